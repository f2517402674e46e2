// mrr-requires: mrr_thrust_omp
// The Thrust backend as a router policy. device::BackendRouter<T, Backend> wraps
// device::TopKRouter and offers two faces:
//   - mrr::Router (host Eigen logits in, host Routing out): MoELayer and RoutingReplay take it
//     unchanged, the routing itself runs on the backend (logits up, ids and weights down);
//   - ResidentRouter (Thrust vectors in and out): RoutingReplay::route_resident routes logits that
//     already live on the backend, and only ids cross to the host route store and back.
// RouterFor<ThrustBackend<S>, T> names it, as RouterFor<CpuBackend, T> names TopKRouter.
// On CUDA, host <-> device copies go through pinned (page-locked) host staging buffers. On the
// OpenMP and host systems the backend's memory is host memory: the mrr::Router face hands the
// caller's Eigen buffers to the view API as they are (no copy), unless capacity dropping needs
// the owning path.
#pragma once

#include <mrr/concepts.hpp>
#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>
#include <mrr/replay/routing_replay.hpp>
#include <mrr/router/config.hpp>
#include <mrr/router/routing.hpp>
#include <mrr/tensor.hpp>
#include <mrr/thrust/backend.hpp>
#include <mrr/thrust/routing.hpp>

#include <thrust/copy.h>
#include <thrust/host_vector.h>
#if THRUST_DEVICE_SYSTEM == THRUST_DEVICE_SYSTEM_CUDA
#include <thrust/system/cuda/memory.h>
#endif

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <utility>
#include <vector>

MRR_NAMESPACE_BEGIN
namespace device {

// Host staging memory for a backend's transfers: pinned (page-locked) on CUDA, so copies run at
// full PCIe bandwidth; plain host memory otherwise (the OpenMP system's "device" is host memory).
template <class U, class Backend>
#if THRUST_DEVICE_SYSTEM == THRUST_DEVICE_SYSTEM_CUDA
using staging_vector = std::conditional_t<Backend::is_device,
                                          thrust::host_vector<U, thrust::cuda::universal_host_pinned_allocator<U>>,
                                          thrust::host_vector<U>>;
#else
using staging_vector = thrust::host_vector<U>;
#endif

template <class T, class Backend = ThrustDeviceBackend>
class BackendRouter {
 public:
  using scalar_type = T;
  template <class U>
  using vector = typename Backend::template vector<U>;
  using resident_logits = vector<T>;
  using resident_routing = Routing<T, Backend>;

  explicit BackendRouter(RouterConfig config) : router_(std::move(config)) {}

  const TopKRouter<T, Backend>& device() const { return router_; }
  TopKRouter<T, Backend>& device() { return router_; }
  const RouterConfig& config() const { return router_.config(); }
  int num_experts() const { return router_.num_experts(); }
  int topk() const { return router_.topk(); }

  template <class Range>
  void set_expert_bias(const Range& bias) {
    router_.set_expert_bias(std::vector<T>(bias.data(), bias.data() + bias.size()));
  }

  // mrr::Router: host logits [tokens, E] (any outer stride) -> host routing.
  mrr::Routing<T> route(MatrixRef<T> logits) const {
    if (in_place()) return route_in_place(logits, nullptr, {});
    return to_host(router_.route(upload(logits)));
  }
  mrr::Routing<T> replay(MatrixRef<T> logits, ExpertIdsRef ids, std::span<const std::uint8_t> replay_mask = {}) const {
    if (!replay_mask.empty())
      mrr::detail::require(replay_mask.size() == static_cast<std::size_t>(logits.rows()),
                           "device::BackendRouter::replay", "'replay_mask' has ", replay_mask.size(), " entries for ",
                           logits.rows(), " rows of logits");
    if (in_place()) return route_in_place(logits, &ids, replay_mask);
    const auto z = upload(logits);
    const auto dids = upload_ids(ids);
    if (replay_mask.empty()) return to_host(router_.replay(z, dids));
    return to_host(router_.replay(z, dids, vector<std::uint8_t>(replay_mask.begin(), replay_mask.end())));
  }
  RowMatrix<T> backward(MatrixRef<T> logits, const mrr::Routing<T>& routing, MatrixRef<T> grad_weights) const {
    const auto grad = routing.has_capacity_mask()
                          ? router_.backward(upload(logits), upload_ids(routing.ids), upload(grad_weights),
                                             upload_matrix<std::uint8_t>(routing.kept))
                          : router_.backward(upload(logits), upload_ids(routing.ids), upload(grad_weights));
    RowMatrix<T> out(logits.rows(), logits.cols());
    download(grad, out.data());
    return out;
  }

  // ResidentRouter: Thrust vectors in, Thrust vectors out.
  long resident_rows(const resident_logits& logits) const {
    return static_cast<long>(logits.size() / static_cast<std::size_t>(num_experts()));
  }
  resident_routing route_resident(const resident_logits& logits) const { return router_.route(logits); }
  // An empty `found` replays every row (the mask-free path).
  resident_routing replay_resident(const resident_logits& logits, const ExpertIds& ids,
                                   const std::vector<std::uint8_t>& found) const {
    const auto dids = upload_ids(ids);
    if (found.empty()) return router_.replay(logits, dids);
    return router_.replay(logits, dids, upload_bytes(found));
  }
  void copy_ids_to_host(const resident_routing& routing, ExpertIds& out) const {
    out.resize(routing.tokens, routing.topk);
    download(routing.ids, out.data());
  }

 private:
  // Host memory is the backend's memory, and no capacity pass needs the owning Routing.
  bool in_place() const { return !Backend::is_device && !config().capacity_factor; }

  template <class U>
  static MatrixView<const U> view_of(const MatrixRef<U>& m) {
    return MatrixView<const U>(m.data(), m.rows(), m.cols(), m.outerStride());
  }

  // The view API on the caller's Eigen buffers (OpenMP / host systems), with the CPU router's
  // error for a bad row.
  mrr::Routing<T> route_in_place(const MatrixRef<T>& logits, const ExpertIdsRef* ids,
                                 std::span<const std::uint8_t> replay_mask) const {
    const long rows = logits.rows();
    mrr::Routing<T> out{ExpertIds(rows, topk()), RowMatrix<T>(rows, topk()), {}};
    std::vector<std::uint8_t> status(static_cast<std::size_t>(rows));
    std::vector<char> scratch(TopKRouter<T, Backend>::workspace_bytes(rows));
    const Workspace ws{scratch.data(), scratch.size()};
    const Execution exec{};
    const MatrixView<std::int32_t> out_ids(out.ids.data(), rows, topk());
    const MatrixView<T> out_w(out.weights.data(), rows, topk());
    if (ids == nullptr) {
      router_.route(exec, view_of(logits), out_ids, out_w, status.data(), ws);
      router_.check_route(exec, view_of(logits), out_ids, out_w, status.data(), ws);
    } else {
      mrr::detail::require(ids->rows() == rows && ids->cols() == topk(), "device::BackendRouter::replay",
                           "'ids' has shape ", mrr::detail::shape_of(*ids), ", expected [", rows, ", ", topk(), "]");
      const std::uint8_t* mask = replay_mask.empty() ? nullptr : replay_mask.data();
      router_.replay(exec, view_of(logits), view_of(*ids), mask, out_ids, out_w, status.data(), ws);
      router_.check_replay(exec, view_of(logits), view_of(*ids), mask, out_ids, out_w, status.data(), ws);
    }
    return out;
  }

  // Through the staging buffer: one contiguous copy each way.
  template <class U>
  static void download(const vector<U>& v, U* dst) {
    if constexpr (Backend::is_device) {
      staging_vector<U, Backend> staged(v.size());
      thrust::copy(v.begin(), v.end(), staged.begin());
      std::memcpy(dst, thrust::raw_pointer_cast(staged.data()), v.size() * sizeof(U));
    } else {
      thrust::copy(v.begin(), v.end(), dst);
    }
  }

  template <class U, class Matrix>
  static vector<U> upload_matrix(const Matrix& m) {
    const auto rows = static_cast<std::size_t>(m.rows()), cols = static_cast<std::size_t>(m.cols());
    staging_vector<U, Backend> staged(rows * cols);
    U* dst = thrust::raw_pointer_cast(staged.data());
    for (std::size_t r = 0; r < rows; ++r)  // rows may be strided (MoELayer pads them)
      std::memcpy(dst + r * cols, m.data() + static_cast<std::ptrdiff_t>(r) * m.outerStride(), cols * sizeof(U));
    return vector<U>(staged.begin(), staged.end());
  }

  static vector<T> upload(const MatrixRef<T>& m) { return upload_matrix<T>(m); }
  static vector<std::int32_t> upload_ids(const ExpertIdsRef& ids) { return upload_matrix<std::int32_t>(ids); }
  static vector<std::uint8_t> upload_bytes(const std::vector<std::uint8_t>& v) {
    return vector<std::uint8_t>(v.begin(), v.end());
  }

  mrr::Routing<T> to_host(const resident_routing& r) const {
    mrr::Routing<T> out{ExpertIds(r.tokens, r.topk), RowMatrix<T>(r.tokens, r.topk), {}};
    download(r.ids, out.ids.data());
    download(r.weights, out.weights.data());
    if (r.has_capacity_mask()) {
      out.kept.resize(r.tokens, r.topk);
      download(r.kept, out.kept.data());
    }
    return out;
  }

  TopKRouter<T, Backend> router_;
};

}  // namespace device

template <class System, class Scalar>
struct RouterFor<ThrustBackend<System>, Scalar> {
  using type = device::BackendRouter<Scalar, ThrustBackend<System>>;
};

MRR_NAMESPACE_END
