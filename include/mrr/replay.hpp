// Routing replay: modes and actions, token layouts, route stores (none, memory, file, and
// AnyRouteStore choosing between the last two at run time), the
// replay controller, verl-style configuration and rollout-engine importers.
#pragma once

#include <mrr/replay/config.hpp>
#include <mrr/replay/layout.hpp>
#include <mrr/replay/memory_store.hpp>
#include <mrr/replay/mode.hpp>
#include <mrr/replay/none_store.hpp>
#include <mrr/replay/npy.hpp>
#include <mrr/replay/routing_replay.hpp>
#include <mrr/replay/shape.hpp>
#include <mrr/replay/vllm_import.hpp>
#include <mrr/replay/file_store.hpp>  // needs xxHash (a required dependency; file_format.hpp says so if absent)
#include <mrr/replay/open_store.hpp>
#include <mrr/replay/any_store.hpp>
