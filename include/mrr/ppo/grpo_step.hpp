// The loss side of one GRPO (or any outcome-reward PPO) step, as verl's actor assembles it from
// core_algos: sequence scores -> token-level rewards -> advantages by estimator name; then, per
// update micro-batch, the policy loss by name aggregated with loss_agg_mode, plus kl_loss_coef
// times the aggregated KL to the reference policy (use_kl_loss). Returns the loss, verl's
// metrics and d loss / d log_prob, which the model backpropagates. Plus the diagnostics of the
// training-vs-rollout log-probability mismatch that routing replay is meant to shrink.
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>
#include <mrr/ppo/aggregate.hpp>
#include <mrr/ppo/detail/validate.hpp>
#include <mrr/ppo/groups.hpp>
#include <mrr/ppo/kl.hpp>
#include <mrr/ppo/optional_view.hpp>
#include <mrr/ppo/policy_loss.hpp>
#include <mrr/ppo/registry.hpp>
#include <mrr/tensor.hpp>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>

MRR_NAMESPACE_BEGIN
namespace ppo {

// verl's keys: algorithm.adv_estimator (+ the AlgoConfig fields), actor.policy_loss.loss_mode,
// actor.loss_agg_mode, actor.clip_ratio*, actor.use_kl_loss, actor.kl_loss_coef, actor.kl_loss_type.
struct GrpoStepConfig {
  std::string adv_estimator = "grpo";
  AdvantageConfig advantage;
  std::string policy_loss = "vanilla";
  std::string loss_agg_mode = "token-mean";
  PolicyLossConfig policy;
  bool use_kl_loss = false;
  double kl_loss_coef = 0.001;
  std::string kl_loss_type = "low_var_kl";

  // Parses every name, so a typo fails before the first rollout.
  void validate() const {
    parse_advantage_estimator(adv_estimator);
    const auto loss = parse_policy_loss(policy_loss);
    mrr::detail::require(loss != PolicyLossKind::bypass_mode || policy.rollout_correction.has_value(),
                         "ppo::GrpoStepConfig",
                         "policy_loss 'bypass_mode' needs policy.rollout_correction (its loss type, IS weights and "
                         "rejection)");
    if (policy.rollout_correction && policy.rollout_correction->rs) policy.rollout_correction->rs->validate();
    parse_loss_agg_mode(loss_agg_mode);
    parse_kl_penalty(kl_loss_type);
    mrr::detail::require(std::isfinite(kl_loss_coef) && kl_loss_coef >= 0.0, "ppo::GrpoStepConfig",
                         "kl_loss_coef must be finite and >= 0, got ", kl_loss_coef);
    policy.check_kl_cov("ppo::GrpoStepConfig");
    policy.check_clip_cov("ppo::GrpoStepConfig");
  }
};

// A rule-based reward manager's output: each sequence's score placed on its last valid response
// token (verl's NaiveRewardManager), zeros elsewhere. A row without valid tokens gets nothing.
template <class T>
RowMatrix<T> token_level_rewards(VectorRef<T> scores, MatrixRef<T> response_mask) {
  constexpr std::string_view fn = "ppo::token_level_rewards";
  mrr::detail::require(scores.size() == response_mask.rows(), fn, "'scores' has ", scores.size(), " entries for ",
                       response_mask.rows(), " rows of 'response_mask'");
  RowMatrix<T> out = RowMatrix<T>::Zero(response_mask.rows(), response_mask.cols());
  for (Eigen::Index i = 0; i < response_mask.rows(); ++i) {
    mrr::detail::require(std::isfinite(scores[i]), fn, "score ", i, " is not finite");
    for (Eigen::Index j = response_mask.cols() - 1; j >= 0; --j)
      if (response_mask(i, j) != T(0)) {
        out(i, j) = scores[i];
        break;
      }
  }
  return out;
}

// Advantages of the named estimator from sequence scores (outcome estimators; index: the prompt
// of each response).
template <class T>
AdvantageResult<T> compute_outcome_advantages(VectorRef<T> scores, MatrixRef<T> response_mask, const GroupIndex& index,
                                              const GrpoStepConfig& config) {
  const RowMatrix<T> rewards = token_level_rewards<T>(scores, response_mask);
  return compute_advantage<T>(config.adv_estimator, AdvantageInputs<T>{rewards, response_mask, {}, &index, {}},
                              config.advantage);
}

template <class T>
struct GrpoLossResult {
  T loss = 0;                  // pg_loss + kl_loss_coef * kl_loss
  T pg_loss = 0;
  T kl_loss = 0;               // 0 unless use_kl_loss
  RowMatrix<T> grad_log_prob;  // d loss / d log_prob (zero on masked tokens)
  // verl's keys: actor/pg_loss, actor/pg_clipfrac, actor/ppo_kl, actor/pg_clipfrac_lower (as the
  // policy loss reports them), actor/kl_loss and actor/kl_coef (with use_kl_loss).
  std::map<std::string, T, std::less<>> metrics;

  std::optional<T> metric(std::string_view name) const {
    const auto it = metrics.find(name);
    return it == metrics.end() ? std::nullopt : std::optional<T>(it->second);
  }
};

// The actor loss of one update micro-batch. ref_log_prob is required with use_kl_loss.
template <class T>
GrpoLossResult<T> grpo_loss(MatrixRef<T> old_log_prob, MatrixRef<T> log_prob, MatrixRef<T> advantages,
                            MatrixRef<T> response_mask, OptionalMatrixView<T> ref_log_prob,
                            const GrpoStepConfig& config, OptionalMatrixView<T> rollout_is_weights = {}) {
  constexpr std::string_view fn = "ppo::grpo_loss";
  const LossAggMode agg = parse_loss_agg_mode(config.loss_agg_mode);
  PolicyLossResult<T> pg = compute_policy_loss<T>(parse_policy_loss(config.policy_loss), old_log_prob, log_prob,
                                                  advantages, response_mask, agg, config.policy, rollout_is_weights);
  GrpoLossResult<T> out;
  out.pg_loss = pg.loss;
  out.loss = pg.loss;
  out.grad_log_prob = std::move(pg.grad_log_prob);
  out.metrics.insert(pg.metrics.begin(), pg.metrics.end());
  out.metrics["actor/pg_loss"] = pg.loss;
  if (config.use_kl_loss) {
    mrr::detail::require(ref_log_prob.has_value(), fn, "use_kl_loss needs 'ref_log_prob'");
    const auto ref = ref_log_prob.map();
    detail::require_same_shape(fn, "log_prob", log_prob, "ref_log_prob", ref);
    const KlPenaltyResult<T> kl = kl_penalty<T>(log_prob, ref, parse_kl_penalty(config.kl_loss_type));
    const GlobalBatchInfo& info = config.policy.global_batch_info;
    out.kl_loss = agg_loss<T>(kl.values, response_mask, agg, info);
    const T coef = static_cast<T>(config.kl_loss_coef);
    out.loss = pg.loss + out.kl_loss * coef;
    const RowMatrix<T> agg_grad = agg_loss_grad<T>(response_mask, agg, info);
    out.grad_log_prob.array() += coef * agg_grad.array() * kl.grad_logprob.array();
    out.metrics["actor/kl_loss"] = out.kl_loss;
    out.metrics["actor/kl_coef"] = coef;
  }
  return out;
}

// How far the training engine's log-probabilities are from the rollout engine's on the same
// tokens (the mismatch routing replay removes a cause of), over the tokens whose mask is non-zero
// (each weighted by its mask value):
// - k1 = mean(log p_train - log p_rollout) and k3 = mean of low_var_kl(train || rollout) (verl's KL
//   penalty estimator: exp(log q/p) - log q/p - 1 with log q/p clamped to +-20 and each value to 10),
//   as mrr's diagnostics (mrr/diagnostics.hpp) and the flagship report them;
// - rollout_kl and rollout_k3_kl: verl's rollout-correction metrics "kl" and "k3_kl"
//   (rollout_corr_helper.compute_offpolicy_metrics), the estimators of KL(rollout || train) from the
//   rollout's samples: masked_mean(log p_rollout - log p_train) (= -k1 up to verl's 1e-8 in the
//   denominator) and masked_mean(r - log r - 1) with r = p_train / p_rollout, unclamped (not k3: that
//   one takes the ratio the other way round);
// - the masked max and mean of |log p_train - log p_rollout|.
template <class T>
struct LogProbMismatch {
  T k1 = 0;
  T k3 = 0;
  T rollout_kl = 0;
  T rollout_k3_kl = 0;
  T max_abs_diff = 0;
  T mean_abs_diff = 0;
  T tokens = 0;
};

template <class T>
LogProbMismatch<T> logprob_mismatch(MatrixRef<T> log_prob, MatrixRef<T> rollout_log_prob, MatrixRef<T> response_mask) {
  constexpr std::string_view fn = "ppo::logprob_mismatch";
  detail::require_same_shape(fn, "log_prob", log_prob, "rollout_log_prob", rollout_log_prob);
  detail::require_same_shape(fn, "log_prob", log_prob, "response_mask", response_mask);
  LogProbMismatch<T> out;
  double k1 = 0, k3 = 0, verl_k3 = 0, abs_sum = 0, weight = 0, max_abs = 0;
  for (Eigen::Index i = 0; i < log_prob.rows(); ++i)
    for (Eigen::Index j = 0; j < log_prob.cols(); ++j) {
      const double m = static_cast<double>(response_mask(i, j));
      if (m == 0) continue;
      const auto e = detail::kl_element<T>(log_prob(i, j), rollout_log_prob(i, j), KlEstimator::k3);
      const double d = static_cast<double>(log_prob(i, j)) - static_cast<double>(rollout_log_prob(i, j));
      k1 += m * d;
      k3 += m * static_cast<double>(e.value);
      verl_k3 += m * (std::exp(d) - d - 1.0);
      abs_sum += m * std::abs(d);
      max_abs = std::max(max_abs, std::abs(d));
      weight += m;
    }
  if (weight > 0) {
    out.k1 = static_cast<T>(k1 / weight);
    out.k3 = static_cast<T>(k3 / weight);
    // verl's masked_mean: sum / (mask sum + 1e-8)
    out.rollout_kl = static_cast<T>(-k1 / (weight + 1e-8));
    out.rollout_k3_kl = static_cast<T>(verl_k3 / (weight + 1e-8));
    out.mean_abs_diff = static_cast<T>(abs_sum / weight);
  }
  out.max_abs_diff = static_cast<T>(max_abs);
  out.tokens = static_cast<T>(weight);
  return out;
}

}  // namespace ppo
MRR_NAMESPACE_END
