// mrr/router.hpp alone: a preset router routes, replays and differentiates, and its routing
// goes through capacity and permutation.
#include <mrr/router.hpp>

namespace mrr_header_use {

inline mrr::Routing<float> route_with_preset(const mrr::RowMatrix<float>& logits) {
  const mrr::TopKRouter<float> router(mrr::presets::qwen3_moe(64, 8));
  auto routing = router.route(logits);
  (void)router.backward(logits, routing, routing.weights);
  return routing;
}

}  // namespace mrr_header_use
