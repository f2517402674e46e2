// libFuzzer target: arbitrary bytes as a route file, opened, read sequence by sequence, appended
// to and reopened with FileRouteStore. Every outcome must be success or an mrr exception; any
// other exception, crash or sanitizer report is a finding. The first input byte picks a mode:
// with bit 0 set, the file header's checksum and every record's header check and checksum are
// recomputed first, so the fuzzer reaches the field checks behind them.
#include <mrr/replay/file_store.hpp>

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

namespace {

namespace rf = mrr::route_file;

std::filesystem::path work_dir() {
  static const std::filesystem::path dir = [] {
    auto d = std::filesystem::temp_directory_path() / ("mrr-fuzz-route-file-" + std::to_string(::getpid()));
    std::filesystem::create_directories(d);
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(
          std::filesystem::temp_directory_path() / ("mrr-fuzz-route-file-" + std::to_string(::getpid())), ec);
    });
    return d;
  }();
  return dir;
}

// Makes every checksum in the file valid, whatever the fields say.
void fix_checksums(std::vector<unsigned char>& f) {
  if (f.size() < rf::kHeaderBytes) return;
  rf::detail::put<std::uint64_t>(f.data() + 56, XXH64(f.data(), 56, 0));
  // Records hashed as the header's version says (an unsupported one: as the newest, refused anyway).
  const auto version = rf::detail::get<std::uint16_t>(f.data() + 8);
  const std::uint16_t hash_version = rf::version_supported(version) ? version : rf::kVersion;
  std::uint64_t at = rf::kHeaderBytes;
  while (at + rf::kRecordHeaderBytes <= f.size()) {
    unsigned char* h = f.data() + at;
    const auto payload = rf::detail::get<std::uint64_t>(h + 8);
    const std::uint64_t left = f.size() - at - rf::kRecordHeaderBytes;
    const std::uint64_t have = payload < left ? payload : left;
    rf::detail::put<std::uint64_t>(
        h + 40, rf::checksum(hash_version, h, h + rf::kRecordHeaderBytes, static_cast<std::size_t>(have)));
    rf::detail::put<std::uint32_t>(h + 48, rf::header_check(h));
    if (payload > left) break;
    at += rf::record_bytes(payload);
  }
}

void write_file(const std::filesystem::path& p, const std::vector<unsigned char>& bytes) {
  std::FILE* f = std::fopen(p.c_str(), "wb");
  if (f == nullptr) std::abort();
  if (!bytes.empty() && std::fwrite(bytes.data(), 1, bytes.size(), f) != bytes.size()) std::abort();
  std::fclose(f);
}

void read_everything(const mrr::FileRouteStore& store) {
  for (mrr::SequenceId uid : store.sequences()) {
    const mrr::SequenceRoutes* seq = store.sequence(uid);
    if (seq == nullptr) continue;
    std::vector<mrr::TokenKey> keys;
    for (std::int64_t p = seq->positions() - 3; p <= seq->positions(); ++p)
      keys.push_back({uid, p < 0 ? 0 : p < mrr::kMaxPositions ? p : mrr::kMaxPositions - 1});
    const mrr::TokenLayout layout(keys);
    mrr::ExpertIds got;
    std::vector<std::uint8_t> found;
    for (int l = 0; l < store.shape().num_layers && l < 4; ++l)
      (void)store.lookup(l, layout, got, found);
    store.release_cache();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const bool fix = (data[0] & 1) != 0;
  std::vector<unsigned char> bytes(data + 1, data + size);
  if (fix) fix_checksums(bytes);
  const auto path = work_dir() / "input.mrr";
  write_file(path, bytes);
  try {
    mrr::RouteShape shape;
    {
      auto store = mrr::FileRouteStore::open(path);
      shape = store.shape();
      (void)store.recovery().describe(path);
      read_everything(store);
    }
    {
      auto store = mrr::FileRouteStore::append(path, shape);
      // One token of every layer, when that is small: sized before anything is allocated (a file's
      // shape may declare 65,535 layers x 4,096 experts per token, a 1 GiB row).
      const std::size_t n = static_cast<std::size_t>(shape.num_layers) * static_cast<std::size_t>(shape.topk);
      if (n <= (1u << 16)) store.record_sequence(0xf00d, 5, 1, 0, shape.num_layers, std::vector<std::int32_t>(n, 0));
      store.close();
    }
    auto again = mrr::FileRouteStore::open(path, shape);
    read_everything(again);
  } catch (const mrr::RouteStoreError&) {  // RouteFileError and the store's own errors
  } catch (const mrr::InvalidArgument&) {
  }
  std::filesystem::remove(path);
  return 0;
}
