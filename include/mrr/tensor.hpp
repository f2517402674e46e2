// Vocabulary types for host tensors: row-major Eigen matrices (the layout of torch tensors) and
// read-only views of them, so callers can pass their own buffers through Eigen::Map without a copy.
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>

#include <Eigen/Core>
#include <cstdint>
#include <string>

MRR_NAMESPACE_BEGIN

template <class T>
using RowMatrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

template <class T>
using Vector = Eigen::Matrix<T, Eigen::Dynamic, 1>;

// A read-only view that never silently copies memory it could have viewed: Eigen::Ref<const
// Plain>, which would quietly evaluate a view of another layout (column-major, a column stride, a
// transpose) into a temporary, limited to what it can view in place. Such an input does not
// compile (static_assert: pass an explicit copy, RowMatrix<T>(input), or a view of the right
// layout); a view whose strides turn out at run time not to fit throws InvalidArgument. An
// expression with no memory of its own (a - b, Ones(), a cast) is evaluated, as it would be
// anywhere. DESIGN.md 11: "a strided input is an error or an explicit copy, never a silent one".
template <class Plain>
class ConstView : public Eigen::Ref<const Plain> {
  using Base = Eigen::Ref<const Plain>;
  template <class Derived>
  using Match = typename Eigen::internal::traits<Base>::template match<Derived>;

 public:
  ConstView(const ConstView&) = default;
  ConstView(ConstView&&) = default;  // NOLINT(performance-noexcept-move-constructor): Eigen's Ref is not

  // Memory viewed in place (checked at run time too: a runtime stride Eigen would copy around).
  template <class Derived>
  requires(bool(Match<Derived>::ScalarTypeMatch) && bool(Match<Derived>::MatchAtCompileTime))
      ConstView(const Eigen::DenseBase<Derived>& m)  // NOLINT(google-explicit-constructor): a view, as Eigen::Ref
      : Base(m.derived()) {
    detail::require(m.size() == 0 || this->data() == m.derived().data(), "mrr view",
                    "the input's strides do not fit a view of contiguous rows (inner stride ",
                    m.derived().innerStride(),
                    "); pass an explicit copy (mrr::RowMatrix<T>(input)) or a row-major view");
  }

  // An expression without memory of its own: evaluated into the view's temporary.
  template <class Derived>
  requires(bool(Match<Derived>::ScalarTypeMatch) && !bool(Match<Derived>::MatchAtCompileTime) &&
           !bool(Match<Derived>::HasDirectAccess))
      ConstView(const Eigen::DenseBase<Derived>& m)  // NOLINT(google-explicit-constructor)
      : Base(m.derived()) {}

  // Memory of another layout: viewing it would be a silent copy.
  template <class Derived>
  requires(bool(Match<Derived>::ScalarTypeMatch) && !bool(Match<Derived>::MatchAtCompileTime) &&
           bool(Match<Derived>::HasDirectAccess)) ConstView(const Eigen::DenseBase<Derived>& m)
      : Base(m.derived()) {  // NOLINT(google-explicit-constructor)
    static_assert(sizeof(Derived) == 0,
                  "mrr: this input is memory of another layout (column-major, a column stride or a transpose), "
                  "which Eigen::Ref would copy silently; pass an explicit copy (mrr::RowMatrix<T>(input)), "
                  "or a row-major view of contiguous rows");
  }
};

// Read-only views: accept a RowMatrix, a block of rows of one, or an Eigen::Map over caller
// memory with contiguous rows (any row stride).
template <class T>
using MatrixRef = ConstView<RowMatrix<T>>;

template <class T>
using VectorRef = ConstView<Vector<T>>;

// Global expert ids, one row of k per token (int32 as torch.topk's int64 narrowed: E < 2^31).
using ExpertIds = RowMatrix<std::int32_t>;
using ExpertIdsRef = MatrixRef<std::int32_t>;

namespace detail {

// Pointer to row `r` of a row-major view (rows are contiguous; the outer stride may not be cols()).
template <class T>
MRR_FORCEINLINE const T* row_ptr(const MatrixRef<T>& m, Eigen::Index r) {
  return m.data() + r * m.outerStride();
}

template <class Derived>
std::string shape_of(const Eigen::EigenBase<Derived>& m) {
  return str('[', m.rows(), ", ", m.cols(), ']');
}

}  // namespace detail

MRR_NAMESPACE_END
