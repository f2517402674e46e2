// The Thrust backend on the CUDA system and the fused routing + replay kernel, timed with CUDA
// events (warm-up, then the median of per-repetition event pairs on the stream the work runs on),
// beside the PyTorch-eager H100 baselines (MRR_BASELINES, see baselines_path) and the bytes-moved
// limit at the baseline's measured device-to-device copy bandwidth (read + written bytes). Needs a
// GPU to run; argv[1] (optional) divides the token counts, for a quick run.
#include <mrr/cuda/fused_routing.cuh>
#include <mrr/router/presets.hpp>
#include <mrr/thrust/permute.hpp>
#include <mrr/thrust/ppo.hpp>
#include <mrr/thrust/routing.hpp>

#include <cuda_runtime.h>
#include <thrust/host_vector.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <initializer_list>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace {

void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

// Median of `reps` timings of f() in ms. Thrust's thrust::device policy and the fused launches
// (stream nullptr) both run on the default stream, where the events are recorded; Thrust calls that
// read results back block the host between the events, which the timing includes (as a caller
// would see it).
template <class F>
double median_ms(F&& f, int reps = 21, int warmup = 3) {
  for (int i = 0; i < warmup; ++i) f();
  cuda_ok(cudaDeviceSynchronize(), "warm-up");
  std::vector<cudaEvent_t> ev(2 * static_cast<std::size_t>(reps));
  for (auto& e : ev) cuda_ok(cudaEventCreate(&e), "cudaEventCreate");
  for (int i = 0; i < reps; ++i) {
    cuda_ok(cudaEventRecord(ev[2 * i], nullptr), "cudaEventRecord");
    f();
    cuda_ok(cudaEventRecord(ev[2 * i + 1], nullptr), "cudaEventRecord");
  }
  cuda_ok(cudaEventSynchronize(ev.back()), "timed runs");
  cuda_ok(cudaGetLastError(), "timed runs");
  std::vector<double> ms(static_cast<std::size_t>(reps));
  for (int i = 0; i < reps; ++i) {
    float t = 0;
    cuda_ok(cudaEventElapsedTime(&t, ev[2 * i], ev[2 * i + 1]), "cudaEventElapsedTime");
    ms[static_cast<std::size_t>(i)] = t;
  }
  for (auto& e : ev) cudaEventDestroy(e);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

thrust::device_vector<float> random_logits(long n) {
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> h(static_cast<std::size_t>(n));
  for (auto& v : h) v = nd(rng);
  return thrust::device_vector<float>(h.begin(), h.end());
}

// The baselines file: $MRR_BASELINES, the repository's copy where the build found it, then that copy
// relative to the working directory (a binary carried to another machine, run from the repository
// root or its build folder). Missing or unreadable: the figures print without baselines.
std::string read_baselines(std::string& path) {
  std::vector<std::string> candidates;
  if (const char* env = std::getenv("MRR_BASELINES")) candidates.emplace_back(env);
#ifdef MRR_BASELINES
  candidates.emplace_back(MRR_BASELINES);
#endif
  for (const char* rel : {"bench/baselines/h100_pytorch.json", "../bench/baselines/h100_pytorch.json",
                          "../../bench/baselines/h100_pytorch.json", "../../../bench/baselines/h100_pytorch.json"})
    candidates.emplace_back(rel);
  for (const auto& c : candidates) {
    std::ifstream in(c);
    if (!in) continue;
    std::stringstream text;
    text << in.rdbuf();
    if (text.str().find('{') == std::string::npos) continue;
    path = c;
    return text.str();
  }
  return {};
}

// The number after "key": in `text` (a flat JSON object), NaN when absent or not a number.
double json_number(const std::string& text, const char* key) {
  const std::string quoted = std::string("\"") + key + "\"";
  const auto at = text.find(quoted);
  if (at == std::string::npos) return NAN;
  auto colon = text.find_first_not_of(" \t\r\n", at + quoted.size());
  if (colon == std::string::npos || text[colon] != ':') return NAN;
  const char* begin = text.c_str() + colon + 1;
  char* end = nullptr;
  const double v = std::strtod(begin, &end);
  return end == begin ? NAN : v;
}

// `key` of the entry of array `section` whose fields equal `match` (the file's arrays hold flat
// objects), NaN when there is none.
double baseline(const std::string& json, const char* section, std::initializer_list<std::pair<const char*, double>> match,
                const char* key) {
  const auto name = json.find(std::string("\"") + section + "\"");
  if (name == std::string::npos) return NAN;
  const auto open = json.find('[', name), close = json.find(']', name);
  if (open == std::string::npos || close == std::string::npos || close < open) return NAN;
  for (auto b = json.find('{', open); b != std::string::npos && b < close; b = json.find('{', b + 1)) {
    const auto e = json.find('}', b);
    if (e == std::string::npos || e > close) break;
    const std::string entry = json.substr(b, e - b + 1);
    bool all = true;
    for (const auto& [k, v] : match) all = all && json_number(entry, k) == v;
    if (all) return json_number(entry, key);
  }
  return NAN;
}

// Device-to-device copy bandwidth, read + written bytes per second (as the baseline measures it).
double measured_copy_gbps() {
  const std::size_t bytes = std::size_t(1) << 30;
  thrust::device_vector<unsigned char> a(bytes, 1), b(bytes);
  const double ms = median_ms([&] {
    cuda_ok(cudaMemcpyAsync(thrust::raw_pointer_cast(b.data()), thrust::raw_pointer_cast(a.data()), bytes,
                            cudaMemcpyDeviceToDevice, nullptr),
            "cudaMemcpyAsync");
  }, 11, 2);
  return 2.0 * static_cast<double>(bytes) / (ms * 1e6);
}

struct Reporter {
  double gbps;  // read + written bytes per second, GB/s
  void operator()(const char* what, double ms, double bytes, double eager_us) const {
    const double us = 1e3 * ms, limit_us = bytes / (gbps * 1e3);
    std::printf("%-58s %10.1f us   limit %8.1f us (%7.1f MB)   %5.1f%% of bw", what, us, limit_us, bytes / 1e6,
                100.0 * limit_us / us);
    if (std::isfinite(eager_us))
      std::printf("   PyTorch eager %9.1f us (%.2fx)\n", eager_us, eager_us / us);
    else
      std::printf("\n");
  }
};

int run(long divisor) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::printf("no CUDA device: nothing to time\n");
    return 0;
  }
  cudaDeviceProp prop{};
  cuda_ok(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  std::string path;
  const std::string json = read_baselines(path);
  const double copy = measured_copy_gbps(), base_copy = json_number(json, "d2d_copy_GBps_rw");
  std::printf("device: %s; d2d copy %.0f GB/s (read + write) measured here\n", prop.name, copy);
  if (json.empty())
    std::printf("no baselines file found (set MRR_BASELINES): limits at the bandwidth measured here\n");
  else
    std::printf("baselines: %s (%s, copy %.0f GB/s): limits at that bandwidth\n", path.c_str(),
                json.find("\"device\"") != std::string::npos ? "PyTorch eager" : "?", base_copy);
  const Reporter report{std::isfinite(base_copy) && base_copy > 0 ? base_copy : copy};

  const long T = 65536 / divisor;
  const int E = 256, k = 8;
  const double Td = static_cast<double>(T), slots = Td * k;
  auto gating = [&](const char* key) { return divisor == 1 ? baseline(json, "gating", {{"T", 65536}, {"E", 256}, {"k", 8}}, key) : NAN; };
  const auto z = random_logits(T * E);
  const double route_bytes = Td * E * 4 + slots * 8;  // fp32 logits in; int32 ids, fp32 weights out

  mrr::device::TopKRouter<float> softmax(mrr::presets::qwen3_moe(E, k, true));
  report("softmax top-8 + renorm T=65536 E=256, thrust", median_ms([&] { (void)softmax.route(z); }), route_bytes,
         gating("softmax_topk_eager_us"));
  thrust::device_vector<std::int32_t> ids(static_cast<std::size_t>(T) * k), replayed(ids.size());
  thrust::device_vector<float> w(ids.size());
  auto fused = [&](const std::int32_t* replay, std::int32_t* out) {
    cuda_ok(mrr::cuda::fused_route_replay(softmax.params(), thrust::raw_pointer_cast(z.data()), nullptr, replay, nullptr,
                                          T, out, thrust::raw_pointer_cast(w.data())),
            "fused_route_replay");
  };
  // fused_route_replay runs the segment-per-token kernel here (k <= 8, E a multiple of 32); the
  // warp-per-token kernel it replaced (still the path for k > 8, E > 256, masks) beside it.
  auto warp_kernel = [&](const mrr::device::RouterParams& p, const float* bias, std::int32_t* out) {
    cuda_ok(mrr::cuda::detail::launch_fused_warps(p, thrust::raw_pointer_cast(z.data()), bias, nullptr, nullptr, T,
                                                  out, thrust::raw_pointer_cast(w.data()), nullptr, nullptr),
            "launch_fused_warps");
  };
  report("  fused segment-per-token kernel", median_ms([&] { fused(nullptr, thrust::raw_pointer_cast(ids.data())); }),
         route_bytes, gating("softmax_topk_eager_us"));
  report("  fused warp-per-token kernel (before)",
         median_ms([&] { warp_kernel(softmax.params(), nullptr, thrust::raw_pointer_cast(replayed.data())); }),
         route_bytes, gating("softmax_topk_eager_us"));
  {
    fused(nullptr, thrust::raw_pointer_cast(ids.data()));
    warp_kernel(softmax.params(), nullptr, thrust::raw_pointer_cast(replayed.data()));
    std::printf("  segment ids equal the warp kernel's: %s\n", replayed == ids ? "yes" : "NO");
    const auto thrust_ids = softmax.route(z).ids;
    std::printf("  fused ids equal the Thrust path's: %s\n", thrust_ids == ids ? "yes" : "NO");
  }
  // Replay reads ids and k logits per token, writes ids and weights (a separate output buffer:
  // the kernel's pointers are __restrict__).
  const double replay_bytes = slots * (4 + 4) + slots * 8;
  report("replay weights at given ids, thrust", median_ms([&] { (void)softmax.replay(z, ids); }), replay_bytes,
         gating("replay_gather_eager_us"));
  report("  fused", median_ms([&] {
           fused(thrust::raw_pointer_cast(ids.data()), thrust::raw_pointer_cast(replayed.data()));
         }),
         replay_bytes, gating("replay_gather_eager_us"));

  // The view API (what a torch/Megatron caller runs): caller-owned buffers and workspace, no
  // allocation and no synchronisation in the timed call; one thread per token (kernels::RouteRows).
  thrust::device_vector<std::uint8_t> status(static_cast<std::size_t>(T));
  thrust::device_vector<unsigned char> ws(mrr::device::TopKRouter<float>::workspace_bytes(T));
  const mrr::device::Workspace workspace{thrust::raw_pointer_cast(ws.data()), ws.size()};
  const mrr::device::MatrixView<const float> zv(thrust::raw_pointer_cast(z.data()), T, E);
  const mrr::device::MatrixView<std::int32_t> idv(thrust::raw_pointer_cast(replayed.data()), T, k);
  const mrr::device::MatrixView<float> wv(thrust::raw_pointer_cast(w.data()), T, k);
  const mrr::device::MatrixView<const std::int32_t> given(thrust::raw_pointer_cast(ids.data()), T, k);
  std::uint8_t* st = thrust::raw_pointer_cast(status.data());
  report("  view API route (row kernel, caller buffers)",
         median_ms([&] { softmax.route(mrr::device::Execution{}, zv, idv, wv, st, workspace); }), route_bytes,
         gating("softmax_topk_eager_us"));
  report("  view API replay (row kernel, caller buffers)",
         median_ms([&] { softmax.replay(mrr::device::Execution{}, zv, given, nullptr, idv, wv, st, workspace); }),
         replay_bytes, gating("replay_gather_eager_us"));

  mrr::device::TopKRouter<float> ds(mrr::presets::deepseek_v3(E, k, 8, 4, true, 2.5));
  std::vector<float> host_bias(static_cast<std::size_t>(E));
  for (int e = 0; e < E; ++e)
    host_bias[static_cast<std::size_t>(e)] = 0.01f * static_cast<float>(e % 7);
  ds.set_expert_bias(host_bias);
  const thrust::device_vector<float> ds_bias(host_bias.begin(), host_bias.end());
  report("DeepSeek-V3 grouped sigmoid + bias, thrust", median_ms([&] { (void)ds.route(z); }), route_bytes,
         gating("ds_grouped_eager_us"));
  report("  fused warp-per-token kernel (before)", median_ms([&] {
           warp_kernel(ds.params(), thrust::raw_pointer_cast(ds_bias.data()), thrust::raw_pointer_cast(replayed.data()));
         }),
         route_bytes, gating("ds_grouped_eager_us"));
  report("  fused segment-per-token kernel (group limits in registers)", median_ms([&] {
           cuda_ok(mrr::cuda::fused_route_replay(
                       ds.params(), thrust::raw_pointer_cast(z.data()), thrust::raw_pointer_cast(ds_bias.data()),
                       nullptr, nullptr, T, thrust::raw_pointer_cast(ids.data()), thrust::raw_pointer_cast(w.data())),
                   "fused_route_replay (grouped)");
         }),
         route_bytes, gating("ds_grouped_eager_us"));
  {
    const auto thrust_ids = ds.route(z).ids;
    long same = 0;
    const thrust::host_vector<std::int32_t> a(thrust_ids), b(ids);
    for (long t = 0; t < T; ++t) {
      bool row = true;
      for (int j = 0; j < k; ++j)
        row = row && a[static_cast<std::size_t>(t * k + j)] == b[static_cast<std::size_t>(t * k + j)];
      same += row ? 1 : 0;
    }
    std::printf("  fused grouped ids equal the Thrust path's in %ld of %ld rows\n", same, T);
    std::printf("  segment grouped ids equal the warp kernel's: %s\n", replayed == ids ? "yes" : "NO");
    // The softmax routes again: the buffers below (replay) read them.
    fused(nullptr, thrust::raw_pointer_cast(ids.data()));
  }
  report("  view API route (row kernel, caller buffers)",
         median_ms([&] { ds.route(mrr::device::Execution{}, zv, idv, wv, st, workspace); }), route_bytes,
         gating("ds_grouped_eager_us"));
  {
    const auto owning = ds.route(z).ids;
    ds.route(mrr::device::Execution{}, zv, idv, wv, st, workspace);
    std::printf("  view ids equal the owning route's: %s\n", owning == replayed ? "yes" : "NO");
  }

  const long H = 2048;
  thrust::device_vector<std::uint16_t> x(static_cast<std::size_t>(T * H), 1), permuted;
  report("permutation T=65536 k=8 E=256 (count, scan, place), thrust",
         median_ms([&] { (void)mrr::device::make_expert_permutation(ids, T, k, E); }, 11),
         slots * 4 * 2 + slots * 4 * 2, NAN);
  {
    // The view API on caller buffers: the radix sort (CUB, the CUDA default) and the counting sort
    // (the OpenMP system's algorithm) side by side.
    using mrr::device::PermutationAlgorithm;
    thrust::device_vector<std::int32_t> st(static_cast<std::size_t>(T) * k), ros(st.size()), off(E + 1);
    thrust::device_vector<mrr::device::DeviceStatus> pst(1);
    const mrr::device::PermutationView pv{thrust::raw_pointer_cast(st.data()),
                                          thrust::raw_pointer_cast(ros.data()),
                                          thrust::raw_pointer_cast(off.data()),
                                          T,
                                          k,
                                          E};
    for (const auto algorithm : {PermutationAlgorithm::radix_sort, PermutationAlgorithm::counting}) {
      thrust::device_vector<unsigned char> pws(mrr::device::permutation_workspace_bytes(T, k, E, algorithm));
      const mrr::device::Workspace w{thrust::raw_pointer_cast(pws.data()), pws.size()};
      report(algorithm == PermutationAlgorithm::radix_sort ? "  view API, radix sort (caller buffers)"
                                                           : "  view API, counting sort (caller buffers)",
             median_ms([&] {
               mrr::device::make_expert_permutation(given, nullptr, pv, w, thrust::raw_pointer_cast(pst.data()), {},
                                                    algorithm);
             }),
             slots * 4 * 2 + slots * 4 * 2, NAN);
    }
  }
  const auto p = mrr::device::make_expert_permutation(ids, T, k, E);
  mrr::device::permute_tokens<std::uint16_t>(x, H, p, permuted);  // sized once: kept buffer
  report("permute T=65536 H=2048 k=8 (2-byte), into a kept buffer, thrust",
         median_ms([&] { mrr::device::permute_tokens<std::uint16_t>(x, H, p, permuted); }, 11),
         slots * static_cast<double>(H) * 2 * 2,
         divisor == 1 ? baseline(json, "permute", {{"T", 65536}, {"H", 2048}}, "permute_eager_us") : NAN);

  {
    const auto pv = p.view();
    const auto xin = mrr::device::matrix_view<const std::uint16_t>(thrust::raw_pointer_cast(x.data()), T, H);
    const auto xout = mrr::device::matrix_view<std::uint16_t>(thrust::raw_pointer_cast(permuted.data()), T * k, H);
    report("  view API permute (16-byte units, caller buffers)",
           median_ms([&] { mrr::device::permute_tokens<std::uint16_t>(xin, pv, xout); }, 11),
           slots * static_cast<double>(H) * 2 * 2,
           divisor == 1 ? baseline(json, "permute", {{"T", 65536}, {"H", 2048}}, "permute_eager_us") : NAN);
    const auto xodd = mrr::device::matrix_view<const std::uint16_t>(thrust::raw_pointer_cast(x.data()), T, H - 1, H);
    const auto oodd =
        mrr::device::matrix_view<std::uint16_t>(thrust::raw_pointer_cast(permuted.data()), T * k, H - 1, H);
    report("  view API permute, H-1 columns (element by element)",
           median_ms([&] { mrr::device::permute_tokens<std::uint16_t>(xodd, pv, oodd); }, 11),
           slots * static_cast<double>(H - 1) * 2 * 2, NAN);
  }

  const long B = 512 / divisor > 0 ? 512 / divisor : 1, L = 4096;
  thrust::device_vector<float> r(static_cast<std::size_t>(B * L), 0.1f), v(r.size(), 0.2f), m(r.size(), 1.f);
  const double gae_bytes = static_cast<double>(B * L) * 4 * 5;  // rewards, values, mask in; advantages, returns out
  const double gae_eager = divisor == 1 ? baseline(json, "gae", {{"B", 512}, {"L", 4096}}, "gae_verl_loop_us") : NAN;
  for (const auto algorithm : {mrr::device::GaeAlgorithm::blocks, mrr::device::GaeAlgorithm::scan})
    report(algorithm == mrr::device::GaeAlgorithm::blocks ? "GAE B=512 L=4096 (float), owning, a block per row"
                                                          : "GAE B=512 L=4096 (float), owning, thrust scan",
           median_ms([&] { (void)mrr::device::compute_gae_advantage_return<float>(r, v, m, L, 0.99, 0.95, algorithm); },
                     11),
           gae_bytes, gae_eager);
  {
    // The view: caller buffers and workspace, no allocation, no synchronisation in the timed call.
    thrust::device_vector<float> adv(r.size()), ret(r.size());
    thrust::device_vector<unsigned char> gws(mrr::device::gae_workspace_bytes<float>(B, L));
    thrust::device_vector<mrr::device::DeviceStatus> gst(1);
    const auto view = [&](const thrust::device_vector<float>& d) {
      return mrr::device::matrix_view<const float>(thrust::raw_pointer_cast(d.data()), B, L);
    };
    for (const auto algorithm : {mrr::device::GaeAlgorithm::blocks, mrr::device::GaeAlgorithm::chunks}) {
      const auto run_view = [&] {
        mrr::device::compute_gae_advantage_return<float>(
            view(r), view(v), view(m), 0.99, 0.95, mrr::device::matrix_view(thrust::raw_pointer_cast(adv.data()), B, L),
            mrr::device::matrix_view(thrust::raw_pointer_cast(ret.data()), B, L),
            mrr::device::Workspace{thrust::raw_pointer_cast(gws.data()), gws.size()},
            thrust::raw_pointer_cast(gst.data()), {}, algorithm);
      };
      report(algorithm == mrr::device::GaeAlgorithm::blocks
                 ? "  view API, a block per row (blocks, the default; caller buffers)"
                 : "  view API, chunks of time in five launches (chunks)",
             median_ms(run_view, 21), gae_bytes, gae_eager);
      mrr::device::check_gae(thrust::raw_pointer_cast(gst.data()));
    }
  }
  cuda_ok(cudaDeviceSynchronize(), "end");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const long divisor = argc > 1 ? std::max(1L, std::atol(argv[1])) : 1;
  try {
    return run(divisor);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_device_cuda: %s\n", e.what());
    return 1;
  }
}
