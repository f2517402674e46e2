// Advantage estimators by verl's name (algorithm.adv_estimator): one entry point that checks
// that the inputs the named estimator needs are present and rejects unknown names.
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>
#include <mrr/ppo/advantage.hpp>
#include <mrr/ppo/groups.hpp>
#include <mrr/ppo/optional_view.hpp>
#include <mrr/tensor.hpp>

#include <array>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

MRR_NAMESPACE_BEGIN
namespace ppo {

enum class AdvantageEstimator {
  gae,
  grpo,
  grpo_vectorized,
  grpo_passk,
  rloo,
  rloo_vectorized,
  opo,
  reinforce_plus_plus,
  reinforce_plus_plus_baseline,
  remax,
  gpg,
  gdpo,
  optimal_token_baseline,
  tir_optimal_token_baseline,
};

inline constexpr std::array<std::string_view, 14> kAdvantageEstimatorNames = {"gae",
                                                                              "grpo",
                                                                              "grpo_vectorized",
                                                                              "grpo_passk",
                                                                              "rloo",
                                                                              "rloo_vectorized",
                                                                              "opo",
                                                                              "reinforce_plus_plus",
                                                                              "reinforce_plus_plus_baseline",
                                                                              "remax",
                                                                              "gpg",
                                                                              "gdpo",
                                                                              "optimal_token_baseline",
                                                                              "tir_optimal_token_baseline"};

inline std::string_view to_string(AdvantageEstimator estimator) {
  return kAdvantageEstimatorNames[static_cast<std::size_t>(estimator)];
}

inline std::string advantage_estimator_list() {
  std::string list;
  for (const auto name : kAdvantageEstimatorNames) {
    if (!list.empty()) list += ", ";
    list += name;
  }
  return list;
}

inline AdvantageEstimator parse_advantage_estimator(std::string_view name) {
  for (std::size_t i = 0; i < kAdvantageEstimatorNames.size(); ++i)
    if (kAdvantageEstimatorNames[i] == name) return static_cast<AdvantageEstimator>(i);
  mrr::detail::throw_invalid_argument("ppo::parse_advantage_estimator", "unknown advantage estimator '", name,
                                      "'; expected one of: ", advantage_estimator_list());
}

// The inputs of every estimator; each uses a subset (values: gae; index: the group-based ones;
// reward_baselines: remax; old_log_probs, sum_pi_squared and, when IS-corrected,
// rollout_is_weights: the optimal token baselines; reward_components [components, batch]: gdpo,
// optional). The views point into the caller's matrices, which must outlive the call.
template <class T>
struct AdvantageInputs {
  MatrixRef<T> token_level_rewards;
  MatrixRef<T> response_mask;
  OptionalMatrixView<T> values = {};
  const GroupIndex* index = nullptr;
  OptionalVectorView<T> reward_baselines = {};
  OptionalMatrixView<T> old_log_probs = {};
  OptionalMatrixView<T> sum_pi_squared = {};
  OptionalMatrixView<T> rollout_is_weights = {};
  OptionalMatrixView<T> reward_components = {};
};

// verl's AlgoConfig fields the estimators read, with its defaults.
struct AdvantageConfig {
  double gamma = 1.0;                   // gae, reinforce_plus_plus
  double lam = 1.0;                     // gae
  double epsilon = 1e-6;                // grpo family
  bool norm_adv_by_std_in_grpo = true;  // grpo, grpo_vectorized, grpo_passk
  double f_norm = 1.0;                  // gpg (verl's keyword argument, not an AlgoConfig field)
  std::vector<double> gdpo_reward_weights = {};  // gdpo: one per reward component, or none (weight 1)
  // The optimal token baselines' keyword arguments (verl's trainer passes neither: these defaults).
  bool handle_zero_tail = true;
  double token_baseline_epsilon = 1e-8;
};

// Writes the named estimator's result into `out` (storage reused when the shape matches).
template <class T>
void compute_advantage_into(AdvantageResult<T>& out, AdvantageEstimator estimator, const AdvantageInputs<T>& in,
                            const AdvantageConfig& config = {}) {
  constexpr std::string_view fn = "ppo::compute_advantage";
  const auto need_index = [&]() -> const GroupIndex& {
    mrr::detail::require(in.index != nullptr, fn, "advantage estimator '", to_string(estimator),
                         "' needs 'index' (the group id of each response)");
    return *in.index;
  };
  const auto& r = in.token_level_rewards;
  const auto& m = in.response_mask;
  switch (estimator) {
    case AdvantageEstimator::gae:
      mrr::detail::require(in.values.has_value(), fn, "advantage estimator 'gae' needs 'values'");
      return compute_gae_advantage_return_into<T>(out, r, in.values.map(), m, config.gamma, config.lam);
    case AdvantageEstimator::grpo:
      return compute_grpo_outcome_advantage_into<T>(out, r, m, need_index(), config.epsilon,
                                                    config.norm_adv_by_std_in_grpo);
    case AdvantageEstimator::grpo_vectorized:
      return compute_grpo_vectorized_outcome_advantage_into<T>(out, r, m, need_index(), config.epsilon,
                                                               config.norm_adv_by_std_in_grpo);
    case AdvantageEstimator::grpo_passk:
      return compute_grpo_passk_outcome_advantage_into<T>(out, r, m, need_index(), config.epsilon,
                                                          config.norm_adv_by_std_in_grpo);
    case AdvantageEstimator::rloo:
      return compute_rloo_outcome_advantage_into<T>(out, r, m, need_index());
    case AdvantageEstimator::rloo_vectorized:
      return compute_rloo_vectorized_outcome_advantage_into<T>(out, r, m, need_index());
    case AdvantageEstimator::opo:
      return compute_opo_outcome_advantage_into<T>(out, r, m, need_index());
    case AdvantageEstimator::reinforce_plus_plus:
      return compute_reinforce_plus_plus_outcome_advantage_into<T>(out, r, m, config.gamma);
    case AdvantageEstimator::reinforce_plus_plus_baseline:
      return compute_reinforce_plus_plus_baseline_outcome_advantage_into<T>(out, r, m, need_index());
    case AdvantageEstimator::remax:
      mrr::detail::require(in.reward_baselines.has_value(), fn, "advantage estimator 'remax' needs 'reward_baselines'");
      return compute_remax_outcome_advantage_into<T>(out, r, in.reward_baselines.map(), m);
    case AdvantageEstimator::gpg:
      return compute_gpg_outcome_advantage_into<T>(out, r, m, need_index(), config.f_norm);
    case AdvantageEstimator::gdpo:
      return compute_gdpo_outcome_advantage_into<T>(out, r, m, need_index(), in.reward_components,
                                                    config.gdpo_reward_weights, config.epsilon,
                                                    config.norm_adv_by_std_in_grpo);
    case AdvantageEstimator::optimal_token_baseline:
    case AdvantageEstimator::tir_optimal_token_baseline: {
      const GroupIndex& index = need_index();
      for (const auto& [view, name] :
           {std::pair{&in.old_log_probs, "old_log_probs"}, std::pair{&in.sum_pi_squared, "sum_pi_squared"}})
        mrr::detail::require(view->has_value(), fn, "advantage estimator '", to_string(estimator), "' needs '", name,
                             "'");
      return estimator == AdvantageEstimator::optimal_token_baseline
                 ? compute_optimal_token_baseline_advantage_into<T>(
                       out, r, m, index, in.old_log_probs.map(), in.sum_pi_squared.map(), in.rollout_is_weights,
                       config.handle_zero_tail, config.token_baseline_epsilon)
                 : compute_multi_turn_optimal_token_baseline_advantage_into<T>(
                       out, r, m, index, in.old_log_probs.map(), in.sum_pi_squared.map(), in.rollout_is_weights,
                       config.handle_zero_tail, config.token_baseline_epsilon);
    }
  }
  mrr::detail::throw_invalid_argument(fn, "invalid AdvantageEstimator ", static_cast<int>(estimator));
}

template <class T>
AdvantageResult<T> compute_advantage(AdvantageEstimator estimator, const AdvantageInputs<T>& in,
                                     const AdvantageConfig& config = {}) {
  AdvantageResult<T> out;
  compute_advantage_into<T>(out, estimator, in, config);
  return out;
}

template <class T>
void compute_advantage_into(AdvantageResult<T>& out, std::string_view estimator, const AdvantageInputs<T>& in,
                            const AdvantageConfig& config = {}) {
  compute_advantage_into<T>(out, parse_advantage_estimator(estimator), in, config);
}

// By verl's name: compute_advantage<double>("grpo", inputs, config).
template <class T>
AdvantageResult<T> compute_advantage(std::string_view estimator, const AdvantageInputs<T>& in,
                                     const AdvantageConfig& config = {}) {
  return compute_advantage<T>(parse_advantage_estimator(estimator), in, config);
}

}  // namespace ppo
MRR_NAMESPACE_END
