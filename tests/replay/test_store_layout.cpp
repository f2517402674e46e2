// Route stores keyed by (sequence, position, layer): a micro-batch of another composition,
// order, padding or packing than the recording gets exactly the recorded rows.
#include <mrr/replay.hpp>

#include <doctest/doctest.h>

#include <random>
#include <vector>

namespace {

// Deterministic "recorded" ids for (uid, position, layer): k distinct experts.
std::vector<std::int32_t> ids_for(mrr::SequenceId uid, std::int64_t pos, int layer, int k, int experts) {
  std::vector<std::int32_t> ids;
  std::uint64_t h = uid * 0x9E3779B97F4A7C15ull ^ static_cast<std::uint64_t>(pos) * 0xC2B2AE3D27D4EB4Full ^
                    static_cast<std::uint64_t>(layer + 1) * 0x165667B19E3779F9ull;
  while (static_cast<int>(ids.size()) < k) {
    h ^= h >> 29;
    h *= 0xBF58476D1CE4E5B9ull;
    h ^= h >> 32;
    const auto e = static_cast<std::int32_t>(h % static_cast<std::uint64_t>(experts));
    bool dup = false;
    for (auto x : ids) dup = dup || x == e;
    if (!dup) ids.push_back(e);
  }
  return ids;
}

mrr::ExpertIds ids_for_layout(const mrr::TokenLayout& layout, int layer, int k, int experts) {
  mrr::ExpertIds out(static_cast<Eigen::Index>(layout.size()), k);
  for (std::size_t r = 0; r < layout.size(); ++r) {
    const auto key = layout[r];
    const auto ids = key.is_padding() ? std::vector<std::int32_t>(static_cast<std::size_t>(k), 0)
                                      : ids_for(key.uid, key.position, layer, k, experts);
    for (int j = 0; j < k; ++j) out(static_cast<Eigen::Index>(r), j) = ids[static_cast<std::size_t>(j)];
  }
  return out;
}

// Records positions [first, first + n) of sequence uid in `layer`, with ids_for's ids.
void record_span(mrr::MemoryRouteStore& store, mrr::SequenceId uid, std::int64_t first, std::int64_t n, int layer) {
  std::vector<mrr::TokenKey> keys;
  for (std::int64_t p = first; p < first + n; ++p)
    keys.push_back({uid, p});
  const mrr::TokenLayout layout(keys);
  store.record(layer, layout, ids_for_layout(layout, layer, store.shape().topk, store.shape().num_experts));
}

}  // namespace

TEST_CASE("padded layouts: positions count real tokens, left and right padding alike") {
  mrr::RowMatrix<int> mask(2, 5);
  mask << 0, 0, 1, 1, 1,  // left-padded prompt
      1, 1, 1, 0, 0;      // right-padded
  const std::vector<mrr::SequenceId> uids = {7, 9};
  const auto layout = mrr::TokenLayout::padded(std::span<const mrr::SequenceId>(uids), mask);
  REQUIRE(layout.size() == 10);
  CHECK(layout[0].is_padding());
  CHECK(layout[2] == mrr::TokenKey{7, 0});
  CHECK(layout[4] == mrr::TokenKey{7, 2});
  CHECK(layout[5] == mrr::TokenKey{9, 0});
  CHECK(layout[9].is_padding());
  CHECK(layout.real_tokens() == 6);
}

TEST_CASE("packed layouts: cu_seqlens, start positions and trailing padding") {
  const std::vector<mrr::SequenceId> uids = {3, 1};
  const std::vector<std::int64_t> cu = {0, 2, 5};
  const std::vector<std::int64_t> first = {10, 0};
  const auto layout = mrr::TokenLayout::packed(uids, cu, first, 7);
  REQUIRE(layout.size() == 7);
  CHECK(layout[0] == mrr::TokenKey{3, 10});
  CHECK(layout[1] == mrr::TokenKey{3, 11});
  CHECK(layout[2] == mrr::TokenKey{1, 0});
  CHECK(layout[4] == mrr::TokenKey{1, 2});
  CHECK(layout[5].is_padding());
  CHECK_THROWS_AS(mrr::TokenLayout::packed(uids, std::vector<std::int64_t>{0, 2}), mrr::InvalidArgument);
  CHECK_THROWS_AS(mrr::TokenLayout::packed(uids, std::vector<std::int64_t>{0, 3, 2}), mrr::InvalidArgument);
  // Sizes are checked before anything is allocated: a wrong total is an error naming it, never
  // std::bad_alloc; a negative total other than -1 (the default) is not "not given".
  const std::vector<mrr::SequenceId> one = {1};
  CHECK_THROWS_WITH_AS(mrr::TokenLayout::packed(one, std::vector<std::int64_t>{0, 3}, {}, std::int64_t{1} << 40),
                       doctest::Contains("total_rows=1099511627776 (cu_seqlens.back()=3) is more rows than"),
                       mrr::InvalidArgument);
  CHECK_THROWS_WITH_AS(mrr::TokenLayout::packed(one, std::vector<std::int64_t>{0, (std::int64_t{1} << 32) + 1}),
                       doctest::Contains("is more rows than a micro-batch can have"), mrr::InvalidArgument);
  CHECK_THROWS_WITH_AS(mrr::TokenLayout::packed(one, std::vector<std::int64_t>{0, 3}, {}, -2),
                       doctest::Contains("total_rows=-2 is negative"), mrr::InvalidArgument);
  CHECK(mrr::TokenLayout::packed(one, std::vector<std::int64_t>{0, 3}, {}, -1).size() == 3);
  CHECK_THROWS_WITH_AS(mrr::TokenLayout::packed(uids, std::vector<std::int64_t>{0, 3, 2}, {}, std::int64_t{1} << 40),
                       doctest::Contains("'cu_seqlens' decreases at entry 2"), mrr::InvalidArgument);
}

TEST_CASE("memory store: recorded padded, replayed packed in another order and composition") {
  const mrr::RouteShape shape{64, 3, 4};
  mrr::MemoryRouteStore store(shape);
  // Recording: micro-batch of sequences 10, 11, 12 left-padded to 6.
  mrr::RowMatrix<int> mask(3, 6);
  mask << 0, 0, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1;
  const std::vector<mrr::SequenceId> uids = {10, 11, 12};
  const auto rec = mrr::TokenLayout::padded(std::span<const mrr::SequenceId>(uids), mask);
  for (int layer = 0; layer < 3; ++layer) store.record(layer, rec, ids_for_layout(rec, layer, 4, 64));
  CHECK(store.num_sequences() == 3);
  CHECK(store.recorded_positions(10) == 4);
  CHECK(store.recorded_positions(12) == 6);

  // Replay: packed, order 12, 10, plus an unknown sequence 99, plus padding.
  const std::vector<mrr::SequenceId> ruids = {12, 10, 99};
  const auto rep = mrr::TokenLayout::packed(ruids, std::vector<std::int64_t>{0, 6, 10, 12}, {}, 14);
  for (int layer = 0; layer < 3; ++layer) {
    mrr::ExpertIds got;
    std::vector<std::uint8_t> found;
    const auto hits = store.lookup(layer, rep, got, found);
    CHECK(hits == 10);
    const auto want = ids_for_layout(rep, layer, 4, 64);
    for (std::size_t r = 0; r < rep.size(); ++r) {
      const bool known = !rep[r].is_padding() && rep[r].uid != 99;
      CHECK(found[r] == static_cast<std::uint8_t>(known));
      if (known) CHECK(got.row(static_cast<Eigen::Index>(r)) == want.row(static_cast<Eigen::Index>(r)));
      else CHECK(got(static_cast<Eigen::Index>(r), 0) == -1);
    }
  }
}

TEST_CASE("re-recording: identical is a no-op, different is an error, and nothing is half-stored") {
  mrr::MemoryRouteStore store({16, 1, 2});
  const std::vector<mrr::SequenceId> uids = {1};
  const auto layout = mrr::TokenLayout::packed(uids, std::vector<std::int64_t>{0, 3});
  mrr::ExpertIds ids(3, 2);
  ids << 0, 1, 2, 3, 4, 5;
  store.record(0, layout, ids);
  CHECK_NOTHROW(store.record(0, layout, ids));
  mrr::ExpertIds other = ids;
  other(2, 1) = 9;
  CHECK_THROWS_WITH_AS(store.record(0, layout, other),
                       doctest::Contains("sequence 1 position 2 layer 0 was already recorded with different experts"),
                       mrr::RouteStoreError);
  // A batch with one bad id stores none of its rows.
  const std::vector<mrr::SequenceId> uid2 = {2};
  const auto l2 = mrr::TokenLayout::packed(uid2, std::vector<std::int64_t>{0, 3});
  mrr::ExpertIds bad(3, 2);
  bad << 0, 1, 2, 3, 4, 16;
  CHECK_THROWS_WITH_AS(store.record(0, l2, bad), doctest::Contains("expert id 16 outside [0, 16)"), mrr::InvalidArgument);
  CHECK_FALSE(store.contains(2));
  // Two rows of one batch for the same token must agree.
  const std::vector<mrr::SequenceId> twice = {3, 3};
  const auto l3 = mrr::TokenLayout::packed(twice, std::vector<std::int64_t>{0, 1, 2});
  mrr::ExpertIds conflict(2, 2);
  conflict << 0, 1, 1, 0;
  CHECK_THROWS_WITH_AS(store.record(0, l3, conflict), doctest::Contains("two rows of the batch (rows 0 and 1) hold sequence 3 position 0"),
                       mrr::RouteStoreError);
  CHECK_THROWS_AS(store.record(1, layout, ids), mrr::InvalidArgument);  // layer out of range
}

TEST_CASE("record_sequence into memory: identical is a no-op, a different or bad block an error that stores nothing") {
  mrr::MemoryRouteStore store({16, 3, 2});
  std::vector<std::int32_t> block(4 * 3 * 2);  // positions 10..13, layers 0..2
  for (std::size_t i = 0; i < block.size(); ++i)
    block[i] = static_cast<std::int32_t>(i % 16);
  store.record_sequence(4, 10, 4, 0, 3, block);
  CHECK_NOTHROW(store.record_sequence(4, 10, 4, 0, 3, block));
  // Positions 12..15 of layers 1..2: 12 and 13 overlap the block, and one of their ids differs.
  std::vector<std::int32_t> later(4 * 2 * 2, 7);
  for (std::size_t t = 0; t < 2; ++t)
    for (std::size_t l = 0; l < 2; ++l)
      for (std::size_t j = 0; j < 2; ++j)
        later[(t * 2 + l) * 2 + j] = block[((t + 2) * 3 + l + 1) * 2 + j];
  later[(1 * 2 + 1) * 2 + 1] = (later[(1 * 2 + 1) * 2 + 1] + 1) % 16;  // position 13, layer 2, slot 1
  CHECK_THROWS_WITH_AS(store.record_sequence(4, 12, 4, 1, 2, later),
                       doctest::Contains("sequence 4 position 13 layer 2 was already recorded with different experts"),
                       mrr::RouteStoreError);
  CHECK(store.recorded_positions(4) == 14);  // nothing of it stored
  later[(1 * 2 + 1) * 2 + 1] = block[(3 * 3 + 2) * 2 + 1];
  store.record_sequence(4, 12, 4, 1, 2, later);  // agrees now: positions 14 and 15 are new
  CHECK(store.recorded_positions(4) == 16);
  // A block with one id out of range stores none of its rows, for a new sequence as for a known one.
  std::vector<std::int32_t> bad(2 * 3 * 2, 1);
  bad[7] = 16;
  for (mrr::SequenceId uid : {4, 5}) {
    CHECK_THROWS_WITH_AS(store.record_sequence(uid, 20, 2, 0, 3, bad),
                         doctest::Contains("expert id 16 outside [0, 16)"), mrr::InvalidArgument);
  }
  CHECK(store.recorded_positions(4) == 16);
  CHECK_FALSE(store.contains(5));
  mrr::ExpertIds got;
  std::vector<std::uint8_t> found;
  const mrr::TokenLayout layout(std::vector<mrr::TokenKey>{{4, 13}, {4, 15}});
  CHECK(store.lookup(2, layout, got, found) == 2);
  CHECK(got(0, 1) == block[(3 * 3 + 2) * 2 + 1]);
  CHECK(got(1, 0) == 7);
}

TEST_CASE("ids use the narrowest width and survive round trips at every width") {
  CHECK(mrr::id_width_for(8) == 1);
  CHECK(mrr::id_width_for(256) == 1);
  CHECK(mrr::id_width_for(257) == 2);
  CHECK(mrr::id_width_for(65536) == 2);
  CHECK(mrr::id_width_for(65537) == 4);
  for (int experts : {256, 300, 70000}) {
    mrr::MemoryRouteStore store({experts, 1, 2});
    const std::vector<mrr::SequenceId> uids = {5};
    const auto layout = mrr::TokenLayout::packed(uids, std::vector<std::int64_t>{0, 2});
    mrr::ExpertIds ids(2, 2);
    ids << experts - 1, 0, 255, experts - 2;
    store.record(0, layout, ids);
    mrr::ExpertIds got;
    std::vector<std::uint8_t> found;
    store.lookup(0, layout, got, found);
    CHECK(got == ids);
  }
}

TEST_CASE("a sequence's table grows both ways and keeps every layer's rows; runs partly recorded") {
  // The table is dense over the recorded positions and layer-major: growing it moves each layer's
  // rows. Records land in an order that grows it up, then down, then up again, layer by layer and
  // as blocks of every layer; lookups span recorded rows, gaps and positions beyond either end.
  for (int experts : {64, 300, 70000}) {
    CAPTURE(experts);
    const int L = 5, k = 3;
    mrr::MemoryRouteStore store({experts, L, k});
    std::vector<std::vector<bool>> recorded(static_cast<std::size_t>(L), std::vector<bool>(400, false));
    auto record_span = [&](std::int64_t first, std::int64_t n, int layer) {
      ::record_span(store, 7, first, n, layer);
      for (std::int64_t p = first; p < first + n; ++p)
        recorded[static_cast<std::size_t>(layer)][static_cast<std::size_t>(p)] = true;
    };
    auto record_block = [&](std::int64_t first, std::int64_t n) {  // every layer, [tokens][layers][k]
      std::vector<std::int32_t> block;
      for (std::int64_t p = first; p < first + n; ++p)
        for (int l = 0; l < L; ++l)
          for (auto id : ids_for(7, p, l, k, experts))
            block.push_back(id);
      store.record_sequence(7, first, n, 0, L, block);
      for (int l = 0; l < L; ++l)
        for (std::int64_t p = first; p < first + n; ++p)
          recorded[static_cast<std::size_t>(l)][static_cast<std::size_t>(p)] = true;
    };
    record_span(200, 30, 2);
    record_span(150, 10, 0);  // grows down
    record_block(240, 20);    // up, every layer
    record_span(100, 5, 4);   // down again
    record_block(90, 3);      // down, every layer
    record_span(300, 50, 1);  // up
    record_span(205, 40, 3);  // inside, then past the block's start
    std::vector<mrr::TokenKey> probe;
    for (std::int64_t p = 80; p < 360; ++p)
      probe.push_back({7, p});
    probe.push_back({8, 0});
    const mrr::TokenLayout layout(probe);
    for (int l = 0; l < L; ++l) {
      CAPTURE(l);
      mrr::ExpertIds got;
      mrr::RowMatrix<std::uint16_t> got16;
      std::vector<std::uint8_t> found, found16;
      const std::size_t hits = store.lookup(l, layout, got, found);
      std::size_t want_hits = 0, wrong = 0;
      for (std::size_t r = 0; r < probe.size(); ++r) {
        const auto p = probe[r].position;
        const bool want = probe[r].uid == 7 && recorded[static_cast<std::size_t>(l)][static_cast<std::size_t>(p)];
        want_hits += want;
        wrong += found[r] != static_cast<std::uint8_t>(want);
        const auto ids =
            want ? ids_for(7, p, l, k, experts) : std::vector<std::int32_t>(static_cast<std::size_t>(k), -1);
        for (int j = 0; j < k; ++j)
          wrong += got(static_cast<Eigen::Index>(r), j) != ids[static_cast<std::size_t>(j)];
      }
      CHECK(hits == want_hits);
      CHECK(wrong == 0);
      if (experts <= 65536) {
        CHECK(store.lookup(l, layout, got16, found16) == hits);
        CHECK(found16 == found);
        CHECK(got16 == got.cast<std::uint16_t>());
      }
    }
  }
}

TEST_CASE("a lookup from before a table's first position, over rows recorded in some layers only") {
  const int k = 2, experts = 64;
  mrr::MemoryRouteStore store({experts, 2, k});
  record_span(store, 3, 1000, 10, 0);  // the table starts at 1000
  record_span(store, 3, 1005, 15, 1);  // and reaches 1020: layer 0 lacks 1010..1019
  std::vector<mrr::TokenKey> keys;
  for (std::int64_t p = 990; p < 1030; ++p)
    keys.push_back({3, p});
  const mrr::TokenLayout layout(keys);
  for (int layer : {0, 1}) {
    mrr::ExpertIds got;
    std::vector<std::uint8_t> found;
    const std::size_t hits = store.lookup(layer, layout, got, found);
    CHECK(hits == (layer == 0 ? 10u : 15u));
    for (std::size_t r = 0; r < keys.size(); ++r) {
      const auto p = keys[r].position;
      const bool want = layer == 0 ? p >= 1000 && p < 1010 : p >= 1005 && p < 1020;
      CHECK(found[r] == static_cast<std::uint8_t>(want));
      const auto ids = want ? ids_for(3, p, layer, k, experts) : std::vector<std::int32_t>(k, -1);
      CHECK(got(static_cast<Eigen::Index>(r), 0) == ids[0]);
      CHECK(got(static_cast<Eigen::Index>(r), 1) == ids[1]);
    }
  }
}
