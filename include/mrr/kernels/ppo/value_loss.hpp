// The critic's clipped value loss per token (verl's compute_value_loss before aggregation): the
// value, d / d vpred and whether the clipped branch was the larger. Plain host/device code; the
// host's ppo/value_loss.hpp aggregates it.
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/kernels/ppo/common.hpp>

MRR_NAMESPACE_BEGIN
namespace kernels::ppo {

template <class T>
struct ValueLossTerms {
  T loss;        // max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2), before verl's 0.5
  T grad;        // d loss / d v
  bool clipped;  // the clipped loss was the larger (verl's vf_clipfrac)
};

// The clip is torch's max(min(v, hi), lo); ties of min / max share the gradient evenly, as
// autograd does.
template <class T>
MRR_HOST_DEVICE inline ValueLossTerms<T> value_loss_token(T vpred, T ret, T old_value, T cliprange) {
  const T hi = old_value + cliprange, lo = old_value - cliprange;
  T clipped = vpred, d_clipped = 1;
  if (vpred > hi) {
    clipped = hi;
    d_clipped = 0;
  } else if (vpred == hi) {
    d_clipped = T(0.5);
  }
  if (clipped < lo) {
    clipped = lo;
    d_clipped = 0;
  } else if (clipped == lo) {
    d_clipped = d_clipped * T(0.5);
  }
  const T loss1 = (vpred - ret) * (vpred - ret), loss2 = (clipped - ret) * (clipped - ret);
  const T grad1 = T(2) * (vpred - ret), grad2 = T(2) * (clipped - ret) * d_clipped;
  if (loss1 > loss2) return {loss1, grad1, false};
  if (loss1 < loss2) return {loss2, grad2, true};
  return {loss1, T(0.5) * (grad1 + grad2), false};
}

}  // namespace kernels::ppo
MRR_NAMESPACE_END
