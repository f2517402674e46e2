// cudaMalloc buffers for the bodies tests/device runs on OpenMP host buffers (Mem::Buffer<U>:
// Buffer(host vector), Buffer(n), data(), host()). Included by .cu files only.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace mrr::test {

inline void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

struct CudaMemory {
  template <class U>
  struct Buffer {
    U* p = nullptr;
    std::size_t n = 0;
    explicit Buffer(std::size_t count) : n(count) { check_cuda(cudaMalloc(&p, (n ? n : 1) * sizeof(U)), "cudaMalloc"); }
    explicit Buffer(const std::vector<U>& h) : Buffer(h.size()) {
      check_cuda(cudaMemcpy(p, h.data(), n * sizeof(U), cudaMemcpyHostToDevice), "cudaMemcpy");
    }
    Buffer(Buffer&& o) noexcept : p(std::exchange(o.p, nullptr)), n(std::exchange(o.n, 0)) {}
    Buffer(const Buffer&) = delete;
    Buffer& operator=(const Buffer&) = delete;
    Buffer& operator=(Buffer&&) = delete;
    ~Buffer() { cudaFree(p); }
    U* data() { return p; }
    std::vector<U> host() const {
      std::vector<U> h(n);
      check_cuda(cudaMemcpy(h.data(), p, n * sizeof(U), cudaMemcpyDeviceToHost), "cudaMemcpy");
      return h;
    }
  };
};

}  // namespace mrr::test
