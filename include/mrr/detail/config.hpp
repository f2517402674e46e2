// Build configuration shared by every mrr header: version, namespace and host/device macros.
// This is the only header that looks at __CUDACC__; every macro can be overridden by the user.
#pragma once

#define MRR_VERSION_MAJOR 0
#define MRR_VERSION_MINOR 1
#define MRR_VERSION_PATCH 0
#define MRR_VERSION (MRR_VERSION_MAJOR * 10000 + MRR_VERSION_MINOR * 100 + MRR_VERSION_PATCH)

// mrr is C++20. Below it, stop at one sentence instead of hundreds of errors further down (the
// missing header makes GCC and Clang stop there: #error alone lets them go on). PyTorch's
// extension builder compiles C++14/17 unless told otherwise.
#if (defined(_MSVC_LANG) ? _MSVC_LANG : __cplusplus) < 202002L
#error "mrr needs C++20: compile with -std=c++20 (torch.utils.cpp_extension: extra_compile_args=['-std=c++20'])"
#include <mrr_needs_cxx20_see_the_error_above>
#endif

// ABI-versioned namespace (as fmt and CCCL do): symbols live in mrr::v0, users write mrr::.
#ifndef MRR_NAMESPACE_BEGIN
#define MRR_NAMESPACE_BEGIN \
  namespace mrr {           \
  inline namespace v0 {
#define MRR_NAMESPACE_END \
  }                       \
  }
#endif

#if defined(__CUDACC__)
#define MRR_COMPILING_WITH_NVCC 1
#else
#define MRR_COMPILING_WITH_NVCC 0
#endif

#ifndef MRR_HOST_DEVICE
#if MRR_COMPILING_WITH_NVCC
#define MRR_HOST_DEVICE __host__ __device__
#else
#define MRR_HOST_DEVICE
#endif
#endif

#ifndef MRR_DEVICE
#if MRR_COMPILING_WITH_NVCC
#define MRR_DEVICE __device__
#else
#define MRR_DEVICE
#endif
#endif

#ifndef MRR_FORCEINLINE
#if MRR_COMPILING_WITH_NVCC
#define MRR_FORCEINLINE __forceinline__
#elif defined(__GNUC__) || defined(__clang__)
#define MRR_FORCEINLINE inline __attribute__((always_inline))
#else
#define MRR_FORCEINLINE inline
#endif
#endif
