// HTTP transport for the reward dispatcher: sends one attempt to one worker URL over a pooled
// keep-alive connection within a time budget (the whole exchange, not each socket call), and
// probes a worker's health endpoint. The HTTP/1.1 client is mrr's own (http_client.hpp).
// mrr-requires: mrr_reward_http
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/detail/str.hpp>
#include <mrr/error.hpp>
#include <mrr/reward/detail/tls_transport.hpp>
#include <mrr/reward/http_client.hpp>
#include <mrr/reward/request_checks.hpp>
#include <mrr/reward/transport.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

MRR_NAMESPACE_BEGIN
namespace reward {

namespace detail {

// Idle keep-alive connections of one worker; an attempt takes one for itself and returns it.
struct Endpoint {
  explicit Endpoint(WorkerUrl u) : url(std::move(u)) {}
  WorkerUrl url;
  std::mutex mutex;
  std::vector<Socket> idle;
};

}  // namespace detail

// Thread-safe; satisfies Transport and HealthProbe. Workers are URLs (parse_worker_url).
class HttpTransport {
 public:
  explicit HttpTransport(HttpTransportOptions options = {}) : options_(validated(std::move(options))) {}

  Reply send(std::string_view worker, const Request& request, Duration timeout) {
    std::shared_ptr<detail::Endpoint> ep;
    try {
      ep = endpoint(worker);
    } catch (const InvalidArgument& e) {
      return Reply::failed(Failure::connect, e.what());
    }
    if (timeout <= Duration::zero())  // nothing is sent: no connection, no request the worker would run
      return Reply::failed(Failure::timeout,
                           mrr::detail::str("the attempt's budget is ",
                                            std::chrono::duration_cast<std::chrono::milliseconds>(timeout).count(),
                                            " ms: nothing was sent"));
#ifdef CPPHTTPLIB_OPENSSL_SUPPORT
    if (ep->url.scheme == "https") return tls_.send(worker, request, timeout);
#endif
    auto head = detail::request_head(ep->url, request, request.target);
    if (auto* e = std::get_if<detail::ClientError>(&head)) return Reply::failed(e->failure, std::move(e->message));
    const auto start = std::chrono::steady_clock::now();
    const auto deadline = detail::saturating_add(start, timeout);
    // A pooled connection the worker closed while it sat idle fails before any answer: the
    // request goes once more, on a fresh connection, when the worker cannot have processed it
    // (not all of it was sent, or its method is idempotent; ClientError::stale).
    for (int round = 0;; ++round) {
      detail::Socket connection = round == 0 ? take_idle(*ep) : detail::Socket{};
      const bool reused = connection.get() >= 0;
      if (!reused) {
        auto made =
            detail::connect_to(ep->url, std::min(deadline, detail::saturating_add(start, options_.connect_timeout)));
        if (auto* e = std::get_if<detail::ClientError>(&made)) return Reply::failed(e->failure, std::move(e->message));
        connection = std::move(std::get<detail::Socket>(made));
      }
      detail::HttpExchange exchange(connection.get(), deadline, options_.max_response_bytes);
      auto got = exchange.run(std::get<std::string>(head), request.body, request.method == "HEAD", timeout,
                              detail::idempotent_method(request.method));
      if (auto* e = std::get_if<detail::ClientError>(&got)) {
        if (reused && e->stale) continue;
        return Reply::failed(e->failure, std::move(e->message));
      }
      auto& in = std::get<detail::ClientResponse>(got);
      if (in.reusable) give_back(*ep, std::move(connection));
      Response response;
      response.status = in.status;
      response.headers = std::move(in.headers);
      response.body = std::move(in.body);
      return Reply::from(std::move(response));
    }
  }

  // GET <base>/<health_path> on a fresh connection (a pooled one may be stale); 2xx is healthy.
  // The whole probe, not each socket call, is bounded by `timeout`.
  bool check_health(std::string_view worker, Duration timeout) {
    std::shared_ptr<detail::Endpoint> ep;
    try {
      ep = endpoint(worker);
    } catch (const InvalidArgument&) {
      return false;
    }
#ifdef CPPHTTPLIB_OPENSSL_SUPPORT
    if (ep->url.scheme == "https") return tls_.check_health(worker, timeout);
#endif
    const auto start = std::chrono::steady_clock::now();
    const auto deadline = detail::saturating_add(start, timeout);
    Request probe;  // the connection is closed after the answer, whatever the worker says
    probe.method = "GET";
    auto head = detail::request_head(ep->url, probe, options_.health_path);
    if (!std::holds_alternative<std::string>(head)) return false;
    auto made =
        detail::connect_to(ep->url, std::min(deadline, detail::saturating_add(start, options_.connect_timeout)));
    if (!std::holds_alternative<detail::Socket>(made)) return false;
    const auto& connection = std::get<detail::Socket>(made);
    detail::HttpExchange exchange(connection.get(), deadline, options_.max_response_bytes);
    const auto got = exchange.run(std::get<std::string>(head), {}, false, timeout);
    const auto* in = std::get_if<detail::ClientResponse>(&got);
    return in != nullptr && in->status >= 200 && in->status < 300;
  }

  // Closes the idle connections to a worker (e.g. once it is removed from the dispatcher).
  void forget(std::string_view worker) {
    {
      std::lock_guard lock(mutex_);
      endpoints_.erase(std::string(worker));
    }
#ifdef CPPHTTPLIB_OPENSSL_SUPPORT
    tls_.forget(worker);
#endif
  }

  [[nodiscard]] const HttpTransportOptions& options() const noexcept { return options_; }

 private:
  static HttpTransportOptions validated(HttpTransportOptions o) {
    mrr::detail::require(o.max_response_bytes >= 1, "reward::HttpTransportOptions", "max_response_bytes must be >= 1");
    return o;
  }

  std::shared_ptr<detail::Endpoint> endpoint(std::string_view worker) {
    std::lock_guard lock(mutex_);
    auto it = endpoints_.find(std::string(worker));
    if (it == endpoints_.end())
      it = endpoints_.emplace(std::string(worker), std::make_shared<detail::Endpoint>(parse_worker_url(worker))).first;
    return it->second;
  }

  // An idle connection still open, or none.
  static detail::Socket take_idle(detail::Endpoint& ep) {
    std::lock_guard lock(ep.mutex);
    while (!ep.idle.empty()) {
      detail::Socket s = std::move(ep.idle.back());
      ep.idle.pop_back();
      if (detail::idle_connection_open(s.get())) return s;
    }
    return {};
  }

  void give_back(detail::Endpoint& ep, detail::Socket connection) {
    std::lock_guard lock(ep.mutex);
    if (ep.idle.size() < options_.max_idle_connections) ep.idle.push_back(std::move(connection));
  }

  const HttpTransportOptions options_;
  std::mutex mutex_;
  std::unordered_map<std::string, std::shared_ptr<detail::Endpoint>> endpoints_;
#ifdef CPPHTTPLIB_OPENSSL_SUPPORT
  detail::TlsTransport tls_{options_};  // https:// workers
#endif
};

}  // namespace reward
MRR_NAMESPACE_END
