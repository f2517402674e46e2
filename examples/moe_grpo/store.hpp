// One route-store type for the trainer whether routes live in memory or in a route file (the
// configuration decides at run time), so the model is compiled once. Models mrr::RouteStore.
#pragma once

#include <mrr/concepts.hpp>
#include <mrr/replay/file_store.hpp>
#include <mrr/replay/memory_store.hpp>

#include <utility>
#include <variant>

namespace moe_grpo {

class AnyRouteStore {
 public:
  explicit AnyRouteStore(mrr::RouteShape shape) : store_(std::in_place_type<mrr::MemoryRouteStore>, shape) {}
  explicit AnyRouteStore(mrr::FileRouteStore file) : store_(std::in_place_type<mrr::FileRouteStore>, std::move(file)) {}

  const mrr::RouteShape& shape() const {
    return std::visit([](const auto& s) -> const mrr::RouteShape& { return s.shape(); }, store_);
  }
  void record(int layer, const mrr::TokenLayout& layout, mrr::ExpertIdsRef ids) {
    std::visit([&](auto& s) { s.record(layer, layout, ids); }, store_);
  }
  std::size_t lookup(int layer, const mrr::TokenLayout& layout, mrr::ExpertIds& out, std::vector<std::uint8_t>& found) const {
    return std::visit([&](const auto& s) { return s.lookup(layer, layout, out, found); }, store_);
  }
  std::int64_t recorded_positions(mrr::SequenceId uid) const {
    return std::visit([&](const auto& s) { return s.recorded_positions(uid); }, store_);
  }
  bool is_file() const { return std::holds_alternative<mrr::FileRouteStore>(store_); }
  // Routes of finished steps are not needed again in memory; a file keeps them.
  void end_step() {
    if (auto* m = std::get_if<mrr::MemoryRouteStore>(&store_)) m->clear();
    if (auto* f = std::get_if<mrr::FileRouteStore>(&store_)) f->release_cache();
  }

 private:
  std::variant<mrr::MemoryRouteStore, mrr::FileRouteStore> store_;
};

static_assert(mrr::RouteStore<AnyRouteStore>);

}  // namespace moe_grpo
