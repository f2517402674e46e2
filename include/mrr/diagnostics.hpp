// What routing replay is for, measured: how often two engines (rollout vs training, or two
// training passes) route the same tokens differently, and how far their log-probabilities are
// apart. The definitions are those of the R3 paper (arXiv 2510.11370):
//   - a routing decision is one (token, layer): it differs when the two expert *sets* differ
//     (slot order is not a decision);
//   - a token differs when at least one of its layers does;
//   - F(tau) is the fraction of tokens with max(p/q, q/p) > tau, i.e. |log p - log q| > log tau.
//
// Nothing here runs unless called: a trainer that leaves its diagnostics off pays nothing. The
// counts are sums, so micro-batches and ranks merge with += (or an all-reduce of counts()).
//
//   mrr::RoutingMismatchCounter c(num_layers, rows, real_rows_mask);
//   for (int l = 0; l < num_layers; ++l) c.add_layer(l, rollout_ids[l], train_ids[l]);
//   mrr::RoutingMismatch m = c.result();   // m.decision_fraction(), m.token_fraction(), ...
//   auto lp = mrr::logprob_divergence<float>(train_lp, rollout_lp, mask, {2.0, 5.0});
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>
#include <mrr/kernels/ppo/kl.hpp>
#include <mrr/replay/layout.hpp>
#include <mrr/tensor.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

MRR_NAMESPACE_BEGIN

namespace kernels {

// The per-element math of the diagnostics, written once for the host functions below and the
// device executors (mrr/thrust/diagnostics.hpp).

// A row that is not a routing: a negative id (a store's "no route" -1) or an expert listed twice.
inline constexpr int kNotARouting = -1;

// Whether k ids are a routing: none negative, none repeated.
template <class Id>
MRR_HOST_DEVICE inline bool is_routing_row(const Id* ids, int k) {
  for (int i = 0; i < k; ++i) {
    if (static_cast<long long>(ids[i]) < 0) return false;
    for (int j = 0; j < i; ++j)
      if (ids[i] == ids[j]) return false;
  }
  return true;
}

// Experts of one row's routing in `a` and not in `b` (k - |a ∩ b|), or kNotARouting when either
// row is not a routing (k - |a ∩ b| counts sets: a repeated or missing id would make it wrong).
template <class IdA, class IdB = IdA>
MRR_HOST_DEVICE inline int differing_experts(const IdA* a, const IdB* b, int k) {
  if (!is_routing_row(a, k) || !is_routing_row(b, k)) return kNotARouting;
  int same = 0;
  for (int i = 0; i < k; ++i)
    for (int j = 0; j < k; ++j)
      same += static_cast<long long>(a[i]) == static_cast<long long>(b[j]) ? 1 : 0;
  return k - same;
}

// Whether row r is compared: its `compare` and `found` entries (null: every row) are non-zero.
MRR_HOST_DEVICE inline bool row_compared(const std::uint8_t* compare, const std::uint8_t* found, long r) {
  return (compare == nullptr || compare[r] != 0) && (found == nullptr || found[r] != 0);
}

// One sampled token's terms: d = log p - log q, verl's low_var_kl k3 (kernels/ppo/kl.hpp) and |d|.
struct DivergenceTerms {
  double d = 0, k3 = 0, abs = 0;
};
MRR_HOST_DEVICE inline DivergenceTerms divergence_terms(double log_p, double log_q) {
  const double d = log_p - log_q;
  return {d, mrr::kernels::ppo::kl_k3<double>(log_p, log_q).value, d < 0 ? -d : d};
}

// Sums of the terms over a run of tokens (one block of a fixed partition: host and device add the
// same blocks in the same order, so their sums are the same bits).
struct DivergenceSums {
  double tokens = 0, k1 = 0, k3 = 0, abs = 0;
};
inline constexpr long kDivergenceBlock = 256;  // tokens per block

MRR_HOST_DEVICE inline void add(DivergenceSums& s, const DivergenceTerms& t) {
  s.tokens += 1, s.k1 += t.d, s.k3 += t.k3, s.abs += t.abs;
}
MRR_HOST_DEVICE inline void add(DivergenceSums& s, const DivergenceSums& o) {
  s.tokens += o.tokens, s.k1 += o.k1, s.k3 += o.k3, s.abs += o.abs;
}

// Nearest-rank q-quantile (q in (0, 1]) of n > 0 sorted values: the index of the ceil(q n)-th smallest.
MRR_HOST_DEVICE inline long nearest_rank_index(long n, double q) {
  double rank = q * static_cast<double>(n);
  auto r = static_cast<long>(rank);
  if (static_cast<double>(r) < rank) ++r;  // ceil
  r = r < 1 ? 1 : (r > n ? n : r);
  return r - 1;
}

// Values of sorted[0, n) above x (n minus the upper bound of x).
MRR_HOST_DEVICE inline long count_above(const double* sorted, long n, double x) {
  long lo = 0, hi = n;  // the first index whose value is > x lies in [lo, hi]
  while (lo < hi) {
    const long mid = lo + (hi - lo) / 2;
    if (sorted[mid] > x)
      hi = mid;
    else
      lo = mid + 1;
  }
  return n - lo;
}

}  // namespace kernels

// Routing mismatch between two routings of the same tokens, over num_layers layers.
struct RoutingMismatch {
  std::int64_t decisions = 0;         // (token, layer) pairs compared
  std::int64_t differing = 0;         // of which the expert sets differ
  std::int64_t experts = 0;           // expert slots compared (decisions x k)
  std::int64_t differing_experts = 0; // experts chosen by one side only (k - |intersection| per pair)
  std::int64_t tokens = 0;            // tokens compared in every layer
  std::int64_t differing_tokens = 0;  // tokens with at least one differing layer
  std::int64_t differing_layer_sum = 0;  // sum over tokens of their differing layers
  std::vector<std::int64_t> layer_decisions, layer_differing;  // per layer

  double decision_fraction() const { return ratio(differing, decisions); }
  double expert_fraction() const { return ratio(differing_experts, experts); }
  double token_fraction() const { return ratio(differing_tokens, tokens); }
  // Mean differing layers per token, over all tokens, and over the tokens that differ at all.
  double mean_differing_layers() const { return ratio(differing_layer_sum, tokens); }
  double mean_differing_layers_of_differing_tokens() const { return ratio(differing_layer_sum, differing_tokens); }
  double layer_fraction(int layer) const {
    detail::require(layer >= 0 && static_cast<std::size_t>(layer) < layer_decisions.size(),
                    "RoutingMismatch::layer_fraction", "layer ", layer, " outside [0, ", layer_decisions.size(), ")");
    const auto l = static_cast<std::size_t>(layer);
    return ratio(layer_differing[l], layer_decisions[l]);
  }

  // Every count, in one array (for an all-reduce across ranks), and back.
  std::vector<std::int64_t> counts() const {
    std::vector<std::int64_t> c{decisions, differing, experts, differing_experts, tokens, differing_tokens,
                                differing_layer_sum};
    c.insert(c.end(), layer_decisions.begin(), layer_decisions.end());
    c.insert(c.end(), layer_differing.begin(), layer_differing.end());
    return c;
  }
  static RoutingMismatch from_counts(std::span<const std::int64_t> c) {
    detail::require(c.size() >= 7 && (c.size() - 7) % 2 == 0, "RoutingMismatch::from_counts",
                    "expected 7 + 2 x layers counts, got ", c.size());
    RoutingMismatch m;
    m.decisions = c[0], m.differing = c[1], m.experts = c[2], m.differing_experts = c[3], m.tokens = c[4],
    m.differing_tokens = c[5], m.differing_layer_sum = c[6];
    const std::size_t layers = (c.size() - 7) / 2;
    m.layer_decisions.assign(c.begin() + 7, c.begin() + 7 + static_cast<std::ptrdiff_t>(layers));
    m.layer_differing.assign(c.begin() + 7 + static_cast<std::ptrdiff_t>(layers), c.end());
    return m;
  }

  RoutingMismatch& operator+=(const RoutingMismatch& o) {
    detail::require(layer_decisions.empty() || o.layer_decisions.empty() ||
                        layer_decisions.size() == o.layer_decisions.size(),
                    "RoutingMismatch::operator+=", "merging ", layer_decisions.size(), " layers with ",
                    o.layer_decisions.size());
    decisions += o.decisions, differing += o.differing, experts += o.experts;
    differing_experts += o.differing_experts, tokens += o.tokens, differing_tokens += o.differing_tokens;
    differing_layer_sum += o.differing_layer_sum;
    if (layer_decisions.empty()) {
      layer_decisions = o.layer_decisions;
      layer_differing = o.layer_differing;
    } else {
      for (std::size_t l = 0; l < o.layer_decisions.size(); ++l) {
        layer_decisions[l] += o.layer_decisions[l];
        layer_differing[l] += o.layer_differing[l];
      }
    }
    return *this;
  }

 private:
  static double ratio(std::int64_t a, std::int64_t b) {
    return b > 0 ? static_cast<double>(a) / static_cast<double>(b) : 0.0;
  }
};

// Compares two routings of the same `rows` rows layer by layer. Rows whose `compare` entry is 0
// (padding, a prompt, a token one side has no route for) are skipped; an empty `compare` compares
// every row. A token counts in `tokens` when it was compared in every layer added.
class RoutingMismatchCounter {
 public:
  RoutingMismatchCounter(int num_layers, long rows, std::span<const std::uint8_t> compare = {})
      : layers_(checked_layers(num_layers)),
        rows_(checked_rows(rows)),
        compare_(compare.begin(), compare.end()),
        row_layers_(static_cast<std::size_t>(rows), 0),
        row_differing_(static_cast<std::size_t>(rows), 0),
        added_layers_(static_cast<std::size_t>(num_layers), 0),
        differences_(static_cast<std::size_t>(rows), 0) {
    detail::require(compare.empty() || static_cast<long>(compare.size()) == rows, "RoutingMismatchCounter",
                    "'compare' has ", compare.size(), " entries for ", rows, " rows");
    m_.layer_decisions.assign(static_cast<std::size_t>(num_layers), 0);
    m_.layer_differing.assign(static_cast<std::size_t>(num_layers), 0);
  }

  // One layer's two routings [rows, k]; `found` (may be empty) further restricts the rows compared
  // in this layer (a store lookup's found flags).
  void add_layer(int layer, ExpertIdsRef a, ExpertIdsRef b, std::span<const std::uint8_t> found = {}) {
    constexpr const char* fn = "RoutingMismatchCounter::add_layer";
    detail::require(layer >= 0 && layer < layers_, fn, "layer ", layer, " outside [0, ", layers_, ")");
    detail::require(a.rows() == rows_ && b.rows() == rows_ && a.cols() == b.cols() && a.cols() > 0, fn,
                    "the routings have shapes ", detail::shape_of(a), " and ", detail::shape_of(b), " for ", rows_,
                    " rows");
    detail::require(found.empty() || static_cast<long>(found.size()) == rows_, fn, "'found' has ", found.size(),
                    " entries for ", rows_, " rows");
    const auto l = static_cast<std::size_t>(layer);
    detail::require(added_layers_[l] == 0, fn, "layer ", layer,
                    " was already added (each layer once: a second time would count its tokens twice)");
    const int k = static_cast<int>(a.cols());
    const auto compared = [&](long r) {
      return kernels::row_compared(compare_.empty() ? nullptr : compare_.data(), found.empty() ? nullptr : found.data(),
                                   r);
    };
    // Every compared row checked before anything is counted: a bad layer leaves the counts as they were.
    for (long r = 0; r < rows_; ++r) {
      if (!compared(r)) continue;
      const int d = kernels::differing_experts(detail::row_ptr(a, r), detail::row_ptr(b, r), k);
      if (d == kernels::kNotARouting) [[unlikely]]
        not_a_routing(layer, r, kernels::is_routing_row(detail::row_ptr(a, r), k) ? b : a,
                      kernels::is_routing_row(detail::row_ptr(a, r), k) ? "b" : "a", k);
      differences_[static_cast<std::size_t>(r)] = d;
    }
    for (long r = 0; r < rows_; ++r) {
      const auto ri = static_cast<std::size_t>(r);
      if (!compared(r)) continue;
      const int d = differences_[ri];
      ++m_.decisions, ++m_.layer_decisions[l];
      m_.experts += k, m_.differing_experts += d;
      if (d != 0) ++m_.differing, ++m_.layer_differing[l], ++row_differing_[ri];
      ++row_layers_[ri];
    }
    added_layers_[l] = 1;
    ++added_;
  }

  // The counts so far; per-token figures count the tokens compared in every layer added.
  RoutingMismatch result() const {
    RoutingMismatch m = m_;
    for (std::size_t r = 0; r < row_layers_.size(); ++r) {
      if (added_ == 0 || row_layers_[r] != added_) continue;
      ++m.tokens;
      m.differing_tokens += row_differing_[r] != 0 ? 1 : 0;
      m.differing_layer_sum += row_differing_[r];
    }
    return m;
  }

 private:
  static int checked_layers(int num_layers) {
    detail::require(num_layers > 0, "RoutingMismatchCounter", "num_layers must be positive, got ", num_layers);
    return num_layers;
  }
  static long checked_rows(long rows) {
    detail::require(rows >= 0, "RoutingMismatchCounter", "rows must be >= 0, got ", rows);
    return rows;
  }
  [[noreturn]] static void not_a_routing(int layer, long row, ExpertIdsRef ids, const char* side, int k) {
    std::string row_ids;
    for (int j = 0; j < k; ++j)
      row_ids += detail::str(j == 0 ? "" : " ", ids(row, j));
    detail::throw_invalid_argument("RoutingMismatchCounter::add_layer", "layer ", layer, ", row ", row, ": '", side,
                                   "' has ids [", row_ids,
                                   "], not a routing (an id is negative, e.g. a store's -1 "
                                   "for no route, or repeated); skip such rows with 'found' or 'compare'");
  }

  int layers_;
  long rows_;
  std::vector<std::uint8_t> compare_;
  std::vector<int> row_layers_, row_differing_;
  std::vector<std::uint8_t> added_layers_;
  std::vector<int> differences_;  // add_layer's scratch: each compared row's differing experts
  int added_ = 0;
  RoutingMismatch m_;
};

// Compares a routing with what a store holds for the same rows (e.g. the rollout's routes against
// the training pass's native ids): only rows the store has a route for count.
template <class Store>
void add_layer_against_store(RoutingMismatchCounter& counter, const Store& store, int layer, const TokenLayout& layout,
                             ExpertIdsRef ids) {
  ExpertIds stored;
  std::vector<std::uint8_t> found;
  store.lookup(layer, layout, stored, found);
  counter.add_layer(layer, stored, ids, found);
}

// How far log p (one engine, e.g. training) is from log q (the other, e.g. rollout) on the same
// sampled tokens, over the tokens whose mask is non-zero (weights are not used: a token counts or
// not). k1 = mean(log p - log q); k3 = mean(q/p - log(q/p) - 1) per token as verl's low_var_kl(p || q)
// computes it (log q/p clamped to +-20, each token's value to 10), the same k3 as
// mrr::ppo::logprob_mismatch; F(tau) = fraction with |log p - log q| > log tau; quantiles of
// |log p - log q| by the nearest-rank rule (p50, p99; max is the largest).
struct LogProbDivergence {
  std::int64_t tokens = 0;
  double k1 = 0, k3 = 0, mean_abs = 0, p50_abs = 0, p99_abs = 0, max_abs = 0;
  std::vector<double> thresholds, fraction_above;  // F(tau) for each tau, in the order given
  double F(double tau) const {
    for (std::size_t i = 0; i < thresholds.size(); ++i)
      if (thresholds[i] == tau) return fraction_above[i];
    detail::throw_invalid_argument("LogProbDivergence::F", "tau = ", tau, " was not among the thresholds asked for");
  }
};

// F(tau) for each threshold and the quantiles of a set of |log p - log q| values (the part of
// LogProbDivergence that is not a sum: callers that gather the values of several ranks call this
// on the union). `abs_diff` is sorted in place.
inline void summarize_abs_differences(std::vector<double>& abs_diff, std::span<const double> thresholds,
                                      LogProbDivergence& out) {
  for (const double tau : thresholds)
    detail::require(tau > 1.0, "logprob_divergence", "threshold ", tau,
                    " must be > 1 (F(tau) compares max(p/q, q/p) with it)");
  out.thresholds.assign(thresholds.begin(), thresholds.end());
  out.fraction_above.assign(thresholds.size(), 0.0);
  if (abs_diff.empty()) return;
  std::sort(abs_diff.begin(), abs_diff.end());
  const auto n = static_cast<long>(abs_diff.size());
  for (std::size_t t = 0; t < thresholds.size(); ++t)
    out.fraction_above[t] =
        static_cast<double>(kernels::count_above(abs_diff.data(), n, std::log(thresholds[t]))) / static_cast<double>(n);
  out.p50_abs = abs_diff[static_cast<std::size_t>(kernels::nearest_rank_index(n, 0.50))];
  out.p99_abs = abs_diff[static_cast<std::size_t>(kernels::nearest_rank_index(n, 0.99))];
  out.max_abs = abs_diff.back();
}

template <class T>
LogProbDivergence logprob_divergence(std::span<const T> log_p, std::span<const T> log_q, std::span<const T> mask,
                                     std::span<const double> thresholds = {}) {
  constexpr const char* fn = "logprob_divergence";
  detail::require(log_p.size() == log_q.size() && (mask.empty() || mask.size() == log_p.size()), fn, "'log_p' has ",
                  log_p.size(), " values, 'log_q' ", log_q.size(), ", 'mask' ", mask.size(), " (empty: all)");
  LogProbDivergence out;
  std::vector<double> abs_diff;
  abs_diff.reserve(log_p.size());
  kernels::DivergenceSums total, block;
  for (std::size_t i = 0; i < log_p.size(); ++i) {
    if (i % kernels::kDivergenceBlock == 0) kernels::add(total, block), block = {};
    if (!mask.empty() && mask[i] == T(0)) continue;
    const double p = static_cast<double>(log_p[i]), q = static_cast<double>(log_q[i]);
    detail::require(std::isfinite(p) && std::isfinite(q), fn, "token ", i, " has log p = ", p, ", log q = ", q,
                    "; log-probabilities of sampled tokens must be finite");
    const auto t = kernels::divergence_terms(p, q);
    kernels::add(block, t);
    abs_diff.push_back(t.abs);
  }
  kernels::add(total, block);
  out.tokens = static_cast<std::int64_t>(abs_diff.size());
  if (out.tokens > 0)
    out.k1 = total.k1 / total.tokens, out.k3 = total.k3 / total.tokens, out.mean_abs = total.abs / total.tokens;
  summarize_abs_differences(abs_diff, thresholds, out);
  return out;
}

MRR_NAMESPACE_END
