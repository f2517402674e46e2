// Policy-gradient losses with verl's names (vanilla PPO with asymmetric and dual clip, gspo,
// sapo, gpg, geo_mean, cispo, dppo_tv, dppo_kl, dro, kl_cov, clip_cov, bypass_mode, and the
// REINFORCE loss bypass_mode runs), their metrics under
// verl's metric names, and the analytic gradient of the loss w.r.t. the current log-probabilities.
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/detail/counter_rng.hpp>
#include <mrr/detail/parallel.hpp>
#include <mrr/error.hpp>
#include <mrr/kernels/ppo/advantage.hpp>
#include <mrr/kernels/ppo/policy_loss.hpp>
#include <mrr/ppo/aggregate.hpp>
#include <mrr/ppo/detail/validate.hpp>
#include <mrr/ppo/masked.hpp>
#include <mrr/ppo/optional_view.hpp>
#include <mrr/ppo/rollout_rejection.hpp>
#include <mrr/tensor.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

MRR_NAMESPACE_BEGIN
namespace ppo {

enum class PolicyLossKind {
  vanilla,
  gspo,
  sapo,
  gpg,
  geo_mean,
  cispo,
  dppo_tv,
  dppo_kl,
  dro,
  kl_cov,
  clip_cov,
  bypass_mode
};

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
  if (name == "kl_cov") return PolicyLossKind::kl_cov;
  if (name == "clip_cov") return PolicyLossKind::clip_cov;
  if (name == "bypass_mode") return PolicyLossKind::bypass_mode;
  mrr::detail::throw_invalid_argument(
      "ppo::parse_policy_loss", "unknown policy loss '", name,
      "'; expected vanilla, gspo, sapo, gpg, geo_mean, cispo, dppo_tv, dppo_kl, dro, kl_cov, clip_cov or bypass_mode");
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
    case PolicyLossKind::kl_cov:
      return "kl_cov";
    case PolicyLossKind::clip_cov:
      return "clip_cov";
    case PolicyLossKind::bypass_mode:
      return "bypass_mode";
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
  double kl_cov_ratio = 0.0002;           // kl_cov: share of valid tokens that get the KL penalty, (0, 1]
  double ppo_kl_coef = 1.0;               // kl_cov: coefficient of |log p - log p_old| on those tokens
  double clip_cov_ratio = 0.0002;         // clip_cov: at most this share of valid tokens is dropped, (0, 1]
  double clip_cov_lb = 1.0;               // clip_cov: drop candidates have a covariance in (lb, ub)
  double clip_cov_ub = 5.0;
  std::uint64_t clip_cov_seed = 0;  // clip_cov: picks among the candidates; vary it per micro-batch
  // bypass_mode: verl's policy_loss.rollout_correction (loss type, IS weights, rejection); required.
  std::optional<RolloutCorrectionConfig> rollout_correction;
  GlobalBatchInfo global_batch_info;

  double low() const { return clip_ratio_low.value_or(clip_ratio); }
  double high() const { return clip_ratio_high.value_or(clip_ratio); }

  // The ranges of the kl_cov / clip_cov settings; `function` names the caller in the error.
  void check_kl_cov(std::string_view function) const {
    mrr::detail::require(kl_cov_ratio > 0 && kl_cov_ratio <= 1, function,
                         "'kl_cov_ratio' (the share of valid tokens to penalise) must be in (0, 1], got ",
                         kl_cov_ratio);
    mrr::detail::require(std::isfinite(ppo_kl_coef), function, "'ppo_kl_coef' must be finite, got ", ppo_kl_coef);
  }
  void check_clip_cov(std::string_view function) const {
    mrr::detail::require(clip_cov_ratio > 0 && clip_cov_ratio <= 1, function,
                         "'clip_cov_ratio' (the most of the valid tokens to drop) must be in (0, 1], got ",
                         clip_cov_ratio);
    mrr::detail::require(clip_cov_lb < clip_cov_ub, function, "'clip_cov_lb' (", clip_cov_lb,
                         ") must be below 'clip_cov_ub' (", clip_cov_ub, ")");
  }
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

// The per-token math lives in kernels/ppo/policy_loss.hpp; these names keep the host's spelling.
using kernels::ppo::clamp;
using kernels::ppo::clamped_ratio;
using kernels::ppo::kBinaryKlEpsilon;
using kernels::ppo::kGeoMeanLogEpsilon;
using kernels::ppo::kGspoLogRatioMax;
using kernels::ppo::kLogRatioBound;
using kernels::ppo::maximum;
using kernels::ppo::minimum;
using kernels::ppo::TokenTerms;
using kernels::ppo::ValueGrad;

enum class MetricSet { clip_and_kl, clip_without_lower_and_kl, kl_only, none };

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
      out.grad_log_prob(i, j) = kernels::ppo::aggregated_grad(token_grad(i, j), response_mask(i, j), row_weights[i]);
    }
  const T denominator = response_mask.sum() + T(kMaskCountEpsilon);
  if (metric_set == MetricSet::clip_and_kl || metric_set == MetricSet::clip_without_lower_and_kl)
    out.metrics["actor/pg_clipfrac"] = clip_sum / denominator;
  if (metric_set == MetricSet::clip_and_kl) out.metrics["actor/pg_clipfrac_lower"] = lower_sum / denominator;
  if (metric_set != MetricSet::none) out.metrics["actor/ppo_kl"] = kl_sum / denominator;
  return out;
}

}  // namespace detail

namespace detail {

// Per-row partial sums of a fused loss pass, reduced serially in row order afterwards (so the
// result does not depend on the thread count).
template <class T>
struct RowPartials {
  Vector<T> tokens, bad_mask, loss, clip, lower, kl, probe;

  void resize(Eigen::Index rows) {
    for (Vector<T>* v : {&tokens, &bad_mask, &loss, &clip, &lower, &kl, &probe})
      v->resize(rows);
  }
};

// The host's vectorised specialisation of kernels::ppo::vanilla_row (whose per-token math,
// vanilla_token, the Thrust path runs): the same choices and ties; the ratio is Eigen's packet exp
// (within 1 ulp of std::exp) and the row sums are Eigen's chunked reductions, so values may differ
// from the kernel's in the last bits (tests/device/test_ppo_executors.cpp states by how much).
// One row of verl's vanilla PPO loss, value and gradient, chunk by chunk in L1 buffers. All
// arithmetic is Eigen array expressions (vectorised, exp included); the comparisons are small
// loops that only turn them into 0/1 indicators, which GCC vectorises (Eigen 3.4 does not
// vectorise comparisons or select, and a single loop mixing both is not vectorised under GCC's
// default -ftrapping-math). The multi-way choices of torch.maximum / minimum's gradients (split
// evenly on ties) are sums of terms times indicators of which exactly one is 1: exact for the
// finite values of valid tokens. Masked tokens may hold anything; the last loop drops them.
// Writes the final gradient (times the row's aggregation weight; zero where masked) and the row's
// masked sums of loss, clip indicators and -log-ratio, plus a probe that is NaN when an input is
// not finite on a valid token. Mask values are 0 or 1 (checked), so m x = x on valid tokens.
template <class T, bool Weighted>
void vanilla_row(const T* lp, const T* old, const T* adv, const T* mask, const T* is_weight, T row_weight, T* grad,
                 Eigen::Index n, T lo, T hi, T dual_clip, T* sums) {
  using Array = Eigen::Array<T, Eigen::Dynamic, 1>;
  using Map = Eigen::Map<Array, Eigen::Aligned16>;
  using ConstMap = Eigen::Map<const Array>;
  constexpr Eigen::Index kLen = 256;
  const T bound = T(kLogRatioBound);
  alignas(64) T clamped_b[kLen], ratio_b[kLen], clipped_b[kLen], value_b[kLen], grad_b[kLen];
  alignas(64) T pass_b[kLen], unclipped_b[kLen], larger_b[kLen], smaller_b[kLen], dual_below_b[kLen],
      dual_above_b[kLen], negative_b[kLen];
  alignas(64) T loss_b[kLen], clip_b[kLen], lower_b[kLen], kl_b[kLen], probe_b[kLen], valid_b[kLen];
  T loss_sum = 0, clip_sum = 0, lower_sum = 0, kl_sum = 0, probe_sum = 0;
  for (Eigen::Index j0 = 0; j0 < n; j0 += kLen) {
    const Eigen::Index m = std::min(kLen, n - j0);
    const T* l = lp + j0;
    const T* o = old + j0;
    const T* av = adv + j0;
    const T* mk = mask + j0;
    const ConstMap a(av, m);
    Map clamped(clamped_b, m), ratio(ratio_b, m), clipped(clipped_b, m);
    clamped = (ConstMap(l, m) - ConstMap(o, m)).max(-bound).min(bound);
    ratio = clamped.exp();
    clipped = ratio.max(lo).min(hi);
    for (Eigen::Index j = 0; j < m; ++j) {
      const T log_ratio = l[j] - o[j], r = ratio_b[j];
      const T loss1 = -av[j] * r, loss2 = -av[j] * clipped_b[j], loss3 = -av[j] * dual_clip;
      // The clamp passes the gradient on its closed interval; so does the clip of the ratio.
      pass_b[j] = clamped_b[j] == log_ratio ? T(1) : T(0);
      unclipped_b[j] = clamped_b[j] == log_ratio && clipped_b[j] == r ? T(1) : T(0);
      larger_b[j] = loss1 > loss2 ? T(1) : T(0);
      smaller_b[j] = loss1 < loss2 ? T(1) : T(0);
      // loss3 against max(loss1, loss2).
      dual_below_b[j] = loss3 < loss1 || loss3 < loss2 ? T(1) : T(0);
      dual_above_b[j] = loss3 > loss1 && loss3 > loss2 ? T(1) : T(0);
      negative_b[j] = av[j] < T(0) ? T(1) : T(0);
      valid_b[j] = mk[j] != T(0) ? T(1) : T(0);
    }
    const Map pass(pass_b, m), unclipped(unclipped_b, m), larger(larger_b, m), smaller(smaller_b, m),
        dual_below(dual_below_b, m), dual_above(dual_above_b, m), negative(negative_b, m);
    // Values: clip1 = max(loss1, loss2); clip2 = min(loss3, clip1); A < 0 takes clip2.
    const auto clip1 = (-a * ratio).max(-a * clipped);
    const auto clip2 = (-a * dual_clip).min(clip1);
    Map value(value_b, m), g(grad_b, m);
    value = negative * clip2 + (T(1) - negative) * clip1;
    // Gradients, times the row weight (verl's (w m) g with m = 1): d loss1 = -a r; d loss2 = the
    // same where the clip passes it; each tie takes half of the sum.
    const auto grad1 = (row_weight * T(1)) * (-a * ratio);
    const auto clipped_only = pass - unclipped;
    const auto clip1_g = larger * (pass * grad1) + smaller * (unclipped * grad1) +
                         (T(1) - larger - smaller) * (unclipped * grad1 + clipped_only * (T(0.5) * grad1));
    g = clip1_g;  // evaluated once, reused below
    const auto dual_tied = T(1) - dual_above - dual_below;
    g = negative * (dual_above * g + dual_tied * (T(0.5) * g)) + (T(1) - negative) * g;
    if constexpr (Weighted) {  // verl weights the per-token loss: (w m) (g is_w)
      const ConstMap w(is_weight + j0, m);
      value = value * w;
      g = g * w;
    }
    // The finiteness probe, x - x: 0 for finite x, NaN for NaN or inf (into a buffer that is free
    // by now; inside the loop below GCC would sink it under the select and stop vectorising).
    Map(unclipped_b, m) = (ConstMap(l, m) - ConstMap(l, m)) + (ConstMap(o, m) - ConstMap(o, m)) + (a - a);
    Map(pass_b, m) = negative * dual_below;  // the lower-clip indicator (both 0/1)
    // The masking selects: plain loads only (GCC sinks any arithmetic used under a ternary into a
    // branch, where it may trap, and then does not vectorise the loop).
    for (Eigen::Index j = 0; j < m; ++j) {
      const T valid = valid_b[j], g_j = grad_b[j], value_j = value_b[j], smaller_j = smaller_b[j];
      const T lower_j = pass_b[j], clamped_j = clamped_b[j], probe_j = unclipped_b[j];
      larger_b[j] = valid != T(0) ? g_j : T(0);
      loss_b[j] = valid != T(0) ? value_j : T(0);
      clip_b[j] = valid != T(0) ? smaller_j : T(0);
      lower_b[j] = valid != T(0) ? lower_j : T(0);
      kl_b[j] = valid != T(0) ? clamped_j : T(0);  // negated in the sum below
      probe_b[j] = valid != T(0) ? probe_j : T(0);
    }
    Eigen::Map<Array>(grad + j0, m) = ConstMap(larger_b, m);
    loss_sum += ConstMap(loss_b, m).sum();
    clip_sum += ConstMap(clip_b, m).sum();
    lower_sum += ConstMap(lower_b, m).sum();
    kl_sum -= ConstMap(kl_b, m).sum();
    probe_sum += ConstMap(probe_b, m).sum();
  }
  sums[0] = loss_sum;
  sums[1] = clip_sum;
  sums[2] = lower_sum;
  sums[3] = kl_sum;
  sums[4] = probe_sum;
}

}  // namespace detail

// PPO clipped objective (verl "vanilla"): max(-A r, -A clip(r, 1 - low, 1 + high)) and, for
// A < 0, the dual clip min(., -A clip_ratio_c). r = exp(clamp(log_prob - old_log_prob, +-20)).
// The `_into` form writes into `out`, reusing its gradient matrix when the shape matches (no
// allocation in a training loop). Two passes: a read of the mask (0/1 check and token counts, for
// the aggregation weights), then one fused pass over the inputs that writes the final gradient.
// Row tiles run in parallel under OpenMP; per-row sums are reduced in row order.
template <class T>
void compute_policy_loss_vanilla_into(PolicyLossResult<T>& out, MatrixRef<T> old_log_prob, MatrixRef<T> log_prob,
                                      MatrixRef<T> advantages, MatrixRef<T> response_mask,
                                      LossAggMode loss_agg_mode = LossAggMode::token_mean,
                                      const PolicyLossConfig& config = {},
                                      OptionalMatrixView<T> rollout_is_weights = {}) {
  constexpr std::string_view fn = "ppo::compute_policy_loss_vanilla";
  detail::require_nonempty(fn, "log_prob", log_prob);
  detail::require_same_shape(fn, "log_prob", log_prob, "old_log_prob", old_log_prob);
  detail::require_same_shape(fn, "log_prob", log_prob, "advantages", advantages);
  detail::require_same_shape(fn, "log_prob", log_prob, "response_mask", response_mask);
  mrr::detail::require(config.clip_ratio_c > 1.0, fn, "'clip_ratio_c' (dual-clip lower bound) must be > 1, got ",
                       config.clip_ratio_c);
  const Eigen::Index rows = log_prob.rows(), cols = log_prob.cols();
  out.grad_log_prob.resize(rows, cols);
  mrr::detail::require(!detail::shares_memory(out.grad_log_prob, log_prob) &&
                           !detail::shares_memory(out.grad_log_prob, old_log_prob) &&
                           !detail::shares_memory(out.grad_log_prob, advantages) &&
                           !detail::shares_memory(out.grad_log_prob, response_mask),
                       fn, "'out.grad_log_prob' shares memory with an input; pass a separate result");
  // The full (slow, scalar) checks run only when the fused passes find something wrong, so the
  // error is the same as theirs: the mask first, then non-finite values in argument order.
  const auto full_check = [&] {
    detail::check_policy_inputs<T>(fn, old_log_prob, log_prob, advantages, response_mask, rollout_is_weights);
  };
  const bool weighted = rollout_is_weights.has_value();
  if (weighted) full_check();  // shapes, finiteness and signs of the weights
  const auto weights = rollout_is_weights.map();
  const T lo = static_cast<T>(1.0 - config.low()), hi = static_cast<T>(1.0 + config.high());
  const T dual_clip = static_cast<T>(config.clip_ratio_c);

  // Reused across calls (no allocation in steady state). A named reference, because a lambda
  // that names a thread_local directly would see each worker thread's own instance.
  thread_local detail::RowPartials<T> partials_storage;
  detail::RowPartials<T>& partials = partials_storage;
  partials.resize(rows);
  const Eigen::Index tile = detail::row_tile(cols);
  mrr::detail::parallel_tiles(rows, tile, rows * cols, [&](std::int64_t, std::int64_t begin, std::int64_t end) {
    for (Eigen::Index i = begin; i < end; ++i) {
      const auto m = response_mask.row(i).array();
      partials.tokens[i] = m.sum();
      partials.bad_mask[i] = (m * (m - T(1))).abs().sum();
    }
  });
  if (!(partials.bad_mask.array() == T(0)).all()) [[unlikely]]
    full_check();
  double total_tokens = 0;
  for (Eigen::Index i = 0; i < rows; ++i)
    total_tokens += static_cast<double>(partials.tokens[i]);
  const Vector<T> row_weights = detail::aggregation_row_weights_from_counts<T>(
      partials.tokens, total_tokens, cols, loss_agg_mode, config.global_batch_info, fn);

  mrr::detail::parallel_tiles(rows, tile, rows * cols * 32, [&](std::int64_t, std::int64_t begin, std::int64_t end) {
    for (Eigen::Index i = begin; i < end; ++i) {
      T sums[5];
      const auto run = [&](auto weighted_tag) {
        detail::vanilla_row<T, decltype(weighted_tag)::value>(
            log_prob.data() + i * log_prob.outerStride(), old_log_prob.data() + i * old_log_prob.outerStride(),
            advantages.data() + i * advantages.outerStride(), response_mask.data() + i * response_mask.outerStride(),
            weighted ? weights.data() + i * weights.outerStride() : nullptr, row_weights[i],
            out.grad_log_prob.data() + i * cols, cols, lo, hi, dual_clip, sums);
      };
      if (weighted)
        run(std::true_type{});
      else
        run(std::false_type{});
      partials.loss[i] = sums[0];
      partials.clip[i] = sums[1];
      partials.lower[i] = sums[2];
      partials.kl[i] = sums[3];
      partials.probe[i] = sums[4];
    }
  });
  if (!(partials.probe.sum() == T(0))) [[unlikely]] {
    full_check();
    mrr::detail::throw_invalid_argument(fn, "an input is not finite on a valid token");
  }
  T clip_sum = 0, lower_sum = 0, kl_sum = 0;
  for (Eigen::Index i = 0; i < rows; ++i) {
    clip_sum += partials.clip[i];
    lower_sum += partials.lower[i];
    kl_sum += partials.kl[i];
  }
  out.loss = detail::aggregate_row_sums<T>(partials.loss.data(), 1, row_weights, loss_agg_mode, config.global_batch_info);
  const T denominator = static_cast<T>(total_tokens) + T(detail::kMaskCountEpsilon);
  if (out.metrics.size() != 3) out.metrics.clear();
  out.metrics["actor/pg_clipfrac"] = clip_sum / denominator;
  out.metrics["actor/pg_clipfrac_lower"] = lower_sum / denominator;
  out.metrics["actor/ppo_kl"] = kl_sum / denominator;
}

template <class T>
PolicyLossResult<T> compute_policy_loss_vanilla(MatrixRef<T> old_log_prob, MatrixRef<T> log_prob,
                                                MatrixRef<T> advantages, MatrixRef<T> response_mask,
                                                LossAggMode loss_agg_mode = LossAggMode::token_mean,
                                                const PolicyLossConfig& config = {},
                                                OptionalMatrixView<T> rollout_is_weights = {}) {
  PolicyLossResult<T> out;
  compute_policy_loss_vanilla_into<T>(out, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                                      rollout_is_weights);
  return out;
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
      [&](Eigen::Index i, Eigen::Index, T lp, T old, T a) {
        return kernels::ppo::gspo_token(sequence_log_ratio[i], lp, old, a, lo, hi);
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
      [&](Eigen::Index, Eigen::Index, T lp, T old, T a) {
        return kernels::ppo::sapo_token(lp, old, a, tau_pos, tau_neg);
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
                                      [](Eigen::Index, Eigen::Index, T lp, T, T a) {
                                        return kernels::ppo::gpg_token(lp, a);
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
      [&](Eigen::Index, Eigen::Index, T lp, T old, T a) {
        return kernels::ppo::cispo_token(lp, old, a, lo, hi);
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
                              [&](Eigen::Index, Eigen::Index, T lp, T old, T a) {
                                using std::exp;
                                const bool keep = valid(exp(lp), exp(old), lp, old, a);
                                return kernels::ppo::dppo_token(lp, old, a, cap, keep);
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
                                return kernels::ppo::dppo_tv_keeps(p, p_old, a, low, high);
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
                                return kernels::ppo::dppo_kl_keeps(p, p_old, lp, old, a, low, high);
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
      [&](Eigen::Index, Eigen::Index, T lp, T old, T a) { return kernels::ppo::dro_token(lp, old, a, beta); });
}

namespace detail {

// kl_cov's choice of tokens, as verl makes it: over the valid tokens (mask > 0) in row-major order,
// cov = (A - mean A) (log p - mean log p) with torch.mean's summation order; the
// max(1, int(n kl_cov_ratio)) largest covariances are selected (none when no token is valid).
// torch.topk leaves the choice among covariances tied at the k-th value to its selection
// algorithm; mrr takes the lowest flat index (deterministic for any thread count or build).
template <class T>
std::vector<std::uint8_t> kl_cov_selection(const MatrixRef<T>& log_prob, const MatrixRef<T>& advantages,
                                           const MatrixRef<T>& response_mask, double kl_cov_ratio) {
  const Eigen::Index rows = log_prob.rows(), cols = log_prob.cols();
  std::vector<std::uint8_t> selected(static_cast<std::size_t>(rows * cols), 0);
  std::vector<long> valid;
  std::vector<T> adv, lp;
  for (Eigen::Index i = 0; i < rows; ++i)
    for (Eigen::Index j = 0; j < cols; ++j)
      if (response_mask(i, j) > T(0)) {
        valid.push_back(static_cast<long>(i * cols + j));
        adv.push_back(advantages(i, j));
        lp.push_back(log_prob(i, j));
      }
  const long n = static_cast<long>(valid.size());
  if (n == 0) return selected;
  std::vector<long> order(static_cast<std::size_t>(n));
  for (long t = 0; t < n; ++t)
    order[static_cast<std::size_t>(t)] = t;
  const T mean_adv = kernels::ppo::group_mean(adv.data(), order.data(), n);
  const T mean_lp = kernels::ppo::group_mean(lp.data(), order.data(), n);
  std::vector<T> cov(static_cast<std::size_t>(n));
  for (long t = 0; t < n; ++t) {
    const auto u = static_cast<std::size_t>(t);
    cov[u] = (adv[u] - mean_adv) * (lp[u] - mean_lp);
  }
  const long k = std::max(1L, static_cast<long>(static_cast<double>(n) * kl_cov_ratio));
  // torch.topk(largest=True) ranks NaN above every number.
  const auto before = [&](long x, long y) {
    const T a = cov[static_cast<std::size_t>(x)], b = cov[static_cast<std::size_t>(y)];
    const bool a_nan = a != a, b_nan = b != b;
    if (a_nan != b_nan) return a_nan;
    if (!a_nan && a != b) return a > b;
    return x < y;
  };
  std::nth_element(order.begin(), order.begin() + (k - 1), order.end(), before);
  for (long t = 0; t < k; ++t)
    selected[static_cast<std::size_t>(valid[static_cast<std::size_t>(order[static_cast<std::size_t>(t)])])] = 1;
  return selected;
}

}  // namespace detail

// verl "kl_cov" (Cui et al. 2025, the entropy mechanism of RL for reasoning models): the
// unclipped -A r, r = exp(log p - log p_old), with ppo_kl_coef |log p - log p_old| added on the
// max(1, int(n kl_cov_ratio)) valid tokens whose advantage and log-probability covary most (see
// detail::kl_cov_selection). Reports actor/ppo_kl = masked mean of |log p - log p_old|, as verl.
template <class T>
PolicyLossResult<T> compute_policy_loss_kl_cov(MatrixRef<T> old_log_prob, MatrixRef<T> log_prob,
                                               MatrixRef<T> advantages, MatrixRef<T> response_mask,
                                               LossAggMode loss_agg_mode = LossAggMode::token_mean,
                                               const PolicyLossConfig& config = {},
                                               OptionalMatrixView<T> rollout_is_weights = {}) {
  constexpr std::string_view fn = "ppo::compute_policy_loss_kl_cov";
  detail::check_policy_inputs<T>(fn, old_log_prob, log_prob, advantages, response_mask, rollout_is_weights);
  config.check_kl_cov(fn);
  const std::vector<std::uint8_t> selected =
      detail::kl_cov_selection<T>(log_prob, advantages, response_mask, config.kl_cov_ratio);
  const T coef = static_cast<T>(config.ppo_kl_coef);
  const Eigen::Index cols = log_prob.cols();
  return detail::token_policy_loss<T>(
      fn, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config.global_batch_info,
      rollout_is_weights, detail::MetricSet::kl_only, [&](Eigen::Index i, Eigen::Index j, T lp, T old, T a) {
        return kernels::ppo::kl_cov_token(lp, old, a, selected[static_cast<std::size_t>(i * cols + j)] != 0, coef);
      });
}

namespace detail {

// clip_cov's dropped tokens. verl's candidates are the valid tokens the PPO clip leaves alone
// (-A clip(r) <= -A r) whose covariance (A - masked mean A)(log p - masked mean log p) lies in
// (clip_cov_lb, clip_cov_ub); it drops max(1, int(clip_cov_ratio x valid tokens)) of them, chosen
// by torch.randperm from torch's global generator. mrr chooses them with a keyed hash instead: the
// candidates with the smallest CounterRng::bits(seed, flat index, 0), a uniformly random subset for
// a random seed and the same subset for the same seed, thread count and build. When there are no
// more candidates than that number, every candidate is dropped, in verl as here.
template <class T>
std::vector<std::uint8_t> clip_cov_selection(const MatrixRef<T>& old_log_prob, const MatrixRef<T>& log_prob,
                                             const MatrixRef<T>& advantages, const MatrixRef<T>& response_mask, T lo,
                                             T hi, const PolicyLossConfig& config) {
  using std::exp;
  const Eigen::Index rows = log_prob.rows(), cols = log_prob.cols();
  std::vector<std::uint8_t> dropped(static_cast<std::size_t>(rows * cols), 0);
  const T mean_adv = masked_mean<T>(advantages, response_mask);
  const T mean_lp = masked_mean<T>(log_prob, response_mask);
  const T lb = static_cast<T>(config.clip_cov_lb), ub = static_cast<T>(config.clip_cov_ub);
  std::vector<std::pair<std::uint64_t, long>> candidates;  // (key, flat index)
  T tokens = 0;
  for (Eigen::Index i = 0; i < rows; ++i)
    for (Eigen::Index j = 0; j < cols; ++j) {
      if (!(response_mask(i, j) > T(0))) continue;
      tokens += response_mask(i, j);
      const T a = advantages(i, j), ratio = exp(log_prob(i, j) - old_log_prob(i, j));
      if (-a * kernels::ppo::clamp(ratio, lo, hi) > -a * ratio) continue;  // clipped by PPO already
      const T cov = (a - mean_adv) * (log_prob(i, j) - mean_lp);
      if (!(cov > lb && cov < ub)) continue;
      const auto flat = static_cast<long>(i * cols + j);
      candidates.emplace_back(mrr::detail::CounterRng::bits(config.clip_cov_seed, static_cast<std::uint64_t>(flat), 0),
                              flat);
    }
  const auto count =
      static_cast<std::size_t>(std::max(1L, static_cast<long>(config.clip_cov_ratio * static_cast<double>(tokens))));
  if (candidates.size() > count)
    std::nth_element(candidates.begin(), candidates.begin() + static_cast<std::ptrdiff_t>(count - 1), candidates.end());
  for (std::size_t c = 0; c < std::min(count, candidates.size()); ++c)
    dropped[static_cast<std::size_t>(candidates[c].second)] = 1;
  return dropped;
}

}  // namespace detail

// verl "clip_cov" (Cui et al. 2025, as kl_cov): PPO's max(-A r, -A clip(r, 1 - low, 1 + high)),
// r = exp(log p - log p_old) (unclamped, no dual clip), with the loss and gradient of up to
// max(1, int(clip_cov_ratio x valid tokens)) tokens set to 0: tokens the clip leaves alone whose
// covariance of advantage and log-probability lies in (clip_cov_lb, clip_cov_ub), picked by
// clip_cov_seed where there are more (detail::clip_cov_selection). Metrics: actor/pg_clipfrac (the
// dropped share of valid tokens) and actor/ppo_kl, as verl.
template <class T>
PolicyLossResult<T> compute_policy_loss_clip_cov(MatrixRef<T> old_log_prob, MatrixRef<T> log_prob,
                                                 MatrixRef<T> advantages, MatrixRef<T> response_mask,
                                                 LossAggMode loss_agg_mode = LossAggMode::token_mean,
                                                 const PolicyLossConfig& config = {},
                                                 OptionalMatrixView<T> rollout_is_weights = {}) {
  constexpr std::string_view fn = "ppo::compute_policy_loss_clip_cov";
  detail::check_policy_inputs<T>(fn, old_log_prob, log_prob, advantages, response_mask, rollout_is_weights);
  config.check_clip_cov(fn);
  const T lo = static_cast<T>(1.0 - config.low()), hi = static_cast<T>(1.0 + config.high());
  const std::vector<std::uint8_t> dropped =
      detail::clip_cov_selection<T>(old_log_prob, log_prob, advantages, response_mask, lo, hi, config);
  const Eigen::Index cols = log_prob.cols();
  return detail::token_policy_loss<T>(
      fn, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config.global_batch_info,
      rollout_is_weights, detail::MetricSet::clip_without_lower_and_kl,
      [&](Eigen::Index i, Eigen::Index j, T lp, T old, T a) {
        return kernels::ppo::clip_cov_token(lp, old, a, lo, hi, dropped[static_cast<std::size_t>(i * cols + j)] != 0);
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

// REINFORCE with optional IS correction (verl compute_policy_loss_reinforce, which bypass_mode
// runs): -A log p, times the rollout IS weights when given; no clipping. Reports actor/ppo_kl, the
// masked mean of rollout - current log-prob. The weights carry no gradient.
template <class T>
PolicyLossResult<T> compute_policy_loss_reinforce(MatrixRef<T> rollout_log_prob, MatrixRef<T> log_prob,
                                                  MatrixRef<T> advantages, MatrixRef<T> response_mask,
                                                  LossAggMode loss_agg_mode = LossAggMode::seq_mean_token_sum,
                                                  const PolicyLossConfig& config = {},
                                                  OptionalMatrixView<T> rollout_is_weights = {}) {
  constexpr std::string_view fn = "ppo::compute_policy_loss_reinforce";
  detail::check_policy_inputs<T>(fn, rollout_log_prob, log_prob, advantages, response_mask, rollout_is_weights);
  return detail::token_policy_loss<T>(
      fn, rollout_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config.global_batch_info,
      rollout_is_weights, detail::MetricSet::kl_only,
      [](Eigen::Index, Eigen::Index, T lp, T rollout, T a) { return kernels::ppo::reinforce_token(lp, rollout, a); });
}

// verl's "bypass_mode": the trainer skips the old-log-prob pass and passes the rollout engine's
// log-probabilities as old_log_prob. From them and the current log_prob it computes the rollout
// correction of config.rollout_correction (IS weights pi / pi_rollout when `is` is set, rejection
// when `rs` is set; both without gradient), then, on the tokens rejection keeps:
//  - loss_type ppo_clip: PPO's clipped loss (compute_policy_loss_vanilla) against the rollout's
//    log-probs, without IS weights (its ratio is that weight already);
//  - loss_type reinforce: compute_policy_loss_reinforce with the IS weights.
// Metrics: the loss's and every rollout_corr/ metric (compute_rollout_correction_and_rejection_mask
// with the current policy as the training one). It computes its own IS weights: passing
// rollout_is_weights is refused (verl ignores them).
template <class T>
PolicyLossResult<T> compute_policy_loss_bypass_mode(MatrixRef<T> old_log_prob, MatrixRef<T> log_prob,
                                                    MatrixRef<T> advantages, MatrixRef<T> response_mask,
                                                    LossAggMode loss_agg_mode = LossAggMode::token_mean,
                                                    const PolicyLossConfig& config = {},
                                                    OptionalMatrixView<T> rollout_is_weights = {}) {
  constexpr std::string_view fn = "ppo::compute_policy_loss_bypass_mode";
  mrr::detail::require(config.rollout_correction.has_value(), fn,
                       "bypass_mode needs PolicyLossConfig::rollout_correction (verl: "
                       "policy_loss.rollout_correction) to say its loss type, IS weights and rejection");
  mrr::detail::require(!rollout_is_weights.has_value(), fn,
                       "bypass_mode computes its IS weights from log_prob and old_log_prob (the rollout's); "
                       "'rollout_is_weights' must not be given");
  detail::check_policy_inputs<T>(fn, old_log_prob, log_prob, advantages, response_mask, rollout_is_weights);
  const auto& rc = *config.rollout_correction;
  auto correction = compute_rollout_correction_and_rejection_mask<T>(log_prob, old_log_prob, response_mask, rc);
  PolicyLossResult<T> out;
  if (rc.loss_type == BypassLossType::reinforce) {
    OptionalMatrixView<T> weights;
    if (correction.weights) weights = *correction.weights;
    out = compute_policy_loss_reinforce<T>(old_log_prob, log_prob, advantages, correction.response_mask, loss_agg_mode,
                                           config, weights);
  } else {
    out = compute_policy_loss_vanilla<T>(old_log_prob, log_prob, advantages, correction.response_mask, loss_agg_mode,
                                         config);
  }
  out.metrics.merge(correction.metrics);
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
    case PolicyLossKind::kl_cov:
      return compute_policy_loss_kl_cov<T>(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                                           rollout_is_weights);
    case PolicyLossKind::clip_cov:
      return compute_policy_loss_clip_cov<T>(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                                             rollout_is_weights);
    case PolicyLossKind::bypass_mode:
      return compute_policy_loss_bypass_mode<T>(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
                                                config, rollout_is_weights);
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
