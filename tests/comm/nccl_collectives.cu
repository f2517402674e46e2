// NcclCommunicator against host references, one rank per visible GPU. Kernels and plain
// functions only (doctest stays in test_comm_nccl.cpp).
#include <mrr/comm/nccl.cuh>

#include "nccl_collectives.hpp"

#include <chrono>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <span>
#include <thread>

namespace mrr::test {

namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

// cudaMemcpy runs on the legacy default stream, which waits for (and is waited for by) the
// communicator's blocking stream; the collectives return with their results in place.
template <class T>
struct DeviceVector {
  explicit DeviceVector(const std::vector<T>& host) : n(host.size()) {
    if (n) {
      check(cudaMalloc(reinterpret_cast<void**>(&data), n * sizeof(T)), "cudaMalloc");
      check(cudaMemcpy(data, host.data(), n * sizeof(T), cudaMemcpyHostToDevice), "cudaMemcpy");
    }
  }
  DeviceVector(const DeviceVector&) = delete;
  DeviceVector& operator=(const DeviceVector&) = delete;
  ~DeviceVector() { cudaFree(data); }
  std::vector<T> host() const {
    std::vector<T> out(n);
    if (n) check(cudaMemcpy(out.data(), data, n * sizeof(T), cudaMemcpyDeviceToHost), "cudaMemcpy");
    return out;
  }
  std::span<T> span() { return {data, n}; }
  std::span<const T> cspan() const { return {data, n}; }
  T* data = nullptr;
  std::size_t n = 0;
};

std::size_t block_count(int from, int to) {
  return (from + to) % 3 == 0 ? 0 : static_cast<std::size_t>(from * 2 + to + 1);
}

float summand(int rank, std::size_t i) {
  const float scale = rank % 3 == 0 ? 1e-4f : rank % 3 == 1 ? 1.f : 1e4f;
  return scale * (0.1f + 0.37f * static_cast<float>((i * 7 + static_cast<std::size_t>(rank) * 3) % 11));
}

void run_rank(const mrr::NcclCommunicator& comm, std::vector<std::string>& failures, std::mutex& mutex) {
  const int P = comm.size(), me = comm.rank();
  auto fail = [&](const std::string& what) {
    std::lock_guard lock(mutex);
    failures.push_back("rank " + std::to_string(me) + ": " + what);
  };
  // all_to_all_v
  std::vector<std::size_t> sc(P), rc(P);
  std::vector<float> send, expected;
  for (int p = 0; p < P; ++p) {
    sc[p] = block_count(me, p);
    rc[p] = block_count(p, me);
    for (std::size_t i = 0; i < sc[p]; ++i)
      send.push_back(static_cast<float>(me * 1000 + p * 10) + static_cast<float>(i));
    for (std::size_t i = 0; i < rc[p]; ++i)
      expected.push_back(static_cast<float>(p * 1000 + me * 10) + static_cast<float>(i));
  }
  DeviceVector<float> d_send(send), d_recv(std::vector<float>(expected.size()));
  comm.all_to_all_v(d_send.cspan(), std::span<const std::size_t>(sc), d_recv.span(), std::span<const std::size_t>(rc));
  if (d_recv.host() != expected) fail("all_to_all_v delivered wrong blocks");
  // all_gather
  std::vector<long long> mine(5), all_expected;
  for (std::size_t i = 0; i < 5; ++i)
    mine[i] = me * 100 + static_cast<long long>(i);
  for (int p = 0; p < P; ++p)
    for (std::size_t i = 0; i < 5; ++i)
      all_expected.push_back(p * 100 + static_cast<long long>(i));
  DeviceVector<long long> d_mine(mine), d_all(std::vector<long long>(all_expected.size()));
  comm.all_gather(d_mine.cspan(), d_all.span());
  if (d_all.host() != all_expected) fail("all_gather");
  // broadcast
  std::vector<double> root_data{1.5, 2.5, 3.5};
  DeviceVector<double> d_b(me == P - 1 ? root_data : std::vector<double>(3, 0.0));
  comm.broadcast(d_b.span(), P - 1);
  if (d_b.host() != root_data) fail("broadcast");
  // all_reduce_sum, bitwise the rank-order sum
  for (std::size_t n : {std::size_t{1}, std::size_t{1001}, std::size_t{100003}}) {
    std::vector<float> x(n), sum(n);
    for (std::size_t i = 0; i < n; ++i) {
      x[i] = summand(me, i);
      sum[i] = summand(0, i);
      for (int p = 1; p < P; ++p)
        sum[i] = sum[i] + summand(p, i);
    }
    DeviceVector<float> d_x(x);
    comm.all_reduce_sum(d_x.span());
    if (std::memcmp(d_x.host().data(), sum.data(), n * sizeof(float)) != 0)
      fail("all_reduce_sum differs from the rank-order sum, n = " + std::to_string(n));
  }
  // mismatched counts: every rank throws
  std::vector<std::size_t> ones(P, 1), bad(P, 1);
  if (me == 0) bad[P - 1] = 2;
  DeviceVector<float> d_p(std::vector<float>(P + 1, 1.f)), d_q(std::vector<float>(P + 1));
  try {
    comm.all_to_all_v(d_p.cspan().first(P), std::span<const std::size_t>(ones), d_q.span(),
                      std::span<const std::size_t>(bad));
    fail("mismatched counts did not throw");
  } catch (const mrr::InvalidArgument&) {
  }
  // in-place (overlapping send and recv buffers) on the last rank: every rank throws
  const auto block = d_p.cspan().first(P);
  // P > 1: shifted by one element; P = 1 (one GPU): the very same element, since a shift by one
  // would leave a one-element block clear of it.
  const auto into = me == P - 1 ? d_p.span().subspan(P > 1 ? 1 : 0, P) : d_q.span().first(P);
  try {
    comm.all_to_all_v(block, std::span<const std::size_t>(ones), into, std::span<const std::size_t>(ones));
    fail("overlapping send and recv buffers did not throw");
  } catch (const mrr::InvalidArgument& e) {
    if (std::string(e.what()).find("send and recv buffers overlap") == std::string::npos)
      fail(std::string("overlap: unexpected message: ") + e.what());
  }
  // a host buffer on the last rank: every rank throws before NCCL reads it
  std::vector<float> host_block(static_cast<std::size_t>(P), 1.f);
  try {
    const std::span<const float> from =
        me == P - 1 ? std::span<const float>(host_block) : std::span<const float>(d_p.cspan().first(P));
    comm.all_to_all_v(from, std::span<const std::size_t>(ones), d_q.span().first(P),
                      std::span<const std::size_t>(ones));
    fail("a host buffer did not throw");
  } catch (const mrr::InvalidArgument& e) {
    if (std::string(e.what()).find("rank " + std::to_string(P - 1) + " passed a buffer that is not device memory") ==
        std::string::npos)
      fail(std::string("host buffer: unexpected message: ") + e.what());
  }
  comm.barrier();
}

}  // namespace

int nccl_device_count() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess ? count : 0;
}

std::vector<std::string> nccl_collectives_self_test(bool blocking) {
  const int P = nccl_device_count();
  std::vector<std::string> failures;
  // A timeout that is not positive, or so large that now() + timeout would wrap, is refused
  // before the communicator is touched.
  for (const auto bad :
       {std::chrono::milliseconds(0), std::chrono::milliseconds(-5), std::chrono::milliseconds::max()}) {
    try {
      mrr::NcclCommunicator unused(nullptr, nullptr, bad);
      failures.push_back("a timeout of " + std::to_string(bad.count()) + " ms was accepted");
    } catch (const mrr::InvalidArgument& e) {
      if (std::string(e.what()).find("the collective timeout must be in (0 ms, 10 years]") == std::string::npos)
        failures.push_back(std::string("timeout: unexpected message: ") + e.what());
    }
  }
  std::vector<ncclComm_t> comms(P);
  std::vector<int> devices(P);
  for (int d = 0; d < P; ++d)
    devices[d] = d;
  if (blocking) {
    if (const ncclResult_t r = ncclCommInitAll(comms.data(), P, devices.data()); r != ncclSuccess)
      return {std::string("ncclCommInitAll failed: ") + ncclGetErrorString(r)};
  } else {
    // Non-blocking communicators (ncclConfig_t::blocking = 0): NCCL calls return ncclInProgress
    // and the communicator waits for them itself.
    ncclUniqueId id;
    if (const ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess)
      return {std::string("ncclGetUniqueId failed: ") + ncclGetErrorString(r)};
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclGroupStart();
    for (int d = 0; d < P; ++d) {
      check(cudaSetDevice(d), "cudaSetDevice");
      const ncclResult_t r = ncclCommInitRankConfig(&comms[d], P, id, d, &config);
      if (r != ncclSuccess && r != ncclInProgress)
        failures.push_back(std::string("ncclCommInitRankConfig failed: ") + ncclGetErrorString(r));
    }
    const ncclResult_t g = ncclGroupEnd();
    if (g != ncclSuccess && g != ncclInProgress)
      failures.push_back(std::string("ncclGroupEnd failed: ") + ncclGetErrorString(g));
    for (int d = 0; d < P && failures.empty(); ++d) {
      ncclResult_t state = ncclInProgress;
      const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(120);
      while (state == ncclInProgress && std::chrono::steady_clock::now() < give_up)
        ncclCommGetAsyncError(comms[d], &state);
      if (state != ncclSuccess)
        failures.push_back(std::string("non-blocking init of rank ") + std::to_string(d) + ": " +
                           ncclGetErrorString(state));
    }
    if (!failures.empty()) return failures;
  }
  std::mutex mutex;
  std::vector<std::thread> threads;
  for (int d = 0; d < P; ++d) {
    threads.emplace_back([&, d] {
      cudaStream_t stream = nullptr;
      try {
        check(cudaSetDevice(d), "cudaSetDevice");
        check(cudaStreamCreate(&stream), "cudaStreamCreate");
        // A rank that fails leaves its peers in a collective: they throw after this timeout
        // rather than hang the test.
        run_rank(mrr::NcclCommunicator(comms[d], stream, std::chrono::seconds(120)), failures, mutex);
      } catch (const std::exception& e) {
        std::lock_guard lock(mutex);
        failures.push_back("rank " + std::to_string(d) + " threw: " + e.what());
      }
      if (stream != nullptr) cudaStreamDestroy(stream);
    });
  }
  for (auto& t : threads)
    t.join();
  for (auto comm : comms)
    ncclCommDestroy(comm);
  return failures;
}

}  // namespace mrr::test
