// Calibration throughput: tokens/s of `calibrate_model`, the share of time spent in statistics
// (inside the observer) versus the forward pass, and peak memory against what the layer-streaming
// design bounds it by (one layer's float32 weights + the hidden states of the calibration set).
//
// Each configuration runs in its own child process so that its peak RSS is its own. Options:
// bench_calibrate --help.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include <cblas.h>

#include "bench/bench_args.h"
#include "calibrate/driver.h"
#include "formats/error.h"

namespace {

struct Config {
  std::string name, model, text;
  uint64_t tokens;
  int max_seq_len;
};

int run_one(const Config& c) {
  kvcc::CalibrationOptions o;
  o.model_path = c.model;
  o.data_path = c.text;
  o.max_tokens = c.tokens;
  o.max_seq_len = c.max_seq_len;
  kvcc::CalibrationSummary s;
  try {
    kvcc::calibrate_model(o, &s);
  } catch (const kvcc::Error& e) {
    std::fprintf(stderr, "%s: error: %s\n", c.name.c_str(), e.what());
    return 1;
  }
  const double mib = 1024.0 * 1024.0;
  const double cpu = s.forward_cpu_seconds + s.stats_cpu_seconds;
  std::printf(
      "%-17s %6llu tokens %4llu seqs | wall %6.2f s, CPU %6.2f s: %6.0f tok/s (CPU) | CPU forward "
      "%6.2f s, stats %5.2f s = %4.1f%% of forward | peak RSS %6.1f MiB; layer %5.1f + hidden "
      "%5.1f = %5.1f MiB\n",
      c.name.c_str(), (unsigned long long)s.tokens, (unsigned long long)s.sequences, s.seconds, cpu,
      cpu > 0 ? double(s.tokens) / cpu : 0.0, s.forward_cpu_seconds, s.stats_cpu_seconds,
      s.forward_cpu_seconds > 0 ? 100.0 * s.stats_cpu_seconds / s.forward_cpu_seconds : 0.0,
      double(s.peak_rss_kib) / 1024.0, double(s.layer_weight_bytes) / mib, double(s.hidden_state_bytes) / mib,
      double(s.layer_weight_bytes + s.hidden_state_bytes) / mib);
  std::fflush(stdout);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // One BLAS thread: CPU time then measures work, not spinning helper threads, and the split
  // between forward and statistics is not skewed by how each parallelises on a shared machine.
  openblas_set_num_threads(1);
  std::vector<std::string> pos;
  kvcc::bench::Args("bench_calibrate",
                    "Calibration throughput (tokens/s of calibrate_model), the statistics' share of it, and peak\n"
                    "memory against the layer-streaming bound, each configuration in a child process.")
      .positional(&pos, "MODEL TEXT TOKENS [MAX_SEQ_LEN]",
                  "one configuration (default: tinystories-656k and gutenberg-27m from ../shared or $KVCC_SHARED)")
      .example("bench_calibrate ../shared/models/gutenberg-27m ../shared/text/gutenberg_heldout.txt 8192 2048")
      .parse(argc, argv);
  std::vector<Config> configs;
  if (!pos.empty()) {
    long tokens = 0, max_seq = 0;
    char *e1 = nullptr, *e2 = nullptr;
    if (pos.size() >= 3) tokens = std::strtol(pos[2].c_str(), &e1, 10);
    if (pos.size() == 4) max_seq = std::strtol(pos[3].c_str(), &e2, 10);
    if (pos.size() < 3 || pos.size() > 4 || *e1 || tokens < 1 || (e2 && (*e2 || max_seq < 0))) {
      std::fprintf(stderr,
                   "bench_calibrate: takes MODEL TEXT TOKENS [MAX_SEQ_LEN] (TOKENS >= 1, MAX_SEQ_LEN >= 0) or nothing "
                   "(bench_calibrate --help)\n");
      return 2;
    }
    configs.push_back({"custom", pos[0], pos[1], uint64_t(tokens), int(max_seq)});
  } else {
    // ../shared beside the repository (located from this source file), or $KVCC_SHARED.
    const char* env = std::getenv("KVCC_SHARED");
    const std::string shared =
        env ? std::string(env)
            : (std::filesystem::path(__FILE__).parent_path().parent_path() / ".." / "shared").string();
    configs.push_back({"tinystories-656k", shared + "/models/tinystories-656k",
                       shared + "/text/tinystories_valid_100.txt", 20000, 0});
    configs.push_back(
        {"gutenberg-27m", shared + "/models/gutenberg-27m", shared + "/text/gutenberg_heldout.txt", 8192, 2048});
  }
  int failures = 0;
  for (const Config& c : configs) {
    if (!std::filesystem::exists(c.model) || !std::filesystem::exists(c.text)) {
      std::printf("%-18s skipped: %s or %s not found\n", c.name.c_str(), c.model.c_str(), c.text.c_str());
      continue;
    }
    const pid_t pid = fork();
    if (pid == 0) _exit(run_one(c));
    int status = 0;
    waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) ++failures;
  }
  return failures == 0 ? 0 : 1;
}
