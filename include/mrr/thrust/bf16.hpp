// mrr-requires: mrr_thrust_omp
// bfloat16 storage for logits handed to the device router: the upper 16 bits of an IEEE float,
// converted from float with round-to-nearest-even (NaN stays a quiet NaN) and widened to float
// exactly. Arithmetic happens in float; this type only stores. Layout-compatible with
// __nv_bfloat16 and torch.bfloat16 (2 bytes, same bits), so their buffers can be reinterpreted.
#pragma once

#include <mrr/detail/config.hpp>

#include <cuda/std/bit>

#include <cstdint>

MRR_NAMESPACE_BEGIN

struct bf16 {
  std::uint16_t bits = 0;

  bf16() = default;
  // From float, rounded (from_float): what static_cast<bf16>(x) means in the kernels that compute
  // in float and store T (a combine's sum), rather than C++20's aggregate initialisation of the
  // bits from the float's integer part.
  MRR_HOST_DEVICE explicit bf16(float f) : bits(from_float(f).bits) {}

  static MRR_HOST_DEVICE bf16 from_bits(std::uint16_t b) {
    bf16 h;
    h.bits = b;
    return h;
  }

  // Round to nearest, ties to even; +-inf stay infinite, finite values past the largest bf16
  // round to infinity (as torch's .to(torch.bfloat16) does).
  static MRR_HOST_DEVICE bf16 from_float(float f) {
    const std::uint32_t u = ::cuda::std::bit_cast<std::uint32_t>(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return from_bits(static_cast<std::uint16_t>((u >> 16) | 0x40u));
    const std::uint32_t rounded = u + 0x7fffu + ((u >> 16) & 1u);
    return from_bits(static_cast<std::uint16_t>(rounded >> 16));
  }

  MRR_HOST_DEVICE float to_float() const { return ::cuda::std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16); }
  MRR_HOST_DEVICE explicit operator float() const { return to_float(); }
  MRR_HOST_DEVICE explicit operator double() const { return static_cast<double>(to_float()); }

  friend MRR_HOST_DEVICE bool operator==(bf16 a, bf16 b) { return a.bits == b.bits; }
};

static_assert(sizeof(bf16) == 2, "bf16 must be two bytes (the layout of torch.bfloat16)");

MRR_NAMESPACE_END
