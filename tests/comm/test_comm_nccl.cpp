// NcclCommunicator on the visible GPUs (one rank each). Compiled wherever nvcc and NCCL are;
// exits 77 (ctest: skipped) where no GPU is.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "nccl_collectives.hpp"

#include <cstdio>

TEST_CASE("NcclCommunicator: collectives match host references; the sum is bitwise the rank-order sum") {
  MESSAGE("ranks (GPUs): " << mrr::test::nccl_device_count());
  const auto failures = mrr::test::nccl_collectives_self_test(true);
  for (const auto& failure : failures)
    FAIL_CHECK(failure);
  CHECK(failures.empty());
}

TEST_CASE("NcclCommunicator on non-blocking communicators: the same results (ncclInProgress waited for)") {
  const auto failures = mrr::test::nccl_collectives_self_test(false);
  for (const auto& failure : failures)
    FAIL_CHECK(failure);
  CHECK(failures.empty());
}

int main(int argc, char** argv) {
  if (mrr::test::nccl_device_count() == 0) {
    std::printf("no CUDA device: NcclCommunicator test skipped\n");
    return 77;
  }
  doctest::Context context(argc, argv);
  return context.run();
}
