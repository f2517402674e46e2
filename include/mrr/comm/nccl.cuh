// Expert parallelism on GPUs with NCCL: NcclCommunicator models the Communicator concept over an
// ncclComm_t. Data spans point to device memory; counts stay on the host. Like the MPI
// communicator, every collective first all-gathers a small record of each rank's arguments and
// validates it identically everywhere (so a mismatch throws on every rank), and all_reduce_sum
// adds in rank order with its own kernel (ncclAllReduce's order is not fixed), so the sum is
// bitwise identical on every rank. Collectives are synchronous: on return the results are in
// place. A collective that does not finish within the timeout, or an NCCL asynchronous error,
// throws CommunicatorError; the ncclComm_t is then unusable (abort it with ncclCommAbort).
// Blocking and non-blocking communicators (ncclConfig_t::blocking = 0) both work: a call that
// returns ncclInProgress is waited for (under the same timeout) before anything depends on it.
// Buffers must be device (or managed) memory: a host buffer on any rank is an InvalidArgument on
// every rank, found in the argument check before NCCL touches it.
#pragma once

#include <mrr/comm/detail/collective_check.hpp>
#include <mrr/cuda/config.cuh>
#include <mrr/error.hpp>

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <thread>
#include <type_traits>
#include <vector>

MRR_NAMESPACE_BEGIN

namespace detail {

inline void cuda_check(cudaError_t code, const char* function, const char* call) {
  if (code != cudaSuccess) [[unlikely]]
    throw CommunicatorError(str("mrr::", function, ": ", call, " failed: ", cudaGetErrorString(code)));
}

inline void nccl_check(ncclResult_t code, ncclComm_t comm, const char* function, const char* call) {
  if (code != ncclSuccess && code != ncclInProgress) [[unlikely]]
    throw CommunicatorError(
        str("mrr::", function, ": ", call, " failed: ", ncclGetErrorString(code), " (", ncclGetLastError(comm), ")"));
}

// NCCL's datatype for T; other trivially copyable types travel as sizeof(T) bytes each.
template <class T>
constexpr bool nccl_named_type = std::is_arithmetic_v<T> && !std::is_same_v<T, bool> &&
                                 (std::is_floating_point_v<T> ? (sizeof(T) == 4 || sizeof(T) == 8)
                                                              : (sizeof(T) == 1 || sizeof(T) == 4 || sizeof(T) == 8));

template <class T>
ncclDataType_t nccl_datatype() {
  if constexpr (std::is_same_v<T, float>)
    return ncclFloat32;
  else if constexpr (std::is_same_v<T, double>)
    return ncclFloat64;
  else if constexpr (nccl_named_type<T> && std::is_signed_v<T>) {
    if constexpr (sizeof(T) == 1)
      return ncclInt8;
    else if constexpr (sizeof(T) == 4)
      return ncclInt32;
    else
      return ncclInt64;
  } else if constexpr (nccl_named_type<T>) {
    if constexpr (sizeof(T) == 1)
      return ncclUint8;
    else if constexpr (sizeof(T) == 4)
      return ncclUint32;
    else
      return ncclUint64;
  } else {
    return ncclUint8;
  }
}

// out[i] = ((rows[0][i] + rows[1][i]) + rows[2][i]) + ..., row p at gathered + p * stride.
template <class T>
__global__ void sum_rows_in_rank_order(const T* gathered, std::size_t stride, int ranks, std::size_t n, T* out) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    T sum = gathered[i];
    for (int p = 1; p < ranks; ++p)
      sum = static_cast<T>(sum + gathered[static_cast<std::size_t>(p) * stride + i]);
    out[i] = sum;
  }
}

// Device memory freed on the stream when it goes out of scope.
template <class T>
class DeviceScratch {
 public:
  DeviceScratch(std::size_t n, cudaStream_t stream, const char* function) : stream_(stream) {
    if (n)
      cuda_check(cudaMallocAsync(reinterpret_cast<void**>(&data_), n * sizeof(T), stream), function, "cudaMallocAsync");
  }
  DeviceScratch(const DeviceScratch&) = delete;
  DeviceScratch& operator=(const DeviceScratch&) = delete;
  ~DeviceScratch() {
    if (data_) cudaFreeAsync(data_, stream_);
  }
  T* get() const { return data_; }

 private:
  T* data_ = nullptr;
  cudaStream_t stream_;
};

// ncclGroupStart ... ncclGroupEnd; an exception between them still ends the group (an open group
// would swallow this thread's next NCCL calls).
class NcclGroup {
 public:
  NcclGroup(ncclComm_t comm, const char* function) : comm_(comm), function_(function) {
    nccl_check(ncclGroupStart(), comm_, function_, "ncclGroupStart");
  }
  NcclGroup(const NcclGroup&) = delete;
  NcclGroup& operator=(const NcclGroup&) = delete;
  void end() {
    open_ = false;
    nccl_check(ncclGroupEnd(), comm_, function_, "ncclGroupEnd");
  }
  ~NcclGroup() {
    if (open_) (void)ncclGroupEnd();
  }

 private:
  ncclComm_t comm_;
  const char* function_;
  bool open_ = true;
};

// Whether NCCL can read and write p: device or managed memory (null, for an empty buffer, too).
inline bool nccl_addressable(const void* p) {
  if (p == nullptr) return true;
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, p) != cudaSuccess) {
    (void)cudaGetLastError();  // an address CUDA does not know: clear the sticky-free error
    return false;
  }
  return attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged;
}

}  // namespace detail

// Models Communicator over an ncclComm_t (not owned) on one CUDA stream; call it from the thread
// that drives that rank's device. Buffers: std::span over device memory.
class NcclCommunicator {
 public:
  explicit NcclCommunicator(ncclComm_t comm, cudaStream_t stream = nullptr,
                            std::chrono::milliseconds timeout = std::chrono::minutes(10))
      : comm_(comm), stream_(stream), timeout_(timeout) {
    // Bounded so that now() + timeout cannot overflow (a huge value meant as "never" would wrap
    // into the past and time every collective out at once).
    detail::require(timeout > std::chrono::milliseconds(0) && timeout <= std::chrono::hours(24 * 365 * 10),
                    "NcclCommunicator", "the collective timeout must be in (0 ms, 10 years], got ", timeout.count(),
                    " ms");
    detail::nccl_check(ncclCommUserRank(comm_, &rank_), comm_, "NcclCommunicator", "ncclCommUserRank");
    detail::nccl_check(ncclCommCount(comm_, &size_), comm_, "NcclCommunicator", "ncclCommCount");
  }

  int rank() const { return rank_; }
  int size() const { return size_; }
  ncclComm_t native() const { return comm_; }
  cudaStream_t stream() const { return stream_; }

  // NCCL has no barrier: the argument check's all-gather is one (no rank completes it before
  // every rank has entered it), and a rank in another collective is an error on every rank.
  void barrier() const {
    auto mine = blank_record();
    detail::describe_collective_tagged(mine, detail::CollectiveOp::barrier, 0);
    agree("NcclCommunicator::barrier", mine);
  }

  template <class T>
  void all_to_all_v(std::span<const T> send, std::span<const std::size_t> send_counts, std::span<T> recv,
                    std::span<const std::size_t> recv_counts) const {
    static_assert(std::is_trivially_copyable_v<T>, "communicators move trivially copyable elements only");
    constexpr const char* fn = "NcclCommunicator::all_to_all_v";
    auto mine = blank_record();
    detail::describe_all_to_all_v<T>(mine, send, send_counts, recv, recv_counts);
    flag_host_memory(mine, send.data(), recv.data());
    agree(fn, mine);
    const ncclDataType_t type = detail::nccl_datatype<T>();
    std::size_t s = 0, r = 0;
    detail::NcclGroup group(comm_, fn);
    for (int p = 0; p < size_; ++p) {
      const std::size_t sc = send_counts[static_cast<std::size_t>(p)], rc = recv_counts[static_cast<std::size_t>(p)];
      if (sc)
        detail::nccl_check(ncclSend(send.data() + s, sc * scale<T>, type, p, comm_, stream_), comm_, fn, "ncclSend");
      if (rc)
        detail::nccl_check(ncclRecv(recv.data() + r, rc * scale<T>, type, p, comm_, stream_), comm_, fn, "ncclRecv");
      s += sc;
      r += rc;
    }
    group.end();
    wait(fn);
  }

  template <class T>
  void all_gather(std::span<const T> send, std::span<T> recv) const {
    static_assert(std::is_trivially_copyable_v<T>, "communicators move trivially copyable elements only");
    constexpr const char* fn = "NcclCommunicator::all_gather";
    auto mine = blank_record();
    detail::describe_all_gather<T>(mine, send, recv);
    flag_host_memory(mine, send.data(), recv.data());
    agree(fn, mine);
    if (send.empty()) return;
    detail::nccl_check(
        ncclAllGather(send.data(), recv.data(), send.size() * scale<T>, detail::nccl_datatype<T>(), comm_, stream_),
        comm_, fn, "ncclAllGather");
    wait(fn);
  }

  template <class T>
  void broadcast(std::span<T> data, int root) const {
    static_assert(std::is_trivially_copyable_v<T>, "communicators move trivially copyable elements only");
    constexpr const char* fn = "NcclCommunicator::broadcast";
    auto mine = blank_record();
    detail::describe_collective<T>(mine, detail::CollectiveOp::broadcast, data.size(),
                                   static_cast<std::uint64_t>(static_cast<std::int64_t>(root)));
    flag_host_memory(mine, data.data(), nullptr);
    agree(fn, mine);
    if (data.empty()) return;
    detail::nccl_check(ncclBroadcast(data.data(), data.data(), data.size() * scale<T>, detail::nccl_datatype<T>(), root,
                                     comm_, stream_),
                       comm_, fn, "ncclBroadcast");
    wait(fn);
  }

  // Rank p receives chunk p (ceil(n/P) elements) of every rank's data, adds the P contributions
  // in rank order with a kernel, and the summed chunks are all-gathered: 2x the data in traffic.
  template <class T>
  void all_reduce_sum(std::span<T> data) const {
    static_assert(detail::summable<T> && detail::nccl_named_type<T>,
                  "NcclCommunicator::all_reduce_sum needs float, double or a 1-, 4- or 8-byte integer");
    constexpr const char* fn = "NcclCommunicator::all_reduce_sum";
    const std::size_t n = data.size(), P = static_cast<std::size_t>(size_);
    const std::size_t chunk = (n + P - 1) / P;
    // Scratch first: a rank that cannot allocate it must fail in the argument check below, on
    // every rank, not after its peers have entered the exchange.
    bool allocated = true;
    std::optional<detail::DeviceScratch<T>> gathered, reduced, result;
    try {
      gathered.emplace(P * chunk, stream_, fn);
      reduced.emplace(chunk, stream_, fn);
      result.emplace(P * chunk, stream_, fn);
    } catch (const CommunicatorError&) {
      allocated = false;
      (void)cudaGetLastError();  // the failed allocation's error is reported by the check instead
    }
    auto record = blank_record();
    detail::describe_collective<T>(record, detail::CollectiveOp::all_reduce_sum, n);
    flag_host_memory(record, data.data(), nullptr);
    record[detail::flags_field] |= allocated ? 0 : detail::scratch_failed_flag;
    agree(fn, record);
    if (n == 0) return;
    auto begin = [&](std::size_t p) { return std::min(p * chunk, n); };
    auto length = [&](std::size_t p) { return begin(p + 1) - begin(p); };
    const std::size_t mine = length(static_cast<std::size_t>(rank_));
    const ncclDataType_t type = detail::nccl_datatype<T>();
    detail::NcclGroup group(comm_, fn);
    for (std::size_t p = 0; p < P; ++p) {
      const int peer = static_cast<int>(p);
      if (length(p))
        detail::nccl_check(ncclSend(data.data() + begin(p), length(p), type, peer, comm_, stream_), comm_, fn,
                           "ncclSend");
      if (mine)
        detail::nccl_check(ncclRecv(gathered->get() + p * chunk, mine, type, peer, comm_, stream_), comm_, fn,
                           "ncclRecv");
    }
    group.end();
    settle(fn);  // a non-blocking communicator: the receives are on the stream before the kernel
    if (mine) {
      const unsigned blocks = static_cast<unsigned>(std::min<std::size_t>((mine + 255) / 256, 4096));
      detail::sum_rows_in_rank_order<T>
          <<<blocks, 256, 0, stream_>>>(gathered->get(), chunk, size_, mine, reduced->get());
      detail::cuda_check(cudaGetLastError(), fn, "sum_rows_in_rank_order");
    }
    // Chunk p lands at result + p * chunk = begin(p): result[0, n) is the sum.
    detail::nccl_check(ncclAllGather(reduced->get(), result->get(), chunk, type, comm_, stream_), comm_, fn,
                       "ncclAllGather");
    settle(fn);
    detail::cuda_check(cudaMemcpyAsync(data.data(), result->get(), n * sizeof(T), cudaMemcpyDeviceToDevice, stream_),
                       fn, "cudaMemcpyAsync");
    wait(fn);
  }

 private:
  template <class T>
  static constexpr std::size_t scale = detail::nccl_named_type<T> ? 1 : sizeof(T);

  [[noreturn]] void timed_out(const char* function) const {
    throw CommunicatorError(detail::str("mrr::", function, ": not finished after ", timeout_.count(),
                                        " ms (a peer died or skipped the collective?); abort the communicator with "
                                        "ncclCommAbort"));
  }

  // The NCCL state: false while a non-blocking communicator's last call is still in progress
  // (ncclInProgress); an asynchronous error throws.
  bool nccl_ready(const char* function) const {
    ncclResult_t async = ncclSuccess;
    detail::nccl_check(ncclCommGetAsyncError(comm_, &async), comm_, function, "ncclCommGetAsyncError");
    if (async == ncclInProgress) return false;
    detail::nccl_check(async, comm_, function, "a pending NCCL operation");
    return true;
  }

  // Waits until the last NCCL call has put its work on the stream: at once for a blocking
  // communicator; a non-blocking one's ncclInProgress is polled, under the timeout.
  void settle(const char* function) const {
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    while (!nccl_ready(function)) {
      if (std::chrono::steady_clock::now() > deadline) timed_out(function);
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

  // Waits for the stream, watching NCCL's asynchronous error and the timeout, so a dead peer
  // ends in an exception instead of a hang. A non-blocking communicator's call still in progress
  // has not reached the stream yet, so an idle stream alone does not mean done.
  void wait(const char* function) const {
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    for (;;) {
      if (nccl_ready(function)) {
        const cudaError_t state = cudaStreamQuery(stream_);
        if (state == cudaSuccess) return;
        if (state != cudaErrorNotReady) detail::cuda_check(state, function, "the stream");
      }
      if (std::chrono::steady_clock::now() > deadline) timed_out(function);
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

  // Marks the record when a buffer is host memory, so the check fails on every rank.
  static void flag_host_memory(std::span<std::uint64_t> record, const void* a, const void* b) {
    if (!detail::nccl_addressable(a) || !detail::nccl_addressable(b))
      record[detail::flags_field] |= detail::host_memory_flag;
  }

  std::vector<std::uint64_t> blank_record() const {
    return std::vector<std::uint64_t>(detail::collective_record_width(size_));
  }

  // All-gathers every rank's record of this call (through the device) and validates the table on
  // every rank.
  void agree(const char* function, std::span<const std::uint64_t> mine) const {
    const std::size_t width = mine.size();
    std::vector<std::uint64_t> table(width * static_cast<std::size_t>(size_));
    detail::DeviceScratch<std::uint64_t> records(table.size(), stream_, function);
    std::uint64_t* my_record = records.get() + static_cast<std::size_t>(rank_) * width;
    detail::cuda_check(
        cudaMemcpyAsync(my_record, mine.data(), width * sizeof(std::uint64_t), cudaMemcpyHostToDevice, stream_),
        function, "cudaMemcpyAsync");
    detail::nccl_check(ncclAllGather(my_record, records.get(), width, ncclUint64, comm_, stream_), comm_, function,
                       "ncclAllGather (argument check)");
    // Wait (with the timeout) before the copy back: a copy into pageable memory blocks the host
    // until everything before it on the stream has finished, so issued first it would hang on a
    // peer that never joins instead of throwing.
    wait(function);
    detail::cuda_check(cudaMemcpyAsync(table.data(), records.get(), table.size() * sizeof(std::uint64_t),
                                       cudaMemcpyDeviceToHost, stream_),
                       function, "cudaMemcpyAsync");
    wait(function);
    detail::check_collective(function, size_, table);
  }

  ncclComm_t comm_;
  cudaStream_t stream_;
  std::chrono::milliseconds timeout_;
  int rank_ = 0;
  int size_ = 1;
};

MRR_NAMESPACE_END
