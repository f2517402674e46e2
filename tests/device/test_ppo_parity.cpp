// PPO utilities on the Thrust backend (OpenMP system) against verl's golden vectors, at the same
// tolerances as the CPU tests (the case's own in double; the float rule of tests/ppo in float):
// GAE as a parallel scan, GRPO / RLOO group statistics, masked reductions, KL penalties.
#include <mrr/ppo/advantage.hpp>
#include <mrr/ppo/kl.hpp>
#include <mrr/thrust/policy_loss.hpp>
#include <mrr/thrust/ppo.hpp>

#include "../ppo/ppo_golden.hpp"

#include <doctest/doctest.h>

#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <vector>

namespace {

using mrr::test::GoldenCase;
using mrr::test::ppo::OutputChecker;

template <class T>
using dvec = thrust::device_vector<T>;

template <class T>
dvec<T> input(const GoldenCase& c, const std::string& key) {
  const auto v = c.input(key).values<T>();
  return dvec<T>(v.begin(), v.end());
}

long cols_of(const GoldenCase& c, const std::string& key) { return static_cast<long>(c.input(key).cols()); }

template <class T>
mrr::RowMatrix<T> as_matrix(const dvec<T>& v, long cols) {
  mrr::RowMatrix<T> m(static_cast<long>(v.size()) / cols, cols);
  thrust::copy(v.begin(), v.end(), m.data());
  return m;
}

// verl's uid labels as dense ints, in order of first appearance.
dvec<std::int32_t> dense_groups(const GoldenCase& c, int& num_groups) {
  std::map<std::string, int> ids;
  std::vector<std::int32_t> out;
  for (const auto& j : c.inputs.at("index")) {
    const auto key = j.dump();
    const auto it = ids.emplace(key, static_cast<int>(ids.size())).first;
    out.push_back(it->second);
  }
  num_groups = static_cast<int>(ids.size());
  return dvec<std::int32_t>(out.begin(), out.end());
}

template <class T>
bool run_advantage(const GoldenCase& c, OutputChecker<T>& check,
                   mrr::device::GaeAlgorithm gae = mrr::device::GaeAlgorithm::automatic) {
  const long cols = cols_of(c, "token_level_rewards");
  const auto rewards = input<T>(c, "token_level_rewards");
  const auto mask = input<T>(c, "response_mask");
  mrr::device::AdvantageResult<T> out;
  if (c.fn == "gae") {
    out = mrr::device::compute_gae_advantage_return<T>(rewards, input<T>(c, "values"), mask, cols,
                                                       c.param<double>("gamma", 1.0), c.param<double>("lam", 1.0),
                                                       gae);
  } else if (c.fn == "grpo" || c.fn == "rloo" || c.fn == "rloo_vectorized") {
    int groups = 0;
    const auto group = dense_groups(c, groups);
    const auto estimator = c.fn == "grpo" ? mrr::device::OutcomeEstimator::grpo
                           : c.fn == "rloo" ? mrr::device::OutcomeEstimator::rloo
                                            : mrr::device::OutcomeEstimator::rloo_vectorized;
    out = mrr::device::compute_outcome_advantage<T>(estimator, rewards, mask, cols, group, groups,
                                                    c.param<double>("epsilon", 1e-6),
                                                    c.param<bool>("norm_adv_by_std_in_grpo", true));
  } else {
    return false;
  }
  check.matrix("advantages", as_matrix(out.advantages, cols));
  check.matrix("returns", as_matrix(out.returns, cols));
  return true;
}

template <class T>
bool run_masked(const GoldenCase& c, OutputChecker<T>& check) {
  if (c.fn == "entropy_from_logits") return false;
  const long cols = cols_of(c, "values");
  auto values = input<T>(c, "values");
  const auto mask = input<T>(c, "mask");
  if (c.fn == "masked_mean") {
    if (!c.has_param("axis")) {
      check.scalar("out", static_cast<double>(mrr::device::masked_mean<T>(values, mask)));
      return true;
    }
    const auto axis = c.param<int>("axis");
    if (axis == 0 || axis == -2) {  // a mean per column: the row means of the transposes
      const auto transposed = [&](const std::string& key) {
        const mrr::RowMatrix<T> t = c.input(key).matrix<T>().transpose();
        return dvec<T>(t.data(), t.data() + t.size());
      };
      const auto m = mrr::device::masked_row_mean<T>(transposed("values"), transposed("mask"),
                                                     static_cast<long>(c.input("values").rows()));
      check.matrix("out", as_matrix(m, static_cast<long>(m.size())));
      return true;
    }
    if (axis != 1 && axis != -1) return false;
    const auto m = mrr::device::masked_row_mean<T>(values, mask, cols);
    check.matrix("out", as_matrix(m, static_cast<long>(m.size())));
    return true;
  }
  if (c.fn == "masked_var") {
    check.scalar("out", static_cast<double>(mrr::device::masked_var<T>(values, mask, c.param<bool>("unbiased", true))));
    return true;
  }
  if (c.fn == "masked_whiten") {
    mrr::device::masked_whiten_in_place<T>(values, mask, c.param<bool>("shift_mean", true));
    check.matrix("out", as_matrix(values, cols));
    return true;
  }
  return false;
}

template <class T>
bool run_kl(const GoldenCase& c, OutputChecker<T>& check) {
  if (c.fn != "kl_penalty") return false;
  const auto penalty = mrr::ppo::parse_kl_penalty(c.param<std::string>("kl_penalty"));
  const long cols = cols_of(c, "logprob");
  const auto r = mrr::device::kl_penalty<T>(input<T>(c, "logprob"), input<T>(c, "ref_logprob"),
                                            static_cast<int>(penalty.estimator), penalty.straight_through);
  check.matrix("out", as_matrix(r.values, cols));
  check.matrix("grad_logprob", as_matrix(r.grad_logprob, cols));
  return true;
}

// Runs the cases of `fns` only, and checks every one of them ran.
template <class T, class Run>
void for_cases(const std::string& file, const std::vector<std::string>& fns, Run&& run) {
  std::size_t ran = 0, wanted = 0;
  for (const auto& c : mrr::test::load_golden(file)) {
    if (std::find(fns.begin(), fns.end(), c.fn) == fns.end()) continue;
    ++wanted;
    INFO(file << " case '" << c.name << "' (" << std::string(mrr::test::ppo::type_name<T>()) << ")");
    OutputChecker<T> check(c);
    if (run(c, check)) {
      check.finish();
      ++ran;
    }
  }
  MESSAGE(file << ": " << ran << " of " << wanted << " device cases run in " << std::string(mrr::test::ppo::type_name<T>()));
  CHECK(ran == wanted);
  CHECK(ran > 0);
}

// verl's vanilla policy loss (dual clip) on the device: loss, grad_log_prob and exactly verl's metrics.
template <class T>
void run_vanilla(const GoldenCase& c, OutputChecker<T>& check) {
  mrr::ppo::PolicyLossConfig config;
  config.clip_ratio = c.param<double>("clip_ratio", config.clip_ratio);
  if (c.has_param("clip_ratio_low")) config.clip_ratio_low = c.param<double>("clip_ratio_low");
  if (c.has_param("clip_ratio_high")) config.clip_ratio_high = c.param<double>("clip_ratio_high");
  config.clip_ratio_c = c.param<double>("clip_ratio_c", config.clip_ratio_c);
  auto& info = config.global_batch_info;
  info.dp_size = c.param<std::int64_t>("dp_size", 1);
  if (c.has_param("batch_num_tokens")) info.batch_num_tokens = c.param<double>("batch_num_tokens");
  if (c.has_param("global_batch_size")) info.global_batch_size = c.param<double>("global_batch_size");
  if (c.has_param("loss_scale_factor")) info.loss_scale_factor = c.param<double>("loss_scale_factor");
  const long cols = cols_of(c, "log_prob");
  std::optional<dvec<T>> weights;
  if (c.has_input("rollout_is_weights")) weights = input<T>(c, "rollout_is_weights");
  const auto out = mrr::device::compute_policy_loss_vanilla<T>(
      input<T>(c, "old_log_prob"), input<T>(c, "log_prob"), input<T>(c, "advantages"), input<T>(c, "response_mask"),
      cols, mrr::ppo::parse_loss_agg_mode(c.param<std::string>("loss_agg_mode", "token-mean")), config,
      weights ? &*weights : nullptr);
  check.scalar("loss", static_cast<double>(out.loss));
  check.matrix("grad_log_prob", as_matrix(out.grad_log_prob, cols));
  std::set<std::string> golden_metrics;
  for (const auto& key : check.keys_with_prefix("metric:")) {
    const std::string name = key.substr(7);
    golden_metrics.insert(name);
    const auto value = out.metric(name);
    if (!value) {
      FAIL_CHECK("metric '" << name << "' is not reported");
      continue;
    }
    check.scalar(key, static_cast<double>(*value));
  }
  for (const auto& [name, value] : out.metrics)
    if (golden_metrics.count(name) == 0) FAIL_CHECK("metric '" << name << "' is reported but verl has none");
}

}  // namespace

TEST_SUITE("golden") {
  TEST_CASE_TEMPLATE("device: policy_loss.json vanilla (dual clip) loss, gradient and metrics", T, double, float) {
    std::size_t ran = 0;
    for (const auto& c : mrr::test::load_golden("policy_loss.json")) {
      if (c.fn != "policy_loss" || c.param<std::string>("policy_loss") != "vanilla") continue;
      INFO("policy_loss.json case '" << c.name << "' (" << std::string(mrr::test::ppo::type_name<T>()) << ")");
      OutputChecker<T> check(c);
      run_vanilla<T>(c, check);
      check.finish();
      ++ran;
    }
    MESSAGE("policy_loss.json: " << ran << " vanilla cases run on the device in "
                                 << std::string(mrr::test::ppo::type_name<T>()));
    CHECK(ran > 0);
  }
  TEST_CASE_TEMPLATE("device: advantage.json gae, grpo, rloo, rloo_vectorized", T, double, float) {
    for_cases<T>("advantage.json", {"gae", "grpo", "rloo", "rloo_vectorized"},
                 [](const GoldenCase& c, OutputChecker<T>& check) { return run_advantage<T>(c, check); });
  }
  TEST_CASE_TEMPLATE("device: advantage.json gae, every algorithm (the GPU's chunks, a scan, the CPU threads' rows)", T,
                     double, float) {
    for (const auto algorithm :
         {mrr::device::GaeAlgorithm::scan, mrr::device::GaeAlgorithm::rows, mrr::device::GaeAlgorithm::chunks})
      for_cases<T>("advantage.json", {"gae"}, [&](const GoldenCase& c, OutputChecker<T>& check) {
        return run_advantage<T>(c, check, algorithm);
      });
  }
  TEST_CASE_TEMPLATE("device: masked.json masked mean, row mean, var, whiten", T, double, float) {
    for_cases<T>("masked.json", {"masked_mean", "masked_var", "masked_whiten"},
                 [](const GoldenCase& c, OutputChecker<T>& check) { return run_masked<T>(c, check); });
  }
  TEST_CASE_TEMPLATE("device: kl.json kl_penalty values and gradients", T, double, float) {
    for_cases<T>("kl.json", {"kl_penalty"}, [](const GoldenCase& c, OutputChecker<T>& check) { return run_kl<T>(c, check); });
  }
}

TEST_CASE("device: GAE (scan, rows and chunks) equals the CPU's sequential recurrence on a large batch") {
  const long rows = 64, cols = 3000;
  std::mt19937 rng(9);
  std::normal_distribution<double> n(0.0, 1.0);
  mrr::RowMatrix<double> r(rows, cols), v(rows, cols), m(rows, cols);
  for (long i = 0; i < rows; ++i)
    for (long j = 0; j < cols; ++j) {
      r(i, j) = n(rng);
      v(i, j) = n(rng);
      m(i, j) = (j < cols - i * 17 && (j % 13) != 5) ? 1.0 : 0.0;  // padding and observation tokens
    }
  const auto host = mrr::ppo::compute_gae_advantage_return<double>(r, v, m, 0.99, 0.95);
  for (const auto algorithm :
       {mrr::device::GaeAlgorithm::scan, mrr::device::GaeAlgorithm::rows, mrr::device::GaeAlgorithm::chunks}) {
    CAPTURE(static_cast<int>(algorithm));
    const auto dev = mrr::device::compute_gae_advantage_return<double>(
        dvec<double>(r.data(), r.data() + r.size()), dvec<double>(v.data(), v.data() + v.size()),
        dvec<double>(m.data(), m.data() + m.size()), cols, 0.99, 0.95, algorithm);
    const auto a = as_matrix(dev.advantages, cols), ret = as_matrix(dev.returns, cols);
    CHECK((a - host.advantages).cwiseAbs().maxCoeff() <= 1e-10);
    CHECK((ret - host.returns).cwiseAbs().maxCoeff() <= 1e-10);
  }
}

TEST_CASE("device: advantages refuse the inputs the CPU refuses, with the CPU's message") {
  namespace dev = mrr::device;
  const long rows = 64, cols = 300;
  std::mt19937 rng(11);
  std::normal_distribution<float> n(0.0f, 1.0f);
  mrr::RowMatrix<float> r(rows, cols), v(rows, cols), m(rows, cols);
  for (long i = 0; i < rows; ++i)
    for (long j = 0; j < cols; ++j) {
      r(i, j) = n(rng);
      v(i, j) = n(rng);
      m(i, j) = j < cols - i ? 1.0f : 0.0f;
    }
  std::vector<std::int32_t> groups;
  for (long i = 0; i < rows; ++i)
    groups.push_back(static_cast<std::int32_t>(i / 8));
  const mrr::ppo::GroupIndex index(groups);
  const auto flat = [](const mrr::RowMatrix<float>& x) { return dvec<float>(x.data(), x.data() + x.size()); };
  const dvec<std::int32_t> dgroups(groups.begin(), groups.end());
  // Each fault alone, then two at once (the lowest element is named): the device's error is the
  // CPU's, word for word, for GAE and for an outcome estimator.
  struct Fault {
    const char* name;
    mrr::RowMatrix<float>* input;
    long row, col;
    float value;
  };
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  for (const Fault& f : {Fault{"mask 0.5", &m, 5, 7, 0.5f}, Fault{"masked-out NaN reward", &r, 9, 299, nan},
                         Fault{"inf value", &v, 63, 0, -inf}}) {
    CAPTURE(f.name);
    const float kept = (*f.input)(f.row, f.col);
    (*f.input)(f.row, f.col) = f.value;
    std::string cpu_gae, cpu_grpo;
    try {
      (void)mrr::ppo::compute_gae_advantage_return<float>(r, v, m, 0.99, 0.95);
    } catch (const std::invalid_argument& e) {
      cpu_gae = e.what();
    }
    try {
      (void)mrr::ppo::compute_grpo_outcome_advantage<float>(r, m, index);
    } catch (const std::invalid_argument& e) {
      cpu_grpo = e.what();
    }
    REQUIRE(!cpu_gae.empty());
    const auto tail = [](const std::string& what) { return what.substr(what.find(": ") + 2); };
    for (const auto algorithm : {dev::GaeAlgorithm::rows, dev::GaeAlgorithm::chunks, dev::GaeAlgorithm::scan}) {
      CAPTURE(static_cast<int>(algorithm));
      CHECK_THROWS_WITH_AS(
          (void)dev::compute_gae_advantage_return<float>(flat(r), flat(v), flat(m), cols, 0.99, 0.95, algorithm),
          doctest::Contains(tail(cpu_gae).c_str()), std::invalid_argument);
    }
    if (f.input != &v) {
      REQUIRE(!cpu_grpo.empty());
      for (const auto estimator :
           {dev::OutcomeEstimator::grpo, dev::OutcomeEstimator::rloo, dev::OutcomeEstimator::rloo_vectorized}) {
        CHECK_THROWS_WITH_AS(
            (void)dev::compute_outcome_advantage<float>(estimator, flat(r), flat(m), cols, dgroups, rows / 8),
            doctest::Contains(tail(cpu_grpo).c_str()), std::invalid_argument);
      }
    }
    (*f.input)(f.row, f.col) = kept;
  }
  m(40, 3) = 7.0f;
  r(40, 2) = nan;
  CHECK_THROWS_WITH_AS((void)dev::compute_gae_advantage_return<float>(flat(r), flat(v), flat(m), cols, 0.99, 0.95),
                       doctest::Contains("'token_level_rewards' has a non-finite value nan at [40, 2]"),
                       std::invalid_argument);
}

TEST_CASE("device: the GAE view (chunks and rows) on padded caller buffers equals the CPU's; a bad mask is a status") {
  namespace dev = mrr::device;
  const long rows = 37, cols = 1000, stride = 1013;  // rows padded: every view takes a row stride
  std::mt19937 rng(5);
  std::normal_distribution<double> n(0.0, 1.0);
  mrr::RowMatrix<double> r(rows, cols), v(rows, cols), m(rows, cols);
  std::vector<double> pr(static_cast<std::size_t>(rows * stride), -77.0), pv(pr), pm(pr);
  for (long i = 0; i < rows; ++i)
    for (long j = 0; j < cols; ++j) {
      r(i, j) = n(rng);
      v(i, j) = n(rng);
      m(i, j) = (j < cols - i * 19 && (j % 11) != 3) ? 1.0 : 0.0;
      const auto at = static_cast<std::size_t>(i * stride + j);
      pr[at] = r(i, j);
      pv[at] = v(i, j);
      pm[at] = m(i, j);
    }
  const auto host = mrr::ppo::compute_gae_advantage_return<double>(r, v, m, 0.99, 0.95);
  const auto in = [&](const std::vector<double>& b) {
    return dev::matrix_view<const double>(b.data(), rows, cols, stride);
  };
  // blocks is CUDA's kernel; on this system it runs chunks (the same bits, checked on a GPU).
  for (const auto algorithm : {dev::GaeAlgorithm::chunks, dev::GaeAlgorithm::rows, dev::GaeAlgorithm::blocks}) {
    CAPTURE(static_cast<int>(algorithm));
    std::vector<double> adv(pr.size(), 5.0), ret(pr.size(), 5.0);
    std::vector<unsigned char> ws(dev::gae_workspace_bytes<double>(rows, cols, algorithm));
    dev::DeviceStatus status;
    dev::compute_gae_advantage_return<double>(
        in(pr), in(pv), in(pm), 0.99, 0.95, dev::matrix_view(adv.data(), rows, cols, stride),
        dev::matrix_view(ret.data(), rows, cols, stride), dev::Workspace{ws.data(), ws.size()}, &status, {}, algorithm);
    CHECK(status.code == dev::status_ok);
    double worst_a = 0, worst_r = 0;
    for (long i = 0; i < rows; ++i) {
      for (long j = 0; j < cols; ++j) {
        const auto at = static_cast<std::size_t>(i * stride + j);
        worst_a = std::max(worst_a, std::abs(adv[at] - host.advantages(i, j)));
        worst_r = std::max(worst_r, std::abs(ret[at] - host.returns(i, j)));
      }
      CHECK(adv[static_cast<std::size_t>(i * stride + cols)] == 5.0);  // the padding is never written
    }
    CHECK(worst_a <= 1e-10);
    CHECK(worst_r <= 1e-10);
    // A mask selecting nothing, then one element: a status, and check_gae throws verl's error.
    std::vector<double> none(pm.size(), 0.0);
    dev::compute_gae_advantage_return<double>(
        in(pr), in(pv), in(none), 0.99, 0.95, dev::matrix_view(adv.data(), rows, cols, stride),
        dev::matrix_view(ret.data(), rows, cols, stride), dev::Workspace{ws.data(), ws.size()}, &status, {}, algorithm);
    CHECK(status.code == dev::status_mask_selects_none);
    CHECK_THROWS_WITH_AS(dev::check_gae(&status), doctest::Contains("selects no element"), std::invalid_argument);
    none[static_cast<std::size_t>(3 * stride + 7)] = 1.0;
    dev::compute_gae_advantage_return<double>(
        in(pr), in(pv), in(none), 0.99, 0.95, dev::matrix_view(adv.data(), rows, cols, stride),
        dev::matrix_view(ret.data(), rows, cols, stride), dev::Workspace{ws.data(), ws.size()}, &status, {}, algorithm);
    CHECK_THROWS_WITH_AS(dev::check_gae(&status), doctest::Contains("single element"), std::invalid_argument);
    // Inputs the CPU refuses are a status naming the lowest one, even where the mask is 0 and even
    // when the mask then selects nothing; the padding past each row is never read.
    const auto run = [&](const std::vector<double>& rewards, const std::vector<double>& values,
                         const std::vector<double>& mask) {
      dev::compute_gae_advantage_return<double>(in(rewards), in(values), in(mask), 0.99, 0.95,
                                                dev::matrix_view(adv.data(), rows, cols, stride),
                                                dev::matrix_view(ret.data(), rows, cols, stride),
                                                dev::Workspace{ws.data(), ws.size()}, &status, {}, algorithm);
    };
    auto bad_r = pr, bad_v = pv, bad_m = pm;
    bad_r[static_cast<std::size_t>(30 * stride + 999)] = std::numeric_limits<double>::quiet_NaN();
    bad_r[static_cast<std::size_t>(31 * stride + 2)] = std::numeric_limits<double>::infinity();
    CHECK(pm[static_cast<std::size_t>(30 * stride + 999)] == 0.0);
    run(bad_r, pv, pm);
    CHECK(status.code == dev::status_reward_not_finite);
    CHECK(status.index == 30 * cols + 999);
    CHECK_THROWS_WITH_AS(dev::check_gae(&status, {}, cols),
                         doctest::Contains("'token_level_rewards' has a non-finite value at [30, 999]"),
                         std::invalid_argument);
    CHECK_THROWS_WITH_AS(dev::check_gae(&status), doctest::Contains("at element 30999 (row-major)"),
                         std::invalid_argument);
    bad_v[static_cast<std::size_t>(30 * stride + 999)] = -std::numeric_limits<double>::infinity();
    run(pr, bad_v, pm);
    CHECK(status.code == dev::status_value_not_finite);
    CHECK_THROWS_WITH_AS(dev::check_gae(&status, {}, cols),
                         doctest::Contains("'values' has a non-finite value at [30, 999]"), std::invalid_argument);
    bad_m[static_cast<std::size_t>(36 * stride + 5)] = 0.5;
    bad_m[static_cast<std::size_t>(36 * stride + 6)] = 2.0;
    run(bad_r, bad_v, bad_m);  // the lowest element wins: the reward at [30, 999]
    CHECK(status.code == dev::status_reward_not_finite);
    run(pr, pv, bad_m);
    CHECK(status.code == dev::status_mask_not_binary);
    CHECK(status.index == 36 * cols + 5);
    CHECK_THROWS_WITH_AS(dev::check_gae(&status, {}, cols),
                         doctest::Contains("'response_mask' has a value other than 0 or 1 at [36, 5]"),
                         std::invalid_argument);
    std::vector<double> half(pm.size(), 0.0);
    half[static_cast<std::size_t>(2 * stride + 3)] = 0.5;  // selects "nothing" but is refused first
    run(pr, pv, half);
    CHECK(status.code == dev::status_mask_not_binary);
    CHECK(status.index == 2 * cols + 3);
    std::vector<double> padded_nan = pr;  // NaN in the padding only: not an input
    for (long i = 0; i < rows; ++i)
      padded_nan[static_cast<std::size_t>(i * stride + cols)] = std::numeric_limits<double>::quiet_NaN();
    run(padded_nan, pv, pm);
    CHECK(status.code == dev::status_ok);
    // A workspace smaller than asked for is an error before anything runs.
    CHECK_THROWS_WITH_AS(
        dev::compute_gae_advantage_return<double>(
            in(pr), in(pv), in(pm), 0.99, 0.95, dev::matrix_view(adv.data(), rows, cols, stride),
            dev::matrix_view(ret.data(), rows, cols, stride), dev::Workspace{ws.data(), 16}, &status, {}, algorithm),
        doctest::Contains("workspace"), std::invalid_argument);
  }
}
