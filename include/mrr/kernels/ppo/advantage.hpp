// Advantage estimators' row and group math with verl's semantics: GAE's backward recurrence over
// one sequence (as affine maps: one step, generic over the value type so the host's SIMD lanes run
// the same statement; a row; and the maps themselves for a parallel scan over time), and the
// per-group statistics and per-response scalars of grpo (with and without the std), rloo and
// rloo_vectorized. The one definition for the host (ppo/advantage.hpp) and the Thrust path
// (thrust/ppo.hpp).
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/kernels/ppo/common.hpp>
#include <mrr/kernels/ppo/masked.hpp>

#include <cmath>
#include <type_traits>

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

// GAE over a row cut into chunks of time (a GPU's algorithm: rows x chunks independent work items).
// A chunk's effect on what it carries out (backwards in time: the values at its first token) is
// affine in what it receives (at its last token): next_value_out = alpha nv_in + beta and
// last_gae_out = p gae_in + q nv_in + r, found by running the chunk's steps on the coefficients.
// Chaining the chunks' maps along a row gives every chunk's carry-in; each chunk then runs
// gae_step from it, as gae_row does. The carry-ins come from composed maps, so results equal the
// sequential recurrence up to floating-point reassociation (as the scan's), the same for any
// thread count.
template <class T>
struct GaeChunkMap {
  T alpha, beta, p, q, r;
};

// A chunk of at most N tokens staged in registers: every load is issued before the recurrence
// runs, so a GPU thread waits for memory once per chunk rather than once per token (N is a
// compile-time bound, so the arrays stay in registers; `len` <= N tokens are real).
template <int N, class T>
struct GaeChunkData {
  T reward[N], value[N], mask[N];
  MRR_HOST_DEVICE GaeChunkData(const T* rewards, const T* values, const T* masks, long lo, int len) {
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (int i = 0; i < N; ++i) {
      const bool in = i < len;
      reward[i] = in ? rewards[lo + i] : T(0);
      value[i] = in ? values[lo + i] : T(0);
      mask[i] = in ? masks[lo + i] : T(0);
    }
  }
};

template <int N, class T>
MRR_HOST_DEVICE inline GaeChunkMap<T> gae_chunk_map(const T* rewards, const T* values, const T* mask, long lo, int len,
                                                    T gamma, T gamma_lambda) {
  const GaeChunkData<N, T> d(rewards, values, mask, lo, len);
  GaeChunkMap<T> f{T(1), T(0), T(1), T(0), T(0)};  // the identity
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int j = N - 1; j >= 0; --j) {
    if (j >= len) continue;
    const T m = d.mask[j], one_minus = T(1) - d.mask[j];
    const T a = m * gamma_lambda + one_minus;  // the advantage map's slope (gae_advantage_map)
    // last_gae = a last_gae' + m (r + gamma next_value' - v), next_value' = alpha nv_in + beta.
    f.p = a * f.p;
    f.q = a * f.q + m * gamma * f.alpha;
    f.r = a * f.r + m * (d.reward[j] + gamma * f.beta - d.value[j]);
    // next_value = (1 - m) next_value' + m v (gae_next_value_map).
    f.alpha = one_minus * f.alpha;
    f.beta = one_minus * f.beta + m * d.value[j];
  }
  return f;
}

// The map of two consecutive stretches of a row: `later` (nearer the row's end) applied first,
// then `earlier`, as one map (for chaining superchunks of chunks).
template <class T>
MRR_HOST_DEVICE inline GaeChunkMap<T> compose(const GaeChunkMap<T>& later, const GaeChunkMap<T>& earlier) {
  return {earlier.alpha * later.alpha, earlier.alpha * later.beta + earlier.beta, earlier.p * later.p,
          earlier.p * later.q + earlier.q * later.alpha, earlier.p * later.r + earlier.q * later.beta + earlier.r};
}

// The carries a chunk hands to the one before it.
template <class T>
MRR_HOST_DEVICE inline void apply(const GaeChunkMap<T>& f, T& next_value, T& last_gae) {
  const T nv = f.alpha * next_value + f.beta;
  last_gae = f.p * last_gae + f.q * next_value + f.r;
  next_value = nv;
}

// GAE over tokens [lo, lo + len) of one sequence from the carries received at its end (gae_row's
// steps, on the staged chunk); returns the chunk's advantages' masked moments, the arithmetic of
// masked_moments over those len tokens, from registers.
template <int N, class T>
MRR_HOST_DEVICE inline Moments gae_chunk(const T* rewards, const T* values, const T* mask, T* advantages, T* returns,
                                         long lo, int len, T next_value, T last_gae, T gamma, T gamma_lambda) {
  const GaeChunkData<N, T> d(rewards, values, mask, lo, len);
  T adv[N];
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int j = N - 1; j >= 0; --j) {
    adv[j] = T(0);
    if (j >= len) continue;
    gae_step<T, T>(d.reward[j], d.value[j], d.mask[j], T(1), gamma, gamma_lambda, next_value, last_gae);
    adv[j] = last_gae;
    advantages[lo + j] = last_gae;
    returns[lo + j] = last_gae + d.value[j];
  }
  double weight = 0, sum = 0;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int j = 0; j < N; ++j)
    if (j < len) {
      weight += static_cast<double>(d.mask[j]);
      if (d.mask[j] != T(0)) sum += masked_value<double>(adv[j], d.mask[j]);
    }
  if (weight == 0) return {};
  const double mean = sum / weight;
  double m2 = 0;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int j = 0; j < N; ++j)
    if (j < len && d.mask[j] != T(0)) m2 += masked_centered_square<double>(adv[j], d.mask[j], mean);
  return {weight, mean, m2};
}

// Applies maps[last], maps[last - 1], ... (count of them, walking back along the row) to the
// carries, writing each one's carry-in first (carry[2 c], carry[2 c + 1]). Maps are read N at a
// time before they are applied, so the loads overlap and only the carries form a chain.
template <int N, class T>
MRR_HOST_DEVICE inline void chain_maps(const GaeChunkMap<T>* maps, T* carry, long last, long count, T& next_value,
                                       T& last_gae) {
  for (long done = 0; done < count; done += N) {
    GaeChunkMap<T> f[N];
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (int i = 0; i < N; ++i)
      f[i] = done + i < count ? maps[last - done - i] : GaeChunkMap<T>{};
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (int i = 0; i < N; ++i) {
      if (done + i >= count) break;
      const long c = last - done - i;
      carry[2 * c] = next_value;
      carry[2 * c + 1] = last_gae;
      apply(f[i], next_value, last_gae);
    }
  }
}

// The composed map of maps[last], maps[last - 1], ... (count of them, count <= N), read together.
template <int N, class T>
MRR_HOST_DEVICE inline GaeChunkMap<T> compose_maps(const GaeChunkMap<T>* maps, long last, int count) {
  GaeChunkMap<T> f[N];
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int i = 0; i < N; ++i)
    f[i] = i < count ? maps[last - i] : GaeChunkMap<T>{};
  GaeChunkMap<T> total{T(1), T(0), T(1), T(0), T(0)};  // the identity
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int i = 0; i < N; ++i)
    if (i < count) total = compose(total, f[i]);
  return total;
}

// The sum torch computes on the CPU for a contiguous 1-D tensor of these values (ATen's
// SumKernel with AVX2 vectors of 4 doubles: 4 vector accumulators, cascaded in levels for long
// rows; leftover vectors into the first; the tail elements summed first, then the lanes), in Acc.
// verl's group statistics are torch.mean and torch.std of a group's stacked scores, and GRPO
// divides by std + epsilon, so a group whose scores are all equal turns the mean's rounding into
// its advantages scaled by 1 / epsilon: the same order gives the same rounding (checked against
// torch 1.13 on 3,000 random sizes up to 3,000, bit for bit). `members` indexes `values`: an
// array of indices, or IdentityIndex for values[0, n) in order.
struct IdentityIndex {
  MRR_HOST_DEVICE long operator[](long k) const { return k; }
};

template <class Acc, class T, class Members>
MRR_HOST_DEVICE inline Acc torch_order_sum(const T* values, const Members& members, long n) {
  constexpr int kLanes = 4, kIlp = 4, kLevels = 4;
  const long vectors = n / kLanes, rows = vectors / kIlp;
  const auto load = [&](long vector, int lane) { return static_cast<Acc>(values[members[vector * kLanes + lane]]); };
  int ceil_log2 = 0;
  while ((1L << ceil_log2) < rows)
    ++ceil_log2;
  const int power = ceil_log2 / kLevels > 4 ? ceil_log2 / kLevels : 4;
  const long step = 1L << power, mask = step - 1;
  Acc acc[kLevels][kIlp][kLanes] = {};
  long i = 0;
  while (i + step <= rows) {
    for (long j = 0; j < step; ++j, ++i)
      for (int k = 0; k < kIlp; ++k)
        for (int lane = 0; lane < kLanes; ++lane)
          acc[0][k][lane] += load(i * kIlp + k, lane);
    for (int level = 1; level < kLevels; ++level) {
      for (int k = 0; k < kIlp; ++k)
        for (int lane = 0; lane < kLanes; ++lane) {
          acc[level][k][lane] += acc[level - 1][k][lane];
          acc[level - 1][k][lane] = 0;
        }
      if ((i & (mask << (level * power))) != 0) break;
    }
  }
  for (; i < rows; ++i)
    for (int k = 0; k < kIlp; ++k)
      for (int lane = 0; lane < kLanes; ++lane)
        acc[0][k][lane] += load(i * kIlp + k, lane);
  for (int level = 1; level < kLevels; ++level)
    for (int k = 0; k < kIlp; ++k)
      for (int lane = 0; lane < kLanes; ++lane)
        acc[0][k][lane] += acc[level][k][lane];
  for (long v = rows * kIlp; v < vectors; ++v)
    for (int lane = 0; lane < kLanes; ++lane)
      acc[0][0][lane] += load(v, lane);
  for (int k = 1; k < kIlp; ++k)
    for (int lane = 0; lane < kLanes; ++lane)
      acc[0][0][lane] += acc[0][k][lane];
  Acc total = 0;
  for (long e = vectors * kLanes; e < n; ++e)
    total += static_cast<Acc>(values[members[e]]);
  for (int lane = 0; lane < kLanes; ++lane)
    total += acc[0][0][lane];
  return total;
}

// Mean and unbiased standard deviation of a group's scores, members given by index, as torch.mean
// and torch.std compute them on the CPU: the sum in torch's order over n, then the squared
// deviations from that mean summed in member order, in double (in T where T is wider; torch
// accumulates a float32 tensor's deviations in double too). Float scores summed in double: equal
// ones sum exactly, so a group of equal scores gets their value as its mean and std 0.
template <class T, class Index>
MRR_HOST_DEVICE inline T group_mean(const T* scores, const Index* members, long count) {
  using Acc = std::common_type_t<T, double>;
  return static_cast<T>(torch_order_sum<Acc>(scores, members, count) / static_cast<Acc>(count));
}

template <class T, class Index>
MRR_HOST_DEVICE inline T group_std(const T* scores, const Index* members, long count, T mean) {
  using std::sqrt;
  using Acc = std::common_type_t<T, double>;
  Acc sum = 0;
  for (long k = 0; k < count; ++k) {
    const Acc d = static_cast<Acc>(scores[members[k]]) - static_cast<Acc>(mean);
    sum += d * d;
  }
  return static_cast<T>(sqrt(sum / static_cast<Acc>(count - 1)));
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
