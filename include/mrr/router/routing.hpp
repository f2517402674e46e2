// The result of routing a batch of tokens: k global expert ids and k gating weights per token,
// plus which slots survived the capacity limit. Also the dense [tokens, experts] form Megatron's
// dispatchers take.
#pragma once

#include <mrr/cpu/backend.hpp>
#include <mrr/detail/config.hpp>
#include <mrr/router/fwd.hpp>
#include <mrr/tensor.hpp>

#include <cstdint>
#include <type_traits>

MRR_NAMESPACE_BEGIN

using Mask = RowMatrix<std::uint8_t>;
using MaskRef = MatrixRef<std::uint8_t>;

// The CPU's routing (Backend = CpuBackend, the default): Eigen matrices in host memory.
template <class T, class Backend>
struct Routing {
  static_assert(std::is_same_v<Backend, CpuBackend>,
                "mrr::Routing<T, Backend>: no routing for this backend (ThrustBackend's is in mrr/thrust/routing.hpp)");
  // [tokens, k] global expert ids; slot order is descending selection score, ties lower id first.
  ExpertIds ids;
  // [tokens, k] gating weights (zero for dropped slots).
  RowMatrix<T> weights;
  // [tokens, k] 1 where the slot is dispatched; empty when no capacity limit dropped anything.
  Mask kept;

  Eigen::Index tokens() const { return ids.rows(); }
  int topk() const { return static_cast<int>(ids.cols()); }
  bool has_capacity_mask() const { return kept.size() != 0; }
  bool is_kept(Eigen::Index token, Eigen::Index slot) const {
    return !has_capacity_mask() || kept(token, slot) != 0;
  }
};

// Dense form: probs[t, e] is the weight of expert e for token t (0 when not routed) and
// map[t, e] says whether t is dispatched to e.
template <class T>
struct DenseRouting {
  RowMatrix<T> probs;
  Mask map;
};

template <class T>
DenseRouting<T> to_dense(const Routing<T>& routing, int num_experts) {
  DenseRouting<T> dense{RowMatrix<T>::Zero(routing.tokens(), num_experts), Mask::Zero(routing.tokens(), num_experts)};
  for (Eigen::Index t = 0; t < routing.tokens(); ++t)
    for (int j = 0; j < routing.topk(); ++j) {
      if (!routing.is_kept(t, j)) continue;
      const auto e = routing.ids(t, j);
      dense.probs(t, e) = routing.weights(t, j);
      dense.map(t, e) = 1;
    }
  return dense;
}

MRR_NAMESPACE_END
