#!/usr/bin/env bash
# Installs the Debian packages mrr's build, tests, examples and benchmarks use, skipping those
# already present. Used by scripts/test.sh and scripts/demo.sh; safe to run repeatedly.
set -euo pipefail

packages=(
  g++ cmake ninja-build pkg-config ccache
  libeigen3-dev          # CPU math (the one dependency of the core library)
  doctest-dev            # tests
  nlohmann-json3-dev     # golden vectors, JSON config
  libyaml-cpp-dev        # YAML config loading (optional header)
  libxxhash-dev          # route file checksums (header-only use)
  libcpp-httplib-dev     # reward dispatch proxy
  libbenchmark-dev       # CPU benchmarks
  python3 python3-numpy  # examples/python/read_routes.py and its test
  clang libclang-rt-dev  # libFuzzer + ASan/UBSan for the fuzz tests (ctest -L fuzz)
  libopenmpi-dev openmpi-bin  # MpiCommunicator and its multi-process tests (ctest -L mpi)
  gnuplot-nox            # the flagship demo's plot (scripts/demo.sh)
  libtorch-dev python3-torch python3-pytest libopenblas0-pthread  # torch adapters' tests (ctest -L torch)
  pybind11-dev python3-dev  # the PyTorch extension's build (torch/extension.h needs pybind11)
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

echo "mrr: installing missing packages: ${missing[*]}"
sudo_cmd=()
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then
    sudo_cmd=(sudo)
  else
    echo "mrr: need root (or sudo) to install: ${missing[*]}" >&2
    exit 1
  fi
fi
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -qq
"${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
