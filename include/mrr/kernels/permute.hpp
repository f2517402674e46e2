// The expert-major permutation of a top-k routing, the row copies that apply it, and combine
// (DESIGN.md section 6), written once for every executor (the CPU's thread tiles, Thrust on any
// system, CUDA kernels). Plain MRR_HOST_DEVICE code over raw pointers, extents and row strides;
// failures come back as values, never exceptions.
//
// The permutation is a counting sort of the slots (t * k + j) by expert, stable by construction:
// the slots are cut into chunks, each chunk counts its experts (count_experts), one exclusive scan
// of the expert-major histogram [experts, chunks] gives every (expert, chunk) its first row, and
// each chunk places its slots in slot order (place_slots). So each expert's rows are its tokens
// in ascending order (Megatron's permute), whatever the chunking: executors choose chunks for
// their hardware and every choice gives the same bits.
//
// Combine accumulates a token's k expert outputs in slot order in Accum (fp32 at least), so the
// output and every gradient are independent of how rows were produced or arrived.
#pragma once

#include <mrr/detail/config.hpp>

#include <array>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

MRR_NAMESPACE_BEGIN
namespace kernels {

// fp32 accumulation for narrower types (bf16, fp16), the type itself otherwise.
template <class T>
using accum_t = std::conditional_t<(sizeof(T) < sizeof(float)), float, T>;

// An id in [0, n): one unsigned compare, which also rejects negative ids of any signed type.
template <class Id>
MRR_HOST_DEVICE MRR_FORCEINLINE bool expert_in_range(Id e, int n) {
  return static_cast<std::uint64_t>(static_cast<std::int64_t>(e)) < static_cast<std::uint64_t>(n);
}

// Counts the dispatched slots (kept[s] != 0, or all when kept is null) of [lo, hi) per expert into
// count[e * stride], zeroed first. Returns the first slot whose id is outside [0, num_experts)
// (kept or not: a bad id is an error wherever it is), or -1.
template <class Id, class Index>
MRR_HOST_DEVICE long count_experts(const Id* ids, const std::uint8_t* kept, long lo, long hi, int num_experts,
                                   Index* count, long stride) {
  for (int e = 0; e < num_experts; ++e) count[e * stride] = 0;
  long bad = -1;
  for (long s = lo; s < hi; ++s) {
    const Id e = ids[s];
    const bool in_range = expert_in_range(e, num_experts);
    if (!in_range && bad < 0) bad = s;
    // Branch-free: an out-of-range or dropped slot adds 0 to expert 0.
    const bool take = in_range && (kept == nullptr || kept[s] != 0);
    count[(take ? static_cast<long>(e) : 0L) * stride] += take ? 1 : 0;
  }
  return bad;
}

// Places the slots of [lo, hi) (ids already checked): next[e * stride] is expert e's next row and
// advances; row_of_slot[s] = -1 for a dropped slot.
template <class Id, class Index>
MRR_HOST_DEVICE void place_slots(const Id* ids, const std::uint8_t* kept, long lo, long hi, int k, Index* next,
                                 long stride, Index* source_token, Index* row_of_slot) {
  for (long s = lo; s < hi; ++s) {
    if (kept != nullptr && kept[s] == 0) {
      row_of_slot[s] = Index(-1);
      continue;
    }
    const Index r = next[static_cast<long>(ids[s]) * stride]++;
    source_token[r] = static_cast<Index>(s / k);
    row_of_slot[s] = r;
  }
}

// Exclusive scan, in expert-major order, of the histogram whose (expert e, chunk c) count is
// histogram[e * expert_stride + c * chunk_stride], in place; offsets[e] (experts + 1 entries, may
// be null) = expert e's first row. Returns the number of rows. Serial: the CPU executor's scan (a
// Thrust executor scans with its own algorithm and takes expert_offset below).
template <class Index, class Offset>
MRR_HOST_DEVICE long scan_histogram(Index* histogram, int num_experts, long chunks, long expert_stride,
                                    long chunk_stride, Offset* offsets) {
  long rows = 0;
  for (int e = 0; e < num_experts; ++e) {
    if (offsets != nullptr) offsets[e] = static_cast<Offset>(rows);
    for (long c = 0; c < chunks; ++c) {
      Index& h = histogram[e * expert_stride + c * chunk_stride];
      const long n = static_cast<long>(h);
      h = static_cast<Index>(rows);
      rows += n;
    }
  }
  if (offsets != nullptr) offsets[num_experts] = static_cast<Offset>(rows);
  return rows;
}

// offsets[e] of a histogram already scanned (exclusively) elsewhere: expert e's first row, and
// offsets[num_experts] = rows.
template <class Index, class Offset>
MRR_HOST_DEVICE void expert_offset(const Index* first_row, long chunks, int num_experts, long rows, int e,
                                   Offset* offsets) {
  offsets[e] = static_cast<Offset>(e == num_experts ? rows : static_cast<long>(first_row[e * chunks]));
}

// dst[lo, hi) = src[lo, hi): one row (or a piece of one) of permute or of a gather.
template <class T>
MRR_HOST_DEVICE MRR_FORCEINLINE void copy_row(T* dst, const T* src, long lo, long hi) {
#if defined(__CUDA_ARCH__)
  for (long h = lo; h < hi; ++h) dst[h] = src[h];
#else
  std::memcpy(dst + lo, src + lo, static_cast<std::size_t>(hi - lo) * sizeof(T));
#endif
}

// a + b * c with the product rounded before the sum, on every executor. nvcc contracts a + b * c
// into one fused multiply-add by default (one rounding), which would give a GPU combine other bits
// than the host's; the _rn intrinsics are never contracted.
template <class A>
MRR_HOST_DEVICE MRR_FORCEINLINE A add_product(A a, A b, A c) {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<A, float>)
    return __fadd_rn(a, __fmul_rn(b, c));
  else if constexpr (std::is_same_v<A, double>)
    return __dadd_rn(a, __dmul_rn(b, c));
  else
    return a + b * c;
#else
  return a + b * c;
#endif
}

// Columns a combine accumulates at a time on a CPU thread (its Accum buffer lives on the stack). A
// GPU work item takes one column (Columns = 1: the buffer is a register, neighbouring threads read
// neighbouring columns); the sum per column is the same either way.
inline constexpr long kCombineColumns = 256;

// Most slots a host combine sums with the rows' pointers and weights in registers.
inline constexpr int kCombineHostSlots = 8;

// out[lo, hi) = sum over j < M, in j order, of w[j] * src[j][lo, hi), + addend[lo, hi) when
// Addend: the arithmetic of combine_row's tiles, column by column (so the same bits), with the
// slot loop unrolled, so the compiler vectorises over columns and keeps the sum in registers
// instead of a stack buffer read and written once per slot. The addend is a template parameter,
// not a test in the loop: with AVX-512, GCC if-converts `if (addend) acc += addend[h]` into a
// masked load, which for a null addend reads (masked off) the null page, and a masked load that
// touches an unmapped page takes a microcode assist every time, about 10x this loop's time.
template <int M, bool Addend, class T, class Accum>
inline void combine_columns_host(const T* const* src, const Accum* w, const T* addend, T* out, long lo, long hi) {
  for (long h = lo; h < hi; ++h) {
    Accum acc = Accum(0);
    for (int j = 0; j < M; ++j)
      acc = add_product(acc, static_cast<Accum>(src[j][h]), w[j]);
    if constexpr (Addend) acc += static_cast<Accum>(addend[h]);
    out[h] = static_cast<T>(acc);
  }
}

// combine_columns_host<M, Addend> for M = 0 ... kCombineHostSlots, by slot count.
template <bool Addend, class T, class Accum, int... M>
constexpr auto combine_columns_host_table(std::integer_sequence<int, M...>) {
  return std::array{&combine_columns_host<M, Addend, T, Accum>...};
}
template <bool Addend, class T, class Accum>
const auto& combine_columns_host_table() {
  static constexpr auto table =
      combine_columns_host_table<Addend, T, Accum>(std::make_integer_sequence<int, kCombineHostSlots + 1>{});
  return table;
}

// combine_row on a host thread for at most kCombineHostSlots slots: the kept slots' rows and
// weights gathered first, then the unrolled pass for their count.
template <class T, class W, class Index, class Accum>
inline void combine_row_host(const T* rows, long row_stride, const Index* row, const W* weights, int n, const T* addend,
                             T* out, long lo, long hi) {
  const T* src[kCombineHostSlots];
  Accum w[kCombineHostSlots];
  int m = 0;
  for (int j = 0; j < n; ++j) {
    const long r = static_cast<long>(row[j]);
    if (r < 0) continue;
    src[m] = rows + r * row_stride;
    w[m] = weights != nullptr ? static_cast<Accum>(weights[j]) : Accum(1);
    ++m;
  }
  if (addend != nullptr)
    combine_columns_host_table<true, T, Accum>()[m](src, w, addend, out, lo, hi);
  else
    combine_columns_host_table<false, T, Accum>()[m](src, w, addend, out, lo, hi);
}

// out[lo, hi) = sum over j < n, in j order, of weight[j] * rows[row[j]][lo, hi) (weight 1 when
// weights is null; row[j] < 0 is skipped: a dropped slot), then + addend[lo, hi) when given,
// accumulated in Accum and rounded once. The combine of one token (row = its row_of_slot), the
// backward of permute (no weights) and Megatron's unpermute (the token's rows, their probs).
// On a host thread, up to 8 slots take combine_row_host: the same sums in the same order (the
// same bits; tests/router/test_aux_loss_permute.cpp), faster (bench/RESULTS.md).
template <class T, class W, class Index, class Accum = accum_t<T>, long Columns = kCombineColumns>
MRR_HOST_DEVICE void combine_row(const T* rows, long row_stride, const Index* row, const W* weights, int n,
                                 const T* addend, T* out, long lo, long hi) {
#if !defined(__CUDA_ARCH__)
  if (n <= kCombineHostSlots)
    return combine_row_host<T, W, Index, Accum>(rows, row_stride, row, weights, n, addend, out, lo, hi);
#endif
  for (long c = lo; c < hi; c += Columns) {
    const long end = c + Columns < hi ? c + Columns : hi;
    Accum acc[Columns];
    for (long h = c; h < end; ++h) acc[h - c] = Accum(0);
    for (int j = 0; j < n; ++j) {  // slot order: the sum never depends on arrival order
      const long r = static_cast<long>(row[j]);
      if (r < 0) continue;
      const Accum w = weights != nullptr ? static_cast<Accum>(weights[j]) : Accum(1);
      const T* src = rows + r * row_stride;
      for (long h = c; h < end; ++h) acc[h - c] = add_product(acc[h - c], static_cast<Accum>(src[h]), w);
    }
    if (addend != nullptr)
      for (long h = c; h < end; ++h) acc[h - c] += static_cast<Accum>(addend[h]);
    for (long h = c; h < end; ++h) out[h] = static_cast<T>(acc[h - c]);
  }
}

// Partial sums of a combine backward's dot product: column h goes to lane h % kDotLanes, each lane
// sums its columns in order, and the lanes are then added in a fixed tree (lane l += lane l + w
// for w = 8, 4, 2, 1). The order depends on the row's length only, so every executor gets the same
// bits, and a host thread vectorises it (one column after another is a chain of dependent adds
// that every load waits on: 2.65 against 1.9 ms for the Qwen3-like layer's, data in cache).
inline constexpr int kDotLanes = 16;

// Backward of one token's combine out = sum_j w[j] * rows[row[j]]: for each kept slot j,
// grad_rows[row[j]] = w[j] * grad_out and grad_weights[j] = <grad_out, rows[row[j]]> (in Accum,
// summed in kDotLanes lanes); a dropped slot gets grad_weights[j] = 0. Each permuted row belongs
// to one slot of one token, so tokens run in parallel without races. grad_weights may be null.
template <class T, class W, class Index, class Accum = accum_t<T>>
MRR_HOST_DEVICE void combine_backward_row(const T* grad_out, long cols, const T* rows, long row_stride,
                                          const Index* row, const W* weights, int n, T* grad_rows,
                                          long grad_row_stride, W* grad_weights) {
  for (int j = 0; j < n; ++j) {
    const long r = static_cast<long>(row[j]);
    if (r < 0) {
      if (grad_weights != nullptr) grad_weights[j] = W(0);
      continue;
    }
    const Accum w = static_cast<Accum>(weights[j]);
    const T* y = rows + r * row_stride;
    T* g = grad_rows + r * grad_row_stride;
    Accum lanes[kDotLanes];
    for (int l = 0; l < kDotLanes; ++l)
      lanes[l] = Accum(0);
    const long whole = cols - cols % kDotLanes;
    for (long h0 = 0; h0 < whole; h0 += kDotLanes)
      for (int l = 0; l < kDotLanes; ++l) {
        const Accum go = static_cast<Accum>(grad_out[h0 + l]);
        g[h0 + l] = static_cast<T>(go * w);
        lanes[l] = add_product(lanes[l], go, static_cast<Accum>(y[h0 + l]));
      }
    // The last cols % kDotLanes columns, by lane (fixed indices keep the lanes in registers on a GPU).
    for (int l = 0; l < kDotLanes; ++l) {
      const long h = whole + l;
      if (h >= cols) break;
      const Accum go = static_cast<Accum>(grad_out[h]);
      g[h] = static_cast<T>(go * w);
      lanes[l] = add_product(lanes[l], go, static_cast<Accum>(y[h]));
    }
    for (int width = kDotLanes / 2; width > 0; width /= 2)
      for (int l = 0; l < width; ++l)
        lanes[l] += lanes[l + width];
    if (grad_weights != nullptr) grad_weights[j] = static_cast<W>(lanes[0]);
  }
}

}  // namespace kernels
MRR_NAMESPACE_END
