// Host interface of thrust_cuda.cu: the Thrust backend instantiated for the CUDA system, and the
// fused routing + replay kernel (plain functions: no Eigen, no doctest across nvcc).
#pragma once

#include <cstddef>
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
// normalize_topk: renormalise the k weights (with pre_softmax, HF Qwen's norm_topk_prob).
DeviceRoute cuda_route(const std::vector<float>& logits, int experts, int k, const std::string& score, bool pre_softmax,
                       const std::vector<float>& bias, const std::vector<std::int32_t>& replay_ids,
                       const std::vector<std::uint8_t>& replay_mask, bool fused, bool normalize_topk = false);

// GAE on the CUDA system: advantages then returns, [rows * cols] each. algorithm: 0 automatic
// (blocks on CUDA), 1 the scan, 2 the per-row recurrence (the OpenMP system's choice), 3 chunks,
// 4 blocks.
std::string cuda_gae(const std::vector<double>& rewards, const std::vector<double>& values,
                     const std::vector<double>& mask, long cols, double gamma, double lam,
                     std::vector<double>& advantages, std::vector<double>& returns, int algorithm = 0);

// The GAE view on the CUDA system: inputs [rows, cols] at row stride `stride` (the vectors hold
// rows * stride); advantages and returns come back as the whole [rows * stride] buffers, which
// start as `fill`. algorithm: 3 chunks, 4 blocks. `code`: the view's DeviceStatus code.
// Whether GaeAlgorithm::blocks runs its block kernel for [rows, cols] of T on this device (else
// chunks), the block's shared memory and the device's opt-in limit.
struct GaeBlocksFit {
  bool fit = false;
  std::size_t bytes = 0;
  int optin = 0;
};
template <class T>
GaeBlocksFit cuda_gae_blocks_fit(long rows, long cols);

template <class T>
std::string cuda_gae_view(const std::vector<T>& rewards, const std::vector<T>& values, const std::vector<T>& mask,
                          long rows, long cols, long stride, int algorithm, T fill, std::vector<T>& advantages,
                          std::vector<T>& returns, int& code);

// Routing of bf16 logits (the given floats rounded to bf16 on the host) on the CUDA system.
DeviceRoute cuda_route_bf16(const std::vector<float>& logits, int experts, int k, const std::string& score,
                            bool pre_softmax);

// The same routing through device::BackendRouter (the mrr::Router face MoELayer takes): host
// logits in, host ids and weights out, through pinned staging buffers.
DeviceRoute cuda_backend_router_route(const std::vector<float>& logits, int experts, int k);

struct DevicePolicyLoss {
  double loss = 0, clipfrac = 0, clipfrac_lower = 0, ppo_kl = 0;
  std::vector<double> grad_log_prob;
  std::string error;
};

// verl's vanilla policy loss (dual clip) on the CUDA system, in double.
DevicePolicyLoss cuda_policy_loss_vanilla(const std::vector<double>& old_log_prob, const std::vector<double>& log_prob,
                                          const std::vector<double>& advantages, const std::vector<double>& mask,
                                          long cols, const std::string& loss_agg_mode, double clip_ratio,
                                          double clip_ratio_c);

// Expert-major permutation + combine on the CUDA system; returns the combined [tokens, hidden].
std::string cuda_permute_combine(const std::vector<std::int32_t>& ids, long tokens, int k, int experts,
                                 const std::vector<float>& x, long hidden, const std::vector<float>& weights,
                                 std::vector<float>& combined);

// Dense token dropping (device::apply_token_dropping) on the CUDA system: the kept probabilities
// and map, [tokens, experts] each. by_probs: DropPolicy::probs, else position.
std::string cuda_token_dropping(const std::vector<float>& probs, const std::vector<std::uint8_t>& map, long tokens,
                                int experts, int topk, double capacity_factor, bool by_probs, bool pad,
                                std::vector<float>& out_probs, std::vector<std::uint8_t>& out_map);
std::string cuda_token_dropping(const std::vector<double>& probs, const std::vector<std::uint8_t>& map, long tokens,
                                int experts, int topk, double capacity_factor, bool by_probs, bool pad,
                                std::vector<double>& out_probs, std::vector<std::uint8_t>& out_map);

}  // namespace mrr::test
