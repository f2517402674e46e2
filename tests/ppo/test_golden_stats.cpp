// Golden cases of masked.json (masked statistics, entropy) and rollout_correction.json
// (truncated importance-sampling weights).
#include "ppo_golden.hpp"

#include <mrr/ppo/masked.hpp>
#include <mrr/ppo/rollout_correction.hpp>
#include <mrr/ppo/rollout_rejection.hpp>

#include <doctest/doctest.h>

#include <string>

namespace {

using namespace mrr;
using mrr::test::GoldenCase;
using mrr::test::ppo::OutputChecker;

template <class T>
bool run_masked(const GoldenCase& c, OutputChecker<T>& check) {
  if (c.fn == "entropy_from_logits") {
    check.matrix("out", ppo::entropy_from_logits<T>(mrr::test::ppo::token_rows<T>(c.input("logits"))));
    return true;
  }
  const RowMatrix<T> values = c.input("values").matrix<T>();
  const RowMatrix<T> mask = c.input("mask").matrix<T>();
  if (c.fn == "masked_mean") {
    if (!c.has_param("axis")) {
      check.scalar("out", static_cast<double>(ppo::masked_mean<T>(values, mask)));
      return true;
    }
    // axis 0 (a mean per column): the row means of the transposes, summed in torch's order for
    // dim 0 of a [B, L] tensor (row after row).
    const auto axis = c.param<int>("axis");
    if (axis == 0 || axis == -2) {
      const RowMatrix<T> values_t = values.transpose(), mask_t = mask.transpose();
      check.matrix("out", ppo::masked_row_mean<T>(values_t, mask_t));
      return true;
    }
    if (axis != 1 && axis != -1) return false;
    check.matrix("out", ppo::masked_row_mean<T>(values, mask));
    return true;
  }
  if (c.fn == "masked_var") {
    check.scalar("out", static_cast<double>(ppo::masked_var<T>(values, mask, c.param<bool>("unbiased", true))));
    return true;
  }
  if (c.fn == "masked_whiten") {
    check.matrix("out", ppo::masked_whiten<T>(values, mask, c.param<bool>("shift_mean", true)));
    return true;
  }
  return false;
}

template <class T>
bool run_rollout(const GoldenCase& c, OutputChecker<T>& check) {
  if (c.fn == "rollout_rejection_mask") {
    const auto rc = mrr::test::ppo::rollout_correction_config(c, "");
    const auto out = ppo::compute_rollout_rejection_mask<T>(c.input("log_ratio").matrix<T>(),
                                                            c.input("response_mask").matrix<T>(), rc.rs.value());
    check.matrix("response_mask", out.response_mask);
    mrr::test::ppo::check_metrics(check, out.metrics);
    return true;
  }
  if (c.fn == "rollout_correction_and_rejection_mask") {
    const auto out = ppo::compute_rollout_correction_and_rejection_mask<T>(
        c.input("old_log_prob").matrix<T>(), c.input("rollout_log_prob").matrix<T>(),
        c.input("response_mask").matrix<T>(), mrr::test::ppo::rollout_correction_config(c, ""));
    check.matrix("response_mask", out.response_mask);
    CHECK(out.weights.has_value() == check.has("weights"));
    if (out.weights && check.has("weights")) check.matrix("weights", *out.weights);
    mrr::test::ppo::check_metrics(check, out.metrics);
    return true;
  }
  if (c.fn != "rollout_is_weights") return false;
  ppo::RolloutIsOptions options;
  options.level = ppo::parse_rollout_is_level(c.param<std::string>("rollout_is", "token"));
  const auto& threshold = c.params.at("rollout_is_threshold");
  options.threshold = threshold.is_string() ? ppo::RolloutIsThreshold::parse(threshold.get<std::string>())
                                            : ppo::RolloutIsThreshold::truncate_at(threshold.get<double>());
  options.batch_normalize = c.param<bool>("rollout_is_batch_normalize", false);
  const auto out = ppo::compute_rollout_correction_weights<T>(c.input("log_ratio").matrix<T>(),
                                                              c.input("response_mask").matrix<T>(), options);
  check.matrix("weights", out.weights);
  for (const auto& key : check.keys_with_prefix("metric:")) {
    const auto it = out.metrics.find(key.substr(7));
    if (it == out.metrics.end()) {
      FAIL_CHECK("metric '" << key << "' is not reported");
      continue;
    }
    check.scalar(key, static_cast<double>(it->second));
  }
  return true;
}

}  // namespace

TEST_SUITE("golden") {
  TEST_CASE_TEMPLATE("masked.json: masked mean/var/whiten and entropy_from_logits", T, double, float) {
    mrr::test::ppo::for_each_case<T>(
        "masked.json", [](const GoldenCase& c, OutputChecker<T>& check) { return run_masked<T>(c, check); });
  }

  TEST_CASE_TEMPLATE("rollout_correction.json: truncated IS weights, rejection sampling, off-policy metrics", T, double,
                     float) {
    mrr::test::ppo::for_each_case<T>("rollout_correction.json", [](const GoldenCase& c, OutputChecker<T>& check) {
      return run_rollout<T>(c, check);
    });
  }
}
