// The HTTP router against real reward workers on 127.0.0.1 (ephemeral ports): workers in this
// process (RewardServer) and in child processes (reward_test_worker), one of them killed with
// SIGKILL mid-test and restarted. No timing is asserted beyond generous upper bounds.
#include "child_process.hpp"
#include "test_worker.hpp"
#include "trickling_worker.hpp"

#include <mrr/reward/http_proxy.hpp>
#include <mrr/reward/http_server.hpp>
#include <mrr/reward/http_transport.hpp>

#include <doctest/doctest.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#ifndef MRR_REWARD_TEST_WORKER
#error "MRR_REWARD_TEST_WORKER must name the reward_test_worker executable"
#endif

using namespace std::chrono_literals;
using mrr::reward::HttpRouter;
using mrr::reward::RouterOptions;
using nlohmann::json;

namespace {

// A worker in its own process, killable with SIGKILL.
class ChildWorker {
 public:
  ChildWorker(const std::string& name, const std::string& mode, int delay_ms = 0, int port = 0)
      : process_({MRR_REWARD_TEST_WORKER, "--name", name, "--mode", mode, "--delay-ms", std::to_string(delay_ms),
                  "--port", std::to_string(port)}) {
    const std::string line = process_.read_line();
    REQUIRE(line.rfind("PORT ", 0) == 0);
    port_ = std::stoi(line.substr(5));
  }
  [[nodiscard]] std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }
  [[nodiscard]] int port() const { return port_; }
  void kill() { process_.kill(); }

 private:
  mrr_test::ChildProcess process_;
  int port_ = 0;
};

// A worker on a thread of this process.
class LocalWorker {
 public:
  explicit LocalWorker(mrr_test::WorkerBehaviour b)
      : server_([b](const mrr::reward::Request& r) { return mrr_test::answer(b, r); }, quick_server()) {}
  [[nodiscard]] std::string url() const { return server_.url(); }
  void stop() { server_.stop(); }

  static mrr::reward::ServerOptions quick_server() {
    mrr::reward::ServerOptions o;
    o.threads = 32;
    o.keep_alive_timeout = 1s;  // idle proxy connections do not delay shutdown
    return o;
  }

 private:
  mrr::reward::RewardServer server_;
};

RouterOptions quick_router(bool health = true) {
  RouterOptions o;
  o.dispatch.backoff_initial = 10ms;
  o.dispatch.backoff_max = 100ms;
  o.dispatch.attempt_timeout = 20s;
  o.dispatch.request_timeout = 30s;
  o.health = health ? std::optional(mrr::reward::HealthOptions{100ms, 1s}) : std::nullopt;
  o.proxy.server = LocalWorker::quick_server();
  return o;
}

httplib::Client client_of(const std::string& url) {
  httplib::Client c(url);
  c.set_url_encode(false);
  c.set_tcp_nodelay(true);  // headers and body go out in two writes: no Nagle wait between them
  c.set_connection_timeout(10s);
  c.set_read_timeout(30s);
  c.set_write_timeout(30s);
  return c;
}

template <class Predicate>
bool eventually(Predicate p, std::chrono::seconds limit = 20s) {
  const auto give_up = std::chrono::steady_clock::now() + limit;
  while (!p()) {
    if (std::chrono::steady_clock::now() > give_up) return false;
    std::this_thread::sleep_for(20ms);
  }
  return true;
}

bool healthy(HttpRouter& router, const std::string& url) {
  const auto s = router.dispatcher().stats(url);
  return s && s->healthy;
}

// The status of a response; a request that got none fails the test instead of crashing it.
int status_of(const httplib::Result& r) {
  REQUIRE(r);
  return r->status;
}

json body_of(const httplib::Result& r) {
  REQUIRE(r);
  return json::parse(r->body);
}

}  // namespace

TEST_SUITE("reward") {
  TEST_CASE("worker URLs are parsed and checked") {
    const auto u = mrr::reward::parse_worker_url("http://127.0.0.1:9001/v1/");
    CHECK(u.scheme == "http");
    CHECK(u.host == "127.0.0.1");
    CHECK(u.port == 9001);
    CHECK(u.base_path == "/v1");
    CHECK(u.origin() == "http://127.0.0.1:9001");
    CHECK(mrr::reward::parse_worker_url("http://[::1]:80").origin() == "http://[::1]:80");
    CHECK(mrr::reward::parse_worker_url("http://localhost").port == 80);
    CHECK_THROWS_AS(mrr::reward::parse_worker_url("127.0.0.1:9001"), mrr::InvalidArgument);
    CHECK_THROWS_AS(mrr::reward::parse_worker_url("ftp://h:1"), mrr::InvalidArgument);
    CHECK_THROWS_AS(mrr::reward::parse_worker_url("http://h:70000"), mrr::InvalidArgument);
    CHECK_THROWS_AS(mrr::reward::parse_worker_url("http://h:1/x?y=1"), mrr::InvalidArgument);
    CHECK_THROWS_AS(mrr::reward::parse_worker_url("http://:1"), mrr::InvalidArgument);
    CHECK_THROWS_AS(HttpRouter({"not a url"}, quick_router()), mrr::InvalidArgument);
    // Bytes that would end up in the request line or headers sent to the worker, and hosts that are none.
    for (const char* bad : {"http://127.0.0.1:1/\r\nX-Injected: 1", "http://127.0.0.1:1/a\nb", "http://h\r\n:1",
                            "http://127.0.0.1:1/a b", "http://user@127.0.0.1:1", "http://-h:1", "http://h..x:1",
                            "http://[::1:1", "http://[zz]:1", "http://h:", "http://h:0", "http://h:+1",
                            "http://h:1/%zz", "http://h:1/a\"b", "http://h:1/\x7f"}) {
      CAPTURE(bad);
      CHECK_THROWS_AS(mrr::reward::parse_worker_url(bad), mrr::InvalidArgument);
    }
    CHECK_THROWS_AS(mrr::reward::parse_worker_url(std::string("http://h\0st:1", 13)), mrr::InvalidArgument);
    CHECK_THROWS_AS(mrr::reward::parse_worker_url(std::string("http://\0:1", 10)), mrr::InvalidArgument);
    CHECK(mrr::reward::parse_worker_url("http://reward-0.svc.local:8000/v1/score").base_path == "/v1/score");
    mrr::reward::WorkerUrlPolicy policy{{"127.0.0.1", "Reward-0"}};
    CHECK(mrr::reward::check_worker_url("http://127.0.0.1:9", policy).port == 9);
    CHECK(mrr::reward::check_worker_url("http://reward-0:9", policy).host == "reward-0");
    CHECK_THROWS_AS(mrr::reward::check_worker_url("http://169.254.169.254:80", policy), mrr::InvalidArgument);
  }

  TEST_CASE("the proxy forwards method, path, query string, headers and body, and relays the answer") {
    LocalWorker worker({"w1"});
    HttpRouter router({worker.url()}, quick_router());
    auto client = client_of(router.url());

    const std::string target = "/score?alpha=1&beta=x%20y&a=1&a=2&check=%E2%9C%93&empty=";
    const std::string body = R"({"solution": "so #### 42", "truth": "42"})";
    const auto r = client.Post(target, {{"X-Custom", "v"}, {"X-Request-Id", "r1"}}, body, "application/json");
    REQUIRE(r);
    CHECK(r->status == 200);
    CHECK(r->get_header_value("X-Worker-Name") == "w1");  // the worker's own header
    CHECK(r->get_header_value("Content-Type") == "application/json");
    CHECK(r->get_header_value("X-Mrr-Worker") == worker.url());
    CHECK(r->get_header_value("X-Mrr-Attempts") == "1");
    const json echo = json::parse(r->body);
    CHECK(echo["method"] == "POST");
    CHECK(echo["target"] == target);
    CHECK(echo["body"] == body);
    CHECK(echo["id"] == "r1");
    CHECK(echo["score"] == 1.0);
    CHECK(echo["headers"]["x-custom"] == "v");
    CHECK(echo["headers"]["content-type"] == "application/json");
    CHECK(echo["headers"]["x-forwarded-for"] == "127.0.0.1");
    CHECK_FALSE(echo["headers"].contains("connection"));  // hop-by-hop: the client's, not the worker's
    CHECK_FALSE(echo["headers"].contains("remote_addr"));

    SUBCASE("the worker's status is relayed, whatever it is") {
      const auto teapot = client.Get("/anything?status=418");
      REQUIRE(teapot);
      CHECK(teapot->status == 418);
      CHECK(json::parse(teapot->body)["method"] == "GET");
      const auto missing = client.Post("/nope?status=404", "x", "text/plain");
      REQUIRE(missing);
      CHECK(missing->status == 404);
      CHECK(missing->get_header_value("X-Mrr-Attempts") == "1");  // a 404 is an answer, not retried
    }
    SUBCASE("X-Forwarded-For split over several fields is one list, the client's address appended") {
      const auto r2 =
          client.Post("/score", {{"X-Forwarded-For", "10.0.0.1"}, {"X-Forwarded-For", "10.0.0.2, 10.0.0.3"}}, "{}",
                      "application/json");
      CHECK(body_of(r2)["headers"]["x-forwarded-for"] == "10.0.0.1, 10.0.0.2, 10.0.0.3, 127.0.0.1");
    }
    SUBCASE("other methods are forwarded as they are") {
      CHECK(body_of(client.Put("/p?x=1", "put-body", "text/plain"))["method"] == "PUT");
      CHECK(body_of(client.Patch("/p", "patch-body", "text/plain"))["body"] == "patch-body");
      CHECK(body_of(client.Delete("/p?y=2"))["target"] == "/p?y=2");
    }
  }

  TEST_CASE("a chunked worker response is relayed whole, and max_response_bytes counts all of its chunks") {
    // A worker that streams its answer (Transfer-Encoding: chunked) in 4 KiB chunks.
    std::string expected(100'000, '\0');
    for (std::size_t i = 0; i < expected.size(); ++i)
      expected[i] = static_cast<char>('a' + (i * 7 + i / 4096) % 26);
    httplib::Server worker;
    worker.Get("/stream", [&](const httplib::Request&, httplib::Response& res) {
      res.set_chunked_content_provider("application/octet-stream", [&](std::size_t offset, httplib::DataSink& sink) {
        if (offset >= expected.size()) {
          sink.done();
          return true;
        }
        return sink.write(expected.data() + offset, std::min<std::size_t>(4096, expected.size() - offset));
      });
    });
    const int port = worker.bind_to_any_port("127.0.0.1");
    REQUIRE(port > 0);
    std::thread serving([&] { worker.listen_after_bind(); });
    const std::string url = "http://127.0.0.1:" + std::to_string(port);
    mrr::reward::Request get;
    get.method = "GET";
    get.target = "/stream";
    {
      mrr::reward::HttpTransport transport;
      const auto reply = transport.send(url, get, 10s);
      REQUIRE(reply.answered());
      CHECK(reply.response.status == 200);
      CHECK(reply.response.body.size() == expected.size());
      CHECK(reply.response.body == expected);
    }
    {  // every chunk is under the limit, the body is not
      mrr::reward::HttpTransportOptions small;
      small.max_response_bytes = 50'000;
      mrr::reward::HttpTransport transport(small);
      const auto reply = transport.send(url, get, 10s);
      CHECK_FALSE(reply.answered());
      CHECK(reply.failure == mrr::reward::Failure::io);
      CHECK(reply.error.find("max_response_bytes (50000 bytes)") != std::string::npos);
    }
    {  // and through the router
      HttpRouter router({url}, quick_router(false));
      auto client = client_of(router.url());
      const auto r = client.Get("/stream");
      CHECK(status_of(r) == 200);
      CHECK(r->body == expected);
    }
    worker.stop();
    serving.join();
  }

  TEST_CASE("no worker available: 503 with a JSON reason; workers added and removed at run time") {
    LocalWorker worker({"w1"});
    RouterOptions options = quick_router();
    options.proxy.admin_token = "test-admin-token-0123456789";
    HttpRouter router({}, options);
    auto client = client_of(router.url());
    client.set_bearer_token_auth(options.proxy.admin_token.c_str());

    const auto none = client.Post("/score", "{}", "application/json");
    REQUIRE(none);
    CHECK(none->status == 503);
    CHECK(none->get_header_value("Content-Type") == "application/json");
    CHECK(json::parse(none->body)["error"] == "no_worker");
    CHECK(json::parse(none->body)["detail"] == "no workers are registered");
    CHECK(status_of(client.Get("/_mrr/health")) == 503);

    const auto added = client.Post("/_mrr/workers?url=" + worker.url());
    REQUIRE(added);
    CHECK(added->status == 201);
    CHECK(status_of(client.Post("/_mrr/workers?url=" + worker.url())) == 400);  // already there
    CHECK(status_of(client.Post("/_mrr/workers?url=not-a-url")) == 400);
    const auto no_url = client.Post("/_mrr/workers");
    CHECK(status_of(no_url) == 400);
    CHECK(body_of(no_url)["error"] == "bad_request");
    CHECK(status_of(client.Get("/_mrr/health")) == 200);
    CHECK(status_of(client.Post("/score", "{}", "application/json")) == 200);
    const json listed = body_of(client.Get("/_mrr/workers"));
    REQUIRE(listed["workers"].size() == 1);
    CHECK(listed["workers"][0]["url"] == worker.url());
    CHECK(listed["workers"][0]["successes"] == 1);
    CHECK(listed["in_flight"] == 0);

    CHECK(status_of(client.Delete("/_mrr/workers?url=" + worker.url())) == 200);
    CHECK(status_of(client.Delete("/_mrr/workers?url=" + worker.url())) == 404);
    CHECK(status_of(client.Post("/score", "{}", "application/json")) == 503);
  }

  TEST_CASE("every attempt failed: 502 with the last error") {
    SUBCASE("workers answering 503") {
      LocalWorker e1({"e1", "error"});
      LocalWorker e2({"e2", "error"});
      HttpRouter router({e1.url(), e2.url()}, quick_router(false));
      const auto r = client_of(router.url()).Post("/score", "{}", "application/json");
      REQUIRE(r);
      CHECK(r->status == 502);
      const json j = json::parse(r->body);
      CHECK(j["error"] == "failed");
      CHECK(j["attempts"] == 3);
      CHECK(j["last_status"] == 503);
      CHECK(j["detail"].get<std::string>().find("answered 503: worker e1 is broken") != std::string::npos);
    }
    SUBCASE("a worker that is not there") {
      std::string gone;
      {
        LocalWorker w({"gone"});
        gone = w.url();
      }  // stopped: nothing listens on its port now
      HttpRouter router({gone}, quick_router(false));
      const auto r = client_of(router.url()).Post("/score", "{}", "application/json");
      REQUIRE(r);
      CHECK(r->status == 502);
      CHECK(json::parse(r->body)["detail"].get<std::string>().find(": connect: ") != std::string::npos);
      CHECK(router.dispatcher().in_flight() == 0);
    }
  }

  TEST_CASE("a reward function that throws on one input: its 500 is the answer, and no worker is evicted") {
    // verl's router neither retries nor evicts on an HTTP error; mrr's default retry statuses
    // leave 500 out for this reason (a 500 listed there would evict all three workers here).
    const auto scorer = [](const mrr::reward::Request& r) {
      if (r.body == "bad") throw std::runtime_error("cannot parse the solution");
      if (r.body == "odd") throw 7;  // not a std::exception
      return mrr::reward::Response{200, {{"Content-Type", "application/json"}}, R"({"score": 1})"};
    };
    std::vector<std::unique_ptr<mrr::reward::RewardServer>> workers;
    std::vector<std::string> urls;
    for (int i = 0; i < 3; ++i) {
      workers.push_back(std::make_unique<mrr::reward::RewardServer>(scorer, LocalWorker::quick_server()));
      urls.push_back(workers.back()->url());
    }
    auto options = quick_router(false);
    options.dispatch.failures_to_evict = 1;
    HttpRouter router(urls, options);
    auto client = client_of(router.url());
    for (int i = 0; i < 6; ++i) {
      const auto bad = client.Post("/score", i % 2 == 0 ? "bad" : "odd", "text/plain");
      REQUIRE(bad);
      CHECK(bad->status == 500);
      CHECK(bad->body.find(i % 2 == 0 ? "reward function failed: cannot parse the solution"
                                      : "reward function failed: an exception not derived from std::exception") !=
            std::string::npos);
      CHECK(bad->get_header_value("X-Mrr-Attempts") == "1");
    }
    for (const auto& url : urls) {
      CHECK(healthy(router, url));
      CHECK(router.dispatcher().stats(url)->failures == 0);
    }
    const auto good = client.Post("/score", "fine", "text/plain");
    REQUIRE(good);
    CHECK(good->status == 200);
    CHECK(status_of(client.Get("/_mrr/health")) == 200);
  }

  TEST_CASE("a worker answering 503 is retried elsewhere, then evicted") {
    LocalWorker broken({"broken", "error"});
    LocalWorker good({"good"});
    auto options = quick_router(false);
    options.dispatch.failures_to_evict = 3;
    options.dispatch.readmit_after = 0s;
    HttpRouter router({broken.url(), good.url()}, options);
    auto client = client_of(router.url());
    std::string last_attempts;
    for (int i = 0; i < 20; ++i) {
      const auto r = client.Post("/score", "{}", "application/json");
      REQUIRE(r);
      CHECK(r->status == 200);
      CHECK(json::parse(r->body)["worker"] == "good");
      last_attempts = r->get_header_value("X-Mrr-Attempts");
    }
    CHECK_FALSE(healthy(router, broken.url()));
    CHECK(router.dispatcher().stats(broken.url())->failures == 3);
    CHECK(last_attempts == "1");  // evicted: no longer tried first
  }

  TEST_CASE("timeouts: a slow worker's attempt is abandoned, and the request deadline answers 504") {
    ChildWorker slow("slow", "normal", /*delay_ms=*/5000);
    LocalWorker fast({"fast"});
    {
      auto options = quick_router(false);
      options.dispatch.attempt_timeout = 400ms;
      HttpRouter router({slow.url(), fast.url()}, options);
      const auto start = std::chrono::steady_clock::now();
      const auto r = client_of(router.url()).Post("/score", "{}", "application/json");
      const auto elapsed = std::chrono::steady_clock::now() - start;
      REQUIRE(r);
      CHECK(r->status == 200);
      CHECK(json::parse(r->body)["worker"] == "fast");
      CHECK(r->get_header_value("X-Mrr-Attempts") == "2");
      CHECK(elapsed < 4s);  // the slow worker would have taken 5 s
      CHECK(router.dispatcher().stats(slow.url())->last_error.find("timeout") != std::string::npos);
    }
    {
      auto options = quick_router(false);
      options.dispatch.request_timeout = 600ms;
      HttpRouter router({slow.url()}, options);
      const auto start = std::chrono::steady_clock::now();
      const auto r = client_of(router.url()).Post("/score", "{}", "application/json");
      const auto elapsed = std::chrono::steady_clock::now() - start;
      REQUIRE(r);
      CHECK(r->status == 504);
      CHECK(json::parse(r->body)["error"] == "timed_out");
      CHECK(elapsed < 4s);
      CHECK(router.dispatcher().in_flight() == 0);
    }
  }

  TEST_CASE("a worker trickling its answer is cut at the attempt's budget, a trickling /health at the probe's") {
    // Every byte comes well within the socket read timeout: only a limit on the whole exchange
    // ends it (cpp-httplib's own timeouts are per socket call; without it, 12 s each here).
    mrr_test::TricklingWorker trickling;
    mrr::reward::HttpTransport transport;
    mrr::reward::Request request;
    request.target = "/score";
    request.body = "{}";
    auto start = std::chrono::steady_clock::now();
    const auto reply = transport.send(trickling.url(), request, 400ms);
    auto elapsed = std::chrono::steady_clock::now() - start;
    CHECK(reply.failure == mrr::reward::Failure::timeout);
    CHECK(reply.error.find("no whole answer within the attempt's 400 ms") != std::string::npos);
    CHECK(elapsed >= 400ms);
    CHECK(elapsed < 3s);
    start = std::chrono::steady_clock::now();
    CHECK_FALSE(transport.check_health(trickling.url(), 300ms));
    elapsed = std::chrono::steady_clock::now() - start;
    CHECK(elapsed >= 300ms);
    CHECK(elapsed < 3s);
    CHECK(trickling.requests() == 2);

    // Through the router: the attempt moves to the good worker within its budget.
    LocalWorker fast({"fast"});
    auto options = quick_router(false);
    options.dispatch.attempt_timeout = 500ms;
    {
      HttpRouter router({trickling.url(), fast.url()}, options);
      for (int i = 0; i < 2; ++i) {  // round robin: one of them meets the trickling worker first
        start = std::chrono::steady_clock::now();
        const auto r = client_of(router.url()).Post("/score", "{}", "application/json");
        elapsed = std::chrono::steady_clock::now() - start;
        REQUIRE(r);
        CHECK(r->status == 200);
        CHECK(json::parse(r->body)["worker"] == "fast");
        CHECK(elapsed < 4s);
      }
      CHECK(router.dispatcher().stats(trickling.url())->last_error.find("no whole answer") != std::string::npos);
    }

    // Health checks: the trickling worker's probe ends at the probe timeout, so the one monitor
    // thread still evicts it, probes the others, and shutting down does not wait for it.
    options.health = mrr::reward::HealthOptions{100ms, 300ms};
    start = std::chrono::steady_clock::now();
    {
      HttpRouter router({trickling.url(), fast.url()}, options);
      CHECK(eventually([&] { return !healthy(router, trickling.url()); }, 5s));
      CHECK(healthy(router, fast.url()));
    }
    CHECK(std::chrono::steady_clock::now() - start < 6s);
  }

  TEST_CASE("a killed worker is evicted, traffic moves, and it is re-admitted when it recovers") {
    ChildWorker a("a", "normal");
    // b holds every request it gets for 5 s, so requests are surely in flight on it when it dies.
    auto b = std::make_unique<ChildWorker>("b", "normal", /*delay_ms=*/5000);
    const std::string b_url = b->url();
    const int b_port = b->port();
    auto options = quick_router(true);
    options.dispatch.failures_to_evict = 2;
    options.dispatch.successes_to_readmit = 2;
    options.dispatch.readmit_after = 0s;  // only health probes re-admit
    HttpRouter router({a.url(), b_url}, options);

    constexpr int total = 400, clients = 8;
    std::vector<int> status(total, 0);
    std::vector<int> attempts(total, 0);
    std::vector<std::string> echoed(total);
    std::atomic<int> done{0};
    std::vector<std::jthread> pool;  // joined even when a REQUIRE unwinds
    for (int c = 0; c < clients; ++c)
      pool.emplace_back([&, c] {
        auto client = client_of(router.url());
        client.set_keep_alive(true);
        for (int i = c; i < total; i += clients) {
          const std::string id = "req-" + std::to_string(i);
          const auto r =
              client.Post("/score?id=" + std::to_string(i), {{"X-Request-Id", id}}, "{}", "application/json");
          if (r) {
            status[i] = r->status;
            attempts[i] = std::stoi(r->get_header_value("X-Mrr-Attempts"));
            // No exception may leave a client thread: a body that is not JSON shows as a wrong id.
            const json j = json::parse(r->body, nullptr, /*allow_exceptions=*/false);
            echoed[i] = j.is_object() ? j.value("id", "") : r->body;
          }
          ++done;
        }
      });
    REQUIRE(eventually([&] { return done >= 100 && router.dispatcher().stats(b_url)->in_flight > 0; }));
    const std::size_t stuck_on_b = router.dispatcher().stats(b_url)->in_flight;
    b->kill();  // SIGKILL, with requests in flight on it
    for (auto& t : pool)
      t.join();

    std::set<std::string> answered;
    for (int i = 0; i < total; ++i) {
      CAPTURE(i);
      CHECK(status[i] == 200);
      CHECK(echoed[i] == "req-" + std::to_string(i));
      answered.insert(echoed[i]);
    }
    CHECK(answered.size() == total);  // each id answered, exactly once
    // The requests b held when it died were answered by a on a later attempt.
    CHECK(static_cast<std::size_t>(std::count_if(attempts.begin(), attempts.end(), [](int n) { return n >= 2; })) >=
          stuck_on_b);
    CHECK(router.dispatcher().in_flight() == 0);

    CHECK(eventually([&] { return !healthy(router, b_url); }));
    auto client = client_of(router.url());
    for (int i = 0; i < 10; ++i) {
      const auto r = client.Post("/score", "{}", "application/json");
      REQUIRE(r);
      CHECK(r->status == 200);
      CHECK(r->get_header_value("X-Mrr-Worker") == a.url());
    }

    b = std::make_unique<ChildWorker>("b", "normal", 0, b_port);  // recovers on its old address
    CHECK(eventually([&] { return healthy(router, b_url); }));
    // With a request held on a, the least-in-flight choice must be the re-admitted b.
    auto held = router.dispatcher().acquire({}, mrr::reward::TimePoint::max());
    REQUIRE(held.worker() == a.url());
    const auto r = client.Post("/score", "{}", "application/json");
    REQUIRE(r);
    CHECK(r->status == 200);
    CHECK(json::parse(r->body)["worker"] == "b");
    held.release();
    for (const auto& s : router.dispatcher().stats())
      CHECK(s.in_flight == 0);
  }

  TEST_CASE("many concurrent clients: every request id answered exactly once, in-flight back to zero") {
    LocalWorker w1({"w1"}), w2({"w2"}), w3({"w3"}), broken({"broken", "error"});
    HttpRouter router({broken.url(), w1.url(), w2.url(), w3.url()}, quick_router(true));
    constexpr int total = 2400, clients = 16;
    std::vector<std::string> echoed(total);
    std::vector<std::string> targets(total);
    std::vector<std::jthread> pool;  // joined even when a REQUIRE unwinds
    for (int c = 0; c < clients; ++c)
      pool.emplace_back([&, c] {
        auto client = client_of(router.url());
        client.set_keep_alive(true);
        for (int i = c; i < total; i += clients) {
          const auto r = client.Post("/score?n=" + std::to_string(i), {{"X-Request-Id", std::to_string(i)}},
                                     R"({"solution": "#### 7", "truth": "7"})", "application/json");
          if (r && r->status == 200) {
            const json j = json::parse(r->body, nullptr, /*allow_exceptions=*/false);
            echoed[i] = j.is_object() ? j.value("id", "") : r->body;
            targets[i] = j.is_object() ? j.value("target", "") : "";
          }
        }
      });
    for (auto& t : pool)
      t.join();
    std::multiset<std::string> ids(echoed.begin(), echoed.end());
    for (int i = 0; i < total; ++i) {
      CAPTURE(i);
      CHECK(echoed[i] == std::to_string(i));
      CHECK(targets[i] == "/score?n=" + std::to_string(i));
      CHECK(ids.count(std::to_string(i)) == 1);
    }
    CHECK(router.dispatcher().in_flight() == 0);
    std::uint64_t successes = 0;
    for (const auto& s : router.dispatcher().stats()) {
      CHECK(s.in_flight == 0);
      successes += s.successes;
    }
    CHECK(successes == total);
  }

  TEST_CASE("sticky sessions by request id") {
    LocalWorker w1({"w1"}), w2({"w2"});
    auto options = quick_router(false);
    options.dispatch.sticky_sessions = true;
    HttpRouter router({w1.url(), w2.url()}, options);
    auto client = client_of(router.url());
    const auto worker_for = [&](const std::string& id) {
      const auto r = id.empty() ? client.Post("/score", "{}", "application/json")
                                : client.Post("/score", {{"X-Request-Id", id}}, "{}", "application/json");
      REQUIRE(r);
      return json::parse(r->body)["worker"].get<std::string>();
    };
    CHECK(worker_for("s1") == "w1");
    auto held = router.dispatcher().acquire({}, mrr::reward::TimePoint::max());  // w1 is busier now
    REQUIRE(held.worker() == w1.url());
    CHECK(worker_for("s1") == "w1");  // pinned
    CHECK(worker_for("s2") == "w2");
    CHECK(worker_for("") == "w2");
  }

}  // TEST_SUITE
