// Runs bench/references/reference_bench.py (PyTorch, Megatron-Core moe_utils, verl core_algos on
// the CPU) with the same thread count as ours and collects its `REF <case> <us>` lines, so that a
// C++ benchmark prints the reference's time beside its own from one run. Set
// MRR_BENCH_NO_REFERENCE=1 to skip it; MRR_BENCH_PYTHON picks the interpreter.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace mrr::bench {

inline int bench_threads() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

// Reference times in seconds by case name; empty when the script could not run.
// `threads` overrides bench_threads(); `extra` is appended to the script's arguments.
inline std::map<std::string, double> run_reference(const char* suite, int threads = 0, const std::string& extra = "") {
  std::map<std::string, double> out;
  if (const char* skip = std::getenv("MRR_BENCH_NO_REFERENCE"); skip != nullptr && *skip != '\0') return out;
  const char* python = std::getenv("MRR_BENCH_PYTHON");
  const std::string command = std::string(python != nullptr ? python : "/usr/bin/python3") + " " +
                              MRR_REFERENCE_SCRIPT + " --suite " + suite + " --threads " +
                              std::to_string(threads > 0 ? threads : bench_threads()) + " --workdir " +
                              MRR_REFERENCE_WORKDIR + " " + extra + " 2>&1";
  std::FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return out;
  char line[512];
  while (std::fgets(line, sizeof line, pipe) != nullptr) {
    char name[256];
    double us = 0;
    if (std::sscanf(line, "REF %255s %lf", name, &us) == 2)
      out[name] = us * 1e-6;
    else
      std::printf("  reference: %s", line);
  }
  if (pclose(pipe) != 0) std::printf("  reference script failed (%s)\n", command.c_str());
  return out;
}

// "name: ours, reference, reference/ours" for one case (skipped when the reference lacks it).
inline void print_vs_reference(const std::map<std::string, double>& ref, const std::string& key,
                               const std::string& label, double ours_s) {
  const auto it = ref.find(key);
  if (it == ref.end()) return;
  std::printf("    vs %-40s %10.1fus  ratio %.2fx (reference / ours)\n", label.c_str(), it->second * 1e6,
              it->second / ours_s);
}

}  // namespace mrr::bench
