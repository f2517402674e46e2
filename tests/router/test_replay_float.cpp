// The float32 softmax weight path (detail/softmax_tile.hpp): its exp, the replay gather and the
// slot-major softmax against a double reference, for every k and for partial tiles and strided
// inputs; the replay guarantees (-inf weighs exactly 0; NaN/+inf read, out-of-range and repeated
// ids are errors) on the tile path; and the run-time AVX2 variant giving the portable one's bits.
#include <mrr/router.hpp>

#include <doctest/doctest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

mrr::RowMatrix<float> random_logits(Eigen::Index tokens, int experts, unsigned seed, float scale = 3.f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.f, scale);
  mrr::RowMatrix<float> z(tokens, experts);
  for (Eigen::Index i = 0; i < z.size(); ++i)
    z.data()[i] = n(rng);
  return z;
}

mrr::ExpertIds random_ids(Eigen::Index tokens, int experts, int k, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<int> perm(static_cast<std::size_t>(experts));
  mrr::ExpertIds ids(tokens, k);
  for (Eigen::Index t = 0; t < tokens; ++t) {
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int j = 0; j < k; ++j)
      ids(t, j) = perm[static_cast<std::size_t>(j)];
  }
  return ids;
}

// softmax(z[ids]) * scale in double.
mrr::RowMatrix<double> reference_weights(const mrr::RowMatrix<float>& z, const mrr::ExpertIds& ids, double scale) {
  mrr::RowMatrix<double> w(ids.rows(), ids.cols());
  for (Eigen::Index t = 0; t < ids.rows(); ++t) {
    double mx = -std::numeric_limits<double>::infinity();
    for (Eigen::Index j = 0; j < ids.cols(); ++j)
      mx = std::max(mx, static_cast<double>(z(t, ids(t, j))));
    double sum = 0;
    for (Eigen::Index j = 0; j < ids.cols(); ++j)
      sum += std::exp(static_cast<double>(z(t, ids(t, j))) - mx);
    for (Eigen::Index j = 0; j < ids.cols(); ++j)
      w(t, j) = scale * std::exp(static_cast<double>(z(t, ids(t, j))) - mx) / sum;
  }
  return w;
}

double max_relative_error(const mrr::RowMatrix<float>& w, const mrr::RowMatrix<double>& ref) {
  double worst = 0;
  for (Eigen::Index i = 0; i < w.size(); ++i) {
    const double r = ref.data()[i];
    worst = std::max(worst, std::abs(static_cast<double>(w.data()[i]) - r) / std::max(r, 1e-30));
  }
  return worst;
}

}  // namespace

TEST_CASE("exp_nonpositive: within 1 ulp of exp on [-87.3, 0], exactly 0 below and at -inf, exactly 1 at 0") {
  double worst_ulps = 0;
  for (int i = 0; i <= 2000000; ++i) {
    const float x = -87.3f * static_cast<float>(i) / 2000000.f;
    const double exact = std::exp(static_cast<double>(x));
    const float rounded = static_cast<float>(exact);
    const double ulp = static_cast<double>(std::nextafter(rounded, kInf) - rounded);
    worst_ulps = std::max(worst_ulps, std::abs(static_cast<double>(mrr::detail::exp_nonpositive(x)) - exact) / ulp);
  }
  CAPTURE(worst_ulps);
  CHECK(worst_ulps <= 1.0);
  CHECK(mrr::detail::exp_nonpositive(0.f) == 1.f);
  CHECK(mrr::detail::exp_nonpositive(-kInf) == 0.f);
  CHECK(mrr::detail::exp_nonpositive(-88.f) == 0.f);
  CHECK(mrr::detail::exp_nonpositive(-1e30f) == 0.f);
}

TEST_CASE("float replay equals softmax over the replayed logits for every k, partial tiles and strided inputs") {
  const Eigen::Index tokens = 3 * mrr::detail::kSoftmaxTileRows + 17;
  for (int experts : {16, 64, 256})
    for (int k : {1, 2, 3, 4, 6, 8, 16}) {
      CAPTURE(experts);
      CAPTURE(k);
      for (bool pre : {false, true}) {
        if (!pre && k == 1) continue;  // post-softmax top-1 is refused (every weight 1), as Megatron refuses it
        auto config = mrr::presets::qwen3_moe(experts, k);  // pre-softmax + renormalised = softmax over the k
        config.pre_softmax = pre;
        config.scaling_factor = pre ? std::optional<double>(2.5) : std::nullopt;
        const mrr::TopKRouter<float> router(config);
        const auto z = random_logits(tokens, experts, static_cast<unsigned>(experts * 31 + k));
        const auto ids = random_ids(tokens, experts, k, static_cast<unsigned>(k));
        const auto r = router.replay(z, ids);
        CHECK(r.ids == ids);
        CHECK(max_relative_error(r.weights, reference_weights(z, ids, pre ? 2.5 : 1.0)) < 2e-6);
        // The same rows seen through strided views give the same bits.
        mrr::RowMatrix<float> wide = mrr::RowMatrix<float>::Constant(tokens, experts + 5, kInf);
        wide.leftCols(experts) = z;
        mrr::ExpertIds wide_ids = mrr::ExpertIds::Constant(tokens, k + 3, -7);
        wide_ids.leftCols(k) = ids;
        const auto strided = router.replay(wide.leftCols(experts), wide_ids.leftCols(k));
        CHECK(strided.ids == r.ids);
        CHECK(strided.weights == r.weights);
        // Native routing computes its weights with the same kernel: replaying its ids gives its bits.
        const auto native = router.route(z);
        CHECK(router.replay(z, native.ids).weights == native.weights);
      }
    }
}

TEST_CASE("float replay keeps the guarantees on the tile path") {
  const int experts = 64, k = 8;
  const Eigen::Index tokens = 200, row = 150;  // row 150 lies in the third tile
  const mrr::TopKRouter<float> router(mrr::presets::qwen3_moe(experts, k));
  const auto z0 = random_logits(tokens, experts, 5);
  const auto ids0 = random_ids(tokens, experts, k, 6);

  SUBCASE("a masked (-inf) replayed logit weighs exactly 0; all masked is an error") {
    auto z = z0;
    z(row, ids0(row, 3)) = -kInf;
    const auto r = router.replay(z, ids0);
    CHECK(r.weights(row, 3) == 0.f);
    CHECK(r.weights.row(row).sum() == doctest::Approx(1.0));
    for (int j = 0; j < k; ++j)
      z(row, ids0(row, j)) = -kInf;
    CHECK_THROWS_WITH_AS(router.replay(z, ids0), doctest::Contains("is NaN because every logit"), mrr::InvalidArgument);
  }
  SUBCASE("NaN or +inf in a replayed logit is an error; elsewhere in the row it is not read") {
    auto z = z0;
    const int unread = [&] {
      for (int e = 0; e < experts; ++e)
        if ((ids0.row(row).array() != e).all()) return e;
      return -1;
    }();
    z(row, unread) = std::numeric_limits<float>::quiet_NaN();
    CHECK_NOTHROW(router.replay(z, ids0));
    z(row, ids0(row, 5)) = std::numeric_limits<float>::quiet_NaN();
    CHECK_THROWS_WITH_AS(router.replay(z, ids0), doctest::Contains("logits row 150 has nan"), mrr::InvalidArgument);
    z(row, ids0(row, 5)) = kInf;
    CHECK_THROWS_WITH_AS(router.replay(z, ids0), doctest::Contains("logits row 150 has inf"), mrr::InvalidArgument);
  }
  SUBCASE("out-of-range and repeated ids are errors naming the row and slot") {
    auto ids = ids0;
    ids(row, 6) = experts;
    CHECK_THROWS_WITH_AS(router.replay(z0, ids), doctest::Contains("row 150 slot 6 has expert id 64 outside [0, 64)"),
                         mrr::InvalidArgument);
    ids(row, 6) = -1;
    CHECK_THROWS_WITH_AS(router.replay(z0, ids), doctest::Contains("row 150 slot 6 has expert id -1"),
                         mrr::InvalidArgument);
    ids(row, 6) = ids(row, 1);
    CHECK_THROWS_WITH_AS(router.replay(z0, ids), doctest::Contains("row 150 repeats expert id"), mrr::InvalidArgument);
    ids = ids0;
    ids(tokens - 1, k - 1) = ids(tokens - 1, 0);  // the last, partial tile
    CHECK_THROWS_WITH_AS(router.replay(z0, ids), doctest::Contains("row 199 repeats expert id"), mrr::InvalidArgument);
  }
}

TEST_CASE("the run-time dispatched kernels give the portable kernels' bits") {
  constexpr int R = mrr::detail::kSoftmaxTileRows;
  for (int k : {1, 3, 8, 12}) {
    CAPTURE(k);
    const int experts = 32, rows = R - 5;
    auto z = random_logits(rows, experts, static_cast<unsigned>(k), 20.f);
    z(3, 0) = -kInf;
    const auto ids = random_ids(rows, experts, k, 9);
    std::vector<float> tile_a(static_cast<std::size_t>(k * R)), tile_b(tile_a.size());
    std::vector<std::int32_t> slot_a(tile_a.size()), slot_b(tile_a.size()), out_a(static_cast<std::size_t>(rows * k)),
        out_b(out_a.size());
    const bool ok_a = mrr::detail::gather_slot_major(z.data(), experts, ids.data(), k, k, experts, rows, tile_a.data(),
                                                     slot_a.data(), out_a.data());
    const bool ok_b = mrr::detail::gather_slot_major_k<0>(z.data(), experts, ids.data(), k, k, experts, rows,
                                                          tile_b.data(), slot_b.data(), out_b.data());
    CHECK(ok_a);
    CHECK(ok_b);
    CHECK(out_a == out_b);
    std::vector<float> w_a(static_cast<std::size_t>(rows * k)), w_b(w_a.size());
    const unsigned s_a = mrr::detail::softmax_slot_major(tile_a.data(), k, rows, 1.5f, w_a.data());
    const unsigned s_b = mrr::detail::softmax_slot_major_body(tile_b.data(), k, rows, 1.5f, w_b.data());
    CHECK(s_a == s_b);
    CHECK(w_a == w_b);
  }
}

TEST_CASE("the fused k=8 replay kernel gives the tile path's ids and bits, and reports what it finds") {
  constexpr int R = mrr::detail::kSoftmaxTileRows;
  const int k = 8;
  for (int experts : {8, 64, 256})
    for (int rows : {R, R - 3, 8, 5}) {
      CAPTURE(experts);
      CAPTURE(rows);
      auto z = random_logits(rows, experts, static_cast<unsigned>(experts + rows), 20.f);
      const auto ids = random_ids(rows, experts, k, static_cast<unsigned>(rows));
      z(1, ids(1, 2)) = -kInf;
      z(2, ids(2, 0)) = -kInf;  // the first slot masked: the maximum starts at -inf
      z(4, ids(4, 7)) = -200.f;  // exp underflows to 0
      std::vector<float> tile(static_cast<std::size_t>(k * R)), w_ref(static_cast<std::size_t>(rows * k)),
          w(w_ref.size(), -1.f);
      std::vector<std::int32_t> slot(tile.size()), ids_ref(w_ref.size()), ids_out(w_ref.size(), -1);
      REQUIRE(mrr::detail::gather_slot_major_k<0>(z.data(), experts, ids.data(), k, k, experts, rows, tile.data(),
                                                  slot.data(), ids_ref.data()));
      REQUIRE(mrr::detail::softmax_slot_major_body(tile.data(), k, rows, 1.5f, w_ref.data()) == 0u);
      unsigned status = 0;
      const int done = mrr::detail::replay_softmax_fused(z.data(), experts, ids.data(), k, k, experts, rows, rows,
                                                         1.5f, ids_out.data(), w.data(), status);
      CHECK(status == 0u);
      CHECK(done % 8 == 0);
      CHECK(done <= rows);
      for (int i = 0; i < done * k; ++i) {
        CHECK(ids_out[static_cast<std::size_t>(i)] == ids_ref[static_cast<std::size_t>(i)]);
        CHECK(std::bit_cast<std::uint32_t>(w[static_cast<std::size_t>(i)]) ==
              std::bit_cast<std::uint32_t>(w_ref[static_cast<std::size_t>(i)]));
      }
      if (done == 0) continue;  // no AVX2 (or a build without run-time dispatch): nothing more to check
      const auto run = [&](const mrr::RowMatrix<float>& zz, const mrr::ExpertIds& ii) {
        unsigned st = 0;
        mrr::detail::replay_softmax_fused(zz.data(), experts, ii.data(), k, k, experts, rows, rows, 1.5f, ids_out.data(),
                                          w.data(), st);
        return st;
      };
      auto bad = ids;
      bad(done - 1, 3) = experts;
      CHECK(run(z, bad) == mrr::detail::replay_fused_bad_ids);
      bad(done - 1, 3) = -1;
      CHECK(run(z, bad) == mrr::detail::replay_fused_bad_ids);
      bad(done - 1, 3) = bad(done - 1, 6);
      CHECK(run(z, bad) == mrr::detail::replay_fused_bad_ids);
      auto zz = z;
      zz(done - 1, ids(done - 1, 5)) = std::numeric_limits<float>::quiet_NaN();
      CHECK(run(zz, ids) == mrr::detail::softmax_tile_invalid_logit);
      zz(done - 1, ids(done - 1, 5)) = kInf;
      CHECK(run(zz, ids) == mrr::detail::softmax_tile_invalid_logit);
      zz = z;
      for (int j = 0; j < k; ++j) zz(done - 1, ids(done - 1, j)) = -kInf;
      CHECK(run(zz, ids) == mrr::detail::softmax_tile_all_masked);
    }
}
