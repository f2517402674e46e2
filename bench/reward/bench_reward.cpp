// Load test of the reward router on loopback: 20,000 requests from 64 concurrent keep-alive
// clients, through the proxy and, as the baseline, straight to the same kind of worker, in one run.
// The cases take turns for a few rounds and each reports its median round, so that load from
// elsewhere on a small machine biases no case. Bounded: it stops once the requests are done
// (each has a 30 s read timeout).
//   bench_reward [requests] [clients] [rounds] [worker delay ms]
// With a worker delay (a sandbox or reward model takes milliseconds) and fewer clients than the
// cores can serve, the comparison is the one a trainer meets: the proxy's added latency per request.
#include <mrr/ppo/reward_rules.hpp>
#include <mrr/reward/http_proxy.hpp>
#include <mrr/reward/http_server.hpp>

#include <httplib.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

// Per-request service time of the worker beyond its scoring (a sandbox or a reward model takes
// milliseconds); 0 = the rule alone.
std::chrono::microseconds worker_delay{0};

// A light rule-based reward worker: parses the JSON body and scores a GSM8K answer.
mrr::reward::Response score(const mrr::reward::Request& request) {
  if (worker_delay.count() > 0) std::this_thread::sleep_for(worker_delay);
  const auto body = nlohmann::json::parse(request.body);
  const double s =
      mrr::ppo::compute_gsm8k_score(body.at("solution").get<std::string>(), body.at("truth").get<std::string>());
  return {200, {{"Content-Type", "application/json"}}, nlohmann::json{{"id", body.at("id")}, {"score", s}}.dump()};
}

mrr::reward::ServerOptions server_options(std::size_t threads) {
  mrr::reward::ServerOptions o;
  o.threads = threads;
  return o;
}

struct LoadResult {
  double seconds = 0;
  std::size_t requests = 0, errors = 0;
  double p50_ms = 0, p99_ms = 0;
  [[nodiscard]] double per_second() const { return static_cast<double>(requests) / seconds; }
};

// `requests` POSTs from `clients` threads, each on its own keep-alive connection.
LoadResult load(const std::string& url, std::size_t requests, std::size_t clients) {
  std::atomic<std::size_t> next{0}, errors{0};
  std::vector<std::vector<double>> latencies(clients);
  std::vector<std::thread> pool;
  const auto start = Clock::now();
  for (std::size_t c = 0; c < clients; ++c)
    pool.emplace_back([&, c] {
      httplib::Client client(url);
      client.set_keep_alive(true);
      client.set_tcp_nodelay(true);
      client.set_read_timeout(std::chrono::seconds(30));
      for (std::size_t i = next++; i < requests; i = next++) {
        const std::string body =
            R"({"id": )" + std::to_string(i) +
            R"(, "solution": "Natalia sold 48/2 = 24 clips in May. 48+24 = 72 #### 72", "truth": "72"})";
        const auto t0 = Clock::now();
        const auto r = client.Post("/score", body, "application/json");
        latencies[c].push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
        if (!r || r->status != 200) ++errors;
      }
    });
  for (auto& t : pool)
    t.join();
  LoadResult out;
  out.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  std::vector<double> all;
  for (const auto& l : latencies)
    all.insert(all.end(), l.begin(), l.end());
  std::sort(all.begin(), all.end());
  out.requests = all.size();
  out.errors = errors;
  out.p50_ms = all[all.size() / 2];
  out.p99_ms = all[std::min(all.size() - 1, all.size() * 99 / 100)];
  return out;
}

void print(const char* name, const LoadResult& r, const LoadResult& baseline) {
  std::printf("%-34s %8zu %9.2f %10.0f %9.3f %9.3f %7zu %9.2fx\n", name, r.requests, r.seconds, r.per_second(),
              r.p50_ms, r.p99_ms, r.errors, r.per_second() / baseline.per_second());
}

}  // namespace

int main(int argc, char** argv) {
  const std::size_t requests = argc > 1 ? std::strtoul(argv[1], nullptr, 10) : 20000;
  const std::size_t clients = argc > 2 ? std::strtoul(argv[2], nullptr, 10) : 64;
  const std::size_t rounds = argc > 3 ? std::strtoul(argv[3], nullptr, 10) : 3;
  const double delay_ms = argc > 4 ? std::strtod(argv[4], nullptr) : 0.0;
  if (requests == 0 || clients == 0 || rounds == 0 || !(delay_ms >= 0)) {
    std::fprintf(stderr, "usage: bench_reward [requests > 0] [clients > 0] [rounds > 0] [worker delay ms >= 0]\n");
    return 2;
  }
  worker_delay = std::chrono::microseconds(static_cast<long>(delay_ms * 1000.0));
  // Every connection holds a server thread while kept alive: room for all clients and upstreams.
  const std::size_t threads = 2 * clients + 16;

  mrr::reward::RewardServer worker1(score, server_options(threads));
  mrr::reward::RewardServer worker2(score, server_options(threads));
  mrr::reward::RouterOptions options;
  options.proxy.server = server_options(threads);
  mrr::reward::HttpRouter one({worker1.url()}, options);
  mrr::reward::HttpRouter two({worker1.url(), worker2.url()}, options);

  std::printf(
      "\n== Reward dispatch: %zu requests, %zu concurrent keep-alive clients, loopback, %u hardware threads,"
      " median of %zu rounds, worker delay %.2f ms\n",
      requests, clients, std::thread::hardware_concurrency(), rounds, delay_ms);
  const std::vector<std::string> urls{worker1.url(), one.url(), two.url()};
  for (const auto& url : urls)
    load(url, 2 * clients, clients);  // warm-up: connections, pools, caches
  std::vector<std::vector<LoadResult>> runs(urls.size());
  std::size_t errors = 0;
  for (std::size_t round = 0; round < rounds; ++round)
    for (std::size_t c = 0; c < urls.size(); ++c) {
      runs[c].push_back(load(urls[c], requests, clients));
      errors += runs[c].back().errors;
    }
  std::vector<LoadResult> median;
  for (auto& r : runs) {
    std::sort(r.begin(), r.end(),
              [](const LoadResult& a, const LoadResult& b) { return a.per_second() < b.per_second(); });
    median.push_back(r[r.size() / 2]);
  }
  std::printf("%-34s %8s %9s %10s %9s %9s %7s %10s\n", "case", "requests", "seconds", "req/s", "p50 ms", "p99 ms",
              "errors", "vs direct");
  print("direct to one worker (baseline)", median[0], median[0]);
  print("through the proxy, 1 worker", median[1], median[0]);
  print("through the proxy, 2 workers", median[2], median[0]);
  std::printf("proxy latency added at p50: %.3f ms, at p99: %.3f ms (1 worker)\n", median[1].p50_ms - median[0].p50_ms,
              median[1].p99_ms - median[0].p99_ms);
  return errors == 0 ? 0 : 1;
}
