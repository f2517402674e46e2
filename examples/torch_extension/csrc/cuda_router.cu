// The extension's CUDA half: mrr/torch/cuda.hpp instantiated for float routers (fp32 or bf16
// logits). See cuda_router.h.
#include "cuda_router.h"

#include <mrr/torch/cuda.hpp>

#include <utility>

namespace mrr_torch_ext {

struct CudaRouter {
  mrr::torch::cuda::Router<float> router;
};

std::shared_ptr<CudaRouter> make_cuda_router(const mrr::RouterConfig& config, const std::vector<float>& bias) {
  auto r = std::make_shared<CudaRouter>(CudaRouter{mrr::torch::cuda::Router<float>(config)});
  if (config.use_expert_bias) r->router.set_expert_bias(bias);
  return r;
}

void cuda_set_expert_bias(CudaRouter& router, const std::vector<float>& bias) { router.router.set_expert_bias(bias); }

mrr::torch::TensorRouting cuda_route(const CudaRouter& r, const at::Tensor& logits, bool check) {
  return r.router.route(logits, check);
}

mrr::torch::TensorRouting cuda_replay(const CudaRouter& r, const at::Tensor& logits, const at::Tensor& ids,
                                      bool check) {
  return r.router.replay(logits, ids, at::Tensor(), check);
}

mrr::torch::TensorRouting cuda_replay_route(mrr::RoutingReplay<mrr::AnyRouteStore>& replay, const CudaRouter& r,
                                            int layer, const at::Tensor& logits) {
  return mrr::torch::cuda::route(replay, r.router, layer, logits);
}

}  // namespace mrr_torch_ext
