// main() of a CUDA test executable: runs the doctest cases where a GPU is, and reports "skipped"
// (ctest SKIP_RETURN_CODE 77) where none is, as in CI. Included by exactly one .cpp per executable.
#pragma once

#include "device_routing.hpp"

#include <doctest/doctest.h>

#include <cstdio>

int main(int argc, char** argv) {
  if (mrr::test::cuda_device_count() == 0) {
    std::printf("no CUDA device: skipped\n");
    return 77;
  }
  doctest::Context context(argc, argv);
  return context.run();
}
