// The MoE layer: expert placement, the Expert policy's reference SwiGLU experts, and MoELayer
// (gate -> router through replay -> dispatch -> experts -> combine, forward and backward).
#pragma once

#include <mrr/moe/moe_layer.hpp>
#include <mrr/moe/placement.hpp>
#include <mrr/moe/swiglu_experts.hpp>
