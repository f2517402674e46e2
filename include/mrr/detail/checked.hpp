// Overflow-checked integer arithmetic for sizes that come from callers or from files (positions x
// layers x k x id width, shapes of .npy arrays): a product that does not fit is an error, never a
// wrapped size that allocates too little and then reads or writes past the buffer.
#pragma once

#include <mrr/detail/config.hpp>

#include <concepts>

MRR_NAMESPACE_BEGIN
namespace detail {

// out = a * b, exactly, in Out; false (out untouched) when the true product does not fit. The
// operands may have any integer types and signs (GCC/Clang builtins compute the exact result).
template <std::integral Out, std::integral A, std::integral B>
[[nodiscard]] constexpr bool checked_mul(A a, B b, Out& out) noexcept {
  Out r{};
  if (__builtin_mul_overflow(a, b, &r)) return false;
  out = r;
  return true;
}

// out = a + b, exactly, in Out; false (out untouched) when it does not fit.
template <std::integral Out, std::integral A, std::integral B>
[[nodiscard]] constexpr bool checked_add(A a, B b, Out& out) noexcept {
  Out r{};
  if (__builtin_add_overflow(a, b, &r)) return false;
  out = r;
  return true;
}

// out = the product of all factors; false when it (or a partial product) does not fit in Out.
template <std::integral Out, std::integral First, std::integral... Rest>
[[nodiscard]] constexpr bool checked_product(Out& out, First first, Rest... rest) noexcept {
  Out r{};
  if (__builtin_mul_overflow(first, Out{1}, &r)) return false;
  const bool ok = ((checked_mul(r, rest, r)) && ...);
  if (!ok) return false;
  out = r;
  return true;
}

}  // namespace detail
MRR_NAMESPACE_END
