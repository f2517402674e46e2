// A counter-based generator: bits(seed, stream, counter) is a pure function (SplitMix64's
// finaliser over the three keys), so draws need no shared state between threads or ranks.
#pragma once

#include <mrr/detail/config.hpp>

#include <cstdint>

MRR_NAMESPACE_BEGIN
namespace detail {

struct CounterRng {
  static constexpr std::uint64_t mix(std::uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
  }
  static constexpr std::uint64_t bits(std::uint64_t seed, std::uint64_t stream, std::uint64_t counter) {
    return mix(mix(mix(seed) ^ stream) ^ counter);
  }
  // In [0, 1), 53 random bits.
  static constexpr double uniform(std::uint64_t seed, std::uint64_t stream, std::uint64_t counter) {
    return static_cast<double>(bits(seed, stream, counter) >> 11) * 0x1.0p-53;
  }
};

}  // namespace detail
MRR_NAMESPACE_END
