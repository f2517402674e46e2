// The Thrust backend on the CUDA system and the fused routing + replay kernel, timed with CUDA
// events, beside the PyTorch-eager H100 baselines (read from MRR_BASELINES, printed as-is) and
// the bytes-moved limit at the baseline's measured copy bandwidth. Needs a GPU to run.
#include <mrr/cuda/fused_routing.cuh>
#include <mrr/router/presets.hpp>
#include <mrr/thrust/permute.hpp>
#include <mrr/thrust/ppo.hpp>
#include <mrr/thrust/routing.hpp>

#include <cuda_runtime.h>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace {

template <class F>
float time_ms(F&& f, int reps = 20) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  f();  // warm-up
  cudaEventRecord(a);
  for (int i = 0; i < reps; ++i) f();
  cudaEventRecord(b);
  cudaEventSynchronize(b);
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ms / static_cast<float>(reps);
}

thrust::device_vector<float> random_logits(long n) {
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> h(static_cast<std::size_t>(n));
  for (auto& v : h) v = nd(rng);
  return thrust::device_vector<float>(h.begin(), h.end());
}

}  // namespace

int main() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::printf("no CUDA device: nothing to time\n");
    return 0;
  }
  std::ifstream baselines(MRR_BASELINES);
  std::stringstream text;
  text << baselines.rdbuf();
  std::printf("PyTorch-eager baselines (%s):\n%s\n", MRR_BASELINES, text.str().c_str());
  const long T = 65536;
  const int E = 256, k = 8;
  const auto z = random_logits(T * E);
  mrr::device::TopKRouter<float> softmax(mrr::presets::qwen3_moe(E, k, true));
  std::printf("softmax top-8 + renorm T=65536 E=256: thrust %.1f us\n", 1e3 * time_ms([&] { (void)softmax.route(z); }));
  thrust::device_vector<std::int32_t> ids(static_cast<std::size_t>(T) * k);
  thrust::device_vector<float> w(ids.size());
  std::printf("  fused warp-per-token kernel: %.1f us\n", 1e3 * time_ms([&] {
                mrr::cuda::fused_route_replay(softmax.params(), thrust::raw_pointer_cast(z.data()), nullptr, nullptr,
                                              nullptr, T, thrust::raw_pointer_cast(ids.data()),
                                              thrust::raw_pointer_cast(w.data()));
              }));
  std::printf("replay weights at given ids: fused %.1f us\n", 1e3 * time_ms([&] {
                mrr::cuda::fused_route_replay(softmax.params(), thrust::raw_pointer_cast(z.data()), nullptr,
                                              thrust::raw_pointer_cast(ids.data()), nullptr, T,
                                              thrust::raw_pointer_cast(ids.data()), thrust::raw_pointer_cast(w.data()));
              }));
  mrr::device::TopKRouter<float> ds(mrr::presets::deepseek_v3(E, k, 8, 4, true, 2.5));
  std::printf("DeepSeek-V3 grouped sigmoid + bias: thrust %.1f us\n", 1e3 * time_ms([&] { (void)ds.route(z); }));
  const long H = 2048;
  thrust::device_vector<std::uint16_t> x(static_cast<std::size_t>(T * H), 1);
  std::printf("permute T=65536 H=2048 k=8 (2-byte): thrust %.1f us\n", 1e3 * time_ms([&] {
                const auto p = mrr::device::make_expert_permutation(ids, T, k, E);
                (void)mrr::device::permute_tokens<std::uint16_t>(x, H, p);
              }, 5));
  const long B = 512, L = 4096;
  thrust::device_vector<float> r(static_cast<std::size_t>(B * L), 0.1f), v(r.size(), 0.2f), m(r.size(), 1.f);
  std::printf("GAE B=512 L=4096 (float): thrust scan %.1f us\n", 1e3 * time_ms([&] {
                (void)mrr::device::compute_gae_advantage_return<float>(r, v, m, L, 0.99, 0.95);
              }, 5));
  return 0;
}
