// The single-process communicator: expert parallelism of size one. Collectives are local copies,
// so code written against the Communicator concept runs unchanged without MPI or NCCL. Arguments
// are validated by the same checks as the other communicators' (counts, sizes, root, overlap).
#pragma once

#include <mrr/comm/detail/collective_check.hpp>
#include <mrr/comm/row_blocks.hpp>
#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>

MRR_NAMESPACE_BEGIN

struct SingleProcess {
  int rank() const { return 0; }
  int size() const { return 1; }
  void barrier() const {}

  // Sum over ranks, in place: with one rank, the data is already the sum.
  template <class T>
  void all_reduce_sum(std::span<T> data) const {
    (void)data;
  }

  // Every rank's `send` (equal sizes) concatenated in rank order: here, a copy.
  template <class T>
  void all_gather(std::span<const T> send, std::span<T> recv) const {
    detail::SingleRankRecord record;
    detail::describe_all_gather<T>(record, send, recv);
    detail::check_collective("SingleProcess::all_gather", 1, record);
    std::copy(send.begin(), send.end(), recv.begin());
  }

  // Root's data on every rank: with one rank, nothing moves.
  template <class T>
  void broadcast(std::span<T> data, int root) const {
    detail::SingleRankRecord record;
    detail::describe_collective<T>(record, detail::CollectiveOp::broadcast, data.size(),
                                   static_cast<std::uint64_t>(static_cast<std::int64_t>(root)));
    detail::check_collective("SingleProcess::broadcast", 1, record);
  }

  // All-to-all with per-rank counts (elements): rank 0 sends its one block to itself.
  template <class T>
  void all_to_all_v(std::span<const T> send, std::span<const std::size_t> send_counts, std::span<T> recv,
                    std::span<const std::size_t> recv_counts) const {
    detail::SingleRankRecord record;
    detail::describe_all_to_all_v<T>(record, send, send_counts, recv, recv_counts);
    detail::check_collective("SingleProcess::all_to_all_v", 1, record);
    std::copy_n(send.begin(), send_counts[0], recv.begin());
  }

  // Gather/scatter all-to-all of rows (comm/row_blocks.hpp): rank 0's send blocks into its recv
  // blocks, one copy.
  template <class T>
  void all_to_all_rows(const T* send, std::size_t send_rows, const RowBlocks& send_blocks, T* recv,
                       std::size_t recv_rows, const RowBlocks& recv_blocks, std::size_t row_elems) const {
    detail::SingleRankRecord record;
    detail::describe_all_to_all_rows<T>(record, 1, send, send_rows, send_blocks, recv, recv_rows, recv_blocks,
                                        row_elems);
    detail::check_collective("SingleProcess::all_to_all_rows", 1, record);
    detail::copy_row_blocks(send, send_blocks, 0, send_blocks.first.size(), recv, recv_blocks, 0,
                            recv_blocks.first.size(), row_elems);
  }
};

MRR_NAMESPACE_END
