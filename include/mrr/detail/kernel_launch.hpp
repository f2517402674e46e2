// How mrr's hand-written CUDA kernels are launched and reach their dynamic shared memory, in one
// place, so that tests/support/lane_emulator.hpp can run the same kernels on the host (CI has no
// GPU): under MRR_LANE_EMULATION the emulator defines both macros; under nvcc they are the CUDA
// syntax. Host-only code never uses them.
//   MRR_KERNEL_LAUNCH(kernel, blocks, threads, shared_bytes, stream, args...)
//   MRR_DYNAMIC_SHARED(type, name);   // inside a kernel: `type* name`, 16-byte aligned
#pragma once

#if defined(MRR_LANE_EMULATION)
#if !defined(MRR_KERNEL_LAUNCH) || !defined(MRR_DYNAMIC_SHARED)
#error "MRR_LANE_EMULATION: include tests/support/lane_emulator.hpp before mrr's kernel headers"
#endif
#elif defined(__CUDACC__)
#define MRR_KERNEL_LAUNCH(kernel, blocks, threads, shared_bytes, stream, ...) \
  kernel<<<blocks, threads, shared_bytes, stream>>>(__VA_ARGS__)
#define MRR_DYNAMIC_SHARED(type, name) extern __shared__ __align__(16) type name[]
#endif
