// Masked statistics (sum, mean, variance, whitening) and the entropy of a softmax, with verl's
// semantics: a zero mask entry excludes the element (even NaN), and means divide by sum(mask) + 1e-8.
// A mask holds 0 or 1; any other value is an error naming its index.
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/detail/parallel.hpp>
#include <mrr/error.hpp>
#include <mrr/kernels/ppo/masked.hpp>
#include <mrr/ppo/detail/validate.hpp>
#include <mrr/tensor.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string_view>

MRR_NAMESPACE_BEGIN
namespace ppo {

namespace detail {

// verl adds this to every mask count it divides by, so an all-masked batch yields 0 rather than NaN;
// masked_whiten adds the other to the variance before the reciprocal square root.
using kernels::ppo::kMaskCountEpsilon;
using kernels::ppo::kWhitenVarianceEpsilon;

// Writable view of caller memory for `_into` outputs: a RowMatrix, a row-major block or a Map.
template <class T>
using OutputRef = Eigen::Ref<RowMatrix<T>>;

// Element-wise passes run over fixed tiles of rows (about 32K elements each, set by the shape
// alone), so the bits never depend on the thread count; see mrr/detail/parallel.hpp.
inline Eigen::Index row_tile(Eigen::Index cols) {
  return std::max<Eigen::Index>(1, Eigen::Index{32768} / std::max<Eigen::Index>(cols, 1));
}

// Columns processed per chunk by the row kernels (stack buffers stay in L1).
inline constexpr Eigen::Index kChunk = 512;

// True when the outputs' storage overlaps the input's (row-major views: rows are contiguous).
template <class Out, class In>
bool shares_memory(const Out& output, const In& input) {
  if (output.size() == 0 || input.size() == 0) return false;
  const auto* out_begin = output.data();
  const auto* out_end = output.data() + (output.rows() - 1) * output.outerStride() + output.cols();
  const auto* in_begin = input.data();
  const auto* in_end = input.data() + (input.rows() - 1) * input.outerStride() + input.cols();
  return out_begin < in_end && in_begin < out_end;
}

template <class Out, class... Inputs>
void require_output(std::string_view function, std::string_view name, const Out& output, Eigen::Index rows,
                    Eigen::Index cols, const Inputs&... inputs) {
  mrr::detail::require(output.rows() == rows && output.cols() == cols, function, "'", name, "' has shape ",
                       mrr::detail::shape_of(output), " but the result has shape [", rows, ", ", cols, "]");
  mrr::detail::require(!(shares_memory(output, inputs) || ...), function, "'", name,
                       "' shares memory with an input; pass a separate output matrix");
}

// sum over (i, j) with mask != 0 of values * mask; the "where" keeps NaN in padding out of the sum.
// One sum in double whatever T, row after row (kernels::ppo::masked_sum): a float sum of many
// terms in one running total loses digits that torch's blocked float reductions keep.
template <class T>
T masked_sum_unchecked(const MatrixRef<T>& values, const MatrixRef<T>& mask) {
  double total = 0;
  for (Eigen::Index i = 0; i < values.rows(); ++i)
    total = kernels::ppo::masked_sum<double>(values.row(i).data(), mask.row(i).data(), values.cols(), total);
  return static_cast<T>(total);
}

// The (possibly biased by 1e-8) mean and the unbiased variance that masked_whiten uses.
template <class T>
struct MaskedMoments {
  T mean;
  T variance;
};

// In T around verl's (shifted) mean, as torch computes masked_var on a float tensor; the moments of
// kernels/ppo/masked.hpp are the double-precision form the GAE whitening and the Thrust path use.
template <class T>
MaskedMoments<T> masked_moments(const MatrixRef<T>& values, const MatrixRef<T>& mask, bool unbiased,
                                std::string_view function) {
  const T count = mask.sum();
  const T mean = masked_sum_unchecked<T>(values, mask) / (count + T(kMaskCountEpsilon));
  T centered_sum = 0;
  for (Eigen::Index i = 0; i < values.rows(); ++i)
    centered_sum =
        kernels::ppo::masked_centered_sum<T>(values.row(i).data(), mask.row(i).data(), values.cols(), mean, centered_sum);
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
  for (Eigen::Index i = 0; i < values.rows(); ++i)
    out[i] = kernels::ppo::masked_mean<T>(values.row(i).data(), mask.row(i).data(), values.cols());
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
  const T inv_std = kernels::ppo::whitening_scale(moments.variance);
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
