// Expert parallelism across processes with MPI (OpenMPI, MPICH): MpiCommunicator models the
// Communicator concept over an MPI communicator, and MpiSession initialises MPI for programs
// that do not already. Every collective first all-gathers a small record of what each rank is
// about to do (sizes, counts, element type) and validates it identically on every rank, so bad
// arguments throw the same error everywhere instead of hanging; all_reduce_sum adds in rank
// order (MPI_Allreduce's order is unspecified), so the sum is bitwise identical on every rank.
// mrr-requires: mrr::mpi
#pragma once

#include <mrr/comm/detail/collective_check.hpp>
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

#include <climits>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
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

// A duplicate of the user's communicator: our messages never match theirs, and errors return
// codes (turned into exceptions) instead of aborting. Freed with the last copy, unless MPI has
// already been finalised.
struct MpiCommHandle {
  MPI_Comm comm = MPI_COMM_NULL;
  MpiCommHandle(const MpiCommHandle&) = delete;
  MpiCommHandle& operator=(const MpiCommHandle&) = delete;
  explicit MpiCommHandle(MPI_Comm user) {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized)
      throw CommunicatorError("mrr::MpiCommunicator: MPI is not initialised (call MPI_Init or use mrr::MpiSession)");
    mpi_check(MPI_Comm_dup(user, &comm), "MpiCommunicator", "MPI_Comm_dup");
    mpi_check(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN), "MpiCommunicator", "MPI_Comm_set_errhandler");
  }
  ~MpiCommHandle() {
    int finalized = 1;
    MPI_Finalized(&finalized);
    if (!finalized && comm != MPI_COMM_NULL) MPI_Comm_free(&comm);
  }
};

}  // namespace detail

// Initialises MPI when it is not yet initialised, and finalises it on destruction if it did.
class MpiSession {
 public:
  MpiSession() : MpiSession(nullptr, nullptr) {}
  MpiSession(int* argc, char*** argv) {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) {
      detail::mpi_check(MPI_Init(argc, argv), "MpiSession", "MPI_Init");
      owns_ = true;
    }
  }
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;
  ~MpiSession() {
    int finalized = 1;
    MPI_Finalized(&finalized);
    if (owns_ && !finalized) MPI_Finalize();
  }

 private:
  bool owns_ = false;
};

// Models Communicator over an MPI communicator (MPI_COMM_WORLD by default), which it duplicates:
// construct it on every rank of that communicator (MPI_Comm_dup is collective). Copies share the
// duplicate. Host buffers; one thread at a time per communicator, as MPI requires. Counts go
// through MPI's int API: a call moving more than INT_MAX elements per rank is an error.
class MpiCommunicator {
 public:
  explicit MpiCommunicator(MPI_Comm comm = MPI_COMM_WORLD) : handle_(std::make_shared<detail::MpiCommHandle>(comm)) {
    detail::mpi_check(MPI_Comm_rank(handle_->comm, &rank_), "MpiCommunicator", "MPI_Comm_rank");
    detail::mpi_check(MPI_Comm_size(handle_->comm, &size_), "MpiCommunicator", "MPI_Comm_size");
  }

  int rank() const { return rank_; }
  int size() const { return size_; }
  MPI_Comm native() const { return handle_->comm; }

  void barrier() const { detail::mpi_check(MPI_Barrier(native()), "MpiCommunicator::barrier", "MPI_Barrier"); }

  template <class T>
  void all_to_all_v(std::span<const T> send, std::span<const std::size_t> send_counts, std::span<T> recv,
                    std::span<const std::size_t> recv_counts) const {
    static_assert(std::is_trivially_copyable_v<T>, "communicators move trivially copyable elements only");
    constexpr const char* fn = "MpiCommunicator::all_to_all_v";
    agree<T>(fn, detail::CollectiveOp::all_to_all_v, send.size(), recv.size(), send_counts, recv_counts);
    const auto P = static_cast<std::size_t>(size_);
    std::vector<int> sc(P), sd(P), rc(P), rd(P);
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
    detail::mpi_check(
        MPI_Alltoallv(send.data(), sc.data(), sd.data(), type, recv.data(), rc.data(), rd.data(), type, native()), fn,
        "MPI_Alltoallv");
  }

  template <class T>
  void all_gather(std::span<const T> send, std::span<T> recv) const {
    static_assert(std::is_trivially_copyable_v<T>, "communicators move trivially copyable elements only");
    constexpr const char* fn = "MpiCommunicator::all_gather";
    agree<T>(fn, detail::CollectiveOp::all_gather, send.size(), recv.size());
    const int n = static_cast<int>(send.size() * scale<T>);
    const MPI_Datatype type = detail::mpi_datatype<T>();
    detail::mpi_check(MPI_Allgather(send.data(), n, type, recv.data(), n, type, native()), fn, "MPI_Allgather");
  }

  template <class T>
  void broadcast(std::span<T> data, int root) const {
    static_assert(std::is_trivially_copyable_v<T>, "communicators move trivially copyable elements only");
    constexpr const char* fn = "MpiCommunicator::broadcast";
    agree<T>(fn, detail::CollectiveOp::broadcast, data.size(),
             static_cast<std::uint64_t>(static_cast<std::int64_t>(root)));
    detail::mpi_check(
        MPI_Bcast(data.data(), static_cast<int>(data.size() * scale<T>), detail::mpi_datatype<T>(), root, native()), fn,
        "MPI_Bcast");
  }

  // Deterministic all-reduce: rank p receives chunk p of every rank's data (MPI_Alltoallv), adds
  // the P contributions in rank order, and the summed chunks are all-gathered. Each element is
  // added in the order 0..P-1 whatever the message arrival order; traffic is 2x the data, as a
  // ring all-reduce.
  template <class T>
  void all_reduce_sum(std::span<T> data) const {
    static_assert(detail::summable<T>, "all_reduce_sum needs an arithmetic element type");
    constexpr const char* fn = "MpiCommunicator::all_reduce_sum";
    agree<T>(fn, detail::CollectiveOp::all_reduce_sum, data.size());
    const auto P = static_cast<std::size_t>(size_);
    const std::size_t n = data.size();
    auto chunk_begin = [&](std::size_t p) { return p * n / P; };
    std::vector<int> counts(P), offsets(P), recv_counts(P), recv_offsets(P);
    for (std::size_t p = 0; p < P; ++p) {
      counts[p] = static_cast<int>(chunk_begin(p + 1) - chunk_begin(p));
      offsets[p] = static_cast<int>(chunk_begin(p));
    }
    const auto mine = static_cast<std::size_t>(counts[static_cast<std::size_t>(rank_)]);
    for (std::size_t p = 0; p < P; ++p) {
      recv_counts[p] = static_cast<int>(mine);
      recv_offsets[p] = static_cast<int>(p * mine);
    }
    std::vector<T> gathered(P * mine), reduced(mine);
    const MPI_Datatype type = detail::mpi_datatype<T>();
    detail::mpi_check(MPI_Alltoallv(data.data(), counts.data(), offsets.data(), type, gathered.data(),
                                    recv_counts.data(), recv_offsets.data(), type, native()),
                      fn, "MPI_Alltoallv");
    detail::sum_in_rank_order<T>([&](std::size_t p) { return gathered.data() + p * mine; }, P, std::span<T>(reduced));
    detail::mpi_check(MPI_Allgatherv(reduced.data(), static_cast<int>(mine), type, data.data(), counts.data(),
                                     offsets.data(), type, native()),
                      fn, "MPI_Allgatherv");
  }

 private:
  template <class T>
  static constexpr std::size_t scale = detail::mpi_named_type<T> ? 1 : sizeof(T);

  // All-gathers every rank's description of this call and validates the table on every rank.
  template <class T>
  void agree(const char* function, detail::CollectiveOp op, std::uint64_t a, std::uint64_t b = 0,
             std::span<const std::size_t> send_counts = {}, std::span<const std::size_t> recv_counts = {}) const {
    const std::size_t width = detail::collective_record_width(size_);
    std::vector<std::uint64_t> mine(width), table(width * static_cast<std::size_t>(size_));
    detail::describe_collective<T>(mine, op, a, b, send_counts, recv_counts);
    detail::mpi_check(MPI_Allgather(mine.data(), static_cast<int>(width), MPI_UINT64_T, table.data(),
                                    static_cast<int>(width), MPI_UINT64_T, native()),
                      function, "MPI_Allgather (argument check)");
    detail::check_collective(function, size_, table, static_cast<std::uint64_t>(INT_MAX) / scale<T>);
  }

  std::shared_ptr<detail::MpiCommHandle> handle_;
  int rank_ = 0;
  int size_ = 1;
};

MRR_NAMESPACE_END
