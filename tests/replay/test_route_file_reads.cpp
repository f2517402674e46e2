// The route file's read path (lookups decode from positioned reads of the file, no decoded copy)
// against MemoryRouteStore, and the cases its record index must get right: overlapping records,
// multi-layer records, 2-byte ids, lookups into narrow and wide ids, reads after close(), and
// sequences too sparse for readers.
#include <mrr/replay.hpp>

#include <doctest/doctest.h>

#include "temp_dir.hpp"

#include <fstream>
#include <limits>
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

// Every lookup of a store into int64, (at most 65,536 experts) uint16 and (at most 256) uint8 ids
// agrees with its int32 lookup; narrow ids that cannot hold every expert are refused.
template <class S>
void narrow_lookups_agree(const S& store, int layer, const mrr::TokenLayout& layout, const mrr::ExpertIds& want,
                          const std::vector<std::uint8_t>& want_found) {
  same_as_int32<std::int64_t>(store, layer, layout, want, want_found);
  auto narrow = [&]<class Id>(Id) {  // agrees when Id holds every expert id, else is refused
    if (std::int64_t{store.shape().num_experts} - 1 <= std::int64_t{std::numeric_limits<Id>::max()}) {
      same_as_int32<Id>(store, layer, layout, want, want_found);
    } else {
      mrr::RowMatrix<Id> ids;
      std::vector<std::uint8_t> found;
      CHECK_THROWS_WITH_AS(store.lookup(layer, layout, ids, found), doctest::Contains("-bit ids cannot hold"),
                           std::invalid_argument);
    }
  };
  narrow(std::uint16_t{});
  narrow(std::uint8_t{});
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
  for (const mrr::RouteShape shape : {mrr::RouteShape{256, 4, 3}, mrr::RouteShape{300, 3, 2}, mrr::RouteShape{64, 2, 4},
                                      mrr::RouteShape{70000, 2, 3}}) {
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

TEST_CASE("records of several layers kept whole for lookups: the same ids with any read_cache_bytes") {
  // record_sequence's records hold every layer of a sequence ([tokens, layers, k]); a reader keeps
  // each whole, layer-major, once a lookup has verified it. Whatever the budget (none, one record's
  // rows, a few, the default) and whichever path decodes (1-byte ids with k as a constant or not,
  // 2-byte ids), lookups layer by layer give the memory store's ids.
  for (const mrr::RouteShape shape :
       {mrr::RouteShape{256, 12, 8}, mrr::RouteShape{64, 5, 6}, mrr::RouteShape{300, 4, 5}, mrr::RouteShape{32, 3, 1},
        mrr::RouteShape{70000, 3, 2}}) {
    CAPTURE(shape.to_string());
    mrr::test::TempDir dir;
    mrr::MemoryRouteStore memory(shape);
    std::mt19937 rng(23);
    std::uniform_int_distribution<int> expert(0, shape.num_experts - 1);
    const auto L = static_cast<std::size_t>(shape.num_layers), k = static_cast<std::size_t>(shape.topk);
    auto random_ids = [&](std::size_t tokens, std::size_t layers) {
      std::vector<std::int32_t> v(tokens * layers * k);
      for (auto& x : v)
        x = expert(rng);
      return v;
    };
    {
      auto file = mrr::FileRouteStore::create(dir / "r.mrr", shape);
      for (mrr::SequenceId uid = 0; uid < 6; ++uid) {  // whole sequences, 40 to 90 tokens
        const auto tokens = static_cast<std::int64_t>(40 + 10 * uid);
        const auto ids = random_ids(static_cast<std::size_t>(tokens), L);
        memory.record_sequence(uid, 0, tokens, 0, shape.num_layers, ids);
        file.record_sequence(uid, 0, tokens, 0, shape.num_layers, ids);
      }
      // Sequence 7: two records that split the layers, and a third of every layer that overlaps
      // the first two's positions (the same ids) and extends them.
      const int half = shape.num_layers / 2 > 0 ? shape.num_layers / 2 : 1;
      const auto low = random_ids(30, static_cast<std::size_t>(half));
      memory.record_sequence(7, 5, 30, 0, half, low);
      file.record_sequence(7, 5, 30, 0, half, low);
      if (half < shape.num_layers) {
        const auto high = random_ids(30, L - static_cast<std::size_t>(half));
        memory.record_sequence(7, 5, 30, half, shape.num_layers - half, high);
        file.record_sequence(7, 5, 30, half, shape.num_layers - half, high);
      }
      std::vector<std::int32_t> all = random_ids(40, L);  // positions 25..64; 25..34 repeat the above
      mrr::ExpertIds earlier;
      std::vector<std::uint8_t> found;
      for (int l = 0; l < shape.num_layers; ++l) {
        std::vector<mrr::TokenKey> keys;
        for (std::int64_t p = 25; p < 35; ++p)
          keys.push_back({7, p});
        memory.lookup(l, mrr::TokenLayout(keys), earlier, found);
        for (std::size_t t = 0; t < 10; ++t)
          for (std::size_t j = 0; j < k; ++j)
            all[(t * L + static_cast<std::size_t>(l)) * k + j] =
                earlier(static_cast<Eigen::Index>(t), static_cast<Eigen::Index>(j));
      }
      memory.record_sequence(7, 25, 40, 0, shape.num_layers, all);
      file.record_sequence(7, 25, 40, 0, shape.num_layers, all);
      file.close();
    }
    // Micro-batches as a trainer looks them up: whole sequences, a run from mid-sequence, padding,
    // positions and sequences nobody recorded.
    std::vector<mrr::TokenLayout> batches;
    {
      std::vector<mrr::TokenKey> a, b, c;
      for (mrr::SequenceId uid : {0, 1, 2})
        for (std::int64_t p = 0; p < 40 + 10 * static_cast<std::int64_t>(uid); ++p)
          a.push_back({uid, p});
      for (std::int64_t p = 17; p < 95; ++p)
        b.push_back({5, p});
      b.push_back({5, -1});
      for (std::int64_t p = 0; p < 70; ++p)
        b.push_back({7, p});
      for (std::int64_t p = 0; p < 5; ++p)
        c.push_back({9, p});
      for (std::int64_t p = 30; p < 60; ++p)
        c.push_back({4, p});
      for (std::int64_t p = 60; p >= 0; p -= 3)
        c.push_back({3, p});  // positions in reverse
      batches = {mrr::TokenLayout(a), mrr::TokenLayout(b), mrr::TokenLayout(c)};
    }
    const std::size_t one_record = 90 * L * k * static_cast<std::size_t>(mrr::id_width_for(shape.num_experts)) +
                                   mrr::detail::HeldRecords::kOverheadBytes;
    for (const std::size_t budget :
         {std::size_t{0}, one_record, 3 * one_record, mrr::FileStoreOptions{}.read_cache_bytes}) {
      CAPTURE(budget);
      auto reader = mrr::FileRouteStore::open(dir / "r.mrr", shape, {.read_cache_bytes = budget});
      for (int pass = 0; pass < 2; ++pass) {  // pass 1 without release_cache: the kept records again
        for (const auto& batch : batches) {
          CHECK(same_lookups(reader, memory, batch) > 0);
          CHECK(reader.read_cache_used() <= budget);
          if (budget >= one_record) {
            CHECK(reader.read_cache_used() > 0);
          } else {
            CHECK(reader.read_cache_used() == 0);
          }
          if (pass == 0) reader.release_cache();
        }
      }
      reader.release_cache();
      CHECK(reader.read_cache_used() == 0);
    }
  }
}

TEST_CASE("a damaged record of several layers is an error at every lookup, never kept") {
  mrr::test::TempDir dir;
  const mrr::RouteShape shape{256, 6, 4};
  std::vector<std::int32_t> ids(50 * 6 * 4);
  for (std::size_t i = 0; i < ids.size(); ++i)
    ids[i] = static_cast<std::int32_t>((i * 37) % 256);
  {
    auto file = mrr::FileRouteStore::create(dir / "r.mrr", shape);
    file.record_sequence(1, 0, 50, 0, 6, ids);
    file.record_sequence(2, 0, 50, 0, 6, ids);
    file.close();
  }
  {  // one byte of sequence 2's payload changed: its record fails its checksum
    std::fstream f(dir / "r.mrr", std::ios::in | std::ios::out | std::ios::binary);
    const auto at =
        static_cast<std::streamoff>(mrr::route_file::kHeaderBytes + mrr::route_file::record_bytes(ids.size()) +
                                    mrr::route_file::kRecordHeaderBytes + 700);
    f.seekg(at);
    char c = 0;
    f.read(&c, 1);
    c = static_cast<char>(c ^ 0x40);
    f.seekp(at);
    f.write(&c, 1);
  }
  auto reader = mrr::FileRouteStore::open(dir / "r.mrr", shape);
  std::vector<mrr::TokenKey> keys;
  for (std::int64_t p = 0; p < 50; ++p)
    keys.push_back({2, p});
  const mrr::TokenLayout damaged(keys), intact(std::vector<mrr::TokenKey>{{1, 3}, {1, 4}});
  mrr::ExpertIds out;
  std::vector<std::uint8_t> found;
  for (int l = 0; l < 6; ++l) {  // every layer's lookup reads and checks it again
    CAPTURE(l);
    CHECK_THROWS_WITH_AS(reader.lookup(l, damaged, out, found), doctest::Contains("fails its checksum"),
                         mrr::RouteFileError);
    CHECK(reader.read_cache_used() == 0);
  }
  CHECK(reader.lookup(5, intact, out, found) == 2);  // the other sequence's record is read and kept
  CHECK(out(0, 0) == ids[(3 * 6 + 5) * 4]);
  CHECK(out(1, 3) == ids[(4 * 6 + 5) * 4 + 3]);
  CHECK(reader.read_cache_used() > 0);
}

TEST_CASE("a file truncated under a reader is an error even for the records it keeps in memory") {
  mrr::test::TempDir dir;
  const mrr::RouteShape shape{64, 4, 2};
  const std::vector<std::int32_t> ids(100 * 4 * 2, 5);
  {
    auto file = mrr::FileRouteStore::create(dir / "r.mrr", shape);
    file.record_sequence(1, 0, 100, 0, 4, ids);
    file.close();
  }
  auto reader = mrr::FileRouteStore::open(dir / "r.mrr", shape);
  std::vector<mrr::TokenKey> keys;
  for (std::int64_t p = 0; p < 100; ++p)
    keys.push_back({1, p});
  const mrr::TokenLayout layout(keys);
  mrr::ExpertIds out;
  std::vector<std::uint8_t> found;
  CHECK(reader.lookup(0, layout, out, found) == 100);
  REQUIRE(reader.read_cache_used() > 0);  // the record is kept: layer 1 needs no read
  std::filesystem::resize_file(dir / "r.mrr", mrr::route_file::kHeaderBytes + 300);
  CHECK_THROWS_WITH_AS(reader.lookup(1, layout, out, found), doctest::Contains("truncated"), mrr::RouteFileError);
}
