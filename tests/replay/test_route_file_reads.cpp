// The route file's read path (lookups decode from positioned reads of the file, no decoded copy)
// against MemoryRouteStore, and the cases its record index must get right: overlapping records,
// multi-layer records, 2-byte ids, lookups into narrow and wide ids, reads after close(), and
// sequences too sparse for readers.
#include <mrr/replay.hpp>

#include <doctest/doctest.h>

#include "temp_dir.hpp"

#include <random>
#include <stdexcept>
#include <type_traits>
#include <vector>

namespace {

// A store's lookup into `Id` gives the int32 lookup's ids and found flags (rows not found: -1,
// which is all ones for unsigned ids).
template <class Id, class S>
void same_as_int32(const S& store, int layer, const mrr::TokenLayout& layout, const mrr::ExpertIds& want,
                   const std::vector<std::uint8_t>& want_found) {
  CAPTURE(sizeof(Id));
  if constexpr (std::is_same_v<S, mrr::FileRouteStore>)
    store.release_cache();  // read and verified afresh: the first-read path, not only the verified one
  mrr::RowMatrix<Id> got(1, 1);
  std::vector<std::uint8_t> found(3, 7);
  const std::size_t hits = store.lookup(layer, layout, got, found);
  CHECK(hits == std::size_t(std::count(want_found.begin(), want_found.end(), 1)));
  CHECK(found == want_found);
  REQUIRE(got.rows() == want.rows());
  REQUIRE(got.cols() == want.cols());
  CHECK(got == want.template cast<Id>());
}

// Every lookup of a store into int64, uint16 and (at most 256 experts) uint8 ids agrees with its
// int32 lookup; 8-bit ids of more experts are refused.
template <class S>
void narrow_lookups_agree(const S& store, int layer, const mrr::TokenLayout& layout, const mrr::ExpertIds& want,
                          const std::vector<std::uint8_t>& want_found) {
  same_as_int32<std::int64_t>(store, layer, layout, want, want_found);
  same_as_int32<std::uint16_t>(store, layer, layout, want, want_found);
  if (store.shape().num_experts <= 256) {
    same_as_int32<std::uint8_t>(store, layer, layout, want, want_found);
  } else {
    mrr::RowMatrix<std::uint8_t> narrow;
    std::vector<std::uint8_t> found;
    CHECK_THROWS_WITH_AS(store.lookup(layer, layout, narrow, found), doctest::Contains("8-bit ids cannot hold"),
                         std::invalid_argument);
  }
}

// Same ids from both stores for every layer of the layout; returns the first store's hits. The
// lookups into int64, uint16 and uint8 agree too, in each store.
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
    narrow_lookups_agree(a, l, layout, out_a, found_a);
    narrow_lookups_agree(b, l, layout, out_b, found_b);
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
      CHECK(same_lookups(file, memory, probe) > 0);  // after close(): still readable
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

TEST_CASE("the id encoding refuses every id outside [0, num_experts), wherever it is and whatever its value") {
  // Each width's loop (1-byte ids from int32 have their own SSE2 form on x86-64: 16 ids a step,
  // then a tail; the portable loops are held to the same cases), with one bad id at every position
  // of blocks that end in the body or the tail.
  for (const int experts : {1, 200, 256, 300, 70000}) {
    CAPTURE(experts);
    mrr::route_file::FileHeader h;
    h.shape = {experts, 1, 1};
    h.id_width = static_cast<std::uint8_t>(experts <= 256 ? 1 : experts <= 65536 ? 2 : 4);
    const mrr::detail::RouteCodec codec(h);
    const std::vector<std::int64_t> bad = {experts,
                                           std::int64_t{experts} + 1,
                                           255 + 1,
                                           -1,
                                           -2,
                                           32767,
                                           32768,
                                           -32768,
                                           -32769,
                                           65535,
                                           65536,
                                           0x7fffffff,
                                           -0x7fffffff - 1};
    for (const std::size_t n : {std::size_t{1}, std::size_t{15}, std::size_t{16}, std::size_t{33}, std::size_t{64}}) {
      std::vector<std::int32_t> ids(n);
      for (std::size_t i = 0; i < n; ++i)
        ids[i] = static_cast<std::int32_t>((i * 37 + 5) % static_cast<std::size_t>(experts));
      std::vector<unsigned char> out(n * 4);
      for (const bool portable : {false, true}) {
        std::fill(out.begin(), out.end(), 0xAB);
        REQUIRE((portable ? codec.encode_ids_portable(ids.data(), n, out.data())
                          : codec.encode_ids(ids.data(), n, out.data())));
        for (std::size_t i = 0; i < n; ++i) {  // the bytes are the ids', little-endian
          std::uint32_t v = 0;
          for (int b = 0; b < h.id_width; ++b)
            v |= std::uint32_t{out[i * h.id_width + static_cast<std::size_t>(b)]} << (8 * b);
          REQUIRE(v == static_cast<std::uint32_t>(ids[i]));
        }
      }
      ids.back() = experts - 1;  // the largest id is in range
      CHECK(codec.encode_ids(ids.data(), n, out.data()));
      CHECK(codec.ids_in_range(ids.data(), n));
      for (std::size_t at = 0; at < n; ++at)
        for (const std::int64_t b : bad) {
          if (b >= 0 && b < experts) continue;  // in range for this shape (256 with 300 experts)
          auto with_bad = ids;
          with_bad[at] = static_cast<std::int32_t>(b);
          CAPTURE(at);
          CAPTURE(b);
          CHECK_FALSE(codec.encode_ids(with_bad.data(), n, out.data()));
          CHECK_FALSE(codec.encode_ids_portable(with_bad.data(), n, out.data()));
          CHECK_FALSE(codec.ids_in_range(with_bad.data(), n));
        }
      if (experts <= 65536) {  // uint16 ids (and uint8 ones where they can be out of range)
        std::vector<std::uint16_t> narrow(ids.begin(), ids.end());
        CHECK(codec.encode_ids(narrow.data(), n, out.data()));
        for (std::size_t at = 0; at < n; ++at) {
          auto with_bad = narrow;
          with_bad[at] = static_cast<std::uint16_t>(std::min(experts, 65535));
          CHECK(codec.encode_ids(with_bad.data(), n, out.data()) == (experts == 65536));
        }
      }
      if (experts < 256) {
        std::vector<std::uint8_t> bytes(ids.begin(), ids.end());
        CHECK(codec.encode_ids(bytes.data(), n, out.data()));
        CHECK(std::equal(bytes.begin(), bytes.end(), out.begin()));
        for (std::size_t at = 0; at < n; ++at)
          for (const int b : {experts, 255}) {
            auto with_bad = bytes;
            with_bad[at] = static_cast<std::uint8_t>(b);
            CHECK_FALSE(codec.encode_ids(with_bad.data(), n, out.data()));
            CHECK_FALSE(codec.ids_in_range(with_bad.data(), n));
          }
      }
    }
  }
}
