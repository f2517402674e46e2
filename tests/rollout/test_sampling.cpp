#include <mrr/rollout/sampling.hpp>

#include "support/random.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

using mrr::RowMatrix;
using mrr::rollout::CounterRng;
using mrr::rollout::SamplingParams;

namespace {

// The distribution sample_token draws from: softmax(z / t) over the kept tokens, renormalised.
std::vector<double> expected_distribution(const std::vector<double>& z, const SamplingParams& p,
                                          const std::vector<std::uint8_t>& keep) {
  std::vector<double> q(z.size(), 0.0);
  double total = 0;
  for (std::size_t i = 0; i < z.size(); ++i)
    if (keep[i] != 0) total += q[i] = std::exp(z[i] / p.temperature);
  for (double& v : q) v /= total;
  return q;
}

}  // namespace

TEST_CASE("counter rng: a pure function of (seed, stream, counter), uniform on [0, 1)") {
  CHECK(CounterRng::uniform(7, 11, 3) == CounterRng::uniform(7, 11, 3));
  CHECK(CounterRng::uniform(7, 11, 3) != CounterRng::uniform(8, 11, 3));
  CHECK(CounterRng::uniform(7, 11, 3) != CounterRng::uniform(7, 12, 3));
  CHECK(CounterRng::uniform(7, 11, 3) != CounterRng::uniform(7, 11, 4));
  double sum = 0, lo = 1, hi = 0;
  const int n = 100000;
  for (int i = 0; i < n; ++i) {
    const double u = CounterRng::uniform(1, 2, static_cast<std::uint64_t>(i));
    REQUIRE(u >= 0.0);
    REQUIRE(u < 1.0);
    sum += u;
    lo = std::min(lo, u);
    hi = std::max(hi, u);
  }
  CHECK(std::abs(sum / n - 0.5) < 0.005);  // sd of the mean: 0.0009
  CHECK(lo < 1e-3);
  CHECK(hi > 1 - 1e-3);
}

TEST_CASE("sample: deterministic per seed, independent of the batch a row is drawn in") {
  const RowMatrix<float> logits = mrr::test::random_normal<float>(6, 12, 5, 2.f);
  const SamplingParams p{.temperature = 0.9, .top_k = 8, .top_p = 0.95};
  const std::vector<std::uint64_t> streams = {10, 11, 12, 13, 14, 15};
  const std::vector<std::int64_t> counters = {3, 3, 4, 4, 5, 5};
  const auto a = mrr::rollout::sample<float>(logits, p, 42, streams, counters);
  const auto b = mrr::rollout::sample<float>(logits, p, 42, streams, counters);
  for (std::size_t i = 0; i < a.size(); ++i) {
    CHECK(a[i].token == b[i].token);
    CHECK(a[i].logprob == b[i].logprob);
  }
  // Row 4 alone gives the row's token of the batch.
  const RowMatrix<float> row = logits.row(4);
  const std::vector<std::uint64_t> s4 = {14};
  const std::vector<std::int64_t> c4 = {5};
  CHECK(mrr::rollout::sample<float>(row, p, 42, s4, c4)[0].token == a[4].token);
  // Over many seeds, another seed gives another sequence of tokens.
  int differ = 0;
  for (std::uint64_t seed = 0; seed < 20; ++seed) {
    const auto c = mrr::rollout::sample<float>(logits, p, seed + 100, streams, counters);
    for (std::size_t i = 0; i < a.size(); ++i) differ += c[i].token != a[i].token;
  }
  CHECK(differ > 20);
}

TEST_CASE("sampling_mask: top-k keeps the k largest and their ties (vLLM), top-p the smallest prefix reaching p") {
  const std::vector<float> z = {1.f, 3.f, 2.f, 3.f, 0.f, -1.f};
  std::vector<std::uint8_t> keep;
  CHECK(mrr::rollout::sampling_mask(z.data(), 6, SamplingParams{.top_k = 2}, keep) == 2);
  CHECK(keep == std::vector<std::uint8_t>{0, 1, 0, 1, 0, 0});
  CHECK(mrr::rollout::sampling_mask(z.data(), 6, SamplingParams{.top_k = 3}, keep) == 3);
  CHECK(keep == std::vector<std::uint8_t>{0, 1, 1, 1, 0, 0});
  // A tie with the k-th largest is kept, as vLLM's mask (logits < k-th value) keeps it.
  CHECK(mrr::rollout::sampling_mask(z.data(), 6, SamplingParams{.top_k = 1}, keep) == 2);
  CHECK(keep == std::vector<std::uint8_t>{0, 1, 0, 1, 0, 0});
  const std::vector<float> tied = {3.f, 2.f, 2.f, 0.f};
  CHECK(mrr::rollout::sampling_mask(tied.data(), 4, SamplingParams{.top_k = 2}, keep) == 3);
  CHECK(keep == std::vector<std::uint8_t>{1, 1, 1, 0});
  // A temperature below vLLM's 1e-5 is greedy (dividing by it overflows): the argmax, not NaN.
  for (const double t : {1e-310, 1e-300, 5e-6}) {
    CAPTURE(t);
    const std::vector<double> zz = {1.0, 2.0, 0.0};
    const auto s = mrr::rollout::sample_token(zz.data(), 3, SamplingParams{.temperature = t}, 0.999);
    CHECK(s.token == 1);
    CHECK(std::isfinite(s.logprob));
  }
  // Greedy: the argmax alone, the lower index on a tie.
  CHECK(mrr::rollout::sampling_mask(z.data(), 6, SamplingParams{.temperature = 0.0}, keep) == 1);
  CHECK(keep == std::vector<std::uint8_t>{0, 1, 0, 0, 0, 0});

  // top-p against a brute-force prefix: probabilities in descending order p(1) >= p(3) > p(2) > ...
  std::vector<double> probs(6);
  double total = 0;
  for (int i = 0; i < 6; ++i) total += probs[i] = std::exp(static_cast<double>(z[i]));
  for (double& v : probs) v /= total;
  const int order[6] = {1, 3, 2, 0, 4, 5};
  for (double top_p : {0.1, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0}) {
    int expected = 0;
    double mass = 0;
    while (expected < 6 && (expected == 0 || mass < top_p)) mass += probs[order[expected++]];
    const int kept = mrr::rollout::sampling_mask(z.data(), 6, SamplingParams{.top_p = top_p}, keep);
    CHECK_MESSAGE(kept == expected, "top_p=", top_p);
    for (int r = 0; r < 6; ++r) CHECK(keep[order[r]] == (r < expected ? 1 : 0));
  }
  // By hand: p = {.053, .389, .143, .389, .019, .007}.
  CHECK(mrr::rollout::sampling_mask(z.data(), 6, SamplingParams{.top_p = 0.3}, keep) == 1);
  CHECK(keep == std::vector<std::uint8_t>{0, 1, 0, 0, 0, 0});
  CHECK(mrr::rollout::sampling_mask(z.data(), 6, SamplingParams{.top_p = 0.8}, keep) == 3);
  CHECK(keep == std::vector<std::uint8_t>{0, 1, 1, 1, 0, 0});
  // Both: top-k first, then top-p among the survivors (renormalised).
  CHECK(mrr::rollout::sampling_mask(z.data(), 6, SamplingParams{.top_k = 3, .top_p = 0.75}, keep) == 2);
  // -inf logits are never kept.
  const std::vector<float> masked = {-INFINITY, 0.f, -INFINITY, 1.f};
  CHECK(mrr::rollout::sampling_mask(masked.data(), 4, SamplingParams{}, keep) == 2);
  CHECK(keep == std::vector<std::uint8_t>{0, 1, 0, 1});
  CHECK_THROWS_AS(mrr::rollout::sampling_mask(z.data(), 6, SamplingParams{.top_p = 0.0}, keep), mrr::InvalidArgument);
  const std::vector<float> bad = {0.f, NAN};
  CHECK_THROWS_AS(mrr::rollout::sampling_mask(bad.data(), 2, SamplingParams{}, keep), mrr::InvalidArgument);
}

TEST_CASE("sample_token: the empirical distribution matches the filtered softmax (chi-square bound)") {
  const std::vector<double> zd = {0.5, -0.3, 1.2, 0.0, -1.0, 0.8, 2.0, -2.5, 0.1, 0.4};
  std::vector<float> z(zd.begin(), zd.end());
  const int vocab = static_cast<int>(z.size());
  for (const SamplingParams p : {SamplingParams{}, SamplingParams{.temperature = 0.7},
                                 SamplingParams{.temperature = 1.3, .top_k = 5},
                                 SamplingParams{.temperature = 1.0, .top_p = 0.8},
                                 SamplingParams{.temperature = 0.8, .top_k = 6, .top_p = 0.9}}) {
    std::vector<std::uint8_t> keep;
    const int kept = mrr::rollout::sampling_mask(z.data(), vocab, p, keep);
    std::vector<double> zf(z.begin(), z.end());
    const auto q = expected_distribution(zf, p, keep);
    const int n = 40000;
    std::vector<int> counts(static_cast<std::size_t>(vocab), 0);
    for (int i = 0; i < n; ++i) {
      const auto s = mrr::rollout::sample_token(z.data(), vocab, p, CounterRng::uniform(9, 1, static_cast<std::uint64_t>(i)));
      REQUIRE(keep[static_cast<std::size_t>(s.token)] == 1);  // filtered tokens are never drawn
      ++counts[static_cast<std::size_t>(s.token)];
      // log-probs: of the full tempered softmax and of the filtered one
      CHECK(s.sampling_logprob == doctest::Approx(std::log(q[static_cast<std::size_t>(s.token)])).epsilon(1e-5));
    }
    double chi2 = 0;
    for (int i = 0; i < vocab; ++i)
      if (keep[static_cast<std::size_t>(i)] != 0) {
        const double e = n * q[static_cast<std::size_t>(i)];
        chi2 += (counts[static_cast<std::size_t>(i)] - e) * (counts[static_cast<std::size_t>(i)] - e) / e;
      }
    // 99.9% quantile of chi-square with kept - 1 <= 9 degrees of freedom is at most 27.9.
    INFO("temperature ", p.temperature, " top_k ", p.top_k, " top_p ", p.top_p, " chi2 ", chi2);
    CHECK(chi2 < 27.9);
    // and a skewed distribution is detected: the uniform one fails the same bound
    double chi2_uniform = 0;
    for (int i = 0; i < vocab; ++i)
      if (keep[static_cast<std::size_t>(i)] != 0) {
        const double e = static_cast<double>(n) / kept;
        chi2_uniform += (counts[static_cast<std::size_t>(i)] - e) * (counts[static_cast<std::size_t>(i)] - e) / e;
      }
    if (kept > 1) CHECK(chi2_uniform > 27.9);
  }
}

TEST_CASE("logprobs_from_logits: log_softmax(z / t)[label], gradient by finite differences") {
  const RowMatrix<double> logits = mrr::test::random_normal<double>(5, 7, 3, 1.5);
  const std::vector<std::int32_t> labels = {0, 6, 3, 3, 1};
  for (double t : {1.0, 0.6}) {
    const mrr::Vector<double> lp = mrr::rollout::logprobs_from_logits<double>(logits, labels, t);
    for (Eigen::Index r = 0; r < 5; ++r) {
      const double lse = std::log((logits.row(r).array() / t).exp().sum());
      CHECK(lp[r] == doctest::Approx(logits(r, labels[static_cast<std::size_t>(r)]) / t - lse).epsilon(1e-12));
    }
    const mrr::Vector<double> g = mrr::test::random_normal<double>(5, 1, 4);
    const RowMatrix<double> grad = mrr::rollout::logprobs_from_logits_backward<double>(logits, labels, g, t);
    const double h = 1e-6;
    for (Eigen::Index r = 0; r < 5; ++r)
      for (Eigen::Index c = 0; c < 7; ++c) {
        RowMatrix<double> plus = logits, minus = logits;
        plus(r, c) += h;
        minus(r, c) -= h;
        const double numeric = (g.dot(mrr::rollout::logprobs_from_logits<double>(plus, labels, t)) -
                                g.dot(mrr::rollout::logprobs_from_logits<double>(minus, labels, t))) /
                               (2 * h);
        CHECK(grad(r, c) == doctest::Approx(numeric).epsilon(1e-6));
      }
  }
  // sample_token's logprob is the trainer's logprobs_from_logits of the drawn token.
  const RowMatrix<float> lf = logits.cast<float>();
  const SamplingParams p{.temperature = 0.6, .top_k = 4};
  const auto s = mrr::rollout::sample_token(&lf(2, 0), 7, p, 0.37);
  const std::vector<std::int32_t> one = {s.token};
  const RowMatrix<float> row = lf.row(2);
  CHECK(s.logprob == doctest::Approx(mrr::rollout::logprobs_from_logits<float>(row, one, 0.6)[0]).epsilon(1e-5));
  CHECK_THROWS_AS(mrr::rollout::logprobs_from_logits<double>(logits, std::vector<std::int32_t>{0, 1}),
                  mrr::InvalidArgument);
  // What has no softmax is an error in the forward and the backward alike, never NaN.
  const std::vector<std::int32_t> first = {0};
  const mrr::Vector<float> g1 = mrr::Vector<float>::Ones(1);
  const RowMatrix<float> all_masked = RowMatrix<float>::Constant(1, 3, -INFINITY);
  CHECK_THROWS_WITH_AS(mrr::rollout::logprobs_from_logits<float>(all_masked, first),
                       doctest::Contains("every logit -inf"), mrr::InvalidArgument);
  CHECK_THROWS_WITH_AS(mrr::rollout::logprobs_from_logits_backward<float>(all_masked, first, g1),
                       doctest::Contains("every logit -inf"), mrr::InvalidArgument);
  RowMatrix<float> nan_row = RowMatrix<float>::Zero(1, 3);
  nan_row(0, 2) = NAN;
  CHECK_THROWS_WITH_AS(mrr::rollout::logprobs_from_logits_backward<float>(nan_row, first, g1),
                       doctest::Contains("logit 2 is nan"), mrr::InvalidArgument);
  // A temperature the logits' type cannot divide by (1 / 1e-40 is inf in float; 1 / 1e300 is 0).
  const RowMatrix<float> plain = RowMatrix<float>::Zero(1, 3);
  CHECK_THROWS_WITH_AS(mrr::rollout::logprobs_from_logits<float>(plain, first, 1e-40),
                       doctest::Contains("outside what the logits' type can divide by"), mrr::InvalidArgument);
  CHECK_THROWS_WITH_AS(mrr::rollout::logprobs_from_logits<float>(plain, first, 1e300),
                       doctest::Contains("outside what the logits' type can divide by"), mrr::InvalidArgument);
  const RowMatrix<double> huge = RowMatrix<double>::Constant(1, 3, 1e300);
  CHECK_THROWS_WITH_AS(mrr::rollout::logprobs_from_logits<double>(huge, first, 1e-10), doctest::Contains("overflows"),
                       mrr::InvalidArgument);
}
