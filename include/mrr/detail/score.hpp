// The score functions moved to mrr/kernels/score.hpp (one definition for every backend); these
// names stay for existing includers.
#pragma once

#include <mrr/kernels/score.hpp>

MRR_NAMESPACE_BEGIN
namespace detail {
using kernels::sigmoid;
using kernels::sigmoid_grad_from_value;
using kernels::softplus;
using kernels::sqrt_softplus;
using kernels::sqrt_softplus_grad;
}  // namespace detail
MRR_NAMESPACE_END
