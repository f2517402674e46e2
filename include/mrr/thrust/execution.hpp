// mrr-requires: mrr_thrust_omp
// What a device view call runs on (DESIGN.md section 11): the caller's stream (Execution), scratch
// and Thrust's temporary storage out of the caller's workspace (Workspace, sized by the
// operation's workspace_bytes query), and errors written to a status word in caller memory
// (DeviceStatus) that the caller checks when it chooses; check_status synchronises and throws.
// Nothing here allocates: a call given its workspace runs without the system allocator.
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>

#include <thrust/execution_policy.h>
#include <thrust/memory.h>

#if THRUST_DEVICE_SYSTEM == THRUST_DEVICE_SYSTEM_CUDA
#include <cuda_runtime_api.h>
#include <thrust/system/cuda/execution_policy.h>
#elif THRUST_DEVICE_SYSTEM == THRUST_DEVICE_SYSTEM_OMP
#include <thrust/system/omp/execution_policy.h>
#endif

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <utility>

MRR_NAMESPACE_BEGIN
namespace device {

#if THRUST_DEVICE_SYSTEM == THRUST_DEVICE_SYSTEM_CUDA
using stream_t = cudaStream_t;
#else
using stream_t = void*;  // the OpenMP system has no streams: carried and ignored
#endif

// Where work runs: the caller's stream (torch.cuda.current_stream(), Megatron's, vLLM's).
struct Execution {
  stream_t stream = nullptr;
};

// Caller memory (device memory on CUDA) of at least the operation's workspace_bytes(...).
struct Workspace {
  void* data = nullptr;
  std::size_t bytes = 0;
};

// A row-major matrix in caller memory: `rows` rows of `cols` elements, `stride` elements apart.
template <class T>
struct MatrixView {
  T* data = nullptr;
  long rows = 0, cols = 0, stride = 0;
};

template <class T>
MatrixView<T> matrix_view(T* data, long rows, long cols, long stride = -1) {
  return {data, rows, cols, stride < 0 ? cols : stride};
}

// An error found on the device, in caller memory: code 0 is success; `index` says where (a slot,
// a row). Written by the kernels, read by the caller when it chooses (check_status).
struct DeviceStatus {
  std::int32_t code = 0;
  std::int64_t index = -1;
};
inline constexpr std::int32_t status_ok = 0;
inline constexpr std::int32_t status_expert_out_of_range = 1;  // index: the slot t * k + j

namespace detail {

inline constexpr std::size_t kWorkspaceAlignment = 256;

inline std::size_t align_up(std::size_t bytes) {
  return (bytes + kWorkspaceAlignment - 1) / kWorkspaceAlignment * kWorkspaceAlignment;
}

// Bytes of n T's in a workspace, aligned as WorkspaceArena::take places them.
template <class T>
std::size_t workspace_array_bytes(std::size_t n) {
  return align_up(n * sizeof(T));
}

// Carves a Workspace into typed arrays; what is left serves Thrust's temporary storage through
// temporary_allocator(). Running out is an error naming the call: the workspace was smaller than
// its workspace_bytes query.
class WorkspaceArena {
 public:
  WorkspaceArena(Workspace w, std::size_t required, const char* fn)
      : base_(static_cast<char*>(w.data)), bytes_(w.bytes), fn_(fn) {
    mrr::detail::require(w.bytes >= required, fn, "the workspace has ", w.bytes, " bytes; workspace_bytes asks for ",
                         required);
    mrr::detail::require(required == 0 || w.data != nullptr, fn, "the workspace pointer is null");
  }

  template <class T>
  T* take(std::size_t n) {
    return reinterpret_cast<T*>(carve(workspace_array_bytes<T>(n)));
  }

  // Thrust's allocator interface (thrust::cuda::par_nosync(alloc), thrust::omp::par(alloc)).
  struct TemporaryAllocator {
    using value_type = char;
    WorkspaceArena* arena;
    char* allocate(std::ptrdiff_t n) { return arena->carve(align_up(static_cast<std::size_t>(n))); }
    void deallocate(char*, std::size_t) noexcept {}  // the caller's memory: released with the call
  };
  TemporaryAllocator temporary_allocator() { return {this}; }

 private:
  char* carve(std::size_t bytes) {
    mrr::detail::require(used_ + bytes <= bytes_, fn_, "the workspace of ", bytes_,
                         " bytes is exhausted (its workspace_bytes query was not honoured)");
    char* p = base_ + used_;
    used_ += bytes;
    return p;
  }
  char* base_;
  std::size_t bytes_, used_ = 0;
  const char* fn_;
};

// Workspace an owning (Thrust-vector) call allocates for itself, uninitialised: a zero-filled
// vector would write (and on CPU threads fault in) every byte first, and the views write each
// byte they read.
template <class Policy>
class OwnedWorkspace {
 public:
  OwnedWorkspace(const Policy& policy, std::size_t bytes)
      : policy_(policy), data_(thrust::malloc<std::uint8_t>(policy, bytes)), bytes_(bytes) {}
  ~OwnedWorkspace() { thrust::free(policy_, data_); }
  OwnedWorkspace(const OwnedWorkspace&) = delete;
  OwnedWorkspace& operator=(const OwnedWorkspace&) = delete;
  Workspace get() const { return {thrust::raw_pointer_cast(data_), bytes_}; }

 private:
  Policy policy_;
  decltype(thrust::malloc<std::uint8_t>(std::declval<const Policy&>(), std::size_t{})) data_;
  std::size_t bytes_;
};

// The Thrust execution policy of a view call: the caller's stream, no synchronisation, temporary
// storage from the arena.
inline auto execution_policy(const Execution& x, WorkspaceArena::TemporaryAllocator& alloc) {
#if THRUST_DEVICE_SYSTEM == THRUST_DEVICE_SYSTEM_CUDA
  return thrust::cuda::par_nosync(alloc).on(x.stream);
#elif THRUST_DEVICE_SYSTEM == THRUST_DEVICE_SYSTEM_OMP
  (void)x;
  return thrust::omp::par(alloc);
#else
  (void)x;
  return thrust::device(alloc);
#endif
}

// Sets the status once per call (the host side writes it before any kernel runs).
inline void reset_status(DeviceStatus* status, const Execution& x) {
#if THRUST_DEVICE_SYSTEM == THRUST_DEVICE_SYSTEM_CUDA
  const DeviceStatus ok{};
  const cudaError_t err = cudaMemcpyAsync(status, &ok, sizeof ok, cudaMemcpyHostToDevice, x.stream);
  if (err != cudaSuccess) throw std::runtime_error(mrr::detail::str("mrr::device status: ", cudaGetErrorString(err)));
#else
  (void)x;
  *status = DeviceStatus{};
#endif
}

}  // namespace detail

// Waits for the stream and returns the status the kernels left (the checking convenience's half).
inline DeviceStatus read_status(const DeviceStatus* status, const Execution& x) {
#if THRUST_DEVICE_SYSTEM == THRUST_DEVICE_SYSTEM_CUDA
  DeviceStatus s;
  cudaError_t err = cudaMemcpyAsync(&s, status, sizeof s, cudaMemcpyDeviceToHost, x.stream);
  if (err == cudaSuccess) err = cudaStreamSynchronize(x.stream);
  if (err != cudaSuccess) throw std::runtime_error(mrr::detail::str("mrr::device status: ", cudaGetErrorString(err)));
  return s;
#else
  (void)x;
  return *status;
#endif
}

}  // namespace device
MRR_NAMESPACE_END
