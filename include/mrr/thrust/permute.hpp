// mrr-requires: mrr_thrust_omp
// Expert-major permutation of a top-k routing on a Thrust system (the device mirror of
// make_expert_permutation / permute_tokens / combine in router/permute.hpp): rows for expert 0
// first, each expert's tokens in ascending token order (a stable sort of the slots by expert),
// and a combine that accumulates each token's k expert outputs in slot order, in Accum precision,
// so the result never depends on how rows were produced or arrived.
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>
#include <mrr/thrust/backend.hpp>

#include <thrust/adjacent_difference.h>
#include <thrust/binary_search.h>
#include <thrust/copy.h>
#include <thrust/for_each.h>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/logical.h>
#include <thrust/sequence.h>
#include <thrust/sort.h>

#include <cstdint>
#include <type_traits>

MRR_NAMESPACE_BEGIN
namespace device {

// Where every (token, slot) goes in the expert-major order (int32 indices: tokens * k < 2^31).
template <class Backend = ThrustDeviceBackend>
struct ExpertPermutation {
  typename Backend::template vector<std::int32_t> source_token;   // [rows]
  typename Backend::template vector<std::int32_t> expert_offsets;  // [experts + 1]; tokens_per_expert = diff
  typename Backend::template vector<std::int32_t> row_of_slot;     // [tokens, k]
  long tokens = 0;
  int topk = 0;
  long rows() const { return static_cast<long>(source_token.size()); }
};

namespace kernels {

struct OutOfRange {
  int num_experts;
  MRR_HOST_DEVICE bool operator()(std::int32_t e) const { return e < 0 || e >= num_experts; }
};

// sorted slot s = t * k + j at row r: source_token[r] = t, row_of_slot[s] = r.
struct ScatterSlots {
  const std::int32_t* sorted_slots;
  std::int32_t* source_token;
  std::int32_t* row_of_slot;
  int k;
  MRR_HOST_DEVICE void operator()(long r) const {
    const std::int32_t s = sorted_slots[r];
    source_token[r] = s / k;
    row_of_slot[s] = static_cast<std::int32_t>(r);
  }
};

// Rows are copied in chunks of kChunk contiguous elements: long unit-stride loops on CPU threads,
// many independent work items on a GPU.
inline constexpr long kChunk = 256;

template <class T>
struct GatherRows {
  const T* tokens;
  const std::int32_t* source_token;
  T* out;
  long hidden, chunks_per_row;
  MRR_HOST_DEVICE void operator()(long item) const {
    const long r = item / chunks_per_row, lo = (item % chunks_per_row) * kChunk;
    const long hi = lo + kChunk < hidden ? lo + kChunk : hidden;
    const T* src = tokens + static_cast<long>(source_token[r]) * hidden;
    T* dst = out + r * hidden;
    for (long h = lo; h < hi; ++h) dst[h] = src[h];
  }
};

template <class T, class Accum>
struct CombineRows {
  const T* expert_out;
  const T* weights;
  const std::int32_t* row_of_slot;
  T* out;
  long hidden, chunks_per_row;
  int k;
  MRR_HOST_DEVICE void operator()(long item) const {
    const long t = item / chunks_per_row, lo = (item % chunks_per_row) * kChunk;
    const long hi = lo + kChunk < hidden ? lo + kChunk : hidden;
    Accum acc[kChunk];
    for (long h = lo; h < hi; ++h) acc[h - lo] = Accum(0);
    for (int j = 0; j < k; ++j) {  // slot order: the sum never depends on arrival order
      const std::int32_t r = row_of_slot[t * k + j];
      if (r < 0) continue;
      const Accum w = static_cast<Accum>(weights[t * k + j]);
      const T* src = expert_out + static_cast<long>(r) * hidden;
      for (long h = lo; h < hi; ++h) acc[h - lo] += static_cast<Accum>(src[h]) * w;
    }
    for (long h = lo; h < hi; ++h) out[t * hidden + h] = static_cast<T>(acc[h - lo]);
  }
};

}  // namespace kernels

// The permutation of ids [tokens, k] (int32, every slot dispatched).
template <class Backend = ThrustDeviceBackend>
ExpertPermutation<Backend> make_expert_permutation(const typename Backend::template vector<std::int32_t>& ids,
                                                   long tokens, int topk, int num_experts) {
  constexpr const char* fn = "device::make_expert_permutation";
  const auto slots = static_cast<std::size_t>(tokens) * static_cast<std::size_t>(topk);
  mrr::detail::require(ids.size() == slots, fn, "'ids' has ", ids.size(), " values, expected [", tokens, ", ", topk,
                       "]");
  mrr::detail::require(slots < (std::size_t(1) << 31), fn, "tokens * k = ", slots, " exceeds the int32 row index");
  const auto policy = Backend::policy();
  mrr::detail::require(!thrust::any_of(policy, ids.begin(), ids.end(), kernels::OutOfRange{num_experts}), fn,
                       "an expert id is outside [0, ", num_experts, ")");
  ExpertPermutation<Backend> p;
  p.tokens = tokens;
  p.topk = topk;
  typename Backend::template vector<std::int32_t> keys(ids.begin(), ids.end()), sorted_slots(slots);
  thrust::sequence(policy, sorted_slots.begin(), sorted_slots.end());
  // Stable: within an expert, slots (hence tokens) stay ascending.
  thrust::stable_sort_by_key(policy, keys.begin(), keys.end(), sorted_slots.begin());
  p.expert_offsets.resize(static_cast<std::size_t>(num_experts) + 1);
  thrust::lower_bound(policy, keys.begin(), keys.end(), thrust::counting_iterator<std::int32_t>(0),
                      thrust::counting_iterator<std::int32_t>(num_experts + 1), p.expert_offsets.begin());
  p.source_token.resize(slots);
  p.row_of_slot.resize(slots);
  thrust::for_each(policy, thrust::counting_iterator<long>(0), thrust::counting_iterator<long>(static_cast<long>(slots)),
                   kernels::ScatterSlots{thrust::raw_pointer_cast(sorted_slots.data()),
                                         thrust::raw_pointer_cast(p.source_token.data()),
                                         thrust::raw_pointer_cast(p.row_of_slot.data()), topk});
  return p;
}

// Tokens per expert, from the offsets.
template <class Backend>
typename Backend::template vector<std::int32_t> tokens_per_expert(const ExpertPermutation<Backend>& p) {
  typename Backend::template vector<std::int32_t> counts(p.expert_offsets.size());
  thrust::adjacent_difference(Backend::policy(), p.expert_offsets.begin(), p.expert_offsets.end(), counts.begin());
  counts.erase(counts.begin());
  return counts;
}

// tokens [tokens, hidden] -> [rows, hidden], expert-major.
template <class T, class Backend = ThrustDeviceBackend>
typename Backend::template vector<T> permute_tokens(const typename Backend::template vector<T>& tokens, long hidden,
                                                    const ExpertPermutation<Backend>& p) {
  mrr::detail::require(tokens.size() == static_cast<std::size_t>(p.tokens * hidden), "device::permute_tokens",
                       "'tokens' has ", tokens.size(), " values, expected [", p.tokens, ", ", hidden, "]");
  typename Backend::template vector<T> out(static_cast<std::size_t>(p.rows() * hidden));
  const long chunks = (hidden + kernels::kChunk - 1) / kernels::kChunk;
  thrust::for_each(Backend::policy(), thrust::counting_iterator<long>(0), thrust::counting_iterator<long>(p.rows() * chunks),
                   kernels::GatherRows<T>{thrust::raw_pointer_cast(tokens.data()),
                                          thrust::raw_pointer_cast(p.source_token.data()),
                                          thrust::raw_pointer_cast(out.data()), hidden, chunks});
  return out;
}

// out[t] = sum_j weights[t, j] * expert_out[row_of_slot[t, j]] in slot order, accumulated in Accum.
template <class T, class Backend = ThrustDeviceBackend,
          class Accum = std::conditional_t<(sizeof(T) < sizeof(float)), float, T>>
typename Backend::template vector<T> combine(const typename Backend::template vector<T>& expert_out, long hidden,
                                             const typename Backend::template vector<T>& weights,
                                             const ExpertPermutation<Backend>& p) {
  mrr::detail::require(expert_out.size() == static_cast<std::size_t>(p.rows() * hidden), "device::combine",
                       "'expert_out' has ", expert_out.size(), " values, expected [", p.rows(), ", ", hidden, "]");
  mrr::detail::require(weights.size() == p.row_of_slot.size(), "device::combine", "'weights' has ", weights.size(),
                       " values, expected [", p.tokens, ", ", p.topk, "]");
  typename Backend::template vector<T> out(static_cast<std::size_t>(p.tokens * hidden));
  const long chunks = (hidden + kernels::kChunk - 1) / kernels::kChunk;
  thrust::for_each(Backend::policy(), thrust::counting_iterator<long>(0), thrust::counting_iterator<long>(p.tokens * chunks),
                   kernels::CombineRows<T, Accum>{thrust::raw_pointer_cast(expert_out.data()),
                                                  thrust::raw_pointer_cast(weights.data()),
                                                  thrust::raw_pointer_cast(p.row_of_slot.data()),
                                                  thrust::raw_pointer_cast(out.data()), hidden, chunks, p.topk});
  return out;
}

}  // namespace device
MRR_NAMESPACE_END
