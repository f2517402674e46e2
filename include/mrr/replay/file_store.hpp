// FileRouteStore: routes in an append-only, checksummed, indexed file (verl's record_file /
// replay_file, which verl declares but never implemented). Every record call reaches the OS in
// one write before it returns, so a writer killed at any point loses at most the record it was
// writing; reopening recovers every complete record and reports the torn tail. A damaged record
// is an error when read, never wrong ids. Format: docs/route-file-format.md. Not thread-safe.
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
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <unordered_set>
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
        cache_(std::move(other.cache_)),
        loaded_(std::move(other.loaded_)),
        read_buffer_(std::move(other.read_buffer_)),
        write_buffer_(std::move(other.write_buffer_)),
        write_pending_(std::move(other.write_pending_)),
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
  }

  const RouteShape& shape() const { return header_.shape; }
  const std::filesystem::path& path() const { return path_; }
  const RouteFileRecovery& recovery() const { return recovery_; }
  bool writable() const { return writable_; }
  bool is_open() const { return fd_ >= 0; }
  int id_width() const { return header_.id_width; }

  void record(int layer, const TokenLayout& layout, ExpertIdsRef ids) {
    constexpr const char* fn = "FileRouteStore::record";
    require_writable(fn);
    for (const TokenRun& run : layout.runs()) ensure_loaded(run.uid);
    // One record per run of new rows; all of them reach the file in one write.
    auto& buffer = write_buffer_;
    auto& pending = write_pending_;
    buffer.clear();
    pending.clear();
    for (const TokenRun& run : cache_.new_runs(layer, layout, ids, fn)) {
      auto* payload = begin_route_record(buffer, pending, run.uid, run.first_position,
                                         static_cast<std::uint32_t>(run.count), layer, 1);
      const int k = shape().topk;
      for (std::size_t i = 0; i < run.count; ++i)
        encode_ids(ids.data() + static_cast<Eigen::Index>(run.first_row + i) * ids.outerStride(), k,
                   payload + i * static_cast<std::size_t>(k * header_.id_width));
      finish_route_record(buffer, pending);
    }
    commit(buffer, pending);
  }

  // A span of one sequence for a range of layers, ids laid out [tokens][layers][k] (vLLM order).
  void record_sequence(SequenceId uid, std::int64_t first_position, std::int64_t num_tokens, int first_layer,
                       int num_layers, std::span<const std::int32_t> ids) {
    constexpr const char* fn = "FileRouteStore::record_sequence";
    require_writable(fn);
    cache_.check_block_extent(first_position, num_tokens, first_layer, num_layers, ids.size(), fn);
    detail::require(num_tokens <= 0xffffffffLL, fn, "num_tokens ", num_tokens,
                    " does not fit a record (at most 2^32 - 1 tokens per call)");
    ensure_loaded(uid);
    if (!cache_.new_block(uid, first_position, num_tokens, first_layer, num_layers, ids, fn)) return;
    auto& buffer = write_buffer_;
    auto& pending = write_pending_;
    buffer.clear();
    pending.clear();
    auto* payload = begin_route_record(buffer, pending, uid, first_position, static_cast<std::uint32_t>(num_tokens),
                                       first_layer, num_layers);
    encode_ids(ids.data(), static_cast<int>(ids.size()), payload);
    finish_route_record(buffer, pending);
    commit(buffer, pending);
  }

  // As MemoryRouteStore::lookup; sequences are read from the file (and checked) on first use.
  std::size_t lookup(int layer, const TokenLayout& layout, ExpertIds& out, std::vector<std::uint8_t>& found) const {
    for (const TokenRun& run : layout.runs()) ensure_loaded(run.uid);
    return cache_.lookup(layer, layout, out, found, "FileRouteStore::lookup");
  }

  std::int64_t recorded_positions(SequenceId uid) const {
    ensure_loaded(uid);
    const SequenceRoutes* s = cache_.find(uid);
    return s ? s->positions() : 0;
  }
  bool contains(SequenceId uid) const { return index_.count(uid) != 0; }
  std::size_t num_sequences() const { return index_.size(); }
  std::vector<SequenceId> sequences() const {
    std::vector<SequenceId> out;
    out.reserve(index_.size());
    for (const auto& [uid, offsets] : index_) out.push_back(uid);
    return out;
  }

  // The routes of one sequence, read from the file and verified (throws RouteFileError if damaged).
  const SequenceRoutes* sequence(SequenceId uid) const {
    ensure_loaded(uid);
    return cache_.find(uid);
  }

  // Forgets decoded sequences (the file keeps them); the next lookup reads them again.
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
    ::close(std::exchange(fd_, -1));
  }

 private:
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

  // A reader sizes a sequence's table from its records' extent: positions [first, end) x layers.
  // Records far apart (positions 0 and 2^31, say) would need a table out of all proportion to the
  // file, so a table more than kSparseFactor times the rows the records hold, plus kSparseSlack
  // bytes, is refused before it is allocated (docs/route-file-format.md, "Bounds").
  static constexpr std::uint64_t kSparseFactor = 32;
  static constexpr std::uint64_t kSparseSlack = std::uint64_t{1} << 20;

  void ensure_loaded(SequenceId uid) const {
    if (loaded_.count(uid) != 0) return;
    auto it = index_.find(uid);
    if (it == index_.end()) return;
    // First every record header, checked; then the table, sized once; then the payloads.
    std::vector<route_file::RecordHeader> headers(it->second.size());
    std::vector<std::array<unsigned char, route_file::kRecordHeaderBytes>> header_bytes(it->second.size());
    std::int64_t first = kMaxPositions, end = 0;
    std::uint64_t rows_held = 0;
    for (std::size_t i = 0; i < it->second.size(); ++i) {
      const std::uint64_t offset = it->second[i];
      route_file::RecordHeader& h = headers[i];
      if (offset > end_ || end_ - offset < route_file::kRecordHeaderBytes)
        damaged(offset, detail::str("the index points past the end of the file for sequence uid ", uid));
      read_exact(header_bytes[i].data(), route_file::kRecordHeaderBytes, offset);
      if (!route_file::decode(header_bytes[i].data(), h) || h.type != route_file::RecordType::routes || h.uid != uid)
        damaged(offset, detail::str("the index points at no route record of sequence uid ", uid));
      check_route_record(h, offset);
      first = std::min(first, h.first_position);
      end = std::max(end, h.first_position + std::int64_t{h.num_tokens});
      rows_held += std::uint64_t{h.num_tokens} * h.num_layers;  // < 2^48 per record
    }
    SequenceRoutes seq(shape());
    if (end > first) {
      const auto per_row = static_cast<std::uint64_t>(1 + seq.row_bytes());
      const std::uint64_t table =
          static_cast<std::uint64_t>(end - first) * static_cast<std::uint64_t>(shape().num_layers);
      std::uint64_t table_bytes = 0, held_bytes = 0;
      if (!detail::checked_mul(table, per_row, table_bytes) || !detail::checked_mul(rows_held, per_row, held_bytes) ||
          table_bytes / kSparseFactor > held_bytes + kSparseSlack / kSparseFactor)
        damaged(it->second.front(),
                detail::str("the records of sequence uid ", uid, " span positions [", first, ", ", end, ") but hold ",
                            rows_held, " of its ", table, " (position, layer) rows; a table that sparse is refused"));
      seq.reserve(first, end);
    }
    std::vector<unsigned char>& payload = read_buffer_;
    for (std::size_t i = 0; i < headers.size(); ++i) {
      const std::uint64_t offset = it->second[i];
      const route_file::RecordHeader& h = headers[i];
      payload.resize(static_cast<std::size_t>(h.payload_bytes));
      read_exact(payload.data(), payload.size(), offset + route_file::kRecordHeaderBytes);
      if (route_file::checksum(header_bytes[i].data(), payload.data(), payload.size()) != h.checksum)
        damaged(offset, detail::str("a record of sequence uid ", uid, " fails its checksum"));
      decode_into(seq, h, payload.data(), offset);
    }
    cache_.insert(uid, std::move(seq));
    loaded_.insert(uid);
  }

  // Range-checked ids to their little-endian encoding (one loop per width, so it vectorises).
  void encode_ids(const std::int32_t* ids, int n, unsigned char* out) const {
    switch (header_.id_width) {
      case 1:
        for (int i = 0; i < n; ++i) out[i] = static_cast<unsigned char>(ids[i]);
        break;
      case 2:
        for (int i = 0; i < n; ++i) {
          out[2 * i] = static_cast<unsigned char>(ids[i]);
          out[2 * i + 1] = static_cast<unsigned char>(ids[i] >> 8);
        }
        break;
      default:
        for (int i = 0; i < n; ++i) detail::store_id(out + 4 * i, 4, static_cast<std::uint32_t>(ids[i]));
    }
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
    buffer.resize(at + static_cast<std::size_t>(route_file::record_bytes(h.payload_bytes)), 0);
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
    for (const Pending& p : pending) {
      add_to_index(p.header.uid, end_ + p.at);
      ++recovery_.records;
      // Write-through: R2 replays what it recorded without reading the file back, and the
      // conflict checks of later records need it (release_cache() frees it).
      decode_into(cache_.get_or_add(p.header.uid), p.header, buffer.data() + p.at + route_file::kRecordHeaderBytes,
                  end_ + p.at);
      loaded_.insert(p.header.uid);
    }
    end_ += buffer.size();
    index_dirty_ = true;
  }

  // Adds a verified record's rows to a sequence: ids are range-checked (unless every value of
  // the id width is a valid expert) and a row that disagrees with an earlier record is damage.
  void decode_into(SequenceRoutes& seq, const route_file::RecordHeader& h, const unsigned char* payload,
                   std::uint64_t offset) const {
    const int w = header_.id_width, k = shape().topk;
    const auto row_bytes = static_cast<std::size_t>(k * w);
    const bool check_range = shape().num_experts < (std::int64_t{1} << (8 * w));
    const unsigned char* p = payload;
    for (std::uint32_t t = 0; t < h.num_tokens; ++t)
      for (int l = 0; l < h.num_layers; ++l, p += row_bytes) {
        if (check_range)
          for (int j = 0; j < k; ++j)
            if (detail::load_id(p + j * w, w) >= static_cast<std::uint32_t>(shape().num_experts))
              damaged(offset, detail::str("a record of sequence uid ", h.uid, " holds expert id ",
                                          detail::load_id(p + j * w, w), " >= num_experts ", shape().num_experts));
        const std::int64_t pos = h.first_position + t;
        const int layer = h.first_layer + l;
        if (seq.has(pos, layer)) {
          if (std::memcmp(seq.row(pos, layer), p, row_bytes) != 0)
            damaged(offset, detail::str("two records of sequence uid ", h.uid, " disagree at position ", pos,
                                        " layer ", layer));
          continue;
        }
        seq.put_encoded(pos, layer, p);
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
  mutable detail::RouteTable cache_;
  mutable std::unordered_set<SequenceId> loaded_;
  mutable std::vector<unsigned char> read_buffer_;  // reused: large vectors cost page faults each time
  std::vector<unsigned char> write_buffer_;
  std::vector<Pending> write_pending_;
  RouteFileRecovery recovery_;
  std::pair<std::uint64_t, std::uint64_t> damaged_index_{0, 0};  // [begin, end) of an index that failed its checks
  bool index_dirty_ = false;
};

MRR_NAMESPACE_END
