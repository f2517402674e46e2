// In-memory route storage shared by the memory and file stores: per sequence, k ids for each
// (position, layer) in the narrowest id width, with presence bits. Recording is checked before
// anything is stored: an id out of range or a conflicting re-record rejects the whole batch.
// Work is done per run of consecutive positions (TokenRun), not per row.
#pragma once

#include <mrr/detail/checked.hpp>
#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>
#include <mrr/replay/layout.hpp>
#include <mrr/replay/shape.hpp>
#include <mrr/tensor.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

MRR_NAMESPACE_BEGIN

// The routes of one sequence. Rows are stored encoded (little-endian ids of id_width bytes),
// the same bytes a route file holds, so files decode with memcpy. Storage is dense over the span
// of positions recorded (from the lowest, not from 0), so a context-parallel shard or a record
// far into a sequence costs what it holds; every size is overflow-checked. It is layer-major: a
// layer's rows are contiguous, so a lookup (one layer of a run of positions) is one copy or
// widening loop. Position-major, each row of a layer's lookup was its own cache line, 10-13 ns a
// row.
class SequenceRoutes {
 public:
  explicit SequenceRoutes(const RouteShape& shape)
      : width_(id_width_for(shape.num_experts)), layers_(shape.num_layers), k_(shape.topk) {}

  // One past the highest position holding a route in any layer.
  std::int64_t positions() const { return positions_; }
  // The lowest position holding a route (kMaxPositions when none), and how many (position, layer)
  // rows hold one: with positions(), what the sparse bound (sparse_violation) is applied to.
  std::int64_t first_position() const { return first_; }
  std::uint64_t rows_held() const { return rows_held_; }
  std::size_t bytes() const { return present_.capacity() * (1 + static_cast<std::size_t>(row_bytes())); }
  int row_bytes() const { return k_ * width_; }

  bool has(std::int64_t pos, int layer) const {
    return pos >= base_ && pos < positions_ && present_[slot(pos, layer)] != 0;
  }

  // Copies the k ids of (pos, layer) to out; false when nothing is recorded there. Id holds every
  // id of the shape (the caller checked: detail::require_ids_fit).
  template <class Id>
  bool get(std::int64_t pos, int layer, Id* out) const {
    if (!has(pos, layer)) return false;
    const std::uint8_t* p = row(pos, layer);
    if (width_ == 1) {
      for (int j = 0; j < k_; ++j)
        out[j] = static_cast<Id>(p[j]);
    } else {
      for (int j = 0; j < k_; ++j)
        out[j] = static_cast<Id>(detail::load_id(p + j * width_, width_));
    }
    return true;
  }

  // The rows of `layer` at positions [first, first + count) to out (count rows of k ids) and
  // found (1 where recorded); returns how many were recorded. Rows not recorded are left as they
  // are. Id holds every id of the shape (the caller checked: detail::require_ids_fit).
  template <class Id>
  std::size_t get_run(std::int64_t first, std::size_t count, int layer, Id* out, std::uint8_t* found) const {
    const std::int64_t lo = std::max(first, base_);
    const std::int64_t hi = std::min(first + static_cast<std::int64_t>(count), positions_);
    if (lo >= hi) return 0;
    const std::size_t at = slot(lo, layer), n = static_cast<std::size_t>(hi - lo);
    const auto skip = static_cast<std::size_t>(lo - first), rb = static_cast<std::size_t>(row_bytes()),
               k = static_cast<std::size_t>(k_);
    const std::uint8_t* present = present_.data() + at;
    const std::size_t held = recorded_in(lo, n, layer);
    if (held == n) {  // the usual case: every row recorded, one pass
      detail::decode_ids(ids_.get() + at * rb, width_, n * k, out + skip * k);
      std::memset(found + skip, 1, n);
      return n;
    }
    for (std::size_t i = 0; i < n; ++i)
      if (present[i] != 0) {
        detail::decode_ids(ids_.get() + (at + i) * rb, width_, k, out + (skip + i) * k);
        found[skip + i] = 1;
      }
    return held;
  }

  // How many of the rows of `layer` at positions [first, first + count) are recorded (one pass
  // over their presence bytes, contiguous in a layer-major table).
  std::size_t recorded_in(std::int64_t first, std::size_t count, int layer) const {
    const std::int64_t lo = std::max(first, base_);
    const std::int64_t hi = std::min(first + static_cast<std::int64_t>(count), positions_);
    if (lo >= hi) return 0;
    const std::uint8_t* present = present_.data() + slot(lo, layer);
    std::size_t held = 0;
    for (std::size_t i = 0, n = static_cast<std::size_t>(hi - lo); i < n; ++i)
      held += present[i];
    return held;
  }

  // The encoded row of (pos, layer); only meaningful where has(pos, layer).
  const std::uint8_t* row(std::int64_t pos, int layer) const {
    return ids_.get() + slot(pos, layer) * static_cast<std::size_t>(row_bytes());
  }

  // True when (pos, layer) holds exactly these ids.
  bool same(std::int64_t pos, int layer, const std::int32_t* ids) const {
    const std::uint8_t* p = row(pos, layer);
    for (int j = 0; j < k_; ++j)
      if (detail::load_id(p + j * width_, width_) != static_cast<std::uint32_t>(ids[j])) return false;
    return true;
  }

  // Stores `count` rows of range-checked ids of `layer` at positions [first, first + count), row i
  // at ids + i * stride: the rows are contiguous in the table, so contiguous ids are encoded in one
  // pass (a row at a time, recording took twice as long).
  void put_run(std::int64_t first, std::size_t count, int layer, const std::int32_t* ids, std::size_t stride) {
    if (count == 0) return;
    const std::int64_t end = first + static_cast<std::int64_t>(count);
    if (first < base_ || end > base_ + cap_) cover(first, end, true);
    positions_ = std::max(positions_, end);
    first_ = std::min(first_, first);
    const std::size_t at = slot(first, layer), k = static_cast<std::size_t>(k_),
                      rb = static_cast<std::size_t>(row_bytes());
    std::uint8_t* present = present_.data() + at;
    std::size_t fresh = 0;
    for (std::size_t i = 0; i < count; ++i)
      fresh += present[i] == 0;
    rows_held_ += fresh;
    std::memset(present, 1, count);
    std::uint8_t* out = ids_.get() + at * rb;
    if (stride == k) {
      detail::encode_ids(ids, width_, count * k, out);
      return;
    }
    switch (width_) {  // strided ids (a [tokens, layers, k] block): row by row, the width a constant
      case 1:
        return put_strided<std::uint8_t>(ids, count, stride, out);
      case 2:
        return put_strided<std::uint16_t>(ids, count, stride, out);
      default:
        return put_strided<std::uint32_t>(ids, count, stride, out);
    }
  }

  // Stores an already encoded row (row_bytes() bytes).
  void put_encoded(std::int64_t pos, int layer, const std::uint8_t* encoded) {
    std::memcpy(writable_row(pos, layer), encoded, static_cast<std::size_t>(row_bytes()));
  }

  // Makes positions [first, end) addressable in one allocation (a reader that knows a sequence's
  // extent sizes it once). Throws RouteStoreError outside [0, kMaxPositions) or when the table
  // would not fit in memory's address space.
  void reserve(std::int64_t first, std::int64_t end) {
    if (first >= end) return;
    cover(first, end, false);
  }

 private:
  template <class Dst>
  void put_strided(const std::int32_t* ids, std::size_t count, std::size_t stride, std::uint8_t* out) const {
    const auto k = static_cast<std::size_t>(k_);
    for (std::size_t i = 0; i < count; ++i, ids += stride, out += k * sizeof(Dst))
      for (std::size_t j = 0; j < k; ++j) {
        const auto v = static_cast<Dst>(ids[j]);
        std::memcpy(out + j * sizeof(Dst), &v, sizeof v);
      }
  }

  std::size_t slot(std::int64_t pos, int layer) const {
    return static_cast<std::size_t>(layer) * static_cast<std::size_t>(cap_) + static_cast<std::size_t>(pos - base_);
  }
  std::int64_t capacity_positions() const { return cap_; }
  std::uint8_t* writable_row(std::int64_t pos, int layer) {
    if (pos < base_ || pos >= base_ + capacity_positions()) cover(pos, pos + 1, true);
    if (pos >= positions_) positions_ = pos + 1;
    first_ = std::min(first_, pos);
    std::uint8_t& present = present_[slot(pos, layer)];
    rows_held_ += present == 0;
    present = 1;
    return ids_.get() + slot(pos, layer) * static_cast<std::size_t>(row_bytes());
  }
  // Grows the table to cover [first, end), with geometric headroom when `grow` (sequences are
  // recorded a micro-batch slice at a time).
  void cover(std::int64_t first, std::int64_t end, bool grow) {
    if (first < 0 || end > kMaxPositions)
      throw RouteStoreError(detail::str("mrr::SequenceRoutes: position ", first < 0 ? first : end - 1,
                                        " outside [0, 2^32)"));
    const std::int64_t cap = capacity_positions();
    std::int64_t lo = cap == 0 ? first : std::min(base_, first);
    std::int64_t hi = cap == 0 ? end : std::max(base_ + cap, end);
    if (cap != 0 && lo == base_ && hi == base_ + cap) return;
    if (grow && cap != 0) {
      const std::int64_t headroom = (hi - lo) / 2;
      if (end > base_ + cap) hi = std::min(kMaxPositions, hi + headroom);
      if (first < base_) lo = std::max<std::int64_t>(0, lo - headroom);
    }
    std::size_t rows = 0, id_bytes = 0;
    if (!detail::checked_mul(hi - lo, layers_, rows) || !detail::checked_mul(rows, row_bytes(), id_bytes) ||
        rows > present_.max_size())
      throw RouteStoreError(detail::str("mrr::SequenceRoutes: positions [", lo, ", ", hi, ") x ", layers_,
                                        " layers do not fit in memory"));
    // Ids are left uninitialised (only rows marked present are ever read): no zero-fill pass.
    std::unique_ptr<std::uint8_t[]> ids(new std::uint8_t[id_bytes]);
    std::vector<std::uint8_t> present(rows, 0);
    if (cap != 0) {  // each layer's rows to their place in the larger table
      const auto old_cap = static_cast<std::size_t>(cap), new_cap = static_cast<std::size_t>(hi - lo);
      const auto shift = static_cast<std::size_t>(base_ - lo), rb = static_cast<std::size_t>(row_bytes());
      for (std::size_t l = 0; l < static_cast<std::size_t>(layers_); ++l) {
        std::memcpy(ids.get() + (l * new_cap + shift) * rb, ids_.get() + l * old_cap * rb, old_cap * rb);
        std::copy_n(present_.begin() + static_cast<std::ptrdiff_t>(l * old_cap), old_cap,
                    present.begin() + static_cast<std::ptrdiff_t>(l * new_cap + shift));
      }
    }
    ids_ = std::move(ids);
    present_ = std::move(present);
    base_ = lo;
    cap_ = hi - lo;
  }

  int width_, layers_, k_;
  std::int64_t base_ = 0;       // position of the first row of the table
  std::int64_t cap_ = 0;        // positions the table holds per layer (from base_)
  std::int64_t positions_ = 0;  // one past the highest position recorded
  std::int64_t first_ = kMaxPositions;  // the lowest position recorded
  std::uint64_t rows_held_ = 0;         // (position, layer) rows recorded
  std::unique_ptr<std::uint8_t[]> ids_;
  std::vector<std::uint8_t> present_;
};

namespace detail {

// Every store refuses a batch in which two rows for the same token (sequence, position) carry
// different experts: which of them would be kept is arbitrary, so recording either is wrong. Runs
// are sorted by (uid, first position); each is compared with the earlier run of its uid reaching
// furthest, which holds every position an earlier run could share with it, so all rows of a token
// are compared in a chain (O(runs log runs + rows)). `sorted` is scratch space.
template <class RowIds>
void check_batch_agrees(std::span<const TokenRun> runs, RowIds&& row_ids, int k, const char* fn,
                        std::vector<TokenRun>& sorted) {
  if (runs.size() < 2) return;
  sorted.assign(runs.begin(), runs.end());
  std::sort(sorted.begin(), sorted.end(), [](const TokenRun& a, const TokenRun& b) {
    return a.uid != b.uid ? a.uid < b.uid : a.first_position < b.first_position;
  });
  std::int64_t reach = -1;  // furthest end so far among runs of the current uid
  std::size_t reach_run = 0;
  for (std::size_t i = 0; i < sorted.size(); ++i) {
    const TokenRun& b = sorted[i];
    if (i > 0 && sorted[i - 1].uid != b.uid) reach = -1;
    const std::int64_t b_end = b.first_position + static_cast<std::int64_t>(b.count);
    if (reach > b.first_position) {
      const TokenRun& a = sorted[reach_run];
      for (std::int64_t pos = b.first_position; pos < std::min(reach, b_end); ++pos) {
        const auto* ra = row_ids(a.first_row + static_cast<std::size_t>(pos - a.first_position));
        const auto* rb = row_ids(b.first_row + static_cast<std::size_t>(pos - b.first_position));
        if (!std::equal(ra, ra + k, rb))
          throw RouteStoreError(str("mrr::", fn, ": two rows of the batch (rows ", a.first_row + static_cast<std::size_t>(pos - a.first_position),
                                    " and ", b.first_row + static_cast<std::size_t>(pos - b.first_position),
                                    ") hold sequence ", a.uid, " position ", pos,
                                    " but carry different experts; nothing was recorded"));
      }
    }
    if (b_end > reach) {
      reach = b_end;
      reach_run = i;
    }
  }
}

// The sparse bound (docs/route-file-format.md, "Bounds"). A sequence's table is dense over the
// positions recorded, from the lowest to the highest, and over every layer, so records far apart
// (positions 0 and 2^32 - 1 over 48 layers: 1.5 TiB) would cost memory out of all proportion to
// what they hold. Each (position, layer) row held pays for kSparseFactor whole positions (all
// layers) of table, plus kSparseSlack bytes in all: R2 recording, which holds one layer of a
// span before the next, and context-parallel shards stay far inside it. A sequence past it is
// refused: by writers before anything is stored, by file readers as damage.
inline constexpr std::uint64_t kSparseFactor = 32;
inline constexpr std::uint64_t kSparseSlack = std::uint64_t{1} << 20;

// The extent of a sequence's routes: positions [first, end), and the (position, layer) rows held.
struct SequenceExtent {
  SequenceId uid = 0;
  std::int64_t first = kMaxPositions, end = 0;
  std::uint64_t rows = 0;
  void add(std::int64_t from, std::int64_t to, std::uint64_t rows_added) {
    first = std::min(first, from);
    end = std::max(end, to);
    rows += rows_added;
  }
};

// Empty when the extent is within the sparse bound for this shape, else why not.
inline std::string sparse_violation(const RouteShape& shape, const SequenceExtent& e) {
  if (e.end <= e.first) return "";
  const auto per_row = static_cast<std::uint64_t>(1 + shape.topk * id_width_for(shape.num_experts));
  const auto layers = static_cast<std::uint64_t>(shape.num_layers);
  const std::uint64_t table = static_cast<std::uint64_t>(e.end - e.first) * layers;
  std::uint64_t table_bytes = 0, paid_bytes = 0;
  if (checked_mul(table, per_row, table_bytes) && checked_product(paid_bytes, e.rows, layers, per_row) &&
      table_bytes / kSparseFactor <= paid_bytes + kSparseSlack / kSparseFactor)
    return "";
  return str("the routes of sequence uid ", e.uid, " would span positions [", e.first, ", ", e.end, ") but hold ",
             e.rows, " (position, layer) rows; a table that sparse is refused");
}

// Writers call this before storing anything: `added` (any order, uids may repeat) extends the
// sequences whose current extent current(uid) gives; a sequence that would become too sparse is
// an InvalidArgument naming it, and nothing is recorded.
template <class Current>
void check_sparse_growth(const RouteShape& shape, std::vector<SequenceExtent>& added, Current&& current, const char* fn) {
  std::sort(added.begin(), added.end(), [](const SequenceExtent& a, const SequenceExtent& b) { return a.uid < b.uid; });
  for (std::size_t i = 0; i < added.size();) {
    SequenceExtent e = current(added[i].uid);
    e.uid = added[i].uid;
    for (; i < added.size() && added[i].uid == e.uid; ++i) e.add(added[i].first, added[i].end, added[i].rows);
    if (const std::string why = sparse_violation(shape, e); !why.empty())
      throw_invalid_argument(fn, "refusing to record: ", why, " (docs/route-file-format.md, \"Bounds\")");
  }
}

// uid -> SequenceRoutes, with the checks every store applies.
class RouteTable {
 public:
  explicit RouteTable(RouteShape shape) : shape_(shape) { shape_.validate(); }

  const RouteShape& shape() const { return shape_; }
  const SequenceRoutes* find(SequenceId uid) const {
    auto it = sequences_.find(uid);
    return it == sequences_.end() ? nullptr : &it->second;
  }
  SequenceRoutes& get_or_add(SequenceId uid) { return sequences_.try_emplace(uid, shape_).first->second; }
  void insert(SequenceId uid, SequenceRoutes routes) { sequences_.insert_or_assign(uid, std::move(routes)); }
  void erase(SequenceId uid) { sequences_.erase(uid); }
  void clear() { sequences_.clear(); }
  std::size_t size() const { return sequences_.size(); }
  std::size_t bytes() const {
    std::size_t n = 0;
    for (const auto& [uid, s] : sequences_) n += s.bytes() + sizeof(uid);
    return n;
  }

  void check_layer(int layer, const char* fn) const {
    detail::require(layer >= 0 && layer < shape_.num_layers, fn, "layer ", layer, " outside [0, ", shape_.num_layers,
                    ")");
  }

  void check_ids(const std::int32_t* ids, const char* fn, SequenceId uid, std::int64_t pos, int layer) const {
    // Branch-free range test (vectorises); the message is built only on failure.
    const auto limit = static_cast<std::uint32_t>(shape_.num_experts);
    bool bad = false;
    for (int j = 0; j < shape_.topk; ++j) bad |= static_cast<std::uint32_t>(ids[j]) >= limit;
    if (!bad) [[likely]]
      return;
    for (int j = 0; j < shape_.topk; ++j)
      if (ids[j] < 0 || ids[j] >= shape_.num_experts)
        detail::throw_invalid_argument(fn, "sequence ", uid, " position ", pos, " layer ", layer, " slot ", j,
                                       " has expert id ", ids[j], " outside [0, ", shape_.num_experts, ")");
  }

  // Whether `rows` rows of k ids (row r at ids + r * stride) are all in [0, num_experts): one
  // branch-free pass (an id u is outside exactly when u | (last - u) has its top bit set).
  bool rows_in_range(const std::int32_t* ids, std::size_t rows, std::size_t stride) const {
    const auto last = static_cast<std::uint32_t>(shape_.num_experts - 1);
    const auto k = static_cast<std::size_t>(shape_.topk);
    std::uint32_t any = 0;
    for (std::size_t r = 0; r < rows; ++r, ids += stride)
      for (std::size_t j = 0; j < k; ++j) {
        const auto v = static_cast<std::uint32_t>(ids[j]);
        any |= v | (last - v);
      }
    return (any >> 31) == 0;
  }

  [[noreturn]] static void conflict(const char* fn, SequenceId uid, std::int64_t pos, int layer) {
    throw RouteStoreError(detail::str("mrr::", fn, ": sequence ", uid, " position ", pos, " layer ", layer,
                                      " was already recorded with different experts; routes are never overwritten "
                                      "(give each recorded sequence a new uid, or erase it first)"));
  }

  // Checks a layer's rows before anything is stored and returns the runs of rows that are new:
  // an identical re-record is a no-op, a different one is an error.
  std::vector<TokenRun> new_runs(int layer, const TokenLayout& layout, const ExpertIdsRef& ids, const char* fn) const {
    check_layer(layer, fn);
    detail::require(static_cast<std::size_t>(ids.rows()) == layout.size() && ids.cols() == shape_.topk, fn,
                    "ids have shape ", detail::shape_of(ids), " for a layout of ", layout.size(), " rows and k=",
                    shape_.topk);
    auto row_ids = [&](std::size_t r) { return ids.data() + static_cast<Eigen::Index>(r) * ids.outerStride(); };
    std::vector<TokenRun> out;
    const auto stride = static_cast<std::size_t>(ids.outerStride());
    for (const TokenRun& run : layout.runs()) {
      if (run.count == 0) continue;
      const SequenceRoutes* seq = find(run.uid);
      // The usual case in one pass each: ids in range, and none of the run's rows recorded yet.
      if (rows_in_range(row_ids(run.first_row), run.count, stride) &&
          (seq == nullptr || seq->recorded_in(run.first_position, run.count, layer) == 0)) {
        out.push_back(run);
        continue;
      }
      // Row by row: the bad id or the conflicting row named, identical rows skipped.
      TokenRun pending{run.uid, run.first_position, run.first_row, 0};
      for (std::size_t i = 0; i < run.count; ++i) {
        const std::int64_t pos = run.first_position + static_cast<std::int64_t>(i);
        const std::int32_t* row = row_ids(run.first_row + i);
        check_ids(row, fn, run.uid, pos, layer);
        if (seq != nullptr && seq->has(pos, layer)) {
          if (!seq->same(pos, layer, row)) conflict(fn, run.uid, pos, layer);
          if (pending.count > 0) out.push_back(pending);
          pending = {run.uid, pos + 1, run.first_row + i + 1, 0};
        } else {
          ++pending.count;
        }
      }
      if (pending.count > 0) out.push_back(pending);
    }
    check_batch_agrees(layout.runs(), row_ids, shape_.topk, fn, sorted_runs_);
    return out;
  }

  // Checks the extent of a block [tokens][layers][k] that a caller hands to record_sequence:
  // positions inside [0, kMaxPositions), layers inside the shape, and exactly tokens*layers*k ids
  // (computed without overflow, so a huge token count cannot wrap to the size of a small span).
  void check_block_extent(std::int64_t first_position, std::int64_t num_tokens, int first_layer, int num_layers,
                          std::size_t num_ids, const char* fn) const {
    detail::require(first_position >= 0 && num_tokens >= 0, fn, "first_position (", first_position,
                    ") and num_tokens (", num_tokens, ") must be >= 0");
    detail::require(first_position <= kMaxPositions - num_tokens, fn, "first_position ", first_position, " + num_tokens ",
                    num_tokens, " is past the last position a store holds (positions must be < 2^32)");
    detail::require(first_layer >= 0 && num_layers > 0 && first_layer <= shape_.num_layers - num_layers, fn, "layers [",
                    first_layer, ", ", std::int64_t{first_layer} + num_layers, ") outside the store's [0, ",
                    shape_.num_layers, ")");
    std::size_t expect = 0;
    const bool fits = detail::checked_product(expect, num_tokens, num_layers, shape_.topk);
    detail::require(fits && num_ids == expect, fn, "ids has ", num_ids, " values, expected tokens*layers*k = ",
                    num_tokens, "*", num_layers, "*", shape_.topk);
  }

  // Checks a block [tokens][layers][k] of one sequence (ids in range, no conflicting re-record)
  // and returns whether any of it is new; an identical re-record is a no-op.
  bool new_block(SequenceId uid, std::int64_t first_position, std::int64_t num_tokens, int first_layer, int num_layers,
                 std::span<const std::int32_t> ids, const char* fn) const {
    const SequenceRoutes* existing = find(uid);
    const int k = shape_.topk;
    // The usual case (a new sequence, or new positions of one) in one pass each: ids in range,
    // and none of the block's rows recorded yet.
    if (num_tokens > 0 &&
        rows_in_range(ids.data(), ids.size() / static_cast<std::size_t>(k), static_cast<std::size_t>(k))) {
      bool none = true;
      for (int l = 0; existing != nullptr && none && l < num_layers; ++l)
        none = existing->recorded_in(first_position, static_cast<std::size_t>(num_tokens), first_layer + l) == 0;
      if (none) return true;
    }
    bool any_new = false;
    for (std::int64_t t = 0; t < num_tokens; ++t)
      for (int l = 0; l < num_layers; ++l) {
        const std::int32_t* row = ids.data() + (t * num_layers + l) * k;
        const std::int64_t pos = first_position + t;
        check_ids(row, fn, uid, pos, first_layer + l);
        if (existing && existing->has(pos, first_layer + l)) {
          if (!existing->same(pos, first_layer + l, row)) conflict(fn, uid, pos, first_layer + l);
        } else {
          any_new = true;
        }
      }
    return any_new;
  }

  // The extent of a sequence's routes so far (empty for one not held).
  SequenceExtent extent(SequenceId uid) const {
    SequenceExtent e;
    e.uid = uid;
    if (const SequenceRoutes* s = find(uid); s != nullptr && s->rows_held() > 0) {
      e.first = s->first_position();
      e.end = s->positions();
      e.rows = s->rows_held();
    }
    return e;
  }

  // Refuses (before anything is stored) additions that would make a sequence too sparse.
  void check_sparse(std::vector<SequenceExtent>& added, const char* fn) const {
    check_sparse_growth(shape_, added, [&](SequenceId uid) { return extent(uid); }, fn);
  }

  template <class Id>
  std::size_t lookup(int layer, const TokenLayout& layout, RowMatrix<Id>& out, std::vector<std::uint8_t>& found,
                     const char* fn) const {
    require_ids_fit<Id>(shape_, fn);
    check_layer(layer, fn);
    const std::size_t rows = layout.size(), k = static_cast<std::size_t>(shape_.topk);
    if (out.rows() != static_cast<Eigen::Index>(rows) || out.cols() != shape_.topk)
      out.resize(static_cast<Eigen::Index>(rows), shape_.topk);
    found.assign(rows, 0);
    std::size_t hits = 0;
    for (const TokenRun& run : layout.runs())
      if (const SequenceRoutes* seq = find(run.uid))
        hits += seq->get_run(run.first_position, run.count, layer, out.data() + run.first_row * k,
                             found.data() + run.first_row);
    if (hits != rows)
      for (std::size_t r = 0; r < rows; ++r)
        if (found[r] == 0) std::fill_n(out.data() + r * k, k, static_cast<Id>(-1));
    return hits;
  }

 private:
  RouteShape shape_;
  std::unordered_map<SequenceId, SequenceRoutes> sequences_;
  mutable std::vector<TokenRun> sorted_runs_;  // scratch of check_batch_agrees
};

}  // namespace detail

MRR_NAMESPACE_END
