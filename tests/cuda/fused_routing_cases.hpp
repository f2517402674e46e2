// The fused routing kernels' cases (mrr/cuda/fused_routing.cuh) against the CPU router: run on a
// GPU by test_cuda_routing, and on the host lane by lane by test_device_kernels_emulated
// (tests/device: the lane emulator), through the functions of device_routing.hpp. Included once by
// each of those tests, after doctest and mrr/router.hpp.
#pragma once

#include "device_routing.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace {

mrr::RowMatrix<float> logits(int rows, int experts, unsigned seed, bool with_ties) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.f, 1.f);
  mrr::RowMatrix<float> z(rows, experts);
  for (Eigen::Index i = 0; i < z.size(); ++i)
    z.data()[i] = with_ties ? std::round(2 * n(rng)) / 2 : n(rng);
  return z;
}

// The fused kernel's routing against the CPU router's: every row routed (status 0), the number
// of rows whose ids differ, and the largest weight difference over the rows whose ids agree.
std::pair<long, double> against_host(const mrr::test::FusedRoute& dev, const mrr::Routing<float>& host) {
  const Eigen::Index rows = host.ids.rows(), k = host.ids.cols();
  long differing = 0;
  double worst = 0;
  for (Eigen::Index t = 0; t < rows; ++t) {
    CHECK(dev.status[static_cast<std::size_t>(t)] == 0);
    bool same = true;
    for (Eigen::Index j = 0; j < k; ++j)
      same = same && dev.ids[static_cast<std::size_t>(t * k + j)] == host.ids(t, j);
    differing += same ? 0 : 1;
    if (same)
      for (Eigen::Index j = 0; j < k; ++j)
        worst = std::max(worst, static_cast<double>(
                                    std::abs(dev.weights[static_cast<std::size_t>(t * k + j)] - host.weights(t, j))));
  }
  return {differing, worst};
}

}  // namespace

namespace {

mrr::RouterConfig config(int experts, int k, mrr::ScoreFunction score, bool pre, bool bias, bool scaled) {
  mrr::RouterConfig c;
  c.num_experts = experts;
  c.topk = k;
  c.score_function = score;
  c.pre_softmax = pre;
  c.use_expert_bias = bias;
  if (scaled) c.scaling_factor = 2.5;
  return c;
}

// Native routing that runs the segment-per-token kernel gives the warp-per-token kernel's result:
// ids, status codes and weights, bit for bit (the weights' reductions run over the same k lanes in
// the same order).
bool same_as_warp_kernel(const mrr::test::FusedRoute& segments, const mrr::test::FusedRoute& warps) {
  return segments.error.empty() && warps.error.empty() && segments.ids == warps.ids &&
         segments.status == warps.status && segments.weights.size() == warps.weights.size() &&
         std::memcmp(segments.weights.data(), warps.weights.data(), segments.weights.size() * sizeof(float)) == 0;
}

}  // namespace

// The fused warp-per-token kernel against the CPU router itself: E not a multiple of 32 (partial
// register rows), E = 1000 (32 values a lane), k = 1 and k = 32, a row count that leaves a partial
// last block, tie-heavy logits and -inf masks (lower index wins), softmax pre / post, sigmoid +
// bias, sqrt-softplus, scaling; then replay with a mask.
TEST_CASE("fused routing kernel: ids equal the CPU router's, weights within 1e-5, replay gives them back") {
  using SF = mrr::ScoreFunction;
  struct Shape {
    int experts, k;
  };
  int segment_runs = 0;  // cases that ran the segment-per-token kernel
  for (const Shape shape : {Shape{8, 2}, Shape{40, 7}, Shape{64, 8}, Shape{200, 1}, Shape{256, 8}, Shape{32, 32},
                            Shape{1000, 32}, Shape{96, 6}, Shape{128, 4}, Shape{256, 2}, Shape{32, 1}}) {
    for (int variant = 0; variant < 5; ++variant) {
      const SF score = variant < 3 ? SF::softmax : (variant == 3 ? SF::sigmoid : SF::sqrt_softplus);
      const bool pre = variant == 1 || variant == 2, bias = variant == 3, scaled = variant == 2 || variant == 4;
      if (score == SF::softmax && !pre && shape.k == 1) continue;  // refused by validate(), as by Megatron
      auto cfg = config(shape.experts, shape.k, score, pre, bias, scaled);
      if (variant == 2) cfg.normalize_topk = true;
      CAPTURE(shape.experts);
      CAPTURE(shape.k);
      CAPTURE(variant);
      const long rows = 1003;
      auto z = logits(static_cast<int>(rows), shape.experts, static_cast<unsigned>(shape.experts * 10 + variant),
                      variant % 2 == 0);
      for (Eigen::Index t = 0; t < rows; t += 7)  // masked experts, at least k left
        for (int e = 0; e + shape.k < shape.experts && e < 3; ++e)
          z(t, (e * 5 + t) % shape.experts) = -INFINITY;
      mrr::TopKRouter<float> cpu(cfg);
      mrr::Vector<float> b(shape.experts);
      for (int e = 0; e < shape.experts; ++e)
        b[e] = 0.01f * static_cast<float>(e % 7);
      if (bias) cpu.set_expert_bias(b);
      const auto host = cpu.route(z);
      const auto dev = mrr::test::device_fused_route(cfg, z.data(), rows, bias ? b.data() : nullptr, nullptr, nullptr);
      REQUIRE(dev.error == "");
      const auto [differing, worst] = against_host(dev, host);
      // Selection on logits compares the same fp32 values: identical ids. Sigmoid + bias selects on
      // the host's vectorised exp: a last-bit difference may reorder a near-tie.
      MESSAGE(differing << " of " << rows << " rows differ");
      if (bias)
        CHECK(differing <= rows / 100);
      else
        CHECK(differing == 0);
      CHECK(worst <= 1e-5);
      if (mrr::test::fused_segments_apply(cfg)) {
        ++segment_runs;
        const auto warps =
            mrr::test::device_fused_route(cfg, z.data(), rows, bias ? b.data() : nullptr, nullptr, nullptr, true);
        CHECK(same_as_warp_kernel(dev, warps));
      }
      // Replay of the CPU's ids, every third row routing natively instead.
      std::vector<std::uint8_t> mask(static_cast<std::size_t>(rows), 1);
      for (std::size_t t = 0; t < mask.size(); t += 3)
        mask[t] = 0;
      const auto replayed =
          mrr::test::device_fused_route(cfg, z.data(), rows, bias ? b.data() : nullptr, host.ids.data(), mask.data());
      REQUIRE(replayed.error == "");
      if (!bias) CHECK(std::equal(replayed.ids.begin(), replayed.ids.end(), host.ids.data()));
      double worst_replay = 0;
      for (std::size_t i = 0; i < replayed.weights.size(); ++i)
        if (mask[i / static_cast<std::size_t>(shape.k)] != 0)
          worst_replay =
              std::max(worst_replay, static_cast<double>(std::abs(replayed.weights[i] - host.weights.data()[i])));
      CHECK(worst_replay <= 1e-5);
      // Every row replayed (no mask): k <= 16 runs the segment-per-token kernel, which must give the
      // warp-per-token kernel's bits (that kernel runs when a mask is given, here all ones).
      const std::vector<std::uint8_t> ones(static_cast<std::size_t>(rows), 1);
      const auto segments =
          mrr::test::device_fused_route(cfg, z.data(), rows, bias ? b.data() : nullptr, host.ids.data(), nullptr);
      const auto warps =
          mrr::test::device_fused_route(cfg, z.data(), rows, bias ? b.data() : nullptr, host.ids.data(), ones.data());
      REQUIRE(segments.error == "");
      REQUIRE(warps.error == "");
      CHECK(segments.ids == warps.ids);
      CHECK(segments.status == warps.status);
      CHECK(std::memcmp(segments.weights.data(), warps.weights.data(), segments.weights.size() * sizeof(float)) == 0);
    }
  }
  // E in {32, 64, 96, 128, 256} with k <= 8, every variant but unrenormalised pre-softmax: 6 shapes
  // x 4 variants, less post-softmax top-1 (32 experts, k = 1), which validate() refuses.
  CHECK(segment_runs == 23);
}

// Group limits in the fused kernel: HF DeepSeek-V3 (0.0 masking, groups score their top 2) and
// Megatron's (-inf masking), groups of 32 and 64 experts, group score top 1; ids against the CPU
// router (sigmoid + bias selects on the host's vectorised exp: a near-tie may differ in a few rows),
// weights, then replay. Unsupported layouts (groups of 16 experts) are refused, not mis-routed.
TEST_CASE("fused routing kernel: group-limited routing (DeepSeek-V3, HF and Megatron) equals the CPU router's") {
  struct Case {
    mrr::RouterConfig cfg;
    const char* name;
  };
  auto one_top = mrr::presets::megatron_deepseek_v3(128, 4, 2, 1, 1.0);
  one_top.group_score_topk = 1;
  one_top.validate();
  for (const auto& c : {Case{mrr::presets::deepseek_v3(256, 8, 8, 4, true, 2.5), "HF 256/8, 8 groups, top 4"},
                        Case{mrr::presets::megatron_deepseek_v3(256, 8, 8, 4, 2.5), "Megatron 256/8"},
                        Case{mrr::presets::deepseek_v3(256, 8, 4, 1, true, 1.0), "HF, groups of 64, top 1 group"},
                        Case{one_top, "Megatron, group score = its top 1"}}) {
    const std::string name = c.name;  // (doctest prints a const char* as its address)
    CAPTURE(name);
    const int experts = c.cfg.num_experts;
    const long rows = 2003;
    // Tied: logits on a grid of 0.5 and no bias, so equal scores, equal group scores and equal
    // group top-2 members are common; the lower group, then the lower expert, must win, as on the CPU.
    for (const bool tied : {false, true}) {
      CAPTURE(tied);
      auto z = logits(static_cast<int>(rows), experts, 77u + static_cast<unsigned>(experts), tied);
      mrr::TopKRouter<float> cpu(c.cfg);
      mrr::Vector<float> b(experts);
      for (int e = 0; e < experts; ++e)
        b[e] = tied ? 0.f : 0.05f * static_cast<float>(e % 11) - 0.6f;  // negative: 0.0 masking bites
      cpu.set_expert_bias(b);
      const auto host = cpu.route(z);
      const auto dev = mrr::test::device_fused_route(c.cfg, z.data(), rows, b.data(), nullptr, nullptr);
      REQUIRE(dev.error == "");
      const auto [differing, worst] = against_host(dev, host);
      MESSAGE(name << std::string(tied ? ", tied" : "") << ": " << differing << " of " << rows << " rows differ");
      // Exact ties stay exact ties through any sigmoid, and values a grid step apart stay apart.
      if (tied)
        CHECK(differing == 0);
      else
        CHECK(differing <= rows / 100);
      CHECK(worst <= 1e-5 * c.cfg.scaling_factor.value_or(1.0));
      // Groups of 32 or 64 experts, 4 to 8 groups: the segment kernel, equal to the warp kernel.
      CHECK(mrr::test::fused_segments_apply(c.cfg));
      CHECK(same_as_warp_kernel(
          dev, mrr::test::device_fused_route(c.cfg, z.data(), rows, b.data(), nullptr, nullptr, true)));
      const auto replayed = mrr::test::device_fused_route(c.cfg, z.data(), rows, b.data(), host.ids.data(), nullptr);
      REQUIRE(replayed.error == "");
      CHECK(std::equal(replayed.ids.begin(), replayed.ids.end(), host.ids.data()));
    }
  }
  // Groups of 16 experts: not the fused kernel's layout.
  const auto small = mrr::presets::megatron_deepseek_v3(64, 4, 4, 2, 1.0);
  const std::vector<float> small_bias(64, 0.f);
  const auto refused =
      mrr::test::device_fused_route(small, logits(64, 64, 5u, false).data(), 64, small_bias.data(), nullptr, nullptr);
  CHECK(refused.error.find("invalid argument") != std::string::npos);
}

// bf16 logits (a bf16 gate's output) read by the fused kernel and widened exactly: the ids the CPU
// router gives on the same bf16-rounded values, weights within 1e-5, and replay of those ids.
TEST_CASE("fused routing kernel: bf16 logits give the CPU router's ids on the rounded values") {
  using SF = mrr::ScoreFunction;
  for (const int experts : {64, 128, 256, 1000}) {
    for (const SF score : {SF::softmax, SF::sigmoid}) {
      CAPTURE(experts);
      const int k = 8;
      auto cfg = config(experts, k, score, false, false, score == SF::sigmoid);
      const long rows = 517;
      // Ties are common in bf16 (8 bits of mantissa): the lower index must win on both sides.
      const auto z = logits(static_cast<int>(rows), experts, static_cast<unsigned>(experts + 3), false);
      const auto dev = mrr::test::device_fused_route_bf16(cfg, z.data(), rows, nullptr, nullptr, nullptr);
      REQUIRE(dev.error == "");
      CHECK(mrr::test::fused_segments_apply(cfg) == (experts <= 256));
      if (experts <= 256)
        CHECK(same_as_warp_kernel(
            dev, mrr::test::device_fused_route_bf16(cfg, z.data(), rows, nullptr, nullptr, nullptr, true)));
      REQUIRE(dev.logits.size() == static_cast<std::size_t>(rows * experts));
      const Eigen::Map<const mrr::RowMatrix<float>> rounded(dev.logits.data(), rows, experts);
      CHECK(rounded != z);  // the device really read rounded values
      const mrr::TopKRouter<float> cpu(cfg);
      const auto host = cpu.route(rounded);
      CHECK(std::equal(dev.ids.begin(), dev.ids.end(), host.ids.data()));
      CHECK(std::all_of(dev.status.begin(), dev.status.end(), [](std::uint8_t c) { return c == 0; }));
      double worst = 0;
      for (std::size_t i = 0; i < dev.weights.size(); ++i)
        worst = std::max(worst, static_cast<double>(std::abs(dev.weights[i] - host.weights.data()[i])));
      CHECK(worst <= 1e-5);
      const auto replayed = mrr::test::device_fused_route_bf16(cfg, z.data(), rows, nullptr, host.ids.data(), nullptr);
      REQUIRE(replayed.error == "");
      CHECK(std::equal(replayed.ids.begin(), replayed.ids.end(), host.ids.data()));
    }
  }
}

TEST_CASE("fused routing kernel: bad rows get the Thrust path's status codes, ids -1 and NaN weights") {
  // E = 40: the warp-per-token kernel; E = 256: native rows run the segment kernel.
  for (const int E : {40, 256}) {
    CAPTURE(E);
    const int k = 4;
    auto z = logits(8, E, 5, false);
    z(0, 3) = NAN;        // invalid logit
    z(1, 39) = INFINITY;  // invalid logit
    for (int e = 0; e < E - 2; ++e)
      z(2, e) = -INFINITY;  // 2 finite < k
    for (int e = 0; e < E - 4; ++e)
      z(3, e) = -INFINITY;  // exactly k finite: fine
    for (int e = 0; e < E; ++e)
      z(4, e) = 0.f;  // all tied: the lowest k indices
    const auto cfg = config(E, k, mrr::ScoreFunction::softmax, false, false, false);
    const auto dev = mrr::test::device_fused_route(cfg, z.data(), 8, nullptr, nullptr, nullptr);
    REQUIRE(dev.error == "");
    CHECK(mrr::test::fused_segments_apply(cfg) == (E == 256));
    CHECK(same_as_warp_kernel(dev, mrr::test::device_fused_route(cfg, z.data(), 8, nullptr, nullptr, nullptr, true)));
    CHECK(std::vector<std::int32_t>(dev.ids.begin() + 4 * k, dev.ids.begin() + 5 * k) ==
          std::vector<std::int32_t>{0, 1, 2, 3});
    for (int j = 0; j < k; ++j)
      CHECK(dev.weights[static_cast<std::size_t>(4 * k + j)] == 0.25f);
    CHECK(dev.status == std::vector<std::uint8_t>{1, 1, 3, 0, 0, 0, 0, 0});
    for (int j = 0; j < k; ++j) {
      CHECK(dev.ids[static_cast<std::size_t>(2 * k + j)] == -1);
      CHECK(std::isnan(dev.weights[static_cast<std::size_t>(2 * k + j)]));
    }
    std::vector<std::int32_t> row3(dev.ids.begin() + 3 * k, dev.ids.begin() + 4 * k);
    std::sort(row3.begin(), row3.end());
    CHECK(row3 == std::vector<std::int32_t>{E - 4, E - 3, E - 2, E - 1});  // the k finite experts
    // Replay: ids out of range or repeated; a NaN among the k replayed logits; a NaN elsewhere in a
    // replayed row is not read (post-softmax), but is under unrenormalised pre-softmax.
    std::vector<std::int32_t> ids(8 * k);
    for (int t = 0; t < 8; ++t)
      for (int j = 0; j < k; ++j)
        ids[static_cast<std::size_t>(t * k + j)] = 10 + j;
    ids[4 * k + 1] = E;   // out of range
    ids[5 * k + 2] = 10;  // repeats slot 0
    ids[6 * k + 3] = -1;  // out of range
    auto zr = logits(8, E, 6, false);
    zr(0, 11) = NAN;  // replayed expert
    zr(1, 30) = NAN;  // not replayed
    // Row 7's replayed experts are all masked: a softmax over them is NaN (row_nan_weight, 4), as the
    // Thrust path and the CPU router reject it; unrenormalised pre-softmax weighs them 0 instead.
    for (int j = 0; j < k; ++j)
      zr(7, 10 + j) = -INFINITY;
    const auto replay = mrr::test::device_fused_route(cfg, zr.data(), 8, nullptr, ids.data(), nullptr);
    REQUIRE(replay.error == "");
    std::string codes;
    for (const auto c : replay.status)
      codes += std::to_string(int(c));
    CHECK(codes == "10002224");  // as a string: doctest prints it
    const auto pre = config(E, k, mrr::ScoreFunction::softmax, true, false, false);
    const auto replay_pre = mrr::test::device_fused_route(pre, zr.data(), 8, nullptr, ids.data(), nullptr);
    REQUIRE(replay_pre.error == "");
    CHECK(replay_pre.status == std::vector<std::uint8_t>{1, 1, 0, 0, 2, 2, 2, 0});
    for (int j = 0; j < k; ++j)
      CHECK(replay_pre.weights[static_cast<std::size_t>(7 * k + j)] == 0.f);
  }
}
