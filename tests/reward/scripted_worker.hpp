// A worker speaking raw HTTP/1.1 from a script, for what no server library does on request: it
// records each request's head and body exactly as they arrived, and answers with the bytes the
// script returns. With `read_body` false it answers as soon as the head is in and never reads the
// body (a worker refusing a large body early, as a server with a body limit does), then waits for
// the client to close. `close_after`: it closes the connection after each answer (without saying
// so in the answer); it also closes after an answer that says Connection: close or is HTTP/1.0.
#pragma once

#include <arpa/inet.h>
#include <doctest/doctest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace mrr_test {

class ScriptedWorker {
 public:
  struct Options {
    bool read_body = true;
    bool close_after = false;
  };
  // The answer's bytes for a request's head (up to its empty line) and body.
  using Script = std::function<std::string(const std::string& head, const std::string& body)>;

  explicit ScriptedWorker(Script script, Options options) : script_(std::move(script)), options_(options) {
    listen_fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    REQUIRE(listen_fd_ >= 0);
    const int one = 1;
    ::setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
    REQUIRE(::listen(listen_fd_, 64) == 0);
    socklen_t len = sizeof addr;
    REQUIRE(::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len) == 0);
    port_ = ntohs(addr.sin_port);
    acceptor_ = std::thread([this] { accept_loop(); });
  }
  explicit ScriptedWorker(Script script) : ScriptedWorker(std::move(script), Options{}) {}
  ScriptedWorker(const ScriptedWorker&) = delete;
  ScriptedWorker& operator=(const ScriptedWorker&) = delete;
  ~ScriptedWorker() {
    stop_ = true;
    acceptor_.join();
    for (auto& t : connections_)
      t.join();
    ::close(listen_fd_);
  }

  [[nodiscard]] std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }
  [[nodiscard]] int port() const { return port_; }
  [[nodiscard]] int connections() const { return accepted_.load(); }
  [[nodiscard]] std::vector<std::string> heads() const {
    std::lock_guard lock(mutex_);
    return heads_;
  }
  [[nodiscard]] std::vector<std::string> bodies() const {
    std::lock_guard lock(mutex_);
    return bodies_;
  }

 private:
  void accept_loop() {
    while (!stop_) {
      pollfd p{listen_fd_, POLLIN, 0};
      if (::poll(&p, 1, 20) <= 0) continue;
      const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) continue;
      ++accepted_;
      connections_.emplace_back([this, fd] { serve(fd); });
    }
  }

  // Appends what arrives within 20 ms; false once the client closed or the worker stops.
  bool receive(int fd, std::string& in) {
    while (!stop_) {
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, 20) <= 0) continue;
      char buf[65536];
      const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
      if (n <= 0) return false;
      in.append(buf, static_cast<std::size_t>(n));
      return true;
    }
    return false;
  }

  void serve(int fd) {
    std::string in;
    for (;;) {
      std::size_t end;
      while ((end = in.find("\r\n\r\n")) == std::string::npos)
        if (!receive(fd, in)) return finish(fd);
      std::string head = in.substr(0, end + 4);
      in.erase(0, end + 4);
      std::size_t length = 0;
      const auto at = head.find("\r\nContent-Length: ");
      if (at != std::string::npos) length = std::stoul(head.substr(at + 18));
      std::string body;
      if (options_.read_body) {
        while (in.size() < length)
          if (!receive(fd, in)) return finish(fd);
        body = in.substr(0, length);
        in.erase(0, length);
      }
      const std::string answer = script_(head, body);
      {
        std::lock_guard lock(mutex_);
        heads_.push_back(head);
        bodies_.push_back(body);
      }
      std::size_t sent = 0;
      while (sent < answer.size()) {
        const ssize_t n = ::send(fd, answer.data() + sent, answer.size() - sent, MSG_NOSIGNAL);
        if (n <= 0) return finish(fd);
        sent += static_cast<std::size_t>(n);
      }
      if (options_.close_after || answer.starts_with("HTTP/1.0") ||
          answer.find("\r\nConnection: close\r\n") < answer.find("\r\n\r\n")) {
        if (options_.read_body) return finish(fd);
      }
      if (options_.close_after) return finish(fd);
      if (!options_.read_body) {  // never reads what follows: waits for the client to go
        while (!stop_) {
          pollfd p{fd, POLLRDHUP, 0};
          if (::poll(&p, 1, 20) > 0) break;
        }
        return finish(fd);
      }
    }
  }

  static void finish(int fd) { ::close(fd); }

  Script script_;
  Options options_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<int> accepted_{0};
  mutable std::mutex mutex_;
  std::vector<std::string> heads_, bodies_;
  std::vector<std::thread> connections_;  // touched by the acceptor thread only, joined after it
  std::thread acceptor_;
};

}  // namespace mrr_test
