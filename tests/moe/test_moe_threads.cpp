// The layer under OpenMP: output and every gradient are bitwise the same with 1, 2 and 3 threads
// and on 1 and 2 expert-parallel ranks (experts run in parallel, each on one thread; the gate, the
// router and combine use fixed tiles), at sizes where a multi-threaded Eigen product would block
// differently. The reuse API: forward(hidden, f) into a kept context gives the same bits as a
// fresh forward, and backward_accumulate adds each call's expert gradients.
#include <mrr/comm/in_process.hpp>
#include <mrr/moe.hpp>
#include <mrr/router.hpp>

#include <doctest/doctest.h>

#include "moe_fixture.hpp"

#include <omp.h>

#include <vector>

using mrr::RowMatrix;
using mrr::test::bitwise_equal;
using mrr::test::check_same;
using mrr::test::MoEModel;
using mrr::test::MoEResult;

namespace {

constexpr int kHidden = 96, kIntermediate = 80;
constexpr Eigen::Index kTokens = 700;

template <class S>
MoEResult<S> run(const MoEModel<S>& m, const RowMatrix<S>& x, const RowMatrix<S>& gy, int threads, int ranks) {
  omp_set_num_threads(threads);
  MoEResult<S> out(x.rows(), m.hidden, m.num_experts(), m.topk(), ranks);
  if (ranks == 1) {
    auto layer = m.layer(mrr::SingleProcess{});
    mrr::test::run_rank(layer, x, gy, out);
  } else {
    mrr::InProcessGroup(ranks).run([&](const mrr::InProcessComm& comm) {
      omp_set_num_threads(threads);  // per thread: each rank's thread starts from the default
      auto layer = m.layer(comm);
      mrr::test::run_rank(layer, x, gy, out);
    });
  }
  return out;
}

}  // namespace

TEST_CASE_TEMPLATE("MoELayer: bitwise the same on 1, 2 and 3 threads and on 1 and 2 ranks", S, float, double) {
  for (const auto& config : {mrr::presets::qwen3_moe(8, 2), mrr::presets::megatron_deepseek_v3(16, 4, 4, 2, 2.5)}) {
    CAPTURE(config.num_experts);
    const auto m = MoEModel<S>::random(config, kHidden, kIntermediate, 11);
    const RowMatrix<S> x = mrr::test::random_normal<S>(kTokens, kHidden, 12);
    const RowMatrix<S> gy = mrr::test::random_normal<S>(kTokens, kHidden, 13);
    const auto reference = run(m, x, gy, 1, 1);
    CHECK(reference.output.allFinite());
    CHECK(!reference.grad_w_down.front().isZero());
    for (int threads : {1, 2, 3})
      for (int ranks : {1, 2}) {
        CAPTURE(threads);
        CAPTURE(ranks);
        check_same(reference, run(m, x, gy, threads, ranks));
      }
  }
  omp_set_num_threads(1);
}

TEST_CASE("MoELayer: a kept context and kept gradients give the fresh results; expert gradients add up") {
  using S = float;
  const auto m = MoEModel<S>::random(mrr::presets::qwen3_moe(8, 2), kHidden, kIntermediate, 21);
  auto layer = m.layer(mrr::SingleProcess{});
  const RowMatrix<S> x1 = mrr::test::random_normal<S>(kTokens, kHidden, 22);
  const RowMatrix<S> x2 = mrr::test::random_normal<S>(kTokens / 2, kHidden, 23);  // another shape in between
  const RowMatrix<S> gy = mrr::test::random_normal<S>(kTokens, kHidden, 24);
  const auto fresh = layer.forward(x1);
  const auto fresh_grad = layer.backward(fresh, gy);

  decltype(layer)::Forward kept;
  layer.forward(x2, kept);
  layer.forward(x1, kept);
  CHECK(bitwise_equal(kept.output, fresh.output));
  CHECK(bitwise_equal(kept.expert_inputs, fresh.expert_inputs));
  CHECK(kept.local_offsets == fresh.local_offsets);

  decltype(layer)::Gradients grads{RowMatrix<S>(), RowMatrix<S>(), layer.experts().zero_gradients()};
  layer.backward_accumulate(kept, gy, grads);
  CHECK(bitwise_equal(grads.input, fresh_grad.input));
  CHECK(bitwise_equal(grads.gate_weight, fresh_grad.gate_weight));
  for (std::size_t e = 0; e < 8; ++e)
    CHECK(bitwise_equal(grads.experts.w_up[e], fresh_grad.experts.w_up[e]));
  // A second micro-batch's expert gradients are added: here the same one, so twice the first.
  layer.backward_accumulate(kept, gy, grads);
  for (std::size_t e = 0; e < 8; ++e) {
    CAPTURE(e);
    CHECK(bitwise_equal(grads.experts.w_down[e], (fresh_grad.experts.w_down[e] * 2.0f).eval()));
    CHECK(bitwise_equal(grads.experts.w_gate[e], (fresh_grad.experts.w_gate[e] * 2.0f).eval()));
  }
  CHECK(bitwise_equal(grads.input, fresh_grad.input));  // overwritten, not added
}

TEST_CASE("MoELayer: saved expert activations give the bits of recomputing them, and cost what they say") {
  using S = float;
  const auto m = MoEModel<S>::random(mrr::presets::mixtral(8, 2), kHidden, kIntermediate, 31);
  const RowMatrix<S> x = mrr::test::random_normal<S>(kTokens, kHidden, 32);
  const RowMatrix<S> gy = mrr::test::random_normal<S>(kTokens, kHidden, 33);
  auto saving = m.layer(mrr::SingleProcess{});
  auto recomputing = m.layer(mrr::SingleProcess{});
  recomputing.save_activations(false);
  CHECK(saving.saves_activations());
  CHECK(!recomputing.saves_activations());
  const auto fs = saving.forward(x);
  const auto fr = recomputing.forward(x);
  CHECK(fs.expert_activations.rows() == fs.local_rows());
  CHECK(fs.expert_activations.cols() == 2 * kIntermediate);
  CHECK(fr.expert_activations.size() == 0);
  CHECK(bitwise_equal(fs.output, fr.output));
  const auto gs = saving.backward(fs, gy);
  const auto gr = recomputing.backward(fr, gy);
  CHECK(bitwise_equal(gs.input, gr.input));
  CHECK(bitwise_equal(gs.gate_weight, gr.gate_weight));
  for (std::size_t e = 0; e < 8; ++e) {
    CAPTURE(e);
    CHECK(bitwise_equal(gs.experts.w_gate[e], gr.experts.w_gate[e]));
    CHECK(bitwise_equal(gs.experts.w_up[e], gr.experts.w_up[e]));
    CHECK(bitwise_equal(gs.experts.w_down[e], gr.experts.w_down[e]));
  }
  CHECK(!gs.experts.w_gate.front().isZero());
}
