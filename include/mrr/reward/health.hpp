// Active health checks: a background thread probes every worker (evicted ones included) at a fixed
// interval and reports to the dispatcher, which evicts failing workers and re-admits recovered ones.
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>
#include <mrr/reward/dispatcher.hpp>
#include <mrr/reward/transport.hpp>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <stop_token>
#include <string>
#include <thread>

MRR_NAMESPACE_BEGIN
namespace reward {

struct HealthOptions {
  Duration interval = std::chrono::seconds(1);  // between the starts of two rounds of probes
  Duration timeout = std::chrono::seconds(1);   // for one probe of one worker
};

// Probes run one worker after another on the monitor's thread, so a hung worker delays a round by
// at most `timeout` (the probe must bound itself: HttpTransport bounds the whole probe, not each
// socket call). Destruction stops the thread and waits for the current probe.
template <HealthProbe Probe, ClockSource Clock>
class HealthMonitor {
 public:
  // Starts the background thread unless `start` is false (tests then call check_now()).
  HealthMonitor(BasicDispatcher<Clock>& dispatcher, Probe& probe, HealthOptions options = {}, bool start = true)
      : dispatcher_(dispatcher), probe_(probe), options_(options) {
    mrr::detail::require(options_.interval > Duration::zero() && options_.timeout > Duration::zero(),
                         "reward::HealthMonitor", "interval and timeout must be positive");
    if (start) thread_ = std::jthread([this](std::stop_token stop) { run(stop); });
  }
  HealthMonitor(const HealthMonitor&) = delete;
  HealthMonitor& operator=(const HealthMonitor&) = delete;
  ~HealthMonitor() { stop(); }

  // One round: probes every registered worker now and reports the verdicts.
  void check_now() { check_round(std::stop_token{}); }

  void stop() {
    if (!thread_.joinable()) return;
    thread_.request_stop();
    wake_.notify_all();
    thread_.join();
  }

 private:
  // A stop request ends the round after the current probe, so that shutting down waits for one
  // probe (at most `timeout` with a probe that bounds itself, as HttpTransport does), not a round.
  void check_round(const std::stop_token& stop) {
    for (const std::string& worker : dispatcher_.addresses()) {
      if (stop.stop_requested()) return;
      bool healthy = false;
      try {
        healthy = static_cast<bool>(probe_.check_health(worker, options_.timeout));
      } catch (...) {
        healthy = false;  // a probe that throws is a failed probe
      }
      dispatcher_.report_health(worker, healthy);
    }
  }

  // Rounds start `interval` apart (a round longer than that is followed by the next at once).
  void run(std::stop_token stop) {
    while (!stop.stop_requested()) {
      const auto start = std::chrono::steady_clock::now();
      check_round(stop);
      std::unique_lock lock(mutex_);
      wake_.wait_until(lock, stop, start + options_.interval, [] { return false; });
    }
  }

  BasicDispatcher<Clock>& dispatcher_;
  Probe& probe_;
  const HealthOptions options_;
  std::mutex mutex_;
  std::condition_variable_any wake_;
  std::jthread thread_;  // last: joined before the members it uses are destroyed
};

}  // namespace reward
MRR_NAMESPACE_END
