// PPO / GRPO on the CPU against verl's own code: each shape runs through verl's core_algos (run as
// is by bench/references/reference_bench.py, PyTorch CPU, the same thread count as ours) and
// through mrr in the same program, which prints both times and ratio = verl / mrr (> 1: mrr is
// faster), with the memory-bandwidth limit of the bytes mrr moves. Both sides report the minimum of
// repeated calls (on a shared machine, the figure least disturbed by others). Steady state on both sides:
// mrr's `_into` forms write into outputs reused across calls (as PyTorch's caching allocator
// reuses its buffers). OMP_NUM_THREADS sets the thread count of both.
#include <mrr/ppo/advantage.hpp>
#include <mrr/ppo/kl.hpp>
#include <mrr/ppo/policy_loss.hpp>

#include <harness.hpp>
#include <reference_runner.hpp>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <map>
#include <random>
#include <string>
#include <vector>

#ifndef MRR_BUILD_FLAGS_NOTE
#ifdef MRR_BENCH_BUILD
#define MRR_BUILD_FLAGS_NOTE MRR_BENCH_BUILD
#else
#define MRR_BUILD_FLAGS_NOTE "no -march"
#endif
#endif

namespace {

using namespace mrr;
using Reference = std::map<std::string, double>;

// Padded responses of random length in [L/4, L] (as the reference script's batch()).
RowMatrix<float> random_mask(Eigen::Index rows, Eigen::Index cols, std::mt19937& gen) {
  std::uniform_int_distribution<Eigen::Index> length(cols / 4, cols);
  RowMatrix<float> mask = RowMatrix<float>::Zero(rows, cols);
  for (Eigen::Index i = 0; i < rows; ++i)
    mask.row(i).head(length(gen)).setOnes();
  return mask;
}

RowMatrix<float> random_normal(Eigen::Index rows, Eigen::Index cols, float scale, std::mt19937& gen) {
  std::normal_distribution<float> normal(0.f, scale);
  RowMatrix<float> m(rows, cols);
  for (Eigen::Index i = 0; i < m.size(); ++i)
    m.data()[i] = normal(gen);
  return m;
}

std::string shape(Eigen::Index rows, Eigen::Index cols) {
  return "B" + std::to_string(rows) + "_L" + std::to_string(cols);
}

// One table row: ours beside verl's time for the same case (reference missing: ours only).
void row(const Reference& ref, const std::string& key, const std::string& label, double ours_s, double bytes,
         double bandwidth) {
  const auto it = ref.find(key);
  bench::print_row(label, ours_s, it != ref.end() ? it->second : 0.0, bytes, bandwidth);
}

void gae(const Reference& ref, double bw) {
  const Eigen::Index rows = 512, cols = 4096;
  std::mt19937 gen(42);
  const auto mask = random_mask(rows, cols, gen);
  const auto rewards = random_normal(rows, cols, 0.01f, gen), values = random_normal(rows, cols, 1.f, gen);
  ppo::AdvantageResult<float> out;
  const auto t = bench::time_it([&] {
    ppo::compute_gae_advantage_return_into<float>(out, rewards, values, mask, 0.99, 0.95);
    bench::do_not_optimize(out.advantages(0, 0));
  });
  // Reads rewards, values, mask; writes advantages and returns; the whitening reads and writes
  // the advantages again.
  row(ref, "gae_" + shape(rows, cols), "gae B=512 L=4096 (advantages, returns)", t.min_s,
      7.0 * rows * cols * sizeof(float), bw);
}

void grpo(const Reference& ref, Eigen::Index rows, Eigen::Index cols, double bw) {
  std::mt19937 gen(43);
  const auto mask = random_mask(rows, cols, gen);
  RowMatrix<float> outcome = RowMatrix<float>::Zero(rows, cols);
  for (Eigen::Index i = 0; i < rows; ++i) {
    Eigen::Index last = 0;
    for (Eigen::Index j = 0; j < cols; ++j)
      if (mask(i, j) != 0.f) last = j;
    outcome(i, last) = static_cast<float>(gen() % 2);
  }
  std::vector<std::int64_t> uids;
  for (Eigen::Index i = 0; i < rows; ++i)
    uids.push_back(1000 + i / 8);  // rollout.n = 8
  const std::string s = shape(rows, cols), label = " B=" + std::to_string(rows) + " L=" + std::to_string(cols);
  const double bytes = 3.0 * static_cast<double>(rows * cols) * sizeof(float);  // rewards, mask in; advantages out

  // verl returns one tensor as both advantages and returns: the single-output form is the like.
  // The GroupIndex (hashing the uids) is built inside the timed call, as verl builds its dict.
  RowMatrix<float> advantages(rows, cols);
  const auto t = bench::time_it([&] {
    const ppo::GroupIndex index(uids);
    ppo::compute_grpo_outcome_advantage_into<float>(advantages, outcome, mask, index);
    bench::do_not_optimize(advantages(0, 0));
  });
  row(ref, "grpo_" + s, "grpo" + label + " (one output)", t.min_s, bytes, bw);
  ppo::AdvantageResult<float> both;
  const auto t_both = bench::time_it([&] {
    const ppo::GroupIndex index(uids);
    ppo::compute_grpo_outcome_advantage_into<float>(both, outcome, mask, index);
    bench::do_not_optimize(both.advantages(0, 0));
  });
  row(ref, "grpo_" + s, "grpo" + label + " (AdvantageResult: 2 outputs)", t_both.min_s, bytes * 4 / 3, bw);
  const auto t_vec = bench::time_it([&] {
    const ppo::GroupIndex index(uids);
    ppo::compute_grpo_vectorized_outcome_advantage_into<float>(advantages, outcome, mask, index);
    bench::do_not_optimize(advantages(0, 0));
  });
  row(ref, "grpo_vectorized_" + s, "grpo_vectorized" + label + " (one output)", t_vec.min_s, bytes, bw);
}

// verl's optimal token baselines (single- and multi-turn) and GDPO without components, groups of
// 8 as GRPO's: old log-probs in (-3, 0), sum_pi_squared between pi^2 and 1.
void token_baselines(const Reference& ref, Eigen::Index rows, Eigen::Index cols, double bw) {
  std::mt19937 gen(45);
  const auto mask = random_mask(rows, cols, gen);
  std::uniform_real_distribution<float> uniform(0.f, 1.f);
  RowMatrix<float> outcome = RowMatrix<float>::Zero(rows, cols), old_log_prob(rows, cols), sum_pi_squared(rows, cols);
  for (Eigen::Index i = 0; i < rows; ++i) {
    Eigen::Index last = 0;
    for (Eigen::Index j = 0; j < cols; ++j) {
      old_log_prob(i, j) = -3.f * uniform(gen);
      const float pi = std::exp(old_log_prob(i, j));
      sum_pi_squared(i, j) = pi * pi + (1.f - pi * pi) * 0.5f * uniform(gen);
      if (mask(i, j) != 0.f) last = j;
    }
    outcome(i, last) = static_cast<float>(gen() % 2);
  }
  std::vector<std::int64_t> uids;
  for (Eigen::Index i = 0; i < rows; ++i)
    uids.push_back(1000 + i / 8);
  const std::string s = shape(rows, cols), label = " B=" + std::to_string(rows) + " L=" + std::to_string(cols);
  // Reads rewards, mask, log-probs, sum_pi_squared; writes and reads back the cumulative path
  // variance; writes advantages and returns.
  const double bytes = 8.0 * static_cast<double>(rows * cols) * sizeof(float);
  ppo::AdvantageResult<float> out;
  for (const bool multi_turn : {false, true}) {
    const auto t = bench::time_it([&] {
      const ppo::GroupIndex index(uids);
      if (multi_turn)
        ppo::compute_multi_turn_optimal_token_baseline_advantage_into<float>(out, outcome, mask, index, old_log_prob,
                                                                             sum_pi_squared);
      else
        ppo::compute_optimal_token_baseline_advantage_into<float>(out, outcome, mask, index, old_log_prob,
                                                                  sum_pi_squared);
      bench::do_not_optimize(out.advantages(0, 0));
    });
    const std::string name = multi_turn ? "tir_optimal_token_baseline" : "optimal_token_baseline";
    row(ref, name + "_" + s, name + label, t.min_s, bytes, bw);
  }
  const auto t_gdpo = bench::time_it([&] {
    const ppo::GroupIndex index(uids);
    ppo::compute_gdpo_outcome_advantage_into<float>(out, outcome, mask, index);
    bench::do_not_optimize(out.advantages(0, 0));
  });
  // Reads rewards and mask; writes the advantages, reads them twice (moments, whitening), copies them.
  row(ref, "gdpo_" + s, "gdpo" + label + " (summed rewards)", t_gdpo.min_s,
      6.0 * static_cast<double>(rows * cols) * sizeof(float), bw);
}

// The other outcome estimators on token_baselines' batch (one outcome reward per response, groups
// of 8): REINFORCE++ (gamma 1, verl's default), REINFORCE++ with baseline, ReMax (random greedy
// baselines), RLOO, OPO, GPG, pass@k GRPO, all through AdvantageResult (advantages and returns;
// verl returns one tensor twice for the broadcasts).
void outcome_estimators(const Reference& ref, Eigen::Index rows, Eigen::Index cols, double bw) {
  std::mt19937 gen(45);
  const auto mask = random_mask(rows, cols, gen);
  RowMatrix<float> outcome = RowMatrix<float>::Zero(rows, cols);
  Vector<float> baselines(rows);
  std::uniform_real_distribution<float> uniform(0.f, 1.f);
  std::vector<std::int64_t> uids;
  for (Eigen::Index i = 0; i < rows; ++i) {
    Eigen::Index last = 0;
    for (Eigen::Index j = 0; j < cols; ++j)
      if (mask(i, j) != 0.f) last = j;
    outcome(i, last) = static_cast<float>(gen() % 2);
    baselines[i] = uniform(gen);
    uids.push_back(1000 + i / 8);
  }
  const std::string s = shape(rows, cols), label = " B=" + std::to_string(rows) + " L=" + std::to_string(cols);
  const double elems = static_cast<double>(rows * cols) * sizeof(float);
  ppo::AdvantageResult<float> out;
  const auto time = [&](const std::string& name, double bytes, auto&& call) {
    const auto t = bench::time_it([&] {
      call();
      bench::do_not_optimize(out.advantages(0, 0));
    });
    row(ref, name + "_" + s, name + label, t.min_s, bytes, bw);
  };
  // Bytes: the inputs read once and the outputs written once (the mask checks and the
  // whitening's passes are extra).
  time("reinforce_plus_plus", 4 * elems,
       [&] { ppo::compute_reinforce_plus_plus_outcome_advantage_into<float>(out, outcome, mask, 1.0); });
  time("reinforce_plus_plus_baseline", 4 * elems, [&] {
    const ppo::GroupIndex index(uids);
    ppo::compute_reinforce_plus_plus_baseline_outcome_advantage_into<float>(out, outcome, mask, index);
  });
  time("remax", 4 * elems, [&] { ppo::compute_remax_outcome_advantage_into<float>(out, outcome, baselines, mask); });
  time("rloo", 4 * elems, [&] {
    const ppo::GroupIndex index(uids);
    ppo::compute_rloo_outcome_advantage_into<float>(out, outcome, mask, index);
  });
  time("rloo_vectorized", 4 * elems, [&] {
    const ppo::GroupIndex index(uids);
    ppo::compute_rloo_vectorized_outcome_advantage_into<float>(out, outcome, mask, index);
  });
  RowMatrix<float> one(rows, cols);
  for (const bool vectorized : {false, true}) {
    const auto t = bench::time_it([&] {
      const ppo::GroupIndex index(uids);
      if (vectorized)
        ppo::compute_rloo_vectorized_outcome_advantage_into<float>(one, outcome, mask, index);
      else
        ppo::compute_rloo_outcome_advantage_into<float>(one, outcome, mask, index);
      bench::do_not_optimize(one(0, 0));
    });
    const std::string name = vectorized ? "rloo_vectorized" : "rloo";
    row(ref, name + "_" + s, name + label + " (one output)", t.min_s, 3 * elems, bw);
  }
  time("opo", 4 * elems, [&] {
    const ppo::GroupIndex index(uids);
    ppo::compute_opo_outcome_advantage_into<float>(out, outcome, mask, index);
  });
  time("gpg", 4 * elems, [&] {
    const ppo::GroupIndex index(uids);
    ppo::compute_gpg_outcome_advantage_into<float>(out, outcome, mask, index);
  });
  time("grpo_passk", 4 * elems, [&] {
    const ppo::GroupIndex index(uids);
    ppo::compute_grpo_passk_outcome_advantage_into<float>(out, outcome, mask, index);
  });
}

void kl_and_policy(const Reference& ref, Eigen::Index rows, Eigen::Index cols, double bw) {
  std::mt19937 gen(44);
  const auto mask = random_mask(rows, cols, gen);
  std::uniform_real_distribution<float> uniform(0.f, 3.f);
  RowMatrix<float> logprob(rows, cols);
  for (Eigen::Index i = 0; i < logprob.size(); ++i)
    logprob.data()[i] = -uniform(gen);
  const RowMatrix<float> ref_logprob = logprob + random_normal(rows, cols, 0.1f, gen);
  const auto adv = random_normal(rows, cols, 1.f, gen);
  const std::string s = shape(rows, cols), label = " B=" + std::to_string(rows) + " L=" + std::to_string(cols);
  const double elems = static_cast<double>(rows * cols) * sizeof(float);

  RowMatrix<float> values(rows, cols), grad(rows, cols);
  const auto t_fwd = bench::time_it([&] {
    ppo::kl_penalty_forward_into<float>(values, logprob, ref_logprob, ppo::KlEstimator::k3);
    bench::do_not_optimize(values(0, 0));
  });
  row(ref, "kl_low_var_kl_" + s, "kl low_var_kl" + label + " (forward)", t_fwd.min_s, 3 * elems, bw);
  const ppo::KlPenalty k3{ppo::KlEstimator::k3, false};
  const auto t_grad = bench::time_it([&] {
    ppo::kl_penalty_into<float>(values, grad, logprob, ref_logprob, k3);
    bench::do_not_optimize(grad(0, 0));
  });
  row(ref, "kl_low_var_kl_" + s, "kl low_var_kl" + label + " (+ gradient)", t_grad.min_s, 4 * elems, bw);

  // verl's reference: compute_policy_loss_vanilla forward (old = ref_logprob, as the script does),
  // clip 0.2 / 0.28, dual clip 3. Ours also writes d loss / d log_prob.
  ppo::PolicyLossConfig config;
  config.clip_ratio_low = 0.2;
  config.clip_ratio_high = 0.28;
  ppo::PolicyLossResult<float> loss;
  const auto t_pl = bench::time_it([&] {
    ppo::compute_policy_loss_vanilla_into<float>(loss, ref_logprob, logprob, adv, mask, ppo::LossAggMode::token_mean,
                                                 config);
    bench::do_not_optimize(loss.loss);
  });
  row(ref, "policy_vanilla_token_mean_" + s, "vanilla loss token-mean" + label + " (+ gradient)", t_pl.min_s,
      6 * elems, bw);
}

}  // namespace

int main() {
  const double bw = bench::copy_bandwidth();
  const auto ref = bench::run_reference("ppo");
  char title[200];
  std::snprintf(title, sizeof title,
                "PPO on the CPU, float32, %d thread(s), %s; baseline = verl core_algos (PyTorch CPU), same "
                "run; min of repeats; speedup = verl / mrr",
                bench::bench_threads(), MRR_BUILD_FLAGS_NOTE);
  bench::print_table_header(title, bw);
  gae(ref, bw);
  grpo(ref, 4096, 1024, bw);
  grpo(ref, 512, 4096, bw);
  token_baselines(ref, 512, 4096, bw);
  outcome_estimators(ref, 512, 4096, bw);
  kl_and_policy(ref, 512, 4096, bw);
  kl_and_policy(ref, 256, 1024, bw);
  if (ref.empty()) std::printf("(reference unavailable: baseline column is 0)\n");
  return 0;
}
