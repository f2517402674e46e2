// The MoE layer as a trainer runs it: T = 2048 tokens, hidden 256, SwiGLU experts of width 128,
// 64 experts, top-8, float. Forward, backward (of a kept forward context) and forward + backward,
// each with native routing (no replay) and with routes replayed through RoutingReplay in mode R2:
// the old-log-prob pass records every layer's ids into a MemoryRouteStore, the actor update
// replays them (every row has a route, so the controller hands the router no mask). Also the
// record forward itself, and the same replayed step on an InProcessGroup of 2 ranks (each with
// half the tokens and half the experts). Baseline: native routing in the same run; the replayed
// step should cost no more than it (replay skips the top-k selection). Prints the median wall
// time and this thread's CPU time per call; run with OMP_NUM_THREADS=1 on a shared machine, where
// only the CPU time is stable.
//
// Uses only the API every version of MoELayer since the expert-parallel layer has (forward,
// backward, RoutingReplay's passes), so the same source times the layer before and after a change.
#include <mrr/comm/in_process.hpp>
#include <mrr/moe.hpp>
#include <mrr/replay.hpp>
#include <mrr/router.hpp>

#include "harness.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <random>
#include <string>
#include <vector>

namespace {

using Scalar = float;
using Matrix = mrr::RowMatrix<Scalar>;

constexpr int kTokens = 2048, kHidden = 256, kIntermediate = 128, kExperts = 64, kTopk = 8;
constexpr int kSequenceLength = 256;

Matrix random_matrix(Eigen::Index rows, Eigen::Index cols, unsigned seed, Scalar stddev) {
  std::mt19937 rng(seed);
  std::normal_distribution<Scalar> normal(0, stddev);
  Matrix m(rows, cols);
  for (Eigen::Index i = 0; i < m.size(); ++i) m.data()[i] = normal(rng);
  return m;
}

std::vector<Scalar> random_vector(std::size_t n, unsigned seed, Scalar stddev) {
  const Matrix m = random_matrix(static_cast<Eigen::Index>(n), 1, seed, stddev);
  return {m.data(), m.data() + m.size()};
}

// The whole model (gate and every expert in torch layout) and one batch.
struct Model {
  Matrix gate = random_matrix(kExperts, kHidden, 1, 0.5f);
  std::vector<Scalar> w_gate = random_vector(std::size_t{kExperts} * kIntermediate * kHidden, 2, 0.05f);
  std::vector<Scalar> w_up = random_vector(std::size_t{kExperts} * kIntermediate * kHidden, 3, 0.05f);
  std::vector<Scalar> w_down = random_vector(std::size_t{kExperts} * kHidden * kIntermediate, 4, 0.05f);
  Matrix input = random_matrix(kTokens, kHidden, 5, 1.0f);
  Matrix grad_output = random_matrix(kTokens, kHidden, 6, 1.0f);

  static mrr::RouterConfig router_config() {
    mrr::RouterConfig c;
    c.num_experts = kExperts;
    c.topk = kTopk;
    return c;
  }

  // Rank `rank` of `ranks`'s experts (contiguous blocks, as MoELayer places them).
  mrr::SwiGLUExperts<Scalar> experts(int ranks, int rank) const {
    const int per = kExperts / ranks;
    mrr::SwiGLUExperts<Scalar> x(kHidden, kIntermediate, per, rank * per);
    x.load_torch(w_gate, w_up, w_down);
    return x;
  }
};

// Rows [begin, end) of the batch: sequence 1000 + t / kSequenceLength, position t % kSequenceLength.
mrr::TokenLayout layout_of(Eigen::Index begin, Eigen::Index end) {
  std::vector<mrr::TokenKey> rows;
  for (Eigen::Index t = begin; t < end; ++t)
    rows.push_back({static_cast<mrr::SequenceId>(1000 + t / kSequenceLength), t % kSequenceLength});
  return mrr::TokenLayout(std::move(rows));
}

int reps() {
  const char* env = std::getenv("MRR_BENCH_REPS");
  return env ? std::max(1, std::atoi(env)) : 7;
}

// This thread's CPU time in ms: with OMP_NUM_THREADS=1 it is all of a single-process step's work,
// and unlike wall time it does not grow when other processes share the cores.
double thread_cpu_ms() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e3 + static_cast<double>(ts.tv_nsec) * 1e-6;
}

struct Time {
  double wall_ms = 0, cpu_ms = 0;
};

// Medians of reps() calls after one warm-up call.
template <class F>
Time median_time(F&& f) {
  f();
  std::vector<double> wall, cpu;
  for (int i = 0; i < reps(); ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    const double c0 = thread_cpu_ms();
    f();
    cpu.push_back(thread_cpu_ms() - c0);
    wall.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(wall.begin(), wall.end());
  std::sort(cpu.begin(), cpu.end());
  return {wall[wall.size() / 2], cpu[cpu.size() / 2]};
}

struct Row {
  std::string name;
  Time time;
  Time baseline;  // native routing, same phase (zero: none)
};

void print(const std::vector<Row>& rows) {
  std::printf("%-44s %10s %10s %14s %9s\n", "case", "wall ms", "cpu ms", "native cpu ms", "cpu ratio");
  for (const Row& r : rows) {
    if (r.baseline.cpu_ms > 0)
      std::printf("%-44s %10.2f %10.2f %14.2f %8.2fx\n", r.name.c_str(), r.time.wall_ms, r.time.cpu_ms,
                  r.baseline.cpu_ms, r.time.cpu_ms / r.baseline.cpu_ms);
    else
      std::printf("%-44s %10.2f %10.2f %14s %9s\n", r.name.c_str(), r.time.wall_ms, r.time.cpu_ms, "-", "-");
  }
}

using NativeLayer = mrr::MoELayer<mrr::TopKRouter<Scalar>, mrr::SwiGLUExperts<Scalar>>;
template <class Comm>
using ReplayLayer = mrr::MoELayer<mrr::TopKRouter<Scalar>, mrr::SwiGLUExperts<Scalar>, Comm, mrr::MemoryRouteStore>;

// forward, backward of a kept context, and both, for one layer.
template <class Layer>
void time_phases(Layer& layer, const Matrix& x, const Matrix& dy, const char* label, std::vector<Row>& rows,
                 const std::vector<Row>* native) {
  const Time fwd = median_time([&] { mrr::bench::do_not_optimize(layer.forward(x).output.data()); });
  const auto kept = layer.forward(x);
  const Time bwd = median_time([&] { mrr::bench::do_not_optimize(layer.backward(kept, dy).input.data()); });
  const Time both = median_time([&] {
    const auto f = layer.forward(x);
    mrr::bench::do_not_optimize(layer.backward(f, dy).input.data());
  });
  const Time base[3] = {native ? (*native)[0].time : Time{}, native ? (*native)[1].time : Time{},
                        native ? (*native)[2].time : Time{}};
  rows.push_back({std::string(label) + " forward", fwd, base[0]});
  rows.push_back({std::string(label) + " backward", bwd, base[1]});
  rows.push_back({std::string(label) + " forward+backward", both, base[2]});
}

// The replayed training step on P ranks of an InProcessGroup (threads): each rank its contiguous
// token chunk, timed between barriers on rank 0 (CPU time: rank 0's thread, half the work).
Time replay_step_ep(const Model& model, int ranks) {
  Time median;
  mrr::InProcessGroup(ranks).run([&](const mrr::InProcessComm& comm) {
    const Eigen::Index per = kTokens / ranks, begin = comm.rank() * per;
    const Matrix x = model.input.middleRows(begin, per), dy = model.grad_output.middleRows(begin, per);
    mrr::MemoryRouteStore store({.num_experts = kExperts, .num_layers = 1, .topk = kTopk});
    mrr::RoutingReplay<mrr::MemoryRouteStore> replay(mrr::ReplayMode::R2, store);
    ReplayLayer<mrr::InProcessComm> layer(mrr::TopKRouter<Scalar>(Model::router_config()),
                                          model.experts(ranks, comm.rank()), comm, replay, 0);
    layer.set_gate_weight(model.gate);
    replay.set_micro_batch(layout_of(begin, begin + per));
    replay.begin_pass(mrr::TrainingPass::old_log_prob);
    (void)layer.forward(x);
    replay.begin_pass(mrr::TrainingPass::actor_update);
    const Time t = median_time([&] {
      comm.barrier();
      const auto f = layer.forward(x);
      mrr::bench::do_not_optimize(layer.backward(f, dy).input.data());
      comm.barrier();
    });
    if (comm.rank() == 0) median = t;
  });
  return median;
}

}  // namespace

int main() {
  std::printf("MoE layer: T=%d H=%d I=%d E=%d k=%d float, SwiGLUExperts, median of %d runs\n", kTokens, kHidden,
              kIntermediate, kExperts, kTopk, reps());
  const Model model;
  std::vector<Row> native, replayed;

  NativeLayer plain(mrr::TopKRouter<Scalar>(Model::router_config()), model.experts(1, 0));
  plain.set_gate_weight(model.gate);
  time_phases(plain, model.input, model.grad_output, "native", native, nullptr);

  // R2 as a trainer runs it: the old-log-prob pass records, the actor update replays.
  mrr::MemoryRouteStore store({.num_experts = kExperts, .num_layers = 1, .topk = kTopk});
  mrr::RoutingReplay<mrr::MemoryRouteStore> replay(mrr::ReplayMode::R2, store);
  ReplayLayer<mrr::SingleProcess> layer(mrr::TopKRouter<Scalar>(Model::router_config()), model.experts(1, 0),
                                        mrr::SingleProcess{}, replay, 0);
  layer.set_gate_weight(model.gate);
  replay.set_micro_batch(layout_of(0, kTokens));
  replay.begin_pass(mrr::TrainingPass::old_log_prob);
  const Time record = median_time([&] { mrr::bench::do_not_optimize(layer.forward(model.input).output.data()); });
  replayed.push_back({"R2 record forward (old_log_prob)", record, native[0].time});
  replay.begin_pass(mrr::TrainingPass::actor_update);
  time_phases(layer, model.input, model.grad_output, "R2 replay", replayed, &native);
  const bool mask_free = replay.stats().mask_free_replays > 0;

  const Time ep2 = replay_step_ep(model, 2);
  replayed.push_back({"R2 replay forward+backward, P=2 (rank 0)", ep2, native[2].time});

  std::vector<Row> all = native;
  all.insert(all.end(), replayed.begin(), replayed.end());
  print(all);
  std::printf("replays that took the mask-free path: %s\n", mask_free ? "yes" : "no");
  return 0;
}
