// Quickstart: why routing replay exists, and R2 with a route file, end to end.
//
// Two "engines" compute the same MoE router logits: engine A in float32 (the training engine's
// old-log-prob pass), engine B from bf16-rounded activations (as a rollout or a differently
// fused kernel would). Without replay their router decisions differ; with R2 the update pass
// replays exactly what A recorded, while the gating weights follow B's logits (so the router
// still learns). The routes go to a checksummed route file, which is reopened and replayed again.
#include <mrr/mrr.hpp>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

namespace {

constexpr int kExperts = 64, kTopK = 8, kLayers = 4, kHidden = 256;
constexpr int kSequences = 8, kTokens = 128;

float to_bf16(float x) {  // round to nearest even on the top 16 bits
  std::uint32_t u;
  std::memcpy(&u, &x, 4);
  u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&x, &u, 4);
  return x;
}

struct Model {
  std::vector<mrr::RowMatrix<float>> gate;  // per layer [hidden, experts]
  std::vector<mrr::RowMatrix<float>> hidden;  // per layer [tokens, hidden] (stand-in activations)
};

Model make_model(std::mt19937& rng) {
  std::normal_distribution<float> n(0.f, 1.f);
  Model m;
  for (int l = 0; l < kLayers; ++l) {
    mrr::RowMatrix<float> w(kHidden, kExperts), h(kSequences * kTokens, kHidden);
    for (Eigen::Index i = 0; i < w.size(); ++i) w.data()[i] = n(rng) / 16.f;
    for (Eigen::Index i = 0; i < h.size(); ++i) h.data()[i] = n(rng);
    m.gate.push_back(w);
    m.hidden.push_back(h);
  }
  return m;
}

mrr::RowMatrix<float> logits_engine_a(const Model& m, int layer) { return m.hidden[layer] * m.gate[layer]; }
mrr::RowMatrix<float> logits_engine_b(const Model& m, int layer) {
  return m.hidden[layer].unaryExpr(&to_bf16) * m.gate[layer].unaryExpr(&to_bf16);
}

}  // namespace

int main(int argc, char** argv) {
  const std::filesystem::path file =
      argc > 1 ? std::filesystem::path(argv[1]) : std::filesystem::temp_directory_path() / "mrr_quickstart_routes.mrr";
  std::filesystem::remove(file);
  std::mt19937 rng(2024);
  const Model model = make_model(rng);
  const mrr::RouteShape shape{kExperts, kLayers, kTopK};
  std::vector<mrr::TopKRouter<float>> routers(kLayers, mrr::TopKRouter<float>(mrr::presets::qwen3_moe(kExperts, kTopK)));

  std::vector<mrr::SequenceId> uids;
  std::vector<std::int64_t> cu{0};
  for (int s = 0; s < kSequences; ++s) {
    uids.push_back(1000 + static_cast<mrr::SequenceId>(s));
    cu.push_back(cu.back() + kTokens);
  }
  const auto layout = mrr::TokenLayout::packed(uids, cu);

  std::printf("mrr %d.%d.%d quickstart: %d MoE layers, %d experts, top-%d, %d sequences x %d tokens\n\n",
              MRR_VERSION_MAJOR, MRR_VERSION_MINOR, MRR_VERSION_PATCH, kLayers, kExperts, kTopK, kSequences, kTokens);

  // 1. How much do the two engines disagree without replay?
  long decisions = 0, differing_decisions = 0;
  std::vector<char> token_differs(static_cast<std::size_t>(kSequences * kTokens), 0);
  for (int l = 0; l < kLayers; ++l) {
    const auto a = routers[l].route(logits_engine_a(model, l));
    const auto b = routers[l].route(logits_engine_b(model, l));
    for (Eigen::Index t = 0; t < a.ids.rows(); ++t)
      for (int j = 0; j < kTopK; ++j) {
        bool found = false;
        for (int i = 0; i < kTopK; ++i) found = found || a.ids(t, j) == b.ids(t, i);
        ++decisions;
        if (!found) {
          ++differing_decisions;
          token_differs[static_cast<std::size_t>(t)] = 1;
        }
      }
  }
  long tokens_differing = 0;
  for (char c : token_differs) tokens_differing += c;
  std::printf("without replay: %.2f%% of expert choices differ between engine A (fp32) and B (bf16 inputs);\n"
              "                %.1f%% of tokens see a different expert in at least one layer\n\n",
              100.0 * static_cast<double>(differing_decisions) / static_cast<double>(decisions),
              100.0 * static_cast<double>(tokens_differing) / static_cast<double>(token_differs.size()));

  // 2. R2: record in the old-log-prob pass (engine A) into a route file...
  {
    auto store = mrr::FileRouteStore::create(file, shape);
    mrr::RoutingReplay replay(mrr::ReplayMode::R2, store);
    replay.set_micro_batch(layout);
    replay.begin_pass(mrr::TrainingPass::old_log_prob);
    for (int l = 0; l < kLayers; ++l) replay.route(routers[l], l, logits_engine_a(model, l));
    std::printf("R2 old-log-prob pass: recorded %llu routes (tokens x layers) into %s\n",
                static_cast<unsigned long long>(replay.stats().recorded_rows), file.string().c_str());

    // ... and replay them in the update pass (engine B), with activation recomputation.
    replay.set_activation_recompute(true);
    replay.begin_pass(mrr::TrainingPass::actor_update);
    long mismatches = 0;
    std::vector<mrr::Routing<float>> forward;
    for (int l = 0; l < kLayers; ++l) {
      const auto native_a = routers[l].route(logits_engine_a(model, l));
      forward.push_back(replay.route(routers[l], l, logits_engine_b(model, l)));
      mismatches += (forward.back().ids.array() != native_a.ids.array()).count();
    }
    replay.begin_pass(mrr::TrainingPass::actor_recompute);
    for (int l = 0; l < kLayers; ++l) {
      const auto again = replay.route(routers[l], l, logits_engine_b(model, l));
      mismatches += (again.ids.array() != forward[static_cast<std::size_t>(l)].ids.array()).count();
    }
    std::printf("R2 update pass:     replayed %llu routes with engine B's logits: %ld expert choices differ from the\n"
                "                    recording (forward and recompute); weights are B's softmax at the replayed ids\n",
                static_cast<unsigned long long>(replay.stats().replayed_rows), mismatches);
    if (mismatches != 0) return 1;
  }

  // 3. The file outlives the process: reopen it (verified, indexed) and replay from it.
  auto reopened = mrr::FileRouteStore::open(file, shape);
  std::printf("\nreopened: %s\n", reopened.recovery().describe(file).c_str());
  mrr::RoutingReplay replay(mrr::ReplayMode::R2, reopened);
  replay.set_micro_batch(layout);
  replay.begin_pass(mrr::TrainingPass::actor_update);  // activations kept: nothing queued
  long mismatches = 0;
  for (int l = 0; l < kLayers; ++l) {
    const auto native_a = routers[l].route(logits_engine_a(model, l));
    mismatches += (replay.route(routers[l], l, logits_engine_b(model, l)).ids.array() != native_a.ids.array()).count();
  }
  std::printf("replay from the reopened file: %ld expert choices differ from the recording; file size %llu bytes "
              "(%d-byte ids)\n",
              mismatches, static_cast<unsigned long long>(std::filesystem::file_size(file)), reopened.id_width());
#ifndef MRR_READ_ROUTES_PY
#define MRR_READ_ROUTES_PY "examples/python/read_routes.py"
#endif
#ifdef MRR_PYTHON_WITH_NUMPY
  std::printf("\nread it from Python: %s %s %s --uid 1000\n", MRR_PYTHON_WITH_NUMPY, MRR_READ_ROUTES_PY,
              file.string().c_str());
#else
  std::printf("\nread it from Python (needs numpy: apt-get install python3-numpy): python3 %s %s --uid 1000\n",
              MRR_READ_ROUTES_PY, file.string().c_str());
#endif
  return mismatches == 0 ? 0 : 1;
}
