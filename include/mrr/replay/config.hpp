// Router-replay configuration with verl's keys and defaults, from key=value overrides (later
// wins, as in Hydra) and, with <mrr/replay/config_yaml.hpp>, from a YAML file. A key that is
// absent keeps verl's default; a value of the wrong kind, a duplicate YAML key or an inconsistent
// combination is a ConfigError naming the key (docs/replay.md, "Configuration").
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>
#include <mrr/replay/mode.hpp>

#include <algorithm>
#include <filesystem>
#include <initializer_list>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

MRR_NAMESPACE_BEGIN

// One configuration value as written. An unquoted word resolves as YAML (PyYAML, which OmegaConf
// and so verl use) and Hydra resolve it: to null, a boolean, a number, a list or map (Hydra's
// `[a,b]` and `{k:v}` on a command line) or else a string; quoted text is always a string.
struct ConfigValue {
  enum class Kind { null, boolean, number, collection, string };
  Kind kind = Kind::string;
  std::string_view text;  // the scalar as written, without quotes

  static ConfigValue quoted(std::string_view text) { return {Kind::string, text}; }
  static ConfigValue plain(std::string_view text) { return {resolve(text), text}; }

  std::string describe() const {
    switch (kind) {
      case Kind::null:
        return "null";
      case Kind::boolean:
        return detail::str("the boolean ", text);
      case Kind::number:
        return detail::str("the number ", text);
      case Kind::collection:
        return detail::str("the ", text.front() == '[' ? "list " : "map ", text);
      case Kind::string:
        break;
    }
    return detail::str("'", text, "'");
  }

  // YAML 1.1's booleans as PyYAML resolves them (so OmegaConf, and so verl): true/false, yes/no
  // and on/off, each in lower, Title or UPPER case; nullopt for any other word. YAML 1.2's core
  // schema keeps only true/false, but a verl config is read with the 1.1 rules, so `On` and `yes`
  // are booleans here too.
  static std::optional<bool> boolean_word(std::string_view t) {
    if (one_of(t, {"true", "True", "TRUE", "yes", "Yes", "YES", "on", "On", "ON"})) return true;
    if (one_of(t, {"false", "False", "FALSE", "no", "No", "NO", "off", "Off", "OFF"})) return false;
    return std::nullopt;
  }

  // A boolean option's value: a YAML 1.1 boolean word (plain or quoted: OmegaConf converts the
  // string too) or the numbers 1 and 0; anything else is an error naming `key`.
  bool as_bool(std::string_view key) const {
    if (const auto b = boolean_word(text)) return *b;
    if (text == "1" || text == "0") return text == "1";
    throw ConfigError(detail::str(key, ": expected true or false, got ", describe(),
                                  " (booleans are YAML 1.1's: true/false, yes/no, on/off in lower, Title or UPPER "
                                  "case, or 1/0)"));
  }

 private:
  static bool one_of(std::string_view t, std::initializer_list<std::string_view> words) {
    return std::find(words.begin(), words.end(), t) != words.end();
  }
  static bool digit(char c) { return c >= '0' && c <= '9'; }

  // YAML 1.1 ints (decimal, 0x, 0o, 0b) and floats with an optional exponent, .inf and .nan.
  static bool is_number(std::string_view t) {
    if (!t.empty() && (t.front() == '+' || t.front() == '-')) t.remove_prefix(1);
    if (one_of(t, {".inf", ".Inf", ".INF"})) return true;
    if (t.empty()) return false;
    if (one_of(t, {".nan", ".NaN", ".NAN"})) return true;
    if (t.size() > 2 && t[0] == '0' && (t[1] == 'x' || t[1] == 'o' || t[1] == 'b')) {
      const std::string_view digits = t.substr(2);
      return std::all_of(digits.begin(), digits.end(), [&](char c) {
        return c == '_' || digit(c) || (t[1] == 'x' && ((c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F')));
      });
    }
    std::size_t i = 0, digits = 0;
    for (; i < t.size() && (digit(t[i]) || t[i] == '_'); ++i)
      digits += digit(t[i]);
    if (i < t.size() && t[i] == '.')
      for (++i; i < t.size() && (digit(t[i]) || t[i] == '_'); ++i)
        digits += digit(t[i]);
    if (digits == 0) return false;
    if (i < t.size() && (t[i] == 'e' || t[i] == 'E')) {
      ++i;
      if (i < t.size() && (t[i] == '+' || t[i] == '-')) ++i;
      const std::size_t exponent_start = i;
      while (i < t.size() && digit(t[i]))
        ++i;
      if (i == exponent_start) return false;
    }
    return i == t.size();
  }

  static Kind resolve(std::string_view t) {
    // "None" is not YAML's null, but mrr has always read it as one (a Python habit).
    if (one_of(t, {"", "~", "null", "Null", "NULL", "None"})) return Kind::null;
    if (boolean_word(t)) return Kind::boolean;
    if (t.front() == '[' || t.front() == '{') return Kind::collection;  // t is not empty: "" is null
    return is_number(t) ? Kind::number : Kind::string;
  }
};

// verl's defaults (RouterReplayConfig and RolloutConfig): mode disabled, no files, no rollout
// routes. A key that is never set keeps its default; so does one set to null.
struct ReplayConfig {
  static constexpr std::string_view kNode = "actor_rollout_ref.actor.router_replay";
  static constexpr std::string_view kPrefix = "actor_rollout_ref.actor.router_replay.";
  static constexpr std::string_view kMode = "actor_rollout_ref.actor.router_replay.mode";
  static constexpr std::string_view kRecordFile = "actor_rollout_ref.actor.router_replay.record_file";
  static constexpr std::string_view kReplayFile = "actor_rollout_ref.actor.router_replay.replay_file";
  // Hydra's instantiation target, present in verl's generated configs; read and ignored.
  static constexpr std::string_view kTarget = "actor_rollout_ref.actor.router_replay._target_";
  static constexpr std::string_view kRolloutReplay = "actor_rollout_ref.rollout.enable_rollout_routing_replay";

  ReplayMode mode = ReplayMode::disabled;
  std::string record_file;  // where recorded routes are appended (empty: keep them in memory)
  std::string replay_file;  // routes to replay from (empty: the run's own records)
  bool enable_rollout_routing_replay = false;

  // Sets one key from its text as written on a command line (quotes make it a string). Returns
  // false for keys that are not router-replay keys (a trainer's command line holds many); an
  // unknown key under router_replay is an error.
  bool set(std::string_view key, std::string_view value) { return set(key, command_line_value(key, value)); }

  // Sets one key from a resolved value (the YAML reader's entry point).
  bool set(std::string_view key, const ConfigValue& value) {
    if (key == kMode) {
      mode = mode_value(value);
    } else if (key == kRecordFile) {
      record_file = path_value(kRecordFile, value);
    } else if (key == kReplayFile) {
      replay_file = path_value(kReplayFile, value);
    } else if (key == kRolloutReplay) {
      enable_rollout_routing_replay = bool_value(kRolloutReplay, value);
    } else if (key == kTarget) {
      // Hydra's _target_ names the dataclass verl builds; nothing to configure here.
    } else if (key == kNode) {
      throw ConfigError(detail::str(kNode, ": set its keys one by one (", kNode, ".mode=R2, ...), not the whole map"));
    } else if (key.substr(0, kPrefix.size()) == kPrefix) {
      throw ConfigError(detail::str("unknown key ", key, " (router_replay has mode, record_file and replay_file)"));
    } else {
      return false;
    }
    return true;
  }

  // Applies "key=value" overrides in order (Hydra's "+key=value" and "++key=value" too) and
  // returns those that are not router-replay keys, untouched, for the rest of the trainer. A key
  // given twice takes its last value, as Hydra does. Hydra's deletion "~key" puts a key back to
  // verl's default, and "~key=value" does so when the key holds that value (else it is an error,
  // as in Hydra).
  template <class Str>
  std::vector<std::string> apply_overrides(std::span<const Str> args) {
    std::vector<std::string> rest;
    for (const auto& a : args) {
      std::string_view arg(a);
      std::string_view body = arg;
      const bool remove = body.starts_with('~');
      if (remove) body.remove_prefix(1);
      while (!remove && !body.empty() && body.front() == '+')
        body.remove_prefix(1);
      const auto eq = body.find('=');
      const std::string_view key = trim(body.substr(0, eq));
      const bool applied =
          remove ? unset(key, eq == std::string_view::npos ? std::nullopt
                                                           : std::optional<std::string_view>(trim(body.substr(eq + 1))))
                 : eq != std::string_view::npos && set(key, trim(body.substr(eq + 1)));
      if (!applied) rest.emplace_back(arg);
    }
    return rest;
  }

  // Hydra's "~key" / "~key=value": the key back to verl's default (when it holds `value`, if
  // given). False for keys that are not router-replay keys.
  bool unset(std::string_view key, std::optional<std::string_view> value = std::nullopt) {
    if (key == kNode) {
      if (value) throw ConfigError(detail::str("~", kNode, "=", *value, ": delete the whole map without a value"));
      const bool flag = enable_rollout_routing_replay;  // not under router_replay
      *this = ReplayConfig{};
      enable_rollout_routing_replay = flag;
      return true;
    }
    ReplayConfig fresh;
    if (!fresh.set(key, ConfigValue::plain({}))) return false;  // not ours (null is each key's default)
    if (value) {
      ReplayConfig given = *this;
      given.set(key, *value);
      if (!(given == *this))
        throw ConfigError(detail::str("~", key, "=", *value, ": the key does not hold ", *value,
                                      " (Hydra deletes a key only when its value matches)"));
    }
    set(key, ConfigValue::plain({}));
    return true;
  }

  bool operator==(const ReplayConfig&) const = default;

  std::vector<std::string> apply_overrides(int argc, const char* const* argv) {
    std::vector<std::string_view> args(argv + 1, argv + argc);
    return apply_overrides(std::span<const std::string_view>(args));
  }

  void validate() const {
    if (mode == ReplayMode::R2 && enable_rollout_routing_replay)
      throw ConfigError(detail::str(kMode, "=R2 records routes in the training engine, but ", kRolloutReplay,
                                    "=true asks the rollout engine for routes: use R3 to replay rollout routes, or "
                                    "set ",
                                    kRolloutReplay, "=false"));
    if (mode == ReplayMode::R3 && !enable_rollout_routing_replay)
      throw ConfigError(detail::str(kMode, "=R3 replays the rollout engine's routes, but ", kRolloutReplay,
                                    "=false, so the rollout returns none: set it to true (or use R2)"));
    if (mode == ReplayMode::disabled && (!record_file.empty() || !replay_file.empty()))
      throw ConfigError(
          detail::str(record_file.empty() ? kReplayFile : kRecordFile, " is set but ", kMode,
                      "=disabled records and replays nothing: set the mode to R2 or R3, or unset the file"));
    if (!record_file.empty() && !replay_file.empty() && !same_file(record_file, replay_file))
      throw ConfigError(
          detail::str(kRecordFile, " (", record_file, ") and ", kReplayFile, " (", replay_file,
                      ") name different files; one file can be both replayed and appended to, two cannot"));
  }

  // Whether two paths name one file, however they are spelled: the same file when both exist
  // (hard links and symlinks included), else the same absolute path once ".", ".." and the
  // symlinks of its existing part are resolved. So routes.mrr, ./routes.mrr and $PWD/routes.mrr
  // are one file, before the first run creates it too.
  static bool same_file(const std::filesystem::path& a, const std::filesystem::path& b) {
    std::error_code ec;
    if (std::filesystem::equivalent(a, b, ec) && !ec) return true;
    return resolved_path(a) == resolved_path(b);
  }

 private:
  // The absolute, normalised path (symlinks of its existing prefix resolved where the file system
  // answers, otherwise lexically).
  static std::filesystem::path resolved_path(const std::filesystem::path& p) {
    std::error_code ec;
    const std::filesystem::path absolute = std::filesystem::absolute(p, ec);
    if (ec) return p.lexically_normal();
    const std::filesystem::path canonical = std::filesystem::weakly_canonical(absolute, ec);
    return ec ? absolute.lexically_normal() : canonical;
  }

  // A value as written on a command line: quoted ('...' or "...") is a string, anything else is
  // resolved as YAML would. A quote that does not close is an error (Hydra refuses it too),
  // not part of the value.
  static ConfigValue command_line_value(std::string_view key, std::string_view value) {
    if (value.empty() || (value.front() != '"' && value.front() != '\'')) return ConfigValue::plain(value);
    if (value.size() < 2 || value.back() != value.front())
      throw ConfigError(
          detail::str(key, ": the value ", value, " opens a quote (", value.front(), ") that does not close"));
    return ConfigValue::quoted(value.substr(1, value.size() - 2));
  }

  static std::string_view trim(std::string_view s) {
    while (!s.empty() && (s.front() == ' ' || s.front() == '\t'))
      s.remove_prefix(1);
    while (!s.empty() && (s.back() == ' ' || s.back() == '\t'))
      s.remove_suffix(1);
    return s;
  }

  static ReplayMode mode_value(const ConfigValue& value) {
    if (value.kind == ConfigValue::Kind::null) return ReplayMode::disabled;
    if (value.kind != ConfigValue::Kind::string)
      throw ConfigError(detail::str(kMode, ": expected disabled, R2 or R3, got ", value.describe()));
    try {
      return parse_replay_mode(value.text);
    } catch (const ConfigError& e) {
      throw ConfigError(detail::str(kMode, ": ", e.what()));
    }
  }

  // A file path is a non-empty string, or null for none. A number or boolean is refused rather
  // than taken as a file name (quote it to mean one); so are "", blanks and embedded NUL bytes,
  // which no file system can open under the name given.
  static std::string path_value(std::string_view key, const ConfigValue& value) {
    using Kind = ConfigValue::Kind;
    if (value.kind == Kind::null) return {};
    if (value.kind != Kind::string)
      throw ConfigError(
          detail::str(key, ": expected a file path or null, got ", value.describe(), " (quote it to name a file)"));
    const std::string_view t = value.text;
    if (t.empty()) throw ConfigError(detail::str(key, ": the file path is empty (use null for no file)"));
    if (const auto nul = t.find('\0'); nul != std::string_view::npos)
      throw ConfigError(detail::str(key, ": the file path has a NUL byte at offset ", nul));
    if (std::all_of(t.begin(), t.end(), [](char c) { return c == ' ' || (c >= '\t' && c <= '\r'); }))
      throw ConfigError(detail::str(key, ": the file path is only whitespace (use null for no file)"));
    // OmegaConf resolves ${...} (quoted or not) before verl reads the value; mrr does not, and a
    // file named after the unresolved text is never what was meant. \${ is OmegaConf's escape
    // for a literal ${.
    std::string path;
    for (std::size_t i = 0; i < t.size(); ++i) {
      if (t.substr(i, 3) == "\\${") {
        path += "${";
        i += 2;
      } else if (t.substr(i, 2) == "${") {
        throw ConfigError(detail::str(key, ": '", t,
                                      "' holds an OmegaConf interpolation, which mrr does not "
                                      "resolve: give the path it stands for (e.g. from OmegaConf.to_yaml(cfg, "
                                      "resolve=True)), or write \\${ for a literal ${"));
      } else {
        path += t[i];
      }
    }
    return path;
  }

  static bool bool_value(std::string_view key, const ConfigValue& value) {
    if (value.kind == ConfigValue::Kind::null) return false;  // verl's default
    return value.as_bool(key);
  }
};

MRR_NAMESPACE_END
