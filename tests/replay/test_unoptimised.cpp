// Built without optimisation (-O0), as a Debug build of a user's trainer is: GCC then keeps every
// load as written, and XXH3's AVX2 kernel (picked at run time on x86-64 baseline builds) faulted
// on accumulators XXH3's streaming update had copied to a stack array aligned for SSE2 only: a
// route file segfaulted when it was closed. Optimised builds folded those loads into unaligned
// forms and never showed it.
#include <mrr/mrr.hpp>

#include <doctest/doctest.h>

#include "temp_dir.hpp"

#include <cstdint>
#include <vector>

TEST_CASE("-O0: XXH3 in pieces through detail::xxh3_update equals the one-shot hash, both kernels") {
  std::vector<unsigned char> bytes(5000);
  for (std::size_t i = 0; i < bytes.size(); ++i)
    bytes[i] = static_cast<unsigned char>(i * 131 + 7);
  for (const std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{255}, std::size_t{256}, std::size_t{1024},
                              std::size_t{1025}, std::size_t{4999}}) {
    for (const bool portable : {false, true}) {
      CAPTURE(n);
      CAPTURE(portable);
      XXH3_state_t state;
      REQUIRE(XXH3_64bits_reset(&state) == XXH_OK);
      const std::size_t half = n / 3;
      mrr::detail::xxh3_update(&state, bytes.data(), half, portable);
      mrr::detail::xxh3_update(&state, bytes.data() + half, n - half, portable);
      CHECK(XXH3_64bits_digest(&state) == XXH3_64bits(bytes.data(), n));
    }
  }
}

TEST_CASE("-O0: a route file is written, closed, opened and replayed") {
  mrr::test::TempDir dir;
  const auto path = dir / "routes.mrr";
  mrr::TopKRouter<float> router(mrr::presets::qwen3_moe(64, 8));
  const std::vector<mrr::SequenceId> uids = {101, 102};
  const auto layout = mrr::TokenLayout::packed(uids, std::vector<std::int64_t>{0, 300, 600});
  const mrr::RowMatrix<float> logits = mrr::RowMatrix<float>::Random(600, 64);
  mrr::RowMatrix<std::int32_t> recorded;
  {
    auto store = mrr::FileRouteStore::create(path, {64, 2, 8});
    mrr::RoutingReplay<mrr::FileRouteStore> replay(mrr::ReplayMode::R2, store);
    replay.set_micro_batch(layout);
    replay.begin_pass(mrr::TrainingPass::old_log_prob);
    recorded = replay.route(router, 0, logits).ids.cast<std::int32_t>();
    replay.route(router, 1, logits);
  }  // closed: index and tail written, every record hashed
  auto store = mrr::FileRouteStore::open(path, mrr::RouteShape{64, 2, 8});
  CHECK(store.recovery().clean());
  mrr::RoutingReplay<mrr::FileRouteStore> replay(mrr::ReplayMode::R2, store);
  replay.set_micro_batch(layout);
  replay.begin_pass(mrr::TrainingPass::actor_update);
  const mrr::RowMatrix<float> drifted = logits + 0.5f * mrr::RowMatrix<float>::Random(600, 64);
  CHECK(replay.route(router, 0, drifted).ids.cast<std::int32_t>() == recorded);
}
