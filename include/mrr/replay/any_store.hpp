// AnyRouteStore: one route-store type whether routes live in memory or in a route file, chosen at
// run time (by a ReplayConfig's record_file / replay_file), so a model is compiled once. Models
// mrr::RouteStore; the choice costs one std::visit per call (a layer's lookup or record), not per
// row.
#pragma once

#include <mrr/concepts.hpp>
#include <mrr/detail/config.hpp>
#include <mrr/replay/config.hpp>
#include <mrr/replay/file_store.hpp>
#include <mrr/replay/memory_store.hpp>
#include <mrr/replay/open_store.hpp>

#include <cstdint>
#include <span>
#include <utility>
#include <variant>
#include <vector>

MRR_NAMESPACE_BEGIN

class AnyRouteStore {
 public:
  explicit AnyRouteStore(RouteShape shape) : store_(std::in_place_type<MemoryRouteStore>, shape) {}
  explicit AnyRouteStore(FileRouteStore file) : store_(std::in_place_type<FileRouteStore>, std::move(file)) {}

  // The store a configuration names: its route file (opened as open_route_file does: appended
  // to, or replayed from and checked against `model`), else memory.
  static AnyRouteStore from_config(const ReplayConfig& config, const RouteShape& model, FileStoreOptions options = {}) {
    if (auto file = open_route_file(config, model, options)) return AnyRouteStore(std::move(*file));
    return AnyRouteStore(model);
  }

  const RouteShape& shape() const {
    return std::visit([](const auto& s) -> const RouteShape& { return s.shape(); }, store_);
  }
  void record(int layer, const TokenLayout& layout, ExpertIdsRef ids) {
    std::visit([&](auto& s) { s.record(layer, layout, ids); }, store_);
  }
  template <class Id>  // int32, int64, uint16, uint8: as the stores' lookup
  std::size_t lookup(int layer, const TokenLayout& layout, RowMatrix<Id>& out, std::vector<std::uint8_t>& found) const {
    return std::visit([&](const auto& s) { return s.lookup(layer, layout, out, found); }, store_);
  }
  // A span of one sequence for a range of layers, ids [tokens][layers][k] (import_routed_experts).
  void record_sequence(SequenceId uid, std::int64_t first_position, std::int64_t num_tokens, int first_layer,
                       int num_layers, std::span<const std::int32_t> ids) {
    std::visit([&](auto& s) { s.record_sequence(uid, first_position, num_tokens, first_layer, num_layers, ids); },
               store_);
  }
  std::int64_t recorded_positions(SequenceId uid) const {
    return std::visit([&](const auto& s) { return s.recorded_positions(uid); }, store_);
  }
  bool contains(SequenceId uid) const {
    return std::visit([&](const auto& s) { return s.contains(uid); }, store_);
  }

  bool is_file() const { return std::holds_alternative<FileRouteStore>(store_); }
  FileRouteStore* file() { return std::get_if<FileRouteStore>(&store_); }
  MemoryRouteStore* memory() { return std::get_if<MemoryRouteStore>(&store_); }

  // Done with the sequences recorded or read so far (a training step ended): memory forgets them,
  // a file keeps them and forgets only what it read.
  void end_step() {
    if (auto* m = memory()) m->clear();
    if (auto* f = file()) f->release_cache();
  }

 private:
  std::variant<MemoryRouteStore, FileRouteStore> store_;
};

static_assert(RouteStore<AnyRouteStore>);

MRR_NAMESPACE_END
