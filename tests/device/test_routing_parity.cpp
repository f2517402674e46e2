// The Thrust backend (OpenMP system) against the CPU TopKRouter: identical ids and weights within
// a few ulps on every golden case of router.json and hf_gate.json, on 1 M random tokens and on
// tie-heavy logits; replay with a mask, the router backward, and the expert-major permutation.
#include <mrr/concepts.hpp>
#include <mrr/router.hpp>
#include <mrr/thrust/bf16.hpp>
#include <mrr/thrust/permute.hpp>
#include <mrr/thrust/routing.hpp>

#include <support/golden.hpp>
#include <support/ties.hpp>

#include "device_vectors.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

using mrr::test::GoldenCase;
using mrr::test::load_golden;

namespace {

using mrr::test::dvec;
using mrr::test::to_device;

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
  mrr::ExpertIds device_ids;  // the device's ids, [rows, k]
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
  c.device_ids = Eigen::Map<const mrr::ExpertIds>(ids.data(), c.rows, k);
  return c;
}

// Float softmax over the k gathered logits (post-softmax, or pre-softmax renormalised): 0, since on
// CPU threads the device functor runs the CPU router's very operations (its polynomial exp, the
// slot-order sum, e * (scale / sum)). Otherwise a few ulps: 8 (the CPU router computes the
// exponentials or scores vectorised with Eigen, the device with the scalar functions: each is
// within about 1 ulp, and a normalisation divides by their sum), plus E/8 when a weight divides by
// a sum over all E experts (pre-softmax without renormalisation), whose order also differs.
double ulp_bound(const mrr::RouterConfig& cfg, bool is_float = true) {
  const bool softmax = cfg.score_function == mrr::ScoreFunction::softmax;
  const bool full_sum = softmax && cfg.pre_softmax && !cfg.normalizes();
  if (is_float && softmax && !full_sum) return 0.0;
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
    // The golden ids: exact, or a float32 tie Megatron broke its own way (tests/support/ties.hpp).
    CHECK(mrr::test::compare_ids_up_to_ties(m, c.output("indices").matrix<std::int32_t>(),
                                            mrr::test::case_selection_scores(c, cfg, "logits", "expert_bias"),
                                            mrr::test::GroupLimit::of(cfg), true, c.name + " indices")
              .ok);
  } else {
    const mrr::ExpertIds ids = c.input("indices").matrix<std::int32_t>();
    r = compare<T>(cfg, logits, nullptr, &ids);
  }
  CHECK(r.differing_rows == 0);
  CHECK(r.worst_ulps <= ulp_bound(cfg, std::is_same_v<T, float>));
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
  TEST_CASE("device: router.json routing and replay equal the CPU router (ids exact, weights exact or within 8 ulps)") {
    for (const auto& c : load_golden("router.json")) {
      mrr::test::guarded(c, [&] {
        CAPTURE(c.name);
        golden_router_case<float>(c);
        golden_router_case<double>(c);
      });
    }
  }

  TEST_CASE("device: hf_gate.json gates equal the CPU router and the golden ids") {
    for (const auto& c : load_golden("hf_gate.json")) {
      mrr::test::guarded(c, [&] {
        CAPTURE(c.name);
        const auto logits = c.input("router_logits").matrix<float>();
        const auto cfg = hf_config(c);
        const bool with_bias = c.has_input("e_score_correction_bias");
        const mrr::Vector<float> bias =
            with_bias ? c.input("e_score_correction_bias").vector<float>() : mrr::Vector<float>();
        const auto r = compare<float>(cfg, logits, with_bias ? &bias : nullptr);
        CHECK(r.differing_rows == 0);
        CHECK(r.worst_ulps <= ulp_bound(cfg));
        // The golden lists each token's experts by id (HF's unsorted top-k); the device's ids, sorted so.
        mrr::ExpertIds by_id = r.device_ids;
        for (Eigen::Index t = 0; t < by_id.rows(); ++t)
          std::sort(by_id.row(t).begin(), by_id.row(t).end());
        CHECK(mrr::test::compare_ids_up_to_ties(
                  by_id, c.output("indices").matrix<std::int32_t>(),
                  mrr::test::case_selection_scores(c, cfg, "router_logits", "e_score_correction_bias"),
                  mrr::test::GroupLimit::of(cfg), false, c.name + " device indices")
                  .ok);
      });
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

TEST_CASE("device: set_expert_bias rejects NaN and +-inf as the CPU router does, and keeps the bias it had") {
  const auto cfg = mrr::presets::deepseek_v3(16, 4, 4, 2, true, 2.5);
  const auto z = random_logits(64, 16, 6, 0);
  mrr::Vector<float> good(16);
  for (int e = 0; e < 16; ++e)
    good[e] = 0.01f * static_cast<float>(e % 5);
  mrr::TopKRouter<float> cpu(cfg);
  mrr::device::TopKRouter<float> dev(cfg);
  cpu.set_expert_bias(good);
  dev.set_expert_bias(std::vector<float>(good.data(), good.data() + 16));
  const auto before = to_host(dev.route(to_device(z)).ids);
  for (const float v : {-std::numeric_limits<float>::infinity(), std::numeric_limits<float>::infinity(),
                        std::numeric_limits<float>::quiet_NaN()}) {
    CAPTURE(v);
    mrr::Vector<float> bad = good;
    bad[3] = v;
    CHECK_THROWS_WITH_AS(cpu.set_expert_bias(bad), doctest::Contains("bias[3] is not finite"), mrr::InvalidArgument);
    CHECK_THROWS_WITH_AS(dev.set_expert_bias(std::vector<float>(bad.data(), bad.data() + 16)),
                         doctest::Contains("bias[3] is not finite"), mrr::InvalidArgument);
    CHECK(cpu.expert_bias() == good);
    CHECK(to_host(dev.route(to_device(z)).ids) == before);  // the rejected bias was not kept
  }
  const auto host = cpu.route(z);
  CHECK(std::equal(before.begin(), before.end(), host.ids.data()));
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
  // A replayed row whose chosen experts are all masked (-inf) has NaN weights: rejected by the CPU
  // router and the device alike, naming the row; masking the other experts instead is fine.
  mrr::RowMatrix<float> masked = mrr::RowMatrix<float>::Zero(4, 8);
  masked(2, 0) = masked(2, 1) = -std::numeric_limits<float>::infinity();
  masked(3, 2) = masked(3, 3) = -std::numeric_limits<float>::infinity();
  const mrr::ExpertIds chosen = (mrr::ExpertIds(4, 2) << 0, 1, 0, 1, 0, 1, 0, 1).finished();
  const dvec<std::int32_t> dchosen(chosen.data(), chosen.data() + chosen.size());
  for (bool pre : {false, true}) {
    auto c = mrr::presets::mixtral(8, 2);
    c.pre_softmax = pre;
    c.normalize_topk = true;
    CAPTURE(pre);
    mrr::TopKRouter<float> cpu(c);
    mrr::device::TopKRouter<float> router(c);
    const dvec<float> dmasked(masked.data(), masked.data() + masked.size());
    CHECK_THROWS_WITH_AS(cpu.replay(masked, chosen), doctest::Contains("logits row 2"), std::invalid_argument);
    CHECK_THROWS_WITH_AS(router.replay(dmasked, dchosen),
                         doctest::Contains("logits row 2: a weight is NaN because every logit it is normalised over "
                                           "is -inf"),
                         std::invalid_argument);
    mrr::RowMatrix<float> fine = masked;
    fine.row(2).setZero();
    const dvec<float> dfine(fine.data(), fine.data() + fine.size());
    const auto w = to_host(router.replay(dfine, dchosen).weights);
    const auto host = cpu.replay(fine, chosen).weights;
    for (std::size_t i = 0; i < w.size(); ++i) CHECK(w[i] == host.data()[i]);
  }
}

TEST_CASE("device: k = 8 replay on CPU threads (8-row kernel, row-by-row rest) equals the CPU bit for bit and names bad rows") {
  // 1003 rows: tiles of 256, a partial last tile and a tail past the last multiple of 8.
  const long tokens = 1003;
  const auto z = random_logits(tokens, 64, 61, 0);
  std::mt19937 rng(62);
  mrr::ExpertIds ids(tokens, 8);
  for (Eigen::Index t = 0; t < ids.rows(); ++t) {
    std::vector<int> e(64);
    for (int i = 0; i < 64; ++i) e[static_cast<std::size_t>(i)] = i;
    std::shuffle(e.begin(), e.end(), rng);
    for (int j = 0; j < 8; ++j) ids(t, j) = e[static_cast<std::size_t>(j)];
  }
  for (bool scaled : {false, true}) {
    auto cfg = mrr::presets::mixtral(64, 8);  // softmax over the 8 chosen logits
    if (scaled) cfg.scaling_factor = 2.5;
    CAPTURE(scaled);
    mrr::TopKRouter<float> cpu(cfg);
    mrr::device::TopKRouter<float> dev(cfg);
    const auto host = cpu.replay(z, ids);
    const auto out = dev.replay(to_device(z), dvec<std::int32_t>(ids.data(), ids.data() + ids.size()));
    const auto w = to_host(out.weights);
    const auto got = to_host(out.ids);
    CHECK(std::memcmp(w.data(), host.weights.data(), w.size() * sizeof(float)) == 0);
    CHECK(std::memcmp(got.data(), ids.data(), got.size() * sizeof(std::int32_t)) == 0);
  }
  mrr::device::TopKRouter<float> dev(mrr::presets::mixtral(64, 8));
  auto expect_error = [&](const mrr::RowMatrix<float>& logits, const mrr::ExpertIds& given, const std::string& what) {
    CAPTURE(what);
    CHECK_THROWS_WITH_AS(dev.replay(to_device(logits), dvec<std::int32_t>(given.data(), given.data() + given.size())),
                         doctest::Contains(what.c_str()), std::invalid_argument);
  };
  mrr::ExpertIds repeated = ids;
  repeated(517, 5) = repeated(517, 2);
  expect_error(z, repeated, "row 517: a replayed row has an expert id outside");
  mrr::ExpertIds tail = ids;
  tail(1001, 7) = 64;  // past the last multiple of 8 (1000): the row-by-row rest
  expect_error(z, tail, "row 1001: a replayed row has an expert id outside");
  mrr::RowMatrix<float> nan = z;
  nan(300, ids(300, 4)) = std::numeric_limits<float>::quiet_NaN();
  expect_error(nan, ids, "logits row 300 holds NaN or +inf");
  mrr::RowMatrix<float> masked = z;
  for (int j = 0; j < 8; ++j) masked(5, ids(5, j)) = -std::numeric_limits<float>::infinity();
  expect_error(masked, ids, "logits row 5: a weight is NaN");
  // A NaN the replay does not read (not a chosen expert) is no error, as on the CPU.
  mrr::RowMatrix<float> unread = z;
  int other = 0;
  while ((ids.row(7).array() == other).any()) ++other;
  unread(7, other) = std::numeric_limits<float>::quiet_NaN();
  CHECK_NOTHROW((void)dev.replay(to_device(unread), dvec<std::int32_t>(ids.data(), ids.data() + ids.size())));
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

namespace {

// Replay weights at given ids and the router backward, device against CPU, on `z`: the ids are
// the CPU's route of perturbed logits (what a training engine replays), every score function.
void replay_and_backward_parity(const mrr::RowMatrix<float>& z, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.f, 1.f);
  mrr::RowMatrix<float> rollout = z;
  for (Eigen::Index i = 0; i < rollout.size(); ++i) rollout.data()[i] += 0.3f * n(rng);
  mrr::RowMatrix<float> g(z.rows(), 8);
  for (Eigen::Index i = 0; i < g.size(); ++i) g.data()[i] = n(rng);
  const auto dz = to_device(z);
  const auto dg = to_device(g);
  struct Case {
    mrr::ScoreFunction score;
    bool pre, normalize;
  };
  for (const Case c : {Case{mrr::ScoreFunction::softmax, false, false}, Case{mrr::ScoreFunction::softmax, true, true},
                       Case{mrr::ScoreFunction::softmax, true, false}, Case{mrr::ScoreFunction::sigmoid, false, true},
                       Case{mrr::ScoreFunction::sqrt_softplus, false, true}}) {
    mrr::RouterConfig cfg;
    cfg.num_experts = static_cast<int>(z.cols());
    cfg.topk = 8;
    cfg.score_function = c.score;
    cfg.pre_softmax = c.pre;
    cfg.normalize_topk = c.normalize;
    cfg.scaling_factor = 2.5;
    CAPTURE(mrr::to_string(c.score));
    CAPTURE(c.pre);
    CAPTURE(c.normalize);
    mrr::TopKRouter<float> cpu(cfg);
    mrr::device::TopKRouter<float> dev(cfg);
    const mrr::ExpertIds ids = cpu.route(rollout).ids;
    const auto r = compare<float>(cfg, z, nullptr, &ids);
    CHECK(r.differing_rows == 0);
    CHECK(r.worst_ulps <= ulp_bound(cfg));
    const auto routing = cpu.replay(z, ids);
    const auto host = cpu.backward(z, routing, g);
    const auto device =
        to_host(dev.backward(dz, dvec<std::int32_t>(ids.data(), ids.data() + ids.size()), dg));
    double worst = 0;
    for (std::size_t i = 0; i < device.size(); ++i)
      worst = std::max(worst, static_cast<double>(std::abs(device[i] - host.data()[i])));
    CHECK(worst <= 1e-5);  // gradients of order 1, float
  }
}

}  // namespace

TEST_CASE("device: replay weights and the router backward equal the CPU's on 1 M random tokens") {
  replay_and_backward_parity(random_logits(1 << 20, 64, 51, 0), 52);
}

TEST_CASE("device: replay weights and the router backward equal the CPU's on tie-heavy logits") {
  replay_and_backward_parity(random_logits(65536, 64, 53, 5), 54);
}

TEST_CASE("device: the counting-sort permutation equals the CPU's on 1 M tokens of 256 experts") {
  const long tokens = 1 << 20;
  const int experts = 256, k = 8;
  mrr::ExpertIds ids(tokens, k);
  std::mt19937 rng(61);
  std::uniform_int_distribution<int> skew(0, experts * 4 - 1);  // uneven loads, some experts empty
  for (Eigen::Index t = 0; t < tokens; ++t)
    for (int j = 0; j < k; ++j) {
      int e = skew(rng);
      e = e < experts ? e : (e % 17) * 3;
      for (int i = 0; i < j; ++i)
        if (ids(t, i) == e) {
          e = (e + 1) % experts;
          i = -1;
        }
      ids(t, j) = e;
    }
  mrr::Routing<float> routing{ids, mrr::RowMatrix<float>::Ones(tokens, k), {}};
  const auto perm = mrr::make_expert_permutation(routing, experts);
  const auto p = mrr::device::make_expert_permutation(dvec<std::int32_t>(ids.data(), ids.data() + ids.size()), tokens,
                                                      k, experts);
  const auto src = to_host(p.source_token);
  CHECK(std::equal(src.begin(), src.end(), perm.source_token.begin(), perm.source_token.end()));
  const auto counts = to_host(mrr::device::tokens_per_expert(p));
  CHECK(std::equal(counts.begin(), counts.end(), perm.tokens_per_expert.begin(), perm.tokens_per_expert.end()));
  const auto rows = to_host(p.row_of_slot);
  bool inverse = true;
  for (std::size_t s = 0; s < rows.size(); ++s)
    inverse = inverse && src[static_cast<std::size_t>(rows[s])] == static_cast<std::int32_t>(s / k);
  CHECK(inverse);
  mrr::ExpertIds bad = ids.topRows(4);
  bad(2, 3) = experts;
  CHECK_THROWS_AS(mrr::device::make_expert_permutation(dvec<std::int32_t>(bad.data(), bad.data() + bad.size()), 4, k,
                                                       experts),
                  std::invalid_argument);
}

TEST_CASE("device: bf16 storage rounds to nearest even and widens exactly") {
  auto bits = [](float f) { return mrr::bf16::from_float(f).bits; };
  CHECK(bits(1.0f) == 0x3f80);
  CHECK(bits(-2.0f) == 0xc000);
  CHECK(bits(std::numeric_limits<float>::infinity()) == 0x7f80);
  CHECK(bits(-std::numeric_limits<float>::infinity()) == 0xff80);
  CHECK(bits(std::numeric_limits<float>::max()) == 0x7f80);  // rounds past the largest bf16
  CHECK(std::isnan(mrr::bf16::from_float(std::numeric_limits<float>::quiet_NaN()).to_float()));
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1); 1 + 3 * 2^-8 ties up to 1 + 2^-6.
  CHECK(bits(1.0f + 0x1p-8f) == 0x3f80);
  CHECK(bits(1.0f + 3 * 0x1p-8f) == 0x3f82);
  CHECK(bits(1.0f + 0x1p-8f + 0x1p-20f) == 0x3f81);  // above halfway rounds up
  for (std::uint32_t b = 0; b < 0x10000; b += 7) {   // every bf16 value round-trips
    const auto h = mrr::bf16::from_bits(static_cast<std::uint16_t>(b));
    if (!std::isnan(h.to_float())) CHECK_EQ(mrr::bf16::from_float(h.to_float()).bits, h.bits);
  }
}

TEST_CASE("device: bf16 logits route like the CPU router on the bf16-rounded fp32 logits") {
  const auto z = random_logits(65536, 128, 71, 0);
  const auto ties = random_logits(16384, 128, 72, 5);
  for (const auto* logits : {&z, &ties}) {
    std::vector<mrr::bf16> half(static_cast<std::size_t>(logits->size()));
    mrr::RowMatrix<float> rounded(logits->rows(), logits->cols());
    for (Eigen::Index i = 0; i < logits->size(); ++i) {
      half[static_cast<std::size_t>(i)] = mrr::bf16::from_float(logits->data()[i]);
      rounded.data()[i] = half[static_cast<std::size_t>(i)].to_float();
    }
    const dvec<mrr::bf16> dh(half.begin(), half.end());
    for (const auto& cfg : {mrr::presets::qwen3_moe(128, 8, true), mrr::presets::mixtral(128, 2),
                            mrr::presets::deepseek_v3(128, 8, 8, 4, true, 2.5)}) {
      mrr::TopKRouter<float> cpu(cfg);
      mrr::device::TopKRouter<float> dev(cfg);
      const auto host = cpu.route(rounded);
      const auto device = dev.route(dh);
      const auto ids = to_host(device.ids);
      CHECK(std::equal(ids.begin(), ids.end(), host.ids.data()));
      CHECK(max_ulps(to_host(device.weights), host.weights) <= ulp_bound(cfg));
      const auto replayed = dev.replay(dh, device.ids);
      CHECK(max_ulps(to_host(replayed.weights), host.weights) <= ulp_bound(cfg));
    }
  }
}

TEST_CASE("device: capacity dropping (probs and position) equals the CPU router's, backward included") {
  const long tokens = 8192;
  const auto z = random_logits(tokens, 16, 81, 0);
  const auto ties = random_logits(tokens, 16, 82, 5);
  std::mt19937 rng(83);
  std::normal_distribution<float> n(0.f, 1.f);
  mrr::RowMatrix<float> g(tokens, 2);
  for (Eigen::Index i = 0; i < g.size(); ++i) g.data()[i] = n(rng);
  for (const auto* logits : {&z, &ties})
    for (const auto drop : {mrr::DropPolicy::probs, mrr::DropPolicy::position})
      for (const double factor : {0.5, 1.0, 1.5}) {
        auto cfg = mrr::presets::mixtral(16, 2);
        cfg.capacity_factor = factor;
        cfg.drop_policy = drop;
        CAPTURE(factor);
        CAPTURE(drop == mrr::DropPolicy::probs);
        CAPTURE(logits == &ties);
        mrr::TopKRouter<float> cpu(cfg);
        mrr::device::TopKRouter<float> dev(cfg);
        const auto host = cpu.route(*logits);
        const auto dz = to_device(*logits);
        const auto device = dev.route(dz);
        REQUIRE(device.has_capacity_mask());
        const auto ids = to_host(device.ids);
        const auto kept = to_host(device.kept);
        CHECK(std::equal(ids.begin(), ids.end(), host.ids.data()));
        long differ = 0, dropped = 0;
        for (std::size_t i = 0; i < kept.size(); ++i) {
          differ += kept[i] != host.kept.data()[i] ? 1 : 0;
          dropped += kept[i] == 0 ? 1 : 0;
        }
        CHECK(differ == 0);
        if (factor < 1.0) CHECK(dropped > 0);
        CHECK(max_ulps(to_host(device.weights), host.weights) <= ulp_bound(cfg));
        const auto grad = to_host(dev.backward(dz, device.ids, to_device(g), device.kept));
        const auto host_grad = cpu.backward(*logits, host, g);
        double worst = 0;
        for (std::size_t i = 0; i < grad.size(); ++i)
          worst = std::max(worst, static_cast<double>(std::abs(grad[i] - host_grad.data()[i])));
        CHECK(worst <= 1e-5);
        const auto replayed = dev.replay(dz, device.ids);  // replay applies the capacity too, as the CPU's
        const auto replay_kept = to_host(replayed.kept);
        CHECK(std::equal(replay_kept.begin(), replay_kept.end(), kept.begin()));
      }
}

TEST_CASE("device: the backend models the Backend concept") {
  static_assert(mrr::Backend<mrr::ThrustDeviceBackend>);
  static_assert(mrr::Backend<mrr::ThrustBackend<mrr::ThrustHostSystem>>);
  CHECK(mrr::ThrustDeviceBackend::name == "thrust-omp");
  CHECK_FALSE(mrr::ThrustDeviceBackend::is_device);
}
