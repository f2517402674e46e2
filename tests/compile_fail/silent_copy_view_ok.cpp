// The twin of silent_copy_view_ko.cpp: the explicit copy, a row-major matrix, a block of its rows,
// a Map with padded rows and an expression (evaluated, as anywhere) are all taken.
#include <mrr/router.hpp>

int main() {
  const mrr::TopKRouter<float> router(mrr::presets::mixtral(8, 2));
  const Eigen::MatrixXf column_major = Eigen::MatrixXf::Random(4, 8);
  (void)router.route(mrr::RowMatrix<float>(column_major));
  const mrr::RowMatrix<float> logits = column_major;
  (void)router.route(logits);
  (void)router.route(logits.middleRows(1, 2));
  (void)router.route(
      Eigen::Map<const mrr::RowMatrix<float>, 0, Eigen::OuterStride<>>(logits.data(), 2, 4, Eigen::OuterStride<>(8)));
  (void)router.route(logits * 2.0f);
}
