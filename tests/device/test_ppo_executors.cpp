// The PPO kernels of include/mrr/kernels/ppo/ run by every executor: each test is written once and
// instantiated for the host path (ppo/, OpenMP row tiles and vectorised specialisations) and the
// Thrust path on Thrust's OpenMP system (thrust/ppo.hpp, thrust/policy_loss.hpp), and checks the
// executor against the kernel applied element by element, or row by row, on the same inputs.
// Where the executor runs the kernel's own operations the check is bitwise; where it reassociates
// (Eigen's packet exp, chunked or tree reductions, the GPU's GAE scan) it is stated per executor.
#include <mrr/kernels/ppo/advantage.hpp>
#include <mrr/kernels/ppo/kl.hpp>
#include <mrr/kernels/ppo/masked.hpp>
#include <mrr/kernels/ppo/policy_loss.hpp>
#include <mrr/ppo/advantage.hpp>
#include <mrr/ppo/kl.hpp>
#include <mrr/ppo/masked.hpp>
#include <mrr/ppo/policy_loss.hpp>
#include <mrr/thrust/policy_loss.hpp>
#include <mrr/thrust/ppo.hpp>

#include "device_vectors.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

namespace {

namespace k = mrr::kernels::ppo;

using mrr::test::dvec;
using mrr::test::to_device;

template <class T>
mrr::RowMatrix<T> to_host(const dvec<T>& v, Eigen::Index cols) {
  mrr::RowMatrix<T> m(static_cast<Eigen::Index>(v.size()) / cols, cols);
  thrust::copy(v.begin(), v.end(), m.data());
  return m;
}

template <class T>
mrr::RowMatrix<T> normal(Eigen::Index rows, Eigen::Index cols, unsigned seed, double scale = 1.0) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> n(0.0, scale);
  mrr::RowMatrix<T> m(rows, cols);
  for (Eigen::Index i = 0; i < m.size(); ++i)
    m.data()[i] = static_cast<T>(n(rng));
  return m;
}

// Ragged responses (padding at the end) with observation tokens inside.
template <class T>
mrr::RowMatrix<T> response_mask(Eigen::Index rows, Eigen::Index cols) {
  mrr::RowMatrix<T> m(rows, cols);
  for (Eigen::Index i = 0; i < rows; ++i)
    for (Eigen::Index j = 0; j < cols; ++j)
      m(i, j) = (j < cols - (i * 7) % cols && j % 11 != 4) ? T(1) : T(0);
  return m;
}

// a == b (NaN == NaN), or |a - b| within `ulps` units in the last place of the larger magnitude,
// or within `abs_tol` (for values that cancel: a whitened advantage near the mean, a mean near 0).
template <class T>
bool close(T a, T b, int ulps, double abs_tol = 0) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  if (a == b) return true;
  const T scale = std::max(std::abs(a), std::abs(b));
  return std::abs(a - b) <= T(ulps) * std::numeric_limits<T>::epsilon() * scale ||
         static_cast<double>(std::abs(a - b)) <= abs_tol;
}

template <class T>
int count_far(const mrr::RowMatrix<T>& got, const mrr::RowMatrix<T>& want, int ulps, double abs_tol = 0) {
  REQUIRE(got.rows() == want.rows());
  REQUIRE(got.cols() == want.cols());
  int far = 0;
  for (Eigen::Index i = 0; i < got.size(); ++i)
    far += close(got.data()[i], want.data()[i], ulps, abs_tol) ? 0 : 1;
  return far;
}

template <class T>
constexpr double tol(double float_tol, double double_tol) {
  return sizeof(T) == 4 ? float_tol : double_tol;
}

// ---- the executors: the public entry points of each path, on host matrices ----

struct HostExecutor {
  static constexpr const char* name = "host";
  static constexpr bool exact_exp = false;         // Eigen's packet exp / exp_float_reduced in the KL rows
  static constexpr bool sequential_gae = true;     // gae_step over packets of rows: gae_row's bits
  static constexpr int vanilla_gradient_ulps = 4;  // Eigen's packet exp of the ratio: within 1 ulp
  static constexpr bool sequential_loss = false;   // row sums by Eigen packets

  template <class T>
  static mrr::ppo::KlPenaltyResult<T> kl(const mrr::RowMatrix<T>& lp, const mrr::RowMatrix<T>& ref,
                                         mrr::ppo::KlPenalty penalty) {
    return mrr::ppo::kl_penalty<T>(lp, ref, penalty);
  }
  template <class T>
  static mrr::ppo::AdvantageResult<T> gae(const mrr::RowMatrix<T>& r, const mrr::RowMatrix<T>& v,
                                          const mrr::RowMatrix<T>& m, double gamma, double lam) {
    return mrr::ppo::compute_gae_advantage_return<T>(r, v, m, gamma, lam);
  }
  template <class T>
  static mrr::RowMatrix<T> outcome(k::OutcomeEstimator estimator, const mrr::RowMatrix<T>& rewards,
                                   const mrr::RowMatrix<T>& mask, const std::vector<std::int32_t>& group, double eps) {
    const mrr::ppo::GroupIndex index(group);
    switch (estimator) {
      case k::OutcomeEstimator::grpo:
      case k::OutcomeEstimator::grpo_mean_only:
        return mrr::ppo::compute_grpo_outcome_advantage<T>(rewards, mask, index, eps,
                                                           estimator == k::OutcomeEstimator::grpo)
            .advantages;
      case k::OutcomeEstimator::rloo:
        return mrr::ppo::compute_rloo_outcome_advantage<T>(rewards, mask, index).advantages;
      case k::OutcomeEstimator::rloo_vectorized:
        return mrr::ppo::compute_rloo_vectorized_outcome_advantage<T>(rewards, mask, index).advantages;
    }
    return {};
  }
  template <class T>
  static mrr::RowMatrix<T> row_mean(const mrr::RowMatrix<T>& values, const mrr::RowMatrix<T>& mask) {
    const mrr::Vector<T> out = mrr::ppo::masked_row_mean<T>(values, mask);
    return mrr::RowMatrix<T>(Eigen::Map<const mrr::RowMatrix<T>>(out.data(), out.size(), 1));
  }
  template <class T>
  static std::pair<T, mrr::RowMatrix<T>> vanilla(const mrr::RowMatrix<T>& old, const mrr::RowMatrix<T>& lp,
                                                 const mrr::RowMatrix<T>& adv, const mrr::RowMatrix<T>& mask,
                                                 mrr::ppo::LossAggMode mode, const mrr::ppo::PolicyLossConfig& config) {
    const auto out = mrr::ppo::compute_policy_loss_vanilla<T>(old, lp, adv, mask, mode, config);
    return {out.loss, out.grad_log_prob};
  }
};

template <mrr::device::GaeAlgorithm Gae>
struct ThrustOmpExecutor {
  static constexpr const char* name = Gae == mrr::device::GaeAlgorithm::scan ? "thrust-omp (GAE scan)" : "thrust-omp";
  static constexpr bool exact_exp = true;                                         // kl_element itself
  static constexpr bool sequential_gae = Gae != mrr::device::GaeAlgorithm::scan;  // gae_row itself, or a scan
  static constexpr int vanilla_gradient_ulps = 0;                                 // vanilla_row, aggregated_grad
  static constexpr bool sequential_loss = true;                                   // vanilla_row's sums

  template <class T>
  static mrr::ppo::KlPenaltyResult<T> kl(const mrr::RowMatrix<T>& lp, const mrr::RowMatrix<T>& ref,
                                         mrr::ppo::KlPenalty penalty) {
    const auto out = mrr::device::kl_penalty<T>(to_device(lp), to_device(ref), static_cast<int>(penalty.estimator),
                                                penalty.straight_through);
    return {to_host(out.values, lp.cols()), to_host(out.grad_logprob, lp.cols())};
  }
  template <class T>
  static mrr::ppo::AdvantageResult<T> gae(const mrr::RowMatrix<T>& r, const mrr::RowMatrix<T>& v,
                                          const mrr::RowMatrix<T>& m, double gamma, double lam) {
    const auto out = mrr::device::compute_gae_advantage_return<T>(to_device(r), to_device(v), to_device(m), r.cols(),
                                                                  gamma, lam, Gae);
    return {to_host(out.advantages, r.cols()), to_host(out.returns, r.cols())};
  }
  template <class T>
  static mrr::RowMatrix<T> outcome(k::OutcomeEstimator estimator, const mrr::RowMatrix<T>& rewards,
                                   const mrr::RowMatrix<T>& mask, const std::vector<std::int32_t>& group, double eps) {
    int groups = 0;
    for (const auto g : group)
      groups = std::max(groups, g + 1);
    const auto kind = estimator == k::OutcomeEstimator::rloo ? mrr::device::OutcomeEstimator::rloo
                      : estimator == k::OutcomeEstimator::rloo_vectorized
                          ? mrr::device::OutcomeEstimator::rloo_vectorized
                          : mrr::device::OutcomeEstimator::grpo;
    const auto out = mrr::device::compute_outcome_advantage<T>(
        kind, to_device(rewards), to_device(mask), rewards.cols(), dvec<std::int32_t>(group.begin(), group.end()),
        groups, eps, estimator == k::OutcomeEstimator::grpo);
    return to_host(out.advantages, rewards.cols());
  }
  template <class T>
  static mrr::RowMatrix<T> row_mean(const mrr::RowMatrix<T>& values, const mrr::RowMatrix<T>& mask) {
    return to_host(mrr::device::masked_row_mean<T>(to_device(values), to_device(mask), values.cols()), 1);
  }
  template <class T>
  static std::pair<T, mrr::RowMatrix<T>> vanilla(const mrr::RowMatrix<T>& old, const mrr::RowMatrix<T>& lp,
                                                 const mrr::RowMatrix<T>& adv, const mrr::RowMatrix<T>& mask,
                                                 mrr::ppo::LossAggMode mode, const mrr::ppo::PolicyLossConfig& config) {
    const auto out = mrr::device::compute_policy_loss_vanilla<T>(to_device(old), to_device(lp), to_device(adv),
                                                                 to_device(mask), lp.cols(), mode, config);
    return {out.loss, to_host(out.grad_log_prob, lp.cols())};
  }
};

using ThrustRows = ThrustOmpExecutor<mrr::device::GaeAlgorithm::rows>;
using ThrustScan = ThrustOmpExecutor<mrr::device::GaeAlgorithm::scan>;

// Every test runs on both paths; GAE also on the Thrust path's scan (the GPU's algorithm).
#define MRR_PPO_EXECUTORS HostExecutor, ThrustRows

// ---- the tests, once ----

template <class Executor, class T>
void check_kl() {
  const Eigen::Index rows = 7, cols = 301;
  mrr::RowMatrix<T> lp = normal<T>(rows, cols, 1, 2.0), ref = normal<T>(rows, cols, 2, 2.0);
  lp(0, 0) = ref(0, 0);          // ties: abs's zero gradient, k3's ratio 1
  lp(1, 3) = ref(1, 3) + T(30);  // k3's log-ratio clamp
  lp(2, 5) = ref(2, 5) - T(12);  // k3's value clamp
  lp(3, 7) = std::numeric_limits<T>::quiet_NaN();
  for (const auto estimator : {k::KlEstimator::k1, k::KlEstimator::abs, k::KlEstimator::k2, k::KlEstimator::k3})
    for (const bool straight_through : {false, true}) {
      CAPTURE(static_cast<int>(estimator));
      CAPTURE(straight_through);
      const auto got = Executor::template kl<T>(lp, ref, {estimator, straight_through});
      mrr::RowMatrix<T> values(rows, cols), grads(rows, cols);
      for (Eigen::Index i = 0; i < lp.size(); ++i) {
        const auto e = k::kl_element(lp.data()[i], ref.data()[i], estimator, straight_through);
        values.data()[i] = e.value;
        grads.data()[i] = e.grad;
      }
      if (estimator != k::KlEstimator::k3 || Executor::exact_exp) {
        CHECK(count_far(got.values, values, 0) == 0);
        CHECK(count_far(got.grad_logprob, grads, 0) == 0);
        continue;
      }
      // The host's k3 exp is within 1 ulp of std::exp (tests/ppo/test_kernels.cpp): k3 = ratio - c - 1
      // and its gradient 1 - ratio are within 2 ulps of their operands (absolute), and the clamps agree.
      int far = 0;
      for (Eigen::Index i = 0; i < lp.size(); ++i) {
        const T c = k::clamp(ref.data()[i] - lp.data()[i], T(-20), T(20));
        const double operands = std::exp(static_cast<double>(c)) + std::abs(static_cast<double>(c)) + 1;
        const double abs_tol = 2 * static_cast<double>(std::numeric_limits<T>::epsilon()) * operands;
        far += close(got.values.data()[i], values.data()[i], 0, abs_tol) ? 0 : 1;
        far += close(got.grad_logprob.data()[i], grads.data()[i], 0, straight_through ? 0.0 : abs_tol) ? 0 : 1;
      }
      CHECK(far == 0);
    }
}

template <class Executor, class T>
void check_gae() {
  const Eigen::Index rows = 21, cols = 700;  // ragged blocks of 8 rows; more than one host time tile for double
  const auto r = normal<T>(rows, cols, 3), v = normal<T>(rows, cols, 4);
  const auto m = response_mask<T>(rows, cols);
  const double gamma = 0.99, lam = 0.95;
  const auto got = Executor::template gae<T>(r, v, m, gamma, lam);
  mrr::RowMatrix<T> adv(rows, cols), ret(rows, cols);
  for (Eigen::Index i = 0; i < rows; ++i)
    k::gae_row(r.row(i).data(), v.row(i).data(), m.row(i).data(), adv.row(i).data(), ret.row(i).data(), cols,
               static_cast<T>(gamma), static_cast<T>(gamma * lam));
  // Every sequential executor runs gae_step itself: the returns are gae_row's, bit for bit. The scan
  // composes the same affine maps in another order.
  if (Executor::sequential_gae)
    CHECK(count_far(got.returns, ret, 0) == 0);
  else
    CHECK(count_far(got.returns, ret, 64, tol<T>(1e-4, 1e-11)) == 0);
  // Whitening: verl's statistics from the moments (kernels::ppo::mean_and_variance); the executors
  // merge partial moments in their own fixed order, so the last bits may differ.
  T mean{}, variance{};
  REQUIRE(k::mean_and_variance(k::masked_moments(adv.data(), cols, m.data(), cols, rows, cols), true, mean, variance) ==
          k::Status::ok);
  const T scale = k::whitening_scale(variance);
  for (Eigen::Index i = 0; i < adv.size(); ++i)
    adv.data()[i] = k::whiten(adv.data()[i], mean, scale);
  CHECK(count_far(got.advantages, adv, 64, tol<T>(1e-5, 1e-12)) == 0);
}

template <class Executor, class T>
void check_outcome() {
  const Eigen::Index rows = 30, cols = 17;
  // One outcome reward per response, at its last valid token (as verl's reward managers write it),
  // so every executor's row sum is exact and the group math alone decides the bits.
  const auto m = response_mask<T>(rows, cols);
  mrr::RowMatrix<T> rewards = mrr::RowMatrix<T>::Zero(rows, cols);
  std::mt19937 rng(5);
  std::uniform_int_distribution<int> score(-3, 4);
  for (Eigen::Index i = 0; i < rows; ++i)
    rewards(i, cols / 2) = static_cast<T>(score(rng)) / T(4);
  // Groups of 4, interleaved, plus singletons (ids 7 and 8).
  std::vector<std::int32_t> group(static_cast<std::size_t>(rows));
  for (Eigen::Index i = 0; i < rows; ++i)
    group[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(i % 7);
  group[28] = 7;
  group[29] = 8;
  const double eps = 1e-6;
  std::vector<T> scores(static_cast<std::size_t>(rows));
  for (Eigen::Index i = 0; i < rows; ++i)
    scores[static_cast<std::size_t>(i)] = rewards.row(i).sum();
  for (const auto estimator : {k::OutcomeEstimator::grpo, k::OutcomeEstimator::grpo_mean_only,
                               k::OutcomeEstimator::rloo, k::OutcomeEstimator::rloo_vectorized}) {
    CAPTURE(static_cast<int>(estimator));
    std::vector<T> scalars(static_cast<std::size_t>(rows));
    for (std::int32_t g = 0; g < 9; ++g) {
      std::vector<long> members;
      for (long i = 0; i < rows; ++i)
        if (group[static_cast<std::size_t>(i)] == g) members.push_back(i);
      k::group_outcome(scores.data(), members.data(), static_cast<long>(members.size()), estimator, static_cast<T>(eps),
                       static_cast<T>(k::singleton_std_plus_epsilon(eps)), scalars.data());
    }
    mrr::RowMatrix<T> want(rows, cols);
    for (Eigen::Index i = 0; i < rows; ++i)
      for (Eigen::Index j = 0; j < cols; ++j)
        want(i, j) = k::outcome_token(scalars[static_cast<std::size_t>(i)], m(i, j));
    CHECK(count_far(Executor::template outcome<T>(estimator, rewards, m, group, eps), want, 0) == 0);
  }
}

template <class Executor, class T>
void check_row_mean() {
  const Eigen::Index rows = 9, cols = 513;
  auto values = normal<T>(rows, cols, 6);
  const auto m = response_mask<T>(rows, cols);
  values(0, cols - 1) = std::numeric_limits<T>::quiet_NaN();  // masked: stays out
  mrr::RowMatrix<T> want(rows, 1);
  for (Eigen::Index i = 0; i < rows; ++i) {
    double sum = 0, count = 0;
    for (Eigen::Index j = 0; j < cols; ++j)
      if (m(i, j) != T(0)) sum += static_cast<double>(values(i, j)), count += 1;
    want(i, 0) = static_cast<T>(sum / (count + 1e-8));
  }
  // The host sums in T (verl's float tensor), the Thrust path in double: both within a few ulps
  // of T of the double-precision mean.
  CHECK(count_far(Executor::template row_mean<T>(values, m), want, 4, tol<T>(2e-5, 1e-13)) == 0);
}

template <class Executor, class T>
void check_vanilla() {
  const Eigen::Index rows = 11, cols = 257;
  const auto old = normal<T>(rows, cols, 7, 0.5);
  auto lp = normal<T>(rows, cols, 8, 0.5);
  auto adv = normal<T>(rows, cols, 9);
  const auto m = response_mask<T>(rows, cols);
  lp(0, 0) = old(0, 0);                                   // ratio 1
  lp(1, 1) = old(1, 1) + T(0.1823216);                    // near the upper clip
  adv(2, 2) = T(0);                                       // ties of max and min
  lp(3, cols - 1) = std::numeric_limits<T>::quiet_NaN();  // masked padding
  mrr::ppo::PolicyLossConfig config;
  config.clip_ratio_low = 0.2;
  config.clip_ratio_high = 0.28;
  for (const auto mode : {mrr::ppo::LossAggMode::token_mean, mrr::ppo::LossAggMode::seq_mean_token_mean}) {
    CAPTURE(mrr::ppo::to_string(mode));
    const auto [loss, grad] = Executor::template vanilla<T>(old, lp, adv, m, mode, config);
    // The reference: vanilla_row per row, the aggregation's row weights, aggregated_grad.
    mrr::RowMatrix<T> token_grad(rows, cols), sums(rows, k::kVanillaRowSums);
    mrr::Vector<T> tokens(rows);
    for (Eigen::Index i = 0; i < rows; ++i) {
      REQUIRE(k::vanilla_row<T>(lp.row(i).data(), old.row(i).data(), adv.row(i).data(), m.row(i).data(), nullptr,
                                token_grad.row(i).data(), cols, T(0.8), T(1.28), T(3),
                                sums.row(i).data()) == k::Status::ok);
      tokens[i] = sums(i, k::kRowTokens);
    }
    const auto weights = mrr::ppo::detail::aggregation_row_weights_from_counts<T>(
        tokens, static_cast<double>(tokens.sum()), cols, mode, config.global_batch_info, "test");
    mrr::RowMatrix<T> want(rows, cols);
    for (Eigen::Index i = 0; i < rows; ++i)
      for (Eigen::Index j = 0; j < cols; ++j)
        want(i, j) = k::aggregated_grad(token_grad(i, j), m(i, j), weights[i]);
    CHECK(count_far(grad, want, Executor::vanilla_gradient_ulps) == 0);
    const T want_loss = mrr::ppo::detail::aggregate_row_sums<T>(sums.data() + k::kRowLoss, k::kVanillaRowSums, weights,
                                                                mode, config.global_batch_info);
    // The Thrust path runs vanilla_row; the host sums each row in chunks of Eigen packets, within
    // the rounding of a sum of |terms| (the terms cancel: random advantages).
    double magnitude = 0;
    for (Eigen::Index i = 0; i < rows; ++i)
      for (Eigen::Index j = 0; j < cols; ++j)
        if (m(i, j) != T(0))
          magnitude += std::abs(static_cast<double>(
              k::vanilla_token(lp(i, j), old(i, j), adv(i, j), T(0.8), T(1.28), T(3)).loss * weights[i]));
    if (Executor::sequential_loss)
      CHECK(loss == want_loss);
    else
      CHECK(std::abs(static_cast<double>(loss - want_loss)) <=
            32 * static_cast<double>(std::numeric_limits<T>::epsilon()) * magnitude);
  }
}

}  // namespace

TEST_CASE_TEMPLATE("PPO kernels per executor: KL estimators (values, gradients, straight-through)", E,
                   MRR_PPO_EXECUTORS) {
  INFO("executor: " << E::name);
  check_kl<E, float>();
  check_kl<E, double>();
}

TEST_CASE_TEMPLATE("PPO kernels per executor: GAE (gae_row's returns, whitened advantages)", E, MRR_PPO_EXECUTORS,
                   ThrustScan) {
  INFO("executor: " << E::name);
  check_gae<E, float>();
  check_gae<E, double>();
}

TEST_CASE_TEMPLATE("PPO kernels per executor: grpo, Dr.GRPO, rloo, rloo_vectorized scalars bit for bit", E,
                   MRR_PPO_EXECUTORS) {
  INFO("executor: " << E::name);
  check_outcome<E, float>();
  check_outcome<E, double>();
}

TEST_CASE_TEMPLATE("PPO kernels per executor: masked row mean (NaN under the mask stays out)", E, MRR_PPO_EXECUTORS) {
  INFO("executor: " << E::name);
  check_row_mean<E, float>();
  check_row_mean<E, double>();
}

TEST_CASE_TEMPLATE("PPO kernels per executor: vanilla policy loss and gradient against vanilla_row", E,
                   MRR_PPO_EXECUTORS) {
  INFO("executor: " << E::name);
  check_vanilla<E, float>();
  check_vanilla<E, double>();
}
