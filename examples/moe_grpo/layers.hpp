// The dense pieces of the example's decoder, written for one sequence at a time so that every
// row's arithmetic is the same whatever batch or rank the sequence is in: RMSNorm, causal
// multi-head self-attention (with a key/value cache for decoding), bf16 rounding (the rollout
// engine's numerics) and AdamW. Forward and backward in Eigen; the backward passes are checked
// against finite differences in tests/flagship.
#pragma once

#include <mrr/tensor.hpp>

#include <Eigen/Core>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace moe_grpo {

using Mat = mrr::RowMatrix<float>;
using Vec = Eigen::VectorXf;
using RowVec = Eigen::RowVectorXf;
using MatMap = Eigen::Map<Mat>;
using ConstMatMap = Eigen::Map<const Mat>;

// Round to the nearest bfloat16 (ties to even), kept in a float: what a bf16 kernel stores.
inline float to_bf16(float x) {
  if (std::isnan(x)) return x;
  std::uint32_t u;
  std::memcpy(&u, &x, 4);
  u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&x, &u, 4);
  return x;
}

template <class Derived>
void round_bf16(Eigen::DenseBase<Derived>& m) {
  m = m.unaryExpr([](float v) { return to_bf16(v); });
}

// Round to the nearest fp8 e4m3 value (OCP FP8 E4M3, as H100 tensor cores read it: 3 mantissa
// bits, exponent bias 7, largest finite 448, subnormals down to 2^-9), ties to even, saturating at
// +-448 as fp8 GEMM recipes do. Kept in a float.
inline float to_fp8_e4m3(float x) {
  if (std::isnan(x)) return x;
  const float a = std::fabs(x);
  if (a >= 448.f) return std::copysign(448.f, x);
  if (a == 0.f) return x;
  int e = 0;
  std::frexp(a, &e);                     // a = m * 2^e, m in [0.5, 1): the leading bit is 2^(e-1)
  const int lead = e - 1 < -6 ? -6 : e - 1;  // below 2^-6 the spacing stays 2^-9 (subnormals)
  const float quantum = std::ldexp(1.f, lead - 3);
  return std::copysign(std::nearbyint(a / quantum) * quantum, x);  // default rounding: ties to even
}

// fp8 with per-block scales, as fp8 rollout engines quantise GEMM operands: each row is cut into
// blocks of `block` columns; a block is scaled so its largest magnitude maps to 448, rounded to
// e4m3, and scaled back (the GEMM then accumulates the dequantised values in fp32).
template <class Derived>
void round_fp8_blocks(Eigen::DenseBase<Derived>& m, Eigen::Index block = 128) {
  for (Eigen::Index r = 0; r < m.rows(); ++r)
    for (Eigen::Index c0 = 0; c0 < m.cols(); c0 += block) {
      const Eigen::Index n = std::min(block, m.cols() - c0);
      float amax = 0.f;
      for (Eigen::Index c = c0; c < c0 + n; ++c) amax = std::max(amax, std::fabs(static_cast<float>(m(r, c))));
      if (amax == 0.f || !std::isfinite(amax)) continue;
      const float scale = amax / 448.f;
      for (Eigen::Index c = c0; c < c0 + n; ++c) m(r, c) = to_fp8_e4m3(static_cast<float>(m(r, c)) / scale) * scale;
    }
}

// ---------------------------------------------------------------------------------------------
// RMSNorm: y = x / sqrt(mean(x^2) + eps) * g, row by row.
struct RmsNorm {
  static constexpr float kEps = 1e-5f;

  // Returns y; keeps 1/rms per row in inv_rms for the backward.
  static Mat forward(const Mat& x, const RowVec& g, Vec& inv_rms) {
    const auto n = static_cast<float>(x.cols());
    inv_rms.resize(x.rows());
    Mat y(x.rows(), x.cols());
    for (Eigen::Index r = 0; r < x.rows(); ++r) {
      inv_rms[r] = 1.0f / std::sqrt(x.row(r).squaredNorm() / n + kEps);
      y.row(r) = x.row(r).cwiseProduct(g) * inv_rms[r];
    }
    return y;
  }

  // dx for dy; adds d g into dg.
  static Mat backward(const Mat& x, const RowVec& g, const Vec& inv_rms, const Mat& dy, RowVec& dg) {
    const auto n = static_cast<float>(x.cols());
    Mat dx(x.rows(), x.cols());
    for (Eigen::Index r = 0; r < x.rows(); ++r) {
      const float s = inv_rms[r];
      const RowVec xhat = x.row(r) * s;
      dg += dy.row(r).cwiseProduct(xhat);
      const RowVec dxhat = dy.row(r).cwiseProduct(g);
      // d/dx of x*s with s = (mean x^2 + eps)^-1/2: s * (dxhat - xhat * mean(dxhat . xhat))
      const float proj = dxhat.dot(xhat) / n;
      dx.row(r) = s * (dxhat - xhat * proj);
    }
    return dx;
  }
};

// ---------------------------------------------------------------------------------------------
// Causal multi-head self-attention of one sequence [S, H]: q, k, v = x W{q,k,v}, per head
// softmax(q k^T / sqrt(d) + causal mask) v, out = concat(heads) Wo. Weights are [H, H] (x W).
struct AttentionWeights {
  Mat wq, wk, wv, wo;
};

struct AttentionCache {  // what the backward needs
  Mat q, k, v, ctx;
  std::vector<Mat> probs;  // per head [S, S]
};

struct Attention {
  static Mat forward(const Mat& x, const AttentionWeights& w, int heads, AttentionCache& c) {
    const Eigen::Index s = x.rows(), h = x.cols(), d = h / heads;
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    c.q = x * w.wq;
    c.k = x * w.wk;
    c.v = x * w.wv;
    c.ctx = Mat::Zero(s, h);
    c.probs.assign(static_cast<std::size_t>(heads), Mat::Zero(s, s));
    for (int hd = 0; hd < heads; ++hd) {
      Mat& p = c.probs[static_cast<std::size_t>(hd)];
      for (Eigen::Index i = 0; i < s; ++i) {
        float top = -std::numeric_limits<float>::infinity();
        for (Eigen::Index j = 0; j <= i; ++j) {
          p(i, j) = c.q.row(i).segment(hd * d, d).dot(c.k.row(j).segment(hd * d, d)) * scale;
          top = std::max(top, p(i, j));
        }
        float total = 0;
        for (Eigen::Index j = 0; j <= i; ++j) total += p(i, j) = std::exp(p(i, j) - top);
        for (Eigen::Index j = 0; j <= i; ++j) p(i, j) /= total;
        for (Eigen::Index j = 0; j <= i; ++j) c.ctx.row(i).segment(hd * d, d) += p(i, j) * c.v.row(j).segment(hd * d, d);
      }
    }
    return c.ctx * w.wo;
  }

  // dx for dy; adds the weight gradients into g.
  static Mat backward(const Mat& x, const AttentionWeights& w, int heads, const AttentionCache& c, const Mat& dy,
                      AttentionWeights& g) {
    const Eigen::Index s = x.rows(), h = x.cols(), d = h / heads;
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    g.wo.noalias() += c.ctx.transpose() * dy;
    const Mat dctx = dy * w.wo.transpose();
    Mat dq = Mat::Zero(s, h), dk = Mat::Zero(s, h), dv = Mat::Zero(s, h);
    for (int hd = 0; hd < heads; ++hd) {
      const Mat& p = c.probs[static_cast<std::size_t>(hd)];
      for (Eigen::Index i = 0; i < s; ++i) {
        // dp_ij = dctx_i . v_j; dscore_ij = p_ij (dp_ij - sum_l p_il dp_il)
        std::vector<float> dp(static_cast<std::size_t>(i + 1));
        float weighted = 0;
        for (Eigen::Index j = 0; j <= i; ++j) {
          dp[static_cast<std::size_t>(j)] = dctx.row(i).segment(hd * d, d).dot(c.v.row(j).segment(hd * d, d));
          weighted += p(i, j) * dp[static_cast<std::size_t>(j)];
          dv.row(j).segment(hd * d, d) += p(i, j) * dctx.row(i).segment(hd * d, d);
        }
        for (Eigen::Index j = 0; j <= i; ++j) {
          const float ds = p(i, j) * (dp[static_cast<std::size_t>(j)] - weighted) * scale;
          dq.row(i).segment(hd * d, d) += ds * c.k.row(j).segment(hd * d, d);
          dk.row(j).segment(hd * d, d) += ds * c.q.row(i).segment(hd * d, d);
        }
      }
    }
    g.wq.noalias() += x.transpose() * dq;
    g.wk.noalias() += x.transpose() * dk;
    g.wv.noalias() += x.transpose() * dv;
    Mat dx = dq * w.wq.transpose();
    dx.noalias() += dk * w.wk.transpose();
    dx.noalias() += dv * w.wv.transpose();
    return dx;
  }

  // One decoding step: the new token's row x [1, H] attends to the cached keys and values of the
  // earlier positions (the cache grows by one row). bf16: round q, k, v and the output as a bf16
  // kernel would.
  static RowVec decode(const RowVec& x, const AttentionWeights& w, int heads, Mat& k_cache, Mat& v_cache,
                       Eigen::Index length, bool bf16) {
    const Eigen::Index h = x.size(), d = h / heads;
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    RowVec q = x * w.wq, k = x * w.wk, v = x * w.wv;
    if (bf16) {
      round_bf16(q);
      round_bf16(k);
      round_bf16(v);
    }
    k_cache.row(length) = k;
    v_cache.row(length) = v;
    RowVec ctx = RowVec::Zero(h);
    std::vector<float> p(static_cast<std::size_t>(length + 1));
    for (int hd = 0; hd < heads; ++hd) {
      float top = -std::numeric_limits<float>::infinity();
      for (Eigen::Index j = 0; j <= length; ++j) {
        p[static_cast<std::size_t>(j)] = q.segment(hd * d, d).dot(k_cache.row(j).segment(hd * d, d)) * scale;
        top = std::max(top, p[static_cast<std::size_t>(j)]);
      }
      float total = 0;
      for (Eigen::Index j = 0; j <= length; ++j) total += p[static_cast<std::size_t>(j)] = std::exp(p[static_cast<std::size_t>(j)] - top);
      for (Eigen::Index j = 0; j <= length; ++j)
        ctx.segment(hd * d, d) += (p[static_cast<std::size_t>(j)] / total) * v_cache.row(j).segment(hd * d, d);
    }
    if (bf16) round_bf16(ctx);
    RowVec out = ctx * w.wo;
    if (bf16) round_bf16(out);
    return out;
  }
};

// ---------------------------------------------------------------------------------------------
// AdamW (decoupled weight decay, torch.optim.AdamW's update) over a flat parameter vector.
struct AdamW {
  float lr = 1e-3f, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, weight_decay = 0.0f;
  Vec m, v;
  int t = 0;

  void step(Eigen::Ref<Vec> params, const Eigen::Ref<const Vec>& grad) {
    if (m.size() != params.size()) {
      m = Vec::Zero(params.size());
      v = Vec::Zero(params.size());
    }
    ++t;
    const float bc1 = 1.0f - std::pow(beta1, static_cast<float>(t));
    const float bc2 = 1.0f - std::pow(beta2, static_cast<float>(t));
    for (Eigen::Index i = 0; i < params.size(); ++i) {
      params[i] *= 1.0f - lr * weight_decay;
      m[i] = beta1 * m[i] + (1.0f - beta1) * grad[i];
      v[i] = beta2 * v[i] + (1.0f - beta2) * grad[i] * grad[i];
      params[i] -= lr * (m[i] / bc1) / (std::sqrt(v[i] / bc2) + eps);
    }
  }
};

}  // namespace moe_grpo
