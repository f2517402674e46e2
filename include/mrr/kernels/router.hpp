// The router's row kernels, written once for every backend (DESIGN.md sections 3, 4 and 10):
// resolved parameters, row validation with its status codes, selection (on logits, on scores with
// expert bias, group-limited with -inf or 0.0 masking), the weights of one row and the router
// backward of one row. Plain MRR_HOST_DEVICE code over raw pointers: the CPU TopKRouter, the
// Thrust functors (OpenMP or CUDA) and the fused CUDA kernel all call these. Scratch comes from
// the caller (the CPU router's per-chunk workspace, a device thread's stack), so the kernels
// allocate nothing and report with status codes, never exceptions.
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/detail/softmax_tile.hpp>
#include <mrr/kernels/score.hpp>
#include <mrr/kernels/topk.hpp>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <type_traits>

MRR_NAMESPACE_BEGIN
namespace kernels {

// Bounds of the per-thread scratch of the device executors (stack arrays); the CPU router takes
// its scratch from a workspace sized by the config and has no bound.
inline constexpr int kMaxExperts = 1024;
inline constexpr int kMaxTopK = 32;
inline constexpr int kMaxGroups = 64;

// A RouterConfig resolved to plain values (router/params.hpp resolves it): what kernels see.
struct RouterParams {
  int num_experts = 0, topk = 0;
  int score = 0;  // ScoreKind: 0 softmax, 1 sigmoid, 2 sqrt-softplus
  bool pre_softmax = false, normalize = false, selects_on_logits = true, grouped = false, zero_masking = false;
  int num_groups = 0, group_topk = 0, group_score_topk = 0, experts_per_group = 0;
  bool has_bias = false, has_scale = false;
  double scale = 1.0;
  bool drops_over_capacity = false;  // a pass over the whole batch after the row kernels (capacity.hpp)

  // Unrenormalised pre-softmax weights divide by a sum over all E: only then does a replayed row
  // read (and validate) its whole row of logits.
  MRR_HOST_DEVICE bool replay_reads_whole_row() const { return score == score_softmax && pre_softmax && !normalize; }
};

// Why a row could not be routed (0: it was). The host turns a code into the CPU router's error
// (router/row_error.hpp). row_nan_weight: a weight came out NaN, which happens when every logit it
// is normalised over is -inf (a replayed row whose chosen experts are all masked).
enum RowStatus : std::uint8_t {
  row_ok = 0,
  row_invalid_logit = 1,
  row_invalid_replay = 2,
  row_too_few_finite = 3,
  row_nan_weight = 4
};

template <class T>
MRR_HOST_DEVICE MRR_FORCEINLINE constexpr T largest_finite() {
  if constexpr (std::is_same_v<T, float>)
    return FLT_MAX;
  else
    return DBL_MAX;
}

// ---------------------------------------------------------------------------------------------
// Row validation

// Scans a row once: NaN or +inf makes it invalid (-inf is a valid mask); counts finite logits.
// Two compares per value and no branch, so host compilers vectorise the scan.
template <class T>
MRR_HOST_DEVICE inline bool valid_logits(const T* z, int n, int& finite) {
  constexpr T largest = largest_finite<T>();
  int bad = 0, count = 0;
  for (int e = 0; e < n; ++e) {
    const T x = z[e];
    bad |= x <= largest ? 0 : 1;     // NaN or +inf
    count += x >= -largest ? 1 : 0;  // finite (not -inf, not NaN)
  }
  finite = count;
  return bad == 0;
}

// The first slot of a row of k expert ids that repeats an earlier slot's id, or -1 (a token holds
// one place of an expert at most).
template <class Id>
MRR_HOST_DEVICE inline int repeated_slot(const Id* id, int k) {
  for (int j = 1; j < k; ++j)
    for (int i = 0; i < j; ++i)
      if (id[i] == id[j]) return j;
  return -1;
}

// Replayed ids: each in [0, num_experts) and distinct within the row. Compared in the caller's
// integer type, so an int64 id of 2^32 + e is out of range, never e.
template <class Id>
MRR_HOST_DEVICE inline bool valid_replay_row(const Id* id, int k, int num_experts) {
  for (int j = 0; j < k; ++j)
    if (id[j] < 0 || id[j] >= static_cast<Id>(num_experts)) return false;
  return repeated_slot(id, k) < 0;
}

// The checks of a native row: valid logits, and at least k finite ones (a top-k that must take a
// masked expert is no routing decision).
template <class T>
MRR_HOST_DEVICE inline RowStatus check_native_row(const RouterParams& p, const T* z) {
  int finite = 0;
  if (!valid_logits(z, p.num_experts, finite)) return row_invalid_logit;
  return finite < p.topk ? row_too_few_finite : row_ok;
}

// The checks of a replayed row: its ids, then the logits its weights read (k of them, or the
// whole row under unrenormalised pre-softmax).
template <class T, class Id>
MRR_HOST_DEVICE inline RowStatus check_replay_row(const RouterParams& p, const T* z, const Id* given) {
  const int k = p.topk;
  if (!valid_replay_row(given, k, p.num_experts)) return row_invalid_replay;
  if (p.replay_reads_whole_row()) {
    int finite = 0;
    return valid_logits(z, p.num_experts, finite) ? row_ok : row_invalid_logit;
  }
  constexpr T largest = largest_finite<T>();
  bool valid = true;
  for (int j = 0; j < k; ++j)
    valid = valid && z[given[j]] <= largest;
  return valid ? row_ok : row_invalid_logit;
}

// ---------------------------------------------------------------------------------------------
// Selection

// Scratch of one row's selection; sizes in the comments.
template <class T>
struct SelectScratch {
  T* scores;        // num_experts (unused when the router selects on logits)
  T* values;        // max(topk, num_groups, group_score_topk)
  T* group_scores;  // num_groups
  int* indices;     // max(num_groups, group_score_topk)
  int* candidates;  // num_experts on the host (block-bounded top-k), or null (plain insertion)
};

// Selection scores of one row: softmax probabilities (pre-softmax), the logits (post-softmax), or
// the sigmoid / sqrt-softplus scores, plus the expert bias.
template <class T>
MRR_HOST_DEVICE inline void selection_scores(const RouterParams& p, const T* z, const T* bias, T* s) {
  using std::exp;
  const int n = p.num_experts;
  if (p.score == score_softmax) {
    if (p.pre_softmax) {
      T mx = z[0];
      for (int e = 1; e < n; ++e)
        mx = z[e] > mx ? z[e] : mx;
      T sum = 0;
      for (int e = 0; e < n; ++e)
        sum += (s[e] = exp(z[e] - mx));
      for (int e = 0; e < n; ++e)
        s[e] /= sum;
    } else {
      for (int e = 0; e < n; ++e)
        s[e] = z[e];
    }
  } else {
    for (int e = 0; e < n; ++e)
      s[e] = score_of(p.score, z[e]);
  }
  if (p.has_bias)
    for (int e = 0; e < n; ++e)
      s[e] += bias[e];
}

// The expert of candidate c of a group-limited selection. Candidates are, in index order, every
// expert of a kept group (gid: the kept groups, ascending) and, with 0.0 masking, the k
// lowest-indexed experts of the other groups.
MRR_HOST_DEVICE inline int expert_of_candidate(const RouterParams& p, const int* gid, int k, int c) {
  const int per = p.experts_per_group;
  int masked_left = p.zero_masking ? k : 0, next_group = 0;
  for (int g = 0; g < p.num_groups; ++g) {
    const bool kept = next_group < p.group_topk && gid[next_group] == g;
    if (kept) ++next_group;
    const int take = kept ? per : (masked_left < per ? masked_left : per);
    if (!kept) masked_left -= take;
    if (c < take) return g * per + c;
    c -= take;
  }
  return -1;  // unreachable: c < the number of candidates
}

// Top k of the selection scores s[0, E) into ids[0, k); group-limited routers overwrite s.
// A group scores the sum of its best m experts; the best group_topk groups stay eligible. The top
// k of the masked row (others at -inf or 0.0) is found without building it: the kept groups'
// experts and, with 0.0 masking, the k lowest-indexed masked experts (equal values: no other masked
// expert could win), compacted into the front of s in index order, so ties still go to the lower
// index (candidate `count` comes from an expert e >= count, read before anything overwrites it).
template <class T, class Id>
MRR_HOST_DEVICE inline void select_on_scores(const RouterParams& p, T* s, Id* ids, const SelectScratch<T>& w) {
  const int k = p.topk, n = p.num_experts;
  if (!p.grouped) {
    topk_row(s, n, k, ids, w.values, w.candidates);
    return;
  }
  const int groups = p.num_groups, per = p.experts_per_group, gk = p.group_topk;
  for (int g = 0; g < groups; ++g)
    w.group_scores[g] = sum_of_top(s + g * per, per, p.group_score_topk, w.indices, w.values);
  int* gid = w.indices;
  topk_desc(w.group_scores, groups, gk, gid, w.values);
  for (int i = 1; i < gk; ++i)  // kept groups in index order
    for (int j = i; j > 0 && gid[j - 1] > gid[j]; --j) {
      const int t = gid[j];
      gid[j] = gid[j - 1];
      gid[j - 1] = t;
    }
  int count = 0, masked_taken = 0, next_group = 0;
  for (int g = 0; g < groups; ++g) {
    const bool kept = next_group < gk && gid[next_group] == g;
    if (kept) ++next_group;
    if (!kept && !p.zero_masking) continue;
    for (int e = g * per; e < (g + 1) * per; ++e) {
      if (!kept && masked_taken++ >= k) break;
      s[count++] = kept ? s[e] : T(0);
    }
  }
  topk_row(s, count, k, ids, w.values, w.candidates);
  for (int j = 0; j < k; ++j)
    ids[j] = static_cast<Id>(expert_of_candidate(p, gid, k, static_cast<int>(ids[j])));
}

// Native selection of one row. Score functions are monotonic, so without bias or group sums the
// top-k of the logits is the top-k of the scores: selecting on logits keeps every backend's ids
// identical despite exp rounding.
template <class T, class Id>
MRR_HOST_DEVICE inline void select_row(const RouterParams& p, const T* z, const T* bias, Id* ids,
                                       const SelectScratch<T>& w) {
  if (p.selects_on_logits) {
    topk_row(z, p.num_experts, p.topk, ids, w.values, w.candidates);
    return;
  }
  selection_scores(p, z, bias, w.scores);
  select_on_scores(p, w.scores, ids, w);
}

// ---------------------------------------------------------------------------------------------
// Weights (DESIGN.md section 3)

// softmax over the k gathered logits z[ids].
template <class T, class Id>
MRR_HOST_DEVICE inline void softmax_gathered(const T* z, const Id* ids, int k, T* w) {
  using std::exp;
  T mx = z[ids[0]];
  for (int j = 1; j < k; ++j)
    mx = z[ids[j]] > mx ? z[ids[j]] : mx;
  T sum = 0;
  for (int j = 0; j < k; ++j)
    sum += (w[j] = exp(z[ids[j]] - mx));
  for (int j = 0; j < k; ++j)
    w[j] /= sum;
}

// The routing weights of a gathered softmax, scale included. On CPU threads in float: the CPU
// router's tile operations (its polynomial exp_nonpositive, the slot-order sum, e * (scale / sum)),
// so host executors give the CPU router's very bits; elsewhere (a GPU, double) exp, / sum, * scale.
template <class T, class Id>
MRR_HOST_DEVICE inline void softmax_gathered_scaled(const T* z, const Id* ids, int k, T scale, bool has_scale, T* w) {
#if !defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<T, float>) {
    float mx = z[ids[0]];
    for (int j = 1; j < k; ++j)
      mx = z[ids[j]] > mx ? z[ids[j]] : mx;
    float sum = 0.0f;
    for (int j = 0; j < k; ++j)
      sum += (w[j] = mrr::detail::exp_nonpositive(z[ids[j]] - mx));
    const float factor = (has_scale ? scale : 1.0f) / sum;
    for (int j = 0; j < k; ++j)
      w[j] *= factor;
    return;
  }
#endif
  softmax_gathered(z, ids, k, w);
  if (has_scale)
    for (int j = 0; j < k; ++j)
      w[j] *= scale;
}

// The softmax normaliser over a whole row: its max and sum exp(z - max).
template <class T>
MRR_HOST_DEVICE inline void softmax_normalizer(const T* z, int n, T& mx, T& sum) {
  using std::exp;
  mx = z[0];
  for (int e = 1; e < n; ++e)
    mx = z[e] > mx ? z[e] : mx;
  sum = 0;
  for (int e = 0; e < n; ++e)
    sum += exp(z[e] - mx);
}

// Weights of the k experts ids[0, k) of one row. The CPU router computes the same function over
// tiles of rows with vectorised exponentials (its host specialisation, TopKRouter::weights_tile).
template <class T, class Id>
MRR_HOST_DEVICE inline void weights_row(const RouterParams& p, const T* z, const Id* ids, T* w) {
  using std::exp;
  const int k = p.topk;
  if (p.score == score_softmax) {
    if (!p.replay_reads_whole_row()) {
      softmax_gathered_scaled(z, ids, k, static_cast<T>(p.scale), p.has_scale, w);
      return;
    }
    T mx, sum;
    softmax_normalizer(z, p.num_experts, mx, sum);
    for (int j = 0; j < k; ++j)
      w[j] = exp(z[ids[j]] - mx) / sum;
  } else {
    for (int j = 0; j < k; ++j)
      w[j] = score_of(p.score, z[ids[j]]);
    if (p.normalize) {
      T sum = 0;
      for (int j = 0; j < k; ++j)
        sum += w[j];
      const T denom = sum + T(1e-20);
      for (int j = 0; j < k; ++j)
        w[j] /= denom;
    }
  }
  if (p.has_scale)
    for (int j = 0; j < k; ++j)
      w[j] *= static_cast<T>(p.scale);
}

// ---------------------------------------------------------------------------------------------
// One row of route / replay

// Routes row z (given == null, or not replayed) or replays the ids `given`, writing ids and
// weights; returns the row's status (its outputs are unspecified unless row_ok).
template <class T, class IdIn, class IdOut>
MRR_HOST_DEVICE inline RowStatus route_row(const RouterParams& p, const T* z, const T* bias, const IdIn* given,
                                           IdOut* ids, T* w, const SelectScratch<T>& scratch) {
  const int k = p.topk;
  if (given != nullptr) {
    const RowStatus s = check_replay_row(p, z, given);
    if (s != row_ok) return s;
    for (int j = 0; j < k; ++j)
      ids[j] = static_cast<IdOut>(given[j]);
  } else {
    const RowStatus s = check_native_row(p, z);
    if (s != row_ok) return s;
    select_row(p, z, bias, ids, scratch);
  }
  weights_row(p, z, ids, w);
  bool nan_weight = false;
  for (int j = 0; j < k; ++j)
    nan_weight |= !(w[j] == w[j]);
  return nan_weight ? row_nan_weight : row_ok;
}

// ---------------------------------------------------------------------------------------------
// Router backward

// Adds to dz[0, E) the gradient of sum_j g_j w_j w.r.t. the row's logits z, for the weights before
// scaling (g carries the scale); w is k values of scratch.
template <class T, class Id>
MRR_HOST_DEVICE inline void backward_weights(const RouterParams& p, const T* z, const Id* ids, const T* g, T* w,
                                             T* dz) {
  using std::exp;
  const int k = p.topk, n = p.num_experts;
  if (p.score == score_softmax) {
    if (p.replay_reads_whole_row()) {
      // w_j = p[ids_j]:  dz_e = sum_j g_j p_ids_j (delta(ids_j, e) - p_e).
      T mx, sum;
      softmax_normalizer(z, n, mx, sum);
      T s = 0;
      for (int j = 0; j < k; ++j)
        s += g[j] * exp(z[ids[j]] - mx) / sum;
      for (int e = 0; e < n; ++e)
        dz[e] -= exp(z[e] - mx) / sum * s;
      for (int j = 0; j < k; ++j)
        dz[ids[j]] += g[j] * exp(z[ids[j]] - mx) / sum;
    } else {
      // w = softmax(z[ids]):  dz_ids_j = w_j (g_j - sum_i g_i w_i).
      softmax_gathered(z, ids, k, w);
      T s = 0;
      for (int j = 0; j < k; ++j)
        s += g[j] * w[j];
      for (int j = 0; j < k; ++j)
        dz[ids[j]] += w[j] * (g[j] - s);
    }
    return;
  }
  // s_j = f(z_ids_j); w_j = s_j / (sum s + eps) when normalised, else s_j.
  T sum = 0;
  for (int j = 0; j < k; ++j)
    sum += (w[j] = score_of(p.score, z[ids[j]]));
  const T denom = sum + T(1e-20);
  T c = 0;
  if (p.normalize)
    for (int j = 0; j < k; ++j)
      c += g[j] * w[j] / denom;
  for (int j = 0; j < k; ++j) {
    const T ds = p.normalize ? (g[j] - c) / denom : g[j];
    dz[ids[j]] += ds * score_grad(p.score, z[ids[j]], w[j]);
  }
}

// The router backward of one row: dz[0, E) = d sum_j grad_w_j weight_j / d z for the ids of the
// row (zeros off them); slots whose `kept` is 0 (dropped over capacity) pass no gradient. g and w
// are k values of scratch each. Returns row_invalid_replay (dz zero) when an id is out of range or
// repeated.
template <class T, class Id>
MRR_HOST_DEVICE inline RowStatus backward_row(const RouterParams& p, const T* z, const Id* ids, const T* grad_w,
                                              const std::uint8_t* kept, T* dz, T* g, T* w) {
  const int k = p.topk;
  for (int e = 0; e < p.num_experts; ++e)
    dz[e] = T(0);
  if (!valid_replay_row(ids, k, p.num_experts)) return row_invalid_replay;
  const T scale = p.has_scale ? static_cast<T>(p.scale) : T(1);
  for (int j = 0; j < k; ++j)
    g[j] = (kept == nullptr || kept[j] != 0) ? grad_w[j] * scale : T(0);
  backward_weights(p, z, ids, g, w, dz);
  return row_ok;
}

}  // namespace kernels
MRR_NAMESPACE_END
