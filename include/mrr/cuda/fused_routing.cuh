// Fused routing + replay kernel: one warp per token, the token's logits in registers, top-k by k
// rounds of a warp arg-max (ties: lower index, as kernels/topk.hpp), replayed rows take their ids
// from the replay buffer, then the weights of DESIGN.md section 3, all in one launch. The fast path
// for routers without group limits (softmax pre/post, sigmoid / sqrt-softplus, with or without
// expert bias); checked against the Thrust path (mrr/thrust/routing.hpp) in tests/cuda.
// It is the warp-cooperative specialisation of the router kernels (mrr/kernels/router.hpp), as the
// AVX2 tiles are their host specialisation: it reads the same resolved parameters, applies the same
// score functions (kernels::score_of) and reports the same status codes, with the row's work split
// over 32 lanes instead of one thread.
// Rows are checked in the same pass as the Thrust path checks them (kernels::RowStatus:
// NaN / +inf logits, replayed ids out of range or repeated, fewer than k finite logits); a bad
// row's ids are written as -1 and its weights as NaN, and its code goes to `status` when given
// (a row whose weights come out NaN, its chosen logits all -inf, keeps its ids: row_nan_weight).
#pragma once

#include <mrr/cuda/config.cuh>
#include <mrr/kernels/router.hpp>
#include <mrr/kernels/score.hpp>
#include <mrr/thrust/routing.hpp>

#include <cuda_runtime.h>

#include <cfloat>
#include <climits>
#include <cstdint>
#include <type_traits>

MRR_NAMESPACE_BEGIN
namespace cuda {
namespace kernels {

inline constexpr int kFusedWarpsPerBlock = 8;
inline constexpr unsigned kFullWarp = 0xffffffffu;
inline constexpr int kNoExpert = 0x7fffffff;  // an arg-max candidate that is no candidate

// (value, index) order of the selection: larger value first, the lower index among equals. A total
// order on non-NaN values (rows holding NaN are rejected before selection), so every lane of the
// butterfly below ends with the same winner.
__device__ __forceinline__ bool ranks_before(float v, int i, float w, int j) { return v > w || (v == w && i < j); }

__device__ __forceinline__ int warp_sum(int x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(kFullWarp, x, off);
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(kFullWarp, x, off);
  return x;
}
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x = fmaxf(x, __shfl_xor_sync(kFullWarp, x, off));
  return x;
}

// Expert e = lane + 32 i of the row lives in lane e % 32, register i (PerLane = ceil(E / 32),
// rounded up to a power of two by the launcher). Every lane of a warp works on the same token, so
// the early return and every branch before a shuffle are warp-uniform: the full-mask shuffles
// always see 32 active lanes (the block is whole warps).
template <int PerLane, class In>
__global__ void __launch_bounds__(32 * kFusedWarpsPerBlock)
    fused_route_replay(device::RouterParams p, const In* __restrict__ logits, const float* __restrict__ bias,
                       const std::int32_t* __restrict__ replay_ids, const std::uint8_t* __restrict__ replay_mask,
                       long tokens, std::int32_t* __restrict__ ids, float* __restrict__ weights,
                       std::uint8_t* __restrict__ status) {
  namespace rk = mrr::kernels;
  const int lane = threadIdx.x & 31;
  const long t = (static_cast<long>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  if (t >= tokens) return;  // whole warps
  const int n = p.num_experts, k = p.topk;
  const In* z = logits + t * n;
  const auto load = [](In x) { return device::kernels::widen<float>(x); };  // bf16: exact
  const bool replay_row = replay_ids != nullptr && (replay_mask == nullptr || replay_mask[t] != 0);
  // Unrenormalised pre-softmax weights divide by a sum over all E: a replayed row reads its whole
  // row only then (as the Thrust path and the CPU router); other replayed rows read k logits.
  const bool whole_row = p.replay_reads_whole_row();
  const bool load_row = !replay_row || whole_row;
  float zr[PerLane], s[PerLane];
  unsigned taken = 0;  // bit i: expert lane + 32 i is no candidate (past E, or chosen already)
  int bad = 0, finite = 0;
#pragma unroll
  for (int i = 0; i < PerLane; ++i) {
    const int e = lane + 32 * i;
    const bool in_row = e < n;
    const float x = in_row && load_row ? load(z[e]) : 0.f;
    zr[i] = x;
    if (!in_row) taken |= 1u << i;
    bad |= in_row && !(x <= FLT_MAX) ? 1 : 0;     // NaN or +inf
    finite += in_row && x >= -FLT_MAX ? 1 : 0;  // not -inf, not NaN
    float v = x;
    if (!p.selects_on_logits && in_row && !replay_row) {  // selection scores: native rows only
      if (p.score != 0) v = rk::score_of(p.score, v);
      if (p.has_bias) v += bias[e];
    }
    s[i] = v;
  }

  // The checks of kernels::route_row, in its order; the code is warp-uniform.
  std::uint8_t code = rk::row_ok;
  std::int32_t my_id = -1;  // lane j < k holds slot j
  float zj = 0.f;           // and its logit
  if (replay_row) {
    if (lane < k) my_id = replay_ids[t * k + lane];
    const unsigned slots = k == 32 ? kFullWarp : (1u << k) - 1u;
    const bool out_of_range = lane < k && (my_id < 0 || my_id >= n);
    // Every lane takes part in the match (a full-mask intrinsic behind `lane < k &&` would wait
    // for the lanes the short circuit skipped: the warp hangs).
    const unsigned same_id = __match_any_sync(kFullWarp, my_id);
    const bool repeated = lane < k && __popc(same_id & slots) > 1;
    if (__any_sync(kFullWarp, out_of_range || repeated)) {
      code = rk::row_invalid_replay;
    } else {
      if (lane < k) zj = load(z[my_id]);
      const bool invalid = whole_row ? bad != 0 : (lane < k && !(zj <= FLT_MAX));
      if (__any_sync(kFullWarp, invalid)) code = rk::row_invalid_logit;
    }
  } else if (__any_sync(kFullWarp, bad != 0)) {
    code = rk::row_invalid_logit;
  } else if (warp_sum(finite) < k) {  // a top-k that must take a masked (-inf) expert
    code = rk::row_too_few_finite;
  }
  if (code != rk::row_ok) {
    if (lane < k) {
      ids[t * k + lane] = -1;
      weights[t * k + lane] = __int_as_float(0x7fc00000);  // quiet NaN
    }
    if (status != nullptr && lane == 0) status[t] = code;
    return;  // warp-uniform
  }

  if (!replay_row) {
    for (int j = 0; j < k; ++j) {
      // This lane's best candidate, scanning its experts in ascending index order...
      float bv = 0.f;
      int bi = kNoExpert;
#pragma unroll
      for (int i = 0; i < PerLane; ++i) {
        const int e = lane + 32 * i;
        if (!(taken & (1u << i)) && (bi == kNoExpert || ranks_before(s[i], e, bv, bi))) {
          bv = s[i];
          bi = e;
        }
      }
      // ...then the warp's: a total order, so all 32 lanes agree on (bv, bi). k <= E, so some
      // lane always has a candidate.
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) {
        const float ov = __shfl_xor_sync(kFullWarp, bv, off);
        const int oi = __shfl_xor_sync(kFullWarp, bi, off);
        if (oi != kNoExpert && (bi == kNoExpert || ranks_before(ov, oi, bv, bi))) {
          bv = ov;
          bi = oi;
        }
      }
      if ((bi & 31) == lane) taken |= 1u << (bi >> 5);
      if (lane == j) my_id = bi;
    }
    if (lane < k) zj = load(z[my_id]);
  }

  // Weights: lane j < k computes slot j; sums over the k slots or all experts by warp reduction.
  float w = 0.f;
  if (p.score == 0) {
    if (whole_row) {
      float mx = -INFINITY;
#pragma unroll
      for (int i = 0; i < PerLane; ++i)
        if (lane + 32 * i < n) mx = fmaxf(mx, zr[i]);
      mx = warp_max(mx);
      float sum = 0.f;
#pragma unroll
      for (int i = 0; i < PerLane; ++i)
        if (lane + 32 * i < n) sum += expf(zr[i] - mx);
      sum = warp_sum(sum);
      w = lane < k ? expf(zj - mx) / sum : 0.f;
    } else {
      const float mx = warp_max(lane < k ? zj : -INFINITY);
      const float e = lane < k ? expf(zj - mx) : 0.f;
      w = e / warp_sum(e);
    }
  } else {
    w = lane < k ? rk::score_of(p.score, zj) : 0.f;
    if (p.normalize) w /= warp_sum(w) + 1e-20f;
  }
  if (p.has_scale) w *= static_cast<float>(p.scale);
  if (lane < k) {
    ids[t * k + lane] = my_id;
    weights[t * k + lane] = w;
  }
  // A NaN weight: every logit it is normalised over is -inf (a replayed row whose chosen experts
  // are all masked), rejected as the Thrust path and the CPU router reject it.
  const bool nan_weight = __any_sync(kFullWarp, lane < k && !(w == w));
  if (status != nullptr && lane == 0) status[t] = nan_weight ? rk::row_nan_weight : rk::row_ok;
}

}  // namespace kernels

// Whether the fused kernel handles this router (no group limits, no capacity dropping: that is a
// pass over the whole batch, device::TopKRouter's; 1 <= k <= E <= 1024, k <= 32; no expert bias
// on softmax, which RouterConfig rejects and whose pre-softmax selection this kernel lacks).
inline bool fused_routing_supports(const device::RouterParams& p) {
  return !p.grouped && !p.drops_over_capacity && p.num_experts >= 1 && p.num_experts <= 1024 && p.topk >= 1 &&
         p.topk <= 32 && p.topk <= p.num_experts && !(p.score == 0 && p.has_bias);
}

// Routes (replay_ids null) or replays (rows with replay_mask 0 route natively; every row replays
// when the mask is null) `tokens` rows of logits [tokens, E] on `stream`; ids and weights
// [tokens, k]. Logits are fp32 or mrr::bf16 (a bf16 gate's output, widened exactly: the ids of the
// fp32 path run on the bf16-rounded logits). Pointers are device memory; bias [E] is needed when the router has expert bias
// (finite: device::TopKRouter::set_expert_bias checks it). status [tokens], when not null, gets
// each row's device::kernels::RowStatus (row_ok = 0), as the Thrust path computes it; rows that
// fail get ids -1 and NaN weights either way. Returns the launch error (asynchronous: kernel faults
// show at the next synchronisation), cudaErrorInvalidValue for an unsupported router or missing
// buffer.
template <class In>
cudaError_t fused_route_replay(const device::RouterParams& p, const In* logits, const float* bias,
                               const std::int32_t* replay_ids, const std::uint8_t* replay_mask, long tokens,
                               std::int32_t* ids, float* weights, std::uint8_t* status = nullptr,
                               cudaStream_t stream = nullptr) {
  static_assert(std::is_same_v<In, float> || std::is_same_v<In, bf16>,
                "fused_route_replay: logits are float or mrr::bf16");
  if (!fused_routing_supports(p) || tokens < 0) return cudaErrorInvalidValue;
  if (tokens == 0) return cudaSuccess;
  if (logits == nullptr || ids == nullptr || weights == nullptr || (p.has_bias && bias == nullptr))
    return cudaErrorInvalidValue;
  constexpr int kWarps = kernels::kFusedWarpsPerBlock;
  const long blocks = (tokens + kWarps - 1) / kWarps;
  if (blocks > INT_MAX) return cudaErrorInvalidConfiguration;  // gridDim.x < 2^31
  const dim3 block(32 * kWarps);
  const dim3 grid(static_cast<unsigned>(blocks));
  const int per_lane = (p.num_experts + 31) / 32;
#define MRR_FUSED_LAUNCH(N)                                                                                     \
  kernels::fused_route_replay<N, In><<<grid, block, 0, stream>>>(p, logits, bias, replay_ids, replay_mask, tokens, \
                                                                 ids, weights, status)
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
