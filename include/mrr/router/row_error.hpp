// The errors of rows the router kernels reject (kernels::RowStatus), in words. Every backend
// throws these messages: the CPU router on the row it is routing, the device routers' checking
// convenience on a host copy of the first bad row.
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>
#include <mrr/kernels/router.hpp>

#include <cmath>
#include <limits>

MRR_NAMESPACE_BEGIN
namespace detail {

// NaN would never be selected and +inf makes every softmax weight NaN; -inf is a valid mask.
// Throws for the first NaN or +inf of z[0, n); returns the number of finite (unmasked) logits.
template <class T>
int reject_invalid_logits(const T* z, int n, long row, const char* fn) {
  int finite = 0;
  for (int e = 0; e < n; ++e) {
    if (std::isnan(z[e]) || z[e] == std::numeric_limits<T>::infinity()) [[unlikely]]
      throw_invalid_argument(fn, "logits row ", row, " has ", z[e], " at expert ", e,
                             " (NaN and +inf are not valid logits)");
    finite += z[e] != -std::numeric_limits<T>::infinity();
  }
  return finite;
}

// Replayed (or backpropagated) ids: in [0, E), distinct within the row.
template <class Id>
void reject_invalid_ids(const Id* ids, int k, int num_experts, long row, const char* fn) {
  for (int j = 0; j < k; ++j) {
    const Id e = ids[j];
    require(e >= 0 && e < static_cast<Id>(num_experts), fn, "row ", row, " slot ", j, " has expert id ", e,
            " outside [0, ", num_experts, ")");
    for (int i = 0; i < j; ++i)
      require(ids[i] != e, fn, "row ", row, " repeats expert id ", e, " in slots ", i, " and ", j);
  }
}

// The input checks of one row (z: its E logits; given: its replayed ids, null for a native row),
// in the order they are reported, throwing the first that fails; returns when the row is valid.
template <class T, class Id>
void reject_bad_row(const kernels::RouterParams& p, const T* z, const Id* given, long row, const char* fn) {
  const int k = p.topk, n = p.num_experts;
  if (given == nullptr || p.replay_reads_whole_row()) {
    const int finite = reject_invalid_logits(z, n, row, fn);
    // A top-k that must take a masked (-inf) expert is not a routing decision.
    if (given == nullptr && finite < k) [[unlikely]]
      throw_invalid_argument(fn, "logits row ", row, " has ", finite, " finite logits (the other ", n - finite,
                             " are -inf, masked) but k=", k,
                             " experts must be chosen: a row needs at least k unmasked experts");
  }
  if (given == nullptr) return;
  reject_invalid_ids(given, k, n, row, fn);
  for (int j = 0; j < k; ++j) {
    const T x = z[given[j]];
    if (std::isnan(x) || x == std::numeric_limits<T>::infinity()) [[unlikely]]
      throw_invalid_argument(fn, "logits row ", row, " has ", x, " at expert ", given[j],
                             " (NaN and +inf are not valid logits)");
  }
}

// Weights are NaN only when every logit they are normalised over is -inf (0/0): all k chosen
// experts masked (post-softmax, renormalised, or a group choice that kept only masked experts),
// or the whole row masked (pre-softmax). That is an error, never NaN weights handed on.
template <class T, class Id>
void reject_nan_weights(const Id* ids, const T* w, int k, long row, bool replayed, const char* fn) {
  for (int j = 0; j < k; ++j)
    if (std::isnan(w[j])) [[unlikely]]
      throw_invalid_argument(
          fn, "logits row ", row, ": the weight of ", replayed ? "replayed" : "chosen", " expert ", ids[j], " (slot ",
          j,
          ") is NaN because every logit it is normalised over is -inf (masked); a row whose "
          "chosen experts are all masked cannot be routed (group-limited routing keeps whole groups: the groups "
          "kept may hold only masked experts)");
}

}  // namespace detail
MRR_NAMESPACE_END
