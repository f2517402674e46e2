// mrr-requires: mrr_thrust_omp
// Memory and streams the caller owns (DESIGN.md section 11), for the Thrust backend's view API:
//   - MatrixView: pointer + rows + cols + row stride (+ column stride, which must be 1: a
//     column-strided input is an error, never a silent copy);
//   - Execution: the CUDA stream work is queued on (ignored on the OpenMP and host systems);
//   - Workspace: caller memory (torch's caching allocator, say) for whatever temporary storage an
//     operation needs, sized by the operation's workspace_bytes(...); WorkspaceArena carves it into
//     the operation's arrays and serves Thrust's temporaries, so nothing is allocated once it is
//     given;
//   - DeviceStatus: an error found on the device, in caller memory, read when the caller chooses
//     (read_status; the check_* conveniences synchronise and throw).
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>
#include <mrr/thrust/backend.hpp>

#include <thrust/execution_policy.h>
#include <thrust/memory.h>
#if THRUST_DEVICE_SYSTEM == THRUST_DEVICE_SYSTEM_CUDA
#include <cuda_runtime_api.h>
#include <thrust/system/cuda/execution_policy.h>
#elif THRUST_DEVICE_SYSTEM == THRUST_DEVICE_SYSTEM_OMP
#include <thrust/system/omp/execution_policy.h>
#endif
#include <thrust/system/cpp/execution_policy.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <new>
#include <stdexcept>
#include <type_traits>
#include <utility>

MRR_NAMESPACE_BEGIN
namespace device {

#if THRUST_DEVICE_SYSTEM == THRUST_DEVICE_SYSTEM_CUDA
using stream_t = cudaStream_t;
#else
using stream_t = void*;  // no streams: work runs on the calling thread's OpenMP team
#endif

// Where an operation runs: the caller's stream (torch.cuda.current_stream(), Megatron's, vLLM's;
// nullptr: the default stream). Device-side results are ready once the stream reaches them; the
// view functions never synchronise except the check_* conveniences, which must read a result on
// the host.
struct Execution {
  stream_t stream = nullptr;
};

// A row-major matrix in caller memory: element (r, c) at data[r * row_stride + c * col_stride].
// T is const for inputs. Rows may be padded (row_stride > cols); columns must be contiguous.
template <class T>
struct MatrixView {
  T* data = nullptr;
  long rows = 0;
  long cols = 0;
  long row_stride = 0;
  long col_stride = 1;

  MatrixView() = default;
  MatrixView(T* d, long r, long c, long rs, long cs = 1) : data(d), rows(r), cols(c), row_stride(rs), col_stride(cs) {}
  // A contiguous [rows, cols] buffer.
  MatrixView(T* d, long r, long c) : MatrixView(d, r, c, c) {}
  bool empty() const { return data == nullptr; }
};

// A [rows, cols] view with the given row stride (default: contiguous rows).
template <class T>
MatrixView<T> matrix_view(T* data, long rows, long cols, long row_stride = -1) {
  return {data, rows, cols, row_stride < 0 ? cols : row_stride};
}

// Checks that `m` is a usable [rows, cols] view.
template <class T>
void require_view(const MatrixView<T>& m, long rows, long cols, const char* fn, const char* name) {
  mrr::detail::require(m.rows >= 0 && m.cols >= 0, fn, "'", name, "' has shape [", m.rows, ", ", m.cols,
                       "]: a negative extent");
  mrr::detail::require(m.data != nullptr || m.rows * m.cols == 0, fn, "'", name, "' is a null pointer");
  mrr::detail::require(m.col_stride == 1, fn, "'", name, "' has column stride ", m.col_stride,
                       ": rows must be contiguous (column stride 1); copy a column-major or strided tensor first "
                       "(torch: .contiguous())");
  mrr::detail::require(m.rows == rows && m.cols == cols, fn, "'", name, "' has shape [", m.rows, ", ", m.cols,
                       "], expected [", rows, ", ", cols, "]");
  mrr::detail::require(m.row_stride >= m.cols, fn, "'", name, "' has row stride ", m.row_stride, " for ", m.cols,
                       " columns: rows would overlap");
}

// Refuses an output view that shares an element's bytes with an input's: the kernels read inputs
// while writing outputs, so the result would depend on the order work items run in (the thread
// count). Views whose rows interleave without touching (the column halves of one buffer) pass.
template <class Out, class In>
void require_disjoint(const MatrixView<Out>& out, const MatrixView<In>& in, const char* fn, const char* out_name,
                      const char* in_name) {
  if (out.data == nullptr || in.data == nullptr || out.rows * out.cols == 0 || in.rows * in.cols == 0) return;
  struct Bytes {
    std::intptr_t first;   // the first row's address
    std::intptr_t stride;  // between rows
    std::intptr_t length;  // of a row
    long rows;
  };
  const auto bytes = [](const auto& m) {
    constexpr auto size = static_cast<std::intptr_t>(sizeof(*m.data));
    return Bytes{reinterpret_cast<std::intptr_t>(m.data), m.row_stride * size, m.cols * size, m.rows};
  };
  const Bytes o = bytes(out), i = bytes(in);
  const auto end = [](const Bytes& b) { return b.first + (b.rows - 1) * b.stride + b.length; };
  if (end(o) <= i.first || end(i) <= o.first) return;  // apart: the common case, no row walk
  // Row r of `o` meets row j of `i` when i.first + j * i.stride < row + o.length and
  // row < i.first + j * i.stride + i.length: the integers j strictly between two bounds.
  const auto floor_div = [](std::intptr_t a, std::intptr_t b) {
    return a / b - static_cast<std::intptr_t>((a % b != 0) && ((a < 0) != (b < 0)));
  };
  bool shared = false;
  for (long r = 0; r < o.rows && !shared; ++r) {
    const std::intptr_t row = o.first + r * o.stride;
    const std::intptr_t lo = floor_div(row - i.first - i.length, i.stride) + 1;   // the smallest j
    const std::intptr_t hi = -floor_div(i.first - row - o.length, i.stride) - 1;  // the largest j
    shared = std::max<std::intptr_t>(lo, 0) <= std::min<std::intptr_t>(hi, i.rows - 1);
  }
  mrr::detail::require(!shared, fn, "'", out_name, "' shares memory with '", in_name,
                       "'; pass a separate output buffer");
}

// Caller memory for temporaries, `bytes` long, suitably aligned (any cudaMalloc or torch buffer
// is). On CUDA it is device memory.
struct Workspace {
  void* data = nullptr;
  std::size_t bytes = 0;
};

// An error found on the device, in caller memory: code 0 is success; `index` says where (a slot,
// a row). Written by the kernels, read by the caller when it chooses (read_status).
struct DeviceStatus {
  std::int32_t code = 0;
  std::int64_t index = -1;
};
inline constexpr std::int32_t status_ok = 0;
inline constexpr std::int32_t status_expert_out_of_range = 1;  // index: the slot t * k + j
inline constexpr std::int32_t status_repeated_expert = 4;      // index: the slot t * k + j of the repeat
// (Codes are unique across the device API: ppo.hpp's masks take 2 and 3, its token inputs 5 to 7.)

inline constexpr std::size_t kWorkspaceAlignment = 256;  // cudaMalloc's, enough for every type

namespace kernels {

// *slot = min(*slot, value), atomically: a kernel's "lowest bad index" whatever order the work
// items ran in (one long of workspace, where a search would take temporaries that grow with it).
MRR_HOST_DEVICE inline void atomic_lower(long* slot, long value) {
#if defined(__CUDA_ARCH__)
  static_assert(sizeof(long) == sizeof(long long));
  atomicMin(reinterpret_cast<long long*>(slot), static_cast<long long>(value));
#else
  std::atomic_ref<long> ref(*slot);
  long seen = ref.load(std::memory_order_relaxed);
  while (value < seen && !ref.compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
  }
#endif
}

// One work item: *slot = value (a "lowest bad index" slot's start, in stream order).
struct SetLong {
  long* slot;
  long value;
  MRR_HOST_DEVICE void operator()(int) const { *slot = value; }
};

}  // namespace kernels

namespace detail {

inline std::size_t align_up(std::size_t bytes) {
  return (bytes + kWorkspaceAlignment - 1) / kWorkspaceAlignment * kWorkspaceAlignment;
}

// Bytes of n T's in a workspace, aligned as WorkspaceArena::take places them.
template <class T>
std::size_t workspace_array_bytes(std::size_t n) {
  return align_up(n * sizeof(T));
}

}  // namespace detail

// A bump allocator over a Workspace: take<T>(n) carves the operation's arrays, and it is Thrust's
// allocator (value_type, allocate, deallocate) for the temporaries of algorithms run with
// execution_policy(...). Nothing is freed before the call returns; running out is an error naming
// the call (the workspace was smaller than its workspace_bytes query).
class WorkspaceArena {
 public:
  using value_type = char;

  // `required`: the operation's workspace_bytes(...), checked up front.
  WorkspaceArena(Workspace w, std::size_t required, const char* fn)
      : base_(static_cast<char*>(w.data)), bytes_(w.bytes), fn_(fn) {
    mrr::detail::require(w.bytes >= required, fn, "the workspace has ", w.bytes, " bytes; workspace_bytes asks for ",
                         required);
    mrr::detail::require(required == 0 || w.data != nullptr, fn, "the workspace pointer is null");
  }
  WorkspaceArena(Workspace w, const char* fn) : WorkspaceArena(w, 0, fn) {}

  template <class T>
  T* take(std::size_t n) {
    return reinterpret_cast<T*>(carve(detail::workspace_array_bytes<T>(n)));
  }

  char* allocate(std::ptrdiff_t n) { return carve(detail::align_up(static_cast<std::size_t>(n))); }
  void deallocate(char*, std::size_t) noexcept {}  // the caller's memory: released with the call

  // A copyable handle for policies that take their allocator by value.
  struct TemporaryAllocator {
    using value_type = char;
    WorkspaceArena* arena;
    char* allocate(std::ptrdiff_t n) { return arena->allocate(n); }
    void deallocate(char*, std::size_t) noexcept {}
  };
  TemporaryAllocator temporary_allocator() { return {this}; }

 private:
  char* carve(std::size_t bytes) {
    if (base_ == nullptr || used_ + bytes > bytes_) [[unlikely]]
      mrr::detail::throw_invalid_argument(fn_, "the workspace of ", bytes_, " bytes is too small: ", used_ + bytes,
                                          " bytes are needed (size it with workspace_bytes(...))");
    char* p = base_ + used_;
    used_ += bytes;
    return p;
  }
  char* base_;
  std::size_t bytes_, used_ = 0;
  const char* fn_;
};
using WorkspaceAllocator = WorkspaceArena;

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

// The execution policy of a view call on Backend: Thrust's system for it, the caller's stream and
// temporaries from `alloc` (a WorkspaceArena or its TemporaryAllocator). On CUDA par_nosync:
// algorithms that need not return a value to the host do not synchronise.
template <class Backend = ThrustDeviceBackend, class Alloc>
auto execution_policy(const Execution& exec, Alloc& alloc) {
  if constexpr (std::is_same_v<Backend, ThrustBackend<ThrustHostSystem>>) {
    (void)exec;
    return thrust::cpp::par(alloc);
  } else {
#if THRUST_DEVICE_SYSTEM == THRUST_DEVICE_SYSTEM_CUDA
    return thrust::cuda::par_nosync(alloc).on(exec.stream);
#elif THRUST_DEVICE_SYSTEM == THRUST_DEVICE_SYSTEM_OMP
    (void)exec;
    return thrust::omp::par(alloc);
#else
    (void)exec;
    return thrust::device(alloc);
#endif
  }
}

// Copies n values from backend memory to the host after the stream reaches them (the checking
// conveniences' read-back; never on the hot path).
template <class Backend, class U>
void copy_to_host(const Execution& exec, const U* src, std::size_t n, U* dst) {
#if THRUST_DEVICE_SYSTEM == THRUST_DEVICE_SYSTEM_CUDA
  if constexpr (Backend::is_device) {
    cudaError_t e = cudaMemcpyAsync(dst, src, n * sizeof(U), cudaMemcpyDeviceToHost, exec.stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize(exec.stream);
    if (e != cudaSuccess)
      throw std::runtime_error(mrr::detail::str("mrr::device::copy_to_host: ", cudaGetErrorString(e)));
    return;
  }
#endif
  (void)exec;
  for (std::size_t i = 0; i < n; ++i) dst[i] = src[i];
}

namespace detail {

using device::execution_policy;
using device::OwnedWorkspace;
using device::require_disjoint;
using device::require_view;
using device::WorkspaceArena;

// Sets the status once per call (the host side writes it before any kernel runs).
inline void reset_status(DeviceStatus* status, const Execution& x) {
#if THRUST_DEVICE_SYSTEM == THRUST_DEVICE_SYSTEM_CUDA
  static const DeviceStatus ok{};  // static: the asynchronous copy may read it after we return
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
