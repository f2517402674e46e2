// reward_router: a least-in-flight HTTP load balancer in front of reward workers (verl's
// naive_router, with failover, timeouts, health checks and status passthrough).
//   reward_router --port 8000 --worker http://127.0.0.1:9001 --worker http://127.0.0.1:9002
// Runs until SIGINT or SIGTERM, then finishes the requests in progress and exits 0.
#include <mrr/reward/http_proxy.hpp>

#include <cerrno>
#include <chrono>
#include <climits>
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
  --threads N              requests handled at once, at most 4096 (default 64)
  --max-connections N      connections open at once; more get 503 (default 1024)
  --max-body-bytes N       larger request bodies get 413 (default 67108864, 64 MiB)
  --max-body-bytes-in-flight N
                           request bodies held at once, in bytes received; a request that
                           would pass it gets 503 (default 1073741824, 1 GiB)
  --max-response-bytes N   a larger worker response is abandoned, the client gets 502
                           (default 67108864, 64 MiB)
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

// A decimal integer in [0, max]; anything else (a sign, junk, a value strtoull would clamp) is an
// error naming the option.
std::uint64_t number(const std::string& option, const char* text, std::uint64_t max = INT64_MAX) {
  const std::string_view digits(text);
  if (digits.empty() || digits.size() > 20 || digits.find_first_not_of("0123456789") != std::string_view::npos)
    bad_usage(option + " needs a non-negative integer, got '" + text + "'");
  errno = 0;
  const unsigned long long value = std::strtoull(text, nullptr, 10);
  if (errno == ERANGE || value > max)
    bad_usage(option + " is out of range: '" + text + "' (at most " + std::to_string(max) + ")");
  return value;
}

// Milliseconds, at most a year (a longer timeout would overflow the clock's nanoseconds).
std::chrono::milliseconds millis(const std::string& option, const char* text) {
  return std::chrono::milliseconds(number(option, text, 365ull * 24 * 3600 * 1000));
}

}  // namespace

int main(int argc, char** argv) {
  using std::chrono::milliseconds;
  std::vector<std::string> workers;
  mrr::reward::RouterOptions options;
  options.proxy.server.port = 8000;
  milliseconds health_interval(1000);
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
      options.proxy.server.port = static_cast<int>(number(arg, value, 65535));
    else if (arg == "--threads")
      options.proxy.server.threads = static_cast<std::size_t>(number(arg, value, 4096));
    else if (arg == "--max-connections")
      options.proxy.server.max_connections = static_cast<std::size_t>(number(arg, value));
    else if (arg == "--max-body-bytes")
      options.proxy.server.max_body_bytes = number(arg, value);
    else if (arg == "--max-body-bytes-in-flight")
      options.proxy.server.max_buffered_body_bytes = number(arg, value);
    else if (arg == "--max-response-bytes")
      options.transport.max_response_bytes = number(arg, value);
    else if (arg == "--header-timeout-ms")
      options.proxy.server.header_timeout = millis(arg, value);
    else if (arg == "--body-timeout-ms")
      options.proxy.server.body_timeout = millis(arg, value);
    else if (arg == "--admin-token")
      options.proxy.admin_token = value;
    else if (arg == "--admin-listen")
      options.proxy.admin_server = listen_address(value);
    else if (arg == "--allow-worker-host")
      options.proxy.worker_policy.allowed_hosts.emplace_back(value);
    else if (arg == "--max-attempts")
      options.dispatch.max_attempts = static_cast<int>(number(arg, value, INT_MAX));
    else if (arg == "--attempt-timeout-ms")
      options.dispatch.attempt_timeout = millis(arg, value);
    else if (arg == "--request-timeout-ms")
      options.dispatch.request_timeout = millis(arg, value);
    else if (arg == "--backoff-ms")
      options.dispatch.backoff_initial = millis(arg, value);
    else if (arg == "--max-in-flight")
      options.dispatch.max_in_flight_per_worker = static_cast<std::size_t>(number(arg, value));
    else if (arg == "--health-interval-ms")
      health_interval = millis(arg, value);
    else if (arg == "--health-path")
      options.transport.health_path = value;
    else
      bad_usage("unknown option: " + arg);
  }
  if (health_interval == milliseconds::zero())
    options.health.reset();
  else
    options.health->interval = health_interval;
  const auto& server = options.proxy.server;
  if (server.max_body_bytes > server.max_buffered_body_bytes)
    bad_usage("--max-body-bytes (" + std::to_string(server.max_body_bytes) + ") is over --max-body-bytes-in-flight (" +
              std::to_string(server.max_buffered_body_bytes) + "): such a body could never be accepted");

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
