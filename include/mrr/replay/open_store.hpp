// Opens the file store a ReplayConfig names, checked against the model: record_file is appended
// to (created when missing, a torn tail recovered), replay_file must exist and match the model's
// experts, layers and k. Errors name the configuration key and the file.
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>
#include <mrr/replay/config.hpp>
#include <mrr/replay/file_store.hpp>
#include <mrr/replay/shape.hpp>

#include <filesystem>
#include <optional>

MRR_NAMESPACE_BEGIN

// nullopt when the configuration names no file (routes then live in a MemoryRouteStore).
inline std::optional<FileRouteStore> open_route_file(const ReplayConfig& config, const RouteShape& model,
                                                     FileStoreOptions options = {}) {
  config.validate();
  try {
    if (!config.replay_file.empty()) {
      std::error_code ec;
      // A replay file must exist (append would create it); open() says what is wrong with the path:
      // missing, a dangling symlink or a symlink loop.
      if (!std::filesystem::exists(config.replay_file, ec))
        return FileRouteStore::open(config.replay_file, model, options);
      if (!config.record_file.empty() && ReplayConfig::same_file(config.record_file, config.replay_file))
        return FileRouteStore::append(config.replay_file, model, options);
      return FileRouteStore::open(config.replay_file, model, options);
    }
    if (!config.record_file.empty()) return FileRouteStore::append(config.record_file, model, options);
  } catch (const RouteFileError& e) {
    const auto key = config.replay_file.empty() ? ReplayConfig::kRecordFile : ReplayConfig::kReplayFile;
    throw RouteFileError(detail::str(key, ": ", e.what()));
  }
  return std::nullopt;
}

MRR_NAMESPACE_END
