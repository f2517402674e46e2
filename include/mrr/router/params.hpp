// A RouterConfig resolved to the plain values the router kernels read (mrr/kernels/router.hpp).
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/kernels/router.hpp>
#include <mrr/router/config.hpp>

MRR_NAMESPACE_BEGIN

inline kernels::RouterParams resolve_router_params(const RouterConfig& c) {
  kernels::RouterParams p;
  p.num_experts = c.num_experts;
  p.topk = c.topk;
  p.score = c.score_function == ScoreFunction::softmax
                ? kernels::score_softmax
                : (c.score_function == ScoreFunction::sigmoid ? kernels::score_sigmoid : kernels::score_sqrt_softplus);
  p.pre_softmax = c.pre_softmax && c.score_function == ScoreFunction::softmax;  // ignored otherwise, as Megatron
  p.normalize = c.normalizes();
  p.grouped = c.grouped();
  p.selects_on_logits = !c.grouped() && !c.use_expert_bias;
  p.zero_masking = c.group_masking == GroupMasking::zero;
  p.num_groups = c.num_groups;
  p.group_topk = c.group_topk;
  p.group_score_topk = c.effective_group_score_topk();
  p.experts_per_group = c.experts_per_group();
  p.has_bias = c.use_expert_bias;
  p.has_scale = c.scaling_factor.has_value();
  p.scale = c.scaling_factor.value_or(1.0);
  p.drops_over_capacity = c.capacity_factor.has_value();
  return p;
}

MRR_NAMESPACE_END
