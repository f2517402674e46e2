// Row-parallel loops, as Eigen does it: OpenMP when the user compiles with -fopenmp, a plain loop
// otherwise. Work is split into fixed tiles of rows whose boundaries depend only on the row index,
// never on the thread count, so every tile computes the same bits whatever the number of threads
// (vectorised tails included); reductions keep per-tile partials and sum them serially in order.
#pragma once

#include <mrr/detail/config.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

MRR_NAMESPACE_BEGIN
namespace detail {

// Threads a parallel region would use (1 without OpenMP).
inline int max_threads() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

inline std::int64_t tile_count(std::int64_t rows, std::int64_t tile) { return rows <= 0 ? 0 : (rows + tile - 1) / tile; }

// The exceptions of a parallel loop's iterations, kept per iteration so that the one rethrown on
// the calling thread is the lowest iteration's: the error a serial loop would raise.
class IterationErrors {
 public:
  explicit IterationErrors(std::int64_t n) : errors_(static_cast<std::size_t>(n)) {}
  // Runs f(); true when it threw (the exception is kept for iteration i).
  template <class F>
  bool failed(std::int64_t i, F&& f) noexcept {
    try {
      f();
      return false;
    } catch (...) {
      errors_[static_cast<std::size_t>(i)] = std::current_exception();
      return true;
    }
  }
  void rethrow_first() const {
    for (const auto& e : errors_)
      if (e) std::rethrow_exception(e);
  }

 private:
  std::vector<std::exception_ptr> errors_;
};

// Calls body(tile_index, first_row, end_row) for every tile of `tile` rows, in parallel under
// OpenMP (static schedule) when there is more than one tile and `work` (a rough count of scalar
// operations) is worth a fork. An exception thrown by a tile is rethrown on the calling thread
// after the loop: the one of the lowest tile, so the error is the one a serial loop would raise.
template <class Body>
void parallel_tiles(std::int64_t rows, std::int64_t tile, std::int64_t work, Body&& body) {
  const std::int64_t tiles = tile_count(rows, tile);
  auto run = [&](std::int64_t i) { body(i, i * tile, std::min(rows, (i + 1) * tile)); };
#ifdef _OPENMP
  if (tiles > 1 && work >= (std::int64_t{1} << 15) && omp_get_max_threads() > 1 && !omp_in_parallel()) {
    IterationErrors errors(tiles);
    bool failed = false;
#pragma omp parallel for schedule(static) reduction(|| : failed)
    for (std::int64_t i = 0; i < tiles; ++i) failed = errors.failed(i, [&] { run(i); }) || failed;
    if (failed) errors.rethrow_first();
    return;
  }
#else
  (void)work;
#endif
  for (std::int64_t i = 0; i < tiles; ++i) run(i);
}

// Calls body(i) for i in [0, n) on OpenMP threads (dynamic schedule: tasks of uneven size, such
// as one expert each) whenever more than one thread is available, even for n == 1: inside the
// region Eigen runs its products on one thread, with the blocking of a one-thread product, so a
// task's bits never depend on the thread count. Exceptions are rethrown as parallel_tiles does.
template <class Body>
void parallel_tasks(std::int64_t n, Body&& body) {
#ifdef _OPENMP
  if (n > 0 && omp_get_max_threads() > 1 && !omp_in_parallel()) {
    IterationErrors errors(n);
    bool failed = false;
#pragma omp parallel for schedule(dynamic, 1) reduction(|| : failed)
    for (std::int64_t i = 0; i < n; ++i) failed = errors.failed(i, [&] { body(i); }) || failed;
    if (failed) errors.rethrow_first();
    return;
  }
#endif
  for (std::int64_t i = 0; i < n; ++i) body(i);
}

}  // namespace detail
MRR_NAMESPACE_END
