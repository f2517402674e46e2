// What a route store holds per token: k global expert ids for each of num_layers MoE layers,
// stored in the narrowest unsigned type that holds num_experts (never a silent truncation).
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/detail/cpu_dispatch.hpp>
#include <mrr/error.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>

MRR_NAMESPACE_BEGIN

struct RouteShape {
  // Bounds on what a model routes (and a route file may declare): up to 65,535 MoE layers and
  // k <= 4096 experts per token, so sizes derived from a shape cannot overflow.
  static constexpr std::int32_t kMaxLayers = 65535;
  static constexpr std::int32_t kMaxTopk = 4096;

  std::int32_t num_experts = 0;
  std::int32_t num_layers = 0;
  std::int32_t topk = 0;

  friend bool operator==(const RouteShape&, const RouteShape&) = default;

  void validate() const {
    detail::require(num_experts > 0, "RouteShape", "num_experts must be positive, got ", num_experts);
    detail::require(num_layers > 0 && num_layers <= kMaxLayers, "RouteShape", "num_layers must be in [1, ", kMaxLayers,
                    "], got ", num_layers);
    detail::require(topk > 0 && topk <= num_experts && topk <= kMaxTopk, "RouteShape",
                    "topk must be in [1, min(num_experts, ", kMaxTopk, ")], got ", topk, " with num_experts ",
                    num_experts);
  }
  std::string to_string() const {
    return detail::str("{experts ", num_experts, ", layers ", num_layers, ", k ", topk, "}");
  }
};

// Bytes per stored id: 1 up to 256 experts, 2 up to 65,536, else 4.
constexpr int id_width_for(std::int64_t num_experts) {
  if (num_experts <= 256) return 1;
  if (num_experts <= 65536) return 2;
  return 4;
}

namespace detail {

// Little-endian encode/decode of one id of `width` bytes (files and memory share the encoding).
MRR_FORCEINLINE void store_id(std::uint8_t* p, int width, std::uint32_t id) {
  p[0] = static_cast<std::uint8_t>(id);
  if (width >= 2) p[1] = static_cast<std::uint8_t>(id >> 8);
  if (width == 4) {
    p[2] = static_cast<std::uint8_t>(id >> 16);
    p[3] = static_cast<std::uint8_t>(id >> 24);
  }
}

MRR_FORCEINLINE std::uint32_t load_id(const std::uint8_t* p, int width) {
  std::uint32_t v = p[0];
  if (width >= 2) v |= static_cast<std::uint32_t>(p[1]) << 8;
  if (width == 4) v |= static_cast<std::uint32_t>(p[2]) << 16 | static_cast<std::uint32_t>(p[3]) << 24;
  return v;
}

// n encoded ids of type Src (a store's id width) to n ids of another width. Out of line: inlined
// into a lookup, GCC lost the __restrict and kept the loop scalar (a byte load and a 4-byte store
// per id: 68% of a file replay into int32 ids in perf, and 2-byte ids went through a libc call
// each); called, the plain loop vectorises. On x86 builds without AVX2 it is also compiled for
// AVX2 (detail/cpu_dispatch.hpp) and picked at run time: a replay into int32 ids writes 4x the
// bytes it reads, and the baseline's 16-byte unpacks and stores took 9.0 us a 131,072-id lookup
// where AVX2's widening loads and 32-byte stores take 6.7 (bench/RESULTS.md). The same values.
template <class Src, class Id>
MRR_FORCEINLINE void widen_ids_body(const std::uint8_t* __restrict src, std::size_t n, Id* __restrict out) {
  for (std::size_t i = 0; i < n; ++i) {
    Src v;
    std::memcpy(&v, src + i * sizeof(Src), sizeof v);
    out[i] = static_cast<Id>(v);
  }
}

template <class Src, class Id>
[[gnu::noinline]] void widen_ids(const std::uint8_t* __restrict src, std::size_t n, Id* __restrict out) {
  widen_ids_body<Src>(src, n, out);
}

#if MRR_AVX2_DISPATCH
template <class Src, class Id>
[[gnu::noinline]] __attribute__((target("avx2"))) void widen_ids_avx2(const std::uint8_t* __restrict src, std::size_t n,
                                                                      Id* __restrict out) {
  widen_ids_body<Src>(src, n, out);
}
#endif

// n encoded ids of type Src to n ids: a copy when they are the same width (the host is
// little-endian, as the encoding), else widen_ids.
template <class Src, class Id>
void decode_ids(const std::uint8_t* src, std::size_t n, Id* out) {
  if constexpr (sizeof(Src) == sizeof(Id)) {
    if (n != 0) std::memcpy(out, src, n * sizeof(Id));  // ids < num_experts <= 2^31: the same value
  } else {
#if MRR_AVX2_DISPATCH
    if (cpu_has_avx2()) return widen_ids_avx2<Src>(src, n, out);
#endif
    widen_ids<Src>(src, n, out);
  }
}

// The same for ids `width` bytes wide (1, 2 or 4).
template <class Id>
void decode_ids(const std::uint8_t* src, int width, std::size_t n, Id* out) {
  switch (width) {
    case 1:
      return decode_ids<std::uint8_t>(src, n, out);
    case 2:
      return decode_ids<std::uint16_t>(src, n, out);
    default:
      return decode_ids<std::uint32_t>(src, n, out);
  }
}

// n range-checked ids to their encoding in Dst (a store's id width): the inverse of decode_ids,
// out of line for the same reason.
template <class Dst>
[[gnu::noinline]] void encode_ids(const std::int32_t* __restrict ids, std::size_t n, std::uint8_t* __restrict out) {
  for (std::size_t i = 0; i < n; ++i) {
    const auto v = static_cast<Dst>(ids[i]);
    std::memcpy(out + i * sizeof(Dst), &v, sizeof v);
  }
}

// The same for ids `width` bytes wide (1, 2 or 4).
inline void encode_ids(const std::int32_t* ids, int width, std::size_t n, std::uint8_t* out) {
  switch (width) {
    case 1:
      return encode_ids<std::uint8_t>(ids, n, out);
    case 2:
      return encode_ids<std::uint16_t>(ids, n, out);
    default:
      return encode_ids<std::uint32_t>(ids, n, out);
  }
}

// What a store's lookup writes: int32 (ExpertIds, what the routers take), int64 (torch's topk), or
// the narrow uint8 / uint16 of rollout engines (vLLM's routed_experts).
template <class Id>
inline constexpr bool is_lookup_id_v = std::is_same_v<Id, std::int32_t> || std::is_same_v<Id, std::int64_t> ||
                                       std::is_same_v<Id, std::uint16_t> || std::is_same_v<Id, std::uint8_t>;

// A lookup into Id needs every expert id of the shape to fit it (never a silent truncation).
template <class Id>
void require_ids_fit(const RouteShape& shape, const char* fn) {
  static_assert(is_lookup_id_v<Id>, "route lookups write int32, int64, uint16 or uint8 ids");
  if constexpr (sizeof(Id) < 4)
    require(std::int64_t{shape.num_experts} - 1 <= static_cast<std::int64_t>(std::numeric_limits<Id>::max()), fn,
            sizeof(Id) * 8, "-bit ids cannot hold the expert ids of ", shape.num_experts,
            " experts; look up into int32 ids");
}

}  // namespace detail

MRR_NAMESPACE_END
