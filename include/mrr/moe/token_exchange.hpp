// TokenExchange: the expert-parallel exchange of a DispatchPlan's rows. To the experts: rows in
// this rank's permuted (expert-major) order go to the ranks owning their experts and are regrouped
// per local expert in (source rank, token) order — global token order for contiguous token chunks,
// so each expert sees the same rows in the same order for any P. From the experts: the mirror.
// The forward's dispatch and combine and the backward's two exchanges all run these two steps.
// With a RowCommunicator (SingleProcess, InProcessGroup, MpiCommunicator) the rows move between
// the matrices directly (all_to_all_rows); with another, through a staging buffer and
// all_to_all_v. The same rows land in the same places either way.
#pragma once

#include <mrr/concepts.hpp>
#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>
#include <mrr/moe/dispatch_plan.hpp>
#include <mrr/tensor.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

MRR_NAMESPACE_BEGIN

template <class Scalar>
class TokenExchange {
 public:
  // The count exchange completing `plan`: the rows every rank sends each of this rank's experts.
  // Collective.
  template <Communicator C>
  static void exchange_counts(const C& comm, DispatchPlan& plan) {
    const auto per = static_cast<std::size_t>(plan.experts_per_rank);
    const auto p = static_cast<std::size_t>(plan.ranks());
    const std::vector<std::size_t> counts(p, per);
    plan.recv_rows.resize(p * per);
    comm.all_to_all_v(std::span<const std::int64_t>(plan.permutation.tokens_per_expert),
                      std::span<const std::size_t>(counts), std::span<std::int64_t>(plan.recv_rows),
                      std::span<const std::size_t>(counts));
    plan.recv_counts.assign(p, 0);
    plan.local_offsets.assign(per + 1, 0);
    for (std::size_t s = 0; s < p; ++s)
      for (std::size_t e = 0; e < per; ++e) {
        plan.recv_counts[s] += static_cast<std::size_t>(plan.recv_rows[s * per + e]) * static_cast<std::size_t>(plan.hidden);
        plan.local_offsets[e + 1] += plan.recv_rows[s * per + e];
      }
    for (std::size_t e = 0; e < per; ++e)
      plan.local_offsets[e + 1] += plan.local_offsets[e];
    std::vector<std::int64_t> filled(plan.local_offsets.begin(), plan.local_offsets.end() - 1);
    plan.grouped_blocks.start(static_cast<int>(p));
    plan.permuted_blocks.start(static_cast<int>(p));
    std::int64_t permuted = 0;
    const auto hidden = static_cast<std::size_t>(plan.hidden);
    for (std::size_t s = 0; s < p; ++s) {
      for (std::size_t e = 0; e < per; ++e) {
        plan.grouped_blocks.add(filled[e], plan.recv_rows[s * per + e]);
        filled[e] += plan.recv_rows[s * per + e];
      }
      plan.grouped_blocks.next_peer();
      const auto rows = static_cast<std::int64_t>(hidden == 0 ? 0 : plan.send_counts[s] / hidden);
      plan.permuted_blocks.add(permuted, rows);
      plan.permuted_blocks.next_peer();
      permuted += rows;
    }
  }

  // Straight from the tokens: each slot's token row (plan.permutation.source_token, in the
  // permuted order) to the owner of its expert, into grouped as to_experts lays it out, without
  // forming the permuted matrix. Needs a RowCommunicator and contiguous token rows. Collective.
  template <class C>
  requires RowCommunicator<C, Scalar>
  void gather_to_experts(const C& comm, MatrixRef<Scalar> tokens_in, const DispatchPlan& plan,
                         RowMatrix<Scalar>& grouped) {
    const MatrixRef<Scalar> tokens = packed(tokens_in, plan.permutation.row_of_slot.rows(), plan.hidden,
                                            "TokenExchange::gather_to_experts", "tokens");
    grouped.resize(plan.local_rows(), plan.hidden);
    const auto& source = plan.permutation.source_token;
    gather_.start(plan.ranks());
    std::size_t row = 0;
    for (int s = 0; s < plan.ranks(); ++s) {
      const auto end = row + plan.send_counts[static_cast<std::size_t>(s)] / static_cast<std::size_t>(plan.hidden);
      for (; row < end; ++row)
        gather_.add(source[row], 1);
      gather_.next_peer();
    }
    comm.all_to_all_rows(tokens.data(), static_cast<std::size_t>(tokens.rows()), gather_, grouped.data(),
                         static_cast<std::size_t>(grouped.rows()), plan.grouped_blocks,
                         static_cast<std::size_t>(plan.hidden));
  }

  // permuted [plan rows, hidden] -> grouped [plan.local_rows(), hidden]: the local experts' rows,
  // expert-major, each expert's in (source rank, token) order (plan.local_offsets). grouped keeps
  // its storage when its shape does not change. With one rank the two orders are the same and
  // this is a copy (MoELayer skips it). Collective.
  template <Communicator C>
  void to_experts(const C& comm, MatrixRef<Scalar> permuted_in, const DispatchPlan& plan, RowMatrix<Scalar>& grouped) {
    const MatrixRef<Scalar> permuted =
        packed(permuted_in, plan.permutation.rows(), plan.hidden, "TokenExchange::to_experts", "permuted");
    grouped.resize(plan.local_rows(), plan.hidden);
    if (plan.ranks() == 1) {
      exchange(comm, permuted.data(), plan.send_counts, grouped.data(), plan.recv_counts);
      return;
    }
    if (move_rows(comm, permuted, plan.permuted_blocks, grouped, plan.grouped_blocks, plan.hidden)) return;
    staging_.resize(plan.received_elements());
    exchange(comm, permuted.data(), plan.send_counts, staging_.data(), plan.recv_counts);
    move_blocks(plan, staging_.data(), grouped.data(), /*src_is_staging=*/true);
  }

  // The mirror: grouped (rows as to_experts gave them) -> permuted [plan rows, hidden], back on
  // the tokens' rank in its permuted order. Collective.
  template <Communicator C>
  void from_experts(const C& comm, MatrixRef<Scalar> grouped_in, const DispatchPlan& plan,
                    RowMatrix<Scalar>& permuted) {
    const MatrixRef<Scalar> grouped =
        packed(grouped_in, plan.local_rows(), plan.hidden, "TokenExchange::from_experts", "grouped");
    permuted.resize(plan.permutation.rows(), plan.hidden);
    if (plan.ranks() == 1) {
      exchange(comm, grouped.data(), plan.recv_counts, permuted.data(), plan.send_counts);
      return;
    }
    if (move_rows(comm, grouped, plan.grouped_blocks, permuted, plan.permuted_blocks, plan.hidden)) return;
    staging_.resize(plan.received_elements());
    move_blocks(plan, grouped.data(), staging_.data(), /*src_is_staging=*/false);
    exchange(comm, staging_.data(), plan.recv_counts, permuted.data(), plan.send_counts);
  }

 private:
  // `m`, checked to be [rows, hidden], as packed rows (row stride = hidden): itself when it is,
  // else a copy in packed_ (a strided view, e.g. the leftCols of a wider matrix). Every path
  // below reads the rows as packed; a strided view read as one came back with its rows shifted.
  // The shape is each rank's own argument: a mismatch throws before the exchange begins.
  MatrixRef<Scalar> packed(MatrixRef<Scalar> m, std::int64_t rows, int hidden, const char* fn, const char* what) {
    detail::require(m.rows() == rows && m.cols() == hidden, fn, "'", what, "' has shape ", detail::shape_of(m),
                    " but the plan needs [", rows, ", ", hidden, "]");
    if (m.outerStride() == hidden || m.rows() <= 1) return m;
    packed_ = m;
    return packed_;
  }

  // src's blocks to dst's blocks in one all_to_all_rows, where the communicator has it and src's
  // rows are contiguous; false: the caller stages instead.
  template <Communicator C>
  static bool move_rows(const C& comm, MatrixRef<Scalar> src, const RowBlocks& src_blocks, RowMatrix<Scalar>& dst,
                        const RowBlocks& dst_blocks, int hidden) {
    if constexpr (RowCommunicator<C, Scalar>) {
      // At most one row is contiguous whatever its stride (Eigen keeps a zero-row view's wide
      // stride): the choice must not depend on a rank's row count, or ranks call different
      // collectives.
      if (src.rows() > 1 && src.outerStride() != hidden) return false;
      comm.all_to_all_rows(src.data(), static_cast<std::size_t>(src.rows()), src_blocks, dst.data(),
                           static_cast<std::size_t>(dst.rows()), dst_blocks, static_cast<std::size_t>(hidden));
      return true;
    } else {
      (void)comm, (void)src, (void)src_blocks, (void)dst, (void)dst_blocks, (void)hidden;
      return false;
    }
  }

  template <Communicator C>
  static void exchange(const C& comm, const Scalar* send, const std::vector<std::size_t>& send_counts, Scalar* recv,
                       const std::vector<std::size_t>& recv_counts) {
    std::size_t sent = 0, received = 0;
    for (auto c : send_counts)
      sent += c;
    for (auto c : recv_counts)
      received += c;
    comm.all_to_all_v(std::span<const Scalar>(send, sent), std::span<const std::size_t>(send_counts),
                      std::span<Scalar>(recv, received), std::span<const std::size_t>(recv_counts));
  }

  // Between staging (blocks by source rank, each expert-major) and grouped (expert-major, each
  // expert's rows by source rank): one copy per (rank, expert) block, src -> dst either way.
  static void move_blocks(const DispatchPlan& plan, const Scalar* src, Scalar* dst, bool src_is_staging) {
    const int per = plan.experts_per_rank;
    const auto hidden = static_cast<std::size_t>(plan.hidden);
    std::vector<std::int64_t> filled(plan.local_offsets.begin(), plan.local_offsets.end() - 1);
    std::size_t staged = 0;
    for (int s = 0; s < plan.ranks(); ++s)
      for (int e = 0; e < per; ++e) {
        const auto n = static_cast<std::size_t>(plan.rows_from(s, e));
        const std::size_t grouped = static_cast<std::size_t>(filled[static_cast<std::size_t>(e)]) * hidden;
        if (n > 0)
          std::copy_n(src + (src_is_staging ? staged : grouped), n * hidden, dst + (src_is_staging ? grouped : staged));
        filled[static_cast<std::size_t>(e)] += static_cast<std::int64_t>(n);
        staged += n * hidden;
      }
  }

  // Received rows before regrouping, grouped rows before sending; reused from call to call (a
  // fresh 100 MB buffer per call costs more in page faults than the copy into it).
  std::vector<Scalar> staging_;
  RowBlocks gather_;          // gather_to_experts' send blocks, capacity reused
  RowMatrix<Scalar> packed_;  // a strided input's rows, packed
};

MRR_NAMESPACE_END
