// The deterministic top-k moved to mrr/kernels/topk.hpp (one definition for every backend); these
// names stay for existing includers.
#pragma once

#include <mrr/kernels/topk.hpp>

MRR_NAMESPACE_BEGIN
namespace detail {
using kernels::topk_desc;
using kernels::topk_desc_bounded;
using kernels::topk_insert;
}  // namespace detail
MRR_NAMESPACE_END
