// Host interface of permute_views.cu: the device views of permute and combine (forward and
// backward) run on the CUDA system, on device buffers the test owns and its own stream, by the
// same body as the OpenMP test (tests/device/permute_views_body.hpp). Plain functions: no Eigen,
// no doctest across nvcc.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace mrr::test {

struct PermuteViewsInput {
  long tokens = 0, hidden = 0, stride = 0;
  int experts = 0, k = 0;
  std::vector<std::int64_t> ids;  // [tokens, k], passed to the views as int64 (wide) or int32
  bool int64_ids = false;
  std::vector<std::uint8_t> kept;  // empty: every slot dispatched
  std::vector<float> x, expert_out, grad_out;  // [tokens | tokens * k, stride]
  std::vector<float> weights;                  // [tokens, k]
};

struct PermuteViewsOutput {
  std::vector<std::int32_t> source_token, row_of_slot, offsets;
  std::vector<float> permuted, combined, grad_x, grad_expert_out, grad_weights;
  std::string error;  // empty on success, else the error the views raised
};

PermuteViewsOutput cuda_permute_views(const PermuteViewsInput& in);

}  // namespace mrr::test
