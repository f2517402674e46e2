// One concept per policy that composes an mrr MoE layer at compile time: Router, RouteStore,
// Communicator and Backend. Checked where a policy is plugged in, so a wrong type fails with a
// sentence instead of a template backtrace.
#pragma once

#include <mrr/comm/row_blocks.hpp>
#include <mrr/detail/config.hpp>
#include <mrr/replay/layout.hpp>
#include <mrr/replay/none_store.hpp>
#include <mrr/replay/shape.hpp>
#include <mrr/router/routing.hpp>
#include <mrr/tensor.hpp>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

MRR_NAMESPACE_BEGIN

// Token -> k experts, with replay of given ids (rows whose mask is 0 route natively; an empty mask
// replays every row) and the gradient of the weights w.r.t. the logits.
template <class R>
concept Router = requires(const R& r, MatrixRef<typename R::scalar_type> logits, ExpertIdsRef ids,
                          std::span<const std::uint8_t> mask, const Routing<typename R::scalar_type>& routing) {
  typename R::scalar_type;
  { r.num_experts() } -> std::convertible_to<int>;
  { r.topk() } -> std::convertible_to<int>;
  { r.route(logits) } -> std::same_as<Routing<typename R::scalar_type>>;
  { r.replay(logits, ids, mask) } -> std::same_as<Routing<typename R::scalar_type>>;
  { r.backward(logits, routing, logits) } -> std::same_as<RowMatrix<typename R::scalar_type>>;
};

// Routes keyed by (sequence uid, position, layer): record a micro-batch's ids, look them up for
// another micro-batch layout.
template <class S>
concept RouteStore = requires(S& s, const S& cs, int layer, const TokenLayout& layout, ExpertIdsRef ids,
                              ExpertIds& out, std::vector<std::uint8_t>& found, SequenceId uid) {
  { cs.shape() } -> std::convertible_to<RouteShape>;
  s.record(layer, layout, ids);
  { cs.lookup(layer, layout, out, found) } -> std::convertible_to<std::size_t>;
  { cs.recorded_positions(uid) } -> std::convertible_to<std::int64_t>;
};

// A store, or the `none` store that compiles replay out.
template <class S>
concept RouteStoreOrNone = RouteStore<S> || std::same_as<S, NoRouteStore>;

// Expert-parallel collectives (single process, in-process ranks, MPI, NCCL). Every collective is
// a template over the element type (float, double, std::int32_t, std::int64_t, std::uint8_t at
// least); counts are in elements and blocks are laid out in rank order. all_reduce_sum adds the
// ranks' contributions in rank order 0..P-1, so every rank gets bitwise the same sum whatever the
// arrival order. A failure on one rank surfaces as an exception on every rank, never a hang.
template <class C>
concept Communicator = requires(const C& c, std::span<float> f, std::span<const float> cf, std::span<double> d,
                                std::span<const double> cd, std::span<std::int64_t> i, std::span<const std::int64_t> ci,
                                std::span<const std::size_t> counts) {
  { c.rank() } -> std::convertible_to<int>;
  { c.size() } -> std::convertible_to<int>;
  c.barrier();
  c.all_reduce_sum(f);
  c.all_reduce_sum(d);
  c.all_reduce_sum(i);
  c.all_gather(cf, f);
  c.all_gather(ci, i);
  c.broadcast(i, 0);
  c.all_to_all_v(cf, counts, f, counts);
  c.all_to_all_v(cd, counts, d, counts);
  c.all_to_all_v(ci, counts, i, counts);
};

// A Communicator that also moves rows by gather/scatter lists (mrr/comm/row_blocks.hpp):
// SingleProcess, InProcessGroup and MpiCommunicator. The MoE layer's exchanges then skip their
// staging copies; with any other communicator they stage through all_to_all_v.
template <class C, class T>
concept RowCommunicator = Communicator<C> &&
    requires(const C& c, const T* send, T* recv, const RowBlocks& blocks, std::size_t n) {
  c.all_to_all_rows(send, n, blocks, recv, n, blocks, n);
};

// The experts one rank holds (a contiguous block [first_expert, first_expert + num_experts) of
// the model's), consumed by MoELayer: local expert e maps its rows [n, hidden] to [n, hidden];
// backward returns the gradient w.r.t. the rows and adds the parameter gradients into `grads`.
template <class X>
concept Expert = requires(const X& x, int e, MatrixRef<typename X::scalar_type> rows,
                          typename X::gradients_type& grads) {
  typename X::scalar_type;
  typename X::gradients_type;
  { x.num_experts() } -> std::convertible_to<int>;
  { x.first_expert() } -> std::convertible_to<int>;
  { x.hidden_size() } -> std::convertible_to<int>;
  { x.intermediate_size() } -> std::convertible_to<int>;
  { x.forward(e, rows) } -> std::same_as<RowMatrix<typename X::scalar_type>>;
  { x.backward(e, rows, rows, grads) } -> std::same_as<RowMatrix<typename X::scalar_type>>;
  { x.zero_gradients() } -> std::same_as<typename X::gradients_type>;
};

// Optional, for speed: experts that also write into caller memory (forward_into(e, rows, out),
// backward_into(e, rows, grad_out, grad_in, grads), with out and grad_in [n, hidden] views) and
// may be called concurrently for different experts. MoELayer then runs them in parallel over
// experts into buffers it keeps, instead of collecting a fresh matrix from each.
template <class X>
concept ExpertWritingInto = Expert<X> &&
    requires(const X& x, int e, MatrixRef<typename X::scalar_type> rows,
             Eigen::Ref<RowMatrix<typename X::scalar_type>> out, typename X::gradients_type& grads) {
  x.forward_into(e, rows, out);
  x.backward_into(e, rows, rows, out, grads);
};

// Optional on top: experts that save the activations their backward needs during the forward
// (activation_size() scalars per row, into a [n, activation_size()] view) and read them back
// instead of recomputing, with the same bits. MoELayer keeps them in the forward context.
template <class X>
concept ExpertSavingActivations = ExpertWritingInto<X> &&
    requires(const X& x, int e, MatrixRef<typename X::scalar_type> rows,
             Eigen::Ref<RowMatrix<typename X::scalar_type>> out, typename X::gradients_type& grads) {
  { x.activation_size() } -> std::convertible_to<Eigen::Index>;
  x.forward_into(e, rows, out, out);
  x.backward_into(e, rows, rows, out, grads, rows);
};

// Where tensors live and which kernels run (CPU with Eigen, CUDA with Thrust).
template <class B>
concept Backend = requires {
  { B::name } -> std::convertible_to<std::string_view>;
  { B::is_device } -> std::convertible_to<bool>;
  typename B::template vector<float>;
};

MRR_NAMESPACE_END
