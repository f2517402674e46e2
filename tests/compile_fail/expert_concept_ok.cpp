// An identity expert block models mrr::Expert and composes an MoELayer.
#include <mrr/mrr.hpp>

struct IdentityExperts {
  using scalar_type = float;
  struct gradients_type {};
  int num_experts() const { return 8; }
  int first_expert() const { return 0; }
  int hidden_size() const { return 4; }
  int intermediate_size() const { return 4; }
  mrr::RowMatrix<float> forward(int, mrr::MatrixRef<float> rows) const { return rows; }
  mrr::RowMatrix<float> backward(int, mrr::MatrixRef<float>, mrr::MatrixRef<float> grad, gradients_type&) const {
    return grad;
  }
  gradients_type zero_gradients() const { return {}; }
};

int main() {
  mrr::MoELayer<mrr::TopKRouter<float>, IdentityExperts> layer(mrr::TopKRouter<float>(mrr::presets::mixtral(8, 2)),
                                                               IdentityExperts{});
  return layer.hidden_size();
}
