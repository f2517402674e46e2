// HTTP plumbing shared by the reward proxy and reward workers (cpp-httplib): a connection loop
// with deadlines and limits, converting messages, and RewardServer, which serves a C++ function.
//
// cpp-httplib 0.11 gives each connection a pool thread for as long as it is open and bounds reads
// only per recv(), so 100 clients sending a byte every few seconds hold every thread (slowloris),
// and `Content-Length: 10^15` keeps one busy skipping. Here one thread reads whole requests, head
// and body, for all connections with poll(): it parses the head strictly (parse_request_head),
// checks its framing, and collects the body as it arrives, against deadlines, a size limit and a
// server-wide budget of body bytes held. A pool thread is taken only once a request is complete,
// so clients that trickle a head or a body hold no thread, and memory follows the bytes that
// actually arrived, never a declared length. cpp-httplib's form, multipart and decompression
// parsers never see a body; it still parses the head (for the handler's path and parameters) and
// writes the response.
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
#include <new>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <variant>
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
  // Requests handled at once. A connection holds a thread only from the end of its request body
  // to the end of its response; idle connections and requests still arriving hold none.
  std::size_t threads = 64;
  // Connections open at once, idle and half-sent ones included; more are answered 503 and closed.
  std::size_t max_connections = 1024;
  std::size_t keep_alive_max_count = 1000;  // requests per connection before the server closes it
  std::chrono::seconds keep_alive_timeout{5};        // an idle connection is closed after this
  Duration header_timeout = std::chrono::seconds(10);  // from a request's first byte to the end of its head
  Duration body_timeout = std::chrono::seconds(60);    // the whole body, from the end of the head (408)
  Duration read_timeout = std::chrono::seconds(60);    // the longest pause between two reads of a body (408)
  Duration write_timeout = std::chrono::seconds(60);   // to write one whole response
  std::size_t max_header_bytes = 64 * 1024;            // request line and header fields together (431)
  std::uint64_t max_body_bytes = 64ull << 20;          // a larger body is refused with 413
  // Request bodies held at once, in bytes received: arriving, waiting for a thread or being served.
  // A request whose body would pass it is answered 503. At least max_body_bytes.
  std::uint64_t max_buffered_body_bytes = 1ull << 30;
  int backlog = 1024;
};

namespace detail {

// Moves the worker's answer into cpp-httplib's response: the body is not copied. The answer to a
// HEAD request, and a 304, keep the Content-Length a GET's 200 would carry (cpp-httplib would
// write 0, which RFC 9110 §8.6 forbids unless it is that length).
inline void write_response(Response&& in, httplib::Response& out, bool head_request = false) {
  out.status = in.status;
  const bool length_of_get = head_request || in.status == 304;
  for (auto& [name, value] : in.headers)
    if (!is_unforwardable_header(name) ||
        (length_of_get && in.body.empty() && iequals(name, "Content-Length") && parse_content_length(value)))
      out.set_header(name, value);
  out.body = std::move(in.body);
}

inline void set_rejection(httplib::Response& out, const RequestRejection& r) {
  out.status = r.status;
  out.set_content(json_error_body(r.error, r.detail), "application/json");
}

// A connection as cpp-httplib sees it on a pool thread: reads come from the connection's buffer
// only (the connection loop has received the whole head; nothing of a pipelined next request is
// taken from the socket behind the loop's back), and one response is written within write_timeout.
// What is left in the buffer after the head stays with the connection.
class DeadlineStream final : public httplib::Stream {
 public:
  DeadlineStream(int fd, std::string& buffer, const ServerOptions& options)
      : fd_(fd), buffer_(buffer), options_(options) {}

  [[nodiscard]] bool broken() const noexcept { return broken_; }

  // The unread bytes, for the connection's next request; the first `head` bytes are dropped even
  // where cpp-httplib stopped reading inside them (a head it refused), never read as a request.
  void keep_leftover(std::size_t head) {
    pos_ = std::max(pos_, head);
    compact();
  }

  bool is_readable() const override { return pos_ < buffer_.size(); }
  bool is_writable() const override { return wait_for(POLLOUT, write_deadline()); }

  ssize_t read(char* ptr, size_t size) override {
    const std::size_t n = std::min(size, buffer_.size() - std::min(pos_, buffer_.size()));
    std::memcpy(ptr, buffer_.data() + pos_, n);
    pos_ += n;
    return static_cast<ssize_t>(n);  // 0 past the head: cpp-httplib disagreed with parse_request_head
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
  void compact() {
    buffer_.erase(0, std::min(pos_, buffer_.size()));
    pos_ = 0;
  }

  ssize_t fail() {
    broken_ = true;
    return -1;
  }

  TimePoint write_deadline() const {
    if (!write_deadline_) write_deadline_ = saturating_add(std::chrono::steady_clock::now(), options_.write_timeout);
    return *write_deadline_;
  }

  // Waits until the socket is ready, at most until the deadline or for one read_timeout.
  bool wait_for(short events, TimePoint deadline) const {
    for (;;) {
      const auto now = std::chrono::steady_clock::now();
      if (now >= deadline) return false;
      const auto left = std::min<Duration>(deadline - now, options_.read_timeout);
      const auto ms = std::chrono::ceil<std::chrono::milliseconds>(left).count();
      pollfd p{fd_, events, 0};
      const int r = ::poll(&p, 1, static_cast<int>(std::min<long long>(ms, 1 << 30)));
      if (r > 0) return true;
      if (r == 0 && deadline - now > options_.read_timeout) return false;  // a pause longer than read_timeout
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
  mutable std::optional<TimePoint> write_deadline_;
  bool broken_ = false;
};

// A request the connection loop has received whole: its head as parse_request_head read it, and
// its body (decoded if it was chunked).
struct ReceivedRequest {
  RequestHead head;
  BodyFraming framing;
  std::string body;
  std::optional<ChunkedDecoder> chunks;  // while a chunked body arrives
  std::uint64_t charged = 0;             // bytes counted in the server's BodyBudget
};

// The request bodies a server holds at once, in bytes, against ServerOptions::max_buffered_body_bytes.
class BodyBudget {
 public:
  void set_limit(std::uint64_t limit) noexcept { limit_ = limit; }
  [[nodiscard]] std::uint64_t limit() const noexcept { return limit_; }
  [[nodiscard]] std::uint64_t used() const noexcept { return used_.load(std::memory_order_relaxed); }

  // Counts `n` more bytes, or returns false (and counts nothing) if that would pass the limit.
  bool take(std::uint64_t n) noexcept {
    std::uint64_t now = used_.load(std::memory_order_relaxed);
    do {
      if (n > limit_ - std::min(limit_, now)) return false;
    } while (!used_.compare_exchange_weak(now, now + n, std::memory_order_relaxed));
    return true;
  }
  void give_back(std::uint64_t n) noexcept { used_.fetch_sub(n, std::memory_order_relaxed); }

 private:
  std::uint64_t limit_ = 0;
  std::atomic<std::uint64_t> used_{0};
};

// The request a pool thread is serving, for the hooks cpp-httplib calls on that thread.
struct Exchange {
  ReceivedRequest* request = nullptr;
  std::size_t response_bytes = 0;  // to decide whether to return memory to the OS afterwards
  bool handled = false;            // the handler ran (else cpp-httplib refused the head itself)
};

// Large bodies leave freed memory in malloc's arenas (the connection loop's, where request bodies
// are allocated, and the pool thread's, where answers are); give it back to the OS, not keep it.
inline void return_free_memory(std::size_t bytes_freed) {
#if defined(__GLIBC__)
  if (bytes_freed >= (std::size_t{1} << 20)) ::malloc_trim(0);
#else
  (void)bytes_freed;
#endif
}

inline thread_local Exchange* current_exchange = nullptr;

// A handler of whole requests: cpp-httplib's parsed head (path, params, remote address), the
// request with its body and end-to-end headers (as parse_request_head read them: cpp-httplib
// percent-decodes header values, which would turn "%0d%0a" into a line break on the way to a
// worker), and the response to fill.
using RequestHandler = std::function<void(const httplib::Request&, Request&&, httplib::Response&)>;

// A cpp-httplib server driven by ServerThread's connection loop rather than its own listen().
class Server : public httplib::Server {
 public:
  // Every request of every method goes to `handler`, with the body the connection loop received.
  void serve(RequestHandler handler) {
    set_pre_routing_handler([handler = std::move(handler)](const httplib::Request& in, httplib::Response& out) {
      Exchange* ex = current_exchange;
      if (ex == nullptr) {  // not driven by ServerThread: the body was not received
        set_rejection(out, {500, "internal", "the server runs outside mrr's connection loop"});
        return HandlerResponse::Handled;
      }
      ReceivedRequest& received = *ex->request;
      const std::size_t request_bytes = received.body.size();
      {
        Request request;
        request.method = std::move(received.head.method);
        request.target = std::move(received.head.target);  // raw: the query string stays as sent
        request.headers = reward::forwardable(received.head.headers);
        request.body = std::move(received.body);
        handler(in, std::move(request), out);
      }
      return_free_memory(request_bytes);  // the request is gone: before the client has its answer
      ex->response_bytes = out.body.size();
      ex->handled = true;
      return HandlerResponse::Handled;
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

inline std::string_view reason_phrase(int status) noexcept {
  switch (status) {
    case 400:
      return "Bad Request";
    case 408:
      return "Request Timeout";
    case 413:
      return "Content Too Large";
    case 431:
      return "Request Header Fields Too Large";
    case 501:
      return "Not Implemented";
    case 503:
      return "Service Unavailable";
    case 505:
      return "HTTP Version Not Supported";
    default:
      return "Error";
  }
}

// An answer written straight to a socket by the connection loop (refusals, 408, 503 when full).
inline void send_canned(int fd, int status, std::string_view error, std::string_view detail) {
  const std::string_view reason = reason_phrase(status);
  const std::string body = json_error_body(error, detail);
  const std::string text =
      mrr::detail::str("HTTP/1.1 ", status, " ", reason, "\r\nContent-Type: application/json\r\nContent-Length: ",
                       body.size(), "\r\nConnection: close\r\n", status == 503 ? "Retry-After: 1\r\n" : "", "\r\n", body);
  [[maybe_unused]] const ssize_t n = ::send(fd, text.data(), text.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
}

// The head as cpp-httplib's parser is given it: the request line with every '?' after the first
// percent-encoded (its parser refuses a second '?', which a query may hold, RFC 3986 §3.4; its
// params decode it back), and no Range field (cpp-httplib would slice the worker's answer, or
// refuse a Range it cannot parse, itself; the worker still gets the field). Every line ends in
// CRLF (parse_request_head checked the head).
inline std::string head_for_httplib(std::string_view head) {
  std::string out;
  out.reserve(head.size() + 16);
  bool first = true;
  while (!head.empty()) {
    const auto crlf = head.find("\r\n");
    const std::string_view line = head.substr(0, crlf == std::string_view::npos ? head.size() : crlf + 2);
    head.remove_prefix(line.size());
    if (first) {
      first = false;
      const auto query = line.find('?');
      const auto target_end = line.find(' ', line.find(' ') + 1);
      if (query != std::string_view::npos && query < target_end) {
        out.append(line.substr(0, query + 1));
        for (std::size_t i = query + 1; i < line.size(); ++i) {
          if (line[i] == '?' && i < target_end)
            out += "%3F";
          else
            out += line[i];
        }
        continue;
      }
    } else {
      const auto colon = line.find(':');
      if (colon != std::string_view::npos && iequals(line.substr(0, colon), "Range")) continue;
    }
    out.append(line);
  }
  return out;
}

// Binds `server` as configured and serves it until stop(): one thread receives the requests of
// every connection with poll(), head and body; `threads` pool threads serve complete requests.
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
    mrr::detail::require(options.max_buffered_body_bytes >= options.max_body_bytes, fn, "max_body_bytes (",
                         options.max_body_bytes, ") is over max_buffered_body_bytes (", options.max_buffered_body_bytes,
                         "): a body that large could never be accepted; raise max_buffered_body_bytes too");
    options_ = options;
    // In the clock's unit without overflow: seconds::max() means "no limit", as Duration::max() does.
    keep_alive_ = options.keep_alive_timeout >= std::chrono::duration_cast<std::chrono::seconds>(Duration::max())
                      ? Duration::max()
                      : std::chrono::duration_cast<Duration>(options.keep_alive_timeout);
    budget_.set_limit(options.max_buffered_body_bytes);
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
    spare_fd_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    server_ = &server;
    stopping_ = false;
    for (std::size_t i = 0; i < options.threads; ++i)
      pool_.emplace_back([this] { work(); });
    reactor_ = std::thread([this] { react(); });
    return port_;
  }

  // Stops accepting, serves the requests that have arrived whole, joins the threads. Idempotent.
  void stop() {
    if (!reactor_.joinable()) return;
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    wake();
    reactor_.join();
    // Refused from now on, while the requests that arrived are served: a client connecting during
    // the drain is turned away at once (and can go elsewhere) instead of waiting in the backlog.
    server_->close_listening_socket();
    ready_cv_.notify_all();
    for (auto& t : pool_)
      t.join();
    pool_.clear();
    for (auto& c : returned_)
      close_connection(c);
    returned_.clear();
    ::close(wake_[0]);
    ::close(wake_[1]);
    if (spare_fd_ >= 0) ::close(spare_fd_);
    spare_fd_ = -1;
  }

  [[nodiscard]] int port() const noexcept { return port_; }
  // Connections open now (for tests and monitoring).
  [[nodiscard]] std::size_t open_connections() const noexcept { return open_; }

 private:
  struct Connection {
    enum class State { idle, head, body, linger };
    int fd = -1;
    State state = State::head;
    TimePoint deadline{};       // of the state: the head's, the sooner of the body's and the next read's, ...
    TimePoint body_deadline{};  // the whole body's
    // Received bytes that are not the body: the request head (cpp-httplib parses it again on the
    // pool thread), then a pipelined next request.
    std::string buffer;
    std::size_t head_bytes = 0;  // the request head's bytes at the front of `buffer`
    ReceivedRequest request;
    std::size_t requests = 0;
    bool counted = true;  // in open_ (a shed connection lingers uncounted)
  };

  static constexpr std::size_t scratch_bytes = 64 * 1024;
  static constexpr std::size_t round_bytes = 1 << 20;  // read from one connection per poll round, for fairness
  static constexpr std::size_t first_body_bytes = 64 * 1024;  // see make_room

  void wake() {
    const char byte = 1;
    [[maybe_unused]] const ssize_t n = ::write(wake_[1], &byte, 1);
  }

  void release_body(Connection& c) noexcept {
    budget_.give_back(c.request.charged);
    c.request = ReceivedRequest{};
  }

  void close_connection(Connection& c) {
    ::close(c.fd);
    if (c.counted) --open_;
    release_body(c);
    c.fd = -1;
  }

  // Half-closes and drains for a moment before closing, so that the client reads our answer
  // rather than a reset caused by the request bytes we did not read.
  void linger(Connection& c, TimePoint now) {
    ::shutdown(c.fd, SHUT_WR);
    release_body(c);
    c.state = Connection::State::linger;
    c.deadline = now + std::chrono::seconds(1);
    c.buffer.clear();
    c.buffer.shrink_to_fit();
  }

  // Answers a request the connection loop refuses, and ends the connection.
  void refuse(Connection& c, const RequestRejection& r, TimePoint now) {
    send_canned(c.fd, r.status, r.error, r.detail);
    linger(c, now);
  }

  void react() {
    std::vector<Connection> watched;
    std::vector<pollfd> fds;
    std::vector<char> scratch(scratch_bytes);
    for (;;) {
      const std::size_t first_returned = watched.size();
      {
        std::lock_guard lock(mutex_);
        if (stopping_) break;
        for (auto& c : returned_)
          watched.push_back(std::move(c));
        returned_.clear();
      }
      // A connection back from the pool may hold its next request already (pipelined).
      for (std::size_t i = first_returned; i < watched.size(); ++i)
        if (watched[i].state == Connection::State::head) start_request(watched[i], std::chrono::steady_clock::now());
      std::erase_if(watched, [](const Connection& c) { return c.fd < 0; });
      fds.clear();
      // The listener, unless it rests after running out of descriptors (a negative fd is skipped).
      const bool accepting = std::chrono::steady_clock::now() >= accept_resumes_;
      fds.push_back({accepting ? server_->listening_socket() : -1, POLLIN, 0});
      fds.push_back({wake_[0], POLLIN, 0});
      for (const auto& c : watched)
        fds.push_back({c.fd, POLLIN, 0});
      ::poll(fds.data(), fds.size(), 200);
      const TimePoint now = std::chrono::steady_clock::now();
      if (fds[1].revents != 0)
        while (::read(wake_[0], scratch.data(), scratch.size()) > 0) {
        }
      const std::size_t polled = watched.size();
      if (fds[0].revents & POLLIN) accept_new(watched, now);
      for (std::size_t i = 0; i < polled; ++i) {
        Connection& c = watched[i];
        if (fds[i + 2].revents != 0) receive(c, scratch, now);
        if (c.fd >= 0 && now >= c.deadline) expire(c, now);
      }
      std::erase_if(watched, [](const Connection& c) { return c.fd < 0; });
    }
    for (auto& c : watched)
      close_connection(c);
  }

  void expire(Connection& c, TimePoint now) {
    if (c.state == Connection::State::head && !c.buffer.empty())
      refuse(c, {408, "request_timeout", "the request head did not arrive within the header timeout"}, now);
    else if (c.state == Connection::State::body)
      refuse(c,
             {408, "request_timeout",
              now >= c.body_deadline ? "the body did not arrive within the body timeout"
                                     : "the body paused for longer than the read timeout"},
             now);
    else
      close_connection(c);  // idle past keep-alive, an empty head, or done lingering
  }

  // Out of file descriptors (the process's limit, or the system's): a waiting client gets a 503
  // through the descriptor kept spare for this, and its connection is closed. Without one to
  // spare, the listener rests a moment: it stays readable, and polling it again at once would spin.
  void shed_without_descriptors(TimePoint now) {
    if (spare_fd_ >= 0) {
      ::close(spare_fd_);
      const int fd = ::accept4(server_->listening_socket(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd >= 0) {
        send_canned(fd, 503, "overloaded", "the server has no file descriptor left for another connection");
        ::close(fd);
      }
      spare_fd_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
      if (fd >= 0 && spare_fd_ >= 0) return;
    }
    accept_resumes_ = now + std::chrono::milliseconds(100);
  }

  void accept_new(std::vector<Connection>& watched, TimePoint now) {
    for (int n = 0; n < 256; ++n) {
      const int fd = ::accept4(server_->listening_socket(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EMFILE || errno == ENFILE) shed_without_descriptors(now);
        return;
      }
      // The spare, lost to another thread's descriptor while it was lent out, is taken back.
      if (spare_fd_ < 0) spare_fd_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
      int yes = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &yes, sizeof(yes));
      Connection c;
      c.fd = fd;
      if (open_ >= options_.max_connections) {
        // Shed: a short answer now, not a connection that waits for a thread nobody will free.
        send_canned(fd, 503, "overloaded",
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
        c.deadline = saturating_add(now, options_.header_timeout);
      }
      watched.push_back(std::move(c));
    }
  }

  // Reads what the connection has (at most round_bytes, so that one fast client cannot hold the
  // loop) and moves its request forward.
  void receive(Connection& c, std::vector<char>& scratch, TimePoint now) {
    for (std::size_t taken = 0; taken < round_bytes && c.fd >= 0;) {
      const ssize_t n = ::recv(c.fd, scratch.data(), scratch.size(), 0);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      if (n <= 0) {
        close_connection(c);  // the client is gone (or, lingering, has read our answer)
        return;
      }
      taken += static_cast<std::size_t>(n);
      const std::string_view bytes(scratch.data(), static_cast<std::size_t>(n));
      switch (c.state) {
        case Connection::State::linger:
          break;  // drained and dropped
        case Connection::State::idle:
          c.state = Connection::State::head;
          c.deadline = saturating_add(now, options_.header_timeout);
          [[fallthrough]];
        case Connection::State::head:
          c.buffer.append(bytes);
          start_request(c, now);
          break;
        case Connection::State::body:
          take_body(c, bytes, now);
          break;
      }
    }
  }

  // Whether `head` holds an empty line ended by a bare LF ("\n\n", or "\n\r\n" after a bare LF).
  static bool ends_with_bare_lf_blank_line(std::string_view head) noexcept {
    if (head.find("\n\n") != std::string_view::npos) return true;
    for (std::size_t at = head.find("\n\r\n"); at != std::string_view::npos; at = head.find("\n\r\n", at + 1))
      if (at == 0 || head[at - 1] != '\r') return true;
    return false;
  }

  // With a whole head in the buffer: parses and checks it (refusing what it must), then takes the
  // body bytes that came with it.
  void start_request(Connection& c, TimePoint now) {
    // Empty lines before a request line are ignored (RFC 9112 §2.2: some clients end a body with
    // an extra CRLF that the next request on the connection then starts with).
    std::size_t blank = 0;
    while (c.buffer.compare(blank, 2, "\r\n") == 0)
      blank += 2;
    if (blank > 0) c.buffer.erase(0, blank);
    const std::size_t end = find_head_end(c.buffer);
    if (end == std::string::npos ? c.buffer.size() > options_.max_header_bytes : end > options_.max_header_bytes) {
      const std::string detail = mrr::detail::str("the request head is over ", options_.max_header_bytes, " bytes");
      refuse(c, {431, "header_too_large", detail}, now);
      return;
    }
    if (end == std::string::npos) {
      // A head whose lines end in a bare LF never holds CRLF CRLF: refused at once, not left to
      // the header timeout.
      if (ends_with_bare_lf_blank_line(c.buffer))
        refuse(c, {400, "bad_request", "the request head ends its lines with a bare LF, not CRLF (RFC 9112 §2.2)"},
               now);
      return;
    }
    auto parsed = parse_request_head(std::string_view(c.buffer).substr(0, end));
    if (const auto* rejection = std::get_if<RequestRejection>(&parsed)) {
      refuse(c, *rejection, now);
      return;
    }
    RequestHead& head = std::get<RequestHead>(parsed);
    const HeadCheck check = check_request_head(head.target, head.headers, options_.max_body_bytes);
    if (check.rejection) {
      refuse(c, *check.rejection, now);
      return;
    }
    const auto hosts = std::count_if(head.headers.begin(), head.headers.end(),
                                     [](const auto& field) { return iequals(field.first, "Host"); });
    if (hosts > 1 || (hosts == 0 && head.version == "HTTP/1.1")) {
      refuse(c, {400, "bad_request", "an HTTP/1.1 request carries exactly one Host field (RFC 9112 §3.2)"}, now);
      return;
    }
    // HTTP/1.0 has no 100 Continue: its Expect is ignored (RFC 9110 §10.1.1).
    const bool expects_continue =
        head.version == "HTTP/1.1" && iequals(header_value(head.headers, "Expect"), "100-continue");
    c.head_bytes = end;
    c.request = ReceivedRequest{std::move(head), check.framing, {}, {}, 0};
    if (check.framing.kind == BodyFraming::Kind::chunked) c.request.chunks.emplace(options_.max_body_bytes);
    const std::string after_head = c.buffer.substr(end);
    c.buffer.resize(end);
    c.state = Connection::State::body;
    c.body_deadline = saturating_add(now, options_.body_timeout);
    c.deadline = std::min(c.body_deadline, saturating_add(now, options_.read_timeout));
    // The client waits for this before sending the body (the checks above are the ones a refusal
    // instead of "100 Continue" would come from).
    if (expects_continue && after_head.empty() && check.framing.kind != BodyFraming::Kind::none) {
      constexpr std::string_view go_on = "HTTP/1.1 100 Continue\r\n\r\n";
      [[maybe_unused]] const ssize_t n = ::send(c.fd, go_on.data(), go_on.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    }
    take_body(c, after_head, now);
  }

  // Adds body bytes to the request (counted against the budget first: memory follows the bytes
  // that arrived, never a declared length); hands the request to the pool once it is whole.
  void take_body(Connection& c, std::string_view bytes, TimePoint now) {
    ReceivedRequest& r = c.request;
    std::size_t used = 0;
    if (r.framing.kind == BodyFraming::Kind::length) {
      used = static_cast<std::size_t>(std::min<std::uint64_t>(bytes.size(), r.framing.length - r.body.size()));
      if (!charge(c, used, now) || !make_room(c, used, now)) return;
      r.body.append(bytes.data(), used);
    } else if (r.framing.kind == BodyFraming::Kind::chunked) {
      // Decoded bytes are never more than the bytes fed: count those, give back the framing.
      if (!charge(c, bytes.size(), now)) return;
      const std::size_t before = r.body.size();
      used = r.chunks->feed(bytes, r.body);
      const std::size_t framing = bytes.size() - (r.body.size() - before);
      budget_.give_back(framing);
      r.charged -= framing;
      if (r.chunks->too_large()) {
        refuse(c,
               {413, "payload_too_large",
                mrr::detail::str("the chunked body is over the limit of ", options_.max_body_bytes, " bytes")},
               now);
        return;
      }
      if (r.chunks->failed()) {
        refuse(c, {400, "bad_request", "bad chunked body: " + r.chunks->error()}, now);
        return;
      }
    }
    if (!bytes.empty()) c.deadline = std::min(c.body_deadline, saturating_add(now, options_.read_timeout));
    const bool whole = r.framing.kind == BodyFraming::Kind::length ? r.body.size() == r.framing.length
                       : r.framing.kind == BodyFraming::Kind::chunked ? r.chunks->done()
                                                                       : true;
    if (!whole) return;
    r.chunks.reset();
    c.buffer.append(bytes.substr(used));  // the start of a pipelined next request
    {
      std::lock_guard lock(mutex_);
      ready_.push_back(std::move(c));
    }
    ready_cv_.notify_one();
    c = Connection{};  // fd -1: removed from the watched set
  }

  // Room for `n` more bytes of a body of known length: first at most 64 KiB, then, once the client
  // has sent that much, the whole declared length at once. Reserved pages are not resident until
  // written, so resident memory follows the bytes received either way, and a body is not moved
  // (nor left behind in pieces in this thread's malloc arena) as it grows.
  bool make_room(Connection& c, std::size_t n, TimePoint now) {
    std::string& body = c.request.body;
    if (n <= body.capacity() - body.size()) return true;
    const auto declared = static_cast<std::size_t>(c.request.framing.length);
    try {
      const std::size_t first = std::min<std::size_t>(declared, std::max<std::size_t>(n, first_body_bytes));
      body.reserve(body.empty() ? first : declared);
      return true;
    } catch (const std::bad_alloc&) {
      refuse(c, {503, "overloaded", mrr::detail::str("no memory for a body of ", declared, " bytes")}, now);
      return false;
    }
  }

  // Counts `n` body bytes of the connection's request against the budget, or answers 503.
  bool charge(Connection& c, std::uint64_t n, TimePoint now) {
    if (budget_.take(n)) {
      c.request.charged += n;
      return true;
    }
    refuse(c,
           {503, "overloaded",
            mrr::detail::str("the server holds ", budget_.used(), " bytes of request bodies; this one would pass its ",
                             "limit of ", budget_.limit(), " bytes (max_buffered_body_bytes); retry later")},
           now);
    return false;
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
    std::size_t response_bytes = 0;
    {
      // cpp-httplib parses its own copy of the head (detail::head_for_httplib); the handler gets
      // the request as received.
      std::string head = head_for_httplib(std::string_view(c.buffer).substr(0, c.head_bytes));
      c.buffer.replace(0, c.head_bytes, head);
      c.head_bytes = head.size();
      DeadlineStream stream(c.fd, c.buffer, options_);
      Exchange ex{&c.request, 0};
      current_exchange = &ex;
      const bool last = ++c.requests >= options_.keep_alive_max_count || stopping_ ||
                        connection_ends_after(ConnectionOptions(c.request.head.headers), c.request.head.headers,
                                              c.request.head.version == "HTTP/1.1");
      bool closed = false;
      bool ok = false;
      try {
        ok = server_->process(stream, last, closed, [](httplib::Request& req) {
          // The connection loop has answered Expect and read the body. cpp-httplib would gzip a
          // relayed body for a client that accepts it, and cut it to a Range.
          req.headers.erase("Expect");
          req.headers.erase("Accept-Encoding");
          req.ranges.clear();
        });
      } catch (...) {
        ok = false;
      }
      current_exchange = nullptr;
      stream.keep_leftover(c.head_bytes);
      // A head cpp-httplib refused itself (an extension method, a field line over its 8 KiB) got
      // its 400: the connection ends there rather than be read on from where its parser stopped.
      reuse = ok && ex.handled && !closed && !last && !stream.broken();
      response_bytes = ex.response_bytes;
    }
    release_body(c);
    return_free_memory(response_bytes);
    const TimePoint now = std::chrono::steady_clock::now();
    if (!reuse) {
      linger(c, now);
    } else if (c.buffer.empty()) {
      c.state = Connection::State::idle;
      c.deadline = saturating_add(now, keep_alive_);
    } else {  // a pipelined request: the connection loop reads it as soon as it has the connection back
      c.state = Connection::State::head;
      c.deadline = saturating_add(now, options_.header_timeout);
    }
    {
      std::lock_guard lock(mutex_);
      returned_.push_back(std::move(c));
    }
    wake();
  }

  Server* server_ = nullptr;
  ServerOptions options_;
  Duration keep_alive_{};  // options_.keep_alive_timeout, saturated
  BodyBudget budget_;
  std::thread reactor_;
  std::vector<std::thread> pool_;
  std::mutex mutex_;
  std::condition_variable ready_cv_;
  std::deque<Connection> ready_;         // requests received whole, waiting for a pool thread
  std::vector<Connection> returned_;     // back from the pool to the reactor
  std::atomic<std::size_t> open_{0};
  std::atomic<bool> stopping_{false};  // set under mutex_, so that waiters on ready_cv_ see it
  int wake_[2] = {-1, -1};
  int port_ = -1;
  int spare_fd_ = -1;           // closed to accept one more connection when out of descriptors
  TimePoint accept_resumes_{};  // the listener is polled again from then
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
    } catch (...) {
      out.status = 500;
      out.set_content("reward function failed: an exception not derived from std::exception", "text/plain");
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
