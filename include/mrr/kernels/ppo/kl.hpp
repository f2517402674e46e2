// The KL penalty estimators between the policy and the reference policy, one element at a time,
// with the derivative w.r.t. log p: Schulman's k1, k2, k3 and |k1| with verl's clamps, and verl's
// straight-through "+" variants (the estimator's value, k2's gradient). The one definition: the
// Thrust path runs it per element, the host path per element where it is not vectorised (the
// host's vectorised rows in ppo/kl.hpp give the same bits, except float k3's exp: see there).
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/kernels/ppo/common.hpp>

#include <cmath>

MRR_NAMESPACE_BEGIN
namespace kernels::ppo {

enum class KlEstimator {
  k1,   // verl "kl" / "k1": log p - log p_ref
  abs,  // verl "abs": |log p - log p_ref|
  k2,   // verl "mse" / "k2": 0.5 (log p - log p_ref)^2
  k3,   // verl "low_var_kl" / "k3": exp(r) - r - 1 with r = log p_ref - log p, clamped
};

// verl clamps the log-ratio and the k3 estimate for numerical stability (low_var_kl).
inline constexpr double kLowVarKlLogRatioBound = 20.0;
inline constexpr double kLowVarKlValueBound = 10.0;

// k3 and its gradient 1 - ratio, which the clamps pass on their closed intervals (false for NaN).
template <class T>
MRR_HOST_DEVICE inline ValueGrad<T> kl_k3(T logprob, T ref_logprob) {
  using std::exp;
  const T bound = T(kLowVarKlLogRatioBound), value_bound = T(kLowVarKlValueBound);
  const T log_ratio = ref_logprob - logprob;
  const T clamped = clamp(log_ratio, -bound, bound);
  const T ratio = exp(clamped);
  const T estimate = ratio - clamped - T(1);
  const bool ratio_passes = log_ratio >= -bound && log_ratio <= bound;
  const bool value_passes = estimate >= -value_bound && estimate <= value_bound;
  return {clamp(estimate, -value_bound, value_bound), ratio_passes && value_passes ? T(1) - ratio : T(0)};
}

// One element: the estimate and d estimate / d logprob (k2's, log p - log p_ref, when straight_through).
template <class T>
MRR_HOST_DEVICE inline ValueGrad<T> kl_element(T logprob, T ref_logprob, KlEstimator estimator,
                                               bool straight_through = false) {
  using std::fabs;
  const T diff = logprob - ref_logprob;
  ValueGrad<T> out{diff, T(1)};
  switch (estimator) {
    case KlEstimator::k1:
      break;
    case KlEstimator::abs:
      out = {fabs(diff), diff > T(0) ? T(1) : (diff < T(0) ? T(-1) : T(0))};
      break;
    case KlEstimator::k2:
      out = {T(0.5) * diff * diff, diff};
      break;
    case KlEstimator::k3:
      out = kl_k3(logprob, ref_logprob);
      break;
  }
  if (straight_through) out.grad = diff;
  return out;
}

}  // namespace kernels::ppo
MRR_NAMESPACE_END
