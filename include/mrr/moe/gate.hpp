// The MoE gate: a linear map hidden -> E router logits (torch nn.Linear layout [E, hidden], no
// bias), with its input gradient and its weight gradient. Every result is bitwise independent of
// the batch size and of how the global batch is split over expert-parallel ranks:
//   - logits and input gradients are GEMMs over tiles of 64 tokens whose every row goes through
//     the same micro-kernel (detail/row_gemm.hpp), so a token's row is its own row's alone;
//   - the weight gradient is one product over the gathered global batch, the same on every rank,
//     in fixed column tiles (single-threaded each), so also the same for any thread count.
#pragma once

#include <mrr/concepts.hpp>
#include <mrr/detail/config.hpp>
#include <mrr/detail/parallel.hpp>
#include <mrr/detail/row_gemm.hpp>
#include <mrr/error.hpp>
#include <mrr/tensor.hpp>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

MRR_NAMESPACE_BEGIN

template <class Scalar>
class Gate {
 public:
  Gate(int num_experts, int hidden_size) : weight_(RowMatrix<Scalar>::Zero(num_experts, hidden_size)) {}

  int num_experts() const { return static_cast<int>(weight_.rows()); }
  int hidden_size() const { return static_cast<int>(weight_.cols()); }

  // [num_experts, hidden] (nn.Linear layout, no bias); zero until set.
  const RowMatrix<Scalar>& weight() const { return weight_; }
  void set_weight(MatrixRef<Scalar> weight, const char* fn) {
    detail::require(weight.rows() == num_experts() && weight.cols() == hidden_size(), fn, "'weight' has shape ",
                    detail::shape_of(weight), ", expected [", num_experts(), ", ", hidden_size(), "]");
    weight_ = weight;
  }

  // Columns of the logits buffer: every row starts at a multiple of 64 bytes from the (aligned)
  // start, so the router's vectorised row reductions peel the same way for every token and every P.
  Eigen::Index padded_experts() const {
    constexpr Eigen::Index per_line = 64 / static_cast<Eigen::Index>(sizeof(Scalar));
    return (num_experts() + per_line - 1) / per_line * per_line;
  }

  // input [tokens, hidden] -> logits [tokens, padded_experts()], the padding zero.
  RowMatrix<Scalar> logits(MatrixRef<Scalar> input) const {
    RowMatrix<Scalar> out;
    logits_into(out, input);
    return out;
  }

  // The same into `out` (its storage reused when the shape matches); tiles of tokens on threads.
  void logits_into(RowMatrix<Scalar>& out, MatrixRef<Scalar> input) const {
    const Eigen::Index tokens = input.rows();
    out.resize(tokens, padded_experts());
    detail::parallel_tiles(
        tokens, 64, tokens * num_experts() * hidden_size(), [&](std::int64_t, std::int64_t lo, std::int64_t hi) {
          const Eigen::Index n = hi - lo;
          detail::rows_times(out.block(lo, 0, n, num_experts()), input.middleRows(lo, n), weight_.transpose(), false);
          out.block(lo, num_experts(), n, padded_experts() - num_experts()).setZero();
        });
  }

  // grad_logits [tokens, num_experts] -> d input [tokens, hidden] = grad_logits @ weight.
  RowMatrix<Scalar> input_gradient(MatrixRef<Scalar> grad_logits) const {
    RowMatrix<Scalar> out = RowMatrix<Scalar>::Zero(grad_logits.rows(), hidden_size());
    add_input_gradient(out, grad_logits);
    return out;
  }

  // grad [tokens, hidden] += grad_logits @ weight, each token's row from its own alone.
  void add_input_gradient(RowMatrix<Scalar>& grad, MatrixRef<Scalar> grad_logits) const {
    const Eigen::Index tokens = grad_logits.rows();
    detail::parallel_tiles(tokens, 64, tokens * num_experts() * hidden_size(),
                           [&](std::int64_t, std::int64_t lo, std::int64_t hi) {
                             const Eigen::Index n = hi - lo;
                             detail::rows_times(grad.middleRows(lo, n), grad_logits.middleRows(lo, n), weight_, true);
                           });
  }

  // d weight = grad_logits^T @ input over the global batch. Every rank gathers the per-token terms
  // of all ranks (rank order = global token order) and runs the same GEMM on the same
  // [global tokens, .] matrices as one rank does, so the result is bitwise independent of P.
  // Collective.
  template <Communicator C>
  RowMatrix<Scalar> weight_gradient(const C& comm, MatrixRef<Scalar> input, MatrixRef<Scalar> grad_logits) const {
    const int p = static_cast<int>(comm.size());
    const int num_e = num_experts(), hidden = hidden_size();
    const std::array<std::int64_t, 1> mine = {input.rows()};
    std::vector<std::int64_t> tokens(static_cast<std::size_t>(p));
    comm.all_gather(std::span<const std::int64_t>(mine), std::span<std::int64_t>(tokens));
    const std::int64_t most = *std::max_element(tokens.begin(), tokens.end());
    std::int64_t global = 0;
    for (auto n : tokens) global += n;
    const auto stride = static_cast<std::size_t>(num_e + hidden);
    std::vector<Scalar> send(static_cast<std::size_t>(most) * stride, Scalar(0));
    for (Eigen::Index t = 0; t < input.rows(); ++t) {
      Scalar* dst = send.data() + static_cast<std::size_t>(t) * stride;
      for (int e = 0; e < num_e; ++e) dst[e] = grad_logits(t, e);
      for (int h = 0; h < hidden; ++h) dst[num_e + h] = input(t, h);
    }
    std::vector<Scalar> all(send.size() * static_cast<std::size_t>(p));
    comm.all_gather(std::span<const Scalar>(send), std::span<Scalar>(all));
    RowMatrix<Scalar> dz(global, num_e), x(global, hidden);
    Eigen::Index row = 0;
    for (int s = 0; s < p; ++s)
      for (std::int64_t t = 0; t < tokens[static_cast<std::size_t>(s)]; ++t, ++row) {
        const Scalar* src =
            all.data() + (static_cast<std::size_t>(s) * static_cast<std::size_t>(most) + static_cast<std::size_t>(t)) * stride;
        for (int e = 0; e < num_e; ++e) dz(row, e) = src[e];
        for (int h = 0; h < hidden; ++h) x(row, h) = src[num_e + h];
      }
    // Column tiles of 64, each one single-threaded product: Eigen's threaded GEMM blocks its
    // reduction by the thread count, which would change the bits with OMP_NUM_THREADS.
    constexpr Eigen::Index tile = 64;
    RowMatrix<Scalar> grad(num_e, hidden);
    detail::parallel_tasks(detail::tile_count(hidden, tile), [&](std::int64_t i) {
      const Eigen::Index c0 = i * tile, w = std::min<Eigen::Index>(tile, hidden - c0);
      grad.middleCols(c0, w).noalias() = dz.transpose() * x.middleCols(c0, w);
    });
    return grad;
  }

 private:
  RowMatrix<Scalar> weight_;
};

MRR_NAMESPACE_END
