// Route file throughput: writing R2 records (one record call per layer and micro-batch) and
// reading them back for replay (look up every layer of every micro-batch, each sequence's records
// verified when first used), beside a plain fwrite / fread of the same id bytes and numpy's
// np.save / np.load of them, and of the same ids as int32 (run with /usr/bin/python3 in the same
// run); R3 (a record per sequence, every layer) also beside numpy taking each layer's rows of the
// loaded array. Everything goes through a warm page cache. Steady state: buffers reused, the store opened once (its
// records are still re-verified every pass: release_cache() after each micro-batch); "open +" rows include open().
#include <mrr/replay.hpp>

#include <harness.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <unistd.h>

namespace {

constexpr int kExperts = 256, kLayers = 48, kTopK = 8;
constexpr int kSequences = 64, kTokens = 2048, kPerMicroBatch = 8;

struct Data {
  std::vector<mrr::TokenLayout> layouts;    // per micro-batch
  std::vector<mrr::ExpertIds> ids;          // per micro-batch and layer
  // The same routes per sequence as a rollout engine returns them: uint8 [tokens, layers, k]
  // (vLLM's routed_experts for <= 256 experts), for record_sequence.
  std::vector<std::vector<std::uint8_t>> rollout;
};

Data make_data() {
  Data d;
  std::mt19937 rng(5);
  std::uniform_int_distribution<int> expert(0, kExperts - 1);
  for (int mb = 0; mb < kSequences / kPerMicroBatch; ++mb) {
    std::vector<mrr::SequenceId> uids;
    std::vector<std::int64_t> cu{0};
    for (int s = 0; s < kPerMicroBatch; ++s) {
      uids.push_back(static_cast<mrr::SequenceId>(mb * kPerMicroBatch + s));
      cu.push_back(cu.back() + kTokens);
    }
    d.layouts.push_back(mrr::TokenLayout::packed(uids, cu));
    for (int l = 0; l < kLayers; ++l) {
      mrr::ExpertIds ids(kPerMicroBatch * kTokens, kTopK);
      for (Eigen::Index i = 0; i < ids.size(); ++i) ids.data()[i] = expert(rng);
      d.ids.push_back(ids);
    }
  }
  for (int seq = 0; seq < kSequences; ++seq) {
    const int mb = seq / kPerMicroBatch, first_row = (seq % kPerMicroBatch) * kTokens;
    std::vector<std::uint8_t> block(static_cast<std::size_t>(kTokens) * kLayers * kTopK);
    for (int t = 0; t < kTokens; ++t)
      for (int l = 0; l < kLayers; ++l)
        for (int j = 0; j < kTopK; ++j)
          block[(static_cast<std::size_t>(t) * kLayers + static_cast<std::size_t>(l)) * kTopK +
                static_cast<std::size_t>(j)] =
              static_cast<std::uint8_t>(d.ids[static_cast<std::size_t>(mb * kLayers + l)](first_row + t, j));
    d.rollout.push_back(std::move(block));
  }
  return d;
}

// Records every sequence's rollout block (uint8 [tokens, layers, k]) with record_sequence, the
// sequence ids shifted by `uid_offset`.
void record_rollout(mrr::FileRouteStore& store, const Data& data, int uid_offset) {
  for (int seq = 0; seq < kSequences; ++seq)
    store.record_sequence(static_cast<mrr::SequenceId>(uid_offset + seq), 0, kTokens, 0, kLayers,
                          std::span<const std::uint8_t>(data.rollout[static_cast<std::size_t>(seq)]));
}

// The start of a numpy baseline script: the raw id bytes as `a`, a [rows, layers, k] uint8 array.
std::string numpy_ids(const std::filesystem::path& raw_path) {
  return "import time, numpy as np\n"
         "a = np.fromfile('" + raw_path.string() + "', dtype=np.uint8).reshape(-1, " + std::to_string(kLayers) + ", " +
         std::to_string(kTopK) + ")\n";
}

// Runs a numpy timing script with /usr/bin/python3 and reads the N times it prints (seconds); all
// 0 when there is no such Python or the script fails.
template <std::size_t N = 2>
std::array<double, N> run_numpy(const std::filesystem::path& script_path, const std::string& script) {
  if (std::FILE* f = std::fopen(script_path.c_str(), "w")) {
    std::fputs(script.c_str(), f);
    std::fclose(f);
  }
  std::array<double, N> times{};
  if (std::FILE* p = ::popen(("/usr/bin/python3 " + script_path.string() + " 2>/dev/null").c_str(), "r")) {
    for (double& t : times)
      if (std::fscanf(p, "%lf", &t) != 1) {
        times.fill(0);
        break;
      }
    ::pclose(p);
  }
  return times;
}

// Drops a file's pages from the page cache (clean pages only: the writers below fsync first), so
// the next read comes from the disk. posix_fadvise needs no privileges.
void drop_cache(const std::filesystem::path& p) {
  const int fd = ::open(p.c_str(), O_RDONLY);
  if (fd < 0) return;
  ::fdatasync(fd);
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
}

// Cold reads of a file of MRR_BENCH_COLD_GB GB (default 2; 0 skips): the data set repeated with
// new sequence ids, written once (fsync'd), then its pages dropped and the whole file replayed
// (open + lookup of every layer of every micro-batch), beside fread of the same id bytes and
// np.load of them, each dropped from the cache the same way first: in rounds of the three, below.
void cold_case(const std::filesystem::path& dir, const Data& data, const std::vector<unsigned char>& raw,
               std::size_t chunk) {
  const char* env = std::getenv("MRR_BENCH_COLD_GB");
  const double gb = env != nullptr ? std::atof(env) : 2.0;
  if (!(gb > 0)) return;
  const int reps = std::max(1, static_cast<int>(gb * 1e9 / static_cast<double>(raw.size()) + 0.5));
  const double bytes = static_cast<double>(raw.size()) * reps;
  const auto path = dir / "cold.mrr", raw_path = dir / "cold.bin", npy_path = dir / "cold.npy";
  const std::size_t micro_batches = data.layouts.size();
  // Micro-batch mb of copy r: the same rows, sequence ids shifted by r * kSequences.
  auto layout = [&](int r, std::size_t mb) {
    std::vector<mrr::SequenceId> uids;
    std::vector<std::int64_t> cu{0};
    for (int s = 0; s < kPerMicroBatch; ++s) {
      uids.push_back(static_cast<mrr::SequenceId>(r * kSequences + static_cast<int>(mb) * kPerMicroBatch + s));
      cu.push_back(cu.back() + kTokens);
    }
    return mrr::TokenLayout::packed(uids, cu);
  };
  const double t_write = mrr::bench::time_it(
                             [&] {
                               std::filesystem::remove(path);
                               auto store = mrr::FileRouteStore::create(path, {kExperts, kLayers, kTopK});
                               for (int r = 0; r < reps; ++r)
                                 for (std::size_t mb = 0; mb < micro_batches; ++mb) {
                                   const auto lay = layout(r, mb);
                                   for (int l = 0; l < kLayers; ++l)
                                     store.record(l, lay, data.ids[mb * kLayers + static_cast<std::size_t>(l)]);
                                 }
                               store.close();  // fsync'd (sync_on_close)
                             },
                             0.0, 1)
                             .median_s;
  // The rollout import path: uint8 ids per sequence (record_sequence), fsync'd the same way.
  const auto path_u8 = dir / "cold_u8.mrr";
  const double t_write_u8 = mrr::bench::time_it(
                                [&] {
                                  std::filesystem::remove(path_u8);
                                  auto store = mrr::FileRouteStore::create(path_u8, {kExperts, kLayers, kTopK});
                                  for (int r = 0; r < reps; ++r)
                                    record_rollout(store, data, r * kSequences);
                                  store.close();
                                },
                                0.0, 1)
                                .median_s;
  std::filesystem::remove(path_u8);
  const double t_fwrite = mrr::bench::time_it(
                              [&] {
                                std::FILE* f = std::fopen(raw_path.c_str(), "wb");
                                for (int r = 0; r < reps; ++r)
                                  for (std::size_t at = 0; at < raw.size(); at += chunk) std::fwrite(raw.data() + at, 1, chunk, f);
                                std::fflush(f);
                                ::fsync(::fileno(f));
                                std::fclose(f);
                              },
                              0.0, 1)
                              .median_s;
  // numpy: np.save of the same bytes, [rows, layers, k] uint8, fsync'd.
  const std::string drop_py =
      "import os\n"
      "def drop(p):\n"
      "    fd = os.open(p, os.O_RDONLY); os.fdatasync(fd); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); "
      "os.close(fd)\n";
  const auto [np_save] =
      run_numpy<1>(dir / "np_cold_save.py", numpy_ids(raw_path) + drop_py +
                                                "t0 = time.perf_counter()\n"
                                                "with open('" +
                                                npy_path.string() +
                                                "', 'wb') as f:\n"
                                                "    np.save(f, a); f.flush(); os.fsync(f.fileno())\n"
                                                "print(time.perf_counter() - t0)\n");
  const std::string np_load_py = "import time, numpy as np\n" + drop_py + "drop('" + npy_path.string() +
                                 "')\nt0 = time.perf_counter(); b = np.load('" + npy_path.string() +
                                 "'); print(time.perf_counter() - t0)\n";
  // The reads. On this VM one cold read of the same 2 GB takes 1.2 s or 3.5 s depending on the
  // virtual disk's state, which changes from one read to the next whatever the reader (the same
  // program alternated between the two, run after run), and the first read of a file written just
  // before took 4-6 s: so a first round is not counted, each round runs the three readers in turn,
  // the order rotating, and the table gives each reader's median and best of the counted rounds.
  const mrr::RouteShape shape{kExperts, kLayers, kTopK};
  mrr::ExpertIds out;
  std::vector<std::uint8_t> found;
  std::vector<unsigned char> back(raw.size());
  auto mrr_read = [&] {
    drop_cache(path);
    const auto t0 = std::chrono::steady_clock::now();
    {
      const auto store = mrr::FileRouteStore::open(path, shape);
      std::size_t hits = 0;
      for (int r = 0; r < reps; ++r)
        for (std::size_t mb = 0; mb < micro_batches; ++mb) {
          const auto lay = layout(r, mb);
          for (int l = 0; l < kLayers; ++l)
            hits += store.lookup(l, lay, out, found);
          store.release_cache();
        }
      mrr::bench::do_not_optimize(hits);
    }
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  auto fread_read = [&] {
    drop_cache(raw_path);
    const auto t0 = std::chrono::steady_clock::now();
    std::FILE* f = std::fopen(raw_path.c_str(), "rb");
    for (int r = 0; r < reps; ++r)
      for (std::size_t at = 0; at < back.size(); at += chunk)
        mrr::bench::do_not_optimize(std::fread(back.data() + at, 1, chunk, f));
    std::fclose(f);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  auto np_read = [&] { return run_numpy<1>(dir / "np_cold_load.py", np_load_py)[0]; };
  constexpr int kRounds = 6;
  std::array<std::vector<double>, 3> all, t;  // mrr, fread, np.load: every read in round order; the counted ones
  for (int round = 0; round <= kRounds; ++round)
    for (int i = 0; i < 3; ++i) {
      const auto which = static_cast<std::size_t>((round + i) % 3);
      all[which].push_back(which == 0 ? mrr_read() : which == 1 ? fread_read() : np_read());
      if (round > 0) t[which].push_back(all[which].back());
    }
  for (auto& v : t)
    std::sort(v.begin(), v.end());
  const auto median = [](const std::vector<double>& v) { return 0.5 * (v[(v.size() - 1) / 2] + v[v.size() / 2]); };
  const double read_med = median(t[0]), read_min = t[0][0], fread_med = median(t[1]), fread_min = t[1][0];
  const double np_med = t[2][0] > 0 ? median(t[2]) : 0.0, np_min = t[2][0];
  std::printf(
      "\ncold (page cache dropped with posix_fadvise(DONTNEED) before each read), a %.2f GB route file"
      " (%d copies of the data set); writes fsync'd; reads: %d rounds of the three readers in turn, after one"
      " not counted\n",
      static_cast<double>(std::filesystem::file_size(path)) / 1e9, reps, kRounds);
  std::printf("  (ratios: baseline time / mrr time, so above 1 means mrr is faster)\n");
  std::printf("  write: mrr %.2f s (%.0f MB/s), fwrite %.2f s (%.2fx), np.save %.2f s (%.2fx)\n", t_write,
              bytes / t_write / 1e6, t_fwrite, t_fwrite / t_write, np_save, np_save > 0 ? np_save / t_write : 0.0);
  std::printf(
      "  write from uint8 ids (record_sequence per sequence, as a rollout import): mrr %.2f s (%.0f MB/s), "
      "fwrite %.2fx, np.save %.2fx\n",
      t_write_u8, bytes / t_write_u8 / 1e6, t_fwrite / t_write_u8, np_save > 0 ? np_save / t_write_u8 : 0.0);
  std::printf("  open + replay read, median: mrr %.2f s (%.0f MB/s), fread %.2f s (%.2fx), np.load %.2f s (%.2fx)\n",
              read_med, bytes / read_med / 1e6, fread_med, fread_med / read_med, np_med,
              np_med > 0 ? np_med / read_med : 0.0);
  std::printf("  open + replay read, best:   mrr %.2f s (%.0f MB/s), fread %.2f s (%.2fx), np.load %.2f s (%.2fx)\n",
              read_min, bytes / read_min / 1e6, fread_min, fread_min / read_min, np_min,
              np_min > 0 ? np_min / read_min : 0.0);
  const char* names[] = {"mrr", "fread", "np.load"};
  std::printf("  every read, s, in round order (the first not counted):");
  for (std::size_t c = 0; c < 3; ++c) {
    std::printf(" %s", names[c]);
    for (const double v : all[c])
      std::printf(" %.2f", v);
    std::printf(c < 2 ? ";" : "\n");
  }
  std::filesystem::remove(path);
  std::filesystem::remove(raw_path);
  std::filesystem::remove(npy_path);
}

}  // namespace

int main() {
  const auto dir = std::filesystem::temp_directory_path() / "mrr_bench_route_file";
  std::filesystem::create_directories(dir);
  const auto path = dir / "routes.mrr";
  const auto raw_path = dir / "raw.bin";
  const Data data = make_data();
  const double id_bytes = static_cast<double>(kSequences) * kTokens * kLayers * kTopK;  // 1-byte ids
  const std::size_t micro_batches = data.layouts.size();

  // The same bytes as the store's payload, for the plain-stdio baseline.
  std::vector<unsigned char> raw(static_cast<std::size_t>(id_bytes));
  for (std::size_t i = 0, at = 0; i < data.ids.size(); ++i)
    for (Eigen::Index j = 0; j < data.ids[i].size(); ++j) raw[at++] = static_cast<unsigned char>(data.ids[i].data()[j]);
  const std::size_t chunk = static_cast<std::size_t>(kPerMicroBatch) * kTokens * kTopK;  // one record call's bytes

  const double bw = mrr::bench::copy_bandwidth();
  std::printf("route file: %d sequences x %d tokens x %d layers x k=%d, 1-byte ids = %.1f MB of ids\n", kSequences,
              kTokens, kLayers, kTopK, id_bytes / 1e6);
  std::printf("record checksums: XXH3-64 with its %s kernels (mrr/detail/xxhash.hpp picks them at run time)\n",
              mrr::detail::xxh3_uses_avx2() ? "AVX2" : "baseline (SSE2 on x86-64)");
  mrr::bench::print_table_header("route file (warm page cache, steady state), baselines fwrite/fread and np.save/np.load", bw);

  const auto write = mrr::bench::time_it(
      [&] {
        std::filesystem::remove(path);
        auto store = mrr::FileRouteStore::create(path, {kExperts, kLayers, kTopK}, {.sync_on_close = false});
        for (std::size_t mb = 0; mb < micro_batches; ++mb)
          for (int l = 0; l < kLayers; ++l) store.record(l, data.layouts[mb], data.ids[mb * kLayers + static_cast<std::size_t>(l)]);
        store.close();
      },
      1.0, 5);
  const auto fwrite_t = mrr::bench::time_it(
      [&] {
        std::FILE* f = std::fopen(raw_path.c_str(), "wb");
        for (std::size_t at = 0; at < raw.size(); at += chunk) std::fwrite(raw.data() + at, 1, chunk, f);
        std::fclose(f);
      },
      1.0, 5);
  const auto path_u8 = dir / "routes_u8.mrr";
  const auto write_u8 = mrr::bench::time_it(
      [&] {
        std::filesystem::remove(path_u8);
        auto store = mrr::FileRouteStore::create(path_u8, {kExperts, kLayers, kTopK}, {.sync_on_close = false});
        record_rollout(store, data, 0);
        store.close();
      },
      1.0, 5);
  mrr::bench::print_row("write (record per layer x micro-batch)", write.median_s, fwrite_t.median_s, 2 * id_bytes, bw);
  mrr::bench::print_row("write from uint8 ids (record_sequence)", write_u8.median_s, fwrite_t.median_s, 2 * id_bytes,
                        bw);
  std::printf("    -> mrr %.0f MB/s, fwrite %.0f MB/s (file %.1f MB)\n", id_bytes / write.median_s / 1e6,
              id_bytes / fwrite_t.median_s / 1e6, static_cast<double>(std::filesystem::file_size(path)) / 1e6);

  mrr::ExpertIds out;
  std::vector<std::uint8_t> found;
  auto replay_all = [&](const mrr::FileRouteStore& store, bool reverify = true) {
    std::size_t hits = 0;
    for (std::size_t mb = 0; mb < micro_batches; ++mb) {
      for (int l = 0; l < kLayers; ++l) hits += store.lookup(l, data.layouts[mb], out, found);
      if (reverify) store.release_cache();  // replay reads a micro-batch's sequences once: verified again next pass
    }
    mrr::bench::do_not_optimize(hits);
  };
  const mrr::RouteShape shape{kExperts, kLayers, kTopK};
  const auto reader = mrr::FileRouteStore::open(path, shape);
  const auto read = mrr::bench::time_it([&] { replay_all(reader); }, 1.0, 5);
  const auto open_read = mrr::bench::time_it([&] { replay_all(mrr::FileRouteStore::open(path, shape)); }, 1.0, 5);
  // Later PPO epochs over the same sequences: records already verified, lookups only.
  const auto reread = mrr::bench::time_it([&] { replay_all(reader, false); }, 1.0, 5);
  // The same lookups into 1-byte ids (what a GPU trainer uploads, vLLM's dtype): no widening.
  mrr::RowMatrix<std::uint8_t> out_u8;
  auto replay_u8 = [&](const mrr::FileRouteStore& store, bool reverify) {
    std::size_t hits = 0;
    for (std::size_t mb = 0; mb < micro_batches; ++mb) {
      for (int l = 0; l < kLayers; ++l)
        hits += store.lookup(l, data.layouts[mb], out_u8, found);
      if (reverify) store.release_cache();
    }
    mrr::bench::do_not_optimize(hits);
  };
  const auto read_u8 = mrr::bench::time_it([&] { replay_u8(reader, true); }, 1.0, 5);
  const auto reread_u8 = mrr::bench::time_it([&] { replay_u8(reader, false); }, 1.0, 5);
  // R3: the rollout's file (record_sequence, one record per sequence holding every layer) replayed
  // layer by layer, as a trainer's update pass looks it up. A layer's rows are strided through each
  // record; the reader keeps each record whole, layer-major, once verified (read_cache_bytes), and
  // without that (read_cache_bytes = 0) each layer's lookup reads the record's span again.
  const auto r3 = mrr::FileRouteStore::open(path_u8, shape);
  const auto r3_uncached = mrr::FileRouteStore::open(path_u8, shape, {.read_cache_bytes = 0});
  const auto read_r3 = mrr::bench::time_it([&] { replay_all(r3); }, 1.0, 5);
  const auto read_r3_u8 = mrr::bench::time_it([&] { replay_u8(r3, true); }, 1.0, 5);
  const auto reread_r3_u8 = mrr::bench::time_it([&] { replay_u8(r3, false); }, 1.0, 5);
  const auto read_r3_uncached = mrr::bench::time_it([&] { replay_all(r3_uncached); }, 0.5, 3);
  std::filesystem::remove(path_u8);
  // The same routes in a MemoryRouteStore (routes kept in the trainer's memory, no file): recorded
  // per layer and micro-batch, then looked up the same way.
  auto record_memory = [&](mrr::MemoryRouteStore& m) {
    for (std::size_t mb = 0; mb < micro_batches; ++mb)
      for (int l = 0; l < kLayers; ++l)
        m.record(l, data.layouts[mb], data.ids[mb * kLayers + static_cast<std::size_t>(l)]);
  };
  const auto mem_record = mrr::bench::time_it(
      [&] {
        mrr::MemoryRouteStore m(shape);
        record_memory(m);
      },
      1.0, 3);
  mrr::MemoryRouteStore memory(shape);
  record_memory(memory);
  auto lookup_memory = [&](auto& ids) {
    std::size_t hits = 0;
    for (std::size_t mb = 0; mb < micro_batches; ++mb)
      for (int l = 0; l < kLayers; ++l)
        hits += memory.lookup(l, data.layouts[mb], ids, found);
    mrr::bench::do_not_optimize(hits);
  };
  const auto mem_read = mrr::bench::time_it([&] { lookup_memory(out); }, 1.0, 5);
  const auto mem_read_u8 = mrr::bench::time_it([&] { lookup_memory(out_u8); }, 1.0, 5);
  std::vector<unsigned char> back(raw.size());
  const auto fread_t = mrr::bench::time_it(
      [&] {
        std::FILE* f = std::fopen(raw_path.c_str(), "rb");
        for (std::size_t at = 0; at < back.size(); at += chunk)
          mrr::bench::do_not_optimize(std::fread(back.data() + at, 1, chunk, f));
        std::fclose(f);
      },
      1.0, 5);
  mrr::bench::print_row("replay read (lookup every layer)", read.median_s, fread_t.median_s, 2 * id_bytes, bw);
  mrr::bench::print_row("open + replay read", open_read.median_s, fread_t.median_s, 2 * id_bytes, bw);
  mrr::bench::print_row("replay read, records verified earlier", reread.median_s, fread_t.median_s, 2 * id_bytes, bw);
  mrr::bench::print_row("replay read into uint8 ids", read_u8.median_s, fread_t.median_s, 2 * id_bytes, bw);
  mrr::bench::print_row("replay read into uint8, verified earlier", reread_u8.median_s, fread_t.median_s, 2 * id_bytes,
                        bw);
  std::printf("    -> mrr %.0f MB/s (open + replay %.0f MB/s), fread %.0f MB/s\n", id_bytes / read.median_s / 1e6,
              id_bytes / open_read.median_s / 1e6, id_bytes / fread_t.median_s / 1e6);
  std::printf("  R3: the rollout's file (record_sequence: a record per sequence, every layer), looked up by layer\n");
  mrr::bench::print_row("R3 replay read", read_r3.median_s, fread_t.median_s, 2 * id_bytes, bw);
  mrr::bench::print_row("R3 replay read into uint8 ids", read_r3_u8.median_s, fread_t.median_s, 2 * id_bytes, bw);
  mrr::bench::print_row("R3 replay into uint8, verified earlier", reread_r3_u8.median_s, fread_t.median_s, 2 * id_bytes,
                        bw);
  mrr::bench::print_row("R3 replay read, read_cache_bytes = 0", read_r3_uncached.median_s, fread_t.median_s,
                        2 * id_bytes, bw);
  std::printf(
      "  MemoryRouteStore, the same routes (no file): record per layer %.1f ms; lookup every layer %.1f ms "
      "into int32, %.1f ms into uint8\n",
      mem_record.median_s * 1e3, mem_read.median_s * 1e3, mem_read_u8.median_s * 1e3);

  // numpy on the same bytes, a [sequences * tokens, layers, k] uint8 array (median of 7 calls),
  // and on the same ids as int32 (what a Python trainer holding the router's int32 ids saves, and
  // what an int32 lookup produces: 4x the bytes).
  const auto npy_path = dir / "raw.npy";
  const auto npy32_path = dir / "raw32.npy";
  const std::string script = numpy_ids(raw_path) + "p8, p32 = '" + npy_path.string() + "', '" + npy32_path.string() +
                             "'\n"
                             "def med(f):\n"
                             "    f(); t = []\n"
                             "    for _ in range(7):\n"
                             "        t0 = time.perf_counter(); f(); t.append(time.perf_counter() - t0)\n"
                             "    return sorted(t)[3]\n"
                             "s = med(lambda: np.save(p8, a))\n"
                             "l = med(lambda: np.load(p8))\n"
                             "b = a.astype(np.int32)\n"
                             "s4 = med(lambda: np.save(p32, b))\n"
                             "l4 = med(lambda: np.load(p32))\n"
                             "def by_layer(dtype):\n"  // R3 in numpy: the rollout's array, then each layer's rows
                             "    x = np.load(p8); n = " +
                             std::to_string(kPerMicroBatch * kTokens) +
                             "\n"
                             "    for m in range(0, x.shape[0], n):\n"
                             "        for j in range(x.shape[1]):\n"
                             "            y = np.ascontiguousarray(x[m:m + n, j, :], dtype=dtype)\n"
                             "r3 = med(lambda: by_layer(np.uint8))\n"
                             "r3_32 = med(lambda: by_layer(np.int32))\n"
                             "print(s, l, s4, l4, r3, r3_32)\n";
  const auto [np_save, np_load, np_save32, np_load32, np_r3, np_r3_32] = run_numpy<6>(dir / "np_baseline.py", script);
  if (np_save > 0) {
    mrr::bench::print_row("write vs np.save", write.median_s, np_save, 2 * id_bytes, bw);
    mrr::bench::print_row("write from uint8 ids vs np.save", write_u8.median_s, np_save, 2 * id_bytes, bw);
    mrr::bench::print_row("replay read vs np.load", read.median_s, np_load, 2 * id_bytes, bw);
    mrr::bench::print_row("open + replay read vs np.load", open_read.median_s, np_load, 2 * id_bytes, bw);
    mrr::bench::print_row("replay read into uint8 vs np.load", read_u8.median_s, np_load, 2 * id_bytes, bw);
    mrr::bench::print_row("  the same, verified earlier", reread_u8.median_s, np_load, 2 * id_bytes, bw);
    mrr::bench::print_row("R3 replay read vs np.load", read_r3.median_s, np_load, 2 * id_bytes, bw);
    mrr::bench::print_row("R3 replay read into uint8 vs np.load", read_r3_u8.median_s, np_load, 2 * id_bytes, bw);
    std::printf(
        "    against numpy doing R3's work (np.load of the rollout's [rows, layers, k] array, then each\n"
        "    micro-batch's rows of each layer as a contiguous array: %.1f ms uint8, %.1f ms int32):\n",
        np_r3 * 1e3, np_r3_32 * 1e3);
    mrr::bench::print_row("R3 replay read vs np.load + layer rows", read_r3.median_s, np_r3_32, 2 * id_bytes, bw);
    mrr::bench::print_row("R3 into uint8 vs np.load + layer rows", read_r3_u8.median_s, np_r3, 2 * id_bytes, bw);
    std::printf("    against numpy on the same ids as int32 (np.save %.1f ms, np.load %.1f ms; 4x the bytes):\n",
                np_save32 * 1e3, np_load32 * 1e3);
    mrr::bench::print_row("write vs np.save of int32 ids", write.median_s, np_save32, 2 * id_bytes, bw);
    mrr::bench::print_row("replay read vs np.load of int32 ids", read.median_s, np_load32, 2 * id_bytes, bw);
    mrr::bench::print_row("  the same, verified earlier", reread.median_s, np_load32, 2 * id_bytes, bw);
  } else {
    std::printf("    (np.save / np.load baseline skipped: no /usr/bin/python3 with numpy)\n");
  }
  // Context (cold numbers): first-touching fresh memory costs page faults that reused buffers never
  // pay (np.load allocates its array on every call). Measured here, on this machine:
  const auto touch = mrr::bench::time_it(
      [&] {
        const std::size_t n = static_cast<std::size_t>(id_bytes);
        std::unique_ptr<unsigned char[]> fresh(new unsigned char[n]);
        for (std::size_t i = 0; i < n; i += 4096) fresh[i] = 1;
        mrr::bench::do_not_optimize(fresh[n / 2]);
      },
      0.5, 3);
  std::printf("    (first touch of %.1f MB of fresh memory: %.1f ms)\n", id_bytes / 1e6,
              touch.median_s * 1e3);
  cold_case(dir, data, raw, chunk);
  std::filesystem::remove_all(dir);
  return 0;
}
