// MoELayer: one sparse-MoE block composed from policies at compile time — gate linear (hidden ->
// E logits, torch nn.Linear layout, no bias) -> router through RoutingReplay (record / replay
// happen here) -> dispatch to the ranks owning the experts -> experts -> combine weighted by the
// gating weights — with the backward pass w.r.t. the input, the gate weight and every expert.
//
// Output and every gradient are bitwise the same for any number of expert-parallel ranks P
// (global tokens split contiguously over the ranks), by construction (docs/expert-parallel.md):
//   - per-token work (gate logits, router, combine, input gradient) uses fixed-shape per-token
//     kernels on buffers of fixed alignment, never a GEMM whose blocking depends on the batch;
//   - each expert sees the same rows in the same order for any P: dispatch orders them by
//     (source rank, token), which is global token order;
//   - the gate-weight gradient is one GEMM over the gathered global batch, the same on every rank;
//   - each token's k expert outputs are summed in slot order (in at least fp32).
#pragma once

#include <mrr/comm/single_process.hpp>
#include <mrr/concepts.hpp>
#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>
#include <mrr/moe/placement.hpp>
#include <mrr/replay/none_store.hpp>
#include <mrr/replay/routing_replay.hpp>
#include <mrr/router/permute.hpp>
#include <mrr/router/routing.hpp>
#include <mrr/tensor.hpp>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

MRR_NAMESPACE_BEGIN

// Thrown on every other rank when one rank of an expert-parallel group failed in a layer step;
// the failing rank throws its own error.
class PeerRankError : public std::runtime_error {
 public:
  PeerRankError(int rank, const std::string& what) : std::runtime_error(what), rank_(rank) {}
  int rank() const { return rank_; }

 private:
  int rank_;
};

// What a forward keeps for its backward (pass it back to MoELayer::backward). Independent
// forwards give independent contexts, so pipeline schedules (F1 F2 B1 B2) and activation
// recomputation (re-run the forward, replayed from RoutingReplay's FIFO) both work.
template <class Scalar>
struct MoEForward {
  RowMatrix<Scalar> output;  // [tokens, hidden]
  Routing<Scalar> routing;   // this rank's tokens: global ids, weights, capacity mask

  // [tokens, num_experts] view of the gate logits.
  Eigen::Map<const RowMatrix<Scalar>, 0, Eigen::OuterStride<>> router_logits() const {
    return {logits.data(), logits.rows(), num_experts, Eigen::OuterStride<>(logits.cols())};
  }

  // Saved for backward.
  RowMatrix<Scalar> input;   // [tokens, hidden]
  RowMatrix<Scalar> logits;  // [tokens, padded experts]: every row starts at the buffer's alignment
  int num_experts = 0;
  ExpertPermutation permutation;                  // this rank's kept slots, expert-major
  std::vector<std::int64_t> recv_rows;            // [P * local experts] rows from each rank per local expert
  std::vector<RowMatrix<Scalar>> expert_inputs;   // per local expert, rows in (source rank, token) order
  RowMatrix<Scalar> expert_outputs;               // [permuted rows, hidden], this rank's slots
};

template <class Scalar, class Experts>
struct MoEGradients {
  RowMatrix<Scalar> input;                    // [tokens, hidden]
  RowMatrix<Scalar> gate_weight;              // [num_experts, hidden], the same on every rank
  typename Experts::gradients_type experts;  // this rank's experts
};

template <Router R, Expert X, class C = SingleProcess, class Store = NoRouteStore>
class MoELayer {
  using Comm = std::remove_cvref_t<C>;
  static_assert(Communicator<Comm>,
                "MoELayer: C must model mrr::Communicator (rank(), size(), barrier(), all_reduce_sum, all_gather, "
                "broadcast, all_to_all_v)");
  static_assert(RouteStoreOrNone<Store>, "MoELayer: Store must model mrr::RouteStore or be mrr::NoRouteStore");
  static_assert(std::is_same_v<typename R::scalar_type, typename X::scalar_type>,
                "MoELayer: the router and the experts must use the same scalar type");

 public:
  using scalar_type = typename R::scalar_type;
  using Scalar = scalar_type;
  // Combine accumulates in float32 at least.
  using Accum = std::conditional_t<(sizeof(Scalar) < sizeof(float)), float, Scalar>;
  using Forward = MoEForward<Scalar>;
  using Gradients = MoEGradients<Scalar, X>;

  // With replay: the layer routes through the model's controller as MoE layer `layer`.
  MoELayer(R router, X experts, C comm, RoutingReplay<Store>& replay, int layer)
      : router_(std::move(router)), experts_(std::move(experts)), comm_(std::forward<C>(comm)), replay_(&replay),
        layer_(layer) {
    init();
  }

  // Without replay (Store = NoRouteStore).
  MoELayer(R router, X experts, C comm = C{})
    requires std::is_same_v<Store, NoRouteStore>
      : router_(std::move(router)), experts_(std::move(experts)), comm_(std::forward<C>(comm)) {
    init();
  }

  int num_experts() const { return router_.num_experts(); }
  int topk() const { return router_.topk(); }
  int hidden_size() const { return experts_.hidden_size(); }
  int layer() const { return layer_; }
  const ExpertPlacement& placement() const { return placement_; }
  const R& router() const { return router_; }
  R& router() { return router_; }
  const X& experts() const { return experts_; }
  X& experts() { return experts_; }
  const Comm& comm() const { return comm_; }

  // Gate weight [num_experts, hidden] (nn.Linear layout, no bias); zero until set.
  const RowMatrix<Scalar>& gate_weight() const { return gate_weight_; }
  void set_gate_weight(MatrixRef<Scalar> weight) {
    detail::require(weight.rows() == num_experts() && weight.cols() == hidden_size(), "MoELayer::set_gate_weight",
                    "'weight' has shape ", detail::shape_of(weight), ", expected [", num_experts(), ", ",
                    hidden_size(), "]");
    gate_weight_ = weight;
  }

  // hidden [tokens, hidden] (this rank's tokens) -> context with the output [tokens, hidden].
  // Collective: every rank of the group calls it.
  Forward forward(MatrixRef<Scalar> hidden) {
    constexpr const char* fn = "MoELayer::forward";
    Forward f;
    agree(fn, [&] {
      detail::require(hidden.cols() == hidden_size(), fn, "'hidden' has shape ", detail::shape_of(hidden),
                      " but the layer's hidden_size is ", hidden_size());
      f.input = hidden;
      f.num_experts = num_experts();
      compute_logits(f);
      f.routing = route(f.router_logits());
      f.permutation = make_expert_permutation(f.routing, num_experts());
    });
    dispatch(f);
    std::vector<RowMatrix<Scalar>> outputs(f.expert_inputs.size());
    agree(fn, [&] {
      for (int e = 0; e < experts_per_rank(); ++e) {
        const auto i = static_cast<std::size_t>(e);
        outputs[i] = experts_.forward(e, f.expert_inputs[i]);
        detail::require(outputs[i].rows() == f.expert_inputs[i].rows() && outputs[i].cols() == hidden_size(), fn,
                        "local expert ", e, " returned shape ", detail::shape_of(outputs[i]), " for input ",
                        detail::shape_of(f.expert_inputs[i]));
      }
    });
    combine(f, outputs);
    return f;
  }

  // forward's communication steps on their own, so bench/ep can time dispatch + combine without
  // the gate and the experts. Collective. dispatch: f.input, f.permutation -> f.recv_rows,
  // f.expert_inputs (permute, count exchange, rows to the owners, regroup per local expert).
  // The staging buffers are the layer's, reused from call to call (a fresh 100 MB buffer per call
  // costs more in page faults than the copy into it); f's matrices are reused when their shapes
  // match. Same bytes, same order as permute_tokens + exchange + regroup.
  void dispatch(Forward& f) {
    const auto hidden = static_cast<std::size_t>(hidden_size());
    const auto rows = static_cast<std::size_t>(f.permutation.rows());
    send_buffer_.resize(rows * hidden);
    for (std::size_t r = 0; r < rows; ++r)  // permute: one pass, straight into the send buffer
      std::copy_n(f.input.row(f.permutation.source_token[r]).data(), hidden, send_buffer_.data() + r * hidden);
    // Counts per (source rank, local expert), then the rows, to the owners.
    f.recv_rows = exchange_counts(f.permutation.tokens_per_expert);
    const std::vector<std::size_t> recv_counts = received_counts(f.recv_rows);
    receive_buffer_.resize(total_of(recv_counts));
    exchange_rows_into(send_buffer_, local_counts(f.permutation), receive_buffer_, recv_counts);
    regroup_into(staged(receive_buffer_), f.recv_rows, f.expert_inputs);
  }

  // combine: the local experts' outputs (rows as in f.expert_inputs) -> f.expert_outputs (back on
  // the tokens' ranks) and f.output (each token's slots summed in slot order).
  void combine(Forward& f, const std::vector<RowMatrix<Scalar>>& outputs) {
    const std::vector<std::size_t> send_counts = received_counts(f.recv_rows);
    send_buffer_.resize(total_of(send_counts));
    ungroup_into(outputs, f.recv_rows, send_buffer_.data());
    const std::vector<std::size_t> recv_counts = local_counts(f.permutation);
    f.expert_outputs.resize(f.permutation.rows(), hidden_size());
    exchange_rows_into(send_buffer_, send_counts,
                       std::span<Scalar>(f.expert_outputs.data(), static_cast<std::size_t>(f.expert_outputs.size())),
                       recv_counts);
    combine_rows_into(f.expert_outputs, f.routing, f.permutation, nullptr, f.output);
  }

  // Gradients of sum(forward.output * grad_output) w.r.t. the input (this rank's tokens), the
  // gate weight (whole, identical on every rank) and this rank's experts. Collective.
  Gradients backward(const Forward& f, MatrixRef<Scalar> grad_output) {
    constexpr const char* fn = "MoELayer::backward";
    const Eigen::Index tokens = f.input.rows();
    const int k = topk();
    agree(fn, [&] {
      detail::require(f.num_experts == num_experts() &&
                          f.expert_inputs.size() == static_cast<std::size_t>(experts_per_rank()),
                      fn, "the forward context comes from another layer");
      detail::require(grad_output.rows() == tokens && grad_output.cols() == hidden_size(), fn, "'grad_output' has shape ",
                      detail::shape_of(grad_output), " for an output of shape ", detail::shape_of(f.output));
    });
    // d weights[t, j] = <grad_output[t], y[t, j]>, a fixed-order dot per slot; d y = w * grad_output.
    RowMatrix<Scalar> grad_weights = RowMatrix<Scalar>::Zero(tokens, k);
    RowMatrix<Scalar> grad_expert_out(f.expert_outputs.rows(), hidden_size());
    for (Eigen::Index t = 0; t < tokens; ++t)
      for (int j = 0; j < k; ++j) {
        const auto row = f.permutation.row_of_slot(t, j);
        if (row < 0) continue;
        Accum dot = 0;
        for (int h = 0; h < hidden_size(); ++h)
          dot += static_cast<Accum>(grad_output(t, h)) * static_cast<Accum>(f.expert_outputs(row, h));
        grad_weights(t, j) = static_cast<Scalar>(dot);
        grad_expert_out.row(row) = grad_output.row(t) * f.routing.weights(t, j);
      }
    const RowMatrix<Scalar> received =
        exchange_rows(grad_expert_out, local_counts(f.permutation), received_counts(f.recv_rows));
    const std::vector<RowMatrix<Scalar>> grad_outputs = regroup(received, f.recv_rows);
    Gradients g{RowMatrix<Scalar>(), RowMatrix<Scalar>(), experts_.zero_gradients()};
    std::vector<RowMatrix<Scalar>> grad_inputs(grad_outputs.size());
    RowMatrix<Scalar> grad_logits;
    agree(fn, [&] {
      for (int e = 0; e < experts_per_rank(); ++e) {
        const auto i = static_cast<std::size_t>(e);
        grad_inputs[i] = experts_.backward(e, f.expert_inputs[i], grad_outputs[i], g.experts);
        detail::require(grad_inputs[i].rows() == f.expert_inputs[i].rows() && grad_inputs[i].cols() == hidden_size(),
                        fn, "local expert ", e, " returned an input gradient of shape ",
                        detail::shape_of(grad_inputs[i]), " for input ", detail::shape_of(f.expert_inputs[i]));
      }
      grad_logits = router_.backward(f.router_logits(), f.routing, grad_weights);
    });
    const RowMatrix<Scalar> grad_expert_in =
        exchange_rows(ungroup(grad_inputs, f.recv_rows), received_counts(f.recv_rows), local_counts(f.permutation));
    g.input = combine_rows(grad_expert_in, f.routing, f.permutation, &grad_logits);
    g.gate_weight = gate_weight_gradient(f.input, grad_logits);
    return g;
  }

 private:
  int experts_per_rank() const { return placement_.experts_per_rank(); }
  int ranks() const { return placement_.ranks(); }

  // Every row of the logits buffer starts at a multiple of 64 bytes from the (aligned) start, so
  // the router's vectorised row reductions peel the same way for every token and every P.
  static Eigen::Index padded_experts(int num_experts) {
    constexpr Eigen::Index per_line = 64 / static_cast<Eigen::Index>(sizeof(Scalar));
    return (num_experts + per_line - 1) / per_line * per_line;
  }

  void init() {
    constexpr const char* fn = "MoELayer";
    const int p = static_cast<int>(comm_.size());
    const int r = static_cast<int>(comm_.rank());
    // Local checks first, but every rank reaches the digest exchange so none is left waiting.
    std::string local_error;
    try {
      placement_ = ExpertPlacement::contiguous(router_.num_experts(), p);
      detail::require(experts_.num_experts() == placement_.experts_per_rank() &&
                          experts_.first_expert() == placement_.first_expert(r),
                      fn, "rank ", r, " holds experts [", experts_.first_expert(), ", ",
                      experts_.first_expert() + experts_.num_experts(), ") but contiguous placement of ",
                      router_.num_experts(), " experts over ", p, " ranks gives it [", placement_.first_expert(r), ", ",
                      placement_.first_expert(r) + placement_.experts_per_rank(), ")");
      if constexpr (!std::is_same_v<Store, NoRouteStore>) {
        const RouteShape& shape = replay_->store().shape();
        detail::require(layer_ >= 0 && layer_ < shape.num_layers, fn, "layer ", layer_, " outside the store's [0, ",
                        shape.num_layers, ")");
      }
    } catch (const std::exception& e) {
      local_error = e.what();
    }
    gate_weight_ = RowMatrix<Scalar>::Zero(router_.num_experts(), experts_.hidden_size());
    // Configuration digest: ranks must agree on the model and on the group.
    constexpr int fields = 8;
    const std::array<std::int64_t, fields> mine = {local_error.empty() ? 0 : 1,
                                                   router_.num_experts(),
                                                   router_.topk(),
                                                   experts_.hidden_size(),
                                                   experts_.intermediate_size(),
                                                   p,
                                                   static_cast<std::int64_t>(sizeof(Scalar)),
                                                   experts_.first_expert()};
    std::vector<std::int64_t> all(static_cast<std::size_t>(p * fields));
    comm_.all_gather(std::span<const std::int64_t>(mine), std::span<std::int64_t>(all));
    if (!local_error.empty()) throw InvalidArgument(local_error);
    static constexpr std::array<const char*, fields> names = {
        "", "num_experts", "topk", "hidden_size", "intermediate_size", "group size", "scalar size", ""};
    for (int s = 0; s < p; ++s) {
      const std::int64_t* theirs = all.data() + s * fields;
      if (theirs[0] != 0)
        throw PeerRankError(s, detail::str("mrr::", fn, ": rank ", s, " of ", p,
                                           " rejected its configuration (its own error names the cause)"));
      for (int i = 1; i < fields - 1; ++i)
        if (theirs[i] != mine[static_cast<std::size_t>(i)])
          throw InvalidArgument(detail::str("mrr::", fn, ": ranks disagree on ", names[static_cast<std::size_t>(i)],
                                            ": rank ", r, " has ", mine[static_cast<std::size_t>(i)], ", rank ", s,
                                            " has ", theirs[i]));
      if (theirs[fields - 1] != placement_.first_expert(s))
        throw InvalidArgument(detail::str("mrr::", fn, ": rank ", s, " holds experts from ", theirs[fields - 1],
                                          " but contiguous placement gives it [", placement_.first_expert(s), ", ",
                                          placement_.first_expert(s) + placement_.experts_per_rank(), ")"));
    }
  }

  // Runs a step that can fail on one rank, then tells every rank: the failing rank rethrows its
  // error, the others throw PeerRankError naming it (with its message), so no rank hangs in the
  // next collective.
  template <class F>
  void agree(const char* fn, F&& step) {
    constexpr std::size_t words = 32;  // 8 bytes of message each
    std::exception_ptr error;
    std::array<std::int64_t, 1 + words> mine{};
    try {
      step();
    } catch (const std::exception& e) {
      error = std::current_exception();
      const std::string what = e.what();
      std::memcpy(mine.data() + 1, what.data(), std::min(what.size(), words * 8 - 1));
      mine[0] = 1;
    } catch (...) {
      error = std::current_exception();
      mine[0] = 1;
    }
    const int p = ranks();
    std::vector<std::int64_t> all(static_cast<std::size_t>(p) * mine.size());
    comm_.all_gather(std::span<const std::int64_t>(mine), std::span<std::int64_t>(all));
    if (error) std::rethrow_exception(error);
    for (int s = 0; s < p; ++s) {
      const std::int64_t* theirs = all.data() + static_cast<std::size_t>(s) * mine.size();
      if (theirs[0] == 0) continue;
      char message[words * 8] = {};
      std::memcpy(message, theirs + 1, words * 8 - 1);
      throw PeerRankError(s, detail::str("mrr::", fn, ": rank ", s, " of ", p, " failed: ", message));
    }
  }

  Routing<Scalar> route(MatrixRef<Scalar> logits) {
    if constexpr (std::is_same_v<Store, NoRouteStore>)
      return router_.route(logits);
    else
      return replay_->route(router_, layer_, logits);
  }

  // Per-token GEMV on an aligned copy of the token: the same kernel, shape and alignment for every
  // token whatever the batch size (a batch GEMM's result per row depends on its blocking).
  void compute_logits(Forward& f) const {
    const Eigen::Index tokens = f.input.rows();
    f.logits = RowMatrix<Scalar>::Zero(tokens, padded_experts(num_experts()));
    Vector<Scalar> x(hidden_size()), z(num_experts());
    for (Eigen::Index t = 0; t < tokens; ++t) {
      x = f.input.row(t).transpose();
      z.noalias() = gate_weight_ * x;
      f.logits.row(t).head(num_experts()) = z.transpose();
    }
  }

  // Elements this rank sends to each rank: its kept rows per owner's block of experts.
  std::vector<std::size_t> local_counts(const ExpertPermutation& p) const {
    std::vector<std::size_t> counts(static_cast<std::size_t>(ranks()), 0);
    for (int e = 0; e < num_experts(); ++e)
      counts[static_cast<std::size_t>(placement_.owner(e))] +=
          static_cast<std::size_t>(p.tokens_per_expert[static_cast<std::size_t>(e)]);
    for (auto& c : counts) c *= static_cast<std::size_t>(hidden_size());
    return counts;
  }

  // Elements this rank receives from each rank.
  std::vector<std::size_t> received_counts(const std::vector<std::int64_t>& recv_rows) const {
    std::vector<std::size_t> counts(static_cast<std::size_t>(ranks()), 0);
    const int per = experts_per_rank();
    for (int s = 0; s < ranks(); ++s)
      for (int e = 0; e < per; ++e)
        counts[static_cast<std::size_t>(s)] += static_cast<std::size_t>(recv_rows[static_cast<std::size_t>(s * per + e)]);
    for (auto& c : counts) c *= static_cast<std::size_t>(hidden_size());
    return counts;
  }

  // Rows per (source rank, local expert) that this rank will receive.
  std::vector<std::int64_t> exchange_counts(const std::vector<std::int64_t>& tokens_per_expert) const {
    const auto per = static_cast<std::size_t>(experts_per_rank());
    const std::vector<std::size_t> counts(static_cast<std::size_t>(ranks()), per);
    std::vector<std::int64_t> recv(static_cast<std::size_t>(ranks()) * per);
    comm_.all_to_all_v(std::span<const std::int64_t>(tokens_per_expert), std::span<const std::size_t>(counts),
                       std::span<std::int64_t>(recv), std::span<const std::size_t>(counts));
    return recv;
  }

  RowMatrix<Scalar> exchange_rows(const RowMatrix<Scalar>& send, const std::vector<std::size_t>& send_counts,
                                  const std::vector<std::size_t>& recv_counts) const {
    const std::size_t total = total_of(recv_counts);
    RowMatrix<Scalar> recv(static_cast<Eigen::Index>(total / static_cast<std::size_t>(hidden_size())), hidden_size());
    exchange_rows_into(std::span<const Scalar>(send.data(), static_cast<std::size_t>(send.size())), send_counts,
                       std::span<Scalar>(recv.data(), total), recv_counts);
    return recv;
  }

  void exchange_rows_into(std::span<const Scalar> send, const std::vector<std::size_t>& send_counts,
                          std::span<Scalar> recv, const std::vector<std::size_t>& recv_counts) const {
    comm_.all_to_all_v(send, std::span<const std::size_t>(send_counts), recv,
                       std::span<const std::size_t>(recv_counts));
  }

  static std::size_t total_of(const std::vector<std::size_t>& counts) {
    std::size_t total = 0;
    for (auto c : counts) total += c;
    return total;
  }

  // A staging buffer as [rows, hidden] rows.
  Eigen::Map<const RowMatrix<Scalar>> staged(const std::vector<Scalar>& buffer) const {
    return {buffer.data(), static_cast<Eigen::Index>(buffer.size() / static_cast<std::size_t>(hidden_size())),
            hidden_size()};
  }

  // Received rows (blocks by source rank, each expert-major) -> one matrix per local expert with
  // its rows in (source rank, token) order: global token order for contiguous token chunks.
  std::vector<RowMatrix<Scalar>> regroup(const RowMatrix<Scalar>& received, const std::vector<std::int64_t>& recv_rows) const {
    std::vector<RowMatrix<Scalar>> out;
    regroup_into(received, recv_rows, out);
    return out;
  }

  // regroup into `out`, keeping the matrices whose shapes already match.
  void regroup_into(MatrixRef<Scalar> received, const std::vector<std::int64_t>& recv_rows,
                    std::vector<RowMatrix<Scalar>>& out) const {
    const int per = experts_per_rank();
    out.resize(static_cast<std::size_t>(per));
    for (int e = 0; e < per; ++e) {
      std::int64_t n = 0;
      for (int s = 0; s < ranks(); ++s) n += recv_rows[static_cast<std::size_t>(s * per + e)];
      out[static_cast<std::size_t>(e)].resize(n, hidden_size());
    }
    std::vector<std::int64_t> filled(static_cast<std::size_t>(per), 0);
    Eigen::Index row = 0;
    for (int s = 0; s < ranks(); ++s)
      for (int e = 0; e < per; ++e) {
        const auto n = recv_rows[static_cast<std::size_t>(s * per + e)];
        auto& dst = out[static_cast<std::size_t>(e)];
        dst.middleRows(filled[static_cast<std::size_t>(e)], n) = received.middleRows(row, n);
        filled[static_cast<std::size_t>(e)] += n;
        row += n;
      }
  }

  // The mirror of regroup: per-expert rows back into blocks by destination rank.
  RowMatrix<Scalar> ungroup(const std::vector<RowMatrix<Scalar>>& per_expert,
                            const std::vector<std::int64_t>& recv_rows) const {
    Eigen::Index total = 0;
    for (const auto& m : per_expert) total += m.rows();
    RowMatrix<Scalar> out(total, hidden_size());
    ungroup_into(per_expert, recv_rows, out.data());
    return out;
  }

  // ungroup into `out` (room for every row).
  void ungroup_into(const std::vector<RowMatrix<Scalar>>& per_expert, const std::vector<std::int64_t>& recv_rows,
                    Scalar* out) const {
    const int per = experts_per_rank();
    const auto hidden = static_cast<std::size_t>(hidden_size());
    std::vector<std::int64_t> taken(static_cast<std::size_t>(per), 0);
    std::size_t at = 0;
    for (int s = 0; s < ranks(); ++s)
      for (int e = 0; e < per; ++e) {
        const auto n = static_cast<std::size_t>(recv_rows[static_cast<std::size_t>(s * per + e)]);
        const auto& src = per_expert[static_cast<std::size_t>(e)];
        if (n > 0) std::copy_n(src.row(taken[static_cast<std::size_t>(e)]).data(), n * hidden, out + at);
        taken[static_cast<std::size_t>(e)] += static_cast<std::int64_t>(n);
        at += n * hidden;
      }
  }

  // out[t] = sum over kept slots j, in slot order, of weight[t, j] * rows[row(t, j)] (forward), or
  // of rows[row(t, j)] plus gate_weight^T grad_logits[t] (input gradient), accumulated in Accum
  // in an aligned buffer: element-wise operations only, so no result depends on P.
  RowMatrix<Scalar> combine_rows(const RowMatrix<Scalar>& rows, const Routing<Scalar>& routing,
                                 const ExpertPermutation& p, const RowMatrix<Scalar>* grad_logits) const {
    RowMatrix<Scalar> out;
    combine_rows_into(rows, routing, p, grad_logits, out);
    return out;
  }

  void combine_rows_into(const RowMatrix<Scalar>& rows, const Routing<Scalar>& routing, const ExpertPermutation& p,
                         const RowMatrix<Scalar>* grad_logits, RowMatrix<Scalar>& out) const {
    const Eigen::Index tokens = routing.tokens();
    out.resize(tokens, hidden_size());
    Vector<Accum> acc(hidden_size());
    Vector<Scalar> dz(num_experts()), dx(hidden_size());
    for (Eigen::Index t = 0; t < tokens; ++t) {
      acc.setZero();
      for (int j = 0; j < routing.topk(); ++j) {
        const auto row = p.row_of_slot(t, j);
        if (row < 0) continue;
        if (grad_logits)
          acc += rows.row(row).transpose().template cast<Accum>();
        else
          acc += rows.row(row).transpose().template cast<Accum>() * static_cast<Accum>(routing.weights(t, j));
      }
      if (grad_logits) {
        dz = grad_logits->row(t).transpose();
        dx.noalias() = gate_weight_.transpose() * dz;
        acc += dx.template cast<Accum>();
      }
      out.row(t) = acc.transpose().template cast<Scalar>();
    }
  }

  // d gate_weight = grad_logits^T @ input over the global batch. Every rank gathers the per-token
  // terms of all ranks (rank order = global token order) and runs the same GEMM on the same
  // [global tokens, .] matrices as P = 1 does, so the result is bitwise independent of P.
  RowMatrix<Scalar> gate_weight_gradient(const RowMatrix<Scalar>& input, const RowMatrix<Scalar>& grad_logits) const {
    const int p = ranks();
    const int num_e = num_experts(), hidden = hidden_size();
    const std::array<std::int64_t, 1> mine = {input.rows()};
    std::vector<std::int64_t> tokens(static_cast<std::size_t>(p));
    comm_.all_gather(std::span<const std::int64_t>(mine), std::span<std::int64_t>(tokens));
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
    comm_.all_gather(std::span<const Scalar>(send), std::span<Scalar>(all));
    RowMatrix<Scalar> dz(global, num_e), x(global, hidden);
    Eigen::Index row = 0;
    for (int s = 0; s < p; ++s)
      for (std::int64_t t = 0; t < tokens[static_cast<std::size_t>(s)]; ++t, ++row) {
        const Scalar* src = all.data() + (static_cast<std::size_t>(s) * static_cast<std::size_t>(most) +
                                          static_cast<std::size_t>(t)) * stride;
        for (int e = 0; e < num_e; ++e) dz(row, e) = src[e];
        for (int h = 0; h < hidden; ++h) x(row, h) = src[num_e + h];
      }
    return dz.transpose() * x;
  }

  R router_;
  X experts_;
  C comm_;
  RoutingReplay<Store>* replay_ = nullptr;
  int layer_ = 0;
  ExpertPlacement placement_ = ExpertPlacement::contiguous(1, 1);
  RowMatrix<Scalar> gate_weight_;
  std::vector<Scalar> send_buffer_, receive_buffer_;  // dispatch/combine staging, reused across calls
};

MRR_NAMESPACE_END
