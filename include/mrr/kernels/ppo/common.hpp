// Building blocks the PPO kernels share: verl's numerical constants, a value with its derivative,
// and torch's max / min / clamp on such pairs (the gradients autograd gives). Plain host/device code,
// included by kernels/ppo/*.hpp; the host (ppo/) and Thrust (thrust/) paths use these definitions.
#pragma once

#include <mrr/detail/config.hpp>

MRR_NAMESPACE_BEGIN
namespace kernels::ppo {

inline constexpr double kMaskCountEpsilon = 1e-8;       // verl masked_mean: sum / (count + 1e-8)
inline constexpr double kWhitenVarianceEpsilon = 1e-8;  // verl masked_whiten: rsqrt(var + 1e-8)
inline constexpr double kLogRatioBound = 20.0;          // verl clamps log(pi / pi_old) to +-20 before exp

// What a kernel reports instead of throwing; the host side turns it into the error message.
enum class Status : int {
  ok = 0,
  empty_mask,      // the mask selects no element
  single_element,  // the mask selects one element: the unbiased variance divides by zero
  invalid_input,   // a mask value other than 0 / 1, or a non-finite input on a valid token
};

// A value and its derivative with respect to the current log-probability.
template <class T>
struct ValueGrad {
  T value;
  T grad;
};

// x - x is 0 for every finite x and NaN for NaN or inf (no <cmath>, no intrinsics: works everywhere).
template <class T>
MRR_HOST_DEVICE inline bool is_finite(T x) {
  return x - x == T(0);
}

template <class T>
MRR_HOST_DEVICE inline T clamp(T x, T lo, T hi) {
  return x < lo ? lo : (x > hi ? hi : x);
}

// torch.maximum / torch.minimum split the gradient evenly on ties.
template <class T>
MRR_HOST_DEVICE inline ValueGrad<T> maximum(ValueGrad<T> a, ValueGrad<T> b) {
  if (a.value > b.value) return a;
  if (a.value < b.value) return b;
  return {a.value, T(0.5) * (a.grad + b.grad)};
}

template <class T>
MRR_HOST_DEVICE inline ValueGrad<T> minimum(ValueGrad<T> a, ValueGrad<T> b) {
  if (a.value < b.value) return a;
  if (a.value > b.value) return b;
  return {a.value, T(0.5) * (a.grad + b.grad)};
}

// torch.clamp passes the gradient on the closed interval.
template <class T>
MRR_HOST_DEVICE inline ValueGrad<T> clamp(ValueGrad<T> x, T lo, T hi) {
  if (x.value < lo) return {lo, T(0)};
  if (x.value > hi) return {hi, T(0)};
  return x;
}

}  // namespace kernels::ppo
MRR_NAMESPACE_END
