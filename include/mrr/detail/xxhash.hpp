// xxHash (libxxhash-dev), header-only (XXH_INLINE_ALL), included by every mrr header that hashes
// so the library is configured once. On x86-64 host code built without AVX2 (the baseline
// target), XXH3's AVX2 kernels are compiled beside the SSE2 ones under a target attribute (nvcc
// passes it to the host compiler), and detail::xxh3_update picks them at run time when the CPU
// has AVX2, as libxxhash's xxh_x86dispatch does. Every kernel gives the same XXH3 value; only the
// speed differs (about 2x on a record held in L2, where a first read of a route file spent a fifth
// of its time hashing).
#pragma once

#if !__has_include(<xxhash.h>)
#error "mrr needs xxHash (Debian/Ubuntu: apt-get install libxxhash-dev)"
#endif

#if defined(XXH_VERSION_NUMBER) && !defined(MRR_XXHASH_CONFIGURED)
// xxhash.h was included before, configured by someone else: use it as it is.
#define MRR_XXH3_AVX2_DISPATCH 0
#endif

#ifndef MRR_XXH3_AVX2_DISPATCH
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(__AVX2__) && !defined(XXH_VECTOR) && \
    !defined(XXH_X86DISPATCH)
#define MRR_XXH3_AVX2_DISPATCH 1
#include <immintrin.h>
#define XXH_DISPATCH_AVX2 1
#define XXH_TARGET_AVX2 __attribute__((__target__("avx2")))
// The accumulators' alignment for the widest kernel called, as libxxhash's own dispatch build
// sets it: XXH3's streaming update copies them to a stack array aligned for the compile-time
// (SSE2) kernels, 16 bytes, and the AVX2 kernel's aligned 32-byte loads faulted on it (at -O0 with
// GCC; optimised builds fold the loads into unaligned forms).
#ifndef XXH_ACC_ALIGN
#define XXH_ACC_ALIGN 64
#endif
#else
#define MRR_XXH3_AVX2_DISPATCH 0
#endif
#endif

#define MRR_XXHASH_CONFIGURED 1
#ifndef XXH_INLINE_ALL
#define XXH_INLINE_ALL
#endif
// GCC's -Warray-bounds misfires inside xxHash's inlined streaming code at -O3 (a false positive
// on its internal buffer); the pragma covers only xxhash.h's own lines.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Warray-bounds"
#pragma GCC diagnostic ignored "-Wstringop-overflow"
#endif
#include <xxhash.h>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

#include <mrr/detail/config.hpp>
#include <mrr/detail/cpu_dispatch.hpp>

#include <cstddef>

MRR_NAMESPACE_BEGIN
namespace detail {

#if MRR_XXH3_AVX2_DISPATCH
// XXH3's streaming update with the AVX2 kernels (its state's accumulators are 64-byte aligned).
XXH_TARGET_AVX2 inline void xxh3_update_avx2(XXH3_state_t* state, const void* input, std::size_t bytes) {
  (void)XXH3_update(state, static_cast<const xxh_u8*>(input), bytes, XXH3_accumulate_512_avx2, XXH3_scrambleAcc_avx2);
}
#endif

// Whether xxh3_update runs XXH3's AVX2 kernels on this machine.
inline bool xxh3_uses_avx2() {
#if MRR_XXH3_AVX2_DISPATCH
  return cpu_has_avx2();
#elif defined(__AVX2__)
  return true;
#else
  return false;
#endif
}

// XXH3_64bits_update, with the fastest kernels this CPU runs. `portable` forces the baseline ones
// (the tests compare the two).
inline void xxh3_update(XXH3_state_t* state, const void* input, std::size_t bytes, bool portable = false) {
#if MRR_XXH3_AVX2_DISPATCH
  if (!portable && cpu_has_avx2()) {
    xxh3_update_avx2(state, input, bytes);
    return;
  }
#endif
  (void)portable;
  (void)XXH3_64bits_update(state, input, bytes);
}

}  // namespace detail
MRR_NAMESPACE_END
