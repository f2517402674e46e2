// The reward transport's own HTTP/1.1 client against raw workers on 127.0.0.1 that record the
// bytes they receive and answer with scripted bytes: the request goes out as the proxy received
// it, a HEAD answer keeps its Content-Length, a worker answering before it reads a large body is
// heard at once (not timed out, not evicted), pooled connections a worker closed are not used,
// and every framing of an answer (length, chunked, end of connection, 1xx first) is read whole.
#include "raw_client.hpp"
#include "scripted_worker.hpp"

#include <mrr/reward/http_proxy.hpp>
#include <mrr/reward/http_transport.hpp>

#include <doctest/doctest.h>
#include <httplib.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <functional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <sys/time.h>

#if defined(CPPHTTPLIB_OPENSSL_SUPPORT) && defined(MRR_REWARD_TEST_OPENSSL)
#include <openssl/ssl.h>
#endif

using namespace std::chrono_literals;
using mrr::reward::Duration;
using mrr::reward::Failure;
using mrr::reward::HttpTransport;
using mrr_test::ScriptedWorker;

namespace {

std::string ok_answer(const std::string& body, const std::string& extra = "") {
  return "HTTP/1.1 200 OK\r\nContent-Length: " + std::to_string(body.size()) + "\r\n" + extra + "\r\n" + body;
}

// Reads one request head off `fd` (and leaves what follows in `in`); false if the client went,
// or after 10 s without a byte (a test that fails does not hang joining the worker's thread).
bool read_head(int fd, std::string& in, std::string& head) {
  const timeval limit{10, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof limit);
  std::size_t end;
  while ((end = in.find("\r\n\r\n")) == std::string::npos) {
    char buf[65536];
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) return false;
    in.append(buf, static_cast<std::size_t>(n));
  }
  head = in.substr(0, end + 4);
  in.erase(0, end + 4);
  return true;
}

// Reads `length` body bytes (after what `in` holds); false if the client went first.
bool read_body(int fd, std::string& in, std::size_t length) {
  while (in.size() < length) {
    char buf[65536];
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) return false;
    in.append(buf, static_cast<std::size_t>(n));
  }
  in.erase(0, length);
  return true;
}

std::size_t content_length(const std::string& head) {
  const auto at = head.find("\r\nContent-Length: ");
  return at == std::string::npos ? 0 : std::stoul(head.substr(at + 18));
}

void send_all(int fd, const std::string& bytes) {
  for (std::size_t sent = 0; sent < bytes.size();) {
    const ssize_t n = ::send(fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) return;
    sent += static_cast<std::size_t>(n);
  }
}

std::string header_value(const mrr::reward::Headers& headers, const std::string& name) {
  for (const auto& [n, v] : headers)
    if (mrr::reward::detail::iequals(n, name)) return v;
  return "<none>";
}

#if defined(CPPHTTPLIB_OPENSSL_SUPPORT) && defined(MRR_REWARD_TEST_OPENSSL)
// The raw TLS workers' server context, with the test's own certificate, which the process's TLS
// clients are told to trust (SSL_CERT_FILE).
class TestTlsContext {
 public:
  TestTlsContext() : ctx_(SSL_CTX_new(TLS_server_method())) {
    const std::string dir = MRR_REWARD_TEST_DATA;
    REQUIRE(ctx_ != nullptr);
    REQUIRE(SSL_CTX_use_certificate_file(ctx_, (dir + "/tls_test_cert.pem").c_str(), SSL_FILETYPE_PEM) == 1);
    REQUIRE(SSL_CTX_use_PrivateKey_file(ctx_, (dir + "/tls_test_key.pem").c_str(), SSL_FILETYPE_PEM) == 1);
    ::setenv("SSL_CERT_FILE", (dir + "/tls_test_cert.pem").c_str(), 1);
  }
  TestTlsContext(const TestTlsContext&) = delete;
  TestTlsContext& operator=(const TestTlsContext&) = delete;
  ~TestTlsContext() { SSL_CTX_free(ctx_); }

  // One connection of a raw TLS worker: the handshake on `fd`, then `session`; closes `fd`.
  void serve(int fd, const std::function<void(SSL*)>& session) const {
    SSL* ssl = SSL_new(ctx_);
    SSL_set_fd(ssl, fd);
    if (SSL_accept(ssl) == 1) session(ssl);
    SSL_free(ssl);
    ::close(fd);
  }

 private:
  SSL_CTX* ctx_;
};

// Reads through the next request head on `ssl` (what follows it stays in `in`); false if the
// client went first.
bool ssl_read_head(SSL* ssl, std::string& in, std::string& head) {
  std::size_t end;
  char buf[16384];
  int n = 0;
  while ((end = in.find("\r\n\r\n")) == std::string::npos && (n = SSL_read(ssl, buf, sizeof buf)) > 0)
    in.append(buf, static_cast<std::size_t>(n));
  if (end == std::string::npos) return false;
  head = in.substr(0, end + 4);
  in.erase(0, end + 4);
  return true;
}
#endif

}  // namespace

TEST_SUITE("reward") {
  TEST_CASE("http client: the request goes to the worker as received, nothing added but Host and Content-Length") {
    ScriptedWorker worker([](const std::string&, const std::string&) { return ok_answer("done"); });
    HttpTransport transport;
    mrr::reward::Request r;
    r.method = "POST";
    r.target = "/score?x=%41&y";  // verbatim, nothing decoded
    r.headers = {{"X-A", "1"},         {"Content-Type", "application/json"}, {"X-A", "3"}, {"Connection", "X-Hop"},
                 {"X-Hop", "dropped"}, {"Keep-Alive", "timeout=5"}};
    r.body = "{\"n\": 1}";
    const auto reply = transport.send(worker.url(), r, 5s);
    REQUIRE(reply.answered());
    CHECK(reply.response.status == 200);
    CHECK(reply.response.body == "done");
    REQUIRE(worker.heads().size() == 1);
    CHECK(worker.heads()[0] ==
          "POST /score?x=%41&y HTTP/1.1\r\nHost: 127.0.0.1:" + std::to_string(worker.port()) +
              "\r\nX-A: 1\r\nContent-Type: application/json\r\nX-A: 3\r\nContent-Length: 8\r\n\r\n");
    CHECK(worker.bodies()[0] == r.body);

    // A GET without a body sends no Content-Length; a POST without one sends 0.
    r.method = "GET";
    r.headers.clear();
    r.body.clear();
    REQUIRE(transport.send(worker.url(), r, 5s).answered());
    r.method = "POST";
    REQUIRE(transport.send(worker.url(), r, 5s).answered());
    const auto heads = worker.heads();
    REQUIRE(heads.size() == 3);
    CHECK(heads[1].find("Content-Length") == std::string::npos);
    CHECK(heads[2].find("\r\nContent-Length: 0\r\n") != std::string::npos);
    CHECK(worker.connections() == 1);  // one keep-alive connection carried all three

    // Bytes that would end the head early are refused before anything is sent.
    r.headers = {{"X-Evil", "a\r\nX-Injected: 1"}};
    auto bad = transport.send(worker.url(), r, 5s);
    CHECK(bad.failure == Failure::exception);
    CHECK(bad.error.find("'X-Evil' holds a control byte") != std::string::npos);
    r.headers = {{"Bad Name", "x"}};
    bad = transport.send(worker.url(), r, 5s);
    CHECK(bad.error.find("'Bad Name' is not a token") != std::string::npos);
    r.headers.clear();
    r.target = "/a b";
    CHECK(transport.send(worker.url(), r, 5s).failure == Failure::exception);
    CHECK(worker.heads().size() == 3);
  }

  TEST_CASE("http client: a HEAD answer keeps its Content-Length; 204, 304 and 1xx are framed right") {
    ScriptedWorker worker([](const std::string& head, const std::string&) -> std::string {
      if (head.starts_with("HEAD ")) return "HTTP/1.1 200 OK\r\nContent-Length: 1234\r\nETag: \"v1\"\r\n\r\n";
      if (head.starts_with("DELETE ")) return "HTTP/1.1 204 No Content\r\nX-Done: 1\r\n\r\n";
      if (head.starts_with("PUT ")) return "HTTP/1.1 304 Not Modified\r\nContent-Length: 99\r\n\r\n";
      return "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n" + ok_answer("after 1xx");
    });
    HttpTransport transport;
    mrr::reward::Request r;
    r.method = "HEAD";
    auto reply = transport.send(worker.url(), r, 5s);
    REQUIRE(reply.answered());
    CHECK(reply.response.body.empty());
    CHECK(header_value(reply.response.headers, "Content-Length") == "1234");  // what a GET would carry
    CHECK(header_value(reply.response.headers, "ETag") == "\"v1\"");
    r.method = "DELETE";
    reply = transport.send(worker.url(), r, 5s);
    REQUIRE(reply.answered());
    CHECK(reply.response.status == 204);
    CHECK(header_value(reply.response.headers, "X-Done") == "1");
    r.method = "PUT";
    reply = transport.send(worker.url(), r, 5s);
    REQUIRE(reply.answered());
    CHECK(reply.response.status == 304);
    CHECK(reply.response.body.empty());                                     // no body despite the length
    CHECK(header_value(reply.response.headers, "Content-Length") == "99");  // a GET's length (RFC 9110 §8.6)
    r.method = "POST";
    reply = transport.send(worker.url(), r, 5s);
    REQUIRE(reply.answered());
    CHECK(reply.response.status == 200);
    CHECK(reply.response.body == "after 1xx");
    CHECK(header_value(reply.response.headers, "Link") == "<none>");  // the interim answer's fields go
    CHECK(worker.connections() == 1);  // every answer was framed right: the connection stayed in step

    // Through the router, the client's HEAD gets the worker's length (cpp-httplib's server wrote 0).
    mrr::reward::RouterOptions options;
    options.health = std::nullopt;
    mrr::reward::HttpRouter router({worker.url()}, options);
    mrr_test::RawClient client(router.port());
    REQUIRE(client.send("HEAD /doc HTTP/1.1\r\nHost: x\r\n\r\n"));
    const std::string answer = client.read_response(1000ms);  // no body follows: read what came
    CHECK(answer.starts_with("HTTP/1.1 200 "));
    CHECK(answer.find("\r\nContent-Length: 1234\r\n") != std::string::npos);
    CHECK(answer.find("Content-Length: 0") == std::string::npos);
    CHECK(answer.find("\r\nETag: \"v1\"\r\n") != std::string::npos);
    CHECK(answer.ends_with("\r\n\r\n"));
    // A 304 keeps its length too (cpp-httplib's server wrote Content-Length: 0).
    REQUIRE(client.send("PUT /doc HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"));
    const std::string not_modified = client.read_response(1000ms);
    CHECK(not_modified.starts_with("HTTP/1.1 304 "));
    CHECK(not_modified.find("\r\nContent-Length: 99\r\n") != std::string::npos);
    CHECK(not_modified.find("Content-Length: 0") == std::string::npos);
    CHECK(not_modified.ends_with("\r\n\r\n"));
  }

  TEST_CASE("http client: a worker answering before it reads a large body is heard, not timed out") {
    // The worker refuses at the head (as a server with a body limit does) and never reads the
    // 32 MiB body; cpp-httplib's client sent the whole body first and timed the attempt out.
    ScriptedWorker worker(
        [](const std::string&, const std::string&) {
          return std::string(
              "HTTP/1.1 413 Payload Too Large\r\nContent-Length: 9\r\nContent-Type: text/plain\r\n"
              "Connection: close\r\n\r\ntoo large");
        },
        {.read_body = false});
    HttpTransport transport;
    mrr::reward::Request r;
    r.target = "/score";
    r.body.assign(32u << 20, 'x');
    const auto start = std::chrono::steady_clock::now();
    const auto reply = transport.send(worker.url(), r, 10s);
    const auto elapsed = std::chrono::steady_clock::now() - start;
    REQUIRE(reply.answered());
    CHECK(reply.response.status == 413);
    CHECK(reply.response.body == "too large");
    CHECK(elapsed < 5s);  // generous: it is answered at once, the budget is 10 s

    // Through the router the client gets the 413, and the worker stays healthy (no eviction).
    mrr::reward::RouterOptions options;
    options.health = std::nullopt;
    options.dispatch.attempt_timeout = 10s;
    options.dispatch.failures_to_evict = 1;
    mrr::reward::HttpRouter router({worker.url()}, options);
    httplib::Client client(router.url());
    client.set_read_timeout(30s);
    client.set_write_timeout(30s);
    for (int i = 0; i < 3; ++i) {
      const auto res = client.Post("/score", std::string(8u << 20, 'y'), "application/octet-stream");
      REQUIRE(res);
      CHECK(res->status == 413);
      CHECK(res->body == "too large");
      CHECK(res->get_header_value("X-Mrr-Attempts") == "1");
    }
    CHECK(router.dispatcher().stats(worker.url())->failures == 0);
    CHECK(router.dispatcher().stats(worker.url())->healthy);
  }

  TEST_CASE("http client: a pooled connection the worker closed is not used; framings read whole") {
    // The worker closes after each answer without saying so: the next request must not go out on
    // the closed connection.
    ScriptedWorker closing([](const std::string&, const std::string& body) { return ok_answer("got " + body); },
                           {.close_after = true});
    HttpTransport transport;
    mrr::reward::Request r;
    r.target = "/score";
    for (int i = 0; i < 5; ++i) {
      r.body = std::to_string(i);
      // Time for the worker's FIN to arrive: a POST sent whole on a connection closed under it is
      // not sent again by the client (below), so this checks the pool's check alone.
      std::this_thread::sleep_for(20ms);
      const auto reply = transport.send(closing.url(), r, 5s);
      REQUIRE(reply.answered());
      CHECK(reply.response.body == "got " + std::to_string(i));
    }
    CHECK(closing.connections() == 5);
    CHECK(closing.heads().size() == 5);  // each request reached the worker once

    // Chunked (extensions and trailers), end of connection, and a body split across reads.
    const std::string big(300000, 'z');
    ScriptedWorker framing([&](const std::string& head, const std::string&) -> std::string {
      if (head.starts_with("GET /chunked"))
        return "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\n"
               "X-Trailer: t\r\n\r\n";
      if (head.starts_with("GET /close")) return "HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end";
      if (head.starts_with("GET /http10")) return "HTTP/1.0 200 OK\r\n\r\nold style";
      if (head.starts_with("GET /bad")) return "HTTP/1.1 2x0 What\r\n\r\n";
      return ok_answer(big);
    });
    mrr::reward::Request get;
    get.method = "GET";
    get.target = "/chunked";
    auto reply = transport.send(framing.url(), get, 5s);
    REQUIRE(reply.answered());
    CHECK(reply.response.body == "hello world");
    get.target = "/close";
    reply = transport.send(framing.url(), get, 5s);
    REQUIRE(reply.answered());
    CHECK(reply.response.body == "until the end");
    get.target = "/http10";
    reply = transport.send(framing.url(), get, 5s);
    REQUIRE(reply.answered());
    CHECK(reply.response.body == "old style");
    get.target = "/big";
    reply = transport.send(framing.url(), get, 5s);
    REQUIRE(reply.answered());
    CHECK(reply.response.body == big);
    get.target = "/bad";
    reply = transport.send(framing.url(), get, 5s);
    CHECK(reply.failure == Failure::io);
    CHECK(reply.error.find("status line") != std::string::npos);
    // Over max_response_bytes: by its length at once, and by a body delimited by the close.
    mrr::reward::HttpTransportOptions small;
    small.max_response_bytes = 1000;
    HttpTransport limited(small);
    get.target = "/big";
    reply = limited.send(framing.url(), get, 5s);
    CHECK(reply.failure == Failure::io);
    CHECK(reply.error.find("max_response_bytes (1000 bytes)") != std::string::npos);
    // /chunked and /close shared one connection (closed by /close), /http10 had one, /big and /bad
    // shared one (dropped after the bad answer), and the limited transport opened its own.
    CHECK(framing.connections() == 4);
  }

  TEST_CASE("http client: connection refused and an unresolvable host are connect failures") {
    int port = 0;
    {
      ScriptedWorker gone([](const std::string&, const std::string&) { return ok_answer(""); });
      port = gone.port();
    }
    HttpTransport transport;
    mrr::reward::Request r;
    auto reply = transport.send("http://127.0.0.1:" + std::to_string(port), r, 2s);
    CHECK(reply.failure == Failure::connect);
    CHECK(reply.error.find("cannot connect to http://127.0.0.1:") != std::string::npos);
    reply = transport.send("http://no-such-host.invalid:80", r, 2s);
    CHECK(reply.failure == Failure::connect);
    CHECK(reply.error.find("cannot resolve 'no-such-host.invalid'") != std::string::npos);
    CHECK_FALSE(transport.check_health("http://127.0.0.1:" + std::to_string(port), 1s));
  }

  TEST_CASE("http client: interim answers while the body is sent are dropped and the body goes on") {
    // 100 Continue or 103 Early Hints right after the head, then the 200 once the whole body is
    // in: the client stopped sending at the interim answer and timed out before.
    for (const std::string interim :
         {"HTTP/1.1 100 Continue\r\n\r\n", "HTTP/1.1 103 Early Hints\r\nLink: </s>\r\n\r\n"}) {
      CAPTURE(interim);
      std::atomic<std::size_t> received{0};
      mrr_test::LoopbackListener listener;
      listener.start([&](int fd) {
        std::string in, head;
        if (read_head(fd, in, head)) {
          send_all(fd, interim);
          const std::size_t length = content_length(head);
          if (read_body(fd, in, length)) {
            received = length;
            send_all(fd, ok_answer("got " + std::to_string(length)));
          }
        }
        ::close(fd);
      });
      HttpTransport transport;
      mrr::reward::Request r;
      r.target = "/score";
      r.body.assign(16u << 20, 'x');
      const auto reply = transport.send(listener.url(), r, 20s);
      REQUIRE(reply.answered());
      CHECK(reply.response.status == 200);
      CHECK(reply.response.body == "got " + std::to_string(r.body.size()));
      CHECK(received.load() == r.body.size());
    }
  }

  TEST_CASE("http client: a POST the worker read whole on a reused connection is not sent again") {
    // The worker answers the first request of a connection, reads the second whole and closes
    // without answering (it crashed, or timed the exchange out). The client may not know whether
    // the worker acted on it: a POST fails (the dispatcher's policy decides about retrying), an
    // idempotent GET goes once more on a fresh connection.
    std::mutex mutex;
    std::vector<std::string> seen;  // "<connection>:<request line>"
    std::atomic<int> next_connection{0};
    mrr_test::LoopbackListener listener;
    listener.start([&](int fd) {
      const int connection = next_connection++;
      std::string in, head;
      for (int n = 0; read_head(fd, in, head) && read_body(fd, in, content_length(head)); ++n) {
        {
          const std::lock_guard lock(mutex);
          seen.push_back(std::to_string(connection) + ":" + head.substr(0, head.find("\r\n")));
        }
        if (n == 1) break;  // the second request of a connection: read, never answered
        send_all(fd, ok_answer("first"));
      }
      ::close(fd);
    });
    HttpTransport transport;
    mrr::reward::Request r;
    r.target = "/post";
    r.body = "score me";
    REQUIRE(transport.send(listener.url(), r, 5s).answered());
    const auto lost = transport.send(listener.url(), r, 5s);
    CHECK(lost.failure == Failure::io);
    CHECK(lost.error.find("closed the connection") != std::string::npos);
    {
      const std::lock_guard lock(mutex);
      CHECK(seen == std::vector<std::string>{"0:POST /post HTTP/1.1", "0:POST /post HTTP/1.1"});
    }
    r.method = "GET";
    r.target = "/get";
    r.body.clear();
    REQUIRE(transport.send(listener.url(), r, 5s).answered());  // connection 1, first request
    const auto again = transport.send(listener.url(), r, 5s);   // read whole on 1, sent again on 2
    REQUIRE(again.answered());
    CHECK(again.response.body == "first");
    const std::lock_guard lock(mutex);
    CHECK(seen == std::vector<std::string>{"0:POST /post HTTP/1.1", "0:POST /post HTTP/1.1", "1:GET /get HTTP/1.1",
                                           "1:GET /get HTTP/1.1", "2:GET /get HTTP/1.1"});
  }

  TEST_CASE("http client: transfer codings other than chunked alone fail; HTTP/1.0 framing by them is not reused") {
    ScriptedWorker worker([](const std::string& head, const std::string&) -> std::string {
      if (head.starts_with("GET /gzip"))  // gzip then chunked: the body would reach the client still gzipped
        return "HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n";
      if (head.starts_with("GET /twice"))
        return "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n";
      // HEAD: no body to decode, the coding is what a GET would use.
      return "HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n";
    });
    HttpTransport transport;
    mrr::reward::Request get;
    get.method = "GET";
    for (const std::string target : {"/gzip", "/twice"}) {
      get.target = target;
      const auto reply = transport.send(worker.url(), get, 5s);
      CHECK(reply.failure == Failure::io);
      CHECK(reply.error.find("only chunked alone is decoded") != std::string::npos);
    }
    get.method = "HEAD";
    get.target = "/gzip";
    CHECK(transport.send(worker.url(), get, 5s).answered());
    // HTTP/1.0 with Transfer-Encoding: faulty framing, read but the connection not kept, though
    // the worker says keep-alive and keeps it open.
    mrr_test::LoopbackListener old;
    old.start([](int fd) {
      std::string in, head;
      while (read_head(fd, in, head))
        send_all(fd,
                 "HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n");
      ::close(fd);
    });
    get.method = "GET";
    get.target = "/old";
    for (int i = 0; i < 2; ++i) {
      const auto reply = transport.send(old.url(), get, 5s);
      REQUIRE(reply.answered());
      CHECK(reply.response.body == "ok");
    }
    CHECK(old.connections() == 2);
  }

  TEST_CASE("http client: a response head with bare LF line ends is an I/O failure at once, not a timeout") {
    mrr_test::LoopbackListener listener;
    listener.start([](int fd) {
      std::string in, head;
      if (read_head(fd, in, head)) send_all(fd, "HTTP/1.1 200 OK\nContent-Length: 2\n\nok");
      std::string rest;
      read_head(fd, rest, head);  // keeps the connection open until the client goes
      ::close(fd);
    });
    HttpTransport transport;
    mrr::reward::Request r;
    const auto start = std::chrono::steady_clock::now();
    const auto reply = transport.send(listener.url(), r, 5s);
    CHECK(reply.failure == Failure::io);
    CHECK(reply.error.find("bare LF") != std::string::npos);
    CHECK(std::chrono::steady_clock::now() - start < 4s);  // not the 5 s budget
  }

  TEST_CASE("http client: a worker streaming without end is cut at the budget; a budget of 0 sends nothing") {
    // The worker answers at once and then sends chunk after chunk (each with an extension) until
    // the client goes: the socket always has bytes, so only a deadline checked before each wait
    // ends the exchange (it ran 25 s and more on a 1 s budget before).
    std::atomic<int> requests{0};
    mrr_test::LoopbackListener listener;
    listener.start([&](int fd) {
      std::string in, head;
      if (read_head(fd, in, head)) {
        ++requests;
        send_all(fd, "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n");
        std::string chunk;  // 256 chunks of one byte, each with a 4,000-byte extension, per write
        for (int i = 0; i < 256; ++i)
          chunk += "1;" + std::string(4000, 'x') + "\r\nA\r\n";
        const auto until = std::chrono::steady_clock::now() + 20s;
        while (!listener.stopping() && std::chrono::steady_clock::now() < until) {
          if (::send(fd, chunk.data(), chunk.size(), MSG_NOSIGNAL) <= 0) break;
        }
      }
      ::close(fd);
    });
    HttpTransport transport;
    mrr::reward::Request r;
    r.method = "POST";
    r.body = "x";
    const auto start = std::chrono::steady_clock::now();
    const auto reply = transport.send(listener.url(), r, 1s);
    const auto took = std::chrono::steady_clock::now() - start;
    CHECK(reply.failure == Failure::timeout);
    CHECK_MESSAGE(took < 3s, std::chrono::duration_cast<std::chrono::milliseconds>(took).count(), " ms");
    CHECK(requests.load() == 1);

    for (const auto budget : {Duration(0), -std::chrono::duration_cast<Duration>(5ms)}) {
      const auto none = transport.send(listener.url(), r, budget);
      CHECK(none.failure == Failure::timeout);
      CHECK(none.error.find("nothing was sent") != std::string::npos);
    }
    std::this_thread::sleep_for(100ms);
    CHECK(requests.load() == 1);  // no request reached the worker
  }

  TEST_CASE("http client: an absolute-form target reaches the worker in origin form, below its base path") {
    ScriptedWorker worker([](const std::string&, const std::string&) { return ok_answer("ok"); });
    HttpTransport transport;
    mrr::reward::Request r;
    r.method = "GET";
    // It was glued to the base path whole: "GET /apihttp://elsewhere/x?y=1".
    for (const auto& [target, sent] :
         std::vector<std::pair<std::string, std::string>>{{"http://elsewhere/x?y=1", "GET /api/x?y=1 HTTP/1.1"},
                                                          {"HTTPS://elsewhere:8443?q", "GET /api/?q HTTP/1.1"},
                                                          {"http://elsewhere", "GET /api/ HTTP/1.1"},
                                                          {"/plain", "GET /api/plain HTTP/1.1"}}) {
      CAPTURE(target);
      r.target = target;
      const auto reply = transport.send(worker.url() + "/api", r, 5s);
      REQUIRE_MESSAGE(reply.answered(), reply.error);
      CHECK(worker.heads().back().starts_with(sent + "\r\n"));
    }
    r.method = "OPTIONS";
    r.target = "*";
    auto reply = transport.send(worker.url(), r, 5s);
    REQUIRE(reply.answered());
    CHECK(worker.heads().back().starts_with("OPTIONS * HTTP/1.1\r\n"));
    const auto heads = worker.heads().size();
    reply = transport.send(worker.url() + "/api", r, 5s);  // no meaning below a base path
    CHECK(reply.failure == Failure::exception);
    CHECK(reply.error.find("asterisk") != std::string::npos);
    r.method = "GET";
    r.target = "elsewhere/x";
    reply = transport.send(worker.url(), r, 5s);
    CHECK(reply.failure == Failure::exception);
    CHECK(worker.heads().size() == heads);  // neither was sent
  }

  TEST_CASE("http client: a host name is resolved within the attempt (localhost)") {
    ScriptedWorker worker([](const std::string&, const std::string&) { return ok_answer("by name"); });
    HttpTransport transport;
    mrr::reward::Request r;
    const auto reply = transport.send("http://localhost:" + std::to_string(worker.port()), r, 5s);
    REQUIRE(reply.answered());
    CHECK(reply.response.body == "by name");
    CHECK(transport.check_health("http://localhost:" + std::to_string(worker.port()), 2s));
  }

#if defined(CPPHTTPLIB_OPENSSL_SUPPORT) && defined(MRR_REWARD_TEST_OPENSSL)
  TEST_CASE("https: a worker that closes before reading the body does not end the process with SIGPIPE") {
    // A TLS worker that reads the request head, answers 413 and closes with the body unread (the
    // kernel resets the connection). cpp-httplib's TLS client writes with write(2), which raised
    // SIGPIPE there and ended the process: a trainer's process need not ignore SIGPIPE (httplib::
    // Server sets SIG_IGN when constructed, so this test puts the default back while it runs).
    const TestTlsContext tls;
    std::atomic<int> heads{0};
    mrr_test::LoopbackListener listener;
    listener.start([&](int fd) {
      tls.serve(fd, [&](SSL* ssl) {  // closes with the body unread: a reset
        std::string in, head;
        if (!ssl_read_head(ssl, in, head)) return;
        ++heads;
        const std::string answer =
            "HTTP/1.1 413 Payload Too Large\r\nContent-Length: 9\r\nConnection: close\r\n\r\ntoo large";
        SSL_write(ssl, answer.data(), static_cast<int>(answer.size()));
      });
    });
    const auto previous = std::signal(SIGPIPE, SIG_DFL);
    {
      HttpTransport transport;
      mrr::reward::Request r;
      r.target = "/score";
      r.body.assign(32u << 20, 'x');
      const auto reply = transport.send("https://127.0.0.1:" + std::to_string(listener.port()), r, 10s);
      // Alive: the 413 relayed, or the broken write reported as an I/O failure (not a timeout).
      if (reply.answered())
        CHECK(reply.response.status == 413);
      else
        CHECK_MESSAGE(reply.failure == Failure::io, reply.error);
    }
    std::signal(SIGPIPE, previous);
    CHECK(heads.load() == 1);
  }

  TEST_CASE("https: bytes after an answer never become the next request's answer; hop-by-hop fields dropped") {
    // A TLS worker that answers each request with its target as the body, and after the first
    // answer on a connection sends a second, unasked one in the same write. cpp-httplib's client
    // left it on the kept connection, where it was read as the answer to the next request.
    const TestTlsContext tls;
    std::atomic<int> interim_mode{0};
    mrr_test::LoopbackListener listener;
    listener.start([&](int fd) {
      tls.serve(fd, [&](SSL* ssl) {
        std::string in, head;
        for (int served = 0; ssl_read_head(ssl, in, head); ++served) {
          const auto space = head.find(' ');
          const std::string target = head.substr(space + 1, head.find(' ', space + 1) - space - 1);
          std::string answer = ok_answer(target, "Connection: X-Hop\r\nX-Hop: secret\r\nX-Keep: yes\r\n");
          if (interim_mode.load() != 0) answer = "HTTP/1.1 103 Early Hints\r\nLink: </style.css>\r\n\r\n" + answer;
          if (target == "/304") answer = "HTTP/1.1 304 Not Modified\r\nContent-Length: 99\r\nETag: \"v\"\r\n\r\n";
          if (target == "/204") answer = "HTTP/1.1 204 No Content\r\nX-Done: 1\r\n\r\n";
          if (served == 0) answer += ok_answer("UNASKED");
          SSL_write(ssl, answer.data(), static_cast<int>(answer.size()));
          if (interim_mode.load() != 0) break;  // and close: cpp-httplib reads the 103's "body" to the end
        }
      });
    });
    {
      HttpTransport transport;
      const std::string url = "https://127.0.0.1:" + std::to_string(listener.port());
      for (const std::string target : {"/1", "/2", "/3", "/4"}) {
        mrr::reward::Request r;
        r.method = "POST";
        r.target = target;
        r.body = "{}";
        const auto reply = transport.send(url, r, 10s);
        REQUIRE_MESSAGE(reply.answered(), reply.error);
        CHECK(reply.response.body == target);
        CHECK(header_value(reply.response.headers, "X-Hop") == "<none>");
        CHECK(header_value(reply.response.headers, "X-Keep") == "yes");
        std::this_thread::sleep_for(20ms);
      }
      // A GET answered 304 (with the GET's length) or 204 is taken at its head: cpp-httplib read the
      // 304's 99 "body" bytes, and the 204's to the end of the connection, so both waited out the
      // whole budget (the worker keeps the connection open).
      for (const std::string target : {"/304", "/204"}) {
        CAPTURE(target);
        mrr::reward::Request get;
        get.method = "GET";
        get.target = target;
        const auto start = std::chrono::steady_clock::now();
        const auto reply = transport.send(url, get, 3s);
        REQUIRE_MESSAGE(reply.answered(), reply.error);
        CHECK(std::chrono::steady_clock::now() - start < 2s);
        CHECK(reply.response.body.empty());
        if (target == "/304") {
          CHECK(reply.response.status == 304);
          CHECK(header_value(reply.response.headers, "Content-Length") == "99");  // the GET's length
          CHECK(header_value(reply.response.headers, "ETag") == "\"v\"");
        } else {
          CHECK(reply.response.status == 204);
          CHECK(header_value(reply.response.headers, "X-Done") == "1");
        }
      }
      // An interim answer other than 100 is an I/O failure, never relayed as the final answer (it
      // was relayed as a 103 whose body held the real answer).
      interim_mode = 1;
      mrr::reward::Request r;
      r.target = "/early";
      const auto reply = transport.send(url, r, 1s);
      CHECK(reply.failure == Failure::io);
      CHECK(reply.error.find("interim") != std::string::npos);
    }
  }
#endif
}
