// The extension's CUDA half, seen from its C++ half (extension.cpp, compiled by the host
// compiler): an opaque device router and the calls that run it on CUDA tensors. Implemented in
// cuda_router.cu (nvcc) with mrr/torch/cuda.hpp; compiled in when mrr_torch.load() finds CUDA
// torch and nvcc (MRR_TORCH_WITH_CUDA).
#pragma once

#include <mrr/replay/any_store.hpp>
#include <mrr/replay/routing_replay.hpp>
#include <mrr/router/config.hpp>
#include <mrr/torch/router.hpp>

#include <memory>
#include <vector>

namespace mrr_torch_ext {

struct CudaRouter;  // mrr::torch::cuda::Router<float>, defined in cuda_router.cu

// bias: the selection-only expert bias (num_experts values) when config.use_expert_bias, else empty.
std::shared_ptr<CudaRouter> make_cuda_router(const mrr::RouterConfig& config, const std::vector<float>& bias);
// Copies a new expert bias to the device router (set_expert_bias's checks).
void cuda_set_expert_bias(CudaRouter& router, const std::vector<float>& bias);

// Native routing and replay of CUDA logits on the current stream (mrr::torch::cuda::route / replay).
// check: synchronise once and raise the CPU router's error for a bad row; false: nothing waits.
mrr::torch::TensorRouting cuda_route(const CudaRouter& router, const at::Tensor& logits, bool check);
mrr::torch::TensorRouting cuda_replay(const CudaRouter& router, const at::Tensor& logits, const at::Tensor& ids,
                                      bool check);

// Through the replay controller: the current action decides; ids cross to the host store.
mrr::torch::TensorRouting cuda_replay_route(mrr::RoutingReplay<mrr::AnyRouteStore>& replay, const CudaRouter& router,
                                            int layer, const at::Tensor& logits);

}  // namespace mrr_torch_ext
