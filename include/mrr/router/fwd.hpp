// The router's class templates, declared with their default backend: CpuBackend, so that
// TopKRouter<float> and Routing<float> are the CPU's (router/topk_router.hpp, router/routing.hpp).
// A backend specialises both for its type: the Thrust backend for ThrustBackend<S>
// (thrust/routing.hpp; device::TopKRouter and device::Routing name those specialisations).
#pragma once

#include <mrr/detail/config.hpp>

MRR_NAMESPACE_BEGIN

struct CpuBackend;

template <class T, class Backend = CpuBackend>
struct Routing;

template <class Scalar, class Backend = CpuBackend>
class TopKRouter;

MRR_NAMESPACE_END
