// Scalar score functions and their derivatives, written once for host and device (every router
// backend calls these). Thresholds
// follow torch (softplus switches to the identity above 20) so results match to the last bits.
#pragma once

#include <mrr/detail/config.hpp>

#include <cmath>

MRR_NAMESPACE_BEGIN
namespace kernels {

template <class T>
MRR_HOST_DEVICE MRR_FORCEINLINE T sigmoid(T x) {
  using std::exp;
  return T(1) / (T(1) + exp(-x));
}

// torch.nn.functional.softplus with beta=1, threshold=20.
template <class T>
MRR_HOST_DEVICE MRR_FORCEINLINE T softplus(T x) {
  using std::exp;
  using std::log1p;
  return x > T(20) ? x : log1p(exp(x));
}

template <class T>
MRR_HOST_DEVICE MRR_FORCEINLINE T sqrt_softplus(T x) {
  using std::sqrt;
  return sqrt(softplus(x));
}

// d sigmoid(x)/dx expressed through s = sigmoid(x).
template <class T>
MRR_HOST_DEVICE MRR_FORCEINLINE T sigmoid_grad_from_value(T s) {
  return s * (T(1) - s);
}

// d sqrt(softplus(x))/dx = softplus'(x) / (2 sqrt(softplus(x))); softplus' = sigmoid below the
// threshold and 1 above it, as torch differentiates its thresholded softplus. Where softplus
// underflows to 0 (x = -inf, or below about -104 in float) torch's 0 / 0 is NaN; the limit there
// is exp(x / 2) / 2 (softplus and sigmoid both tend to exp(x)), which this returns.
template <class T>
MRR_HOST_DEVICE MRR_FORCEINLINE T sqrt_softplus_grad(T x, T value) {
  using std::exp;
  if (value == T(0)) return exp(x / T(2)) / T(2);
  const T dsp = x > T(20) ? T(1) : sigmoid(x);
  return dsp / (T(2) * value);
}

// The score functions a router applies, as resolved kernel parameters carry them.
enum ScoreKind : int { score_softmax = 0, score_sigmoid = 1, score_sqrt_softplus = 2 };

// The per-expert score of the element-wise score functions (sigmoid, sqrt-softplus).
template <class T>
MRR_HOST_DEVICE MRR_FORCEINLINE T score_of(int score, T x) {
  return score == score_sigmoid ? sigmoid(x) : sqrt_softplus(x);
}

// Its derivative, from the input x and the value s = score_of(score, x).
template <class T>
MRR_HOST_DEVICE MRR_FORCEINLINE T score_grad(int score, T x, T s) {
  return score == score_sigmoid ? sigmoid_grad_from_value(s) : sqrt_softplus_grad(x, s);
}

}  // namespace kernels
MRR_NAMESPACE_END
