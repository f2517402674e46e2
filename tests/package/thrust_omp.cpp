// mrr::thrust_omp from the installed package: Thrust's OpenMP system on the host, mrr's device
// routing on it.
#include <mrr/thrust/routing.hpp>

#include <thrust/device_vector.h>
#include <thrust/reduce.h>

#include <cstdio>

int main() {
  thrust::device_vector<int> ones(1000, 1);
  const int sum = thrust::reduce(ones.begin(), ones.end());
  std::printf("Thrust's OpenMP system through mrr::thrust_omp: sum %d\n", sum);
  return sum == 1000 ? 0 : 1;
}
