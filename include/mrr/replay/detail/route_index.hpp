// The index of a route file (docs/route-file-format.md) and where each sequence's rows are:
// RouteIndex lists the routes records (by sequence, and in file order) with the checks an index
// read from a file must pass before it is trusted, and bounds each record by the next one
// (record_limit); SequenceIndex holds, per sequence in use, one segment per record and layer.
// No I/O: FileRouteStore reads the records these point at.
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>
#include <mrr/replay/file_format.hpp>
#include <mrr/replay/layout.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

MRR_NAMESPACE_BEGIN
namespace detail {

// A layer's rows in one record: `count` positions from `first`, the row of first + t at file
// offset payload + t * stride (R2 records hold one layer, so its rows are contiguous).
struct RouteSegment {
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
  std::vector<RouteSegment> segments;
  std::int64_t first = kMaxPositions, end = 0;  // positions its records span
  std::uint64_t rows_held = 0;                  // (position, layer) rows its records hold
  bool overlapping = false;                     // some segments of a layer overlap (and agree)
  // Records whose checksum and ids a reader has not verified yet, sorted by offset, with the
  // header their segments were made from (read from the file, or what the index says of it): the
  // header read with the record must say the same. FileRouteStore::lookup verifies each from the
  // same read that decodes it.
  struct Pending {
    std::uint64_t offset;
    route_file::RecordHeader header;
    std::uint64_t bytes() const { return route_file::kRecordHeaderBytes + header.payload_bytes; }
    bool operator<(const Pending& o) const { return offset < o.offset; }
  };
  std::vector<Pending> unverified;

  // The record at `offset` if it is not verified yet, else unverified.end().
  std::vector<Pending>::iterator pending_at(std::uint64_t offset) {
    const auto it = std::lower_bound(unverified.begin(), unverified.end(), offset,
                                     [](const Pending& p, std::uint64_t at) { return p.offset < at; });
    return it != unverified.end() && it->offset == offset ? it : unverified.end();
  }

  // Whether some segments of one layer overlap (their rows must then be compared).
  bool has_overlaps() const {
    for (std::size_t i = 1, reach = 0; i < segments.size(); ++i) {
      if (segments[reach].layer != segments[i].layer) {
        reach = i;
        continue;
      }
      if (segments[reach].end() > segments[i].first) return true;
      if (segments[i].end() > segments[reach].end()) reach = i;
    }
    return false;
  }

  static bool segment_order(const RouteSegment& a, const RouteSegment& b) {
    return a.layer != b.layer ? a.layer < b.layer : a.first != b.first ? a.first < b.first : a.payload < b.payload;
  }

  // Widens the span and the row count by those of the record `h`.
  void count(const route_file::RecordHeader& h) {
    first = std::min(first, h.first_position);
    end = std::max(end, h.first_position + std::int64_t{h.num_tokens});
    rows_held += std::uint64_t{h.num_tokens} * h.num_layers;  // < 2^48 per record
  }

  // Appends the segments of the record at `offset` (one per layer; rows of row_bytes) unsorted:
  // sort() once the last record of a sequence read from the file is in.
  void append_segments(const route_file::RecordHeader& h, std::uint64_t offset, std::uint32_t row_bytes) {
    if (h.num_tokens == 0) return;
    for (std::uint32_t l = 0; l < h.num_layers; ++l) segments.push_back(segment(h, offset, row_bytes, l));
  }
  void sort() { std::sort(segments.begin(), segments.end(), segment_order); }

  // A record this writer just appended: counted, and its segments inserted in order.
  void insert(const route_file::RecordHeader& h, std::uint64_t offset, std::uint32_t row_bytes) {
    count(h);
    if (h.num_tokens == 0) return;
    for (std::uint32_t l = 0; l < h.num_layers; ++l) {
      const RouteSegment g = segment(h, offset, row_bytes, l);
      auto at = std::upper_bound(segments.begin(), segments.end(), g, segment_order);
      // Sorted disjoint segments stay disjoint unless the new one overlaps a neighbour.
      if (at != segments.begin() && std::prev(at)->layer == g.layer && std::prev(at)->end() > g.first)
        overlapping = true;
      if (at != segments.end() && at->layer == g.layer && at->first < g.end()) overlapping = true;
      segments.insert(at, g);
    }
  }

  // Calls f(segment, a, b) for each segment of `layer` holding positions [a, b) of [from, to),
  // in order of first position.
  template <class F>
  void for_each_overlap(int layer, std::int64_t from, std::int64_t to, F&& f) const {
    const RouteSegment* begin = segments.data();
    const RouteSegment* stop = begin + segments.size();
    const RouteSegment* lo = std::lower_bound(begin, stop, layer, [](const RouteSegment& g, int l) { return g.layer < l; });
    const RouteSegment* hi = std::upper_bound(lo, stop, layer, [](int l, const RouteSegment& g) { return l < g.layer; });
    const RouteSegment* it = lo;
    if (!overlapping) {  // disjoint: only the last segment starting at or before `from` can hold it
      it = std::upper_bound(lo, hi, from, [](std::int64_t p, const RouteSegment& g) { return p < g.first; });
      if (it != lo) --it;
    }
    for (; it != hi && it->first < to; ++it)
      if (it->end() > from) f(*it, std::max(from, it->first), std::min(to, it->end()));
  }

 private:
  static RouteSegment segment(const route_file::RecordHeader& h, std::uint64_t offset, std::uint32_t row_bytes,
                              std::uint32_t l) {
    return {h.first_position, offset + route_file::kRecordHeaderBytes + std::uint64_t{l} * row_bytes, offset,
            h.first_layer + static_cast<std::int32_t>(l), h.num_tokens, row_bytes * h.num_layers};
  }
};

// A routes record an index lists: where it is and, when known, what its header says of its rows
// (a version-2 index carries that, and a scan or this writer read or wrote the header; a
// version-1 index lists offsets only, and the header is read when its sequence is first used).
// 24 bytes a record: num_layers is 0 when the header is not known (a routes record has at least one layer).
struct IndexedRecord {
  std::uint64_t offset = 0;
  std::int64_t first_position = 0;
  std::uint32_t num_tokens = 0;
  std::uint16_t first_layer = 0;
  std::uint16_t num_layers = 0;

  bool has_header() const { return num_layers != 0; }
  static IndexedRecord of(const route_file::RecordHeader& h, std::uint64_t offset) {
    return {offset, h.first_position, h.num_tokens, h.first_layer, h.num_layers};
  }
};

// The routes records of a file: per sequence and in file order, and the sorted offsets of every
// record (and index) known, which bound each record's extent.
class RouteIndex {
 public:
  // The routes record of `uid` at r.offset, which follows every record added before it.
  void add(SequenceId uid, const IndexedRecord& r) {
    auto& records = by_sequence_[uid];
    order_.push_back({uid, records.size()});
    records.push_back(r);
    boundaries_.push_back(r.offset);
  }

  void clear() {
    by_sequence_.clear();
    order_.clear();
    boundaries_.clear();
  }

  // The records of `uid`, in file order; nullptr for a sequence the file does not hold.
  const std::vector<IndexedRecord>* find(SequenceId uid) const {
    const auto it = by_sequence_.find(uid);
    return it == by_sequence_.end() ? nullptr : &it->second;
  }
  bool contains(SequenceId uid) const { return by_sequence_.count(uid) != 0; }
  std::size_t num_sequences() const { return by_sequence_.size(); }
  std::vector<SequenceId> sequences() const {
    std::vector<SequenceId> out;
    out.reserve(by_sequence_.size());
    for (const auto& [uid, records] : by_sequence_)
      out.push_back(uid);
    return out;
  }

  // An index record's payload in format `version`: the entry count, then one entry per record in
  // file order (route_file::index_entry_bytes). Every record of a version-2 file has its header
  // known (its index, a scan or this writer gave it), so its entries are complete.
  std::vector<unsigned char> encode(std::uint16_t version) const {
    const std::size_t entry = route_file::index_entry_bytes(version);
    std::vector<unsigned char> payload(8 + entry * order_.size());
    route_file::detail::put<std::uint64_t>(payload.data(), order_.size());
    for (std::size_t i = 0; i < order_.size(); ++i) {
      unsigned char* e = payload.data() + 8 + entry * i;
      const SequenceId uid = order_[i].uid;
      const IndexedRecord& r = by_sequence_.find(uid)->second[order_[i].at];
      route_file::detail::put<std::uint64_t>(e, uid);
      route_file::detail::put<std::uint64_t>(e + 8, r.offset);
      if (entry == 16) continue;
      if (!r.has_header())  // cannot happen: only a version-1 index leaves headers unknown
        throw RouteFileError(str("mrr: internal error: no header known for the record at offset ", r.offset));
      route_file::detail::put<std::int64_t>(e + 16, r.first_position);
      route_file::detail::put<std::uint32_t>(e + 24, r.num_tokens);
      route_file::detail::put<std::uint16_t>(e + 28, r.first_layer);
      route_file::detail::put<std::uint16_t>(e + 30, r.num_layers);
    }
    return payload;
  }

  // Adds the `count` entries of an index record of format `version` at `index_offset` (the
  // payload's entries after its count); false, with the index left empty, when one points outside
  // the records (before the first or at the index itself): the index is then damaged and the
  // file rescanned. Call check_entries() after a successful read. The rows an entry claims are
  // checked against the file's shape when its sequence is first used, and against the record's
  // own header when the record is read.
  bool read_entries(const unsigned char* entries, std::uint64_t count, std::uint64_t index_offset,
                    std::uint16_t version) {
    const std::size_t entry = route_file::index_entry_bytes(version);
    for (std::uint64_t i = 0; i < count; ++i) {
      const unsigned char* e = entries + i * entry;
      IndexedRecord r;
      r.offset = route_file::detail::get<std::uint64_t>(e + 8);
      if (r.offset < route_file::kHeaderBytes || r.offset >= index_offset) {
        clear();
        return false;
      }
      if (entry == 32) {
        r.first_position = route_file::detail::get<std::int64_t>(e + 16);
        r.num_tokens = route_file::detail::get<std::uint32_t>(e + 24);
        r.first_layer = route_file::detail::get<std::uint16_t>(e + 28);
        r.num_layers = route_file::detail::get<std::uint16_t>(e + 30);
        if (!r.has_header()) {  // no routes record has 0 layers: a damaged index, rescanned
          clear();
          return false;
        }
      }
      add(route_file::detail::get<std::uint64_t>(e), r);
    }
    return true;
  }

  // What is wrong with the entries read from the index at `index_offset` (empty when nothing).
  // An index is trusted only as a list of distinct, non-overlapping records: one listed twice (or
  // inside another) would be read and verified again for every listing, so a small crafted file
  // could cost time quadratic in its size. Records start 8-byte aligned, at least a record header
  // apart, and before the index; each record's size is checked against the next boundary when
  // its sequence is read (record_limit), so reading a file costs at most its size.
  std::string check_entries(std::uint64_t index_offset) {
    std::sort(boundaries_.begin(), boundaries_.end());
    for (std::size_t i = 0; i < boundaries_.size(); ++i) {
      const std::uint64_t at = boundaries_[i];
      const std::uint64_t next = i + 1 < boundaries_.size() ? boundaries_[i + 1] : index_offset;
      if (at % 8 != 0) return str("its index lists a record at offset ", at, ", not 8-byte aligned");
      if (next == at) return str("its index lists the record at offset ", at, " twice");
      if (next - at < route_file::kRecordHeaderBytes)
        return str("its index lists records at offsets ", at, " and ", next,
                   ", which overlap (a record header alone is ", route_file::kRecordHeaderBytes, " bytes)");
    }
    boundaries_.push_back(index_offset);  // no record runs into the index
    return {};
  }

  // Where the record at `offset` must end at the latest: the next record (or index) the file is
  // known to hold there, else `file_end`.
  std::uint64_t record_limit(std::uint64_t offset, std::uint64_t file_end) const {
    const auto next = std::upper_bound(boundaries_.begin(), boundaries_.end(), offset);
    return next == boundaries_.end() ? file_end : std::min(*next, file_end);
  }

 private:
  std::unordered_map<SequenceId, std::vector<IndexedRecord>> by_sequence_;
  struct Listed {
    SequenceId uid;
    std::size_t at;  // in by_sequence_[uid]
  };
  std::vector<Listed> order_;  // routes records in file order
  std::vector<std::uint64_t> boundaries_;  // sorted offsets of the records (and index) known
};

}  // namespace detail
MRR_NAMESPACE_END
