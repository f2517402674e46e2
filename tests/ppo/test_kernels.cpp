// Row kernels of the PPO paths. The float32 exp of detail/vexp.hpp and the float k3 KL kernel
// built on it: within 1 ulp of the correctly rounded exp (a sample of all floats; the whole range
// was checked once), exact at the k3 clamp bounds, and, where the AVX2 variants are compiled and
// the CPU has AVX2, bit-identical to the portable variants (no FMA contraction in either). GAE's
// tile transposes against plain loops, on ragged shapes.
#include <mrr/detail/vexp.hpp>
#include <mrr/ppo/advantage.hpp>
#include <mrr/ppo/kl.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

namespace {

std::int64_t ulp_distance(float a, float b) {
  if (a == b) return 0;
  const auto ia = static_cast<std::int64_t>(std::bit_cast<std::int32_t>(a));
  const auto ib = static_cast<std::int64_t>(std::bit_cast<std::int32_t>(b));
  return std::llabs(ia - ib);
}

// Every 61st float in [-105, 90] (about 35M of them) and the boundaries.
std::vector<float> sample_inputs() {
  std::vector<float> xs;
  for (std::uint32_t b = 0; b <= std::bit_cast<std::uint32_t>(90.0f); b += 61)
    xs.push_back(std::bit_cast<float>(b));
  for (std::uint32_t b = 0x80000000u; b <= std::bit_cast<std::uint32_t>(-105.0f); b += 61)
    xs.push_back(std::bit_cast<float>(b));
  for (float x : {20.0f, -20.0f, 88.72283f, 88.72284f, -87.33654f, -103.97f, -103.98f, 0.0f, -0.0f})
    xs.push_back(x);
  return xs;
}

}  // namespace

TEST_CASE("exp_float: within 1 ulp of exp over the float range, exact at +-20, inf/0/NaN at the ends") {
  const auto xs = sample_inputs();
  std::vector<float> y(xs.size());
  mrr::detail::exp_float_span(xs.data(), y.data(), static_cast<std::int64_t>(xs.size()));
  std::int64_t worst = 0;
  float worst_x = 0;
  for (std::size_t i = 0; i < xs.size(); ++i) {
    const auto d = ulp_distance(y[i], static_cast<float>(std::exp(static_cast<double>(xs[i]))));
    if (d > worst) worst = d, worst_x = xs[i];
  }
  INFO("worst at x = ", worst_x);
  CHECK(worst <= 1);
  for (float x : {20.0f, -20.0f})
    CHECK(mrr::detail::exp_float(x) == static_cast<float>(std::exp(static_cast<double>(x))));
  constexpr float inf = std::numeric_limits<float>::infinity();
  CHECK(mrr::detail::exp_float(inf) == inf);
  CHECK(mrr::detail::exp_float(1000.0f) == inf);
  CHECK(mrr::detail::exp_float(-inf) == 0.0f);
  CHECK(mrr::detail::exp_float(-1000.0f) == 0.0f);
  CHECK(std::isnan(mrr::detail::exp_float(std::numeric_limits<float>::quiet_NaN())));
}

#if MRR_VEXP_AVX2
TEST_CASE("exp_float and float k3: the AVX2 variants give the portable variants' bits") {
  if (!__builtin_cpu_supports("avx2")) return;
  const auto xs = sample_inputs();
  const auto n = static_cast<std::int64_t>(xs.size());
  std::vector<float> portable(xs.size()), avx2(xs.size());
  mrr::detail::exp_float_span_portable(xs.data(), portable.data(), n);
  mrr::detail::exp_float_span_avx2(xs.data(), avx2.data(), n);
  CHECK(std::memcmp(portable.data(), avx2.data(), xs.size() * sizeof(float)) == 0);

  // k3 on log-ratios across and beyond the clamp, NaN and inf included.
  std::mt19937 gen(7);
  std::normal_distribution<float> normal(0.0f, 12.0f);
  const std::int64_t m = 100003;
  std::vector<float> lp(m), ref(m);
  for (std::int64_t j = 0; j < m; ++j)
    lp[j] = normal(gen), ref[j] = normal(gen);
  lp[0] = std::numeric_limits<float>::quiet_NaN(), ref[1] = std::numeric_limits<float>::infinity();
  ref[2] = lp[2] + 20.0f, ref[3] = lp[3] - 20.0f;
  std::vector<float> v0(m), g0(m), v1(m), g1(m), v2(m), v3(m);
  mrr::ppo::detail::kl_k3_float_portable<true>(lp.data(), ref.data(), v0.data(), g0.data(), m);
  mrr::ppo::detail::kl_k3_float_avx2<true>(lp.data(), ref.data(), v1.data(), g1.data(), m);
  mrr::ppo::detail::kl_k3_float_portable<false>(lp.data(), ref.data(), v2.data(), nullptr, m);
  mrr::ppo::detail::kl_k3_float_avx2<false>(lp.data(), ref.data(), v3.data(), nullptr, m);
  CHECK(std::memcmp(v0.data(), v1.data(), m * sizeof(float)) == 0);
  CHECK(std::memcmp(g0.data(), g1.data(), m * sizeof(float)) == 0);
  CHECK(std::memcmp(v0.data(), v2.data(), m * sizeof(float)) == 0);
  CHECK(std::memcmp(v0.data(), v3.data(), m * sizeof(float)) == 0);
}
#endif

TEST_CASE("float k3 kernel agrees with kl_element (values within 2 ulp-ish, same gradient mask, NaN kept)") {
  std::mt19937 gen(11);
  std::normal_distribution<float> normal(0.0f, 12.0f);
  const std::int64_t m = 20011;
  std::vector<float> lp(m), ref(m), v(m), g(m);
  for (std::int64_t j = 0; j < m; ++j)
    lp[j] = normal(gen), ref[j] = normal(gen);
  lp[5] = std::numeric_limits<float>::quiet_NaN();
  ref[6] = lp[6] + 20.0f, ref[7] = lp[7] - 20.0f;
  mrr::ppo::detail::kl_k3_float(lp.data(), ref.data(), v.data(), g.data(), m);
  for (std::int64_t j = 0; j < m; ++j) {
    const auto e = mrr::ppo::detail::kl_element(lp[j], ref[j], mrr::ppo::KlEstimator::k3);
    if (std::isnan(e.value)) {
      CHECK(std::isnan(v[j]));
      CHECK(g[j] == 0.0f);
      continue;
    }
    CHECK(v[j] == doctest::Approx(e.value).epsilon(1e-6));
    CHECK(g[j] == doctest::Approx(e.grad).epsilon(1e-6));
    CHECK((g[j] == 0.0f) == (e.grad == 0.0f));
  }
}

TEST_CASE_TEMPLATE("GAE tile transposes: gather and scatter equal plain loops on ragged shapes", T, float, double) {
  constexpr int R = 8;
  using Transpose = mrr::ppo::detail::TileTranspose<T, R>;
  const Eigen::Index stride = 37;
  std::vector<T> src(static_cast<std::size_t>(R * stride)), tile(static_cast<std::size_t>(R * stride));
  for (std::size_t i = 0; i < src.size(); ++i)
    src[i] = static_cast<T>(i) + T(0.25);
  for (Eigen::Index rows : {1, 3, 4, 5, 8})
    for (Eigen::Index n : {1, 2, 3, 7, 8, 33, 37}) {
      std::fill(tile.begin(), tile.end(), T(-1));
      Transpose::gather(tile.data(), src.data(), stride, rows, n);
      bool gathered = true;
      for (Eigen::Index k = 0; k < R; ++k)
        for (Eigen::Index j = 0; j < n; ++j)
          gathered &= tile[static_cast<std::size_t>(j * R + k)] ==
                      (k < rows ? src[static_cast<std::size_t>(k * stride + j)] : T(0));
      CHECK(gathered);
      std::vector<T> back(src.size(), T(-1));
      Transpose::scatter(back.data(), stride, tile.data(), rows, n);
      bool scattered = true;
      for (Eigen::Index k = 0; k < R; ++k)
        for (Eigen::Index j = 0; j < stride; ++j)
          scattered &= back[static_cast<std::size_t>(k * stride + j)] ==
                       (k < rows && j < n ? src[static_cast<std::size_t>(k * stride + j)] : T(-1));
      CHECK(scattered);
    }
}
