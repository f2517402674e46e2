// The route file's read path (lookups decode straight from the mapped file, no decoded copy)
// against MemoryRouteStore, and the cases its record index must get right: overlapping records,
// multi-layer records, 2-byte ids, reads after close(), and sequences too sparse for readers.
#include <mrr/replay.hpp>

#include <doctest/doctest.h>

#include "temp_dir.hpp"

#include <random>
#include <vector>

namespace {

// Same ids from both stores for every layer of the layout; returns the file store's hits.
template <class A, class B>
std::size_t same_lookups(const A& a, const B& b, const mrr::TokenLayout& layout) {
  mrr::ExpertIds out_a, out_b;
  std::vector<std::uint8_t> found_a, found_b;
  std::size_t hits = 0;
  for (int l = 0; l < a.shape().num_layers; ++l) {
    const std::size_t ha = a.lookup(l, layout, out_a, found_a);
    hits += b.lookup(l, layout, out_b, found_b);
    CHECK(ha == std::size_t(std::count(found_a.begin(), found_a.end(), 1)));
    CHECK(found_a == found_b);
    CHECK(out_a == out_b);
  }
  return hits;
}

}  // namespace

TEST_CASE("route file lookups match the memory store: overlaps, gaps, multi-layer records, 2-byte ids") {
  for (const mrr::RouteShape shape : {mrr::RouteShape{256, 4, 3}, mrr::RouteShape{300, 3, 2}, mrr::RouteShape{64, 2, 4}}) {
    CAPTURE(shape.to_string());
    mrr::test::TempDir dir;
    mrr::MemoryRouteStore memory(shape);
    std::mt19937 rng(11);
    std::uniform_int_distribution<int> expert(0, shape.num_experts - 1);
    auto random_ids = [&](std::size_t n) {
      std::vector<std::int32_t> v(n);
      for (auto& x : v) x = expert(rng);
      return v;
    };
    {
      auto file = mrr::FileRouteStore::create(dir / "r.mrr", shape);
      // Sequence 1: a multi-layer block [0, 10), then per-layer runs that overlap it (same ids,
      // a no-op) and extend it; sequence 2: a batch with the same tokens twice (both recorded).
      const auto block = random_ids(10 * static_cast<std::size_t>(shape.num_layers * shape.topk));
      memory.record_sequence(1, 0, 10, 0, shape.num_layers, block);
      file.record_sequence(1, 0, 10, 0, shape.num_layers, block);
      const std::vector<mrr::SequenceId> uids = {1, 2, 2};
      const std::vector<std::int64_t> cu = {0, 8, 12, 16}, first = {6, 20, 20};
      const auto layout = mrr::TokenLayout::packed(uids, cu, first, 18);
      for (int l = 0; l < shape.num_layers; ++l) {
        mrr::ExpertIds ids(18, shape.topk);
        for (Eigen::Index i = 0; i < ids.size(); ++i) ids.data()[i] = expert(rng);
        for (int r = 0; r < 4; ++r)  // positions 6..9 of sequence 1 repeat the block
          for (int j = 0; j < shape.topk; ++j) ids(r, j) = block[static_cast<std::size_t>(((6 + r) * shape.num_layers + l) * shape.topk + j)];
        ids.middleRows(12, 4) = ids.middleRows(8, 4).eval();  // sequence 2's two copies agree
        memory.record(l, layout, ids);
        file.record(l, layout, ids);
        ids(0, 0) = (ids(0, 0) + 1) % shape.num_experts;
        CHECK_THROWS_AS(file.record(l, layout, ids), mrr::RouteStoreError);  // conflicts with the block
      }
      // Layouts with gaps, padding and positions nobody recorded.
      std::vector<mrr::TokenKey> keys;
      for (std::int64_t p = -2; p < 26; ++p) keys.push_back({1, p < 0 ? -1 : p});
      for (std::int64_t p = 18; p < 26; ++p) keys.push_back({2, p});
      keys.push_back({3, 0});
      const mrr::TokenLayout probe(keys);
      CHECK(same_lookups(file, memory, probe) > 0);  // while writing
      file.close();
      CHECK(same_lookups(file, memory, probe) > 0);  // after close(): the mapping stays
      auto reader = mrr::FileRouteStore::open(dir / "r.mrr", shape);
      CHECK(reader.recovery().clean());
      CHECK(same_lookups(reader, memory, probe) == same_lookups(memory, memory, probe));
      CHECK(reader.recorded_positions(1) == memory.recorded_positions(1));
      CHECK(reader.recorded_positions(2) == memory.recorded_positions(2));
      const mrr::SequenceRoutes* seq = reader.sequence(1);
      REQUIRE(seq != nullptr);
      std::vector<std::int32_t> row(static_cast<std::size_t>(shape.topk));
      CHECK(seq->get(3, shape.num_layers - 1, row.data()));
    }
  }
}

TEST_CASE("a writer refuses a sequence too sparse for readers, and writes nothing") {
  mrr::test::TempDir dir;
  const mrr::RouteShape shape{64, 2, 2};
  auto file = mrr::FileRouteStore::create(dir / "r.mrr", shape);
  const std::vector<std::int32_t> ids(4, 1);
  file.record_sequence(5, 0, 1, 0, 2, ids);
  CHECK_THROWS_WITH_AS(file.record_sequence(5, std::int64_t{1} << 31, 1, 0, 2, ids), doctest::Contains("sparse"),
                       mrr::InvalidArgument);
  CHECK(file.recorded_positions(5) == 1);
  file.close();
  auto reader = mrr::FileRouteStore::open(dir / "r.mrr", shape);
  CHECK(reader.recovery().records == 1);
  CHECK(reader.recorded_positions(5) == 1);
}
