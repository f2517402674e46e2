#include <mrr/ppo/grpo_step.hpp>

#include "support/random.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

using mrr::RowMatrix;
using mrr::Vector;
namespace ppo = mrr::ppo;

namespace {

struct Batch {
  RowMatrix<double> old_log_prob, log_prob, ref_log_prob, mask;
  Vector<double> scores;
  ppo::GroupIndex index;
};

// 3 prompts x 4 responses, responses of different lengths.
Batch make_batch() {
  Batch b;
  const Eigen::Index n = 12, len = 6;
  b.old_log_prob = -mrr::test::random_normal<double>(n, len, 1).cwiseAbs();
  b.log_prob = b.old_log_prob + 0.15 * mrr::test::random_normal<double>(n, len, 2);
  b.ref_log_prob = b.old_log_prob + 0.3 * mrr::test::random_normal<double>(n, len, 3);
  b.mask = RowMatrix<double>::Zero(n, len);
  for (Eigen::Index i = 0; i < n; ++i) b.mask.row(i).head(1 + (i * 5) % len).setOnes();
  b.scores = Vector<double>(n);
  for (Eigen::Index i = 0; i < n; ++i) b.scores[i] = static_cast<double>((i * 7) % 3) * 0.5;
  std::vector<int> groups;
  for (int i = 0; i < n; ++i) groups.push_back(i / 4);
  b.index = ppo::GroupIndex(groups);
  return b;
}

}  // namespace

TEST_CASE("token_level_rewards: the score sits on the last valid token") {
  const RowMatrix<double> mask = (RowMatrix<double>(3, 4) << 1, 1, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0).finished();
  const Vector<double> scores = (Vector<double>(3) << 2.0, -1.0, 5.0).finished();
  const RowMatrix<double> r = ppo::token_level_rewards<double>(scores, mask);
  const RowMatrix<double> expected = (RowMatrix<double>(3, 4) << 0, 2, 0, 0, 0, 0, 0, -1, 0, 0, 0, 0).finished();
  CHECK(r == expected);
}

TEST_CASE("grpo_loss agrees with composing mrr::ppo by hand") {
  const Batch b = make_batch();
  for (const std::string estimator : {"grpo", "rloo", "grpo_vectorized", "reinforce_plus_plus_baseline"})
    for (const std::string agg : {"token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"})
      for (const std::string kl : {"low_var_kl", "kl", "mse", "k3+"})
        for (const bool use_kl : {false, true}) {
          CAPTURE(estimator);
          CAPTURE(agg);
          CAPTURE(kl);
          CAPTURE(use_kl);
          ppo::GrpoStepConfig config;
          config.adv_estimator = estimator;
          config.loss_agg_mode = agg;
          config.kl_loss_type = kl;
          config.use_kl_loss = use_kl;
          config.kl_loss_coef = 0.05;
          config.policy.clip_ratio_high = 0.28;
          config.validate();
          const auto adv = ppo::compute_outcome_advantages<double>(b.scores, b.mask, b.index, config);
          const auto got = ppo::grpo_loss<double>(b.old_log_prob, b.log_prob, adv.advantages, b.mask, b.ref_log_prob,
                                                  config);

          // By hand.
          const RowMatrix<double> rewards = ppo::token_level_rewards<double>(b.scores, b.mask);
          const auto adv2 = ppo::compute_advantage<double>(estimator, {rewards, b.mask, {}, &b.index, {}});
          CHECK(adv2.advantages == adv.advantages);
          const auto pg = ppo::compute_policy_loss<double>("vanilla", b.old_log_prob, b.log_prob, adv2.advantages,
                                                           b.mask, agg, config.policy);
          double loss = pg.loss;
          RowMatrix<double> grad = pg.grad_log_prob;
          if (use_kl) {
            const auto k = ppo::kl_penalty<double>(b.log_prob, b.ref_log_prob, kl);
            const double kl_loss = ppo::agg_loss<double>(k.values, b.mask, agg);
            loss += 0.05 * kl_loss;
            grad += 0.05 * ppo::agg_loss_grad<double>(b.mask, ppo::parse_loss_agg_mode(agg))
                               .cwiseProduct(k.grad_logprob);
            CHECK(*got.metric("actor/kl_loss") == doctest::Approx(kl_loss).epsilon(1e-14));
          } else {
            CHECK_FALSE(got.metric("actor/kl_loss").has_value());
          }
          CHECK(got.loss == doctest::Approx(loss).epsilon(1e-14));
          CHECK(got.pg_loss == pg.loss);
          CHECK((got.grad_log_prob - grad).cwiseAbs().maxCoeff() < 1e-15);
          CHECK(*got.metric("actor/pg_clipfrac") == *pg.metric("actor/pg_clipfrac"));
          CHECK(*got.metric("actor/ppo_kl") == *pg.metric("actor/ppo_kl"));
        }
}

TEST_CASE("grpo_loss: gradient w.r.t. log_prob by finite differences") {
  const Batch b = make_batch();
  for (const std::string agg : {"token-mean", "seq-mean-token-mean"})
    for (const std::string kl : {"low_var_kl", "k2"}) {
      CAPTURE(agg);
      CAPTURE(kl);
      ppo::GrpoStepConfig config;
      config.loss_agg_mode = agg;
      config.kl_loss_type = kl;
      config.use_kl_loss = true;
      config.kl_loss_coef = 0.1;
      const auto adv = ppo::compute_outcome_advantages<double>(b.scores, b.mask, b.index, config);
      const auto got = ppo::grpo_loss<double>(b.old_log_prob, b.log_prob, adv.advantages, b.mask, b.ref_log_prob, config);
      const double h = 1e-7;
      int checked = 0;
      for (Eigen::Index i = 0; i < b.log_prob.rows(); ++i)
        for (Eigen::Index j = 0; j < b.log_prob.cols(); ++j) {
          RowMatrix<double> plus = b.log_prob, minus = b.log_prob;
          plus(i, j) += h;
          minus(i, j) -= h;
          const double numeric =
              (ppo::grpo_loss<double>(b.old_log_prob, plus, adv.advantages, b.mask, b.ref_log_prob, config).loss -
               ppo::grpo_loss<double>(b.old_log_prob, minus, adv.advantages, b.mask, b.ref_log_prob, config).loss) /
              (2 * h);
          CHECK(got.grad_log_prob(i, j) == doctest::Approx(numeric).epsilon(1e-6).scale(1e-3));
          checked += b.mask(i, j) != 0;
        }
      CHECK(checked > 20);
      CHECK(got.grad_log_prob.cwiseAbs().sum() > 0);
    }
}

TEST_CASE("grpo_loss and config: errors name the problem") {
  const Batch b = make_batch();
  ppo::GrpoStepConfig config;
  config.use_kl_loss = true;
  const RowMatrix<double> adv = RowMatrix<double>::Zero(b.mask.rows(), b.mask.cols());
  CHECK_THROWS_WITH_AS(ppo::grpo_loss<double>(b.old_log_prob, b.log_prob, adv, b.mask, std::nullopt, config),
                       doctest::Contains("ref_log_prob"), mrr::InvalidArgument);
  config.adv_estimator = "grpoo";
  CHECK_THROWS_AS(config.validate(), mrr::InvalidArgument);
  ppo::GrpoStepConfig kl_cov;
  kl_cov.policy_loss = "kl_cov";
  kl_cov.policy.kl_cov_ratio = 0;  // caught before the first rollout, not at the first update
  CHECK_THROWS_WITH_AS(kl_cov.validate(),
                       doctest::Contains("ppo::GrpoStepConfig: 'kl_cov_ratio' (the share of valid tokens to penalise) "
                                         "must be in (0, 1], got 0"),
                       mrr::InvalidArgument);
  kl_cov.policy.kl_cov_ratio = 0.5;
  kl_cov.validate();
  ppo::GrpoStepConfig bypass;
  bypass.policy_loss = "bypass_mode";
  CHECK_THROWS_WITH_AS(bypass.validate(), doctest::Contains("'bypass_mode' needs policy.rollout_correction"),
                       mrr::InvalidArgument);
  bypass.policy.rollout_correction = ppo::RolloutCorrectionConfig{};
  CHECK_NOTHROW(bypass.validate());
  ppo::GrpoStepConfig clip_cov;
  clip_cov.policy_loss = "clip_cov";
  clip_cov.policy.clip_cov_ub = 0.5;  // below the default lower bound 1
  CHECK_THROWS_WITH_AS(clip_cov.validate(),
                       doctest::Contains("ppo::GrpoStepConfig: 'clip_cov_lb' (1) must be below 'clip_cov_ub' (0.5)"),
                       mrr::InvalidArgument);
  const RowMatrix<double> signed_adv = RowMatrix<double>::Constant(b.mask.rows(), b.mask.cols(), 0.25);
  const auto got = ppo::grpo_loss<double>(b.old_log_prob, b.log_prob, signed_adv, b.mask, std::nullopt, kl_cov);
  const auto pg = ppo::compute_policy_loss_kl_cov<double>(b.old_log_prob, b.log_prob, signed_adv, b.mask,
                                                          ppo::LossAggMode::token_mean, kl_cov.policy);
  CHECK(got.loss == pg.loss);
  CHECK(got.grad_log_prob == pg.grad_log_prob);
  CHECK_FALSE(got.metric("actor/pg_clipfrac").has_value());  // verl's kl_cov reports actor/ppo_kl only
}

TEST_CASE("logprob_mismatch: k1, k3, max and mean |diff| over valid tokens") {
  const RowMatrix<double> lp = (RowMatrix<double>(2, 3) << -1.0, -2.0, -0.5, -0.1, -3.0, 99.0).finished();
  const RowMatrix<double> ro = (RowMatrix<double>(2, 3) << -1.2, -2.0, -0.4, -0.1, -2.5, 0.0).finished();
  const RowMatrix<double> mask = (RowMatrix<double>(2, 3) << 1, 1, 1, 1, 1, 0).finished();
  const auto m = ppo::logprob_mismatch<double>(lp, ro, mask);
  const double d[5] = {0.2, 0.0, -0.1, 0.0, -0.5};
  double k3 = 0, k1 = 0, abs_sum = 0;
  for (double x : d) {
    k1 += x;
    k3 += std::exp(-x) + x - 1;
    abs_sum += std::abs(x);
  }
  CHECK(m.k1 == doctest::Approx(k1 / 5));
  CHECK(m.k3 == doctest::Approx(k3 / 5));
  CHECK(m.mean_abs_diff == doctest::Approx(abs_sum / 5));
  CHECK(m.max_abs_diff == doctest::Approx(0.5));  // the masked 99 does not count
  CHECK(m.tokens == 5);
  // verl's rollout-correction pair estimates KL(rollout || train): the other sign, the other ratio.
  double verl_k3 = 0;
  for (double x : d)
    verl_k3 += std::exp(x) - x - 1;
  CHECK(m.rollout_kl == doctest::Approx(-k1 / 5));
  CHECK(m.rollout_k3_kl == doctest::Approx(verl_k3 / 5));
}

TEST_CASE("logprob_mismatch: rollout_kl and rollout_k3_kl are verl's rollout_corr \"kl\" and \"k3_kl\"") {
  // Values printed by verl's own compute_offpolicy_metrics (verl-project/verl 1dda039b,
  // verl/trainer/ppo/rollout_corr_helper.py) on these float64 inputs, with torch 1.13.
  const RowMatrix<double> train = (RowMatrix<double>(2, 3) << -0.5, -1.0, -2.0, -0.1, -3.0, -0.7).finished();
  const RowMatrix<double> rollout = (RowMatrix<double>(2, 3) << -0.9, -0.8, -2.5, -0.1, -1.0, -0.2).finished();
  const RowMatrix<double> mask = (RowMatrix<double>(2, 3) << 1, 1, 1, 1, 1, 0).finished();
  const auto m = ppo::logprob_mismatch<double>(train, rollout, mask);
  CHECK(m.rollout_kl == doctest::Approx(0.25999999948).epsilon(1e-12));
  CHECK(m.rollout_k3_kl == doctest::Approx(0.278922400373354).epsilon(1e-12));
  // mrr's own pair keeps its definitions: k1 = mean(train - rollout), k3 = low_var_kl(train || rollout).
  CHECK(m.k1 == doctest::Approx(-0.26).epsilon(1e-12));
  double k3 = 0;
  for (double x : {0.4, -0.2, 0.5, 0.0, -2.0})  // train - rollout on the counted tokens
    k3 += std::exp(-x) + x - 1;
  CHECK(m.k3 == doctest::Approx(k3 / 5).epsilon(1e-12));  // 0.917..., where verl's k3_kl is 0.279
}
