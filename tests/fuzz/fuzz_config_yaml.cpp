// libFuzzer target: arbitrary bytes as a verl-style YAML configuration, loaded from a string and
// (for inputs whose first byte is odd) from a temporary file. Every outcome must be success or a
// ConfigError naming the source: a yaml-cpp exception escaping the API, a crash or a sanitizer
// report is a finding, and an accepted configuration must hold usable values.
#include <mrr/replay/config_yaml.hpp>

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <string_view>

namespace {

std::filesystem::path work_dir() {
  static const std::filesystem::path dir = [] {
    auto d = std::filesystem::temp_directory_path() / ("mrr-fuzz-config-yaml-" + std::to_string(::getpid()));
    std::filesystem::create_directories(d);
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(
          std::filesystem::temp_directory_path() / ("mrr-fuzz-config-yaml-" + std::to_string(::getpid())), ec);
    });
    return d;
  }();
  return dir;
}

bool usable_path(const std::string& path) {
  if (path.empty()) return true;  // no file
  if (path.find('\0') != std::string::npos) return false;
  return !std::all_of(path.begin(), path.end(), [](char c) { return c == ' ' || (c >= '\t' && c <= '\r'); });
}

void check(const mrr::ReplayConfig& config) {
  if (!usable_path(config.record_file) || !usable_path(config.replay_file)) std::abort();
  if (config.mode == mrr::ReplayMode::R3 && !config.enable_rollout_routing_replay) std::abort();
  if (config.mode == mrr::ReplayMode::R2 && config.enable_rollout_routing_replay) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    check(mrr::load_replay_config_from_string(text));
  } catch (const mrr::ConfigError& e) {
    // Reading errors name the source; validate()'s (which may involve overrides) name the keys.
    const std::string_view what = e.what();
    if (what.substr(0, 13) != "YAML config: " && what.find("actor_rollout_ref.") == std::string_view::npos)
      std::abort();
  }
  if (size == 0 || (data[0] & 1) == 0) return 0;
  const auto path = work_dir() / "ppo.yaml";
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) std::abort();
  if (std::fwrite(data, 1, size, f) != size) std::abort();
  std::fclose(f);
  try {
    check(mrr::load_replay_config(path));
  } catch (const mrr::ConfigError&) {
  }
  return 0;
}
