// The MoE layer: expert placement, the Expert policy's reference SwiGLU experts, and MoELayer
// (gate -> router through replay -> dispatch -> experts -> combine, forward and backward), with
// the CPU backend's router (TopKRouter, which router_for_t<CpuBackend, T> names), so this header
// alone composes a layer.
#pragma once

#include <mrr/moe/moe_layer.hpp>
#include <mrr/moe/placement.hpp>
#include <mrr/moe/swiglu_experts.hpp>
#include <mrr/router/topk_router.hpp>
