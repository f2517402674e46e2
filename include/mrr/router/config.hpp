// Router configuration: score function, top-k flavour, group limits, bias, scaling, capacity and
// auxiliary losses, with the names Megatron-Core and Hugging Face use. validate() rejects
// combinations the reference implementations would silently misbehave on.
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>

#include <cmath>
#include <optional>
#include <string>
#include <string_view>

MRR_NAMESPACE_BEGIN

enum class ScoreFunction { softmax, sigmoid, sqrt_softplus };

// How tokens over an expert's capacity are chosen for dropping (Megatron moe_token_drop_policy).
enum class DropPolicy { probs, position };

// What the experts of non-selected groups score in group-limited routing: Megatron masks them
// with -inf; Hugging Face DeepSeek-V3 fills 0.0 (they can still win when kept scores are < 0).
enum class GroupMasking { neg_inf, zero };

inline std::string_view to_string(ScoreFunction f) {
  switch (f) {
    case ScoreFunction::softmax: return "softmax";
    case ScoreFunction::sigmoid: return "sigmoid";
    case ScoreFunction::sqrt_softplus: return "sqrtsoftplus";
  }
  return "?";
}

inline std::string_view to_string(DropPolicy p) { return p == DropPolicy::probs ? "probs" : "position"; }

inline ScoreFunction parse_score_function(std::string_view name) {
  if (name == "softmax") return ScoreFunction::softmax;
  if (name == "sigmoid") return ScoreFunction::sigmoid;
  if (name == "sqrtsoftplus" || name == "sqrt_softplus") return ScoreFunction::sqrt_softplus;
  detail::throw_invalid_argument("parse_score_function", "unknown score function '", name,
                                 "' (expected softmax, sigmoid or sqrtsoftplus)");
}

inline DropPolicy parse_drop_policy(std::string_view name) {
  if (name == "probs") return DropPolicy::probs;
  if (name == "position") return DropPolicy::position;
  detail::throw_invalid_argument("parse_drop_policy", "unknown drop policy '", name, "' (expected probs or position)");
}

struct RouterConfig {
  int num_experts = 0;
  int topk = 0;
  ScoreFunction score_function = ScoreFunction::softmax;

  // softmax only: true = softmax over all experts, then top-k (Megatron moe_router_pre_softmax,
  // HF Mixtral/Qwen); false = top-k on logits, then softmax over the k (Megatron's default).
  // Ignored by sigmoid and sqrt-softplus, as by Megatron-Core (DeepSeek-V3 recipes set it there).
  bool pre_softmax = false;
  // Divide the k weights by their sum (+1e-20): HF norm_topk_prob. Unset means Megatron's rule:
  // sigmoid and sqrt-softplus weights are normalised when k > 1, softmax ones never (post-softmax
  // weights sum to one already).
  std::optional<bool> normalize_topk;

  // Group-limited routing (DeepSeek device/node-limited): experts split into num_groups equal
  // groups, the group_topk best groups kept. A group scores the sum of its best
  // group_score_topk experts; 0 means topk / group_topk (Megatron), HF DeepSeek-V3 uses 2.
  int num_groups = 0;
  int group_topk = 0;
  int group_score_topk = 0;
  GroupMasking group_masking = GroupMasking::neg_inf;

  // Expert bias added to sigmoid / sqrt-softplus scores for selection only (aux-loss-free
  // balancing); the weights never see it. Updated with the sign rule at the given rate.
  bool use_expert_bias = false;
  double expert_bias_update_rate = 1e-3;

  // Multiplies the final weights (Megatron moe_router_topk_scaling_factor, HF routed_scaling_factor).
  std::optional<double> scaling_factor;

  // Token dropping: capacity = ceil(tokens * topk / num_experts * capacity_factor).
  std::optional<double> capacity_factor;
  DropPolicy drop_policy = DropPolicy::probs;
  bool pad_to_capacity = false;

  // Auxiliary losses (0 = off): switch load balancing, sequence-level load balancing, z-loss.
  // MoELayer applies aux_loss_coeff and z_loss_coeff (MoEForward::aux_loss, z_loss and their
  // gradient); seq_aux_loss_coeff needs sequence lengths, so MoELayer refuses it (add
  // sequence_aux_loss's gradient to MoEForward::aux_grad_logits). A router alone applies none:
  // its backward is the weights' gradient; call switch_aux_loss / z_loss (router/aux_loss.hpp).
  double aux_loss_coeff = 0.0;
  double seq_aux_loss_coeff = 0.0;
  double z_loss_coeff = 0.0;

  int experts_per_group() const { return grouped() ? num_experts / num_groups : num_experts; }
  int effective_group_score_topk() const {
    return group_score_topk > 0 ? group_score_topk : (group_topk > 0 ? topk / group_topk : 0);
  }
  bool grouped() const { return num_groups > 0 && group_topk > 0; }
  // True when the k weights are divided by their sum.
  bool normalizes() const {
    if (score_function == ScoreFunction::softmax) return pre_softmax && normalize_topk.value_or(false);
    return normalize_topk.value_or(topk > 1);
  }

  void validate() const {
    constexpr std::string_view fn = "RouterConfig::validate";
    detail::require(num_experts > 0, fn, "num_experts must be positive, got ", num_experts);
    detail::require(topk > 0 && topk <= num_experts, fn, "topk must be in [1, num_experts=", num_experts, "], got ",
                    topk);
    detail::require(score_function != ScoreFunction::softmax || pre_softmax || topk > 1, fn,
                    "softmax after a top-1 selection gives every token weight 1 and the gate no gradient: use "
                    "pre_softmax with topk = 1 (Megatron-Core refuses it too)");
    detail::require(num_groups >= 0 && group_topk >= 0 && group_score_topk >= 0, fn,
                    "num_groups, group_topk and group_score_topk must be >= 0");
    // Megatron-Core limits groups only when group_topk is set: num_groups alone routes ungrouped.
    detail::require(group_topk == 0 || num_groups > 0, fn, "group_topk (", group_topk,
                    ") needs num_groups (the number of expert groups)");
    if (grouped()) {
      detail::require(num_experts % num_groups == 0, fn, "num_experts=", num_experts,
                      " is not divisible by num_groups=", num_groups);
      detail::require(group_topk <= num_groups, fn, "group_topk=", group_topk, " exceeds num_groups=", num_groups);
      detail::require(topk <= group_topk * experts_per_group(), fn, "topk=", topk, " exceeds the ",
                      group_topk * experts_per_group(), " experts of the ", group_topk, " selected groups");
      const int m = effective_group_score_topk();
      detail::require(m >= 1 && m <= experts_per_group(), fn, "group score sums the top ", m,
                      " experts of a group, which must be in [1, ", experts_per_group(),
                      "] (set group_score_topk, or topk >= group_topk)");
    } else {
      detail::require(group_score_topk == 0, fn, "group_score_topk is set but group-limited routing is off");
    }
    detail::require(!use_expert_bias || score_function != ScoreFunction::softmax, fn,
                    "expert bias is supported with the sigmoid and sqrtsoftplus score functions only "
                    "(as in Megatron-Core); got softmax");
    detail::require(std::isfinite(expert_bias_update_rate) && expert_bias_update_rate >= 0, fn,
                    "expert_bias_update_rate must be finite and >= 0, got ", expert_bias_update_rate);
    if (scaling_factor)
      detail::require(std::isfinite(*scaling_factor) && *scaling_factor > 0, fn,
                      "scaling_factor must be finite and positive, got ", *scaling_factor);
    if (capacity_factor)
      detail::require(std::isfinite(*capacity_factor) && *capacity_factor > 0, fn,
                      "capacity_factor must be finite and positive, got ", *capacity_factor);
    detail::require(!pad_to_capacity || capacity_factor.has_value(), fn,
                    "pad_to_capacity needs a capacity_factor");
    for (double c : {aux_loss_coeff, seq_aux_loss_coeff, z_loss_coeff})
      detail::require(std::isfinite(c) && c >= 0, fn, "auxiliary loss coefficients must be finite and >= 0, got ", c);
  }
};

MRR_NAMESPACE_END
