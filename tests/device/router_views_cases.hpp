// The cases of the device router's view checks and the CPU router's answers for them (host code:
// Eigen and doctest), shared by the OpenMP test and the CUDA test.
#pragma once

#include <mrr/router.hpp>
#include <mrr/thrust/bf16.hpp>

#include "router_views.hpp"

#include <doctest/doctest.h>

#include <random>
#include <vector>

namespace mrr::test {

// Softmax (post and pre, renormalised), and group-limited with both masking profiles on
// sqrt-softplus scores (CPU and device compute the same scalar scores, so the ids must be equal;
// the CPU vectorises sigmoid's).
inline std::vector<RouterConfig> router_view_configs() {
  auto softmax = mrr::presets::mixtral(16, 4);
  softmax.pre_softmax = true;
  softmax.normalize_topk = true;
  auto zero_masked = mrr::presets::deepseek_v3(64, 6, 8, 4);
  zero_masked.use_expert_bias = false;
  zero_masked.score_function = mrr::ScoreFunction::sqrt_softplus;
  auto inf_masked = mrr::presets::megatron_deepseek_v3(64, 8, 8, 4);
  inf_masked.use_expert_bias = false;
  inf_masked.score_function = mrr::ScoreFunction::sqrt_softplus;
  return {mrr::presets::mixtral(16, 4), softmax, zero_masked, inf_masked, mrr::presets::qwen3_moe(64, 8)};
}

inline RouterViewInputs router_view_inputs(mrr::RouterConfig config, long rows, unsigned seed) {
  const int E = config.num_experts, k = config.topk;
  RouterViewInputs in;
  in.config = config;
  in.rows = rows;
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  mrr::RowMatrix<float> z(rows, E), gw(rows, k), z16(rows, E);
  for (Eigen::Index i = 0; i < z.size(); ++i)
    z.data()[i] = normal(rng);
  for (Eigen::Index i = 0; i < gw.size(); ++i)
    gw.data()[i] = normal(rng);
  for (Eigen::Index i = 0; i < z.size(); ++i)
    z16.data()[i] = mrr::bf16::from_float(z.data()[i]).to_float();
  const mrr::TopKRouter<float> cpu(config);
  const auto r = cpu.route(z);
  const auto g = cpu.backward(z, r, gw);
  const auto r16 = cpu.route(z16);
  const auto g16 = cpu.backward(z16, r16, gw);
  in.logits.assign(z.data(), z.data() + z.size());
  in.ids.assign(r.ids.data(), r.ids.data() + r.ids.size());
  in.weights.assign(r.weights.data(), r.weights.data() + r.weights.size());
  in.grad_weights.assign(gw.data(), gw.data() + gw.size());
  in.grad.assign(g.data(), g.data() + g.size());
  in.bf16_ids.assign(r16.ids.data(), r16.ids.data() + r16.ids.size());
  in.bf16_grad.assign(g16.data(), g16.data() + g16.size());
  return in;
}

inline void check_report(const RouterViewReport& report) {
  for (const auto& f : report.failures)
    FAIL_CHECK(f);
  CHECK(report.failures.empty());
  CHECK(report.hot_allocations == 0);
}

}  // namespace mrr::test
