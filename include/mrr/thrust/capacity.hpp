// mrr-requires: mrr_thrust_omp
// Megatron's dense token dropping (apply_router_token_dropping, pad_to_capacity included) on a
// Thrust system: the device mirror of mrr::apply_token_dropping (router/capacity.hpp), with the
// same result bit for bit. Every expert column keeps its min(capacity, tokens) best tokens under
// the CPU's strict total order (key descending, then token ascending; key = the probability for
// DropPolicy::probs, routed-or-not for DropPolicy::position); a kept token is marked (map 1, its
// probability copied) if pad_to_capacity or it was routed, everything else is 0.
//
// How, per policy (both deterministic: no atomics, no order left to the schedule):
//  * probs: every expert has exactly `tokens` candidates, so a stable sort of all T * E cells by
//    (expert ascending, key descending, token ascending) puts expert e's candidates, best first, at
//    positions [e * T, (e + 1) * T): position p has expert p / T and rank p % T, and rank < keep
//    is kept. Done as two stable sorts of the row-major cell index j = t * E + e (which starts in
//    (token, expert) order): first by a 64-bit key that orders the probabilities descending (equal
//    values, -0 and +0 included, give equal keys, so ties stay in token order), then by expert.
//    Both are radix sorts on CUDA (O(T E)) and merge sorts on the OpenMP system (O(T E log T E)).
//  * position: the key is 0/1, so no sort is needed. A segmented exclusive scan over the
//    column-major cells counts each cell's routed predecessors in its column; a routed token's rank
//    is that count, a non-routed one's the column's routed total plus its non-routed predecessors.
//    O(T E), exact by construction.
// That is DroppingAlgorithm::sort, what a GPU needs (T E independent work items). CPU threads (the
// OpenMP and host systems) take DroppingAlgorithm::columns by default: an expert column per work
// item, done as the CPU does it (gather the column, nth_element under the same strict order;
// position: one pass in token order), O(T E) in all and E-way parallel. The kept set of a column
// is unique under a strict total order, so both algorithms give the same bits; the tests run both.
// Inputs are checked on the host side of one reduction pass: shapes, capacity_factor (finite,
// > 0, as expert_capacity), map values 0/1, and (probs policy) no NaN probability, which would
// leave the order undefined (the CPU's nth_element has no answer for it either).
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>
#include <mrr/router/capacity.hpp>
#include <mrr/router/config.hpp>
#include <mrr/thrust/backend.hpp>

#include <cuda/std/bit>

#include <thrust/for_each.h>
#include <thrust/functional.h>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/iterator/transform_iterator.h>
#include <thrust/scan.h>
#include <thrust/sequence.h>
#include <thrust/sort.h>
#include <thrust/transform.h>
#include <thrust/transform_reduce.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

MRR_NAMESPACE_BEGIN
namespace device {

// The result of apply_token_dropping: [tokens, experts] row-major, zero where not kept.
template <class T, class Backend = ThrustDeviceBackend>
struct DenseRouting {
  typename Backend::template vector<T> probs;
  typename Backend::template vector<std::uint8_t> map;
  long tokens = 0;
  int num_experts = 0;
};

namespace kernels {

// Bit flags of the input check, or-reduced over all cells.
inline constexpr int dense_nan_prob = 1;
inline constexpr int dense_bad_map = 2;

template <class T>
struct DenseInputFlags {
  const T* probs;
  const std::uint8_t* map;
  bool check_nan;
  MRR_HOST_DEVICE int operator()(long j) const {
    const T p = probs[j];
    return (check_nan && !(p == p) ? dense_nan_prob : 0) | (map[j] > 1 ? dense_bad_map : 0);
  }
};

// A 64-bit key whose ascending order is the probabilities' descending order: the value widened to
// double (exact for float), -0 made +0 (the CPU compares them equal), the IEEE bits made
// monotone (negatives: all bits flipped; others: the sign bit set), then complemented.
template <class T>
struct DescendingKey {
  const T* probs;
  MRR_HOST_DEVICE std::uint64_t operator()(long j) const {
    double x = static_cast<double>(probs[j]);
    if (x == 0.0) x = 0.0;
    const std::uint64_t u = ::cuda::std::bit_cast<std::uint64_t>(x);
    const std::uint64_t ascending = (u >> 63) != 0 ? ~u : (u | (std::uint64_t(1) << 63));
    return ~ascending;
  }
};

struct ExpertOfCell {
  const std::int32_t* cell;  // row-major cell index t * E + e
  int num_experts;
  MRR_HOST_DEVICE std::int32_t operator()(long p) const { return cell[p] % num_experts; }
};

// Position p of the expert-major order holds cell order[p] with rank p % T in its expert.
template <class T>
struct MarkSortedKept {
  const std::int32_t* order;
  const T* probs;
  const std::uint8_t* map;
  T* out_probs;
  std::uint8_t* out_map;
  long tokens, keep;
  bool pad;
  MRR_HOST_DEVICE void operator()(long p) const {
    if (p % tokens >= keep) return;
    const std::int32_t j = order[p];
    if (pad || map[j] != 0) {
      out_map[j] = 1;
      out_probs[j] = probs[j];
    }
  }
};

// Column-major cell i (expert i / T, token i % T): its segment key and its routed flag.
struct ColumnOfCell {
  long tokens;
  MRR_HOST_DEVICE long operator()(long i) const { return i / tokens; }
};

struct RoutedOfCell {
  const std::uint8_t* map;
  long tokens;
  int num_experts;
  MRR_HOST_DEVICE std::int32_t operator()(long i) const {
    return map[(i % tokens) * num_experts + i / tokens] != 0 ? 1 : 0;
  }
};

// routed_before[i]: routed tokens before cell i's token in its column (exclusive scan).
template <class T>
struct MarkPositionKept {
  const std::int32_t* routed_before;
  const T* probs;
  const std::uint8_t* map;
  T* out_probs;
  std::uint8_t* out_map;
  long tokens, keep;
  int num_experts;
  bool pad;
  MRR_HOST_DEVICE void operator()(long i) const {
    const long e = i / tokens, t = i % tokens;
    const long j = t * num_experts + e;
    const bool routed = map[j] != 0;
    const long last = (tokens - 1) * num_experts + e;
    const long routed_total = routed_before[e * tokens + tokens - 1] + (map[last] != 0 ? 1 : 0);
    const long before = routed_before[i];
    const long rank = routed ? before : routed_total + (t - before);
    if (rank < keep && (pad || routed)) {
      out_map[j] = 1;
      out_probs[j] = probs[j];
    }
  }
};

// One expert column per work item, on CPU threads only (host code: a scratch column and
// std::nth_element): the CPU's algorithm, with the DescendingKey order (equal keys by token).
template <class T>
struct KeepColumn {
  const T* probs;
  const std::uint8_t* map;
  T* out_probs;
  std::uint8_t* out_map;
  long tokens, keep;
  int num_experts;
  bool by_probs, pad;
  void operator()(int e) const {
    const std::uint8_t* column = map + e;  // column[t * num_experts]
    if (!by_probs) {
      // Routed tokens in token order, then (only marked when padding) the others.
      long left = keep;
      for (long t = 0; t < tokens && left > 0; ++t)
        if (column[t * num_experts] != 0) {
          mark_at(t, e);
          --left;
        }
      if (pad)
        for (long t = 0; t < tokens && left > 0; ++t)
          if (column[t * num_experts] == 0) {
            mark_at(t, e);
            --left;
          }
      return;
    }
    const DescendingKey<T> key{probs + e};
    std::vector<std::pair<std::uint64_t, long>> candidates(static_cast<std::size_t>(tokens));
    for (long t = 0; t < tokens; ++t) candidates[static_cast<std::size_t>(t)] = {key(t * num_experts), t};
    if (keep < tokens) std::nth_element(candidates.begin(), candidates.begin() + keep, candidates.end());
    for (long i = 0; i < keep; ++i) {
      const long t = candidates[static_cast<std::size_t>(i)].second;
      if (pad || column[t * num_experts] != 0) mark_at(t, e);
    }
  }
  void mark_at(long t, int e) const {
    const long j = t * num_experts + e;
    out_map[j] = 1;
    out_probs[j] = probs[j];
  }
};

}  // namespace kernels

// How apply_token_dropping ranks each expert's candidates: `sort` (two stable sorts of all T * E
// cells, or a segmented scan for the position policy: what a GPU needs) or `columns` (an expert
// column per work item, the CPU's nth_element: what CPU threads need; not on a GPU system).
// `automatic` picks columns on the OpenMP and host systems and sort on CUDA. Same result.
enum class DroppingAlgorithm { automatic, sort, columns };

// Megatron's dense token dropping on a Thrust system; equal to mrr::apply_token_dropping.
// probs and map are [tokens, num_experts] row-major; map holds 0/1. T is float or double.
template <class T, class Backend = ThrustDeviceBackend>
DenseRouting<T, Backend> apply_token_dropping(const typename Backend::template vector<T>& probs,
                                              const typename Backend::template vector<std::uint8_t>& map, long tokens,
                                              int num_experts, int topk, double capacity_factor, DropPolicy policy,
                                              bool pad_to_capacity,
                                              DroppingAlgorithm algorithm = DroppingAlgorithm::automatic) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                "device::apply_token_dropping takes float or double probabilities");
  constexpr const char* fn = "device::apply_token_dropping";
  mrr::detail::require(tokens >= 0 && num_experts > 0, fn, "needs tokens >= 0 and num_experts > 0, got tokens=", tokens,
                       " num_experts=", num_experts);
  const auto cells = static_cast<std::size_t>(tokens) * static_cast<std::size_t>(num_experts);
  mrr::detail::require(probs.size() == cells, fn, "'probs' has ", probs.size(), " values, expected [", tokens, ", ",
                       num_experts, "]");
  mrr::detail::require(map.size() == cells, fn, "'routing_map' has ", map.size(), " values, expected [", tokens, ", ",
                       num_experts, "]");
  mrr::detail::require(cells < (std::size_t(1) << 31), fn, "tokens * num_experts = ", cells,
                       " exceeds the int32 cell index");
  // Megatron get_capacity; also checks topk > 0 and capacity_factor finite and positive.
  const std::int64_t capacity = expert_capacity(tokens, topk, num_experts, capacity_factor);
  const long keep = capacity > tokens ? tokens : static_cast<long>(capacity);

  const auto exec = Backend::policy();
  DenseRouting<T, Backend> out;
  out.tokens = tokens;
  out.num_experts = num_experts;
  out.probs.resize(cells, T(0));
  out.map.resize(cells, std::uint8_t(0));
  if (cells == 0) return out;

  const long n = static_cast<long>(cells);
  const T* p = thrust::raw_pointer_cast(probs.data());
  const std::uint8_t* m = thrust::raw_pointer_cast(map.data());
  const bool by_probs = policy == DropPolicy::probs;
  const int flags = thrust::transform_reduce(exec, thrust::counting_iterator<long>(0), thrust::counting_iterator<long>(n),
                                             kernels::DenseInputFlags<T>{p, m, by_probs}, 0, thrust::bit_or<int>());
  mrr::detail::require((flags & kernels::dense_nan_prob) == 0, fn,
                       "'probs' holds NaN: the probs drop policy cannot order it");
  mrr::detail::require((flags & kernels::dense_bad_map) == 0, fn, "'routing_map' holds a value other than 0 and 1");

  T* out_p = thrust::raw_pointer_cast(out.probs.data());
  std::uint8_t* out_m = thrust::raw_pointer_cast(out.map.data());
  if (algorithm == DroppingAlgorithm::automatic)
    algorithm = Backend::is_device ? DroppingAlgorithm::sort : DroppingAlgorithm::columns;
  if (algorithm == DroppingAlgorithm::columns) {
    mrr::detail::require(!Backend::is_device, fn, "DroppingAlgorithm::columns runs on CPU threads only, not on ",
                         Backend::name);
    if constexpr (!Backend::is_device)
      thrust::for_each(exec, thrust::counting_iterator<int>(0), thrust::counting_iterator<int>(num_experts),
                       kernels::KeepColumn<T>{p, m, out_p, out_m, tokens, keep, num_experts, by_probs,
                                              pad_to_capacity});
  } else if (by_probs) {
    typename Backend::template vector<std::uint64_t> keys(cells);
    typename Backend::template vector<std::int32_t> order(cells);
    thrust::transform(exec, thrust::counting_iterator<long>(0), thrust::counting_iterator<long>(n), keys.begin(),
                      kernels::DescendingKey<T>{p});
    thrust::sequence(exec, order.begin(), order.end());
    // (key desc, token asc, expert asc), then stable by expert: (expert asc, key desc, token asc).
    thrust::stable_sort_by_key(exec, keys.begin(), keys.end(), order.begin());
    keys.clear();
    keys.shrink_to_fit();
    typename Backend::template vector<std::int32_t> experts(cells);
    thrust::transform(exec, thrust::counting_iterator<long>(0), thrust::counting_iterator<long>(n), experts.begin(),
                      kernels::ExpertOfCell{thrust::raw_pointer_cast(order.data()), num_experts});
    thrust::stable_sort_by_key(exec, experts.begin(), experts.end(), order.begin());
    thrust::for_each(exec, thrust::counting_iterator<long>(0), thrust::counting_iterator<long>(n),
                     kernels::MarkSortedKept<T>{thrust::raw_pointer_cast(order.data()), p, m, out_p, out_m, tokens,
                                                keep, pad_to_capacity});
  } else {
    typename Backend::template vector<std::int32_t> routed_before(cells);
    const auto column = thrust::make_transform_iterator(thrust::counting_iterator<long>(0), kernels::ColumnOfCell{tokens});
    const auto routed =
        thrust::make_transform_iterator(thrust::counting_iterator<long>(0), kernels::RoutedOfCell{m, tokens, num_experts});
    thrust::exclusive_scan_by_key(exec, column, column + n, routed, routed_before.begin(), std::int32_t(0));
    thrust::for_each(exec, thrust::counting_iterator<long>(0), thrust::counting_iterator<long>(n),
                     kernels::MarkPositionKept<T>{thrust::raw_pointer_cast(routed_before.data()), p, m, out_p, out_m,
                                                  tokens, keep, num_experts, pad_to_capacity});
  }
  return out;
}

}  // namespace device
MRR_NAMESPACE_END
