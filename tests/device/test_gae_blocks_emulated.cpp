// GAE by a thread block per row (GaeAlgorithm::blocks, kernels::gae_blocks in mrr/thrust/ppo.hpp)
// on the host, lane by lane (tests/support/lane_emulator.hpp): the test test_cuda_thrust runs on a
// GPU (tests/cuda/gae_blocks_cases.hpp), here on Thrust's OpenMP system, in every CI run. The
// block kernel, its __syncthreads and its dynamic shared memory run as on a GPU with 227 KiB a
// block; the levels of the moments' tree between launches run on OpenMP, as chunks' do.
// This translation unit alone in its executable includes mrr/thrust/ppo.hpp, which changes under
// MRR_LANE_EMULATION.
#include <mrr/kernels/ppo/advantage.hpp>
#include <mrr/tensor.hpp>

#include <doctest/doctest.h>

// What mrr/thrust/ppo.hpp includes, before the emulator's macros.
#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>
#include <mrr/kernels/ppo/kl.hpp>
#include <mrr/kernels/ppo/masked.hpp>
#include <mrr/thrust/backend.hpp>
#include <mrr/thrust/execution.hpp>

#include <thrust/copy.h>
#include <thrust/device_vector.h>
#include <thrust/for_each.h>
#include <thrust/functional.h>
#include <thrust/host_vector.h>
#include <thrust/iterator/constant_iterator.h>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/iterator/transform_iterator.h>
#include <thrust/pair.h>
#include <thrust/reduce.h>
#include <thrust/scan.h>
#include <thrust/sequence.h>
#include <thrust/sort.h>
#include <thrust/transform_reduce.h>

#include <cstdint>
#include <stdexcept>
#include <type_traits>

#include "support/lane_emulator.hpp"

#include <mrr/thrust/ppo.hpp>

#include "cuda/gae_view.hpp"

static_assert(MRR_GAE_BLOCK_KERNEL == 1, "the block kernel is compiled under the lane emulator");

#include "cuda/gae_blocks_cases.hpp"
