// Record a route on the device backend, then replay it: ids are forced, weights recomputed from
// the new logits (DESIGN.md section 3), and rows without a recorded route (the replay mask) route
// natively. The route store stays on the host; only ids travel.
#include <mrr/router/presets.hpp>
#include <mrr/thrust/routing.hpp>

#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

int main() {
  const long tokens = 6;
  const int experts = 16, k = 4;
  mrr::device::TopKRouter<float> router(mrr::presets::qwen3_moe(experts, k, true));
  std::mt19937 rng(1);
  std::normal_distribution<float> n(0.f, 1.f);
  std::vector<float> z(static_cast<std::size_t>(tokens * experts));
  for (auto& v : z) v = n(rng);
  const thrust::device_vector<float> old_logits(z.begin(), z.end());
  const auto recorded = router.route(old_logits);  // the rollout pass
  std::vector<std::int32_t> store(recorded.ids.size());  // host route store
  thrust::copy(recorded.ids.begin(), recorded.ids.end(), store.begin());

  for (auto& v : z) v += 0.3f * n(rng);  // the training engine's logits differ a little
  const thrust::device_vector<float> new_logits(z.begin(), z.end());
  std::vector<std::uint8_t> mask(static_cast<std::size_t>(tokens), 1);
  mask.back() = 0;  // the last token has no recorded route
  const auto replayed = router.replay(new_logits, thrust::device_vector<std::int32_t>(store.begin(), store.end()),
                                      thrust::device_vector<std::uint8_t>(mask.begin(), mask.end()));
  std::printf("backend %s\n", std::string(mrr::ThrustDeviceBackend::name).c_str());
  int forced = 0;
  for (long t = 0; t < tokens; ++t) {
    std::printf("token %ld:", t);
    bool same = true;
    for (int j = 0; j < k; ++j) {
      const auto i = static_cast<std::size_t>(t * k + j);
      same = same && replayed.ids[i] == store[i];
      std::printf(" %2d (%.3f)", static_cast<int>(replayed.ids[i]), static_cast<double>(replayed.weights[i]));
    }
    std::printf("%s\n", mask[static_cast<std::size_t>(t)] ? " replayed" : " native");
    forced += (mask[static_cast<std::size_t>(t)] != 0 && same) ? 1 : 0;
  }
  return forced == tokens - 1 ? 0 : 1;
}
