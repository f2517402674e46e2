// Umbrella header: the host-safe public API of mrr. CUDA headers (mrr/cuda/*.cuh) and headers
// with optional dependencies (mrr/replay/config_yaml.hpp needs yaml-cpp, mrr/reward/http*.hpp
// need cpp-httplib) are included explicitly. xxHash headers are required (route files, reward
// tie-break hashing).
#pragma once

#include <mrr/comm/single_process.hpp>
#include <mrr/concepts.hpp>
#include <mrr/cpu/backend.hpp>
#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>
#include <mrr/moe.hpp>
#include <mrr/ppo.hpp>
#include <mrr/replay.hpp>
#include <mrr/reward.hpp>
#include <mrr/rollout.hpp>
#include <mrr/router.hpp>
#include <mrr/tensor.hpp>
