// HTTP plumbing shared by the reward proxy and reward workers (cpp-httplib): a connection loop
// with deadlines and limits, converting messages, and RewardServer, which serves a C++ function.
//
// cpp-httplib 0.11 gives each connection a pool thread for as long as it is open and bounds reads
// only per recv(), so 100 clients sending a byte every few seconds hold every thread (slowloris),
// and `Content-Length: 10^15` keeps one busy skipping. Here one thread reads request heads for all
// connections with poll(); a pool thread is taken only once a whole head has arrived, and reads the
// body itself against a deadline and a size limit, so cpp-httplib's form, multipart and
// decompression parsers never see it. cpp-httplib still parses the head and writes the response.
// mrr-requires: mrr_reward_http
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>
#include <mrr/reward/request_checks.hpp>
#include <mrr/reward/transport.hpp>

#include <arpa/inet.h>
#include <fcntl.h>
#include <httplib.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

MRR_NAMESPACE_BEGIN
namespace reward {

// A server could not be started (the address is taken, the host is not local, ...).
class ServerError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct ServerOptions {
  std::string host = "127.0.0.1";  // loopback by default: expose a reward service on purpose only
  int port = 0;                    // 0: an ephemeral port, see port()
  // Requests handled at once. A connection holds a thread only from the end of its request head
  // to the end of its response; idle connections and heads still arriving hold none.
  std::size_t threads = 64;
  // Connections open at once, idle and half-sent ones included; more are answered 503 and closed.
  std::size_t max_connections = 1024;
  std::size_t keep_alive_max_count = 1000;  // requests per connection before the server closes it
  std::chrono::seconds keep_alive_timeout{5};        // an idle connection is closed after this
  Duration header_timeout = std::chrono::seconds(10);  // from a request's first byte to the end of its head
  Duration body_timeout = std::chrono::seconds(60);    // the whole body, from the end of the head
  Duration read_timeout = std::chrono::seconds(60);    // the longest pause between two reads of a body
  Duration write_timeout = std::chrono::seconds(60);   // to write one whole response
  std::size_t max_header_bytes = 64 * 1024;            // request line and header fields together (431)
  std::uint64_t max_body_bytes = 64ull << 20;          // a larger body is refused with 413
  int backlog = 1024;
};

namespace detail {

// The end-to-end fields of a cpp-httplib header map.
inline Headers forwardable(const httplib::Headers& headers) {
  Headers all(headers.begin(), headers.end());
  return reward::forwardable(all);
}

// Moves the worker's answer into cpp-httplib's response: the body is not copied.
inline void write_response(Response&& in, httplib::Response& out) {
  out.status = in.status;
  for (auto& [name, value] : in.headers)
    if (!is_unforwardable_header(name)) out.set_header(name, value);
  out.body = std::move(in.body);
}

inline void set_rejection(httplib::Response& out, const RequestRejection& r) {
  out.status = r.status;
  out.set_content(json_error_body(r.error, r.detail), "application/json");
}

// A socket with deadlines: reads until `read deadline` (the head's, then the body's), each read
// waiting at most read_timeout; one response written within write_timeout. Reads are buffered,
// and what is left after a request (a pipelined next one) stays with the connection.
class DeadlineStream final : public httplib::Stream {
 public:
  DeadlineStream(int fd, std::string& buffer, const ServerOptions& options)
      : fd_(fd), buffer_(buffer), options_(options) {}

  void set_read_deadline(TimePoint t) noexcept { read_deadline_ = t; }
  [[nodiscard]] bool broken() const noexcept { return broken_; }
  [[nodiscard]] bool timed_out() const noexcept { return timed_out_; }

  // Buffered bytes not read yet; consume() marks some as read; fill() reads more (false: EOF,
  // error or deadline).
  [[nodiscard]] std::string_view buffered() const noexcept {
    return std::string_view(buffer_).substr(std::min(pos_, buffer_.size()));
  }
  void consume(std::size_t n) noexcept { pos_ += n; }
  bool fill() {
    compact();
    const std::size_t old = buffer_.size();
    buffer_.resize(old + chunk);
    const ssize_t n = receive(buffer_.data() + old, chunk);
    buffer_.resize(old + static_cast<std::size_t>(std::max<ssize_t>(n, 0)));
    return n > 0;
  }
  // The unread bytes, for the connection's next request.
  void keep_leftover() {
    compact();
  }

  bool is_readable() const override { return pos_ < buffer_.size() || wait_for(POLLIN, read_deadline_); }
  bool is_writable() const override { return wait_for(POLLOUT, write_deadline()); }

  ssize_t read(char* ptr, size_t size) override {
    if (pos_ < buffer_.size()) {
      const std::size_t n = std::min(size, buffer_.size() - pos_);
      std::memcpy(ptr, buffer_.data() + pos_, n);
      pos_ += n;
      return static_cast<ssize_t>(n);
    }
    if (size >= chunk) return receive(ptr, size);  // large reads go straight into the caller's memory
    if (!fill()) return broken_ ? -1 : 0;
    return read(ptr, size);
  }

  ssize_t write(const char* ptr, size_t size) override {
    for (;;) {
      if (!wait_for(POLLOUT, write_deadline())) return fail();
      const ssize_t n = ::send(fd_, ptr, size, MSG_NOSIGNAL);
      if (n >= 0) return n;
      if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return fail();
    }
  }

  void get_remote_ip_and_port(std::string& ip, int& port) const override { address(true, ip, port); }
  void get_local_ip_and_port(std::string& ip, int& port) const override { address(false, ip, port); }
  socket_t socket() const override { return fd_; }

 private:
  static constexpr std::size_t chunk = 16 * 1024;

  void compact() {
    buffer_.erase(0, std::min(pos_, buffer_.size()));
    pos_ = 0;
  }

  ssize_t receive(char* ptr, std::size_t size) {
    for (;;) {
      if (!wait_for(POLLIN, read_deadline_)) return fail();
      const ssize_t n = ::recv(fd_, ptr, size, 0);
      if (n >= 0) return n;
      if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return fail();
    }
  }

  ssize_t fail() {
    broken_ = true;
    return -1;
  }

  TimePoint write_deadline() const {
    if (!write_deadline_) write_deadline_ = saturating_add(std::chrono::steady_clock::now(), options_.write_timeout);
    return *write_deadline_;
  }

  // Waits until the socket is ready or the deadline (or one read_timeout) passes.
  bool wait_for(short events, TimePoint deadline) const {
    for (;;) {
      const auto now = std::chrono::steady_clock::now();
      if (now >= deadline) {
        timed_out_ = true;
        return false;
      }
      const auto left = std::min<Duration>(deadline - now, options_.read_timeout);
      const auto ms = std::chrono::ceil<std::chrono::milliseconds>(left).count();
      pollfd p{fd_, events, 0};
      const int r = ::poll(&p, 1, static_cast<int>(std::min<long long>(ms, 1 << 30)));
      if (r > 0) return true;
      if (r == 0 && deadline - now > options_.read_timeout) {
        timed_out_ = true;
        return false;  // a pause longer than read_timeout
      }
      if (r < 0 && errno != EINTR) return false;
    }
  }

  void address(bool remote, std::string& ip, int& port) const {
    sockaddr_storage addr{};
    socklen_t len = sizeof(addr);
    auto* sa = reinterpret_cast<sockaddr*>(&addr);
    if ((remote ? ::getpeername(fd_, sa, &len) : ::getsockname(fd_, sa, &len)) != 0) return;
    char text[INET6_ADDRSTRLEN] = {};
    if (addr.ss_family == AF_INET) {
      const auto* in = reinterpret_cast<sockaddr_in*>(&addr);
      ::inet_ntop(AF_INET, &in->sin_addr, text, sizeof(text));
      port = ntohs(in->sin_port);
    } else if (addr.ss_family == AF_INET6) {
      const auto* in = reinterpret_cast<sockaddr_in6*>(&addr);
      ::inet_ntop(AF_INET6, &in->sin6_addr, text, sizeof(text));
      port = ntohs(in->sin6_port);
    }
    ip = text;
  }

  int fd_;
  std::string& buffer_;
  std::size_t pos_ = 0;
  const ServerOptions& options_;
  TimePoint read_deadline_ = TimePoint::max();
  mutable std::optional<TimePoint> write_deadline_;
  mutable bool timed_out_ = false;
  bool broken_ = false;
};

// The request a pool thread is serving, for the hooks cpp-httplib calls on that thread.
struct Exchange {
  DeadlineStream* stream = nullptr;
  const ServerOptions* options = nullptr;
  Headers hidden;      // fields kept from cpp-httplib (Accept-Encoding: it would compress relayed bodies)
  bool close = false;  // the body was not read to its end: the connection cannot carry another request
  std::size_t bytes = 0;  // body and response sizes, to decide whether to return memory to the OS
};

inline thread_local Exchange* current_exchange = nullptr;

inline Headers all_headers(const httplib::Request& in, const Exchange& ex) {
  Headers out;
  out.reserve(in.headers.size() + ex.hidden.size());
  for (const auto& [name, value] : in.headers)
    if (!iequals(name, "REMOTE_ADDR") && !iequals(name, "REMOTE_PORT") && !iequals(name, "LOCAL_ADDR") &&
        !iequals(name, "LOCAL_PORT"))
      out.emplace_back(name, value);
  out.insert(out.end(), ex.hidden.begin(), ex.hidden.end());
  return out;
}

// Reads the body announced by `framing` from the exchange's stream; a rejection if it cannot.
inline std::optional<RequestRejection> read_body(Exchange& ex, const BodyFraming& framing, std::string& body) {
  DeadlineStream& in = *ex.stream;
  const auto incomplete = [&] {
    if (in.timed_out())
      return RequestRejection{408, "request_timeout", "the body did not arrive within the body timeout"};
    return RequestRejection{400, "bad_request", "the connection ended before the whole body"};
  };
  if (framing.kind == BodyFraming::Kind::length) {
    body.resize(static_cast<std::size_t>(framing.length));  // exactly once: no growth, no second copy
    std::size_t done = 0;
    while (done < body.size()) {
      const ssize_t n = in.read(body.data() + done, body.size() - done);
      if (n <= 0) return incomplete();
      done += static_cast<std::size_t>(n);
    }
  } else if (framing.kind == BodyFraming::Kind::chunked) {
    ChunkedDecoder decoder(ex.options->max_body_bytes);
    while (!decoder.done()) {
      if (in.buffered().empty() && !in.fill()) return incomplete();
      in.consume(decoder.feed(in.buffered(), body));
      if (decoder.too_large())
        return RequestRejection{413, "payload_too_large",
                                mrr::detail::str("the chunked body is over the limit of ", ex.options->max_body_bytes,
                                                 " bytes")};
      if (decoder.failed()) return RequestRejection{400, "bad_request", "bad chunked body: " + decoder.error()};
    }
  }
  ex.bytes += body.size();
  return std::nullopt;
}

// A handler of whole requests: cpp-httplib's parsed head (path, params, remote address), the
// request with its body and end-to-end headers, and the response to fill.
using RequestHandler = std::function<void(const httplib::Request&, Request&&, httplib::Response&)>;

// A cpp-httplib server driven by ServerThread's connection loop rather than its own listen().
class Server : public httplib::Server {
 public:
  // Every request of every method goes to `handler`, with its body read by read_body.
  void serve(RequestHandler handler) {
    set_pre_routing_handler([handler = std::move(handler)](const httplib::Request& in, httplib::Response& out) {
      Exchange* ex = current_exchange;
      if (ex == nullptr) {  // not driven by ServerThread: no stream to read the body from
        set_rejection(out, {500, "internal", "the server runs outside mrr's connection loop"});
        return HandlerResponse::Handled;
      }
      Headers headers = all_headers(in, *ex);
      const HeadCheck head = check_request_head(in.target, headers, ex->options->max_body_bytes);
      std::optional<RequestRejection> rejection = head.rejection;
      std::string body;
      if (!rejection) rejection = read_body(*ex, head.framing, body);
      if (rejection) {
        ex->close = true;
        set_rejection(out, *rejection);
        out.set_header("Connection", "close");
        return HandlerResponse::Handled;
      }
      Request request;
      request.method = in.method;
      request.target = in.target.empty() ? std::string("/") : in.target;  // raw: the query string stays as sent
      request.headers = reward::forwardable(headers);
      request.body = std::move(body);
      handler(in, std::move(request), out);
      ex->bytes += out.body.size();
      return HandlerResponse::Handled;
    });
    // A refused body is refused before the client sends it, not after "100 Continue".
    set_expect_100_continue_handler([](const httplib::Request& in, httplib::Response& out) {
      Exchange* ex = current_exchange;
      if (ex == nullptr) return 100;
      const HeadCheck head = check_request_head(in.target, all_headers(in, *ex), ex->options->max_body_bytes);
      if (!head.rejection) return 100;
      ex->close = true;
      set_rejection(out, *head.rejection);
      out.set_header("Connection", "close");
      return head.rejection->status;
    });
  }

  bool process(httplib::Stream& stream, bool close_connection, bool& connection_closed,
               const std::function<void(httplib::Request&)>& setup) {
    return process_request(stream, close_connection, connection_closed, setup);
  }

  [[nodiscard]] int listening_socket() const noexcept { return svr_sock_; }
  void close_listening_socket() noexcept {
    const socket_t sock = svr_sock_.exchange(INVALID_SOCKET);
    if (sock != INVALID_SOCKET) ::close(sock);
  }
  // cpp-httplib 0.11 listens with a backlog of 5, compiled into Debian's shared library, so a burst
  // of connections waits for SYN retransmission (1 s). Linux lets listen() be called again to widen it.
  void widen_backlog(int backlog) { ::listen(svr_sock_, backlog); }
};

// An answer written straight to a socket by the connection loop (503 when full, 408, 431).
inline void send_canned(int fd, int status, std::string_view reason, std::string_view error, std::string_view detail) {
  const std::string body = json_error_body(error, detail);
  const std::string text =
      mrr::detail::str("HTTP/1.1 ", status, " ", reason, "\r\nContent-Type: application/json\r\nContent-Length: ",
                       body.size(), "\r\nConnection: close\r\n", status == 503 ? "Retry-After: 1\r\n" : "", "\r\n", body);
  [[maybe_unused]] const ssize_t n = ::send(fd, text.data(), text.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
}

// Binds `server` as configured and serves it until stop(): one thread reads request heads of every
// connection with poll(), `threads` pool threads serve requests whose head has arrived.
class ServerThread {
 public:
  ServerThread() = default;
  ServerThread(const ServerThread&) = delete;
  ServerThread& operator=(const ServerThread&) = delete;
  ~ServerThread() { stop(); }

  int start(Server& server, const ServerOptions& options) {
    constexpr std::string_view fn = "reward::ServerOptions";
    mrr::detail::require(!reactor_.joinable(), "reward::ServerThread::start", "the server is already running");
    mrr::detail::require(options.threads >= 1 && options.keep_alive_max_count >= 1 && options.max_connections >= 1,
                         fn, "threads, max_connections and keep_alive_max_count must be >= 1");
    mrr::detail::require(options.port >= 0 && options.port <= 65535, fn, "port ", options.port, " is out of range");
    mrr::detail::require(options.header_timeout > Duration::zero() && options.body_timeout > Duration::zero() &&
                             options.read_timeout > Duration::zero() && options.write_timeout > Duration::zero(),
                         fn, "timeouts must be positive");
    mrr::detail::require(options.max_header_bytes >= 1024, fn, "max_header_bytes must be >= 1024");
    options_ = options;
    server.set_keep_alive_max_count(options.keep_alive_max_count);
    server.set_keep_alive_timeout(options.keep_alive_timeout.count());
    // SO_REUSEADDR only: cpp-httplib's default adds SO_REUSEPORT, which would let a second server
    // share a port silently. Rebinding the port of a killed worker still works.
    server.set_socket_options([](socket_t sock) {
      int yes = 1;
      ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    });
    if (options.port == 0) {
      port_ = server.bind_to_any_port(options.host);
      if (port_ < 0) throw ServerError(mrr::detail::str("mrr::reward: cannot bind ", options.host, ":0"));
    } else {
      if (!server.bind_to_port(options.host, options.port))
        throw ServerError(mrr::detail::str("mrr::reward: cannot bind ", options.host, ":", options.port));
      port_ = options.port;
    }
    server.widen_backlog(options.backlog);
    ::fcntl(server.listening_socket(), F_SETFL, ::fcntl(server.listening_socket(), F_GETFL) | O_NONBLOCK);
    if (::pipe2(wake_, O_NONBLOCK | O_CLOEXEC) != 0) {
      server.close_listening_socket();
      throw ServerError("mrr::reward: pipe2 failed");
    }
    server_ = &server;
    stopping_ = false;
    for (std::size_t i = 0; i < options.threads; ++i)
      pool_.emplace_back([this] { work(); });
    reactor_ = std::thread([this] { react(); });
    return port_;
  }

  // Stops accepting, serves the requests whose head has arrived, joins the threads. Idempotent.
  void stop() {
    if (!reactor_.joinable()) return;
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    wake();
    reactor_.join();
    ready_cv_.notify_all();
    for (auto& t : pool_)
      t.join();
    pool_.clear();
    for (auto& c : returned_)
      ::close(c.fd);
    returned_.clear();
    ::close(wake_[0]);
    ::close(wake_[1]);
    server_->close_listening_socket();
  }

  [[nodiscard]] int port() const noexcept { return port_; }
  // Connections open now (for tests and monitoring).
  [[nodiscard]] std::size_t open_connections() const noexcept { return open_; }

 private:
  struct Connection {
    enum class State { head, idle, linger };
    int fd = -1;
    State state = State::head;
    TimePoint deadline{};
    std::string buffer;
    std::size_t requests = 0;
    bool counted = true;  // in open_ (a shed connection lingers uncounted)
  };

  void wake() {
    const char byte = 1;
    [[maybe_unused]] const ssize_t n = ::write(wake_[1], &byte, 1);
  }

  void close_connection(Connection& c) {
    ::close(c.fd);
    if (c.counted) --open_;
    c.fd = -1;
  }

  // Half-closes and drains for a moment before closing, so that the client reads our answer
  // rather than a reset caused by the request bytes we did not read.
  static void linger(Connection& c, TimePoint now) {
    ::shutdown(c.fd, SHUT_WR);
    c.state = Connection::State::linger;
    c.deadline = now + std::chrono::seconds(1);
    c.buffer.clear();
    c.buffer.shrink_to_fit();
  }

  void react() {
    std::vector<Connection> watched;
    std::vector<pollfd> fds;
    char scratch[16 * 1024];
    for (;;) {
      {
        std::lock_guard lock(mutex_);
        if (stopping_) break;
        for (auto& c : returned_)
          watched.push_back(std::move(c));
        returned_.clear();
      }
      fds.clear();
      fds.push_back({server_->listening_socket(), POLLIN, 0});
      fds.push_back({wake_[0], POLLIN, 0});
      for (const auto& c : watched)
        fds.push_back({c.fd, POLLIN, 0});
      ::poll(fds.data(), fds.size(), 200);
      const TimePoint now = std::chrono::steady_clock::now();
      if (fds[1].revents != 0)
        while (::read(wake_[0], scratch, sizeof(scratch)) > 0) {
        }
      const std::size_t polled = watched.size();
      if (fds[0].revents & POLLIN) accept_new(watched, now);
      for (std::size_t i = 0; i < polled; ++i) {
        Connection& c = watched[i];
        if (fds[i + 2].revents != 0) read_head(c, scratch, sizeof(scratch), now);
        if (c.fd >= 0 && now >= c.deadline) {
          if (c.state == Connection::State::head && !c.buffer.empty())
            send_canned(c.fd, 408, "Request Timeout", "request_timeout",
                        "the request head did not arrive within the header timeout");
          close_connection(c);
        }
      }
      std::erase_if(watched, [](const Connection& c) { return c.fd < 0; });
    }
    for (auto& c : watched)
      close_connection(c);
  }

  void accept_new(std::vector<Connection>& watched, TimePoint now) {
    for (int n = 0; n < 256; ++n) {
      const int fd = ::accept4(server_->listening_socket(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) return;
      int yes = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &yes, sizeof(yes));
      Connection c;
      c.fd = fd;
      if (open_ >= options_.max_connections) {
        // Shed: a short answer now, not a connection that waits for a thread nobody will free.
        send_canned(fd, 503, "Service Unavailable", "overloaded",
                    mrr::detail::str("the server has its maximum of ", options_.max_connections,
                                     " connections open"));
        if (watched.size() >= 2 * options_.max_connections) {
          ::close(fd);
          continue;
        }
        c.counted = false;
        linger(c, now);
      } else {
        ++open_;
        c.deadline = now + options_.header_timeout;
      }
      watched.push_back(std::move(c));
    }
  }

  void read_head(Connection& c, char* scratch, std::size_t size, TimePoint now) {
    for (;;) {
      const ssize_t n = ::recv(c.fd, scratch, size, 0);
      if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
        close_connection(c);  // the client is gone (or, lingering, has read our answer)
        return;
      }
      if (n < 0) break;
      if (c.state == Connection::State::linger) continue;  // drained and dropped
      if (c.state == Connection::State::idle) {
        c.state = Connection::State::head;
        c.deadline = now + options_.header_timeout;
      }
      c.buffer.append(scratch, static_cast<std::size_t>(n));
      if (c.buffer.size() > options_.max_header_bytes + size) break;
    }
    if (c.state != Connection::State::head) return;
    if (find_head_end(c.buffer) != std::string::npos) {
      {
        std::lock_guard lock(mutex_);
        ready_.push_back(std::move(c));
      }
      ready_cv_.notify_one();
      c = Connection{};  // fd -1: removed from the watched set
    } else if (c.buffer.size() > options_.max_header_bytes) {
      send_canned(c.fd, 431, "Request Header Fields Too Large", "header_too_large",
                  mrr::detail::str("the request head is over ", options_.max_header_bytes, " bytes"));
      linger(c, now);
    }
  }

  void work() {
    for (;;) {
      Connection c;
      {
        std::unique_lock lock(mutex_);
        ready_cv_.wait(lock, [&] { return !ready_.empty() || stopping_; });
        if (ready_.empty()) return;
        c = std::move(ready_.front());
        ready_.pop_front();
      }
      serve(c);
    }
  }

  void serve(Connection& c) {
    bool reuse = false;
    std::size_t bytes = 0;
    {
      DeadlineStream stream(c.fd, c.buffer, options_);
      stream.set_read_deadline(saturating_add(std::chrono::steady_clock::now(), options_.header_timeout));
      Exchange ex{&stream, &options_, {}, false, 0};
      current_exchange = &ex;
      const bool last = ++c.requests >= options_.keep_alive_max_count || stopping_;
      bool closed = false;
      bool ok = false;
      try {
        ok = server_->process(stream, last, closed, [&](httplib::Request& req) {
          stream.set_read_deadline(saturating_add(std::chrono::steady_clock::now(), options_.body_timeout));
          // cpp-httplib would gzip a relayed body for a client that accepts it, and cut it to a
          // Range: the handler sees these fields, cpp-httplib does not.
          const auto [first, last_field] = req.headers.equal_range("Accept-Encoding");
          for (auto it = first; it != last_field; ++it)
            ex.hidden.emplace_back(it->first, it->second);
          req.headers.erase("Accept-Encoding");
          req.ranges.clear();
        });
      } catch (...) {
        ok = false;
      }
      current_exchange = nullptr;
      stream.keep_leftover();
      reuse = ok && !closed && !last && !ex.close && !stream.broken();
      bytes = ex.bytes;
    }
#if defined(__GLIBC__)
    // Large bodies leave freed memory in the thread's arena; give it back rather than keep it.
    if (bytes >= (std::size_t{1} << 20)) ::malloc_trim(0);
#endif
    const TimePoint now = std::chrono::steady_clock::now();
    if (!reuse) {
      linger(c, now);
    } else if (find_head_end(c.buffer) != std::string::npos) {  // a pipelined request is already here
      std::lock_guard lock(mutex_);
      if (!stopping_) {
        ready_.push_back(std::move(c));
        return;
      }
      linger(c, now);
    } else if (c.buffer.empty()) {
      c.state = Connection::State::idle;
      c.deadline = now + options_.keep_alive_timeout;
    } else {
      c.state = Connection::State::head;
      c.deadline = now + options_.header_timeout;
    }
    {
      std::lock_guard lock(mutex_);
      returned_.push_back(std::move(c));
    }
    wake();
  }

  Server* server_ = nullptr;
  ServerOptions options_;
  std::thread reactor_;
  std::vector<std::thread> pool_;
  std::mutex mutex_;
  std::condition_variable ready_cv_;
  std::deque<Connection> ready_;         // heads complete, waiting for a pool thread
  std::vector<Connection> returned_;     // back from the pool to the reactor
  std::atomic<std::size_t> open_{0};
  std::atomic<bool> stopping_{false};  // set under mutex_, so that waiters on ready_cv_ see it
  int wake_[2] = {-1, -1};
  int port_ = -1;
};

inline std::string url_of(const std::string& host, int port) {
  const bool ipv6 = host.find(':') != std::string::npos;
  return mrr::detail::str("http://", ipv6 ? "[" : "", host, ipv6 ? "]" : "", ":", port);
}

}  // namespace detail

// Serves a reward function over HTTP: every method and path goes to `handler`, except GET on
// `health_path` (answered 200 unless the path is empty). A handler that throws answers 500.
// Bodies are read and limited as ServerOptions says (max_body_bytes, timeouts).
class RewardServer {
 public:
  using Handler = std::function<Response(const Request&)>;

  explicit RewardServer(Handler handler, ServerOptions options = {}, std::string health_path = "/health")
      : handler_(std::move(handler)), host_(options.host), health_path_(std::move(health_path)) {
    mrr::detail::require(static_cast<bool>(handler_), "reward::RewardServer", "the handler is empty");
    server_.serve([this](const httplib::Request& in, Request&& request, httplib::Response& out) {
      handle(in, std::move(request), out);
    });
    runner_.start(server_, options);
  }
  RewardServer(const RewardServer&) = delete;
  RewardServer& operator=(const RewardServer&) = delete;
  ~RewardServer() { stop(); }

  [[nodiscard]] int port() const noexcept { return runner_.port(); }
  [[nodiscard]] std::string url() const { return detail::url_of(host_, port()); }
  // Stops accepting and waits for requests in progress. Idempotent.
  void stop() { runner_.stop(); }

 private:
  void handle(const httplib::Request& in, Request&& request, httplib::Response& out) {
    if (!health_path_.empty() && in.path == health_path_ && (in.method == "GET" || in.method == "HEAD")) {
      out.set_content("{\"status\":\"ok\"}", "application/json");
      return;
    }
    try {
      detail::write_response(handler_(request), out);
    } catch (const std::exception& e) {
      out.status = 500;
      out.set_content(mrr::detail::str("reward function failed: ", e.what()), "text/plain");
    }
  }

  Handler handler_;
  std::string host_;
  std::string health_path_;
  detail::Server server_;
  detail::ServerThread runner_;  // after server_: stopped before the server is destroyed
};

}  // namespace reward
MRR_NAMESPACE_END
