// mrr/mrr.hpp alone: the core (routers, routing replay with memory and file stores, the MoE
// layer, the single-process communicator), composed as the README's example composes it.
#include <mrr/mrr.hpp>

namespace mrr_header_use {

using Layer = mrr::MoELayer<mrr::TopKRouter<float>, mrr::SwiGLUExperts<float>, mrr::SingleProcess,
                            mrr::MemoryRouteStore>;

inline mrr::Routing<float> core_route(mrr::RoutingReplay<mrr::FileRouteStore>& replay, const mrr::RowMatrix<float>& x) {
  const mrr::TopKRouter<float> router(mrr::presets::qwen3_moe(64, 8));
  return replay.route(router, /*layer=*/0, x);
}

inline void core_layer(Layer& layer, const mrr::RowMatrix<float>& x) { (void)layer.forward(x); }

}  // namespace mrr_header_use
