// reward_router: a least-in-flight HTTP load balancer in front of reward workers (verl's
// naive_router, with failover, timeouts, health checks and status passthrough).
//   reward_router --port 8000 --worker http://127.0.0.1:9001 --worker http://127.0.0.1:9002
// Runs until SIGINT or SIGTERM, then finishes the requests in progress and exits 0.
#include <mrr/reward/http_proxy.hpp>

#include <csignal>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <string>
#include <string_view>
#include <vector>

namespace {

constexpr const char* usage = R"(usage: reward_router --worker URL [--worker URL ...] [options]

Forwards every HTTP request to the reward worker with the fewest requests in flight, retries
failures on another worker, and evicts workers that fail their health checks.

  --worker URL             a worker, http://host:port[/base]; repeat for more (may be none:
                           add them later with POST /_mrr/workers?url=URL)
  --host HOST              address to listen on (default 127.0.0.1)
  --port N                 port to listen on, 0 for any free one (default 8000)
  --threads N              requests handled at once (default 64)
  --max-connections N      connections open at once; more get 503 (default 1024)
  --max-body-bytes N       larger request bodies get 413 (default 67108864, 64 MiB)
  --header-timeout-ms N    a request head must arrive within this (default 10000)
  --body-timeout-ms N      a request body must arrive within this (default 60000)
  --max-attempts N         attempts per request, each on another worker (default 3)
  --attempt-timeout-ms N   one attempt on one worker (default 30000)
  --request-timeout-ms N   a whole request, retries included (default 60000)
  --backoff-ms N           pause before the first retry, doubling after (default 50)
  --max-in-flight N        cap per worker, 0 for none (default 0)
  --health-interval-ms N   health probe period, 0 to disable (default 1000)
  --health-path PATH       probed with GET (default /health)
  --sticky                 requests with the same X-Request-Id go to the same worker
  --deterministic          break ties by a hash of the body instead of the lowest index
  --admin-token TOKEN      enables the admin API; requests send "Authorization: Bearer TOKEN"
                           (16+ characters; prefer the environment variable
                           MRR_REWARD_ADMIN_TOKEN, which other users cannot read in ps)
  --admin-listen HOST:PORT serve the admin API only there (e.g. 127.0.0.1:8001)
  --allow-worker-host HOST only workers on this host may be added; repeat for more
  --help                   this text

Admin API (off without a token): GET /_mrr/workers, POST|DELETE /_mrr/workers?url=URL.
GET /_mrr/health needs no token.
)";

[[noreturn]] void bad_usage(const std::string& message) {
  std::fprintf(stderr, "reward_router: %s\n(see reward_router --help)\n", message.c_str());
  std::exit(2);
}

// "host:port" or "[v6]:port".
mrr::reward::ServerOptions listen_address(const std::string& text) {
  const auto colon = text.rfind(':');
  if (colon == std::string::npos || colon == 0) bad_usage("--admin-listen needs HOST:PORT, got '" + text + "'");
  std::string host = text.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  char* end = nullptr;
  const std::string port = text.substr(colon + 1);
  const long value = std::strtol(port.c_str(), &end, 10);
  if (port.empty() || *end != '\0' || value < 0 || value > 65535)
    bad_usage("--admin-listen needs HOST:PORT, got '" + text + "'");
  mrr::reward::ServerOptions out;
  out.host = host;
  out.port = static_cast<int>(value);
  out.threads = 4;
  out.max_connections = 64;
  return out;
}

long number(const std::string& option, const char* text) {
  char* end = nullptr;
  const long value = std::strtol(text, &end, 10);
  if (end == text || *end != '\0' || value < 0) bad_usage(option + " needs a non-negative integer, got '" + text + "'");
  return value;
}

}  // namespace

int main(int argc, char** argv) {
  using std::chrono::milliseconds;
  std::vector<std::string> workers;
  mrr::reward::RouterOptions options;
  options.proxy.server.port = 8000;
  long health_interval_ms = 1000;
  if (const char* token = std::getenv("MRR_REWARD_ADMIN_TOKEN")) options.proxy.admin_token = token;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::fputs(usage, stdout);
      return 0;
    }
    if (arg == "--sticky") {
      options.dispatch.sticky_sessions = true;
      continue;
    }
    if (arg == "--deterministic") {
      options.dispatch.tie_break = mrr::reward::TieBreak::body_hash;
      continue;
    }
    if (i + 1 >= argc) bad_usage("unknown option or missing value: " + arg);
    const char* value = argv[++i];
    if (arg == "--worker")
      workers.emplace_back(value);
    else if (arg == "--host")
      options.proxy.server.host = value;
    else if (arg == "--port")
      options.proxy.server.port = static_cast<int>(number(arg, value));
    else if (arg == "--threads")
      options.proxy.server.threads = static_cast<std::size_t>(number(arg, value));
    else if (arg == "--max-connections")
      options.proxy.server.max_connections = static_cast<std::size_t>(number(arg, value));
    else if (arg == "--max-body-bytes")
      options.proxy.server.max_body_bytes = static_cast<std::uint64_t>(number(arg, value));
    else if (arg == "--header-timeout-ms")
      options.proxy.server.header_timeout = milliseconds(number(arg, value));
    else if (arg == "--body-timeout-ms")
      options.proxy.server.body_timeout = milliseconds(number(arg, value));
    else if (arg == "--admin-token")
      options.proxy.admin_token = value;
    else if (arg == "--admin-listen")
      options.proxy.admin_server = listen_address(value);
    else if (arg == "--allow-worker-host")
      options.proxy.worker_policy.allowed_hosts.emplace_back(value);
    else if (arg == "--max-attempts")
      options.dispatch.max_attempts = static_cast<int>(number(arg, value));
    else if (arg == "--attempt-timeout-ms")
      options.dispatch.attempt_timeout = milliseconds(number(arg, value));
    else if (arg == "--request-timeout-ms")
      options.dispatch.request_timeout = milliseconds(number(arg, value));
    else if (arg == "--backoff-ms")
      options.dispatch.backoff_initial = milliseconds(number(arg, value));
    else if (arg == "--max-in-flight")
      options.dispatch.max_in_flight_per_worker = static_cast<std::size_t>(number(arg, value));
    else if (arg == "--health-interval-ms")
      health_interval_ms = number(arg, value);
    else if (arg == "--health-path")
      options.transport.health_path = value;
    else
      bad_usage("unknown option: " + arg);
  }
  if (health_interval_ms == 0)
    options.health.reset();
  else
    options.health->interval = milliseconds(health_interval_ms);

  // Block the stop signals before any thread starts, so that only sigwait below receives them.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  try {
    mrr::reward::HttpRouter router(workers, options);
    std::printf("reward_router: listening on %s with %zu worker(s)\n", router.url().c_str(), workers.size());
    if (options.proxy.admin_server) std::printf("reward_router: admin API on %s\n", router.admin_url().c_str());
    std::fflush(stdout);
    int received = 0;
    sigwait(&stop_signals, &received);
    std::fprintf(stderr, "reward_router: signal %d, stopping\n", received);
    router.stop();
  } catch (const mrr::InvalidArgument& e) {
    bad_usage(e.what());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "reward_router: %s\n", e.what());
    return 1;
  }
  return 0;
}
