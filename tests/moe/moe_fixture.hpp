// Test fixture for the MoE layer: a random whole model (gate and experts in torch layout), one
// rank's share of a global batch (contiguous token chunks), and the global result assembled
// from every rank's slice, so runs with different numbers of ranks can be compared bitwise.
#pragma once

#include <mrr/moe.hpp>
#include <mrr/replay.hpp>
#include <mrr/router.hpp>

#include <support/random.hpp>

#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

namespace mrr::test {

template <class S>
struct MoEModel {
  RouterConfig config;
  int hidden = 0, intermediate = 0;
  RowMatrix<S> gate;                     // [E, H]
  std::vector<S> w_gate, w_up, w_down;  // [E, I, H], [E, I, H], [E, H, I]

  int num_experts() const { return config.num_experts; }
  int topk() const { return config.topk; }

  static MoEModel random(RouterConfig config, int hidden, int intermediate, unsigned seed) {
    MoEModel m;
    m.config = config;
    m.hidden = hidden;
    m.intermediate = intermediate;
    const int e = config.num_experts;
    m.gate = random_normal<S>(e, hidden, seed, S(0.5));
    auto flat = [](const RowMatrix<S>& x) { return std::vector<S>(x.data(), x.data() + x.size()); };
    m.w_gate = flat(random_normal<S>(e * intermediate, hidden, seed + 1, S(0.3)));
    m.w_up = flat(random_normal<S>(e * intermediate, hidden, seed + 2, S(0.3)));
    m.w_down = flat(random_normal<S>(e * hidden, intermediate, seed + 3, S(0.3)));
    return m;
  }

  template <class Comm, class Store = NoRouteStore>
  auto layer(const Comm& comm, RoutingReplay<Store>* replay = nullptr, int layer_index = 0) const {
    const auto placement = ExpertPlacement::contiguous(num_experts(), comm.size());
    SwiGLUExperts<S> experts(hidden, intermediate, placement.experts_per_rank(),
                             placement.first_expert(comm.rank()));
    experts.load_torch(w_gate, w_up, w_down);
    if constexpr (std::is_same_v<Store, NoRouteStore>) {
      (void)replay;
      (void)layer_index;
      MoELayer<TopKRouter<S>, SwiGLUExperts<S>, Comm> l(TopKRouter<S>(config), std::move(experts), comm);
      l.set_gate_weight(gate);
      return l;
    } else {
      MoELayer<TopKRouter<S>, SwiGLUExperts<S>, Comm, Store> l(TopKRouter<S>(config), std::move(experts), comm,
                                                               *replay, layer_index);
      l.set_gate_weight(gate);
      return l;
    }
  }
};

// Rank r's contiguous chunk [begin, end) of `tokens` global tokens over `ranks` ranks.
inline std::pair<Eigen::Index, Eigen::Index> token_chunk(Eigen::Index tokens, int ranks, int rank) {
  const Eigen::Index base = tokens / ranks, extra = tokens % ranks;
  const Eigen::Index begin = rank * base + std::min<Eigen::Index>(rank, extra);
  return {begin, begin + base + (rank < extra ? 1 : 0)};
}

// Global token g is position g % seq_len of sequence 1000 + g / seq_len.
inline TokenLayout token_layout(Eigen::Index begin, Eigen::Index end, Eigen::Index seq_len = 8) {
  std::vector<TokenKey> rows;
  for (Eigen::Index g = begin; g < end; ++g) rows.push_back({static_cast<SequenceId>(1000 + g / seq_len), g % seq_len});
  return TokenLayout(std::move(rows));
}

// The whole batch's results, each rank writing its slice.
template <class S>
struct MoEResult {
  RowMatrix<S> output, grad_input;
  ExpertIds ids;
  std::vector<RowMatrix<S>> grad_gate;  // per rank
  std::vector<RowMatrix<S>> grad_w_gate, grad_w_up, grad_w_down;  // per global expert
  std::shared_ptr<std::mutex> mutex = std::make_shared<std::mutex>();  // movable result

  MoEResult(Eigen::Index tokens, int hidden, int num_experts, int topk, int ranks)
      : output(tokens, hidden), grad_input(tokens, hidden), ids(tokens, topk),
        grad_gate(static_cast<std::size_t>(ranks)), grad_w_gate(static_cast<std::size_t>(num_experts)),
        grad_w_up(static_cast<std::size_t>(num_experts)), grad_w_down(static_cast<std::size_t>(num_experts)) {}
};

// One rank's forward and backward over its chunk of x and grad_y.
template <class S, class Layer>
void run_rank(Layer& layer, const RowMatrix<S>& x, const RowMatrix<S>& grad_y, MoEResult<S>& out) {
  const int rank = layer.comm().rank(), ranks = layer.comm().size();
  const auto [begin, end] = token_chunk(x.rows(), ranks, rank);
  const RowMatrix<S> xs = x.middleRows(begin, end - begin);
  const RowMatrix<S> gs = grad_y.middleRows(begin, end - begin);
  const auto f = layer.forward(xs);
  const auto g = layer.backward(f, gs);
  std::lock_guard lock(*out.mutex);
  out.output.middleRows(begin, end - begin) = f.output;
  out.grad_input.middleRows(begin, end - begin) = g.input;
  out.ids.middleRows(begin, end - begin) = f.routing.ids;
  out.grad_gate[static_cast<std::size_t>(rank)] = g.gate_weight;
  const int first = layer.experts().first_expert();
  for (int e = 0; e < layer.experts().num_experts(); ++e) {
    const auto i = static_cast<std::size_t>(e), global = static_cast<std::size_t>(first + e);
    out.grad_w_gate[global] = g.experts.w_gate[i];
    out.grad_w_up[global] = g.experts.w_up[i];
    out.grad_w_down[global] = g.experts.w_down[i];
  }
}

template <class Derived1, class Derived2>
bool bitwise_equal(const Eigen::DenseBase<Derived1>& a, const Eigen::DenseBase<Derived2>& b) {
  using T = typename Derived1::Scalar;
  static_assert(std::is_same_v<T, typename Derived2::Scalar>);
  if (a.rows() != b.rows() || a.cols() != b.cols()) return false;
  const auto& da = a.derived();
  const auto& db = b.derived();
  // An empty matrix's data() is null, which memcmp must not be given.
  return da.size() == 0 || std::memcmp(da.data(), db.data(), static_cast<std::size_t>(da.size()) * sizeof(T)) == 0;
}

// Two runs' results are the same bits: ids, output, input gradient, every rank's gate gradient
// (against a's first) and every expert's gradients.
template <class S>
void check_same(const MoEResult<S>& a, const MoEResult<S>& b) {
  CHECK(a.ids == b.ids);
  CHECK(bitwise_equal(a.output, b.output));
  CHECK(bitwise_equal(a.grad_input, b.grad_input));
  for (const auto& g : b.grad_gate) CHECK(bitwise_equal(a.grad_gate.front(), g));
  for (std::size_t e = 0; e < a.grad_w_gate.size(); ++e) {
    CAPTURE(e);
    CHECK(bitwise_equal(a.grad_w_gate[e], b.grad_w_gate[e]));
    CHECK(bitwise_equal(a.grad_w_up[e], b.grad_w_up[e]));
    CHECK(bitwise_equal(a.grad_w_down[e], b.grad_w_down[e]));
  }
}

// Copies every route `src` holds for the rows of `layout` into `dst` (merging per-rank stores).
template <class Src, class Dst>
void copy_routes(const Src& src, Dst& dst, int layer, const TokenLayout& layout) {
  ExpertIds ids;
  std::vector<std::uint8_t> found;
  src.lookup(layer, layout, ids, found);
  std::vector<TokenKey> rows;
  std::vector<Eigen::Index> picked;
  for (std::size_t r = 0; r < layout.size(); ++r)
    if (found[r] != 0) {
      rows.push_back(layout[r]);
      picked.push_back(static_cast<Eigen::Index>(r));
    }
  ExpertIds kept(static_cast<Eigen::Index>(picked.size()), ids.cols());
  for (std::size_t i = 0; i < picked.size(); ++i) kept.row(static_cast<Eigen::Index>(i)) = ids.row(picked[i]);
  if (!rows.empty()) dst.record(layer, TokenLayout(std::move(rows)), kept);
}

}  // namespace mrr::test
