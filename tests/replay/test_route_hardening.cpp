// Untrusted sizes: positions past the bound, crafted route-file headers and records (with valid
// checksums), two writers on one file, symlinks that lead nowhere, and crafted .npy files. Each
// is an mrr exception naming the file or argument and the field, never a wrapped size, a huge
// allocation or ids out of thin air.
#include <mrr/replay.hpp>

#include <doctest/doctest.h>

#include "temp_dir.hpp"

#include <dlfcn.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

namespace {

namespace rf = mrr::route_file;

std::vector<std::int32_t> some_ids(std::size_t n, int experts) {
  std::vector<std::int32_t> ids(n);
  for (std::size_t i = 0; i < n; ++i)
    ids[i] = static_cast<std::int32_t>((i * 7 + 3) % static_cast<std::size_t>(experts));
  return ids;
}

std::size_t hits(const auto& store, mrr::SequenceId uid, std::int64_t position, int layer) {
  mrr::TokenLayout layout({mrr::TokenKey{uid, position}});
  mrr::ExpertIds got;
  std::vector<std::uint8_t> found;
  return store.lookup(layer, layout, got, found);
}

void append_bytes(std::vector<unsigned char>& out, const unsigned char* p, std::size_t n) {
  out.insert(out.end(), p, p + n);
}

std::vector<unsigned char> file_header(std::uint32_t experts, std::uint32_t layers, std::uint32_t topk,
                                       std::uint8_t id_width, std::uint16_t version = rf::kVersion) {
  rf::FileHeader h;
  h.version = version;
  h.id_width = id_width;
  h.shape = {static_cast<std::int32_t>(experts), static_cast<std::int32_t>(layers), static_cast<std::int32_t>(topk)};
  std::vector<unsigned char> out(rf::kHeaderBytes);
  rf::encode(h, out.data());
  return out;
}

// The format version of the file being crafted in `file` (its header's; the newest when it has
// none yet, as for a record crafted on its own).
std::uint16_t version_of(const std::vector<unsigned char>& file) {
  return file.size() >= rf::kHeaderBytes ? rf::detail::get<std::uint16_t>(file.data() + 8) : rf::kVersion;
}

// A routes record with valid header check and checksum (as the file's version computes it),
// whatever its fields say.
void add_record(std::vector<unsigned char>& file, rf::RecordHeader h, const std::vector<unsigned char>& payload) {
  unsigned char hb[rf::kRecordHeaderBytes];
  rf::encode(version_of(file), h, payload.data(), hb);
  append_bytes(file, hb, sizeof hb);
  append_bytes(file, payload.data(), payload.size());
  file.resize(file.size() + (rf::padded(payload.size()) - payload.size()), 0);
}

// An index of the given (uid, offset) routes records and the tail, as close() writes them in the
// file's version: in version 2 each entry also says what the record header at its offset says of
// the rows, as an honest writer's index would (one token of one layer where no header is there,
// so that the offsets, not the entry's rows, are what a reader refuses).
void add_index(std::vector<unsigned char>& file, const std::vector<std::pair<std::uint64_t, std::uint64_t>>& entries) {
  const std::size_t entry = rf::index_entry_bytes(version_of(file));
  std::vector<unsigned char> payload(8 + entry * entries.size(), 0);
  rf::detail::put<std::uint64_t>(payload.data(), entries.size());
  for (std::size_t i = 0; i < entries.size(); ++i) {
    unsigned char* e = payload.data() + 8 + entry * i;
    rf::detail::put<std::uint64_t>(e, entries[i].first);
    rf::detail::put<std::uint64_t>(e + 8, entries[i].second);
    rf::RecordHeader h;
    h.num_tokens = 1;
    h.num_layers = 1;
    if (entry == 32) {
      if (entries[i].second + rf::kRecordHeaderBytes <= file.size()) (void)rf::decode(file.data() + entries[i].second, h);
      rf::detail::put<std::int64_t>(e + 16, h.first_position);
      rf::detail::put<std::uint32_t>(e + 24, h.num_tokens);
      rf::detail::put<std::uint16_t>(e + 28, h.first_layer);
      rf::detail::put<std::uint16_t>(e + 30, h.num_layers);
    }
  }
  const std::uint64_t index_at = file.size();
  rf::RecordHeader ih;
  ih.type = rf::RecordType::index;
  ih.payload_bytes = payload.size();
  add_record(file, ih, payload);
  std::vector<unsigned char> tail(8);
  rf::detail::put<std::uint64_t>(tail.data(), index_at);
  rf::RecordHeader th;
  th.type = rf::RecordType::tail;
  th.payload_bytes = 8;
  add_record(file, th, tail);
}

rf::RecordHeader routes_header(mrr::SequenceId uid, std::int64_t first_position, std::uint32_t tokens,
                               std::uint16_t layers, std::uint64_t payload_bytes) {
  rf::RecordHeader h;
  h.type = rf::RecordType::routes;
  h.uid = uid;
  h.first_position = first_position;
  h.num_tokens = tokens;
  h.first_layer = 0;
  h.num_layers = layers;
  h.payload_bytes = payload_bytes;
  return h;
}

void write_file(const std::filesystem::path& p, const std::vector<unsigned char>& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

void write_text(const std::filesystem::path& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// A .npy file (version 1 unless a 4-byte header length is asked for) with this header text.
std::string npy(std::string header, std::size_t data_bytes, int version = 1, std::uint32_t forced_len = 0) {
  const std::size_t preamble = version == 1 ? 10 : 12;
  while ((preamble + header.size() + 1) % 64 != 0)
    header += ' ';
  header += '\n';
  const auto len = forced_len != 0 ? forced_len : static_cast<std::uint32_t>(header.size());
  std::string out = "\x93NUMPY";
  out += static_cast<char>(version);
  out += '\0';
  out += static_cast<char>(len & 0xff);
  out += static_cast<char>((len >> 8) & 0xff);
  if (version != 1) {
    out += static_cast<char>((len >> 16) & 0xff);
    out += static_cast<char>((len >> 24) & 0xff);
  }
  out += header;
  out.append(data_bytes, '\1');
  return out;
}

std::string dict(const std::string& descr, const std::string& shape) {
  return "{'descr': '" + descr + "', 'fortran_order': False, 'shape': " + shape + ", }";
}

}  // namespace

TEST_CASE("positions past 2^32 are refused by every store, never wrapped into the table") {
  const mrr::RouteShape shape{256, 256, 2};
  const auto ids = some_ids(256 * 2, 256);
  const std::int64_t far = std::int64_t{1} << 56;  // far * 256 layers wraps to 0 in 64 bits
  mrr::MemoryRouteStore memory(shape);
  CHECK_THROWS_WITH_AS(memory.record_sequence(1, far, 1, 0, 256, ids), doctest::Contains("positions must be < 2^32"),
                       mrr::InvalidArgument);
  CHECK(hits(memory, 1, 0, 0) == 0);  // nothing recorded: no ids out of thin air
  CHECK_FALSE(memory.contains(1));

  mrr::test::TempDir dir;
  auto file = mrr::FileRouteStore::create(dir / "r.mrr", shape);
  CHECK_THROWS_WITH_AS(file.record_sequence(1, far, 1, 0, 256, ids), doctest::Contains("positions must be < 2^32"),
                       mrr::InvalidArgument);
  CHECK(hits(file, 1, 0, 0) == 0);

  // The last valid position works, and costs one position of table, not 2^32.
  const std::int64_t last = mrr::kMaxPositions - 1;
  memory.record_sequence(2, last, 1, 0, 256, ids);
  file.record_sequence(2, last, 1, 0, 256, ids);
  CHECK(hits(memory, 2, last, 255) == 1);
  CHECK(hits(file, 2, last, 255) == 1);
  CHECK(hits(memory, 2, 0, 0) == 0);
  CHECK(memory.memory_bytes() < (1u << 20));
  CHECK_THROWS_AS(memory.record_sequence(3, last, 2, 0, 256, some_ids(2 * 256 * 2, 256)), mrr::InvalidArgument);

  // A token count whose tokens*layers*k wraps to the size of the (empty) span is refused.
  const mrr::RouteShape small{8, 2, 2};
  mrr::MemoryRouteStore m2(small);
  CHECK_THROWS_WITH_AS(m2.record_sequence(1, 0, std::int64_t{1} << 62, 0, 2, {}),
                       doctest::Contains("positions must be < 2^32"), mrr::InvalidArgument);
  std::vector<std::int32_t> none;
  auto import_wrapping = [&] {
    mrr::import_routed_experts<mrr::MemoryRouteStore, std::int32_t>(m2, 1, none, std::int64_t{1} << 62, 2, 2);
  };
  CHECK_THROWS_AS(import_wrapping(), mrr::InvalidArgument);
  // Layouts refuse such positions too (their runs would overflow).
  CHECK_THROWS_WITH_AS(mrr::TokenLayout({mrr::TokenKey{1, far}}), doctest::Contains("positions must be < 2^32"),
                       mrr::InvalidArgument);
  const std::vector<mrr::SequenceId> uids = {1};
  CHECK_THROWS_AS(mrr::TokenLayout::packed(uids, std::vector<std::int64_t>{0, 4},
                                           std::vector<std::int64_t>{std::numeric_limits<std::int64_t>::max()}),
                  mrr::InvalidArgument);
}

TEST_CASE("crafted route-file headers: every shape field is bounded, the error names the file and the field") {
  mrr::test::TempDir dir;
  const auto path = dir / "crafted.mrr";
  auto open_fails_with = [&](const std::vector<unsigned char>& bytes, const char* field) {
    CAPTURE(field);
    write_file(path, bytes);
    CHECK_THROWS_WITH_AS(mrr::FileRouteStore::open(path), doctest::Contains(path.string().c_str()),
                         mrr::RouteFileError);
    CHECK_THROWS_WITH_AS(mrr::FileRouteStore::open(path), doctest::Contains(field), mrr::RouteFileError);
  };
  open_fails_with(file_header(64, 70000, 4, 1), "num_layers = 70000");
  open_fails_with(file_header(0x7fffffff, 8, 0x7fffffff, 4), "topk = 2147483647");
  open_fails_with(file_header(0xffffffff, 8, 2, 4), "num_experts = 4294967295");
  open_fails_with(file_header(64, 8, 65, 1), "topk = 65");
  open_fails_with(file_header(64, 8, 4, 2), "id width 2");
  // ... and appending to such a file is refused the same way.
  write_file(path, file_header(64, 70000, 4, 1));
  CHECK_THROWS_WITH_AS(mrr::FileRouteStore::append(path, mrr::RouteShape{64, 3, 4}),
                       doctest::Contains("num_layers = 70000"), mrr::RouteFileError);
}

using Version1 = std::integral_constant<std::uint16_t, 1>;
using Version2 = std::integral_constant<std::uint16_t, 2>;

TEST_CASE_TEMPLATE("crafted route records: positions and sizes are checked before anything is sized from them", V,
                   Version1, Version2) {
  static_assert(V::value <= rf::kVersion);
  mrr::test::TempDir dir;
  const mrr::RouteShape shape{64, 3, 4};
  const auto path = dir / "crafted.mrr";
  const std::vector<unsigned char> one_token(12, 5);  // 1 token x 3 layers x k=4, 1-byte ids

  for (bool with_index : {false, true}) {
    CAPTURE(with_index);
    auto crafted = [&](std::vector<std::pair<std::int64_t, std::uint32_t>> records) {
      auto bytes = file_header(64, 3, 4, 1, V::value);
      std::vector<std::pair<std::uint64_t, std::uint64_t>> entries;
      for (auto [position, tokens] : records) {
        entries.emplace_back(7, bytes.size());
        add_record(bytes, routes_header(7, position, tokens, 3, std::uint64_t{tokens} * 12),
                   std::vector<unsigned char>(std::size_t{tokens} * 12, 5));
      }
      if (with_index) add_index(bytes, entries);
      write_file(path, bytes);
    };
    // A record at position 2^31 is valid: it costs one position of table (it took 2.1 GB and 33 s).
    crafted({{std::int64_t{1} << 31, 1}});
    {
      auto store = mrr::FileRouteStore::open(path, shape);
      CHECK(store.recovery().opened_from_index == with_index);
      CHECK(hits(store, 7, std::int64_t{1} << 31, 2) == 1);
      CHECK(hits(store, 7, 0, 0) == 0);
      CHECK(store.recorded_positions(7) == (std::int64_t{1} << 31) + 1);
    }
    // Past the bound (2^40 threw std::bad_alloc, INT64_MAX overflowed), or negative.
    for (std::int64_t position :
         {std::int64_t{1} << 40, std::numeric_limits<std::int64_t>::max(), mrr::kMaxPositions, std::int64_t{-1}}) {
      CAPTURE(position);
      crafted({{position, 1}});
      auto read = [&] {
        auto store = mrr::FileRouteStore::open(path, shape);  // the scan checks at open; the index when read
        (void)hits(store, 7, 0, 0);
      };
      CHECK_THROWS_WITH_AS(read(), doctest::Contains(("first_position " + std::to_string(position)).c_str()),
                           mrr::RouteFileError);
      CHECK_THROWS_WITH_AS(read(), doctest::Contains(path.string().c_str()), mrr::RouteFileError);
    }
    // Two records far apart in one sequence would need a table out of all proportion to the file.
    crafted({{0, 1}, {std::int64_t{1} << 31, 1}});
    {
      auto store = mrr::FileRouteStore::open(path, shape);
      CHECK_THROWS_WITH_AS((void)hits(store, 7, 0, 0), doctest::Contains("sparse"), mrr::RouteFileError);
    }
    // A few records close together are fine.
    crafted({{100, 2}, {0, 1}, {50, 1}});
    {
      auto store = mrr::FileRouteStore::open(path, shape);
      CHECK(hits(store, 7, 0, 1) == 1);
      CHECK(hits(store, 7, 101, 1) == 1);
      CHECK(hits(store, 7, 99, 1) == 0);
    }
  }

  // An index whose count wraps (2^60 * 16 + 8 == 8) or whose payload size is past the end of the
  // file is skipped as damaged, and the records are rescanned.
  {
    auto bytes = file_header(64, 3, 4, 1, V::value);
    add_record(bytes, routes_header(7, 0, 1, 3, 12), one_token);
    const std::uint64_t index_at = bytes.size();
    std::vector<unsigned char> payload(8);
    rf::detail::put<std::uint64_t>(payload.data(), std::uint64_t{1} << 60);
    rf::RecordHeader ih;
    ih.type = rf::RecordType::index;
    ih.payload_bytes = 8;
    add_record(bytes, ih, payload);
    std::vector<unsigned char> tail(8);
    rf::detail::put<std::uint64_t>(tail.data(), index_at);
    rf::RecordHeader th;
    th.type = rf::RecordType::tail;
    th.payload_bytes = 8;
    add_record(bytes, th, tail);
    write_file(path, bytes);
    auto store = mrr::FileRouteStore::open(path, shape);
    CHECK(store.recovery().index_damaged);
    CHECK(hits(store, 7, 0, 0) == 1);
  }
  {
    auto bytes = file_header(64, 3, 4, 1, V::value);
    add_record(bytes, routes_header(7, 0, 1, 3, 12), one_token);
    const std::uint64_t index_at = bytes.size();
    rf::RecordHeader ih;
    ih.type = rf::RecordType::index;
    // A payload size that pads to 0 (the record would look 56 bytes long), with a valid header check.
    unsigned char header[rf::kRecordHeaderBytes];
    ih.payload_bytes = 0;
    rf::encode(version_of(bytes), ih, nullptr, header);
    rf::detail::put<std::uint64_t>(header + 8, ~std::uint64_t{0} - 3);
    rf::detail::put<std::uint32_t>(header + 48, rf::header_check(header));
    append_bytes(bytes, header, sizeof header);
    std::vector<unsigned char> tail(8);
    rf::detail::put<std::uint64_t>(tail.data(), index_at);
    rf::RecordHeader th;
    th.type = rf::RecordType::tail;
    th.payload_bytes = 8;
    add_record(bytes, th, tail);
    write_file(path, bytes);
    std::optional<mrr::FileRouteStore> store;
    CHECK_NOTHROW(store.emplace(mrr::FileRouteStore::open(path, shape)));
    if (store) {
      CHECK(store->recovery().index_damaged);
      CHECK(hits(*store, 7, 0, 0) == 1);
    }
  }
}

TEST_CASE("one writer per route file: a second process appending is refused at open; readers are not") {
  mrr::test::TempDir dir;
  const mrr::RouteShape shape{64, 3, 4};
  const auto path = dir / "shared.mrr";
  const auto ids = some_ids(12, 64);
  int ready[2], go[2];
  REQUIRE(::pipe(ready) == 0);
  REQUIRE(::pipe(go) == 0);
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    int rc = 0;
    try {
      auto store = mrr::FileRouteStore::append(path, shape);
      for (mrr::SequenceId uid = 0; uid < 150; ++uid)
        store.record_sequence(uid, 0, 1, 0, 3, ids);
      char c = 'r';
      if (::write(ready[1], &c, 1) != 1) rc = 4;
      if (::read(go[0], &c, 1) != 1) rc = 5;
      store.close();
    } catch (...) {
      rc = 3;
    }
    ::_exit(rc);
  }
  char c = 0;
  REQUIRE(::read(ready[0], &c, 1) == 1);
  // The child holds the file: appending (which both processes used to acknowledge, then lose
  // records to each other's overwrites) is refused with a clear error.
  CHECK_THROWS_WITH_AS(mrr::FileRouteStore::append(path, shape), doctest::Contains("is locked by another writer"),
                       mrr::RouteFileError);
  CHECK_THROWS_AS(mrr::FileRouteStore::create(path, shape), mrr::RouteFileError);
  {
    auto reader = mrr::FileRouteStore::open(path, shape);  // readers take no lock
    CHECK(reader.recovery().records == 150);
  }
  REQUIRE(::write(go[1], "g", 1) == 1);
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  for (int fd : {ready[0], ready[1], go[0], go[1]})
    ::close(fd);
  {
    auto store = mrr::FileRouteStore::append(path, shape);  // the lock went with the writer
    for (mrr::SequenceId uid = 150; uid < 300; ++uid)
      store.record_sequence(uid, 0, 1, 0, 3, ids);
    // Within one process, a second store on the same file is a second writer too.
    CHECK_THROWS_WITH_AS(mrr::FileRouteStore::append(path, shape), doctest::Contains("locked by another writer"),
                         mrr::RouteFileError);
  }
  auto store = mrr::FileRouteStore::open(path, shape);
  CHECK(store.recovery().records == 300);
  CHECK(store.num_sequences() == 300);
}

TEST_CASE("a dangling symlink or a symlink loop as the path says what it is") {
  mrr::test::TempDir dir;
  const mrr::RouteShape shape{64, 3, 4};
  const auto dangling = dir / "dangling.mrr";
  std::filesystem::create_symlink(dir / "nowhere" / "routes.mrr", dangling);
  const auto loop_a = dir / "a.mrr", loop_b = dir / "b.mrr";
  std::filesystem::create_symlink(loop_b, loop_a);
  std::filesystem::create_symlink(loop_a, loop_b);
  const std::string target = (dir / "nowhere" / "routes.mrr").string();
  CHECK_THROWS_WITH_AS(mrr::FileRouteStore::create(dangling, shape),
                       doctest::Contains(("dangling symlink to " + target).c_str()), mrr::RouteFileError);
  CHECK_THROWS_WITH_AS(mrr::FileRouteStore::append(dangling, shape),
                       doctest::Contains(("dangling symlink to " + target).c_str()), mrr::RouteFileError);
  CHECK_THROWS_WITH_AS(mrr::FileRouteStore::open(dangling, shape),
                       doctest::Contains(("dangling symlink to " + target).c_str()), mrr::RouteFileError);
  for (const auto& p : {loop_a, loop_b}) {
    CHECK_THROWS_WITH_AS(mrr::FileRouteStore::create(p, shape), doctest::Contains("symlink loop"), mrr::RouteFileError);
    CHECK_THROWS_WITH_AS(mrr::FileRouteStore::append(p, shape), doctest::Contains("symlink loop"), mrr::RouteFileError);
    CHECK_THROWS_WITH_AS(mrr::FileRouteStore::open(p, shape), doctest::Contains("symlink loop"), mrr::RouteFileError);
  }
  // Through verl's configuration keys too: replay_file names the key and says what the path is.
  mrr::ReplayConfig config;
  config.mode = mrr::ReplayMode::R2;
  config.replay_file = dangling.string();
  CHECK_THROWS_WITH_AS(mrr::open_route_file(config, shape),
                       doctest::Contains(("replay_file: cannot open route file " + dangling.string() +
                                          ": it is a dangling symlink")
                                             .c_str()),
                       mrr::RouteFileError);
  config.replay_file = (dir / "missing.mrr").string();
  CHECK_THROWS_WITH_AS(mrr::open_route_file(config, shape), doctest::Contains("does not exist"), mrr::RouteFileError);
  // A symlink to a usable path is followed as before.
  const auto real = dir / "real.mrr", link = dir / "link.mrr";
  std::filesystem::create_symlink(real, link);
  CHECK_THROWS_WITH_AS(mrr::FileRouteStore::create(link, shape), doctest::Contains("dangling symlink"),
                       mrr::RouteFileError);
  mrr::FileRouteStore::create(real, shape).close();
  mrr::FileRouteStore::append(link, shape).record_sequence(1, 0, 1, 0, 3, some_ids(12, 64));
  CHECK(mrr::FileRouteStore::open(real, shape).num_sequences() == 1);
}

TEST_CASE("crafted .npy files are refused before anything is allocated; every error is an mrr exception") {
  mrr::test::TempDir dir;
  const auto path = dir / "r.npy";
  auto fails_with = [&](const std::string& bytes, const std::string& what) {
    CAPTURE(what);
    write_text(path, bytes);
    CHECK_THROWS_WITH_AS(mrr::read_npy(path), doctest::Contains(what.c_str()), mrr::InvalidArgument);
    CHECK_THROWS_WITH_AS(mrr::read_npy(path), doctest::Contains(path.string().c_str()), mrr::InvalidArgument);
  };
  // 150 bytes whose shape wraps the element count to 0 (it segfaulted in the store).
  const auto wrapping = npy(dict("<i4", "(4611686018427387904, 2, 2)"), 22);
  CHECK(wrapping.size() == 150);
  fails_with(wrapping, "overflows");
  {
    mrr::MemoryRouteStore store(mrr::RouteShape{8, 2, 2});
    CHECK_THROWS_AS(mrr::import_routed_experts_npy(store, 1, path), mrr::InvalidArgument);
  }
  fails_with(npy(dict("<i4", "(3, 2, 2)"), 48, 2, 0xFFFFFFF0u), "header_len 4294967280");  // allocated 4 GB
  fails_with(npy(dict("<i4", "(100000000, 2, 2)"), 36), "fewer values");                   // allocated 1.5 GB
  fails_with(npy(dict("<i4", "(-1, 2, 2)"), 16), "negative dimension");                    // std::length_error
  fails_with(npy(dict("<i4", "(abc, 2)"), 16), "malformed 'shape'");                       // bare std::invalid_argument
  fails_with(npy(dict("<i4", "(99999999999999999999, 2)"), 16), "too large");              // std::out_of_range
  fails_with(npy(dict("<i4junk", "(2, 2)"), 16), "dtype '<i4junk'");
  fails_with(npy(dict("<i4", "(2, 2)"), 17), "trailing bytes");
  fails_with(npy(dict("<i4", "(2, 2)"), 15), "fewer values");
  fails_with(npy("{'descr': '<i4', 'shape': (2, 2), }", 16), "lacks the 'fortran_order'");
  fails_with(npy("{'descr': '<i4', 'fortran_order': False, 'shape': (2, 2), 'x': 1}", 16), "unexpected or repeated");
  fails_with(npy(dict("<i4", "(2, 2)") + " junk", 16), "text after its header");
  fails_with(npy("{'descr': '<i4", 16), "unterminated");
  fails_with(npy(dict("<i4", "(2, 2)"), 16, 7), "unsupported .npy version 7");
  fails_with(std::string("\x93NUMPY\x01\x00\x05", 9), "ends inside its preamble");
  fails_with(npy(dict("<u8", "(1,)"), 0) + std::string(8, '\xff'), "beyond int64");
  // Valid files still read, in each version and integer width.
  write_text(path, npy(dict("<i2", "(2, 1, 1)"), 0) + std::string("\x05\x00\xff\xff", 4));
  const auto a = mrr::read_npy(path);
  CHECK(a.shape == std::vector<std::int64_t>{2, 1, 1});
  CHECK(a.values == std::vector<std::int64_t>{5, -1});
  write_text(path, npy("{\"descr\": \"|u1\", \"fortran_order\": False, \"shape\": (0, 3)}", 0, 3));
  CHECK(mrr::read_npy(path).values.empty());
  write_text(path, npy(dict("<i8", "()"), 0) + std::string("\x07\0\0\0\0\0\0\0", 8));
  CHECK(mrr::read_npy(path).values == std::vector<std::int64_t>{7});
}

TEST_CASE("an empty routed_experts array imports into a route file as nothing (found by fuzz_npy)") {
  // Shape (0, 2, 2): no tokens. The file store applied an offset to the empty span's null data().
  mrr::test::TempDir dir;
  const auto path = dir / "empty.npy";
  write_text(path, npy(dict("<i4", "(0, 2, 2)"), 0));
  auto store = mrr::FileRouteStore::create(dir / "r.mrr", mrr::RouteShape{8, 2, 2});
  mrr::import_routed_experts_npy(store, 1, path);
  CHECK(store.recorded_positions(1) == 0);
  store.record_sequence(2, 5, 0, 0, 2, std::span<const std::int32_t>{});
  CHECK(store.recorded_positions(2) == 0);
}

TEST_CASE_TEMPLATE("a crafted index listing one record many times, or records inside each other, is an error at open",
                   V, Version1, Version2) {
  mrr::test::TempDir dir;
  const mrr::RouteShape shape{64, 1, 1};
  const auto path = dir / "crafted.mrr";
  std::vector<unsigned char> payload(1000);
  for (std::size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<unsigned char>(i % 64);

  SUBCASE("one record listed 5000 times (82 KB; it cost 2.5 GB and 39 s to open)") {
    auto file = file_header(64, 1, 1, 1, V::value);
    add_record(file, routes_header(7, 0, 1000, 1, 1000), payload);
    add_index(file, std::vector<std::pair<std::uint64_t, std::uint64_t>>(5000, {7, 64}));
    write_file(path, file);
    CHECK_THROWS_WITH_AS(mrr::FileRouteStore::open(path, shape), doctest::Contains("lists the record at offset 64 twice"),
                         mrr::RouteFileError);
    CHECK_THROWS_WITH_AS(mrr::FileRouteStore::append(path, shape), doctest::Contains("twice"), mrr::RouteFileError);
  }
  SUBCASE("two entries closer than a record header") {
    auto file = file_header(64, 1, 1, 1, V::value);
    add_record(file, routes_header(7, 0, 1000, 1, 1000), payload);
    add_index(file, {{7, 64}, {7, 64 + 16}});
    write_file(path, file);
    CHECK_THROWS_WITH_AS(mrr::FileRouteStore::open(path, shape), doctest::Contains("which overlap"), mrr::RouteFileError);
  }
  SUBCASE("an entry inside another record's payload: the outer record runs into it") {
    // A valid record header (with its own small payload) hidden inside the payload of record A.
    std::vector<unsigned char> inner;
    add_record(inner, routes_header(7, 5000, 8, 1, 8), std::vector<unsigned char>(8, 3));
    std::vector<unsigned char> outer = payload;
    std::copy(inner.begin(), inner.end(), outer.begin() + 200);
    auto file = file_header(64, 1, 1, 1, V::value);
    add_record(file, routes_header(7, 0, 1000, 1, 1000), outer);
    add_index(file, {{7, 64}, {7, 64 + rf::kRecordHeaderBytes + 200}});
    write_file(path, file);
    const auto store = mrr::FileRouteStore::open(path, shape);
    CHECK_THROWS_WITH_AS(hits(store, 7, 0, 0), doctest::Contains("running into the next record at offset 320"),
                         mrr::RouteFileError);
  }
  SUBCASE("an entry that is not 8-byte aligned") {
    auto file = file_header(64, 1, 1, 1, V::value);
    add_record(file, routes_header(7, 0, 1000, 1, 1000), payload);
    add_index(file, {{7, 64}, {7, 64 + 1003}});
    write_file(path, file);
    CHECK_THROWS_WITH_AS(mrr::FileRouteStore::open(path, shape), doctest::Contains("not 8-byte aligned"),
                         mrr::RouteFileError);
  }
  SUBCASE("the same records with an honest index open and read") {
    auto file = file_header(64, 1, 1, 1, V::value);
    add_record(file, routes_header(7, 0, 1000, 1, 1000), payload);
    add_index(file, {{7, 64}});
    write_file(path, file);
    const auto store = mrr::FileRouteStore::open(path, shape);
    CHECK(store.recovery().opened_from_index);
    CHECK(hits(store, 7, 999, 0) == 1);
  }
}

// Fault injection for the sync tests below: this executable's fdatasync fails with EIO while
// `fail_fdatasync` is set, and its fsync counts the directories it is called on; otherwise both
// are the C library's (symbol interposition: the library is header-only, so its calls land here).
namespace {
std::atomic<bool> fail_fdatasync{false};
std::atomic<int> directory_fsyncs{0};
}  // namespace

extern "C" int fdatasync(int fd) {
  if (fail_fdatasync.load()) {
    errno = EIO;
    return -1;
  }
  static const auto real = reinterpret_cast<int (*)(int)>(::dlsym(RTLD_NEXT, "fdatasync"));
  return real(fd);
}

extern "C" int fsync(int fd) {
  struct stat st {};
  if (::fstat(fd, &st) == 0 && S_ISDIR(st.st_mode)) ++directory_fsyncs;
  static const auto real = reinterpret_cast<int (*)(int)>(::dlsym(RTLD_NEXT, "fsync"));
  return real(fd);
}

TEST_CASE("a failed sync stays failed: a retried close() never reports unsynced records persisted") {
  mrr::test::TempDir dir;
  const mrr::RouteShape shape{64, 3, 4};
  const auto path = dir / "sync.mrr";
  const auto ids = some_ids(12, 64);
  {
    auto store = mrr::FileRouteStore::create(path, shape);
    store.record_sequence(7, 0, 1, 0, 3, ids);
    fail_fdatasync = true;
    CHECK_THROWS_WITH_AS(store.close(), doctest::Contains("fdatasync failed"), mrr::RouteFileError);
    fail_fdatasync = false;
    // The device may have dropped the pages it could not write, and a second fdatasync can then
    // succeed without them: the second close() (and sync()) fail as the first did. (Before, the
    // second close() returned as if the records were persisted.)
    CHECK_THROWS_WITH_AS(store.close(), doctest::Contains("not known to be on the device"), mrr::RouteFileError);
    CHECK_THROWS_WITH_AS(store.sync(), doctest::Contains("fdatasync failed"), mrr::RouteFileError);
  }  // the destructor's close fails too, silently
  // What was written is still there to read (the sync failed, not the writes).
  auto reader = mrr::FileRouteStore::open(path, shape);
  CHECK(reader.num_sequences() == 1);
  CHECK(hits(reader, 7, 0, 2) == 1);
  // Without sync_on_close, a close() after a failed sync() fails too (it returned normally).
  mrr::FileStoreOptions no_sync;
  no_sync.sync_on_close = false;
  auto store = mrr::FileRouteStore::create(dir / "no_sync.mrr", shape, no_sync);
  store.record_sequence(8, 0, 1, 0, 3, ids);
  fail_fdatasync = true;
  CHECK_THROWS_WITH_AS(store.sync(), doctest::Contains("fdatasync failed"), mrr::RouteFileError);
  fail_fdatasync = false;
  CHECK_THROWS_WITH_AS(store.close(), doctest::Contains("not known to be on the device"), mrr::RouteFileError);
}

TEST_CASE("a synced new route file has its directory entry synced too; an appended one needs no directory sync") {
  mrr::test::TempDir dir;
  const mrr::RouteShape shape{64, 3, 4};
  const auto path = dir / "named.mrr";
  const auto ids = some_ids(12, 64);
  const int before = directory_fsyncs.load();
  {
    auto store = mrr::FileRouteStore::create(path, shape);
    store.record_sequence(1, 0, 1, 0, 3, ids);
    store.close();  // sync_on_close
  }
  CHECK(directory_fsyncs.load() == before + 1);
  {
    auto store = mrr::FileRouteStore::append(dir / "appended_new.mrr", shape);  // created by append
    store.record_sequence(1, 0, 1, 0, 3, ids);
    store.close();
  }
  CHECK(directory_fsyncs.load() == before + 2);
  {
    auto store = mrr::FileRouteStore::append(path, shape);  // an existing file: its name is on the device
    store.record_sequence(2, 0, 1, 0, 3, ids);
    store.close();
  }
  CHECK(directory_fsyncs.load() == before + 2);
}

// A write that fails part-way (the disk fills): with `failing_write` at 1, this executable's next
// pwritev writes half of its first piece and sets it to 2, and every pwritev then fails with
// ENOSPC; its ftruncate fails with EIO while `fail_ftruncate` is set.
namespace {
std::atomic<int> failing_write{0};
std::atomic<bool> fail_ftruncate{false};
}  // namespace

extern "C" ssize_t pwritev(int fd, const struct iovec* iov, int count, off_t offset) {
  static const auto real =
      reinterpret_cast<ssize_t (*)(int, const struct iovec*, int, off_t)>(::dlsym(RTLD_NEXT, "pwritev"));
  if (failing_write.load() == 1 && count > 0) {
    failing_write = 2;
    struct iovec half = iov[0];
    half.iov_len = std::max<std::size_t>(1, half.iov_len / 2);
    return real(fd, &half, 1, offset);
  }
  if (failing_write.load() == 2) {
    errno = ENOSPC;
    return -1;
  }
  return real(fd, iov, count, offset);
}

extern "C" int ftruncate(int fd, off_t length) {
  if (fail_ftruncate.load()) {
    errno = EIO;
    return -1;
  }
  static const auto real = reinterpret_cast<int (*)(int, off_t)>(::dlsym(RTLD_NEXT, "ftruncate"));
  return real(fd, length);
}

TEST_CASE("a write that fails part-way is cut back; when cutting back fails too, the error says what may remain") {
  mrr::test::TempDir dir;
  const mrr::RouteShape shape{64, 3, 4};
  const auto ids = some_ids(12, 64);
  for (const bool cut_fails : {false, true}) {
    CAPTURE(cut_fails);
    const auto path = dir / (cut_fails ? "cut_fails.mrr" : "cut.mrr");
    auto store = mrr::FileRouteStore::create(path, shape);
    store.record_sequence(1, 0, 1, 0, 3, ids);
    const auto before = std::filesystem::file_size(path);
    failing_write = 1;
    fail_ftruncate = cut_fails;
    std::string message;
    try {
      store.record_sequence(2, 0, 1, 0, 3, ids);
    } catch (const mrr::RouteFileError& e) {
      message = e.what();
    }
    failing_write = 0;
    fail_ftruncate = false;
    CHECK(message.find("write failed at offset") != std::string::npos);
    CHECK(message.find("No space left on device") != std::string::npos);
    if (cut_fails) {
      CHECK(message.find("cutting the file back to offset " + std::to_string(before) + " failed too") !=
            std::string::npos);
      CHECK(std::filesystem::file_size(path) > before);  // what went in stayed
    } else {
      CHECK(message.find("cutting") == std::string::npos);
      CHECK(std::filesystem::file_size(path) == before);  // cut back to the last whole record
    }
  }
}

TEST_CASE("at a real size (48 layers, 256 experts, 768 KiB records) a write failing part-way loses nothing recorded") {
  // Records past every buffer of the writer and the reader (256 KiB reads): the failed one is cut
  // away, the store goes on recording, and what a reader then finds is exactly what was recorded.
  mrr::test::TempDir dir;
  const mrr::RouteShape shape{256, 48, 8};
  const std::int64_t tokens = 2048;
  const auto path = dir / "large.mrr";
  const auto ids_of = [&](int uid) { return some_ids(static_cast<std::size_t>(tokens) * 48 * 8, 256 - uid); };
  {
    auto store = mrr::FileRouteStore::create(path, shape);
    store.record_sequence(1, 0, tokens, 0, 48, ids_of(1));
    const auto before = std::filesystem::file_size(path);
    failing_write = 1;
    CHECK_THROWS_WITH_AS(store.record_sequence(2, 0, tokens, 0, 48, ids_of(2)),
                         doctest::Contains("No space left on device"), mrr::RouteFileError);
    failing_write = 0;
    CHECK(std::filesystem::file_size(path) == before);
    store.record_sequence(3, 0, tokens, 0, 48, ids_of(3));
    store.close();
  }
  auto reader = mrr::FileRouteStore::open(path, shape);
  CHECK(reader.num_sequences() == 2);
  CHECK(reader.recovery().records == 2);
  for (const int uid : {1, 3}) {
    CAPTURE(uid);
    std::vector<mrr::TokenKey> keys;
    for (std::int64_t p = 0; p < tokens; ++p)
      keys.push_back(mrr::TokenKey{static_cast<mrr::SequenceId>(uid), p});
    const mrr::TokenLayout layout(keys);
    const auto want = ids_of(uid);
    for (const int layer : {0, 23, 47}) {
      mrr::ExpertIds got;
      std::vector<std::uint8_t> found;
      CHECK(reader.lookup(layer, layout, got, found) == static_cast<std::size_t>(tokens));
      bool same = true;
      for (std::int64_t p = 0; p < tokens && same; ++p)
        for (int j = 0; j < 8; ++j)
          same = same && got(p, j) == want[static_cast<std::size_t>((p * 48 + layer) * 8 + j)];
      CHECK(same);
    }
  }
  CHECK(hits(reader, 2, 0, 0) == 0);  // the failed record is not there
}
