// The whole MoE layer as a trainer runs it, beside PyTorch and the GEMM limit, from one run.
//
// Per shape (Qwen3-, Mixtral- and DeepSeek-like ratios at laptop scale, float32) and per thread
// count (1 and 2, MRR_BENCH_THREADS): forward, backward and forward + backward of
//   - mrr's MoELayer<TopKRouter, SwiGLUExperts, SingleProcess, MemoryRouteStore>, with native
//     routing and with routes replayed through RoutingReplay in mode R2 (the old-log-prob pass
//     records, the actor update replays), in steady state as a training loop runs it: a kept
//     forward context (forward(x, f)) and kept gradients (backward_accumulate);
//   - (a) the Hugging Face Qwen2/Qwen3-MoE SparseMoeBlock (a loop over the experts hit, each
//     gathering its tokens, index_add_ back) and (b) a grouped block (tokens sorted by expert, one
//     matmul chain per expert, one scatter back, as Megatron's grouped MLP), in PyTorch with
//     autograd, native and replayed, run by bench/references/reference_bench.py --suite moe in the
//     same run with the same thread count (OPENBLAS_NUM_THREADS set too; the BLAS it loaded is
//     printed);
//   - the GEMM limit: the forward's expert FLOPs (6 R H I for R routed rows) and the forward +
//     backward's (18 R H I: what autograd needs, and mrr, whose experts keep their activations by
//     default; with save_activations(false) the backward recomputes two products, 22 R H I) at the
//     best GEMM rate measured on this machine at the shape's rows per expert, Eigen's (this build)
//     or PyTorch's BLAS; and beside it the core's measured fused multiply-add peak, which no GEMM
//     on one thread can beat.
// Then the replayed step on P = 2 and 4 in-process ranks (threads; each rank its token chunk).
// Wall-time medians. MRR_BENCH_SHAPES=qwen3,mixtral,deepseek picks shapes, MRR_BENCH_REPS the
// repetitions, MRR_BENCH_NO_REFERENCE=1 skips PyTorch.
#include <mrr/comm/in_process.hpp>
#include <mrr/moe.hpp>
#include <mrr/replay.hpp>
#include <mrr/router.hpp>

#include <harness.hpp>
#include <reference_runner.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#endif

#ifndef MRR_BENCH_FLAGS
#define MRR_BENCH_FLAGS "the toolchain's default target"
#endif

namespace {

using Scalar = float;
using Matrix = mrr::RowMatrix<Scalar>;

struct Shape {
  std::string name;
  int tokens, hidden, intermediate, experts, topk;
  mrr::RouterConfig router;
  const char* torch_router;  // reference_bench.py's routing: softmax_norm or deepseek
  double rows_per_expert() const { return static_cast<double>(tokens) * topk / experts; }
  double expert_flops(double per_row_hi) const { return per_row_hi * tokens * topk * double(hidden) * intermediate; }
};

std::vector<Shape> all_shapes() {
  auto deepseek = mrr::presets::deepseek_v3(256, 8, 8, 4);
  return {{"qwen3", 2048, 256, 128, 64, 8, mrr::presets::qwen3_moe(64, 8), "softmax_norm"},
          {"mixtral", 2048, 256, 896, 8, 2, mrr::presets::mixtral(8, 2), "softmax_norm"},
          {"deepseek", 2048, 256, 64, 256, 8, deepseek, "deepseek"}};
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, sep);)
    if (!item.empty()) out.push_back(item);
  return out;
}

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
  Shape s;
  Matrix gate, input, grad_output;
  std::vector<Scalar> w_gate, w_up, w_down;
  explicit Model(Shape shape) : s(std::move(shape)) {
    const auto n = static_cast<std::size_t>(s.experts) * s.intermediate * s.hidden;
    gate = random_matrix(s.experts, s.hidden, 1, 0.5f);
    w_gate = random_vector(n, 2, 0.05f);
    w_up = random_vector(n, 3, 0.05f);
    w_down = random_vector(n, 4, 0.05f);
    input = random_matrix(s.tokens, s.hidden, 5, 1.0f);
    grad_output = random_matrix(s.tokens, s.hidden, 6, 1.0f);
  }
  mrr::SwiGLUExperts<Scalar> experts(int ranks, int rank) const {
    const int per = s.experts / ranks;
    mrr::SwiGLUExperts<Scalar> x(s.hidden, s.intermediate, per, rank * per);
    x.load_torch(w_gate, w_up, w_down);
    return x;
  }
  mrr::RouteShape route_shape() const { return {.num_experts = s.experts, .num_layers = 1, .topk = s.topk}; }
};

// Rows [begin, end) of the batch: sequence 1000 + t / 256, position t % 256.
mrr::TokenLayout layout_of(Eigen::Index begin, Eigen::Index end) {
  std::vector<mrr::TokenKey> rows;
  for (Eigen::Index t = begin; t < end; ++t)
    rows.push_back({static_cast<mrr::SequenceId>(1000 + t / 256), t % 256});
  return mrr::TokenLayout(std::move(rows));
}

int reps() {
  const char* env = std::getenv("MRR_BENCH_REPS");
  return env ? std::max(1, std::atoi(env)) : 7;
}

// Median wall seconds of reps() calls after one warm-up call.
template <class F>
double median_s(F&& f) {
  f();
  std::vector<double> t;
  for (int i = 0; i < reps(); ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

using Layer =
    mrr::MoELayer<mrr::TopKRouter<Scalar>, mrr::SwiGLUExperts<Scalar>, mrr::SingleProcess, mrr::MemoryRouteStore>;
template <class Comm>
using EpLayer = mrr::MoELayer<mrr::TopKRouter<Scalar>, mrr::SwiGLUExperts<Scalar>, Comm, mrr::MemoryRouteStore>;

struct Phases {
  double forward = 0, backward = 0, step = 0;
};

// forward, backward of a kept context, and both, in steady state (kept context and gradients).
Phases time_layer(Layer& layer, const Model& m) {
  Layer::Forward f;
  Layer::Gradients g{Matrix(), Matrix(), layer.experts().zero_gradients()};
  Phases p;
  p.forward = median_s([&] { layer.forward(m.input, f); });
  layer.forward(m.input, f);
  p.backward = median_s([&] { layer.backward_accumulate(f, m.grad_output, g); });
  p.step = median_s([&] {
    layer.forward(m.input, f);
    layer.backward_accumulate(f, m.grad_output, g);
  });
  mrr::bench::do_not_optimize(g.input.data());
  return p;
}

// Eigen's GEMM rate (FLOP/s) at one expert's forward product: [n, H] x [H, I].
double eigen_gemm_flops(const Shape& s) {
  const auto n = static_cast<Eigen::Index>(std::max(1.0, s.rows_per_expert()));
  const Matrix a = random_matrix(n, s.hidden, 8, 1.0f), b = random_matrix(s.intermediate, s.hidden, 9, 1.0f);
  Matrix c(n, s.intermediate);
  const mrr::bench::Timing t = mrr::bench::time_it(
      [&] {
        c.noalias() = a * b.transpose();
        mrr::bench::do_not_optimize(c.data());
      },
      0.3, 20);
  return 2.0 * double(n) * s.hidden * s.intermediate / t.min_s;
}

// The core's fused multiply-add peak (FLOP/s): 12 independent accumulator chains of the widest
// vector this build targets, enough to cover the FMA latency on current x86 cores. What no GEMM
// on one thread can beat; the GEMM limit above sits below it by the kernel's own losses.
double fma_peak_flops() {
#if defined(__AVX512F__)
  using V = __m512;
  constexpr int lanes = 16;
  const auto fma = [](V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); };
  const auto splat = [](float x) { return _mm512_set1_ps(x); };
  const auto first = [](V a) { return _mm512_cvtss_f32(a); };
#elif defined(__FMA__)
  using V = __m256;
  constexpr int lanes = 8;
  const auto fma = [](V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); };
  const auto splat = [](float x) { return _mm256_set1_ps(x); };
  const auto first = [](V a) { return _mm256_cvtss_f32(a); };
#else
  using V = float;
  constexpr int lanes = 1;
  const auto fma = [](V a, V b, V c) { return a * b + c; };
  const auto splat = [](float x) { return x; };
  const auto first = [](V a) { return a; };
#endif
  constexpr int chains = 12;  // named, not an array, so that each stays in a register
  constexpr long steps = 20'000'000;
  const V scale = splat(0.999999f), shift = splat(1e-7f);
  const mrr::bench::Timing t = mrr::bench::time_it(
      [&] {
        V a0 = splat(0.0f), a1 = splat(0.1f), a2 = splat(0.2f), a3 = splat(0.3f), a4 = splat(0.4f), a5 = splat(0.5f),
          a6 = splat(0.6f), a7 = splat(0.7f), a8 = splat(0.8f), a9 = splat(0.9f), a10 = splat(1.0f), a11 = splat(1.1f);
        for (long i = 0; i < steps; ++i) {
#define MRR_BENCH_CHAIN(a)  \
  a = fma(a, scale, shift); \
  asm volatile("" : "+v"(a));  // one chain, unmerged
          MRR_BENCH_CHAIN(a0)
          MRR_BENCH_CHAIN(a1) MRR_BENCH_CHAIN(a2) MRR_BENCH_CHAIN(a3) MRR_BENCH_CHAIN(a4) MRR_BENCH_CHAIN(a5)
              MRR_BENCH_CHAIN(a6) MRR_BENCH_CHAIN(a7) MRR_BENCH_CHAIN(a8) MRR_BENCH_CHAIN(a9) MRR_BENCH_CHAIN(a10)
                  MRR_BENCH_CHAIN(a11)
#undef MRR_BENCH_CHAIN
        }
        mrr::bench::do_not_optimize(first(a0) + first(a1) + first(a2) + first(a3) + first(a4) + first(a5) + first(a6) +
                                    first(a7) + first(a8) + first(a9) + first(a10) + first(a11));
      },
      0.2, 3);
  return 2.0 * lanes * chains * static_cast<double>(steps) / t.min_s;
}

// The replayed training step on P in-process ranks (threads), rank 0's wall time between barriers.
double replay_step_ep(const Model& m, int ranks) {
  double median = 0;
  mrr::InProcessGroup(ranks).run([&](const mrr::InProcessComm& comm) {
    const Eigen::Index per = m.s.tokens / ranks, begin = comm.rank() * per;
    const Matrix x = m.input.middleRows(begin, per), dy = m.grad_output.middleRows(begin, per);
    mrr::MemoryRouteStore store(m.route_shape());
    mrr::RoutingReplay<mrr::MemoryRouteStore> replay(mrr::ReplayMode::R2, store);
    EpLayer<mrr::InProcessComm> layer(mrr::TopKRouter<Scalar>(m.s.router), m.experts(ranks, comm.rank()), comm, replay,
                                      0);
    layer.set_gate_weight(m.gate);
    replay.set_micro_batch(layout_of(begin, begin + per));
    replay.begin_pass(mrr::TrainingPass::old_log_prob);
    (void)layer.forward(x);
    replay.begin_pass(mrr::TrainingPass::actor_update);
    decltype(layer)::Forward f;
    decltype(layer)::Gradients g{Matrix(), Matrix(), layer.experts().zero_gradients()};
    const double t = median_s([&] {
      comm.barrier();
      layer.forward(x, f);
      layer.backward_accumulate(f, dy, g);
      comm.barrier();
    });
    if (comm.rank() == 0) median = t;
  });
  return median;
}

void set_threads(int n) {
#ifdef _OPENMP
  omp_set_num_threads(n);
#else
  (void)n;
#endif
}

double ref(const std::map<std::string, double>& r, const std::string& key) {
  const auto it = r.find(key);
  return it == r.end() ? 0.0 : it->second;
}

void print_row(const char* phase, const char* mode, double ours, double hf, double grouped, double limit) {
  std::printf("  %-9s %-7s %9.1f", phase, mode, ours * 1e3);
  if (hf > 0)
    std::printf(" %9.1f %9.1f %7.2fx %7.2fx", hf * 1e3, grouped * 1e3, hf / ours, grouped / ours);
  else
    std::printf(" %9s %9s %8s %8s", "-", "-", "-", "-");
  std::printf(" %9.1f %7.2fx", limit * 1e3, ours / limit);
  // The ratios a layer running at the GEMM limit would get: where the reference itself runs near
  // the limit (large products at a fast BLAS), no GEMM-bound layer beats it by more.
  if (hf > 0) std::printf(" %7.2fx %7.2fx", hf / limit, grouped / limit);
  std::printf("\n");
}

}  // namespace

int main() {
  const char* shapes_env = std::getenv("MRR_BENCH_SHAPES");
  const char* threads_env = std::getenv("MRR_BENCH_THREADS");
  const auto wanted = split(shapes_env ? shapes_env : "qwen3,mixtral,deepseek", ',');
  std::vector<int> thread_counts;
  for (const auto& t : split(threads_env ? threads_env : "1,2", ','))
    thread_counts.push_back(std::max(1, std::atoi(t.c_str())));
  std::vector<Shape> shapes;
  for (const auto& s : all_shapes())
    if (std::find(wanted.begin(), wanted.end(), s.name) != wanted.end()) shapes.push_back(s);
  std::string torch_shapes;
  for (const auto& s : shapes) {
    if (!torch_shapes.empty()) torch_shapes += ';';
    torch_shapes += s.name + "," + std::to_string(s.tokens) + "," + std::to_string(s.hidden) + "," +
                    std::to_string(s.intermediate) + "," + std::to_string(s.experts) + "," + std::to_string(s.topk) +
                    "," + s.torch_router;
  }
  std::printf(
      "MoE layer, float32, median of %d runs; mrr = MoELayer<TopKRouter, SwiGLUExperts, SingleProcess, "
      "MemoryRouteStore>\nratio = reference / mrr (> 1: mrr faster); of limit = mrr / GEMM limit; HF/lim, grp/lim =\n"
      "reference / GEMM limit, the ratios a layer running at the GEMM limit would get\n"
      "mrr built with: %s\n",
      reps(), MRR_BENCH_FLAGS);
  const double peak = fma_peak_flops();
  std::printf("core FMA peak (measured, one thread): %.1f GFLOP/s\n", peak * 1e-9);
  std::vector<Model> models;
  for (const auto& s : shapes)
    models.emplace_back(s);

  for (const int threads : thread_counts) {
    set_threads(threads);
    const auto reference = mrr::bench::run_reference("moe", threads, "--moe-shapes '" + torch_shapes + "'");
    for (const Model& m : models) {
      const Shape& s = m.s;
      std::printf("\n== %s: T=%d H=%d I=%d E=%d k=%d (%.0f rows per expert), %d thread%s\n", s.name.c_str(), s.tokens,
                  s.hidden, s.intermediate, s.experts, s.topk, s.rows_per_expert(), threads, threads > 1 ? "s" : "");
      const double eigen_rate = eigen_gemm_flops(s);
      const double torch_rate =
          ref(reference, "moe_" + s.name + "_gemm_flops") * 1e6 * 1e6;  // MFLOP/s in seconds' slot
      const double rate = std::max(eigen_rate, torch_rate);
      std::printf(
          "  GEMM rate at [%.0f, %d] x [%d, %d]: Eigen %.1f GFLOP/s, PyTorch's BLAS %s GFLOP/s; limit uses %.1f\n",
          std::max(1.0, s.rows_per_expert()), s.hidden, s.hidden, s.intermediate, eigen_rate * 1e-9,
          torch_rate > 0 ? std::to_string(torch_rate * 1e-9).substr(0, 5).c_str() : "-", rate * 1e-9);
      if (threads == 1)
        std::printf("  that rate is %.0f%% of the core's FMA peak; a layer at the peak would take %.2fx the limit\n",
                    100.0 * rate / peak, rate / peak);
      const double limit_fwd = s.expert_flops(6) / rate, limit_step = s.expert_flops(18) / rate;

      mrr::MemoryRouteStore store(m.route_shape());
      mrr::RoutingReplay<mrr::MemoryRouteStore> native_replay(mrr::ReplayMode::disabled, store);
      Layer native(mrr::TopKRouter<Scalar>(s.router), m.experts(1, 0), mrr::SingleProcess{}, native_replay, 0);
      native.set_gate_weight(m.gate);
      const Phases pn = time_layer(native, m);

      mrr::RoutingReplay<mrr::MemoryRouteStore> replay(mrr::ReplayMode::R2, store);
      Layer layer(mrr::TopKRouter<Scalar>(s.router), m.experts(1, 0), mrr::SingleProcess{}, replay, 0);
      layer.set_gate_weight(m.gate);
      replay.set_micro_batch(layout_of(0, s.tokens));
      replay.begin_pass(mrr::TrainingPass::old_log_prob);
      const double record = median_s([&] { mrr::bench::do_not_optimize(layer.forward(m.input).output.data()); });
      replay.begin_pass(mrr::TrainingPass::actor_update);
      const Phases pr = time_layer(layer, m);

      std::printf("  %-9s %-7s %9s %9s %9s %8s %8s %9s %8s %8s %8s\n", "phase", "routes", "mrr ms", "HF ms", "group ms",
                  "HF/mrr", "grp/mrr", "limit ms", "of limit", "HF/lim", "grp/lim");
      const std::string k = "moe_" + s.name;
      for (const auto& [mode, p] : {std::pair<const char*, const Phases&>{"native", pn}, {"replay", pr}}) {
        auto r = [&](const char* block, const char* phase) {
          return ref(reference, k + "_" + block + "_" + mode + "_" + phase);
        };
        print_row("forward", mode, p.forward, r("hf", "forward"), r("grouped", "forward"), limit_fwd);
        print_row("backward", mode, p.backward, r("hf", "backward"), r("grouped", "backward"), limit_step - limit_fwd);
        print_row("fwd+bwd", mode, p.step, r("hf", "step"), r("grouped", "step"), limit_step);
      }
      std::printf(
          "  R2 record forward (old-log-prob pass, fresh context): %.1f ms; replays on the mask-free path: %s\n",
          record * 1e3, replay.stats().mask_free_replays > 0 ? "yes" : "no");
    }
  }
  set_threads(1);
  for (const Model& m : models) {
    if (m.s.experts % 4 != 0) continue;
    std::printf("\n%s replayed forward+backward on in-process ranks, 1 thread each (rank 0, wall):", m.s.name.c_str());
    for (int ranks : {2, 4})
      std::printf("  P=%d %.1f ms", ranks, replay_step_ep(m, ranks) * 1e3);
    std::printf("\n");
  }
  return 0;
}
