// HttpTransport's https:// workers, where cpp-httplib has TLS (CPPHTTPLIB_OPENSSL_SUPPORT): its
// client pooled per worker with keep-alive, an exchange bounded as a whole by a watchdog (the
// client's own timeouts bound each socket call). Plain http:// goes through mrr's own client
// (http_client.hpp), which also hears a worker that answers before reading the whole body.
// mrr-requires: mrr_reward_http
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>
#include <mrr/reward/http_client.hpp>
#include <mrr/reward/request_checks.hpp>
#include <mrr/reward/transport.hpp>

#ifdef CPPHTTPLIB_OPENSSL_SUPPORT
#include <httplib.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <time.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

MRR_NAMESPACE_BEGIN
namespace reward {
namespace detail {

// Idle keep-alive clients of one worker. A cpp-httplib client serialises its requests, so each
// attempt takes one client for itself and returns it afterwards.
// Blocks SIGPIPE on this thread while alive, and takes one raised meanwhile off the pending set
// before it goes: cpp-httplib's TLS writes use write(2) without MSG_NOSIGNAL, and a worker that
// closes first (an early 413) would otherwise end the process, SIGPIPE's default action.
class SigpipeBlocked {
 public:
  SigpipeBlocked() {
    sigemptyset(&pipe_);
    sigaddset(&pipe_, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe_, &old_);
    sigset_t pending;
    sigpending(&pending);
    was_pending_ = sigismember(&pending, SIGPIPE) == 1;  // not ours to take
  }
  SigpipeBlocked(const SigpipeBlocked&) = delete;
  SigpipeBlocked& operator=(const SigpipeBlocked&) = delete;
  ~SigpipeBlocked() {
    sigset_t pending;
    if (!was_pending_ && sigpending(&pending) == 0 && sigismember(&pending, SIGPIPE) == 1) {
      const timespec now{0, 0};
      while (sigtimedwait(&pipe_, nullptr, &now) < 0 && errno == EINTR) {
      }
    }
    pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }

 private:
  sigset_t pipe_{}, old_{};
  bool was_pending_ = false;
};

// cpp-httplib's TLS client, which can also say whether its kept connection is clean.
class TlsClient final : public httplib::SSLClient {
 public:
  using httplib::SSLClient::SSLClient;

  // Whether the connection it keeps holds nothing nobody asked for: no bytes decrypted and left
  // over, none waiting on the socket, no close from the worker. cpp-httplib reads an answer by its
  // framing and leaves what follows it where it is, so a worker that sent more (a second answer,
  // bytes after the body) would have them read as the answer to the next request on the
  // connection; such a client is not used again. Call between requests only.
  bool connection_clean() {
    std::lock_guard lock(socket_mutex_);
    if (!socket_.is_open()) return true;  // no connection kept: the next request makes one
    if (socket_.ssl != nullptr && SSL_pending(socket_.ssl) > 0) return false;
    pollfd p{socket_.sock, POLLIN, 0};
    return ::poll(&p, 1, 0) == 0;
  }
};

struct TlsEndpoint {
  explicit TlsEndpoint(WorkerUrl u) : url(std::move(u)) {}
  WorkerUrl url;
  std::mutex mutex;
  std::vector<std::unique_ptr<TlsClient>> idle;
};

inline std::unique_ptr<TlsClient> make_client(const WorkerUrl& url) {
  auto client = std::make_unique<TlsClient>(url.host, url.port);
  client->set_keep_alive(true);
  client->set_url_encode(false);  // the target is forwarded exactly as the client sent it
  client->set_decompress(false);  // the body is relayed with its Content-Encoding untouched
  client->set_follow_location(false);
  client->set_tcp_nodelay(true);
  return client;
}

// cpp-httplib timeouts have microsecond resolution; a zero would mean "no wait at all".
inline std::chrono::microseconds at_least_1ms(Duration d) {
  return std::max<std::chrono::microseconds>(std::chrono::duration_cast<std::chrono::microseconds>(d),
                                             std::chrono::milliseconds(1));
}

// cpp-httplib's timeouts bound each socket call, not an exchange: a worker that trickles its
// response head (or a /health answer) a byte at a time would hold an attempt, or the health
// monitor's one thread, for ever. The watchdog stops a client whose exchange outlives its
// deadline: Client::stop() from another thread shuts the socket down (the one thing cpp-httplib
// makes safe while a request is in flight) and the blocked call returns. Until the exchange
// ends, it stops the client again every few milliseconds, in case the first stop came while
// the client was still connecting (no socket yet to shut down). One thread per transport,
// started with the first exchange; it sleeps until the earliest deadline.
class ExchangeWatchdog {
 public:
  using Clock = std::chrono::steady_clock;

  ExchangeWatchdog() = default;
  ExchangeWatchdog(const ExchangeWatchdog&) = delete;
  ExchangeWatchdog& operator=(const ExchangeWatchdog&) = delete;
  ~ExchangeWatchdog() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

  // Watches `client` until end() (or destruction), which says whether its deadline passed.
  class Watch {
   public:
    Watch(ExchangeWatchdog& dog, httplib::ClientImpl& client, Clock::time_point deadline)
        : dog_(&dog), id_(dog.add(client, deadline)) {}
    Watch(const Watch&) = delete;
    Watch& operator=(const Watch&) = delete;
    ~Watch() { end(); }
    // Stops watching (the client is no longer touched after this returns); true when the deadline
    // passed and the client was stopped.
    bool end() {
      if (dog_ != nullptr) {
        fired_ = dog_->remove(id_);
        dog_ = nullptr;
      }
      return fired_;
    }

   private:
    ExchangeWatchdog* dog_;
    std::uint64_t id_;
    bool fired_ = false;
  };

 private:
  static constexpr auto restop_every = std::chrono::milliseconds(5);

  struct Entry {
    httplib::ClientImpl* client;
    Clock::time_point deadline;
    bool fired = false;     // the deadline passed: the client was stopped
    bool stopping = false;  // the watchdog is calling client->stop() now
  };

  std::uint64_t add(httplib::ClientImpl& client, Clock::time_point deadline) {
    std::unique_lock lock(mutex_);
    const std::uint64_t id = next_id_++;
    entries_.emplace(id, Entry{&client, deadline});
    if (!thread_.joinable()) thread_ = std::thread([this] { run(); });
    if (deadline < next_wake_) {
      next_wake_ = deadline;
      lock.unlock();
      wake_.notify_one();
    }
    return id;
  }

  // Waits while the watchdog is stopping the client, so the caller may free it once this returns.
  bool remove(std::uint64_t id) {
    std::unique_lock lock(mutex_);
    const auto it = entries_.find(id);  // std::map: stays valid while others come and go
    stopped_.wait(lock, [&] { return !it->second.stopping; });
    const bool fired = it->second.fired;
    entries_.erase(it);
    return fired;
  }

  void run() {
    std::unique_lock lock(mutex_);
    std::vector<httplib::ClientImpl*> due;
    while (!stopping_) {
      const auto now = Clock::now();
      next_wake_ = Clock::time_point::max();
      for (auto& [id, e] : entries_) {
        if (e.deadline <= now) {
          e.fired = e.stopping = true;
          e.deadline = now + restop_every;
          due.push_back(e.client);
        }
        next_wake_ = std::min(next_wake_, e.deadline);
      }
      if (!due.empty()) {
        // Outside the lock (stop() may wait for a connect in progress, and other exchanges must
        // still come and go); remove() waits for `stopping` to clear before the client is freed.
        lock.unlock();
        for (httplib::ClientImpl* client : due)
          client->stop();
        lock.lock();
        due.clear();
        for (auto& [id, e] : entries_)
          e.stopping = false;
        stopped_.notify_all();
        continue;
      }
      wake_.wait_until(lock, next_wake_ == Clock::time_point::max() ? now + std::chrono::hours(1) : next_wake_);
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_, stopped_;
  std::map<std::uint64_t, Entry> entries_;
  std::uint64_t next_id_ = 0;
  Clock::time_point next_wake_ = Clock::time_point::max();
  bool stopping_ = false;
  std::thread thread_;  // last: started once the members it uses exist
};

// HttpTransport's https:// workers: cpp-httplib's TLS client (thread-safe).
class TlsTransport {
 public:
  explicit TlsTransport(const HttpTransportOptions& options) : options_(options) {}

  Reply send(std::string_view worker, const Request& request, Duration timeout) {
    std::shared_ptr<TlsEndpoint> ep;
    try {
      ep = endpoint(worker);
    } catch (const InvalidArgument& e) {
      return Reply::failed(Failure::connect, e.what());
    }
    std::unique_ptr<TlsClient> client = take_client(*ep);
    if (!client->is_valid()) return Reply::failed(Failure::connect, "cannot create a client for this URL");

    const auto start = std::chrono::steady_clock::now();
    const auto deadline = saturating_add(start, timeout);
    client->set_connection_timeout(at_least_1ms(std::min(timeout, options_.connect_timeout)));
    client->set_read_timeout(at_least_1ms(timeout));
    client->set_write_timeout(at_least_1ms(timeout));

    httplib::Request out;
    out.method = request.method;
    auto target = worker_target(ep->url, request.target);
    if (auto* e = std::get_if<ClientError>(&target)) return Reply::failed(e->failure, std::move(e->message));
    out.path = std::move(std::get<std::string>(target));
    for (auto& [name, value] : forwardable(request.headers))
      out.headers.emplace(std::move(name), std::move(value));
    // The body is streamed from the caller's string: no copy per attempt, however large.
    if (!request.body.empty()) {
      const std::string& body = request.body;
      out.content_length_ = body.size();
      out.content_provider_ = [&body](std::size_t offset, std::size_t length, httplib::DataSink& sink) {
        return sink.write(body.data() + offset, std::min(length, body.size() - offset));
      };
    }
    // The socket timeouts bound each read; this bounds the whole body of a worker that trickles.
    out.progress = [deadline](std::uint64_t, std::uint64_t) { return std::chrono::steady_clock::now() < deadline; };
    // The answer is read into a string sized from its Content-Length at once, not grown by doubling,
    // and abandoned once it passes max_response_bytes (at once when its length says it will). The
    // bytes are counted here: cpp-httplib passes a chunked body chunk by chunk, each from offset 0
    // with the chunk's length as `total`, so neither says where in the body a piece goes.
    std::string body;
    bool too_large = false, first_piece = true;
    const std::uint64_t limit = options_.max_response_bytes;
    out.content_receiver = [&](const char* data, std::size_t n, std::uint64_t offset, std::uint64_t total) {
      if (first_piece) {
        first_piece = false;
        too_large = offset == 0 && total > limit;
        if (too_large) return false;  // cpp-httplib stops reading: Error::Canceled
        if (offset == 0 && total > body.capacity()) body.reserve(static_cast<std::size_t>(total));
      }
      too_large = n > limit - body.size();
      if (too_large) return false;
      body.append(data, n);
      return true;
    };

    // An answer that has no body whatever its fields say (204, 304) is taken at its head: cpp-httplib
    // 0.11 reads one by its Content-Length, or to the end of the connection, and so waited out the
    // whole budget. An interim answer other than 100 (103 Early Hints), which cpp-httplib would take
    // for the final one, ends the attempt there too.
    int head_only_status = 0;
    httplib::Headers head_only_fields;
    out.response_handler = [&](const httplib::Response& head) {
      if (head.status != 204 && head.status != 304 && head.status >= 200) return true;
      head_only_status = head.status;
      head_only_fields = head.headers;
      return false;  // cpp-httplib stops reading: Error::Canceled
    };

    httplib::Response in;
    httplib::Error error = httplib::Error::Success;
    ExchangeWatchdog::Watch watch(watchdog_, *client, deadline);
    const SigpipeBlocked no_sigpipe;
    const bool sent = client->send(out, in, error);
    const bool stopped = watch.end();  // the exchange outlived its budget (e.g. a trickled response head)
    if (!sent && head_only_status != 0) {  // taken at its head; the connection is not used again
      if (head_only_status < 200)
        return Reply::failed(Failure::io,
                             mrr::detail::str("the worker sent an interim answer (", head_only_status,
                                              ") that the https client cannot skip; only 100 Continue is"));
      in.status = head_only_status;
      in.headers = std::move(head_only_fields);
      body.clear();
    } else if (!sent) {
      if (too_large)
        return Reply::failed(Failure::io,
                             mrr::detail::str("the worker's response is over max_response_bytes (", limit, " bytes)"));
      if (stopped)
        return Reply::failed(Failure::timeout,
                             mrr::detail::str("no whole answer within the attempt's ",
                                              std::chrono::duration_cast<std::chrono::milliseconds>(timeout).count(),
                                              " ms (", httplib::to_string(error), ")"));
      const auto elapsed = std::chrono::steady_clock::now() - start;
      return Reply::failed(classify(error, elapsed, timeout), httplib::to_string(error));
    }
    Response response;
    response.status = in.status;
    response.headers = forwardable(Headers(in.headers.begin(), in.headers.end()),
                                   /*keep_length=*/request.method == "HEAD" || in.status == 304);
    response.body = std::move(body);
    if (sent && !stopped) give_back(*ep, std::move(client));  // a stopped one has no connection left
    return Reply::from(std::move(response));
  }

  // GET <base>/<health_path> on a fresh connection (a pooled one may be stale); 2xx is healthy.
  // The whole probe, not each socket call, is bounded by `timeout`.
  bool check_health(std::string_view worker, Duration timeout) {
    std::shared_ptr<TlsEndpoint> ep;
    try {
      ep = endpoint(worker);
    } catch (const InvalidArgument&) {
      return false;
    }
    auto client = make_client(ep->url);
    client->set_keep_alive(false);
    client->set_connection_timeout(at_least_1ms(std::min(timeout, options_.connect_timeout)));
    client->set_read_timeout(at_least_1ms(timeout));
    client->set_write_timeout(at_least_1ms(timeout));
    ExchangeWatchdog::Watch watch(watchdog_, *client, saturating_add(std::chrono::steady_clock::now(), timeout));
    const SigpipeBlocked no_sigpipe;
    const auto result = client->Get(ep->url.base_path + options_.health_path);
    const bool late = watch.end();
    return !late && result && result->status >= 200 && result->status < 300;
  }

  // Closes the idle connections to a worker (e.g. once it is removed from the dispatcher).
  void forget(std::string_view worker) {
    std::lock_guard lock(mutex_);
    endpoints_.erase(std::string(worker));
  }

 private:
  static Failure classify(httplib::Error error, Duration elapsed, Duration budget) {
    switch (error) {
      case httplib::Error::Connection:
        return Failure::connect;
      case httplib::Error::ConnectionTimeout:
        return Failure::timeout;
      case httplib::Error::Canceled:  // our progress callback past the deadline, or a body write that broke
      case httplib::Error::Read:
      case httplib::Error::Write:
        // A socket timeout and a broken connection look alike; the clock tells them apart.
        return elapsed >= budget - std::chrono::milliseconds(5) ? Failure::timeout : Failure::io;
      default:
        return Failure::io;
    }
  }

  std::shared_ptr<TlsEndpoint> endpoint(std::string_view worker) {
    std::lock_guard lock(mutex_);
    auto it = endpoints_.find(std::string(worker));
    if (it == endpoints_.end())
      it = endpoints_.emplace(std::string(worker), std::make_shared<TlsEndpoint>(parse_worker_url(worker))).first;
    return it->second;
  }

  // An idle client whose connection is still clean (checked now: a worker may have sent bytes or
  // closed while it sat idle), or a new one.
  static std::unique_ptr<TlsClient> take_client(TlsEndpoint& ep) {
    for (;;) {
      std::unique_ptr<TlsClient> client;
      {
        std::lock_guard lock(ep.mutex);
        if (ep.idle.empty()) break;
        client = std::move(ep.idle.back());
        ep.idle.pop_back();
      }
      if (client->connection_clean()) return client;
    }
    return make_client(ep.url);
  }

  void give_back(TlsEndpoint& ep, std::unique_ptr<TlsClient> client) {
    if (!client->connection_clean()) return;  // bytes after the answer: the connection is not trusted
    std::lock_guard lock(ep.mutex);
    if (ep.idle.size() < options_.max_idle_connections) ep.idle.push_back(std::move(client));
  }

  const HttpTransportOptions& options_;
  std::mutex mutex_;
  std::unordered_map<std::string, std::shared_ptr<TlsEndpoint>> endpoints_;
  ExchangeWatchdog watchdog_;  // last: stopped before the endpoints' clients go
};

}  // namespace detail
}  // namespace reward
MRR_NAMESPACE_END
#endif  // CPPHTTPLIB_OPENSSL_SUPPORT
