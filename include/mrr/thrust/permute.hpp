// mrr-requires: mrr_thrust_omp
// Expert-major permutation of a top-k routing, permute, combine and their backward on a Thrust
// system (CUDA on a GPU, OpenMP in CI): the kernels of mrr/kernels/permute.hpp (the CPU's too)
// run as Thrust work items. Rows for expert 0 first, each expert's tokens in ascending token order
// (a counting sort of the slots by expert: count, scan, place; stable by construction); combine
// accumulates each token's k expert outputs in slot order, in Accum, so the result never depends
// on how rows were produced or arrived.
//
// Two faces. The views (DESIGN.md section 11) take the caller's memory: MatrixView pointers with
// extents and row strides, int32 or int64 ids (range-checked on the device: an int64 id of
// 2^32 + e is out of range, never e), outputs written into caller buffers, the caller's stream
// (Execution), workspace sized by permutation_workspace_bytes, and errors into a DeviceStatus the
// caller checks when it chooses (check_permutation synchronises and throws). Given its workspace,
// no call allocates. The Thrust-vector functions are a thin owning layer over the views.
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>
#include <mrr/kernels/permute.hpp>
#include <mrr/thrust/backend.hpp>
#include <mrr/thrust/execution.hpp>

#include <thrust/adjacent_difference.h>
#include <thrust/copy.h>
#include <thrust/for_each.h>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/sort.h>

#if THRUST_DEVICE_SYSTEM == THRUST_DEVICE_SYSTEM_CUDA
#include <cub/device/device_radix_sort.cuh>
#endif

#if THRUST_DEVICE_SYSTEM == THRUST_DEVICE_SYSTEM_OMP
#include <omp.h>
#endif

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <type_traits>

MRR_NAMESPACE_BEGIN
namespace device {

// The permutation in the caller's memory, for [tokens, k] slots (int32 indices: tokens * k < 2^31).
struct PermutationView {
  std::int32_t* source_token = nullptr;    // [tokens * k]: rows [0, expert_offsets[E]) are written
  std::int32_t* row_of_slot = nullptr;     // [tokens * k]: -1 for a dropped slot
  std::int32_t* expert_offsets = nullptr;  // [E + 1]: expert e's rows are [offsets[e], offsets[e + 1])
  long tokens = 0;
  int topk = 0, num_experts = 0;
};

// Per-work-item scratch of the counting sort lives on the thread's stack, so experts are bounded.
inline constexpr int kMaxPermuteExperts = 1024;

namespace kernels {

// Count, scan, place (kernels/permute.hpp) over chunks of slots; the histogram is expert-major
// [experts, chunks], so a chunk's first rows are a column of it.
template <class Id>
struct CountChunk {
  const Id* ids;
  const std::uint8_t* kept;
  std::int32_t* histogram;
  long* bad;  // [chunks] first out-of-range slot of the chunk, or -1
  long slots, chunk;
  int num_experts, chunks;
  MRR_HOST_DEVICE void operator()(int c) const {
    const long lo = c * chunk, hi = lo + chunk < slots ? lo + chunk : slots;
#if defined(__CUDA_ARCH__)
    bad[c] = mrr::kernels::count_experts(ids, kept, lo, hi, num_experts, histogram + c, chunks);
#else
    // CPU threads count in a private array: the expert-major histogram puts the counters of
    // neighbouring chunks in one cache line, and incrementing them in place from several threads
    // made 2 threads 2-3 x slower than 1 (measured: 4.5-6.7 ms against 1.9 ms).
    std::int32_t count[kMaxPermuteExperts];
    bad[c] = mrr::kernels::count_experts(ids, kept, lo, hi, num_experts, count, 1);
    for (int e = 0; e < num_experts; ++e) histogram[static_cast<long>(e) * chunks + c] = count[e];
#endif
  }
};

// Expert e's chunks, scanned in place; totals[e] = its rows.
struct ScanExpert {
  std::int32_t* histogram;
  std::int32_t* totals;
  long chunks;
  MRR_HOST_DEVICE void operator()(int e) const {
    totals[e] = static_cast<std::int32_t>(mrr::kernels::scan_histogram<std::int32_t, std::int32_t>(
        histogram + static_cast<long>(e) * chunks, 1, chunks, 0, 1, nullptr));
  }
};

// One work item: the experts' offsets from their totals, and the first bad slot into the status.
// After a bad id the offsets are all 0 (no rows), so a gather enqueued before the status is checked
// copies nothing.
struct FinishScan {
  std::int32_t* totals;
  std::int32_t* offsets;
  const long* bad;
  DeviceStatus* status;
  long chunks;
  int num_experts;
  MRR_HOST_DEVICE void operator()(int) const {
    mrr::kernels::scan_histogram(totals, num_experts, 1, 1, 1, offsets);
    for (long c = 0; c < chunks; ++c)
      if (bad[c] >= 0) {
        status->code = status_expert_out_of_range;
        status->index = bad[c];
        for (int e = 0; e <= num_experts; ++e)
          offsets[e] = 0;
        return;
      }
  }
};

template <class Id>
struct PlaceChunk {
  const Id* ids;
  const std::uint8_t* kept;
  const std::int32_t* histogram;  // scanned per expert
  const std::int32_t* offsets;
  std::int32_t* source_token;
  std::int32_t* row_of_slot;
  const DeviceStatus* status;
  long slots, chunk;
  int num_experts, chunks, k;
  MRR_HOST_DEVICE void operator()(int c) const {
    const long lo = c * chunk, hi = lo + chunk < slots ? lo + chunk : slots;
    if (status->code != status_ok) {  // a bad id has no row to go to: every slot is dropped
      for (long s = lo; s < hi; ++s)
        row_of_slot[s] = -1;
      return;
    }
    std::int32_t next[kMaxPermuteExperts];
    for (int e = 0; e < num_experts; ++e)
      next[e] = offsets[e] + histogram[static_cast<long>(e) * chunks + c];
    mrr::kernels::place_slots(ids, kept, lo, hi, k, next, 1, source_token, row_of_slot);
  }
};

// How work items cover rows. A CPU thread takes a whole row (one memcpy, one combine over
// kCombineColumns-column chunks). On a GPU an item is one copy unit of a gather (16 bytes when the
// rows allow it, else one element) or one column of a combine, so the threads of a warp touch
// neighbouring bytes of a row (coalesced) and there are rows x units items to spread over the SMs.
inline long pieces_per_row(long cols, bool host_system) {
  return host_system || cols == 0 ? 1 : cols;
}

// item -> (row, piece) for `pieces` pieces per row; 32-bit division when both fit (the common case:
// 64-bit division is a long software sequence on a GPU).
MRR_HOST_DEVICE MRR_FORCEINLINE void split_item(long item, long pieces, long& row, long& piece) {
  if (((static_cast<unsigned long>(item) | static_cast<unsigned long>(pieces)) >> 32) == 0) {
    const auto i = static_cast<unsigned>(item), n = static_cast<unsigned>(pieces), q = i / n;
    row = static_cast<long>(q);
    piece = static_cast<long>(i - q * n);
  } else {
    row = item / pieces;
    piece = item - row * pieces;
  }
}

MRR_HOST_DEVICE inline void piece_bounds(long item, long pieces, long cols, long& row, long& lo, long& hi) {
  long piece;
  split_item(item, pieces, row, piece);
  const long length = pieces == cols ? 1 : (cols + pieces - 1) / pieces;
  lo = piece * length;
  hi = lo + length < cols ? lo + length : cols;
}

// Sixteen bytes copied as one unit (one 128-bit load and store on a GPU): a gather's rows are
// reinterpreted as rows of these when their pointers, strides and widths are multiples of 16 bytes.
struct alignas(16) CopyUnit16 {
  std::uint32_t word[4];
};

// out[r] = tokens[source_token[r]] for the permutation's rows (r < offsets[E], read on the device),
// in copy units U (the element type, or CopyUnit16); strides and cols in units.
template <class U>
struct GatherRows {
  const U* tokens;
  long tokens_stride;
  const std::int32_t* source_token;
  const std::int32_t* rows;  // &expert_offsets[E]
  U* out;
  long out_stride, cols, pieces;
  MRR_HOST_DEVICE void operator()(long item) const {
    long r, lo, hi;
    piece_bounds(item, pieces, cols, r, lo, hi);
    if (r >= *rows) return;
    mrr::kernels::copy_row(out + r * out_stride, tokens + static_cast<long>(source_token[r]) * tokens_stride, lo, hi);
  }
};

// out[t] = sum_j weights[t, j] * rows[row_of_slot[t, j]] (weight 1 when weights is null), Columns
// columns accumulated at a time.
template <class T, class W, class Accum, long Columns>
struct CombineRows {
  const T* rows;
  long rows_stride;
  const std::int32_t* row_of_slot;
  const W* weights;
  long weights_stride;
  T* out;
  long out_stride, cols, pieces;
  int k;
  MRR_HOST_DEVICE void operator()(long item) const {
    long t, lo, hi;
    piece_bounds(item, pieces, cols, t, lo, hi);
    mrr::kernels::combine_row<T, W, std::int32_t, Accum, Columns>(
        rows, rows_stride, row_of_slot + t * k, weights != nullptr ? weights + t * weights_stride : nullptr, k, nullptr,
        out + t * out_stride, lo, hi);
  }
};

template <class T, class W, class Accum>
struct CombineBackwardRows {
  const T* grad_out;
  long grad_out_stride;
  const T* rows;
  long rows_stride;
  const std::int32_t* row_of_slot;
  const W* weights;
  long weights_stride;
  T* grad_rows;
  long grad_rows_stride;
  W* grad_weights;
  long grad_weights_stride;
  long cols;
  int k;
  MRR_HOST_DEVICE void operator()(long t) const {
    mrr::kernels::combine_backward_row<T, W, std::int32_t, Accum>(
        grad_out + t * grad_out_stride, cols, rows, rows_stride, row_of_slot + t * k, weights + t * weights_stride, k,
        grad_rows, grad_rows_stride, grad_weights != nullptr ? grad_weights + t * grad_weights_stride : nullptr);
  }
};

// ---- The permutation as a stable radix sort of slot keys (a GPU's algorithm) ----
// Slot s gets the key id (dispatched), E (dropped) or E + 1 (id out of range). A stable sort of
// (key, slot) lists the dispatched slots expert by expert, each expert's slots (so tokens) in
// ascending order: the counting sort's permutation, bit for bit. The dropped slots follow, then the
// bad ones, the first of them the lowest bad slot (what the status reports).
template <class Id>
struct SlotKeys {
  const Id* ids;
  const std::uint8_t* kept;
  std::uint16_t* keys;
  std::int32_t* slot;
  int num_experts;
  MRR_HOST_DEVICE void operator()(long s) const {
    const Id e = ids[s];
    const bool in_range = mrr::kernels::expert_in_range(e, num_experts);
    const int key = !in_range ? num_experts + 1 : (kept != nullptr && kept[s] == 0) ? num_experts : static_cast<int>(e);
    keys[s] = static_cast<std::uint16_t>(key);
    slot[s] = static_cast<std::int32_t>(s);
  }
};

// bounds[e] = the first sorted position whose key is >= e, for e in [0, E + 1]: item r in
// [0, slots] writes the e in (key[r - 1], key[r]] (keys past the end count as E + 2), so every e
// is written once, with no search.
struct KeyBounds {
  const std::uint16_t* keys;  // sorted
  std::int32_t* bounds;       // [E + 2]
  long slots;
  int last;  // E + 1
  MRR_HOST_DEVICE void operator()(long r) const {
    const int before = r == 0 ? -1 : static_cast<int>(keys[r - 1]);
    const int at = r == slots ? last : static_cast<int>(keys[r]);
    for (int e = before + 1; e <= at; ++e)
      bounds[e] = static_cast<std::int32_t>(r);
  }
};

// offsets[e] = bounds[e] for e <= E (offsets[E]: the dispatched rows), all 0 after a bad id; item
// E + 1 reports the first bad slot, if any.
struct FinishSorted {
  const std::int32_t* bounds;
  const std::int32_t* sorted_slot;
  std::int32_t* offsets;
  DeviceStatus* status;
  long slots;
  int num_experts;
  MRR_HOST_DEVICE void operator()(int e) const {
    if (e <= num_experts) {
      offsets[e] = bounds[num_experts + 1] < slots ? 0 : bounds[e];
    } else if (bounds[e] < slots) {
      status->code = status_expert_out_of_range;
      status->index = sorted_slot[bounds[e]];
    }
  }
};

// Sorted position r: a dispatched slot's row (source_token, row_of_slot), or a dropped slot's -1.
// After a bad id every slot is dropped (-1) and no row is written.
struct PlaceSorted {
  const std::int32_t* sorted_slot;
  const std::int32_t* bounds;
  std::int32_t* source_token;
  std::int32_t* row_of_slot;
  long slots;
  int num_experts, k;
  MRR_HOST_DEVICE void operator()(long r) const {
    const std::int32_t s = sorted_slot[r];
    if (bounds[num_experts + 1] < slots) {  // a bad id (the status says which)
      row_of_slot[s] = -1;
      return;
    }
    if (r < bounds[num_experts]) {
      source_token[r] = s / k;
      row_of_slot[s] = static_cast<std::int32_t>(r);
    } else {
      row_of_slot[s] = -1;
    }
  }
};

}  // namespace kernels

// Chunks of the counting sort: 128 on CPU threads (long sequential runs, a few per thread on up to
// 32 threads), whatever the thread count, so that the workspace a caller sized once still fits
// after omp_set_num_threads; or one per 256 slots on a GPU (many independent work items).
inline int permutation_chunks(long slots) {
#if THRUST_DEVICE_SYSTEM == THRUST_DEVICE_SYSTEM_OMP
  const long wanted = 128;
#else
  const long wanted = (slots + 255) / 256;
#endif
  const long at_least_1k = (slots + 1023) / 1024;  // never chunks so small the histogram dominates
  const long chunks = wanted < at_least_1k ? wanted : at_least_1k;
  return static_cast<int>(chunks < 1 ? 1 : chunks);
}

// How the expert-major permutation is computed; both give the same bits. `counting`: count, scan,
// place over chunks of slots (long sequential runs: CPU threads). `radix_sort`: a stable radix sort
// of the slots' expert keys (CUB's on CUDA, the GPU's default; thrust::stable_sort_by_key on other
// systems, where it exists to test the path on CPU threads).
enum class PermutationAlgorithm { automatic, counting, radix_sort };

inline constexpr PermutationAlgorithm resolve(PermutationAlgorithm a, bool host_system) {
  if (a != PermutationAlgorithm::automatic) return a;
  return THRUST_DEVICE_SYSTEM == THRUST_DEVICE_SYSTEM_CUDA && !host_system ? PermutationAlgorithm::radix_sort
                                                                           : PermutationAlgorithm::counting;
}

namespace detail {

// Bits of the radix sort's keys: ids up to E + 1.
inline int permutation_key_bits(int num_experts) {
  int bits = 1;
  while ((1 << bits) <= num_experts + 1)
    ++bits;
  return bits;
}

// Temporary bytes of the sort itself for n slots: CUB's query on CUDA; on other systems a bound on
// what thrust::stable_sort_by_key asks of the arena (a few copies of keys and slots).
inline std::size_t permutation_sort_bytes(long n, int num_experts) {
#if THRUST_DEVICE_SYSTEM == THRUST_DEVICE_SYSTEM_CUDA
  std::size_t bytes = 0;
  const cudaError_t e = cub::DeviceRadixSort::SortPairs(
      nullptr, bytes, static_cast<const std::uint16_t*>(nullptr), static_cast<std::uint16_t*>(nullptr),
      static_cast<const std::int32_t*>(nullptr), static_cast<std::int32_t*>(nullptr), static_cast<int>(n), 0,
      permutation_key_bits(num_experts));
  if (e != cudaSuccess)
    throw std::runtime_error(mrr::detail::str("mrr::device::permutation_workspace_bytes: ", cudaGetErrorString(e)));
  return bytes;
#else
  (void)num_experts;
  return 4 * static_cast<std::size_t>(n) * (sizeof(std::uint16_t) + sizeof(std::int32_t)) + (std::size_t(1) << 20);
#endif
}

}  // namespace detail

// Workspace of make_expert_permutation for [tokens, topk] slots over num_experts experts.
inline std::size_t permutation_workspace_bytes(long tokens, int topk, int num_experts,
                                               PermutationAlgorithm algorithm = PermutationAlgorithm::automatic,
                                               bool host_system = false) {
  const auto slots = static_cast<std::size_t>(tokens) * static_cast<std::size_t>(topk);
  const auto experts = static_cast<std::size_t>(num_experts);
  const auto chunks = static_cast<std::size_t>(permutation_chunks(tokens * topk));
  const std::size_t counting = detail::workspace_array_bytes<std::int32_t>(experts * chunks) +
                               detail::workspace_array_bytes<long>(chunks) +
                               detail::workspace_array_bytes<std::int32_t>(experts);
  if (resolve(algorithm, host_system) != PermutationAlgorithm::radix_sort) return counting;
  const std::size_t sorted = 2 * detail::workspace_array_bytes<std::uint16_t>(slots) +
                             2 * detail::workspace_array_bytes<std::int32_t>(slots) +
                             detail::workspace_array_bytes<std::int32_t>(experts + 3) +
                             detail::align_up(detail::permutation_sort_bytes(static_cast<long>(slots), num_experts));
  return sorted > counting ? sorted : counting;  // no tokens: the counting path runs
}

namespace detail {

inline void require_permutation(const PermutationView& p, const char* fn) {
  mrr::detail::require(p.tokens >= 0 && p.topk > 0, fn, "the permutation needs tokens >= 0 and topk > 0, got ",
                       p.tokens, " and ", p.topk);
  mrr::detail::require(p.num_experts > 0 && p.num_experts <= kMaxPermuteExperts, fn, "num_experts=", p.num_experts,
                       " outside the device limit [1, ", kMaxPermuteExperts, "]");
  mrr::detail::require(static_cast<std::size_t>(p.tokens) * static_cast<std::size_t>(p.topk) < (std::size_t(1) << 31),
                       fn, "tokens * k = ", p.tokens * p.topk, " exceeds the int32 row index");
  mrr::detail::require(p.expert_offsets != nullptr && (p.tokens == 0 || (p.source_token && p.row_of_slot)), fn,
                       "the permutation's arrays are null");
}

// The radix-sort permutation (PermutationAlgorithm::radix_sort) on any Thrust policy.
template <class Policy, class Id>
void expert_permutation_sorted(const Policy& policy, const Id* ids, const std::uint8_t* kept, const PermutationView& p,
                               WorkspaceArena& arena, DeviceStatus* status, stream_t stream) {
  const long slots = p.tokens * p.topk;
  const auto n = static_cast<std::size_t>(slots);
  auto* keys = arena.take<std::uint16_t>(n);
  auto* sorted_keys = arena.take<std::uint16_t>(n);
  auto* slot = arena.take<std::int32_t>(n);
  auto* sorted_slot = arena.take<std::int32_t>(n);
  auto* bounds = arena.take<std::int32_t>(static_cast<std::size_t>(p.num_experts) + 3);
  using thrust::counting_iterator;
  thrust::for_each(policy, counting_iterator<long>(0), counting_iterator<long>(slots),
                   device::kernels::SlotKeys<Id>{ids, kept, keys, slot, p.num_experts});
#if THRUST_DEVICE_SYSTEM == THRUST_DEVICE_SYSTEM_CUDA
  std::size_t bytes = permutation_sort_bytes(slots, p.num_experts);
  void* temp = arena.take<unsigned char>(bytes);
  const cudaError_t e =
      cub::DeviceRadixSort::SortPairs(temp, bytes, keys, sorted_keys, slot, sorted_slot, static_cast<int>(slots), 0,
                                      permutation_key_bits(p.num_experts), stream);
  if (e != cudaSuccess)
    throw std::runtime_error(mrr::detail::str("mrr::device::make_expert_permutation: ", cudaGetErrorString(e)));
#else
  (void)stream;
  thrust::copy(policy, keys, keys + slots, sorted_keys);
  thrust::copy(policy, slot, slot + slots, sorted_slot);
  thrust::stable_sort_by_key(policy, sorted_keys, sorted_keys + slots, sorted_slot);
#endif
  thrust::for_each(policy, counting_iterator<long>(0), counting_iterator<long>(slots + 1),
                   device::kernels::KeyBounds{sorted_keys, bounds, slots, p.num_experts + 1});
  thrust::for_each(policy, counting_iterator<int>(0), counting_iterator<int>(p.num_experts + 2),
                   device::kernels::FinishSorted{bounds, sorted_slot, p.expert_offsets, status, slots, p.num_experts});
  thrust::for_each(
      policy, counting_iterator<long>(0), counting_iterator<long>(slots),
      device::kernels::PlaceSorted{sorted_slot, bounds, p.source_token, p.row_of_slot, slots, p.num_experts, p.topk});
}

// The counting sort on any Thrust policy, or the radix sort where `algorithm` resolves to it; ids
// [tokens, k] contiguous, kept null or [tokens * k]. `host`: the policy runs on the host
// (a CUDA build's host backend), which never takes CUB's path.
template <class Policy, class Id>
void expert_permutation(const Policy& policy, const Id* ids, const std::uint8_t* kept, const PermutationView& p,
                        WorkspaceArena& arena, DeviceStatus* status, stream_t stream = nullptr,
                        PermutationAlgorithm algorithm = PermutationAlgorithm::automatic, bool host = false) {
  if (resolve(algorithm, host) == PermutationAlgorithm::radix_sort && p.tokens > 0) {
    expert_permutation_sorted(policy, ids, kept, p, arena, status, stream);
    return;
  }
  const long slots = p.tokens * p.topk;
  const int chunks = permutation_chunks(slots);
  const long chunk = (slots + chunks - 1) / chunks;
  auto* histogram = arena.take<std::int32_t>(static_cast<std::size_t>(p.num_experts) * chunks);
  auto* bad = arena.take<long>(static_cast<std::size_t>(chunks));
  auto* totals = arena.take<std::int32_t>(static_cast<std::size_t>(p.num_experts));
  using thrust::counting_iterator;
  thrust::for_each(policy, counting_iterator<int>(0), counting_iterator<int>(chunks),
                   device::kernels::CountChunk<Id>{ids, kept, histogram, bad, slots, chunk, p.num_experts, chunks});
  thrust::for_each(policy, counting_iterator<int>(0), counting_iterator<int>(p.num_experts),
                   device::kernels::ScanExpert{histogram, totals, chunks});
  thrust::for_each(policy, counting_iterator<int>(0), counting_iterator<int>(1),
                   device::kernels::FinishScan{totals, p.expert_offsets, bad, status, chunks, p.num_experts});
  thrust::for_each(policy, counting_iterator<int>(0), counting_iterator<int>(chunks),
                   device::kernels::PlaceChunk<Id>{ids, kept, histogram, p.expert_offsets, p.source_token,
                                                   p.row_of_slot, status, slots, chunk, p.num_experts, chunks,
                                                   p.topk});
}

template <class Policy, class T, class W, class Accum>
void combine_rows(const Policy& policy, MatrixView<const T> rows, MatrixView<const W> weights,
                  const PermutationView& p, MatrixView<T> out, bool host_system) {
  const long pieces = device::kernels::pieces_per_row(out.cols, host_system);
  const auto items = [&](auto kernel) {
    thrust::for_each(policy, thrust::counting_iterator<long>(0), thrust::counting_iterator<long>(p.tokens * pieces),
                     kernel);
  };
  if (host_system)
    items(device::kernels::CombineRows<T, W, Accum, mrr::kernels::kCombineColumns>{
        rows.data, rows.row_stride, p.row_of_slot, weights.data, weights.row_stride, out.data, out.row_stride, out.cols,
        pieces, p.topk});
  else
    items(device::kernels::CombineRows<T, W, Accum, 1>{rows.data, rows.row_stride, p.row_of_slot, weights.data,
                                                       weights.row_stride, out.data, out.row_stride, out.cols, pieces,
                                                       p.topk});
}

// Whether rows of T at `data` with `row_stride` and `cols` can be copied in 16-byte units.
template <class T>
bool copies_in_16_bytes(const T* data, long row_stride, long cols) {
  return 16 % sizeof(T) == 0 && reinterpret_cast<std::uintptr_t>(data) % 16 == 0 &&
         (static_cast<std::size_t>(row_stride) * sizeof(T)) % 16 == 0 &&
         (static_cast<std::size_t>(cols) * sizeof(T)) % 16 == 0;
}

// out[r] = tokens[source_token[r]] for r < p's rows (read on the device), out having room for
// tokens * k rows; in 16-byte units on a GPU when both matrices allow it.
template <class Policy, class T>
void gather_rows(const Policy& policy, MatrixView<const T> tokens, const PermutationView& p, MatrixView<T> out,
                 bool host_system) {
  const long slots = p.tokens * p.topk;
  const std::int32_t* rows = p.expert_offsets + p.num_experts;
  if (!host_system && copies_in_16_bytes(tokens.data, tokens.row_stride, tokens.cols) &&
      copies_in_16_bytes<T>(out.data, out.row_stride, out.cols)) {
    using U = device::kernels::CopyUnit16;
    constexpr long per = static_cast<long>(sizeof(U) / sizeof(T));
    const long cols = tokens.cols / per;
    thrust::for_each(
        policy, thrust::counting_iterator<long>(0), thrust::counting_iterator<long>(slots * cols),
        device::kernels::GatherRows<U>{reinterpret_cast<const U*>(tokens.data), tokens.row_stride / per, p.source_token,
                                       rows, reinterpret_cast<U*>(out.data), out.row_stride / per, cols, cols});
    return;
  }
  const long pieces = device::kernels::pieces_per_row(tokens.cols, host_system);
  thrust::for_each(policy, thrust::counting_iterator<long>(0), thrust::counting_iterator<long>(slots * pieces),
                   device::kernels::GatherRows<T>{tokens.data, tokens.row_stride, p.source_token, rows, out.data,
                                                  out.row_stride, tokens.cols, pieces});
}

inline constexpr bool host_system = THRUST_DEVICE_SYSTEM != THRUST_DEVICE_SYSTEM_CUDA;

}  // namespace detail

// ---- Views: the caller's memory, stream and workspace ----

// The permutation of ids [tokens, k] (int32 or int64, contiguous rows: a strided id matrix is an
// error) into p; kept (null, or [tokens * k] 0/1) leaves dropped slots out. An id outside
// [0, num_experts) sets *status (status_expert_out_of_range, index = the first such slot) and
// leaves p inert: no rows (expert_offsets all 0) and every slot dropped (row_of_slot -1), so a
// permute or combine enqueued before the status is checked reads nothing outside its inputs (the
// combine writes zeros). Enqueued on x.stream; nothing waits. The workspace is
// permutation_workspace_bytes(tokens, k, E, algorithm) bytes.
template <class Id>
void make_expert_permutation(MatrixView<const Id> ids, const std::uint8_t* kept, const PermutationView& p,
                             Workspace workspace, DeviceStatus* status, Execution x = {},
                             PermutationAlgorithm algorithm = PermutationAlgorithm::automatic) {
  static_assert(std::is_same_v<Id, std::int32_t> || std::is_same_v<Id, std::int64_t>,
                "device::make_expert_permutation takes int32 or int64 expert ids");
  constexpr const char* fn = "device::make_expert_permutation";
  detail::require_permutation(p, fn);
  detail::require_view(ids, p.tokens, p.topk, fn, "ids");
  mrr::detail::require(ids.row_stride == ids.cols, fn, "'ids' rows must be contiguous (row stride ", ids.row_stride,
                       " for ", ids.cols, " ids); copy them first");
  mrr::detail::require(status != nullptr, fn, "the status pointer is null");
  detail::WorkspaceArena arena(workspace, permutation_workspace_bytes(p.tokens, p.topk, p.num_experts, algorithm), fn);
  auto alloc = arena.temporary_allocator();
  detail::reset_status(status, x);
  detail::expert_permutation(detail::execution_policy(x, alloc), ids.data, kept, p, arena, status, x.stream, algorithm);
}

namespace detail {

inline void throw_on_status(const DeviceStatus& s, const PermutationView& p,
                            const char* fn = "device::make_expert_permutation") {
  if (s.code == status_expert_out_of_range)
    mrr::detail::throw_invalid_argument(fn, "token ", s.index / p.topk, " slot ", s.index % p.topk,
                                        " has an expert id outside [0, ", p.num_experts, ")");
  if (s.code == status_repeated_expert)
    mrr::detail::throw_invalid_argument(fn, "token ", s.index / p.topk, " slot ", s.index % p.topk,
                                        " repeats an expert id of its row (a token holds one place of an expert "
                                        "at most)");
  mrr::detail::require(s.code == status_ok, fn, "unknown device status ", s.code);
}

}  // namespace detail

// Synchronises x.stream and throws if the permutation met a bad id (the checking convenience;
// also reads drop_over_capacity's status, whose ids may repeat an expert within a row).
inline void check_permutation(const DeviceStatus* status, const PermutationView& p, Execution x = {}) {
  detail::throw_on_status(read_status(status, x), p);
}

// out[r] = tokens[source_token[r]] for the permutation's rows; out has room for tokens * k rows
// (rows past the permutation's count are left as they are).
template <class T>
void permute_tokens(MatrixView<const T> tokens, const PermutationView& p, MatrixView<T> out, Execution x = {}) {
  constexpr const char* fn = "device::permute_tokens";
  detail::require_permutation(p, fn);
  detail::require_view(tokens, p.tokens, tokens.cols, fn, "tokens");
  detail::require_view(out, p.tokens * p.topk, tokens.cols, fn, "out");
  detail::require_disjoint(out, tokens, fn, "out", "tokens");
  detail::WorkspaceArena arena({}, 0, fn);
  auto alloc = arena.temporary_allocator();
  detail::gather_rows(detail::execution_policy(x, alloc), tokens, p, out, detail::host_system);
}

// out[t] = sum_j weights[t, j] * expert_out[row_of_slot[t, j]], in slot order, in Accum.
template <class T, class W, class Accum = mrr::kernels::accum_t<T>>
void combine(MatrixView<const T> expert_out, MatrixView<const W> weights, const PermutationView& p,
             MatrixView<T> out, Execution x = {}) {
  constexpr const char* fn = "device::combine";
  detail::require_permutation(p, fn);
  detail::require_view(expert_out, p.tokens * p.topk, expert_out.cols, fn, "expert_out");
  detail::require_view(weights, p.tokens, p.topk, fn, "weights");
  detail::require_view(out, p.tokens, expert_out.cols, fn, "out");
  detail::require_disjoint(out, expert_out, fn, "out", "expert_out");
  detail::require_disjoint(out, weights, fn, "out", "weights");
  detail::WorkspaceArena arena({}, 0, fn);
  auto alloc = arena.temporary_allocator();
  detail::combine_rows<decltype(detail::execution_policy(x, alloc)), T, W, Accum>(
      detail::execution_policy(x, alloc), expert_out, weights, p, out, detail::host_system);
}

// Backward of permute_tokens: grad_tokens[t] = sum over t's kept slots, in slot order, of
// grad_permuted[row_of_slot[t, j]] (in Accum); a token with every slot dropped gets zeros.
template <class T, class Accum = mrr::kernels::accum_t<T>>
void permute_tokens_backward(MatrixView<const T> grad_permuted, const PermutationView& p, MatrixView<T> grad_tokens,
                             Execution x = {}) {
  constexpr const char* fn = "device::permute_tokens_backward";
  detail::require_permutation(p, fn);
  detail::require_view(grad_permuted, p.tokens * p.topk, grad_permuted.cols, fn, "grad_permuted");
  detail::require_view(grad_tokens, p.tokens, grad_permuted.cols, fn, "grad_tokens");
  detail::require_disjoint(grad_tokens, grad_permuted, fn, "grad_tokens", "grad_permuted");
  detail::WorkspaceArena arena({}, 0, fn);
  auto alloc = arena.temporary_allocator();
  const MatrixView<const T> no_weights{nullptr, p.tokens, p.topk, p.topk};
  detail::combine_rows<decltype(detail::execution_policy(x, alloc)), T, T, Accum>(
      detail::execution_policy(x, alloc), grad_permuted, no_weights, p, grad_tokens, detail::host_system);
}

// Backward of combine for the upstream gradient grad_out [tokens, hidden]: grad_expert_out[r] =
// weights[t, j] * grad_out[t] at r = row_of_slot[t, j], and grad_weights[t, j] =
// <grad_out[t], expert_out[r]> (0 for a dropped slot; grad_weights.data may be null).
template <class T, class W, class Accum = mrr::kernels::accum_t<T>>
void combine_backward(MatrixView<const T> grad_out, MatrixView<const T> expert_out, MatrixView<const W> weights,
                      const PermutationView& p, MatrixView<T> grad_expert_out, MatrixView<W> grad_weights,
                      Execution x = {}) {
  constexpr const char* fn = "device::combine_backward";
  detail::require_permutation(p, fn);
  detail::require_view(expert_out, p.tokens * p.topk, expert_out.cols, fn, "expert_out");
  detail::require_view(grad_out, p.tokens, expert_out.cols, fn, "grad_out");
  detail::require_view(weights, p.tokens, p.topk, fn, "weights");
  detail::require_view(grad_expert_out, p.tokens * p.topk, expert_out.cols, fn, "grad_expert_out");
  if (grad_weights.data != nullptr) detail::require_view(grad_weights, p.tokens, p.topk, fn, "grad_weights");
  detail::require_disjoint(grad_expert_out, grad_out, fn, "grad_expert_out", "grad_out");
  detail::require_disjoint(grad_expert_out, expert_out, fn, "grad_expert_out", "expert_out");
  detail::require_disjoint(grad_expert_out, weights, fn, "grad_expert_out", "weights");
  detail::require_disjoint(grad_weights, grad_out, fn, "grad_weights", "grad_out");
  detail::require_disjoint(grad_weights, expert_out, fn, "grad_weights", "expert_out");
  detail::require_disjoint(grad_weights, weights, fn, "grad_weights", "weights");
  detail::WorkspaceArena arena({}, 0, fn);
  auto alloc = arena.temporary_allocator();
  thrust::for_each(detail::execution_policy(x, alloc), thrust::counting_iterator<long>(0),
                   thrust::counting_iterator<long>(p.tokens),
                   kernels::CombineBackwardRows<T, W, Accum>{grad_out.data, grad_out.row_stride, expert_out.data,
                                                             expert_out.row_stride, p.row_of_slot, weights.data,
                                                             weights.row_stride, grad_expert_out.data,
                                                             grad_expert_out.row_stride, grad_weights.data,
                                                             grad_weights.row_stride, expert_out.cols, p.topk});
}

// ---- The owning layer: Thrust vectors of the backend's system, over the same kernels ----

// Where every (token, slot) goes in the expert-major order (int32 indices: tokens * k < 2^31).
template <class Backend = ThrustDeviceBackend>
struct ExpertPermutation {
  typename Backend::template vector<std::int32_t> source_token;   // [rows]
  typename Backend::template vector<std::int32_t> expert_offsets;  // [experts + 1]; tokens_per_expert = diff
  typename Backend::template vector<std::int32_t> row_of_slot;     // [tokens, k]
  long tokens = 0;
  int topk = 0;
  long rows() const { return static_cast<long>(source_token.size()); }
  PermutationView view() const {
    auto* self = const_cast<ExpertPermutation*>(this);  // views carry mutable pointers; nothing is written
    return {raw(self->source_token), raw(self->row_of_slot), raw(self->expert_offsets), tokens, topk,
            static_cast<int>(expert_offsets.size()) - 1};
  }
};

// The permutation of ids [tokens, k] (int32, every slot dispatched). Experts <= 1024.
template <class Backend = ThrustDeviceBackend>
ExpertPermutation<Backend> make_expert_permutation(const typename Backend::template vector<std::int32_t>& ids,
                                                   long tokens, int topk, int num_experts) {
  constexpr const char* fn = "device::make_expert_permutation";
  const auto slots = static_cast<std::size_t>(tokens) * static_cast<std::size_t>(topk);
  mrr::detail::require(ids.size() == slots, fn, "'ids' has ", ids.size(), " values, expected [", tokens, ", ", topk,
                       "]");
  ExpertPermutation<Backend> p;
  p.tokens = tokens;
  p.topk = topk;
  p.source_token.resize(slots);
  p.row_of_slot.resize(slots);
  p.expert_offsets.resize(static_cast<std::size_t>(num_experts > 0 ? num_experts : 0) + 1);
  PermutationView v = p.view();
  v.num_experts = num_experts;
  detail::require_permutation(v, fn);
  constexpr auto algorithm = PermutationAlgorithm::automatic;
  const std::size_t bytes = permutation_workspace_bytes(tokens, topk, num_experts, algorithm, !Backend::is_device);
  const detail::OwnedWorkspace<decltype(Backend::policy())> workspace(Backend::policy(), bytes);
  typename Backend::template vector<DeviceStatus> status(1);
  detail::WorkspaceArena arena(workspace.get(), bytes, fn);
  detail::expert_permutation(Backend::policy(), raw(ids), static_cast<const std::uint8_t*>(nullptr), v, arena,
                             raw(status), nullptr, algorithm, !Backend::is_device);
  detail::throw_on_status(status[0], v);
  return p;
}

// Tokens per expert, from the offsets.
template <class Backend>
typename Backend::template vector<std::int32_t> tokens_per_expert(const ExpertPermutation<Backend>& p) {
  typename Backend::template vector<std::int32_t> counts(p.expert_offsets.size());
  thrust::adjacent_difference(Backend::policy(), p.expert_offsets.begin(), p.expert_offsets.end(), counts.begin());
  counts.erase(counts.begin());
  return counts;
}

// tokens [tokens, hidden] -> out [rows, hidden], expert-major, into a buffer the caller keeps
// across steps (a fresh Thrust vector is zero-filled first: one more write of the whole output).
template <class T, class Backend = ThrustDeviceBackend>
void permute_tokens(const typename Backend::template vector<T>& tokens, long hidden, const ExpertPermutation<Backend>& p,
                    typename Backend::template vector<T>& out) {
  mrr::detail::require(tokens.size() == static_cast<std::size_t>(p.tokens * hidden), "device::permute_tokens",
                       "'tokens' has ", tokens.size(), " values, expected [", p.tokens, ", ", hidden, "]");
  if (out.size() != static_cast<std::size_t>(p.rows() * hidden)) out.resize(static_cast<std::size_t>(p.rows() * hidden));
  const PermutationView v = p.view();
  detail::gather_rows(Backend::policy(), MatrixView<const T>{raw(tokens), p.tokens, hidden, hidden}, v,
                      MatrixView<T>{raw(out), p.rows(), hidden, hidden}, !Backend::is_device);
}

// tokens [tokens, hidden] -> [rows, hidden], expert-major.
template <class T, class Backend = ThrustDeviceBackend>
typename Backend::template vector<T> permute_tokens(const typename Backend::template vector<T>& tokens, long hidden,
                                                    const ExpertPermutation<Backend>& p) {
  typename Backend::template vector<T> out;
  permute_tokens<T, Backend>(tokens, hidden, p, out);
  return out;
}

// out[t] = sum_j weights[t, j] * expert_out[row_of_slot[t, j]] in slot order, accumulated in Accum.
template <class T, class Backend = ThrustDeviceBackend, class Accum = mrr::kernels::accum_t<T>>
typename Backend::template vector<T> combine(const typename Backend::template vector<T>& expert_out, long hidden,
                                             const typename Backend::template vector<T>& weights,
                                             const ExpertPermutation<Backend>& p) {
  mrr::detail::require(expert_out.size() == static_cast<std::size_t>(p.rows() * hidden), "device::combine",
                       "'expert_out' has ", expert_out.size(), " values, expected [", p.rows(), ", ", hidden, "]");
  mrr::detail::require(weights.size() == p.row_of_slot.size(), "device::combine", "'weights' has ", weights.size(),
                       " values, expected [", p.tokens, ", ", p.topk, "]");
  typename Backend::template vector<T> out(static_cast<std::size_t>(p.tokens * hidden));
  detail::combine_rows<decltype(Backend::policy()), T, T, Accum>(
      Backend::policy(), MatrixView<const T>{raw(expert_out), p.rows(), hidden, hidden},
      MatrixView<const T>{raw(weights), p.tokens, p.topk, p.topk}, p.view(),
      MatrixView<T>{raw(out), p.tokens, hidden, hidden}, !Backend::is_device);
  return out;
}

}  // namespace device
MRR_NAMESPACE_END
