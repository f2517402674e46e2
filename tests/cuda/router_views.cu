// The device router's view checks (tests/device/router_views_body.hpp) on the CUDA system, on
// cudaMalloc buffers the test owns; the CPU router's answers come from the host side.
#include <mrr/thrust/routing.hpp>

#include "../device/router_views_body.hpp"
#include "cuda_memory.hpp"
#include "router_views_cuda.hpp"

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>
#include <vector>

namespace mrr::test {

RouterViewReport cuda_router_views(const RouterViewInputs& inputs, long (*count_allocations)()) {
  try {
    return run_router_view_checks<test::CudaMemory>(inputs, count_allocations);
  } catch (const std::exception& e) {
    RouterViewReport r;
    r.failures.push_back(std::string("threw: ") + e.what());
    return r;
  }
}

}  // namespace mrr::test
