// Truncated importance-sampling weights for the rollout / training mismatch (verl's rollout
// correction), one token at a time: the raw weight exp(clamp(log_ratio, +-20)) on valid tokens and
// its truncation (TIS: min(w, upper)) or rejection (IcePop: 0 outside [lower, upper]), and the
// divergence statistics of rejection sampling. Plain host/device code; ppo/rollout_correction.hpp
// and ppo/rollout_rejection.hpp compute the diagnostics around them.
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/kernels/ppo/common.hpp>

#include <cmath>

MRR_NAMESPACE_BEGIN
namespace kernels::ppo {

inline constexpr double kRolloutSafetyBound = 20.0;  // log-ratios are clamped to +-20 before exp

// The weight before truncation: exp(clamp(log_ratio, +-20)) m, and 0 where masked.
template <class T>
MRR_HOST_DEVICE inline T rollout_is_raw_weight(T log_ratio, T mask) {
  using std::exp;
  const T bound = T(kRolloutSafetyBound);
  return mask != T(0) ? exp(clamp(log_ratio, -bound, bound)) * mask : T(0);
}

// TIS truncates at upper; IcePop (reject = true) zeroes weights outside [lower, upper].
template <class T>
MRR_HOST_DEVICE inline T rollout_is_weight(T raw, T lower, T upper, bool reject) {
  if (reject) return raw >= lower && raw <= upper ? raw : T(0);
  return upper < raw ? upper : raw;  // std::min(raw, upper)
}

// The divergence statistics of verl's rejection sampling (rollout_rs), of one token's log-ratio
// log(pi_train / pi_rollout) clamped to +-20: k1 = -log ratio, k2 = log ratio^2 / 2,
// k3 = exp(log ratio) - 1 - log ratio.
enum class RolloutRsStatistic { k1, k2, k3 };

template <class T>
MRR_HOST_DEVICE inline T rollout_rs_statistic(RolloutRsStatistic statistic, T log_ratio) {
  using std::exp;
  const T bound = T(kRolloutSafetyBound);
  const T r = clamp(log_ratio, -bound, bound);
  switch (statistic) {
    case RolloutRsStatistic::k1:
      return -r;
    case RolloutRsStatistic::k2:
      return T(0.5) * r * r;
    default:
      return exp(r) - T(1) - r;
  }
}

}  // namespace kernels::ppo
MRR_NAMESPACE_END
