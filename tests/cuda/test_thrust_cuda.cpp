// The Thrust backend on the CUDA system against the CPU router, and the fused routing + replay
// kernel against the Thrust path. Exits 77 (ctest: skipped) without a GPU.
#define DOCTEST_CONFIG_IMPLEMENT
#include <mrr/ppo/advantage.hpp>
#include <mrr/router.hpp>

#include <doctest/doctest.h>

#include "device_routing.hpp"
#include "thrust_cuda.hpp"

#include <cmath>
#include <cstdio>
#include <random>

namespace {

std::vector<float> random_logits(long n, unsigned seed, int distinct) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_int_distribution<int> pick(0, distinct > 0 ? distinct - 1 : 0);
  std::vector<float> z(static_cast<std::size_t>(n));
  for (auto& v : z) v = distinct > 0 ? static_cast<float>(pick(rng)) * 0.25f : nd(rng);
  return z;
}

}  // namespace

TEST_CASE("CUDA Thrust path: ids equal the CPU router's, ties included") {
  for (int distinct : {0, 5}) {
    const long tokens = 65536;
    const auto z = random_logits(tokens * 256, 3, distinct);
    mrr::TopKRouter<float> cpu(mrr::presets::qwen3_moe(256, 8, true));
    const auto host = cpu.route(Eigen::Map<const mrr::RowMatrix<float>>(z.data(), tokens, 256));
    const auto dev = mrr::test::cuda_route(z, 256, 8, "softmax", true, {}, {}, {}, false);
    REQUIRE(dev.error == "");
    CHECK(std::equal(dev.ids.begin(), dev.ids.end(), host.ids.data()));
  }
}

TEST_CASE("fused routing + replay kernel equals the Thrust path") {
  const long tokens = 32768;
  for (int experts : {8, 64, 256}) {
    const auto z = random_logits(tokens * experts, static_cast<unsigned>(experts), experts == 64 ? 5 : 0);
    std::vector<float> bias(static_cast<std::size_t>(experts));
    for (int e = 0; e < experts; ++e) bias[static_cast<std::size_t>(e)] = 0.01f * static_cast<float>(e % 7);
    std::vector<std::uint8_t> mask(static_cast<std::size_t>(tokens), 1);
    for (std::size_t t = 0; t < mask.size(); t += 5) mask[t] = 0;
    const int k = experts >= 64 ? 8 : 2;
    for (const char* score : {"softmax", "sigmoid", "sqrtsoftplus"}) {
      for (bool pre : {false, true}) {
        if (pre && std::string(score) != "softmax") continue;
        const auto with_bias = std::string(score) == "softmax" ? std::vector<float>{} : bias;
        const auto slow = mrr::test::cuda_route(z, experts, k, score, pre, with_bias, {}, {}, false);
        const auto fast = mrr::test::cuda_route(z, experts, k, score, pre, with_bias, {}, {}, true);
        REQUIRE(slow.error == "");
        REQUIRE(fast.error == "");
        CAPTURE(experts);
        CAPTURE(score);
        CHECK(slow.ids == fast.ids);
        double worst = 0;
        for (std::size_t i = 0; i < slow.weights.size(); ++i)
          worst = std::max(worst, static_cast<double>(std::abs(slow.weights[i] - fast.weights[i])));
        CHECK(worst <= 1e-6);
        // Replay of the native ids with a mask: the same ids back, the same weights.
        const auto replayed = mrr::test::cuda_route(z, experts, k, score, pre, {}, slow.ids, mask, true);
        REQUIRE(replayed.error == "");
        if (with_bias.empty()) CHECK(replayed.ids == slow.ids);
      }
    }
  }
}

TEST_CASE("CUDA GAE scan equals the CPU recurrence") {
  const long rows = 32, cols = 4096;
  std::mt19937 rng(1);
  std::normal_distribution<double> n(0.0, 1.0);
  mrr::RowMatrix<double> r(rows, cols), v(rows, cols), m(rows, cols);
  for (long i = 0; i < r.size(); ++i) {
    r.data()[i] = n(rng);
    v.data()[i] = n(rng);
    m.data()[i] = (i % cols) < cols - 100 * (i / cols) ? 1.0 : 0.0;
  }
  const auto host = mrr::ppo::compute_gae_advantage_return<double>(r, v, m, 0.99, 0.95);
  std::vector<double> a, ret;
  REQUIRE(mrr::test::cuda_gae({r.data(), r.data() + r.size()}, {v.data(), v.data() + v.size()},
                              {m.data(), m.data() + m.size()}, cols, 0.99, 0.95, a, ret) == "");
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(a[i] - host.advantages.data()[i]));
  CHECK(worst <= 1e-10);
}

TEST_CASE("CUDA permute + combine equal the CPU's bit for bit") {
  const long tokens = 2048, hidden = 300;
  const int experts = 32, k = 4;
  const auto z = random_logits(tokens * experts, 9, 0);
  mrr::TopKRouter<float> cpu(mrr::presets::qwen3_moe(experts, k, true));
  const auto routing = cpu.route(Eigen::Map<const mrr::RowMatrix<float>>(z.data(), tokens, experts));
  const auto perm = mrr::make_expert_permutation(routing, experts);
  const auto xv = random_logits(tokens * hidden, 10, 0);
  const Eigen::Map<const mrr::RowMatrix<float>> x(xv.data(), tokens, hidden);
  const auto combined = mrr::combine<float>(mrr::permute_tokens<float>(x, perm), routing, perm);
  std::vector<float> dev;
  REQUIRE(mrr::test::cuda_permute_combine({routing.ids.data(), routing.ids.data() + routing.ids.size()}, tokens, k,
                                          experts, xv, hidden,
                                          {routing.weights.data(), routing.weights.data() + routing.weights.size()},
                                          dev) == "");
  CHECK(std::equal(dev.begin(), dev.end(), combined.data()));
}

int main(int argc, char** argv) {
  if (mrr::test::cuda_device_count() == 0) {
    std::printf("no CUDA device: skipped\n");
    return 77;
  }
  doctest::Context context(argc, argv);
  return context.run();
}
