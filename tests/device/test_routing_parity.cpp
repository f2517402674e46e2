// The Thrust backend (OpenMP system) against the CPU TopKRouter: identical ids and weights within
// a few ulps on every golden case of router.json and hf_gate.json, on 1 M random tokens and on
// tie-heavy logits; replay with a mask, the router backward, and the expert-major permutation.
#include <mrr/concepts.hpp>
#include <mrr/router.hpp>
#include <mrr/thrust/permute.hpp>
#include <mrr/thrust/routing.hpp>

#include <support/golden.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

using mrr::test::GoldenCase;
using mrr::test::load_golden;

namespace {

template <class T>
using dvec = thrust::device_vector<T>;

template <class T>
dvec<T> to_device(const mrr::RowMatrix<T>& m) {
  return dvec<T>(m.data(), m.data() + m.size());
}

template <class T>
std::vector<T> to_host(const dvec<T>& v) {
  std::vector<T> h(v.size());
  thrust::copy(v.begin(), v.end(), h.begin());
  return h;
}

// Largest difference in float32 ulps of the CPU value (for double runs, in ulps of double).
template <class T>
double max_ulps(const std::vector<T>& device, const mrr::RowMatrix<T>& host) {
  double worst = 0;
  for (std::size_t i = 0; i < device.size(); ++i) {
    const T h = host.data()[i];
    const T ulp = std::nextafter(std::abs(h), std::numeric_limits<T>::infinity()) - std::abs(h);
    worst = std::max(worst, static_cast<double>(std::abs(device[i] - h) / ulp));
  }
  return worst;
}

struct Compared {
  long rows = 0, differing_rows = 0;
  double worst_ulps = 0;
};

// Routes (or replays) on both backends and compares; `ulps` bounds the weights.
template <class T>
Compared compare(const mrr::RouterConfig& cfg, const mrr::RowMatrix<T>& logits, const mrr::Vector<T>* bias,
                 const mrr::ExpertIds* replay_ids = nullptr, const std::vector<std::uint8_t>* mask = nullptr) {
  mrr::TopKRouter<T> cpu(cfg);
  mrr::device::TopKRouter<T> dev(cfg);
  if (bias) {
    cpu.set_expert_bias(*bias);
    dev.set_expert_bias(std::vector<T>(bias->data(), bias->data() + bias->size()));
  }
  const auto z = to_device(logits);
  mrr::Routing<T> host;
  mrr::device::Routing<T> device;
  if (replay_ids == nullptr) {
    host = cpu.route(logits);
    device = dev.route(z);
  } else {
    const dvec<std::int32_t> ids(replay_ids->data(), replay_ids->data() + replay_ids->size());
    if (mask) {
      host = cpu.replay(logits, *replay_ids, *mask);
      device = dev.replay(z, ids, dvec<std::uint8_t>(mask->begin(), mask->end()));
    } else {
      host = cpu.replay(logits, *replay_ids);
      device = dev.replay(z, ids);
    }
  }
  const auto ids = to_host(device.ids);
  const auto w = to_host(device.weights);
  Compared c;
  c.rows = host.ids.rows();
  const int k = cfg.topk;
  for (long t = 0; t < c.rows; ++t) {
    bool same = true;
    for (int j = 0; j < k; ++j) same = same && ids[static_cast<std::size_t>(t * k + j)] == host.ids(t, j);
    c.differing_rows += same ? 0 : 1;
  }
  if (c.differing_rows == 0) c.worst_ulps = max_ulps(w, host.weights);
  return c;
}

// The CPU router evaluates exp with Eigen's vectorised kernel (within ~2 ulps) and the device with
// std::exp (within 1); a weight is one exp divided by a sum of k of them, so the two can differ
// by up to about 2 + k/2 ulps in the worst case — 8 for k <= 12 — and by more when the sum runs
// over all E experts (pre-softmax without renormalisation). Ids are compared exactly.
double ulp_bound(const mrr::RouterConfig& cfg) {
  const bool full_sum = cfg.score_function == mrr::ScoreFunction::softmax && cfg.pre_softmax && !cfg.normalizes();
  return 8.0 + (full_sum ? cfg.num_experts / 8.0 : 0.0);
}

mrr::RouterConfig megatron_config(const GoldenCase& c, int num_experts, bool with_bias) {
  mrr::RouterConfig cfg;
  cfg.num_experts = num_experts;
  cfg.topk = c.param<int>("topk");
  cfg.score_function = mrr::parse_score_function(c.param<std::string>("score_function", "softmax"));
  cfg.pre_softmax = c.param<bool>("use_pre_softmax", false);
  cfg.num_groups = c.param<int>("num_groups", 0);
  cfg.group_topk = c.param<int>("group_topk", 0);
  if (c.has_param("scaling_factor")) cfg.scaling_factor = c.param<double>("scaling_factor");
  cfg.use_expert_bias = with_bias;
  return cfg;
}

mrr::RouterConfig hf_config(const GoldenCase& c) {
  const auto& name = c.name;
  if (name.rfind("deepseek_v3", 0) == 0)
    return mrr::presets::deepseek_v3(c.param<int>("n_routed_experts"), c.param<int>("num_experts_per_tok"),
                                     c.param<int>("n_group"), c.param<int>("topk_group"), c.param<bool>("norm_topk_prob"),
                                     c.param<double>("routed_scaling_factor"));
  if (name.rfind("qwen3_moe", 0) == 0)
    return mrr::presets::qwen3_moe(c.param<int>("num_experts"), c.param<int>("num_experts_per_tok"),
                                   c.param<bool>("norm_topk_prob"));
  if (name.rfind("qwen2_moe", 0) == 0)
    return mrr::presets::qwen2_moe(c.param<int>("num_experts"), c.param<int>("num_experts_per_tok"),
                                   c.param<bool>("norm_topk_prob"));
  return mrr::presets::mixtral(c.param<int>("num_local_experts"), c.param<int>("num_experts_per_tok"));
}

template <class T>
void golden_router_case(const GoldenCase& c) {
  const auto logits = c.input("logits").matrix<T>();
  const bool with_bias = c.has_input("expert_bias");
  const auto cfg = megatron_config(c, static_cast<int>(logits.cols()), with_bias);
  const mrr::Vector<T> bias = with_bias ? c.input("expert_bias").vector<T>() : mrr::Vector<T>();
  Compared r;
  if (c.fn == "topk_routing") {
    r = compare<T>(cfg, logits, with_bias ? &bias : nullptr);
    // And the golden ids themselves.
    mrr::device::TopKRouter<T> dev(cfg);
    if (with_bias) dev.set_expert_bias(std::vector<T>(bias.data(), bias.data() + bias.size()));
    const auto ids = to_host(dev.route(to_device(logits)).ids);
    Eigen::Map<const mrr::RowMatrix<std::int32_t>> m(ids.data(), logits.rows(), cfg.topk);
    CHECK(mrr::test::check_close(m, c.output("indices"), 0, 0, c.name + " indices"));
  } else {
    const mrr::ExpertIds ids = c.input("indices").matrix<std::int32_t>();
    r = compare<T>(cfg, logits, nullptr, &ids);
  }
  CHECK(r.differing_rows == 0);
  CHECK(r.worst_ulps <= ulp_bound(cfg));
}

mrr::RowMatrix<float> random_logits(long rows, int experts, unsigned seed, int distinct_values) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.f, 1.f);
  std::uniform_int_distribution<int> pick(0, distinct_values - 1);
  mrr::RowMatrix<float> z(rows, experts);
  for (Eigen::Index i = 0; i < z.size(); ++i)
    z.data()[i] = distinct_values > 0 ? static_cast<float>(pick(rng)) * 0.25f - 1.f : n(rng);
  return z;
}

}  // namespace

TEST_SUITE("golden") {
  TEST_CASE("device: router.json routing and replay equal the CPU router (ids exact, weights within 4 ulps)") {
    for (const auto& c : load_golden("router.json")) {
      CAPTURE(c.name);
      golden_router_case<float>(c);
      golden_router_case<double>(c);
    }
  }

  TEST_CASE("device: hf_gate.json gates equal the CPU router and the golden ids") {
    for (const auto& c : load_golden("hf_gate.json")) {
      CAPTURE(c.name);
      const auto logits = c.input("router_logits").matrix<float>();
      const auto cfg = hf_config(c);
      const bool with_bias = c.has_input("e_score_correction_bias");
      const mrr::Vector<float> bias = with_bias ? c.input("e_score_correction_bias").vector<float>() : mrr::Vector<float>();
      const auto r = compare<float>(cfg, logits, with_bias ? &bias : nullptr);
      CHECK(r.differing_rows == 0);
      CHECK(r.worst_ulps <= ulp_bound(cfg));
    }
  }
}

TEST_CASE("device: 1 M random tokens route like the CPU router (softmax top-8 of 64, pre and post)") {
  const long tokens = 1 << 20;
  const auto z = random_logits(tokens, 64, 7, 0);
  for (bool pre : {true, false}) {
    auto cfg = mrr::presets::qwen3_moe(64, 8, pre);
    cfg.pre_softmax = pre;
    const auto r = compare<float>(cfg, z, nullptr);
    CAPTURE(pre);
    CHECK(r.differing_rows == 0);
    CHECK(r.worst_ulps <= ulp_bound(cfg));
  }
}

TEST_CASE("device: tie-heavy logits (5 distinct values) pick the lower index, as the CPU router") {
  const auto z = random_logits(65536, 64, 11, 5);
  for (const auto& cfg : {mrr::presets::qwen3_moe(64, 8, true), mrr::presets::mixtral(64, 2),
                          mrr::presets::deepseek_v3(64, 8, 8, 4, true, 2.5)}) {
    const auto r = compare<float>(cfg, z, nullptr);
    CHECK(r.differing_rows == 0);
    CHECK(r.worst_ulps <= ulp_bound(cfg));
  }
  auto sp = mrr::presets::qwen3_moe(64, 8, true);
  sp.score_function = mrr::ScoreFunction::sqrt_softplus;
  sp.pre_softmax = false;
  const auto r = compare<float>(sp, z, nullptr);
  CHECK(r.differing_rows == 0);
}

TEST_CASE("device: DeepSeek-V3 grouped sigmoid with expert bias on 65536 random tokens") {
  // The CPU router computes the selection sigmoid with Eigen's vectorised exp, the device with the
  // scalar one; a last-bit difference can reorder two near-equal biased scores. Count, bound, report.
  const auto z = random_logits(65536, 256, 5, 0);
  mrr::Vector<float> bias(256);
  std::mt19937 rng(3);
  std::normal_distribution<float> n(0.f, 0.05f);
  for (int e = 0; e < 256; ++e) bias[e] = n(rng);
  for (bool hf : {true, false}) {
    const auto cfg = hf ? mrr::presets::deepseek_v3(256, 8, 8, 4, true, 2.5)
                        : mrr::presets::megatron_deepseek_v3(256, 8, 8, 4, 2.5);
    const auto r = compare<float>(cfg, z, &bias);
    MESSAGE(std::string(hf ? "HF" : "Megatron") << " grouped sigmoid + bias: " << r.differing_rows << " of " << r.rows
                                     << " rows differ from the CPU router");
    CHECK(r.differing_rows <= 4);
  }
}

TEST_CASE("device: replay with a replay mask, and replay rejects bad ids") {
  const auto z = random_logits(4096, 64, 21, 0);
  const auto cfg = mrr::presets::megatron_deepseek_v3(64, 8, 1, 1, 2.5);
  mrr::ExpertIds ids(4096, 8);
  std::mt19937 rng(2);
  for (Eigen::Index t = 0; t < ids.rows(); ++t) {
    std::vector<int> e(64);
    for (int i = 0; i < 64; ++i) e[static_cast<std::size_t>(i)] = i;
    std::shuffle(e.begin(), e.end(), rng);
    for (int j = 0; j < 8; ++j) ids(t, j) = e[static_cast<std::size_t>(j)];
  }
  std::vector<std::uint8_t> mask(4096, 1);
  for (std::size_t t = 0; t < mask.size(); t += 7) mask[t] = 0;
  for (auto score : {mrr::ScoreFunction::softmax, mrr::ScoreFunction::sigmoid, mrr::ScoreFunction::sqrt_softplus}) {
    auto c = cfg;
    c.score_function = score;
    c.num_groups = c.group_topk = 0;
    c.use_expert_bias = false;
    CAPTURE(mrr::to_string(score));
    const auto r = compare<float>(c, z, nullptr, &ids, &mask);
    CHECK(r.differing_rows == 0);
    CHECK(r.worst_ulps <= ulp_bound(c));
    const auto full = compare<float>(c, z, nullptr, &ids);
    CHECK(full.differing_rows == 0);
  }
  mrr::device::TopKRouter<float> dev(mrr::presets::mixtral(8, 2));
  const dvec<float> small(4 * 8, 0.f);
  CHECK_THROWS_AS(dev.replay(small, dvec<std::int32_t>(std::vector<std::int32_t>{0, 1, 2, 2, 0, 1, 0, 1})),
                  std::invalid_argument);
  CHECK_THROWS_AS(dev.replay(small, dvec<std::int32_t>(std::vector<std::int32_t>{0, 1, 2, 9, 0, 1, 0, 1})),
                  std::invalid_argument);
  dvec<float> bad(small);
  bad[3] = std::numeric_limits<float>::quiet_NaN();
  CHECK_THROWS_AS(dev.route(bad), std::invalid_argument);
}

TEST_CASE("device: router backward equals the CPU router's gradient") {
  const auto z = random_logits(2048, 64, 31, 0);
  mrr::RowMatrix<double> zd = z.cast<double>();
  std::mt19937 rng(4);
  std::normal_distribution<double> n(0.0, 1.0);
  for (auto score : {mrr::ScoreFunction::softmax, mrr::ScoreFunction::sigmoid, mrr::ScoreFunction::sqrt_softplus}) {
    for (bool pre : {false, true}) {
      if (pre && score != mrr::ScoreFunction::softmax) continue;
      mrr::RouterConfig cfg;
      cfg.num_experts = 64;
      cfg.topk = 8;
      cfg.score_function = score;
      cfg.pre_softmax = pre;
      cfg.scaling_factor = 2.5;
      mrr::TopKRouter<double> cpu(cfg);
      mrr::device::TopKRouter<double> dev(cfg);
      const auto routing = cpu.route(zd);
      mrr::RowMatrix<double> g(2048, 8);
      for (Eigen::Index i = 0; i < g.size(); ++i) g.data()[i] = n(rng);
      const auto host = cpu.backward(zd, routing, g);
      const auto device = to_host(dev.backward(to_device(zd), dvec<std::int32_t>(routing.ids.data(), routing.ids.data() + routing.ids.size()), to_device(g)));
      double worst = 0;
      for (std::size_t i = 0; i < device.size(); ++i) worst = std::max(worst, std::abs(device[i] - host.data()[i]));
      CAPTURE(mrr::to_string(score));
      CAPTURE(pre);
      CHECK(worst <= 1e-14);
    }
  }
}

TEST_CASE("device: expert-major permutation and slot-order combine equal the CPU's bit for bit") {
  const long tokens = 3000;
  const int experts = 32, k = 4;
  const long hidden = 300;  // not a multiple of the copy chunk
  const auto z = random_logits(tokens, experts, 41, 0);
  mrr::TopKRouter<float> cpu(mrr::presets::qwen3_moe(experts, k, true));
  const auto routing = cpu.route(z);
  const auto perm = mrr::make_expert_permutation(routing, experts);
  mrr::RowMatrix<float> x = random_logits(tokens, static_cast<int>(hidden), 42, 0);
  const auto permuted = mrr::permute_tokens<float>(x, perm);
  mrr::RowMatrix<float> expert_out = permuted * 0.5f;
  const auto combined = mrr::combine<float>(expert_out, routing, perm);

  const dvec<std::int32_t> ids(routing.ids.data(), routing.ids.data() + routing.ids.size());
  const auto p = mrr::device::make_expert_permutation(ids, tokens, k, experts);
  const auto src = to_host(p.source_token);
  REQUIRE(src.size() == perm.source_token.size());
  bool same = true;
  for (std::size_t r = 0; r < src.size(); ++r) same = same && src[r] == perm.source_token[r];
  CHECK(same);
  const auto counts = to_host(mrr::device::tokens_per_expert(p));
  for (int e = 0; e < experts; ++e) CHECK(counts[static_cast<std::size_t>(e)] == perm.tokens_per_expert[static_cast<std::size_t>(e)]);
  const auto dp = to_host(mrr::device::permute_tokens<float>(to_device(x), hidden, p));
  CHECK(std::equal(dp.begin(), dp.end(), permuted.data()));
  const auto dc = to_host(mrr::device::combine<float>(to_device(expert_out), hidden, to_device(routing.weights), p));
  CHECK(std::equal(dc.begin(), dc.end(), combined.data()));
}

TEST_CASE("device: the backend models the Backend concept") {
  static_assert(mrr::Backend<mrr::ThrustDeviceBackend>);
  static_assert(mrr::Backend<mrr::ThrustBackend<mrr::ThrustHostSystem>>);
  CHECK(mrr::ThrustDeviceBackend::name == "thrust-omp");
  CHECK_FALSE(mrr::ThrustDeviceBackend::is_device);
}
