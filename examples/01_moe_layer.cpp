// 01: an MoE layer composed from policies — a Qwen3-MoE router, SwiGLU experts, the
// single-process communicator and a memory route store — recording routes in one pass and
// replaying them, with gradients, in the next.
#include <mrr/moe.hpp>
#include <mrr/mrr.hpp>

#include <cstdio>
#include <vector>

int main() {
  constexpr int experts = 8, k = 2, hidden = 16, intermediate = 32, tokens = 24;
  using Layer = mrr::MoELayer<mrr::TopKRouter<float>, mrr::SwiGLUExperts<float>, mrr::SingleProcess,
                              mrr::MemoryRouteStore>;

  mrr::MemoryRouteStore store({.num_experts = experts, .num_layers = 1, .topk = k});
  mrr::RoutingReplay replay(mrr::ReplayMode::R2, store);
  mrr::SwiGLUExperts<float> bank(hidden, intermediate, experts);
  const mrr::RowMatrix<float> w_in = mrr::RowMatrix<float>::Random(experts * intermediate, hidden);
  const mrr::RowMatrix<float> w_out = mrr::RowMatrix<float>::Random(experts * hidden, intermediate);
  auto flat = [](const mrr::RowMatrix<float>& m) { return std::span<const float>(m.data(), m.size()); };
  bank.load_torch(flat(w_in), flat(0.5f * w_in), flat(w_out));  // torch layout: [E, I, H], [E, I, H], [E, H, I]
  Layer layer(mrr::TopKRouter<float>(mrr::presets::qwen3_moe(experts, k)), std::move(bank), {}, replay, /*layer=*/0);
  layer.set_gate_weight(mrr::RowMatrix<float>::Random(experts, hidden));

  const std::vector<mrr::SequenceId> uids = {7};
  replay.set_micro_batch(mrr::TokenLayout::packed(uids, std::vector<std::int64_t>{0, tokens}));
  const mrr::RowMatrix<float> x = mrr::RowMatrix<float>::Random(tokens, hidden);

  replay.begin_pass(mrr::TrainingPass::old_log_prob);  // records the routes
  const auto recorded = layer.forward(x);

  layer.set_gate_weight(layer.gate_weight() + 0.1f * mrr::RowMatrix<float>::Random(experts, hidden));
  replay.begin_pass(mrr::TrainingPass::actor_update);  // replays them on the updated gate
  const auto f = layer.forward(x);
  const auto grads = layer.backward(f, mrr::RowMatrix<float>::Ones(tokens, hidden));

  std::printf("replayed the same experts: %s; |d gate| = %.4f, |d input| = %.4f\n",
              f.routing.ids == recorded.routing.ids ? "yes" : "no", double(grads.gate_weight.norm()), double(grads.input.norm()));
  return f.routing.ids == recorded.routing.ids ? 0 : 1;
}
