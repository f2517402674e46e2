// mrr/ppo.hpp alone (it is not part of mrr/mrr.hpp): advantages and the policy loss.
#include <mrr/ppo.hpp>

namespace mrr_header_use {

inline mrr::ppo::AdvantageResult<float> ppo_gae(const mrr::RowMatrix<float>& rewards, const mrr::RowMatrix<float>& values,
                                                const mrr::RowMatrix<float>& mask) {
  return mrr::ppo::compute_gae_advantage_return<float>(rewards, values, mask, 1.0, 0.95);
}

}  // namespace mrr_header_use
