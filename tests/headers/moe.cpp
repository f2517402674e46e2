// mrr/moe.hpp alone composes a layer on the CPU backend's router: router_for_t<CpuBackend, T>
// names TopKRouter, which must be defined here, not only declared (it once was only declared,
// and this translation unit failed with "incomplete type" in the Router concept).
#include <mrr/moe.hpp>

namespace mrr_header_use {

using Router = mrr::router_for_t<mrr::CpuBackend, float>;
using Layer = mrr::MoELayer<Router, mrr::SwiGLUExperts<float>>;
static_assert(mrr::Router<Router>);

inline void moe_forward_backward(Layer& layer, const mrr::RowMatrix<float>& x) {
  const auto forward = layer.forward(x);
  (void)layer.backward(forward, forward.output);
}

}  // namespace mrr_header_use
