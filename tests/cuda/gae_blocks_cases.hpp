// GAE blocks against chunks on the device system, bit for bit: run on a GPU by test_cuda_thrust and
// on the host, lane by lane, by test_device_kernels_emulated (tests/device). Included once by each,
// after doctest and mrr/kernels/ppo (gae_row).
#pragma once

#include "thrust_cuda.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iterator>
#include <limits>
#include <random>
#include <vector>

namespace {

// GAE blocks (a thread block per row) against chunks on the same strided views: every byte of the
// outputs (padding columns untouched) and the status, for rows whose chunk counts give 0 to 3
// in-row levels of the moments' tree, rows too long for a block (chunks runs), many short rows
// (the tree's launches before its last block), masked rows, and masks selecting none or one.
template <class T>
void gae_blocks_equal_chunks() {
  struct Shape {
    long rows, cols;
    int mask;  // 0 random runs, 1 nothing selected, 2 one element selected
  };
  // In-row tree levels: 0 (1000, 16, 1, 37, 300 columns), 1 (128), 2 (4096, 7168), 3 (8192: float
  // only, double's stage exceeds an H100's 227 KB); 8200 columns is too long for a block; 16 x 20000
  // and 128 x 10000 leave more parts than one block finishes (launches first), 16 x 8192 and
  // 16 x 8193 sit at that bound; 7952 / 7953 columns are the last double row that fits an H100
  // block and the first that does not.
  const Shape shapes[] = {{32, 4096, 0}, {7, 1000, 0},  {3, 8192, 0}, {2, 8200, 0}, {64, 128, 0}, {20000, 16, 0},
                          {1, 1, 0},     {5, 37, 0},    {4, 300, 1},  {4, 300, 2},  {2, 7168, 0}, {10000, 128, 0},
                          {8192, 16, 0}, {8193, 16, 0}, {1, 7952, 0}, {1, 7953, 0}};
  std::mt19937 rng(7);
  std::normal_distribution<double> n(0.0, 1.0);
  int blocks_ran = 0;
  for (const auto& shape : shapes) {
    CAPTURE(shape.rows);
    CAPTURE(shape.cols);
    CAPTURE(shape.mask);
    // The block kernel must really run where it fits, or the comparison is chunks against chunks.
    const long chunks = (shape.cols + 15) / 16;
    const auto fit = mrr::test::cuda_gae_blocks_fit<T>(shape.rows, shape.cols);
    CHECK(fit.fit == (chunks <= 512 && fit.bytes <= static_cast<std::size_t>(fit.optin)));
    if (fit.optin >= 232448)  // an H100 or H200: 227 KB a block
      CHECK(fit.fit == (chunks <= (sizeof(T) == 4 ? 512 : 497)));
    blocks_ran += fit.fit ? 1 : 0;
    const long stride = shape.cols + 3, size = shape.rows * stride;
    std::vector<T> r(static_cast<std::size_t>(size)), v(r.size()), m(r.size());
    for (long i = 0; i < size; ++i) {
      const long row = i / stride, col = i % stride;
      r[i] = col < shape.cols ? static_cast<T>(n(rng)) : std::numeric_limits<T>::quiet_NaN();
      v[i] = col < shape.cols ? static_cast<T>(n(rng)) : std::numeric_limits<T>::quiet_NaN();
      // Prompt-like zeros at the start of a row, padding at its end; row 1 fully masked.
      const bool on = col >= row % 5 && col < shape.cols - (row * 13) % (shape.cols / 2 + 1) && row != 1;
      m[i] = shape.mask == 0 ? T(on ? 1 : 0) : T(shape.mask == 2 && i == 0 ? 1 : 0);
    }
    std::vector<T> adv_chunks, ret_chunks, adv_blocks, ret_blocks;
    int code_chunks = -1, code_blocks = -1;
    const T fill = T(12345);
    REQUIRE(mrr::test::cuda_gae_view<T>(r, v, m, shape.rows, shape.cols, stride, 3, fill, adv_chunks, ret_chunks,
                                        code_chunks) == "");
    REQUIRE(mrr::test::cuda_gae_view<T>(r, v, m, shape.rows, shape.cols, stride, 4, fill, adv_blocks, ret_blocks,
                                        code_blocks) == "");
    long selected = 0;
    for (long i = 0; i < size; ++i)
      selected += m[i] != T(0) && i % stride < shape.cols;
    CAPTURE(selected);
    CHECK(code_blocks == code_chunks);
    CHECK(code_chunks == (selected == 0 ? 2 : selected == 1 ? 3 : 0));
    long differ = 0, first = -1;
    for (long i = 0; i < size; ++i)
      if (std::memcmp(&adv_chunks[i], &adv_blocks[i], sizeof(T)) != 0 ||
          std::memcmp(&ret_chunks[i], &ret_blocks[i], sizeof(T)) != 0) {
        if (first < 0) first = i;
        ++differ;
      }
    CAPTURE(first);
    CHECK(differ == 0);
    // The padding columns are not written.
    for (long i = shape.cols; i < size; i += stride)
      CHECK(adv_blocks[i] == fill);
    // And the values are GAE's: the last masked token's advantage of row 0 is r - v there.
    if (shape.mask == 0 && code_chunks == 0) {
      double worst = 0;
      std::vector<double> rr(static_cast<std::size_t>(shape.cols)), vv(rr.size()), mm(rr.size()), a(rr.size()),
          ret(rr.size());
      for (long row = 0; row < shape.rows; row += std::max(1L, shape.rows / 4)) {
        for (long j = 0; j < shape.cols; ++j) {
          rr[j] = r[row * stride + j], vv[j] = v[row * stride + j], mm[j] = m[row * stride + j];
        }
        mrr::kernels::ppo::gae_row<double>(rr.data(), vv.data(), mm.data(), a.data(), ret.data(), shape.cols, 0.99,
                                           0.99 * 0.95);
        for (long j = 0; j < shape.cols; ++j)
          worst = std::max(
              worst, std::abs(static_cast<double>(ret_blocks[row * stride + j]) - ret[j]) / (1.0 + std::abs(ret[j])));
      }
      CHECK(worst <= (sizeof(T) == 4 ? 1e-4 : 1e-10));
    }
  }
  MESSAGE("GAE shapes that ran the block kernel (", sizeof(T) * 8, "-bit): ", blocks_ran, " of ", std::size(shapes));
  CHECK(blocks_ran >= 10);
}

}  // namespace

TEST_CASE("CUDA GAE blocks equals chunks bit for bit (float, double; strided views; short and long rows)") {
  gae_blocks_equal_chunks<float>();
  gae_blocks_equal_chunks<double>();
}
