// Comparing expert ids with a float32 reference that breaks ties its own way (docs/routing.md,
// "Tie rule"). Megatron-Core ranks float32 scores and Hugging Face float32 probabilities, and
// torch.topk orders equal values in an implementation-defined way; mrr ranks in the caller's type
// with the lower index first. Where the two pick differently, the test accepts the reference's
// pick only when it is a tie of the reference: at every rank the reference's expert scores what
// ours does to within the float32 budget the weights are already held to (4 + E/8 ulps, see
// check_close_fp32_reference). Everything else must match exactly, and the weights of a tied row
// are then checked at the reference's ids (replay), so nothing else is loosened.
// Test-only; doctest macros inside.
#pragma once

#include <mrr/router.hpp>

#include <support/golden.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

namespace mrr::test {

// The float32 budget, in ulps, for a score computed from E experts' values.
inline double fp32_score_ulps(int experts) {
  return 4.0 + static_cast<double>(experts) / 8.0;
}

// True when a float32 reference cannot tell a from b: equal, within `ulps` float32 ulps of the
// larger magnitude, or both below the smallest normal float32.
inline bool fp32_tied(double a, double b, double ulps) {
  if (a == b) return true;
  if (!std::isfinite(a) || !std::isfinite(b)) return false;
  // Both below float32's normal range: 0 to a reference that flushes subnormals.
  const auto tiny = static_cast<double>(std::numeric_limits<float>::min());
  if (std::abs(a) < tiny && std::abs(b) < tiny) return true;
  const float m = static_cast<float>(std::max(std::abs(a), std::abs(b)));
  const double ulp = static_cast<double>(std::nextafter(m, std::numeric_limits<float>::infinity()) - m);
  return std::abs(a - b) <= ulps * ulp;
}

// The scores a float32 reference ranks, modelled in double from `logits` (pass them
// float32-rounded, as the reference sees them): the softmax over the row (pre-softmax), the logits
// (post-softmax), or the sigmoid / sqrt-softplus scores, their intermediate exp / softplus rounded to
// float32 with subnormals flushed (so an underflow to 0 there is one here), plus the bias. Groups are not applied: see
// GroupLimit.
inline RowMatrix<double> reference_selection_scores(const RouterConfig& cfg, const RowMatrix<double>& logits,
                                                    const Vector<double>* bias) {
  // float32 rounding, subnormals flushed: torch's vectorised exp and softplus may return 0 there.
  const auto f32 = [](double v) {
    return std::abs(v) < static_cast<double>(std::numeric_limits<float>::min())
               ? 0.0
               : static_cast<double>(static_cast<float>(v));
  };
  const Eigen::Index rows = logits.rows(), n = logits.cols();
  RowMatrix<double> s(rows, n);
  for (Eigen::Index t = 0; t < rows; ++t) {
    if (cfg.score_function == ScoreFunction::softmax) {
      if (cfg.pre_softmax) {
        const double m = logits.row(t).maxCoeff();
        double sum = 0;
        for (Eigen::Index e = 0; e < n; ++e)
          sum += (s(t, e) = std::exp(logits(t, e) - m));
        s.row(t) /= sum;
      } else {
        s.row(t) = logits.row(t);
      }
    } else {
      for (Eigen::Index e = 0; e < n; ++e) {
        const double x = logits(t, e);
        s(t, e) = cfg.score_function == ScoreFunction::sigmoid ? f32(1.0 / (1.0 + f32(std::exp(-x))))
                                                               : f32(std::sqrt(f32(std::log1p(std::exp(x)))));
      }
    }
    if (bias != nullptr) s.row(t) += bias->transpose();
  }
  return s;
}

// The same for golden case c: its input `logits` and, when present, `bias`, float32-rounded as
// the reference sees them.
inline RowMatrix<double> case_selection_scores(const GoldenCase& c, const RouterConfig& cfg, const std::string& logits,
                                               const std::string& bias) {
  const auto f32 = [](double v) { return static_cast<double>(static_cast<float>(v)); };
  const RowMatrix<double> z = c.input(logits).matrix<double>().unaryExpr(f32);
  if (!c.has_input(bias)) return reference_selection_scores(cfg, z, nullptr);
  const Vector<double> b = c.input(bias).vector<double>().unaryExpr(f32);
  return reference_selection_scores(cfg, z, &b);
}

// Group-limited selection as the reference makes it: a group scores the sum of its best
// `score_topk` experts, the `keep` best groups stay eligible, the others' experts score -inf (or
// 0.0 with zero masking). Groups whose scores tie the keep-th best (within the float32 budget) may
// be kept either way; compare_ids_up_to_ties tries each choice.
struct GroupLimit {
  int groups = 0, per = 0, score_topk = 0, keep = 0;
  bool zero = false;

  static GroupLimit of(const RouterConfig& cfg) {
    GroupLimit g;
    if (!cfg.grouped()) return g;
    g.groups = cfg.num_groups;
    g.per = cfg.experts_per_group();
    g.score_topk = cfg.effective_group_score_topk();
    g.keep = cfg.group_topk;
    g.zero = cfg.group_masking == GroupMasking::zero;
    return g;
  }
  bool active() const { return groups > 0; }
};

namespace detail {

inline std::vector<double> group_scores(const GroupLimit& g, const double* s) {
  std::vector<double> out(static_cast<std::size_t>(g.groups));
  for (int i = 0; i < g.groups; ++i) {
    std::vector<double> v(s + i * g.per, s + (i + 1) * g.per);
    std::partial_sort(v.begin(), v.begin() + g.score_topk, v.end(), std::greater<>());
    out[static_cast<std::size_t>(i)] = std::accumulate(v.begin(), v.begin() + g.score_topk, 0.0);
  }
  return out;
}

// The scores of a row with the groups outside `kept` masked.
inline std::vector<double> masked(const GroupLimit& g, const double* s, int n, const std::vector<char>& kept) {
  std::vector<double> out(s, s + n);
  for (int e = 0; e < n; ++e)
    if (!kept[static_cast<std::size_t>(e / g.per)])
      out[static_cast<std::size_t>(e)] = g.zero ? 0.0 : -std::numeric_limits<double>::infinity();
  return out;
}

}  // namespace detail

struct TieComparison {
  bool ok = true;
  std::vector<char> tied;  // per row: the reference picked differently, within a tie
  long tied_rows = 0;
};

// ours and golden: [T, k] expert ids. ordered: both list a row's picks by descending score
// (Megatron's sorted top-k), checked rank by rank as given; otherwise (Hugging Face lists them by
// id) each row's picks are ranked by score first. Where the two differ, each must be a top k of the
// row to within ties, under some choice of kept groups a tie allows.
inline TieComparison compare_ids_up_to_ties(const ExpertIds& ours, const RowMatrix<std::int32_t>& golden,
                                            const RowMatrix<double>& scores, const GroupLimit& groups, bool ordered,
                                            const std::string& what) {
  TieComparison r;
  if (ours.rows() != golden.rows() || ours.cols() != golden.cols() || scores.rows() != ours.rows()) {
    FAIL_CHECK(what << ": ids " << ours.rows() << " x " << ours.cols() << ", golden " << golden.rows() << " x "
                    << golden.cols() << ", scores " << scores.rows() << " rows");
    r.ok = false;
    return r;
  }
  const int n = static_cast<int>(scores.cols());
  const double ulps = fp32_score_ulps(n);
  r.tied.assign(static_cast<std::size_t>(ours.rows()), 0);
  long bad = 0;
  std::ostringstream first;
  // Both rows: k distinct experts in range (a map row with another count has a -1).
  const auto distinct_in_range = [&](std::vector<std::int32_t> v) {
    for (auto id : v)
      if (id < 0 || id >= n) return false;
    std::sort(v.begin(), v.end());
    return std::adjacent_find(v.begin(), v.end()) == v.end();
  };
  // True when `ids` is a top-k of the row's scores `s` to within ties: its j-th pick (as listed, or
  // ranked by score when not ordered) scores the j-th largest of s, within the budget.
  const auto top_k_up_to_ties = [&](std::vector<std::int32_t> ids, const std::vector<double>& s) {
    const auto at = [&](std::int32_t id) { return s[static_cast<std::size_t>(id)]; };
    if (!ordered) std::stable_sort(ids.begin(), ids.end(), [&](auto x, auto y) { return at(x) > at(y); });
    std::vector<double> best = s;
    std::partial_sort(best.begin(), best.begin() + static_cast<std::ptrdiff_t>(ids.size()), best.end(),
                      std::greater<>());
    for (std::size_t j = 0; j < ids.size(); ++j)
      if (!fp32_tied(at(ids[j]), best[j], ulps)) return false;
    return true;
  };
  for (Eigen::Index t = 0; t < ours.rows(); ++t) {
    if (ours.row(t) == golden.row(t)) continue;
    const std::vector<std::int32_t> a(ours.row(t).begin(), ours.row(t).end());
    const std::vector<std::int32_t> b(golden.row(t).begin(), golden.row(t).end());
    const double* row = scores.row(t).data();
    bool valid = distinct_in_range(a) && distinct_in_range(b);
    if (valid && !groups.active()) {
      const std::vector<double> s(row, row + n);
      valid = top_k_up_to_ties(a, s) && top_k_up_to_ties(b, s);
    } else if (valid) {
      // Either side may keep any groups at or tied with the boundary (the keep-th best group
      // score): mrr breaks a group tie on its own computed sums, the reference its own way.
      const auto gs = detail::group_scores(groups, row);
      std::vector<double> sorted = gs;
      std::sort(sorted.begin(), sorted.end(), std::greater<>());
      const double boundary = sorted[static_cast<std::size_t>(groups.keep - 1)];
      std::vector<int> sure, maybe;
      for (int i = 0; i < groups.groups; ++i) {
        const double v = gs[static_cast<std::size_t>(i)];
        if (fp32_tied(v, boundary, ulps))
          maybe.push_back(i);
        else if (v > boundary)
          sure.push_back(i);
      }
      const int choose = groups.keep - static_cast<int>(sure.size());
      const auto kept_with = [&](auto&& in_pick) {
        std::vector<char> kept(gs.size(), 0);
        for (int i : sure)
          kept[static_cast<std::size_t>(i)] = 1;
        for (std::size_t i = 0; i < maybe.size(); ++i)
          if (in_pick(i)) kept[static_cast<std::size_t>(maybe[i])] = 1;
        return detail::masked(groups, row, n, kept);
      };
      bool ours_valid = false, golden_valid = false;
      if (valid && maybe.size() <= 16) {  // every choice of the tied groups
        for (std::uint32_t pick = 0; pick < (1u << maybe.size()); ++pick) {
          if (std::popcount(pick) != choose) continue;
          const auto s = kept_with([&](std::size_t i) { return (pick >> i & 1u) != 0; });
          ours_valid = ours_valid || top_k_up_to_ties(a, s);
          golden_valid = golden_valid || top_k_up_to_ties(b, s);
        }
      } else if (valid) {
        // Too many to try (saturated scores): the tied groups a side picks from, then those whose
        // best expert scores least.
        const auto build = [&](const std::vector<std::int32_t>& ids) {
          std::vector<char> in(maybe.size(), 0);
          int taken = 0;
          for (std::size_t i = 0; i < maybe.size(); ++i)
            for (auto id : ids)
              if (id / groups.per == maybe[i] && !in[i] && taken < choose) in[i] = 1, ++taken;
          std::vector<std::size_t> rest;
          for (std::size_t i = 0; i < maybe.size(); ++i)
            if (!in[i]) rest.push_back(i);
          const auto best = [&](std::size_t i) {
            return *std::max_element(row + maybe[i] * groups.per, row + (maybe[i] + 1) * groups.per);
          };
          std::stable_sort(rest.begin(), rest.end(), [&](auto x, auto y) { return best(x) < best(y); });
          for (std::size_t j = 0; j < rest.size() && taken < choose; ++j)
            in[rest[j]] = 1, ++taken;
          return kept_with([&](std::size_t i) { return in[i] != 0; });
        };
        ours_valid = top_k_up_to_ties(a, build(a));
        golden_valid = top_k_up_to_ties(b, build(b));
      }
      valid = ours_valid && golden_valid;
    }
    if (valid) {
      r.tied[static_cast<std::size_t>(t)] = 1;
      ++r.tied_rows;
      continue;
    }
    if (bad++ == 0) {
      const auto print = [&](const auto& ids) {
        for (auto id : ids) {
          first << ' ' << id;
          if (id >= 0 && id < n) first << " (" << scores(t, id) << ')';
        }
      };
      first << " first at row " << t << ": ours";
      print(ours.row(t));
      first << ", golden";
      print(golden.row(t));
      first << " (unmasked scores)";
    }
  }
  if (bad != 0) {
    FAIL_CHECK(what << ": " << bad << " of " << ours.rows() << " rows pick other experts than the golden, not by a "
                    << "float32 tie (" << ulps << " ulps);" << first.str());
    r.ok = false;
  }
  if (r.tied_rows != 0) MESSAGE(what << ": " << r.tied_rows << " rows differ from the golden by a float32 tie");
  return r;
}

// A routing map [T, E] as each row's k chosen experts, ascending; a row that does not choose
// exactly k gets -1s, which compare_ids_up_to_ties refuses.
template <class Map>
RowMatrix<std::int32_t> map_to_ids(const Map& map, int k) {
  RowMatrix<std::int32_t> ids = RowMatrix<std::int32_t>::Constant(map.rows(), k, -1);
  for (Eigen::Index t = 0; t < map.rows(); ++t) {
    int j = 0;
    for (Eigen::Index e = 0; e < map.cols(); ++e)
      if (map(t, e) != 0 && j++ < k) ids(t, j - 1) = static_cast<std::int32_t>(e);
    if (j != k) ids.row(t).setConstant(-1);
  }
  return ids;
}

}  // namespace mrr::test
