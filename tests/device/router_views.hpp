// The inputs and the report of the device router's view checks (router_views_body.hpp): plain
// types, so that host-compiled test files (doctest, Eigen) and nvcc-compiled ones share them.
#pragma once

#include <mrr/router/config.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace mrr::test {

// What the CPU router gives for the same inputs (row-major, contiguous).
struct RouterViewInputs {
  RouterConfig config;
  long rows = 0;
  std::vector<float> logits;           // [rows, E]
  std::vector<std::int32_t> ids;       // CPU route(logits)
  std::vector<float> weights;          // its weights
  std::vector<float> grad_weights;     // [rows, k] upstream gradient
  std::vector<float> grad;             // CPU backward(logits, ids, grad_weights)
  std::vector<std::int32_t> bf16_ids;  // CPU route of the logits rounded to bf16
  std::vector<float> bf16_grad;        // CPU backward there, at bf16_ids
};

struct RouterViewReport {
  std::vector<std::string> failures;  // empty: every check held
  long hot_allocations = -1;          // operator new calls in the view calls once the workspace is given
};

}  // namespace mrr::test
