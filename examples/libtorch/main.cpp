// A libtorch MoE model whose routing goes through mrr (docs/integration.md, "libtorch"):
// gate (torch::nn::Linear) -> mrr::torch::route(RoutingReplay, TopKRouter, layer, logits) ->
// torch experts (SwiGLU per expert) -> combine with the routing weights, trained with Adam for a
// few steps in each replay mode:
//   disabled                   native routing everywhere;
//   R2 memory                  the old-log-prob pass records, the update passes replay;
//   R2 record_file->replay_file  routes recorded into a route file, replayed from it after reopening;
//   R3                         routes of a rollout pass (bf16 gate, as a rollout engine runs it),
//                              imported as vLLM returns them ([n - 1, layers, k]), replayed.
// Each mode checks, and exits non-zero when a check fails:
//   - recorded ids equal torch::topk of the same softmax (the ids a pure-torch router picks);
//   - replayed ids equal the recorded ones after the weights drifted (every update step);
//   - the output and the gate's gradient equal a pure-torch formula (softmax, gather, renormalise,
//     the same experts) within float tolerance.
// Built against the installed package: find_package(mrr) and find_package(Torch).
#include <mrr/replay.hpp>
#include <mrr/router.hpp>
#include <mrr/torch/router.hpp>

#include <torch/torch.h>

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

namespace {

constexpr int kLayers = 2, kExperts = 16, kTopK = 4, kHidden = 32, kFfn = 16;
constexpr int kSequences = 6, kLength = 12;

int failures = 0;
void check(bool ok, const std::string& what) {
  if (!ok) {
    ++failures;
    std::printf("  FAILED: %s\n", what.c_str());
  }
}
float max_abs(const torch::Tensor& a) { return a.abs().max().item<float>(); }

// One MoE layer: gate, mrr routing, SwiGLU experts, combine.
struct MoELayerImpl : torch::nn::Module {
  torch::nn::Linear gate{nullptr};
  torch::Tensor w_gate, w_up, w_down;  // [E, H, F], [E, H, F], [E, F, H]

  MoELayerImpl() {
    gate = register_module("gate", torch::nn::Linear(torch::nn::LinearOptions(kHidden, kExperts).bias(false)));
    w_gate = register_parameter("w_gate", torch::randn({kExperts, kHidden, kFfn}) * 0.2);
    w_up = register_parameter("w_up", torch::randn({kExperts, kHidden, kFfn}) * 0.2);
    w_down = register_parameter("w_down", torch::randn({kExperts, kFfn, kHidden}) * 0.2);
  }

  torch::Tensor expert(int e, const torch::Tensor& x) const {
    return torch::matmul(torch::silu(torch::matmul(x, w_gate[e])) * torch::matmul(x, w_up[e]), w_down[e]);
  }

  // out[t] = sum_j weights[t, j] * expert_{ids[t, j]}(x[t]), by expert (the HF block's loop).
  torch::Tensor combine(const torch::Tensor& x, const torch::Tensor& weights, const torch::Tensor& ids) const {
    torch::Tensor out = torch::zeros_like(x);
    for (int e = 0; e < kExperts; ++e) {
      const torch::Tensor hit = ids.eq(e);                      // [T, k]
      const torch::Tensor rows = hit.any(1).nonzero().squeeze(1);  // tokens routed to e
      if (rows.numel() == 0) continue;
      const torch::Tensor w = (weights * hit.to(weights.scalar_type())).sum(1).index_select(0, rows);
      out.index_add_(0, rows, expert(e, x.index_select(0, rows)) * w.unsqueeze(1));
    }
    return out;
  }
};
TORCH_MODULE(MoELayer);

struct Model : torch::nn::Module {
  std::vector<MoELayer> layers;
  const mrr::TopKRouter<float>* router;
  explicit Model(const mrr::TopKRouter<float>& r) : router(&r) {
    for (int l = 0; l < kLayers; ++l) layers.push_back(register_module("layer" + std::to_string(l), MoELayer()));
  }

  // Runs the layers through mrr; returns the output and each layer's (logits, ids).
  template <class Store>
  torch::Tensor forward(mrr::RoutingReplay<Store>& replay, torch::Tensor x, std::vector<torch::Tensor>* ids_out,
                        std::vector<torch::Tensor>* logits_out = nullptr) {
    for (int l = 0; l < kLayers; ++l) {
      const torch::Tensor logits = layers[l]->gate(x);
      const auto r = mrr::torch::route(replay, *router, l, logits);
      if (ids_out) ids_out->push_back(r.ids);
      if (logits_out) logits_out->push_back(logits);
      x = x + layers[l]->combine(x, r.weights, r.ids);
    }
    return x;
  }
};

// The same model in pure torch for given ids: softmax, gather, renormalise (HF Qwen3-MoE's gate).
torch::Tensor reference_forward(Model& m, torch::Tensor x, const std::vector<torch::Tensor>& ids) {
  for (int l = 0; l < kLayers; ++l) {
    const torch::Tensor probs = torch::softmax(m.layers[l]->gate(x), 1);
    torch::Tensor w = probs.gather(1, ids[l]);
    w = w / w.sum(1, true);
    x = x + m.layers[l]->combine(x, w, ids[l]);
  }
  return x;
}

// Every sequence is a row of the batch; real tokens are the first kLength - b % 3 of row b.
struct Batch {
  torch::Tensor x, uids, mask;
  mrr::TokenLayout layout;
};
Batch make_batch() {
  Batch b;
  b.x = torch::randn({kSequences * kLength, kHidden});
  b.uids = torch::arange(100, 100 + kSequences, torch::kLong);  // one id per response
  b.mask = torch::ones({kSequences, kLength}, torch::kLong);
  for (int s = 0; s < kSequences; ++s)
    if (s % 3) b.mask.index_put_({s, torch::indexing::Slice(kLength - s % 3, torch::indexing::None)}, 0);
  b.layout = mrr::torch::padded_layout(b.uids, b.mask);
  return b;
}

// The ids of real tokens (padding rows are never recorded or compared).
torch::Tensor real_rows(const torch::Tensor& t, const torch::Tensor& mask) {
  return t.index_select(0, mask.reshape(-1).nonzero().squeeze(1));
}

// Output and gate gradient of mrr's path against the pure-torch formula for the same ids.
template <class Store>
void check_against_torch(Model& model, mrr::RoutingReplay<Store>& replay, const Batch& b, const char* mode) {
  model.zero_grad();
  std::vector<torch::Tensor> ids;
  const torch::Tensor out = model.forward(replay, b.x, &ids);
  out.pow(2).mean().backward();
  std::vector<torch::Tensor> grads;
  for (auto& l : model.layers) grads.push_back(l->gate->weight.grad().clone());
  model.zero_grad();
  const torch::Tensor ref = reference_forward(model, b.x, ids);
  ref.pow(2).mean().backward();
  const float out_err = max_abs(out - ref) / std::max(1e-12f, max_abs(ref));
  float grad_err = 0;
  for (int l = 0; l < kLayers; ++l)
    grad_err = std::max(grad_err, max_abs(grads[l] - model.layers[l]->gate->weight.grad()) /
                                      std::max(1e-12f, max_abs(model.layers[l]->gate->weight.grad())));
  std::printf("  %-12s output vs pure torch: %.2e relative; gate gradient: %.2e relative\n", mode, out_err, grad_err);
  check(out_err < 1e-5f, std::string(mode) + ": output equals the pure-torch formula");
  check(grad_err < 1e-4f, std::string(mode) + ": gate gradient equals the pure-torch formula");
  model.zero_grad();
}

// The ids torch.topk picks from the softmax of the same logits, on real rows.
void check_topk(const std::vector<torch::Tensor>& logits, const std::vector<torch::Tensor>& ids, const Batch& b,
                const char* what) {
  for (int l = 0; l < kLayers; ++l) {
    const torch::Tensor expect = std::get<1>(torch::topk(torch::softmax(logits[l].detach(), 1), kTopK));
    check(torch::equal(real_rows(expect, b.mask), real_rows(ids[l], b.mask)),
          std::string(what) + ": ids equal torch::topk, layer " + std::to_string(l));
  }
}

// A few optimizer steps in the update pass; every step's replayed ids must equal `recorded`.
template <class Store>
void train(Model& model, mrr::RoutingReplay<Store>& replay, const Batch& b, const std::vector<torch::Tensor>& recorded,
           const char* mode, int steps = 3) {
  torch::optim::Adam opt(model.parameters(), torch::optim::AdamOptions(1e-2));
  long drifted = 0;
  for (int step = 0; step < steps; ++step) {
    replay.begin_pass(mrr::TrainingPass::actor_update);
    replay.set_micro_batch(b.layout);
    std::vector<torch::Tensor> ids, logits;
    opt.zero_grad();
    const torch::Tensor out = model.forward(replay, b.x, &ids, &logits);
    out.pow(2).mean().backward();
    opt.step();
    for (int l = 0; l < kLayers; ++l) {
      if (!recorded.empty())
        check(torch::equal(real_rows(ids[l], b.mask), real_rows(recorded[l], b.mask)),
              std::string(mode) + ": replayed ids equal the recorded ones, step " + std::to_string(step));
      // As sets: whether the experts themselves changed, not only their order.
      const torch::Tensor native = std::get<0>(std::get<1>(torch::topk(logits[l].detach(), kTopK)).sort(1));
      const torch::Tensor used = std::get<0>(ids[l].sort(1));
      drifted += real_rows(native, b.mask).ne(real_rows(used, b.mask)).any(1).sum().item<long>();
    }
  }
  std::printf("  %-12s %d update steps; rows whose native top-%d set differs from the ids used: %ld\n", mode, steps,
              kTopK, drifted);
}

}  // namespace

int main() {
  torch::manual_seed(0);
  const mrr::TopKRouter<float> router(mrr::presets::qwen3_moe(kExperts, kTopK));
  const mrr::RouteShape shape{kExperts, kLayers, kTopK};
  const Batch b = make_batch();
  const auto dir = std::filesystem::temp_directory_path() / ("mrr_libtorch_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);

  try {
    {  // disabled: native routing everywhere
      Model model(router);
      mrr::RoutingReplay<mrr::NoRouteStore> replay(mrr::ReplayMode::disabled);
      replay.set_micro_batch(b.layout);
      std::vector<torch::Tensor> ids, logits;
      torch::NoGradGuard no_grad;
      model.forward(replay, b.x, &ids, &logits);
      check_topk(logits, ids, b, "disabled");
    }
    {  // disabled, with gradients
      Model model(router);
      mrr::RoutingReplay<mrr::NoRouteStore> replay(mrr::ReplayMode::disabled);
      replay.set_micro_batch(b.layout);
      check_against_torch(model, replay, b, "disabled");
      train(model, replay, b, {}, "disabled");
    }
    {  // R2, routes in memory
      Model model(router);
      mrr::MemoryRouteStore store(shape);
      mrr::RoutingReplay<mrr::MemoryRouteStore> replay(mrr::ReplayMode::R2, store);
      replay.begin_pass(mrr::TrainingPass::old_log_prob);
      replay.set_micro_batch(b.layout);
      std::vector<torch::Tensor> recorded, logits;
      {
        torch::NoGradGuard no_grad;
        model.forward(replay, b.x, &recorded, &logits);
      }
      check_topk(logits, recorded, b, "R2 memory");
      replay.begin_pass(mrr::TrainingPass::actor_update);
      replay.set_micro_batch(b.layout);
      check_against_torch(model, replay, b, "R2 memory");
      train(model, replay, b, recorded, "R2 memory");
    }
    {  // R2 through a route file: record_file, then a new store replays it as replay_file
      const auto path = (dir / "routes.mrr").string();
      Model model(router);
      std::vector<torch::Tensor> recorded;
      {
        mrr::ReplayConfig cfg;
        cfg.set(mrr::ReplayConfig::kMode, "R2");
        cfg.set(mrr::ReplayConfig::kRecordFile, path);
        auto store = mrr::AnyRouteStore::from_config(cfg, shape);
        mrr::RoutingReplay<mrr::AnyRouteStore> replay(cfg.mode, store);
        replay.begin_pass(mrr::TrainingPass::old_log_prob);
        replay.set_micro_batch(b.layout);
        torch::NoGradGuard no_grad;
        model.forward(replay, b.x, &recorded);
      }  // the store closes the file
      mrr::ReplayConfig cfg;
      cfg.set(mrr::ReplayConfig::kMode, "R2");
      cfg.set(mrr::ReplayConfig::kReplayFile, path);
      auto store = mrr::AnyRouteStore::from_config(cfg, shape);
      check(store.is_file(), "R2 file: replay_file opens the route file");
      mrr::RoutingReplay<mrr::AnyRouteStore> replay(cfg.mode, store);
      train(model, replay, b, recorded, "R2 file");
    }
    {  // R3: a rollout pass with a bf16 gate routes natively; its routes come back as vLLM's
       // routed_experts [n - 1, layers, k] per response and are replayed by training.
      Model model(router);
      mrr::MemoryRouteStore store(shape);
      std::vector<torch::Tensor> rollout_ids;
      {
        torch::NoGradGuard no_grad;
        torch::Tensor x = b.x;
        for (int l = 0; l < kLayers; ++l) {
          const torch::Tensor logits = model.layers[l]->gate(x.to(torch::kBFloat16).to(torch::kFloat))
                                           .to(torch::kBFloat16)
                                           .to(torch::kFloat);
          const auto r = mrr::torch::route(router, logits);
          rollout_ids.push_back(r.ids);
          x = x + model.layers[l]->combine(x, r.weights, r.ids);
        }
      }
      for (int s = 0; s < kSequences; ++s) {
        const long n = b.mask[s].sum().item<long>();
        std::vector<torch::Tensor> per_layer;  // [n - 1, k] each
        for (int l = 0; l < kLayers; ++l)
          per_layer.push_back(rollout_ids[l].slice(0, s * kLength, s * kLength + n - 1));
        const torch::Tensor routed = torch::stack(per_layer, 1).to(torch::kInt).contiguous();  // [n - 1, L, k]
        mrr::import_routed_experts<mrr::MemoryRouteStore, std::int32_t>(
            store, static_cast<mrr::SequenceId>(b.uids[s].item<long>()),
            std::span<const std::int32_t>(routed.data_ptr<std::int32_t>(), static_cast<std::size_t>(routed.numel())),
            n - 1, kLayers, kTopK);
      }
      mrr::RoutingReplay<mrr::MemoryRouteStore> replay(mrr::ReplayMode::R3, store);
      // The last token of each response has no route (vLLM never ran it): it routes natively, so
      // compare all other real tokens.
      torch::Tensor last = torch::zeros_like(b.mask);
      for (int s = 0; s < kSequences; ++s) last[s][b.mask[s].sum().item<long>() - 1] = 1;
      Batch without_last = b;
      without_last.mask = b.mask * (1 - last);
      replay.begin_pass(mrr::TrainingPass::actor_update);
      replay.set_micro_batch(b.layout);
      check_against_torch(model, replay, b, "R3");
      train(model, replay, without_last, rollout_ids, "R3");
      std::printf("  %-12s replayed rows %llu, natively routed last tokens %llu\n", "R3",
                  static_cast<unsigned long long>(replay.stats().replayed_rows),
                  static_cast<unsigned long long>(replay.stats().native_rows));
      check(replay.stats().native_rows == static_cast<std::uint64_t>(4 * kSequences * kLayers),
            "R3: exactly the last token of each response routed natively");
    }
    {  // int64 ids are range-checked, never narrowed
      bool threw = false;
      try {
        const torch::Tensor logits = torch::randn({2, kExperts});
        mrr::torch::replay(router, logits, torch::full({2, kTopK}, (std::int64_t{1} << 32) + 3, torch::kLong));
      } catch (const mrr::InvalidArgument& e) {
        threw = std::string(e.what()).find("4294967299") != std::string::npos;
      }
      check(threw, "an int64 id of 2^32 + 3 is an error naming it");
    }
  } catch (const std::exception& e) {
    std::printf("error: %s\n", e.what());
    ++failures;
  }
  std::filesystem::remove_all(dir);
  std::printf("%s\n", failures == 0 ? "libtorch example: all checks passed" : "libtorch example: checks FAILED");
  return failures == 0 ? 0 : 1;
}
