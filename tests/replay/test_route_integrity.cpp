// Recorded ids or a clear error, whatever happens around a store: two rows of a batch that
// disagree (every store, one check), sequences too sparse for memory (every store), route files
// truncated, replaced or renamed while open, writers racing to create a file, and FIFOs where a
// file is expected.
#include <mrr/replay.hpp>
#include <mrr/router.hpp>

#include <doctest/doctest.h>
#include <support/fifo.hpp>
#include <support/random.hpp>

#include "temp_dir.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

namespace {

mrr::TokenLayout span_layout(mrr::SequenceId uid, std::int64_t first, std::int64_t n) {
  std::vector<mrr::TokenKey> rows;
  for (std::int64_t t = 0; t < n; ++t) rows.push_back({uid, first + t});
  return mrr::TokenLayout(std::move(rows));
}

mrr::ExpertIds ids_for(std::int64_t n, int k, int experts, int salt) {
  mrr::ExpertIds ids(n, k);
  for (std::int64_t t = 0; t < n; ++t)
    for (int j = 0; j < k; ++j) ids(t, j) = static_cast<std::int32_t>((t * 5 + j * 3 + salt) % experts);
  return ids;
}

// Writes a closed route file holding sequences 1..4, 64 positions, one layer, ids from `salt`.
void write_routes(const std::filesystem::path& path, int salt) {
  auto store = mrr::FileRouteStore::create(path, {32, 1, 2});
  for (mrr::SequenceId uid = 1; uid <= 4; ++uid) store.record(0, span_layout(uid, 0, 64), ids_for(64, 2, 32, salt));
  store.close();
}

// An empty store of either kind (a file store writes r.mrr in `dir`).
template <class Store>
Store new_store(const mrr::test::TempDir& dir, const mrr::RouteShape& shape) {
  if constexpr (std::is_same_v<Store, mrr::FileRouteStore>)
    return mrr::FileRouteStore::create(dir / "r.mrr", shape);
  else
    return mrr::MemoryRouteStore(shape);
}

// A FIFO named where a file is expected is refused at once, naming the file and what it is.
void refused_without_blocking(const std::filesystem::path& fifo, const std::function<void()>& f, const char* what) {
  const auto start = std::chrono::steady_clock::now();
  const std::string message = mrr::test::error_or_blocked(fifo, f, std::chrono::seconds(5));
  INFO(what << ": " << message);
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(4));
  CHECK(message.find("FIFO") != std::string::npos);
  CHECK(message.find(fifo.filename().string()) != std::string::npos);
}

}  // namespace

TEST_CASE_TEMPLATE("every store refuses a batch whose rows for one token disagree, whichever runs hold them", Store,
                   mrr::MemoryRouteStore, mrr::FileRouteStore) {
  mrr::test::TempDir dir;
  const mrr::RouteShape shape{16, 1, 2};
  auto store = new_store<Store>(dir, shape);
  // Sequence 7: positions 0-9, then position 2 again, then positions 5-7 with other experts. The
  // third run overlaps the first, not its neighbour in sorted order (the second).
  std::vector<mrr::TokenKey> rows;
  for (int p = 0; p < 10; ++p) rows.push_back({7, p});
  rows.push_back({7, 2});
  for (int p = 5; p < 8; ++p) rows.push_back({7, p});
  mrr::ExpertIds ids(static_cast<Eigen::Index>(rows.size()), 2);
  for (Eigen::Index r = 0; r < ids.rows(); ++r) ids.row(r) << static_cast<int>(r % 10), 15;
  ids.row(10) << 2, 15;  // position 2 again: agrees
  ids.row(12) << 3, 4;   // position 6: disagrees with row 6
  ids.row(11) << 5, 15;  // position 5: agrees
  ids.row(13) << 7, 15;  // position 7: agrees
  CHECK_THROWS_WITH_AS(store.record(0, mrr::TokenLayout(rows), ids),
                       doctest::Contains("(rows 6 and 12) hold sequence 7 position 6 but carry different experts"),
                       mrr::RouteStoreError);
  CHECK_FALSE(store.contains(7));  // nothing was recorded
  // The same batch with row 12 agreeing is recorded, and position 6 replays row 6.
  ids.row(12) << 6, 15;
  store.record(0, mrr::TokenLayout(rows), ids);
  mrr::ExpertIds got;
  std::vector<std::uint8_t> found;
  REQUIRE(store.lookup(0, span_layout(7, 6, 1), got, found) == 1);
  CHECK(got(0, 0) == 6);
}

TEST_CASE_TEMPLATE("every store bounds sparse positions: 0 and 2^32 - 1 over 48 layers are refused, not 1.5 TiB", Store,
                   mrr::MemoryRouteStore, mrr::FileRouteStore) {
  mrr::test::TempDir dir;
  const mrr::RouteShape shape{64, 48, 8};
  auto store = new_store<Store>(dir, shape);
  const std::int64_t last = mrr::kMaxPositions - 1;
  store.record(0, span_layout(3, 0, 1), ids_for(1, 8, 64, 0));
  CHECK_THROWS_WITH_AS(store.record(0, span_layout(3, last, 1), ids_for(1, 8, 64, 1)),
                       doctest::Contains("a table that sparse is refused"), mrr::InvalidArgument);
  const std::vector<std::int32_t> block(48 * 8, 1);
  CHECK_THROWS_WITH_AS(store.record_sequence(3, last, 1, 0, 48, block), doctest::Contains("sequence uid 3"),
                       mrr::InvalidArgument);
  // Both at once in one batch, for a new sequence.
  CHECK_THROWS_AS(store.record(0, mrr::TokenLayout({{4, 0}, {4, last}}), ids_for(2, 8, 64, 2)), mrr::InvalidArgument);
  CHECK_FALSE(store.contains(4));
  CHECK(store.recorded_positions(3) == 1);
  // Far from 0 but dense is fine: a context-parallel shard starting at 2^31.
  store.record(5, span_layout(9, std::int64_t{1} << 31, 64), ids_for(64, 8, 64, 3));
  CHECK(store.recorded_positions(9) == (std::int64_t{1} << 31) + 64);
  // R2 records one layer of a long sequence before the next: 1/48 of its table, never refused.
  store.record(0, span_layout(10, 0, 32768), ids_for(32768, 8, 64, 4));
  store.record(47, span_layout(10, 0, 32768), ids_for(32768, 8, 64, 5));
  CHECK(store.recorded_positions(10) == 32768);
}

TEST_CASE("a route file truncated under an open reader is an error, never SIGBUS or wrong ids") {
  mrr::test::TempDir dir;
  const auto path = dir / "r.mrr";
  write_routes(path, 0);
  const auto reader = mrr::FileRouteStore::open(path);
  mrr::ExpertIds got;
  std::vector<std::uint8_t> found;
  REQUIRE(reader.lookup(0, span_layout(1, 0, 64), got, found) == 64);  // sequence 1 loaded
  REQUIRE(::truncate(path.c_str(), 200) == 0);
  CHECK_THROWS_WITH_AS(reader.lookup(0, span_layout(1, 0, 64), got, found),
                       doctest::Contains("was truncated or replaced while open"), mrr::RouteFileError);
  CHECK_THROWS_WITH_AS(reader.lookup(0, span_layout(3, 0, 64), got, found),
                       doctest::Contains("was truncated or replaced while open"), mrr::RouteFileError);
  CHECK_THROWS_AS(reader.sequence(4), mrr::RouteFileError);
  REQUIRE(::truncate(path.c_str(), 0) == 0);
  CHECK_THROWS_AS(reader.lookup(0, span_layout(1, 0, 64), got, found), mrr::RouteFileError);
}

TEST_CASE("another route file copied over an open one: its ids are never returned") {
  mrr::test::TempDir dir;
  const auto path = dir / "r.mrr", other = dir / "other.mrr";
  write_routes(path, 0);
  write_routes(other, 1);  // same shape, sequences and sizes; other ids
  const auto reader = mrr::FileRouteStore::open(path);
  mrr::ExpertIds got;
  std::vector<std::uint8_t> found;
  REQUIRE(reader.lookup(0, span_layout(1, 0, 64), got, found) == 64);
  CHECK(got == ids_for(64, 2, 32, 0));
  // cp other r.mrr: the same inode, truncated and rewritten.
  std::filesystem::copy_file(other, path, std::filesystem::copy_options::overwrite_existing);
  CHECK_THROWS_WITH_AS(reader.lookup(0, span_layout(1, 0, 64), got, found), doctest::Contains("was replaced or rewritten"),
                       mrr::RouteFileError);
  CHECK_THROWS_WITH_AS(reader.lookup(0, span_layout(2, 0, 64), got, found), doctest::Contains("was replaced or rewritten"),
                       mrr::RouteFileError);
  CHECK_THROWS_AS(reader.sequence(3), mrr::RouteFileError);
  // Renamed over instead: the reader keeps the file it opened, and its ids.
  const auto reader2 = mrr::FileRouteStore::open(other);
  write_routes(dir / "third.mrr", 2);
  std::filesystem::rename(dir / "third.mrr", other);
  REQUIRE(reader2.lookup(0, span_layout(1, 0, 64), got, found) == 64);
  CHECK(got == ids_for(64, 2, 32, 1));
}

TEST_CASE("a file renamed over (or removed from) the path of an open writer: recording stops with an error") {
  mrr::test::TempDir dir;
  const auto path = dir / "r.mrr";
  auto writer = mrr::FileRouteStore::create(path, {32, 1, 2});
  writer.record(0, span_layout(1, 0, 8), ids_for(8, 2, 32, 0));

  SUBCASE("renamed over") {
    write_routes(dir / "other.mrr", 1);
    std::filesystem::rename(dir / "other.mrr", path);
    CHECK_THROWS_WITH_AS(writer.record(0, span_layout(9, 0, 8), ids_for(8, 2, 32, 0)),
                         doctest::Contains("was replaced (another file renamed over it) while this writer had it open"),
                         mrr::RouteFileError);
    // A second writer on the path gets the new file, which the first never writes to.
    auto second = mrr::FileRouteStore::append(path, {32, 1, 2});
    CHECK(second.contains(4));
    CHECK_FALSE(second.contains(9));
  }
  SUBCASE("removed") {
    std::filesystem::remove(path);
    CHECK_THROWS_WITH_AS(writer.record_sequence(2, 0, 1, 0, 1, std::vector<std::int32_t>{1, 2}),
                         doctest::Contains("was removed while this writer had it open"), mrr::RouteFileError);
    CHECK_THROWS_AS(writer.close(), mrr::RouteFileError);
  }
  SUBCASE("truncated by another program") {
    REQUIRE(::truncate(path.c_str(), 64) == 0);
    CHECK_THROWS_WITH_AS(writer.record(0, span_layout(2, 0, 8), ids_for(8, 2, 32, 0)),
                         doctest::Contains("another program truncated or wrote it"), mrr::RouteFileError);
  }
  SUBCASE("left alone, it records and reads back") {
    writer.record(0, span_layout(2, 0, 8), ids_for(8, 2, 32, 5));
    mrr::ExpertIds got;
    std::vector<std::uint8_t> found;
    REQUIRE(writer.lookup(0, span_layout(2, 0, 8), got, found) == 8);
    CHECK(got == ids_for(8, 2, 32, 5));
  }
}

TEST_CASE("writers racing to append to a new file: one records, the other is told the file is locked") {
  mrr::test::TempDir dir;
  const mrr::RouteShape shape{32, 1, 2};
  int winners = 0, locked = 0;
  std::vector<std::string> other_errors;
  for (int round = 0; round < 600; ++round) {
    const auto path = dir / ("race" + std::to_string(round) + ".mrr");
    std::atomic<int> ready{0};
    std::string outcome[2];
    auto racer = [&](int who) {
      ready.fetch_add(1);
      while (ready.load() < 2) {
      }
      try {
        auto store = mrr::FileRouteStore::append(path, shape);
        store.record(0, span_layout(static_cast<mrr::SequenceId>(who), 0, 4), ids_for(4, 2, 32, who));
        outcome[who] = "ok";
      } catch (const std::exception& e) {
        outcome[who] = e.what();
      }
    };
    std::thread a(racer, 0), b(racer, 1);
    a.join();
    b.join();
    for (const std::string& o : outcome) {
      if (o == "ok")
        ++winners;
      else if (o.find("is locked by another writer") != std::string::npos)
        ++locked;
      else
        other_errors.push_back(o);
    }
    // Whatever happened, the file is a valid route file holding what the winners recorded.
    const auto reader = mrr::FileRouteStore::open(path, shape);
    CHECK(reader.num_sequences() == static_cast<std::size_t>((outcome[0] == "ok") + (outcome[1] == "ok")));
  }
  MESSAGE(winners << " appends recorded, " << locked << " refused as locked");
  CHECK(other_errors.empty());
  if (!other_errors.empty()) MESSAGE("first other error: " << other_errors.front());
  CHECK(winners >= 600);
}

TEST_CASE("an empty file (a creator stopped before its header) is started anew by append, refused by open") {
  mrr::test::TempDir dir;
  const auto path = dir / "empty.mrr";
  std::ofstream(path).close();
  CHECK_THROWS_WITH_AS(mrr::FileRouteStore::open(path), doctest::Contains("too short to hold a header"),
                       mrr::RouteFileError);
  {
    auto store = mrr::FileRouteStore::append(path, {32, 1, 2});
    store.record(0, span_layout(1, 0, 4), ids_for(4, 2, 32, 0));
  }
  CHECK(mrr::FileRouteStore::open(path).contains(1));
}

TEST_CASE("a FIFO as a route file, replay_file or .npy is refused at once, never waited on") {
  mrr::test::TempDir dir;
  const auto fifo = dir / "routes.fifo";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  refused_without_blocking(fifo, [&] { (void)mrr::FileRouteStore::open(fifo); }, "open");
  refused_without_blocking(fifo, [&] { (void)mrr::FileRouteStore::append(fifo, {32, 1, 2}); }, "append");
  refused_without_blocking(fifo, [&] { (void)mrr::read_npy(fifo); }, "read_npy");
  mrr::ReplayConfig config;
  config.mode = mrr::ReplayMode::R3;
  config.enable_rollout_routing_replay = true;
  config.replay_file = fifo.string();
  refused_without_blocking(fifo, [&] { (void)mrr::open_route_file(config, {32, 1, 2}); }, "replay_file");
  // A directory is named as one too.
  CHECK_THROWS_WITH_AS(mrr::FileRouteStore::open(dir.path()), doctest::Contains("is a directory, not a regular file"),
                       mrr::RouteFileError);
}

TEST_CASE("close() releases the writer's lock: a second writer appends while the first (still readable) lives") {
  mrr::test::TempDir dir;
  const auto path = dir / "r.mrr";
  auto first = mrr::FileRouteStore::create(path, {32, 1, 2});
  first.record(0, span_layout(1, 0, 8), ids_for(8, 2, 32, 0));
  CHECK_THROWS_WITH_AS(mrr::FileRouteStore::append(path, {32, 1, 2}), doctest::Contains("is locked by another writer"),
                       mrr::RouteFileError);
  first.close();
  CHECK_FALSE(first.is_open());
  {
    auto second = mrr::FileRouteStore::append(path, {32, 1, 2});
    second.record(0, span_layout(2, 0, 8), ids_for(8, 2, 32, 1));
  }
  // The first still reads what it recorded; recording again is refused as closed.
  mrr::ExpertIds got;
  std::vector<std::uint8_t> found;
  REQUIRE(first.lookup(0, span_layout(1, 0, 8), got, found) == 8);
  CHECK(got == ids_for(8, 2, 32, 0));
  CHECK_THROWS_WITH_AS(first.record(0, span_layout(3, 0, 8), ids_for(8, 2, 32, 0)), doctest::Contains("is closed"),
                       mrr::RouteFileError);
  CHECK(mrr::FileRouteStore::open(path).num_sequences() == 2);
}

TEST_CASE("FileRouteStore is move-assignable: the store assigned over is closed (index written, lock released)") {
  mrr::test::TempDir dir;
  auto store = mrr::FileRouteStore::create(dir / "a.mrr", {32, 1, 2});
  store.record(0, span_layout(1, 0, 8), ids_for(8, 2, 32, 0));
  store = mrr::FileRouteStore::create(dir / "b.mrr", {32, 1, 2});
  store.record(0, span_layout(2, 0, 8), ids_for(8, 2, 32, 1));
  CHECK(store.path() == dir / "b.mrr");
  const auto a = mrr::FileRouteStore::open(dir / "a.mrr");
  CHECK(a.recovery().opened_from_index);  // closed cleanly by the assignment
  CHECK(a.contains(1));
  auto a_again = mrr::FileRouteStore::append(dir / "a.mrr", {32, 1, 2});  // its lock was released
  CHECK(a_again.contains(1));
  mrr::FileRouteStore moved(std::move(store));
  CHECK_FALSE(store.is_open());  // NOLINT(bugprone-use-after-move): the moved-from state is specified
  CHECK_THROWS_WITH_AS(store.record(0, span_layout(3, 0, 8), ids_for(8, 2, 32, 0)), doctest::Contains("is closed"),
                       mrr::RouteFileError);
  mrr::ExpertIds got;
  std::vector<std::uint8_t> found;
  CHECK_THROWS_WITH_AS(store.lookup(0, span_layout(2, 0, 8), got, found), doctest::Contains("was moved from"),
                       mrr::RouteFileError);
  REQUIRE(moved.lookup(0, span_layout(2, 0, 8), got, found) == 8);
  CHECK(got == ids_for(8, 2, 32, 1));
}

TEST_CASE("AnyRouteStore: a configuration picks memory or a route file at run time; both replay what was recorded") {
  mrr::test::TempDir dir;
  const mrr::RouteShape shape{32, 2, 2};
  mrr::ReplayConfig config;
  config.mode = mrr::ReplayMode::R2;
  auto memory = mrr::AnyRouteStore::from_config(config, shape);
  CHECK_FALSE(memory.is_file());
  config.record_file = (dir / "r2.mrr").string();
  {
    auto file = mrr::AnyRouteStore::from_config(config, shape);
    CHECK(file.is_file());
    for (auto* store : {&memory, &file}) {
      mrr::RoutingReplay<mrr::AnyRouteStore> replay(mrr::ReplayMode::R2, *store);
      const mrr::TopKRouter<float> router(mrr::presets::mixtral(32, 2));
      replay.set_micro_batch(span_layout(4, 0, 16));
      replay.begin_pass(mrr::TrainingPass::old_log_prob);
      const auto z = mrr::test::random_normal<float>(16, 32, 3);
      const auto recorded = replay.route(router, 1, z);
      replay.begin_pass(mrr::TrainingPass::actor_update);
      CHECK(replay.route(router, 1, mrr::test::random_normal<float>(16, 32, 4)).ids == recorded.ids);
      CHECK(store->contains(4));
      store->end_step();
    }
    CHECK_FALSE(memory.contains(4));  // memory forgets a finished step
    CHECK(file.contains(4));          // the file keeps it
  }
  // The file replays in a later run.
  config.record_file.clear();
  config.replay_file = (dir / "r2.mrr").string();
  auto replayed = mrr::AnyRouteStore::from_config(config, shape);
  CHECK(replayed.is_file());
  CHECK(replayed.recorded_positions(4) == 16);
  mrr::ExpertIds ids;  // lookups into int32 and into 1-byte ids, through the variant
  mrr::RowMatrix<std::uint8_t> bytes;
  std::vector<std::uint8_t> found, found_bytes;
  const auto layout = span_layout(4, 0, 20);  // 16 recorded positions and 4 beyond them
  CHECK(replayed.lookup(1, layout, ids, found) == 16);
  CHECK(replayed.lookup(1, layout, bytes, found_bytes) == 16);
  CHECK(found_bytes == found);
  CHECK(bytes.topRows(16) == ids.topRows(16).cast<std::uint8_t>());
  CHECK((bytes.bottomRows(4).array() == 0xff).all());
  CHECK_THROWS_AS(mrr::AnyRouteStore::from_config(config, {32, 3, 2}), mrr::RouteFileError);  // another model
}
