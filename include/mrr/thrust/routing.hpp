// mrr-requires: mrr_thrust_omp
// Top-k routing, replay and the router backward on a Thrust system (DESIGN.md sections 3 and 4):
// the same selection code as the CPU TopKRouter (detail/topk.hpp, lower index wins ties), one
// token per functor call, so ids equal the CPU's wherever both compare the same values (every
// selection on logits; sqrt-softplus). Weights are recomputed from the logits and may differ from
// the CPU's in the last bits (exp rounding, summation order).
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/detail/score.hpp>
#include <mrr/detail/softmax_tile.hpp>
#include <mrr/detail/topk.hpp>
#include <mrr/error.hpp>
#include <mrr/router/config.hpp>
#include <mrr/thrust/backend.hpp>
#include <mrr/thrust/bf16.hpp>
#include <mrr/thrust/capacity.hpp>
#include <mrr/thrust/permute.hpp>

#include <cuda/std/limits>

#include <thrust/find.h>
#include <thrust/for_each.h>
#include <thrust/functional.h>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/logical.h>
#include <thrust/reduce.h>
#include <thrust/sort.h>
#include <thrust/transform.h>
#include <thrust/tuple.h>

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>

MRR_NAMESPACE_BEGIN
namespace device {

// Per-token scratch lives in registers / the thread's stack, so shapes are bounded.
inline constexpr int kMaxExperts = 1024;
inline constexpr int kMaxTopK = 32;
inline constexpr int kMaxGroups = 64;

// A RouterConfig resolved to plain values: what the functors see.
struct RouterParams {
  int num_experts = 0, topk = 0;
  int score = 0;  // 0 softmax, 1 sigmoid, 2 sqrt-softplus
  bool pre_softmax = false, normalize = false, selects_on_logits = true, grouped = false, zero_masking = false;
  int num_groups = 0, group_topk = 0, group_score_topk = 0, experts_per_group = 0;
  bool has_bias = false, has_scale = false;
  double scale = 1.0;
  bool drops_over_capacity = false;  // applied after the per-token pass (TopKRouter::drop_over_capacity)
};

inline RouterParams resolve(const RouterConfig& c) {
  RouterParams p;
  p.num_experts = c.num_experts;
  p.topk = c.topk;
  p.score = c.score_function == ScoreFunction::softmax ? 0 : (c.score_function == ScoreFunction::sigmoid ? 1 : 2);
  p.pre_softmax = c.pre_softmax;
  p.normalize = c.normalizes();
  p.grouped = c.grouped();
  p.selects_on_logits = !c.grouped() && !c.use_expert_bias;
  p.zero_masking = c.group_masking == GroupMasking::zero;
  p.num_groups = c.num_groups;
  p.group_topk = c.group_topk;
  p.group_score_topk = c.effective_group_score_topk();
  p.experts_per_group = c.experts_per_group();
  p.has_bias = c.use_expert_bias;
  p.has_scale = c.scaling_factor.has_value();
  p.scale = c.scaling_factor.value_or(1.0);
  p.drops_over_capacity = c.capacity_factor.has_value();
  return p;
}

namespace kernels {

template <class T>
MRR_HOST_DEVICE inline T score_of(int score, T x) {
  return score == 1 ? mrr::detail::sigmoid(x) : mrr::detail::sqrt_softplus(x);
}

// Sum of the m largest of v[0, n), in the CPU router's order (the group score).
template <class T>
MRR_HOST_DEVICE inline T sum_of_top(const T* v, int n, int m) {
  if (m == 1) {
    T a = v[0];
    for (int e = 1; e < n; ++e) a = v[e] > a ? v[e] : a;
    return a;
  }
  if (m == 2) {  // two running maxima, started from the first pair (n >= 2 by validation)
    T a = v[1] > v[0] ? v[1] : v[0], b = v[1] > v[0] ? v[0] : v[1];
    for (int e = 2; e < n; ++e) {
      const T x = v[e];
      b = x > a ? a : (x > b ? x : b);
      a = x > a ? x : a;
    }
    return a + b;
  }
  int idx[kMaxTopK];
  T val[kMaxTopK];
  mrr::detail::topk_desc(v, n, m, idx, val);
  T sum = 0;
  for (int i = 0; i < m; ++i) sum += val[i];
  return sum;
}

// Top k of v[0, n) (lower index wins ties). On the host (the OpenMP system) the block-bounded
// selection the CPU router uses, about twice as fast for long rows; on a GPU the plain insertion,
// which needs no n-sized scratch. Both return the same ids.
template <class T, class Index>
MRR_HOST_DEVICE MRR_FORCEINLINE void topk_row(const T* v, int n, int k, Index* ids, T* vals) {
#if defined(__CUDA_ARCH__)
  mrr::detail::topk_desc(v, n, k, ids, vals);
#else
  int scratch[kMaxExperts];
  mrr::detail::topk_desc_bounded(v, n, k, ids, vals, scratch);
#endif
}

// The expert of candidate c of a group-limited selection. Candidates are, in index order, every
// expert of a kept group (gid: the kept groups, ascending) and, with 0.0 masking, the k
// lowest-indexed experts of the other groups (as the CPU router lists them).
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

template <class T>
MRR_HOST_DEVICE inline void select_row(const RouterParams& p, const T* z, const T* bias, std::int32_t* ids) {
  const int k = p.topk, n = p.num_experts;
  T vals[kMaxTopK];
  if (p.selects_on_logits) {
    topk_row(z, n, k, ids, vals);
    return;
  }
  T s[kMaxExperts];
  if (p.score == 0) {
    if (p.pre_softmax) {
      T mx = z[0];
      for (int e = 1; e < n; ++e) mx = z[e] > mx ? z[e] : mx;
      T sum = 0;
      for (int e = 0; e < n; ++e) {
        using std::exp;
        s[e] = exp(z[e] - mx);
        sum += s[e];
      }
      for (int e = 0; e < n; ++e) s[e] /= sum;
    } else {
      for (int e = 0; e < n; ++e) s[e] = z[e];
    }
  } else {
    for (int e = 0; e < n; ++e) s[e] = score_of(p.score, z[e]);
  }
  if (p.has_bias)
    for (int e = 0; e < n; ++e) s[e] += bias[e];
  if (!p.grouped) {
    topk_row(s, n, k, ids, vals);
    return;
  }
  const int groups = p.num_groups, per = p.experts_per_group, gk = p.group_topk;
  T gs[kMaxGroups], gv[kMaxGroups];
  int gid[kMaxGroups];
  for (int g = 0; g < groups; ++g) gs[g] = sum_of_top(s + g * per, per, p.group_score_topk);
  mrr::detail::topk_desc(gs, groups, gk, gid, gv);
  for (int i = 1; i < gk; ++i)  // kept groups in index order
    for (int j = i; j > 0 && gid[j - 1] > gid[j]; --j) {
      const int t = gid[j];
      gid[j] = gid[j - 1];
      gid[j - 1] = t;
    }
  // Candidates in index order, as the CPU router builds them: the kept groups' experts and, with
  // 0.0 masking, the k lowest-indexed masked experts (scoring 0). They are compacted into the front
  // of s (candidate `count` comes from an expert e >= count, read before anything overwrites it),
  // and a chosen candidate's expert is found again from the group list: no candidate arrays,
  // which on a GPU would take 8 KB more local memory per thread.
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
  topk_row(s, count, k, ids, vals);
  for (int j = 0; j < k; ++j) ids[j] = expert_of_candidate(p, gid, k, ids[j]);
}

// softmax over the k gathered logits z[ids].
template <class T>
MRR_HOST_DEVICE inline void softmax_gathered(const T* z, const std::int32_t* ids, int k, T* w) {
  using std::exp;
  T mx = z[ids[0]];
  for (int j = 1; j < k; ++j) mx = z[ids[j]] > mx ? z[ids[j]] : mx;
  T sum = 0;
  for (int j = 0; j < k; ++j) sum += (w[j] = exp(z[ids[j]] - mx));
  for (int j = 0; j < k; ++j) w[j] /= sum;
}

// The routing weights of a gathered softmax, scale included. On CPU threads in float: the CPU
// router's operations (its polynomial exp_nonpositive, the slot-order sum, e * (scale / sum)), so
// the OpenMP system gives the CPU backend's very bits, about 1.4 x faster than expf here; elsewhere
// (a GPU, double) exp, / sum, * scale.
template <class T>
MRR_HOST_DEVICE inline void softmax_gathered_scaled(const T* z, const std::int32_t* ids, int k, T scale,
                                                    bool has_scale, T* w) {
#if !defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<T, float>) {
    float mx = z[ids[0]];
    for (int j = 1; j < k; ++j) mx = z[ids[j]] > mx ? z[ids[j]] : mx;
    float sum = 0.0f;
    for (int j = 0; j < k; ++j) sum += (w[j] = mrr::detail::exp_nonpositive(z[ids[j]] - mx));
    const float factor = (has_scale ? scale : 1.0f) / sum;
    for (int j = 0; j < k; ++j) w[j] *= factor;
    return;
  }
#endif
  softmax_gathered(z, ids, k, w);
  if (has_scale)
    for (int j = 0; j < k; ++j) w[j] *= scale;
}

template <class T>
MRR_HOST_DEVICE inline void softmax_normalizer(const T* z, int n, T& mx, T& sum) {
  using std::exp;
  mx = z[0];
  for (int e = 1; e < n; ++e) mx = z[e] > mx ? z[e] : mx;
  sum = 0;
  for (int e = 0; e < n; ++e) sum += exp(z[e] - mx);
}

// Weights of the k experts ids[0, k) of one token (DESIGN.md section 3).
template <class T>
MRR_HOST_DEVICE inline void weights_row(const RouterParams& p, const T* z, const std::int32_t* ids, T* w) {
  using std::exp;
  const int k = p.topk;
  if (p.score == 0) {
    if (p.pre_softmax && !p.normalize) {
      T mx, sum;
      softmax_normalizer(z, p.num_experts, mx, sum);
      for (int j = 0; j < k; ++j) w[j] = exp(z[ids[j]] - mx) / sum;
    } else {
      softmax_gathered_scaled(z, ids, k, static_cast<T>(p.scale), p.has_scale, w);
      return;
    }
  } else {
    for (int j = 0; j < k; ++j) w[j] = score_of(p.score, z[ids[j]]);
    if (p.normalize) {
      T sum = 0;
      for (int j = 0; j < k; ++j) sum += w[j];
      const T denom = sum + T(1e-20);
      for (int j = 0; j < k; ++j) w[j] /= denom;
    }
  }
  if (p.has_scale)
    for (int j = 0; j < k; ++j) w[j] *= static_cast<T>(p.scale);
}

// Why a row could not be routed (0: it was). Checked in the same pass that routes, so valid
// inputs cost no extra read; the host turns the first nonzero code into the CPU router's error.
// row_nan_weight: a weight came out NaN, which happens when every logit it is normalised over is
// -inf (a replayed row whose chosen experts are all masked); the CPU router rejects that too.
enum RowStatus : std::uint8_t {
  row_ok = 0,
  row_invalid_logit = 1,
  row_invalid_replay = 2,
  row_too_few_finite = 3,
  row_nan_weight = 4
};

// Scans a row once: NaN or +inf makes it invalid (-inf is a valid mask); counts finite logits.
// Two compares per value and no branch, so the host compiler vectorises the scan.
template <class T>
MRR_HOST_DEVICE inline bool valid_logits(const T* z, int n, int& finite) {
  constexpr T largest = ::cuda::std::numeric_limits<T>::max();
  int bad = 0, count = 0;
  for (int e = 0; e < n; ++e) {
    const T x = z[e];
    bad |= x <= largest ? 0 : 1;      // NaN or +inf
    count += x >= -largest ? 1 : 0;  // finite (not -inf, not NaN)
  }
  finite = count;
  return bad == 0;
}

MRR_HOST_DEVICE inline bool valid_replay_row(const std::int32_t* id, int k, int num_experts) {
  for (int j = 0; j < k; ++j) {
    if (id[j] < 0 || id[j] >= num_experts) return false;
    for (int i = 0; i < j; ++i)
      if (id[i] == id[j]) return false;
  }
  return true;
}

template <class T, class In>
MRR_HOST_DEVICE MRR_FORCEINLINE T widen(In x) {
  return static_cast<T>(x);
}
template <class T>
MRR_HOST_DEVICE MRR_FORCEINLINE T widen(bf16 x) {
  return static_cast<T>(x.to_float());
}

// Logits stored as In (T, or bf16 widened exactly to T): a row pointer to T values.
template <class T, class In>
struct RowOfLogits {
  T buffer[std::is_same_v<T, In> ? 1 : kMaxExperts];
  MRR_HOST_DEVICE const T* load(const In* z, int n) {
    if constexpr (std::is_same_v<T, In>) {
      (void)n;
      return z;
    } else {
      for (int e = 0; e < n; ++e) buffer[e] = widen<T>(z[e]);
      return buffer;
    }
  }
};

inline constexpr long kReplayPrefetchRows = 4;

// One token of route / replay: replayed rows copy their ids, the others select natively.
template <class T, class In = T>
struct RouteRows {
  RouterParams p;
  const In* logits;
  const T* bias;                    // null without expert bias
  const std::int32_t* replay_ids;   // null for native routing
  const std::uint8_t* replay_mask;  // null: every row replays (when replay_ids is set)
  std::int32_t* ids;
  T* weights;
  std::uint8_t* status;  // [tokens] RowStatus
  long tokens;

  MRR_HOST_DEVICE void operator()(long t) const {
    const int k = p.topk, n = p.num_experts;
    RowOfLogits<T, In> row;
    const T* z = row.load(logits + t * n, n);
    std::int32_t* id = ids + t * k;
    T* w = weights + t * k;
    int finite = 0;
    if (replay_ids != nullptr && (replay_mask == nullptr || replay_mask[t] != 0)) {
      // A replayed row reads only its k logits (as the CPU router's replay), unless the weights
      // are unrenormalised pre-softmax probabilities over all E.
      const std::int32_t* given = replay_ids + t * k;
#if !defined(__CUDA_ARCH__) && (defined(__GNUC__) || defined(__clang__))
      // A replayed row reads k scattered logits: on CPU threads the loads of a row a few ahead
      // overlap this row's arithmetic (rows of one thread are consecutive): about 2 x measured.
      if (t + kReplayPrefetchRows < tokens && std::is_same_v<T, In>)
        for (int j = 0; j < k; ++j) {
          const long ahead = t + kReplayPrefetchRows;
          const std::int32_t e = replay_ids[ahead * k + j];
          if (e >= 0 && e < n) __builtin_prefetch(logits + ahead * n + e);
        }
#endif
      if (!valid_replay_row(given, k, n)) {
        status[t] = row_invalid_replay;
        return;
      }
      const bool whole_row = p.score == 0 && p.pre_softmax && !p.normalize;
      bool valid = true;
      if (whole_row) {
        valid = valid_logits(z, n, finite);
      } else {
        constexpr T largest = ::cuda::std::numeric_limits<T>::max();
        for (int j = 0; j < k; ++j) valid = valid && z[given[j]] <= largest;
      }
      if (!valid) {
        status[t] = row_invalid_logit;
        return;
      }
      for (int j = 0; j < k; ++j) id[j] = given[j];
    } else {
      if (!valid_logits(z, n, finite)) {
        status[t] = row_invalid_logit;
        return;
      }
      if (finite < k) {  // a top-k that must take a masked (-inf) expert is no routing decision
        status[t] = row_too_few_finite;
        return;
      }
      select_row(p, z, bias, id);
    }
    weights_row(p, z, id, w);
    bool nan_weight = false;
    for (int j = 0; j < k; ++j) nan_weight |= !(w[j] == w[j]);
    status[t] = nan_weight ? row_nan_weight : row_ok;
  }
};

#if !defined(__CUDACC__)
// Replay of every row with k = 8 and a softmax over the chosen logits, on CPU threads (host code,
// never compiled by nvcc): a tile of kReplayTileRows rows per work item, done 8 rows at a time by
// the CPU router's AVX2 kernel (mrr::detail::replay_softmax_fused: hardware gathers, a transposed
// softmax, the same operations as softmax_gathered_scaled, so the same bits). Whatever that kernel
// does not finish (no AVX2, rows past the last multiple of 8) or flags (an id out of range or
// repeated, a NaN / +inf logit, an all-masked row) goes through RouteRows row by row, which
// computes the exact status: a flagged tile is redone whole.
inline constexpr long kReplayTileRows = 256;

struct ReplayTilesK8 {
  RouteRows<float, float> rows;
  float scale;  // 1 without a scaling factor
  void operator()(long tile) const {
    const long first = tile * kReplayTileRows;
    const long end = first + kReplayTileRows < rows.tokens ? first + kReplayTileRows : rows.tokens;
    const int n = rows.p.num_experts;
    unsigned flags = 0;
    const long readable = rows.tokens - first < end - first + 8 ? rows.tokens - first : end - first + 8;
    long done = mrr::detail::replay_softmax_fused(rows.logits + first * n, n, rows.replay_ids + first * 8, 8, 8, n,
                                                  static_cast<int>(end - first), static_cast<int>(readable), scale,
                                                  rows.ids + first * 8, rows.weights + first * 8, flags);
    if (flags != 0) [[unlikely]]
      done = 0;
    for (long t = first; t < first + done; ++t) rows.status[t] = row_ok;
    for (long t = first + done; t < end; ++t) rows(t);
  }
};
#endif

// d sum(g * w) / d z for one token; writes the whole row of grad (zeros off the selected ids).
template <class T>
struct BackwardRows {
  RouterParams p;
  const T* logits;
  const std::int32_t* ids_all;
  const T* grad_weights;
  const std::uint8_t* kept;  // null: every slot dispatched; else dropped slots pass no gradient
  T* grad;
  std::uint8_t* status;  // [tokens] RowStatus

  MRR_HOST_DEVICE void operator()(long t) const {
    using std::exp;
    const int k = p.topk, n = p.num_experts;
    const T* z = logits + t * n;
    const std::int32_t* ids = ids_all + t * k;
    T* dz = grad + t * n;
    for (int e = 0; e < n; ++e) dz[e] = T(0);
    if (!valid_replay_row(ids, k, n)) {
      status[t] = row_invalid_replay;
      return;
    }
    status[t] = row_ok;
    const T scale = p.has_scale ? static_cast<T>(p.scale) : T(1);
    T g[kMaxTopK], w[kMaxTopK];
    for (int j = 0; j < k; ++j)
      g[j] = (kept == nullptr || kept[t * k + j] != 0) ? grad_weights[t * k + j] * scale : T(0);
    if (p.score == 0) {
      if (p.pre_softmax && !p.normalize) {
        T mx, sum;
        softmax_normalizer(z, n, mx, sum);
        T s = 0;
        for (int j = 0; j < k; ++j) s += g[j] * exp(z[ids[j]] - mx) / sum;
        for (int e = 0; e < n; ++e) dz[e] -= exp(z[e] - mx) / sum * s;
        for (int j = 0; j < k; ++j) dz[ids[j]] += g[j] * exp(z[ids[j]] - mx) / sum;
      } else {
        softmax_gathered(z, ids, k, w);
        T s = 0;
        for (int j = 0; j < k; ++j) s += g[j] * w[j];
        for (int j = 0; j < k; ++j) dz[ids[j]] += w[j] * (g[j] - s);
      }
      return;
    }
    T sum = 0;
    for (int j = 0; j < k; ++j) sum += (w[j] = score_of(p.score, z[ids[j]]));
    const T denom = sum + T(1e-20);
    T c = 0;
    if (p.normalize)
      for (int j = 0; j < k; ++j) c += g[j] * w[j] / denom;
    for (int j = 0; j < k; ++j) {
      const T ds = p.normalize ? (g[j] - c) / denom : g[j];
      const T dsdz = p.score == 1 ? mrr::detail::sigmoid_grad_from_value(w[j])
                                  : mrr::detail::sqrt_softplus_grad(z[ids[j]], w[j]);
      dz[ids[j]] += ds * dsdz;
    }
  }
};

// NaN and +inf are not valid logits (-inf is a valid mask).
template <class T>
struct InvalidLogit {
  MRR_HOST_DEVICE bool operator()(T x) const { return !(x == x) || (x > T(0) && !(x * T(0) == T(0))); }
};

struct IsBadRow {
  MRR_HOST_DEVICE bool operator()(std::uint8_t code) const { return code != row_ok; }
};

}  // namespace kernels

// Routing of a batch on a Thrust system: ids [tokens, k] (int32) and weights [tokens, k], row-major.
template <class T, class Backend = ThrustDeviceBackend>
struct Routing {
  typename Backend::template vector<std::int32_t> ids;
  typename Backend::template vector<T> weights;  // zero for dropped slots
  long tokens = 0;
  int topk = 0;
  // [tokens, k] 1 where the slot is dispatched; empty when no capacity limit applies.
  typename Backend::template vector<std::uint8_t> kept{};
  bool has_capacity_mask() const { return !kept.empty(); }
};

// The Thrust counterpart of mrr::TopKRouter, capacity dropping included.
// Logits, ids and weights are row-major Thrust vectors of the backend's system.
template <class T, class Backend = ThrustDeviceBackend>
class TopKRouter {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                "device::TopKRouter<T>: T must be float or double (fp32 logits in, as the CPU router)");

 public:
  template <class U>
  using vector = typename Backend::template vector<U>;

  explicit TopKRouter(RouterConfig config) : config_(std::move(config)) {
    constexpr const char* fn = "device::TopKRouter";
    config_.validate();
    mrr::detail::require(config_.num_experts <= kMaxExperts, fn, "num_experts=", config_.num_experts,
                         " exceeds the device limit ", kMaxExperts);
    mrr::detail::require(config_.topk <= kMaxTopK, fn, "topk=", config_.topk, " exceeds the device limit ", kMaxTopK);
    mrr::detail::require(config_.num_groups <= kMaxGroups, fn, "num_groups=", config_.num_groups,
                         " exceeds the device limit ", kMaxGroups);
    mrr::detail::require(!config_.grouped() || config_.effective_group_score_topk() <= kMaxTopK, fn,
                         "group_score_topk exceeds the device limit ", kMaxTopK);
    params_ = resolve(config_);
    if (config_.use_expert_bias) bias_ = vector<T>(static_cast<std::size_t>(config_.num_experts), T(0));
  }

  const RouterConfig& config() const { return config_; }
  const RouterParams& params() const { return params_; }
  int num_experts() const { return config_.num_experts; }
  int topk() const { return config_.topk; }

  // Selection-only bias, copied from any Thrust or host range of num_experts values.
  template <class Range>
  void set_expert_bias(const Range& bias) {
    mrr::detail::require(config_.use_expert_bias, "device::TopKRouter::set_expert_bias",
                         "the config has use_expert_bias = false");
    mrr::detail::require(static_cast<int>(bias.size()) == num_experts(), "device::TopKRouter::set_expert_bias",
                         "bias has ", bias.size(), " entries for ", num_experts(), " experts");
    bias_ = vector<T>(bias.begin(), bias.end());
    check_finite(bias_, "device::TopKRouter::set_expert_bias", "expert bias");
  }

  Routing<T, Backend> route(const vector<T>& logits) const { return run(logits, nullptr, nullptr); }

  // Replays `ids` [tokens, k]; with a replay_mask [tokens], rows whose mask is 0 route natively.
  Routing<T, Backend> replay(const vector<T>& logits, const vector<std::int32_t>& ids) const {
    return run(logits, &ids, nullptr);
  }
  Routing<T, Backend> replay(const vector<T>& logits, const vector<std::int32_t>& ids,
                             const vector<std::uint8_t>& replay_mask) const {
    return run(logits, &ids, &replay_mask);
  }

  // bf16 logits (as a bf16 model's gate produces them): widened exactly to T, so the ids equal
  // those of the CPU router run on the bf16-rounded fp32 logits.
  Routing<T, Backend> route(const vector<bf16>& logits) const { return run(logits, nullptr, nullptr); }
  Routing<T, Backend> replay(const vector<bf16>& logits, const vector<std::int32_t>& ids) const {
    return run(logits, &ids, nullptr);
  }
  Routing<T, Backend> replay(const vector<bf16>& logits, const vector<std::int32_t>& ids,
                             const vector<std::uint8_t>& replay_mask) const {
    return run(logits, &ids, &replay_mask);
  }

  // Gradient of sum(grad_weights * weights) w.r.t. the logits [tokens, E] for the given ids.
  vector<T> backward(const vector<T>& logits, const vector<std::int32_t>& ids, const vector<T>& grad_weights) const {
    return backward_impl(logits, ids, grad_weights, nullptr);
  }
  // The same for a routing with dropped slots (Routing::kept): they pass no gradient.
  vector<T> backward(const vector<T>& logits, const vector<std::int32_t>& ids, const vector<T>& grad_weights,
                     const vector<std::uint8_t>& kept) const {
    mrr::detail::require(kept.size() == ids.size(), "device::TopKRouter::backward", "'kept' has ", kept.size(),
                         " entries for ", ids.size(), " slots");
    return backward_impl(logits, ids, grad_weights, &kept);
  }

 private:
  vector<T> backward_impl(const vector<T>& logits, const vector<std::int32_t>& ids, const vector<T>& grad_weights,
                          const vector<std::uint8_t>* kept) const {
    constexpr const char* fn = "device::TopKRouter::backward";
    const long tokens = rows_of(logits, fn);
    const auto k = static_cast<std::size_t>(topk());
    mrr::detail::require(ids.size() == static_cast<std::size_t>(tokens) * k && grad_weights.size() == ids.size(), fn,
                         "ids and grad_weights must be [", tokens, ", ", k, "]");
    vector<T> grad(logits.size());
    vector<std::uint8_t> status(static_cast<std::size_t>(tokens));
    thrust::for_each(Backend::policy(), thrust::counting_iterator<long>(0), thrust::counting_iterator<long>(tokens),
                     kernels::BackwardRows<T>{params_, raw(logits), raw(ids), raw(grad_weights),
                                              kept ? raw(*kept) : nullptr, raw(grad), raw(status)});
    throw_on_bad_row(status, fn);
    return grad;
  }

  template <class V>
  static auto raw(const V& v) {
    return thrust::raw_pointer_cast(v.data());
  }
  template <class V>
  static auto raw(V& v) {
    return thrust::raw_pointer_cast(v.data());
  }

  template <class In>
  long rows_of(const vector<In>& logits, const char* fn) const {
    mrr::detail::require(logits.size() % static_cast<std::size_t>(num_experts()) == 0, fn, "logits have ",
                         logits.size(), " values, not a multiple of ", num_experts(), " experts");
    return static_cast<long>(logits.size() / static_cast<std::size_t>(num_experts()));
  }

  static void check_finite(const vector<T>& v, const char* fn, const char* what) {
    if (thrust::any_of(Backend::policy(), v.begin(), v.end(), kernels::InvalidLogit<T>{})) [[unlikely]]
      mrr::detail::throw_invalid_argument(fn, what, " hold NaN or +inf");
  }

  // One reduction over the per-row codes; only a failure looks for the first bad row.
  void throw_on_bad_row(const vector<std::uint8_t>& status, const char* fn) const {
    const auto policy = Backend::policy();
    const int worst = thrust::reduce(policy, status.begin(), status.end(), 0, thrust::maximum<int>());
    if (worst == kernels::row_ok) [[likely]]
      return;
    const auto first = thrust::find_if(policy, status.begin(), status.end(), kernels::IsBadRow{});
    const long row = static_cast<long>(first - status.begin());
    const int code = *first;
    if (code == kernels::row_invalid_logit)
      mrr::detail::throw_invalid_argument(fn, "logits row ", row, " holds NaN or +inf (-inf is the only valid mask)");
    if (code == kernels::row_invalid_replay)
      mrr::detail::throw_invalid_argument(fn, "row ", row, ": a replayed row has an expert id outside [0, ",
                                          num_experts(), ") or repeats an id");
    if (code == kernels::row_nan_weight)
      mrr::detail::throw_invalid_argument(fn, "logits row ", row,
                                          ": a weight is NaN because every logit it is normalised over is -inf "
                                          "(masked); a row whose chosen experts are all masked cannot be routed");
    mrr::detail::throw_invalid_argument(fn, "logits row ", row, " has fewer finite logits than k=", topk(),
                                        " (the others are -inf, masked): a row needs at least k unmasked experts");
  }

  template <class In>
  Routing<T, Backend> run(const vector<In>& logits, const vector<std::int32_t>* replay_ids,
                          const vector<std::uint8_t>* mask) const {
    const char* fn = replay_ids ? "device::TopKRouter::replay" : "device::TopKRouter::route";
    const long tokens = rows_of(logits, fn);
    const auto k = static_cast<std::size_t>(topk());
    if (replay_ids) {
      mrr::detail::require(replay_ids->size() == static_cast<std::size_t>(tokens) * k, fn, "'ids' has ",
                           replay_ids->size(), " values, expected [", tokens, ", ", k, "]");
      if (mask)
        mrr::detail::require(mask->size() == static_cast<std::size_t>(tokens), fn, "'replay_mask' has ", mask->size(),
                             " entries for ", tokens, " rows of logits");
    }
    Routing<T, Backend> out{vector<std::int32_t>(static_cast<std::size_t>(tokens) * k),
                            vector<T>(static_cast<std::size_t>(tokens) * k), tokens, topk(), {}};
    vector<std::uint8_t> status(static_cast<std::size_t>(tokens));
    const kernels::RouteRows<T, In> rows{params_,
                                         raw(logits),
                                         config_.use_expert_bias ? raw(bias_) : nullptr,
                                         replay_ids ? raw(*replay_ids) : nullptr,
                                         mask ? raw(*mask) : nullptr,
                                         raw(out.ids),
                                         raw(out.weights),
                                         raw(status),
                                         tokens};
#if !defined(__CUDACC__)
    if constexpr (!Backend::is_device && std::is_same_v<T, float> && std::is_same_v<In, float>) {
      const bool gathered_softmax = params_.score == 0 && !(params_.pre_softmax && !params_.normalize);
      if (replay_ids != nullptr && mask == nullptr && topk() == 8 && gathered_softmax) {
        const long tiles = (tokens + kernels::kReplayTileRows - 1) / kernels::kReplayTileRows;
        const float scale = params_.has_scale ? static_cast<float>(params_.scale) : 1.0f;
        thrust::for_each(Backend::policy(), thrust::counting_iterator<long>(0), thrust::counting_iterator<long>(tiles),
                         kernels::ReplayTilesK8{rows, scale});
        throw_on_bad_row(status, fn);
        if (config_.capacity_factor) drop_over_capacity(out);
        return out;
      }
    }
#endif
    thrust::for_each(Backend::policy(), thrust::counting_iterator<long>(0), thrust::counting_iterator<long>(tokens),
                     rows);
    throw_on_bad_row(status, fn);
    if (config_.capacity_factor) drop_over_capacity(out);
    return out;
  }

  // Megatron's token dropping on the top-k routing, in the CPU router's order: the capacity view
  // (thrust/capacity.hpp) over the routing's own vectors. Position decisions equal the CPU's
  // exactly; probs decisions compare weights that may differ from the CPU's in the last bits, so a
  // near-tie at the capacity edge can differ.
  void drop_over_capacity(Routing<T, Backend>& r) const {
    device::drop_over_capacity<T, Backend>(r.ids, r.weights, r.kept, r.tokens, r.topk, num_experts(),
                                           *config_.capacity_factor, config_.drop_policy);
  }

  RouterConfig config_;
  RouterParams params_;
  vector<T> bias_;
};

}  // namespace device
MRR_NAMESPACE_END
