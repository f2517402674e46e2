// Host interface of router_views.cu: the device router's view checks on the CUDA system.
#pragma once

#include "../device/router_views.hpp"

namespace mrr::test {

RouterViewReport cuda_router_views(const RouterViewInputs& inputs, long (*count_allocations)());

}  // namespace mrr::test
