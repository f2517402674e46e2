// Backend memory on Thrust's OpenMP system is host memory: the Mem::Buffer<U> of the bodies that
// tests/cuda runs on cudaMalloc buffers (tests/cuda/cuda_memory.hpp).
#pragma once

#include <cstddef>
#include <vector>

namespace mrr::test {

struct HostMemory {
  template <class U>
  struct Buffer {
    std::vector<U> v;
    explicit Buffer(std::size_t n) : v(n) {}
    explicit Buffer(const std::vector<U>& h) : v(h) {}
    U* data() { return v.data(); }
    std::vector<U> host() const { return v; }
  };
};

}  // namespace mrr::test
