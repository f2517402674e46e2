// Host interface of thrust_cuda.cu: the Thrust backend instantiated for the CUDA system, and the
// fused routing + replay kernel (plain functions: no Eigen, no doctest across nvcc).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace mrr::test {

struct DeviceRoute {
  std::vector<std::int32_t> ids;
  std::vector<float> weights;
  std::string error;  // empty on success
};

// score: "softmax", "sigmoid" or "sqrtsoftplus"; replay_ids empty for native routing; replay_mask
// empty for "every row replays". fused = the warp-per-token kernel, else the Thrust path.
DeviceRoute cuda_route(const std::vector<float>& logits, int experts, int k, const std::string& score, bool pre_softmax,
                       const std::vector<float>& bias, const std::vector<std::int32_t>& replay_ids,
                       const std::vector<std::uint8_t>& replay_mask, bool fused);

// GAE on the CUDA system (Thrust scans): advantages then returns, [rows * cols] each.
std::string cuda_gae(const std::vector<double>& rewards, const std::vector<double>& values,
                     const std::vector<double>& mask, long cols, double gamma, double lam,
                     std::vector<double>& advantages, std::vector<double>& returns);

// Expert-major permutation + combine on the CUDA system; returns the combined [tokens, hidden].
std::string cuda_permute_combine(const std::vector<std::int32_t>& ids, long tokens, int k, int experts,
                                 const std::vector<float>& x, long hidden, const std::vector<float>& weights,
                                 std::vector<float>& combined);

}  // namespace mrr::test
