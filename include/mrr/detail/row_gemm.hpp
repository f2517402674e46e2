// Row-stable products on the host: dst = lhs * rhs (or dst += lhs * rhs) for a block of rows, where
// each row of dst depends on its own row of lhs (and of dst) only, bit for bit, whatever other
// rows the call holds. The MoE layer's GEMMs (gate logits and input gradient, the experts'
// forward and backward) take their rows through this, so a token's results do not depend on how
// many tokens share its tile, its expert, or its rank.
//
// Eigen's product picks among three kernels by shape: its coefficient-based lazy product when
// rows + cols + depth < EIGEN_GEMM_TO_COEFFBASED_THRESHOLD (20), a matrix-vector product when
// the result has one row, and the blocked GEMM otherwise. Within the GEMM the rows of a row-major
// product (the columns of its column-major problem) go in groups of gebp_traits::nr through one
// micro-kernel and the rows past the last whole group through narrower ones, whose bits differ.
// So rows_times always calls the GEMM itself (never the lazy product), and computes the last
// lhs.rows() % nr rows padded to a whole group (zero rows, whose results are dropped). A
// one-column result (rhs [k, 1]) still takes Eigen's matrix-vector product, whose rows are dot
// products of their own (tests/moe/test_expert_rows.cpp holds it to the same property).
// The reduction depth's blocking depends on the depth and the cache sizes only, never on the
// number of rows.
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/tensor.hpp>

#include <cstddef>
#include <type_traits>
#include <vector>

MRR_NAMESPACE_BEGIN
namespace detail {

// Rows per group of Eigen's GEMM micro-kernel for Scalar.
template <class Scalar>
inline constexpr Eigen::Index kGemmRowGroup = Eigen::internal::gebp_traits<Scalar, Scalar>::nr;

// dst += lhs * rhs through Eigen's blocked GEMM whatever the shape (dst has more than one row;
// one column: its matrix-vector product).
template <class Dst, class Lhs, class Rhs>
void gemm_add(Dst& dst, const Lhs& lhs, const Rhs& rhs) {
  using Scalar = typename Dst::Scalar;
  using Gemm =
      Eigen::internal::generic_product_impl<Lhs, Rhs, Eigen::DenseShape, Eigen::DenseShape, Eigen::GemmProduct>;
  Gemm::scaleAndAddTo(dst, lhs, rhs, Scalar(1));
}

// Per-thread room for one padded group of rows: its lhs and its result (grow only).
template <class Scalar>
struct RowGroupBuffers {
  std::vector<Scalar> in, out;
};
template <class Scalar>
RowGroupBuffers<Scalar>& row_group_buffers() {
  thread_local RowGroupBuffers<Scalar> b;
  return b;
}

// dst = lhs * rhs, or dst += lhs * rhs when accumulate, row-stable (above). dst [n, m] may be a
// block of a larger matrix; lhs [n, k]; rhs [k, m].
template <class Dst, class Lhs, class Rhs>
void rows_times(Dst&& dst, const Lhs& lhs, const Rhs& rhs, bool accumulate) {
  using Scalar = typename std::decay_t<Dst>::Scalar;
  constexpr Eigen::Index group = kGemmRowGroup<Scalar>;
  static_assert(group > 1, "rows_times needs a GEMM micro-kernel of more than one row");
  const Eigen::Index n = lhs.rows(), whole = n - n % group, rest = n - whole;
  if (whole > 0) {
    auto top = dst.topRows(whole);
    if (!accumulate) top.setZero();
    gemm_add(top, lhs.topRows(whole), rhs);
  }
  if (rest == 0) return;
  RowGroupBuffers<Scalar>& b = row_group_buffers<Scalar>();
  const auto in_size = static_cast<std::size_t>(group * lhs.cols());
  const auto out_size = static_cast<std::size_t>(group * rhs.cols());
  if (b.in.size() < in_size) b.in.resize(in_size);
  if (b.out.size() < out_size) b.out.resize(out_size);
  Eigen::Map<RowMatrix<Scalar>> in(b.in.data(), group, lhs.cols());
  Eigen::Map<RowMatrix<Scalar>> out(b.out.data(), group, rhs.cols());
  in.topRows(rest) = lhs.bottomRows(rest);
  in.bottomRows(group - rest).setZero();
  if (accumulate)
    out.topRows(rest) = dst.bottomRows(rest);
  else
    out.topRows(rest).setZero();
  out.bottomRows(group - rest).setZero();
  gemm_add(out, in, rhs);
  dst.bottomRows(rest) = out.topRows(rest);
}

}  // namespace detail
MRR_NAMESPACE_END
