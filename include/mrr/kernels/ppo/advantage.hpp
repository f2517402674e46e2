// Advantage estimators' row and group math with verl's semantics: GAE's backward recurrence over
// one sequence (as affine maps: one step, generic over the value type so the host's SIMD lanes run
// the same statement; a row; and the maps themselves for a parallel scan over time), and the
// per-group statistics and per-response scalars of grpo (with and without the std), rloo and
// rloo_vectorized. The one definition for the host (ppo/advantage.hpp) and the Thrust path
// (thrust/ppo.hpp).
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/kernels/ppo/common.hpp>

#include <cmath>

MRR_NAMESPACE_BEGIN
namespace kernels::ppo {

// GAE's recurrence backwards in time, with verl's masked updates x' = new m + (1 - m) x:
// observation / padding tokens (m = 0) carry the next value and the running advantage through
// unchanged. Each update is an affine map x = a x' + b of the carried value, with a and b free of
// it: one multiply-add on the dependency chain per step (the scalar loop is latency-bound), and
// composable for a parallel scan over time (applying (a1, b1) then (a2, b2) gives
// (a2 a1, a2 b1 + b2)). V is T, or a packet of independent rows (the host runs 8 rows in SIMD
// lanes); `one` is V's 1.
template <class V>
struct Affine {
  V a, b;
};

template <class V>
MRR_HOST_DEVICE inline Affine<V> compose(const Affine<V>& first, const Affine<V>& then) {
  return {then.a * first.a, then.a * first.b + then.b};
}

// next_value = m v + (1 - m) next_value'.
template <class V>
MRR_HOST_DEVICE inline Affine<V> gae_next_value_map(const V& value, const V& mask, const V& one) {
  return {one - mask, mask * value};
}

// last_gae = m (delta + gl last_gae') + (1 - m) last_gae', delta = r + gamma next_value' - v.
template <class V, class T>
MRR_HOST_DEVICE inline Affine<V> gae_advantage_map(const V& reward, const V& value, const V& mask, const V& next_value,
                                                   const V& one, T gamma, T gamma_lambda) {
  const V delta = reward + gamma * next_value - value;
  return {mask * gamma_lambda + (one - mask), mask * delta};
}

// One step backwards: the two maps applied to the carried values.
template <class V, class T>
MRR_HOST_DEVICE inline void gae_step(const V& reward, const V& value, const V& mask, const V& one, T gamma,
                                     T gamma_lambda, V& next_value, V& last_gae) {
  const Affine<V> advantage = gae_advantage_map(reward, value, mask, next_value, one, gamma, gamma_lambda);
  const Affine<V> carried = gae_next_value_map(value, mask, one);
  last_gae = advantage.a * last_gae + advantage.b;
  next_value = carried.a * next_value + carried.b;
}

// GAE over one sequence of n tokens: advantages (before whitening) and returns = advantages + values.
template <class T>
MRR_HOST_DEVICE inline void gae_row(const T* rewards, const T* values, const T* mask, T* advantages, T* returns, long n,
                                    T gamma, T gamma_lambda) {
  T next_value = 0, last_gae = 0;
  for (long j = n - 1; j >= 0; --j) {
    gae_step<T, T>(rewards[j], values[j], mask[j], T(1), gamma, gamma_lambda, next_value, last_gae);
    advantages[j] = last_gae;
    returns[j] = last_gae + values[j];
  }
}

// Mean and unbiased standard deviation (torch.std) of a group's scores, members given by index,
// summed in member order in T.
template <class T, class Index>
MRR_HOST_DEVICE inline T group_mean(const T* scores, const Index* members, long count) {
  T sum = 0;
  for (long k = 0; k < count; ++k)
    sum += scores[members[k]];
  return sum / T(static_cast<double>(count));
}

template <class T, class Index>
MRR_HOST_DEVICE inline T group_std(const T* scores, const Index* members, long count, T mean) {
  using std::sqrt;
  T sum = 0;
  for (long k = 0; k < count; ++k) {
    const T d = scores[members[k]] - mean;
    sum += d * d;
  }
  return sqrt(sum / T(static_cast<double>(count - 1)));
}

// The placeholder "std" verl gives a singleton group is a float32 tensor, so std + epsilon is
// rounded to float32 (1 + 1e-6 becomes 1.00000095...). Reproduced so that results match bit for bit.
MRR_HOST_DEVICE inline double singleton_std_plus_epsilon(double epsilon) {
  return static_cast<double>(1.0f + static_cast<float>(epsilon));
}

enum class OutcomeEstimator {
  grpo,             // (s - mean) / (std + epsilon); a singleton group: s / singleton_divisor
  grpo_mean_only,   // Dr.GRPO: s - mean; a singleton group: s
  rloo,             // s n / (n - 1) - mean n / (n - 1); a singleton group keeps s
  rloo_vectorized,  // (n s - sum) / (n - 1); a singleton group gets 0
};

// The per-response scalars of one group (members in sample order): writes scalars[members[k]].
// singleton_divisor is singleton_std_plus_epsilon(epsilon).
template <class T, class Index>
MRR_HOST_DEVICE inline void group_outcome(const T* scores, const Index* members, long count, OutcomeEstimator estimator,
                                          T epsilon, T singleton_divisor, T* scalars) {
  const T n = T(static_cast<double>(count));
  switch (estimator) {
    case OutcomeEstimator::grpo:
    case OutcomeEstimator::grpo_mean_only: {
      T mean = 0, divisor = singleton_divisor;
      if (count > 1) {
        mean = group_mean(scores, members, count);
        divisor = group_std(scores, members, count, mean) + epsilon;
      }
      for (long k = 0; k < count; ++k) {
        const T s = scores[members[k]];
        scalars[members[k]] = estimator == OutcomeEstimator::grpo ? (s - mean) / divisor : s - mean;
      }
      return;
    }
    case OutcomeEstimator::rloo: {
      const T mean = count > 1 ? group_mean(scores, members, count) : T(0);
      for (long k = 0; k < count; ++k) {
        const T s = scores[members[k]];
        scalars[members[k]] = count < 2 ? s : s * n / (n - T(1)) - mean * n / (n - T(1));
      }
      return;
    }
    case OutcomeEstimator::rloo_vectorized: {
      T sum = 0;
      for (long k = 0; k < count; ++k)
        sum += scores[members[k]];
      for (long k = 0; k < count; ++k)
        scalars[members[k]] = count < 2 ? T(0) : (n * scores[members[k]] - sum) / (n - T(1));
      return;
    }
  }
}

// Outcome estimators broadcast each response's scalar over its tokens: advantage = scalar m.
template <class T>
MRR_HOST_DEVICE inline T outcome_token(T scalar, T mask) {
  return mask * scalar;
}

}  // namespace kernels::ppo
MRR_NAMESPACE_END
