// A worker no HTTP server library would be: it reads each request's head, then writes a response
// head one byte every `pause`, for `limit` (then closes: a client without a limit on the whole
// exchange fails the test instead of hanging it). Each socket read of its client gets a byte well
// within any read timeout, so only a limit on the whole exchange ends it sooner.
#pragma once

#include <arpa/inet.h>
#include <doctest/doctest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

namespace mrr_test {

class TricklingWorker {
 public:
  explicit TricklingWorker(std::chrono::milliseconds pause = std::chrono::milliseconds(100),
                           std::chrono::milliseconds limit = std::chrono::seconds(12))
      : pause_(pause), limit_(limit) {
    listen_fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    REQUIRE(listen_fd_ >= 0);
    const int one = 1;
    ::setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = 0;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
    REQUIRE(::listen(listen_fd_, 64) == 0);
    socklen_t len = sizeof addr;
    REQUIRE(::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len) == 0);
    port_ = ntohs(addr.sin_port);
    acceptor_ = std::thread([this] { accept_loop(); });
  }
  TricklingWorker(const TricklingWorker&) = delete;
  TricklingWorker& operator=(const TricklingWorker&) = delete;
  ~TricklingWorker() {
    stop_ = true;
    acceptor_.join();
    for (auto& t : connections_)
      t.join();
    ::close(listen_fd_);
  }

  [[nodiscard]] std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }
  [[nodiscard]] int requests() const { return requests_.load(); }

 private:
  void accept_loop() {
    while (!stop_) {
      pollfd p{listen_fd_, POLLIN, 0};
      if (::poll(&p, 1, 50) <= 0) continue;
      const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd >= 0) connections_.emplace_back([this, fd] { serve(fd); });
    }
  }

  // Reads up to the end of the head, then trickles "HTTP/1.1 200 OK\r\nX-Pad: aaaa..." until
  // the client goes away or the worker is destroyed.
  void serve(int fd) {
    std::string in;
    char buf[4096];
    while (!stop_ && in.find("\r\n\r\n") == std::string::npos) {
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, 50) <= 0) continue;
      const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
      if (n <= 0) break;
      in.append(buf, static_cast<std::size_t>(n));
    }
    if (in.find("\r\n\r\n") != std::string::npos) {
      ++requests_;
      const std::string head = "HTTP/1.1 200 OK\r\nX-Pad: ";
      const auto give_up = std::chrono::steady_clock::now() + limit_;
      for (std::size_t i = 0; !stop_ && std::chrono::steady_clock::now() < give_up; ++i) {
        const char c = i < head.size() ? head[i] : 'a';
        if (::send(fd, &c, 1, MSG_NOSIGNAL) != 1) break;
        std::this_thread::sleep_for(pause_);
      }
    }
    ::close(fd);
  }

  std::chrono::milliseconds pause_, limit_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<int> requests_{0};
  std::vector<std::thread> connections_;  // touched by the acceptor thread only, joined after it
  std::thread acceptor_;
};

}  // namespace mrr_test
