// mrr-requires: mrr_thrust_omp
// Memory and streams the caller owns (DESIGN.md section 11), for the Thrust backend's view API:
//   - MatrixView: pointer + rows + cols + row stride (+ column stride, which must be 1: a
//     column-strided input is an error, never a silent copy);
//   - Execution: the CUDA stream work is queued on (ignored on the OpenMP and host systems);
//   - Workspace: caller memory (torch's caching allocator, say) for whatever temporary storage an
//     operation needs, sized by the operation's workspace_bytes(...); Thrust's temporaries come
//     from it through WorkspaceAllocator, so nothing is allocated once it is given.
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>
#include <mrr/thrust/backend.hpp>

#include <thrust/execution_policy.h>
#if THRUST_DEVICE_SYSTEM == THRUST_DEVICE_SYSTEM_CUDA
#include <cuda_runtime_api.h>
#include <thrust/system/cuda/execution_policy.h>
#elif THRUST_DEVICE_SYSTEM == THRUST_DEVICE_SYSTEM_OMP
#include <thrust/system/omp/execution_policy.h>
#endif
#include <thrust/system/cpp/execution_policy.h>

#include <cstddef>
#include <cstdint>
#include <new>
#include <stdexcept>
#include <type_traits>

MRR_NAMESPACE_BEGIN
namespace device {

#if THRUST_DEVICE_SYSTEM == THRUST_DEVICE_SYSTEM_CUDA
using stream_t = cudaStream_t;
#else
using stream_t = void*;  // no streams: work runs on the calling thread's OpenMP team
#endif

// Where an operation runs: the stream (nullptr: the default stream). Device-side results are
// ready once the stream reaches them; the view functions never synchronise except the check_*
// conveniences, which must read a result on the host.
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

// Checks that `m` is a usable [rows, cols] view (rows < 0 takes its own row count).
template <class T>
void require_view(const MatrixView<T>& m, long rows, long cols, const char* fn, const char* name) {
  detail::require(m.data != nullptr || m.rows == 0, fn, "'", name, "' is a null pointer");
  detail::require(m.col_stride == 1, fn, "'", name, "' has column stride ", m.col_stride,
                  ": rows must be contiguous (column stride 1); copy a column-major or strided tensor first "
                  "(torch: .contiguous())");
  detail::require(m.rows == rows && m.cols == cols, fn, "'", name, "' has shape [", m.rows, ", ", m.cols,
                  "], expected [", rows, ", ", cols, "]");
  detail::require(m.row_stride >= m.cols, fn, "'", name, "' has row stride ", m.row_stride, " for ", m.cols,
                  " columns: rows would overlap");
}

// Caller memory for temporaries, `bytes` long, suitably aligned (any cudaMalloc or torch buffer
// is). On CUDA it is device memory.
struct Workspace {
  void* data = nullptr;
  std::size_t bytes = 0;
};

// Thrust's allocator interface over a Workspace: a bump allocation that never frees (a call's
// temporaries live until it returns) and fails with a clear error when the workspace is short.
class WorkspaceAllocator {
 public:
  using value_type = char;
  static constexpr std::size_t kAlignment = 256;  // cudaMalloc's, enough for every type

  WorkspaceAllocator(Workspace ws, const char* fn) : ws_(ws), fn_(fn) {}

  char* allocate(std::ptrdiff_t n) {
    const std::size_t offset = (used_ + kAlignment - 1) / kAlignment * kAlignment;
    const auto bytes = static_cast<std::size_t>(n);
    if (ws_.data == nullptr || offset + bytes > ws_.bytes) [[unlikely]]
      detail::throw_invalid_argument(fn_, "the workspace of ", ws_.bytes, " bytes is too small: ", offset + bytes,
                                     " bytes are needed (size it with workspace_bytes(...))");
    used_ = offset + bytes;
    return static_cast<char*>(ws_.data) + offset;
  }
  void deallocate(char*, std::size_t) {}

 private:
  Workspace ws_;
  const char* fn_;
  std::size_t used_ = 0;
};

// The execution policy of a view call on Backend: Thrust's system for it, the caller's stream and
// temporaries from `alloc`. On CUDA par_nosync: algorithms that need not return a value to the
// host do not synchronise.
template <class Backend>
auto execution_policy(const Execution& exec, WorkspaceAllocator& alloc) {
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
    if (e != cudaSuccess) throw std::runtime_error(detail::str("mrr::device::copy_to_host: ", cudaGetErrorString(e)));
    return;
  }
#endif
  (void)exec;
  for (std::size_t i = 0; i < n; ++i)
    dst[i] = src[i];
}

}  // namespace device
MRR_NAMESPACE_END
