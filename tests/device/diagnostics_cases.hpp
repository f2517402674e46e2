// Inputs for the device diagnostics (diagnostics_body.hpp) and the check against the host
// functions of mrr/diagnostics.hpp: the same counts, and the same bits for every log-prob figure.
#pragma once

#include "diagnostics_types.hpp"

#include <mrr/diagnostics.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <vector>

namespace mrr::test {

// Routings where about `flip` of the (row, layer) pairs differ (one expert replaced) and others
// are the same set in another slot order; padded rows hold junk past k; a compare mask skipping
// every 7th row and found flags missing every 11th row of odd layers; log-probs [lp_rows, lp_cols]
// in a padded buffer with a mask that ends each row early.
inline DiagnosticsInputs diagnostics_inputs(int layers, long rows, int k, int experts, long lp_rows, long lp_cols,
                                            unsigned seed, double flip = 0.1) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> u(0, 1);
  DiagnosticsInputs in;
  in.layers = layers, in.k = k, in.rows = rows, in.stride_a = k + 3, in.stride_b = k + 1;
  std::vector<int> all(static_cast<std::size_t>(experts));
  std::iota(all.begin(), all.end(), 0);
  for (int l = 0; l < layers; ++l) {
    std::vector<std::int32_t> a(static_cast<std::size_t>(rows * in.stride_a), -7);
    std::vector<std::int64_t> b(static_cast<std::size_t>(rows * in.stride_b), 1 << 20);
    std::vector<std::uint8_t> found(static_cast<std::size_t>(rows), 1);
    for (long r = 0; r < rows; ++r) {
      std::shuffle(all.begin(), all.end(), rng);  // the first k + 1 are distinct experts
      std::vector<int> row(all.begin(), all.begin() + k), other = row;
      if (u(rng) < flip)
        other[static_cast<std::size_t>(rng() % static_cast<unsigned>(k))] = all[static_cast<std::size_t>(k)];
      if (u(rng) < 0.5) std::reverse(other.begin(), other.end());  // slot order is not a decision
      for (int j = 0; j < k; ++j) {
        a[static_cast<std::size_t>(r * in.stride_a + j)] = row[static_cast<std::size_t>(j)];
        b[static_cast<std::size_t>(r * in.stride_b + j)] = other[static_cast<std::size_t>(j)];
      }
      if (l % 2 == 1 && r % 11 == 3) found[static_cast<std::size_t>(r)] = 0;
    }
    in.a.push_back(std::move(a));
    in.b.push_back(std::move(b));
    in.found.push_back(l % 2 == 1 ? std::move(found) : std::vector<std::uint8_t>{});
  }
  in.compare.assign(static_cast<std::size_t>(rows), 1);
  for (long r = 0; r < rows; r += 7)
    in.compare[static_cast<std::size_t>(r)] = 0;

  in.lp_rows = lp_rows, in.lp_cols = lp_cols, in.lp_stride = lp_cols + 5;
  const auto n = static_cast<std::size_t>(lp_rows * in.lp_stride);
  in.log_p.assign(n, std::nanf("")), in.log_q.assign(n, std::nanf("")), in.mask.assign(n, 0.0f);
  std::normal_distribution<double> z(0, 1);
  for (long r = 0; r < lp_rows; ++r) {
    const long len = lp_cols - static_cast<long>(rng() % static_cast<unsigned>(lp_cols / 2 + 1));
    for (long c = 0; c < lp_cols; ++c) {
      const auto i = static_cast<std::size_t>(r * in.lp_stride + c);
      const double lp = -std::abs(2.0 * z(rng)) - 1e-3;
      // Mostly small differences, a few beyond log 2 and log 5 (F(2), F(5)), and exact ties.
      const double d = u(rng) < 0.02 ? 2.5 * z(rng) : (u(rng) < 0.1 ? 0.0 : 0.01 * z(rng));
      in.log_p[i] = static_cast<float>(lp);
      in.log_q[i] = static_cast<float>(lp - d);
      in.mask[i] = c < len ? 1.0f : 0.0f;
      if (c >= len && u(rng) < 0.5) in.log_p[i] = std::nanf("");  // masked tokens are never read
    }
  }
  in.thresholds = {1.5, 2.0, 5.0};
  return in;
}

// Compacts a padded [rows, stride] buffer to [rows, cols].
template <class U>
std::vector<U> compact(const std::vector<U>& v, long rows, long cols, long stride) {
  std::vector<U> out;
  for (long r = 0; r < rows; ++r)
    for (long c = 0; c < cols; ++c)
      out.push_back(v[static_cast<std::size_t>(r * stride + c)]);
  return out;
}

inline RoutingMismatch host_mismatch(const DiagnosticsInputs& in) {
  RoutingMismatchCounter c(in.layers, in.rows, in.compare);
  for (int l = 0; l < in.layers; ++l) {
    const auto li = static_cast<std::size_t>(l);
    ExpertIds a(in.rows, in.k), b(in.rows, in.k);
    for (long r = 0; r < in.rows; ++r)
      for (int j = 0; j < in.k; ++j) {
        a(r, j) = in.a[li][static_cast<std::size_t>(r * in.stride_a + j)];
        b(r, j) = static_cast<std::int32_t>(in.b[li][static_cast<std::size_t>(r * in.stride_b + j)]);
      }
    c.add_layer(l, a, b,
                in.found.empty() ? std::span<const std::uint8_t>{} : std::span<const std::uint8_t>(in.found[li]));
  }
  return c.result();
}

inline void check_diagnostics(const DiagnosticsInputs& in, const DiagnosticsResults& got) {
  const RoutingMismatch want = host_mismatch(in);
  if (in.rows >= 50) {  // enough rows that both kinds occur
    CHECK(want.differing > 0);
    CHECK(want.differing < want.decisions);
  }
  CHECK(got.mismatch.decisions == want.decisions);
  CHECK(got.mismatch.differing == want.differing);
  CHECK(got.mismatch.experts == want.experts);
  CHECK(got.mismatch.differing_experts == want.differing_experts);
  CHECK(got.mismatch.tokens == want.tokens);
  CHECK(got.mismatch.differing_tokens == want.differing_tokens);
  CHECK(got.mismatch.differing_layer_sum == want.differing_layer_sum);
  CHECK(got.mismatch.layer_decisions == want.layer_decisions);
  CHECK(got.mismatch.layer_differing == want.layer_differing);

  const auto p = compact(in.log_p, in.lp_rows, in.lp_cols, in.lp_stride);
  const auto q = compact(in.log_q, in.lp_rows, in.lp_cols, in.lp_stride);
  const auto m = compact(in.mask, in.lp_rows, in.lp_cols, in.lp_stride);
  const LogProbDivergence hd = logprob_divergence<float>(p, q, m, in.thresholds);
  const LogProbDivergence& dd = got.divergence;
  CHECK(hd.tokens > 0);
  CHECK(hd.fraction_above.back() > 0);  // some tokens pass F(5)
  CHECK(dd.tokens == hd.tokens);
  CHECK(dd.k1 == hd.k1);  // the same blocks added in the same order: the same bits
  CHECK(dd.k3 == hd.k3);
  CHECK(dd.mean_abs == hd.mean_abs);
  CHECK(dd.p50_abs == hd.p50_abs);
  CHECK(dd.p99_abs == hd.p99_abs);
  CHECK(dd.max_abs == hd.max_abs);
  CHECK(dd.thresholds == hd.thresholds);
  CHECK(dd.fraction_above == hd.fraction_above);

  const std::string bad_token = "token " + std::to_string((in.lp_rows - 1) * in.lp_cols + 1) + " (row " +
                                std::to_string(in.lp_rows - 1) + ", column 1)";
  const std::vector<std::string> want_errors{"layer " + std::to_string(in.layers) + " outside",
                                             "'b' has shape",
                                             "layer 0 was already added",
                                             "workspace",
                                             bad_token,
                                             "",
                                             "must be > 1",
                                             "at most 8 thresholds",
                                             "workspace"};
  REQUIRE(got.errors.size() == want_errors.size());
  for (std::size_t i = 0; i < want_errors.size(); ++i) {
    CAPTURE(i);
    CAPTURE(got.errors[i]);
    if (want_errors[i].empty())
      CHECK(got.errors[i].empty());
    else
      CHECK(got.errors[i].find(want_errors[i]) != std::string::npos);
  }
}

}  // namespace mrr::test
