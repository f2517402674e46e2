// CPU and GPU pick identical experts from identical fp32 logits (DESIGN.md section 4): the
// device runs the same selection code, ties included. Exits 77 (ctest: skipped) without a GPU.
#define DOCTEST_CONFIG_IMPLEMENT
#include <mrr/router.hpp>

#include <doctest/doctest.h>

#include "device_routing.hpp"
#include "fused_routing_cases.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

TEST_CASE("device top-k equals TopKRouter's selection (softmax gates select on logits), ties included") {
  for (int experts : {64, 256}) {
    for (bool ties : {false, true}) {
      const auto z = logits(4096, experts, static_cast<unsigned>(experts), ties);
      mrr::TopKRouter<float> router(mrr::presets::qwen3_moe(experts, 8));
      const auto host = router.route(z);
      mrr::ExpertIds device(4096, 8);
      REQUIRE(mrr::test::device_topk(z.data(), 4096, experts, 8, device.data()) == "");
      CHECK(device == host.ids);
    }
  }
}

TEST_CASE("device selection on sigmoid + expert bias equals the host router's") {
  auto cfg = mrr::presets::megatron_deepseek_v3(64, 8, 1, 1, 1.0);
  cfg.num_groups = cfg.group_topk = 0;  // no groups: the plain biased selection
  mrr::TopKRouter<float> router(cfg);
  mrr::Vector<float> bias(64);
  std::mt19937 rng(3);
  std::normal_distribution<float> n(0.f, 0.05f);
  for (int e = 0; e < 64; ++e) bias[e] = n(rng);
  router.set_expert_bias(bias);
  const auto z = logits(2048, 64, 11, false);
  mrr::ExpertIds device(2048, 8);
  REQUIRE(mrr::test::device_biased_sigmoid_topk(z.data(), bias.data(), 2048, 64, 8, device.data()) == "");
  // The host vectorises sigmoid with Eigen; the device uses expf: a last-bit difference may
  // reorder near-equal scores, so count disagreements rather than demand none.
  const auto host = router.route(z);
  long differing = 0;
  for (Eigen::Index t = 0; t < 2048; ++t) differing += host.ids.row(t) != device.row(t) ? 1 : 0;
  MESSAGE(differing << " of 2048 rows differ between host and device biased selection");
  CHECK(differing <= 2);
}

#include "gpu_test_main.hpp"
