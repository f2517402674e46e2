// mrr-requires: mrr_thrust_omp
// verl's vanilla PPO policy loss (compute_policy_loss_vanilla: asymmetric clip and dual clip) on a
// Thrust system, with d loss / d log_prob and verl's metrics: the device mirror of
// ppo::compute_policy_loss_vanilla, same config, aggregation modes and global-batch semantics.
// One pass over the tokens (one work item per row: per-token terms, masked row sums, input
// checks), the aggregation's row weights on the host from the per-row counts, one pass scaling
// the gradient. Tensors are row-major [rows, cols] Thrust vectors.
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>
#include <mrr/ppo/aggregate.hpp>
#include <mrr/ppo/policy_loss.hpp>
#include <mrr/thrust/backend.hpp>

#include <thrust/copy.h>
#include <thrust/for_each.h>
#include <thrust/host_vector.h>
#include <thrust/iterator/counting_iterator.h>

#include <cmath>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

MRR_NAMESPACE_BEGIN
namespace device {

template <class T, class Backend = ThrustDeviceBackend>
struct PolicyLossResult {
  T loss = 0;
  typename Backend::template vector<T> grad_log_prob;  // d loss / d log_prob, [rows, cols]
  std::map<std::string, T, std::less<>> metrics;       // verl's keys, as ppo::PolicyLossResult

  std::optional<T> metric(std::string_view name) const {
    const auto it = metrics.find(name);
    return it == metrics.end() ? std::nullopt : std::optional<T>(it->second);
  }
};

namespace kernels {

template <class T>
struct ValueGrad {
  T value, grad;
};

// torch.maximum / minimum split the gradient evenly on ties (what autograd gives).
template <class T>
MRR_HOST_DEVICE inline ValueGrad<T> max_vg(ValueGrad<T> a, ValueGrad<T> b) {
  if (a.value > b.value) return a;
  if (a.value < b.value) return b;
  return {a.value, T(0.5) * (a.grad + b.grad)};
}
template <class T>
MRR_HOST_DEVICE inline ValueGrad<T> min_vg(ValueGrad<T> a, ValueGrad<T> b) {
  if (a.value < b.value) return a;
  if (a.value > b.value) return b;
  return {a.value, T(0.5) * (a.grad + b.grad)};
}
// torch.clamp passes the gradient on the closed interval.
template <class T>
MRR_HOST_DEVICE inline ValueGrad<T> clamp_vg(ValueGrad<T> x, T lo, T hi) {
  if (x.value < lo) return {lo, T(0)};
  if (x.value > hi) return {hi, T(0)};
  return x;
}

template <class T>
MRR_HOST_DEVICE inline bool finite(T x) {
  return x - x == T(0);
}

// Row sums written per row: masked loss sum, mask count, clipfrac, clipfrac_lower, -kl; and
// whether the row's inputs are invalid (a mask value other than 0 / 1, a non-finite input or a
// negative rollout weight at a valid token).
inline constexpr int kPolicySums = 5;

template <class T>
struct VanillaRows {
  const T *old_log_prob, *log_prob, *advantages, *mask, *is_weights;  // is_weights may be null
  T* token_grad;                                                      // [rows, cols] before row weights
  T* sums;                                                            // [rows, kPolicySums]
  std::uint8_t* bad;                                                  // [rows]
  long cols;
  T lo, hi, c, bound;
  MRR_HOST_DEVICE void operator()(long i) const {
    using std::exp;
    T loss_sum = 0, count = 0, clip = 0, lower = 0, neg_kl = 0;
    bool invalid = false;
    for (long at = i * cols; at < (i + 1) * cols; ++at) {
      const T lp = log_prob[at], old = old_log_prob[at], a = advantages[at], m = mask[at];
      const T weight = is_weights ? is_weights[at] : T(1);
      invalid |= m != T(0) && m != T(1);
      if (m != T(0)) invalid |= !finite(lp) || !finite(old) || !finite(a) || !finite(weight) || weight < T(0);
      // ratio = exp(clamp(lp - old, +-20)), d ratio / d lp = ratio inside the clamp, 0 outside.
      const ValueGrad<T> log_ratio = clamp_vg<T>({lp - old, T(1)}, -bound, bound);
      const T r = exp(log_ratio.value);
      const ValueGrad<T> ratio{r, r * log_ratio.grad};
      const ValueGrad<T> loss1{-a * ratio.value, -a * ratio.grad};
      const ValueGrad<T> clipped = clamp_vg(ratio, lo, hi);
      const ValueGrad<T> loss2{-a * clipped.value, -a * clipped.grad};
      const ValueGrad<T> clip1 = max_vg(loss1, loss2);
      const ValueGrad<T> loss3{-a * c, T(0)};
      const ValueGrad<T> clip2 = min_vg(loss3, clip1);
      const ValueGrad<T> chosen = a < T(0) ? clip2 : clip1;
      token_grad[at] = chosen.grad * weight;
      if (m != T(0)) {
        const T d = lp - old;
        loss_sum += chosen.value * weight * m;
        count += m;
        clip += T(loss2.value > loss1.value ? 1 : 0) * m;
        lower += T(clip1.value > loss3.value && a < T(0) ? 1 : 0) * m;
        neg_kl += -(d < -bound ? -bound : (d > bound ? bound : d)) * m;
      }
    }
    T* s = sums + i * kPolicySums;
    s[0] = loss_sum;
    s[1] = count;
    s[2] = clip;
    s[3] = lower;
    s[4] = neg_kl;
    bad[i] = invalid ? 1 : 0;
  }
};

template <class T>
struct ScaleGrad {
  T* grad;
  const T* mask;
  const T* row_weights;
  long cols;
  MRR_HOST_DEVICE void operator()(long at) const {
    const T m = mask[at];
    grad[at] = m != T(0) ? row_weights[at / cols] * m * grad[at] : T(0);
  }
};

}  // namespace kernels

// verl "vanilla": max(-A r, -A clip(r, 1 - low, 1 + high)) and, for A < 0, the dual clip
// min(., -A clip_ratio_c); r = exp(clamp(log_prob - old_log_prob, +-20)). rollout_is_weights
// (optional, [rows, cols]) multiply each token's loss. Metrics: actor/pg_clipfrac,
// actor/pg_clipfrac_lower, actor/ppo_kl.
template <class T, class Backend = ThrustDeviceBackend>
PolicyLossResult<T, Backend> compute_policy_loss_vanilla(
    const typename Backend::template vector<T>& old_log_prob, const typename Backend::template vector<T>& log_prob,
    const typename Backend::template vector<T>& advantages, const typename Backend::template vector<T>& response_mask,
    long cols, ppo::LossAggMode loss_agg_mode = ppo::LossAggMode::token_mean, const ppo::PolicyLossConfig& config = {},
    const typename Backend::template vector<T>* rollout_is_weights = nullptr) {
  constexpr const char* fn = "device::compute_policy_loss_vanilla";
  const std::size_t n = log_prob.size();
  mrr::detail::require(n > 0 && cols > 0 && n % static_cast<std::size_t>(cols) == 0, fn, "'log_prob' has ", n,
                       " values, not a non-empty multiple of ", cols, " columns");
  mrr::detail::require(old_log_prob.size() == n && advantages.size() == n && response_mask.size() == n &&
                           (rollout_is_weights == nullptr || rollout_is_weights->size() == n),
                       fn, "old_log_prob, log_prob, advantages, response_mask (and rollout_is_weights) must all be [",
                       n / static_cast<std::size_t>(cols), ", ", cols, "]");
  mrr::detail::require(config.clip_ratio_c > 1.0, fn, "'clip_ratio_c' (dual-clip lower bound) must be > 1, got ",
                       config.clip_ratio_c);
  const long rows = static_cast<long>(n) / cols;
  const auto policy = Backend::policy();
  auto raw = [](const auto& v) { return thrust::raw_pointer_cast(v.data()); };

  PolicyLossResult<T, Backend> out;
  out.grad_log_prob.resize(n);
  typename Backend::template vector<T> sums(static_cast<std::size_t>(rows) * kernels::kPolicySums);
  typename Backend::template vector<std::uint8_t> bad(static_cast<std::size_t>(rows));
  thrust::for_each(policy, thrust::counting_iterator<long>(0), thrust::counting_iterator<long>(rows),
                   kernels::VanillaRows<T>{raw(old_log_prob), raw(log_prob), raw(advantages), raw(response_mask),
                                           rollout_is_weights ? raw(*rollout_is_weights) : nullptr,
                                           thrust::raw_pointer_cast(out.grad_log_prob.data()),
                                           thrust::raw_pointer_cast(sums.data()), thrust::raw_pointer_cast(bad.data()),
                                           cols, static_cast<T>(1.0 - config.low()), static_cast<T>(1.0 + config.high()),
                                           static_cast<T>(config.clip_ratio_c), static_cast<T>(ppo::detail::kLogRatioBound)});
  const thrust::host_vector<T> h(sums);
  const thrust::host_vector<std::uint8_t> hbad(bad);
  for (long i = 0; i < rows; ++i)
    if (hbad[static_cast<std::size_t>(i)] != 0) [[unlikely]]
      mrr::detail::throw_invalid_argument(fn, "row ", i,
                                          ": 'response_mask' holds a value other than 0 or 1, or a valid token has a "
                                          "non-finite log_prob, old_log_prob, advantage or rollout weight, or a "
                                          "negative rollout weight");

  // The aggregation's row weights (ppo/aggregate.hpp: every mode is linear in the token losses).
  const ppo::GlobalBatchInfo& info = config.global_batch_info;
  mrr::detail::require(info.dp_size >= 1, fn, "'dp_size' must be at least 1, got ", info.dp_size);
  const T dp = static_cast<T>(static_cast<double>(info.dp_size));
  auto at = [&](long i, int s) { return h[static_cast<std::size_t>(i * kernels::kPolicySums + s)]; };
  T mask_sum = 0, loss_total = 0, clip = 0, lower = 0, neg_kl = 0;
  long sequences_with_tokens = 0;
  for (long i = 0; i < rows; ++i) {
    mask_sum += at(i, 1);
    clip += at(i, 2);
    lower += at(i, 3);
    neg_kl += at(i, 4);
    sequences_with_tokens += at(i, 1) > T(0) ? 1 : 0;
  }
  std::vector<T> row_weights(static_cast<std::size_t>(rows));
  using ppo::LossAggMode;
  if (loss_agg_mode == LossAggMode::token_mean || loss_agg_mode == LossAggMode::token_sum) {
    T scale = dp;
    if (loss_agg_mode == LossAggMode::token_mean) {
      T tokens = mask_sum;
      if (info.batch_num_tokens)
        tokens = static_cast<T>(*info.batch_num_tokens);
      else
        mrr::detail::require(info.dp_size == 1, fn, "'batch_num_tokens' (global) is required for token-mean when dp_size is ",
                             info.dp_size);
      mrr::detail::require(tokens > T(0) && std::isfinite(tokens), fn,
                           "token-mean divides by the number of valid tokens, which is ", static_cast<double>(tokens));
      scale = dp / tokens;
    }
    for (auto& w : row_weights) w = scale;
    for (long i = 0; i < rows; ++i) loss_total += at(i, 0);
    loss_total *= loss_agg_mode == LossAggMode::token_sum ? dp : scale;
  } else {
    T sequences = static_cast<T>(static_cast<double>(sequences_with_tokens));
    if (info.global_batch_size)
      sequences = static_cast<T>(*info.global_batch_size);
    else
      mrr::detail::require(info.dp_size == 1, fn, "'global_batch_size' is required for ", ppo::to_string(loss_agg_mode),
                           " when dp_size is ", info.dp_size);
    mrr::detail::require(sequences > T(0) && std::isfinite(sequences), fn, ppo::to_string(loss_agg_mode),
                         " divides by the number of sequences, which is ", static_cast<double>(sequences));
    T norm = T(1);
    if (loss_agg_mode == LossAggMode::seq_mean_token_sum_norm) {
      norm = info.loss_scale_factor ? static_cast<T>(*info.loss_scale_factor) : static_cast<T>(static_cast<double>(cols));
      mrr::detail::require(norm != T(0) && std::isfinite(norm), fn,
                           "'loss_scale_factor' must be finite and non-zero, got ", static_cast<double>(norm));
    }
    for (long i = 0; i < rows; ++i) {
      const bool has_tokens = at(i, 1) > T(0);  // fully masked sequences leave the sequence mean
      T w = has_tokens ? dp / sequences : T(0);
      if (loss_agg_mode == LossAggMode::seq_mean_token_mean && has_tokens)
        w = w / (at(i, 1) + T(ppo::detail::kMaskCountEpsilon));
      if (loss_agg_mode == LossAggMode::seq_mean_token_sum_norm) w = w / norm;
      row_weights[static_cast<std::size_t>(i)] = w;
      if (w != T(0)) loss_total += at(i, 0) * w;
    }
  }
  out.loss = loss_total;
  const typename Backend::template vector<T> device_weights(row_weights.begin(), row_weights.end());
  thrust::for_each(policy, thrust::counting_iterator<long>(0), thrust::counting_iterator<long>(static_cast<long>(n)),
                   kernels::ScaleGrad<T>{thrust::raw_pointer_cast(out.grad_log_prob.data()), raw(response_mask),
                                         raw(device_weights), cols});
  const T denominator = mask_sum + T(ppo::detail::kMaskCountEpsilon);
  out.metrics["actor/pg_clipfrac"] = clip / denominator;
  out.metrics["actor/pg_clipfrac_lower"] = lower / denominator;
  out.metrics["actor/ppo_kl"] = neg_kl / denominator;
  return out;
}

}  // namespace device
MRR_NAMESPACE_END
