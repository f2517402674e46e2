// FileRouteStore: routes in an append-only, checksummed, indexed file (verl's record_file /
// replay_file, which verl declares but never implemented). Every record call reaches the OS in
// one write before it returns, so a writer killed at any point loses at most the record it was
// writing; reopening recovers every complete record and reports the torn tail. A damaged record
// is an error when read, never wrong ids. Reads are positioned reads (pread) in chunks of at most
// kReadChunk bytes, decoded into the caller's output (records that follow one another in the file
// in one scatter read, straight into the output when its ids are the file's bytes); the store
// keeps only where each sequence's rows are, not a decoded copy. A file truncated or replaced underneath an open store
// is an error, never a crash (no mapping to fault on) and never another file's ids (the header, with its random file
// id, is compared after reading). Format: docs/route-file-format.md. Not thread-safe.
//
// FileRouteStore is the facade over three parts under replay/detail/: the POSIX file
// (route_file_handle.hpp: open, lock, positioned I/O, identity checks), the record codec
// (route_codec.hpp: ids to bytes and back, record checks, records built for one write) and the
// index (route_index.hpp: records by sequence and in file order, their bounds, and where each
// sequence's rows are). It decides what to read, verify and write, and when.
#pragma once

#include <mrr/detail/checked.hpp>
#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>
#include <mrr/replay/detail/held_records.hpp>
#include <mrr/replay/detail/route_codec.hpp>
#include <mrr/replay/detail/route_file_handle.hpp>
#include <mrr/replay/detail/route_index.hpp>
#include <mrr/replay/file_format.hpp>
#include <mrr/replay/layout.hpp>
#include <mrr/replay/route_table.hpp>
#include <mrr/replay/shape.hpp>
#include <mrr/tensor.hpp>

#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <initializer_list>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

MRR_NAMESPACE_BEGIN

static_assert(detail::RouteFileHandle::kHeaderBytes == route_file::kHeaderBytes,
              "RouteFileHandle compares the route file's header: its size is the format's");

struct FileStoreOptions {
  // fdatasync when closing (a cleanly closed file then survives power loss, not only a crash).
  bool sync_on_close = true;
  // The format version a new file is written in (docs/route-file-format.md): 0, the newest
  // (route_file::kVersion), or 2 or 1 for readers that predate version 3 or 2 (mrr before
  // 2026-11-27, or an older read_routes.py). append() keeps the file's own version; a nonzero value
  // that differs from it is an error, never a file of two versions.
  std::uint16_t format_version = 0;
  // A reader keeps records of several layers (record_sequence's [tokens, layers, k] blocks: a
  // rollout's routes) in memory whole, up to this many bytes, once a lookup has read and verified
  // them: the lookups of their other layers decode from memory. Without it each layer's lookup
  // reads the record's whole span again, since its rows are strided through it (48 layers: 48
  // times the bytes). The oldest record goes first when full; release_cache() empties it (its
  // buffers stay, for the next micro-batch's records, until the store is destroyed); 0 keeps none.
  // Records of one layer (record()'s) are read once per lookup either way and are not kept.
  std::size_t read_cache_bytes = std::size_t{256} << 20;
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

class FileRouteStore final {
 public:
  // A new file; an existing one is an error (records are never overwritten). The writer holds an
  // exclusive lock on the file until close(): a second writer is refused, readers are not.
  static FileRouteStore create(const std::filesystem::path& path, RouteShape shape, FileStoreOptions options = {}) {
    shape.validate();
    check_format_version(options, "FileRouteStore::create");
    auto file = detail::RouteFileHandle::create(path);
    if (file.size() != 0)
      throw RouteFileError(detail::str("cannot create route file ", path.string(),
                                       ": another writer (FileRouteStore::append) started it between its creation and "
                                       "this writer's lock; append to it, or choose a new name"));
    return start_new_file(std::move(file), shape, options);
  }

  // An existing file, read-only. With `expected`, a file of another model is an error naming
  // the field that differs. A FIFO, directory or device is refused without waiting on it. Of
  // `options`, a reader uses read_cache_bytes (the others are a writer's).
  static FileRouteStore open(const std::filesystem::path& path, std::optional<RouteShape> expected = std::nullopt,
                             FileStoreOptions options = {}) {
    // Readers take no lock: a file being appended to is read up to its last complete record.
    FileRouteStore store(detail::RouteFileHandle::open_for_reading(path), options, RouteShape{1, 1, 1});
    store.read_header(expected);
    store.load_index_or_scan();
    return store;
  }

  // An existing file to add routes to (created when missing; an empty file, such as one whose
  // creator stopped before writing its header, is started anew). A torn last record is truncated
  // away (and reported in recovery()) so new records follow the last complete one. Like create,
  // it holds an exclusive lock until close(): two writers never interleave their appends, and of
  // two processes appending to a new file at once, one records and the other is told the file is
  // locked.
  static FileRouteStore append(const std::filesystem::path& path, RouteShape shape, FileStoreOptions options = {}) {
    shape.validate();
    check_format_version(options, "FileRouteStore::append");
    auto file = detail::RouteFileHandle::open_for_appending(path);
    // Under the lock, an empty file is new: created by this call, or by another writer that has
    // not written its header yet (it is then refused as "locked" when it tries; had it locked
    // first, the file would not be empty now), or left by one that stopped before writing it. It
    // holds no routes, so it is started as a new file.
    if (file.size() == 0) return start_new_file(std::move(file), shape, options);
    FileRouteStore store(std::move(file), options, shape);
    store.read_header(shape);
    if (options.format_version != 0 && options.format_version != store.header_.version)
      throw RouteFileError(detail::str("mrr::FileRouteStore::append: route file ", path.string(),
                                       " is in format version ", store.header_.version,
                                       " but format_version = ", options.format_version,
                                       " was asked for; a file keeps its version (leave format_version 0 to append in "
                                       "the file's own, or start a new file)"));
    store.load_index_or_scan();
    if (store.recovery_.torn_bytes > 0) store.file_.truncate(store.end_, "its torn tail");
    store.index_dirty_ = store.index_dirty_ || !store.recovery_.opened_from_index;
    return store;
  }

  // Moves keep everything (an open writer stays the file's one writer); the moved-from store is
  // empty. Assigning closes (writing the index of) the store assigned to first.
  FileRouteStore(FileRouteStore&& other) noexcept = default;
  FileRouteStore& operator=(FileRouteStore&& other) noexcept {
    if (this != &other) {
      std::destroy_at(this);  // closes, as the destructor does
      std::construct_at(this, std::move(other));
    }
    return *this;
  }
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
  // The file's format version (docs/route-file-format.md): route_file::kVersion for new files.
  int format_version() const { return header_.version; }
  const std::filesystem::path& path() const { return file_.path(); }
  const RouteFileRecovery& recovery() const { return recovery_; }
  bool writable() const { return file_.writable() && !closed_; }
  bool is_open() const { return file_.is_open() && !closed_; }
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
    detail::check_batch_agrees(layout.runs(), row_ids, k, fn, sorted_runs_);
    auto& batch = write_batch_;
    batch.clear();
    for (const TokenRun& run : layout.runs()) {
      const SequenceIndex* seq = ensure_loaded(run.uid);
      // Rows already in the file must hold the same ids (a no-op); the rest become records.
      std::int64_t cursor = run.first_position;
      const std::int64_t run_end = run.first_position + static_cast<std::int64_t>(run.count);
      auto row_of = [&](std::int64_t pos) { return row_ids(run.first_row + static_cast<std::size_t>(pos - run.first_position)); };
      auto emit = [&](std::int64_t from, std::int64_t to) {
        if (to <= from) return;
        const auto count = static_cast<std::size_t>(to - from);
        const std::size_t row = run.first_row + static_cast<std::size_t>(from - run.first_position);
        auto* payload = batch.begin(codec_, run.uid, from, static_cast<std::uint32_t>(count), layer, 1);
        if (!codec_.encode_rows(row_ids(row), stride, count, payload))  // range-checked while encoding
          check_id_rows(row_ids(row), stride, count, fn, TokenRun{run.uid, from, row, count}, layer);
        batch.finish();
      };
      if (seq != nullptr)
        seq->for_each_overlap(layer, run.first_position, run_end, [&](const Segment& s, std::int64_t a, std::int64_t b) {
          const std::size_t row = run.first_row + static_cast<std::size_t>(a - run.first_position);
          check_id_rows(row_ids(row), stride, static_cast<std::size_t>(b - a), fn, TokenRun{run.uid, a, row, 0}, layer);
          if (const std::int64_t pos = first_mismatch(s, a, b, row_of); pos != b)
            detail::RouteTable::conflict(fn, run.uid, pos, layer);
          emit(cursor, a);
          cursor = std::max(cursor, b);
        });
      emit(cursor, run_end);
    }
    check_sparse_before_write(batch, fn);
    commit(batch, fn);
  }

  // A span of one sequence for a range of layers, ids laid out [tokens][layers][k] (vLLM order).
  // An identical re-record is a no-op; otherwise the whole block is one record. Ids are int32
  // (the router's), or uint8 / uint16 as vLLM returns routed_experts: those are range-checked and
  // encoded as they are (a 1-byte file copies 1-byte ids), never widened to int32 first.
  void record_sequence(SequenceId uid, std::int64_t first_position, std::int64_t num_tokens, int first_layer,
                       int num_layers, std::span<const std::int32_t> ids) {
    record_block(uid, first_position, num_tokens, first_layer, num_layers, ids);
  }
  void record_sequence(SequenceId uid, std::int64_t first_position, std::int64_t num_tokens, int first_layer,
                       int num_layers, std::span<const std::uint16_t> ids) {
    record_block(uid, first_position, num_tokens, first_layer, num_layers, ids);
  }
  void record_sequence(SequenceId uid, std::int64_t first_position, std::int64_t num_tokens, int first_layer,
                       int num_layers, std::span<const std::uint8_t> ids) {
    record_block(uid, first_position, num_tokens, first_layer, num_layers, ids);
  }

 private:
  template <class Id>
  void record_block(SequenceId uid, std::int64_t first_position, std::int64_t num_tokens, int first_layer,
                    int num_layers, std::span<const Id> ids) {
    constexpr const char* fn = "FileRouteStore::record_sequence";
    require_writable(fn);
    cache_.check_block_extent(first_position, num_tokens, first_layer, num_layers, ids.size(), fn);
    detail::require(num_tokens <= 0xffffffffLL, fn, "num_tokens ", num_tokens,
                    " does not fit a record (at most 2^32 - 1 tokens per call)");
    if (num_tokens == 0) return;  // nothing to record (and an empty span's data() may be null)
    const int k = shape().topk;
    const auto row_stride = static_cast<std::size_t>(num_layers) * static_cast<std::size_t>(k);
    // Every id in range before anything is compared or written. The pass per layer, with rows
    // num_layers * k ids apart, does not vectorise: it runs only to name a bad id. A sequence the
    // file does not hold yet (the common case) is checked by the encoding itself (one pass over
    // the ids, into the write buffer, nothing written on failure); one it holds, by a contiguous
    // pass first, before its records are compared with the new ids.
    auto name_bad_id = [&] {
      for (int l = 0; l < num_layers; ++l)
        check_id_rows(ids.data() + static_cast<std::size_t>(l) * static_cast<std::size_t>(k), row_stride,
                      static_cast<std::size_t>(num_tokens), fn, TokenRun{uid, first_position, 0, 0}, first_layer + l);
      detail::throw_invalid_argument(fn, "sequence ", uid, ": an expert id is outside [0, ", shape().num_experts, ")");
    };
    const bool held = loaded_.find(uid) != loaded_.end() || index_.find(uid) != nullptr;
    if (held && !codec_.ids_in_range(ids.data(), ids.size())) name_bad_id();
    const SequenceIndex* seq = held ? ensure_loaded(uid) : nullptr;
    bool any_new = seq == nullptr;
    const std::int64_t end = first_position + num_tokens;
    if (seq != nullptr)
      for (int l = 0; l < num_layers; ++l) {
        std::int64_t cursor = first_position;
        auto row_of = [&](std::int64_t pos) {
          return ids.data() + static_cast<std::size_t>(pos - first_position) * row_stride +
                 static_cast<std::size_t>(l) * static_cast<std::size_t>(k);
        };
        seq->for_each_overlap(first_layer + l, first_position, end, [&](const Segment& s, std::int64_t a, std::int64_t b) {
          if (const std::int64_t pos = first_mismatch(s, a, b, row_of); pos != b)
            detail::RouteTable::conflict(fn, uid, pos, first_layer + l);
          any_new = any_new || a > cursor;
          cursor = std::max(cursor, b);
        });
        any_new = any_new || cursor < end;
      }
    if (!any_new) return;
    if constexpr (std::is_same_v<Id, std::uint8_t>) {
      if (codec_.id_width() == 1) {  // the ids are their own encoding: written from where they are
        if (!held && !codec_.ids_in_range(ids.data(), ids.size())) name_bad_id();
        write_record_from(uid, first_position, static_cast<std::uint32_t>(num_tokens), first_layer, num_layers,
                          ids.data(), fn);
        return;
      }
    }
    auto& batch = write_batch_;
    batch.clear();
    auto* payload = batch.begin(codec_, uid, first_position, static_cast<std::uint32_t>(num_tokens), first_layer,
                                num_layers);
    if (!codec_.encode_ids(ids.data(), ids.size(), payload)) {  // the range check of a new sequence
      batch.clear();
      name_bad_id();
    }
    batch.finish();
    check_sparse_before_write(batch, fn);
    commit(batch, fn);
  }

 public:
  // As MemoryRouteStore::lookup. Ids are read from the file in chunks and decoded into `out`; each
  // record is verified (checksum, id range) before the lookup returns any of its ids, from the
  // read that decodes it when it fits one (records that overlap are verified and compared when
  // their sequence is first used). Records of one layer taken whole are read after the runs, those
  // adjacent in the file at once (read_whole_records). If it throws, `out` holds what was read. No allocation once
  // `out`, `found`, the read buffer and the sequence's index are sized. Throws RouteFileError when the file was
  // truncated or replaced since it was opened.
  //
  // Id: int32 (ExpertIds, what the routers take), int64 (torch's topk), or the narrow uint8 /
  // uint16 of rollout engines (vLLM's routed_experts) when every expert id fits it: a file of 1-byte
  // ids then copies its rows out without widening (a quarter of the bytes to write, or to send to a
  // GPU). Rows not found are -1 for signed ids and all ones for unsigned ones; `found` says which.
  template <class Id>
  std::size_t lookup(int layer, const TokenLayout& layout, RowMatrix<Id>& out, std::vector<std::uint8_t>& found) const {
    constexpr const char* fn = "FileRouteStore::lookup";
    detail::require_ids_fit<Id>(shape(), fn);
    cache_.check_layer(layer, fn);
    require_readable(fn);
    const int k = shape().topk;
    const std::size_t rows = layout.size(), row_bytes = codec_.row_bytes();
    if (out.rows() != static_cast<Eigen::Index>(rows) || out.cols() != k) out.resize(static_cast<Eigen::Index>(rows), k);
    found.assign(rows, 0);
    std::size_t hits = 0;
    bool read_any = false, held_any = false;
    whole_reads_.clear();
    for (const TokenRun& run : layout.runs()) {
      SequenceIndex* seq = ensure_loaded(run.uid, &read_any, /*lazy=*/true);
      if (seq == nullptr) continue;
      std::int64_t cursor = run.first_position;  // rows below it are filled (overlapping records agree)
      const std::int64_t run_end = run.first_position + static_cast<std::int64_t>(run.count);
      seq->for_each_overlap(layer, run.first_position, run_end, [&](const Segment& s, std::int64_t a, std::int64_t b) {
        a = std::max(a, cursor);
        if (b <= a) return;
        auto decode_strided = [&](std::int64_t pos, std::size_t n, const unsigned char* src, std::uint32_t stride) {
          const std::size_t row = run.first_row + static_cast<std::size_t>(pos - run.first_position);
          codec_.decode_rows(src, stride, n, out.data() + row * static_cast<std::size_t>(k));
          std::memset(found.data() + row, 1, n);
        };
        auto decode = [&](std::int64_t pos, std::size_t n, const unsigned char* src) {
          decode_strided(pos, n, src, s.stride);
        };
        hits += static_cast<std::size_t>(b - a);
        cursor = b;
        // A record of several layers is read whole once, verified, and kept layer-major for the
        // lookups of its other layers: this layer's rows are then contiguous.
        if (s.stride > row_bytes) {
          if (const unsigned char* layers = held_record(*seq, s)) {
            held_any = true;
            const std::uint64_t layer_in_record = (s.payload - s.record - route_file::kRecordHeaderBytes) / row_bytes;
            decode_strided(a, static_cast<std::size_t>(b - a),
                           layers + (layer_in_record * s.count + static_cast<std::uint64_t>(a - s.first)) * row_bytes,
                           static_cast<std::uint32_t>(row_bytes));
            return;
          }
        }
        // A record of one layer whose rows this lookup takes whole: read after the runs, with the
        // lookup's other such records (read_whole_records).
        if (s.stride == row_bytes && a == s.first && b == s.end() &&
            defers_whole_read<Id>(route_file::kRecordHeaderBytes + std::uint64_t{s.count} * row_bytes)) {
          whole_reads_.push_back({s.record, seq, codec_.routes_header(run.uid, s.first, s.count, s.layer, 1),
                                  run.first_row + static_cast<std::size_t>(a - run.first_position)});
          return;
        }
        // A record read for the first time is verified before any of its ids is used; when it
        // fits one read, the ids are decoded from that same read.
        if (const unsigned char* record = verify_on_first_read(*seq, s.record)) {
          decode(a, static_cast<std::size_t>(b - a),
                 record + (s.payload - s.record) + static_cast<std::uint64_t>(a - s.first) * s.stride);
          return;
        }
        for_each_row_chunk(s, a, b, read_buffer_, decode);
      });
    }
    if (!whole_reads_.empty()) read_whole_records(out.data(), found.data());
    if (hits > 0 || read_any) file_.check_unchanged(fn);  // what was read is this file's, not a replacement's
    if (held_any) file_.check_not_truncated(fn, end_);    // as a read of the kept records would
    if (hits != rows)
      for (std::size_t r = 0; r < rows; ++r)
        if (found[r] == 0) std::fill_n(out.data() + r * static_cast<std::size_t>(k), k, static_cast<Id>(-1));
    return hits;
  }

  std::int64_t recorded_positions(SequenceId uid) const {
    bool read_any = false;
    const SequenceIndex* s = ensure_loaded(uid, &read_any, /*lazy=*/true);  // the headers say it
    if (read_any) file_.check_unchanged("FileRouteStore::recorded_positions");
    return s != nullptr && !s->segments.empty() ? s->end : 0;
  }
  bool contains(SequenceId uid) const { return index_.contains(uid); }
  std::size_t num_sequences() const { return index_.num_sequences(); }
  std::vector<SequenceId> sequences() const { return index_.sequences(); }

  // The routes of one sequence as a table, read from the file and verified (throws
  // RouteFileError if damaged). lookup() does not need it: it decodes from the file directly.
  const SequenceRoutes* sequence(SequenceId uid) const {
    constexpr const char* fn = "FileRouteStore::sequence";
    require_readable(fn);
    const SequenceIndex* s = ensure_loaded(uid);
    if (s == nullptr) return nullptr;
    if (const SequenceRoutes* done = cache_.find(uid)) return done;
    SequenceRoutes seq(shape());
    if (s->end > s->first) seq.reserve(s->first, s->end);
    for (const Segment& g : s->segments)
      for_each_row_chunk(g, g.first, g.end(), read_buffer_, [&](std::int64_t pos, std::size_t n, const unsigned char* src) {
        for (std::size_t t = 0; t < n; ++t) seq.put_encoded(pos + static_cast<std::int64_t>(t), g.layer, src + t * g.stride);
      });
    file_.check_unchanged(fn);
    cache_.insert(uid, std::move(seq));
    return cache_.find(uid);
  }

  // Forgets what was read of sequences (their record index, tables and the records kept whole; the
  // file keeps them): the next lookup reads and verifies their records again.
  void release_cache() const {
    cache_.clear();
    loaded_.clear();
    held_.clear();
  }

  // Bytes of records the reader keeps whole for lookups now (their rows and bookkeeping; at most
  // FileStoreOptions::read_cache_bytes).
  std::size_t read_cache_used() const { return held_.bytes_held(); }

  // Records are written through on every call; sync() also asks the device to persist them.
  void sync() { file_.sync(); }

  // Writes the index and tail records (when routes were added), syncs if configured, and ends
  // writing: the lock is released, so another writer may append. The store stays readable (its
  // descriptor is kept until it is destroyed), so what was recorded can still be looked up.
  void close() {
    if (!file_.is_open() || closed_) return;
    if (file_.writable() && index_dirty_) {
      file_.check_still_ours("FileRouteStore::close", end_);
      write_index();
      index_dirty_ = false;
      sync_pending_ = options_.sync_on_close;
    }
    // Until a sync succeeds, every close() tries it again (and a failed sync stays failed: see
    // RouteFileHandle::sync), so a retried close() never reports records persisted that are not;
    // after a failed sync() it fails too, also without sync_on_close.
    if (sync_pending_ || file_.sync_failed()) {
      sync();
      sync_pending_ = false;
    }
    closed_ = true;
    file_.unlock();
  }

 private:
  using Segment = detail::RouteSegment;
  using SequenceIndex = detail::SequenceIndex;

  FileRouteStore(detail::RouteFileHandle file, FileStoreOptions options, RouteShape shape)
      : file_(std::move(file)), options_(options), cache_(shape), held_(options.read_cache_bytes) {
    header_.shape = shape;
    header_.id_width = static_cast<std::uint8_t>(id_width_for(shape.num_experts));
    codec_ = detail::RouteCodec(header_);
  }

  // Writes the header of a new file (empty, locked for writing).
  static FileRouteStore start_new_file(detail::RouteFileHandle file, const RouteShape& shape,
                                       const FileStoreOptions& options) {
    FileRouteStore store(std::move(file), options, shape);
    store.header_.version = options.format_version != 0 ? options.format_version : route_file::kVersion;
    store.codec_ = detail::RouteCodec(store.header_);
    store.header_.file_id = new_file_id();
    unsigned char header[route_file::kHeaderBytes];
    route_file::encode(store.header_, header);
    store.file_.set_header(header);
    store.file_.write_all(header, sizeof header, 0);
    store.end_ = route_file::kHeaderBytes;
    store.index_dirty_ = true;
    return store;
  }

  static void check_format_version(const FileStoreOptions& options, const char* fn) {
    if (options.format_version != 0 && !route_file::version_supported(options.format_version))
      throw RouteFileError(detail::str("mrr::", fn, ": format_version = ", options.format_version,
                                       " is not a route file version this mrr writes (0 for the newest, or ",
                                       route_file::kOldestVersion, " to ", route_file::kVersion, ")"));
  }

  // A random 64-bit id for a new file's header: what tells two route files of one shape apart.
  static std::uint64_t new_file_id() {
    std::uint64_t seed[3] = {static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()),
                             static_cast<std::uint64_t>(::getpid()), 0};
    try {
      std::random_device rd;
      seed[2] = (std::uint64_t{rd()} << 32) ^ rd();
    } catch (...) {
      // No entropy source: time and pid still differ between files.
    }
    static std::atomic<std::uint64_t> counter{0};  // files created by this process
    seed[1] ^= counter.fetch_add(1, std::memory_order_relaxed) << 32;
    const std::uint64_t id = XXH64(seed, sizeof seed, 0);
    return id != 0 ? id : 1;  // 0 means "written before file ids existed"
  }

  [[noreturn]] void damaged(std::uint64_t offset, const std::string& what) const {
    throw RouteFileError(detail::str("route file ", path().string(), " is damaged: ", what, " at offset ", offset,
                                     "; refusing to use it (no route is ever replayed from a damaged record)"));
  }

  void require_writable(const char* fn) const {
    if (!file_.is_open() || closed_)
      throw RouteFileError(detail::str("mrr::", fn, ": route file ", path().string(), " is closed"));
    if (!file_.writable())
      throw RouteFileError(detail::str("mrr::", fn, ": route file ", path().string(),
                                       " was opened read-only (FileRouteStore::open, or a configuration's replay_file "
                                       "alone); use create or append to record (record_file), and replay a read-only "
                                       "file without recording: R2's old-log-prob pass records, so replay it with "
                                       "set_action(replay_forward) instead"));
  }
  void require_readable(const char* fn) const {
    if (!file_.is_open())
      throw RouteFileError(detail::str("mrr::", fn, ": this FileRouteStore was moved from; it has no file"));
  }

  void read_header(const std::optional<RouteShape>& expected) {
    const std::uint64_t size = file_.size();
    if (size < route_file::kHeaderBytes)
      throw RouteFileError(detail::str("route file ", path().string(), " is too short to hold a header (", size,
                                       " bytes): not a route file, or its writer stopped while creating it"));
    unsigned char buf[route_file::kHeaderBytes];
    file_.read_exact(buf, sizeof buf, 0);
    route_file::FileHeader h;
    if (const std::string why = route_file::decode(buf, h); !why.empty())
      throw RouteFileError(detail::str("route file ", path().string(), " cannot be used: ", why));
    file_.set_header(buf);
    if (expected) {
      const auto& e = *expected;
      auto mismatch = [&](const char* field, std::int32_t file_value, std::int32_t model_value) {
        throw RouteFileError(detail::str("route file ", path().string(), " has ", field, " = ", file_value,
                                         " but the model has ", model_value, "; it was recorded for another model"));
      };
      if (h.shape.num_experts != e.num_experts) mismatch("num_experts", h.shape.num_experts, e.num_experts);
      if (h.shape.num_layers != e.num_layers) mismatch("num_layers (MoE layers)", h.shape.num_layers, e.num_layers);
      if (h.shape.topk != e.topk) mismatch("topk", h.shape.topk, e.topk);
    }
    header_ = h;
    codec_ = detail::RouteCodec(h);
    cache_ = detail::RouteTable(h.shape);
  }

  // A clean file ends with [index record][tail record]; anything else is rescanned.
  void load_index_or_scan() {
    const std::uint64_t size = file_.size();
    end_ = size;
    if (try_load_index(size)) return;
    scan(size);
  }

  bool try_load_index(std::uint64_t size) {
    const std::uint64_t tail_bytes = route_file::record_bytes(8);
    if (size < route_file::kHeaderBytes + tail_bytes) return false;
    unsigned char tail[route_file::kRecordHeaderBytes + 8];  // a tail record is exactly this
    file_.read_exact(tail, sizeof tail, size - tail_bytes);
    const std::optional<std::uint64_t> tail_points_at = detail::decode_tail(header_.version, header_.file_id, tail);
    if (!tail_points_at) return false;
    const std::uint64_t index_offset = *tail_points_at;
    if (index_offset < route_file::kHeaderBytes || index_offset > size - tail_bytes - route_file::kRecordHeaderBytes) {
      recovery_.index_damaged = true;
      return false;
    }
    // From here on the tail is intact, so [index_offset, size - tail_bytes) is the index record:
    // if it is damaged, the rescan steps over it (it holds no routes).
    damaged_index_ = {index_offset, size - tail_bytes};
    unsigned char ih_bytes[route_file::kRecordHeaderBytes];
    file_.read_exact(ih_bytes, sizeof ih_bytes, index_offset);
    route_file::RecordHeader ih;
    // The payload size is checked against the file before it is padded or allocated.
    if (!route_file::decode(ih_bytes, ih) || ih.type != route_file::RecordType::index ||
        ih.uid != route_file::index_and_tail_uid(header_.version, header_.file_id) ||
        ih.payload_bytes > size - tail_bytes - index_offset ||
        index_offset + route_file::record_bytes(ih.payload_bytes) != size - tail_bytes || ih.payload_bytes < 8 ||
        (ih.payload_bytes - 8) % route_file::index_entry_bytes(header_.version) != 0) {
      recovery_.index_damaged = true;
      return false;
    }
    std::vector<unsigned char> payload(static_cast<std::size_t>(ih.payload_bytes));
    file_.read_exact(payload.data(), payload.size(), index_offset + route_file::kRecordHeaderBytes);
    const auto count = route_file::detail::get<std::uint64_t>(payload.data());
    if (route_file::checksum(header_.version, ih_bytes, payload.data(), payload.size()) != ih.checksum ||
        count != (ih.payload_bytes - 8) / route_file::index_entry_bytes(header_.version)) {
      recovery_.index_damaged = true;
      return false;
    }
    if (!index_.read_entries(payload.data() + 8, count, index_offset, header_.version)) {
      recovery_.index_damaged = true;
      return false;
    }
    if (const std::string why = index_.check_entries(index_offset); !why.empty()) damaged(index_offset, why);
    recovery_.opened_from_index = true;
    recovery_.records = count;
    return true;
  }

  // Where the record at `offset` must end at the latest (the next record known, or the end).
  std::uint64_t record_limit(std::uint64_t offset) const { return index_.record_limit(offset, end_); }

  void scan(std::uint64_t size) {
    std::uint64_t offset = route_file::kHeaderBytes;
    index_.clear();
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
      file_.read_exact(hb, sizeof hb, offset);
      if (!route_file::decode(hb, h)) {
        if (all_zero(offset, size)) return torn(offset, size);
        damaged(offset, "no valid record header (bad magic, type or header check)");
      }
      // The header is intact, so its size is what was written: a payload running past the end
      // of the file is the record being written when the writer stopped.
      const std::uint64_t need = route_file::record_bytes(h.payload_bytes);
      if (h.payload_bytes > left || need > left) return torn(offset, size);
      if (stream_payload(hb, h, offset, [](const unsigned char*, std::size_t) {}) != h.checksum) {
        if (offset + need == size) return torn(offset, size);  // the last record, partly persisted
        // An index or tail left inside the file by an earlier close (appending leaves them in place)
        // holds no routes: its intact header gives its size, so it is stepped over and reported.
        if (h.type != route_file::RecordType::routes) {
          recovery_.index_damaged = true;
          offset += need;
          continue;
        }
        damaged(offset, detail::str("a routes record (sequence uid ", h.uid, ") fails its checksum"));
      }
      if (h.type == route_file::RecordType::routes) {
        check_route_record(h, offset, size);
        index_.add(h.uid, detail::IndexedRecord::of(h, offset));
        ++recovery_.records;
      }
      offset += need;
    }
  }

  // Reads the payload of the record at `offset` (header hb, h) in chunks of at most kReadChunk
  // bytes, calls f(bytes, n) on each, and returns its checksum: memory stays bounded whatever
  // the record's size.
  template <class F>
  std::uint64_t stream_payload(const unsigned char* hb, const route_file::RecordHeader& h, std::uint64_t offset, F&& f,
                               const unsigned char* prefix = nullptr, std::size_t prefix_bytes = 0) const {
    // `prefix`: the payload's first bytes, already read along with the header.
    route_file::RecordChecksum sum(header_.version, hb);
    const auto have = static_cast<std::size_t>(std::min<std::uint64_t>(prefix_bytes, h.payload_bytes));
    if (have > 0) {
      sum.update(prefix, have);
      f(prefix, have);
    }
    for (std::uint64_t done = have; done < h.payload_bytes;) {
      const auto n = static_cast<std::size_t>(std::min<std::uint64_t>(kReadChunk, h.payload_bytes - done));
      const unsigned char* p = file_.read_at(offset + route_file::kRecordHeaderBytes + done, n, read_buffer_);
      sum.update(p, n);
      f(p, n);
      done += n;
    }
    return sum.digest();
  }

  bool all_zero(std::uint64_t from, std::uint64_t to) const {
    std::vector<unsigned char> buf(1 << 16);
    while (from < to) {
      const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(buf.size(), to - from));
      file_.read_exact(buf.data(), n, from);
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

  // Every field of a routes record against the file's shape, the position bound and `limit`
  // (where the record must end: the next record, or the end of the file), before anything is
  // sized from it.
  void check_route_record(const route_file::RecordHeader& h, std::uint64_t offset, std::uint64_t limit) const {
    if (const std::string why = detail::route_record_problem(h, header_, offset, limit, end_); !why.empty())
      damaged(offset, why);
  }

  // How many bytes are read at a time: small enough to stay in L2 while decoded, large enough
  // that a system call costs little per byte. Route files are far larger; nothing else is sized
  // from them.
  static constexpr std::size_t kReadChunk = std::size_t{1} << 18;

  // Calls f(pos, n, rows) for the rows of segment s at positions [from, to), read from the file
  // kReadChunk bytes at a time: the row of pos + i is at rows + i * s.stride.
  template <class F>
  void for_each_row_chunk(const Segment& s, std::int64_t from, std::int64_t to, std::vector<unsigned char>& buf,
                          F&& f) const {
    const std::size_t row_bytes = codec_.row_bytes();
    const auto per_chunk = static_cast<std::int64_t>(std::max<std::size_t>(1, kReadChunk / s.stride));
    for (std::int64_t pos = from; pos < to;) {
      const std::int64_t n = std::min(per_chunk, to - pos);
      const std::size_t bytes = static_cast<std::size_t>(n - 1) * s.stride + row_bytes;
      f(pos, static_cast<std::size_t>(n), file_.read_at(s.payload + static_cast<std::uint64_t>(pos - s.first) * s.stride, bytes, buf));
      pos += n;
    }
  }

  // The first position in [a, b) whose row in segment s differs from the k ids at ids_of(pos),
  // or b when all agree.
  template <class IdsOf>
  std::int64_t first_mismatch(const Segment& s, std::int64_t a, std::int64_t b, IdsOf&& ids_of) const {
    std::int64_t bad = b;
    for_each_row_chunk(s, a, b, compare_buffer_, [&](std::int64_t pos, std::size_t n, const unsigned char* rows) {
      for (std::size_t i = 0; i < n && bad == b; ++i)
        if (!codec_.same_row(rows + i * s.stride, ids_of(pos + static_cast<std::int64_t>(i)))) bad = pos + static_cast<std::int64_t>(i);
    });
    return bad;
  }

  // Range check of `count` rows (`stride` ids apart) of positions run.first_position...: one
  // branch-free pass; the row-by-row check that names the bad id runs only when it fails.
  template <class Id>
  void check_id_rows(const Id* ids, std::size_t stride, std::size_t count, const char* fn, const TokenRun& run,
                     int layer) const {
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
    std::vector<std::int32_t> row(k);  // the row widened, for the message that names the bad id
    for (std::size_t r = 0; r < count; ++r) {
      std::copy_n(ids + r * stride, k, row.data());
      cache_.check_ids(row.data(), fn, run.uid, run.first_position + static_cast<std::int64_t>(r), layer);
    }
  }

  // A writer never makes a sequence that readers would refuse as too sparse.
  void check_sparse_before_write(const detail::RecordBatch& batch, const char* fn) const {
    auto& added = sparse_scratch_;
    added.clear();
    for (const auto& [h, at] : batch.records())
      add_extent(h);
    check_sparse_added(fn);
  }
  void check_sparse_before_write(std::initializer_list<route_file::RecordHeader> records, const char* fn) const {
    sparse_scratch_.clear();
    for (const auto& h : records)
      add_extent(h);
    check_sparse_added(fn);
  }
  void add_extent(const route_file::RecordHeader& h) const {
    sparse_scratch_.push_back({h.uid, h.first_position, h.first_position + std::int64_t{h.num_tokens},
                               std::uint64_t{h.num_tokens} * h.num_layers});
  }
  void check_sparse_added(const char* fn) const {
    auto& added = sparse_scratch_;
    detail::check_sparse_growth(shape(), added, [&](SequenceId uid) {
      detail::SequenceExtent e;
      if (auto it = loaded_.find(uid); it != loaded_.end()) e.add(it->second.first, it->second.end, it->second.rows_held);
      return e;
    }, fn);
  }

  // The record index of a sequence: read (headers checked) on first use, kept up to date by this
  // writer's appends. nullptr for a sequence the file does not hold. Sets *read_any when it read
  // the file (the caller then checks the file is unchanged). Its records are verified (checksum,
  // id range) before it returns, or with `lazy` (lookup) each when it is first read
  // (verify_on_first_read): a pass over a fresh sequence then reads each byte once.
  SequenceIndex* ensure_loaded(SequenceId uid, bool* read_any = nullptr, bool lazy = false) const {
    if (auto found = loaded_.find(uid); found != loaded_.end()) {
      if (!lazy && !found->second.unverified.empty()) {
        if (read_any != nullptr) *read_any = true;
        verify_pending(found->second);
      }
      return &found->second;
    }
    const std::vector<detail::IndexedRecord>* records = index_.find(uid);
    if (records == nullptr) return nullptr;
    if (read_any != nullptr) *read_any = true;
    SequenceIndex seq;
    const auto row_bytes = static_cast<std::uint32_t>(codec_.row_bytes());
    auto& headers = header_scratch_;
    headers.resize(records->size());
    for (std::size_t i = 0; i < records->size(); ++i) {
      const detail::IndexedRecord& r = (*records)[i];
      const std::uint64_t offset = r.offset;
      if (offset > end_ || end_ - offset < route_file::kRecordHeaderBytes)
        damaged(offset, detail::str("the index points past the end of the file for sequence uid ", uid));
      const std::uint64_t limit = record_limit(offset);
      route_file::RecordHeader& h = headers[i];
      if (lazy && r.has_header()) {
        // The index (version 2), a scan or this writer says what the record holds: nothing is
        // read until a lookup needs its rows, and then its header must say the same.
        h = header_of(uid, r);
        check_route_record(h, offset, limit);
        seq.unverified.push_back({offset, h});
      } else {
        // One read for the header and, when it fits a chunk, the whole record: its extent is
        // known (the next record starts at record_limit), so nothing beyond it is read. Lazy:
        // the header.
        const auto want = lazy ? route_file::kRecordHeaderBytes
                               : static_cast<std::size_t>(std::clamp<std::uint64_t>(
                                     limit - offset, route_file::kRecordHeaderBytes, kReadChunk));
        const unsigned char* record = file_.read_at(offset, want, read_buffer_);
        unsigned char hb[route_file::kRecordHeaderBytes];
        std::memcpy(hb, record, route_file::kRecordHeaderBytes);
        if (!route_file::decode(hb, h) || h.type != route_file::RecordType::routes || h.uid != uid)
          damaged(offset, detail::str("the index points at no route record of sequence uid ", uid));
        if (r.has_header() && !same_rows(h, header_of(uid, r))) damaged(offset, index_disagrees(uid));
        check_route_record(h, offset, limit);
        if (lazy)
          seq.unverified.push_back({offset, h});
        else
          verify_record(h, hb, offset, record + route_file::kRecordHeaderBytes, want - route_file::kRecordHeaderBytes);
      }
      seq.count(h);
    }
    if (const std::string why = detail::sparse_violation(shape(), {uid, seq.first, seq.end, seq.rows_held}); !why.empty())
      damaged(records->front().offset, why);
    seq.segments.reserve(records->size());
    for (std::size_t i = 0; i < records->size(); ++i)
      seq.append_segments(headers[i], (*records)[i].offset, row_bytes);
    seq.sort();
    std::sort(seq.unverified.begin(), seq.unverified.end());
    if (seq.has_overlaps()) verify_pending(seq);  // overlapping rows are compared: verified first
    check_overlaps_agree(seq, uid);
    return &loaded_.insert_or_assign(uid, std::move(seq)).first->second;
  }

  // The header a routes record of `uid` must have for what the index says of it (its checksum is
  // not in the index: it is checked against the payload when the record is read).
  route_file::RecordHeader header_of(SequenceId uid, const detail::IndexedRecord& r) const {
    return codec_.routes_header(uid, r.first_position, r.num_tokens, r.first_layer, r.num_layers);
  }
  static bool same_rows(const route_file::RecordHeader& a, const route_file::RecordHeader& b) {
    return a.type == b.type && a.uid == b.uid && a.payload_bytes == b.payload_bytes &&
           a.first_position == b.first_position && a.num_tokens == b.num_tokens && a.first_layer == b.first_layer &&
           a.num_layers == b.num_layers;
  }
  static std::string index_disagrees(SequenceId uid) {
    return detail::str("a route record of sequence uid ", uid,
                       " is not what the index (or its header read earlier) says of it");
  }

  // The header of a record whose rows were taken from `expected` (its header read earlier, or the
  // index) when its sequence was loaded, read again from `read` into hb: it must say the same.
  route_file::RecordHeader header_again(std::uint64_t offset, const route_file::RecordHeader& expected,
                                        const unsigned char* read, unsigned char* hb) const {
    std::memcpy(hb, read, route_file::kRecordHeaderBytes);
    route_file::RecordHeader h;
    if (!route_file::decode(hb, h) || !same_rows(h, expected)) damaged(offset, index_disagrees(expected.uid));
    return h;
  }

  // Verifies every record of `seq` not verified yet.
  void verify_pending(SequenceIndex& seq) const {
    for (const auto& p : seq.unverified) {
      unsigned char hb[route_file::kRecordHeaderBytes];
      const auto h =
          header_again(p.offset, p.header, file_.read_at(p.offset, route_file::kRecordHeaderBytes, read_buffer_), hb);
      verify_record(h, hb, p.offset, nullptr, 0);
    }
    seq.unverified.clear();
  }

  // When the record at `offset` is not verified yet, verifies it. Returns the whole record, read
  // once into read_buffer_, when it fits one read (the caller decodes from it), else nullptr (it
  // was verified by streaming it, or was verified before: the caller reads what it needs).
  const unsigned char* verify_on_first_read(SequenceIndex& seq, std::uint64_t offset) const {
    if (seq.unverified.empty()) return nullptr;
    const auto it = seq.pending_at(offset);
    if (it == seq.unverified.end()) return nullptr;
    const std::uint64_t bytes = it->bytes();
    const unsigned char* record =
        bytes <= kReadChunk ? file_.read_at(offset, static_cast<std::size_t>(bytes), read_buffer_) : nullptr;
    unsigned char hb[route_file::kRecordHeaderBytes];
    const auto h = header_again(
        offset, it->header,
        record != nullptr ? record : file_.read_at(offset, route_file::kRecordHeaderBytes, read_buffer_), hb);
    if (record != nullptr)
      verify_record(h, hb, offset, record + route_file::kRecordHeaderBytes,
                    static_cast<std::size_t>(bytes) - route_file::kRecordHeaderBytes);
    else
      verify_record(h, hb, offset, nullptr, 0);
    seq.unverified.erase(it);
    return record;
  }

  // lookup()'s records of one layer whose rows it takes whole (R2 records, and a replay's
  // micro-batch that holds whole sequences). Sorted by offset, records that follow one another in
  // the file (R2 writes a layer's records of a micro-batch in one write) are read in one system
  // call: into the caller's output directly when its ids are the file's bytes (the 56-byte
  // headers elsewhere), else into read_buffer_ and decoded from there. A record read for the first
  // time is verified (its header against what the index says, checksum, id range) before the
  // lookup returns, and only then marked verified; a damaged one throws RouteFileError (the
  // output then holds what was read, as after any lookup that throws). Every header read is
  // checked against the record's rows.
  struct WholeRead {
    std::uint64_t offset;
    SequenceIndex* seq;               // loaded_ holds it (node-based: stable across inserts)
    route_file::RecordHeader header;  // the record's rows, as its sequence's index says
    std::size_t row;                  // its first position's row in the output
  };

  // Whether lookup() defers reading a record of `bytes` into ids of type Id: always when the
  // output takes the file's bytes as they are, else when it fits read_buffer_ (larger ones are
  // verified and decoded in chunks where they are met).
  template <class Id>
  bool defers_whole_read(std::uint64_t bytes) const {
    return ids_are_bytes<Id>() || route_file::padded(bytes) <= kReadChunk;
  }
  template <class Id>
  bool ids_are_bytes() const {
    return sizeof(Id) == codec_.id_width() && std::endian::native == std::endian::little;
  }

  template <class Id>
  void read_whole_records(Id* out, std::uint8_t* found) const {
    auto& reads = whole_reads_;
    std::sort(reads.begin(), reads.end(), [](const WholeRead& x, const WholeRead& y) { return x.offset < y.offset; });
    const std::size_t k = static_cast<std::size_t>(shape().topk), row_bytes = codec_.row_bytes();
    const bool direct = ids_are_bytes<Id>();
    for (std::size_t i = 0; i < reads.size();) {
      // reads[i, j): records end to end in the file (the same record twice rides along), read at once.
      const std::uint64_t from = reads[i].offset;
      std::uint64_t to = from + route_file::record_bytes(reads[i].header.payload_bytes);
      int pieces = 3;
      std::size_t j = i + 1;
      for (; j < reads.size(); ++j) {
        if (reads[j].offset == reads[j - 1].offset) continue;
        const std::uint64_t end = reads[j].offset + route_file::record_bytes(reads[j].header.payload_bytes);
        if (reads[j].offset != to ||
            (direct ? pieces + 3 > detail::RouteFileHandle::kMaxReadPieces : end - from > kReadChunk))
          break;
        to = end;
        pieces += 3;
      }
      auto& headers = whole_read_headers_;
      const unsigned char* span = nullptr;  // the records as read, when not read into the output
      if (direct) {
        headers.resize(static_cast<std::size_t>(pieces / 3) * route_file::kRecordHeaderBytes);
        auto& iov = read_pieces_;
        iov.clear();
        for (std::size_t r = i, h = 0; r < j; ++r) {
          if (r > i && reads[r].offset == reads[r - 1].offset) continue;
          const std::uint64_t payload = reads[r].header.payload_bytes;
          iov.push_back({headers.data() + h++ * route_file::kRecordHeaderBytes, route_file::kRecordHeaderBytes});
          iov.push_back({out + reads[r].row * k, static_cast<std::size_t>(payload)});
          iov.push_back({read_padding_.data(), static_cast<std::size_t>(route_file::padded(payload) - payload)});
        }
        file_.read_exact(iov.data(), static_cast<int>(iov.size()), from);
      } else {
        span = file_.read_at(from, static_cast<std::size_t>(to - from), read_buffer_);
      }
      for (std::size_t r = i, h = 0; r < j; ++r) {
        const WholeRead& w = reads[r];
        const std::size_t n = w.header.num_tokens;
        Id* dst = out + w.row * k;
        if (r > i && w.offset == reads[r - 1].offset) {  // the same record again: its rows as read
          if (direct)
            std::memcpy(dst, out + reads[r - 1].row * k, n * row_bytes);
          else
            codec_.decode_rows(span + (w.offset - from) + route_file::kRecordHeaderBytes,
                               static_cast<std::uint32_t>(row_bytes), n, dst);
          std::memset(found + w.row, 1, n);
          continue;
        }
        const unsigned char* record =
            direct ? headers.data() + h++ * route_file::kRecordHeaderBytes : span + (w.offset - from);
        const unsigned char* payload =
            direct ? reinterpret_cast<const unsigned char*>(dst) : record + route_file::kRecordHeaderBytes;
        unsigned char hb[route_file::kRecordHeaderBytes];
        const auto h_read = header_again(w.offset, w.header, record, hb);
        if (const auto it = w.seq->pending_at(w.offset); it != w.seq->unverified.end()) {
          verify_record(h_read, hb, w.offset, payload, static_cast<std::size_t>(h_read.payload_bytes));
          w.seq->unverified.erase(it);
        }
        if (!direct) codec_.decode_rows(payload, static_cast<std::uint32_t>(row_bytes), n, dst);
        std::memset(found + w.row, 1, n);
      }
      i = j;
    }
  }

  // The rows of the record of segment s (one of several layers) in memory, layer-major ([layers,
  // tokens] rows): read whole once, verified then when it was not yet, and kept
  // (FileStoreOptions::read_cache_bytes). nullptr when it is not kept (the budget cannot hold it):
  // the caller reads its rows from the file.
  const unsigned char* held_record(SequenceIndex& seq, const Segment& s) const {
    if (const unsigned char* layers = held_.find(s.record)) return layers;
    const std::uint64_t payload = std::uint64_t{s.count} * s.stride;
    if (!held_.fits(payload)) return nullptr;
    auto& buf = held_.read_buffer();
    buf.resize(static_cast<std::size_t>(route_file::kRecordHeaderBytes + payload));
    file_.read_exact(buf.data(), buf.size(), s.record);
    if (const auto it = seq.pending_at(s.record); it != seq.unverified.end()) {  // first read: verified before use
      unsigned char hb[route_file::kRecordHeaderBytes];
      const auto h = header_again(s.record, it->header, buf.data(), hb);
      verify_record(h, hb, s.record, buf.data() + route_file::kRecordHeaderBytes,
                    buf.size() - route_file::kRecordHeaderBytes);
      seq.unverified.erase(it);
    }
    auto layers = held_.spare();
    layers.resize(static_cast<std::size_t>(payload));
    const std::size_t row_bytes = codec_.row_bytes();
    codec_.split_layers(buf.data() + route_file::kRecordHeaderBytes, s.count, s.stride / row_bytes, layers.data());
    return held_.keep(s.record, std::move(layers));
  }

  // Records covering the same (position, layer) must agree: each overlapped row is compared with
  // the earlier segment reaching furthest (which holds it), so all copies agree in turn. Reads
  // both sides in chunks; the work is bounded by the rows the records hold.
  void check_overlaps_agree(SequenceIndex& seq, SequenceId uid) const {
    const std::size_t row_bytes = codec_.row_bytes();
    for (std::size_t i = 1, reach = 0; i < seq.segments.size(); ++i) {
      const Segment& g = seq.segments[i];
      if (seq.segments[reach].layer != g.layer) {
        reach = i;
        continue;
      }
      const Segment& r = seq.segments[reach];
      if (r.end() > g.first) {
        seq.overlapping = true;
        for_each_row_chunk(g, g.first, std::min(r.end(), g.end()), read_buffer_,
                           [&](std::int64_t pos, std::size_t n, const unsigned char* g_rows) {
          for_each_row_chunk(r, pos, pos + static_cast<std::int64_t>(n), compare_buffer_,
                             [&](std::int64_t rpos, std::size_t rn, const unsigned char* r_rows) {
            for (std::size_t t = 0; t < rn; ++t)
              if (std::memcmp(r_rows + t * r.stride, g_rows + static_cast<std::size_t>(rpos - pos + static_cast<std::int64_t>(t)) * g.stride,
                              row_bytes) != 0)
                damaged(g.record, detail::str("two records of sequence uid ", uid, " disagree at position ",
                                              rpos + static_cast<std::int64_t>(t), " layer ", g.layer));
          });
        });
      }
      if (g.end() > r.end()) reach = i;
    }
  }

  // Checksum, and every id < num_experts (unless every value of the id width is a valid expert),
  // reading the payload in chunks.
  void verify_record(const route_file::RecordHeader& h, const unsigned char* hb, std::uint64_t offset,
                     const unsigned char* prefix, std::size_t prefix_bytes) const {
    const bool check_ids = codec_.ids_need_range_check();
    std::uint32_t top = 0;
    const std::uint64_t sum = stream_payload(
        hb, h, offset, [&](const unsigned char* p, std::size_t n) {
          if (check_ids) top = std::max(top, codec_.max_id(p, n));
        },
        prefix, prefix_bytes);
    if (sum != h.checksum) damaged(offset, detail::str("a record of sequence uid ", h.uid, " fails its checksum"));
    if (top >= static_cast<std::uint32_t>(shape().num_experts))
      damaged(offset, detail::str("a record of sequence uid ", h.uid, " holds expert id ", top, " >= num_experts ",
                                  shape().num_experts));
  }

  // One write for the whole call, after checking the path still names this writer's file and
  // nobody else changed it; memory state changes only after the write succeeded.
  void commit(const detail::RecordBatch& batch, const char* fn) {
    if (batch.empty()) return;
    const auto& bytes = batch.bytes();
    file_.check_still_ours(fn, end_);
    file_.write_all(bytes.data(), bytes.size(), end_);
    for (const auto& [h, at] : batch.records())
      committed(h, end_ + at);
    end_ += bytes.size();
    index_dirty_ = true;
  }

  // One routes record whose payload is `payload` as it stands (1-byte ids in a 1-byte file, range
  // checked by the caller): its header and the caller's bytes reach the file in one pwritev, with
  // no copy into a write buffer (a rollout's uint8 routed_experts, record_sequence).
  void write_record_from(SequenceId uid, std::int64_t first_position, std::uint32_t num_tokens, int first_layer,
                         int num_layers, const unsigned char* payload, const char* fn) {
    route_file::RecordHeader h = codec_.routes_header(uid, first_position, num_tokens, first_layer, num_layers);
    check_sparse_before_write({h}, fn);
    unsigned char header[route_file::kRecordHeaderBytes];
    route_file::encode(header_.version, h, payload, header);
    static constexpr unsigned char kPadding[8] = {};
    const iovec pieces[3] = {{header, sizeof header},
                             {const_cast<unsigned char*>(payload), static_cast<std::size_t>(h.payload_bytes)},
                             {const_cast<unsigned char*>(kPadding),
                              static_cast<std::size_t>(route_file::padded(h.payload_bytes) - h.payload_bytes)}};
    file_.check_still_ours(fn, end_);
    file_.write_all(pieces, 3, end_);
    committed(h, end_);
    end_ += route_file::record_bytes(h.payload_bytes);
    index_dirty_ = true;
  }

  // What a routes record written at `offset` changes in memory, once it is in the file.
  void committed(const route_file::RecordHeader& h, std::uint64_t offset) {
    index_.add(h.uid, detail::IndexedRecord::of(h, offset));
    ++recovery_.records;
    // The writer keeps its sequences' record index current: later records are checked against
    // it, and lookups read the new rows back through the page cache (no decoded copy).
    loaded_[h.uid].insert(h, offset, static_cast<std::uint32_t>(codec_.row_bytes()));
    cache_.erase(h.uid);
  }

  // The index and tail records that end a cleanly closed file, after its last record.
  void write_index() {
    const std::vector<unsigned char> bytes =
        detail::encode_index_and_tail(header_.version, header_.file_id, index_.encode(header_.version), end_);
    file_.write_all(bytes.data(), bytes.size(), end_);
    end_ += bytes.size();
  }

  detail::RouteFileHandle file_;  // the open file: descriptor, lock, positioned I/O, identity checks
  FileStoreOptions options_;
  route_file::FileHeader header_;
  detail::RouteCodec codec_;  // the file's id encoding (from header_)
  std::uint64_t end_ = 0;  // where the next record goes
  detail::RouteIndex index_;  // the routes records by sequence and in file order, and their bounds
  mutable std::unordered_map<SequenceId, SequenceIndex> loaded_;  // sequences read or written so far
  mutable detail::RouteTable cache_;  // tables built by sequence(), and the shape checks
  mutable detail::HeldRecords held_;  // records of several layers kept whole for lookups (read_cache_bytes)
  bool closed_ = false;                  // close() was called: no more writes, reads still work
  mutable std::vector<unsigned char> read_buffer_;     // chunks read from the file (kReadChunk)
  mutable std::vector<unsigned char> compare_buffer_;  // a second chunk, for comparisons
  mutable std::vector<route_file::RecordHeader> header_scratch_;  // record headers of a sequence being loaded
  mutable std::vector<detail::SequenceExtent> sparse_scratch_;
  mutable std::vector<WholeRead> whole_reads_;             // lookup()'s records read after its runs
  mutable std::vector<unsigned char> whole_read_headers_;  // their headers, read apart from their rows
  mutable std::vector<iovec> read_pieces_;
  mutable std::array<unsigned char, 8> read_padding_{};  // only written: pad bytes are not checked
  detail::RecordBatch write_batch_;  // reused across record calls
  std::vector<TokenRun> sorted_runs_;
  RouteFileRecovery recovery_;
  std::pair<std::uint64_t, std::uint64_t> damaged_index_{0, 0};  // [begin, end) of an index that failed its checks
  bool index_dirty_ = false;
  bool sync_pending_ = false;  // close() wrote the index and has yet to sync it (sync_on_close)
};

MRR_NAMESPACE_END
