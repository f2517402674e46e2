// Truncated importance-sampling weights for the training/rollout mismatch (verl's
// rollout_corr_helper): token- or sequence-level ratios pi_train / pi_rollout, truncated (TIS) or
// masked outside a band (IcePop), optionally normalised to mean 1 over the batch.
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>
#include <mrr/kernels/ppo/masked.hpp>
#include <mrr/kernels/ppo/rollout_correction.hpp>
#include <mrr/ppo/detail/validate.hpp>
#include <mrr/ppo/masked.hpp>
#include <mrr/tensor.hpp>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>

MRR_NAMESPACE_BEGIN
namespace ppo {

enum class RolloutIsLevel {
  token,     // one weight per token: exp(log_ratio)
  sequence,  // one weight per sequence: exp(sum of masked log_ratio), broadcast over its tokens
};

inline RolloutIsLevel parse_rollout_is_level(std::string_view name) {
  if (name == "token") return RolloutIsLevel::token;
  if (name == "sequence") return RolloutIsLevel::sequence;
  mrr::detail::throw_invalid_argument("ppo::parse_rollout_is_level", "unknown rollout_is '", name,
                                      "'; expected 'token' or 'sequence'");
}

// verl's rollout_is_threshold: a number (TIS: weights above it are truncated to it) or a
// "lower_upper" string (IcePop: weights outside [lower, upper] become 0).
struct RolloutIsThreshold {
  double upper = 2.0;
  std::optional<double> lower;

  static RolloutIsThreshold truncate_at(double upper) {
    RolloutIsThreshold t;
    t.upper = upper;
    t.validate();
    return t;
  }

  static RolloutIsThreshold parse(std::string_view spec) {
    constexpr std::string_view fn = "ppo::RolloutIsThreshold::parse";
    const auto trim = [](std::string_view s) {
      while (!s.empty() && (s.front() == ' ' || s.front() == '\t'))
        s.remove_prefix(1);
      while (!s.empty() && (s.back() == ' ' || s.back() == '\t'))
        s.remove_suffix(1);
      return s;
    };
    const auto number = [&](std::string_view s) {
      s = trim(s);
      double value = 0;
      const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), value);
      mrr::detail::require(ec == std::errc() && end == s.data() + s.size() && !s.empty(), fn,
                           "invalid rollout_is_threshold '", spec, "'");
      return value;
    };
    spec = trim(spec);
    mrr::detail::require(!spec.empty(), fn, "rollout_is_threshold must not be empty");
    RolloutIsThreshold t;
    if (const auto sep = spec.find('_'); sep != std::string_view::npos) {
      t.lower = number(spec.substr(0, sep));
      t.upper = number(spec.substr(sep + 1));
    } else {
      t.upper = number(spec);
    }
    t.validate();
    return t;
  }

  void validate() const {
    constexpr std::string_view fn = "ppo::RolloutIsThreshold";
    mrr::detail::require(std::isfinite(upper) && upper > 0, fn, "upper threshold must be positive, got ", upper);
    if (lower) {
      mrr::detail::require(std::isfinite(*lower) && *lower > 0, fn, "lower threshold must be positive, got ", *lower);
      mrr::detail::require(*lower <= upper, fn, "lower threshold ", *lower, " exceeds upper threshold ", upper);
    }
  }
};

struct RolloutIsOptions {
  RolloutIsLevel level = RolloutIsLevel::token;
  RolloutIsThreshold threshold;
  bool batch_normalize = false;  // divide by the batch mean weight (token or sequence mean)
};

template <class T>
struct RolloutIsResult {
  RowMatrix<T> weights;  // [batch, length]; 0 on masked tokens; detached (no gradient) by nature
  // verl's diagnostics under its keys: rollout_is_mean/max/min/std, rollout_is_eff_sample_size,
  // rollout_is_ratio_fraction_high/low, rollout_is_seq_* and, when used,
  // rollout_is_batch_norm_factor and rollout_is_oob_ratio. Computed before batch normalisation.
  std::map<std::string, T, std::less<>> metrics;
};

namespace detail {
using kernels::ppo::kRolloutSafetyBound;  // log-ratios are clamped to +-20 before exp

// verl's (condition).float().mean(): a float32 count over a float32 count.
template <class T>
T float32_fraction(Eigen::Index hits, Eigen::Index of) {
  return static_cast<T>(static_cast<float>(hits) / static_cast<float>(of));
}
}  // namespace detail

// log_ratio = log pi_train - log pi_rollout per token.
template <class T>
RolloutIsResult<T> compute_rollout_correction_weights(MatrixRef<T> log_ratio, MatrixRef<T> response_mask,
                                                      const RolloutIsOptions& options = {}) {
  constexpr std::string_view fn = "ppo::compute_rollout_correction_weights";
  detail::require_nonempty(fn, "log_ratio", log_ratio);
  detail::require_same_shape(fn, "log_ratio", log_ratio, "response_mask", response_mask);
  detail::require_mask(fn, "response_mask", response_mask);
  detail::require_finite_where(fn, "log_ratio", log_ratio, response_mask);
  options.threshold.validate();
  // verl's metrics refuse an all-masked batch, and so does every use of the weights.
  mrr::detail::require((response_mask.array() != T(0)).any(), fn,
                       "'response_mask' must select at least one valid token");

  const Eigen::Index rows = log_ratio.rows(), cols = log_ratio.cols();
  const T bound = T(detail::kRolloutSafetyBound);
  const T upper = static_cast<T>(options.threshold.upper);
  const bool icepop = options.threshold.lower.has_value();
  const T lower = static_cast<T>(options.threshold.lower.value_or(1.0 / options.threshold.upper));
  // The thresholds as the weights' type holds them: one that rounds to 0 or overflows in T would
  // zero every weight (or clamp none) with no error.
  mrr::detail::require(std::isfinite(upper) && upper > T(0) && std::isfinite(lower) && lower > T(0), fn,
                       "the thresholds [", options.threshold.lower.value_or(1.0 / options.threshold.upper), ", ",
                       options.threshold.upper, "] are not positive and finite in the weights' ", sizeof(T) * 8,
                       "-bit type");
  const bool sequence_level = options.level == RolloutIsLevel::sequence;

  Vector<T> sequence_log_ratio = Vector<T>::Zero(rows);
  if (sequence_level)
    for (Eigen::Index i = 0; i < rows; ++i)
      sequence_log_ratio[i] = kernels::ppo::masked_sum<T>(log_ratio.row(i).data(), response_mask.row(i).data(), cols, T(0));

  RowMatrix<T> raw(rows, cols);
  RolloutIsResult<T> out{RowMatrix<T>(rows, cols), {}};
  for (Eigen::Index i = 0; i < rows; ++i)
    for (Eigen::Index j = 0; j < cols; ++j) {
      const T lr = sequence_level ? sequence_log_ratio[i] : log_ratio(i, j);
      const T r = kernels::ppo::rollout_is_raw_weight(lr, response_mask(i, j));
      raw(i, j) = r;
      out.weights(i, j) = kernels::ppo::rollout_is_weight(r, lower, upper, icepop);
    }

  // Diagnostics, from the weights before batch normalisation. Means accumulate in double whatever T:
  // the std below is E[w^2] - E[w]^2, which cancels, and a float running sum over the batch loses
  // the digits it needs.
  const T eps = T(detail::kMaskCountEpsilon);
  const T count = response_mask.sum();
  const auto masked_mean_of = [&](auto&& value) {
    double sum = 0;
    for (Eigen::Index i = 0; i < rows; ++i)
      for (Eigen::Index j = 0; j < cols; ++j) {
        const T m = response_mask(i, j);
        if (m != T(0)) sum += static_cast<double>(value(i, j)) * static_cast<double>(m);
      }
    return sum / (static_cast<double>(count) + detail::kMaskCountEpsilon);
  };
  const auto& w = out.weights;
  auto& metrics = out.metrics;
  metrics["rollout_is_mean"] = static_cast<T>(masked_mean_of([&](Eigen::Index i, Eigen::Index j) { return w(i, j); }));
  if (sequence_level) {
    metrics["rollout_is_max"] = std::exp(std::min(sequence_log_ratio.maxCoeff(), bound));
    metrics["rollout_is_min"] = std::exp(sequence_log_ratio.minCoeff());
    // verl compares with torch.log(torch.tensor(threshold)): a float32 logarithm.
    const T log_upper = static_cast<T>(std::log(static_cast<float>(upper)));
    const T log_lower = static_cast<T>(std::log(static_cast<float>(lower)));
    metrics["rollout_is_ratio_fraction_high"] =
        detail::float32_fraction<T>((sequence_log_ratio.array() > log_upper).count(), rows);
    metrics["rollout_is_ratio_fraction_low"] =
        detail::float32_fraction<T>((sequence_log_ratio.array() < log_lower).count(), rows);
  } else {
    metrics["rollout_is_ratio_fraction_high"] =
        static_cast<T>(masked_mean_of([&](Eigen::Index i, Eigen::Index j) { return T(raw(i, j) > upper ? 1 : 0); }));
    metrics["rollout_is_ratio_fraction_low"] =
        static_cast<T>(masked_mean_of([&](Eigen::Index i, Eigen::Index j) { return T(raw(i, j) < lower ? 1 : 0); }));
    T max = -std::numeric_limits<T>::infinity(), min = std::numeric_limits<T>::infinity();
    for (Eigen::Index i = 0; i < rows; ++i)
      for (Eigen::Index j = 0; j < cols; ++j)
        if (response_mask(i, j) != T(0)) {
          max = std::max(max, w(i, j));
          min = std::min(min, w(i, j));
        }
    metrics["rollout_is_max"] = max;
    metrics["rollout_is_min"] = min;
  }
  const auto clamped = [&](Eigen::Index i, Eigen::Index j) { return std::clamp(w(i, j), T(0), upper); };
  const double clamped_mean_exact = masked_mean_of(clamped);
  const T clamped_mean = static_cast<T>(clamped_mean_exact);
  if (count > T(1)) {
    const double second = masked_mean_of([&](Eigen::Index i, Eigen::Index j) {
      const double c = clamped(i, j);
      return c * c;
    });
    metrics["rollout_is_std"] =
        static_cast<T>(std::sqrt(std::max(second - clamped_mean_exact * clamped_mean_exact, 0.0)));
  } else {
    metrics["rollout_is_std"] = T(0);
  }
  // When every weight is 0 (IcePop rejected every token) no sample is effective: 0, where verl's
  // 1 / 0 raises ZeroDivisionError (docs/ppo.md, deliberate difference 9).
  const double normalized_square = masked_mean_of([&](Eigen::Index i, Eigen::Index j) {
    const T normalized = clamped(i, j) / (clamped_mean + eps);
    return normalized * normalized;
  });
  metrics["rollout_is_eff_sample_size"] = static_cast<T>(normalized_square > 0 ? 1.0 / normalized_square : 0.0);
  const Vector<T> sequence_mean = masked_row_mean<T>(w, response_mask);
  const Vector<T> raw_sequence_mean = masked_row_mean<T>(raw, response_mask);
  const T seq_avg = sequence_mean.mean();
  metrics["rollout_is_seq_mean"] = seq_avg;
  metrics["rollout_is_seq_std"] =
      rows > 1
          ? std::sqrt((sequence_mean.array() - seq_avg).square().sum() / static_cast<T>(static_cast<double>(rows - 1)))
          : T(0);
  metrics["rollout_is_seq_max"] = sequence_mean.maxCoeff();
  metrics["rollout_is_seq_min"] = sequence_mean.minCoeff();
  metrics["rollout_is_seq_max_deviation"] = (sequence_mean.array() - T(1)).abs().maxCoeff();
  metrics["rollout_is_seq_fraction_high"] =
      detail::float32_fraction<T>((raw_sequence_mean.array() > upper).count(), rows);
  metrics["rollout_is_seq_fraction_low"] =
      detail::float32_fraction<T>((raw_sequence_mean.array() < lower).count(), rows);
  if (icepop)
    metrics["rollout_is_oob_ratio"] = static_cast<T>(masked_mean_of(
        [&](Eigen::Index i, Eigen::Index j) { return T(raw(i, j) < lower || raw(i, j) > upper ? 1 : 0); }));

  if (options.batch_normalize) {
    T batch_mean;
    if (sequence_level) {
      // Mean over sequences with at least one valid token of each sequence's (single) weight.
      T total = 0, sequences = 0;
      for (Eigen::Index i = 0; i < rows; ++i)
        if (response_mask.row(i).sum() > T(0)) {
          total += sequence_mean[i];
          sequences += T(1);
        }
      batch_mean = total / std::max(sequences, eps);
    } else {
      batch_mean = metrics["rollout_is_mean"];
    }
    if (batch_mean > eps) {
      out.weights /= batch_mean;
      metrics["rollout_is_batch_norm_factor"] = batch_mean;
    } else {
      metrics["rollout_is_batch_norm_factor"] = T(1);
    }
  }
  return out;
}

}  // namespace ppo
MRR_NAMESPACE_END
