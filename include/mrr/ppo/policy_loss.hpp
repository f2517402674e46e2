// Policy-gradient losses with verl's names (vanilla PPO with asymmetric and dual clip, gspo,
// sapo, gpg, geo_mean, cispo, dppo_tv, dppo_kl, dro), their metrics under verl's metric names,
// and the analytic gradient of the loss w.r.t. the current log-probabilities.
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>
#include <mrr/ppo/aggregate.hpp>
#include <mrr/ppo/detail/validate.hpp>
#include <mrr/ppo/masked.hpp>
#include <mrr/ppo/optional_view.hpp>
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

enum class PolicyLossKind { vanilla, gspo, sapo, gpg, geo_mean, cispo, dppo_tv, dppo_kl, dro };

inline PolicyLossKind parse_policy_loss(std::string_view name) {
  if (name == "vanilla") return PolicyLossKind::vanilla;
  if (name == "gspo") return PolicyLossKind::gspo;
  if (name == "sapo") return PolicyLossKind::sapo;
  if (name == "gpg") return PolicyLossKind::gpg;
  if (name == "geo_mean") return PolicyLossKind::geo_mean;
  if (name == "cispo") return PolicyLossKind::cispo;
  if (name == "dppo_tv") return PolicyLossKind::dppo_tv;
  if (name == "dppo_kl") return PolicyLossKind::dppo_kl;
  if (name == "dro") return PolicyLossKind::dro;
  if (name == "clip_cov" || name == "kl_cov" || name == "bypass_mode")
    mrr::detail::throw_invalid_argument("ppo::parse_policy_loss", "policy loss '", name,
                                        "' exists in verl but is not implemented by mrr; implemented: vanilla, gspo, "
                                        "sapo, gpg, geo_mean, cispo, dppo_tv, dppo_kl, dro");
  mrr::detail::throw_invalid_argument("ppo::parse_policy_loss", "unknown policy loss '", name,
                                      "'; expected vanilla, gspo, sapo, gpg, geo_mean, cispo, dppo_tv, dppo_kl or dro");
}

inline std::string_view to_string(PolicyLossKind kind) {
  switch (kind) {
    case PolicyLossKind::vanilla:
      return "vanilla";
    case PolicyLossKind::gspo:
      return "gspo";
    case PolicyLossKind::sapo:
      return "sapo";
    case PolicyLossKind::gpg:
      return "gpg";
    case PolicyLossKind::geo_mean:
      return "geo_mean";
    case PolicyLossKind::cispo:
      return "cispo";
    case PolicyLossKind::dppo_tv:
      return "dppo_tv";
    case PolicyLossKind::dppo_kl:
      return "dppo_kl";
    case PolicyLossKind::dro:
      return "dro";
  }
  return "?";
}

// The actor settings the losses read, with verl's ActorConfig defaults. For dppo_* the clip
// ratios are divergence thresholds and clip_ratio_c truncates the importance ratio.
struct PolicyLossConfig {
  double clip_ratio = 0.2;
  std::optional<double> clip_ratio_low;   // defaults to clip_ratio
  std::optional<double> clip_ratio_high;  // defaults to clip_ratio
  double clip_ratio_c = 3.0;              // dual-clip bound (vanilla, must be > 1); ratio cap (dppo_*)
  double tau_pos = 1.0;                   // sapo gate temperature for positive advantages
  double tau_neg = 1.05;                  // sapo gate temperature for other advantages
  std::optional<double> dro_beta;         // dro quadratic penalty; required (> 0) by dro
  GlobalBatchInfo global_batch_info;

  double low() const { return clip_ratio_low.value_or(clip_ratio); }
  double high() const { return clip_ratio_high.value_or(clip_ratio); }
};

template <class T>
struct PolicyLossResult {
  T loss = 0;
  RowMatrix<T> grad_log_prob;  // d loss / d log_prob
  // verl's metrics under verl's keys ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"),
  // exactly the keys verl reports for this loss.
  std::map<std::string, T, std::less<>> metrics;

  std::optional<T> metric(std::string_view name) const {
    const auto it = metrics.find(name);
    return it == metrics.end() ? std::nullopt : std::optional<T>(it->second);
  }
};

namespace detail {

inline constexpr double kLogRatioBound = 20.0;       // verl clamps log(pi/pi_old) to +-20 before exp
inline constexpr double kGspoLogRatioMax = 10.0;     // gspo clamps the sequence log-ratio from above
inline constexpr double kBinaryKlEpsilon = 1e-8;     // dppo_kl: log((1 - p_old + eps) / (1 - p + eps))
inline constexpr double kGeoMeanLogEpsilon = 1e-10;  // geo_mean: log(w + eps) of rollout weights

// Per-token quantities a loss produces before weighting and aggregation.
template <class T>
struct TokenTerms {
  T loss;            // per-token loss
  T grad;            // d loss / d log_prob at this token
  T clipfrac;        // indicator for actor/pg_clipfrac
  T clipfrac_lower;  // indicator for actor/pg_clipfrac_lower
  T neg_kl;          // term of actor/ppo_kl (old - new log-prob, clamped where verl clamps)
};

enum class MetricSet { clip_and_kl, kl_only, none };

// torch.maximum/minimum split the gradient evenly on ties; replicate it so the analytic
// gradient is the one autograd gives.
template <class T>
struct ValueGrad {
  T value;
  T grad;
};

template <class T>
ValueGrad<T> maximum(ValueGrad<T> a, ValueGrad<T> b) {
  if (a.value > b.value) return a;
  if (a.value < b.value) return b;
  return {a.value, T(0.5) * (a.grad + b.grad)};
}

template <class T>
ValueGrad<T> minimum(ValueGrad<T> a, ValueGrad<T> b) {
  if (a.value < b.value) return a;
  if (a.value > b.value) return b;
  return {a.value, T(0.5) * (a.grad + b.grad)};
}

// torch.clamp passes the gradient on the closed interval.
template <class T>
ValueGrad<T> clamp(ValueGrad<T> x, T lo, T hi) {
  if (x.value < lo) return {lo, T(0)};
  if (x.value > hi) return {hi, T(0)};
  return x;
}

// exp(clamp(log_prob - old_log_prob, -20, 20)) and its derivative w.r.t. log_prob.
template <class T>
ValueGrad<T> clamped_ratio(T log_prob, T old_log_prob) {
  const T bound = T(kLogRatioBound);
  const auto log_ratio = clamp<T>({log_prob - old_log_prob, T(1)}, -bound, bound);
  const T ratio = std::exp(log_ratio.value);
  return {ratio, ratio * log_ratio.grad};
}

template <class T>
void check_policy_inputs(std::string_view function, const MatrixRef<T>& old_log_prob, const MatrixRef<T>& log_prob,
                         const MatrixRef<T>& advantages, const MatrixRef<T>& response_mask,
                         const OptionalMatrixView<T>& rollout_is_weights) {
  require_nonempty(function, "log_prob", log_prob);
  require_same_shape(function, "log_prob", log_prob, "old_log_prob", old_log_prob);
  require_same_shape(function, "log_prob", log_prob, "advantages", advantages);
  require_same_shape(function, "log_prob", log_prob, "response_mask", response_mask);
  require_mask(function, "response_mask", response_mask);
  require_finite_where(function, "log_prob", log_prob, response_mask);
  require_finite_where(function, "old_log_prob", old_log_prob, response_mask);
  require_finite_where(function, "advantages", advantages, response_mask);
  if (rollout_is_weights) {
    const auto weights = rollout_is_weights.map();
    require_same_shape(function, "log_prob", log_prob, "rollout_is_weights", weights);
    require_finite_where(function, "rollout_is_weights", weights, response_mask);
    for (Eigen::Index i = 0; i < log_prob.rows(); ++i)
      for (Eigen::Index j = 0; j < log_prob.cols(); ++j)
        mrr::detail::require(response_mask(i, j) == T(0) || weights(i, j) >= T(0), function,
                             "'rollout_is_weights' has a negative weight ", static_cast<double>(weights(i, j)), " at [",
                             i, ", ", j, "]");
  }
}

// Shared tail of every token-level loss: weights by the rollout IS weights, aggregates with
// loss_agg_mode, forms the gradient through the aggregation and the metrics as masked means.
template <class T, class Kernel>
PolicyLossResult<T> token_policy_loss(std::string_view function, const MatrixRef<T>& old_log_prob,
                                      const MatrixRef<T>& log_prob, const MatrixRef<T>& advantages,
                                      const MatrixRef<T>& response_mask, LossAggMode loss_agg_mode,
                                      const GlobalBatchInfo& info, const OptionalMatrixView<T>& rollout_is_weights,
                                      MetricSet metric_set, Kernel&& kernel) {
  const Eigen::Index rows = log_prob.rows(), cols = log_prob.cols();
  RowMatrix<T> token_loss(rows, cols), token_grad(rows, cols);
  T clip_sum = 0, lower_sum = 0, kl_sum = 0;
  const bool weighted = rollout_is_weights.has_value();
  const auto weights = rollout_is_weights.map();
  for (Eigen::Index i = 0; i < rows; ++i)
    for (Eigen::Index j = 0; j < cols; ++j) {
      const TokenTerms<T> terms = kernel(i, j, log_prob(i, j), old_log_prob(i, j), advantages(i, j));
      const T weight = weighted ? weights(i, j) : T(1);
      token_loss(i, j) = terms.loss * weight;
      token_grad(i, j) = terms.grad * weight;
      const T m = response_mask(i, j);
      if (m != T(0)) {
        clip_sum += terms.clipfrac * m;
        lower_sum += terms.clipfrac_lower * m;
        kl_sum += terms.neg_kl * m;
      }
    }
  const Vector<T> row_weights = aggregation_row_weights<T>(response_mask, loss_agg_mode, info, function);
  PolicyLossResult<T> out;
  out.loss = aggregate_with<T>(token_loss, response_mask, loss_agg_mode, info, row_weights);
  out.grad_log_prob.resize(rows, cols);
  for (Eigen::Index i = 0; i < rows; ++i)
    for (Eigen::Index j = 0; j < cols; ++j) {
      const T m = response_mask(i, j);
      out.grad_log_prob(i, j) = m != T(0) ? row_weights[i] * m * token_grad(i, j) : T(0);
    }
  const T denominator = response_mask.sum() + T(kMaskCountEpsilon);
  if (metric_set == MetricSet::clip_and_kl) {
    out.metrics["actor/pg_clipfrac"] = clip_sum / denominator;
    out.metrics["actor/pg_clipfrac_lower"] = lower_sum / denominator;
  }
  if (metric_set != MetricSet::none) out.metrics["actor/ppo_kl"] = kl_sum / denominator;
  return out;
}

}  // namespace detail

// PPO clipped objective (verl "vanilla"): max(-A r, -A clip(r, 1 - low, 1 + high)) and, for
// A < 0, the dual clip min(., -A clip_ratio_c). r = exp(clamp(log_prob - old_log_prob, +-20)).
template <class T>
PolicyLossResult<T> compute_policy_loss_vanilla(MatrixRef<T> old_log_prob, MatrixRef<T> log_prob,
                                                MatrixRef<T> advantages, MatrixRef<T> response_mask,
                                                LossAggMode loss_agg_mode = LossAggMode::token_mean,
                                                const PolicyLossConfig& config = {},
                                                OptionalMatrixView<T> rollout_is_weights = {}) {
  constexpr std::string_view fn = "ppo::compute_policy_loss_vanilla";
  detail::check_policy_inputs<T>(fn, old_log_prob, log_prob, advantages, response_mask, rollout_is_weights);
  mrr::detail::require(config.clip_ratio_c > 1.0, fn, "'clip_ratio_c' (dual-clip lower bound) must be > 1, got ",
                       config.clip_ratio_c);
  const T lo = static_cast<T>(1.0 - config.low()), hi = static_cast<T>(1.0 + config.high());
  const T c = static_cast<T>(config.clip_ratio_c);
  return detail::token_policy_loss<T>(fn, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
                                      config.global_batch_info, rollout_is_weights, detail::MetricSet::clip_and_kl,
                                      [&](Eigen::Index, Eigen::Index, T lp, T old, T a) -> detail::TokenTerms<T> {
                                        const auto ratio = detail::clamped_ratio(lp, old);
                                        const detail::ValueGrad<T> loss1{-a * ratio.value, -a * ratio.grad};
                                        const auto clipped = detail::clamp(ratio, lo, hi);
                                        const detail::ValueGrad<T> loss2{-a * clipped.value, -a * clipped.grad};
                                        const auto clip1 = detail::maximum(loss1, loss2);
                                        const detail::ValueGrad<T> loss3{-a * c, T(0)};
                                        const auto clip2 = detail::minimum(loss3, clip1);
                                        const auto chosen = a < T(0) ? clip2 : clip1;
                                        const T neg_kl = -std::clamp(lp - old, T(-detail::kLogRatioBound),
                                                                     T(detail::kLogRatioBound));
                                        return {chosen.value, chosen.grad, T(loss2.value > loss1.value ? 1 : 0),
                                                T(clip1.value > loss3.value && a < T(0) ? 1 : 0), neg_kl};
                                      });
}

// GSPO (arXiv 2507.18071): the sequence-level ratio exp(mean masked log-ratio) carried to each
// token with the token's own gradient (log s_it = sg[log s_i] + log p - sg[log p]), clamped
// above at 10, then PPO-clipped. verl always aggregates it with seq-mean-token-mean, whatever
// loss_agg_mode says; so does this function.
template <class T>
PolicyLossResult<T> compute_policy_loss_gspo(
    MatrixRef<T> old_log_prob, MatrixRef<T> log_prob, MatrixRef<T> advantages, MatrixRef<T> response_mask,
    [[maybe_unused]] LossAggMode loss_agg_mode = LossAggMode::seq_mean_token_mean, const PolicyLossConfig& config = {},
    OptionalMatrixView<T> rollout_is_weights = {}) {
  constexpr std::string_view fn = "ppo::compute_policy_loss_gspo";
  detail::check_policy_inputs<T>(fn, old_log_prob, log_prob, advantages, response_mask, rollout_is_weights);
  const T lo = static_cast<T>(1.0 - config.low()), hi = static_cast<T>(1.0 + config.high());
  Vector<T> sequence_log_ratio(log_prob.rows());
  for (Eigen::Index i = 0; i < log_prob.rows(); ++i) {
    T sum = 0, length = 0;
    for (Eigen::Index j = 0; j < log_prob.cols(); ++j) {
      const T m = response_mask(i, j);
      length += m;
      if (m != T(0)) sum += (log_prob(i, j) - old_log_prob(i, j)) * m;
    }
    sequence_log_ratio[i] = sum / std::max(length, T(1));
  }
  return detail::token_policy_loss<T>(
      fn, old_log_prob, log_prob, advantages, response_mask, LossAggMode::seq_mean_token_mean, config.global_batch_info,
      rollout_is_weights, detail::MetricSet::clip_and_kl,
      [&](Eigen::Index i, Eigen::Index, T lp, T old, T a) -> detail::TokenTerms<T> {
        const T log_ratio = sequence_log_ratio[i];
        const T capped = std::min(log_ratio, T(detail::kGspoLogRatioMax));
        const T ratio = std::exp(capped);
        const detail::ValueGrad<T> r{ratio, log_ratio <= T(detail::kGspoLogRatioMax) ? ratio : T(0)};
        const detail::ValueGrad<T> loss1{-a * r.value, -a * r.grad};
        const auto clipped = detail::clamp(r, lo, hi);
        const detail::ValueGrad<T> loss2{-a * clipped.value, -a * clipped.grad};
        const auto chosen = detail::maximum(loss1, loss2);
        return {chosen.value, chosen.grad, T(loss2.value > loss1.value ? 1 : 0), T(0), old - lp};
      });
}

// SAPO (arXiv 2511.20347): a smooth gate sigmoid(tau (r - 1)) * 4 / tau replaces the clip, with
// tau_pos for positive advantages and tau_neg otherwise. Aggregated with seq-mean-token-mean as
// verl does regardless of loss_agg_mode.
template <class T>
PolicyLossResult<T> compute_policy_loss_sapo(
    MatrixRef<T> old_log_prob, MatrixRef<T> log_prob, MatrixRef<T> advantages, MatrixRef<T> response_mask,
    [[maybe_unused]] LossAggMode loss_agg_mode = LossAggMode::seq_mean_token_mean, const PolicyLossConfig& config = {},
    OptionalMatrixView<T> rollout_is_weights = {}) {
  constexpr std::string_view fn = "ppo::compute_policy_loss_sapo";
  detail::check_policy_inputs<T>(fn, old_log_prob, log_prob, advantages, response_mask, rollout_is_weights);
  mrr::detail::require(config.tau_pos != 0 && config.tau_neg != 0, fn, "'tau_pos' and 'tau_neg' must be non-zero, got ",
                       config.tau_pos, " and ", config.tau_neg);
  const T tau_pos = static_cast<T>(config.tau_pos), tau_neg = static_cast<T>(config.tau_neg);
  return detail::token_policy_loss<T>(
      fn, old_log_prob, log_prob, advantages, response_mask, LossAggMode::seq_mean_token_mean, config.global_batch_info,
      rollout_is_weights, detail::MetricSet::clip_and_kl,
      [&](Eigen::Index, Eigen::Index, T lp, T old, T a) -> detail::TokenTerms<T> {
        const auto ratio = detail::clamped_ratio(lp, old);
        const T tau = a > T(0) ? tau_pos : tau_neg;
        const T sigmoid = T(1) / (T(1) + std::exp(-(tau * (ratio.value - T(1)))));
        // verl's 4.0 / tau is tau.reciprocal() * 4 (Tensor.__rtruediv__); scaling by 4 is exact, so
        // it equals the quotient bit for bit (docs/ppo.md, "gpg arithmetic").
        const T gate = sigmoid * (T(4) / tau);
        // d gate / d r = 4 sigmoid (1 - sigmoid): the tau of the argument cancels the 1/tau.
        const T gate_grad = T(4) * sigmoid * (T(1) - sigmoid) * ratio.grad;
        const T neg_kl = -std::clamp(lp - old, T(-detail::kLogRatioBound), T(detail::kLogRatioBound));
        return {-gate * a, -a * gate_grad, T(0), T(0), neg_kl};
      });
}

// GPG: plain policy gradient -A log p. verl reports no metric for it.
template <class T>
PolicyLossResult<T> compute_policy_loss_gpg(MatrixRef<T> old_log_prob, MatrixRef<T> log_prob, MatrixRef<T> advantages,
                                            MatrixRef<T> response_mask,
                                            LossAggMode loss_agg_mode = LossAggMode::token_mean,
                                            const PolicyLossConfig& config = {},
                                            OptionalMatrixView<T> rollout_is_weights = {}) {
  constexpr std::string_view fn = "ppo::compute_policy_loss_gpg";
  detail::check_policy_inputs<T>(fn, old_log_prob, log_prob, advantages, response_mask, rollout_is_weights);
  return detail::token_policy_loss<T>(fn, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
                                      config.global_batch_info, rollout_is_weights, detail::MetricSet::none,
                                      [&](Eigen::Index, Eigen::Index, T lp, T, T a) -> detail::TokenTerms<T> {
                                        return {-lp * a, -a, T(0), T(0), T(0)};
                                      });
}

// CISPO (arXiv 2506.13585): -sg(clip(r, 1 - low, 1 + high)) A log p; the gradient flows through
// log p only.
template <class T>
PolicyLossResult<T> compute_policy_loss_cispo(MatrixRef<T> old_log_prob, MatrixRef<T> log_prob, MatrixRef<T> advantages,
                                              MatrixRef<T> response_mask,
                                              LossAggMode loss_agg_mode = LossAggMode::token_mean,
                                              const PolicyLossConfig& config = {},
                                              OptionalMatrixView<T> rollout_is_weights = {}) {
  constexpr std::string_view fn = "ppo::compute_policy_loss_cispo";
  detail::check_policy_inputs<T>(fn, old_log_prob, log_prob, advantages, response_mask, rollout_is_weights);
  const T lo = static_cast<T>(1.0 - config.low()), hi = static_cast<T>(1.0 + config.high());
  return detail::token_policy_loss<T>(
      fn, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config.global_batch_info,
      rollout_is_weights, detail::MetricSet::clip_and_kl,
      [&](Eigen::Index, Eigen::Index, T lp, T old, T a) -> detail::TokenTerms<T> {
        const T log_ratio = std::clamp(lp - old, T(-detail::kLogRatioBound), T(detail::kLogRatioBound));
        const T ratio = std::exp(log_ratio);
        const T clipped = std::clamp(ratio, lo, hi);
        return {-clipped * a * lp, -clipped * a, T(ratio != clipped ? 1 : 0), T(0), -log_ratio};
      });
}

namespace detail {

// DPPO-Binary (arXiv 2602.04879): -A sg(min(r, clip_ratio_c)) log p on tokens whose divergence
// passes the trust-region test `valid(p, p_old, A)`; other tokens get no gradient.
template <class T, class Valid>
PolicyLossResult<T> dppo_loss(std::string_view fn, const MatrixRef<T>& old_log_prob, const MatrixRef<T>& log_prob,
                              const MatrixRef<T>& advantages, const MatrixRef<T>& response_mask,
                              LossAggMode loss_agg_mode, const PolicyLossConfig& config,
                              const OptionalMatrixView<T>& rollout_is_weights, Valid&& valid) {
  check_policy_inputs<T>(fn, old_log_prob, log_prob, advantages, response_mask, rollout_is_weights);
  const T cap = static_cast<T>(config.clip_ratio_c);
  return token_policy_loss<T>(fn, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
                              config.global_batch_info, rollout_is_weights, MetricSet::clip_and_kl,
                              [&](Eigen::Index, Eigen::Index, T lp, T old, T a) -> TokenTerms<T> {
                                const T log_ratio = std::clamp(lp - old, T(-kLogRatioBound), T(kLogRatioBound));
                                const T ratio = std::exp(log_ratio);
                                const T truncated = std::min(ratio, cap);
                                const T keep = valid(std::exp(lp), std::exp(old), lp, old, a) ? T(1) : T(0);
                                return {-a * truncated * lp * keep, -a * truncated * keep, T(1) - keep,
                                        T(ratio > cap ? 1 : 0) * keep, -log_ratio};
                              });
}

}  // namespace detail

// verl "dppo_tv": a token is kept when the probability moved by at most clip_ratio_high upwards
// (A > 0) or clip_ratio_low downwards (A <= 0).
template <class T>
PolicyLossResult<T> compute_policy_loss_dppo_tv(MatrixRef<T> old_log_prob, MatrixRef<T> log_prob,
                                                MatrixRef<T> advantages, MatrixRef<T> response_mask,
                                                LossAggMode loss_agg_mode = LossAggMode::token_mean,
                                                const PolicyLossConfig& config = {},
                                                OptionalMatrixView<T> rollout_is_weights = {}) {
  const T low = static_cast<T>(config.low()), high = static_cast<T>(config.high());
  return detail::dppo_loss<T>("ppo::compute_policy_loss_dppo_tv", old_log_prob, log_prob, advantages, response_mask,
                              loss_agg_mode, config, rollout_is_weights, [&](T p, T p_old, T, T, T a) {
                                return a > T(0) ? (p - p_old) <= high : (p - p_old) >= -low;
                              });
}

// verl "dppo_kl": a token is kept when the binary KL between Bernoulli(p_old) and Bernoulli(p)
// is within clip_ratio_high (A > 0) or clip_ratio_low (A <= 0), or when p moved the safe way.
template <class T>
PolicyLossResult<T> compute_policy_loss_dppo_kl(MatrixRef<T> old_log_prob, MatrixRef<T> log_prob,
                                                MatrixRef<T> advantages, MatrixRef<T> response_mask,
                                                LossAggMode loss_agg_mode = LossAggMode::token_mean,
                                                const PolicyLossConfig& config = {},
                                                OptionalMatrixView<T> rollout_is_weights = {}) {
  const T low = static_cast<T>(config.low()), high = static_cast<T>(config.high());
  return detail::dppo_loss<T>("ppo::compute_policy_loss_dppo_kl", old_log_prob, log_prob, advantages, response_mask,
                              loss_agg_mode, config, rollout_is_weights, [&](T p, T p_old, T lp, T old, T a) {
                                const T eps = T(detail::kBinaryKlEpsilon);
                                const T binary_kl = p_old * (old - lp) +
                                                    (T(1) - p_old) * std::log((T(1) - p_old + eps) / (T(1) - p + eps));
                                return a > T(0) ? (binary_kl <= high || p <= p_old) : (binary_kl <= low || p >= p_old);
                              });
}

// verl "dro": -(A log p - beta/2 (log p - log p_old)^2); reports actor/ppo_kl only.
template <class T>
PolicyLossResult<T> compute_policy_loss_dro(MatrixRef<T> old_log_prob, MatrixRef<T> log_prob, MatrixRef<T> advantages,
                                            MatrixRef<T> response_mask,
                                            LossAggMode loss_agg_mode = LossAggMode::token_mean,
                                            const PolicyLossConfig& config = {},
                                            OptionalMatrixView<T> rollout_is_weights = {}) {
  constexpr std::string_view fn = "ppo::compute_policy_loss_dro";
  detail::check_policy_inputs<T>(fn, old_log_prob, log_prob, advantages, response_mask, rollout_is_weights);
  mrr::detail::require(config.dro_beta.has_value() && *config.dro_beta > 0 && std::isfinite(*config.dro_beta), fn,
                       "'dro_beta' must be set to a positive value for dro, got ",
                       config.dro_beta ? std::to_string(*config.dro_beta) : std::string("none"));
  const T beta = static_cast<T>(*config.dro_beta);
  return detail::token_policy_loss<T>(
      fn, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config.global_batch_info,
      rollout_is_weights, detail::MetricSet::kl_only,
      [&](Eigen::Index, Eigen::Index, T lp, T old, T a) -> detail::TokenTerms<T> {
        const T log_ratio = lp - old;
        return {-(lp * a - T(0.5) * beta * (log_ratio * log_ratio)), -(a - beta * log_ratio), T(0), T(0), -log_ratio};
      });
}

// GMPO (verl "geo_mean", arXiv 2507.20673): the per-sequence geometric mean of token ratios, each
// log-ratio clipped to [-low, high] on the side the advantage sign makes pessimistic, times the
// sequence's mean advantage; the loss is the plain mean over sequences (loss_agg_mode and the
// global batch info are ignored, as in verl). Rollout IS weights enter as their per-sequence
// geometric mean.
template <class T>
PolicyLossResult<T> compute_policy_loss_geo_mean(MatrixRef<T> old_log_prob, MatrixRef<T> log_prob,
                                                 MatrixRef<T> advantages, MatrixRef<T> response_mask,
                                                 [[maybe_unused]] LossAggMode loss_agg_mode = LossAggMode::token_mean,
                                                 const PolicyLossConfig& config = {},
                                                 OptionalMatrixView<T> rollout_is_weights = {}) {
  constexpr std::string_view fn = "ppo::compute_policy_loss_geo_mean";
  detail::check_policy_inputs<T>(fn, old_log_prob, log_prob, advantages, response_mask, rollout_is_weights);
  const T low = static_cast<T>(config.low()), high = static_cast<T>(config.high());
  const Eigen::Index rows = log_prob.rows(), cols = log_prob.cols();
  const T eps = T(detail::kMaskCountEpsilon);
  PolicyLossResult<T> out;
  out.grad_log_prob = RowMatrix<T>::Zero(rows, cols);
  RowMatrix<T> clipped_grad(rows, cols);  // d (clipped log-ratio) / d log_prob
  T loss_sum = 0, clip_high = 0, clip_low = 0, kl_sum = 0;
  const auto weights = rollout_is_weights.map();
  for (Eigen::Index i = 0; i < rows; ++i) {
    T length = 0, log_ratio_sum = 0, advantage_sum = 0, log_weight_sum = 0;
    for (Eigen::Index j = 0; j < cols; ++j) {
      const T m = response_mask(i, j);
      length += m;
      if (m == T(0)) {
        clipped_grad(i, j) = T(0);
        continue;
      }
      const T a = advantages(i, j);
      const T log_ratio = log_prob(i, j) - old_log_prob(i, j);
      const T sign = a > T(0) ? T(1) : (a < T(0) ? T(-1) : T(0));
      const auto clamped = detail::clamp<T>({log_ratio, T(1)}, -low, high);
      // sign * min(sign * x, sign * clamp(x)): the pessimistic of the raw and the clipped ratio.
      const auto pessimistic =
          detail::minimum<T>({sign * log_ratio, sign}, {sign * clamped.value, sign * clamped.grad});
      log_ratio_sum += sign * pessimistic.value * m;
      clipped_grad(i, j) = sign * pessimistic.grad;
      advantage_sum += a * m;
      if (rollout_is_weights) log_weight_sum += std::log(weights(i, j) + T(detail::kGeoMeanLogEpsilon)) * m;
      const bool clipped = log_ratio != clamped.value;
      clip_high += T(clipped && a > T(0) ? 1 : 0) * m;
      clip_low += T(clipped && a < T(0) ? 1 : 0) * m;
      kl_sum += -log_ratio * m;
    }
    const T ratio = std::exp(log_ratio_sum / (length + eps));
    const T advantage = advantage_sum / (length + eps);
    const T weight = rollout_is_weights ? std::exp(log_weight_sum / (length + eps)) : T(1);
    loss_sum += -advantage * ratio * weight;
    // d loss_i / d log_prob_ij = -advantage * weight * ratio * m_ij / (length + eps) * d clipped_ij.
    const T row_scale = -advantage * weight * ratio / (length + eps) / static_cast<T>(static_cast<double>(rows));
    for (Eigen::Index j = 0; j < cols; ++j) {
      const T m = response_mask(i, j);
      if (m != T(0)) out.grad_log_prob(i, j) = row_scale * m * clipped_grad(i, j);
    }
  }
  out.loss = loss_sum / static_cast<T>(static_cast<double>(rows));
  const T denominator = response_mask.sum() + eps;
  out.metrics["actor/pg_clipfrac"] = clip_high / denominator;
  out.metrics["actor/pg_clipfrac_lower"] = clip_low / denominator;
  out.metrics["actor/ppo_kl"] = kl_sum / denominator;
  return out;
}

// Dispatch by kind (verl's get_policy_loss_fn).
template <class T>
PolicyLossResult<T> compute_policy_loss(PolicyLossKind kind, MatrixRef<T> old_log_prob, MatrixRef<T> log_prob,
                                        MatrixRef<T> advantages, MatrixRef<T> response_mask, LossAggMode loss_agg_mode,
                                        const PolicyLossConfig& config = {},
                                        OptionalMatrixView<T> rollout_is_weights = {}) {
  switch (kind) {
    case PolicyLossKind::vanilla:
      return compute_policy_loss_vanilla<T>(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                                            rollout_is_weights);
    case PolicyLossKind::gspo:
      return compute_policy_loss_gspo<T>(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                                         rollout_is_weights);
    case PolicyLossKind::sapo:
      return compute_policy_loss_sapo<T>(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                                         rollout_is_weights);
    case PolicyLossKind::gpg:
      return compute_policy_loss_gpg<T>(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                                        rollout_is_weights);
    case PolicyLossKind::geo_mean:
      return compute_policy_loss_geo_mean<T>(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                                             rollout_is_weights);
    case PolicyLossKind::cispo:
      return compute_policy_loss_cispo<T>(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                                          rollout_is_weights);
    case PolicyLossKind::dppo_tv:
      return compute_policy_loss_dppo_tv<T>(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                                            rollout_is_weights);
    case PolicyLossKind::dppo_kl:
      return compute_policy_loss_dppo_kl<T>(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                                            rollout_is_weights);
    case PolicyLossKind::dro:
      return compute_policy_loss_dro<T>(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                                        rollout_is_weights);
  }
  mrr::detail::throw_invalid_argument("ppo::compute_policy_loss", "invalid PolicyLossKind ", static_cast<int>(kind));
}

// Dispatch by verl's name ("vanilla", "gspo", ...); unknown names throw with the list of known ones.
template <class T>
PolicyLossResult<T> compute_policy_loss(std::string_view name, MatrixRef<T> old_log_prob, MatrixRef<T> log_prob,
                                        MatrixRef<T> advantages, MatrixRef<T> response_mask,
                                        std::string_view loss_agg_mode, const PolicyLossConfig& config = {},
                                        OptionalMatrixView<T> rollout_is_weights = {}) {
  return compute_policy_loss<T>(parse_policy_loss(name), old_log_prob, log_prob, advantages, response_mask,
                                parse_loss_agg_mode(loss_agg_mode), config, rollout_is_weights);
}

}  // namespace ppo
MRR_NAMESPACE_END
