#!/usr/bin/env bash
# Installs what is missing, configures, builds and runs every test. Exits non-zero on any failure.
#   MRR_BUILD_DIR   build directory (default: build/ in the repository)
#   MRR_BUILD_TYPE  CMake build type (default: Release)
#   MRR_GOLDEN_DIR  golden vectors (default: tests/golden, vendored; point it at another set of cases)
#   CTEST_ARGS      extra ctest arguments, e.g. "-L golden" or "-R replay"
set -euo pipefail
# shellcheck source=configure.sh
source "$(dirname "${BASH_SOURCE[0]}")/configure.sh" -DMRR_WARNINGS_AS_ERRORS=ON
cmake --build "$build" --parallel "$jobs"
# shellcheck disable=SC2086
ctest --test-dir "$build" --output-on-failure --parallel "$jobs" --timeout 900 ${CTEST_ARGS:-}
