// Multi-turn state masking (Search-R1 style): tool observations that the environment spliced
// into a response, e.g. <information> ... </information>, are not the policy's actions, so their
// tokens are excluded from the loss. Built from token ids and configurable marker sequences.
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>
#include <mrr/ppo/detail/validate.hpp>
#include <mrr/tensor.hpp>

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

MRR_NAMESPACE_BEGIN
namespace ppo {

// One kind of observation span, given as the token ids its opening and closing markers encode
// to (a marker may be several tokens).
struct StateSpanMarkers {
  std::vector<std::int64_t> start;  // e.g. the ids of "<information>"
  std::vector<std::int64_t> end;    // e.g. the ids of "</information>"
  bool mask_markers = true;         // the markers were inserted with the observation: mask them too
};

namespace detail {

inline bool matches_at(const MatrixRef<std::int64_t>& ids, Eigen::Index row, Eigen::Index pos,
                       const std::vector<std::int64_t>& marker) {
  const auto n = static_cast<Eigen::Index>(marker.size());
  if (pos + n > ids.cols()) return false;
  for (Eigen::Index k = 0; k < n; ++k)
    if (ids(row, pos + k) != marker[static_cast<std::size_t>(k)]) return false;
  return true;
}

}  // namespace detail

// 1 for tokens the policy generated, 0 inside observation spans. Spans are found left to right
// and do not nest: after an opening marker the first closing marker of the same kind ends the
// span. An opening marker without a closing one masks the rest of the row (the observation was
// cut off by the length limit); a closing marker without an opening one is an ordinary token.
template <class T>
RowMatrix<T> compute_state_mask(MatrixRef<std::int64_t> token_ids, std::span<const StateSpanMarkers> markers) {
  constexpr std::string_view fn = "ppo::compute_state_mask";
  mrr::detail::require(!markers.empty(), fn, "'markers' is empty; give at least one start/end marker pair");
  for (std::size_t k = 0; k < markers.size(); ++k)
    mrr::detail::require(!markers[k].start.empty() && !markers[k].end.empty(), fn, "'markers[", k, "]' has an empty ",
                         markers[k].start.empty() ? "start" : "end", " marker");
  const Eigen::Index rows = token_ids.rows(), cols = token_ids.cols();
  RowMatrix<T> mask = RowMatrix<T>::Ones(rows, cols);
  for (Eigen::Index i = 0; i < rows; ++i) {
    Eigen::Index pos = 0;
    while (pos < cols) {
      const StateSpanMarkers* opened = nullptr;
      for (const auto& m : markers)
        if (detail::matches_at(token_ids, i, pos, m.start)) {
          opened = &m;
          break;
        }
      if (opened == nullptr) {
        ++pos;
        continue;
      }
      const auto start_len = static_cast<Eigen::Index>(opened->start.size());
      const auto end_len = static_cast<Eigen::Index>(opened->end.size());
      Eigen::Index close = pos + start_len;
      while (close < cols && !detail::matches_at(token_ids, i, close, opened->end))
        ++close;
      const bool closed = close < cols;
      const Eigen::Index first = opened->mask_markers ? pos : pos + start_len;
      const Eigen::Index last = closed ? (opened->mask_markers ? close + end_len : close) : cols;  // exclusive
      for (Eigen::Index j = first; j < last; ++j)
        mask(i, j) = T(0);
      pos = closed ? close + end_len : cols;
    }
  }
  return mask;
}

template <class T>
RowMatrix<T> compute_state_mask(MatrixRef<std::int64_t> token_ids, const StateSpanMarkers& markers) {
  return compute_state_mask<T>(token_ids, std::span<const StateSpanMarkers>(&markers, 1));
}

// The loss mask of a multi-turn batch: the response (or attention) mask with the observation
// spans removed.
template <class T>
RowMatrix<T> compute_state_loss_mask(MatrixRef<std::int64_t> token_ids, MatrixRef<T> response_mask,
                                     std::span<const StateSpanMarkers> markers) {
  constexpr std::string_view fn = "ppo::compute_state_loss_mask";
  detail::require_same_shape(fn, "token_ids", token_ids, "response_mask", response_mask);
  detail::require_mask(fn, "response_mask", response_mask);
  RowMatrix<T> mask = compute_state_mask<T>(token_ids, markers);
  mask.array() *= response_mask.array();
  return mask;
}

template <class T>
RowMatrix<T> compute_state_loss_mask(MatrixRef<std::int64_t> token_ids, MatrixRef<T> response_mask,
                                     const StateSpanMarkers& markers) {
  return compute_state_loss_mask<T>(token_ids, response_mask, std::span<const StateSpanMarkers>(&markers, 1));
}

}  // namespace ppo
MRR_NAMESPACE_END
