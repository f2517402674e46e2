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
#include <mrr/kernels/ppo/policy_loss.hpp>
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

// One row of the vanilla loss per work item (kernels/ppo/policy_loss.hpp); bad[i] flags invalid input.
template <class T>
struct VanillaRows {
  const T *old_log_prob, *log_prob, *advantages, *mask, *is_weights;  // is_weights may be null
  T* token_grad;                                                      // [rows, cols] before row weights
  T* sums;                                                            // [rows, kVanillaRowSums]
  std::uint8_t* bad;                                                  // [rows]
  long cols;
  T lo, hi, dual_clip;
  MRR_HOST_DEVICE void operator()(long i) const {
    namespace k = mrr::kernels::ppo;
    const long at = i * cols;
    const k::Status status =
        k::vanilla_row(log_prob + at, old_log_prob + at, advantages + at, mask + at,
                       is_weights != nullptr ? is_weights + at : nullptr, token_grad + at, cols, lo, hi, dual_clip,
                       sums + i * k::kVanillaRowSums);
    bad[i] = status == k::Status::ok ? 0 : 1;
  }
};

template <class T>
struct ScaleGrad {
  T* grad;
  const T* mask;
  const T* row_weights;
  long cols;
  MRR_HOST_DEVICE void operator()(long at) const {
    grad[at] = mrr::kernels::ppo::aggregated_grad(grad[at], mask[at], row_weights[at / cols]);
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

  namespace k = mrr::kernels::ppo;
  PolicyLossResult<T, Backend> out;
  out.grad_log_prob.resize(n);
  typename Backend::template vector<T> sums(static_cast<std::size_t>(rows) * k::kVanillaRowSums);
  typename Backend::template vector<std::uint8_t> bad(static_cast<std::size_t>(rows));
  thrust::for_each(policy, thrust::counting_iterator<long>(0), thrust::counting_iterator<long>(rows),
                   kernels::VanillaRows<T>{raw(old_log_prob), raw(log_prob), raw(advantages), raw(response_mask),
                                           rollout_is_weights ? raw(*rollout_is_weights) : nullptr,
                                           thrust::raw_pointer_cast(out.grad_log_prob.data()),
                                           thrust::raw_pointer_cast(sums.data()), thrust::raw_pointer_cast(bad.data()),
                                           cols, static_cast<T>(1.0 - config.low()), static_cast<T>(1.0 + config.high()),
                                           static_cast<T>(config.clip_ratio_c)});
  const thrust::host_vector<T> h(sums);
  const thrust::host_vector<std::uint8_t> hbad(bad);
  for (long i = 0; i < rows; ++i)
    if (hbad[static_cast<std::size_t>(i)] != 0) [[unlikely]]
      mrr::detail::throw_invalid_argument(fn, "row ", i,
                                          ": 'response_mask' holds a value other than 0 or 1, or a valid token has a "
                                          "non-finite log_prob, old_log_prob, advantage or rollout weight, or a "
                                          "negative rollout weight");

  // The aggregation's row weights and loss, as the host path computes them (ppo/aggregate.hpp).
  const auto at = [&](long i, int s) { return h[static_cast<std::size_t>(i * k::kVanillaRowSums + s)]; };
  Vector<T> tokens(rows);
  double total_tokens = 0;
  T clip = 0, lower = 0, neg_kl = 0;
  for (long i = 0; i < rows; ++i) {
    tokens[i] = at(i, k::kRowTokens);
    total_tokens += static_cast<double>(tokens[i]);
    clip += at(i, k::kRowClipfrac);
    lower += at(i, k::kRowClipfracLower);
    neg_kl += at(i, k::kRowNegKl);
  }
  const Vector<T> row_weights = ppo::detail::aggregation_row_weights_from_counts<T>(
      tokens, total_tokens, cols, loss_agg_mode, config.global_batch_info, fn);
  out.loss = ppo::detail::aggregate_row_sums<T>(h.data() + k::kRowLoss, k::kVanillaRowSums, row_weights, loss_agg_mode,
                                                config.global_batch_info);
  const typename Backend::template vector<T> device_weights(row_weights.data(), row_weights.data() + rows);
  thrust::for_each(policy, thrust::counting_iterator<long>(0), thrust::counting_iterator<long>(static_cast<long>(n)),
                   kernels::ScaleGrad<T>{thrust::raw_pointer_cast(out.grad_log_prob.data()), raw(response_mask),
                                         raw(device_weights), cols});
  const T denominator = static_cast<T>(total_tokens) + T(ppo::detail::kMaskCountEpsilon);
  out.metrics["actor/pg_clipfrac"] = clip / denominator;
  out.metrics["actor/pg_clipfrac_lower"] = lower / denominator;
  out.metrics["actor/ppo_kl"] = neg_kl / denominator;
  return out;
}

}  // namespace device
MRR_NAMESPACE_END
