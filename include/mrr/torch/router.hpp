// Routing on torch tensors with autograd: the weights a MoE block multiplies its expert outputs by
// carry mrr's router backward, whether the ids were chosen natively, replayed from a route store
// (RoutingReplay: R2 / R3) or given by the caller. CPU tensors; see mrr/torch/tensor.hpp.
//
//   mrr::TopKRouter<float> router(mrr::presets::qwen3_moe(64, 8));
//   auto r = mrr::torch::route(replay, router, layer, gate(x));   // RoutingReplay<Store>& replay
//   // r.weights [T, k] (autograd), r.ids [T, k] int64: combine = sum_j r.weights[:, j] * expert(x)
//
// The router must outlive the backward of the weights it produced (the graph keeps a pointer).
// mrr-requires: mrr_torch
// (a target mrr's own build never defines: the torch tests compile these headers, ctest -L torch)
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>
#include <mrr/replay/layout.hpp>
#include <mrr/replay/routing_replay.hpp>
#include <mrr/router/topk_router.hpp>
#include <mrr/torch/tensor.hpp>

#include <ATen/core/ivalue.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

MRR_NAMESPACE_BEGIN
namespace torch {

// One router call on tensors: weights [T, k] (differentiable w.r.t. the logits), ids [T, k]
// int64 (torch.topk's dtype), kept [T, k] uint8 (undefined when no capacity limit dropped a slot),
// status [T] uint8 (CUDA calls only, mrr/torch/cuda.hpp: each row's kernels::RowStatus, 0 = routed).
struct TensorRouting {
  at::Tensor weights;
  at::Tensor ids;
  at::Tensor kept;
  at::Tensor status;
};

namespace detail {

// weights = f(logits; ids): the forward hands over weights the router computed, the backward is
// TopKRouter::backward_into on the saved logits and ids.
template <class Scalar>
struct RouterWeights : public ::torch::autograd::Function<RouterWeights<Scalar>> {
  static at::Tensor forward(::torch::autograd::AutogradContext* ctx, const at::Tensor& logits,
                            const Routing<Scalar>* routing, const TopKRouter<Scalar>* router) {
    at::Tensor ids = to_tensor(routing->ids, at::kInt);
    at::Tensor kept = routing->has_capacity_mask() ? to_tensor(routing->kept, at::kByte) : at::Tensor();
    ctx->save_for_backward({logits, ids, kept});
    ctx->saved_data["router"] = reinterpret_cast<std::int64_t>(router);
    return to_tensor(routing->weights, scalar_type_of<Scalar>());
  }

  static ::torch::autograd::variable_list backward(::torch::autograd::AutogradContext* ctx,
                                                   ::torch::autograd::variable_list grads) {
    constexpr const char* fn = "torch::route (backward)";
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& logits = saved[0];
    const at::Tensor& ids = saved[1];
    const at::Tensor& kept = saved[2];
    const auto* router = reinterpret_cast<const TopKRouter<Scalar>*>(ctx->saved_data["router"].toInt());
    at::Tensor grad_w = grads[0].defined() ? grads[0].to(scalar_type_of<Scalar>()).contiguous()
                                           : at::zeros(ids.sizes(), logits.options());
    at::Tensor grad = at::empty(logits.sizes(), logits.options().dtype(scalar_type_of<Scalar>()));
    router->backward_into(mutable_host_matrix<Scalar>(grad, fn, "grad_logits"), host_matrix<Scalar>(logits, fn, "logits"),
                          host_matrix<std::int32_t>(ids, fn, "ids"), host_matrix<Scalar>(grad_w, fn, "grad_weights"),
                          kept.defined() ? kept.data_ptr<std::uint8_t>() : nullptr);
    return {grad, at::Tensor(), at::Tensor()};
  }
};

template <class Scalar>
TensorRouting finish(const TopKRouter<Scalar>& router, const at::Tensor& logits, const Routing<Scalar>& routing) {
  TensorRouting out;
  out.weights = RouterWeights<Scalar>::apply(logits, &routing, &router);
  out.ids = to_tensor(routing.ids, at::kLong);
  if (routing.has_capacity_mask()) out.kept = to_tensor(routing.kept, at::kByte);
  return out;
}

}  // namespace detail

// Native routing of logits [T, E] (a CPU tensor of the router's scalar type; any row stride).
template <class Scalar>
TensorRouting route(const TopKRouter<Scalar>& router, const at::Tensor& logits) {
  const auto z = host_matrix<Scalar>(logits, "torch::route", "logits");
  const Routing<Scalar> routing = router.route(z);
  return detail::finish(router, logits, routing);
}

// Replay of the given ids [T, k] (int64, int32, int16 or uint8; range-checked in their own type):
// the weights the router gives those experts, with its backward.
template <class Scalar>
TensorRouting replay(const TopKRouter<Scalar>& router, const at::Tensor& logits, const at::Tensor& ids) {
  constexpr const char* fn = "torch::replay";
  const auto z = host_matrix<Scalar>(logits, fn, "logits");
  const ExpertIds given = host_ids(ids, router.num_experts(), router.topk(), fn);
  mrr::detail::require(given.rows() == z.rows(), fn, "'ids' has ", given.rows(), " rows for ", z.rows(),
                       " rows of logits");
  const Routing<Scalar> routing = router.replay(z, given);
  return detail::finish(router, logits, routing);
}

// What a trainer's MoE layer calls: the RoutingReplay's current action decides (native, record,
// replay_forward, replay_backward), for the rows set by replay.set_micro_batch(...).
template <class Store, class Scalar>
TensorRouting route(RoutingReplay<Store>& replay, const TopKRouter<Scalar>& router, int layer, const at::Tensor& logits) {
  const auto z = host_matrix<Scalar>(logits, "torch::route", "logits");
  const Routing<Scalar> routing = replay.route(router, layer, z);
  return detail::finish(router, logits, routing);
}

// ---------------------------------------------------------------------------------------------
// Token layouts from a trainer's tensors (DESIGN.md section 4). Sequence ids are per response:
// verl's `uid` is shared by the n responses of one prompt, so give each response its own id
// (e.g. its row index in the rollout batch, or a hash of uid and the sample index).

namespace detail {
// Integer (or, where `bool_ok`, bool) dtypes only: a float tensor of ids or positions would be
// truncated (10.7 -> sequence 10), and an additive float mask (0 / -inf) is not a 0/1 mask.
inline void require_integral(const at::Tensor& t, const char* fn, const char* name, bool bool_ok = false) {
  const at::ScalarType st = t.scalar_type();
  mrr::detail::require(at::isIntegralType(st, /*includeBool=*/bool_ok), fn, "'", name, "' has dtype ", text(st),
                       "; expected an integer", bool_ok ? " or bool" : "", " dtype");
}
}  // namespace detail

// Padded batch: uids [B] (an integer dtype), attention_mask [B, S] (bool, or an integer dtype
// holding 0 and 1 only: HF's additive float masks and other values are errors).
inline TokenLayout padded_layout(const at::Tensor& uids, const at::Tensor& attention_mask) {
  constexpr const char* fn = "torch::padded_layout";
  detail::require_cpu(uids, fn, "uids");
  detail::require_cpu(attention_mask, fn, "attention_mask");
  mrr::detail::require(uids.dim() == 1, fn, "'uids' has shape ", detail::text(uids.sizes()),
                       "; expected one sequence id per row, [B] (not the rows' token ids)");
  mrr::detail::require(attention_mask.dim() == 2 && uids.size(0) == attention_mask.size(0), fn,
                       "'uids' [B] and 'attention_mask' [B, S] disagree: ", detail::text(uids.sizes()), " and ",
                       detail::text(attention_mask.sizes()));
  detail::require_integral(uids, fn, "uids");
  detail::require_integral(attention_mask, fn, "attention_mask", /*bool_ok=*/true);
  const at::Tensor u = uids.to(at::kLong).contiguous();
  if (attention_mask.scalar_type() != at::kBool) {
    const at::Tensor wide = attention_mask.to(at::kLong);
    const at::Tensor bad = (wide != 0).logical_and(wide != 1);
    if (bad.any().item<bool>()) {
      const at::Tensor at_ = bad.nonzero()[0];
      const std::int64_t b = at_[0].item<std::int64_t>(), t = at_[1].item<std::int64_t>();
      mrr::detail::throw_invalid_argument(fn, "'attention_mask'[", b, ", ", t, "] = ", wide[b][t].item<std::int64_t>(),
                                          "; a mask holds 0 (padding) and 1 (a real token) only");
    }
  }
  const at::Tensor m = attention_mask.to(at::kByte).contiguous();
  std::vector<SequenceId> ids(static_cast<std::size_t>(u.size(0)));
  for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<SequenceId>(u.data_ptr<std::int64_t>()[i]);
  const Eigen::Map<const RowMatrix<std::uint8_t>> mask(m.data_ptr<std::uint8_t>(), m.size(0), m.size(1));
  return TokenLayout::padded(std::span<const SequenceId>(ids), mask);
}

// Packed (THD) batch: uids [N], cu_seqlens [N + 1], first_positions [N] (undefined: all 0).
inline TokenLayout packed_layout(const at::Tensor& uids, const at::Tensor& cu_seqlens,
                                 const at::Tensor& first_positions = at::Tensor(), std::int64_t total_rows = -1) {
  constexpr const char* fn = "torch::packed_layout";
  auto longs = [&](const at::Tensor& t, const char* name) {
    detail::require_cpu(t, fn, name);
    mrr::detail::require(t.dim() == 1, fn, "'", name, "' must be 1-D, got ", detail::text(t.sizes()));
    detail::require_integral(t, fn, name);
    const at::Tensor c = t.to(at::kLong).contiguous();
    return std::vector<std::int64_t>(c.data_ptr<std::int64_t>(), c.data_ptr<std::int64_t>() + c.numel());
  };
  const auto u = longs(uids, "uids");
  const std::vector<SequenceId> ids(u.begin(), u.end());
  const auto cu = longs(cu_seqlens, "cu_seqlens");
  const auto first = first_positions.defined() ? longs(first_positions, "first_positions") : std::vector<std::int64_t>{};
  return TokenLayout::packed(ids, cu, first, total_rows);
}

}  // namespace torch
MRR_NAMESPACE_END
