// The reward transport's HTTP/1.1 client (POSIX sockets, no library): one exchange on one
// connection, every socket call bounded by the exchange's deadline (so a worker that trickles
// its answer cannot hold an attempt past its budget), the request sent as the proxy received it
// (no field added but Host and the body's Content-Length), and a worker that answers before it
// has read the whole body (an early 413) heard: the client stops sending and reads the answer.
// Plain http; https:// workers go through cpp-httplib's TLS client (detail/tls_transport.hpp).
// mrr-requires: mrr_reward_http
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/detail/regular_file.hpp>
#include <mrr/detail/str.hpp>
#include <mrr/reward/request_checks.hpp>
#include <mrr/reward/transport.hpp>

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <utility>
#include <variant>

MRR_NAMESPACE_BEGIN
namespace reward {

struct HttpTransportOptions {
  Duration connect_timeout = std::chrono::seconds(2);  // capped by the attempt's budget
  std::string health_path = "/health";                 // GET; any 2xx is healthy
  std::size_t max_idle_connections = 256;              // kept open per worker for reuse
  // A worker's response body over this many bytes is abandoned as it arrives (at once when its
  // Content-Length says so): the attempt fails with Failure::io, and the proxy answers 502.
  std::uint64_t max_response_bytes = 64ull << 20;
};

namespace detail {

// An owned socket descriptor (the project's file-descriptor owner).
using Socket = mrr::detail::UniqueFd;

// Why an exchange gave no answer: the dispatcher's failure class and a message. `stale`: a reused
// keep-alive connection was closed by the worker before any byte of an answer came (the worker
// timed the idle connection out) while the worker cannot have processed the request (it was not
// all sent, or its method is idempotent, RFC 9110 §9.2.2), so it may be sent again on a fresh one.
// A POST the worker may have read whole is never sent again behind the dispatcher's back
// (RFC 9112 §9.3.1): that failure is the dispatcher's to count and retry.
struct ClientError {
  Failure failure = Failure::io;
  std::string message;
  bool stale = false;
};

// Waits for `events` until `deadline`: the revents, 0 once the deadline passed, -1 on error. The
// deadline is checked before each wait, not only when a wait times out: a peer that always has
// bytes ready (a worker streaming without end) would otherwise never meet it.
inline int poll_until(int fd, short events, TimePoint deadline) {
  for (;;) {
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) return 0;
    const long long left = std::chrono::ceil<std::chrono::milliseconds>(deadline - now).count();
    pollfd p{fd, events, 0};
    const int r = ::poll(&p, 1, static_cast<int>(std::min<long long>(left, 1 << 30)));
    if (r > 0) return p.revents;
    if (r < 0 && errno != EINTR) return -1;
  }
}

// Whether a request of this method may be sent twice with the effect of once (RFC 9110 §9.2.2).
inline bool idempotent_method(std::string_view method) {
  for (const std::string_view m : {"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})
    if (method == m) return true;
  return false;
}

// Whether an idle keep-alive connection is still open: nothing to read (the worker neither closed
// it nor sent anything unasked).
inline bool idle_connection_open(int fd) {
  pollfd p{fd, POLLIN, 0};
  return ::poll(&p, 1, 0) == 0;
}

// getaddrinfo's answer, owned.
struct Addresses {
  int rc = EAI_AGAIN;
  addrinfo* list = nullptr;
  Addresses() = default;
  Addresses(const Addresses&) = delete;
  Addresses& operator=(const Addresses&) = delete;
  ~Addresses() {
    if (list != nullptr) ::freeaddrinfo(list);
  }
};

// host:port's addresses by `deadline`: an address literal at once; a name on a thread of its own
// that the caller waits for until the deadline (getaddrinfo has no timeout, and a resolver that
// never answers holds it for its own retries, 10 s and more). A thread still resolving at the
// deadline finishes alone and frees what it found.
inline std::variant<std::shared_ptr<Addresses>, ClientError> resolve(const WorkerUrl& url, TimePoint deadline) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV | AI_NUMERICHOST;
  const std::string port = std::to_string(url.port);
  auto out = std::make_shared<Addresses>();
  out->rc = ::getaddrinfo(url.host.c_str(), port.c_str(), &hints, &out->list);
  if (out->rc == EAI_NONAME) {  // a name, not an address
    struct Pending {
      std::mutex mutex;
      std::condition_variable done;
      std::shared_ptr<Addresses> result;
    };
    auto pending = std::make_shared<Pending>();
    hints.ai_flags = AI_NUMERICSERV;
    try {
      std::thread([pending, host = url.host, port, hints] {
        auto found = std::make_shared<Addresses>();
        found->rc = ::getaddrinfo(host.c_str(), port.c_str(), &hints, &found->list);
        const std::lock_guard lock(pending->mutex);
        pending->result = std::move(found);
        pending->done.notify_all();
      }).detach();
    } catch (const std::system_error& e) {
      return ClientError{Failure::connect, mrr::detail::str("cannot resolve '", url.host, "': ", e.what())};
    }
    std::unique_lock lock(pending->mutex);
    if (!pending->done.wait_until(lock, deadline, [&] { return pending->result != nullptr; }))
      return ClientError{Failure::timeout, mrr::detail::str("resolving '", url.host, "' took the attempt's budget")};
    out = std::move(pending->result);
  }
  if (out->rc != 0)
    return ClientError{Failure::connect,
                       mrr::detail::str("cannot resolve '", url.host, "': ", ::gai_strerror(out->rc))};
  return out;
}

// A connection to host:port, the name's resolution and the connect bounded by `deadline` (every
// address tried in turn).
inline std::variant<Socket, ClientError> connect_to(const WorkerUrl& url, TimePoint deadline) {
  auto resolved = resolve(url, deadline);
  if (auto* e = std::get_if<ClientError>(&resolved)) return std::move(*e);
  const addrinfo* found = std::get<std::shared_ptr<Addresses>>(resolved)->list;
  std::string last = "no address";
  Failure failure = Failure::connect;
  Socket out;
  for (const addrinfo* ai = found; ai != nullptr && out.get() < 0; ai = ai->ai_next) {
    Socket s(::socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    if (s.get() < 0) {
      last = std::strerror(errno);
      continue;
    }
    int error = ::connect(s.get(), ai->ai_addr, ai->ai_addrlen) == 0 ? 0 : errno;
    if (error == EINPROGRESS) {
      const int r = poll_until(s.get(), POLLOUT, deadline);
      if (r == 0) {
        failure = Failure::timeout;
        last = "the connect timed out";
        break;  // the budget is spent: no time for another address
      }
      socklen_t len = sizeof error;
      if (r < 0 || ::getsockopt(s.get(), SOL_SOCKET, SO_ERROR, &error, &len) != 0) error = errno;
    }
    if (error != 0) {
      last = std::strerror(error);
      continue;
    }
    const int one = 1;
    ::setsockopt(s.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    out = std::move(s);
  }
  if (out.get() < 0) return ClientError{failure, mrr::detail::str("cannot connect to ", url.origin(), ": ", last)};
  return out;
}

// The target the worker gets: the worker's base path, then the request's target in origin form.
// A client may send a proxy the absolute form (RFC 9112 §3.2.2, "http://host/path?q"): its path
// and query go on (they were glued to the base path whole, "/apihttp://host/path"); the asterisk
// form ("OPTIONS *") only to a worker without a base path.
inline std::variant<std::string, ClientError> worker_target(const WorkerUrl& url, std::string_view target) {
  const auto refuse = [](std::string why) { return ClientError{Failure::exception, std::move(why)}; };
  if (target.empty()) return url.base_path + "/";
  if (target.front() == '/') return mrr::detail::str(url.base_path, target);
  if (target == "*") {
    if (!url.base_path.empty())
      return refuse("the asterisk-form target '*' has no meaning below the worker's base path " + url.base_path);
    return std::string("*");
  }
  const auto scheme_end = target.find("://");
  const std::string_view scheme =
      scheme_end == std::string_view::npos ? std::string_view{} : target.substr(0, scheme_end);
  if (!iequals(scheme, "http") && !iequals(scheme, "https"))
    return refuse("the request target is neither origin-form ('/path?query') nor an http(s) absolute-form URL");
  const auto path = target.find_first_of("/?", scheme_end + 3);
  if (path == std::string_view::npos) return url.base_path + "/";
  return mrr::detail::str(url.base_path, target[path] == '?' ? "/" : "", target.substr(path));
}

// The request's head as sent to the worker: the request line (worker_target: the worker's base
// path, then the target in origin form), Host, the request's end-to-end fields in their order, and
// the body's Content-Length (also 0 for the methods whose requests carry a body). Refuses what
// would let a caller's bytes end the head early (a field name that is no token, a value with CR or
// LF).
inline std::variant<std::string, ClientError> request_head(const WorkerUrl& url, const Request& r,
                                                           std::string_view target) {
  const auto refuse = [](std::string why) { return ClientError{Failure::exception, std::move(why)}; };
  if (r.method.empty() || !std::all_of(r.method.begin(), r.method.end(), is_tchar))
    return refuse("the request method is not a token");
  for (const char c : target)
    if (static_cast<unsigned char>(c) <= 0x20 || static_cast<unsigned char>(c) >= 0x7f)
      return refuse("the request target has a control, space or non-ASCII byte");
  auto sent_target = worker_target(url, target);
  if (auto* e = std::get_if<ClientError>(&sent_target)) return std::move(*e);
  const bool ipv6 = url.host.find(':') != std::string::npos;
  std::string head = mrr::detail::str(r.method, " ", std::get<std::string>(sent_target), " HTTP/1.1\r\n",
                                      "Host: ", ipv6 ? "[" : "", url.host, ipv6 ? "]" : "");
  if (url.port != 80) head += mrr::detail::str(":", url.port);
  head += "\r\n";
  const ConnectionOptions connection_options(r.headers);
  for (const auto& [name, value] : r.headers) {
    if (name.empty() || !std::all_of(name.begin(), name.end(), is_tchar))
      return refuse(mrr::detail::str("header field name '", quoted_name(name), "' is not a token"));
    if (!std::all_of(value.begin(), value.end(), is_field_value_byte))
      return refuse(mrr::detail::str("the value of header field '", quoted_name(name), "' holds a control byte"));
    if (is_unforwardable_header(name) || connection_options.names(name)) continue;
    head += name;
    head += ": ";
    head += value;
    head += "\r\n";
  }
  if (!r.body.empty() || r.method == "POST" || r.method == "PUT" || r.method == "PATCH")
    head += mrr::detail::str("Content-Length: ", r.body.size(), "\r\n");
  head += "\r\n";
  return head;
}

// A worker's answer as read off the connection.
struct ClientResponse {
  int status = 0;
  Headers headers;  // end-to-end fields (a HEAD answer keeps its Content-Length)
  std::string body;
  bool reusable = false;  // the connection may carry another request
};

// One exchange on `fd`: sends head and body, and reads the answer, all before `deadline`. A
// worker that answers before the body is all sent (or closes its reading side) is read at once;
// the connection is then not reused. A body over `limit` bytes is abandoned as it arrives.
class HttpExchange {
 public:
  HttpExchange(int fd, TimePoint deadline, std::uint64_t limit) : fd_(fd), deadline_(deadline), limit_(limit) {}

  // `idempotent`: the request's method is (RFC 9110 §9.2.2), so a worker that closed the
  // connection after reading it whole may be sent it again.
  std::variant<ClientResponse, ClientError> run(std::string_view head, std::string_view body, bool head_request,
                                                Duration budget, bool idempotent = false) {
    budget_ = budget;
    const SendResult sent = send_request(head, body);
    if (sent == SendResult::timeout) return late();
    const bool whole = sent == SendResult::sent;
    auto got = read_response(head_request);
    if (auto* r = std::get_if<ClientResponse>(&got)) {
      r->reusable = r->reusable && whole;
    } else {
      auto& e = std::get<ClientError>(got);
      if (sent == SendResult::broken && received_ == 0)
        e.message = "the connection broke while the request was sent (" + send_error_ + ")";
      e.stale = e.stale && (!whole || idempotent);
    }
    return got;
  }

 private:
  enum class SendResult { sent, answered_early, broken, timeout };
  static constexpr std::size_t kMaxHead = 64 << 10;

  ClientError late() const {
    return ClientError{Failure::timeout,
                       mrr::detail::str("no whole answer within the attempt's ",
                                        std::chrono::duration_cast<std::chrono::milliseconds>(budget_).count(), " ms")};
  }

  // Sends head then body; stops as soon as the worker has something to say.
  SendResult send_request(std::string_view head, std::string_view body) {
    std::size_t done = 0;
    const std::size_t total = head.size() + body.size();
    while (done < total) {
      const int ev = poll_until(fd_, POLLOUT | POLLIN, deadline_);
      if (ev == 0) return SendResult::timeout;
      if (ev < 0) return broken(errno);
      if ((ev & POLLIN) != 0) {  // an answer, or the worker closed
        const long r = receive();
        if (r == -2) return SendResult::timeout;
        // Interim answers (100 Continue, 103 Early Hints) are dropped and the body goes on; a final
        // answer, the end of the stream or an error stops the send, and read_response takes it.
        if (r <= 0 || !only_interim_heads()) return SendResult::answered_early;
        continue;
      }
      if ((ev & (POLLERR | POLLHUP)) != 0 && (ev & POLLOUT) == 0) return broken(ECONNRESET);
      iovec iov[2];
      int parts = 0;
      if (done < head.size()) iov[parts++] = {const_cast<char*>(head.data() + done), head.size() - done};
      const std::size_t body_done = done > head.size() ? done - head.size() : 0;
      if (body_done < body.size()) iov[parts++] = {const_cast<char*>(body.data() + body_done), body.size() - body_done};
      msghdr msg{};
      msg.msg_iov = iov;
      msg.msg_iovlen = static_cast<decltype(msg.msg_iovlen)>(parts);
      const ssize_t n = ::sendmsg(fd_, &msg, MSG_NOSIGNAL);
      if (n < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) continue;
        return broken(errno);
      }
      done += static_cast<std::size_t>(n);
    }
    return SendResult::sent;
  }

  // Whether in_ holds nothing but whole interim (1xx but 101) heads and perhaps the start of
  // another head; drops the whole interim ones.
  bool only_interim_heads() {
    for (;;) {
      const std::size_t end = find_head_end(in_);
      if (end == std::string::npos) return in_.size() <= kMaxHead;
      int status = 0;
      bool http11 = false;
      const std::string_view line = std::string_view(in_).substr(0, in_.find("\r\n"));
      if (!parse_status_line(line, status, http11) || status >= 200 || status == 101) return false;
      in_.erase(0, end);
    }
  }

  SendResult broken(int error) {
    send_error_ = std::strerror(error);
    return SendResult::broken;
  }

  // Appends what the socket has to in_: > 0 bytes, 0 at the end of the stream, -1 on an error
  // (errno kept in error_), -2 at the deadline.
  long receive() {
    for (;;) {
      const int ev = poll_until(fd_, POLLIN, deadline_);
      if (ev == 0) return -2;
      if (ev < 0) {
        error_ = std::strerror(errno);
        return -1;
      }
      char buf[64 << 10];
      const ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
      if (n > 0) {
        in_.append(buf, static_cast<std::size_t>(n));
        received_ += static_cast<std::uint64_t>(n);
        return static_cast<long>(n);
      }
      if (n == 0) return 0;
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) continue;
      error_ = std::strerror(errno);
      return -1;
    }
  }

  ClientError io(std::string message) const { return ClientError{Failure::io, std::move(message)}; }

  // More bytes or the reason there are none: nullopt when some came.
  std::optional<ClientError> more(std::string_view while_doing) {
    const long r = receive();
    if (r > 0) return std::nullopt;
    if (r == -2) return late();
    ClientError e = io(r == 0 ? mrr::detail::str("the worker closed the connection ", while_doing)
                              : mrr::detail::str("the connection broke ", while_doing, " (", error_, ")"));
    e.stale = received_ == 0;
    return e;
  }

  // "HTTP/1.x SP 3DIGIT [SP reason]".
  static bool parse_status_line(std::string_view line, int& status, bool& http11) {
    if (line.size() < 12 || !line.starts_with("HTTP/1.") || !is_digit(line[7]) || line[8] != ' ') return false;
    if (!is_digit(line[9]) || !is_digit(line[10]) || !is_digit(line[11])) return false;
    if (line.size() > 12 && line[12] != ' ') return false;
    status = (line[9] - '0') * 100 + (line[10] - '0') * 10 + (line[11] - '0');
    http11 = line[7] != '0';
    return status >= 100;
  }

  std::variant<ClientResponse, ClientError> read_response(bool head_request) {
    ClientResponse out;
    Headers fields;
    bool http11 = false;
    for (;;) {  // heads, 1xx interim answers skipped
      std::size_t end;
      while ((end = find_head_end(in_)) == std::string::npos) {
        if (in_.size() > kMaxHead) return io("the worker's response head is over 64 KiB");
        // A head whose lines end in a bare LF never holds CRLF CRLF: refused at once, not waited on.
        if (in_.find("\n\n") != std::string::npos)
          return io("the worker's response head ends its lines with a bare LF, not CRLF");
        if (auto e = more("before a whole response head")) return *e;
      }
      if (end > kMaxHead) return io("the worker's response head is over 64 KiB");
      std::string_view head(in_.data(), end - 2);  // each line ends in CRLF
      fields.clear();
      std::size_t number = 0;
      while (!head.empty()) {
        const auto crlf = head.find("\r\n");
        const std::string_view line = head.substr(0, crlf);
        head.remove_prefix(crlf + 2);
        ++number;
        if (line.find_first_of("\r\n") != std::string_view::npos)
          return io("the worker's response head holds a bare CR or LF");
        if (number == 1) {
          if (!parse_status_line(line, out.status, http11))
            return io(mrr::detail::str("the worker's status line is not 'HTTP/1.1 <status> <reason>'"));
        } else if (auto bad = parse_field_line(line, number, fields)) {
          return io("bad response head from the worker: " + bad->detail);
        }
      }
      in_.erase(0, end);
      if (out.status >= 200) break;
      if (out.status == 101) return io("the worker switched protocols (101), which a reward exchange does not do");
    }
    // Framing (RFC 9112 §6.3).
    std::optional<std::uint64_t> length;
    bool chunked = false;
    std::optional<std::string_view> unreadable_coding;  // a Transfer-Encoding other than chunked alone
    for (const auto& [name, value] : fields) {
      if (iequals(name, "Content-Length")) {
        std::string_view rest = value;
        do {
          const auto comma = rest.find(',');
          const auto parsed = parse_content_length(rest.substr(0, comma));  // trims the item
          if (!parsed || (length && *length != *parsed)) return io("the worker's Content-Length is not one number");
          length = parsed;
          rest = comma == std::string_view::npos ? std::string_view{} : rest.substr(comma + 1);
        } while (!rest.empty());
      } else if (iequals(name, "Transfer-Encoding")) {
        if (chunked || !iequals(trim_ows(value), "chunked")) unreadable_coding = value;
        chunked = true;
      }
    }
    const ConnectionOptions connection_options(fields);
    bool close = connection_ends_after(connection_options, fields, http11);
    const bool no_body = head_request || out.status == 204 || out.status == 304;
    // Only chunked alone is decoded: a body in another coding (gzip, chunked) would reach the
    // client still coded once the hop-by-hop field is dropped (RFC 9112 §6.1).
    if (unreadable_coding && !no_body)
      return io(mrr::detail::str("the worker's Transfer-Encoding is '", *unreadable_coding,
                                 "'; only chunked alone is decoded"));
    out.headers = forwardable(fields, /*keep_length=*/head_request || out.status == 304);
    if (no_body) {
      out.reusable = !close && in_.empty();
      return out;
    }
    const auto too_large = [&] {
      return io(mrr::detail::str("the worker's response is over max_response_bytes (", limit_, " bytes)"));
    };
    if (chunked) {
      ChunkedDecoder decoder(limit_);
      for (;;) {
        const std::size_t used = decoder.feed(in_, out.body);
        in_.erase(0, used);
        if (decoder.done()) break;
        if (decoder.failed())
          return decoder.too_large() ? too_large() : io("the worker's chunked body is malformed: " + decoder.error());
        if (auto e = more("in the middle of a chunked body")) return *e;
      }
      close = close || length.has_value();  // both framings given: this one read, the connection not trusted
    } else if (length) {
      if (*length > limit_) return too_large();
      const auto n = static_cast<std::size_t>(*length);
      in_.reserve(n);  // sized once from the length, not grown by doubling
      while (in_.size() < n)
        if (auto e = more("in the middle of the body")) return *e;
      if (in_.size() == n) {
        out.body = std::move(in_);  // no copy
        in_.clear();
      } else {
        out.body.assign(in_, 0, n);
        in_.erase(0, n);
      }
    } else {  // delimited by the end of the connection
      close = true;
      for (;;) {
        if (in_.size() > limit_) return too_large();
        const long r = receive();
        if (r == 0) break;
        if (r == -2) return late();
        if (r < 0) return io(mrr::detail::str("the connection broke in the middle of the body (", error_, ")"));
      }
      out.body = std::move(in_);
      in_.clear();
    }
    out.reusable = !close && in_.empty();  // bytes nobody asked for: the connection is not trusted
    return out;
  }

  int fd_;
  TimePoint deadline_;
  std::uint64_t limit_;
  Duration budget_{};
  std::string in_;
  std::uint64_t received_ = 0;
  std::string error_, send_error_;
};

}  // namespace detail
}  // namespace reward
MRR_NAMESPACE_END
