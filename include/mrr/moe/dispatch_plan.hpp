// DispatchPlan: where one rank's routed (token, slot) pairs go under expert parallelism and what
// comes back — the expert-major permutation and the rows exchanged with every rank. Computed once
// per forward (kept in the forward context), then read by the token exchange in both directions
// of the forward and the backward, and by combine.
#pragma once

#include <mrr/comm/row_blocks.hpp>
#include <mrr/detail/config.hpp>
#include <mrr/moe/placement.hpp>
#include <mrr/router/permute.hpp>
#include <mrr/router/routing.hpp>

#include <cstddef>
#include <cstdint>
#include <vector>

MRR_NAMESPACE_BEGIN

struct DispatchPlan {
  ExpertPermutation permutation;   // this rank's kept slots, expert-major
  std::vector<std::int64_t> recv_rows;  // [P * local experts]: rows from rank s for local expert e at s * per + e
  // Elements ([rows] * hidden) per rank, in the dispatch direction; combine's return runs them
  // the other way.
  std::vector<std::size_t> send_counts;  // this rank's permuted rows, by the owner of their expert
  std::vector<std::size_t> recv_counts;  // the rows every rank sends this one
  // [local experts + 1]: local expert e's received rows are [local_offsets[e], local_offsets[e + 1])
  // of the expert-major matrix the exchange hands the experts.
  std::vector<std::int64_t> local_offsets;
  // The same rows as block lists (comm/row_blocks.hpp), for communicators that move rows in place:
  // by source rank, its rows for each local expert in the expert-major matrix; by owner rank, its
  // block of this rank's permuted rows.
  RowBlocks grouped_blocks, permuted_blocks;
  int experts_per_rank = 0;
  int hidden = 0;

  int ranks() const { return static_cast<int>(send_counts.size()); }
  std::int64_t rows_from(int rank, int local_expert) const {
    return recv_rows[static_cast<std::size_t>(rank * experts_per_rank + local_expert)];
  }
  std::int64_t local_rows() const { return local_offsets.empty() ? 0 : local_offsets.back(); }
  std::size_t received_elements() const {
    std::size_t total = 0;
    for (auto c : recv_counts) total += c;
    return total;
  }
};

// The plan's local half: the permutation of `routing` (its ids checked against the experts) and
// what this rank sends each owner. The receive side needs the count exchange
// (TokenExchange::exchange_counts), a collective.
template <class T>
DispatchPlan make_dispatch_plan(const Routing<T>& routing, const ExpertPlacement& placement, int hidden) {
  DispatchPlan plan;
  plan.permutation = make_expert_permutation(routing, placement.num_experts());
  plan.experts_per_rank = placement.experts_per_rank();
  plan.hidden = hidden;
  plan.send_counts.assign(static_cast<std::size_t>(placement.ranks()), 0);
  for (int e = 0; e < placement.num_experts(); ++e)
    plan.send_counts[static_cast<std::size_t>(placement.owner(e))] +=
        static_cast<std::size_t>(plan.permutation.tokens_per_expert[static_cast<std::size_t>(e)]) *
        static_cast<std::size_t>(hidden);
  return plan;
}

MRR_NAMESPACE_END
