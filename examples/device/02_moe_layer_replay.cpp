// 02: the backend as a policy. The same MoE layer (Qwen3-MoE router, SwiGLU experts, single
// process, memory route store) is composed twice, its router picked by RouterFor<Backend>: the
// CPU's TopKRouter and the Thrust backend's device::BackendRouter (OpenMP system here, CUDA with
// nvcc). Each records routes in the rollout pass and replays them in the update after the gate
// moved; the two compositions must agree: ids identical, outputs and gradients within float
// rounding. Then logits already resident on the backend are routed through RoutingReplay's
// route_resident, where only ids cross to the host route store.
#include <mrr/moe.hpp>
#include <mrr/mrr.hpp>
#include <mrr/thrust/backend_router.hpp>

#include <thrust/equal.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace {

constexpr int kExperts = 16, kTopK = 4, kHidden = 32, kIntermediate = 48, kTokens = 96;

struct Result {
  mrr::ExpertIds recorded, replayed;
  mrr::RowMatrix<float> output, grad_input, grad_gate;
  mrr::ReplayStats stats;
};

template <class Backend>
Result run() {
  using Router = mrr::router_for_t<Backend, float>;
  using Layer = mrr::MoELayer<Router, mrr::SwiGLUExperts<float>, mrr::SingleProcess, mrr::MemoryRouteStore>;
  mrr::MemoryRouteStore store({.num_experts = kExperts, .num_layers = 1, .topk = kTopK});
  mrr::RoutingReplay replay(mrr::ReplayMode::R2, store);
  std::srand(5);  // the same weights and inputs for both backends
  mrr::SwiGLUExperts<float> bank(kHidden, kIntermediate, kExperts);
  const mrr::RowMatrix<float> w_in = mrr::RowMatrix<float>::Random(kExperts * kIntermediate, kHidden);
  const mrr::RowMatrix<float> w_out = mrr::RowMatrix<float>::Random(kExperts * kHidden, kIntermediate);
  auto flat = [](const mrr::RowMatrix<float>& m) { return std::span<const float>(m.data(), m.size()); };
  bank.load_torch(flat(w_in), flat(0.5f * w_in), flat(w_out));
  Layer layer(Router(mrr::presets::qwen3_moe(kExperts, kTopK)), std::move(bank), {}, replay, /*layer=*/0);
  layer.set_gate_weight(mrr::RowMatrix<float>::Random(kExperts, kHidden));
  const mrr::RowMatrix<float> x = mrr::RowMatrix<float>::Random(kTokens, kHidden);
  const mrr::RowMatrix<float> gate_step = 0.2f * mrr::RowMatrix<float>::Random(kExperts, kHidden);

  const std::vector<mrr::SequenceId> uids = {11, 12};
  replay.set_micro_batch(mrr::TokenLayout::packed(uids, std::vector<std::int64_t>{0, kTokens / 2, kTokens}));
  replay.begin_pass(mrr::TrainingPass::old_log_prob);  // R2: the rollout-side pass records
  Result r;
  r.recorded = layer.forward(x).routing.ids;
  layer.set_gate_weight(layer.gate_weight() + gate_step);
  replay.begin_pass(mrr::TrainingPass::actor_update);  // replays on the moved gate
  const auto f = layer.forward(x);
  const auto g = layer.backward(f, mrr::RowMatrix<float>::Ones(kTokens, kHidden));
  r.replayed = f.routing.ids;
  r.output = f.output;
  r.grad_input = g.input;
  r.grad_gate = g.gate_weight;
  r.stats = replay.stats();
  return r;
}

// Largest |a - b| relative to the largest |b|.
double relative_difference(const mrr::RowMatrix<float>& a, const mrr::RowMatrix<float>& b) {
  const double scale = std::max(1e-30, static_cast<double>(b.cwiseAbs().maxCoeff()));
  return static_cast<double>((a - b).cwiseAbs().maxCoeff()) / scale;
}

}  // namespace

int main() {
  const Result cpu = run<mrr::CpuBackend>();
  const Result dev = run<mrr::ThrustDeviceBackend>();
  const bool ids_equal = cpu.recorded == dev.recorded && cpu.replayed == dev.replayed && dev.replayed == dev.recorded;
  const double out = relative_difference(dev.output, cpu.output), gin = relative_difference(dev.grad_input, cpu.grad_input),
               ggate = relative_difference(dev.grad_gate, cpu.grad_gate);
  std::printf("backends cpu and %s: ids %s (recorded %lld rows, replayed %lld); relative difference: output %.2e, "
              "d input %.2e, d gate %.2e\n",
              std::string(mrr::ThrustDeviceBackend::name).c_str(), ids_equal ? "identical" : "DIFFER",
              static_cast<long long>(dev.stats.recorded_rows), static_cast<long long>(dev.stats.replayed_rows), out, gin,
              ggate);
  // Weights differ by a few float ulps (exp rounding); everything downstream is the same code.
  const bool close = out <= 1e-5 && gin <= 1e-5 && ggate <= 1e-5;

  // Logits resident on the backend: route_resident records and replays with only ids crossing.
  mrr::MemoryRouteStore store({.num_experts = kExperts, .num_layers = 1, .topk = kTopK});
  mrr::RoutingReplay replay(mrr::ReplayMode::R2, store);
  const mrr::device::BackendRouter<float> router(mrr::presets::qwen3_moe(kExperts, kTopK));
  const mrr::RowMatrix<float> z = mrr::RowMatrix<float>::Random(kTokens, kExperts);
  const thrust::device_vector<float> resident(z.data(), z.data() + z.size());
  const std::vector<mrr::SequenceId> uids = {21};
  replay.set_micro_batch(mrr::TokenLayout::packed(uids, std::vector<std::int64_t>{0, kTokens}));
  replay.begin_pass(mrr::TrainingPass::old_log_prob);
  const auto recorded = replay.route_resident(router, 0, resident);
  const mrr::RowMatrix<float> moved = z + 0.5f * mrr::RowMatrix<float>::Random(kTokens, kExperts);
  replay.begin_pass(mrr::TrainingPass::actor_update);
  const auto replayed = replay.route_resident(router, 0, thrust::device_vector<float>(moved.data(), moved.data() + moved.size()));
  const mrr::TopKRouter<float> cpu_router(mrr::presets::qwen3_moe(kExperts, kTopK));
  const auto cpu_ids = cpu_router.route(z).ids;
  const bool resident_ok = thrust::equal(recorded.ids.begin(), recorded.ids.end(), cpu_ids.data()) &&
                           thrust::equal(replayed.ids.begin(), replayed.ids.end(), cpu_ids.data());
  std::printf("route_resident: recorded ids equal the CPU router's and replay on moved logits: %s\n",
              resident_ok ? "yes" : "NO");
  return ids_equal && close && resident_ok ? 0 : 1;
}
