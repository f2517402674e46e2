// verl-style configuration (YAML and key=value overrides), opening the file it names, importing
// vLLM/SGLang routed_experts arrays, and reading a route file from Python with numpy alone.
#include <mrr/replay.hpp>
#ifdef MRR_TEST_YAML
#include <mrr/replay/config_yaml.hpp>
#endif

#include <doctest/doctest.h>
#include <support/fifo.hpp>

#include "temp_dir.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

namespace {

bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// A .npy file as numpy writes it (version 1.0, C order).
void write_npy(const std::filesystem::path& path, const std::string& descr, const std::vector<std::int64_t>& shape,
               const std::vector<std::int64_t>& values, int bytes, bool fortran = false) {
  std::string dims;
  for (auto d : shape) dims += std::to_string(d) + ", ";
  std::string header = "{'descr': '" + descr + "', 'fortran_order': " + (fortran ? "True" : "False") +
                      ", 'shape': (" + dims.substr(0, dims.size() - (shape.size() == 1 ? 1 : 2)) + "), }";
  while ((10 + header.size() + 1) % 64 != 0) header += ' ';
  header += '\n';
  std::ofstream out(path, std::ios::binary);
  out.write("\x93NUMPY\x01\x00", 8);
  const auto len = static_cast<std::uint16_t>(header.size());
  out.put(static_cast<char>(len & 0xff));
  out.put(static_cast<char>(len >> 8));
  out << header;
  for (auto v : values)
    for (int b = 0; b < bytes; ++b) out.put(static_cast<char>((static_cast<std::uint64_t>(v) >> (8 * b)) & 0xff));
}

}  // namespace

TEST_CASE("key=value overrides with verl's names; later wins; other keys are passed through") {
  mrr::ReplayConfig c;
  const std::vector<std::string> args = {"actor_rollout_ref.actor.router_replay.mode=R2",
                                        "trainer.total_epochs=3",
                                        "+actor_rollout_ref.actor.router_replay.record_file=/tmp/a.mrr",
                                        "actor_rollout_ref.actor.router_replay.mode=R3",
                                        "actor_rollout_ref.rollout.enable_rollout_routing_replay=True"};
  const auto rest = c.apply_overrides(std::span<const std::string>(args));
  CHECK(c.mode == mrr::ReplayMode::R3);
  CHECK(c.record_file == "/tmp/a.mrr");
  CHECK(c.enable_rollout_routing_replay);
  REQUIRE(rest.size() == 1);
  CHECK(rest[0] == "trainer.total_epochs=3");
  CHECK_NOTHROW(c.validate());
}

TEST_CASE("inconsistent configurations are errors naming the keys") {
  mrr::ReplayConfig c;
  CHECK_THROWS_WITH_AS(c.set("actor_rollout_ref.actor.router_replay.mode", "R5"),
                       doctest::Contains("unknown router replay mode 'R5'"), mrr::ConfigError);
  CHECK_THROWS_WITH_AS(c.set("actor_rollout_ref.actor.router_replay.replay_fiel", "x"),
                       doctest::Contains("unknown key actor_rollout_ref.actor.router_replay.replay_fiel"),
                       mrr::ConfigError);
  CHECK_THROWS_WITH_AS(c.set("actor_rollout_ref.rollout.enable_rollout_routing_replay", "maybe"),
                       doctest::Contains("expected true or false"), mrr::ConfigError);
  c.mode = mrr::ReplayMode::R2;
  c.enable_rollout_routing_replay = true;
  CHECK_THROWS_WITH_AS(c.validate(), doctest::Contains("mode=R2 records routes in the training engine"),
                       mrr::ConfigError);
  c.mode = mrr::ReplayMode::R3;
  c.enable_rollout_routing_replay = false;
  CHECK_THROWS_WITH_AS(c.validate(), doctest::Contains("enable_rollout_routing_replay=false"), mrr::ConfigError);
  c.mode = mrr::ReplayMode::disabled;
  c.record_file = "x.mrr";
  CHECK_THROWS_WITH_AS(c.validate(), doctest::Contains("record_file is set but"), mrr::ConfigError);
  c.mode = mrr::ReplayMode::R2;
  c.replay_file = "y.mrr";
  CHECK_THROWS_WITH_AS(c.validate(), doctest::Contains("name different files"), mrr::ConfigError);
}

TEST_CASE("override values: file paths must be real paths, null unsets, quotes make a string; verl's defaults") {
  mrr::ReplayConfig c;  // verl's defaults
  CHECK(c.mode == mrr::ReplayMode::disabled);
  CHECK(c.record_file.empty());
  CHECK(c.replay_file.empty());
  CHECK_FALSE(c.enable_rollout_routing_replay);
  const std::string rf(mrr::ReplayConfig::kRecordFile);
  for (const std::string bad : {"\"\"", "''", "\"   \"", "\"\t\"", "123", "1.5e3", "true", "off", "0x1f"}) {
    CAPTURE(bad);
    CHECK_THROWS_WITH_AS(c.set(rf, bad), doctest::Contains((rf + ": ").c_str()), mrr::ConfigError);
  }
  CHECK_THROWS_WITH_AS(c.set(rf, "123"), doctest::Contains("expected a file path or null, got the number 123"),
                       mrr::ConfigError);
  CHECK_THROWS_WITH_AS(c.set(rf, "\"\""), doctest::Contains("the file path is empty"), mrr::ConfigError);
  CHECK_THROWS_WITH_AS(c.set(rf, "\"  \""), doctest::Contains("only whitespace"), mrr::ConfigError);
  CHECK_THROWS_WITH_AS(c.set(rf, std::string_view("a\0b", 3)), doctest::Contains("NUL byte at offset 1"),
                       mrr::ConfigError);
  c.set(rf, "'123'");  // quoted: a file named 123
  CHECK(c.record_file == "123");
  c.set(rf, "null");
  CHECK(c.record_file.empty());
  // Explicit null takes the default for the other keys too.
  c.set(mrr::ReplayConfig::kRolloutReplay, "true");
  c.set(mrr::ReplayConfig::kRolloutReplay, "~");
  CHECK_FALSE(c.enable_rollout_routing_replay);
  c.set(mrr::ReplayConfig::kMode, "R2");
  c.set(mrr::ReplayConfig::kMode, "null");
  CHECK(c.mode == mrr::ReplayMode::disabled);
  CHECK_THROWS_WITH_AS(c.set(mrr::ReplayConfig::kMode, "3"),
                       doctest::Contains("mode: expected disabled, R2 or R3, got the number 3"), mrr::ConfigError);
  // Hydra's _target_ (in verl's generated configs) is accepted; the whole node is not settable.
  CHECK(c.set(mrr::ReplayConfig::kTarget, "verl.workers.config.RouterReplayConfig"));
  CHECK_THROWS_WITH_AS(c.set(mrr::ReplayConfig::kNode, "{mode:R2}"), doctest::Contains("set its keys one by one"),
                       mrr::ConfigError);
}

TEST_CASE("Hydra's ~key puts a key back to verl's default; unclosed quotes and ${...} are errors") {
  mrr::ReplayConfig c;
  const std::vector<std::string> args = {"actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
                                         "actor_rollout_ref.actor.router_replay.mode=R3",
                                         "actor_rollout_ref.actor.router_replay.record_file=a.mrr",
                                         "~actor_rollout_ref.rollout.enable_rollout_routing_replay",
                                         "~actor_rollout_ref.actor.router_replay.record_file=a.mrr",
                                         "~trainer.logger"};
  const auto rest = c.apply_overrides(std::span<const std::string>(args));
  CHECK_FALSE(c.enable_rollout_routing_replay);
  CHECK(c.record_file.empty());
  CHECK(c.mode == mrr::ReplayMode::R3);
  CHECK(rest == std::vector<std::string>{"~trainer.logger"});
  CHECK_THROWS_WITH_AS(c.validate(), doctest::Contains("enable_rollout_routing_replay=false"), mrr::ConfigError);
  // ~key=value deletes only a matching value, as Hydra does.
  const std::vector<std::string> mismatch = {"~actor_rollout_ref.actor.router_replay.mode=R2"};
  CHECK_THROWS_WITH_AS(c.apply_overrides(std::span<const std::string>(mismatch)),
                       doctest::Contains("the key does not hold R2"), mrr::ConfigError);
  CHECK(c.mode == mrr::ReplayMode::R3);
  c.record_file = "b.mrr";
  c.enable_rollout_routing_replay = true;
  const std::vector<std::string> node = {"~actor_rollout_ref.actor.router_replay"};
  c.apply_overrides(std::span<const std::string>(node));
  CHECK(c.mode == mrr::ReplayMode::disabled);
  CHECK(c.record_file.empty());
  CHECK(c.enable_rollout_routing_replay);  // not under router_replay

  const std::string rf(mrr::ReplayConfig::kRecordFile);
  CHECK_THROWS_WITH_AS(c.set(rf, "\"routes.mrr'"), doctest::Contains("opens a quote (\") that does not close"),
                       mrr::ConfigError);
  CHECK_THROWS_WITH_AS(c.set(rf, "'routes.mrr"), doctest::Contains("does not close"), mrr::ConfigError);
  CHECK_THROWS_WITH_AS(c.set(rf, "\""), doctest::Contains("does not close"), mrr::ConfigError);
  // OmegaConf interpolations are not resolved here: never a file named after them.
  CHECK_THROWS_WITH_AS(c.set(rf, "routes_${oc.env:USER,me}.mrr"), doctest::Contains("holds an OmegaConf interpolation"),
                       mrr::ConfigError);
  CHECK_THROWS_WITH_AS(c.set(rf, "'${oc.env:HOME}/r.mrr'"), doctest::Contains("OmegaConf"), mrr::ConfigError);
  c.set(rf, "a\\${b}.mrr");  // OmegaConf's escape: a literal ${
  CHECK(c.record_file == "a${b}.mrr");
  c.set(rf, "cost$5.mrr");
  CHECK(c.record_file == "cost$5.mrr");
}

TEST_CASE("a key given twice on the command line takes its last value, as in Hydra") {
  mrr::ReplayConfig c;
  const std::vector<std::string> args = {"actor_rollout_ref.actor.router_replay.mode=R3",
                                        "actor_rollout_ref.actor.router_replay.mode=R2"};
  c.apply_overrides(std::span<const std::string>(args));
  CHECK(c.mode == mrr::ReplayMode::R2);
}

TEST_CASE("booleans are YAML 1.1's (as PyYAML and so verl read them), every spelling alike") {
  const std::string flag(mrr::ReplayConfig::kRolloutReplay);
  mrr::ReplayConfig c;
  for (const std::string yes : {"true", "True", "TRUE", "yes", "Yes", "YES", "on", "On", "ON", "1", "'On'", "\"yes\""}) {
    CAPTURE(yes);
    c.enable_rollout_routing_replay = false;
    c.set(flag, yes);
    CHECK(c.enable_rollout_routing_replay);
  }
  for (const std::string no : {"false", "False", "FALSE", "no", "No", "NO", "off", "Off", "OFF", "0"}) {
    CAPTURE(no);
    c.enable_rollout_routing_replay = true;
    c.set(flag, no);
    CHECK_FALSE(c.enable_rollout_routing_replay);
  }
  // Not booleans in YAML 1.1 as PyYAML resolves it: errors naming the key and the rule.
  for (const std::string bad : {"y", "n", "tRUE", "oN", "2", "enable"}) {
    CAPTURE(bad);
    CHECK_THROWS_WITH_AS(c.set(flag, bad), doctest::Contains((flag + ": expected true or false, got").c_str()),
                         mrr::ConfigError);
    CHECK_THROWS_WITH_AS(c.set(flag, bad), doctest::Contains("yes/no, on/off"), mrr::ConfigError);
  }
  // A word that resolves as a boolean is accepted as one: what resolve() calls a boolean, as_bool() reads.
  for (const std::string word : {"On", "OFF", "Yes", "NO"}) {
    CAPTURE(word);
    CHECK(mrr::ConfigValue::plain(word).kind == mrr::ConfigValue::Kind::boolean);
    CHECK_NOTHROW(c.set(flag, word));
  }
}

TEST_CASE("a Hydra list or map on the command line is not a single value: an error naming the key") {
  mrr::ReplayConfig c;
  const std::string rf(mrr::ReplayConfig::kRecordFile), mode(mrr::ReplayConfig::kMode);
  CHECK_THROWS_WITH_AS(c.set(rf, "[a.mrr,b.mrr]"),
                       doctest::Contains((rf + ": expected a file path or null, got the list [a.mrr,b.mrr]").c_str()),
                       mrr::ConfigError);
  CHECK_THROWS_WITH_AS(c.set(mode, "[R2]"), doctest::Contains("mode: expected disabled, R2 or R3, got the list [R2]"),
                       mrr::ConfigError);
  CHECK_THROWS_WITH_AS(c.set(mrr::ReplayConfig::kRolloutReplay, "{a: 1}"),
                       doctest::Contains("enable_rollout_routing_replay: expected true or false, got the map {a: 1}"),
                       mrr::ConfigError);
  c.set(rf, "'[a.mrr]'");  // quoted: a file with brackets in its name
  CHECK(c.record_file == "[a.mrr]");
  // Other keys pass through untouched, lists included (they belong to the rest of the trainer).
  const std::vector<std::string> args = {"trainer.logger=[console,wandb]"};
  CHECK(c.apply_overrides(std::span<const std::string>(args)) == args);
}

TEST_CASE("record_file and replay_file spelled differently but naming one file are one file") {
  mrr::test::TempDir dir;
  const auto cwd = std::filesystem::current_path();
  std::filesystem::current_path(dir.path());
  struct Restore {
    std::filesystem::path to;
    ~Restore() { std::filesystem::current_path(to); }
  } restore{cwd};
  mrr::ReplayConfig c;
  c.mode = mrr::ReplayMode::R2;
  const auto one_file = [&](const std::string& record, const std::string& replay) {
    c.record_file = record;
    c.replay_file = replay;
    c.validate();
  };
  // Before the file exists (the first run creates it) and after.
  for (int exists = 0; exists < 2; ++exists) {
    CAPTURE(exists);
    std::filesystem::create_directories("sub");
    CHECK_NOTHROW(one_file("routes.mrr", "./routes.mrr"));
    CHECK_NOTHROW(one_file("routes.mrr", "sub/../routes.mrr"));
    CHECK_NOTHROW(one_file((dir.path() / "routes.mrr").string(), "routes.mrr"));
    CHECK_NOTHROW(one_file("./sub//r.mrr", "sub/r.mrr"));
    CHECK_THROWS_WITH_AS(one_file("routes.mrr", "sub/routes.mrr"), doctest::Contains("name different files"),
                         mrr::ConfigError);
    std::ofstream("routes.mrr") << "x";
    std::ofstream("sub/r.mrr") << "x";
  }
  // A symlink or a hard link to the file is the file.
  std::filesystem::create_symlink(dir.path() / "routes.mrr", "link.mrr");
  std::filesystem::create_hard_link("routes.mrr", "hard.mrr");
  CHECK_NOTHROW(one_file("link.mrr", "routes.mrr"));
  CHECK_NOTHROW(one_file("hard.mrr", "./routes.mrr"));
  CHECK(mrr::ReplayConfig::same_file("routes.mrr", "./routes.mrr"));
  CHECK_FALSE(mrr::ReplayConfig::same_file("routes.mrr", "sub/r.mrr"));

  // open_route_file treats them as one file too: replayed and appended to.
  std::filesystem::remove("routes.mrr");
  std::filesystem::remove("hard.mrr");
  const mrr::RouteShape model{8, 1, 2};
  c.record_file = "routes.mrr";
  c.replay_file.clear();
  {
    auto first = mrr::open_route_file(c, model);  // created
    REQUIRE(first.has_value());
    first->record_sequence(1, 0, 1, 0, 1, std::vector<std::int32_t>{3, 5});
  }
  c.replay_file = "./routes.mrr";
  auto store = mrr::open_route_file(c, model);
  REQUIRE(store.has_value());
  CHECK(store->writable());
  CHECK(store->num_sequences() == 1);
}

TEST_CASE("open_route_file: record_file is created or appended, replay_file must exist and match the model") {
  mrr::test::TempDir dir;
  const mrr::RouteShape model{32, 2, 4};
  mrr::ReplayConfig c;
  c.mode = mrr::ReplayMode::R2;
  CHECK_FALSE(mrr::open_route_file(c, model).has_value());  // memory store
  c.record_file = (dir / "r2.mrr").string();
  {
    auto store = mrr::open_route_file(c, model);
    REQUIRE(store.has_value());
    CHECK(store->writable());
    std::vector<std::int32_t> ids(3 * 2 * 4);
    for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<std::int32_t>(i % 32);
    store->record_sequence(1, 0, 3, 0, 2, ids);
  }
  c.record_file.clear();
  c.replay_file = (dir / "r2.mrr").string();
  auto replay = mrr::open_route_file(c, model);
  REQUIRE(replay.has_value());
  CHECK_FALSE(replay->writable());
  CHECK(replay->num_sequences() == 1);
  CHECK_THROWS_WITH_AS(mrr::open_route_file(c, mrr::RouteShape{32, 3, 4}),
                       doctest::Contains("actor_rollout_ref.actor.router_replay.replay_file: route file"),
                       mrr::RouteFileError);
  CHECK_THROWS_WITH_AS(mrr::open_route_file(c, mrr::RouteShape{32, 3, 4}),
                       doctest::Contains("num_layers (MoE layers) = 2 but the model has 3"), mrr::RouteFileError);
  c.replay_file = (dir / "missing.mrr").string();
  CHECK_THROWS_WITH_AS(mrr::open_route_file(c, model), doctest::Contains("missing.mrr does not exist"),
                       mrr::RouteFileError);
}

#ifdef MRR_TEST_YAML
TEST_CASE("YAML config with verl's layout, then overrides") {
  mrr::test::TempDir dir;
  const auto yaml = dir / "ppo.yaml";
  std::ofstream(yaml) << "actor_rollout_ref:\n"
                        "  actor:\n"
                        "    ppo_mini_batch_size: 16\n"
                        "    router_replay:\n"
                        "      mode: R3\n"
                        "      record_file: null\n"
                        "      replay_file: null\n"
                        "  rollout:\n"
                        "    name: vllm\n"
                        "    enable_rollout_routing_replay: true\n";
  auto c = mrr::load_replay_config(yaml);
  CHECK(c.mode == mrr::ReplayMode::R3);
  CHECK(c.enable_rollout_routing_replay);
  CHECK(c.record_file.empty());
  const std::vector<std::string> over = {"actor_rollout_ref.actor.router_replay.mode=R2",
                                        "actor_rollout_ref.rollout.enable_rollout_routing_replay=false"};
  c = mrr::load_replay_config(yaml, std::span<const std::string>(over));
  CHECK(c.mode == mrr::ReplayMode::R2);
  c = mrr::load_replay_config(yaml, over);  // a vector, as docs/replay.md writes it
  CHECK(c.mode == mrr::ReplayMode::R2);
  CHECK(mrr::load_replay_config_from_string("actor_rollout_ref: {}\n", over).mode == mrr::ReplayMode::R2);
  const std::vector<std::string> bad = {"actor_rollout_ref.actor.router_replay.mode=R2"};
  CHECK_THROWS_WITH_AS(mrr::load_replay_config(yaml, std::span<const std::string>(bad)),
                       doctest::Contains("mode=R2 records routes"), mrr::ConfigError);
  std::ofstream(dir / "typo.yaml") << "actor_rollout_ref:\n  actor:\n    router_replay:\n      mdoe: R2\n";
  CHECK_THROWS_WITH_AS(mrr::load_replay_config(dir / "typo.yaml"),
                       doctest::Contains("unknown key actor_rollout_ref.actor.router_replay.mdoe"), mrr::ConfigError);
  std::ofstream(dir / "list.yaml") << "actor_rollout_ref:\n  actor:\n    router_replay:\n      mode: [R2]\n";
  CHECK_THROWS_WITH_AS(mrr::load_replay_config(dir / "list.yaml"), doctest::Contains("expected a single value"),
                       mrr::ConfigError);
  CHECK_THROWS_WITH_AS(mrr::load_replay_config(dir / "nope.yaml"), doctest::Contains("nope.yaml does not exist"),
                       mrr::ConfigError);
}
TEST_CASE("YAML: merge keys (<<) are expanded as PyYAML expands them; validate() errors name the file") {
  // The anchor's map is merged under the map's own keys, which win; an earlier merged map wins
  // over a later one.
  const auto c = mrr::load_replay_config_from_string(
      std::string("base: &b {actor: {router_replay: {mode: R2, record_file: routes.mrr}}}\n"
                  "actor_rollout_ref: {<<: *b}\n"));
  CHECK(c.mode == mrr::ReplayMode::R2);
  CHECK(c.record_file == "routes.mrr");
  const auto own =
      mrr::load_replay_config_from_string(std::string("defaults: &d {mode: R3, replay_file: a.mrr}\n"
                                                      "first: &f {mode: R2}\n"
                                                      "actor_rollout_ref:\n"
                                                      "  actor:\n"
                                                      "    router_replay:\n"
                                                      "      <<: [*f, *d]\n"
                                                      "      replay_file: null\n"
                                                      "      record_file: r.mrr\n"));
  CHECK(own.mode == mrr::ReplayMode::R2);  // *f before *d
  CHECK(own.replay_file.empty());          // the map's own key wins over the merged one
  CHECK(own.record_file == "r.mrr");
  const auto nested =
      mrr::load_replay_config_from_string(std::string("a: &a {enable_rollout_routing_replay: true}\n"
                                                      "b: &b {<<: *a, name: vllm}\n"
                                                      "actor_rollout_ref:\n"
                                                      "  actor: {router_replay: {mode: R3}}\n"
                                                      "  rollout: {<<: *b}\n"));
  CHECK(nested.enable_rollout_routing_replay);
  CHECK_THROWS_WITH_AS(mrr::load_replay_config_from_string(std::string("actor_rollout_ref: {<<: 5}\n")),
                       doctest::Contains("actor_rollout_ref: a merge key (<<) takes a map or a list of maps"),
                       mrr::ConfigError);
  // A quoted "<<" is a plain key, unknown under router_replay.
  CHECK_THROWS_WITH_AS(
      mrr::load_replay_config_from_string(std::string("actor_rollout_ref: {actor: {router_replay: {'<<': R2}}}\n")),
      doctest::Contains("unknown key actor_rollout_ref.actor.router_replay.<<"), mrr::ConfigError);
  CHECK_THROWS_WITH_AS(
      mrr::load_replay_config_from_string(std::string("actor_rollout_ref: {actor: {router_replay: {mode: R3}}}\n")),
      doctest::Contains("YAML config: actor_rollout_ref.actor.router_replay.mode=R3 replays"), mrr::ConfigError);
}

TEST_CASE("YAML: a FIFO or a directory as the config file is refused at once, naming the file") {
  mrr::test::TempDir dir;
  const auto fifo = dir / "ppo.yaml";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  const std::string error = mrr::test::error_or_blocked(fifo, [&] { mrr::load_replay_config(fifo); });
  CHECK(has(error, "config file " + fifo.string() + ": not a regular file (a FIFO"));
  CHECK_THROWS_WITH_AS(mrr::load_yaml_config(dir.path()), doctest::Contains("not a regular file (a directory)"),
                       mrr::ConfigError);
}

TEST_CASE("YAML: a stream of several documents is an error naming the source, not its first document") {
  mrr::test::TempDir dir;
  const std::string r2 = "actor_rollout_ref:\n  actor:\n    router_replay:\n      mode: R2\n";
  std::ofstream(dir / "two.yaml") << r2 << "---\n" << r2;
  CHECK_THROWS_WITH_AS(
      mrr::load_replay_config(dir / "two.yaml"),
      doctest::Contains(("config file " + (dir / "two.yaml").string() +
                         ": holds more than one YAML document (another starts at line 5)").c_str()),
      mrr::ConfigError);
  CHECK_THROWS_WITH_AS(mrr::load_replay_config_from_string("a: 1\n---\nb: 2\n---\nc: 3\n"),
                       doctest::Contains("YAML config: holds more than one YAML document"), mrr::ConfigError);
  // An empty second document is a second document too (PyYAML refuses it as well).
  CHECK_THROWS_WITH_AS(mrr::load_replay_config_from_string(r2 + "---\n"),
                       doctest::Contains("holds more than one YAML document"), mrr::ConfigError);
  // Text yaml-cpp cannot read, which it reports as endless empty documents at one place (LoadAll
  // never returns; Load took it for an empty configuration), is an error naming the place.
  CHECK_THROWS_WITH_AS(mrr::load_replay_config_from_string(",a"),
                       doctest::Contains("YAML config: is not YAML that can be read: the parser stops at line 1, column 1"),
                       mrr::ConfigError);
  // One document, with the optional markers around it, is one document.
  CHECK(mrr::load_replay_config_from_string("---\n" + r2 + "...\n").mode == mrr::ReplayMode::R2);
  CHECK(mrr::load_replay_config_from_string("# only a comment\n").mode == mrr::ReplayMode::disabled);
}

TEST_CASE("YAML: enable_rollout_routing_replay: On is the boolean On, as yes is") {
  for (const std::string word : {"On", "ON", "on", "yes", "Yes", "YES", "true"}) {
    CAPTURE(word);
    const auto c = mrr::load_replay_config_from_string(
        "actor_rollout_ref:\n  actor:\n    router_replay:\n      mode: R3\n  rollout:\n"
        "    enable_rollout_routing_replay: " + word + "\n");
    CHECK(c.enable_rollout_routing_replay);
  }
}

TEST_CASE("YAML: absent keys take verl's defaults; a minimal R2 config loads") {
  mrr::test::TempDir dir;
  std::ofstream(dir / "r2.yaml") << "actor_rollout_ref:\n  actor:\n    router_replay:\n      mode: R2\n";
  const auto r2 = mrr::load_replay_config(dir / "r2.yaml");
  CHECK(r2.mode == mrr::ReplayMode::R2);
  CHECK_FALSE(r2.enable_rollout_routing_replay);
  CHECK(r2.record_file.empty());
  // rollout present without the flag, an empty file, a tree without actor_rollout_ref: defaults.
  std::ofstream(dir / "rollout.yaml") << "actor_rollout_ref:\n  actor:\n    router_replay:\n      mode: R2\n"
                                        "  rollout:\n    name: vllm\n";
  CHECK(mrr::load_replay_config(dir / "rollout.yaml").mode == mrr::ReplayMode::R2);
  std::ofstream(dir / "empty.yaml") << "";
  CHECK(mrr::load_replay_config(dir / "empty.yaml").mode == mrr::ReplayMode::disabled);
  std::ofstream(dir / "other.yaml") << "trainer:\n  total_epochs: 3\nactor_rollout_ref:\n";
  CHECK(mrr::load_replay_config(dir / "other.yaml").mode == mrr::ReplayMode::disabled);
  // verl's generated config carries Hydra's _target_ under router_replay.
  const auto verl = mrr::load_replay_config_from_string(
      "actor_rollout_ref:\n  actor:\n    router_replay:\n      _target_: verl.workers.config.RouterReplayConfig\n"
      "      mode: R3\n      record_file: null\n      replay_file: null\n  rollout:\n"
      "    enable_rollout_routing_replay: true\n");
  CHECK(verl.mode == mrr::ReplayMode::R3);
}

TEST_CASE("YAML: duplicate keys, complex keys, wrong kinds and bad paths are errors naming the key") {
  const auto error_of = [](const std::string& yaml) -> std::string {
    try {
      mrr::load_replay_config_from_string(yaml);
    } catch (const mrr::ConfigError& e) {
      return e.what();
    }
    return "(no error)";
  };
  const std::string head = "actor_rollout_ref:\n  actor:\n    router_replay:\n      mode: R2\n";
  CHECK(has(error_of(head + "      record_file: a.mrr\n      record_file: b.mrr\n"),
            "actor_rollout_ref.actor.router_replay.record_file appears twice"));
  CHECK(has(error_of(head + "      mode: R3\n"), "router_replay.mode appears twice"));
  CHECK(has(error_of(head + "  rollout:\n    enable_rollout_routing_replay: false\n"
                            "    enable_rollout_routing_replay: true\n"),
            "actor_rollout_ref.rollout.enable_rollout_routing_replay appears twice"));
  CHECK(has(error_of(head + "actor_rollout_ref:\n  rollout: {}\n"),
            "actor_rollout_ref appears twice"));
  CHECK(has(error_of(head + "  actor:\n    ppo_epochs: 1\n"), "actor_rollout_ref.actor appears twice"));
  CHECK(has(error_of(head + "      ? [a, b]\n      : c\n"),
            "actor_rollout_ref.actor.router_replay: a key is a list"));
  CHECK(has(error_of(head + "      record_file: 123\n"),
            "record_file: expected a file path or null, got the number 123"));
  CHECK(has(error_of(head + "      record_file: true\n"),
            "record_file: expected a file path or null, got the boolean true"));
  CHECK(has(error_of(head + "      record_file: !!int 7\n"), "record_file: expected a file path"));
  CHECK(has(error_of(head + "      record_file: \"\"\n"), "record_file: the file path is empty"));
  CHECK(has(error_of(head + "      record_file: \"  \"\n"), "record_file: the file path is only whitespace"));
  CHECK(has(error_of(head + "      replay_file: \"a\\0b\"\n"),
            "replay_file: the file path has a NUL byte at offset 1"));
  CHECK(has(error_of(head + "      record_file: !custom x\n"), "record_file: unsupported YAML tag !custom"));
  CHECK(has(error_of("actor_rollout_ref:\n  rollout:\n    enable_rollout_routing_replay: maybe\n"),
            "enable_rollout_routing_replay: expected true or false, got 'maybe'"));
  CHECK(has(error_of("actor_rollout_ref: [1, 2]\n"), "actor_rollout_ref: expected a map, got a list"));
  CHECK(has(error_of("actor_rollout_ref:\n  rollout: 5\n"),
            "actor_rollout_ref.rollout: expected a map, got a single value"));
  CHECK(has(error_of("- 1\n- 2\n"), "the top level of the configuration is not a map"));
  CHECK(has(error_of("a: [\n"), "YAML config: "));  // a parse error, as a ConfigError
  // Quoted numbers are file names; the messages start with the source.
  const auto quoted = mrr::load_replay_config_from_string(head + "      record_file: '123'\n");
  CHECK(quoted.record_file == "123");
  CHECK(error_of(head + "      record_file: 1\n").rfind("YAML config: ", 0) == 0);
}
#endif

TEST_CASE("vLLM routed_experts .npy ([tokens, layers, k] int32) imports as an R3 source") {
  mrr::test::TempDir dir;
  const int L = 3, k = 2, E = 16, tokens = 5;
  std::vector<std::int64_t> values;
  for (int t = 0; t < tokens; ++t)
    for (int l = 0; l < L; ++l)
      for (int j = 0; j < k; ++j) values.push_back((t * 3 + l * 5 + j * 7) % E);
  write_npy(dir / "r.npy", "<i4", {tokens, L, k}, values, 4);
  mrr::MemoryRouteStore store({E, L, k});
  mrr::import_routed_experts_npy(store, 11, dir / "r.npy");
  CHECK(store.recorded_positions(11) == tokens);
  const std::vector<mrr::SequenceId> uids = {11};
  const auto layout = mrr::TokenLayout::packed(uids, std::vector<std::int64_t>{0, tokens + 1});
  for (int l = 0; l < L; ++l) {
    mrr::ExpertIds got;
    std::vector<std::uint8_t> found;
    CHECK(store.lookup(l, layout, got, found) == tokens);
    for (int t = 0; t < tokens; ++t)
      for (int j = 0; j < k; ++j) CHECK(got(t, j) == values[static_cast<std::size_t>((t * L + l) * k + j)]);
    CHECK(found[tokens] == 0);
  }
  // int64 arrays work too; wrong layers / k / ids / layout are errors naming the problem.
  write_npy(dir / "r64.npy", "<i8", {tokens, L, k}, values, 8);
  mrr::MemoryRouteStore store64({E, L, k});
  mrr::import_routed_experts_npy(store64, 1, dir / "r64.npy");
  CHECK(store64.recorded_positions(1) == tokens);
  mrr::MemoryRouteStore wrong_layers({E, L + 1, k});
  CHECK_THROWS_WITH_AS(mrr::import_routed_experts_npy(wrong_layers, 1, dir / "r.npy"),
                       doctest::Contains("routed_experts has 3 layers but the model has 4 MoE layers"),
                       mrr::InvalidArgument);
  mrr::MemoryRouteStore wrong_k({E, L, k + 1});
  CHECK_THROWS_WITH_AS(mrr::import_routed_experts_npy(wrong_k, 1, dir / "r.npy"), doctest::Contains("k = 2"),
                       mrr::InvalidArgument);
  // A token listing one expert twice in a layer is refused before anything is stored, in every
  // id width and store (a route file is append-only: a bad route could never be corrected).
  {
    const std::vector<std::uint8_t> dup = {0, 1, 5, 5, 2, 3};  // [3 tokens, 1 layer, k = 2]: token 1 repeats 5
    mrr::test::TempDir files;
    auto file = mrr::FileRouteStore::create(files / "dup.mrr", {E, 1, k});
    CHECK_THROWS_WITH_AS(mrr::import_routed_experts(file, 4, std::span<const std::uint8_t>(dup), 3, 1, k),
                         doctest::Contains("routed_experts[1, 0, 1] = 5 repeats an expert"), mrr::InvalidArgument);
    CHECK_FALSE(file.contains(4));
    mrr::MemoryRouteStore mem({E, 1, k});
    const std::vector<std::int64_t> dup64(dup.begin(), dup.end());
    CHECK_THROWS_WITH_AS(mrr::import_routed_experts(mem, 4, std::span<const std::int64_t>(dup64), 3, 1, k),
                         doctest::Contains("repeats an expert"), mrr::InvalidArgument);
    CHECK_FALSE(mem.contains(4));
    // The corrected routes then import (into a store chosen at run time too).
    const std::vector<std::uint8_t> fixed = {0, 1, 5, 6, 2, 3};
    mrr::import_routed_experts(file, 4, std::span<const std::uint8_t>(fixed), 3, 1, k);
    CHECK(file.recorded_positions(4) == 3);
    mrr::AnyRouteStore any(mrr::RouteShape{E, 1, k});
    mrr::import_routed_experts(any, 4, std::span<const std::uint8_t>(fixed), 3, 1, k);
    CHECK(any.recorded_positions(4) == 3);
  }
  mrr::MemoryRouteStore few_experts({8, L, k});
  CHECK_THROWS_WITH_AS(mrr::import_routed_experts_npy(few_experts, 1, dir / "r.npy"),
                       doctest::Contains("is outside [0, 8)"), mrr::InvalidArgument);

  // An id type too narrow for the model is refused, in memory and in a file, before any id is stored:
  // a uint8 array of a 300-expert model can only come from a truncating cast (ids 264 -> 8).
  {
    const int wide = 300;
    const std::vector<std::uint8_t> truncated = {8, 3, 10, 43};  // the rollout routed 264, 3, 10, 299
    mrr::MemoryRouteStore many({wide, 1, k});
    CHECK_THROWS_WITH_AS(mrr::import_routed_experts(many, 9, std::span<const std::uint8_t>(truncated), 2, 1, k),
                         doctest::Contains("routed_experts holds 8-bit unsigned ids, which cannot hold the ids of "
                                           "the model's 300 experts"),
                         mrr::InvalidArgument);
    CHECK_FALSE(many.contains(9));
    const std::vector<std::int8_t> signed8 = {8, 3, 10, 43};
    mrr::MemoryRouteStore e200({200, 1, k});
    CHECK_THROWS_WITH_AS(mrr::import_routed_experts(e200, 9, std::span<const std::int8_t>(signed8), 2, 1, k),
                         doctest::Contains("8-bit signed ids"), mrr::InvalidArgument);
    write_npy(dir / "u1.npy", "|u1", {2, 1, k}, std::vector<std::int64_t>(truncated.begin(), truncated.end()), 1);
    CHECK_THROWS_WITH_AS(mrr::import_routed_experts_npy(many, 9, dir / "u1.npy"),
                         doctest::Contains("8-bit unsigned ids"), mrr::InvalidArgument);
    // 256 experts fit uint8, and the file's own width goes to a route file as it is.
    mrr::test::TempDir files;
    auto file = mrr::FileRouteStore::create(files / "u1.mrr", {256, 1, k});
    mrr::import_routed_experts_npy(file, 9, dir / "u1.npy");
    const std::vector<mrr::SequenceId> nine = {9};
    mrr::ExpertIds got;
    std::vector<std::uint8_t> found;
    CHECK(file.lookup(0, mrr::TokenLayout::packed(nine, std::vector<std::int64_t>{0, 2}), got, found) == 2);
    CHECK(got(0, 0) == 8);
    CHECK(got(1, 1) == 43);
  }

  // A uint64 id past int64 is named as the file holds it, not wrapped to -1.
  write_npy(dir / "u8.npy", "<u8", {1, 1, k}, {-1, 3}, 8);
  mrr::MemoryRouteStore one_layer({E, 1, k});
  CHECK_THROWS_WITH_AS(mrr::import_routed_experts_npy(one_layer, 3, dir / "u8.npy"),
                       doctest::Contains("routed_experts[0, 0, 0] = 18446744073709551615 is outside [0, 16)"),
                       mrr::InvalidArgument);

  write_npy(dir / "f.npy", "<i4", {tokens, L, k}, values, 4, true);
  CHECK_THROWS_WITH_AS(mrr::read_npy(dir / "f.npy"), doctest::Contains("Fortran order"), mrr::InvalidArgument);
  write_npy(dir / "x.npy", "<f4", {tokens, L, k}, values, 4);
  CHECK_THROWS_WITH_AS(mrr::read_npy(dir / "x.npy"), doctest::Contains("dtype '<f4'"), mrr::InvalidArgument);
  write_npy(dir / "2d.npy", "<i4", {tokens, L * k}, values, 4);
  CHECK_THROWS_WITH_AS(mrr::import_routed_experts_npy(store, 2, dir / "2d.npy"), doctest::Contains("2 dimensions"),
                       mrr::InvalidArgument);
}

TEST_CASE("routed_experts with a row per decoder layer (dense layers zero-filled, as SGLang's capturer): moe_layers") {
  // 6 decoder layers, the first two dense (their rows zeros: a top-k of repeated expert 0, which
  // the import would refuse), four MoE layers: the model's MoE layer i is decoder layer 2 + i.
  mrr::test::TempDir dir;
  const int decoder = 6, moe = 4, k = 3, E = 32, tokens = 7;
  std::vector<std::int64_t> values;
  const auto id = [&](int t, int l, int j) { return (t * 5 + l * 11 + j * 7) % E; };
  for (int t = 0; t < tokens; ++t)
    for (int l = 0; l < decoder; ++l)
      for (int j = 0; j < k; ++j)
        values.push_back(l < 2 ? 0 : id(t, l, j));
  write_npy(dir / "all.npy", "<i4", {tokens, decoder, k}, values, 4);
  const std::vector<int> moe_layers = {2, 3, 4, 5};
  mrr::MemoryRouteStore store({E, moe, k});
  CHECK_THROWS_WITH_AS(mrr::import_routed_experts_npy(store, 3, dir / "all.npy"),
                       doctest::Contains("routed_experts has 6 layers but the model has 4 MoE layers (an array with a "
                                         "row per decoder layer, dense ones included: give moe_layers)"),
                       mrr::InvalidArgument);
  mrr::import_routed_experts_npy(store, 3, dir / "all.npy", 0, moe_layers);
  const std::vector<mrr::SequenceId> uids = {3};
  const auto layout = mrr::TokenLayout::packed(uids, std::vector<std::int64_t>{0, tokens});
  for (int i = 0; i < moe; ++i) {
    mrr::ExpertIds got;
    std::vector<std::uint8_t> found;
    REQUIRE(store.lookup(i, layout, got, found) == tokens);
    for (int t = 0; t < tokens; ++t)
      for (int j = 0; j < k; ++j)
        CHECK(got(t, j) == id(t, moe_layers[static_cast<std::size_t>(i)], j));
  }
  // Into a route file from 1-byte ids, from a later position (a continuation).
  mrr::test::TempDir files;
  auto file = mrr::FileRouteStore::create(files / "r.mrr", {E, moe, k});
  const std::vector<std::uint8_t> bytes(values.begin(), values.end());
  mrr::import_routed_experts(file, 9, std::span<const std::uint8_t>(bytes), tokens, decoder, k, 5,
                             std::span<const int>(moe_layers));
  CHECK(file.recorded_positions(9) == 5 + tokens);
  // moe_layers out of order, outside the array, or naming another count of layers: errors, and
  // nothing stored.
  const auto refused = [&](std::vector<int> layers, const char* text) {
    mrr::MemoryRouteStore s({E, moe, k});
    CHECK_THROWS_WITH_AS(mrr::import_routed_experts_npy(s, 3, dir / "all.npy", 0, layers), doctest::Contains(text),
                         mrr::InvalidArgument);
    CHECK_FALSE(s.contains(3));
  };
  refused({2, 3, 5, 4}, "moe_layers[3] = 4 does not follow the one before it or is outside the array's 6 layers");
  refused({2, 3, 4, 6}, "moe_layers[3] = 6 does not follow the one before it or is outside the array's 6 layers");
  refused({-1, 3, 4, 5}, "moe_layers[0] = -1 is outside the array's 6 layers [0, 6)");
  refused({3, 4, 5}, "moe_layers names 3 layers but the model has 4 MoE layers");
  refused({0, 3, 4, 5}, "repeats an expert");  // a dense layer's zeros named as a MoE layer
}

#ifdef MRR_PYTHON_WITH_NUMPY
TEST_CASE("examples/python/read_routes.py reads a file written by the library, checksums verified") {
  // In each format version the library writes: 3 (the default) and 2 (XXH3-64 record checksums;
  // the records here take XXH3's 17-128 and over-240-byte paths) and 1 (XXH64).
  for (const std::uint16_t version : {std::uint16_t{0}, std::uint16_t{2}, std::uint16_t{1}}) {
    CAPTURE(version);
    mrr::test::TempDir dir;
    const mrr::RouteShape shape{300, 2, 3};  // 2-byte ids
    const auto path = dir / "routes.mrr";
    std::vector<std::int32_t> ids;
    {
      auto store = mrr::FileRouteStore::create(path, shape, {.format_version = version});
      CHECK(store.format_version() == (version == 0 ? mrr::route_file::kVersion : version));
      for (int t = 0; t < 40; ++t)
        for (int l = 0; l < 2; ++l)
          for (int j = 0; j < 3; ++j)
            ids.push_back((t * 37 + l * 101 + j * 7) % 300);
      store.record_sequence(77, 0, 40, 0, 2, ids);
      // A second record for the same sequence, layer 1 only, positions 40..41.
      const std::vector<mrr::SequenceId> uids = {77};
      const auto layout =
          mrr::TokenLayout::packed(uids, std::vector<std::int64_t>{0, 2}, std::vector<std::int64_t>{40});
      mrr::ExpertIds more(2, 3);
      more << 299, 0, 1, 2, 3, 298;
      store.record(1, layout, more);
    }
    const auto npy = dir / "seq77.npy";
    const std::string cmd = std::string(MRR_PYTHON_WITH_NUMPY) + " " + MRR_READ_ROUTES_PY + " " + path.string() +
                            " --uid 77 --npy " + npy.string() + " > " + (dir / "out.txt").string() + " 2>&1";
    REQUIRE(std::system(cmd.c_str()) == 0);
    const auto a = mrr::read_npy(npy);
    REQUIRE(a.shape == std::vector<std::int64_t>{42, 2, 3});
    for (int t = 0; t < 40; ++t)
      for (int l = 0; l < 2; ++l)
        for (int j = 0; j < 3; ++j)
          CHECK(a.values[static_cast<std::size_t>((t * 2 + l) * 3 + j)] ==
                ids[static_cast<std::size_t>((t * 2 + l) * 3 + j)]);
    CHECK(a.values[static_cast<std::size_t>((40 * 2 + 0) * 3)] == -1);  // layer 0 not recorded at 40
    CHECK(a.values[static_cast<std::size_t>((40 * 2 + 1) * 3)] == 299);
    CHECK(a.values[static_cast<std::size_t>((41 * 2 + 1) * 3 + 2)] == 298);
    // A damaged record makes the reader fail, not return wrong ids.
    {
      std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
      f.seekp(static_cast<std::streamoff>(mrr::route_file::kHeaderBytes + mrr::route_file::kRecordHeaderBytes + 10));
      f.put('\x7f');
    }
    const std::string bad = std::string(MRR_PYTHON_WITH_NUMPY) + " " + MRR_READ_ROUTES_PY + " " + path.string() +
                            " --uid 77 > " + (dir / "bad.txt").string() + " 2>&1";
    CHECK(std::system(bad.c_str()) != 0);
    std::ifstream err(dir / "bad.txt");
    const std::string text((std::istreambuf_iterator<char>(err)), {});
    CHECK(text.find("fails its checksum") != std::string::npos);
  }
}
#endif
