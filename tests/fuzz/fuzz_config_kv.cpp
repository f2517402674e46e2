// libFuzzer target: arbitrary bytes as a trainer's command line (one argument per line, NUL bytes
// kept), applied to a ReplayConfig as key=value overrides and validated. Every outcome must be
// success or a ConfigError; a configuration that is accepted must hold only values the store can
// use (no empty, blank or NUL-carrying file path). Anything else is a finding.
#include <mrr/replay/config.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

namespace {

bool usable_path(const std::string& path) {
  if (path.empty()) return true;  // no file
  if (path.find('\0') != std::string::npos) return false;
  return !std::all_of(path.begin(), path.end(), [](char c) { return c == ' ' || (c >= '\t' && c <= '\r'); });
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  std::vector<std::string> args;
  for (std::size_t begin = 0; begin <= input.size();) {
    const std::size_t end = std::min(input.find('\n', begin), input.size());
    args.emplace_back(input.substr(begin, end - begin));
    begin = end + 1;
  }
  mrr::ReplayConfig config;
  try {
    const auto rest = config.apply_overrides(std::span<const std::string>(args));
    if (rest.size() > args.size()) std::abort();
    if (!usable_path(config.record_file) || !usable_path(config.replay_file)) std::abort();
    config.validate();
    if (config.mode == mrr::ReplayMode::R3 && !config.enable_rollout_routing_replay) std::abort();
    if (config.mode == mrr::ReplayMode::R2 && config.enable_rollout_routing_replay) std::abort();
  } catch (const mrr::ConfigError&) {
  }
  return 0;
}
