// Short GRPO runs of the flagship trainer, asserting what router replay does: R3 replays the
// rollout's routes exactly, disabled differs from the rollout under its bf16 numerics, the paired
// passes (native vs replaying the rollout's routes, same weights) show both in any mode, R2 removes
// the old-log-prob vs update mismatch, a route file recorded in one run is replayed bit for bit
// in another, and 1 and 2 expert-parallel ranks train bitwise the same model.
#include "trainer.hpp"

#include <mrr/comm/in_process.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

using namespace moe_grpo;

namespace {

TrainConfig small(mrr::ReplayMode mode, int steps = 3) {
  TrainConfig c;
  c.steps = steps;
  c.prompts = 8;
  c.group = 4;
  c.mini_batch_prompts = 4;
  c.seed = 11;
  c.replay.mode = mode;
  c.replay.enable_rollout_routing_replay = mode == mrr::ReplayMode::R3;
  return c;
}

std::vector<StepMetrics> train(const TrainConfig& c, int ranks = 1) {
  std::vector<StepMetrics> out;
  mrr::InProcessGroup group(ranks);
  group.run([&](const mrr::InProcessComm& comm) {
    Trainer<mrr::InProcessComm> trainer(c, comm);
    trainer.run([&](const StepMetrics& m) {
      if (comm.rank() == 0) out.push_back(m);
    });
  });
  return out;
}

std::filesystem::path temp_dir() {
  auto dir = std::filesystem::temp_directory_path() / ("mrr_flagship_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  return dir;
}

}  // namespace

TEST_CASE("R3: zero routing mismatch on replayed rows, and none between old-log-prob and update passes") {
  const auto r3 = train(small(mrr::ReplayMode::R3));
  const auto off = train(small(mrr::ReplayMode::disabled));
  REQUIRE(r3.size() == 3);
  double mismatch_off = 0, k3_r3 = 0, k3_off = 0, update_off = 0;
  for (std::size_t s = 0; s < r3.size(); ++s) {
    CAPTURE(s);
    CHECK(r3[s].compared_rows > 0);
    CHECK(r3[s].replayed_rows > 0);
    CHECK(r3[s].rollout_mismatch_decisions == 0.0);
    CHECK(r3[s].rollout_mismatch_tokens == 0.0);
    CHECK(r3[s].update_mismatch_decisions == 0.0);
    // Only each sequence's last token (no rollout route) is routed natively.
    CHECK(r3[s].native_rows > 0);
    CHECK(off[s].replayed_rows == 0);
    mismatch_off += off[s].rollout_mismatch_decisions;
    update_off += off[s].update_mismatch_decisions;
    k3_r3 += r3[s].k3;
    k3_off += off[s].k3;
  }
  // Disabled: the bf16 rollout engine picks other experts than training for some tokens, and the
  // weights move between the two mini-batches' old-log-prob and update passes.
  CHECK(mismatch_off > 0);
  CHECK(update_off > 0);
  // The first step's rollout is the same model and the same samples in both modes.
  CHECK(r3[0].reward == off[0].reward);
  MESSAGE("k3(train||rollout) summed over 3 steps: R3 ", k3_r3, ", disabled ", k3_off);
}

TEST_CASE("paired passes: replaying the rollout's routes matches them exactly, native routing does not (bf16)") {
  for (const auto mode : {mrr::ReplayMode::disabled, mrr::ReplayMode::R2, mrr::ReplayMode::R3}) {
    CAPTURE(mrr::to_string(mode));
    const TrainConfig c = small(mode);
    const auto runs = train(c);
    REQUIRE(runs.size() == 3);
    double native_mismatch = 0, native_tokens = 0;
    for (std::size_t s = 0; s < runs.size(); ++s) {
      CAPTURE(s);
      const StepMetrics& m = runs[s];
      // The replayed pass used the rollout's routes on every row the rollout has one for.
      CHECK(m.paired_replayed_rows == static_cast<std::uint64_t>(m.compared_rows));
      CHECK(m.paired_replayed_rows > 0);
      CHECK(m.paired_replay_mismatch_decisions == 0.0);
      CHECK(m.paired_native_k3 > 0);
      CHECK(m.paired_replay_k3 > 0);  // bf16 numerics differ beyond routing
      native_mismatch += m.paired_native_mismatch_decisions;
      native_tokens += m.paired_native_mismatch_tokens;
      // The R3 paper's definitions (mrr/diagnostics.hpp): a (token, layer) decision differs at
      // least as often as an expert does, at most k times as often; replayed rows never differ.
      CHECK(m.paired_native_decisions_differing >= m.paired_native_mismatch_decisions);
      CHECK(m.paired_native_decisions_differing <= c.model.topk * m.paired_native_mismatch_decisions + 1e-12);
      CHECK(m.p99_abs_dlogp > 0);
      CHECK(m.p99_abs_dlogp <= m.max_abs_dlogp);
      // The same-engine floor: the training engine is batch-invariant (per-token fixed-shape
      // reductions, slot-order combine), so two compositions of the same tokens give the same bits.
      CHECK(m.floor_k3 == 0.0);
      CHECK(std::isfinite(m.grad_norm));
      CHECK(m.grad_norm > 0);
      CHECK(m.entropy > 0);
      CHECK(m.entropy <= std::log(static_cast<double>(c.model.vocab)) + 1e-9);  // at most uniform
      if (mode == mrr::ReplayMode::R3) CHECK(m.rollout_decisions_differing == 0.0);
      // Where the mode's own old-log-prob pass is one of the paired passes, it is the same numbers.
      if (mode == mrr::ReplayMode::R3) {
        CHECK(m.paired_replay_k3 == m.k3);
        CHECK(m.paired_replay_mean_abs_dlogp == m.mean_abs_dlogp);
      } else {
        CHECK(m.paired_native_k3 == m.k3);
        CHECK(m.paired_native_mismatch_decisions == m.rollout_mismatch_decisions);
        CHECK(m.paired_native_mismatch_tokens == m.rollout_mismatch_tokens);
      }
    }
    // Natively routed, the training engine picks other experts than the bf16 rollout for some tokens.
    CHECK(native_mismatch > 0);
    CHECK(native_tokens > 0);

    // Computing both paired passes (no reuse of the old-log-prob pass) gives bitwise the same
    // numbers, and the paired passes leave the run itself untouched.
    TrainConfig both = c;
    both.paired_reuse = false;
    TrainConfig none = c;
    none.paired_metrics = false;
    const auto computed = train(both);
    const auto unmeasured = train(none);
    for (std::size_t s = 0; s < runs.size(); ++s) {
      CAPTURE(s);
      CHECK(computed[s].paired_native_k3 == runs[s].paired_native_k3);
      CHECK(computed[s].paired_native_mismatch_decisions == runs[s].paired_native_mismatch_decisions);
      CHECK(computed[s].paired_native_mismatch_tokens == runs[s].paired_native_mismatch_tokens);
      CHECK(computed[s].paired_native_mean_abs_dlogp == runs[s].paired_native_mean_abs_dlogp);
      CHECK(computed[s].paired_replay_k3 == runs[s].paired_replay_k3);
      CHECK(computed[s].paired_replay_mean_abs_dlogp == runs[s].paired_replay_mean_abs_dlogp);
      CHECK(computed[s].paired_replayed_rows == runs[s].paired_replayed_rows);
      for (const auto* other : {&computed[s], &unmeasured[s]}) {
        CHECK(other->params_digest == runs[s].params_digest);
        CHECK(other->routes_digest == runs[s].routes_digest);
        CHECK(other->loss == runs[s].loss);
        CHECK(other->replayed_rows == runs[s].replayed_rows);
        CHECK(other->native_rows == runs[s].native_rows);
        CHECK(other->recorded_rows == runs[s].recorded_rows);
      }
      CHECK(unmeasured[s].paired_replayed_rows == 0);
    }
  }
}

TEST_CASE("R2: zero mismatch between the old-log-prob and update passes; the rollout still differs") {
  const auto r2 = train(small(mrr::ReplayMode::R2));
  double rollout_mismatch = 0;
  for (const auto& m : r2) {
    CHECK(m.update_mismatch_decisions == 0.0);
    CHECK(m.recorded_rows > 0);
    CHECK(m.replayed_rows > 0);
    rollout_mismatch += m.rollout_mismatch_decisions;
  }
  CHECK(rollout_mismatch > 0);
}

TEST_CASE("fp8 rollout numerics (e4m3, per-block scales on the MoE GEMMs): more routing differences than bf16") {
  TrainConfig c = small(mrr::ReplayMode::disabled, 2);
  const auto bf16 = train(c);
  c.rollout_fp8 = true;
  const auto fp8 = train(c);
  CHECK(fp8[0].rollout_decisions_differing > bf16[0].rollout_decisions_differing);
  CHECK(fp8[0].k3 > bf16[0].k3);
  // R3 still replays the fp8 rollout's routes exactly.
  TrainConfig r3 = small(mrr::ReplayMode::R3, 2);
  r3.rollout_fp8 = true;
  for (const auto& m : train(r3)) CHECK(m.rollout_decisions_differing == 0.0);
}

TEST_CASE("TIS (verl's token-level rollout correction): weights change the update, routing is untouched") {
  TrainConfig c = small(mrr::ReplayMode::disabled, 2);
  c.rollout_fp8 = true;  // a mismatch large enough that some ratios differ from 1
  const auto plain = train(c);
  c.rollout_tis = true;
  c.rollout_is_threshold = 2.0;
  const auto tis = train(c);
  // The first step's rollout and old-log-prob pass are the same runs: the same routes and mismatch.
  CHECK(tis[0].rollout_decisions_differing == plain[0].rollout_decisions_differing);
  CHECK(tis[0].k3 == plain[0].k3);
  // The loss is weighted by pi_old / pi_rollout (not all 1): a different loss and other parameters.
  CHECK(tis[0].loss != plain[0].loss);
  CHECK(tis[0].params_digest != plain[0].params_digest);
  // A threshold below 1 would truncate every ratio: refused with verl's key.
  c.rollout_is_threshold = 0.5;
  CHECK_THROWS_WITH_AS(train(c), doctest::Contains("rollout_is_threshold"), mrr::ConfigError);
}

TEST_CASE("entropy bonus (verl's entropy_coeff): the term and its logit gradient, then in training on 1 and 2 ranks") {
  // One sequence's term against a direct sum in double, and its gradient against central differences.
  const int rows = 5, vocab = 16;
  const double t = 0.7, coeff = 0.3;
  Mat z(rows, vocab);
  for (int i = 0; i < rows; ++i)
    for (int v = 0; v < vocab; ++v)
      z(i, v) = static_cast<float>(std::sin(0.37 * (i * vocab + v) + 1.1)) * 2.5f;
  Mat mask = Mat::Ones(1, rows);
  mask(0, 3) = 0;  // a padding position: no entropy, no gradient
  mrr::ppo::GlobalBatchInfo info;
  info.batch_num_tokens = 7.0;  // token-mean over a global batch of 7 tokens, 4 of them here
  const auto value = [&](const Mat& x) {
    double sum = 0;
    for (int i = 0; i < rows; ++i) {
      if (mask(0, i) == 0) continue;
      const Eigen::ArrayXd y = x.row(i).cast<double>().transpose().array() / t;
      const double mx = y.maxCoeff(), total = (y - mx).exp().sum();
      const Eigen::ArrayXd p = (y - mx).exp() / total;
      sum += -(p * (y - mx - std::log(total))).sum();
    }
    return -coeff * sum / 7.0;
  };
  const EntropyBonus e = entropy_bonus(z, mask, t, coeff, mrr::ppo::LossAggMode::token_mean, info);
  CHECK(e.loss == doctest::Approx(value(z)).epsilon(1e-5));
  CHECK(e.loss < 0);  // a bonus: entropy lowers the loss
  REQUIRE(e.grad_logits.rows() == rows);
  REQUIRE(e.grad_logits.cols() == vocab);
  CHECK(e.grad_logits.row(3).isZero(0));
  for (int i = 0; i < rows; ++i)
    for (int v = 0; v < vocab; ++v) {
      CAPTURE(i);
      CAPTURE(v);
      const float h = 1e-2f;
      Mat up = z, down = z;
      up(i, v) += h;
      down(i, v) -= h;
      const double numeric = (value(up) - value(down)) / (2.0 * static_cast<double>(h));
      CHECK(static_cast<double>(e.grad_logits(i, v)) == doctest::Approx(numeric).epsilon(2e-3).scale(1e-3));
    }

  // In training: another loss and other parameters from the first update, bitwise the same on 2
  // ranks, and a policy whose entropy falls less than without the bonus.
  TrainConfig c = small(mrr::ReplayMode::R3, 4);
  const auto plain = train(c);
  c.entropy_coeff = 0.5;
  const auto bonus = train(c);
  CHECK(bonus[0].k3 == plain[0].k3);  // the first rollout and old-log-prob pass are the same
  CHECK(bonus[0].entropy == plain[0].entropy);
  CHECK(bonus[0].loss < plain[0].loss);  // minus 0.5 x the entropy
  CHECK(bonus[0].params_digest != plain[0].params_digest);
  CHECK(bonus.back().entropy > plain.back().entropy);
  const auto two = train(c, 2);
  REQUIRE(two.size() == bonus.size());
  for (std::size_t s = 0; s < bonus.size(); ++s) {
    CAPTURE(s);
    CHECK(two[s].loss == bonus[s].loss);
    CHECK(two[s].params_digest == bonus[s].params_digest);
  }
}

TEST_CASE(
    "rejection sampling (verl's rollout_rs): masks mismatched tokens out of the loss, the same on 1 and 2 ranks") {
  TrainConfig c = small(mrr::ReplayMode::disabled, 2);
  c.rollout_fp8 = true;  // a mismatch large enough that some tokens exceed the bound
  const auto plain = train(c);
  c.rollout_rs = "token_k1,seq_max_k3";
  c.rollout_rs_threshold = "0.98_1.02,0.0005";  // |delta log p| reaches ~0.05 here
  const auto rs = train(c);
  // The rollout and old-log-prob pass of the first step are the same runs; the loss sees fewer tokens.
  CHECK(rs[0].k3 == plain[0].k3);
  CHECK(rs[0].rollout_rs_masked_fraction > 0);
  CHECK(rs[0].rollout_rs_masked_fraction < 1);
  CHECK(plain[0].rollout_rs_masked_fraction == 0);
  CHECK(rs[0].loss != plain[0].loss);
  CHECK(rs[0].params_digest != plain[0].params_digest);
  // Each decision is a token's or a sequence's own: 2 expert-parallel ranks mask and train the same.
  const auto two = train(c, 2);
  REQUIRE(two.size() == rs.size());
  for (std::size_t s = 0; s < rs.size(); ++s) {
    CAPTURE(s);
    CHECK(two[s].rollout_rs_masked_fraction == rs[s].rollout_rs_masked_fraction);
    CHECK(two[s].loss == rs[s].loss);
    CHECK(two[s].params_digest == rs[s].params_digest);
  }
  // Bad settings name verl's keys.
  c.rollout_rs_threshold.clear();
  CHECK_THROWS_WITH_AS(train(c), doctest::Contains("rollout_rs_threshold must be given too"), mrr::ConfigError);
  c.rollout_rs = "token_k5";
  c.rollout_rs_threshold = "2";
  CHECK_THROWS_WITH_AS(train(c), doctest::Contains("invalid rollout_rs option 'token_k5'"), mrr::ConfigError);
}

TEST_CASE(
    "optimal token baselines (verl's OTB): per-token advantages from the old-log-prob pass, 1 and 2 ranks alike") {
  TrainConfig c = small(mrr::ReplayMode::R2, 2);
  const auto grpo = train(c);
  for (const char* estimator : {"optimal_token_baseline", "tir_optimal_token_baseline"}) {
    CAPTURE(estimator);
    c.grpo.adv_estimator = estimator;
    c.rollout_tis = std::string(estimator) == "tir_optimal_token_baseline";  // W scaled by the IS weights
    const auto otb = train(c);
    // The rollout and the old-log-prob pass of the first step are GRPO's; the advantages are not.
    CHECK(otb[0].reward == grpo[0].reward);
    CHECK(otb[0].k3 == grpo[0].k3);
    CHECK(otb[0].loss != grpo[0].loss);
    CHECK(otb[0].params_digest != grpo[0].params_digest);
    // Every baseline needs the whole group's log-probs, gathered over the ranks: still bitwise.
    const auto two = train(c, 2);
    REQUIRE(two.size() == otb.size());
    for (std::size_t s = 0; s < otb.size(); ++s) {
      CAPTURE(s);
      CHECK(two[s].loss == otb[s].loss);
      CHECK(two[s].params_digest == otb[s].params_digest);
    }
  }
  c.grpo.adv_estimator = "gae";
  CHECK_THROWS_WITH_AS(train(c), doctest::Contains("algorithm.adv_estimator: 'gae' needs a critic's values"),
                       mrr::ConfigError);
}

TEST_CASE("fp32 rollout numerics: far fewer routing differences than bf16") {
  TrainConfig c = small(mrr::ReplayMode::disabled, 2);
  const auto bf16 = train(c);
  c.rollout_bf16 = false;
  const auto fp32 = train(c);
  CHECK(fp32[0].rollout_mismatch_decisions < bf16[0].rollout_mismatch_decisions);
  CHECK(fp32[0].k3 < bf16[0].k3);
}

TEST_CASE("record_file in one run, replay_file in another: the same routing, bit for bit") {
  const auto dir = temp_dir();
  for (const auto mode : {mrr::ReplayMode::R3, mrr::ReplayMode::R2}) {
    CAPTURE(mrr::to_string(mode));
    const std::string file = (dir / (std::string(mrr::to_string(mode)) + ".mrr")).string();
    std::filesystem::remove(file);
    TrainConfig record = small(mode, 2);
    record.replay.record_file = file;
    const auto first = train(record);
    REQUIRE(std::filesystem::exists(file));
    TrainConfig replay = small(mode, 2);
    replay.replay.replay_file = file;
    const auto second = train(replay);
    const auto native = train(small(mrr::ReplayMode::disabled, 2));
    for (std::size_t s = 0; s < first.size(); ++s) {
      CHECK(second[s].routes_digest == first[s].routes_digest);
      CHECK(second[s].params_digest == first[s].params_digest);
      CHECK(second[s].loss == first[s].loss);
      CHECK(second[s].replayed_rows > 0);
    }
    // The digest sees routing: the disabled run routed otherwise (and trained another model).
    CHECK(native[1].routes_digest != first[1].routes_digest);
    if (mode == mrr::ReplayMode::R2) CHECK(second[0].recorded_rows == 0);  // replayed, not recorded
  }
  // A replay file recorded for another model is refused, naming the key.
  TrainConfig other = small(mrr::ReplayMode::R3, 1);
  other.model.topk = 2;
  other.replay.replay_file = (dir / "R3.mrr").string();
  CHECK_THROWS_WITH(train(other), doctest::Contains("replay_file"));
  // A replay file of the same model recorded by a run with another seed, learning rate or batch
  // holds none of this run's sequences: refused at the first step, never replayed onto other
  // tokens (before, the same uids and lengths replayed the other run's routes silently).
  const std::string r3_file = (dir / "R3.mrr").string();
  const auto with_file = [&](TrainConfig c) {
    c.replay.replay_file = r3_file;
    return c;
  };
  TrainConfig seed2 = with_file(small(mrr::ReplayMode::R3, 1)), lr2 = seed2, mb2 = seed2;
  seed2.seed = 2;
  lr2.lr *= 2;
  mb2.mini_batch_prompts /= 2;
  for (TrainConfig* c : {&seed2, &lr2, &mb2})
    CHECK_THROWS_WITH_AS(train(*c), doctest::Contains("holds no routes for sequence 0 of step 0"), mrr::RouteFileError);
  // Fewer steps than recorded is the same run: accepted, and it replays.
  const auto shorter = train(with_file(small(mrr::ReplayMode::R3, 1)));
  REQUIRE(shorter.size() == 1);
  CHECK(shorter[0].replayed_rows > 0);
  std::filesystem::remove_all(dir);
}

TEST_CASE("1 rank and 2 expert-parallel ranks: bitwise the same losses, routes and parameters") {
  for (const auto mode : {mrr::ReplayMode::disabled, mrr::ReplayMode::R3}) {
    CAPTURE(mrr::to_string(mode));
    TrainConfig c = small(mode, 2);
    c.grpo.use_kl_loss = mode == mrr::ReplayMode::R3;  // the reference pass too
    const auto one = train(c, 1);
    const auto two = train(c, 2);
    REQUIRE(one.size() == two.size());
    for (std::size_t s = 0; s < one.size(); ++s) {
      CAPTURE(s);
      CHECK(one[s].loss == two[s].loss);
      CHECK(one[s].kl_loss == two[s].kl_loss);
      CHECK(one[s].reward == two[s].reward);
      CHECK(one[s].routes_digest == two[s].routes_digest);
      CHECK(one[s].params_digest == two[s].params_digest);
      CHECK(one[s].rollout_mismatch_decisions == two[s].rollout_mismatch_decisions);
      CHECK(one[s].paired_native_mismatch_decisions == two[s].paired_native_mismatch_decisions);
      CHECK(one[s].paired_replayed_rows == two[s].paired_replayed_rows);
    }
    CHECK(one.back().params_digest != one.front().params_digest);  // it trained
  }
}

TEST_CASE("configuration errors name the keys") {
  TrainConfig c = small(mrr::ReplayMode::R3, 1);
  c.replay.enable_rollout_routing_replay = false;
  CHECK_THROWS_WITH(train(c), doctest::Contains("enable_rollout_routing_replay"));
  TrainConfig d = small(mrr::ReplayMode::disabled, 1);
  d.grpo.loss_agg_mode = "token-meen";
  CHECK_THROWS_WITH(train(d), doctest::Contains("loss_agg_mode"));
  TrainConfig e = small(mrr::ReplayMode::disabled, 1);
  e.prompts = 6;
  CHECK_THROWS_WITH(train(e), doctest::Contains("ppo_mini_batch_size"));
}
