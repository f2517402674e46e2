// mrr/thrust/diagnostics.hpp on Thrust's OpenMP system, on buffers the test owns, against the host
// functions of mrr/diagnostics.hpp (the body is diagnostics_body.hpp, which tests/cuda runs on CUDA).
#include "diagnostics_body.hpp"
#include "diagnostics_cases.hpp"
#include "host_memory.hpp"

#include <doctest/doctest.h>

#include <vector>

using mrr::test::HostMemory;

TEST_CASE("device diagnostics: a hand-computed case") {
  // 4 rows, k = 2, 2 layers (the case of tests/core/test_diagnostics.cpp); row 3 is not compared.
  mrr::test::DiagnosticsInputs in;
  in.layers = 2, in.k = 2, in.rows = 4, in.stride_a = 2, in.stride_b = 2;
  in.a = {{1, 2, 0, 3, 4, 5, 6, 7}, {5, 6, 1, 2, 3, 4, 6, 7}};
  in.b = {{2, 1, 0, 4, 4, 5, 0, 1}, {7, 8, 2, 1, 3, 4, 0, 1}};
  in.compare = {1, 1, 1, 0};
  in.lp_rows = 2, in.lp_cols = 3, in.lp_stride = 3;
  // |d| = 0.1, 1.0, 2.0 (log 5 = 1.61 < 2), masked, 0, masked.
  in.log_p = {-1.0f, -2.0f, -0.5f, -1.0f, -0.25f, -3.0f};
  in.log_q = {-1.1f, -1.0f, -2.5f, -9.0f, -0.25f, -3.0f};
  in.mask = {1, 1, 1, 0, 1, 0};
  in.thresholds = {2.0, 5.0};
  const auto got = mrr::test::run_device_diagnostics<HostMemory>(in);
  const auto& m = got.mismatch;
  CHECK(m.decisions == 6);
  CHECK(m.differing == 2);  // (row 1, layer 0) and (row 0, layer 1); row 0 layer 0 is a reorder
  CHECK(m.experts == 12);
  CHECK(m.differing_experts == 3);
  CHECK(m.tokens == 3);
  CHECK(m.differing_tokens == 2);
  CHECK(m.differing_layer_sum == 2);
  CHECK(m.layer_differing == std::vector<std::int64_t>{1, 1});
  const auto& d = got.divergence;
  CHECK(d.tokens == 4);
  CHECK(d.max_abs == doctest::Approx(2.0));
  CHECK(d.p50_abs == doctest::Approx(0.1).epsilon(1e-6));  // the 2nd smallest of {0, 0.1, 1, 2}
  CHECK(d.F(2.0) == doctest::Approx(0.5));                 // 1.0 and 2.0 > log 2
  CHECK(d.F(5.0) == doctest::Approx(0.25));                // 2.0 > log 5
  CHECK(d.k1 == doctest::Approx((0.1 - 1.0 + 2.0 + 0.0) / 4).epsilon(1e-6));
  mrr::test::check_diagnostics(in, got);
}

TEST_CASE("device diagnostics: a compared row that is not a routing (-1, a repeat) is an error, a skipped one is not") {
  mrr::test::DiagnosticsInputs in;
  in.layers = 2, in.k = 2, in.rows = 3, in.stride_a = 2, in.stride_b = 2;
  in.a = {{1, 2, 0, 3, -1, -1}, {5, 6, 1, 2, 3, 3}};  // row 2: no route (layer 0), a repeat (layer 1)
  in.b = {{2, 1, 0, 4, -1, -1}, {7, 1, 2, 1, 3, 3}};
  in.compare = {1, 1, 0};
  in.lp_rows = 1, in.lp_cols = 1, in.lp_stride = 1;
  in.log_p = {-1.0f}, in.log_q = {-1.0f}, in.mask = {1};
  const auto skipped = mrr::test::run_device_diagnostics<HostMemory>(in);
  CHECK(skipped.mismatch.decisions == 4);
  in.compare = {1, 1, 1};
  CHECK_THROWS_WITH_AS(mrr::test::run_device_diagnostics<HostMemory>(in),
                       doctest::Contains("layer 0: 1 compared rows are not routings"), mrr::InvalidArgument);
}

TEST_CASE("device diagnostics: 48 layers, 128 experts, top-8, 20,000 rows; 64 x 1,500 log-probs") {
  const auto in = mrr::test::diagnostics_inputs(48, 20000, 8, 128, 64, 1500, 7);
  mrr::test::check_diagnostics(in, mrr::test::run_device_diagnostics<HostMemory>(in));
}

TEST_CASE("device diagnostics: odd sizes (one row, blocks not filled) and top-1") {
  for (const long rows : {1L, 63L, 65L, 1000L}) {
    CAPTURE(rows);
    const auto in = mrr::test::diagnostics_inputs(3, rows, 1, 4, 3, 257, 11 + static_cast<unsigned>(rows), 0.4);
    mrr::test::check_diagnostics(in, mrr::test::run_device_diagnostics<HostMemory>(in));
  }
}
