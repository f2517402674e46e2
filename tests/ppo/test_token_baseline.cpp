// The optimal token baseline (single- and multi-turn), GDPO and sum_pi_squared_from_logits beyond
// the verl cases (tests/ppo/verl_token_baseline): hand-computed baselines, the zero tail, the
// multi-turn estimator as the single-turn one on each response's packed tokens, GDPO as its
// definition through mrr's own GRPO and whitening, a 64 x 4096 micro-batch, and bad input.
#include <mrr/ppo.hpp>
#include <mrr/rollout/sampling.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using namespace mrr;
using Matrix = RowMatrix<double>;

std::string error_of(const auto& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// A right-padded mask of the given lengths, with observation spans [from, to) zeroed in `holes`.
Matrix mask_of(const std::vector<int>& lengths, int cols, const std::vector<std::array<int, 3>>& holes = {}) {
  Matrix mask = Matrix::Zero(static_cast<Eigen::Index>(lengths.size()), cols);
  for (std::size_t i = 0; i < lengths.size(); ++i)
    mask.row(static_cast<Eigen::Index>(i)).head(lengths[i]).setOnes();
  for (const auto& [row, from, to] : holes)
    mask.row(row).segment(from, to - from).setZero();
  return mask;
}

struct Batch {
  Matrix rewards, mask, log_probs, sum_pi_squared, is_weights;
};

// Random but physical: log-probs in (-4, 0), sum_pi_squared between pi^2 and 1, IS weights near 1.
Batch random_batch(const Matrix& mask, unsigned seed, bool dense) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  std::normal_distribution<double> normal(0.0, 1.0);
  Batch b{Matrix::Zero(mask.rows(), mask.cols()), mask, Matrix(mask.rows(), mask.cols()),
          Matrix(mask.rows(), mask.cols()), Matrix(mask.rows(), mask.cols())};
  for (Eigen::Index i = 0; i < mask.rows(); ++i) {
    Eigen::Index last = -1;
    for (Eigen::Index t = 0; t < mask.cols(); ++t) {
      b.log_probs(i, t) = -4.0 * unit(gen) - 1e-3;
      const double pi = std::exp(b.log_probs(i, t));
      b.sum_pi_squared(i, t) = pi * pi + (1 - pi * pi) * unit(gen) * 0.5;
      b.is_weights(i, t) = std::exp(0.2 * normal(gen));
      if (mask(i, t) != 0) {
        last = t;
        if (dense) b.rewards(i, t) = 0.3 * normal(gen);
      }
    }
    if (!dense && last >= 0) b.rewards(i, last) = unit(gen) < 0.5 ? 1.0 : 0.0;
  }
  return b;
}

ppo::AdvantageResult<double> otb(const Batch& b, const ppo::GroupIndex& index, bool multi_turn, bool zero_tail = true,
                                 bool with_is = false) {
  const ppo::OptionalMatrixView<double> is = with_is ? ppo::OptionalMatrixView<double>(b.is_weights) : std::nullopt;
  return multi_turn ? ppo::compute_multi_turn_optimal_token_baseline_advantage<double>(
                          b.rewards, b.mask, index, b.log_probs, b.sum_pi_squared, is, zero_tail)
                    : ppo::compute_optimal_token_baseline_advantage<double>(b.rewards, b.mask, index, b.log_probs,
                                                                            b.sum_pi_squared, is, zero_tail);
}

}  // namespace

TEST_CASE("optimal token baseline by hand: B_t = sum G W / sum W per position, the unique longest's tail at 0") {
  // pi = 1/2 and sum pi^2 = 1/2 everywhere: w = 1 - 1 + 1/2 = 1/2, so W_t = (t + 1) / 2.
  const Matrix mask = mask_of({3, 2, 1}, 4);
  Matrix rewards = Matrix::Zero(3, 4);
  rewards(0, 2) = 1.0;  // response 0: reward 1 at its last token
  rewards(1, 1) = 3.0;  // response 1: reward 3 at its last token
  rewards(2, 0) = 2.0;  // response 2: alone in its group
  const Matrix log_probs = Matrix::Constant(3, 4, std::log(0.5)), sum_pi_squared = Matrix::Constant(3, 4, 0.5);
  const ppo::GroupIndex index{7, 7, 9};
  const auto out =
      ppo::compute_optimal_token_baseline_advantage<double>(rewards, mask, index, log_probs, sum_pi_squared);
  // Reward-to-go, unmasked: response 0 [1, 1, 1, 0], response 1 [3, 3, 0, 0], response 2 [2, 0, 0, 0].
  CHECK(out.returns.row(0) == Eigen::RowVector4d(1, 1, 1, 0));
  CHECK(out.returns.row(1) == Eigen::RowVector4d(3, 3, 0, 0));
  CHECK(out.returns.row(2) == Eigen::RowVector4d(2, 0, 0, 0));
  // Group 7 at t = 0, 1: both members have W_t = (t + 1) / 2, so B_t = (1 + 3) / 2 = 2 (to epsilon).
  const double eps = 1e-8;
  for (int t = 0; t < 2; ++t) {
    const double w = (t + 1) / 2.0, baseline = (1 * w + 3 * w) / (2 * w + eps);
    CHECK(out.advantages(0, t) == doctest::Approx(1 - baseline).epsilon(1e-15));
    CHECK(out.advantages(1, t) == doctest::Approx(3 - baseline).epsilon(1e-15));
  }
  // t = 2: response 0 is the unique longest and response 1 ends at 2, so its baseline is 0 there.
  CHECK(out.advantages(0, 2) == 1.0);
  CHECK(out.advantages(0, 3) == 0.0);  // padding
  CHECK(out.advantages.row(1).tail(2).isZero());
  // A singleton group has no baseline: advantage = reward-to-go on its tokens.
  CHECK(out.advantages.row(2) == Eigen::RowVector4d(2, 0, 0, 0));

  // Without the zero tail, response 0's baseline at t = 2 is its own G W / (W + eps): about 1.
  const auto kept =
      ppo::compute_optimal_token_baseline_advantage<double>(rewards, mask, index, log_probs, sum_pi_squared, {}, false);
  CHECK(kept.advantages(0, 2) == doctest::Approx(1 - 1.5 / (1.5 + eps)).epsilon(1e-15));
  CHECK(std::abs(kept.advantages(0, 2)) < 1e-8);
  CHECK(kept.advantages.leftCols(2) == out.advantages.leftCols(2));
}

TEST_CASE("optimal token baseline: IS weights scale W by their square; weights of 1 change no bit") {
  const Matrix mask = mask_of({5, 3, 4, 5}, 6);
  Batch b = random_batch(mask, 11, true);
  const ppo::GroupIndex index{0, 0, 0, 0};
  b.is_weights.setOnes();
  for (const bool multi_turn : {false, true}) {
    CAPTURE(multi_turn);
    const auto plain = otb(b, index, multi_turn), weighted = otb(b, index, multi_turn, true, true);
    CHECK(plain.advantages == weighted.advantages);
    CHECK(plain.returns == weighted.returns);
  }
  // Weight 2 on one response's tokens counts its path variance four times: the same baseline as
  // that response's W times 4 given through sum_pi_squared (w' = 4 w = 1 - 2 pi + s' with
  // s' = 4 w - 1 + 2 pi), to rounding.
  Batch scaled = b;
  b.is_weights.row(1).setConstant(2.0);
  for (Eigen::Index t = 0; t < 6; ++t) {
    const double pi = std::exp(b.log_probs(1, t));
    const double w = (1 - 2 * pi) + b.sum_pi_squared(1, t);
    scaled.sum_pi_squared(1, t) = 4 * w - 1 + 2 * pi;
  }
  const auto weighted = otb(b, index, false, true, true), equivalent = otb(scaled, index, false);
  CHECK(((weighted.advantages - equivalent.advantages).cwiseAbs().maxCoeff()) < 1e-12);
  CHECK(((weighted.advantages - otb(b, index, false).advantages).cwiseAbs().maxCoeff()) > 1e-3);
}

TEST_CASE("multi-turn token baseline: the single-turn one on each response's packed valid tokens, bit for bit") {
  const int cols = 40;
  const Matrix mask = mask_of({40, 31, 12, 25, 38, 17, 9, 40}, cols, {{0, 5, 11}, {1, 3, 4}, {3, 10, 20}, {4, 1, 30}});
  const Batch b = random_batch(mask, 5, true);
  const ppo::GroupIndex index(std::vector<std::string>{"a", "b", "a", "b", "a", "b", "a", "b"});
  for (const bool zero_tail : {true, false}) {
    CAPTURE(zero_tail);
    // Pack each response's valid tokens to the left (observation spans removed).
    Batch packed{Matrix::Zero(8, cols), Matrix::Zero(8, cols), Matrix::Constant(8, cols, -1.0),
                 Matrix::Constant(8, cols, 0.5), Matrix::Ones(8, cols)};
    std::vector<std::vector<Eigen::Index>> positions(8);
    for (Eigen::Index i = 0; i < 8; ++i)
      for (Eigen::Index t = 0; t < cols; ++t)
        if (mask(i, t) != 0) {
          const auto j = static_cast<Eigen::Index>(positions[static_cast<std::size_t>(i)].size());
          positions[static_cast<std::size_t>(i)].push_back(t);
          packed.rewards(i, j) = b.rewards(i, t);
          packed.mask(i, j) = 1;
          packed.log_probs(i, j) = b.log_probs(i, t);
          packed.sum_pi_squared(i, j) = b.sum_pi_squared(i, t);
        }
    const auto multi = otb(b, index, true, zero_tail), single = otb(packed, index, false, zero_tail);
    Matrix expected = Matrix::Zero(8, cols);
    for (Eigen::Index i = 0; i < 8; ++i) {
      const auto& p = positions[static_cast<std::size_t>(i)];
      for (std::size_t j = 0; j < p.size(); ++j) {
        expected(i, p[j]) = single.advantages(i, static_cast<Eigen::Index>(j));
        CHECK(multi.returns(i, p[j]) == single.returns(i, static_cast<Eigen::Index>(j)));
      }
    }
    CHECK(multi.advantages == expected);
    // Aligned by position instead, the spans shift the later turns: a different baseline.
    CHECK(otb(b, index, false, zero_tail).advantages != multi.advantages);
  }
}

TEST_CASE("token baselines on right-padded responses: single- and multi-turn agree, empty responses aside") {
  const Matrix mask = mask_of({7, 12, 3, 12, 9, 1}, 12);
  const Batch b = random_batch(mask, 3, false);
  const ppo::GroupIndex index{1, 1, 1, 2, 2, 2};
  CHECK(otb(b, index, true).advantages == otb(b, index, false).advantages);
  CHECK(otb(b, index, true, true, true).advantages == otb(b, index, false, true, true).advantages);
  // An empty response: the single-turn estimator keeps it in its group (so group 2 below still has
  // two members and a baseline), the multi-turn one drops it (group 2 is a singleton: no baseline).
  const Matrix holed = mask_of({7, 12, 3, 12, 0, 0}, 12);
  Batch e = random_batch(holed, 3, true);
  const ppo::GroupIndex pairs{1, 1, 1, 2, 2, 2};
  const auto single = otb(e, pairs, false), multi = otb(e, pairs, true);
  CHECK(multi.advantages.row(3) == multi.returns.row(3));      // a full row: the reward-to-go
  CHECK(single.advantages.row(3) == multi.advantages.row(3));  // the longest of its group: zero tail from 0
  CHECK(multi.advantages.bottomRows(2).isZero());
}

TEST_CASE("token baselines at a real micro-batch: 64 x 4096 tokens, groups of 8") {
  const int rows = 64, cols = 4096;
  std::mt19937 gen(42);
  std::vector<int> lengths(rows);
  for (auto& n : lengths)
    n = 512 + static_cast<int>(gen() % (cols - 512 + 1));
  lengths[8] = lengths[9] = cols;  // group 1: a shared longest
  const Matrix mask = mask_of(lengths, cols);
  Batch b = random_batch(mask, 9, false);
  std::vector<std::int64_t> labels(rows);
  for (int i = 0; i < rows; ++i)
    labels[static_cast<std::size_t>(i)] = i / 8;
  const ppo::GroupIndex index(labels);
  // Group 0: every response earns 1 at its last token, so G_t = 1 wherever there is a token and
  // the baseline is 1 (to epsilon): advantage ~0, except past the second longest response.
  for (int i = 0; i < 8; ++i)
    b.rewards(i, lengths[static_cast<std::size_t>(i)] - 1) = 1.0;
  for (const bool multi_turn : {false, true}) {
    CAPTURE(multi_turn);
    const auto out = otb(b, index, multi_turn, true, true);
    CHECK(out.advantages.allFinite());
    CHECK((out.advantages.array() * (1 - mask.array())).isZero());
    std::vector<int> group0(lengths.begin(), lengths.begin() + 8);
    std::sort(group0.begin(), group0.end());
    for (int i = 0; i < 8; ++i) {
      const int n = lengths[static_cast<std::size_t>(i)];
      const bool longest = n == group0[7];
      const int shared = longest ? group0[6] : n;
      CHECK(out.advantages.row(i).head(shared).cwiseAbs().maxCoeff() < 1e-6);
      if (longest && group0[7] > group0[6]) CHECK(out.advantages.row(i).segment(shared, n - shared).isOnes());
    }
    // Every group shares one baseline per position: G - (G - B) is B to a rounding of G (0 or 1).
    const Matrix baseline = out.returns - out.advantages;
    double spread = 0;
    for (int g = 1; g < 8; ++g)
      for (Eigen::Index t = 0; t < 512; ++t)  // every response has a token there
        for (int i = 8 * g + 1; i < 8 * g + 8; ++i)
          spread = std::max(spread, std::abs(baseline(i, t) - baseline(8 * g, t)));
    CHECK(spread < 1e-15);
    CHECK(baseline.bottomRows(56).leftCols(512).cwiseAbs().maxCoeff() > 0.1);
  }
}

TEST_CASE("gdpo: each component normalised in its group, weighted, summed, whitened over the mask") {
  const Matrix mask = mask_of({5, 8, 2, 8, 6, 4, 7, 3}, 8);
  const ppo::GroupIndex index{0, 0, 0, 0, 1, 1, 1, 1};
  Matrix components(2, 8);
  components << 1, 0, 0, 1, 1, 1, 0, 1,  //
      0.2, 0.9, 0.4, 0.35, 0.6, 0.1, 0.75, 0.5;
  const std::vector<double> weights{1.0, 0.5};
  const Matrix unused = Matrix::Zero(8, 8);
  const auto out = ppo::compute_gdpo_outcome_advantage<double>(unused, mask, index, components, weights);
  // By definition, through mrr's GRPO (one score per row, at its first token) and masked_whiten.
  Matrix sum = Matrix::Zero(8, 8);
  for (Eigen::Index k = 0; k < 2; ++k) {
    Matrix scores = Matrix::Zero(8, 8);
    scores.col(0) = components.row(k).transpose();
    sum += weights[static_cast<std::size_t>(k)] *
           ppo::compute_grpo_outcome_advantage<double>(scores, mask, index).advantages;
  }
  const Matrix expected = ppo::masked_whiten<double>(sum, mask).cwiseProduct(mask);
  CHECK((out.advantages - expected).cwiseAbs().maxCoeff() < 1e-12);
  CHECK(out.returns == out.advantages);
  // Whitened: mean 0 and unbiased variance 1 over the mask, to verl's 1e-8 terms (its masked mean
  // divides by the mask's sum + 1e-8, its scale is 1 / sqrt(var + 1e-8)).
  const double n = mask.sum(), mean = out.advantages.sum() / n;
  CHECK(std::abs(mean) < 1e-9);
  CHECK((out.advantages.array() - mean).cwiseProduct(mask.array()).square().sum() / (n - 1) ==
        doctest::Approx(1.0).epsilon(1e-7));
  // Scaling every weight changes next to nothing; flipping one component's sign does.
  const std::vector<double> doubled{2.0, 1.0}, flipped{1.0, -0.5};
  CHECK((ppo::compute_gdpo_outcome_advantage<double>(unused, mask, index, components, doubled).advantages -
         out.advantages)
            .cwiseAbs()
            .maxCoeff() < 1e-7);  // verl's 1e-8 under the variance's square root: not scale-free
  CHECK((ppo::compute_gdpo_outcome_advantage<double>(unused, mask, index, components, flipped).advantages -
         out.advantages)
            .cwiseAbs()
            .maxCoeff() > 0.1);

  // Without components: the summed token rewards as one component, i.e. GRPO then whitening.
  Matrix rewards = Matrix::Zero(8, 8);
  rewards.col(1) = components.row(1).transpose();
  const Matrix one_row = components.row(1);
  const auto summed = ppo::compute_gdpo_outcome_advantage<double>(rewards, mask, index);
  CHECK(summed.advantages == ppo::compute_gdpo_outcome_advantage<double>(unused, mask, index, one_row).advantages);
  const auto grpo = ppo::compute_grpo_outcome_advantage<double>(rewards, mask, index);
  CHECK(
      (summed.advantages - ppo::masked_whiten<double>(grpo.advantages, mask).cwiseProduct(mask)).cwiseAbs().maxCoeff() <
      1e-12);
  // Dr.GRPO (no std) changes the per-group scale, so the result.
  CHECK((ppo::compute_gdpo_outcome_advantage<double>(unused, mask, index, components, weights, 1e-6, false).advantages -
         out.advantages)
            .cwiseAbs()
            .maxCoeff() > 1e-3);
}

TEST_CASE("the new estimators through the registry, by verl's names") {
  const Matrix mask = mask_of({5, 8, 2, 8}, 8);
  const Batch b = random_batch(mask, 21, false);
  const ppo::GroupIndex index{0, 0, 1, 1};
  ppo::AdvantageInputs<double> in{b.rewards, mask};
  in.index = &index;
  in.old_log_probs = b.log_probs;
  in.sum_pi_squared = b.sum_pi_squared;
  CHECK(ppo::compute_advantage<double>("optimal_token_baseline", in).advantages == otb(b, index, false).advantages);
  CHECK(ppo::compute_advantage<double>("tir_optimal_token_baseline", in).advantages == otb(b, index, true).advantages);
  in.rollout_is_weights = b.is_weights;
  ppo::AdvantageConfig config;
  config.handle_zero_tail = false;
  CHECK(ppo::compute_advantage<double>("optimal_token_baseline", in, config).advantages ==
        otb(b, index, false, false, true).advantages);
  CHECK(ppo::compute_advantage<double>("gdpo", in).advantages ==
        ppo::compute_gdpo_outcome_advantage<double>(b.rewards, mask, index).advantages);
  in.old_log_probs = std::nullopt;
  CHECK(contains(error_of([&] { ppo::compute_advantage<double>("optimal_token_baseline", in); }),
                 "advantage estimator 'optimal_token_baseline' needs 'old_log_probs'"));
  in.old_log_probs = b.log_probs;
  in.sum_pi_squared = std::nullopt;
  CHECK(contains(error_of([&] { ppo::compute_advantage<double>("tir_optimal_token_baseline", in); }),
                 "needs 'sum_pi_squared'"));
  in.index = nullptr;
  CHECK(contains(error_of([&] { ppo::compute_advantage<double>("gdpo", in); }), "'gdpo' needs 'index'"));
}

TEST_CASE("token baselines and gdpo: bad input gets an error naming the argument") {
  const Matrix mask = mask_of({3, 4}, 4);
  Batch b = random_batch(mask, 1, true);
  const ppo::GroupIndex index{0, 0};
  const auto run = [&](const Batch& x, double epsilon = 1e-8) {
    return error_of([&] {
      ppo::compute_optimal_token_baseline_advantage<double>(x.rewards, x.mask, index, x.log_probs, x.sum_pi_squared,
                                                            x.is_weights, true, epsilon);
    });
  };
  CHECK(run(b) == "(no error)");
  Batch bad = b;
  bad.log_probs(0, 3) = std::numeric_limits<double>::quiet_NaN();  // padding: never read
  CHECK(run(bad) == "(no error)");
  bad.log_probs(1, 3) = std::numeric_limits<double>::quiet_NaN();
  CHECK(contains(run(bad), "'old_log_probs' has a non-finite value nan at unmasked position [1, 3]"));
  bad = b;
  bad.sum_pi_squared = Matrix::Zero(2, 3);
  CHECK(contains(run(bad), "'sum_pi_squared' has shape [2, 3] but 'token_level_rewards' has shape [2, 4]"));
  bad = b;
  bad.is_weights(0, 0) = std::numeric_limits<double>::infinity();
  CHECK(contains(run(bad), "'rollout_is_weights' has a non-finite value inf at unmasked position [0, 0]"));
  bad = b;
  bad.log_probs(0, 0) = 800;  // exp overflows
  CHECK(contains(run(bad), "the cumulative path variance of row 0 overflowed"));
  bad = b;
  bad.mask(1, 1) = 0.5;
  CHECK(contains(run(bad), "'response_mask' has 0.5 at [1, 1]"));
  CHECK(contains(run(b, 0.0), "'epsilon' must be finite and positive"));
  CHECK(contains(error_of([&] {
                   ppo::compute_multi_turn_optimal_token_baseline_advantage<double>(
                       b.rewards, b.mask, ppo::GroupIndex{0, 0, 1}, b.log_probs, b.sum_pi_squared);
                 }),
                 "'index' has 3 entries but 'token_level_rewards' has 2 rows"));

  const Matrix components = Matrix::Ones(2, 3);
  CHECK(contains(error_of([&] { ppo::compute_gdpo_outcome_advantage<double>(b.rewards, mask, index, components); }),
                 "'reward_components' has 3 columns (responses) but 'token_level_rewards' has 2 rows"));
  Matrix nan_components = Matrix::Ones(2, 2);
  nan_components(1, 0) = std::numeric_limits<double>::quiet_NaN();
  CHECK(contains(error_of([&] { ppo::compute_gdpo_outcome_advantage<double>(b.rewards, mask, index, nan_components); }),
                 "'reward_components' has a non-finite value nan at [1, 0]"));
  const Matrix two = Matrix::Ones(2, 2);
  const std::vector<double> three{1, 2, 3}, inf{1, std::numeric_limits<double>::infinity()};
  CHECK(contains(error_of([&] { ppo::compute_gdpo_outcome_advantage<double>(b.rewards, mask, index, two, three); }),
                 "'reward_weights' has 3 weights for 2 reward components"));
  CHECK(contains(error_of([&] { ppo::compute_gdpo_outcome_advantage<double>(b.rewards, mask, index, {}, three); }),
                 "'reward_weights' has 3 weights for 1 reward component (no 'reward_components'"));
  CHECK(contains(error_of([&] { ppo::compute_gdpo_outcome_advantage<double>(b.rewards, mask, index, two, inf); }),
                 "'reward_weights' has a non-finite weight inf at [1]"));
  CHECK(contains(error_of([&] {
                   ppo::compute_gdpo_outcome_advantage<double>(b.rewards, mask_of({1, 0}, 4), index);
                 }),
                 "'response_mask' selects a single element"));
}

TEST_CASE("sum_pi_squared_from_logits: 1 / vocab for equal logits, 1 for one-hot, the logsumexp form") {
  Matrix logits(4, 50);
  logits.row(0).setConstant(3.0);
  logits.row(1).setConstant(-20.0);
  logits(1, 7) = 980.0;  // exp(1000) would overflow: the max is taken out first
  std::mt19937 gen(4);
  std::normal_distribution<double> normal(0.0, 2.0);
  for (Eigen::Index i = 2; i < 4; ++i)
    for (Eigen::Index v = 0; v < 50; ++v)
      logits(i, v) = normal(gen);
  const Vector<double> s = rollout::sum_pi_squared_from_logits<double>(logits);
  CHECK(s[0] == doctest::Approx(1.0 / 50).epsilon(1e-15));
  CHECK(s[1] == 1.0);
  for (Eigen::Index i = 2; i < 4; ++i) {
    long double lse = 0, lse2 = 0;
    for (Eigen::Index v = 0; v < 50; ++v) {
      lse += std::exp(static_cast<long double>(logits(i, v)));
      lse2 += std::exp(2 * static_cast<long double>(logits(i, v)));
    }
    const double expected = static_cast<double>(std::exp(std::log(lse2) - 2 * std::log(lse)));
    CHECK(s[i] == doctest::Approx(expected).epsilon(1e-14));
  }
  // Temperature t: the logits divided by t.
  const Vector<double> hot = rollout::sum_pi_squared_from_logits<double>(logits, 2.0);
  const Matrix halved = logits / 2.0;
  CHECK((hot - rollout::sum_pi_squared_from_logits<double>(halved)).cwiseAbs().maxCoeff() < 1e-15);
  Matrix bad = logits;
  bad(3, 3) = std::numeric_limits<double>::quiet_NaN();
  CHECK(contains(error_of([&] { rollout::sum_pi_squared_from_logits<double>(bad); }), "sum_pi_squared_from_logits"));
}
