// Batch invariance of the reference expert: a row's output, saved activations and input
// gradient are bitwise the same whatever other rows share its expert in the call (how many, and
// where the row falls in the blocks of row_block()). Found by the flagship's same-engine floor:
// Eigen computes a product's rows in groups of 4 and the rows left over (a lone row above all: a
// matrix-vector product) with other kernels whose bits differ, so a token's results depended on
// how many other tokens its expert got. The gate's logits and input gradient, and the product
// both take (detail::rows_times), have the same property.
#include <mrr/detail/row_gemm.hpp>
#include <mrr/moe/gate.hpp>
#include <mrr/moe/swiglu_experts.hpp>

#include <doctest/doctest.h>

#include "moe_fixture.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>

using mrr::test::bitwise_equal;
using mrr::test::random_normal;

TEST_CASE_TEMPLATE("SwiGLUExperts: a row's results do not depend on the other rows of the call", T, float, double) {
  struct Shape {
    int hidden, intermediate;
  };
  // Small and Mixtral-like widths; 300 and 1000 leave remainders in every blocking Eigen uses.
  for (const Shape s : {Shape{64, 48}, Shape{128, 96}, Shape{256, 896}, Shape{300, 1000}}) {
    CAPTURE(s.hidden);
    CAPTURE(s.intermediate);
    mrr::SwiGLUExperts<T> experts(s.hidden, s.intermediate, 1);
    experts.set_expert(0, random_normal<T>(s.intermediate, s.hidden, 11, T(0.1)),
                       random_normal<T>(s.intermediate, s.hidden, 12, T(0.1)),
                       random_normal<T>(s.hidden, s.intermediate, 13, T(0.1)));
    const Eigen::Index n = 300;  // one block of 256 (or fewer for wide experts) and a remainder
    const auto x = random_normal<T>(n, s.hidden, 14);
    const auto dy = random_normal<T>(n, s.hidden, 15);
    mrr::RowMatrix<T> out(n, s.hidden), saved(n, experts.activation_size()), dx(n, s.hidden);
    experts.forward_into(0, x, out, saved);
    auto grads = experts.zero_gradients();
    experts.backward_into(0, x, dy, dx, grads, saved);

    // The same rows in calls of other sizes: alone, in pairs, threes, and blocks whose last
    // row-block holds one row.
    for (const Eigen::Index chunk : {Eigen::Index{1}, Eigen::Index{2}, Eigen::Index{3}, Eigen::Index{5},
                                     experts.row_block() + 1, Eigen::Index{n}}) {
      CAPTURE(chunk);
      mrr::RowMatrix<T> out2(n, s.hidden), saved2(n, experts.activation_size()), dx2(n, s.hidden), dx3(n, s.hidden);
      auto g2 = experts.zero_gradients();
      for (Eigen::Index r0 = 0; r0 < n; r0 += chunk) {
        const Eigen::Index m = std::min(chunk, n - r0);
        experts.forward_into(0, x.middleRows(r0, m), out2.middleRows(r0, m), saved2.middleRows(r0, m));
        experts.backward_into(0, x.middleRows(r0, m), dy.middleRows(r0, m), dx2.middleRows(r0, m), g2,
                              saved2.middleRows(r0, m));
        experts.backward_into(0, x.middleRows(r0, m), dy.middleRows(r0, m), dx3.middleRows(r0, m), g2);  // recomputes
      }
      CHECK(bitwise_equal(out2, out));
      CHECK(bitwise_equal(saved2, saved));
      CHECK(bitwise_equal(dx2, dx));
      CHECK(bitwise_equal(dx3, dx));
    }
  }
}

TEST_CASE("SwiGLUExperts::set_intermediate_rounding: applied to every block's rows before w_down, forward only") {
  const int hidden = 96, intermediate = 160;
  mrr::SwiGLUExperts<float> experts(hidden, intermediate, 1);
  experts.set_expert(0, random_normal<float>(intermediate, hidden, 21, 0.1f),
                     random_normal<float>(intermediate, hidden, 22, 0.1f),
                     random_normal<float>(hidden, intermediate, 23, 0.1f));
  const Eigen::Index n = experts.row_block() * 2 + 7;  // three blocks, the last a remainder
  const auto x = random_normal<float>(n, hidden, 24);
  const auto plain = experts.forward(0, x);
  CHECK_FALSE(experts.rounds_intermediate());

  // Doubling every intermediate value is exact, and so is every product and sum built from it:
  // the output is exactly twice the plain one on every row, so every block went through it.
  std::atomic<int> calls{0};
  experts.set_intermediate_rounding([&](Eigen::Ref<mrr::RowMatrix<float>> a) {
    CHECK(a.cols() == intermediate);
    ++calls;
    a *= 2.0f;
  });
  CHECK(experts.rounds_intermediate());
  const mrr::RowMatrix<float> doubled = experts.forward(0, x);
  CHECK(calls.load() == 3);
  CHECK(bitwise_equal(doubled, mrr::RowMatrix<float>(2.0f * plain)));
  // A row-wise rounding keeps the rows independent: each row alone gives its bits in the block.
  experts.set_intermediate_rounding([](Eigen::Ref<mrr::RowMatrix<float>> a) {
    a = a.unaryExpr([](float v) { return std::round(v * 64.0f) / 64.0f; });
  });
  const mrr::RowMatrix<float> rounded = experts.forward(0, x);
  CHECK_FALSE(bitwise_equal(rounded, plain));
  for (Eigen::Index r = 0; r < n; r += 37)
    CHECK(bitwise_equal(experts.forward(0, x.middleRows(r, 1)), rounded.middleRows(r, 1)));

  // Backward is refused while a rounding is set (it would not be the forward's gradient), and
  // works again once it is removed.
  mrr::RowMatrix<float> dx(n, hidden);
  auto grads = experts.zero_gradients();
  CHECK_THROWS_WITH_AS(experts.backward_into(0, x, x, dx, grads), doctest::Contains("set_intermediate_rounding"),
                       std::invalid_argument);
  experts.set_intermediate_rounding({});
  CHECK_FALSE(experts.rounds_intermediate());
  CHECK_NOTHROW(experts.backward_into(0, x, x, dx, grads));
  CHECK(bitwise_equal(experts.forward(0, x), plain));
}

// Eigen picks its coefficient-based lazy product when rows + cols + depth < 20 and a
// matrix-vector product for one row, each with other bits than its GEMM: at the small shapes a
// row would get other bits in a call of 4 rows than in one of 36. rows_times never takes the
// lazy product, and pads the rows to whole groups; one-column results (Eigen's matrix-vector
// product) are held to the same property.
TEST_CASE_TEMPLATE("detail::rows_times: a row's product has the same bits in calls of any size, tiny shapes included",
                   T, float, double) {
  struct Shape {
    int depth, cols;
  };
  for (const Shape s : {Shape{3, 4}, Shape{5, 7}, Shape{1, 2}, Shape{5, 1}, Shape{64, 1}, Shape{300, 1}, Shape{64, 48},
                        Shape{300, 100}}) {
    CAPTURE(s.depth);
    CAPTURE(s.cols);
    const Eigen::Index n = 37;
    const auto lhs = random_normal<T>(n, s.depth, 31);
    const auto rhs = random_normal<T>(s.depth, s.cols, 32);
    const auto start = random_normal<T>(n, s.cols, 33);
    for (const bool accumulate : {false, true}) {
      CAPTURE(accumulate);
      mrr::RowMatrix<T> whole = start;
      mrr::detail::rows_times(whole, lhs, rhs, accumulate);
      // The product itself, within the rounding of a depth-long sum (so a call that computed
      // something else cannot pass).
      const mrr::RowMatrix<T> exact = (accumulate ? start : mrr::RowMatrix<T>::Zero(n, s.cols)) + lhs * rhs;
      CHECK((whole - exact).cwiseAbs().maxCoeff() <= T(1e-4) * T(s.depth + 1));
      for (const Eigen::Index chunk : {Eigen::Index{1}, Eigen::Index{2}, Eigen::Index{4}, Eigen::Index{5}}) {
        CAPTURE(chunk);
        mrr::RowMatrix<T> parts = start;
        for (Eigen::Index r0 = 0; r0 < n; r0 += chunk) {
          const Eigen::Index m = std::min(chunk, n - r0);
          mrr::detail::rows_times(parts.middleRows(r0, m), lhs.middleRows(r0, m), rhs, accumulate);
        }
        CHECK(bitwise_equal(parts, whole));
      }
    }
  }
}

// The gate's per-token results, whatever batch they come in (it computes them in tiles of 64
// tokens through rows_times): the logits (with their zero padding columns) and the input gradient.
TEST_CASE_TEMPLATE("Gate: a token's logits and input gradient have the same bits in batches of any size", T, float,
                   double) {
  struct Shape {
    int experts, hidden;
  };
  for (const Shape s : {Shape{6, 5}, Shape{64, 256}, Shape{8, 300}}) {
    CAPTURE(s.experts);
    CAPTURE(s.hidden);
    mrr::Gate<T> gate(s.experts, s.hidden);
    gate.set_weight(random_normal<T>(s.experts, s.hidden, 41, T(0.5)), "test");
    const Eigen::Index tokens = 150;
    const auto x = random_normal<T>(tokens, s.hidden, 42);
    const auto dz = random_normal<T>(tokens, s.experts, 43);
    const auto base = random_normal<T>(tokens, s.hidden, 44);
    mrr::RowMatrix<T> logits;
    gate.logits_into(logits, x);
    mrr::RowMatrix<T> grad = base;
    gate.add_input_gradient(grad, dz);
    REQUIRE(logits.rows() == tokens);
    REQUIRE(logits.cols() == gate.padded_experts());
    CHECK(logits.rightCols(gate.padded_experts() - s.experts).isZero(0));
    const mrr::RowMatrix<T> exact = x * gate.weight().transpose();
    CHECK((logits.leftCols(s.experts) - exact).cwiseAbs().maxCoeff() <= T(1e-3));
    const mrr::RowMatrix<T> exact_grad = base + dz * gate.weight();
    CHECK((grad - exact_grad).cwiseAbs().maxCoeff() <= T(1e-3));
    for (const Eigen::Index chunk : {Eigen::Index{1}, Eigen::Index{3}, Eigen::Index{65}}) {
      CAPTURE(chunk);
      for (Eigen::Index r0 = 0; r0 < tokens; r0 += chunk) {
        const Eigen::Index m = std::min(chunk, tokens - r0);
        mrr::RowMatrix<T> part;
        gate.logits_into(part, x.middleRows(r0, m));
        CHECK(bitwise_equal(part, mrr::RowMatrix<T>(logits.middleRows(r0, m))));
        mrr::RowMatrix<T> part_grad = base.middleRows(r0, m);
        gate.add_input_gradient(part_grad, dz.middleRows(r0, m));
        CHECK(bitwise_equal(part_grad, mrr::RowMatrix<T>(grad.middleRows(r0, m))));
      }
    }
  }
}
