// Route file format versions (docs/route-file-format.md): new files are version 3, whose records
// are checksummed with XXH3-64 (as in version 2) and whose index and tail records carry the file
// id; versions 2 and 1 (XXH64) are still written on request, and files an older mrr wrote
// (tests/replay/data, bytes from mrr at a2ca4b6) are read and appended to in their own version. Every checksum is
// recomputed here from the bytes with xxHash directly, not through the library's own helpers.
#include <mrr/replay.hpp>

#include <doctest/doctest.h>

#include "temp_dir.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <span>
#include <string>
#include <vector>

namespace {

namespace rf = mrr::route_file;

std::vector<unsigned char> file_bytes(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), {}};
}

void put_bytes(const std::filesystem::path& p, const std::vector<unsigned char>& bytes) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

std::uint64_t le64(const unsigned char* p) {
  std::uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

struct Scan {
  int records = 0;  // of every type
  int routes = 0;
  int xxh64 = 0;  // records whose checksum is XXH64 of (header bytes 0..39, payload)
  int xxh3 = 0;   // ... XXH3-64 of the same bytes
  std::vector<std::uint64_t> index_and_tail_uids;  // the uid field of each index and tail record
};

// Walks every record of a cleanly written file and says which hash each checksum is.
Scan scan_records(const std::vector<unsigned char>& f) {
  Scan s;
  std::size_t at = rf::kHeaderBytes;
  while (at + rf::kRecordHeaderBytes <= f.size()) {
    const unsigned char* h = f.data() + at;
    REQUIRE(std::memcmp(h, "MRRR", 4) == 0);
    const std::uint64_t payload = le64(h + 8);
    REQUIRE(at + rf::kRecordHeaderBytes + payload <= f.size());
    std::vector<unsigned char> body(h, h + 40);
    body.insert(body.end(), h + rf::kRecordHeaderBytes, h + rf::kRecordHeaderBytes + payload);
    const std::uint64_t stored = le64(h + 40);
    s.xxh64 += stored == XXH64(body.data(), body.size(), 0) ? 1 : 0;
    s.xxh3 += stored == XXH3_64bits(body.data(), body.size()) ? 1 : 0;
    s.routes += h[4] == 1 ? 1 : 0;
    if (h[4] != 1) s.index_and_tail_uids.push_back(le64(h + 16));
    ++s.records;
    at += rf::kRecordHeaderBytes + ((payload + 7) & ~std::uint64_t{7});
  }
  CHECK(at == f.size());
  return s;
}

// The ids of the fixtures (and of what the tests append to them), by formula: k distinct ids.
std::int32_t id_of(int experts, int k, std::int64_t uid, std::int64_t pos, int layer, int slot) {
  return static_cast<std::int32_t>(((uid * 131 + pos * 31 + layer * 7 + slot * 13) % (experts - 13 * k) + 13 * slot) %
                                   experts);
}

mrr::TokenLayout span(mrr::SequenceId uid, std::int64_t first, std::int64_t n) {
  std::vector<mrr::TokenKey> rows;
  for (std::int64_t t = 0; t < n; ++t)
    rows.push_back({uid, first + t});
  return mrr::TokenLayout(std::move(rows));
}

// Every layer of positions [first, first + n) of uid holds id_of's ids.
void check_span(const mrr::FileRouteStore& store, mrr::SequenceId uid, std::int64_t first, std::int64_t n) {
  const auto& s = store.shape();
  mrr::ExpertIds got;
  mrr::RowMatrix<std::uint16_t> narrow;
  std::vector<std::uint8_t> found;
  for (int l = 0; l < s.num_layers; ++l) {
    REQUIRE(store.lookup(l, span(uid, first, n), got, found) == static_cast<std::size_t>(n));
    REQUIRE(store.lookup(l, span(uid, first, n), narrow, found) == static_cast<std::size_t>(n));
    int wrong = 0;
    for (std::int64_t t = 0; t < n; ++t)
      for (int j = 0; j < s.topk; ++j) {
        const std::int32_t want = id_of(s.num_experts, s.topk, static_cast<std::int64_t>(uid), first + t, l, j);
        wrong += got(t, j) != want || narrow(t, j) != want ? 1 : 0;
      }
    CHECK_MESSAGE(wrong == 0, "uid ", uid, " layer ", l);
  }
}

void record_span(mrr::FileRouteStore& store, mrr::SequenceId uid, std::int64_t first, std::int64_t n) {
  const auto& s = store.shape();
  for (int l = 0; l < s.num_layers; ++l) {
    mrr::ExpertIds ids(n, s.topk);
    for (std::int64_t t = 0; t < n; ++t)
      for (int j = 0; j < s.topk; ++j)
        ids(t, j) = id_of(s.num_experts, s.topk, static_cast<std::int64_t>(uid), first + t, l, j);
    store.record(l, span(uid, first, n), ids);
  }
}

struct Fixture {
  const char* name;
  mrr::RouteShape shape;
};
// Written by mrr at a2ca4b6 (format version 1): sequence 3 at positions 0..39 and sequence 9 at
// 0..59 (two overlapping records per layer: 0..39 with sequence 3 in one layout, then 20..59),
// per layer as R2 records them; sequence 1000 at 5..304 in one record_sequence block. Closed
// cleanly (index and tail).
const Fixture kFixtures[] = {{"v1_e64_l3_k4.routes", {64, 3, 4}}, {"v1_e300_l2_k6.routes", {300, 2, 6}}};

// "<stem><n>.routes" (appended piecewise: GCC 12's -Wrestrict misfires on "literal" + std::string).
std::string numbered(const char* stem, unsigned n) {
  std::string s = stem;
  s += std::to_string(n);
  s += ".routes";
  return s;
}

std::filesystem::path fixture(const char* name) {
  return std::filesystem::path(MRR_REPLAY_TEST_DATA) / name;
}

}  // namespace

TEST_CASE("new route files are format version 3 (XXH3-64, index and tail name the file); 2 and 1 on request") {
  mrr::test::TempDir dir;
  const mrr::RouteShape shape{64, 3, 4};
  for (const std::uint16_t asked : {std::uint16_t{0}, std::uint16_t{3}, std::uint16_t{2}, std::uint16_t{1}}) {
    CAPTURE(asked);
    const auto path = dir / numbered("v", asked);
    {
      auto store = mrr::FileRouteStore::create(path, shape, {.format_version = asked});
      record_span(store, 5, 0, 300);  // payloads of 1,200 bytes: XXH3's long path
      record_span(store, 6, 7, 3);    // 12 bytes (52 hashed): its 17-128 path
      store.close();
    }
    const int version = asked == 0 ? 3 : asked;
    const auto bytes = file_bytes(path);
    CHECK(bytes[8] == version);
    CHECK(bytes[9] == 0);
    const Scan s = scan_records(bytes);
    CHECK(s.routes == 6);
    CHECK(s.records == 8);  // and the index and tail records
    CHECK(s.xxh3 == (version >= 2 ? s.records : 0));
    CHECK(s.xxh64 == (version == 1 ? s.records : 0));
    // The index and the tail carry the header's file id from version 3 (0 before).
    const std::uint64_t file_id = le64(bytes.data() + 32);
    CHECK(file_id != 0);
    const std::vector<std::uint64_t> expected(2, version >= 3 ? file_id : 0);
    CHECK(s.index_and_tail_uids == expected);
    const auto store = mrr::FileRouteStore::open(path, shape);
    CHECK(store.format_version() == version);
    CHECK(store.recovery().opened_from_index);  // the index record's checksum checked as the version says
    check_span(store, 5, 0, 300);
    check_span(store, 6, 7, 3);
  }
}

TEST_CASE("a damaged record fails its checksum in either format version") {
  mrr::test::TempDir dir;
  const mrr::RouteShape shape{300, 2, 6};
  for (const std::uint16_t version : {std::uint16_t{1}, std::uint16_t{2}, std::uint16_t{3}}) {
    CAPTURE(version);
    const auto path = dir / numbered("v", version);
    {
      auto store = mrr::FileRouteStore::create(path, shape, {.format_version = version});
      record_span(store, 5, 0, 100);
    }
    auto bytes = file_bytes(path);
    // One bit of one id of the first record (layer 0), to another id in range.
    bytes[rf::kHeaderBytes + rf::kRecordHeaderBytes + 100] ^= 1;
    put_bytes(path, bytes);
    const auto store = mrr::FileRouteStore::open(path, shape);
    mrr::ExpertIds got;
    std::vector<std::uint8_t> found;
    CHECK_THROWS_WITH_AS(store.lookup(0, span(5, 0, 100), got, found), doctest::Contains("fails its checksum"),
                         mrr::RouteFileError);
  }
}

TEST_CASE("version-1 files an older mrr wrote are read, and appended to in version 1") {
  mrr::test::TempDir dir;
  for (const Fixture& fx : kFixtures) {
    const std::string name = fx.name;
    CAPTURE(name);
    const auto path = dir / fx.name;
    std::filesystem::copy_file(fixture(fx.name), path);
    const Scan before = scan_records(file_bytes(path));
    REQUIRE(before.records > 0);
    CHECK(before.xxh64 == before.records);  // the fixture is what it says
    {
      const auto store = mrr::FileRouteStore::open(path, fx.shape);
      CHECK(store.format_version() == 1);
      CHECK(store.recovery().opened_from_index);
      CHECK(store.num_sequences() == 3);
      check_span(store, 3, 0, 40);
      check_span(store, 9, 0, 60);
      check_span(store, 1000, 5, 300);
      CHECK(store.recorded_positions(1000) == 305);
    }
    // Asking for another version than the file's is an error, before anything is written.
    CHECK_THROWS_WITH_AS(mrr::FileRouteStore::append(path, fx.shape, {.format_version = 2}),
                         doctest::Contains("is in format version 1 but format_version = 2 was asked for"),
                         mrr::RouteFileError);
    CHECK(file_bytes(path).size() == std::filesystem::file_size(fixture(fx.name)));
    {
      auto store = mrr::FileRouteStore::append(path, fx.shape);  // format_version 0: the file's own
      CHECK(store.format_version() == 1);
      record_span(store, 9, 60, 10);   // a sequence the file holds, extended
      record_span(store, 42, 0, 500);  // a new one
      store.close();
    }
    const auto bytes = file_bytes(path);
    CHECK(bytes[8] == 1);
    const Scan after = scan_records(bytes);
    CHECK(after.routes == before.routes + 2 * fx.shape.num_layers);
    CHECK(after.xxh64 == after.records);  // every record, old and new, index and tail: XXH64
    CHECK(after.xxh3 == 0);
    // An explicit format_version = 1 appends as well.
    { auto again = mrr::FileRouteStore::append(path, fx.shape, {.format_version = 1}); }
    const auto store = mrr::FileRouteStore::open(path, fx.shape);
    CHECK(store.format_version() == 1);
    CHECK(store.recovery().opened_from_index);
    check_span(store, 3, 0, 40);
    check_span(store, 9, 0, 70);
    check_span(store, 1000, 5, 300);
    check_span(store, 42, 0, 500);
  }
}

TEST_CASE("format versions this mrr does not know are refused, naming the version") {
  mrr::test::TempDir dir;
  const mrr::RouteShape shape{64, 3, 4};
  for (const std::uint16_t bad : {std::uint16_t{4}, std::uint16_t{7}, std::uint16_t{65535}}) {
    CAPTURE(bad);
    const auto path = dir / numbered("asked", bad);
    std::string why = "format_version = ";
    why += std::to_string(bad);
    why += " is not a route file version";
    CHECK_THROWS_WITH_AS(mrr::FileRouteStore::create(path, shape, {.format_version = bad}),
                         doctest::Contains(why.c_str()), mrr::RouteFileError);
    CHECK_FALSE(std::filesystem::exists(path));
    CHECK_THROWS_WITH_AS(mrr::FileRouteStore::append(path, shape, {.format_version = bad}),
                         doctest::Contains("is not a route file version"), mrr::RouteFileError);
  }
  // A file of a newer version (a valid header otherwise, its checksum recomputed) is refused by
  // readers and writers alike.
  const auto path = dir / "v4.routes";
  {
    auto store = mrr::FileRouteStore::create(path, shape);
    record_span(store, 1, 0, 10);
  }
  auto bytes = file_bytes(path);
  bytes[8] = 4;
  const std::uint64_t sum = XXH64(bytes.data(), 56, 0);
  std::memcpy(bytes.data() + 56, &sum, 8);
  put_bytes(path, bytes);
  CHECK_THROWS_WITH_AS(mrr::FileRouteStore::open(path, shape),
                       doctest::Contains("format version 4, which this mrr does not read (it reads versions 1 to 3"),
                       mrr::RouteFileError);
  CHECK_THROWS_WITH_AS(mrr::FileRouteStore::append(path, shape), doctest::Contains("format version 4"),
                       mrr::RouteFileError);
  CHECK(file_bytes(path) == bytes);  // untouched
}

TEST_CASE("version 3: ids that hold an index and a tail never pass for the tail of a file that was not closed") {
  // Until close() writes the real index and tail, a file ends with a routes record, and with 256
  // experts every byte is a valid id: a rollout's ids can end with the bytes of an index record
  // and a tail record (here crafted to list a forged record of sequence 1). In version 2 a reader
  // opening the file then (while the writer records, or after it crashed) would trust that tail.
  // In version 3 the tail and index must carry the file's random id, which ids cannot know.
  mrr::test::TempDir dir;
  const auto path = dir / "forged.routes";
  const mrr::RouteShape shape{256, 1, 8};
  auto writer = mrr::FileRouteStore::create(path, shape);
  REQUIRE(writer.format_version() == 3);
  const std::vector<std::uint8_t> recorded(4 * 8, 7);  // sequence 1: 4 tokens, every id 7
  writer.record_sequence(1, 0, 4, 0, 1, std::span<const std::uint8_t>(recorded));
  const std::uint64_t payload_at = std::filesystem::file_size(path) + rf::kRecordHeaderBytes;
  const std::uint64_t file_id = le64(file_bytes(path).data() + 32);
  for (const std::uint64_t guess : {std::uint64_t{0}, std::uint64_t{0x9e3779b97f4a7c15}}) {
    REQUIRE(guess != file_id);
    // Sequence 2's "ids": a routes record of sequence 1 (every id 200), an index listing only it,
    // a tail pointing at that index; all checksums valid.
    std::vector<unsigned char> forged(rf::kRecordHeaderBytes);
    const std::vector<unsigned char> fake_ids(4 * 8, 200);
    rf::RecordHeader h;
    h.type = rf::RecordType::routes;
    h.payload_bytes = fake_ids.size();
    h.uid = 1;
    h.num_tokens = 4;
    h.num_layers = 1;
    rf::encode(rf::kVersion, h, fake_ids.data(), forged.data());
    forged.insert(forged.end(), fake_ids.begin(), fake_ids.end());
    std::vector<unsigned char> index(8 + 32, 0);
    rf::detail::put<std::uint64_t>(index.data(), 1);                // one entry:
    rf::detail::put<std::uint64_t>(index.data() + 8, 1);            // uid 1
    rf::detail::put<std::uint64_t>(index.data() + 16, payload_at);  // at the forged record
    rf::detail::put<std::uint32_t>(index.data() + 32, 4);           // 4 tokens
    rf::detail::put<std::uint16_t>(index.data() + 38, 1);           // 1 layer
    const auto tail = mrr::detail::encode_index_and_tail(rf::kVersion, guess, index, payload_at + forged.size());
    forged.insert(forged.end(), tail.begin(), tail.end());
    REQUIRE(forged.size() % 8 == 0);
    const auto path2 = dir / numbered("forged", static_cast<unsigned>(guess & 1u));
    std::filesystem::copy_file(path, path2, std::filesystem::copy_options::overwrite_existing);
    auto second = mrr::FileRouteStore::append(path2, shape);
    second.record_sequence(2, 0, static_cast<std::int64_t>(forged.size() / 8), 0, 1,
                           std::span<const std::uint8_t>(forged.data(), forged.size()));
    // A reader now (the same bytes a crash would leave): a rescan, every record as recorded.
    const mrr::TokenLayout first_four = span(1, 0, 4);
    mrr::ExpertIds got;
    std::vector<std::uint8_t> found;
    {
      const auto reader = mrr::FileRouteStore::open(path2, shape);
      CHECK_FALSE(reader.recovery().opened_from_index);
      CHECK(reader.num_sequences() == 2);
      REQUIRE(reader.lookup(0, first_four, got, found) == 4);
      CHECK((got.array() == 7).all());
      CHECK(reader.recorded_positions(2) == static_cast<std::int64_t>(forged.size() / 8));
    }
    // A crash now, then an append and a clean close: nothing recorded is lost.
    const auto crashed = dir / numbered("crashed", static_cast<unsigned>(guess & 1u));
    std::filesystem::copy_file(path2, crashed, std::filesystem::copy_options::overwrite_existing);
    {
      auto appender = mrr::FileRouteStore::append(crashed, shape);
      CHECK_FALSE(appender.recovery().opened_from_index);
      const std::vector<std::uint8_t> more(8, 3);
      appender.record_sequence(3, 0, 1, 0, 1, std::span<const std::uint8_t>(more));
    }
    const auto after = mrr::FileRouteStore::open(crashed, shape);
    CHECK(after.recovery().opened_from_index);
    CHECK(after.num_sequences() == 3);
    REQUIRE(after.lookup(0, first_four, got, found) == 4);
    CHECK((got.array() == 7).all());
    CHECK(after.contains(2));
  }
}

TEST_CASE("a version-2 index entry that disagrees with its record's header is damage, never other rows") {
  mrr::test::TempDir dir;
  const mrr::RouteShape shape{64, 3, 4};
  const auto path = dir / "index.routes";
  {
    auto store = mrr::FileRouteStore::create(path, shape);
    record_span(store, 5, 0, 100);  // three records, one per layer
  }
  const auto good = file_bytes(path);
  // The tail (the last 64 bytes) points at the index record; its payload: a count, then entries of
  // {uid, offset, first_position, num_tokens, first_layer, num_layers}.
  const std::uint64_t index_at = le64(good.data() + good.size() - 8);
  const std::size_t entries = index_at + rf::kRecordHeaderBytes + 8;
  REQUIRE(le64(good.data() + index_at + rf::kRecordHeaderBytes) == 3);
  REQUIRE(le64(good.data() + entries) == 5);
  REQUIRE(le64(good.data() + entries + 16) == 0);  // first_position of the first record

  // Rewrites one field of the first entry, and the index record's checksum and header check, so
  // that only the field differs.
  auto crafted = [&](std::size_t field, std::uint64_t value, std::size_t bytes) {
    auto f = good;
    std::memcpy(f.data() + entries + field, &value, bytes);
    unsigned char* ih = f.data() + index_at;
    const std::uint64_t payload = le64(ih + 8);
    std::vector<unsigned char> body(ih, ih + 40);
    body.insert(body.end(), ih + rf::kRecordHeaderBytes, ih + rf::kRecordHeaderBytes + payload);
    const std::uint64_t sum = XXH3_64bits(body.data(), body.size());
    std::memcpy(ih + 40, &sum, 8);
    const auto check = static_cast<std::uint32_t>(XXH64(ih, 48, 0));  // the header check covers the checksum
    std::memcpy(ih + 48, &check, 4);
    put_bytes(path, f);
  };
  mrr::ExpertIds got;
  std::vector<std::uint8_t> found;
  // first_position 0 -> 1: the rows would be read one position off.
  crafted(16, 1, 8);
  {
    const auto store = mrr::FileRouteStore::open(path, shape);
    CHECK(store.recovery().opened_from_index);
    CHECK_THROWS_WITH_AS(store.lookup(0, span(5, 0, 100), got, found),
                         doctest::Contains("is not what the index (or its header read earlier) says of it"),
                         mrr::RouteFileError);
    CHECK_THROWS_WITH_AS(store.sequence(5), doctest::Contains("is not what the index"), mrr::RouteFileError);
  }
  // num_tokens 100 -> 99: fewer rows than the record holds.
  crafted(24, 99, 4);
  {
    const auto store = mrr::FileRouteStore::open(path, shape);
    CHECK_THROWS_WITH_AS(store.lookup(0, span(5, 0, 100), got, found), doctest::Contains("is not what the index"),
                         mrr::RouteFileError);
  }
  // num_tokens 100 -> 4,000: more rows than fit before the next record, refused before any read.
  crafted(24, 4000, 4);
  {
    const auto store = mrr::FileRouteStore::open(path, shape);
    CHECK_THROWS_WITH_AS(store.lookup(0, span(5, 0, 100), got, found),
                         doctest::Contains("running into the next record"), mrr::RouteFileError);
  }
  // num_layers 1 -> 9: outside the file's shape.
  crafted(30, 9, 2);
  {
    const auto store = mrr::FileRouteStore::open(path, shape);
    CHECK_THROWS_WITH_AS(store.lookup(0, span(5, 0, 100), got, found), doctest::Contains("outside the file's 3 layers"),
                         mrr::RouteFileError);
  }
  // num_layers 1 -> 0: no routes record has that, so the index is damaged; the records are
  // rescanned (they are intact) and read back.
  crafted(30, 0, 2);
  {
    const auto store = mrr::FileRouteStore::open(path, shape);
    CHECK(store.recovery().index_damaged);
    CHECK_FALSE(store.recovery().opened_from_index);
    check_span(store, 5, 0, 100);
  }
  // The file as written reads back.
  put_bytes(path, good);
  const auto store = mrr::FileRouteStore::open(path, shape);
  check_span(store, 5, 0, 100);
}

// The record checksum's XXH3 runs AVX2 kernels when the CPU has them (mrr/detail/xxhash.hpp):
// streamed in any pieces, from any alignment, it is the one-shot baseline XXH3 of the same bytes.
TEST_CASE("XXH3 streamed with the kernels this CPU runs is the baseline XXH3, for every length and split") {
  const std::string kernels = mrr::detail::xxh3_uses_avx2() ? "AVX2 (chosen at run time)" : "baseline";
  MESSAGE("XXH3 kernels: " << kernels);
  std::vector<unsigned char> data(70000 + 64);
  std::uint64_t x = 0x9E3779B97F4A7C15u;
  for (auto& b : data) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    b = static_cast<unsigned char>(x);
  }
  std::vector<std::size_t> lengths;
  for (std::size_t n = 0; n <= 1100; ++n)
    lengths.push_back(n);
  for (const std::size_t n : {4095, 4096, 4097, 16384, 16441, 65536, 70000})
    lengths.push_back(n);
  std::size_t checked = 0, wrong = 0;
  for (const std::size_t n : lengths)
    for (const std::size_t align : {0, 1, 7, 32}) {
      const unsigned char* p = data.data() + align;
      const XXH64_hash_t want = XXH3_64bits(p, n);
      for (const std::size_t piece :
           {n + 1, std::size_t{1}, std::size_t{40}, std::size_t{255}, std::size_t{1024}, std::size_t{16384}}) {
        if (piece == 1 && n > 2000) continue;
        for (const bool portable : {false, true}) {
          XXH3_state_t state;
          XXH3_64bits_reset(&state);
          for (std::size_t at = 0; at < n; at += piece)
            mrr::detail::xxh3_update(&state, p + at, std::min(piece, n - at), portable);
          ++checked;
          if (XXH3_64bits_digest(&state) != want && wrong++ == 0)
            FAIL_CHECK("length " << n << ", alignment " << align << ", pieces of " << piece
                                 << (portable ? ", baseline kernels" : ", this CPU's kernels"));
        }
      }
    }
  CHECK(wrong == 0);
  CHECK(checked == lengths.size() * 4 * 6 * 2 -
                       4 * 2 * std::count_if(lengths.begin(), lengths.end(), [](std::size_t n) { return n > 2000; }));
}
