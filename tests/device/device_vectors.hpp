// Thrust vectors of the device system for the device tests (tests/device on OpenMP, tests/cuda on
// CUDA): a row-major Eigen matrix uploaded as is, a vector downloaded.
#pragma once

#include <mrr/tensor.hpp>

#include <thrust/copy.h>
#include <thrust/device_vector.h>

#include <vector>

namespace mrr::test {

template <class T>
using dvec = thrust::device_vector<T>;

template <class T>
dvec<T> to_device(const mrr::RowMatrix<T>& m) {
  return dvec<T>(m.data(), m.data() + m.size());
}

template <class T>
std::vector<T> to_host(const thrust::device_vector<T>& v) {
  std::vector<T> h(v.size());
  thrust::copy(v.begin(), v.end(), h.begin());
  return h;
}

}  // namespace mrr::test
