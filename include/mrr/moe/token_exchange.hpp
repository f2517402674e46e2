// TokenExchange: the expert-parallel exchange of a DispatchPlan's rows. To the experts: rows in
// this rank's permuted (expert-major) order go to the ranks owning their experts and are regrouped
// per local expert in (source rank, token) order — global token order for contiguous token chunks,
// so each expert sees the same rows in the same order for any P. From the experts: the mirror.
// The forward's dispatch and combine and the backward's two exchanges all run these two steps.
#pragma once

#include <mrr/concepts.hpp>
#include <mrr/detail/config.hpp>
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
  }

  // permuted [plan rows, hidden] -> grouped [plan.local_rows(), hidden]: the local experts' rows,
  // expert-major, each expert's in (source rank, token) order (plan.local_offsets). grouped keeps
  // its storage when its shape does not change. With one rank the two orders are the same and
  // this is a copy (MoELayer skips it). Collective.
  template <Communicator C>
  void to_experts(const C& comm, MatrixRef<Scalar> permuted, const DispatchPlan& plan, RowMatrix<Scalar>& grouped) {
    grouped.resize(plan.local_rows(), plan.hidden);
    if (plan.ranks() == 1) {
      exchange(comm, permuted.data(), plan.send_counts, grouped.data(), plan.recv_counts);
      return;
    }
    staging_.resize(plan.received_elements());
    exchange(comm, permuted.data(), plan.send_counts, staging_.data(), plan.recv_counts);
    move_blocks(plan, staging_.data(), grouped.data(), /*src_is_staging=*/true);
  }

  // The mirror: grouped (rows as to_experts gave them) -> permuted [plan rows, hidden], back on
  // the tokens' rank in its permuted order. Collective.
  template <Communicator C>
  void from_experts(const C& comm, MatrixRef<Scalar> grouped, const DispatchPlan& plan, RowMatrix<Scalar>& permuted) {
    permuted.resize(plan.permutation.rows(), plan.hidden);
    if (plan.ranks() == 1) {
      exchange(comm, grouped.data(), plan.recv_counts, permuted.data(), plan.send_counts);
      return;
    }
    staging_.resize(plan.received_elements());
    move_blocks(plan, grouped.data(), staging_.data(), /*src_is_staging=*/false);
    exchange(comm, staging_.data(), plan.recv_counts, permuted.data(), plan.send_counts);
  }

 private:
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
};

MRR_NAMESPACE_END
