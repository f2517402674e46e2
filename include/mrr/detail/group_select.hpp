// Group-limited selection on the host: kernels::select_on_scores' grouped branch (DeepSeek-V3's
// gate: group scores from each group's top 1 or 2, the best group_topk groups kept, then the top k
// of the kept experts), with the same ids, in a few hundred cycles a row instead of thousands.
// - A group's top 2 (a multiset) in eight running pairs side by side, merged in a tree: the
//   scalar kernel's running maxima form one dependency chain through the whole row; these
//   vectorise. The pairs hold the same values, so the group scores are the same sums (a + b is
//   commutative; only the sign of a zero sum could differ, and the group ranking compares
//   scores, where -0 equals +0).
// - The k-th largest of the kept groups' top-2 values bounds the row's k-th largest candidate
//   from below (they are 2 group_topk >= k distinct candidates), so only the candidates reaching
//   it are ranked: about k of them. Candidates are visited in the scalar kernel's order (index
//   order; with 0.0 masking, the k lowest-indexed masked experts among them at 0.0), and the same
//   strict insertion ranks them, so ties go to the lower index as everywhere.
// The loops are compiled for the build's target and, on x86 builds without AVX2, once more under
// target("avx2"), picked at run time (detail/cpu_dispatch.hpp): compares and selects only, so
// both give the same bits. group_select_applies says which routers take it (float scores, groups
// of a multiple of 8 experts, at most 64 groups, 2 group_topk >= k, k <= 64); the others keep the
// scalar kernel.
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/detail/cpu_dispatch.hpp>
#include <mrr/kernels/router.hpp>
#include <mrr/kernels/topk.hpp>

#include <algorithm>
#include <functional>
#include <limits>
#include <utility>

MRR_NAMESPACE_BEGIN
namespace detail {

inline constexpr int kGroupSelectMaxGroups = 64;
inline constexpr int kGroupSelectMaxK = 64;

inline bool group_select_applies(const kernels::RouterParams& p) {
  return p.grouped && (p.group_score_topk == 1 || p.group_score_topk == 2) && p.experts_per_group >= 8 &&
         p.experts_per_group % 8 == 0 && p.num_groups >= 1 && p.num_groups <= kGroupSelectMaxGroups &&
         p.group_topk >= 1 && p.group_topk <= p.num_groups && 2 * p.group_topk >= p.topk && p.topk >= 1 &&
         p.topk <= kGroupSelectMaxK && p.num_experts == p.num_groups * p.experts_per_group;
}

// (x86's maxps / minps: the second operand unless the first is strictly larger / smaller.)
MRR_FORCEINLINE float max_of(float a, float b) {
  return a > b ? a : b;
}
MRR_FORCEINLINE float min_of(float a, float b) {
  return a < b ? a : b;
}

// first[g] >= second[g]: the two largest of group g's `per` scores (per a multiple of 8).
MRR_FORCEINLINE void group_top2_body(const float* s, int groups, int per, float* first, float* second) {
  constexpr float lowest = -std::numeric_limits<float>::infinity();
  for (int g = 0; g < groups; ++g) {
    const float* v = s + static_cast<long>(g) * per;
    float f[8], t[8];
    for (int l = 0; l < 8; ++l) {
      f[l] = v[l];
      t[l] = lowest;
    }
    for (int i = 8; i < per; i += 8)
      for (int l = 0; l < 8; ++l) {
        const float x = v[i + l];
        t[l] = max_of(t[l], min_of(f[l], x));
        f[l] = max_of(f[l], x);
      }
    for (int w = 4; w > 0; w >>= 1)
      for (int l = 0; l < w; ++l) {
        t[l] = max_of(max_of(t[l], t[l + w]), min_of(f[l], f[l + w]));
        f[l] = max_of(f[l], f[l + w]);
      }
    first[g] = f[0];
    second[g] = t[0];
  }
}

// Appends to cand the experts e of [lo, lo + n) with s[e] >= bound, in index order; returns the
// new count (branch-free, so it vectorises).
MRR_FORCEINLINE int candidates_at_least_body(const float* s, int lo, int n, float bound, int* cand, int count) {
  for (int e = lo; e < lo + n; ++e) {
    cand[count] = e;
    count += s[e] >= bound ? 1 : 0;
  }
  return count;
}

inline void group_top2_portable(const float* s, int groups, int per, float* first, float* second) {
  group_top2_body(s, groups, per, first, second);
}
inline int candidates_at_least_portable(const float* s, int lo, int n, float bound, int* cand, int count) {
  return candidates_at_least_body(s, lo, n, bound, cand, count);
}

#if MRR_AVX2_DISPATCH
__attribute__((target("avx2"))) inline void group_top2_avx2(const float* s, int groups, int per, float* first,
                                                            float* second) {
  group_top2_body(s, groups, per, first, second);
}
__attribute__((target("avx2"))) inline int candidates_at_least_avx2(const float* s, int lo, int n, float bound,
                                                                    int* cand, int count) {
  return candidates_at_least_body(s, lo, n, bound, cand, count);
}
#endif

// The selection, with the AVX2 loops when `avx2` (and compiled in) or the build's own. ids[0, k)
// as kernels::select_on_scores(p, s, ids, ...) gives them for group_select_applies(p); s is only
// read. vals: k floats, cand: num_experts ints of scratch.
template <class Id>
void select_grouped(const kernels::RouterParams& p, const float* s, Id* ids, float* vals, int* cand, bool avx2) {
  const int groups = p.num_groups, per = p.experts_per_group, gk = p.group_topk, k = p.topk;
  float first[kGroupSelectMaxGroups], second[kGroupSelectMaxGroups], score[kGroupSelectMaxGroups];
  auto top2 = &group_top2_portable;
  auto at_least = &candidates_at_least_portable;
#if MRR_AVX2_DISPATCH
  if (avx2) {
    top2 = &group_top2_avx2;
    at_least = &candidates_at_least_avx2;
  }
#else
  (void)avx2;
#endif
  top2(s, groups, per, first, second);
  for (int g = 0; g < groups; ++g)
    score[g] = p.group_score_topk == 2 ? first[g] + second[g] : first[g];
  // The kept groups (kernels::topk_desc: lower group first among equal scores), in index order.
  int gid[kGroupSelectMaxGroups];
  float gval[kGroupSelectMaxGroups];
  kernels::topk_desc(score, groups, gk, gid, gval);
  for (int i = 1; i < gk; ++i)
    for (int j = i; j > 0 && gid[j - 1] > gid[j]; --j)
      std::swap(gid[j - 1], gid[j]);
  // bound: the k-th largest of the kept groups' top-2 values.
  float top[2 * kGroupSelectMaxGroups];
  for (int i = 0; i < gk; ++i) {
    top[2 * i] = first[gid[i]];
    top[2 * i + 1] = second[gid[i]];
  }
  float bound = top[0];
  if (2 * gk == k) {  // DeepSeek-V3's 4 groups x 2 = top-8: the smallest
    for (int i = 1; i < 2 * gk; ++i)
      bound = min_of(bound, top[i]);
  } else {
    std::nth_element(top, top + (k - 1), top + 2 * gk, std::greater<float>());
    bound = top[k - 1];
  }
  // Candidates reaching it, in the scalar kernel's order; a 0.0-masked expert as ~e.
  int count = 0, masked_taken = 0, next_group = 0;
  for (int g = 0; g < groups; ++g) {
    const bool kept = next_group < gk && gid[next_group] == g;
    if (kept) {
      ++next_group;
      if (first[g] >= bound)  // (else none of the group reaches it)
        count = at_least(s, g * per, per, bound, cand, count);
    } else if (p.zero_masking && masked_taken < k) {
      const int take = std::min(per, k - masked_taken);
      masked_taken += take;
      if (0.0f >= bound)
        for (int e = g * per; e < g * per + take; ++e)
          cand[count++] = ~e;
    }
  }
  int kept = 0;
  for (int i = 0; i < count; ++i) {
    const int c = cand[i], e = c >= 0 ? c : ~c;
    const float v = c >= 0 ? s[e] : 0.0f;
    if (kept < k)
      kernels::topk_insert(v, e, kept++, ids, vals);
    else if (v > vals[k - 1])
      kernels::topk_insert(v, e, k - 1, ids, vals);
  }
}

// select_grouped with the loops this CPU runs fastest (the same ids either way).
template <class Id>
void select_grouped(const kernels::RouterParams& p, const float* s, Id* ids, float* vals, int* cand) {
#if MRR_AVX2_DISPATCH
  select_grouped(p, s, ids, vals, cand, cpu_has_avx2());
#else
  select_grouped(p, s, ids, vals, cand, false);
#endif
}

}  // namespace detail
MRR_NAMESPACE_END
