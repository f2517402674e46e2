// torch::Tensor <-> mrr, without copies where the layout allows: views of a trainer's tensors as
// the Eigen matrices the host router reads, checked first (dtype, device, rank, shape, strides),
// and expert ids in either of torch's index dtypes with range checks in their own type.
//
// An optional header, like mrr/replay/config_yaml.hpp: include it only in code that already links
// libtorch (find_package(Torch), or torch.utils.cpp_extension). The CUDA side is
// mrr/torch/cuda.hpp. Everything here is in namespace mrr::torch; libtorch's own namespace is
// always written ::torch.
// mrr-requires: mrr_torch
// (a target mrr's own build never defines: the torch tests compile these headers, ctest -L torch)
#pragma once

#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>
#include <mrr/tensor.hpp>

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <type_traits>

MRR_NAMESPACE_BEGIN
namespace torch {

template <class T>
constexpr at::ScalarType scalar_type_of() {
  if constexpr (std::is_same_v<T, float>)
    return at::kFloat;
  else if constexpr (std::is_same_v<T, double>)
    return at::kDouble;
  else if constexpr (std::is_same_v<T, std::int32_t>)
    return at::kInt;
  else if constexpr (std::is_same_v<T, std::int64_t>)
    return at::kLong;
  else if constexpr (std::is_same_v<T, std::uint8_t>)
    return at::kByte;
  else
    static_assert(!sizeof(T*), "mrr::torch: no torch dtype for this element type");
}

// The row-major [rows, cols] Eigen map of a host tensor, rows possibly padded (stride(0) >=
// cols), columns contiguous.
template <class T>
using HostMap = Eigen::Map<const RowMatrix<T>, Eigen::Unaligned, Eigen::OuterStride<>>;
template <class T>
using MutableHostMap = Eigen::Map<RowMatrix<T>, Eigen::Unaligned, Eigen::OuterStride<>>;

namespace detail {

// Text for messages (mrr::detail::str prints numbers and strings only).
inline std::string text(at::IntArrayRef v) {
  std::string out = "[";
  for (std::size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + std::to_string(v[i]);
  return out + "]";
}
inline std::string text(at::ScalarType t) { return c10::toString(t); }
inline std::string text(const at::Device& d) { return d.str(); }

inline void require_matrix(const at::Tensor& t, at::ScalarType dtype, const char* fn, const char* name) {
  mrr::detail::require(t.defined(), fn, "'", name, "' is an undefined tensor");
  mrr::detail::require(t.dim() == 2, fn, "'", name, "' must be 2-D [rows, cols], got ", t.dim(), " dimensions ",
                       text(t.sizes()));
  mrr::detail::require(t.scalar_type() == dtype, fn, "'", name, "' has dtype ", text(t.scalar_type()), ", expected ",
                       text(dtype), " (convert with .to(", text(dtype), "))");
  mrr::detail::require(t.layout() == at::kStrided, fn, "'", name, "' must be a dense (strided) tensor");
  mrr::detail::require(t.size(1) <= 1 || t.stride(1) == 1, fn, "'", name, "' ", text(t.sizes()), " has strides ",
                       text(t.strides()), ": its columns must be contiguous (stride(1) == 1); call .contiguous() first");
  mrr::detail::require(t.size(0) <= 1 || t.stride(0) >= t.size(1), fn, "'", name, "' ", text(t.sizes()), " has strides ",
                       text(t.strides()), ": rows overlap (stride(0) < size(1)); call .contiguous() first");
}

inline void require_cpu(const at::Tensor& t, const char* fn, const char* name) {
  mrr::detail::require(t.device().is_cpu(), fn, "'", name, "' is on ", text(t.device()),
                       "; this call runs on the CPU (CUDA tensors: mrr/torch/cuda.hpp)");
}

}  // namespace detail

// A view of a CPU tensor [rows, cols] of T: no copy. The tensor must outlive the map.
template <class T>
HostMap<T> host_matrix(const at::Tensor& t, const char* fn, const char* name) {
  detail::require_cpu(t, fn, name);
  detail::require_matrix(t, scalar_type_of<T>(), fn, name);
  const Eigen::Index rows = t.size(0), cols = t.size(1);
  return HostMap<T>(t.data_ptr<T>(), rows, cols, Eigen::OuterStride<>(rows > 1 ? t.stride(0) : cols));
}
template <class T>
MutableHostMap<T> mutable_host_matrix(at::Tensor& t, const char* fn, const char* name) {
  detail::require_cpu(t, fn, name);
  detail::require_matrix(t, scalar_type_of<T>(), fn, name);
  const Eigen::Index rows = t.size(0), cols = t.size(1);
  return MutableHostMap<T>(t.data_ptr<T>(), rows, cols, Eigen::OuterStride<>(rows > 1 ? t.stride(0) : cols));
}

// Expert ids [rows, k] as the host router takes them (int32), from an int32, int64 (torch.topk's
// dtype), int16 or uint8 tensor on the CPU. Every id is checked in its own type against
// [0, num_experts): an int64 2^32 + e is an error naming its row and slot, never e.
inline ExpertIds host_ids(const at::Tensor& ids, int num_experts, int k, const char* fn, const char* name = "ids") {
  detail::require_cpu(ids, fn, name);
  mrr::detail::require(ids.defined() && ids.dim() == 2 && ids.size(1) == k, fn, "'", name, "' must be [rows, ", k,
                       "], got ", ids.defined() ? detail::text(ids.sizes()) : std::string("an undefined tensor"));
  const at::ScalarType st = ids.scalar_type();
  mrr::detail::require(st == at::kInt || st == at::kLong || st == at::kShort || st == at::kByte, fn, "'", name,
                       "' has dtype ", detail::text(st), "; expert ids are int64, int32, int16 or uint8");
  const at::Tensor c = ids.contiguous();
  ExpertIds out(c.size(0), k);
  // (A switch, not AT_DISPATCH_*: torch 2.11's macros name torch::headeronly unqualified, which
  // inside this namespace would mean mrr::torch.)
  auto narrow = [&](const auto* src) {
    using S = std::remove_cv_t<std::remove_pointer_t<decltype(src)>>;
    for (Eigen::Index i = 0; i < out.size(); ++i) {
      const S v = src[i];
      bool negative = false;
      if constexpr (std::is_signed_v<S>) negative = v < 0;
      if (negative || static_cast<std::int64_t>(v) >= num_experts)
        mrr::detail::throw_invalid_argument(fn, "'", name, "'[", i / k, ", ", i % k, "] = ", static_cast<std::int64_t>(v),
                                            " is outside [0, ", num_experts, ")");
      out.data()[i] = static_cast<std::int32_t>(v);
    }
  };
  switch (st) {
    case at::kLong:
      narrow(c.data_ptr<std::int64_t>());
      break;
    case at::kInt:
      narrow(c.data_ptr<std::int32_t>());
      break;
    case at::kShort:
      narrow(c.data_ptr<std::int16_t>());
      break;
    default:
      narrow(c.data_ptr<std::uint8_t>());
      break;  // kByte (checked above)
  }
  return out;
}

// A host matrix as a new CPU tensor of dtype `dtype` (ids come back as int64, like torch.topk).
template <class Derived>
at::Tensor to_tensor(const Eigen::MatrixBase<Derived>& m, at::ScalarType dtype) {
  using T = typename Derived::Scalar;
  at::Tensor out = at::empty({static_cast<std::int64_t>(m.rows()), static_cast<std::int64_t>(m.cols())},
                             at::TensorOptions().dtype(scalar_type_of<T>()));
  if (m.size() != 0) Eigen::Map<RowMatrix<T>>(out.data_ptr<T>(), m.rows(), m.cols()) = m;  // one copy, any layout
  return dtype == out.scalar_type() ? out : out.to(dtype);
}

}  // namespace torch
MRR_NAMESPACE_END
