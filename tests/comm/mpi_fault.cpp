// A rank process that dies inside a collective loop (rank 1 calls std::_Exit mid-exchange): the
// mpirun job must end, with a non-zero exit, within a bounded time. Run by run_expect_failure.cmake
// under `timeout`; exiting 0 or timing out fails the test.
#include <mrr/comm/mpi.hpp>

#include <cstdlib>
#include <span>
#include <vector>

int main(int argc, char** argv) {
  mrr::MpiSession session(&argc, &argv);
  const mrr::MpiCommunicator comm;
  const auto P = static_cast<std::size_t>(comm.size());
  std::vector<std::size_t> counts(P, 1024);
  std::vector<float> send(P * 1024, 1.f), recv(P * 1024);
  for (int step = 0; step < 1000000; ++step) {
    if (comm.rank() == 1 && step == 50) std::_Exit(3);  // dies between two exchanges of a loop
    comm.all_to_all_v(std::span<const float>(send), std::span<const std::size_t>(counts), std::span<float>(recv),
                      std::span<const std::size_t>(counts));
    std::vector<double> x(16, 1.0);
    comm.all_reduce_sum(std::span<double>(x));
  }
  return 0;  // not reached unless the dead rank went unnoticed
}
