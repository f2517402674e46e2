// MoELayer over MpiCommunicator in real processes (ctest runs it under mpirun -np 2 and -np 4):
// each rank's slice of the output and of every gradient is bitwise the one-process computation,
// which every rank also runs locally; bad input on one rank is an error on every rank.
#define DOCTEST_CONFIG_IMPLEMENT
#include <mrr/comm/mpi.hpp>
#include <mrr/moe.hpp>

#include <doctest/doctest.h>

#include "moe_fixture.hpp"

#include <mpi.h>

#include <cstdio>
#include <sstream>
#include <string>

namespace {

using mrr::RowMatrix;
using mrr::test::bitwise_equal;

const mrr::MpiCommunicator& world() {
  static const mrr::MpiCommunicator comm(MPI_COMM_WORLD);
  return comm;
}

template <class S>
void check_against_one_process(const mrr::RouterConfig& config, int hidden, int intermediate, Eigen::Index tokens) {
  const auto& comm = world();
  const auto m = mrr::test::MoEModel<S>::random(config, hidden, intermediate, 17);
  const RowMatrix<S> x = mrr::test::random_normal<S>(tokens, hidden, 18);
  const RowMatrix<S> gy = mrr::test::random_normal<S>(tokens, hidden, 19);
  mrr::test::MoEResult<S> single(tokens, hidden, m.num_experts(), m.topk(), 1);
  auto reference = m.layer(mrr::SingleProcess{});
  mrr::test::run_rank(reference, x, gy, single);

  mrr::test::MoEResult<S> mine(tokens, hidden, m.num_experts(), m.topk(), comm.size());
  auto layer = m.layer(comm);
  mrr::test::run_rank(layer, x, gy, mine);
  const auto [begin, end] = mrr::test::token_chunk(tokens, comm.size(), comm.rank());
  CHECK(bitwise_equal(mine.output.middleRows(begin, end - begin).eval(), single.output.middleRows(begin, end - begin).eval()));
  CHECK(bitwise_equal(mine.grad_input.middleRows(begin, end - begin).eval(),
                      single.grad_input.middleRows(begin, end - begin).eval()));
  CHECK(mine.ids.middleRows(begin, end - begin) == single.ids.middleRows(begin, end - begin));
  CHECK(bitwise_equal(mine.grad_gate[static_cast<std::size_t>(comm.rank())], single.grad_gate[0]));
  for (int e = layer.experts().first_expert(); e < layer.experts().first_expert() + layer.experts().num_experts(); ++e) {
    const auto i = static_cast<std::size_t>(e);
    CHECK(bitwise_equal(mine.grad_w_gate[i], single.grad_w_gate[i]));
    CHECK(bitwise_equal(mine.grad_w_up[i], single.grad_w_up[i]));
    CHECK(bitwise_equal(mine.grad_w_down[i], single.grad_w_down[i]));
  }
}

}  // namespace

TEST_CASE_TEMPLATE("MPI: MoELayer output and gradients are bitwise the one-process ones", S, float, double) {
  check_against_one_process<S>(mrr::presets::qwen3_moe(8, 2), 13, 7, 37);
  check_against_one_process<S>(mrr::presets::megatron_deepseek_v3(16, 4, 4, 2, 2.5), 33, 20, 50);
  check_against_one_process<S>(mrr::presets::mixtral(8, 2), 16, 32, 3);
}

TEST_CASE("MPI: bad input on one rank is an error on every rank, and the layer stays usable") {
  const auto m = mrr::test::MoEModel<double>::random(mrr::presets::qwen3_moe(8, 2), 8, 4, 1);
  auto layer = m.layer(world());
  const int cols = world().rank() == 1 ? 9 : 8;
  std::string what;
  try {
    layer.forward(RowMatrix<double>::Ones(5, cols));
  } catch (const std::exception& e) {
    what = e.what();
  }
  CAPTURE(what);
  CHECK(what.find("'hidden' has shape [5, 9]") != std::string::npos);
  CHECK(layer.forward(RowMatrix<double>::Ones(5, 8)).output.allFinite());
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
  if (rank != 0 && result != 0) std::fputs(quiet.str().c_str(), stderr);
  return worst;
}
