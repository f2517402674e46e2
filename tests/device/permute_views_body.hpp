// One forward and backward through the device views of permute and combine (thrust/permute.hpp),
// on pointers the caller owns: host memory for the OpenMP test (test_permute_views.cpp), device
// memory for the CUDA one (tests/cuda/permute_views.cu). Plain code, no doctest: nvcc compiles it.
#pragma once

#include <mrr/thrust/permute.hpp>

#include <cstddef>
#include <cstdint>

namespace mrr::test {

// Activations are [rows, hidden] with rows `stride` elements apart; ids, weights, kept and
// grad_weights are contiguous [tokens, k].
template <class Id>
struct PermuteViewCall {
  long tokens = 0, hidden = 0, stride = 0;
  int experts = 0, k = 0;
  const Id* ids = nullptr;
  const std::uint8_t* kept = nullptr;  // null: every slot dispatched
  const float *x = nullptr, *expert_out = nullptr, *grad_out = nullptr, *weights = nullptr;
  std::int32_t *source_token = nullptr, *row_of_slot = nullptr, *offsets = nullptr;
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
  mrr::device::DeviceStatus* status = nullptr;
  float *permuted = nullptr, *combined = nullptr, *grad_x = nullptr, *grad_expert_out = nullptr,
        *grad_weights = nullptr;

  mrr::device::PermutationView permutation() const {
    return {source_token, row_of_slot, offsets, tokens, k, experts};
  }
};

// Enqueues the permutation, permute, combine, permute's backward and combine's backward on
// x.stream; checks the status (synchronising) after the permutation, as a trainer would.
template <class Id>
void run_permute_views(const PermuteViewCall<Id>& c, mrr::device::Execution x) {
  namespace dev = mrr::device;
  const long slots = c.tokens * c.k;
  const dev::PermutationView p = c.permutation();
  dev::make_expert_permutation(dev::matrix_view<const Id>(c.ids, c.tokens, c.k), c.kept, p,
                               dev::Workspace{c.workspace, c.workspace_bytes}, c.status, x);
  dev::check_permutation(c.status, p, x);
  const auto weights = dev::matrix_view<const float>(c.weights, c.tokens, c.k);
  const auto expert_out = dev::matrix_view<const float>(c.expert_out, slots, c.hidden, c.stride);
  dev::permute_tokens(dev::matrix_view<const float>(c.x, c.tokens, c.hidden, c.stride), p,
                      dev::matrix_view(c.permuted, slots, c.hidden, c.stride), x);
  dev::combine(expert_out, weights, p, dev::matrix_view(c.combined, c.tokens, c.hidden, c.stride), x);
  dev::permute_tokens_backward(expert_out, p, dev::matrix_view(c.grad_x, c.tokens, c.hidden, c.stride), x);
  dev::combine_backward(dev::matrix_view<const float>(c.grad_out, c.tokens, c.hidden, c.stride), expert_out, weights,
                        p, dev::matrix_view(c.grad_expert_out, slots, c.hidden, c.stride),
                        dev::matrix_view(c.grad_weights, c.tokens, c.k), x);
}

}  // namespace mrr::test
