// A worker no HTTP server library would be: it reads each request's head, then writes a response
// head one byte every `pause`, for `limit` (then closes: a client without a limit on the whole
// exchange fails the test instead of hanging it). Each socket read of its client gets a byte well
// within any read timeout, so only a limit on the whole exchange ends it sooner.
#pragma once

#include "loopback_listener.hpp"

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
    listener_.start([this](int fd) { serve(fd); });
  }

  [[nodiscard]] std::string url() const { return listener_.url(); }
  [[nodiscard]] int requests() const { return requests_.load(); }

 private:
  // Reads up to the end of the head, then trickles "HTTP/1.1 200 OK\r\nX-Pad: aaaa..." until
  // the client goes away or the worker is destroyed.
  void serve(int fd) {
    std::string in;
    char buf[4096];
    while (!listener_.stopping() && in.find("\r\n\r\n") == std::string::npos) {
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
      for (std::size_t i = 0; !listener_.stopping() && std::chrono::steady_clock::now() < give_up; ++i) {
        const char c = i < head.size() ? head[i] : 'a';
        if (::send(fd, &c, 1, MSG_NOSIGNAL) != 1) break;
        std::this_thread::sleep_for(pause_);
      }
    }
    ::close(fd);
  }

  std::chrono::milliseconds pause_, limit_;
  std::atomic<int> requests_{0};
  LoopbackListener listener_;  // last: its threads are joined first
};

}  // namespace mrr_test
