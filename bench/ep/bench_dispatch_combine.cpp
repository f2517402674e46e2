// MoELayer dispatch + combine at P = the MPI world size (run with mpirun -np 2 and -np 4), for
// MpiCommunicator and InProcessGroup (P threads in rank 0's process while the other MPI ranks
// sleep): permute, count exchange, all-to-all-v of the rows, regroup per local expert, the return
// exchange and the slot-ordered combine — the gate, routing and expert math excluded (the layer's
// public dispatch/combine steps, identity experts). Baseline: a plain MPI_Alltoallv of the same
// bytes in both directions, preallocated, measured in the same run; beside it the communicator's
// own all_to_all_v of those bytes. Target: ours <= 1.5x the raw exchange.
#include <mrr/comm/in_process.hpp>
#include <mrr/comm/mpi.hpp>
#include <mrr/moe.hpp>
#include <mrr/router.hpp>

#include "harness.hpp"

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace {

using clock_type = std::chrono::steady_clock;
using Scalar = float;
using Matrix = mrr::RowMatrix<Scalar>;

// The identity map on every local expert: models mrr::Expert with no math, so a forward is gate +
// routing + dispatch + combine only.
struct IdentityExperts {
  using scalar_type = Scalar;
  struct gradients_type {};
  int hidden = 0, count = 0, first = 0;
  int num_experts() const { return count; }
  int first_expert() const { return first; }
  int hidden_size() const { return hidden; }
  int intermediate_size() const { return hidden; }
  Matrix forward(int, mrr::MatrixRef<Scalar> rows) const { return rows; }
  Matrix backward(int, mrr::MatrixRef<Scalar>, mrr::MatrixRef<Scalar> grad, gradients_type&) const { return grad; }
  gradients_type zero_gradients() const { return {}; }
};
static_assert(mrr::Expert<IdentityExperts>);

struct Shape {
  int tokens, hidden, experts, topk;
};

// Medians over a fixed number of rounds (every rank runs the same number), the cases interleaved
// within each round so load from other processes on a shared machine hits them alike; each call
// timed between barriers, as the slowest rank saw it when `reduce_over` is given.
template <class Barrier, class... F>
std::array<double, sizeof...(F)> interleaved_medians(int rounds, Barrier&& barrier, MPI_Comm reduce_over, F&&... f) {
  constexpr std::size_t n = sizeof...(F);
  std::array<std::vector<double>, n> samples;
  auto one = [&](std::size_t i, auto& g, bool keep) {
    barrier();
    const auto t0 = clock_type::now();
    g();
    double s = std::chrono::duration<double>(clock_type::now() - t0).count();
    if (reduce_over != MPI_COMM_NULL) MPI_Allreduce(MPI_IN_PLACE, &s, 1, MPI_DOUBLE, MPI_MAX, reduce_over);
    if (keep) samples[i].push_back(s);
  };
  for (int round = -1; round < rounds; ++round) {  // round -1 warms up
    std::size_t i = 0;
    (one(i++, f, round >= 0), ...);
  }
  std::array<double, n> medians{};
  for (std::size_t i = 0; i < n; ++i) {
    std::sort(samples[i].begin(), samples[i].end());
    medians[i] = samples[i][samples[i].size() / 2];
  }
  return medians;
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

// This rank's tokens: random hidden states and a random gate, so routing spreads about evenly.
Matrix rank_tokens(const Shape& s, int rank) {
  std::mt19937 rng(1234u + static_cast<unsigned>(rank));
  std::normal_distribution<Scalar> normal(0, 1);
  Matrix x(s.tokens, s.hidden);
  for (Eigen::Index i = 0; i < x.size(); ++i)
    x.data()[i] = normal(rng);
  return x;
}

Matrix gate_weight(const Shape& s) {
  std::mt19937 rng(99u);
  std::normal_distribution<Scalar> normal(0, 1);
  Matrix w(s.experts, s.hidden);
  for (Eigen::Index i = 0; i < w.size(); ++i)
    w.data()[i] = normal(rng);
  return w;
}

// What one rank's dispatch + combine moves, and the plain-exchange timing of the same counts.
struct Exchange {
  std::vector<std::size_t> send, recv;  // elements per peer, dispatch direction
  std::size_t send_total = 0, recv_total = 0;
};

template <class Layer>
Exchange exchange_of(const Layer& layer, const typename Layer::Forward& f, int P) {
  Exchange x;
  const auto Pz = static_cast<std::size_t>(P);
  const int per = layer.placement().experts_per_rank();
  const auto hidden = static_cast<std::size_t>(layer.hidden_size());
  x.send.assign(Pz, 0);
  x.recv.assign(Pz, 0);
  for (int e = 0; e < layer.num_experts(); ++e)
    x.send[static_cast<std::size_t>(layer.placement().owner(e))] +=
        static_cast<std::size_t>(f.permutation.tokens_per_expert[static_cast<std::size_t>(e)]) * hidden;
  for (std::size_t s = 0; s < Pz; ++s)
    for (int e = 0; e < per; ++e)
      x.recv[s] +=
          static_cast<std::size_t>(f.recv_rows[s * static_cast<std::size_t>(per) + static_cast<std::size_t>(e)]) *
          hidden;
  for (std::size_t p = 0; p < Pz; ++p) {
    x.send_total += x.send[p];
    x.recv_total += x.recv[p];
  }
  return x;
}

// Both directions of the exchange through a communicator, buffers preallocated.
template <class Comm>
struct CommRoundTrip {
  const Comm& comm;
  const Exchange& x;
  std::vector<Scalar> a, b;
  CommRoundTrip(const Comm& c, const Exchange& ex) : comm(c), x(ex), a(ex.send_total, 1.f), b(ex.recv_total) {}
  void operator()() {
    comm.all_to_all_v(std::span<const Scalar>(a), std::span<const std::size_t>(x.send), std::span<Scalar>(b),
                      std::span<const std::size_t>(x.recv));
    comm.all_to_all_v(std::span<const Scalar>(b), std::span<const std::size_t>(x.recv), std::span<Scalar>(a),
                      std::span<const std::size_t>(x.send));
  }
};

std::vector<int> as_int(const std::vector<std::size_t>& v) {
  return {v.begin(), v.end()};
}
std::vector<int> offsets(const std::vector<int>& counts) {
  std::vector<int> d(counts.size());
  for (std::size_t p = 1; p < counts.size(); ++p)
    d[p] = d[p - 1] + counts[p - 1];
  return d;
}

void row(const std::string& name, double bytes, double ours, double comm_raw, double mpi_raw, double limit) {
  std::printf("%-34s %9.1f %10.2fms %10.2fms %10.2fms %7.2fx %7.2fx %9.2fms\n", name.c_str(), bytes / (1 << 20),
              ours * 1e3, comm_raw * 1e3, mpi_raw * 1e3, ours / mpi_raw, ours / comm_raw, limit * 1e3);
}

}  // namespace

int main(int argc, char** argv) {
  mrr::MpiSession session(&argc, &argv);
  const mrr::MpiCommunicator world;
  const int P = world.size(), rank = world.rank();
  const int reps = argc > 1 ? std::atoi(argv[1]) : 7;
  const int tokens = argc > 2 ? std::atoi(argv[2]) : 4096;
  const int hidden = argc > 3 ? std::atoi(argv[3]) : 1024;
  const std::vector<Shape> shapes = {{tokens, hidden, 16, 2}, {tokens, hidden, 64, 8}};

  double bandwidth = 0;
  if (rank == 0) bandwidth = mrr::bench::copy_bandwidth();
  idle_until_rank0_done(rank);
  if (rank == 0) {
    std::printf(
        "\n== MoELayer dispatch + combine, P = %d, float32, %d reps (medians, slowest rank); baseline: "
        "MPI_Alltoallv both directions, interleaved  (host copy bandwidth %.1f GB/s, read+write)\n",
        P, reps, bandwidth / 1e9);
    std::printf("%-34s %9s %12s %12s %12s %8s %8s %11s\n", "case (T per rank, H, E, k)", "MiB/rank", "ours",
                "comm a2a x2", "MPI_Alltoallv", "ours/MPI", "ours/a2a", "copy limit");
  }
  auto world_barrier = [] { MPI_Barrier(MPI_COMM_WORLD); };

  for (const Shape& s : shapes) {
    const std::string name = "T=" + std::to_string(s.tokens) + " H=" + std::to_string(s.hidden) +
                             " E=" + std::to_string(s.experts) + " k=" + std::to_string(s.topk);
    const mrr::RouterConfig config = mrr::presets::megatron(s.experts, s.topk);
    const Matrix gate = gate_weight(s);
    double mpi_raw = 0, bytes = 0;
    {
      const auto placement = mrr::ExpertPlacement::contiguous(s.experts, P);
      mrr::MoELayer<mrr::TopKRouter<Scalar>, IdentityExperts, mrr::MpiCommunicator> layer(
          mrr::TopKRouter<Scalar>(config),
          IdentityExperts{s.hidden, placement.experts_per_rank(), placement.first_expert(rank)}, world);
      layer.set_gate_weight(gate);
      const Matrix x = rank_tokens(s, rank);
      auto f = layer.forward(x);
      const Exchange ex = exchange_of(layer, f, P);
      // The bytes this rank sends and receives, both directions.
      bytes = 2.0 * static_cast<double>((ex.send_total + ex.recv_total) * sizeof(Scalar));
      MPI_Allreduce(MPI_IN_PLACE, &bytes, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);

      std::vector<Scalar> a(ex.send_total, 1.f), b(ex.recv_total);
      const std::vector<int> sc = as_int(ex.send), rc = as_int(ex.recv), sd = offsets(sc), rd = offsets(rc);
      auto plain = [&] {
        MPI_Alltoallv(a.data(), sc.data(), sd.data(), MPI_FLOAT, b.data(), rc.data(), rd.data(), MPI_FLOAT,
                      MPI_COMM_WORLD);
        MPI_Alltoallv(b.data(), rc.data(), rd.data(), MPI_FLOAT, a.data(), sc.data(), sd.data(), MPI_FLOAT,
                      MPI_COMM_WORLD);
      };
      CommRoundTrip<mrr::MpiCommunicator> trip(world, ex);
      auto layer_steps = [&] {
        layer.dispatch(f);
        layer.combine(f, f.expert_inputs);  // identity experts: outputs = inputs
      };
      const auto [raw, comm_raw, ours] =
          interleaved_medians(reps, world_barrier, MPI_COMM_WORLD, plain, trip, layer_steps);
      mpi_raw = raw;
      if (rank == 0) row("MpiCommunicator " + name, bytes, ours, comm_raw, mpi_raw, bytes / bandwidth);
    }
    if (rank == 0) {
      mrr::InProcessGroup group(P);
      double ours = 0, comm_raw = 0;
      group.run([&](const mrr::InProcessComm& c) {
        const auto placement = mrr::ExpertPlacement::contiguous(s.experts, P);
        mrr::MoELayer<mrr::TopKRouter<Scalar>, IdentityExperts, mrr::InProcessComm> layer(
            mrr::TopKRouter<Scalar>(config),
            IdentityExperts{s.hidden, placement.experts_per_rank(), placement.first_expert(c.rank())}, c);
        layer.set_gate_weight(gate);
        const Matrix x = rank_tokens(s, c.rank());
        auto f = layer.forward(x);
        const Exchange ex = exchange_of(layer, f, P);
        auto barrier = [&] { c.barrier(); };
        CommRoundTrip<mrr::InProcessComm> trip(c, ex);
        auto layer_steps = [&] {
          layer.dispatch(f);
          layer.combine(f, f.expert_inputs);
        };
        const auto [raw, t] = interleaved_medians(reps, barrier, MPI_COMM_NULL, trip, layer_steps);
        if (c.rank() == 0) {
          comm_raw = raw;
          ours = t;
        }
      });
      row("InProcessGroup " + name, bytes, ours, comm_raw, mpi_raw, bytes / bandwidth);
    }
    idle_until_rank0_done(rank);
  }
  if (rank == 0)
    std::printf(
        "(MiB/rank: rows sent + received per rank, both directions; copy limit: those bytes at the host copy "
        "bandwidth; the InProcessGroup rows share rank 0's process and its cores)\n");
  return 0;
}
