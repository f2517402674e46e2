// The reference expert: a SwiGLU MLP, y = w_down @ (silu(w_gate @ x) * (w_up @ x)), with the
// parameters in torch's nn.Linear layout (w_gate, w_up [I, H]; w_down [H, I]) — the experts of
// Qwen2/Qwen3-MoE, Mixtral and DeepSeek. SwiGLUExperts holds one rank's block of experts and
// models mrr::Expert (and ExpertWritingInto: MoELayer runs its experts in parallel, into its own
// buffers); forward and backward work on a block of rows [n, H] with Eigen GEMMs.
#pragma once

#include <mrr/concepts.hpp>
#include <mrr/detail/config.hpp>
#include <mrr/detail/row_gemm.hpp>
#include <mrr/detail/vexp.hpp>
#include <mrr/error.hpp>
#include <mrr/tensor.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <functional>
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
    RowMatrix<Scalar> out(rows.rows(), hidden_);
    forward_into(local, rows, out);
    return out;
  }

  // forward into caller memory: out [n, H] (a block of a larger matrix is fine). Rows are taken
  // in blocks of row_block() from the first, so the activations of a block stay in cache and
  // nothing is allocated after a thread's first call; each output row depends on its own input
  // row only, bit for bit, whatever other rows the call holds (detail::rows_times). Safe to call
  // concurrently for different experts (scratch is per thread).
  void forward_into(int local, MatrixRef<Scalar> rows, Eigen::Ref<RowMatrix<Scalar>> out) const {
    forward_rows(local, rows, out, nullptr);
  }

  // The same, also saving the activations backward needs into saved [n, activation_size()]
  // (w_gate x | w_up x), so backward_into(..., saved) skips recomputing them (two of its six
  // products per block). The bits are those of the recomputing path.
  void forward_into(int local, MatrixRef<Scalar> rows, Eigen::Ref<RowMatrix<Scalar>> out,
                    Eigen::Ref<RowMatrix<Scalar>> saved) const {
    detail::require(saved.rows() == rows.rows() && saved.cols() == activation_size(), "SwiGLUExperts::forward",
                    "'saved' has shape ", detail::shape_of(saved), ", expected [", rows.rows(), ", ", activation_size(),
                    "]");
    forward_rows(local, rows, out, &saved);
  }

  // An inference engine's numerics: `f` is applied to each block of intermediate rows
  // silu(w_gate x) * (w_up x), [n, I], in place, before w_down takes them (e.g. an fp8 engine's
  // quantisation of down_proj's input). It must treat each row alone, so a token's output still
  // depends on its own row only; it is called from the layer's threads at once. Forward only:
  // backward refuses experts that have one (the rounding has no gradient of its own). An empty
  // function removes it.
  using IntermediateRounding = std::function<void(Eigen::Ref<RowMatrix<Scalar>>)>;
  void set_intermediate_rounding(IntermediateRounding f) { round_intermediate_ = std::move(f); }
  bool rounds_intermediate() const { return static_cast<bool>(round_intermediate_); }

  // Scalars per row that forward_into(..., saved) keeps: 2 x intermediate_size.
  Eigen::Index activation_size() const { return Eigen::Index{2} * intermediate_; }

  // Gradient w.r.t. `rows` of sum(forward(rows) * grad_out); adds the parameter gradients into
  // `grads`. Activations are recomputed from `rows` (only the expert's input is kept).
  RowMatrix<Scalar> backward(int local, MatrixRef<Scalar> rows, MatrixRef<Scalar> grad_out, Gradients& grads) const {
    RowMatrix<Scalar> grad_in(rows.rows(), hidden_);
    backward_into(local, rows, grad_out, grad_in, grads);
    return grad_in;
  }

  // backward into caller memory: grad_in [n, H]. The parameter gradients add one block of
  // row_block() rows at a time, in row order (a fixed order for given rows). Concurrent calls
  // must name different experts (each adds into its own expert's gradients).
  void backward_into(int local, MatrixRef<Scalar> rows, MatrixRef<Scalar> grad_out,
                     Eigen::Ref<RowMatrix<Scalar>> grad_in, Gradients& grads) const {
    backward_rows(local, rows, grad_out, grad_in, grads, nullptr);
  }

  // The same from the activations forward_into(..., saved) kept for these rows.
  void backward_into(int local, MatrixRef<Scalar> rows, MatrixRef<Scalar> grad_out,
                     Eigen::Ref<RowMatrix<Scalar>> grad_in, Gradients& grads, MatrixRef<Scalar> saved) const {
    detail::require(saved.rows() == rows.rows() && saved.cols() == activation_size(), "SwiGLUExperts::backward",
                    "'saved' has shape ", detail::shape_of(saved), ", expected [", rows.rows(), ", ", activation_size(),
                    "]");
    backward_rows(local, rows, grad_out, grad_in, grads, &saved);
  }

  // Rows per block of forward_into / backward_into: 256 (the weight-gradient products reduce over
  // a block's rows, and fewer make them inefficient), fewer for very wide experts so that one
  // [rows, I] activation stays within 1 MiB of float (multiples of 16, at least 16). Fixed by the
  // shape, so results depend on the rows only.
  Eigen::Index row_block() const {
    return std::clamp<Eigen::Index>((Eigen::Index{262144} / intermediate_) / 16 * 16, 16, 256);
  }

 private:
  void forward_rows(int local, const MatrixRef<Scalar>& rows, Eigen::Ref<RowMatrix<Scalar>>& out,
                    Eigen::Ref<RowMatrix<Scalar>>* saved) const {
    constexpr const char* fn = "SwiGLUExperts::forward";
    check_rows(local, rows, fn);
    check_out(out, rows.rows(), "out", fn);
    const auto e = static_cast<std::size_t>(local);
    Scratch& s = scratch(3);
    const Eigen::Index I = intermediate_;
    for (Eigen::Index r0 = 0; r0 < rows.rows(); r0 += row_block()) {
      const Eigen::Index n = std::min<Eigen::Index>(row_block(), rows.rows() - r0);
      const auto x = rows.middleRows(r0, n);
      // w_gate x | w_up x: into `saved` when given, else into scratch blocks 1 and 2.
      const Eigen::Index stride = saved != nullptr ? saved->outerStride() : 2 * I;
      Scalar* gu_rows = saved != nullptr ? saved->data() + r0 * stride : s.pair(1, n).data();
      Eigen::Map<RowMatrix<Scalar>, 0, Eigen::OuterStride<>> gu(gu_rows, n, 2 * I, Eigen::OuterStride<>(stride));
      detail::rows_times(gu.leftCols(I), x, w_gate_[e].transpose(), false);
      detail::rows_times(gu.rightCols(I), x, w_up_[e].transpose(), false);
      auto a = s.block(0, n);
      silu_times(gu.data(), stride, n, nullptr, a.data());
      if (round_intermediate_) round_intermediate_(a);
      detail::rows_times(out.middleRows(r0, n), a, w_down_[e].transpose(), false);
    }
  }

  void backward_rows(int local, const MatrixRef<Scalar>& rows, const MatrixRef<Scalar>& grad_out,
                     Eigen::Ref<RowMatrix<Scalar>>& grad_in, Gradients& grads, const MatrixRef<Scalar>* saved) const {
    constexpr const char* fn = "SwiGLUExperts::backward";
    detail::require(!round_intermediate_, fn,
                    "these experts round their intermediate rows (set_intermediate_rounding: an inference engine's "
                    "numerics), which has no gradient; remove it to train");
    check_rows(local, rows, fn);
    detail::require(grad_out.rows() == rows.rows() && grad_out.cols() == hidden_, fn, "'grad_out' has shape ",
                    detail::shape_of(grad_out), " for rows ", detail::shape_of(rows));
    check_out(grad_in, rows.rows(), "grad_in", fn);
    detail::require(grads.w_gate.size() == w_gate_.size() && grads.w_up.size() == w_up_.size() &&
                        grads.w_down.size() == w_down_.size(),
                    fn, "'grads' holds another number of experts (use zero_gradients())");
    const auto e = static_cast<std::size_t>(local);
    Scratch& s = scratch(6);
    const Eigen::Index I = intermediate_;
    for (Eigen::Index r0 = 0; r0 < rows.rows(); r0 += row_block()) {
      const Eigen::Index n = std::min<Eigen::Index>(row_block(), rows.rows() - r0);
      const auto x = rows.middleRows(r0, n);
      const auto dy = grad_out.middleRows(r0, n);
      const Scalar* g_rows;  // w_gate x and w_up x, row r at g_rows + r * stride (u at + I)
      Eigen::Index stride;
      if (saved != nullptr) {
        g_rows = saved->data() + r0 * saved->outerStride();
        stride = saved->outerStride();
      } else {
        auto gu = s.pair(0, n);  // [n, 2I] in scratch blocks 0 and 1
        detail::rows_times(gu.leftCols(I), x, w_gate_[e].transpose(), false);
        detail::rows_times(gu.rightCols(I), x, w_up_[e].transpose(), false);
        g_rows = gu.data();
        stride = 2 * I;
      }
      auto sg = s.block(2, n);  // sigmoid(g)
      auto a = s.block(3, n);   // silu(g) * u, then d a
      auto dg = s.block(4, n);
      auto du = s.block(5, n);
      silu_times(g_rows, stride, n, sg.data(), a.data());
      grads.w_down[e].noalias() += dy.transpose() * a;
      detail::rows_times(a, dy, w_down_[e], false);  // d a
      // d g = d a * u * silu'(g), silu'(g) = s (1 + g (1 - s)); d u = d a * silu(g)
      for (Eigen::Index r = 0; r < n; ++r) {
        const Scalar* gr = g_rows + r * stride;
        const Scalar* ur = gr + I;
        const Scalar* sr = sg.row(r).data();
        const Scalar* dar = a.row(r).data();
        Scalar* dgr = dg.row(r).data();
        Scalar* dur = du.row(r).data();
        for (Eigen::Index c = 0; c < I; ++c) {
          const Scalar gv = gr[c], sv = sr[c], da = dar[c];
          dgr[c] = da * ur[c] * sv * (Scalar(1) + gv * (Scalar(1) - sv));
          dur[c] = da * (gv * sv);
        }
      }
      grads.w_up[e].noalias() += du.transpose() * x;
      grads.w_gate[e].noalias() += dg.transpose() * x;
      auto dx = grad_in.middleRows(r0, n);
      detail::rows_times(dx, dg, w_gate_[e], false);
      detail::rows_times(dx, du, w_up_[e], true);
    }
  }

  // For rows r < n of w_gate x | w_up x (g at gu + r * stride, u at + intermediate_): a = silu(g) *
  // u = g * sigmoid(g) * u, and sig = sigmoid(g) when given (both [n, intermediate_], dense), one
  // L1-sized piece of a row at a time. Each element takes the operations of detail::sigmoid_each
  // and then (g * s) * u, so its bits depend on its values only (not on the scratch's address,
  // the thread, or how many rows share the block).
  void silu_times(const Scalar* gu, Eigen::Index stride, Eigen::Index n, Scalar* sig, Scalar* a) const {
    constexpr Eigen::Index kPiece = 256;
    alignas(64) Scalar e[kPiece];
    const Eigen::Index I = intermediate_;
    for (Eigen::Index r = 0; r < n; ++r) {
      const Scalar* g = gu + r * stride;
      const Scalar* u = g + I;
      Scalar* ar = a + r * I;
      Scalar* sr = sig != nullptr ? sig + r * I : nullptr;
      for (Eigen::Index c0 = 0; c0 < I; c0 += kPiece) {
        const Eigen::Index len = std::min(kPiece, I - c0);
        for (Eigen::Index i = 0; i < len; ++i)
          e[i] = -g[c0 + i];
        detail::exp_each(e, len);
        for (Eigen::Index i = 0; i < len; ++i)
          e[i] = Scalar(1) / (Scalar(1) + e[i]);
        if (sr != nullptr)
          for (Eigen::Index i = 0; i < len; ++i)
            sr[c0 + i] = e[i];
        for (Eigen::Index i = 0; i < len; ++i)
          ar[c0 + i] = g[c0 + i] * e[i] * u[c0 + i];
      }
    }
  }

  // Per-thread activations of one row block: `count` [row_block, I] matrices in one allocation
  // that only grows.
  struct Scratch {
    std::vector<Scalar> data;
    Eigen::Index rows = 0, cols = 0;
    Eigen::Map<RowMatrix<Scalar>> block(int i, Eigen::Index n) {
      return {data.data() + static_cast<std::size_t>(i) * static_cast<std::size_t>(rows * cols), n, cols};
    }
    // Blocks i and i + 1 as one [n, 2 cols] matrix.
    Eigen::Map<RowMatrix<Scalar>> pair(int i, Eigen::Index n) {
      return {data.data() + static_cast<std::size_t>(i) * static_cast<std::size_t>(rows * cols), n, 2 * cols};
    }
  };
  Scratch& scratch(int count) const {
    thread_local Scratch s;
    s.rows = row_block();
    s.cols = intermediate_;
    const auto need = static_cast<std::size_t>(count) * static_cast<std::size_t>(s.rows * s.cols);
    if (s.data.size() < need) s.data.resize(need);
    return s;
  }

  void check_out(const Eigen::Ref<RowMatrix<Scalar>>& out, Eigen::Index rows, const char* name, const char* fn) const {
    detail::require(out.rows() == rows && out.cols() == hidden_, fn, "'", name, "' has shape ", detail::shape_of(out),
                    ", expected [", rows, ", ", hidden_, "]");
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
  IntermediateRounding round_intermediate_;
};

static_assert(ExpertWritingInto<SwiGLUExperts<float>> && ExpertWritingInto<SwiGLUExperts<double>>);

MRR_NAMESPACE_END
