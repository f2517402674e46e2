// mrr-requires: mrr_thrust_omp
// PPO / GRPO utilities on a Thrust system (the device mirror of ppo/advantage.hpp, masked.hpp and
// kl.hpp, same verl semantics). GAE on a GPU runs as two segmented reverse scans of affine maps
// x_t = a_t x_{t+1} + b_t (one for the carried next value, one for the advantage), so time is
// parallel too (results equal the sequential recurrence up to floating-point reassociation); on
// CPU threads (the OpenMP system) as the sequential recurrence over blocks of rows.
// Tensors are row-major [rows, cols] Thrust vectors; sums behind means run in double.
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>
#include <mrr/kernels/ppo/kl.hpp>
#include <mrr/thrust/backend.hpp>

#include <thrust/for_each.h>
#include <thrust/functional.h>
#include <thrust/iterator/constant_iterator.h>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/iterator/permutation_iterator.h>
#include <thrust/iterator/transform_iterator.h>
#include <thrust/pair.h>
#include <thrust/reduce.h>
#include <thrust/scan.h>
#include <thrust/scatter.h>
#include <thrust/sequence.h>
#include <thrust/sort.h>
#include <thrust/transform.h>
#include <thrust/transform_reduce.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

MRR_NAMESPACE_BEGIN
namespace device {

inline constexpr double kMaskCountEpsilon = 1e-8;       // verl masked_mean: sum / (count + 1e-8)
inline constexpr double kWhitenVarianceEpsilon = 1e-8;  // verl masked_whiten: rsqrt(var + 1e-8)

template <class T, class Backend = ThrustDeviceBackend>
struct AdvantageResult {
  typename Backend::template vector<T> advantages, returns;
};

namespace kernels {

// x = a x' + b, composed along the scan: applying (a1,b1) first then (a2,b2) gives
// (a2 a1, a2 b1 + b2). Associative, so a parallel scan computes the recurrence.
template <class T>
struct Affine {
  T a, b;
};

template <class T>
struct ComposeAffine {
  MRR_HOST_DEVICE Affine<T> operator()(const Affine<T>& first, const Affine<T>& then) const {
    return {then.a * first.a, then.a * first.b + then.b};
  }
};

// Scan position j walks the flat [rows, cols] array backwards: element n - 1 - j.
struct ReverseRowKey {
  long n, cols;
  MRR_HOST_DEVICE long operator()(long j) const { return (n - 1 - j) / cols; }
};

// next_value_t = m v + (1 - m) next_value_{t+1}.
template <class T>
struct NextValueStep {
  const T *values, *mask;
  long n;
  MRR_HOST_DEVICE Affine<T> operator()(long j) const {
    const long i = n - 1 - j;
    return {T(1) - mask[i], mask[i] * values[i]};
  }
};

// last_gae_t = m (delta_t + gl last_gae_{t+1}) + (1 - m) last_gae_{t+1},
// delta_t = r_t + gamma next_value_{t+1} - v_t (next_value_{t+1} is the previous scan position).
template <class T>
struct AdvantageStep {
  const T *rewards, *values, *mask;
  const Affine<T>* next_value;  // scan results of NextValueStep
  long n, cols;
  T gamma, gamma_lambda;
  MRR_HOST_DEVICE Affine<T> operator()(long j) const {
    const long i = n - 1 - j;
    const T nv = (i % cols == cols - 1) ? T(0) : next_value[j - 1].b;
    const T m = mask[i];
    const T delta = rewards[i] + gamma * nv - values[i];
    return {m * gamma_lambda + (T(1) - m), m * delta};
  }
};

template <class T>
struct WriteAdvantage {
  const Affine<T>* scanned;
  const T* values;
  T *advantages, *returns;
  long n;
  MRR_HOST_DEVICE void operator()(long j) const {
    const long i = n - 1 - j;
    advantages[i] = scanned[j].b;
    returns[i] = scanned[j].b + values[i];
  }
};

// GAE for a block of kGaeRows rows by the sequential recurrence, one row after the other (rows
// of a power-of-two length sit at the same cache set: interleaving them thrashes L1), each step
// one fused multiply-add on the carried value (last = a last + b, a and b free of it), with the
// block's masked count, sum and M2 about the block mean of the advantages for the whitening
// statistics. The OpenMP system's algorithm: rows are spread over threads, time stays sequential.
inline constexpr int kGaeRows = 8;

template <class T>
struct GaeRowBlock {
  const T *rewards, *values, *mask;
  T *advantages, *returns;
  double* moments;  // [blocks, 3]: count, sum, M2
  long rows, cols;
  T gamma, gamma_lambda;
  MRR_HOST_DEVICE void operator()(long block) const {
    const long r0 = block * kGaeRows, r1 = r0 + kGaeRows < rows ? r0 + kGaeRows : rows;
    double count = 0, sum = 0;
    for (long r = r0; r < r1; ++r) {
      T next_value = 0, last_gae = 0;
      for (long at = r * cols + cols - 1; at >= r * cols; --at) {
        const T m = mask[at], v = values[at];
        const T delta = rewards[at] + gamma * next_value - v;
        last_gae = (m * gamma_lambda + (T(1) - m)) * last_gae + m * delta;
        next_value = (T(1) - m) * next_value + m * v;
        advantages[at] = last_gae;
        returns[at] = last_gae + v;
      }
    }
    for (long at = r0 * cols; at < r1 * cols; ++at) {
      const double m = static_cast<double>(mask[at]);
      count += m;
      sum += m != 0 ? static_cast<double>(advantages[at]) * m : 0.0;
    }
    const double mean = count != 0 ? sum / count : 0.0;
    double m2 = 0;
    for (long at = r0 * cols; at < r1 * cols; ++at) {
      const double m = static_cast<double>(mask[at]);
      const double d = static_cast<double>(advantages[at]) - mean;
      m2 += m != 0 ? d * d * m : 0.0;
    }
    moments[3 * block] = count;
    moments[3 * block + 1] = sum;
    moments[3 * block + 2] = m2;
  }
};

template <class T>
struct MaskedTerm {  // (m, v m) in double
  const T *values, *mask;
  MRR_HOST_DEVICE thrust::pair<double, double> operator()(long i) const {
    const double m = static_cast<double>(mask[i]);
    return {m, m != 0 ? static_cast<double>(values[i]) * m : 0.0};
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
    const double m = static_cast<double>(mask[i]);
    if (m == 0) return 0.0;
    const double d = static_cast<double>(values[i]) - mean;
    return d * d * m;
  }
};

template <class T>
struct Whiten {
  T* values;
  T mean, inv_std, add_back;
  MRR_HOST_DEVICE void operator()(long i) const { values[i] = (values[i] - mean) * inv_std + add_back; }
};

template <class T>
struct MeanOfSums {  // (weight, weighted sum) -> verl's masked mean
  MRR_HOST_DEVICE T operator()(const thrust::pair<double, double>& p) const {
    return static_cast<T>(p.second / (p.first + 1e-8));
  }
};

template <class T>
struct ToDouble {
  MRR_HOST_DEVICE double operator()(T x) const { return static_cast<double>(x); }
};

template <class T>
struct RowOf {
  long cols;
  MRR_HOST_DEVICE long operator()(long i) const { return i / cols; }
};

template <class T>
struct ReadAt {
  const T* data;
  MRR_HOST_DEVICE T operator()(long i) const { return data[i]; }
};

// Per-response scalar of the outcome estimators, from the row scores and per-group sums.
template <class T>
struct OutcomeScalar {
  const T* scores;
  const std::int32_t* group;
  const double *group_count, *group_sum, *group_m2;
  T* scalar;
  int estimator;  // 0 grpo, 1 grpo without std (Dr.GRPO), 2 rloo, 3 rloo_vectorized
  T epsilon, singleton_divisor;
  MRR_HOST_DEVICE void operator()(long i) const {
    using std::sqrt;
    const int g = group[i];
    const T s = scores[i];
    const double count = group_count[g];
    if (estimator <= 1) {
      T mean = 0, divisor = singleton_divisor;
      if (count > 1) {
        mean = static_cast<T>(group_sum[g] / count);
        divisor = static_cast<T>(sqrt(group_m2[g] / (count - 1))) + epsilon;
      }
      scalar[i] = estimator == 0 ? (s - mean) / divisor : s - mean;
    } else if (estimator == 2) {
      if (count < 2) {
        scalar[i] = s;
        return;
      }
      const T n = static_cast<T>(count), mean = static_cast<T>(group_sum[g] / count);
      scalar[i] = s * n / (n - T(1)) - mean * n / (n - T(1));
    } else {
      const T n = static_cast<T>(count);
      scalar[i] = count < 2 ? T(0) : (n * s - static_cast<T>(group_sum[g])) / (n - T(1));
    }
  }
};

template <class T>
struct GroupCentered {  // (s - group mean)^2 of one response, in double
  const T* scores;
  const std::int32_t* group;
  const double *group_count, *group_sum;
  MRR_HOST_DEVICE double operator()(long i) const {
    const int g = group[i];
    const double d = static_cast<double>(scores[i]) - group_sum[g] / group_count[g];
    return d * d;
  }
};

template <class T>
struct Broadcast {
  const T *scalar, *mask;
  T *advantages, *returns;
  long cols;
  MRR_HOST_DEVICE void operator()(long i) const {
    advantages[i] = returns[i] = mask[i] * scalar[i / cols];
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

// (weight, weighted sum, M2) of values under mask, in double.
template <class T, class Backend>
void masked_sums(const typename Backend::template vector<T>& values, const typename Backend::template vector<T>& mask,
                 double& weight, double& sum, double* m2) {
  const auto policy = Backend::policy();
  const long n = static_cast<long>(values.size());
  const auto ws = thrust::transform_reduce(policy, thrust::counting_iterator<long>(0), thrust::counting_iterator<long>(n),
                                           kernels::MaskedTerm<T>{raw(values), raw(mask)},
                                           thrust::pair<double, double>(0.0, 0.0), kernels::AddPair{});
  weight = ws.first;
  sum = ws.second;
  if (m2 != nullptr) {
    const double mean = weight != 0 ? sum / weight : 0.0;
    *m2 = thrust::transform_reduce(policy, thrust::counting_iterator<long>(0), thrust::counting_iterator<long>(n),
                                   kernels::CenteredSquare<T>{raw(values), raw(mask), mean}, 0.0,
                                   thrust::plus<double>());
  }
}

}  // namespace ppo_detail

// verl masked_mean over every element: sum(v m) / (sum(m) + 1e-8).
template <class T, class Backend = ThrustDeviceBackend>
T masked_mean(const typename Backend::template vector<T>& values, const typename Backend::template vector<T>& mask) {
  mrr::detail::require(values.size() == mask.size(), "device::masked_mean", "'values' and 'mask' differ in size");
  double w = 0, s = 0;
  ppo_detail::masked_sums<T, Backend>(values, mask, w, s, nullptr);
  return static_cast<T>(s / (w + kMaskCountEpsilon));
}

// Mean (verl's, with the count epsilon) and variance (Bessel-corrected when unbiased).
template <class T, class Backend = ThrustDeviceBackend>
thrust::pair<T, T> masked_mean_var(const typename Backend::template vector<T>& values,
                                   const typename Backend::template vector<T>& mask, bool unbiased = true) {
  constexpr const char* fn = "device::masked_var";
  mrr::detail::require(values.size() == mask.size(), fn, "'values' and 'mask' differ in size");
  double w = 0, s = 0, m2 = 0;
  ppo_detail::masked_sums<T, Backend>(values, mask, w, s, &m2);
  const double mean = s / (w + kMaskCountEpsilon);
  const double exact = w != 0 ? s / w : 0.0, offset = exact - mean;
  double var = (m2 + w * offset * offset) / (w + kMaskCountEpsilon);
  if (unbiased) {
    mrr::detail::require(w != 0, fn, "'mask' selects no element; the variance is undefined");
    mrr::detail::require(w != 1, fn, "'mask' selects a single element; the unbiased variance divides by zero");
    var *= w / (w - 1);
  }
  return {static_cast<T>(mean), static_cast<T>(var)};
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
  using std::sqrt;
  const auto mv = masked_mean_var<T, Backend>(values, mask, true);
  const T inv_std = T(1) / sqrt(mv.second + T(kWhitenVarianceEpsilon));
  thrust::for_each(Backend::policy(), thrust::counting_iterator<long>(0),
                   thrust::counting_iterator<long>(static_cast<long>(values.size())),
                   kernels::Whiten<T>{ppo_detail::raw(values), mv.first, inv_std, shift_mean ? T(0) : mv.first});
}

// Row sums of v m / (row sum of m + 1e-8): verl masked_mean(axis=-1).
template <class T, class Backend = ThrustDeviceBackend>
typename Backend::template vector<T> masked_row_mean(const typename Backend::template vector<T>& values,
                                                     const typename Backend::template vector<T>& mask, long cols) {
  const long n = static_cast<long>(values.size()), rows = n / cols;
  const auto policy = Backend::policy();
  typename Backend::template vector<long> keys(static_cast<std::size_t>(rows));
  typename Backend::template vector<thrust::pair<double, double>> sums(static_cast<std::size_t>(rows));
  thrust::reduce_by_key(policy, thrust::make_transform_iterator(thrust::counting_iterator<long>(0), kernels::RowOf<T>{cols}),
                        thrust::make_transform_iterator(thrust::counting_iterator<long>(n), kernels::RowOf<T>{cols}),
                        thrust::make_transform_iterator(thrust::counting_iterator<long>(0),
                                                        kernels::MaskedTerm<T>{ppo_detail::raw(values), ppo_detail::raw(mask)}),
                        keys.begin(), sums.begin(), thrust::equal_to<long>(), kernels::AddPair{});
  typename Backend::template vector<T> out(static_cast<std::size_t>(rows));
  thrust::transform(policy, sums.begin(), sums.end(), out.begin(), kernels::MeanOfSums<T>{});
  return out;
}

// verl whitens GAE advantages with its own statistics (count epsilon in the mean, variance around
// that mean), from the masked count w, sum s and M2 about the exact mean s / w.
template <class T, class Backend>
void whiten_advantages(typename Backend::template vector<T>& advantages, double w, double s, double m2,
                       const char* fn) {
  mrr::detail::require(w != 0, fn, "'response_mask' selects no element; whitening is undefined");
  mrr::detail::require(w != 1, fn, "'response_mask' selects a single element; the unbiased variance divides by zero");
  const double mean = s / (w + kMaskCountEpsilon), offset = s / w - mean;
  const double var = (m2 + w * offset * offset) / (w + kMaskCountEpsilon) * (w / (w - 1));
  using std::sqrt;
  const T inv_std = T(1) / sqrt(static_cast<T>(var) + T(kWhitenVarianceEpsilon));
  thrust::for_each(Backend::policy(), thrust::counting_iterator<long>(0),
                   thrust::counting_iterator<long>(static_cast<long>(advantages.size())),
                   kernels::Whiten<T>{ppo_detail::raw(advantages), static_cast<T>(mean), inv_std, T(0)});
}

// How GAE walks time: `scan` (two segmented reverse scans of affine maps, parallel over time: what
// a GPU needs) or `rows` (the sequential recurrence, blocks of rows in parallel: what CPU threads
// need). `automatic` picks rows on the OpenMP and host systems and scan on CUDA.
enum class GaeAlgorithm { automatic, scan, rows };

template <class Backend>
constexpr GaeAlgorithm resolve_gae_algorithm(GaeAlgorithm a) {
  if (a != GaeAlgorithm::automatic) return a;
#if THRUST_DEVICE_SYSTEM == THRUST_DEVICE_SYSTEM_CUDA
  return std::is_same_v<Backend, ThrustBackend<ThrustHostSystem>> ? GaeAlgorithm::rows : GaeAlgorithm::scan;
#else
  return GaeAlgorithm::rows;
#endif
}

// verl "gae": advantages whitened over the mask (every element), returns = advantages + values
// before whitening. Inputs [rows, cols].
template <class T, class Backend = ThrustDeviceBackend>
AdvantageResult<T, Backend> compute_gae_advantage_return(const typename Backend::template vector<T>& rewards,
                                                         const typename Backend::template vector<T>& values,
                                                         const typename Backend::template vector<T>& mask, long cols,
                                                         double gamma, double lam,
                                                         GaeAlgorithm algorithm = GaeAlgorithm::automatic) {
  constexpr const char* fn = "device::compute_gae_advantage_return";
  using ppo_detail::raw;
  const long n = static_cast<long>(rewards.size());
  mrr::detail::require(cols > 0 && n % cols == 0 && values.size() == rewards.size() && mask.size() == rewards.size(), fn,
                       "rewards, values and mask must all be [rows, ", cols, "]");
  const auto policy = Backend::policy();
  if (resolve_gae_algorithm<Backend>(algorithm) == GaeAlgorithm::rows) {
    const long rows = n / cols, blocks = (rows + kernels::kGaeRows - 1) / kernels::kGaeRows;
    AdvantageResult<T, Backend> out{typename Backend::template vector<T>(static_cast<std::size_t>(n)),
                                    typename Backend::template vector<T>(static_cast<std::size_t>(n))};
    typename Backend::template vector<double> moments(static_cast<std::size_t>(3 * blocks));
    thrust::for_each(policy, thrust::counting_iterator<long>(0), thrust::counting_iterator<long>(blocks),
                     kernels::GaeRowBlock<T>{raw(rewards), raw(values), raw(mask), raw(out.advantages),
                                             raw(out.returns), raw(moments), rows, cols, static_cast<T>(gamma),
                                             static_cast<T>(gamma * lam)});
    // Merge the blocks' moments in block order (Chan et al.): deterministic for any thread count.
    const thrust::host_vector<double> h(moments);
    double w = 0, s = 0, m2 = 0;
    for (long b = 0; b < blocks; ++b) {
      const double wb = h[static_cast<std::size_t>(3 * b)], sb = h[static_cast<std::size_t>(3 * b + 1)],
                   m2b = h[static_cast<std::size_t>(3 * b + 2)];
      if (wb == 0) continue;
      if (w != 0) {
        const double d = sb / wb - s / w;
        m2 += m2b + d * d * w * wb / (w + wb);
      } else {
        m2 = m2b;
      }
      w += wb;
      s += sb;
    }
    whiten_advantages<T, Backend>(out.advantages, w, s, m2, fn);
    return out;
  }
  const auto keys = thrust::make_transform_iterator(thrust::counting_iterator<long>(0), kernels::ReverseRowKey{n, cols});
  typename Backend::template vector<kernels::Affine<T>> next_value(static_cast<std::size_t>(n)),
      scanned(static_cast<std::size_t>(n));
  thrust::inclusive_scan_by_key(
      policy, keys, keys + n,
      thrust::make_transform_iterator(thrust::counting_iterator<long>(0), kernels::NextValueStep<T>{raw(values), raw(mask), n}),
      next_value.begin(), thrust::equal_to<long>(), kernels::ComposeAffine<T>{});
  const kernels::AdvantageStep<T> step{raw(rewards),     raw(values), raw(mask), raw(next_value), n, cols,
                                       static_cast<T>(gamma), static_cast<T>(gamma * lam)};
  thrust::inclusive_scan_by_key(policy, keys, keys + n,
                                thrust::make_transform_iterator(thrust::counting_iterator<long>(0), step),
                                scanned.begin(), thrust::equal_to<long>(), kernels::ComposeAffine<T>{});
  AdvantageResult<T, Backend> out{typename Backend::template vector<T>(static_cast<std::size_t>(n)),
                                  typename Backend::template vector<T>(static_cast<std::size_t>(n))};
  thrust::for_each(policy, thrust::counting_iterator<long>(0), thrust::counting_iterator<long>(n),
                   kernels::WriteAdvantage<T>{raw(scanned), raw(values), raw(out.advantages), raw(out.returns), n});
  double w = 0, s = 0, m2 = 0;
  ppo_detail::masked_sums<T, Backend>(out.advantages, mask, w, s, &m2);
  whiten_advantages<T, Backend>(out.advantages, w, s, m2, fn);
  return out;
}

enum class OutcomeEstimator { grpo, rloo, rloo_vectorized };

// verl "grpo" (norm_adv_by_std_in_grpo; Dr.GRPO without), "rloo" and "rloo_vectorized".
// `group` [rows] holds each response's group as an int in [0, num_groups) (map verl's uid labels
// to ints on the host). Score = sum of the row's rewards (every column, as verl).
template <class T, class Backend = ThrustDeviceBackend>
AdvantageResult<T, Backend> compute_outcome_advantage(OutcomeEstimator estimator,
                                                      const typename Backend::template vector<T>& rewards,
                                                      const typename Backend::template vector<T>& mask, long cols,
                                                      const typename Backend::template vector<std::int32_t>& group,
                                                      int num_groups, double epsilon = 1e-6,
                                                      bool norm_adv_by_std_in_grpo = true) {
  constexpr const char* fn = "device::compute_outcome_advantage";
  using ppo_detail::raw;
  const long n = static_cast<long>(rewards.size()), rows = n / cols;
  mrr::detail::require(cols > 0 && n % cols == 0 && mask.size() == rewards.size() &&
                           static_cast<long>(group.size()) == rows,
                       fn, "rewards and mask must be [rows, ", cols, "] and group [rows]");
  const auto policy = Backend::policy();
  // Row scores.
  typename Backend::template vector<long> row_keys(static_cast<std::size_t>(rows));
  typename Backend::template vector<T> scores(static_cast<std::size_t>(rows));
  const auto row_of = thrust::make_transform_iterator(thrust::counting_iterator<long>(0), kernels::RowOf<T>{cols});
  thrust::reduce_by_key(policy, row_of, row_of + n, rewards.begin(), row_keys.begin(), scores.begin());
  // Group count, sum and M2 (double), scattered by group id: the groups are small, so an atomic-free
  // pass over the responses sorted by group.
  typename Backend::template vector<std::int32_t> sorted_group(group.begin(), group.end()),
      order(static_cast<std::size_t>(rows));
  thrust::sequence(policy, order.begin(), order.end());
  thrust::stable_sort_by_key(policy, sorted_group.begin(), sorted_group.end(), order.begin());
  typename Backend::template vector<std::int32_t> unique_groups(static_cast<std::size_t>(rows));
  typename Backend::template vector<double> sums(static_cast<std::size_t>(rows)), counts(static_cast<std::size_t>(rows));
  const auto score_in_order = thrust::make_permutation_iterator(
      thrust::make_transform_iterator(scores.begin(), kernels::ToDouble<T>{}),
      order.begin());
  const auto ends = thrust::reduce_by_key(policy, sorted_group.begin(), sorted_group.end(), score_in_order,
                                          unique_groups.begin(), sums.begin());
  const long present = ends.first - unique_groups.begin();
  thrust::reduce_by_key(policy, sorted_group.begin(), sorted_group.end(), thrust::constant_iterator<double>(1.0),
                        unique_groups.begin(), counts.begin());
  typename Backend::template vector<double> group_sum(static_cast<std::size_t>(num_groups), 0.0),
      group_count(static_cast<std::size_t>(num_groups), 1.0), group_m2(static_cast<std::size_t>(num_groups), 0.0);
  thrust::scatter(policy, sums.begin(), sums.begin() + present, unique_groups.begin(), group_sum.begin());
  thrust::scatter(policy, counts.begin(), counts.begin() + present, unique_groups.begin(), group_count.begin());
  const auto centered = thrust::make_permutation_iterator(
      thrust::make_transform_iterator(thrust::counting_iterator<long>(0),
                                      kernels::GroupCentered<T>{raw(scores), raw(group), raw(group_count), raw(group_sum)}),
      order.begin());
  thrust::reduce_by_key(policy, sorted_group.begin(), sorted_group.end(), centered, unique_groups.begin(), sums.begin());
  thrust::scatter(policy, sums.begin(), sums.begin() + present, unique_groups.begin(), group_m2.begin());

  typename Backend::template vector<T> scalar(static_cast<std::size_t>(rows));
  const int code = estimator == OutcomeEstimator::grpo ? (norm_adv_by_std_in_grpo ? 0 : 1)
                                                       : (estimator == OutcomeEstimator::rloo ? 2 : 3);
  // verl's singleton "std" is a float32 tensor: 1 + epsilon rounded to float32.
  const T singleton = static_cast<T>(static_cast<double>(1.0f + static_cast<float>(epsilon)));
  thrust::for_each(policy, thrust::counting_iterator<long>(0), thrust::counting_iterator<long>(rows),
                   kernels::OutcomeScalar<T>{raw(scores), raw(group), raw(group_count), raw(group_sum), raw(group_m2),
                                             raw(scalar), code, static_cast<T>(epsilon), singleton});
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
