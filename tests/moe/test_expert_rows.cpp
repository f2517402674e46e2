// Batch invariance of the reference expert: a row's output, saved activations and input
// gradient are bitwise the same whatever other rows share its expert in the call (how many, and
// where the row falls in the blocks of row_block()). Found by the flagship's same-engine floor:
// Eigen computes a product's rows in groups of 4 and the rows left over (a lone row above all: a
// matrix-vector product) with other kernels whose bits differ, so a token's results depended on
// how many other tokens its expert got.
#include <mrr/moe/swiglu_experts.hpp>

#include <doctest/doctest.h>

#include "moe_fixture.hpp"

#include <algorithm>

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
