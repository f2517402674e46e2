// Communicators in one process: SingleProcess and InProcessGroup (P = 2, 3, 4) run the shared
// collective checks; InProcessGroup's failure behaviour (a throwing rank, a rank returning early)
// ends every rank with an exception, under a watchdog that turns a deadlock into a failure.
#include <mrr/comm/in_process.hpp>
#include <mrr/comm/single_process.hpp>
#include <mrr/concepts.hpp>

#include <doctest/doctest.h>

#include "collective_checks.hpp"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

namespace {

using namespace mrr::test::comm;

static_assert(mrr::Communicator<mrr::SingleProcess>);
static_assert(mrr::Communicator<mrr::InProcessComm>);
static_assert(mrr::RowCommunicator<mrr::SingleProcess, float> && mrr::RowCommunicator<mrr::InProcessComm, double>);

// Runs f; a hang past the limit ends the process with a message instead of blocking ctest.
template <class F>
void with_watchdog(F&& f, std::chrono::seconds limit = std::chrono::seconds(60)) {
  auto done = std::async(std::launch::async, std::forward<F>(f));
  if (done.wait_for(limit) == std::future_status::timeout) {
    std::fprintf(stderr, "watchdog: still running after %lld s: the communicator deadlocked\n",
                 static_cast<long long>(limit.count()));
    std::_Exit(3);
  }
  done.get();
}

template <class Body>
void on_every_communicator(Body body) {
  with_watchdog([&] {
    body(mrr::SingleProcess{});
    for (int P : {2, 3, 4}) {
      CAPTURE(P);
      mrr::InProcessGroup group(P);
      group.run([&](const mrr::InProcessComm& comm) {
        CHECK(comm.size() == P);
        body(comm);
      });
    }
  });
}

struct RankFailure : std::exception {
  const char* what() const noexcept override { return "boom"; }
};

}  // namespace

TEST_CASE("every collective matches the reference, for each element type, repeatedly") {
  on_every_communicator([](const auto& comm) { check_collectives(comm); });
}

TEST_CASE("mismatched counts or buffers throw on every rank, and the communicator stays usable") {
  on_every_communicator([](const auto& comm) { check_mismatched_counts(comm); });
}

TEST_CASE("sizes, roots, collectives or element types that disagree between ranks throw on every rank") {
  on_every_communicator([](const auto& comm) { check_mismatched_sizes(comm); });
}

TEST_CASE("barrier on one rank facing all_to_all_v on another throws on every rank, and nothing is read") {
  on_every_communicator([](const auto& comm) { check_mismatched_barrier(comm); });
}

TEST_CASE("InProcessGroup: barrier facing all_to_all_v after an exchange reads no freed buffer (ASan)") {
  // Both ranks exchange from buffers that are then freed; rank 0 then calls barrier() and rank 1
  // all_to_all_v with the same arguments. Were the barrier unchecked, rank 0 would pass it and
  // return, and rank 1 would accept rank 0's stale record and copy from its freed send buffer.
  mrr::InProcessGroup group(2);
  std::vector<std::string> seen(2);
  with_watchdog([&] {
    CHECK_THROWS_AS(group.run([&](const mrr::InProcessComm& comm) {
      const std::vector<std::size_t> counts(2, 4096);
      std::vector<float> recv(8192);
      {
        const std::vector<float> send(8192, static_cast<float>(comm.rank()));
        comm.all_to_all_v(cspan(send), cspan(counts), mspan(recv), cspan(counts));
      }
      try {
        if (comm.rank() == 0) {
          comm.barrier();
        } else {
          const std::vector<float> send(8192, 2.f);
          comm.all_to_all_v(cspan(send), cspan(counts), mspan(recv), cspan(counts));
        }
      } catch (const mrr::CommunicatorError& e) {
        seen[static_cast<std::size_t>(comm.rank())] = e.what();
        throw;
      }
    }),
                    mrr::CommunicatorError);
  });
  for (const auto& message : seen)
    CHECK(message.find("rank 1 calls all_to_all_v<float> while rank 0 calls barrier") != std::string::npos);
}

TEST_CASE("collective messages name the element type, 16-byte integers included") {
  using mrr::detail::element_name;
  using mrr::detail::element_tag;
  __extension__ typedef __int128 int128;  // a GNU extension (integral in gnu++ modes)
  __extension__ typedef unsigned __int128 uint128;
  CHECK(element_name(element_tag<float>()) == "float");
  CHECK(element_name(element_tag<std::int32_t>()) == "int32");
  CHECK(element_name(element_tag<std::uint8_t>()) == "uint8");
  CHECK(element_name(element_tag<long double>()) == "a 16-byte type");
  // They were named "uint48" and "a 18446744073709550652-byte type".
  if constexpr (std::is_integral_v<int128>) {
    CHECK(element_name(element_tag<int128>()) == "int128");
    CHECK(element_name(element_tag<uint128>()) == "uint128");
  } else {
    CHECK(element_name(element_tag<int128>()) == "a 16-byte type");
  }
}

TEST_CASE("overlapping send and recv buffers are refused on every rank") {
  on_every_communicator([](const auto& comm) { check_overlapping_buffers(comm); });
}

TEST_CASE("a rank that throws wakes every rank blocked in a collective; run rethrows the original") {
  for (int failing_after : {0, 3}) {  // before the first collective, and mid-loop
    CAPTURE(failing_after);
    mrr::InProcessGroup group(4);
    std::mutex mutex;
    std::vector<std::string> seen(4);
    with_watchdog([&] {
      CHECK_THROWS_AS(group.run([&](const mrr::InProcessComm& comm) {
        try {
          for (int step = 0;; ++step) {
            if (comm.rank() == 2 && step == failing_after) throw RankFailure();
            std::vector<float> x(8, 1.f);
            comm.all_reduce_sum(mspan(x));
          }
        } catch (const mrr::CommunicatorError& e) {
          std::lock_guard lock(mutex);
          seen[static_cast<std::size_t>(comm.rank())] = e.what();
          throw;
        }
      }),
                      RankFailure);
    });
    for (int r : {0, 1, 3})
      CHECK(seen[static_cast<std::size_t>(r)].find("rank 2 failed: boom") != std::string::npos);
    CHECK(seen[2].empty());
    // The group runs again after a failure.
    group.run([](const mrr::InProcessComm& comm) { check_still_works(comm); });
  }
}

TEST_CASE("a rank that returns while the others wait in a collective ends the run with an error") {
  mrr::InProcessGroup group(3);
  std::atomic<int> errors{0};
  with_watchdog([&] {
    CHECK_THROWS_AS(group.run([&](const mrr::InProcessComm& comm) {
      if (comm.rank() == 1) return;  // never enters the barrier
      try {
        comm.barrier();
      } catch (const mrr::CommunicatorError& e) {
        CHECK(std::string(e.what()).find("rank 1 returned from run()") != std::string::npos);
        ++errors;
        throw;
      }
    }),
                    mrr::CommunicatorError);
  });
  CHECK(errors == 2);
}

TEST_CASE("InProcessGroup rejects a size below one and runs a group of one") {
  CHECK_THROWS_AS(mrr::InProcessGroup(0), mrr::InvalidArgument);
  mrr::InProcessGroup one(1);
  int calls = 0;
  one.run([&](const mrr::InProcessComm& comm) {
    ++calls;
    check_collectives(comm);
  });
  CHECK(calls == 1);
}

TEST_CASE("all_to_all_v counts whose sum wraps (a negative count cast to unsigned) throw on every rank") {
  // size_t(-1) + 1 wrapped to 0, passed the buffer checks and copied from far outside the buffer.
  std::vector<std::string> errors(2);
  CHECK_THROWS(mrr::InProcessGroup(2).run([&](const mrr::InProcessComm& c) {
    const std::size_t wrapped = static_cast<std::size_t>(-1);
    std::vector<float> send(c.rank() == 0 ? 0 : 1, 7.f), recv(send.size(), 0.f);
    const std::vector<std::size_t> counts =
        c.rank() == 0 ? std::vector<std::size_t>{wrapped, 1} : std::vector<std::size_t>{1, 0};
    try {
      c.all_to_all_v(std::span<const float>(send), std::span<const std::size_t>(counts), std::span<float>(recv),
                     std::span<const std::size_t>(counts));
    } catch (const std::exception& e) {
      errors[static_cast<std::size_t>(c.rank())] = e.what();
      throw;
    }
  }));
  for (const auto& e : errors)
    CHECK(e.find("overflow a 64-bit sum") != std::string::npos);
}

TEST_CASE("InProcessGroup runs one function at a time: a nested or concurrent run is an error") {
  mrr::InProcessGroup g(2);
  std::string nested;
  CHECK_THROWS(g.run([&](const mrr::InProcessComm& c) {
    if (c.rank() != 0) return;
    try {
      g.run([](const mrr::InProcessComm&) {});
    } catch (const std::exception& e) {
      nested = e.what();
      throw;
    }
  }));
  CHECK(nested.find("already running") != std::string::npos);
  // The group is usable again afterwards.
  std::atomic<int> sum{0};
  g.run([&](const mrr::InProcessComm& c) {
    float x = 1.f + static_cast<float>(c.rank());
    c.all_reduce_sum(std::span<float>(&x, 1));
    sum += static_cast<int>(x);
  });
  CHECK(sum.load() == 6);
}

TEST_CASE("row blocks whose first peer does not start at block 0 are malformed") {
  const mrr::SingleProcess comm;
  std::vector<float> send{10.f, 20.f, 30.f}, recv(1, 0.f);
  mrr::RowBlocks from, to;
  from.first = {0, 2};
  from.rows = {1, 1};
  from.peer_begin = {1, 2};  // block 0 belongs to no peer: SingleProcess moved it, the others did not
  to.first = {0};
  to.rows = {1};
  to.peer_begin = {0, 1};
  CHECK_THROWS_WITH(comm.all_to_all_rows(send.data(), 3, from, recv.data(), 1, to, 1), doctest::Contains("malformed"));
}
