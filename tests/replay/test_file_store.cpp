// FileRouteStore: round trips, the index and the rescan path, appending, and what a crash or
// damage does: a writer killed mid-append, files truncated at every byte of their last records,
// flipped bytes. Complete records are always recovered; damage is an error, never wrong ids.
#include <mrr/replay.hpp>

#include <doctest/doctest.h>

#include "temp_dir.hpp"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <iterator>
#include <optional>
#include <span>
#include <thread>
#include <vector>

namespace {

const mrr::RouteShape kShape{64, 3, 4};

// Deterministic routes of sequence uid: [tokens][layers][k].
std::vector<std::int32_t> routes_of(mrr::SequenceId uid, std::int64_t tokens, const mrr::RouteShape& s = kShape) {
  std::vector<std::int32_t> ids;
  for (std::int64_t t = 0; t < tokens; ++t)
    for (int l = 0; l < s.num_layers; ++l)
      for (int j = 0; j < s.topk; ++j)
        ids.push_back(static_cast<std::int32_t>((uid * 31 + static_cast<std::uint64_t>(t) * 7 +
                                                 static_cast<std::uint64_t>(l) * 5 + static_cast<std::uint64_t>(j) * 13) %
                                                static_cast<std::uint64_t>(s.num_experts)));
  return ids;
}

std::int64_t tokens_of(mrr::SequenceId uid) { return 5 + static_cast<std::int64_t>(uid % 7); }

// Checks that the store holds exactly routes_of(uid) for every layer and position of uid.
template <class Store>
void check_sequence(const Store& store, mrr::SequenceId uid, std::int64_t tokens) {
  CAPTURE(uid);
  const auto want = routes_of(uid, tokens);
  const std::vector<mrr::SequenceId> uids = {uid};
  const auto layout = mrr::TokenLayout::packed(uids, std::vector<std::int64_t>{0, tokens});
  for (int l = 0; l < kShape.num_layers; ++l) {
    mrr::ExpertIds got;
    std::vector<std::uint8_t> found;
    REQUIRE(store.lookup(l, layout, got, found) == static_cast<std::size_t>(tokens));
    for (std::int64_t t = 0; t < tokens; ++t)
      for (int j = 0; j < kShape.topk; ++j)
        REQUIRE(got(t, j) == want[static_cast<std::size_t>((t * kShape.num_layers + l) * kShape.topk + j)]);
  }
}

void write_sequences(const std::filesystem::path& path, mrr::SequenceId first, mrr::SequenceId count, bool append) {
  auto store = append ? mrr::FileRouteStore::append(path, kShape) : mrr::FileRouteStore::create(path, kShape);
  for (mrr::SequenceId uid = first; uid < first + count; ++uid)
    store.record_sequence(uid, 0, tokens_of(uid), 0, kShape.num_layers, routes_of(uid, tokens_of(uid)));
  store.close();
}

std::vector<char> read_bytes(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

void write_bytes(const std::filesystem::path& p, const std::vector<char>& bytes, std::size_t n) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(n));
}

}  // namespace

TEST_CASE("file store round trip: record per layer, reopen from the index, look up any layout") {
  mrr::test::TempDir dir;
  const auto path = dir / "routes.mrr";
  {
    auto store = mrr::FileRouteStore::create(path, kShape);
    CHECK(store.id_width() == 1);
    const std::vector<mrr::SequenceId> uids = {1, 2};
    const auto layout = mrr::TokenLayout::packed(uids, std::vector<std::int64_t>{0, tokens_of(1), tokens_of(1) + tokens_of(2)});
    for (int l = 0; l < kShape.num_layers; ++l) {
      mrr::ExpertIds ids(static_cast<Eigen::Index>(layout.size()), kShape.topk);
      for (std::size_t r = 0; r < layout.size(); ++r) {
        const auto all = routes_of(layout[r].uid, tokens_of(layout[r].uid));
        for (int j = 0; j < kShape.topk; ++j)
          ids(static_cast<Eigen::Index>(r), j) =
              all[static_cast<std::size_t>((layout[r].position * kShape.num_layers + l) * kShape.topk + j)];
      }
      store.record(l, layout, ids);
    }
    check_sequence(store, 1, tokens_of(1));  // readable while writing (R2 replays in the same run)
    store.release_cache();
    check_sequence(store, 2, tokens_of(2));  // ... also back from the file
  }
  auto store = mrr::FileRouteStore::open(path, kShape);
  CHECK(store.recovery().opened_from_index);
  CHECK(store.recovery().clean());
  CHECK(store.recovery().records == 2 * kShape.num_layers);
  CHECK(store.num_sequences() == 2);
  check_sequence(store, 1, tokens_of(1));
  check_sequence(store, 2, tokens_of(2));
  CHECK_THROWS_WITH_AS(store.record_sequence(3, 0, 1, 0, 3, routes_of(3, 1)), doctest::Contains("opened read-only"),
                       mrr::RouteFileError);
}

TEST_CASE("appending after a clean close keeps every record; the new index covers both sessions") {
  mrr::test::TempDir dir;
  const auto path = dir / "routes.mrr";
  write_sequences(path, 0, 3, false);
  write_sequences(path, 3, 4, true);
  auto store = mrr::FileRouteStore::open(path, kShape);
  CHECK(store.recovery().opened_from_index);
  CHECK(store.num_sequences() == 7);
  for (mrr::SequenceId uid = 0; uid < 7; ++uid) check_sequence(store, uid, tokens_of(uid));
  CHECK_THROWS_WITH_AS(mrr::FileRouteStore::create(path, kShape), doctest::Contains("it exists"), mrr::RouteFileError);
}

TEST_CASE("conflicting re-records are refused by the file store too") {
  mrr::test::TempDir dir;
  const auto path = dir / "routes.mrr";
  write_sequences(path, 0, 2, false);
  auto store = mrr::FileRouteStore::append(path, kShape);
  auto ids = routes_of(1, tokens_of(1));
  CHECK_NOTHROW(store.record_sequence(1, 0, tokens_of(1), 0, 3, ids));  // identical: no-op
  ids[5] = (ids[5] + 1) % 64;
  CHECK_THROWS_WITH_AS(store.record_sequence(1, 0, tokens_of(1), 0, 3, ids),
                       doctest::Contains("was already recorded with different experts"), mrr::RouteStoreError);
  store.close();
  CHECK(mrr::FileRouteStore::open(path).recovery().records == 2);
}

// Where route record `i` of write_sequences(path, 0, n) ends: the file header, then one record
// per sequence (record header, payload padded to 8 bytes).
std::size_t route_record_end(mrr::SequenceId i) {
  std::size_t end = mrr::route_file::kHeaderBytes;
  for (mrr::SequenceId j = 0; j <= i; ++j)
    end += mrr::route_file::record_bytes(static_cast<std::uint64_t>(tokens_of(j) * kShape.num_layers * kShape.topk));
  return end;
}

constexpr std::size_t kFirstPayload = mrr::route_file::kHeaderBytes + mrr::route_file::kRecordHeaderBytes;
const std::size_t kTailBytes = mrr::route_file::record_bytes(8);

TEST_CASE("truncation at every byte after the first record: complete records survive, the torn one is reported") {
  mrr::test::TempDir dir;
  const auto path = dir / "routes.mrr";
  write_sequences(path, 0, 3, false);
  const auto bytes = read_bytes(path);
  const auto cut_path = dir / "cut.mrr";
  std::size_t torn_seen = 0;
  for (std::size_t cut = 64; cut < bytes.size(); ++cut) {
    CAPTURE(cut);
    write_bytes(cut_path, bytes, cut);
    auto s = mrr::FileRouteStore::open(cut_path, kShape);
    const auto& rec = s.recovery();
    REQUIRE_FALSE(rec.opened_from_index);  // the tail record is the last thing written
    std::uint64_t complete = 0;
    while (complete < 3 && route_record_end(complete) <= cut) ++complete;
    CHECK(rec.records == complete);
    // A cleanly closed file continues with an index record (a count, then an entry per record).
    const std::size_t index_end =
        route_record_end(2) +
        mrr::route_file::record_bytes(8 + mrr::route_file::index_entry_bytes(mrr::route_file::kVersion) * 3);
    std::size_t good_end = complete == 0 ? 64 : route_record_end(complete - 1);
    if (cut >= index_end) good_end = index_end;
    CHECK(rec.torn_bytes == cut - good_end);
    if (rec.torn_bytes > 0) {
      CHECK(rec.torn_offset == good_end);
      ++torn_seen;
    }
    for (mrr::SequenceId uid : s.sequences()) check_sequence(s, uid, tokens_of(uid));
  }
  MESSAGE((bytes.size() - 64) << " truncation points checked, " << torn_seen << " left a torn record");
  CHECK(torn_seen > 0);
}

TEST_CASE("appending to a torn file truncates the torn record and carries on") {
  mrr::test::TempDir dir;
  const auto path = dir / "routes.mrr";
  write_sequences(path, 0, 3, false);
  auto bytes = read_bytes(path);
  write_bytes(path, bytes, route_record_end(2) - 20);  // a crash while writing the third record
  {
    auto s = mrr::FileRouteStore::append(path, kShape);
    CHECK(s.recovery().records == 2);
    CHECK(s.recovery().torn_bytes == route_record_end(2) - 20 - route_record_end(1));
    CHECK(s.recovery().describe(path).find("incomplete last record") != std::string::npos);
    s.record_sequence(9, 0, tokens_of(9), 0, 3, routes_of(9, tokens_of(9)));
  }
  auto s = mrr::FileRouteStore::open(path, kShape);
  CHECK(s.recovery().opened_from_index);
  CHECK(s.recovery().clean());
  CHECK(s.num_sequences() == 3);
  check_sequence(s, 0, tokens_of(0));
  check_sequence(s, 1, tokens_of(1));
  check_sequence(s, 9, tokens_of(9));
  CHECK_FALSE(s.contains(2));
}

TEST_CASE("a flipped byte is an error when its sequence is read, never wrong ids") {
  mrr::test::TempDir dir;
  const auto path = dir / "routes.mrr";
  write_sequences(path, 0, 4, false);
  const auto bytes = read_bytes(path);
  const auto bad = dir / "bad.mrr";
  // Flip one byte inside each of the first records' payloads (route records start at 64).
  std::size_t errors = 0;
  for (std::size_t at = kFirstPayload; at < kFirstPayload + 40; at += 7) {
    auto copy = bytes;
    copy[at] = static_cast<char>(copy[at] ^ 0x10);
    write_bytes(bad, copy, copy.size());
    auto s = mrr::FileRouteStore::open(bad, kShape);  // the index is intact
    CHECK(s.recovery().opened_from_index);
    const std::vector<mrr::SequenceId> uids = {0};
    const auto layout = mrr::TokenLayout::packed(uids, std::vector<std::int64_t>{0, tokens_of(0)});
    mrr::ExpertIds got;
    std::vector<std::uint8_t> found;
    CHECK_THROWS_WITH_AS(s.lookup(0, layout, got, found), doctest::Contains("is damaged"), mrr::RouteFileError);
    check_sequence(s, 1, tokens_of(1));  // other sequences are unaffected
    ++errors;
  }
  CHECK(errors > 0);
  // Without the index, the rescan meets the damage mid-file and refuses the file.
  auto copy = bytes;
  copy[kFirstPayload + 3] = static_cast<char>(copy[kFirstPayload + 3] ^ 0x01);
  write_bytes(bad, copy, copy.size() - kTailBytes);  // tail gone
  CHECK_THROWS_WITH_AS(mrr::FileRouteStore::open(bad, kShape), doctest::Contains("fails its checksum"),
                       mrr::RouteFileError);
  // A damaged index is rescanned, and reported.
  copy = bytes;
  copy[copy.size() - kTailBytes - 10] = static_cast<char>(copy[copy.size() - kTailBytes - 10] ^ 0x01);
  write_bytes(bad, copy, copy.size());
  auto s = mrr::FileRouteStore::open(bad, kShape);
  CHECK(s.recovery().index_damaged);
  CHECK(s.num_sequences() == 4);
  // A damaged file header refuses the file.
  copy = bytes;
  copy[17] = static_cast<char>(copy[17] ^ 0x01);
  write_bytes(bad, copy, copy.size());
  CHECK_THROWS_WITH_AS(mrr::FileRouteStore::open(bad), doctest::Contains("header fails its checksum"),
                       mrr::RouteFileError);
}

TEST_CASE("a damaged index left mid-file by an append is stepped over: a crashed or unfinished append still opens") {
  // A closed file whose index got damaged opens by rescanning; appending then leaves that index
  // (and its tail) inside the file. Until the appender's close() writes a new index, every open is
  // a rescan that meets the damaged index mid-file: it holds no routes, so it is skipped and
  // reported, and every routes record is recovered.
  mrr::test::TempDir dir;
  const auto path = dir / "routes.mrr";
  write_sequences(path, 0, 4, false);
  auto bytes = read_bytes(path);
  bytes[bytes.size() - kTailBytes - 10] = static_cast<char>(bytes[bytes.size() - kTailBytes - 10] ^ 0x01);
  write_bytes(path, bytes, bytes.size());
  {
    auto appender = mrr::FileRouteStore::append(path, kShape);
    CHECK(appender.recovery().index_damaged);
    for (mrr::SequenceId uid = 4; uid < 6; ++uid)
      appender.record_sequence(uid, 0, tokens_of(uid), 0, kShape.num_layers, routes_of(uid, tokens_of(uid)));
    // What a reader sees while the appender records, and what a crash now would leave behind.
    const auto crashed = dir / "crashed.mrr";
    std::filesystem::copy_file(path, crashed);
    for (const auto& p : {path, crashed}) {
      CAPTURE(p);
      auto reader = mrr::FileRouteStore::open(p, kShape);
      INFO(reader.recovery().describe(p));
      CHECK(reader.recovery().index_damaged);
      CHECK_FALSE(reader.recovery().opened_from_index);
      CHECK(reader.recovery().records == 6u);
      CHECK(reader.num_sequences() == 6);
      for (mrr::SequenceId uid = 0; uid < 6; ++uid)
        check_sequence(reader, uid, tokens_of(uid));
    }
    // The crashed copy takes more appends, and closes cleanly.
    write_sequences(crashed, 6, 1, true);
    auto reopened = mrr::FileRouteStore::open(crashed, kShape);
    CHECK(reopened.recovery().clean());
    CHECK(reopened.num_sequences() == 7);
    for (mrr::SequenceId uid = 0; uid < 7; ++uid)
      check_sequence(reopened, uid, tokens_of(uid));
  }
  auto closed = mrr::FileRouteStore::open(path, kShape);
  CHECK(closed.recovery().opened_from_index);
  CHECK(closed.num_sequences() == 6);
  for (mrr::SequenceId uid = 0; uid < 6; ++uid)
    check_sequence(closed, uid, tokens_of(uid));
}

// Lookups verify each record when they first read it (from the same read that decodes it), not
// the whole sequence up front: a damaged record is an error whenever any of its ids is asked for
// (however few, from a record larger than one read too), and the other records' ids stay usable.
TEST_CASE("a flipped byte in one layer's record: that layer's lookups fail, every time; the others are exact") {
  mrr::test::TempDir dir;
  const mrr::RouteShape shape{64, 3, 8};
  const std::vector<mrr::SequenceId> uids = {5};
  for (const std::int64_t tokens : {std::int64_t{100}, std::int64_t{40000}}) {  // 800 B and 320 KB records
    CAPTURE(tokens);
    const auto path = dir / ("routes" + std::to_string(tokens) + ".mrr");
    const auto layout = mrr::TokenLayout::packed(uids, std::vector<std::int64_t>{0, tokens});
    std::vector<mrr::ExpertIds> want;
    {
      auto store = mrr::FileRouteStore::create(path, shape);
      for (int l = 0; l < shape.num_layers; ++l) {  // one record per layer, as R2 writes them
        mrr::ExpertIds ids(tokens, shape.topk);
        for (std::int64_t t = 0; t < tokens; ++t)
          for (int j = 0; j < shape.topk; ++j)
            ids(t, j) = static_cast<std::int32_t>((t * 7 + j * 8 + l) % 64);
        store.record(l, layout, ids);
        want.push_back(ids);
      }
    }
    auto bytes = read_bytes(path);
    const std::size_t record = mrr::route_file::record_bytes(static_cast<std::uint64_t>(tokens * shape.topk));
    const std::size_t last_byte_of_layer1 = mrr::route_file::kHeaderBytes + 2 * record - 1;
    bytes[last_byte_of_layer1] = static_cast<char>(bytes[last_byte_of_layer1] ^ 0x04);
    const auto bad = dir / ("bad" + std::to_string(tokens) + ".mrr");
    write_bytes(bad, bytes, bytes.size());
    auto s = mrr::FileRouteStore::open(bad, shape);
    CHECK(s.recovery().opened_from_index);
    const auto first_rows = mrr::TokenLayout::packed(uids, std::vector<std::int64_t>{0, 3});  // 3 rows only
    for (int pass = 0; pass < 2; ++pass) {
      mrr::ExpertIds got;
      std::vector<std::uint8_t> found;
      mrr::RowMatrix<std::uint8_t> narrow;  // 1-byte ids, read (and verified) first: the same ids
      REQUIRE(s.lookup(2, layout, narrow, found) == static_cast<std::size_t>(tokens));
      CHECK(narrow == want[2].cast<std::uint8_t>());
      for (const int l : {0, 2}) {
        REQUIRE(s.lookup(l, layout, got, found) == static_cast<std::size_t>(tokens));
        CHECK(got == want[static_cast<std::size_t>(l)]);
      }
      CHECK_THROWS_WITH_AS(s.lookup(1, first_rows, got, found), doctest::Contains("fails its checksum"),
                           mrr::RouteFileError);
      CHECK_THROWS_WITH_AS(s.lookup(1, layout, got, found), doctest::Contains("fails its checksum"),
                           mrr::RouteFileError);
      // a lookup into 1-byte ids verifies the same way
      CHECK_THROWS_WITH_AS(s.lookup(1, first_rows, narrow, found), doctest::Contains("fails its checksum"),
                           mrr::RouteFileError);
      CHECK_THROWS_AS(s.sequence(5), mrr::RouteFileError);  // the table needs every record
      s.release_cache();                                    // read and verified again on the next pass
    }
  }
}

TEST_CASE("a damaged record size is damage, never mistaken for a torn tail (no later record is dropped)") {
  mrr::test::TempDir dir;
  const auto path = dir / "routes.mrr";
  write_sequences(path, 0, 4, false);
  auto bytes = read_bytes(path);
  bytes.resize(bytes.size() - kTailBytes);  // as after a crash: no tail, so the file is scanned
  // Make the second record claim a payload far past the end of the file.
  const std::size_t size_field = route_record_end(0) + 8;
  bytes[size_field + 5] = static_cast<char>(bytes[size_field + 5] ^ 0x40);
  const auto bad = dir / "bad.mrr";
  write_bytes(bad, bytes, bytes.size());
  CHECK_THROWS_WITH_AS(mrr::FileRouteStore::open(bad, kShape), doctest::Contains("no valid record header"),
                       mrr::RouteFileError);
  // Appending refuses too, rather than truncating the records after the damage away.
  CHECK_THROWS_AS(mrr::FileRouteStore::append(bad, kShape), mrr::RouteFileError);
  CHECK(std::filesystem::file_size(bad) == bytes.size());
}

TEST_CASE("a file of another model, a missing file and a non-route file are clear errors") {
  mrr::test::TempDir dir;
  const auto path = dir / "routes.mrr";
  write_sequences(path, 0, 1, false);
  CHECK_THROWS_WITH_AS(mrr::FileRouteStore::open(path, mrr::RouteShape{128, 3, 4}),
                       doctest::Contains("has num_experts = 64 but the model has 128"), mrr::RouteFileError);
  CHECK_THROWS_WITH_AS(mrr::FileRouteStore::open(path, mrr::RouteShape{64, 4, 4}),
                       doctest::Contains("num_layers (MoE layers) = 3 but the model has 4"), mrr::RouteFileError);
  CHECK_THROWS_WITH_AS(mrr::FileRouteStore::open(path, mrr::RouteShape{64, 3, 8}),
                       doctest::Contains("has topk = 4 but the model has 8"), mrr::RouteFileError);
  CHECK_THROWS_WITH_AS(mrr::FileRouteStore::open(dir / "missing.mrr"), doctest::Contains("does not exist"),
                       mrr::RouteFileError);
  std::ofstream(dir / "text.mrr") << "this is not a route file, but it is long enough to hold a header ......";
  CHECK_THROWS_WITH_AS(mrr::FileRouteStore::open(dir / "text.mrr"), doctest::Contains("not an mrr route file"),
                       mrr::RouteFileError);
}

TEST_CASE("a writer process killed mid-append loses at most the record it was writing") {
  mrr::test::TempDir dir;
  // Large records (1.5 MiB), prepared before writing starts, so the writer spends its time inside
  // write(2) and SIGKILL often lands mid-record (Linux then leaves a short write behind).
  const mrr::RouteShape big{256, 48, 8};
  const std::int64_t tokens = 4096;
  constexpr mrr::SequenceId kDistinct = 16;
  std::vector<std::vector<std::int32_t>> payloads;
  for (mrr::SequenceId i = 0; i < kDistinct; ++i) payloads.push_back(routes_of(i, tokens, big));
  int torn_runs = 0;
  for (int run = 0; run < 4; ++run) {
    const auto path = dir / ("killed" + std::to_string(run) + ".mrr");
    const pid_t child = ::fork();
    REQUIRE(child >= 0);
    if (child == 0) {
      try {
        auto store = mrr::FileRouteStore::create(path, big);
        for (mrr::SequenceId uid = 0;; ++uid)
          store.record_sequence(uid, 0, tokens, 0, big.num_layers, payloads[uid % kDistinct]);
      } catch (...) {
      }
      ::_exit(3);
    }
    // Let it write a varying amount, then kill it without warning.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    const std::uintmax_t target = (4u + static_cast<unsigned>(run) * 3u) << 20;
    std::error_code ec;
    while (std::chrono::steady_clock::now() < deadline &&
           (!std::filesystem::exists(path, ec) || std::filesystem::file_size(path, ec) < target))
      std::this_thread::sleep_for(std::chrono::microseconds(50 + 150 * run));
    ::kill(child, SIGKILL);
    int status = 0;
    ::waitpid(child, &status, 0);
    REQUIRE(WIFSIGNALED(status));

    auto store = mrr::FileRouteStore::open(path, big);
    const auto& rec = store.recovery();
    INFO(rec.describe(path));
    CHECK_FALSE(rec.opened_from_index);
    CHECK(rec.records >= 2);
    if (rec.torn_bytes > 0) ++torn_runs;
    // The recovered sequences are exactly 0 .. n-1, each one intact.
    const auto n = static_cast<mrr::SequenceId>(rec.records);
    CHECK(store.num_sequences() == n);
    std::vector<std::int32_t> row(static_cast<std::size_t>(big.topk));
    for (mrr::SequenceId uid = 0; uid < n; ++uid) {
      REQUIRE(store.contains(uid));
      const auto* seq = store.sequence(uid);
      REQUIRE(seq != nullptr);
      CHECK(seq->positions() == tokens);
      const auto& want = payloads[uid % kDistinct];
      bool same = true;
      for (std::int64_t t = 0; t < tokens && same; t += 61)
        for (int l = 0; l < big.num_layers && same; l += 5) {
          seq->get(t, l, row.data());
          for (int j = 0; j < big.topk; ++j)
            same = same && row[static_cast<std::size_t>(j)] ==
                               want[static_cast<std::size_t>((t * big.num_layers + l) * big.topk + j)];
        }
      CHECK(same);
      store.release_cache();
    }
    // Reopening for append truncates the torn tail; the next record follows the last complete one.
    {
      auto append = mrr::FileRouteStore::append(path, big);
      append.record_sequence(1000, 0, 4, 0, big.num_layers, routes_of(1000, 4, big));
    }
    auto after = mrr::FileRouteStore::open(path, big);
    CHECK(after.recovery().clean());
    CHECK(after.num_sequences() == n + 1);
  }
  MESSAGE("killed writers: " << torn_runs << " of 4 runs were killed inside a write and left a torn record");
}

TEST_CASE("file store record_sequence takes uint8 / uint16 ids as vLLM returns them, without widening") {
  mrr::test::TempDir dir;
  // 48 layers, k = 8: a rollout batch's worth of rows per sequence, in 1-byte (64 experts) and
  // 2-byte (300 experts) files, from int32, uint16 and uint8 ids of the same values.
  for (const int experts : {64, 300}) {
    CAPTURE(experts);
    const mrr::RouteShape shape{experts, 48, 8};
    const std::int64_t tokens = 700;
    std::vector<std::int32_t> wide;
    for (mrr::SequenceId uid = 1; uid <= 3; ++uid) {
      const auto part = routes_of(uid, tokens, shape);
      wide.insert(wide.end(), part.begin(), part.end());
    }
    const std::size_t per_seq = static_cast<std::size_t>(tokens) * 48 * 8;
    std::vector<std::uint16_t> u16(wide.begin(), wide.end());
    auto i32_store = mrr::FileRouteStore::create(dir / ("i32_" + std::to_string(experts)), shape);
    auto u16_store = mrr::FileRouteStore::create(dir / ("u16_" + std::to_string(experts)), shape);
    for (mrr::SequenceId uid = 1; uid <= 3; ++uid) {
      const std::size_t at = (uid - 1) * per_seq;
      i32_store.record_sequence(uid, 0, tokens, 0, 48, std::span<const std::int32_t>(wide.data() + at, per_seq));
      u16_store.record_sequence(uid, 0, tokens, 0, 48, std::span<const std::uint16_t>(u16.data() + at, per_seq));
    }
    std::vector<mrr::FileRouteStore*> stores = {&i32_store, &u16_store};
    std::optional<mrr::FileRouteStore> u8_store;
    if (experts <= 256) {
      std::vector<std::uint8_t> u8(wide.begin(), wide.end());
      u8_store.emplace(mrr::FileRouteStore::create(dir / "u8", shape));
      for (mrr::SequenceId uid = 1; uid <= 3; ++uid)
        u8_store->record_sequence(uid, 0, tokens, 0, 48,
                                  std::span<const std::uint8_t>(u8.data() + (uid - 1) * per_seq, per_seq));
      stores.push_back(&*u8_store);
      // The same bytes reach the file (uint8 ids are written from the caller's array, int32 ones
      // encoded first): every byte of the records and of the index's entries (the header, the
      // index's and the tail's record headers hold each file's own id).
      u8_store->close();
      i32_store.close();
      auto bytes_of = [](const std::filesystem::path& p) {
        std::ifstream f(p, std::ios::binary);
        return std::vector<char>(std::istreambuf_iterator<char>(f), {});
      };
      auto a = bytes_of(dir / "u8");
      auto b = bytes_of(dir / ("i32_" + std::to_string(experts)));
      REQUIRE(a.size() == b.size());
      std::uint64_t index_at = 0;  // the tail's payload
      std::memcpy(&index_at, a.data() + a.size() - 8, 8);
      REQUIRE(index_at < a.size());
      const auto records = [&](const std::vector<char>& f) {
        return std::vector<char>(f.begin() + mrr::route_file::kHeaderBytes, f.begin() + static_cast<long>(index_at));
      };
      const auto entries = [&](const std::vector<char>& f) {
        return std::vector<char>(f.begin() + static_cast<long>(index_at + mrr::route_file::kRecordHeaderBytes),
                                 f.end() - static_cast<long>(kTailBytes));
      };
      CHECK(records(a) == records(b));
      CHECK(entries(a) == entries(b));
    }
    const std::vector<mrr::SequenceId> uids = {3, 1, 2};
    const auto layout = mrr::TokenLayout::packed(uids, std::vector<std::int64_t>{0, tokens, 2 * tokens, 3 * tokens});
    for (int l : {0, 23, 47}) {
      mrr::ExpertIds want, got;
      std::vector<std::uint8_t> found;
      REQUIRE(stores[0]->lookup(l, layout, want, found) == static_cast<std::size_t>(3 * tokens));
      for (std::size_t s = 1; s < stores.size(); ++s) {
        REQUIRE(stores[s]->lookup(l, layout, got, found) == static_cast<std::size_t>(3 * tokens));
        CHECK(got == want);
      }
      // And they are the ids that were given (sequence 3 first in this layout).
      CHECK(want(0, 0) == wide[2 * per_seq + static_cast<std::size_t>(l) * 8]);
    }
  }

  // Out of range in its own type: uint8 64 in a 64-expert file is an error naming where; nothing
  // is written. A conflicting re-record is an error; an identical one is a no-op.
  const mrr::RouteShape shape{64, 2, 2};
  auto store = mrr::FileRouteStore::create(dir / "checks", shape);
  std::vector<std::uint8_t> ids = {1, 2, 3, 4, 5, 6, 7, 8};  // [2 tokens][2 layers][2]
  ids[5] = 64;
  CHECK_THROWS_WITH_AS(store.record_sequence(9, 0, 2, 0, 2, std::span<const std::uint8_t>(ids)),
                       doctest::Contains("sequence 9 position 1 layer 0"), mrr::InvalidArgument);
  CHECK_FALSE(store.contains(9));
  ids[5] = 6;
  store.record_sequence(9, 0, 2, 0, 2, std::span<const std::uint8_t>(ids));
  const auto size = std::filesystem::file_size(dir / "checks");
  store.record_sequence(9, 0, 2, 0, 2, std::span<const std::uint8_t>(ids));
  CHECK(std::filesystem::file_size(dir / "checks") == size);
  // A held sequence extended with a bad id (checked before its records are compared): an error.
  std::vector<std::uint8_t> more = {1, 2, 3, 200};  // position 2, [2 layers][2]; 200 >= 64
  CHECK_THROWS_WITH_AS(store.record_sequence(9, 2, 1, 0, 2, std::span<const std::uint8_t>(more)),
                       doctest::Contains("sequence 9 position 2 layer 1"), mrr::InvalidArgument);
  CHECK(store.recorded_positions(9) == 2);
  ids[0] = 9;
  CHECK_THROWS_WITH_AS(store.record_sequence(9, 0, 2, 0, 2, std::span<const std::uint8_t>(ids)),
                       doctest::Contains("already recorded with different experts"), mrr::RouteStoreError);
  // vLLM's uint8 array through import_routed_experts takes the same path.
  const std::vector<std::uint8_t> routed = {10, 11, 12, 13};  // [1 token][2 layers][2]
  mrr::import_routed_experts<mrr::FileRouteStore, std::uint8_t>(store, 10, routed, 1, 2, 2);
  mrr::ExpertIds got;
  std::vector<std::uint8_t> found;
  const std::vector<mrr::SequenceId> one = {10};
  REQUIRE(store.lookup(1, mrr::TokenLayout::packed(one, std::vector<std::int64_t>{0, 1}), got, found) == 1);
  CHECK(got(0, 0) == 12);
  CHECK(got(0, 1) == 13);
}
