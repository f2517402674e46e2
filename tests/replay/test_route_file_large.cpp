// Route files at real sizes: hundreds of MB, far past every internal buffer and chunk, written
// the ways R2 (a layer at a time) and R3 (whole sequences, all layers) write them, and read back
// through every path (the writer itself while it writes, a reader scanning a file still being
// written, a reader using the index, an appender, sequence(), RoutingReplay) with every id
// compared to the id recorded. Ids come from a formula, so nothing is stored twice in memory.
#include <mrr/replay.hpp>
#include <mrr/router.hpp>

#include <doctest/doctest.h>
#include <support/random.hpp>

#include "temp_dir.hpp"

#include <cstdint>
#include <filesystem>
#include <vector>

namespace {

// The id recorded for (uid, position, layer, slot): a mixed hash per row, then slots 256 / k
// apart, so a row's k ids are distinct (as a router's are) and every row differs from its
// neighbours.
std::int32_t expected_id(std::uint64_t uid, std::int64_t pos, int layer, int slot, int experts, int k) {
  std::uint64_t h = uid * 0x9E3779B97F4A7C15ull ^ static_cast<std::uint64_t>(pos) * 0xC2B2AE3D27D4EB4Full ^
                    static_cast<std::uint64_t>(layer) * 0x165667B19E3779F9ull;
  h ^= h >> 29;
  h *= 0xBF58476D1CE4E5B9ull;
  h ^= h >> 32;
  return static_cast<std::int32_t>((h + static_cast<std::uint64_t>(slot) * static_cast<std::uint64_t>(experts / k)) %
                                   static_cast<std::uint64_t>(experts));
}

// Every id of layer `layer` for positions [first, first + n) of `uid`, [n][k].
mrr::ExpertIds expected_rows(std::uint64_t uid, std::int64_t first, std::int64_t n, int layer, int experts, int k) {
  mrr::ExpertIds ids(n, k);
  for (std::int64_t t = 0; t < n; ++t)
    for (int j = 0; j < k; ++j) ids(t, j) = expected_id(uid, first + t, layer, j, experts, k);
  return ids;
}

mrr::TokenLayout span_layout(std::uint64_t uid, std::int64_t first, std::int64_t n) {
  std::vector<mrr::TokenKey> rows(static_cast<std::size_t>(n));
  for (std::int64_t t = 0; t < n; ++t) rows[static_cast<std::size_t>(t)] = {uid, first + t};
  return mrr::TokenLayout(std::move(rows));
}

// Looks up layer `layer` of [first, first + n) of `uid` into `Id` ids and counts ids differing
// from the formula (rows not found count k each).
template <class Id = std::int32_t, class Store>
std::int64_t wrong_ids(const Store& store, std::uint64_t uid, std::int64_t first, std::int64_t n, int layer) {
  const int experts = store.shape().num_experts, k = store.shape().topk;
  mrr::RowMatrix<Id> got;
  std::vector<std::uint8_t> found;
  const std::size_t hits = store.lookup(layer, span_layout(uid, first, n), got, found);
  std::int64_t wrong = (n - static_cast<std::int64_t>(hits)) * k;
  for (std::int64_t t = 0; t < n; ++t)
    if (found[static_cast<std::size_t>(t)] != 0)
      for (int j = 0; j < k; ++j)
        wrong += static_cast<std::int64_t>(got(t, j)) != expected_id(uid, first + t, layer, j, experts, k);
  return wrong;
}

}  // namespace

TEST_CASE("a writer reads back what it recorded after the file passed every internal buffer (issue's minimal case)") {
  mrr::test::TempDir dir;
  const int E = 64;
  auto store = mrr::FileRouteStore::create(dir / "r.mrr", {E, 1, 1});
  const std::vector<std::int32_t> five = {5};
  store.record_sequence(1, 0, 1, 0, 1, five);
  const std::int64_t n = 3'000'000;  // 3 MB of ids: past the old 1 MiB read mapping, 11 read chunks
  std::vector<std::int32_t> ids(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) ids[static_cast<std::size_t>(i)] = static_cast<std::int32_t>((7 * i + 3) % E);
  store.record_sequence(2, 0, n, 0, 1, ids);

  mrr::ExpertIds got;
  std::vector<std::uint8_t> found;
  CHECK(store.lookup(0, span_layout(2, n - 16, 16), got, found) == 16);
  for (std::int64_t t = 0; t < 16; ++t) CHECK(got(t, 0) == (7 * (n - 16 + t) + 3) % E);
  // Every id, in one lookup and through sequence().
  REQUIRE(store.lookup(0, span_layout(2, 0, n), got, found) == static_cast<std::size_t>(n));
  std::int64_t wrong = 0;
  for (std::int64_t t = 0; t < n; ++t) wrong += got(t, 0) != ids[static_cast<std::size_t>(t)];
  CHECK(wrong == 0);
  const mrr::SequenceRoutes* seq = store.sequence(2);
  REQUIRE(seq != nullptr);
  std::int32_t one = -1;
  wrong = 0;
  for (std::int64_t t = 0; t < n; t += 997) wrong += !seq->get(t, 0, &one) || one != ids[static_cast<std::size_t>(t)];
  CHECK(wrong == 0);
  CHECK(store.lookup(0, span_layout(1, 0, 1), got, found) == 1);
  CHECK(got(0, 0) == 5);
}

TEST_CASE("a 256 MB route file (48 layers, 256 experts, k = 8): every id read equals the id recorded, on every path") {
  mrr::test::TempDir dir;
  const int E = 256, L = 48, k = 8;
  const std::int64_t T = 8192;        // tokens per sequence
  const int sequences = 86;           // 86 x 8192 x 48 x 8 bytes = 270 MB of ids
  const std::filesystem::path path = dir / "big.mrr";
  auto writer = mrr::FileRouteStore::create(path, {E, L, k});

  std::vector<std::int32_t> block;
  for (int s = 0; s < sequences; ++s) {
    const auto uid = static_cast<std::uint64_t>(1000 + s);
    if (s % 2 == 0) {
      // R2: the old-log-prob pass records each layer of a micro-batch (two half-sequences here).
      for (int half = 0; half < 2; ++half) {
        const std::int64_t first = half * T / 2;
        const auto layout = span_layout(uid, first, T / 2);
        for (int l = 0; l < L; ++l) writer.record(l, layout, expected_rows(uid, first, T / 2, l, E, k));
      }
    } else {
      // R3: a rollout engine's routed_experts, [tokens][layers][k], one call per sequence.
      block.resize(static_cast<std::size_t>(T * L * k));
      for (std::int64_t t = 0; t < T; ++t)
        for (int l = 0; l < L; ++l)
          for (int j = 0; j < k; ++j)
            block[static_cast<std::size_t>((t * L + l) * k + j)] = expected_id(uid, t, l, j, E, k);
      writer.record_sequence(uid, 0, T, 0, L, block);
    }
    // The writer reads back, while it writes, a slice of an earlier sequence and of this one.
    const auto earlier = static_cast<std::uint64_t>(1000 + s / 2);
    CHECK(wrong_ids(writer, earlier, 777, 300, s % L) == 0);
    CHECK(wrong_ids(writer, uid, T - 64, 64, L - 1) == 0);
  }
  const auto bytes = std::filesystem::file_size(path);
  MESSAGE("route file of " << bytes / (1 << 20) << " MiB");
  REQUIRE(bytes >= (std::uintmax_t{256} << 20));

  // A reader opened while the writer is still open finds no index and scans every record.
  {
    const auto reader = mrr::FileRouteStore::open(path, mrr::RouteShape{E, L, k});
    CHECK_FALSE(reader.recovery().opened_from_index);
    CHECK(reader.recovery().records == static_cast<std::uint64_t>(sequences / 2 * 2 * L + sequences / 2));
    std::int64_t wrong = 0;
    for (int s = 0; s < sequences; s += 5) wrong += wrong_ids(reader, 1000u + static_cast<unsigned>(s), 0, T, s % L);
    CHECK(wrong == 0);
  }
  writer.close();
  // The writer still reads after close().
  CHECK(wrong_ids(writer, 1000, 0, T, 0) == 0);

  // Through the index: every id of every sequence and layer, half of the layers into 1-byte ids
  // (each record read first by whichever lookup comes first), then all of them again the other way.
  const auto reader = mrr::FileRouteStore::open(path, mrr::RouteShape{E, L, k});
  CHECK(reader.recovery().opened_from_index);
  std::int64_t wrong = 0;
  for (int pass = 0; pass < 2; ++pass) {
    for (int s = 0; s < sequences; ++s)
      for (int l = 0; l < L; ++l) {
        const auto uid = 1000u + static_cast<unsigned>(s);
        wrong += (l + pass) % 2 == 0 ? wrong_ids(reader, uid, 0, T, l) : wrong_ids<std::uint8_t>(reader, uid, 0, T, l);
      }
    reader.release_cache();
  }
  CHECK(wrong == 0);
  // The R3 records (3 MiB each, kept whole by lookups) through a read cache of two of them: layer by
  // layer across all sequences, every lookup lets an older record go and reads the next again.
  {
    const auto small =
        mrr::FileRouteStore::open(path, mrr::RouteShape{E, L, k}, {.read_cache_bytes = std::size_t{7} << 20});
    wrong = 0;
    for (int l : {0, 1, 47})
      for (int s = 1; s < sequences; s += 2) {
        wrong += wrong_ids(small, 1000u + static_cast<unsigned>(s), 0, T, l);
        CHECK(small.read_cache_used() <= (std::size_t{7} << 20));
      }
    CHECK(small.read_cache_used() > (std::size_t{3} << 20));
    CHECK(wrong == 0);
  }

  // A micro-batch mixing sequences, reversed positions and padding, as a reshuffled update pass.
  std::vector<mrr::TokenKey> mixed;
  for (int s = sequences - 1; s >= 0; s -= 7)
    for (std::int64_t t = T - 1; t >= 0; t -= 61) {
      mixed.push_back({1000u + static_cast<unsigned>(s), t});
      if (t % 5 == 0) mixed.push_back({0, -1});
    }
  mrr::ExpertIds got;
  std::vector<std::uint8_t> found;
  const mrr::TokenLayout mixed_layout(mixed);
  for (int l : {0, 17, 47}) {
    reader.lookup(l, mixed_layout, got, found);
    wrong = 0;
    for (std::size_t r = 0; r < mixed.size(); ++r) {
      if (mixed[r].is_padding()) {
        wrong += found[r] != 0;
        continue;
      }
      for (int j = 0; j < k; ++j)
        wrong += got(static_cast<Eigen::Index>(r), j) != expected_id(mixed[r].uid, mixed[r].position, l, j, E, k);
    }
    CHECK(wrong == 0);
  }

  // sequence() of an R2 and an R3 sequence, every row.
  for (int s : {0, sequences - 1}) {
    const mrr::SequenceRoutes* seq = reader.sequence(1000u + static_cast<unsigned>(s));
    REQUIRE(seq != nullptr);
    std::int32_t row[k];
    wrong = 0;
    for (std::int64_t t = 0; t < T; ++t)
      for (int l = 0; l < L; ++l) {
        if (!seq->get(t, l, row)) {
          ++wrong;
          continue;
        }
        for (int j = 0; j < k; ++j) wrong += row[j] != expected_id(1000u + static_cast<unsigned>(s), t, l, j, E, k);
      }
    CHECK(wrong == 0);
  }

  // Appending: new records after the old index, old and new read back by the appender and by a
  // fresh reader.
  {
    auto appender = mrr::FileRouteStore::append(path, {E, L, k});
    CHECK(appender.recovery().opened_from_index);
    const std::uint64_t uid = 5000;
    for (int l = 0; l < L; ++l) appender.record(l, span_layout(uid, 0, T), expected_rows(uid, 0, T, l, E, k));
    CHECK(wrong_ids(appender, uid, 0, T, 31) == 0);
    CHECK(wrong_ids(appender, 1001, 0, T, 31) == 0);
  }
  const auto again = mrr::FileRouteStore::open(path, mrr::RouteShape{E, L, k});
  CHECK(again.recovery().opened_from_index);
  CHECK(wrong_ids(again, 5000, 0, T, 0) == 0);
  CHECK(wrong_ids(again, 1000u + sequences - 1, 0, T, 47) == 0);
}

TEST_CASE("RoutingReplay R2 through a FileRouteStore: many MB recorded, every replayed route is the one recorded") {
  mrr::test::TempDir dir;
  const int E = 64, k = 8, L = 4;
  const mrr::TopKRouter<float> router(mrr::presets::qwen3_moe(E, k));
  auto store = mrr::FileRouteStore::create(dir / "r2.mrr", {E, L, k});
  mrr::RoutingReplay<mrr::FileRouteStore> replay(mrr::ReplayMode::R2, store);
  const int seqs = 64;
  const std::int64_t len = 2048;  // 64 x 2048 x 4 layers x 8 = 4 MiB of ids
  std::vector<mrr::ExpertIds> recorded(static_cast<std::size_t>(seqs * L));
  auto logits = [&](int s) { return mrr::test::random_normal<float>(len, E, 900 + static_cast<unsigned>(s)); };

  replay.begin_pass(mrr::TrainingPass::old_log_prob);
  for (int s = 0; s < seqs; ++s) {
    const std::vector<mrr::SequenceId> uid = {static_cast<mrr::SequenceId>(s)};
    replay.set_micro_batch(mrr::TokenLayout::packed(uid, std::vector<std::int64_t>{0, len}));
    const auto z = logits(s);
    for (int l = 0; l < L; ++l) recorded[static_cast<std::size_t>(s * L + l)] = replay.route(router, l, z).ids;
  }
  CHECK(std::filesystem::file_size(dir / "r2.mrr") > (std::uintmax_t{4} << 20));

  // Update pass, sequences in another order with other logits: every id is the recorded one.
  replay.begin_pass(mrr::TrainingPass::actor_update);
  std::int64_t wrong = 0;
  for (int s = seqs - 1; s >= 0; --s) {
    const std::vector<mrr::SequenceId> uid = {static_cast<mrr::SequenceId>(s)};
    replay.set_micro_batch(mrr::TokenLayout::packed(uid, std::vector<std::int64_t>{0, len}));
    const auto z = logits(s + 1000);
    for (int l = 0; l < L; ++l)
      wrong += (replay.route(router, l, z).ids.array() != recorded[static_cast<std::size_t>(s * L + l)].array()).count();
  }
  CHECK(wrong == 0);
}
