// The analytic gradients (policy losses, value loss, entropy loss, KL penalties, aggregation)
// against central finite differences of the forward values, on random inputs.
#include <mrr/ppo/aggregate.hpp>
#include <mrr/ppo/kl.hpp>
#include <mrr/ppo/policy_loss.hpp>
#include <mrr/ppo/value_loss.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <vector>

namespace {

using namespace mrr;
using Matrix = RowMatrix<double>;

constexpr double kStep = 1e-6;

// d f / d x by central differences, one element at a time. `shadow`, when given, moves by the
// same step as x: this differentiates through log_prob while keeping log_prob - old_log_prob
// (and so every stop-gradient ratio) fixed.
Matrix numeric_gradient(const std::function<double(const Matrix&, const Matrix*)>& f, const Matrix& x,
                        const Matrix* shadow = nullptr) {
  Matrix grad(x.rows(), x.cols());
  for (Eigen::Index k = 0; k < x.size(); ++k) {
    Matrix plus = x, minus = x;
    plus.data()[k] += kStep;
    minus.data()[k] -= kStep;
    std::optional<Matrix> shadow_plus, shadow_minus;
    if (shadow) {
      shadow_plus = *shadow;
      shadow_minus = *shadow;
      shadow_plus->data()[k] += kStep;
      shadow_minus->data()[k] -= kStep;
    }
    grad.data()[k] =
        (f(plus, shadow ? &*shadow_plus : nullptr) - f(minus, shadow ? &*shadow_minus : nullptr)) / (2 * kStep);
  }
  return grad;
}

void check_gradient(const Matrix& analytic, const Matrix& numeric, const std::string& what) {
  INFO(what);
  REQUIRE(analytic.rows() == numeric.rows());
  REQUIRE(analytic.cols() == numeric.cols());
  for (Eigen::Index k = 0; k < analytic.size(); ++k) {
    const double a = analytic.data()[k], n = numeric.data()[k];
    INFO("element " << k << ": analytic " << a << ", numeric " << n);
    CHECK(std::abs(a - n) <= 1e-6 + 1e-5 * std::abs(n));
  }
}

struct Batch {
  Matrix log_prob, old_log_prob, advantages, mask, weights;
};

// Rows of different lengths (one fully masked), a hole in one row (multi-turn), log-ratios wide
// enough that the clips, the dual clip and the divergence masks all trigger.
Batch random_batch(unsigned seed, Eigen::Index rows = 5, Eigen::Index cols = 9) {
  std::mt19937 gen(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_real_distribution<double> uniform(0.05, 2.5);
  Batch b{Matrix(rows, cols), Matrix(rows, cols), Matrix(rows, cols), Matrix::Zero(rows, cols), Matrix(rows, cols)};
  for (Eigen::Index i = 0; i < rows; ++i) {
    const Eigen::Index length =
        (i == rows - 1) ? 0 : 1 + static_cast<Eigen::Index>(gen() % static_cast<unsigned>(cols));
    for (Eigen::Index j = 0; j < length; ++j)
      b.mask(i, j) = 1;
    if (i == 1 && length > 3) b.mask(i, 1) = 0;
    for (Eigen::Index j = 0; j < cols; ++j) {
      b.log_prob(i, j) = -uniform(gen);
      b.old_log_prob(i, j) = std::min(-1e-3, b.log_prob(i, j) + 0.7 * normal(gen));
      b.advantages(i, j) = normal(gen);
      b.weights(i, j) = 0.5 + uniform(gen) / 2;
    }
  }
  return b;
}

struct AggCase {
  ppo::LossAggMode mode;
  ppo::GlobalBatchInfo info;
};

std::vector<AggCase> agg_cases() {
  std::vector<AggCase> cases;
  for (const auto mode :
       {ppo::LossAggMode::token_mean, ppo::LossAggMode::token_sum, ppo::LossAggMode::seq_mean_token_sum,
        ppo::LossAggMode::seq_mean_token_mean, ppo::LossAggMode::seq_mean_token_sum_norm})
    cases.push_back({mode, {}});
  ppo::GlobalBatchInfo global;
  global.dp_size = 4;
  global.batch_num_tokens = 97;
  global.global_batch_size = 13;
  global.loss_scale_factor = 50;
  for (const auto mode :
       {ppo::LossAggMode::token_mean, ppo::LossAggMode::seq_mean_token_mean, ppo::LossAggMode::seq_mean_token_sum_norm})
    cases.push_back({mode, global});
  return cases;
}

// Policy losses whose stop-gradient factors (cispo's clipped ratio, dppo's truncated ratio and
// trust-region mask) are functions of log_prob - old_log_prob: differentiate with old_log_prob
// moving along, which is exactly the gradient autograd gives through the non-detached path.
bool has_detached_ratio(ppo::PolicyLossKind kind) {
  return kind == ppo::PolicyLossKind::cispo || kind == ppo::PolicyLossKind::dppo_tv ||
         kind == ppo::PolicyLossKind::dppo_kl;
}

}  // namespace

TEST_CASE("policy loss gradients match finite differences") {
  using ppo::PolicyLossKind;
  for (const auto kind : {PolicyLossKind::vanilla, PolicyLossKind::sapo, PolicyLossKind::gpg, PolicyLossKind::geo_mean,
                          PolicyLossKind::cispo, PolicyLossKind::dppo_tv, PolicyLossKind::dppo_kl, PolicyLossKind::dro,
                          PolicyLossKind::kl_cov, PolicyLossKind::clip_cov}) {
    for (const auto& agg : agg_cases()) {
      for (const bool with_weights : {false, true}) {
        for (const unsigned seed : {1u, 2u}) {
          const Batch b = random_batch(seed + 10 * static_cast<unsigned>(kind));
          ppo::PolicyLossConfig config;
          config.clip_ratio_high = 0.28;
          config.dro_beta = 0.1;
          config.kl_cov_ratio = 0.3;  // a third of the tokens carry the |log-ratio| term
          config.clip_cov_ratio = 0.3;  // clip_cov drops up to a third, covariances in (0.1, 5)
          config.clip_cov_lb = 0.1;
          config.global_batch_info = agg.info;
          ppo::OptionalMatrixView<double> weights;
          if (with_weights) weights = b.weights;
          CAPTURE(ppo::to_string(kind));
          CAPTURE(ppo::to_string(agg.mode));
          CAPTURE(agg.info.dp_size);
          CAPTURE(with_weights);
          CAPTURE(seed);
          const auto result = ppo::compute_policy_loss<double>(kind, b.old_log_prob, b.log_prob, b.advantages, b.mask,
                                                               agg.mode, config, weights);
          const auto loss = [&](const Matrix& lp, const Matrix* old) {
            return ppo::compute_policy_loss<double>(kind, old ? *old : b.old_log_prob, lp, b.advantages, b.mask,
                                                    agg.mode, config, weights)
                .loss;
          };
          const Matrix numeric =
              numeric_gradient(loss, b.log_prob, has_detached_ratio(kind) ? &b.old_log_prob : nullptr);
          check_gradient(result.grad_log_prob, numeric, std::string(ppo::to_string(kind)));
        }
      }
    }
  }
}

TEST_CASE("gspo gradient matches finite differences on one-token sequences") {
  // GSPO's token ratio carries the detached sequence ratio; with one valid token per sequence the
  // sequence ratio is the token's own, so the forward value's derivative is the loss gradient.
  Batch b = random_batch(7);
  b.mask.setZero();
  for (Eigen::Index i = 0; i < b.mask.rows(); ++i)
    b.mask(i, (2 * i + 1) % b.mask.cols()) = 1;
  for (const bool with_weights : {false, true}) {
    ppo::OptionalMatrixView<double> weights;
    if (with_weights) weights = b.weights;
    const ppo::PolicyLossConfig config;
    const auto result = ppo::compute_policy_loss_gspo<double>(b.old_log_prob, b.log_prob, b.advantages, b.mask,
                                                              ppo::LossAggMode::seq_mean_token_mean, config, weights);
    const auto loss = [&](const Matrix& lp, const Matrix*) {
      return ppo::compute_policy_loss_gspo<double>(b.old_log_prob, lp, b.advantages, b.mask,
                                                   ppo::LossAggMode::seq_mean_token_mean, config, weights)
          .loss;
    };
    check_gradient(result.grad_log_prob, numeric_gradient(loss, b.log_prob), "gspo");
  }
}

TEST_CASE("value loss gradient w.r.t. vpreds matches finite differences") {
  std::mt19937 gen(3);
  std::normal_distribution<double> normal(0.0, 1.0);
  const Batch b = random_batch(3, 6, 11);
  Matrix values(6, 11), vpreds(6, 11), returns(6, 11);
  for (Eigen::Index k = 0; k < values.size(); ++k) {
    values.data()[k] = normal(gen);
    vpreds.data()[k] = values.data()[k] + 0.4 * normal(gen);
    returns.data()[k] = normal(gen);
  }
  for (const auto& agg : agg_cases()) {
    CAPTURE(ppo::to_string(agg.mode));
    const auto result = ppo::compute_value_loss<double>(vpreds, returns, values, b.mask, 0.2, agg.mode, agg.info);
    const auto loss = [&](const Matrix& v, const Matrix*) {
      return ppo::compute_value_loss<double>(v, returns, values, b.mask, 0.2, agg.mode, agg.info).loss;
    };
    check_gradient(result.grad_vpreds, numeric_gradient(loss, vpreds), "value loss");
  }
}

TEST_CASE("entropy loss gradient w.r.t. logits matches finite differences") {
  std::mt19937 gen(4);
  std::normal_distribution<double> normal(0.0, 2.0);
  const Batch b = random_batch(4, 4, 6);
  Matrix logits(24, 9);
  for (Eigen::Index k = 0; k < logits.size(); ++k)
    logits.data()[k] = normal(gen);
  for (const auto& agg : agg_cases()) {
    CAPTURE(ppo::to_string(agg.mode));
    const auto result = ppo::compute_entropy_loss<double>(logits, b.mask, agg.mode, agg.info);
    const auto loss = [&](const Matrix& z, const Matrix*) {
      return ppo::compute_entropy_loss<double>(z, b.mask, agg.mode, agg.info).loss;
    };
    check_gradient(result.grad_logits, numeric_gradient(loss, logits), "entropy loss");
  }
}

TEST_CASE("KL penalty gradients: estimators by finite differences, '+' variants take k2's gradient") {
  std::mt19937 gen(5);
  std::normal_distribution<double> normal(0.0, 1.5);
  Matrix logprob(4, 8), ref(4, 8);
  for (Eigen::Index k = 0; k < logprob.size(); ++k) {
    logprob.data()[k] = -std::abs(normal(gen));
    ref.data()[k] = logprob.data()[k] + normal(gen);
  }
  ref(0, 0) = logprob(0, 0) + 3.5;   // k3 above its clamp at 10: no gradient
  ref(0, 1) = logprob(0, 1) - 21.0;  // log-ratio beyond the +-20 clamp
  for (const std::string name : {"kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"}) {
    CAPTURE(name);
    const auto result = ppo::kl_penalty<double>(logprob, ref, name);
    const auto total = [&](const Matrix& lp, const Matrix*) {
      return ppo::kl_penalty<double>(lp, ref, name).values.sum();
    };
    check_gradient(result.grad_logprob, numeric_gradient(total, logprob), name);

    const auto straight = ppo::kl_penalty<double>(logprob, ref, name + "+");
    CHECK(straight.values == result.values);
    const auto k2_total = [&](const Matrix& lp, const Matrix*) {
      return ppo::kl_penalty<double>(lp, ref, "k2").values.sum();
    };
    check_gradient(straight.grad_logprob, numeric_gradient(k2_total, logprob), name + "+");
  }
}

TEST_CASE("agg_loss_grad matches finite differences of agg_loss") {
  std::mt19937 gen(6);
  std::normal_distribution<double> normal(0.0, 1.0);
  const Batch b = random_batch(6, 5, 7);
  Matrix loss_mat(5, 7);
  for (Eigen::Index k = 0; k < loss_mat.size(); ++k)
    loss_mat.data()[k] = normal(gen);
  for (const auto& agg : agg_cases()) {
    CAPTURE(ppo::to_string(agg.mode));
    const auto total = [&](const Matrix& x, const Matrix*) {
      return ppo::agg_loss<double>(x, b.mask, agg.mode, agg.info);
    };
    check_gradient(ppo::agg_loss_grad<double>(b.mask, agg.mode, agg.info), numeric_gradient(total, loss_mat),
                   std::string(ppo::to_string(agg.mode)));
  }
}
