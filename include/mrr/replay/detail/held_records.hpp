// Route records a reader keeps in memory between lookups. A record of several layers (a sequence's
// [tokens, layers, k] block, as record_sequence writes a rollout's routes) holds one layer's rows
// strided through it: a lookup of that layer reads the record's whole span, so the lookups of its
// 48 layers would read it 48 times. FileRouteStore reads such a record once, verifies it, and keeps
// its rows here layer-major (each layer's rows contiguous: strided through memory, every row was a
// cache miss); the lookups of its other layers decode from memory. No I/O here.
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/replay/detail/route_codec.hpp>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <unordered_map>
#include <utility>
#include <vector>

MRR_NAMESPACE_BEGIN
namespace detail {

class HeldRecords {
 public:
  using Bytes = std::vector<unsigned char, UninitializedAllocator<unsigned char>>;

  // What one kept record costs beyond its bytes (its map entry and order slot), so that a budget
  // also bounds the memory of many small records.
  static constexpr std::size_t kOverheadBytes = 96;

  explicit HeldRecords(std::size_t budget = 0) : budget_(budget) {}

  // The rows of the kept record at file offset `offset`, or nullptr.
  const unsigned char* find(std::uint64_t offset) const {
    const auto it = records_.find(offset);
    return it == records_.end() ? nullptr : it->second.data();
  }

  // Whether rows of `bytes` bytes can be kept at all (the whole budget could hold them).
  bool fits(std::uint64_t bytes) const { return bytes <= budget_ && budget_ - bytes >= kOverheadBytes; }

  // A buffer for a record's rows: the memory of a record let go, when there is one.
  Bytes spare() {
    if (spares_.empty()) return {};
    Bytes b = std::move(spares_.back());
    spares_.pop_back();
    return b;
  }

  // Where a record is read whole (and verified) before its rows are kept.
  Bytes& read_buffer() { return read_buffer_; }

  // Keeps `bytes` (the rows of a record read whole and verified) as the record at `offset`, letting the
  // oldest kept records go while the budget would be exceeded; returns its bytes. The caller
  // checked fits(bytes.size()).
  const unsigned char* keep(std::uint64_t offset, Bytes bytes) {
    const std::size_t cost = bytes.size() + kOverheadBytes;
    while (held_ + cost > budget_ && !order_.empty())
      let_go_oldest();
    held_ += cost;
    order_.push_back(offset);
    return records_.insert_or_assign(offset, std::move(bytes)).first->second.data();
  }

  // Lets every record go (FileRouteStore::release_cache). Their buffers are kept for the next
  // records (at most the budget: they held no more), so that a reader replaying micro-batch after
  // micro-batch allocates nothing: fresh buffers were a page fault every 4 KiB, a quarter of a pass.
  void clear() {
    for (auto& [offset, bytes] : records_)
      spares_.push_back(std::move(bytes));
    records_.clear();
    order_.clear();
    held_ = 0;
  }

  std::size_t bytes_held() const { return held_; }  // kept bytes with their overhead, <= the budget

 private:
  void let_go_oldest() {
    const auto it = records_.find(order_.front());
    order_.pop_front();
    held_ -= it->second.size() + kOverheadBytes;
    spares_.push_back(std::move(it->second));  // reused by the next record
    records_.erase(it);
  }

  std::size_t budget_;
  std::size_t held_ = 0;
  std::unordered_map<std::uint64_t, Bytes> records_;
  std::deque<std::uint64_t> order_;  // oldest first
  std::vector<Bytes> spares_;        // buffers of records let go
  Bytes read_buffer_;
};

}  // namespace detail
MRR_NAMESPACE_END
