// The Thrust backend on the OpenMP system (OMP_NUM_THREADS threads) beside the CPU backend for the
// same operation, and the bytes-moved limit at the machine's measured copy bandwidth. The issue's
// shapes; pass a scale divisor as argv[1] to shrink T (and B) on small machines.
#include <mrr/ppo/advantage.hpp>
#include <mrr/router.hpp>
#include <mrr/thrust/permute.hpp>
#include <mrr/thrust/ppo.hpp>
#include <mrr/thrust/routing.hpp>

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

namespace {

template <class F>
double best_ms(F&& f, int reps = 3) {
  double best = 1e300;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    best = std::min(best, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

double copy_gbps() {
  std::vector<char> a(std::size_t(1) << 28, 1), b(a.size());
  const double ms = best_ms([&] { std::memcpy(b.data(), a.data(), a.size()); });
  return 2.0 * static_cast<double>(a.size()) / (ms * 1e6);  // read + write
}

void row(const char* op, double dev_ms, double cpu_ms, double bytes, double gbps) {
  std::printf("%-44s thrust-omp %9.2f ms   cpu %9.2f ms   cpu/omp %5.2fx   limit %8.2f ms\n", op, dev_ms, cpu_ms,
              cpu_ms / dev_ms, bytes / (gbps * 1e6));
}

mrr::RowMatrix<float> logits(long t, int e, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.f, 1.f);
  mrr::RowMatrix<float> z(t, e);
  for (Eigen::Index i = 0; i < z.size(); ++i) z.data()[i] = n(rng);
  return z;
}

}  // namespace

int main(int argc, char** argv) {
  const long scale = argc > 1 ? std::max(1L, std::atol(argv[1])) : 1;
  const double gbps = copy_gbps();
  std::printf("threads %d, memcpy bandwidth %.1f GB/s (read + write), T divided by %ld\n", omp_get_max_threads(), gbps,
              scale);
  if (std::getenv("OMP_WAIT_POLICY") == nullptr)
    std::printf("note: OMP_WAIT_POLICY is unset; on a shared machine set it to passive, or threads spinning at each\n"
                "      parallel region's end take the cores the others need\n");
  const long T = 65536 / scale;
  {  // softmax top-8 + renorm, E = 256
    const auto z = logits(T, 256, 1);
    const auto cfg = mrr::presets::qwen3_moe(256, 8, true);
    mrr::TopKRouter<float> cpu(cfg);
    mrr::device::TopKRouter<float> dev(cfg);
    const thrust::device_vector<float> dz(z.data(), z.data() + z.size());
    const double d = best_ms([&] { (void)dev.route(dz); }), c = best_ms([&] { (void)cpu.route(z); });
    row("softmax top-8 + renorm T=65536 E=256", d, c, static_cast<double>(T) * (256 * 4 + 8 * 8), gbps);
    const auto ids = cpu.route(z).ids;
    const thrust::device_vector<std::int32_t> did(ids.data(), ids.data() + ids.size());
    const double dr = best_ms([&] { (void)dev.replay(dz, did); }), cr = best_ms([&] { (void)cpu.replay(z, ids); });
    row("replay weights at given ids T=65536 E=256", dr, cr, static_cast<double>(T) * (8 * 4 + 8 * 4 + 8 * 4 * 2), gbps);
  }
  {  // DeepSeek-V3 grouped sigmoid top-8 with bias
    const auto z = logits(T, 256, 2);
    const auto cfg = mrr::presets::deepseek_v3(256, 8, 8, 4, true, 2.5);
    mrr::TopKRouter<float> cpu(cfg);
    mrr::device::TopKRouter<float> dev(cfg);
    std::vector<float> bias(256, 0.01f);
    cpu.set_expert_bias(Eigen::Map<const mrr::Vector<float>>(bias.data(), 256));
    dev.set_expert_bias(bias);
    const thrust::device_vector<float> dz(z.data(), z.data() + z.size());
    const double d = best_ms([&] { (void)dev.route(dz); }), c = best_ms([&] { (void)cpu.route(z); });
    row("DeepSeek-V3 grouped sigmoid+bias T=65536 E=256", d, c, static_cast<double>(T) * (256 * 4 + 8 * 8), gbps);
  }
  {  // permute T=65536 H=2048 k=8, 2-byte elements (bf16 bytes)
    const long H = 2048;
    const auto z = logits(T, 256, 3);
    mrr::TopKRouter<float> cpu(mrr::presets::qwen3_moe(256, 8, true));
    const auto routing = cpu.route(z);
    std::vector<std::uint16_t> x(static_cast<std::size_t>(T * H), 7);
    const thrust::device_vector<std::uint16_t> dx(x.begin(), x.end());
    const thrust::device_vector<std::int32_t> did(routing.ids.data(), routing.ids.data() + routing.ids.size());
    // Both sides write into an output buffer kept across steps, as a training loop does.
    thrust::device_vector<std::uint16_t> dout;
    mrr::RowMatrix<std::uint16_t> out(T * 8, H);
    const double d = best_ms([&] {
      const auto pp = mrr::device::make_expert_permutation(did, T, 8, 256);
      mrr::device::permute_tokens<std::uint16_t>(dx, H, pp, dout);
    }, 3);
    const double c = best_ms([&] {
      const auto pp = mrr::make_expert_permutation(routing, 256);
      for (std::int64_t r = 0; r < pp.rows(); ++r)
        std::memcpy(out.row(r).data(), x.data() + pp.source_token[static_cast<std::size_t>(r)] * H, H * 2);
    }, 3);
    row("permute T=65536 H=2048 k=8 (2-byte)", d, c, static_cast<double>(T) * 8 * H * 2 * 2, gbps);
    const double dp = best_ms([&] { (void)mrr::device::make_expert_permutation(did, T, 8, 256); });
    const double cp = best_ms([&] { (void)mrr::make_expert_permutation(routing, 256); });
    row("  permutation only (count, scan, place)", dp, cp, static_cast<double>(T) * 8 * 4 * 4, gbps);
  }
  {  // combine T=16384 H=2048 k=8 (fp32), and capacity dropping of a top-8 routing (T=65536, E=256)
    const long Tc = T / 4, H = 2048;
    const auto z = logits(Tc, 256, 5);
    mrr::TopKRouter<float> cpu(mrr::presets::qwen3_moe(256, 8, true));
    const auto routing = cpu.route(z);
    const auto perm = mrr::make_expert_permutation(routing, 256);
    const mrr::RowMatrix<float> y = logits(perm.rows(), static_cast<int>(H), 6);
    const thrust::device_vector<std::int32_t> did(routing.ids.data(), routing.ids.data() + routing.ids.size());
    const auto dp = mrr::device::make_expert_permutation(did, Tc, 8, 256);
    const thrust::device_vector<float> dy(y.data(), y.data() + y.size());
    const thrust::device_vector<float> dw(routing.weights.data(), routing.weights.data() + routing.weights.size());
    const double d = best_ms([&] { (void)mrr::device::combine<float>(dy, H, dw, dp); });
    const double c = best_ms([&] { (void)mrr::combine<float>(y, routing, perm); });
    row("combine T=16384 H=2048 k=8 (fp32)", d, c, static_cast<double>(Tc) * 9 * H * 4, gbps);

    auto cfg = mrr::presets::qwen3_moe(256, 8, true);
    cfg.capacity_factor = 1.0;
    const auto zc = logits(T, 256, 7);
    const auto base = mrr::TopKRouter<float>(mrr::presets::qwen3_moe(256, 8, true)).route(zc);
    const thrust::device_vector<float> dzc(zc.data(), zc.data() + zc.size());
    const thrust::device_vector<std::int32_t> dids(base.ids.data(), base.ids.data() + base.ids.size());
    for (const auto policy : {mrr::DropPolicy::probs, mrr::DropPolicy::position}) {
      cfg.drop_policy = policy;
      mrr::device::TopKRouter<float> dev(cfg);
      const double with = best_ms([&] { (void)dev.replay(dzc, dids); });
      cfg.capacity_factor.reset();
      mrr::device::TopKRouter<float> plain(cfg);
      const double without = best_ms([&] { (void)plain.replay(dzc, dids); });
      cfg.capacity_factor = 1.0;
      const double host = best_ms([&] {
        auto r = base;
        mrr::drop_over_capacity(r, 256, 1.0, policy);
      });
      row(policy == mrr::DropPolicy::probs ? "capacity drop (probs) T=65536 E=256 k=8" :
                                              "capacity drop (position) T=65536 E=256 k=8",
          with - without, host, static_cast<double>(T) * 8 * (4 + 4 + 1) * 2, gbps);
    }
  }
  {  // GAE B=512 L=4096 (double)
    const long B = 512 / scale, L = 4096;
    mrr::RowMatrix<double> r(B, L), v(B, L), m = mrr::RowMatrix<double>::Ones(B, L);
    std::mt19937 rng(4);
    std::normal_distribution<double> n(0.0, 1.0);
    for (Eigen::Index i = 0; i < r.size(); ++i) {
      r.data()[i] = n(rng);
      v.data()[i] = n(rng);
    }
    const thrust::device_vector<double> dr(r.data(), r.data() + r.size()), dv(v.data(), v.data() + v.size()),
        dm(m.data(), m.data() + m.size());
    const double d = best_ms([&] { (void)mrr::device::compute_gae_advantage_return<double>(dr, dv, dm, L, 0.99, 0.95); });
    const double c = best_ms([&] { (void)mrr::ppo::compute_gae_advantage_return<double>(r, v, m, 0.99, 0.95); });
    row("GAE B=512 L=4096 double (rows)", d, c, static_cast<double>(B * L) * 8 * 5, gbps);
    const double ds = best_ms([&] {
      (void)mrr::device::compute_gae_advantage_return<double>(dr, dv, dm, L, 0.99, 0.95, mrr::device::GaeAlgorithm::scan);
    });
    row("  GAE as the GPU's parallel scan", ds, c, static_cast<double>(B * L) * 8 * 5, gbps);
  }
  return 0;
}
