// All-to-all-v throughput of the expert-parallel communicators at P = the MPI world size (run
// with mpirun -np 2 and -np 4): MpiCommunicator::all_to_all_v and InProcessGroup (P threads in
// rank 0's process) beside a plain MPI_Alltoallv of the same bytes, measured in the same run.
// Equal blocks of `block` bytes per peer. The "bw limit" column is the time a single-threaded
// memcpy would take to read and write everything delivered (P*P blocks); threads and processes
// copy in parallel, so > 100% of it is possible.
#include <mrr/comm/in_process.hpp>
#include <mrr/comm/mpi.hpp>

#include "harness.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

namespace {

using clock_type = std::chrono::steady_clock;

// Median over a fixed number of reps (every rank must run the same number), each rep timed
// between barriers, as the slowest rank saw it.
template <class Barrier, class F>
double median_time(int reps, Barrier&& barrier, F&& f, MPI_Comm reduce_over = MPI_COMM_NULL) {
  std::vector<double> samples;
  f();  // warm-up
  for (int rep = 0; rep < reps; ++rep) {
    barrier();
    const auto t0 = clock_type::now();
    f();
    double s = std::chrono::duration<double>(clock_type::now() - t0).count();
    if (reduce_over != MPI_COMM_NULL) MPI_Allreduce(MPI_IN_PLACE, &s, 1, MPI_DOUBLE, MPI_MAX, reduce_over);
    samples.push_back(s);
  }
  std::sort(samples.begin(), samples.end());
  return samples[samples.size() / 2];
}

// Ranks other than 0 wait here without spinning while rank 0 works alone.
void idle_until_rank0_done(int rank) {
  MPI_Request request;
  MPI_Ibarrier(MPI_COMM_WORLD, &request);
  if (rank == 0) {
    MPI_Wait(&request, MPI_STATUS_IGNORE);
    return;
  }
  for (int done = 0; !done;) {
    MPI_Test(&request, &done, MPI_STATUS_IGNORE);
    if (!done) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

std::string size_name(std::size_t bytes) {
  return bytes >= (1u << 20) ? std::to_string(bytes >> 20) + " MiB" : std::to_string(bytes >> 10) + " KiB";
}

}  // namespace

int main(int argc, char** argv) {
  mrr::MpiSession session(&argc, &argv);
  const mrr::MpiCommunicator comm;
  const int P = comm.size(), rank = comm.rank();
  const auto Pz = static_cast<std::size_t>(P);

  double bandwidth = 0;
  if (rank == 0) bandwidth = mrr::bench::copy_bandwidth();
  idle_until_rank0_done(rank);
  if (rank == 0) {
    mrr::bench::print_table_header(
        ("all_to_all_v, P = " + std::to_string(P) + ", float, equal blocks per peer; baseline: MPI_Alltoallv").c_str(),
        bandwidth);
  }

  for (std::size_t block : {std::size_t{4} << 10, std::size_t{64} << 10, std::size_t{1} << 20}) {
    const std::size_t n = block / sizeof(float);
    const int reps = block >= (std::size_t{1} << 20) ? 40 : 200;
    std::vector<std::size_t> counts(Pz, n);
    std::vector<int> icounts(Pz, static_cast<int>(n)), displs(Pz);
    for (std::size_t p = 0; p < Pz; ++p)
      displs[p] = static_cast<int>(p * n);
    std::vector<float> send(Pz * n, 1.f), recv(Pz * n);

    auto world_barrier = [] { MPI_Barrier(MPI_COMM_WORLD); };
    const double raw = median_time(
        reps, world_barrier,
        [&] {
          MPI_Alltoallv(send.data(), icounts.data(), displs.data(), MPI_FLOAT, recv.data(), icounts.data(),
                        displs.data(), MPI_FLOAT, MPI_COMM_WORLD);
        },
        MPI_COMM_WORLD);
    const double ours = median_time(
        reps, world_barrier,
        [&] {
          comm.all_to_all_v(std::span<const float>(send), std::span<const std::size_t>(counts), std::span<float>(recv),
                            std::span<const std::size_t>(counts));
        },
        MPI_COMM_WORLD);
    const double delivered = 2.0 * static_cast<double>(Pz * Pz * block);  // read + write of every block
    if (rank == 0) {
      mrr::bench::print_row("MpiCommunicator " + size_name(block) + "/peer", ours, raw, delivered, bandwidth);
      // The same exchange between P threads of this process (the other MPI ranks sleep).
      mrr::InProcessGroup group(P);
      std::vector<std::vector<float>> sends(Pz, send), recvs(Pz, recv);
      double in_process = 0;
      group.run([&](const mrr::InProcessComm& c) {
        const auto r = static_cast<std::size_t>(c.rank());
        const double t = median_time(
            reps, [&] { c.barrier(); },
            [&] {
              c.all_to_all_v(std::span<const float>(sends[r]), std::span<const std::size_t>(counts),
                             std::span<float>(recvs[r]), std::span<const std::size_t>(counts));
            });
        if (r == 0) in_process = t;
      });
      mrr::bench::print_row("InProcessGroup " + size_name(block) + "/peer", in_process, raw, delivered, bandwidth);
    }
    idle_until_rank0_done(rank);
  }
  if (rank == 0) std::printf("(speedup = MPI_Alltoallv time / ours; medians, each rep timed between barriers)\n");
  return 0;
}
