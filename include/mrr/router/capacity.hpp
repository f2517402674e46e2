// Expert capacity and token dropping (Megatron apply_router_token_dropping), in the dense
// [tokens, experts] form and directly on a top-k Routing. Which tokens an expert keeps is
// decided by a strict total order, so the result never depends on the selection algorithm:
//   probs    - higher routing probability first, then the lower token index;
//   position - routed tokens before others, then the lower token index (earliest tokens kept).
// torch.topk leaves equal keys in an implementation-defined order; see docs/routing.md.
// The per-expert keep decision is kernels/capacity.hpp's, which the device runs too; the CPU
// executor selects each segment's threshold with std::nth_element.
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>
#include <mrr/kernels/capacity.hpp>
#include <mrr/kernels/router.hpp>
#include <mrr/router/config.hpp>
#include <mrr/router/permute.hpp>
#include <mrr/router/routing.hpp>
#include <mrr/router/row_error.hpp>
#include <mrr/tensor.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

MRR_NAMESPACE_BEGIN

// Megatron get_capacity(num_tokens * topk, num_experts, capacity_factor).
inline std::int64_t expert_capacity(std::int64_t num_tokens, int topk, int num_experts, double capacity_factor) {
  detail::require(num_tokens >= 0 && topk > 0 && num_experts > 0, "expert_capacity",
                  "needs num_tokens >= 0, topk > 0 and num_experts > 0");
  detail::require(std::isfinite(capacity_factor) && capacity_factor > 0, "expert_capacity",
                  "capacity_factor must be finite and positive, got ", capacity_factor);
  return kernels::expert_capacity(num_tokens * topk, num_experts, capacity_factor);
}

namespace detail {

// The selection of a CPU thread for kernels/capacity.hpp: std::nth_element on a scratch copy.
struct NthElementSelect {
  std::uint64_t operator()(const std::uint64_t* key, long n, long rank, std::uint64_t* scratch) const {
    std::copy(key, key + n, scratch);
    std::nth_element(scratch, scratch + rank, scratch + n);
    return scratch[rank];
  }
};

}  // namespace detail

// Dense token dropping with Megatron's semantics: every token competes for each expert's
// `capacity` places (under the position policy non-routed ones rank last; under the probs policy
// by probability, so a routed weight of exactly 0 ties with them), pad_to_capacity keeps the full capacity mask
// (non-routed tokens included, with probability 0), and a capacity above the token count keeps all.
template <class T>
DenseRouting<T> apply_token_dropping(MatrixRef<T> probs, MaskRef map, int topk, double capacity_factor,
                                     DropPolicy policy, bool pad_to_capacity) {
  constexpr const char* fn = "apply_token_dropping";
  detail::require(probs.rows() == map.rows() && probs.cols() == map.cols(), fn, "'probs' has shape ",
                  detail::shape_of(probs), " but 'routing_map' has ", detail::shape_of(map));
  const auto tokens = probs.rows();
  const auto experts = static_cast<int>(probs.cols());
  const std::int64_t capacity = expert_capacity(tokens, topk, experts, capacity_factor);
  // As the device form: a map holds 0 / 1, and the probs policy cannot order a NaN probability.
  for (Eigen::Index t = 0; t < tokens; ++t)
    for (Eigen::Index e = 0; e < experts; ++e) {
      detail::require(map(t, e) <= 1, fn, "'routing_map' has ", static_cast<int>(map(t, e)), " at [", t, ", ", e,
                      "]; a map holds 0 or 1");
      detail::require(policy != DropPolicy::probs || !std::isnan(probs(t, e)), fn, "'probs' holds NaN at [", t, ", ", e,
                      "]: the probs drop policy cannot order it");
    }
  DenseRouting<T> out{RowMatrix<T>::Zero(tokens, experts), Mask::Zero(tokens, experts)};
  std::vector<std::uint64_t> scratch(static_cast<std::size_t>(2 * tokens));
  for (int e = 0; e < experts; ++e)
    kernels::keep_column(probs.data(), probs.outerStride(), map.data(), map.outerStride(), tokens, experts, e,
                         capacity, policy == DropPolicy::probs, pad_to_capacity, scratch.data(), out.probs.data(),
                         out.map.data(), detail::NthElementSelect{});
  return out;
}

namespace detail {

// drop_over_capacity on ids known to be valid (the router's own output): no checks.
template <class T>
void drop_over_capacity_unchecked(Routing<T>& routing, int num_experts, double capacity_factor, DropPolicy policy) {
  const auto tokens = routing.tokens();
  const int k = routing.topk();
  const std::int64_t capacity = expert_capacity(tokens, k, num_experts, capacity_factor);
  // Every slot competes, a dropped one of an earlier call included.
  const ExpertPermutation p =
      detail::expert_permutation(routing.ids.data(), nullptr, tokens, k, num_experts, "drop_over_capacity");
  std::vector<std::int64_t> slot_of_row(static_cast<std::size_t>(p.rows()));
  for (Eigen::Index s = 0; s < p.row_of_slot.size(); ++s)
    slot_of_row[static_cast<std::size_t>(p.row_of_slot.data()[s])] = s;
  routing.kept = Mask::Ones(tokens, k);
  std::vector<std::uint64_t> scratch(static_cast<std::size_t>(2 * p.rows()));
  for (int e = 0; e < num_experts; ++e)
    kernels::drop_segment(slot_of_row.data(), p.first_row(e), p.first_row(e + 1), capacity, policy == DropPolicy::probs,
                          routing.weights.data(), routing.kept.data(), scratch.data(), detail::NthElementSelect{});
}

}  // namespace detail

// Drops the slots of a top-k Routing over capacity: fills routing.kept and zeroes their weights.
// apply_token_dropping without padding, except that only routed slots compete here (a routed
// weight of exactly 0 can tie with non-routed tokens there): each expert's slots, in token order
// from the expert-major permutation, form its segment. Ids must be in range and distinct within
// a row (a token holds one place of an expert at most).
template <class T>
void drop_over_capacity(Routing<T>& routing, int num_experts, double capacity_factor, DropPolicy policy) {
  constexpr const char* fn = "drop_over_capacity";
  const auto tokens = routing.tokens();
  const int k = routing.topk();
  detail::require(routing.weights.rows() == tokens && routing.weights.cols() == k, fn, "routing weights have shape ",
                  detail::shape_of(routing.weights), " for ids of shape ", detail::shape_of(routing.ids));
  // The first row with an id out of range or repeated, at its first bad slot (as the device form).
  for (Eigen::Index t = 0; t < tokens; ++t) {
    const std::int32_t* row = routing.ids.data() + t * k;
    bool bad = kernels::repeated_slot(row, k) >= 0;
    for (int j = 0; j < k; ++j)
      bad |= row[j] < 0 || row[j] >= num_experts;
    if (bad) [[unlikely]]
      detail::reject_invalid_ids(row, k, num_experts, t, fn);
  }
  detail::drop_over_capacity_unchecked(routing, num_experts, capacity_factor, policy);
}

MRR_NAMESPACE_END
