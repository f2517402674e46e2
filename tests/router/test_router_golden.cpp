// Parity with Megatron-Core's topk_routing_with_score_function (router.json), its aux losses
// (router_loss.json), permute/unpermute (permute.json) and Hugging Face gates (hf_gate.json).
#include <mrr/router.hpp>

#include <support/golden.hpp>
#include <support/ties.hpp>

#include <algorithm>
#include <numeric>
#include <type_traits>
#include <vector>

using mrr::test::GoldenCase;
using mrr::test::check_close;
using mrr::test::load_golden;

namespace {

mrr::RouterConfig megatron_config(const GoldenCase& c, int num_experts, bool with_bias) {
  mrr::RouterConfig cfg;
  cfg.num_experts = num_experts;
  cfg.topk = c.param<int>("topk");
  cfg.score_function = mrr::parse_score_function(c.param<std::string>("score_function", "softmax"));
  cfg.pre_softmax = c.param<bool>("use_pre_softmax", false);
  cfg.num_groups = c.param<int>("num_groups", 0);
  cfg.group_topk = c.param<int>("group_topk", 0);
  if (c.has_param("scaling_factor")) cfg.scaling_factor = c.param<double>("scaling_factor");
  cfg.use_expert_bias = with_bias;
  return cfg;
}

// What Megatron rounds to float32 before its first transcendental, as doubles: the logits and, for
// softmax, x - max over the entries its softmax takes (the whole row; post-softmax, the selected
// experts `ids`). Softmax is shift-invariant, so a softmax of these rows is Megatron's function of
// its own float32 inputs.
mrr::RowMatrix<double> megatron_fp32_inputs(const mrr::RowMatrix<double>& logits, mrr::ScoreFunction score,
                                            const mrr::ExpertIds* ids) {
  const auto f32 = [](double v) { return static_cast<double>(static_cast<float>(v)); };
  mrr::RowMatrix<double> z = logits.unaryExpr(f32);
  if (score != mrr::ScoreFunction::softmax) return z;
  for (Eigen::Index t = 0; t < z.rows(); ++t) {
    double m = ids ? z(t, (*ids)(t, 0)) : z.row(t).maxCoeff();
    for (Eigen::Index j = 1; ids && j < ids->cols(); ++j)
      m = std::max(m, z(t, (*ids)(t, j)));
    for (Eigen::Index e = 0; e < z.cols(); ++e)
      z(t, e) = f32(z(t, e) - m);
  }
  return z;
}

// Megatron computes router probabilities in float32 (see check_close_fp32_reference): the double
// run is held to the case tolerance plus that documented float32 error, next to a run on
// Megatron's float32-rounded inputs (replayed at the same ids); the float run to 1e-5.
template <class T>
bool check_probs(const mrr::TopKRouter<T>& router, const mrr::RowMatrix<T>& ours, const mrr::RowMatrix<T>& logits,
                 const mrr::ExpertIds& ids, const GoldenCase& c, double rtol, double atol) {
  if constexpr (std::is_same_v<T, double>) {
    const auto& cfg = router.config();
    const auto rounded = megatron_fp32_inputs(logits, cfg.score_function, cfg.pre_softmax ? nullptr : &ids);
    return mrr::test::check_close_fp32_reference(ours, router.replay(rounded, ids).weights, c.output("probs"), rtol,
                                                 atol, router.num_experts(), c.name + " probs");
  } else {
    return check_close(ours, c.output("probs"), rtol, atol, c.name + " probs");
  }
}

template <class T>
void run_router_case(const GoldenCase& c, double rtol, double atol) {
  const auto logits = c.input("logits").matrix<T>();
  const bool with_bias = c.has_input("expert_bias");
  mrr::TopKRouter<T> router(megatron_config(c, static_cast<int>(logits.cols()), with_bias));
  if (with_bias) router.set_expert_bias(c.input("expert_bias").vector<T>());
  if (c.fn == "topk_routing") {
    const auto r = router.route(logits);
    const mrr::ExpertIds golden = c.output("indices").matrix<std::int32_t>();
    const auto ties = mrr::test::compare_ids_up_to_ties(
        r.ids, golden, mrr::test::case_selection_scores(c, router.config(), "logits", "expert_bias"),
        mrr::test::GroupLimit::of(router.config()), true, c.name + " indices");
    CHECK(ties.ok);
    // Where Megatron broke a float32 tie its own way, our weights at its ids.
    mrr::ExpertIds ids = r.ids;
    mrr::RowMatrix<T> weights = r.weights;
    if (ties.ok && ties.tied_rows != 0) {
      const auto at_golden = router.replay(logits, golden);
      for (Eigen::Index t = 0; t < ids.rows(); ++t)
        if (ties.tied[static_cast<std::size_t>(t)]) {
          ids.row(t) = golden.row(t);
          weights.row(t) = at_golden.weights.row(t);
        }
    }
    CHECK(check_probs(router, weights, logits, ids, c, rtol, atol));
  } else if (c.fn == "topk_routing_replay") {
    const auto ids = c.input("indices").matrix<std::int32_t>();
    const auto r = router.replay(logits, ids);
    CHECK(r.ids == ids);
    CHECK(check_probs(router, r.weights, logits, ids, c, rtol, atol));
  } else {
    FAIL("router.json case " << c.name << " has unhandled fn " << c.fn);
  }
}

}  // namespace

TEST_SUITE("golden") {
  TEST_CASE("router.json: Megatron top-k routing and replay (double; exact ids, probs to the fp32 reference)") {
    for (const auto& c : load_golden("router.json")) {
      mrr::test::guarded(c, [&] {
        CAPTURE(c.name);
        run_router_case<double>(c, c.rtol, c.atol);
      });
    }
  }

  TEST_CASE("router.json: float routing picks the same experts, weights within rtol 1e-5") {
    for (const auto& c : load_golden("router.json")) {
      mrr::test::guarded(c, [&] {
        CAPTURE(c.name);
        run_router_case<float>(c, 1e-5, 1e-6);
      });
    }
  }

  TEST_CASE("router_loss.json: switch load-balancing loss and z-loss with gradients") {
    for (const auto& c : load_golden("router_loss.json")) {
      mrr::test::guarded(c, [&] {
        CAPTURE(c.name);
        const auto logits = c.input("logits").matrix<double>();
        if (c.fn == "switch_load_balancing_loss") {
          const int topk = c.param<int>("topk");
          REQUIRE(c.param<int>("num_experts") == logits.cols());
          const auto sf = mrr::parse_score_function(c.param<std::string>("score_function"));
          const double coeff = c.param<double>("coeff");
          const auto s = mrr::routing_scores_for_aux_loss<double>(logits, topk, sf);
          // Scores, loss and grad_scores come from Megatron's float32 score path (its softmax over
          // the whole row); `rounded`: the same on Megatron's float32-rounded inputs.
          const int experts = static_cast<int>(logits.cols());
          const auto rounded =
              mrr::routing_scores_for_aux_loss<double>(megatron_fp32_inputs(logits, sf, nullptr), topk, sf);
          // The map: exact, or a float32 tie of Megatron's top-k broken its own way. Then the loss
          // and its gradient are checked at Megatron's counts (they depend on which expert won).
          const auto golden_map = c.output("routing_map").matrix<std::uint8_t>();
          // Megatron's aux-loss scores: the softmax over the row, or sigmoid / sqrt-softplus scores
          // divided by their row sum (+1e-20), modelled with its float32 intermediates.
          mrr::RouterConfig score_cfg;
          score_cfg.score_function = sf;
          score_cfg.pre_softmax = true;
          const auto f32 = [](double v) { return static_cast<double>(static_cast<float>(v)); };
          auto ranked = mrr::test::reference_selection_scores(score_cfg, logits.unaryExpr(f32), nullptr);
          if (sf != mrr::ScoreFunction::softmax)
            for (Eigen::Index t = 0; t < ranked.rows(); ++t)
              ranked.row(t) /= ranked.row(t).sum() + 1e-20;
          const auto ties = mrr::test::compare_ids_up_to_ties(mrr::test::map_to_ids(s.routing_map, topk),
                                                              mrr::test::map_to_ids(golden_map, topk), ranked, {},
                                                              false, c.name + " routing_map");
          CHECK(ties.ok);
          if (ties.tied_rows == 0)
            CHECK(check_close(s.routing_map, c.output("routing_map"), 0, 0, c.name + " routing_map"));
          CHECK(mrr::test::check_close_fp32_reference(s.scores, rounded.scores, c.output("scores"), c.rtol, c.atol,
                                                      experts, c.name + " scores"));
          const mrr::Vector<double> counts = ties.tied_rows == 0
                                                 ? s.tokens_per_expert
                                                 : mrr::Vector<double>(c.output("tokens_per_expert").vector<double>());
          if (ties.tied_rows == 0)
            CHECK(check_close(s.tokens_per_expert.transpose(), c.output("tokens_per_expert"), 0, 0,
                              c.name + " tokens_per_expert"));
          else
            CHECK(s.tokens_per_expert.transpose() == s.routing_map.cast<double>().colwise().sum());
          const double total = static_cast<double>(logits.rows());
          const double loss = mrr::switch_load_balancing_loss<double>(s.scores, counts, total, topk, coeff);
          Eigen::Matrix<double, 1, 1> loss_m, rounded_loss;
          loss_m(0, 0) = loss;
          rounded_loss(0, 0) = mrr::switch_load_balancing_loss<double>(rounded.scores, counts, total, topk, coeff);
          CHECK(mrr::test::check_close_fp32_reference(loss_m, rounded_loss, c.output("loss"), c.rtol, c.atol, experts,
                                                      c.name + " loss"));
          // The gradient w.r.t. the scores does not depend on them: nothing of the inputs is rounded.
          const auto grad =
              mrr::switch_load_balancing_loss_grad_scores<double>(logits.rows(), counts, total, topk, coeff);
          CHECK(mrr::test::check_close_fp32_reference(grad, grad, c.output("grad_scores"), c.rtol, c.atol, experts,
                                                      c.name + " grad_scores"));
          // The full loss from logits agrees with the pieces (at its own counts).
          const double own = mrr::switch_load_balancing_loss<double>(s.scores, s.tokens_per_expert, total, topk, coeff);
          CHECK(mrr::switch_aux_loss<double>(logits, topk, sf, coeff).loss == doctest::Approx(own).epsilon(1e-12));
        } else if (c.fn == "z_loss") {
          const auto z = mrr::z_loss<double>(logits, c.param<double>("coeff"));
          CHECK(check_close(z.loss, c.output("loss"), c.rtol, c.atol, c.name + " loss"));
          CHECK(check_close(z.grad_logits, c.output("grad_logits"), c.rtol, c.atol, c.name + " grad_logits"));
        } else {
          FAIL("router_loss.json case " << c.name << " has unhandled fn " << c.fn);
        }
      });
    }
  }

  TEST_CASE("router_capacity.json: expert bias update") {
    for (const auto& c : load_golden("router_capacity.json", "expert_bias_update")) {
      mrr::test::guarded(c, [&] {
        CAPTURE(c.name);
        const auto counts = c.input("tokens_per_expert").vector<double>();
        const auto bias = c.input("expert_bias").vector<double>();
        const auto updated =
            mrr::TopKRouter<double>::updated_expert_bias<double>(counts, bias, c.param<double>("update_rate"));
        CHECK(check_close(updated.transpose(), c.output("expert_bias"), c.rtol, c.atol, c.name + " expert_bias"));
      });
    }
  }

  TEST_CASE("permute.json: expert-major permute and weighted unpermute") {
    for (const auto& c : load_golden("permute.json")) {
      mrr::test::guarded(c, [&] {
        CAPTURE(c.name);
        const auto map = c.input("routing_map").matrix<std::uint8_t>();
        const auto probs = c.input("probs").matrix<double>();
        if (c.fn == "permute") {
          const auto tokens = c.input("tokens").matrix<double>();
          const auto p = mrr::permute<double>(tokens, map, mrr::MatrixRef<double>(probs));
          CHECK(static_cast<long>(p.sorted_indices.size()) == c.param<long>("num_out_tokens"));
          CHECK(check_close(p.tokens, c.output("permuted_tokens"), c.rtol, c.atol, c.name + " permuted_tokens"));
          CHECK(
              check_close(p.probs.transpose(), c.output("permuted_probs"), c.rtol, c.atol, c.name + " permuted_probs"));
          Eigen::Map<const Eigen::Matrix<std::int64_t, 1, Eigen::Dynamic>> idx(
              p.sorted_indices.data(), static_cast<long>(p.sorted_indices.size()));
          CHECK(check_close(idx, c.output("sorted_indices"), 0, 0, c.name + " sorted_indices"));
        } else if (c.fn == "unpermute") {
          const auto permuted = c.input("permuted_tokens").matrix<double>();
          const auto sorted = c.input("sorted_indices").values<std::int64_t>();
          const auto out =
              mrr::unpermute<double>(permuted, sorted, map.rows(), mrr::MatrixRef<double>(probs), mrr::MaskRef(map));
          CHECK(check_close(out, c.output("tokens"), c.rtol, c.atol, c.name + " tokens"));
        } else {
          FAIL("permute.json case " << c.name << " has unhandled fn " << c.fn);
        }
      });
    }
  }
}

namespace {

mrr::RouterConfig hf_config(const GoldenCase& c) {
  const auto& name = c.name;
  if (name.rfind("deepseek_v3", 0) == 0)
    return mrr::presets::deepseek_v3(c.param<int>("n_routed_experts"), c.param<int>("num_experts_per_tok"),
                                     c.param<int>("n_group"), c.param<int>("topk_group"), c.param<bool>("norm_topk_prob"),
                                     c.param<double>("routed_scaling_factor"));
  if (name.rfind("qwen3_moe", 0) == 0)
    return mrr::presets::qwen3_moe(c.param<int>("num_experts"), c.param<int>("num_experts_per_tok"),
                                   c.param<bool>("norm_topk_prob"));
  if (name.rfind("qwen2_moe", 0) == 0)
    return mrr::presets::qwen2_moe(c.param<int>("num_experts"), c.param<int>("num_experts_per_tok"),
                                   c.param<bool>("norm_topk_prob"));
  if (name.rfind("mixtral", 0) == 0)
    return mrr::presets::mixtral(c.param<int>("num_local_experts"), c.param<int>("num_experts_per_tok"));
  throw std::runtime_error("hf_gate.json case " + name + " names no known model family");
}

// HF uses unsorted top-k; the golden lists each token's slots by expert id: a routing sorted so.
template <class T>
void sort_slots_by_id(mrr::Routing<T>& r) {
  const mrr::ExpertIds ids = r.ids;
  const mrr::RowMatrix<T> w = r.weights;
  for (Eigen::Index t = 0; t < ids.rows(); ++t) {
    std::vector<int> order(static_cast<std::size_t>(ids.cols()));
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](int a, int b) { return ids(t, a) < ids(t, b); });
    for (Eigen::Index j = 0; j < ids.cols(); ++j) {
      r.ids(t, j) = ids(t, order[static_cast<std::size_t>(j)]);
      r.weights(t, j) = w(t, order[static_cast<std::size_t>(j)]);
    }
  }
}

template <class T>
void run_hf_case(const GoldenCase& c) {
  mrr::TopKRouter<T> router(hf_config(c));
  if (c.has_input("e_score_correction_bias")) router.set_expert_bias(c.input("e_score_correction_bias").vector<T>());
  const auto logits = c.input("router_logits").matrix<T>();
  auto r = router.route(logits);
  sort_slots_by_id(r);
  // The ids: exact, or a float32 tie of HF's top-k (float32 probabilities or biased sigmoid
  // scores, zero-filled dropped groups) broken its own way; then our weights at its ids.
  const mrr::ExpertIds golden = c.output("indices").matrix<std::int32_t>();
  const auto ties = mrr::test::compare_ids_up_to_ties(
      r.ids, golden, mrr::test::case_selection_scores(c, router.config(), "router_logits", "e_score_correction_bias"),
      mrr::test::GroupLimit::of(router.config()), false, c.name + " indices");
  CHECK(ties.ok);
  if (ties.ok && ties.tied_rows != 0) {
    const auto at_golden = router.replay(logits, golden);
    for (Eigen::Index t = 0; t < golden.rows(); ++t)
      if (ties.tied[static_cast<std::size_t>(t)]) {
        r.ids.row(t) = golden.row(t);
        r.weights.row(t) = at_golden.weights.row(t);
      }
  }
  CHECK(check_close(r.weights, c.output("weights"), c.rtol, c.atol, c.name + " weights"));
}

}  // namespace

TEST_SUITE("golden") {
  TEST_CASE("hf_gate.json: DeepSeek-V3, Qwen3-MoE, Qwen2-MoE and Mixtral gates (float and double)") {
    for (const auto& c : load_golden("hf_gate.json")) {
      mrr::test::guarded(c, [&] {
        CAPTURE(c.name);
        REQUIRE(c.fn == "hf_gate");
        run_hf_case<float>(c);
        run_hf_case<double>(c);
      });
    }
  }
}
