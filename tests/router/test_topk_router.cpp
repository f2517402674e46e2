// TopKRouter: the tie rule, replay (with mask), gradients against finite differences, capacity,
// configuration checks and bad input.
#include <mrr/detail/group_select.hpp>
#include <mrr/router.hpp>

#include <doctest/doctest.h>
#include <support/random.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <vector>

namespace {

mrr::RowMatrix<double> random_logits(Eigen::Index tokens, int experts, unsigned seed, double scale = 2.0) {
  return mrr::test::random_normal<double>(tokens, experts, seed, scale);
}

// Central finite differences of L(z) = sum(g * weights(z, ids)) with ids held fixed.
mrr::RowMatrix<double> numeric_grad(const mrr::TopKRouter<double>& router, const mrr::RowMatrix<double>& z,
                                    const mrr::ExpertIds& ids, const mrr::RowMatrix<double>& g) {
  const double h = 1e-6;
  mrr::RowMatrix<double> grad(z.rows(), z.cols());
  mrr::RowMatrix<double> zz = z;
  for (Eigen::Index i = 0; i < z.size(); ++i) {
    const double orig = zz.data()[i];
    zz.data()[i] = orig + h;
    const double up = router.replay(zz, ids).weights.cwiseProduct(g).sum();
    zz.data()[i] = orig - h;
    const double down = router.replay(zz, ids).weights.cwiseProduct(g).sum();
    zz.data()[i] = orig;
    grad.data()[i] = (up - down) / (2 * h);
  }
  return grad;
}

std::vector<mrr::RouterConfig> gradient_configs() {
  std::vector<mrr::RouterConfig> out;
  auto base = [] {
    mrr::RouterConfig c;
    c.num_experts = 12;
    c.topk = 3;
    return c;
  };
  auto c = base();  // post-softmax
  out.push_back(c);
  c = base();
  c.pre_softmax = true;  // Megatron pre-softmax, no renormalisation
  out.push_back(c);
  c.normalize_topk = true;  // HF Qwen/Mixtral
  out.push_back(c);
  c = base();
  c.score_function = mrr::ScoreFunction::sigmoid;  // normalised (k > 1)
  c.scaling_factor = 2.5;
  out.push_back(c);
  c.normalize_topk = false;
  out.push_back(c);
  c = base();
  c.score_function = mrr::ScoreFunction::sqrt_softplus;
  out.push_back(c);
  c = base();
  c.topk = 1;
  c.score_function = mrr::ScoreFunction::sigmoid;
  out.push_back(c);
  out.push_back(mrr::presets::deepseek_v3(16, 4, 4, 2, true, 2.5));
  return out;
}

}  // namespace

TEST_CASE("tie rule: among equal logits the lower expert id wins, in slot order") {
  mrr::RouterConfig cfg;
  cfg.num_experts = 6;
  cfg.topk = 3;
  mrr::TopKRouter<double> router(cfg);
  mrr::RowMatrix<double> z(3, 6);
  z << 1, 1, 1, 1, 1, 1,        // all tied
      0, 2, 0, 2, 0, 2,         // three-way tie at the top
      -1, 5, 3, 5, 3, 0;        // tie for first and for third
  const auto r = router.route(z);
  CHECK(r.ids.row(0) == (Eigen::RowVector<int, 3>() << 0, 1, 2).finished().cast<std::int32_t>());
  CHECK(r.ids.row(1) == (Eigen::RowVector<int, 3>() << 1, 3, 5).finished().cast<std::int32_t>());
  CHECK(r.ids.row(2) == (Eigen::RowVector<int, 3>() << 1, 3, 2).finished().cast<std::int32_t>());
}

TEST_CASE("tie rule holds for groups too: equal group scores keep the lower group") {
  mrr::RouterConfig cfg;
  cfg.num_experts = 8;
  cfg.topk = 2;
  cfg.score_function = mrr::ScoreFunction::sigmoid;
  cfg.num_groups = 4;
  cfg.group_topk = 1;
  mrr::TopKRouter<float> router(cfg);
  mrr::RowMatrix<float> z(1, 8);
  z << 0.5f, 0.5f, 1.f, 0.f, 0.5f, 0.5f, 1.f, 0.f;
  const auto r = router.route(z);
  // Groups {0,1} and {4,5} tie at 2 sigmoid(0.5) = 1.2449, above sigmoid(1) + sigmoid(0) = 1.2311
  // of {2,3} and {6,7}: group 0 wins the tie, and inside it expert 0 beats its equal, expert 1.
  CHECK(r.ids(0, 0) == 0);
  CHECK(r.ids(0, 1) == 1);
}

TEST_CASE("route and replay agree on native ids; replay recomputes weights from the current logits") {
  for (const auto& cfg : gradient_configs()) {
    CAPTURE(mrr::to_string(cfg.score_function));
    mrr::TopKRouter<double> router(cfg);
    if (cfg.use_expert_bias) router.set_expert_bias(random_logits(1, cfg.num_experts, 7, 0.1).row(0).transpose());
    const auto z = random_logits(20, cfg.num_experts, 1);
    const auto native = router.route(z);
    const auto replayed = router.replay(z, native.ids);
    CHECK(replayed.ids == native.ids);
    CHECK((replayed.weights - native.weights).cwiseAbs().maxCoeff() < 1e-15);
    // New logits: replay keeps the ids, weights follow the new logits.
    const auto z2 = random_logits(20, cfg.num_experts, 2);
    const auto again = router.replay(z2, native.ids);
    CHECK(again.ids == native.ids);
    CHECK((again.weights - router.replay(z2, native.ids).weights).cwiseAbs().maxCoeff() == 0.0);
    CHECK((again.weights - native.weights).cwiseAbs().maxCoeff() > 1e-3);
  }
}

TEST_CASE("replay mask: unmasked rows are routed natively") {
  mrr::TopKRouter<double> router(mrr::presets::qwen3_moe(16, 4));
  const auto z = random_logits(5, 16, 3);
  mrr::ExpertIds ids(5, 4);
  for (int t = 0; t < 5; ++t) ids.row(t) << 15, 14, 13, 12;
  const std::vector<std::uint8_t> mask = {1, 1, 0, 1, 0};
  const auto r = router.replay(z, ids, mask);
  const auto native = router.route(z);
  for (int t = 0; t < 5; ++t) {
    if (mask[static_cast<std::size_t>(t)]) {
      CHECK(r.ids.row(t) == ids.row(t));
    } else {
      CHECK(r.ids.row(t) == native.ids.row(t));
      CHECK(r.weights.row(t) == native.weights.row(t));
    }
  }
}

TEST_CASE("backward matches finite differences for every score function and normalisation") {
  for (const auto& cfg : gradient_configs()) {
    CAPTURE(mrr::to_string(cfg.score_function));
    CAPTURE(cfg.pre_softmax);
    CAPTURE(cfg.normalizes());
    mrr::TopKRouter<double> router(cfg);
    const auto z = random_logits(7, cfg.num_experts, 11);
    const auto routing = router.route(z);
    const auto g = random_logits(7, cfg.topk, 12, 1.0);
    const auto analytic = router.backward(z, routing, g);
    const auto numeric = numeric_grad(router, z, routing.ids, g);
    CHECK((analytic - numeric).cwiseAbs().maxCoeff() < 1e-7);
    CHECK(analytic.cwiseAbs().maxCoeff() > 1e-3);  // not trivially zero
  }
}

TEST_CASE("backward on replayed ids matches finite differences (gradients flow through replay)") {
  mrr::TopKRouter<double> router(mrr::presets::megatron_deepseek_v3(16, 4, 4, 2, 2.5));
  const auto z = random_logits(6, 16, 21);
  mrr::ExpertIds ids(6, 4);
  for (int t = 0; t < 6; ++t) ids.row(t) << (t % 16), ((t + 5) % 16), ((t + 9) % 16), ((t + 14) % 16);
  const auto routing = router.replay(z, ids);
  const auto g = random_logits(6, 4, 22, 1.0);
  CHECK((router.backward(z, routing, g) - numeric_grad(router, z, ids, g)).cwiseAbs().maxCoeff() < 1e-7);
}

// backward_into: the same gradient on memory the caller holds (a torch trainer's padded rows),
// with ids that never went through a Routing, and a clear error for an id out of range.
TEST_CASE("backward_into on strided caller memory equals backward; bad ids name their row") {
  mrr::TopKRouter<double> router(mrr::presets::megatron_deepseek_v3(16, 4, 4, 2, 2.5));
  const auto z = random_logits(6, 16, 31);
  const auto routing = router.route(z);
  const auto g = random_logits(6, 4, 32, 1.0);
  const auto expect = router.backward(z, routing, g);
  // Logits, ids, grad_weights and grad each inside a wider buffer (row stride > cols).
  mrr::RowMatrix<double> zbuf = mrr::RowMatrix<double>::Constant(6, 20, 99.0), gbuf = mrr::RowMatrix<double>::Zero(6, 7);
  mrr::RowMatrix<std::int32_t> ibuf = mrr::RowMatrix<std::int32_t>::Constant(6, 5, -1);
  zbuf.leftCols(16) = z;
  gbuf.leftCols(4) = g;
  ibuf.leftCols(4) = routing.ids;
  using Stride = Eigen::OuterStride<>;
  const Eigen::Map<const mrr::RowMatrix<double>, 0, Stride> zv(zbuf.data(), 6, 16, Stride(20)), gv(gbuf.data(), 6, 4, Stride(7));
  const Eigen::Map<const mrr::ExpertIds, 0, Stride> iv(ibuf.data(), 6, 4, Stride(5));
  mrr::RowMatrix<double> out = mrr::RowMatrix<double>::Constant(6, 24, 7.0);
  Eigen::Map<mrr::RowMatrix<double>, 0, Stride> ov(out.data(), 6, 16, Stride(24));
  router.backward_into(ov, zv, iv, gv);
  CHECK(mrr::RowMatrix<double>(ov) == expect);                  // bit for bit
  CHECK((out.rightCols(8).array() == 7.0).all());                // nothing past the view is written
  ibuf(3, 2) = 16;
  CHECK_THROWS_WITH_AS(router.backward_into(ov, zv, iv, gv), doctest::Contains("row 3"), mrr::InvalidArgument);
}

TEST_CASE("capacity: dropped slots get zero weight and no gradient; sparse equals dense") {
  mrr::RouterConfig cfg;
  cfg.num_experts = 8;
  cfg.topk = 2;
  cfg.pre_softmax = true;
  cfg.capacity_factor = 0.5;
  for (auto policy : {mrr::DropPolicy::probs, mrr::DropPolicy::position}) {
    cfg.drop_policy = policy;
    mrr::TopKRouter<double> router(cfg);
    const auto z = random_logits(40, 8, 5);
    const auto r = router.route(z);
    REQUIRE(r.has_capacity_mask());
    const long capacity = mrr::expert_capacity(40, 2, 8, 0.5);
    std::vector<long> load(8, 0);
    long dropped = 0;
    for (int t = 0; t < 40; ++t)
      for (int j = 0; j < 2; ++j) {
        if (r.kept(t, j)) ++load[static_cast<std::size_t>(r.ids(t, j))];
        else {
          ++dropped;
          CHECK(r.weights(t, j) == 0.0);
        }
      }
    CHECK(dropped > 0);
    for (long l : load) CHECK(l <= capacity);
    // The same as Megatron's dense function applied to the un-dropped routing.
    mrr::RouterConfig no_cap = cfg;
    no_cap.capacity_factor.reset();
    const auto full = mrr::TopKRouter<double>(no_cap).route(z);
    const auto dense = mrr::to_dense(full, 8);
    const auto expected = mrr::apply_token_dropping<double>(dense.probs, dense.map, 2, 0.5, policy, false);
    const auto got = mrr::to_dense(r, 8);
    CHECK(got.map == expected.map);
    CHECK(got.probs == expected.probs);
    const auto g = mrr::RowMatrix<double>::Ones(40, 2);
    const auto grad = router.backward(z, r, g);
    auto routing_without_drops = r;
    routing_without_drops.kept.resize(0, 0);
    mrr::RowMatrix<double> masked_g = g;
    for (int t = 0; t < 40; ++t)
      for (int j = 0; j < 2; ++j) masked_g(t, j) = r.kept(t, j) ? 1.0 : 0.0;
    CHECK((grad - router.backward(z, routing_without_drops, masked_g)).cwiseAbs().maxCoeff() == 0.0);
  }
}

TEST_CASE("capacity: a factor too large for int64 keeps every slot (it saturates, never wraps negative)") {
  CHECK(mrr::expert_capacity(40, 2, 8, 0.5) == 5);
  CHECK(mrr::expert_capacity(40, 2, 8, 1e17) == 1'000'000'000'000'000'000);  // ceil(80 / 8 * 1e17), exact
  for (const double cf : {1e19, 1e20, 1e300}) {
    CAPTURE(cf);
    CHECK(mrr::expert_capacity(40, 2, 8, cf) == std::numeric_limits<std::int64_t>::max());
    mrr::RouterConfig cfg;
    cfg.num_experts = 8;
    cfg.topk = 2;
    cfg.capacity_factor = cf;
    const auto z = random_logits(40, 8, 6);
    for (auto policy : {mrr::DropPolicy::probs, mrr::DropPolicy::position}) {
      cfg.drop_policy = policy;
      const auto r = mrr::TopKRouter<double>(cfg).route(z);
      REQUIRE(r.has_capacity_mask());
      CHECK(r.kept.cast<int>().sum() == 80);  // sparse: every slot kept
      auto sparse = r;
      mrr::drop_over_capacity(sparse, 8, cf, policy);
      CHECK(sparse.kept.cast<int>().sum() == 80);
      const auto dense = mrr::to_dense(r, 8);
      for (const bool pad : {false, true}) {
        const auto d = mrr::apply_token_dropping<double>(dense.probs, dense.map, 2, cf, policy, pad);
        CHECK(d.map.cast<int>().sum() == (pad ? 40 * 8 : 80));
      }
    }
  }
}

TEST_CASE("position policy keeps the earliest tokens") {
  mrr::RowMatrix<double> probs = mrr::RowMatrix<double>::Zero(6, 2);
  mrr::Mask map = mrr::Mask::Zero(6, 2);
  for (int t = 0; t < 6; ++t) {
    map(t, 0) = 1;
    probs(t, 0) = 0.1 * (6 - t);
  }
  // capacity = ceil(6 * 1 / 2 * 0.5) = 2
  const auto pos = mrr::apply_token_dropping<double>(probs, map, 1, 0.5, mrr::DropPolicy::position, false);
  CHECK(pos.map.col(0).cast<int>().sum() == 2);
  CHECK(pos.map(0, 0) == 1);
  CHECK(pos.map(1, 0) == 1);
  // probs policy keeps the largest probabilities (which here are also the earliest)
  probs(5, 0) = 1.0;
  const auto pr = mrr::apply_token_dropping<double>(probs, map, 1, 0.5, mrr::DropPolicy::probs, false);
  CHECK(pr.map(5, 0) == 1);
  CHECK(pr.map(0, 0) == 1);
  CHECK(pr.map(1, 0) == 0);
  // The probs policy cannot order a NaN (the device form refuses it too); position ignores probs.
  probs(3, 1) = std::numeric_limits<double>::quiet_NaN();
  CHECK_THROWS_WITH_AS((void)mrr::apply_token_dropping<double>(probs, map, 1, 0.5, mrr::DropPolicy::probs, false),
                       doctest::Contains("'probs' holds NaN at [3, 1]"), mrr::InvalidArgument);
  CHECK(mrr::apply_token_dropping<double>(probs, map, 1, 0.5, mrr::DropPolicy::position, false).map(0, 0) == 1);
  probs(3, 1) = 0;
  map(4, 1) = 2;
  CHECK_THROWS_WITH_AS((void)mrr::apply_token_dropping<double>(probs, map, 1, 0.5, mrr::DropPolicy::position, false),
                       doctest::Contains("'routing_map' has 2 at [4, 1]; a map holds 0 or 1"), mrr::InvalidArgument);
}

TEST_CASE("bad input is a clear error naming the problem") {
  mrr::TopKRouter<double> router(mrr::presets::mixtral(8, 2));
  CHECK_THROWS_WITH_AS(router.route(random_logits(3, 7, 1)), doctest::Contains("but the router has 8 experts"),
                       mrr::InvalidArgument);
  auto z = random_logits(3, 8, 1);
  z(1, 4) = std::numeric_limits<double>::quiet_NaN();
  CHECK_THROWS_WITH_AS(router.route(z), doctest::Contains("logits row 1 has nan at expert 4"), mrr::InvalidArgument);
  z(1, 4) = std::numeric_limits<double>::infinity();
  CHECK_THROWS_WITH_AS(router.route(z), doctest::Contains("logits row 1 has inf at expert 4"), mrr::InvalidArgument);
  z(1, 4) = -std::numeric_limits<double>::infinity();  // a masked expert is fine
  CHECK(router.route(z).ids(1, 0) != 4);
  z(1, 4) = 0;
  mrr::ExpertIds ids(3, 2);
  ids << 0, 1, 2, 8, 4, 5;
  CHECK_THROWS_WITH_AS(router.replay(z, ids), doctest::Contains("row 1 slot 1 has expert id 8 outside [0, 8)"),
                       mrr::InvalidArgument);
  ids(1, 1) = 2;
  CHECK_THROWS_WITH_AS(router.replay(z, ids), doctest::Contains("row 1 repeats expert id 2"), mrr::InvalidArgument);
  ids(1, 1) = 3;
  CHECK_THROWS_AS(router.replay(z, ids, std::vector<std::uint8_t>{1, 1}), mrr::InvalidArgument);
  CHECK_NOTHROW(router.replay(z, ids));

  mrr::RouterConfig c;
  c.num_experts = 16;
  c.topk = 20;
  CHECK_THROWS_WITH_AS(c.validate(), doctest::Contains("topk must be in [1, num_experts=16]"), mrr::InvalidArgument);
  c.topk = 4;
  c.num_groups = 5;
  c.group_topk = 2;
  CHECK_THROWS_WITH_AS(c.validate(), doctest::Contains("not divisible by num_groups=5"), mrr::InvalidArgument);
  c.num_groups = 4;
  c.use_expert_bias = true;
  CHECK_THROWS_WITH_AS(c.validate(), doctest::Contains("expert bias is supported with the sigmoid"),
                       mrr::InvalidArgument);
  c.use_expert_bias = false;
  c.pad_to_capacity = true;
  CHECK_THROWS_WITH_AS(c.validate(), doctest::Contains("pad_to_capacity needs a capacity_factor"),
                       mrr::InvalidArgument);
  CHECK_THROWS_AS(mrr::parse_score_function("softermax"), mrr::InvalidArgument);
}

TEST_CASE("RouterConfig and TopKRouter refuse what Megatron refuses or a [tokens, k] routing cannot hold") {
  // Softmax after a top-1 selection: every weight 1, no gradient to the gate.
  CHECK_THROWS_WITH_AS(mrr::presets::megatron(8, 1), doctest::Contains("use pre_softmax with topk = 1"),
                       mrr::InvalidArgument);
  auto post = mrr::presets::megatron(8, 2);
  post.topk = 1;
  CHECK_THROWS_WITH_AS(post.validate(), doctest::Contains("use pre_softmax with topk = 1"), mrr::InvalidArgument);
  post.pre_softmax = true;
  CHECK_NOTHROW(post.validate());
  // What Megatron-Core accepts: pre_softmax with sigmoid (DeepSeek-V3 recipes set it; only softmax
  // reads it) routes as without it; num_groups without group_topk routes ungrouped; group_topk
  // without num_groups is refused with its reason.
  {
    const mrr::RowMatrix<double> z = random_logits(64, 16, 91);
    auto sig = mrr::presets::megatron_deepseek_v3(16, 4, 4, 2, 2.5);
    auto sig_pre = sig;
    sig_pre.pre_softmax = true;
    const auto a = mrr::TopKRouter<double>(sig).route(z), b = mrr::TopKRouter<double>(sig_pre).route(z);
    CHECK(a.ids == b.ids);
    CHECK(a.weights == b.weights);
    auto plain = mrr::presets::megatron(16, 4), groups_only = plain;
    groups_only.num_groups = 4;
    const auto c = mrr::TopKRouter<double>(plain).route(z), d = mrr::TopKRouter<double>(groups_only).route(z);
    CHECK(c.ids == d.ids);
    CHECK(c.weights == d.weights);
    groups_only.num_groups = 0;
    groups_only.group_topk = 2;
    CHECK_THROWS_WITH_AS(groups_only.validate(), doctest::Contains("group_topk (2) needs num_groups"),
                         mrr::InvalidArgument);
  }
  // A negative group_score_topk was replaced by the default.
  auto grouped = mrr::presets::megatron_deepseek_v3(16, 4, 4, 2, 1.0);
  grouped.group_score_topk = -3;
  CHECK_THROWS_WITH_AS(grouped.validate(), doctest::Contains("group_score_topk must be >= 0"), mrr::InvalidArgument);
  // Padding to capacity is the dense apply_token_dropping's.
  auto padded = mrr::presets::qwen3_moe(8, 2);
  padded.capacity_factor = 1.0;
  padded.pad_to_capacity = true;
  CHECK_NOTHROW(padded.validate());
  CHECK_THROWS_WITH_AS(mrr::TopKRouter<float>{padded}, doctest::Contains("pad_to_capacity is for the dense"),
                       mrr::InvalidArgument);
}

TEST_CASE("drop_over_capacity refuses weights of another shape and a token listing an expert twice") {
  mrr::Routing<float> r;
  r.ids = mrr::ExpertIds(4, 2);
  r.ids << 0, 1, 1, 2, 2, 3, 3, 0;
  r.weights = mrr::RowMatrix<float>::Constant(2, 2, 0.5f);  // 2 rows for 4 tokens: was a heap overflow
  CHECK_THROWS_WITH_AS(mrr::drop_over_capacity(r, 4, 1.0, mrr::DropPolicy::probs),
                       doctest::Contains("routing weights have shape"), mrr::InvalidArgument);
  r.weights = mrr::RowMatrix<float>::Constant(4, 2, 0.5f);
  r.ids(1, 1) = 1;  // token 1: expert 1 twice would take two of its places
  CHECK_THROWS_WITH_AS(mrr::drop_over_capacity(r, 4, 1.0, mrr::DropPolicy::probs),
                       doctest::Contains("row 1 repeats expert id 1"), mrr::InvalidArgument);
  r.ids(1, 1) = 2;
  mrr::drop_over_capacity(r, 4, 1.0, mrr::DropPolicy::probs);
  CHECK(r.kept.rows() == 4);
}

TEST_CASE("update_expert_bias refuses NaN and negative counts (a NaN mean froze every bias)") {
  mrr::TopKRouter<double> router(mrr::presets::megatron_deepseek_v3(4, 2, 2, 1, 1.0));
  const std::vector<double> nan_count{100, std::numeric_limits<double>::quiet_NaN(), 0, 0};
  CHECK_THROWS_WITH_AS(router.update_expert_bias(std::span<const double>(nan_count)),
                       doctest::Contains("'tokens_per_expert' has nan for expert 1"), mrr::InvalidArgument);
  const std::vector<double> negative{-5, 3, 3, 3};
  CHECK_THROWS_WITH_AS(router.update_expert_bias(std::span<const double>(negative)), doctest::Contains("for expert 0"),
                       mrr::InvalidArgument);
  CHECK(router.expert_bias().cwiseAbs().maxCoeff() == 0.0);
}

TEST_CASE("expert bias steers selection only, and the sign rule moves it toward balance") {
  auto cfg = mrr::presets::megatron_deepseek_v3(8, 2, 2, 1, 1.0);
  cfg.expert_bias_update_rate = 0.5;
  mrr::TopKRouter<double> router(cfg);
  const auto z = random_logits(4, 8, 9);
  const auto before = router.route(z);
  mrr::Vector<double> bias = mrr::Vector<double>::Zero(8);
  bias[7] = 10.0;  // expert 7 (group 1) now always wins selection
  router.set_expert_bias(bias);
  const auto after = router.route(z);
  for (int t = 0; t < 4; ++t) CHECK(after.ids(t, 0) == 7);
  // Weights never see the bias: replaying the biased ids without bias gives the same weights.
  mrr::RouterConfig plain = cfg;
  plain.use_expert_bias = false;
  plain.num_groups = plain.group_topk = 0;
  CHECK((mrr::TopKRouter<double>(plain).replay(z, after.ids).weights - after.weights).cwiseAbs().maxCoeff() < 1e-15);
  std::vector<long> load(8, 0);
  load[7] = 8;
  router.update_expert_bias<long>(load);
  CHECK(router.expert_bias()[7] == doctest::Approx(9.5));
  CHECK(router.expert_bias()[0] == doctest::Approx(0.5));
  (void)before;
}

TEST_CASE("presets validate and describe their families") {
  CHECK(mrr::presets::mixtral().normalizes());
  CHECK_FALSE(mrr::presets::qwen2_moe().normalizes());
  CHECK(mrr::presets::qwen3_moe().normalizes());
  const auto ds = mrr::presets::deepseek_v3();
  CHECK(ds.group_masking == mrr::GroupMasking::zero);
  CHECK(ds.effective_group_score_topk() == 2);
  const auto mds = mrr::presets::megatron_deepseek_v3(256, 8, 8, 4);
  CHECK(mds.group_masking == mrr::GroupMasking::neg_inf);
  CHECK(mds.effective_group_score_topk() == 2);
  CHECK(mrr::presets::megatron_deepseek_v3(64, 8, 4, 2).effective_group_score_topk() == 4);
}

TEST_CASE("masked (-inf) rows: fewer than k unmasked experts, or only masked experts chosen, is an error, never NaN") {
  const double ninf = -std::numeric_limits<double>::infinity();
  mrr::RouterConfig mixtral = mrr::presets::mixtral(8, 2);  // softmax over all experts, renormalised over the k
  mrr::RouterConfig pre = mixtral;                           // softmax over all experts, not renormalised
  pre.normalize_topk = false;
  mrr::RouterConfig post;                               // Megatron's default: top-k, then softmax over the k
  post.num_experts = 8;
  post.topk = 2;
  mrr::RouterConfig sig = post;
  sig.score_function = mrr::ScoreFunction::sigmoid;
  for (const auto& config : {mixtral, pre, post, sig}) {
    CAPTURE(mrr::to_string(config.score_function));
    CAPTURE(config.pre_softmax);
    CAPTURE(config.normalizes());
    mrr::TopKRouter<double> router(config);
    auto z = random_logits(3, 8, 5);
    for (int e = 0; e < 8; ++e) z(1, e) = ninf;
    CHECK_THROWS_WITH_AS(router.route(z), doctest::Contains("logits row 1 has 0 finite logits"), mrr::InvalidArgument);
    z(1, 6) = 0.5;  // one unmasked expert, k = 2
    CHECK_THROWS_WITH_AS(router.route(z), doctest::Contains("but k=2 experts must be chosen"), mrr::InvalidArgument);
    z(1, 3) = -0.5;  // exactly k unmasked: routed to them, finite weights
    const auto r = router.route(z);
    CHECK(r.ids(1, 0) == 6);
    CHECK(r.ids(1, 1) == 3);
    CHECK(r.weights.allFinite());
    // Replay: ids are given, so only weights that would be 0/0 are an error.
    mrr::ExpertIds ids(3, 2);
    ids << 0, 1, 0, 1, 0, 1;  // row 1 replays two masked experts
    if (config.score_function == mrr::ScoreFunction::softmax && (!config.pre_softmax || config.normalizes())) {
      CHECK_THROWS_WITH_AS(router.replay(z, ids), doctest::Contains("logits row 1: the weight of replayed expert 0"),
                           mrr::InvalidArgument);
    } else {
      const auto w = router.replay(z, ids).weights;  // softmax over all / sigmoid: a masked expert weighs 0
      CHECK(w.allFinite());
      CHECK(w(1, 0) == 0.0);
    }
    for (int e = 0; e < 8; ++e) z(1, e) = ninf;
    if (config.score_function == mrr::ScoreFunction::softmax)
      CHECK_THROWS_WITH_AS(router.replay(z, ids), doctest::Contains("is NaN because every logit"),
                           mrr::InvalidArgument);
    else
      CHECK(router.replay(z, ids).weights.allFinite());
    // A row the replay mask leaves to native routing still needs k unmasked experts.
    CHECK_THROWS_WITH_AS(router.replay(z, ids, std::vector<std::uint8_t>{1, 0, 1}),
                         doctest::Contains("logits row 1 has 0 finite logits"), mrr::InvalidArgument);
  }
  // Group-limited, post-softmax, Megatron -inf masking: every group has at most one unmasked
  // expert, so every group scores -inf (sum of its top 2), the tie keeps group 0, and the top-2 of
  // the kept group are two masked experts: Megatron would return NaN weights; we raise.
  mrr::RouterConfig grouped = post;
  grouped.num_experts = 16;
  grouped.num_groups = 4;
  grouped.group_topk = 1;
  mrr::TopKRouter<double> router(grouped);
  mrr::RowMatrix<double> z = mrr::RowMatrix<double>::Constant(1, 16, ninf);
  z(0, 9) = 1.0;
  z(0, 13) = 2.0;
  CHECK_THROWS_WITH_AS(router.route(z), doctest::Contains("logits row 0: the weight of chosen expert 0"),
                       mrr::InvalidArgument);
  z(0, 8) = 0.0;  // group 2 now scores finite: routed there
  const auto r = router.route(z);
  CHECK(r.ids(0, 0) == 9);
  CHECK(r.ids(0, 1) == 8);
  CHECK(r.weights.allFinite());
}

namespace {

// The definition: indices by descending value, the lower index first among equals; the first k.
std::vector<int> topk_by_definition(const std::vector<float>& v, int k) {
  std::vector<int> order(v.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return v[static_cast<std::size_t>(a)] > v[static_cast<std::size_t>(b)]; });
  order.resize(static_cast<std::size_t>(k));
  return order;
}

}  // namespace

TEST_CASE(
    "the plain and the block-bounded top-k (host fast path) select the definition's ids: every n <= 300, k <= 16") {
  // Rows of every length, not only the usual expert counts: the bounded selection splits a row into
  // k blocks, and lengths that do not divide into k blocks of ceil(n / k) (n = 33, k = 8) once left
  // its last slots unwritten. The "strided" rows put the only large values one block apart, so the
  // block maxima are exactly the row's best: the bound's worst case.
  std::mt19937 rng(99);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_int_distribution<int> small(-3, 3);
  long rows = 0;
  for (int n = 1; n <= 320; n += n < 300 ? 1 : 84) {  // 1..300, then 384
    std::vector<float> v(static_cast<std::size_t>(n));
    std::vector<int> scratch(v.size());
    for (int k = 1; k <= std::min(n, 16); ++k) {
      const int block = n / k;
      for (int pattern = 0; pattern < 8; ++pattern) {
        for (std::size_t e = 0; e < v.size(); ++e) {
          switch (pattern) {
            case 0:
              v[e] = normal(rng);
              break;
            case 1:  // many exact ties
              v[e] = static_cast<float>(small(rng));
              break;
            case 2:
              v[e] = e % 3 == 0 ? -std::numeric_limits<float>::infinity() : normal(rng);
              break;
            case 3:  // ascending: the best last
              v[e] = static_cast<float>(e);
              break;
            default:  // small values under the strided large ones below
              v[e] = 0.01f * normal(rng);
              break;
          }
        }
        if (pattern >= 4) {  // strided: large descending values every `stride` indices
          const int stride = std::max(1, block - 1 + (pattern - 4));
          for (int e = 0, i = 0; e < n; e += stride, ++i)
            v[static_cast<std::size_t>(e)] = 100.f - static_cast<float>(i);
        }
        CAPTURE(n);
        CAPTURE(k);
        CAPTURE(pattern);
        const auto want = topk_by_definition(v, k);
        std::vector<int> a(static_cast<std::size_t>(k), -1), b(static_cast<std::size_t>(k), -1);
        std::vector<float> va(static_cast<std::size_t>(k)), vb(static_cast<std::size_t>(k));
        mrr::detail::topk_desc(v.data(), n, k, a.data(), va.data());
        mrr::detail::topk_desc_bounded(v.data(), n, k, b.data(), vb.data(), scratch.data());
        REQUIRE(a == want);
        REQUIRE(b == want);
        for (int j = 0; j < k; ++j)
          REQUIRE(vb[static_cast<std::size_t>(j)] == v[static_cast<std::size_t>(want[static_cast<std::size_t>(j)])]);
        ++rows;
      }
    }
  }
  CHECK(rows > 30000);
}

TEST_CASE("group-limited selection equals the definition: mask the other groups, then top-k (both maskings)") {
  // Groups of 4 take the scalar kernel; groups of 32 and 16 the vectorised host selection
  // (detail/group_select.hpp), where it applies (group scores of the top 1 or 2).
  struct Layout {
    int experts, k, groups, group_topk;
  };
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (const Layout l : {Layout{32, 4, 8, 2}, Layout{256, 8, 8, 4}, Layout{128, 6, 8, 3}, Layout{64, 2, 4, 1}}) {
    const int n = l.experts, per = n / l.groups, k = l.k;
    CAPTURE(n);
    CAPTURE(k);
    for (auto masking : {mrr::GroupMasking::neg_inf, mrr::GroupMasking::zero}) {
      for (int trial = 0; trial < 40; ++trial) {
        mrr::RouterConfig cfg = mrr::presets::deepseek_v3(n, k, l.groups, l.group_topk, true, 1.0);
        cfg.group_masking = masking;
        if (trial % 3 == 1) cfg.group_score_topk = 0;  // topk / group_topk
        if (trial % 3 == 2) cfg.group_score_topk = std::min(3, per);
        mrr::TopKRouter<float> router(cfg);
        mrr::Vector<float> bias(n);
        // Strongly negative biases make kept scores < 0, where 0.0-masked experts can win.
        for (int e = 0; e < n; ++e)
          bias[e] = trial % 2 ? -1.5f + 0.1f * normal(rng) : 0.2f * normal(rng);
        router.set_expert_bias(bias);
        mrr::RowMatrix<float> z(6, n);
        for (Eigen::Index i = 0; i < z.size(); ++i)
          z.data()[i] = trial % 4 == 3 ? std::round(normal(rng)) : normal(rng);
        const auto got = router.route(z);
        for (int t = 0; t < 6; ++t) {
          std::vector<float> s(static_cast<std::size_t>(n));
          for (int e = 0; e < n; ++e)
            s[static_cast<std::size_t>(e)] = 1.f / (1.f + std::exp(-z(t, e))) + bias[e];
          const int m = cfg.effective_group_score_topk();
          std::vector<float> gs(static_cast<std::size_t>(l.groups));
          for (int g = 0; g < l.groups; ++g) {
            std::vector<float> members(s.begin() + g * per, s.begin() + (g + 1) * per);
            std::sort(members.begin(), members.end(), std::greater<>());
            gs[static_cast<std::size_t>(g)] = 0;
            for (int i = 0; i < m; ++i)
              gs[static_cast<std::size_t>(g)] += members[static_cast<std::size_t>(i)];
          }
          std::vector<int> gid(static_cast<std::size_t>(l.group_topk));
          std::vector<float> gv(gid.size());
          mrr::detail::topk_desc(gs.data(), l.groups, l.group_topk, gid.data(), gv.data());
          std::vector<float> masked(static_cast<std::size_t>(n),
                                    masking == mrr::GroupMasking::zero ? 0.f : -std::numeric_limits<float>::infinity());
          for (int g : gid)
            for (int e = g * per; e < (g + 1) * per; ++e)
              masked[static_cast<std::size_t>(e)] = s[static_cast<std::size_t>(e)];
          std::vector<int> want(static_cast<std::size_t>(k));
          std::vector<float> wv(want.size());
          mrr::detail::topk_desc(masked.data(), n, k, want.data(), wv.data());
          for (int j = 0; j < k; ++j)
            CHECK(got.ids(t, j) == want[static_cast<std::size_t>(j)]);
        }
      }
    }
  }
}

// detail::select_grouped against the scalar kernel it specialises, on rows made to break it: ties
// (many equal values, all equal), signed zeros, -inf holes and all -inf, scores below 0 (where
// 0.0-masked experts win); every layout it takes, group scores of the top 1 and 2, both maskings,
// with the build's loops and the AVX2 ones where this CPU runs them.
TEST_CASE("vectorised group-limited selection gives the scalar kernel's ids on adversarial rows") {
  struct Layout {
    int groups, per, group_topk, k;
  };
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (const Layout l :
       {Layout{8, 32, 4, 8}, Layout{8, 8, 4, 8}, Layout{4, 16, 2, 4}, Layout{16, 16, 4, 8}, Layout{64, 8, 32, 64},
        Layout{8, 32, 4, 1}, Layout{1, 64, 1, 2}, Layout{2, 128, 1, 2}, Layout{32, 8, 4, 6}, Layout{8, 24, 3, 5}})
    for (int m : {1, 2})
      for (bool zero : {false, true})
        for (int pattern = 0; pattern < 8; ++pattern)
          for (int trial = 0; trial < 60; ++trial) {
            mrr::kernels::RouterParams p;
            p.num_experts = l.groups * l.per;
            p.topk = l.k;
            p.score = 1;
            p.selects_on_logits = false;
            p.grouped = true;
            p.zero_masking = zero;
            p.num_groups = l.groups;
            p.group_topk = l.group_topk;
            p.group_score_topk = m;
            p.experts_per_group = l.per;
            REQUIRE(mrr::detail::group_select_applies(p));
            const int n = p.num_experts;
            std::vector<float> s(static_cast<std::size_t>(n));
            for (auto& x : s) {
              x = normal(rng);
              switch (pattern) {
                case 1:
                  x = std::round(x * 2) / 2;
                  break;  // many ties
                case 2:
                  x = -1.5f + 0.1f * x;
                  break;  // below 0
                case 3:
                  x = rng() % 3 == 0 ? -std::numeric_limits<float>::infinity() : x;
                  break;  // holes
                case 4:
                  x = 1.0f;
                  break;  // all equal
                case 5:
                  x = rng() % 2 ? -0.0f : 0.0f;
                  break;  // signed zeros
                case 6:
                  x = std::round(x) * 0.0f;
                  break;  // zeros, ties
                case 7:
                  x = -std::numeric_limits<float>::infinity();
                  break;
                default:
                  break;
              }
            }
            CAPTURE(l.groups);
            CAPTURE(l.per);
            CAPTURE(m);
            CAPTURE(zero);
            CAPTURE(pattern);
            std::vector<float> row = s, values(static_cast<std::size_t>(std::max({p.topk, p.num_groups, 2}))),
                               group_scores(static_cast<std::size_t>(p.num_groups)),
                               vals(static_cast<std::size_t>(p.topk));
            std::vector<int> indices(static_cast<std::size_t>(std::max(p.num_groups, 2))),
                candidates(static_cast<std::size_t>(n)), want(static_cast<std::size_t>(p.topk)), got(want.size());
            const mrr::kernels::SelectScratch<float> w{nullptr, values.data(), group_scores.data(), indices.data(),
                                                       candidates.data()};
            mrr::kernels::select_on_scores(p, row.data(), want.data(), w);
            for (bool avx2 : {false, true}) {
#if MRR_HAVE_CPU_HAS_AVX2
              if (avx2 && !mrr::detail::cpu_has_avx2()) continue;
#else
              if (avx2) continue;
#endif
              std::fill(got.begin(), got.end(), -1);
              mrr::detail::select_grouped(p, s.data(), got.data(), vals.data(), candidates.data(), avx2);
              REQUIRE(got == want);
            }
          }
}
