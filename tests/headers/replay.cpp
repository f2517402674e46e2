// mrr/replay.hpp alone: every store models RouteStore, and the controller binds to the run-time
// choice of store.
#include <mrr/replay.hpp>

namespace mrr_header_use {

static_assert(mrr::RouteStore<mrr::MemoryRouteStore> && mrr::RouteStore<mrr::FileRouteStore> &&
              mrr::RouteStore<mrr::AnyRouteStore>);

inline std::size_t replay_record_lookup(mrr::RoutingReplay<mrr::AnyRouteStore>& replay, mrr::AnyRouteStore& store,
                                        const mrr::TokenLayout& layout, mrr::ExpertIds& ids,
                                        std::vector<std::uint8_t>& found) {
  replay.set_micro_batch(layout);
  store.record(0, layout, ids);
  return store.lookup(0, layout, ids, found);
}

}  // namespace mrr_header_use
