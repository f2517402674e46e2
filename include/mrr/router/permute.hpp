// Expert-major permutation of tokens and its inverse with weights (Megatron permute/unpermute):
// the rows for expert 0 first, then expert 1, ..., each expert's tokens in ascending token order.
// Both the dense-map form (Megatron parity) and a top-k Routing form whose combine accumulates
// each token's k expert outputs in slot order, so the result never depends on arrival order.
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/detail/parallel.hpp>
#include <mrr/error.hpp>
#include <mrr/kernels/permute.hpp>
#include <mrr/router/routing.hpp>
#include <mrr/tensor.hpp>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

MRR_NAMESPACE_BEGIN

namespace detail {

// out.row(r) = in.row(index[r]) for every row of out, in parallel.
template <class T, class Index>
void gather_rows(MatrixRef<T> in, const Index* index, RowMatrix<T>& out) {
  const long rows = out.rows(), cols = in.cols();
  parallel_tiles(rows, 64, rows * cols, [&](std::int64_t, std::int64_t first, std::int64_t end) {
    for (std::int64_t r = first; r < end; ++r)
      kernels::copy_row(out.row(r).data(), row_ptr(in, static_cast<Eigen::Index>(index[r])), 0, cols);
  });
}

}  // namespace detail

template <class T>
struct Permuted {
  RowMatrix<T> tokens;                      // [rows, hidden], expert-major
  Vector<T> probs;                          // [rows] weight of each row (empty when none given)
  std::vector<std::int64_t> sorted_indices;  // [rows] source token of each row
};

// Megatron permute(tokens, routing_map, probs, num_out_tokens) into `out`, reusing its storage when
// the shapes already match: rows ordered by expert, then token. One pass over the map counts each
// expert's rows per tile of tokens, a prefix sum places every (tile, expert) run, a second pass
// scatters the row indices (and probs), and the token rows are gathered in parallel.
template <class T>
void permute_into(Permuted<T>& out, MatrixRef<T> tokens, MaskRef routing_map,
                  const std::optional<MatrixRef<T>>& probs = std::nullopt) {
  constexpr const char* fn = "permute";
  detail::require(routing_map.rows() == tokens.rows(), fn, "'routing_map' has ", routing_map.rows(), " rows for ",
                  tokens.rows(), " tokens");
  if (probs)
    detail::require(probs->rows() == routing_map.rows() && probs->cols() == routing_map.cols(), fn, "'probs' has shape ",
                    detail::shape_of(*probs), " but 'routing_map' has ", detail::shape_of(routing_map));
  const std::int64_t num_tokens = routing_map.rows(), experts = routing_map.cols();
  constexpr std::int64_t tile = 256;
  const std::int64_t tiles = detail::tile_count(num_tokens, tile);
  // counts[tile * experts + e]: rows of expert e among the tile's tokens; becomes the tile's start.
  std::vector<std::int64_t> counts(static_cast<std::size_t>(tiles * experts), 0);
  detail::parallel_tiles(num_tokens, tile, num_tokens * experts, [&](std::int64_t i, std::int64_t first, std::int64_t end) {
    std::int64_t* c = counts.data() + i * experts;
    for (std::int64_t t = first; t < end; ++t) {
      const std::uint8_t* m = detail::row_ptr(routing_map, t);
      for (std::int64_t e = 0; e < experts; ++e) c[e] += m[e] != 0;
    }
  });
  std::int64_t rows = 0;
  for (std::int64_t e = 0; e < experts; ++e)
    for (std::int64_t i = 0; i < tiles; ++i) {
      std::int64_t& c = counts[static_cast<std::size_t>(i * experts + e)];
      const std::int64_t n = c;
      c = rows;
      rows += n;
    }
  out.sorted_indices.resize(static_cast<std::size_t>(rows));
  out.tokens.resize(rows, tokens.cols());
  if (probs)
    out.probs.resize(rows);
  else
    out.probs.resize(0);
  detail::parallel_tiles(num_tokens, tile, num_tokens * experts, [&](std::int64_t i, std::int64_t first, std::int64_t end) {
    std::int64_t* next = counts.data() + i * experts;
    for (std::int64_t t = first; t < end; ++t) {
      const std::uint8_t* m = detail::row_ptr(routing_map, t);
      for (std::int64_t e = 0; e < experts; ++e) {
        if (m[e] == 0) continue;
        const std::int64_t r = next[e]++;
        out.sorted_indices[static_cast<std::size_t>(r)] = t;
        if (probs) out.probs[r] = (*probs)(t, e);
      }
    }
  });
  detail::gather_rows(tokens, out.sorted_indices.data(), out.tokens);
}

template <class T>
Permuted<T> permute(MatrixRef<T> tokens, MaskRef routing_map, const std::optional<MatrixRef<T>>& probs = std::nullopt) {
  Permuted<T> out;
  permute_into<T>(out, tokens, routing_map, probs);
  return out;
}

// Megatron unpermute: scatter-add rows back to their tokens, each scaled by its probability
// when probs and routing_map are given. Each token adds its rows in permuted (expert-major)
// order, as a serial scatter-add does; tokens are summed in parallel from a counting sort of the
// rows by token, so the bits do not depend on the number of threads.
template <class T>
RowMatrix<T> unpermute(MatrixRef<T> permuted_tokens, const std::vector<std::int64_t>& sorted_indices,
                       Eigen::Index num_tokens, const std::optional<MatrixRef<T>>& probs = std::nullopt,
                       const std::optional<MaskRef>& routing_map = std::nullopt) {
  constexpr const char* fn = "unpermute";
  detail::require(static_cast<Eigen::Index>(sorted_indices.size()) == permuted_tokens.rows(), fn, "'sorted_indices' has ",
                  sorted_indices.size(), " entries for ", permuted_tokens.rows(), " permuted rows");
  detail::require(probs.has_value() == routing_map.has_value(), fn, "'probs' needs 'routing_map' and vice versa");
  Vector<T> row_probs;
  if (probs) {
    detail::require(probs->rows() == num_tokens && routing_map->rows() == num_tokens &&
                        probs->cols() == routing_map->cols(),
                    fn, "'probs' ", detail::shape_of(*probs), " and 'routing_map' ", detail::shape_of(*routing_map),
                    " must both be [", num_tokens, ", experts]");
    row_probs.resize(permuted_tokens.rows());
    Eigen::Index r = 0;
    for (Eigen::Index e = 0; e < routing_map->cols(); ++e)
      for (Eigen::Index t = 0; t < num_tokens; ++t)
        if ((*routing_map)(t, e) != 0) {
          detail::require(r < row_probs.size(), fn, "'routing_map' selects more rows than were permuted");
          row_probs[r++] = (*probs)(t, e);
        }
    detail::require(r == row_probs.size(), fn, "'routing_map' selects ", r, " rows but ", row_probs.size(),
                    " were permuted");
  }
  const std::int64_t rows = permuted_tokens.rows();
  // first_row[t] .. first_row[t + 1]: token t's rows in `order`, ascending.
  std::vector<std::int64_t> first_row(static_cast<std::size_t>(num_tokens) + 1, 0), order(static_cast<std::size_t>(rows));
  for (std::int64_t r = 0; r < rows; ++r) {
    const auto t = sorted_indices[static_cast<std::size_t>(r)];
    detail::require(t >= 0 && t < num_tokens, fn, "sorted_indices[", r, "] = ", t, " outside [0, ", num_tokens, ")");
    ++first_row[static_cast<std::size_t>(t) + 1];
  }
  for (std::size_t t = 0; t < static_cast<std::size_t>(num_tokens); ++t) first_row[t + 1] += first_row[t];
  {
    std::vector<std::int64_t> next(first_row.begin(), first_row.end() - 1);
    for (std::int64_t r = 0; r < rows; ++r)
      order[static_cast<std::size_t>(next[static_cast<std::size_t>(sorted_indices[static_cast<std::size_t>(r)])]++)] = r;
  }
  // Token t's rows are order[first_row[t] .. first_row[t + 1]), each weighted by its prob.
  Vector<T> entry_probs;
  if (probs) {
    entry_probs.resize(rows);
    for (std::int64_t i = 0; i < rows; ++i) entry_probs[i] = row_probs[order[static_cast<std::size_t>(i)]];
  }
  RowMatrix<T> out(num_tokens, permuted_tokens.cols());
  const long cols = permuted_tokens.cols();
  detail::parallel_tiles(num_tokens, 64, rows * cols, [&](std::int64_t, std::int64_t first, std::int64_t end) {
    for (std::int64_t t = first; t < end; ++t) {
      const std::int64_t lo = first_row[static_cast<std::size_t>(t)], n = first_row[static_cast<std::size_t>(t) + 1] - lo;
      kernels::combine_row(permuted_tokens.data(), permuted_tokens.outerStride(), order.data() + lo,
                           probs ? entry_probs.data() + lo : static_cast<const T*>(nullptr), static_cast<int>(n),
                           static_cast<const T*>(nullptr), out.row(t).data(), 0, cols);
    }
  });
  return out;
}

// Where every (token, slot) of a top-k Routing goes in the expert-major order. Dropped slots get
// no row (-1).
struct ExpertPermutation {
  std::vector<std::int64_t> source_token;       // [rows]
  std::vector<std::int64_t> tokens_per_expert;  // [experts]
  std::vector<std::int64_t> expert_offsets;     // [experts + 1]: expert e's rows are [offsets[e], offsets[e + 1])
  RowMatrix<std::int64_t> row_of_slot;          // [tokens, k]
  std::int64_t rows() const { return static_cast<std::int64_t>(source_token.size()); }
  std::int64_t first_row(int e) const { return expert_offsets[static_cast<std::size_t>(e)]; }
};

namespace detail {

// The counting sort of kernels/permute.hpp on CPU threads, over fixed chunks of slots, so the bits
// depend on neither the thread count nor the chunking. The histogram is chunk-major here (each
// thread counts into its own contiguous counters) and scanned expert-major. kept may be null.
template <class Id>
ExpertPermutation expert_permutation(const Id* ids, const std::uint8_t* kept, std::int64_t tokens, int k,
                                     int num_experts, const char* fn) {
  detail::require(num_experts > 0 && k > 0, fn, "needs num_experts > 0 and k > 0, got ", num_experts, " and ", k);
  const std::int64_t slots = tokens * k;
  constexpr std::int64_t chunk = std::int64_t{1} << 14;
  const std::int64_t chunks = std::max<std::int64_t>(1, tile_count(slots, chunk));
  // No slots, no tiles: the histogram stays zero and nothing is bad.
  std::vector<std::int64_t> histogram(static_cast<std::size_t>(chunks * num_experts), 0);
  std::vector<std::int64_t> bad(static_cast<std::size_t>(chunks), -1);
  parallel_tiles(slots, chunk, slots, [&](std::int64_t c, std::int64_t lo, std::int64_t hi) {
    bad[static_cast<std::size_t>(c)] =
        kernels::count_experts(ids, kept, lo, hi, num_experts, histogram.data() + c * num_experts, 1);
  });
  for (const std::int64_t s : bad)
    if (s >= 0)
      detail::throw_invalid_argument(fn, "token ", s / k, " slot ", s % k, " has expert id ",
                                     static_cast<std::int64_t>(ids[s]), " outside [0, ", num_experts, ")");
  ExpertPermutation p;
  p.expert_offsets.resize(static_cast<std::size_t>(num_experts) + 1);
  const long rows =
      kernels::scan_histogram(histogram.data(), num_experts, chunks, 1, num_experts, p.expert_offsets.data());
  p.tokens_per_expert.resize(static_cast<std::size_t>(num_experts));
  for (int e = 0; e < num_experts; ++e)
    p.tokens_per_expert[static_cast<std::size_t>(e)] = p.first_row(e + 1) - p.first_row(e);
  p.source_token.resize(static_cast<std::size_t>(rows));
  p.row_of_slot.resize(tokens, k);
  parallel_tiles(slots, chunk, slots, [&](std::int64_t c, std::int64_t lo, std::int64_t hi) {
    kernels::place_slots(ids, kept, lo, hi, k, histogram.data() + c * num_experts, 1, p.source_token.data(),
                         p.row_of_slot.data());
  });
  return p;
}

}  // namespace detail

template <class T>
ExpertPermutation make_expert_permutation(const Routing<T>& routing, int num_experts) {
  return detail::expert_permutation(routing.ids.data(), routing.has_capacity_mask() ? routing.kept.data() : nullptr,
                                    routing.tokens(), routing.topk(), num_experts, "make_expert_permutation");
}

// tokens [tokens, hidden] -> out [rows, hidden], expert-major, reusing out's storage.
template <class T>
void permute_tokens_into(RowMatrix<T>& out, MatrixRef<T> tokens, const ExpertPermutation& p) {
  detail::require(tokens.rows() == p.row_of_slot.rows(), "permute_tokens", "'tokens' has ", tokens.rows(),
                  " rows but the permutation was made for ", p.row_of_slot.rows(), " tokens");
  out.resize(p.rows(), tokens.cols());
  detail::gather_rows(tokens, p.source_token.data(), out);
}

template <class T>
RowMatrix<T> permute_tokens(MatrixRef<T> tokens, const ExpertPermutation& p) {
  RowMatrix<T> out;
  permute_tokens_into<T>(out, tokens, p);
  return out;
}

namespace detail {

inline void require_permuted_rows(std::int64_t rows, const ExpertPermutation& p, const char* fn, const char* what) {
  detail::require(rows == p.rows(), fn, "'", what, "' has ", rows, " rows, the permutation ", p.rows());
}

// The routing's [tokens, k] is the one the permutation was made for (row_of_slot is read per slot).
template <class T>
void require_permutation_of(const Routing<T>& routing, const ExpertPermutation& p, const char* fn) {
  detail::require(routing.tokens() == p.row_of_slot.rows() && routing.topk() == p.row_of_slot.cols(), fn,
                  "the routing is [", routing.tokens(), ", ", routing.topk(), "] but the permutation was made for [",
                  p.row_of_slot.rows(), ", ", p.row_of_slot.cols(), "]");
}

}  // namespace detail

// out[t] = sum_j weights[t, j] * expert_out[row_of_slot[t, j]], summed in slot order in
// Accum precision (float32 at least), so the result is independent of how rows arrived.
template <class T, class Accum = kernels::accum_t<T>>
void combine_into(RowMatrix<T>& out, MatrixRef<T> expert_out, const Routing<T>& routing, const ExpertPermutation& p) {
  detail::require_permutation_of(routing, p, "combine");
  detail::require_permuted_rows(expert_out.rows(), p, "combine", "expert_out");
  const std::int64_t tokens = routing.tokens();
  const int k = routing.topk();
  const long cols = expert_out.cols();
  out.resize(tokens, cols);
  detail::parallel_tiles(tokens, 64, tokens * k * cols, [&](std::int64_t, std::int64_t first, std::int64_t end) {
    for (std::int64_t t = first; t < end; ++t)
      kernels::combine_row<T, T, std::int64_t, Accum>(expert_out.data(), expert_out.outerStride(),
                                                      p.row_of_slot.data() + t * k, routing.weights.data() + t * k, k,
                                                      nullptr, out.row(t).data(), 0, cols);
  });
}

template <class T, class Accum = kernels::accum_t<T>>
RowMatrix<T> combine(MatrixRef<T> expert_out, const Routing<T>& routing, const ExpertPermutation& p) {
  RowMatrix<T> out;
  combine_into<T, Accum>(out, expert_out, routing, p);
  return out;
}

// Backward of permute_tokens: grad_tokens[t] = sum over t's kept slots, in slot order, of
// grad_permuted[row_of_slot[t, j]] (in Accum); a token with every slot dropped gets zeros.
template <class T, class Accum = kernels::accum_t<T>>
void permute_tokens_backward_into(RowMatrix<T>& grad, MatrixRef<T> grad_permuted, const ExpertPermutation& p) {
  detail::require_permuted_rows(grad_permuted.rows(), p, "permute_tokens_backward", "grad_permuted");
  const std::int64_t tokens = p.row_of_slot.rows();
  const int k = static_cast<int>(p.row_of_slot.cols());
  const long cols = grad_permuted.cols();
  grad.resize(tokens, cols);
  detail::parallel_tiles(tokens, 64, tokens * k * cols, [&](std::int64_t, std::int64_t first, std::int64_t end) {
    for (std::int64_t t = first; t < end; ++t)
      kernels::combine_row<T, T, std::int64_t, Accum>(grad_permuted.data(), grad_permuted.outerStride(),
                                                      p.row_of_slot.data() + t * k, nullptr, k, nullptr,
                                                      grad.row(t).data(), 0, cols);
  });
}

template <class T, class Accum = kernels::accum_t<T>>
RowMatrix<T> permute_tokens_backward(MatrixRef<T> grad_permuted, const ExpertPermutation& p) {
  RowMatrix<T> grad;
  permute_tokens_backward_into<T, Accum>(grad, grad_permuted, p);
  return grad;
}

// Gradients of combine's out w.r.t. its inputs, for the upstream gradient grad_out [tokens, hidden].
template <class T>
struct CombineGradients {
  RowMatrix<T> expert_out;  // [rows, hidden]: weights[t, j] * grad_out[t] at row_of_slot[t, j]
  RowMatrix<T> weights;     // [tokens, k]: <grad_out[t], expert_out[row_of_slot[t, j]]>, 0 where dropped
};

// combine_backward into caller matrices (storage reused when the shapes match): grad_expert_out
// [rows, hidden] (one row per kept slot, every one written) and grad_weights [tokens, k].
template <class T, class Accum = kernels::accum_t<T>>
void combine_backward_into(RowMatrix<T>& grad_expert_out, RowMatrix<T>& grad_weights, MatrixRef<T> grad_out,
                           MatrixRef<T> expert_out, const Routing<T>& routing, const ExpertPermutation& p) {
  constexpr const char* fn = "combine_backward";
  detail::require_permutation_of(routing, p, fn);
  detail::require_permuted_rows(expert_out.rows(), p, fn, "expert_out");
  detail::require(grad_out.rows() == routing.tokens() && grad_out.cols() == expert_out.cols(), fn, "'grad_out' has shape ",
                  detail::shape_of(grad_out), ", expected [", routing.tokens(), ", ", expert_out.cols(), "]");
  const std::int64_t tokens = routing.tokens();
  const int k = routing.topk();
  const long cols = expert_out.cols();
  grad_expert_out.resize(p.rows(), cols);
  grad_weights.resize(tokens, k);
  detail::parallel_tiles(tokens, 64, tokens * k * cols, [&](std::int64_t, std::int64_t first, std::int64_t end) {
    for (std::int64_t t = first; t < end; ++t)
      kernels::combine_backward_row<T, T, std::int64_t, Accum>(
          detail::row_ptr(grad_out, t), cols, expert_out.data(), expert_out.outerStride(), p.row_of_slot.data() + t * k,
          routing.weights.data() + t * k, k, grad_expert_out.data(), cols, grad_weights.data() + t * k);
  });
}

template <class T, class Accum = kernels::accum_t<T>>
CombineGradients<T> combine_backward(MatrixRef<T> grad_out, MatrixRef<T> expert_out, const Routing<T>& routing,
                                     const ExpertPermutation& p) {
  CombineGradients<T> g;
  combine_backward_into<T, Accum>(g.expert_out, g.weights, grad_out, expert_out, routing, p);
  return g;
}

MRR_NAMESPACE_END
