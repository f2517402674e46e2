// Dense token dropping (device::apply_token_dropping, OpenMP system, both algorithms) against the
// CPU mrr::apply_token_dropping: map and probabilities bit for bit, on every token_dropping case of
// router_capacity.json, on random and tie-heavy inputs (both drop policies, with and without
// padding, capacity factors 0.5 / 1 / 1.5 / beyond the token count / beyond int64, float and double), on edge
// shapes, and the input errors.
#include <mrr/router.hpp>
#include <mrr/thrust/capacity.hpp>

#include <support/golden.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

using mrr::test::load_golden;

namespace {

template <class T>
using dvec = thrust::device_vector<T>;

template <class T>
std::vector<T> to_host(const dvec<T>& v) {
  std::vector<T> h(v.size());
  thrust::copy(v.begin(), v.end(), h.begin());
  return h;
}

struct Outcome {
  long differing_map = 0, differing_probs = 0, kept = 0, routed = 0;
};

// Runs the CPU and both device algorithms and compares the map exactly and the probabilities bit for bit (-0 included).
template <class T>
Outcome compare(const mrr::RowMatrix<T>& probs, const mrr::Mask& map, int topk, double cf, mrr::DropPolicy policy,
                bool pad) {
  const auto host = mrr::apply_token_dropping<T>(probs, map, topk, cf, policy, pad);
  const dvec<T> dp(probs.data(), probs.data() + probs.size());
  const dvec<std::uint8_t> dm(map.data(), map.data() + map.size());
  Outcome o;
  // Both algorithms: the sort (what CUDA runs) and the columns (the OpenMP system's default).
  for (const auto algorithm : {mrr::device::DroppingAlgorithm::sort, mrr::device::DroppingAlgorithm::columns}) {
    const auto dev = mrr::device::apply_token_dropping<T>(dp, dm, static_cast<long>(probs.rows()),
                                                          static_cast<int>(probs.cols()), topk, cf, policy, pad, algorithm);
    const auto m = to_host(dev.map);
    const auto p = to_host(dev.probs);
    REQUIRE(m.size() == static_cast<std::size_t>(host.map.size()));
    REQUIRE(p.size() == static_cast<std::size_t>(host.probs.size()));
    CHECK(dev.tokens == probs.rows());
    CHECK(dev.num_experts == probs.cols());
    o.kept = o.routed = 0;
    for (std::size_t i = 0; i < m.size(); ++i) {
      o.differing_map += m[i] != host.map.data()[i] ? 1 : 0;
      o.differing_probs += std::memcmp(&p[i], &host.probs.data()[i], sizeof(T)) != 0 ? 1 : 0;
      o.kept += m[i];
      o.routed += map.data()[i];
    }
  }
  return o;
}

// Random probabilities ([0, 1), or one of `distinct` values, with +0 and -0 among them when tied)
// and a map routing each token to `topk` distinct experts (every 7th token to none).
template <class T>
void random_inputs(long tokens, int experts, int topk, int distinct, unsigned seed, mrr::RowMatrix<T>& probs,
                   mrr::Mask& map) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::uniform_int_distribution<int> pick(0, distinct > 0 ? distinct - 1 : 0);
  probs.resize(tokens, experts);
  map = mrr::Mask::Zero(tokens, experts);
  for (Eigen::Index i = 0; i < probs.size(); ++i) {
    if (distinct > 0) {
      const int v = pick(rng);
      probs.data()[i] = v == 0 ? (i % 2 == 0 ? T(0) : -T(0)) : static_cast<T>(v) / static_cast<T>(distinct);
    } else {
      probs.data()[i] = static_cast<T>(u(rng));
    }
  }
  std::vector<int> all(static_cast<std::size_t>(experts));
  for (int e = 0; e < experts; ++e) all[static_cast<std::size_t>(e)] = e;
  for (long t = 0; t < tokens; ++t) {
    if (t % 7 == 3) continue;
    std::shuffle(all.begin(), all.end(), rng);
    for (int j = 0; j < topk; ++j) map(t, all[static_cast<std::size_t>(j)]) = 1;
  }
}

template <class T>
void random_sweep(long tokens, int experts, int topk, int distinct, unsigned seed) {
  mrr::RowMatrix<T> probs;
  mrr::Mask map;
  random_inputs<T>(tokens, experts, topk, distinct, seed, probs, map);
  for (const auto policy : {mrr::DropPolicy::probs, mrr::DropPolicy::position})
    for (const bool pad : {false, true})
      for (const double cf : {0.5, 1.0, 1.5, 1e6, 1e19, 1e300}) {
        CAPTURE(policy == mrr::DropPolicy::probs);
        CAPTURE(pad);
        CAPTURE(cf);
        const auto o = compare<T>(probs, map, topk, cf, policy, pad);
        CHECK(o.differing_map == 0);
        CHECK(o.differing_probs == 0);
        if (cf < 1.0) CHECK(o.kept < o.routed);  // something was dropped
        if (cf > 1e3) CHECK(o.kept == (pad ? probs.size() : o.routed));  // capacity beyond the tokens keeps all
      }
}

template <class T>
std::string error_of(const std::vector<T>& probs, const std::vector<std::uint8_t>& map, long tokens, int experts,
                     int topk, double cf, mrr::DropPolicy policy) {
  std::string message[2];
  int i = 0;
  for (const auto algorithm : {mrr::device::DroppingAlgorithm::sort, mrr::device::DroppingAlgorithm::columns}) {
    try {
      (void)mrr::device::apply_token_dropping<T>(dvec<T>(probs.begin(), probs.end()),
                                                 dvec<std::uint8_t>(map.begin(), map.end()), tokens, experts, topk, cf,
                                                 policy, false, algorithm);
    } catch (const mrr::InvalidArgument& e) {
      message[i] = e.what();
    }
    ++i;
  }
  CHECK(message[0] == message[1]);  // checked before either algorithm runs
  return message[0];
}

bool mentions(const std::string& message, const std::string& part) {
  return message.find(part) != std::string::npos;
}

}  // namespace

TEST_SUITE("golden") {
  TEST_CASE("device: router_capacity.json token_dropping cases equal the CPU apply_token_dropping bit for bit") {
    int cases = 0;
    for (const auto& c : load_golden("router_capacity.json", "token_dropping")) {
      mrr::test::guarded(c, [&] {
        CAPTURE(c.name);
        const auto probs = c.input("routing_probs").matrix<double>();
        const auto map = c.input("routing_map").matrix<std::uint8_t>();
        const int topk = c.param<int>("topk");
        const double cf = c.param<double>("capacity_factor");
        const auto policy = mrr::parse_drop_policy(c.param<std::string>("drop_policy"));
        const bool pad = c.param<bool>("pad_to_capacity");
        const auto d = compare<double>(probs, map, topk, cf, policy, pad);
        CHECK(d.differing_map == 0);
        CHECK(d.differing_probs == 0);
        const mrr::RowMatrix<float> pf = probs.cast<float>();
        const auto f = compare<float>(pf, map, topk, cf, policy, pad);
        CHECK(f.differing_map == 0);
        CHECK(f.differing_probs == 0);
        ++cases;
      });
    }
    MESSAGE("token_dropping golden cases: " << cases);
    CHECK(cases > 0);
  }
}

TEST_CASE("device: dense token dropping equals the CPU's on random inputs (float and double)") {
  random_sweep<float>(4096, 16, 2, 0, 11);
  random_sweep<double>(4096, 16, 2, 0, 12);
  random_sweep<float>(1000, 64, 8, 0, 13);
  random_sweep<double>(777, 8, 1, 0, 14);
}

TEST_CASE("device: dense token dropping equals the CPU's on tie-heavy inputs (few distinct probs, +0 and -0)") {
  for (const int distinct : {2, 3, 5}) {
    CAPTURE(distinct);
    random_sweep<float>(2048, 16, 2, distinct, 20u + static_cast<unsigned>(distinct));
    random_sweep<double>(2048, 16, 4, distinct, 30u + static_cast<unsigned>(distinct));
  }
}

TEST_CASE("device: dense token dropping on edge shapes and values") {
  for (const long tokens : {0L, 1L, 2L, 3L})
    for (const int experts : {1, 3}) {
      mrr::RowMatrix<float> probs;
      mrr::Mask map;
      random_inputs<float>(tokens, experts, 1, 0, 40u + static_cast<unsigned>(tokens), probs, map);
      for (const auto policy : {mrr::DropPolicy::probs, mrr::DropPolicy::position})
        for (const bool pad : {false, true})
          for (const double cf : {0.1, 1.0, 4.0}) {
            CAPTURE(tokens);
            CAPTURE(experts);
            const auto o = compare<float>(probs, map, 1, cf, policy, pad);
            CHECK(o.differing_map == 0);
            CHECK(o.differing_probs == 0);
          }
    }
  // Infinities, negative and denormal probabilities order as the CPU orders them.
  mrr::RowMatrix<double> probs(6, 2);
  probs << std::numeric_limits<double>::infinity(), -1.0, -std::numeric_limits<double>::infinity(), 0.5,
      std::numeric_limits<double>::denorm_min(), -0.0, -std::numeric_limits<double>::denorm_min(), 0.0, -2.0, 0.5, 1.0,
      -0.0;
  mrr::Mask map(6, 2);
  map << 1, 0, 0, 1, 1, 1, 0, 0, 1, 1, 0, 1;
  for (const bool pad : {false, true})
    for (const double cf : {0.3, 0.5, 1.0}) {
      const auto o = compare<double>(probs, map, 1, cf, mrr::DropPolicy::probs, pad);
      CHECK(o.differing_map == 0);
      CHECK(o.differing_probs == 0);
    }
  // NaN probabilities do not matter to the position policy (the CPU copies them as they are).
  probs(2, 1) = std::numeric_limits<double>::quiet_NaN();
  for (const bool pad : {false, true}) {
    const auto o = compare<double>(probs, map, 1, 0.5, mrr::DropPolicy::position, pad);
    CHECK(o.differing_map == 0);
    CHECK(o.differing_probs == 0);
  }
}

TEST_CASE("device: dense token dropping rejects bad inputs with a message naming the problem") {
  const std::vector<float> probs = {0.5f, 0.25f, 0.75f, 0.1f, 0.2f, 0.3f};  // [3, 2]
  const std::vector<std::uint8_t> map = {1, 0, 0, 1, 1, 0};
  const auto probs_policy = mrr::DropPolicy::probs;
  CHECK(error_of<float>(probs, map, 3, 2, 1, 1.0, probs_policy).empty());
  CHECK(mentions(error_of<float>(probs, map, 2, 2, 1, 1.0, probs_policy), "'probs' has 6 values, expected [2, 2]"));
  CHECK(mentions(error_of<float>(probs, {1, 0, 0}, 3, 2, 1, 1.0, probs_policy), "'routing_map' has 3 values"));
  CHECK(mentions(error_of<float>(probs, map, 3, 0, 1, 1.0, probs_policy), "num_experts > 0"));
  CHECK(mentions(error_of<float>(probs, map, -1, 2, 1, 1.0, probs_policy), "tokens >= 0"));
  for (const double cf : {0.0, -1.0, std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity()})
    CHECK(mentions(error_of<float>(probs, map, 3, 2, 1, cf, probs_policy), "capacity_factor must be finite and positive"));
  CHECK(mentions(error_of<float>(probs, map, 3, 2, 0, 1.0, probs_policy), "topk > 0"));
  auto nan_probs = probs;
  nan_probs[3] = std::numeric_limits<float>::quiet_NaN();
  CHECK(mentions(error_of<float>(nan_probs, map, 3, 2, 1, 1.0, probs_policy), "NaN"));
  CHECK(error_of<float>(nan_probs, map, 3, 2, 1, 1.0, mrr::DropPolicy::position).empty());
  auto bad_map = map;
  bad_map[4] = 2;
  for (const auto policy : {mrr::DropPolicy::probs, mrr::DropPolicy::position})
    CHECK(mentions(error_of<float>(probs, bad_map, 3, 2, 1, 1.0, policy), "other than 0 and 1"));
}
