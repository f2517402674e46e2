// Options of the flagship trainer: verl's key names, from a YAML file (--config) and key=value
// overrides (later wins). Router-replay keys go through mrr::ReplayConfig.
#pragma once

#include "trainer.hpp"

#include <mrr/error.hpp>
#include <mrr/replay/config.hpp>

#include <charconv>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#if MOE_GRPO_WITH_YAML
#include <mrr/replay/config_yaml.hpp>
#endif

namespace moe_grpo {

struct RunOptions {
  TrainConfig train;
  int ranks = 1;
  std::string output_dir = "moe_grpo_out";  // trainer.default_local_dir
  std::string experiment = "";               // trainer.experiment_name (default: the mode)
  bool progress = true;                      // a progress bar on a terminal
};

namespace detail {

template <class T>
T parse_number(std::string_view key, std::string_view v) {
  // The whole value, nothing around it (std::stod skipped leading spaces); YAML's one leading '+'.
  std::string_view digits = v;
  if constexpr (std::is_floating_point_v<T>)
    if (digits.size() > 1 && digits[0] == '+' && digits[1] != '-' && digits[1] != '+') digits.remove_prefix(1);
  // Reals as doubles, then narrowed: a float option given 1e39 is inf, which its range refuses.
  std::conditional_t<std::is_floating_point_v<T>, double, T> out{};
  const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), out);
  if (!digits.empty() && ec == std::errc() && end == digits.data() + digits.size()) return static_cast<T>(out);
  throw mrr::ConfigError(std::string(key) + ": cannot parse '" + std::string(v) + "' as a number");
}

// Short aliases for the command line (a config file uses verl's names).
inline const std::map<std::string_view, std::string_view>& short_aliases() {
  static const std::map<std::string_view, std::string_view> aliases = {
      {"steps", "trainer.total_training_steps"},
      {"seed", "trainer.seed"},
      {"out", "trainer.default_local_dir"},
      {"name", "trainer.experiment_name"},
      {"batch", "data.train_batch_size"},
      {"group", "actor_rollout_ref.rollout.n"},
      {"mini_batch", "actor_rollout_ref.actor.ppo_mini_batch_size"},
      {"lr", "actor_rollout_ref.actor.optim.lr"},
      {"loss_agg_mode", "actor_rollout_ref.actor.loss_agg_mode"},
      {"adv_estimator", "algorithm.adv_estimator"},
      {"kl_loss_type", "actor_rollout_ref.actor.kl_loss_type"},
      {"mode", "actor_rollout_ref.actor.router_replay.mode"}};
  return aliases;
}

// The boolean rule of the router-replay keys (YAML 1.1's words, and 1/0), for every flag alike.
inline bool parse_flag(std::string_view key, std::string_view v) { return mrr::ConfigValue::plain(v).as_bool(key); }

}  // namespace detail

// Sets one non-replay key; unknown keys are errors naming the known ones.
inline void set_option(RunOptions& o, std::string_view key, std::string_view v) {
  TrainConfig& t = o.train;
  using detail::parse_number;
  const std::map<std::string_view, std::function<void()>> setters = {
      {keys::steps, [&] { t.steps = parse_number<int>(key, v); }},
      {keys::seed, [&] { t.seed = parse_number<std::uint64_t>(key, v); }},
      {"trainer.default_local_dir", [&] { o.output_dir = std::string(v); }},
      {"trainer.experiment_name", [&] { o.experiment = std::string(v); }},
      {"trainer.progress", [&] { o.progress = detail::parse_flag(key, v); }},
      {keys::ranks, [&] { o.ranks = parse_number<int>(key, v); }},
      {keys::batch, [&] { t.prompts = parse_number<int>(key, v); }},
      {keys::max_operand, [&] { t.max_operand = parse_number<int>(key, v); }},
      {"algorithm.adv_estimator", [&] { t.grpo.adv_estimator = std::string(v); }},
      {"algorithm.norm_adv_by_std_in_grpo",
       [&] { t.grpo.advantage.norm_adv_by_std_in_grpo = detail::parse_flag(key, v); }},
      {keys::group, [&] { t.group = parse_number<int>(key, v); }},
      {keys::temperature, [&] { t.sampling.temperature = parse_number<double>(key, v); }},
      {keys::top_k, [&] { t.sampling.top_k = parse_number<int>(key, v); }},
      {keys::top_p, [&] { t.sampling.top_p = parse_number<double>(key, v); }},
      {"actor_rollout_ref.rollout.dtype",
       [&] {
         if (v != "bf16" && v != "bfloat16" && v != "fp32" && v != "float32" && v != "fp8")
           throw mrr::ConfigError(std::string(key) + ": expected bf16, fp8 or fp32, got '" + std::string(v) + "'");
         t.rollout_bf16 = v != "fp32" && v != "float32";
         t.rollout_fp8 = v == "fp8";
       }},
      {"algorithm.rollout_correction.rollout_is",
       [&] {
         if (v != "token" && v != "null" && v != "none")
           throw mrr::ConfigError(std::string(key) + ": expected token (TIS) or null, got '" + std::string(v) + "'");
         t.rollout_tis = v == "token";
       }},
      {"algorithm.rollout_correction.rollout_is_threshold",
       [&] { t.rollout_is_threshold = parse_number<double>(key, v); }},
      {"algorithm.rollout_correction.rollout_rs",
       [&] { t.rollout_rs = v == "null" || v == "none" ? std::string() : std::string(v); }},
      {"algorithm.rollout_correction.rollout_rs_threshold", [&] { t.rollout_rs_threshold = std::string(v); }},
      {keys::lr, [&] { t.lr = parse_number<float>(key, v); }},
      {keys::weight_decay, [&] { t.weight_decay = parse_number<float>(key, v); }},
      {keys::mini_batch, [&] { t.mini_batch_prompts = parse_number<int>(key, v); }},
      {keys::ppo_epochs, [&] { t.ppo_epochs = parse_number<int>(key, v); }},
      {"actor_rollout_ref.actor.loss_agg_mode", [&] { t.grpo.loss_agg_mode = std::string(v); }},
      {"actor_rollout_ref.actor.policy_loss.loss_mode", [&] { t.grpo.policy_loss = std::string(v); }},
      {keys::clip_ratio, [&] { t.grpo.policy.clip_ratio = parse_number<double>(key, v); }},
      {keys::clip_ratio_low, [&] { t.grpo.policy.clip_ratio_low = parse_number<double>(key, v); }},
      {keys::clip_ratio_high, [&] { t.grpo.policy.clip_ratio_high = parse_number<double>(key, v); }},
      {"actor_rollout_ref.actor.use_kl_loss", [&] { t.grpo.use_kl_loss = detail::parse_flag(key, v); }},
      {keys::kl_loss_coef, [&] { t.grpo.kl_loss_coef = parse_number<double>(key, v); }},
      {keys::entropy_coeff, [&] { t.entropy_coeff = parse_number<double>(key, v); }},
      {"actor_rollout_ref.actor.kl_loss_type", [&] { t.grpo.kl_loss_type = std::string(v); }},
      {keys::experts, [&] { t.model.experts = parse_number<int>(key, v); }},
      {keys::topk, [&] { t.model.topk = parse_number<int>(key, v); }},
      {keys::hidden, [&] { t.model.hidden = parse_number<int>(key, v); }},
      {keys::layers, [&] { t.model.layers = parse_number<int>(key, v); }},
      {keys::expert_hidden, [&] { t.model.expert_hidden = parse_number<int>(key, v); }},
  };
  const auto& aliases = detail::short_aliases();
  if (const auto a = aliases.find(key); a != aliases.end()) {
    if (a->second == mrr::ReplayConfig::kMode) {
      t.replay.set(mrr::ReplayConfig::kMode, v);
      // The short form sets the rollout flag R3 needs, as verl's recipes do.
      t.replay.enable_rollout_routing_replay = t.replay.mode == mrr::ReplayMode::R3;
      return;
    }
    return set_option(o, a->second, v);
  }
  const auto it = setters.find(key);
  if (it == setters.end()) {
    std::string known;
    for (const auto& [k, f] : setters) known += "\n  " + std::string(k);
    throw mrr::ConfigError("unknown option '" + std::string(key) + "'; known options (besides " +
                           std::string(mrr::ReplayConfig::kPrefix) + "{mode,record_file,replay_file} and " +
                           std::string(mrr::ReplayConfig::kRolloutReplay) + "):" + known);
  }
  it->second();
}

#if MOE_GRPO_WITH_YAML
namespace detail {

// Keys that mrr::read_replay_config reads from the file.
inline bool is_replay_key(std::string_view key) {
  return key == mrr::ReplayConfig::kNode || key.substr(0, mrr::ReplayConfig::kPrefix.size()) == mrr::ReplayConfig::kPrefix ||
         key == mrr::ReplayConfig::kRolloutReplay;
}

// Sets every scalar under `node`, flattened to its dotted key. A key given twice in a map is an
// error, as it is for OmegaConf (yaml-cpp keeps both), and so is a list or a key that is not a
// plain name: no option takes a list. A null keeps the option's default, as for the router-replay
// keys.
inline void apply_yaml(RunOptions& o, const YAML::Node& node, const std::string& key) {
  if (node.IsMap()) {
    std::set<std::string, std::less<>> seen;
    for (const auto& kv : node) {
      if (!kv.first.IsScalar())
        throw mrr::ConfigError((key.empty() ? std::string("the top level") : key) +
                               ": a key is a list, a map or null; keys are plain names");
      const std::string child = key.empty() ? kv.first.Scalar() : key + "." + kv.first.Scalar();
      if (!seen.insert(kv.first.Scalar()).second)
        throw mrr::ConfigError(child + " appears twice; YAML keys must be unique");
      apply_yaml(o, kv.second, child);
    }
  } else if (const auto a = short_aliases().find(key); a != short_aliases().end()) {
    // A short form in a file would apply after the file's full names whatever their order (mode
    // also sets the rollout flag): the file says what it means with verl's names.
    throw mrr::ConfigError(key + ": a command-line short form; in a config file write " + std::string(a->second));
  } else if (is_replay_key(key) || node.IsNull()) {
    // Read by mrr::read_replay_config, or null: the default stays.
  } else if (node.IsSequence()) {
    throw mrr::ConfigError(key + ": expected a single value, got a list");
  } else {
    set_option(o, key, node.Scalar());
  }
}

}  // namespace detail
#endif

// The options of a YAML file (verl's nesting): router-replay keys through mrr::ReplayConfig, the
// rest through set_option. The file must be a regular file holding one YAML document; every
// error is a ConfigError that starts with "config file <file>".
inline void apply_config_file(RunOptions& o, const std::string& file) {
#if MOE_GRPO_WITH_YAML
  const YAML::Node root = mrr::load_yaml_config(file);
  try {
    mrr::read_replay_config(root, o.train.replay);
    detail::apply_yaml(o, root, "");
  } catch (const mrr::ConfigError& e) {
    throw mrr::ConfigError("config file " + file + ": " + e.what());
  } catch (const YAML::Exception& e) {
    throw mrr::ConfigError("config file " + file + ": " + e.what());
  }
#else
  (void)o;
  (void)file;
  throw mrr::ConfigError("--config needs yaml-cpp (libyaml-cpp-dev); use key=value overrides");
#endif
}

// key=value arguments (and --config FILE, --ranks N, --no-progress) -> options, every value
// checked (TrainConfig::validate) before anything runs.
inline RunOptions parse_options(const std::vector<std::string>& args) {
  RunOptions o;
  std::vector<std::string> overrides;
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--ranks" && i + 1 < args.size()) {
      o.ranks = detail::parse_number<int>("--ranks", args[++i]);
    } else if (a == "--no-progress") {
      o.progress = false;
    } else if (a == "--config" && i + 1 < args.size()) {
      apply_config_file(o, args[++i]);
    } else if (a.find('=') != std::string::npos) {
      std::string_view body = a;
      while (!body.empty() && body.front() == '+')
        body.remove_prefix(1);
      if (body.starts_with("mode=")) {
        // The short form stands for both keys it sets, in its place, so a later full-name key
        // (or a later mode=) wins as anywhere else on the command line.
        mrr::ReplayConfig parsed;
        parsed.set(mrr::ReplayConfig::kMode, body.substr(5));
        overrides.push_back(std::string(mrr::ReplayConfig::kMode) + "=" + std::string(body.substr(5)));
        overrides.push_back(std::string(mrr::ReplayConfig::kRolloutReplay) + "=" +
                            (parsed.mode == mrr::ReplayMode::R3 ? "true" : "false"));
      } else {
        overrides.push_back(a);
      }
    } else {
      throw mrr::ConfigError("unexpected argument '" + a + "' (options are key=value; see --help)");
    }
  }
  for (const std::string& rest : o.train.replay.apply_overrides(std::span<const std::string>(overrides))) {
    std::string_view body = rest;
    while (!body.empty() && body.front() == '+') body.remove_prefix(1);
    const auto eq = body.find('=');
    set_option(o, body.substr(0, eq), body.substr(eq + 1));
  }
  o.train.validate(o.ranks);
  if (o.experiment.empty()) o.experiment = std::string(mrr::to_string(o.train.replay.mode));
  return o;
}

}  // namespace moe_grpo
