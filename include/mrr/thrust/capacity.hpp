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
// The keys, the strict order and the keep decisions are kernels/capacity.hpp's (the CPU's too).
// Below the dense form: drop_over_capacity on a top-k routing in caller memory (a view) and its
// Thrust-vector layer, which device::TopKRouter's capacity step calls.
// Inputs are checked on the host side of one reduction pass: shapes, capacity_factor (finite,
// > 0, as expert_capacity), map values 0/1, and (probs policy) no NaN probability, which would
// leave the order to the keys' encoding of NaN; the CPU's apply_token_dropping refuses the same.
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>
#include <mrr/kernels/capacity.hpp>
#include <mrr/kernels/router.hpp>
#include <mrr/router/capacity.hpp>
#include <mrr/router/config.hpp>
#include <mrr/thrust/backend.hpp>
#include <mrr/thrust/execution.hpp>
#include <mrr/thrust/permute.hpp>

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

// The probs policy's order key (kernels/capacity.hpp) of cell j.
template <class T>
struct DescendingKey {
  const T* probs;
  MRR_HOST_DEVICE std::uint64_t operator()(long j) const { return mrr::kernels::probs_key(probs[j]); }
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
    if (!mrr::kernels::kept_at_rank(p % tokens, keep)) return;
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
    if (mrr::kernels::kept_at_rank(rank, keep) && (pad || routed)) {
      out_map[j] = 1;
      out_probs[j] = probs[j];
    }
  }
};

// One expert column per work item, on CPU threads only: the CPU's keep_column and selection.
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
    std::vector<std::uint64_t> scratch(static_cast<std::size_t>(2 * tokens));
    mrr::kernels::keep_column(probs, num_experts, map, num_experts, tokens, num_experts, e, keep, by_probs, pad,
                              scratch.data(), out_probs, out_map, mrr::detail::NthElementSelect{});
  }
};

// Top-k dropping: slot_of_row inverts the permutation (every slot starts kept); then each expert's
// rows are one segment (kernels::drop_segment).
struct SlotOfRow {
  const std::int32_t* row_of_slot;
  std::int32_t* slot_of_row;
  std::uint8_t* kept;
  const DeviceStatus* status;
  MRR_HOST_DEVICE void operator()(long s) const {
    if (status->code != status_ok) return;
    slot_of_row[row_of_slot[s]] = static_cast<std::int32_t>(s);
    kept[s] = 1;
  }
};

// Token t's row listing an expert a second time: the repeat's slot, the lowest over all rows
// whatever order the work items run in, into *bad (which starts at the slot count).
template <class Id>
struct FindRepeatedExpert {
  const Id* ids;
  long* bad;
  int topk;
  MRR_HOST_DEVICE void operator()(long t) const {
    const int j = mrr::kernels::repeated_slot(ids + t * topk, topk);
    if (j >= 0) atomic_lower(bad, t * topk + j);
  }
};

// One work item: a repeat into the status, unless an id out of range was reported at a lower slot
// (the lowest bad slot is reported, as the CPU does).
struct ReportRepeatedExpert {
  const long* bad;
  DeviceStatus* status;
  long slots;
  MRR_HOST_DEVICE void operator()(int) const {
    if (*bad < slots &&
        (status->code == status_ok || (status->code == status_expert_out_of_range && *bad < status->index))) {
      status->code = status_repeated_expert;
      status->index = *bad;
    }
  }
};

template <class T>
struct DropSegment {
  const std::int32_t* offsets;
  const std::int32_t* slot_of_row;
  std::uint64_t* scratch;  // 2 keys per row: segment e uses [2 offsets[e], 2 offsets[e + 1])
  T* weights;
  std::uint8_t* kept;
  const DeviceStatus* status;
  long capacity;
  bool by_probs;
  MRR_HOST_DEVICE void operator()(int e) const {
    if (status->code != status_ok) return;
    const long first = offsets[e], last = offsets[e + 1];
#if MRR_COMPILING_WITH_NVCC
    const mrr::kernels::RadixSelect select{};
#else
    const mrr::detail::NthElementSelect select{};
#endif
    mrr::kernels::drop_segment(slot_of_row, first, last, capacity, by_probs, weights, kept, scratch + 2 * first,
                               select);
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

// ---- Top-k dropping on the caller's memory (the view the router's capacity path runs) ----

// Workspace of drop_over_capacity for [tokens, topk] slots over num_experts experts.
// `host_system`: for a CUDA build's host backend (the permutation's algorithm differs).
inline std::size_t drop_over_capacity_workspace_bytes(long tokens, int topk, int num_experts,
                                                      bool host_system = false) {
  const auto slots = static_cast<std::size_t>(tokens) * static_cast<std::size_t>(topk);
  return 3 * detail::workspace_array_bytes<std::int32_t>(slots) +
         detail::workspace_array_bytes<std::int32_t>(static_cast<std::size_t>(num_experts) + 1) +
         permutation_workspace_bytes(tokens, topk, num_experts, PermutationAlgorithm::automatic, host_system) +
         detail::workspace_array_bytes<std::uint64_t>(2 * slots) + detail::workspace_array_bytes<long>(1);
}

namespace detail {

// Megatron's top-k token dropping on any Thrust policy, in the order of kernels/capacity.hpp.
// `check_repeats`: a row listing an expert twice sets status_repeated_expert (off for a router's
// own ids, which never repeat).
template <class Policy, class Id, class T>
void drop_over_capacity(const Policy& policy, const Id* ids, T* weights, std::uint8_t* kept, long tokens, int topk,
                        int num_experts, long capacity, DropPolicy drop, WorkspaceArena& arena, DeviceStatus* status,
                        stream_t stream, bool on_host, bool check_repeats = true) {
  const auto slots = static_cast<std::size_t>(tokens) * static_cast<std::size_t>(topk);
  const PermutationView p{arena.take<std::int32_t>(slots), arena.take<std::int32_t>(slots),
                          arena.take<std::int32_t>(static_cast<std::size_t>(num_experts) + 1), tokens, topk,
                          num_experts};
  auto* slot_of_row = arena.take<std::int32_t>(slots);
  auto* scratch = arena.take<std::uint64_t>(2 * slots);
  auto* repeat = arena.take<long>(1);
  expert_permutation(policy, ids, static_cast<const std::uint8_t*>(nullptr), p, arena, status, stream,
                     PermutationAlgorithm::automatic, on_host);
  if (check_repeats && topk > 1) {
    // A token listing an expert twice would take two of its places: an error, as on the CPU.
    const long n = static_cast<long>(slots);
    thrust::for_each(policy, thrust::counting_iterator<int>(0), thrust::counting_iterator<int>(1),
                     kernels::SetLong{repeat, n});
    thrust::for_each(policy, thrust::counting_iterator<long>(0), thrust::counting_iterator<long>(tokens),
                     kernels::FindRepeatedExpert<Id>{ids, repeat, topk});
    thrust::for_each(policy, thrust::counting_iterator<int>(0), thrust::counting_iterator<int>(1),
                     kernels::ReportRepeatedExpert{repeat, status, n});
  }
  thrust::for_each(policy, thrust::counting_iterator<long>(0), thrust::counting_iterator<long>(static_cast<long>(slots)),
                   kernels::SlotOfRow{p.row_of_slot, slot_of_row, kept, status});
  thrust::for_each(policy, thrust::counting_iterator<int>(0), thrust::counting_iterator<int>(num_experts),
                   kernels::DropSegment<T>{p.expert_offsets, slot_of_row, scratch, weights, kept, status, capacity,
                                           drop == DropPolicy::probs});
}

}  // namespace detail

// Drops the slots over each expert's capacity (Megatron get_capacity(tokens * k, E,
// capacity_factor)) of a top-k routing in caller memory: ids [tokens, k] (int32 or int64) and
// weights [tokens, k] (float or double), both with contiguous rows. kept[t * k + j] (caller
// memory) becomes 1 for a dispatched slot, 0 for a dropped one, whose weight is zeroed in place.
// Which slots an expert keeps follows the strict order of kernels/capacity.hpp (probs: highest
// weight, then lower token; position: earliest tokens), as the CPU's drop_over_capacity. An id
// outside [0, num_experts) (status_expert_out_of_range), or a row listing an expert twice
// (status_repeated_expert: it would take two of the expert's places), sets *status, the lowest
// such slot in its index (check_permutation reads it), and leaves weights and kept unwritten.
// Given its workspace (drop_over_capacity_workspace_bytes), nothing allocates.
template <class Id, class T>
void drop_over_capacity(MatrixView<const Id> ids, MatrixView<T> weights, std::uint8_t* kept, int num_experts,
                        double capacity_factor, DropPolicy policy, Workspace workspace, DeviceStatus* status,
                        Execution x = {}) {
  static_assert(std::is_same_v<Id, std::int32_t> || std::is_same_v<Id, std::int64_t>,
                "device::drop_over_capacity takes int32 or int64 expert ids");
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                "device::drop_over_capacity takes float or double weights");
  constexpr const char* fn = "device::drop_over_capacity";
  const long tokens = ids.rows;
  const int topk = static_cast<int>(ids.cols);
  mrr::detail::require(num_experts > 0 && num_experts <= kMaxPermuteExperts, fn, "num_experts=", num_experts,
                       " outside the device limit [1, ", kMaxPermuteExperts, "]");
  mrr::detail::require(topk > 0 && static_cast<std::size_t>(tokens) * static_cast<std::size_t>(topk) < (std::size_t(1) << 31),
                       fn, "needs k > 0 and tokens * k < 2^31, got [", tokens, ", ", topk, "]");
  detail::require_view(ids, tokens, topk, fn, "ids");
  detail::require_view(weights, tokens, topk, fn, "weights");
  mrr::detail::require(ids.row_stride == topk && weights.row_stride == topk, fn,
                       "'ids' and 'weights' rows must be contiguous (row strides ", ids.row_stride, " and ",
                       weights.row_stride, " for k=", topk, "); copy them first");
  mrr::detail::require(status != nullptr && (kept != nullptr || tokens == 0), fn, "'kept' or the status is null");
  const long capacity = static_cast<long>(expert_capacity(tokens, topk, num_experts, capacity_factor));
  detail::WorkspaceArena arena(workspace, drop_over_capacity_workspace_bytes(tokens, topk, num_experts), fn);
  auto alloc = arena.temporary_allocator();
  detail::reset_status(status, x);
  detail::drop_over_capacity(detail::execution_policy(x, alloc), ids.data, weights.data, kept, tokens, topk,
                             num_experts, capacity, policy, arena, status, x.stream, false);
}

namespace detail {

// The owning layer's work; `check_repeats` off for a router's own ids (distinct by construction).
template <class T, class Backend>
void drop_over_capacity_owned(const typename Backend::template vector<std::int32_t>& ids,
                              typename Backend::template vector<T>& weights,
                              typename Backend::template vector<std::uint8_t>& kept, long tokens, int topk,
                              int num_experts, double capacity_factor, DropPolicy policy, bool check_repeats) {
  constexpr const char* fn = "device::drop_over_capacity";
  const auto slots = static_cast<std::size_t>(tokens) * static_cast<std::size_t>(topk);
  mrr::detail::require(ids.size() == slots && weights.size() == slots, fn, "'ids' and 'weights' have ", ids.size(),
                       " and ", weights.size(), " values, expected [", tokens, ", ", topk, "]");
  mrr::detail::require(num_experts > 0 && num_experts <= kMaxPermuteExperts, fn, "num_experts=", num_experts,
                       " outside the device limit [1, ", kMaxPermuteExperts, "]");
  const long capacity = static_cast<long>(expert_capacity(tokens, topk, num_experts, capacity_factor));
  kept.resize(slots);
  const std::size_t bytes = drop_over_capacity_workspace_bytes(tokens, topk, num_experts, !Backend::is_device);
  const OwnedWorkspace<decltype(Backend::policy())> workspace(Backend::policy(), bytes);
  typename Backend::template vector<DeviceStatus> status(1);
  WorkspaceArena arena(workspace.get(), bytes, fn);
  drop_over_capacity(Backend::policy(), raw(ids), raw(weights), raw(kept), tokens, topk, num_experts, capacity, policy,
                     arena, raw(status), nullptr, !Backend::is_device, check_repeats);
  throw_on_status(status[0], PermutationView{nullptr, nullptr, nullptr, tokens, topk, num_experts}, fn);
}

}  // namespace detail

// The owning layer: ids and weights [tokens, k] in Thrust vectors of the backend's system (ids
// from a router, or checked here on the device: in range and distinct within a row); kept is
// resized to [tokens, k]. A bad id throws, and leaves weights as they were.
template <class T, class Backend = ThrustDeviceBackend>
void drop_over_capacity(const typename Backend::template vector<std::int32_t>& ids,
                        typename Backend::template vector<T>& weights,
                        typename Backend::template vector<std::uint8_t>& kept, long tokens, int topk, int num_experts,
                        double capacity_factor, DropPolicy policy) {
  detail::drop_over_capacity_owned<T, Backend>(ids, weights, kept, tokens, topk, num_experts, capacity_factor, policy,
                                               true);
}

}  // namespace device
MRR_NAMESPACE_END
