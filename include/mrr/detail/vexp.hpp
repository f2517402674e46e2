// A float32 exp over the whole float range, written without branches so that loops over it
// vectorise, and compiled on x86 (GCC, Clang) both for the build's target and for AVX2, picked at
// run time: a build without -march otherwise gets Eigen's SSE2 exp, fixed at compile time, while
// PyTorch picks AVX2 at run time. Both variants perform the same IEEE operations in the same order
// (no FMA: the AVX2 variant does not enable it), so the bits do not depend on the machine.
// MRR_NO_RUNTIME_DISPATCH turns the dispatch off.
// A build whose own target has FMA (-march=native on a current x86, -march=x86-64-v3, -mfma) runs
// neither variant but its own code, and GCC fuses the polynomial's multiply-adds there (its
// default -ffp-contract=fast holds with -std=c++20 too; GCC 12's __builtin_assoc_barrier does not
// survive its vectoriser): exp is then within 1.02 ulp, not 1, and about 1% of softmax weights
// (fewer sigmoid ones) differ from a generic build's in the last bit; the ids do not. Inside such
// a build every path still agrees (CPU router, host executors, threads, ranks). Build with
// -ffp-contract=off for a generic build's bits (docs/routing.md).
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/detail/cpu_dispatch.hpp>

#include <bit>
#include <cmath>
#include <cstdint>
#include <type_traits>

#define MRR_VEXP_AVX2 MRR_AVX2_DISPATCH

MRR_NAMESPACE_BEGIN
namespace detail {

// c ? a : b through the bits, so that GCC neither sinks arithmetic into a branch nor threads a
// constant through the code after it (either stops the vectoriser; a plain ternary does both).
MRR_FORCEINLINE float select_float(bool c, float a, float b) {
  const std::uint32_t m = c ? ~0u : 0u;
  return std::bit_cast<float>((std::bit_cast<std::uint32_t>(a) & m) | (std::bit_cast<std::uint32_t>(b) & ~m));
}

// The core shared by the polynomial exps (exp_float here, exp_nonpositive in softmax_tile.hpp):
// Cody-Waite reduction x = n ln2 + r and a degree-6 minimax polynomial p ~ exp(r) (Cephes'
// expf). Returns p and t = x log2(e) + 1.5 * 2^23, whose bits hold n: bits(t) - bits(1.5 * 2^23).
struct ExpReduction {
  float t;
  float p;
};
inline constexpr float kExpRoundMagic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer

MRR_FORCEINLINE ExpReduction exp_reduce(float x) {
  const float t = x * 1.44269504088896341f + kExpRoundMagic;
  const float n = t - kExpRoundMagic;
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float q = 0.001381461275741458f;
  q = q * r + 0.008368710055947304f;
  q = q * r + 0.04166838899254799f;
  q = q * r + 0.1666652113199234f;
  q = q * r + 0.4999999403953552f;
  return {t, (r * r) * q + r + 1.0f};
}

// exp(x) within 1 ulp of the true value for every float (1.02 with FMA contraction, above;
// checked over all of them once;
// tests/ppo/test_kernels.cpp samples them), exact at +-20 (the k3 clamp); inf above 88.72, gradual
// underflow to 0 below -87.34, NaN for NaN. Cody-Waite reduction x = n ln2 + r, |r| <= ln2 / 2,
// a degree-6 minimax polynomial in r (Cephes' expf), and 2^n built in the exponent bits as
// 2^h 2^(n - h), h = floor(n / 2), so that n from -150 to 129 needs no branch and the product
// overflows or underflows exactly as exp does. exp_float_reduced is exp_float without the clamp
// of x to [-104, 89]: the same inside that range (and NaN for NaN), garbage outside it.
MRR_FORCEINLINE float exp_float_reduced(float x) {
  const auto [t, p] = exp_reduce(x);
  // n = bits(t) - bits(kExpRoundMagic); 2^h = (h + 127) << 23 (h >= -75, so the exponent is normal).
  const auto n_int =
      static_cast<std::int32_t>(std::bit_cast<std::uint32_t>(t) - std::bit_cast<std::uint32_t>(kExpRoundMagic));
  const std::int32_t h = n_int >> 1;
  const float scale_h = std::bit_cast<float>(static_cast<std::uint32_t>(h + 127) << 23);
  const float scale_rest = std::bit_cast<float>(static_cast<std::uint32_t>(n_int - h + 127) << 23);
  return (p * scale_h) * scale_rest;
}

MRR_FORCEINLINE float exp_float(float x) {
  // Clamp to where exp is 0 or inf anyway (NaN passes: its comparisons are false).
  x = select_float(x > 89.0f, 89.0f, x);
  x = select_float(x < -104.0f, -104.0f, x);
  return exp_float_reduced(x);
}

MRR_FORCEINLINE void exp_float_span_body(const float* x, float* y, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i)
    y[i] = exp_float(x[i]);
}

inline void exp_float_span_portable(const float* x, float* y, std::int64_t n) { exp_float_span_body(x, y, n); }

#if MRR_VEXP_AVX2
__attribute__((target("avx2"))) inline void exp_float_span_avx2(const float* x, float* y, std::int64_t n) {
  exp_float_span_body(x, y, n);
}

// Whether the AVX2 variants run here; read once.
inline bool vexp_use_avx2() {
  return cpu_has_avx2();
}
#endif

// y[i] = exp(x[i]) for i < n; y may equal x.
inline void exp_float_span(const float* x, float* y, std::int64_t n) {
#if MRR_VEXP_AVX2
  if (vexp_use_avx2()) return exp_float_span_avx2(x, y, n);
#endif
  exp_float_span_portable(x, y, n);
}

// Element-wise exp and sigmoid whose bits depend on each element's value only. Eigen's vectorised
// exp takes its scalar path (other bits) for the elements before the first aligned packet and
// after the last one, so with it a value's bits would depend on where it sits: on the length of
// the span (a tile of a rank's rows: so on P) or on the span's address (a per-thread buffer: so on
// the thread). Float runs exp_float (one branch-free formula for every lane and the remainder),
// double std::exp.
template <class T>
inline void exp_each(T* x, std::int64_t n) {
  if constexpr (std::is_same_v<T, float>)
    exp_float_span(x, x, n);
  else
    for (std::int64_t i = 0; i < n; ++i)
      x[i] = std::exp(x[i]);
}

// x <- 1 / (1 + exp(-x)), element-wise as exp_each (exactly 0 at -inf).
template <class T>
inline void sigmoid_each(T* x, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i)
    x[i] = -x[i];
  exp_each(x, n);
  for (std::int64_t i = 0; i < n; ++i)
    x[i] = T(1) / (T(1) + x[i]);
}

}  // namespace detail
MRR_NAMESPACE_END
