// Routing on CUDA tensors: the device router's view API (mrr/thrust/routing.hpp, DESIGN.md
// section 11) on a trainer's own tensors, on torch's current stream, with workspace and outputs
// from torch's caching allocator, and with autograd whose backward is mrr's device backward.
// Compile with nvcc (a torch CUDAExtension's .cu, or a libtorch program's CUDA sources).
//
//   mrr::torch::cuda::Router<float> router(mrr::presets::qwen3_moe(64, 8));
//   auto r = router.route(gate(x));                          // logits: a CUDA tensor [T, E]
//   auto r = mrr::torch::cuda::route(replay, router, layer, gate(x));   // through RoutingReplay
//   // r.weights [T, k] (autograd), r.ids [T, k] int64, both on the logits' device
//
// What happens where:
// - Every kernel is queued on the current CUDA stream of the logits' device
//   (c10::cuda::getCurrentCUDAStream: torch.cuda.stream(s) in Python, CUDAStreamGuard in C++),
//   under a device guard for that device. The backward runs on the stream autograd gives it (the
//   forward's).
// - Outputs, the row-status buffer and the workspace are torch tensors on that device: torch's
//   caching allocator, never cudaMalloc.
// - With check = true (the default) a call synchronises its stream once, to turn a bad row (a
//   NaN logit, a replayed id out of range or repeated) into the CPU router's error. With
//   check = false nothing waits: `status` [T] holds each row's kernels::RowStatus (0: routed).
// - Through RoutingReplay (cuda::route(replay, ...), a ResidentRouter), logits and weights stay
//   on the device; only ids cross to the host route store (recorded) and back (replayed).
//
// The router must outlive the backward of the weights it produced (the graph keeps a pointer);
// the PyTorch extension (examples/torch_extension) ties its lifetime to the graph.
// mrr-requires: mrr_torch_cuda
// (a target mrr's own build never defines: the torch extension compiles it where CUDA torch is)
#pragma once

#include <mrr/cuda/fused_routing.cuh>
#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>
#include <mrr/replay/routing_replay.hpp>
#include <mrr/thrust/bf16.hpp>
#include <mrr/thrust/execution.hpp>
#include <mrr/thrust/routing.hpp>
#include <mrr/torch/router.hpp>

#include <ATen/core/ivalue.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

MRR_NAMESPACE_BEGIN
namespace torch {
namespace cuda {

// The current CUDA stream of `t`'s device (what torch queues its own kernels on).
inline cudaStream_t current_stream(const at::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
}

namespace detail {

using mrr::torch::detail::require_matrix;
using mrr::torch::detail::text;

inline void require_cuda(const at::Tensor& t, const char* fn, const char* name) {
  mrr::detail::require(t.defined() && t.device().is_cuda(), fn, "'", name, "' is ",
                       t.defined() ? "on " + text(t.device()) : std::string("an undefined tensor"),
                       "; this call takes CUDA tensors (CPU tensors: mrr/torch/router.hpp)");
}

inline void require_same_device(const at::Tensor& t, const at::Tensor& logits, const char* fn, const char* name) {
  require_cuda(t, fn, name);
  mrr::detail::require(t.device() == logits.device(), fn, "'", name, "' is on ", text(t.device()), " but 'logits' on ",
                       text(logits.device()));
}

// The torch dtype of a view element: float, double, mrr::bf16 (torch.bfloat16), ids, status.
template <class T>
constexpr at::ScalarType dtype_of() {
  if constexpr (std::is_same_v<std::remove_const_t<T>, bf16>)
    return at::kBFloat16;
  else
    return scalar_type_of<std::remove_const_t<T>>();
}

// A view of a CUDA tensor [rows, cols]: checked dtype, contiguous columns, any row stride.
template <class T>
device::MatrixView<T> view(const at::Tensor& t, const char* fn, const char* name) {
  require_cuda(t, fn, name);
  require_matrix(t, dtype_of<T>(), fn, name);
  const long rows = t.size(0), cols = t.size(1);
  return device::MatrixView<T>(static_cast<T*>(t.data_ptr()), rows, cols, rows > 1 ? t.stride(0) : cols);
}

// Workspace from torch's caching allocator: a uint8 tensor on `like`'s device, alive as long as
// this object (the queued kernels are ordered on the stream before any reuse of the block).
struct TensorWorkspace {
  at::Tensor buffer;
  TensorWorkspace(std::size_t bytes, const at::Tensor& like)
      : buffer(at::empty({static_cast<std::int64_t>(bytes)}, like.options().dtype(at::kByte))) {}
  device::Workspace workspace() const { return {buffer.data_ptr(), static_cast<std::size_t>(buffer.numel())}; }
};

// weights = f(logits; ids): the forward hands over the weights the view call wrote; the backward
// is the device router's backward on the saved logits and ids, on the current stream.
template <class T, class In>
struct DeviceRouterWeights : public ::torch::autograd::Function<DeviceRouterWeights<T, In>> {
  // (weights comes by pointer: a tensor argument would be one of the node's inputs.)
  static at::Tensor forward(::torch::autograd::AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& ids,
                            const at::Tensor* weights, const device::TopKRouter<T>* router, bool check) {
    ctx->save_for_backward({logits, ids});
    ctx->saved_data["router"] = reinterpret_cast<std::int64_t>(router);
    ctx->saved_data["check"] = check;
    return *weights;
  }

  static ::torch::autograd::variable_list backward(::torch::autograd::AutogradContext* ctx,
                                                   ::torch::autograd::variable_list grads) {
    constexpr const char* fn = "torch::cuda::route (backward)";
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& logits = saved[0];
    const at::Tensor& ids = saved[1];
    const auto* router = reinterpret_cast<const device::TopKRouter<T>*>(ctx->saved_data["router"].toInt());
    const c10::cuda::CUDAGuard guard(logits.device());
    const device::Execution exec{current_stream(logits)};
    const long rows = logits.size(0);
    const at::TensorOptions opt = logits.options().dtype(scalar_type_of<T>());
    const at::Tensor grad_w = grads[0].defined() ? grads[0].to(opt).contiguous() : at::zeros(ids.sizes(), opt);
    at::Tensor grad = at::empty({rows, static_cast<std::int64_t>(router->num_experts())}, opt);
    at::Tensor status = at::empty({rows}, logits.options().dtype(at::kByte));
    const TensorWorkspace ws(device::TopKRouter<T>::workspace_bytes(rows), logits);
    const auto lv = view<const In>(logits, fn, "logits");
    const auto iv = view<const std::int64_t>(ids, fn, "ids");
    const auto gv = view<const T>(grad_w, fn, "grad_weights");
    const auto out = view<T>(grad, fn, "grad_logits");
    router->backward(exec, lv, iv, gv, nullptr, out, status.data_ptr<std::uint8_t>(), ws.workspace());
    if (ctx->saved_data["check"].toBool())
      router->check_backward(exec, lv, iv, gv, nullptr, out, status.data_ptr<std::uint8_t>(), ws.workspace());
    // The gradient w.r.t. the logits in the logits' dtype (bf16 logits get a bf16 gradient).
    return {logits.scalar_type() == grad.scalar_type() ? grad : grad.to(logits.scalar_type()), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// Whether native routing takes the fused kernels (mrr/cuda/fused_routing.cuh): fp32 router,
// contiguous logits, a router they support (expert bias read from the router's device copy); the
// Thrust row kernel otherwise. All give the CPU router's ids.
template <class T>
bool takes_fused_route(const device::TopKRouter<T>& router, const at::Tensor& logits) {
  if constexpr (!std::is_same_v<T, float>) {
    return false;
  } else {
    const auto& p = router.params();
    return ::mrr::cuda::fused_routing_supports(p) && (!p.has_bias || router.expert_bias_data() != nullptr) &&
           logits.dim() == 2 &&
           (logits.size(0) <= 1 || logits.stride(0) == logits.size(1)) &&
           (logits.size(1) <= 1 || logits.stride(1) == 1);
  }
}

// One route or replay on the current stream: ids int64, weights T, status uint8, all on the
// logits' device; weights carry the backward.
template <class T, class In, class IdIn>
TensorRouting run(const device::TopKRouter<T>& router, const at::Tensor& logits, const at::Tensor* replay_ids,
                  const at::Tensor* replay_mask, bool check, const char* fn) {
  const c10::cuda::CUDAGuard guard(logits.device());
  const device::Execution exec{current_stream(logits)};
  const long rows = logits.size(0), k = router.topk();
  TensorRouting out;
  out.ids = at::empty({rows, k}, logits.options().dtype(at::kLong));
  at::Tensor weights = at::empty({rows, k}, logits.options().dtype(scalar_type_of<T>()));
  out.status = at::empty({rows}, logits.options().dtype(at::kByte));
  const TensorWorkspace ws(device::TopKRouter<T>::workspace_bytes(rows), logits);
  const auto lv = view<const In>(logits, fn, "logits");
  device::require_view(lv, rows, router.num_experts(), fn, "logits");  // before any kernel reads E columns
  const auto iv = view<std::int64_t>(out.ids, fn, "ids");
  const auto wv = view<T>(weights, fn, "weights");
  std::uint8_t* st = out.status.data_ptr<std::uint8_t>();
  if (replay_ids == nullptr && takes_fused_route(router, logits)) {
    // The fused kernel writes int32 ids; torch's are int64 (one widening copy, on the stream).
    at::Tensor ids32 = at::empty({rows, k}, logits.options().dtype(at::kInt));
    const cudaError_t e = ::mrr::cuda::fused_route_replay<In>(
        router.params(), static_cast<const In*>(logits.data_ptr()), router.expert_bias_data(), nullptr, nullptr, rows,
        ids32.data_ptr<std::int32_t>(), static_cast<float*>(weights.data_ptr()), st, exec.stream);
    if (e != cudaSuccess)
      throw std::runtime_error(
          mrr::detail::str("mrr::", fn, ": the fused routing kernel did not launch: ", cudaGetErrorString(e)));
    if (check) router.check_route(exec, lv, view<std::int32_t>(ids32, fn, "ids"), wv, st, ws.workspace());
    out.ids.copy_(ids32);
  } else if (replay_ids == nullptr) {
    router.route(exec, lv, iv, wv, st, ws.workspace());
    if (check) router.check_route(exec, lv, iv, wv, st, ws.workspace());
  } else {
    const auto given = view<const IdIn>(*replay_ids, fn, "ids");
    const std::uint8_t* mask = replay_mask ? static_cast<const std::uint8_t*>(replay_mask->data_ptr()) : nullptr;
    router.replay(exec, lv, given, mask, iv, wv, st, ws.workspace());
    if (check) router.check_replay(exec, lv, given, mask, iv, wv, st, ws.workspace());
  }
  out.weights = DeviceRouterWeights<T, In>::apply(logits, out.ids, &weights, &router, check);
  return out;
}

template <class T, class IdIn>
TensorRouting dispatch(const device::TopKRouter<T>& router, const at::Tensor& logits, const at::Tensor* ids,
                       const at::Tensor* mask, bool check, const char* fn) {
  require_cuda(logits, fn, "logits");
  if (logits.scalar_type() == at::kBFloat16) return run<T, bf16, IdIn>(router, logits, ids, mask, check, fn);
  return run<T, T, IdIn>(router, logits, ids, mask, check, fn);
}

}  // namespace detail

// Native routing of CUDA logits [T, E] (the router's scalar type, or bfloat16; any row stride).
// weights [T, k] (autograd: the device router's backward), ids [T, k] int64, status [T] uint8.
// A config with capacity_factor is refused (route, then drop with mrr/thrust/capacity.hpp).
template <class T>
TensorRouting route(const device::TopKRouter<T>& router, const at::Tensor& logits, bool check = true) {
  return detail::dispatch<T, std::int64_t>(router, logits, nullptr, nullptr, check, "torch::cuda::route");
}

// Replay of ids [T, k] (an int64 or int32 tensor on the logits' device, range-checked on the
// device in its own type: an int64 2^32 + e is an error, never e). With a replay_mask [T] (uint8
// or bool on that device), rows whose mask is 0 route natively.
template <class T>
TensorRouting replay(const device::TopKRouter<T>& router, const at::Tensor& logits, const at::Tensor& ids,
                     const at::Tensor& replay_mask = at::Tensor(), bool check = true) {
  constexpr const char* fn = "torch::cuda::replay";
  detail::require_cuda(logits, fn, "logits");
  detail::require_same_device(ids, logits, fn, "ids");
  mrr::detail::require(ids.scalar_type() == at::kLong || ids.scalar_type() == at::kInt, fn, "'ids' has dtype ",
                       detail::text(ids.scalar_type()), "; expert ids here are int64 or int32");
  mrr::detail::require(ids.dim() == 2 && ids.size(0) == logits.size(0) && ids.size(1) == router.topk(), fn,
                       "'ids' must be [", logits.size(0), ", ", router.topk(), "], got ", detail::text(ids.sizes()));
  at::Tensor mask;
  if (replay_mask.defined()) {
    detail::require_same_device(replay_mask, logits, fn, "replay_mask");
    mrr::detail::require(replay_mask.dim() == 1 && replay_mask.size(0) == logits.size(0), fn, "'replay_mask' must be [",
                         logits.size(0), "], got ", detail::text(replay_mask.sizes()));
    mrr::detail::require(replay_mask.scalar_type() == at::kByte || replay_mask.scalar_type() == at::kBool, fn,
                         "'replay_mask' has dtype ", detail::text(replay_mask.scalar_type()),
                         "; expected uint8 or bool");
    mask = replay_mask.contiguous();  // bool and uint8 share the byte layout (0 / 1)
  }
  const at::Tensor* m = mask.defined() ? &mask : nullptr;
  if (ids.scalar_type() == at::kInt) return detail::dispatch<T, std::int32_t>(router, logits, &ids, m, check, fn);
  return detail::dispatch<T, std::int64_t>(router, logits, &ids, m, check, fn);
}

// A device router on CUDA tensors, and the ResidentRouter RoutingReplay::route_resident takes:
// logits stay on the device, ids cross to the host store and back.
template <class T = float>
class Router {
 public:
  using scalar_type = T;
  using resident_logits = at::Tensor;
  using resident_routing = TensorRouting;

  explicit Router(RouterConfig config) : router_(std::move(config)) {}

  const device::TopKRouter<T>& device() const { return router_; }
  const RouterConfig& config() const { return router_.config(); }
  int num_experts() const { return router_.num_experts(); }
  int topk() const { return router_.topk(); }

  // Selection-only bias (use_expert_bias), num_experts host values.
  void set_expert_bias(const std::vector<T>& bias) { router_.set_expert_bias(bias); }

  TensorRouting route(const at::Tensor& logits, bool check = true) const { return cuda::route(router_, logits, check); }
  TensorRouting replay(const at::Tensor& logits, const at::Tensor& ids, const at::Tensor& replay_mask = at::Tensor(),
                       bool check = true) const {
    return cuda::replay(router_, logits, ids, replay_mask, check);
  }

  // ResidentRouter. An empty `found` replays every row (the mask-free path).
  long resident_rows(const at::Tensor& logits) const {
    detail::require_cuda(logits, "torch::cuda::Router", "logits");
    mrr::detail::require(logits.dim() == 2, "torch::cuda::Router", "'logits' must be 2-D [rows, experts], got ",
                         detail::text(logits.sizes()));
    return static_cast<long>(logits.size(0));
  }
  TensorRouting route_resident(const at::Tensor& logits) const { return route(logits); }
  TensorRouting replay_resident(const at::Tensor& logits, const ExpertIds& ids,
                                const std::vector<std::uint8_t>& found) const {
    // Host -> device copies of pageable memory: the copy has finished reading `ids` / `found`
    // when .to() returns, so they may go out of scope.
    const auto on_device = logits.options().dtype(at::kInt);
    const at::Tensor given =
        at::from_blob(const_cast<std::int32_t*>(ids.data()), {ids.rows(), ids.cols()}, at::dtype(at::kInt))
            .to(on_device, /*non_blocking=*/false, /*copy=*/true);
    at::Tensor mask;
    if (!found.empty())
      mask = at::from_blob(const_cast<std::uint8_t*>(found.data()), {static_cast<std::int64_t>(found.size())},
                           at::dtype(at::kByte))
                 .to(logits.options().dtype(at::kByte), false, true);
    return replay(logits, given, mask);
  }
  void copy_ids_to_host(const TensorRouting& routing, ExpertIds& out) const {
    const at::Tensor host = routing.ids.to(at::kCPU).to(at::kInt).contiguous();  // ids the router chose: in range
    out.resize(host.size(0), host.size(1));
    if (host.numel() != 0) std::copy_n(host.data_ptr<std::int32_t>(), host.numel(), out.data());
  }

 private:
  device::TopKRouter<T> router_;
};

// What a trainer's MoE layer calls on CUDA logits: the RoutingReplay's current action decides
// (native, record, replay_forward, replay_backward) for the rows set by replay.set_micro_batch.
// Padding rows of the micro-batch are never recorded or used: when one holds a NaN or infinity
// (uninitialised padding), padding rows are routed as zeros, as the host path does.
template <class Store, class T>
TensorRouting route(RoutingReplay<Store>& replay, const Router<T>& router, int layer, const at::Tensor& logits) {
  constexpr const char* fn = "torch::cuda::route";
  detail::require_cuda(logits, fn, "logits");
  if constexpr (std::is_same_v<Store, NoRouteStore>) {
    return replay.route_resident(router, layer, logits);
  } else {
    const TokenLayout& layout = replay.micro_batch();
    if (layout.size() == static_cast<std::size_t>(logits.size(0)) && layout.real_tokens() != layout.size()) {
      std::vector<std::int64_t> padding;
      for (std::size_t r = 0; r < layout.size(); ++r)
        if (layout[r].is_padding()) padding.push_back(static_cast<std::int64_t>(r));
      const at::Tensor rows = at::tensor(padding, at::dtype(at::kLong)).to(logits.device());
      if (!at::isfinite(logits.index_select(0, rows)).all().item<bool>())
        return replay.route_resident(router, layer, logits.index_fill(0, rows, 0));
    }
    return replay.route_resident(router, layer, logits);
  }
}

}  // namespace cuda
}  // namespace torch
MRR_NAMESPACE_END
