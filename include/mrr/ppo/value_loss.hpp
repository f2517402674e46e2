// The critic's clipped value loss and the entropy bonus loss (verl's compute_value_loss and
// compute_entropy_loss), each with its analytic gradient.
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>
#include <mrr/kernels/ppo/value_loss.hpp>
#include <mrr/ppo/aggregate.hpp>
#include <mrr/ppo/detail/validate.hpp>
#include <mrr/ppo/masked.hpp>
#include <mrr/tensor.hpp>

#include <algorithm>
#include <cmath>
#include <string_view>

MRR_NAMESPACE_BEGIN
namespace ppo {

template <class T>
struct ValueLossResult {
  T loss = 0;
  T clipfrac = 0;            // share of valid tokens where the clipped loss was the larger
  RowMatrix<T> grad_vpreds;  // d loss / d vpreds
};

// 0.5 * agg(max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2)), per token by
// kernels::ppo::value_loss_token (torch's clip and autograd's even split of ties).
template <class T>
ValueLossResult<T> compute_value_loss(MatrixRef<T> vpreds, MatrixRef<T> returns, MatrixRef<T> values,
                                      MatrixRef<T> response_mask, double cliprange_value,
                                      LossAggMode loss_agg_mode = LossAggMode::token_mean,
                                      const GlobalBatchInfo& info = {}) {
  constexpr std::string_view fn = "ppo::compute_value_loss";
  detail::require_nonempty(fn, "vpreds", vpreds);
  detail::require_same_shape(fn, "vpreds", vpreds, "returns", returns);
  detail::require_same_shape(fn, "vpreds", vpreds, "values", values);
  detail::require_same_shape(fn, "vpreds", vpreds, "response_mask", response_mask);
  detail::require_mask(fn, "response_mask", response_mask);
  detail::require_finite_where(fn, "vpreds", vpreds, response_mask);
  detail::require_finite_where(fn, "returns", returns, response_mask);
  detail::require_finite_where(fn, "values", values, response_mask);
  detail::require_finite_scalar(fn, "cliprange_value", cliprange_value);

  const Eigen::Index rows = vpreds.rows(), cols = vpreds.cols();
  const T c = static_cast<T>(cliprange_value);
  RowMatrix<T> token_loss(rows, cols), token_grad(rows, cols);
  T clipped_count = 0;
  for (Eigen::Index i = 0; i < rows; ++i)
    for (Eigen::Index j = 0; j < cols; ++j) {
      const auto terms = kernels::ppo::value_loss_token(vpreds(i, j), returns(i, j), values(i, j), c);
      token_loss(i, j) = terms.loss;
      token_grad(i, j) = terms.grad;
      const T m = response_mask(i, j);
      if (m != T(0) && terms.clipped) clipped_count += m;
    }
  const Vector<T> row_weights = detail::aggregation_row_weights<T>(response_mask, loss_agg_mode, info, fn);
  ValueLossResult<T> out;
  out.loss = T(0.5) * detail::aggregate_with<T>(token_loss, response_mask, loss_agg_mode, info, row_weights);
  out.clipfrac = clipped_count / (response_mask.sum() + T(detail::kMaskCountEpsilon));
  out.grad_vpreds.resize(rows, cols);
  for (Eigen::Index i = 0; i < rows; ++i)
    for (Eigen::Index j = 0; j < cols; ++j) {
      const T m = response_mask(i, j);
      out.grad_vpreds(i, j) = m != T(0) ? T(0.5) * row_weights[i] * m * token_grad(i, j) : T(0);
    }
  return out;
}

template <class T>
struct EntropyLossResult {
  T loss = 0;
  RowMatrix<T> grad_logits;  // d loss / d logits, same layout as the logits
};

// agg(entropy(softmax(logits))). logits has one row per token in row-major (batch, length)
// order, i.e. batch * length rows and vocabulary columns; response_mask is [batch, length].
// dH/dz_k = -p_k (z_k - sum_j p_j z_j), computed about max_j z_j.
template <class T>
EntropyLossResult<T> compute_entropy_loss(MatrixRef<T> logits, MatrixRef<T> response_mask,
                                          LossAggMode loss_agg_mode = LossAggMode::token_mean,
                                          const GlobalBatchInfo& info = {}) {
  constexpr std::string_view fn = "ppo::compute_entropy_loss";
  detail::require_nonempty(fn, "response_mask", response_mask);
  mrr::detail::require(logits.rows() == response_mask.size() && logits.cols() > 0, fn, "'logits' has shape ",
                       mrr::detail::shape_of(logits), " but needs one row per token of 'response_mask' (shape ",
                       mrr::detail::shape_of(response_mask), "), i.e. ", response_mask.size(), " rows");
  detail::require_mask(fn, "response_mask", response_mask);
  const Eigen::Index rows = response_mask.rows(), cols = response_mask.cols(), vocab = logits.cols();
  const Vector<T> entropy = entropy_from_logits<T>(logits);
  const Eigen::Map<const RowMatrix<T>> token_entropy(entropy.data(), rows, cols);
  for (Eigen::Index t = 0; t < entropy.size(); ++t)
    if (response_mask(t / cols, t % cols) != T(0) && !std::isfinite(entropy[t])) [[unlikely]]
      mrr::detail::throw_invalid_argument(fn, "'logits' row ", t, " (a valid token) has a non-finite entropy");
  const Vector<T> row_weights = detail::aggregation_row_weights<T>(response_mask, loss_agg_mode, info, fn);
  EntropyLossResult<T> out;
  out.loss = detail::aggregate_with<T>(token_entropy, response_mask, loss_agg_mode, info, row_weights);
  out.grad_logits = RowMatrix<T>::Zero(logits.rows(), vocab);
  for (Eigen::Index t = 0; t < logits.rows(); ++t) {
    const Eigen::Index i = t / cols, j = t % cols;
    const T m = response_mask(i, j);
    if (m == T(0)) continue;
    const auto z = logits.row(t);
    const T max = z.maxCoeff();
    T sum = 0;
    for (Eigen::Index k = 0; k < vocab; ++k)
      sum += std::exp(z[k] - max);
    // sum_j p_j (z_j - max), over finite-probability entries: about the shifted logits, so that
    // z_k - sum_j p_j z_j below does not cancel two large numbers (logits of a wide range in float).
    T mean_shifted = 0;
    for (Eigen::Index k = 0; k < vocab; ++k) {
      const T p = std::exp(z[k] - max) / sum;
      if (p != T(0)) mean_shifted += p * (z[k] - max);
    }
    const T scale = row_weights[i] * m;
    for (Eigen::Index k = 0; k < vocab; ++k) {
      const T p = std::exp(z[k] - max) / sum;
      out.grad_logits(t, k) = p != T(0) ? -scale * p * ((z[k] - max) - mean_shifted) : T(0);
    }
  }
  return out;
}

}  // namespace ppo
MRR_NAMESPACE_END
