// The fused routing + replay kernels (mrr/cuda/fused_routing.cuh starts them on a stream). Native
// routing with k <= 8 and E a multiple of 32 up to 256: 8 lanes per token (fused_route_segments: a
// threshold from the lanes' top-2 scores, the few candidates above it ranked in shared memory).
// Otherwise one warp per token, the token's logits in registers, top-k by k rounds of a warp
// arg-max over packed (value, index) keys (ties: lower index, as kernels/topk.hpp), replayed rows
// take their ids from the replay buffer. Then the weights of DESIGN.md section 3, all in one
// launch; both kernels give the same bits. The fast path for softmax pre/post, sigmoid /
// sqrt-softplus, with or without expert bias, and group limits of whole warps of experts
// (DeepSeek-V3's; fused_routing_supports says which); checked against the CPU router and the
// Thrust path (mrr/thrust/routing.hpp) in tests/cuda.
// It is the warp-cooperative specialisation of the router kernels (mrr/kernels/router.hpp), as the
// AVX2 tiles are their host specialisation: it reads the same resolved parameters, applies the same
// score functions (kernels::score_of) and reports the same status codes, with the row's work split
// over 32 lanes instead of one thread.
// Rows are checked in the same pass as the Thrust path checks them (kernels::RowStatus:
// NaN / +inf logits, replayed ids out of range or repeated, fewer than k finite logits); a bad
// row's ids are written as -1 and its weights as NaN, and its code goes to `status` when given
// (a row whose weights come out NaN, its chosen logits all -inf, keeps its ids: row_nan_weight).
// Device code for nvcc. It also compiles on the host under tests/support/lane_emulator.hpp
// (MRR_LANE_EMULATION), which defines the CUDA built-ins used here and runs a launch lane by lane,
// so CI checks the kernels' logic where no GPU is. Which kernel, which instance and how many
// blocks is decided once, in detail::route_with, for both.
#pragma once

#if !defined(__CUDACC__) && !defined(MRR_LANE_EMULATION)
#error "mrr/cuda/routing_kernels.cuh is device code: compile with nvcc (include mrr/cuda/fused_routing.cuh)"
#endif

#include <mrr/detail/config.hpp>
#include <mrr/kernels/router.hpp>
#include <mrr/kernels/score.hpp>
#include <mrr/thrust/routing.hpp>

#include <cfloat>
#include <climits>
#include <cstdint>
#include <type_traits>

MRR_NAMESPACE_BEGIN
namespace cuda {
namespace kernels {

inline constexpr int kFusedWarpsPerBlock = 8;
inline constexpr unsigned kFullWarp = 0xffffffffu;

// The selection's order as one unsigned 64-bit key: larger value first, the lower index among
// equal values (kernels/topk.hpp's order). High word: the value's bits mapped so that unsigned
// order is float order (-0 taken as +0 first: they compare equal, so only the index may decide);
// low word: ~index. A total order on non-NaN values (rows holding NaN are rejected before their
// keys are used), and never 0, which marks "no candidate". One key compares in one 64-bit max, and
// a warp's arg-max is one reduction of the keys.
__device__ __forceinline__ unsigned long long select_key(float v, int index) {
  const unsigned u = __float_as_uint(v + 0.0f);  // -0 + 0 = +0
  const unsigned ordered = (u & 0x80000000u) != 0u ? ~u : (u | 0x80000000u);
  return (static_cast<unsigned long long>(ordered) << 32) | static_cast<unsigned>(~index);
}
__device__ __forceinline__ int expert_of_key(unsigned long long key) {
  return static_cast<int>(~static_cast<unsigned>(key & 0xffffffffull));
}
__device__ __forceinline__ float value_of_key(unsigned long long key) {  // -0 comes back as +0
  const auto ordered = static_cast<unsigned>(key >> 32);
  return __uint_as_float((ordered & 0x80000000u) != 0u ? (ordered & 0x7fffffffu) : ~ordered);
}

// A lane's N keys in descending order: a bitonic network (N a power of two), unrolled so the keys
// stay in registers.
template <int N>
__device__ __forceinline__ void sort_descending(unsigned long long (&v)[N]) {
#pragma unroll
  for (int size = 2; size <= N; size <<= 1)
#pragma unroll
    for (int stride = size >> 1; stride > 0; stride >>= 1)
#pragma unroll
      for (int i = 0; i < N; ++i) {
        const int j = i ^ stride;
        if (j > i && j < N) {  // j < N always (N a power of two); said for the host compiler's bounds check
          const unsigned long long a = v[i], b = v[j];
          const bool swap = (i & size) == 0 ? a < b : a > b;  // the last merge (size == N) is descending
          v[i] = swap ? b : a;
          v[j] = swap ? a : b;
        }
      }
}

// The largest key of the warp, in every lane: the high words' max, then among the lanes holding it
// the largest low word (sm_80+: two hardware reductions; earlier GPUs: a butterfly of shuffles).
__device__ __forceinline__ unsigned long long warp_max_key(unsigned long long key) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const auto hi = static_cast<unsigned>(key >> 32), lo = static_cast<unsigned>(key);
  const unsigned top = __reduce_max_sync(0xffffffffu, hi);
  const unsigned low = __reduce_max_sync(0xffffffffu, hi == top ? lo : 0u);
  return (static_cast<unsigned long long>(top) << 32) | low;
#else
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const unsigned long long other = __shfl_xor_sync(0xffffffffu, key, off);
    key = other > key ? other : key;
  }
  return key;
#endif
}

__device__ __forceinline__ int warp_sum(int x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1)
    x += __shfl_xor_sync(kFullWarp, x, off);
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1)
    x += __shfl_xor_sync(kFullWarp, x, off);
  return x;
}
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1)
    x = fmaxf(x, __shfl_xor_sync(kFullWarp, x, off));
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
  float zr[PerLane];
  unsigned long long key[PerLane];  // the selection's keys (select_key); 0: no candidate
  int bad = 0, finite = 0;
#pragma unroll
  for (int i = 0; i < PerLane; ++i) {
    const int e = lane + 32 * i;
    const bool in_row = e < n;
    const float x = in_row && load_row ? load(z[e]) : 0.f;
    zr[i] = x;
    bad |= in_row && !(x <= FLT_MAX) ? 1 : 0;   // NaN or +inf
    finite += in_row && x >= -FLT_MAX ? 1 : 0;  // not -inf, not NaN
    float v = x;
    if (!p.selects_on_logits && in_row && !replay_row) {  // selection scores: native rows only
      if (p.score != 0) v = rk::score_of(p.score, v);
      if (p.has_bias) v += bias[e];
    }
    key[i] = in_row ? select_key(v, e) : 0ull;  // a NaN row is rejected before its keys are used
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

  if (!replay_row && p.grouped) {
    // Group-limited selection (kernels::select_on_scores): experts_per_group is a
    // multiple of 32, so group g is registers [g R, (g + 1) R) of every lane. A group scores the
    // sum of its best group_score_topk (1 or 2) selection scores, found as keys (the values of the
    // CPU's running maxima, summed larger first); lane g keeps group g's score; the best group_topk
    // groups (ties: lower group) stay, the other groups' experts leave the candidates.
    const int per_group = p.experts_per_group / 32, groups = p.num_groups;
    unsigned long long first = 0ull, second = 0ull, group_key = 0ull;
#pragma unroll
    for (int i = 0; i < PerLane; ++i) {
      if (i >= groups * per_group) break;  // warp-uniform
      const unsigned long long x = key[i];
      second = x > first ? first : (x > second ? x : second);
      first = x > first ? x : first;
      if (i % per_group == per_group - 1) {  // the group's last register
        const unsigned long long top = warp_max_key(first);
        float sum = value_of_key(top);
        if (p.group_score_topk == 2) sum += value_of_key(warp_max_key(first == top ? second : first));
        const int g = i / per_group;
        if (lane == g) group_key = select_key(sum, g);
        first = second = 0ull;
      }
    }
    unsigned kept = 0u;
    for (int r = 0; r < p.group_topk; ++r) {
      const unsigned long long best = warp_max_key(group_key);
      kept |= 1u << expert_of_key(best);
      group_key = group_key == best ? 0ull : group_key;
    }
    // -inf masking: the other groups' experts are no candidates. 0.0 masking (HF DeepSeek-V3's
    // masked_fill): they compete with score 0, ties to the lower index, as the CPU's candidates.
#pragma unroll
    for (int i = 0; i < PerLane; ++i)
      if (i < groups * per_group && !((kept >> (i / per_group)) & 1u))
        key[i] = p.zero_masking ? select_key(0.0f, lane + 32 * i) : 0ull;
  }

  if (!replay_row) {
    // Each lane sorts its keys once (best first); a round is then one warp arg-max of the lanes'
    // heads, and the winning lane (keys are unique: the index is part of one) moves its list up.
    sort_descending(key);
    for (int j = 0; j < k; ++j) {
      const unsigned long long best = warp_max_key(key[0]);
      const bool pop = key[0] == best;
#pragma unroll
      for (int i = 0; i + 1 < PerLane; ++i)
        key[i] = pop ? key[i + 1] : key[i];
      key[PerLane - 1] = pop ? 0ull : key[PerLane - 1];
      if (lane == j) my_id = expert_of_key(best);
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

// Replay of every row (no mask) where the weights read only the k chosen logits: a segment of W
// lanes per token (W = k rounded up to a power of two, 32 / W tokens per warp), so a warp serves
// several tokens and a block keeps more of them in flight (replay is latency-bound: two dependent
// reads per token). The checks, codes and weights are the warp-per-token kernel's, bit for bit:
// its reductions over 32 lanes add the idle lanes' zeros (or take their -inf) first, which are
// exact, then run the same butterfly over the k lanes as these segment reductions do.
template <int W>
__device__ __forceinline__ float segment_max(float x) {
#pragma unroll
  for (int off = W / 2; off > 0; off >>= 1)
    x = fmaxf(x, __shfl_xor_sync(kFullWarp, x, off));
  return x;
}
template <int W>
__device__ __forceinline__ float segment_sum(float x) {
#pragma unroll
  for (int off = W / 2; off > 0; off >>= 1)
    x += __shfl_xor_sync(kFullWarp, x, off);
  return x;
}

// The weight of a segment's slot lane from its chosen logit zj (lanes with active false hold no
// slot): DESIGN.md section 3 over the k chosen logits, every lane of the warp taking part.
template <int W>
__device__ __forceinline__ float segment_weight(const device::RouterParams& p, bool active, float zj) {
  float w;
  if (p.score == 0) {
    const float mx = segment_max<W>(active ? zj : -INFINITY);
    const float e = active ? expf(zj - mx) : 0.f;
    w = e / segment_sum<W>(e);
  } else {
    w = active ? mrr::kernels::score_of(p.score, zj) : 0.f;
    const float sum = segment_sum<W>(w);
    if (p.normalize) w /= sum + 1e-20f;
  }
  if (p.has_scale) w *= static_cast<float>(p.scale);
  return w;
}

template <int W, class In>
__global__ void __launch_bounds__(32 * kFusedWarpsPerBlock)
    fused_replay_segments(device::RouterParams p, const In* __restrict__ logits,
                          const std::int32_t* __restrict__ replay_ids, long tokens, std::int32_t* __restrict__ ids,
                          float* __restrict__ weights, std::uint8_t* __restrict__ status) {
  namespace rk = mrr::kernels;
  const int lane = threadIdx.x & 31, seg = lane / W, j = lane % W;
  const long t = ((static_cast<long>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5) * (32 / W) + seg;
  const int n = p.num_experts, k = p.topk;
  const bool active = j < k && t < tokens;
  const auto load = [](In x) { return device::kernels::widen<float>(x); };
  const std::int32_t id = active ? replay_ids[t * k + j] : -1;
  // The logit is read as soon as its id is known to be in range, while the row's checks run (a
  // row with a bad id discards it).
  const bool in_range = active && id >= 0 && id < n;
  const float z_read = in_range ? load(logits[t * n + id]) : -INFINITY;
  // Repeats within this token: match on (segment, id); idle lanes match nobody.
  const unsigned long long tag = active ? (static_cast<unsigned long long>(seg) << 32) | static_cast<unsigned>(id)
                                        : (0xffffull << 32) | static_cast<unsigned>(lane);
  const unsigned same = __match_any_sync(kFullWarp, tag);
  const unsigned mine = (W == 32 ? kFullWarp : ((1u << W) - 1u)) << (seg * W);
  const bool bad_id = active && (id < 0 || id >= n || __popc(same) > 1);
  const bool bad_row_id = (__ballot_sync(kFullWarp, bad_id) & mine) != 0u;
  const float zj = active && !bad_row_id ? z_read : -INFINITY;
  // Every lane takes part in each ballot (a full-mask vote behind a short circuit would miss the
  // lanes of segments that skipped it).
  const unsigned bad_logits = __ballot_sync(kFullWarp, active && !(zj <= FLT_MAX));
  const bool bad_row_logit = !bad_row_id && (bad_logits & mine) != 0u;
  const float w = segment_weight<W>(p, active, zj);
  const bool nan_weight = (__ballot_sync(kFullWarp, active && !(w == w)) & mine) != 0u;
  const bool bad = bad_row_id || bad_row_logit;
  if (active) {
    ids[t * k + j] = bad ? -1 : id;
    weights[t * k + j] = bad ? __int_as_float(0x7fc00000) : w;
  }
  if (status != nullptr && j == 0 && t < tokens)
    status[t] = bad_row_id      ? rk::row_invalid_replay
                : bad_row_logit ? rk::row_invalid_logit
                : nan_weight    ? rk::row_nan_weight
                                : rk::row_ok;
}

// ---------------------------------------------------------------------------------------------
// Native routing, k <= 8 and E a multiple of 32 up to 256: a segment of 8 lanes per token (4 tokens
// a warp), the warp-per-token kernel's result, bit for bit, with far fewer instructions (that kernel
// spends ~75 per logit sorting and popping 64-bit keys: compute-bound, 110 µs for 65,536 x 256 on
// an H100; this one issues 191 warp instructions a token and takes 30 µs; bench/RESULTS.md).
// - Lane j of a segment holds experts 32 q + 4 j + r (r < 4): one 16-byte load per q, and a
//   segment reads 128 contiguous bytes per load.
// - Threshold: tau, the k-th largest of the segment's 16 lane top-2 scores, is at most the row's
//   k-th largest selection score (k of those values are distinct experts >= tau), so every expert
//   of the top k scores >= tau. Those candidates (about 9 for k = 8 on normal logits) are found by
//   a bit per register, listed as packed keys (select_key: larger value, then lower index) in
//   shared memory, and ranked against each other: rank < k is the slot. Lists of more than 48
//   (ties, masks) take k rounds of a segment arg-max over the staged scores instead, the same keys
//   and order.
// - Group limits (groups of whole multiples of 32 experts, at most 8 groups): register q is group
//   q / (experts_per_group / 32); each group's top-2 scores merge over the segment, lane g ranks
//   group g, and the other groups' experts become -inf or 0.0 as in the warp kernel.
// - Checks as the warp kernel's: a NaN-propagating maximum finds NaN / +inf logits; rows that may
//   have fewer than k finite logits (tau = -inf, or a -inf logit when selecting on scores) count
//   them. Weights as the replay segments: the same reductions over the k slot lanes.
inline constexpr int kSegmentWarpsPerBlock = 4;

__device__ __forceinline__ float max_nan(float a, float b) {  // NaN if either is NaN
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return (a != a || b != b) ? __int_as_float(0x7fc00000) : fmaxf(a, b);
#endif
}

// 1 / d, correctly rounded, for normal d below 2^126 (exponent field 1 to 252): an approximate
// reciprocal refined by one fused Newton step, the sequence nvcc's IEEE division runs in that range
// before its branch to the general case, so the same bits as 1.0f / d there (the CUDA tests compare
// the segment kernel's sigmoid selections and weights with the warp kernel's, which divides).
__device__ __forceinline__ float reciprocal_in_range(float d) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(d));
  const float err = __fmaf_rn(d, r, -1.0f);
  return __fmaf_rn(r, -err, r);
#else  // the lane emulator: the division itself (the same bits in this range)
  return 1.0f / d;
#endif
}

// Four consecutive logits widened to float (bf16: its bits are a float's upper half).
__device__ __forceinline__ void load4(const float* p, float* x) {
  const float4 v = *reinterpret_cast<const float4*>(p);
  x[0] = v.x;
  x[1] = v.y;
  x[2] = v.z;
  x[3] = v.w;
}
__device__ __forceinline__ void load4(const bf16* p, float* x) {
  const uint2 v = *reinterpret_cast<const uint2*>(p);
  x[0] = __uint_as_float(v.x << 16);
  x[1] = __uint_as_float(v.x & 0xffff0000u);
  x[2] = __uint_as_float(v.y << 16);
  x[3] = __uint_as_float(v.y & 0xffff0000u);
}

// Simple: selection on the logits themselves, no groups, E = 32 Q (the launcher's choice): the
// paths it never takes are compiled out, which frees registers for more warps in flight.
template <int Q, bool Simple, class In>
__global__ void __launch_bounds__(32 * kSegmentWarpsPerBlock)
    fused_route_segments(device::RouterParams p, const In* __restrict__ logits, const float* __restrict__ bias,
                         long tokens, std::int32_t* __restrict__ ids, float* __restrict__ weights,
                         std::uint8_t* __restrict__ status) {
  namespace rk = mrr::kernels;
  constexpr int kLane = 4 * Q;                           // values a lane holds
  constexpr int kSegs = 4 * kSegmentWarpsPerBlock;       // tokens a block
  constexpr int kList = 48;                              // candidates ranked in shared memory
  __shared__ unsigned long long list[kSegs][kList + 2];  // (+2: the lists start in different banks)
  __shared__ unsigned long long slot[kSegs][8];          // the chosen keys, by rank
  __shared__ __align__(16) float stage[kSegs][32 * Q];   // the scores, where a candidate's bit finds its own
  const int lane = threadIdx.x & 31, j = lane & 7, seg = threadIdx.x >> 3, first_lane = lane & ~7;
  const unsigned seg_mask = 0xffu << first_lane;
  const long t = static_cast<long>(blockIdx.x) * kSegs + seg;
  const bool live = t < tokens;  // not an early return: the shuffles below are full-warp
  const int n = Simple ? 32 * Q : p.num_experts, k = p.topk, nq = n / 32;
  const In* z = logits + (live ? t : 0) * static_cast<long>(n);

  float v[kLane];
#pragma unroll
  for (int q = 0; q < Q; ++q) {
    if (q < nq && live) {
      load4(z + 32 * q + 4 * j, v + 4 * q);
    } else {
#pragma unroll
      for (int r = 0; r < 4; ++r)
        v[4 * q + r] = 0.f;
    }
  }
  // Selecting on scores (or masking groups): NaN / +inf logits and -inf ones, before the logits
  // become scores. Selecting on logits, the lanes' maxima below do both.
  const bool scored = !Simple && !p.selects_on_logits && (p.score != 0 || p.has_bias);
  const bool grouped = !Simple && p.grouped;
  const bool logits_are_scores = !scored && !grouped;
  float xmax = -INFINITY, xmin = INFINITY;
  if (!logits_are_scores) {
#pragma unroll
    for (int q = 0; q < Q; ++q)
      if (q < nq)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          xmax = max_nan(xmax, v[4 * q + r]);
          xmin = fminf(xmin, v[4 * q + r]);
        }
  }
  if (scored) {  // selection scores replace the logits (chosen logits are read again for weights)
    if (p.score == rk::score_sigmoid) {
      // kernels::sigmoid's 1 / (1 + exp(-x)) with the lane's 32 values side by side: the
      // reciprocal's branch-free range (reciprocal_in_range) for all, division only where a
      // denominator left it (x below about -87, or NaN), so the exps and reciprocals interleave.
      bool outside = false;
#pragma unroll
      for (int i = 0; i < kLane; ++i) {
        v[i] = 1.0f + expf(-v[i]);
        outside |= !(v[i] < 0x1p126f);
      }
      if (outside) {
#pragma unroll
        for (int i = 0; i < kLane; ++i)
          v[i] = v[i] < 0x1p126f ? reciprocal_in_range(v[i]) : 1.0f / v[i];
      } else {
#pragma unroll
        for (int i = 0; i < kLane; ++i)
          v[i] = reciprocal_in_range(v[i]);
      }
    } else if (p.score != rk::score_softmax) {
#pragma unroll
      for (int i = 0; i < kLane; ++i)
        v[i] = rk::score_of(p.score, v[i]);
    }
    if (p.has_bias) {
#pragma unroll
      for (int q = 0; q < Q; ++q) {
        if (q >= nq) continue;
        float b[4];
        load4(bias + 32 * q + 4 * j, b);
#pragma unroll
        for (int r = 0; r < 4; ++r)
          v[4 * q + r] += b[r];
      }
    }
  }

  if (grouped) {
    // Group g is registers [g per, (g + 1) per) of every lane: its top-2 scores over the segment
    // (a multiset: equal values count twice), summed larger first, as the warp kernel's keys.
    const int per = p.experts_per_group / 32, groups = p.num_groups;
    float first = -INFINITY, second = -INFINITY, my_group = -INFINITY;  // lane g: group g's score
#pragma unroll
    for (int q = 0; q < Q; ++q) {
      if (q >= nq) break;
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const float y = v[4 * q + r];
        second = fmaxf(second, fminf(first, y));
        first = fmaxf(first, y);
      }
      if (q % per == per - 1) {  // uniform: the group's last register
#pragma unroll
        for (int off = 4; off > 0; off >>= 1) {
          const float f = __shfl_xor_sync(kFullWarp, first, off), s = __shfl_xor_sync(kFullWarp, second, off);
          second = fmaxf(fminf(first, f), fmaxf(second, s));
          first = fmaxf(first, f);
        }
        const float sum = p.group_score_topk == 2 ? first + second : first;
        if (j == q / per) my_group = sum;
        first = second = -INFINITY;
      }
    }
    // Lane g ranks group g (larger score first, lower group among equal ones).
    int rank = 0;
#pragma unroll
    for (int h = 0; h < 8; ++h) {
      const float other = __shfl_sync(kFullWarp, my_group, first_lane | h);
      rank += h < groups && (other > my_group || (other == my_group && h < j)) ? 1 : 0;
    }
    const unsigned kept = (__ballot_sync(kFullWarp, j < groups && rank < p.group_topk) >> first_lane) & 0xffu;
    const float masked = p.zero_masking ? 0.0f : -INFINITY;
#pragma unroll
    for (int q = 0; q < Q; ++q)
      if (q < nq && ((kept >> (q / per)) & 1u) == 0u)
#pragma unroll
        for (int r = 0; r < 4; ++r)
          v[4 * q + r] = masked;
  }

  // Each lane's top 2 selection scores (a multiset); selecting on logits, the maximum propagates
  // NaN, so it is the NaN / +inf check as well.
  float first = -INFINITY, second = -INFINITY;
#pragma unroll
  for (int q = 0; q < Q; ++q)
    if (q < nq)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const float y = v[4 * q + r];
        second = fmaxf(second, fminf(first, y));
        first = logits_are_scores ? max_nan(first, y) : fmaxf(first, y);
      }
  if (logits_are_scores) xmax = first;
  // tau: the k-th largest of the segment's 16 top-2 values (a bitonic sort, value 2 j + s in lane j,
  // register s; descending), at most the row's k-th largest score: about k candidates on real
  // logits (the lanes' maxima alone let through 2.6 k).
  float a0 = first, a1 = second;
#pragma unroll
  for (int size = 2; size <= 16; size <<= 1)
#pragma unroll
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      const bool descending = ((2 * j) & size) == 0;
      if (stride == 1) {
        const float hi = fmaxf(a0, a1), lo = fminf(a0, a1);
        a0 = descending ? hi : lo;
        a1 = descending ? lo : hi;
      } else {
        const float b0 = __shfl_xor_sync(kFullWarp, a0, stride >> 1), b1 = __shfl_xor_sync(kFullWarp, a1, stride >> 1);
        const bool keep_max = ((j & (stride >> 1)) == 0) == descending;
        a0 = keep_max ? fmaxf(a0, b0) : fminf(a0, b0);
        a1 = keep_max ? fmaxf(a1, b1) : fminf(a1, b1);
      }
    }
  const float tau = __shfl_sync(kFullWarp, ((k - 1) & 1) == 0 ? a0 : a1, first_lane | ((k - 1) >> 1));

  // The row's checks, in kernels::route_row's order; the code is segment-uniform.
  const bool bad = (__ballot_sync(kFullWarp, !(xmax <= FLT_MAX)) & seg_mask) != 0u;
  const bool maybe_few =
      logits_are_scores ? !(tau >= -FLT_MAX) : (__ballot_sync(kFullWarp, !(xmin >= -FLT_MAX)) & seg_mask) != 0u;
  bool few = false;
  if (__any_sync(kFullWarp, live && !bad && maybe_few)) {  // rare: count the finite logits
    int finite = 0;
#pragma unroll
    for (int q = 0; q < Q; ++q) {
      if (q >= nq || !live) continue;
      float x[4];
      load4(z + 32 * q + 4 * j, x);
#pragma unroll
      for (int r = 0; r < 4; ++r)
        finite += x[r] >= -FLT_MAX ? 1 : 0;
    }
#pragma unroll
    for (int off = 4; off > 0; off >>= 1)
      finite += __shfl_xor_sync(kFullWarp, finite, off);
    few = finite < k;
  }
  const std::uint8_t code = bad ? rk::row_invalid_logit : few ? rk::row_too_few_finite : rk::row_ok;

  // The candidates (score >= tau): a bit per register, then listed as keys after an exclusive scan
  // of the lanes' counts (the scores staged in shared memory, where a bit's index can reach them).
  unsigned candidates = 0u;
#pragma unroll
  for (int q = 0; q < Q; ++q)
    if (q < nq)
#pragma unroll
      for (int r = 0; r < 4; ++r)
        candidates |= v[4 * q + r] >= tau ? 1u << (4 * q + r) : 0u;
  if (!live || code != rk::row_ok) candidates = 0u;
  const int count = __popc(candidates);
  int inclusive = count;
#pragma unroll
  for (int off = 1; off < 8; off <<= 1) {
    const int other = __shfl_up_sync(kFullWarp, inclusive, off, 8);
    inclusive += j >= off ? other : 0;
  }
  const int total = __shfl_sync(kFullWarp, inclusive, first_lane | 7);
  float* const staged = stage[seg];  // [Q][8 lanes][4]: a lane's 16 bytes side by side
#pragma unroll
  for (int q = 0; q < Q; ++q)
    if (q < nq)
      *reinterpret_cast<float4*>(staged + (8 * q + j) * 4) =
          make_float4(v[4 * q], v[4 * q + 1], v[4 * q + 2], v[4 * q + 3]);
  if (__any_sync(kFullWarp, total > kList)) {
    // Long lists (ties, masked experts): k rounds of a segment arg-max, each lane scanning its
    // staged scores for its best key below the last one taken.
    unsigned long long last = ~0ull;
    for (int round = 0; round < k; ++round) {
      unsigned long long head = 0ull;
      for (int i = 0; i < 4 * nq && live; ++i) {
        const int q = i >> 2, r = i & 3;
        const unsigned long long key = select_key(staged[(8 * q + j) * 4 + r], 32 * q + 4 * j + r);
        head = key < last && key > head ? key : head;
      }
#pragma unroll
      for (int off = 4; off > 0; off >>= 1) {
        const unsigned long long other = __shfl_xor_sync(kFullWarp, head, off);
        head = other > head ? other : head;
      }
      if (j == 0) slot[seg][round] = head;
      last = head;
    }
  } else {
    int at = inclusive - count;
    for (unsigned m = candidates; m != 0u; m &= m - 1u) {
      const int bit = __ffs(static_cast<int>(m)) - 1, q = bit >> 2, r = bit & 3;
      list[seg][at++] = select_key(staged[(8 * q + j) * 4 + r], 32 * q + 4 * j + r);
    }
    __syncwarp();
    // Rank each candidate among the list (keys are distinct: the index is part of one).
    for (int c = j; c < total; c += 8) {
      const unsigned long long key = list[seg][c];
      int rank = 0;
      for (int d = 0; d < total; ++d)
        rank += list[seg][d] > key ? 1 : 0;
      if (rank < k) slot[seg][rank] = key;
    }
  }
  __syncwarp();

  const bool active = live && j < k;
  std::int32_t my_id = -1;
  float zj = 0.f;
  if (active && code == rk::row_ok) {
    const unsigned long long key = slot[seg][j];
    my_id = expert_of_key(key);
    zj = scored || p.score != 0 ? device::kernels::widen<float>(z[my_id]) : value_of_key(key);
  }
  const float w = segment_weight<8>(p, active, zj);
  const bool nan_weight = (__ballot_sync(kFullWarp, active && !(w == w)) & seg_mask) != 0u;
  if (active) {
    ids[t * k + j] = code == rk::row_ok ? my_id : -1;
    weights[t * k + j] = code == rk::row_ok ? w : __int_as_float(0x7fc00000);
  }
  if (status != nullptr && live && j == 0)
    status[t] = code != rk::row_ok ? code : static_cast<std::uint8_t>(nan_weight ? rk::row_nan_weight : rk::row_ok);
}

}  // namespace kernels

// Whether the fused kernel handles this router: no capacity dropping (a pass over the whole batch,
// device::TopKRouter's); 1 <= k <= E <= 1024, k <= 32; no expert bias on softmax (RouterConfig
// rejects it; its pre-softmax selection is not here). Group limits (DeepSeek-V3's, -inf or 0.0
// masking) when a group is a multiple of 32 experts, at most 32 groups, groups score their top 1
// or 2, and the selection is not on pre-softmax probabilities (their sum over E would round
// otherwise than the CPU's).
inline bool fused_routing_supports(const device::RouterParams& p) {
  const bool groups_ok =
      !p.grouped || (p.experts_per_group % 32 == 0 && p.num_groups >= 1 && p.num_groups <= 32 && p.group_topk >= 1 &&
                     p.group_topk <= p.num_groups && (p.group_score_topk == 1 || p.group_score_topk == 2) &&
                     !(p.score == 0 && p.pre_softmax));
  return groups_ok && !p.drops_over_capacity && p.num_experts >= 1 && p.num_experts <= 1024 && p.topk >= 1 &&
         p.topk <= 32 && p.topk <= p.num_experts && !(p.score == 0 && p.has_bias);
}

namespace detail {

// The segment-per-token native routing kernel applies (kernels::fused_route_segments): no replay,
// weights over the k chosen logits, k <= 8, E a multiple of 32 up to 256, groups of multiples of
// 32 experts (at most 8), and 16-byte aligned rows (8-byte for bf16) and bias.
template <class In>
bool fused_segments_apply(const device::RouterParams& p, const In* logits, const float* bias) {
  const auto aligned = [](const void* ptr, std::uintptr_t to) {
    return reinterpret_cast<std::uintptr_t>(ptr) % to == 0;
  };
  return !p.replay_reads_whole_row() && p.topk <= 8 && p.num_experts % 32 == 0 && p.num_experts <= 256 &&
         (!p.grouped || (p.experts_per_group % 32 == 0 && p.num_groups <= 8)) && aligned(logits, 4 * sizeof(In)) &&
         (!p.has_bias || aligned(bias, 16));
}

// How a launcher's call went. launched: `launch` was called once; nothing_to_launch: no rows.
enum class LaunchStatus { launched, nothing_to_launch, invalid_value, too_many_blocks };

// The launchers below pick the kernel instance and the grid and hand them to `launch`:
// launch(kernel, blocks, threads_per_block, args...) starts `kernel` (fused_routing.cuh: on a
// stream; the lane emulator: on the host).
template <class In, class Launch>
LaunchStatus route_segments_with(Launch&& launch, const device::RouterParams& p, const In* logits, const float* bias,
                                 long tokens, std::int32_t* ids, float* weights, std::uint8_t* status) {
  constexpr long per_block = 4L * kernels::kSegmentWarpsPerBlock;
  const long blocks = (tokens + per_block - 1) / per_block;
  if (blocks > INT_MAX) return LaunchStatus::too_many_blocks;  // gridDim.x < 2^31
  const auto grid = static_cast<unsigned>(blocks);
  constexpr unsigned block = 32 * kernels::kSegmentWarpsPerBlock;
  const int quads = p.num_experts / 32;
  const bool simple = !p.grouped && (p.selects_on_logits || (p.score == 0 && !p.has_bias)) &&
                      quads * 32 == p.num_experts && (quads == 1 || quads == 2 || quads == 4 || quads == 8);
  const auto go = [&](auto q) {
    constexpr int Q = decltype(q)::value;
    if (simple)
      launch(&kernels::fused_route_segments<Q, true, In>, grid, block, p, logits, bias, tokens, ids, weights, status);
    else
      launch(&kernels::fused_route_segments<Q, false, In>, grid, block, p, logits, bias, tokens, ids, weights, status);
  };
  if (quads <= 1)
    go(std::integral_constant<int, 1>{});
  else if (quads <= 2)
    go(std::integral_constant<int, 2>{});
  else if (quads <= 4)
    go(std::integral_constant<int, 4>{});
  else
    go(std::integral_constant<int, 8>{});
  return LaunchStatus::launched;
}

// The warp-per-token kernel (every supported router; replay), or its replay segments.
template <class In, class Launch>
LaunchStatus route_warps_with(Launch&& launch, const device::RouterParams& p, const In* logits, const float* bias,
                              const std::int32_t* replay_ids, const std::uint8_t* replay_mask, long tokens,
                              std::int32_t* ids, float* weights, std::uint8_t* status) {
  constexpr int kWarps = kernels::kFusedWarpsPerBlock;
  constexpr unsigned block = 32 * kWarps;
  if (replay_ids != nullptr && replay_mask == nullptr && !p.replay_reads_whole_row() && p.topk <= 16) {
    const int width = p.topk <= 1 ? 1 : p.topk <= 2 ? 2 : p.topk <= 4 ? 4 : p.topk <= 8 ? 8 : 16;
    const long per_block = static_cast<long>(kWarps) * (32 / width);
    const long replay_blocks = (tokens + per_block - 1) / per_block;
    if (replay_blocks > INT_MAX) return LaunchStatus::too_many_blocks;
    const auto grid = static_cast<unsigned>(replay_blocks);
    const auto go = [&](auto w) {
      launch(&kernels::fused_replay_segments<decltype(w)::value, In>, grid, block, p, logits, replay_ids, tokens, ids,
             weights, status);
    };
    switch (width) {
      case 1:
        go(std::integral_constant<int, 1>{});
        break;
      case 2:
        go(std::integral_constant<int, 2>{});
        break;
      case 4:
        go(std::integral_constant<int, 4>{});
        break;
      case 8:
        go(std::integral_constant<int, 8>{});
        break;
      default:
        go(std::integral_constant<int, 16>{});
        break;
    }
    return LaunchStatus::launched;
  }
  const long blocks = (tokens + kWarps - 1) / kWarps;
  if (blocks > INT_MAX) return LaunchStatus::too_many_blocks;
  const auto grid = static_cast<unsigned>(blocks);
  const int per_lane = (p.num_experts + 31) / 32;
  const auto go = [&](auto n) {
    launch(&kernels::fused_route_replay<decltype(n)::value, In>, grid, block, p, logits, bias, replay_ids, replay_mask,
           tokens, ids, weights, status);
  };
  if (per_lane <= 1)
    go(std::integral_constant<int, 1>{});
  else if (per_lane <= 2)
    go(std::integral_constant<int, 2>{});
  else if (per_lane <= 4)
    go(std::integral_constant<int, 4>{});
  else if (per_lane <= 8)
    go(std::integral_constant<int, 8>{});
  else if (per_lane <= 16)
    go(std::integral_constant<int, 16>{});
  else
    go(std::integral_constant<int, 32>{});
  return LaunchStatus::launched;
}

// cuda::fused_route_replay's checks and choice of kernel.
template <class In, class Launch>
LaunchStatus route_with(Launch&& launch, const device::RouterParams& p, const In* logits, const float* bias,
                        const std::int32_t* replay_ids, const std::uint8_t* replay_mask, long tokens, std::int32_t* ids,
                        float* weights, std::uint8_t* status) {
  static_assert(std::is_same_v<In, float> || std::is_same_v<In, bf16>,
                "fused_route_replay: logits are float or mrr::bf16");
  if (!fused_routing_supports(p) || tokens < 0) return LaunchStatus::invalid_value;
  if (tokens == 0) return LaunchStatus::nothing_to_launch;
  if (logits == nullptr || ids == nullptr || weights == nullptr || (p.has_bias && bias == nullptr))
    return LaunchStatus::invalid_value;
  if (replay_ids == nullptr && fused_segments_apply(p, logits, bias))
    return route_segments_with(launch, p, logits, bias, tokens, ids, weights, status);
  return route_warps_with(launch, p, logits, bias, replay_ids, replay_mask, tokens, ids, weights, status);
}

}  // namespace detail
}  // namespace cuda
MRR_NAMESPACE_END
