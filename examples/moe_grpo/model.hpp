// The policy: a small decoder-only MoE transformer. Token + position embeddings, `layers` blocks of
// [RMSNorm -> causal self-attention -> RMSNorm -> mrr::MoELayer (SwiGLU experts, Qwen3-MoE gate)],
// final RMSNorm, output head. Dense parts run one sequence at a time (the same arithmetic in any
// batch or rank); the MoE layers run on all of a rank's tokens at once and exchange them with
// the ranks that own the experts.
//
// Engine<Comm> is one instance of the model's numerics: the training engine (fp32), the reference
// policy, or the rollout engine (weights and activations rounded to bf16, one token at a time
// with a key/value cache, as vLLM decodes). Parameters live outside, in Params, and are loaded
// into an engine (the rollout's "weight sync").
#pragma once

#include "layers.hpp"
#include "store.hpp"
#include "task.hpp"

#include <mrr/moe/moe_layer.hpp>
#include <mrr/moe/swiglu_experts.hpp>
#include <mrr/replay/routing_replay.hpp>
#include <mrr/router/presets.hpp>
#include <mrr/router/topk_router.hpp>
#include <mrr/rollout/sampling.hpp>

#include <cstdint>
#include <random>
#include <span>
#include <vector>

namespace moe_grpo {

struct ModelConfig {
  int vocab = kVocab;
  int hidden = 64;
  int heads = 4;
  int layers = 2;
  int max_seq = 10;  // prompt + response
  int experts = 16;
  int topk = 4;
  int expert_hidden = 64;
  float init_std = 0.05f;
};

// Offsets of every replicated tensor in one flat vector (gates included: they are replicated).
struct DenseLayout {
  struct Layer {
    Eigen::Index norm1, wq, wk, wv, wo, norm2, gate;
  };
  Eigen::Index tok_emb = 0, pos_emb = 0, final_norm = 0, head = 0, size = 0;
  std::vector<Layer> layer;

  explicit DenseLayout(const ModelConfig& c) {
    const Eigen::Index h = c.hidden;
    Eigen::Index at = 0;
    const auto take = [&](Eigen::Index n) {
      const Eigen::Index o = at;
      at += n;
      return o;
    };
    tok_emb = take(c.vocab * h);
    pos_emb = take(c.max_seq * h);
    for (int l = 0; l < c.layers; ++l)
      layer.push_back({take(h), take(h * h), take(h * h), take(h * h), take(h * h), take(h), take(c.experts * h)});
    final_norm = take(h);
    head = take(h * c.vocab);
    size = at;
  }
};

// A rank's parameters: replicated (identical on every rank) and its block of experts, per layer
// per local expert w_gate [I, H], w_up [I, H], w_down [H, I].
struct Params {
  Vec dense;
  Vec experts;
};

inline Eigen::Index expert_block_size(const ModelConfig& c) {
  return 3 * static_cast<Eigen::Index>(c.expert_hidden) * c.hidden;
}

// Parameters of the whole model (DenseLayout's replicated ones and every expert of every layer),
// in double: it bounds the sizes before they are known to fit an index (test_flagship_options
// checks it against DenseLayout and expert_block_size).
inline double parameter_count(const ModelConfig& c) {
  const double h = c.hidden, experts = c.experts;
  const double per_layer = 2 * h + 4 * h * h + experts * h + experts * 3 * c.expert_hidden * h;
  return (c.vocab + c.max_seq) * h + c.layers * per_layer + h + h * c.vocab;
}

// Initialised from the seed tensor by tensor, so every rank (and any number of ranks) holds the
// same values: expert e of layer l is drawn from its own stream whichever rank owns it.
inline Params init_params(const ModelConfig& c, std::uint64_t seed, int first_expert, int local_experts) {
  const DenseLayout layout(c);
  Params p;
  p.dense = Vec::Zero(layout.size);
  auto fill = [&](float* out, Eigen::Index n, std::uint64_t stream, float sd) {
    std::mt19937_64 rng(mrr::rollout::CounterRng::bits(seed, stream, 0));
    std::normal_distribution<float> normal(0.f, sd);
    for (Eigen::Index i = 0; i < n; ++i) out[i] = normal(rng);
  };
  const float sd = c.init_std;
  const Eigen::Index h = c.hidden;
  fill(p.dense.data() + layout.tok_emb, c.vocab * h, 1, 1.0f);
  fill(p.dense.data() + layout.pos_emb, c.max_seq * h, 2, 0.5f);
  for (int l = 0; l < c.layers; ++l) {
    const auto& L = layout.layer[static_cast<std::size_t>(l)];
    p.dense.segment(L.norm1, h).setOnes();
    p.dense.segment(L.norm2, h).setOnes();
    const float proj_sd = 1.0f / std::sqrt(static_cast<float>(h));
    fill(p.dense.data() + L.wq, h * h, 100 + 10 * l, proj_sd);
    fill(p.dense.data() + L.wk, h * h, 101 + 10 * l, proj_sd);
    fill(p.dense.data() + L.wv, h * h, 102 + 10 * l, proj_sd);
    fill(p.dense.data() + L.wo, h * h, 103 + 10 * l, proj_sd * 0.5f);
    fill(p.dense.data() + L.gate, c.experts * h, 104 + 10 * l, proj_sd);
  }
  p.dense.segment(layout.final_norm, h).setOnes();
  fill(p.dense.data() + layout.head, h * c.vocab, 3, sd);
  const Eigen::Index block = expert_block_size(c);
  p.experts = Vec::Zero(block * local_experts * c.layers);
  for (int l = 0; l < c.layers; ++l)
    for (int e = 0; e < local_experts; ++e) {
      float* out = p.experts.data() + (static_cast<Eigen::Index>(l) * local_experts + e) * block;
      const Eigen::Index ih = static_cast<Eigen::Index>(c.expert_hidden) * h;
      const std::uint64_t stream = 1000 + static_cast<std::uint64_t>(l) * 1000 + static_cast<std::uint64_t>(first_expert + e);
      fill(out, 2 * ih, stream, 1.0f / std::sqrt(static_cast<float>(h)));
      fill(out + 2 * ih, ih, stream + 500, 0.5f / std::sqrt(static_cast<float>(c.expert_hidden)));
    }
  return p;
}

// What a training-style forward keeps for its backward.
template <class Forward>
struct SequenceBatchCache {
  struct Seq {
    std::vector<Mat> x_in, h1, x_mid, h2;  // per layer: block input, norm1 out, residual after attention, norm2 out
    std::vector<Vec> inv1, inv2;
    std::vector<AttentionCache> att;
    Mat x_out, hf;
    Vec invf;
  };
  std::vector<Seq> seqs;
  std::vector<Forward> moe;  // per layer
};

template <class Comm>
class Engine {
 public:
  using Router = mrr::TopKRouter<float>;
  using Experts = mrr::SwiGLUExperts<float>;
  using Moe = mrr::MoELayer<Router, Experts, Comm, AnyRouteStore>;
  using MoeForward = typename Moe::Forward;
  using Cache = SequenceBatchCache<MoeForward>;

  Engine(const ModelConfig& config, Comm comm, AnyRouteStore& store, mrr::ReplayMode mode, bool bf16, bool fp8 = false)
      : config_(config), layout_(config), comm_(comm), replay_(mode, store), bf16_(bf16 || fp8), fp8_(fp8) {
    const int ranks = static_cast<int>(comm.size());
    const int per_rank = config.experts / ranks;
    first_expert_ = per_rank * static_cast<int>(comm.rank());
    local_experts_ = per_rank;
    for (int l = 0; l < config.layers; ++l)
      moe_.emplace_back(Router(mrr::presets::qwen3_moe(config.experts, config.topk)),
                        Experts(config.hidden, config.expert_hidden, per_rank, first_expert_), comm, replay_, l);
    // The experts' intermediate rows (down_proj's input) in the engine's precision: bf16, or fp8
    // with per-block scales, as fp8 engines quantise every MoE GEMM's input.
    using Rows = Eigen::Ref<mrr::RowMatrix<float>>;
    if (bf16_)
      for (auto& moe : moe_)
        moe.experts().set_intermediate_rounding(fp8_
                                                    ? Experts::IntermediateRounding([](Rows a) { round_fp8_blocks(a); })
                                                    : Experts::IntermediateRounding([](Rows a) { round_bf16(a); }));
    attention_.resize(static_cast<std::size_t>(config.layers));
  }

  const ModelConfig& config() const { return config_; }
  const DenseLayout& layout() const { return layout_; }
  mrr::RoutingReplay<AnyRouteStore>& replay() { return replay_; }
  int first_expert() const { return first_expert_; }
  int local_experts() const { return local_experts_; }
  bool bf16() const { return bf16_; }

  // Weight sync: copies the parameters in (rounded to bf16 for a bf16 engine).
  void load(const Params& p) {
    dense_ = p.dense;
    Vec experts = p.experts;
    if (bf16_) {
      round_bf16(dense_);
      round_bf16(experts);
    }
    if (fp8_) {  // the MoE GEMMs' weights: every expert matrix row, and the gate [E, H], in 128-blocks
      for (int l = 0; l < config_.layers; ++l) {
        MatMap gate(dense_.data() + layout_.layer[static_cast<std::size_t>(l)].gate, config_.experts, config_.hidden);
        round_fp8_blocks(gate);
      }
      const Eigen::Index ih = static_cast<Eigen::Index>(config_.expert_hidden) * config_.hidden;
      for (Eigen::Index at = 0; at + expert_block_size(config_) <= experts.size(); at += expert_block_size(config_)) {
        MatMap w1(experts.data() + at, config_.expert_hidden, config_.hidden), w3(experts.data() + at + ih, config_.expert_hidden, config_.hidden);
        MatMap w2(experts.data() + at + 2 * ih, config_.hidden, config_.expert_hidden);
        round_fp8_blocks(w1);
        round_fp8_blocks(w3);
        round_fp8_blocks(w2);
      }
    }
    const Eigen::Index h = config_.hidden, ih = static_cast<Eigen::Index>(config_.expert_hidden) * h;
    for (int l = 0; l < config_.layers; ++l) {
      const auto& L = layout_.layer[static_cast<std::size_t>(l)];
      auto& a = attention_[static_cast<std::size_t>(l)];
      a.wq = ConstMatMap(dense_.data() + L.wq, h, h);
      a.wk = ConstMatMap(dense_.data() + L.wk, h, h);
      a.wv = ConstMatMap(dense_.data() + L.wv, h, h);
      a.wo = ConstMatMap(dense_.data() + L.wo, h, h);
      auto& moe = moe_[static_cast<std::size_t>(l)];
      moe.set_gate_weight(ConstMatMap(dense_.data() + L.gate, config_.experts, h));
      for (int e = 0; e < local_experts_; ++e) {
        const float* w = experts.data() + (static_cast<Eigen::Index>(l) * local_experts_ + e) * expert_block_size(config_);
        moe.experts().set_expert(first_expert_ + e, ConstMatMap(w, config_.expert_hidden, h),
                                 ConstMatMap(w + ih, config_.expert_hidden, h), ConstMatMap(w + 2 * ih, h, config_.expert_hidden));
      }
    }
  }

  // ---------------------------------------------------------------------------------------------
  // Training numerics: whole sequences [n, max_seq] (right-padded; a sequence's real tokens are
  // its first lengths[i]). Routes go through the replay controller, whose pass the caller sets.
  // Returns per sequence the logits [max_seq, vocab]; `routes` gets, per layer, the ids used for
  // the rows of the layout (sequence-major).
  std::vector<Mat> forward(std::span<const std::vector<std::int32_t>> tokens, std::span<const int> lengths,
                           std::span<const mrr::SequenceId> uids, Cache& cache, std::vector<mrr::ExpertIds>* routes) {
    const int n = static_cast<int>(tokens.size());
    const Eigen::Index s = config_.max_seq, h = config_.hidden;
    mrr::RowMatrix<std::uint8_t> attention_mask = mrr::RowMatrix<std::uint8_t>::Zero(n, s);
    for (int i = 0; i < n; ++i) attention_mask.row(i).head(lengths[static_cast<std::size_t>(i)]).setOnes();
    replay_.set_micro_batch(mrr::TokenLayout::padded(uids, attention_mask));
    cache.seqs.assign(static_cast<std::size_t>(n), {});
    cache.moe.clear();
    std::vector<Mat> x(static_cast<std::size_t>(n));
    for (int i = 0; i < n; ++i) {
      Mat& xi = x[static_cast<std::size_t>(i)];
      xi.resize(s, h);
      for (Eigen::Index t = 0; t < s; ++t)
        xi.row(t) = dense_row(layout_.tok_emb, tokens[static_cast<std::size_t>(i)][static_cast<std::size_t>(t)]) +
                    dense_row(layout_.pos_emb, static_cast<int>(t));
    }
    if (routes) routes->clear();
    for (int l = 0; l < config_.layers; ++l) {
      const auto& L = layout_.layer[static_cast<std::size_t>(l)];
      Mat stacked(static_cast<Eigen::Index>(n) * s, h);
      for (int i = 0; i < n; ++i) {
        auto& c = cache.seqs[static_cast<std::size_t>(i)];
        Mat& xi = x[static_cast<std::size_t>(i)];
        c.x_in.push_back(xi);
        c.inv1.emplace_back();
        c.h1.push_back(RmsNorm::forward(xi, norm(L.norm1), c.inv1.back()));
        c.att.emplace_back();
        xi += Attention::forward(c.h1.back(), attention_[static_cast<std::size_t>(l)], config_.heads, c.att.back());
        c.x_mid.push_back(xi);
        c.inv2.emplace_back();
        c.h2.push_back(RmsNorm::forward(xi, norm(L.norm2), c.inv2.back()));
        stacked.middleRows(static_cast<Eigen::Index>(i) * s, s) = c.h2.back();
      }
      cache.moe.push_back(moe_[static_cast<std::size_t>(l)].forward(stacked));
      if (routes) routes->push_back(cache.moe.back().routing.ids);
      for (int i = 0; i < n; ++i) x[static_cast<std::size_t>(i)] += cache.moe.back().output.middleRows(static_cast<Eigen::Index>(i) * s, s);
    }
    std::vector<Mat> logits(static_cast<std::size_t>(n));
    const ConstMatMap head(dense_.data() + layout_.head, h, config_.vocab);
    for (int i = 0; i < n; ++i) {
      auto& c = cache.seqs[static_cast<std::size_t>(i)];
      c.x_out = x[static_cast<std::size_t>(i)];
      c.hf = RmsNorm::forward(c.x_out, norm(layout_.final_norm), c.invf);
      logits[static_cast<std::size_t>(i)] = c.hf * head;
    }
    return logits;
  }

  struct Gradients {
    std::vector<Vec> dense_per_sequence;  // replicated parameters, one gradient per sequence (gates excluded)
    Vec gates;                            // the gates' gradient over the global batch (same on every rank)
    Vec experts;                          // this rank's experts
  };

  // Backward of sum_i <dlogits[i], logits[i]> through the forward that filled `cache`.
  Gradients backward(std::span<const std::vector<std::int32_t>> tokens, Cache& cache, const std::vector<Mat>& dlogits) {
    const int n = static_cast<int>(tokens.size());
    const Eigen::Index s = config_.max_seq, h = config_.hidden;
    Gradients g;
    g.dense_per_sequence.assign(static_cast<std::size_t>(n), Vec::Zero(layout_.size));
    g.gates = Vec::Zero(layout_.size);
    g.experts = Vec::Zero(expert_block_size(config_) * local_experts_ * config_.layers);
    const ConstMatMap head(dense_.data() + layout_.head, h, config_.vocab);
    std::vector<Mat> dx(static_cast<std::size_t>(n));
    for (int i = 0; i < n; ++i) {
      auto& c = cache.seqs[static_cast<std::size_t>(i)];
      Vec& gi = g.dense_per_sequence[static_cast<std::size_t>(i)];
      const Mat& dl = dlogits[static_cast<std::size_t>(i)];
      MatMap(gi.data() + layout_.head, h, config_.vocab).noalias() += c.hf.transpose() * dl;
      const Mat dhf = dl * head.transpose();
      RowVec dg = RowVec::Zero(h);
      dx[static_cast<std::size_t>(i)] = RmsNorm::backward(c.x_out, norm(layout_.final_norm), c.invf, dhf, dg);
      gi.segment(layout_.final_norm, h) += dg.transpose();
    }
    for (int l = config_.layers - 1; l >= 0; --l) {
      const auto& L = layout_.layer[static_cast<std::size_t>(l)];
      Mat stacked(static_cast<Eigen::Index>(n) * s, h);
      for (int i = 0; i < n; ++i) stacked.middleRows(static_cast<Eigen::Index>(i) * s, s) = dx[static_cast<std::size_t>(i)];
      auto mg = moe_[static_cast<std::size_t>(l)].backward(cache.moe[static_cast<std::size_t>(l)], stacked);
      g.gates.segment(L.gate, static_cast<Eigen::Index>(config_.experts) * h) =
          Eigen::Map<const Vec>(mg.gate_weight.data(), mg.gate_weight.size());
      for (int e = 0; e < local_experts_; ++e) {
        float* w = g.experts.data() + (static_cast<Eigen::Index>(l) * local_experts_ + e) * expert_block_size(config_);
        const Eigen::Index ih = static_cast<Eigen::Index>(config_.expert_hidden) * h;
        const auto ue = static_cast<std::size_t>(e);
        Eigen::Map<Vec>(w, ih) = Eigen::Map<const Vec>(mg.experts.w_gate[ue].data(), ih);
        Eigen::Map<Vec>(w + ih, ih) = Eigen::Map<const Vec>(mg.experts.w_up[ue].data(), ih);
        Eigen::Map<Vec>(w + 2 * ih, ih) = Eigen::Map<const Vec>(mg.experts.w_down[ue].data(), ih);
      }
      for (int i = 0; i < n; ++i) {
        auto& c = cache.seqs[static_cast<std::size_t>(i)];
        Vec& gi = g.dense_per_sequence[static_cast<std::size_t>(i)];
        const auto ul = static_cast<std::size_t>(l);
        RowVec dg2 = RowVec::Zero(h), dg1 = RowVec::Zero(h);
        Mat& d = dx[static_cast<std::size_t>(i)];
        d += RmsNorm::backward(c.x_mid[ul], norm(L.norm2), c.inv2[ul], mg.input.middleRows(static_cast<Eigen::Index>(i) * s, s), dg2);
        AttentionWeights ga{Mat::Zero(h, h), Mat::Zero(h, h), Mat::Zero(h, h), Mat::Zero(h, h)};
        const Mat dh1 = Attention::backward(c.h1[ul], attention_[ul], config_.heads, c.att[ul], d, ga);
        d += RmsNorm::backward(c.x_in[ul], norm(L.norm1), c.inv1[ul], dh1, dg1);
        gi.segment(L.norm1, h) += dg1.transpose();
        gi.segment(L.norm2, h) += dg2.transpose();
        Eigen::Map<Vec>(gi.data() + L.wq, h * h) += Eigen::Map<const Vec>(ga.wq.data(), h * h);
        Eigen::Map<Vec>(gi.data() + L.wk, h * h) += Eigen::Map<const Vec>(ga.wk.data(), h * h);
        Eigen::Map<Vec>(gi.data() + L.wv, h * h) += Eigen::Map<const Vec>(ga.wv.data(), h * h);
        Eigen::Map<Vec>(gi.data() + L.wo, h * h) += Eigen::Map<const Vec>(ga.wo.data(), h * h);
      }
    }
    for (int i = 0; i < n; ++i) {
      Vec& gi = g.dense_per_sequence[static_cast<std::size_t>(i)];
      const Mat& d = dx[static_cast<std::size_t>(i)];
      for (Eigen::Index t = 0; t < s; ++t) {
        gi.segment(layout_.tok_emb + tokens[static_cast<std::size_t>(i)][static_cast<std::size_t>(t)] * h, h) += d.row(t).transpose();
        gi.segment(layout_.pos_emb + t * h, h) += d.row(t).transpose();
      }
    }
    return g;
  }

  // ---------------------------------------------------------------------------------------------
  // Rollout numerics: one decoding step. Feeds token tokens[i][position] of every sequence in
  // `active` (its earlier positions are in the caches) and returns its next-token logits
  // [active, vocab]. Routes go through the replay controller (the rollout records them).
  struct DecodeState {
    std::vector<std::vector<Mat>> k_cache, v_cache;  // [sequence][layer] [max_seq, hidden]
  };

  DecodeState start_decoding(int sequences) const {
    DecodeState st;
    st.k_cache.assign(static_cast<std::size_t>(sequences),
                      std::vector<Mat>(static_cast<std::size_t>(config_.layers), Mat::Zero(config_.max_seq, config_.hidden)));
    st.v_cache = st.k_cache;
    return st;
  }

  Mat decode(std::span<const std::vector<std::int32_t>> tokens, std::span<const mrr::SequenceId> uids,
             std::span<const int> active, int position, DecodeState& st, std::vector<mrr::ExpertIds>* routes) {
    const Eigen::Index h = config_.hidden;
    const auto n = static_cast<Eigen::Index>(active.size());
    std::vector<mrr::TokenKey> keys;
    for (const int i : active) keys.push_back({uids[static_cast<std::size_t>(i)], position});
    replay_.set_micro_batch(mrr::TokenLayout(keys));
    Mat x(n, h);
    for (Eigen::Index r = 0; r < n; ++r)
      x.row(r) = dense_row(layout_.tok_emb, tokens[static_cast<std::size_t>(active[static_cast<std::size_t>(r)])][static_cast<std::size_t>(position)]) +
                 dense_row(layout_.pos_emb, position);
    round_if(x);
    if (routes) routes->clear();
    for (int l = 0; l < config_.layers; ++l) {
      const auto& L = layout_.layer[static_cast<std::size_t>(l)];
      const auto ul = static_cast<std::size_t>(l);
      Vec inv;
      Mat h1 = RmsNorm::forward(x, norm(L.norm1), inv);
      round_if(h1);
      for (Eigen::Index r = 0; r < n; ++r) {
        const auto i = static_cast<std::size_t>(active[static_cast<std::size_t>(r)]);
        x.row(r) += Attention::decode(h1.row(r), attention_[ul], config_.heads, st.k_cache[i][ul], st.v_cache[i][ul],
                                      position, bf16_);
      }
      round_if(x);
      Mat h2 = RmsNorm::forward(x, norm(L.norm2), inv);
      round_if(h2);
      if (fp8_) round_fp8_blocks(h2);  // the gate's and the experts' input
      auto f = moe_[ul].forward(h2);
      if (routes) routes->push_back(f.routing.ids);
      x += f.output;
      round_if(x);
    }
    Vec inv;
    Mat hf = RmsNorm::forward(x, norm(layout_.final_norm), inv);
    round_if(hf);
    Mat logits = hf * ConstMatMap(dense_.data() + layout_.head, h, config_.vocab);
    round_if(logits);
    return logits;
  }

 private:
  RowVec dense_row(Eigen::Index offset, int row) const {
    return Eigen::Map<const RowVec>(dense_.data() + offset + static_cast<Eigen::Index>(row) * config_.hidden, config_.hidden);
  }
  RowVec norm(Eigen::Index offset) const { return Eigen::Map<const RowVec>(dense_.data() + offset, config_.hidden); }
  void round_if(Mat& m) const {
    if (bf16_) round_bf16(m);
  }

  ModelConfig config_;
  DenseLayout layout_;
  Comm comm_;
  mrr::RoutingReplay<AnyRouteStore> replay_;
  bool bf16_, fp8_ = false;
  int first_expert_ = 0, local_experts_ = 0;
  std::vector<Moe> moe_;
  std::vector<AttentionWeights> attention_;
  Vec dense_;
};

}  // namespace moe_grpo
