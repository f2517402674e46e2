// expect: C must model mrr::Communicator
// A communicator without all_gather cannot compose an MoELayer: the static_assert names the concept.
#include <mrr/mrr.hpp>

#include <algorithm>
#include <cstddef>
#include <span>

struct NoGatherComm {
  int rank() const { return 0; }
  int size() const { return 1; }
  void barrier() const {}
  template <class T>
  void all_to_all_v(std::span<const T> send, std::span<const std::size_t>, std::span<T> recv,
                    std::span<const std::size_t>) const {
    std::copy(send.begin(), send.end(), recv.begin());
  }
  template <class T>
  void broadcast(std::span<T>, int) const {}
  template <class T>
  void all_reduce_sum(std::span<T>) const {}
};

int main() {
  mrr::MoELayer<mrr::TopKRouter<float>, mrr::SwiGLUExperts<float>, NoGatherComm> layer(
      mrr::TopKRouter<float>(mrr::presets::mixtral(8, 2)), mrr::SwiGLUExperts<float>(4, 8, 8), NoGatherComm{});
  return layer.hidden_size();
}
