// The inputs and results of the device diagnostics' body (diagnostics_body.hpp): plain types, so
// that host-compiled test files (doctest) and nvcc-compiled ones share them.
#pragma once

#include <mrr/diagnostics.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace mrr::test {

// Two routings of `rows` rows over `layers` layers, with row strides, and two log-prob matrices.
struct DiagnosticsInputs {
  int layers = 0, k = 0;
  long rows = 0, stride_a = 0, stride_b = 0;     // ids row strides (>= k)
  std::vector<std::vector<std::int32_t>> a;      // per layer [rows, stride_a]
  std::vector<std::vector<std::int64_t>> b;      // per layer [rows, stride_b]
  std::vector<std::uint8_t> compare;             // [rows] or empty
  std::vector<std::vector<std::uint8_t>> found;  // per layer, [rows] or empty
  long lp_rows = 0, lp_cols = 0, lp_stride = 0;
  std::vector<float> log_p, log_q, mask;  // [lp_rows, lp_stride]; mask empty: every token
  std::vector<double> thresholds;
};

struct DiagnosticsResults {
  RoutingMismatch mismatch;
  LogProbDivergence divergence;
  std::vector<std::string> errors;  // the messages of the bad calls, in order (empty string: did not throw)
};

}  // namespace mrr::test
