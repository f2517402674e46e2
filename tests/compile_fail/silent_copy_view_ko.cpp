// expect: memory of another layout .*explicit copy .mrr::RowMatrix<T>.input..
// A column-major matrix passed where mrr takes a row-major view (MatrixRef): Eigen::Ref would copy
// it silently into a temporary; mrr refuses to compile it and names the explicit copy.
#include <mrr/router.hpp>

int main() {
  const mrr::TopKRouter<float> router(mrr::presets::mixtral(8, 2));
  const Eigen::MatrixXf column_major = Eigen::MatrixXf::Random(4, 8);
  (void)router.route(column_major);
}
