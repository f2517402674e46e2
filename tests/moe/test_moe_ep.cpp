// Expert parallelism: the layer's output and every gradient are bitwise the same on 1, 2 and 4
// ranks (SingleProcess and InProcessGroup), routes recorded on 4 ranks replay bitwise on 1 and 2
// (memory and file stores), and a bad configuration or input on one rank is an error on every rank.
#include <mrr/comm/in_process.hpp>
#include <mrr/moe.hpp>
#include <mrr/replay.hpp>
#include <mrr/router.hpp>

#include <doctest/doctest.h>

#include "../replay/temp_dir.hpp"
#include "moe_fixture.hpp"

#include <atomic>
#include <limits>
#include <string>
#include <vector>

using mrr::RowMatrix;
using mrr::test::bitwise_equal;
using mrr::test::check_same;
using mrr::test::MoEModel;
using mrr::test::MoEResult;

namespace {

// InProcessComm without all_to_all_rows: the layer then stages its exchanges through
// all_to_all_v (as with NCCL or a user's communicator). Both paths must give the same bits.
struct StagingComm {
  mrr::InProcessComm comm;
  int rank() const { return comm.rank(); }
  int size() const { return comm.size(); }
  void barrier() const { comm.barrier(); }
  template <class T>
  void all_reduce_sum(std::span<T> d) const {
    comm.all_reduce_sum(d);
  }
  template <class T>
  void all_gather(std::span<const T> s, std::span<T> r) const {
    comm.all_gather(s, r);
  }
  template <class T>
  void broadcast(std::span<T> d, int root) const {
    comm.broadcast(d, root);
  }
  template <class T>
  void all_to_all_v(std::span<const T> s, std::span<const std::size_t> sc, std::span<T> r,
                    std::span<const std::size_t> rc) const {
    comm.all_to_all_v(s, sc, r, rc);
  }
};
static_assert(mrr::Communicator<StagingComm> && !mrr::RowCommunicator<StagingComm, float>);
static_assert(mrr::RowCommunicator<mrr::InProcessComm, float>);

template <class S>
MoEResult<S> run_group(const MoEModel<S>& m, const RowMatrix<S>& x, const RowMatrix<S>& gy, int ranks,
                       bool staging = false) {
  MoEResult<S> out(x.rows(), m.hidden, m.num_experts(), m.topk(), ranks);
  mrr::InProcessGroup(ranks).run([&](const mrr::InProcessComm& comm) {
    if (staging) {
      auto layer = m.layer(StagingComm{comm});
      mrr::test::run_rank(layer, x, gy, out);
    } else {
      auto layer = m.layer(comm);
      mrr::test::run_rank(layer, x, gy, out);
    }
  });
  return out;
}

template <class S>
void check_ep_invariance(const mrr::RouterConfig& config, int hidden, int intermediate, Eigen::Index tokens) {
  CAPTURE(hidden);
  CAPTURE(tokens);
  const auto m = MoEModel<S>::random(config, hidden, intermediate, 7);
  const RowMatrix<S> x = mrr::test::random_normal<S>(tokens, hidden, 8);
  const RowMatrix<S> gy = mrr::test::random_normal<S>(tokens, hidden, 9);
  MoEResult<S> single(tokens, hidden, m.num_experts(), m.topk(), 1);
  auto layer = m.layer(mrr::SingleProcess{});
  mrr::test::run_rank(layer, x, gy, single);
  CHECK(single.output.allFinite());
  CHECK(!single.output.isZero());
  for (int ranks : {1, 2, 4}) {
    CAPTURE(ranks);
    auto group = run_group(m, x, gy, ranks);
    check_same(single, group);
    if (ranks > 1) check_same(single, run_group(m, x, gy, ranks, /*staging=*/true));
  }
}

}  // namespace

TEST_CASE_TEMPLATE("MoELayer: output and every gradient are bitwise the same on 1, 2 and 4 ranks", S, float, double) {
  // Odd hidden sizes and token counts put rank boundaries at every alignment.
  check_ep_invariance<S>(mrr::presets::qwen3_moe(8, 2), 13, 7, 37);
  check_ep_invariance<S>(mrr::presets::qwen2_moe(8, 3, false), 40, 24, 64);
  check_ep_invariance<S>(mrr::presets::megatron_deepseek_v3(16, 4, 4, 2, 2.5), 33, 20, 50);
  check_ep_invariance<S>(mrr::presets::mixtral(8, 2), 16, 32, 3);  // fewer tokens than ranks
}

// Routes recorded on 4 ranks (one store per rank: each records its own tokens, no sharing, no
// lock), merged, then replayed on 1, 2 and 4 ranks with a drifted gate: the same ids, and bitwise
// the same outputs and gradients whatever the number of ranks.
template <class MakeReplayStore>
void check_replay_across_ep(const char* kind, MakeReplayStore&& make_replay_store) {
  CAPTURE(kind);
  using S = float;
  constexpr int kLayers = 2, kLayer = 1;
  const Eigen::Index tokens = 45;
  auto m = MoEModel<S>::random(mrr::presets::qwen3_moe(8, 2), 24, 16, 3);
  const RowMatrix<S> x = mrr::test::random_normal<S>(tokens, 24, 4);
  const RowMatrix<S> gy = mrr::test::random_normal<S>(tokens, 24, 5);
  const mrr::RouteShape shape{.num_experts = 8, .num_layers = kLayers, .topk = 2};
  mrr::test::TempDir dir;

  // Record (R2 old-log-prob pass) on 4 ranks, one file per rank.
  mrr::ExpertIds recorded(tokens, 2);
  mrr::InProcessGroup(4).run([&](const mrr::InProcessComm& comm) {
    auto store = mrr::FileRouteStore::create(dir / ("routes.rank" + std::to_string(comm.rank()) + ".mrr"), shape);
    mrr::RoutingReplay replay(mrr::ReplayMode::R2, store);
    const auto [begin, end] = mrr::test::token_chunk(tokens, 4, comm.rank());
    replay.set_micro_batch(mrr::test::token_layout(begin, end));
    replay.begin_pass(mrr::TrainingPass::old_log_prob);
    auto layer = m.layer(comm, &replay, kLayer);
    const RowMatrix<S> xs = x.middleRows(begin, end - begin);
    const auto f = layer.forward(xs);
    recorded.middleRows(begin, end - begin) = f.routing.ids;
  });

  // The policy moved: native routing now disagrees somewhere, replay must not.
  m.gate += 0.5f * mrr::test::random_normal<S>(8, 24, 6);
  {
    auto layer = m.layer(mrr::SingleProcess{});
    CHECK(layer.forward(x).routing.ids != recorded);
  }
  const auto everything = mrr::test::token_layout(0, tokens);
  std::vector<MoEResult<S>> results;
  results.reserve(3);
  for (int ranks : {1, 2, 4}) {
    CAPTURE(ranks);
    results.emplace_back(tokens, 24, 8, 2, ranks);
    auto& out = results.back();
    mrr::InProcessGroup(ranks).run([&](const mrr::InProcessComm& comm) {
      auto store = make_replay_store(dir, shape, comm.rank(), everything);
      mrr::RoutingReplay replay(mrr::ReplayMode::R2, *store);
      const auto [begin, end] = mrr::test::token_chunk(tokens, ranks, comm.rank());
      replay.set_micro_batch(mrr::test::token_layout(begin, end));
      replay.begin_pass(mrr::TrainingPass::actor_update);
      auto layer = m.layer(comm, &replay, kLayer);
      mrr::test::run_rank(layer, x, gy, out);
      CHECK(replay.stats().replayed_rows == static_cast<std::uint64_t>(end - begin));
      CHECK(replay.stats().mask_free_replays == 1);  // every row had a route: the router's fast path
    });
    CHECK(out.ids == recorded);
  }
  check_same(results[0], results[1]);
  check_same(results[0], results[2]);
}

TEST_CASE("MoELayer: routes recorded on 4 ranks replay bitwise on 1, 2 and 4 ranks (memory store)") {
  // Each replaying rank merges the 4 recorded files into its own MemoryRouteStore.
  check_replay_across_ep("memory", [](const mrr::test::TempDir& dir, const mrr::RouteShape& shape, int,
                                      const mrr::TokenLayout& everything) {
    auto store = std::make_unique<mrr::MemoryRouteStore>(shape);
    for (int r = 0; r < 4; ++r) {
      const auto file = mrr::FileRouteStore::open(dir / ("routes.rank" + std::to_string(r) + ".mrr"), shape);
      mrr::test::copy_routes(file, *store, 1, everything);
    }
    return store;
  });
}

TEST_CASE("MoELayer: routes recorded on 4 ranks replay bitwise on 1, 2 and 4 ranks (file store)") {
  // One merged route file; every replaying rank opens it read-only.
  mrr::test::TempDir merged_dir;
  std::once_flag merged;
  check_replay_across_ep("file", [&](const mrr::test::TempDir& dir, const mrr::RouteShape& shape, int,
                                     const mrr::TokenLayout& everything) {
    const auto path = merged_dir / "merged.mrr";
    std::call_once(merged, [&] {
      auto out = mrr::FileRouteStore::create(path, shape);
      for (int r = 0; r < 4; ++r) {
        const auto file = mrr::FileRouteStore::open(dir / ("routes.rank" + std::to_string(r) + ".mrr"), shape);
        mrr::test::copy_routes(file, out, 1, everything);
      }
    });
    return std::make_unique<mrr::FileRouteStore>(mrr::FileRouteStore::open(path, shape));
  });
}

namespace {

// Runs f on every rank of a group and returns what each rank threw ("" when it did not).
template <class F>
std::vector<std::string> errors_per_rank(int ranks, F&& f) {
  std::vector<std::string> errors(static_cast<std::size_t>(ranks));
  try {
    mrr::InProcessGroup(ranks).run([&](const mrr::InProcessComm& comm) {
      try {
        f(comm);
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(comm.rank())] = e.what();
        throw;
      }
    });
  } catch (const std::exception&) {
  }
  return errors;
}

void check_all_failed(const std::vector<std::string>& errors, const std::string& needle) {
  for (std::size_t r = 0; r < errors.size(); ++r) {
    CAPTURE(r);
    CAPTURE(errors[r]);
    CHECK(errors[r].find(needle) != std::string::npos);
  }
}

// Answers lookups like a MemoryRouteStore but hands rank `bad_rank` an expert id out of range.
struct CorruptStore {
  mrr::MemoryRouteStore inner;
  bool corrupt = false;
  const mrr::RouteShape& shape() const { return inner.shape(); }
  void record(int layer, const mrr::TokenLayout& layout, mrr::ExpertIdsRef ids) { inner.record(layer, layout, ids); }
  std::size_t lookup(int layer, const mrr::TokenLayout& layout, mrr::ExpertIds& out, std::vector<std::uint8_t>& found) const {
    const auto n = inner.lookup(layer, layout, out, found);
    if (corrupt && out.rows() > 0) out(0, 1) = shape().num_experts;
    return n;
  }
  std::int64_t recorded_positions(mrr::SequenceId uid) const { return inner.recorded_positions(uid); }
};
static_assert(mrr::RouteStore<CorruptStore>);

}  // namespace

TEST_CASE("MoELayer: a configuration the ranks disagree on is an error on every rank, at construction") {
  const auto m = MoEModel<double>::random(mrr::presets::qwen3_moe(6, 2), 8, 4, 1);
  SUBCASE("experts not divisible by ranks") {
    check_all_failed(errors_per_rank(4, [&](const mrr::InProcessComm& comm) {
      mrr::SwiGLUExperts<double> experts(8, 4, 1, comm.rank());
      mrr::MoELayer<mrr::TopKRouter<double>, mrr::SwiGLUExperts<double>, mrr::InProcessComm> layer(
          mrr::TopKRouter<double>(m.config), experts, comm);
    }), "not divisible by 4");
  }
  SUBCASE("intermediate size") {
    check_all_failed(errors_per_rank(2, [&](const mrr::InProcessComm& comm) {
      auto other = m;
      if (comm.rank() == 1) other.intermediate = 5;
      other.w_gate.resize(6u * other.intermediate * 8);
      other.w_up.resize(other.w_gate.size());
      other.w_down.resize(other.w_gate.size());
      auto layer = other.layer(comm);
    }), "ranks disagree on intermediate_size");
  }
  SUBCASE("topk and experts") {
    check_all_failed(errors_per_rank(2, [&](const mrr::InProcessComm& comm) {
      auto other = m;
      if (comm.rank() == 0) other.config = mrr::presets::qwen3_moe(6, 3);
      auto layer = other.layer(comm);
    }), "ranks disagree on topk");
  }
  SUBCASE("placement") {
    const auto errors = errors_per_rank(3, [&](const mrr::InProcessComm& comm) {
      mrr::SwiGLUExperts<double> experts(8, 4, 2, comm.rank() == 1 ? 0 : 2 * comm.rank());
      mrr::MoELayer<mrr::TopKRouter<double>, mrr::SwiGLUExperts<double>, mrr::InProcessComm> layer(
          mrr::TopKRouter<double>(m.config), experts, comm);
    });
    check_all_failed(errors, "rank 1");
    CHECK(errors[1].find("contiguous placement") != std::string::npos);
  }
}

TEST_CASE("MoELayer: bad input on one rank is an error on every rank") {
  const auto m = MoEModel<double>::random(mrr::presets::qwen3_moe(8, 2), 8, 4, 1);
  SUBCASE("hidden size of one rank's input") {
    const auto errors = errors_per_rank(4, [&](const mrr::InProcessComm& comm) {
      auto layer = m.layer(comm);
      const int cols = comm.rank() == 2 ? 9 : 8;
      layer.forward(RowMatrix<double>::Ones(5, cols));
    });
    check_all_failed(errors, "'hidden' has shape [5, 9]");
    check_all_failed(errors, "MoELayer::forward");
  }
  SUBCASE("a replayed expert id out of range") {
    const auto errors = errors_per_rank(2, [&](const mrr::InProcessComm& comm) {
      CorruptStore store{mrr::MemoryRouteStore({.num_experts = 8, .num_layers = 1, .topk = 2}), comm.rank() == 1};
      mrr::RoutingReplay replay(mrr::ReplayMode::R2, store);
      const auto layout = mrr::test::token_layout(8 * comm.rank(), 8 * comm.rank() + 8);
      replay.set_micro_batch(layout);
      auto layer = m.layer(comm, &replay, 0);
      const RowMatrix<double> x = mrr::test::random_normal<double>(8, 8, 3);
      replay.begin_pass(mrr::TrainingPass::old_log_prob);
      layer.forward(x);
      replay.begin_pass(mrr::TrainingPass::actor_update);
      layer.forward(x);
    });
    check_all_failed(errors, "has expert id 8 outside [0, 8)");
    CHECK(errors[0].find("rank 1 of 2 failed") != std::string::npos);
  }
  SUBCASE("grad_output of the wrong shape in backward") {
    check_all_failed(errors_per_rank(2, [&](const mrr::InProcessComm& comm) {
      auto layer = m.layer(comm);
      const auto f = layer.forward(RowMatrix<double>::Ones(3, 8));
      layer.backward(f, RowMatrix<double>::Ones(comm.rank() == 0 ? 4 : 3, 8));
    }), "'grad_output' has shape [4, 8]");
  }
  SUBCASE("a rank that throws before its forward") {
    const auto errors = errors_per_rank(4, [&](const mrr::InProcessComm& comm) {
      auto layer = m.layer(comm);
      if (comm.rank() == 3) throw std::runtime_error("rank 3 ran out of memory");
      layer.forward(RowMatrix<double>::Ones(2, 8));
    });
    check_all_failed(errors, "rank 3 ran out of memory");
  }
}

TEST_CASE("MoELayer: E not divisible by one rank is rejected with SingleProcess's neighbours too") {
  CHECK_THROWS_WITH_AS(mrr::ExpertPlacement::contiguous(6, 4), doctest::Contains("not divisible by 4"),
                       mrr::InvalidArgument);
  const auto p = mrr::ExpertPlacement::contiguous(8, 4);
  CHECK(p.first_expert(3) == 6);
  CHECK(p.owner(5) == 2);
}

TEST_CASE("MoELayer: a forward that fails on one rank leaves every rank's recompute queue as it was") {
  // R2 with activation recompute on 2 ranks. Micro-batches A and B are recorded; in the update the
  // gate moved, so native routing would differ from the recorded routes.
  const auto m = MoEModel<double>::random(mrr::presets::qwen3_moe(8, 2), 8, 4, 11);
  const Eigen::Index rows = 8;  // per rank
  std::vector<int> checked(2, 0);
  mrr::InProcessGroup(2).run([&](const mrr::InProcessComm& comm) {
    const int r = comm.rank();
    mrr::MemoryRouteStore store({.num_experts = 8, .num_layers = 1, .topk = 2});
    mrr::RoutingReplay replay(mrr::ReplayMode::R2, store);
    auto layer = m.layer(comm, &replay, 0);
    const auto la = mrr::test::token_layout(rows * r, rows * r + rows);
    const auto lb = mrr::test::token_layout(100 + rows * r, 100 + rows * r + rows);
    const RowMatrix<double> xa = mrr::test::random_normal<double>(rows, 8, 20 + r);
    const RowMatrix<double> xb = mrr::test::random_normal<double>(rows, 8, 30 + r);
    replay.begin_pass(mrr::TrainingPass::old_log_prob);
    replay.set_micro_batch(la);
    layer.forward(xa);
    replay.set_micro_batch(lb);
    layer.forward(xb);
    layer.set_gate_weight(m.gate + 0.7 * mrr::test::random_normal<double>(8, 8, 40));
    replay.set_activation_recompute(true);
    replay.begin_pass(mrr::TrainingPass::actor_update);

    // A's update forward fails on rank 1 only (a NaN in a real token), after rank 0's router
    // replayed and queued A's ids. Every rank throws, and rank 0 must not keep A's ids queued.
    RowMatrix<double> bad = xa;
    if (r == 1) bad(3, 2) = std::numeric_limits<double>::quiet_NaN();
    replay.set_micro_batch(la);
    CHECK_THROWS_WITH(layer.forward(bad), doctest::Contains("nan"));
    CHECK(replay.queued(0) == 0);

    // The trainer skips A: B's forward, then its recompute, which must replay B's ids, not A's.
    replay.set_micro_batch(lb);
    const auto fb = layer.forward(xb);
    CHECK(replay.queued(0) == 1);
    replay.begin_pass(mrr::TrainingPass::actor_recompute);
    // A recompute that fails on rank 0 only (the experts' input is fine on rank 1, whose router
    // took B's ids) gives them back on every rank: the retry replays B.
    RowMatrix<double> bad_b = xb;
    if (r == 0) bad_b(5, 1) = std::numeric_limits<double>::infinity();
    CHECK_THROWS_WITH(layer.forward(bad_b), doctest::Contains(r == 0 ? "inf" : "rank 0 of 2 failed"));
    CHECK(replay.queued(0) == 1);
    const auto rb = layer.forward(xb);
    CHECK(replay.queued(0) == 0);
    CHECK(rb.routing.ids == fb.routing.ids);
    CHECK(bitwise_equal(rb.output, fb.output));
    // Native routing with the moved gate differs: the replayed ids are not what it would pick.
    replay.begin_pass(mrr::TrainingPass::ref_log_prob);  // R2: native
    CHECK(layer.forward(xb).routing.ids != fb.routing.ids);
    // A revert with nothing to undo changes nothing.
    replay.revert_route(0);
    CHECK(replay.queued(0) == 0);
    checked[static_cast<std::size_t>(r)] = 1;
  });
  CHECK(checked == std::vector<int>{1, 1});
}

TEST_CASE("TokenExchange: strided inputs (a wider matrix's leftCols) move the rows a packed copy moves") {
  // Every path read its input as packed rows: a strided view came back with its rows shifted.
  // Rank 0 with 1 or 0 rows: a zero-row view keeps its wide stride, and the ranks once chose
  // different collectives by it (staging against all_to_all_rows).
  const int h = 3;
  for (const int rows0 : {6, 1, 0})
    for (const bool staging : {false, true}) {
      CAPTURE(staging);
      CAPTURE(rows0);
      mrr::InProcessGroup(2).run([&](const mrr::InProcessComm& comm) {
        const int n = comm.rank() == 0 ? rows0 : 6;
        mrr::Routing<float> routing;
        routing.ids.resize(n, 1);
        routing.weights = RowMatrix<float>::Ones(n, 1);
        for (int t = 0; t < n; ++t)
          routing.ids(t, 0) = (t + comm.rank()) % 4;
        auto plan = mrr::make_dispatch_plan(routing, mrr::ExpertPlacement::contiguous(4, 2), h);
        mrr::TokenExchange<float>::exchange_counts(comm, plan);
        const auto fill = [&](Eigen::Index rows) {
          RowMatrix<float> wide(rows, h + 2);
          for (Eigen::Index r = 0; r < rows; ++r)
            for (int c = 0; c < h + 2; ++c)
              wide(r, c) = c < h ? 100.f * comm.rank() + 10.f * r + c : -1.f;
          return wide;
        };
        const RowMatrix<float> tokens = fill(n), permuted = fill(plan.permutation.rows());
        mrr::TokenExchange<float> ex;
        RowMatrix<float> want, got;
        const auto run = [&](const auto& c) {
          ex.to_experts(c, RowMatrix<float>(permuted.leftCols(h)), plan, want);
          ex.to_experts(c, permuted.leftCols(h), plan, got);
          CHECK(bitwise_equal(got, want));
          RowMatrix<float> back_want, back_got;
          const RowMatrix<float> grouped_wide = fill(plan.local_rows());
          ex.from_experts(c, RowMatrix<float>(grouped_wide.leftCols(h)), plan, back_want);
          ex.from_experts(c, grouped_wide.leftCols(h), plan, back_got);
          CHECK(bitwise_equal(back_got, back_want));
          CHECK_THROWS_WITH_AS(ex.to_experts(c, permuted, plan, got), doctest::Contains("'permuted' has shape"),
                               mrr::InvalidArgument);
        };
        if (staging) {
          run(StagingComm{comm});
        } else {
          run(comm);
          ex.gather_to_experts(comm, RowMatrix<float>(tokens.leftCols(h)), plan, want);
          ex.gather_to_experts(comm, tokens.leftCols(h), plan, got);
          CHECK(bitwise_equal(got, want));
        }
      });
    }
}
