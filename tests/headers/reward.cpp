// mrr/reward.hpp alone (it is not part of mrr/mrr.hpp): the dispatcher over the in-process
// transport.
#include <mrr/reward.hpp>

namespace mrr_header_use {

inline mrr::reward::DispatchResult reward_dispatch(mrr::reward::Dispatcher& dispatcher,
                                                   const mrr::reward::Request& request) {
  mrr::reward::InProcessTransport transport([](std::string_view, const mrr::reward::Request&) { return mrr::reward::Reply{}; });
  return dispatcher.dispatch(transport, request);
}

}  // namespace mrr_header_use
