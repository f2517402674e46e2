// The trainer's route store: mrr::AnyRouteStore (memory or a route file, chosen at run time by
// the configuration, so the model is compiled once).
#pragma once

#include <mrr/replay/any_store.hpp>

namespace moe_grpo {

using AnyRouteStore = mrr::AnyRouteStore;

}  // namespace moe_grpo
