// mrr as a PyTorch extension: routers with mrr's autograd, a route store chosen by verl's
// router-replay keys (memory or route file), rollout imports (vLLM, SGLang) and the replay
// controller, on CPU tensors and (built with CUDA: MRR_TORCH_WITH_CUDA, cuda_router.cu) on CUDA
// tensors. Built by mrr_torch.load() with torch.utils.cpp_extension; the Python side
// (mrr_torch/__init__.py) adds Megatron's RouterReplay API on top.
#include <mrr/replay/any_store.hpp>
#include <mrr/replay/config.hpp>
#include <mrr/replay/layout.hpp>
#include <mrr/replay/mode.hpp>
#include <mrr/replay/routing_replay.hpp>
#include <mrr/replay/vllm_import.hpp>
#include <mrr/router/config.hpp>
#include <mrr/router/row_error.hpp>
#include <mrr/router/topk_router.hpp>
#include <mrr/torch/python.hpp>
#include <mrr/torch/router.hpp>
#include <mrr/torch/tensor.hpp>

#include <pybind11/numpy.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#ifdef MRR_TORCH_WITH_CUDA
#include "cuda_router.h"
#endif

#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace py = pybind11;
using mrr::detail::require;
using mrr::detail::throw_invalid_argument;

namespace {

// ---------------------------------------------------------------------------------------------
// Routers

struct Router {
  mrr::TopKRouter<float> router;
  std::vector<float> bias() const {  // the selection-only expert bias (empty without use_expert_bias)
    const auto& b = router.expert_bias();
    return std::vector<float>(b.data(), b.data() + b.size());
  }
  // Sets the bias on the CPU router (its checks: use_expert_bias, size, finite) and on the GPU copy.
  void set_expert_bias(const std::vector<float>& values) {
    router.set_expert_bias(Eigen::Map<const mrr::Vector<float>>(values.data(), static_cast<Eigen::Index>(values.size())));
#ifdef MRR_TORCH_WITH_CUDA
    if (cuda) mrr_torch_ext::cuda_set_expert_bias(*cuda, values);
#endif
  }
#ifdef MRR_TORCH_WITH_CUDA
  // The same config on the GPU, made at the first CUDA call (the CUDA runtime starts then).
  mutable std::shared_ptr<mrr_torch_ext::CudaRouter> cuda;
  const mrr_torch_ext::CudaRouter& on_cuda() const {
    if (!cuda) cuda = mrr_torch_ext::make_cuda_router(router.config(), bias());
    return *cuda;
  }
#endif
};

// CUDA logits go to the device router on torch's current stream; a build without CUDA says so.
bool is_cuda_input(const at::Tensor& logits, const char* fn) {
  if (!logits.defined() || !logits.device().is_cuda()) return false;
#ifndef MRR_TORCH_WITH_CUDA
  throw_invalid_argument(fn, "'logits' is on ", mrr::torch::detail::text(logits.device()),
                         " but this build of the extension has no CUDA (mrr_torch.load() builds the CUDA half when "
                         "torch.cuda.is_available() and nvcc is found; MRR_TORCH_CUDA=0 turns it off)");
#else
  (void)fn;
  return true;
#endif
}

std::shared_ptr<Router> make_router(int num_experts, int topk, const std::string& score_function, bool pre_softmax,
                   std::optional<bool> normalize_topk, std::optional<double> scaling_factor, int num_groups,
                   int group_topk, bool use_expert_bias) {
  mrr::RouterConfig c;
  c.num_experts = num_experts;
  c.topk = topk;
  c.score_function = mrr::parse_score_function(score_function);
  c.pre_softmax = pre_softmax;
  c.normalize_topk = normalize_topk;
  c.scaling_factor = scaling_factor;
  c.num_groups = num_groups;
  c.group_topk = group_topk;
  c.use_expert_bias = use_expert_bias;
  c.validate();
  return std::make_shared<Router>(Router{mrr::TopKRouter<float>(std::move(c))});
}

// mrr's backward reads the router through a pointer (mrr/torch/router.hpp), so the weights'
// graph node owns the router too: dropping the Python Router before backward() is then safe.
struct KeepRouterAlive : ::torch::autograd::FunctionPreHook {
  explicit KeepRouterAlive(std::shared_ptr<const Router> r) : router(std::move(r)) {}
  ::torch::autograd::variable_list operator()(const ::torch::autograd::variable_list& grads) override { return grads; }
  std::shared_ptr<const Router> router;
};

// (weights, ids); with_status (a CUDA call with check=False): (weights, ids, status [T] uint8), the
// status being each row's code (0: routed), for the caller to test when it chooses.
py::tuple as_tuple(const mrr::torch::TensorRouting& r, const std::shared_ptr<const Router>& router,
                   bool with_status = false) {
  if (const auto& node = r.weights.grad_fn()) node->add_pre_hook(std::make_unique<KeepRouterAlive>(router));
  if (with_status) return py::make_tuple(r.weights, r.ids, r.status);
  return py::make_tuple(r.weights, r.ids);
}

// Expert ids [rows, k] a caller (Megatron's set_replay_data) hands over: in [0, num_experts) in
// their own dtype, no expert twice in a row. Throws InvalidArgument with mrr's message.
void validate_ids(const at::Tensor& ids, int num_experts) {
  constexpr const char* fn = "validate_ids";
  require(ids.defined() && ids.dim() == 2, fn, "'ids' must be 2-D [rows, k], got ",
          ids.defined() ? mrr::torch::detail::text(ids.sizes()) : std::string("an undefined tensor"));
  require(num_experts > 0, fn, "num_experts must be positive, got ", num_experts);
  const int k = static_cast<int>(ids.size(1));
  const mrr::ExpertIds host = mrr::torch::host_ids(ids, num_experts, k, fn);
  for (Eigen::Index r = 0; r < host.rows(); ++r)
    mrr::detail::reject_invalid_ids(host.data() + r * k, k, num_experts, static_cast<long>(r), fn);
}

// A sequence id from a Python int: 0 .. 2**64 - 1, or a negative int64 as the same 64 bits (a
// uid tensor is int64, so a 64-bit hash there is negative; record/lookup read it that way too).
mrr::SequenceId sequence_id(const py::int_& uid, const char* fn) {
  const py::object lo = py::int_(-(std::int64_t{1} << 62)) * py::int_(2);  // -2**63
  const py::object hi = py::int_(~std::uint64_t{0});                       // 2**64 - 1
  require(uid >= lo && uid <= hi, fn, "uid ", py::repr(uid).cast<std::string>(),
          " is outside a 64-bit sequence id (0 .. 2**64 - 1, or a negative int64 for the same bits)");
  if (uid < py::int_(0)) return static_cast<mrr::SequenceId>(uid.cast<std::int64_t>());
  return uid.cast<std::uint64_t>();
}

// ---------------------------------------------------------------------------------------------
// Tensors and arrays in

std::vector<std::int64_t> int64_vector(const at::Tensor& t, const char* fn, const char* name) {
  require(t.defined() && t.dim() == 1, fn, "'", name, "' must be a 1-D tensor, got ",
          t.defined() ? mrr::torch::detail::text(t.sizes()) : std::string("an undefined tensor"));
  const at::ScalarType st = t.scalar_type();
  require(st == at::kLong || st == at::kInt || st == at::kShort || st == at::kByte, fn, "'", name, "' has dtype ",
          mrr::torch::detail::text(st), "; expected an integer dtype (int64)");
  const at::Tensor c = t.to(at::kCPU).to(at::kLong).contiguous();  // CUDA uids/positions: one copy
  return {c.data_ptr<std::int64_t>(), c.data_ptr<std::int64_t>() + c.numel()};
}

// Rows (uid, position) given as two 1-D tensors of equal length.
mrr::TokenLayout token_rows(const at::Tensor& uids, const at::Tensor& positions, const char* fn) {
  const auto u = int64_vector(uids, fn, "uids");
  const auto p = int64_vector(positions, fn, "positions");
  require(u.size() == p.size(), fn, "'uids' has ", u.size(), " entries but 'positions' has ", p.size());
  std::vector<mrr::TokenKey> rows(u.size());
  for (std::size_t i = 0; i < u.size(); ++i) {
    require(p[i] >= 0, fn, "'positions'[", i, "] = ", p[i], " is negative");
    rows[i] = {static_cast<mrr::SequenceId>(u[i]), p[i]};
  }
  return mrr::TokenLayout(std::move(rows));
}

// ---------------------------------------------------------------------------------------------
// Base64 (SGLang's routed_experts payload): RFC 4648's standard alphabet with '=' padding, and
// nothing else (no line breaks or spaces), so a truncated or mangled payload is an error rather
// than silently different ids.

std::vector<unsigned char> decode_base64(std::string_view in, const char* fn, const char* name) {
  auto value = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
  };
  require(in.size() % 4 == 0, fn, "'", name, "' is ", in.size(),
          " characters of base64, not a multiple of 4 (truncated, or not padded with '=')");
  std::size_t pad = 0;
  while (pad < 2 && pad < in.size() && in[in.size() - 1 - pad] == '=') ++pad;
  std::vector<unsigned char> out;
  out.reserve(in.size() / 4 * 3);
  std::uint32_t acc = 0;
  for (std::size_t i = 0; i < in.size() - pad; ++i) {
    const int v = value(in[i]);
    if (v < 0) {
      const auto byte = static_cast<unsigned>(static_cast<unsigned char>(in[i]));
      throw_invalid_argument(fn, "'", name, "' has ", in[i] == '=' ? "misplaced padding '='" : "a character",
                             " (byte ", byte, ") at offset ", i, " that is not base64");
    }
    acc = (acc << 6) | static_cast<std::uint32_t>(v);
    if (i % 4 == 3) {
      out.push_back(static_cast<unsigned char>(acc >> 16));
      out.push_back(static_cast<unsigned char>(acc >> 8));
      out.push_back(static_cast<unsigned char>(acc));
      acc = 0;
    }
  }
  if (pad == 2) {  // "xx==": one byte; the low 4 bits must be zero (canonical encoding)
    require((acc & 0xF) == 0, fn, "'", name, "' has non-zero bits in its padding (not canonical base64)");
    out.push_back(static_cast<unsigned char>(acc >> 4));
  } else if (pad == 1) {  // "xxx=": two bytes
    require((acc & 0x3) == 0, fn, "'", name, "' has non-zero bits in its padding (not canonical base64)");
    out.push_back(static_cast<unsigned char>(acc >> 10));
    out.push_back(static_cast<unsigned char>(acc >> 2));
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Route store

// verl's router-replay keys, short or full: a key without a dot is one of the router_replay node
// (mode, record_file, replay_file; another is ReplayConfig's "unknown key" error), except
// enable_rollout_routing_replay, which lives under actor_rollout_ref.rollout.
std::string full_key(const std::string& key) {
  if (key == "enable_rollout_routing_replay") return std::string(mrr::ReplayConfig::kRolloutReplay);
  if (key.find('.') == std::string::npos) return std::string(mrr::ReplayConfig::kPrefix) + key;
  return key;
}

// A Python value as the text a verl config holds: a str is always a string (a file named "1" or
// "null" stays that), bools are true/false, None is null, numbers are YAML numbers.
mrr::ReplayConfig replay_config(const py::dict& values) {
  mrr::ReplayConfig config;
  for (const auto& [k, v] : values) {
    if (!py::isinstance<py::str>(k))
      throw mrr::ConfigError("router replay config keys are strings, got " + py::repr(k).cast<std::string>());
    const std::string key = full_key(k.cast<std::string>());
    bool known = false;
    if (v.is_none()) {
      known = config.set(key, mrr::ConfigValue::plain("null"));
    } else if (py::isinstance<py::bool_>(v)) {
      known = config.set(key, mrr::ConfigValue::plain(v.cast<bool>() ? "true" : "false"));
    } else if (py::isinstance<py::str>(v)) {
      const std::string text = v.cast<std::string>();
      known = config.set(key, mrr::ConfigValue::quoted(text));
    } else if (py::isinstance<py::int_>(v) || py::isinstance<py::float_>(v)) {
      const std::string text = py::str(v).cast<std::string>();
      known = config.set(key, mrr::ConfigValue::plain(text));
    } else {
      throw mrr::ConfigError(key + ": expected a string, a boolean, a number or None, got " +
                             py::repr(v).cast<std::string>());
    }
    if (!known)
      throw mrr::ConfigError("unknown key " + key + " (router replay takes mode, record_file, replay_file and " +
                             std::string(mrr::ReplayConfig::kRolloutReplay) + ")");
  }
  return config;
}

struct RouteFile {
  mrr::ReplayConfig config;
  mrr::AnyRouteStore store;

  RouteFile(mrr::ReplayConfig c, const mrr::RouteShape& shape)
      : config(std::move(c)), store(mrr::AnyRouteStore::from_config(config, shape)) {}

  const mrr::RouteShape& shape() const { return store.shape(); }

  void check_layer(int layer, const char* fn) const {
    require(layer >= 0 && layer < shape().num_layers, fn, "layer ", layer, " outside the store's [0, ",
            shape().num_layers, ")");
  }

  void record(int layer, const at::Tensor& uids, const at::Tensor& positions, const at::Tensor& ids) {
    constexpr const char* fn = "RouteFile.record";
    check_layer(layer, fn);
    const mrr::TokenLayout rows = token_rows(uids, positions, fn);
    // Ids a CUDA router chose come to the host store (one copy; the store lives on the host).
    const at::Tensor on_host = ids.defined() && ids.device().is_cuda() ? ids.cpu() : ids;
    const mrr::ExpertIds host = mrr::torch::host_ids(on_host, shape().num_experts, shape().topk, fn);
    require(static_cast<std::size_t>(host.rows()) == rows.size(), fn, "'ids' has ", host.rows(), " rows for ",
            rows.size(), " (uid, position) pairs");
    // A row listing an expert twice is no top-k: refused before anything is stored (a route file
    // is append-only; the replay would refuse it only later), as import_vllm refuses it.
    const int k = shape().topk;
    for (Eigen::Index r = 0; r < host.rows(); ++r)
      mrr::detail::reject_invalid_ids(host.data() + r * k, k, shape().num_experts, static_cast<long>(r), fn);
    store.record(layer, rows, host);
  }

  // The ids in the dtype asked for (int64 by default, as torch.topk; int32; uint8 when every
  // expert id fits it, a quarter of int32's bytes to send to a GPU), read by the store straight
  // into that type: one copy into the tensor.
  py::tuple lookup(int layer, const at::Tensor& uids, const at::Tensor& positions, const py::object& dtype) const {
    constexpr const char* fn = "RouteFile.lookup";
    check_layer(layer, fn);
    const mrr::TokenLayout rows = token_rows(uids, positions, fn);
    std::vector<std::uint8_t> found;
    const py::module_ torch = py::module_::import("torch");
    at::Tensor ids;
    if (dtype.is_none() || dtype.equal(torch.attr("int64")))
      ids = lookup_as<std::int64_t>(layer, rows, found);
    else if (dtype.equal(torch.attr("int32")))
      ids = lookup_as<std::int32_t>(layer, rows, found);
    else if (dtype.equal(torch.attr("uint8")))
      ids = lookup_as<std::uint8_t>(layer, rows, found);
    else
      throw_invalid_argument(fn, "'dtype' is ", py::str(dtype).cast<std::string>(),
                             "; expected torch.int64, torch.int32 or torch.uint8");
    at::Tensor hit = at::empty({static_cast<std::int64_t>(found.size())}, at::kBool);
    for (std::size_t i = 0; i < found.size(); ++i) hit.data_ptr<bool>()[i] = found[i] != 0;
    return py::make_tuple(ids, hit);
  }

  template <class Id>
  at::Tensor lookup_as(int layer, const mrr::TokenLayout& rows, std::vector<std::uint8_t>& found) const {
    mrr::RowMatrix<Id> out;
    store.lookup(layer, rows, out, found);
    return mrr::torch::to_tensor(out, mrr::torch::scalar_type_of<Id>());
  }

  // Any store with record_sequence (the memory or the file alternative).
  template <class F>
  void with_sequence_store(F&& f) {
    if (auto* file = store.file()) return f(*file);
    f(*store.memory());
  }

  template <class Int>
  void import_ids(std::uint64_t uid, std::span<const Int> values, std::int64_t tokens, std::int64_t layers,
                  std::int64_t k, std::int64_t first_position, const std::vector<int>& moe_layers) {
    with_sequence_store([&](auto& s) {
      mrr::import_routed_experts<std::remove_reference_t<decltype(s)>, Int>(
          s, uid, values, tokens, layers, k, first_position, std::span<const int>(moe_layers));
    });
  }

  // moe_layers (None or a sequence of ints): the decoder layers of the array that are MoE layers.
  static std::vector<int> layer_list(const py::object& moe_layers, const char* fn) {
    std::vector<int> out;
    if (moe_layers.is_none()) return out;
    require(py::isinstance<py::sequence>(moe_layers) && !py::isinstance<py::str>(moe_layers), fn,
            "'moe_layers' must be a sequence of ints (the decoder layers that are MoE layers), got ",
            py::str(moe_layers.get_type()).cast<std::string>());
    for (const py::handle item : moe_layers) {
      require(py::isinstance<py::int_>(item), fn, "'moe_layers' must hold ints, got ",
              py::str(item.get_type()).cast<std::string>());
      const auto v = item.cast<long long>();
      require(v >= 0 && v <= 65535, fn, "'moe_layers' holds ", v, ", outside [0, 65535]");
      out.push_back(static_cast<int>(v));
    }
    require(!out.empty(), fn, "'moe_layers' is empty; give None when every layer of the array is a MoE layer");
    return out;
  }

  // vLLM's routed_experts [n - 1, layers, k]: int32 (early versions), uint8 (<= 256 experts) or
  // uint16 (more), as a tensor or a numpy array (torch 1.13 has no uint16 tensors).
  void import_vllm(const py::int_& uid_in, const py::object& routed_experts, std::int64_t first_position,
                   const py::object& moe_layers_in) {
    constexpr const char* fn = "RouteFile.import_vllm";
    const mrr::SequenceId uid = sequence_id(uid_in, fn);
    const std::vector<int> moe_layers = layer_list(moe_layers_in, fn);
    require(first_position >= 0, fn, "'first_position' = ", first_position, " is negative");
    if (THPVariable_Check(routed_experts.ptr())) {
      const at::Tensor t = routed_experts.cast<at::Tensor>();
      mrr::torch::detail::require_cpu(t, fn, "routed_experts");
      require(t.dim() == 3, fn, "'routed_experts' must be 3-D [tokens, layers, k], got ",
              mrr::torch::detail::text(t.sizes()));
      const at::ScalarType st = t.scalar_type();
      require(st == at::kInt || st == at::kLong || st == at::kShort || st == at::kByte, fn,
              "'routed_experts' has dtype ", mrr::torch::detail::text(st),
              "; expected int32, uint8, uint16 (numpy), int16 or int64");
      const at::Tensor c = t.contiguous();
      AT_DISPATCH_INTEGRAL_TYPES(st, "import_vllm", [&] {
        import_ids<scalar_t>(uid,
                             std::span<const scalar_t>(c.data_ptr<scalar_t>(), static_cast<std::size_t>(c.numel())),
                             c.size(0), c.size(1), c.size(2), first_position, moe_layers);
      });
      return;
    }
    require(py::isinstance<py::array>(routed_experts), fn,
            "'routed_experts' must be a torch tensor or a numpy array, got ",
            py::str(routed_experts.get_type()).cast<std::string>());
    const auto a = routed_experts.cast<py::array>();
    require(a.ndim() == 3, fn, "'routed_experts' must be 3-D [tokens, layers, k], got ", a.ndim(), " dimensions");
    const char kind = a.dtype().kind();
    const auto size = a.dtype().itemsize();
    auto run = [&](auto tag) {
      using Int = decltype(tag);
      const auto c = py::array_t<Int, py::array::c_style>::ensure(a);
      if (!c) throw py::error_already_set();
      import_ids<Int>(uid, std::span<const Int>(c.data(), static_cast<std::size_t>(c.size())), c.shape(0), c.shape(1),
                      c.shape(2), first_position, moe_layers);
    };
    if (kind == 'i' && size == 4) return run(std::int32_t{});
    if (kind == 'i' && size == 8) return run(std::int64_t{});
    if (kind == 'i' && size == 2) return run(std::int16_t{});
    if (kind == 'u' && size == 1) return run(std::uint8_t{});
    if (kind == 'u' && size == 2) return run(std::uint16_t{});
    if (kind == 'u' && size == 4) return run(std::uint32_t{});
    throw_invalid_argument(fn, "'routed_experts' has numpy dtype ", py::str(a.dtype()).cast<std::string>(),
                           "; expected int32, uint8, uint16 or int64");
  }

  // SGLang's meta_info["routed_experts"]: base64 of int32 [rows, layers, k] (little-endian, as
  // numpy's tobytes on the hosts SGLang runs on) covering positions [start_len, start_len + rows).
  // SGLang's capturer holds a row per decoder layer: with moe_layers, num_hidden_layers (the
  // payload's layer count) is needed too.
  void import_sglang(const py::int_& uid_in, const py::object& payload, std::int64_t start_len,
                     const py::object& moe_layers_in, const py::object& num_hidden_layers) {
    constexpr const char* fn = "RouteFile.import_sglang";
    const mrr::SequenceId uid = sequence_id(uid_in, fn);
    require(start_len >= 0, fn, "'start_len' = ", start_len, " is negative");
    const std::vector<int> moe_layers = layer_list(moe_layers_in, fn);
    require(moe_layers.empty() == num_hidden_layers.is_none(), fn,
            "give 'moe_layers' and 'num_hidden_layers' together (the payload's rows hold every decoder layer), "
            "or neither");
    std::string text;
    if (py::isinstance<py::str>(payload) || py::isinstance<py::bytes>(payload))
      text = payload.cast<std::string>();
    else
      throw_invalid_argument(fn, "'payload' must be a base64 str or bytes, got ",
                             py::str(payload.get_type()).cast<std::string>());
    const std::vector<unsigned char> bytes = decode_base64(text, fn, "payload");
    std::int64_t layers = shape().num_layers;
    if (!moe_layers.empty()) {
      require(py::isinstance<py::int_>(num_hidden_layers), fn, "'num_hidden_layers' must be an int");
      layers = num_hidden_layers.cast<std::int64_t>();
      require(layers >= 1 && layers <= 65535, fn, "'num_hidden_layers' = ", layers, " is outside [1, 65535]");
    }
    const std::int64_t k = shape().topk;
    const auto row_bytes = static_cast<std::size_t>(layers * k) * sizeof(std::int32_t);
    require(bytes.size() % row_bytes == 0, fn, "sequence ", uid, ": 'payload' decodes to ", bytes.size(),
            " bytes, not a whole number of int32 rows of [", layers, " layers, k = ", k, "] (", row_bytes,
            " bytes each)");
    std::vector<std::int32_t> ids(bytes.size() / sizeof(std::int32_t));
    if (!bytes.empty()) std::memcpy(ids.data(), bytes.data(), bytes.size());
    const auto rows = static_cast<std::int64_t>(bytes.size() / row_bytes);
    import_ids<std::int32_t>(uid, ids, rows, layers, k, start_len, moe_layers);
  }

  void flush() {
    if (auto* f = store.file(); f && f->writable()) f->sync();
  }
  void close() {
    if (auto* f = store.file()) f->close();
  }
};

std::shared_ptr<RouteFile> open_route_file(const py::dict& config, int num_experts, int num_layers, int topk) {
  mrr::RouteShape shape{num_experts, num_layers, topk};
  shape.validate();
  return std::make_shared<RouteFile>(replay_config(config), shape);
}

// ---------------------------------------------------------------------------------------------
// Replay controller

mrr::TrainingPass parse_pass(std::string_view name) {
  if (name == "old_log_prob") return mrr::TrainingPass::old_log_prob;
  if (name == "actor_update") return mrr::TrainingPass::actor_update;
  if (name == "actor_recompute") return mrr::TrainingPass::actor_recompute;
  if (name == "ref_log_prob") return mrr::TrainingPass::ref_log_prob;
  throw_invalid_argument("Replay.begin_pass", "unknown pass '", name,
                         "' (expected old_log_prob, actor_update, actor_recompute or ref_log_prob)");
}

mrr::RouterAction parse_action(std::string_view name) {
  for (auto a : {mrr::RouterAction::native, mrr::RouterAction::record, mrr::RouterAction::replay_forward,
                 mrr::RouterAction::replay_backward})
    if (name == mrr::to_string(a)) return a;
  throw_invalid_argument("Replay.set_action", "unknown action '", name,
                         "' (expected native, record, replay_forward or replay_backward)");
}

mrr::MissingRoutes parse_missing(std::string_view name) {
  if (name == "error") return mrr::MissingRoutes::error;
  if (name == "native_last_position") return mrr::MissingRoutes::native_last_position;
  if (name == "native") return mrr::MissingRoutes::native;
  throw_invalid_argument("Replay", "unknown missing-route policy '", name,
                         "' (expected error, native_last_position or native)");
}

struct Replay {
  std::shared_ptr<RouteFile> file;  // the store RoutingReplay points into
  mrr::RoutingReplay<mrr::AnyRouteStore> replay;

  static mrr::ReplayMode mode_of(const RouteFile& f, const std::optional<std::string>& mode) {
    return mode ? mrr::parse_replay_mode(*mode) : f.config.mode;
  }
  static mrr::MissingRoutes missing_of(mrr::ReplayMode mode, const std::optional<std::string>& missing) {
    if (missing) return parse_missing(*missing);
    return mode == mrr::ReplayMode::R3 ? mrr::MissingRoutes::native_last_position : mrr::MissingRoutes::error;
  }

  Replay(std::shared_ptr<RouteFile> f, const std::optional<std::string>& mode, const std::optional<std::string>& missing)
      : file(std::move(f)),
        replay(mode_of(*file, mode), file->store, missing_of(mode_of(*file, mode), missing)) {}

  py::dict stats() const {
    const mrr::ReplayStats& s = replay.stats();
    py::dict d;
    d["recorded_rows"] = s.recorded_rows;
    d["replayed_rows"] = s.replayed_rows;
    d["native_rows"] = s.native_rows;
    d["mask_free_replays"] = s.mask_free_replays;
    return d;
  }
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "mrr (MoE routing replay) for PyTorch: routers, route stores, rollout imports, replay";
  mrr::torch::register_exceptions(m);
#ifdef MRR_TORCH_WITH_CUDA
  m.attr("has_cuda") = true;
#else
  m.attr("has_cuda") = false;
#endif

  py::class_<Router, std::shared_ptr<Router>>(m, "Router", "A top-k MoE router (mrr::TopKRouter<float>).")
      .def(py::init(&make_router), py::arg("num_experts"), py::arg("topk"), py::arg("score_function") = "softmax",
           py::arg("pre_softmax") = false, py::arg("normalize_topk") = py::none(),
           py::arg("scaling_factor") = py::none(), py::arg("num_groups") = 0, py::arg("group_topk") = 0,
           py::arg("use_expert_bias") = false)
      .def_property_readonly("num_experts", [](const Router& r) { return r.router.num_experts(); })
      .def_property_readonly(
          "expert_bias",
          [](const Router& r) {
            const std::vector<float> b = r.bias();
            return ::torch::tensor(b, ::torch::dtype(::torch::kFloat32));
          },
          "The selection-only expert bias (float32 [num_experts] on the CPU; empty without use_expert_bias).")
      .def(
          "set_expert_bias",
          [](Router& r, const at::Tensor& bias) {
            mrr::detail::require(bias.dim() == 1, "Router.set_expert_bias", "'bias' must be 1-D [num_experts], got ",
                                 bias.dim(), " dimensions");
            const at::Tensor host = bias.detach().to(at::kCPU, at::kFloat).contiguous();
            const float* data = host.data_ptr<float>();
            r.set_expert_bias(std::vector<float>(data, data + host.numel()));
          },
          py::arg("bias"),
          "Sets the selection-only expert bias (DeepSeek-V3's e_score_correction_bias, Megatron's expert_bias): "
          "num_experts finite values, any device and float dtype; the router needs use_expert_bias=True. It moves "
          "which experts are chosen, not their weights; the CUDA router gets the same values.")
      .def(
          "set_expert_bias", [](Router& r, const std::vector<float>& bias) { r.set_expert_bias(bias); },
          py::arg("bias"), "The same from a sequence of floats.")
      .def_property_readonly("topk", [](const Router& r) { return r.router.topk(); })
      .def(
          "route",
          [](const std::shared_ptr<Router>& r, const at::Tensor& logits, bool check) {
#ifdef MRR_TORCH_WITH_CUDA
            if (is_cuda_input(logits, "Router.route"))
              return as_tuple(mrr_torch_ext::cuda_route(r->on_cuda(), logits, check), r, !check);
#else
            (void)check;
            is_cuda_input(logits, "Router.route");
#endif
            return as_tuple(mrr::torch::route(r->router, logits), r);
          },
          py::arg("logits"), py::arg("check") = true,
          "Native routing of logits [T, E] (float32; on CUDA also bfloat16): (weights [T, k] with autograd, ids int64 "
          "[T, k]), on the logits' device (CUDA: the current stream). check=False (CUDA only; the CPU always "
          "checks) skips the one synchronisation that turns a bad row into an error and returns (weights, ids, "
          "status): status [T] uint8, 0 where the row was routed.")
      .def(
          "replay",
          [](const std::shared_ptr<Router>& r, const at::Tensor& logits, const at::Tensor& ids, bool check) {
#ifdef MRR_TORCH_WITH_CUDA
            if (is_cuda_input(logits, "Router.replay"))
              return as_tuple(mrr_torch_ext::cuda_replay(r->on_cuda(), logits, ids, check), r, !check);
#else
            (void)check;
            is_cuda_input(logits, "Router.replay");
#endif
            return as_tuple(mrr::torch::replay(r->router, logits, ids), r);
          },
          py::arg("logits"), py::arg("ids"), py::arg("check") = true,
          "The weights the router gives the experts `ids` [T, k]: (weights, ids int64). check as in route.");

  m.def("validate_ids", &validate_ids, py::arg("ids"), py::arg("num_experts"),
        "Raises InvalidArgumentError unless ids [rows, k] are in [0, num_experts) (in their own dtype) and no row "
        "repeats an expert.");

  py::class_<RouteFile, std::shared_ptr<RouteFile>>(
      m, "RouteFile", "A route store: a route file (record_file / replay_file) or memory.")
      .def_property_readonly("mode", [](const RouteFile& f) { return std::string(mrr::to_string(f.config.mode)); })
      .def_property_readonly("is_file", [](const RouteFile& f) { return f.store.is_file(); })
      .def_property_readonly("record_file",
                             [](const RouteFile& f) -> py::object {
                               return f.config.record_file.empty() ? py::object(py::none()) : py::str(f.config.record_file);
                             })
      .def_property_readonly("replay_file",
                             [](const RouteFile& f) -> py::object {
                               return f.config.replay_file.empty() ? py::object(py::none()) : py::str(f.config.replay_file);
                             })
      .def_property_readonly("enable_rollout_routing_replay",
                             [](const RouteFile& f) { return f.config.enable_rollout_routing_replay; })
      .def_property_readonly("num_experts", [](const RouteFile& f) { return f.shape().num_experts; })
      .def_property_readonly("num_layers", [](const RouteFile& f) { return f.shape().num_layers; })
      .def_property_readonly("topk", [](const RouteFile& f) { return f.shape().topk; })
      .def("record", &RouteFile::record, py::arg("layer"), py::arg("uids"), py::arg("positions"), py::arg("ids"),
           "Records ids [rows, k] of tokens (uids[i], positions[i]) in `layer`.")
      .def("lookup", &RouteFile::lookup, py::arg("layer"), py::arg("uids"), py::arg("positions"),
           py::arg("dtype") = py::none(),
           "(ids [rows, k], found bool [rows]). ids: int64 by default, or dtype=torch.int32 / torch.uint8 "
           "(uint8 when every expert id fits; 1-byte route files copy rows out without widening); rows not "
           "found are -1 (255 in uint8).")
      .def(
          "recorded_positions",
          [](const RouteFile& f, const py::int_& uid) {
            return f.store.recorded_positions(sequence_id(uid, "RouteFile.recorded_positions"));
          },
          py::arg("uid"))
      .def(
          "contains",
          [](const RouteFile& f, const py::int_& uid) {
            return f.store.contains(sequence_id(uid, "RouteFile.contains"));
          },
          py::arg("uid"))
      .def(
          "end_step", [](RouteFile& f) { f.store.end_step(); },
          "A training step ended: memory forgets its routes, a file its read cache.")
      .def("flush", &RouteFile::flush, "Asks the device to persist what was appended (records are written through).")
      .def("close", &RouteFile::close, "Writes the file's index and releases its write lock (it stays readable).")
      .def("import_vllm", &RouteFile::import_vllm, py::arg("uid"), py::arg("routed_experts"),
           py::arg("first_position") = 0, py::arg("moe_layers") = py::none(),
           "Stores vLLM's routed_experts [n - 1, layers, k] for sequence `uid`; moe_layers: the array's layers "
           "that are MoE layers, when it has a row per decoder layer (dense ones included).")
      .def("import_sglang", &RouteFile::import_sglang, py::arg("uid"), py::arg("payload"), py::arg("start_len") = 0,
           py::arg("moe_layers") = py::none(), py::arg("num_hidden_layers") = py::none(),
           "Stores SGLang's base64 meta_info['routed_experts'] (int32 [rows, layers, k]) from position start_len; "
           "with a row per decoder layer (SGLang's capturer), give moe_layers and num_hidden_layers.");

  m.def("open_route_file", &open_route_file, py::arg("config"), py::arg("num_experts"), py::arg("num_layers"),
        py::arg("topk"),
        "A RouteFile from verl's router-replay keys (short, e.g. mode, or full, e.g. "
        "actor_rollout_ref.actor.router_replay.mode).");

  py::class_<Replay>(m, "Replay", "The replay controller (mrr::RoutingReplay) over a RouteFile.")
      .def(py::init<std::shared_ptr<RouteFile>, const std::optional<std::string>&, const std::optional<std::string>&>(),
           py::arg("route_file"), py::arg("mode") = py::none(), py::arg("missing") = py::none(), py::keep_alive<1, 2>())
      .def_property_readonly("mode", [](const Replay& r) { return std::string(mrr::to_string(r.replay.mode())); })
      .def_property_readonly("action", [](const Replay& r) { return std::string(mrr::to_string(r.replay.action())); })
      .def(
          "begin_pass", [](Replay& r, const std::string& name) { r.replay.begin_pass(parse_pass(name)); },
          py::arg("name"))
      .def(
          "set_action",
          [](Replay& r, const std::string& name, bool queue_for_recompute) {
            r.replay.set_action(parse_action(name), queue_for_recompute);
          },
          py::arg("name"), py::arg("queue_for_recompute") = true)
      .def(
          "set_activation_recompute", [](Replay& r, bool on) { r.replay.set_activation_recompute(on); }, py::arg("on"))
      .def(
          "set_activation_recompute",
          [](Replay& r, const std::vector<int>& layers) { r.replay.set_activation_recompute(layers); },
          py::arg("layers"))
      .def(
          "activation_recompute",
          [](const Replay& r, std::optional<int> layer) {
            return layer ? r.replay.activation_recompute(*layer) : r.replay.activation_recompute();
          },
          py::arg("layer") = py::none())
      .def(
          "set_micro_batch_padded",
          [](Replay& r, const at::Tensor& uids, const at::Tensor& attention_mask) {
            r.replay.set_micro_batch(mrr::torch::padded_layout(uids, attention_mask));
          },
          py::arg("uids"), py::arg("attention_mask"))
      .def(
          "set_micro_batch_packed",
          [](Replay& r, const at::Tensor& uids, const at::Tensor& cu_seqlens, const std::optional<at::Tensor>& first,
             std::int64_t total_rows) {
            r.replay.set_micro_batch(
                mrr::torch::packed_layout(uids, cu_seqlens, first ? *first : at::Tensor(), total_rows));
          },
          py::arg("uids"), py::arg("cu_seqlens"), py::arg("first_positions") = py::none(), py::arg("total_rows") = -1)
      .def(
          "route",
          [](Replay& r, const std::shared_ptr<Router>& router, int layer, const at::Tensor& logits) {
#ifdef MRR_TORCH_WITH_CUDA
            if (is_cuda_input(logits, "Replay.route"))
              return as_tuple(mrr_torch_ext::cuda_replay_route(r.replay, router->on_cuda(), layer, logits), router);
#else
            is_cuda_input(logits, "Replay.route");
#endif
            return as_tuple(mrr::torch::route(r.replay, router->router, layer, logits), router);
          },
          py::arg("router"), py::arg("layer"), py::arg("logits"))
      .def("stats", &Replay::stats)
      .def(
          "queued", [](const Replay& r, int layer) { return r.replay.queued(layer); }, py::arg("layer"))
      .def("clear_queues", [](Replay& r) { r.replay.clear_queues(); })
      .def(
          "revert_route", [](Replay& r, int layer) { r.replay.revert_route(layer); }, py::arg("layer"),
          "Undoes what the layer's last route call did to its recompute queue: call it when the forward fails "
          "after routing (the ids it queued are dropped, the ids a recompute took are queued again).");
}
