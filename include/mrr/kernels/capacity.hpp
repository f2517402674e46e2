// Expert capacity and token dropping (Megatron's get_capacity and apply_router_token_dropping),
// written once for every executor as plain MRR_HOST_DEVICE code over raw pointers.
//
// An expert's candidates form a segment (a column of the dense [tokens, experts] map, or the
// expert's rows of the expert-major permutation), listed in ascending token order. Which of them
// the expert keeps is decided by a strict total order, so the result never depends on the
// selection algorithm: a candidate ranks before another when its order key is smaller, or the keys
// are equal and its token is lower. Keys (both policies as one 64-bit order):
//   probs    - the probability, higher first (probs_key: -0 and +0 equal, as the CPU compares);
//   position - routed candidates first (position_key), so the earliest routed tokens are kept.
// The keep decision of a segment: the `capacity` best candidates. With the segment's
// capacity-th smallest key as threshold (found by the executor: a selection on CPU threads, a
// sort on a GPU), a candidate is kept when its key is below the threshold, or equal to it and
// among the first `quota` such candidates in token order (SegmentCut). An executor that sorted
// the segment best-first keeps its first `capacity` positions instead (kept_at_rank): the same set.
#pragma once

#include <mrr/detail/config.hpp>

#if MRR_COMPILING_WITH_NVCC
#include <cuda/std/bit>
#else
#include <bit>
#endif

#include <cmath>
#include <cstdint>

MRR_NAMESPACE_BEGIN
namespace kernels {

// Megatron get_capacity(slots, num_experts, capacity_factor) = ceil(slots / E * capacity_factor),
// slots = tokens * k. The caller checks capacity_factor is finite and positive. A capacity past
// int64's range saturates (every slot is kept either way): a huge factor (1e20 for "never drop")
// must not convert to a negative capacity that drops every slot.
MRR_HOST_DEVICE inline std::int64_t expert_capacity(std::int64_t slots, int num_experts, double capacity_factor) {
  using std::ceil;
  const double per_expert = static_cast<double>(slots) / static_cast<double>(num_experts);
  const double capacity = ceil(per_expert * capacity_factor);
  constexpr double kBeyondInt64 = 9223372036854775808.0;  // 2^63
  return capacity >= kBeyondInt64 ? INT64_MAX : static_cast<std::int64_t>(capacity);
}

// A 64-bit key whose ascending order is the probabilities' descending order: the value widened to
// double (exact for float), -0 made +0 (the CPU compares them equal), the IEEE bits made monotone
// (negatives: all bits flipped; others: the sign bit set), then complemented.
template <class T>
MRR_HOST_DEVICE MRR_FORCEINLINE std::uint64_t probs_key(T p) {
  double x = static_cast<double>(p);
  if (x == 0.0) x = 0.0;
#if MRR_COMPILING_WITH_NVCC
  const std::uint64_t u = ::cuda::std::bit_cast<std::uint64_t>(x);
#else
  const std::uint64_t u = std::bit_cast<std::uint64_t>(x);
#endif
  const std::uint64_t ascending = (u >> 63) != 0 ? ~u : (u | (std::uint64_t(1) << 63));
  return ~ascending;
}

// The position policy's key: routed candidates before the others (then the lower token).
MRR_HOST_DEVICE MRR_FORCEINLINE std::uint64_t position_key(bool routed) { return routed ? 0 : 1; }

// The strict total order of candidates (key, token): smaller key first, then the lower token.
MRR_HOST_DEVICE MRR_FORCEINLINE bool ranks_before(std::uint64_t key_a, long token_a, std::uint64_t key_b,
                                                  long token_b) {
  return key_a < key_b || (key_a == key_b && token_a < token_b);
}

// Where a segment is cut: candidates with key < threshold are kept, and the first `quota` with
// key == threshold in token order. A segment with no more candidates than capacity keeps all.
struct SegmentCut {
  std::uint64_t threshold = ~std::uint64_t(0);
  long quota = 0;
  bool keep_all = true;

  // Called once per candidate, in token order.
  MRR_HOST_DEVICE MRR_FORCEINLINE bool keeps(std::uint64_t key) {
    if (keep_all || key < threshold) return true;
    if (key != threshold || quota == 0) return false;
    --quota;
    return true;
  }
};

// The cut of a segment of n candidates whose keys are key[i * stride], given its capacity and
// `threshold`, the capacity-th smallest key (ignored when n <= capacity).
MRR_HOST_DEVICE inline SegmentCut cut_segment(const std::uint64_t* key, long stride, long n, long capacity,
                                              std::uint64_t threshold) {
  SegmentCut cut;
  if (n <= capacity) return cut;
  long below = 0;
  for (long i = 0; i < n; ++i) below += key[i * stride] < threshold ? 1 : 0;
  cut.threshold = threshold;
  cut.quota = capacity - below;
  cut.keep_all = false;
  return cut;
}

// The rank-th smallest (0-based) of n keys, without scratch or reordering: a most-significant-digit
// radix select, 8 passes of 8 bits, each counting the keys that share the prefix found so far. The
// selection of a thread that cannot call std::nth_element (a GPU thread); the same value.
MRR_HOST_DEVICE inline std::uint64_t select_key(const std::uint64_t* key, long n, long rank) {
  std::uint64_t prefix = 0, mask = 0;
  for (int shift = 56; shift >= 0; shift -= 8) {
    std::int32_t count[256];
    for (int b = 0; b < 256; ++b) count[b] = 0;
    for (long i = 0; i < n; ++i)
      if ((key[i] & mask) == prefix) ++count[(key[i] >> shift) & 255];
    int b = 0;
    while (rank >= count[b]) rank -= count[b++];
    prefix |= static_cast<std::uint64_t>(b) << shift;
    mask |= std::uint64_t(255) << shift;
  }
  return prefix;
}

// Selects with select_key (any thread); a CPU executor passes its own selection (std::nth_element
// on the scratch copy), which returns the same value.
struct RadixSelect {
  MRR_HOST_DEVICE std::uint64_t operator()(const std::uint64_t* key, long n, long rank, std::uint64_t*) const {
    return select_key(key, n, rank);
  }
};

// The cut of a segment of n keys (in token order) keeping `capacity`: select(key, n, rank,
// scratch) finds the rank-th smallest key (scratch: n keys it may use).
template <class Select>
MRR_HOST_DEVICE SegmentCut best_of_segment(const std::uint64_t* key, long n, long capacity, std::uint64_t* scratch,
                                           const Select& select) {
  const std::uint64_t threshold = n > capacity && capacity > 0 ? select(key, n, capacity - 1, scratch) : 0;
  return cut_segment(key, 1, n, capacity, threshold);
}

// Dense dropping of expert column e: every token competes (probs and map rows `probs_stride` and
// `map_stride` apart); the kept cells are marked in the dense [tokens, E] outputs when
// pad_to_capacity or routed (the outputs start zeroed). scratch: 2 * tokens keys.
template <class T, class Select>
MRR_HOST_DEVICE void keep_column(const T* probs, long probs_stride, const std::uint8_t* map, long map_stride,
                                 long tokens, int num_experts, int e, long capacity, bool by_probs,
                                 bool pad_to_capacity, std::uint64_t* scratch, T* out_probs, std::uint8_t* out_map,
                                 const Select& select) {
  std::uint64_t* key = scratch + tokens;
  for (long t = 0; t < tokens; ++t)
    key[t] = by_probs ? probs_key(probs[t * probs_stride + e]) : position_key(map[t * map_stride + e] != 0);
  SegmentCut cut = best_of_segment(key, tokens, capacity, scratch, select);
  for (long t = 0; t < tokens; ++t)
    if (cut.keeps(key[t]) && (pad_to_capacity || map[t * map_stride + e] != 0)) {
      out_map[t * num_experts + e] = 1;
      out_probs[t * num_experts + e] = probs[t * probs_stride + e];
    }
}

// Top-k dropping of one expert's rows [first, last) of the expert-major permutation (token order):
// slot_of_row maps a row to its slot t * k + j of the contiguous [tokens, k] weights and kept;
// kept[s] = 1 for the best `capacity` slots, else 0 with weight 0. scratch: 2 * (last - first) keys.
template <class T, class Index, class Select>
MRR_HOST_DEVICE void drop_segment(const Index* slot_of_row, long first, long last, long capacity, bool by_probs,
                                  T* weights, std::uint8_t* kept, std::uint64_t* scratch, const Select& select) {
  const long n = last - first;
  std::uint64_t* key = scratch + n;
  // position: every candidate is routed (one key), so the cut is the first `capacity` in token order.
  for (long i = 0; i < n; ++i) key[i] = by_probs ? probs_key(weights[slot_of_row[first + i]]) : position_key(true);
  SegmentCut cut = by_probs ? best_of_segment(key, n, capacity, scratch, select)
                            : cut_segment(key, 1, n, capacity, position_key(true));
  for (long i = 0; i < n; ++i) {
    const long s = static_cast<long>(slot_of_row[first + i]);
    const bool keep = cut.keeps(key[i]);
    kept[s] = keep ? 1 : 0;
    if (!keep) weights[s] = T(0);
  }
}

// The decision of an executor that sorted each segment best-first under the strict order (ties in
// token order): position `rank` of its segment is kept when rank < capacity.
MRR_HOST_DEVICE MRR_FORCEINLINE bool kept_at_rank(long rank, long capacity) { return rank < capacity; }

}  // namespace kernels
MRR_NAMESPACE_END
