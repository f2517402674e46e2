// MemoryRouteStore: routes kept in process memory, for R2 within one run and for R3 sources
// handed over by the rollout engine.
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>
#include <mrr/replay/layout.hpp>
#include <mrr/replay/route_table.hpp>
#include <mrr/replay/shape.hpp>
#include <mrr/tensor.hpp>

#include <cstdint>
#include <span>
#include <vector>

MRR_NAMESPACE_BEGIN

class MemoryRouteStore {
 public:
  explicit MemoryRouteStore(RouteShape shape) : table_(shape) {}

  const RouteShape& shape() const { return table_.shape(); }

  // Records the ids [layout rows, k] that `layer` chose for the rows of a micro-batch; padding
  // rows are skipped. All rows are checked (ids in range, agreement with earlier records and
  // between rows of the batch for the same token, the sparse bound) before any is stored.
  void record(int layer, const TokenLayout& layout, ExpertIdsRef ids) {
    constexpr const char* fn = "MemoryRouteStore::record";
    const std::vector<TokenRun> runs = table_.new_runs(layer, layout, ids, fn);
    added_.clear();
    for (const TokenRun& run : runs)
      added_.push_back({run.uid, run.first_position, run.first_position + static_cast<std::int64_t>(run.count), run.count});
    table_.check_sparse(added_, fn);
    const auto stride = static_cast<std::size_t>(ids.outerStride());
    for (const TokenRun& run : runs)
      table_.get_or_add(run.uid).put_run(run.first_position, run.count, layer,
                                         ids.data() + static_cast<Eigen::Index>(run.first_row) * ids.outerStride(),
                                         stride);
  }

  // Records a span of one sequence for a range of layers; ids are laid out [tokens][layers][k]
  // (the order of vLLM's and SGLang's routed_experts).
  void record_sequence(SequenceId uid, std::int64_t first_position, std::int64_t num_tokens, int first_layer,
                       int num_layers, std::span<const std::int32_t> ids) {
    constexpr const char* fn = "MemoryRouteStore::record_sequence";
    table_.check_block_extent(first_position, num_tokens, first_layer, num_layers, ids.size(), fn);
    if (!table_.new_block(uid, first_position, num_tokens, first_layer, num_layers, ids, fn)) return;
    added_.assign(1, {uid, first_position, first_position + num_tokens,
                      static_cast<std::uint64_t>(num_tokens) * static_cast<std::uint64_t>(num_layers)});
    table_.check_sparse(added_, fn);
    const auto k = static_cast<std::size_t>(shape().topk);
    SequenceRoutes& seq = table_.get_or_add(uid);
    for (int l = 0; l < num_layers; ++l)  // each layer's rows, strided through the block
      seq.put_run(first_position, static_cast<std::size_t>(num_tokens), first_layer + l,
                  ids.data() + static_cast<std::size_t>(l) * k, static_cast<std::size_t>(num_layers) * k);
  }

  // Fills out [layout rows, k] with the recorded ids of `layer` (-1 where none: all ones for
  // unsigned ids) and found[r] = 1 where row r has a route; returns how many rows do. Id: int32
  // (ExpertIds), int64, or uint16 / uint8 when every expert id fits (else std::invalid_argument).
  template <class Id>
  std::size_t lookup(int layer, const TokenLayout& layout, RowMatrix<Id>& out, std::vector<std::uint8_t>& found) const {
    return table_.lookup(layer, layout, out, found, "MemoryRouteStore::lookup");
  }

  // One past the last position recorded for the sequence (0 when unknown).
  std::int64_t recorded_positions(SequenceId uid) const {
    const SequenceRoutes* s = table_.find(uid);
    return s ? s->positions() : 0;
  }
  bool contains(SequenceId uid) const { return table_.find(uid) != nullptr; }
  std::size_t num_sequences() const { return table_.size(); }
  std::size_t memory_bytes() const { return table_.bytes(); }
  void erase(SequenceId uid) { table_.erase(uid); }
  void clear() { table_.clear(); }

 private:
  detail::RouteTable table_;
  std::vector<detail::SequenceExtent> added_;  // scratch of the sparse check
};

MRR_NAMESPACE_END
