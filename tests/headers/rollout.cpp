// mrr/rollout.hpp alone (it is not part of mrr/mrr.hpp): seeded sampling and log-probabilities.
#include <mrr/rollout.hpp>

namespace mrr_header_use {

inline mrr::Vector<float> rollout_logprobs(const mrr::RowMatrix<float>& logits, std::span<const std::int32_t> labels) {
  return mrr::rollout::logprobs_from_logits<float>(logits, labels);
}

}  // namespace mrr_header_use
