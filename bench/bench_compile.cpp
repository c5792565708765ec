// Compile time of a synthetic 36-layer, 8-KV-head, head_dim-128 stats file (the shape of a
// Qwen3-8B-class model), per method, on this machine's cores. Optionally writes the stats file so
// `kvcc compile` / `kvcc report` can be timed end to end. Options: bench_compile --help.
#include <time.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include "bench/bench_args.h"
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
  kvcc::bench::Args("bench_compile",
                    "Compile time per method of a synthetic stats file (36 layers x 8 KV heads x head_dim 128 by\n"
                    "default: a Qwen3-8B-class shape) on this machine's cores.")
      .option("--layers", &spec.n_layers, "layers", 1)
      .option("--kv-heads", &spec.n_kv_heads, "KV heads", 1)
      .option("--head-dim", &spec.head_dim, "head_dim", 2)
      .option("--threads", &threads, "compile threads (0: all cores)", 0)
      .option("--write-stats", &stats_out, "also write the synthetic stats file here (for kvcc compile / report)")
      .option("--methods", &methods, "methods timed, comma-separated")
      .example("bench_compile --layers 4 --methods oscar,kivi --write-stats /tmp/synthetic.stats.h5")
      .parse(argc, argv);
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
