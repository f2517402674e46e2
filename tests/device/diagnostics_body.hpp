// mrr/thrust/diagnostics.hpp on buffers the test owns, written once and run on every Thrust
// system: tests/device on OpenMP (host buffers), tests/cuda on CUDA (cudaMalloc buffers). No
// doctest here (nvcc compiles it): the body returns what the device computed, and the caller
// compares it with the host functions (diagnostics_cases.hpp).
#pragma once

#include "diagnostics_types.hpp"

#include <mrr/thrust/diagnostics.hpp>
#include <mrr/thrust/execution.hpp>

#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace mrr::test {

// Mem::Buffer<U>: backend memory the test owns; Buffer(host vector), Buffer(n), data(), host().
template <class Mem>
DiagnosticsResults run_device_diagnostics(const DiagnosticsInputs& in) {
  using device::Execution;
  using device::MatrixView;
  using device::Workspace;
  DiagnosticsResults out;
  const Execution exec{};
  auto error = [&](auto&& call) {  // records the message of a call that must fail ("" if it did not)
    try {
      call();
      out.errors.emplace_back();
    } catch (const std::invalid_argument& e) {
      out.errors.emplace_back(e.what());
    }
  };
  {
    using Counter = device::RoutingMismatchCounter<>;
    typename Mem::template Buffer<unsigned char> ws(Counter::workspace_bytes(in.layers, in.rows));
    std::vector<typename Mem::template Buffer<std::int32_t>> a;
    std::vector<typename Mem::template Buffer<std::int64_t>> b;
    std::vector<typename Mem::template Buffer<std::uint8_t>> found;
    for (int l = 0; l < in.layers; ++l) {
      a.emplace_back(in.a[static_cast<std::size_t>(l)]);
      b.emplace_back(in.b[static_cast<std::size_t>(l)]);
      found.emplace_back(in.found.empty() ? std::vector<std::uint8_t>{} : in.found[static_cast<std::size_t>(l)]);
    }
    typename Mem::template Buffer<std::uint8_t> compare(in.compare);
    Counter c(exec, Workspace{ws.data(), Counter::workspace_bytes(in.layers, in.rows)}, in.layers, in.rows,
              in.compare.empty() ? nullptr : compare.data());
    for (int l = 0; l < in.layers; ++l) {
      const auto li = static_cast<std::size_t>(l);
      c.add_layer(l, MatrixView<const std::int32_t>(a[li].data(), in.rows, in.k, in.stride_a),
                  MatrixView<const std::int64_t>(b[li].data(), in.rows, in.k, in.stride_b),
                  in.found.empty() || in.found[li].empty() ? nullptr : found[li].data());
    }
    out.mismatch = c.result();
    error([&] {
      c.add_layer(in.layers, MatrixView<const std::int32_t>(a[0].data(), in.rows, in.k, in.stride_a),
                  MatrixView<const std::int64_t>(b[0].data(), in.rows, in.k, in.stride_b));
    });
    error([&] {
      c.add_layer(0, MatrixView<const std::int32_t>(a[0].data(), in.rows, in.k, in.stride_a),
                  MatrixView<const std::int64_t>(b[0].data(), in.rows - 1, in.k, in.stride_b));
    });
    error([&] {  // each layer once
      c.add_layer(0, MatrixView<const std::int32_t>(a[0].data(), in.rows, in.k, in.stride_a),
                  MatrixView<const std::int64_t>(b[0].data(), in.rows, in.k, in.stride_b));
    });
    error([&] { Counter(exec, Workspace{ws.data(), 16}, in.layers, in.rows); });
  }
  {
    const std::size_t bytes = device::logprob_divergence_workspace_bytes(in.lp_rows, in.lp_cols);
    typename Mem::template Buffer<unsigned char> ws(bytes);
    typename Mem::template Buffer<float> p(in.log_p), q(in.log_q), mask(in.mask);
    const MatrixView<const float> pv(p.data(), in.lp_rows, in.lp_cols, in.lp_stride);
    const MatrixView<const float> qv(q.data(), in.lp_rows, in.lp_cols, in.lp_stride);
    const MatrixView<const float> mv = in.mask.empty()
                                           ? MatrixView<const float>{}
                                           : MatrixView<const float>(mask.data(), in.lp_rows, in.lp_cols, in.lp_stride);
    out.divergence = device::logprob_divergence<float>(exec, Workspace{ws.data(), bytes}, pv, qv, mv, in.thresholds);
    // A non-finite log-prob at a counted token (the last row's second token), then one the mask
    // leaves out (not an error), then bad thresholds.
    std::vector<float> bad = in.log_p;
    const long at = (in.lp_rows - 1) * in.lp_stride + 1;
    bad[static_cast<std::size_t>(at)] = std::numeric_limits<float>::infinity();
    typename Mem::template Buffer<float> badp(bad);
    const MatrixView<const float> bv(badp.data(), in.lp_rows, in.lp_cols, in.lp_stride);
    std::vector<float> counted = in.mask.empty() ? std::vector<float>(in.log_p.size(), 1.0f) : in.mask;
    std::vector<float> masked = counted;
    counted[static_cast<std::size_t>(at)] = 1.0f;
    masked[static_cast<std::size_t>(at)] = 0.0f;
    typename Mem::template Buffer<float> countedb(counted), maskedb(masked);
    for (auto* m : {&countedb, &maskedb})
      error([&] {
        device::logprob_divergence<float>(exec, Workspace{ws.data(), bytes}, bv, qv,
                                          MatrixView<const float>(m->data(), in.lp_rows, in.lp_cols, in.lp_stride),
                                          in.thresholds);
      });
    const std::vector<double> one{1.0}, nine(9, 2.0);
    error([&] { device::logprob_divergence<float>(exec, Workspace{ws.data(), bytes}, pv, qv, mv, one); });
    error([&] { device::logprob_divergence<float>(exec, Workspace{ws.data(), bytes}, pv, qv, mv, nine); });
    error([&] { device::logprob_divergence<float>(exec, Workspace{ws.data(), bytes / 2}, pv, qv, mv, in.thresholds); });
  }
  return out;
}

}  // namespace mrr::test
