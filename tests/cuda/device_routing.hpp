// Host interface of device_routing.cu (plain functions: no Eigen, no doctest across nvcc).
#pragma once

#include <mrr/router/config.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace mrr::test {

// Number of CUDA devices, 0 when there is none (or no driver).
int cuda_device_count();

// Top-k expert ids of each row of logits [rows, experts] (row-major), selected on the device
// with mrr's tie rule, one thread per row. Returns an empty string, or the CUDA error.
std::string device_topk(const float* logits, int rows, int experts, int k, int* ids);

// The same selection on sigmoid(logits) + bias, as the expert-bias routers select.
std::string device_biased_sigmoid_topk(const float* logits, const float* bias, int rows, int experts, int k, int* ids);

// mrr::cuda::fused_route_replay on rows of fp32 logits [rows, E] of `config` (validated); bias [E]
// or null; replay_ids [rows, k] or null (native routing); replay_mask [rows] or null. Returns ids
// and weights [rows, k] and each row's status code (device::kernels::RowStatus), or the CUDA
// error. warps_only: the warp-per-token kernel even where the segment kernel would run.
struct FusedRoute {
  std::vector<std::int32_t> ids;
  std::vector<float> weights;
  std::vector<std::uint8_t> status;
  std::vector<float> logits;  // device_fused_route_bf16: the logits the device read, widened to fp32
  std::string error;  // empty on success
};
FusedRoute device_fused_route(const RouterConfig& config, const float* logits, long rows, const float* bias,
                              const std::int32_t* replay_ids, const std::uint8_t* replay_mask,
                              bool warps_only = false);
// Whether fused_route_replay runs the segment-per-token kernel for this router (native routing).
bool fused_segments_apply(const RouterConfig& config);

// The same on the logits rounded to mrr::bf16 (round to nearest even) and uploaded as bf16.
FusedRoute device_fused_route_bf16(const RouterConfig& config, const float* logits, long rows, const float* bias,
                                   const std::int32_t* replay_ids, const std::uint8_t* replay_mask,
                                   bool warps_only = false);

}  // namespace mrr::test
