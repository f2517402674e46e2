// Counts operator new calls in a test program (for "nothing is allocated once the workspace is
// given"). Replaces the global operator new: include it in exactly one translation unit.
#pragma once

#include <atomic>
#include <cstdlib>
#include <new>

// GCC pairs the inlined std::free below with the builtin operator new it assumes and warns; the
// pair here is malloc / free, which match.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif

namespace mrr::test {
inline std::atomic<long> g_allocations{0};
inline long allocations() {
  return g_allocations.load();
}
}  // namespace mrr::test

// The array forms forward here; the aligned forms are not used by the code under test.
void* operator new(std::size_t n) {
  mrr::test::g_allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n) {
  return ::operator new(n);
}
void operator delete(void* p) noexcept {
  std::free(p);
}
void operator delete(void* p, std::size_t) noexcept {
  std::free(p);
}
void operator delete[](void* p) noexcept {
  std::free(p);
}
void operator delete[](void* p, std::size_t) noexcept {
  std::free(p);
}
