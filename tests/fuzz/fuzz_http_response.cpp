// libFuzzer target for the reward transport's HTTP/1.1 client (mrr/reward/http_client.hpp): what
// a worker sends back is untrusted bytes. The input's first byte picks the request (bit 0: HEAD,
// bit 1: a tiny max_response_bytes); the rest is what the worker answers, written into one end of
// a socket pair whose other end the client reads, then closed. Every input must end in a response
// or a ClientError, within the deadline; a response's body is within the limit, its status 200 or
// more, a HEAD's body empty; and no exception escapes.
//
// A second mode (first byte's bit 2) fuzzes request_head: the rest split at '\n' into the
// target and "Name: value" header lines; an accepted head holds exactly one empty line, at its
// end (no field can end it early), and every field it carries came from the request.
#include <mrr/reward/http_client.hpp>

#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>
#include <variant>

namespace {

void check(bool invariant) {
  if (!invariant) std::abort();
}

void response(std::uint8_t mode, std::string_view answer) {
  int fds[2];
  check(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) == 0);
  const mrr::reward::detail::Socket client(fds[0]);
  {
    const mrr::reward::detail::Socket worker(fds[1]);
    int size = 1 << 20;  // the whole answer fits in the pair's buffer: written before the client reads
    ::setsockopt(worker.get(), SOL_SOCKET, SO_SNDBUF, &size, sizeof size);
    ::setsockopt(client.get(), SOL_SOCKET, SO_RCVBUF, &size, sizeof size);
    std::size_t sent = 0;
    while (sent < answer.size()) {
      const ssize_t n = ::send(worker.get(), answer.data() + sent, answer.size() - sent, MSG_NOSIGNAL);
      if (n <= 0) return;  // larger than the buffer: not this target's case
      sent += static_cast<std::size_t>(n);
    }
  }  // the worker closes: a body delimited by the close ends here
  const bool head = (mode & 1) != 0;
  const std::uint64_t limit = (mode & 2) != 0 ? 16 : (1u << 20);
  const std::string request = head ? "HEAD / HTTP/1.1\r\nHost: x\r\n\r\n" : "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  mrr::reward::detail::HttpExchange exchange(client.get(), deadline, limit);
  const auto got = exchange.run(request, {}, head, std::chrono::seconds(5));
  if (const auto* r = std::get_if<mrr::reward::detail::ClientResponse>(&got)) {
    check(r->status >= 200 && r->status <= 999);
    check(r->body.size() <= limit);
    if (head || r->status == 204 || r->status == 304) check(r->body.empty());
    for (const auto& [name, value] : r->headers) {
      check(!name.empty());
      check(value.find_first_of("\r\n") == std::string::npos);
    }
  } else {
    const auto& e = std::get<mrr::reward::detail::ClientError>(got);
    check(!e.message.empty());
    check(e.failure == mrr::reward::Failure::io);  // the answer was all there: never a timeout
  }
}

void request_head(std::string_view rest) {
  mrr::reward::WorkerUrl url{"http", "127.0.0.1", 8000, "/base"};
  mrr::reward::Request r;
  const auto nl = rest.find('\n');
  const std::string_view target = rest.substr(0, nl);
  rest = nl == std::string_view::npos ? std::string_view{} : rest.substr(nl + 1);
  while (!rest.empty()) {
    const auto end = rest.find('\n');
    const std::string_view line = rest.substr(0, end);
    const auto colon = line.find(':');
    if (colon != std::string_view::npos)
      r.headers.emplace_back(std::string(line.substr(0, colon)), std::string(line.substr(colon + 1)));
    rest = end == std::string_view::npos ? std::string_view{} : rest.substr(end + 1);
  }
  r.body = "b";
  const auto head = mrr::reward::detail::request_head(url, r, target);
  if (const auto* text = std::get_if<std::string>(&head)) {
    check(text->find("\r\n\r\n") == text->size() - 4);
    check(text->starts_with("POST /base"));
    check(text->find('\0') == std::string::npos);
    std::size_t lines = 0;
    for (std::size_t at = 0; (at = text->find("\r\n", at)) != std::string::npos; at += 2)
      ++lines;
    check(lines <= r.headers.size() + 4);  // request line, Host, the request's fields, Content-Length, end
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const std::string_view rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  try {
    if ((data[0] & 4) != 0)
      request_head(rest);
    else
      response(data[0], rest);
  } catch (...) {
    std::abort();  // the client reports with ClientError, never by throwing
  }
  return 0;
}
