// A raw TCP client for the reward proxy's tests: it writes exactly the bytes given (requests no
// HTTP client library would send) and reads responses back, with timeouts.
#pragma once

#include <arpa/inet.h>
#include <doctest/doctest.h>
#include <netinet/in.h>
#include <nlohmann/json.hpp>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

namespace mrr_test {

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
  std::string read_response(std::chrono::milliseconds timeout = std::chrono::seconds(20)) {
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
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(give_up - std::chrono::steady_clock::now());
      if (left.count() <= 0) return std::exchange(in_, {});
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
      char chunk[4096];
      const ssize_t n = ::recv(fd_, chunk, sizeof chunk, 0);
      if (n <= 0) return std::exchange(in_, {});
      in_.append(chunk, static_cast<std::size_t>(n));
    }
  }

  // Whether response bytes are waiting (or arrive within `timeout`).
  bool has_data(std::chrono::milliseconds timeout) {
    if (!in_.empty()) return true;
    pollfd p{fd_, POLLIN, 0};
    return ::poll(&p, 1, static_cast<int>(timeout.count())) > 0;
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

inline int status_line(const std::string& response) {
  if (response.rfind("HTTP/1.1 ", 0) != 0 || response.size() < 12) return 0;
  return std::stoi(response.substr(9, 3));
}

inline nlohmann::json json_body(const std::string& response) {
  const auto head = response.find("\r\n\r\n");
  if (head == std::string::npos) return nlohmann::json();
  return nlohmann::json::parse(response.substr(head + 4), nullptr, false);
}

}  // namespace mrr_test
