// KL penalty estimators between the policy and the reference policy (Schulman's k1/k2/k3 and
// |k1|, with verl's straight-through "+" variants), KL-penalised token rewards, and the fixed and
// adaptive KL coefficient controllers.
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/detail/vexp.hpp>
#include <mrr/error.hpp>
#include <mrr/kernels/ppo/kl.hpp>
#include <mrr/ppo/detail/validate.hpp>
#include <mrr/ppo/masked.hpp>
#include <mrr/tensor.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>

MRR_NAMESPACE_BEGIN
namespace ppo {

using KlEstimator = kernels::ppo::KlEstimator;  // k1, abs, k2, k3 (kernels/ppo/kl.hpp)

// A parsed verl kl_penalty name. straight_through ("+" suffix) keeps the forward value of the
// estimator but takes the gradient of k2, whose expected gradient is the KL's.
struct KlPenalty {
  KlEstimator estimator = KlEstimator::k1;
  bool straight_through = false;
};

// Accepts verl's names: kl, k1, abs, mse, k2, low_var_kl, k3, each optionally followed by "+".
inline KlPenalty parse_kl_penalty(std::string_view name) {
  constexpr std::string_view fn = "ppo::parse_kl_penalty";
  KlPenalty out;
  std::string_view base = name;
  if (!base.empty() && base.back() == '+') {
    out.straight_through = true;
    base.remove_suffix(1);
  }
  if (base == "kl" || base == "k1") {
    out.estimator = KlEstimator::k1;
  } else if (base == "abs") {
    out.estimator = KlEstimator::abs;
  } else if (base == "mse" || base == "k2") {
    out.estimator = KlEstimator::k2;
  } else if (base == "low_var_kl" || base == "k3") {
    out.estimator = KlEstimator::k3;
  } else if (base == "full") {
    mrr::detail::throw_invalid_argument(fn,
                                        "kl_penalty 'full' needs the full vocabulary distribution; verl does "
                                        "not implement it either");
  } else {
    mrr::detail::throw_invalid_argument(fn, "unknown kl_penalty '", name,
                                        "'; expected one of kl, k1, abs, mse, k2, low_var_kl, k3, optionally with "
                                        "a '+' suffix (straight-through k2 gradient)");
  }
  return out;
}

inline std::string to_string(KlPenalty penalty) {
  std::string name;
  switch (penalty.estimator) {
    case KlEstimator::k1:
      name = "k1";
      break;
    case KlEstimator::abs:
      name = "abs";
      break;
    case KlEstimator::k2:
      name = "k2";
      break;
    case KlEstimator::k3:
      name = "k3";
      break;
  }
  if (penalty.straight_through) name += '+';
  return name;
}

namespace detail {

using kernels::ppo::kLowVarKlLogRatioBound;
using kernels::ppo::kLowVarKlValueBound;

template <class T>
using KlValueAndGrad = kernels::ppo::ValueGrad<T>;

// One element of an estimator and its derivative w.r.t. log p: the kernel's (kernels/ppo/kl.hpp).
// The row functions below are its vectorised host specialisation.
template <class T>
KlValueAndGrad<T> kl_element(T logprob, T ref_logprob, KlEstimator estimator) {
  return kernels::ppo::kl_element<T>(logprob, ref_logprob, estimator);
}

}  // namespace detail

template <class T>
struct KlPenaltyResult {
  RowMatrix<T> values;        // element-wise estimate
  RowMatrix<T> grad_logprob;  // gradient of sum(values) w.r.t. logprob
};

namespace detail {

// k3 over one float row segment in a single element-wise loop (exp_float_reduced inlined),
// compiled for the build's target and for AVX2 and picked at run time like exp_float_span: the
// same IEEE operations in the same order either way. The clamps are bit selects that keep NaN,
// and the gradient (WithGrad) is kl_element's: 1 - ratio where both clamps pass, else 0.
template <bool WithGrad>
MRR_FORCEINLINE void kl_k3_float_body(const float* lp, const float* ref, float* values, float* grad,
                                      std::int64_t n) {
  constexpr auto bound = static_cast<float>(kLowVarKlLogRatioBound);
  constexpr auto value_bound = static_cast<float>(kLowVarKlValueBound);
  for (std::int64_t j = 0; j < n; ++j) {
    const float log_ratio = ref[j] - lp[j];
    using mrr::detail::select_float;
    float clamped = select_float(log_ratio > bound, bound, log_ratio);
    clamped = select_float(clamped < -bound, -bound, clamped);
    const float ratio = mrr::detail::exp_float_reduced(clamped);  // |clamped| <= 20 (or NaN)
    const float estimate = ratio - clamped - 1.0f;
    // exp(c) - c - 1 >= 0 up to rounding (a few 1e-8 near c = 0), so the lower value clamp never
    // applies; estimate is NaN exactly when log_ratio is (the log-ratio clamp makes inf finite).
    values[j] = select_float(estimate > value_bound, value_bound, estimate);
    if constexpr (WithGrad) {
      const float slope = 1.0f - ratio;
      const bool passes = (log_ratio >= -bound) & (log_ratio <= bound) & (estimate <= value_bound);
      grad[j] = select_float(passes, slope, 0.0f);
    }
  }
}

template <bool WithGrad>
void kl_k3_float_portable(const float* lp, const float* ref, float* values, float* grad, std::int64_t n) {
  kl_k3_float_body<WithGrad>(lp, ref, values, grad, n);
}

#if MRR_VEXP_AVX2
template <bool WithGrad>
__attribute__((target("avx2"))) void kl_k3_float_avx2(const float* lp, const float* ref, float* values, float* grad,
                                                      std::int64_t n) {
  kl_k3_float_body<WithGrad>(lp, ref, values, grad, n);
}
#endif

// grad == nullptr: values only.
inline void kl_k3_float(const float* lp, const float* ref, float* values, float* grad, std::int64_t n) {
#if MRR_VEXP_AVX2
  if (mrr::detail::vexp_use_avx2()) {
    if (grad != nullptr)
      kl_k3_float_avx2<true>(lp, ref, values, grad, n);
    else
      kl_k3_float_avx2<false>(lp, ref, values, grad, n);
    return;
  }
#endif
  if (grad != nullptr)
    kl_k3_float_portable<true>(lp, ref, values, grad, n);
  else
    kl_k3_float_portable<false>(lp, ref, values, grad, n);
}

// k3 with Eigen's vectorised exp, a chunk at a time (double; grad == nullptr: values only).
template <class T>
void kl_k3_eigen(const T* lp, const T* ref, T* values, T* grad, Eigen::Index n) {
  using Array = Eigen::Array<T, Eigen::Dynamic, 1>;
  const Eigen::Map<const Array> lp_map(lp, n), ref_map(ref, n);
  const T bound = T(kLowVarKlLogRatioBound), value_bound = T(kLowVarKlValueBound);
  alignas(64) T ratio_b[kChunk], estimate_b[kChunk], slope_b[kChunk];
  for (Eigen::Index j0 = 0; j0 < n; j0 += kChunk) {
    const Eigen::Index m = std::min(kChunk, n - j0);
    const auto l = lp_map.segment(j0, m), r = ref_map.segment(j0, m);
    const auto clamped = (r - l).max(-bound).min(bound);
    Eigen::Map<Array> out(values + j0, m);
    if (grad == nullptr) {
      out = (clamped.exp() - clamped - T(1)).max(-value_bound).min(value_bound);
    } else {
      Eigen::Map<Array> ratio(ratio_b, m), estimate(estimate_b, m);
      ratio = clamped.exp();
      estimate = ratio - clamped - T(1);
      out = estimate.max(-value_bound).min(value_bound);
      Eigen::Map<Array>(slope_b, m) = T(1) - ratio;
      // A select of loaded values only (arithmetic under a ternary stops GCC's vectoriser).
      T* g = grad + j0;
      for (Eigen::Index j = 0; j < m; ++j) {
        const T log_ratio = ref[j0 + j] - lp[j0 + j], e = estimate_b[j], slope = slope_b[j];
        // The clamps pass the gradient on their closed intervals (false for NaN).
        const bool passes = (log_ratio >= -bound) & (log_ratio <= bound) & (e >= -value_bound) & (e <= value_bound);
        g[j] = passes ? slope : T(0);
      }
    }
    // The packet min/max may turn a NaN log-ratio into a bound: x - x is NaN only for NaN or
    // inf inputs, and then the rare loop below puts the NaN back (inf is already right).
    if (!(((l - l) + (r - r)).sum() == T(0))) [[unlikely]]
      for (Eigen::Index j = 0; j < m; ++j) {
        const T log_ratio = ref[j0 + j] - lp[j0 + j];
        if (log_ratio != log_ratio) values[j0 + j] = log_ratio;
      }
  }
}

// One row segment [0, n) of an estimator: values and (when grad != nullptr) d value / d logprob.
// The host's vectorised specialisation of kernels::ppo::kl_element: the same IEEE operations
// (bit-identical for k1, abs and k2), except k3's exp, which is Eigen's packet exp (double) or
// exp_float_reduced (float), within 1 ulp of std::exp (tests/ppo/test_kernels.cpp).
// The estimator is chosen outside the element loop; the arithmetic is Eigen array expressions
// (float k3: kl_k3_float; double k3: Eigen's vectorised exp) and the remaining loops only select
// between loaded values, which the compiler vectorises. NaN inputs give NaN values and a zero
// gradient, as kl_element does.
template <class T>
void kl_segment(const T* lp, const T* ref, T* values, T* grad, Eigen::Index n, KlPenalty penalty) {
  using Array = Eigen::Array<T, Eigen::Dynamic, 1>;
  const Eigen::Map<const Array> lp_map(lp, n), ref_map(ref, n);
  switch (penalty.estimator) {
    case KlEstimator::k1:
      Eigen::Map<Array>(values, n) = lp_map - ref_map;
      if (grad != nullptr && !penalty.straight_through) Eigen::Map<Array>(grad, n).setOnes();
      break;
    case KlEstimator::abs:
      Eigen::Map<Array>(values, n) = (lp_map - ref_map).abs();
      if (grad != nullptr && !penalty.straight_through)
        for (Eigen::Index j = 0; j < n; ++j) {
          const T d = lp[j] - ref[j];
          grad[j] = d > T(0) ? T(1) : (d < T(0) ? T(-1) : T(0));
        }
      break;
    case KlEstimator::k2:
      Eigen::Map<Array>(values, n) = T(0.5) * (lp_map - ref_map).square();
      break;
    case KlEstimator::k3: {
      T* k3_grad = grad != nullptr && !penalty.straight_through ? grad : nullptr;
      if constexpr (std::is_same_v<T, float>)
        kl_k3_float(lp, ref, values, k3_grad, n);
      else
        kl_k3_eigen<T>(lp, ref, values, k3_grad, n);
      break;
    }
  }
  // k2's gradient, and the straight-through gradient of every estimator: log p - log p_ref.
  if (grad != nullptr && (penalty.straight_through || penalty.estimator == KlEstimator::k2))
    Eigen::Map<Array>(grad, n) = lp_map - ref_map;
}

// Row-parallel driver: every row is independent, so any thread count gives the same bits.
template <class T>
void kl_rows(OutputRef<T>& values, OutputRef<T>* grad, const MatrixRef<T>& logprob, const MatrixRef<T>& ref_logprob,
             KlPenalty penalty) {
  const Eigen::Index rows = logprob.rows(), cols = logprob.cols();
  mrr::detail::parallel_tiles(rows, row_tile(cols), rows * cols * 8, [&](std::int64_t, std::int64_t begin,
                                                                          std::int64_t end) {
    for (Eigen::Index i = begin; i < end; ++i)
      kl_segment<T>(logprob.data() + i * logprob.outerStride(), ref_logprob.data() + i * ref_logprob.outerStride(),
                    values.data() + i * values.outerStride(),
                    grad != nullptr ? grad->data() + i * grad->outerStride() : nullptr, cols, penalty);
  });
}

}  // namespace detail

// Element-wise KL estimate and its gradient w.r.t. logprob into caller-owned matrices of the
// inputs' shape (no allocation). No mask is applied (verl applies the response mask when it
// aggregates). Outputs must not overlap the inputs.
template <class T>
void kl_penalty_into(detail::OutputRef<T> values, detail::OutputRef<T> grad_logprob, MatrixRef<T> logprob,
                     MatrixRef<T> ref_logprob, KlPenalty penalty) {
  constexpr std::string_view fn = "ppo::kl_penalty";
  detail::require_same_shape(fn, "logprob", logprob, "ref_logprob", ref_logprob);
  detail::require_output(fn, "values", values, logprob.rows(), logprob.cols(), logprob, ref_logprob);
  detail::require_output(fn, "grad_logprob", grad_logprob, logprob.rows(), logprob.cols(), logprob, ref_logprob);
  mrr::detail::require(!detail::shares_memory(values, grad_logprob), fn,
                       "'values' and 'grad_logprob' share memory; pass separate output matrices");
  detail::kl_rows<T>(values, &grad_logprob, logprob, ref_logprob, penalty);
}

// Same, into a result whose matrices are resized only when the shape changes.
template <class T>
void kl_penalty_into(KlPenaltyResult<T>& out, MatrixRef<T> logprob, MatrixRef<T> ref_logprob, KlPenalty penalty) {
  detail::require_same_shape("ppo::kl_penalty", "logprob", logprob, "ref_logprob", ref_logprob);
  out.values.resize(logprob.rows(), logprob.cols());
  out.grad_logprob.resize(logprob.rows(), logprob.cols());
  kl_penalty_into<T>(out.values, out.grad_logprob, logprob, ref_logprob, penalty);
}

template <class T>
KlPenaltyResult<T> kl_penalty(MatrixRef<T> logprob, MatrixRef<T> ref_logprob, KlPenalty penalty) {
  KlPenaltyResult<T> out;
  kl_penalty_into<T>(out, logprob, ref_logprob, penalty);
  return out;
}

template <class T>
KlPenaltyResult<T> kl_penalty(MatrixRef<T> logprob, MatrixRef<T> ref_logprob, std::string_view name) {
  return kl_penalty<T>(logprob, ref_logprob, parse_kl_penalty(name));
}

// Forward values only, into a caller-owned matrix of the inputs' shape (verl's kl_penalty_forward).
template <class T>
void kl_penalty_forward_into(detail::OutputRef<T> values, MatrixRef<T> logprob, MatrixRef<T> ref_logprob,
                             KlEstimator estimator) {
  constexpr std::string_view fn = "ppo::kl_penalty_forward";
  detail::require_same_shape(fn, "logprob", logprob, "ref_logprob", ref_logprob);
  detail::require_output(fn, "values", values, logprob.rows(), logprob.cols(), logprob, ref_logprob);
  detail::kl_rows<T>(values, nullptr, logprob, ref_logprob, KlPenalty{estimator, false});
}

template <class T>
RowMatrix<T> kl_penalty_forward(MatrixRef<T> logprob, MatrixRef<T> ref_logprob, KlEstimator estimator) {
  detail::require_same_shape("ppo::kl_penalty_forward", "logprob", logprob, "ref_logprob", ref_logprob);
  RowMatrix<T> out(logprob.rows(), logprob.cols());
  kl_penalty_forward_into<T>(out, logprob, ref_logprob, estimator);
  return out;
}

// Token rewards with the in-reward KL penalty: scores - kl_ratio * (log p_old - log p_ref).
template <class T>
RowMatrix<T> compute_rewards(MatrixRef<T> token_level_scores, MatrixRef<T> old_log_prob, MatrixRef<T> ref_log_prob,
                             double kl_ratio) {
  constexpr std::string_view fn = "ppo::compute_rewards";
  detail::require_same_shape(fn, "token_level_scores", token_level_scores, "old_log_prob", old_log_prob);
  detail::require_same_shape(fn, "token_level_scores", token_level_scores, "ref_log_prob", ref_log_prob);
  detail::require_finite_scalar(fn, "kl_ratio", kl_ratio);
  return token_level_scores - ((old_log_prob - ref_log_prob) * static_cast<T>(kl_ratio));
}

// The KL coefficient: fixed, or adaptive (Ziegler et al., arXiv 1909.08593) where each update
// multiplies it by 1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon.
template <class T = double>
class KlController {
 public:
  enum class Type { fixed, adaptive };

  static KlController fixed(double kl_coef) {
    detail::require_finite_scalar("ppo::KlController::fixed", "kl_coef", kl_coef);
    return KlController(Type::fixed, kl_coef, 0, 0);
  }

  static KlController adaptive(double init_kl_coef, double target_kl, double horizon) {
    constexpr std::string_view fn = "ppo::KlController::adaptive";
    detail::require_finite_scalar(fn, "init_kl_coef", init_kl_coef);
    mrr::detail::require(std::isfinite(target_kl) && target_kl > 0, fn, "'target_kl' must be positive, got ",
                         target_kl);
    mrr::detail::require(std::isfinite(horizon) && horizon > 0, fn, "'horizon' must be positive, got ", horizon);
    return KlController(Type::adaptive, init_kl_coef, target_kl, horizon);
  }

  // verl's kl_ctrl.type: "fixed" or "adaptive".
  static KlController from_config(std::string_view type, double kl_coef, double target_kl = 0.1,
                                  double horizon = 10000) {
    if (type == "fixed") return fixed(kl_coef);
    if (type == "adaptive") return adaptive(kl_coef, target_kl, horizon);
    mrr::detail::throw_invalid_argument("ppo::KlController::from_config", "unknown kl_ctrl type '", type,
                                        "'; expected 'fixed' or 'adaptive'");
  }

  Type type() const { return type_; }
  T value() const { return static_cast<T>(value_); }

  // Observes the current KL over n_steps samples; a fixed controller ignores it.
  void update(T current_kl, std::int64_t n_steps) {
    if (type_ == Type::fixed) return;
    constexpr std::string_view fn = "ppo::KlController::update";
    detail::require_finite_scalar(fn, "current_kl", static_cast<double>(current_kl));
    mrr::detail::require(n_steps >= 0, fn, "'n_steps' must be non-negative, got ", n_steps);
    const double proportional_error = std::clamp(static_cast<double>(current_kl) / target_ - 1.0, -0.2, 0.2);
    value_ *= 1.0 + proportional_error * static_cast<double>(n_steps) / horizon_;
  }

 private:
  KlController(Type type, double value, double target, double horizon)
      : type_(type), value_(value), target_(target), horizon_(horizon) {}

  Type type_;
  double value_;
  double target_;
  double horizon_;
};

}  // namespace ppo
MRR_NAMESPACE_END
