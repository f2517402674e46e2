// The reward worker the integration tests and the router's CLI test run, in-process or as a child
// process: it echoes what it received (to check forwarding) and scores GSM8K answers with
// mrr::ppo's rule-based reward.
#pragma once

#include <mrr/ppo/reward_rules.hpp>
#include <mrr/reward/transport.hpp>

#include <nlohmann/json.hpp>

#include <cctype>
#include <chrono>
#include <string>
#include <thread>

namespace mrr_test {

struct WorkerBehaviour {
  std::string name = "worker";
  std::string mode = "normal";  // normal | error (answers 503: a worker counted as failing)
  int delay_ms = 0;             // before answering
};

// 200 with a JSON echo {worker, id, method, target, body, headers, score}; "?status=N" in the
// target answers N instead. Mode "error" answers 503 Service Unavailable.
inline mrr::reward::Response answer(const WorkerBehaviour& b, const mrr::reward::Request& r) {
  if (b.delay_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(b.delay_ms));
  mrr::reward::Response out;
  out.headers.emplace_back("X-Worker-Name", b.name);
  if (b.mode == "error") {
    out.status = 503;
    out.headers.emplace_back("Content-Type", "text/plain");
    out.body = "worker " + b.name + " is broken";
    return out;
  }
  nlohmann::json headers = nlohmann::json::object();
  for (const auto& [k, v] : r.headers) {
    std::string key;
    for (const char c : k)
      key += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    headers[key] = v;
  }
  nlohmann::json echo{{"worker", b.name},   {"id", std::string(mrr::reward::header_value(r.headers, "X-Request-Id"))},
                      {"method", r.method}, {"target", r.target},
                      {"body", r.body},     {"headers", headers}};
  const auto parsed = nlohmann::json::parse(r.body, nullptr, /*allow_exceptions=*/false);
  if (parsed.is_object() && parsed.contains("solution") && parsed.contains("truth"))
    echo["score"] =
        mrr::ppo::compute_gsm8k_score(parsed["solution"].get<std::string>(), parsed["truth"].get<std::string>());
  if (const auto at = r.target.find("status="); at != std::string::npos)
    out.status = std::stoi(r.target.substr(at + 7));
  out.headers.emplace_back("Content-Type", "application/json");
  out.body = echo.dump();
  return out;
}

}  // namespace mrr_test
