// mrr-requires: mrr_thrust_omp
// PPO / GRPO utilities on a Thrust system, same verl semantics as ppo/advantage.hpp, masked.hpp and
// kl.hpp: an executor of the kernels in kernels/ppo/ (the math is written there once). GAE on a GPU
// runs by chunks of time: each chunk's effect on the carried values is an affine map, the maps are
// chained along the row, then each chunk reruns its steps (GaeAlgorithm::blocks, a thread block per
// row; chunks, the same in five launches; scan, two segmented reverse scans of the per-token maps),
// so time is parallel too (results equal the sequential recurrence up to floating-point
// reassociation); on CPU threads (the OpenMP system) as kernels::ppo::gae_row over blocks of rows. Tensors are
// row-major [rows, cols] Thrust vectors; sums behind means run in double (Thrust's reductions combine the kernels'
// element terms).
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/detail/kernel_launch.hpp>
#include <mrr/error.hpp>
#include <mrr/kernels/ppo/advantage.hpp>
#include <mrr/kernels/ppo/kl.hpp>
#include <mrr/kernels/ppo/masked.hpp>
#include <mrr/thrust/backend.hpp>
#include <mrr/thrust/execution.hpp>

#include <thrust/for_each.h>
#include <thrust/functional.h>
#include <thrust/host_vector.h>
#include <thrust/iterator/constant_iterator.h>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/iterator/transform_iterator.h>
#include <thrust/pair.h>
#include <thrust/reduce.h>
#include <thrust/scan.h>
#include <thrust/sequence.h>
#include <thrust/sort.h>
#include <thrust/transform_reduce.h>

#include <cstdint>
#include <stdexcept>
#include <type_traits>

MRR_NAMESPACE_BEGIN
namespace device {

using mrr::kernels::ppo::kMaskCountEpsilon;       // verl masked_mean: sum / (count + 1e-8)
using mrr::kernels::ppo::kWhitenVarianceEpsilon;  // verl masked_whiten: rsqrt(var + 1e-8)

template <class T, class Backend = ThrustDeviceBackend>
struct AdvantageResult {
  typename Backend::template vector<T> advantages, returns;
};

// DeviceStatus codes of the GAE view: the mask selects no element, or one (whitening undefined);
// an input the host functions refuse (index: the lowest such element, row-major): a mask value
// other than 0 / 1, a non-finite reward, a non-finite value.
inline constexpr std::int32_t status_mask_selects_none = 2;
inline constexpr std::int32_t status_mask_selects_one = 3;
inline constexpr std::int32_t status_mask_not_binary = 5;
inline constexpr std::int32_t status_reward_not_finite = 6;
inline constexpr std::int32_t status_value_not_finite = 7;

namespace kernels {

namespace ppo_kernels = mrr::kernels::ppo;

template <class T>
struct ComposeAffine {
  MRR_HOST_DEVICE ppo_kernels::Affine<T> operator()(const ppo_kernels::Affine<T>& first,
                                                    const ppo_kernels::Affine<T>& then) const {
    return ppo_kernels::compose(first, then);
  }
};

// Scan position j walks the flat [rows, cols] array backwards: element n - 1 - j.
struct ReverseRowKey {
  long n, cols;
  MRR_HOST_DEVICE long operator()(long j) const { return (n - 1 - j) / cols; }
};

template <class T>
struct NextValueStep {
  const T *values, *mask;
  long n;
  MRR_HOST_DEVICE ppo_kernels::Affine<T> operator()(long j) const {
    const long i = n - 1 - j;
    return ppo_kernels::gae_next_value_map(values[i], mask[i], T(1));
  }
};

// next_value_{t+1} is the previous scan position's result (0 past a row's end).
template <class T>
struct AdvantageStep {
  const T *rewards, *values, *mask;
  const ppo_kernels::Affine<T>* next_value;  // scan results of NextValueStep
  long n, cols;
  T gamma, gamma_lambda;
  MRR_HOST_DEVICE ppo_kernels::Affine<T> operator()(long j) const {
    const long i = n - 1 - j;
    const T nv = (i % cols == cols - 1) ? T(0) : next_value[j - 1].b;
    return ppo_kernels::gae_advantage_map(rewards[i], values[i], mask[i], nv, T(1), gamma, gamma_lambda);
  }
};

template <class T>
struct WriteAdvantage {
  const ppo_kernels::Affine<T>* scanned;
  const T* values;
  T *advantages, *returns;
  long n;
  MRR_HOST_DEVICE void operator()(long j) const {
    const long i = n - 1 - j;
    advantages[i] = scanned[j].b;
    returns[i] = scanned[j].b + values[i];
  }
};

// GAE runs kGaeRows rows per work item on CPU threads (kernels::GaeRowsView, below): the sequential
// recurrence (kernels::ppo::gae_row), one row after the other (rows of a power-of-two length sit at the same cache set:
// interleaving them thrashes L1), then the block's masked moments of the advantages for the whitening statistics. The
// OpenMP system's algorithm: rows are spread over threads, time stays sequential.
inline constexpr int kGaeRows = 8;

// Item i of f run as item i * stride of a `stride` times longer range (the others do nothing).
// Thrust's CUDA for_each gives n items about n / 512 blocks; work items that are few and long
// (serial chains, latency-bound loads) then sit on a handful of SMs and queue on their load units.
// Spread out, they reach `stride` times as many SMs. CPU threads need no spreading (stride 1).
template <class F>
struct Spread {
  F f;
  long stride;
  MRR_HOST_DEVICE void operator()(long i) const {
    if (i % stride == 0) f(i / stride);
  }
};

// ---- GAE on the caller's memory (the view) ----
// The five [rows, cols] matrices with their row strides, and the recurrence's constants.
template <class T>
struct GaeViews {
  const T *rewards, *values, *mask;
  T *advantages, *returns;
  long rewards_stride, values_stride, mask_stride, advantages_stride, returns_stride, rows, cols;
  T gamma, gamma_lambda;
};

// By chunks of time (kernels::ppo::gae_chunk_map, a GPU's algorithm): the chunks' maps, their
// chaining along each row into carry-ins, then each chunk's recurrence from its carry-in and its
// advantages' masked moments.
inline constexpr int kGaeChunk = 16;

MRR_HOST_DEVICE inline void chunk_bounds(long item, long chunks, long cols, long& row, long& lo, int& len) {
  row = item / chunks;
  lo = (item - row * chunks) * kGaeChunk;
  len = static_cast<int>(lo + kGaeChunk < cols ? kGaeChunk : cols - lo);
}

template <class T>
struct GaeChunkMaps {
  GaeViews<T> g;
  ppo_kernels::GaeChunkMap<T>* maps;  // [rows, chunks]
  long chunks;
  MRR_HOST_DEVICE void operator()(long item) const {
    long row, lo;
    int len;
    chunk_bounds(item, chunks, g.cols, row, lo, len);
    maps[item] =
        ppo_kernels::gae_chunk_map<kGaeChunk>(g.rewards + row * g.rewards_stride, g.values + row * g.values_stride,
                                              g.mask + row * g.mask_stride, lo, len, g.gamma, g.gamma_lambda);
  }
};

// The chunks' carry-ins, in two levels so no thread walks a whole row: superchunks of kGaeSuper
// chunks compose their maps; each row chains its superchunks (last first); each superchunk then
// chains its chunks from its own carry-in. carry[2 c], carry[2 c + 1] = (next_value, last_gae)
// received by chunk c (at its last token).
inline constexpr int kGaeSuper = 16;

template <class T>
struct GaeComposeSupers {
  const ppo_kernels::GaeChunkMap<T>* maps;  // [rows, chunks]
  ppo_kernels::GaeChunkMap<T>* supers;      // [rows, supers]
  long chunks, supers_per_row;
  MRR_HOST_DEVICE void operator()(long item) const {
    const long row = item / supers_per_row, s = item - row * supers_per_row;
    const long lo = s * kGaeSuper, hi = lo + kGaeSuper < chunks ? lo + kGaeSuper : chunks;
    supers[item] = ppo_kernels::compose_maps<kGaeSuper>(maps + row * chunks, hi - 1, static_cast<int>(hi - lo));
  }
};

template <class T>
struct GaeChainSupers {
  const ppo_kernels::GaeChunkMap<T>* supers;  // [rows, supers]
  T* super_carry;                             // [rows, supers, 2]
  long supers_per_row;
  MRR_HOST_DEVICE void operator()(long row) const {
    T next_value = 0, last_gae = 0;
    ppo_kernels::chain_maps<kGaeSuper>(supers + row * supers_per_row, super_carry + 2 * row * supers_per_row,
                                       supers_per_row - 1, supers_per_row, next_value, last_gae);
  }
};

template <class T>
struct GaeChainChunks {
  const ppo_kernels::GaeChunkMap<T>* maps;  // [rows, chunks]
  const T* super_carry;                     // [rows, supers, 2]
  T* carry;                                 // [rows, chunks, 2]
  long chunks, supers_per_row;
  MRR_HOST_DEVICE void operator()(long item) const {
    const long row = item / supers_per_row, s = item - row * supers_per_row;
    const long lo = s * kGaeSuper, hi = lo + kGaeSuper < chunks ? lo + kGaeSuper : chunks;
    T next_value = super_carry[2 * item], last_gae = super_carry[2 * item + 1];
    ppo_kernels::chain_maps<kGaeSuper>(maps + row * chunks, carry + 2 * row * chunks, hi - 1, hi - lo, next_value,
                                       last_gae);
  }
};

template <class T>
struct GaeChunkSteps {
  GaeViews<T> g;
  const T* carry;
  ppo_kernels::Moments* parts;  // [rows, chunks]: the chunk's advantages' masked moments
  long chunks;
  MRR_HOST_DEVICE void operator()(long item) const {
    long row, lo;
    int len;
    chunk_bounds(item, chunks, g.cols, row, lo, len);
    T* adv = g.advantages + row * g.advantages_stride;
    const T* mask = g.mask + row * g.mask_stride;
    parts[item] = ppo_kernels::gae_chunk<kGaeChunk>(
        g.rewards + row * g.rewards_stride, g.values + row * g.values_stride, mask, adv,
        g.returns + row * g.returns_stride, lo, len, carry[2 * item], carry[2 * item + 1], g.gamma, g.gamma_lambda);
  }
};

// By rows (CPU threads' algorithm): kGaeRows rows per item, sequential in time, and their moments.
template <class T>
struct GaeRowsView {
  GaeViews<T> g;
  ppo_kernels::Moments* parts;  // [blocks]
  MRR_HOST_DEVICE void operator()(long block) const {
    const long r0 = block * kGaeRows, r1 = r0 + kGaeRows < g.rows ? r0 + kGaeRows : g.rows;
    for (long r = r0; r < r1; ++r)
      ppo_kernels::gae_row(g.rewards + r * g.rewards_stride, g.values + r * g.values_stride, g.mask + r * g.mask_stride,
                           g.advantages + r * g.advantages_stride, g.returns + r * g.returns_stride, g.cols, g.gamma,
                           g.gamma_lambda);
    parts[block] = ppo_kernels::masked_moments(g.advantages + r0 * g.advantages_stride, g.advantages_stride,
                                               g.mask + r0 * g.mask_stride, g.mask_stride, r1 - r0, g.cols);
  }
};

// One level of the moments' merge tree: out[i] = in[i fan, (i + 1) fan) merged in order. A fixed
// tree for a given count of parts: the same bits on any executor and thread count.
inline constexpr long kMomentsFan = 8;  // short serial merges, more work items

// Item i of a level above the n parts `in`: parts [i fan, (i + 1) fan) merged in order.
// The parts are read together before the first merge, so a GPU thread waits for memory once.
MRR_HOST_DEVICE inline ppo_kernels::Moments merge_item(const ppo_kernels::Moments* in, long i, long n) {
  const long begin = i * kMomentsFan;
  const long count = begin + kMomentsFan < n ? kMomentsFan : n - begin;
  ppo_kernels::Moments part[kMomentsFan];
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (long j = 0; j < kMomentsFan; ++j)
    if (j < count) part[j] = in[begin + j];
  ppo_kernels::Moments total;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (long j = 0; j < kMomentsFan; ++j)
    if (j < count) ppo_kernels::merge(total, part[j]);
  return total;
}

struct MergeMoments {
  const ppo_kernels::Moments* in;
  ppo_kernels::Moments* out;
  long n;
  MRR_HOST_DEVICE void operator()(long i) const { out[i] = merge_item(in, i, n); }
};

// verl's whitening statistics (unbiased variance) from the merged moments, or the status when the
// mask selects no element or one.
template <class T>
struct WhiteningStats {
  const ppo_kernels::Moments* total;
  T* stats;  // mean, scale
  DeviceStatus* status;
  MRR_HOST_DEVICE void operator()(int) const {
    if (total->weight == 0) {
      status->code = status_mask_selects_none;
      return;
    }
    T mean{}, variance{};
    if (ppo_kernels::mean_and_variance<T>(*total, true, mean, variance) != ppo_kernels::Status::ok) {
      status->code = status_mask_selects_one;
      return;
    }
    stats[0] = mean;
    stats[1] = ppo_kernels::whitening_scale(variance);
  }
};

template <class T>
struct WhitenView {
  T* values;
  long stride, cols;
  const T* stats;
  const DeviceStatus* status;
  MRR_HOST_DEVICE void operator()(long i) const {
    if (status->code != status_ok) return;
    const long r = i / cols;
    T& v = values[r * stride + (i - r * cols)];
    v = ppo_kernels::whiten(v, stats[0], stats[1]);
  }
};

// The host functions' checks of token inputs (ppo/advantage.hpp), every element (masked or not):
// 0 when element i of [rows, cols] is valid, else 1 + what is wrong with it, mask first: a mask
// value other than 0 / 1, a non-finite reward, a non-finite value (values may be null).
template <class T>
struct TokenInputFault {
  const T *rewards, *values, *mask;
  long rewards_stride, values_stride, mask_stride, cols;
  MRR_HOST_DEVICE int operator()(long i) const {
    const long r = i / cols, c = i - r * cols;
    const T m = mask[r * mask_stride + c];
    if (m != T(0) && m != T(1)) return 1;
    if (!ppo_kernels::is_finite(rewards[r * rewards_stride + c])) return 2;
    if (values != nullptr && !ppo_kernels::is_finite(values[r * values_stride + c])) return 3;
    return 0;
  }
};

// The lowest faulty element as element * 3 + (fault - 1) into *bad (which starts at 3 rows cols),
// whatever order the work items run in.
template <class T>
struct FindTokenInputFault {
  TokenInputFault<T> fault;
  long* bad;
  MRR_HOST_DEVICE void operator()(long i) const {
    const int f = fault(i);
    if (f != 0) atomic_lower(bad, i * 3 + (f - 1));
  }
};

// As a reduction: the same code, or `none` for a valid element.
template <class T>
struct TokenInputFaultCode {
  TokenInputFault<T> fault;
  long none;
  MRR_HOST_DEVICE long operator()(long i) const {
    const int f = fault(i);
    return f != 0 ? i * 3 + (f - 1) : none;
  }
};

// One work item, the last of the GAE view: a faulty input overrides the whitening's status (a
// non-binary mask may well select "no element").
struct ReportTokenInputFault {
  const long* bad;
  DeviceStatus* status;
  long none;
  MRR_HOST_DEVICE void operator()(int) const {
    if (*bad < none) {
      status->code = status_mask_not_binary + static_cast<std::int32_t>(*bad % 3);
      status->index = *bad / 3;
    }
  }
};

// The block kernel runs where nvcc compiles for the CUDA system, and on the host under the lane
// emulator (tests/support/lane_emulator.hpp), which CI runs it through.
#if (THRUST_DEVICE_SYSTEM == THRUST_DEVICE_SYSTEM_CUDA && MRR_COMPILING_WITH_NVCC) || defined(MRR_LANE_EMULATION)
#define MRR_GAE_BLOCK_KERNEL 1
#else
#define MRR_GAE_BLOCK_KERNEL 0
#endif

#if MRR_GAE_BLOCK_KERNEL
// GaeAlgorithm::blocks: the chunks algorithm above with one thread block per row, so the row, the
// chunks' maps, their chains and the first levels of the moments' tree stay in shared memory and
// the whole recurrence is one launch (the chunks algorithm takes five, with every map and carry
// through global memory, and a thread's 16 consecutive tokens read and written 4 bytes at a time
// with a 64-byte stride between lanes). Here the block reads and writes the row coalesced, staged
// in shared memory; thread c is chunk c, and the same functions run in the same order on the same
// values (gae_chunk_map, compose_maps, chain_maps, gae_chunk, merge_item), so the advantages,
// returns and moments are those of `chunks`, bit for bit. Rows of at most kGaeBlockThreads chunks
// whose stage fits the device's shared memory; longer rows take `chunks`.
inline constexpr int kGaeBlockThreads = 512;
inline constexpr int kGaeStagePitch = kGaeChunk + 1;  // a chunk's stage slots (+1: no bank conflicts)

template <class T>
struct GaeBlockShared {  // offsets in the block's dynamic shared memory
  std::size_t values, mask, maps, carry, super_maps, super_carry, bytes;
  static constexpr std::size_t align(std::size_t b) { return (b + 15) / 16 * 16; }
  static constexpr std::size_t slot() {  // a chunk's map, later its moments
    return sizeof(ppo_kernels::GaeChunkMap<T>) > sizeof(ppo_kernels::Moments) ? sizeof(ppo_kernels::GaeChunkMap<T>)
                                                                              : sizeof(ppo_kernels::Moments);
  }
  GaeBlockShared(long chunks, long supers) {
    const auto c = static_cast<std::size_t>(chunks), s = static_cast<std::size_t>(supers);
    const std::size_t stage = align(c * kGaeStagePitch * sizeof(T));
    values = stage;  // rewards at 0, then values, then the mask
    mask = 2 * stage;
    maps = 3 * stage;
    carry = maps + align(c * slot());
    super_maps = carry + align(2 * c * sizeof(T));
    super_carry = super_maps + align(s * sizeof(ppo_kernels::GaeChunkMap<T>));
    bytes = super_carry + align(2 * s * sizeof(T));
  }
};

// Levels of the moments' tree a row's block can merge itself: while a level has a multiple of
// kMomentsFan parts per row, every item of the next level lies inside one row.
inline int gae_block_levels(long chunks) {
  int levels = 0;
  for (long per_row = chunks; per_row % kMomentsFan == 0; per_row /= kMomentsFan)
    ++levels;
  return levels;
}

// Token j of a row in the stage: chunk j / kGaeChunk, slot j % kGaeChunk.
MRR_HOST_DEVICE inline long gae_stage_index(long j) {
  return (j / kGaeChunk) * kGaeStagePitch + j % kGaeChunk;
}

// Blocks an SM keeps of rows up to 256 chunks (4,096 tokens): the register budget of a thread.
#ifndef MRR_GAE_BLOCKS_PER_SM
#define MRR_GAE_BLOCKS_PER_SM 2
#endif

template <class T, int MaxThreads, int MinBlocks>
__global__ void __launch_bounds__(MaxThreads, MinBlocks)
    gae_blocks(GaeViews<T> g, long chunks, long supers, int levels, GaeBlockShared<T> layout,
               ppo_kernels::Moments* level_out, DeviceStatus* status) {
  MRR_DYNAMIC_SHARED(unsigned char, gae_shared);
  using Map = ppo_kernels::GaeChunkMap<T>;
  // The row: rewards, values, mask; the recurrence overwrites a chunk's rewards with its advantages
  // and its values with its returns (gae_chunk reads the chunk into registers before it writes).
  auto* rewards = reinterpret_cast<T*>(gae_shared);
  auto* values = reinterpret_cast<T*>(gae_shared + layout.values);
  auto* mask = reinterpret_cast<T*>(gae_shared + layout.mask);
  auto* maps = reinterpret_cast<Map*>(gae_shared + layout.maps);
  auto* parts = reinterpret_cast<ppo_kernels::Moments*>(gae_shared + layout.maps);  // the maps' slots, once used
  auto* carry = reinterpret_cast<T*>(gae_shared + layout.carry);
  auto* super_maps = reinterpret_cast<Map*>(gae_shared + layout.super_maps);
  auto* super_carry = reinterpret_cast<T*>(gae_shared + layout.super_carry);
  const long row = blockIdx.x, c = threadIdx.x, cols = g.cols;
  if (row == 0 && c == 0) *status = DeviceStatus{};  // the view's reset, ordered before the whitening's status
  {
    // blockDim.x >= chunks, so a thread stages at most kGaeChunk tokens: every load is issued
    // before the first store to the stage, one wait for memory instead of one per token.
    const T* r = g.rewards + row * g.rewards_stride;
    const T* v = g.values + row * g.values_stride;
    const T* m = g.mask + row * g.mask_stride;
    T rr[kGaeChunk], vv[kGaeChunk], mm[kGaeChunk];
#pragma unroll
    for (int i = 0; i < kGaeChunk; ++i) {
      const long j = c + i * static_cast<long>(blockDim.x);
      rr[i] = j < cols ? r[j] : T(0);
      vv[i] = j < cols ? v[j] : T(0);
      mm[i] = j < cols ? m[j] : T(0);
    }
#pragma unroll
    for (int i = 0; i < kGaeChunk; ++i) {
      const long j = c + i * static_cast<long>(blockDim.x);
      if (j < cols) {
        const long at = gae_stage_index(j);
        rewards[at] = rr[i];
        values[at] = vv[i];
        mask[at] = mm[i];
      }
    }
  }
  __syncthreads();
  // Chunk c's tokens sit at stage offset c * kGaeStagePitch (its `lo` in the row is c * kGaeChunk).
  const long at = c * kGaeStagePitch;
  const int len = static_cast<int>(c * kGaeChunk + kGaeChunk < cols ? kGaeChunk : cols - c * kGaeChunk);
  if (c < chunks)
    maps[c] =
        ppo_kernels::gae_chunk_map<kGaeChunk>(rewards + at, values + at, mask + at, 0, len, g.gamma, g.gamma_lambda);
  __syncthreads();
  const long s_lo = c * kGaeSuper, s_hi = s_lo + kGaeSuper < chunks ? s_lo + kGaeSuper : chunks;
  if (c < supers) super_maps[c] = ppo_kernels::compose_maps<kGaeSuper>(maps, s_hi - 1, static_cast<int>(s_hi - s_lo));
  __syncthreads();
  if (c == 0) {
    T next_value = 0, last_gae = 0;
    ppo_kernels::chain_maps<kGaeSuper>(super_maps, super_carry, supers - 1, supers, next_value, last_gae);
  }
  __syncthreads();
  if (c < supers) {
    T next_value = super_carry[2 * c], last_gae = super_carry[2 * c + 1];
    ppo_kernels::chain_maps<kGaeSuper>(maps, carry, s_hi - 1, s_hi - s_lo, next_value, last_gae);
  }
  __syncthreads();  // every map is read: their slots take the moments
  if (c < chunks)
    parts[c] = ppo_kernels::gae_chunk<kGaeChunk>(rewards + at, values + at, mask + at, rewards + at, values + at, 0,
                                                 len, carry[2 * c], carry[2 * c + 1], g.gamma, g.gamma_lambda);
  __syncthreads();
  {
    T* a = g.advantages + row * g.advantages_stride;
    T* ret = g.returns + row * g.returns_stride;
    for (long j = c; j < cols; j += blockDim.x) {
      const long at_j = gae_stage_index(j);
      a[j] = rewards[at_j];
      ret[j] = values[at_j];
    }
  }
  long per_row = chunks;
  for (int level = 0; level < levels; ++level) {
    const long items = per_row / kMomentsFan;
    ppo_kernels::Moments total;
    if (c < items) total = merge_item(parts, c, per_row);
    __syncthreads();
    if (c < items) parts[c] = total;
    __syncthreads();
    per_row = items;
  }
  if (c < per_row) level_out[row * per_row + c] = parts[c];
}

// The rest of the moments' tree above n <= kGaeFinishParts parts in one block: the first level
// from global memory, the others in shared memory; then WhiteningStats. The same tree as the
// launches of the chunks algorithm.
inline constexpr long kGaeFinishParts = 1024 * kMomentsFan;

template <class T>
__global__ void __launch_bounds__(1024)
    gae_finish_moments(const ppo_kernels::Moments* level, long n, T* stats, DeviceStatus* status) {
  __shared__ __align__(16) unsigned char stage_bytes[sizeof(ppo_kernels::Moments) * (kGaeFinishParts / kMomentsFan)];
  auto* stage = reinterpret_cast<ppo_kernels::Moments*>(stage_bytes);  // (Moments' initialisers: no __shared__ array)
  const long t = threadIdx.x;
  long m = n > 1 ? (n + kMomentsFan - 1) / kMomentsFan : 1;
  if (t < m) stage[t] = n > 1 ? merge_item(level, t, n) : level[0];
  __syncthreads();
  for (n = m; n > 1; n = m) {
    m = (n + kMomentsFan - 1) / kMomentsFan;
    ppo_kernels::Moments total;
    if (t < m) total = merge_item(stage, t, n);
    __syncthreads();
    if (t < m) stage[t] = total;
    __syncthreads();
  }
  if (t == 0) WhiteningStats<T>{stage, stats, status}(0);
}

// WhitenView with a block per row (no division per element), kUnroll loads in flight a thread.
template <class T>
__global__ void gae_whiten_rows(T* values, long stride, long cols, const T* stats, const DeviceStatus* status) {
  if (status->code != status_ok) return;
  T* row = values + static_cast<long>(blockIdx.x) * stride;
  const T mean = stats[0], scale = stats[1];
  constexpr int kUnroll = 8;
  const long step = blockDim.x;
  for (long base = threadIdx.x; base < cols; base += kUnroll * step) {
    T v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      v[u] = base + u * step < cols ? row[base + u * step] : T(0);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (base + u * step < cols) row[base + u * step] = ppo_kernels::whiten(v[u], mean, scale);
  }
}
#endif

template <class T>
struct MaskedTerm {  // (m, v m) in double
  const T *values, *mask;
  MRR_HOST_DEVICE thrust::pair<double, double> operator()(long i) const {
    return {static_cast<double>(mask[i]), ppo_kernels::masked_value<double>(values[i], mask[i])};
  }
};

struct AddPair {
  MRR_HOST_DEVICE thrust::pair<double, double> operator()(const thrust::pair<double, double>& x,
                                                          const thrust::pair<double, double>& y) const {
    return {x.first + y.first, x.second + y.second};
  }
};

template <class T>
struct CenteredSquare {  // m (v - mean)^2 in double
  const T *values, *mask;
  double mean;
  MRR_HOST_DEVICE double operator()(long i) const {
    return ppo_kernels::masked_centered_square<double>(values[i], mask[i], mean);
  }
};

template <class T>
struct Whiten {
  T* values;
  T mean, scale, add_back;
  MRR_HOST_DEVICE void operator()(long i) const { values[i] = ppo_kernels::whiten(values[i], mean, scale) + add_back; }
};

template <class T>
struct MaskedRowMean {  // verl masked_mean(axis=-1) of one row, in double
  const T *values, *mask;
  T* out;
  long cols;
  MRR_HOST_DEVICE void operator()(long r) const {
    out[r] = static_cast<T>(ppo_kernels::masked_mean<double>(values + r * cols, mask + r * cols, cols));
  }
};

template <class T>
struct RowOf {
  long cols;
  MRR_HOST_DEVICE long operator()(long i) const { return i / cols; }
};

// One group's per-response scalars (kernels::ppo::group_outcome) over its members, which sit at
// [start, start + count) of the responses sorted by group (stable: in sample order, as the host's).
template <class T>
struct GroupOutcome {
  const T* scores;
  const std::int32_t *order, *count;
  const long* start;
  T* scalars;
  ppo_kernels::OutcomeEstimator estimator;
  T epsilon, singleton_divisor;
  MRR_HOST_DEVICE void operator()(long g) const {
    ppo_kernels::group_outcome(scores, order + start[g], static_cast<long>(count[g]), estimator, epsilon,
                               singleton_divisor, scalars);
  }
};

template <class T>
struct Broadcast {
  const T *scalar, *mask;
  T *advantages, *returns;
  long cols;
  MRR_HOST_DEVICE void operator()(long i) const {
    advantages[i] = returns[i] = ppo_kernels::outcome_token(scalar[i / cols], mask[i]);
  }
};

// verl kl_penalty per element (kernels/ppo/kl.hpp).
template <class T>
struct KlElement {
  const T *logprob, *ref_logprob;
  T *out, *grad;
  mrr::kernels::ppo::KlEstimator estimator;
  bool straight_through;
  MRR_HOST_DEVICE void operator()(long i) const {
    const auto e = mrr::kernels::ppo::kl_element(logprob[i], ref_logprob[i], estimator, straight_through);
    out[i] = e.value;
    grad[i] = e.grad;
  }
};

}  // namespace kernels

namespace ppo_detail {

template <class V>
auto raw(const V& v) {
  return thrust::raw_pointer_cast(v.data());
}
template <class V>
auto raw(V& v) {
  return thrust::raw_pointer_cast(v.data());
}

// Throws, as the host functions do, for the lowest faulty token input (kernels::TokenInputFault)
// of row-major [rows, cols] vectors, naming it and its value; values may be null.
template <class T, class Backend>
void require_token_inputs(const char* fn, const typename Backend::template vector<T>& rewards,
                          const typename Backend::template vector<T>* values,
                          const typename Backend::template vector<T>& mask, long cols) {
  const long n = static_cast<long>(rewards.size()), none = 3 * n;
  if (n == 0) return;
  const kernels::TokenInputFault<T> fault{
      raw(rewards), values != nullptr ? raw(*values) : nullptr, raw(mask), cols, cols, cols, cols};
  const long bad = thrust::transform_reduce(
      Backend::policy(), thrust::counting_iterator<long>(0), thrust::counting_iterator<long>(n),
      kernels::TokenInputFaultCode<T>{fault, none}, none, thrust::minimum<long>());
  if (bad == none) return;
  const long i = bad / 3;
  const auto at = static_cast<std::size_t>(i);
  switch (bad % 3) {
    case 0:
      mrr::detail::throw_invalid_argument(fn, "'response_mask' has ", static_cast<T>(mask[at]), " at [", i / cols, ", ",
                                          i % cols, "]; a mask holds 0 or 1");
    case 1:
      mrr::detail::throw_invalid_argument(fn, "'token_level_rewards' has a non-finite value ",
                                          static_cast<T>(rewards[at]), " at [", i / cols, ", ", i % cols, "]");
    default:
      mrr::detail::throw_invalid_argument(fn, "'values' has a non-finite value ", static_cast<T>((*values)[at]),
                                          " at [", i / cols, ", ", i % cols, "]");
  }
}

// The masked moments of every element (count, mean, M2 about it) by Thrust reductions, in double.
template <class T, class Backend>
mrr::kernels::ppo::Moments masked_moments(const typename Backend::template vector<T>& values,
                                          const typename Backend::template vector<T>& mask) {
  const auto policy = Backend::policy();
  const long n = static_cast<long>(values.size());
  const auto ws = thrust::transform_reduce(policy, thrust::counting_iterator<long>(0), thrust::counting_iterator<long>(n),
                                           kernels::MaskedTerm<T>{raw(values), raw(mask)},
                                           thrust::pair<double, double>(0.0, 0.0), kernels::AddPair{});
  if (ws.first == 0) return {};
  const double mean = ws.second / ws.first;
  const double m2 = thrust::transform_reduce(policy, thrust::counting_iterator<long>(0),
                                             thrust::counting_iterator<long>(n),
                                             kernels::CenteredSquare<T>{raw(values), raw(mask), mean}, 0.0,
                                             thrust::plus<double>());
  return {ws.first, mean, m2};
}

// verl's mean and variance from the moments (kernels::ppo::mean_and_variance), errors named on the host.
template <class T>
thrust::pair<T, T> mean_and_variance(const mrr::kernels::ppo::Moments& moments, bool unbiased, const char* fn,
                                     const char* mask_name) {
  T mean{}, variance{};
  const auto status = mrr::kernels::ppo::mean_and_variance<T>(moments, unbiased, mean, variance);
  mrr::detail::require(status != mrr::kernels::ppo::Status::empty_mask, fn, "'", mask_name,
                       "' selects no element; the variance is undefined");
  mrr::detail::require(status != mrr::kernels::ppo::Status::single_element, fn, "'", mask_name,
                       "' selects a single element; the unbiased variance divides by zero");
  return {mean, variance};
}

template <class T, class Backend>
void whiten(typename Backend::template vector<T>& values, thrust::pair<T, T> mean_var, bool shift_mean) {
  const T scale = mrr::kernels::ppo::whitening_scale(mean_var.second);
  thrust::for_each(Backend::policy(), thrust::counting_iterator<long>(0),
                   thrust::counting_iterator<long>(static_cast<long>(values.size())),
                   kernels::Whiten<T>{raw(values), mean_var.first, scale, shift_mean ? T(0) : mean_var.first});
}

}  // namespace ppo_detail

// verl masked_mean over every element: sum(v m) / (sum(m) + 1e-8).
template <class T, class Backend = ThrustDeviceBackend>
T masked_mean(const typename Backend::template vector<T>& values, const typename Backend::template vector<T>& mask) {
  mrr::detail::require(values.size() == mask.size(), "device::masked_mean", "'values' and 'mask' differ in size");
  return ppo_detail::mean_and_variance<T>(ppo_detail::masked_moments<T, Backend>(values, mask), false,
                                          "device::masked_mean", "mask")
      .first;
}

// Mean (verl's, with the count epsilon) and variance (Bessel-corrected when unbiased).
template <class T, class Backend = ThrustDeviceBackend>
thrust::pair<T, T> masked_mean_var(const typename Backend::template vector<T>& values,
                                   const typename Backend::template vector<T>& mask, bool unbiased = true) {
  constexpr const char* fn = "device::masked_var";
  mrr::detail::require(values.size() == mask.size(), fn, "'values' and 'mask' differ in size");
  return ppo_detail::mean_and_variance<T>(ppo_detail::masked_moments<T, Backend>(values, mask), unbiased, fn, "mask");
}

template <class T, class Backend = ThrustDeviceBackend>
T masked_var(const typename Backend::template vector<T>& values, const typename Backend::template vector<T>& mask,
             bool unbiased = true) {
  return masked_mean_var<T, Backend>(values, mask, unbiased).second;
}

// verl masked_whiten: (v - mean) / sqrt(var + 1e-8), plus the mean back when !shift_mean. In place.
template <class T, class Backend = ThrustDeviceBackend>
void masked_whiten_in_place(typename Backend::template vector<T>& values,
                            const typename Backend::template vector<T>& mask, bool shift_mean = true) {
  ppo_detail::whiten<T, Backend>(values, masked_mean_var<T, Backend>(values, mask, true), shift_mean);
}

// Row sums of v m / (row sum of m + 1e-8): verl masked_mean(axis=-1), one row per work item.
template <class T, class Backend = ThrustDeviceBackend>
typename Backend::template vector<T> masked_row_mean(const typename Backend::template vector<T>& values,
                                                     const typename Backend::template vector<T>& mask, long cols) {
  mrr::detail::require(cols > 0 && values.size() % static_cast<std::size_t>(cols) == 0 && mask.size() == values.size(),
                       "device::masked_row_mean", "'values' and 'mask' must both be [rows, ", cols, "]");
  const long rows = static_cast<long>(values.size()) / cols;
  typename Backend::template vector<T> out(static_cast<std::size_t>(rows));
  thrust::for_each(Backend::policy(), thrust::counting_iterator<long>(0), thrust::counting_iterator<long>(rows),
                   kernels::MaskedRowMean<T>{ppo_detail::raw(values), ppo_detail::raw(mask), ppo_detail::raw(out), cols});
  return out;
}

// verl whitens GAE advantages with masked_whiten's statistics, from their masked moments.
template <class T, class Backend>
void whiten_advantages(typename Backend::template vector<T>& advantages, const mrr::kernels::ppo::Moments& moments,
                       const char* fn) {
  mrr::detail::require(moments.weight != 0, fn, "'response_mask' selects no element; whitening is undefined");
  ppo_detail::whiten<T, Backend>(advantages, ppo_detail::mean_and_variance<T>(moments, true, fn, "response_mask"), true);
}

// How GAE walks time: `chunks` (chunks of kGaeChunk tokens: their affine maps, chained along each
// row, then each chunk's recurrence: rows x chunks work items, what a GPU needs), `scan` (two
// segmented reverse scans of affine maps over every token) or `rows` (the sequential recurrence,
// blocks of rows in parallel: what CPU threads need). `blocks` is chunks with a CUDA thread block
// per row (kernels::gae_blocks: one launch, maps and carries in shared memory), the same bits as
// chunks; rows longer than kGaeBlockThreads chunks, and systems other than CUDA, run chunks.
// `automatic` picks rows on the OpenMP and host systems and blocks on CUDA. chunks and scan equal
// rows up to floating-point reassociation.
enum class GaeAlgorithm { automatic, scan, rows, chunks, blocks };

template <class Backend>
constexpr GaeAlgorithm resolve_gae_algorithm(GaeAlgorithm a) {
  if (a != GaeAlgorithm::automatic) return a;
#if THRUST_DEVICE_SYSTEM == THRUST_DEVICE_SYSTEM_CUDA
  return std::is_same_v<Backend, ThrustBackend<ThrustHostSystem>> ? GaeAlgorithm::rows : GaeAlgorithm::blocks;
#else
  return GaeAlgorithm::rows;
#endif
}

namespace ppo_detail {

// GAE by rows (kernels::GaeRowsView); returns the advantages' masked moments, merged in block order
// (kernels::ppo::merge): the same bits for any thread count.
template <class T, class Backend>
mrr::kernels::ppo::Moments gae_rows(const typename Backend::template vector<T>& rewards,
                                    const typename Backend::template vector<T>& values,
                                    const typename Backend::template vector<T>& mask, long cols, T gamma,
                                    T gamma_lambda, AdvantageResult<T, Backend>& out) {
  const long rows = static_cast<long>(rewards.size()) / cols, blocks = (rows + kernels::kGaeRows - 1) / kernels::kGaeRows;
  typename Backend::template vector<mrr::kernels::ppo::Moments> moments(static_cast<std::size_t>(blocks));
  thrust::for_each(Backend::policy(), thrust::counting_iterator<long>(0), thrust::counting_iterator<long>(blocks),
                   kernels::GaeRowsView<T>{{raw(rewards), raw(values), raw(mask), raw(out.advantages), raw(out.returns),
                                            cols, cols, cols, cols, cols, rows, cols, gamma, gamma_lambda},
                                           raw(moments)});
  const thrust::host_vector<mrr::kernels::ppo::Moments> h(moments);
  mrr::kernels::ppo::Moments total;
  for (const auto& m : h) mrr::kernels::ppo::merge(total, m);
  return total;
}

// GAE as two segmented reverse scans of the recurrence's affine maps; returns the moments.
template <class T, class Backend>
mrr::kernels::ppo::Moments gae_scan(const typename Backend::template vector<T>& rewards,
                                    const typename Backend::template vector<T>& values,
                                    const typename Backend::template vector<T>& mask, long cols, T gamma,
                                    T gamma_lambda, AdvantageResult<T, Backend>& out) {
  using Affine = mrr::kernels::ppo::Affine<T>;
  const auto policy = Backend::policy();
  const long n = static_cast<long>(rewards.size());
  const auto keys = thrust::make_transform_iterator(thrust::counting_iterator<long>(0), kernels::ReverseRowKey{n, cols});
  typename Backend::template vector<Affine> next_value(static_cast<std::size_t>(n)), scanned(static_cast<std::size_t>(n));
  thrust::inclusive_scan_by_key(
      policy, keys, keys + n,
      thrust::make_transform_iterator(thrust::counting_iterator<long>(0), kernels::NextValueStep<T>{raw(values), raw(mask), n}),
      next_value.begin(), thrust::equal_to<long>(), kernels::ComposeAffine<T>{});
  const kernels::AdvantageStep<T> step{raw(rewards), raw(values), raw(mask), raw(next_value), n, cols, gamma, gamma_lambda};
  thrust::inclusive_scan_by_key(policy, keys, keys + n,
                                thrust::make_transform_iterator(thrust::counting_iterator<long>(0), step),
                                scanned.begin(), thrust::equal_to<long>(), kernels::ComposeAffine<T>{});
  thrust::for_each(policy, thrust::counting_iterator<long>(0), thrust::counting_iterator<long>(n),
                   kernels::WriteAdvantage<T>{raw(scanned), raw(values), raw(out.advantages), raw(out.returns), n});
  return masked_moments<T, Backend>(out.advantages, mask);
}

}  // namespace ppo_detail

// ---- GAE on the caller's memory, stream and workspace (DESIGN.md section 11) ----

namespace ppo_detail {

// Sizes of the merge tree's levels above `parts` parts (each ceil(n / kMomentsFan)), and their sum.
inline long moments_tree_size(long parts) {
  long total = 0;
  for (long n = parts; n > 1;) {
    n = (n + kernels::kMomentsFan - 1) / kernels::kMomentsFan;
    total += n;
  }
  return total;
}

inline long gae_supers_per_row(long cols) {
  const long chunks = (cols + kernels::kGaeChunk - 1) / kernels::kGaeChunk;
  return (chunks + kernels::kGaeSuper - 1) / kernels::kGaeSuper;
}

inline bool gae_by_chunks(GaeAlgorithm resolved) {
  return resolved == GaeAlgorithm::chunks || resolved == GaeAlgorithm::blocks;
}

inline long gae_parts(long rows, long cols, GaeAlgorithm resolved) {
  return gae_by_chunks(resolved) ? rows * ((cols + kernels::kGaeChunk - 1) / kernels::kGaeChunk)
                                 : (rows + kernels::kGaeRows - 1) / kernels::kGaeRows;
}

#if MRR_GAE_BLOCK_KERNEL
inline void cuda_launched([[maybe_unused]] const char* fn) {
#if !defined(MRR_LANE_EMULATION)
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw std::runtime_error(mrr::detail::str("mrr::", fn, ": ", cudaGetErrorString(e)));
#endif
}

// Whether rows of `chunks` chunks fit kernels::gae_blocks on the current device: at most
// kGaeBlockThreads chunks, the stage within the shared memory a block may opt in to, and a grid
// of one block per row.
// The shared memory a block of the current device may opt in to (0 when it cannot be read).
inline int gae_shared_optin() {
#if defined(MRR_LANE_EMULATION)
  return 232448;  // an H100's or H200's 227 KiB
#else
  int device = 0, optin = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess) {
    (void)cudaGetLastError();  // the query's own error: the view falls back to chunks
    return 0;
  }
  return optin;
#endif
}

template <class T>
bool gae_blocks_fit(long rows, long chunks, long supers_per_row) {
  if (chunks > kernels::kGaeBlockThreads || rows > 0x7fffffffL) return false;  // a grid of one block per row
  return kernels::GaeBlockShared<T>(chunks, supers_per_row).bytes <= static_cast<std::size_t>(gae_shared_optin());
}

// GaeAlgorithm::blocks (kernels::gae_blocks): the recurrence and the tree's in-row levels in one
// launch, the tree's upper levels (one block once few parts are left) and the whitening. The
// moments land where the chunks algorithm's launches put them, so the tree is the same.
template <class T, class SpreadEach>
void gae_blocks(const kernels::GaeViews<T>& g, long chunks, long supers_per_row, mrr::kernels::ppo::Moments* part,
                long parts, mrr::kernels::ppo::Moments* tree, T* stats, DeviceStatus* status,
                const SpreadEach& spread_each, [[maybe_unused]] const Execution& x, const char* fn) {
  using Moments = mrr::kernels::ppo::Moments;
  const int levels = kernels::gae_block_levels(chunks);
  Moments* level = part;  // level 0: the chunks' moments
  Moments* next = tree;   // where the level above it goes
  long n = parts;
  for (int l = 0; l < levels; ++l) {
    n /= kernels::kMomentsFan;
    level = next;
    next += n;
  }
  const kernels::GaeBlockShared<T> layout(chunks, supers_per_row);
  const auto threads = static_cast<unsigned>((chunks + 31) / 32 * 32);
  const auto launch = [&](auto kernel) {
    // Above the default a launch must opt in. The limit is the function's, for every host thread:
    // set it to the device's maximum, never lower, so a launch of another thread's shorter rows
    // cannot undo it between this thread's setting and its launch.
#if !defined(MRR_LANE_EMULATION)
    if (layout.bytes > 48 * 1024) {
      const cudaError_t e =
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, gae_shared_optin());
      if (e != cudaSuccess) throw std::runtime_error(mrr::detail::str("mrr::", fn, ": ", cudaGetErrorString(e)));
    }
#endif
    MRR_KERNEL_LAUNCH(kernel, static_cast<unsigned>(g.rows), threads, layout.bytes, x.stream, g, chunks, supers_per_row,
                      levels, layout, level, status);
  };
  if (threads <= 256)
    launch(kernels::gae_blocks<T, 256, MRR_GAE_BLOCKS_PER_SM>);
  else
    launch(kernels::gae_blocks<T, kernels::kGaeBlockThreads, 1>);
  cuda_launched(fn);
  for (; n > kernels::kGaeFinishParts;) {  // levels of the tree as launches, down to one block's
    const long m = (n + kernels::kMomentsFan - 1) / kernels::kMomentsFan;
    spread_each(m, 8, kernels::MergeMoments{level, next, n});
    level = next;
    next += m;
    n = m;
  }
  MRR_KERNEL_LAUNCH(kernels::gae_finish_moments<T>, 1, 1024, 0, x.stream, level, n, stats, status);
  cuda_launched(fn);
  MRR_KERNEL_LAUNCH(kernels::gae_whiten_rows<T>, static_cast<unsigned>(g.rows), 256, 0, x.stream, g.advantages,
                    g.advantages_stride, g.cols, stats, status);
  cuda_launched(fn);
}
#endif

}  // namespace ppo_detail

// Workspace of the GAE view for [rows, cols] (algorithm: blocks, chunks or rows; automatic picks
// blocks on CUDA, rows elsewhere; blocks takes chunks' size, since a row too long for a block runs
// chunks).
template <class T>
std::size_t gae_workspace_bytes(long rows, long cols, GaeAlgorithm algorithm = GaeAlgorithm::automatic) {
  const GaeAlgorithm resolved = resolve_gae_algorithm<ThrustDeviceBackend>(algorithm);
  const auto parts = static_cast<std::size_t>(ppo_detail::gae_parts(rows, cols, resolved));
  std::size_t bytes = detail::workspace_array_bytes<mrr::kernels::ppo::Moments>(parts) +
                      detail::workspace_array_bytes<mrr::kernels::ppo::Moments>(
                          static_cast<std::size_t>(ppo_detail::moments_tree_size(static_cast<long>(parts))) + 1) +
                      detail::workspace_array_bytes<T>(2) + detail::workspace_array_bytes<long>(1);
  if (ppo_detail::gae_by_chunks(resolved)) {
    const auto supers = static_cast<std::size_t>(rows) * static_cast<std::size_t>(ppo_detail::gae_supers_per_row(cols));
    bytes += detail::workspace_array_bytes<mrr::kernels::ppo::GaeChunkMap<T>>(parts) +
             detail::workspace_array_bytes<T>(2 * parts) +
             detail::workspace_array_bytes<mrr::kernels::ppo::GaeChunkMap<T>>(supers) +
             detail::workspace_array_bytes<T>(2 * supers);
  }
  return bytes;
}

// verl "gae" on views: rewards, values, mask [rows, cols] (any row strides) in; advantages
// (whitened over the mask, verl's masked_whiten with the unbiased variance) and returns
// (advantages + values before whitening) [rows, cols] written. Enqueued on x.stream; nothing
// allocates or waits. A mask selecting no element or one leaves the advantages unwhitened and sets
// *status (check_gae throws verl's error); so does, overriding it, an input the host functions
// refuse (a mask value other than 0 / 1, a non-finite reward or value, anywhere), whose
// advantages and returns are then undefined. `algorithm`: blocks (CUDA's: a thread block per row),
// chunks (rows x chunks of kGaeChunk tokens, the same bits in more launches) or rows (sequential per
// row, CPU threads'); scan is the owning function's only.
template <class T>
void compute_gae_advantage_return(MatrixView<const T> rewards, MatrixView<const T> values, MatrixView<const T> mask,
                                  double gamma, double lam, MatrixView<T> advantages, MatrixView<T> returns,
                                  Workspace workspace, DeviceStatus* status, Execution x = {},
                                  GaeAlgorithm algorithm = GaeAlgorithm::automatic) {
  constexpr const char* fn = "device::compute_gae_advantage_return";
  const long rows = rewards.rows, cols = rewards.cols;
  const GaeAlgorithm resolved = resolve_gae_algorithm<ThrustDeviceBackend>(algorithm);
  mrr::detail::require(resolved != GaeAlgorithm::scan, fn,
                       "the view runs GaeAlgorithm::blocks, chunks or rows, not scan");
  mrr::detail::require(rows > 0 && cols > 0, fn, "needs at least one row and one column, got [", rows, ", ", cols, "]");
  detail::require_view(rewards, rows, cols, fn, "rewards");
  detail::require_view(values, rows, cols, fn, "values");
  detail::require_view(mask, rows, cols, fn, "response_mask");
  detail::require_view(advantages, rows, cols, fn, "advantages");
  detail::require_view(returns, rows, cols, fn, "returns");
  mrr::detail::require(status != nullptr, fn, "the status pointer is null");
  using Moments = mrr::kernels::ppo::Moments;
  detail::WorkspaceArena arena(workspace, gae_workspace_bytes<T>(rows, cols, resolved), fn);
  auto alloc = arena.temporary_allocator();
  const auto policy = detail::execution_policy(x, alloc);
  const kernels::GaeViews<T> g{rewards.data,
                               values.data,
                               mask.data,
                               advantages.data,
                               returns.data,
                               rewards.row_stride,
                               values.row_stride,
                               mask.row_stride,
                               advantages.row_stride,
                               returns.row_stride,
                               rows,
                               cols,
                               static_cast<T>(gamma),
                               static_cast<T>(gamma * lam)};
  const long parts = ppo_detail::gae_parts(rows, cols, resolved);
  Moments* part = arena.take<Moments>(static_cast<std::size_t>(parts));
  Moments* tree = arena.take<Moments>(static_cast<std::size_t>(ppo_detail::moments_tree_size(parts)) + 1);
  T* stats = arena.take<T>(2);
  long* bad = arena.take<long>(1);
  using thrust::counting_iterator;
  // Last in stream order, after the whitening's status: the lowest faulty input, if any.
  const auto report_faults = [&] {
    const long none = 3 * rows * cols;
    thrust::for_each(policy, counting_iterator<int>(0), counting_iterator<int>(1), kernels::SetLong{bad, none});
    thrust::for_each(
        policy, counting_iterator<long>(0), counting_iterator<long>(rows * cols),
        kernels::FindTokenInputFault<T>{
            {rewards.data, values.data, mask.data, rewards.row_stride, values.row_stride, mask.row_stride, cols}, bad});
    thrust::for_each(policy, counting_iterator<int>(0), counting_iterator<int>(1),
                     kernels::ReportTokenInputFault{bad, status, none});
  };
  // Few long items are spread over more SMs on a GPU (kernels::Spread); one per item elsewhere.
  const auto spread_each = [&](long n, long stride, auto f) {
    if (THRUST_DEVICE_SYSTEM != THRUST_DEVICE_SYSTEM_CUDA || stride <= 1)
      thrust::for_each(policy, counting_iterator<long>(0), counting_iterator<long>(n), f);
    else
      thrust::for_each(policy, counting_iterator<long>(0), counting_iterator<long>(n * stride),
                       kernels::Spread<decltype(f)>{f, stride});
  };
  if (ppo_detail::gae_by_chunks(resolved)) {
    const long chunks = (cols + kernels::kGaeChunk - 1) / kernels::kGaeChunk;
    const long supers_per_row = ppo_detail::gae_supers_per_row(cols), supers = rows * supers_per_row;
#if MRR_GAE_BLOCK_KERNEL
    if (resolved == GaeAlgorithm::blocks && ppo_detail::gae_blocks_fit<T>(rows, chunks, supers_per_row)) {
      ppo_detail::gae_blocks<T>(g, chunks, supers_per_row, part, parts, tree, stats, status, spread_each, x, fn);
      report_faults();
      return;
    }
#endif
    detail::reset_status(status, x);
    auto* maps = arena.take<mrr::kernels::ppo::GaeChunkMap<T>>(static_cast<std::size_t>(parts));
    T* carry = arena.take<T>(2 * static_cast<std::size_t>(parts));
    auto* super_maps = arena.take<mrr::kernels::ppo::GaeChunkMap<T>>(static_cast<std::size_t>(supers));
    T* super_carry = arena.take<T>(2 * static_cast<std::size_t>(supers));
    spread_each(parts, 4, kernels::GaeChunkMaps<T>{g, maps, chunks});
    spread_each(supers, 16, kernels::GaeComposeSupers<T>{maps, super_maps, chunks, supers_per_row});
    spread_each(rows, 32, kernels::GaeChainSupers<T>{super_maps, super_carry, supers_per_row});
    spread_each(supers, 16, kernels::GaeChainChunks<T>{maps, super_carry, carry, chunks, supers_per_row});
    spread_each(parts, 4, kernels::GaeChunkSteps<T>{g, carry, part, chunks});
  } else {
    detail::reset_status(status, x);
    thrust::for_each(policy, counting_iterator<long>(0), counting_iterator<long>(parts),
                     kernels::GaeRowsView<T>{g, part});
  }
  // The merge tree: each level's parts after the previous level's, the total last.
  const Moments* level = part;
  Moments* next = tree;
  for (long n = parts; n > 1;) {
    const long m = (n + kernels::kMomentsFan - 1) / kernels::kMomentsFan;
    spread_each(m, 8, kernels::MergeMoments{level, next, n});
    level = next;
    next += m;
    n = m;
  }
  thrust::for_each(policy, counting_iterator<int>(0), counting_iterator<int>(1),
                   kernels::WhiteningStats<T>{level, stats, status});
  thrust::for_each(policy, counting_iterator<long>(0), counting_iterator<long>(rows * cols),
                   kernels::WhitenView<T>{advantages.data, advantages.row_stride, cols, stats, status});
  report_faults();
}

// Synchronises x.stream and throws if the GAE view found a faulty input (named at [row, col] when
// `cols` is given, else by its row-major index) or verl's error if its mask selected no element or
// one.
inline void check_gae(const DeviceStatus* status, Execution x = {}, long cols = 0) {
  const DeviceStatus s = read_status(status, x);
  constexpr const char* fn = "device::compute_gae_advantage_return";
  if (s.code == status_mask_not_binary || s.code == status_reward_not_finite || s.code == status_value_not_finite) {
    const char* what = s.code == status_mask_not_binary     ? "'response_mask' has a value other than 0 or 1"
                       : s.code == status_reward_not_finite ? "'token_level_rewards' has a non-finite value"
                                                            : "'values' has a non-finite value";
    if (cols > 0) mrr::detail::throw_invalid_argument(fn, what, " at [", s.index / cols, ", ", s.index % cols, "]");
    mrr::detail::throw_invalid_argument(fn, what, " at element ", s.index, " (row-major)");
  }
  mrr::detail::require(s.code != status_mask_selects_none, fn,
                       "'response_mask' selects no element; whitening is undefined");
  mrr::detail::require(s.code != status_mask_selects_one, fn, "'response_mask' selects a single element; ",
                       "the unbiased variance divides by zero");
  mrr::detail::require(s.code == status_ok, fn, "unknown device status ", s.code);
}

// verl "gae": advantages whitened over the mask (every element), returns = advantages + values
// before whitening. Inputs [rows, cols]. GaeAlgorithm::blocks and chunks run the view above (on a
// host backend, which has no view, the rows).
template <class T, class Backend = ThrustDeviceBackend>
AdvantageResult<T, Backend> compute_gae_advantage_return(const typename Backend::template vector<T>& rewards,
                                                         const typename Backend::template vector<T>& values,
                                                         const typename Backend::template vector<T>& mask, long cols,
                                                         double gamma, double lam,
                                                         GaeAlgorithm algorithm = GaeAlgorithm::automatic) {
  constexpr const char* fn = "device::compute_gae_advantage_return";
  const long n = static_cast<long>(rewards.size());
  mrr::detail::require(cols > 0 && n % cols == 0 && values.size() == rewards.size() && mask.size() == rewards.size(),
                       fn, "rewards, values and mask must all be [rows, ", cols, "]");
  AdvantageResult<T, Backend> out{typename Backend::template vector<T>(static_cast<std::size_t>(n)),
                                  typename Backend::template vector<T>(static_cast<std::size_t>(n))};
  const T g = static_cast<T>(gamma), gl = static_cast<T>(gamma * lam);
  const GaeAlgorithm resolved = resolve_gae_algorithm<Backend>(algorithm);
  if (ppo_detail::gae_by_chunks(resolved) && Backend::is_device && n > 0) {
    const auto raw = [](auto& v) { return thrust::raw_pointer_cast(v.data()); };
    const long rows = n / cols;
    const std::size_t bytes = gae_workspace_bytes<T>(rows, cols, resolved);
    const detail::OwnedWorkspace<decltype(Backend::policy())> workspace(Backend::policy(), bytes);
    typename Backend::template vector<DeviceStatus> status(1);
    compute_gae_advantage_return<T>(
        matrix_view<const T>(raw(rewards), rows, cols), matrix_view<const T>(raw(values), rows, cols),
        matrix_view<const T>(raw(mask), rows, cols), gamma, lam, matrix_view<T>(raw(out.advantages), rows, cols),
        matrix_view<T>(raw(out.returns), rows, cols), workspace.get(), raw(status), {}, resolved);
    // The view checked the inputs in its own pass; a fault is then named with its value, as the CPU does.
    const std::int32_t code = read_status(raw(status), {}).code;
    if (code == status_mask_not_binary || code == status_reward_not_finite || code == status_value_not_finite)
      ppo_detail::require_token_inputs<T, Backend>(fn, rewards, &values, mask, cols);
    check_gae(raw(status), {}, cols);
    return out;
  }
  ppo_detail::require_token_inputs<T, Backend>(fn, rewards, &values, mask, cols);
  const auto moments = resolved == GaeAlgorithm::scan
                           ? ppo_detail::gae_scan<T, Backend>(rewards, values, mask, cols, g, gl, out)
                           : ppo_detail::gae_rows<T, Backend>(rewards, values, mask, cols, g, gl, out);
  whiten_advantages<T, Backend>(out.advantages, moments, fn);
  return out;
}

enum class OutcomeEstimator { grpo, rloo, rloo_vectorized };

// verl "grpo" (norm_adv_by_std_in_grpo; Dr.GRPO without), "rloo" and "rloo_vectorized".
// `group` [rows] holds each response's group as an int in [0, num_groups) (map verl's uid labels
// to ints on the host). Score = sum of the row's rewards (every column, as verl). Each group's
// scalars come from kernels::ppo::group_outcome over its members in sample order, as on the host.
template <class T, class Backend = ThrustDeviceBackend>
AdvantageResult<T, Backend> compute_outcome_advantage(OutcomeEstimator estimator,
                                                      const typename Backend::template vector<T>& rewards,
                                                      const typename Backend::template vector<T>& mask, long cols,
                                                      const typename Backend::template vector<std::int32_t>& group,
                                                      int num_groups, double epsilon = 1e-6,
                                                      bool norm_adv_by_std_in_grpo = true) {
  constexpr const char* fn = "device::compute_outcome_advantage";
  using ppo_detail::raw;
  const long n = static_cast<long>(rewards.size()), rows = cols > 0 ? n / cols : 0;
  mrr::detail::require(cols > 0 && n % cols == 0 && mask.size() == rewards.size() &&
                           static_cast<long>(group.size()) == rows,
                       fn, "rewards and mask must be [rows, ", cols, "] and group [rows]");
  ppo_detail::require_token_inputs<T, Backend>(fn, rewards, nullptr, mask, cols);
  const auto policy = Backend::policy();
  // Row scores.
  typename Backend::template vector<long> row_keys(static_cast<std::size_t>(rows));
  typename Backend::template vector<T> scores(static_cast<std::size_t>(rows));
  const auto row_of = thrust::make_transform_iterator(thrust::counting_iterator<long>(0), kernels::RowOf<T>{cols});
  thrust::reduce_by_key(policy, row_of, row_of + n, rewards.begin(), row_keys.begin(), scores.begin());
  // The responses sorted by group (stable: sample order inside a group), each group's size and start.
  typename Backend::template vector<std::int32_t> sorted_group(group.begin(), group.end()),
      order(static_cast<std::size_t>(rows)), unique_groups(static_cast<std::size_t>(rows)),
      counts(static_cast<std::size_t>(rows));
  thrust::sequence(policy, order.begin(), order.end());
  thrust::stable_sort_by_key(policy, sorted_group.begin(), sorted_group.end(), order.begin());
  const auto ends = thrust::reduce_by_key(policy, sorted_group.begin(), sorted_group.end(),
                                          thrust::constant_iterator<std::int32_t>(1), unique_groups.begin(),
                                          counts.begin());
  const long present = ends.first - unique_groups.begin();
  mrr::detail::require(present <= num_groups, fn, "'group' holds ", present, " distinct ids, more than num_groups (",
                       num_groups, ")");
  typename Backend::template vector<long> starts(static_cast<std::size_t>(present));
  thrust::exclusive_scan(policy, counts.begin(), counts.begin() + present, starts.begin(), 0L);

  namespace k = mrr::kernels::ppo;
  const k::OutcomeEstimator kind = estimator == OutcomeEstimator::grpo
                                       ? (norm_adv_by_std_in_grpo ? k::OutcomeEstimator::grpo
                                                                  : k::OutcomeEstimator::grpo_mean_only)
                                       : (estimator == OutcomeEstimator::rloo ? k::OutcomeEstimator::rloo
                                                                              : k::OutcomeEstimator::rloo_vectorized);
  const T singleton = static_cast<T>(k::singleton_std_plus_epsilon(epsilon));
  typename Backend::template vector<T> scalar(static_cast<std::size_t>(rows));
  thrust::for_each(policy, thrust::counting_iterator<long>(0), thrust::counting_iterator<long>(present),
                   kernels::GroupOutcome<T>{raw(scores), raw(order), raw(counts), raw(starts), raw(scalar), kind,
                                            static_cast<T>(epsilon), singleton});
  AdvantageResult<T, Backend> out{typename Backend::template vector<T>(static_cast<std::size_t>(n)),
                                  typename Backend::template vector<T>(static_cast<std::size_t>(n))};
  thrust::for_each(policy, thrust::counting_iterator<long>(0), thrust::counting_iterator<long>(n),
                   kernels::Broadcast<T>{raw(scalar), raw(mask), raw(out.advantages), raw(out.returns), cols});
  return out;
}

template <class T, class Backend = ThrustDeviceBackend>
struct KlResult {
  typename Backend::template vector<T> values, grad_logprob;
};

// verl kl_penalty element-wise with the gradient w.r.t. logprob (estimator as ppo::KlEstimator:
// 0 k1, 1 abs, 2 k2, 3 k3; parse names on the host with ppo::parse_kl_penalty).
template <class T, class Backend = ThrustDeviceBackend>
KlResult<T, Backend> kl_penalty(const typename Backend::template vector<T>& logprob,
                                const typename Backend::template vector<T>& ref_logprob, int estimator,
                                bool straight_through) {
  mrr::detail::require(logprob.size() == ref_logprob.size(), "device::kl_penalty",
                       "'logprob' and 'ref_logprob' differ in size");
  KlResult<T, Backend> out{typename Backend::template vector<T>(logprob.size()),
                           typename Backend::template vector<T>(logprob.size())};
  thrust::for_each(Backend::policy(), thrust::counting_iterator<long>(0),
                   thrust::counting_iterator<long>(static_cast<long>(logprob.size())),
                   kernels::KlElement<T>{ppo_detail::raw(logprob), ppo_detail::raw(ref_logprob),
                                         ppo_detail::raw(out.values), ppo_detail::raw(out.grad_logprob),
                                         static_cast<mrr::kernels::ppo::KlEstimator>(estimator), straight_through});
  return out;
}

}  // namespace device
MRR_NAMESPACE_END
