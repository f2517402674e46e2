// Deterministic top-k over one row: descending value, and among equal values the lower index
// first. This is mrr's tie rule everywhere (CPU and GPU, experts and groups); torch.topk leaves
// ties implementation-defined. NaN must be rejected by the caller: it compares false and would
// never be selected.
#pragma once

#include <mrr/detail/config.hpp>

MRR_NAMESPACE_BEGIN
namespace kernels {

// Places value v of index e at slot `pos` or above, shifting smaller kept values down; strict
// comparison keeps an equal earlier value (the lower index) in front.
template <class T, class Index>
MRR_HOST_DEVICE MRR_FORCEINLINE void topk_insert(T v, int e, int pos, Index* out_idx, T* out_val) {
  while (pos > 0 && v > out_val[pos - 1]) {
    out_val[pos] = out_val[pos - 1];
    out_idx[pos] = out_idx[pos - 1];
    --pos;
  }
  out_val[pos] = v;
  out_idx[pos] = static_cast<Index>(e);
}

// Writes the indices of the k largest of values[0], values[stride], ... (n of them) to out_idx
// and their values to out_val, best first. Index iteration is ascending and the comparison
// strict, which is what makes the lower index win a tie. O(n * k) worst case, O(n) typical for
// the small k routers use.
template <class T, class Index>
MRR_HOST_DEVICE inline void topk_desc(const T* values, int n, int k, Index* out_idx, T* out_val, long stride = 1) {
  auto insert = [&](T v, int e, int pos) { topk_insert(v, e, pos, out_idx, out_val); };
  const int first = n < k ? n : k;
  for (int e = 0; e < first; ++e)
    insert(values[static_cast<long>(e) * stride], e, e);
  if (first < k) return;
  // Steady state: one compare against the k-th best, kept in a register; most values stop here.
  T threshold = out_val[k - 1];
  for (int e = k; e < n; ++e) {
    const T v = values[static_cast<long>(e) * stride];
    if (!(v > threshold)) continue;
    insert(v, e, k - 1);
    threshold = out_val[k - 1];
  }
}

// The same selection for long rows on the host, about twice as fast: k disjoint blocks have k
// maxima at k different indices, so the k-th largest value is at least the smallest block maximum;
// only values reaching that bound can be selected, and at least k do. They are gathered in index
// order (so ties still go to the lower index) and the insertion above runs on those few.
// `candidates` holds n ints of scratch. Exactly k non-empty blocks: n / k values each, the last
// also the remainder. (Blocks of ceil(n / k) values can number fewer than k, e.g. 7 for n = 33 and
// k = 8, and their bound then admits as few as k - 1 values.)
template <class T, class Index>
MRR_HOST_DEVICE inline void topk_desc_bounded(const T* values, int n, int k, Index* out_idx, T* out_val,
                                              int* candidates) {
  if (n < 4 * k) return topk_desc(values, n, k, out_idx, out_val);
  const int block = n / k;
  T bound = values[0];
  for (int b = 0; b < k; ++b) {
    const int lo = b * block, hi = b + 1 < k ? lo + block : n;
    T m = values[lo];
    for (int e = lo + 1; e < hi; ++e)
      m = values[e] > m ? values[e] : m;
    bound = (b == 0 || m < bound) ? m : bound;
  }
  int count = 0;
  for (int e = 0; e < n; ++e) {  // branch-free compaction
    candidates[count] = e;
    count += values[e] >= bound ? 1 : 0;
  }
  int kept = 0;
  for (int i = 0; i < count; ++i) {
    const int e = candidates[i];
    const T v = values[e];
    if (kept < k)
      topk_insert(v, e, kept++, out_idx, out_val);
    else if (v > out_val[k - 1])
      topk_insert(v, e, k - 1, out_idx, out_val);
  }
}

// Top k of v[0, n) into ids / vals (k each), lower index first among equals. With `candidates`
// (n ints of scratch) on the host, the block-bounded selection above; on a GPU, or without
// scratch, the plain insertion. Both give the same ids.
template <class T, class Index>
MRR_HOST_DEVICE MRR_FORCEINLINE void topk_row(const T* v, int n, int k, Index* ids, T* vals, int* candidates) {
#if defined(__CUDA_ARCH__)
  (void)candidates;
  topk_desc(v, n, k, ids, vals);
#else
  if (candidates != nullptr)
    topk_desc_bounded(v, n, k, ids, vals, candidates);
  else
    topk_desc(v, n, k, ids, vals);
#endif
}

// Sum of the m largest of v[0, n) (a group's score), summed best first. m = 1 and 2 (DeepSeek-V3)
// take running maxima; larger m the insertion, with idx / val scratch of m entries.
template <class T>
MRR_HOST_DEVICE inline T sum_of_top(const T* v, int n, int m, int* idx, T* val) {
  if (m == 1) {
    T a = v[0];
    for (int e = 1; e < n; ++e)
      a = v[e] > a ? v[e] : a;
    return a;
  }
  if (m == 2) {  // two running maxima from the first pair (m <= n: RouterConfig::validate)
    T a = v[1] > v[0] ? v[1] : v[0], b = v[1] > v[0] ? v[0] : v[1];
    for (int e = 2; e < n; ++e) {
      const T x = v[e];
      b = x > a ? a : (x > b ? x : b);
      a = x > a ? x : a;
    }
    return a + b;
  }
  topk_desc(v, n, m, idx, val);
  T sum = 0;
  for (int i = 0; i < m; ++i)
    sum += val[i];
  return sum;
}

}  // namespace kernels
MRR_NAMESPACE_END
