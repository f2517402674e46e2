// The policy-gradient losses of verl (vanilla PPO with asymmetric and dual clip, gspo, sapo, gpg,
// cispo, dppo_tv, dppo_kl, dro, kl_cov, clip_cov) one token at a time: the loss, d loss / d log_prob
// and the token's contribution to verl's metrics; and the vanilla loss over one row (the Thrust path runs one row
// per work item). The one definition of this math: ppo/policy_loss.hpp and thrust/policy_loss.hpp
// call it; the host's vectorised vanilla row (ppo/policy_loss.hpp, vanilla_row) is a documented
// specialisation of vanilla_token. Validation and error messages stay on the host.
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/kernels/ppo/common.hpp>

#include <cmath>

MRR_NAMESPACE_BEGIN
namespace kernels::ppo {

inline constexpr double kGspoLogRatioMax = 10.0;     // gspo clamps the sequence log-ratio from above
inline constexpr double kBinaryKlEpsilon = 1e-8;     // dppo_kl: log((1 - p_old + eps) / (1 - p + eps))
inline constexpr double kGeoMeanLogEpsilon = 1e-10;  // geo_mean: log(w + eps) of rollout weights

// Per-token quantities a loss produces before rollout weighting and aggregation.
template <class T>
struct TokenTerms {
  T loss;            // per-token loss
  T grad;            // d loss / d log_prob at this token
  T clipfrac;        // indicator for actor/pg_clipfrac
  T clipfrac_lower;  // indicator for actor/pg_clipfrac_lower
  T neg_kl;          // term of actor/ppo_kl (old - new log-prob, clamped where verl clamps)
};

// exp(clamp(log_prob - old_log_prob, -20, 20)) and its derivative w.r.t. log_prob.
template <class T>
MRR_HOST_DEVICE inline ValueGrad<T> clamped_ratio(T log_prob, T old_log_prob) {
  using std::exp;
  const T bound = T(kLogRatioBound);
  const ValueGrad<T> log_ratio = clamp<T>({log_prob - old_log_prob, T(1)}, -bound, bound);
  const T ratio = exp(log_ratio.value);
  return {ratio, ratio * log_ratio.grad};
}

// -clamp(log_prob - old_log_prob, +-20): verl's actor/ppo_kl term.
template <class T>
MRR_HOST_DEVICE inline T clamped_neg_kl(T log_prob, T old_log_prob) {
  const T bound = T(kLogRatioBound);
  return -clamp(log_prob - old_log_prob, -bound, bound);
}

// verl "vanilla": max(-A r, -A clip(r, lo, hi)) and, for A < 0, min(., -A dual_clip).
template <class T>
MRR_HOST_DEVICE inline TokenTerms<T> vanilla_token(T log_prob, T old_log_prob, T a, T lo, T hi, T dual_clip) {
  const ValueGrad<T> ratio = clamped_ratio(log_prob, old_log_prob);
  const ValueGrad<T> loss1{-a * ratio.value, -a * ratio.grad};
  const ValueGrad<T> clipped = clamp(ratio, lo, hi);
  const ValueGrad<T> loss2{-a * clipped.value, -a * clipped.grad};
  const ValueGrad<T> clip1 = maximum(loss1, loss2);
  const ValueGrad<T> loss3{-a * dual_clip, T(0)};
  const ValueGrad<T> clip2 = minimum(loss3, clip1);
  const ValueGrad<T> chosen = a < T(0) ? clip2 : clip1;
  return {chosen.value, chosen.grad, T(loss2.value > loss1.value ? 1 : 0),
          T(clip1.value > loss3.value && a < T(0) ? 1 : 0), clamped_neg_kl(log_prob, old_log_prob)};
}

// GSPO: the sequence's log-ratio (mean masked log p - log p_old) carried to each token with the
// token's own gradient, capped above at 10, then PPO-clipped.
template <class T>
MRR_HOST_DEVICE inline TokenTerms<T> gspo_token(T sequence_log_ratio, T log_prob, T old_log_prob, T a, T lo, T hi) {
  using std::exp;
  const T cap = T(kGspoLogRatioMax);
  const T ratio = exp(cap < sequence_log_ratio ? cap : sequence_log_ratio);  // std::min: NaN stays NaN
  const ValueGrad<T> r{ratio, sequence_log_ratio <= cap ? ratio : T(0)};
  const ValueGrad<T> loss1{-a * r.value, -a * r.grad};
  const ValueGrad<T> clipped = clamp(r, lo, hi);
  const ValueGrad<T> loss2{-a * clipped.value, -a * clipped.grad};
  const ValueGrad<T> chosen = maximum(loss1, loss2);
  return {chosen.value, chosen.grad, T(loss2.value > loss1.value ? 1 : 0), T(0), old_log_prob - log_prob};
}

// SAPO: the smooth gate sigmoid(tau (r - 1)) * 4 / tau in place of the clip.
template <class T>
MRR_HOST_DEVICE inline TokenTerms<T> sapo_token(T log_prob, T old_log_prob, T a, T tau_pos, T tau_neg) {
  using std::exp;
  const ValueGrad<T> ratio = clamped_ratio(log_prob, old_log_prob);
  const T tau = a > T(0) ? tau_pos : tau_neg;
  const T sigmoid = T(1) / (T(1) + exp(-(tau * (ratio.value - T(1)))));
  // verl's 4.0 / tau is tau.reciprocal() * 4 (Tensor.__rtruediv__); scaling by 4 is exact, so
  // it equals the quotient bit for bit (docs/ppo.md, "gpg arithmetic").
  const T gate = sigmoid * (T(4) / tau);
  // d gate / d r = 4 sigmoid (1 - sigmoid): the tau of the argument cancels the 1/tau.
  const T gate_grad = T(4) * sigmoid * (T(1) - sigmoid) * ratio.grad;
  return {-gate * a, -a * gate_grad, T(0), T(0), clamped_neg_kl(log_prob, old_log_prob)};
}

// GPG: the plain policy gradient -A log p (no metrics).
template <class T>
MRR_HOST_DEVICE inline TokenTerms<T> gpg_token(T log_prob, T a) {
  return {-log_prob * a, -a, T(0), T(0), T(0)};
}

// REINFORCE (verl compute_policy_loss_reinforce, bypass mode): -A log p, reporting
// rollout - current log-prob as its ppo_kl term.
template <class T>
MRR_HOST_DEVICE inline TokenTerms<T> reinforce_token(T log_prob, T rollout_log_prob, T a) {
  return {-log_prob * a, -a, T(0), T(0), rollout_log_prob - log_prob};
}

// CISPO: -sg(clip(r, lo, hi)) A log p; the gradient flows through log p only.
template <class T>
MRR_HOST_DEVICE inline TokenTerms<T> cispo_token(T log_prob, T old_log_prob, T a, T lo, T hi) {
  using std::exp;
  const T bound = T(kLogRatioBound);
  const T log_ratio = clamp(log_prob - old_log_prob, -bound, bound);
  const T ratio = exp(log_ratio);
  const T clipped = clamp(ratio, lo, hi);
  return {-clipped * a * log_prob, -clipped * a, T(ratio != clipped ? 1 : 0), T(0), -log_ratio};
}

// DPPO trust regions: whether a token is kept (p = exp(log_prob), p_old = exp(old_log_prob)).
// dppo_tv: the probability moved by at most `high` upwards (A > 0) or `low` downwards (A <= 0).
template <class T>
MRR_HOST_DEVICE inline bool dppo_tv_keeps(T p, T p_old, T a, T low, T high) {
  return a > T(0) ? (p - p_old) <= high : (p - p_old) >= -low;
}

// dppo_kl: the binary KL between Bernoulli(p_old) and Bernoulli(p) within the bound, or p moved
// the safe way.
template <class T>
MRR_HOST_DEVICE inline bool dppo_kl_keeps(T p, T p_old, T log_prob, T old_log_prob, T a, T low, T high) {
  using std::log;
  const T eps = T(kBinaryKlEpsilon);
  const T binary_kl = p_old * (old_log_prob - log_prob) + (T(1) - p_old) * log((T(1) - p_old + eps) / (T(1) - p + eps));
  return a > T(0) ? (binary_kl <= high || p <= p_old) : (binary_kl <= low || p >= p_old);
}

// DPPO-Binary: -A sg(min(r, cap)) log p on kept tokens; others get no gradient.
template <class T>
MRR_HOST_DEVICE inline TokenTerms<T> dppo_token(T log_prob, T old_log_prob, T a, T cap, bool keep_token) {
  using std::exp;
  const T bound = T(kLogRatioBound);
  const T log_ratio = clamp(log_prob - old_log_prob, -bound, bound);
  const T ratio = exp(log_ratio);
  const T truncated = cap < ratio ? cap : ratio;  // std::min
  const T keep = keep_token ? T(1) : T(0);
  return {-a * truncated * log_prob * keep, -a * truncated * keep, T(1) - keep, T(ratio > cap ? 1 : 0) * keep,
          -log_ratio};
}

// DRO: -(A log p - beta/2 (log p - log p_old)^2); reports actor/ppo_kl only.
template <class T>
MRR_HOST_DEVICE inline TokenTerms<T> dro_token(T log_prob, T old_log_prob, T a, T beta) {
  const T log_ratio = log_prob - old_log_prob;
  return {-(log_prob * a - T(0.5) * beta * (log_ratio * log_ratio)), -(a - beta * log_ratio), T(0), T(0), -log_ratio};
}

// verl "kl_cov" (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning
// Language Models"), per token: -A r with r = exp(log p - log p_old) (not clamped, as verl), plus coef |log p - log
// p_old| on the tokens the caller selected (the largest covariances of advantage and log-probability). |x|'s gradient
// is sign(x), 0 at 0 (torch.abs). The metric term is |log p - log p_old| (verl's actor/ppo_kl for this loss).
template <class T>
MRR_HOST_DEVICE inline TokenTerms<T> kl_cov_token(T log_prob, T old_log_prob, T a, bool selected, T coef) {
  using std::exp;
  const T log_ratio = log_prob - old_log_prob;
  const T ratio = exp(log_ratio);
  const T abs_kl = log_ratio < T(0) ? -log_ratio : log_ratio;
  const T sign = T(log_ratio > T(0) ? 1 : 0) - T(log_ratio < T(0) ? 1 : 0);
  const T loss = -a * ratio;
  if (!selected) return {loss, loss, T(0), T(0), abs_kl};
  return {loss + coef * abs_kl, loss + coef * sign, T(0), T(0), abs_kl};
}

// verl "clip_cov" (the same paper), per token: max(-A r, -A clip(r, lo, hi)), r = exp(log p -
// log p_old) (not clamped, no dual clip), times 0 on the tokens the caller dropped (a detached
// factor: they get no gradient). Metric terms: dropped (actor/pg_clipfrac), log p_old - log p.
template <class T>
MRR_HOST_DEVICE inline TokenTerms<T> clip_cov_token(T log_prob, T old_log_prob, T a, T lo, T hi, bool dropped) {
  using std::exp;
  const T ratio = exp(log_prob - old_log_prob);
  const ValueGrad<T> loss1{-a * ratio, -a * ratio};
  const ValueGrad<T> clipped = clamp(ValueGrad<T>{ratio, ratio}, lo, hi);
  const ValueGrad<T> loss2{-a * clipped.value, -a * clipped.grad};
  const ValueGrad<T> chosen = maximum(loss1, loss2);
  const T keep = dropped ? T(0) : T(1);
  return {chosen.value * keep, chosen.grad * keep, T(dropped ? 1 : 0), T(0), old_log_prob - log_prob};
}

// The gradient through the aggregation: row weight x mask x the token's gradient; 0 where masked
// (a masked token may hold anything, NaN included).
template <class T>
MRR_HOST_DEVICE inline T aggregated_grad(T token_grad, T mask, T row_weight) {
  return mask != T(0) ? row_weight * mask * token_grad : T(0);
}

// The sums vanilla_row writes per row.
enum VanillaRowSum : int { kRowLoss, kRowTokens, kRowClipfrac, kRowClipfracLower, kRowNegKl, kVanillaRowSums };

// One row of the vanilla loss: the token gradients before the aggregation's row weight (times
// the rollout weight, when is_weights is not null) and the row's masked sums. Reports
// Status::invalid_input for a mask value other than 0 / 1, or a valid token with a non-finite
// input or a negative rollout weight.
template <class T>
MRR_HOST_DEVICE inline Status vanilla_row(const T* log_prob, const T* old_log_prob, const T* advantages, const T* mask,
                                          const T* is_weights, T* token_grad, long cols, T lo, T hi, T dual_clip,
                                          T* sums) {
  T loss = 0, tokens = 0, clip = 0, lower = 0, neg_kl = 0;
  bool invalid = false;
  for (long j = 0; j < cols; ++j) {
    const T lp = log_prob[j], old = old_log_prob[j], a = advantages[j], m = mask[j];
    const T weight = is_weights != nullptr ? is_weights[j] : T(1);
    invalid |= m != T(0) && m != T(1);
    if (m != T(0)) invalid |= !is_finite(lp) || !is_finite(old) || !is_finite(a) || !is_finite(weight) || weight < T(0);
    const TokenTerms<T> t = vanilla_token(lp, old, a, lo, hi, dual_clip);
    token_grad[j] = t.grad * weight;
    if (m != T(0)) {
      loss += t.loss * weight * m;
      tokens += m;
      clip += t.clipfrac * m;
      lower += t.clipfrac_lower * m;
      neg_kl += t.neg_kl * m;
    }
  }
  sums[kRowLoss] = loss;
  sums[kRowTokens] = tokens;
  sums[kRowClipfrac] = clip;
  sums[kRowClipfracLower] = lower;
  sums[kRowNegKl] = neg_kl;
  return invalid ? Status::invalid_input : Status::ok;
}

}  // namespace kernels::ppo
MRR_NAMESPACE_END
