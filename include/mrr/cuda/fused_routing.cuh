// Fused routing + replay kernel: one warp per token, the token's logits in registers, top-k by k
// rounds of a warp arg-max (ties: lower index, as detail/topk.hpp), replayed rows take their ids
// from the replay buffer, then the weights of DESIGN.md section 3, all in one launch. The fast path
// for routers without group limits (softmax pre/post, sigmoid / sqrt-softplus, with or without
// expert bias); checked against the Thrust path (mrr/thrust/routing.hpp) in tests/cuda.
#pragma once

#include <mrr/cuda/config.cuh>
#include <mrr/detail/score.hpp>
#include <mrr/thrust/routing.hpp>

#include <cuda_runtime.h>

#include <cstdint>

MRR_NAMESPACE_BEGIN
namespace cuda {
namespace kernels {

// (value, index) order of the selection: larger value first, the lower index among equals.
__device__ __forceinline__ bool ranks_before(float v, int i, float w, int j) { return v > w || (v == w && i < j); }

template <int PerLane>
__global__ void fused_route_replay(device::RouterParams p, const float* __restrict__ logits,
                                   const float* __restrict__ bias, const std::int32_t* __restrict__ replay_ids,
                                   const std::uint8_t* __restrict__ replay_mask, long tokens,
                                   std::int32_t* __restrict__ ids, float* __restrict__ weights) {
  const int lane = threadIdx.x & 31;
  const long t = (static_cast<long>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  if (t >= tokens) return;
  const int n = p.num_experts, k = p.topk;
  const float* z = logits + t * n;
  float zr[PerLane], s[PerLane];
  unsigned taken = 0;
#pragma unroll
  for (int i = 0; i < PerLane; ++i) {
    const int e = lane + 32 * i;
    zr[i] = e < n ? z[e] : 0.f;
    if (e >= n) taken |= 1u << i;
    float v = zr[i];
    if (!p.selects_on_logits && e < n) {
      if (p.score != 0) v = device::kernels::score_of(p.score, v);
      if (p.has_bias) v += bias[e];
    }
    s[i] = v;
  }
  std::int32_t my_id = -1;  // lane j < k holds slot j
  const bool replay_row = replay_ids != nullptr && (replay_mask == nullptr || replay_mask[t] != 0);
  if (replay_row) {
    if (lane < k) my_id = replay_ids[t * k + lane];
  } else {
    for (int j = 0; j < k; ++j) {
      float bv = 0.f;
      int bi = 0x7fffffff;
#pragma unroll
      for (int i = 0; i < PerLane; ++i) {
        const int e = lane + 32 * i;
        if (!(taken & (1u << i)) && (bi == 0x7fffffff || ranks_before(s[i], e, bv, bi))) {
          bv = s[i];
          bi = e;
        }
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, off);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, off);
        if (oi != 0x7fffffff && (bi == 0x7fffffff || ranks_before(ov, oi, bv, bi))) {
          bv = ov;
          bi = oi;
        }
      }
      if ((bi & 31) == lane) taken |= 1u << (bi >> 5);
      if (lane == j) my_id = bi;
    }
  }
  // Weights: lane j < k computes slot j; sums over the k slots or all experts by warp reduction.
  const float zj = lane < k ? z[my_id] : 0.f;
  float w = 0.f;
  if (p.score == 0) {
    if (p.pre_softmax && !p.normalize) {
      float mx = -INFINITY;
#pragma unroll
      for (int i = 0; i < PerLane; ++i)
        if (lane + 32 * i < n) mx = fmaxf(mx, zr[i]);
      for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      float sum = 0.f;
#pragma unroll
      for (int i = 0; i < PerLane; ++i)
        if (lane + 32 * i < n) sum += expf(zr[i] - mx);
      for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
      w = lane < k ? expf(zj - mx) / sum : 0.f;
    } else {
      float mx = lane < k ? zj : -INFINITY;
      for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      const float e = lane < k ? expf(zj - mx) : 0.f;
      float sum = e;
      for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
      w = e / sum;
    }
  } else {
    w = lane < k ? device::kernels::score_of(p.score, zj) : 0.f;
    if (p.normalize) {
      float sum = w;
      for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
      w /= sum + 1e-20f;
    }
  }
  if (p.has_scale) w *= static_cast<float>(p.scale);
  if (lane < k) {
    ids[t * k + lane] = my_id;
    weights[t * k + lane] = w;
  }
}

}  // namespace kernels

// Whether the fused kernel handles this router (no group limits, no capacity dropping: that is a
// pass over the whole batch, device::TopKRouter's; E <= 1024, k <= 32).
inline bool fused_routing_supports(const device::RouterParams& p) {
  return !p.grouped && !p.drops_over_capacity && p.num_experts <= 1024 && p.topk <= 32;
}

// Routes (replay_ids null) or replays (rows with replay_mask 0, or all when it is null) `tokens`
// rows of fp32 logits [tokens, E] on `stream`. Inputs are validated by the caller (device::TopKRouter
// does it on the Thrust path); pointers are device memory.
inline cudaError_t fused_route_replay(const device::RouterParams& p, const float* logits, const float* bias,
                                      const std::int32_t* replay_ids, const std::uint8_t* replay_mask, long tokens,
                                      std::int32_t* ids, float* weights, cudaStream_t stream = nullptr) {
  if (!fused_routing_supports(p)) return cudaErrorInvalidValue;
  if (tokens == 0) return cudaSuccess;
  constexpr int kWarpsPerBlock = 8;
  const dim3 block(32 * kWarpsPerBlock);
  const dim3 grid(static_cast<unsigned>((tokens + kWarpsPerBlock - 1) / kWarpsPerBlock));
  const int per_lane = (p.num_experts + 31) / 32;
#define MRR_FUSED_LAUNCH(N) \
  kernels::fused_route_replay<N><<<grid, block, 0, stream>>>(p, logits, bias, replay_ids, replay_mask, tokens, ids, weights)
  if (per_lane <= 1)
    MRR_FUSED_LAUNCH(1);
  else if (per_lane <= 2)
    MRR_FUSED_LAUNCH(2);
  else if (per_lane <= 4)
    MRR_FUSED_LAUNCH(4);
  else if (per_lane <= 8)
    MRR_FUSED_LAUNCH(8);
  else if (per_lane <= 16)
    MRR_FUSED_LAUNCH(16);
  else
    MRR_FUSED_LAUNCH(32);
#undef MRR_FUSED_LAUNCH
  return cudaGetLastError();
}

}  // namespace cuda
MRR_NAMESPACE_END
