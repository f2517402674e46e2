// One TopKRouter<T, Backend>: the CPU executor (the default backend) and the Thrust executor on
// the OpenMP system run the same row kernels (mrr/kernels/router.hpp). Written once, instantiated
// per executor: each must give the kernels' own answer, computed here one row at a time.
#include <mrr/router.hpp>
#include <mrr/thrust/routing.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <type_traits>
#include <vector>

static_assert(std::is_same_v<mrr::TopKRouter<float>, mrr::TopKRouter<float, mrr::CpuBackend>>);
static_assert(std::is_same_v<mrr::Routing<float>, mrr::Routing<float, mrr::CpuBackend>>);
static_assert(std::is_same_v<mrr::device::TopKRouter<float>, mrr::TopKRouter<float, mrr::ThrustDeviceBackend>>);
static_assert(std::is_same_v<mrr::device::Routing<float>, mrr::Routing<float, mrr::ThrustDeviceBackend>>);

namespace {

struct Result {
  std::vector<std::int32_t> ids;
  std::vector<float> weights, grad;
};

// Route, then backward at the routed ids, on executor Backend; host vectors in and out.
template <class Backend>
struct Executor;

template <>
struct Executor<mrr::CpuBackend> {
  static Result run(const mrr::RouterConfig& c, const std::vector<float>& z, const std::vector<float>& gw, long rows) {
    const mrr::TopKRouter<float, mrr::CpuBackend> router(c);
    const mrr::RowMatrix<float> logits = Eigen::Map<const mrr::RowMatrix<float>>(z.data(), rows, c.num_experts);
    const mrr::RowMatrix<float> grad_w = Eigen::Map<const mrr::RowMatrix<float>>(gw.data(), rows, c.topk);
    const auto r = router.route(logits);
    const auto g = router.backward(logits, r, grad_w);
    return {{r.ids.data(), r.ids.data() + r.ids.size()},
            {r.weights.data(), r.weights.data() + r.weights.size()},
            {g.data(), g.data() + g.size()}};
  }
};

template <>
struct Executor<mrr::ThrustDeviceBackend> {
  static Result run(const mrr::RouterConfig& c, const std::vector<float>& z, const std::vector<float>& gw, long) {
    const mrr::TopKRouter<float, mrr::ThrustDeviceBackend> router(c);
    const thrust::device_vector<float> logits(z.begin(), z.end()), grad_w(gw.begin(), gw.end());
    const auto r = router.route(logits);
    const auto g = router.backward(logits, r.ids, grad_w);
    Result out{std::vector<std::int32_t>(r.ids.size()), std::vector<float>(r.weights.size()),
               std::vector<float>(g.size())};
    thrust::copy(r.ids.begin(), r.ids.end(), out.ids.begin());
    thrust::copy(r.weights.begin(), r.weights.end(), out.weights.begin());
    thrust::copy(g.begin(), g.end(), out.grad.begin());
    return out;
  }
};

// The kernels run directly, row after row: what every executor computes.
Result kernel_reference(const mrr::RouterConfig& c, const std::vector<float>& z, const std::vector<float>& gw,
                        long rows) {
  const auto p = mrr::resolve_router_params(c);
  const int E = c.num_experts, k = c.topk;
  Result out{std::vector<std::int32_t>(static_cast<std::size_t>(rows * k)),
             std::vector<float>(static_cast<std::size_t>(rows * k)), std::vector<float>(z.size())};
  std::vector<float> scores(static_cast<std::size_t>(E)), values(64), group_scores(64), g(static_cast<std::size_t>(k)),
      w(static_cast<std::size_t>(k));
  std::vector<int> indices(64);
  const mrr::kernels::SelectScratch<float> scratch{scores.data(), values.data(), group_scores.data(), indices.data(),
                                                   nullptr};
  for (long t = 0; t < rows; ++t) {
    const float* zt = z.data() + t * E;
    std::int32_t* ids = out.ids.data() + t * k;
    REQUIRE(mrr::kernels::route_row(p, zt, static_cast<const float*>(nullptr), static_cast<const std::int32_t*>(nullptr),
                                    ids, out.weights.data() + t * k, scratch) == mrr::kernels::row_ok);
    REQUIRE(mrr::kernels::backward_row(p, zt, ids, gw.data() + t * k, nullptr, out.grad.data() + t * E, g.data(),
                                       w.data()) == mrr::kernels::row_ok);
  }
  return out;
}

bool close(const std::vector<float>& a, const std::vector<float>& b, float tol) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (!(std::abs(a[i] - b[i]) <= tol * std::max(1.0f, std::abs(b[i])))) return false;
  return true;
}

}  // namespace

TEST_CASE_TEMPLATE("one TopKRouter<T, Backend>: each executor gives the row kernels' ids, weights and gradient",
                   Backend, mrr::CpuBackend, mrr::ThrustDeviceBackend) {
  auto pre = mrr::presets::qwen3_moe(64, 8);  // pre-softmax, renormalised
  auto grouped = mrr::presets::megatron_deepseek_v3(64, 8, 8, 4);
  grouped.use_expert_bias = false;
  grouped.score_function = mrr::ScoreFunction::sqrt_softplus;  // scalar scores on every executor
  auto zero_masked = mrr::presets::deepseek_v3(64, 6, 8, 4);
  zero_masked.use_expert_bias = false;
  zero_masked.score_function = mrr::ScoreFunction::sqrt_softplus;
  const long rows = 301;  // several CPU tiles and a partial one
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (const auto& config : {mrr::presets::megatron(32, 4), pre, grouped, zero_masked}) {
    CAPTURE(config.num_experts);
    CAPTURE(config.topk);
    std::vector<float> z(static_cast<std::size_t>(rows * config.num_experts)),
        gw(static_cast<std::size_t>(rows * config.topk));
    for (auto& v : z) v = normal(rng);
    for (auto& v : gw) v = normal(rng);
    const Result want = kernel_reference(config, z, gw, rows);
    const Result got = Executor<Backend>::run(config, z, gw, rows);
    CHECK(got.ids == want.ids);
    // Weights: the CPU's vectorised tile and the kernels' scalar exp may differ in the last bits.
    CHECK(close(got.weights, want.weights, 1e-6f));
    CHECK(close(got.grad, want.grad, 1e-6f));
  }
}
