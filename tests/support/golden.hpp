// Reader for the golden vectors in MRR_GOLDEN_DIR (default tests/golden, vendored in the repository)
// and a tolerance check that reports the first offending element. Test-only; doctest macros inside.
#pragma once

#include <mrr/tensor.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace mrr::test {

inline std::filesystem::path golden_dir() {
  if (const char* env = std::getenv("MRR_GOLDEN_DIR"); env != nullptr && *env != '\0') return env;
  return std::filesystem::path(MRR_SOURCE_DIR) / "tests" / "golden";
}

// A tensor as stored: {"shape": [...], "data": [row-major values]}; a plain list is 1-D.
struct Tensor {
  std::vector<std::int64_t> shape;
  std::vector<double> data;

  static Tensor from_json(const nlohmann::json& j) {
    Tensor t;
    if (j.is_array()) {
      t.shape = {static_cast<std::int64_t>(j.size())};
      for (const auto& v : j) t.data.push_back(v.get<double>());
    } else if (j.is_number()) {
      t.data = {j.get<double>()};
    } else {
      t.shape = j.at("shape").get<std::vector<std::int64_t>>();
      t.data = j.at("data").get<std::vector<double>>();
    }
    return t;
  }

  std::int64_t dim(std::size_t i) const { return shape.at(i); }
  std::int64_t rows() const { return shape.empty() ? 1 : shape[0]; }
  std::int64_t cols() const {
    if (shape.size() < 2) return shape.empty() ? 1 : 1;
    std::int64_t c = 1;
    for (std::size_t i = 1; i < shape.size(); ++i) c *= shape[i];
    return c;
  }
  double scalar() const {
    if (data.size() != 1) throw std::runtime_error("golden tensor is not a scalar");
    return data[0];
  }
  // 2-D (or N-D flattened to [shape[0], prod(rest)]) as a row-major matrix.
  template <class T>
  RowMatrix<T> matrix() const {
    RowMatrix<T> m(rows(), shape.size() < 2 ? 1 : cols());
    for (Eigen::Index i = 0; i < m.size(); ++i) m.data()[i] = static_cast<T>(data[static_cast<std::size_t>(i)]);
    return m;
  }
  // 1-D as a row of a matrix (shape [1, n]); used for per-row vectors.
  template <class T>
  Vector<T> vector() const {
    Vector<T> v(static_cast<Eigen::Index>(data.size()));
    for (Eigen::Index i = 0; i < v.size(); ++i) v[i] = static_cast<T>(data[static_cast<std::size_t>(i)]);
    return v;
  }
  template <class T>
  std::vector<T> values() const {
    std::vector<T> v;
    v.reserve(data.size());
    for (double x : data) v.push_back(static_cast<T>(x));
    return v;
  }
};

struct GoldenCase {
  std::string file;
  std::string name;
  std::string fn;
  std::string note;
  nlohmann::json params;
  nlohmann::json inputs;
  nlohmann::json outputs;
  double rtol = 0;
  double atol = 0;

  bool has_input(const std::string& key) const { return inputs.contains(key); }
  bool has_output(const std::string& key) const { return outputs.contains(key); }
  bool has_param(const std::string& key) const { return params.contains(key) && !params.at(key).is_null(); }
  Tensor input(const std::string& key) const { return Tensor::from_json(inputs.at(key)); }
  Tensor output(const std::string& key) const { return Tensor::from_json(outputs.at(key)); }
  template <class T>
  T param(const std::string& key) const {
    return params.at(key).get<T>();
  }
  template <class T>
  T param(const std::string& key, T fallback) const {
    return has_param(key) ? params.at(key).get<T>() : fallback;
  }
};

// Runs one case's checks; a case that throws (a parameter the library refuses, a missing key)
// fails alone, named with its message, and the cases after it still run.
template <class Body>
void guarded(const GoldenCase& c, Body&& body) {
  try {
    body();
  } catch (const std::exception& e) {
    FAIL_CHECK(c.file << " case '" << c.name << "' (fn " << c.fn << ") threw: " << std::string(e.what()));
  }
}

inline std::vector<GoldenCase> load_golden(const std::string& file) {
  const auto path = golden_dir() / file;
  std::ifstream in(path);
  if (!in)
    throw std::runtime_error("cannot open golden file " + path.string() +
                             " (set MRR_GOLDEN_DIR to the directory of the golden vectors)");
  nlohmann::json j = nlohmann::json::parse(in);
  std::vector<GoldenCase> cases;
  for (const auto& c : j.at("cases")) {
    GoldenCase g;
    g.file = file;
    g.name = c.at("name").get<std::string>();
    g.fn = c.at("fn").get<std::string>();
    g.note = c.value("note", "");
    g.params = c.value("params", nlohmann::json::object());
    g.inputs = c.at("inputs");
    g.outputs = c.at("outputs");
    g.rtol = c.at("tolerance").at("rtol").get<double>();
    g.atol = c.at("tolerance").at("atol").get<double>();
    cases.push_back(std::move(g));
  }
  if (cases.empty()) throw std::runtime_error("golden file " + path.string() + " has no cases");
  return cases;
}

inline std::vector<GoldenCase> load_golden(const std::string& file, const std::string& fn) {
  std::vector<GoldenCase> out;
  for (auto& c : load_golden(file))
    if (c.fn == fn) out.push_back(std::move(c));
  if (out.empty()) throw std::runtime_error("golden file " + file + " has no cases of fn " + fn);
  return out;
}

// |actual - expected| <= atol + rtol * |expected| element-wise (the golden files' rule); NaN and
// inf must match exactly. Returns true when every element passes, and reports the first failure.
template <class Derived>
bool check_close(const Eigen::DenseBase<Derived>& actual, const Tensor& expected, double rtol, double atol,
                 const std::string& what) {
  const auto n = static_cast<std::size_t>(actual.size());
  if (n != expected.data.size()) {
    FAIL_CHECK(what << ": size " << n << " but golden has " << expected.data.size());
    return false;
  }
  std::size_t bad = 0, first = n;
  double worst = 0;
  // Row-major walk of the actual values, whatever Eigen's storage order.
  const Eigen::Index cols = actual.cols();
  for (std::size_t i = 0; i < n; ++i) {
    const auto r = static_cast<Eigen::Index>(i) / cols, c = static_cast<Eigen::Index>(i) % cols;
    const double a = static_cast<double>(actual.derived().coeff(r, c));
    const double b = expected.data[i];
    bool ok;
    if (std::isnan(b) || std::isnan(a)) {
      ok = std::isnan(a) && std::isnan(b);
    } else if (std::isinf(b) || std::isinf(a)) {
      ok = a == b;
    } else {
      const double err = std::abs(a - b);
      ok = err <= atol + rtol * std::abs(b);
      if (!ok) worst = std::max(worst, err);
    }
    if (!ok) {
      if (bad == 0) first = i;
      ++bad;
    }
  }
  if (bad != 0) {
    const auto r = static_cast<Eigen::Index>(first) / cols, c = static_cast<Eigen::Index>(first) % cols;
    FAIL_CHECK(what << ": " << bad << " of " << n << " elements outside atol " << atol << " + rtol " << rtol
                    << "; first at flat index " << first << ": got " << static_cast<double>(actual.derived().coeff(r, c))
                    << ", golden " << expected.data[first] << "; worst abs error " << worst);
    return false;
  }
  return true;
}

// For golden outputs the reference computed in float32 whatever the input dtype (Megatron-Core's
// router: "logits are converted to fp32 for score functions ... all intermediate calculations
// are in fp32", moe_utils.py). Those values carry float32 rounding that a float64 computation
// cannot reproduce bit for bit, so the documented difference is bounded, not waved through, in two
// parts:
// - what the reference rounds before its first transcendental (its float32 logits; softmax's
//   float32 x - max, whose rounding grows with the logits' spread): the test rounds the same
//   values and runs mrr on them (`on_rounded`). That run must meet the case's atol + rtol*|b| plus
//   the float32 arithmetic that follows, `ulps` units in the last place of b as a float32 (each exp
//   within 1 ulp, one division, a float32 sum over `terms` values);
// - mrr's run on the unrounded inputs (`actual`) then differs from the golden by at most that plus
//   |actual - on_rounded|: the rounding's own effect, computed per element, not a wider budget.
template <class A, class R>
bool check_close_fp32_reference(const Eigen::DenseBase<A>& actual, const Eigen::DenseBase<R>& on_rounded,
                                const Tensor& expected, double rtol, double atol, int terms, const std::string& what) {
  const double ulps = 4.0 + static_cast<double>(terms) / 8.0;
  const auto n = static_cast<std::size_t>(actual.size());
  if (n != expected.data.size() || on_rounded.size() != actual.size()) {
    FAIL_CHECK(what << ": size " << n << " (" << on_rounded.size() << " on the rounded inputs) but golden has "
                    << expected.data.size());
    return false;
  }
  const Eigen::Index cols = actual.cols();
  std::size_t bad_rounded = 0, bad = 0;
  double worst_rounded = 0, worst = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const auto r = static_cast<Eigen::Index>(i) / cols, c = static_cast<Eigen::Index>(i) % cols;
    const double a = static_cast<double>(actual.derived().coeff(r, c));
    const double m = static_cast<double>(on_rounded.derived().coeff(r, c));
    const double b = expected.data[i];
    const float bf = static_cast<float>(std::abs(b));
    const double ulp = static_cast<double>(std::nextafter(bf, std::numeric_limits<float>::infinity()) - bf);
    const double budget = atol + rtol * std::abs(b) + ulps * ulp;
    worst_rounded = std::max(worst_rounded, std::abs(m - b) / ulp);
    worst = std::max(worst, std::abs(a - b) / ulp);
    if (!(std::abs(m - b) <= budget)) ++bad_rounded;
    if (!(std::abs(a - b) <= budget + std::abs(a - m))) ++bad;
  }
  if (bad_rounded != 0)
    FAIL_CHECK(what << ", on the reference's float32-rounded inputs: " << bad_rounded << " of " << n
                    << " elements outside the case tolerance plus " << ulps << " float32 ulps of the reference; worst "
                    << worst_rounded << " ulps");
  if (bad != 0)
    FAIL_CHECK(what << ": " << bad << " of " << n << " elements outside the case tolerance plus " << ulps
                    << " float32 ulps plus the input rounding's effect; worst " << worst << " ulps");
  return bad_rounded == 0 && bad == 0;
}

inline bool check_close(double actual, const Tensor& expected, double rtol, double atol, const std::string& what) {
  Eigen::Matrix<double, 1, 1> m;
  m(0, 0) = actual;
  return check_close(m, expected, rtol, atol, what);
}

}  // namespace mrr::test
