// Kernels over mrr's host/device helpers (detail/topk.hpp, detail/score.hpp): the same code the
// CPU router runs, compiled for the GPU, so CPU and GPU pick identical experts from identical
// fp32 inputs.
#include <mrr/cuda/config.cuh>
#include <mrr/cuda/fused_routing.cuh>
#include <mrr/detail/score.hpp>
#include <mrr/detail/topk.hpp>

#include "device_routing.hpp"

#include <cuda_runtime.h>

#include <exception>
#include <utility>
#include <vector>

namespace {

constexpr int kMaxExperts = 512;
constexpr int kMaxTopK = 16;

__global__ void topk_rows(const float* logits, int rows, int experts, int k, int* ids) {
  const int row = blockIdx.x * blockDim.x + threadIdx.x;
  if (row >= rows) return;
  float values[kMaxTopK];
  mrr::detail::topk_desc(logits + static_cast<long>(row) * experts, experts, k, ids + static_cast<long>(row) * k, values);
}

__global__ void biased_sigmoid_topk_rows(const float* logits, const float* bias, int rows, int experts, int k,
                                         int* ids) {
  const int row = blockIdx.x * blockDim.x + threadIdx.x;
  if (row >= rows) return;
  float scores[kMaxExperts];
  float values[kMaxTopK];
  for (int e = 0; e < experts; ++e) scores[e] = mrr::detail::sigmoid(logits[static_cast<long>(row) * experts + e]) + bias[e];
  mrr::detail::topk_desc(scores, experts, k, ids + static_cast<long>(row) * k, values);
}

std::string check(cudaError_t e) { return e == cudaSuccess ? std::string() : std::string(cudaGetErrorString(e)); }

template <class Launch>
std::string run(const float* logits, const float* bias, int rows, int experts, int k, int* ids, Launch launch) {
  if (experts > kMaxExperts || k > kMaxTopK || k > experts) return "shape outside the test kernel's limits";
  if (rows <= 0) return {};
  float *d_logits = nullptr, *d_bias = nullptr;
  int* d_ids = nullptr;
  std::string err;
  const size_t n = static_cast<size_t>(rows) * experts;
  if (err.empty()) err = check(cudaMalloc(&d_logits, n * sizeof(float)));
  if (err.empty()) err = check(cudaMalloc(&d_bias, experts * sizeof(float)));
  if (err.empty()) err = check(cudaMalloc(&d_ids, static_cast<size_t>(rows) * k * sizeof(int)));
  if (err.empty()) err = check(cudaMemcpy(d_logits, logits, n * sizeof(float), cudaMemcpyHostToDevice));
  if (err.empty() && bias) err = check(cudaMemcpy(d_bias, bias, experts * sizeof(float), cudaMemcpyHostToDevice));
  if (err.empty()) {
    launch((rows + 127) / 128, 128, d_logits, d_bias, d_ids);
    err = check(cudaGetLastError());  // launch errors: cudaDeviceSynchronize does not report them
    if (err.empty()) err = check(cudaDeviceSynchronize());
  }
  if (err.empty())
    err = check(cudaMemcpy(ids, d_ids, static_cast<size_t>(rows) * k * sizeof(int), cudaMemcpyDeviceToHost));
  cudaFree(d_logits);
  cudaFree(d_bias);
  cudaFree(d_ids);
  return err;
}

}  // namespace

namespace mrr::test {

int cuda_device_count() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess ? count : 0;
}

std::string device_topk(const float* logits, int rows, int experts, int k, int* ids) {
  return run(logits, nullptr, rows, experts, k, ids, [&](int blocks, int threads, float* l, float*, int* out) {
    topk_rows<<<blocks, threads>>>(l, rows, experts, k, out);
  });
}

std::string device_biased_sigmoid_topk(const float* logits, const float* bias, int rows, int experts, int k, int* ids) {
  return run(logits, bias, rows, experts, k, ids, [&](int blocks, int threads, float* l, float* b, int* out) {
    biased_sigmoid_topk_rows<<<blocks, threads>>>(l, b, rows, experts, k, out);
  });
}

namespace {

// The fused kernel on logits stored as In (float or mrr::bf16).
template <class In>
FusedRoute fused_route(const RouterConfig& config, const In* logits, long rows, const float* bias,
                       const std::int32_t* replay_ids, const std::uint8_t* replay_mask, bool warps_only) {
  FusedRoute out;
  try {
    config.validate();
  } catch (const std::exception& e) {
    out.error = e.what();
    return out;
  }
  const device::RouterParams p = device::resolve(config);
  const std::size_t n = static_cast<std::size_t>(rows) * static_cast<std::size_t>(p.num_experts),
                    slots = static_cast<std::size_t>(rows) * static_cast<std::size_t>(p.topk);
  In* d_logits = nullptr;
  float *d_bias = nullptr, *d_weights = nullptr;
  std::int32_t *d_replay = nullptr, *d_ids = nullptr;
  std::uint8_t *d_mask = nullptr, *d_status = nullptr;
  std::string& err = out.error;
  auto upload = [&](auto** dst, const auto* src, std::size_t count) {
    if (err.empty()) err = check(cudaMalloc(reinterpret_cast<void**>(dst), count * sizeof(**dst) + 1));
    if (err.empty() && src) err = check(cudaMemcpy(*dst, src, count * sizeof(**dst), cudaMemcpyHostToDevice));
  };
  upload(&d_logits, logits, n);
  if (bias) upload(&d_bias, bias, static_cast<std::size_t>(p.num_experts));
  if (replay_ids) upload(&d_replay, replay_ids, slots);
  if (replay_mask) upload(&d_mask, replay_mask, static_cast<std::size_t>(rows));
  upload(&d_ids, static_cast<const std::int32_t*>(nullptr), slots);
  upload(&d_weights, static_cast<const float*>(nullptr), slots);
  upload(&d_status, static_cast<const std::uint8_t*>(nullptr), static_cast<std::size_t>(rows));
  if (err.empty() && warps_only && !mrr::cuda::fused_routing_supports(p)) err = check(cudaErrorInvalidValue);
  if (err.empty())
    err = check(warps_only ? mrr::cuda::detail::launch_fused_warps(p, d_logits, d_bias, d_replay,
                                                                   replay_ids ? d_mask : nullptr, rows, d_ids,
                                                                   d_weights, d_status, nullptr)
                           : mrr::cuda::fused_route_replay(p, d_logits, d_bias, d_replay,
                                                           replay_ids ? d_mask : nullptr, rows, d_ids, d_weights,
                                                           d_status));
  if (err.empty()) err = check(cudaDeviceSynchronize());
  if (err.empty()) {
    out.ids.resize(slots);
    out.weights.resize(slots);
    out.status.resize(static_cast<std::size_t>(rows));
    err = check(cudaMemcpy(out.ids.data(), d_ids, slots * sizeof(std::int32_t), cudaMemcpyDeviceToHost));
    if (err.empty()) err = check(cudaMemcpy(out.weights.data(), d_weights, slots * sizeof(float), cudaMemcpyDeviceToHost));
    if (err.empty())
      err = check(cudaMemcpy(out.status.data(), d_status, static_cast<std::size_t>(rows), cudaMemcpyDeviceToHost));
  }
  cudaFree(d_logits);
  cudaFree(d_bias);
  cudaFree(d_replay);
  cudaFree(d_mask);
  cudaFree(d_ids);
  cudaFree(d_weights);
  cudaFree(d_status);
  return out;
}

}  // namespace

#include "fused_route_functions.inc"

}  // namespace mrr::test
