// Bad input gets a clear mrr::InvalidArgument naming the function and the offending argument,
// never a silent wrong number.
#include <mrr/ppo.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace {

using namespace mrr;
using Matrix = RowMatrix<double>;

// Runs f, requires an InvalidArgument, and returns its message.
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const InvalidArgument& e) {
    return e.what();
  } catch (const std::exception& e) {
    FAIL("threw something other than mrr::InvalidArgument: " << std::string(e.what()));
  }
  FAIL("did not throw");
  return {};
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

}  // namespace

TEST_CASE("mismatched shapes name the function and both arguments") {
  const Matrix rewards = Matrix::Ones(3, 4), mask = Matrix::Ones(3, 5), values = Matrix::Ones(2, 4);
  const ppo::GroupIndex index{1, 1, 2};
  auto msg = error_of([&] { ppo::compute_grpo_outcome_advantage<double>(rewards, mask, index); });
  CHECK(contains(msg, "mrr::ppo::compute_grpo_outcome_advantage"));
  CHECK(contains(msg, "'token_level_rewards' has shape [3, 4] but 'response_mask' has shape [3, 5]"));

  msg = error_of([&] { ppo::compute_gae_advantage_return<double>(rewards, values, Matrix::Ones(3, 4), 1.0, 1.0); });
  CHECK(contains(msg, "mrr::ppo::compute_gae_advantage_return"));
  CHECK(contains(msg, "'values' has shape [2, 4]"));

  msg = error_of([&] {
    ppo::compute_policy_loss_vanilla<double>(Matrix::Zero(3, 4), Matrix::Zero(3, 4), Matrix::Zero(3, 3),
                                             Matrix::Ones(3, 4));
  });
  CHECK(contains(msg, "mrr::ppo::compute_policy_loss_vanilla"));
  CHECK(contains(msg, "'advantages' has shape [3, 3]"));

  msg = error_of([&] { ppo::kl_penalty<double>(Matrix::Zero(2, 2), Matrix::Zero(2, 3), "k3"); });
  CHECK(contains(msg, "'ref_logprob' has shape [2, 3]"));

  msg = error_of([&] { ppo::agg_loss<double>(Matrix::Zero(2, 2), Matrix::Ones(3, 2), ppo::LossAggMode::token_mean); });
  CHECK(contains(msg, "mrr::ppo::agg_loss"));

  msg = error_of([&] { ppo::compute_entropy_loss<double>(Matrix::Zero(5, 7), Matrix::Ones(2, 3)); });
  CHECK(contains(msg, "'logits' has shape [5, 7]"));

  msg = error_of([&] {
    const Vector<double> baselines = Vector<double>::Zero(2);
    ppo::compute_remax_outcome_advantage<double>(rewards, baselines, Matrix::Ones(3, 4));
  });
  CHECK(contains(msg, "'reward_baselines' has 2 entries but 'token_level_rewards' has 3 rows"));
}

TEST_CASE("the group ids must cover the batch") {
  const ppo::GroupIndex index{1, 1};
  const auto msg =
      error_of([&] { ppo::compute_rloo_outcome_advantage<double>(Matrix::Ones(3, 2), Matrix::Ones(3, 2), index); });
  CHECK(contains(msg, "'index' has 2 entries but 'token_level_rewards' has 3 rows"));
}

TEST_CASE("an empty batch is an error") {
  const Matrix empty(0, 4);
  const ppo::GroupIndex none(std::vector<std::int64_t>{});
  CHECK(contains(error_of([&] { ppo::compute_grpo_outcome_advantage<double>(empty, empty, none); }), "is empty"));
  CHECK(contains(error_of([&] { ppo::compute_gae_advantage_return<double>(empty, empty, empty, 1, 1); }), "is empty"));
  CHECK(contains(error_of([&] { ppo::compute_policy_loss_vanilla<double>(empty, empty, empty, empty); }), "is empty"));
  CHECK(contains(error_of([&] { ppo::agg_loss<double>(empty, empty, ppo::LossAggMode::token_sum); }), "is empty"));
  CHECK(contains(error_of([&] { ppo::compute_value_loss<double>(empty, empty, empty, empty, 0.2); }), "is empty"));
  CHECK(contains(error_of([&] { ppo::compute_rollout_correction_weights<double>(empty, empty); }), "is empty"));
}

TEST_CASE("grpo_passk needs two responses per group and names the group") {
  const Matrix rewards = Matrix::Ones(3, 2), mask = Matrix::Ones(3, 2);
  const ppo::GroupIndex index(std::vector<std::string>{"prompt-a", "prompt-a", "prompt-b"});
  const auto msg = error_of([&] { ppo::compute_grpo_passk_outcome_advantage<double>(rewards, mask, index); });
  CHECK(contains(msg, "mrr::ppo::compute_grpo_passk_outcome_advantage"));
  CHECK(contains(msg, "group 'prompt-b'"));
  CHECK(contains(msg, "at least 2"));
}

TEST_CASE("NaN and inf in rewards are rejected with their position") {
  Matrix rewards = Matrix::Zero(4, 6);
  const Matrix mask = Matrix::Ones(4, 6);
  const ppo::GroupIndex index{0, 0, 1, 1};
  rewards(2, 5) = std::numeric_limits<double>::quiet_NaN();
  auto msg = error_of([&] { ppo::compute_grpo_outcome_advantage<double>(rewards, mask, index); });
  CHECK(contains(msg, "'token_level_rewards' has a non-finite value nan at [2, 5]"));
  msg = error_of([&] { ppo::compute_gae_advantage_return<double>(rewards, Matrix::Zero(4, 6), mask, 0.99, 0.95); });
  CHECK(contains(msg, "mrr::ppo::compute_gae_advantage_return"));
  CHECK(contains(msg, "'token_level_rewards' has a non-finite value nan at [2, 5]"));

  rewards(2, 5) = 0;
  rewards(1, 0) = std::numeric_limits<double>::infinity();
  for (const auto name : ppo::kAdvantageEstimatorNames) {
    CAPTURE(name);
    const Matrix values = Matrix::Zero(4, 6), log_probs = Matrix::Constant(4, 6, -1.0);
    const Matrix sum_pi_squared = Matrix::Constant(4, 6, 0.5);
    const Vector<double> baselines = Vector<double>::Zero(4);
    ppo::AdvantageInputs<double> in{rewards, mask, values, &index, baselines, log_probs, sum_pi_squared};
    CHECK(contains(error_of([&] { ppo::compute_advantage<double>(name, in); }),
                   "'token_level_rewards' has a non-finite value inf at [1, 0]"));
  }

  // A NaN value in GAE's values, even on a masked position, poisons the recurrence: rejected too.
  Matrix values = Matrix::Zero(4, 6);
  Matrix holes = mask;
  holes(3, 2) = 0;
  values(3, 2) = std::numeric_limits<double>::quiet_NaN();
  msg = error_of([&] { ppo::compute_gae_advantage_return<double>(Matrix::Zero(4, 6), values, holes, 1.0, 1.0); });
  CHECK(contains(msg, "'values' has a non-finite value nan at [3, 2]"));
}

TEST_CASE("non-finite log-probs on valid tokens are rejected, padding may hold anything") {
  Matrix lp = Matrix::Constant(2, 3, -1.0), old = lp, adv = Matrix::Ones(2, 3), mask = Matrix::Ones(2, 3);
  mask(1, 2) = 0;
  lp(1, 2) = std::numeric_limits<double>::quiet_NaN();  // padding
  const auto ok = ppo::compute_policy_loss_vanilla<double>(old, lp, adv, mask);
  CHECK(std::isfinite(ok.loss));
  CHECK(ok.grad_log_prob.allFinite());
  lp(0, 1) = -std::numeric_limits<double>::infinity();
  const auto msg = error_of([&] { ppo::compute_policy_loss_vanilla<double>(old, lp, adv, mask); });
  CHECK(contains(msg, "'log_prob' has a non-finite value -inf at unmasked position [0, 1]"));
}

TEST_CASE("unknown names are rejected with the list of known ones") {
  auto msg = error_of([] { ppo::parse_advantage_estimator("grpo2"); });
  CHECK(contains(msg, "mrr::ppo::parse_advantage_estimator: unknown advantage estimator 'grpo2'"));
  CHECK(contains(msg, "reinforce_plus_plus_baseline"));
  CHECK(contains(msg, "tir_optimal_token_baseline"));  // in the list of known ones
  msg = error_of([] { ppo::parse_policy_loss("ppo"); });
  CHECK(contains(msg, "unknown policy loss 'ppo'"));
  CHECK(contains(msg, "bypass_mode"));  // in the list of known ones
  CHECK(contains(error_of([] { ppo::parse_kl_penalty("k4"); }), "unknown kl_penalty 'k4'"));
  CHECK(contains(error_of([] { ppo::parse_kl_penalty("full"); }), "'full'"));
  CHECK(contains(error_of([] { ppo::parse_loss_agg_mode("token_mean"); }), "unknown loss_agg_mode 'token_mean'"));
  CHECK(contains(error_of([] { ppo::parse_rollout_is_level("batch"); }), "unknown rollout_is 'batch'"));
  CHECK(contains(error_of([] { ppo::RolloutIsThreshold::parse("two"); }), "invalid rollout_is_threshold 'two'"));
  CHECK(contains(error_of([] { ppo::RolloutIsThreshold::parse("3_2"); }), "exceeds upper threshold"));
  CHECK(contains(error_of([] { ppo::KlController<double>::from_config("pid", 0.1); }), "unknown kl_ctrl type 'pid'"));
  const Matrix m = Matrix::Ones(2, 2);
  ppo::AdvantageInputs<double> in{m, m};
  CHECK(contains(error_of([&] { ppo::compute_advantage<double>("nope", in); }), "unknown advantage estimator 'nope'"));
}

TEST_CASE("an estimator without the inputs it needs says which") {
  const Matrix m = Matrix::Ones(2, 2);
  ppo::AdvantageInputs<double> in{m, m};
  CHECK(contains(error_of([&] { ppo::compute_advantage<double>("grpo", in); }), "'grpo' needs 'index'"));
  CHECK(contains(error_of([&] { ppo::compute_advantage<double>("gae", in); }), "'gae' needs 'values'"));
  CHECK(contains(error_of([&] { ppo::compute_advantage<double>("remax", in); }), "'remax' needs 'reward_baselines'"));
}

TEST_CASE("loss configuration errors") {
  const Matrix z = Matrix::Zero(2, 3), ones = Matrix::Ones(2, 3);
  ppo::PolicyLossConfig config;
  CHECK(contains(
      error_of([&] { ppo::compute_policy_loss_dro<double>(z, z, z, ones, ppo::LossAggMode::token_mean, config); }),
      "'dro_beta' must be set to a positive value"));
  config.clip_ratio_c = 1.0;
  CHECK(contains(
      error_of([&] { ppo::compute_policy_loss_vanilla<double>(z, z, z, ones, ppo::LossAggMode::token_mean, config); }),
      "'clip_ratio_c'"));
  for (const double ratio : {0.0, -0.1, 1.5, std::nan("")}) {
    CAPTURE(ratio);
    ppo::PolicyLossConfig kl_cov;
    kl_cov.kl_cov_ratio = ratio;
    CHECK(contains(
        error_of([&] { ppo::compute_policy_loss_kl_cov<double>(z, z, z, ones, ppo::LossAggMode::token_mean, kl_cov); }),
        "mrr::ppo::compute_policy_loss_kl_cov: 'kl_cov_ratio' (the share of valid tokens to penalise) "
        "must be in (0, 1]"));
  }
  for (const double ratio : {0.0, 2.0}) {
    ppo::PolicyLossConfig clip_cov;
    clip_cov.clip_cov_ratio = ratio;
    CHECK(contains(error_of([&] {
                     ppo::compute_policy_loss_clip_cov<double>(z, z, z, ones, ppo::LossAggMode::token_mean, clip_cov);
                   }),
                   "'clip_cov_ratio' (the most of the valid tokens to drop) must be in (0, 1]"));
  }
  ppo::PolicyLossConfig bounds;
  bounds.clip_cov_lb = 5;
  CHECK(contains(
      error_of([&] { ppo::compute_policy_loss_clip_cov<double>(z, z, z, ones, ppo::LossAggMode::token_mean, bounds); }),
      "'clip_cov_lb' (5) must be below 'clip_cov_ub' (5)"));
  ppo::PolicyLossConfig kl_coef;
  kl_coef.ppo_kl_coef = std::numeric_limits<double>::infinity();
  CHECK(contains(
      error_of([&] { ppo::compute_policy_loss_kl_cov<double>(z, z, z, ones, ppo::LossAggMode::token_mean, kl_coef); }),
      "'ppo_kl_coef' must be finite, got inf"));
  ppo::GlobalBatchInfo info;
  info.dp_size = 2;
  CHECK(contains(error_of([&] { ppo::agg_loss<double>(z, ones, ppo::LossAggMode::token_mean, info); }),
                 "'batch_num_tokens' (global) is required"));
  CHECK(contains(error_of([&] { ppo::agg_loss<double>(z, ones, ppo::LossAggMode::seq_mean_token_mean, info); }),
                 "'global_batch_size' is required"));
  info.dp_size = 0;
  CHECK(contains(error_of([&] { ppo::agg_loss<double>(z, ones, ppo::LossAggMode::token_sum, info); }), "'dp_size'"));
  // verl would return 0/0 = NaN for an all-masked micro-batch without a global count.
  CHECK(
      contains(error_of([&] { ppo::agg_loss<double>(z, z, ppo::LossAggMode::token_mean); }), "pass batch_num_tokens"));
  CHECK(contains(error_of([&] { ppo::agg_loss<double>(z, z, ppo::LossAggMode::seq_mean_token_sum); }),
                 "pass global_batch_size"));
  ppo::GlobalBatchInfo global;
  global.batch_num_tokens = 10;
  CHECK(ppo::agg_loss<double>(ones, z, ppo::LossAggMode::token_mean, global) == 0.0);

  Matrix weights = ones;
  weights(1, 1) = -0.5;
  const ppo::OptionalMatrixView<double> w(weights);
  CHECK(contains(
      error_of([&] { ppo::compute_policy_loss_gpg<double>(z, z, z, ones, ppo::LossAggMode::token_mean, {}, w); }),
      "'rollout_is_weights' has a negative weight -0.5 at [1, 1]"));
}

TEST_CASE("statistics that need two elements say so") {
  Matrix mask = Matrix::Zero(2, 3);
  mask(0, 0) = 1;
  const Matrix values = Matrix::Ones(2, 3);
  CHECK(contains(error_of([&] { ppo::masked_var<double>(values, mask); }), "a single element"));
  CHECK(contains(error_of([&] { ppo::masked_whiten<double>(values, Matrix::Zero(2, 3)); }), "no element"));
  CHECK(contains(error_of([&] { ppo::compute_gae_advantage_return<double>(values, values, mask, 1.0, 1.0); }),
                 "'response_mask' selects a single element"));
  CHECK(contains(error_of([&] { ppo::compute_rollout_correction_weights<double>(values, Matrix::Zero(2, 3)); }),
                 "at least one valid token"));
}

TEST_CASE("KL controller arguments") {
  CHECK(contains(error_of([] { ppo::KlController<double>::adaptive(0.1, 0.1, 0); }), "'horizon' must be positive"));
  CHECK(contains(error_of([] { ppo::KlController<double>::adaptive(0.1, 0.0, 100); }), "'target_kl' must be positive"));
  auto controller = ppo::KlController<double>::adaptive(0.1, 0.1, 100);
  CHECK(contains(error_of([&] { controller.update(std::numeric_limits<double>::quiet_NaN(), 1); }), "'current_kl'"));
}

TEST_CASE("mask values other than 0 and 1 are rejected, naming the argument and the index") {
  const Matrix z = Matrix::Zero(3, 4), ones = Matrix::Ones(3, 4);
  for (const double bad : {0.5, 2.0, -1.0, std::numeric_limits<double>::quiet_NaN()}) {
    CAPTURE(bad);
    Matrix mask = ones;
    mask(1, 2) = bad;
    const std::string at = "'response_mask' has ";
    const auto names_index = [&](const std::string& msg, const std::string& function) {
      CHECK(contains(msg, "mrr::" + function));
      CHECK(contains(msg, at));
      CHECK(contains(msg, " at [1, 2]; a mask holds 0 or 1"));
    };
    for (const auto name :
         {"vanilla", "gspo", "sapo", "gpg", "geo_mean", "cispo", "dppo_tv", "dppo_kl", "dro", "kl_cov", "clip_cov"}) {
      CAPTURE(name);
      names_index(error_of([&] { ppo::compute_policy_loss<double>(name, z, z, z, mask, "token-mean"); }),
                  std::string("ppo::compute_policy_loss_") + name);
    }
    const ppo::GroupIndex index{1, 1, 1};  // one group of three: grpo_passk needs two per group
    const Vector<double> baselines = Vector<double>::Zero(3);
    const ppo::OptionalMatrixView<double> values(z);
    const ppo::OptionalVectorView<double> reward_baselines(baselines);
    const Matrix log_probs = Matrix::Constant(3, 4, -1.0), sum_pi_squared = Matrix::Constant(3, 4, 0.5);
    for (const auto name : ppo::kAdvantageEstimatorNames) {
      CAPTURE(name);
      const std::string msg = error_of([&] {
        ppo::compute_advantage<double>(name, {ones, mask, values, &index, reward_baselines, log_probs, sum_pi_squared});
      });
      CHECK(contains(msg, at));
      CHECK(contains(msg, " at [1, 2]; a mask holds 0 or 1"));
    }
    names_index(error_of([&] { ppo::compute_value_loss<double>(z, z, z, mask, 0.5); }), "ppo::compute_value_loss");
    names_index(error_of([&] { ppo::compute_entropy_loss<double>(Matrix::Zero(12, 5), mask); }),
                "ppo::compute_entropy_loss");
    names_index(error_of([&] { ppo::compute_rollout_correction_weights<double>(z, mask); }),
                "ppo::compute_rollout_correction_weights");
    const RowMatrix<std::int64_t> ids = RowMatrix<std::int64_t>::Zero(3, 4);
    names_index(error_of([&] { ppo::compute_state_loss_mask<double>(ids, mask, ppo::StateSpanMarkers{{7}, {8}}); }),
                "ppo::compute_state_loss_mask");
    const auto loss_mask = [&](const std::string& msg, const std::string& function) {
      CHECK(contains(msg, "mrr::" + function));
      CHECK(contains(msg, "'loss_mask' has "));
      CHECK(contains(msg, " at [1, 2]"));
    };
    loss_mask(error_of([&] { ppo::agg_loss<double>(z, mask, ppo::LossAggMode::token_mean); }), "ppo::agg_loss");
    loss_mask(error_of([&] { ppo::agg_loss_grad<double>(mask, ppo::LossAggMode::seq_mean_token_mean); }),
              "ppo::agg_loss_grad");
    CHECK(contains(error_of([&] { ppo::masked_mean<double>(z, mask); }), "'mask' has "));
    CHECK(contains(error_of([&] { ppo::masked_sum<double>(z, mask); }), "at [1, 2]"));
    CHECK(contains(error_of([&] { ppo::masked_row_mean<double>(z, mask); }), "mrr::ppo::masked_row_mean"));
    CHECK(contains(error_of([&] { ppo::masked_var<double>(z, mask); }), "mrr::ppo::masked_var"));
    CHECK(contains(error_of([&] { ppo::masked_whiten<double>(z, mask); }), "mrr::ppo::masked_whiten"));
  }
  // GAE checks the mask block by block; the index is the row of the batch, not of the block.
  Matrix tall = Matrix::Ones(20, 3);
  tall(17, 1) = 0.25;
  CHECK(contains(error_of([&] { ppo::compute_gae_advantage_return<double>(tall, tall, tall, 1.0, 1.0); }),
                 "'response_mask' has 0.25 at [17, 1]"));
}

TEST_CASE("rollout rejection sampling and bypass_mode refuse bad settings with verl's reasons") {
  using ppo::RolloutRsOptions;
  CHECK(contains(error_of([] { RolloutRsOptions::parse("token_k4", "2.0"); }), "invalid rollout_rs option 'token_k4'"));
  CHECK(contains(error_of([] { RolloutRsOptions::parse("seq_max_k1", "2.0"); }), "'seq_max_k1'"));
  CHECK(contains(error_of([] { RolloutRsOptions::parse(" , ", "2.0"); }), "names no option"));
  CHECK(contains(error_of([] { RolloutRsOptions::parse("token_k1,token_k2", "2.0,0.1,0.2"); }),
                 "has 3 thresholds for 2 rollout_rs options"));
  CHECK(contains(error_of([] { RolloutRsOptions::parse("token_k1", ""); }), "at least one threshold"));
  CHECK(contains(error_of([] { RolloutRsOptions::parse("token_k2", "0.1_0.2"); }),
                 "'token_k2' must be a single upper bound without '_'"));
  CHECK(contains(error_of([] { RolloutRsOptions::parse("token_k1", "2_1"); }), "must be lower <= upper"));
  CHECK(contains(error_of([] { RolloutRsOptions::parse("seq_sum_k3", "-1"); }), "must be positive"));
  CHECK(contains(error_of([] { RolloutRsOptions::parse("token_k1", "0"); }), "must be positive"));
  CHECK(contains(error_of([] { RolloutRsOptions::parse("token_k3", "nan"); }), "invalid numeric threshold 'nan'"));
  CHECK(contains(error_of([] { RolloutRsOptions::parse("token_k3", "0.1x"); }), "invalid numeric threshold '0.1x'"));
  CHECK(contains(error_of([] { RolloutRsOptions::parse("token_k1", 0.0); }), "must be positive"));
  CHECK(contains(error_of([] { ppo::parse_bypass_loss_type("ppo"); }), "invalid loss_type 'ppo'"));

  const Matrix lp = Matrix::Constant(2, 3, -1.0), mask = Matrix::Ones(2, 3), zero = Matrix::Zero(2, 3);
  const auto rs = RolloutRsOptions::parse("token_k3", "0.1");
  CHECK(contains(error_of([&] { ppo::compute_rollout_rejection_mask<double>(lp, zero, rs); }),
                 "'response_mask' must select at least one valid token"));
  Matrix bad = lp;
  bad(1, 2) = std::numeric_limits<double>::quiet_NaN();
  CHECK(contains(error_of([&] { ppo::compute_rollout_rejection_mask<double>(bad, mask, rs); }), "log_ratio"));
  Matrix half = mask;
  half(0, 0) = 0.5;
  CHECK(contains(error_of([&] { ppo::compute_rollout_rejection_mask<double>(lp, half, rs); }), "a mask holds 0 or 1"));

  ppo::PolicyLossConfig config;
  CHECK(contains(error_of([&] {
                   ppo::compute_policy_loss<double>(ppo::PolicyLossKind::bypass_mode, lp, lp, lp, mask,
                                                    ppo::LossAggMode::token_mean, config);
                 }),
                 "bypass_mode needs PolicyLossConfig::rollout_correction"));
  config.rollout_correction = ppo::RolloutCorrectionConfig{};
  CHECK(contains(error_of([&] {
                   ppo::compute_policy_loss<double>(ppo::PolicyLossKind::bypass_mode, lp, lp, lp, mask,
                                                    ppo::LossAggMode::token_mean, config, mask);
                 }),
                 "'rollout_is_weights' must not be given"));
}
