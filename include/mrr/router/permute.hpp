// Expert-major permutation of tokens and its inverse with weights (Megatron permute/unpermute):
// the rows for expert 0 first, then expert 1, ..., each expert's tokens in ascending token order.
// Both the dense-map form (Megatron parity) and a top-k Routing form whose combine accumulates
// each token's k expert outputs in slot order, so the result never depends on arrival order.
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/detail/parallel.hpp>
#include <mrr/error.hpp>
#include <mrr/router/routing.hpp>
#include <mrr/tensor.hpp>

#include <cstdint>
#include <optional>
#include <vector>

MRR_NAMESPACE_BEGIN

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
  const Eigen::Index hidden = tokens.cols();
  detail::parallel_tiles(rows, 64, rows * hidden, [&](std::int64_t, std::int64_t first, std::int64_t end) {
    for (std::int64_t r = first; r < end; ++r)
      out.tokens.row(r) = tokens.row(out.sorted_indices[static_cast<std::size_t>(r)]);
  });
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
  RowMatrix<T> out(num_tokens, permuted_tokens.cols());
  detail::parallel_tiles(num_tokens, 64, rows * permuted_tokens.cols(),
                         [&](std::int64_t, std::int64_t first, std::int64_t end) {
    for (std::int64_t t = first; t < end; ++t) {
      out.row(t).setZero();
      for (std::int64_t i = first_row[static_cast<std::size_t>(t)]; i < first_row[static_cast<std::size_t>(t) + 1]; ++i) {
        const std::int64_t r = order[static_cast<std::size_t>(i)];
        if (probs)
          out.row(t) += permuted_tokens.row(r) * row_probs[r];
        else
          out.row(t) += permuted_tokens.row(r);
      }
    }
  });
  return out;
}

// Where every (token, slot) of a top-k Routing goes in the expert-major order. Dropped slots get
// no row (-1).
struct ExpertPermutation {
  std::vector<std::int64_t> source_token;      // [rows]
  std::vector<std::int64_t> tokens_per_expert;  // [experts]
  RowMatrix<std::int64_t> row_of_slot;          // [tokens, k]
  std::int64_t rows() const { return static_cast<std::int64_t>(source_token.size()); }
};

template <class T>
ExpertPermutation make_expert_permutation(const Routing<T>& routing, int num_experts) {
  constexpr const char* fn = "make_expert_permutation";
  ExpertPermutation p;
  p.tokens_per_expert.assign(static_cast<std::size_t>(num_experts), 0);
  for (Eigen::Index t = 0; t < routing.tokens(); ++t)
    for (int j = 0; j < routing.topk(); ++j) {
      const auto e = routing.ids(t, j);
      detail::require(e >= 0 && e < num_experts, fn, "token ", t, " slot ", j, " has expert id ", e, " outside [0, ",
                      num_experts, ")");
      if (routing.is_kept(t, j)) ++p.tokens_per_expert[static_cast<std::size_t>(e)];
    }
  // Counting sort by expert; scanning tokens in order keeps each expert's rows in token order.
  std::vector<std::int64_t> next(static_cast<std::size_t>(num_experts), 0);
  std::int64_t offset = 0;
  for (int e = 0; e < num_experts; ++e) {
    next[static_cast<std::size_t>(e)] = offset;
    offset += p.tokens_per_expert[static_cast<std::size_t>(e)];
  }
  p.source_token.assign(static_cast<std::size_t>(offset), -1);
  p.row_of_slot = RowMatrix<std::int64_t>::Constant(routing.tokens(), routing.topk(), -1);
  for (Eigen::Index t = 0; t < routing.tokens(); ++t)
    for (int j = 0; j < routing.topk(); ++j) {
      if (!routing.is_kept(t, j)) continue;
      const auto row = next[static_cast<std::size_t>(routing.ids(t, j))]++;
      p.source_token[static_cast<std::size_t>(row)] = t;
      p.row_of_slot(t, j) = row;
    }
  return p;
}

template <class T>
RowMatrix<T> permute_tokens(MatrixRef<T> tokens, const ExpertPermutation& p) {
  RowMatrix<T> out(p.rows(), tokens.cols());
  detail::parallel_tiles(p.rows(), 64, p.rows() * tokens.cols(), [&](std::int64_t, std::int64_t first, std::int64_t end) {
    for (std::int64_t r = first; r < end; ++r) out.row(r) = tokens.row(p.source_token[static_cast<std::size_t>(r)]);
  });
  return out;
}

// out[t] = sum_j weights[t, j] * expert_out[row_of_slot[t, j]], summed in slot order in
// Accum precision (float32 at least), so the result is independent of how rows arrived.
template <class T, class Accum = std::conditional_t<(sizeof(T) < sizeof(float)), float, T>>
RowMatrix<T> combine(MatrixRef<T> expert_out, const Routing<T>& routing, const ExpertPermutation& p) {
  detail::require(expert_out.rows() == p.rows(), "combine", "'expert_out' has ", expert_out.rows(), " rows, the permutation ",
                  p.rows());
  RowMatrix<T> out(routing.tokens(), expert_out.cols());
  const std::int64_t tokens = routing.tokens();
  detail::parallel_tiles(tokens, 64, tokens * routing.topk() * expert_out.cols(),
                         [&](std::int64_t, std::int64_t first, std::int64_t end) {
    Eigen::Matrix<Accum, 1, Eigen::Dynamic> acc(expert_out.cols());
    for (std::int64_t t = first; t < end; ++t) {
      acc.setZero();
      for (int j = 0; j < routing.topk(); ++j) {
        const auto row = p.row_of_slot(t, j);
        if (row < 0) continue;
        acc += expert_out.row(row).template cast<Accum>() * static_cast<Accum>(routing.weights(t, j));
      }
      out.row(t) = acc.template cast<T>();
    }
  });
  return out;
}

MRR_NAMESPACE_END
