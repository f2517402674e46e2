// Gather/scatter all-to-all of rows (all_to_all_rows): every rank sends each peer a list of row
// blocks of a row-major buffer and receives each peer's rows into a list of its own blocks, so an
// expert-parallel exchange moves rows straight from where they are (the tokens, in any order) to
// where the experts read them (one matrix, expert-major), with no staging copy on either side.
// The transport copies each row once where it can: InProcessGroup and SingleProcess copy from the
// sender's buffer into the receiver's; MpiCommunicator describes the blocks as MPI datatypes
// (MPI_Ialltoallw), so MPI packs and unpacks them itself.
#pragma once

#include <mrr/comm/detail/collective_check.hpp>
#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

MRR_NAMESPACE_BEGIN

// Row blocks of a row-major buffer, by peer: peer p's blocks are [peer_begin[p], peer_begin[p + 1])
// of (first[i], rows[i]); a peer's rows are sent, or filled, in that order. Build with
// start(P), then add(...) and next_peer() per peer; contiguous neighbours merge into one block.
struct RowBlocks {
  std::vector<std::int64_t> first, rows;
  std::vector<std::size_t> peer_begin{0};

  void start(int peers) {
    first.clear(), rows.clear();
    peer_begin.assign(1, 0);
    peer_begin.reserve(static_cast<std::size_t>(peers) + 1);
  }
  void add(std::int64_t first_row, std::int64_t count) {
    if (count == 0) return;
    if (first.size() > peer_begin.back() && first.back() + rows.back() == first_row) {
      rows.back() += count;
      return;
    }
    first.push_back(first_row), rows.push_back(count);
  }
  void next_peer() { peer_begin.push_back(first.size()); }

  int peers() const { return static_cast<int>(peer_begin.size()) - 1; }
  std::int64_t peer_rows(int p) const {
    std::int64_t n = 0;
    for (auto i = peer_begin[static_cast<std::size_t>(p)]; i < peer_begin[static_cast<std::size_t>(p) + 1]; ++i)
      n += rows[i];
    return n;
  }
};

namespace detail {

// Whether `b` is well formed for a buffer of `buffer_rows` rows and `ranks` peers: blocks inside
// the buffer, and (for receive blocks) no row written twice.
inline bool row_blocks_valid(const RowBlocks& b, std::uint64_t buffer_rows, int ranks, bool receive) {
  if (b.peers() != ranks || b.first.size() != b.rows.size() || b.peer_begin.front() != 0 ||
      b.peer_begin.back() != b.first.size())
    return false;
  for (std::size_t p = 0; p < static_cast<std::size_t>(ranks); ++p)
    if (b.peer_begin[p] > b.peer_begin[p + 1]) return false;
  for (std::size_t i = 0; i < b.first.size(); ++i)
    if (b.first[i] < 0 || b.rows[i] < 0 || static_cast<std::uint64_t>(b.first[i] + b.rows[i]) > buffer_rows)
      return false;
  if (!receive) return true;
  std::vector<std::pair<std::int64_t, std::int64_t>> spans;
  spans.reserve(b.first.size());
  for (std::size_t i = 0; i < b.first.size(); ++i)
    if (b.rows[i] > 0) spans.emplace_back(b.first[i], b.rows[i]);
  std::sort(spans.begin(), spans.end());
  for (std::size_t i = 1; i < spans.size(); ++i)
    if (spans[i - 1].first + spans[i - 1].second > spans[i].first) return false;
  return true;
}

// The record of an all_to_all_rows call: a/b = send/recv buffer rows, c = elements per row, then
// the rows for every peer both ways; flags: overlapping buffers, malformed blocks.
template <class T>
void describe_all_to_all_rows(std::span<std::uint64_t> record, int ranks, const T* send, std::uint64_t send_rows,
                              const RowBlocks& send_blocks, const T* recv, std::uint64_t recv_rows,
                              const RowBlocks& recv_blocks, std::size_t row_elems) {
  const bool ok =
      row_blocks_valid(send_blocks, send_rows, ranks, false) && row_blocks_valid(recv_blocks, recv_rows, ranks, true);
  std::vector<std::size_t> sent(static_cast<std::size_t>(ranks)), received(static_cast<std::size_t>(ranks));
  for (int p = 0; ok && p < ranks; ++p) {
    sent[static_cast<std::size_t>(p)] = static_cast<std::size_t>(send_blocks.peer_rows(p));
    received[static_cast<std::size_t>(p)] = static_cast<std::size_t>(recv_blocks.peer_rows(p));
  }
  const bool overlap = buffers_overlap(std::span<const T>(send, send ? send_rows * row_elems : 0),
                                       std::span<const T>(recv, recv ? recv_rows * row_elems : 0));
  describe_collective<T>(record, CollectiveOp::all_to_all_rows, send_rows, recv_rows, sent, received,
                         (overlap ? buffers_overlap_flag : 0) | (ok ? 0 : malformed_row_blocks_flag));
  record[c_field] = row_elems;
}

// Copies the rows of src's blocks [s0, s1) into dst's blocks [d0, d1), in order (equal row totals,
// checked by the collective's record): block boundaries need not line up.
template <class T>
void copy_row_blocks(const T* src, const RowBlocks& sb, std::size_t s0, std::size_t s1, T* dst, const RowBlocks& db,
                     std::size_t d0, std::size_t d1, std::size_t row_elems) {
  std::int64_t s_done = 0, d_done = 0;  // rows already taken from the current blocks
  while (s0 < s1 && d0 < d1) {
    const std::int64_t n = std::min(sb.rows[s0] - s_done, db.rows[d0] - d_done);
    std::copy_n(src + static_cast<std::size_t>(sb.first[s0] + s_done) * row_elems,
                static_cast<std::size_t>(n) * row_elems,
                dst + static_cast<std::size_t>(db.first[d0] + d_done) * row_elems);
    s_done += n, d_done += n;
    if (s_done == sb.rows[s0]) ++s0, s_done = 0;
    if (d_done == db.rows[d0]) ++d0, d_done = 0;
  }
}

}  // namespace detail

MRR_NAMESPACE_END
