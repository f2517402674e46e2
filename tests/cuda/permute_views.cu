// The device views of permute and combine on the CUDA system: device buffers this file owns, a
// stream of its own, workspace sized by permutation_workspace_bytes, the OpenMP test's body.
#include "../device/permute_views_body.hpp"
#include "permute_views.hpp"

#include <thrust/copy.h>
#include <thrust/device_vector.h>

#include <cuda_runtime_api.h>

#include "../device/device_vectors.hpp"

#include <exception>

namespace mrr::test {

namespace {

template <class Id>
PermuteViewsOutput run(const PermuteViewsInput& in) {
  PermuteViewsOutput out;
  cudaStream_t stream = nullptr;
  if (cudaStreamCreate(&stream) != cudaSuccess) {
    out.error = "cudaStreamCreate failed";
    return out;
  }
  try {
    const long slots = in.tokens * in.k;
    const std::vector<Id> host_ids(in.ids.begin(), in.ids.end());
    const thrust::device_vector<Id> ids(host_ids.begin(), host_ids.end());
    const thrust::device_vector<std::uint8_t> kept(in.kept.begin(), in.kept.end());
    const thrust::device_vector<float> x(in.x.begin(), in.x.end()), expert_out(in.expert_out.begin(), in.expert_out.end()),
        grad_out(in.grad_out.begin(), in.grad_out.end()), weights(in.weights.begin(), in.weights.end());
    thrust::device_vector<std::int32_t> source_token(static_cast<std::size_t>(slots)), row_of_slot(source_token.size()),
        offsets(static_cast<std::size_t>(in.experts) + 1);
    thrust::device_vector<std::uint8_t> workspace(
        mrr::device::permutation_workspace_bytes(in.tokens, in.k, in.experts));
    thrust::device_vector<mrr::device::DeviceStatus> status(1);
    thrust::device_vector<float> permuted(static_cast<std::size_t>(slots * in.stride)),
        combined(static_cast<std::size_t>(in.tokens * in.stride)), grad_x(combined.size()),
        grad_expert_out(permuted.size()), grad_weights(static_cast<std::size_t>(slots));
    PermuteViewCall<Id> c;
    c.tokens = in.tokens;
    c.hidden = in.hidden;
    c.stride = in.stride;
    c.experts = in.experts;
    c.k = in.k;
    c.ids = thrust::raw_pointer_cast(ids.data());
    c.kept = in.kept.empty() ? nullptr : thrust::raw_pointer_cast(kept.data());
    c.x = thrust::raw_pointer_cast(x.data());
    c.expert_out = thrust::raw_pointer_cast(expert_out.data());
    c.grad_out = thrust::raw_pointer_cast(grad_out.data());
    c.weights = thrust::raw_pointer_cast(weights.data());
    c.source_token = thrust::raw_pointer_cast(source_token.data());
    c.row_of_slot = thrust::raw_pointer_cast(row_of_slot.data());
    c.offsets = thrust::raw_pointer_cast(offsets.data());
    c.workspace = thrust::raw_pointer_cast(workspace.data());
    c.workspace_bytes = workspace.size();
    c.status = thrust::raw_pointer_cast(status.data());
    c.permuted = thrust::raw_pointer_cast(permuted.data());
    c.combined = thrust::raw_pointer_cast(combined.data());
    c.grad_x = thrust::raw_pointer_cast(grad_x.data());
    c.grad_expert_out = thrust::raw_pointer_cast(grad_expert_out.data());
    c.grad_weights = thrust::raw_pointer_cast(grad_weights.data());
    run_permute_views(c, mrr::device::Execution{stream});
    if (cudaStreamSynchronize(stream) != cudaSuccess) throw std::runtime_error("cudaStreamSynchronize failed");
    out.source_token = to_host(source_token);
    out.row_of_slot = to_host(row_of_slot);
    out.offsets = to_host(offsets);
    out.permuted = to_host(permuted);
    out.combined = to_host(combined);
    out.grad_x = to_host(grad_x);
    out.grad_expert_out = to_host(grad_expert_out);
    out.grad_weights = to_host(grad_weights);
  } catch (const std::exception& e) {
    out.error = e.what();
  }
  cudaStreamDestroy(stream);
  return out;
}

}  // namespace

PermuteViewsOutput cuda_permute_views(const PermuteViewsInput& in) {
  return in.int64_ids ? run<std::int64_t>(in) : run<std::int32_t>(in);
}

}  // namespace mrr::test
