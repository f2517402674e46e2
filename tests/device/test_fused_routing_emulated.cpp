// The fused routing kernels (mrr/cuda/routing_kernels.cuh) run on the host by the lane emulator,
// through the same launchers (cuda::detail::route_with) and the same test cases as on a GPU
// (tests/cuda/fused_routing_cases.hpp): CI has no GPU, so this is where every change to their
// logic is checked first. Values come from the host's expf, so ids and weights compare with the
// CPU router as the GPU's do, and the segment kernel with the warp kernel bit for bit.
#include <mrr/router.hpp>
#include <mrr/thrust/routing.hpp>

#include <doctest/doctest.h>

#include "cuda/device_routing.hpp"

#include <cstddef>
#include <cstdint>
#include <exception>
#include <stdexcept>
#include <string>
#include <vector>

// Last: it defines the CUDA keywords as macros.
#include "support/lane_emulator.hpp"

#include <mrr/cuda/routing_kernels.cuh>

namespace mrr::test {
namespace {

template <class In>
FusedRoute fused_route(const RouterConfig& config, const In* logits, long rows, const float* bias,
                       const std::int32_t* replay_ids, const std::uint8_t* replay_mask, bool warps_only) {
  FusedRoute out;
  try {
    config.validate();
  } catch (const std::exception& e) {
    out.error = e.what();
    return out;
  }
  const device::RouterParams p = device::resolve(config);
  const std::size_t slots = static_cast<std::size_t>(rows) * static_cast<std::size_t>(p.topk);
  // Outputs start as garbage a kernel must overwrite (the GPU test's cudaMalloc gives no zeros).
  out.ids.assign(slots, 0x5a5a5a5a);
  out.weights.assign(slots, 1234.5f);
  out.status.assign(static_cast<std::size_t>(rows), 0xee);
  namespace cd = mrr::cuda::detail;
  if (warps_only && !mrr::cuda::fused_routing_supports(p)) {
    out.error = "invalid argument";
    return out;
  }
  const std::int32_t* replay = replay_ids;
  const std::uint8_t* mask = replay_ids ? replay_mask : nullptr;
  cd::LaunchStatus s;
  try {
    s = warps_only ? cd::route_warps_with(mrr_emu::HostLaunch{}, p, logits, bias, replay, mask, rows, out.ids.data(),
                                          out.weights.data(), out.status.data())
                   : cd::route_with(mrr_emu::HostLaunch{}, p, logits, bias, replay, mask, rows, out.ids.data(),
                                    out.weights.data(), out.status.data());
  } catch (const std::logic_error& e) {
    out.error = e.what();  // the emulator found a warp intrinsic some lanes never reach
    return out;
  }
  // cudaGetErrorString's words for the codes fused_routing.cuh turns these into.
  if (s == cd::LaunchStatus::invalid_value) out.error = "invalid argument";
  if (s == cd::LaunchStatus::too_many_blocks) out.error = "invalid configuration argument";
  return out;
}

}  // namespace

#include "cuda/fused_route_functions.inc"

}  // namespace mrr::test

#include "cuda/fused_routing_cases.hpp"
