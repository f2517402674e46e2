// The reference expert: a SwiGLU MLP, y = w_down @ (silu(w_gate @ x) * (w_up @ x)), with the
// parameters in torch's nn.Linear layout (w_gate, w_up [I, H]; w_down [H, I]) — the experts of
// Qwen2/Qwen3-MoE, Mixtral and DeepSeek. SwiGLUExperts holds one rank's block of experts and
// models mrr::Expert; forward and backward work on a block of rows [n, H] with Eigen GEMMs.
#pragma once

#include <mrr/concepts.hpp>
#include <mrr/detail/config.hpp>
#include <mrr/error.hpp>
#include <mrr/tensor.hpp>

#include <cmath>
#include <cstddef>
#include <span>
#include <type_traits>
#include <vector>

MRR_NAMESPACE_BEGIN

template <class Scalar>
class SwiGLUExperts {
  static_assert(std::is_floating_point_v<Scalar>, "SwiGLUExperts<Scalar>: Scalar must be float or double");

 public:
  using scalar_type = Scalar;

  // Parameter gradients, one matrix per local expert, in the parameters' layout.
  struct Gradients {
    std::vector<RowMatrix<Scalar>> w_gate, w_up, w_down;
  };
  using gradients_type = Gradients;

  // num_experts local experts, global ids [first_expert, first_expert + num_experts), zero
  // parameters. Each matrix is its own allocation, so an expert computes bitwise the same
  // whichever rank (and offset in a rank's block) holds it.
  SwiGLUExperts(int hidden_size, int intermediate_size, int num_experts, int first_expert = 0)
      : hidden_(hidden_size), intermediate_(intermediate_size), first_(first_expert) {
    constexpr const char* fn = "SwiGLUExperts";
    detail::require(hidden_size > 0 && intermediate_size > 0, fn, "hidden_size (", hidden_size,
                    ") and intermediate_size (", intermediate_size, ") must be positive");
    detail::require(num_experts >= 0 && first_expert >= 0, fn, "num_experts (", num_experts, ") and first_expert (",
                    first_expert, ") must be >= 0");
    const auto n = static_cast<std::size_t>(num_experts);
    w_gate_.assign(n, RowMatrix<Scalar>::Zero(intermediate_size, hidden_size));
    w_up_.assign(n, RowMatrix<Scalar>::Zero(intermediate_size, hidden_size));
    w_down_.assign(n, RowMatrix<Scalar>::Zero(hidden_size, intermediate_size));
  }

  int num_experts() const { return static_cast<int>(w_gate_.size()); }
  int first_expert() const { return first_; }
  int hidden_size() const { return hidden_; }
  int intermediate_size() const { return intermediate_; }
  bool holds(int global_expert) const { return global_expert >= first_ && global_expert < first_ + num_experts(); }

  const RowMatrix<Scalar>& w_gate(int local) const { return w_gate_.at(static_cast<std::size_t>(local)); }
  const RowMatrix<Scalar>& w_up(int local) const { return w_up_.at(static_cast<std::size_t>(local)); }
  const RowMatrix<Scalar>& w_down(int local) const { return w_down_.at(static_cast<std::size_t>(local)); }

  // Sets one expert (global id) from torch-layout matrices w_gate [I, H], w_up [I, H], w_down [H, I].
  void set_expert(int global_expert, MatrixRef<Scalar> w_gate, MatrixRef<Scalar> w_up, MatrixRef<Scalar> w_down) {
    constexpr const char* fn = "SwiGLUExperts::set_expert";
    detail::require(holds(global_expert), fn, "expert ", global_expert, " is not in this rank's block [", first_, ", ",
                    first_ + num_experts(), ")");
    check_shape(w_gate, intermediate_, hidden_, "w_gate", fn);
    check_shape(w_up, intermediate_, hidden_, "w_up", fn);
    check_shape(w_down, hidden_, intermediate_, "w_down", fn);
    const auto e = static_cast<std::size_t>(global_expert - first_);
    w_gate_[e] = w_gate;
    w_up_[e] = w_up;
    w_down_[e] = w_down;
  }

  // Loads this rank's experts from whole-model tensors as a checkpoint stores them (row-major):
  // w_gate and w_up [E, I, H], w_down [E, H, I] (HF's stacked experts, or per-expert nn.Linear
  // weights concatenated). E is deduced from the sizes and must cover this rank's block.
  void load_torch(std::span<const Scalar> w_gate, std::span<const Scalar> w_up, std::span<const Scalar> w_down) {
    constexpr const char* fn = "SwiGLUExperts::load_torch";
    const auto per_expert = static_cast<std::size_t>(hidden_) * static_cast<std::size_t>(intermediate_);
    detail::require(w_gate.size() % per_expert == 0, fn, "'w_gate' has ", w_gate.size(),
                    " values, not a multiple of intermediate_size*hidden_size = ", per_expert);
    const std::size_t experts = w_gate.size() / per_expert;
    detail::require(w_up.size() == w_gate.size() && w_down.size() == w_gate.size(), fn, "'w_gate', 'w_up' and 'w_down' have ",
                    w_gate.size(), ", ", w_up.size(), " and ", w_down.size(), " values; expected ", experts, " experts of ",
                    per_expert, " each");
    detail::require(static_cast<std::size_t>(first_ + num_experts()) <= experts, fn, "the tensors hold ", experts,
                    " experts but this rank's block is [", first_, ", ", first_ + num_experts(), ")");
    using ConstMap = Eigen::Map<const RowMatrix<Scalar>>;
    for (int e = 0; e < num_experts(); ++e) {
      const std::size_t offset = static_cast<std::size_t>(first_ + e) * per_expert;
      const auto i = static_cast<std::size_t>(e);
      w_gate_[i] = ConstMap(w_gate.data() + offset, intermediate_, hidden_);
      w_up_[i] = ConstMap(w_up.data() + offset, intermediate_, hidden_);
      w_down_[i] = ConstMap(w_down.data() + offset, hidden_, intermediate_);
    }
  }

  Gradients zero_gradients() const {
    Gradients g;
    g.w_gate.assign(w_gate_.size(), RowMatrix<Scalar>::Zero(intermediate_, hidden_));
    g.w_up.assign(w_up_.size(), RowMatrix<Scalar>::Zero(intermediate_, hidden_));
    g.w_down.assign(w_down_.size(), RowMatrix<Scalar>::Zero(hidden_, intermediate_));
    return g;
  }

  // rows [n, H] -> [n, H] for local expert `local`.
  RowMatrix<Scalar> forward(int local, MatrixRef<Scalar> rows) const {
    check_rows(local, rows, "SwiGLUExperts::forward");
    const auto e = static_cast<std::size_t>(local);
    if (rows.rows() == 0) return RowMatrix<Scalar>(0, hidden_);
    const RowMatrix<Scalar> g = rows * w_gate_[e].transpose();
    const RowMatrix<Scalar> u = rows * w_up_[e].transpose();
    const RowMatrix<Scalar> a = (g.array() * sigmoid(g).array() * u.array()).matrix();
    return a * w_down_[e].transpose();
  }

  // Gradient w.r.t. `rows` of sum(forward(rows) * grad_out); adds the parameter gradients into
  // `grads`. Activations are recomputed from `rows` (only the expert's input is kept).
  RowMatrix<Scalar> backward(int local, MatrixRef<Scalar> rows, MatrixRef<Scalar> grad_out, Gradients& grads) const {
    constexpr const char* fn = "SwiGLUExperts::backward";
    check_rows(local, rows, fn);
    detail::require(grad_out.rows() == rows.rows() && grad_out.cols() == hidden_, fn, "'grad_out' has shape ",
                    detail::shape_of(grad_out), " for rows ", detail::shape_of(rows));
    detail::require(grads.w_gate.size() == w_gate_.size() && grads.w_up.size() == w_up_.size() &&
                        grads.w_down.size() == w_down_.size(),
                    fn, "'grads' holds another number of experts (use zero_gradients())");
    const auto e = static_cast<std::size_t>(local);
    if (rows.rows() == 0) return RowMatrix<Scalar>(0, hidden_);
    const RowMatrix<Scalar> g = rows * w_gate_[e].transpose();
    const RowMatrix<Scalar> u = rows * w_up_[e].transpose();
    const RowMatrix<Scalar> s = sigmoid(g);
    const RowMatrix<Scalar> silu = (g.array() * s.array()).matrix();
    const RowMatrix<Scalar> a = (silu.array() * u.array()).matrix();
    const RowMatrix<Scalar> da = grad_out * w_down_[e];
    grads.w_down[e].noalias() += grad_out.transpose() * a;
    const RowMatrix<Scalar> du = (da.array() * silu.array()).matrix();
    // silu'(g) = s (1 + g (1 - s))
    const RowMatrix<Scalar> dg =
        (da.array() * u.array() * s.array() * (Scalar(1) + g.array() * (Scalar(1) - s.array()))).matrix();
    grads.w_up[e].noalias() += du.transpose() * rows;
    grads.w_gate[e].noalias() += dg.transpose() * rows;
    RowMatrix<Scalar> dx = dg * w_gate_[e];
    dx.noalias() += du * w_up_[e];
    return dx;
  }

 private:
  static RowMatrix<Scalar> sigmoid(const RowMatrix<Scalar>& x) {
    return (Scalar(1) + (-x.array()).exp()).inverse().matrix();
  }

  void check_rows(int local, const MatrixRef<Scalar>& rows, const char* fn) const {
    detail::require(local >= 0 && local < num_experts(), fn, "local expert ", local, " outside [0, ", num_experts(), ")");
    detail::require(rows.cols() == hidden_, fn, "rows have shape ", detail::shape_of(rows), " but hidden_size is ",
                    hidden_);
  }

  static void check_shape(const MatrixRef<Scalar>& m, int rows, int cols, const char* name, const char* fn) {
    detail::require(m.rows() == rows && m.cols() == cols, fn, "'", name, "' has shape ", detail::shape_of(m),
                    ", expected [", rows, ", ", cols, "]");
  }

  int hidden_;
  int intermediate_;
  int first_;
  std::vector<RowMatrix<Scalar>> w_gate_, w_up_, w_down_;
};

static_assert(Expert<SwiGLUExperts<float>> && Expert<SwiGLUExperts<double>>);

MRR_NAMESPACE_END
