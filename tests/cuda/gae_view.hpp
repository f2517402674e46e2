// The GAE view on the device system's buffers (thrust_cuda.hpp's cuda_gae_view and
// cuda_gae_blocks_fit): instantiated for CUDA by thrust_cuda.cu, and on the host under the lane
// emulator by tests/device/test_gae_blocks_emulated.cpp. Include after mrr/thrust/ppo.hpp.
#pragma once

#include "../device/device_vectors.hpp"
#include "thrust_cuda.hpp"

#include <exception>
#include <string>
#include <vector>

namespace mrr::test {

template <class T>
std::string cuda_gae_view(const std::vector<T>& rewards, const std::vector<T>& values, const std::vector<T>& mask,
                          long rows, long cols, long stride, int algorithm, T fill, std::vector<T>& advantages,
                          std::vector<T>& returns, int& code) {
  try {
    const auto a = algorithm == 4 ? device::GaeAlgorithm::blocks : device::GaeAlgorithm::chunks;
    const thrust::device_vector<T> r(rewards.begin(), rewards.end()), v(values.begin(), values.end()),
        m(mask.begin(), mask.end());
    thrust::device_vector<T> adv(rewards.size(), fill), ret(rewards.size(), fill);
    thrust::device_vector<unsigned char> workspace(device::gae_workspace_bytes<T>(rows, cols, a));
    thrust::device_vector<device::DeviceStatus> status(1);
    // A stale code: the view must reset it.
    status[0] = device::DeviceStatus{99, 7};
    const auto in = [&](const thrust::device_vector<T>& d) {
      return device::MatrixView<const T>{thrust::raw_pointer_cast(d.data()), rows, cols, stride};
    };
    const auto out = [&](thrust::device_vector<T>& d) {
      return device::MatrixView<T>{thrust::raw_pointer_cast(d.data()), rows, cols, stride};
    };
    device::compute_gae_advantage_return<T>(
        in(r), in(v), in(m), 0.99, 0.95, out(adv), out(ret),
        device::Workspace{thrust::raw_pointer_cast(workspace.data()), workspace.size()},
        thrust::raw_pointer_cast(status.data()), {}, a);
    code = device::read_status(thrust::raw_pointer_cast(status.data()), device::Execution{}).code;
    advantages = to_host(adv);
    returns = to_host(ret);
  } catch (const std::exception& e) {
    return e.what();
  }
  return {};
}

template <class T>
GaeBlocksFit cuda_gae_blocks_fit(long rows, long cols) {
  const long chunks = (cols + device::kernels::kGaeChunk - 1) / device::kernels::kGaeChunk;
  const long supers = device::ppo_detail::gae_supers_per_row(cols);
  return {device::ppo_detail::gae_blocks_fit<T>(rows, chunks, supers),
          device::kernels::GaeBlockShared<T>(chunks, supers).bytes, device::ppo_detail::gae_shared_optin()};
}

}  // namespace mrr::test
