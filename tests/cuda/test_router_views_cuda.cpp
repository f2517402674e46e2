// The device router's view API on CUDA: the OpenMP test's body (tests/device/router_views_body.hpp)
// on cudaMalloc buffers, against the CPU router. Exits 77 (ctest: skipped) without a GPU.
#define DOCTEST_CONFIG_IMPLEMENT
#include "../device/count_allocations.hpp"
#include "../device/diagnostics_cases.hpp"
#include "../device/router_views_cases.hpp"
#include "device_routing.hpp"
#include "diagnostics_cuda.hpp"
#include "router_views_cuda.hpp"

#include <doctest/doctest.h>

#include <cstdio>

TEST_CASE("cuda views: route / replay / backward on caller buffers equal the CPU router, allocate nothing") {
  for (const auto& config : mrr::test::router_view_configs()) {
    CAPTURE(config.num_experts);
    CAPTURE(config.topk);
    mrr::test::check_report(
        mrr::test::cuda_router_views(mrr::test::router_view_inputs(config, 67, 7), &mrr::test::allocations));
  }
}

// The device diagnostics (mrr/thrust/diagnostics.hpp) against the host functions, bit for bit.
TEST_CASE("cuda diagnostics: 48 layers, 128 experts, top-8; log-probs with a mask; odd sizes") {
  const auto in = mrr::test::diagnostics_inputs(48, 20000, 8, 128, 64, 1500, 7);
  mrr::test::check_diagnostics(in, mrr::test::cuda_diagnostics(in));
  for (const long rows : {1L, 65L, 70000L}) {
    CAPTURE(rows);
    const auto odd = mrr::test::diagnostics_inputs(3, rows, 1, 4, 3, 257, 11 + static_cast<unsigned>(rows), 0.4);
    mrr::test::check_diagnostics(odd, mrr::test::cuda_diagnostics(odd));
  }
}

#include "gpu_test_main.hpp"
