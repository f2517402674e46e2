// The device router's view checks (tests/device/router_views_body.hpp) on the CUDA system, on
// cudaMalloc buffers the test owns; the CPU router's answers come from the host side.
#include <mrr/thrust/routing.hpp>

#include "../device/router_views_body.hpp"
#include "router_views_cuda.hpp"

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>
#include <vector>

namespace {

void check_cuda(cudaError_t e, const char* what) {
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
    Buffer(const Buffer&) = delete;
    Buffer& operator=(const Buffer&) = delete;
    ~Buffer() { cudaFree(p); }
    U* data() { return p; }
    std::vector<U> host() const {
      std::vector<U> h(n);
      check_cuda(cudaMemcpy(h.data(), p, n * sizeof(U), cudaMemcpyDeviceToHost), "cudaMemcpy");
      return h;
    }
  };
};

}  // namespace

namespace mrr::test {

RouterViewReport cuda_router_views(const RouterViewInputs& inputs, long (*count_allocations)()) {
  try {
    return run_router_view_checks<CudaMemory>(inputs, count_allocations);
  } catch (const std::exception& e) {
    RouterViewReport r;
    r.failures.push_back(std::string("threw: ") + e.what());
    return r;
  }
}

}  // namespace mrr::test
