#!/usr/bin/env bash
# Builds mrr's tests with AddressSanitizer and UndefinedBehaviorSanitizer (host code) and runs every
# CPU test under them, leaks included: a developer's check, not part of CI (a full sanitized build
# takes about 40 minutes on 2 cores). Exits non-zero on any report or failure.
#   MRR_BUILD_DIR   build directory (default: build-sanitize/ in the repository)
#   MRR_SANITIZE    sanitizers (default: address,undefined)
#   CTEST_ARGS      extra ctest arguments, e.g. "-R replay"
# CUDA tests (device code: compute-sanitizer, docs/device.md) and the fuzzers (built with clang and
# sanitizers of their own under `ctest -L fuzz`) are left out.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export MRR_BUILD_DIR="${MRR_BUILD_DIR:-$root/build-sanitize}"
export MRR_BUILD_TYPE="${MRR_BUILD_TYPE:-RelWithDebInfo}"
# shellcheck source=configure.sh
source "$root/scripts/configure.sh" -DMRR_WARNINGS_AS_ERRORS=ON -DMRR_SANITIZE="${MRR_SANITIZE:-address,undefined}" \
  -DMRR_BUILD_BENCHMARKS=OFF -DMRR_BUILD_EXAMPLES=OFF
cmake --build "$build" --parallel "$jobs"
export ASAN_OPTIONS="detect_leaks=1:fast_unwind_on_malloc=0:abort_on_error=0:strict_string_checks=1:detect_stack_use_after_return=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
export LSAN_OPTIONS="suppressions=$root/tests/sanitize/lsan.supp:print_suppressions=0"
# shellcheck disable=SC2086
ctest --test-dir "$build" --output-on-failure --parallel "$jobs" --timeout 1800 -LE "^(cuda|fuzz)$" ${CTEST_ARGS:-}
