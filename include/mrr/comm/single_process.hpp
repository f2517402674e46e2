// The single-process communicator: expert parallelism of size one. Collectives are local copies,
// so code written against the Communicator concept runs unchanged without MPI or NCCL.
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>

#include <algorithm>
#include <cstddef>
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
    detail::require(recv.size() == send.size(), "SingleProcess::all_gather", "'recv' has ", recv.size(),
                    " elements for 1 rank x ", send.size());
    std::copy(send.begin(), send.end(), recv.begin());
  }

  // Root's data on every rank: with one rank, nothing moves.
  template <class T>
  void broadcast(std::span<T> data, int root) const {
    (void)data;
    detail::require(root == 0, "SingleProcess::broadcast", "root ", root, " outside [0, 1)");
  }

  // All-to-all with per-rank counts (elements): rank 0 sends its one block to itself.
  template <class T>
  void all_to_all_v(std::span<const T> send, std::span<const std::size_t> send_counts, std::span<T> recv,
                    std::span<const std::size_t> recv_counts) const {
    constexpr const char* fn = "SingleProcess::all_to_all_v";
    detail::require(send_counts.size() == 1 && recv_counts.size() == 1, fn, "counts must have one entry per rank (1)");
    detail::require(send_counts[0] == recv_counts[0], fn, "rank 0 sends ", send_counts[0], " elements to itself but expects ",
                    recv_counts[0]);
    detail::require(send.size() >= send_counts[0] && recv.size() >= recv_counts[0], fn,
                    "buffers are smaller than their counts");
    std::copy_n(send.begin(), send_counts[0], recv.begin());
  }
};

MRR_NAMESPACE_END
