// RoutingReplay: the model-wide replay controller. It knows the mode, the current action, the
// rows of the micro-batch being run, and per layer the first-in-first-out queue of replayed ids
// that activation recomputation consumes. ReplayRouter binds one MoE layer's router to it.
#pragma once

#include <mrr/concepts.hpp>
#include <mrr/cpu/backend.hpp>
#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>
#include <mrr/replay/layout.hpp>
#include <mrr/replay/mode.hpp>
#include <mrr/replay/none_store.hpp>
#include <mrr/router/routing.hpp>
#include <mrr/tensor.hpp>

#include <cstdint>
#include <deque>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

MRR_NAMESPACE_BEGIN

// What to do with a real token that has no recorded route when replaying.
enum class MissingRoutes {
  error,                 // every token must have a route (R2: all were recorded)
  native_last_position,  // only a sequence's final token may lack one (R3: vLLM returns n-1 rows)
  native,                // route any token without a route natively
};

// TopKRouter<Scalar, Backend = CpuBackend> is declared in mrr/router/fwd.hpp (via concepts.hpp).

// The router a backend runs: what MoELayer and RoutingReplay take for it. TopKRouter on the CPU;
// a backend's header specialises it (mrr/thrust/backend_router.hpp: device::BackendRouter for
// every ThrustBackend).
template <class Backend, class Scalar>
struct RouterFor {
  static_assert(!sizeof(Backend*),
                "mrr::RouterFor<Backend, Scalar>: no router is registered for this backend; include the backend's "
                "router header (mrr/thrust/backend_router.hpp for mrr::ThrustBackend)");
};
template <class Scalar>
struct RouterFor<CpuBackend, Scalar> {
  using type = TopKRouter<Scalar>;
};
template <class Backend, class Scalar>
using router_for_t = typename RouterFor<Backend, Scalar>::type;

// A router whose logits and routing stay in a backend's memory (a GPU's, or Thrust's OpenMP
// system): RoutingReplay::route_resident moves only ids, to the host route store and back. An
// empty `found` passed to replay_resident means every row replays (the mask-free path).
template <class R>
concept ResidentRouter = requires(const R& r, const typename R::resident_logits& logits, const ExpertIds& ids,
                                  const std::vector<std::uint8_t>& found,
                                  const typename R::resident_routing& routing, ExpertIds& host_ids) {
  { r.num_experts() } -> std::convertible_to<int>;
  { r.topk() } -> std::convertible_to<int>;
  { r.resident_rows(logits) } -> std::convertible_to<long>;
  { r.route_resident(logits) } -> std::same_as<typename R::resident_routing>;
  { r.replay_resident(logits, ids, found) } -> std::same_as<typename R::resident_routing>;
  r.copy_ids_to_host(routing, host_ids);
};

struct ReplayStats {
  std::uint64_t recorded_rows = 0;
  std::uint64_t replayed_rows = 0;
  std::uint64_t native_rows = 0;  // real tokens routed natively while replaying
  // Replays (forward or recompute) in which every row had a route, so the router ran its
  // mask-free replay path (several times faster than the masked one on the CPU).
  std::uint64_t mask_free_replays = 0;
};

template <class Store>
class RoutingReplay {
  static_assert(RouteStoreOrNone<Store>,
                "RoutingReplay<Store>: Store must model mrr::RouteStore (shape(), record(layer, layout, ids), "
                "lookup(layer, layout, out, found), recorded_positions(uid)) or be mrr::NoRouteStore");

 public:
  RoutingReplay(ReplayMode mode, Store& store) : RoutingReplay(mode, store, default_missing(mode)) {}
  RoutingReplay(ReplayMode mode, Store& store, MissingRoutes missing)
      : mode_(mode),
        store_(&store),
        missing_(missing),
        queues_(static_cast<std::size_t>(store.shape().num_layers)),
        last_(queues_.size()) {}

  ReplayMode mode() const { return mode_; }
  RouterAction action() const { return action_; }
  const ReplayStats& stats() const { return stats_; }
  const Store& store() const { return *store_; }
  Store& store() { return *store_; }

  // Sets the action of the forwards that follow, as in the table of DESIGN.md section 2. Switching
  // between actor_update and actor_recompute keeps the queues (pipeline schedules interleave
  // forwards and backwards of different micro-batches); the no-gradient passes start empty.
  void begin_pass(TrainingPass pass) {
    set_action(action_for(mode_, pass), pass == TrainingPass::actor_update && recompute_);
    in_update_pass_ = pass == TrainingPass::actor_update;
    if (pass == TrainingPass::old_log_prob || pass == TrainingPass::ref_log_prob) clear_queues();
  }

  // Whether the actor update's backward recomputes activations (re-runs the routers): then each
  // update forward queues its replayed ids for the recompute that follows. Off by default, so a
  // trainer that keeps activations queues nothing (with it on, every update micro-batch's ids
  // would pile up until the next old-log-prob pass); a recompute with it off is a clear error.
  // Takes effect at once, also inside an actor_update pass already begun. `true` means every MoE
  // layer recomputes.
  void set_activation_recompute(bool on) {
    recompute_ = on;
    recomputed_.clear();
    if (in_update_pass_) queue_ = on;
  }
  // Only these layers' backwards recompute (Megatron's partial recomputation,
  // `recompute_num_layers` with `recompute_method` uniform or block): only they queue their ids,
  // so a layer that keeps its activations holds none between old-log-prob passes. An empty list
  // is set_activation_recompute(false). The list applies to set_action's queue_for_recompute too.
  void set_activation_recompute(std::span<const int> layers) {
    std::vector<std::uint8_t> recomputed(queues_.size(), 0);
    for (const int layer : layers) {
      check_layer(layer, "RoutingReplay::set_activation_recompute");
      recomputed[static_cast<std::size_t>(layer)] = 1;
    }
    set_activation_recompute(!layers.empty());
    if (!layers.empty()) recomputed_ = std::move(recomputed);
  }
  bool activation_recompute() const { return recompute_; }
  // Whether `layer` queues its replayed ids in the actor update (activation recompute on for it).
  bool activation_recompute(int layer) const {
    check_layer(layer, "RoutingReplay::activation_recompute");
    return recompute_ && recomputes(layer);
  }
  void clear_queues() {
    for (auto& q : queues_) q.clear();
    for (auto& l : last_)
      l = LastChange{};
  }

  // Undoes what `layer`'s last route call did to its recompute queue: a forward that fails after
  // its router ran (a later step failed here, or on another rank, and every rank throws) calls
  // it, so that the ids that forward queued do not stay for a later micro-batch's recompute to
  // take, and the ids a failed recompute took are queued again, in front, for the retry. Calling
  // it again, or after a route call that changed no queue (native, record), does nothing.
  // MoELayer::forward does this itself; a trainer that routes through ReplayRouter in its own
  // layer calls ReplayRouter::revert_forward when its forward fails.
  void revert_route(int layer) {
    check_layer(layer, "RoutingReplay::revert_route");
    auto& queue = queues_[static_cast<std::size_t>(layer)];
    LastChange& last = last_[static_cast<std::size_t>(layer)];
    if (last.kind == LastChange::queued && !queue.empty()) queue.pop_back();
    if (last.kind == LastChange::popped) queue.push_front(std::move(last.entry));
    last = LastChange{};
  }

  // Low level (Megatron's set_global_router_replay_action). queue_for_recompute: replay_forward
  // keeps its ids for a later replay_backward (only when the backward recomputes activations).
  void set_action(RouterAction action, bool queue_for_recompute = true) {
    if (mode_ == ReplayMode::disabled && action != RouterAction::native)
      throw ConfigError(detail::str("router replay is disabled; action ", to_string(action), " needs mode R2 or R3"));
    action_ = action;
    queue_ = queue_for_recompute;
    in_update_pass_ = false;  // begin_pass sets it after this call
  }

  // The rows of the micro-batch whose forwards follow.
  void set_micro_batch(TokenLayout layout) {
    layout_ = std::move(layout);
    // Its padding rows, once per micro-batch (not per layer): empty when it has none.
    layout_padding_.clear();
    if (layout_.real_tokens() != layout_.size()) {
      layout_padding_.resize(layout_.size());
      for (std::size_t r = 0; r < layout_.size(); ++r) layout_padding_[r] = layout_[r].is_padding() ? 1 : 0;
    }
  }
  const TokenLayout& micro_batch() const { return layout_; }

  // Ids queued for recomputation in `layer`.
  std::size_t queued(int layer) const {
    check_layer(layer, "RoutingReplay::queued");
    return queues_[static_cast<std::size_t>(layer)].size();
  }

  // Throws unless `layer` is one of the store's MoE layers.
  void check_layer(int layer, const char* fn) const {
    const RouteShape& shape = store_->shape();
    detail::require(layer >= 0 && layer < shape.num_layers, fn, "layer ", layer, " outside the store's [0, ",
                    shape.num_layers, ")");
  }

  // Padding rows of the micro-batch are never recorded or used, so their logits may hold
  // anything (a trainer's uninitialised or NaN-filled padding): they are routed as zeros, and a
  // NaN there is not the error it is in a real token's row.
  // A recompute (replay_backward) takes the padding rows of the forward it replays, which it
  // queued, not the current micro-batch's: in a schedule F1 F2 B1 B2 the layout is F2's during B1.
  template <Router R>
  Routing<typename R::scalar_type> route(const R& router, int layer, MatrixRef<typename R::scalar_type> logits) {
    using S = typename R::scalar_type;
    constexpr const char* fn = "RoutingReplay::route";
    const std::span<const std::uint8_t> padding = padding_rows(layer, logits.rows());
    if (!padding_rows_finite(logits, padding)) {
      RowMatrix<S> clean = logits;
      for (std::size_t r = 0; r < padding.size(); ++r)
        if (padding[r] != 0) clean.row(static_cast<Eigen::Index>(r)).setZero();
      return route_with(HostLogits<R>{router, clean}, layer, fn);
    }
    return route_with(HostLogits<R>{router, logits}, layer, fn);
  }

  // The same, for logits resident in a backend's memory (a ResidentRouter, e.g.
  // device::BackendRouter with Thrust vectors): the routing stays there; recorded ids are copied
  // to the host store (through pinned buffers on CUDA), replayed ids from it.
  template <ResidentRouter R>
  typename R::resident_routing route_resident(const R& router, int layer, const typename R::resident_logits& logits) {
    return route_with(ResidentLogits<R>{router, logits}, layer, "RoutingReplay::route_resident");
  }

  // The padding rows (1) of the forward of `layer` that routes `rows` rows next: the queued
  // forward's for a recompute, else the micro-batch layout's; empty when unknown or none.
  // MoELayer reads them to treat a non-finite padding row of its input as zeros.
  std::span<const std::uint8_t> padding_rows(int layer, long rows) const {
    const std::vector<std::uint8_t>* padding = &layout_padding_;
    if (action_ == RouterAction::replay_backward) {
      if (layer < 0 || static_cast<std::size_t>(layer) >= queues_.size() ||
          queues_[static_cast<std::size_t>(layer)].empty())
        return {};
      padding = &queues_[static_cast<std::size_t>(layer)].front().padding;
    }
    return padding->size() == static_cast<std::size_t>(rows) ? std::span<const std::uint8_t>(*padding)
                                                             : std::span<const std::uint8_t>{};
  }

 private:
  // How route_with reaches one router call's logits: host matrices, or a backend's memory where
  // only ids cross to the host store.
  template <class R>
  struct HostLogits {
    const R& router;
    MatrixRef<typename R::scalar_type> logits;
    long rows() const { return static_cast<long>(logits.rows()); }
    Routing<typename R::scalar_type> route() const { return router.route(logits); }
    Routing<typename R::scalar_type> replay(const ExpertIds& ids, const std::vector<std::uint8_t>& mask) const {
      return router.replay(logits, ids, mask);
    }
    static const ExpertIds& host_ids(const Routing<typename R::scalar_type>& routing) { return routing.ids; }
  };
  template <class R>
  struct ResidentLogits {
    const R& router;
    const typename R::resident_logits& logits;
    long rows() const { return router.resident_rows(logits); }
    typename R::resident_routing route() const { return router.route_resident(logits); }
    typename R::resident_routing replay(const ExpertIds& ids, const std::vector<std::uint8_t>& mask) const {
      return router.replay_resident(logits, ids, mask);
    }
    ExpertIds host_ids(const typename R::resident_routing& routing) const {
      ExpertIds ids;
      router.copy_ids_to_host(routing, ids);
      return ids;
    }
  };

  // The current action around one router call: route natively, route and record, replay the
  // store's ids (replay_forward, queued for a recompute when asked) or the queue's oldest
  // (replay_backward). The one body behind route and route_resident.
  template <class Logits>
  auto route_with(const Logits& in, int layer, const char* fn) {
    if (action_ == RouterAction::native) {
      if (layer >= 0 && static_cast<std::size_t>(layer) < last_.size()) last_[static_cast<std::size_t>(layer)] = {};
      return in.route();
    }
    check_router(in.router, layer, fn);
    LastChange& last = last_[static_cast<std::size_t>(layer)];
    last = LastChange{};
    if (action_ == RouterAction::replay_backward) {
      // Taken only once the replay succeeded: a recompute that fails leaves the queue as it was.
      auto& queue = queues_[static_cast<std::size_t>(layer)];
      check_queued(layer, in.rows(), fn);
      auto routing = in.replay(queue.front().ids, replay_mask(queue.front()));
      last.entry = std::move(queue.front());
      last.kind = LastChange::popped;
      queue.pop_front();
      return routing;
    }
    check_layout_rows(layer, in.rows(), fn);
    if (action_ == RouterAction::record) {
      auto routing = in.route();
      store_->record(layer, layout_, in.host_ids(routing));
      stats_.recorded_rows += layout_.real_tokens();
      return routing;
    }
    Queued q = lookup_replayed(layer, queue_ && recomputes(layer));  // replay_forward
    auto routing = in.replay(q.ids, replay_mask(q));
    if (queue_ && recomputes(layer)) {
      // The recompute must take every row as this forward routed it: the rows this forward routed
      // natively (no recorded route: R3's last position, allowed misses) are pinned to the ids it
      // chose, not routed again from the recompute's logits. Padding rows stay native (zeros).
      if (!q.all_found) pin_native_rows(q, in.host_ids(routing));
      queues_[static_cast<std::size_t>(layer)].push_back(std::move(q));
      last.kind = LastChange::queued;
    }
    return routing;
  }

  template <class R>
  void check_router(const R& router, int layer, const char* fn) const {
    check_layer(layer, fn);
    const RouteShape& shape = store_->shape();
    detail::require(router.num_experts() == shape.num_experts && router.topk() == shape.topk, fn, "layer ", layer,
                    ": the router has ", router.num_experts(), " experts and k=", router.topk(), " but the store holds ",
                    shape.to_string());
  }

  // False when a padding row holds a NaN or infinity.
  template <class S>
  static bool padding_rows_finite(const MatrixRef<S>& logits, std::span<const std::uint8_t> padding) {
    for (std::size_t r = 0; r < padding.size(); ++r)
      if (padding[r] != 0 && !logits.row(static_cast<Eigen::Index>(r)).allFinite()) return false;
    return true;
  }

  struct Queued {
    ExpertIds ids;
    std::vector<std::uint8_t> found;
    bool all_found = false;             // every row has a route (no padding, none missing)
    std::vector<std::uint8_t> padding;  // the forward's padding rows (1), empty when none
  };

  // The mask a replay passes its router: none when every row has a route, so the router takes
  // its mask-free path (same ids and weights, several times faster), else `found`.
  const std::vector<std::uint8_t>& replay_mask(const Queued& q) {
    static const std::vector<std::uint8_t> none;
    if (!q.all_found) return q.found;
    ++stats_.mask_free_replays;
    return none;
  }

  // replay_backward takes the oldest ids queued by replay_forward in `layer`: they must exist and
  // be for a forward of `rows`.
  void check_queued(int layer, long rows, const char* fn) const {
    const auto& queue = queues_[static_cast<std::size_t>(layer)];
    if (queue.empty())
      throw RouteStoreError(detail::str(
          "mrr::", fn, ": layer ", layer,
          " has no queued routes to recompute with: replay_backward consumes, in order, the ids of earlier "
          "replay_forward calls of the same layer",
          !recompute_ ? "; activation recompute is off (the default), so the actor update queued nothing: call "
                        "set_activation_recompute(true) before the actor_update pass when the backward recomputes"
          : !recomputes(layer)
              ? "; this layer is not among those set_activation_recompute(layers) named, so it queued nothing: "
                "name every layer whose backward recomputes"
              : ""));
    detail::require(queue.front().ids.rows() == rows, fn, "layer ", layer, ": the recomputed forward has ", rows,
                    " rows but the forward it replays had ", queue.front().ids.rows(),
                    " (recompute must follow the forward order)");
  }

  void check_layout_rows(int layer, long rows, const char* fn) const {
    detail::require(layout_.size() == static_cast<std::size_t>(rows), fn, "layer ", layer, ": logits have ", rows,
                    " rows but the micro-batch layout has ", layout_.size(), " (call set_micro_batch before the forward)");
  }

  // replay_forward: the micro-batch's recorded ids in `layer` (a miss is an error unless allowed).
  Queued lookup_replayed(int layer, bool queued) {
    Queued q;
    q.all_found = store_->lookup(layer, layout_, q.ids, q.found) == layout_.size();
    check_missing(layer, q.found);
    if (queued) q.padding = layout_padding_;
    return q;
  }

  void pin_native_rows(Queued& q, const ExpertIds& routed) const {
    bool all = true;
    for (std::size_t r = 0; r < q.found.size(); ++r) {
      if (q.found[r] != 0) continue;
      if (layout_[r].is_padding()) {
        all = false;
        continue;
      }
      const auto row = static_cast<Eigen::Index>(r);
      q.ids.row(row) = routed.row(row);
      q.found[r] = 1;
    }
    q.all_found = all;
  }

  static MissingRoutes default_missing(ReplayMode mode) {
    return mode == ReplayMode::R3 ? MissingRoutes::native_last_position : MissingRoutes::error;
  }

  void check_missing(int layer, const std::vector<std::uint8_t>& found) {
    for (std::size_t r = 0; r < found.size(); ++r) {
      const TokenKey key = layout_[r];
      if (key.is_padding()) continue;
      if (found[r] != 0) {
        ++stats_.replayed_rows;
        continue;
      }
      const bool allowed =
          missing_ == MissingRoutes::native ||
          (missing_ == MissingRoutes::native_last_position && store_->recorded_positions(key.uid) == key.position &&
           key.position > 0);
      if (!allowed)
        throw RouteStoreError(detail::str(
            "mrr::RoutingReplay::route: layer ", layer, ": no recorded route for sequence ", key.uid, " position ",
            key.position, " (", store_->recorded_positions(key.uid), " positions recorded for it) in mode ",
            to_string(mode_), "; a replay must not silently fall back to native routing"));
      ++stats_.native_rows;
    }
  }

  // Whether `layer` queues when queue_ is set: every layer, or those named to recompute.
  bool recomputes(int layer) const { return recomputed_.empty() || recomputed_[static_cast<std::size_t>(layer)] != 0; }

  ReplayMode mode_;
  Store* store_;
  MissingRoutes missing_;
  RouterAction action_ = RouterAction::native;
  bool queue_ = true;
  bool recompute_ = false;
  std::vector<std::uint8_t> recomputed_;  // per layer, 1: recomputes; empty: every layer does
  bool in_update_pass_ = false;  // the action came from begin_pass(actor_update)
  TokenLayout layout_;
  std::vector<std::uint8_t> layout_padding_;  // layout_'s padding rows (1), empty when none
  std::vector<std::deque<Queued>> queues_;
  // Per layer, what its last route call did to its queue, for revert_route.
  struct LastChange {
    enum Kind : std::uint8_t { none, queued, popped } kind = none;
    Queued entry;  // the entry a recompute took
  };
  std::vector<LastChange> last_;
  ReplayStats stats_;
};

// With the none store there is nothing to record or replay: every call is the router's own.
template <>
class RoutingReplay<NoRouteStore> {
 public:
  RoutingReplay() = default;
  explicit RoutingReplay(ReplayMode mode) {
    if (mode != ReplayMode::disabled)
      throw ConfigError(detail::str("router replay mode ", to_string(mode),
                                    " needs a route store; NoRouteStore supports mode disabled only"));
  }
  ReplayMode mode() const { return ReplayMode::disabled; }
  RouterAction action() const { return RouterAction::native; }
  void check_layer(int, const char*) const {}  // no store: any layer routes natively
  void begin_pass(TrainingPass) {}
  void set_micro_batch(const TokenLayout&) {}
  void revert_route(int) {}
  std::span<const std::uint8_t> padding_rows(int, long) const { return {}; }

  template <Router R>
  Routing<typename R::scalar_type> route(const R& router, int, MatrixRef<typename R::scalar_type> logits) const {
    return router.route(logits);
  }
  template <ResidentRouter R>
  typename R::resident_routing route_resident(const R& router, int, const typename R::resident_logits& logits) const {
    return router.route_resident(logits);
  }
};

// One MoE layer's router bound to the model's replay controller: the one way a router meets
// replay (MoELayer routes through it). With Store = NoRouteStore it may be built without a
// controller and routes natively (RoutingReplay<NoRouteStore> compiles replay out).
template <Router R, class Store = NoRouteStore>
class ReplayRouter {
 public:
  using scalar_type = typename R::scalar_type;

  ReplayRouter(R router, RoutingReplay<Store>& replay, int layer)
      : router_(std::move(router)), replay_(&replay), layer_(layer) {}
  explicit ReplayRouter(R router)
    requires std::is_same_v<Store, NoRouteStore>
      : router_(std::move(router)), replay_(&disabled()), layer_(0) {}

  Routing<scalar_type> forward(MatrixRef<scalar_type> logits) { return replay_->route(router_, layer_, logits); }
  RowMatrix<scalar_type> backward(MatrixRef<scalar_type> logits, const Routing<scalar_type>& routing,
                                  MatrixRef<scalar_type> grad_weights) const {
    return router_.backward(logits, routing, grad_weights);
  }

  // The padding rows (1) of this layer's next forward of `rows` rows (RoutingReplay::padding_rows).
  std::span<const std::uint8_t> padding_rows(long rows) const { return replay_->padding_rows(layer_, rows); }

  // After a forward that fails once this router ran: see RoutingReplay::revert_route.
  void revert_forward() { replay_->revert_route(layer_); }

  // Throws unless the layer is one of the controller's store's layers (always passes without one).
  void check_layer(const char* fn) const { replay_->check_layer(layer_, fn); }

  const R& router() const { return router_; }
  R& router() { return router_; }
  int layer() const { return layer_; }

 private:
  // Stateless, so one instance serves every unbound router on every thread.
  static RoutingReplay<NoRouteStore>& disabled() {
    static RoutingReplay<NoRouteStore> none;
    return none;
  }

  R router_;
  RoutingReplay<Store>* replay_;
  int layer_;
};

MRR_NAMESPACE_END
