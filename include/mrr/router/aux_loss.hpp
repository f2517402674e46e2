// Router auxiliary losses with their gradients: switch load balancing (Megatron
// switch_load_balancing_loss_func on compute_routing_scores_for_aux_loss), its per-sequence
// variant, and the ST-MoE z-loss. All gradients are w.r.t. the router logits.
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/detail/score.hpp>
#include <mrr/detail/topk.hpp>
#include <mrr/error.hpp>
#include <mrr/router/config.hpp>
#include <mrr/router/routing.hpp>
#include <mrr/tensor.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

MRR_NAMESPACE_BEGIN

template <class T>
struct AuxLoss {
  T loss = T(0);
  RowMatrix<T> grad_logits;  // d loss / d logits, [tokens, experts]
};

// Scores the load-balancing losses see: softmax over all experts, or sigmoid / sqrt-softplus
// normalised per token; and the top-k map they imply (selected on these scores, ties to the
// lower expert id). Independent of replay: balancing looks at what the router would choose.
template <class T>
struct AuxLossScores {
  RowMatrix<T> scores;       // [tokens, experts]
  Mask routing_map;          // [tokens, experts]
  Vector<T> tokens_per_expert;  // column sums of routing_map
};

template <class T>
AuxLossScores<T> routing_scores_for_aux_loss(MatrixRef<T> logits, int topk, ScoreFunction score_function) {
  constexpr const char* fn = "routing_scores_for_aux_loss";
  const auto tokens = logits.rows();
  const auto experts = static_cast<int>(logits.cols());
  detail::require(topk > 0 && topk <= experts, fn, "topk=", topk, " outside [1, ", experts, "]");
  AuxLossScores<T> out{RowMatrix<T>(tokens, experts), Mask::Zero(tokens, experts), Vector<T>::Zero(experts)};
  std::vector<int> idx(static_cast<std::size_t>(topk));
  std::vector<T> val(static_cast<std::size_t>(topk));
  for (Eigen::Index t = 0; t < tokens; ++t) {
    auto s = out.scores.row(t);
    bool any_finite = false;
    for (int e = 0; e < experts; ++e) {
      detail::require(!std::isnan(logits(t, e)) && logits(t, e) != std::numeric_limits<T>::infinity(), fn,
                      "logits row ", t, " has ", logits(t, e), " at expert ", e);
      any_finite = any_finite || std::isfinite(logits(t, e));
    }
    detail::require(any_finite, fn, "logits row ", t, " has no finite value (every score would be NaN)");
    if (score_function == ScoreFunction::softmax) {
      s = (logits.row(t).array() - logits.row(t).maxCoeff()).exp().matrix();
      s /= s.sum();
    } else {
      for (int e = 0; e < experts; ++e)
        s[e] = score_function == ScoreFunction::sigmoid ? detail::sigmoid(logits(t, e)) : detail::sqrt_softplus(logits(t, e));
      s /= (s.sum() + T(1e-20));
    }
    detail::topk_desc(&out.scores(t, 0), experts, topk, idx.data(), val.data());
    for (int j = 0; j < topk; ++j) {
      out.routing_map(t, idx[static_cast<std::size_t>(j)]) = 1;
      out.tokens_per_expert[idx[static_cast<std::size_t>(j)]] += T(1);
    }
  }
  return out;
}

// loss = E * coeff / (topk * total_tokens^2) * sum_e (sum_t scores[t, e]) * tokens_per_expert[e].
// tokens_per_expert and total_tokens may be global (summed over ranks) while scores are local,
// as Megatron does under sequence/context parallelism.
template <class T>
T switch_load_balancing_loss(MatrixRef<T> scores, VectorRef<T> tokens_per_expert, double total_tokens, int topk,
                             double coeff) {
  constexpr const char* fn = "switch_load_balancing_loss";
  detail::require(tokens_per_expert.size() == scores.cols(), fn, "'tokens_per_expert' has ", tokens_per_expert.size(),
                  " entries for ", scores.cols(), " experts");
  detail::require(total_tokens > 0 && topk > 0, fn, "total_tokens and topk must be positive");
  const T c = static_cast<T>(static_cast<double>(scores.cols()) * coeff /
                             (static_cast<double>(topk) * total_tokens * total_tokens));
  return (scores.colwise().sum().transpose().cwiseProduct(tokens_per_expert)).sum() * c;
}

// Its gradient w.r.t. scores: the routing map is piecewise constant, so each column gets
// tokens_per_expert[e] * c.
template <class T>
RowMatrix<T> switch_load_balancing_loss_grad_scores(Eigen::Index tokens, VectorRef<T> tokens_per_expert,
                                                    double total_tokens, int topk, double coeff) {
  const auto experts = tokens_per_expert.size();
  const T c = static_cast<T>(static_cast<double>(experts) * coeff /
                             (static_cast<double>(topk) * total_tokens * total_tokens));
  return (tokens_per_expert * c).transpose().replicate(tokens, 1);
}

// Chain rule from d loss / d scores to d loss / d logits for routing_scores_for_aux_loss.
template <class T>
RowMatrix<T> aux_scores_backward(MatrixRef<T> logits, MatrixRef<T> scores, MatrixRef<T> grad_scores,
                                 ScoreFunction score_function) {
  RowMatrix<T> grad(logits.rows(), logits.cols());
  for (Eigen::Index t = 0; t < logits.rows(); ++t) {
    if (score_function == ScoreFunction::softmax) {
      const T dot = scores.row(t).dot(grad_scores.row(t));
      grad.row(t) = scores.row(t).cwiseProduct((grad_scores.row(t).array() - dot).matrix());
      continue;
    }
    // q = s / (sum s + eps):  dL/ds_i = (g_i - sum_e g_e q_e) / (sum s + eps).
    T sum = 0;
    for (Eigen::Index e = 0; e < logits.cols(); ++e)
      sum += score_function == ScoreFunction::sigmoid ? detail::sigmoid(logits(t, e)) : detail::sqrt_softplus(logits(t, e));
    const T denom = sum + T(1e-20);
    const T dot = scores.row(t).dot(grad_scores.row(t));
    for (Eigen::Index e = 0; e < logits.cols(); ++e) {
      const T x = logits(t, e);
      const T ds = (grad_scores(t, e) - dot) / denom;
      const T dsdz = score_function == ScoreFunction::sigmoid
                         ? detail::sigmoid_grad_from_value(detail::sigmoid(x))
                         : detail::sqrt_softplus_grad(x, detail::sqrt_softplus(x));
      grad(t, e) = ds * dsdz;
    }
  }
  return grad;
}

// Switch load-balancing loss of a micro-batch, from the logits.
template <class T>
AuxLoss<T> switch_aux_loss(MatrixRef<T> logits, int topk, ScoreFunction score_function, double coeff) {
  const auto s = routing_scores_for_aux_loss<T>(logits, topk, score_function);
  const double total = static_cast<double>(logits.rows());
  AuxLoss<T> out;
  out.loss = switch_load_balancing_loss<T>(s.scores, s.tokens_per_expert, total, topk, coeff);
  const RowMatrix<T> g = switch_load_balancing_loss_grad_scores<T>(logits.rows(), s.tokens_per_expert, total, topk, coeff);
  out.grad_logits = aux_scores_backward<T>(logits, s.scores, g, score_function);
  return out;
}

// Sequence-level load balancing (Megatron seq_aux_loss, DeepSeek-V3): the switch loss of each
// sequence on its own tokens, averaged over sequences. Rows are laid out sequence after
// sequence with the given lengths (padded or packed alike).
template <class T>
AuxLoss<T> sequence_aux_loss(MatrixRef<T> logits, std::span<const std::int64_t> sequence_lengths, int topk,
                             ScoreFunction score_function, double coeff) {
  constexpr const char* fn = "sequence_aux_loss";
  std::int64_t total = 0;
  for (auto n : sequence_lengths) {
    detail::require(n > 0, fn, "every sequence length must be positive, got ", n);
    total += n;
  }
  detail::require(!sequence_lengths.empty() && total == logits.rows(), fn, "sequence lengths sum to ", total,
                  " but logits have ", logits.rows(), " rows");
  AuxLoss<T> out{T(0), RowMatrix<T>(logits.rows(), logits.cols())};
  const T inv_b = T(1) / static_cast<T>(sequence_lengths.size());
  Eigen::Index begin = 0;
  for (auto n : sequence_lengths) {
    const auto part = switch_aux_loss<T>(logits.middleRows(begin, n), topk, score_function, coeff);
    out.loss += part.loss * inv_b;
    out.grad_logits.middleRows(begin, n) = part.grad_logits * inv_b;
    begin += n;
  }
  return out;
}

// z-loss: coeff * mean_t (logsumexp_e logits[t, e])^2.
template <class T>
AuxLoss<T> z_loss(MatrixRef<T> logits, double coeff) {
  constexpr const char* fn = "z_loss";
  detail::require(logits.rows() > 0 && logits.cols() > 0, fn, "logits have shape ", detail::shape_of(logits),
                  ": no rows or no experts");
  AuxLoss<T> out{T(0), RowMatrix<T>(logits.rows(), logits.cols())};
  const T c = static_cast<T>(coeff);
  const T inv_t = T(1) / static_cast<T>(logits.rows());
  for (Eigen::Index t = 0; t < logits.rows(); ++t) {
    T mx = -std::numeric_limits<T>::infinity();
    for (Eigen::Index e = 0; e < logits.cols(); ++e) {  // element by element: Eigen's maxCoeff may skip a NaN
      const T z = logits(t, e);
      detail::require(!std::isnan(z) && z != std::numeric_limits<T>::infinity(), fn, "logits row ", t, " has ", z,
                      " at expert ", e);
      mx = z > mx ? z : mx;
    }
    detail::require(std::isfinite(mx), fn, "logits row ", t, " has no finite value");
    const auto ex = (logits.row(t).array() - mx).exp();
    const T sum = ex.sum();
    const T lse = mx + std::log(sum);
    out.loss += lse * lse;
    // d lse^2 / dz = 2 lse softmax(z).
    out.grad_logits.row(t) = (ex / sum * (T(2) * lse * c * inv_t)).matrix();
  }
  out.loss *= c * inv_t;
  return out;
}

MRR_NAMESPACE_END
