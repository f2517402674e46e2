// Masked statistics with verl's semantics, as segment kernels in a fixed order: a zero mask entry
// excludes its element (even NaN), means divide by sum(mask) + 1e-8, whitening uses the unbiased
// variance around that mean. Also the masked moments (count, mean, M2) of a block of rows, their
// merge (Chan et al.), and the whitening statistics they give, with status codes in place of
// exceptions. The one definition for the host (ppo/masked.hpp, ppo/advantage.hpp) and the Thrust
// path (thrust/ppo.hpp); a Thrust reduction combines the same element terms in its own tree order.
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/kernels/ppo/common.hpp>

#include <cmath>

MRR_NAMESPACE_BEGIN
namespace kernels::ppo {

// One element's term of a masked sum, v m, and 0 where masked (so a NaN there stays out).
template <class Acc, class T>
MRR_HOST_DEVICE inline Acc masked_value(T value, T mask) {
  const Acc m = static_cast<Acc>(mask);
  return m != Acc(0) ? static_cast<Acc>(value) * m : Acc(0);
}

// One element's term of a centred sum of squares, (v - mean)^2 m, and 0 where masked.
template <class Acc, class T>
MRR_HOST_DEVICE inline Acc masked_centered_square(T value, T mask, Acc mean) {
  const Acc m = static_cast<Acc>(mask);
  if (m == Acc(0)) return Acc(0);
  const Acc d = static_cast<Acc>(value) - mean;
  return d * d * m;
}

// total + the masked terms of [0, n), left to right in Acc (masked elements are skipped, not added).
template <class Acc, class T>
MRR_HOST_DEVICE inline Acc masked_sum(const T* values, const T* mask, long n, Acc total) {
  for (long j = 0; j < n; ++j)
    if (mask[j] != T(0)) total += masked_value<Acc>(values[j], mask[j]);
  return total;
}

template <class Acc, class T>
MRR_HOST_DEVICE inline Acc masked_centered_sum(const T* values, const T* mask, long n, Acc mean, Acc total) {
  for (long j = 0; j < n; ++j)
    if (mask[j] != T(0)) total += masked_centered_square<Acc>(values[j], mask[j], mean);
  return total;
}

// verl masked_mean of one segment: sum(v m) / (sum(m) + 1e-8), in Acc.
template <class Acc, class T>
MRR_HOST_DEVICE inline Acc masked_mean(const T* values, const T* mask, long n) {
  Acc count = 0;
  for (long j = 0; j < n; ++j)
    count += static_cast<Acc>(mask[j]);
  return masked_sum<Acc>(values, mask, n, Acc(0)) / (count + Acc(kMaskCountEpsilon));
}

// Masked count, mean and M2 about that mean, in double.
struct Moments {
  double weight = 0, mean = 0, m2 = 0;
};

// Folds `add` into `into` (Chan et al.'s pairwise update); merging in a fixed order gives bits
// that do not depend on who computed the parts.
MRR_HOST_DEVICE inline void merge(Moments& into, const Moments& add) {
  if (add.weight == 0) return;
  const double total = into.weight + add.weight;
  const double delta = add.mean - into.mean;
  into.mean += delta * (add.weight / total);
  into.m2 += add.m2 + delta * delta * (into.weight * add.weight / total);
  into.weight = total;
}

// The moments of rows [0, rows) of values under mask (row strides in elements), two passes in
// row order. An all-masked block gives zero moments.
template <class T>
MRR_HOST_DEVICE inline Moments masked_moments(const T* values, long value_stride, const T* mask, long mask_stride,
                                              long rows, long cols) {
  double weight = 0, sum = 0;
  for (long i = 0; i < rows; ++i) {
    const T *v = values + i * value_stride, *m = mask + i * mask_stride;
    for (long j = 0; j < cols; ++j) {  // one pass: the count and masked_sum's terms, in its order
      weight += static_cast<double>(m[j]);
      if (m[j] != T(0)) sum += masked_value<double>(v[j], m[j]);
    }
  }
  if (weight == 0) return {};
  const double mean = sum / weight;
  double m2 = 0;
  for (long i = 0; i < rows; ++i)
    m2 = masked_centered_sum<double>(values + i * value_stride, mask + i * mask_stride, cols, mean, m2);
  return {weight, mean, m2};
}

// verl's masked_mean / masked_var from exact moments: its mean divides by count + 1e-8 and its
// variance is taken around that mean (Bessel-corrected when unbiased). Reports empty_mask or
// single_element where the unbiased variance is undefined.
template <class T>
MRR_HOST_DEVICE inline Status mean_and_variance(const Moments& m, bool unbiased, T& mean, T& variance) {
  if (unbiased && m.weight == 0) return Status::empty_mask;
  if (unbiased && m.weight == 1) return Status::single_element;
  const double shifted_mean = m.mean * m.weight / (m.weight + kMaskCountEpsilon);
  const double offset = m.mean - shifted_mean;
  const double centered = m.m2 + m.weight * offset * offset;
  double var = centered / (m.weight + kMaskCountEpsilon);
  if (unbiased) var = var * (m.weight / (m.weight - 1));
  mean = static_cast<T>(shifted_mean);
  variance = static_cast<T>(var);
  return Status::ok;
}

// masked_whiten's scale, 1 / sqrt(var + 1e-8), and one whitened value.
template <class T>
MRR_HOST_DEVICE inline T whitening_scale(T variance) {
  using std::sqrt;
  return T(1) / sqrt(variance + T(kWhitenVarianceEpsilon));
}

template <class T>
MRR_HOST_DEVICE inline T whiten(T value, T mean, T scale) {
  return (value - mean) * scale;
}

}  // namespace kernels::ppo
MRR_NAMESPACE_END
