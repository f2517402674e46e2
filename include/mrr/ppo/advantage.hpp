// Advantage estimators with verl's names and semantics (core_algos.py at 1dda039b): GAE, GRPO and
// its variants, RLOO, OPO, REINFORCE++ (with and without baseline), ReMax, GPG, GDPO and the
// optimal token baseline (single- and multi-turn).
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/detail/parallel.hpp>
#include <mrr/error.hpp>
#include <mrr/kernels/ppo/advantage.hpp>
#include <mrr/kernels/ppo/masked.hpp>
#include <mrr/ppo/detail/validate.hpp>
#include <mrr/ppo/groups.hpp>
#include <mrr/ppo/masked.hpp>
#include <mrr/ppo/optional_view.hpp>
#include <mrr/tensor.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

MRR_NAMESPACE_BEGIN
namespace ppo {

// Every estimator returns both tensors, as verl does; outcome estimators return the same values twice.
template <class T>
struct AdvantageResult {
  RowMatrix<T> advantages;  // [batch, response_length]
  RowMatrix<T> returns;     // [batch, response_length]
};

namespace detail {

// Accumulates masked moments part by part (Chan et al.'s pairwise update, kernels/ppo/masked.hpp),
// so a producer can fold each block in while it is still in cache. Sums run in double.
template <class T>
class MaskedMomentAccumulator {
 public:
  // Adds a group of elements given by its total mask weight, weighted mean and centred M2.
  void add_moments(double weight, double mean, double m2) { kernels::ppo::merge(total_, {weight, mean, m2}); }

  // verl's masked_whiten statistics (kernels::ppo::mean_and_variance, unbiased).
  MaskedMoments<T> whitening_moments(std::string_view function) const {
    MaskedMoments<T> out{};
    const auto status = kernels::ppo::mean_and_variance<T>(total_, true, out.mean, out.variance);
    mrr::detail::require(status != kernels::ppo::Status::empty_mask, function,
                         "'response_mask' selects no element; whitening is undefined");
    mrr::detail::require(status != kernels::ppo::Status::single_element, function,
                         "'response_mask' selects a single element; the unbiased variance divides by zero");
    return out;
  }

 private:
  kernels::ppo::Moments total_;
};

template <class T>
void whiten_in_place(RowMatrix<T>& values, const MaskedMoments<T>& moments) {
  // kernels::ppo::whiten over every element, vectorised by Eigen (the same operations).
  const T inv_std = kernels::ppo::whitening_scale(moments.variance);
  mrr::detail::parallel_tiles(values.rows(), row_tile(values.cols()), values.size(),
                              [&](std::int64_t, std::int64_t begin, std::int64_t end) {
                                auto block = values.middleRows(begin, end - begin).array();
                                block = (block - moments.mean) * inv_std;
                              });
}

// dst = whiten(src) * mask (verl's masked_whiten, then the mask applied), and *also = dst when
// given, in one pass on OpenMP row tiles: per element the operations of whiten_in_place followed
// by the multiplication by the mask. dst may be src.
template <class T>
void whiten_masked_into(RowMatrix<T>& dst, const RowMatrix<T>& src, const MatrixRef<T>& mask,
                        const MaskedMoments<T>& moments, RowMatrix<T>* also = nullptr) {
  const T inv_std = kernels::ppo::whitening_scale(moments.variance);
  mrr::detail::parallel_tiles(
      src.rows(), row_tile(src.cols()), src.size(), [&](std::int64_t, std::int64_t begin, std::int64_t end) {
        const Eigen::Index n = end - begin;
        dst.middleRows(begin, n).array() =
            ((src.middleRows(begin, n).array() - moments.mean) * inv_std) * mask.middleRows(begin, n).array();
        if (also != nullptr) also->middleRows(begin, n) = dst.middleRows(begin, n);
      });
}

// dst = mask * scalars[row] (resized to the mask's shape), on OpenMP row tiles, and verl's
// masked_whiten statistics of dst: every selected element of row i holds scalars[i], so the
// moments are those of count_i copies of it (count_i the row's mask sum, exact for a 0/1 mask),
// merged row by row in row order (Chan et al.: M2 of the copies is 0); one pass over the mask
// instead of two over the broadcast values, with each mask row's 0/1 check. The scalars are finite.
template <class T>
MaskedMoments<T> broadcast_rows_into(std::string_view function, RowMatrix<T>& dst, const MatrixRef<T>& mask,
                                     const Vector<T>& scalars) {
  dst.resize(mask.rows(), mask.cols());
  Vector<T> count(mask.rows());
  mrr::detail::parallel_tiles(mask.rows(), row_tile(mask.cols()), mask.size(),
                              [&](std::int64_t, std::int64_t begin, std::int64_t end) {
                                for (Eigen::Index i = begin; i < end; ++i) {
                                  const auto mask_row = mask.row(i);
                                  if (!is_binary_mask(mask_row)) [[unlikely]]
                                    require_mask(function, "response_mask", mask_row, i);
                                  dst.row(i).array() = mask_row.array() * scalars[i];
                                  count[i] = mask_row.sum();
                                }
                              });
  MaskedMomentAccumulator<T> acc;
  for (Eigen::Index i = 0; i < mask.rows(); ++i)
    acc.add_moments(static_cast<double>(count[i]), static_cast<double>(scalars[i]), 0.0);
  return acc.whitening_moments(function);
}

// Shapes only; the values are checked where they are first read (see response_scores and
// broadcast_outcome), so that validation costs no extra pass over the batch.
template <class T>
void check_token_shapes(std::string_view function, const MatrixRef<T>& rewards, const MatrixRef<T>& mask) {
  require_nonempty(function, "token_level_rewards", rewards);
  require_same_shape(function, "token_level_rewards", rewards, "response_mask", mask);
}

template <class T>
void check_token_inputs(std::string_view function, const MatrixRef<T>& rewards, const MatrixRef<T>& mask) {
  check_token_shapes<T>(function, rewards, mask);
  require_finite(function, "token_level_rewards", rewards);
  require_mask(function, "response_mask", mask);
}

template <class T>
void check_group_inputs(std::string_view function, const MatrixRef<T>& rewards, const MatrixRef<T>& mask,
                        const GroupIndex& index) {
  check_token_shapes<T>(function, rewards, mask);
  require_rows(function, "index", index.size(), "token_level_rewards", rewards);
}

// Per-response score = sum of its token rewards (verl sums every column, masked or not). A NaN or
// inf reward makes its row sum non-finite, which is how it is detected. Rows in parallel tiles;
// each row sum is one vectorised reduction, the same whatever the thread count.
template <class T>
Vector<T> response_scores(std::string_view function, const MatrixRef<T>& rewards) {
  Vector<T> scores(rewards.rows());
  mrr::detail::parallel_tiles(rewards.rows(), row_tile(rewards.cols()), rewards.size(),
                              [&](std::int64_t, std::int64_t begin, std::int64_t end) {
                                const Eigen::Index n = end - begin;
                                scores.segment(begin, n) = rewards.middleRows(begin, n).rowwise().sum();
                              });
  if (!scores.allFinite()) [[unlikely]] {
    require_finite(function, "token_level_rewards", rewards);
    mrr::detail::throw_invalid_argument(function, "a row sum of 'token_level_rewards' overflowed");
  }
  return scores;
}

// Sizes the outputs (keeping their storage when the shape matches) and refuses outputs that
// overlap an input: the estimators read inputs after writing outputs.
template <class T, class... Inputs>
void prepare_output(std::string_view function, AdvantageResult<T>& out, Eigen::Index rows, Eigen::Index cols,
                    const Inputs&... inputs) {
  out.advantages.resize(rows, cols);
  out.returns.resize(rows, cols);
  const auto overlaps = [&](const RowMatrix<T>& output, const auto& input) {
    if (input.size() == 0) return false;
    const T* in_begin = input.data();
    const T* in_end = input.data() + (input.rows() - 1) * input.outerStride() + input.cols();
    return output.data() < in_end && in_begin < output.data() + output.size();
  };
  const bool aliased = ((overlaps(out.advantages, inputs) || overlaps(out.returns, inputs)) || ...);
  mrr::detail::require(!aliased, function, "'out' shares memory with an input; pass separate output matrices");
}

// Outcome estimators broadcast one scalar per response over its tokens: advantage = scalar * mask,
// in one pass per row (returns, when wanted, copied from the row while it is in L1), the 0/1 check
// of the mask row fused in. Row tiles run in parallel; the first bad row is reported, as serially.
template <class T>
void broadcast_outcome_rows(std::string_view function, const Vector<T>& per_response, const MatrixRef<T>& mask,
                            OutputRef<T>& advantages, OutputRef<T>* returns) {
  mrr::detail::parallel_tiles(mask.rows(), row_tile(mask.cols()), mask.size(),
                              [&](std::int64_t, std::int64_t begin, std::int64_t end) {
                                for (Eigen::Index i = begin; i < end; ++i) {
                                  const auto mask_row = mask.row(i);
                                  advantages.row(i) = mask_row * per_response[i];
                                  if (returns != nullptr) returns->row(i) = advantages.row(i);
                                  if (!is_binary_mask(mask_row)) [[unlikely]]
                                    require_mask(function, "response_mask", mask_row, i);
                                }
                              });
}

template <class T>
void broadcast_outcome(std::string_view function, const Vector<T>& per_response, const MatrixRef<T>& mask,
                       AdvantageResult<T>& out) {
  OutputRef<T> advantages(out.advantages), returns(out.returns);
  broadcast_outcome_rows<T>(function, per_response, mask, advantages, &returns);
}

using kernels::ppo::singleton_std_plus_epsilon;

// Unbiased standard deviation and mean of the group members' scores (kernels/ppo/advantage.hpp).
template <class T>
T group_std(const Vector<T>& scores, std::span<const Eigen::Index> members, T mean) {
  return kernels::ppo::group_std(scores.data(), members.data(), static_cast<long>(members.size()), mean);
}

template <class T>
T group_mean(const Vector<T>& scores, std::span<const Eigen::Index> members) {
  return kernels::ppo::group_mean(scores.data(), members.data(), static_cast<long>(members.size()));
}

// Every group's per-response scalars by kernels::ppo::group_outcome.
template <class T>
Vector<T> group_outcome_scalars(const Vector<T>& scores, const GroupIndex& index,
                                kernels::ppo::OutcomeEstimator estimator, double epsilon = 0) {
  Vector<T> scalars(scores.size());
  const T singleton = static_cast<T>(singleton_std_plus_epsilon(epsilon));
  for (Eigen::Index g = 0; g < index.num_groups(); ++g) {
    const auto members = index.members(g);
    kernels::ppo::group_outcome(scores.data(), members.data(), static_cast<long>(members.size()), estimator,
                                static_cast<T>(epsilon), singleton, scalars.data());
  }
  return scalars;
}

// Copies between `rows` row-major rows (row stride `stride`) and a column-major tile with `Rows`
// lanes per column, i.e. a transpose, in P x P blocks of 16-byte vectors (P = 4 float, 2 double)
// with GCC's and Clang's generic vectors and shuffles, which every target lowers (SSE, AVX, NEON,
// or scalar code), and scalar code for the ragged edges and other compilers. Lanes >= rows are zero.
template <class T, int Rows>
struct TileTranspose {
#if defined(__GNUC__) || defined(__clang__)
  static constexpr int kBlock = 16 / static_cast<int>(sizeof(T));
  static constexpr bool kVectorized = (kBlock == 4 || kBlock == 2) && Rows % kBlock == 0;
  typedef T Vec __attribute__((vector_size(16)));  // an alias declaration drops the attribute

  // d[i * d_stride + k] = s[k * s_stride + i] for a kBlock x kBlock block.
  static void block(const T* s, Eigen::Index s_stride, T* d, Eigen::Index d_stride) {
    Vec r[kBlock > 0 ? kBlock : 1];
    for (int i = 0; i < kBlock; ++i)
      std::memcpy(&r[i], s + i * s_stride, sizeof(Vec));
    if constexpr (kBlock == 4) {
      const Vec t0 = __builtin_shufflevector(r[0], r[1], 0, 4, 1, 5);
      const Vec t1 = __builtin_shufflevector(r[0], r[1], 2, 6, 3, 7);
      const Vec t2 = __builtin_shufflevector(r[2], r[3], 0, 4, 1, 5);
      const Vec t3 = __builtin_shufflevector(r[2], r[3], 2, 6, 3, 7);
      r[0] = __builtin_shufflevector(t0, t2, 0, 1, 4, 5);
      r[1] = __builtin_shufflevector(t0, t2, 2, 3, 6, 7);
      r[2] = __builtin_shufflevector(t1, t3, 0, 1, 4, 5);
      r[3] = __builtin_shufflevector(t1, t3, 2, 3, 6, 7);
    } else if constexpr (kBlock == 2) {
      const Vec t0 = __builtin_shufflevector(r[0], r[1], 0, 2), t1 = __builtin_shufflevector(r[0], r[1], 1, 3);
      r[0] = t0;
      r[1] = t1;
    }
    for (int i = 0; i < kBlock; ++i)
      std::memcpy(d + i * d_stride, &r[i], sizeof(Vec));
  }
#else
  static constexpr int kBlock = 1;
  static constexpr bool kVectorized = false;
  static void block(const T*, Eigen::Index, T*, Eigen::Index) {}
#endif

  // tile(k, j) = rows[k][j] for j < n.
  static void gather(T* tile, const T* src, Eigen::Index stride, Eigen::Index rows, Eigen::Index n) {
    Eigen::Index k0 = 0;
    if constexpr (kVectorized) {
      const Eigen::Index full = n - n % kBlock;
      for (; k0 + kBlock <= rows; k0 += kBlock) {
        for (Eigen::Index j = 0; j < full; j += kBlock)
          block(src + k0 * stride + j, stride, tile + j * Rows + k0, Rows);
        for (Eigen::Index k = k0; k < k0 + kBlock; ++k)
          for (Eigen::Index j = full; j < n; ++j)
            tile[j * Rows + k] = src[k * stride + j];
      }
    }
    for (Eigen::Index k = k0; k < Rows; ++k)
      for (Eigen::Index j = 0; j < n; ++j)
        tile[j * Rows + k] = k < rows ? src[k * stride + j] : T(0);
  }

  // rows[k][j] = tile(k, j) for k < rows, j < n.
  static void scatter(T* dst, Eigen::Index stride, const T* tile, Eigen::Index rows, Eigen::Index n) {
    Eigen::Index k0 = 0;
    if constexpr (kVectorized) {
      const Eigen::Index full = n - n % kBlock;
      for (; k0 + kBlock <= rows; k0 += kBlock) {
        for (Eigen::Index j = 0; j < full; j += kBlock)
          block(tile + j * Rows + k0, Rows, dst + k0 * stride + j, stride);
        for (Eigen::Index k = k0; k < k0 + kBlock; ++k)
          for (Eigen::Index j = full; j < n; ++j)
            dst[k * stride + j] = tile[j * Rows + k];
      }
    }
    for (Eigen::Index k = k0; k < rows; ++k)
      for (Eigen::Index j = 0; j < n; ++j)
        dst[k * stride + j] = tile[j * Rows + k];
  }
};

// Rows per GAE block: 8, or 16 for float where Eigen's packets hold 16 (AVX-512), so a block's
// lanes fill whole packets. The block fixes the order in which the whitening moments are merged.
template <class T>
constexpr int gae_block_rows() {
#if defined(EIGEN_VECTORIZE_AVX512)
  return sizeof(T) == 4 ? 16 : 8;
#else
  return 8;
#endif
}

// Masked moments of one (row block, time tile) of the GAE advantages, merged serially afterwards
// in a fixed order, so the whitening statistics do not depend on which thread made them.
struct TileMoments {
  double weight = 0, mean = 0, m2 = 0;
};

// Prefetches `count` elements from `data` (the next time tile of a row, pages away from the other
// rows': hardware prefetchers stop at page boundaries).
template <class T>
void prefetch_tile([[maybe_unused]] const T* data, [[maybe_unused]] Eigen::Index count,
                   [[maybe_unused]] bool for_write) {
#if defined(__GNUC__) || defined(__clang__)
  constexpr Eigen::Index kLine = 64 / static_cast<Eigen::Index>(sizeof(T));
  for (Eigen::Index i = 0; i < count; i += kLine) {
    if (for_write)
      __builtin_prefetch(data + i, 1);
    else
      __builtin_prefetch(data + i, 0);
  }
#endif
}

// The masked moments of one transposed tile (column j: time step j, one lane per row), given the
// weight and weighted sum accumulated per lane by the recurrence: the M2 around the tile's own
// mean is a second pass over the tile while it is in cache; tiles are then merged in double
// (Chan et al.), so no long serial sum builds up in T.
template <class Tile, class Lane>
TileMoments tile_moments(const Tile& values, const Tile& mask, Eigen::Index n, const Lane& weight,
                         const Lane& weighted_sum) {
  using T = typename Tile::Scalar;
  const double total_weight = static_cast<double>(weight.sum());
  if (total_weight == 0) return {};
  const double mean = static_cast<double>(weighted_sum.sum()) / total_weight;
  const T tile_mean = static_cast<T>(mean);
  Lane m2 = Lane::Zero();
  for (Eigen::Index j = 0; j < n; ++j) {
    const Lane d = values.col(j) - tile_mean;
    m2 += d * d * mask.col(j);
  }
  // M2 was taken around the rounded mean; shift it to the exact one.
  const double offset = mean - static_cast<double>(tile_mean);
  return {total_weight, mean, static_cast<double>(m2.sum()) - total_weight * offset * offset};
}

// A time-tile kernel's `Count` transposed tiles [Rows, cols], kept per thread (and per Kernel)
// across calls. A kernel that owned them freed them at the end of every call: with 16 lanes
// (AVX-512) GAE's five tiles are 160 KiB at the heap's top, over glibc's 128 KiB trim
// threshold, so each call gave the pages back and faulted them in again (GAE at B = 512,
// L = 4096 was 20% slower built with -march=native than without).
template <class Kernel, class T, int Rows, int Count>
std::array<Eigen::Array<T, Rows, Eigen::Dynamic>, Count>& tile_scratch(Eigen::Index cols) {
  thread_local std::array<Eigen::Array<T, Rows, Eigen::Dynamic>, Count> tiles;
  for (auto& t : tiles)
    if (t.cols() != cols) t.resize(Rows, cols);
  return tiles;
}

// GAE for up to `Rows` consecutive rows, one time tile at a time. Each row's tile (2 KiB of it)
// is first copied, as one sequential burst, into a transposed buffer [time][row], so the
// recurrence runs across the rows in SIMD lanes (the rows are independent; time is the
// dependency chain) while memory is still read and written row by row, in few streams. Each step
// is kernels::ppo::gae_step on a packet of rows: the bits of gae_row, row by row (identical for
// 0/1 masks to the interpolation verl writes, m new + (1 - m) old). The tile's
// masked moments (for the whitening, summed per lane and merged in double: a host order) and
// a NaN/inf probe are folded in while the tile is in cache.
template <class T, int Rows>
class GaeBlockKernel {
 public:
  // 2 KiB of each row per tile: long enough bursts for the memory system, small enough that the
  // five tiles stay in L2 (measured best among 0.5 to 4 KiB on the reference machine).
  static constexpr Eigen::Index kTile = 2048 / static_cast<Eigen::Index>(sizeof(T));

  GaeBlockKernel(T gamma, T gamma_lambda)
      : gamma_(gamma),
        gamma_lambda_(gamma_lambda),
        tiles_(tile_scratch<GaeBlockKernel, T, Rows, 5>(kTile)),
        reward_(tiles_[0]),
        value_(tiles_[1]),
        mask_(tiles_[2]),
        advantage_(tiles_[3]),
        return_(tiles_[4]) {}

  // Rows [0, rows) of the given row pointers (rows <= Rows); returns false if an output is not finite.
  bool run(const T* rewards, Eigen::Index reward_stride, const T* values, Eigen::Index value_stride, const T* mask,
           Eigen::Index mask_stride, T* advantages, T* returns, Eigen::Index out_stride, Eigen::Index rows,
           Eigen::Index cols, TileMoments* moments) {
    Lane next_value = Lane::Zero(), last_gae = Lane::Zero(), probe = Lane::Zero();
    Lane weight, weighted_sum;
    const Lane one = Lane::Ones();
    for (Eigen::Index end = cols; end > 0; end -= kTile) {
      const Eigen::Index begin = std::max<Eigen::Index>(0, end - kTile), n = end - begin;
      // Padding lanes (k >= rows) are zero; their mask 0 keeps them out of the moments.
      Transpose::gather(reward_.data(), rewards + begin, reward_stride, rows, n);
      Transpose::gather(value_.data(), values + begin, value_stride, rows, n);
      Transpose::gather(mask_.data(), mask + begin, mask_stride, rows, n);
      // The rows are pages apart and hardware prefetchers stop at page boundaries: fetch the next
      // tile (earlier in time) while this one is computed.
      if (begin > 0) {
        const Eigen::Index next = std::max<Eigen::Index>(0, begin - kTile), count = begin - next;
        for (Eigen::Index k = 0; k < rows; ++k) {
          prefetch_tile(rewards + k * reward_stride + next, count, false);
          prefetch_tile(values + k * value_stride + next, count, false);
          prefetch_tile(mask + k * mask_stride + next, count, false);
          prefetch_tile(advantages + k * out_stride + next, count, true);
          prefetch_tile(returns + k * out_stride + next, count, true);
        }
      }
      weight.setZero();
      weighted_sum.setZero();
      for (Eigen::Index j = n - 1; j >= 0; --j) {
        const Lane r = reward_.col(j), v = value_.col(j), m = mask_.col(j);
        kernels::ppo::gae_step<Lane, T>(r, v, m, one, gamma_, gamma_lambda_, next_value, last_gae);
        advantage_.col(j) = last_gae;
        return_.col(j) = last_gae + v;
        probe += last_gae * T(0);  // NaN once an input was NaN or inf
        weight += m;
        weighted_sum += last_gae * m;
      }
      Transpose::scatter(advantages + begin, out_stride, advantage_.data(), rows, n);
      Transpose::scatter(returns + begin, out_stride, return_.data(), rows, n);
      if (!(probe.sum() == T(0))) return false;
      *moments++ = tile_moments(advantage_, mask_, n, weight, weighted_sum);
    }
    return true;
  }

 private:
  using Lane = Eigen::Array<T, Rows, 1>;
  using Tile = Eigen::Array<T, Rows, Eigen::Dynamic>;  // column j: time step j of the tile, one lane per row
  using Transpose = TileTranspose<T, Rows>;

  T gamma_, gamma_lambda_;
  std::array<Tile, 5>& tiles_;  // per thread: one kernel runs at a time on a thread
  Tile &reward_, &value_, &mask_, &advantage_, &return_;
};

// The outcome estimators' reward-to-go, right to left along each row:
//   discounted (reinforce_plus_plus): u = r + gamma R, return u m, R = u m + R (1 - m), so an
//     observation token (m = 0) returns 0 and carries R through;
//   masked_sum (remax): R += r m, return R, advantage R - b m with the row's baseline b.
enum class RewardToGo { discounted, masked_sum };

// The reward-to-go of up to `Rows` consecutive rows in SIMD lanes on time tiles, laid out as
// GaeBlockKernel's (each row's tile copied as one burst into a transposed buffer; time is the
// dependency chain, the rows are independent lanes). Each lane runs the scalar recurrence's
// operations in its order. A NaN/inf probe (a non-finite reward, even a masked one, or an
// overflow reaches the running sum) and, for `discounted`, the tiles' masked moments of the
// returns are folded in while the tile is in cache.
template <class T, int Rows>
class RewardToGoKernel {
 public:
  static constexpr Eigen::Index kTile = 2048 / static_cast<Eigen::Index>(sizeof(T));

  RewardToGoKernel(RewardToGo kind, T gamma)
      : kind_(kind),
        gamma_(gamma),
        tiles_(tile_scratch<RewardToGoKernel, T, Rows, 4>(kTile)),
        reward_(tiles_[0]),
        mask_(tiles_[1]),
        return_(tiles_[2]),
        advantage_(tiles_[3]) {}

  // Rows [0, rows) (rows <= Rows). masked_sum reads `baselines` [rows] and writes `advantages`;
  // discounted writes one TileMoments per time tile (right to left). Stops at the first tile where
  // the running sum is not finite, returning its row (-1: every row finite).
  Eigen::Index run(const T* rewards, Eigen::Index reward_stride, const T* mask, Eigen::Index mask_stride,
                   const T* baselines, T* returns, T* advantages, Eigen::Index out_stride, Eigen::Index rows,
                   Eigen::Index cols, TileMoments* moments) {
    Lane running = Lane::Zero(), probe = Lane::Zero(), baseline = Lane::Zero();
    if (kind_ == RewardToGo::masked_sum)
      for (Eigen::Index k = 0; k < rows; ++k)
        baseline[k] = baselines[k];
    const Lane one = Lane::Ones();
    for (Eigen::Index end = cols; end > 0; end -= kTile) {
      const Eigen::Index begin = std::max<Eigen::Index>(0, end - kTile), n = end - begin;
      // Padding lanes (k >= rows) are zero, and their mask 0 keeps them out of the moments.
      Transpose::gather(reward_.data(), rewards + begin, reward_stride, rows, n);
      Transpose::gather(mask_.data(), mask + begin, mask_stride, rows, n);
      if (begin > 0) {
        const Eigen::Index next = std::max<Eigen::Index>(0, begin - kTile), count = begin - next;
        for (Eigen::Index k = 0; k < rows; ++k) {
          prefetch_tile(rewards + k * reward_stride + next, count, false);
          prefetch_tile(mask + k * mask_stride + next, count, false);
          prefetch_tile(returns + k * out_stride + next, count, true);
          if (advantages != nullptr) prefetch_tile(advantages + k * out_stride + next, count, true);
        }
      }
      Lane weight = Lane::Zero(), weighted_sum = Lane::Zero();  // the moments' (discounted)
      if (kind_ == RewardToGo::discounted) {
        for (Eigen::Index j = n - 1; j >= 0; --j) {
          const Lane m = mask_.col(j);
          const Lane updated = reward_.col(j) + gamma_ * running;
          const Lane ret = updated * m;
          return_.col(j) = ret;
          running = ret + running * (one - m);
          probe += ret * T(0);  // NaN once a return overflowed
          weight += m;
          weighted_sum += ret * m;
        }
        Transpose::scatter(returns + begin, out_stride, return_.data(), rows, n);
      } else {
        for (Eigen::Index j = n - 1; j >= 0; --j) {
          const Lane m = mask_.col(j);
          running += reward_.col(j) * m;
          return_.col(j) = running;
          advantage_.col(j) = running - baseline * m;
        }
        probe = running * T(0);  // a non-finite term stays in the running sum
        Transpose::scatter(returns + begin, out_stride, return_.data(), rows, n);
        Transpose::scatter(advantages + begin, out_stride, advantage_.data(), rows, n);
      }
      if (!(probe.sum() == T(0))) [[unlikely]]
        for (Eigen::Index k = 0; k < rows; ++k)
          if (!(probe[k] == T(0))) return k;
      if (moments != nullptr) *moments++ = tile_moments(return_, mask_, n, weight, weighted_sum);
    }
    return -1;
  }

 private:
  using Lane = Eigen::Array<T, Rows, 1>;
  using Tile = Eigen::Array<T, Rows, Eigen::Dynamic>;
  using Transpose = TileTranspose<T, Rows>;

  RewardToGo kind_;
  T gamma_;
  std::array<Tile, 4>& tiles_;                   // per thread: one kernel runs at a time on a thread
  Tile &reward_, &mask_, &return_, &advantage_;  // advantage_: masked_sum only
};

// out.returns (and, for masked_sum, out.advantages) of every row by RewardToGoKernel, on OpenMP
// tiles of row blocks, each block's mask checked (0/1) where it is read. For discounted, returns
// the returns' masked moments (merged in row-block then time-tile order: the same bits for any
// thread count). A non-finite running sum names the non-finite reward, or else the first row
// that overflowed. The shapes were checked.
template <class T>
kernels::ppo::Moments reward_to_go(std::string_view function, RewardToGo kind, double gamma,
                                   const MatrixRef<T>& rewards, const MatrixRef<T>& mask, const T* baselines,
                                   AdvantageResult<T>& out) {
  constexpr int kRows = gae_block_rows<T>();
  using Kernel = RewardToGoKernel<T, kRows>;
  const Eigen::Index batch = rewards.rows(), length = rewards.cols();
  const Eigen::Index blocks = (batch + kRows - 1) / kRows, time_tiles = (length + Kernel::kTile - 1) / Kernel::kTile;
  const bool discounted = kind == RewardToGo::discounted;
  std::vector<TileMoments> records(discounted ? static_cast<std::size_t>(blocks * time_tiles) : 0);
  std::vector<Eigen::Index> overflowed(static_cast<std::size_t>(blocks), -1);  // per block: a row, or -1
  const auto rs = rewards.outerStride(), ms = mask.outerStride();
  mrr::detail::parallel_tiles(blocks, 4, batch * length * 8, [&](std::int64_t, std::int64_t first, std::int64_t last) {
    Kernel kernel(kind, static_cast<T>(gamma));
    for (Eigen::Index b = first; b < last; ++b) {
      const Eigen::Index i = b * kRows, n = std::min<Eigen::Index>(kRows, batch - i);
      const auto mask_rows = mask.middleRows(i, n);
      if (!is_binary_mask(mask_rows)) [[unlikely]]
        require_mask(function, "response_mask", mask_rows, i);
      const Eigen::Index bad = kernel.run(
          rewards.data() + i * rs, rs, mask.data() + i * ms, ms, baselines != nullptr ? baselines + i : nullptr,
          out.returns.data() + i * length, discounted ? nullptr : out.advantages.data() + i * length, length, n, length,
          discounted ? records.data() + b * time_tiles : nullptr);
      overflowed[static_cast<std::size_t>(b)] = bad < 0 ? -1 : i + bad;
    }
  });
  for (const Eigen::Index row : overflowed)
    if (row >= 0) [[unlikely]] {
      require_finite(function, "token_level_rewards", rewards);
      mrr::detail::throw_invalid_argument(
          function, discounted ? "the discounted return" : "the reward-to-go", " of row ", row, " overflowed",
          discounted ? " (gamma " + std::to_string(gamma) + ")" : std::string(), "; the rewards are finite");
    }
  kernels::ppo::Moments total;
  if (!discounted) return total;
  for (const auto& r : records)
    kernels::ppo::merge(total, {r.weight, r.mean, r.m2});
  return total;
}

}  // namespace detail

// Every estimator has two forms: compute_X(...) returns a new AdvantageResult, and
// compute_X_into(out, ...) writes into `out`, reusing its storage when the shape already matches
// (no allocation and no page faults in a training loop). `out` must not share memory with an input.

// Generalized Advantage Estimation (verl "gae"). Masked (observation/padding) tokens neither
// consume a value nor a TD error: the value and running advantage skip over them. Returns are
// advantages + values before whitening; advantages are then whitened over the mask (every
// element, masked ones included, as verl does).
template <class T>
void compute_gae_advantage_return_into(AdvantageResult<T>& out, MatrixRef<T> token_level_rewards, MatrixRef<T> values,
                                       MatrixRef<T> response_mask, double gamma, double lam) {
  constexpr std::string_view fn = "ppo::compute_gae_advantage_return";
  detail::require_nonempty(fn, "token_level_rewards", token_level_rewards);
  detail::require_same_shape(fn, "token_level_rewards", token_level_rewards, "values", values);
  detail::require_same_shape(fn, "token_level_rewards", token_level_rewards, "response_mask", response_mask);
  detail::require_finite_scalar(fn, "gamma", gamma);
  detail::require_finite_scalar(fn, "lam", lam);

  const Eigen::Index batch = token_level_rewards.rows(), length = token_level_rewards.cols();
  detail::prepare_output(fn, out, batch, length, token_level_rewards, values, response_mask);
  constexpr int kRows = detail::gae_block_rows<T>();
  using Kernel = detail::GaeBlockKernel<T, kRows>;
  const Eigen::Index blocks = (batch + kRows - 1) / kRows, time_tiles = (length + Kernel::kTile - 1) / Kernel::kTile;
  // One record per (row block, time tile), merged below in block order then time-tile order.
  std::vector<detail::TileMoments> records(static_cast<std::size_t>(blocks * time_tiles));
  const auto rs = token_level_rewards.outerStride(), vs = values.outerStride(), ms = response_mask.outerStride();
  // Parallel over groups of 4 row blocks (32 rows); each group has its own kernel scratch.
  mrr::detail::parallel_tiles(blocks, 4, batch * length * 16, [&](std::int64_t, std::int64_t first, std::int64_t last) {
    Kernel kernel(static_cast<T>(gamma), static_cast<T>(gamma * lam));
    for (Eigen::Index b = first; b < last; ++b) {
      const Eigen::Index i = b * kRows, n = std::min<Eigen::Index>(kRows, batch - i);
      const auto mask_rows = response_mask.middleRows(i, n);
      if (!detail::is_binary_mask(mask_rows)) [[unlikely]]
        detail::require_mask(fn, "response_mask", mask_rows, i);
      const bool finite = kernel.run(token_level_rewards.data() + i * rs, rs, values.data() + i * vs, vs,
                                     response_mask.data() + i * ms, ms, out.advantages.data() + i * length,
                                     out.returns.data() + i * length, length, n, length,
                                     records.data() + b * time_tiles);
      // Any NaN/inf input reaches the running advantage; name the offending input on the cold path.
      if (!finite) [[unlikely]] {
        detail::require_finite(fn, "token_level_rewards", token_level_rewards);
        detail::require_finite(fn, "values", values);
        mrr::detail::throw_invalid_argument(fn, "the advantage overflowed for rows from ", i, " (gamma ", gamma,
                                            ", lam ", lam, ")");
      }
    }
  });
  detail::MaskedMomentAccumulator<T> moments;
  for (const auto& r : records)
    moments.add_moments(r.weight, r.mean, r.m2);
  detail::whiten_in_place(out.advantages, moments.whitening_moments(fn));
}

template <class T>
AdvantageResult<T> compute_gae_advantage_return(MatrixRef<T> token_level_rewards, MatrixRef<T> values,
                                                MatrixRef<T> response_mask, double gamma, double lam) {
  AdvantageResult<T> out;
  compute_gae_advantage_return_into<T>(out, token_level_rewards, values, response_mask, gamma, lam);
  return out;
}

namespace detail {

template <class T>
Vector<T> grpo_scalars(std::string_view fn, const MatrixRef<T>& token_level_rewards, const GroupIndex& index,
                       double epsilon, bool norm_adv_by_std_in_grpo) {
  return group_outcome_scalars<T>(response_scores<T>(fn, token_level_rewards), index,
                                  norm_adv_by_std_in_grpo ? kernels::ppo::OutcomeEstimator::grpo
                                                          : kernels::ppo::OutcomeEstimator::grpo_mean_only,
                                  epsilon);
}

}  // namespace detail

// GRPO outcome advantage (verl "grpo"): per-response score = sum of its token rewards, normalised
// within its group by the group mean and (with norm_adv_by_std_in_grpo) the unbiased std + epsilon;
// Dr.GRPO without the std. A singleton group uses mean 0 and std 1.
template <class T>
void compute_grpo_outcome_advantage_into(AdvantageResult<T>& out, MatrixRef<T> token_level_rewards,
                                         MatrixRef<T> response_mask, const GroupIndex& index, double epsilon = 1e-6,
                                         bool norm_adv_by_std_in_grpo = true) {
  constexpr std::string_view fn = "ppo::compute_grpo_outcome_advantage";
  detail::check_group_inputs<T>(fn, token_level_rewards, response_mask, index);
  detail::prepare_output(fn, out, token_level_rewards.rows(), token_level_rewards.cols(), token_level_rewards,
                         response_mask);
  const Vector<T> scalars = detail::grpo_scalars<T>(fn, token_level_rewards, index, epsilon, norm_adv_by_std_in_grpo);
  detail::broadcast_outcome<T>(fn, scalars, response_mask, out);
}

// The single-output form: verl returns the advantages tensor twice (as advantages and returns),
// so a caller that needs one matrix passes it here ([batch, length], caller-owned, not
// overlapping an input): one read of the rewards, one of the mask, one write.
template <class T>
void compute_grpo_outcome_advantage_into(detail::OutputRef<T> advantages, MatrixRef<T> token_level_rewards,
                                         MatrixRef<T> response_mask, const GroupIndex& index, double epsilon = 1e-6,
                                         bool norm_adv_by_std_in_grpo = true) {
  constexpr std::string_view fn = "ppo::compute_grpo_outcome_advantage";
  detail::check_group_inputs<T>(fn, token_level_rewards, response_mask, index);
  detail::require_output(fn, "advantages", advantages, token_level_rewards.rows(), token_level_rewards.cols(),
                         token_level_rewards, response_mask);
  const Vector<T> scalars = detail::grpo_scalars<T>(fn, token_level_rewards, index, epsilon, norm_adv_by_std_in_grpo);
  detail::broadcast_outcome_rows<T>(fn, scalars, response_mask, advantages, nullptr);
}

template <class T>
AdvantageResult<T> compute_grpo_outcome_advantage(MatrixRef<T> token_level_rewards, MatrixRef<T> response_mask,
                                                  const GroupIndex& index, double epsilon = 1e-6,
                                                  bool norm_adv_by_std_in_grpo = true) {
  AdvantageResult<T> out;
  compute_grpo_outcome_advantage_into<T>(out, token_level_rewards, response_mask, index, epsilon,
                                         norm_adv_by_std_in_grpo);
  return out;
}

namespace detail {

template <class T>
Vector<T> grpo_vectorized_scalars(std::string_view fn, const MatrixRef<T>& token_level_rewards, const GroupIndex& index,
                                  double epsilon, bool norm_adv_by_std_in_grpo) {
  const Vector<T> scores = response_scores<T>(fn, token_level_rewards);
  Vector<T> scalars(scores.size());
  const float eps = static_cast<float>(epsilon);
  for (Eigen::Index g = 0; g < index.num_groups(); ++g) {
    const auto members = index.members(g);
    float mean = 0.0f, std = 1.0f;
    if (members.size() > 1) {
      const float count = static_cast<float>(members.size());
      float sum = 0.0f;
      for (const auto i : members)
        sum += static_cast<float>(scores[i]);
      mean = sum / count;
      float centered = 0.0f;
      for (const auto i : members) {
        const float d = static_cast<float>(scores[i]) - mean;
        centered += d * d;
      }
      std = std::sqrt(std::max(centered / (count - 1.0f), 0.0f));
    }
    const float divisor = std + eps;
    for (const auto i : members) {
      const T centered_score = scores[i] - static_cast<T>(mean);
      scalars[i] = norm_adv_by_std_in_grpo ? centered_score / static_cast<T>(divisor) : centered_score;
    }
  }
  return scalars;
}

}  // namespace detail

// verl "grpo_vectorized": GRPO with group statistics computed in float32 (verl's group_mean_std
// casts the scores to float32), including the float32 std + epsilon; a singleton group uses
// mean 0 and std 1. Results therefore differ from "grpo" at float32 precision.
template <class T>
void compute_grpo_vectorized_outcome_advantage_into(AdvantageResult<T>& out, MatrixRef<T> token_level_rewards,
                                                    MatrixRef<T> response_mask, const GroupIndex& index,
                                                    double epsilon = 1e-6, bool norm_adv_by_std_in_grpo = true) {
  constexpr std::string_view fn = "ppo::compute_grpo_vectorized_outcome_advantage";
  detail::check_group_inputs<T>(fn, token_level_rewards, response_mask, index);
  detail::prepare_output(fn, out, token_level_rewards.rows(), token_level_rewards.cols(), token_level_rewards,
                         response_mask);
  const Vector<T> scalars =
      detail::grpo_vectorized_scalars<T>(fn, token_level_rewards, index, epsilon, norm_adv_by_std_in_grpo);
  detail::broadcast_outcome<T>(fn, scalars, response_mask, out);
}

// Single-output form (the advantages; verl returns them twice), as for "grpo".
template <class T>
void compute_grpo_vectorized_outcome_advantage_into(detail::OutputRef<T> advantages, MatrixRef<T> token_level_rewards,
                                                    MatrixRef<T> response_mask, const GroupIndex& index,
                                                    double epsilon = 1e-6, bool norm_adv_by_std_in_grpo = true) {
  constexpr std::string_view fn = "ppo::compute_grpo_vectorized_outcome_advantage";
  detail::check_group_inputs<T>(fn, token_level_rewards, response_mask, index);
  detail::require_output(fn, "advantages", advantages, token_level_rewards.rows(), token_level_rewards.cols(),
                         token_level_rewards, response_mask);
  const Vector<T> scalars =
      detail::grpo_vectorized_scalars<T>(fn, token_level_rewards, index, epsilon, norm_adv_by_std_in_grpo);
  detail::broadcast_outcome_rows<T>(fn, scalars, response_mask, advantages, nullptr);
}

template <class T>
AdvantageResult<T> compute_grpo_vectorized_outcome_advantage(MatrixRef<T> token_level_rewards,
                                                             MatrixRef<T> response_mask, const GroupIndex& index,
                                                             double epsilon = 1e-6,
                                                             bool norm_adv_by_std_in_grpo = true) {
  AdvantageResult<T> out;
  compute_grpo_vectorized_outcome_advantage_into<T>(out, token_level_rewards, response_mask, index, epsilon,
                                                    norm_adv_by_std_in_grpo);
  return out;
}

// verl "grpo_passk" (Pass@k, arXiv 2503.19595): only the best response of each group gets a
// non-zero advantage, max - second max (over the group std + epsilon when normalising). Every
// group needs at least two responses.
template <class T>
void compute_grpo_passk_outcome_advantage_into(AdvantageResult<T>& out, MatrixRef<T> token_level_rewards,
                                               MatrixRef<T> response_mask, const GroupIndex& index,
                                               double epsilon = 1e-6, bool norm_adv_by_std_in_grpo = true) {
  constexpr std::string_view fn = "ppo::compute_grpo_passk_outcome_advantage";
  detail::check_group_inputs<T>(fn, token_level_rewards, response_mask, index);
  for (Eigen::Index g = 0; g < index.num_groups(); ++g)
    mrr::detail::require(index.group_size(g) >= 2, fn, "group '", index.label(g), "' in 'index' has ",
                         index.group_size(g), " response; Pass@k needs at least 2 per group");
  detail::prepare_output(fn, out, token_level_rewards.rows(), token_level_rewards.cols(), token_level_rewards,
                         response_mask);
  const Vector<T> scores = detail::response_scores<T>(fn, token_level_rewards);
  Vector<T> scalars = Vector<T>::Zero(scores.size());
  for (Eigen::Index g = 0; g < index.num_groups(); ++g) {
    const auto members = index.members(g);
    Eigen::Index best = members[0];
    for (const auto i : members)
      if (scores[i] > scores[best]) best = i;
    T second = -std::numeric_limits<T>::infinity();
    for (const auto i : members)
      if (i != best) second = std::max(second, scores[i]);
    T advantage = scores[best] - second;
    if (norm_adv_by_std_in_grpo) {
      const T mean = detail::group_mean(scores, members);
      advantage = advantage / (detail::group_std(scores, members, mean) + static_cast<T>(epsilon));
    }
    scalars[best] = advantage;
  }
  detail::broadcast_outcome<T>(fn, scalars, response_mask, out);
}

template <class T>
AdvantageResult<T> compute_grpo_passk_outcome_advantage(MatrixRef<T> token_level_rewards, MatrixRef<T> response_mask,
                                                        const GroupIndex& index, double epsilon = 1e-6,
                                                        bool norm_adv_by_std_in_grpo = true) {
  AdvantageResult<T> out;
  compute_grpo_passk_outcome_advantage_into<T>(out, token_level_rewards, response_mask, index, epsilon,
                                               norm_adv_by_std_in_grpo);
  return out;
}

namespace detail {

// The whole pass of an estimator that broadcasts kernels::ppo::group_outcome's per-response
// scalar: checks, scores, scalars, then both outputs or one caller-owned matrix.
template <class T>
void group_outcome_into(std::string_view fn, kernels::ppo::OutcomeEstimator estimator, AdvantageResult<T>& out,
                        const MatrixRef<T>& rewards, const MatrixRef<T>& mask, const GroupIndex& index) {
  check_group_inputs<T>(fn, rewards, mask, index);
  prepare_output(fn, out, rewards.rows(), rewards.cols(), rewards, mask);
  broadcast_outcome<T>(fn, group_outcome_scalars<T>(response_scores<T>(fn, rewards), index, estimator), mask, out);
}

template <class T>
void group_outcome_into(std::string_view fn, kernels::ppo::OutcomeEstimator estimator, OutputRef<T> advantages,
                        const MatrixRef<T>& rewards, const MatrixRef<T>& mask, const GroupIndex& index) {
  check_group_inputs<T>(fn, rewards, mask, index);
  require_output(fn, "advantages", advantages, rewards.rows(), rewards.cols(), rewards, mask);
  const Vector<T> scalars = group_outcome_scalars<T>(response_scores<T>(fn, rewards), index, estimator);
  broadcast_outcome_rows<T>(fn, scalars, mask, advantages, nullptr);
}

}  // namespace detail

// verl "rloo" (arXiv 2402.14740): score * n/(n-1) - mean * n/(n-1), the leave-one-out baseline.
// A singleton group keeps its raw score (unlike rloo_vectorized).
template <class T>
void compute_rloo_outcome_advantage_into(AdvantageResult<T>& out, MatrixRef<T> token_level_rewards,
                                         MatrixRef<T> response_mask, const GroupIndex& index) {
  detail::group_outcome_into<T>("ppo::compute_rloo_outcome_advantage", kernels::ppo::OutcomeEstimator::rloo, out,
                                token_level_rewards, response_mask, index);
}

// The single-output form (verl returns one tensor twice), as compute_grpo_outcome_advantage_into's.
template <class T>
void compute_rloo_outcome_advantage_into(detail::OutputRef<T> advantages, MatrixRef<T> token_level_rewards,
                                         MatrixRef<T> response_mask, const GroupIndex& index) {
  detail::group_outcome_into<T>("ppo::compute_rloo_outcome_advantage", kernels::ppo::OutcomeEstimator::rloo, advantages,
                                token_level_rewards, response_mask, index);
}

template <class T>
AdvantageResult<T> compute_rloo_outcome_advantage(MatrixRef<T> token_level_rewards, MatrixRef<T> response_mask,
                                                  const GroupIndex& index) {
  AdvantageResult<T> out;
  compute_rloo_outcome_advantage_into<T>(out, token_level_rewards, response_mask, index);
  return out;
}

// verl "rloo_vectorized": (n * score - group sum) / (n - 1); a singleton group gets 0.
template <class T>
void compute_rloo_vectorized_outcome_advantage_into(AdvantageResult<T>& out, MatrixRef<T> token_level_rewards,
                                                    MatrixRef<T> response_mask, const GroupIndex& index) {
  detail::group_outcome_into<T>("ppo::compute_rloo_vectorized_outcome_advantage",
                                kernels::ppo::OutcomeEstimator::rloo_vectorized, out, token_level_rewards,
                                response_mask, index);
}

// The single-output form (verl returns one tensor twice), as compute_grpo_outcome_advantage_into's.
template <class T>
void compute_rloo_vectorized_outcome_advantage_into(detail::OutputRef<T> advantages, MatrixRef<T> token_level_rewards,
                                                    MatrixRef<T> response_mask, const GroupIndex& index) {
  detail::group_outcome_into<T>("ppo::compute_rloo_vectorized_outcome_advantage",
                                kernels::ppo::OutcomeEstimator::rloo_vectorized, advantages, token_level_rewards,
                                response_mask, index);
}

template <class T>
AdvantageResult<T> compute_rloo_vectorized_outcome_advantage(MatrixRef<T> token_level_rewards,
                                                             MatrixRef<T> response_mask, const GroupIndex& index) {
  AdvantageResult<T> out;
  compute_rloo_vectorized_outcome_advantage_into<T>(out, token_level_rewards, response_mask, index);
  return out;
}

// verl "opo" (arXiv 2505.23585): the baseline is the length-weighted mean score of the group
// (length = number of response tokens); a singleton group has baseline 0. A group whose
// responses have no token at all gets baseline 0 (verl divides 0 by 0; every advantage of such a
// group is multiplied by a zero mask anyway).
template <class T>
void compute_opo_outcome_advantage_into(AdvantageResult<T>& out, MatrixRef<T> token_level_rewards,
                                        MatrixRef<T> response_mask, const GroupIndex& index) {
  constexpr std::string_view fn = "ppo::compute_opo_outcome_advantage";
  detail::check_group_inputs<T>(fn, token_level_rewards, response_mask, index);
  detail::prepare_output(fn, out, token_level_rewards.rows(), token_level_rewards.cols(), token_level_rewards,
                         response_mask);
  Vector<T> scores = detail::response_scores<T>(fn, token_level_rewards);
  const Vector<T> lengths = response_mask.rowwise().sum();
  for (Eigen::Index g = 0; g < index.num_groups(); ++g) {
    const auto members = index.members(g);
    if (members.size() < 2) continue;
    T weighted = 0, total_length = 0;
    for (const auto i : members) {
      weighted += lengths[i] * scores[i];
      total_length += lengths[i];
    }
    const T baseline = total_length != T(0) ? weighted / total_length : T(0);
    for (const auto i : members)
      scores[i] = scores[i] - baseline;
  }
  detail::broadcast_outcome<T>(fn, scores, response_mask, out);
}

template <class T>
AdvantageResult<T> compute_opo_outcome_advantage(MatrixRef<T> token_level_rewards, MatrixRef<T> response_mask,
                                                 const GroupIndex& index) {
  AdvantageResult<T> out;
  compute_opo_outcome_advantage_into<T>(out, token_level_rewards, response_mask, index);
  return out;
}

// verl "reinforce_plus_plus" (arXiv 2501.03262): discounted return-to-go per token; masked
// (observation) tokens get return 0 and pass the running return through. Advantages are the
// returns whitened over the mask, then masked.
template <class T>
void compute_reinforce_plus_plus_outcome_advantage_into(AdvantageResult<T>& out, MatrixRef<T> token_level_rewards,
                                                        MatrixRef<T> response_mask, double gamma) {
  constexpr std::string_view fn = "ppo::compute_reinforce_plus_plus_outcome_advantage";
  detail::check_token_shapes<T>(fn, token_level_rewards, response_mask);  // values: in reward_to_go
  detail::require_finite_scalar(fn, "gamma", gamma);
  const Eigen::Index batch = token_level_rewards.rows(), length = token_level_rewards.cols();
  detail::prepare_output(fn, out, batch, length, token_level_rewards, response_mask);
  const auto moments = detail::reward_to_go<T>(fn, detail::RewardToGo::discounted, gamma, token_level_rewards,
                                               response_mask, nullptr, out);
  detail::MaskedMomentAccumulator<T> acc;
  acc.add_moments(moments.weight, moments.mean, moments.m2);
  detail::whiten_masked_into(out.advantages, out.returns, response_mask, acc.whitening_moments(fn));
}

template <class T>
AdvantageResult<T> compute_reinforce_plus_plus_outcome_advantage(MatrixRef<T> token_level_rewards,
                                                                 MatrixRef<T> response_mask, double gamma) {
  AdvantageResult<T> out;
  compute_reinforce_plus_plus_outcome_advantage_into<T>(out, token_level_rewards, response_mask, gamma);
  return out;
}

// verl "reinforce_plus_plus_baseline": score minus the group mean (0 for a singleton group),
// broadcast over the mask, whitened over the mask, then masked.
template <class T>
void compute_reinforce_plus_plus_baseline_outcome_advantage_into(AdvantageResult<T>& out,
                                                                 MatrixRef<T> token_level_rewards,
                                                                 MatrixRef<T> response_mask, const GroupIndex& index) {
  constexpr std::string_view fn = "ppo::compute_reinforce_plus_plus_baseline_outcome_advantage";
  detail::check_group_inputs<T>(fn, token_level_rewards, response_mask, index);  // the mask: in the broadcast
  detail::prepare_output(fn, out, token_level_rewards.rows(), token_level_rewards.cols(), token_level_rewards,
                         response_mask);
  Vector<T> scores = detail::response_scores<T>(fn, token_level_rewards);
  for (Eigen::Index g = 0; g < index.num_groups(); ++g) {
    const auto members = index.members(g);
    if (members.size() < 2) continue;
    const T mean = detail::group_mean(scores, members);
    for (const auto i : members)
      scores[i] = scores[i] - mean;
  }
  const auto moments = detail::broadcast_rows_into<T>(fn, out.advantages, response_mask, scores);
  detail::whiten_masked_into(out.advantages, out.advantages, response_mask, moments, &out.returns);
}

template <class T>
AdvantageResult<T> compute_reinforce_plus_plus_baseline_outcome_advantage(MatrixRef<T> token_level_rewards,
                                                                          MatrixRef<T> response_mask,
                                                                          const GroupIndex& index) {
  AdvantageResult<T> out;
  compute_reinforce_plus_plus_baseline_outcome_advantage_into<T>(out, token_level_rewards, response_mask, index);
  return out;
}

// verl "remax" (arXiv 2310.10505): returns are the masked reward-to-go; advantages subtract the
// greedy-rollout baseline of each response on its masked tokens.
template <class T>
void compute_remax_outcome_advantage_into(AdvantageResult<T>& out, MatrixRef<T> token_level_rewards,
                                          VectorRef<T> reward_baselines, MatrixRef<T> response_mask) {
  constexpr std::string_view fn = "ppo::compute_remax_outcome_advantage";
  detail::check_token_shapes<T>(fn, token_level_rewards, response_mask);  // values: in reward_to_go
  detail::require_rows(fn, "reward_baselines", reward_baselines.size(), "token_level_rewards", token_level_rewards);
  detail::require_finite(fn, "reward_baselines", reward_baselines);
  const Eigen::Index batch = token_level_rewards.rows(), length = token_level_rewards.cols();
  detail::prepare_output(fn, out, batch, length, token_level_rewards, response_mask);
  detail::reward_to_go<T>(fn, detail::RewardToGo::masked_sum, 0.0, token_level_rewards, response_mask,
                          reward_baselines.data(), out);
}

template <class T>
AdvantageResult<T> compute_remax_outcome_advantage(MatrixRef<T> token_level_rewards, VectorRef<T> reward_baselines,
                                                   MatrixRef<T> response_mask) {
  AdvantageResult<T> out;
  compute_remax_outcome_advantage_into<T>(out, token_level_rewards, reward_baselines, response_mask);
  return out;
}

// verl "gpg" (GPG): alpha * (score - group mean) / f_norm with alpha = batch / max(1, number of
// non-zero scores); a singleton group has mean 0. verl writes `bsz / m.clamp(min=1)` with bsz a
// Python int and m an int64 tensor: Tensor.__rtruediv__ is `m.reciprocal() * bsz`, so alpha is
// float32(float32(1 / m) * bsz), which can be one ulp from the correctly rounded bsz / m (B = 7,
// m = 6). Computed the same way here (docs/ppo.md, "gpg arithmetic").
template <class T>
void compute_gpg_outcome_advantage_into(AdvantageResult<T>& out, MatrixRef<T> token_level_rewards,
                                        MatrixRef<T> response_mask, const GroupIndex& index, double f_norm = 1.0) {
  constexpr std::string_view fn = "ppo::compute_gpg_outcome_advantage";
  detail::check_group_inputs<T>(fn, token_level_rewards, response_mask, index);
  mrr::detail::require(f_norm != 0 && std::isfinite(f_norm), fn, "'f_norm' must be finite and non-zero, got ", f_norm);
  detail::prepare_output(fn, out, token_level_rewards.rows(), token_level_rewards.cols(), token_level_rewards,
                         response_mask);
  const Vector<T> scores = detail::response_scores<T>(fn, token_level_rewards);
  const Eigen::Index nonzero = (scores.array() != T(0)).count();
  const float inv_m = 1.0f / static_cast<float>(std::max<Eigen::Index>(nonzero, 1));  // torch.reciprocal, float32
  const float alpha_f = inv_m * static_cast<float>(scores.size());                   // * bsz, float32
  const T alpha = static_cast<T>(alpha_f);
  Vector<T> scalars(scores.size());
  for (Eigen::Index g = 0; g < index.num_groups(); ++g) {
    const auto members = index.members(g);
    const T mean = members.size() > 1 ? detail::group_mean(scores, members) : T(0);
    for (const auto i : members)
      scalars[i] = alpha * (scores[i] - mean) / static_cast<T>(f_norm);
  }
  detail::broadcast_outcome<T>(fn, scalars, response_mask, out);
}

template <class T>
AdvantageResult<T> compute_gpg_outcome_advantage(MatrixRef<T> token_level_rewards, MatrixRef<T> response_mask,
                                                 const GroupIndex& index, double f_norm = 1.0) {
  AdvantageResult<T> out;
  compute_gpg_outcome_advantage_into<T>(out, token_level_rewards, response_mask, index, f_norm);
  return out;
}

namespace detail {

// Where a response's tokens meet its group's: "optimal_token_baseline" compares tokens at the same
// position; "tir_optimal_token_baseline" (multi-turn) compares a response's j-th valid token with
// the others' j-th valid tokens, whatever observation spans lie between.
enum class TokenAlignment { position, valid_token };

// The unique longest member of a group, when it is longer than every other, and the second
// longest length: its baseline is 0 from there on (handle_zero_tail), where no other member has
// a token to share it. -1 when the longest length is shared or the group has one member.
inline Eigen::Index zero_tail_member(std::span<const Eigen::Index> members, const std::vector<Eigen::Index>& lengths,
                                     Eigen::Index& second_longest) {
  if (members.size() < 2) return -1;
  Eigen::Index longest = -1;
  Eigen::Index first = -1, second = -1;  // the two largest lengths, counted with repeats
  for (const auto i : members) {
    const Eigen::Index n = lengths[static_cast<std::size_t>(i)];
    if (n > first) {
      second = first;
      first = n;
      longest = i;
    } else if (n > second) {
      second = n;
    }
  }
  second_longest = second;
  return first > second ? longest : -1;
}

template <class T>
void optimal_token_baseline_into(std::string_view fn, AdvantageResult<T>& out, const MatrixRef<T>& rewards,
                                 const MatrixRef<T>& mask, const GroupIndex& index, const MatrixRef<T>& old_log_probs,
                                 const MatrixRef<T>& sum_pi_squared, const OptionalMatrixView<T>& rollout_is_weights,
                                 bool handle_zero_tail, double epsilon, TokenAlignment alignment) {
  check_group_inputs<T>(fn, rewards, mask, index);
  require_finite(fn, "token_level_rewards", rewards);
  if (!is_binary_mask(mask)) [[unlikely]]
    require_mask(fn, "response_mask", mask);
  require_same_shape(fn, "old_log_probs", old_log_probs, "token_level_rewards", rewards);
  require_same_shape(fn, "sum_pi_squared", sum_pi_squared, "token_level_rewards", rewards);
  require_finite_where(fn, "old_log_probs", old_log_probs, mask);
  require_finite_where(fn, "sum_pi_squared", sum_pi_squared, mask);
  const auto is_weights = rollout_is_weights.map();
  if (rollout_is_weights) {
    require_same_shape(fn, "rollout_is_weights", is_weights, "token_level_rewards", rewards);
    require_finite_where(fn, "rollout_is_weights", is_weights, mask);
  }
  mrr::detail::require(std::isfinite(epsilon) && epsilon > 0, fn,
                       "'epsilon' must be finite and positive (it keeps a position whose path variance is 0 in "
                       "every member from dividing 0 by 0), got ",
                       epsilon);
  const Eigen::Index batch = rewards.rows(), length = rewards.cols();
  prepare_output(fn, out, batch, length, rewards, mask, old_log_probs, sum_pi_squared, is_weights);

  // Group by group (every response belongs to one), so that the only scratch is one group's rows:
  // a batch-sized scratch would cost more in page faults than the whole computation.
  //  1. Each member's reward-to-go G (into out.returns, unmasked as verl returns it) and cumulative
  //     path variance W. w_t = ((1 - 2 exp(old_log_prob)) + sum_pi_squared) * is_weight^2 in verl's
  //     order, in Eigen packets (its exp is within an ulp of std::exp), 0 on masked tokens (whose
  //     inputs may hold anything). Both sums run in double for float, as torch's CPU cumsum does,
  //     side by side in one loop: two independent dependency chains.
  //  2. Aligned rows: by position, G, W and the mask as they are; by valid token, each response's
  //     valid tokens packed to the left (G, W and a mask of 1 there, 0 beyond), so one loop serves
  //     both. Zeros beyond a response add nothing to the sums.
  //  3. B_j = sum_i G_ij W_ij m_ij / (sum_i W_ij m_ij + epsilon), members in sample order; a
  //     singleton group has B = 0, and the unique longest member's B is 0 from the second longest
  //     length on (handle_zero_tail). Advantages (G - B) m, by valid token scattered back to the
  //     positions (0 elsewhere, and for a response left out of its group).
  using Acc = std::common_type_t<T, double>;
  using RowArray = Eigen::Array<T, 1, Eigen::Dynamic>;
  using RowView = Eigen::Map<const RowArray>;
  constexpr std::size_t kBlock = 4;
  const bool packed = alignment == TokenAlignment::valid_token;
  std::vector<Eigen::Index> lengths(static_cast<std::size_t>(batch));
  for (Eigen::Index i = 0; i < batch; ++i)
    lengths[static_cast<std::size_t>(i)] = static_cast<Eigen::Index>(mask.row(i).sum());  // a 0/1 mask
  if (packed) out.advantages.setZero();
  Eigen::Index largest = 0;
  for (Eigen::Index g = 0; g < index.num_groups(); ++g)
    largest = std::max(largest, index.group_size(g));
  RowMatrix<T> group_w(largest, length), group_g, group_m;  // W by position; aligned G, W, mask when packed
  if (packed) {
    group_g.resize(largest, length);
    group_m.resize(largest, length);
  }
  RowArray numerator(length), denominator(length), baseline(length), advantage(length);
  const RowArray zeros = RowArray::Zero(length);
  RowArray scratch = RowArray::Zero(length);  // stays 0: the idle lanes add zeros
  std::vector<Eigen::Index> members, member_rows;  // kept members: index in the group, row
  for (Eigen::Index g = 0; g < index.num_groups(); ++g) {
    const auto all = index.members(g);
    // w into the W rows, then both running sums of up to kBlock members side by side (2 kBlock
    // independent chains: the sums are latency-bound one row at a time).
    for (std::size_t k0 = 0; k0 < all.size(); k0 += kBlock) {
      const std::size_t nb = std::min(kBlock, all.size() - k0);
      // Lanes past the group's end run on a zero row into scratch: every block is kBlock wide.
      const T* r[kBlock] = {zeros.data(), zeros.data(), zeros.data(), zeros.data()};
      const T* mr[kBlock] = {zeros.data(), zeros.data(), zeros.data(), zeros.data()};
      T* to_go_row[kBlock] = {scratch.data(), scratch.data(), scratch.data(), scratch.data()};
      T* so_far_row[kBlock] = {scratch.data(), scratch.data(), scratch.data(), scratch.data()};
      Acc to_go[kBlock] = {}, so_far[kBlock] = {};
      for (std::size_t b = 0; b < nb; ++b) {
        const Eigen::Index i = all[k0 + b];
        auto w = group_w.row(static_cast<Eigen::Index>(k0 + b)).array();
        const auto m = mask.row(i).array();
        if (rollout_is_weights)
          w = ((T(1) - T(2) * old_log_probs.row(i).array().exp()) + sum_pi_squared.row(i).array()) *
              is_weights.row(i).array().square();
        else
          w = (T(1) - T(2) * old_log_probs.row(i).array().exp()) + sum_pi_squared.row(i).array();
        w = (m != T(0)).select(w * m, T(0));
        r[b] = mrr::detail::row_ptr(rewards, i);
        mr[b] = mrr::detail::row_ptr(mask, i);
        to_go_row[b] = out.returns.row(i).data();
        so_far_row[b] = w.data();
      }
      for (Eigen::Index t = 0; t < length; ++t) {
        const Eigen::Index back = length - 1 - t;
        for (std::size_t b = 0; b < kBlock; ++b) {
          to_go[b] += static_cast<Acc>(r[b][back] * mr[b][back]);
          to_go_row[b][back] = static_cast<T>(to_go[b]);
          so_far[b] += static_cast<Acc>(so_far_row[b][t]);
          so_far_row[b][t] = static_cast<T>(so_far[b]);
        }
      }
      for (std::size_t b = 0; b < nb; ++b) {
        const Eigen::Index i = all[k0 + b];
        // x * 0 sums to 0 only over finite values (one vectorised pass; allFinite tests one by one).
        mrr::detail::require((out.returns.row(i).array() * T(0)).sum() == T(0), fn, "the reward-to-go of row ", i,
                             " of 'token_level_rewards' overflowed");
        mrr::detail::require((group_w.row(static_cast<Eigen::Index>(k0 + b)).array() * T(0)).sum() == T(0), fn,
                             "the cumulative path variance of row ", i,
                             " overflowed (an 'old_log_probs' far above 0, or huge 'sum_pi_squared' or "
                             "'rollout_is_weights' values)");
      }
    }
    // verl's multi-turn estimator leaves responses without a token out of their group; the
    // aligned rows of the members kept, by their index k in the group.
    members.clear();
    member_rows.clear();
    for (std::size_t k = 0; k < all.size(); ++k)
      if (!packed || lengths[static_cast<std::size_t>(all[k])] > 0) {
        members.push_back(static_cast<Eigen::Index>(k));
        member_rows.push_back(all[k]);
      }
    if (packed)
      for (const auto k : members) {
        const Eigen::Index i = all[static_cast<std::size_t>(k)];
        Eigen::Index j = 0;
        for (Eigen::Index t = 0; t < length; ++t)
          if (mask(i, t) != T(0)) {
            group_g(k, j) = out.returns(i, t);
            group_w(k, j) = group_w(k, t);  // j <= t: packing in place, left to right
            ++j;
          }
        group_g.row(k).tail(length - j).setZero();
        group_w.row(k).tail(length - j).setZero();
        group_m.row(k).head(j).setOnes();
        group_m.row(k).tail(length - j).setZero();
      }
    const auto G = [&](Eigen::Index k) {
      return RowView(packed ? group_g.row(k).data() : out.returns.row(all[static_cast<std::size_t>(k)]).data(), length);
    };
    const auto M = [&](Eigen::Index k) {
      return RowView(packed ? group_m.row(k).data() : mrr::detail::row_ptr(mask, all[static_cast<std::size_t>(k)]),
                     length);
    };
    if (members.size() > 1) {
      numerator.setZero();
      denominator.setZero();
      for (const auto k : members) {
        numerator += G(k) * group_w.row(k).array() * M(k);
        denominator += group_w.row(k).array() * M(k);
      }
      baseline = numerator / (denominator + static_cast<T>(epsilon));
    } else {
      baseline.setZero();
    }
    Eigen::Index second_longest = 0;
    const Eigen::Index zero_tail =
        handle_zero_tail ? zero_tail_member(member_rows, lengths, second_longest) : Eigen::Index{-1};
    for (const auto k : members) {
      const Eigen::Index i = all[static_cast<std::size_t>(k)];
      const RowView gk = G(k), mk = M(k);
      advantage = (gk - baseline) * mk;
      if (i == zero_tail)
        advantage.tail(length - second_longest) = gk.tail(length - second_longest) * mk.tail(length - second_longest);
      if (!packed) {
        out.advantages.row(i) = advantage.matrix();
        continue;
      }
      Eigen::Index j = 0;
      for (Eigen::Index t = 0; t < length; ++t)
        if (mask(i, t) != T(0)) out.advantages(i, t) = advantage[j++] * mask(i, t);
    }
  }
}

}  // namespace detail

// verl "optimal_token_baseline" (OTB): a baseline for every position, shared by a group's
// responses, B_t = sum_i G_it W_it / (sum_i W_it + epsilon) over the group's responses with a token
// at t, where G is the reward-to-go and W_t the path variance so far, sum_{s <= t} w_s with
// w_s = (1 - 2 exp(old_log_prob_s) + sum_pi_squared_s) * rollout_is_weight_s^2 (no IS factor
// without weights). Advantage = (G - B) m; a singleton group has B = 0. handle_zero_tail: the
// unique longest response of a group gets B = 0 from the second longest length on. Returns are
// the unmasked reward-to-go, as verl returns them. sum_pi_squared is sum_v pi_v^2 over the
// vocabulary (rollout::sum_pi_squared_from_logits). Inputs other than the rewards are used only on
// valid tokens: padding may hold anything.
template <class T>
void compute_optimal_token_baseline_advantage_into(AdvantageResult<T>& out, MatrixRef<T> token_level_rewards,
                                                   MatrixRef<T> response_mask, const GroupIndex& index,
                                                   MatrixRef<T> old_log_probs, MatrixRef<T> sum_pi_squared,
                                                   OptionalMatrixView<T> rollout_is_weights = {},
                                                   bool handle_zero_tail = true, double epsilon = 1e-8) {
  detail::optimal_token_baseline_into<T>("ppo::compute_optimal_token_baseline_advantage", out, token_level_rewards,
                                         response_mask, index, old_log_probs, sum_pi_squared, rollout_is_weights,
                                         handle_zero_tail, epsilon, detail::TokenAlignment::position);
}

template <class T>
AdvantageResult<T> compute_optimal_token_baseline_advantage(MatrixRef<T> token_level_rewards,
                                                            MatrixRef<T> response_mask, const GroupIndex& index,
                                                            MatrixRef<T> old_log_probs, MatrixRef<T> sum_pi_squared,
                                                            OptionalMatrixView<T> rollout_is_weights = {},
                                                            bool handle_zero_tail = true, double epsilon = 1e-8) {
  AdvantageResult<T> out;
  compute_optimal_token_baseline_advantage_into<T>(out, token_level_rewards, response_mask, index, old_log_probs,
                                                   sum_pi_squared, rollout_is_weights, handle_zero_tail, epsilon);
  return out;
}

// verl "tir_optimal_token_baseline" (compute_multi_turn_optimal_token_baseline_advantage): the
// optimal token baseline for multi-turn responses, whose masks hold observation spans. Responses
// are aligned by valid token (the j-th valid token of each), not by position; G and W are those of
// optimal_token_baseline at the valid tokens. Responses without a valid token leave their group
// and get advantage 0.
template <class T>
void compute_multi_turn_optimal_token_baseline_advantage_into(AdvantageResult<T>& out, MatrixRef<T> token_level_rewards,
                                                              MatrixRef<T> response_mask, const GroupIndex& index,
                                                              MatrixRef<T> old_log_probs, MatrixRef<T> sum_pi_squared,
                                                              OptionalMatrixView<T> rollout_is_weights = {},
                                                              bool handle_zero_tail = true, double epsilon = 1e-8) {
  detail::optimal_token_baseline_into<T>("ppo::compute_multi_turn_optimal_token_baseline_advantage", out,
                                         token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared,
                                         rollout_is_weights, handle_zero_tail, epsilon,
                                         detail::TokenAlignment::valid_token);
}

template <class T>
AdvantageResult<T> compute_multi_turn_optimal_token_baseline_advantage(
    MatrixRef<T> token_level_rewards, MatrixRef<T> response_mask, const GroupIndex& index, MatrixRef<T> old_log_probs,
    MatrixRef<T> sum_pi_squared, OptionalMatrixView<T> rollout_is_weights = {}, bool handle_zero_tail = true,
    double epsilon = 1e-8) {
  AdvantageResult<T> out;
  compute_multi_turn_optimal_token_baseline_advantage_into<T>(out, token_level_rewards, response_mask, index,
                                                              old_log_probs, sum_pi_squared, rollout_is_weights,
                                                              handle_zero_tail, epsilon);
  return out;
}

// verl "gdpo" (GDPO, arXiv 2601.05242): each reward component is normalised within its group on
// its own (GRPO: (s - mean) / (std + epsilon), or s - mean without the std), the normalised
// components are summed with their weights (in component order), and the sum is whitened over the
// mask and masked. reward_components is [components, batch], one score per response and
// component (verl's gdpo_reward_keys); without components (0 rows) the one component is each
// response's sum of token_level_rewards. reward_weights: one per component, or none for weight 1.
// Computed in T; verl casts component scores to float32 and normalises them in float32
// (docs/ppo.md, deliberate difference 12).
template <class T>
void compute_gdpo_outcome_advantage_into(AdvantageResult<T>& out, MatrixRef<T> token_level_rewards,
                                         MatrixRef<T> response_mask, const GroupIndex& index,
                                         OptionalMatrixView<T> reward_components = {},
                                         std::span<const double> reward_weights = {}, double epsilon = 1e-6,
                                         bool norm_adv_by_std_in_grpo = true) {
  constexpr std::string_view fn = "ppo::compute_gdpo_outcome_advantage";
  detail::check_group_inputs<T>(fn, token_level_rewards, response_mask, index);  // the mask: in the broadcast
  const auto components = reward_components.map();
  const bool given = reward_components.has_value() && components.rows() > 0;
  if (given) {
    mrr::detail::require(components.cols() == token_level_rewards.rows(), fn, "'reward_components' has ",
                         components.cols(), " columns (responses) but 'token_level_rewards' has ",
                         token_level_rewards.rows(), " rows");
    detail::require_finite(fn, "reward_components", components);
  }
  const Eigen::Index count = given ? components.rows() : 1;
  mrr::detail::require(reward_weights.empty() || static_cast<Eigen::Index>(reward_weights.size()) == count, fn,
                       "'reward_weights' has ", reward_weights.size(), " weights for ", count, " reward component",
                       count == 1 ? "" : "s", given ? "" : " (no 'reward_components': the summed token rewards)");
  for (std::size_t k = 0; k < reward_weights.size(); ++k)
    mrr::detail::require(std::isfinite(reward_weights[k]), fn, "'reward_weights' has a non-finite weight ",
                         reward_weights[k], " at [", k, "]");
  detail::prepare_output(fn, out, token_level_rewards.rows(), token_level_rewards.cols(), token_level_rewards,
                         response_mask, components);
  const auto estimator =
      norm_adv_by_std_in_grpo ? kernels::ppo::OutcomeEstimator::grpo : kernels::ppo::OutcomeEstimator::grpo_mean_only;
  Vector<T> total;
  for (Eigen::Index k = 0; k < count; ++k) {
    const Vector<T> scores =
        given ? Vector<T>(components.row(k).transpose()) : detail::response_scores<T>(fn, token_level_rewards);
    const Vector<T> normalised = detail::group_outcome_scalars<T>(scores, index, estimator, epsilon);
    const T weight = reward_weights.empty() ? T(1) : static_cast<T>(reward_weights[static_cast<std::size_t>(k)]);
    if (k == 0)
      total = weight * normalised;
    else
      total += weight * normalised;
  }
  const auto moments = detail::broadcast_rows_into<T>(fn, out.advantages, response_mask, total);
  detail::whiten_masked_into(out.advantages, out.advantages, response_mask, moments, &out.returns);
}

template <class T>
AdvantageResult<T> compute_gdpo_outcome_advantage(MatrixRef<T> token_level_rewards, MatrixRef<T> response_mask,
                                                  const GroupIndex& index, OptionalMatrixView<T> reward_components = {},
                                                  std::span<const double> reward_weights = {}, double epsilon = 1e-6,
                                                  bool norm_adv_by_std_in_grpo = true) {
  AdvantageResult<T> out;
  compute_gdpo_outcome_advantage_into<T>(out, token_level_rewards, response_mask, index, reward_components,
                                         reward_weights, epsilon, norm_adv_by_std_in_grpo);
  return out;
}

}  // namespace ppo
MRR_NAMESPACE_END
