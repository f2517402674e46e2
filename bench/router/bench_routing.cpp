// CPU routing throughput (T = 4096 tokens, k = 8, E = 64 and 256) for native routing and for
// replay (weights recomputed at given ids), beside a naive reference loop written the way a
// straightforward port of torch.softmax + torch.topk would be: full softmax with std::exp, then
// std::partial_sort of (score, index) pairs per token. The PyTorch eager figure measured on an
// H100 (bench/baselines/h100_pytorch.json) is printed for orientation, not as a CPU baseline.
// Each case is also compared with the real reference on this CPU, run in the same program by
// bench/references/reference_bench.py with the same thread count: Megatron-Core's
// topk_routing_with_score_function (native, and replay through precomputed_indices), plain torch
// gather + softmax, and Megatron's permute / unpermute. Ours runs in steady state (route_into /
// replay_into / permute_into reuse their outputs), as the reference does through its allocator.
#include <mrr/router.hpp>

#include <harness.hpp>
#include <reference_runner.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace {

mrr::RowMatrix<float> random_logits(int tokens, int experts, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.f, 1.f);
  mrr::RowMatrix<float> z(tokens, experts);
  for (Eigen::Index i = 0; i < z.size(); ++i) z.data()[i] = n(rng);
  return z;
}

// Naive softmax-then-topk (pre-softmax, renormalised: the Qwen3/Mixtral gate).
void naive_softmax_topk(const mrr::RowMatrix<float>& z, int k, mrr::ExpertIds& ids, mrr::RowMatrix<float>& w) {
  const int experts = static_cast<int>(z.cols());
  std::vector<std::pair<float, int>> scored(static_cast<std::size_t>(experts));
  for (Eigen::Index t = 0; t < z.rows(); ++t) {
    float mx = z(t, 0);
    for (int e = 1; e < experts; ++e) mx = std::max(mx, z(t, e));
    float sum = 0;
    for (int e = 0; e < experts; ++e) {
      const float p = std::exp(z(t, e) - mx);
      scored[static_cast<std::size_t>(e)] = {p, e};
      sum += p;
    }
    std::partial_sort(scored.begin(), scored.begin() + k, scored.end(),
                      [](const auto& a, const auto& b) { return a.first > b.first; });
    float top = 0;
    for (int j = 0; j < k; ++j) top += scored[static_cast<std::size_t>(j)].first;
    for (int j = 0; j < k; ++j) {
      ids(t, j) = scored[static_cast<std::size_t>(j)].second;
      w(t, j) = scored[static_cast<std::size_t>(j)].first / top;
    }
    (void)sum;
  }
}

// Naive DeepSeek-V3 gate: sigmoid, bias, group scores by sorting each group, mask, sort all.
void naive_deepseek(const mrr::RowMatrix<float>& z, const mrr::Vector<float>& bias, int k, int groups, int group_topk,
                    mrr::ExpertIds& ids, mrr::RowMatrix<float>& w) {
  const int experts = static_cast<int>(z.cols()), per = experts / groups;
  std::vector<float> s(static_cast<std::size_t>(experts)), biased(static_cast<std::size_t>(experts));
  std::vector<std::pair<float, int>> group_score(static_cast<std::size_t>(groups)), scored(static_cast<std::size_t>(experts));
  for (Eigen::Index t = 0; t < z.rows(); ++t) {
    for (int e = 0; e < experts; ++e) {
      s[static_cast<std::size_t>(e)] = 1.f / (1.f + std::exp(-z(t, e)));
      biased[static_cast<std::size_t>(e)] = s[static_cast<std::size_t>(e)] + bias[e];
    }
    for (int g = 0; g < groups; ++g) {
      std::vector<float> members(biased.begin() + g * per, biased.begin() + (g + 1) * per);
      std::sort(members.begin(), members.end(), std::greater<>());
      group_score[static_cast<std::size_t>(g)] = {members[0] + members[1], g};
    }
    std::sort(group_score.begin(), group_score.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
    std::vector<char> keep(static_cast<std::size_t>(groups), 0);
    for (int i = 0; i < group_topk; ++i) keep[static_cast<std::size_t>(group_score[static_cast<std::size_t>(i)].second)] = 1;
    for (int e = 0; e < experts; ++e)
      scored[static_cast<std::size_t>(e)] = {keep[static_cast<std::size_t>(e / per)] ? biased[static_cast<std::size_t>(e)] : 0.f, e};
    std::sort(scored.begin(), scored.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
    float sum = 0;
    for (int j = 0; j < k; ++j) sum += s[static_cast<std::size_t>(scored[static_cast<std::size_t>(j)].second)];
    for (int j = 0; j < k; ++j) {
      ids(t, j) = scored[static_cast<std::size_t>(j)].second;
      w(t, j) = 2.5f * s[static_cast<std::size_t>(scored[static_cast<std::size_t>(j)].second)] / (sum + 1e-20f);
    }
  }
}

// PyTorch eager on an H100 (bench/baselines/h100_pytorch.json), T = 4096, k = 8.
double h100_softmax_topk_us(int experts) { return experts == 64 ? 91.552 : experts == 128 ? 82.656 : 109.760; }

}  // namespace

int main() {
  const int tokens = 4096, k = 8;
  const double bw = mrr::bench::copy_bandwidth();
  const auto ref = mrr::bench::run_reference("routing");
  const auto ref_perm = mrr::bench::run_reference("permute");
  char title[128];
  std::snprintf(title, sizeof title, "CPU routing, T=4096, k=8, float32, %d thread(s)", mrr::bench::bench_threads());
  mrr::bench::print_table_header(title, bw);
  for (int experts : {64, 128, 256}) {
    const auto z = random_logits(tokens, experts, static_cast<unsigned>(experts));
    const double bytes = static_cast<double>(tokens) * experts * 4 + static_cast<double>(tokens) * k * 8;
    mrr::ExpertIds ids(tokens, k);
    mrr::RowMatrix<float> w(tokens, k);
    const std::string e = std::to_string(experts);

    mrr::TopKRouter<float> qwen(mrr::presets::qwen3_moe(experts, k));
    mrr::Routing<float> routed;
    const auto ours = mrr::bench::time_it([&] {
      qwen.route_into(routed, z);
      mrr::bench::do_not_optimize(routed.ids(0, 0));
    });
    const auto naive = mrr::bench::time_it([&] {
      naive_softmax_topk(z, k, ids, w);
      mrr::bench::do_not_optimize(ids(0, 0));
    });
    // Same answer (the naive loop breaks exact ties arbitrarily; random floats have none).
    if (qwen.route(z).ids != ids) std::printf("  warning: naive and mrr ids differ\n");
    mrr::bench::print_row("softmax top-8, E=" + e + " (route)", ours.median_s, naive.median_s, bytes, bw);
    std::printf("    -> %.1f M tokens/s (naive %.1f M tokens/s); PyTorch eager on H100: %.1f us\n",
                tokens / ours.median_s / 1e6, tokens / naive.median_s / 1e6, h100_softmax_topk_us(experts));
    mrr::bench::print_vs_reference(ref, "route_softmax_E" + e, "Megatron topk_routing (dense_output)", ours.median_s);

    const auto recorded = qwen.route(z).ids;
    mrr::Routing<float> replayed;
    const auto replay = mrr::bench::time_it([&] {
      qwen.replay_into(replayed, z, recorded);
      mrr::bench::do_not_optimize(replayed.weights(0, 0));
    });
    mrr::bench::print_row("softmax replay, E=" + e, replay.median_s, naive.median_s, bytes, bw);
    std::printf("    -> %.1f M tokens/s\n", tokens / replay.median_s / 1e6);
    mrr::bench::print_vs_reference(ref, "replay_softmax_E" + e, "Megatron precomputed_indices (dense_output)",
                                   replay.median_s);
    mrr::bench::print_vs_reference(ref, "replay_softmax_dense_E" + e, "Megatron precomputed_indices ([T,E] out)",
                                   replay.median_s);
    mrr::bench::print_vs_reference(ref, "replay_torch_gather_E" + e, "torch gather + softmax", replay.median_s);

    if (experts == 256) {
      mrr::TopKRouter<float> ds(mrr::presets::deepseek_v3(experts, k, 8, 4, true, 2.5));
      std::mt19937 rng(7);
      std::normal_distribution<float> n(0.f, 0.01f);
      mrr::Vector<float> bias(experts);
      for (int i = 0; i < experts; ++i) bias[i] = n(rng);
      ds.set_expert_bias(bias);
      mrr::Routing<float> ds_out;
      const auto ours_ds = mrr::bench::time_it([&] {
        ds.route_into(ds_out, z);
        mrr::bench::do_not_optimize(ds_out.ids(0, 0));
      });
      const auto naive_ds = mrr::bench::time_it([&] {
        naive_deepseek(z, bias, k, 8, 4, ids, w);
        mrr::bench::do_not_optimize(ids(0, 0));
      });
      mrr::bench::print_row("DeepSeek-V3 grouped sigmoid, E=256", ours_ds.median_s, naive_ds.median_s, bytes, bw);
      std::printf("    -> %.1f M tokens/s (naive %.1f M tokens/s); PyTorch eager on H100: 298.8 us\n",
                  tokens / ours_ds.median_s / 1e6, tokens / naive_ds.median_s / 1e6);
      mrr::bench::print_vs_reference(ref, "route_deepseek_E256", "Megatron grouped topk_routing", ours_ds.median_s);
    }
  }

  // Permute / unpermute, T=4096, H=1024, k=8, E=64, as Megatron's dispatcher calls them.
  {
    const int hidden = 1024, experts = 64;
    const auto z = random_logits(tokens, experts, 1);
    const auto x = random_logits(tokens, hidden, 2);
    mrr::TopKRouter<float> qwen(mrr::presets::qwen3_moe(experts, k));
    const auto dense = mrr::to_dense(qwen.route(z), experts);
    mrr::Permuted<float> permuted;
    const mrr::MatrixRef<float> probs_ref(dense.probs);
    const auto t_perm = mrr::bench::time_it([&] {
      mrr::permute_into<float>(permuted, x, dense.map, probs_ref);
      mrr::bench::do_not_optimize(permuted.tokens(0, 0));
    });
    const double moved = 2.0 * tokens * k * hidden * 4.0;
    mrr::bench::print_row("permute T=4096 H=1024 k=8 E=64", t_perm.median_s, t_perm.median_s, moved, bw);
    mrr::bench::print_vs_reference(ref_perm, "permute_T4096_H1024_k8", "Megatron permute (index_select)",
                                   t_perm.median_s);
    mrr::RowMatrix<float> restored;
    const auto t_unperm = mrr::bench::time_it([&] {
      restored = mrr::unpermute<float>(permuted.tokens, permuted.sorted_indices, tokens, probs_ref,
                                       mrr::MaskRef(dense.map));
      mrr::bench::do_not_optimize(restored(0, 0));
    });
    mrr::bench::print_row("unpermute T=4096 H=1024 k=8 E=64", t_unperm.median_s, t_unperm.median_s, moved, bw);
    mrr::bench::print_vs_reference(ref_perm, "unpermute_T4096_H1024_k8", "Megatron unpermute (scatter_add)",
                                   t_unperm.median_s);
  }
  return 0;
}
