// The row-parallel PPO paths (GAE, the reward-to-go estimators, GRPO / RLOO / GDPO broadcasts,
// KL, vanilla policy loss) give the same bits with 1, 2 and 3 OpenMP threads (this target is
// compiled with -fopenmp; the row tiles and the order in which partial sums are reduced do not
// depend on the thread count).
#include <mrr/ppo/advantage.hpp>
#include <mrr/ppo/kl.hpp>
#include <mrr/ppo/policy_loss.hpp>

#include <doctest/doctest.h>
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace {

using namespace mrr;

template <class T>
struct Batch {
  RowMatrix<T> a, b, c, mask;
  std::vector<std::int64_t> uids;
};

// Rows and columns that are multiples of no tile; ragged masks, some fully masked rows.
template <class T>
Batch<T> make_batch(Eigen::Index rows, Eigen::Index cols, unsigned seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_int_distribution<Eigen::Index> length(0, cols);
  Batch<T> b{RowMatrix<T>(rows, cols), RowMatrix<T>(rows, cols), RowMatrix<T>(rows, cols),
             RowMatrix<T>::Zero(rows, cols), {}};
  for (Eigen::Index i = 0; i < rows; ++i) {
    b.mask.row(i).head(length(gen)).setOnes();
    for (Eigen::Index j = 0; j < cols; ++j) {
      b.a(i, j) = static_cast<T>(-std::abs(normal(gen)));
      b.b(i, j) = static_cast<T>(static_cast<double>(b.a(i, j)) + 0.3 * normal(gen));
      b.c(i, j) = static_cast<T>(normal(gen));
    }
    b.uids.push_back(static_cast<std::int64_t>(i / 5));
  }
  return b;
}

template <class F>
void same_for_thread_counts(F&& run) {
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  const auto reference = run();
  for (int threads : {2, 3}) {
    omp_set_num_threads(threads);
    CHECK(run() == reference);
  }
  omp_set_num_threads(saved);
}

}  // namespace

TEST_CASE_TEMPLATE("PPO results are bitwise independent of the thread count", T, float, double) {
  const auto b = make_batch<T>(203, 1531, 7);
  same_for_thread_counts([&] {
    const auto r = ppo::compute_gae_advantage_return<T>(b.c, b.a, b.mask, 0.99, 0.95);
    return std::make_pair(r.advantages, r.returns);
  });
  const ppo::GroupIndex index(b.uids);
  same_for_thread_counts([&] { return ppo::compute_grpo_outcome_advantage<T>(b.c, b.mask, index).advantages; });
  same_for_thread_counts([&] {
    RowMatrix<T> out(b.c.rows(), b.c.cols());
    ppo::compute_grpo_vectorized_outcome_advantage_into<T>(out, b.c, b.mask, index);
    return out;
  });
  same_for_thread_counts([&] { return ppo::compute_rloo_outcome_advantage<T>(b.c, b.mask, index).returns; });
  // The reward-to-go estimators (rows in SIMD lanes on time tiles) and the whitened broadcasts,
  // with observation spans inside the responses (and across the time tiles' edges).
  RowMatrix<T> turns = b.mask;
  for (Eigen::Index i = 0; i < turns.rows(); i += 3)
    turns.row(i).segment((i * 37) % 900, 300).setZero();
  const Vector<T> baselines = b.a.col(0);
  for (const RowMatrix<T>* mask : {&b.mask, static_cast<const RowMatrix<T>*>(&turns)}) {
    same_for_thread_counts([&] {
      const auto r = ppo::compute_reinforce_plus_plus_outcome_advantage<T>(b.c, *mask, 0.97);
      return std::make_pair(r.advantages, r.returns);
    });
    same_for_thread_counts([&] {
      const auto r = ppo::compute_remax_outcome_advantage<T>(b.c, baselines, *mask);
      return std::make_pair(r.advantages, r.returns);
    });
    same_for_thread_counts([&] {
      const auto r = ppo::compute_reinforce_plus_plus_baseline_outcome_advantage<T>(b.c, *mask, index);
      return std::make_pair(r.advantages, r.returns);
    });
    same_for_thread_counts([&] { return ppo::compute_gdpo_outcome_advantage<T>(b.c, *mask, index).advantages; });
  }
  for (const std::string name : {"k1", "abs", "k2", "k3", "k3+"})
    same_for_thread_counts([&] {
      const auto r = ppo::kl_penalty<T>(b.a, b.b, name);
      return std::make_pair(r.values, r.grad_logprob);
    });
  for (const auto mode : {ppo::LossAggMode::token_mean, ppo::LossAggMode::token_sum,
                          ppo::LossAggMode::seq_mean_token_sum, ppo::LossAggMode::seq_mean_token_mean,
                          ppo::LossAggMode::seq_mean_token_sum_norm}) {
    const RowMatrix<T> weights = b.c.array().abs();
    for (const bool weighted : {false, true})
      same_for_thread_counts([&] {
        ppo::OptionalMatrixView<T> is_weights;
        if (weighted) is_weights = weights;
        const auto r = ppo::compute_policy_loss_vanilla<T>(b.b, b.a, b.c, b.mask, mode, {}, is_weights);
        return std::make_tuple(r.loss, r.grad_log_prob, r.metrics);
      });
  }
}

TEST_CASE("errors found in parallel tiles are the ones a serial loop reports") {
  auto b = make_batch<float>(300, 700, 9);
  b.mask(250, 3) = 0.5f;
  b.mask(120, 5) = 2.0f;
  b.b(60, 0) = std::numeric_limits<float>::quiet_NaN();
  b.mask(60, 0) = 1.0f;
  const ppo::GroupIndex index(b.uids);
  for (int threads : {1, 2, 3}) {
    omp_set_num_threads(threads);
    CHECK_THROWS_WITH_AS(ppo::compute_grpo_outcome_advantage<float>(b.c, b.mask, index),
                         doctest::Contains("'response_mask' has 2 at [120, 5]"), mrr::InvalidArgument);
    CHECK_THROWS_WITH_AS(ppo::compute_gae_advantage_return<float>(b.c, b.a, b.mask, 1.0, 1.0),
                         doctest::Contains("'response_mask' has 2 at [120, 5]"), mrr::InvalidArgument);
    CHECK_THROWS_WITH_AS(ppo::compute_policy_loss_vanilla<float>(b.b, b.a, b.c, b.mask),
                         doctest::Contains("'response_mask' has 2 at [120, 5]"), mrr::InvalidArgument);
  }
  b.mask(250, 3) = 1.0f;
  b.mask(120, 5) = 1.0f;
  for (int threads : {1, 2, 3}) {
    omp_set_num_threads(threads);
    CHECK_THROWS_WITH_AS(ppo::compute_policy_loss_vanilla<float>(b.b, b.a, b.c, b.mask),
                         doctest::Contains("'old_log_prob' has a non-finite value nan at unmasked position [60, 0]"),
                         mrr::InvalidArgument);
  }
}
