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
    for (std::size_t s = 0; s < p; ++s)
      for (std::size_t e = 0; e < per; ++e)
        plan.recv_counts[s] += static_cast<std::size_t>(plan.recv_rows[s * per + e]) * static_cast<std::size_t>(plan.hidden);
  }

  // permuted [plan rows, hidden] -> per_expert[e]: local expert e's rows in (source rank, token)
  // order. Matrices already of the right shape are reused. Collective.
  template <Communicator C>
  void to_experts(const C& comm, MatrixRef<Scalar> permuted, const DispatchPlan& plan,
                  std::vector<RowMatrix<Scalar>>& per_expert) {
    staging_.resize(plan.received_elements());
    comm.all_to_all_v(std::span<const Scalar>(permuted.data(), static_cast<std::size_t>(permuted.size())),
                      std::span<const std::size_t>(plan.send_counts), std::span<Scalar>(staging_),
                      std::span<const std::size_t>(plan.recv_counts));
    regroup(plan, per_expert);
  }

  // The mirror: per_expert (rows as to_experts gave them) -> permuted [plan rows, hidden], back on
  // the tokens' rank in its permuted order. Collective.
  template <Communicator C>
  void from_experts(const C& comm, const std::vector<RowMatrix<Scalar>>& per_expert, const DispatchPlan& plan,
                    RowMatrix<Scalar>& permuted) {
    staging_.resize(plan.received_elements());
    ungroup(plan, per_expert);
    permuted.resize(plan.permutation.rows(), plan.hidden);
    comm.all_to_all_v(std::span<const Scalar>(staging_), std::span<const std::size_t>(plan.recv_counts),
                      std::span<Scalar>(permuted.data(), static_cast<std::size_t>(permuted.size())),
                      std::span<const std::size_t>(plan.send_counts));
  }

 private:
  // staging_ (blocks by source rank, each expert-major) -> one matrix per local expert.
  void regroup(const DispatchPlan& plan, std::vector<RowMatrix<Scalar>>& out) const {
    const int per = plan.experts_per_rank;
    out.resize(static_cast<std::size_t>(per));
    for (int e = 0; e < per; ++e) {
      std::int64_t n = 0;
      for (int s = 0; s < plan.ranks(); ++s) n += plan.rows_from(s, e);
      out[static_cast<std::size_t>(e)].resize(n, plan.hidden);
    }
    const auto hidden = static_cast<std::size_t>(plan.hidden);
    std::vector<std::int64_t> filled(static_cast<std::size_t>(per), 0);
    const Scalar* src = staging_.data();
    for (int s = 0; s < plan.ranks(); ++s)
      for (int e = 0; e < per; ++e) {
        const auto n = static_cast<std::size_t>(plan.rows_from(s, e));
        auto& dst = out[static_cast<std::size_t>(e)];
        if (n > 0) std::copy_n(src, n * hidden, dst.row(filled[static_cast<std::size_t>(e)]).data());
        filled[static_cast<std::size_t>(e)] += static_cast<std::int64_t>(n);
        src += n * hidden;
      }
  }

  // per-expert rows -> staging_, in blocks by destination rank.
  void ungroup(const DispatchPlan& plan, const std::vector<RowMatrix<Scalar>>& per_expert) {
    const int per = plan.experts_per_rank;
    const auto hidden = static_cast<std::size_t>(plan.hidden);
    std::vector<std::int64_t> taken(static_cast<std::size_t>(per), 0);
    Scalar* dst = staging_.data();
    for (int s = 0; s < plan.ranks(); ++s)
      for (int e = 0; e < per; ++e) {
        const auto n = static_cast<std::size_t>(plan.rows_from(s, e));
        if (n > 0) std::copy_n(per_expert[static_cast<std::size_t>(e)].row(taken[static_cast<std::size_t>(e)]).data(), n * hidden, dst);
        taken[static_cast<std::size_t>(e)] += static_cast<std::int64_t>(n);
        dst += n * hidden;
      }
  }

  // Received rows before regrouping, ungrouped rows before sending; reused from call to call (a
  // fresh 100 MB buffer per call costs more in page faults than the copy into it).
  std::vector<Scalar> staging_;
};

MRR_NAMESPACE_END
