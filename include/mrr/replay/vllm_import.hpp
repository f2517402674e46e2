// R3 sources from rollout engines: vLLM and SGLang return, per request, a routed_experts array
// [tokens, layers, k] of global expert ids for every token they ran through the model; the last
// generated token was never fed back, so there are num_tokens - 1 rows. Row i is position i.
#pragma once

#include <mrr/detail/checked.hpp>
#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>
#include <mrr/replay/layout.hpp>
#include <mrr/replay/npy.hpp>
#include <mrr/replay/shape.hpp>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <span>
#include <type_traits>
#include <vector>

MRR_NAMESPACE_BEGIN

// Throws, naming the entry, unless every id of routed_experts [tokens, layers, k] is in
// [0, num_experts) and each (token, layer) row's k ids are distinct (a top-k never repeats one).
template <class Int>
void check_routed_experts(std::span<const Int> routed_experts, std::int64_t layers, std::int64_t k, int num_experts,
                          SequenceId uid) {
  constexpr const char* fn = "import_routed_experts";
  const auto kk = static_cast<std::size_t>(k);
  const auto per_token = static_cast<std::size_t>(layers) * kk;
  const auto where = [&](std::size_t i) {
    return detail::str("routed_experts[", i / per_token, ", ", (i % per_token) / kk, ", ", i % kk, "]");
  };
  // seen[e] == row + 1 when expert e appeared in the current row (row numbers as stamps: no reset).
  std::vector<std::uint64_t> seen(static_cast<std::size_t>(num_experts), 0);
  for (std::size_t row = 0, i = 0; i < routed_experts.size(); ++row)
    for (std::size_t j = 0; j < kk; ++j, ++i) {
      const Int raw = routed_experts[i];
      bool in_range = static_cast<std::uint64_t>(raw) < static_cast<std::uint64_t>(num_experts);
      if constexpr (std::is_signed_v<Int>) in_range = in_range && raw >= 0;
      if (!in_range) {  // the value as the array holds it (a uint64 past int64 included)
        if constexpr (std::is_signed_v<Int>)
          detail::throw_invalid_argument(fn, "sequence ", uid, ": ", where(i), " = ", static_cast<long long>(raw),
                                         " is outside [0, ", num_experts, ")");
        else
          detail::throw_invalid_argument(fn, "sequence ", uid, ": ", where(i), " = ",
                                         static_cast<unsigned long long>(raw), " is outside [0, ", num_experts, ")");
      }
      const auto v = static_cast<std::int64_t>(raw);
      std::uint64_t& stamp = seen[static_cast<std::size_t>(v)];
      if (stamp == row + 1)
        detail::throw_invalid_argument(fn, "sequence ", uid, ": ", where(i), " = ", v,
                                       " repeats an expert of the same token and layer (a top-k lists k distinct "
                                       "experts); nothing of the sequence was stored");
      stamp = row + 1;
    }
}

// Stores a rollout's routes [tokens, layers, k] for sequence `uid` from position `first_position`
// (0 for a whole prompt + response) into any store with record_sequence. Shapes and ids are
// checked against the store first: a mismatch is an error naming the array and the field.
template <class Store, class Int>
void import_routed_experts(Store& store, SequenceId uid, std::span<const Int> routed_experts, std::int64_t tokens,
                           std::int64_t layers, std::int64_t k, std::int64_t first_position = 0) {
  constexpr const char* fn = "import_routed_experts";
  const RouteShape& s = store.shape();
  detail::require(layers == s.num_layers, fn, "sequence ", uid, ": routed_experts has ", layers,
                  " layers but the model has ", s.num_layers,
                  " MoE layers (an array with a row per decoder layer, dense ones included: give moe_layers)");
  detail::require(k == s.topk, fn, "sequence ", uid, ": routed_experts has k = ", k, " but the model routes to ", s.topk,
                  " experts per token");
  // An id type too narrow for the model (uint8 for 300 experts) can only come from a truncating
  // cast (verl's uint8 wrapped ids past 255): every id is suspect, in range or not.
  detail::require(
      static_cast<std::uint64_t>(std::numeric_limits<Int>::max()) >= static_cast<std::uint64_t>(s.num_experts - 1), fn,
      "sequence ", uid, ": routed_experts holds ", sizeof(Int) * 8, "-bit ",
      std::is_signed_v<Int> ? "signed" : "unsigned", " ids, which cannot hold the ids of the model's ", s.num_experts,
      " experts (a truncating cast?); export wider ids (int16 / int32)");
  std::size_t expect = 0;  // computed without overflow: a huge token count must not wrap to the span's size
  const bool fits = tokens >= 0 && detail::checked_product(expect, tokens, layers, k);
  detail::require(fits && routed_experts.size() == expect, fn, "sequence ", uid, ": routed_experts holds ",
                  routed_experts.size(), " values for shape [", tokens, ", ", layers, ", ", k, "]");
  // Every id in range, and no token listing an expert twice in a layer, before anything is
  // written: a route file is append-only, and a bad route in it could never be replayed, nor
  // corrected (a second import of the sequence differs from the first).
  check_routed_experts(routed_experts, layers, k, s.num_experts, uid);
  // uint8 / uint16 ids (vLLM's routed_experts for <= 256 / <= 65,536 experts) go to a store that
  // takes them as they are (FileRouteStore: encoded without widening).
  if constexpr (std::is_same_v<Int, std::uint8_t> || std::is_same_v<Int, std::uint16_t>) {
    if constexpr (requires { store.record_sequence(uid, first_position, tokens, 0, 1, routed_experts); }) {
      store.record_sequence(uid, first_position, tokens, 0, static_cast<int>(layers), routed_experts);
      return;
    }
  }
  std::vector<std::int32_t> ids(routed_experts.size());
  for (std::size_t i = 0; i < ids.size(); ++i)
    ids[i] = static_cast<std::int32_t>(routed_experts[i]);
  store.record_sequence(uid, first_position, tokens, 0, static_cast<int>(layers), ids);
}

// The same from an array with a row per decoder layer, dense ones included (SGLang's capturer
// fills [tokens, num_hidden_layers, k], zeros where a layer has no router; DeepSeek-V3's first
// three layers are dense): the model's MoE layer i is the array's layer moe_layers[i]. moe_layers
// must ascend, lie in [0, layers) and name as many layers as the model has MoE layers; the other
// layers' rows are not read. Empty: every layer of the array is a MoE layer.
template <class Store, class Int>
void import_routed_experts(Store& store, SequenceId uid, std::span<const Int> routed_experts, std::int64_t tokens,
                           std::int64_t layers, std::int64_t k, std::int64_t first_position,
                           std::span<const int> moe_layers) {
  if (moe_layers.empty())
    return import_routed_experts<Store, Int>(store, uid, routed_experts, tokens, layers, k, first_position);
  constexpr const char* fn = "import_routed_experts";
  const auto moe = static_cast<std::int64_t>(moe_layers.size());
  detail::require(moe == store.shape().num_layers, fn, "sequence ", uid, ": moe_layers names ", moe,
                  " layers but the model has ", store.shape().num_layers, " MoE layers");
  for (std::size_t i = 0; i < moe_layers.size(); ++i)
    detail::require(moe_layers[i] >= 0 && moe_layers[i] < layers && (i == 0 || moe_layers[i] > moe_layers[i - 1]), fn,
                    "sequence ", uid, ": moe_layers[", i, "] = ", moe_layers[i],
                    i == 0 ? "" : " does not follow the one before it or", " is outside the array's ", layers,
                    " layers [0, ", layers, ")");
  std::size_t expect = 0;
  const bool fits = tokens >= 0 && k >= 0 && detail::checked_product(expect, tokens, layers, k);
  detail::require(fits && routed_experts.size() == expect, fn, "sequence ", uid, ": routed_experts holds ",
                  routed_experts.size(), " values for shape [", tokens, ", ", layers, ", ", k, "]");
  const auto kk = static_cast<std::size_t>(k);
  std::vector<Int> picked(static_cast<std::size_t>(tokens) * moe_layers.size() * kk);
  for (std::size_t t = 0, at = 0; t < static_cast<std::size_t>(tokens); ++t)
    for (const int layer : moe_layers) {
      const Int* row =
          routed_experts.data() + (t * static_cast<std::size_t>(layers) + static_cast<std::size_t>(layer)) * kk;
      std::copy(row, row + kk, picked.data() + at);
      at += kk;
    }
  import_routed_experts<Store, Int>(store, uid, std::span<const Int>(picked), tokens, moe, k, first_position);
}

// The same from a .npy file as vLLM/SGLang users save it (np.save(path, routed_experts)).
template <class Store>
void import_routed_experts_npy(Store& store, SequenceId uid, const std::filesystem::path& npy,
                               std::int64_t first_position = 0, std::span<const int> moe_layers = {}) {
  // The ids in the file's own width (a uint8 file is imported as uint8, as from memory).
  visit_npy(
      npy, [&]<class Int>(std::span<const Int> values, const std::vector<std::int64_t>& shape, const std::string&) {
        detail::require(shape.size() == 3, "import_routed_experts_npy", npy.string(), " has ", shape.size(),
                        " dimensions; routed_experts is [tokens, layers, k]");
        import_routed_experts<Store, Int>(store, uid, values, shape[0], shape[1], shape[2], first_position, moe_layers);
      });
}

MRR_NAMESPACE_END
