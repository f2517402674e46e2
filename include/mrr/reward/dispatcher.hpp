// Least-in-flight dispatch of reward requests to a changing set of workers, independent of the
// transport: selection, stickiness, RAII release, retries with backoff, timeouts, caps, health.
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>
#include <mrr/reward/transport.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

// xxHash (libxxhash-dev), header-only: its XXH3 value is fixed by the format specification, so
// the deterministic tie-break picks the same worker on every platform and every run.
#include <mrr/detail/xxhash.hpp>

MRR_NAMESPACE_BEGIN
namespace reward {

// How to choose among workers with equally few requests in flight.
enum class TieBreak {
  lowest_index,  // the earliest-added worker
  body_hash,     // XXH3 of the request body: the same body goes to the same worker across runs
};

struct DispatchOptions {
  TieBreak tie_break = TieBreak::lowest_index;
  bool sticky_sessions = false;                              // requests with the same Request::session go to one worker
  // Sessions remembered (the least recently used are forgotten), ~100 bytes each however long the id.
  std::size_t sticky_capacity = 65536;
  std::size_t max_in_flight_per_worker = 0;                  // 0: no cap; otherwise excess requests wait for room
  int max_attempts = 3;                                      // attempts per request, each on another worker if any
  Duration backoff_initial = std::chrono::milliseconds(50);  // pause before the 2nd attempt
  double backoff_multiplier = 2.0;                           // growth per further attempt
  Duration backoff_max = std::chrono::seconds(2);
  Duration attempt_timeout = std::chrono::seconds(30);  // one attempt on one worker
  Duration request_timeout = std::chrono::seconds(60);  // the whole request, waits and retries included
  // Answers counted as the worker's failure (and retried elsewhere). Not 500 by default: a reward
  // function that throws on one malformed input answers 500 on every worker, and counting it would
  // evict them all (verl's router neither retries nor evicts on an HTTP error).
  std::vector<int> retry_statuses{502, 503, 504};
  int failures_to_evict = 3;                            // consecutive failures (requests or health probes) that evict
  int successes_to_readmit = 2;  // consecutive good health probes that re-admit an evicted worker
  // An evicted worker is re-admitted on probation after this long even without a health probe
  // (one more failure evicts it again), so a dispatcher without HealthMonitor cannot starve. It
  // counts from the eviction or from the worker's last failed probe, so a worker whose probes keep
  // failing stays out. Zero: only health probes re-admit.
  Duration readmit_after = std::chrono::seconds(10);
};

// A snapshot of one worker, for monitoring and tests.
struct WorkerStats {
  std::string address;
  std::size_t in_flight = 0;
  bool healthy = true;  // false: evicted, receives no requests
  int consecutive_failures = 0;
  std::uint64_t attempts = 0;  // attempts dispatched to it: successes + failures + cut_short
  std::uint64_t successes = 0;
  std::uint64_t failures = 0;
  std::uint64_t cut_short = 0;  // attempts the request's own deadline ended, counted neither way
  std::uint64_t evictions = 0;
  std::string last_error;
};

// How a dispatched request ended.
enum class Outcome {
  answered,   // a worker answered (the response may still be a non-retryable 4xx/5xx)
  no_worker,  // no worker could take it: none registered, all evicted, or all at their cap
  failed,     // every attempt failed
  timed_out,  // the request deadline passed
};

constexpr std::string_view to_string(Outcome outcome) noexcept {
  switch (outcome) {
    case Outcome::answered:
      return "answered";
    case Outcome::no_worker:
      return "no_worker";
    case Outcome::failed:
      return "failed";
    case Outcome::timed_out:
      return "timed_out";
  }
  return "unknown";
}

struct DispatchResult {
  Outcome outcome = Outcome::no_worker;
  Response response;   // the worker's response when answered
  std::string error;   // otherwise why: the reason no worker was free, or the last attempt's error
  std::string worker;  // the worker that answered, or the last one tried
  int attempts = 0;
  int last_status = 0;  // the last retryable status a worker answered with, 0 if none

  // The status an HTTP proxy returns: the worker's own, or 503 / 502 / 504.
  [[nodiscard]] int http_status() const noexcept {
    switch (outcome) {
      case Outcome::answered:
        return response.status;
      case Outcome::no_worker:
        return 503;
      case Outcome::failed:
        return 502;
      case Outcome::timed_out:
        return 504;
    }
    return 500;
  }
};

namespace detail {

// Guarded by the dispatcher's mutex; shared with leases so a worker removed while requests are
// in flight still has somewhere to release them.
struct WorkerState {
  explicit WorkerState(std::string a) : address(std::move(a)) {}
  std::string address;
  std::size_t in_flight = 0;
  bool healthy = true;
  bool removed = false;
  int consecutive_failures = 0;
  int consecutive_probe_successes = 0;
  TimePoint evicted_at{};
  std::uint64_t attempts = 0, successes = 0, failures = 0, cut_short = 0, evictions = 0;
  std::string last_error;
};

inline std::uint64_t body_hash(std::string_view body) noexcept {
  return XXH3_64bits(body.data(), body.size());
}

// A sticky session as the dispatcher remembers it: the XXH3-128 of the client's key, so that every
// remembered session costs the same few bytes however long the key is (65,536 ids of 8 KB would
// otherwise be 1 GB). Two keys share a pin only if their 128-bit hashes collide.
struct SessionKey {
  std::uint64_t low = 0;
  std::uint64_t high = 0;
  bool operator==(const SessionKey&) const = default;
};

struct SessionKeyHash {
  std::size_t operator()(const SessionKey& k) const noexcept { return static_cast<std::size_t>(k.low ^ k.high); }
};

inline SessionKey session_key(std::string_view session) noexcept {
  const XXH128_hash_t h = XXH3_128bits(session.data(), session.size());
  return {h.low64, h.high64};
}

inline std::string excerpt(std::string_view text, std::size_t limit = 256) {
  if (text.size() <= limit) return std::string(text);
  return mrr::detail::str(text.substr(0, limit), "...");
}

inline std::string format_duration(Duration d) {
  return mrr::detail::str(std::chrono::duration_cast<std::chrono::milliseconds>(d).count(), " ms");
}

}  // namespace detail

// Thread-safe. Workers are identified by their address (any string the transport understands);
// their order of addition is the index used by TieBreak::lowest_index.
template <ClockSource Clock = SteadyClock>
class BasicDispatcher {
 public:
  // The right to send one attempt to one worker; releases its in-flight slot when destroyed, on
  // every path (answer, error, timeout, exception). Report the outcome first for health tracking.
  class Lease {
   public:
    Lease() = default;
    Lease(Lease&& other) noexcept { *this = std::move(other); }
    Lease& operator=(Lease&& other) noexcept {
      if (this != &other) {
        release();
        owner_ = std::exchange(other.owner_, nullptr);
        worker_ = std::move(other.worker_);
        reason_ = std::move(other.reason_);
        reported_ = other.reported_;
      }
      return *this;
    }
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    ~Lease() { release(); }

    [[nodiscard]] explicit operator bool() const noexcept { return owner_ != nullptr; }
    // The worker's address; only for a held lease.
    [[nodiscard]] const std::string& worker() const noexcept { return worker_->address; }
    // Why no worker was available; only for an empty lease.
    [[nodiscard]] const std::string& unavailable_reason() const noexcept { return reason_; }

    void succeeded() {
      if (owner_ && !std::exchange(reported_, true)) owner_->record_success(*worker_);
    }
    void failed(std::string error) {
      if (owner_ && !std::exchange(reported_, true)) owner_->record_failure(*worker_, std::move(error));
    }
    // The attempt ended because the request's deadline left it too little time, not through the
    // worker: counted neither as a success nor as a failure (no eviction for a caller's deadline).
    void cut_short() {
      if (owner_ && !std::exchange(reported_, true)) owner_->record_cut_short(*worker_);
    }
    // Gives the slot back now rather than at destruction.
    void release() noexcept {
      if (owner_) std::exchange(owner_, nullptr)->release_slot(*worker_);
    }

   private:
    friend class BasicDispatcher;
    Lease(BasicDispatcher* owner, std::shared_ptr<detail::WorkerState> worker)
        : owner_(owner), worker_(std::move(worker)) {}
    explicit Lease(std::string reason) : reason_(std::move(reason)) {}

    BasicDispatcher* owner_ = nullptr;
    std::shared_ptr<detail::WorkerState> worker_;
    std::string reason_;
    bool reported_ = false;
  };

  explicit BasicDispatcher(DispatchOptions options = {}, Clock clock = {})
      : options_(validated(std::move(options))), clock_(std::move(clock)) {}
  BasicDispatcher(const std::vector<std::string>& workers, DispatchOptions options, Clock clock = {})
      : BasicDispatcher(std::move(options), std::move(clock)) {
    for (const auto& w : workers)
      add_worker(w);
  }
  // Leases point back here: the dispatcher stays put.
  BasicDispatcher(const BasicDispatcher&) = delete;
  BasicDispatcher& operator=(const BasicDispatcher&) = delete;

  [[nodiscard]] const DispatchOptions& options() const noexcept { return options_; }
  [[nodiscard]] Clock& clock() noexcept { return clock_; }

  // Adds a healthy worker at the end of the order; it takes requests at once.
  void add_worker(std::string address) {
    mrr::detail::require(!address.empty(), "reward::Dispatcher::add_worker", "the worker address is empty");
    {
      std::lock_guard lock(mutex_);
      mrr::detail::require(find(address) == workers_.end(), "reward::Dispatcher::add_worker", "worker '", address,
                           "' is already registered");
      workers_.push_back(std::make_shared<detail::WorkerState>(std::move(address)));
    }
    room_.notify_all();
  }

  // Removes a worker; requests already sent to it finish and release normally. False if unknown.
  bool remove_worker(std::string_view address) {
    std::lock_guard lock(mutex_);
    const auto it = find(address);
    if (it == workers_.end()) return false;
    (*it)->removed = true;
    workers_.erase(it);
    return true;
  }

  [[nodiscard]] std::vector<std::string> addresses() const {
    std::lock_guard lock(mutex_);
    std::vector<std::string> out;
    out.reserve(workers_.size());
    for (const auto& w : workers_)
      out.push_back(w->address);
    return out;
  }

  // Applies readmit_after first, so that health reports a cooled-down worker as the next request
  // would find it (a load balancer that stops sending on an unhealthy answer would otherwise never
  // see the re-admission).
  [[nodiscard]] std::vector<WorkerStats> stats() const {
    std::vector<WorkerStats> out;
    bool readmitted = false;
    {
      std::lock_guard lock(mutex_);
      readmitted = readmit_cooled_down(clock_.now());
      out.reserve(workers_.size());
      for (const auto& w : workers_)
        out.push_back({w->address, w->in_flight, w->healthy, w->consecutive_failures, w->attempts, w->successes,
                       w->failures, w->cut_short, w->evictions, w->last_error});
    }
    if (readmitted) room_.notify_all();
    return out;
  }

  [[nodiscard]] std::optional<WorkerStats> stats(std::string_view address) const {
    for (auto& s : stats())
      if (s.address == address) return s;
    return std::nullopt;
  }

  // Requests in flight on all workers, removed ones included.
  [[nodiscard]] std::size_t in_flight() const {
    std::lock_guard lock(mutex_);
    return total_in_flight_;
  }

  // A health probe's verdict (HealthMonitor calls this). A good probe counts towards re-admission
  // of an evicted worker; a bad one counts as a failure towards eviction.
  void report_health(std::string_view address, bool healthy) {
    {
      std::lock_guard lock(mutex_);
      const auto it = find(address);
      if (it == workers_.end()) return;
      detail::WorkerState& w = **it;
      if (healthy) {
        ++w.consecutive_probe_successes;
        if (!w.healthy && w.consecutive_probe_successes >= options_.successes_to_readmit) readmit(w);
      } else {
        w.consecutive_probe_successes = 0;
        // A probe that fails keeps an evicted worker out: readmit_after counts from its last
        // failed probe (time alone re-admits only workers nobody probes, or whose probes stopped).
        if (!w.healthy) w.evicted_at = clock_.now();
        count_failure(w, "health probe failed");
      }
    }
    room_.notify_all();
  }

  // Evicts or re-admits a worker by hand (an operator's decision; probes and failures still apply).
  bool set_healthy(std::string_view address, bool healthy) {
    {
      std::lock_guard lock(mutex_);
      const auto it = find(address);
      if (it == workers_.end()) return false;
      if (healthy && !(*it)->healthy) readmit(**it);
      if (!healthy && (*it)->healthy) {
        (*it)->last_error = "evicted by the operator";
        evict(**it);
      }
    }
    room_.notify_all();
    return true;
  }

  // Chooses a worker and takes one of its in-flight slots. Only workers least often in `tried` are
  // chosen (a worker at its cap included in that count, so a retry waits for it rather than going
  // back to the one that failed); waits for room while they are at their cap, until `deadline`,
  // and never leases at or after it. An empty lease says why.
  [[nodiscard]] Lease acquire(const Request& request, TimePoint deadline, const std::vector<std::string>& tried = {}) {
    std::unique_lock lock(mutex_);
    std::string reason;  // why the last look found no worker
    for (;;) {
      const TimePoint now = clock_.now();
      readmit_cooled_down(now);
      if (now >= deadline)
        return Lease(reason.empty() ? std::string("the request deadline has passed")
                                    : mrr::detail::str("the request deadline passed while waiting: ", reason));
      bool waiting_helps = false;
      if (auto chosen = choose(request, tried, reason, waiting_helps)) {
        ++chosen->in_flight;
        ++chosen->attempts;
        ++total_in_flight_;
        if (options_.sticky_sessions && !request.session.empty()) pin(request.session, chosen);
        return Lease(this, std::move(chosen));
      }
      if (!waiting_helps) return Lease(std::move(reason));
      // Sliced so that a manual clock moved by another thread is noticed without a notification.
      room_.wait_for(lock, std::min<Duration>(deadline - now, std::chrono::milliseconds(20)));
    }
  }

  // Sends `request` through `transport`: least-in-flight choice, retries on other workers with
  // exponential backoff, per-attempt and per-request timeouts. Never throws for a worker's fault.
  template <Transport T>
  DispatchResult dispatch(T& transport, const Request& request) {
    DispatchResult result;
    const TimePoint deadline = detail::saturating_add(clock_.now(), options_.request_timeout);
    std::vector<std::string> tried;
    for (int attempt = 1; attempt <= options_.max_attempts; ++attempt) {
      if (attempt > 1) {
        const Duration pause = backoff(attempt - 1);
        if (detail::saturating_add(clock_.now(), pause) >= deadline) {
          result.outcome = Outcome::timed_out;
          result.error = mrr::detail::str("request timeout of ", detail::format_duration(options_.request_timeout),
                                          " leaves no time to retry; last error: ", result.error);
          return result;
        }
        clock_.sleep_for(pause);
      }
      Lease lease = acquire(request, deadline, tried);
      if (!lease) {
        const bool late = clock_.now() >= deadline;
        if (attempt == 1) {
          result.outcome = late ? Outcome::timed_out : Outcome::no_worker;
          result.error = lease.unavailable_reason();
        } else {
          result.outcome = late ? Outcome::timed_out : Outcome::failed;
          result.error = mrr::detail::str(result.error, "; no worker left to retry on: ", lease.unavailable_reason());
        }
        return result;
      }
      tried.push_back(lease.worker());
      result.attempts = attempt;
      result.worker = lease.worker();

      const TimePoint start = clock_.now();
      const Duration budget = std::min(options_.attempt_timeout, deadline - start);
      Reply reply = send_one(transport, lease.worker(), request, budget);
      if (reply.answered() && clock_.now() - start > budget)
        reply = Reply::failed(Failure::timeout, mrr::detail::str("answered after the attempt timeout of ",
                                                                 detail::format_duration(budget), "; answer dropped"));
      if (reply.answered() && is_retry_status(reply.response.status)) {
        result.last_status = reply.response.status;
        reply = Reply::failed(Failure::status, mrr::detail::str("answered ", reply.response.status, ": ",
                                                                detail::excerpt(reply.response.body)));
      }
      if (reply.answered()) {
        lease.succeeded();
        result.outcome = Outcome::answered;
        result.response = std::move(reply.response);
        result.error.clear();
        return result;
      }
      if (reply.failure != Failure::status) result.last_status = 0;
      result.error = mrr::detail::str("worker ", lease.worker(), ": ", to_string(reply.failure), ": ", reply.error);
      // A timeout in an attempt that the time already spent on the request (waiting for room,
      // earlier attempts, backoff) left with less than half the budget a first attempt gets is the
      // request's deadline, not the worker's fault. A worker that hangs through a whole budget is.
      const Duration fair = std::min(options_.attempt_timeout, options_.request_timeout);
      if (reply.failure == Failure::timeout && budget < fair / 2 && clock_.now() >= deadline)
        lease.cut_short();
      else
        lease.failed(result.error);
      lease.release();  // before the backoff pause
      if (clock_.now() >= deadline) {
        result.outcome = Outcome::timed_out;
        return result;
      }
    }
    result.outcome = Outcome::failed;
    return result;
  }

  // The pause before retry number `retry` (1-based): initial * multiplier^(retry-1), capped.
  [[nodiscard]] Duration backoff(int retry) const {
    const double factor = std::pow(options_.backoff_multiplier, retry - 1);
    const double ticks = static_cast<double>(options_.backoff_initial.count()) * factor;
    if (!(ticks < static_cast<double>(options_.backoff_max.count()))) return options_.backoff_max;
    return Duration(static_cast<Duration::rep>(ticks));
  }

 private:
  using WorkerPtr = std::shared_ptr<detail::WorkerState>;

  static DispatchOptions validated(DispatchOptions o) {
    constexpr std::string_view fn = "reward::Dispatcher";
    mrr::detail::require(o.max_attempts >= 1, fn, "max_attempts must be >= 1, got ", o.max_attempts);
    mrr::detail::require(o.backoff_initial >= Duration::zero() && o.backoff_max >= Duration::zero(), fn,
                         "backoff_initial and backoff_max must not be negative");
    mrr::detail::require(o.backoff_multiplier >= 1.0, fn, "backoff_multiplier must be >= 1, got ",
                         o.backoff_multiplier);
    mrr::detail::require(o.attempt_timeout > Duration::zero() && o.request_timeout > Duration::zero(), fn,
                         "attempt_timeout and request_timeout must be positive");
    mrr::detail::require(o.failures_to_evict >= 1, fn, "failures_to_evict must be >= 1, got ", o.failures_to_evict);
    mrr::detail::require(o.successes_to_readmit >= 1, fn, "successes_to_readmit must be >= 1, got ",
                         o.successes_to_readmit);
    mrr::detail::require(o.readmit_after >= Duration::zero(), fn, "readmit_after must not be negative");
    mrr::detail::require(!o.sticky_sessions || o.sticky_capacity >= 1, fn,
                         "sticky_capacity must be >= 1 when sticky_sessions is on");
    for (const int s : o.retry_statuses)
      mrr::detail::require(s >= 100 && s <= 599, fn, "retry_statuses holds ", s, ", not an HTTP status");
    return o;
  }

  template <Transport T>
  static Reply send_one(T& transport, const std::string& worker, const Request& request, Duration budget) {
    try {
      return transport.send(worker, request, budget);
    } catch (const std::exception& e) {
      return Reply::failed(Failure::exception, e.what());
    } catch (...) {
      return Reply::failed(Failure::exception, "unknown exception");
    }
  }

  [[nodiscard]] bool is_retry_status(int status) const noexcept {
    return std::find(options_.retry_statuses.begin(), options_.retry_statuses.end(), status) !=
           options_.retry_statuses.end();
  }

  auto find(std::string_view address) const {
    return std::find_if(workers_.begin(), workers_.end(), [&](const WorkerPtr& w) { return w->address == address; });
  }

  // Under mutex_. Without a choice, says why, and whether waiting helps (only caps stand in the way).
  WorkerPtr choose(const Request& request, const std::vector<std::string>& tried, std::string& reason,
                   bool& waiting_helps) {
    candidates_.clear();
    std::size_t healthy = 0;
    std::size_t fewest_tries = tried.size();
    // Retries move on: a worker tried for this request is used again only when every healthy one
    // was tried as often, so attempts go round the workers. One at its cap counts too: the retry
    // waits for its room rather than going back to the worker that just failed.
    for (const auto& w : workers_) {
      if (!w->healthy) continue;
      ++healthy;
      const auto tries = static_cast<std::size_t>(std::count(tried.begin(), tried.end(), w->address));
      fewest_tries = std::min(fewest_tries, tries);
      candidates_.push_back({&w, tries});
    }
    std::erase_if(candidates_, [&](const Candidate& c) {
      return c.tries > fewest_tries ||
             (options_.max_in_flight_per_worker != 0 && (*c.worker)->in_flight >= options_.max_in_flight_per_worker);
    });
    if (candidates_.empty()) {
      if (workers_.empty()) {
        reason = "no workers are registered";
      } else if (healthy == 0) {
        reason = mrr::detail::str("all ", workers_.size(), " workers are evicted as unhealthy");
      } else if (tried.empty()) {
        reason = mrr::detail::str(
            "all ", healthy, " healthy workers are at max_in_flight_per_worker = ", options_.max_in_flight_per_worker);
        waiting_helps = true;
      } else {
        std::size_t least_tried = 0;
        for (const auto& w : workers_)
          if (w->healthy &&
              static_cast<std::size_t>(std::count(tried.begin(), tried.end(), w->address)) == fewest_tries)
            ++least_tried;
        reason = mrr::detail::str("the ", least_tried, " of ", healthy,
                                  " healthy workers tried least for this request (", fewest_tries,
                                  " times) are at max_in_flight_per_worker = ", options_.max_in_flight_per_worker,
                                  "; a retry waits for them");
        waiting_helps = true;
      }
      return nullptr;
    }

    if (options_.sticky_sessions && !request.session.empty()) {
      if (const auto it = sessions_.find(detail::session_key(request.session)); it != sessions_.end()) {
        if (const auto pinned = it->second.worker.lock()) {
          for (const auto& c : candidates_)
            if (*c.worker == pinned) return pinned;
        }
      }
    }

    std::size_t least = (*candidates_.front().worker)->in_flight;
    for (const auto& c : candidates_)
      least = std::min(least, (*c.worker)->in_flight);
    // Candidates are in index order, so the ties are too.
    const auto is_tie = [least](const Candidate& c) { return (*c.worker)->in_flight == least; };
    std::size_t pick = 0;
    if (options_.tie_break == TieBreak::body_hash) {
      const auto ties = static_cast<std::size_t>(std::count_if(candidates_.begin(), candidates_.end(), is_tie));
      pick = static_cast<std::size_t>(detail::body_hash(request.body) % ties);
    }
    for (const auto& c : candidates_)
      if (is_tie(c) && pick-- == 0) return *c.worker;
    return nullptr;  // unreachable: at least one candidate has the least count
  }

  void pin(const std::string& session_id, const WorkerPtr& worker) {
    const detail::SessionKey session = detail::session_key(session_id);
    if (const auto it = sessions_.find(session); it != sessions_.end()) {
      it->second.worker = worker;
      recency_.splice(recency_.begin(), recency_, it->second.position);
      return;
    }
    recency_.push_front(session);
    sessions_.emplace(session, Pin{worker, recency_.begin()});
    if (sessions_.size() > options_.sticky_capacity) {
      sessions_.erase(recency_.back());
      recency_.pop_back();
    }
  }

  void release_slot(detail::WorkerState& w) noexcept {
    {
      std::lock_guard lock(mutex_);
      --w.in_flight;
      --total_in_flight_;
    }
    room_.notify_all();
  }

  void record_success(detail::WorkerState& w) {
    std::lock_guard lock(mutex_);
    ++w.successes;
    w.consecutive_failures = 0;
  }

  void record_cut_short(detail::WorkerState& w) {
    std::lock_guard lock(mutex_);
    ++w.cut_short;
  }

  void record_failure(detail::WorkerState& w, std::string error) {
    std::lock_guard lock(mutex_);
    ++w.failures;
    count_failure(w, std::move(error));
  }

  void count_failure(detail::WorkerState& w, std::string error) {
    w.last_error = std::move(error);
    if (++w.consecutive_failures >= options_.failures_to_evict && w.healthy && !w.removed) evict(w);
  }

  void evict(detail::WorkerState& w) {
    w.healthy = false;
    w.consecutive_probe_successes = 0;
    w.evicted_at = clock_.now();
    ++w.evictions;
  }

  // On probation: one more failure evicts again, so a worker that is still broken costs little.
  // (const: the workers' states are shared, not part of the dispatcher's value; stats() applies it.)
  void readmit(detail::WorkerState& w) const {
    w.healthy = true;
    w.consecutive_failures = options_.failures_to_evict - 1;
  }

  // Under mutex_; whether any worker came back.
  bool readmit_cooled_down(TimePoint now) const {
    if (options_.readmit_after == Duration::zero()) return false;
    bool any = false;
    for (const auto& w : workers_)
      if (!w->healthy && now - w->evicted_at >= options_.readmit_after) {
        readmit(*w);
        any = true;
      }
    return any;
  }

  struct Candidate {
    const WorkerPtr* worker;  // into workers_, valid while mutex_ is held
    std::size_t tries;        // attempts of this request on it so far
  };
  struct Pin {
    std::weak_ptr<detail::WorkerState> worker;
    std::list<detail::SessionKey>::iterator position;
  };

  const DispatchOptions options_;
  mutable Clock clock_;  // now() from stats() const
  mutable std::mutex mutex_;
  mutable std::condition_variable room_;  // a slot was released, a worker added or re-admitted
  std::vector<WorkerPtr> workers_;
  std::size_t total_in_flight_ = 0;
  std::vector<Candidate> candidates_;  // scratch for choose(), reused to avoid allocation
  std::unordered_map<detail::SessionKey, Pin, detail::SessionKeyHash> sessions_;
  std::list<detail::SessionKey> recency_;  // sessions, most recently used first
};

using Dispatcher = BasicDispatcher<>;

}  // namespace reward
MRR_NAMESPACE_END
