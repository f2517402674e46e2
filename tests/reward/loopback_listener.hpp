// A TCP listener on 127.0.0.1 (an ephemeral port) for the raw test workers: an acceptor thread
// hands each connection to `serve` on a thread of its own. Declare it as the last member of the
// worker that owns it, so its threads are joined before the members they use are destroyed.
#pragma once

#include <arpa/inet.h>
#include <doctest/doctest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <functional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace mrr_test {

class LoopbackListener {
 public:
  LoopbackListener() {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    REQUIRE(fd_ >= 0);
    const int one = 1;
    ::setsockopt(fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
    REQUIRE(::listen(fd_, 64) == 0);
    socklen_t len = sizeof addr;
    REQUIRE(::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len) == 0);
    port_ = ntohs(addr.sin_port);
  }
  LoopbackListener(const LoopbackListener&) = delete;
  LoopbackListener& operator=(const LoopbackListener&) = delete;
  ~LoopbackListener() {
    stop_ = true;
    if (acceptor_.joinable()) acceptor_.join();
    for (auto& t : connections_)
      t.join();
    ::close(fd_);
  }

  // Starts accepting; each connection's fd goes to `serve`, which closes it.
  void start(std::function<void(int)> serve) {
    serve_ = std::move(serve);
    acceptor_ = std::thread([this] {
      while (!stop_) {
        pollfd p{fd_, POLLIN, 0};
        if (::poll(&p, 1, 20) <= 0) continue;
        const int fd = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
        if (fd < 0) continue;
        ++accepted_;
        connections_.emplace_back([this, fd] { serve_(fd); });
      }
    });
  }

  [[nodiscard]] bool stopping() const { return stop_.load(); }
  [[nodiscard]] int port() const { return port_; }
  [[nodiscard]] std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }
  [[nodiscard]] int connections() const { return accepted_.load(); }

 private:
  int fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<int> accepted_{0};
  std::function<void(int)> serve_;
  std::vector<std::thread> connections_;  // touched by the acceptor thread only, joined after it
  std::thread acceptor_;
};

}  // namespace mrr_test
