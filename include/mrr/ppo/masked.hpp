// Masked statistics (sum, mean, variance, whitening) and the entropy of a softmax, with verl's
// semantics: a zero mask entry excludes the element (even NaN), and means divide by sum(mask) + 1e-8.
// A mask holds 0 or 1; any other value is an error naming its index.
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>
#include <mrr/ppo/detail/validate.hpp>
#include <mrr/tensor.hpp>

#include <cmath>
#include <limits>

MRR_NAMESPACE_BEGIN
namespace ppo {

namespace detail {

// verl adds this to every mask count it divides by, so an all-masked batch yields 0 rather than NaN.
inline constexpr double kMaskCountEpsilon = 1e-8;
// masked_whiten adds this to the variance before the reciprocal square root.
inline constexpr double kWhitenVarianceEpsilon = 1e-8;

// sum over (i, j) with mask != 0 of values * mask; the "where" keeps NaN in padding out of the sum.
template <class T>
T masked_sum_unchecked(const MatrixRef<T>& values, const MatrixRef<T>& mask) {
  T total = 0;
  for (Eigen::Index i = 0; i < values.rows(); ++i)
    for (Eigen::Index j = 0; j < values.cols(); ++j) {
      const T m = mask(i, j);
      if (m != T(0)) total += values(i, j) * m;
    }
  return total;
}

// The (possibly biased by 1e-8) mean and the unbiased variance that masked_whiten uses.
template <class T>
struct MaskedMoments {
  T mean;
  T variance;
};

template <class T>
MaskedMoments<T> masked_moments(const MatrixRef<T>& values, const MatrixRef<T>& mask, bool unbiased,
                                std::string_view function) {
  const T count = mask.sum();
  const T mean = masked_sum_unchecked<T>(values, mask) / (count + T(kMaskCountEpsilon));
  T centered_sum = 0;
  for (Eigen::Index i = 0; i < values.rows(); ++i)
    for (Eigen::Index j = 0; j < values.cols(); ++j) {
      const T m = mask(i, j);
      if (m != T(0)) {
        const T d = values(i, j) - mean;
        centered_sum += d * d * m;
      }
    }
  T variance = centered_sum / (count + T(kMaskCountEpsilon));
  if (unbiased) {
    // Bessel's correction is undefined for fewer than two selected elements; verl raises too.
    mrr::detail::require(count != T(0), function, "'mask' selects no element; the variance is undefined");
    mrr::detail::require(count != T(1), function,
                         "'mask' selects a single element; the unbiased variance divides by zero");
    variance = variance * (count / (count - T(1)));
  }
  return {mean, variance};
}

}  // namespace detail

// Sum of values * mask over the elements whose mask is non-zero.
template <class T>
T masked_sum(MatrixRef<T> values, MatrixRef<T> mask) {
  detail::require_same_shape("ppo::masked_sum", "values", values, "mask", mask);
  detail::require_mask("ppo::masked_sum", "mask", mask);
  return detail::masked_sum_unchecked<T>(values, mask);
}

// masked_sum / (sum(mask) + 1e-8): 0 for an all-masked input, as verl returns.
template <class T>
T masked_mean(MatrixRef<T> values, MatrixRef<T> mask) {
  detail::require_same_shape("ppo::masked_mean", "values", values, "mask", mask);
  detail::require_mask("ppo::masked_mean", "mask", mask);
  return detail::masked_sum_unchecked<T>(values, mask) / (mask.sum() + T(detail::kMaskCountEpsilon));
}

// Per-row masked mean (verl's masked_mean with axis=-1): one value per row.
template <class T>
Vector<T> masked_row_mean(MatrixRef<T> values, MatrixRef<T> mask) {
  detail::require_same_shape("ppo::masked_row_mean", "values", values, "mask", mask);
  detail::require_mask("ppo::masked_row_mean", "mask", mask);
  Vector<T> out(values.rows());
  for (Eigen::Index i = 0; i < values.rows(); ++i) {
    T sum = 0;
    for (Eigen::Index j = 0; j < values.cols(); ++j) {
      const T m = mask(i, j);
      if (m != T(0)) sum += values(i, j) * m;
    }
    out[i] = sum / (mask.row(i).sum() + T(detail::kMaskCountEpsilon));
  }
  return out;
}

// Masked variance around the masked mean; unbiased (Bessel) by default, which needs sum(mask) >= 2.
template <class T>
T masked_var(MatrixRef<T> values, MatrixRef<T> mask, bool unbiased = true) {
  detail::require_same_shape("ppo::masked_var", "values", values, "mask", mask);
  detail::require_mask("ppo::masked_var", "mask", mask);
  return detail::masked_moments<T>(values, mask, unbiased, "ppo::masked_var").variance;
}

// (values - mean) / sqrt(var + 1e-8) with masked statistics, applied to every element (masked
// ones included, as verl does); with shift_mean = false the mean is added back.
template <class T>
RowMatrix<T> masked_whiten(MatrixRef<T> values, MatrixRef<T> mask, bool shift_mean = true) {
  detail::require_same_shape("ppo::masked_whiten", "values", values, "mask", mask);
  detail::require_mask("ppo::masked_whiten", "mask", mask);
  const auto moments = detail::masked_moments<T>(values, mask, true, "ppo::masked_whiten");
  const T inv_std = T(1) / std::sqrt(moments.variance + T(detail::kWhitenVarianceEpsilon));
  RowMatrix<T> out = ((values.array() - moments.mean) * inv_std).matrix();
  if (!shift_mean) out.array() += moments.mean;
  return out;
}

// Entropy of softmax(logits) per row (rows are tokens, columns the vocabulary). Computed as
// sum_k p_k (logsumexp - z_k), the same quantity as verl's logsumexp - sum p z without its
// cancellation for large logits; zero-probability entries (-inf logits) contribute nothing.
template <class T>
Vector<T> entropy_from_logits(MatrixRef<T> logits) {
  mrr::detail::require(logits.cols() > 0, "ppo::entropy_from_logits", "'logits' has no vocabulary column");
  Vector<T> out(logits.rows());
  for (Eigen::Index i = 0; i < logits.rows(); ++i) {
    const auto row = logits.row(i);
    const T max = row.maxCoeff();
    T sum = 0;
    for (Eigen::Index k = 0; k < row.size(); ++k)
      sum += std::exp(row[k] - max);
    const T log_sum = std::log(sum);
    T entropy = 0;
    for (Eigen::Index k = 0; k < row.size(); ++k) {
      const T shifted = row[k] - max;
      const T p = std::exp(shifted) / sum;
      if (p != T(0)) entropy += p * (log_sum - shifted);
    }
    out[i] = entropy;
  }
  return out;
}

}  // namespace ppo
MRR_NAMESPACE_END
