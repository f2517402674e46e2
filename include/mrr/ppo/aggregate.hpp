// Loss aggregation (verl's agg_loss): reduces a [batch, length] per-token loss to the scalar a
// data-parallel rank backpropagates, so that the global loss does not depend on the parallelism.
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>
#include <mrr/ppo/detail/validate.hpp>
#include <mrr/ppo/masked.hpp>
#include <mrr/tensor.hpp>

#include <cmath>
#include <cstdint>
#include <optional>
#include <string_view>

MRR_NAMESPACE_BEGIN
namespace ppo {

enum class LossAggMode {
  token_mean,               // "token-mean": sum over valid tokens / number of valid tokens
  token_sum,                // "token-sum": sum over valid tokens
  seq_mean_token_sum,       // "seq-mean-token-sum": mean over sequences of their token sums
  seq_mean_token_mean,      // "seq-mean-token-mean": mean over sequences of their token means
  seq_mean_token_sum_norm,  // "seq-mean-token-sum-norm": seq-mean-token-sum / loss_scale_factor
};

inline LossAggMode parse_loss_agg_mode(std::string_view name) {
  if (name == "token-mean") return LossAggMode::token_mean;
  if (name == "token-sum") return LossAggMode::token_sum;
  if (name == "seq-mean-token-sum") return LossAggMode::seq_mean_token_sum;
  if (name == "seq-mean-token-mean") return LossAggMode::seq_mean_token_mean;
  if (name == "seq-mean-token-sum-norm") return LossAggMode::seq_mean_token_sum_norm;
  mrr::detail::throw_invalid_argument("ppo::parse_loss_agg_mode", "unknown loss_agg_mode '", name,
                                      "'; expected token-mean, token-sum, seq-mean-token-sum, seq-mean-token-mean "
                                      "or seq-mean-token-sum-norm");
}

inline std::string_view to_string(LossAggMode mode) {
  switch (mode) {
    case LossAggMode::token_mean:
      return "token-mean";
    case LossAggMode::token_sum:
      return "token-sum";
    case LossAggMode::seq_mean_token_sum:
      return "seq-mean-token-sum";
    case LossAggMode::seq_mean_token_mean:
      return "seq-mean-token-mean";
    case LossAggMode::seq_mean_token_sum_norm:
      return "seq-mean-token-sum-norm";
  }
  return "?";
}

// verl's global_batch_info. With dp_size > 1 each rank's loss is scaled by dp_size (gradients
// are averaged across ranks) and normalised by the *global* count, which must then be given.
struct GlobalBatchInfo {
  std::int64_t dp_size = 1;
  std::optional<double> batch_num_tokens;   // token-mean: valid tokens in the global batch
  std::optional<double> global_batch_size;  // seq-mean-*: sequences in the global batch
  std::optional<double> loss_scale_factor;  // seq-mean-token-sum-norm: divisor (default: length)
};

namespace detail {

// Every mode is linear in the loss matrix: loss = sum_i row_weight[i] * sum_j mask_ij loss_ij over
// mask_ij != 0. The per-row weights therefore give both the value and the gradient. From the
// per-row token counts and their total (summed in double: exact for 0/1 masks), so a fused
// kernel can count while it checks the mask.
template <class T>
Vector<T> aggregation_row_weights_from_counts(const Vector<T>& tokens_per_row, double total_tokens, Eigen::Index cols,
                                              LossAggMode mode, const GlobalBatchInfo& info,
                                              std::string_view function) {
  mrr::detail::require(info.dp_size >= 1, function, "'dp_size' must be at least 1, got ", info.dp_size);
  const T dp = static_cast<T>(static_cast<double>(info.dp_size));
  const Eigen::Index rows = tokens_per_row.size();
  Vector<T> weights(rows);
  if (mode == LossAggMode::token_mean || mode == LossAggMode::token_sum) {
    T scale = dp;
    if (mode == LossAggMode::token_mean) {
      T tokens;
      if (info.batch_num_tokens) {
        tokens = static_cast<T>(*info.batch_num_tokens);
      } else {
        mrr::detail::require(info.dp_size == 1, function,
                             "'batch_num_tokens' (global) is required for token-mean when dp_size is ", info.dp_size);
        tokens = static_cast<T>(total_tokens);
      }
      // verl divides 0 by 0 here and returns NaN; an all-masked micro-batch needs the global count.
      mrr::detail::require(
          tokens > T(0) && std::isfinite(tokens), function,
          "token-mean divides by the number of valid tokens, which is ", static_cast<double>(tokens),
          info.batch_num_tokens ? " ('batch_num_tokens')" : " ('loss_mask' selects nothing; pass batch_num_tokens)");
      scale = dp / tokens;
    }
    weights.setConstant(scale);
    return weights;
  }
  T sequences;
  if (info.global_batch_size) {
    sequences = static_cast<T>(*info.global_batch_size);
  } else {
    mrr::detail::require(info.dp_size == 1, function, "'global_batch_size' is required for ", to_string(mode),
                         " when dp_size is ", info.dp_size);
    sequences = static_cast<T>(static_cast<double>((tokens_per_row.array() > T(0)).count()));
  }
  mrr::detail::require(
      sequences > T(0) && std::isfinite(sequences), function, to_string(mode),
      " divides by the number of sequences, which is ", static_cast<double>(sequences),
      info.global_batch_size ? " ('global_batch_size')" : " ('loss_mask' selects nothing; pass global_batch_size)");
  T norm = T(1);
  if (mode == LossAggMode::seq_mean_token_sum_norm) {
    norm = info.loss_scale_factor ? static_cast<T>(*info.loss_scale_factor) : static_cast<T>(static_cast<double>(cols));
    mrr::detail::require(norm != T(0) && std::isfinite(norm), function,
                         "'loss_scale_factor' must be finite and non-zero, got ", static_cast<double>(norm));
  }
  for (Eigen::Index i = 0; i < rows; ++i) {
    // Fully masked sequences are excluded from the sequence mean.
    const bool has_tokens = tokens_per_row[i] > T(0);
    T w = has_tokens ? dp / sequences : T(0);
    if (mode == LossAggMode::seq_mean_token_mean && has_tokens) w = w / (tokens_per_row[i] + T(kMaskCountEpsilon));
    if (mode == LossAggMode::seq_mean_token_sum_norm) w = w / norm;
    weights[i] = w;
  }
  return weights;
}

template <class T>
Vector<T> aggregation_row_weights(const MatrixRef<T>& loss_mask, LossAggMode mode, const GlobalBatchInfo& info,
                                  std::string_view function) {
  const Vector<T> tokens_per_row = loss_mask.rowwise().sum();
  double total = 0;
  for (Eigen::Index i = 0; i < tokens_per_row.size(); ++i)
    total += static_cast<double>(tokens_per_row[i]);
  return aggregation_row_weights_from_counts<T>(tokens_per_row, total, loss_mask.cols(), mode, info, function);
}

// The aggregated loss from each row's masked loss sum (row i at row_loss[i * stride]) and the row
// weights: token-sum and token-mean sum every row first, then scale (as verl); fully masked rows of
// the seq-mean modes have weight 0 and are skipped (their sum is 0 anyway). Serial in row order.
template <class T>
T aggregate_row_sums(const T* row_loss, Eigen::Index stride, const Vector<T>& row_weights, LossAggMode mode,
                     const GlobalBatchInfo& info) {
  const bool token_mode = mode == LossAggMode::token_mean || mode == LossAggMode::token_sum;
  T loss = 0;
  for (Eigen::Index i = 0; i < row_weights.size(); ++i) {
    if (token_mode)
      loss += row_loss[i * stride];
    else if (row_weights[i] != T(0))
      loss += row_loss[i * stride] * row_weights[i];
  }
  if (mode == LossAggMode::token_sum) return loss * static_cast<T>(static_cast<double>(info.dp_size));
  if (mode == LossAggMode::token_mean) return loss * row_weights[0];
  return loss;
}

// Value of the aggregated loss given the row weights: the masked token sum of each row, weighted
// (token-sum and token-mean sum all tokens first, as verl does). Agrees with verl to rounding.
template <class T>
T aggregate_with(const MatrixRef<T>& loss_mat, const MatrixRef<T>& loss_mask, LossAggMode mode,
                 const GlobalBatchInfo& info, const Vector<T>& row_weights) {
  if (mode == LossAggMode::token_mean || mode == LossAggMode::token_sum) {
    T total = masked_sum_unchecked<T>(loss_mat, loss_mask);
    const T dp = static_cast<T>(static_cast<double>(info.dp_size));
    if (mode == LossAggMode::token_sum) return total * dp;
    return total * row_weights[0];
  }
  double total = 0;  // in double whatever T, as masked_sum_unchecked
  for (Eigen::Index i = 0; i < loss_mat.rows(); ++i) {
    if (row_weights[i] == T(0)) continue;
    const double row =
        kernels::ppo::masked_sum<double>(loss_mat.row(i).data(), loss_mask.row(i).data(), loss_mat.cols(), 0.0);
    total += row * static_cast<double>(row_weights[i]);
  }
  return static_cast<T>(total);
}

}  // namespace detail

// Aggregated loss. Masked-out elements never contribute, even when they hold NaN or inf.
template <class T>
T agg_loss(MatrixRef<T> loss_mat, MatrixRef<T> loss_mask, LossAggMode mode, const GlobalBatchInfo& info = {}) {
  constexpr std::string_view fn = "ppo::agg_loss";
  detail::require_nonempty(fn, "loss_mat", loss_mat);
  detail::require_same_shape(fn, "loss_mat", loss_mat, "loss_mask", loss_mask);
  detail::require_mask(fn, "loss_mask", loss_mask);
  const Vector<T> weights = detail::aggregation_row_weights<T>(loss_mask, mode, info, fn);
  return detail::aggregate_with<T>(loss_mat, loss_mask, mode, info, weights);
}

template <class T>
T agg_loss(MatrixRef<T> loss_mat, MatrixRef<T> loss_mask, std::string_view mode, const GlobalBatchInfo& info = {}) {
  return agg_loss<T>(loss_mat, loss_mask, parse_loss_agg_mode(mode), info);
}

// Gradient of agg_loss w.r.t. loss_mat: mask_ij times the weight of row i (zero where masked).
template <class T>
RowMatrix<T> agg_loss_grad(MatrixRef<T> loss_mask, LossAggMode mode, const GlobalBatchInfo& info = {}) {
  constexpr std::string_view fn = "ppo::agg_loss_grad";
  detail::require_nonempty(fn, "loss_mask", loss_mask);
  detail::require_mask(fn, "loss_mask", loss_mask);
  const Vector<T> weights = detail::aggregation_row_weights<T>(loss_mask, mode, info, fn);
  return (loss_mask.array().colwise() * weights.array()).matrix();
}

}  // namespace ppo
MRR_NAMESPACE_END
