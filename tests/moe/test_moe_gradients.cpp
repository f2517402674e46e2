// MoELayer gradients against central finite differences (double): w.r.t. the input, the gate
// weight and every expert matrix, with native and replayed routes, with and without capacity
// dropping; activation recomputation replaying the forward's routes first-in-first-out; and the
// replay controller handing the router no mask when every row has a route.
#include <mrr/moe.hpp>
#include <mrr/replay.hpp>
#include <mrr/router.hpp>

#include <doctest/doctest.h>

#include "moe_fixture.hpp"

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <span>

using mrr::RowMatrix;
using mrr::test::MoEModel;

namespace {

constexpr int kHidden = 6, kIntermediate = 5, kTokens = 14;

// sum(output * grad_y)
double loss(const RowMatrix<double>& out, const RowMatrix<double>& gy) { return (out.array() * gy.array()).sum(); }

// Checks d loss / d p against (L(p + h) - L(p - h)) / 2h for every entry of `param`.
void check_fd(RowMatrix<double>& param, const RowMatrix<double>& analytic, const std::function<double()>& eval,
              const char* what) {
  CAPTURE(what);
  REQUIRE(analytic.rows() == param.rows());
  REQUIRE(analytic.cols() == param.cols());
  constexpr double h = 1e-6;
  double worst = 0;
  for (Eigen::Index i = 0; i < param.size(); ++i) {
    const double saved = param.data()[i];
    param.data()[i] = saved + h;
    const double up = eval();
    param.data()[i] = saved - h;
    const double down = eval();
    param.data()[i] = saved;
    const double fd = (up - down) / (2 * h);
    const double err = std::abs(fd - analytic.data()[i]) / (1e-6 + std::abs(fd));
    worst = std::max(worst, err);
  }
  CHECK(worst < 1e-5);
}

// Finite differences of every parameter for a layer whose route comes from `replay` (any store).
template <class Store>
void check_layer_gradients(const MoEModel<double>& base, mrr::RoutingReplay<Store>* replay,
                           const std::function<void()>& before_forward) {
  MoEModel<double> model = base;
  RowMatrix<double> x = mrr::test::random_normal<double>(kTokens, kHidden, 11);
  const RowMatrix<double> gy = mrr::test::random_normal<double>(kTokens, kHidden, 12);
  const mrr::SingleProcess comm;
  auto run = [&] {
    auto layer = model.layer(comm, replay, 0);
    before_forward();
    return std::pair{layer.forward(x), std::move(layer)};
  };
  auto [f, layer] = run();
  const auto g = layer.backward(f, gy);
  auto eval = [&] { return loss(run().first.output, gy); };
  check_fd(x, g.input, eval, "input");
  check_fd(model.gate, g.gate_weight, eval, "gate weight");
  const int e = model.num_experts(), h = model.hidden, inter = model.intermediate;
  for (int ex = 0; ex < e; ++ex) {
    CAPTURE(ex);
    // View expert ex's slices of the flat torch-layout tensors as matrices.
    auto slice = [&](std::vector<double>& flat, int rows, int cols, const RowMatrix<double>& grad, const char* what) {
      RowMatrix<double> m = Eigen::Map<RowMatrix<double>>(flat.data() + ex * rows * cols, rows, cols);
      check_fd(m, grad, [&] {
        Eigen::Map<RowMatrix<double>>(flat.data() + ex * rows * cols, rows, cols) = m;
        return eval();
      }, what);
      Eigen::Map<RowMatrix<double>>(flat.data() + ex * rows * cols, rows, cols) = m;
    };
    slice(model.w_gate, inter, h, g.experts.w_gate[static_cast<std::size_t>(ex)], "w_gate");
    slice(model.w_up, inter, h, g.experts.w_up[static_cast<std::size_t>(ex)], "w_up");
    slice(model.w_down, h, inter, g.experts.w_down[static_cast<std::size_t>(ex)], "w_down");
  }
}

MoEModel<double> model_with(mrr::RouterConfig config) { return MoEModel<double>::random(config, kHidden, kIntermediate, 5); }

mrr::RouterConfig with_capacity(mrr::RouterConfig c, double factor, mrr::DropPolicy policy) {
  c.capacity_factor = factor;
  c.drop_policy = policy;
  return c;
}

// Routes of the base model recorded once (R2), then replayed for every forward of the checks,
// while the parameters move.
void check_replayed(const MoEModel<double>& model, bool expect_drops) {
  mrr::MemoryRouteStore store({.num_experts = model.num_experts(), .num_layers = 1, .topk = model.topk()});
  mrr::RoutingReplay replay(mrr::ReplayMode::R2, store);
  replay.set_micro_batch(mrr::test::token_layout(0, kTokens));
  replay.begin_pass(mrr::TrainingPass::old_log_prob);
  {
    auto layer = model.layer(mrr::SingleProcess{}, &replay, 0);
    const auto f = layer.forward(mrr::test::random_normal<double>(kTokens, kHidden, 11));
    CHECK(f.routing.has_capacity_mask() == expect_drops);
    if (expect_drops) CHECK((f.routing.kept.array() == 0).any());
  }
  replay.set_activation_recompute(false);
  replay.begin_pass(mrr::TrainingPass::actor_update);
  check_layer_gradients(model, &replay, [] {});
  CHECK(replay.stats().replayed_rows > 0);
}

}  // namespace

TEST_CASE("MoELayer gradients match finite differences: native routing") {
  for (const auto& config : {mrr::presets::qwen3_moe(6, 2), mrr::presets::qwen2_moe(6, 3, false),
                             mrr::presets::megatron(6, 2)}) {
    mrr::RoutingReplay<mrr::NoRouteStore> none;
    check_layer_gradients(model_with(config), &none, [] {});
  }
}

TEST_CASE("MoELayer gradients match finite differences: sigmoid scores with groups and scaling") {
  mrr::RoutingReplay<mrr::NoRouteStore> none;
  check_layer_gradients(model_with(mrr::presets::megatron_deepseek_v3(8, 2, 4, 2, 1.5)), &none, [] {});
}

TEST_CASE("MoELayer gradients match finite differences: replayed routes") {
  check_replayed(model_with(mrr::presets::qwen3_moe(6, 2)), false);
  check_replayed(model_with(mrr::presets::qwen2_moe(6, 2, false)), false);
}

TEST_CASE("MoELayer gradients match finite differences: capacity dropping, native and replayed") {
  for (auto policy : {mrr::DropPolicy::probs, mrr::DropPolicy::position}) {
    CAPTURE(mrr::to_string(policy));
    const auto model = model_with(with_capacity(mrr::presets::qwen3_moe(6, 2), 0.5, policy));
    mrr::RoutingReplay<mrr::NoRouteStore> none;
    check_layer_gradients(model, &none, [] {});
    check_replayed(model, true);
  }
}

TEST_CASE("MoELayer: dropped slots contribute nothing forward or backward") {
  const auto model = model_with(with_capacity(mrr::presets::qwen3_moe(6, 2), 0.5, mrr::DropPolicy::probs));
  auto layer = model.layer(mrr::SingleProcess{});
  const RowMatrix<double> x = mrr::test::random_normal<double>(kTokens, kHidden, 11);
  const auto f = layer.forward(x);
  REQUIRE(f.routing.has_capacity_mask());
  std::int64_t kept = 0;
  for (Eigen::Index t = 0; t < kTokens; ++t)
    for (int j = 0; j < model.topk(); ++j) {
      if (f.routing.is_kept(t, j))
        ++kept;
      else
        CHECK(f.routing.weights(t, j) == 0.0);
    }
  CHECK(kept == f.permutation.rows());
  // A token with every slot dropped gets a zero output and gradient only through the gate.
  for (Eigen::Index t = 0; t < kTokens; ++t) {
    bool any = false;
    for (int j = 0; j < model.topk(); ++j) any = any || f.routing.is_kept(t, j);
    if (!any) CHECK(f.output.row(t).isZero(0));
  }
}

TEST_CASE("MoELayer: activation recomputation replays each forward's routes first-in-first-out") {
  const auto model = model_with(mrr::presets::qwen3_moe(6, 2));
  mrr::MemoryRouteStore store({.num_experts = 6, .num_layers = 2, .topk = 2});
  mrr::RoutingReplay replay(mrr::ReplayMode::R2, store);
  const RowMatrix<double> x1 = mrr::test::random_normal<double>(kTokens, kHidden, 21);
  const RowMatrix<double> x2 = mrr::test::random_normal<double>(kTokens, kHidden, 22);
  const RowMatrix<double> gy = mrr::test::random_normal<double>(kTokens, kHidden, 23);
  const auto mb1 = mrr::test::token_layout(0, kTokens), mb2 = mrr::test::token_layout(kTokens, 2 * kTokens);
  auto layer = model.layer(mrr::SingleProcess{}, &replay, 1);
  replay.begin_pass(mrr::TrainingPass::old_log_prob);  // record both micro-batches
  replay.set_micro_batch(mb1);
  const auto r1 = layer.forward(x1);
  replay.set_micro_batch(mb2);
  const auto r2 = layer.forward(x2);

  // The update's forwards (F1 F2) run on drifted gates and queue their replayed ids ...
  RowMatrix<double> drifted = model.gate + 0.3 * mrr::test::random_normal<double>(6, kHidden, 24);
  layer.set_gate_weight(drifted);
  replay.set_activation_recompute(true);
  replay.begin_pass(mrr::TrainingPass::actor_update);
  replay.set_micro_batch(mb1);
  const auto f1 = layer.forward(x1);
  replay.set_micro_batch(mb2);
  const auto f2 = layer.forward(x2);
  CHECK(f1.routing.ids == r1.routing.ids);
  CHECK(f2.routing.ids == r2.routing.ids);
  CHECK(replay.queued(1) == 2);
  // ... and the backward's recomputations (B1 B2) pop them in order, reproducing the forwards.
  replay.begin_pass(mrr::TrainingPass::actor_recompute);
  const auto b1 = layer.forward(x1);
  const auto b2 = layer.forward(x2);
  CHECK(replay.queued(1) == 0);
  CHECK(mrr::test::bitwise_equal(b1.output, f1.output));
  CHECK(mrr::test::bitwise_equal(b2.output, f2.output));
  const auto g1 = layer.backward(b1, gy), g1_direct = layer.backward(f1, gy);
  CHECK(mrr::test::bitwise_equal(g1.input, g1_direct.input));
  CHECK(mrr::test::bitwise_equal(g1.gate_weight, g1_direct.gate_weight));
  CHECK_THROWS_AS(layer.forward(x1), mrr::RouteStoreError);  // nothing left to recompute with
}

namespace {

// TopKRouter, watched: counts the replays that reached it without a mask (the router's replay-all
// fast path) and with the controller's `found` mask.
struct MaskWatchingRouter {
  using scalar_type = double;
  mrr::TopKRouter<double> inner;
  mutable int mask_free = 0, masked = 0;

  int num_experts() const { return inner.num_experts(); }
  int topk() const { return inner.topk(); }
  mrr::Routing<double> route(mrr::MatrixRef<double> logits) const { return inner.route(logits); }
  mrr::Routing<double> replay(mrr::MatrixRef<double> logits, mrr::ExpertIdsRef ids,
                              std::span<const std::uint8_t> mask) const {
    ++(mask.empty() ? mask_free : masked);
    return inner.replay(logits, ids, mask);
  }
  RowMatrix<double> backward(mrr::MatrixRef<double> logits, const mrr::Routing<double>& routing,
                             mrr::MatrixRef<double> grad_weights) const {
    return inner.backward(logits, routing, grad_weights);
  }
};
static_assert(mrr::Router<MaskWatchingRouter>);

}  // namespace

TEST_CASE("MoELayer with replay: every row recorded reaches the mask-free replay, a missing row passes the mask") {
  const auto model = model_with(mrr::presets::qwen3_moe(6, 2));
  mrr::SwiGLUExperts<double> experts(kHidden, kIntermediate, 6);
  experts.load_torch(model.w_gate, model.w_up, model.w_down);
  mrr::MemoryRouteStore store({.num_experts = 6, .num_layers = 1, .topk = 2});
  mrr::RoutingReplay replay(mrr::ReplayMode::R2, store, mrr::MissingRoutes::native);
  mrr::MoELayer<MaskWatchingRouter, mrr::SwiGLUExperts<double>, mrr::SingleProcess, mrr::MemoryRouteStore> layer(
      MaskWatchingRouter{mrr::TopKRouter<double>(model.config)}, experts, mrr::SingleProcess{}, replay, 0);
  layer.set_gate_weight(model.gate);
  const RowMatrix<double> x = mrr::test::random_normal<double>(kTokens, kHidden, 31);
  constexpr Eigen::Index recorded_rows = 10;  // tokens [10, 14) are never recorded
  replay.set_micro_batch(mrr::test::token_layout(0, recorded_rows));
  replay.begin_pass(mrr::TrainingPass::old_log_prob);
  const mrr::ExpertIds recorded = layer.forward(x.topRows(recorded_rows)).routing.ids;

  // The policy moves, so native routing now disagrees with the record somewhere.
  layer.set_gate_weight(model.gate + 2.0 * mrr::test::random_normal<double>(6, kHidden, 32));
  const auto natively = [&](const auto& f) { return mrr::TopKRouter<double>(model.config).route(f.router_logits()).ids; };
  replay.begin_pass(mrr::TrainingPass::actor_update);
  const auto all = layer.forward(x.topRows(recorded_rows));
  REQUIRE(natively(all) != recorded);
  CHECK(all.routing.ids == recorded);
  CHECK(layer.router().mask_free == 1);
  CHECK(layer.router().masked == 0);
  CHECK(replay.stats().mask_free_replays == 1);

  replay.set_micro_batch(mrr::test::token_layout(0, kTokens));
  const auto some = layer.forward(x);
  CHECK(layer.router().mask_free == 1);
  CHECK(layer.router().masked == 1);
  CHECK(replay.stats().mask_free_replays == 1);
  CHECK(replay.stats().native_rows == static_cast<std::uint64_t>(kTokens - recorded_rows));
  CHECK(some.routing.ids.topRows(recorded_rows) == recorded);
  CHECK(some.routing.ids.bottomRows(kTokens - recorded_rows) ==
        natively(some).bottomRows(kTokens - recorded_rows));
}

TEST_CASE("MoELayer: a NaN or infinite padding row is a zero token: finite output and gradients, the zero row's bits") {
  // Padding rows (the micro-batch layout's) may hold anything; the masked loss gives them a zero
  // output gradient. Without the rule, 0 x NaN made the gate and expert weight gradients NaN.
  const auto model = model_with(mrr::presets::qwen3_moe(6, 2));
  mrr::MemoryRouteStore store({.num_experts = 6, .num_layers = 1, .topk = 2});
  mrr::RoutingReplay replay(mrr::ReplayMode::R2, store);
  auto layer = model.layer(mrr::SingleProcess{}, &replay, 0);
  // Two sequences right-padded to 7 rows: rows 5, 6 and 13 are padding.
  std::vector<mrr::TokenKey> keys;
  for (int s = 0; s < 2; ++s)
    for (int p = 0; p < 7; ++p)
      keys.push_back(p < (s == 0 ? 5 : 6) ? mrr::TokenKey{static_cast<mrr::SequenceId>(50 + s), p} : mrr::TokenKey{});
  const mrr::TokenLayout padded(keys);
  // Another micro-batch, without padding, for a F1 F2 B1 B2 schedule.
  const auto other = mrr::test::token_layout(100, 100 + kTokens);
  RowMatrix<double> zeros = mrr::test::random_normal<double>(kTokens, kHidden, 31);
  RowMatrix<double> gy = mrr::test::random_normal<double>(kTokens, kHidden, 32);
  for (Eigen::Index r : {5, 6, 13}) {
    zeros.row(r).setZero();
    gy.row(r).setZero();
  }
  RowMatrix<double> poisoned = zeros;
  poisoned(5, 1) = std::numeric_limits<double>::quiet_NaN();
  poisoned.row(6).setConstant(std::numeric_limits<double>::infinity());
  poisoned(13, 0) = -std::numeric_limits<double>::infinity();
  const RowMatrix<double> x2 = mrr::test::random_normal<double>(kTokens, kHidden, 33);

  replay.begin_pass(mrr::TrainingPass::old_log_prob);
  replay.set_micro_batch(padded);
  const auto recorded = layer.forward(poisoned);
  CHECK(mrr::test::bitwise_equal(recorded.output, layer.forward(zeros).output));
  replay.set_micro_batch(other);
  layer.forward(x2);

  replay.set_activation_recompute(true);
  replay.begin_pass(mrr::TrainingPass::actor_update);
  replay.set_micro_batch(padded);
  const auto f = layer.forward(poisoned);
  replay.set_micro_batch(other);
  layer.forward(x2);
  const auto g = layer.backward(f, gy);
  CHECK(f.output.allFinite());
  CHECK(g.gate_weight.allFinite());
  CHECK(g.input.allFinite());
  CHECK(g.gate_weight.cwiseAbs().maxCoeff() > 0);
  for (const auto& w : g.experts.w_gate)
    CHECK(w.allFinite());
  for (const auto& w : g.experts.w_up)
    CHECK(w.allFinite());
  for (const auto& w : g.experts.w_down)
    CHECK(w.allFinite());
  // B1 recomputes F1 (padded) while the layout is F2's: the queued padding rows apply.
  replay.begin_pass(mrr::TrainingPass::actor_recompute);
  const auto b = layer.forward(poisoned);
  CHECK(mrr::test::bitwise_equal(b.output, f.output));
  const auto gb = layer.backward(b, gy);
  CHECK(mrr::test::bitwise_equal(gb.gate_weight, g.gate_weight));
  CHECK(mrr::test::bitwise_equal(gb.input, g.input));

  // Bit for bit the zero-padded input's results.
  replay.set_activation_recompute(false);
  replay.begin_pass(mrr::TrainingPass::actor_update);
  replay.set_micro_batch(padded);
  const auto fz = layer.forward(zeros);
  const auto gz = layer.backward(fz, gy);
  CHECK(mrr::test::bitwise_equal(f.output, fz.output));
  CHECK(mrr::test::bitwise_equal(g.gate_weight, gz.gate_weight));
  CHECK(mrr::test::bitwise_equal(g.input, gz.input));
  for (std::size_t e = 0; e < g.experts.w_down.size(); ++e) {
    CHECK(mrr::test::bitwise_equal(g.experts.w_gate[e], gz.experts.w_gate[e]));
    CHECK(mrr::test::bitwise_equal(g.experts.w_down[e], gz.experts.w_down[e]));
  }
  // A real row's NaN is still an error.
  RowMatrix<double> bad = zeros;
  bad(2, 3) = std::numeric_limits<double>::quiet_NaN();
  CHECK_THROWS_WITH(layer.forward(bad), doctest::Contains("nan"));
}

TEST_CASE("MoELayer applies the router's aux_loss_coeff and z_loss_coeff: values, gradients, padding rows left out") {
  for (auto config : {mrr::presets::qwen3_moe(6, 2), mrr::presets::megatron_deepseek_v3(8, 2, 4, 2, 1.5)}) {
    CAPTURE(mrr::to_string(config.score_function));
    config.aux_loss_coeff = 0.3;
    config.z_loss_coeff = 0.05;
    MoEModel<double> model = model_with(config);
    RowMatrix<double> x = mrr::test::random_normal<double>(kTokens, kHidden, 41);
    const RowMatrix<double> gy = mrr::test::random_normal<double>(kTokens, kHidden, 42);
    const mrr::SingleProcess comm;
    auto run = [&] {
      auto layer = model.layer(comm);
      return std::pair{layer.forward(x), std::move(layer)};
    };
    auto [f, layer] = run();
    // The values are Megatron's losses of the gate logits, coefficients included.
    const RowMatrix<double> logits = f.router_logits();
    const auto aux = mrr::switch_aux_loss<double>(logits, config.topk, config.score_function, 0.3);
    const auto z = mrr::z_loss<double>(logits, 0.05);
    CHECK(f.aux_loss == doctest::Approx(aux.loss).epsilon(1e-12));
    CHECK(f.z_loss == doctest::Approx(z.loss).epsilon(1e-12));
    CHECK(f.aux_loss > 0);
    CHECK((f.aux_grad_logits - aux.grad_logits - z.grad_logits).cwiseAbs().maxCoeff() < 1e-14);
    // Backward differentiates sum(output * gy) + aux_loss + z_loss.
    const auto g = layer.backward(f, gy);
    const auto eval = [&] {
      const auto r = run();
      return loss(r.first.output, gy) + r.first.aux_loss + r.first.z_loss;
    };
    check_fd(x, g.input, eval, "input");
    check_fd(model.gate, g.gate_weight, eval, "gate weight");
  }
  // Padding rows (the replay controller's layout) are not tokens of the losses.
  auto config = mrr::presets::qwen3_moe(6, 2);
  config.aux_loss_coeff = 0.3;
  config.z_loss_coeff = 0.05;
  const auto model = model_with(config);
  mrr::MemoryRouteStore store({.num_experts = 6, .num_layers = 1, .topk = 2});
  mrr::RoutingReplay replay(mrr::ReplayMode::R2, store);
  auto layer = model.layer(mrr::SingleProcess{}, &replay, 0);
  std::vector<mrr::TokenKey> keys;
  for (int p = 0; p < kTokens; ++p)
    keys.push_back(p < 10 ? mrr::TokenKey{static_cast<mrr::SequenceId>(7), p} : mrr::TokenKey{});
  replay.begin_pass(mrr::TrainingPass::old_log_prob);
  replay.set_micro_batch(mrr::TokenLayout(keys));
  const auto f = layer.forward(mrr::test::random_normal<double>(kTokens, kHidden, 43));
  const RowMatrix<double> counted = f.router_logits().topRows(10);
  CHECK(f.aux_loss ==
        doctest::Approx(mrr::switch_aux_loss<double>(counted, 2, config.score_function, 0.3).loss).epsilon(1e-12));
  CHECK(f.z_loss == doctest::Approx(mrr::z_loss<double>(counted, 0.05).loss).epsilon(1e-12));
  CHECK(f.aux_grad_logits.bottomRows(kTokens - 10).cwiseAbs().maxCoeff() == 0.0);
  CHECK(f.aux_grad_logits.topRows(10).cwiseAbs().maxCoeff() > 0.0);

  // Without coefficients: no losses, nothing added.
  const auto plain = model_with(mrr::presets::qwen3_moe(6, 2))
                         .layer(mrr::SingleProcess{})
                         .forward(mrr::test::random_normal<double>(kTokens, kHidden, 44));
  CHECK(plain.aux_grad_logits.size() == 0);
  CHECK(plain.aux_loss == 0.0);

  // The sequence loss needs the sequences' rows: the layer refuses its coefficient.
  auto seq = mrr::presets::qwen3_moe(6, 2);
  seq.seq_aux_loss_coeff = 0.1;
  CHECK_THROWS_WITH(model_with(seq).layer(mrr::SingleProcess{}), doctest::Contains("seq_aux_loss_coeff"));
}
