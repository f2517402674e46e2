// The device router's view API (DESIGN.md section 11) on buffers the test owns, written once and
// run on every Thrust system: tests/device/test_router_views.cpp on OpenMP (host buffers) and
// tests/cuda/router_views.cu on CUDA (cudaMalloc buffers). No Eigen and no doctest here (nvcc
// compiles it): the caller computes the CPU router's answers, and the body reports what differs.
#pragma once

#include "router_views.hpp"

#include <mrr/router/config.hpp>
#include <mrr/thrust/bf16.hpp>
#include <mrr/thrust/execution.hpp>
#include <mrr/thrust/routing.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace mrr::test {

namespace views_detail {

inline bool close(float a, float b) {
  return std::abs(a - b) <= 1e-6f * std::max(1.0f, std::abs(b));
}

template <class A, class B>
bool same_ids(const std::vector<A>& got, const std::vector<B>& want) {
  if (got.size() != want.size()) return false;
  for (std::size_t i = 0; i < got.size(); ++i)
    if (static_cast<long long>(got[i]) != static_cast<long long>(want[i])) return false;
  return true;
}

// Row-strided [rows, cols] from contiguous, rows padded with `pad`.
template <class U>
std::vector<U> padded(const std::vector<U>& v, long rows, long cols, long stride, U pad) {
  std::vector<U> out(static_cast<std::size_t>(rows * stride), pad);
  for (long r = 0; r < rows; ++r)
    for (long c = 0; c < cols; ++c)
      out[static_cast<std::size_t>(r * stride + c)] = v[static_cast<std::size_t>(r * cols + c)];
  return out;
}

template <class U>
std::vector<U> unpadded(const std::vector<U>& v, long rows, long cols, long stride) {
  std::vector<U> out(static_cast<std::size_t>(rows * cols));
  for (long r = 0; r < rows; ++r)
    for (long c = 0; c < cols; ++c)
      out[static_cast<std::size_t>(r * cols + c)] = v[static_cast<std::size_t>(r * stride + c)];
  return out;
}

}  // namespace views_detail

// Mem::Buffer<U>: backend memory the test owns; Buffer(host vector), Buffer(n), data(), host().
// count_allocations: operator new calls so far in this process.
template <class Mem>
RouterViewReport run_router_view_checks(const RouterViewInputs& in, long (*count_allocations)()) {
  using namespace views_detail;
  using device::Execution;
  using device::MatrixView;
  using device::Workspace;
  RouterViewReport report;
  auto expect = [&](bool ok, const std::string& what) {
    if (!ok) report.failures.push_back(what);
  };
  auto expect_throw = [&](auto&& call, const std::string& contains, const std::string& what) {
    try {
      call();
      report.failures.push_back(what + ": did not throw");
    } catch (const std::invalid_argument& e) {
      if (std::string(e.what()).find(contains) == std::string::npos)
        report.failures.push_back(what + ": message '" + e.what() + "' lacks '" + contains + "'");
    }
  };

  const device::TopKRouter<float> router(in.config);
  const long rows = in.rows, E = in.config.num_experts, k = in.config.topk;
  const long stride = E + 3;  // padded rows; the padding holds NaN, which no kernel may read
  const Execution exec{};
  const float nan = std::numeric_limits<float>::quiet_NaN();

  typename Mem::template Buffer<float> logits(padded(in.logits, rows, E, stride, nan));
  std::vector<bf16> rounded(in.logits.size());
  for (std::size_t i = 0; i < rounded.size(); ++i)
    rounded[i] = bf16::from_float(in.logits[i]);
  typename Mem::template Buffer<bf16> logits_bf16(padded(rounded, rows, E, stride, bf16::from_float(nan)));
  std::vector<std::int64_t> ids64_host(in.ids.begin(), in.ids.end());
  typename Mem::template Buffer<std::int32_t> given32(in.ids);
  typename Mem::template Buffer<std::int64_t> given64(ids64_host);
  std::vector<std::uint8_t> mask_host(static_cast<std::size_t>(rows));
  for (long r = 0; r < rows; ++r)
    mask_host[static_cast<std::size_t>(r)] = r % 3 != 0;  // every third row routes
  typename Mem::template Buffer<std::uint8_t> mask(mask_host);
  typename Mem::template Buffer<float> grad_weights(in.grad_weights);
  typename Mem::template Buffer<std::int32_t> ids32(static_cast<std::size_t>(rows * k));
  typename Mem::template Buffer<std::int64_t> ids64(static_cast<std::size_t>(rows * k));
  typename Mem::template Buffer<float> weights(static_cast<std::size_t>(rows * k));
  typename Mem::template Buffer<float> grad(static_cast<std::size_t>(rows * stride));
  typename Mem::template Buffer<std::uint8_t> status(static_cast<std::size_t>(rows));
  typename Mem::template Buffer<char> ws_buffer(device::TopKRouter<float>::workspace_bytes(rows));
  const Workspace ws{ws_buffer.data(), device::TopKRouter<float>::workspace_bytes(rows)};

  const MatrixView<const float> z(logits.data(), rows, E, stride);
  const MatrixView<const bf16> z16(logits_bf16.data(), rows, E, stride);
  const MatrixView<const std::int32_t> g32(given32.data(), rows, k);
  const MatrixView<const std::int64_t> g64(given64.data(), rows, k);
  const MatrixView<std::int32_t> out32(ids32.data(), rows, k);
  const MatrixView<std::int64_t> out64(ids64.data(), rows, k);
  const MatrixView<float> w(weights.data(), rows, k);
  const MatrixView<const float> gw(grad_weights.data(), rows, k);
  const MatrixView<float> dz(grad.data(), rows, E, stride);
  auto weights_match = [&] {
    const auto got = weights.host();
    for (std::size_t i = 0; i < got.size(); ++i)
      if (!close(got[i], in.weights[i])) return false;
    return true;
  };
  auto grad_matches = [&](const std::vector<float>& want) {
    const auto got = unpadded(grad.host(), rows, E, stride);
    for (std::size_t i = 0; i < got.size(); ++i)
      if (!close(got[i], want[i])) return false;
    return true;
  };
  auto all_ok = [&] {
    for (auto s : status.host())
      if (s != 0) return false;
    return true;
  };

  // Every call once before counting: OpenMP starts its thread team on the first parallel region.
  router.route(exec, z, out32, w, status.data(), ws);
  router.check_route(exec, z, out32, w, status.data(), ws);

  // Operator new calls inside the view calls (the test's own host() copies are not counted).
  long hot = 0;
  auto counted = [&](auto&& call) {
    const long before = count_allocations();
    call();
    hot += count_allocations() - before;
  };
  // Route: strided rows in, int32 and int64 ids out, equal to the CPU router's.
  counted([&] { router.route(exec, z, out32, w, status.data(), ws); });
  counted([&] { router.check_route(exec, z, out32, w, status.data(), ws); });
  const auto route_ids = ids32.host();
  const bool route_weights = weights_match();
  counted([&] { router.route(exec, z, out64, w, status.data(), ws); });
  const auto route_ids64 = ids64.host();
  // Replay: int64 ids, without and with a mask (masked-out rows route natively: the same ids).
  counted([&] { router.replay(exec, z, g64, nullptr, out64, w, status.data(), ws); });
  const auto replay_ids64 = ids64.host();
  const bool replay_weights = weights_match();
  counted([&] { router.replay(exec, z, g32, mask.data(), out32, w, status.data(), ws); });
  counted([&] { router.check_replay(exec, z, g32, mask.data(), out32, w, status.data(), ws); });
  const auto masked_ids = ids32.host();
  const bool masked_status = all_ok();
  // Backward from int32 and int64 ids.
  counted([&] { router.backward(exec, z, g32, gw, nullptr, dz, status.data(), ws); });
  const bool grad32 = grad_matches(in.grad);
  counted([&] { router.backward(exec, z, g64, gw, nullptr, dz, status.data(), ws); });
  counted([&] { router.check_backward(exec, z, g64, gw, nullptr, dz, status.data(), ws); });
  const bool grad64 = grad_matches(in.grad);
  // bf16 logits: route and backward.
  counted([&] { router.route(exec, z16, out32, w, status.data(), ws); });
  const auto bf16_ids = ids32.host();
  typename Mem::template Buffer<std::int32_t> bf16_given(in.bf16_ids);
  counted([&] {
    router.backward(exec, z16, MatrixView<const std::int32_t>(bf16_given.data(), rows, k), gw, nullptr, dz,
                    status.data(), ws);
  });
  const bool grad16 = grad_matches(in.bf16_grad);

  expect(same_ids(route_ids, in.ids), "route: int32 ids differ from the CPU router's");
  expect(route_weights, "route: weights differ from the CPU router's beyond 1e-6");
  expect(same_ids(route_ids64, in.ids), "route: int64 ids differ from the CPU router's");
  expect(same_ids(replay_ids64, in.ids), "replay: int64 ids are not the given ones");
  expect(replay_weights, "replay: weights differ from the CPU router's beyond 1e-6");
  expect(same_ids(masked_ids, in.ids) && masked_status, "replay with a mask: ids differ or a row failed");
  expect(grad32, "backward (int32 ids): gradient differs from the CPU router's");
  expect(grad64, "backward (int64 ids): gradient differs from the CPU router's");
  expect(same_ids(bf16_ids, in.bf16_ids),
         "route (bf16 logits): ids differ from the CPU router's on bf16-rounded logits");
  expect(grad16, "backward (bf16 logits): gradient differs from the CPU router's on bf16-rounded logits");
  report.hot_allocations = hot;

  // A column-strided input is an error, never a silent copy.
  expect_throw(
      [&] {
        router.route(exec, MatrixView<const float>(logits.data(), rows, E, stride, 2), out32, w, status.data(), ws);
      },
      "column stride 2", "route with column stride 2");

  // An int64 id of 2^32 + e is out of range (never silently e): that row's status, then the check's error.
  {
    auto bad = ids64_host;
    const std::int64_t e = bad[static_cast<std::size_t>(3 * k + 1)];
    bad[static_cast<std::size_t>(3 * k + 1)] = (std::int64_t{1} << 32) + e;
    typename Mem::template Buffer<std::int64_t> bad_ids(bad);
    const MatrixView<const std::int64_t> b(bad_ids.data(), rows, k);
    bool threw = false;
    try {
      router.replay(exec, z, b, nullptr, out32, w, status.data(), ws);
    } catch (const std::exception&) {
      threw = true;
    }
    expect(!threw, "replay of an out-of-range int64 id threw before the check");
    const auto s = status.host();
    bool others_ok = true;
    for (long r = 0; r < rows; ++r)
      others_ok = others_ok && (r == 3 || s[static_cast<std::size_t>(r)] == 0);
    expect(s[3] == mrr::kernels::row_invalid_replay && others_ok, "status does not name row 3 alone as invalid_replay");
    expect_throw([&] { router.check_replay(exec, z, b, nullptr, out32, w, status.data(), ws); },
                 "row 3 slot 1 has expert id " + std::to_string((std::int64_t{1} << 32) + e) + " outside [0, " +
                     std::to_string(E) + ")",
                 "check_replay of an int64 id 2^32 + e");
  }

  // A bad row is reported in the status buffer without throwing; the check names it as the CPU does.
  {
    auto poisoned = padded(in.logits, rows, E, stride, nan);
    poisoned[static_cast<std::size_t>(5 * stride + 2)] = nan;
    typename Mem::template Buffer<float> bad_logits(poisoned);
    const MatrixView<const float> bz(bad_logits.data(), rows, E, stride);
    bool threw = false;
    try {
      router.route(exec, bz, out32, w, status.data(), ws);
    } catch (const std::exception&) {
      threw = true;
    }
    expect(!threw, "route of a NaN row threw before the check");
    const auto s = status.host();
    expect(s[5] == mrr::kernels::row_invalid_logit, "status[5] is not row_invalid_logit");
    expect_throw([&] { router.check_route(exec, bz, out32, w, status.data(), ws); }, "logits row 5 has nan at expert 2",
                 "check_route of a NaN row");
  }

  // At a trainer's batch size, with the workspace workspace_bytes asks for: a clean batch passes
  // its check; with two bad rows the check names the lower one (whatever order rows ran in).
  {
    const long big = 70000;
    std::vector<float> host(static_cast<std::size_t>(big * E));
    std::uint32_t state = 12345;
    for (auto& x : host) {
      state = state * 1664525u + 1013904223u;
      x = static_cast<float>(state >> 8) * (1.0f / 16777216.0f) * 8.0f - 4.0f;
    }
    typename Mem::template Buffer<float> big_logits(host);
    typename Mem::template Buffer<std::int64_t> big_ids(static_cast<std::size_t>(big * k));
    typename Mem::template Buffer<float> big_w(static_cast<std::size_t>(big * k));
    typename Mem::template Buffer<std::uint8_t> big_status(static_cast<std::size_t>(big));
    const std::size_t bytes = device::TopKRouter<float>::workspace_bytes(big);
    typename Mem::template Buffer<char> big_ws_buffer(bytes);
    const Workspace big_ws{big_ws_buffer.data(), bytes};
    const MatrixView<const float> bz(big_logits.data(), big, E);
    const MatrixView<std::int64_t> bi(big_ids.data(), big, k);
    const MatrixView<float> bw(big_w.data(), big, k);
    try {
      router.route(exec, bz, bi, bw, big_status.data(), big_ws);
      router.check_route(exec, bz, bi, bw, big_status.data(), big_ws);
    } catch (const std::exception& e) {
      report.failures.push_back(std::string("check_route of a clean batch of 70000 rows threw: ") + e.what());
    }
    host[static_cast<std::size_t>(69999 * E + 1)] = nan;
    host[static_cast<std::size_t>(50001 * E + 3)] = nan;
    typename Mem::template Buffer<float> poisoned(host);
    const MatrixView<const float> pz(poisoned.data(), big, E);
    router.route(exec, pz, bi, bw, big_status.data(), big_ws);
    expect_throw([&] { router.check_route(exec, pz, bi, bw, big_status.data(), big_ws); },
                 "logits row 50001 has nan at expert 3", "check_route of 70000 rows, rows 50001 and 69999 bad");
  }
  return report;
}

}  // namespace mrr::test
