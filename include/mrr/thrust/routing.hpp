// mrr-requires: mrr_thrust_omp
// Top-k routing, replay and the router backward on a Thrust system (DESIGN.md sections 3 and 4):
// the same selection code as the CPU TopKRouter (detail/topk.hpp, lower index wins ties), one
// token per functor call, so ids equal the CPU's wherever both compare the same values (every
// selection on logits; sqrt-softplus). Weights are recomputed from the logits and may differ from
// the CPU's in the last bits (exp rounding, summation order).
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/detail/score.hpp>
#include <mrr/detail/topk.hpp>
#include <mrr/error.hpp>
#include <mrr/router/config.hpp>
#include <mrr/thrust/backend.hpp>

#include <thrust/for_each.h>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/logical.h>

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

template <class T>
MRR_HOST_DEVICE inline void select_row(const RouterParams& p, const T* z, const T* bias, std::int32_t* ids) {
  const int k = p.topk, n = p.num_experts;
  T vals[kMaxTopK];
  if (p.selects_on_logits) {
    mrr::detail::topk_desc(z, n, k, ids, vals);
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
    mrr::detail::topk_desc(s, n, k, ids, vals);
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
  // Candidates in index order: the kept groups' experts and, with 0.0 masking, the k
  // lowest-indexed masked experts (as the CPU router builds them).
  T cand[kMaxExperts];
  int cand_id[kMaxExperts];
  int count = 0, masked_taken = 0, next_group = 0;
  for (int g = 0; g < groups; ++g) {
    const bool kept = next_group < gk && gid[next_group] == g;
    if (kept) ++next_group;
    if (!kept && !p.zero_masking) continue;
    for (int e = g * per; e < (g + 1) * per; ++e) {
      if (!kept && masked_taken++ >= k) break;
      cand[count] = kept ? s[e] : T(0);
      cand_id[count++] = e;
    }
  }
  mrr::detail::topk_desc(cand, count, k, ids, vals);
  for (int j = 0; j < k; ++j) ids[j] = cand_id[ids[j]];
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
      softmax_gathered(z, ids, k, w);
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

// One token of route / replay: replayed rows copy their ids, the others select natively.
template <class T>
struct RouteRows {
  RouterParams p;
  const T* logits;
  const T* bias;                    // null without expert bias
  const std::int32_t* replay_ids;   // null for native routing
  const std::uint8_t* replay_mask;  // null: every row replays (when replay_ids is set)
  std::int32_t* ids;
  T* weights;

  MRR_HOST_DEVICE void operator()(long t) const {
    const T* z = logits + t * p.num_experts;
    std::int32_t* id = ids + t * p.topk;
    if (replay_ids != nullptr && (replay_mask == nullptr || replay_mask[t] != 0)) {
      for (int j = 0; j < p.topk; ++j) id[j] = replay_ids[t * p.topk + j];
    } else {
      select_row(p, z, bias, id);
    }
    weights_row(p, z, id, weights + t * p.topk);
  }
};

// d sum(g * w) / d z for one token; writes the whole row of grad (zeros off the selected ids).
template <class T>
struct BackwardRows {
  RouterParams p;
  const T* logits;
  const std::int32_t* ids_all;
  const T* grad_weights;
  T* grad;

  MRR_HOST_DEVICE void operator()(long t) const {
    using std::exp;
    const int k = p.topk, n = p.num_experts;
    const T* z = logits + t * n;
    const std::int32_t* ids = ids_all + t * k;
    T* dz = grad + t * n;
    const T scale = p.has_scale ? static_cast<T>(p.scale) : T(1);
    T g[kMaxTopK], w[kMaxTopK];
    for (int j = 0; j < k; ++j) g[j] = grad_weights[t * k + j] * scale;
    for (int e = 0; e < n; ++e) dz[e] = T(0);
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

// A replayed row with an id outside [0, E) or a repeated id.
struct InvalidReplayRow {
  const std::int32_t* ids;
  const std::uint8_t* mask;
  int k, num_experts;
  MRR_HOST_DEVICE bool operator()(long t) const {
    if (mask != nullptr && mask[t] == 0) return false;
    const std::int32_t* id = ids + t * k;
    for (int j = 0; j < k; ++j) {
      if (id[j] < 0 || id[j] >= num_experts) return true;
      for (int i = 0; i < j; ++i)
        if (id[i] == id[j]) return true;
    }
    return false;
  }
};

}  // namespace kernels

// Routing of a batch on a Thrust system: ids [tokens, k] (int32) and weights [tokens, k], row-major.
template <class T, class Backend = ThrustDeviceBackend>
struct Routing {
  typename Backend::template vector<std::int32_t> ids;
  typename Backend::template vector<T> weights;
  long tokens = 0;
  int topk = 0;
};

// The Thrust counterpart of mrr::TopKRouter (no capacity dropping: that stays on the host).
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
    mrr::detail::require(!config_.capacity_factor.has_value(), fn,
                         "capacity dropping is not implemented on the Thrust backend; route on the device and "
                         "apply the capacity on the host, or unset capacity_factor");
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

  Routing<T, Backend> route(const vector<T>& logits) const { return run(logits, nullptr, nullptr, "route"); }

  // Replays `ids` [tokens, k]; with a replay_mask [tokens], rows whose mask is 0 route natively.
  Routing<T, Backend> replay(const vector<T>& logits, const vector<std::int32_t>& ids) const {
    return run(logits, &ids, nullptr, "replay");
  }
  Routing<T, Backend> replay(const vector<T>& logits, const vector<std::int32_t>& ids,
                             const vector<std::uint8_t>& replay_mask) const {
    return run(logits, &ids, &replay_mask, "replay");
  }

  // Gradient of sum(grad_weights * weights) w.r.t. the logits [tokens, E] for the given ids.
  vector<T> backward(const vector<T>& logits, const vector<std::int32_t>& ids, const vector<T>& grad_weights) const {
    const long tokens = rows_of(logits, "device::TopKRouter::backward");
    const auto k = static_cast<std::size_t>(topk());
    mrr::detail::require(ids.size() == static_cast<std::size_t>(tokens) * k && grad_weights.size() == ids.size(),
                         "device::TopKRouter::backward", "ids and grad_weights must be [", tokens, ", ", k, "]");
    check_replay_ids(ids, nullptr, tokens, "device::TopKRouter::backward");
    vector<T> grad(logits.size());
    thrust::for_each(Backend::policy(), thrust::counting_iterator<long>(0), thrust::counting_iterator<long>(tokens),
                     kernels::BackwardRows<T>{params_, raw(logits), raw(ids), raw(grad_weights), raw(grad)});
    return grad;
  }

 private:
  template <class V>
  static auto raw(const V& v) {
    return thrust::raw_pointer_cast(v.data());
  }
  template <class V>
  static auto raw(V& v) {
    return thrust::raw_pointer_cast(v.data());
  }

  long rows_of(const vector<T>& logits, const char* fn) const {
    mrr::detail::require(logits.size() % static_cast<std::size_t>(num_experts()) == 0, fn, "logits have ",
                         logits.size(), " values, not a multiple of ", num_experts(), " experts");
    return static_cast<long>(logits.size() / static_cast<std::size_t>(num_experts()));
  }

  static void check_finite(const vector<T>& v, const char* fn, const char* what) {
    if (thrust::any_of(Backend::policy(), v.begin(), v.end(), kernels::InvalidLogit<T>{})) [[unlikely]]
      mrr::detail::throw_invalid_argument(fn, what, " hold NaN or +inf");
  }

  void check_replay_ids(const vector<std::int32_t>& ids, const vector<std::uint8_t>* mask, long tokens,
                        const char* fn) const {
    const kernels::InvalidReplayRow bad{raw(ids), mask ? raw(*mask) : nullptr, topk(), num_experts()};
    if (thrust::any_of(Backend::policy(), thrust::counting_iterator<long>(0), thrust::counting_iterator<long>(tokens),
                       bad)) [[unlikely]]
      mrr::detail::throw_invalid_argument(fn, "a replayed row has an expert id outside [0, ", num_experts(),
                                          ") or repeats an id");
  }

  Routing<T, Backend> run(const vector<T>& logits, const vector<std::int32_t>* replay_ids,
                          const vector<std::uint8_t>* mask, const char* what) const {
    const char* fn = replay_ids ? "device::TopKRouter::replay" : "device::TopKRouter::route";
    (void)what;
    const long tokens = rows_of(logits, fn);
    const auto k = static_cast<std::size_t>(topk());
    check_finite(logits, fn, "logits");
    if (replay_ids) {
      mrr::detail::require(replay_ids->size() == static_cast<std::size_t>(tokens) * k, fn, "'ids' has ",
                           replay_ids->size(), " values, expected [", tokens, ", ", k, "]");
      if (mask)
        mrr::detail::require(mask->size() == static_cast<std::size_t>(tokens), fn, "'replay_mask' has ", mask->size(),
                             " entries for ", tokens, " rows of logits");
      check_replay_ids(*replay_ids, mask, tokens, fn);
    }
    Routing<T, Backend> out{vector<std::int32_t>(static_cast<std::size_t>(tokens) * k),
                            vector<T>(static_cast<std::size_t>(tokens) * k), tokens, topk()};
    const kernels::RouteRows<T> rows{params_,
                                     raw(logits),
                                     config_.use_expert_bias ? raw(bias_) : nullptr,
                                     replay_ids ? raw(*replay_ids) : nullptr,
                                     mask ? raw(*mask) : nullptr,
                                     raw(out.ids),
                                     raw(out.weights)};
    thrust::for_each(Backend::policy(), thrust::counting_iterator<long>(0), thrust::counting_iterator<long>(tokens),
                     rows);
    return out;
  }

  RouterConfig config_;
  RouterParams params_;
  vector<T> bias_;
};

}  // namespace device
MRR_NAMESPACE_END
