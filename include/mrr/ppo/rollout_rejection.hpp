// verl's rollout rejection sampling and the rest of its rollout correction (rollout_corr_helper):
// a hard trust region that masks tokens or whole sequences whose divergence between the training
// and the rollout policy exceeds a threshold (compute_rollout_rejection_mask), the off-policy
// diagnostics (compute_offpolicy_metrics), and the pipeline that runs IS weights, rejection and
// diagnostics together (compute_rollout_correction_and_rejection_mask), which verl's
// "bypass_mode" policy loss calls. The per-token statistics are kernels/ppo/rollout_correction.hpp's.
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>
#include <mrr/kernels/ppo/advantage.hpp>
#include <mrr/kernels/ppo/masked.hpp>
#include <mrr/kernels/ppo/rollout_correction.hpp>
#include <mrr/ppo/detail/validate.hpp>
#include <mrr/ppo/rollout_correction.hpp>
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
#include <vector>

MRR_NAMESPACE_BEGIN
namespace ppo {

// Where an option applies its statistic: each token, or each sequence's sum, mean or maximum of
// the token statistics (one decision for the whole sequence).
enum class RolloutRsScope { token, seq_sum, seq_mean, seq_max };

// One rejection criterion, verl's rollout_rs option. k1 keeps lower <= pi_train / pi_rollout <=
// upper (its statistic -log ratio is compared with log lower and log upper, as verl does); k2 and
// k3 keep a divergence <= upper.
struct RolloutRsOption {
  RolloutRsScope scope = RolloutRsScope::token;
  kernels::ppo::RolloutRsStatistic statistic = kernels::ppo::RolloutRsStatistic::k1;
  double upper = 2.0;
  double lower = 0.5;  // k1 only

  bool k1() const { return statistic == kernels::ppo::RolloutRsStatistic::k1; }
  std::string name() const {
    static constexpr const char* scopes[] = {"token", "seq_sum", "seq_mean", "seq_max"};
    static constexpr const char* stats[] = {"k1", "k2", "k3"};
    return std::string(scopes[static_cast<int>(scope)]) + "_" + stats[static_cast<int>(statistic)];
  }
};

namespace detail {

inline std::string_view trim_space(std::string_view s) {
  const auto space = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; };
  while (!s.empty() && space(s.front()))
    s.remove_prefix(1);
  while (!s.empty() && space(s.back()))
    s.remove_suffix(1);
  return s;
}

// The comma-separated, trimmed, non-empty parts of s.
inline std::vector<std::string_view> comma_parts(std::string_view s) {
  std::vector<std::string_view> parts;
  while (true) {
    const auto comma = s.find(',');
    const auto part = trim_space(s.substr(0, comma));
    if (!part.empty()) parts.push_back(part);
    if (comma == std::string_view::npos) return parts;
    s.remove_prefix(comma + 1);
  }
}

inline double parse_threshold_number(std::string_view fn, std::string_view option, std::string_view spec,
                                     std::string_view text) {
  text = trim_space(text);
  if (!text.empty() && text.front() == '+') text.remove_prefix(1);
  double value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  mrr::detail::require(ec == std::errc() && end == text.data() + text.size() && !text.empty() && !std::isnan(value), fn,
                       "invalid numeric threshold '", spec, "' for option '", option, "'");
  return value;
}

inline std::optional<RolloutRsOption> rollout_rs_option_named(std::string_view name) {
  using kernels::ppo::RolloutRsStatistic;
  static constexpr std::pair<std::string_view, RolloutRsScope> scopes[] = {{"token_", RolloutRsScope::token},
                                                                           {"seq_sum_", RolloutRsScope::seq_sum},
                                                                           {"seq_mean_", RolloutRsScope::seq_mean},
                                                                           {"seq_max_", RolloutRsScope::seq_max}};
  for (const auto& [prefix, scope] : scopes) {
    if (name.substr(0, prefix.size()) != prefix) continue;
    const auto stat = name.substr(prefix.size());
    RolloutRsOption o;
    o.scope = scope;
    if (stat == "k1" && scope != RolloutRsScope::seq_max)
      o.statistic = RolloutRsStatistic::k1;
    else if (stat == "k2")
      o.statistic = RolloutRsStatistic::k2;
    else if (stat == "k3")
      o.statistic = RolloutRsStatistic::k3;
    else
      return std::nullopt;
    return o;
  }
  return std::nullopt;
}

}  // namespace detail

// verl's rollout_rs and rollout_rs_threshold: comma-separated options (each must pass; repeats
// count once) and one threshold shared by all or one per option. A k1 threshold is "lower_upper"
// or an upper bound alone (lower = 1 / upper); the others are one upper bound.
struct RolloutRsOptions {
  std::vector<RolloutRsOption> options;

  static constexpr std::string_view supported =
      "token_k1, token_k2, token_k3, seq_sum_k1, seq_sum_k2, seq_sum_k3, seq_mean_k1, seq_mean_k2, seq_mean_k3, "
      "seq_max_k2, seq_max_k3";

  static RolloutRsOptions parse(std::string_view rollout_rs, std::string_view rollout_rs_threshold) {
    constexpr std::string_view fn = "ppo::RolloutRsOptions::parse";
    RolloutRsOptions out;
    for (const auto name : detail::comma_parts(rollout_rs)) {
      const auto option = detail::rollout_rs_option_named(name);
      mrr::detail::require(option.has_value(), fn, "invalid rollout_rs option '", name, "'; expected one of ",
                           supported);
      const bool seen = std::any_of(out.options.begin(), out.options.end(), [&](const RolloutRsOption& o) {
        return o.scope == option->scope && o.statistic == option->statistic;
      });
      if (!seen) out.options.push_back(*option);
    }
    mrr::detail::require(!out.options.empty(), fn, "rollout_rs '", rollout_rs, "' names no option; expected one of ",
                         supported);
    auto specs = detail::comma_parts(rollout_rs_threshold);
    mrr::detail::require(!specs.empty(), fn, "rollout_rs_threshold must hold at least one threshold");
    mrr::detail::require(specs.size() == 1 || specs.size() == out.options.size(), fn, "rollout_rs_threshold '",
                         rollout_rs_threshold, "' has ", specs.size(), " thresholds for ", out.options.size(),
                         " rollout_rs options: give one shared by all or one per option");
    for (std::size_t i = 0; i < out.options.size(); ++i) {
      auto& o = out.options[i];
      const auto spec = specs.size() == 1 ? specs[0] : specs[i];
      const auto name = o.name();
      const auto sep = spec.find('_');
      if (o.k1()) {
        o.upper =
            detail::parse_threshold_number(fn, name, spec, sep == std::string_view::npos ? spec : spec.substr(sep + 1));
        o.lower = sep == std::string_view::npos ? 1.0 / o.upper
                                                : detail::parse_threshold_number(fn, name, spec, spec.substr(0, sep));
      } else {
        mrr::detail::require(sep == std::string_view::npos, fn, "rollout_rs_threshold for option '", name,
                             "' must be a single upper bound without '_', got '", spec, "'");
        o.upper = detail::parse_threshold_number(fn, name, spec, spec);
      }
      out.validate_option(o);
    }
    return out;
  }

  // One number for every option (verl's float rollout_rs_threshold).
  static RolloutRsOptions parse(std::string_view rollout_rs, double rollout_rs_threshold) {
    RolloutRsOptions out = parse(rollout_rs, std::string_view("1"));
    for (auto& o : out.options) {
      o.upper = rollout_rs_threshold;
      o.lower = 1.0 / rollout_rs_threshold;
      out.validate_option(o);
    }
    return out;
  }

  void validate() const {
    mrr::detail::require(!options.empty(), "ppo::RolloutRsOptions", "no rejection option is set");
    for (const auto& o : options)
      validate_option(o);
  }

 private:
  static void validate_option(const RolloutRsOption& o) {
    constexpr std::string_view fn = "ppo::RolloutRsOptions";
    const auto name = o.name();
    mrr::detail::require(o.upper > 0 && !std::isnan(o.upper), fn, "the threshold of option '", name,
                         "' must be positive, got ", o.upper);
    if (o.k1()) {
      mrr::detail::require(o.lower > 0 && std::isfinite(o.lower), fn, "the lower threshold of option '", name,
                           "' must be positive and finite, got ", o.lower);
      mrr::detail::require(o.lower <= o.upper, fn, "the thresholds of option '", name, "' must be lower <= upper, got ",
                           o.lower, " and ", o.upper);
    }
  }
};

template <class T>
struct RolloutRsResult {
  RowMatrix<T> response_mask;  // the input mask with the rejected tokens set to 0
  // verl's metrics under its keys: per option rollout_rs_<option>_{mean, max, min, std,
  // fraction_high, fraction_low, seq_mean, seq_std, seq_max, seq_min, seq_max_deviation,
  // seq_fraction_high[, seq_fraction_low], masked_fraction, seq_masked_fraction}, and
  // rollout_rs_masked_fraction, rollout_rs_seq_masked_fraction for all options together.
  std::map<std::string, T, std::less<>> metrics;
};

namespace detail {

// torch's CPU sum of these doubles, in order.
inline double torch_sum(const std::vector<double>& values) {
  return kernels::ppo::torch_order_sum<double>(values.data(), kernels::ppo::IdentityIndex{},
                                               static_cast<long>(values.size()));
}

// verl's masked_sum of value(i, j) over rows [first, last), in double: sum(where(m, v, 0) m), in
// torch's order over every element (masked ones as 0). The metrics' standard deviations are
// E[x^2] - E[x]^2, which cancels: the same order gives the same digits.
template <class T, class Value>
double torch_masked_sum(const MatrixRef<T>& mask, Value&& value, Eigen::Index first, Eigen::Index last) {
  std::vector<double> terms;
  terms.reserve(static_cast<std::size_t>((last - first) * mask.cols()));
  for (Eigen::Index i = first; i < last; ++i)
    for (Eigen::Index j = 0; j < mask.cols(); ++j) {
      const double m = static_cast<double>(mask(i, j));
      terms.push_back(m != 0 ? static_cast<double>(value(i, j)) * m : 0.0);
    }
  return torch_sum(terms);
}

// verl's masked_mean over rows [first, last) (the whole batch by default): the masked sum above
// / (sum(m) + 1e-8).
template <class T, class Value>
double batch_masked_mean(const MatrixRef<T>& mask, Value&& value, Eigen::Index first = 0, Eigen::Index last = -1) {
  if (last < 0) last = mask.rows();
  const double count = static_cast<double>(mask.middleRows(first, last - first).sum());
  return torch_masked_sum(mask, value, first, last) / (count + kMaskCountEpsilon);
}

}  // namespace detail

// Masks tokens (token_*) or whole sequences (seq_*) whose divergence between the training and the
// rollout policy exceeds the options' thresholds. log_ratio = log pi_train - log pi_rollout per
// token, clamped to +-20 before the statistics. A batch of no rows is returned as given, without
// metrics (as verl); otherwise response_mask must select a token.
template <class T>
RolloutRsResult<T> compute_rollout_rejection_mask(MatrixRef<T> log_ratio, MatrixRef<T> response_mask,
                                                  const RolloutRsOptions& options) {
  constexpr std::string_view fn = "ppo::compute_rollout_rejection_mask";
  using kernels::ppo::rollout_rs_statistic;
  detail::require_same_shape(fn, "log_ratio", log_ratio, "response_mask", response_mask);
  options.validate();
  RolloutRsResult<T> out{RowMatrix<T>(response_mask), {}};
  const Eigen::Index rows = log_ratio.rows(), cols = log_ratio.cols();
  if (rows == 0) return out;
  detail::require_mask(fn, "response_mask", response_mask);
  detail::require_finite_where(fn, "log_ratio", log_ratio, response_mask);
  mrr::detail::require((response_mask.array() != T(0)).any(), fn,
                       "'response_mask' must select at least one valid token");

  std::vector<char> row_valid(static_cast<std::size_t>(rows));
  Eigen::Index valid_rows = 0;
  for (Eigen::Index i = 0; i < rows; ++i)
    valid_rows += (row_valid[static_cast<std::size_t>(i)] = (response_mask.row(i).array() != T(0)).any());
  const double total_tokens = static_cast<double>(response_mask.sum());

  // Sequences with a valid token that `keep` rejects.
  const auto rows_with_rejection = [&](const RowMatrix<T>& keep) {
    Eigen::Index count = 0;
    for (Eigen::Index i = 0; i < rows; ++i) {
      bool rejected = false;
      for (Eigen::Index j = 0; j < cols && !rejected; ++j)
        rejected = response_mask(i, j) != T(0) && keep(i, j) == T(0);
      count += rejected;
    }
    return count;
  };
  RowMatrix<T> keep_all = RowMatrix<T>::Ones(rows, cols);
  RowMatrix<T> stat(rows, cols), per_token(rows, cols);
  Vector<T> per_sequence(rows);
  auto& metrics = out.metrics;
  for (const auto& o : options.options) {
    const bool sequence_level = o.scope != RolloutRsScope::token;
    for (Eigen::Index i = 0; i < rows; ++i)
      for (Eigen::Index j = 0; j < cols; ++j)
        stat(i, j) = rollout_rs_statistic(o.statistic, log_ratio(i, j));
    // Thresholds as verl compares them: k1 in log space (math.log in double), against tensors of T.
    const T upper = static_cast<T>(o.k1() ? std::log(o.upper) : o.upper);
    const T lower = static_cast<T>(o.k1() ? std::log(o.lower) : 0.0);
    const auto passes = [&](T v) { return o.k1() ? v >= lower && v <= upper : v <= upper; };
    RowMatrix<T> keep(rows, cols);
    for (Eigen::Index i = 0; i < rows; ++i) {
      const T* s = stat.row(i).data();
      const T* m = response_mask.row(i).data();
      if (!sequence_level) {
        per_sequence[i] = static_cast<T>(detail::batch_masked_mean(
            response_mask, [&](auto r, auto j) { return stat(r, j); }, i, i + 1));
        for (Eigen::Index j = 0; j < cols; ++j) {
          per_token(i, j) = s[j];
          keep(i, j) = passes(s[j]) ? T(1) : T(0);
        }
        continue;
      }
      T v = 0;
      if (o.scope == RolloutRsScope::seq_sum) {
        v = static_cast<T>(detail::torch_masked_sum(
            response_mask, [&](auto r, auto j) { return stat(r, j); }, i, i + 1));
      } else if (o.scope == RolloutRsScope::seq_mean) {
        v = static_cast<T>(detail::batch_masked_mean(
            response_mask, [&](auto r, auto j) { return stat(r, j); }, i, i + 1));
      } else {  // seq_max: 0 for a sequence without valid tokens
        v = -std::numeric_limits<T>::infinity();
        for (Eigen::Index j = 0; j < cols; ++j)
          if (m[j] != T(0)) v = std::max(v, s[j]);
        if (v == -std::numeric_limits<T>::infinity()) v = T(0);
      }
      per_sequence[i] = v;
      per_token.row(i).setConstant(v);
      keep.row(i).setConstant(passes(v) ? T(1) : T(0));
    }

    // verl's compute_rs_metrics. Sequence values: the per-sequence statistic (seq_*) or the masked
    // mean of the token statistic, over sequences with a valid token.
    const std::string prefix = "rollout_rs_" + o.name();
    std::vector<T> seq;
    for (Eigen::Index i = 0; i < rows; ++i)
      if (row_valid[static_cast<std::size_t>(i)]) seq.push_back(per_sequence[i]);
    const auto n_seq = static_cast<Eigen::Index>(seq.size());
    const auto count_if = [&](auto&& pred) {
      return static_cast<Eigen::Index>(std::count_if(seq.begin(), seq.end(), pred));
    };
    metrics[prefix + "_mean"] =
        static_cast<T>(detail::batch_masked_mean(response_mask, [&](auto i, auto j) { return per_token(i, j); }));
    if (sequence_level && n_seq > 0) {
      metrics[prefix + "_max"] = *std::max_element(seq.begin(), seq.end());
      metrics[prefix + "_min"] = *std::min_element(seq.begin(), seq.end());
      metrics[prefix + "_fraction_high"] = detail::float32_fraction<T>(count_if([&](T v) { return v > upper; }), n_seq);
      metrics[prefix + "_fraction_low"] =
          o.k1() ? detail::float32_fraction<T>(count_if([&](T v) { return v < lower; }), n_seq) : T(0);
    } else {
      T mx = -std::numeric_limits<T>::infinity(), mn = std::numeric_limits<T>::infinity();
      for (Eigen::Index i = 0; i < rows; ++i)
        for (Eigen::Index j = 0; j < cols; ++j)
          if (response_mask(i, j) != T(0)) {
            mx = std::max(mx, per_token(i, j));
            mn = std::min(mn, per_token(i, j));
          }
      metrics[prefix + "_max"] = mx;
      metrics[prefix + "_min"] = mn;
      metrics[prefix + "_fraction_high"] = static_cast<T>(detail::batch_masked_mean(
          response_mask, [&](auto i, auto j) { return per_token(i, j) > upper ? 1.0 : 0.0; }));
      metrics[prefix + "_fraction_low"] =
          o.k1() ? static_cast<T>(detail::batch_masked_mean(
                       response_mask, [&](auto i, auto j) { return per_token(i, j) < lower ? 1.0 : 0.0; }))
                 : T(0);
    }
    if (total_tokens > 1) {
      const T clamp_low = o.k1() ? lower : T(0);
      const auto clamped = [&](auto i, auto j) { return std::clamp(per_token(i, j), clamp_low, upper); };
      const double mean = detail::batch_masked_mean(response_mask, clamped);
      const double second = detail::batch_masked_mean(response_mask, [&](auto i, auto j) {
        const double c = clamped(i, j);
        return c * c;
      });
      metrics[prefix + "_std"] = static_cast<T>(std::sqrt(std::max(second - mean * mean, 0.0)));
    } else {
      metrics[prefix + "_std"] = T(0);
    }
    if (n_seq > 0) {
      const double mean = detail::torch_sum(std::vector<double>(seq.begin(), seq.end())) / static_cast<double>(n_seq);
      double squares = 0, deviation = 0;
      for (const T v : seq) {
        squares += (static_cast<double>(v) - mean) * (static_cast<double>(v) - mean);
        deviation = std::max(deviation, std::abs(static_cast<double>(v)));
      }
      metrics[prefix + "_seq_mean"] = static_cast<T>(mean);
      metrics[prefix + "_seq_std"] =
          n_seq > 1 ? static_cast<T>(std::sqrt(squares / static_cast<double>(n_seq - 1))) : T(0);
      metrics[prefix + "_seq_max"] = *std::max_element(seq.begin(), seq.end());
      metrics[prefix + "_seq_min"] = *std::min_element(seq.begin(), seq.end());
      metrics[prefix + "_seq_max_deviation"] = static_cast<T>(deviation);
      metrics[prefix + "_seq_fraction_high"] =
          detail::float32_fraction<T>(count_if([&](T v) { return v > upper; }), n_seq);
      if (o.k1())
        metrics[prefix + "_seq_fraction_low"] =
            detail::float32_fraction<T>(count_if([&](T v) { return v < lower; }), n_seq);
    } else {
      for (const char* key : {"_seq_mean", "_seq_std", "_seq_max", "_seq_min", "_seq_max_deviation",
                              "_seq_fraction_high", "_seq_fraction_low"})
        metrics[prefix + key] = T(0);
    }

    // How much this option rejects, by token and by sequence (sequences with a rejected valid token
    // among those with a valid token).
    metrics[prefix + "_masked_fraction"] = static_cast<T>(detail::batch_masked_mean(
        response_mask, [&](auto i, auto j) { return 1.0 - static_cast<double>(keep(i, j)); }));
    const Eigen::Index rejected_rows = rows_with_rejection(keep);
    metrics[prefix + "_seq_masked_fraction"] =
        valid_rows > 0 ? static_cast<T>(static_cast<double>(rejected_rows) / static_cast<double>(valid_rows)) : T(0);
    keep_all.array() *= keep.array();
  }

  metrics["rollout_rs_masked_fraction"] = static_cast<T>(detail::batch_masked_mean(
      response_mask, [&](auto i, auto j) { return 1.0 - static_cast<double>(keep_all(i, j)); }));
  metrics["rollout_rs_seq_masked_fraction"] = detail::float32_fraction<T>(rows_with_rejection(keep_all), rows);
  out.response_mask.array() *= keep_all.array();
  return out;
}

template <class T>
RolloutRsResult<T> compute_rollout_rejection_mask(MatrixRef<T> log_ratio, MatrixRef<T> response_mask,
                                                  std::string_view rollout_rs, std::string_view rollout_rs_threshold) {
  return compute_rollout_rejection_mask<T>(log_ratio, response_mask,
                                           RolloutRsOptions::parse(rollout_rs, rollout_rs_threshold));
}

// verl's off-policy diagnostics of the training policy (old_log_prob) against the rollout policy,
// unprefixed: training_ppl / training_log_ppl and rollout_ppl / rollout_log_ppl (batch means of
// each sequence's perplexity and its log, sequences without valid tokens counting as perplexity 1),
// kl = mean(log p_rollout - log p_train) and k3_kl = mean(r - log r - 1) with r = p_train /
// p_rollout, log_ppl_diff (mean, abs mean, max, min), ppl_ratio, chi2_token = E[r^2] - 1 and
// chi2_seq = E[(prod r)^2] - 1 (log-ratios clamped to +-20 there).
template <class T>
std::map<std::string, T, std::less<>> compute_offpolicy_metrics(MatrixRef<T> old_log_prob,
                                                                MatrixRef<T> rollout_log_prob,
                                                                MatrixRef<T> response_mask) {
  constexpr std::string_view fn = "ppo::compute_offpolicy_metrics";
  detail::require_same_shape(fn, "old_log_prob", old_log_prob, "rollout_log_prob", rollout_log_prob);
  detail::require_same_shape(fn, "old_log_prob", old_log_prob, "response_mask", response_mask);
  detail::require_mask(fn, "response_mask", response_mask);
  detail::require_finite_where(fn, "old_log_prob", old_log_prob, response_mask);
  detail::require_finite_where(fn, "rollout_log_prob", rollout_log_prob, response_mask);
  mrr::detail::require((response_mask.array() != T(0)).any(), fn,
                       "'response_mask' must select at least one valid token");
  const Eigen::Index rows = old_log_prob.rows();
  const double bound = kernels::ppo::kRolloutSafetyBound, n = static_cast<double>(rows);
  // Per sequence, then batch means in torch's order.
  std::vector<double> train_ppl, train_log_ppl, rollout_ppl, rollout_log_ppl, diff, abs_diff, ppl_ratio, chi2_seq;
  double diff_max = -std::numeric_limits<double>::infinity(), diff_min = std::numeric_limits<double>::infinity();
  for (Eigen::Index i = 0; i < rows; ++i) {
    const auto row_mean = [&](const MatrixRef<T>& v) {
      return static_cast<T>(detail::batch_masked_mean(
          response_mask, [&](auto r, auto j) { return v(r, j); }, i, i + 1));
    };
    const T train = row_mean(old_log_prob), rollout = row_mean(rollout_log_prob);
    train_ppl.push_back(std::exp(-static_cast<double>(train)));
    train_log_ppl.push_back(-static_cast<double>(train));
    rollout_ppl.push_back(std::exp(-static_cast<double>(rollout)));
    rollout_log_ppl.push_back(-static_cast<double>(rollout));
    const double d = static_cast<double>(rollout - train);
    diff.push_back(d);
    abs_diff.push_back(std::abs(d));
    diff_max = std::max(diff_max, d);
    diff_min = std::min(diff_min, d);
    ppl_ratio.push_back(std::exp(d));
    const auto log_ratio_sum = static_cast<T>(detail::torch_masked_sum(
        response_mask, [&](auto r, auto j) { return old_log_prob(r, j) - rollout_log_prob(r, j); }, i, i + 1));
    chi2_seq.push_back(std::exp(2.0 * std::clamp(static_cast<double>(log_ratio_sum), -bound, bound)));
  }
  std::map<std::string, T, std::less<>> metrics;
  const auto mean = [&](const std::vector<double>& v) { return static_cast<T>(detail::torch_sum(v) / n); };
  metrics["training_ppl"] = mean(train_ppl);
  metrics["training_log_ppl"] = mean(train_log_ppl);
  metrics["kl"] = static_cast<T>(detail::batch_masked_mean(
      response_mask, [&](auto i, auto j) { return static_cast<double>(rollout_log_prob(i, j) - old_log_prob(i, j)); }));
  metrics["k3_kl"] = static_cast<T>(detail::batch_masked_mean(response_mask, [&](auto i, auto j) {
    const double r = static_cast<double>(old_log_prob(i, j) - rollout_log_prob(i, j));
    return std::exp(r) - r - 1.0;
  }));
  metrics["rollout_ppl"] = mean(rollout_ppl);
  metrics["rollout_log_ppl"] = mean(rollout_log_ppl);
  metrics["log_ppl_diff"] = mean(diff);
  metrics["log_ppl_abs_diff"] = mean(abs_diff);
  metrics["log_ppl_diff_max"] = static_cast<T>(diff_max);
  metrics["log_ppl_diff_min"] = static_cast<T>(diff_min);
  metrics["ppl_ratio"] = mean(ppl_ratio);
  metrics["chi2_token"] = static_cast<T>(
      detail::batch_masked_mean(response_mask,
                                [&](auto i, auto j) {
                                  const double r = std::clamp(
                                      static_cast<double>(old_log_prob(i, j) - rollout_log_prob(i, j)), -bound, bound);
                                  return std::exp(2.0 * r);
                                }) -
      1.0);
  metrics["chi2_seq"] = static_cast<T>(detail::torch_sum(chi2_seq) / n - 1.0);
  return metrics;
}

// What verl's bypass_mode loss computes on the rollout's tokens (policy_loss.rollout_correction).
enum class BypassLossType {
  ppo_clip,   // PPO's clipped loss with old_log_prob = the rollout's; no IS weights (the ratio is one)
  reinforce,  // -w A log p with the IS weights w (when rollout_is is set)
};

inline BypassLossType parse_bypass_loss_type(std::string_view name) {
  if (name == "ppo_clip") return BypassLossType::ppo_clip;
  if (name == "reinforce") return BypassLossType::reinforce;
  mrr::detail::throw_invalid_argument("ppo::parse_bypass_loss_type", "invalid loss_type '", name,
                                      "'; expected 'ppo_clip' or 'reinforce'");
}

// verl's rollout correction settings (RolloutCorrectionConfig): IS weights when `is` is set
// (rollout_is), rejection when `rs` is set (rollout_rs), and, for bypass_mode, the loss type.
struct RolloutCorrectionConfig {
  std::optional<RolloutIsOptions> is;
  std::optional<RolloutRsOptions> rs;
  BypassLossType loss_type = BypassLossType::ppo_clip;
};

template <class T>
struct RolloutCorrectionResult {
  std::optional<RowMatrix<T>> weights;  // the IS weights, when config.is is set
  RowMatrix<T> response_mask;           // the mask after rejection (the input's without config.rs)
  // Every metric of the IS weights, the rejection and compute_offpolicy_metrics, prefixed
  // "rollout_corr/" as verl logs them.
  std::map<std::string, T, std::less<>> metrics;
};

// verl's compute_rollout_correction_and_rejection_mask: old_log_prob is the training policy's,
// rollout_log_prob the rollout engine's, per token.
template <class T>
RolloutCorrectionResult<T> compute_rollout_correction_and_rejection_mask(MatrixRef<T> old_log_prob,
                                                                         MatrixRef<T> rollout_log_prob,
                                                                         MatrixRef<T> response_mask,
                                                                         const RolloutCorrectionConfig& config) {
  constexpr std::string_view fn = "ppo::compute_rollout_correction_and_rejection_mask";
  detail::require_same_shape(fn, "old_log_prob", old_log_prob, "rollout_log_prob", rollout_log_prob);
  detail::require_same_shape(fn, "old_log_prob", old_log_prob, "response_mask", response_mask);
  detail::require_mask(fn, "response_mask", response_mask);
  mrr::detail::require((response_mask.array() != T(0)).any(), fn,
                       "'response_mask' must select at least one valid token");
  detail::require_finite_where(fn, "old_log_prob", old_log_prob, response_mask);
  detail::require_finite_where(fn, "rollout_log_prob", rollout_log_prob, response_mask);
  // Masked tokens may hold anything; their log-ratio is never read.
  RowMatrix<T> log_ratio(old_log_prob.rows(), old_log_prob.cols());
  for (Eigen::Index i = 0; i < log_ratio.rows(); ++i)
    for (Eigen::Index j = 0; j < log_ratio.cols(); ++j)
      log_ratio(i, j) = response_mask(i, j) != T(0) ? old_log_prob(i, j) - rollout_log_prob(i, j) : T(0);

  RolloutCorrectionResult<T> out;
  std::map<std::string, T, std::less<>> metrics;
  if (config.is) {
    auto is = compute_rollout_correction_weights<T>(log_ratio, response_mask, *config.is);
    out.weights = std::move(is.weights);
    metrics.merge(is.metrics);
  }
  if (config.rs) {
    auto rs = compute_rollout_rejection_mask<T>(log_ratio, response_mask, *config.rs);
    out.response_mask = std::move(rs.response_mask);
    metrics.merge(rs.metrics);
  } else {
    out.response_mask = response_mask;
  }
  metrics.merge(compute_offpolicy_metrics<T>(old_log_prob, rollout_log_prob, response_mask));
  for (auto& [key, value] : metrics)
    out.metrics.emplace("rollout_corr/" + key, value);
  return out;
}

}  // namespace ppo
MRR_NAMESPACE_END
