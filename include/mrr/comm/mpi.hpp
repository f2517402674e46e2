// Expert parallelism across processes with MPI (OpenMPI, MPICH): MpiCommunicator models the
// Communicator concept over an MPI communicator, and MpiSession initialises MPI for programs
// that do not already. Every collective first all-gathers a small record of what each rank is
// about to do (sizes, counts, element type) and validates it identically on every rank, so bad
// arguments throw the same error everywhere instead of hanging; all_reduce_sum adds in rank
// order (MPI_Allreduce's order is unspecified), so the sum is bitwise identical on every rank.
// A rank that fails alone ends every rank within a bounded time: destroying a communicator tells
// the peers (they throw), an exception leaving MpiSession's scope aborts the job, and every MPI
// operation runs under a watchdog that aborts the job when the others do not join in time.
// mrr-requires: mrr::mpi
#pragma once

#include <mrr/comm/detail/collective_check.hpp>
#include <mrr/comm/row_blocks.hpp>
#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>

// The C API only: MPI's deprecated C++ bindings are not needed (and warn under -Wextra).
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <charconv>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <type_traits>
#include <vector>

MRR_NAMESPACE_BEGIN

namespace detail {

inline void mpi_check(int code, const char* function, const char* call) {
  if (code == MPI_SUCCESS) [[likely]]
    return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) length = 0;
  throw CommunicatorError(
      str("mrr::", function, ": ", call, " failed: ", std::string(text, static_cast<std::size_t>(length))));
}

// The MPI datatype of T; types MPI does not name travel as sizeof(T) bytes each.
template <class T>
constexpr bool mpi_named_type = std::is_arithmetic_v<T> && !std::is_same_v<T, bool> && sizeof(T) <= 8;

template <class T>
MPI_Datatype mpi_datatype() {
  if constexpr (std::is_same_v<T, float>)
    return MPI_FLOAT;
  else if constexpr (std::is_same_v<T, double>)
    return MPI_DOUBLE;
  else if constexpr (mpi_named_type<T> && std::is_integral_v<T> && std::is_signed_v<T>) {
    if constexpr (sizeof(T) == 1)
      return MPI_INT8_T;
    else if constexpr (sizeof(T) == 2)
      return MPI_INT16_T;
    else if constexpr (sizeof(T) == 4)
      return MPI_INT32_T;
    else
      return MPI_INT64_T;
  } else if constexpr (mpi_named_type<T> && std::is_integral_v<T>) {
    if constexpr (sizeof(T) == 1)
      return MPI_UINT8_T;
    else if constexpr (sizeof(T) == 2)
      return MPI_UINT16_T;
    else if constexpr (sizeof(T) == 4)
      return MPI_UINT32_T;
    else
      return MPI_UINT64_T;
  } else {
    return MPI_BYTE;
  }
}

// How long a rank waits in one MPI operation for the other ranks before it aborts the job:
// MRR_MPI_TIMEOUT (seconds, fractions allowed) when set, else 10 minutes (NCCL's default).
inline constexpr std::chrono::milliseconds mpi_default_timeout = std::chrono::minutes(10);

inline std::chrono::milliseconds mpi_timeout_from_environment() {
  const char* text = std::getenv("MRR_MPI_TIMEOUT");
  if (text == nullptr) return mpi_default_timeout;
  const std::string_view value(text);
  double seconds = 0;
  const auto [end, error] = std::from_chars(value.data(), value.data() + value.size(), seconds);
  require(error == std::errc() && end == value.data() + value.size() && seconds > 0 && seconds <= 1e9,
          "MpiCommunicator", "MRR_MPI_TIMEOUT='", value, "' is not a number of seconds in (0, 1e9]");
  return std::chrono::milliseconds(static_cast<std::int64_t>(std::ceil(seconds * 1000)));
}

// Ends every process of the job after printing `message` on this one. MPI_Abort does not return;
// std::abort covers an implementation that does.
[[noreturn]] inline void mpi_abort(MPI_Comm comm, const std::string& message) {
  std::fprintf(stderr, "%s\n", message.c_str());
  std::fflush(stderr);
  MPI_Abort(comm, 1);
  std::abort();
}

// The watchdog of every MPI operation mrr starts: polls the request until it completes. A
// request still pending after `timeout` can neither finish (a rank is missing: it failed,
// stalled, left or is in another collective) nor be cancelled (MPI cannot cancel a collective,
// and it still owns the buffers), so the job is aborted, as NCCL's watchdog does, with a message
// naming the call, the rank and the timeout.
struct MpiWatchdog {
  MPI_Comm comm = MPI_COMM_NULL;  // aborted on timeout
  int rank = 0, size = 1;
  std::chrono::milliseconds timeout = mpi_default_timeout;

  void wait(MPI_Request& request, const char* function, const char* call) const {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (int polls = 0;; ++polls) {
      int done = 0;
      mpi_check(MPI_Test(&request, &done, MPI_STATUS_IGNORE), function, call);  // drives MPI's progress
      if (done) return;
      // Spin briefly (a collective among ready ranks completes in microseconds), then give the
      // core to others: ranks oversubscribed on few cores, or a peer still computing.
      if (polls >= 1024) std::this_thread::yield();
      if (std::chrono::steady_clock::now() > deadline) [[unlikely]]
        mpi_abort(comm, str("mrr::", function, ": rank ", rank, " of ", size, " waited ",
                            static_cast<double>(timeout.count()) / 1000, " s in ", call,
                            " and not every rank joined (a rank failed, stalled, left or is in another collective); "
                            "aborting the job, as a pending MPI collective cannot be cancelled (timeout: "
                            "MRR_MPI_TIMEOUT seconds or MpiCommunicator's constructor argument)"));
    }
  }
};

// A duplicate of the user's communicator (our messages never match theirs; errors return codes,
// turned into exceptions) and what every collective on it shares: the watchdog, and whether a
// rank has left. Destroying it is collective, as MPI_Comm_free is: it posts a `leave` record in
// place of the next argument check, so a peer still calling collectives throws instead of waiting
// for a rank that will never come (the rank returned, or threw and unwound).
class MpiCommState {
 public:
  MpiCommState(const MpiCommState&) = delete;
  MpiCommState& operator=(const MpiCommState&) = delete;

  MpiCommState(MPI_Comm user, std::chrono::milliseconds timeout) {
    constexpr const char* fn = "MpiCommunicator";
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized)
      throw CommunicatorError("mrr::MpiCommunicator: MPI is not initialised (call MPI_Init or use mrr::MpiSession)");
    require(timeout.count() > 0, fn, "timeout ", timeout.count(), " ms must be positive");
    watchdog_.timeout = timeout;
    watchdog_.comm = user;
    mpi_check(MPI_Comm_rank(user, &watchdog_.rank), fn, "MPI_Comm_rank");
    mpi_check(MPI_Comm_size(user, &watchdog_.size), fn, "MPI_Comm_size");
    MPI_Request request = MPI_REQUEST_NULL;
    mpi_check(MPI_Comm_idup(user, &comm_, &request), fn, "MPI_Comm_idup");
    watchdog_.wait(request, fn, "MPI_Comm_idup");  // a rank that never constructs it cannot hang the others
    watchdog_.comm = comm_;
    mpi_check(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), fn, "MPI_Comm_set_errhandler");
  }

  ~MpiCommState() {
    int finalized = 1;
    MPI_Finalized(&finalized);
    if (finalized || comm_ == MPI_COMM_NULL || !departed_.empty()) return;  // nobody left to tell, or to free with
    try {
      std::vector<std::uint64_t> mine(collective_record_width(size()));
      describe_collective_tagged(mine, CollectiveOp::leave, 0);
      const auto table = all_gather_records("MpiCommunicator::~MpiCommunicator", mine);
      bool everyone_leaves = true;
      for (int r = 0; r < size(); ++r)
        everyone_leaves =
            everyone_leaves && table[static_cast<std::size_t>(r) * mine.size() + op_field] == mine[op_field];
      if (everyone_leaves) MPI_Comm_free(&comm_);  // else the peers in a collective throw, naming this rank
    } catch (...) {
      // An MPI error while leaving: a destructor cannot report it, and the peers' own calls fail.
    }
  }

  MPI_Comm comm() const { return comm_; }
  int rank() const { return watchdog_.rank; }
  int size() const { return watchdog_.size; }
  const MpiWatchdog& watchdog() const { return watchdog_; }

  // All-gathers one record per rank (the argument check), under the watchdog. A rank whose
  // record says it left makes this communicator unusable on every rank that saw it (all did).
  std::vector<std::uint64_t> all_gather_records(const char* function, std::span<const std::uint64_t> mine) {
    if (!departed_.empty()) throw CommunicatorError(str("mrr::", function, ": ", departed_));
    constexpr const char* call = "MPI_Iallgather (argument check)";
    const int width = static_cast<int>(mine.size());
    std::vector<std::uint64_t> table(mine.size() * static_cast<std::size_t>(size()));
    MPI_Request request = MPI_REQUEST_NULL;
    mpi_check(MPI_Iallgather(mine.data(), width, MPI_UINT64_T, table.data(), width, MPI_UINT64_T, comm_, &request),
              function, call);
    watchdog_.wait(request, function, call);
    for (int r = 0; r < size(); ++r) {
      if (r != rank() && table[static_cast<std::size_t>(r) * mine.size() + op_field] ==
                             static_cast<std::uint64_t>(CollectiveOp::leave)) {
        departed_ = str("rank ", r, " has destroyed its MpiCommunicator; this communicator can no longer be used");
        break;
      }
    }
    return table;
  }

 private:
  MPI_Comm comm_ = MPI_COMM_NULL;
  MpiWatchdog watchdog_;
  std::string departed_;  // set once a peer has left: every later collective throws this
};

}  // namespace detail

// Initialises MPI when it is not yet initialised, and finalises it on destruction if it did. An
// exception propagating out of the session's scope aborts the job instead (MPI_Abort): this rank
// is leaving with an error, and MPI_Finalize could wait forever for peers that wait for it.
class MpiSession {
 public:
  MpiSession() : MpiSession(nullptr, nullptr) {}
  MpiSession(int* argc, char*** argv) : uncaught_(std::uncaught_exceptions()) {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) {
      detail::mpi_check(MPI_Init(argc, argv), "MpiSession", "MPI_Init");
      owns_ = true;
      detail::mpi_check(MPI_Comm_dup(MPI_COMM_WORLD, &finish_), "MpiSession", "MPI_Comm_dup");
    }
  }
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;
  ~MpiSession() {
    int finalized = 1;
    MPI_Finalized(&finalized);
    if (!owns_ || finalized) return;
    if (std::uncaught_exceptions() > uncaught_) {
      int rank = -1;
      MPI_Comm_rank(MPI_COMM_WORLD, &rank);
      detail::mpi_abort(MPI_COMM_WORLD,
                        detail::str("mrr::MpiSession: rank ", rank,
                                    " is leaving the MPI program's scope by an exception; aborting "
                                    "the job rather than finalising while other ranks may wait for it"));
    }
    wait_for_every_rank();
    MPI_Comm_free(&finish_);
    MPI_Finalize();
  }

 private:
  // Every rank reaches the end of its session before any finalises. A rank that finished early
  // waits here, idle, rather than inside MPI_Finalize: if its peers are stuck in a collective
  // waiting for it, their watchdog aborts the job and this rank is ended like the others (Open
  // MPI 4.1's mpirun can crash or hang when ranks abort while another is inside MPI_Finalize).
  // No timeout here: a peer still working legitimately (a checkpoint) must not be cut short.
  void wait_for_every_rank() {
    MPI_Request request = MPI_REQUEST_NULL;
    if (MPI_Ibarrier(finish_, &request) != MPI_SUCCESS) return;
    for (int done = 0; !done;) {
      if (MPI_Test(&request, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) return;
      if (!done) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }

  bool owns_ = false;
  int uncaught_ = 0;
  MPI_Comm finish_ = MPI_COMM_NULL;  // the end-of-session barrier's own communicator
};

// Models Communicator over an MPI communicator (MPI_COMM_WORLD by default), which it duplicates:
// construct it on every rank of that communicator (duplicating is collective), and destroy it on
// every rank (so is leaving: see MpiCommState). Copies share the duplicate. Host buffers; one
// thread at a time per communicator, as MPI requires. Counts go through MPI's int API: a call
// moving more than INT_MAX elements per rank is an error. Every MPI operation runs under the
// watchdog: one that does not complete within `timeout` aborts the job with a message.
class MpiCommunicator {
 public:
  explicit MpiCommunicator(MPI_Comm comm = MPI_COMM_WORLD,
                           std::chrono::milliseconds timeout = detail::mpi_timeout_from_environment())
      : state_(std::make_shared<detail::MpiCommState>(comm, timeout)), rank_(state_->rank()), size_(state_->size()) {}

  int rank() const { return rank_; }
  int size() const { return size_; }
  MPI_Comm native() const { return state_->comm(); }
  std::chrono::milliseconds timeout() const { return state_->watchdog().timeout; }

  // The argument check's all-gather is the barrier: no rank completes it before every rank has
  // entered it, and a rank in another collective is an error on every rank.
  void barrier() const {
    auto mine = blank_record();
    detail::describe_collective_tagged(mine, detail::CollectiveOp::barrier, 0);
    agree("MpiCommunicator::barrier", mine, INT_MAX);
  }

  template <class T>
  void all_to_all_v(std::span<const T> send, std::span<const std::size_t> send_counts, std::span<T> recv,
                    std::span<const std::size_t> recv_counts) const {
    static_assert(std::is_trivially_copyable_v<T>, "communicators move trivially copyable elements only");
    constexpr const char* fn = "MpiCommunicator::all_to_all_v";
    auto mine = blank_record();
    detail::describe_all_to_all_v<T>(mine, send, send_counts, recv, recv_counts);
    // Allocated before the agreement: a rank that fails after it would leave the others inside
    // the exchange (its communicator's leave record then meets their MPI_Ialltoallv).
    const auto P = static_cast<std::size_t>(size_);
    std::vector<int> sc(P), sd(P), rc(P), rd(P);
    agree(fn, mine, count_limit<T>);
    std::size_t s = 0, r = 0;
    for (std::size_t p = 0; p < P; ++p) {  // agree() checked every count and total against INT_MAX
      sc[p] = static_cast<int>(send_counts[p] * scale<T>);
      sd[p] = static_cast<int>(s * scale<T>);
      rc[p] = static_cast<int>(recv_counts[p] * scale<T>);
      rd[p] = static_cast<int>(r * scale<T>);
      s += send_counts[p];
      r += recv_counts[p];
    }
    const MPI_Datatype type = detail::mpi_datatype<T>();
    MPI_Request request = MPI_REQUEST_NULL;
    detail::mpi_check(MPI_Ialltoallv(send.data(), sc.data(), sd.data(), type, recv.data(), rc.data(), rd.data(), type,
                                     native(), &request),
                      fn, "MPI_Ialltoallv");
    state_->watchdog().wait(request, fn, "MPI_Ialltoallv");
  }

  // Gather/scatter all-to-all of rows (comm/row_blocks.hpp): each peer's blocks become an MPI
  // datatype (hindexed rows), and one MPI_Ialltoallw moves them; MPI packs straight from the
  // send blocks and unpacks into the recv blocks, with no staging buffer of ours.
  template <class T>
  void all_to_all_rows(const T* send, std::size_t send_rows, const RowBlocks& send_blocks, T* recv,
                       std::size_t recv_rows, const RowBlocks& recv_blocks, std::size_t row_elems) const {
    static_assert(std::is_trivially_copyable_v<T>, "communicators move trivially copyable elements only");
    constexpr const char* fn = "MpiCommunicator::all_to_all_rows";
    auto mine = blank_record();
    detail::describe_all_to_all_rows<T>(mine, size_, send, send_rows, send_blocks, recv, recv_rows, recv_blocks,
                                        row_elems);
    agree(fn, mine, INT_MAX);
    // Equal on every rank (agreed above), so this throws on all of them or none.
    detail::require(row_elems * scale<T> <= static_cast<std::size_t>(INT_MAX), fn, "rows of ", row_elems,
                    " elements exceed MPI's int count");
    Datatypes types;
    MPI_Datatype row = MPI_DATATYPE_NULL;
    detail::mpi_check(MPI_Type_contiguous(static_cast<int>(row_elems * scale<T>), detail::mpi_datatype<T>(), &row), fn,
                      "MPI_Type_contiguous");
    types.owned.push_back(row);
    detail::mpi_check(MPI_Type_commit(&row), fn, "MPI_Type_commit");
    const auto P = static_cast<std::size_t>(size_);
    std::vector<int> sc(P), rc(P), zero(P, 0);
    std::vector<MPI_Datatype> st(P), rt(P);
    const auto row_bytes = static_cast<MPI_Aint>(row_elems * sizeof(T));
    auto peer_type = [&](const RowBlocks& b, std::size_t p, int& count, MPI_Datatype& type) {
      const std::size_t i0 = b.peer_begin[p], i1 = b.peer_begin[p + 1];
      std::vector<int> lengths;
      std::vector<MPI_Aint> displacements;
      for (std::size_t i = i0; i < i1; ++i) {
        if (b.rows[i] == 0) continue;
        lengths.push_back(static_cast<int>(b.rows[i]));  // <= the peer's rows, agreed <= INT_MAX
        displacements.push_back(static_cast<MPI_Aint>(b.first[i]) * row_bytes);
      }
      count = lengths.empty() ? 0 : 1;
      type = row;
      if (lengths.empty()) return;
      detail::mpi_check(
          MPI_Type_create_hindexed(static_cast<int>(lengths.size()), lengths.data(), displacements.data(), row, &type),
          fn, "MPI_Type_create_hindexed");
      types.owned.push_back(type);
      detail::mpi_check(MPI_Type_commit(&type), fn, "MPI_Type_commit");
    };
    const auto me = static_cast<std::size_t>(rank_);
    for (std::size_t p = 0; p < P; ++p) {
      if (p == me) {  // copied here, directly (MPI would pack into a temporary and unpack it)
        st[p] = rt[p] = row;
        continue;
      }
      peer_type(send_blocks, p, sc[p], st[p]);
      peer_type(recv_blocks, p, rc[p], rt[p]);
    }
    MPI_Request request = MPI_REQUEST_NULL;
    detail::mpi_check(MPI_Ialltoallw(send, sc.data(), zero.data(), st.data(), recv, rc.data(), zero.data(), rt.data(),
                                     native(), &request),
                      fn, "MPI_Ialltoallw");
    detail::copy_row_blocks(send, send_blocks, send_blocks.peer_begin[me], send_blocks.peer_begin[me + 1], recv,
                            recv_blocks, recv_blocks.peer_begin[me], recv_blocks.peer_begin[me + 1], row_elems);
    state_->watchdog().wait(request, fn, "MPI_Ialltoallw");
  }

  template <class T>
  void all_gather(std::span<const T> send, std::span<T> recv) const {
    static_assert(std::is_trivially_copyable_v<T>, "communicators move trivially copyable elements only");
    constexpr const char* fn = "MpiCommunicator::all_gather";
    auto mine = blank_record();
    detail::describe_all_gather<T>(mine, send, recv);
    agree(fn, mine, count_limit<T>);
    const int n = static_cast<int>(send.size() * scale<T>);
    const MPI_Datatype type = detail::mpi_datatype<T>();
    MPI_Request request = MPI_REQUEST_NULL;
    detail::mpi_check(MPI_Iallgather(send.data(), n, type, recv.data(), n, type, native(), &request), fn,
                      "MPI_Iallgather");
    state_->watchdog().wait(request, fn, "MPI_Iallgather");
  }

  template <class T>
  void broadcast(std::span<T> data, int root) const {
    static_assert(std::is_trivially_copyable_v<T>, "communicators move trivially copyable elements only");
    constexpr const char* fn = "MpiCommunicator::broadcast";
    auto mine = blank_record();
    detail::describe_collective<T>(mine, detail::CollectiveOp::broadcast, data.size(),
                                   static_cast<std::uint64_t>(static_cast<std::int64_t>(root)));
    agree(fn, mine, count_limit<T>);
    MPI_Request request = MPI_REQUEST_NULL;
    detail::mpi_check(MPI_Ibcast(data.data(), static_cast<int>(data.size() * scale<T>), detail::mpi_datatype<T>(),
                                 root, native(), &request),
                      fn, "MPI_Ibcast");
    state_->watchdog().wait(request, fn, "MPI_Ibcast");
  }

  // Deterministic all-reduce: rank p receives chunk p of every rank's data (MPI_Ialltoallv), adds
  // the P contributions in rank order, and the summed chunks are all-gathered. Each element is
  // added in the order 0..P-1 whatever the message arrival order; traffic is 2x the data, as a
  // ring all-reduce.
  template <class T>
  void all_reduce_sum(std::span<T> data) const {
    static_assert(detail::summable<T>, "all_reduce_sum needs an arithmetic element type");
    constexpr const char* fn = "MpiCommunicator::all_reduce_sum";
    auto mine = blank_record();
    detail::describe_collective<T>(mine, detail::CollectiveOp::all_reduce_sum, data.size());
    const auto P = static_cast<std::size_t>(size_);
    const std::size_t n = data.size();
    auto chunk_begin = [&](std::size_t p) { return p * n / P; };
    // Counts and offsets in units of the MPI datatype: bytes for a type MPI has no name for
    // (long double, __int128 travel as MPI_BYTE), scale<T> of them per element.
    std::vector<int> counts(P), offsets(P), recv_counts(P), recv_offsets(P);
    for (std::size_t p = 0; p < P; ++p) {
      counts[p] = static_cast<int>((chunk_begin(p + 1) - chunk_begin(p)) * scale<T>);
      offsets[p] = static_cast<int>(chunk_begin(p) * scale<T>);
    }
    const std::size_t own =
        chunk_begin(static_cast<std::size_t>(rank_) + 1) - chunk_begin(static_cast<std::size_t>(rank_));
    for (std::size_t p = 0; p < P; ++p) {
      recv_counts[p] = static_cast<int>(own * scale<T>);
      recv_offsets[p] = static_cast<int>(p * own * scale<T>);
    }
    // Allocated before the agreement (unless the size is one it refuses): a rank that fails
    // after it would leave the others inside the exchange (its communicator's leave record then
    // meets their MPI_Ialltoallv, which OpenMPI aborts on instead of an error on every rank).
    const bool fits = n <= count_limit<T>;
    std::vector<T> gathered(fits ? P * own : 0), reduced(fits ? own : 0);
    agree(fn, mine, count_limit<T>);
    const MPI_Datatype type = detail::mpi_datatype<T>();
    MPI_Request request = MPI_REQUEST_NULL;
    detail::mpi_check(MPI_Ialltoallv(data.data(), counts.data(), offsets.data(), type, gathered.data(),
                                     recv_counts.data(), recv_offsets.data(), type, native(), &request),
                      fn, "MPI_Ialltoallv");
    state_->watchdog().wait(request, fn, "MPI_Ialltoallv");
    detail::sum_in_rank_order<T>([&](std::size_t p) { return gathered.data() + p * own; }, P, std::span<T>(reduced));
    detail::mpi_check(MPI_Iallgatherv(reduced.data(), static_cast<int>(own * scale<T>), type, data.data(),
                                      counts.data(), offsets.data(), type, native(), &request),
                      fn, "MPI_Iallgatherv");
    state_->watchdog().wait(request, fn, "MPI_Iallgatherv");
  }

 private:
  // Datatypes a call created, freed when it returns or throws.
  struct Datatypes {
    std::vector<MPI_Datatype> owned;
    Datatypes() = default;
    Datatypes(const Datatypes&) = delete;
    Datatypes& operator=(const Datatypes&) = delete;
    ~Datatypes() {
      for (auto& t : owned)
        MPI_Type_free(&t);
    }
  };

  template <class T>
  static constexpr std::size_t scale = detail::mpi_named_type<T> ? 1 : sizeof(T);
  template <class T>
  static constexpr std::uint64_t count_limit = static_cast<std::uint64_t>(INT_MAX) / scale<T>;

  std::vector<std::uint64_t> blank_record() const {
    return std::vector<std::uint64_t>(detail::collective_record_width(size_));
  }

  // All-gathers every rank's record of this call and validates the table on every rank.
  void agree(const char* function, std::span<const std::uint64_t> mine, std::uint64_t limit) const {
    const auto table = state_->all_gather_records(function, mine);
    detail::check_collective(function, size_, table, limit);
  }

  std::shared_ptr<detail::MpiCommState> state_;
  int rank_ = 0;
  int size_ = 1;
};

MRR_NAMESPACE_END
