// Fused routing + replay on a CUDA stream: mrr::cuda::fused_route_replay and the launchers it
// chooses between. The kernels, what they compute and how, are in mrr/cuda/routing_kernels.cuh.
#pragma once

#include <mrr/cuda/config.cuh>
#include <mrr/cuda/routing_kernels.cuh>

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

MRR_NAMESPACE_BEGIN
namespace cuda {
namespace detail {

// Starts a kernel instance on a stream (the `launch` of routing_kernels.cuh's launchers).
struct StreamLaunch {
  cudaStream_t stream;
  template <class... Params, class... Args>
  void operator()(void (*kernel)(Params...), unsigned blocks, unsigned threads, Args... args) const {
    kernel<<<blocks, threads, 0, stream>>>(args...);
  }
};

inline cudaError_t launch_error(LaunchStatus s) {
  switch (s) {
    case LaunchStatus::launched:
      return cudaGetLastError();
    case LaunchStatus::nothing_to_launch:
      return cudaSuccess;
    case LaunchStatus::too_many_blocks:
      return cudaErrorInvalidConfiguration;
    default:
      return cudaErrorInvalidValue;
  }
}

template <class In>
cudaError_t launch_fused_segments(const device::RouterParams& p, const In* logits, const float* bias, long tokens,
                                  std::int32_t* ids, float* weights, std::uint8_t* status, cudaStream_t stream) {
  return launch_error(route_segments_with(StreamLaunch{stream}, p, logits, bias, tokens, ids, weights, status));
}

// The warp-per-token kernel (every supported router; replay), or its replay segments.
template <class In>
cudaError_t launch_fused_warps(const device::RouterParams& p, const In* logits, const float* bias,
                               const std::int32_t* replay_ids, const std::uint8_t* replay_mask, long tokens,
                               std::int32_t* ids, float* weights, std::uint8_t* status, cudaStream_t stream) {
  return launch_error(
      route_warps_with(StreamLaunch{stream}, p, logits, bias, replay_ids, replay_mask, tokens, ids, weights, status));
}

}  // namespace detail

// Routes (replay_ids null) or replays (rows with replay_mask 0 route natively; every row replays
// when the mask is null) `tokens` rows of logits [tokens, E] on `stream`; ids and weights
// [tokens, k]. Logits are fp32 or mrr::bf16 (a bf16 gate's output, widened exactly: the ids of the
// fp32 path run on the bf16-rounded logits). Pointers are device memory; bias [E] is needed when the router has expert bias
// (finite: device::TopKRouter::set_expert_bias checks it). status [tokens], when not null, gets
// each row's device::kernels::RowStatus (row_ok = 0), as the Thrust path computes it; rows that
// fail get ids -1 and NaN weights either way. Returns the launch error (asynchronous: kernel faults
// show at the next synchronisation), cudaErrorInvalidValue for an unsupported router or missing
// buffer. Native routing with k <= 8 and E a multiple of 32 up to 256 runs the segment-per-token
// kernel (detail::fused_segments_apply); the rest, the warp-per-token kernel. Both give the CPU
// router's ids.
template <class In>
cudaError_t fused_route_replay(const device::RouterParams& p, const In* logits, const float* bias,
                               const std::int32_t* replay_ids, const std::uint8_t* replay_mask, long tokens,
                               std::int32_t* ids, float* weights, std::uint8_t* status = nullptr,
                               cudaStream_t stream = nullptr) {
  return detail::launch_error(detail::route_with(detail::StreamLaunch{stream}, p, logits, bias, replay_ids, replay_mask,
                                                 tokens, ids, weights, status));
}

}  // namespace cuda
MRR_NAMESPACE_END
