// moe_grpo: an MoE policy trained with GRPO, showing what router replay does.
//
//   moe_grpo mode=R3 steps=40                          # one run, one rank
//   moe_grpo --ranks 4 mode=R2                         # four expert-parallel ranks on threads
//   mpirun -n 2 moe_grpo_mpi mode=R3                   # two MPI processes
//   moe_grpo actor_rollout_ref.actor.router_replay.mode=R3
//            actor_rollout_ref.rollout.enable_rollout_routing_replay=true
//            actor_rollout_ref.actor.router_replay.record_file=routes.mrr
//
// Writes <trainer.default_local_dir>/<experiment>.csv (one row per step) and prints a summary.
#include "options.hpp"

#include <unistd.h>
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <stdexcept>
#include <string>
#include <vector>

#if MOE_GRPO_WITH_MPI
#include <mrr/comm/mpi.hpp>
#else
#include <mrr/comm/in_process.hpp>
#endif

namespace {

using moe_grpo::StepMetrics;

constexpr const char* kCsvHeader =
    "step,reward,accuracy,response_length,rollout_mismatch_decisions,rollout_mismatch_tokens,compared_rows,"
    "k3_kl,k1_kl,max_abs_dlogp,mean_abs_dlogp,update_mismatch_decisions,loss,pg_clipfrac,ppo_kl,kl_loss,"
    "load_max_over_mean,replayed_rows,native_rows,recorded_rows,wall_seconds,params_digest,routes_digest,"
    "paired_native_mismatch_decisions,paired_native_mismatch_tokens,paired_native_k3,paired_native_mean_abs_dlogp,"
    "paired_replay_mismatch_decisions,paired_replay_k3,paired_replay_mean_abs_dlogp,paired_replayed_rows,"
    "rollout_decisions_differing,rollout_mean_differing_layers,f2,f5,p99_abs_dlogp,"
    "paired_native_decisions_differing,paired_native_f2,paired_replay_f2,floor_k3,grad_norm,entropy,"
    "rollout_rs_masked_fraction";

void write_csv_row(std::ostream& out, const StepMetrics& m) {
  char line[1536];
  std::snprintf(
      line, sizeof line,
      "%d,%.6g,%.6g,%.4g,%.6g,%.6g,%lld,%.6g,%.6g,%.6g,%.6g,%.6g,%.9g,%.6g,%.6g,%.6g,%.4g,%llu,%llu,%llu,%.4f,"
      "%016llx,%016llx,%.6g,%.6g,%.6g,%.6g,%.6g,%.6g,%.6g,%llu,%.6g,%.6g,%.6g,%.6g,%.6g,%.6g,%.6g,%.6g,%.6g,%.6g,%.6g,"
      "%.6g\n",
      m.step, m.reward, m.accuracy, m.response_length, m.rollout_mismatch_decisions, m.rollout_mismatch_tokens,
      static_cast<long long>(m.compared_rows), m.k3, m.k1, m.max_abs_dlogp, m.mean_abs_dlogp,
      m.update_mismatch_decisions, m.loss, m.pg_clipfrac, m.ppo_kl, m.kl_loss, m.load_max_over_mean,
      static_cast<unsigned long long>(m.replayed_rows), static_cast<unsigned long long>(m.native_rows),
      static_cast<unsigned long long>(m.recorded_rows), m.wall_seconds,
      static_cast<unsigned long long>(m.params_digest), static_cast<unsigned long long>(m.routes_digest),
      m.paired_native_mismatch_decisions, m.paired_native_mismatch_tokens, m.paired_native_k3,
      m.paired_native_mean_abs_dlogp, m.paired_replay_mismatch_decisions, m.paired_replay_k3,
      m.paired_replay_mean_abs_dlogp, static_cast<unsigned long long>(m.paired_replayed_rows),
      m.rollout_decisions_differing, m.rollout_mean_differing_layers, m.f2, m.f5, m.p99_abs_dlogp,
      m.paired_native_decisions_differing, m.paired_native_f2, m.paired_replay_f2, m.floor_k3, m.grad_norm, m.entropy,
      m.rollout_rs_masked_fraction);
  out << line;
  out.flush();
  if (!out) throw std::runtime_error("writing a CSV row failed (disk full?)");
}

// A progress bar on a terminal, plain lines otherwise (logs, CI, pipes).
class Progress {
 public:
  Progress(int total, std::string name, bool enabled)
      : total_(total), name_(std::move(name)), tty_(enabled && ::isatty(::fileno(stderr)) != 0) {}
  void update(const StepMetrics& m) {
    if (tty_) {
      const int width = 24, filled = total_ > 0 ? (m.step + 1) * width / total_ : width;
      std::fprintf(stderr, "\r%-8s [%s%s] %3d/%d reward %.3f mismatch %5.2f%% k3 %.2e %.2fs/step ", name_.c_str(),
                   std::string(static_cast<std::size_t>(filled), '#').c_str(),
                   std::string(static_cast<std::size_t>(width - filled), ' ').c_str(), m.step + 1, total_, m.reward,
                   100 * m.rollout_mismatch_decisions, m.k3, m.wall_seconds);
      if (m.step + 1 == total_) std::fprintf(stderr, "\n");
    } else {
      std::fprintf(stderr,
                   "%s step %d/%d reward %.3f acc %.3f mismatch %.4f (tokens %.4f) k3 %.3e max|dlogp| %.3f "
                   "update-mismatch %.4f loss %.5f clipfrac %.4f load %.2f %.2fs\n",
                   name_.c_str(), m.step + 1, total_, m.reward, m.accuracy, m.rollout_mismatch_decisions,
                   m.rollout_mismatch_tokens, m.k3, m.max_abs_dlogp, m.update_mismatch_decisions, m.loss, m.pg_clipfrac,
                   m.load_max_over_mean, m.wall_seconds);
    }
  }

 private:
  int total_;
  std::string name_;
  bool tty_;
};

double mean_of(const std::vector<double>& v) {
  double s = 0;
  for (const double x : v) s += x;
  return v.empty() ? 0 : s / static_cast<double>(v.size());
}

double median_of(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t h = v.size() / 2;
  return v.size() % 2 ? v[h] : 0.5 * (v[h - 1] + v[h]);
}

// One value per step.
template <class F>
std::vector<double> per_step(const std::vector<StepMetrics>& ms, F f) {
  std::vector<double> v;
  for (const auto& m : ms) v.push_back(f(m));
  return v;
}

void print_help() {
  std::puts(
      "moe_grpo: GRPO on a small MoE policy (a + b task), router replay disabled / R2 / R3.\n"
      "usage: moe_grpo [--ranks N] [--config FILE.yaml] [--no-progress] [key=value ...]\n"
      "  mode=disabled|R2|R3  (short for actor_rollout_ref.actor.router_replay.mode, and sets\n"
      "                        actor_rollout_ref.rollout.enable_rollout_routing_replay for R3)\n"
      "  actor_rollout_ref.actor.router_replay.{mode,record_file,replay_file}\n"
      "  actor_rollout_ref.rollout.enable_rollout_routing_replay=true|false\n"
      "  steps= seed= batch= group= mini_batch= lr= loss_agg_mode= adv_estimator= kl_loss_type= out= name=\n"
      "  (verl names: trainer.total_training_steps, data.train_batch_size, actor_rollout_ref.rollout.n, ...;\n"
      "   an unknown key lists them all)");
}

template <class Comm>
int run_rank(const moe_grpo::RunOptions& o, Comm comm, std::vector<StepMetrics>* out) {
  moe_grpo::Trainer<Comm> trainer(o.train, comm);
  const bool root = comm.rank() == 0;
  std::ofstream csv;
  std::unique_ptr<Progress> progress;
  if (root) {
    const auto csv_path = std::filesystem::path(o.output_dir) / (o.experiment + ".csv");
    csv.open(csv_path);
    csv << kCsvHeader << "\n";
    if (!csv) throw std::runtime_error("cannot write " + csv_path.string());
    progress = std::make_unique<Progress>(o.train.steps, o.experiment, o.progress);
  }
  trainer.run([&](const StepMetrics& m) {
    if (!root) return;
    write_csv_row(csv, m);
    progress->update(m);
    out->push_back(m);
  });
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
#if MOE_GRPO_WITH_MPI
  mrr::MpiSession session(&argc, &argv);
#endif
  std::vector<std::string> args(argv + 1, argv + argc);
  for (const auto& a : args)
    if (a == "--help" || a == "-h") {
      print_help();
      return 0;
    }
  try {
    const moe_grpo::RunOptions o = moe_grpo::parse_options(args);
    // Before the trainer opens a record_file, which may lie inside it.
    std::filesystem::create_directories(o.output_dir);
    std::vector<StepMetrics> metrics;
    int ranks = o.ranks, rank = 0;
#if MOE_GRPO_WITH_MPI
    mrr::MpiCommunicator comm;
    ranks = comm.size();
    rank = comm.rank();
    run_rank(o, comm, &metrics);
#else
    mrr::InProcessGroup group(o.ranks);
    group.run([&](const mrr::InProcessComm& comm) { run_rank(o, comm, &metrics); });
#endif
    if (rank != 0 || metrics.empty()) return 0;
    const auto& ms = metrics;
    const auto k3 = per_step(ms, [](const StepMetrics& m) { return m.k3; });
    const auto native = per_step(ms, [](const StepMetrics& m) { return m.paired_native_k3; });
    const auto replayed = per_step(ms, [](const StepMetrics& m) { return m.paired_replay_k3; });
    std::vector<double> ratio;  // native / replayed, step by step (the same weights and tokens)
    for (const auto& m : ms)
      if (m.paired_replay_k3 > 0) ratio.push_back(m.paired_native_k3 / m.paired_replay_k3);
    double seconds = 0;
    for (const auto& m : ms) seconds += m.wall_seconds;
    // Final reward: mean of the last quarter of the steps (one step's reward is noisy).
    const std::size_t tail = std::max<std::size_t>(1, ms.size() / 4);
    double final_reward = 0;
    for (std::size_t i = ms.size() - tail; i < ms.size(); ++i) final_reward += ms[i].reward;
    final_reward /= static_cast<double>(tail);
    std::printf(
        "summary mode=%s ranks=%d steps=%zu final_reward=%.4f first_reward=%.4f mismatch_decisions=%.6f "
        "mismatch_tokens=%.6f k3_kl=%.4e k3_kl_median=%.4e mean_abs_dlogp=%.4e update_mismatch=%.6f "
        "paired_native_mismatch=%.6f paired_native_k3=%.4e paired_native_k3_median=%.4e paired_replay_mismatch=%.6f "
        "paired_replay_k3=%.4e paired_replay_k3_median=%.4e paired_k3_ratio_median=%.4f seconds=%.1f "
        "digest=%016llx routes=%016llx csv=%s\n",
        std::string(mrr::to_string(o.train.replay.mode)).c_str(), ranks, ms.size(), final_reward, ms.front().reward,
        mean_of(per_step(ms, [](const StepMetrics& m) { return m.rollout_mismatch_decisions; })),
        mean_of(per_step(ms, [](const StepMetrics& m) { return m.rollout_mismatch_tokens; })), mean_of(k3),
        median_of(k3), mean_of(per_step(ms, [](const StepMetrics& m) { return m.mean_abs_dlogp; })),
        mean_of(per_step(ms, [](const StepMetrics& m) { return m.update_mismatch_decisions; })),
        mean_of(per_step(ms, [](const StepMetrics& m) { return m.paired_native_mismatch_decisions; })), mean_of(native),
        median_of(native), mean_of(per_step(ms, [](const StepMetrics& m) { return m.paired_replay_mismatch_decisions; })),
        mean_of(replayed), median_of(replayed), median_of(ratio), seconds,
        static_cast<unsigned long long>(ms.back().params_digest), static_cast<unsigned long long>(ms.back().routes_digest),
        (std::filesystem::path(o.output_dir) / (o.experiment + ".csv")).string().c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moe_grpo: %s\n", e.what());
    return 1;
  }
}
