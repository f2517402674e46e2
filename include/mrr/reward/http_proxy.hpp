// The reward router as an HTTP service (cpp-httplib): a proxy that forwards every request to the
// worker the dispatcher picks, and HttpRouter, which bundles dispatcher, transport, health checks
// and proxy. Error bodies and the admin API are JSON (nlohmann-json, Debian nlohmann-json3-dev).
// mrr-requires: mrr_reward_http
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>
#include <mrr/reward/dispatcher.hpp>
#include <mrr/reward/health.hpp>
#include <mrr/reward/http_server.hpp>
#include <mrr/reward/http_transport.hpp>
#include <mrr/reward/request_checks.hpp>
#include <mrr/reward/transport.hpp>

#include <httplib.h>
#include <nlohmann/json.hpp>

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

MRR_NAMESPACE_BEGIN
namespace reward {

struct ProxyOptions {
  ServerOptions server;
  // Header whose value is the sticky-session key (when the dispatcher has sticky_sessions on).
  std::string session_header = "X-Request-Id";
  // Admin API under this prefix (empty: none): GET <prefix>/workers lists the workers,
  // POST <prefix>/workers?url=U (or a JSON body {"url": U}) adds one, DELETE <prefix>/workers?url=U
  // removes one; GET <prefix>/health answers 200 while some worker is healthy, else 503.
  std::string admin_prefix = "/_mrr";
  // <prefix>/workers (every method, listing included) needs "Authorization: Bearer <admin_token>",
  // compared in constant time. Empty: the admin API is off (403); <prefix>/health is always served.
  // At least 16 characters.
  std::string admin_token;
  // When set, <prefix>/workers is served only on this address (e.g. a loopback port that the
  // trainers' network cannot reach), and answers 404 on the proxy's own.
  std::optional<ServerOptions> admin_server;
  // Which worker URLs the admin API (and HttpRouter's initial list) accept.
  WorkerUrlPolicy worker_policy;
};

namespace detail {

inline nlohmann::json to_json(const WorkerStats& s) {
  return {{"url", s.address},          {"healthy", s.healthy},     {"in_flight", s.in_flight},
          {"attempts", s.attempts},    {"successes", s.successes}, {"failures", s.failures},
          {"cut_short", s.cut_short},  {"evictions", s.evictions}, {"consecutive_failures", s.consecutive_failures},
          {"last_error", s.last_error}};
}

inline void set_json(httplib::Response& out, int status, const nlohmann::json& body) {
  out.status = status;
  // Error texts may quote a worker's bytes; replace invalid UTF-8 rather than throw.
  out.set_content(body.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace), "application/json");
}

}  // namespace detail

// Forwards method, target (path and query string), body and end-to-end headers; relays the
// worker's status, headers and body. When no worker answers: 503 (none available), 502 (every
// attempt failed) or 504 (request timeout), each with a JSON body {"error", "detail", ...}.
// Every response carries X-Mrr-Attempts, and X-Mrr-Worker once a worker was tried.
template <ClockSource Clock = SteadyClock>
class BasicHttpProxy {
 public:
  // Starts serving at once; the dispatcher and transport must outlive the proxy.
  BasicHttpProxy(BasicDispatcher<Clock>& dispatcher, HttpTransport& transport, ProxyOptions options = {})
      : dispatcher_(dispatcher), transport_(transport), options_(validated(std::move(options))) {
    start(server_, runner_, options_.server, /*admin_listener=*/false);
    if (options_.admin_server) start(admin_server_, admin_runner_, *options_.admin_server, /*admin_listener=*/true);
  }
  BasicHttpProxy(const BasicHttpProxy&) = delete;
  BasicHttpProxy& operator=(const BasicHttpProxy&) = delete;
  ~BasicHttpProxy() { stop(); }

  [[nodiscard]] int port() const noexcept { return runner_.port(); }
  [[nodiscard]] std::string url() const { return detail::url_of(options_.server.host, port()); }
  // The admin listener's port and URL, when ProxyOptions::admin_server is set (else -1 / the proxy's URL).
  [[nodiscard]] int admin_port() const noexcept { return options_.admin_server ? admin_runner_.port() : port(); }
  [[nodiscard]] std::string admin_url() const {
    return options_.admin_server ? detail::url_of(options_.admin_server->host, admin_port()) : url();
  }
  // Stops accepting and waits for requests in progress. Idempotent.
  void stop() {
    runner_.stop();
    admin_runner_.stop();
  }

 private:
  static ProxyOptions validated(ProxyOptions o) {
    mrr::detail::require(o.admin_token.empty() || o.admin_token.size() >= 16, "reward::ProxyOptions",
                         "admin_token must have at least 16 characters, got ", o.admin_token.size());
    for (const char c : o.admin_token)
      mrr::detail::require(c > 0x20 && c < 0x7f, "reward::ProxyOptions",
                           "admin_token must be visible ASCII (it is sent in an HTTP header)");
    return o;
  }

  void start(detail::Server& server, detail::ServerThread& runner, const ServerOptions& options, bool admin_listener) {
    server.serve([this, admin_listener](const httplib::Request& in, Request&& request, httplib::Response& out) {
      handle(in, std::move(request), out, admin_listener);
    });
    server.set_exception_handler([](const httplib::Request&, httplib::Response& out, std::exception_ptr ep) {
      std::string what = "unknown exception";
      try {
        if (ep) std::rethrow_exception(ep);
      } catch (const std::exception& e) {
        what = e.what();
      } catch (...) {
      }
      detail::set_json(out, 500, {{"error", "proxy_exception"}, {"detail", what}});
    });
    runner.start(server, options);
  }

  void handle(const httplib::Request& in, Request&& request, httplib::Response& out, bool admin_listener) {
    const std::string& prefix = options_.admin_prefix;
    const bool admin_path = !prefix.empty() && in.path.size() > prefix.size() && in.path.starts_with(prefix) &&
                            in.path[prefix.size()] == '/';
    if (admin_path || admin_listener) {
      if (!admin_path)
        detail::set_json(out, 404, {{"error", "not_found"}, {"detail", "this address serves the admin API only"}});
      else
        admin(std::string_view(in.path).substr(prefix.size()), in, request, out, admin_listener);
      return;
    }
    if (!in.remote_addr.empty()) {
      // Every X-Forwarded-For field the client sent, in order (a list split over several fields
      // is one list, RFC 9110 §5.3), then the client's address: one field.
      std::string forwarded;
      for (const auto& [name, value] : request.headers)
        if (detail::iequals(name, "X-Forwarded-For") && !value.empty())
          forwarded.append(forwarded.empty() ? "" : ", ").append(value);
      std::erase_if(request.headers, [](const auto& h) { return detail::iequals(h.first, "X-Forwarded-For"); });
      request.headers.emplace_back("X-Forwarded-For",
                                   forwarded.empty() ? in.remote_addr : forwarded + ", " + in.remote_addr);
    }
    if (dispatcher_.options().sticky_sessions && !options_.session_header.empty())
      request.session = std::string(header_value(request.headers, options_.session_header));

    DispatchResult result = dispatcher_.dispatch(transport_, request);
    request.body = std::string();  // the request's memory goes before the response is written
    if (result.outcome == Outcome::answered) {
      detail::write_response(std::move(result.response), out, request.method == "HEAD");
    } else {
      nlohmann::json body{
          {"error", to_string(result.outcome)}, {"detail", result.error}, {"attempts", result.attempts}};
      if (!result.worker.empty()) body["last_worker"] = result.worker;
      if (result.last_status != 0) body["last_status"] = result.last_status;
      detail::set_json(out, result.http_status(), body);
    }
    out.headers.erase("X-Mrr-Attempts");  // a worker that is itself a router: report this hop
    out.headers.erase("X-Mrr-Worker");
    out.set_header("X-Mrr-Attempts", std::to_string(result.attempts));
    if (!result.worker.empty()) out.set_header("X-Mrr-Worker", result.worker);
  }

  void admin(std::string_view path, const httplib::Request& in, const Request& request, httplib::Response& out,
             bool admin_listener) {
    if (path != "/health") {
      // Authenticate before looking at anything else the client sent.
      if (options_.admin_server && !admin_listener) {
        detail::set_json(out, 404, {{"error", "not_found"}, {"detail", "the admin API is served on its own address"}});
        return;
      }
      if (options_.admin_token.empty()) {
        detail::set_json(out, 403,
                         {{"error", "admin_disabled"},
                          {"detail", "the admin API is off: start the router with an admin token "
                                     "(--admin-token or MRR_REWARD_ADMIN_TOKEN)"}});
        return;
      }
      if (!bearer_token_matches(header_value(request.headers, "Authorization"), options_.admin_token)) {
        detail::set_json(out, 401,
                         {{"error", "unauthorized"}, {"detail", "send Authorization: Bearer <admin token>"}});
        out.set_header("WWW-Authenticate", "Bearer");
        return;
      }
    }
    std::optional<std::string> url_param;
    if (in.has_param("url")) url_param = in.get_param_value("url");
    auto parsed = parse_admin_command(in.method, path, url_param ? std::optional<std::string_view>(*url_param)
                                                                 : std::nullopt,
                                      request.body, options_.worker_policy);
    if (const auto* rejection = std::get_if<RequestRejection>(&parsed)) {
      detail::set_rejection(out, *rejection);
      return;
    }
    const AdminCommand& command = std::get<AdminCommand>(parsed);
    switch (command.kind) {
      case AdminCommand::Kind::health: {
        std::size_t healthy = 0;
        for (const auto& s : dispatcher_.stats())
          healthy += s.healthy ? 1 : 0;
        detail::set_json(out, healthy > 0 ? 200 : 503, {{"healthy_workers", healthy}});
        return;
      }
      case AdminCommand::Kind::list: {
        nlohmann::json workers = nlohmann::json::array();
        for (const auto& s : dispatcher_.stats())
          workers.push_back(detail::to_json(s));
        detail::set_json(out, 200, {{"workers", workers}, {"in_flight", dispatcher_.in_flight()}});
        return;
      }
      case AdminCommand::Kind::add:
        try {
          dispatcher_.add_worker(command.url);
        } catch (const InvalidArgument& e) {
          detail::set_json(out, 400, {{"error", "bad_request"}, {"detail", e.what()}});
          return;
        }
        detail::set_json(out, 201, {{"added", command.url}});
        return;
      case AdminCommand::Kind::remove:
        if (!dispatcher_.remove_worker(command.url)) {
          detail::set_json(out, 404, {{"error", "not_found"}, {"detail", "no such worker: " + command.url}});
          return;
        }
        transport_.forget(command.url);
        detail::set_json(out, 200, {{"removed", command.url}});
        return;
    }
  }

  BasicDispatcher<Clock>& dispatcher_;
  HttpTransport& transport_;
  const ProxyOptions options_;
  detail::Server server_;
  detail::Server admin_server_;
  detail::ServerThread runner_;        // after the servers: stopped before they are destroyed
  detail::ServerThread admin_runner_;
};

using HttpProxy = BasicHttpProxy<>;

struct RouterOptions {
  DispatchOptions dispatch;
  HttpTransportOptions transport;
  ProxyOptions proxy;
  std::optional<HealthOptions> health = HealthOptions{};  // nullopt: no active health checks
};

// Everything a reward router needs, owned together and started at construction: a dispatcher over
// `workers` (checked with check_worker_url and the proxy's worker_policy), the HTTP transport, health checks and the proxy.
class HttpRouter {
 public:
  HttpRouter(const std::vector<std::string>& workers, RouterOptions options = {})
      : dispatcher_(checked(workers, options.proxy.worker_policy), std::move(options.dispatch)),
        transport_(std::move(options.transport)) {
    if (options.health)
      monitor_ = std::make_unique<HealthMonitor<HttpTransport, SteadyClock>>(dispatcher_, transport_, *options.health);
    proxy_ = std::make_unique<HttpProxy>(dispatcher_, transport_, std::move(options.proxy));
  }

  [[nodiscard]] Dispatcher& dispatcher() noexcept { return dispatcher_; }
  [[nodiscard]] HttpTransport& transport() noexcept { return transport_; }
  [[nodiscard]] int port() const noexcept { return proxy_->port(); }
  [[nodiscard]] std::string url() const { return proxy_->url(); }
  [[nodiscard]] int admin_port() const noexcept { return proxy_->admin_port(); }
  [[nodiscard]] std::string admin_url() const { return proxy_->admin_url(); }

  // Stops the proxy (waiting for requests in progress), then the health checks. Idempotent.
  void stop() {
    proxy_->stop();
    if (monitor_) monitor_->stop();
  }

 private:
  static const std::vector<std::string>& checked(const std::vector<std::string>& workers,
                                                const WorkerUrlPolicy& policy) {
    for (const auto& w : workers)
      check_worker_url(w, policy);
    return workers;
  }

  Dispatcher dispatcher_;
  HttpTransport transport_;
  std::unique_ptr<HealthMonitor<HttpTransport, SteadyClock>> monitor_;
  std::unique_ptr<HttpProxy> proxy_;  // last: destroyed (stopped) first
};

}  // namespace reward
MRR_NAMESPACE_END
