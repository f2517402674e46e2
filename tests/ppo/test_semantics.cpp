// Semantics the golden files do not pin down: the fast GAE against a literal transcription of
// verl's loop on other shapes, group labels of any type, the registry, IS-weight diagnostics and
// IcePop, the KL controllers, and masked statistics ignoring padding.
#include <mrr/ppo.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace {

using namespace mrr;

template <class T>
RowMatrix<T> random_matrix(Eigen::Index rows, Eigen::Index cols, unsigned seed, double scale = 1.0) {
  std::mt19937 gen(seed);
  std::normal_distribution<double> normal(0.0, scale);
  RowMatrix<T> m(rows, cols);
  for (Eigen::Index k = 0; k < m.size(); ++k)
    m.data()[k] = static_cast<T>(normal(gen));
  return m;
}

// Responses of different lengths with observation holes, as in multi-turn rollouts.
template <class T>
RowMatrix<T> multi_turn_mask(Eigen::Index rows, Eigen::Index cols, unsigned seed) {
  std::mt19937 gen(seed);
  RowMatrix<T> mask = RowMatrix<T>::Zero(rows, cols);
  for (Eigen::Index i = 0; i < rows; ++i) {
    const Eigen::Index length = 2 + static_cast<Eigen::Index>(gen() % static_cast<unsigned>(cols - 1));
    for (Eigen::Index j = 0; j < length; ++j)
      mask(i, j) = 1;
    const Eigen::Index hole = static_cast<Eigen::Index>(gen() % static_cast<unsigned>(length));
    for (Eigen::Index j = hole; j < std::min(length - 1, hole + 3); ++j)
      mask(i, j) = 0;
  }
  return mask;
}

// verl's GAE loop transcribed literally: column by column over the whole batch, then whitening.
template <class T>
ppo::AdvantageResult<T> reference_gae(const RowMatrix<T>& rewards, const RowMatrix<T>& values, const RowMatrix<T>& mask,
                                      double gamma, double lam) {
  const Eigen::Index rows = rewards.rows(), cols = rewards.cols();
  Vector<T> next_values = Vector<T>::Zero(rows), last_gae = Vector<T>::Zero(rows);
  RowMatrix<T> advantages(rows, cols);
  for (Eigen::Index t = cols - 1; t >= 0; --t) {
    for (Eigen::Index i = 0; i < rows; ++i) {
      const T delta = rewards(i, t) + T(gamma) * next_values[i] - values(i, t);
      const T gae = delta + T(gamma * lam) * last_gae[i];
      next_values[i] = values(i, t) * mask(i, t) + (T(1) - mask(i, t)) * next_values[i];
      last_gae[i] = gae * mask(i, t) + (T(1) - mask(i, t)) * last_gae[i];
      advantages(i, t) = last_gae[i];
    }
  }
  RowMatrix<T> returns = advantages + values;
  return {ppo::masked_whiten<T>(advantages, mask), returns};
}

template <class T>
void check_near(const RowMatrix<T>& a, const RowMatrix<T>& b, double rtol, double atol) {
  REQUIRE(a.rows() == b.rows());
  REQUIRE(a.cols() == b.cols());
  for (Eigen::Index k = 0; k < a.size(); ++k) {
    INFO("flat index " << k << ": " << a.data()[k] << " vs " << b.data()[k]);
    CHECK(std::abs(static_cast<double>(a.data()[k] - b.data()[k])) <=
          atol + rtol * std::abs(static_cast<double>(b.data()[k])));
  }
}

}  // namespace

TEST_CASE_TEMPLATE("GAE equals verl's column loop on shapes the golden files lack", T, double, float) {
  const double rtol = sizeof(T) == 8 ? 1e-12 : 1e-4, atol = sizeof(T) == 8 ? 1e-12 : 1e-4;
  for (const auto& [rows, cols] :
       std::vector<std::pair<Eigen::Index, Eigen::Index>>{{1, 7}, {3, 1}, {13, 50}, {64, 33}}) {
    CAPTURE(rows);
    CAPTURE(cols);
    const auto rewards = random_matrix<T>(rows, cols, 11);
    const auto values = random_matrix<T>(rows, cols, 12);
    const RowMatrix<T> mask = cols > 1 ? multi_turn_mask<T>(rows, cols, 13) : RowMatrix<T>::Ones(rows, cols);
    if (mask.sum() < T(2)) continue;
    for (const auto& [gamma, lam] : std::vector<std::pair<double, double>>{{1.0, 1.0}, {0.99, 0.95}, {0.9, 0.0}}) {
      const auto ours = ppo::compute_gae_advantage_return<T>(rewards, values, mask, gamma, lam);
      const auto reference = reference_gae<T>(rewards, values, mask, gamma, lam);
      check_near<T>(ours.advantages, reference.advantages, rtol, atol);
      check_near<T>(ours.returns, reference.returns, rtol, atol);
    }
  }
}

TEST_CASE("GAE reads caller memory through strided views") {
  const auto big_rewards = random_matrix<double>(9, 20, 1), big_values = random_matrix<double>(9, 20, 2);
  const RowMatrix<double> big_mask = multi_turn_mask<double>(9, 20, 3);
  const RowMatrix<double> rewards = big_rewards.block(2, 3, 6, 12), values = big_values.block(2, 3, 6, 12);
  const RowMatrix<double> mask = big_mask.block(2, 3, 6, 12);
  const auto from_blocks = ppo::compute_gae_advantage_return<double>(
      big_rewards.block(2, 3, 6, 12), big_values.block(2, 3, 6, 12), big_mask.block(2, 3, 6, 12), 0.99, 0.95);
  const auto from_copies = ppo::compute_gae_advantage_return<double>(rewards, values, mask, 0.99, 0.95);
  CHECK(from_blocks.advantages == from_copies.advantages);
  CHECK(from_blocks.returns == from_copies.returns);
}

// verl's REINFORCE++ and ReMax loops transcribed: column by column over the whole batch, in T.
template <class T>
ppo::AdvantageResult<T> reference_reinforce_plus_plus(const RowMatrix<T>& rewards, const RowMatrix<T>& mask,
                                                      double gamma) {
  RowMatrix<T> returns = RowMatrix<T>::Zero(rewards.rows(), rewards.cols());
  Vector<T> running = Vector<T>::Zero(rewards.rows());
  for (Eigen::Index t = rewards.cols() - 1; t >= 0; --t)
    for (Eigen::Index i = 0; i < rewards.rows(); ++i) {
      const T updated = rewards(i, t) + T(gamma) * running[i];
      returns(i, t) = updated * mask(i, t);
      running[i] = updated * mask(i, t) + running[i] * (T(1) - mask(i, t));
    }
  RowMatrix<T> advantages = ppo::masked_whiten<T>(returns, mask);
  advantages.array() *= mask.array();
  return {advantages, returns};
}

template <class T>
ppo::AdvantageResult<T> reference_remax(const RowMatrix<T>& rewards, const Vector<T>& baselines,
                                        const RowMatrix<T>& mask) {
  RowMatrix<T> returns(rewards.rows(), rewards.cols()), advantages(rewards.rows(), rewards.cols());
  for (Eigen::Index i = 0; i < rewards.rows(); ++i) {
    T running = 0;
    for (Eigen::Index t = rewards.cols() - 1; t >= 0; --t) {
      running += rewards(i, t) * mask(i, t);
      returns(i, t) = running;
      advantages(i, t) = running - baselines[i] * mask(i, t);
    }
  }
  return {advantages, returns};
}

// verl's reinforce_plus_plus_baseline: score minus the group mean, broadcast, whitened, masked.
template <class T>
RowMatrix<T> reference_reinforce_plus_plus_baseline(const RowMatrix<T>& rewards, const RowMatrix<T>& mask,
                                                    const std::vector<std::int64_t>& uids) {
  Vector<T> scores = rewards.rowwise().sum();
  const Vector<T> original = scores;
  for (Eigen::Index i = 0; i < scores.size(); ++i) {
    T sum = 0;
    int count = 0;
    for (Eigen::Index j = 0; j < scores.size(); ++j)
      if (uids[static_cast<std::size_t>(j)] == uids[static_cast<std::size_t>(i)]) {
        sum += original[j];
        ++count;
      }
    if (count > 1) scores[i] = original[i] - sum / T(count);
  }
  const RowMatrix<T> broadcast = (mask.array().colwise() * scores.array()).matrix();
  RowMatrix<T> advantages = ppo::masked_whiten<T>(broadcast, mask);
  advantages.array() *= mask.array();
  return advantages;
}

TEST_CASE_TEMPLATE("reward-to-go and whitened broadcasts equal verl's loops over several time tiles", T, double,
                   float) {
  // Rows that fill no whole block of SIMD lanes, several 2 KiB time tiles, observation spans
  // (some across a tile's edge), empty and full rows.
  const double rtol = sizeof(T) == 8 ? 1e-11 : 2e-4, atol = sizeof(T) == 8 ? 1e-11 : 2e-4;
  for (const auto& [rows, cols] : std::vector<std::pair<Eigen::Index, Eigen::Index>>{{37, 1300}, {5, 2}, {17, 513}}) {
    CAPTURE(rows);
    CAPTURE(cols);
    const auto rewards = random_matrix<T>(rows, cols, 21, 0.1);
    RowMatrix<T> mask = multi_turn_mask<T>(rows, cols, 22);
    for (Eigen::Index i = 0; i < rows; i += 4)
      mask.row(i)
          .segment(std::min<Eigen::Index>(cols - 1, 250 + 3 * i), std::min<Eigen::Index>(cols / 4, 40))
          .setZero();
    mask.row(1).setZero();
    mask.row(rows - 1).setOnes();
    const Vector<T> baselines = random_matrix<T>(rows, 1, 23).col(0);
    std::vector<std::int64_t> uids;
    for (Eigen::Index i = 0; i < rows; ++i)
      uids.push_back(i % 7 == 3 ? 1000 + i : i / 4);  // groups of 4, and singletons
    for (const double gamma : {1.0, 0.97}) {
      const auto ours = ppo::compute_reinforce_plus_plus_outcome_advantage<T>(rewards, mask, gamma);
      const auto reference = reference_reinforce_plus_plus<T>(rewards, mask, gamma);
      check_near<T>(ours.returns, reference.returns, rtol, atol);
      check_near<T>(ours.advantages, reference.advantages, rtol, atol);
    }
    const auto remax = ppo::compute_remax_outcome_advantage<T>(rewards, baselines, mask);
    const auto remax_reference = reference_remax<T>(rewards, baselines, mask);
    check_near<T>(remax.returns, remax_reference.returns, rtol, atol);
    check_near<T>(remax.advantages, remax_reference.advantages, rtol, atol);
    const ppo::GroupIndex index(uids);
    const auto baseline = ppo::compute_reinforce_plus_plus_baseline_outcome_advantage<T>(rewards, mask, index);
    const auto baseline_reference = reference_reinforce_plus_plus_baseline<T>(rewards, mask, uids);
    check_near<T>(baseline.advantages, baseline_reference, rtol, atol);
    CHECK(baseline.returns == baseline.advantages);
  }
}

TEST_CASE("reward-to-go estimators read strided views and name an overflowing return") {
  const auto big_rewards = random_matrix<float>(40, 1200, 31);
  const RowMatrix<float> big_mask = multi_turn_mask<float>(40, 1200, 32);
  const auto rewards = big_rewards.block(3, 5, 33, 1100);
  const auto mask = big_mask.block(3, 5, 33, 1100);
  const RowMatrix<float> rewards_copy = rewards, mask_copy = mask;
  const auto from_blocks = ppo::compute_reinforce_plus_plus_outcome_advantage<float>(rewards, mask, 0.99);
  const auto from_copies = ppo::compute_reinforce_plus_plus_outcome_advantage<float>(rewards_copy, mask_copy, 0.99);
  CHECK(from_blocks.advantages == from_copies.advantages);
  CHECK(from_blocks.returns == from_copies.returns);
  const Vector<float> baselines = Vector<float>::LinSpaced(33, -1.f, 1.f);
  const auto remax_blocks = ppo::compute_remax_outcome_advantage<float>(rewards, baselines, mask);
  const auto remax_copies = ppo::compute_remax_outcome_advantage<float>(rewards_copy, baselines, mask_copy);
  CHECK(remax_blocks.advantages == remax_copies.advantages);
  CHECK(remax_blocks.returns == remax_copies.returns);

  // Finite rewards whose discounted sum overflows float in row 20 only: the error names it.
  RowMatrix<float> huge = rewards_copy;
  RowMatrix<float> ones = RowMatrix<float>::Ones(33, 1100);
  huge.row(20).setConstant(3e37f);
  std::string message;
  try {
    (void)ppo::compute_reinforce_plus_plus_outcome_advantage<float>(huge, ones, 1.0);
  } catch (const std::invalid_argument& e) {
    message = e.what();
  }
  INFO(message);
  CHECK(message.find("compute_reinforce_plus_plus_outcome_advantage") != std::string::npos);
  CHECK(message.find("the discounted return of row 20 overflowed (gamma 1") != std::string::npos);
  const Vector<float> zero = Vector<float>::Zero(33);
  CHECK_THROWS_WITH_AS(ppo::compute_remax_outcome_advantage<float>(huge, zero, ones),
                       doctest::Contains("the reward-to-go of row 20 overflowed; the rewards are finite"),
                       InvalidArgument);
  // A NaN under a zero mask still poisons the running sum: the reward is named, not an overflow.
  RowMatrix<float> poisoned = rewards_copy;
  poisoned(7, 900) = std::numeric_limits<float>::quiet_NaN();
  RowMatrix<float> holes = ones;
  holes(7, 900) = 0.f;
  CHECK_THROWS_WITH_AS(ppo::compute_reinforce_plus_plus_outcome_advantage<float>(poisoned, holes, 1.0),
                       doctest::Contains("'token_level_rewards' has a non-finite value nan at [7, 900]"),
                       InvalidArgument);
  CHECK_THROWS_WITH_AS(ppo::compute_remax_outcome_advantage<float>(poisoned, zero, holes),
                       doctest::Contains("'token_level_rewards' has a non-finite value nan at [7, 900]"),
                       InvalidArgument);
}

TEST_CASE("group labels: integers and strings give the same groups") {
  const auto rewards = random_matrix<double>(6, 4, 5);
  const RowMatrix<double> mask = RowMatrix<double>::Ones(6, 4);
  const ppo::GroupIndex ints(std::vector<std::int64_t>{7, 3, 7, 3, 9, 7});
  const ppo::GroupIndex strings(std::vector<std::string>{"uid-7", "uid-3", "uid-7", "uid-3", "uid-9", "uid-7"});
  CHECK(ints.num_groups() == 3);
  CHECK(ints.group_size(0) == 3);
  CHECK(ints.label(1) == "3");
  CHECK(strings.label(2) == "uid-9");
  for (const auto name :
       {"grpo", "grpo_vectorized", "rloo", "rloo_vectorized", "opo", "reinforce_plus_plus_baseline", "gpg"}) {
    CAPTURE(name);
    const auto a = ppo::compute_advantage<double>(name, {rewards, mask, std::nullopt, &ints});
    const auto b = ppo::compute_advantage<double>(name, {rewards, mask, std::nullopt, &strings});
    CHECK(a.advantages == b.advantages);
  }
  // Labels are compared as given (deliberate difference 8): "01" and "1" are two groups in every
  // estimator, grpo_vectorized included (verl's converts all-integer labels to int64 first).
  const ppo::GroupIndex numeric_strings(std::vector<std::string>{"01", "1", "1", "01", "2", "2"});
  CHECK(numeric_strings.num_groups() == 3);
  const ppo::GroupIndex same_as_ints(std::vector<std::int64_t>{0, 1, 1, 0, 2, 2});
  for (const auto name : {"grpo", "grpo_vectorized", "rloo_vectorized"}) {
    CAPTURE(name);
    const auto a = ppo::compute_advantage<double>(name, {rewards, mask, std::nullopt, &numeric_strings});
    const auto b = ppo::compute_advantage<double>(name, {rewards, mask, std::nullopt, &same_as_ints});
    CHECK(a.advantages == b.advantages);
  }
}

TEST_CASE("rloo keeps a singleton's score, rloo_vectorized zeroes it") {
  RowMatrix<double> rewards = RowMatrix<double>::Zero(3, 2);
  rewards(0, 1) = 1.0;
  rewards(1, 1) = 3.0;
  rewards(2, 0) = 5.0;
  const RowMatrix<double> mask = RowMatrix<double>::Ones(3, 2);
  const ppo::GroupIndex index{1, 1, 2};
  const auto loop = ppo::compute_rloo_outcome_advantage<double>(rewards, mask, index);
  const auto vectorized = ppo::compute_rloo_vectorized_outcome_advantage<double>(rewards, mask, index);
  // Pair: 1 - 3 = -2 and 3 - 1 = 2 in both.
  CHECK(loop.advantages(0, 0) == doctest::Approx(-2.0));
  CHECK(vectorized.advantages(1, 1) == doctest::Approx(2.0));
  CHECK(loop.advantages(2, 1) == 5.0);
  CHECK(vectorized.advantages(2, 1) == 0.0);
}

TEST_CASE("grpo_passk credits only the best response of each group") {
  RowMatrix<double> rewards = RowMatrix<double>::Zero(4, 2);
  rewards(0, 1) = 1.0;
  rewards(1, 1) = 4.0;
  rewards(2, 1) = 2.0;
  rewards(3, 1) = 2.0;  // a tie: max - second max = 0
  const RowMatrix<double> mask = RowMatrix<double>::Ones(4, 2);
  const ppo::GroupIndex index{0, 0, 1, 1};
  const auto plain = ppo::compute_grpo_passk_outcome_advantage<double>(rewards, mask, index, 1e-6, false);
  CHECK(plain.advantages(0, 0) == 0.0);
  CHECK(plain.advantages(1, 0) == 3.0);
  CHECK(plain.advantages.bottomRows(2).isZero());
  const auto normalised = ppo::compute_grpo_passk_outcome_advantage<double>(rewards, mask, index, 1e-6, true);
  CHECK(normalised.advantages(1, 1) == doctest::Approx(3.0 / (std::sqrt(4.5) + 1e-6)));
}

TEST_CASE("masked statistics ignore NaN in masked-out padding") {
  RowMatrix<double> values(2, 3), mask(2, 3);
  values << 1, 2, std::numeric_limits<double>::quiet_NaN(), 4, 5, 6;
  mask << 1, 1, 0, 1, 1, 1;
  CHECK(ppo::masked_mean<double>(values, mask) == doctest::Approx(18.0 / 5.0));
  CHECK(std::isfinite(ppo::masked_var<double>(values, mask)));
  const auto rows = ppo::masked_row_mean<double>(values, mask);
  CHECK(rows[0] == doctest::Approx(1.5));
  CHECK(ppo::agg_loss<double>(values, mask, ppo::LossAggMode::seq_mean_token_mean) == doctest::Approx((1.5 + 5.0) / 2));
}

TEST_CASE("entropy_from_logits: uniform, one-hot and -inf logits") {
  RowMatrix<double> logits(3, 4);
  const double inf = std::numeric_limits<double>::infinity();
  logits << 0, 0, 0, 0, 50, 0, 0, 0, 1, -inf, 1, -inf;
  const auto h = ppo::entropy_from_logits<double>(logits);
  CHECK(h[0] == doctest::Approx(std::log(4.0)));
  CHECK(h[1] == doctest::Approx(0.0).epsilon(1e-12));
  CHECK(h[2] == doctest::Approx(std::log(2.0)));
  // The loss and its gradient too (deliberate difference 7: verl's are NaN): a -inf column is
  // the row without that column, and gets no gradient.
  RowMatrix<double> z(2, 3), without(2, 2);
  z << 0.0, -inf, 1.0, 2.0, -inf, 0.5;
  without << 0.0, 1.0, 2.0, 0.5;
  const RowMatrix<double> mask = RowMatrix<double>::Ones(1, 2);
  RowMatrix<double> z_finite = z;
  z_finite(0, 1) = 0.0;
  const auto masked = ppo::compute_entropy_loss<double>(z, mask);
  const auto reference = ppo::compute_entropy_loss<double>(without, mask);
  CHECK(std::isfinite(masked.loss));
  CHECK(masked.loss == doctest::Approx(reference.loss).epsilon(1e-15));
  for (int t = 0; t < 2; ++t) {
    CHECK(masked.grad_logits(t, 1) == 0.0);
    CHECK(masked.grad_logits(t, 0) == doctest::Approx(reference.grad_logits(t, 0)).epsilon(1e-15));
    CHECK(masked.grad_logits(t, 2) == doctest::Approx(reference.grad_logits(t, 1)).epsilon(1e-15));
  }
  CHECK(masked.loss != doctest::Approx(ppo::compute_entropy_loss<double>(z_finite, mask).loss));
}

TEST_CASE("agg_loss: dp_size and global counts scale as in verl") {
  RowMatrix<double> loss(2, 3), mask(2, 3);
  loss << 1, 2, 3, 4, 5, 6;
  mask << 1, 1, 0, 1, 0, 0;
  ppo::GlobalBatchInfo info;
  CHECK(ppo::agg_loss<double>(loss, mask, ppo::LossAggMode::token_mean, info) == doctest::Approx(7.0 / 3.0));
  CHECK(ppo::agg_loss<double>(loss, mask, ppo::LossAggMode::token_sum, info) == doctest::Approx(7.0));
  CHECK(ppo::agg_loss<double>(loss, mask, ppo::LossAggMode::seq_mean_token_sum, info) == doctest::Approx(3.5));
  CHECK(ppo::agg_loss<double>(loss, mask, ppo::LossAggMode::seq_mean_token_sum_norm, info) == doctest::Approx(3.5 / 3));
  info.dp_size = 4;
  info.batch_num_tokens = 12;
  info.global_batch_size = 8;
  info.loss_scale_factor = 7;
  CHECK(ppo::agg_loss<double>(loss, mask, ppo::LossAggMode::token_mean, info) == doctest::Approx(7.0 / 12 * 4));
  CHECK(ppo::agg_loss<double>(loss, mask, ppo::LossAggMode::token_sum, info) == doctest::Approx(28.0));
  CHECK(ppo::agg_loss<double>(loss, mask, ppo::LossAggMode::seq_mean_token_mean, info) ==
        doctest::Approx((1.5 + 4.0) / 8 * 4));
  CHECK(ppo::agg_loss<double>(loss, mask, ppo::LossAggMode::seq_mean_token_sum_norm, info) ==
        doctest::Approx(7.0 / 8 * 4 / 7));
}

TEST_CASE("policy loss metrics follow verl's key sets") {
  const auto lp = random_matrix<double>(3, 5, 21, 0.3), old = random_matrix<double>(3, 5, 22, 0.3);
  const auto adv = random_matrix<double>(3, 5, 23);
  const RowMatrix<double> mask = RowMatrix<double>::Ones(3, 5);
  ppo::PolicyLossConfig config;
  config.dro_beta = 0.05;
  const auto full = ppo::compute_policy_loss<double>("vanilla", old, lp, adv, mask, "token-mean", config);
  CHECK(full.metrics.size() == 3);
  CHECK(full.metric("actor/ppo_kl").has_value());
  CHECK(ppo::compute_policy_loss<double>("gpg", old, lp, adv, mask, "token-mean", config).metrics.empty());
  const auto dro = ppo::compute_policy_loss<double>("dro", old, lp, adv, mask, "token-mean", config);
  CHECK(dro.metrics.size() == 1);
  CHECK(*dro.metric("actor/ppo_kl") == doctest::Approx(ppo::masked_mean<double>(old - lp, mask)));
  CHECK_FALSE(dro.metric("actor/pg_clipfrac").has_value());
  // gspo and sapo aggregate with seq-mean-token-mean whatever mode is asked for, as verl does.
  for (const auto name : {"gspo", "sapo"}) {
    const auto a = ppo::compute_policy_loss<double>(name, old, lp, adv, mask, "token-sum", config);
    const auto b = ppo::compute_policy_loss<double>(name, old, lp, adv, mask, "seq-mean-token-mean", config);
    CHECK(a.loss == b.loss);
  }
}

TEST_CASE("vanilla: asymmetric clip and dual clip on hand-made tokens") {
  // ratios e^x: 1.5 (A>0, clipped at 1.28), 0.5 (A<0, clipped at 0.8), 5 (A<0, dual-clipped at 3).
  RowMatrix<double> lp(1, 3), old = RowMatrix<double>::Zero(1, 3), adv(1, 3), mask = RowMatrix<double>::Ones(1, 3);
  lp << std::log(1.5), std::log(0.5), std::log(5.0);
  adv << 1.0, -1.0, -2.0;
  ppo::PolicyLossConfig config;
  config.clip_ratio_high = 0.28;
  const auto out = ppo::compute_policy_loss_vanilla<double>(old, lp, adv, mask, ppo::LossAggMode::token_sum, config);
  CHECK(out.loss == doctest::Approx(-1.28 + 0.8 + 6.0));
  CHECK(out.grad_log_prob.isZero());  // every token is clipped
  CHECK(*out.metric("actor/pg_clipfrac") == doctest::Approx(2.0 / 3.0));
  CHECK(*out.metric("actor/pg_clipfrac_lower") == doctest::Approx(1.0 / 3.0));
}

TEST_CASE("kl_cov: the tokens whose advantage and log-probability covary most carry coef |log-ratio|") {
  // Means: A 0, log p -1.625; covariances A (log p + 1.625) = 0.625, 0.375, -1.375, -1.125.
  RowMatrix<double> lp(1, 4), old(1, 4), adv(1, 4), mask = RowMatrix<double>::Ones(1, 4);
  lp << -1.0, -2.0, -3.0, -0.5;
  const double log_ratio[4] = {0.1, -0.2, 0.3, 0.05};
  for (int j = 0; j < 4; ++j)
    old(0, j) = lp(0, j) - log_ratio[j];
  adv << 1.0, -1.0, 1.0, -1.0;
  const auto expect = [&](const ppo::PolicyLossResult<double>& out, std::vector<int> selected, double coef) {
    double loss = 0;
    for (int j = 0; j < 4; ++j) {
      const bool s = std::find(selected.begin(), selected.end(), j) != selected.end();
      const double plain = -adv(0, j) * std::exp(lp(0, j) - old(0, j));
      loss += plain + (s ? coef * std::abs(log_ratio[j]) : 0.0);
      CAPTURE(j);
      CHECK(out.grad_log_prob(0, j) ==
            doctest::Approx(plain + (s ? coef * (log_ratio[j] > 0 ? 1.0 : -1.0) : 0.0)).epsilon(1e-12));
    }
    CHECK(out.loss == doctest::Approx(loss).epsilon(1e-12));
    CHECK(out.metrics.size() == 1);  // verl reports actor/ppo_kl only: the masked mean |log-ratio|
    CHECK(*out.metric("actor/ppo_kl") == doctest::Approx((0.1 + 0.2 + 0.3 + 0.05) / (4 + 1e-8)).epsilon(1e-12));
  };
  ppo::PolicyLossConfig config;  // verl's defaults: 0.0002 of 4 tokens rounds to 0, so one token
  config.ppo_kl_coef = 2.0;
  expect(ppo::compute_policy_loss_kl_cov<double>(old, lp, adv, mask, ppo::LossAggMode::token_sum, config), {0}, 2.0);
  config.kl_cov_ratio = 0.5;  // two tokens
  expect(ppo::compute_policy_loss<double>("kl_cov", old, lp, adv, mask, "token-sum", config), {0, 1}, 2.0);
  config.kl_cov_ratio = 1.0;  // every valid token
  expect(ppo::compute_policy_loss<double>("kl_cov", old, lp, adv, mask, "token-sum", config), {0, 1, 2, 3}, 2.0);
  // Equal advantages: every covariance is 0, and the tie goes to the lowest valid index (torch.topk
  // leaves it to its selection algorithm; docs/ppo.md).
  adv.setConstant(0.5);
  config.kl_cov_ratio = 0.25;
  expect(ppo::compute_policy_loss_kl_cov<double>(old, lp, adv, mask, ppo::LossAggMode::token_sum, config), {0}, 2.0);
  mask(0, 0) = 0;
  const auto masked = ppo::compute_policy_loss_kl_cov<double>(old, lp, adv, mask, ppo::LossAggMode::token_sum, config);
  CHECK(masked.grad_log_prob(0, 0) == 0.0);
  CHECK(masked.grad_log_prob(0, 1) == doctest::Approx(-0.5 * std::exp(-0.2) - 2.0).epsilon(1e-12));
  CHECK(masked.grad_log_prob(0, 2) == doctest::Approx(-0.5 * std::exp(0.3)).epsilon(1e-12));
}

TEST_CASE("clip_cov: drops candidates of high covariance the clip left alone; the seed picks among more") {
  // 1 x 4: A = 1, -1, 1, -1 (mean 0), log p = -1, -2, -3, -0.5 (mean -1.625): covariances 0.625,
  // 0.375, -1.375, -1.125. Ratios 1.1, 0.9, 1.3, 1.05: token 2 (A > 0, r > 1.2) is clipped.
  RowMatrix<double> lp(1, 4), old(1, 4), adv(1, 4), mask = RowMatrix<double>::Ones(1, 4);
  lp << -1.0, -2.0, -3.0, -0.5;
  const double ratio[4] = {1.1, 0.9, 1.3, 1.05};
  for (int j = 0; j < 4; ++j)
    old(0, j) = lp(0, j) - std::log(ratio[j]);
  adv << 1.0, -1.0, 1.0, -1.0;
  ppo::PolicyLossConfig config;
  config.clip_cov_ratio = 0.5;  // up to 2 of 4 tokens
  config.clip_cov_lb = 0.3;     // candidates: tokens 0 and 1
  const auto out = ppo::compute_policy_loss_clip_cov<double>(old, lp, adv, mask, ppo::LossAggMode::token_sum, config);
  CHECK(out.grad_log_prob(0, 0) == 0.0);  // dropped
  CHECK(out.grad_log_prob(0, 1) == 0.0);  // dropped
  CHECK(out.grad_log_prob(0, 2) == 0.0);  // clipped at 1.2: no gradient either
  CHECK(out.grad_log_prob(0, 3) == doctest::Approx(1.05).epsilon(1e-12));
  CHECK(out.loss == doctest::Approx(-1.2 + 1.05).epsilon(1e-12));
  CHECK(out.metrics.size() == 2);
  CHECK(*out.metric("actor/pg_clipfrac") == doctest::Approx(2 / (4 + 1e-8)).epsilon(1e-12));
  CHECK(out.metric("actor/ppo_kl").has_value());
  config.clip_cov_ratio = 0.25;  // one of the two candidates, chosen by the seed
  int dropped_first = 0;
  for (std::uint64_t seed = 0; seed < 64; ++seed) {
    config.clip_cov_seed = seed;
    const auto one = ppo::compute_policy_loss_clip_cov<double>(old, lp, adv, mask, ppo::LossAggMode::token_sum, config);
    const bool first = one.grad_log_prob(0, 0) == 0.0, second = one.grad_log_prob(0, 1) == 0.0;
    CHECK(first != second);
    dropped_first += first ? 1 : 0;
  }
  CHECK(dropped_first > 16);  // each about half of the time
  CHECK(dropped_first < 48);

  // Many candidates: exactly the allowed number is dropped, all of them candidates, the same set
  // for the same seed, and over seeds every candidate alike (no preference by position).
  const auto big_lp = random_matrix<double>(16, 64, 31, 0.8), big_old = random_matrix<double>(16, 64, 32, 0.8);
  const auto big_adv = random_matrix<double>(16, 64, 33);
  const RowMatrix<double> big_mask = RowMatrix<double>::Ones(16, 64);
  ppo::PolicyLossConfig many;
  many.clip_cov_ratio = 0.01;  // 10 of 1,024
  many.clip_cov_lb = 0.3;
  const double lo = 1 - many.low(), hi = 1 + many.high();
  const double mean_adv = big_adv.mean(), mean_lp = big_lp.mean();
  std::vector<long> candidates;
  for (long t = 0; t < big_lp.size(); ++t) {
    const double a = big_adv.data()[t], r = std::exp(big_lp.data()[t] - big_old.data()[t]);
    const double cov = (a - mean_adv) * (big_lp.data()[t] - mean_lp);
    if (!(-a * std::clamp(r, lo, hi) > -a * r) && cov > 0.3 && cov < 5.0) candidates.push_back(t);
  }
  REQUIRE(candidates.size() > 40);
  std::vector<int> times(static_cast<std::size_t>(big_lp.size()), 0);
  const int seeds = 400;
  for (int seed = 0; seed < seeds; ++seed) {
    many.clip_cov_seed = static_cast<std::uint64_t>(seed) * 7919;
    const auto dropped = ppo::detail::clip_cov_selection<double>(big_old, big_lp, big_adv, big_mask, lo, hi, many);
    int count = 0;
    for (long t = 0; t < big_lp.size(); ++t)
      if (dropped[static_cast<std::size_t>(t)] != 0) {
        ++count;
        ++times[static_cast<std::size_t>(t)];
        CHECK(std::find(candidates.begin(), candidates.end(), t) != candidates.end());
      }
    CHECK(count == 10);
    if (seed < 3)
      CHECK(dropped == ppo::detail::clip_cov_selection<double>(big_old, big_lp, big_adv, big_mask, lo, hi, many));
  }
  const double expected = seeds * 10.0 / static_cast<double>(candidates.size());
  for (const long t : candidates) {
    CAPTURE(t);
    CHECK(times[static_cast<std::size_t>(t)] > 0.4 * expected);
    CHECK(times[static_cast<std::size_t>(t)] < 1.8 * expected);
  }
}

TEST_CASE("kl_cov and clip_cov at a real micro-batch: 64 x 4096 tokens, verl's default ratios") {
  const Eigen::Index rows = 64, cols = 4096;
  const auto lp = random_matrix<double>(rows, cols, 41, 0.8), old = random_matrix<double>(rows, cols, 42, 0.8);
  RowMatrix<double> adv = random_matrix<double>(rows, cols, 43), mask = RowMatrix<double>::Zero(rows, cols);
  std::mt19937 gen(44);
  long valid = 0;
  for (Eigen::Index i = 0; i < rows; ++i) {
    const auto length = static_cast<Eigen::Index>(gen() % static_cast<unsigned>(cols)) + 1;  // padded tails
    mask.row(i).head(length).setOnes();
    valid += static_cast<long>(length);
  }
  const ppo::PolicyLossConfig config;  // kl_cov_ratio = clip_cov_ratio = 0.0002
  const auto selected = ppo::detail::kl_cov_selection<double>(lp, adv, mask, config.kl_cov_ratio);
  const long k = std::max(1L, static_cast<long>(static_cast<double>(valid) * config.kl_cov_ratio));
  REQUIRE(k > 10);
  // The k largest covariances of the valid tokens, nothing else.
  double mean_adv = 0, mean_lp = 0;
  for (Eigen::Index t = 0; t < lp.size(); ++t)
    if (mask.data()[t] != 0) mean_adv += adv.data()[t], mean_lp += lp.data()[t];
  mean_adv /= static_cast<double>(valid);
  mean_lp /= static_cast<double>(valid);
  double lowest_selected = std::numeric_limits<double>::infinity(), highest_other = -lowest_selected;
  long count = 0;
  for (Eigen::Index t = 0; t < lp.size(); ++t) {
    if (mask.data()[t] == 0) {
      CHECK(selected[static_cast<std::size_t>(t)] == 0);
      continue;
    }
    const double cov = (adv.data()[t] - mean_adv) * (lp.data()[t] - mean_lp);
    if (selected[static_cast<std::size_t>(t)] != 0) {
      ++count;
      lowest_selected = std::min(lowest_selected, cov);
    } else {
      highest_other = std::max(highest_other, cov);
    }
  }
  CHECK(count == k);
  CHECK(lowest_selected > highest_other);
  // clip_cov drops at most as many, all valid, and the loss over the whole batch stays finite.
  const auto dropped = ppo::detail::clip_cov_selection<double>(old, lp, adv, mask, 0.8, 1.2, config);
  long drops = 0;
  for (Eigen::Index t = 0; t < lp.size(); ++t)
    drops += dropped[static_cast<std::size_t>(t)] != 0 && mask.data()[t] != 0 ? 1 : 0;
  CHECK(drops == std::count(dropped.begin(), dropped.end(), std::uint8_t{1}));
  CHECK(drops >= 1);
  CHECK(drops <= std::max(1L, static_cast<long>(static_cast<double>(valid) * config.clip_cov_ratio)));
  for (const auto name : {"kl_cov", "clip_cov"}) {
    CAPTURE(name);
    const auto out = ppo::compute_policy_loss<double>(name, old, lp, adv, mask, "token-mean", config);
    CHECK(std::isfinite(out.loss));
    CHECK(out.grad_log_prob.allFinite());
  }
}

TEST_CASE("rollout IS weights: TIS, IcePop, batch normalisation and diagnostics") {
  RowMatrix<double> log_ratio(2, 3), mask(2, 3);
  log_ratio << std::log(0.25), std::log(1.0), std::log(4.0), std::log(2.0), 0.7, 30.0;
  mask << 1, 1, 1, 1, 0, 0;
  ppo::RolloutIsOptions options;
  options.threshold = ppo::RolloutIsThreshold::truncate_at(2.0);
  auto tis = ppo::compute_rollout_correction_weights<double>(log_ratio, mask, options);
  CHECK(tis.weights(0, 0) == doctest::Approx(0.25));
  CHECK(tis.weights(0, 2) == doctest::Approx(2.0));
  CHECK(tis.weights(1, 1) == 0.0);
  CHECK(tis.metrics.at("rollout_is_mean") == doctest::Approx((0.25 + 1 + 2 + 2) / 4));
  CHECK(tis.metrics.at("rollout_is_max") == doctest::Approx(2.0));
  CHECK(tis.metrics.at("rollout_is_min") == doctest::Approx(0.25));
  CHECK(tis.metrics.at("rollout_is_ratio_fraction_high") == doctest::Approx(0.25));  // the raw 4.0
  CHECK(tis.metrics.at("rollout_is_ratio_fraction_low") == doctest::Approx(0.25));   // 0.25 < 1/2
  CHECK(tis.metrics.count("rollout_is_batch_norm_factor") == 0);

  // A threshold the weights' type cannot hold (1e-50 is 0 in float) would zero every weight.
  {
    ppo::RolloutIsOptions tiny;
    tiny.threshold = ppo::RolloutIsThreshold::truncate_at(1e-50);
    const RowMatrix<float> lf = log_ratio.cast<float>(), mf = mask.cast<float>();
    CHECK_THROWS_WITH_AS(ppo::compute_rollout_correction_weights<float>(lf, mf, tiny),
                         doctest::Contains("not positive and finite in the weights' 32-bit type"),
                         mrr::InvalidArgument);
    CHECK(ppo::compute_rollout_correction_weights<double>(log_ratio, mask, tiny).weights(0, 0) ==
          doctest::Approx(1e-50));
  }

  options.batch_normalize = true;
  tis = ppo::compute_rollout_correction_weights<double>(log_ratio, mask, options);
  CHECK(tis.metrics.at("rollout_is_batch_norm_factor") == doctest::Approx(5.25 / 4));
  CHECK(ppo::masked_mean<double>(tis.weights, mask) == doctest::Approx(1.0));

  options.batch_normalize = false;
  options.threshold = ppo::RolloutIsThreshold::parse("0.5_2");
  {
    // Every token outside IcePop's band: no effective sample (verl: ZeroDivisionError; was inf).
    RowMatrix<double> outside(2, 3);
    outside << 3.0, -3.0, 5.0, -4.0, 0.0, 0.0;
    const auto none = ppo::compute_rollout_correction_weights<double>(outside, mask, options);
    CHECK(none.weights.isZero());
    CHECK(none.metrics.at("rollout_is_eff_sample_size") == 0.0);
  }
  const auto icepop = ppo::compute_rollout_correction_weights<double>(log_ratio, mask, options);
  CHECK(icepop.weights(0, 0) == 0.0);  // 0.25 below the band
  CHECK(icepop.weights(0, 2) == 0.0);  // 4 above the band
  CHECK(icepop.weights(1, 0) == doctest::Approx(2.0));
  CHECK(icepop.metrics.at("rollout_is_oob_ratio") == doctest::Approx(0.5));

  options.level = ppo::RolloutIsLevel::sequence;
  options.threshold = ppo::RolloutIsThreshold::truncate_at(5.0);
  const auto sequence = ppo::compute_rollout_correction_weights<double>(log_ratio, mask, options);
  CHECK(sequence.weights(0, 1) == doctest::Approx(1.0));  // 0.25 * 1 * 4
  CHECK(sequence.weights(1, 0) == doctest::Approx(2.0));
  CHECK(sequence.weights(1, 2) == 0.0);
}

TEST_CASE("KL controllers: fixed never moves, adaptive follows the proportional error") {
  auto fixed = ppo::KlController<double>::from_config("fixed", 0.05);
  fixed.update(10.0, 1000);
  CHECK(fixed.value() == 0.05);
  auto adaptive = ppo::KlController<double>::from_config("adaptive", 0.2, 0.1, 1000);
  adaptive.update(0.5, 100);  // error clipped to +0.2
  CHECK(adaptive.value() == doctest::Approx(0.2 * (1 + 0.2 * 100 / 1000)));
  adaptive.update(0.09, 100);  // error -0.1
  CHECK(adaptive.value() == doctest::Approx(0.2 * 1.02 * (1 - 0.1 * 100 / 1000)));
}

TEST_CASE("compute_rewards subtracts the scaled KL") {
  RowMatrix<double> scores(1, 2), old(1, 2), ref(1, 2);
  scores << 1, 2;
  old << -1, -2;
  ref << -1.5, -1;
  const auto rewards = ppo::compute_rewards<double>(scores, old, ref, 0.1);
  CHECK(rewards(0, 0) == doctest::Approx(1 - 0.05));
  CHECK(rewards(0, 1) == doctest::Approx(2 + 0.1));
}

TEST_CASE("_into variants reuse the caller's storage and refuse aliasing outputs") {
  const auto rewards = random_matrix<double>(6, 9, 31), values = random_matrix<double>(6, 9, 32);
  const RowMatrix<double> mask = multi_turn_mask<double>(6, 9, 33);
  const ppo::GroupIndex index{0, 0, 1, 1, 2, 2};
  const Vector<double> baselines = Vector<double>::Ones(6);
  const RowMatrix<double> log_probs = -values.cwiseAbs(), sum_pi_squared = RowMatrix<double>::Constant(6, 9, 0.4);
  ppo::AdvantageInputs<double> in{rewards, mask, values, &index, baselines, log_probs, sum_pi_squared};
  ppo::AdvantageResult<double> out;
  for (const auto name : ppo::kAdvantageEstimatorNames) {
    CAPTURE(name);
    ppo::compute_advantage_into<double>(out, name, in);
    const double* storage = out.advantages.data();
    ppo::compute_advantage_into<double>(out, name, in);
    CHECK(out.advantages.data() == storage);
    const auto fresh = ppo::compute_advantage<double>(name, in);
    CHECK(out.advantages == fresh.advantages);
    CHECK(out.returns == fresh.returns);
  }
  // The single-output forms write exactly the advantages of the two-output ones.
  RowMatrix<double> one(6, 9);
  ppo::compute_rloo_outcome_advantage_into<double>(one, rewards, mask, index);
  CHECK(one == ppo::compute_rloo_outcome_advantage<double>(rewards, mask, index).advantages);
  ppo::compute_rloo_vectorized_outcome_advantage_into<double>(one, rewards, mask, index);
  CHECK(one == ppo::compute_rloo_vectorized_outcome_advantage<double>(rewards, mask, index).advantages);
  RowMatrix<double> wrong(6, 8), rewards_copy = rewards;
  CHECK_THROWS_WITH_AS(ppo::compute_rloo_outcome_advantage_into<double>(wrong, rewards, mask, index),
                       doctest::Contains("'advantages' has shape [6, 8]"), InvalidArgument);
  CHECK_THROWS_WITH_AS(
      ppo::compute_rloo_vectorized_outcome_advantage_into<double>(rewards_copy, rewards_copy, mask, index),
      doctest::Contains("'advantages'"), InvalidArgument);
  ppo::AdvantageResult<double> aliased{rewards, values};
  CHECK_THROWS_WITH_AS(ppo::compute_gae_advantage_return_into<double>(aliased, aliased.advantages, values, mask, 1, 1),
                       doctest::Contains("'out' shares memory with an input"), InvalidArgument);
}

TEST_CASE("gpg: alpha is verl's bsz / m, i.e. float32(float32(1 / m) * bsz), not the rounded quotient") {
  // verl: alpha = bsz / m.clamp(min=1) with bsz a Python int and m an int64 tensor. Python calls
  // Tensor.__rtruediv__, which is m.reciprocal() * bsz: the reciprocal is promoted to float32 and
  // the product rounded to float32. For B = 7 and m = 6 that is one ulp above float32(7 / 6).
  const int batch = 7, nonzero = 6;
  const float reciprocal = 1.0f / static_cast<float>(nonzero);
  const float verl_alpha = reciprocal * static_cast<float>(batch);
  const float quotient = static_cast<float>(batch) / static_cast<float>(nonzero);
  REQUIRE(verl_alpha != quotient);  // the case that tells the two apart
  CHECK(verl_alpha == std::nextafter(quotient, 2.0f));

  // Singleton groups have mean 0, so each advantage is alpha * score / f_norm (f_norm = 1).
  RowMatrix<float> rewards = RowMatrix<float>::Zero(batch, 3);
  for (int i = 0; i < nonzero; ++i)
    rewards(i, 2) = static_cast<float>(i + 1);  // score i + 1; the last response scores 0
  const RowMatrix<float> mask = RowMatrix<float>::Ones(batch, 3);
  const ppo::GroupIndex index(std::vector<std::int64_t>{0, 1, 2, 3, 4, 5, 6});
  const auto out = ppo::compute_gpg_outcome_advantage<float>(rewards, mask, index);
  for (int i = 0; i < batch; ++i) {
    CAPTURE(i);
    const float score = rewards.row(i).sum();
    CHECK(out.advantages(i, 0) == verl_alpha * score);
    CHECK(out.returns(i, 2) == verl_alpha * score);
  }
  // In double the float32 alpha is kept, as verl's float32 tensor is.
  const RowMatrix<double> rewards_d = rewards.cast<double>();
  const RowMatrix<double> mask_d = mask.cast<double>();
  const auto out_d = ppo::compute_gpg_outcome_advantage<double>(rewards_d, mask_d, index);
  CHECK(out_d.advantages(0, 0) == static_cast<double>(verl_alpha));
}

// Float inputs whose reductions cancel or run long: the float results stay within float's own
// precision of the double ones (found by verl cases drawn beyond the vendored ones, where the float
// runs missed tests/ppo's float rule while verl itself in float32 met it).
TEST_CASE("float: rollout_is_std of weights near 1 over a large batch is the double one to 1e-4") {
  // std 0.01 around 1 over 32,768 tokens: E[w^2] - E[w]^2 = 1e-4 cancels four digits, and a float
  // running sum over 32,768 terms near 1 is off by more than that.
  const auto log_ratio = random_matrix<double>(64, 512, 31, 0.01);
  const RowMatrix<double> mask = RowMatrix<double>::Ones(64, 512);
  ppo::RolloutIsOptions options;
  options.level = ppo::RolloutIsLevel::token;
  options.threshold.upper = 2.0;
  const auto d = ppo::compute_rollout_correction_weights<double>(log_ratio, mask, options);
  const RowMatrix<float> log_ratio_f = log_ratio.cast<float>(), mask_f = mask.cast<float>();
  const auto f = ppo::compute_rollout_correction_weights<float>(log_ratio_f, mask_f, options);
  for (const char* key : {"rollout_is_std", "rollout_is_mean", "rollout_is_eff_sample_size"}) {
    CAPTURE(key);
    const double want = d.metrics.at(key), got = f.metrics.at(key);
    CHECK(std::abs(got - want) <= 1e-4 * std::abs(want));
  }
}

TEST_CASE("float: the entropy gradient of logits far from 0 is the double one to float precision") {
  // Logits 1000 + N(0, 8): sum_j p_j z_j is about 1000, and z_k minus it cancels about 14 bits in
  // float unless both are taken about max_j z_j.
  RowMatrix<double> logits = random_matrix<double>(6, 33, 41, 8.0);
  logits.array() += 1000.0;
  const RowMatrix<double> mask = RowMatrix<double>::Ones(2, 3);
  const auto d = ppo::compute_entropy_loss<double>(logits, mask);
  // The float run sees the logits rounded to float; so does the double reference here.
  const RowMatrix<float> logits_f = logits.cast<float>(), mask_f = mask.cast<float>();
  const RowMatrix<double> logits_rounded = logits_f.cast<double>();
  const auto dr = ppo::compute_entropy_loss<double>(logits_rounded, mask);
  const auto f = ppo::compute_entropy_loss<float>(logits_f, mask_f);
  const double scale = dr.grad_logits.cwiseAbs().maxCoeff();
  CHECK(scale > 1e-3);
  CHECK((f.grad_logits.cast<double>() - dr.grad_logits).cwiseAbs().maxCoeff() <= 1e-5 * scale);
  CHECK((dr.grad_logits - d.grad_logits).cwiseAbs().maxCoeff() <= 1e-3 * scale);  // the rounding's own effect
}

TEST_CASE("float: token-sum and seq-mean aggregation of 131,072 terms is the double one to 1e-6") {
  auto loss = random_matrix<double>(64, 2048, 51, 0.1);
  loss.array() += 1.0;  // a running float sum near 131,072 keeps 1/128 of each term's last bit
  const RowMatrix<double> mask = RowMatrix<double>::Ones(64, 2048);
  const RowMatrix<float> loss_f = loss.cast<float>(), mask_f = mask.cast<float>();
  const RowMatrix<double> loss_rounded = loss_f.cast<double>();
  for (auto mode : {ppo::LossAggMode::token_sum, ppo::LossAggMode::token_mean, ppo::LossAggMode::seq_mean_token_sum}) {
    CAPTURE(ppo::to_string(mode));
    const double want = ppo::agg_loss<double>(loss_rounded, mask, mode);
    const double got = ppo::agg_loss<float>(loss_f, mask_f, mode);
    CHECK(std::abs(got - want) <= 1e-6 * std::abs(want));
  }
}

TEST_CASE("sequence-level IS fractions as verl computes them: a float32 log threshold and a float32 mean") {
  // verl compares each sequence's log-ratio with torch.log(torch.tensor(2.0)), a float32 value
  // (0.69314718246...), above double's log 2 (0.69314718056...), and takes (cond).float().mean().
  const double between = 0.6931471815;  // above double's log 2, below float32's
  REQUIRE(between > std::log(2.0));
  REQUIRE(between < static_cast<double>(std::log(2.0f)));
  RowMatrix<double> log_ratio(3, 2);
  log_ratio << between, 0.0, 1.0, 0.0, 0.0, 0.0;
  const RowMatrix<double> mask = RowMatrix<double>::Ones(3, 2);
  ppo::RolloutIsOptions options;
  options.level = ppo::RolloutIsLevel::sequence;
  options.threshold = ppo::RolloutIsThreshold::truncate_at(2.0);
  const auto out = ppo::compute_rollout_correction_weights<double>(log_ratio, mask, options);
  // One sequence of three exceeds the float32 threshold (the borderline one does not), and the
  // fraction is float32's 1 / 3.
  CHECK(out.metrics.at("rollout_is_ratio_fraction_high") == static_cast<double>(1.0f / 3.0f));
  CHECK(out.metrics.at("rollout_is_ratio_fraction_high") != 1.0 / 3.0);
  CHECK(out.metrics.at("rollout_is_ratio_fraction_low") == 0.0);
}

TEST_CASE("rejection sampling: which tokens and sequences each option masks, chained options, metrics") {
  using M = RowMatrix<double>;
  // Row 0: ratios 3, 1, 0.4 and a padded token; row 1: ratios 1.1, 0.9, 1.05, 1.0.
  M log_ratio(2, 4), mask = M::Ones(2, 4);
  log_ratio << std::log(3.0), 0.0, std::log(0.4), 50.0, std::log(1.1), std::log(0.9), std::log(1.05), 0.0;
  mask(0, 3) = 0;
  // token_k1 keeps 0.5 <= ratio <= 2: rejects 3 and 0.4, never the padded token.
  auto r = ppo::compute_rollout_rejection_mask<double>(log_ratio, mask, "token_k1", "0.5_2.0");
  M expected = mask;
  expected(0, 0) = expected(0, 2) = 0;
  CHECK(r.response_mask == expected);
  CHECK(r.metrics.at("rollout_rs_token_k1_masked_fraction") == doctest::Approx(2.0 / 7.0));
  CHECK(r.metrics.at("rollout_rs_masked_fraction") == doctest::Approx(2.0 / 7.0));
  CHECK(r.metrics.at("rollout_rs_seq_masked_fraction") == doctest::Approx(0.5));
  CHECK(r.metrics.at("rollout_rs_token_k1_max") == doctest::Approx(-std::log(0.4)));  // k1 = -log ratio
  // A bare upper bound means [1 / upper, upper].
  CHECK(ppo::compute_rollout_rejection_mask<double>(log_ratio, mask, "token_k1", "2").response_mask == expected);
  CHECK(ppo::compute_rollout_rejection_mask<double>(log_ratio, mask, ppo::RolloutRsOptions::parse("token_k1", 2.0))
            .response_mask == expected);

  // seq_mean_k3 masks whole sequences: row 0's mean k3 is large, row 1's small.
  r = ppo::compute_rollout_rejection_mask<double>(log_ratio, mask, "seq_mean_k3", "0.01");
  expected = mask;
  expected.row(0).setZero();
  CHECK(r.response_mask == expected);
  CHECK(r.metrics.at("rollout_rs_seq_mean_k3_seq_masked_fraction") == doctest::Approx(0.5));
  CHECK(r.metrics.count("rollout_rs_seq_mean_k3_seq_fraction_low") == 0);  // k1 options only
  CHECK(r.metrics.at("rollout_rs_seq_mean_k3_fraction_low") == 0.0);

  // Chained: a token must pass every option; repeated options count once; one shared threshold.
  r = ppo::compute_rollout_rejection_mask<double>(log_ratio, mask, " token_k2 , seq_max_k2 ,token_k2", "0.004");
  // k2 = log(r)^2 / 2 <= 0.004 <=> |log r| <= 0.0894: row 1 keeps ratios 0.9..1.1 only where |log r| fits
  // (1.1: 0.0953, 0.9: 0.105 fail), and seq_max_k2 rejects both rows (each has a token above).
  CHECK(r.response_mask.isZero());
  CHECK(r.metrics.count("rollout_rs_token_k2_mean") == 1);
  CHECK(r.metrics.count("rollout_rs_seq_max_k2_mean") == 1);
  CHECK(r.metrics.at("rollout_rs_masked_fraction") == doctest::Approx(1.0));

  // The log-ratio is clamped to +-20 before the statistics: 50 and 20 give the same k3.
  M far(1, 2), two = M::Ones(1, 2);
  far << 50.0, 20.0;
  const auto c = ppo::compute_rollout_rejection_mask<double>(far, two, "token_k3", "1e12");
  CHECK(c.metrics.at("rollout_rs_token_k3_max") == c.metrics.at("rollout_rs_token_k3_min"));

  // No rows: returned as given, no metrics (as verl).
  const M none(0, 4);
  const auto e = ppo::compute_rollout_rejection_mask<double>(none, none, "token_k1", "2");
  CHECK(e.response_mask.rows() == 0);
  CHECK(e.metrics.empty());
}

TEST_CASE(
    "bypass_mode: reinforce is -w A log p on the kept tokens, IS weights without gradient; ppo_clip is PPO "
    "against the rollout's log-probs") {
  using M = RowMatrix<double>;
  const M rollout = -random_matrix<double>(3, 5, 71).cwiseAbs() - M::Constant(3, 5, 0.1);
  const M log_prob = rollout + random_matrix<double>(3, 5, 72, 0.3);
  M advantages(3, 5), mask = M::Ones(3, 5);
  advantages.row(0).setConstant(1.0);
  advantages.row(1).setConstant(-0.5);
  advantages.row(2).setConstant(2.0);
  mask(2, 4) = 0;
  advantages(2, 4) = 0;

  ppo::PolicyLossConfig config;
  ppo::RolloutCorrectionConfig rc;
  rc.loss_type = ppo::BypassLossType::reinforce;
  rc.is = ppo::RolloutIsOptions{ppo::RolloutIsLevel::token, ppo::RolloutIsThreshold::truncate_at(1.2), false};
  rc.rs = ppo::RolloutRsOptions::parse("token_k1", "0.6_1.6");
  config.rollout_correction = rc;
  const auto out = ppo::compute_policy_loss<double>(ppo::PolicyLossKind::bypass_mode, rollout, log_prob, advantages,
                                                    mask, ppo::LossAggMode::token_mean, config);
  // By hand: w = min(p / p_rollout, 1.2); kept: 0.6 <= p / p_rollout <= 1.6 on valid tokens.
  double loss = 0, kept = 0, kl = 0;
  M grad = M::Zero(3, 5);
  for (Eigen::Index i = 0; i < 3; ++i)
    for (Eigen::Index j = 0; j < 5; ++j) {
      const double ratio = std::exp(log_prob(i, j) - rollout(i, j));
      if (mask(i, j) == 0 || ratio < 0.6 || ratio > 1.6) continue;
      const double w = std::min(ratio, 1.2);
      loss += -w * advantages(i, j) * log_prob(i, j);
      grad(i, j) = -w * advantages(i, j);
      kl += rollout(i, j) - log_prob(i, j);
      kept += 1;
    }
  REQUIRE(kept > 0);
  REQUIRE(kept < 14);  // the case rejects something
  CHECK(out.loss == doctest::Approx(loss / kept).epsilon(1e-12));
  CHECK(out.grad_log_prob.isApprox(grad / kept, 1e-12));
  CHECK(out.metric("actor/ppo_kl").value() == doctest::Approx(kl / (kept + 1e-8)).epsilon(1e-9));
  CHECK(out.metric("rollout_corr/rollout_rs_token_k1_masked_fraction").has_value());
  CHECK(out.metric("rollout_corr/rollout_is_mean").has_value());
  CHECK(out.metric("rollout_corr/training_ppl").has_value());
  CHECK(!out.metric("actor/pg_clipfrac").has_value());

  // ppo_clip: vanilla PPO on the kept tokens with old_log_prob = the rollout's, no IS weights, and
  // the same rollout_corr metrics.
  config.rollout_correction->loss_type = ppo::BypassLossType::ppo_clip;
  const auto clip =
      ppo::compute_policy_loss<double>("bypass_mode", rollout, log_prob, advantages, mask, "token-mean", config);
  const auto kept_mask = ppo::compute_rollout_rejection_mask<double>(M(log_prob - rollout), mask, *rc.rs).response_mask;
  const auto vanilla = ppo::compute_policy_loss_vanilla<double>(rollout, log_prob, advantages, kept_mask,
                                                                ppo::LossAggMode::token_mean, config);
  CHECK(clip.loss == vanilla.loss);
  CHECK(clip.grad_log_prob == vanilla.grad_log_prob);
  CHECK(clip.metric("actor/pg_clipfrac") == vanilla.metric("actor/pg_clipfrac"));
  CHECK(clip.metric("rollout_corr/rollout_rs_masked_fraction") ==
        out.metric("rollout_corr/rollout_rs_masked_fraction"));
}

TEST_CASE(
    "rejection sampling at a real micro-batch (64 x 4096, padded tails): masks only valid tokens, whole rows "
    "for sequence options, fractions that add up") {
  using M = RowMatrix<double>;
  const Eigen::Index rows = 64, cols = 4096;
  const M log_ratio = random_matrix<double>(rows, cols, 81, 0.05);
  M mask = M::Zero(rows, cols);
  std::mt19937 gen(82);
  for (Eigen::Index i = 0; i < rows; ++i)
    mask.row(i).head(1 + static_cast<Eigen::Index>(gen() % cols)).setOnes();
  const auto r = ppo::compute_rollout_rejection_mask<double>(log_ratio, mask, "token_k1,seq_max_k3", "0.9_1.11,0.0125");
  double kept = 0, rejected_rows = 0;
  for (Eigen::Index i = 0; i < rows; ++i) {
    bool whole = true, any_rejected = false;
    for (Eigen::Index j = 0; j < cols; ++j) {
      CHECK_FALSE((r.response_mask(i, j) == 1 && mask(i, j) == 0));
      kept += r.response_mask(i, j);
      if (mask(i, j) == 1 && r.response_mask(i, j) == 0)
        any_rejected = true;
      else if (mask(i, j) == 1)
        whole = false;
    }
    rejected_rows += any_rejected;
    // seq_max_k3: a row whose largest k3 exceeds the bound is rejected whole.
    double max_k3 = 0;
    for (Eigen::Index j = 0; j < cols; ++j)
      if (mask(i, j) == 1) max_k3 = std::max(max_k3, std::expm1(log_ratio(i, j)) - log_ratio(i, j));
    if (max_k3 > 0.0125) CHECK(whole);
  }
  const double valid = mask.sum();
  CHECK(r.metrics.at("rollout_rs_masked_fraction") == doctest::Approx(1.0 - kept / valid).epsilon(1e-12));
  CHECK(r.metrics.at("rollout_rs_seq_masked_fraction") == doctest::Approx(rejected_rows / rows).epsilon(1e-6));
  CHECK(kept > 0);
  CHECK(kept < valid);
}
