// Token dropping against Megatron's apply_router_token_dropping (router_capacity.json).
//
// Megatron picks each expert's `capacity` tokens with torch.topk, whose order among equal keys
// is implementation-defined. mrr orders equal keys by token index (the earliest token wins), so:
//  * every expert column whose reference selection is tie-free must match the golden exactly;
//  * in a tied column, ours keeps as many tokens, keeps routed tokens first, and breaks the tie
//    toward the earliest token;
//  * and, to show the remaining difference is the tie order alone, a re-enactment of ATen's CPU
//    top-k selection (nth_element / partial_sort over (value, index) pairs with a value-only
//    comparison) reproduces every golden column bit for bit.
#include <mrr/router.hpp>

#include <support/golden.hpp>

#include <algorithm>
#include <utility>
#include <vector>

using mrr::test::check_close;
using mrr::test::load_golden;

namespace {

// The set of rows ATen's topk(column, k, sorted=False) returns on the CPU.
std::vector<char> aten_cpu_topk_rows(const std::vector<double>& column, long k) {
  using Elem = std::pair<double, long>;
  std::vector<Elem> queue;
  for (long i = 0; i < static_cast<long>(column.size()); ++i) queue.emplace_back(column[static_cast<std::size_t>(i)], i);
  auto larger = [](const Elem& a, const Elem& b) { return a.first > b.first; };
  if (k * 64 <= static_cast<long>(queue.size()))
    std::partial_sort(queue.begin(), queue.begin() + k, queue.end(), larger);
  else
    std::nth_element(queue.begin(), queue.begin() + (k - 1), queue.end(), larger);
  std::vector<char> chosen(column.size(), 0);
  for (long i = 0; i < k; ++i) chosen[static_cast<std::size_t>(queue[static_cast<std::size_t>(i)].second)] = 1;
  return chosen;
}

}  // namespace

TEST_SUITE("golden") {
  TEST_CASE("router_capacity.json: token dropping, probs and position policies, with and without padding") {
    int exact_columns = 0, tied_columns = 0;
    for (const auto& c : load_golden("router_capacity.json", "token_dropping")) {
      mrr::test::guarded(c, [&] {
        CAPTURE(c.name);
        const auto probs = c.input("routing_probs").matrix<double>();
        const auto map = c.input("routing_map").matrix<std::uint8_t>();
        const auto golden_probs = c.output("probs").matrix<double>();
        const auto golden_map = c.output("routing_map").matrix<std::uint8_t>();
        const int topk = c.param<int>("topk");
        const double cf = c.param<double>("capacity_factor");
        const auto policy = mrr::parse_drop_policy(c.param<std::string>("drop_policy"));
        const bool pad = c.param<bool>("pad_to_capacity");
        const auto tokens = probs.rows();
        const auto experts = static_cast<int>(probs.cols());
        const long capacity = mrr::expert_capacity(tokens, topk, experts, cf);
        CHECK(capacity == c.param<long>("capacity"));

        const auto ours = mrr::apply_token_dropping<double>(probs, map, topk, cf, policy, pad);

        for (int e = 0; e < experts; ++e) {
          CAPTURE(e);
          std::vector<double> key(static_cast<std::size_t>(tokens));
          for (Eigen::Index t = 0; t < tokens; ++t)
            key[static_cast<std::size_t>(t)] = policy == mrr::DropPolicy::probs ? probs(t, e) : double(map(t, e) != 0);

          // ATen re-enactment reproduces the golden column exactly.
          const long keep = capacity > tokens ? tokens : capacity;
          const auto aten = aten_cpu_topk_rows(key, keep);
          for (Eigen::Index t = 0; t < tokens; ++t) {
            const bool in = aten[static_cast<std::size_t>(t)] != 0 && (pad || map(t, e) != 0);
            CHECK(golden_map(t, e) == static_cast<std::uint8_t>(in));
          }

          std::vector<double> sorted = key;
          std::sort(sorted.begin(), sorted.end(), std::greater<>());
          const bool tie_free =
              keep == tokens || sorted[static_cast<std::size_t>(keep - 1)] != sorted[static_cast<std::size_t>(keep)];
          if (tie_free) {
            ++exact_columns;
            for (Eigen::Index t = 0; t < tokens; ++t) {
              CHECK(ours.map(t, e) == golden_map(t, e));
              CHECK(ours.probs(t, e) == doctest::Approx(golden_probs(t, e)).epsilon(c.rtol));
            }
          } else {
            // Specification of the tie rule: every token above the boundary key, then the earliest
            // tokens at the boundary key, until the capacity is full.
            ++tied_columns;
            const double boundary = sorted[static_cast<std::size_t>(keep - 1)];
            long room = keep;
            for (double k : key)
              room -= k > boundary ? 1 : 0;
            long ours_count = 0, golden_count = 0;
            for (Eigen::Index t = 0; t < tokens; ++t) {
              const double k = key[static_cast<std::size_t>(t)];
              bool in_capacity = k > boundary;
              if (k == boundary && room > 0) {
                in_capacity = true;
                --room;
              }
              const bool expected = in_capacity && (pad || map(t, e) != 0);
              CHECK(ours.map(t, e) == static_cast<std::uint8_t>(expected));
              CHECK(ours.probs(t, e) == (expected ? probs(t, e) : 0.0));
              ours_count += ours.map(t, e);
              golden_count += golden_map(t, e);
            }
            CHECK(ours_count == golden_count);
          }
        }
      });
    }
    MESSAGE("token dropping: " << exact_columns << " tie-free expert columns match the golden exactly; "
                               << tied_columns << " tied columns follow mrr's earliest-token rule");
    CHECK(exact_columns > 0);
  }
}
