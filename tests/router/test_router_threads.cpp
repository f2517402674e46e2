// Routing, replay, permute, unpermute and combine give the same bits with 1, 2 and 3 OpenMP
// threads (this target is compiled with -fopenmp; the row tiles do not depend on the thread count).
#include <mrr/router.hpp>

#include <doctest/doctest.h>
#include <omp.h>

#include <algorithm>
#include <limits>
#include <random>
#include <vector>

namespace {

mrr::RowMatrix<float> random_matrix(Eigen::Index rows, Eigen::Index cols, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.f, 1.f);
  mrr::RowMatrix<float> m(rows, cols);
  for (Eigen::Index i = 0; i < m.size(); ++i) m.data()[i] = n(rng);
  return m;
}

template <class F>
void same_for_thread_counts(F&& run) {
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  const auto reference = run();
  for (int threads : {2, 3}) {
    omp_set_num_threads(threads);
    CHECK(run() == reference);
  }
  omp_set_num_threads(saved);
}

// Megatron's unpermute as a serial scatter-add in permuted order: what the parallel one must equal.
mrr::RowMatrix<float> serial_unpermute(const mrr::Permuted<float>& p, Eigen::Index tokens,
                                       const mrr::RowMatrix<float>& probs, const mrr::RowMatrix<std::uint8_t>& map) {
  mrr::RowMatrix<float> out = mrr::RowMatrix<float>::Zero(tokens, p.tokens.cols());
  Eigen::Index r = 0;
  for (Eigen::Index e = 0; e < map.cols(); ++e)
    for (Eigen::Index t = 0; t < tokens; ++t)
      if (map(t, e) != 0) {
        out.row(p.sorted_indices[static_cast<std::size_t>(r)]) += p.tokens.row(r) * probs(t, e);
        ++r;
      }
  return out;
}

}  // namespace

TEST_CASE("route, replay, permute and combine are bitwise independent of the thread count") {
  const int tokens = 3001, experts = 64, k = 8, hidden = 96;  // not a multiple of any tile
  auto z = random_matrix(tokens, experts, 3);
  for (int t = 0; t < tokens; t += 97) z(t, t % experts) = -std::numeric_limits<float>::infinity();
  const auto x = random_matrix(tokens, hidden, 4);
  for (const auto& config : {mrr::presets::qwen3_moe(experts, k), mrr::presets::deepseek_v3(experts, k, 8, 4, true, 2.5),
                             mrr::presets::mixtral(experts, 2), mrr::presets::qwen2_moe(experts, 4)}) {
    const mrr::TopKRouter<float> router(config);
    same_for_thread_counts([&] {
      const auto r = router.route(z);
      return std::make_pair(r.ids, r.weights);
    });
    const auto ids = router.route(z).ids;
    same_for_thread_counts([&] { return router.replay(z, ids).weights; });
    const auto routing = router.route(z);
    const auto dense = mrr::to_dense(routing, experts);
    same_for_thread_counts([&] {
      const auto p = mrr::permute<float>(x, dense.map, mrr::MatrixRef<float>(dense.probs));
      return std::make_tuple(p.tokens, p.probs, p.sorted_indices);
    });
    const auto permuted = mrr::permute<float>(x, dense.map, mrr::MatrixRef<float>(dense.probs));
    const auto serial = serial_unpermute(permuted, tokens, dense.probs, dense.map);
    same_for_thread_counts([&] {
      const auto out = mrr::unpermute<float>(permuted.tokens, permuted.sorted_indices, tokens,
                                             mrr::MatrixRef<float>(dense.probs), mrr::MaskRef(dense.map));
      CHECK(out == serial);
      return out;
    });
    same_for_thread_counts([&] { return mrr::unpermute<float>(permuted.tokens, permuted.sorted_indices, tokens); });
    const auto perm = mrr::make_expert_permutation(routing, experts);
    const auto expert_out = mrr::permute_tokens<float>(x, perm);
    same_for_thread_counts([&] { return mrr::combine<float>(expert_out, routing, perm); });
  }
}

TEST_CASE("an invalid replayed id is reported for the first bad row whatever the thread count") {
  const int tokens = 2000, experts = 32, k = 4;
  const auto z = random_matrix(tokens, experts, 5);
  const mrr::TopKRouter<float> router(mrr::presets::qwen3_moe(experts, k));
  auto ids = router.route(z).ids;
  ids(1500, 2) = ids(1500, 0);
  ids(1900, 1) = experts;
  for (int threads : {1, 2, 3}) {
    omp_set_num_threads(threads);
    CHECK_THROWS_WITH_AS(router.replay(z, ids), doctest::Contains("row 1500 repeats expert id"), mrr::InvalidArgument);
  }
}

namespace {

// Routes and replays every row of z on its own, in pieces of every length up to 40 rows, and from
// a copy of z in a buffer offset by one float (another alignment); each row's ids and weights must
// be the bits of routing all rows at once. So a token routes the same whatever rank (and so chunk
// and tile of rows) holds it, and wherever its logits sit.
template <class T>
void rows_route_alone_as_together(const mrr::RouterConfig& config, const mrr::RowMatrix<T>& z) {
  const mrr::TopKRouter<T> router(config);
  const auto all = router.route(z);
  const auto replayed_all = router.replay(z, all.ids);
  const auto rows = z.rows();
  long differing = 0;
  for (Eigen::Index length :
       {Eigen::Index{1}, Eigen::Index{2}, Eigen::Index{3}, Eigen::Index{5}, Eigen::Index{7}, Eigen::Index{40}})
    for (Eigen::Index first = 0; first < rows; first += length) {
      const Eigen::Index n = std::min(length, rows - first);
      const auto part = router.route(z.middleRows(first, n));
      const mrr::ExpertIds part_ids = all.ids.middleRows(first, n);
      const auto replayed = router.replay(z.middleRows(first, n), part_ids);
      differing += part.ids == all.ids.middleRows(first, n) ? 0 : 1;
      differing += part.weights == all.weights.middleRows(first, n) ? 0 : 1;
      differing += replayed.weights == replayed_all.weights.middleRows(first, n) ? 0 : 1;
    }
  std::vector<T> shifted(static_cast<std::size_t>(z.size()) + 1);
  std::copy(z.data(), z.data() + z.size(), shifted.begin() + 1);
  const Eigen::Map<const mrr::RowMatrix<T>> moved(shifted.data() + 1, z.rows(), z.cols());
  const auto again = router.route(moved);
  differing += again.ids == all.ids && again.weights == all.weights ? 0 : 1;
  CHECK(differing == 0);
}

template <class T>
mrr::RowMatrix<T> random_logits_of(Eigen::Index rows, Eigen::Index cols, unsigned seed) {
  const mrr::RowMatrix<float> f = random_matrix(rows, cols, seed);
  mrr::RowMatrix<T> z = (f.cast<T>() * T(2)).eval();
  for (Eigen::Index t = 0; t < rows; t += 11)
    z(t, (t * 5) % cols) = -std::numeric_limits<T>::infinity();
  return z;
}

}  // namespace

TEST_CASE_TEMPLATE("a token's ids and weights do not depend on the rows routed with it, nor on its logits' address", T,
                   float, double) {
  // Odd k and unrenormalised pre-softmax (Qwen2-MoE's norm_topk_prob = false, DeepSeek-V2's k = 6)
  // and sigmoid scores take the tile pass whose exponentials once depended on the tile's length.
  const int experts = 12;
  for (const auto& config :
       {mrr::presets::qwen2_moe(experts, 3, false), mrr::presets::qwen2_moe(experts, 6, false),
        mrr::presets::qwen2_moe(experts, 4, false), mrr::presets::megatron_deepseek_v3(experts, 3, 1, 1, 1.0),
        mrr::presets::deepseek_v3(experts, 3, 4, 2, true, 2.5), mrr::presets::qwen3_moe(experts, 3),
        mrr::presets::mixtral(experts, 2)}) {
    CAPTURE(config.topk);
    CAPTURE(config.pre_softmax);
    rows_route_alone_as_together<T>(config, random_logits_of<T>(121, experts, 17));
  }
}
