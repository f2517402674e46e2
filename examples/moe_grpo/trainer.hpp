// The GRPO trainer: rollout (bf16 engine, seeded sampling, routes recorded) -> rewards ->
// group advantages -> old-log-prob pass -> (reference pass) -> PPO updates with AdamW, with
// router replay disabled, R2 or R3 (verl's configuration keys), on one or more expert-parallel
// ranks. Every rank runs run_rank(); metrics reach rank 0's callback.
//
// Bitwise independence of the number of ranks: a mini-batch's sequences are split contiguously
// over the ranks (global order = rank order), the MoE layer is P-independent by construction,
// dense layers run per sequence, and the replicated parameters' gradient is the sum of
// per-sequence gradients gathered from every rank and added in global sequence order.
#pragma once

#include "model.hpp"

#include <mrr/diagnostics.hpp>
#include <mrr/ppo/grpo_step.hpp>
#include <mrr/ppo/rollout_correction.hpp>
#include <mrr/ppo/value_loss.hpp>
#include <mrr/replay/config.hpp>
#include <mrr/replay/open_store.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace moe_grpo {

// verl's names of the numeric options: what set_option reads and what validation errors name.
namespace keys {
inline constexpr std::string_view steps = "trainer.total_training_steps";
inline constexpr std::string_view seed = "trainer.seed";
inline constexpr std::string_view ranks = "trainer.n_ranks";
inline constexpr std::string_view batch = "data.train_batch_size";
inline constexpr std::string_view max_operand = "data.max_operand";
inline constexpr std::string_view group = "actor_rollout_ref.rollout.n";
inline constexpr std::string_view temperature = "actor_rollout_ref.rollout.temperature";
inline constexpr std::string_view top_k = "actor_rollout_ref.rollout.top_k";
inline constexpr std::string_view top_p = "actor_rollout_ref.rollout.top_p";
inline constexpr std::string_view lr = "actor_rollout_ref.actor.optim.lr";
inline constexpr std::string_view weight_decay = "actor_rollout_ref.actor.optim.weight_decay";
inline constexpr std::string_view mini_batch = "actor_rollout_ref.actor.ppo_mini_batch_size";
inline constexpr std::string_view ppo_epochs = "actor_rollout_ref.actor.ppo_epochs";
inline constexpr std::string_view clip_ratio = "actor_rollout_ref.actor.clip_ratio";
inline constexpr std::string_view clip_ratio_low = "actor_rollout_ref.actor.clip_ratio_low";
inline constexpr std::string_view clip_ratio_high = "actor_rollout_ref.actor.clip_ratio_high";
inline constexpr std::string_view kl_loss_coef = "actor_rollout_ref.actor.kl_loss_coef";
inline constexpr std::string_view entropy_coeff = "actor_rollout_ref.actor.entropy_coeff";
inline constexpr std::string_view experts = "actor_rollout_ref.model.num_experts";
inline constexpr std::string_view topk = "actor_rollout_ref.model.moe_topk";
inline constexpr std::string_view hidden = "actor_rollout_ref.model.hidden_size";
inline constexpr std::string_view layers = "actor_rollout_ref.model.num_layers";
inline constexpr std::string_view expert_hidden = "actor_rollout_ref.model.moe_intermediate_size";
}  // namespace keys

// The example's limits, checked before anything is sized: below them every count and offset fits
// an int and a step's memory stays within a few GiB. verl's recipes sit far inside them.
inline constexpr int kMaxSequencesPerStep = 65536;  // data.train_batch_size x rollout.n
inline constexpr int kMaxSteps = 1 << 24;           // trainer.total_training_steps (a uid's 24 step bits)
inline constexpr int kMaxDimension = 65536;         // num_experts, hidden_size, moe_intermediate_size
inline constexpr std::int64_t kMaxParameters = std::int64_t{1} << 28;  // 1 GiB of floats; AdamW keeps 3 more copies
inline constexpr int kMaxPpoEpochs = 1000;
inline constexpr int kMaxOperand = 9;  // the operands are single-digit tokens

namespace detail {

// Throws "<key> must be <range>, got <value>" unless `ok`.
template <class T>
void require_option(bool ok, std::string_view key, std::string_view range, const T& value) {
  if (!ok) throw mrr::ConfigError(mrr::detail::str(key, " must be ", range, ", got ", value));
}

inline bool finite_at_least(double v, double low) { return std::isfinite(v) && v >= low; }

}  // namespace detail

struct TrainConfig {
  ModelConfig model;
  mrr::ReplayConfig replay;
  mrr::ppo::GrpoStepConfig grpo;
  std::uint64_t seed = 1;
  int steps = 30;             // trainer.total_training_steps
  int prompts = 16;           // data.train_batch_size
  int group = 8;              // actor_rollout_ref.rollout.n
  int mini_batch_prompts = 8; // actor_rollout_ref.actor.ppo_mini_batch_size (prompts)
  int ppo_epochs = 1;         // actor_rollout_ref.actor.ppo_epochs
  float lr = 3e-3f;           // actor_rollout_ref.actor.optim.lr
  float weight_decay = 0.0f;  // actor_rollout_ref.actor.optim.weight_decay
  int max_operand = 4;        // the task: a + b with a, b in [0, max_operand]
  mrr::rollout::SamplingParams sampling;
  bool rollout_bf16 = true;   // actor_rollout_ref.rollout.dtype: bf16 (vLLM-like) or fp32
  // dtype=fp8: bf16 numerics plus e4m3 with per-block scales on the MoE and gate GEMMs' inputs and
  // weights (fp8 rollout engines' recipe), which the training engine does not have.
  bool rollout_fp8 = false;
  // verl's rollout correction (algorithm.rollout_correction.rollout_is / rollout_is_threshold):
  // token-level truncated importance sampling, weights min(pi_old / pi_rollout, threshold) on the
  // policy loss (TIS). Off by default.
  bool rollout_tis = false;
  double rollout_is_threshold = 2.0;
  // verl's entropy bonus (actor_rollout_ref.actor.entropy_coeff): the loss is the policy loss minus
  // entropy_coeff x the policy's entropy over response tokens (softmax of logits / temperature),
  // aggregated as the policy loss is (loss_agg_mode, global token and sequence counts). 0: off.
  double entropy_coeff = 0.0;
  // verl's rejection sampling (algorithm.rollout_correction.rollout_rs / rollout_rs_threshold):
  // tokens or whole sequences whose divergence between the old-log-prob pass and the rollout
  // exceeds the threshold are masked out of the loss (mrr::ppo::compute_rollout_rejection_mask).
  // Each decision is a token's or a sequence's own, so any rank count masks the same tokens.
  // Empty: off.
  std::string rollout_rs, rollout_rs_threshold;
  // The parsed options (validate() fills them), or none when rollout_rs is empty.
  std::optional<mrr::ppo::RolloutRsOptions> rollout_rs_options() const {
    if (rollout_rs.empty()) return std::nullopt;
    constexpr const char* key = "algorithm.rollout_correction.rollout_rs";
    if (rollout_rs_threshold.empty())
      throw mrr::ConfigError(std::string(key) + " is set ('" + rollout_rs +
                             "'): algorithm.rollout_correction.rollout_rs_threshold must be given too");
    try {
      return mrr::ppo::RolloutRsOptions::parse(rollout_rs, rollout_rs_threshold);
    } catch (const mrr::InvalidArgument& e) {
      throw mrr::ConfigError(std::string(key) + " / rollout_rs_threshold: " + e.what());
    }
  }
  // The paired, counterfactual measurement (StepMetrics::paired_*): every step, the rollout's
  // tokens are scored on the step's weights twice, routed natively and replaying the rollout's
  // routes. paired_reuse takes one of the two from the mode's own old-log-prob pass when that pass
  // is exactly it (the same forward on the same weights: bitwise equal, one forward saved).
  bool paired_metrics = true;
  bool paired_reuse = true;

  // Every option in its range, before anything is sized or run; `ranks` is the number of
  // expert-parallel ranks. Errors name verl's key, the accepted range and the value given.
  void validate(int ranks = 1) const {
    validate_batch();
    validate_numerics();
    validate_model();
    validate_ranks(ranks);
    replay.validate();
    grpo.validate();
    sampling.validate();
  }

  // The tag in every sequence uid of the run (bits 40..63; the step in 16..39, the sequence's index
  // in the step's batch in 0..15): a hash of every option that decides the run's tokens. The
  // router-replay keys are left out, so a run replaying a record samples what the recording run
  // sampled whatever its mode, and so are the paired metrics (they change nothing). A replay_file
  // recorded by a run with another seed, task, batch, model, rollout numerics or training option
  // holds none of this run's uids: an error, never the routes of other tokens.
  std::uint64_t run_tag() const {
    std::uint64_t h = 1469598103934665603ull;  // FNV-1a over each value's bytes
    const auto mix = [&h](const auto& v) {
      unsigned char bytes[sizeof v];
      std::memcpy(bytes, &v, sizeof v);
      for (const unsigned char b : bytes)
        h = (h ^ b) * 1099511628211ull;
    };
    const auto mix_text = [&](const std::string& s) {
      mix(s.size());
      for (const char c : s)
        mix(c);
    };
    const auto mix_optional = [&](const std::optional<double>& v) {
      mix(v.has_value());
      mix(v.value_or(0.0));
    };
    mix(seed), mix(prompts), mix(group), mix(mini_batch_prompts), mix(ppo_epochs), mix(lr), mix(weight_decay);
    mix(max_operand), mix(sampling.temperature), mix(sampling.top_k), mix(sampling.top_p);
    mix(rollout_bf16), mix(rollout_fp8), mix(rollout_tis), mix(rollout_is_threshold);
    mix(model.vocab), mix(model.hidden), mix(model.heads), mix(model.layers), mix(model.max_seq);
    mix(model.experts), mix(model.topk), mix(model.expert_hidden), mix(model.init_std);
    mix_text(grpo.adv_estimator), mix_text(grpo.policy_loss), mix_text(grpo.loss_agg_mode), mix_text(grpo.kl_loss_type);
    mix(grpo.advantage.gamma), mix(grpo.advantage.lam), mix(grpo.advantage.epsilon);
    mix(grpo.advantage.norm_adv_by_std_in_grpo), mix(grpo.advantage.f_norm);
    const auto& policy = grpo.policy;
    mix(policy.clip_ratio), mix_optional(policy.clip_ratio_low), mix_optional(policy.clip_ratio_high);
    mix(policy.clip_ratio_c), mix(policy.tau_pos), mix(policy.tau_neg), mix_optional(policy.dro_beta);
    mix(grpo.use_kl_loss), mix(grpo.kl_loss_coef);
    if (!rollout_rs.empty()) mix_text(rollout_rs), mix_text(rollout_rs_threshold);  // (runs without it keep their tag)
    if (entropy_coeff != 0) mix(entropy_coeff);                                     // (the same)
    return (h ^ (h >> 24) ^ (h >> 48)) & 0xffffffull;
  }
  // The uid of sequence `index` of the step's batch (validate() keeps both in their bits).
  mrr::SequenceId sequence_uid(std::uint64_t tag, int step, int index) const {
    return tag << 40 | static_cast<std::uint64_t>(step) << 16 | static_cast<std::uint64_t>(index);
  }

  int sequences() const { return prompts * group; }
  int mini_batches() const { return prompts / mini_batch_prompts; }
  int response_length() const { return model.max_seq - kPromptLength; }

 private:
  void validate_batch() const {
    using detail::require_option;
    using mrr::detail::str;
    const std::string sequences_range = str("in [1, ", kMaxSequencesPerStep, "]");
    require_option(steps >= 0 && steps <= kMaxSteps, keys::steps, str("in [0, ", kMaxSteps, "]"), steps);
    require_option(prompts >= 1 && prompts <= kMaxSequencesPerStep, keys::batch, sequences_range, prompts);
    require_option(group >= 1 && group <= kMaxSequencesPerStep, keys::group, sequences_range, group);
    if (static_cast<std::int64_t>(prompts) * group > kMaxSequencesPerStep)
      throw mrr::ConfigError(str(keys::batch, " x ", keys::group, " must be at most ", kMaxSequencesPerStep,
                                 " sequences per step, got ", prompts, " x ", group));
    require_option(mini_batch_prompts >= 1 && mini_batch_prompts <= prompts, keys::mini_batch,
                   str("in [1, ", keys::batch, " = ", prompts, "]"), mini_batch_prompts);
    if (prompts % mini_batch_prompts != 0)
      throw mrr::ConfigError(str(keys::batch, " (", prompts, ") must be a multiple of ", keys::mini_batch, " (",
                                 mini_batch_prompts, ")"));
    require_option(ppo_epochs >= 1 && ppo_epochs <= kMaxPpoEpochs, keys::ppo_epochs, str("in [1, ", kMaxPpoEpochs, "]"),
                   ppo_epochs);
    require_option(max_operand >= 0 && max_operand <= kMaxOperand, keys::max_operand,
                   str("in [0, ", kMaxOperand, "] (the operands are single-digit tokens)"), max_operand);
  }

  // Real-valued options: NaN and infinities fail every range.
  void validate_numerics() const {
    using detail::finite_at_least;
    using detail::require_option;
    require_option(finite_at_least(lr, 0), keys::lr, "finite and >= 0", lr);
    require_option(finite_at_least(weight_decay, 0), keys::weight_decay, "finite and >= 0", weight_decay);
    require_option(finite_at_least(sampling.temperature, 0), keys::temperature, "finite and >= 0 (0: greedy)",
                   sampling.temperature);
    require_option(sampling.top_k >= -1, keys::top_k, "-1 or 0 (off) or >= 1", sampling.top_k);
    require_option(sampling.top_p > 0 && sampling.top_p <= 1, keys::top_p, "in (0, 1]", sampling.top_p);
    require_option(finite_at_least(grpo.kl_loss_coef, 0), keys::kl_loss_coef, "finite and >= 0", grpo.kl_loss_coef);
    require_option(finite_at_least(entropy_coeff, 0), keys::entropy_coeff, "finite and >= 0", entropy_coeff);
    require_option(std::isfinite(rollout_is_threshold) && rollout_is_threshold >= 1,
                   "algorithm.rollout_correction.rollout_is_threshold", "finite and >= 1", rollout_is_threshold);
    rollout_rs_options();  // throws ConfigError naming the key
    // The ratio is clipped to [1 - low, 1 + high]: low in (0, 1) keeps the lower bound positive.
    const auto& policy = grpo.policy;
    const auto in_unit = [](double v) { return v > 0 && v < 1; };
    require_option(std::isfinite(policy.clip_ratio) && policy.clip_ratio > 0, keys::clip_ratio, "finite and > 0",
                   policy.clip_ratio);
    if (policy.clip_ratio_low)
      require_option(in_unit(*policy.clip_ratio_low), keys::clip_ratio_low, "in (0, 1)", *policy.clip_ratio_low);
    else
      require_option(in_unit(policy.clip_ratio), keys::clip_ratio,
                     mrr::detail::str("in (0, 1) while it is also the lower clip (", keys::clip_ratio_low, " unset)"),
                     policy.clip_ratio);
    if (policy.clip_ratio_high)
      require_option(std::isfinite(*policy.clip_ratio_high) && *policy.clip_ratio_high > 0, keys::clip_ratio_high,
                     "finite and > 0", *policy.clip_ratio_high);
    // kl_cov and clip_cov choose tokens by statistics of the whole micro-batch; this example forms
    // the loss sequence by sequence (so any rank count gives the same bits), where they would
    // choose per sequence instead: refused rather than computed differently from verl.
    if (grpo.policy_loss == "kl_cov" || grpo.policy_loss == "clip_cov")
      throw mrr::ConfigError(mrr::detail::str(
          "actor_rollout_ref.actor.policy_loss.loss_mode: '", grpo.policy_loss,
          "' selects tokens across a whole micro-batch, and this example computes its loss sequence by sequence "
          "(the same bits for any rank count); mrr::ppo::compute_policy_loss provides it on whole micro-batches"));
    // bypass_mode replaces the old-log-prob pass with the rollout's log-probs; this example
    // recomputes them in its own pass (that is what routing replay records) and has no
    // rollout_correction settings.
    if (grpo.policy_loss == "bypass_mode")
      throw mrr::ConfigError(
          "actor_rollout_ref.actor.policy_loss.loss_mode: 'bypass_mode' trains on the rollout engine's log-probs "
          "instead of an old-log-prob pass, which this example always runs (routing replay records in it); "
          "mrr::ppo::compute_policy_loss provides it with PolicyLossConfig::rollout_correction");
    // GAE needs a critic's values and ReMax a greedy rollout's reward; this example has neither.
    const auto estimator = mrr::ppo::parse_advantage_estimator(grpo.adv_estimator);
    if (estimator == mrr::ppo::AdvantageEstimator::gae || estimator == mrr::ppo::AdvantageEstimator::remax)
      throw mrr::ConfigError(mrr::detail::str(
          "algorithm.adv_estimator: '", grpo.adv_estimator, "' needs ",
          estimator == mrr::ppo::AdvantageEstimator::gae ? "a critic's values" : "a greedy rollout's reward baseline",
          ", which this example does not compute; its estimators take the rewards and groups (and, for the optimal "
          "token baselines, the old-log-prob pass)"));
  }

  void validate_model() const {
    using detail::require_option;
    using mrr::detail::str;
    const std::string dimension = str("in [1, ", kMaxDimension, "]");
    require_option(model.experts >= 1 && model.experts <= kMaxDimension, keys::experts, dimension, model.experts);
    const int max_topk = std::min(model.experts, mrr::RouteShape::kMaxTopk);
    require_option(model.topk >= 1 && model.topk <= max_topk, keys::topk,
                   str("in [1, ", max_topk, "] (", keys::experts, " = ", model.experts, ")"), model.topk);
    require_option(model.hidden >= model.heads && model.hidden <= kMaxDimension && model.hidden % model.heads == 0,
                   keys::hidden, str("a multiple of the ", model.heads, " attention heads in [", model.heads, ", ",
                                     kMaxDimension, "]"),
                   model.hidden);
    require_option(model.layers >= 1 && model.layers <= mrr::RouteShape::kMaxLayers, keys::layers,
                   str("in [1, ", mrr::RouteShape::kMaxLayers, "]"), model.layers);
    require_option(model.expert_hidden >= 1 && model.expert_hidden <= kMaxDimension, keys::expert_hidden, dimension,
                   model.expert_hidden);
    if (const double parameters = parameter_count(model); parameters > static_cast<double>(kMaxParameters)) {
      char count[400];  // every digit of the double: the count may exceed 2^64
      std::snprintf(count, sizeof count, "%.0f", parameters);
      throw mrr::ConfigError(str("the model has ", count, " parameters, more than the example's ", kMaxParameters,
                                 " (2^28): lower ", keys::layers, ", ", keys::experts, ", ", keys::hidden, " or ",
                                 keys::expert_hidden));
    }
  }

  void validate_ranks(int ranks) const {
    using mrr::detail::str;
    detail::require_option(ranks >= 1 && ranks <= model.experts, str(keys::ranks, " (--ranks)"),
                           str("in [1, ", keys::experts, " = ", model.experts, "]"), ranks);
    if (model.experts % ranks != 0)
      throw mrr::ConfigError(str(keys::experts, " (", model.experts, ") do not split evenly over ", ranks, " ranks"));
    if ((mini_batch_prompts * group) % ranks != 0)
      throw mrr::ConfigError(str("a mini-batch of ", mini_batch_prompts * group, " sequences (", keys::mini_batch,
                                 " x ", keys::group, ") does not split evenly over ", ranks, " ranks"));
  }
};

struct StepMetrics {
  int step = 0;
  double reward = 0, accuracy = 0, response_length = 0;
  // rollout vs training (old-log-prob pass): router decisions that differ, tokens with any layer differing
  double rollout_mismatch_decisions = 0, rollout_mismatch_tokens = 0;
  std::int64_t compared_rows = 0;  // (token, layer) rows the rollout has a route for
  double k3 = 0, k1 = 0, max_abs_dlogp = 0, mean_abs_dlogp = 0;
  // The same comparison by the R3 paper's definitions (mrr/diagnostics.hpp): the fraction of
  // (token, layer) decisions whose expert *set* differs (the columns above count differing experts),
  // mean differing layers per token, F(2) and F(5) (tokens with max(p/q, q/p) > tau) and the p99
  // of |delta log p|, over every rank's tokens.
  double rollout_decisions_differing = 0, rollout_mean_differing_layers = 0;
  double f2 = 0, f5 = 0, p99_abs_dlogp = 0;
  // The same-engine floor: k3 between two no-gradient training passes on the same weights and
  // tokens in different micro-batch compositions (sequences reversed), both routed natively.
  double floor_k3 = 0;
  double grad_norm = 0;  // global L2 norm of each update's gradient, mean over the step's updates
  double entropy = 0;    // mean entropy of the policy over response tokens (old-log-prob pass)
  // The paired measurement, the same in every mode: on the step's weights (before any update) and
  // the rollout's tokens, a no-gradient pass of the training engine routed natively and one
  // replaying the rollout's routes (R3-style), each against the rollout: routing mismatch over the
  // rows the rollout has a route for, k3 KL and mean |delta log p|. The replayed pass's mismatch is
  // 0 by construction (a check); the difference between the two is what routing alone contributes.
  double paired_native_mismatch_decisions = 0, paired_native_mismatch_tokens = 0;
  double paired_native_k3 = 0, paired_native_mean_abs_dlogp = 0;
  double paired_replay_mismatch_decisions = 0, paired_replay_k3 = 0, paired_replay_mean_abs_dlogp = 0;
  std::uint64_t paired_replayed_rows = 0;  // rows the replayed pass took from the rollout
  double paired_native_decisions_differing = 0, paired_native_f2 = 0, paired_replay_f2 = 0;
  // old-log-prob pass vs update passes: router decisions that differ
  double update_mismatch_decisions = 0;
  double loss = 0, pg_clipfrac = 0, ppo_kl = 0, kl_loss = 0;
  // Rejection sampling (rollout_rs): the share of response tokens it masked out of the loss.
  double rollout_rs_masked_fraction = 0;
  double load_max_over_mean = 0;  // expert load (old-log-prob pass), worst layer
  std::uint64_t replayed_rows = 0, native_rows = 0, recorded_rows = 0;
  double wall_seconds = 0;
  std::uint64_t params_digest = 0;
  // A hash of every expert id the training passes used (old-log-prob and updates), sequence by
  // sequence in global order: equal for equal routing whatever the number of ranks.
  std::uint64_t routes_digest = 0;
};

namespace detail {

inline std::uint64_t hash_ids(const mrr::ExpertIds& ids, Eigen::Index first_row, Eigen::Index rows, std::uint64_t h) {
  for (Eigen::Index r = first_row; r < first_row + rows; ++r)
    for (Eigen::Index j = 0; j < ids.cols(); ++j)
      h = (h ^ static_cast<std::uint32_t>(ids(r, j))) * 1099511628211ull;
  return h;
}

inline std::uint64_t hash_floats(const float* p, Eigen::Index n, std::uint64_t h = 1469598103934665603ull) {
  for (Eigen::Index i = 0; i < n; ++i) {
    std::uint32_t u;
    std::memcpy(&u, p + i, 4);
    h = (h ^ u) * 1099511628211ull;
  }
  return h;
}

// One training-engine pass compared with the rollout: routing counts over the rows the rollout
// has a route for, and the log-prob divergence sums (token-weighted).
struct RolloutComparison {
  std::int64_t decisions = 0, differing_decisions = 0, tokens = 0, differing_tokens = 0;
  double k3_sum = 0, k1_sum = 0, abs_sum = 0, lp_tokens = 0, max_abs = 0;
  mrr::RoutingMismatch routing;   // by (token, layer) decision, mrr/diagnostics.hpp
  std::vector<double> abs_dlogp;  // |log p_train - log p_rollout| of every compared token
};

}  // namespace detail

// verl's entropy bonus on one sequence: -coeff x agg(entropy(softmax(z / temperature))) over its
// response positions (rows of `logits`, raw logits z; `mask` [1, rows]), aggregated with the
// policy loss's mode and global counts, so the sequences' terms add up to the mini-batch's; and
// its gradient w.r.t. the raw logits.
struct EntropyBonus {
  float loss = 0;
  Mat grad_logits;
};
template <class Logits>
EntropyBonus entropy_bonus(const Logits& logits, const Mat& mask, double temperature, double coeff,
                           mrr::ppo::LossAggMode mode, const mrr::ppo::GlobalBatchInfo& info) {
  const float t = static_cast<float>(temperature), c = static_cast<float>(coeff);
  const Mat z = logits / t;
  const auto r = mrr::ppo::compute_entropy_loss<float>(z, mask, mode, info);
  return {-c * r.loss, (-c / t) * r.grad_logits};
}

template <class Comm>
class Trainer {
 public:
  using Callback = std::function<void(const StepMetrics&)>;

  Trainer(const TrainConfig& cfg, Comm comm) : cfg_(cfg), comm_(comm) {
    const int ranks = static_cast<int>(comm.size());
    cfg_.validate(ranks);
    rs_options_ = cfg_.rollout_rs_options();
    const mrr::RouteShape shape{cfg.model.experts, cfg.model.layers, cfg.model.topk};
    // Route files: one per rank when there are several (a rank replays only its own sequences).
    mrr::ReplayConfig files = cfg_.replay;
    if (ranks > 1) {
      const std::string suffix = ".rank" + std::to_string(comm.rank());
      if (!files.record_file.empty()) files.record_file += suffix;
      if (!files.replay_file.empty()) files.replay_file += suffix;
    }
    auto file = mrr::open_route_file(files, shape);
    const auto mode = cfg_.replay.mode;
    if (mode == mrr::ReplayMode::R3) {
      // R3: the rollout records routes; training replays them (or those of replay_file).
      if (file && files.replay_file.empty()) {
        rollout_store_ = std::make_unique<AnyRouteStore>(std::move(*file));
      } else {
        rollout_store_ = std::make_unique<AnyRouteStore>(shape);
        if (file) train_store_ = std::make_unique<AnyRouteStore>(std::move(*file));
      }
    } else {
      rollout_store_ = std::make_unique<AnyRouteStore>(shape);
      if (file) train_store_ = std::make_unique<AnyRouteStore>(std::move(*file));
    }
    if (!train_store_ && mode != mrr::ReplayMode::R3) train_store_ = std::make_unique<AnyRouteStore>(shape);
    AnyRouteStore& train_store = train_store_ ? *train_store_ : *rollout_store_;
    r2_replays_file_ = mode == mrr::ReplayMode::R2 && !files.replay_file.empty() && files.record_file.empty();
    run_tag_ = cfg_.run_tag();
    if (r2_replays_file_ || (mode == mrr::ReplayMode::R3 && !files.replay_file.empty()))
      replayed_file_ = files.replay_file;
    ref_store_ = std::make_unique<AnyRouteStore>(shape);
    train_ = std::make_unique<Engine<Comm>>(cfg.model, comm, train_store, mode, false);
    train_->replay().set_activation_recompute(false);  // the backward keeps activations
    rollout_ = std::make_unique<Engine<Comm>>(cfg.model, comm, *rollout_store_, mrr::ReplayMode::R2, cfg.rollout_bf16,
                                             cfg.rollout_fp8);
    if (cfg.grpo.use_kl_loss)
      ref_ = std::make_unique<Engine<Comm>>(cfg.model, comm, *ref_store_, mrr::ReplayMode::disabled, false);
    if (cfg.paired_metrics) {
      // Its own RoutingReplay (R3: replays what the rollout recorded, each sequence's last token
      // natively) over the rollout's store, which it only reads: the run's queues and stores are
      // untouched. Which side the mode's old-log-prob pass already is, if any:
      paired_ = std::make_unique<Engine<Comm>>(cfg.model, comm, *rollout_store_, mrr::ReplayMode::R3, false);
      paired_->replay().set_activation_recompute(false);
      if (cfg.paired_reuse) {
        old_is_native_ = mode == mrr::ReplayMode::disabled || (mode == mrr::ReplayMode::R2 && !r2_replays_file_);
        old_is_replay_ = mode == mrr::ReplayMode::R3 && &train_store == rollout_store_.get();
      }
    }
    params_ = init_params(cfg.model, cfg.seed, train_->first_expert(), train_->local_experts());
    train_->load(params_);
    if (ref_) ref_->load(params_);
    dense_opt_.lr = expert_opt_.lr = cfg.lr;
    dense_opt_.weight_decay = expert_opt_.weight_decay = cfg.weight_decay;
  }

  void run(const Callback& on_step) {
    for (int step = 0; step < cfg_.steps; ++step) on_step(train_step(step));
  }

  StepMetrics train_step(int step) {
    const auto t0 = std::chrono::steady_clock::now();
    StepMetrics m;
    m.step = step;
    const int ranks = static_cast<int>(comm_.size()), rank = static_cast<int>(comm_.rank());
    const int mb = cfg_.mini_batches(), per_mb = cfg_.mini_batch_prompts * cfg_.group, local_n = per_mb / ranks;
    const int R = cfg_.response_length(), S = cfg_.model.max_seq, k = cfg_.model.topk, L = cfg_.model.layers;
    const auto stats0 = train_->replay().stats();

    // The rank's sequences, mini-batch by mini-batch: a contiguous slice of each.
    std::vector<Batch> batches(static_cast<std::size_t>(mb));
    for (int b = 0; b < mb; ++b) {
      Batch& batch = batches[static_cast<std::size_t>(b)];
      for (int i = 0; i < local_n; ++i) {
        const int global = b * per_mb + rank * local_n + i;
        batch.global.push_back(global);
        batch.uids.push_back(cfg_.sequence_uid(run_tag_, step, global));
        // The sampler's stream: the step and the index, as before uids carried the run's tag.
        batch.streams.push_back((static_cast<std::uint64_t>(step) << 32) | static_cast<std::uint64_t>(global));
        batch.problems.push_back(make_problem(cfg_.seed, step, global / cfg_.group, cfg_.max_operand));
      }
    }

    // A replayed route file must hold this run's sequences: one recorded by a run with other
    // options would give routes of other tokens.
    if (!replayed_file_.empty())
      for (const auto& batch : batches)
        for (std::size_t i = 0; i < batch.uids.size(); ++i)
          if (!train_store_->contains(batch.uids[i]))
            throw mrr::RouteFileError(mrr::detail::str(
                mrr::ReplayConfig::kReplayFile, ": ", replayed_file_, " holds no routes for sequence ", batch.global[i],
                " of step ", step, " (uid ", batch.uids[i], "): it was recorded by a run with fewer steps or other ",
                "options (seed, data, model, rollout dtype or training options; only the router-replay keys may "
                "differ)"));

    // 1. Rollout with the rollout engine's numerics (weights synced, rounded), recording routes.
    rollout_->load(params_);
    rollout_->replay().set_action(mrr::RouterAction::record);
    for (auto& batch : batches) rollout(batch);

    // 2. Rewards and group advantages over the global batch (every rank computes all of them).
    std::vector<float> scores_global(static_cast<std::size_t>(cfg_.sequences()));
    std::vector<std::int64_t> lengths_global(static_cast<std::size_t>(cfg_.sequences()));
    for (int b = 0; b < mb; ++b) {
      const Batch& batch = batches[static_cast<std::size_t>(b)];
      std::vector<float> s(batch.scores.begin(), batch.scores.end());
      std::vector<std::int64_t> len(batch.response_lengths.begin(), batch.response_lengths.end());
      comm_.all_gather(std::span<const float>(s), std::span<float>(scores_global.data() + b * per_mb, static_cast<std::size_t>(per_mb)));
      comm_.all_gather(std::span<const std::int64_t>(len),
                       std::span<std::int64_t>(lengths_global.data() + b * per_mb, static_cast<std::size_t>(per_mb)));
    }
    Mat mask_global = Mat::Zero(cfg_.sequences(), R);
    Vec scores = Vec::Zero(cfg_.sequences());
    std::vector<std::int64_t> prompt_of;
    double correct = 0, length_sum = 0;
    for (int i = 0; i < cfg_.sequences(); ++i) {
      mask_global.row(i).head(lengths_global[static_cast<std::size_t>(i)]).setOnes();
      scores[i] = scores_global[static_cast<std::size_t>(i)];
      prompt_of.push_back(i / cfg_.group);
      correct += scores[i] == 1.0f;
      length_sum += static_cast<double>(lengths_global[static_cast<std::size_t>(i)]);
    }
    m.reward = scores.cast<double>().mean();
    m.accuracy = correct / cfg_.sequences();
    m.response_length = length_sum / cfg_.sequences();
    const mrr::ppo::GroupIndex index(prompt_of);
    // The optimal token baselines need the old-log-prob pass's log-probs and sum_pi_squared (verl:
    // actor.calculate_sum_pi_squared): computed after it (step 3b); every other estimator here.
    const bool token_baseline = token_baseline_estimator();
    mrr::ppo::AdvantageResult<float> adv;
    if (!token_baseline) adv = mrr::ppo::compute_outcome_advantages<float>(scores, mask_global, index, cfg_.grpo);

    // 3. Old-log-prob pass (R2 records, R3 replays the rollout's routes), compared with the rollout;
    //    then the paired passes (native and replayed, no gradient) on the same weights.
    detail::RolloutComparison own, native, replayed, floor;
    double entropy_sum = 0, entropy_tokens = 0;
    std::vector<double> rs_tokens = {0, 0};  // response tokens, rejected ones
    std::uint64_t paired_replayed_rows = 0;
    std::vector<std::vector<std::int64_t>> load(static_cast<std::size_t>(L), std::vector<std::int64_t>(static_cast<std::size_t>(cfg_.model.experts), 0));
    for (int b = 0; b < mb; ++b) {
      Batch& batch = batches[static_cast<std::size_t>(b)];
      batch.mask = Mat::Zero(local_n, R);
      batch.advantages = Mat(local_n, R);
      for (int i = 0; i < local_n; ++i) {
        batch.mask.row(i).head(batch.response_lengths[static_cast<std::size_t>(i)]).setOnes();
        if (!token_baseline) batch.advantages.row(i) = adv.advantages.row(batch.global[static_cast<std::size_t>(i)]);
      }
      if (r2_replays_file_)
        train_->replay().set_action(mrr::RouterAction::replay_forward, false);
      else
        train_->replay().begin_pass(mrr::TrainingPass::old_log_prob);
      typename Engine<Comm>::Cache cache;
      const auto logits = train_->forward(batch.tokens, batch.lengths, batch.uids, cache, &batch.old_routes);
      batch.old_log_prob = log_probs(batch, logits);
      if (token_baseline) batch.sum_pi_squared = sum_pi_squared(batch, logits);
      accumulate_entropy(batch, logits, entropy_sum, entropy_tokens);
      if (cfg_.rollout_tis) {
        mrr::ppo::RolloutIsOptions is;
        is.threshold = mrr::ppo::RolloutIsThreshold::truncate_at(cfg_.rollout_is_threshold);
        const Mat log_ratio = batch.old_log_prob - batch.rollout_log_prob;
        batch.is_weights = mrr::ppo::compute_rollout_correction_weights<float>(log_ratio, batch.mask, is).weights;
      }
      batch.route_hash.assign(static_cast<std::size_t>(local_n), 1469598103934665603ull);
      for (int i = 0; i < local_n; ++i)
        for (int l = 0; l < L; ++l)
          batch.route_hash[static_cast<std::size_t>(i)] = detail::hash_ids(
              batch.old_routes[static_cast<std::size_t>(l)], static_cast<Eigen::Index>(i) * S, S, batch.route_hash[static_cast<std::size_t>(i)]);
      const mrr::TokenLayout& layout = train_->replay().micro_batch();
      const detail::RolloutComparison c = compare_with_rollout(batch, layout, batch.old_routes, batch.old_log_prob);
      accumulate(own, c);
      for (int l = 0; l < L; ++l)
        for (std::size_t r = 0; r < layout.size(); ++r) {
          if (layout[r].is_padding()) continue;
          const auto& used = batch.old_routes[static_cast<std::size_t>(l)];
          for (int j = 0; j < k; ++j) ++load[static_cast<std::size_t>(l)][static_cast<std::size_t>(used(static_cast<Eigen::Index>(r), j))];
        }
      if (paired_) {
        // The same weights (params_, which the rollout synced and no update has moved yet).
        if (b == 0) paired_->load(params_);
        Mat native_lp;
        if (old_is_native_) {
          accumulate(native, c);
          native_lp = batch.old_log_prob;
        } else {
          paired_->replay().set_action(mrr::RouterAction::native);
          accumulate(native, paired_pass(batch, &native_lp));
        }
        floor_pass(batch, native_lp, floor);
        if (old_is_replay_) {
          accumulate(replayed, c);
          paired_replayed_rows += rows_with_route(layout, L);
        } else {
          const auto before = paired_->replay().stats().replayed_rows;
          paired_->replay().begin_pass(mrr::TrainingPass::old_log_prob);  // R3: replay_forward, queues cleared
          accumulate(replayed, paired_pass(batch));
          paired_replayed_rows += paired_->replay().stats().replayed_rows - before;
        }
      }
      if (ref_) {
        ref_->replay().begin_pass(mrr::TrainingPass::ref_log_prob);
        typename Engine<Comm>::Cache ref_cache;
        batch.ref_log_prob = log_probs(batch, ref_->forward(batch.tokens, batch.lengths, batch.uids, ref_cache, nullptr));
      }
      // Rejection sampling last: the comparisons above see every response token; the loss (and
      // its global token count) only the kept ones, as verl's modified response mask.
      if (rs_options_) {
        const Mat log_ratio = batch.old_log_prob - batch.rollout_log_prob;
        const double before = static_cast<double>(batch.mask.sum());
        batch.mask = mrr::ppo::compute_rollout_rejection_mask<float>(log_ratio, batch.mask, *rs_options_).response_mask;
        rs_tokens[0] += before;
        rs_tokens[1] += before - static_cast<double>(batch.mask.sum());
      }
    }

    // 3b. The optimal token baselines over the global batch, as verl orders them: after the
    //     old-log-prob pass and the rollout correction (its IS weights scale W; its rejection
    //     mask is the response mask the estimator sees), rewards on each response's last token.
    if (token_baseline) {
      const auto global_of = [&](Mat Batch::*field) {
        Mat out(cfg_.sequences(), R);
        for (int b = 0; b < mb; ++b) {
          const Mat& local = batches[static_cast<std::size_t>(b)].*field;
          comm_.all_gather(std::span<const float>(local.data(), static_cast<std::size_t>(local.size())),
                           std::span<float>(out.data() + static_cast<Eigen::Index>(b) * per_mb * R,
                                            static_cast<std::size_t>(per_mb) * static_cast<std::size_t>(R)));
        }
        return out;
      };
      const Mat rewards = mrr::ppo::token_level_rewards<float>(scores, mask_global);
      const Mat mask = global_of(&Batch::mask), old_lp = global_of(&Batch::old_log_prob);
      const Mat spsq = global_of(&Batch::sum_pi_squared);
      const Mat is = cfg_.rollout_tis ? global_of(&Batch::is_weights) : Mat();
      mrr::ppo::AdvantageInputs<float> in{rewards, mask};
      in.index = &index;
      in.old_log_probs = old_lp;
      in.sum_pi_squared = spsq;
      if (cfg_.rollout_tis) in.rollout_is_weights = is;
      adv = mrr::ppo::compute_advantage<float>(cfg_.grpo.adv_estimator, in, cfg_.grpo.advantage);
      for (auto& batch : batches)
        for (int i = 0; i < local_n; ++i)
          batch.advantages.row(i) = adv.advantages.row(batch.global[static_cast<std::size_t>(i)]);
    }

    // 4. PPO updates, mini-batch by mini-batch (weights change between them).
    std::int64_t update_decisions = 0, update_differing = 0;
    double loss_sum = 0, clip_sum = 0, ppo_kl_sum = 0, kl_loss_sum = 0, grad_norm_sum = 0;
    int updates = 0;
    for (int epoch = 0; epoch < cfg_.ppo_epochs; ++epoch)
      for (int b = 0; b < mb; ++b) {
        Batch& batch = batches[static_cast<std::size_t>(b)];
        train_->replay().begin_pass(mrr::TrainingPass::actor_update);
        typename Engine<Comm>::Cache cache;
        std::vector<mrr::ExpertIds> routes;
        const auto logits = train_->forward(batch.tokens, batch.lengths, batch.uids, cache, &routes);
        const Mat lp = log_probs(batch, logits);
        for (int l = 0; l < L; ++l)
          for (int i = 0; i < local_n; ++i)
            for (int t = 0; t + 1 < batch.lengths[static_cast<std::size_t>(i)]; ++t) {
              const Eigen::Index r = static_cast<Eigen::Index>(i) * S + t;
              update_decisions += k;
              update_differing += mrr::kernels::differing_experts(&routes[static_cast<std::size_t>(l)](r, 0),
                                                    &batch.old_routes[static_cast<std::size_t>(l)](r, 0), k);
            }
        for (int i = 0; i < local_n; ++i)
          for (int l = 0; l < L; ++l)
            batch.route_hash[static_cast<std::size_t>(i)] = detail::hash_ids(
                routes[static_cast<std::size_t>(l)], static_cast<Eigen::Index>(i) * S, S, batch.route_hash[static_cast<std::size_t>(i)]);
        const LossOut lo = loss(batch, lp, logits, b);
        loss_sum += lo.loss;
        clip_sum += lo.clipfrac;
        ppo_kl_sum += lo.ppo_kl;
        kl_loss_sum += lo.kl_loss;
        ++updates;
        std::vector<Mat> dlogits = logit_grads(batch, logits, lo.grad_log_prob, lo.entropy_grads);
        auto g = train_->backward(batch.tokens, cache, dlogits);
        grad_norm_sum += apply(g);
      }

    // 5. Metrics over every rank (sums added in rank order: the same for any number of ranks).
    const detail::RolloutComparison* passes[3] = {&own, &native, &replayed};
    std::vector<std::int64_t> counts = {update_decisions, update_differing, static_cast<std::int64_t>(paired_replayed_rows)};
    for (const auto* p : passes)
      for (const auto c : {p->decisions, p->differing_decisions, p->tokens, p->differing_tokens}) counts.push_back(c);
    for (auto& per_layer : load)
      for (auto c : per_layer) counts.push_back(c);
    comm_.all_reduce_sum(std::span<std::int64_t>(counts));
    std::vector<double> sums, maxes_local;
    for (const auto* p : passes) {
      for (const double v : {p->k3_sum, p->k1_sum, p->abs_sum, p->lp_tokens}) sums.push_back(v);
      maxes_local.push_back(p->max_abs);
    }
    std::vector<double> all(sums.size() * static_cast<std::size_t>(ranks)), maxes(maxes_local.size() * static_cast<std::size_t>(ranks));
    comm_.all_gather(std::span<const double>(sums), std::span<double>(all));
    comm_.all_gather(std::span<const double>(maxes_local), std::span<double>(maxes));
    struct Reduced {
      double k3 = 0, k1 = 0, mean_abs = 0, max_abs = 0, mismatch_decisions = 0, mismatch_tokens = 0;
      std::int64_t rows = 0;
    };
    const auto ratio = [](std::int64_t num, std::int64_t den) {
      return den > 0 ? static_cast<double>(num) / static_cast<double>(den) : 0.0;
    };
    Reduced red[3];
    for (std::size_t p = 0; p < 3; ++p) {
      double k3 = 0, k1 = 0, ab = 0, nt = 0;
      for (std::size_t r = 0; r < static_cast<std::size_t>(ranks); ++r) {
        const std::size_t at = r * sums.size() + p * 4;
        k3 += all[at];
        k1 += all[at + 1];
        ab += all[at + 2];
        nt += all[at + 3];
        red[p].max_abs = std::max(red[p].max_abs, maxes[r * maxes_local.size() + p]);
      }
      red[p].k3 = nt > 0 ? k3 / nt : 0;
      red[p].k1 = nt > 0 ? k1 / nt : 0;
      red[p].mean_abs = nt > 0 ? ab / nt : 0;
      const std::size_t at = 3 + p * 4;
      red[p].mismatch_decisions = ratio(counts[at + 1], counts[at]);
      red[p].mismatch_tokens = ratio(counts[at + 3], counts[at + 2]);
      red[p].rows = counts[at] / k;
    }
    m.k3 = red[0].k3;
    m.k1 = red[0].k1;
    m.mean_abs_dlogp = red[0].mean_abs;
    m.max_abs_dlogp = red[0].max_abs;
    m.rollout_mismatch_decisions = red[0].mismatch_decisions;
    m.rollout_mismatch_tokens = red[0].mismatch_tokens;
    m.compared_rows = red[0].rows;
    m.update_mismatch_decisions = ratio(counts[1], counts[0]);
    if (paired_) {
      m.paired_native_mismatch_decisions = red[1].mismatch_decisions;
      m.paired_native_mismatch_tokens = red[1].mismatch_tokens;
      m.paired_native_k3 = red[1].k3;
      m.paired_native_mean_abs_dlogp = red[1].mean_abs;
      m.paired_replay_mismatch_decisions = red[2].mismatch_decisions;
      m.paired_replay_k3 = red[2].k3;
      m.paired_replay_mean_abs_dlogp = red[2].mean_abs;
      m.paired_replayed_rows = static_cast<std::uint64_t>(counts[2]);
    }
    constexpr std::size_t load_at = 3 + 3 * 4;
    for (int l = 0; l < L; ++l) {
      double most = 0, total = 0;
      for (int e = 0; e < cfg_.model.experts; ++e) {
        const auto c = static_cast<double>(counts[load_at + static_cast<std::size_t>(l * cfg_.model.experts + e)]);
        most = std::max(most, c);
        total += c;
      }
      if (total > 0) m.load_max_over_mean = std::max(m.load_max_over_mean, most / (total / cfg_.model.experts));
    }
    m.loss = loss_sum / updates;
    m.pg_clipfrac = clip_sum / updates;
    m.ppo_kl = ppo_kl_sum / updates;
    m.kl_loss = kl_loss_sum / updates;
    m.grad_norm = grad_norm_sum / updates;
    {  // the policy's entropy over every rank's response tokens (old-log-prob pass)
      std::vector<double> e{entropy_sum, entropy_tokens}, all_e(2 * static_cast<std::size_t>(ranks));
      comm_.all_gather(std::span<const double>(e), std::span<double>(all_e));
      double sum = 0, tokens = 0;
      for (std::size_t r = 0; r < static_cast<std::size_t>(ranks); ++r) sum += all_e[2 * r], tokens += all_e[2 * r + 1];
      m.entropy = tokens > 0 ? sum / tokens : 0;
    }
    if (rs_options_) {  // over every rank's tokens, added in rank order
      std::vector<double> all_rs(2 * static_cast<std::size_t>(ranks));
      comm_.all_gather(std::span<const double>(rs_tokens), std::span<double>(all_rs));
      double tokens = 0, rejected = 0;
      for (std::size_t r = 0; r < static_cast<std::size_t>(ranks); ++r)
        tokens += all_rs[2 * r], rejected += all_rs[2 * r + 1];
      m.rollout_rs_masked_fraction = tokens > 0 ? rejected / tokens : 0;
    }
    const auto& st = train_->replay().stats();
    std::vector<std::int64_t> rows = {static_cast<std::int64_t>(st.replayed_rows - stats0.replayed_rows),
                                      static_cast<std::int64_t>(st.native_rows - stats0.native_rows),
                                      static_cast<std::int64_t>(st.recorded_rows - stats0.recorded_rows)};
    comm_.all_reduce_sum(std::span<std::int64_t>(rows));
    m.replayed_rows = static_cast<std::uint64_t>(rows[0]);
    m.native_rows = static_cast<std::uint64_t>(rows[1]);
    m.recorded_rows = static_cast<std::uint64_t>(rows[2]);
    // The same-engine floor over every rank: k3 sum and token count.
    if (paired_) {
      std::vector<double> fl{floor.k3_sum, floor.lp_tokens}, all_fl(2 * static_cast<std::size_t>(ranks));
      comm_.all_gather(std::span<const double>(fl), std::span<double>(all_fl));
      double k3 = 0, nt = 0;
      for (std::size_t r = 0; r < static_cast<std::size_t>(ranks); ++r) k3 += all_fl[2 * r], nt += all_fl[2 * r + 1];
      m.floor_k3 = nt > 0 ? k3 / nt : 0;
    }
    // The R3 paper's definitions (mrr/diagnostics.hpp) over every rank: decision counts summed,
    // |delta log p| values gathered (each rank's list padded to the longest with NaN).
    for (std::size_t p = 0; p < 3; ++p) {
      if (p > 0 && !paired_) break;
      std::vector<std::int64_t> rc = passes[p]->routing.counts();
      if (rc.size() == 7) rc.resize(7 + 2 * static_cast<std::size_t>(L), 0);  // nothing compared on this rank
      comm_.all_reduce_sum(std::span<std::int64_t>(rc));
      const mrr::RoutingMismatch routing = mrr::RoutingMismatch::from_counts(rc);
      std::vector<std::int64_t> sizes(static_cast<std::size_t>(ranks));
      const std::int64_t mine = static_cast<std::int64_t>(passes[p]->abs_dlogp.size());
      comm_.all_gather(std::span<const std::int64_t>(&mine, 1), std::span<std::int64_t>(sizes));
      const std::int64_t longest = *std::max_element(sizes.begin(), sizes.end());
      std::vector<double> padded = passes[p]->abs_dlogp, gathered(static_cast<std::size_t>(longest * ranks));
      padded.resize(static_cast<std::size_t>(longest), std::nan(""));
      comm_.all_gather(std::span<const double>(padded), std::span<double>(gathered));
      gathered.erase(std::remove_if(gathered.begin(), gathered.end(), [](double v) { return std::isnan(v); }), gathered.end());
      mrr::LogProbDivergence div;
      const double taus[] = {2.0, 5.0};
      mrr::summarize_abs_differences(gathered, taus, div);
      if (p == 0) {
        m.rollout_decisions_differing = routing.decision_fraction();
        m.rollout_mean_differing_layers = routing.mean_differing_layers();
        m.f2 = div.F(2.0);
        m.f5 = div.F(5.0);
        m.p99_abs_dlogp = div.p99_abs;
      } else if (p == 1) {
        m.paired_native_decisions_differing = routing.decision_fraction();
        m.paired_native_f2 = div.F(2.0);
      } else {
        m.paired_replay_f2 = div.F(2.0);
      }
    }
    m.params_digest = digest();
    std::uint64_t route_digest = 1469598103934665603ull;
    for (const Batch& batch : batches) {
      std::vector<std::int64_t> mine(batch.route_hash.begin(), batch.route_hash.end()), all_hashes(mine.size() * static_cast<std::size_t>(ranks));
      comm_.all_gather(std::span<const std::int64_t>(mine), std::span<std::int64_t>(all_hashes));
      for (const auto h : all_hashes) route_digest = (route_digest ^ static_cast<std::uint64_t>(h)) * 1099511628211ull;
    }
    m.routes_digest = route_digest;
    rollout_store_->end_step();
    if (train_store_) train_store_->end_step();
    m.wall_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return m;
  }

  // A hash of every parameter (replicated ones and each expert in global order): equal for equal
  // models whatever the number of ranks.
  std::uint64_t digest() const {
    std::uint64_t h = detail::hash_floats(params_.dense.data(), params_.dense.size());
    const int L = cfg_.model.layers, local = train_->local_experts(), ranks = static_cast<int>(comm_.size());
    const Eigen::Index block = expert_block_size(cfg_.model);
    std::vector<std::int64_t> mine;
    for (int l = 0; l < L; ++l)
      for (int e = 0; e < local; ++e)
        mine.push_back(static_cast<std::int64_t>(
            detail::hash_floats(params_.experts.data() + (static_cast<Eigen::Index>(l) * local + e) * block, block)));
    std::vector<std::int64_t> all(mine.size() * static_cast<std::size_t>(ranks));
    comm_.all_gather(std::span<const std::int64_t>(mine), std::span<std::int64_t>(all));
    for (int l = 0; l < L; ++l)
      for (int r = 0; r < ranks; ++r)
        for (int e = 0; e < local; ++e) {
          const auto v = static_cast<std::uint64_t>(all[static_cast<std::size_t>((r * L + l) * local + e)]);
          h = (h ^ v) * 1099511628211ull;
        }
    return h;
  }

  const Params& params() const { return params_; }

 private:
  struct Batch {
    std::vector<int> global;
    std::vector<mrr::SequenceId> uids;
    std::vector<std::uint64_t> streams;  // the sampler's, per sequence
    std::vector<Problem> problems;
    std::vector<std::vector<std::int32_t>> tokens;  // [max_seq], padded with EOS
    std::vector<int> lengths;                       // prompt + response
    std::vector<int> response_lengths;
    std::vector<float> scores;
    Mat rollout_log_prob, old_log_prob, ref_log_prob, mask, advantages;  // [n, response_length]
    Mat is_weights;      // TIS weights, [n, response_length], when rollout_tis
    Mat sum_pi_squared;  // sum_v pi_v^2 at each response token, for the optimal token baselines
    std::vector<mrr::ExpertIds> old_routes;                              // per layer, rows of the padded layout
    std::vector<std::uint64_t> route_hash;                               // per sequence, routes of every training pass
  };

  void rollout(Batch& batch) {
    const int n = static_cast<int>(batch.global.size());
    const int S = cfg_.model.max_seq, R = cfg_.response_length();
    batch.tokens.assign(static_cast<std::size_t>(n), std::vector<std::int32_t>(static_cast<std::size_t>(S), kEos));
    for (int i = 0; i < n; ++i) {
      const auto prompt = batch.problems[static_cast<std::size_t>(i)].prompt();
      std::copy(prompt.begin(), prompt.end(), batch.tokens[static_cast<std::size_t>(i)].begin());
    }
    batch.lengths.assign(static_cast<std::size_t>(n), kPromptLength);
    batch.rollout_log_prob = Mat::Zero(n, R);
    std::vector<std::uint8_t> done(static_cast<std::size_t>(n), 0);
    auto state = rollout_->start_decoding(n);
    // Every rank runs every position (the MoE layers are collective), with its unfinished rows.
    for (int position = 0; position + 1 < S; ++position) {
      std::vector<int> active;
      for (int i = 0; i < n; ++i)
        if (!done[static_cast<std::size_t>(i)] && batch.lengths[static_cast<std::size_t>(i)] > position) active.push_back(i);
      const Mat logits = rollout_->decode(batch.tokens, batch.uids, active, position, state, nullptr);
      if (position + 1 < kPromptLength) continue;
      std::vector<std::uint64_t> streams;
      std::vector<std::int64_t> counters;
      for (const int i : active) {
        streams.push_back(batch.streams[static_cast<std::size_t>(i)]);
        counters.push_back(position + 1);
      }
      const auto sampled = mrr::rollout::sample<float>(logits, cfg_.sampling, cfg_.seed, streams, counters);
      for (std::size_t r = 0; r < active.size(); ++r) {
        const auto i = static_cast<std::size_t>(active[r]);
        batch.tokens[i][static_cast<std::size_t>(position + 1)] = sampled[r].token;
        batch.rollout_log_prob(static_cast<Eigen::Index>(i), position + 1 - kPromptLength) = sampled[r].logprob;
        batch.lengths[i] = position + 2;
        if (sampled[r].token == kEos) done[i] = 1;
      }
    }
    batch.response_lengths.clear();
    batch.scores.clear();
    for (int i = 0; i < n; ++i) {
      const int len = batch.lengths[static_cast<std::size_t>(i)] - kPromptLength;
      batch.response_lengths.push_back(len);
      const auto& t = batch.tokens[static_cast<std::size_t>(i)];
      batch.scores.push_back(static_cast<float>(
          score_response(batch.problems[static_cast<std::size_t>(i)], std::span<const std::int32_t>(t).subspan(kPromptLength, static_cast<std::size_t>(len)))));
    }
  }

  // Compares one pass (its routes per layer over `layout`, its log-probs) with the rollout.
  detail::RolloutComparison compare_with_rollout(const Batch& batch, const mrr::TokenLayout& layout,
                                                 const std::vector<mrr::ExpertIds>& routes, const Mat& log_prob) const {
    detail::RolloutComparison c;
    const int L = cfg_.model.layers;
    const auto lm = mrr::ppo::logprob_mismatch<float>(log_prob, batch.rollout_log_prob, batch.mask);
    c.lp_tokens = static_cast<double>(lm.tokens);
    c.k3_sum = static_cast<double>(lm.k3) * c.lp_tokens;
    c.k1_sum = static_cast<double>(lm.k1) * c.lp_tokens;
    c.abs_sum = static_cast<double>(lm.mean_abs_diff) * c.lp_tokens;
    c.max_abs = static_cast<double>(lm.max_abs_diff);
    // Routes: the rollout has one for every position it fed (all but each sequence's last); real
    // rows it has a route for are compared in every layer (mrr/diagnostics.hpp). The expert-level
    // columns are the same counts' differing experts.
    std::vector<std::uint8_t> real(layout.size());
    for (std::size_t r = 0; r < layout.size(); ++r) real[r] = layout[r].is_padding() ? 0 : 1;
    mrr::RoutingMismatchCounter counter(L, static_cast<long>(layout.size()), real);
    for (int l = 0; l < L; ++l) mrr::add_layer_against_store(counter, *rollout_store_, l, layout, routes[static_cast<std::size_t>(l)]);
    c.routing = counter.result();
    c.decisions = c.routing.experts;
    c.differing_decisions = c.routing.differing_experts;
    c.tokens = c.routing.tokens;
    c.differing_tokens = c.routing.differing_tokens;
    for (Eigen::Index i = 0; i < log_prob.rows(); ++i)
      for (Eigen::Index j = 0; j < log_prob.cols(); ++j)
        if (batch.mask(i, j) != 0)
          c.abs_dlogp.push_back(std::abs(static_cast<double>(log_prob(i, j)) - static_cast<double>(batch.rollout_log_prob(i, j))));
    return c;
  }

  static void accumulate(detail::RolloutComparison& into, const detail::RolloutComparison& c) {
    into.decisions += c.decisions;
    into.differing_decisions += c.differing_decisions;
    into.tokens += c.tokens;
    into.differing_tokens += c.differing_tokens;
    into.k3_sum += c.k3_sum;
    into.k1_sum += c.k1_sum;
    into.abs_sum += c.abs_sum;
    into.lp_tokens += c.lp_tokens;
    into.max_abs = std::max(into.max_abs, c.max_abs);
    into.routing += c.routing;
    into.abs_dlogp.insert(into.abs_dlogp.end(), c.abs_dlogp.begin(), c.abs_dlogp.end());
  }

  // (token, layer) rows of `layout` the rollout has a route for.
  std::uint64_t rows_with_route(const mrr::TokenLayout& layout, int layers) const {
    std::uint64_t n = 0;
    for (int l = 0; l < layers; ++l) {
      mrr::ExpertIds ids;
      std::vector<std::uint8_t> found;
      rollout_store_->lookup(l, layout, ids, found);
      for (std::size_t r = 0; r < layout.size(); ++r) n += !layout[r].is_padding() && found[r];
    }
    return n;
  }

  // A no-gradient pass of the paired engine with the action already set, compared with the rollout.
  detail::RolloutComparison paired_pass(const Batch& batch, Mat* log_prob_out = nullptr) {
    typename Engine<Comm>::Cache cache;
    std::vector<mrr::ExpertIds> routes;
    const auto logits = paired_->forward(batch.tokens, batch.lengths, batch.uids, cache, &routes);
    Mat lp = log_probs(batch, logits);
    auto c = compare_with_rollout(batch, paired_->replay().micro_batch(), routes, lp);
    if (log_prob_out) *log_prob_out = std::move(lp);
    return c;
  }

  // The same-engine floor (the R3 paper's reference level): the training engine twice on the same
  // weights and tokens in two micro-batch compositions (the mini-batch as is, routed natively, and
  // its sequences in reverse order, routed natively), compared token by token: the divergence no
  // routing fix can remove. native_lp: the first of the two, already computed.
  void floor_pass(const Batch& batch, const Mat& native_lp, detail::RolloutComparison& into) {
    const std::size_t n = batch.global.size();
    Batch rev;
    rev.global.assign(batch.global.rbegin(), batch.global.rend());
    rev.uids.assign(batch.uids.rbegin(), batch.uids.rend());
    rev.tokens.assign(batch.tokens.rbegin(), batch.tokens.rend());
    rev.lengths.assign(batch.lengths.rbegin(), batch.lengths.rend());
    paired_->replay().set_action(mrr::RouterAction::native);
    typename Engine<Comm>::Cache cache;
    const Mat lp_rev = log_probs(rev, paired_->forward(rev.tokens, rev.lengths, rev.uids, cache, nullptr));
    Mat lp_back(native_lp.rows(), native_lp.cols());  // lp_rev in the batch's order
    for (std::size_t i = 0; i < n; ++i)
      lp_back.row(static_cast<Eigen::Index>(i)) = lp_rev.row(static_cast<Eigen::Index>(n - 1 - i));
    const auto span = [](const Mat& m) { return std::span<const float>(m.data(), static_cast<std::size_t>(m.size())); };
    const auto d = mrr::logprob_divergence<float>(span(lp_back), span(native_lp), span(batch.mask));
    into.k3_sum += d.k3 * static_cast<double>(d.tokens);
    into.lp_tokens += static_cast<double>(d.tokens);
  }

  // Sum over the response tokens (mask 1) of the policy's entropy at that position, of
  // softmax(logits / temperature) as the log-probs use it, and the number of tokens.
  void accumulate_entropy(const Batch& batch, const std::vector<Mat>& logits, double& sum, double& tokens) const {
    const int n = static_cast<int>(batch.global.size()), R = cfg_.response_length();
    const double t = logit_temperature();
    for (int i = 0; i < n; ++i)
      for (int j = 0; j < R; ++j) {
        if (batch.mask(i, j) == 0) continue;
        const auto z = logits[static_cast<std::size_t>(i)].row(kPromptLength - 1 + j).cast<double>() / t;
        const double mx = z.maxCoeff();
        const auto e = (z.array() - mx).exp();
        const double total = e.sum();
        // H = log sum exp(z) - sum p z
        sum += (mx + std::log(total)) - (e * z.array()).sum() / total;
        tokens += 1;
      }
  }

  bool token_baseline_estimator() const {
    const auto e = mrr::ppo::parse_advantage_estimator(cfg_.grpo.adv_estimator);
    return e == mrr::ppo::AdvantageEstimator::optimal_token_baseline ||
           e == mrr::ppo::AdvantageEstimator::tir_optimal_token_baseline;
  }

  // sum_v pi_v^2 of softmax(logits / temperature) at each response position (verl's
  // calculate_sum_pi_squared_from_logits, as the log-probs use the logits), [n, response_length].
  Mat sum_pi_squared(const Batch& batch, const std::vector<Mat>& logits) const {
    const int n = static_cast<int>(batch.global.size()), R = cfg_.response_length();
    Mat out(n, R);
    const double t = logit_temperature();
    for (int i = 0; i < n; ++i)
      out.row(i) = mrr::rollout::sum_pi_squared_from_logits<float>(
                       logits[static_cast<std::size_t>(i)].middleRows(kPromptLength - 1, R), t)
                       .transpose();
    return out;
  }

  // log p of each response token (verl: logits / rollout temperature), [n, response_length].
  Mat log_probs(const Batch& batch, const std::vector<Mat>& logits) const {
    const int n = static_cast<int>(batch.global.size()), R = cfg_.response_length();
    Mat out(n, R);
    const double t = logit_temperature();
    for (int i = 0; i < n; ++i) {
      const auto& tok = batch.tokens[static_cast<std::size_t>(i)];
      const std::span<const std::int32_t> labels(tok.data() + kPromptLength, static_cast<std::size_t>(R));
      out.row(i) = mrr::rollout::logprobs_from_logits<float>(logits[static_cast<std::size_t>(i)].middleRows(kPromptLength - 1, R),
                                                             labels, t)
                       .transpose();
    }
    return out;
  }

  // The temperature the log-probs, entropies and sum_pi_squared divide the logits by (1 when greedy).
  double logit_temperature() const { return cfg_.sampling.greedy() ? 1.0 : cfg_.sampling.temperature; }

  // d loss / d logits: through the log-probs, plus the entropy bonus's own term when it is on.
  std::vector<Mat> logit_grads(const Batch& batch, const std::vector<Mat>& logits, const Mat& grad_log_prob,
                               const std::vector<Mat>& entropy_grads) const {
    const int n = static_cast<int>(batch.global.size()), R = cfg_.response_length();
    const double t = logit_temperature();
    std::vector<Mat> out(static_cast<std::size_t>(n), Mat::Zero(cfg_.model.max_seq, cfg_.model.vocab));
    for (int i = 0; i < n; ++i) {
      const auto& tok = batch.tokens[static_cast<std::size_t>(i)];
      const std::span<const std::int32_t> labels(tok.data() + kPromptLength, static_cast<std::size_t>(R));
      const Vec g = grad_log_prob.row(i).transpose();
      auto rows = out[static_cast<std::size_t>(i)].middleRows(kPromptLength - 1, R);
      rows = mrr::rollout::logprobs_from_logits_backward<float>(
          logits[static_cast<std::size_t>(i)].middleRows(kPromptLength - 1, R), labels, g, t);
      if (!entropy_grads.empty()) rows += entropy_grads[static_cast<std::size_t>(i)];
    }
    return out;
  }

  struct LossOut {
    double loss = 0, clipfrac = 0, ppo_kl = 0, kl_loss = 0;
    Mat grad_log_prob;
    std::vector<Mat> entropy_grads;  // per sequence, d (entropy bonus) / d response logits; empty when off
  };

  // The mini-batch's loss, sequence by sequence with the global counts (so every term is the
  // same whichever rank computes it), summed in global sequence order.
  LossOut loss(const Batch& batch, const Mat& log_prob, const std::vector<Mat>& logits, int b) {
    const int n = static_cast<int>(batch.global.size()), R = cfg_.response_length();
    const int ranks = static_cast<int>(comm_.size()), per_mb = n * ranks;
    std::vector<std::int64_t> tokens_local = {static_cast<std::int64_t>(batch.mask.sum())};
    comm_.all_reduce_sum(std::span<std::int64_t>(tokens_local));
    mrr::ppo::GrpoStepConfig config = cfg_.grpo;
    config.policy.global_batch_info.batch_num_tokens = static_cast<double>(tokens_local[0]);
    config.policy.global_batch_info.global_batch_size = static_cast<double>(per_mb);
    LossOut out;
    out.grad_log_prob = Mat(n, R);
    std::vector<float> terms(static_cast<std::size_t>(n) * 4);
    const mrr::ppo::LossAggMode agg = mrr::ppo::parse_loss_agg_mode(config.loss_agg_mode);
    for (int i = 0; i < n; ++i) {
      const Mat old_row = batch.old_log_prob.row(i), lp_row = log_prob.row(i), adv_row = batch.advantages.row(i),
                mask_row = batch.mask.row(i);
      Mat ref_row;
      mrr::ppo::OptionalMatrixView<float> ref;
      if (ref_) {
        ref_row = batch.ref_log_prob.row(i);
        ref = ref_row;
      }
      Mat is_row;
      mrr::ppo::OptionalMatrixView<float> is_weights;
      if (cfg_.rollout_tis) {
        is_row = batch.is_weights.row(i);
        is_weights = is_row;
      }
      const auto r = mrr::ppo::grpo_loss<float>(old_row, lp_row, adv_row, mask_row, ref, config, is_weights);
      out.grad_log_prob.row(i) = r.grad_log_prob;
      const float t = mask_row.sum();
      terms[static_cast<std::size_t>(i) * 4] = r.loss;
      if (cfg_.entropy_coeff != 0) {
        EntropyBonus e = entropy_bonus(logits[static_cast<std::size_t>(i)].middleRows(kPromptLength - 1, R), mask_row,
                                       logit_temperature(), cfg_.entropy_coeff, agg, config.policy.global_batch_info);
        terms[static_cast<std::size_t>(i) * 4] += e.loss;
        out.entropy_grads.push_back(std::move(e.grad_logits));
      }
      terms[static_cast<std::size_t>(i) * 4 + 1] = r.metric("actor/pg_clipfrac").value_or(0.f) * t;
      terms[static_cast<std::size_t>(i) * 4 + 2] = r.metric("actor/ppo_kl").value_or(0.f) * t;
      terms[static_cast<std::size_t>(i) * 4 + 3] = r.kl_loss;
    }
    std::vector<float> all(terms.size() * static_cast<std::size_t>(ranks));
    comm_.all_gather(std::span<const float>(terms), std::span<float>(all));
    (void)b;
    float loss = 0, kl = 0;
    double clip = 0, ppo_kl = 0;
    for (int i = 0; i < per_mb; ++i) {
      loss += all[static_cast<std::size_t>(i) * 4];
      clip += static_cast<double>(all[static_cast<std::size_t>(i) * 4 + 1]);
      ppo_kl += static_cast<double>(all[static_cast<std::size_t>(i) * 4 + 2]);
      kl += all[static_cast<std::size_t>(i) * 4 + 3];
    }
    out.loss = static_cast<double>(loss);
    out.kl_loss = static_cast<double>(kl);
    out.clipfrac = tokens_local[0] > 0 ? clip / static_cast<double>(tokens_local[0]) : 0;
    out.ppo_kl = tokens_local[0] > 0 ? ppo_kl / static_cast<double>(tokens_local[0]) : 0;
    return out;
  }

  // Replicated gradient = per-sequence gradients of every rank added in global order, plus the
  // gates'; experts are local. Then AdamW, and the training engine reloads.
  // Applies one update's gradients; returns their global L2 norm (dense parameters, the same on
  // every rank after the gather, plus every rank's experts, summed in rank order).
  double apply(typename Engine<Comm>::Gradients& g) {
    const int ranks = static_cast<int>(comm_.size());
    const Eigen::Index d = train_->layout().size;
    const auto n = g.dense_per_sequence.size();
    std::vector<float> mine(n * static_cast<std::size_t>(d));
    for (std::size_t i = 0; i < n; ++i)
      std::copy_n(g.dense_per_sequence[i].data(), d, mine.data() + i * static_cast<std::size_t>(d));
    std::vector<float> all(mine.size() * static_cast<std::size_t>(ranks));
    comm_.all_gather(std::span<const float>(mine), std::span<float>(all));
    Vec dense = Vec::Zero(d);
    for (std::size_t s = 0; s < n * static_cast<std::size_t>(ranks); ++s)
      dense += Eigen::Map<const Vec>(all.data() + s * static_cast<std::size_t>(d), d);
    dense += g.gates;
    std::vector<double> expert_sq{static_cast<double>(g.experts.squaredNorm())},
        all_sq(static_cast<std::size_t>(ranks));
    comm_.all_gather(std::span<const double>(expert_sq), std::span<double>(all_sq));
    double norm_sq = static_cast<double>(dense.squaredNorm());
    for (const double v : all_sq) norm_sq += v;
    dense_opt_.step(params_.dense, dense);
    expert_opt_.step(params_.experts, g.experts);
    train_->load(params_);
    return std::sqrt(norm_sq);
  }

  TrainConfig cfg_;
  std::optional<mrr::ppo::RolloutRsOptions> rs_options_;  // rejection sampling, when configured
  Comm comm_;
  std::unique_ptr<AnyRouteStore> rollout_store_, train_store_, ref_store_;
  bool r2_replays_file_ = false;
  std::uint64_t run_tag_ = 0;
  std::string replayed_file_;  // the route file the training passes replay, if any
  std::unique_ptr<Engine<Comm>> train_, rollout_, ref_, paired_;
  bool old_is_native_ = false, old_is_replay_ = false;  // the old-log-prob pass is that paired pass
  Params params_;
  AdamW dense_opt_, expert_opt_;
};

}  // namespace moe_grpo
