// Auxiliary-loss gradients against finite differences, the sequence aux loss against its
// definition, and the Routing-form permutation against Megatron's dense permute/unpermute.
#include <mrr/router.hpp>

#include <doctest/doctest.h>
#include <support/random.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace {

mrr::RowMatrix<double> random_matrix(Eigen::Index r, Eigen::Index c, unsigned seed) {
  return mrr::test::random_normal<double>(r, c, seed, 1.5);
}

template <class LossFn>
mrr::RowMatrix<double> numeric_grad(const mrr::RowMatrix<double>& z, LossFn loss) {
  const double h = 1e-6;
  mrr::RowMatrix<double> g(z.rows(), z.cols());
  mrr::RowMatrix<double> zz = z;
  for (Eigen::Index i = 0; i < z.size(); ++i) {
    const double o = zz.data()[i];
    zz.data()[i] = o + h;
    const double up = loss(zz);
    zz.data()[i] = o - h;
    const double down = loss(zz);
    zz.data()[i] = o;
    g.data()[i] = (up - down) / (2 * h);
  }
  return g;
}

}  // namespace

TEST_CASE("switch aux loss: gradient w.r.t. logits matches finite differences") {
  for (auto sf : {mrr::ScoreFunction::softmax, mrr::ScoreFunction::sigmoid, mrr::ScoreFunction::sqrt_softplus}) {
    CAPTURE(mrr::to_string(sf));
    const auto z = random_matrix(9, 6, 3);
    const auto analytic = mrr::switch_aux_loss<double>(z, 2, sf, 0.01).grad_logits;
    // The routing map is piecewise constant: hold it fixed, as autograd does.
    const auto s0 = mrr::routing_scores_for_aux_loss<double>(z, 2, sf);
    const auto numeric = numeric_grad(z, [&](const mrr::RowMatrix<double>& zz) {
      const auto s = mrr::routing_scores_for_aux_loss<double>(zz, 2, sf);
      return mrr::switch_load_balancing_loss<double>(s.scores, s0.tokens_per_expert, 9.0, 2, 0.01);
    });
    CHECK((analytic - numeric).cwiseAbs().maxCoeff() < 1e-9);
    CHECK(analytic.cwiseAbs().maxCoeff() > 1e-6);
  }
}

TEST_CASE("aux losses: a NaN anywhere in a row, a row with no finite logit and no experts are errors, never NaN") {
  mrr::RowMatrix<double> z = random_matrix(3, 4, 8);
  z(1, 1) = std::numeric_limits<double>::quiet_NaN();  // not the row's first or largest: maxCoeff missed it
  CHECK_THROWS_WITH_AS(mrr::z_loss<double>(z, 1e-3), doctest::Contains("logits row 1 has nan at expert 1"),
                       mrr::InvalidArgument);
  CHECK_THROWS_WITH_AS(mrr::switch_aux_loss<double>(z, 2, mrr::ScoreFunction::softmax, 0.01),
                       doctest::Contains("logits row 1 has nan"), mrr::InvalidArgument);
  z.row(1).setConstant(-std::numeric_limits<double>::infinity());
  CHECK_THROWS_WITH_AS(mrr::z_loss<double>(z, 1e-3), doctest::Contains("no finite value"), mrr::InvalidArgument);
  CHECK_THROWS_WITH_AS(mrr::switch_aux_loss<double>(z, 2, mrr::ScoreFunction::softmax, 0.01),
                       doctest::Contains("logits row 1 has no finite value"), mrr::InvalidArgument);
  CHECK_THROWS_WITH_AS(mrr::z_loss<double>(mrr::RowMatrix<double>(3, 0), 1e-3), doctest::Contains("no experts"),
                       mrr::InvalidArgument);
  // sqrt-softplus where softplus underflows: the gradient's limit exp(x / 2) / 2, not 0 / 0.
  mrr::RowMatrix<float> low = mrr::RowMatrix<float>::Zero(2, 4);
  low(0, 3) = -std::numeric_limits<float>::infinity();
  low(1, 2) = -120.f;
  const auto aux = mrr::switch_aux_loss<float>(low, 2, mrr::ScoreFunction::sqrt_softplus, 0.01);
  CHECK(std::isfinite(aux.loss));
  CHECK(aux.grad_logits.allFinite());
  CHECK(mrr::kernels::sqrt_softplus_grad(-120.0, 0.0) == doctest::Approx(std::exp(-60.0) / 2));
}

TEST_CASE("z-loss: gradient matches finite differences") {
  const auto z = random_matrix(5, 7, 4);
  const auto analytic = mrr::z_loss<double>(z, 1e-3).grad_logits;
  const auto numeric = numeric_grad(z, [](const mrr::RowMatrix<double>& zz) { return mrr::z_loss<double>(zz, 1e-3).loss; });
  CHECK((analytic - numeric).cwiseAbs().maxCoeff() < 1e-9);
}

TEST_CASE("sequence aux loss: Megatron's [S, B*E] reshaping equals the mean of per-sequence losses") {
  const int S = 6, B = 3, E = 4, k = 2;
  const auto z = random_matrix(S * B, E, 5);  // rows sequence after sequence
  const std::vector<std::int64_t> lengths(B, S);
  const auto seq = mrr::sequence_aux_loss<double>(z, lengths, k, mrr::ScoreFunction::softmax, 0.1);
  // Megatron: scores reshaped to [S, B*E], tokens_per_expert over B*E columns, total = S, / B.
  const auto s = mrr::routing_scores_for_aux_loss<double>(z, k, mrr::ScoreFunction::softmax);
  double sum = 0;
  for (int b = 0; b < B; ++b)
    for (int e = 0; e < E; ++e) {
      double p = 0, f = 0;
      for (int t = 0; t < S; ++t) {
        p += s.scores(b * S + t, e);
        f += s.routing_map(b * S + t, e);
      }
      sum += p * f;
    }
  const double megatron = sum * (E * 0.1 / (k * double(S) * S)) / B;
  CHECK(seq.loss == doctest::Approx(megatron).epsilon(1e-12));
  CHECK_THROWS_AS(mrr::sequence_aux_loss<double>(z, std::vector<std::int64_t>{S, S}, k, mrr::ScoreFunction::softmax, 0.1),
                  mrr::InvalidArgument);
}

TEST_CASE("Routing-form permutation equals Megatron's dense permute; combine equals unpermute") {
  mrr::RouterConfig cfg;
  cfg.num_experts = 6;
  cfg.topk = 2;
  cfg.pre_softmax = true;
  mrr::TopKRouter<double> router(cfg);
  const auto z = random_matrix(11, 6, 6);
  const auto tokens = random_matrix(11, 5, 7);
  const auto routing = router.route(z);
  const auto dense = mrr::to_dense(routing, 6);
  const auto megatron = mrr::permute<double>(tokens, dense.map, mrr::MatrixRef<double>(dense.probs));
  const auto perm = mrr::make_expert_permutation(routing, 6);
  CHECK(perm.source_token == megatron.sorted_indices);
  const auto permuted = mrr::permute_tokens<double>(tokens, perm);
  CHECK(permuted == megatron.tokens);
  const auto expert_out = random_matrix(perm.rows(), 5, 8);
  const auto a = mrr::combine<double>(expert_out, routing, perm);
  const auto b = mrr::unpermute<double>(expert_out, megatron.sorted_indices, 11, mrr::MatrixRef<double>(dense.probs),
                                        mrr::MaskRef(dense.map));
  CHECK((a - b).cwiseAbs().maxCoeff() < 1e-14);
  long total = 0;
  for (auto n : perm.tokens_per_expert) total += n;
  CHECK(total == 22);
}

TEST_CASE("permute_tokens, combine and combine_backward reject a permutation made for another routing") {
  mrr::RouterConfig cfg;
  cfg.num_experts = 4;
  cfg.topk = 2;
  mrr::TopKRouter<double> router(cfg);
  const auto big = router.route(random_matrix(64, 4, 9));
  const auto small = router.route(random_matrix(2, 4, 10));
  const auto p_big = mrr::make_expert_permutation(big, 4);      // 64 tokens, 128 rows
  const auto p_small = mrr::make_expert_permutation(small, 4);  // 2 tokens, 4 rows
  const auto message = [](auto&& call) {
    try {
      call();
    } catch (const mrr::InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  // Tokens of another batch: the permutation's rows name tokens 0..63 of a 2-row matrix.
  const auto two_tokens = random_matrix(2, 5, 11);
  CHECK(message([&] {
          (void)mrr::permute_tokens<double>(two_tokens, p_big);
        }).find("'tokens' has 2 rows but the permutation was made for 64 tokens") != std::string::npos);
  // A routing of 64 tokens with the 2-token permutation (whose expert rows match expert_out).
  const auto expert_out = random_matrix(p_small.rows(), 5, 12);
  const std::string expected = "the routing is [64, 2] but the permutation was made for [2, 2]";
  CHECK(message([&] { (void)mrr::combine<double>(expert_out, big, p_small); }).find(expected) != std::string::npos);
  const auto grad_out = random_matrix(64, 5, 13);
  CHECK(message([&] { (void)mrr::combine_backward<double>(grad_out, expert_out, big, p_small); }).find(expected) !=
        std::string::npos);
  // The matching ones still run.
  CHECK(message([&] { (void)mrr::combine<double>(expert_out, small, p_small); }).empty());
  CHECK(mrr::permute_tokens<double>(two_tokens, p_small).rows() == 4);
}

TEST_CASE("combine_row sums the slots in order, rounding each product, for every slot count and column range") {
  // The host's unrolled form (up to kCombineHostSlots kept slots) and the tiled form (more) give
  // the bits of the definition: acc = 0; acc = acc + (row_j * w_j) per kept slot in slot order;
  // + addend; rounded once to T. Dropped slots (row -1) are skipped; no weights means weight 1.
  std::mt19937 rng(21);
  std::normal_distribution<float> normal(0.f, 1.f);
  const long cols = 1000, rows = 40;
  std::vector<float> table(static_cast<std::size_t>(rows * cols));
  for (float& v : table)
    v = normal(rng);
  std::vector<float> addend(static_cast<std::size_t>(cols));
  for (float& v : addend)
    v = normal(rng);
  int mismatches = 0, cases = 0;
  for (int n = 0; n <= 12; ++n)
    for (int variant = 0; variant < 4; ++variant) {
      const bool drop = (variant & 1) != 0, weighted = (variant & 2) != 0;
      std::vector<std::int64_t> row(static_cast<std::size_t>(n));
      std::vector<float> w(static_cast<std::size_t>(n));
      for (int j = 0; j < n; ++j) {
        row[static_cast<std::size_t>(j)] = drop && j % 3 == 1 ? -1 : (j * 7 + n) % rows;
        w[static_cast<std::size_t>(j)] = normal(rng);
      }
      for (const auto& [lo, hi] : {std::pair<long, long>{0, cols}, {3, 517}, {999, 1000}}) {
        for (const bool add : {false, true}) {
          std::vector<float> out(static_cast<std::size_t>(cols), -7.f);
          mrr::kernels::combine_row<float, float, std::int64_t, float>(
              table.data(), cols, row.data(), weighted ? w.data() : nullptr, n, add ? addend.data() : nullptr,
              out.data(), lo, hi);
          ++cases;
          for (long h = 0; h < cols; ++h) {
            float want = -7.f;  // outside [lo, hi): untouched
            if (h >= lo && h < hi) {
              volatile float acc = 0.f;  // volatile: no contraction into a fused multiply-add here
              for (int j = 0; j < n; ++j) {
                const auto r = row[static_cast<std::size_t>(j)];
                if (r < 0) continue;
                volatile float product =
                    table[static_cast<std::size_t>(r * cols + h)] * (weighted ? w[static_cast<std::size_t>(j)] : 1.f);
                acc = acc + product;
              }
              if (add) acc = acc + addend[static_cast<std::size_t>(h)];
              want = acc;
            }
            const float got = out[static_cast<std::size_t>(h)];
            mismatches += std::memcmp(&got, &want, sizeof got) != 0 ? 1 : 0;
          }
        }
      }
    }
  CHECK(cases == 13 * 4 * 3 * 2);
  CHECK(mismatches == 0);
}
