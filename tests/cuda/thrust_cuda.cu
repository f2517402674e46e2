// The same Thrust operations the OpenMP tests check, instantiated for the CUDA system, and the
// fused routing + replay kernel. Compiled by nvcc in every CI run; run where a GPU is.
#include <mrr/cuda/fused_routing.cuh>
#include <mrr/router/presets.hpp>
#include <mrr/thrust/backend_router.hpp>
#include <mrr/thrust/bf16.hpp>
#include <mrr/thrust/capacity.hpp>
#include <mrr/thrust/permute.hpp>
#include <mrr/thrust/policy_loss.hpp>
#include <mrr/thrust/ppo.hpp>
#include <mrr/thrust/routing.hpp>

#include "../device/device_vectors.hpp"
#include "gae_view.hpp"
#include "thrust_cuda.hpp"

#include <exception>

namespace mrr::test {

DeviceRoute cuda_route(const std::vector<float>& logits, int experts, int k, const std::string& score, bool pre_softmax,
                       const std::vector<float>& bias, const std::vector<std::int32_t>& replay_ids,
                       const std::vector<std::uint8_t>& replay_mask, bool fused, bool normalize_topk) {
  DeviceRoute out;
  try {
    RouterConfig cfg;
    cfg.num_experts = experts;
    cfg.topk = k;
    cfg.score_function = parse_score_function(score);
    cfg.pre_softmax = pre_softmax;
    cfg.normalize_topk = normalize_topk;
    cfg.use_expert_bias = !bias.empty();
    device::TopKRouter<float> router(cfg);
    if (!bias.empty()) router.set_expert_bias(bias);
    const thrust::device_vector<float> z(logits.begin(), logits.end());
    const thrust::device_vector<std::int32_t> rid(replay_ids.begin(), replay_ids.end());
    const thrust::device_vector<std::uint8_t> mask(replay_mask.begin(), replay_mask.end());
    const thrust::device_vector<float> b(bias.begin(), bias.end());
    const long tokens = static_cast<long>(logits.size()) / experts;
    if (fused) {
      thrust::device_vector<std::int32_t> ids(static_cast<std::size_t>(tokens) * k);
      thrust::device_vector<float> w(ids.size());
      const auto err = cuda::fused_route_replay(
          router.params(), thrust::raw_pointer_cast(z.data()), bias.empty() ? nullptr : thrust::raw_pointer_cast(b.data()),
          replay_ids.empty() ? nullptr : thrust::raw_pointer_cast(rid.data()),
          replay_mask.empty() ? nullptr : thrust::raw_pointer_cast(mask.data()), tokens, thrust::raw_pointer_cast(ids.data()),
          thrust::raw_pointer_cast(w.data()));
      // The launch error, then what the kernel itself hit (shown at the synchronisation).
      const auto done = err == cudaSuccess ? cudaDeviceSynchronize() : err;
      if (done != cudaSuccess) {
        out.error = cudaGetErrorString(done);
        return out;
      }
      out.ids = to_host(ids);
      out.weights = to_host(w);
    } else {
      const auto r = replay_ids.empty() ? router.route(z)
                     : replay_mask.empty() ? router.replay(z, rid)
                                           : router.replay(z, rid, mask);
      out.ids = to_host(r.ids);
      out.weights = to_host(r.weights);
    }
  } catch (const std::exception& e) {
    out.error = e.what();
  }
  return out;
}

std::string cuda_gae(const std::vector<double>& rewards, const std::vector<double>& values,
                     const std::vector<double>& mask, long cols, double gamma, double lam,
                     std::vector<double>& advantages, std::vector<double>& returns, int algorithm) {
  try {
    const auto r = device::compute_gae_advantage_return<double>(
        thrust::device_vector<double>(rewards.begin(), rewards.end()),
        thrust::device_vector<double>(values.begin(), values.end()),
        thrust::device_vector<double>(mask.begin(), mask.end()), cols, gamma, lam,
        algorithm == 1   ? device::GaeAlgorithm::scan
        : algorithm == 2 ? device::GaeAlgorithm::rows
        : algorithm == 3 ? device::GaeAlgorithm::chunks
        : algorithm == 4 ? device::GaeAlgorithm::blocks
                         : device::GaeAlgorithm::automatic);
    advantages = to_host(r.advantages);
    returns = to_host(r.returns);
  } catch (const std::exception& e) {
    return e.what();
  }
  return {};
}

template GaeBlocksFit cuda_gae_blocks_fit<float>(long, long);
template GaeBlocksFit cuda_gae_blocks_fit<double>(long, long);

template std::string cuda_gae_view<float>(const std::vector<float>&, const std::vector<float>&,
                                          const std::vector<float>&, long, long, long, int, float, std::vector<float>&,
                                          std::vector<float>&, int&);
template std::string cuda_gae_view<double>(const std::vector<double>&, const std::vector<double>&,
                                           const std::vector<double>&, long, long, long, int, double,
                                           std::vector<double>&, std::vector<double>&, int&);

std::string cuda_permute_combine(const std::vector<std::int32_t>& ids, long tokens, int k, int experts,
                                 const std::vector<float>& x, long hidden, const std::vector<float>& weights,
                                 std::vector<float>& combined) {
  try {
    const auto p = device::make_expert_permutation(thrust::device_vector<std::int32_t>(ids.begin(), ids.end()), tokens,
                                                   k, experts);
    const auto permuted = device::permute_tokens<float>(thrust::device_vector<float>(x.begin(), x.end()), hidden, p);
    combined = to_host(
        device::combine<float>(permuted, hidden, thrust::device_vector<float>(weights.begin(), weights.end()), p));
  } catch (const std::exception& e) {
    return e.what();
  }
  return {};
}

DeviceRoute cuda_route_bf16(const std::vector<float>& logits, int experts, int k, const std::string& score,
                            bool pre_softmax) {
  DeviceRoute out;
  try {
    RouterConfig cfg;
    cfg.num_experts = experts;
    cfg.topk = k;
    cfg.score_function = parse_score_function(score);
    cfg.pre_softmax = pre_softmax;
    device::TopKRouter<float> router(cfg);
    std::vector<bf16> half(logits.size());
    for (std::size_t i = 0; i < logits.size(); ++i) half[i] = bf16::from_float(logits[i]);
    const auto r = router.route(thrust::device_vector<bf16>(half.begin(), half.end()));
    out.ids = to_host(r.ids);
    out.weights = to_host(r.weights);
  } catch (const std::exception& e) {
    out.error = e.what();
  }
  return out;
}

DeviceRoute cuda_backend_router_route(const std::vector<float>& logits, int experts, int k) {
  DeviceRoute out;
  try {
    const device::BackendRouter<float> router(presets::qwen3_moe(experts, k, true));
    const long tokens = static_cast<long>(logits.size()) / experts;
    const auto r = router.route(Eigen::Map<const RowMatrix<float>>(logits.data(), tokens, experts));
    out.ids.assign(r.ids.data(), r.ids.data() + r.ids.size());
    out.weights.assign(r.weights.data(), r.weights.data() + r.weights.size());
  } catch (const std::exception& e) {
    out.error = e.what();
  }
  return out;
}

DevicePolicyLoss cuda_policy_loss_vanilla(const std::vector<double>& old_log_prob, const std::vector<double>& log_prob,
                                          const std::vector<double>& advantages, const std::vector<double>& mask,
                                          long cols, const std::string& loss_agg_mode, double clip_ratio,
                                          double clip_ratio_c) {
  DevicePolicyLoss out;
  try {
    ppo::PolicyLossConfig config;
    config.clip_ratio = clip_ratio;
    config.clip_ratio_c = clip_ratio_c;
    using V = thrust::device_vector<double>;
    const auto r = device::compute_policy_loss_vanilla<double>(
        V(old_log_prob.begin(), old_log_prob.end()), V(log_prob.begin(), log_prob.end()),
        V(advantages.begin(), advantages.end()), V(mask.begin(), mask.end()), cols,
        ppo::parse_loss_agg_mode(loss_agg_mode), config);
    out.loss = r.loss;
    out.grad_log_prob = to_host(r.grad_log_prob);
    out.clipfrac = *r.metric("actor/pg_clipfrac");
    out.clipfrac_lower = *r.metric("actor/pg_clipfrac_lower");
    out.ppo_kl = *r.metric("actor/ppo_kl");
  } catch (const std::exception& e) {
    out.error = e.what();
  }
  return out;
}


namespace {

template <class T>
std::string token_dropping(const std::vector<T>& probs, const std::vector<std::uint8_t>& map, long tokens, int experts,
                           int topk, double capacity_factor, bool by_probs, bool pad, std::vector<T>& out_probs,
                           std::vector<std::uint8_t>& out_map) {
  try {
    const auto r = device::apply_token_dropping<T>(thrust::device_vector<T>(probs.begin(), probs.end()),
                                                   thrust::device_vector<std::uint8_t>(map.begin(), map.end()), tokens,
                                                   experts, topk, capacity_factor,
                                                   by_probs ? DropPolicy::probs : DropPolicy::position, pad);
    out_probs = to_host(r.probs);
    out_map = to_host(r.map);
  } catch (const std::exception& e) {
    return e.what();
  }
  return {};
}

}  // namespace

std::string cuda_token_dropping(const std::vector<float>& probs, const std::vector<std::uint8_t>& map, long tokens,
                                int experts, int topk, double capacity_factor, bool by_probs, bool pad,
                                std::vector<float>& out_probs, std::vector<std::uint8_t>& out_map) {
  return token_dropping<float>(probs, map, tokens, experts, topk, capacity_factor, by_probs, pad, out_probs, out_map);
}

std::string cuda_token_dropping(const std::vector<double>& probs, const std::vector<std::uint8_t>& map, long tokens,
                                int experts, int topk, double capacity_factor, bool by_probs, bool pad,
                                std::vector<double>& out_probs, std::vector<std::uint8_t>& out_map) {
  return token_dropping<double>(probs, map, tokens, experts, topk, capacity_factor, by_probs, pad, out_probs, out_map);
}

}  // namespace mrr::test
