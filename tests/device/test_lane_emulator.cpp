// The lane emulator itself (tests/support/lane_emulator.hpp): warp intrinsics give the hardware's
// results (segment scans and reductions, votes, matches, out-of-segment shuffles keep their own
// value), __shared__ is one array per block, and the two bugs a GPU turns into hangs or garbage
// (lanes that never reach an intrinsic, lanes at different intrinsics) throw, naming them.
#include <doctest/doctest.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "support/lane_emulator.hpp"

namespace {

// Per lane: the inclusive sum over its segment of `width` lanes up to itself (shfl_up), the
// segment's total (shfl_xor butterfly), the segment's first lane's value (shfl_sync), the next
// lane's value within the segment (shfl_down, the last keeping its own), a ballot and a match.
__global__ void intrinsics(int width, int* scan, int* total, int* first, int* next, unsigned* ballot, unsigned* match) {
  const int lane = threadIdx.x & 31, t = blockIdx.x * blockDim.x + threadIdx.x;
  const int mine = lane + 1;
  int inclusive = mine;
  for (int off = 1; off < width; off <<= 1) {
    const int other = __shfl_up_sync(0xffffffffu, inclusive, off, width);
    inclusive += (lane % width) >= off ? other : 0;
  }
  int sum = mine;
  for (int off = width / 2; off > 0; off >>= 1)
    sum += __shfl_xor_sync(0xffffffffu, sum, off, width);
  scan[t] = inclusive;
  total[t] = sum;
  first[t] = __shfl_sync(0xffffffffu, mine, 0, width);
  next[t] = __shfl_down_sync(0xffffffffu, mine, 1, width);
  ballot[t] = __ballot_sync(0xffffffffu, lane % 3 == 0);
  match[t] = __match_any_sync(0xffffffffu, lane / 4);
}

// Lanes exchange values through __shared__ after a __syncwarp: lane j reads what lane j + 1 of its
// warp wrote, in its own block.
__global__ void shared_exchange(int* out) {
  __shared__ int slot[64];
  slot[threadIdx.x] = static_cast<int>(blockIdx.x * 1000 + threadIdx.x);
  __syncwarp();
  const unsigned base = threadIdx.x & ~31u;
  out[blockIdx.x * blockDim.x + threadIdx.x] = slot[base + ((threadIdx.x + 1) & 31u)];
}

// Across warps: thread t reads what thread t + 1 of the block wrote, after the block's barrier, in
// dynamic shared memory.
__global__ void block_exchange(int* out) {
  MRR_DYNAMIC_SHARED(int, slot);
  slot[threadIdx.x] = static_cast<int>(blockIdx.x * 1000 + threadIdx.x);
  __syncthreads();
  out[blockIdx.x * blockDim.x + threadIdx.x] = slot[(threadIdx.x + 1) % blockDim.x];
}

__global__ void barrier_after_return(int* out) {
  if (threadIdx.x == 40) return;
  __syncthreads();
  out[threadIdx.x] = 1;
}

__global__ void early_return(int* out) {
  if ((threadIdx.x & 31) == 5) return;
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, static_cast<int>(threadIdx.x), 1);
}

__global__ void divergent(int* out) {
  if ((threadIdx.x & 31) < 16)
    out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1, 1);
  else
    out[threadIdx.x] = static_cast<int>(__ballot_sync(0xffffffffu, 1));
}

}  // namespace

TEST_CASE("lane emulator: shuffles, votes and matches give the hardware's results, segments of every width") {
  for (const int width : {1, 2, 4, 8, 16, 32}) {
    CAPTURE(width);
    const int n = 2 * 64;  // 2 blocks of 64 threads
    std::vector<int> scan(n), total(n), first(n), next(n);
    std::vector<unsigned> ballot(n), match(n);
    mrr_emu::run(2, 64, [&] {
      intrinsics(width, scan.data(), total.data(), first.data(), next.data(), ballot.data(), match.data());
    });
    for (int t = 0; t < n; ++t) {
      const int lane = t % 32, in_seg = lane % width, base = lane - in_seg;
      // lanes hold lane + 1: sums of consecutive integers
      CHECK(scan[t] == (base + 1 + lane + 1) * (in_seg + 1) / 2);
      CHECK(total[t] == (2 * base + width + 1) * width / 2);
      CHECK(first[t] == base + 1);
      CHECK(next[t] == (in_seg + 1 < width ? lane + 2 : lane + 1));
      CHECK(ballot[t] == 0x49249249u);              // lanes 0, 3, 6, ..., 30
      CHECK(match[t] == 0xfu << (4 * (lane / 4)));  // lanes with the same lane / 4
    }
  }
}

TEST_CASE("lane emulator: a block's lanes share __shared__ storage") {
  std::vector<int> out(3 * 64, -1);
  mrr_emu::run(3, 64, [&] { shared_exchange(out.data()); });
  for (int t = 0; t < 3 * 64; ++t) {
    const int block = t / 64, thread = t % 64, base = thread & ~31;
    CHECK(out[t] == block * 1000 + base + (thread + 1) % 32);
  }
}

TEST_CASE("lane emulator: __syncthreads holds every thread of the block; dynamic shared memory") {
  std::vector<int> out(2 * 96, -1);
  mrr_emu::run(2, 96, 96 * sizeof(int), [&] { block_exchange(out.data()); });
  for (int t = 0; t < 2 * 96; ++t) {
    const int block = t / 96, thread = t % 96;
    CHECK(out[t] == block * 1000 + (thread + 1) % 96);
  }
  try {
    mrr_emu::run(1, 64, [&] { barrier_after_return(out.data()); });
    FAIL("no error for a thread that returned before __syncthreads");
  } catch (const std::logic_error& e) {
    CHECK(std::string(e.what()).find("__syncthreads that 1 threads of the block never reach") != std::string::npos);
  }
}

TEST_CASE("lane emulator: lanes that never reach an intrinsic, or reach different ones, are reported") {
  std::vector<int> out(64);
  try {
    mrr_emu::run(1, 64, [&] { early_return(out.data()); });
    FAIL("no error for a lane that returned before __shfl_xor_sync");
  } catch (const std::logic_error& e) {
    const std::string what = e.what();
    CHECK(what.find("warp 0") != std::string::npos);
    CHECK(what.find("__shfl_xor_sync") != std::string::npos);
    CHECK(what.find("never reach") != std::string::npos);
  }
  try {
    mrr_emu::run(1, 32, [&] { divergent(out.data()); });
    FAIL("no error for lanes at different intrinsics");
  } catch (const std::logic_error& e) {
    const std::string what = e.what();
    CHECK(what.find("different intrinsics") != std::string::npos);
    CHECK(what.find("__ballot_sync") != std::string::npos);
  }
  // The emulator runs again after a failed launch.
  std::vector<int> scan(32), total(32), first(32), next(32);
  std::vector<unsigned> ballot(32), match(32);
  mrr_emu::run(1, 32, [&] {
    intrinsics(32, scan.data(), total.data(), first.data(), next.data(), ballot.data(), match.data());
  });
  CHECK(total[0] == 32 * 33 / 2);
}
