// Argument checks shared by the PPO utilities: shapes, emptiness, finiteness, 0/1 masks. Each
// failure throws mrr::InvalidArgument naming the function, the argument and (for values) the
// first bad element.
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>
#include <mrr/tensor.hpp>

#include <Eigen/Core>
#include <cmath>
#include <string_view>

MRR_NAMESPACE_BEGIN
namespace ppo::detail {

template <class A, class B>
void require_same_shape(std::string_view function, std::string_view name_a, const Eigen::EigenBase<A>& a,
                        std::string_view name_b, const Eigen::EigenBase<B>& b) {
  mrr::detail::require(a.rows() == b.rows() && a.cols() == b.cols(), function, "'", name_a, "' has shape ",
                       mrr::detail::shape_of(a), " but '", name_b, "' has shape ", mrr::detail::shape_of(b));
}

// An empty batch has no defined statistics; verl would return NaN or crash later.
template <class A>
void require_nonempty(std::string_view function, std::string_view name, const Eigen::EigenBase<A>& a) {
  mrr::detail::require(a.rows() > 0 && a.cols() > 0, function, "'", name, "' is empty (shape ",
                       mrr::detail::shape_of(a), "); an empty batch has no defined result");
}

template <class A>
void require_rows(std::string_view function, std::string_view name, Eigen::Index size, std::string_view batch_name,
                  const Eigen::EigenBase<A>& batch) {
  mrr::detail::require(size == batch.rows(), function, "'", name, "' has ", size, " entries but '", batch_name,
                       "' has ", batch.rows(), " rows");
}

// Names the first non-finite element. Only called on the cold path or on small inputs.
template <class Derived>
[[noreturn]] void throw_not_finite(std::string_view function, std::string_view name,
                                   const Eigen::DenseBase<Derived>& m) {
  for (Eigen::Index i = 0; i < m.rows(); ++i)
    for (Eigen::Index j = 0; j < m.cols(); ++j)
      if (!std::isfinite(static_cast<double>(m(i, j))))
        mrr::detail::throw_invalid_argument(function, "'", name, "' has a non-finite value ",
                                            static_cast<double>(m(i, j)), " at [", i, ", ", j, "]");
  mrr::detail::throw_invalid_argument(function, "'", name, "' has a non-finite value");
}

// x * 0 is 0 for finite x and NaN for NaN or inf, so one vectorised sum tests every element
// (Eigen's allFinite tests them one by one, 20x slower on large batches).
template <class Derived>
void require_finite(std::string_view function, std::string_view name, const Eigen::DenseBase<Derived>& m) {
  using T = typename Derived::Scalar;
  if (m.size() == 0) return;
  if (!(((m.derived().array() * T(0)).sum()) == T(0))) [[unlikely]]
    throw_not_finite(function, name, m);
}

// Finite where the mask selects the element; masked-out positions may hold anything (padding).
template <class Derived, class MaskDerived>
void require_finite_where(std::string_view function, std::string_view name, const Eigen::DenseBase<Derived>& m,
                          const Eigen::DenseBase<MaskDerived>& mask) {
  using T = typename Derived::Scalar;
  bool ok = true;
  for (Eigen::Index i = 0; i < m.rows() && ok; ++i) {
    // A row finite everywhere (one vectorised sum of x * 0) needs no look at its mask.
    if ((m.row(i).array() * T(0)).sum() == T(0)) [[likely]]
      continue;
    for (Eigen::Index j = 0; j < m.cols(); ++j)
      if (mask(i, j) != T(0) && !std::isfinite(m(i, j))) {
        ok = false;
        break;
      }
  }
  if (!ok) [[unlikely]] {
    for (Eigen::Index i = 0; i < m.rows(); ++i)
      for (Eigen::Index j = 0; j < m.cols(); ++j)
        if (mask(i, j) != T(0) && !std::isfinite(m(i, j)))
          mrr::detail::throw_invalid_argument(function, "'", name, "' has a non-finite value ",
                                              static_cast<double>(m(i, j)), " at unmasked position [", i, ", ", j, "]");
  }
}

// True when every element is exactly 0 or 1 (NaN and inf are not): m (m - 1) is 0 exactly for
// m = 0 or 1 and non-zero (or NaN) for any other value, denormals included, so one vectorised sum
// of |m (m - 1)| tests a whole block (Eigen 3.4 vectorises no comparison, and `.all()` over one
// tests an element at a time: half of an outcome estimator's time at 512 x 4096). require_mask
// runs it first and looks for the offending element only when it fails.
template <class Derived>
bool is_binary_mask(const Eigen::DenseBase<Derived>& mask) {
  using T = typename Derived::Scalar;
  const auto a = mask.derived().array();
  return (a * (a - T(1))).abs().sum() == T(0);
}

// A mask selects (1) or excludes (0) an element; any other value (0.5, 2, -1, NaN) would scale
// the element silently, so it is rejected with the first offending index. row_offset is added to
// the reported row when `mask` is a block of rows starting there.
template <class Derived>
void require_mask(std::string_view function, std::string_view name, const Eigen::DenseBase<Derived>& mask,
                  Eigen::Index row_offset = 0) {
  using T = typename Derived::Scalar;
  if (is_binary_mask(mask)) [[likely]]
    return;
  for (Eigen::Index i = 0; i < mask.rows(); ++i)
    for (Eigen::Index j = 0; j < mask.cols(); ++j) {
      const T m = mask(i, j);
      if (m != T(0) && m != T(1))
        mrr::detail::throw_invalid_argument(function, "'", name, "' has ", static_cast<double>(m), " at [",
                                            i + row_offset, ", ", j, "]; a mask holds 0 or 1");
    }
}

inline void require_finite_scalar(std::string_view function, std::string_view name, double value) {
  mrr::detail::require(std::isfinite(value), function, "'", name, "' must be finite, got ", value);
}

}  // namespace ppo::detail
MRR_NAMESPACE_END
