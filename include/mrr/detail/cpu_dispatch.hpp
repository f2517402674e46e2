// Run-time dispatch to AVX2 for host loops. A header-only library is compiled with its user's
// flags, most often x86-64's baseline (SSE2) target, while PyTorch and numpy pick AVX2 kernels at
// run time. So on x86 with GCC or Clang, and host code built without AVX2, a few hot loops are
// compiled a second time under target("avx2") and called when the CPU has it (the same
// arithmetic, so the same bits; the loops say why they qualify). MRR_NO_RUNTIME_DISPATCH turns
// this off. nvcc's host pass keeps the plain loops (MRR_AVX2_DISPATCH 0); xxHash's own AVX2
// kernels (detail/xxhash.hpp) are dispatched under nvcc too.
#pragma once

#include <mrr/detail/config.hpp>

#if !defined(MRR_NO_RUNTIME_DISPATCH) && !MRR_COMPILING_WITH_NVCC && (defined(__GNUC__) || defined(__clang__)) && \
    (defined(__x86_64__) || defined(__i386__)) && !defined(__AVX2__)
#define MRR_AVX2_DISPATCH 1
#else
#define MRR_AVX2_DISPATCH 0
#endif

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define MRR_HAVE_CPU_HAS_AVX2 1
#else
#define MRR_HAVE_CPU_HAS_AVX2 0
#endif

MRR_NAMESPACE_BEGIN
namespace detail {

#if MRR_HAVE_CPU_HAS_AVX2
// Whether this CPU runs AVX2; asked once.
inline bool cpu_has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2") != 0;
  return yes;
}
#endif

}  // namespace detail
MRR_NAMESPACE_END
