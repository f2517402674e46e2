// Helpers for the PPO golden tests: inputs as matrices of the scalar under test, the tolerance
// per scalar type, and a checker that fails a case when one of its golden outputs is left unchecked.
#pragma once

#include <mrr/ppo/rollout_rejection.hpp>
#include <mrr/tensor.hpp>
#include <support/golden.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <exception>
#include <set>
#include <string>
#include <vector>

namespace mrr::test::ppo {

template <class T>
constexpr const char* type_name() {
  return sizeof(T) == sizeof(double) ? "double" : "float";
}

template <class T>
RowMatrix<T> input_matrix(const GoldenCase& c, const std::string& key) {
  return c.input(key).matrix<T>();
}

// [B, L, V] logits as [B * L, V] rows of tokens (the layout mrr's entropy functions take).
template <class T>
RowMatrix<T> token_rows(const Tensor& t) {
  const auto vocab = t.shape.back();
  const auto tokens = static_cast<std::int64_t>(t.data.size()) / vocab;
  RowMatrix<T> m(tokens, vocab);
  for (Eigen::Index i = 0; i < m.size(); ++i)
    m.data()[i] = static_cast<T>(t.data[static_cast<std::size_t>(i)]);
  return m;
}

struct Tolerance {
  double rtol;
  double atol;
};

// double: the case's own tolerance. float: rtol 1e-4 and atol 1e-6 + 1e-5 * max|expected|, i.e.
// about 100 float ulps of the tensor's own scale, for results that come out of cancellation
// (k3 near zero, whitened values near the mean); the 1e-6 floor covers all-zero tensors.
template <class T>
Tolerance tolerance(const GoldenCase& c, const Tensor& expected) {
  if constexpr (sizeof(T) == sizeof(double)) {
    return {c.rtol, c.atol};
  } else {
    double scale = 0;
    for (const double v : expected.data)
      if (std::isfinite(v)) scale = std::max(scale, std::abs(v));
    return {1e-4, 1e-6 + 1e-5 * scale};
  }
}

// Checks outputs by key and remembers which were checked; finish() fails the case for any golden
// output nobody compared, so a new output in a hidden case cannot pass silently.
template <class T>
class OutputChecker {
 public:
  explicit OutputChecker(const GoldenCase& c) : case_(c) {}

  template <class Derived>
  void matrix(const std::string& key, const Eigen::DenseBase<Derived>& actual) {
    const Tensor expected = take(key);
    const auto tol = tolerance<T>(case_, expected);
    check_close(actual, expected, tol.rtol, tol.atol, key);
  }

  void scalar(const std::string& key, double actual) {
    const Tensor expected = take(key);
    const auto tol = tolerance<T>(case_, expected);
    check_close(actual, expected, tol.rtol, tol.atol, key);
  }

  bool has(const std::string& key) const { return case_.has_output(key); }
  std::size_t compared() const { return checked_.size(); }

  std::vector<std::string> keys_with_prefix(const std::string& prefix) const {
    std::vector<std::string> keys;
    for (auto it = case_.outputs.begin(); it != case_.outputs.end(); ++it)
      if (it.key().rfind(prefix, 0) == 0) keys.push_back(it.key());
    return keys;
  }

  void finish() const {
    for (auto it = case_.outputs.begin(); it != case_.outputs.end(); ++it)
      if (checked_.count(it.key()) == 0) FAIL_CHECK("golden output '" << it.key() << "' was not checked");
  }

 private:
  Tensor take(const std::string& key) {
    checked_.insert(key);
    return case_.output(key);
  }

  const GoldenCase& case_;
  std::set<std::string> checked_;
};

// verl's rollout-correction keys of a case, under `prefix` ("" or "rollout_correction."):
// rollout_is (absent or null: no IS weights), rollout_is_threshold (a number or "lower_upper"),
// rollout_is_batch_normalize, rollout_rs (absent or null: no rejection), rollout_rs_threshold (a
// number or a string) and loss_type.
inline mrr::ppo::RolloutCorrectionConfig rollout_correction_config(const GoldenCase& c, const std::string& prefix) {
  namespace ppo = mrr::ppo;
  const auto at = [&](const std::string& key) -> const nlohmann::json* {
    const auto it = c.params.find(prefix + key);
    return it == c.params.end() || it->is_null() ? nullptr : &*it;
  };
  ppo::RolloutCorrectionConfig rc;
  if (const auto* level = at("rollout_is")) {
    ppo::RolloutIsOptions is;
    is.level = ppo::parse_rollout_is_level(level->get<std::string>());
    if (const auto* t = at("rollout_is_threshold"))
      is.threshold = t->is_string() ? ppo::RolloutIsThreshold::parse(t->get<std::string>())
                                    : ppo::RolloutIsThreshold::truncate_at(t->get<double>());
    if (const auto* b = at("rollout_is_batch_normalize")) is.batch_normalize = b->get<bool>();
    rc.is = is;
  }
  if (const auto* rs = at("rollout_rs")) {
    const auto* t = at("rollout_rs_threshold");
    if (t == nullptr) throw std::runtime_error("case sets rollout_rs without rollout_rs_threshold");
    rc.rs = t->is_string() ? ppo::RolloutRsOptions::parse(rs->get<std::string>(), t->get<std::string>())
                           : ppo::RolloutRsOptions::parse(rs->get<std::string>(), t->get<double>());
  }
  if (const auto* type = at("loss_type")) rc.loss_type = ppo::parse_bypass_loss_type(type->get<std::string>());
  return rc;
}

// Checks every "metric:<key>" golden output against `metrics`, and that `metrics` holds no other
// key: exactly verl's metric keys.
template <class T, class Metrics>
void check_metrics(OutputChecker<T>& check, const Metrics& metrics) {
  std::set<std::string> golden;
  for (const auto& key : check.keys_with_prefix("metric:")) {
    const std::string name = key.substr(7);
    golden.insert(name);
    const auto it = metrics.find(name);
    if (it == metrics.end()) {
      FAIL_CHECK("metric '" << name << "' is not reported");
      continue;
    }
    check.scalar(key, static_cast<double>(it->second));
  }
  for (const auto& [name, value] : metrics)
    if (golden.count(name) == 0) FAIL_CHECK("metric '" << name << "' is reported but verl has none");
}

// Runs every case of a file through `run`, naming the case in every failure. An exception or an
// unhandled fn fails that case and the loop goes on with the next one.
template <class T, class Run>
void for_each_case(const std::string& file, Run&& run) {
  const auto cases = load_golden(file);
  std::size_t completed = 0, outputs = 0;
  for (const auto& c : cases) {
    INFO(file << " case '" << c.name << "' (fn " << c.fn << ", " << std::string(type_name<T>()) << ")");
    try {
      OutputChecker<T> check(c);
      if (run(c, check)) {
        check.finish();
        ++completed;
        outputs += check.compared();
      } else {
        FAIL_CHECK("fn '" << c.fn << "' is not handled by the test");
      }
    } catch (const std::exception& e) {
      FAIL_CHECK("threw: " << std::string(e.what()));
    }
  }
  MESSAGE(file << ": " << completed << " of " << cases.size() << " cases run in " << std::string(type_name<T>()) << ", "
               << outputs << " golden outputs compared");
  CHECK(completed == cases.size());
}

}  // namespace mrr::test::ppo
