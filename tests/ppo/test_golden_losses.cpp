// Golden cases of kl.json, agg.json, policy_loss.json and value_loss.json: values, verl's metrics
// and every grad_* output.
#include "ppo_golden.hpp"

#include <mrr/ppo/aggregate.hpp>
#include <mrr/ppo/kl.hpp>
#include <mrr/ppo/policy_loss.hpp>
#include <mrr/ppo/value_loss.hpp>

#include <doctest/doctest.h>

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace {

using namespace mrr;
using mrr::test::GoldenCase;
using mrr::test::ppo::OutputChecker;

// verl's global_batch_info and the seq-mean-token-sum-norm scale, when a case sets them.
ppo::GlobalBatchInfo batch_info(const GoldenCase& c) {
  ppo::GlobalBatchInfo info;
  info.dp_size = c.param<std::int64_t>("dp_size", 1);
  if (c.has_param("batch_num_tokens")) info.batch_num_tokens = c.param<double>("batch_num_tokens");
  if (c.has_param("global_batch_size")) info.global_batch_size = c.param<double>("global_batch_size");
  if (c.has_param("loss_scale_factor")) info.loss_scale_factor = c.param<double>("loss_scale_factor");
  return info;
}

ppo::LossAggMode agg_mode(const GoldenCase& c) {
  return ppo::parse_loss_agg_mode(c.param<std::string>("loss_agg_mode", "token-mean"));
}

template <class T>
bool run_kl(const GoldenCase& c, OutputChecker<T>& check) {
  if (c.fn == "kl_penalty") {
    const auto out = ppo::kl_penalty<T>(c.input("logprob").matrix<T>(), c.input("ref_logprob").matrix<T>(),
                                        c.param<std::string>("kl_penalty"));
    check.matrix("out", out.values);
    check.matrix("grad_logprob", out.grad_logprob);
    return true;
  }
  if (c.fn == "compute_rewards") {
    const auto out =
        ppo::compute_rewards<T>(c.input("token_level_scores").matrix<T>(), c.input("old_log_prob").matrix<T>(),
                                c.input("ref_log_prob").matrix<T>(), c.param<double>("kl_ratio"));
    check.matrix("out", out);
    return true;
  }
  if (c.fn == "adaptive_kl_controller") {
    auto controller = ppo::KlController<T>::adaptive(c.param<double>("init_kl_coef"), c.param<double>("target_kl"),
                                                     c.param<double>("horizon"));
    const auto current = c.input("current_kl").values<T>();
    Vector<T> values(static_cast<Eigen::Index>(current.size()));
    for (std::size_t k = 0; k < current.size(); ++k) {
      controller.update(current[k], c.param<std::int64_t>("n_steps"));
      values[static_cast<Eigen::Index>(k)] = controller.value();
    }
    check.matrix("values", values);
    return true;
  }
  return false;
}

template <class T>
bool run_agg(const GoldenCase& c, OutputChecker<T>& check) {
  if (c.fn != "agg_loss") return false;
  const T out =
      ppo::agg_loss<T>(c.input("loss_mat").matrix<T>(), c.input("loss_mask").matrix<T>(), agg_mode(c), batch_info(c));
  check.scalar("out", static_cast<double>(out));
  return true;
}

template <class T>
bool run_policy_loss(const GoldenCase& c, OutputChecker<T>& check) {
  if (c.fn != "policy_loss") return false;
  ppo::PolicyLossConfig config;
  config.clip_ratio = c.param<double>("clip_ratio", config.clip_ratio);
  if (c.has_param("clip_ratio_low")) config.clip_ratio_low = c.param<double>("clip_ratio_low");
  if (c.has_param("clip_ratio_high")) config.clip_ratio_high = c.param<double>("clip_ratio_high");
  config.clip_ratio_c = c.param<double>("clip_ratio_c", config.clip_ratio_c);
  config.tau_pos = c.param<double>("tau_pos", config.tau_pos);
  config.tau_neg = c.param<double>("tau_neg", config.tau_neg);
  if (c.has_param("dro_beta")) config.dro_beta = c.param<double>("dro_beta");
  config.kl_cov_ratio = c.param<double>("kl_cov_ratio", config.kl_cov_ratio);
  config.ppo_kl_coef = c.param<double>("ppo_kl_coef", config.ppo_kl_coef);
  config.clip_cov_ratio = c.param<double>("clip_cov_ratio", config.clip_cov_ratio);
  config.clip_cov_lb = c.param<double>("clip_cov_lb", config.clip_cov_lb);
  config.clip_cov_ub = c.param<double>("clip_cov_ub", config.clip_cov_ub);
  config.global_batch_info = batch_info(c);
  if (c.has_param("rollout_correction.loss_type"))
    config.rollout_correction = mrr::test::ppo::rollout_correction_config(c, "rollout_correction.");

  const RowMatrix<T> old_log_prob = c.input("old_log_prob").matrix<T>();
  const RowMatrix<T> log_prob = c.input("log_prob").matrix<T>();
  const RowMatrix<T> advantages = c.input("advantages").matrix<T>();
  const RowMatrix<T> mask = c.input("response_mask").matrix<T>();
  std::optional<RowMatrix<T>> weights;
  if (c.has_input("rollout_is_weights")) weights = c.input("rollout_is_weights").matrix<T>();
  ppo::OptionalMatrixView<T> weights_ref;
  if (weights) weights_ref = *weights;

  const auto out =
      ppo::compute_policy_loss<T>(ppo::parse_policy_loss(c.param<std::string>("policy_loss")), old_log_prob, log_prob,
                                  advantages, mask, agg_mode(c), config, weights_ref);
  check.scalar("loss", static_cast<double>(out.loss));
  check.matrix("grad_log_prob", out.grad_log_prob);
  // Exactly verl's metric keys: each golden metric is ours, and we report no other.
  mrr::test::ppo::check_metrics(check, out.metrics);
  return true;
}

template <class T>
bool run_value_loss(const GoldenCase& c, OutputChecker<T>& check) {
  if (c.fn == "value_loss") {
    const auto out = ppo::compute_value_loss<T>(c.input("vpreds").matrix<T>(), c.input("returns").matrix<T>(),
                                                c.input("values").matrix<T>(), c.input("response_mask").matrix<T>(),
                                                c.param<double>("cliprange_value"), agg_mode(c), batch_info(c));
    check.scalar("loss", static_cast<double>(out.loss));
    check.scalar("clipfrac", static_cast<double>(out.clipfrac));
    check.matrix("grad_vpreds", out.grad_vpreds);
    return true;
  }
  if (c.fn == "entropy_loss") {
    const RowMatrix<T> logits = mrr::test::ppo::token_rows<T>(c.input("logits"));
    const auto out =
        ppo::compute_entropy_loss<T>(logits, c.input("response_mask").matrix<T>(), agg_mode(c), batch_info(c));
    check.scalar("loss", static_cast<double>(out.loss));
    check.matrix("grad_logits", out.grad_logits);
    return true;
  }
  return false;
}

}  // namespace

TEST_SUITE("golden") {
  TEST_CASE_TEMPLATE("kl.json: KL penalties, gradients, compute_rewards, adaptive controller", T, double, float) {
    mrr::test::ppo::for_each_case<T>("kl.json",
                                     [](const GoldenCase& c, OutputChecker<T>& check) { return run_kl<T>(c, check); });
  }

  TEST_CASE_TEMPLATE("agg.json: loss aggregation modes with dp_size and global counts", T, double, float) {
    mrr::test::ppo::for_each_case<T>("agg.json",
                                     [](const GoldenCase& c, OutputChecker<T>& check) { return run_agg<T>(c, check); });
  }

  TEST_CASE_TEMPLATE("policy_loss.json: losses, metrics and grad_log_prob", T, double, float) {
    mrr::test::ppo::for_each_case<T>(
        "policy_loss.json", [](const GoldenCase& c, OutputChecker<T>& check) { return run_policy_loss<T>(c, check); });
  }

  TEST_CASE_TEMPLATE("value_loss.json: clipped value loss and entropy loss with gradients", T, double, float) {
    mrr::test::ppo::for_each_case<T>(
        "value_loss.json", [](const GoldenCase& c, OutputChecker<T>& check) { return run_value_loss<T>(c, check); });
  }
}
