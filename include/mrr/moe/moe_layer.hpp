// MoELayer: one sparse-MoE block composed from policies at compile time — the gate (hidden -> E
// logits, mrr/moe/gate.hpp) -> router through RoutingReplay (record / replay happen here) ->
// dispatch to the ranks owning the experts (a DispatchPlan run by a TokenExchange) -> experts ->
// combine weighted by the gating weights (mrr/router/permute.hpp) — with the backward pass w.r.t.
// the input, the gate weight and every expert. A step that can fail on one rank runs under
// agree_on_step (mrr/comm/agreement.hpp), so every rank fails with it instead of waiting.
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
  std::vector<RowMatrix<Scalar>> expert_inputs;  // per local expert, rows in (source rank, token) order
  RowMatrix<Scalar> expert_outputs;              // [permuted rows, hidden], this rank's slots
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

  // Gate weight [num_experts, hidden] (nn.Linear layout, no bias); zero until set.
  const RowMatrix<Scalar>& gate_weight() const { return gate_.weight(); }
  void set_gate_weight(MatrixRef<Scalar> weight) { gate_.set_weight(weight, "MoELayer::set_gate_weight"); }

  // hidden [tokens, hidden] (this rank's tokens) -> context with the output [tokens, hidden].
  // Collective: every rank of the group calls it.
  Forward forward(MatrixRef<Scalar> hidden) {
    constexpr const char* fn = "MoELayer::forward";
    Forward f;
    agree_on_step(comm_, fn, [&] {
      detail::require(hidden.cols() == hidden_size(), fn, "'hidden' has shape ", detail::shape_of(hidden),
                      " but the layer's hidden_size is ", hidden_size());
      f.input = hidden;
      f.num_experts = num_experts();
      f.logits = gate_.logits(f.input);
      f.routing = router_.forward(f.router_logits());
      static_cast<DispatchPlan&>(f) = make_dispatch_plan(f.routing, placement_, hidden_size());
    });
    dispatch(f);
    std::vector<RowMatrix<Scalar>> outputs(f.expert_inputs.size());
    agree_on_step(comm_, fn, [&] { run_experts_forward(f.expert_inputs, outputs, fn); });
    combine(f, outputs);
    return f;
  }

  // forward's communication steps on their own, so bench/ep can time dispatch + combine without
  // the gate and the experts. Collective. dispatch: f.input and f's plan -> the plan's receive
  // side (count exchange) and f.expert_inputs (permute, rows to the owners, regroup per local
  // expert); f's matrices are reused when their shapes match.
  void dispatch(Forward& f) {
    TokenExchange<Scalar>::exchange_counts(comm_, f);
    // Into the layer's buffer: a fresh [T k, hidden] matrix per forward costs page faults.
    permute_tokens_into<Scalar>(permuted_, f.input, f.permutation);
    exchange_.to_experts(comm_, permuted_, f, f.expert_inputs);
  }

  // combine: the local experts' outputs (rows as in f.expert_inputs) -> f.expert_outputs (back on
  // the tokens' ranks) and f.output (each token's slots summed in slot order).
  void combine(Forward& f, const std::vector<RowMatrix<Scalar>>& outputs) {
    exchange_.from_experts(comm_, outputs, f, f.expert_outputs);
    f.output = mrr::combine<Scalar>(f.expert_outputs, f.routing, f.permutation);
  }

  // Gradients of sum(forward.output * grad_output) w.r.t. the input (this rank's tokens), the
  // gate weight (whole, identical on every rank) and this rank's experts. Collective.
  Gradients backward(const Forward& f, MatrixRef<Scalar> grad_output) {
    constexpr const char* fn = "MoELayer::backward";
    agree_on_step(comm_, fn, [&] {
      detail::require(f.num_experts == num_experts() &&
                          f.expert_inputs.size() == static_cast<std::size_t>(experts_per_rank()),
                      fn, "the forward context comes from another layer");
      detail::require(grad_output.rows() == f.input.rows() && grad_output.cols() == hidden_size(), fn,
                      "'grad_output' has shape ", detail::shape_of(grad_output), " for an output of shape ",
                      detail::shape_of(f.output));
    });
    RowMatrix<Scalar> grad_weights, grad_expert_out;
    combine_backward(f, grad_output, grad_weights, grad_expert_out);
    std::vector<RowMatrix<Scalar>> grad_outputs;
    exchange_.to_experts(comm_, grad_expert_out, f, grad_outputs);
    Gradients g{RowMatrix<Scalar>(), RowMatrix<Scalar>(), experts_.zero_gradients()};
    std::vector<RowMatrix<Scalar>> grad_inputs(grad_outputs.size());
    RowMatrix<Scalar> grad_logits;
    agree_on_step(comm_, fn, [&] {
      run_experts_backward(f.expert_inputs, grad_outputs, grad_inputs, g.experts, fn);
      grad_logits = router_.backward(f.router_logits(), f.routing, grad_weights);
    });
    RowMatrix<Scalar> grad_expert_in;
    exchange_.from_experts(comm_, grad_inputs, f, grad_expert_in);
    g.input = input_gradient(f, grad_expert_in, grad_logits);
    g.gate_weight = gate_.weight_gradient(comm_, f.input, grad_logits);
    return g;
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

  void run_experts_forward(const std::vector<RowMatrix<Scalar>>& inputs, std::vector<RowMatrix<Scalar>>& outputs,
                           const char* fn) const {
    for (int e = 0; e < experts_per_rank(); ++e) {
      const auto i = static_cast<std::size_t>(e);
      outputs[i] = experts_.forward(e, inputs[i]);
      detail::require(outputs[i].rows() == inputs[i].rows() && outputs[i].cols() == hidden_size(), fn,
                      "local expert ", e, " returned shape ", detail::shape_of(outputs[i]), " for input ",
                      detail::shape_of(inputs[i]));
    }
  }

  void run_experts_backward(const std::vector<RowMatrix<Scalar>>& inputs,
                            const std::vector<RowMatrix<Scalar>>& grad_outputs,
                            std::vector<RowMatrix<Scalar>>& grad_inputs, typename X::gradients_type& grads,
                            const char* fn) const {
    for (int e = 0; e < experts_per_rank(); ++e) {
      const auto i = static_cast<std::size_t>(e);
      grad_inputs[i] = experts_.backward(e, inputs[i], grad_outputs[i], grads);
      detail::require(grad_inputs[i].rows() == inputs[i].rows() && grad_inputs[i].cols() == hidden_size(), fn,
                      "local expert ", e, " returned an input gradient of shape ", detail::shape_of(grad_inputs[i]),
                      " for input ", detail::shape_of(inputs[i]));
    }
  }

  // combine's backward: d weights[t, j] = <grad_output[t], y[t, j]>, a fixed-order dot per slot
  // (in at least fp32); d y[row(t, j)] = weights[t, j] * grad_output[t], in permuted order.
  void combine_backward(const Forward& f, MatrixRef<Scalar> grad_output, RowMatrix<Scalar>& grad_weights,
                        RowMatrix<Scalar>& grad_expert_out) const {
    const Eigen::Index tokens = f.input.rows();
    grad_weights = RowMatrix<Scalar>::Zero(tokens, topk());
    grad_expert_out.resize(f.expert_outputs.rows(), hidden_size());
    for (Eigen::Index t = 0; t < tokens; ++t)
      for (int j = 0; j < topk(); ++j) {
        const auto row = f.permutation.row_of_slot(t, j);
        if (row < 0) continue;
        Accum dot = 0;
        for (int h = 0; h < hidden_size(); ++h)
          dot += static_cast<Accum>(grad_output(t, h)) * static_cast<Accum>(f.expert_outputs(row, h));
        grad_weights(t, j) = static_cast<Scalar>(dot);
        grad_expert_out.row(row) = grad_output.row(t) * f.routing.weights(t, j);
      }
  }

  // d input[t] = the sum over t's kept slots, in slot order, of the expert input gradients (a
  // combine with unit weights: multiplying by one is exact, so these are the plain sums) plus the
  // gate's term grad_logits[t] @ gate_weight; element-wise, so no result depends on P.
  RowMatrix<Scalar> input_gradient(const Forward& f, const RowMatrix<Scalar>& grad_expert_in,
                                   const RowMatrix<Scalar>& grad_logits) const {
    Routing<Scalar> unit = f.routing;
    unit.weights.setOnes();
    RowMatrix<Scalar> grad = mrr::combine<Scalar>(grad_expert_in, unit, f.permutation);
    grad += gate_.input_gradient(grad_logits);
    return grad;
  }

  ReplayRouter<R, Store> router_;  // the router bound to the replay controller (native without one)
  X experts_;
  C comm_;
  ExpertPlacement placement_ = ExpertPlacement::contiguous(1, 1);
  Gate<Scalar> gate_;
  TokenExchange<Scalar> exchange_;  // staging reused across calls
  RowMatrix<Scalar> permuted_;      // this rank's rows in expert-major order, reused across calls
};

MRR_NAMESPACE_END
