// The device views of permute and combine (forward and backward) on the CUDA system against the
// CPU functions, bit for bit: int32 and int64 ids, strided rows (copied by element and in 16-byte
// units), a dropped slot (the radix-sort permutation: CUB's), and an int64 id
// of 2^32 + e rejected. Exits 77 (ctest: skipped) without a GPU.
#define DOCTEST_CONFIG_IMPLEMENT
#include <mrr/router.hpp>

#include <doctest/doctest.h>

#include "device_routing.hpp"
#include "permute_views.hpp"

#include <cstdio>
#include <random>

namespace {

mrr::RowMatrix<float> block(const std::vector<float>& v, long rows, long cols, long stride) {
  mrr::RowMatrix<float> m(rows, cols);
  for (long r = 0; r < rows; ++r)
    for (long c = 0; c < cols; ++c) m(r, c) = v[static_cast<std::size_t>(r * stride + c)];
  return m;
}

struct Case {
  mrr::Routing<float> routing;
  mrr::test::PermuteViewsInput in;
};

Case make_case(bool int64_ids, double capacity_factor, long hidden = 300) {
  Case c;
  auto& in = c.in;
  in.tokens = 3001;
  in.hidden = hidden;
  in.stride = 320;
  in.experts = 32;
  in.k = 4;
  in.int64_ids = int64_ids;
  std::mt19937 rng(11);
  std::normal_distribution<float> n(0.f, 1.f);
  mrr::RowMatrix<float> z(in.tokens, in.experts);
  for (Eigen::Index i = 0; i < z.size(); ++i) z.data()[i] = n(rng);
  auto cfg = mrr::presets::qwen3_moe(in.experts, in.k, true);
  if (capacity_factor > 0) cfg.capacity_factor = capacity_factor;
  c.routing = mrr::TopKRouter<float>(cfg).route(z);
  const long slots = in.tokens * in.k;
  in.ids.assign(c.routing.ids.data(), c.routing.ids.data() + slots);
  if (c.routing.has_capacity_mask()) in.kept.assign(c.routing.kept.data(), c.routing.kept.data() + slots);
  in.weights.assign(c.routing.weights.data(), c.routing.weights.data() + slots);
  auto fill = [&](std::vector<float>& v, long rows) {
    v.resize(static_cast<std::size_t>(rows * in.stride));
    for (auto& e : v) e = n(rng);
  };
  fill(in.x, in.tokens);
  fill(in.expert_out, slots);
  fill(in.grad_out, in.tokens);
  return c;
}

bool equal_block(const std::vector<float>& v, long stride, const mrr::RowMatrix<float>& m) {
  return block(v, m.rows(), m.cols(), stride) == m;
}

}  // namespace

TEST_CASE("CUDA device views: permute, combine and backward equal the CPU's bit for bit") {
  // hidden 300 copies element by element; 320 (rows of 1280 bytes) in 16-byte units.
  for (const long hidden : {300L, 320L})
    for (const bool wide : {false, true})
      for (const double cf : {0.0, 0.5}) {
        CAPTURE(hidden);
        CAPTURE(wide);
        CAPTURE(cf);
        const Case c = make_case(wide, cf, hidden);
        const auto out = mrr::test::cuda_permute_views(c.in);
        REQUIRE(out.error == "");
        const auto& in = c.in;
        const auto perm = mrr::make_expert_permutation(c.routing, in.experts);
        REQUIRE(out.offsets.back() == perm.rows());
        CHECK(std::equal(perm.source_token.begin(), perm.source_token.end(), out.source_token.begin()));
        const auto x = block(in.x, in.tokens, in.hidden, in.stride);
        const auto y = block(in.expert_out, perm.rows(), in.hidden, in.stride);
        CHECK(equal_block(out.permuted, in.stride, mrr::permute_tokens<float>(x, perm)));
        CHECK(equal_block(out.grad_x, in.stride, mrr::permute_tokens_backward<float>(y, perm)));
        // Combine multiply-adds: nvcc may fuse them (FMA), so within 1e-5 of the CPU's (values ~ 1).
        const auto cpu = mrr::combine<float>(y, c.routing, perm);
        CHECK((block(out.combined, in.tokens, in.hidden, in.stride) - cpu).cwiseAbs().maxCoeff() <= 1e-5f);
        const auto g =
            mrr::combine_backward<float>(block(in.grad_out, in.tokens, in.hidden, in.stride), y, c.routing, perm);
        CHECK(equal_block(out.grad_expert_out, in.stride, g.expert_out));
      }
}

TEST_CASE("CUDA device views: an int64 id of 2^32 + e is rejected, never read as e") {
  Case c = make_case(true, 0);
  c.in.ids[9] = (std::int64_t{1} << 32) + 3;
  const auto out = mrr::test::cuda_permute_views(c.in);
  CHECK(out.error.find("token 2 slot 1") != std::string::npos);
}

#include "gpu_test_main.hpp"
