#!/usr/bin/env bash
# Runs one libFuzzer target for MRR_FUZZ_SECONDS (default 20) over a scratch corpus seeded from
# the repository's corpus (which is never written to). Exit status: libFuzzer's (0 = nothing found).
#   run_fuzzer.sh <fuzzer binary> <seed corpus dir> <work dir>
set -euo pipefail
fuzzer="$1" seeds="$2" work="$3"
mkdir -p "$work/corpus" "$work/artifacts"
seconds="${MRR_FUZZ_SECONDS:-20}"
# CI replays a fixed seed (MRR_FUZZ_SEED, default 1 when CI is set) so a submission's result is
# reproducible; runs by hand draw a new seed each time to explore further.
seed="${MRR_FUZZ_SEED:-}"
if [ -z "$seed" ] && [ -n "${CI:-}" ]; then seed=1; fi
seed_flag=()
[ -n "$seed" ] && seed_flag=(-seed="$seed")
seed_args=()
[ -d "$seeds" ] && seed_args=("$seeds")
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:allocator_may_return_null=0}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
exec "$fuzzer" "${seed_flag[@]}" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=512 \
  -print_final_stats=1 -artifact_prefix="$work/artifacts/" "$work/corpus" "${seed_args[@]}"
