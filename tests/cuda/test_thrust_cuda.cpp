// The Thrust backend on the CUDA system against the CPU router, and the fused routing + replay
// kernel against the Thrust path. Exits 77 (ctest: skipped) without a GPU.
#define DOCTEST_CONFIG_IMPLEMENT
#include <mrr/ppo/advantage.hpp>
#include <mrr/ppo/policy_loss.hpp>
#include <mrr/router.hpp>

#include <doctest/doctest.h>

#include "device_routing.hpp"
#include "gae_blocks_cases.hpp"
#include "thrust_cuda.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <limits>
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
    // The same configuration on the device: pre-softmax with the k weights renormalised.
    const auto dev = mrr::test::cuda_route(z, 256, 8, "softmax", true, {}, {}, {}, false, /*normalize_topk=*/true);
    REQUIRE(dev.error == "");
    CHECK(std::equal(dev.ids.begin(), dev.ids.end(), host.ids.data()));
    // Weights within 8 float ulps of the CPU's (the GPU's expf against the CPU's polynomial).
    double worst = 0;
    for (std::size_t i = 0; i < dev.weights.size(); ++i)
      worst = std::max(worst, static_cast<double>(std::abs(dev.weights[i] - host.weights.data()[i])) /
                                  (std::abs(static_cast<double>(host.weights.data()[i])) * 0x1p-23 + 1e-45));
    CHECK(worst <= 8.0);
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
        // Replayed rows (mask 1) take the given ids and recompute the same weights (the weights never
        // include the bias); the others route natively, here without bias.
        const auto replayed = mrr::test::cuda_route(z, experts, k, score, pre, {}, slow.ids, mask, true);
        REQUIRE(replayed.error == "");
        if (with_bias.empty()) CHECK(replayed.ids == slow.ids);
        std::size_t differing_ids = 0;
        double worst_replayed = 0;
        for (std::size_t t = 0; t < mask.size(); ++t) {
          if (mask[t] == 0) continue;
          for (int j = 0; j < k; ++j) {
            const std::size_t i = t * static_cast<std::size_t>(k) + static_cast<std::size_t>(j);
            differing_ids += replayed.ids[i] != slow.ids[i] ? 1 : 0;
            worst_replayed = std::max(worst_replayed, static_cast<double>(std::abs(replayed.weights[i] - slow.weights[i])));
          }
        }
        CHECK(differing_ids == 0);
        CHECK(worst_replayed <= 1e-6);
      }
    }
  }
}

TEST_CASE("CUDA GAE (chunks, scan, rows) equals the CPU recurrence") {
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
  for (int algorithm : {0, 1, 2, 3, 4}) {  // automatic (blocks), the scan, the per-row recurrence, chunks, blocks
    CAPTURE(algorithm);
    std::vector<double> a, ret;
    REQUIRE(mrr::test::cuda_gae({r.data(), r.data() + r.size()}, {v.data(), v.data() + v.size()},
                                {m.data(), m.data() + m.size()}, cols, 0.99, 0.95, a, ret, algorithm) == "");
    double worst = 0;
    for (std::size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(a[i] - host.advantages.data()[i]));
    CHECK(worst <= 1e-10);
  }
}

TEST_CASE("CUDA bf16 logits route like the CPU router on the bf16-rounded logits; BackendRouter like TopKRouter") {
  const long tokens = 16384;
  const int experts = 128, k = 8;
  for (int distinct : {0, 5}) {
    const auto z = random_logits(tokens * experts, 13, distinct);
    std::vector<float> rounded(z.size());
    for (std::size_t i = 0; i < z.size(); ++i) {  // round to nearest even at bit 16
      std::uint32_t u;
      std::memcpy(&u, &z[i], 4);
      u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
      std::memcpy(&rounded[i], &u, 4);
    }
    mrr::TopKRouter<float> cpu(mrr::presets::qwen3_moe(experts, k, true));
    const auto host = cpu.route(Eigen::Map<const mrr::RowMatrix<float>>(rounded.data(), tokens, experts));
    const auto dev = mrr::test::cuda_route_bf16(z, experts, k, "softmax", true);
    REQUIRE(dev.error == "");
    CHECK(std::equal(dev.ids.begin(), dev.ids.end(), host.ids.data()));
    const auto exact = cpu.route(Eigen::Map<const mrr::RowMatrix<float>>(z.data(), tokens, experts));
    const auto adapter = mrr::test::cuda_backend_router_route(z, experts, k);
    REQUIRE(adapter.error == "");
    CHECK(std::equal(adapter.ids.begin(), adapter.ids.end(), exact.ids.data()));
  }
}

TEST_CASE("CUDA vanilla policy loss equals the CPU's") {
  const long rows = 64, cols = 1000;
  std::mt19937 rng(17);
  std::normal_distribution<double> n(0.0, 1.0);
  mrr::RowMatrix<double> old_lp(rows, cols), lp(rows, cols), adv(rows, cols), mask(rows, cols);
  for (long i = 0; i < lp.size(); ++i) {
    old_lp.data()[i] = -std::abs(n(rng));
    lp.data()[i] = old_lp.data()[i] + 0.3 * n(rng);
    adv.data()[i] = n(rng);
    mask.data()[i] = (i % cols) < cols - 7 * (i / cols) ? 1.0 : 0.0;
  }
  auto vec = [](const mrr::RowMatrix<double>& m) { return std::vector<double>(m.data(), m.data() + m.size()); };
  for (const char* mode : {"token-mean", "seq-mean-token-mean", "seq-mean-token-sum"}) {
    CAPTURE(mode);
    mrr::ppo::PolicyLossConfig config;
    config.clip_ratio = 0.2;
    config.clip_ratio_c = 3.0;
    const auto host = mrr::ppo::compute_policy_loss_vanilla<double>(old_lp, lp, adv, mask,
                                                                    mrr::ppo::parse_loss_agg_mode(mode), config);
    const auto dev = mrr::test::cuda_policy_loss_vanilla(vec(old_lp), vec(lp), vec(adv), vec(mask), cols, mode, 0.2, 3.0);
    REQUIRE(dev.error == "");
    CHECK(std::abs(dev.loss - host.loss) <= 1e-10 * (1 + std::abs(host.loss)));
    double worst = 0;
    for (std::size_t i = 0; i < dev.grad_log_prob.size(); ++i)
      worst = std::max(worst, std::abs(dev.grad_log_prob[i] - host.grad_log_prob.data()[i]));
    CHECK(worst <= 1e-12);
    CHECK(std::abs(dev.clipfrac - *host.metric("actor/pg_clipfrac")) <= 1e-12);
    CHECK(std::abs(dev.clipfrac_lower - *host.metric("actor/pg_clipfrac_lower")) <= 1e-12);
    CHECK(std::abs(dev.ppo_kl - *host.metric("actor/ppo_kl")) <= 1e-12);
  }
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

TEST_CASE("CUDA dense token dropping equals the CPU apply_token_dropping bit for bit") {
  const long tokens = 65536;
  const int experts = 64, k = 4;
  std::mt19937 rng(23);
  std::uniform_int_distribution<int> pick_expert(0, experts - 1);
  std::vector<std::uint8_t> map(static_cast<std::size_t>(tokens * experts), 0);
  for (long t = 0; t < tokens; ++t)
    for (int placed = 0; placed < k && t % 7 != 3;) {  // k distinct experts; every 7th token none
      auto& cell = map[static_cast<std::size_t>(t * experts + pick_expert(rng))];
      placed += cell == 0 ? 1 : 0;
      cell = 1;
    }
  const Eigen::Map<const mrr::Mask> host_map(map.data(), tokens, experts);
  for (int distinct : {0, 5}) {  // tie-heavy: 5 distinct probabilities
    const auto z = random_logits(tokens * experts, 29, distinct);
    std::vector<double> zd(z.begin(), z.end());
    for (const bool by_probs : {true, false})
      for (const bool pad : {false, true})
        for (const double cf : {0.5, 1.0, 1.5, 1e6}) {
          CAPTURE(distinct);
          CAPTURE(by_probs);
          CAPTURE(pad);
          CAPTURE(cf);
          const auto policy = by_probs ? mrr::DropPolicy::probs : mrr::DropPolicy::position;
          const auto host = mrr::apply_token_dropping<float>(Eigen::Map<const mrr::RowMatrix<float>>(z.data(), tokens, experts),
                                                             host_map, k, cf, policy, pad);
          std::vector<float> p;
          std::vector<std::uint8_t> m;
          REQUIRE(mrr::test::cuda_token_dropping(z, map, tokens, experts, k, cf, by_probs, pad, p, m) == "");
          CHECK(std::equal(m.begin(), m.end(), host.map.data()));
          CHECK(std::memcmp(p.data(), host.probs.data(), p.size() * sizeof(float)) == 0);
          const auto host_d = mrr::apply_token_dropping<double>(
              Eigen::Map<const mrr::RowMatrix<double>>(zd.data(), tokens, experts), host_map, k, cf, policy, pad);
          std::vector<double> pd;
          REQUIRE(mrr::test::cuda_token_dropping(zd, map, tokens, experts, k, cf, by_probs, pad, pd, m) == "");
          CHECK(std::equal(m.begin(), m.end(), host_d.map.data()));
          CHECK(std::memcmp(pd.data(), host_d.probs.data(), pd.size() * sizeof(double)) == 0);
        }
  }
  std::vector<float> p;
  std::vector<std::uint8_t> m;
  auto bad = map;
  bad[5] = 2;
  CHECK(mrr::test::cuda_token_dropping(random_logits(tokens * experts, 31, 0), bad, tokens, experts, k, 1.0, true, false,
                                       p, m) != "");
}

#include "gpu_test_main.hpp"
