// Thrust vectors of the device system for the tests/device executables: a row-major Eigen matrix
// uploaded as is.
#pragma once

#include <mrr/tensor.hpp>

#include <thrust/device_vector.h>

namespace mrr::test {

template <class T>
using dvec = thrust::device_vector<T>;

template <class T>
dvec<T> to_device(const mrr::RowMatrix<T>& m) {
  return dvec<T>(m.data(), m.data() + m.size());
}

}  // namespace mrr::test
