// Loads a ReplayConfig from a verl-style YAML file (actor_rollout_ref.actor.router_replay.* and
// actor_rollout_ref.rollout.enable_rollout_routing_replay), then applies key=value overrides.
// Absent keys keep verl's defaults; a key given twice in a map on the way is an error, as it is
// for OmegaConf (which verl loads configs with), and so is a file that is not a regular file or
// holds several YAML documents; every failure is a ConfigError naming the file and the key.
// mrr-requires: mrr_yaml
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/detail/regular_file.hpp>
#include <mrr/error.hpp>
#include <mrr/replay/config.hpp>

#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/yaml.h>

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <set>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

MRR_NAMESPACE_BEGIN

namespace detail {

inline std::string yaml_path(std::string_view parent, std::string_view name) {
  return parent.empty() ? std::string(name) : str(parent, ".", name);
}

struct YamlEntry {
  YAML::Node key, value;
};

// The entries of the map `node` (at dotted `path`) as PyYAML, and so OmegaConf and verl, reads
// them: YAML 1.1 merge keys expanded (`<<: *base` or `<<: [*a, *b]`: the merged maps' entries,
// under the map's own keys, which win, and an earlier merged map's over a later one's). yaml-cpp
// expands none, and a key found only through a merge must not silently keep its default. A key
// written twice in one map is an error: yaml-cpp keeps both, and which one node[name] returns is
// not what a reader of the file expects (OmegaConf refuses it too).
inline std::vector<YamlEntry> yaml_entries(const YAML::Node& node, std::string_view path, int depth = 0) {
  std::vector<YamlEntry> out;
  std::set<std::string, std::less<>> seen;
  std::vector<YAML::Node> merges;
  for (const auto& kv : node) {
    const bool plain_scalar_key = kv.first.IsScalar() && (kv.first.Tag() == "?" || kv.first.Tag().empty());
    if (plain_scalar_key && kv.first.Scalar() == "<<") {
      merges.push_back(kv.second);
      continue;
    }
    if (kv.first.IsScalar() && !seen.insert(kv.first.Scalar()).second)
      throw ConfigError(str(yaml_path(path, kv.first.Scalar()), " appears twice; YAML keys must be unique"));
    out.push_back({kv.first, kv.second});
  }
  const std::string where = path.empty() ? std::string("the top level") : std::string(path);
  if (!merges.empty() && depth >= 32) throw ConfigError(str(where, ": merge keys (<<) nest more than 32 deep"));
  for (const YAML::Node& merge : merges) {
    std::vector<YAML::Node> maps;
    if (merge.IsSequence())
      for (const auto& m : merge)
        maps.push_back(m);
    else
      maps.push_back(merge);
    for (const YAML::Node& m : maps) {
      if (!m.IsMap()) throw ConfigError(str(where, ": a merge key (<<) takes a map or a list of maps"));
      for (YamlEntry& e : yaml_entries(m, path, depth + 1))
        if (!e.key.IsScalar() || seen.insert(e.key.Scalar()).second) out.push_back(std::move(e));
    }
  }
  return out;
}

// The value of key `name` in the map `node` (at dotted `path`), or an undefined node when the map
// or the key is absent (merge keys expanded, a key written twice an error: yaml_entries).
inline YAML::Node yaml_find(const YAML::Node& node, std::string_view path, std::string_view name) {
  YAML::Node found(YAML::NodeType::Undefined);
  if (!node.IsDefined() || !node.IsMap()) return found;
  for (const YamlEntry& e : yaml_entries(node, path))
    if (e.key.IsScalar() && e.key.Scalar() == name) found = e.value;
  return found;
}

// A map on the way to the router-replay keys: absent or null is an empty map, anything else is
// an error naming it.
inline YAML::Node yaml_map(const YAML::Node& parent, std::string_view parent_path, std::string_view name) {
  YAML::Node node = yaml_find(parent, parent_path, name);
  if (node.IsDefined() && !node.IsNull() && !node.IsMap())
    throw ConfigError(
        str(yaml_path(parent_path, name), ": expected a map, got ", node.IsSequence() ? "a list" : "a single value"));
  return node;
}

// A scalar resolved as the file wrote it: plain scalars as YAML resolves them, quoted ones (and
// !!str) as strings, the core schema's tags as their kinds.
inline ConfigValue yaml_value(const YAML::Node& node, std::string_view key) {
  if (node.IsNull()) return {ConfigValue::Kind::null, {}};
  if (!node.IsScalar()) throw ConfigError(str(key, ": expected a single value, got a list or a map"));
  const std::string& tag = node.Tag();
  const std::string& text = node.Scalar();
  if (tag == "?" || tag.empty()) return ConfigValue::plain(text);
  if (tag == "!" || tag == "tag:yaml.org,2002:str") return ConfigValue::quoted(text);
  if (tag == "tag:yaml.org,2002:null") return {ConfigValue::Kind::null, text};
  if (tag == "tag:yaml.org,2002:bool") return {ConfigValue::Kind::boolean, text};
  if (tag == "tag:yaml.org,2002:int" || tag == "tag:yaml.org,2002:float") return {ConfigValue::Kind::number, text};
  throw ConfigError(str(key, ": unsupported YAML tag ", tag));
}

}  // namespace detail

// Reads the router-replay keys of a parsed YAML tree into `config` (keys that are absent keep
// their values). Unknown or repeated keys under router_replay are errors; the rest of the tree is
// ignored.
inline void read_replay_config(const YAML::Node& root, ReplayConfig& config) {
  if (root.IsDefined() && !root.IsNull() && !root.IsMap())
    throw ConfigError("the top level of the configuration is not a map (expected actor_rollout_ref: ...)");
  const YAML::Node arr = detail::yaml_map(root, "", "actor_rollout_ref");
  const YAML::Node actor = detail::yaml_map(arr, "actor_rollout_ref", "actor");
  const YAML::Node replay = detail::yaml_find(actor, "actor_rollout_ref.actor", "router_replay");
  if (replay.IsDefined() && !replay.IsNull()) {
    if (!replay.IsMap())
      throw ConfigError(detail::str(ReplayConfig::kNode, ": expected a map of mode, record_file and replay_file"));
    for (const auto& kv : detail::yaml_entries(replay, ReplayConfig::kNode)) {
      if (!kv.key.IsScalar())
        throw ConfigError(detail::str(ReplayConfig::kNode, ": a key is a ",
                                      kv.key.IsNull() ? "null" : (kv.key.IsMap() ? "map" : "list"),
                                      "; keys are mode, record_file and replay_file"));
      const std::string key = std::string(ReplayConfig::kPrefix) + kv.key.Scalar();
      config.set(key, detail::yaml_value(kv.value, key));
    }
  }
  const YAML::Node rollout = detail::yaml_map(arr, "actor_rollout_ref", "rollout");
  const YAML::Node flag = detail::yaml_find(rollout, "actor_rollout_ref.rollout", "enable_rollout_routing_replay");
  if (flag.IsDefined())
    config.set(ReplayConfig::kRolloutReplay, detail::yaml_value(flag, ReplayConfig::kRolloutReplay));
}

namespace detail {

// Runs `f`, turning every failure into a ConfigError that starts with `source` (the file, or what
// the text came from).
template <class F>
auto with_source(std::string_view source, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const YAML::Exception& e) {
    throw ConfigError(str(source, ": ", e.what()));
  } catch (const ConfigError& e) {
    throw ConfigError(str(source, ": ", e.what()));
  }
}

// The bytes of a regular file. Anything else is refused without being read (open_regular_file
// opens without blocking and checks the descriptor): opening a FIFO for reading would wait for a
// writer that may never come, and a device may never end.
inline std::string read_regular_file(const std::filesystem::path& file) {
  const RegularFile opened = open_regular_file(file.c_str(), O_RDONLY);
  if (opened.not_regular())
    throw ConfigError(str("not a regular file (", opened.kind, "); a configuration is read from a regular file"));
  if (!opened.ok()) throw ConfigError(str("cannot be opened: ", std::strerror(opened.err)));
  const UniqueFd fd(opened.fd);
  std::string text;
  char buffer[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd.get(), buffer, sizeof buffer);
    if (n == 0) return text;
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw ConfigError(str("cannot be read: ", std::strerror(errno)));
    text.append(buffer, static_cast<std::size_t>(n));
  }
}

// Records where each document starts; the rest of the parse is not kept.
class DocumentStarts final : public YAML::EventHandler {
 public:
  std::vector<YAML::Mark> starts;
  void OnDocumentStart(const YAML::Mark& mark) override { starts.push_back(mark); }
  void OnDocumentEnd() override {}
  void OnNull(const YAML::Mark&, YAML::anchor_t) override {}
  void OnAlias(const YAML::Mark&, YAML::anchor_t) override {}
  void OnScalar(const YAML::Mark&, const std::string&, YAML::anchor_t, const std::string&) override {}
  void OnSequenceStart(const YAML::Mark&, const std::string&, YAML::anchor_t, YAML::EmitterStyle::value) override {}
  void OnSequenceEnd() override {}
  void OnMapStart(const YAML::Mark&, const std::string&, YAML::anchor_t, YAML::EmitterStyle::value) override {}
  void OnMapEnd() override {}
};

// The one YAML document of `text` (an empty text is a null document). Several documents are an
// error rather than the first one silently (PyYAML's safe_load, which OmegaConf uses, refuses
// them too): which of them is the configuration would be a guess. At most two documents are
// parsed, never YAML::LoadAll: on text it cannot read (",a") yaml-cpp reports empty documents at
// the same place without end, and Load takes the first of them as an empty configuration.
inline YAML::Node single_document(const std::string& text) {
  std::istringstream in(text);
  YAML::Parser parser(in);
  DocumentStarts documents;
  while (documents.starts.size() < 2 && parser.HandleNextDocument(documents)) {
  }
  if (documents.starts.size() == 2) {
    const YAML::Mark& second = documents.starts[1];
    if (second.pos == documents.starts[0].pos)
      throw ConfigError(str("is not YAML that can be read: the parser stops at line ", second.line + 1, ", column ",
                            second.column + 1));
    throw ConfigError(str("holds more than one YAML document (another starts at line ", second.line + 1,
                          "); a configuration is a single document"));
  }
  return YAML::Load(text);
}

// Reads the router-replay keys of `root`, then applies the overrides and validates.
template <class Str>
ReplayConfig replay_config_from(std::string_view source, const YAML::Node& root, std::span<const Str> overrides) {
  ReplayConfig config;
  with_source(source, [&] { read_replay_config(root, config); });
  config.apply_overrides(overrides);
  // An inconsistent combination names the file too, though an override may have made it so.
  with_source(overrides.empty() ? std::string(source) : str(source, " with its overrides"), [&] { config.validate(); });
  return config;
}

}  // namespace detail

// The YAML tree of a configuration file: a regular file holding one YAML document. Every failure
// (a missing file, a FIFO or other non-regular file, a syntax error, several documents) is a
// ConfigError that starts with "config file <file>".
inline YAML::Node load_yaml_config(const std::filesystem::path& yaml_file) {
  std::error_code ec;
  if (!std::filesystem::exists(yaml_file, ec))
    throw ConfigError(detail::str("config file ", yaml_file.string(), " does not exist"));
  return detail::with_source(detail::str("config file ", yaml_file.string()),
                             [&] { return detail::single_document(detail::read_regular_file(yaml_file)); });
}

// File, then overrides (later wins), then validate().
template <class Str = std::string>
ReplayConfig load_replay_config(const std::filesystem::path& yaml_file, std::span<const Str> overrides = {}) {
  const YAML::Node root = load_yaml_config(yaml_file);
  return detail::replay_config_from(detail::str("config file ", yaml_file.string()), root, overrides);
}

// The same from YAML text (`source` names it in messages).
template <class Str = std::string>
ReplayConfig load_replay_config_from_string(std::string_view yaml_text, std::span<const Str> overrides = {},
                                            std::string_view source = "YAML config") {
  const YAML::Node root = detail::with_source(source, [&] { return detail::single_document(std::string(yaml_text)); });
  return detail::replay_config_from(source, root, overrides);
}

// The overrides as a std::vector<std::string>, as a trainer usually holds them (a vector is not
// deduced as a span of its elements).
inline ReplayConfig load_replay_config(const std::filesystem::path& yaml_file,
                                       const std::vector<std::string>& overrides) {
  return load_replay_config<std::string>(yaml_file, std::span<const std::string>(overrides));
}
inline ReplayConfig load_replay_config_from_string(std::string_view yaml_text,
                                                   const std::vector<std::string>& overrides,
                                                   std::string_view source = "YAML config") {
  return load_replay_config_from_string<std::string>(yaml_text, std::span<const std::string>(overrides), source);
}

MRR_NAMESPACE_END
