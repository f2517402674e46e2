// The reward proxy against hostile clients, over real sockets on 127.0.0.1: the admin API's token,
// bind address and URL checks; slow and oversized requests; bodies forwarded as raw bytes whatever
// their content type; malformed framing refused with a JSON reason. Each case failed before the
// proxy owned its connection loop. Timing is asserted only as generous upper bounds.
#include "test_worker.hpp"

#include <mrr/reward/http_proxy.hpp>
#include <mrr/reward/http_server.hpp>

#include <arpa/inet.h>
#include <doctest/doctest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <nlohmann/json.hpp>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

using namespace std::chrono_literals;
using mrr::reward::HttpRouter;
using mrr::reward::RouterOptions;
using nlohmann::json;

namespace {

const std::string token = "hardening-token-0123456789abcdef";

// A TCP connection to 127.0.0.1 that writes exactly the bytes given, for requests no HTTP client
// library would send.
class RawClient {
 public:
  explicit RawClient(int port) {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    REQUIRE(fd_ >= 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<std::uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ = ::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  }
  RawClient(const RawClient&) = delete;
  RawClient& operator=(const RawClient&) = delete;
  ~RawClient() {
    if (fd_ >= 0) ::close(fd_);
  }
  [[nodiscard]] bool connected() const { return connected_; }

  bool send(std::string_view bytes) {
    while (!bytes.empty()) {
      const ssize_t n = ::send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL);
      if (n <= 0) return false;
      bytes.remove_prefix(static_cast<std::size_t>(n));
    }
    return true;
  }

  // One whole response (head + Content-Length; bytes after it are kept for the next call), or
  // what arrived before the peer closed or the timeout.
  std::string read_response(std::chrono::milliseconds timeout = 20s) {
    const auto give_up = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      if (const auto head = in_.find("\r\n\r\n"); head != std::string::npos) {
        const auto cl = in_.find("Content-Length: ");
        if (cl != std::string::npos && cl < head) {
          const std::size_t end = head + 4 + std::stoul(in_.substr(cl + 16));
          if (in_.size() >= end) {
            std::string one = in_.substr(0, end);
            in_.erase(0, end);
            return one;
          }
        }
      }
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(give_up - std::chrono::steady_clock::now());
      if (left.count() <= 0) return std::exchange(in_, {});
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
      char chunk[4096];
      const ssize_t n = ::recv(fd_, chunk, sizeof chunk, 0);
      if (n <= 0) return std::exchange(in_, {});
      in_.append(chunk, static_cast<std::size_t>(n));
    }
  }

  // Whether the peer closes the connection within `timeout`.
  bool closed_by_peer(std::chrono::milliseconds timeout) {
    const auto give_up = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < give_up) {
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, 100) <= 0) continue;
      char chunk[4096];
      const ssize_t n = ::recv(fd_, chunk, sizeof chunk, 0);
      if (n <= 0) return true;
    }
    return false;
  }

 private:
  int fd_ = -1;
  bool connected_ = false;
  std::string in_;
};

int status_line(const std::string& response) {
  if (response.rfind("HTTP/1.1 ", 0) != 0 || response.size() < 12) return 0;
  return std::stoi(response.substr(9, 3));
}

json json_body(const std::string& response) {
  const auto head = response.find("\r\n\r\n");
  if (head == std::string::npos) return json();
  return json::parse(response.substr(head + 4), nullptr, false);
}

mrr::reward::ServerOptions small_server() {
  mrr::reward::ServerOptions o;
  o.threads = 4;
  o.keep_alive_timeout = 1s;
  return o;
}

RouterOptions router_options() {
  RouterOptions o;
  o.dispatch.attempt_timeout = 20s;
  o.dispatch.request_timeout = 30s;
  o.health.reset();
  o.proxy.server = small_server();
  return o;
}

httplib::Client client_of(const std::string& url) {
  httplib::Client c(url);
  c.set_url_encode(false);
  c.set_tcp_nodelay(true);
  c.set_connection_timeout(10s);
  c.set_read_timeout(20s);
  c.set_write_timeout(20s);
  return c;
}

int status_of(const httplib::Result& r) {
  REQUIRE(r);
  return r->status;
}

json body_of(const httplib::Result& r) {
  REQUIRE(r);
  return json::parse(r->body, nullptr, false);
}

class EchoWorker {
 public:
  explicit EchoWorker(mrr::reward::ServerOptions o = small_server())
      : server_([](const mrr::reward::Request& r) { return mrr_test::answer({"echo"}, r); }, o) {}
  [[nodiscard]] std::string url() const { return server_.url(); }

 private:
  mrr::reward::RewardServer server_;
};

}  // namespace

TEST_SUITE("reward") {
  TEST_CASE("admin API: off without a token, and a token is needed for every /workers request") {
    EchoWorker worker;
    SUBCASE("no token configured: 403, nothing changes, /health still answers") {
      HttpRouter router({worker.url()}, router_options());
      auto client = client_of(router.url());
      const auto r = client.Post("/_mrr/workers?url=http://127.0.0.1:1");
      CHECK(status_of(r) == 403);
      CHECK(body_of(r)["error"] == "admin_disabled");
      CHECK(status_of(client.Delete("/_mrr/workers?url=" + worker.url())) == 403);
      CHECK(status_of(client.Get("/_mrr/workers")) == 403);
      CHECK(router.dispatcher().addresses() == std::vector<std::string>{worker.url()});
      CHECK(status_of(client.Get("/_mrr/health")) == 200);
    }
    SUBCASE("with a token: missing or wrong credentials are 401") {
      RouterOptions options = router_options();
      options.proxy.admin_token = token;
      HttpRouter router({worker.url()}, options);
      auto client = client_of(router.url());
      CHECK(status_of(client.Delete("/_mrr/workers?url=" + worker.url())) == 401);
      CHECK(status_of(client.Get("/_mrr/workers")) == 401);
      client.set_bearer_token_auth((token + "x").c_str());
      CHECK(status_of(client.Delete("/_mrr/workers?url=" + worker.url())) == 401);
      client.set_bearer_token_auth(token.substr(0, token.size() - 1).c_str());
      CHECK(status_of(client.Delete("/_mrr/workers?url=" + worker.url())) == 401);
      CHECK(router.dispatcher().addresses().size() == 1);
      client.set_bearer_token_auth(token.c_str());
      CHECK(status_of(client.Get("/_mrr/workers")) == 200);
      CHECK(status_of(client.Delete("/_mrr/workers?url=" + worker.url())) == 200);
      CHECK(router.dispatcher().addresses().empty());
      // A JSON body names the worker as well as the query string does.
      CHECK(status_of(client.Post("/_mrr/workers", json{{"url", worker.url()}}.dump(), "application/json")) == 201);
      CHECK(router.dispatcher().addresses() == std::vector<std::string>{worker.url()});
    }
    CHECK_THROWS_AS(
        [] {
          RouterOptions options = router_options();
          options.proxy.admin_token = "short";
          HttpRouter router({}, options);
        }(),
        mrr::InvalidArgument);
  }

  TEST_CASE("admin API: worker URLs with CR/LF, NUL or a host outside the allow-list are refused") {
    EchoWorker worker;
    RouterOptions options = router_options();
    options.proxy.admin_token = token;
    options.proxy.worker_policy.allowed_hosts = {"127.0.0.1"};
    HttpRouter router({}, options);
    auto client = client_of(router.url());
    client.set_bearer_token_auth(token.c_str());
    for (const std::string bad : {"http://127.0.0.1:1/%0d%0aX-Injected:%20yes", "http://127.0.0.1%0d%0a:1",
                                  "http://%00:1", "http://127.0.0.1%00.evil:1", "http://10.0.0.1:6379",
                                  "http://localhost:1", "http://127.0.0.1:99999", "ftp://127.0.0.1:1"}) {
      CAPTURE(bad);
      const auto r = client.Post("/_mrr/workers?url=" + bad);
      CHECK(status_of(r) == 400);
      CHECK(body_of(r)["error"] == "bad_request");
    }
    CHECK(router.dispatcher().addresses().empty());
    CHECK(status_of(client.Post("/_mrr/workers?url=" + worker.url())) == 201);
    CHECK(status_of(client.Post("/score", "{}", "application/json")) == 200);
    // The allow-list applies to the initial workers too.
    CHECK_THROWS_AS(HttpRouter({"http://10.1.2.3:80"}, options), mrr::InvalidArgument);
  }

  TEST_CASE("admin API on its own address: the proxy's port does not serve it") {
    EchoWorker worker;
    RouterOptions options = router_options();
    options.proxy.admin_token = token;
    options.proxy.admin_server = small_server();
    HttpRouter router({}, options);
    REQUIRE(router.admin_port() != router.port());
    auto proxy = client_of(router.url());
    proxy.set_bearer_token_auth(token.c_str());
    const auto refused = proxy.Post("/_mrr/workers?url=" + worker.url());
    CHECK(status_of(refused) == 404);
    CHECK(body_of(refused)["error"] == "not_found");
    auto admin = client_of(router.admin_url());
    admin.set_bearer_token_auth(token.c_str());
    CHECK(status_of(admin.Post("/_mrr/workers?url=" + worker.url())) == 201);
    CHECK(status_of(admin.Post("/score", "{}", "application/json")) == 404);  // no traffic there
    CHECK(status_of(proxy.Post("/score", "{}", "application/json")) == 200);
  }

  TEST_CASE("admin POST without a body or Content-Length: 400 with a JSON reason, at once") {
    RouterOptions options = router_options();
    options.proxy.admin_token = token;
    HttpRouter router({}, options);
    RawClient raw(router.port());
    REQUIRE(raw.connected());
    REQUIRE(raw.send("POST /_mrr/workers HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + token + "\r\n\r\n"));
    const std::string response = raw.read_response();
    CHECK(status_line(response) == 400);
    CHECK(json_body(response)["error"] == "bad_request");
  }

  TEST_CASE("slowloris: 100 connections trickling their heads do not stop a normal request") {
    EchoWorker worker;
    HttpRouter router({worker.url()}, router_options());  // 4 threads: fewer than the slow clients
    std::vector<std::unique_ptr<RawClient>> slow;
    for (int i = 0; i < 100; ++i) {
      slow.push_back(std::make_unique<RawClient>(router.port()));
      REQUIRE(slow.back()->connected());
      slow.back()->send("POST /score HTTP/1.1\r\nHost: x\r\n");
    }
    std::atomic<bool> done{false};
    std::thread trickle([&] {
      // A header byte per connection every second, for at most 30 s (until the normal request is done).
      for (int round = 0; round < 300 && !done; ++round) {
        if (round % 10 == 0)
          for (auto& c : slow)
            c->send("X");
        std::this_thread::sleep_for(100ms);
      }
    });
    auto client = client_of(router.url());
    const auto r = client.Post("/score", R"({"solution": "#### 1", "truth": "1"})", "application/json");
    done = true;
    trickle.join();
    REQUIRE(r);
    CHECK(r->status == 200);
    CHECK(json::parse(r->body)["score"] == 1.0);
  }

  TEST_CASE("a slow head is cut at the header timeout with 408") {
    EchoWorker worker;
    RouterOptions options = router_options();
    options.proxy.server.header_timeout = 300ms;
    HttpRouter router({worker.url()}, options);
    RawClient partial(router.port());
    REQUIRE(partial.send("POST /score HTTP/1.1\r\nHost: x\r\n"));
    const std::string response = partial.read_response();
    CHECK(status_line(response) == 408);
    CHECK(json_body(response)["error"] == "request_timeout");
  }

  TEST_CASE("a server at its connection cap sheds new connections with 503, and recovers") {
    EchoWorker worker;
    RouterOptions options = router_options();
    options.proxy.server.max_connections = 8;
    HttpRouter router({worker.url()}, options);
    std::vector<std::unique_ptr<RawClient>> idle;
    for (int i = 0; i < 8; ++i) {
      idle.push_back(std::make_unique<RawClient>(router.port()));
      REQUIRE(idle.back()->connected());
    }
    // Connections are accepted in the order they were made: the ninth finds the cap reached.
    RawClient extra(router.port());
    REQUIRE(extra.send("GET /_mrr/health HTTP/1.1\r\nHost: x\r\n\r\n"));
    const std::string shed = extra.read_response();
    CHECK(status_line(shed) == 503);
    CHECK(json_body(shed)["error"] == "overloaded");
    idle.clear();  // closing them gives the slots back
    auto client = client_of(router.url());
    bool served = false;
    for (int i = 0; i < 200 && !served; ++i) {
      const auto r = client.Post("/score", "{}", "application/json");
      served = r && r->status == 200;
      if (!served) std::this_thread::sleep_for(50ms);
    }
    CHECK(served);
  }

  TEST_CASE("an over-limit Content-Length is answered 413 at once, without reading the body") {
    EchoWorker worker;
    RouterOptions options = router_options();
    options.proxy.server.max_body_bytes = 1 << 20;
    HttpRouter router({worker.url()}, options);
    for (const char* length : {"1000000000000000", "1048577"}) {
      CAPTURE(length);
      RawClient raw(router.port());
      REQUIRE(raw.send(std::string("POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                   "Content-Length: ") +
                       length + "\r\n\r\n{\"a\":"));
      const std::string response = raw.read_response();
      CHECK(status_line(response) == 413);
      CHECK(json_body(response)["error"] == "payload_too_large");
      CHECK(raw.closed_by_peer(20s));
    }
    // With Expect: 100-continue the refusal comes instead of "100 Continue".
    RawClient expect(router.port());
    REQUIRE(expect.send("POST /score HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 2000000\r\n\r\n"));
    CHECK(status_line(expect.read_response()) == 413);
    // A chunked body is counted as it arrives.
    RawClient chunked(router.port());
    REQUIRE(chunked.send("POST /score HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"));
    const std::string piece(64 * 1024, 'a');
    for (int i = 0; i < 20; ++i)
      if (!chunked.send("10000\r\n" + piece + "\r\n")) break;
    CHECK(status_line(chunked.read_response()) == 413);
    // At the limit is fine.
    auto client = client_of(router.url());
    const auto ok = client.Post("/score", std::string(1 << 20, 'x'), "text/plain");
    CHECK(status_of(ok) == 200);
  }

  TEST_CASE("bodies are forwarded as raw bytes whatever their content type or encoding") {
    EchoWorker worker;
    HttpRouter router({worker.url()}, router_options());
    auto client = client_of(router.url());
    // curl -d: form-urlencoded, over cpp-httplib's 8 KB form limit.
    std::string form = "a=1";
    while (form.size() < 20000)
      form += "&k" + std::to_string(form.size()) + "=v%20x";
    const auto f = client.Post("/score", form, "application/x-www-form-urlencoded");
    REQUIRE(status_of(f) == 200);
    CHECK(json::parse(f->body)["body"] == form);
    CHECK(json::parse(f->body)["headers"]["content-type"] == "application/x-www-form-urlencoded");
    // Multipart is not parsed either.
    const std::string multipart = "--XyZ\r\nContent-Disposition: form-data; name=\"f\"\r\n\r\nvalue\r\n--XyZ--\r\n";
    const auto m = client.Post("/score", multipart, "multipart/form-data; boundary=XyZ");
    REQUIRE(status_of(m) == 200);
    CHECK(json::parse(m->body)["body"] == multipart);
    // Content-Encoding is the worker's business: the bytes are not decompressed on the way.
    const auto g = client.Post("/score", {{"Content-Encoding", "gzip"}}, "not really gzip", "application/json");
    REQUIRE(status_of(g) == 200);
    CHECK(json::parse(g->body)["body"] == "not really gzip");
    CHECK(json::parse(g->body)["headers"]["content-encoding"] == "gzip");
    // And the answer is relayed as the worker sent it, not gzipped for a client that accepts gzip.
    client.set_decompress(false);
    const auto a = client.Post("/score", {{"Accept-Encoding", "gzip"}}, "{}", "application/json");
    REQUIRE(status_of(a) == 200);
    CHECK(!a->has_header("Content-Encoding"));
    CHECK(json::parse(a->body, nullptr, false).is_object());
    // A body on GET is read (and forwarded), not left on the connection as the next request.
    RawClient raw(router.port());
    REQUIRE(raw.send("GET /g HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello"
                     "GET /h HTTP/1.1\r\nHost: x\r\n\r\n"));
    const std::string first = raw.read_response();
    CHECK(status_line(first) == 200);
    CHECK(json_body(first)["body"] == "hello");
    CHECK(json_body(first)["target"] == "/g");
    const std::string second = raw.read_response();
    CHECK(status_line(second) == 200);
    CHECK(json_body(second)["target"] == "/h");
  }

  TEST_CASE("conflicting or malformed framing is refused with 400 and a JSON reason") {
    EchoWorker worker;
    HttpRouter router({worker.url()}, router_options());
    for (const char* head : {"Content-Length: 5\r\nContent-Length: 6\r\n", "Content-Length: 5, 6\r\n",
                             "Content-Length: -5\r\n", "Content-Length: 0x5\r\n",
                             "Content-Length: 5\r\nTransfer-Encoding: chunked\r\n"}) {
      CAPTURE(head);
      RawClient raw(router.port());
      REQUIRE(raw.send(std::string("POST /score HTTP/1.1\r\nHost: x\r\n") + head + "\r\nhello"));
      const std::string response = raw.read_response();
      CHECK(status_line(response) == 400);
      CHECK(json_body(response)["error"] == "bad_request");
      CHECK(!json_body(response)["detail"].get<std::string>().empty());
    }
    RawClient gzip_te(router.port());
    REQUIRE(gzip_te.send("POST /score HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"));
    CHECK(status_line(gzip_te.read_response()) == 501);
    // Equal repeated values are one length (RFC 9110 §8.6).
    RawClient same(router.port());
    REQUIRE(same.send("POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\nhello"));
    const std::string ok = same.read_response();
    CHECK(status_line(ok) == 200);
    CHECK(json_body(ok)["body"] == "hello");
  }

}  // TEST_SUITE
