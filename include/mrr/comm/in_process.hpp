// Expert parallelism inside one process: N ranks on N threads, exchanging through shared memory.
// For tests, and for users without MPI. `InProcessGroup(4).run(f)` calls f(comm) on four threads,
// one per rank; an exception on any rank wakes the ranks blocked in a collective (they throw
// CommunicatorError), and run() rethrows the first failure after joining every thread.
#pragma once

#include <mrr/comm/detail/collective_check.hpp>
#include <mrr/comm/row_blocks.hpp>
#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

MRR_NAMESPACE_BEGIN

namespace detail {

// State shared by the ranks of one InProcessGroup: each rank posts its buffers and a record of
// the collective, a barrier publishes them, every rank validates the same table and copies what
// it needs straight from its peers' buffers, and a second barrier keeps those buffers alive
// until everyone has read them.
class InProcessState {
 public:
  struct Post {
    const void* send = nullptr;
    void* recv = nullptr;
    const std::size_t* send_counts = nullptr;
    const RowBlocks* send_blocks = nullptr;  // all_to_all_rows
  };

  explicit InProcessState(int size)
      : size_(size),
        posts_(static_cast<std::size_t>(size)),
        table_(static_cast<std::size_t>(size) * collective_record_width(size)) {}

  int size() const { return size_; }

  void reset() {
    std::lock_guard lock(mutex_);
    arrived_ = 0;
    failed_ = false;
    exited_rank_ = -1;
    first_failure_ = nullptr;
    failure_message_.clear();
  }

  Post& post(int rank) { return posts_[static_cast<std::size_t>(rank)]; }
  std::span<std::uint64_t> record(int rank) {
    const std::size_t width = collective_record_width(size_);
    return std::span<std::uint64_t>(table_).subspan(static_cast<std::size_t>(rank) * width, width);
  }
  std::span<const std::uint64_t> table() const { return table_; }

  // Blocks until every rank arrives. Throws CommunicatorError instead when a rank failed, or
  // returned from run() and so can never arrive.
  void arrive_and_wait() {
    std::unique_lock lock(mutex_);
    throw_if_broken();
    const std::uint64_t generation = generation_;
    if (++arrived_ == size_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return;
    }
    cv_.wait(lock, [&] { return generation_ != generation || failed_ || exited_rank_ >= 0; });
    if (generation_ != generation) return;
    throw_if_broken();
  }

  // A rank's function threw: remember the first failure and wake everyone.
  void fail(int rank, std::exception_ptr error) {
    std::lock_guard lock(mutex_);
    if (!first_failure_) {
      first_failure_ = error;
      std::string what = "an exception not derived from std::exception";
      try {
        std::rethrow_exception(error);
      } catch (const std::exception& e) {
        what = e.what();
      } catch (...) {
      }
      failure_message_ = str("rank ", rank, " failed: ", what);
    }
    failed_ = true;
    cv_.notify_all();
  }

  // A rank's function returned: a rank still waiting in a collective would wait forever.
  void exit(int rank) {
    std::lock_guard lock(mutex_);
    if (exited_rank_ < 0) exited_rank_ = rank;
    cv_.notify_all();
  }

  std::exception_ptr first_failure() const {
    std::lock_guard lock(mutex_);
    return first_failure_;
  }

 private:
  void throw_if_broken() const {
    if (failed_) throw CommunicatorError(str("mrr::InProcessComm: ", failure_message_));
    if (exited_rank_ >= 0)
      throw CommunicatorError(str("mrr::InProcessComm: rank ", exited_rank_,
                                  " returned from run() while another rank entered a collective (every rank must call "
                                  "the same collectives in the same order)"));
  }

  int size_;
  std::vector<Post> posts_;
  std::vector<std::uint64_t> table_;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  int arrived_ = 0;
  std::uint64_t generation_ = 0;
  bool failed_ = false;
  int exited_rank_ = -1;
  std::exception_ptr first_failure_;
  std::string failure_message_;
};

}  // namespace detail

// One rank's view of an InProcessGroup, handed to the function run() calls. Models Communicator.
// Collectives block until every rank of the group has entered the same one; buffers must not
// overlap one another (a rank whose send and recv buffers overlap is an error on every rank).
class InProcessComm {
 public:
  int rank() const { return rank_; }
  int size() const { return state_->size(); }

  // Checked like the other collectives: a rank in barrier() facing one in another collective is
  // an error on both, not a barrier that lets one leave while the other reads its buffers.
  void barrier() const {
    detail::describe_collective_tagged(state_->record(rank_), detail::CollectiveOp::barrier, 0);
    exchange("InProcessComm::barrier", [] {});
  }

  template <class T>
  void all_to_all_v(std::span<const T> send, std::span<const std::size_t> send_counts, std::span<T> recv,
                    std::span<const std::size_t> recv_counts) const {
    static_assert(std::is_trivially_copyable_v<T>, "communicators move trivially copyable elements only");
    auto& post = state_->post(rank_);
    post.send = send.data();
    post.recv = recv.data();
    post.send_counts = send_counts.data();
    detail::describe_all_to_all_v<T>(state_->record(rank_), send, send_counts, recv, recv_counts);
    exchange("InProcessComm::all_to_all_v", [&] {
      const auto P = static_cast<std::size_t>(size());
      const auto me = static_cast<std::size_t>(rank_);
      std::size_t at = 0;
      for (std::size_t p = 0; p < P; ++p) {
        const auto& peer = state_->post(static_cast<int>(p));
        std::size_t offset = 0;  // where the peer's block for me starts in its send buffer
        for (std::size_t q = 0; q < me; ++q)
          offset += peer.send_counts[q];
        std::copy_n(static_cast<const T*>(peer.send) + offset, recv_counts[p], recv.data() + at);
        at += recv_counts[p];
      }
    });
  }

  // Gather/scatter all-to-all of rows (comm/row_blocks.hpp): each rank copies its peers' rows
  // straight from their buffers into its blocks, one copy per row.
  template <class T>
  void all_to_all_rows(const T* send, std::size_t send_rows, const RowBlocks& send_blocks, T* recv,
                       std::size_t recv_rows, const RowBlocks& recv_blocks, std::size_t row_elems) const {
    static_assert(std::is_trivially_copyable_v<T>, "communicators move trivially copyable elements only");
    auto& post = state_->post(rank_);
    post.send = send;
    post.send_blocks = &send_blocks;
    detail::describe_all_to_all_rows<T>(state_->record(rank_), size(), send, send_rows, send_blocks, recv, recv_rows,
                                        recv_blocks, row_elems);
    exchange("InProcessComm::all_to_all_rows", [&] {
      const auto me = static_cast<std::size_t>(rank_);
      for (std::size_t p = 0; p < static_cast<std::size_t>(size()); ++p) {
        const auto& peer = state_->post(static_cast<int>(p));
        const RowBlocks& theirs = *peer.send_blocks;
        detail::copy_row_blocks(static_cast<const T*>(peer.send), theirs, theirs.peer_begin[me],
                                theirs.peer_begin[me + 1], recv, recv_blocks, recv_blocks.peer_begin[p],
                                recv_blocks.peer_begin[p + 1], row_elems);
      }
    });
  }

  template <class T>
  void all_gather(std::span<const T> send, std::span<T> recv) const {
    static_assert(std::is_trivially_copyable_v<T>, "communicators move trivially copyable elements only");
    state_->post(rank_).send = send.data();
    detail::describe_all_gather<T>(state_->record(rank_), send, recv);
    exchange("InProcessComm::all_gather", [&] {
      for (int p = 0; p < size(); ++p)
        std::copy_n(static_cast<const T*>(state_->post(p).send), send.size(),
                    recv.data() + static_cast<std::size_t>(p) * send.size());
    });
  }

  template <class T>
  void broadcast(std::span<T> data, int root) const {
    static_assert(std::is_trivially_copyable_v<T>, "communicators move trivially copyable elements only");
    state_->post(rank_).send = data.data();
    detail::describe_collective<T>(state_->record(rank_), detail::CollectiveOp::broadcast, data.size(),
                                   static_cast<std::uint64_t>(static_cast<std::int64_t>(root)));
    exchange("InProcessComm::broadcast", [&] {
      if (root != rank_) std::copy_n(static_cast<const T*>(state_->post(root).send), data.size(), data.data());
    });
  }

  // Every rank sums the posted buffers itself, in rank order, then writes its result once all
  // ranks have read: bitwise the same result everywhere.
  template <class T>
  void all_reduce_sum(std::span<T> data) const {
    static_assert(detail::summable<T>, "all_reduce_sum needs an arithmetic element type");
    state_->post(rank_).send = data.data();
    detail::describe_collective<T>(state_->record(rank_), detail::CollectiveOp::all_reduce_sum, data.size());
    std::vector<T> sum(data.size());
    exchange("InProcessComm::all_reduce_sum", [&] {
      detail::sum_in_rank_order<T>(
          [&](std::size_t p) { return static_cast<const T*>(state_->post(static_cast<int>(p)).send); },
          static_cast<std::size_t>(size()), std::span<T>(sum));
    });
    std::copy(sum.begin(), sum.end(), data.begin());
  }

 private:
  friend class InProcessGroup;
  InProcessComm(detail::InProcessState* state, int rank) : state_(state), rank_(rank) {}

  // Publish, validate (identically on every rank), move, and wait until no rank reads our
  // buffers any more. A validation error is thrown after the second barrier, so every rank
  // leaves the collective before anyone posts the next one.
  template <class Move>
  void exchange(const char* function, Move&& move) const {
    state_->arrive_and_wait();
    std::exception_ptr invalid;
    try {
      detail::check_collective(function, size(), state_->table());
    } catch (...) {
      invalid = std::current_exception();
    }
    if (!invalid) move();
    state_->arrive_and_wait();
    if (invalid) std::rethrow_exception(invalid);
  }

  detail::InProcessState* state_;
  int rank_;
};

// N ranks on threads of this process. run(f) calls f(const InProcessComm&) once per rank, rank 0
// on the calling thread, and returns when every rank has returned; it rethrows the first
// exception a rank threw (its original type). A group runs one function at a time: a second run
// while one is in progress (from another thread, or nested inside f) is an error, since the two
// would pair their ranks' collectives. The group has no stall timeout: a rank blocked outside
// the library holds its peers in run() until it returns.
class InProcessGroup {
 public:
  explicit InProcessGroup(int size) : state_(checked_size(size)) {}

  int size() const { return state_.size(); }

  template <class F>
  requires std::invocable<F&, const InProcessComm&>
  void run(F&& f) {
    detail::require(!running_.exchange(true), "InProcessGroup::run",
                    "the group is already running a function (another thread's run, or a run nested in f); "
                    "use a group per concurrent job");
    struct Done {
      std::atomic<bool>& running;
      ~Done() { running.store(false); }
    } done{running_};
    state_.reset();
    auto rank_main = [&](int rank) {
      try {
        const InProcessComm comm(&state_, rank);
        std::invoke(f, comm);
        state_.exit(rank);
      } catch (...) {
        state_.fail(rank, std::current_exception());
      }
    };
    std::vector<std::thread> threads;
    threads.reserve(static_cast<std::size_t>(size() - 1));
    try {
      for (int rank = 1; rank < size(); ++rank)
        threads.emplace_back(rank_main, rank);
    } catch (...) {
      state_.fail(0, std::current_exception());  // could not start every rank: release those started
    }
    if (static_cast<int>(threads.size()) == size() - 1) rank_main(0);
    for (auto& thread : threads)
      thread.join();
    if (auto failure = state_.first_failure()) std::rethrow_exception(failure);
  }

 private:
  static int checked_size(int size) {
    detail::require(size >= 1, "InProcessGroup", "size ", size, " must be at least 1");
    return size;
  }

  detail::InProcessState state_;
  std::atomic<bool> running_{false};
};

MRR_NAMESPACE_END
