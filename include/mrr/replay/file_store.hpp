// FileRouteStore: routes in an append-only, checksummed, indexed file (verl's record_file /
// replay_file, which verl declares but never implemented). Every record call reaches the OS in
// one write before it returns, so a writer killed at any point loses at most the record it was
// writing; reopening recovers every complete record and reports the torn tail. A damaged record
// is an error when read, never wrong ids. Reads go through a read-only mapping of the file and
// decode straight into the caller's output; the store keeps only where each sequence's rows are,
// not a decoded copy. Format: docs/route-file-format.md. Not thread-safe.
#pragma once

#include <mrr/detail/checked.hpp>
#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>
#include <mrr/replay/file_format.hpp>
#include <mrr/replay/layout.hpp>
#include <mrr/replay/route_table.hpp>
#include <mrr/replay/shape.hpp>
#include <mrr/tensor.hpp>

#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <iterator>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

MRR_NAMESPACE_BEGIN

struct FileStoreOptions {
  // fdatasync when closing (a cleanly closed file then survives power loss, not only a crash).
  bool sync_on_close = true;
};

// What opening a file found.
struct RouteFileRecovery {
  bool opened_from_index = false;  // the file was closed cleanly and its index was used
  bool index_damaged = false;      // an index was present but failed its checksum: records rescanned
  std::uint64_t records = 0;       // route records in the file
  std::uint64_t torn_offset = 0;   // where an incomplete last record starts (when torn_bytes > 0)
  std::uint64_t torn_bytes = 0;    // bytes of that incomplete record, not used (dropped on append)

  bool clean() const { return torn_bytes == 0 && !index_damaged; }
  std::string describe(const std::filesystem::path& path) const {
    std::string s = detail::str("route file ", path.string(), ": ", records, " route records");
    if (opened_from_index) s += ", opened from its index";
    if (index_damaged) s += "; its index was damaged and the records were rescanned";
    if (torn_bytes > 0)
      s += detail::str("; an incomplete last record of ", torn_bytes, " bytes at offset ", torn_offset,
                       " (a writer stopped mid-append) was not used");
    return s;
  }
};

class FileRouteStore {
 public:
  // A new file; an existing one is an error (records are never overwritten). The writer holds an
  // exclusive lock on the file until close(): a second writer is refused, readers are not.
  static FileRouteStore create(const std::filesystem::path& path, RouteShape shape, FileStoreOptions options = {}) {
    shape.validate();
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0) throw_create_error(path);
    return start_new_file(path, fd, shape, options);
  }

  // An existing file, read-only. With `expected`, a file of another model is an error naming
  // the field that differs.
  static FileRouteStore open(const std::filesystem::path& path, std::optional<RouteShape> expected = std::nullopt) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw_open_error(path);
    // Readers take no lock: a file being appended to is read up to its last complete record.
    FileRouteStore store(path, fd, false, {}, RouteShape{1, 1, 1});
    store.read_header(expected);
    store.load_index_or_scan();
    return store;
  }

  // An existing file to add routes to (created when missing). A torn last record is truncated
  // away (and reported in recovery()) so new records follow the last complete one. Like create,
  // it holds an exclusive lock until close(): two writers never interleave their appends.
  static FileRouteStore append(const std::filesystem::path& path, RouteShape shape, FileStoreOptions options = {}) {
    shape.validate();
    int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0 && errno == ENOENT && !std::filesystem::is_symlink(std::filesystem::symlink_status(path))) {
      fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
      if (fd >= 0) return start_new_file(path, fd, shape, options);
      if (errno != EEXIST) throw_create_error(path);
      fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);  // another process created it meanwhile
    }
    if (fd < 0) throw_open_error(path);
    lock_for_writing(fd, path);
    FileRouteStore store(path, fd, true, options, shape);
    store.read_header(shape);
    store.load_index_or_scan();
    if (store.recovery_.torn_bytes > 0 && ::ftruncate(store.fd_, static_cast<off_t>(store.end_)) != 0)
      throw RouteFileError(detail::str("route file ", path.string(), ": cannot truncate its torn tail: ",
                                       std::strerror(errno)));
    store.index_dirty_ = store.index_dirty_ || !store.recovery_.opened_from_index;
    return store;
  }

  FileRouteStore(FileRouteStore&& other) noexcept
      : path_(std::move(other.path_)),
        fd_(std::exchange(other.fd_, -1)),
        writable_(other.writable_),
        options_(other.options_),
        header_(other.header_),
        end_(other.end_),
        index_(std::move(other.index_)),
        order_(std::move(other.order_)),
        loaded_(std::move(other.loaded_)),
        cache_(std::move(other.cache_)),
        map_(std::exchange(other.map_, nullptr)),
        map_len_(std::exchange(other.map_len_, 0)),
        write_buffer_(std::move(other.write_buffer_)),
        write_pending_(std::move(other.write_pending_)),
        sorted_runs_(std::move(other.sorted_runs_)),
        recovery_(other.recovery_),
        damaged_index_(other.damaged_index_),
        index_dirty_(other.index_dirty_) {}
  FileRouteStore& operator=(FileRouteStore&&) = delete;
  FileRouteStore(const FileRouteStore&) = delete;
  FileRouteStore& operator=(const FileRouteStore&) = delete;

  // Closes (writing the index) without throwing; call close() to see errors.
  ~FileRouteStore() {
    try {
      close();
    } catch (...) {
      // The records are on disk; only the index may be missing, and reopening rescans.
    }
    unmap();
  }

  const RouteShape& shape() const { return header_.shape; }
  const std::filesystem::path& path() const { return path_; }
  const RouteFileRecovery& recovery() const { return recovery_; }
  bool writable() const { return writable_; }
  bool is_open() const { return fd_ >= 0; }
  int id_width() const { return header_.id_width; }

  // Records the ids [layout rows, k] that `layer` chose; padding rows are skipped. All rows are
  // checked (range, conflicts with earlier records and within the batch) before anything is
  // written; one record per run of new rows, all of them in one write.
  void record(int layer, const TokenLayout& layout, ExpertIdsRef ids) {
    constexpr const char* fn = "FileRouteStore::record";
    require_writable(fn);
    cache_.check_layer(layer, fn);
    const int k = shape().topk;
    detail::require(static_cast<std::size_t>(ids.rows()) == layout.size() && ids.cols() == k, fn, "ids have shape ",
                    detail::shape_of(ids), " for a layout of ", layout.size(), " rows and k=", k);
    const auto stride = static_cast<std::size_t>(ids.outerStride());
    auto row_ids = [&](std::size_t r) { return ids.data() + r * stride; };
    check_batch_agrees(layout, row_ids, fn);
    ensure_mapped();
    auto& buffer = write_buffer_;
    auto& pending = write_pending_;
    buffer.clear();
    pending.clear();
    for (const TokenRun& run : layout.runs()) {
      const SequenceIndex* seq = ensure_loaded(run.uid);
      // Rows already in the file must hold the same ids (a no-op); the rest become records.
      std::int64_t cursor = run.first_position;
      const std::int64_t run_end = run.first_position + static_cast<std::int64_t>(run.count);
      auto emit = [&](std::int64_t from, std::int64_t to) {
        if (to <= from) return;
        const auto count = static_cast<std::size_t>(to - from);
        const std::size_t row = run.first_row + static_cast<std::size_t>(from - run.first_position);
        auto* payload = begin_route_record(buffer, pending, run.uid, from, static_cast<std::uint32_t>(count), layer, 1);
        if (!encode_rows(row_ids(row), stride, count, payload))  // range-checked while encoding
          check_id_rows(row_ids(row), stride, count, fn, TokenRun{run.uid, from, row, count}, layer);
        finish_route_record(buffer, pending);
      };
      if (seq != nullptr)
        for_each_overlap(*seq, layer, run.first_position, run_end, [&](const Segment& s, std::int64_t a, std::int64_t b) {
          const std::size_t row = run.first_row + static_cast<std::size_t>(a - run.first_position);
          check_id_rows(row_ids(row), stride, static_cast<std::size_t>(b - a), fn, TokenRun{run.uid, a, row, 0}, layer);
          for (std::int64_t pos = a; pos < b; ++pos)
            if (!same_row(s, pos, row_ids(run.first_row + static_cast<std::size_t>(pos - run.first_position)), k))
              detail::RouteTable::conflict(fn, run.uid, pos, layer);
          emit(cursor, a);
          cursor = std::max(cursor, b);
        });
      emit(cursor, run_end);
    }
    check_sparse_before_write(pending, fn);
    commit(buffer, pending);
  }

  // A span of one sequence for a range of layers, ids laid out [tokens][layers][k] (vLLM order).
  // An identical re-record is a no-op; otherwise the whole block is one record.
  void record_sequence(SequenceId uid, std::int64_t first_position, std::int64_t num_tokens, int first_layer,
                       int num_layers, std::span<const std::int32_t> ids) {
    constexpr const char* fn = "FileRouteStore::record_sequence";
    require_writable(fn);
    cache_.check_block_extent(first_position, num_tokens, first_layer, num_layers, ids.size(), fn);
    detail::require(num_tokens <= 0xffffffffLL, fn, "num_tokens ", num_tokens,
                    " does not fit a record (at most 2^32 - 1 tokens per call)");
    if (num_tokens == 0) return;  // nothing to record (and an empty span's data() may be null)
    const int k = shape().topk;
    const auto row_stride = static_cast<std::size_t>(num_layers) * static_cast<std::size_t>(k);
    for (int l = 0; l < num_layers; ++l)
      check_id_rows(ids.data() + static_cast<std::size_t>(l) * static_cast<std::size_t>(k), row_stride,
                    static_cast<std::size_t>(num_tokens), fn, TokenRun{uid, first_position, 0, 0}, first_layer + l);
    ensure_mapped();
    const SequenceIndex* seq = ensure_loaded(uid);
    bool any_new = seq == nullptr;
    const std::int64_t end = first_position + num_tokens;
    if (seq != nullptr)
      for (int l = 0; l < num_layers; ++l) {
        std::int64_t cursor = first_position;
        for_each_overlap(*seq, first_layer + l, first_position, end, [&](const Segment& s, std::int64_t a, std::int64_t b) {
          for (std::int64_t pos = a; pos < b; ++pos)
            if (!same_row(s, pos, ids.data() + static_cast<std::size_t>(pos - first_position) * row_stride +
                                      static_cast<std::size_t>(l) * static_cast<std::size_t>(k), k))
              detail::RouteTable::conflict(fn, uid, pos, first_layer + l);
          any_new = any_new || a > cursor;
          cursor = std::max(cursor, b);
        });
        any_new = any_new || cursor < end;
      }
    if (!any_new) return;
    auto& buffer = write_buffer_;
    auto& pending = write_pending_;
    buffer.clear();
    pending.clear();
    auto* payload = begin_route_record(buffer, pending, uid, first_position, static_cast<std::uint32_t>(num_tokens),
                                       first_layer, num_layers);
    (void)encode_ids(ids.data(), ids.size(), payload);  // range-checked above
    finish_route_record(buffer, pending);
    check_sparse_before_write(pending, fn);
    commit(buffer, pending);
  }

  // As MemoryRouteStore::lookup. Ids are decoded straight from the mapped file into `out`; each
  // record is verified (checksum, id range, agreement with overlapping records) when its sequence
  // is first used. No allocation once `out`, `found` and the sequence's index are sized.
  std::size_t lookup(int layer, const TokenLayout& layout, ExpertIds& out, std::vector<std::uint8_t>& found) const {
    constexpr const char* fn = "FileRouteStore::lookup";
    cache_.check_layer(layer, fn);
    const int k = shape().topk;
    const std::size_t rows = layout.size();
    if (out.rows() != static_cast<Eigen::Index>(rows) || out.cols() != k) out.resize(static_cast<Eigen::Index>(rows), k);
    found.assign(rows, 0);
    std::size_t hits = 0;
    for (const TokenRun& run : layout.runs()) {
      const SequenceIndex* seq = ensure_loaded(run.uid);
      if (seq == nullptr) continue;
      std::int64_t cursor = run.first_position;  // rows below it are filled (overlapping records agree)
      const std::int64_t run_end = run.first_position + static_cast<std::int64_t>(run.count);
      for_each_overlap(*seq, layer, run.first_position, run_end, [&](const Segment& s, std::int64_t a, std::int64_t b) {
        a = std::max(a, cursor);
        if (b <= a) return;
        const std::size_t row = run.first_row + static_cast<std::size_t>(a - run.first_position);
        const auto count = static_cast<std::size_t>(b - a);
        decode_rows(map_ + s.payload + static_cast<std::uint64_t>(a - s.first) * s.stride, s.stride, count,
                    out.data() + row * static_cast<std::size_t>(k));
        std::memset(found.data() + row, 1, count);
        hits += count;
        cursor = b;
      });
    }
    if (hits != rows)
      for (std::size_t r = 0; r < rows; ++r)
        if (found[r] == 0) std::fill_n(out.data() + r * static_cast<std::size_t>(k), k, -1);
    return hits;
  }

  std::int64_t recorded_positions(SequenceId uid) const {
    const SequenceIndex* s = ensure_loaded(uid);
    return s != nullptr && !s->segments.empty() ? s->end : 0;
  }
  bool contains(SequenceId uid) const { return index_.count(uid) != 0; }
  std::size_t num_sequences() const { return index_.size(); }
  std::vector<SequenceId> sequences() const {
    std::vector<SequenceId> out;
    out.reserve(index_.size());
    for (const auto& [uid, offsets] : index_) out.push_back(uid);
    return out;
  }

  // The routes of one sequence as a table, read from the file and verified (throws
  // RouteFileError if damaged). lookup() does not need it: it decodes from the file directly.
  const SequenceRoutes* sequence(SequenceId uid) const {
    const SequenceIndex* s = ensure_loaded(uid);
    if (s == nullptr) return nullptr;
    if (const SequenceRoutes* done = cache_.find(uid)) return done;
    SequenceRoutes seq(shape());
    if (s->end > s->first) seq.reserve(s->first, s->end);
    for (const Segment& g : s->segments)
      for (std::uint32_t t = 0; t < g.count; ++t) seq.put_encoded(g.first + t, g.layer, map_ + g.payload + std::uint64_t{t} * g.stride);
    cache_.insert(uid, std::move(seq));
    return cache_.find(uid);
  }

  // Forgets what was read of sequences (their record index and tables; the file keeps them): the
  // next lookup reads and verifies their records again.
  void release_cache() const {
    cache_.clear();
    loaded_.clear();
  }

  // Records are written through on every call; sync() also asks the device to persist them.
  void sync() {
    if (fd_ >= 0 && writable_ && ::fdatasync(fd_) != 0)
      throw RouteFileError(detail::str("route file ", path_.string(), ": fdatasync failed: ", std::strerror(errno)));
  }

  // Writes the index and tail records (when routes were added), syncs if configured, closes.
  void close() {
    if (fd_ < 0) return;
    if (writable_ && index_dirty_) {
      write_index();
      index_dirty_ = false;
      if (options_.sync_on_close) sync();
    }
    // The mapping outlives the descriptor, so what was recorded stays readable after close().
    if (recovery_.records > 0) {
      try {
        ensure_mapped();
      } catch (const RouteFileError&) {
        // Lookups after close() then report the failed mapping.
      }
    }
    ::close(std::exchange(fd_, -1));
  }

 private:
  // A layer's rows in one record: `count` positions from `first`, the row of first + t at file
  // offset payload + t * stride (R2 records hold one layer, so its rows are contiguous).
  struct Segment {
    std::int64_t first;
    std::uint64_t payload;
    std::uint64_t record;  // the record's offset, for messages
    std::int32_t layer;
    std::uint32_t count;
    std::uint32_t stride;
    std::int64_t end() const { return first + count; }
  };
  // Where a sequence's rows are in the file: its segments sorted by (layer, first position).
  struct SequenceIndex {
    std::vector<Segment> segments;
    std::int64_t first = kMaxPositions, end = 0;  // positions its records span
    std::uint64_t rows_held = 0;                  // (position, layer) rows its records hold
    bool overlapping = false;                     // some segments of a layer overlap (and agree)
  };

  // A record built in the write buffer and not yet on disk.
  struct Pending {
    route_file::RecordHeader header;
    std::size_t at;  // its offset in the buffer
  };

  FileRouteStore(std::filesystem::path path, int fd, bool writable, FileStoreOptions options, RouteShape shape)
      : path_(std::move(path)), fd_(fd), writable_(writable), options_(options), cache_(shape) {
    header_.shape = shape;
    header_.id_width = static_cast<std::uint8_t>(id_width_for(shape.num_experts));
  }

  static FileRouteStore start_new_file(const std::filesystem::path& path, int fd, const RouteShape& shape,
                                       const FileStoreOptions& options) {
    lock_for_writing(fd, path);
    FileRouteStore store(path, fd, true, options, shape);
    unsigned char header[route_file::kHeaderBytes];
    route_file::encode(store.header_, header);
    store.write_all(header, sizeof header, 0);
    store.end_ = route_file::kHeaderBytes;
    store.index_dirty_ = true;
    return store;
  }

  // One writer per file: flock(LOCK_EX | LOCK_NB) on the open file, released when it is closed
  // (or the process dies). Filesystems without flock support are written unlocked.
  static void lock_for_writing(int fd, const std::filesystem::path& path) {
    if (::flock(fd, LOCK_EX | LOCK_NB) == 0) return;
    const int err = errno;
    if (err == ENOLCK || err == EOPNOTSUPP || err == ENOSYS) return;
    ::close(fd);
    if (err == EWOULDBLOCK)
      throw RouteFileError(detail::str("route file ", path.string(),
                                       " is locked by another writer (a FileRouteStore created or appended to it and "
                                       "has not closed it); close that writer first, or record to another file"));
    throw RouteFileError(detail::str("route file ", path.string(), ": cannot lock it for writing: ",
                                     std::strerror(err)));
  }

  // What a symlink at `path` is when it leads nowhere ("" when it is no such symlink): open()
  // alone only says "File exists" or "No such file".
  static std::string broken_symlink(const std::filesystem::path& path) {
    std::error_code ec;
    if (!std::filesystem::is_symlink(std::filesystem::symlink_status(path, ec))) return "";
    const std::string target = std::filesystem::read_symlink(path, ec).string();
    struct stat st {};
    if (::stat(path.c_str(), &st) == 0) return "";
    if (errno == ELOOP) return detail::str("is a symlink loop (", path.string(), " -> ", target, " -> ...)");
    if (errno == ENOENT) return detail::str("is a dangling symlink to ", target, ", which does not exist");
    return "";
  }

  [[noreturn]] static void throw_create_error(const std::filesystem::path& path) {
    const int err = errno;
    if (const std::string link = broken_symlink(path); !link.empty())
      throw RouteFileError(detail::str("cannot create route file ", path.string(), ": it ", link,
                                       "; remove the link or make it point at a usable path"));
    throw RouteFileError(detail::str("cannot create route file ", path.string(), ": ", std::strerror(err),
                                     err == EEXIST ? " (it exists; open it with FileRouteStore::append to add "
                                                     "routes, or choose a new name)"
                                                   : ""));
  }

  [[noreturn]] static void throw_open_error(const std::filesystem::path& path) {
    const int err = errno;
    if (const std::string link = broken_symlink(path); !link.empty())
      throw RouteFileError(detail::str("cannot open route file ", path.string(), ": it ", link));
    if (err == ENOENT) throw RouteFileError(detail::str("route file ", path.string(), " does not exist"));
    throw RouteFileError(detail::str("cannot open route file ", path.string(), ": ", std::strerror(err)));
  }

  [[noreturn]] void damaged(std::uint64_t offset, const std::string& what) const {
    throw RouteFileError(detail::str("route file ", path_.string(), " is damaged: ", what, " at offset ", offset,
                                     "; refusing to use it (no route is ever replayed from a damaged record)"));
  }

  void require_writable(const char* fn) const {
    if (fd_ < 0) throw RouteFileError(detail::str("mrr::", fn, ": route file ", path_.string(), " is closed"));
    if (!writable_)
      throw RouteFileError(detail::str("mrr::", fn, ": route file ", path_.string(),
                                       " was opened read-only (FileRouteStore::open); use create or append to record"));
  }

  std::uint64_t file_size() const {
    struct stat st {};
    if (::fstat(fd_, &st) != 0)
      throw RouteFileError(detail::str("route file ", path_.string(), ": fstat failed: ", std::strerror(errno)));
    return static_cast<std::uint64_t>(st.st_size);
  }

  void read_exact(void* out, std::size_t n, std::uint64_t offset) const {
    auto* p = static_cast<unsigned char*>(out);
    while (n > 0) {
      const ssize_t got = ::pread(fd_, p, n, static_cast<off_t>(offset));
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0)
        throw RouteFileError(detail::str("route file ", path_.string(), ": read failed at offset ", offset, ": ",
                                         got < 0 ? std::strerror(errno) : "unexpected end of file"));
      p += got;
      n -= static_cast<std::size_t>(got);
      offset += static_cast<std::uint64_t>(got);
    }
  }

  void write_all(const void* data, std::size_t n, std::uint64_t offset) {
    const auto* p = static_cast<const unsigned char*>(data);
    const std::uint64_t start = offset;
    while (n > 0) {
      const ssize_t put = ::pwrite(fd_, p, n, static_cast<off_t>(offset));
      if (put < 0 && errno == EINTR) continue;
      if (put <= 0) {
        const int err = errno;
        // Leave no partial record behind for the next append.
        if (::ftruncate(fd_, static_cast<off_t>(start)) != 0) { /* reopening reports the torn tail */ }
        throw RouteFileError(detail::str("route file ", path_.string(), ": write failed at offset ", offset, ": ",
                                         std::strerror(err)));
      }
      p += put;
      n -= static_cast<std::size_t>(put);
      offset += static_cast<std::uint64_t>(put);
    }
  }

  void read_header(const std::optional<RouteShape>& expected) {
    if (file_size() < route_file::kHeaderBytes)
      throw RouteFileError(detail::str("route file ", path_.string(), " is too short to hold a header (",
                                       file_size(), " bytes): not a route file, or its writer stopped while creating it"));
    unsigned char buf[route_file::kHeaderBytes];
    read_exact(buf, sizeof buf, 0);
    route_file::FileHeader h;
    if (const std::string why = route_file::decode(buf, h); !why.empty())
      throw RouteFileError(detail::str("route file ", path_.string(), " cannot be used: ", why));
    if (expected) {
      const auto& e = *expected;
      auto mismatch = [&](const char* field, std::int32_t file_value, std::int32_t model_value) {
        throw RouteFileError(detail::str("route file ", path_.string(), " has ", field, " = ", file_value,
                                         " but the model has ", model_value, "; it was recorded for another model"));
      };
      if (h.shape.num_experts != e.num_experts) mismatch("num_experts", h.shape.num_experts, e.num_experts);
      if (h.shape.num_layers != e.num_layers) mismatch("num_layers (MoE layers)", h.shape.num_layers, e.num_layers);
      if (h.shape.topk != e.topk) mismatch("topk", h.shape.topk, e.topk);
    }
    header_ = h;
    cache_ = detail::RouteTable(h.shape);
  }

  void add_to_index(SequenceId uid, std::uint64_t offset) {
    index_[uid].push_back(offset);
    order_.emplace_back(uid, offset);
  }

  // A clean file ends with [index record][tail record]; anything else is rescanned.
  void load_index_or_scan() {
    const std::uint64_t size = file_size();
    end_ = size;
    if (try_load_index(size)) return;
    scan(size);
  }

  bool try_load_index(std::uint64_t size) {
    const std::uint64_t tail_bytes = route_file::record_bytes(8);
    if (size < route_file::kHeaderBytes + tail_bytes) return false;
    unsigned char tail[route_file::kRecordHeaderBytes + 8];  // a tail record is exactly this
    read_exact(tail, sizeof tail, size - tail_bytes);
    route_file::RecordHeader th;
    if (!route_file::decode(tail, th) || th.type != route_file::RecordType::tail || th.payload_bytes != 8 ||
        route_file::checksum(tail, tail + route_file::kRecordHeaderBytes, 8) != th.checksum)
      return false;
    const auto index_offset = route_file::detail::get<std::uint64_t>(tail + route_file::kRecordHeaderBytes);
    if (index_offset < route_file::kHeaderBytes || index_offset > size - tail_bytes - route_file::kRecordHeaderBytes) {
      recovery_.index_damaged = true;
      return false;
    }
    // From here on the tail is intact, so [index_offset, size - tail_bytes) is the index record:
    // if it is damaged, the rescan steps over it (it holds no routes).
    damaged_index_ = {index_offset, size - tail_bytes};
    unsigned char ih_bytes[route_file::kRecordHeaderBytes];
    read_exact(ih_bytes, sizeof ih_bytes, index_offset);
    route_file::RecordHeader ih;
    // The payload size is checked against the file before it is padded or allocated.
    if (!route_file::decode(ih_bytes, ih) || ih.type != route_file::RecordType::index ||
        ih.payload_bytes > size - tail_bytes - index_offset ||
        index_offset + route_file::record_bytes(ih.payload_bytes) != size - tail_bytes || ih.payload_bytes < 8 ||
        (ih.payload_bytes - 8) % 16 != 0) {
      recovery_.index_damaged = true;
      return false;
    }
    std::vector<unsigned char> payload(static_cast<std::size_t>(ih.payload_bytes));
    read_exact(payload.data(), payload.size(), index_offset + route_file::kRecordHeaderBytes);
    const auto count = route_file::detail::get<std::uint64_t>(payload.data());
    if (route_file::checksum(ih_bytes, payload.data(), payload.size()) != ih.checksum ||
        count != (ih.payload_bytes - 8) / 16) {
      recovery_.index_damaged = true;
      return false;
    }
    for (std::uint64_t i = 0; i < count; ++i) {
      const unsigned char* e = payload.data() + 8 + i * 16;
      const auto offset = route_file::detail::get<std::uint64_t>(e + 8);
      if (offset < route_file::kHeaderBytes || offset >= index_offset) {
        index_.clear();
        order_.clear();
        recovery_.index_damaged = true;
        return false;
      }
      add_to_index(route_file::detail::get<std::uint64_t>(e), offset);
    }
    recovery_.opened_from_index = true;
    recovery_.records = count;
    return true;
  }

  void scan(std::uint64_t size) {
    std::uint64_t offset = route_file::kHeaderBytes;
    std::vector<unsigned char> payload;
    while (offset < size) {
      const std::uint64_t left = size - offset;
      unsigned char hb[route_file::kRecordHeaderBytes];
      route_file::RecordHeader h;
      if (recovery_.index_damaged && offset == damaged_index_.first) {
        offset = damaged_index_.second;
        continue;
      }
      // A header cut short by the end of the file is a torn write; so is a zero-filled tail.
      if (left < route_file::kRecordHeaderBytes) return torn(offset, size);
      read_exact(hb, sizeof hb, offset);
      if (!route_file::decode(hb, h)) {
        if (all_zero(offset, size)) return torn(offset, size);
        damaged(offset, "no valid record header (bad magic, type or header check)");
      }
      // The header is intact, so its size is what was written: a payload running past the end
      // of the file is the record being written when the writer stopped.
      const std::uint64_t need = route_file::record_bytes(h.payload_bytes);
      if (h.payload_bytes > left || need > left) return torn(offset, size);
      payload.resize(static_cast<std::size_t>(h.payload_bytes));
      read_exact(payload.data(), payload.size(), offset + route_file::kRecordHeaderBytes);
      if (route_file::checksum(hb, payload.data(), payload.size()) != h.checksum) {
        if (offset + need == size) return torn(offset, size);  // the last record, partly persisted
        damaged(offset, detail::str("a record (sequence uid ", h.uid, ") fails its checksum"));
      }
      if (h.type == route_file::RecordType::routes) {
        check_route_record(h, offset);
        add_to_index(h.uid, offset);
        ++recovery_.records;
      }
      offset += need;
    }
  }

  bool all_zero(std::uint64_t from, std::uint64_t to) const {
    std::vector<unsigned char> buf(1 << 16);
    while (from < to) {
      const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(buf.size(), to - from));
      read_exact(buf.data(), n, from);
      for (std::size_t i = 0; i < n; ++i)
        if (buf[i] != 0) return false;
      from += n;
    }
    return true;
  }

  void torn(std::uint64_t offset, std::uint64_t size) {
    recovery_.torn_offset = offset;
    recovery_.torn_bytes = size - offset;
    end_ = offset;
  }

  // Every field of a routes record against the file's shape, the position bound and the file's
  // size, before anything is sized from it.
  void check_route_record(const route_file::RecordHeader& h, std::uint64_t offset) const {
    const auto& s = shape();
    if (h.num_layers == 0 || h.first_layer + h.num_layers > s.num_layers)
      damaged(offset, detail::str("a record of sequence uid ", h.uid, " has first_layer ", h.first_layer,
                                  " and num_layers ", h.num_layers, ", outside the file's ", s.num_layers, " layers"));
    if (h.first_position < 0 || h.first_position > kMaxPositions - std::int64_t{h.num_tokens})
      damaged(offset, detail::str("a record of sequence uid ", h.uid, " has first_position ", h.first_position,
                                  " and num_tokens ", h.num_tokens, "; positions must be in [0, 2^32)"));
    std::uint64_t expect = 0;
    if (!detail::checked_product(expect, std::uint64_t{h.num_tokens}, h.num_layers, s.topk, header_.id_width) ||
        h.payload_bytes != expect)
      damaged(offset, detail::str("a record of sequence uid ", h.uid, " has payload_bytes ", h.payload_bytes,
                                  " where num_tokens x num_layers x topk x id width = ", h.num_tokens, " x ",
                                  h.num_layers, " x ", s.topk, " x ", int{header_.id_width}));
    if (offset > end_ || end_ - offset < route_file::kRecordHeaderBytes ||
        h.payload_bytes > end_ - offset - route_file::kRecordHeaderBytes)
      damaged(offset, detail::str("a record of sequence uid ", h.uid, " has payload_bytes ", h.payload_bytes,
                                  ", past the end of the file (", end_, " bytes)"));
  }

  // A reader indexes a sequence by its records' extent: positions [first, end) x layers.
  // Records far apart (positions 0 and 2^31, say) would make a table (sequence()) out of all
  // proportion to the file, so a sequence spanning more than kSparseFactor times the rows its
  // records hold, plus kSparseSlack bytes, is refused (docs/route-file-format.md, "Bounds");
  // writers refuse to create one.
  static constexpr std::uint64_t kSparseFactor = 32;
  static constexpr std::uint64_t kSparseSlack = std::uint64_t{1} << 20;

  // Empty when a sequence spanning [first, end) and holding rows_held (position, layer) rows is
  // within the bound, else why not.
  std::string sparse_violation(SequenceId uid, std::int64_t first, std::int64_t end, std::uint64_t rows_held) const {
    if (end <= first) return "";
    const auto per_row = static_cast<std::uint64_t>(1 + shape().topk * header_.id_width);
    const std::uint64_t table = static_cast<std::uint64_t>(end - first) * static_cast<std::uint64_t>(shape().num_layers);
    std::uint64_t table_bytes = 0, held_bytes = 0;
    if (detail::checked_mul(table, per_row, table_bytes) && detail::checked_mul(rows_held, per_row, held_bytes) &&
        table_bytes / kSparseFactor <= held_bytes + kSparseSlack / kSparseFactor)
      return "";
    return detail::str("the records of sequence uid ", uid, " span positions [", first, ", ", end, ") but hold ",
                       rows_held, " of its ", table, " (position, layer) rows; a table that sparse is refused");
  }

  // Maps the file (read-only, shared: a writer's later appends show through) far enough to cover
  // every complete record. Pointers into the map are never kept across calls, so a writer may
  // remap when the file has grown past it.
  void ensure_mapped() const {
    if (end_ <= map_len_) return;
    unmap();
    const std::uint64_t want = writable_ ? std::max<std::uint64_t>(end_ + end_ / 2, std::uint64_t{1} << 20) : end_;
    void* p = ::mmap(nullptr, static_cast<std::size_t>(want), PROT_READ, MAP_SHARED, fd_, 0);
    if (p == MAP_FAILED)
      throw RouteFileError(detail::str("route file ", path_.string(), ": cannot map it for reading: ", std::strerror(errno)));
    map_ = static_cast<const unsigned char*>(p);
    map_len_ = want;
  }
  void unmap() const {
    if (map_ != nullptr) ::munmap(const_cast<unsigned char*>(map_), static_cast<std::size_t>(map_len_));
    map_ = nullptr;
    map_len_ = 0;
  }

  // Calls f(segment, a, b) for each segment of `layer` holding positions [a, b) of [from, to),
  // in order of first position.
  template <class F>
  static void for_each_overlap(const SequenceIndex& s, int layer, std::int64_t from, std::int64_t to, F&& f) {
    const Segment* begin = s.segments.data();
    const Segment* end = begin + s.segments.size();
    const Segment* lo = std::lower_bound(begin, end, layer, [](const Segment& g, int l) { return g.layer < l; });
    const Segment* hi = std::upper_bound(lo, end, layer, [](int l, const Segment& g) { return l < g.layer; });
    const Segment* it = lo;
    if (!s.overlapping) {  // disjoint: only the last segment starting at or before `from` can hold it
      it = std::upper_bound(lo, hi, from, [](std::int64_t p, const Segment& g) { return p < g.first; });
      if (it != lo) --it;
    }
    for (; it != hi && it->first < to; ++it)
      if (it->end() > from) f(*it, std::max(from, it->first), std::min(to, it->end()));
  }

  // Whether the stored row of `pos` in segment s holds exactly these k ids.
  bool same_row(const Segment& s, std::int64_t pos, const std::int32_t* ids, int k) const {
    const unsigned char* p = map_ + s.payload + static_cast<std::uint64_t>(pos - s.first) * s.stride;
    const int w = header_.id_width;
    for (int j = 0; j < k; ++j)
      if (detail::load_id(p + j * w, w) != static_cast<std::uint32_t>(ids[j])) return false;
    return true;
  }

  // `rows` stored rows, `stride` bytes apart, to int32 ids (already range-checked when verified).
  void decode_rows(const unsigned char* __restrict src, std::uint32_t stride, std::size_t rows,
                   std::int32_t* __restrict out) const {
    const auto k = static_cast<std::size_t>(shape().topk);
    const int w = header_.id_width;
    if (w == 1 && stride == k) {  // a contiguous block: one widening loop
      const std::size_t n = rows * k;
      for (std::size_t i = 0; i < n; ++i) out[i] = src[i];
      return;
    }
    for (std::size_t r = 0; r < rows; ++r, src += stride, out += k) {
      if (w == 1) {
        for (std::size_t j = 0; j < k; ++j) out[j] = src[j];
      } else if (w == 2) {
        for (std::size_t j = 0; j < k; ++j) out[j] = route_file::detail::get<std::uint16_t>(src + 2 * j);
      } else {
        for (std::size_t j = 0; j < k; ++j)
          out[j] = static_cast<std::int32_t>(route_file::detail::get<std::uint32_t>(src + 4 * j));
      }
    }
  }

  // `count` rows of k ids, `stride` ids apart, to their encoding (contiguous rows in one loop);
  // false when an id is out of range.
  [[nodiscard]] bool encode_rows(const std::int32_t* __restrict ids, std::size_t stride, std::size_t count,
                                 unsigned char* __restrict out) const {
    const auto k = static_cast<std::size_t>(shape().topk);
    if (stride == k) return encode_ids(ids, count * k, out);
    bool ok = true;
    for (std::size_t r = 0; r < count; ++r) ok &= encode_ids(ids + r * stride, k, out + r * k * header_.id_width);
    return ok;
  }

  // Range check of `count` rows (`stride` ids apart) of positions run.first_position...: one
  // branch-free pass; the row-by-row check that names the bad id runs only when it fails.
  void check_id_rows(const std::int32_t* ids, std::size_t stride, std::size_t count, const char* fn,
                     const TokenRun& run, int layer) const {
    const auto k = static_cast<std::size_t>(shape().topk);
    const auto limit = static_cast<std::uint32_t>(shape().num_experts);
    bool bad = false;
    if (stride == k) {
      for (std::size_t i = 0, n = count * k; i < n; ++i) bad |= static_cast<std::uint32_t>(ids[i]) >= limit;
    } else {
      for (std::size_t r = 0; r < count; ++r)
        for (std::size_t j = 0; j < k; ++j) bad |= static_cast<std::uint32_t>(ids[r * stride + j]) >= limit;
    }
    if (!bad) [[likely]]
      return;
    for (std::size_t r = 0; r < count; ++r)
      cache_.check_ids(ids + r * stride, fn, run.uid, run.first_position + static_cast<std::int64_t>(r), layer);
  }

  // Two runs of one batch covering the same tokens must agree.
  template <class RowIds>
  void check_batch_agrees(const TokenLayout& layout, RowIds&& row_ids, const char* fn) {
    if (layout.runs().size() < 2) return;
    auto& sorted = sorted_runs_;
    sorted.assign(layout.runs().begin(), layout.runs().end());
    std::sort(sorted.begin(), sorted.end(), [](const TokenRun& a, const TokenRun& b) {
      return a.uid != b.uid ? a.uid < b.uid : a.first_position < b.first_position;
    });
    const int k = shape().topk;
    std::int64_t reach = -1;  // furthest end so far among runs of the current uid
    std::size_t reach_run = 0;
    for (std::size_t i = 0; i < sorted.size(); ++i) {
      const TokenRun& b = sorted[i];
      if (i > 0 && sorted[i - 1].uid != b.uid) reach = -1;
      const std::int64_t b_end = b.first_position + static_cast<std::int64_t>(b.count);
      if (reach > b.first_position) {  // overlaps the run reaching furthest, which starts no later
        const TokenRun& a = sorted[reach_run];
        for (std::int64_t pos = b.first_position; pos < std::min(reach, b_end); ++pos) {
          const auto* ra = row_ids(a.first_row + static_cast<std::size_t>(pos - a.first_position));
          const auto* rb = row_ids(b.first_row + static_cast<std::size_t>(pos - b.first_position));
          if (!std::equal(ra, ra + k, rb))
            throw RouteStoreError(detail::str("mrr::", fn, ": two rows of the batch hold sequence ", a.uid,
                                              " position ", pos, " but carry different experts"));
        }
      }
      if (b_end > reach) {
        reach = b_end;
        reach_run = i;
      }
    }
  }

  // A writer never makes a sequence that readers would refuse as too sparse.
  void check_sparse_before_write(const std::vector<Pending>& pending, const char* fn) const {
    for (std::size_t i = 0; i < pending.size(); ++i) {
      const SequenceId uid = pending[i].header.uid;
      std::int64_t first = kMaxPositions, end = 0;
      std::uint64_t rows = 0;
      if (auto it = loaded_.find(uid); it != loaded_.end()) {
        first = it->second.first;
        end = it->second.end;
        rows = it->second.rows_held;
      }
      bool seen_before = false;
      for (std::size_t j = 0; j < pending.size(); ++j) {
        const auto& h = pending[j].header;
        if (h.uid != uid) continue;
        if (j < i) seen_before = true;
        first = std::min(first, h.first_position);
        end = std::max(end, h.first_position + std::int64_t{h.num_tokens});
        rows += std::uint64_t{h.num_tokens} * h.num_layers;
      }
      if (seen_before) continue;
      if (const std::string why = sparse_violation(uid, first, end, rows); !why.empty())
        detail::throw_invalid_argument(fn, "refusing to record: ", why, " by readers (docs/route-file-format.md)");
    }
  }

  // The record index of a sequence: read (headers checked, records verified) on first use, kept
  // up to date by this writer's appends. nullptr for a sequence the file does not hold.
  const SequenceIndex* ensure_loaded(SequenceId uid) const {
    if (auto found = loaded_.find(uid); found != loaded_.end()) return &found->second;
    auto it = index_.find(uid);
    if (it == index_.end()) return nullptr;
    ensure_mapped();
    SequenceIndex seq;
    const int k = shape().topk, w = header_.id_width;
    const auto row_bytes = static_cast<std::uint32_t>(k * w);
    for (const std::uint64_t offset : it->second) {
      if (offset > end_ || end_ - offset < route_file::kRecordHeaderBytes)
        damaged(offset, detail::str("the index points past the end of the file for sequence uid ", uid));
      const unsigned char* hb = map_ + offset;
      route_file::RecordHeader h;
      if (!route_file::decode(hb, h) || h.type != route_file::RecordType::routes || h.uid != uid)
        damaged(offset, detail::str("the index points at no route record of sequence uid ", uid));
      check_route_record(h, offset);
      seq.first = std::min(seq.first, h.first_position);
      seq.end = std::max(seq.end, h.first_position + std::int64_t{h.num_tokens});
      seq.rows_held += std::uint64_t{h.num_tokens} * h.num_layers;  // < 2^48 per record
    }
    if (const std::string why = sparse_violation(uid, seq.first, seq.end, seq.rows_held); !why.empty())
      damaged(it->second.front(), why);
    seq.segments.reserve(it->second.size());
    for (const std::uint64_t offset : it->second) {
      const unsigned char* hb = map_ + offset;
      route_file::RecordHeader h;
      (void)route_file::decode(hb, h);
      verify_record(h, hb, offset);
      if (h.num_tokens == 0) continue;
      for (std::uint32_t l = 0; l < h.num_layers; ++l)
        seq.segments.push_back({h.first_position, offset + route_file::kRecordHeaderBytes + std::uint64_t{l} * row_bytes,
                                offset, h.first_layer + static_cast<std::int32_t>(l), h.num_tokens,
                                row_bytes * h.num_layers});
    }
    std::sort(seq.segments.begin(), seq.segments.end(), segment_order);
    // Records covering the same (position, layer) must agree: each overlapped row is compared
    // with the earlier segment reaching furthest (which holds it), so all copies agree in turn.
    for (std::size_t i = 1, reach = 0; i < seq.segments.size(); ++i) {
      const Segment& g = seq.segments[i];
      if (seq.segments[reach].layer != g.layer) {
        reach = i;
        continue;
      }
      const Segment& r = seq.segments[reach];
      if (r.end() > g.first) {
        seq.overlapping = true;
        for (std::int64_t pos = g.first; pos < std::min(r.end(), g.end()); ++pos)
          if (std::memcmp(map_ + r.payload + static_cast<std::uint64_t>(pos - r.first) * r.stride,
                          map_ + g.payload + static_cast<std::uint64_t>(pos - g.first) * g.stride, row_bytes) != 0)
            damaged(g.record, detail::str("two records of sequence uid ", uid, " disagree at position ", pos, " layer ",
                                          g.layer));
      }
      if (g.end() > r.end()) reach = i;
    }
    return &loaded_.insert_or_assign(uid, std::move(seq)).first->second;
  }

  static bool segment_order(const Segment& a, const Segment& b) {
    return a.layer != b.layer ? a.layer < b.layer : a.first != b.first ? a.first < b.first : a.payload < b.payload;
  }

  // Checksum, and every id < num_experts (unless every value of the id width is a valid expert).
  void verify_record(const route_file::RecordHeader& h, const unsigned char* hb, std::uint64_t offset) const {
    const unsigned char* payload = hb + route_file::kRecordHeaderBytes;
    const auto n = static_cast<std::size_t>(h.payload_bytes);
    if (route_file::checksum(hb, payload, n) != h.checksum)
      damaged(offset, detail::str("a record of sequence uid ", h.uid, " fails its checksum"));
    const int w = header_.id_width;
    if (shape().num_experts >= (std::int64_t{1} << (8 * w))) return;
    const auto limit = static_cast<std::uint32_t>(shape().num_experts);
    std::uint32_t top = 0;
    if (w == 1) {
      for (std::size_t i = 0; i < n; ++i) top = std::max<std::uint32_t>(top, payload[i]);
    } else if (w == 2) {
      for (std::size_t i = 0; i < n; i += 2) top = std::max<std::uint32_t>(top, route_file::detail::get<std::uint16_t>(payload + i));
    } else {
      for (std::size_t i = 0; i < n; i += 4) top = std::max(top, route_file::detail::get<std::uint32_t>(payload + i));
    }
    if (top >= limit)
      damaged(offset, detail::str("a record of sequence uid ", h.uid, " holds expert id ", top, " >= num_experts ",
                                  shape().num_experts));
  }

  // Ids to their little-endian encoding, range-checked in the same pass (one loop per width;
  // __restrict lets it vectorise, since a byte store may otherwise alias the ids): false when one
  // is outside [0, num_experts).
  [[nodiscard]] bool encode_ids(const std::int32_t* __restrict ids, std::size_t n, unsigned char* __restrict out) const {
    std::uint32_t top = 0;  // the largest id as unsigned: a negative id is huge
    switch (header_.id_width) {
      case 1:
        for (std::size_t i = 0; i < n; ++i) {
          const auto v = static_cast<std::uint32_t>(ids[i]);
          out[i] = static_cast<unsigned char>(v);
          top = std::max(top, v);
        }
        break;
      case 2:
        for (std::size_t i = 0; i < n; ++i) {
          const auto v = static_cast<std::uint32_t>(ids[i]);
          out[2 * i] = static_cast<unsigned char>(v);
          out[2 * i + 1] = static_cast<unsigned char>(v >> 8);
          top = std::max(top, v);
        }
        break;
      default:
        for (std::size_t i = 0; i < n; ++i) {
          const auto v = static_cast<std::uint32_t>(ids[i]);
          detail::store_id(out + 4 * i, 4, v);
          top = std::max(top, v);
        }
    }
    return top < static_cast<std::uint32_t>(shape().num_experts);
  }

  // Reserves a route record in `buffer` and returns where its payload goes.
  unsigned char* begin_route_record(std::vector<unsigned char>& buffer, std::vector<Pending>& pending, SequenceId uid,
                                    std::int64_t first_position, std::uint32_t num_tokens, int first_layer,
                                    int num_layers) {
    route_file::RecordHeader h;
    h.type = route_file::RecordType::routes;
    h.payload_bytes = std::uint64_t{num_tokens} * static_cast<std::uint64_t>(num_layers) *
                      static_cast<std::uint64_t>(shape().topk) * header_.id_width;
    h.uid = uid;
    h.first_position = first_position;
    h.num_tokens = num_tokens;
    h.first_layer = static_cast<std::uint16_t>(first_layer);
    h.num_layers = static_cast<std::uint16_t>(num_layers);
    const std::size_t at = buffer.size();
    const auto bytes = static_cast<std::size_t>(route_file::record_bytes(h.payload_bytes));
    if (buffer.capacity() < at + bytes) buffer.reserve(std::max(at + bytes, 2 * buffer.capacity()));
    buffer.resize(at + bytes);  // header and padding are written by encode / below, the payload by the caller
    std::memset(buffer.data() + at + route_file::kRecordHeaderBytes + h.payload_bytes, 0,
                bytes - route_file::kRecordHeaderBytes - static_cast<std::size_t>(h.payload_bytes));
    pending.push_back({h, at});
    return buffer.data() + at + route_file::kRecordHeaderBytes;
  }

  // Writes the header (with its checksum) of the record begun last.
  void finish_route_record(std::vector<unsigned char>& buffer, std::vector<Pending>& pending) {
    Pending& p = pending.back();
    route_file::encode(p.header, buffer.data() + p.at + route_file::kRecordHeaderBytes, buffer.data() + p.at);
  }

  // One write for the whole call; memory state changes only after it succeeded.
  void commit(const std::vector<unsigned char>& buffer, const std::vector<Pending>& pending) {
    if (buffer.empty()) return;
    write_all(buffer.data(), buffer.size(), end_);
    const auto row_bytes = static_cast<std::uint32_t>(shape().topk * header_.id_width);
    for (const Pending& p : pending) {
      const std::uint64_t offset = end_ + p.at;
      add_to_index(p.header.uid, offset);
      ++recovery_.records;
      // The writer keeps its sequences' record index current: later records are checked against
      // it, and lookups read the new rows back through the page cache (no decoded copy).
      add_segments(loaded_[p.header.uid], p.header, offset, row_bytes);
      cache_.erase(p.header.uid);
    }
    end_ += buffer.size();
    index_dirty_ = true;
  }

  static void add_segments(SequenceIndex& s, const route_file::RecordHeader& h, std::uint64_t offset,
                           std::uint32_t row_bytes) {
    s.first = std::min(s.first, h.first_position);
    s.end = std::max(s.end, h.first_position + std::int64_t{h.num_tokens});
    s.rows_held += std::uint64_t{h.num_tokens} * h.num_layers;
    if (h.num_tokens == 0) return;
    for (std::uint32_t l = 0; l < h.num_layers; ++l) {
      const Segment g{h.first_position, offset + route_file::kRecordHeaderBytes + std::uint64_t{l} * row_bytes, offset,
                      h.first_layer + static_cast<std::int32_t>(l), h.num_tokens, row_bytes * h.num_layers};
      auto at = std::upper_bound(s.segments.begin(), s.segments.end(), g, segment_order);
      // Sorted disjoint segments stay disjoint unless the new one overlaps a neighbour.
      if (at != s.segments.begin() && std::prev(at)->layer == g.layer && std::prev(at)->end() > g.first)
        s.overlapping = true;
      if (at != s.segments.end() && at->layer == g.layer && at->first < g.end()) s.overlapping = true;
      s.segments.insert(at, g);
    }
  }

  void write_index() {
    std::vector<unsigned char> index_payload(8 + 16 * order_.size());
    route_file::detail::put<std::uint64_t>(index_payload.data(), order_.size());
    for (std::size_t i = 0; i < order_.size(); ++i) {
      route_file::detail::put<std::uint64_t>(index_payload.data() + 8 + 16 * i, order_[i].first);
      route_file::detail::put<std::uint64_t>(index_payload.data() + 16 + 16 * i, order_[i].second);
    }
    std::vector<unsigned char> buffer(static_cast<std::size_t>(route_file::record_bytes(index_payload.size()) +
                                                               route_file::record_bytes(8)), 0);
    route_file::RecordHeader ih;
    ih.type = route_file::RecordType::index;
    ih.payload_bytes = index_payload.size();
    std::memcpy(buffer.data() + route_file::kRecordHeaderBytes, index_payload.data(), index_payload.size());
    route_file::encode(ih, index_payload.data(), buffer.data());
    const std::size_t tail_at = static_cast<std::size_t>(route_file::record_bytes(index_payload.size()));
    unsigned char tail_payload[8];
    route_file::detail::put<std::uint64_t>(tail_payload, end_);
    route_file::RecordHeader th;
    th.type = route_file::RecordType::tail;
    th.payload_bytes = 8;
    std::memcpy(buffer.data() + tail_at + route_file::kRecordHeaderBytes, tail_payload, 8);
    route_file::encode(th, tail_payload, buffer.data() + tail_at);
    write_all(buffer.data(), buffer.size(), end_);
    end_ += buffer.size();
  }

  std::filesystem::path path_;
  int fd_ = -1;
  bool writable_ = false;
  FileStoreOptions options_;
  route_file::FileHeader header_;
  std::uint64_t end_ = 0;  // where the next record goes
  std::unordered_map<SequenceId, std::vector<std::uint64_t>> index_;
  std::vector<std::pair<SequenceId, std::uint64_t>> order_;  // route records in file order
  mutable std::unordered_map<SequenceId, SequenceIndex> loaded_;  // sequences read or written so far
  mutable detail::RouteTable cache_;  // tables built by sequence(), and the shape checks
  mutable const unsigned char* map_ = nullptr;  // the file, mapped read-only (see ensure_mapped)
  mutable std::uint64_t map_len_ = 0;
  std::vector<unsigned char> write_buffer_;  // reused across record calls
  std::vector<Pending> write_pending_;
  std::vector<TokenRun> sorted_runs_;
  RouteFileRecovery recovery_;
  std::pair<std::uint64_t, std::uint64_t> damaged_index_{0, 0};  // [begin, end) of an index that failed its checks
  bool index_dirty_ = false;
};

MRR_NAMESPACE_END
