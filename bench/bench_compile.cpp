// Compile time of a synthetic 36-layer, 8-KV-head, head_dim-128 stats file (the shape of a
// Qwen3-8B-class model), per method, on this machine's cores. Optionally writes the stats file so
// `kvcc compile` / `kvcc report` can be timed end to end.
//   bench_compile [--layers 36] [--kv-heads 8] [--head-dim 128] [--threads 0] [--write-stats PATH]
#include <time.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include "compile/compile.h"
#include "compile/synthetic_stats.h"
#include "formats/error.h"

using namespace kvcc;

namespace {
// CPU seconds of the whole process (all threads): on a shared machine wall time also counts the
// time other processes held the cores; CPU time / cores is what the compile needs on idle cores.
double cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}
}  // namespace

int main(int argc, char** argv) {
  SyntheticSpec spec;
  spec.n_layers = 36;
  spec.n_kv_heads = 8;
  spec.group = 4;
  spec.head_dim = 128;
  spec.docs = 10;
  spec.doc_len = 128;
  int threads = 0;
  std::string stats_out;
  std::string methods = "oscar,oscar-lm,hadamard,identity,random,turboquant,kivi,kvarn";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--layers") spec.n_layers = std::atoi(argv[i + 1]);
    else if (flag == "--kv-heads") spec.n_kv_heads = std::atoi(argv[i + 1]);
    else if (flag == "--head-dim") spec.head_dim = std::atoi(argv[i + 1]);
    else if (flag == "--threads") threads = std::atoi(argv[i + 1]);
    else if (flag == "--write-stats") stats_out = argv[i + 1];
    else if (flag == "--methods") methods = argv[i + 1];
    else {
      std::fprintf(stderr, "unknown flag %s\n", argv[i]);
      return 2;
    }
  }
  try {
    auto t0 = std::chrono::steady_clock::now();
    const Stats stats = make_synthetic_stats(spec);
    const double gen = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf(
        "synthetic stats: %d layers x %d KV heads, head_dim %d, %d tokens, reservoir %zu rows "
        "per head (%.2f s to generate)\n",
        spec.n_layers, spec.n_kv_heads, spec.head_dim, spec.docs * spec.doc_len, stats.reservoirs[0].size(), gen);
    if (!stats_out.empty()) {
      write_stats(stats, stats_out);
      std::printf("wrote %s\n", stats_out.c_str());
    }
    std::printf("threads: %d (hardware %u)\n", threads, std::thread::hardware_concurrency());
    size_t start = 0;
    while (start < methods.size()) {
      size_t end = methods.find(',', start);
      if (end == std::string::npos) end = methods.size();
      CompileOptions o;
      o.method = methods.substr(start, end - start);
      o.threads = threads;
      t0 = std::chrono::steady_clock::now();
      const double cpu0 = cpu_seconds();
      const Artifact art = compile_artifact(stats, o);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const double cpu = cpu_seconds() - cpu0;
      std::printf("%-11s wall %7.2f s  cpu %7.2f s  (%zu heads, %.1f cpu-ms/head)\n", o.method.c_str(), s, cpu,
                  art.heads.size(), 1000.0 * cpu / double(art.heads.size()));
      std::fflush(stdout);
      start = end + 1;
    }
  } catch (const Error& e) {
    std::fprintf(stderr, "bench_compile: %s\n", e.what());
    return 1;
  }
  return 0;
}
