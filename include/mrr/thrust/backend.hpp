// mrr-requires: mrr_thrust_omp
// The Thrust execution backend: device operations written once against Thrust algorithms and
// MRR_HOST_DEVICE functors, compiled for whichever Thrust system the translation unit selects:
// OpenMP (g++ -fopenmp -DTHRUST_DEVICE_SYSTEM=THRUST_DEVICE_SYSTEM_OMP, no GPU needed) or CUDA
// (nvcc, the default device system). Kernels take plain resolved types; concepts stay on the host.
#pragma once

#include <mrr/detail/config.hpp>

#include <thrust/device_vector.h>
#include <thrust/execution_policy.h>
#include <thrust/host_vector.h>

#include <string_view>

MRR_NAMESPACE_BEGIN

// The system a backend runs on: Thrust's device system (CUDA or OpenMP, fixed per translation unit
// by THRUST_DEVICE_SYSTEM) or its host system (sequential C++).
struct ThrustDeviceSystem {};
struct ThrustHostSystem {};

template <class System>
struct ThrustBackend;

template <>
struct ThrustBackend<ThrustDeviceSystem> {
#if THRUST_DEVICE_SYSTEM == THRUST_DEVICE_SYSTEM_CUDA
  static constexpr std::string_view name = "thrust-cuda";
  static constexpr bool is_device = true;
#elif THRUST_DEVICE_SYSTEM == THRUST_DEVICE_SYSTEM_OMP
  static constexpr std::string_view name = "thrust-omp";
  static constexpr bool is_device = false;  // host memory, OpenMP threads
#else
  static constexpr std::string_view name = "thrust-device";
  static constexpr bool is_device = false;
#endif
  template <class T>
  using vector = thrust::device_vector<T>;
  static auto policy() { return thrust::device; }
};

template <>
struct ThrustBackend<ThrustHostSystem> {
  static constexpr std::string_view name = "thrust-host";
  static constexpr bool is_device = false;
  template <class T>
  using vector = thrust::host_vector<T>;
  static auto policy() { return thrust::host; }
};

using ThrustDeviceBackend = ThrustBackend<ThrustDeviceSystem>;

namespace device {

// Raw pointer to a Thrust vector's storage, for functors (plain pointers cross into device code).
template <class Vector>
auto raw(Vector& v) {
  return thrust::raw_pointer_cast(v.data());
}

}  // namespace device

MRR_NAMESPACE_END
