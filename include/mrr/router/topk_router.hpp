// TopKRouter: token -> k experts with Megatron-Core / Hugging Face semantics (softmax, sigmoid
// and sqrt-softplus scores; pre/post-softmax; group limits; selection-only expert bias;
// normalisation; scaling; capacity), replay of given ids with weights recomputed from the current
// logits (DESIGN.md section 3), and the exact gradient of the weights w.r.t. the logits.
// The row algorithms are the kernels every backend runs (mrr/kernels/router.hpp); this is their
// CPU executor: rows in fixed tiles over OpenMP threads (bits independent of the thread count),
// with two host specialisations that give the kernels' results faster: the selection scores
// through Eigen's vectorised exp, and the weights of a whole tile at once (weights_tile, and the
// float softmax of detail/softmax_tile.hpp with its AVX2 variant).
#pragma once

#include <mrr/cpu/backend.hpp>
#include <mrr/detail/config.hpp>
#include <mrr/detail/group_select.hpp>
#include <mrr/detail/parallel.hpp>
#include <mrr/detail/softmax_tile.hpp>
#include <mrr/detail/vexp.hpp>
#include <mrr/error.hpp>
#include <mrr/kernels/router.hpp>
#include <mrr/router/capacity.hpp>
#include <mrr/router/config.hpp>
#include <mrr/router/fwd.hpp>
#include <mrr/router/params.hpp>
#include <mrr/router/routing.hpp>
#include <mrr/router/row_error.hpp>
#include <mrr/tensor.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

MRR_NAMESPACE_BEGIN

// The CPU executor (Backend = CpuBackend, the default); ThrustBackend<S> specialises it
// (mrr/thrust/routing.hpp).
template <class Scalar, class Backend>
class TopKRouter {
  static_assert(std::is_floating_point_v<Scalar>, "TopKRouter<Scalar>: Scalar must be float or double");
  static_assert(std::is_same_v<Backend, CpuBackend>,
                "mrr::TopKRouter<T, Backend>: no router for this backend (ThrustBackend's is in mrr/thrust/routing.hpp)");

 public:
  using scalar_type = Scalar;

  explicit TopKRouter(RouterConfig config) : config_(std::move(config)) {
    config_.validate();
    detail::require(!config_.pad_to_capacity, "TopKRouter",
                    "pad_to_capacity is for the dense apply_token_dropping: a padded "
                    "expert takes tokens not routed to it, which [tokens, k] ids cannot hold; this router drops "
                    "over-capacity slots without padding");
    params_ = resolve_router_params(config_);
    if (config_.use_expert_bias) expert_bias_ = Vector<Scalar>::Zero(config_.num_experts);
  }

  const RouterConfig& config() const { return config_; }
  int num_experts() const { return config_.num_experts; }
  int topk() const { return config_.topk; }

  // Selection-only bias (empty unless config().use_expert_bias).
  const Vector<Scalar>& expert_bias() const { return expert_bias_; }
  void set_expert_bias(VectorRef<Scalar> bias) {
    detail::require(config_.use_expert_bias, "TopKRouter::set_expert_bias", "the config has use_expert_bias = false");
    detail::require(bias.size() == num_experts(), "TopKRouter::set_expert_bias", "bias has ", bias.size(),
                    " entries for ", num_experts(), " experts");
    for (Eigen::Index e = 0; e < bias.size(); ++e)
      detail::require(std::isfinite(bias[e]), "TopKRouter::set_expert_bias", "bias[", e, "] is not finite");
    expert_bias_ = bias;
  }

  // Native routing of every row of logits [tokens, num_experts].
  Routing<Scalar> route(MatrixRef<Scalar> logits) const {
    Routing<Scalar> out;
    route_into(out, logits);
    return out;
  }

  // The same into `out`, reusing its storage when the shapes already match (a training loop's
  // steady state allocates nothing).
  void route_into(Routing<Scalar>& out, MatrixRef<Scalar> logits) const { route_rows(out, logits, nullptr, {}); }

  // Replays `ids` [tokens, k] (global ids), recomputing the weights from `logits`; expert bias and
  // group limits only affect selection, so they play no part here. Only the logits the weights
  // read are validated (NaN or +inf there is an error), except under unrenormalised pre-softmax,
  // whose denominator reads the whole row; ids must be in range and distinct within a row.
  Routing<Scalar> replay(MatrixRef<Scalar> logits, ExpertIdsRef ids) const {
    Routing<Scalar> out;
    replay_into(out, logits, ids);
    return out;
  }
  void replay_into(Routing<Scalar>& out, MatrixRef<Scalar> logits, ExpertIdsRef ids) const {
    route_rows(out, logits, &ids, {});
  }

  // Replays the rows whose replay_mask is non-zero and routes the others natively (rollout engines
  // return no route for the last generated token). An empty mask replays every row, as the
  // overload without one does (RoutingReplay passes none when every row has a route).
  Routing<Scalar> replay(MatrixRef<Scalar> logits, ExpertIdsRef ids, std::span<const std::uint8_t> replay_mask) const {
    Routing<Scalar> out;
    replay_into(out, logits, ids, replay_mask);
    return out;
  }
  void replay_into(Routing<Scalar>& out, MatrixRef<Scalar> logits, ExpertIdsRef ids,
                   std::span<const std::uint8_t> replay_mask) const {
    detail::require(replay_mask.empty() || static_cast<Eigen::Index>(replay_mask.size()) == logits.rows(),
                    "TopKRouter::replay", "'replay_mask' has ", replay_mask.size(), " entries for ", logits.rows(),
                    " rows of logits (an empty mask replays every row)");
    route_rows(out, logits, &ids, replay_mask);
  }

  // Gradient of sum(grad_weights * routing.weights) w.r.t. the logits, for the ids in `routing`
  // (native or replayed alike: the weights are the same function of logits and ids). Dropped
  // slots carry no gradient.
  RowMatrix<Scalar> backward(MatrixRef<Scalar> logits, const Routing<Scalar>& routing,
                             MatrixRef<Scalar> grad_weights) const {
    RowMatrix<Scalar> grad(logits.rows(), num_experts());
    backward_into(grad, logits, routing.ids, grad_weights, routing.has_capacity_mask() ? routing.kept.data() : nullptr);
    return grad;
  }

  // The same on memory the caller holds (a torch trainer's tensors: no Routing, no copy of the
  // ids): grad [tokens, E] is overwritten; kept [tokens, k] row-major, or null when nothing was
  // dropped. An id out of range or repeated is an error naming its row.
  void backward_into(Eigen::Ref<RowMatrix<Scalar>> grad, MatrixRef<Scalar> logits, ExpertIdsRef ids,
                     MatrixRef<Scalar> grad_weights, const std::uint8_t* kept = nullptr) const {
    constexpr const char* fn = "TopKRouter::backward";
    check_logits(logits, fn);
    const int k = topk();
    detail::require(ids.rows() == logits.rows() && ids.cols() == k, fn, "routing ids have shape ", detail::shape_of(ids),
                    " for logits ", detail::shape_of(logits), " and topk ", k);
    detail::require(grad_weights.rows() == logits.rows() && grad_weights.cols() == k, fn, "'grad_weights' has shape ",
                    detail::shape_of(grad_weights), ", expected [", logits.rows(), ", ", k, "]");
    detail::require(grad.rows() == logits.rows() && grad.cols() == num_experts(), fn, "'grad' has shape ",
                    detail::shape_of(grad), ", expected [", logits.rows(), ", ", num_experts(), "]");
    std::vector<Scalar> g(static_cast<std::size_t>(k)), w(static_cast<std::size_t>(k));
    for (Eigen::Index t = 0; t < logits.rows(); ++t) {
      const std::int32_t* row_ids = detail::row_ptr(ids, t);
      const std::uint8_t* row_kept = kept != nullptr ? kept + t * k : nullptr;
      const auto status = kernels::backward_row(params_, detail::row_ptr(logits, t), row_ids,
                                                detail::row_ptr(grad_weights, t), row_kept, &grad(t, 0), g.data(),
                                                w.data());
      if (status != kernels::row_ok) [[unlikely]]
        detail::reject_invalid_ids(row_ids, k, num_experts(), t, fn);
    }
  }

  // Sign-based expert-bias update (aux-loss-free balancing): experts above the mean load are
  // pushed down by the update rate, those below pushed up.
  template <class Count>
  void update_expert_bias(std::span<const Count> tokens_per_expert) {
    constexpr const char* fn = "TopKRouter::update_expert_bias";
    detail::require(config_.use_expert_bias, fn, "the config has use_expert_bias = false");
    detail::require(static_cast<int>(tokens_per_expert.size()) == num_experts(), fn, "'tokens_per_expert' has ",
                    tokens_per_expert.size(), " entries for ", num_experts(), " experts");
    Vector<Scalar> counts(num_experts());
    for (int e = 0; e < num_experts(); ++e) {
      counts[e] = static_cast<Scalar>(tokens_per_expert[e]);
      detail::require(std::isfinite(counts[e]) && counts[e] >= 0, fn, "'tokens_per_expert' has ", counts[e],
                      " for expert ", e, " (a count must be finite and >= 0)");
    }
    expert_bias_ = updated_expert_bias<Scalar>(counts, expert_bias_, config_.expert_bias_update_rate);
  }

  // Megatron get_updated_expert_bias: bias + sign(mean(counts) - counts) * rate.
  template <class T>
  static Vector<T> updated_expert_bias(VectorRef<T> tokens_per_expert, VectorRef<T> bias, double update_rate) {
    detail::require(tokens_per_expert.size() == bias.size(), "updated_expert_bias", "'tokens_per_expert' has ",
                    tokens_per_expert.size(), " entries but 'expert_bias' has ", bias.size());
    const T mean = tokens_per_expert.sum() / static_cast<T>(tokens_per_expert.size());
    Vector<T> out(bias.size());
    for (Eigen::Index e = 0; e < bias.size(); ++e) {
      const T offset = mean - tokens_per_expert[e];
      const T sign = offset > T(0) ? T(1) : (offset < T(0) ? T(-1) : T(0));
      out[e] = bias[e] + sign * static_cast<T>(update_rate);
    }
    return out;
  }

 private:
  void check_logits(const MatrixRef<Scalar>& logits, const char* fn) const {
    detail::require(logits.cols() == num_experts(), fn, "logits have shape ", detail::shape_of(logits),
                    " but the router has ", num_experts(), " experts");
  }

  // Per-chunk scratch, so rows allocate nothing; replay needs only the tile.
  struct Workspace {
    std::vector<Scalar> scores, values, group_scores;
    std::vector<int> indices, candidates;
    std::vector<Scalar> row_scale;
    std::vector<Scalar> slot_major;      // float softmax weights: the tile's logits, slot-major
    std::vector<std::int32_t> slot_ids;  // and its replayed ids (duplicate check)
    Workspace(const RouterConfig& c, bool selects, bool slot_major_tile)
        : slot_major(slot_major_tile ? static_cast<std::size_t>(c.topk) * detail::kSoftmaxTileRows : 0),
          slot_ids(slot_major.size()) {
      if (!selects) return;
      const auto e = static_cast<std::size_t>(c.num_experts), g = static_cast<std::size_t>(c.num_groups);
      const auto m = static_cast<std::size_t>(c.effective_group_score_topk());
      scores.resize(e);
      values.resize(std::max({static_cast<std::size_t>(c.topk), g, m}));
      group_scores.resize(g);
      indices.resize(std::max(g, m));
      candidates.resize(e);
    }
    kernels::SelectScratch<Scalar> select() {
      return {scores.data(), values.data(), group_scores.data(), indices.data(), candidates.data()};
    }
  };

  // Rows per tile: tile boundaries depend on the row index only, so the vectorised weight pass
  // computes the same bits for any number of threads.
  static constexpr std::int64_t kTileRows = detail::kSoftmaxTileRows;
  static constexpr std::int64_t kChunkRows = 8 * kTileRows;

  // Replay reads only z[ids] unless the weights are unrenormalised pre-softmax probabilities.
  bool replay_reads_whole_row() const { return params_.replay_reads_whole_row(); }

  // Float weights that are a softmax over the k chosen logits take detail::softmax_slot_major.
  bool softmax_over_slots() const {
    return std::is_same_v<Scalar, float> && config_.score_function == ScoreFunction::softmax &&
           !replay_reads_whole_row();
  }

  void route_rows(Routing<Scalar>& out, const MatrixRef<Scalar>& logits, const ExpertIdsRef* replay_ids,
                  std::span<const std::uint8_t> replay_mask) const {
    const char* fn = replay_ids ? "TopKRouter::replay" : "TopKRouter::route";
    check_logits(logits, fn);
    const int k = topk();
    const int num_e = num_experts();
    const Eigen::Index rows = logits.rows();
    if (replay_ids)
      detail::require(replay_ids->rows() == rows && replay_ids->cols() == k, fn, "'ids' has shape ",
                      detail::shape_of(*replay_ids), ", expected [", rows, ", ", k, "]");
    out.ids.resize(rows, k);
    out.weights.resize(rows, k);
    out.kept.resize(0, 0);
    const bool whole_row = replay_reads_whole_row();
    const std::int64_t work = static_cast<std::int64_t>(rows) * (replay_ids && !whole_row ? 4 * k : num_e + 4 * k);
    const bool slot_major = softmax_over_slots();
    const bool replay_all = replay_ids && replay_mask.empty();
    const bool selects = !replay_all;
    // Where a row's gathered logits go: slot-major in the workspace tile for the float softmax
    // kernel, else in place in out.weights for weights_tile.
    const std::int64_t row_step = slot_major ? 1 : k, slot_step = slot_major ? kTileRows : 1;
    const Scalar scale = config_.scaling_factor ? static_cast<Scalar>(*config_.scaling_factor) : Scalar(1);
    // Threads take chunks of rows (one workspace each); the weight pass runs on tiles of
    // kTileRows inside a chunk, whose boundaries are multiples of kTileRows.
    detail::parallel_tiles(rows, kChunkRows, work, [&](std::int64_t, std::int64_t chunk_first, std::int64_t chunk_end) {
      Workspace ws(config_, selects, slot_major);
      for (std::int64_t first = chunk_first; first < chunk_end; first += kTileRows) {
        const std::int64_t end = std::min(chunk_end, first + kTileRows);
        Scalar* const sink = slot_major ? ws.slot_major.data() : &out.weights(first, 0);
        bool bad = false;
        // Rows [first, tile_first) are done by the fused replay kernel, which reports in `fused`.
        std::int64_t tile_first = first;
        unsigned fused = 0;
        if (replay_all && slot_major) {
          // Replay only: tight loops over the tile, no per-row dispatch; with k = 8 on AVX2, one
          // fused pass over each 8 rows, the rest (if any) through the tile.
          if constexpr (std::is_same_v<Scalar, float>)
            tile_first += detail::replay_softmax_fused(
                detail::row_ptr(logits, first), logits.outerStride(), detail::row_ptr(*replay_ids, first),
                replay_ids->outerStride(), k, num_e, static_cast<int>(end - first),
                static_cast<int>(std::min<std::int64_t>(rows - first, end - first + 8)), scale, &out.ids(first, 0),
                &out.weights(first, 0), fused);
          bad = (fused & detail::replay_fused_bad_ids) != 0;
          if (!bad && tile_first < end)
            bad = !gather_replayed_tile(logits, *replay_ids, tile_first, end, sink, out, ws);
        } else {
          for (Eigen::Index t = first; t < end; ++t) {
            const Scalar* z = detail::row_ptr(logits, t);
            std::int32_t* ids = &out.ids(t, 0);
            Scalar* w = sink + (t - first) * row_step;
            const bool replay_row =
                replay_ids && (replay_mask.empty() || replay_mask[static_cast<std::size_t>(t)] != 0);
            const std::int32_t* src = replay_row ? detail::row_ptr(*replay_ids, t) : nullptr;
            const auto status =
                replay_row ? kernels::check_replay_row(params_, z, src) : kernels::check_native_row(params_, z);
            if (status != kernels::row_ok) [[unlikely]] {
              bad = true;
              continue;
            }
            if (replay_row)
              for (int j = 0; j < k; ++j) ids[j] = src[j];
            else
              select_row(z, ids, ws);
            for (int j = 0; j < k; ++j) w[j * slot_step] = z[ids[j]];
          }
        }
        // An invalid row re-runs the checks one row at a time, which raise the precise error.
        if (bad) [[unlikely]]
          for (Eigen::Index t = first; t < end; ++t)
            diagnose_row(logits, replay_ids, replay_mask, t, fn);
        bool nan = false;
        if constexpr (std::is_same_v<Scalar, float>) {
          if (slot_major) {
            const unsigned status =
                fused | (tile_first < end ? detail::softmax_slot_major(ws.slot_major.data(), k,
                                                                       static_cast<int>(end - tile_first), scale,
                                                                       &out.weights(tile_first, 0))
                                          : 0u);
            if (status & detail::softmax_tile_invalid_logit) [[unlikely]]
              for (Eigen::Index t = first; t < end; ++t)
                diagnose_row(logits, replay_ids, replay_mask, t, fn);
            nan = (status & detail::softmax_tile_all_masked) != 0;
          }
        }
        if (!slot_major) {
          weights_tile(logits, out, first, end, ws);
          const Scalar* w = &out.weights(first, 0);
          for (std::int64_t i = 0; i < (end - first) * k; ++i) nan |= std::isnan(w[i]);
        }
        if (nan) [[unlikely]]
          for (Eigen::Index t = first; t < end; ++t) {
            const bool replay_row =
                replay_ids && (replay_mask.empty() || replay_mask[static_cast<std::size_t>(t)] != 0);
            detail::reject_nan_weights(&out.ids(t, 0), &out.weights(t, 0), k, t, replay_row, fn);
          }
      }
    });
    if (config_.capacity_factor)
      detail::drop_over_capacity_unchecked(out, num_e, *config_.capacity_factor, config_.drop_policy);  // own ids
  }

  // The same for the rows [first, end) of a replay without a mask, into the slot-major tile of
  // detail::softmax_slot_major (which checks the logits), with the ids copied to out.ids.
  bool gather_replayed_tile(const MatrixRef<Scalar>& logits, const ExpertIdsRef& replay_ids, Eigen::Index first,
                            Eigen::Index end, Scalar* tile, Routing<Scalar>& out, Workspace& ws) const {
    return detail::gather_slot_major(detail::row_ptr(logits, first), logits.outerStride(),
                                     detail::row_ptr(replay_ids, first), replay_ids.outerStride(), topk(),
                                     num_experts(), static_cast<int>(end - first), tile, ws.slot_ids.data(),
                                     &out.ids(first, 0));
  }

  // The checks of one row, in the order they are reported, throwing the first that fails.
  void diagnose_row(const MatrixRef<Scalar>& logits, const ExpertIdsRef* replay_ids,
                    std::span<const std::uint8_t> replay_mask, Eigen::Index t, const char* fn) const {
    const bool replay_row = replay_ids && (replay_mask.empty() || replay_mask[static_cast<std::size_t>(t)] != 0);
    detail::reject_bad_row(params_, detail::row_ptr(logits, t), replay_row ? detail::row_ptr(*replay_ids, t) : nullptr,
                           t, fn);
  }

  // Fills ids[0, k) for one token: kernels::select_row, with the selection scores computed by
  // the host specialisation below.
  void select_row(const Scalar* z, std::int32_t* ids, Workspace& ws) const {
    const kernels::SelectScratch<Scalar> scratch = ws.select();
    if (params_.selects_on_logits) {
      kernels::select_row(params_, z, static_cast<const Scalar*>(nullptr), ids, scratch);
      return;
    }
    compute_selection_scores(z, scratch.scores);
    if constexpr (std::is_same_v<Scalar, float>) {
      if (detail::group_select_applies(params_)) {  // grouped rows: the same ids, vectorised
        detail::select_grouped(params_, scratch.scores, ids, scratch.values, scratch.candidates);
        return;
      }
    }
    kernels::select_on_scores(params_, scratch.scores, ids, scratch);
  }

  // kernels::selection_scores on the host: the exponentials of sigmoid and of the pre-softmax
  // probabilities vectorised through Eigen (selection needs only their order).
  void compute_selection_scores(const Scalar* z, Scalar* scores) const {
    const int num_e = num_experts();
    switch (config_.score_function) {
      case ScoreFunction::softmax:
        if (config_.pre_softmax) {
          softmax(z, num_e, scores);
        } else {
          for (int e = 0; e < num_e; ++e) scores[e] = z[e];
        }
        break;
      case ScoreFunction::sigmoid:
        for (int e = 0; e < num_e; ++e)
          scores[e] = z[e];
        detail::sigmoid_each(scores, num_e);
        break;
      case ScoreFunction::sqrt_softplus:
        for (int e = 0; e < num_e; ++e) scores[e] = kernels::sqrt_softplus(z[e]);
        break;
    }
    if (config_.use_expert_bias)
      Eigen::Map<Eigen::Array<Scalar, Eigen::Dynamic, 1>>(scores, num_e) += expert_bias_.array();
  }

  static void softmax(const Scalar* z, int n, Scalar* out) {
    const Scalar mx = *std::max_element(z, z + n);
    for (int e = 0; e < n; ++e)
      out[e] = z[e] - mx;
    detail::exp_each(out, n);
    const Scalar sum = fixed_order_sum(out, n);
    for (int e = 0; e < n; ++e)
      out[e] /= sum;
  }

  // kernels::softmax_normalizer on the host (weights_tile's full-row softmax): (max, sum exp(z -
  // max)), the exponentials in chunks of a stack buffer.
  static std::pair<Scalar, Scalar> softmax_normalizer(const Scalar* z, int n) {
    const Scalar mx = *std::max_element(z, z + n);
    constexpr int kChunk = 256;
    Scalar buffer[kChunk];
    Scalar sum = 0;
    for (int first = 0; first < n; first += kChunk) {
      const int m = std::min(kChunk, n - first);
      for (int i = 0; i < m; ++i)
        buffer[i] = z[first + i] - mx;
      detail::exp_each(buffer, m);
      sum += fixed_order_sum(buffer, m);
    }
    return {mx, sum};
  }

  // The sum of x[0, n) in an order fixed by n: eight partial sums by index (element i goes to sum
  // i % 8, in index order), then added pairwise. The same bits whether or not the compiler
  // vectorises the loop, and wherever x sits.
  static Scalar fixed_order_sum(const Scalar* x, int n) {
    Scalar part[8] = {};
    int i = 0;
    for (; i + 8 <= n; i += 8)
      for (int l = 0; l < 8; ++l)
        part[l] += x[i + l];
    for (int l = 0; i < n; ++i, ++l)
      part[l] += x[i];
    return ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
  }

  // kernels::weights_row over the rows [first, end) at once (DESIGN.md section 3), in place: on
  // entry weights(t, j) holds the logit z[t, ids(t, j)]. The exponentials and scores run over the
  // whole tile, element by element (detail::exp_each); sums and maxima run per row in slot order.
  void weights_tile(const MatrixRef<Scalar>& logits, Routing<Scalar>& out, Eigen::Index first, Eigen::Index end,
                    Workspace& ws) const {
    using Array = Eigen::Array<Scalar, Eigen::Dynamic, 1>;
    const int k = topk();
    const Eigen::Index n = (end - first) * k;
    Scalar* w0 = &out.weights(first, 0);
    Eigen::Map<Array> tile(w0, n);
    std::vector<Scalar>& scale = ws.row_scale;  // per-row softmax denominators (full-row softmax)
    scale.resize(static_cast<std::size_t>(end - first));
    switch (config_.score_function) {
      case ScoreFunction::softmax: {
        const bool full_row = config_.pre_softmax && !config_.normalizes();
        for (Eigen::Index t = first; t < end; ++t) {
          Scalar* w = w0 + (t - first) * k;
          Scalar mx;
          if (full_row) {
            const auto [m, sum] = softmax_normalizer(detail::row_ptr(logits, t), num_experts());
            mx = m;
            scale[static_cast<std::size_t>(t - first)] = sum;
          } else {
            mx = w[0];
            for (int j = 1; j < k; ++j) mx = std::max(mx, w[j]);
          }
          for (int j = 0; j < k; ++j) w[j] -= mx;
        }
        // Each weight's bits depend on its own logits only (detail::exp_each), whichever tile it is in; a
        // masked (-inf) logit weighs exactly 0.
        detail::exp_each(w0, n);
        for (Eigen::Index t = first; t < end; ++t) {
          Scalar* w = w0 + (t - first) * k;
          Scalar sum = scale[static_cast<std::size_t>(t - first)];
          if (!full_row) {
            sum = 0;
            for (int j = 0; j < k; ++j) sum += w[j];
          }
          for (int j = 0; j < k; ++j) w[j] /= sum;
        }
        break;
      }
      case ScoreFunction::sigmoid:
      case ScoreFunction::sqrt_softplus: {
        if (config_.score_function == ScoreFunction::sigmoid)
          detail::sigmoid_each(w0, n);
        else
          for (Eigen::Index i = 0; i < n; ++i) w0[i] = score(w0[i]);
        if (config_.normalizes())
          for (Eigen::Index t = first; t < end; ++t) {
            Scalar* w = w0 + (t - first) * k;
            Scalar sum = 0;
            for (int j = 0; j < k; ++j) sum += w[j];
            const Scalar denom = sum + Scalar(1e-20);
            for (int j = 0; j < k; ++j) w[j] /= denom;
          }
        break;
      }
    }
    if (config_.scaling_factor) tile *= static_cast<Scalar>(*config_.scaling_factor);
  }

  Scalar score(Scalar x) const { return kernels::score_of(params_.score, x); }

  RouterConfig config_;
  kernels::RouterParams params_;
  Vector<Scalar> expert_bias_;
};

MRR_NAMESPACE_END
