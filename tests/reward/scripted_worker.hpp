// A worker speaking raw HTTP/1.1 from a script, for what no server library does on request: it
// records each request's head and body exactly as they arrived, and answers with the bytes the
// script returns. With `read_body` false it answers as soon as the head is in and never reads the
// body (a worker refusing a large body early, as a server with a body limit does), then waits for
// the client to close. `close_after`: it closes the connection after each answer (without saying
// so in the answer); it also closes after an answer that says Connection: close or is HTTP/1.0.
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
    listener_.start([this](int fd) { serve(fd); });
  }
  explicit ScriptedWorker(Script script) : ScriptedWorker(std::move(script), Options{}) {}

  [[nodiscard]] std::string url() const { return listener_.url(); }
  [[nodiscard]] int port() const { return listener_.port(); }
  [[nodiscard]] int connections() const { return listener_.connections(); }
  [[nodiscard]] std::vector<std::string> heads() const {
    std::lock_guard lock(mutex_);
    return heads_;
  }
  [[nodiscard]] std::vector<std::string> bodies() const {
    std::lock_guard lock(mutex_);
    return bodies_;
  }

 private:
  // Appends what arrives within 20 ms; false once the client closed or the worker stops.
  bool receive(int fd, std::string& in) {
    while (!listener_.stopping()) {
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
      const bool says_close =
          answer.starts_with("HTTP/1.0") || answer.find("\r\nConnection: close\r\n") < answer.find("\r\n\r\n");
      if (options_.close_after || (says_close && options_.read_body)) return finish(fd);
      if (!options_.read_body) {  // never reads what follows: waits for the client to go
        while (!listener_.stopping()) {
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
  mutable std::mutex mutex_;
  std::vector<std::string> heads_, bodies_;
  LoopbackListener listener_;  // last: its threads are joined first
};

}  // namespace mrr_test
