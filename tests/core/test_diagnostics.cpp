// mrr/diagnostics.hpp against cases computed by hand.
#include <mrr/diagnostics.hpp>
#include <mrr/replay/memory_store.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <vector>

namespace {

mrr::ExpertIds ids(std::initializer_list<std::initializer_list<int>> rows) {
  mrr::ExpertIds m(static_cast<Eigen::Index>(rows.size()), static_cast<Eigen::Index>(rows.begin()->size()));
  Eigen::Index r = 0;
  for (const auto& row : rows) {
    Eigen::Index c = 0;
    for (const int v : row) m(r, c++) = v;
    ++r;
  }
  return m;
}

}  // namespace

TEST_CASE("routing mismatch: sets, not slot order; per layer, per token; skipped rows") {
  // 4 rows, k = 2, 2 layers; row 3 is padding (not compared) and differs everywhere.
  const auto a0 = ids({{1, 2}, {0, 3}, {4, 5}, {6, 7}}), b0 = ids({{2, 1}, {0, 4}, {4, 5}, {0, 1}});
  const auto a1 = ids({{5, 6}, {1, 2}, {3, 4}, {6, 7}}), b1 = ids({{7, 8}, {2, 1}, {3, 4}, {0, 1}});
  const std::vector<std::uint8_t> compare{1, 1, 1, 0};
  mrr::RoutingMismatchCounter c(2, 4, compare);
  c.add_layer(0, a0, b0);
  c.add_layer(1, a1, b1);
  const auto m = c.result();
  CHECK(m.decisions == 6);
  CHECK(m.differing == 2);            // (row 1, layer 0) and (row 0, layer 1); row 0 layer 0 is a reorder
  CHECK(m.experts == 12);
  CHECK(m.differing_experts == 3);    // 1 + 2
  CHECK(m.tokens == 3);
  CHECK(m.differing_tokens == 2);
  CHECK(m.differing_layer_sum == 2);
  CHECK(m.decision_fraction() == doctest::Approx(2.0 / 6));
  CHECK(m.token_fraction() == doctest::Approx(2.0 / 3));
  CHECK(m.mean_differing_layers() == doctest::Approx(2.0 / 3));
  CHECK(m.mean_differing_layers_of_differing_tokens() == doctest::Approx(1.0));
  CHECK(m.layer_fraction(0) == doctest::Approx(1.0 / 3));
  CHECK(m.layer_fraction(1) == doctest::Approx(1.0 / 3));

  // Counts survive a round trip and merge: the two halves of the rows add up to the whole.
  CHECK(mrr::RoutingMismatch::from_counts(m.counts()).counts() == m.counts());
  mrr::RoutingMismatchCounter top(2, 2), bottom(2, 1);
  top.add_layer(0, a0.topRows(2), b0.topRows(2));
  top.add_layer(1, a1.topRows(2), b1.topRows(2));
  bottom.add_layer(0, a0.middleRows(2, 1), b0.middleRows(2, 1));
  bottom.add_layer(1, a1.middleRows(2, 1), b1.middleRows(2, 1));
  auto merged = top.result();
  merged += bottom.result();
  CHECK(merged.counts() == m.counts());
}

TEST_CASE("routing mismatch against a store: only rows with a recorded route count") {
  mrr::MemoryRouteStore store({8, 1, 2});
  // Sequence 7 positions 0..1 recorded; position 2 never was (vLLM's missing last token).
  const mrr::TokenLayout recorded({{7, 0}, {7, 1}});
  store.record(0, recorded, ids({{1, 2}, {3, 4}}));
  const mrr::TokenLayout batch({{7, 0}, {7, 1}, {7, 2}});
  mrr::RoutingMismatchCounter c(1, 3);
  mrr::add_layer_against_store(c, store, 0, batch, ids({{2, 1}, {3, 5}, {6, 7}}));
  const auto m = c.result();
  CHECK(m.decisions == 2);
  CHECK(m.differing == 1);
  CHECK(m.tokens == 2);  // the row without a route is not a token compared
  CHECK(m.differing_tokens == 1);
}

TEST_CASE("log-prob divergence: k1, k3, F(tau) and quantiles by hand") {
  const std::vector<double> p{-1, -2, -0.5, -3, -9}, q{-1, -1, -0.5, -0.2, -1}, mask{1, 1, 1, 1, 0};
  const std::vector<double> taus{2.0, 5.0};
  const auto d = mrr::logprob_divergence<double>(p, q, mask, taus);
  // d = p - q = {0, -1, 0, -2.8}; the fifth token is masked.
  CHECK(d.tokens == 4);
  CHECK(d.k1 == doctest::Approx(-3.8 / 4));
  // k3 per token: q/p - log(q/p) - 1, capped at 10 as verl's low_var_kl caps it:
  // e - 2 for d = -1; e^2.8 - 3.8 = 12.64 for d = -2.8, capped to 10.
  CHECK(d.k3 == doctest::Approx((std::exp(1.0) - 2.0 + 10.0) / 4));
  CHECK(d.mean_abs == doctest::Approx(3.8 / 4));
  CHECK(d.F(2.0) == doctest::Approx(0.5));   // |d| > log 2: 1 and 2.8
  CHECK(d.F(5.0) == doctest::Approx(0.25));  // |d| > log 5: 2.8
  CHECK(d.p50_abs == 0.0);                   // sorted {0, 0, 1, 2.8}: the 2nd
  CHECK(d.p99_abs == doctest::Approx(2.8));  // the 4th
  CHECK(d.max_abs == doctest::Approx(2.8));
  CHECK_THROWS_WITH_AS(d.F(3.0), doctest::Contains("not among the thresholds"), mrr::InvalidArgument);
  // The same engine twice: everything is zero.
  const auto same = mrr::logprob_divergence<double>(p, p, {}, taus);
  CHECK(same.tokens == 5);
  CHECK(same.k3 == 0.0);
  CHECK(same.F(2.0) == 0.0);
}

TEST_CASE("diagnostics refuse bad input with the argument named") {
  const std::vector<float> a{-1.f, -2.f}, b{-1.f};
  CHECK_THROWS_WITH_AS(mrr::logprob_divergence<float>(a, b, {}), doctest::Contains("'log_q' 1"), mrr::InvalidArgument);
  const std::vector<double> taus{1.0};
  CHECK_THROWS_WITH_AS(mrr::logprob_divergence<float>(a, a, {}, taus), doctest::Contains("must be > 1"),
                       mrr::InvalidArgument);
  const std::vector<float> bad{-1.f, -INFINITY};
  CHECK_THROWS_WITH_AS(mrr::logprob_divergence<float>(bad, a, {}), doctest::Contains("token 1"), mrr::InvalidArgument);
  mrr::RoutingMismatchCounter c(2, 2);
  CHECK_THROWS_WITH_AS(c.add_layer(2, ids({{1, 2}, {3, 4}}), ids({{1, 2}, {3, 4}})), doctest::Contains("layer 2"),
                       mrr::InvalidArgument);
  CHECK_THROWS_WITH_AS(c.add_layer(0, ids({{1, 2}}), ids({{1, 2}})), doctest::Contains("for 2 rows"),
                       mrr::InvalidArgument);
  // Rows that are not routings (k - |a ∩ b| counts sets): a repeat gave -2 differing experts, and
  // [1, 2] against [1, 1] "no difference"; a store's -1 (no route) likewise. Nothing is counted.
  CHECK_THROWS_WITH_AS(c.add_layer(0, ids({{3, 4}, {3, 3}}), ids({{3, 4}, {3, 3}})),
                       doctest::Contains("layer 0, row 1: 'a' has ids [3 3], not a routing"), mrr::InvalidArgument);
  CHECK_THROWS_WITH_AS(c.add_layer(0, ids({{1, 2}, {3, 4}}), ids({{1, 1}, {3, 4}})),
                       doctest::Contains("row 0: 'b' has ids [1 1]"), mrr::InvalidArgument);
  CHECK_THROWS_WITH_AS(c.add_layer(0, ids({{-1, -1}, {3, 4}}), ids({{-1, -1}, {3, 4}})),
                       doctest::Contains("row 0: 'a' has ids [-1 -1]"), mrr::InvalidArgument);
  CHECK(c.result().decisions == 0);
  // Skipped rows may hold anything.
  const std::vector<std::uint8_t> found{0, 1};
  c.add_layer(0, ids({{-1, -1}, {3, 4}}), ids({{-1, -1}, {3, 5}}), found);
  CHECK(c.result().decisions == 1);
  CHECK(c.result().differing == 1);
  // Each layer once: a second add would count its tokens twice.
  CHECK_THROWS_WITH_AS(c.add_layer(0, ids({{1, 2}, {3, 4}}), ids({{1, 2}, {3, 4}})),
                       doctest::Contains("layer 0 was already added"), mrr::InvalidArgument);
  CHECK(c.result().decisions == 1);
  CHECK_THROWS_WITH_AS(c.result().layer_fraction(2), doctest::Contains("layer 2 outside [0, 2)"), mrr::InvalidArgument);
  CHECK_THROWS_WITH_AS(c.result().layer_fraction(-1), doctest::Contains("outside"), mrr::InvalidArgument);
  CHECK_THROWS_WITH_AS(mrr::RoutingMismatchCounter(1, -1), doctest::Contains("rows must be >= 0, got -1"),
                       mrr::InvalidArgument);
}
