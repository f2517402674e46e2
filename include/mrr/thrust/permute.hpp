// mrr-requires: mrr_thrust_omp
// Expert-major permutation of a top-k routing on a Thrust system (the device mirror of
// make_expert_permutation / permute_tokens / combine in router/permute.hpp): rows for expert 0
// first, each expert's tokens in ascending token order (a counting sort of the slots by expert:
// count, scan, place; stable by construction), and a combine that accumulates each token's k
// expert outputs in slot order, in Accum precision, so the result never depends on how rows were
// produced or arrived.
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>
#include <mrr/thrust/backend.hpp>

#include <thrust/adjacent_difference.h>
#include <thrust/for_each.h>
#include <thrust/functional.h>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/reduce.h>
#include <thrust/scan.h>

#if THRUST_DEVICE_SYSTEM == THRUST_DEVICE_SYSTEM_OMP
#include <omp.h>
#endif

#include <cstdint>
#include <cstring>
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

// The permutation is a counting sort of the slots by expert, stable by construction: the slots
// are cut into chunks; each chunk counts its experts (histogram [experts, chunks], expert-major);
// one exclusive scan of that histogram gives every (expert, chunk) its first row; each chunk then
// places its slots in slot order. Three passes over the ids and no comparison sort.
struct CountChunk {
  const std::int32_t* ids;
  std::int32_t* histogram;  // [experts, chunks]
  std::uint8_t* bad;        // [chunks] 1 where an id is outside [0, experts)
  long slots, chunk;
  int num_experts, chunks;
  MRR_HOST_DEVICE void operator()(int c) const {
    const long lo = c * chunk, hi = lo + chunk < slots ? lo + chunk : slots;
    bool out_of_range = false;
#if defined(__CUDA_ARCH__)
    for (int e = 0; e < num_experts; ++e) histogram[static_cast<long>(e) * chunks + c] = 0;
    for (long s = lo; s < hi; ++s) {
      const std::int32_t e = ids[s];
      if (e < 0 || e >= num_experts) {
        out_of_range = true;
        continue;
      }
      ++histogram[static_cast<long>(e) * chunks + c];
    }
#else
    // CPU threads count in a private array: the expert-major histogram puts the counters of
    // neighbouring chunks in one cache line, and incrementing them in place from several threads
    // made 2 threads 2-3 x slower than 1 (measured: 4.5-6.7 ms against 1.9 ms).
    std::int32_t count[1024] = {};  // kMaxExperts of the router
    for (long s = lo; s < hi; ++s) {
      const std::int32_t e = ids[s];
      const bool in_range = static_cast<std::uint32_t>(e) < static_cast<std::uint32_t>(num_experts);
      out_of_range |= !in_range;
      count[in_range ? e : 0] += in_range ? 1 : 0;
    }
    for (int e = 0; e < num_experts; ++e) histogram[static_cast<long>(e) * chunks + c] = count[e];
#endif
    bad[c] = out_of_range ? 1 : 0;
  }
};

struct PlaceChunk {
  const std::int32_t* ids;
  const std::int32_t* first_row;  // [experts, chunks] exclusive scan of the histogram
  std::int32_t* source_token;
  std::int32_t* row_of_slot;
  long slots, chunk;
  int num_experts, chunks, k;
  MRR_HOST_DEVICE void operator()(int c) const {
    std::int32_t next[1024];  // kMaxExperts of the router
    for (int e = 0; e < num_experts; ++e) next[e] = first_row[static_cast<long>(e) * chunks + c];
    const long lo = c * chunk, hi = lo + chunk < slots ? lo + chunk : slots;
    for (long s = lo; s < hi; ++s) {
      const std::int32_t r = next[ids[s]]++;
      source_token[r] = static_cast<std::int32_t>(s / k);
      row_of_slot[s] = r;
    }
  }
};

// expert_offsets[e] = first_row[e, 0]; expert_offsets[experts] = slots.
struct ExpertOffsets {
  const std::int32_t* first_row;
  std::int32_t* offsets;
  int chunks, num_experts;
  std::int32_t slots;
  MRR_HOST_DEVICE void operator()(int e) const {
    offsets[e] = e == num_experts ? slots : first_row[static_cast<long>(e) * chunks];
  }
};

// Rows are copied in chunks of kChunk contiguous elements: many independent work items on a GPU;
// on CPU threads a gathered row is one work item and one memcpy.
inline constexpr long kChunk = 256;

template <class T>
struct GatherRows {
  const T* tokens;
  const std::int32_t* source_token;
  T* out;
  long hidden, chunks_per_row;
  MRR_HOST_DEVICE void operator()(long item) const {
    const long length = (hidden + chunks_per_row - 1) / chunks_per_row;
    const long r = item / chunks_per_row, lo = (item % chunks_per_row) * length;
    const long hi = lo + length < hidden ? lo + length : hidden;
    const T* src = tokens + static_cast<long>(source_token[r]) * hidden;
    T* dst = out + r * hidden;
#if defined(__CUDA_ARCH__)
    for (long h = lo; h < hi; ++h) dst[h] = src[h];
#else
    std::memcpy(dst + lo, src + lo, static_cast<std::size_t>(hi - lo) * sizeof(T));
#endif
  }
};

// Chunks per row for GatherRows: one on the OpenMP and host systems (rows are work items enough).
inline long gather_chunks_per_row(long hidden, bool host_system) {
  return host_system ? 1 : (hidden + kChunk - 1) / kChunk;
}

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

// Chunks of the counting sort: a few per OpenMP thread (each a long sequential run), or one per
// 256 slots on a GPU (many independent work items).
inline int permutation_chunks(long slots) {
#if THRUST_DEVICE_SYSTEM == THRUST_DEVICE_SYSTEM_OMP
  const long wanted = 4L * omp_get_max_threads();
#else
  const long wanted = (slots + 255) / 256;
#endif
  const long at_least_1k = (slots + 1023) / 1024;  // never chunks so small the histogram dominates
  const long chunks = wanted < at_least_1k ? wanted : at_least_1k;
  return static_cast<int>(chunks < 1 ? 1 : chunks);
}

// The permutation of ids [tokens, k] (int32, every slot dispatched). Experts <= 1024.
template <class Backend = ThrustDeviceBackend>
ExpertPermutation<Backend> make_expert_permutation(const typename Backend::template vector<std::int32_t>& ids,
                                                   long tokens, int topk, int num_experts) {
  constexpr const char* fn = "device::make_expert_permutation";
  const auto slots = static_cast<std::size_t>(tokens) * static_cast<std::size_t>(topk);
  mrr::detail::require(ids.size() == slots, fn, "'ids' has ", ids.size(), " values, expected [", tokens, ", ", topk,
                       "]");
  mrr::detail::require(slots < (std::size_t(1) << 31), fn, "tokens * k = ", slots, " exceeds the int32 row index");
  mrr::detail::require(num_experts > 0 && num_experts <= 1024, fn, "num_experts=", num_experts,
                       " outside the device limit [1, 1024]");
  const auto policy = Backend::policy();
  ExpertPermutation<Backend> p;
  p.tokens = tokens;
  p.topk = topk;
  const int chunks = permutation_chunks(static_cast<long>(slots));
  const long chunk = (static_cast<long>(slots) + chunks - 1) / chunks;
  typename Backend::template vector<std::int32_t> histogram(static_cast<std::size_t>(num_experts) * chunks);
  typename Backend::template vector<std::uint8_t> bad(static_cast<std::size_t>(chunks));
  const auto* id = thrust::raw_pointer_cast(ids.data());
  thrust::for_each(policy, thrust::counting_iterator<int>(0), thrust::counting_iterator<int>(chunks),
                   kernels::CountChunk{id, thrust::raw_pointer_cast(histogram.data()),
                                       thrust::raw_pointer_cast(bad.data()), static_cast<long>(slots), chunk,
                                       num_experts, chunks});
  mrr::detail::require(thrust::reduce(policy, bad.begin(), bad.end(), 0, thrust::maximum<int>()) == 0, fn,
                       "an expert id is outside [0, ", num_experts, ")");
  thrust::exclusive_scan(policy, histogram.begin(), histogram.end(), histogram.begin());
  p.expert_offsets.resize(static_cast<std::size_t>(num_experts) + 1);
  thrust::for_each(policy, thrust::counting_iterator<int>(0), thrust::counting_iterator<int>(num_experts + 1),
                   kernels::ExpertOffsets{thrust::raw_pointer_cast(histogram.data()),
                                          thrust::raw_pointer_cast(p.expert_offsets.data()), chunks, num_experts,
                                          static_cast<std::int32_t>(slots)});
  p.source_token.resize(slots);
  p.row_of_slot.resize(slots);
  thrust::for_each(policy, thrust::counting_iterator<int>(0), thrust::counting_iterator<int>(chunks),
                   kernels::PlaceChunk{id, thrust::raw_pointer_cast(histogram.data()),
                                       thrust::raw_pointer_cast(p.source_token.data()),
                                       thrust::raw_pointer_cast(p.row_of_slot.data()), static_cast<long>(slots), chunk,
                                       num_experts, chunks, topk});
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

// tokens [tokens, hidden] -> out [rows, hidden], expert-major, into a buffer the caller keeps
// across steps (a fresh Thrust vector is zero-filled first: one more write of the whole output).
template <class T, class Backend = ThrustDeviceBackend>
void permute_tokens(const typename Backend::template vector<T>& tokens, long hidden, const ExpertPermutation<Backend>& p,
                    typename Backend::template vector<T>& out) {
  mrr::detail::require(tokens.size() == static_cast<std::size_t>(p.tokens * hidden), "device::permute_tokens",
                       "'tokens' has ", tokens.size(), " values, expected [", p.tokens, ", ", hidden, "]");
  if (out.size() != static_cast<std::size_t>(p.rows() * hidden)) out.resize(static_cast<std::size_t>(p.rows() * hidden));
  const long chunks = kernels::gather_chunks_per_row(hidden, !Backend::is_device);
  thrust::for_each(Backend::policy(), thrust::counting_iterator<long>(0), thrust::counting_iterator<long>(p.rows() * chunks),
                   kernels::GatherRows<T>{thrust::raw_pointer_cast(tokens.data()),
                                          thrust::raw_pointer_cast(p.source_token.data()),
                                          thrust::raw_pointer_cast(out.data()), hidden, chunks});
}

// tokens [tokens, hidden] -> [rows, hidden], expert-major.
template <class T, class Backend = ThrustDeviceBackend>
typename Backend::template vector<T> permute_tokens(const typename Backend::template vector<T>& tokens, long hidden,
                                                    const ExpertPermutation<Backend>& p) {
  typename Backend::template vector<T> out;
  permute_tokens<T, Backend>(tokens, hidden, p, out);
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
