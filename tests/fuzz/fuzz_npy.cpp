// libFuzzer target: arbitrary bytes as a .npy file, read with read_npy and imported as a vLLM
// routed_experts array into a memory store and a route file. Every outcome must be success or an
// mrr exception; any other exception, crash or sanitizer report is a finding.
#include <mrr/replay/file_store.hpp>
#include <mrr/replay/memory_store.hpp>
#include <mrr/replay/npy.hpp>
#include <mrr/replay/vllm_import.hpp>

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>

namespace {

std::filesystem::path work_dir() {
  static const std::filesystem::path dir = [] {
    auto d = std::filesystem::temp_directory_path() / ("mrr-fuzz-npy-" + std::to_string(::getpid()));
    std::filesystem::create_directories(d);
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(
          std::filesystem::temp_directory_path() / ("mrr-fuzz-npy-" + std::to_string(::getpid())), ec);
    });
    return d;
  }();
  return dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const auto path = work_dir() / "input.npy";
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) std::abort();
  if (size != 0 && std::fwrite(data, 1, size, f) != size) std::abort();
  std::fclose(f);
  try {
    const mrr::NpyIntArray a = mrr::read_npy(path);
    if (a.shape.size() == 3 && a.shape[1] >= 1 && a.shape[1] <= 64 && a.shape[2] >= 1 && a.shape[2] <= 16) {
      // A model whose shape matches the array's, so the import reaches the stores.
      const mrr::RouteShape shape{256, static_cast<std::int32_t>(a.shape[1]), static_cast<std::int32_t>(a.shape[2])};
      mrr::MemoryRouteStore memory(shape);
      try {
        mrr::import_routed_experts_npy(memory, 1, path, static_cast<std::int64_t>(size));
      } catch (const mrr::InvalidArgument&) {
      }
      const auto route_path = work_dir() / "routes.mrr";
      std::filesystem::remove(route_path);
      {
        auto file = mrr::FileRouteStore::create(route_path, shape);
        try {
          mrr::import_routed_experts_npy(file, 1, path);
        } catch (const mrr::InvalidArgument&) {
        }
      }
      (void)mrr::FileRouteStore::open(route_path, shape).recorded_positions(1);
      std::filesystem::remove(route_path);
    }
  } catch (const mrr::InvalidArgument&) {
  } catch (const mrr::RouteStoreError&) {
  }
  std::filesystem::remove(path);
  return 0;
}
