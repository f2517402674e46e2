// The example's dense layers: attention and RMSNorm backward against central finite differences
// (in double-checked float: perturbations large enough for float, tolerances to match), the KV-cache
// decode against the full forward, bf16 rounding and AdamW against torch's update rule.
#include "layers.hpp"

#include "support/random.hpp"

#include <doctest/doctest.h>

#include <cmath>

using namespace moe_grpo;

namespace {

Mat rnd(Eigen::Index r, Eigen::Index c, unsigned seed, float sd = 1.f) { return mrr::test::random_normal<float>(r, c, seed, sd); }

// sum(f(x) * w) for a fixed random w: a scalar whose gradient w.r.t. f's output is w.
double contract(const Mat& y, const Mat& w) { return (y.cast<double>().array() * w.cast<double>().array()).sum(); }

}  // namespace

TEST_CASE("RMSNorm backward matches finite differences") {
  const Mat x = rnd(5, 8, 1);
  const RowVec g = rnd(1, 8, 2);
  const Mat w = rnd(5, 8, 3);
  Vec inv;
  RowVec dg = RowVec::Zero(8);
  RmsNorm::forward(x, g, inv);
  const Mat dx = RmsNorm::backward(x, g, inv, w, dg);
  const double h = 1e-2;
  const float hf = static_cast<float>(h);
  for (Eigen::Index i = 0; i < x.size(); ++i) {
    Mat p = x, m = x;
    p.data()[i] += hf;
    m.data()[i] -= hf;
    Vec tmp;
    const double num = (contract(RmsNorm::forward(p, g, tmp), w) - contract(RmsNorm::forward(m, g, tmp), w)) / (2 * h);
    CHECK(dx.data()[i] == doctest::Approx(num).epsilon(2e-3).scale(1.0));
  }
  for (Eigen::Index i = 0; i < g.size(); ++i) {
    RowVec p = g, m = g;
    p[i] += hf;
    m[i] -= hf;
    Vec tmp;
    const double num = (contract(RmsNorm::forward(x, p, tmp), w) - contract(RmsNorm::forward(x, m, tmp), w)) / (2 * h);
    CHECK(dg[i] == doctest::Approx(num).epsilon(2e-3).scale(1.0));
  }
}

TEST_CASE("Attention backward matches finite differences (inputs and every weight)") {
  const int heads = 2;
  const Mat x = rnd(6, 8, 4);
  AttentionWeights wt{rnd(8, 8, 5, 0.5f), rnd(8, 8, 6, 0.5f), rnd(8, 8, 7, 0.5f), rnd(8, 8, 8, 0.5f)};
  const Mat w = rnd(6, 8, 9);
  AttentionCache c;
  Attention::forward(x, wt, heads, c);
  AttentionWeights g{Mat::Zero(8, 8), Mat::Zero(8, 8), Mat::Zero(8, 8), Mat::Zero(8, 8)};
  const Mat dx = Attention::backward(x, wt, heads, c, w, g);
  const double h = 1e-2;
  const float hf = static_cast<float>(h);
  auto value = [&](const Mat& xx, const AttentionWeights& ww) {
    AttentionCache cc;
    return contract(Attention::forward(xx, ww, heads, cc), w);
  };
  for (Eigen::Index i = 0; i < x.size(); ++i) {
    Mat p = x, m = x;
    p.data()[i] += hf;
    m.data()[i] -= hf;
    CHECK(dx.data()[i] == doctest::Approx((value(p, wt) - value(m, wt)) / (2 * h)).epsilon(3e-3).scale(1.0));
  }
  Mat AttentionWeights::*members[4] = {&AttentionWeights::wq, &AttentionWeights::wk, &AttentionWeights::wv,
                                       &AttentionWeights::wo};
  for (auto member : members)
    for (Eigen::Index i = 0; i < 64; ++i) {
      AttentionWeights p = wt, m = wt;
      (p.*member).data()[i] += hf;
      (m.*member).data()[i] -= hf;
      CHECK((g.*member).data()[i] == doctest::Approx((value(x, p) - value(x, m)) / (2 * h)).epsilon(3e-3).scale(1.0));
    }
  // Causality: the output of row 2 does not depend on row 4.
  Mat x2 = x;
  x2.row(4).setRandom();
  AttentionCache c2;
  const Mat y1 = Attention::forward(x, wt, heads, c), y2 = Attention::forward(x2, wt, heads, c2);
  CHECK(y1.topRows(4) == y2.topRows(4));
  CHECK(y1.row(4) != y2.row(4));
}

TEST_CASE("Attention decode with a KV cache gives the full forward's rows (fp32)") {
  const int heads = 4;
  const Mat x = rnd(7, 16, 10);
  AttentionWeights wt{rnd(16, 16, 11, 0.3f), rnd(16, 16, 12, 0.3f), rnd(16, 16, 13, 0.3f), rnd(16, 16, 14, 0.3f)};
  AttentionCache c;
  const Mat full = Attention::forward(x, wt, heads, c);
  Mat kc(7, 16), vc(7, 16);
  for (Eigen::Index t = 0; t < 7; ++t) {
    const RowVec y = Attention::decode(x.row(t), wt, heads, kc, vc, t, false);
    CHECK((y - full.row(t)).cwiseAbs().maxCoeff() < 1e-5f);
  }
  // bf16 decoding differs from fp32 by more than rounding noise, but stays close.
  Mat kb(7, 16), vb(7, 16);
  double diff = 0;
  for (Eigen::Index t = 0; t < 7; ++t)
    diff = std::max(diff, static_cast<double>((Attention::decode(x.row(t), wt, heads, kb, vb, t, true) - full.row(t))
                                                  .cwiseAbs()
                                                  .maxCoeff()));
  CHECK(diff > 1e-5);
  CHECK(diff < 0.1);
}

TEST_CASE("bf16 rounding: nearest, ties to even") {
  CHECK(to_bf16(1.0f) == 1.0f);
  CHECK(to_bf16(1.0f + 1.0f / 256) == 1.0f);                // tie between 1 and 1+2^-7: even (1)
  CHECK(to_bf16(1.0f + 3.0f / 256) == 1.0f + 4.0f / 256);  // tie between 1+2^-7 and 1+2^-6: even
  CHECK(to_bf16(1.0f + 1.5f / 256) == 1.0f + 2.0f / 256);
  CHECK(to_bf16(-3.14159f) == -3.140625f);
}

TEST_CASE("fp8 e4m3 rounding: nearest, ties to even, subnormals, saturation") {
  CHECK(to_fp8_e4m3(1.0f) == 1.0f);
  CHECK(to_fp8_e4m3(1.0625f) == 1.0f);    // tie between 1 and 1.125 (spacing 2^-3): even (1)
  CHECK(to_fp8_e4m3(1.1875f) == 1.25f);   // tie between 1.125 and 1.25: even (1.25)
  CHECK(to_fp8_e4m3(1.2f) == 1.25f);
  CHECK(to_fp8_e4m3(-3.3f) == -3.25f);    // spacing 2^-2 in [2, 4)
  CHECK(to_fp8_e4m3(448.f) == 448.f);     // the largest finite e4m3
  CHECK(to_fp8_e4m3(1000.f) == 448.f);    // saturated
  CHECK(to_fp8_e4m3(-1000.f) == -448.f);
  CHECK(to_fp8_e4m3(0x1p-9f) == 0x1p-9f);            // the smallest subnormal
  CHECK(to_fp8_e4m3(0x1p-10f) == 0.0f);              // half of it: tie, to even (0)
  CHECK(to_fp8_e4m3(3 * 0x1p-10f) == 0x1p-8f);       // 1.5 quanta: tie, to even (2 quanta)
  CHECK(to_fp8_e4m3(0x1.4p-7f) == 0x1.4p-7f);        // 5 quanta of 2^-9, exactly representable
  // Blocks: each row's block of 128 is scaled so its largest magnitude maps to 448 exactly.
  Mat m(2, 130);
  for (Eigen::Index c = 0; c < m.cols(); ++c) m(0, c) = 0.01f * static_cast<float>(c + 1), m(1, c) = -0.5f;
  const Mat before = m;
  round_fp8_blocks(m);
  CHECK(m(0, 127) == before(0, 127));  // the block's amax is kept exactly
  CHECK(m(1, 5) == -0.5f);
  CHECK(m(0, 129) == before(0, 129));  // the second block [128, 130): its own scale, its amax exact
  float worst = 0;
  for (Eigen::Index c = 0; c < 128; ++c) worst = std::max(worst, std::fabs(m(0, c) - before(0, c)) / std::fabs(before(0, c)));
  CHECK(worst > 0);             // e4m3 keeps 3 mantissa bits: values move
  CHECK(worst <= 1.0f / 16);    // by at most half a spacing, 2^-4 relative
}

TEST_CASE("AdamW: torch's update") {
  AdamW opt;
  opt.lr = 0.1f;
  opt.weight_decay = 0.01f;
  Vec p(2);
  p << 1.0f, -2.0f;
  Vec g(2);
  g << 0.5f, -0.25f;
  opt.step(p, g);
  // Step 1: m_hat = g, v_hat = g^2, update = lr * g / (|g| + eps); decay first: p *= 1 - lr * wd.
  CHECK(p[0] == doctest::Approx(1.0 * (1 - 0.001) - 0.1 * 0.5 / (0.5 + 1e-8)).epsilon(1e-6));
  CHECK(p[1] == doctest::Approx(-2.0 * (1 - 0.001) + 0.1).epsilon(1e-6));
  opt.step(p, g);
  CHECK(opt.t == 2);
}
