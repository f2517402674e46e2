// Umbrella header of mrr's core: routers, routing replay (stores, controller, configuration), the
// MoE layer and the single-process communicator. The rest is included on its own, so a trainer
// that routes does not compile what it does not use: mrr/ppo.hpp (PPO/GRPO losses and
// advantages), mrr/reward.hpp (reward dispatch), mrr/rollout.hpp (sampling). CUDA headers
// (mrr/cuda/*.cuh) and headers with optional dependencies (mrr/replay/config_yaml.hpp needs
// yaml-cpp, mrr/reward/http*.hpp need cpp-httplib) are included explicitly too. xxHash headers
// are required (route-file checksums).
#pragma once

#include <mrr/comm/single_process.hpp>
#include <mrr/concepts.hpp>
#include <mrr/cpu/backend.hpp>
#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>
#include <mrr/moe.hpp>
#include <mrr/replay.hpp>
#include <mrr/router.hpp>
#include <mrr/tensor.hpp>
