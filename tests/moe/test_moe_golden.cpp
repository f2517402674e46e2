// Parity with Hugging Face's sparse-MoE blocks (Qwen2-MoE, Qwen3-MoE, Mixtral; moe_block.json):
// router logits, ids, weights, output and the gradients w.r.t. the input, the gate weight and
// every expert matrix, float64, native and replayed — loaded in torch's nn.Linear layout as a
// user converting a checkpoint would, and run on 1, 2 and 4 expert-parallel ranks.
#include <mrr/comm/in_process.hpp>
#include <mrr/moe.hpp>
#include <mrr/replay.hpp>
#include <mrr/router.hpp>

#include <support/golden.hpp>

#include "moe_fixture.hpp"

#include <string>
#include <vector>

using mrr::test::check_close;
using mrr::test::GoldenCase;
using mrr::test::load_golden;

namespace {

std::vector<GoldenCase> moe_cases() {
  auto cases = load_golden("moe_block.json", "moe_block");
  for (auto& c : load_golden("moe_block.json", "moe_block_replay")) cases.push_back(std::move(c));
  return cases;
}

mrr::RouterConfig hf_config(const GoldenCase& c) {
  const auto family = c.param<std::string>("family");
  const int e = c.param<int>("num_experts"), k = c.param<int>("topk");
  if (family == "mixtral") return mrr::presets::mixtral(e, k);
  if (family == "qwen3_moe") return mrr::presets::qwen3_moe(e, k, c.param<bool>("norm_topk_prob"));
  if (family == "qwen2_moe") return mrr::presets::qwen2_moe(e, k, c.param<bool>("norm_topk_prob"));
  FAIL("unknown family " << family);
  return {};
}

mrr::test::MoEModel<double> golden_model(const GoldenCase& c) {
  mrr::test::MoEModel<double> m;
  m.config = hf_config(c);
  m.hidden = c.param<int>("hidden_size");
  m.intermediate = c.param<int>("intermediate_size");
  m.gate = c.input("gate_weight").matrix<double>();
  m.w_gate = c.input("w_gate").values<double>();
  m.w_up = c.input("w_up").values<double>();
  m.w_down = c.input("w_down").values<double>();
  return m;
}

// Global [E, a, b] golden tensor vs the per-expert matrices.
bool check_experts(const std::vector<mrr::RowMatrix<double>>& ours, const mrr::test::Tensor& golden,
                   const GoldenCase& c, const std::string& what) {
  mrr::RowMatrix<double> stacked(static_cast<Eigen::Index>(ours.size()) * ours.front().rows(), ours.front().cols());
  for (std::size_t e = 0; e < ours.size(); ++e)
    stacked.middleRows(static_cast<Eigen::Index>(e) * ours.front().rows(), ours.front().rows()) = ours[e];
  return check_close(stacked, golden, c.rtol, c.atol, c.name + " " + what);
}

// Runs the case on `ranks` in-process ranks (replay cases: each rank's store holds the given ids
// for its tokens, replayed by RoutingReplay in R3) and checks everything against the golden.
void run_case(const GoldenCase& c, int ranks) {
  CAPTURE(c.name);
  CAPTURE(ranks);
  const auto model = golden_model(c);
  const auto x = c.input("hidden").matrix<double>();
  const auto gy = c.input("grad_output").matrix<double>();
  const bool replay = c.fn == "moe_block_replay";
  const int e = model.num_experts(), k = model.topk();
  mrr::test::MoEResult<double> out(x.rows(), model.hidden, e, k, ranks);
  mrr::RowMatrix<double> logits(x.rows(), e);
  mrr::InProcessGroup(ranks).run([&](const mrr::InProcessComm& comm) {
    const auto [begin, end] = mrr::test::token_chunk(x.rows(), ranks, comm.rank());
    const auto layout = mrr::test::token_layout(begin, end);
    mrr::MemoryRouteStore store({.num_experts = e, .num_layers = 1, .topk = k});
    mrr::RoutingReplay replayer(mrr::ReplayMode::R3, store);
    replayer.set_micro_batch(layout);
    if (replay) {
      store.record(0, layout, c.input("replay_ids").matrix<std::int32_t>().middleRows(begin, end - begin));
      replayer.begin_pass(mrr::TrainingPass::actor_update);
    } else {
      replayer.begin_pass(mrr::TrainingPass::ref_log_prob);  // native
    }
    auto layer = model.layer(comm, &replayer);
    const mrr::RowMatrix<double> xs = x.middleRows(begin, end - begin);
    const auto f = layer.forward(xs);
    logits.middleRows(begin, end - begin) = f.router_logits();
    const auto g = layer.backward(f, gy.middleRows(begin, end - begin));
    std::lock_guard lock(*out.mutex);
    out.output.middleRows(begin, end - begin) = f.output;
    out.grad_input.middleRows(begin, end - begin) = g.input;
    out.ids.middleRows(begin, end - begin) = f.routing.ids;
    out.grad_gate[static_cast<std::size_t>(comm.rank())] = g.gate_weight;
    for (int i = 0; i < layer.experts().num_experts(); ++i) {
      const auto global = static_cast<std::size_t>(layer.experts().first_expert() + i);
      out.grad_w_gate[global] = g.experts.w_gate[static_cast<std::size_t>(i)];
      out.grad_w_up[global] = g.experts.w_up[static_cast<std::size_t>(i)];
      out.grad_w_down[global] = g.experts.w_down[static_cast<std::size_t>(i)];
    }
  });
  CHECK(check_close(logits, c.output("router_logits"), c.rtol, c.atol, c.name + " router_logits"));
  // Both list each token's slots in descending weight order (torch.topk sorted; replay: as given).
  CHECK(check_close(out.ids, c.output("indices"), 0, 0, c.name + " indices"));
  CHECK(check_close(out.output, c.output("output"), c.rtol, c.atol, c.name + " output"));
  CHECK(check_close(out.grad_input, c.output("grad_hidden"), c.rtol, c.atol, c.name + " grad_hidden"));
  for (const auto& gate : out.grad_gate)
    CHECK(check_close(gate, c.output("grad_gate_weight"), c.rtol, c.atol, c.name + " grad_gate_weight"));
  CHECK(check_experts(out.grad_w_gate, c.output("grad_w_gate"), c, "grad_w_gate"));
  CHECK(check_experts(out.grad_w_up, c.output("grad_w_up"), c, "grad_w_up"));
  CHECK(check_experts(out.grad_w_down, c.output("grad_w_down"), c, "grad_w_down"));
}

}  // namespace

TEST_SUITE("golden") {
  TEST_CASE("moe_block.json: HF Qwen2/Qwen3-MoE and Mixtral blocks, forward and gradients (double)") {
    for (const auto& c : moe_cases()) run_case(c, 1);
  }

  TEST_CASE("moe_block.json: the same on 2 and 4 expert-parallel ranks") {
    for (const auto& c : moe_cases()) {
      const int e = c.param<int>("num_experts");
      for (int ranks : {2, 4})
        if (e % ranks == 0) run_case(c, ranks);
    }
  }

  TEST_CASE("moe_block.json: routing weights match the reference's") {
    for (const auto& c : moe_cases()) {
      CAPTURE(c.name);
      const auto model = golden_model(c);
      mrr::TopKRouter<double> router(model.config);
      const auto logits = c.output("router_logits").matrix<double>();
      const auto r = c.fn == "moe_block_replay" ? router.replay(logits, c.input("replay_ids").matrix<std::int32_t>())
                                                : router.route(logits);
      CHECK(check_close(r.weights, c.output("weights"), c.rtol, c.atol, c.name + " weights"));
    }
  }
}
