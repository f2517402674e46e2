// Host interface of nccl_collectives.cu (plain functions: no doctest across nvcc).
#pragma once

#include <string>
#include <vector>

namespace mrr::test {

// Number of CUDA devices, 0 when there is none (or no driver).
int nccl_device_count();

// Runs NcclCommunicator's collectives on every visible GPU (one rank per GPU, one thread each,
// communicators from ncclCommInitAll, or non-blocking ones from ncclCommInitRankConfig) against
// host references: all_to_all_v with unequal and zero counts, all_gather, broadcast,
// all_reduce_sum bitwise equal to the rank-order sum, and mismatched counts, overlapping buffers
// and a host buffer throwing InvalidArgument on every rank; bad timeouts refused. Returns one
// line per failed check.
std::vector<std::string> nccl_collectives_self_test(bool blocking);

}  // namespace mrr::test
