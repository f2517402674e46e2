// mrr-requires: mrr_thrust_omp
// Top-k routing, replay and the router backward on a Thrust system (DESIGN.md sections 3 and 4):
// the router kernels the CPU TopKRouter runs (mrr/kernels/router.hpp, lower index wins ties), one
// token per functor call, so ids equal the CPU's wherever both compare the same values (every
// selection on logits; sqrt-softplus). Weights are recomputed from the logits and may differ from
// the CPU's in the last bits (exp rounding, summation order).
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/detail/softmax_tile.hpp>
#include <mrr/error.hpp>
#include <mrr/kernels/router.hpp>
#include <mrr/router/config.hpp>
#include <mrr/router/fwd.hpp>
#include <mrr/router/params.hpp>
#include <mrr/router/row_error.hpp>
#include <mrr/thrust/backend.hpp>
#include <mrr/thrust/bf16.hpp>
#include <mrr/thrust/capacity.hpp>
#include <mrr/thrust/execution.hpp>
#include <mrr/thrust/permute.hpp>

#include <cuda/std/limits>

#include <thrust/fill.h>
#include <thrust/find.h>
#include <thrust/for_each.h>
#include <thrust/functional.h>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/reduce.h>
#include <thrust/sort.h>
#include <thrust/transform.h>
#include <thrust/tuple.h>

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

MRR_NAMESPACE_BEGIN
namespace device {

// The router kernels (mrr/kernels/router.hpp) under the names this backend has always used.
using RouterParams = mrr::kernels::RouterParams;
using mrr::kernels::kMaxExperts;
using mrr::kernels::kMaxGroups;
using mrr::kernels::kMaxTopK;
inline RouterParams resolve(const RouterConfig& c) { return resolve_router_params(c); }

namespace kernels {

using mrr::kernels::RowStatus;
using mrr::kernels::row_invalid_logit;
using mrr::kernels::row_invalid_replay;
using mrr::kernels::row_nan_weight;
using mrr::kernels::row_ok;
using mrr::kernels::row_too_few_finite;

template <class T, class In>
MRR_HOST_DEVICE MRR_FORCEINLINE T widen(In x) {
  return static_cast<T>(x);
}
template <class T>
MRR_HOST_DEVICE MRR_FORCEINLINE T widen(bf16 x) {
  return static_cast<T>(x.to_float());
}

// Logits stored as In (T, or bf16 widened exactly to T): a row pointer to T values.
template <class T, class In>
struct RowOfLogits {
  T buffer[std::is_same_v<T, In> ? 1 : kMaxExperts];
  MRR_HOST_DEVICE const T* load(const In* z, int n) {
    if constexpr (std::is_same_v<T, In>) {
      (void)n;
      return z;
    } else {
      for (int e = 0; e < n; ++e) buffer[e] = widen<T>(z[e]);
      return buffer;
    }
  }
};

// A thread's selection scratch, on its stack (the bounds are checked by TopKRouter). On CPU
// threads `candidates` lets the block-bounded top-k run (mrr::kernels::topk_row); a GPU thread
// takes the plain insertion, and the unused array costs it no local memory.
template <class T>
struct ThreadSelectScratch {
  static_assert(kMaxGroups >= kMaxTopK, "values holds k selected values or a group score's top m");
  T scores[kMaxExperts];
  T values[kMaxGroups];
  T group_scores[kMaxGroups];
  int indices[kMaxGroups];
  int candidates[kMaxExperts];
  MRR_HOST_DEVICE mrr::kernels::SelectScratch<T> view(bool needs_scores) {
#if defined(__CUDA_ARCH__)
    int* cand = nullptr;
#else
    int* cand = candidates;
#endif
    return {needs_scores ? scores : nullptr, values, group_scores, indices, cand};
  }
};

inline constexpr long kReplayPrefetchRows = 4;

// One row of route / replay over row-strided buffers: replayed rows copy their ids, the others
// select natively (mrr::kernels::route_row). IdIn / IdOut: int32 or int64 ids.
template <class T, class In = T, class IdIn = std::int32_t, class IdOut = std::int32_t>
struct RouteRows {
  RouterParams p;
  const In* logits;
  long logits_stride;
  const T* bias;              // null without expert bias
  const IdIn* replay_ids;     // null for native routing
  long replay_stride;
  const std::uint8_t* replay_mask;  // null: every row replays (when replay_ids is set)
  IdOut* ids;
  long ids_stride;
  T* weights;
  long weights_stride;
  std::uint8_t* status;  // [tokens] RowStatus
  long tokens;

  MRR_HOST_DEVICE void operator()(long t) const {
    const int n = p.num_experts;
    RowOfLogits<T, In> row;
    const T* z = row.load(logits + t * logits_stride, n);
    const bool replayed = replay_ids != nullptr && (replay_mask == nullptr || replay_mask[t] != 0);
#if !defined(__CUDA_ARCH__) && (defined(__GNUC__) || defined(__clang__))
    // A replayed row reads k scattered logits: on CPU threads the loads of a row a few ahead
    // overlap this row's arithmetic (rows of one thread are consecutive): about 2 x measured.
    if (replayed && t + kReplayPrefetchRows < tokens && std::is_same_v<T, In>)
      for (int j = 0; j < p.topk; ++j) {
        const long ahead = t + kReplayPrefetchRows;
        const IdIn e = replay_ids[ahead * replay_stride + j];
        if (e >= 0 && e < n) __builtin_prefetch(logits + ahead * logits_stride + e);
      }
#endif
    ThreadSelectScratch<T> scratch;
    status[t] = mrr::kernels::route_row(p, z, bias, replayed ? replay_ids + t * replay_stride : nullptr,
                                        ids + t * ids_stride, weights + t * weights_stride,
                                        scratch.view(!replayed && !p.selects_on_logits));
  }
};

#if !defined(__CUDACC__)
// Replay of every row with k = 8 and a softmax over the chosen logits, on CPU threads (host code,
// never compiled by nvcc): a tile of kReplayTileRows rows per work item, done 8 rows at a time by
// the CPU router's AVX2 kernel (mrr::detail::replay_softmax_fused: hardware gathers, a transposed
// softmax, the same operations as mrr::kernels::softmax_gathered_scaled, so the same bits). Whatever
// that kernel does not finish (no AVX2, rows past the last multiple of 8) or flags (an id out of
// range or repeated, a NaN / +inf logit, an all-masked row) goes through RouteRows row by row,
// which computes the exact status: a flagged tile is redone whole. Needs int32 ids in and out and
// contiguous [tokens, 8] outputs.
inline constexpr long kReplayTileRows = 256;

struct ReplayTilesK8 {
  RouteRows<float, float> rows;
  float scale;  // 1 without a scaling factor
  void operator()(long tile) const {
    const long first = tile * kReplayTileRows;
    const long end = first + kReplayTileRows < rows.tokens ? first + kReplayTileRows : rows.tokens;
    const int n = rows.p.num_experts;
    unsigned flags = 0;
    const long readable = rows.tokens - first < end - first + 8 ? rows.tokens - first : end - first + 8;
    long done = mrr::detail::replay_softmax_fused(rows.logits + first * rows.logits_stride, rows.logits_stride,
                                                  rows.replay_ids + first * rows.replay_stride, rows.replay_stride, 8,
                                                  n, static_cast<int>(end - first), static_cast<int>(readable), scale,
                                                  rows.ids + first * 8, rows.weights + first * 8, flags);
    if (flags != 0) [[unlikely]]
      done = 0;
    for (long t = first; t < first + done; ++t) rows.status[t] = row_ok;
    for (long t = first + done; t < end; ++t) rows(t);
  }
};
#endif

// One row of the router backward (mrr::kernels::backward_row) over row-strided buffers: writes the
// whole row of grad (zeros off the row's ids).
template <class T, class In = T, class Id = std::int32_t>
struct BackwardRows {
  RouterParams p;
  const In* logits;
  long logits_stride;
  const Id* ids;
  long ids_stride;
  const T* grad_weights;
  long grad_weights_stride;
  const std::uint8_t* kept;  // null: every slot dispatched; else [tokens, k], dropped slots pass no gradient
  T* grad;
  long grad_stride;
  std::uint8_t* status;  // [tokens] RowStatus

  MRR_HOST_DEVICE void operator()(long t) const {
    const int k = p.topk;
    RowOfLogits<T, In> row;
    T g[kMaxTopK], w[kMaxTopK];
    status[t] = mrr::kernels::backward_row(p, row.load(logits + t * logits_stride, p.num_experts), ids + t * ids_stride,
                                           grad_weights + t * grad_weights_stride,
                                           kept != nullptr ? kept + t * k : nullptr, grad + t * grad_stride, g, w);
  }
};

template <class T>
struct NotFinite {
  MRR_HOST_DEVICE bool operator()(T x) const { return !(x == x) || !(x * T(0) == T(0)); }
};

struct IsBadRow {
  MRR_HOST_DEVICE bool operator()(std::uint8_t code) const { return code != row_ok; }
};

// Lowers *first to t when row t of a status buffer is bad: after a pass over every row, *first is
// the lowest bad row whatever order the rows ran in (the view checks' search, in one long of
// workspace: Thrust's find_if takes temporaries that grow with the rows on CUDA).
struct LowerToBadRow {
  const std::uint8_t* status;
  long* first;
  MRR_HOST_DEVICE void operator()(long t) const {
    if (status[t] != row_ok) atomic_lower(first, t);
  }
};

}  // namespace kernels

}  // namespace device

// Routing of a batch on a Thrust system: ids [tokens, k] (int32) and weights [tokens, k], row-major.
template <class T, class System>
struct Routing<T, ThrustBackend<System>> {
  template <class U>
  using vector = typename ThrustBackend<System>::template vector<U>;
  vector<std::int32_t> ids;
  vector<T> weights;  // zero for dropped slots
  long tokens = 0;
  int topk = 0;
  // [tokens, k] 1 where the slot is dispatched; empty when no capacity limit applies.
  vector<std::uint8_t> kept{};
  bool has_capacity_mask() const { return !kept.empty(); }
};

namespace device {

template <class T, class Backend = ThrustDeviceBackend>
using Routing = mrr::Routing<T, Backend>;

// mrr::TopKRouter<T, ThrustBackend<S>>: the Thrust executor of the router kernels, capacity
// dropping included. Logits, ids and weights are row-major Thrust vectors of the backend's
// system, or views of caller memory.
template <class T, class Backend>
class ThrustTopKRouter {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                "device::TopKRouter<T>: T must be float or double (fp32 logits in, as the CPU router)");

 public:
  template <class U>
  using vector = typename Backend::template vector<U>;

  explicit ThrustTopKRouter(RouterConfig config) : config_(std::move(config)) {
    constexpr const char* fn = "device::TopKRouter";
    config_.validate();
    mrr::detail::require(!config_.pad_to_capacity, fn,
                         "pad_to_capacity is for the dense apply_token_dropping: a padded "
                         "expert takes tokens not routed to it, which [tokens, k] ids cannot hold; this router drops "
                         "over-capacity slots without padding");
    mrr::detail::require(config_.num_experts <= kMaxExperts, fn, "num_experts=", config_.num_experts,
                         " exceeds the device limit ", kMaxExperts);
    mrr::detail::require(config_.topk <= kMaxTopK, fn, "topk=", config_.topk, " exceeds the device limit ", kMaxTopK);
    mrr::detail::require(config_.num_groups <= kMaxGroups, fn, "num_groups=", config_.num_groups,
                         " exceeds the device limit ", kMaxGroups);
    mrr::detail::require(!config_.grouped() || config_.effective_group_score_topk() <= kMaxTopK, fn,
                         "group_score_topk exceeds the device limit ", kMaxTopK);
    params_ = resolve(config_);
    if (config_.use_expert_bias) bias_ = vector<T>(static_cast<std::size_t>(config_.num_experts), T(0));
  }

  const RouterConfig& config() const { return config_; }
  const RouterParams& params() const { return params_; }
  int num_experts() const { return config_.num_experts; }
  int topk() const { return config_.topk; }
  // The selection-only bias in backend memory (num_experts values; device memory on CUDA), for
  // kernels that take it by pointer (cuda::fused_route_replay); null without use_expert_bias.
  const T* expert_bias_data() const { return config_.use_expert_bias ? raw(bias_) : nullptr; }

  // Selection-only bias, copied from any Thrust or host range of num_experts values.
  template <class Range>
  void set_expert_bias(const Range& bias) {
    mrr::detail::require(config_.use_expert_bias, "device::TopKRouter::set_expert_bias",
                         "the config has use_expert_bias = false");
    mrr::detail::require(static_cast<int>(bias.size()) == num_experts(), "device::TopKRouter::set_expert_bias",
                         "bias has ", bias.size(), " entries for ", num_experts(), " experts");
    vector<T> values(bias.begin(), bias.end());
    // As the CPU router: every value finite (a -inf bias is no mask), and a rejected bias leaves
    // the router's as it was.
    const auto bad = thrust::find_if(Backend::policy(), values.begin(), values.end(), kernels::NotFinite<T>{});
    if (bad != values.end()) [[unlikely]]
      mrr::detail::throw_invalid_argument("device::TopKRouter::set_expert_bias", "bias[", bad - values.begin(),
                                          "] is not finite");
    bias_ = std::move(values);
  }

  // ---- The view API (DESIGN.md section 11): caller memory, stream and workspace -------------
  // Inputs and outputs are MatrixViews of backend memory (device memory on CUDA): logits [rows, E]
  // as float, double or bf16 with any row stride; ids int32 or int64 (replayed ids are range-checked
  // in their own type: an int64 2^32 + e is out of range, never e); weights [rows, k]; status [rows]
  // gets each row's kernels::RowStatus (0: routed). Work is queued on exec.stream and nothing is
  // allocated; row errors go to `status` only: check_route / check_replay / check_backward, called
  // with the same arguments, synchronise and throw the CPU router's message for the first bad row.
  // Capacity dropping is a pass over the whole batch: a config with capacity_factor is refused
  // here (route without it, then drop with mrr/thrust/capacity.hpp).

  // Workspace the view calls and their checks need for `rows` rows: the row kernels need none;
  // a check's search for the first bad row takes Thrust temporaries (a reduction's partials).
  static std::size_t workspace_bytes(long rows) {
    (void)rows;  // the reduction's partials depend on the launch, not on the row count
    return kCheckWorkspaceBytes;
  }

  template <class In, class IdOut>
  void route(const Execution& exec, MatrixView<const In> logits, MatrixView<IdOut> ids, MatrixView<T> weights,
             std::uint8_t* status, Workspace workspace) const {
    constexpr const char* fn = "device::TopKRouter::route";
    require_no_capacity(fn);
    launch_rows(exec, logits, MatrixView<const std::int32_t>{}, nullptr, ids, weights, status, workspace, fn);
  }

  // Replays replay_ids [rows, k]; with a replay_mask [rows] (may be null), rows whose mask is 0
  // route natively.
  template <class In, class IdIn, class IdOut>
  void replay(const Execution& exec, MatrixView<const In> logits, MatrixView<const IdIn> replay_ids,
              const std::uint8_t* replay_mask, MatrixView<IdOut> ids, MatrixView<T> weights, std::uint8_t* status,
              Workspace workspace) const {
    constexpr const char* fn = "device::TopKRouter::replay";
    require_no_capacity(fn);
    mrr::detail::require(!replay_ids.empty() || logits.rows == 0, fn, "'replay_ids' is a null pointer");
    launch_rows(exec, logits, replay_ids, replay_mask, ids, weights, status, workspace, fn);
  }

  // The router backward for the ids [rows, k] (native or replayed alike): grad_logits [rows, E] =
  // d sum(grad_weights * weights) / d logits; slots whose kept [rows, k] (may be null) is 0 pass
  // no gradient. A row with an id out of range or repeated gets zeros and row_invalid_replay.
  template <class In, class Id>
  void backward(const Execution& exec, MatrixView<const In> logits, MatrixView<const Id> ids,
                MatrixView<const T> grad_weights, const std::uint8_t* kept, MatrixView<T> grad_logits,
                std::uint8_t* status, Workspace workspace) const {
    constexpr const char* fn = "device::TopKRouter::backward";
    const long rows = logits.rows;
    require_view(logits, rows, num_experts(), fn, "logits");
    require_view(ids, rows, topk(), fn, "ids");
    require_view(grad_weights, rows, topk(), fn, "grad_weights");
    require_view(grad_logits, rows, num_experts(), fn, "grad_logits");
    mrr::detail::require(status != nullptr || rows == 0, fn, "'status' is a null pointer");
    WorkspaceAllocator alloc(workspace, fn);
    thrust::for_each(execution_policy<Backend>(exec, alloc), thrust::counting_iterator<long>(0),
                     thrust::counting_iterator<long>(rows),
                     kernels::BackwardRows<T, In, Id>{params_, logits.data, logits.row_stride, ids.data, ids.row_stride,
                                                      grad_weights.data, grad_weights.row_stride, kept,
                                                      grad_logits.data, grad_logits.row_stride, status});
  }

  // The checking conveniences: synchronise, then throw the CPU router's error for the first row
  // whose status is not row_ok (copying that one row to the host); return when every row is.
  template <class In, class IdOut>
  void check_route(const Execution& exec, MatrixView<const In> logits, MatrixView<IdOut> ids, MatrixView<T> weights,
                   const std::uint8_t* status, Workspace workspace) const {
    check_rows(exec, logits, MatrixView<const std::int32_t>{}, nullptr, ids, weights, status, workspace,
               "device::TopKRouter::route");
  }
  template <class In, class IdIn, class IdOut>
  void check_replay(const Execution& exec, MatrixView<const In> logits, MatrixView<const IdIn> replay_ids,
                    const std::uint8_t* replay_mask, MatrixView<IdOut> ids, MatrixView<T> weights,
                    const std::uint8_t* status, Workspace workspace) const {
    check_rows(exec, logits, replay_ids, replay_mask, ids, weights, status, workspace, "device::TopKRouter::replay");
  }
  template <class In, class Id>
  void check_backward(const Execution& exec, MatrixView<const In> logits, MatrixView<const Id> ids,
                      MatrixView<const T> grad_weights, const std::uint8_t* kept, MatrixView<T> grad_logits,
                      const std::uint8_t* status, Workspace workspace) const {
    (void)grad_weights, (void)kept, (void)grad_logits;
    constexpr const char* fn = "device::TopKRouter::backward";
    const long row = first_bad_row(exec, status, logits.rows, workspace, fn);
    if (row < 0) return;
    std::vector<Id> given(static_cast<std::size_t>(topk()));
    copy_to_host<Backend>(exec, ids.data + row * ids.row_stride, given.size(), given.data());
    mrr::detail::reject_invalid_ids(given.data(), topk(), num_experts(), row, fn);
    mrr::detail::throw_invalid_argument(fn, "row ", row, " was rejected (status ", int(row_status(exec, status, row)),
                                        ")");
  }

  // ---- Owning conveniences: Thrust vectors of the backend, a thin layer over the views --------

  Routing<T, Backend> route(const vector<T>& logits) const { return run(logits, nullptr, nullptr); }

  // Replays `ids` [tokens, k]; with a replay_mask [tokens], rows whose mask is 0 route natively.
  Routing<T, Backend> replay(const vector<T>& logits, const vector<std::int32_t>& ids) const {
    return run(logits, &ids, nullptr);
  }
  Routing<T, Backend> replay(const vector<T>& logits, const vector<std::int32_t>& ids,
                             const vector<std::uint8_t>& replay_mask) const {
    return run(logits, &ids, &replay_mask);
  }

  // bf16 logits (as a bf16 model's gate produces them): widened exactly to T, so the ids equal
  // those of the CPU router run on the bf16-rounded fp32 logits.
  Routing<T, Backend> route(const vector<bf16>& logits) const { return run(logits, nullptr, nullptr); }
  Routing<T, Backend> replay(const vector<bf16>& logits, const vector<std::int32_t>& ids) const {
    return run(logits, &ids, nullptr);
  }
  Routing<T, Backend> replay(const vector<bf16>& logits, const vector<std::int32_t>& ids,
                             const vector<std::uint8_t>& replay_mask) const {
    return run(logits, &ids, &replay_mask);
  }

  // Gradient of sum(grad_weights * weights) w.r.t. the logits [tokens, E] for the given ids.
  vector<T> backward(const vector<T>& logits, const vector<std::int32_t>& ids, const vector<T>& grad_weights) const {
    return backward_impl(logits, ids, grad_weights, nullptr);
  }
  // The same for a routing with dropped slots (Routing::kept): they pass no gradient.
  vector<T> backward(const vector<T>& logits, const vector<std::int32_t>& ids, const vector<T>& grad_weights,
                     const vector<std::uint8_t>& kept) const {
    mrr::detail::require(kept.size() == ids.size(), "device::TopKRouter::backward", "'kept' has ", kept.size(),
                         " entries for ", ids.size(), " slots");
    return backward_impl(logits, ids, grad_weights, &kept);
  }

 private:
  // The search for the first bad row: one long (kernels::LowerToBadRow), whatever the rows.
  static constexpr std::size_t kCheckWorkspaceBytes = mrr::device::kWorkspaceAlignment;

  void require_no_capacity(const char* fn) const {
    mrr::detail::require(!config_.capacity_factor, fn, "the config has capacity_factor = ", *config_.capacity_factor,
                         ": dropping over capacity is a pass over the whole batch, not part of the view call; route "
                         "with a config without it, then drop with mrr/thrust/capacity.hpp (or use the owning "
                         "route(), which does both)");
  }

  // The row kernels over the views (replay_ids empty: native routing), no checks of the rows.
  template <class In, class IdIn, class IdOut>
  void launch_rows(const Execution& exec, MatrixView<const In> logits, MatrixView<const IdIn> replay_ids,
                   const std::uint8_t* replay_mask, MatrixView<IdOut> ids, MatrixView<T> weights,
                   std::uint8_t* status, Workspace workspace, const char* fn) const {
    static_assert(std::is_same_v<In, T> || std::is_same_v<In, bf16>,
                  "device::TopKRouter: logits are T (float or double) or bf16");
    static_assert(std::is_same_v<IdIn, std::int32_t> || std::is_same_v<IdIn, std::int64_t>,
                  "device::TopKRouter: ids are int32 or int64");
    static_assert(std::is_same_v<IdOut, std::int32_t> || std::is_same_v<IdOut, std::int64_t>,
                  "device::TopKRouter: ids are int32 or int64");
    const long rows = logits.rows;
    const bool replays = !replay_ids.empty();
    require_view(logits, rows, num_experts(), fn, "logits");
    if (replays) require_view(replay_ids, rows, topk(), fn, "replay_ids");
    require_view(ids, rows, topk(), fn, "ids");
    require_view(weights, rows, topk(), fn, "weights");
    mrr::detail::require(status != nullptr || rows == 0, fn, "'status' is a null pointer");
    const kernels::RouteRows<T, In, IdIn, IdOut> kernel{params_,
                                                         logits.data,
                                                         logits.row_stride,
                                                         config_.use_expert_bias ? raw(bias_) : nullptr,
                                                         replays ? replay_ids.data : nullptr,
                                                         replay_ids.row_stride,
                                                         replays ? replay_mask : nullptr,
                                                         ids.data,
                                                         ids.row_stride,
                                                         weights.data,
                                                         weights.row_stride,
                                                         status,
                                                         rows};
    WorkspaceAllocator alloc(workspace, fn);
    const auto policy = execution_policy<Backend>(exec, alloc);
#if !defined(__CUDACC__)
    if constexpr (!Backend::is_device && std::is_same_v<T, float> && std::is_same_v<In, float> &&
                  std::is_same_v<IdIn, std::int32_t> && std::is_same_v<IdOut, std::int32_t>) {
      const bool gathered_softmax = params_.score == mrr::kernels::score_softmax && !params_.replay_reads_whole_row();
      if (replays && replay_mask == nullptr && topk() == 8 && gathered_softmax && ids.row_stride == 8 &&
          weights.row_stride == 8) {
        const long tiles = (rows + kernels::kReplayTileRows - 1) / kernels::kReplayTileRows;
        const float scale = params_.has_scale ? static_cast<float>(params_.scale) : 1.0f;
        thrust::for_each(policy, thrust::counting_iterator<long>(0), thrust::counting_iterator<long>(tiles),
                         kernels::ReplayTilesK8{kernel, scale});
        return;
      }
    }
#endif
    thrust::for_each(policy, thrust::counting_iterator<long>(0), thrust::counting_iterator<long>(rows), kernel);
  }

  // The first row whose status is not row_ok, or -1; synchronises (the answer goes to the host).
  long first_bad_row(const Execution& exec, const std::uint8_t* status, long rows, Workspace workspace,
                     const char* fn) const {
    if (rows == 0) return -1;
    WorkspaceAllocator alloc(workspace, fn);
    long* first = alloc.take<long>(1);
    const auto policy = execution_policy<Backend>(exec, alloc);
    thrust::fill_n(policy, first, 1, rows);
    thrust::for_each(policy, thrust::counting_iterator<long>(0), thrust::counting_iterator<long>(rows),
                     kernels::LowerToBadRow{status, first});
    long found = rows;
    copy_to_host<Backend>(exec, first, 1, &found);  // synchronises the stream
    return found == rows ? -1 : found;
  }

  std::uint8_t row_status(const Execution& exec, const std::uint8_t* status, long row) const {
    std::uint8_t code = 0;
    copy_to_host<Backend>(exec, status + row, 1, &code);
    return code;
  }

  template <class In, class IdIn, class IdOut>
  void check_rows(const Execution& exec, MatrixView<const In> logits, MatrixView<const IdIn> replay_ids,
                  const std::uint8_t* replay_mask, MatrixView<IdOut> ids, MatrixView<T> weights,
                  const std::uint8_t* status, Workspace workspace, const char* fn) const {
    const long row = first_bad_row(exec, status, logits.rows, workspace, fn);
    if (row < 0) return;
    // The row on the host, widened to T as the kernels read it.
    const auto n = static_cast<std::size_t>(num_experts()), k = static_cast<std::size_t>(topk());
    std::vector<In> stored(n);
    copy_to_host<Backend>(exec, logits.data + row * logits.row_stride, n, stored.data());
    std::vector<T> z(n);
    for (std::size_t e = 0; e < n; ++e) z[e] = kernels::widen<T>(stored[e]);
    std::uint8_t replayed = replay_ids.empty() ? 0 : 1;
    if (replayed && replay_mask != nullptr) copy_to_host<Backend>(exec, replay_mask + row, 1, &replayed);
    std::vector<IdIn> given(k);
    if (replayed) copy_to_host<Backend>(exec, replay_ids.data + row * replay_ids.row_stride, k, given.data());
    mrr::detail::reject_bad_row(params_, z.data(), replayed ? given.data() : nullptr, row, fn);
    std::vector<IdOut> chosen(k);
    std::vector<T> w(k);
    copy_to_host<Backend>(exec, ids.data + row * ids.row_stride, k, chosen.data());
    copy_to_host<Backend>(exec, weights.data + row * weights.row_stride, k, w.data());
    mrr::detail::reject_nan_weights(chosen.data(), w.data(), topk(), row, replayed != 0, fn);
    mrr::detail::throw_invalid_argument(fn, "row ", row, " was rejected (status ", int(row_status(exec, status, row)),
                                        ")");
  }

  vector<T> backward_impl(const vector<T>& logits, const vector<std::int32_t>& ids, const vector<T>& grad_weights,
                          const vector<std::uint8_t>* kept) const {
    constexpr const char* fn = "device::TopKRouter::backward";
    const long tokens = rows_of(logits, fn);
    const auto k = static_cast<std::size_t>(topk());
    mrr::detail::require(ids.size() == static_cast<std::size_t>(tokens) * k && grad_weights.size() == ids.size(), fn,
                         "ids and grad_weights must be [", tokens, ", ", k, "]");
    vector<T> grad(logits.size());
    vector<std::uint8_t> status(static_cast<std::size_t>(tokens));
    backward(Execution{}, MatrixView<const T>(raw(logits), tokens, num_experts()),
             MatrixView<const std::int32_t>(raw(ids), tokens, topk()),
             MatrixView<const T>(raw(grad_weights), tokens, topk()), kept ? raw(*kept) : nullptr,
             MatrixView<T>(raw(grad), tokens, num_experts()), raw(status), Workspace{});
    throw_on_bad_row(status, fn);
    return grad;
  }

  template <class V>
  static auto raw(const V& v) {
    return thrust::raw_pointer_cast(v.data());
  }
  template <class V>
  static auto raw(V& v) {
    return thrust::raw_pointer_cast(v.data());
  }

  template <class In>
  long rows_of(const vector<In>& logits, const char* fn) const {
    mrr::detail::require(logits.size() % static_cast<std::size_t>(num_experts()) == 0, fn, "logits have ",
                         logits.size(), " values, not a multiple of ", num_experts(), " experts");
    return static_cast<long>(logits.size() / static_cast<std::size_t>(num_experts()));
  }

  // One reduction over the per-row codes; only a failure looks for the first bad row.
  void throw_on_bad_row(const vector<std::uint8_t>& status, const char* fn) const {
    const auto policy = Backend::policy();
    const int worst = thrust::reduce(policy, status.begin(), status.end(), 0, thrust::maximum<int>());
    if (worst == kernels::row_ok) [[likely]]
      return;
    const auto first = thrust::find_if(policy, status.begin(), status.end(), kernels::IsBadRow{});
    const long row = static_cast<long>(first - status.begin());
    const int code = *first;
    if (code == kernels::row_invalid_logit)
      mrr::detail::throw_invalid_argument(fn, "logits row ", row, " holds NaN or +inf (-inf is the only valid mask)");
    if (code == kernels::row_invalid_replay)
      mrr::detail::throw_invalid_argument(fn, "row ", row, ": a replayed row has an expert id outside [0, ",
                                          num_experts(), ") or repeats an id");
    if (code == kernels::row_nan_weight)
      mrr::detail::throw_invalid_argument(
          fn, "logits row ", row,
          ": a weight is NaN because every logit it is normalised over is -inf "
          "(masked); a row whose chosen experts are all masked cannot be routed (group-limited "
          "routing keeps whole groups: the groups kept may hold only masked experts)");
    mrr::detail::throw_invalid_argument(fn, "logits row ", row, " has fewer finite logits than k=", topk(),
                                        " (the others are -inf, masked): a row needs at least k unmasked experts");
  }

  template <class In>
  Routing<T, Backend> run(const vector<In>& logits, const vector<std::int32_t>* replay_ids,
                          const vector<std::uint8_t>* mask) const {
    const char* fn = replay_ids ? "device::TopKRouter::replay" : "device::TopKRouter::route";
    const long tokens = rows_of(logits, fn);
    const auto k = static_cast<std::size_t>(topk());
    if (replay_ids) {
      mrr::detail::require(replay_ids->size() == static_cast<std::size_t>(tokens) * k, fn, "'ids' has ",
                           replay_ids->size(), " values, expected [", tokens, ", ", k, "]");
      if (mask)
        mrr::detail::require(mask->size() == static_cast<std::size_t>(tokens), fn, "'replay_mask' has ", mask->size(),
                             " entries for ", tokens, " rows of logits");
    }
    Routing<T, Backend> out{vector<std::int32_t>(static_cast<std::size_t>(tokens) * k),
                            vector<T>(static_cast<std::size_t>(tokens) * k), tokens, topk(), {}};
    vector<std::uint8_t> status(static_cast<std::size_t>(tokens));
    const long n = num_experts(), kk = topk();
    launch_rows(Execution{}, MatrixView<const In>(raw(logits), tokens, n),
                replay_ids ? MatrixView<const std::int32_t>(raw(*replay_ids), tokens, kk)
                           : MatrixView<const std::int32_t>{},
                mask ? raw(*mask) : nullptr, MatrixView<std::int32_t>(raw(out.ids), tokens, kk),
                MatrixView<T>(raw(out.weights), tokens, kk), raw(status), Workspace{}, fn);
    throw_on_bad_row(status, fn);
    if (config_.capacity_factor) drop_over_capacity(out);
    return out;
  }

  // Megatron's token dropping on the top-k routing, in the CPU router's order: the capacity view
  // (thrust/capacity.hpp) over the routing's own vectors. Position decisions equal the CPU's
  // exactly; probs decisions compare weights that may differ from the CPU's in the last bits, so a
  // near-tie at the capacity edge can differ.
  void drop_over_capacity(Routing<T, Backend>& r) const {
    device::detail::drop_over_capacity_owned<T, Backend>(r.ids, r.weights, r.kept, r.tokens, r.topk, num_experts(),
                                                         *config_.capacity_factor, config_.drop_policy,
                                                         false);  // own ids: distinct
  }

  RouterConfig config_;
  RouterParams params_;
  vector<T> bias_;
};

}  // namespace device

// One TopKRouter<T, Backend>: the Thrust backend's is this specialisation (the CPU's is the
// primary template, router/topk_router.hpp).
template <class T, class System>
class TopKRouter<T, ThrustBackend<System>> : public device::ThrustTopKRouter<T, ThrustBackend<System>> {
 public:
  using device::ThrustTopKRouter<T, ThrustBackend<System>>::ThrustTopKRouter;
};

namespace device {

template <class T, class Backend = ThrustDeviceBackend>
using TopKRouter = mrr::TopKRouter<T, Backend>;

}  // namespace device
MRR_NAMESPACE_END
