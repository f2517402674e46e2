// Options of the flagship trainer: verl's key names, from a YAML file (--config) and key=value
// overrides (later wins). Router-replay keys go through mrr::ReplayConfig.
#pragma once

#include "trainer.hpp"

#include <mrr/error.hpp>
#include <mrr/replay/config.hpp>

#include <charconv>
#include <functional>
#include <map>
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
  T out{};
  if constexpr (std::is_floating_point_v<T>) {
    try {
      std::size_t used = 0;
      const double d = std::stod(std::string(v), &used);
      if (used == v.size()) return static_cast<T>(d);
    } catch (const std::exception&) {
    }
  } else {
    const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), out);
    if (ec == std::errc() && end == v.data() + v.size()) return out;
  }
  throw mrr::ConfigError(std::string(key) + ": cannot parse '" + std::string(v) + "' as a number");
}

inline bool parse_flag(std::string_view key, std::string_view v) {
  if (v == "true" || v == "True" || v == "1") return true;
  if (v == "false" || v == "False" || v == "0") return false;
  throw mrr::ConfigError(std::string(key) + ": expected true or false, got '" + std::string(v) + "'");
}

}  // namespace detail

// Sets one non-replay key; unknown keys are errors naming the known ones.
inline void set_option(RunOptions& o, std::string_view key, std::string_view v) {
  TrainConfig& t = o.train;
  using detail::parse_number;
  const std::map<std::string_view, std::function<void()>> setters = {
      {"trainer.total_training_steps", [&] { t.steps = parse_number<int>(key, v); }},
      {"trainer.seed", [&] { t.seed = parse_number<std::uint64_t>(key, v); }},
      {"trainer.default_local_dir", [&] { o.output_dir = std::string(v); }},
      {"trainer.experiment_name", [&] { o.experiment = std::string(v); }},
      {"trainer.progress", [&] { o.progress = detail::parse_flag(key, v); }},
      {"trainer.n_ranks", [&] { o.ranks = parse_number<int>(key, v); }},
      {"data.train_batch_size", [&] { t.prompts = parse_number<int>(key, v); }},
      {"data.max_operand", [&] { t.max_operand = parse_number<int>(key, v); }},
      {"algorithm.adv_estimator", [&] { t.grpo.adv_estimator = std::string(v); }},
      {"algorithm.norm_adv_by_std_in_grpo", [&] { t.grpo.advantage.norm_adv_by_std_in_grpo = detail::parse_flag(key, v); }},
      {"actor_rollout_ref.rollout.n", [&] { t.group = parse_number<int>(key, v); }},
      {"actor_rollout_ref.rollout.temperature", [&] { t.sampling.temperature = parse_number<double>(key, v); }},
      {"actor_rollout_ref.rollout.top_k", [&] { t.sampling.top_k = parse_number<int>(key, v); }},
      {"actor_rollout_ref.rollout.top_p", [&] { t.sampling.top_p = parse_number<double>(key, v); }},
      {"actor_rollout_ref.rollout.dtype",
       [&] {
         if (v != "bf16" && v != "bfloat16" && v != "fp32" && v != "float32")
           throw mrr::ConfigError(std::string(key) + ": expected bf16 or fp32, got '" + std::string(v) + "'");
         t.rollout_bf16 = v == "bf16" || v == "bfloat16";
       }},
      {"actor_rollout_ref.actor.optim.lr", [&] { t.lr = parse_number<float>(key, v); }},
      {"actor_rollout_ref.actor.optim.weight_decay", [&] { t.weight_decay = parse_number<float>(key, v); }},
      {"actor_rollout_ref.actor.ppo_mini_batch_size", [&] { t.mini_batch_prompts = parse_number<int>(key, v); }},
      {"actor_rollout_ref.actor.ppo_epochs", [&] { t.ppo_epochs = parse_number<int>(key, v); }},
      {"actor_rollout_ref.actor.loss_agg_mode", [&] { t.grpo.loss_agg_mode = std::string(v); }},
      {"actor_rollout_ref.actor.policy_loss.loss_mode", [&] { t.grpo.policy_loss = std::string(v); }},
      {"actor_rollout_ref.actor.clip_ratio", [&] { t.grpo.policy.clip_ratio = parse_number<double>(key, v); }},
      {"actor_rollout_ref.actor.clip_ratio_low", [&] { t.grpo.policy.clip_ratio_low = parse_number<double>(key, v); }},
      {"actor_rollout_ref.actor.clip_ratio_high", [&] { t.grpo.policy.clip_ratio_high = parse_number<double>(key, v); }},
      {"actor_rollout_ref.actor.use_kl_loss", [&] { t.grpo.use_kl_loss = detail::parse_flag(key, v); }},
      {"actor_rollout_ref.actor.kl_loss_coef", [&] { t.grpo.kl_loss_coef = parse_number<double>(key, v); }},
      {"actor_rollout_ref.actor.kl_loss_type", [&] { t.grpo.kl_loss_type = std::string(v); }},
      {"actor_rollout_ref.model.num_experts", [&] { t.model.experts = parse_number<int>(key, v); }},
      {"actor_rollout_ref.model.moe_topk", [&] { t.model.topk = parse_number<int>(key, v); }},
      {"actor_rollout_ref.model.hidden_size", [&] { t.model.hidden = parse_number<int>(key, v); }},
      {"actor_rollout_ref.model.num_layers", [&] { t.model.layers = parse_number<int>(key, v); }},
      {"actor_rollout_ref.model.moe_intermediate_size", [&] { t.model.expert_hidden = parse_number<int>(key, v); }},
  };
  // Short aliases for the command line.
  static const std::map<std::string_view, std::string_view> aliases = {
      {"steps", "trainer.total_training_steps"}, {"seed", "trainer.seed"},
      {"out", "trainer.default_local_dir"},      {"name", "trainer.experiment_name"},
      {"batch", "data.train_batch_size"},        {"group", "actor_rollout_ref.rollout.n"},
      {"mini_batch", "actor_rollout_ref.actor.ppo_mini_batch_size"},
      {"lr", "actor_rollout_ref.actor.optim.lr"}, {"loss_agg_mode", "actor_rollout_ref.actor.loss_agg_mode"},
      {"adv_estimator", "algorithm.adv_estimator"}, {"kl_loss_type", "actor_rollout_ref.actor.kl_loss_type"},
      {"mode", "actor_rollout_ref.actor.router_replay.mode"}};
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

// key=value arguments (and --config FILE, --ranks N, --no-progress) -> options.
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
#if MOE_GRPO_WITH_YAML
      const YAML::Node root = YAML::LoadFile(args[++i]);
      mrr::read_replay_config(root, o.train.replay);
      // Every other scalar, flattened to its dotted key.
      std::function<void(const YAML::Node&, const std::string&)> walk = [&](const YAML::Node& n, const std::string& prefix) {
        if (n.IsMap()) {
          for (const auto& kv : n) walk(kv.second, prefix.empty() ? kv.first.as<std::string>() : prefix + "." + kv.first.as<std::string>());
        } else if (n.IsScalar() && prefix.rfind(mrr::ReplayConfig::kPrefix, 0) != 0 &&
                   prefix != mrr::ReplayConfig::kRolloutReplay) {
          set_option(o, prefix, n.as<std::string>());
        }
      };
      walk(root, "");
#else
      throw mrr::ConfigError("--config needs yaml-cpp (libyaml-cpp-dev); use key=value overrides");
#endif
    } else if (a.find('=') != std::string::npos) {
      overrides.push_back(a);
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
  o.train.replay.validate();
  if (o.ranks < 1) throw mrr::ConfigError("--ranks must be >= 1");
  if (o.experiment.empty()) o.experiment = std::string(mrr::to_string(o.train.replay.mode));
  return o;
}

}  // namespace moe_grpo
