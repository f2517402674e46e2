// mrr-requires: mrr_thrust_omp
// The diagnostics of mrr/diagnostics.hpp on a Thrust system, on the caller's memory and stream
// (DESIGN.md section 11): a GPU trainer compares its routings and log-probabilities where they
// are, and reads a handful of numbers back once.
//
//   device::RoutingMismatchCounter<> c(exec, workspace, num_layers, rows, compare);  // compare: device, or null
//   for (int l = 0; l < num_layers; ++l) c.add_layer(l, rollout_ids[l], train_ids[l]);  // queued on exec.stream
//   mrr::RoutingMismatch m = c.result();  // waits for the stream, reads the counts back
//   auto lp = device::logprob_divergence<float>(exec, workspace, train_lp, rollout_lp, mask, {2.0, 5.0});
//
// The results equal the host functions' bit for bit: the counts are integers, and the log-prob
// sums add the same fixed blocks of tokens (kernels::kDivergenceBlock) in the same order on every
// executor and thread count; the quantiles and F(tau) come from the same sorted values. The
// per-element math is mrr/diagnostics.hpp's kernels. Nothing is allocated once the workspace is
// given; nothing waits for the stream before result() / the divergence's return.
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/diagnostics.hpp>
#include <mrr/error.hpp>
#include <mrr/thrust/execution.hpp>

#include <thrust/fill.h>
#include <thrust/for_each.h>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/sort.h>
#if THRUST_DEVICE_SYSTEM == THRUST_DEVICE_SYSTEM_CUDA
#include <cub/device/device_radix_sort.cuh>
#endif

#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <stdexcept>
#include <vector>

MRR_NAMESPACE_BEGIN
namespace device {

namespace kernels {

inline constexpr long kMismatchRows = 64;  // rows per work item of a layer's comparison

struct MismatchCounts {  // one layer's (or one block's) counts, as mrr::RoutingMismatch's
  long long decisions = 0, differing = 0, experts = 0, differing_experts = 0;
  long long not_routings = 0;  // compared rows that are not routings (result() refuses them)
};
struct TokenCounts {
  long long tokens = 0, differing_tokens = 0, differing_layer_sum = 0;
};

// One layer, rows [block * kMismatchRows, ...): each row's differing experts, the row's layer
// counters (a row belongs to one work item), and the block's counts.
template <class IdA, class IdB>
struct CompareRouteRows {
  MatrixView<const IdA> a;
  MatrixView<const IdB> b;
  const std::uint8_t *compare, *found;
  std::int32_t *row_layers, *row_differing;
  MismatchCounts* block_counts;  // this layer's
  MRR_HOST_DEVICE void operator()(long block) const {
    MismatchCounts c;
    const int k = static_cast<int>(a.cols);
    const long end = (block + 1) * kMismatchRows < a.rows ? (block + 1) * kMismatchRows : a.rows;
    for (long r = block * kMismatchRows; r < end; ++r) {
      if (!mrr::kernels::row_compared(compare, found, r)) continue;
      const int d = mrr::kernels::differing_experts(a.data + r * a.row_stride, b.data + r * b.row_stride, k);
      if (d == mrr::kernels::kNotARouting) {
        c.not_routings += 1;
        continue;
      }
      c.decisions += 1, c.experts += k, c.differing_experts += d;
      c.differing += d != 0 ? 1 : 0;
      row_differing[r] += d != 0 ? 1 : 0;
      row_layers[r] += 1;
    }
    block_counts[block] = c;
  }
};

// Layer l's counts: its blocks' in order.
struct SumLayerBlocks {
  const MismatchCounts* block_counts;  // [layers, blocks]
  long blocks;
  MismatchCounts* layer_counts;  // [layers]
  MRR_HOST_DEVICE void operator()(long l) const {
    MismatchCounts t;
    for (long i = 0; i < blocks; ++i) {
      const MismatchCounts& c = block_counts[l * blocks + i];
      t.decisions += c.decisions, t.differing += c.differing, t.experts += c.experts;
      t.differing_experts += c.differing_experts;
      t.not_routings += c.not_routings;
    }
    layer_counts[l] = t;
  }
};

// A block's tokens: rows compared in every one of the `added` layers.
struct CountTokens {
  const std::int32_t *row_layers, *row_differing;
  long rows;
  int added;
  TokenCounts* token_counts;  // [blocks]
  MRR_HOST_DEVICE void operator()(long block) const {
    TokenCounts t;
    const long end = (block + 1) * kMismatchRows < rows ? (block + 1) * kMismatchRows : rows;
    for (long r = block * kMismatchRows; r < end && added > 0; ++r) {
      if (row_layers[r] != added) continue;
      t.tokens += 1, t.differing_tokens += row_differing[r] != 0 ? 1 : 0, t.differing_layer_sum += row_differing[r];
    }
    token_counts[block] = t;
  }
};

inline constexpr int kMaxDivergenceThresholds = 8;

// Block `block` of the flat [rows, cols] tokens: its sums, each token's |d| (+inf where the mask
// leaves it out, so the sort puts those last), and the lowest token with a non-finite log-prob.
template <class T>
struct DivergenceBlock {
  MatrixView<const T> p, q, mask;  // mask.data null: every token
  double* abs;                     // [rows * cols]
  mrr::kernels::DivergenceSums* sums;
  long* first_bad;
  MRR_HOST_DEVICE void operator()(long block) const {
    const long n = p.rows * p.cols;
    const long end =
        (block + 1) * mrr::kernels::kDivergenceBlock < n ? (block + 1) * mrr::kernels::kDivergenceBlock : n;
    mrr::kernels::DivergenceSums s;
    for (long i = block * mrr::kernels::kDivergenceBlock; i < end; ++i) {
      const long r = i / p.cols, c = i - r * p.cols;
      abs[i] = HUGE_VAL;
      if (mask.data != nullptr && mask.data[r * mask.row_stride + c] == T(0)) continue;
      const double lp = static_cast<double>(p.data[r * p.row_stride + c]);
      const double lq = static_cast<double>(q.data[r * q.row_stride + c]);
      if (!(lp - lp == 0.0) || !(lq - lq == 0.0)) {  // NaN or infinite
        atomic_lower(first_bad, i);
        continue;
      }
      const auto t = mrr::kernels::divergence_terms(lp, lq);
      mrr::kernels::add(s, t);
      abs[i] = t.abs;
    }
    sums[block] = s;
  }
};

// What the host reads back: the sums, the quantiles and F(tau) counts of the sorted |d|.
struct DivergenceSummary {
  mrr::kernels::DivergenceSums total;
  double p50 = 0, p99 = 0, max = 0;
  long long above[kMaxDivergenceThresholds] = {};
  long first_bad = 0;
};

struct FinishDivergence {
  const mrr::kernels::DivergenceSums* sums;
  long blocks;
  const double* sorted;  // the masked tokens' |d| first, ascending
  const long* first_bad;
  double log_tau[kMaxDivergenceThresholds];
  int thresholds;
  DivergenceSummary* out;
  MRR_HOST_DEVICE void operator()(int) const {
    DivergenceSummary s;
    for (long i = 0; i < blocks; ++i)
      mrr::kernels::add(s.total, sums[i]);
    const auto n = static_cast<long>(s.total.tokens);
    if (n > 0) {
      s.p50 = sorted[mrr::kernels::nearest_rank_index(n, 0.50)];
      s.p99 = sorted[mrr::kernels::nearest_rank_index(n, 0.99)];
      s.max = sorted[n - 1];
      for (int t = 0; t < thresholds; ++t)
        s.above[t] = mrr::kernels::count_above(sorted, n, log_tau[t]);
    }
    s.first_bad = *first_bad;
    *out = s;
  }
};

}  // namespace kernels

// Routing mismatch (mrr::RoutingMismatch, the R3 paper's definitions) of two routings of the same
// `rows` rows over `num_layers` layers, counted where the ids are. The counters live in the
// caller's workspace (workspace_bytes); `compare` (device memory, [rows], or null: every row) skips
// rows whose entry is 0, as the host counter's. add_layer queues work on the stream; result() waits
// for it, copies the counts back and returns the host struct.
template <class Backend = ThrustDeviceBackend>
class RoutingMismatchCounter {
 public:
  static long blocks(long rows) { return (rows + kernels::kMismatchRows - 1) / kernels::kMismatchRows; }

  static std::size_t workspace_bytes(int num_layers, long rows) {
    const auto r = static_cast<std::size_t>(rows < 0 ? 0 : rows);
    const auto b = static_cast<std::size_t>(blocks(rows < 0 ? 0 : rows));
    const auto l = static_cast<std::size_t>(num_layers < 0 ? 0 : num_layers);
    return 2 * detail::workspace_array_bytes<std::int32_t>(r) +
           detail::workspace_array_bytes<kernels::MismatchCounts>(l * b + l) +
           detail::workspace_array_bytes<kernels::TokenCounts>(b);
  }

  RoutingMismatchCounter(const Execution& exec, Workspace workspace, int num_layers, long rows,
                         const std::uint8_t* compare = nullptr)
      : exec_(exec), layers_(num_layers), rows_(rows), compare_(compare) {
    constexpr const char* fn = "device::RoutingMismatchCounter";
    mrr::detail::require(num_layers > 0, fn, "num_layers must be positive, got ", num_layers);
    mrr::detail::require(rows >= 0, fn, "rows must be >= 0, got ", rows);
    WorkspaceArena arena(workspace, workspace_bytes(num_layers, rows), fn);
    const auto r = static_cast<std::size_t>(rows), b = static_cast<std::size_t>(blocks(rows));
    row_layers_ = arena.take<std::int32_t>(r);
    row_differing_ = arena.take<std::int32_t>(r);
    // Each layer's block counts, then the layers' sums of them.
    block_counts_ = arena.take<kernels::MismatchCounts>(static_cast<std::size_t>(num_layers) * (b + 1));
    layer_counts_ = block_counts_ + static_cast<std::size_t>(num_layers) * b;
    token_counts_ = arena.take<kernels::TokenCounts>(b);
    WorkspaceArena none(Workspace{}, fn);
    const auto policy = execution_policy<Backend>(exec_, none);
    thrust::fill(policy, row_layers_, row_layers_ + rows, 0);
    thrust::fill(policy, row_differing_, row_differing_ + rows, 0);
    const kernels::MismatchCounts zero{};
    thrust::fill(policy, block_counts_, block_counts_ + static_cast<long>(num_layers) * blocks(rows), zero);
  }

  // One layer's two routings [rows, k] (int32 / int64 ids, any row stride); `found` (device, or
  // null) further restricts the rows compared in this layer (a store lookup's found flags).
  template <class IdA, class IdB>
  void add_layer(int layer, MatrixView<const IdA> a, MatrixView<const IdB> b, const std::uint8_t* found = nullptr) {
    constexpr const char* fn = "device::RoutingMismatchCounter::add_layer";
    mrr::detail::require(layer >= 0 && layer < layers_, fn, "layer ", layer, " outside [0, ", layers_, ")");
    mrr::detail::require(a.cols > 0 && a.cols <= 4096, fn, "the routings have k = ", a.cols, ", outside [1, 4096]");
    require_view(a, rows_, a.cols, fn, "a");
    require_view(b, rows_, a.cols, fn, "b");
    mrr::detail::require(added_layers_[static_cast<std::size_t>(layer)] == 0, fn, "layer ", layer,
                         " was already added (each layer once: a second time would count its tokens twice)");
    WorkspaceArena none(Workspace{}, fn);
    const auto policy = execution_policy<Backend>(exec_, none);
    const long nb = blocks(rows_);
    thrust::for_each(policy, thrust::counting_iterator<long>(0), thrust::counting_iterator<long>(nb),
                     kernels::CompareRouteRows<IdA, IdB>{a, b, compare_, found, row_layers_, row_differing_,
                                                         block_counts_ + static_cast<long>(layer) * nb});
    added_layers_[static_cast<std::size_t>(layer)] = 1;
    ++added_;
  }

  // The counts so far (synchronises); per-token figures count the rows compared in every layer added.
  mrr::RoutingMismatch result() const {
    constexpr const char* fn = "device::RoutingMismatchCounter::result";
    WorkspaceArena none(Workspace{}, fn);
    const auto policy = execution_policy<Backend>(exec_, none);
    const long nb = blocks(rows_);
    thrust::for_each(policy, thrust::counting_iterator<long>(0), thrust::counting_iterator<long>(layers_),
                     kernels::SumLayerBlocks{block_counts_, nb, layer_counts_});
    thrust::for_each(policy, thrust::counting_iterator<long>(0), thrust::counting_iterator<long>(nb),
                     kernels::CountTokens{row_layers_, row_differing_, rows_, added_, token_counts_});
    std::vector<kernels::MismatchCounts> layers(static_cast<std::size_t>(layers_));
    std::vector<kernels::TokenCounts> tokens(static_cast<std::size_t>(nb));
    copy_to_host<Backend>(exec_, layer_counts_, layers.size(), layers.data());
    copy_to_host<Backend>(exec_, token_counts_, tokens.size(), tokens.data());
    for (std::size_t l = 0; l < layers.size(); ++l)
      mrr::detail::require(layers[l].not_routings == 0, fn, "layer ", l, ": ", layers[l].not_routings,
                           " compared rows are not routings (an id is negative, e.g. a store's -1 for no route, "
                           "or repeated); skip such rows with 'found' or 'compare'");
    mrr::RoutingMismatch m;
    for (const auto& c : layers) {
      m.layer_decisions.push_back(c.decisions), m.layer_differing.push_back(c.differing);
      m.decisions += c.decisions, m.differing += c.differing, m.experts += c.experts;
      m.differing_experts += c.differing_experts;
    }
    for (const auto& t : tokens)
      m.tokens += t.tokens, m.differing_tokens += t.differing_tokens, m.differing_layer_sum += t.differing_layer_sum;
    return m;
  }

 private:
  Execution exec_;
  int layers_;
  long rows_;
  const std::uint8_t* compare_;
  std::int32_t *row_layers_ = nullptr, *row_differing_ = nullptr;
  kernels::MismatchCounts *block_counts_ = nullptr, *layer_counts_ = nullptr;
  kernels::TokenCounts* token_counts_ = nullptr;
  std::vector<std::uint8_t> added_layers_ =
      std::vector<std::uint8_t>(static_cast<std::size_t>(layers_ > 0 ? layers_ : 0), 0);
  int added_ = 0;
};

// Workspace of logprob_divergence for [rows, cols] log-probs.
inline std::size_t logprob_divergence_workspace_bytes(long rows, long cols) {
  const auto n = static_cast<std::size_t>(rows < 0 || cols < 0 ? 0 : rows * cols);
  const auto blocks = (n + mrr::kernels::kDivergenceBlock - 1) / mrr::kernels::kDivergenceBlock;
  std::size_t sort_bytes = 0;
#if THRUST_DEVICE_SYSTEM == THRUST_DEVICE_SYSTEM_CUDA
  const cudaError_t e = cub::DeviceRadixSort::SortKeys(nullptr, sort_bytes, static_cast<const double*>(nullptr),
                                                       static_cast<double*>(nullptr), static_cast<int>(n));
  if (e != cudaSuccess)
    throw std::runtime_error(
        mrr::detail::str("mrr::device::logprob_divergence_workspace_bytes: ", cudaGetErrorString(e)));
#else
  sort_bytes = 4 * n * sizeof(double) + (std::size_t(1) << 20);  // a bound on thrust::sort's temporaries
#endif
  return 2 * detail::workspace_array_bytes<double>(n) +
         detail::workspace_array_bytes<mrr::kernels::DivergenceSums>(blocks) + detail::workspace_array_bytes<long>(1) +
         detail::workspace_array_bytes<kernels::DivergenceSummary>(1) + detail::align_up(sort_bytes);
}

// mrr::logprob_divergence on [rows, cols] log-probs in backend memory (any row stride): log p (one
// engine), log q (the other), `mask` (empty view: every token; a token counts where it is non-zero)
// and at most 8 thresholds tau > 1 for F(tau). Synchronises once, to return the host struct; a
// non-finite log-prob of a counted token is an error naming it.
template <class T, class Backend = ThrustDeviceBackend>
mrr::LogProbDivergence logprob_divergence(const Execution& exec, Workspace workspace, MatrixView<const T> log_p,
                                          MatrixView<const T> log_q, MatrixView<const T> mask = {},
                                          std::span<const double> thresholds = {}) {
  constexpr const char* fn = "device::logprob_divergence";
  require_view(log_p, log_p.rows, log_p.cols, fn, "log_p");
  require_view(log_q, log_p.rows, log_p.cols, fn, "log_q");
  if (!mask.empty()) require_view(mask, log_p.rows, log_p.cols, fn, "mask");
  mrr::detail::require(thresholds.size() <= static_cast<std::size_t>(kernels::kMaxDivergenceThresholds), fn, "at most ",
                       kernels::kMaxDivergenceThresholds, " thresholds, got ", thresholds.size());
  kernels::FinishDivergence finish{};
  for (std::size_t t = 0; t < thresholds.size(); ++t) {
    mrr::detail::require(thresholds[t] > 1.0, fn, "threshold ", thresholds[t],
                         " must be > 1 (F(tau) compares max(p/q, q/p) with it)");
    finish.log_tau[t] = std::log(thresholds[t]);
  }
  finish.thresholds = static_cast<int>(thresholds.size());

  const long n = log_p.rows * log_p.cols;
  mrr::detail::require(n < (long(1) << 31), fn, "[", log_p.rows, ", ", log_p.cols,
                       "] log-probs exceed the sort's int32 count; compare them in parts");
  const long blocks = (n + mrr::kernels::kDivergenceBlock - 1) / mrr::kernels::kDivergenceBlock;
  WorkspaceArena arena(workspace, logprob_divergence_workspace_bytes(log_p.rows, log_p.cols), fn);
  auto* abs = arena.take<double>(static_cast<std::size_t>(n));
  auto* sorted = arena.take<double>(static_cast<std::size_t>(n));
  auto* sums = arena.take<mrr::kernels::DivergenceSums>(static_cast<std::size_t>(blocks));
  auto* first_bad = arena.take<long>(1);
  auto* summary = arena.take<kernels::DivergenceSummary>(1);
  const auto policy = execution_policy<Backend>(exec, arena);
  using thrust::counting_iterator;
  thrust::fill(policy, first_bad, first_bad + 1, n);
  thrust::for_each(policy, counting_iterator<long>(0), counting_iterator<long>(blocks),
                   kernels::DivergenceBlock<T>{log_p, log_q, mask, abs, sums, first_bad});
#if THRUST_DEVICE_SYSTEM == THRUST_DEVICE_SYSTEM_CUDA
  if constexpr (Backend::is_device) {
    std::size_t bytes = 0;
    cub::DeviceRadixSort::SortKeys(nullptr, bytes, abs, sorted, static_cast<int>(n));
    void* temp = arena.take<unsigned char>(bytes);
    const cudaError_t e = cub::DeviceRadixSort::SortKeys(temp, bytes, abs, sorted, static_cast<int>(n), 0,
                                                         int(sizeof(double) * 8), exec.stream);
    if (e != cudaSuccess)
      throw std::runtime_error(mrr::detail::str("mrr::device::logprob_divergence: ", cudaGetErrorString(e)));
  } else
#endif
  {
    thrust::copy(policy, abs, abs + n, sorted);
    thrust::sort(policy, sorted, sorted + n);
  }
  finish.sums = sums, finish.blocks = blocks, finish.sorted = sorted, finish.first_bad = first_bad,
  finish.out = summary;
  thrust::for_each(policy, counting_iterator<int>(0), counting_iterator<int>(1), finish);

  kernels::DivergenceSummary s;
  copy_to_host<Backend>(exec, summary, 1, &s);
  mrr::detail::require(s.first_bad >= n, fn, "token ", s.first_bad, " (row ", log_p.cols ? s.first_bad / log_p.cols : 0,
                       ", column ", log_p.cols ? s.first_bad % log_p.cols : 0,
                       ") has a non-finite log-probability; log-probabilities of sampled tokens must be finite");
  mrr::LogProbDivergence out;
  out.tokens = static_cast<std::int64_t>(s.total.tokens);
  if (out.tokens > 0) {
    out.k1 = s.total.k1 / s.total.tokens, out.k3 = s.total.k3 / s.total.tokens,
    out.mean_abs = s.total.abs / s.total.tokens;
    out.p50_abs = s.p50, out.p99_abs = s.p99, out.max_abs = s.max;
  }
  out.thresholds.assign(thresholds.begin(), thresholds.end());
  out.fraction_above.assign(thresholds.size(), 0.0);
  for (std::size_t t = 0; t < thresholds.size() && out.tokens > 0; ++t)
    out.fraction_above[t] = static_cast<double>(s.above[t]) / static_cast<double>(out.tokens);
  return out;
}

}  // namespace device
MRR_NAMESPACE_END
