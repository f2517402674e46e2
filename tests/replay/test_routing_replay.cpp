// The replay controller with a real router: R2 record then replay (including the recompute
// FIFO), R3 from rollout routes with a missing last row, the reference pass, and the none store.
#include <mrr/replay.hpp>
#include <mrr/router.hpp>

#include <doctest/doctest.h>
#include <support/random.hpp>

#include <limits>
#include <random>
#include <type_traits>
#include <vector>

namespace {

mrr::RowMatrix<float> logits(Eigen::Index rows, int experts, unsigned seed, float scale = 1.0f) {
  return mrr::test::random_normal<float>(rows, experts, seed, scale);
}

// Perturbation standing in for another engine's kernels: enough to flip some decisions.
mrr::RowMatrix<float> perturbed(const mrr::RowMatrix<float>& z, unsigned seed) {
  return z + logits(z.rows(), static_cast<int>(z.cols()), seed, 0.05f);
}

int differing_rows(const mrr::ExpertIds& a, const mrr::ExpertIds& b) {
  int n = 0;
  for (Eigen::Index r = 0; r < a.rows(); ++r) n += a.row(r) != b.row(r) ? 1 : 0;
  return n;
}

}  // namespace

TEST_CASE("action table: R2 records old log-probs and replays updates, R3 replays all, ref never") {
  using mrr::RouterAction;
  using mrr::TrainingPass;
  CHECK(mrr::action_for(mrr::ReplayMode::R2, TrainingPass::old_log_prob) == RouterAction::record);
  CHECK(mrr::action_for(mrr::ReplayMode::R2, TrainingPass::actor_update) == RouterAction::replay_forward);
  CHECK(mrr::action_for(mrr::ReplayMode::R2, TrainingPass::actor_recompute) == RouterAction::replay_backward);
  CHECK(mrr::action_for(mrr::ReplayMode::R3, TrainingPass::old_log_prob) == RouterAction::replay_forward);
  CHECK(mrr::action_for(mrr::ReplayMode::R3, TrainingPass::ref_log_prob) == RouterAction::native);
  CHECK(mrr::action_for(mrr::ReplayMode::R2, TrainingPass::ref_log_prob) == RouterAction::native);
  CHECK(mrr::action_for(mrr::ReplayMode::disabled, TrainingPass::actor_update) == RouterAction::native);
  CHECK_THROWS_AS(mrr::parse_replay_mode("R4"), mrr::ConfigError);
}

TEST_CASE("R2: the update pass replays the old-log-prob routes exactly, on reshuffled micro-batches") {
  const int E = 32, k = 4, L = 2;
  std::vector<mrr::TopKRouter<float>> routers(L, mrr::TopKRouter<float>(mrr::presets::qwen3_moe(E, k)));
  mrr::MemoryRouteStore store({E, L, k});
  mrr::RoutingReplay<mrr::MemoryRouteStore> replay(mrr::ReplayMode::R2, store);

  // Old-log-prob pass: sequences 100..103, 12 tokens each, two micro-batches.
  std::vector<mrr::RowMatrix<float>> z_seq;
  for (int s = 0; s < 4; ++s) z_seq.push_back(logits(12, E, 50 + static_cast<unsigned>(s)));
  std::vector<mrr::ExpertIds> recorded(4 * L);
  replay.begin_pass(mrr::TrainingPass::old_log_prob);
  for (int mb = 0; mb < 2; ++mb) {
    const std::vector<mrr::SequenceId> uids = {100ull + 2 * mb, 101ull + 2 * mb};
    replay.set_micro_batch(mrr::TokenLayout::packed(uids, std::vector<std::int64_t>{0, 12, 24}));
    mrr::RowMatrix<float> z(24, E);
    z << z_seq[static_cast<std::size_t>(2 * mb)], z_seq[static_cast<std::size_t>(2 * mb + 1)];
    for (int l = 0; l < L; ++l) {
      const auto r = replay.route(routers[static_cast<std::size_t>(l)], l, z);
      recorded[static_cast<std::size_t>((2 * mb) * L + l)] = r.ids.topRows(12);
      recorded[static_cast<std::size_t>((2 * mb + 1) * L + l)] = r.ids.bottomRows(12);
    }
  }
  CHECK(replay.stats().recorded_rows == 4 * 12 * L);

  // Update pass: different composition (103 and 100), different logits (another "engine").
  replay.set_activation_recompute(true);
  replay.begin_pass(mrr::TrainingPass::actor_update);
  const std::vector<mrr::SequenceId> uids = {103, 100};
  replay.set_micro_batch(mrr::TokenLayout::packed(uids, std::vector<std::int64_t>{0, 12, 24}));
  mrr::RowMatrix<float> z(24, E);
  z << perturbed(z_seq[3], 1), perturbed(z_seq[0], 2);
  int flipped = 0;
  for (int l = 0; l < L; ++l) {
    const auto& router = routers[static_cast<std::size_t>(l)];
    const auto r = replay.route(router, l, z);
    CHECK(r.ids.topRows(12) == recorded[static_cast<std::size_t>(3 * L + l)]);
    CHECK(r.ids.bottomRows(12) == recorded[static_cast<std::size_t>(0 * L + l)]);
    // Weights are recomputed from the current logits at the replayed ids.
    CHECK((r.weights - router.replay(z, r.ids).weights).cwiseAbs().maxCoeff() == 0.0f);
    flipped += differing_rows(router.route(z).ids, r.ids);
    CHECK(replay.queued(l) == 1);
  }
  CHECK(replay.stats().mask_free_replays == static_cast<std::uint64_t>(L));  // every row found: no mask
  MESSAGE("native routing of the perturbed logits would have changed " << flipped << " of " << 24 * L << " rows");
  CHECK(flipped > 0);  // the perturbation matters, so the replay is doing something

  // Backward recompute consumes the queue.
  replay.begin_pass(mrr::TrainingPass::actor_recompute);
  for (int l = 0; l < L; ++l) {
    const auto r = replay.route(routers[static_cast<std::size_t>(l)], l, z);
    CHECK(r.ids.topRows(12) == recorded[static_cast<std::size_t>(3 * L + l)]);
    CHECK(replay.queued(l) == 0);
  }
  CHECK_THROWS_WITH_AS(replay.route(routers[0], 0, z), doctest::Contains("has no queued routes to recompute"),
                       mrr::RouteStoreError);
}

TEST_CASE("recompute consumes forwards first-in-first-out across micro-batches (F1 F2 B1 B2)") {
  const int E = 16, k = 2;
  mrr::TopKRouter<float> router(mrr::presets::mixtral(E, k));
  mrr::MemoryRouteStore store({E, 1, k});
  mrr::RoutingReplay<mrr::MemoryRouteStore> replay(mrr::ReplayMode::R2, store);
  replay.begin_pass(mrr::TrainingPass::old_log_prob);
  const std::vector<mrr::SequenceId> a = {1}, b = {2};
  const auto la = mrr::TokenLayout::packed(a, std::vector<std::int64_t>{0, 5});
  const auto lb = mrr::TokenLayout::packed(b, std::vector<std::int64_t>{0, 7});
  replay.set_micro_batch(la);
  const auto ra = replay.route(router, 0, logits(5, E, 1));
  replay.set_micro_batch(lb);
  const auto rb = replay.route(router, 0, logits(7, E, 2));

  replay.set_activation_recompute(true);
  replay.begin_pass(mrr::TrainingPass::actor_update);
  replay.set_micro_batch(la);
  replay.route(router, 0, logits(5, E, 3));
  replay.set_micro_batch(lb);
  replay.route(router, 0, logits(7, E, 4));
  CHECK(replay.queued(0) == 2);
  // A layer outside the model is an InvalidArgument naming it and the range, not std::out_of_range.
  CHECK_THROWS_WITH_AS(replay.queued(99), doctest::Contains("RoutingReplay::queued: layer 99 outside the store's [0, 1)"),
                       mrr::InvalidArgument);
  CHECK_THROWS_AS(replay.queued(-1), mrr::InvalidArgument);
  replay.begin_pass(mrr::TrainingPass::actor_recompute);
  CHECK(replay.route(router, 0, logits(5, E, 5)).ids == ra.ids);
  CHECK(replay.route(router, 0, logits(7, E, 6)).ids == rb.ids);
  // Recompute out of order is caught: the rows disagree.
  replay.begin_pass(mrr::TrainingPass::actor_update);
  replay.set_micro_batch(la);
  replay.route(router, 0, logits(5, E, 3));
  replay.begin_pass(mrr::TrainingPass::actor_recompute);
  CHECK_THROWS_WITH_AS(replay.route(router, 0, logits(7, E, 6)), doctest::Contains("recompute must follow the forward order"),
                       mrr::InvalidArgument);
}

TEST_CASE("the recompute takes rows its forward routed natively (R3's last position) as the forward did") {
  const int E = 16, k = 2;
  mrr::TopKRouter<float> router(mrr::presets::mixtral(E, k));
  mrr::MemoryRouteStore store({E, 1, k});
  // The rollout engine's routes for positions 0-4 of sequence 7; none for the last token (5).
  const std::vector<mrr::SequenceId> seq = {7};
  store.record(0, mrr::TokenLayout::packed(seq, std::vector<std::int64_t>{0, 5}), router.route(logits(5, E, 1)).ids);
  // The update's logits and the recompute's differ a little (the nondeterminism the recompute
  // queue absorbs); at row 5 enough to change a native choice: experts 3 and 4 there, 3 and 5 here.
  mrr::RowMatrix<float> z = logits(6, E, 2, 0.1f), zr = z;
  z(5, 3) = 3.0f;
  z(5, 4) = 2.9f;
  z(5, 5) = 2.8f;
  zr(5, 3) = 3.0f;
  zr(5, 4) = 2.8f;
  zr(5, 5) = 2.9f;
  REQUIRE(router.route(zr).ids.row(5) != router.route(z).ids.row(5));
  for (const auto missing : {mrr::MissingRoutes::native_last_position, mrr::MissingRoutes::native}) {
    mrr::RoutingReplay<mrr::MemoryRouteStore> replay(mrr::ReplayMode::R3, store, missing);
    replay.set_activation_recompute(true);
    replay.begin_pass(mrr::TrainingPass::actor_update);
    replay.set_micro_batch(mrr::TokenLayout::packed(seq, std::vector<std::int64_t>{0, 6}));
    const auto forward = replay.route(router, 0, z);
    CHECK(forward.ids.row(5) == router.route(z).ids.row(5));  // routed natively in the forward
    replay.begin_pass(mrr::TrainingPass::actor_recompute);
    const auto recompute = replay.route(router, 0, zr);
    CHECK(recompute.ids == forward.ids);  // every row, the natively routed one included
    CHECK(replay.queued(0) == 0);
  }
}

TEST_CASE("a failed recompute keeps its queued ids; revert_route undoes the last route call's queue change") {
  const int E = 16, k = 2;
  mrr::TopKRouter<float> router(mrr::presets::mixtral(E, k));
  mrr::MemoryRouteStore store({E, 2, k});
  mrr::RoutingReplay<mrr::MemoryRouteStore> replay(mrr::ReplayMode::R2, store);
  replay.begin_pass(mrr::TrainingPass::old_log_prob);
  const std::vector<mrr::SequenceId> a = {1}, b = {2};
  const auto la = mrr::TokenLayout::packed(a, std::vector<std::int64_t>{0, 5});
  const auto lb = mrr::TokenLayout::packed(b, std::vector<std::int64_t>{0, 5});
  replay.set_micro_batch(la);
  const auto ra = replay.route(router, 0, logits(5, E, 1));
  replay.route(router, 1, logits(5, E, 11));
  replay.set_micro_batch(lb);
  const auto rb = replay.route(router, 0, logits(5, E, 2));

  replay.set_activation_recompute(true);
  replay.begin_pass(mrr::TrainingPass::actor_update);
  replay.set_micro_batch(la);
  replay.route(router, 0, logits(5, E, 3));
  replay.route(router, 1, logits(5, E, 13));
  // Layer 1's forward failed after routing: only layer 1's entry goes, and only once.
  replay.revert_route(1);
  replay.revert_route(1);
  CHECK(replay.queued(0) == 1);
  CHECK(replay.queued(1) == 0);
  replay.set_micro_batch(lb);
  replay.route(router, 0, logits(5, E, 4));
  replay.revert_route(0);  // B's forward failed: A's entry stays
  CHECK(replay.queued(0) == 1);

  replay.begin_pass(mrr::TrainingPass::actor_recompute);
  // A recompute whose replay fails (a NaN in a real token) takes nothing.
  mrr::RowMatrix<float> bad = logits(5, E, 5);
  bad.row(2).setConstant(std::numeric_limits<float>::quiet_NaN());
  CHECK_THROWS_WITH_AS(replay.route(router, 0, bad), doctest::Contains("nan"), mrr::InvalidArgument);
  CHECK(replay.queued(0) == 1);
  // One that fails after its replay gets its ids back, in front.
  replay.begin_pass(mrr::TrainingPass::actor_update);
  replay.set_micro_batch(lb);
  replay.route(router, 0, logits(5, E, 6));
  CHECK(replay.queued(0) == 2);
  replay.begin_pass(mrr::TrainingPass::actor_recompute);
  CHECK(replay.route(router, 0, logits(5, E, 7)).ids == ra.ids);
  replay.revert_route(0);
  CHECK(replay.queued(0) == 2);
  CHECK(replay.route(router, 0, logits(5, E, 7)).ids == ra.ids);
  CHECK(replay.route(router, 0, logits(5, E, 8)).ids == rb.ids);
  CHECK(replay.queued(0) == 0);
  CHECK_THROWS_AS(replay.revert_route(2), mrr::InvalidArgument);
}

TEST_CASE("a recompute cleans the padding rows of the forward it replays, not the current micro-batch's") {
  // F1 F2 B1 B2 with padded micro-batches: during B1 the layout is still mb2's. mb1's row 3 is
  // padding holding NaN (allowed) where mb2 has a real token; mb2's row 0 is padding where mb1 has
  // a real token. B1 must route exactly as F1 did, and a failed recompute takes nothing.
  const int E = 16, k = 2;
  mrr::TopKRouter<float> router(mrr::presets::qwen2_moe(E, k, false));
  mrr::MemoryRouteStore store({E, 1, k});
  mrr::RoutingReplay<mrr::MemoryRouteStore> replay(mrr::ReplayMode::R2, store);
  const mrr::TokenLayout mb1({{1, 0}, {1, 1}, {1, 2}, {1, -1}});
  const mrr::TokenLayout mb2({{2, -1}, {2, 0}, {2, 1}, {2, 2}});
  auto z1 = logits(4, E, 11);
  z1.row(3).setConstant(std::numeric_limits<float>::quiet_NaN());
  auto z2 = logits(4, E, 12);
  z2.row(0).setConstant(std::numeric_limits<float>::quiet_NaN());
  replay.begin_pass(mrr::TrainingPass::old_log_prob);
  replay.set_micro_batch(mb1);
  (void)replay.route(router, 0, z1);
  replay.set_micro_batch(mb2);
  (void)replay.route(router, 0, z2);

  replay.set_activation_recompute(true);
  replay.begin_pass(mrr::TrainingPass::actor_update);
  replay.set_micro_batch(mb1);
  const auto f1 = replay.route(router, 0, z1);
  replay.set_micro_batch(mb2);
  const auto f2 = replay.route(router, 0, z2);
  replay.begin_pass(mrr::TrainingPass::actor_recompute);
  CHECK_THROWS_WITH_AS(replay.route(router, 0, logits(3, E, 13)), doctest::Contains("recompute must follow"),
                       mrr::InvalidArgument);
  CHECK(replay.queued(0) == 2);  // the failed recompute took nothing
  const auto b1 = replay.route(router, 0, z1);
  const auto b2 = replay.route(router, 0, z2);
  CHECK(b1.ids == f1.ids);
  CHECK(b1.weights == f1.weights);
  CHECK(b2.ids == f2.ids);
  CHECK(b2.weights == f2.weights);
  CHECK(replay.queued(0) == 0);
}

TEST_CASE("R2: a token without a recorded route is an error, never a silent native route") {
  const int E = 16, k = 2;
  mrr::TopKRouter<float> router(mrr::presets::mixtral(E, k));
  mrr::MemoryRouteStore store({E, 1, k});
  mrr::RoutingReplay<mrr::MemoryRouteStore> replay(mrr::ReplayMode::R2, store);
  replay.begin_pass(mrr::TrainingPass::actor_update);
  const std::vector<mrr::SequenceId> uids = {42};
  replay.set_micro_batch(mrr::TokenLayout::packed(uids, std::vector<std::int64_t>{0, 3}));
  CHECK_THROWS_WITH_AS(replay.route(router, 0, logits(3, E, 1)),
                       doctest::Contains("no recorded route for sequence 42 position 0"), mrr::RouteStoreError);
  replay.set_micro_batch(mrr::TokenLayout::packed(uids, std::vector<std::int64_t>{0, 2}));
  CHECK_THROWS_WITH_AS(replay.route(router, 0, logits(3, E, 1)), doctest::Contains("call set_micro_batch"),
                       mrr::InvalidArgument);
}

TEST_CASE("R3: rollout routes with n-1 rows replay every token but the last, which routes natively") {
  const int E = 8, k = 2, L = 2, n = 6;
  mrr::TopKRouter<float> router(mrr::presets::mixtral(E, k));
  mrr::MemoryRouteStore store({E, L, k});
  // The rollout engine's routed_experts for sequence 7: [n - 1, L, k].
  std::vector<std::int32_t> routed;
  for (int t = 0; t < n - 1; ++t)
    for (int l = 0; l < L; ++l) {
      routed.push_back((t + l) % E);
      routed.push_back((t + l + 3) % E);
    }
  mrr::import_routed_experts<mrr::MemoryRouteStore, std::int32_t>(store, 7, routed, n - 1, L, k);
  mrr::RoutingReplay<mrr::MemoryRouteStore> replay(mrr::ReplayMode::R3, store);
  replay.begin_pass(mrr::TrainingPass::old_log_prob);
  const std::vector<mrr::SequenceId> uids = {7};
  replay.set_micro_batch(mrr::TokenLayout::packed(uids, std::vector<std::int64_t>{0, n}));
  const auto z = logits(n, E, 9);
  for (int l = 0; l < L; ++l) {
    const auto r = replay.route(router, l, z);
    for (int t = 0; t < n - 1; ++t) {
      CHECK(r.ids(t, 0) == (t + l) % E);
      CHECK(r.ids(t, 1) == (t + l + 3) % E);
    }
    CHECK(r.ids.row(n - 1) == router.route(z).ids.row(n - 1));
    CHECK(replay.queued(l) == 0);  // the old-log-prob pass keeps nothing for recompute
  }
  CHECK(replay.stats().native_rows == L);
  CHECK(replay.stats().mask_free_replays == 0);  // the last token routes natively: the mask is needed
  // A training sequence longer than the rollout is an error beyond the final token.
  replay.set_micro_batch(mrr::TokenLayout::packed(uids, std::vector<std::int64_t>{0, n + 1}));
  CHECK_THROWS_AS(replay.route(router, 0, logits(n + 1, E, 9)), mrr::RouteStoreError);
  // The reference policy is never replayed.
  replay.begin_pass(mrr::TrainingPass::ref_log_prob);
  CHECK(replay.route(router, 0, z).ids == router.route(z).ids);
}

TEST_CASE("the none store compiles replay out: an empty controller that routes natively") {
  static_assert(std::is_empty_v<mrr::RoutingReplay<mrr::NoRouteStore>>);
  mrr::RoutingReplay<mrr::NoRouteStore> replay;
  mrr::TopKRouter<float> router(mrr::presets::mixtral(8, 2));
  mrr::ReplayRouter<mrr::TopKRouter<float>, mrr::NoRouteStore> layer(router, replay, 0);
  const auto z = logits(10, 8, 4);
  replay.begin_pass(mrr::TrainingPass::actor_update);
  CHECK(layer.forward(z).ids == router.route(z).ids);
  CHECK_THROWS_AS(mrr::RoutingReplay<mrr::NoRouteStore>(mrr::ReplayMode::R2), mrr::ConfigError);
  mrr::MemoryRouteStore store({8, 1, 2});
  mrr::RoutingReplay<mrr::MemoryRouteStore> disabled(mrr::ReplayMode::disabled, store);
  CHECK_THROWS_AS(disabled.set_action(mrr::RouterAction::record), mrr::ConfigError);
}

TEST_CASE("ReplayRouter: gradients flow through replayed routes") {
  const int E = 12, k = 3;
  mrr::MemoryRouteStore store({E, 1, k});
  mrr::RoutingReplay<mrr::MemoryRouteStore> replay(mrr::ReplayMode::R2, store);
  mrr::ReplayRouter<mrr::TopKRouter<float>, mrr::MemoryRouteStore> layer(
      mrr::TopKRouter<float>(mrr::presets::megatron_deepseek_v3(E, k, 4, 2, 2.5)), replay, 0);
  const std::vector<mrr::SequenceId> uids = {5};
  replay.set_micro_batch(mrr::TokenLayout::packed(uids, std::vector<std::int64_t>{0, 4}));
  replay.begin_pass(mrr::TrainingPass::old_log_prob);
  const auto z = logits(4, E, 13);
  const auto rec = layer.forward(z);
  replay.begin_pass(mrr::TrainingPass::actor_update);
  const auto z2 = perturbed(z, 14);
  const auto r = layer.forward(z2);
  CHECK(r.ids == rec.ids);
  // (Ones would give zero: normalised weights sum to the scaling factor whatever the logits.)
  const mrr::RowMatrix<float> g = logits(4, k, 15);
  const auto grad = layer.backward(z2, r, g);
  CHECK(grad.cwiseAbs().maxCoeff() > 0.0f);
  // Only replayed experts receive gradient (sigmoid scores, normalised).
  for (int t = 0; t < 4; ++t)
    for (int e = 0; e < E; ++e) {
      bool routed = false;
      for (int j = 0; j < k; ++j) routed = routed || r.ids(t, j) == e;
      if (!routed) CHECK(grad(t, e) == 0.0f);
    }
}

TEST_CASE("activation recompute is off by default: update passes queue nothing, a recompute says what to switch on") {
  const int E = 16, k = 2;
  mrr::TopKRouter<float> router(mrr::presets::mixtral(E, k));
  mrr::MemoryRouteStore store({E, 1, k});
  mrr::RoutingReplay<mrr::MemoryRouteStore> replay(mrr::ReplayMode::R2, store);
  CHECK_FALSE(replay.activation_recompute());
  const std::vector<mrr::SequenceId> a = {1};
  replay.set_micro_batch(mrr::TokenLayout::packed(a, std::vector<std::int64_t>{0, 5}));
  replay.begin_pass(mrr::TrainingPass::old_log_prob);
  replay.route(router, 0, logits(5, E, 1));
  // A trainer that keeps activations runs many update micro-batches: nothing piles up.
  replay.begin_pass(mrr::TrainingPass::actor_update);
  for (int mb = 0; mb < 32; ++mb) replay.route(router, 0, logits(5, E, 2 + static_cast<unsigned>(mb)));
  CHECK(replay.queued(0) == 0);
  replay.begin_pass(mrr::TrainingPass::actor_recompute);
  CHECK_THROWS_WITH_AS(replay.route(router, 0, logits(5, E, 3)), doctest::Contains("call set_activation_recompute(true)"),
                       mrr::RouteStoreError);
  // Switched on inside an update pass already begun, it applies to that pass's next forwards;
  // a low-level set_action is not a pass, so the switch leaves its queueing alone.
  replay.begin_pass(mrr::TrainingPass::actor_update);
  replay.set_activation_recompute(true);
  replay.route(router, 0, logits(5, E, 4));
  CHECK(replay.queued(0) == 1);
  replay.set_activation_recompute(false);
  replay.route(router, 0, logits(5, E, 5));
  CHECK(replay.queued(0) == 1);
  replay.set_action(mrr::RouterAction::replay_forward, /*queue_for_recompute=*/false);
  replay.set_activation_recompute(true);
  replay.route(router, 0, logits(5, E, 6));
  CHECK(replay.queued(0) == 1);
}

TEST_CASE(
    "partial recompute (48 layers, 64 experts, the first 16 recomputed): only those layers queue, and their "
    "recomputes replay the update forwards exactly") {
  const int E = 64, k = 8, L = 48, recomputed = 16, micro_batches = 8;
  const mrr::TopKRouter<float> router(mrr::presets::qwen3_moe(E, k));
  mrr::MemoryRouteStore store({E, L, k});
  mrr::RoutingReplay<mrr::MemoryRouteStore> replay(mrr::ReplayMode::R2, store);
  std::vector<int> layers;
  for (int l = 0; l < recomputed; ++l)
    layers.push_back(l);  // Megatron's recompute_method "block"
  const auto layout = [](int mb) {
    const std::vector<mrr::SequenceId> uids = {static_cast<mrr::SequenceId>(1000 + mb)};
    return mrr::TokenLayout::packed(uids, std::vector<std::int64_t>{0, 96});
  };
  const auto z = [](int mb, int l, unsigned engine) {
    return perturbed(logits(96, E, 7000u + static_cast<unsigned>(mb * L + l)), engine + static_cast<unsigned>(l));
  };
  replay.begin_pass(mrr::TrainingPass::old_log_prob);
  for (int mb = 0; mb < micro_batches; ++mb) {
    replay.set_micro_batch(layout(mb));
    for (int l = 0; l < L; ++l)
      replay.route(router, l, z(mb, l, 1));
  }
  replay.set_activation_recompute(layers);
  CHECK(replay.activation_recompute());
  CHECK(replay.activation_recompute(0));
  CHECK(replay.activation_recompute(recomputed - 1));
  CHECK_FALSE(replay.activation_recompute(recomputed));
  // Update forwards of every micro-batch (no recompute in between, as a pipeline's warm-up).
  replay.begin_pass(mrr::TrainingPass::actor_update);
  std::vector<mrr::ExpertIds> update_ids;
  for (int mb = 0; mb < micro_batches; ++mb) {
    replay.set_micro_batch(layout(mb));
    for (int l = 0; l < L; ++l)
      update_ids.push_back(replay.route(router, l, z(mb, l, 2)).ids);
  }
  for (int l = 0; l < L; ++l)
    CHECK(replay.queued(l) == (l < recomputed ? micro_batches : 0u));
  // The recomputes, in forward order, route each micro-batch as its update forward did although
  // a third engine's logits would route many rows otherwise.
  replay.begin_pass(mrr::TrainingPass::actor_recompute);
  int rerouted_natively = 0;
  for (int mb = 0; mb < micro_batches; ++mb)
    for (int l = 0; l < recomputed; ++l) {
      const auto third = z(mb, l, 3);
      CHECK(replay.route(router, l, third).ids == update_ids[static_cast<std::size_t>(mb * L + l)]);
      rerouted_natively += differing_rows(router.route(third).ids, update_ids[static_cast<std::size_t>(mb * L + l)]);
    }
  CHECK(rerouted_natively > 0);
  for (int l = 0; l < L; ++l)
    CHECK(replay.queued(l) == 0);
  // A recompute of a layer that was not named says so.
  CHECK_THROWS_WITH_AS(replay.route(router, recomputed, z(0, recomputed, 3)),
                       doctest::Contains("not among those set_activation_recompute(layers) named"),
                       mrr::RouteStoreError);
  // Layers outside the store are refused before anything changes; an empty list switches it off,
  // true switches every layer on.
  const std::vector<int> outside = {3, L};
  CHECK_THROWS_WITH_AS(replay.set_activation_recompute(outside),
                       doctest::Contains("layer 48 outside the store's [0, 48)"), mrr::InvalidArgument);
  CHECK(replay.activation_recompute(3));
  CHECK_FALSE(replay.activation_recompute(20));
  replay.set_activation_recompute(std::vector<int>{});
  CHECK_FALSE(replay.activation_recompute());
  CHECK_FALSE(replay.activation_recompute(3));
  replay.set_activation_recompute(true);
  CHECK(replay.activation_recompute(L - 1));
  replay.begin_pass(mrr::TrainingPass::actor_update);
  replay.set_micro_batch(layout(0));
  for (int l = 0; l < L; ++l)
    replay.route(router, l, z(0, l, 4));
  for (int l = 0; l < L; ++l)
    CHECK(replay.queued(l) == 1);
}

TEST_CASE("replay passes no mask when every row has a route, and the masked path when padding or a miss needs it") {
  const int E = 32, k = 4;
  const mrr::TopKRouter<float> router(mrr::presets::qwen3_moe(E, k));
  mrr::MemoryRouteStore store({E, 1, k});
  mrr::RoutingReplay<mrr::MemoryRouteStore> replay(mrr::ReplayMode::R2, store);
  const std::vector<mrr::SequenceId> uids = {5};
  const auto full = mrr::TokenLayout::packed(uids, std::vector<std::int64_t>{0, 64});
  replay.set_micro_batch(full);
  replay.begin_pass(mrr::TrainingPass::old_log_prob);
  const auto z = logits(64, E, 11);
  const auto recorded = replay.route(router, 0, z);
  replay.begin_pass(mrr::TrainingPass::actor_update);
  const auto z2 = perturbed(z, 12);
  const auto fast = replay.route(router, 0, z2);
  CHECK(replay.stats().mask_free_replays == 1);
  CHECK(fast.ids == recorded.ids);
  // Same ids and bitwise the same weights as the masked path with an all-ones mask.
  const std::vector<std::uint8_t> ones(64, 1);
  const auto masked = router.replay(z2, recorded.ids, ones);
  CHECK(masked.ids == fast.ids);
  CHECK((masked.weights.array() == fast.weights.array()).all());
  // Padding rows need the mask (they route natively, unrecorded).
  std::vector<mrr::TokenKey> rows;
  for (int t = 0; t < 64; ++t) rows.push_back({5, t});
  rows.push_back({0, -1});
  replay.set_micro_batch(mrr::TokenLayout(rows));
  mrr::RowMatrix<float> z3(65, E);
  z3 << z2, logits(1, E, 13);
  const auto padded = replay.route(router, 0, z3);
  CHECK(replay.stats().mask_free_replays == 1);
  CHECK(padded.ids.topRows(64) == recorded.ids);
}

TEST_CASE("a NaN in a padding row's logits is not an error: the row is never recorded or used") {
  const int E = 16, k = 2;
  const mrr::TopKRouter<float> router(mrr::presets::mixtral(E, k));
  mrr::MemoryRouteStore store({E, 1, k});
  mrr::RoutingReplay<mrr::MemoryRouteStore> replay(mrr::ReplayMode::R2, store);
  const std::vector<mrr::TokenKey> rows = {{3, 0}, {0, -1}, {3, 1}, {0, -1}};
  replay.set_micro_batch(mrr::TokenLayout(rows));
  mrr::RowMatrix<float> z = logits(4, E, 21);
  z.row(1).setConstant(std::numeric_limits<float>::quiet_NaN());
  z(3, 5) = std::numeric_limits<float>::infinity();
  replay.begin_pass(mrr::TrainingPass::old_log_prob);
  const auto recorded = replay.route(router, 0, z);
  CHECK(recorded.ids.row(0) == router.route(z.topRows(1)).ids.row(0));
  CHECK(recorded.weights.allFinite());
  CHECK(replay.stats().recorded_rows == 2);
  replay.begin_pass(mrr::TrainingPass::actor_update);
  CHECK(replay.route(router, 0, z).ids.row(2) == recorded.ids.row(2));
  replay.begin_pass(mrr::TrainingPass::ref_log_prob);
  CHECK_NOTHROW(replay.route(router, 0, z));
  // In a real token's row a NaN stays an error.
  z(2, 0) = std::numeric_limits<float>::quiet_NaN();
  CHECK_THROWS_AS(replay.route(router, 0, z), mrr::InvalidArgument);
}
