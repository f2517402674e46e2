// Softmax over the k slots of each row of a tile, for the router's float32 weights (native and
// replayed alike). The tile's logits are held slot-major, buf[j * kSoftmaxTileRows + r], so every
// step is an element-wise loop of fixed length over the tile's rows: compilers vectorise it at
// -O2 and -O3 without -march (Eigen's SSE2 exp is not inlined there and took 40% of replay).
// On x86 with GCC or Clang the same code is also compiled for AVX2 and picked at run time; both
// perform the same IEEE operations in the same order (no FMA), so the bits do not depend on it
// (a build whose own target has FMA contracts them: vexp.hpp).
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/detail/cpu_dispatch.hpp>
#include <mrr/detail/vexp.hpp>

#include <bit>
#include <cstdint>
#include <limits>

#define MRR_SOFTMAX_TILE_AVX2 MRR_AVX2_DISPATCH

#if MRR_SOFTMAX_TILE_AVX2
#include <immintrin.h>
#endif


MRR_NAMESPACE_BEGIN
namespace detail {

inline constexpr int kSoftmaxTileRows = 64;

// exp(x) for the softmax's x = z - max <= 0, within 1 ulp of the true value on [-87.3, 0] and
// exactly 0 below (so a masked -inf logit weighs exactly 0; true exp would give a denormal there,
// under 1.2e-38). Cody-Waite reduction x = n ln2 + r, a degree-6 minimax polynomial in r, and 2^n
// built in the exponent bits; written without branches so that loops over it vectorise.
MRR_FORCEINLINE float exp_nonpositive(float x) {
  constexpr float lowest = -87.33654475f;  // log(FLT_MIN)
  const auto [t, p] = exp_reduce(x);
  // 2^n = (n + 127) << 23, with n = bits(t) - bits(kExpRoundMagic) (unsigned: wraps, never overflows).
  const std::uint32_t two_n =
      (std::bit_cast<std::uint32_t>(t) << 23) + ((127u - std::bit_cast<std::uint32_t>(kExpRoundMagic)) << 23);
  const std::uint32_t keep = x >= lowest ? ~0u : 0u;  // also drops NaN, -inf and garbage 2^n
  return std::bit_cast<float>(std::bit_cast<std::uint32_t>(p * std::bit_cast<float>(two_n)) & keep);
}

// Replay's gather of a tile of `rows` rows: tile[j * kSoftmaxTileRows + r] = z[r][ids[r][j]] and
// ids_out[r * k + j] = ids[r][j], checking that the ids are in [0, num_experts) (first, so that
// the gather needs no clamp) and distinct within a row (every pair of slots compared, in
// element-wise loops over the tile's rows, with a slot-major copy of the ids in `slot_ids`).
// Returns false when an id is out of range or repeated. The common k are compiled with k known.
template <int K, class Scalar>
MRR_FORCEINLINE bool gather_slot_major_body(const Scalar* z, std::int64_t z_stride, const std::int32_t* ids,
                                            std::int64_t id_stride, int runtime_k, int num_experts, int rows,
                                            Scalar* tile, std::int32_t* slot_ids, std::int32_t* ids_out) {
  constexpr int R = kSoftmaxTileRows;
  const int k = K > 0 ? K : runtime_k;
  const auto num_e = static_cast<std::uint32_t>(num_experts);
  std::uint32_t out_of_range = 0;
  if (id_stride == k) {
    for (int i = 0; i < rows * k; ++i)
      out_of_range |= static_cast<std::uint32_t>(ids[i]) >= num_e ? 1u : 0u;
  } else {
    for (int r = 0; r < rows; ++r)
      for (int j = 0; j < k; ++j)
        out_of_range |= static_cast<std::uint32_t>(ids[r * id_stride + j]) >= num_e ? 1u : 0u;
  }
  if (out_of_range != 0) return false;
  if (id_stride == k) {  // contiguous ids: one vectorised copy
    for (int i = 0; i < rows * k; ++i)
      ids_out[i] = ids[i];
  } else {
    for (int r = 0; r < rows; ++r)
      for (int j = 0; j < k; ++j)
        ids_out[r * k + j] = ids[r * id_stride + j];
  }
  for (int r = 0; r < rows; ++r) {
    const std::int32_t* src = ids + r * id_stride;
    const Scalar* zr = z + r * z_stride;
    for (int j = 0; j < k; ++j) {
      const std::int32_t e = src[j];
      slot_ids[j * R + r] = e;
      tile[j * R + r] = zr[e];
    }
  }
  for (int r = rows; r < R; ++r)  // padding lanes: distinct ids
    for (int j = 0; j < k; ++j)
      slot_ids[j * R + r] = j;
  std::int32_t repeated = 0;
  for (int i = 0; i + 1 < k; ++i)
    for (int j = i + 1; j < k; ++j)
      for (int r = 0; r < R; ++r)
        repeated |= slot_ids[i * R + r] == slot_ids[j * R + r] ? 1 : 0;
  return repeated == 0;
}

template <int K, class Scalar>
bool gather_slot_major_k(const Scalar* z, std::int64_t z_stride, const std::int32_t* ids, std::int64_t id_stride,
                         int runtime_k, int num_experts, int rows, Scalar* tile, std::int32_t* slot_ids,
                         std::int32_t* ids_out) {
  return gather_slot_major_body<K>(z, z_stride, ids, id_stride, runtime_k, num_experts, rows, tile, slot_ids, ids_out);
}

#if MRR_SOFTMAX_TILE_AVX2
template <int K, class Scalar>
__attribute__((target("avx2"))) bool gather_slot_major_avx2(const Scalar* z, std::int64_t z_stride,
                                                            const std::int32_t* ids, std::int64_t id_stride,
                                                            int runtime_k, int num_experts, int rows, Scalar* tile,
                                                            std::int32_t* slot_ids, std::int32_t* ids_out) {
  return gather_slot_major_body<K>(z, z_stride, ids, id_stride, runtime_k, num_experts, rows, tile, slot_ids, ids_out);
}
#endif

template <int K, class Scalar>
bool gather_slot_major_dispatch(const Scalar* z, std::int64_t z_stride, const std::int32_t* ids, std::int64_t id_stride,
                                int k, int num_experts, int rows, Scalar* tile, std::int32_t* slot_ids,
                                std::int32_t* ids_out) {
#if MRR_SOFTMAX_TILE_AVX2
  const bool has_avx2 = cpu_has_avx2();
  if (has_avx2)
    return gather_slot_major_avx2<K>(z, z_stride, ids, id_stride, k, num_experts, rows, tile, slot_ids, ids_out);
#endif
  return gather_slot_major_k<K>(z, z_stride, ids, id_stride, k, num_experts, rows, tile, slot_ids, ids_out);
}

template <class Scalar>
bool gather_slot_major(const Scalar* z, std::int64_t z_stride, const std::int32_t* ids, std::int64_t id_stride, int k,
                       int num_experts, int rows, Scalar* tile, std::int32_t* slot_ids, std::int32_t* ids_out) {
  switch (k) {
    case 2:
      return gather_slot_major_dispatch<2>(z, z_stride, ids, id_stride, k, num_experts, rows, tile, slot_ids, ids_out);
    case 4:
      return gather_slot_major_dispatch<4>(z, z_stride, ids, id_stride, k, num_experts, rows, tile, slot_ids, ids_out);
    case 6:
      return gather_slot_major_dispatch<6>(z, z_stride, ids, id_stride, k, num_experts, rows, tile, slot_ids, ids_out);
    case 8:
      return gather_slot_major_dispatch<8>(z, z_stride, ids, id_stride, k, num_experts, rows, tile, slot_ids, ids_out);
    default:
      return gather_slot_major_dispatch<0>(z, z_stride, ids, id_stride, k, num_experts, rows, tile, slot_ids, ids_out);
  }
}

// What softmax_slot_major found besides the weights.
enum SoftmaxTileStatus : unsigned {
  softmax_tile_ok = 0,
  softmax_tile_invalid_logit = 1,  // a NaN or +inf logit
  softmax_tile_all_masked = 2,     // a row whose logits are all -inf: its weights are NaN (0 * inf)
};

// Weights of `rows` (<= kSoftmaxTileRows) rows: out[r * k + j] = scale * softmax(buf[., r])[j].
// buf holds k * kSoftmaxTileRows logits slot-major and is overwritten; lanes >= rows are ignored.
// Maxima and sums run per row in slot order.
template <int K = 0>
MRR_FORCEINLINE unsigned softmax_slot_major_body(float* buf, int runtime_k, int rows, float scale, float* out) {
  constexpr int R = kSoftmaxTileRows;
  const int k = K > 0 ? K : runtime_k;
  constexpr float inf = std::numeric_limits<float>::infinity();
  if (rows < R)  // padding lanes take finite values, so every loop below keeps its fixed length
    for (int j = 0; j < k; ++j)
      for (int r = rows; r < R; ++r)
        buf[j * R + r] = 0.0f;
  float mx[R], sum[R];
  int invalid = 0, masked = 0;
  for (int r = 0; r < R; ++r) {
    mx[r] = buf[r];
    invalid |= buf[r] < inf ? 0 : 1;
  }
  for (int j = 1; j < k; ++j) {
    const float* b = buf + j * R;
    for (int r = 0; r < R; ++r) {
      mx[r] = b[r] > mx[r] ? b[r] : mx[r];
      invalid |= b[r] < inf ? 0 : 1;
    }
  }
  for (int r = 0; r < R; ++r) {
    masked |= mx[r] > -inf ? 0 : 1;
    sum[r] = 0.0f;
  }
  for (int j = 0; j < k; ++j) {
    float* b = buf + j * R;
    for (int r = 0; r < R; ++r) {
      const float e = exp_nonpositive(b[r] - mx[r]);
      b[r] = e;
      sum[r] += e;
    }
  }
  for (int r = 0; r < R; ++r)
    sum[r] = scale / sum[r];
  for (int r = 0; r < rows; ++r)
    for (int j = 0; j < k; ++j)
      out[r * k + j] = buf[j * R + r] * sum[r];
  return (invalid ? softmax_tile_invalid_logit : 0u) | (masked ? softmax_tile_all_masked : 0u);
}

template <int K>
unsigned softmax_slot_major_k(float* buf, int k, int rows, float scale, float* out) {
  return softmax_slot_major_body<K>(buf, k, rows, scale, out);
}

#if MRR_SOFTMAX_TILE_AVX2
template <int K>
__attribute__((target("avx2"))) unsigned softmax_slot_major_avx2(float* buf, int k, int rows, float scale, float* out) {
  return softmax_slot_major_body<K>(buf, k, rows, scale, out);
}
#endif

template <int K>
unsigned softmax_slot_major_dispatch(float* buf, int k, int rows, float scale, float* out) {
#if MRR_SOFTMAX_TILE_AVX2
  const bool has_avx2 = cpu_has_avx2();
  if (has_avx2) return softmax_slot_major_avx2<K>(buf, k, rows, scale, out);
#endif
  return softmax_slot_major_k<K>(buf, k, rows, scale, out);
}

inline unsigned softmax_slot_major(float* buf, int k, int rows, float scale, float* out) {
  switch (k) {
    case 2:
      return softmax_slot_major_dispatch<2>(buf, k, rows, scale, out);
    case 4:
      return softmax_slot_major_dispatch<4>(buf, k, rows, scale, out);
    case 6:
      return softmax_slot_major_dispatch<6>(buf, k, rows, scale, out);
    case 8:
      return softmax_slot_major_dispatch<8>(buf, k, rows, scale, out);
    default:
      return softmax_slot_major_dispatch<0>(buf, k, rows, scale, out);
  }
}

// Replay with k = 8 on AVX2 in one pass, for the leading multiple of 8 of a tile's `rows` rows:
// ids_out[r * 8 + j] = ids[r][j] and w_out[r * 8 + j] = scale * softmax(z[r][ids[r]])[j], the
// same IEEE operations in the same order as gather_slot_major + softmax_slot_major (the logits are
// fetched with hardware gathers, which change only the loads), so the bits are those of the tile
// path. Eight rows at a time: the ids are range-checked before the gathers, transposed slot-major
// in registers (every pair of slots compared for repeats), and the weights transposed back.
// Rows up to `readable_rows` (>= rows) may be read, not written: the kernel prefetches the logits
// of the 8 rows after the current 8 when they lie there (the next tile's first 8 included).
// Returns the number of rows done (0 without AVX2, for k != 8, or for row strides too large for
// 32-bit gather offsets); `status` gets replay_fused_bad_ids (an id out of range or repeated: the
// rows after the group that found it are not done) and the softmax_tile_* bits.
inline constexpr unsigned replay_fused_bad_ids = 4;

#if MRR_SOFTMAX_TILE_AVX2
__attribute__((target("avx2"))) inline void transpose8_avx2(__m256& a0, __m256& a1, __m256& a2, __m256& a3,
                                                           __m256& a4, __m256& a5, __m256& a6, __m256& a7) {
  const __m256 t0 = _mm256_unpacklo_ps(a0, a1), t1 = _mm256_unpackhi_ps(a0, a1);
  const __m256 t2 = _mm256_unpacklo_ps(a2, a3), t3 = _mm256_unpackhi_ps(a2, a3);
  const __m256 t4 = _mm256_unpacklo_ps(a4, a5), t5 = _mm256_unpackhi_ps(a4, a5);
  const __m256 t6 = _mm256_unpacklo_ps(a6, a7), t7 = _mm256_unpackhi_ps(a6, a7);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  a0 = _mm256_permute2f128_ps(u0, u4, 0x20);
  a1 = _mm256_permute2f128_ps(u1, u5, 0x20);
  a2 = _mm256_permute2f128_ps(u2, u6, 0x20);
  a3 = _mm256_permute2f128_ps(u3, u7, 0x20);
  a4 = _mm256_permute2f128_ps(u0, u4, 0x31);
  a5 = _mm256_permute2f128_ps(u1, u5, 0x31);
  a6 = _mm256_permute2f128_ps(u2, u6, 0x31);
  a7 = _mm256_permute2f128_ps(u3, u7, 0x31);
}

// exp_nonpositive on eight lanes, operation for operation.
__attribute__((target("avx2"))) inline __m256 exp_nonpositive_avx2(__m256 x) {
  const __m256 round_magic = _mm256_set1_ps(12582912.0f);
  const __m256 t = _mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), round_magic);
  const __m256 n = _mm256_sub_ps(t, round_magic);
  const __m256 r = _mm256_sub_ps(_mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f))),
                                 _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
  __m256 q = _mm256_set1_ps(0.001381461275741458f);
  q = _mm256_add_ps(_mm256_mul_ps(q, r), _mm256_set1_ps(0.008368710055947304f));
  q = _mm256_add_ps(_mm256_mul_ps(q, r), _mm256_set1_ps(0.04166838899254799f));
  q = _mm256_add_ps(_mm256_mul_ps(q, r), _mm256_set1_ps(0.1666652113199234f));
  q = _mm256_add_ps(_mm256_mul_ps(q, r), _mm256_set1_ps(0.4999999403953552f));
  const __m256 p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(r, r), q), r), _mm256_set1_ps(1.0f));
  const __m256i two_n = _mm256_add_epi32(_mm256_slli_epi32(_mm256_castps_si256(t), 23),
                                         _mm256_set1_epi32(static_cast<int>((127u - 0x4B400000u) << 23)));
  const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(-87.33654475f), _CMP_GE_OQ);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(two_n)), keep);
}

__attribute__((target("avx2"))) inline int replay_softmax_k8_avx2(const float* z, std::int64_t z_stride,
                                                                 const std::int32_t* ids, std::int64_t id_stride,
                                                                 int num_experts, int rows, int readable_rows,
                                                                 float scale, std::int32_t* ids_out, float* w_out,
                                                                 unsigned& status) {
  const int s = static_cast<int>(z_stride);
  const __m256i row_offset = _mm256_setr_epi32(0, s, 2 * s, 3 * s, 4 * s, 5 * s, 6 * s, 7 * s);
  const __m256i last_id = _mm256_set1_epi32(num_experts - 1);
  const __m256 inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256 scale_v = _mm256_set1_ps(scale);
  __m256i repeated = _mm256_setzero_si256();
  __m256 invalid = _mm256_setzero_ps(), masked = _mm256_setzero_ps();
  const int done = rows & ~7;
  for (int g = 0; g < done; g += 8) {
    const std::int32_t* src = ids + g * id_stride;
    __m256i id[8];
    __m256i hi = _mm256_setzero_si256();
    for (int i = 0; i < 8; ++i) {
      id[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i * id_stride));
      hi = _mm256_max_epu32(hi, id[i]);
    }
    // Unsigned: negative ids are huge. Checked before any gather reads z.
    if (_mm256_movemask_epi8(_mm256_cmpeq_epi32(_mm256_max_epu32(hi, last_id), last_id)) != -1) [[unlikely]] {
      status |= replay_fused_bad_ids;
      return done;
    }
    // Prefetch the logits the next 8 rows read (their ids are at hand; a gather that misses
    // cache stalls the pass: at E=256 the logits outgrow L2, and this took replay from 88 to 66 us).
    if (g + 16 <= readable_rows) {
      const std::int32_t* next = src + 8 * id_stride;
      const float* zn = z + (g + 8) * z_stride;
      for (int i = 0; i < 8; ++i)
        for (int j = 0; j < 8; ++j)
          _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<std::uintptr_t>(zn + i * z_stride) +
                                                     4 * static_cast<std::uintptr_t>(next[i * id_stride + j])),
                       _MM_HINT_T0);  // never faults, so an id out of range does no harm
    }
    for (int i = 0; i < 8; ++i)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(ids_out + (g + i) * 8), id[i]);
    __m256 v[8];
    for (int i = 0; i < 8; ++i) v[i] = _mm256_castsi256_ps(id[i]);
    transpose8_avx2(v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7]);  // v[j]: slot j of the 8 rows
    for (int j = 0; j < 8; ++j) id[j] = _mm256_castps_si256(v[j]);
    for (int i = 0; i < 7; ++i)
      for (int j = i + 1; j < 8; ++j)
        repeated = _mm256_or_si256(repeated, _mm256_cmpeq_epi32(id[i], id[j]));
    const float* zg = z + g * z_stride;
    __m256 b[8];
    for (int j = 0; j < 8; ++j) {
      b[j] = _mm256_i32gather_ps(zg, _mm256_add_epi32(row_offset, id[j]), 4);
      invalid = _mm256_or_ps(invalid, _mm256_cmp_ps(b[j], inf, _CMP_NLT_UQ));  // NaN or +inf
    }
    __m256 mx = b[0];
    for (int j = 1; j < 8; ++j) mx = _mm256_max_ps(b[j], mx);  // b > mx ? b : mx
    masked = _mm256_or_ps(masked, _mm256_cmp_ps(mx, neg_inf, _CMP_NGT_UQ));
    __m256 sum = _mm256_setzero_ps();
    for (int j = 0; j < 8; ++j) {
      b[j] = exp_nonpositive_avx2(_mm256_sub_ps(b[j], mx));
      sum = _mm256_add_ps(sum, b[j]);
    }
    const __m256 factor = _mm256_div_ps(scale_v, sum);
    for (int j = 0; j < 8; ++j) b[j] = _mm256_mul_ps(b[j], factor);
    transpose8_avx2(b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]);  // back to b[i]: row i
    for (int i = 0; i < 8; ++i) _mm256_storeu_ps(w_out + (g + i) * 8, b[i]);
  }
  if (!_mm256_testz_si256(repeated, repeated)) status |= replay_fused_bad_ids;
  if (_mm256_movemask_ps(invalid) != 0) status |= softmax_tile_invalid_logit;
  if (_mm256_movemask_ps(masked) != 0) status |= softmax_tile_all_masked;
  return done;
}
#endif

inline int replay_softmax_fused(const float* z, std::int64_t z_stride, const std::int32_t* ids,
                                std::int64_t id_stride, int k, int num_experts, int rows, int readable_rows, float scale,
                                std::int32_t* ids_out, float* w_out, unsigned& status) {
#if MRR_SOFTMAX_TILE_AVX2
  const bool has_avx2 = cpu_has_avx2();
  if (has_avx2 && k == 8 && z_stride <= (std::int64_t{1} << 27) && num_experts <= z_stride)
    return replay_softmax_k8_avx2(z, z_stride, ids, id_stride, num_experts, rows, readable_rows, scale, ids_out,
                                  w_out, status);
#else
  (void)z, (void)z_stride, (void)ids, (void)id_stride, (void)k, (void)num_experts, (void)rows, (void)readable_rows,
      (void)scale, (void)ids_out, (void)w_out, (void)status;
#endif
  return 0;
}

}  // namespace detail
MRR_NAMESPACE_END
