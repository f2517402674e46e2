// MoELayer: one sparse-MoE block composed from policies at compile time — the gate (hidden -> E
// logits, mrr/moe/gate.hpp) -> router through RoutingReplay (record / replay happen here) ->
// dispatch to the ranks owning the experts (a DispatchPlan run by a TokenExchange) -> experts ->
// combine weighted by the gating weights (mrr/router/permute.hpp) — with the backward pass w.r.t.
// the input, the gate weight and every expert. A step that can fail on one rank runs under
// agree_on_step (mrr/comm/agreement.hpp), so every rank fails with it instead of waiting.
//
// Output and every gradient are bitwise the same for any number of expert-parallel ranks P
// (global tokens split contiguously over the ranks), by construction (docs/expert-parallel.md):
//   - per-token work (router, combine, input gradient) uses fixed-shape per-token kernels on
//     buffers of fixed alignment; the gate's logits and input gradient are GEMMs whose every row
//     goes through the same micro-kernel (detail/row_gemm.hpp), so a token's row is its own;
//   - each expert sees the same rows in the same order for any P: dispatch orders them by
//     (source rank, token), which is global token order;
//   - the gate-weight gradient is one GEMM over the gathered global batch, the same on every rank;
//   - each token's k expert outputs are summed in slot order (in at least fp32);
//   - and for any OpenMP thread count: experts run in parallel, each on one thread (Eigen's
//     threaded GEMM would block by the thread count); row loops use fixed tiles.
// Workspace (the exchange's staging, the experts' outputs, the backward's intermediates) is kept
// by the layer and reused; forward(hidden, f) and backward_accumulate(f, dy, g) also reuse the
// caller's context and gradients, so a training step allocates nothing once warm. With one rank
// the experts read and write the permuted rows in place (no exchange copies).
#pragma once

#include <mrr/comm/agreement.hpp>
#include <mrr/comm/single_process.hpp>
#include <mrr/concepts.hpp>
#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>
#include <mrr/moe/dispatch_plan.hpp>
#include <mrr/moe/gate.hpp>
#include <mrr/moe/placement.hpp>
#include <mrr/moe/token_exchange.hpp>
#include <mrr/replay/none_store.hpp>
#include <mrr/replay/routing_replay.hpp>
#include <mrr/router/aux_loss.hpp>
#include <mrr/router/config.hpp>
#include <mrr/router/permute.hpp>
#include <mrr/router/routing.hpp>
#include <mrr/tensor.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

MRR_NAMESPACE_BEGIN

// What a forward keeps for its backward (pass it back to MoELayer::backward). Independent
// forwards give independent contexts, so pipeline schedules (F1 F2 B1 B2) and activation
// recomputation (re-run the forward, replayed from RoutingReplay's FIFO) both work. It is the
// forward's DispatchPlan (permutation, recv_rows, counts), which its backward exchanges run again.
template <class Scalar>
struct MoEForward : DispatchPlan {
  RowMatrix<Scalar> output;  // [tokens, hidden]
  Routing<Scalar> routing;   // this rank's tokens: global ids, weights, capacity mask

  // [tokens, num_experts] view of the gate logits.
  Eigen::Map<const RowMatrix<Scalar>, 0, Eigen::OuterStride<>> router_logits() const {
    return {logits.data(), logits.rows(), num_experts, Eigen::OuterStride<>(logits.cols())};
  }
  const DispatchPlan& plan() const { return *this; }

  // Saved for backward.
  RowMatrix<Scalar> input;   // [tokens, hidden]
  RowMatrix<Scalar> logits;  // [tokens, padded experts]: every row starts at the buffer's alignment
  int num_experts = 0;
  // [plan.local_rows(), hidden]: the local experts' input rows, expert-major, each expert's in
  // (source rank, token) order; local expert e's are expert_input(e).
  RowMatrix<Scalar> expert_inputs;
  RowMatrix<Scalar> expert_outputs;  // [permuted rows, hidden], this rank's slots
  // [plan.local_rows(), activation size] when the experts save their activations (rows as in
  // expert_inputs); empty otherwise, or when the layer recomputes them (save_activations(false)).
  RowMatrix<Scalar> expert_activations;

  // The router's auxiliary losses on this rank's tokens (its config's aux_loss_coeff and
  // z_loss_coeff, Megatron's switch load balancing and z-loss, coefficients included; 0 when off),
  // padding rows left out, and their gradient w.r.t. router_logits() [tokens, num_experts], which
  // backward adds to the router's (as Megatron's MoEAuxLossAutoScaler does). Empty when both are
  // off. A caller may add a loss's gradient of its own here between forward and backward (assign
  // it when the matrix is empty), e.g. sequence_aux_loss's, which needs each sequence's rows.
  Scalar aux_loss = 0, z_loss = 0;
  RowMatrix<Scalar> aux_grad_logits;

  auto expert_input(int local_expert) const {
    const auto e = static_cast<std::size_t>(local_expert);
    return expert_inputs.middleRows(local_offsets[e], local_offsets[e + 1] - local_offsets[e]);
  }
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
      : router_(std::move(router), replay, layer), experts_(std::move(experts)), comm_(std::forward<C>(comm)),
        gate_(num_experts(), experts_.hidden_size()) {
    init();
  }

  // Without replay (Store = NoRouteStore).
  MoELayer(R router, X experts, C comm = C{})
    requires std::is_same_v<Store, NoRouteStore>
      : router_(std::move(router)), experts_(std::move(experts)), comm_(std::forward<C>(comm)),
        gate_(num_experts(), experts_.hidden_size()) {
    init();
  }

  int num_experts() const { return router().num_experts(); }
  int topk() const { return router().topk(); }
  int hidden_size() const { return experts_.hidden_size(); }
  int layer() const { return router_.layer(); }
  const ExpertPlacement& placement() const { return placement_; }
  const R& router() const { return router_.router(); }
  R& router() { return router_.router(); }
  const X& experts() const { return experts_; }
  X& experts() { return experts_; }
  const Comm& comm() const { return comm_; }

  // Experts that can (ExpertSavingActivations, e.g. SwiGLUExperts) save their activations in the
  // forward context, and backward reads them instead of recomputing (the same bits): faster, at
  // activation_size() scalars per routed row (2 x intermediate for SwiGLU). On by default, as
  // autograd does; false recomputes them in backward and keeps only the expert inputs.
  void save_activations(bool on) { save_activations_ = on; }
  bool saves_activations() const { return save_activations_ && ExpertSavingActivations<X>; }

  // Gate weight [num_experts, hidden] (nn.Linear layout, no bias); zero until set.
  const RowMatrix<Scalar>& gate_weight() const { return gate_.weight(); }
  void set_gate_weight(MatrixRef<Scalar> weight) { gate_.set_weight(weight, "MoELayer::set_gate_weight"); }

  // hidden [tokens, hidden] (this rank's tokens) -> context with the output [tokens, hidden].
  // Collective: every rank of the group calls it.
  Forward forward(MatrixRef<Scalar> hidden) {
    Forward f;
    forward(hidden, f);
    return f;
  }

  // The same into a context the caller keeps (one per micro-batch in flight): its matrices are
  // reused when their shapes match, so a training loop allocates nothing per step. The results
  // are the same bits as forward(hidden).
  //
  // A forward that fails (here or, through the agreement, on another rank) after its router ran
  // undoes what the routing did to the replay queue (RoutingReplay::revert_route): ids it queued
  // for a recompute are dropped, ids a recompute took are queued again.
  void forward(MatrixRef<Scalar> hidden, Forward& f) {
    constexpr const char* fn = "MoELayer::forward";
    bool routed = false;
    try {
      agree_on_step(comm_, fn, [&] {
        detail::require(hidden.cols() == hidden_size(), fn, "'hidden' has shape ", detail::shape_of(hidden),
                        " but the layer's hidden_size is ", hidden_size());
        f.input = hidden;
        zero_nonfinite_padding(f.input);
        f.num_experts = num_experts();
        gate_.logits_into(f.logits, f.input);
        f.routing = router_.forward(f.router_logits());
        routed = true;
        auxiliary_losses(f);
        static_cast<DispatchPlan&>(f) = make_dispatch_plan(f.routing, placement_, hidden_size());
      });
      dispatch(f);
      // With one rank the experts' rows are the permuted rows: they write f.expert_outputs directly.
      RowMatrix<Scalar>& out = single_rank() ? f.expert_outputs : expert_rows_;
      out.resize(f.local_rows(), hidden_size());
      agree_on_step(comm_, fn, [&] { run_experts_forward(f, out, fn); });
      combine(f, out);
    } catch (...) {
      if (routed) router_.revert_forward();
      throw;
    }
  }

  // forward's communication steps on their own, so bench/ep can time dispatch + combine without
  // the gate and the experts. Collective. dispatch: f.input and f's plan -> the plan's receive
  // side (count exchange) and f.expert_inputs (permute, rows to the owners, regroup per local
  // expert); f's matrices are reused when their shapes match.
  void dispatch(Forward& f) {
    TokenExchange<Scalar>::exchange_counts(comm_, f);
    if (single_rank()) {  // the permuted order is the experts' order: no exchange
      permute_tokens_into<Scalar>(f.expert_inputs, f.input, f.permutation);
      return;
    }
    if constexpr (RowCommunicator<Comm, Scalar>) {
      if (f.input.outerStride() == hidden_size()) {  // the tokens' rows go straight to their experts
        exchange_.gather_to_experts(comm_, f.input, f, f.expert_inputs);
        return;
      }
    }
    permute_tokens_into<Scalar>(permuted_, f.input, f.permutation);
    exchange_.to_experts(comm_, permuted_, f, f.expert_inputs);
  }

  // combine: the local experts' outputs (rows as in f.expert_inputs) -> f.expert_outputs (back on
  // the tokens' ranks) and f.output (each token's slots summed in slot order).
  void combine(Forward& f, MatrixRef<Scalar> outputs) {
    if (!single_rank() || outputs.data() != f.expert_outputs.data())
      exchange_.from_experts(comm_, outputs, f, f.expert_outputs);
    combine_into<Scalar>(f.output, f.expert_outputs, f.routing, f.permutation);
  }

  // Gradients of sum(forward.output * grad_output) w.r.t. the input (this rank's tokens), the
  // gate weight (whole, identical on every rank) and this rank's experts. Collective.
  Gradients backward(const Forward& f, MatrixRef<Scalar> grad_output) {
    Gradients g{RowMatrix<Scalar>(), RowMatrix<Scalar>(), experts_.zero_gradients()};
    backward_accumulate(f, grad_output, g);
    return g;
  }

  // The same into gradients the caller keeps: g.input and g.gate_weight are overwritten (their
  // storage reused), the expert gradients are *added* to g.experts (start from
  // experts().zero_gradients(); accumulating over micro-batches, as trainers do, adds each
  // micro-batch's in call order). Collective. When it throws (here or, through the agreement, on
  // another rank), g.experts is unspecified on every rank: ranks whose experts finished have added
  // this micro-batch, the failing one may hold part of it. A trainer that goes on must restart the
  // accumulation (zero_gradients, and the micro-batches again) on every rank, not skip the one
  // that failed.
  void backward_accumulate(const Forward& f, MatrixRef<Scalar> grad_output, Gradients& g) {
    constexpr const char* fn = "MoELayer::backward";
    agree_on_step(comm_, fn, [&] {
      detail::require(f.num_experts == num_experts() &&
                          f.local_offsets.size() == static_cast<std::size_t>(experts_per_rank()) + 1 &&
                          f.expert_inputs.rows() == f.local_rows(),
                      fn, "the forward context comes from another layer");
      detail::require(grad_output.rows() == f.input.rows() && grad_output.cols() == hidden_size(), fn,
                      "'grad_output' has shape ", detail::shape_of(grad_output), " for an output of shape ",
                      detail::shape_of(f.output));
    });
    // d weights and d expert outputs (permuted order); with one rank, the experts' order.
    combine_backward_into<Scalar>(grad_expert_out_, grad_weights_, grad_output, f.expert_outputs, f.routing,
                                  f.permutation);
    const RowMatrix<Scalar>* grad_rows = &grad_expert_out_;
    if (!single_rank()) {
      exchange_.to_experts(comm_, grad_expert_out_, f, grad_grouped_);
      grad_rows = &grad_grouped_;
    }
    RowMatrix<Scalar>& grad_in = single_rank() ? grad_expert_in_ : expert_rows_;
    grad_in.resize(f.local_rows(), hidden_size());
    agree_on_step(comm_, fn, [&] {
      run_experts_backward(f, *grad_rows, grad_in, g.experts, fn);
      grad_logits_ = router_.backward(f.router_logits(), f.routing, grad_weights_);
      if (f.aux_grad_logits.size() != 0) {
        detail::require(f.aux_grad_logits.rows() == grad_logits_.rows() && f.aux_grad_logits.cols() == num_experts(),
                        fn, "'aux_grad_logits' has shape ", detail::shape_of(f.aux_grad_logits), ", expected [",
                        grad_logits_.rows(), ", ", num_experts(), "]");
        grad_logits_ += f.aux_grad_logits;
      }
    });
    if (!single_rank()) exchange_.from_experts(comm_, expert_rows_, f, grad_expert_in_);
    input_gradient(f, grad_expert_in_, grad_logits_, g.input);
    g.gate_weight = gate_.weight_gradient(comm_, f.input, grad_logits_);
  }

 private:
  int experts_per_rank() const { return placement_.experts_per_rank(); }

  // Local checks first, but every rank reaches the configuration agreement so none is left waiting.
  void init() {
    constexpr const char* fn = "MoELayer";
    const int p = static_cast<int>(comm_.size());
    const int r = static_cast<int>(comm_.rank());
    std::string local_error;
    try {
      placement_ = ExpertPlacement::contiguous(num_experts(), p);
      detail::require(experts_.num_experts() == placement_.experts_per_rank() &&
                          experts_.first_expert() == placement_.first_expert(r),
                      fn, "rank ", r, " holds experts [", experts_.first_expert(), ", ",
                      experts_.first_expert() + experts_.num_experts(), ") but contiguous placement of ",
                      num_experts(), " experts over ", p, " ranks gives it [", placement_.first_expert(r), ", ",
                      placement_.first_expert(r) + placement_.experts_per_rank(), ")");
      router_.check_layer(fn);
      if (const RouterConfig* c = router_config())
        detail::require(c->seq_aux_loss_coeff == 0, fn,
                        "seq_aux_loss_coeff needs each sequence's rows, which the layer does not see: add "
                        "sequence_aux_loss(forward.router_logits(), lengths, ...).grad_logits to "
                        "forward.aux_grad_logits before backward, and leave the coefficient at 0");
    } catch (const std::exception& e) {
      local_error = e.what();
    }
    // Each rank checked its own expert block against the placement; the ranks must agree on the
    // model and on the group for those placements to be one.
    agree_on_values(comm_, fn, local_error,
                    std::array<AgreedValue, 6>{{{"num_experts", num_experts()},
                                                {"topk", topk()},
                                                {"hidden_size", experts_.hidden_size()},
                                                {"intermediate_size", experts_.intermediate_size()},
                                                {"group size", p},
                                                {"scalar size", static_cast<std::int64_t>(sizeof(Scalar))}}});
  }

  bool single_rank() const { return comm_.size() == 1; }

  // The router's configuration when it has one (TopKRouter and the device routers do).
  const RouterConfig* router_config() const {
    if constexpr (requires(const R& r) {
                    { r.config() } -> std::convertible_to<const RouterConfig&>;
                  })
      return &router().config();
    else
      return nullptr;
  }

  // Forward::aux_loss, z_loss and aux_grad_logits from the router's coefficients, on the rows
  // that are not padding (the replay controller's layout says which), as Megatron leaves padding
  // tokens out of its losses: total tokens are those rows.
  void auxiliary_losses(Forward& f) const {
    f.aux_loss = f.z_loss = Scalar(0);
    f.aux_grad_logits.resize(0, 0);
    const RouterConfig* c = router_config();
    if (c == nullptr || (c->aux_loss_coeff == 0 && c->z_loss_coeff == 0)) return;
    const auto logits = f.router_logits();
    const auto padding = router_.padding_rows(static_cast<long>(logits.rows()));
    std::vector<Eigen::Index> rows;
    rows.reserve(static_cast<std::size_t>(logits.rows()));
    for (Eigen::Index t = 0; t < logits.rows(); ++t)
      if (padding.empty() || padding[static_cast<std::size_t>(t)] == 0) rows.push_back(t);
    f.aux_grad_logits.setZero(logits.rows(), num_experts());
    if (rows.empty()) return;
    // Every row counts (no padding): the losses read the logits in place and add whole gradients.
    const bool all = rows.size() == static_cast<std::size_t>(logits.rows());
    RowMatrix<Scalar> counted;
    if (!all) {
      counted.resize(static_cast<Eigen::Index>(rows.size()), num_experts());
      for (std::size_t i = 0; i < rows.size(); ++i)
        counted.row(static_cast<Eigen::Index>(i)) = logits.row(rows[i]);
    }
    const MatrixRef<Scalar> in = all ? MatrixRef<Scalar>(logits) : MatrixRef<Scalar>(counted);
    const auto add = [&](const AuxLoss<Scalar>& loss, Scalar& value) {
      value = loss.loss;
      if (all) {
        f.aux_grad_logits += loss.grad_logits;
        return;
      }
      for (std::size_t i = 0; i < rows.size(); ++i)
        f.aux_grad_logits.row(rows[i]) += loss.grad_logits.row(static_cast<Eigen::Index>(i));
    };
    if (c->aux_loss_coeff > 0)
      add(switch_aux_loss<Scalar>(in, c->topk, c->score_function, c->aux_loss_coeff), f.aux_loss);
    if (c->z_loss_coeff > 0) add(mrr::z_loss<Scalar>(in, c->z_loss_coeff), f.z_loss);
  }

  // Padding rows (the replay controller's micro-batch layout says which) may hold anything, and
  // the router already routes a non-finite one as zeros; the layer goes one step further and
  // treats such a row of its input as zeros, so that the row's NaN never reaches an expert, the
  // output or, as 0 x NaN, a weight gradient (the masked loss gives it a zero output gradient).
  // Finite padding rows are computed as given, as Megatron and HF do.
  void zero_nonfinite_padding(RowMatrix<Scalar>& input) const {
    const auto padding = router_.padding_rows(static_cast<long>(input.rows()));
    for (std::size_t r = 0; r < padding.size(); ++r) {
      const auto row = static_cast<Eigen::Index>(r);
      if (padding[r] != 0 && !input.row(row).allFinite()) input.row(row).setZero();
    }
  }

  // Local expert e's rows of a grouped matrix (rows as in f.expert_inputs).
  template <class M>
  static auto expert_block(M& rows, const Forward& f, int e) {
    const auto i = static_cast<std::size_t>(e);
    return rows.middleRows(f.local_offsets[i], f.local_offsets[i + 1] - f.local_offsets[i]);
  }

  // Experts that write into caller memory run in parallel over experts (each on one thread, so
  // the bits do not depend on the thread count); others one after another, each returning its
  // matrix.
  void run_experts_forward(Forward& f, RowMatrix<Scalar>& out, const char* fn) const {
    if constexpr (ExpertSavingActivations<X>) {
      if (save_activations_) {
        f.expert_activations.resize(f.local_rows(), experts_.activation_size());
        detail::parallel_tasks(experts_per_rank(), [&](std::int64_t e) {
          const int i = static_cast<int>(e);
          experts_.forward_into(i, f.expert_input(i), expert_block(out, f, i),
                                expert_block(f.expert_activations, f, i));
        });
        return;
      }
    }
    f.expert_activations.resize(0, 0);
    if constexpr (ExpertWritingInto<X>) {
      detail::parallel_tasks(experts_per_rank(), [&](std::int64_t e) {
        experts_.forward_into(static_cast<int>(e), f.expert_input(static_cast<int>(e)),
                              expert_block(out, f, static_cast<int>(e)));
      });
    } else {
      for (int e = 0; e < experts_per_rank(); ++e) {
        const auto rows = f.expert_input(e);
        const RowMatrix<Scalar> y = experts_.forward(e, rows);
        detail::require(y.rows() == rows.rows() && y.cols() == hidden_size(), fn, "local expert ", e,
                        " returned shape ", detail::shape_of(y), " for input ", detail::shape_of(rows));
        expert_block(out, f, e) = y;
      }
    }
  }

  void run_experts_backward(const Forward& f, const RowMatrix<Scalar>& grad_out, RowMatrix<Scalar>& grad_in,
                            typename X::gradients_type& grads, const char* fn) const {
    if constexpr (ExpertSavingActivations<X>) {
      if (f.expert_activations.rows() == f.local_rows() && f.expert_activations.cols() == experts_.activation_size() &&
          f.local_rows() > 0) {
        detail::parallel_tasks(experts_per_rank(), [&](std::int64_t e) {
          const int i = static_cast<int>(e);
          experts_.backward_into(i, f.expert_input(i), expert_block(grad_out, f, i), expert_block(grad_in, f, i), grads,
                                 expert_block(f.expert_activations, f, i));
        });
        return;
      }
    }
    if constexpr (ExpertWritingInto<X>) {
      detail::parallel_tasks(experts_per_rank(), [&](std::int64_t e) {
        const int i = static_cast<int>(e);
        experts_.backward_into(i, f.expert_input(i), expert_block(grad_out, f, i), expert_block(grad_in, f, i), grads);
      });
    } else {
      for (int e = 0; e < experts_per_rank(); ++e) {
        const auto rows = f.expert_input(e);
        const RowMatrix<Scalar> dx = experts_.backward(e, rows, expert_block(grad_out, f, e), grads);
        detail::require(dx.rows() == rows.rows() && dx.cols() == hidden_size(), fn, "local expert ", e,
                        " returned an input gradient of shape ", detail::shape_of(dx), " for input ",
                        detail::shape_of(rows));
        expert_block(grad_in, f, e) = dx;
      }
    }
  }

  // d input[t] = the sum over t's kept slots, in slot order, of the expert input gradients (a
  // combine with unit weights: multiplying by one is exact, so these are the plain sums) plus the
  // gate's term grad_logits[t] @ gate_weight; element-wise, so no result depends on P.
  void input_gradient(const Forward& f, const RowMatrix<Scalar>& grad_expert_in, const RowMatrix<Scalar>& grad_logits,
                      RowMatrix<Scalar>& grad) const {
    permute_tokens_backward_into<Scalar>(grad, grad_expert_in, f.permutation);
    gate_.add_input_gradient(grad, grad_logits);
  }

  ReplayRouter<R, Store> router_;  // the router bound to the replay controller (native without one)
  X experts_;
  C comm_;
  ExpertPlacement placement_ = ExpertPlacement::contiguous(1, 1);
  Gate<Scalar> gate_;
  // Workspace reused across calls (a fresh matrix per call costs page faults, not only copies):
  TokenExchange<Scalar> exchange_;     // the exchange's staging
  RowMatrix<Scalar> permuted_;         // P > 1: this rank's rows in expert-major order
  RowMatrix<Scalar> expert_rows_;      // P > 1: the experts' outputs, then their input gradients (grouped)
  RowMatrix<Scalar> grad_expert_out_;  // d expert outputs, permuted order
  RowMatrix<Scalar> grad_grouped_;     // P > 1: the same, grouped
  RowMatrix<Scalar> grad_expert_in_;   // d expert inputs, permuted order
  RowMatrix<Scalar> grad_weights_;     // [tokens, k]
  RowMatrix<Scalar> grad_logits_;      // [tokens, num_experts]
  bool save_activations_ = true;
};

MRR_NAMESPACE_END
