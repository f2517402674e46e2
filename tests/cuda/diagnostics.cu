// mrr/thrust/diagnostics.hpp on the CUDA system: the OpenMP test's body
// (tests/device/diagnostics_body.hpp) on cudaMalloc buffers (CUB's radix sort of the |d|).
#include "../device/diagnostics_body.hpp"
#include "cuda_memory.hpp"
#include "diagnostics_cuda.hpp"

namespace mrr::test {

DiagnosticsResults cuda_diagnostics(const DiagnosticsInputs& inputs) {
  return run_device_diagnostics<CudaMemory>(inputs);
}

}  // namespace mrr::test
