// MpiCommunicator across real processes (ctest runs this under mpirun -np 2 and -np 4): the
// shared collective checks, on MPI_COMM_WORLD and on a split communicator. Every rank runs every
// test case; only rank 0 prints, and the exit code is the worst over all ranks.
#define DOCTEST_CONFIG_IMPLEMENT
#include <mrr/comm/mpi.hpp>

#include <doctest/doctest.h>

#include "collective_checks.hpp"

#include <mpi.h>

#include <chrono>
#include <cstdlib>
#include <memory>
#include <optional>
#include <span>
#include <sstream>
#include <vector>

namespace {

using namespace mrr::test::comm;

static_assert(mrr::Communicator<mrr::MpiCommunicator>);
static_assert(mrr::RowCommunicator<mrr::MpiCommunicator, float>);

const mrr::MpiCommunicator& world() {
  static const mrr::MpiCommunicator comm(MPI_COMM_WORLD);
  return comm;
}

}  // namespace

TEST_CASE("MPI: every collective matches the reference, for each element type, repeatedly") {
  check_collectives(world());
}

TEST_CASE("MPI: mismatched counts or buffers throw on every rank, and the communicator stays usable") {
  check_mismatched_counts(world());
}

TEST_CASE("MPI: sizes, roots, collectives or element types that disagree between ranks throw on every rank") {
  check_mismatched_sizes(world());
}

TEST_CASE("MPI: barrier on one rank facing all_to_all_v on another throws on every rank") {
  check_mismatched_barrier(world());
}

TEST_CASE("MPI: overlapping send and recv buffers are refused on every rank") {
  check_overlapping_buffers(world());
}

TEST_CASE("MPI: a rank that destroys its communicator while the others call a collective ends their wait") {
  const int P = world().size(), me = world().rank();
  std::optional<mrr::MpiCommunicator> comm(std::in_place, MPI_COMM_WORLD);
  if (me == 1) {
    comm.reset();  // leaves: returns at once, without waiting for the others to leave too
  } else {
    std::vector<double> mine(3, 1.0), all(3 * static_cast<std::size_t>(P));
    CHECK_THROWS_WITH_AS(comm->all_gather(std::span<const double>(mine), std::span<double>(all)),
                         doctest::Contains("rank 1 has destroyed its MpiCommunicator"), mrr::CommunicatorError);
    // The communicator is now unusable everywhere, and says why without waiting for anyone.
    CHECK_THROWS_WITH_AS(comm->barrier(), doctest::Contains("can no longer be used"), mrr::CommunicatorError);
    comm.reset();
  }
  world().barrier();  // the other communicators are unaffected
  check_still_works(world());
}

TEST_CASE("MPI: the collective timeout comes from the constructor or MRR_MPI_TIMEOUT, and must be positive") {
  CHECK(world().timeout() == std::chrono::minutes(10));
  CHECK(mrr::MpiCommunicator(MPI_COMM_WORLD, std::chrono::seconds(7)).timeout() == std::chrono::seconds(7));
  CHECK_THROWS_AS(mrr::MpiCommunicator(MPI_COMM_WORLD, std::chrono::milliseconds(0)), mrr::InvalidArgument);
  REQUIRE(setenv("MRR_MPI_TIMEOUT", "2.5", 1) == 0);
  CHECK(mrr::MpiCommunicator().timeout() == std::chrono::milliseconds(2500));
  for (const char* bad : {"", "abc", "0", "-3", "5s", "nan", "1e300"}) {
    CAPTURE(bad);
    REQUIRE(setenv("MRR_MPI_TIMEOUT", bad, 1) == 0);
    CHECK_THROWS_WITH_AS(mrr::MpiCommunicator(), doctest::Contains("MRR_MPI_TIMEOUT"), mrr::InvalidArgument);
  }
  REQUIRE(unsetenv("MRR_MPI_TIMEOUT") == 0);
}

TEST_CASE("MPI: a split communicator (even and odd ranks) runs the same checks") {
  MPI_Comm half = MPI_COMM_NULL;
  REQUIRE(MPI_Comm_split(MPI_COMM_WORLD, world().rank() % 2, world().rank(), &half) == MPI_SUCCESS);
  {
    const mrr::MpiCommunicator comm(half);
    CHECK(comm.size() == (world().size() + 1 - world().rank() % 2) / 2);
    check_collectives_of<float>(comm);
    check_all_reduce_sum<double>(comm, 1000);
  }
  MPI_Comm_free(&half);
}

TEST_CASE("MPI: a large all_reduce_sum is the rank-order sum, bitwise, on every rank") {
  check_all_reduce_sum<float>(world(), 100003);
  check_all_reduce_sum<double>(world(), 100003);
}

TEST_CASE("MPI: all_reduce_sum of a type MPI has no name for (long double, sent as bytes)") {
  // Its counts were in elements while the type was MPI_BYTE: 1/16 of the data moved, and every
  // rank kept (part of) its own values, with no error.
  for (const std::size_t n : {std::size_t{1}, std::size_t{5}, std::size_t{1000}}) {
    CAPTURE(n);
    check_all_reduce_sum<long double>(world(), n);
  }
}

int main(int argc, char** argv) {
  mrr::MpiSession session(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  doctest::Context context(argc, argv);
  std::ostringstream quiet;
  if (rank != 0) context.setCout(&quiet);  // rank 0 speaks for everyone; the exit code covers all ranks
  const int result = context.run();
  int worst = result;
  MPI_Allreduce(&result, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (rank != 0 && result != 0) std::fputs(quiet.str().c_str(), stderr);  // a failure seen only here
  return worst;
}
