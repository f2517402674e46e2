// The flagship's options (examples/moe_grpo/options.hpp): every numeric option is checked against
// its range before anything is sized or run, with an error naming verl's key, the range and the
// value; --config files are regular files holding one YAML document, without repeated keys or
// lists; the bounds are real (a run at each edge trains).
#include "options.hpp"

#include <mrr/comm/in_process.hpp>

#include <doctest/doctest.h>
#include <support/fifo.hpp>

#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

using namespace moe_grpo;

namespace {

// The error parse_options gives for `args`, or "(accepted)".
std::string error_of(const std::vector<std::string>& args) {
  try {
    parse_options(args);
  } catch (const mrr::ConfigError& e) {
    return e.what();
  }
  return "(accepted)";
}

struct TempDir {
  std::filesystem::path path = std::filesystem::temp_directory_path() /
                               ("mrr_flagship_options_" + std::to_string(::getpid()) + "_" + std::to_string(count()++));
  TempDir() { std::filesystem::create_directories(path); }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  static int& count() {
    static int n = 0;
    return n;
  }
  std::string write(const std::string& name, const std::string& text) const {
    std::ofstream(path / name) << text;
    return (path / name).string();
  }
};

}  // namespace

TEST_CASE("every numeric option out of its range is an error naming the key, the range and the value") {
  const std::string seqs = "must be in [1, 65536], got ";
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"batch=0"}, "data.train_batch_size " + seqs + "0"},
      {{"batch=-3"}, "data.train_batch_size " + seqs + "-3"},
      {{"batch=70000"}, "data.train_batch_size " + seqs + "70000"},
      {{"group=0"}, "actor_rollout_ref.rollout.n " + seqs + "0"},
      {{"batch=4096", "group=32", "mini_batch=4096"},
       "data.train_batch_size x actor_rollout_ref.rollout.n must be at most 65536 sequences per step, got 4096 x 32"},
      {{"mini_batch=0"},
       "actor_rollout_ref.actor.ppo_mini_batch_size must be in [1, data.train_batch_size = 16], got 0"},
      {{"mini_batch=32"}, "ppo_mini_batch_size must be in [1, data.train_batch_size = 16], got 32"},
      {{"mini_batch=5"},
       "data.train_batch_size (16) must be a multiple of actor_rollout_ref.actor.ppo_mini_batch_size (5)"},
      {{"steps=-1"}, "trainer.total_training_steps must be in [0, 16777216], got -1"},
      {{"steps=16777217"}, "trainer.total_training_steps must be in [0, 16777216], got 16777217"},
      // The whole value is the number: no spaces around it (std::stod skipped leading ones).
      {{"lr= 0.1"}, "actor_rollout_ref.actor.optim.lr: cannot parse ' 0.1' as a number"},
      {{"lr=0.1 "}, "actor_rollout_ref.actor.optim.lr: cannot parse '0.1 ' as a number"},
      {{"steps= 3"}, "trainer.total_training_steps: cannot parse ' 3' as a number"},
      {{"lr=+-1"}, "actor_rollout_ref.actor.optim.lr: cannot parse '+-1' as a number"},
      {{"lr=+"}, "actor_rollout_ref.actor.optim.lr: cannot parse '+' as a number"},
      {{"lr=0x1p-3"}, "actor_rollout_ref.actor.optim.lr: cannot parse '0x1p-3' as a number"},
      {{"steps=99999999999"}, "trainer.total_training_steps: cannot parse '99999999999' as a number"},
      {{"actor_rollout_ref.actor.ppo_epochs=0"}, "actor_rollout_ref.actor.ppo_epochs must be in [1, 1000], got 0"},
      {{"actor_rollout_ref.actor.ppo_epochs=5000"}, "ppo_epochs must be in [1, 1000], got 5000"},
      {{"data.max_operand=2000000000"},
       "data.max_operand must be in [0, 9] (the operands are single-digit tokens), got 2000000000"},
      {{"data.max_operand=10"}, "data.max_operand must be in [0, 9]"},
      {{"data.max_operand=-1"}, "data.max_operand must be in [0, 9]"},
      {{"lr=nan"}, "actor_rollout_ref.actor.optim.lr must be finite and >= 0, got nan"},
      {{"lr=-1"}, "actor_rollout_ref.actor.optim.lr must be finite and >= 0, got -1"},
      {{"lr=inf"}, "optim.lr must be finite and >= 0, got inf"},
      {{"lr=1e39"}, "optim.lr must be finite and >= 0, got inf"},  // beyond float
      {{"actor_rollout_ref.actor.optim.weight_decay=-0.1"}, "optim.weight_decay must be finite and >= 0, got -0.1"},
      {{"actor_rollout_ref.rollout.temperature=-1"}, "rollout.temperature must be finite and >= 0 (0: greedy), got -1"},
      {{"actor_rollout_ref.rollout.temperature=nan"}, "rollout.temperature must be finite and >= 0"},
      {{"actor_rollout_ref.rollout.top_k=-2"}, "rollout.top_k must be -1 or 0 (off) or >= 1, got -2"},
      {{"actor_rollout_ref.rollout.top_p=0"}, "rollout.top_p must be in (0, 1], got 0"},
      {{"actor_rollout_ref.rollout.top_p=1.5"}, "rollout.top_p must be in (0, 1], got 1.5"},
      {{"actor_rollout_ref.rollout.top_p=nan"}, "rollout.top_p must be in (0, 1], got nan"},
      {{"actor_rollout_ref.actor.clip_ratio=nan"},
       "actor_rollout_ref.actor.clip_ratio must be finite and > 0, got nan"},
      {{"actor_rollout_ref.actor.clip_ratio=-1"}, "actor_rollout_ref.actor.clip_ratio must be finite and > 0, got -1"},
      {{"actor_rollout_ref.actor.clip_ratio=0"}, "actor_rollout_ref.actor.clip_ratio must be finite and > 0, got 0"},
      {{"actor_rollout_ref.actor.clip_ratio=1"},
       "clip_ratio must be in (0, 1) while it is also the lower clip (actor_rollout_ref.actor.clip_ratio_low unset), "
       "got 1"},
      {{"actor_rollout_ref.actor.clip_ratio_low=1"}, "actor_rollout_ref.actor.clip_ratio_low must be in (0, 1), got 1"},
      {{"actor_rollout_ref.actor.clip_ratio_high=-0.1"}, "clip_ratio_high must be finite and > 0, got -0.1"},
      {{"actor_rollout_ref.actor.clip_ratio_high=inf"}, "clip_ratio_high must be finite and > 0, got inf"},
      {{"actor_rollout_ref.actor.kl_loss_coef=-1"},
       "actor_rollout_ref.actor.kl_loss_coef must be finite and >= 0, got -1"},
      {{"actor_rollout_ref.actor.kl_loss_coef=nan"}, "kl_loss_coef must be finite and >= 0, got nan"},
      {{"actor_rollout_ref.actor.entropy_coeff=-0.01"},
       "actor_rollout_ref.actor.entropy_coeff must be finite and >= 0, got -0.01"},
      {{"actor_rollout_ref.actor.entropy_coeff=inf"}, "entropy_coeff must be finite and >= 0, got inf"},
      {{"actor_rollout_ref.actor.policy_loss.loss_mode=kl_cov"},
       "loss_mode: 'kl_cov' selects tokens across a whole micro-batch, and this example computes its loss sequence "
       "by sequence"},
      {{"actor_rollout_ref.actor.policy_loss.loss_mode=clip_cov"}, "'clip_cov' selects tokens across a whole"},
      {{"algorithm.rollout_correction.rollout_rs=token_k9", "algorithm.rollout_correction.rollout_rs_threshold=2"},
       "algorithm.rollout_correction.rollout_rs / rollout_rs_threshold: mrr::ppo::RolloutRsOptions::parse: invalid "
       "rollout_rs option 'token_k9'"},
      {{"algorithm.rollout_correction.rollout_rs=seq_mean_k3"}, "rollout_rs_threshold must be given too"},
      {{"actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode"},
       "'bypass_mode' trains on the rollout engine's log-probs instead of an old-log-prob pass"},
      {{"actor_rollout_ref.model.num_experts=0"}, "actor_rollout_ref.model.num_experts must be in [1, 65536], got 0"},
      {{"actor_rollout_ref.model.num_experts=70000"}, "num_experts must be in [1, 65536], got 70000"},
      {{"actor_rollout_ref.model.moe_topk=0"},
       "actor_rollout_ref.model.moe_topk must be in [1, 16] (actor_rollout_ref.model.num_experts = 16), got 0"},
      {{"actor_rollout_ref.model.moe_topk=17"}, "moe_topk must be in [1, 16]"},
      {{"actor_rollout_ref.model.hidden_size=6"},
       "actor_rollout_ref.model.hidden_size must be a multiple of the 4 attention heads in [4, 65536], got 6"},
      {{"actor_rollout_ref.model.hidden_size=0"}, "hidden_size must be a multiple of the 4 attention heads"},
      {{"actor_rollout_ref.model.num_layers=0"}, "actor_rollout_ref.model.num_layers must be in [1, 65535], got 0"},
      {{"actor_rollout_ref.model.moe_intermediate_size=0"}, "moe_intermediate_size must be in [1, 65536], got 0"},
      {{"actor_rollout_ref.model.hidden_size=4096", "actor_rollout_ref.model.num_layers=16"},
       "the model has 1276424192 parameters, more than the example's 268435456 (2^28)"},
      {{"--ranks", "0"}, "trainer.n_ranks (--ranks) must be in [1, actor_rollout_ref.model.num_experts = 16], got 0"},
      {{"trainer.n_ranks=32"},
       "trainer.n_ranks (--ranks) must be in [1, actor_rollout_ref.model.num_experts = 16], got 32"},
      {{"--ranks", "3"}, "actor_rollout_ref.model.num_experts (16) do not split evenly over 3 ranks"},
      {{"--ranks", "2", "group=3", "batch=3", "mini_batch=1"},
       "a mini-batch of 3 sequences (actor_rollout_ref.actor.ppo_mini_batch_size x actor_rollout_ref.rollout.n) does "
       "not "
       "split evenly over 2 ranks"},
      {{"trainer.progress=maybe"}, "trainer.progress: expected true or false, got 'maybe'"},
      {{"actor_rollout_ref.actor.use_kl_loss=2"}, "use_kl_loss: expected true or false, got the number 2"},
  };
  for (const auto& [args, expected] : cases) {
    CAPTURE(args.front());
    CAPTURE(args.back());
    CHECK_THROWS_WITH_AS(parse_options(args), doctest::Contains(expected.c_str()), mrr::ConfigError);
  }
}

TEST_CASE("values at the edge of every range are accepted") {
  const std::vector<std::vector<std::string>> good = {
      {},
      {"batch=1", "mini_batch=1", "group=1", "steps=0"},
      {"batch=4096", "group=16", "mini_batch=4096"},  // 65536 sequences per step
      {"data.max_operand=0"},
      {"data.max_operand=9"},
      {"lr=0", "actor_rollout_ref.actor.optim.weight_decay=0"},
      {"actor_rollout_ref.rollout.temperature=0", "actor_rollout_ref.rollout.top_k=-1"},
      {"actor_rollout_ref.rollout.top_k=0", "actor_rollout_ref.rollout.top_p=1"},
      {"actor_rollout_ref.rollout.top_k=1000", "actor_rollout_ref.rollout.top_p=1e-9"},
      {"actor_rollout_ref.actor.clip_ratio=3", "actor_rollout_ref.actor.clip_ratio_low=0.2"},
      {"actor_rollout_ref.actor.clip_ratio_low=0.999", "actor_rollout_ref.actor.clip_ratio_high=10"},
      {"actor_rollout_ref.actor.kl_loss_coef=0", "actor_rollout_ref.actor.ppo_epochs=1000"},
      {"actor_rollout_ref.actor.entropy_coeff=0.01"},
      {"actor_rollout_ref.model.num_experts=1", "actor_rollout_ref.model.moe_topk=1"},
      {"actor_rollout_ref.model.hidden_size=4", "actor_rollout_ref.model.num_layers=1",
       "actor_rollout_ref.model.moe_intermediate_size=1"},
      {"--ranks", "16", "mini_batch=2"},
      {"trainer.progress=Off", "actor_rollout_ref.actor.use_kl_loss=On", "algorithm.norm_adv_by_std_in_grpo=NO"},
  };
  for (const auto& args : good) {
    CAPTURE(args.empty() ? std::string("(defaults)") : args.front());
    CHECK(error_of(args) == "(accepted)");
  }
  const RunOptions flags = parse_options({"trainer.progress=Off", "actor_rollout_ref.actor.use_kl_loss=yes"});
  CHECK_FALSE(flags.progress);
  CHECK(flags.train.grpo.use_kl_loss);
  // Reals in YAML's forms: a leading '+', exponents, a bare fraction.
  const RunOptions reals = parse_options({"lr=+5e-3", "actor_rollout_ref.rollout.top_p=.5", "steps=16777216"});
  CHECK(reals.train.lr == 5e-3f);
  CHECK(reals.train.sampling.top_p == 0.5);
  CHECK(reals.train.steps == 16777216);
}

TEST_CASE("the bounds are real: runs at the edges train, and the Trainer checks what it is given directly") {
  for (const auto& args :
       std::vector<std::vector<std::string>>{{"steps=1", "batch=1", "mini_batch=1", "group=2", "data.max_operand=9"},
                                             {"steps=1", "batch=2", "mini_batch=1", "group=2", "data.max_operand=0",
                                              "actor_rollout_ref.rollout.top_k=1"}}) {
    CAPTURE(args.back());
    const RunOptions o = parse_options(args);
    mrr::InProcessGroup group(1);
    int steps = 0;
    group.run([&](const mrr::InProcessComm& comm) {
      Trainer<mrr::InProcessComm> trainer(o.train, comm);
      trainer.run([&](const StepMetrics& m) {
        CHECK(m.reward >= 0);
        CHECK(m.compared_rows > 0);
        ++steps;
      });
    });
    CHECK(steps == 1);
  }
  // A TrainConfig built in code gets the same checks from the Trainer itself.
  TrainConfig bad;
  bad.prompts = 0;
  mrr::InProcessGroup group(1);
  CHECK_THROWS_WITH_AS(group.run([&](const mrr::InProcessComm& comm) { Trainer<mrr::InProcessComm>(bad, comm); }),
                       doctest::Contains("data.train_batch_size must be in [1, 65536], got 0"), mrr::ConfigError);
}

TEST_CASE("parameter_count is what the model lays out") {
  for (const auto& [hidden, layers, experts, expert_hidden] :
       std::vector<std::array<int, 4>>{{64, 2, 16, 64}, {4, 1, 1, 1}, {128, 3, 8, 32}, {36, 5, 7, 11}}) {
    ModelConfig c;
    c.hidden = hidden;
    c.layers = layers;
    c.experts = experts;
    c.expert_hidden = expert_hidden;
    const double laid_out = static_cast<double>(DenseLayout(c).size) +
                            static_cast<double>(layers) * experts * static_cast<double>(expert_block_size(c));
    CHECK(parameter_count(c) == laid_out);
  }
}

#if MOE_GRPO_WITH_YAML
TEST_CASE("--config: verl's nesting sets the options; YAML 1.1 booleans; null keeps the default") {
  TempDir dir;
  const auto file = dir.write("run.yaml",
                              "trainer:\n  seed: 7\n  total_training_steps: 3\n  progress: Off\n"
                              "data:\n  train_batch_size: 4\n  max_operand: ~\n"
                              "actor_rollout_ref:\n  actor:\n    ppo_mini_batch_size: 2\n    use_kl_loss: On\n"
                              "    router_replay:\n      mode: R3\n"
                              "  rollout:\n    enable_rollout_routing_replay: YES\n");
  const RunOptions o = parse_options({"--config", file, "steps=5"});
  CHECK(o.train.seed == 7);
  CHECK(o.train.steps == 5);  // the command line comes after the file
  CHECK(o.train.prompts == 4);
  const TrainConfig defaults;
  CHECK(o.train.max_operand == defaults.max_operand);
  CHECK(o.train.mini_batch_prompts == 2);
  CHECK(o.train.grpo.use_kl_loss);
  CHECK_FALSE(o.progress);
  CHECK(o.train.replay.mode == mrr::ReplayMode::R3);
  CHECK(o.train.replay.enable_rollout_routing_replay);
}

TEST_CASE("--config: a repeated key anywhere, a list, several documents or a FIFO is an error naming the file") {
  TempDir dir;
  const auto config_error = [&](const std::string& name, const std::string& yaml) {
    const std::string file = dir.write(name, yaml);
    return std::pair(error_of({"--config", file}), "config file " + file + ": ");
  };
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"trainer:\n  seed: 1\n  seed: 2\n", "trainer.seed appears twice; YAML keys must be unique"},
      {"trainer:\n  seed: 1\ntrainer:\n  total_training_steps: 2\n", "trainer appears twice"},
      {"actor_rollout_ref:\n  actor:\n    clip_ratio: 0.2\n    clip_ratio: 0.3\n",
       "actor_rollout_ref.actor.clip_ratio appears twice"},
      {"data:\n  train_batch_size: [8, 16]\n", "data.train_batch_size: expected a single value, got a list"},
      {"actor_rollout_ref:\n  actor:\n    optim:\n      lr:\n        - 0.1\n",
       "actor_rollout_ref.actor.optim.lr: expected a single value, got a list"},
      {"trainer:\n  ? [a, b]\n  : 1\n", "trainer: a key is a list, a map or null"},
      {"trainer:\n  seed: 1\n---\ntrainer:\n  seed: 2\n",
       "holds more than one YAML document (another starts at line 3)"},
      {"trainer:\n  sed: 1\n", "unknown option 'trainer.sed'"},
      // The command line's short forms are not verl's names: in a file they would override the
      // file's own full names whatever the order (mode= also sets the rollout flag).
      {"mode: R3\nactor_rollout_ref:\n  rollout:\n    enable_rollout_routing_replay: false\n",
       "mode: a command-line short form; in a config file write actor_rollout_ref.actor.router_replay.mode"},
      {"steps: 3\n", "steps: a command-line short form; in a config file write trainer.total_training_steps"},
      {"- 1\n", "the top level of the configuration is not a map"},
      {"trainer: {seed: [\n", "config file "},  // a syntax error
  };
  int i = 0;
  for (const auto& [yaml, expected] : cases) {
    CAPTURE(yaml);
    // Appended, not "c" + std::to_string(...): GCC 12 at -O3 reports a false -Wrestrict on that
    // (GCC bug 105651), depending on what else the translation unit inlines.
    const auto [error, prefix] = config_error(std::string("c").append(std::to_string(i++)).append(".yaml"), yaml);
    CHECK(error.find(expected) != std::string::npos);
    CHECK(error.rfind(prefix, 0) == 0);
  }
  const auto fifo = dir.path / "fifo.yaml";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  const std::string error =
      mrr::test::error_or_blocked(fifo, [&] { throw std::runtime_error(error_of({"--config", fifo.string()})); });
  CHECK(error.find("config file " + fifo.string() + ": not a regular file (a FIFO") == 0);
  CHECK(error_of({"--config", dir.path.string()}).find("not a regular file (a directory)") != std::string::npos);
  CHECK(error_of({"--config", (dir.path / "missing.yaml").string()}).find("missing.yaml does not exist") !=
        std::string::npos);
}
#endif

TEST_CASE("mode= stands for its two keys in its place: a later full-name key or mode= wins") {
  RunOptions o = parse_options({"mode=R3"});
  CHECK(o.train.replay.mode == mrr::ReplayMode::R3);
  CHECK(o.train.replay.enable_rollout_routing_replay);
  o = parse_options({"mode=R3", "actor_rollout_ref.actor.router_replay.mode=R2",
                     "actor_rollout_ref.rollout.enable_rollout_routing_replay=false"});
  CHECK(o.train.replay.mode == mrr::ReplayMode::R2);
  CHECK_FALSE(o.train.replay.enable_rollout_routing_replay);
  o = parse_options({"mode=R3", "mode=disabled"});
  CHECK(o.train.replay.mode == mrr::ReplayMode::disabled);
  CHECK_FALSE(o.train.replay.enable_rollout_routing_replay);
  // R3 with its rollout flag turned off afterwards is the contradiction validate() refuses (it
  // ran R3 before: the alias was applied last).
  CHECK(error_of({"mode=R3", "actor_rollout_ref.rollout.enable_rollout_routing_replay=false"}) != "(accepted)");
  CHECK(error_of({"mode=R4"}).find("R4") != std::string::npos);
}
