// expect: Expert<X>|satisfy 'Expert'
// An expert block without backward/zero_gradients cannot compose an MoELayer: the Expert concept fails.
#include <mrr/mrr.hpp>

struct ForwardOnlyExperts {
  using scalar_type = float;
  struct gradients_type {};
  int num_experts() const { return 8; }
  int first_expert() const { return 0; }
  int hidden_size() const { return 4; }
  int intermediate_size() const { return 4; }
  mrr::RowMatrix<float> forward(int, mrr::MatrixRef<float> rows) const { return rows; }
};

int main() {
  mrr::MoELayer<mrr::TopKRouter<float>, ForwardOnlyExperts> layer(mrr::TopKRouter<float>(mrr::presets::mixtral(8, 2)),
                                                                  ForwardOnlyExperts{});
  return layer.hidden_size();
}
