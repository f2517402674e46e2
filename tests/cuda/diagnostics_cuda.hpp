// Host interface of diagnostics.cu: the device diagnostics on the CUDA system.
#pragma once

#include "../device/diagnostics_types.hpp"

namespace mrr::test {

DiagnosticsResults cuda_diagnostics(const DiagnosticsInputs& inputs);

}  // namespace mrr::test
