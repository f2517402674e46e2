// Dispatcher policy, checked deterministically with the in-process transport and a manual clock:
// selection, tie-breaks, stickiness, release on every path, retries, backoff, timeouts, caps,
// eviction and re-admission, runtime membership, and concurrent use.
#include "manual_clock.hpp"

#include <mrr/reward.hpp>

#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

using namespace std::chrono_literals;
using mrr::reward::BasicDispatcher;
using mrr::reward::DispatchOptions;
using mrr::reward::Duration;
using mrr::reward::Failure;
using mrr::reward::InProcessTransport;
using mrr::reward::Outcome;
using mrr::reward::Reply;
using mrr::reward::Request;
using mrr::reward::Response;
using mrr_test::ManualClock;

namespace {

using TestDispatcher = BasicDispatcher<ManualClock>;

Request request_with(std::string body, std::string session = {}) {
  Request r;
  r.body = std::move(body);
  r.session = std::move(session);
  return r;
}

mrr::reward::TimePoint far_future() {
  return mrr::reward::TimePoint::max();
}

std::size_t in_flight_of(const TestDispatcher& d, const std::string& worker) {
  const auto s = d.stats(worker);
  REQUIRE(s.has_value());
  return s->in_flight;
}

// This process's resident memory (VmRSS of /proc/self/status), 0 if unknown.
std::uint64_t vm_rss_bytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
  return 0;
}

bool healthy(const TestDispatcher& d, const std::string& worker) {
  const auto s = d.stats(worker);
  REQUIRE(s.has_value());
  return s->healthy;
}

Response ok(std::string body) {
  return Response{200, {}, std::move(body)};
}

}  // namespace

TEST_SUITE("reward") {
  TEST_CASE("the concepts accept the library's types and reject others") {
    auto fn = [](std::string_view, const Request&) { return Response{}; };
    using Local = InProcessTransport<decltype(fn)>;
    static_assert(mrr::reward::Transport<Local>);
    static_assert(mrr::reward::HealthProbe<Local>);
    static_assert(!mrr::reward::Transport<int>);
    static_assert(mrr::reward::ClockSource<mrr::reward::SteadyClock>);
    static_assert(mrr::reward::ClockSource<ManualClock>);
    static_assert(!mrr::reward::ClockSource<int>);
    static_assert(mrr::reward::RewardFunction<decltype(fn)>);
    static_assert(!mrr::reward::RewardFunction<int>);
    CHECK(Local(fn).send("w", Request{}, 1s).answered());
  }

  TEST_CASE("least in flight wins; ties go to the lowest index") {
    ManualClock clock;
    TestDispatcher d({"a", "b", "c"}, {}, clock);
    auto l1 = d.acquire(Request{}, far_future());
    auto l2 = d.acquire(Request{}, far_future());
    auto l3 = d.acquire(Request{}, far_future());
    REQUIRE((l1 && l2 && l3));
    CHECK(l1.worker() == "a");
    CHECK(l2.worker() == "b");
    CHECK(l3.worker() == "c");
    auto l4 = d.acquire(Request{}, far_future());
    CHECK(l4.worker() == "a");  // all at one: the lowest index
    l2.release();
    auto l5 = d.acquire(Request{}, far_future());
    CHECK(l5.worker() == "b");  // the only one at one fewer
    CHECK(d.in_flight() == 4);
    CHECK(in_flight_of(d, "a") == 2);
  }

  TEST_CASE("the body-hash tie-break is XXH3 of the body modulo the tied workers") {
    ManualClock clock;
    DispatchOptions options;
    options.tie_break = mrr::reward::TieBreak::body_hash;
    TestDispatcher d({"w0", "w1", "w2"}, options, clock);
    TestDispatcher again({"w0", "w1", "w2"}, options, clock);
    std::set<std::string> used;
    for (int i = 0; i < 64; ++i) {
      const std::string body = "{\"prompt\": " + std::to_string(i) + "}";
      const std::string expected = std::string("w").append(std::to_string(XXH3_64bits(body.data(), body.size()) % 3));
      auto lease = d.acquire(request_with(body), far_future());
      auto other = again.acquire(request_with(body), far_future());
      CHECK(lease.worker() == expected);
      CHECK(other.worker() == lease.worker());
      used.insert(lease.worker());
    }
    CHECK(used.size() == 3);
    // Only ties are hashed: a busier worker is never chosen.
    auto hold0 = d.acquire(request_with("x"), far_future());
    auto hold1 = d.acquire(request_with("y"), far_future());
    const std::set<std::string> busy{hold0.worker(), hold1.worker()};
    REQUIRE(busy.size() == 2);
    for (int i = 0; i < 16; ++i) {
      auto lease = d.acquire(request_with(std::to_string(i)), far_future());
      CHECK(busy.count(lease.worker()) == 0);
    }
  }

  TEST_CASE("sticky sessions keep a session on its worker until it is gone") {
    ManualClock clock;
    DispatchOptions options;
    options.sticky_sessions = true;
    options.sticky_capacity = 2;
    TestDispatcher d({"a", "b", "c"}, options, clock);

    auto first = d.acquire(request_with("", "s1"), far_future());
    REQUIRE(first.worker() == "a");
    auto again = d.acquire(request_with("", "s1"), far_future());
    CHECK(again.worker() == "a");  // busier than b and c, but pinned
    auto other = d.acquire(request_with("", "s2"), far_future());
    CHECK(other.worker() == "b");
    auto anonymous = d.acquire(request_with(""), far_future());
    CHECK(anonymous.worker() == "c");
    first.release();
    again.release();
    other.release();
    anonymous.release();

    SUBCASE("a removed worker's sessions move and are pinned anew") {
      REQUIRE(d.remove_worker("a"));
      auto moved = d.acquire(request_with("", "s1"), far_future());
      CHECK(moved.worker() == "b");
      auto busy = d.acquire(request_with(""), far_future());  // c
      CHECK(busy.worker() == "c");
      auto stays = d.acquire(request_with("", "s1"), far_future());
      CHECK(stays.worker() == "b");
    }
    SUBCASE("the least recently used session is forgotten beyond the capacity") {
      { auto l = d.acquire(request_with("", "s3"), far_future()); }  // pins s3 to a, forgets s1
      auto hold = d.acquire(request_with(""), far_future());         // a
      REQUIRE(hold.worker() == "a");
      auto s1 = d.acquire(request_with("", "s1"), far_future());
      CHECK(s1.worker() == "b");  // no longer pinned to a: least in flight
      auto s3 = d.acquire(request_with("", "s3"), far_future());
      CHECK(s3.worker() == "a");
    }
  }

  // A sticky id is the client's to choose (X-Request-Id through the proxy): a full table of long
  // ids once kept every id twice (map key and LRU list), 65,536 x 8 KB x 2 = 1 GiB.
  TEST_CASE("sticky sessions: memory per remembered session does not grow with the id's length") {
    DispatchOptions options;
    options.sticky_sessions = true;
    options.sticky_capacity = 65536;
    mrr::reward::Dispatcher d({"a", "b"}, options);
    InProcessTransport answer([](std::string_view, const Request&) { return Response{200, {}, "ok"}; });
    const std::uint64_t before = vm_rss_bytes();
    REQUIRE(before > 0);
    std::string id(8192, 'x');
    for (std::size_t i = 0; i < options.sticky_capacity; ++i) {
      std::snprintf(id.data(), 17, "%016zx", i);  // distinct ids of 8 KB each
      Request r;
      r.session = id;
      REQUIRE(d.dispatch(answer, r).outcome == Outcome::answered);
    }
    const std::uint64_t grown = vm_rss_bytes() - std::min(before, vm_rss_bytes());
    MESSAGE("65,536 sticky ids of 8 KB: RSS grew by ", grown >> 20, " MiB");
#if defined(__SANITIZE_ADDRESS__)
    // AddressSanitizer holds freed blocks in quarantine (256 MiB by default): RSS measures that.
    MESSAGE("AddressSanitizer build: the RSS bound is not checked");
#else
    CHECK(grown < (32ull << 20));  // ~100 bytes a session: 6.5 MiB, plus allocator slack
#endif
    // Every id was pinned to a (all ties); a remembered id goes back there even while a is busier.
    auto busy = d.acquire(Request{}, far_future());
    REQUIRE(busy.worker() == "a");
    std::snprintf(id.data(), 17, "%016zx", std::size_t{7});
    Request remembered;
    remembered.session = id;
    CHECK(d.dispatch(answer, remembered).worker == "a");
    std::snprintf(id.data(), 17, "%016zx", options.sticky_capacity);
    Request fresh;
    fresh.session = id;
    CHECK(d.dispatch(answer, fresh).worker == "b");
  }

  TEST_CASE("slots are released on every path") {
    ManualClock clock;
    DispatchOptions options;
    options.max_attempts = 2;
    options.attempt_timeout = 1s;
    options.failures_to_evict = 100;
    TestDispatcher d({"a", "b"}, options, clock);
    std::string mode;
    std::map<std::string, std::size_t> seen_in_flight;
    auto transport = InProcessTransport([&](std::string_view worker, const Request&) -> Reply {
      seen_in_flight[std::string(worker)] = in_flight_of(d, std::string(worker));
      if (mode == "answer") return Reply::from(ok("fine"));
      if (mode == "error") return Reply::failed(Failure::io, "broken pipe");
      if (mode == "throw") throw std::runtime_error("scorer crashed");
      if (mode == "throw-int") throw 42;
      clock.advance(2s);  // "slow": answers after its budget
      return Reply::from(ok("late"));
    });
    for (const std::string m : {"answer", "error", "throw", "throw-int", "slow"}) {
      CAPTURE(m);
      mode = m;
      seen_in_flight.clear();
      const auto result = d.dispatch(transport, Request{});
      CHECK(seen_in_flight.at("a") == 1);  // the slot was held during the call...
      CHECK(d.in_flight() == 0);           // ...and given back afterwards
      CHECK(in_flight_of(d, "a") == 0);
      CHECK(in_flight_of(d, "b") == 0);
      if (m == "answer") {
        CHECK(result.outcome == Outcome::answered);
      } else {
        CHECK(result.outcome == Outcome::failed);
        CHECK(result.attempts == 2);
      }
    }
    SUBCASE("a lease held by code that throws is released by unwinding") {
      try {
        auto lease = d.acquire(Request{}, far_future());
        REQUIRE(d.in_flight() == 1);
        throw std::runtime_error("caller failed");
      } catch (const std::runtime_error&) {
      }
      CHECK(d.in_flight() == 0);
    }
  }

  TEST_CASE("retries move to another worker after an exponential backoff") {
    ManualClock clock;
    DispatchOptions options;
    options.max_attempts = 4;
    options.backoff_initial = 50ms;
    options.backoff_multiplier = 2.0;
    options.backoff_max = 300ms;
    options.failures_to_evict = 100;
    std::vector<std::string> order;
    std::set<std::string> failing;
    auto transport = InProcessTransport([&](std::string_view worker, const Request& r) -> Reply {
      order.emplace_back(worker);
      if (failing.count(std::string(worker))) return Reply::failed(Failure::connect, "refused");
      return Reply::from(ok(r.body));
    });

    SUBCASE("the first failure moves the request to the next worker") {
      TestDispatcher d({"a", "b", "c", "d"}, options, clock);
      failing = {"a"};
      const auto result = d.dispatch(transport, request_with("payload"));
      CHECK(result.outcome == Outcome::answered);
      CHECK(result.response.body == "payload");
      CHECK(result.worker == "b");
      CHECK(result.attempts == 2);
      CHECK(order == std::vector<std::string>{"a", "b"});
      CHECK(clock.sleeps() == std::vector<Duration>{50ms});
    }
    SUBCASE("every worker fails: each tried once, backoff doubles up to its cap") {
      TestDispatcher d({"a", "b", "c", "d"}, options, clock);
      failing = {"a", "b", "c", "d"};
      const auto result = d.dispatch(transport, Request{});
      CHECK(result.outcome == Outcome::failed);
      CHECK(result.http_status() == 502);
      CHECK(result.attempts == 4);
      CHECK(order == std::vector<std::string>{"a", "b", "c", "d"});
      CHECK(clock.sleeps() == std::vector<Duration>{50ms, 100ms, 200ms});
      CHECK(result.error.find("worker d: connect: refused") != std::string::npos);
      CHECK(d.backoff(4) == 300ms);  // 400 ms capped
    }
    SUBCASE("with fewer workers than attempts, tried workers are used again") {
      TestDispatcher d({"a", "b"}, options, clock);
      failing = {"a", "b"};
      const auto result = d.dispatch(transport, Request{});
      CHECK(result.outcome == Outcome::failed);
      CHECK(order == std::vector<std::string>{"a", "b", "a", "b"});
    }
  }

  TEST_CASE("retryable statuses are failures; other statuses are the worker's answer") {
    ManualClock clock;
    DispatchOptions options;
    options.failures_to_evict = 100;
    std::map<std::string, int> status{{"a", 503}, {"b", 404}};
    auto transport = InProcessTransport([&](std::string_view worker, const Request&) {
      return Response{status.at(std::string(worker)), {{"Content-Type", "text/plain"}}, "from " + std::string(worker)};
    });
    SUBCASE("503 is retried, 404 is relayed") {
      TestDispatcher d({"a", "b"}, options, clock);
      const auto result = d.dispatch(transport, Request{});
      CHECK(result.outcome == Outcome::answered);
      CHECK(result.http_status() == 404);
      CHECK(result.response.body == "from b");
      CHECK(result.attempts == 2);
      CHECK(d.stats("a")->failures == 1);
      CHECK(d.stats("b")->successes == 1);
    }
    SUBCASE("when every answer is retryable the request fails with the last status") {
      status = {{"a", 503}, {"b", 502}};
      TestDispatcher d({"a", "b"}, options, clock);
      const auto result = d.dispatch(transport, Request{});
      CHECK(result.outcome == Outcome::failed);
      CHECK(result.http_status() == 502);
      CHECK(result.last_status == 503);  // a again on the third attempt
      CHECK(result.error.find("answered 503: from a") != std::string::npos);
    }
    SUBCASE("500 is the answer by default: one input a reward function throws on evicts no worker") {
      options.failures_to_evict = 1;
      status = {{"a", 500}, {"b", 500}};
      TestDispatcher d({"a", "b"}, options, clock);
      for (int i = 0; i < 5; ++i) {
        const auto result = d.dispatch(transport, Request{});
        CHECK(result.outcome == Outcome::answered);
        CHECK(result.http_status() == 500);
        CHECK(result.attempts == 1);
      }
      CHECK(healthy(d, "a"));
      CHECK(healthy(d, "b"));
      CHECK(d.stats("a")->failures == 0);
      options.retry_statuses.push_back(500);  // where a 500 means a broken worker, say so
      TestDispatcher strict({"a", "b"}, options, clock);
      CHECK(strict.dispatch(transport, Request{}).outcome == Outcome::failed);
      CHECK_FALSE(healthy(strict, "a"));
    }
    SUBCASE("without retry statuses a 503 is relayed as it is") {
      options.retry_statuses.clear();
      TestDispatcher d({"a", "b"}, options, clock);
      const auto result = d.dispatch(transport, Request{});
      CHECK(result.outcome == Outcome::answered);
      CHECK(result.http_status() == 503);
      CHECK(result.response.body == "from a");
      CHECK(result.attempts == 1);
    }
  }

  TEST_CASE("attempt and request timeouts are honoured") {
    ManualClock clock;
    DispatchOptions options;
    options.attempt_timeout = 2s;
    options.request_timeout = 3s;
    options.backoff_initial = 50ms;
    options.failures_to_evict = 100;
    std::vector<Duration> budgets;
    std::set<std::string> slow;
    auto transport = InProcessTransport([&](std::string_view worker, const Request&, Duration budget) {
      budgets.push_back(budget);
      if (slow.count(std::string(worker))) clock.advance(2500ms);
      return ok(std::string(worker));
    });
    SUBCASE("a late answer is dropped and the request retried elsewhere") {
      TestDispatcher d({"a", "b"}, options, clock);
      slow = {"a"};
      const auto result = d.dispatch(transport, Request{});
      CHECK(result.outcome == Outcome::answered);
      CHECK(result.response.body == "b");
      CHECK(budgets.front() == 2s);
      CHECK(d.stats("a")->last_error.find("timeout") != std::string::npos);
    }
    SUBCASE("the request deadline ends the retries with timed_out (504)") {
      TestDispatcher d({"a", "b"}, options, clock);
      slow = {"a", "b"};
      const auto result = d.dispatch(transport, Request{});
      CHECK(result.outcome == Outcome::timed_out);
      CHECK(result.http_status() == 504);
      CHECK(result.attempts == 2);
      REQUIRE(budgets.size() == 2);
      CHECK(budgets[0] == 2s);
      CHECK(budgets[1] == 3s - 2500ms - 50ms);  // what was left of the request's budget
      CHECK(d.in_flight() == 0);
      // a's timeout was its own; b's budget was what the request had left: not b's failure.
      CHECK(d.stats("a")->failures == 1);
      CHECK(d.stats("b")->failures == 0);
      CHECK(d.stats("b")->cut_short == 1);
      CHECK(d.stats("b")->attempts == 1);
      CHECK(d.stats("b")->consecutive_failures == 0);
    }
    SUBCASE("no retry is started when the backoff would pass the deadline") {
      options.backoff_initial = 1s;
      TestDispatcher d({"a", "b"}, options, clock);
      slow = {"a", "b"};
      const auto result = d.dispatch(transport, Request{});
      CHECK(result.outcome == Outcome::timed_out);
      CHECK(result.attempts == 1);
      CHECK(clock.sleeps().empty());
    }
  }

  TEST_CASE("Duration::max() means no time limit, without overflow") {
    ManualClock clock;
    DispatchOptions options;
    options.attempt_timeout = Duration::max();
    options.request_timeout = Duration::max();
    TestDispatcher d({"a"}, options, clock);
    Duration budget{};
    auto transport = InProcessTransport([&](std::string_view, const Request&, Duration b) {
      budget = b;
      clock.advance(24h);
      return ok("late but fine");
    });
    const auto result = d.dispatch(transport, Request{});
    CHECK(result.outcome == Outcome::answered);
    CHECK(budget > 1000h);
  }

  TEST_CASE("the in-flight cap makes requests wait for room, up to their deadline") {
    ManualClock clock;
    DispatchOptions options;
    options.max_in_flight_per_worker = 1;
    TestDispatcher d({"a", "b"}, options, clock);
    auto la = d.acquire(Request{}, far_future());
    auto lb = d.acquire(Request{}, far_future());
    REQUIRE((la.worker() == "a" && lb.worker() == "b"));

    SUBCASE("a released slot is taken by the waiter") {
      std::atomic<bool> done{false};
      std::string got;
      std::thread waiter([&] {
        auto l = d.acquire(Request{}, clock.now() + 1h);
        got = l ? l.worker() : "none";
        done = true;
      });
      std::this_thread::sleep_for(50ms);
      CHECK_FALSE(done.load());  // both workers are at their cap
      lb.release();
      waiter.join();
      CHECK(got == "b");
    }
    SUBCASE("the deadline ends the wait with the reason") {
      std::string reason;
      const auto deadline = clock.now() + 1s;
      std::thread waiter([&] {
        auto l = d.acquire(Request{}, deadline);
        reason = l ? "got " + l.worker() : l.unavailable_reason();
      });
      std::this_thread::sleep_for(50ms);  // the waiter has looked and found both at their cap
      clock.advance(2s);
      waiter.join();
      CHECK(reason.find("the request deadline passed while waiting: all 2 healthy workers are at "
                        "max_in_flight_per_worker = 1") != std::string::npos);
    }
    SUBCASE("dispatch reports a wait past the deadline as timed out") {
      auto transport = InProcessTransport([](std::string_view, const Request&) { return ok("x"); });
      mrr::reward::DispatchResult result;
      std::atomic<bool> done{false};
      std::thread caller([&] {
        result = d.dispatch(transport, Request{});
        done = true;
      });
      while (!done) {  // the caller reads its deadline off the clock: move time until it gives up
        clock.advance(2min);
        std::this_thread::sleep_for(5ms);
      }
      caller.join();
      CHECK(result.outcome == Outcome::timed_out);
      CHECK(result.attempts == 0);
    }
  }

  TEST_CASE("no lease at or after the request deadline; overload evicts no worker") {
    ManualClock clock;
    DispatchOptions options;
    options.max_in_flight_per_worker = 1;
    options.failures_to_evict = 1;
    options.request_timeout = 1s;
    TestDispatcher d({"a"}, options, clock);
    std::atomic<int> calls{0};
    auto transport = InProcessTransport([&](std::string_view, const Request&) {
      ++calls;
      return ok("x");
    });
    auto held = d.acquire(Request{}, far_future());
    REQUIRE(held);
    mrr::reward::DispatchResult result;
    std::thread caller([&] { result = d.dispatch(transport, Request{}); });
    std::this_thread::sleep_for(50ms);  // the caller waits for a's room
    clock.advance(2s);                  // past its deadline, and then the room comes
    held.release();
    caller.join();
    CHECK(result.outcome == Outcome::timed_out);
    CHECK(result.http_status() == 504);
    CHECK(result.error.find("deadline passed while waiting: all 1 healthy workers are at") != std::string::npos);
    CHECK(calls == 0);  // never sent with no time left
    CHECK(healthy(d, "a"));
    CHECK(d.stats("a")->failures == 0);
    CHECK(d.dispatch(transport, Request{}).outcome == Outcome::answered);
  }

  TEST_CASE("a worker that hangs through a whole budget is evicted, even when the request's budget is the attempt's") {
    ManualClock clock;
    DispatchOptions options;
    options.attempt_timeout = 50ms;
    options.request_timeout = 40ms;  // each attempt's budget is the request's: 40 ms, never 50
    options.failures_to_evict = 3;
    options.readmit_after = 0s;
    TestDispatcher d({"a", "b"}, options, clock);
    auto transport = InProcessTransport([&](std::string_view worker, const Request&, Duration budget) {
      if (worker == "a") clock.advance(budget + 1ms);  // a hangs past whatever it is given
      return ok(std::string(worker));
    });
    for (int i = 0; i < 3; ++i)
      CHECK(d.dispatch(transport, Request{}).outcome == Outcome::timed_out);  // a, with the whole budget
    CHECK(d.stats("a")->failures == 3);
    CHECK(d.stats("a")->cut_short == 0);
    CHECK_FALSE(healthy(d, "a"));
    const auto next = d.dispatch(transport, Request{});
    CHECK(next.outcome == Outcome::answered);
    CHECK(next.worker == "b");
  }

  TEST_CASE("under the in-flight cap a retry waits for a worker not yet tried") {
    ManualClock clock;
    DispatchOptions options;
    options.max_in_flight_per_worker = 1;
    options.backoff_initial = 0ms;
    options.failures_to_evict = 100;
    TestDispatcher d({"a", "b"}, options, clock);
    std::mutex order_mutex;
    std::vector<std::string> order;
    auto transport = InProcessTransport([&](std::string_view worker, const Request&) -> Reply {
      {
        std::lock_guard lock(order_mutex);
        order.emplace_back(worker);
      }
      if (worker == "a") return Reply::failed(Failure::connect, "refused");
      return Reply::from(ok("from b"));
    });
    auto busy_b = d.acquire(Request{}, far_future(), {"a"});  // b, busy elsewhere
    REQUIRE(busy_b.worker() == "b");
    mrr::reward::DispatchResult result;
    std::atomic<bool> done{false};
    std::thread caller([&] {
      result = d.dispatch(transport, Request{});
      done = true;
    });
    std::this_thread::sleep_for(100ms);
    CHECK_FALSE(done.load());  // a failed; the retry waits for b rather than going back to a
    busy_b.release();
    caller.join();
    CHECK(result.outcome == Outcome::answered);
    CHECK(result.response.body == "from b");
    CHECK(order == std::vector<std::string>{"a", "b"});
    CHECK(d.stats("a")->failures == 1);
    // While it waits, the reason names the workers it waits for, not "all at their cap" (a is idle).
    auto held = d.acquire(Request{}, far_future(), {"a"});
    REQUIRE(held.worker() == "b");
    const auto waited = d.acquire(Request{}, clock.now(), {"a"});
    CHECK_FALSE(waited);
    clock.advance(1ms);
    std::string reason;
    std::thread late([&] { reason = d.acquire(Request{}, clock.now() + 1ms, {"a"}).unavailable_reason(); });
    std::this_thread::sleep_for(50ms);
    clock.advance(1s);
    late.join();
    CHECK(reason.find("the 1 of 2 healthy workers tried least for this request (0 times) are at "
                      "max_in_flight_per_worker = 1") != std::string::npos);
  }

  TEST_CASE("stats() reports a worker re-admitted by readmit_after without a request") {
    ManualClock clock;
    DispatchOptions options;
    options.failures_to_evict = 1;
    options.readmit_after = 10s;
    TestDispatcher d({"a"}, options, clock);
    auto lease = d.acquire(Request{}, far_future());
    lease.failed("refused");
    lease.release();
    CHECK_FALSE(healthy(d, "a"));
    clock.advance(9s);
    CHECK_FALSE(healthy(d, "a"));
    clock.advance(2s);
    CHECK(healthy(d, "a"));  // what the next request would find, before any request
    CHECK(d.stats("a")->consecutive_failures == options.failures_to_evict - 1);  // on probation
  }

  TEST_CASE("failures evict a worker; health probes and time re-admit it on probation") {
    ManualClock clock;
    DispatchOptions options;
    options.failures_to_evict = 3;
    options.successes_to_readmit = 2;
    options.readmit_after = 10s;
    options.backoff_initial = 0ms;
    TestDispatcher d({"a", "b"}, options, clock);
    bool a_works = false;
    auto transport = InProcessTransport([&](std::string_view worker, const Request&) -> Reply {
      if (worker == "a" && !a_works) return Reply::failed(Failure::connect, "refused");
      return Reply::from(ok(std::string(worker)));
    });
    for (int i = 0; i < 3; ++i) {
      const auto result = d.dispatch(transport, Request{});
      CHECK(result.attempts == 2);  // a first (lowest index), then b
      CHECK(result.response.body == "b");
    }
    CHECK_FALSE(healthy(d, "a"));
    CHECK(d.stats("a")->evictions == 1);
    const auto after = d.dispatch(transport, Request{});
    CHECK(after.attempts == 1);  // straight to b
    CHECK(after.worker == "b");

    SUBCASE("two good probes re-admit; one failure on probation evicts again") {
      d.report_health("a", true);
      CHECK_FALSE(healthy(d, "a"));
      d.report_health("a", true);
      CHECK(healthy(d, "a"));
      CHECK(d.dispatch(transport, Request{}).attempts == 2);  // a failed again...
      CHECK_FALSE(healthy(d, "a"));                           // ...and is out at once
      CHECK(d.stats("a")->evictions == 2);
    }
    SUBCASE("a recovered worker takes traffic again and a success clears its record") {
      a_works = true;
      d.report_health("a", true);
      d.report_health("a", true);
      const auto result = d.dispatch(transport, Request{});
      CHECK(result.worker == "a");
      CHECK(result.attempts == 1);
      CHECK(d.stats("a")->consecutive_failures == 0);
    }
    SUBCASE("without probes an evicted worker returns after readmit_after") {
      clock.advance(9s);
      CHECK(d.dispatch(transport, Request{}).attempts == 1);  // still evicted
      clock.advance(2s);
      CHECK(d.dispatch(transport, Request{}).attempts == 2);  // tried again (and evicted again)
      CHECK_FALSE(healthy(d, "a"));
    }
    SUBCASE("failing probes keep an evicted worker out: readmit_after counts from the last failed probe") {
      for (int i = 0; i < 5; ++i) {
        clock.advance(4s);
        d.report_health("a", false);
        CHECK(d.dispatch(transport, Request{}).attempts == 1);  // 20 s after the eviction, still out
      }
      CHECK_FALSE(healthy(d, "a"));
      clock.advance(11s);  // its probes stopped: time re-admits it
      CHECK(d.dispatch(transport, Request{}).attempts == 2);
    }
    SUBCASE("failed probes evict, and with every worker evicted there is no worker (503)") {
      for (int i = 0; i < 3; ++i)
        d.report_health("b", false);
      CHECK_FALSE(healthy(d, "b"));
      const auto result = d.dispatch(transport, Request{});
      CHECK(result.outcome == Outcome::no_worker);
      CHECK(result.http_status() == 503);
      CHECK(result.error == "all 2 workers are evicted as unhealthy");
    }
    SUBCASE("an operator can evict and re-admit") {
      CHECK(d.set_healthy("b", false));
      CHECK_FALSE(healthy(d, "b"));
      CHECK(d.set_healthy("a", true));
      CHECK(healthy(d, "a"));
      CHECK_FALSE(d.set_healthy("zz", true));
    }
  }

  TEST_CASE("workers are added and removed at run time") {
    ManualClock clock;
    TestDispatcher d({}, clock);
    auto transport =
        InProcessTransport([](std::string_view worker, const Request&) { return ok(std::string(worker)); });
    auto none = d.dispatch(transport, Request{});
    CHECK(none.outcome == Outcome::no_worker);
    CHECK(none.error == "no workers are registered");

    d.add_worker("a");
    CHECK(d.dispatch(transport, Request{}).response.body == "a");
    CHECK_THROWS_AS(d.add_worker("a"), mrr::InvalidArgument);
    CHECK_THROWS_AS(d.add_worker(""), mrr::InvalidArgument);

    auto held = d.acquire(Request{}, far_future());
    REQUIRE(held.worker() == "a");
    d.add_worker("b");
    auto next = d.acquire(Request{}, far_future());
    CHECK(next.worker() == "b");
    next.release();

    CHECK(d.remove_worker("a"));
    CHECK_FALSE(d.remove_worker("a"));
    CHECK(d.addresses() == std::vector<std::string>{"b"});
    CHECK(d.in_flight() == 1);  // the removed worker's request is still counted...
    held.release();
    CHECK(d.in_flight() == 0);  // ...until it finishes
    CHECK(d.dispatch(transport, Request{}).response.body == "b");
  }

  TEST_CASE("HealthMonitor probes every worker and reports to the dispatcher") {
    ManualClock clock;
    DispatchOptions options;
    options.failures_to_evict = 2;
    options.successes_to_readmit = 1;
    options.readmit_after = 0s;
    TestDispatcher d({"a", "b"}, options, clock);
    std::atomic<bool> a_up{false};
    std::atomic<int> probes{0};
    auto fn = [](std::string_view, const Request&) { return ok(""); };
    auto probe = [&](std::string_view worker) {
      ++probes;
      if (worker == "b") throw std::runtime_error("probe crashed");  // counts as unhealthy
      return a_up.load();
    };
    InProcessTransport<decltype(fn), decltype(probe)> transport(fn, probe);

    SUBCASE("by hand") {
      mrr::reward::HealthMonitor monitor(d, transport, {}, /*start=*/false);
      monitor.check_now();
      CHECK(healthy(d, "a"));
      monitor.check_now();
      CHECK_FALSE(healthy(d, "a"));
      CHECK_FALSE(healthy(d, "b"));
      a_up = true;
      monitor.check_now();
      CHECK(healthy(d, "a"));
      CHECK(probes == 6);
    }
    SUBCASE("rounds start `interval` apart, however long a round takes") {
      // Two probes of 150 ms each, rounds 400 ms apart: waiting `interval` after a round ended
      // would start them 700 ms apart.
      std::mutex starts_mutex;
      std::vector<std::chrono::steady_clock::time_point> starts;
      auto slow_probe = [&](std::string_view worker) {
        if (worker == "a") {
          std::lock_guard lock(starts_mutex);
          starts.push_back(std::chrono::steady_clock::now());
        }
        std::this_thread::sleep_for(150ms);
        return true;
      };
      InProcessTransport<decltype(fn), decltype(slow_probe)> slow(fn, slow_probe);
      {
        mrr::reward::HealthMonitor monitor(d, slow, {400ms, 1s});
        const auto give_up = std::chrono::steady_clock::now() + 20s;
        for (;;) {
          {
            std::lock_guard lock(starts_mutex);
            if (starts.size() >= 3 || std::chrono::steady_clock::now() > give_up) break;
          }
          std::this_thread::sleep_for(10ms);
        }
      }
      std::lock_guard lock(starts_mutex);
      REQUIRE(starts.size() >= 3);
      const auto gap = std::chrono::duration_cast<std::chrono::milliseconds>(starts[2] - starts[1]);
      CHECK(gap >= 390ms);
      CHECK(gap < 650ms);
    }
    SUBCASE("on its thread") {
      mrr::reward::HealthMonitor monitor(d, transport, {5ms, 1s});
      const auto give_up = std::chrono::steady_clock::now() + 20s;
      while (healthy(d, "a") && std::chrono::steady_clock::now() < give_up)
        std::this_thread::sleep_for(5ms);
      CHECK_FALSE(healthy(d, "a"));
      a_up = true;
      while (!healthy(d, "a") && std::chrono::steady_clock::now() < give_up)
        std::this_thread::sleep_for(5ms);
      CHECK(healthy(d, "a"));
      monitor.stop();
      const int after_stop = probes;
      std::this_thread::sleep_for(30ms);
      CHECK(probes == after_stop);
    }
  }

  TEST_CASE("concurrent dispatch answers every request exactly once and respects the cap") {
    DispatchOptions options;
    options.max_in_flight_per_worker = 2;
    options.backoff_initial = 0ms;
    options.failures_to_evict = 1'000'000;
    mrr::reward::Dispatcher d({"a", "b", "c"}, options);
    std::mutex m;
    std::map<std::string, int> running, peak;
    std::set<std::string> failed_once;
    auto transport = InProcessTransport([&](std::string_view worker, const Request& r) -> Reply {
      const std::string w(worker);
      {
        std::lock_guard lock(m);
        peak[w] = std::max(peak[w], ++running[w]);
      }
      std::this_thread::yield();
      bool fail = false;
      {
        std::lock_guard lock(m);
        --running[w];
        // c drops the first attempt of every third request; the retry must land elsewhere or succeed
        if (w == "c" && std::stoi(r.body) % 3 == 0) fail = failed_once.insert(r.body).second;
      }
      if (fail) return Reply::failed(Failure::io, "reset");
      return Reply::from(ok(r.body));
    });
    constexpr std::size_t threads = 8, per_thread = 300;
    std::vector<std::vector<std::string>> answers(threads);
    std::vector<std::thread> pool;
    for (std::size_t t = 0; t < threads; ++t)
      pool.emplace_back([&, t] {
        for (std::size_t i = 0; i < per_thread; ++i) {
          const auto result = d.dispatch(transport, request_with(std::to_string(t * per_thread + i)));
          answers[t].push_back(result.outcome == Outcome::answered ? result.response.body : "lost");
        }
      });
    for (auto& th : pool)
      th.join();
    std::multiset<std::string> all;
    for (const auto& a : answers)
      all.insert(a.begin(), a.end());
    CHECK(all.size() == threads * per_thread);
    for (std::size_t id = 0; id < threads * per_thread; ++id)
      CHECK(all.count(std::to_string(id)) == 1);
    CHECK(d.in_flight() == 0);
    std::uint64_t successes = 0;
    for (const auto& s : d.stats()) {
      CHECK(s.in_flight == 0);
      CHECK(peak[s.address] <= 2);
      successes += s.successes;
    }
    CHECK(successes == threads * per_thread);
    CHECK(d.stats("c")->failures > 0);
  }

  TEST_CASE("bad options are rejected with the option's name") {
    const auto rejects = [](auto&& change, const std::string& needle) {
      DispatchOptions o;
      change(o);
      try {
        mrr::reward::Dispatcher d(o);
        FAIL("accepted");
      } catch (const mrr::InvalidArgument& e) {
        CHECK(std::string(e.what()).find(needle) != std::string::npos);
      }
    };
    rejects([](DispatchOptions& o) { o.max_attempts = 0; }, "max_attempts");
    rejects([](DispatchOptions& o) { o.backoff_multiplier = 0.5; }, "backoff_multiplier");
    rejects([](DispatchOptions& o) { o.attempt_timeout = 0s; }, "attempt_timeout");
    rejects([](DispatchOptions& o) { o.failures_to_evict = 0; }, "failures_to_evict");
    rejects([](DispatchOptions& o) { o.retry_statuses = {42}; }, "retry_statuses");
    rejects([](DispatchOptions& o) { o.backoff_initial = -1s; }, "backoff_initial");
  }

}  // TEST_SUITE
