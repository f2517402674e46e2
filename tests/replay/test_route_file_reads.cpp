// The route file's read path (lookups decode from positioned reads of the file, no decoded copy)
// against MemoryRouteStore, and the cases its record index must get right: overlapping records,
// multi-layer records, 2-byte ids, lookups into narrow and wide ids, reads after close(), and
// sequences too sparse for readers.
#include <mrr/replay.hpp>

#include <doctest/doctest.h>

#include "temp_dir.hpp"

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
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

namespace {

// The offset of the routes record of sequence `uid` and layer `layer` in a route file (read from
// the record headers, docs/route-file-format.md), or -1.
std::int64_t record_offset(const std::filesystem::path& path, mrr::SequenceId uid, int layer) {
  std::ifstream f(path, std::ios::binary);
  std::vector<unsigned char> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  auto get = [&](std::size_t at, int n) {
    std::uint64_t v = 0;
    for (int b = 0; b < n; ++b)
      v |= std::uint64_t{bytes[at + static_cast<std::size_t>(b)]} << (8 * b);
    return v;
  };
  for (std::size_t at = mrr::route_file::kHeaderBytes; at + mrr::route_file::kRecordHeaderBytes <= bytes.size();) {
    if (get(at + 4, 2) == 1 && get(at + 16, 8) == uid && static_cast<int>(get(at + 36, 2)) == layer)
      return static_cast<std::int64_t>(at);
    at += mrr::route_file::record_bytes(get(at + 8, 8));
  }
  return -1;
}

void flip_byte(const std::filesystem::path& path, std::int64_t at) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(at);
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x10);
  f.seekp(at);
  f.write(&c, 1);
}

}  // namespace

// A lookup that takes whole records of one layer (R2's, a micro-batch of whole sequences) reads
// the records that follow one another in the file at once: straight into the output when its ids
// are the file's bytes (the headers apart), else into the read buffer in pieces of at most
// kReadChunk. Groups of hundreds of records (more than one scatter read holds), records whose
// payload needs padding, the same sequence twice in a layout, layouts in any order and records a
// lookup takes only part of: the memory store's ids, in every output type and id width.
TEST_CASE("lookups read records that follow one another in the file at once: the memory store's ids") {
  for (const mrr::RouteShape shape : {mrr::RouteShape{256, 3, 3}, mrr::RouteShape{64, 2, 8}, mrr::RouteShape{300, 2, 2},
                                      mrr::RouteShape{70000, 2, 3}}) {
    CAPTURE(shape.to_string());
    mrr::test::TempDir dir;
    mrr::MemoryRouteStore memory(shape);
    std::mt19937 rng(29);
    std::uniform_int_distribution<int> expert(0, shape.num_experts - 1);
    // 420 short sequences (1 to 7 tokens: most payloads padded), then 40 of 2,000 to 2,999 tokens
    // (their records add up to more than kReadChunk), each micro-batch recorded layer by layer.
    std::vector<mrr::TokenLayout> batches;
    for (const auto& [first_uid, count, min_len, max_len] :
         {std::tuple{0, 420, 1, 7}, std::tuple{1000, 40, 2000, 2999}}) {
      std::uniform_int_distribution<int> len(min_len, max_len);
      std::vector<mrr::SequenceId> uids;
      std::vector<std::int64_t> cu{0};
      for (int s = 0; s < count; ++s) {
        uids.push_back(static_cast<mrr::SequenceId>(first_uid + s));
        cu.push_back(cu.back() + len(rng));
      }
      batches.push_back(mrr::TokenLayout::packed(uids, cu));
    }
    {
      auto file = mrr::FileRouteStore::create(dir / "r.mrr", shape);
      for (const auto& layout : batches)
        for (int l = 0; l < shape.num_layers; ++l) {
          mrr::ExpertIds ids(static_cast<Eigen::Index>(layout.size()), shape.topk);
          for (Eigen::Index i = 0; i < ids.size(); ++i)
            ids.data()[i] = expert(rng);
          memory.record(l, layout, ids);
          file.record(l, layout, ids);
        }
      file.close();
    }
    auto reader = mrr::FileRouteStore::open(dir / "r.mrr", shape);
    std::vector<mrr::TokenLayout> probes = batches;
    {  // every sequence of both batches, last first, one of them twice, and one cut short
      std::vector<mrr::TokenKey> keys;
      for (int b = 1; b >= 0; --b)
        for (const mrr::TokenRun& run : std::vector<mrr::TokenRun>(batches[static_cast<std::size_t>(b)].runs().rbegin(),
                                                                   batches[static_cast<std::size_t>(b)].runs().rend()))
          for (std::size_t t = 0; t < run.count; ++t)
            keys.push_back({run.uid, run.first_position + static_cast<std::int64_t>(t)});
      for (std::int64_t p = 0; p < 5; ++p)
        keys.push_back({1003, p});                        // part of a record
      for (const mrr::TokenRun& run : batches[0].runs())  // sequence 17 again
        if (run.uid == 17)
          for (std::size_t t = 0; t < run.count; ++t)
            keys.push_back({17, static_cast<std::int64_t>(t)});
      probes.emplace_back(keys);
    }
    for (const auto& probe : probes) {
      reader.release_cache();  // each probe reads and verifies the records afresh
      CHECK(same_lookups(reader, memory, probe) == same_lookups(memory, memory, probe));
    }
  }
}

// A damaged record among records read at once is an error at every lookup that reads it, into
// every output type, and never marked verified; the records around it read as recorded. A file
// cut short under a reader is an error there too.
TEST_CASE("a damaged record among records read at once: an error every time, the others exact") {
  for (const mrr::RouteShape shape : {mrr::RouteShape{256, 2, 3}, mrr::RouteShape{70000, 2, 3}}) {
    CAPTURE(shape.to_string());
    mrr::test::TempDir dir;
    std::vector<mrr::SequenceId> uids;
    std::vector<std::int64_t> cu{0};
    for (int s = 0; s < 30; ++s) {
      uids.push_back(static_cast<mrr::SequenceId>(s));
      cu.push_back(cu.back() + 5 + s);
    }
    const auto layout = mrr::TokenLayout::packed(uids, cu);
    std::vector<mrr::ExpertIds> recorded;
    {
      auto file = mrr::FileRouteStore::create(dir / "r.mrr", shape);
      for (int l = 0; l < 2; ++l) {
        mrr::ExpertIds ids(static_cast<Eigen::Index>(layout.size()), shape.topk);
        for (Eigen::Index i = 0; i < ids.size(); ++i)
          ids.data()[i] = static_cast<std::int32_t>((i * 7919 + l) % shape.num_experts);
        file.record(l, layout, ids);
        recorded.push_back(ids);
      }
      file.close();
    }
    const std::int64_t at = record_offset(dir / "r.mrr", 14, 1);  // in the middle of layer 1's records
    REQUIRE(at > 0);
    for (const std::int64_t byte : {std::int64_t{3}, std::int64_t{mrr::route_file::kRecordHeaderBytes + 10}}) {
      CAPTURE(byte);  // a header byte, then a payload byte
      flip_byte(dir / "r.mrr", at + byte);
      auto reader = mrr::FileRouteStore::open(dir / "r.mrr", shape);
      mrr::ExpertIds out;
      mrr::RowMatrix<std::uint8_t> narrow;
      mrr::RowMatrix<std::int64_t> wide;
      std::vector<std::uint8_t> found;
      for (int round = 0; round < 2; ++round) {  // never marked verified
        CHECK_THROWS_AS(reader.lookup(1, layout, out, found), mrr::RouteFileError);
        CHECK_THROWS_AS(reader.lookup(1, layout, wide, found), mrr::RouteFileError);
        if (shape.num_experts <= 256) CHECK_THROWS_AS(reader.lookup(1, layout, narrow, found), mrr::RouteFileError);
      }
      CHECK(reader.lookup(0, layout, out, found) == layout.size());  // the other layer: as recorded
      CHECK(out == recorded[0]);
      std::vector<mrr::TokenKey> others;  // layer 1 without sequence 14: as recorded
      std::vector<Eigen::Index> rows;
      for (const mrr::TokenRun& run : layout.runs())
        if (run.uid != 14)
          for (std::size_t t = 0; t < run.count; ++t) {
            others.push_back({run.uid, run.first_position + static_cast<std::int64_t>(t)});
            rows.push_back(static_cast<Eigen::Index>(run.first_row + t));
          }
      CHECK(reader.lookup(1, mrr::TokenLayout(others), out, found) == others.size());
      CHECK(out == recorded[1](rows, Eigen::all));
      flip_byte(dir / "r.mrr", at + byte);  // undone
    }
    auto reader = mrr::FileRouteStore::open(dir / "r.mrr", shape);
    std::filesystem::resize_file(dir / "r.mrr", static_cast<std::uintmax_t>(at + 100));
    mrr::ExpertIds out;
    std::vector<std::uint8_t> found;
    CHECK_THROWS_WITH_AS(reader.lookup(1, layout, out, found), doctest::Contains("truncated"), mrr::RouteFileError);
  }
}

// A record of several layers is kept layer-major (split_layers): every row where the definition
// puts it, for the row sizes with their own loops (8-byte rows go in 2 x 2 blocks) and others,
// odd and even token and layer counts, and records larger than one block of tokens.
TEST_CASE("split_layers puts every row of a [tokens, layers] record at [layer, token]") {
  for (const auto& [k, width] : {std::pair{8, 1}, std::pair{4, 2}, std::pair{4, 1}, std::pair{6, 1}, std::pair{3, 4},
                                 std::pair{16, 1}, std::pair{3, 1}}) {
    mrr::route_file::FileHeader h;
    h.shape = {width == 1 ? 256 : width == 2 ? 65536 : 70000, 64, k};
    h.id_width = static_cast<std::uint8_t>(width);
    const mrr::detail::RouteCodec codec(h);
    const std::size_t rb = codec.row_bytes();
    for (const std::size_t tokens : {1, 2, 3, 63, 64, 65, 130, 1001})
      for (const std::size_t layers : {1, 2, 3, 47, 48}) {
        CAPTURE(rb);
        CAPTURE(tokens);
        CAPTURE(layers);
        std::vector<unsigned char> payload(tokens * layers * rb), out(payload.size(), 0xEE);
        for (std::size_t i = 0; i < payload.size(); ++i)
          payload[i] = static_cast<unsigned char>(i * 131 + i / 251);
        codec.split_layers(payload.data(), tokens, layers, out.data());
        std::size_t wrong = 0;
        for (std::size_t t = 0; t < tokens; ++t)
          for (std::size_t l = 0; l < layers; ++l)
            wrong += std::memcmp(out.data() + (l * tokens + t) * rb, payload.data() + (t * layers + l) * rb, rb) != 0;
        CHECK(wrong == 0);
      }
  }
}

// Every widening of encoded ids a lookup runs (1-, 2- and 4-byte files into wider ids), in the
// build's loop and, where the CPU has AVX2, the AVX2 loop decode_ids picks at run time: each id is
// its little-endian encoding's value, for every length to past several vectors, at odd source and
// output offsets, and nothing past n is written.
template <class Src, class Id>
void check_widening(const std::vector<unsigned char>& bytes) {
  CAPTURE(sizeof(Src));
  CAPTURE(sizeof(Id));
  using Widen = void (*)(const std::uint8_t*, std::size_t, Id*);
  std::vector<std::pair<std::string, Widen>> loops{{"decode_ids", &mrr::detail::decode_ids<Src, Id>},
                                                   {"build's loop", &mrr::detail::widen_ids<Src, Id>}};
#if MRR_AVX2_DISPATCH
  if (mrr::detail::cpu_has_avx2()) loops.emplace_back("AVX2 loop", &mrr::detail::widen_ids_avx2<Src, Id>);
#endif
  for (const auto& [name, widen] : loops) {
    CAPTURE(name);
    std::size_t wrong = 0;
    for (std::size_t n = 0; n <= 300; ++n)
      for (std::size_t src_off : {0, 1, 3})
        for (std::size_t out_off : {0, 1}) {
          std::vector<Id> out(n + out_off + 2, static_cast<Id>(0x55));
          widen(bytes.data() + src_off, n, out.data() + out_off);
          for (std::size_t i = 0; i < n; ++i) {
            std::uint64_t v = 0;
            for (std::size_t b = 0; b < sizeof(Src); ++b)
              v |= static_cast<std::uint64_t>(bytes[src_off + i * sizeof(Src) + b]) << (8 * b);
            wrong += static_cast<std::uint64_t>(out[out_off + i]) != v;
          }
          wrong += out[0] != static_cast<Id>(0x55) && out_off == 1;
          wrong += out[n + out_off] != static_cast<Id>(0x55) || out[n + out_off + 1] != static_cast<Id>(0x55);
        }
    CHECK(wrong == 0);
  }
}

TEST_CASE("widening encoded ids: the build's loop and the AVX2 one give each id's value, for every length") {
  std::vector<unsigned char> bytes(4 * 300 + 8);
  std::mt19937 rng(11);
  for (auto& b : bytes)
    b = static_cast<unsigned char>(rng());
  bytes[5] = 0xFF;  // the top bit set: widening is unsigned
  check_widening<std::uint8_t, std::int32_t>(bytes);
  check_widening<std::uint8_t, std::int64_t>(bytes);
  check_widening<std::uint8_t, std::uint16_t>(bytes);
  check_widening<std::uint16_t, std::int32_t>(bytes);
  check_widening<std::uint16_t, std::int64_t>(bytes);
  check_widening<std::uint32_t, std::int64_t>(bytes);
}
