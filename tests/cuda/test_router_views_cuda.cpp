// The device router's view API on CUDA: the OpenMP test's body (tests/device/router_views_body.hpp)
// on cudaMalloc buffers, against the CPU router. Exits 77 (ctest: skipped) without a GPU.
#define DOCTEST_CONFIG_IMPLEMENT
#include "../device/count_allocations.hpp"
#include "../device/router_views_cases.hpp"
#include "device_routing.hpp"
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

#include "gpu_test_main.hpp"
