// One rank of an mpirun job fails on its own while the others are in, or about to enter, an
// exchange loop; the job must end, with a non-zero exit, within a bounded time. Run by
// run_expect_failure.cmake under `timeout`, which also checks the messages; exiting 0 or timing
// out fails the test. The scenario is the first argument:
//   dies       rank 1 calls std::_Exit mid-loop (mpirun notices the lost process)
//   returns    rank 1 returns 0 from main mid-loop (its MpiCommunicator is destroyed)
//   throws     rank 1 throws mid-loop; main catches it, reports it and returns 1 (as a trainer does)
//   finalizes  rank 1 returns mid-loop while its communicator outlives MPI_Finalize (a static):
//              only the peers' collective timeout (MRR_MPI_TIMEOUT) can end the job
//   stalls     rank 1 stops calling collectives and sleeps: the peers' timeout again
//   escapes    rank 1 throws out of MpiSession's scope, its communicator a static: the session
//              aborts the job (no timeout involved)
//   mismatch   rank 0 calls barrier() while the others call all_to_all_v
// Every rank reports the exception that ends it as "mpi_fault rank R: <what>" and exits 1.
#include <mrr/comm/mpi.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace {

void exchange(const mrr::MpiCommunicator& comm) {
  const auto P = static_cast<std::size_t>(comm.size());
  std::vector<std::size_t> counts(P, 1024);
  std::vector<float> send(P * 1024, 1.f), recv(P * 1024);
  comm.all_to_all_v(std::span<const float>(send), std::span<const std::size_t>(counts), std::span<float>(recv),
                    std::span<const std::size_t>(counts));
  std::vector<double> x(16, 1.0);
  comm.all_reduce_sum(std::span<double>(x));
}

const mrr::MpiCommunicator& outliving_communicator() {
  static const mrr::MpiCommunicator comm;  // destroyed after main returns, so after MPI_Finalize
  return comm;
}

// Returns main's exit code when rank 1 leaves the loop (it never does in `dies`).
int run(const std::string& scenario, const mrr::MpiCommunicator& comm) {
  if (scenario == "mismatch") {
    std::vector<std::size_t> counts(static_cast<std::size_t>(comm.size()), 1);
    std::vector<float> send(counts.size(), 1.f), recv(counts.size());
    if (comm.rank() == 0)
      comm.barrier();
    else
      comm.all_to_all_v(std::span<const float>(send), std::span<const std::size_t>(counts), std::span<float>(recv),
                        std::span<const std::size_t>(counts));
    return 0;  // not reached: the mismatch throws on every rank
  }
  for (int step = 0; step < 1000000; ++step) {
    if (comm.rank() == 1 && step == 50) {
      if (scenario == "dies") std::_Exit(3);
      if (scenario == "returns" || scenario == "finalizes") return 0;
      if (scenario == "throws" || scenario == "escapes") throw std::runtime_error("boom");
      if (scenario == "stalls") std::this_thread::sleep_for(std::chrono::hours(1));
    }
    exchange(comm);
  }
  return 0;  // not reached unless the failing rank went unnoticed
}

// The MPI program: the session's scope. Every scenario but `escapes` catches here, as a trainer's
// main does, and returns 1.
int program(int argc, char** argv, const std::string& scenario) {
  mrr::MpiSession session(&argc, &argv);
  if (scenario == "escapes") return run(scenario, outliving_communicator());
  int rank = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  try {
    if (scenario == "finalizes") return run(scenario, outliving_communicator());
    const mrr::MpiCommunicator comm;
    return run(scenario, comm);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mpi_fault rank %d: %s\n", rank, e.what());
    return 1;
  }
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return program(argc, argv, argc > 1 ? argv[1] : "dies");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mpi_fault: %s (after the MPI program)\n", e.what());
    return 1;
  }
}
