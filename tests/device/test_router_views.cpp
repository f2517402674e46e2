// The device router's view API on Thrust's OpenMP system, on buffers the test owns (the body is
// tests/device/router_views_body.hpp, which tests/cuda runs on CUDA): strided rows, int32 and int64
// ids, bf16 logits, replay with and without a mask, the backward from ids, the status buffer and
// its checks, and no allocation once the workspace is given (operator new is counted here).
#include <mrr/router.hpp>

#include "count_allocations.hpp"
#include "host_memory.hpp"
#include "router_views_body.hpp"
#include "router_views_cases.hpp"

#include <doctest/doctest.h>

#include <vector>

using mrr::test::HostMemory;

TEST_CASE("device views: route / replay / backward on caller buffers equal the CPU router, allocate nothing") {
  for (const auto& config : mrr::test::router_view_configs()) {
    CAPTURE(config.num_experts);
    CAPTURE(config.topk);
    mrr::test::check_report(mrr::test::run_router_view_checks<HostMemory>(mrr::test::router_view_inputs(config, 67, 7),
                                                                          &mrr::test::allocations));
  }
}

TEST_CASE("device views: bad shapes and a capacity config are clear errors") {
  const mrr::device::TopKRouter<float> router(mrr::presets::mixtral(8, 2));
  std::vector<float> z(4 * 8, 0.f), w(4 * 2);
  std::vector<std::int32_t> ids(4 * 2);
  std::vector<std::uint8_t> status(4);
  using mrr::device::MatrixView;
  const mrr::device::Workspace none{};
  CHECK_THROWS_WITH_AS(
      router.route(mrr::device::Execution{}, MatrixView<const float>(z.data(), 4, 7),
                   MatrixView<std::int32_t>(ids.data(), 4, 2), MatrixView<float>(w.data(), 4, 2), status.data(), none),
      doctest::Contains("'logits' has shape [4, 7], expected [4, 8]"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(
      router.route(mrr::device::Execution{}, MatrixView<const float>(z.data(), 4, 8, 4),
                   MatrixView<std::int32_t>(ids.data(), 4, 2), MatrixView<float>(w.data(), 4, 2), status.data(), none),
      doctest::Contains("row stride 4 for 8 columns"), std::invalid_argument);
  // A negative row count is an error, not an empty batch that reports success.
  CHECK_THROWS_WITH_AS(router.route(mrr::device::Execution{}, MatrixView<const float>(z.data(), -3, 8),
                                    MatrixView<std::int32_t>(ids.data(), -3, 2), MatrixView<float>(w.data(), -3, 2),
                                    status.data(), none),
                       doctest::Contains("'logits' has shape [-3, 8]: a negative extent"), std::invalid_argument);
  const std::vector<std::int32_t> replayed(4 * 2, 0);
  CHECK_THROWS_WITH_AS(router.replay(mrr::device::Execution{}, MatrixView<const float>(z.data(), -3, 8),
                                     MatrixView<const std::int32_t>(replayed.data(), -3, 2), nullptr,
                                     MatrixView<std::int32_t>(ids.data(), -3, 2), MatrixView<float>(w.data(), -3, 2),
                                     status.data(), none),
                       doctest::Contains("a negative extent"), std::invalid_argument);
  auto capped = mrr::presets::mixtral(8, 2);
  capped.capacity_factor = 1.0;
  const mrr::device::TopKRouter<float> dropping(capped);
  CHECK_THROWS_WITH_AS(dropping.route(mrr::device::Execution{}, MatrixView<const float>(z.data(), 4, 8),
                                      MatrixView<std::int32_t>(ids.data(), 4, 2), MatrixView<float>(w.data(), 4, 2),
                                      status.data(), none),
                       doctest::Contains("capacity_factor"), std::invalid_argument);
  // Route itself needs no workspace.
  router.route(mrr::device::Execution{}, MatrixView<const float>(z.data(), 4, 8),
               MatrixView<std::int32_t>(ids.data(), 4, 2), MatrixView<float>(w.data(), 4, 2), status.data(), none);
  CHECK(status == std::vector<std::uint8_t>(4, 0));
}
