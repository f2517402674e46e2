// Golden cases of advantage.json (verl core_algos advantage estimators), through the registry.
#include "ppo_golden.hpp"

#include <mrr/ppo/registry.hpp>
#include <mrr/rollout/sampling.hpp>

#include <doctest/doctest.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace {

using namespace mrr;
using mrr::test::GoldenCase;
using mrr::test::ppo::OutputChecker;

// verl's index is any list of hashable ids; the golden files hold integers, other sets may hold strings.
ppo::GroupIndex group_index(const GoldenCase& c) {
  const auto& j = c.inputs.at("index");
  if (!j.empty() && j.front().is_string()) return ppo::GroupIndex(j.get<std::vector<std::string>>());
  return ppo::GroupIndex(j.get<std::vector<std::int64_t>>());
}

template <class T>
bool run_advantage(const GoldenCase& c, OutputChecker<T>& check) {
  const auto estimator = ppo::parse_advantage_estimator(c.fn);
  const RowMatrix<T> rewards = c.input("token_level_rewards").matrix<T>();
  const RowMatrix<T> mask = c.input("response_mask").matrix<T>();
  std::optional<RowMatrix<T>> values, old_log_probs, sum_pi_squared, is_weights, components;
  std::optional<Vector<T>> baselines;
  std::optional<ppo::GroupIndex> index;
  const auto optional_matrix = [&](std::optional<RowMatrix<T>>& m, const char* key) {
    if (c.has_input(key)) m = c.input(key).template matrix<T>();
  };
  optional_matrix(values, "values");
  optional_matrix(old_log_probs, "old_log_probs");
  optional_matrix(sum_pi_squared, "sum_pi_squared");
  optional_matrix(is_weights, "rollout_is_weights");
  optional_matrix(components, "reward_components");
  if (c.has_input("reward_baselines")) baselines = c.input("reward_baselines").vector<T>();
  if (c.has_input("index")) index = group_index(c);

  ppo::AdvantageInputs<T> in{rewards, mask};
  if (values) in.values = *values;
  if (baselines) in.reward_baselines = *baselines;
  if (index) in.index = &*index;
  if (old_log_probs) in.old_log_probs = *old_log_probs;
  if (sum_pi_squared) in.sum_pi_squared = *sum_pi_squared;
  if (is_weights) in.rollout_is_weights = *is_weights;
  if (components) in.reward_components = *components;
  ppo::AdvantageConfig config;
  config.gamma = c.param<double>("gamma", config.gamma);
  config.lam = c.param<double>("lam", config.lam);
  config.norm_adv_by_std_in_grpo = c.param<bool>("norm_adv_by_std_in_grpo", config.norm_adv_by_std_in_grpo);
  config.f_norm = c.param<double>("f_norm", config.f_norm);
  config.handle_zero_tail = c.param<bool>("handle_zero_tail", config.handle_zero_tail);
  config.gdpo_reward_weights = c.param<std::vector<double>>("gdpo_reward_weights", {});
  // verl's epsilon keyword: the grpo family's, or the optimal token baselines' (default 1e-8).
  const bool token_baseline = estimator == ppo::AdvantageEstimator::optimal_token_baseline ||
                              estimator == ppo::AdvantageEstimator::tir_optimal_token_baseline;
  (token_baseline ? config.token_baseline_epsilon : config.epsilon) =
      c.param<double>("epsilon", token_baseline ? config.token_baseline_epsilon : config.epsilon);

  // Cases that carry the logits: sum_pi_squared as verl's calculate_sum_pi_squared_from_logits.
  if (c.has_input("logits")) {
    const RowMatrix<T> logits = c.input("logits").matrix<T>();
    const Vector<T> spsq = rollout::sum_pi_squared_from_logits<T>(logits);
    const auto expected = c.input("sum_pi_squared");
    const auto tol = mrr::test::ppo::tolerance<T>(c, expected);
    const Eigen::Map<const RowMatrix<T>> actual(spsq.data(), rewards.rows(), rewards.cols());
    mrr::test::check_close(actual, expected, tol.rtol, tol.atol, "sum_pi_squared from the logits");
  }

  const auto out = ppo::compute_advantage<T>(estimator, in, config);
  check.matrix("advantages", out.advantages);
  check.matrix("returns", out.returns);
  return true;
}

}  // namespace

TEST_SUITE("golden") {
  TEST_CASE_TEMPLATE("advantage.json: every estimator matches verl", T, double, float) {
    mrr::test::ppo::for_each_case<T>(
        "advantage.json", [](const GoldenCase& c, OutputChecker<T>& check) { return run_advantage<T>(c, check); });
  }
}
