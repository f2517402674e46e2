#!/usr/bin/env bash
# The GPU checks of a session that is lent a GPU, in one short run (docs/device.md, "What ran where"):
# every CUDA test, compute-sanitizer's memcheck and racecheck on the GAE block kernel's test, PyTorch
# eager on the same card (bench/torch/pytorch_baselines_cuda.py) and bench_device_cuda twice beside it.
#
#   bench/device/gpu_check.sh BIN_DIR OUT_DIR
#
# BIN_DIR holds test_cuda_routing, test_cuda_thrust, test_cuda_router_views, test_cuda_permute_views,
# test_comm_nccl and bench_device_cuda (built anywhere with nvcc for sm_90: the machine that runs
# them needs only the driver, libcudart and libnccl). Logs go to OUT_DIR; a summary to stdout.
set -u
bin=${1:?BIN_DIR}
out=${2:?OUT_DIR}
mkdir -p "$out"
here=$(cd "$(dirname "$0")/../.." && pwd)

# libnccl / libcudart from PyTorch's wheels when the system has none.
extra=$(python3 - <<'EOF' 2>/dev/null
import importlib, os
dirs = []
for name in ("nvidia.nccl", "nvidia.cuda_runtime", "nvidia.cu13"):
    try:
        m = importlib.import_module(name)
    except ImportError:
        continue
    for p in getattr(m, "__path__", []):
        for sub in ("lib", "lib64"):
            if os.path.isdir(os.path.join(p, sub)):
                dirs.append(os.path.join(p, sub))
print(":".join(dirs))
EOF
)
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}/usr/local/cuda/lib64:/usr/local/cuda/lib${extra:+:$extra}

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
failed=0
run() {  # name, timeout, command...
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo "$name: rc $rc, $((SECONDS - start)) s: $(grep -E 'test cases|ERROR SUMMARY|RACECHECK SUMMARY' "$out/$name.log" | tail -1)"
  [ "$rc" -eq 0 ] || { failed=1; tail -25 "$out/$name.log"; }
}
for t in test_cuda_routing test_cuda_thrust test_cuda_router_views test_cuda_permute_views test_comm_nccl; do
  run "$t" 300 "$bin/$t"
done
sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
if [ -n "$sanitizer" ]; then
  for tool in memcheck racecheck; do
    run "gae_blocks_$tool" 300 "$sanitizer" --tool "$tool" --error-exitcode 1 "$bin/test_cuda_thrust" \
      "--test-case=CUDA GAE blocks*"
  done
else
  echo "compute-sanitizer: not found"
fi
run pytorch_baselines 300 python3 "$here/bench/torch/pytorch_baselines_cuda.py" --out "$out/same_card.json"
for i in 1 2; do
  run "bench_device_cuda_$i" 300 env "MRR_BASELINES=$out/same_card.json" "$bin/bench_device_cuda"
  cat "$out/bench_device_cuda_$i.log"
done
exit $failed
