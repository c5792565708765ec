// CPU forward-pass throughput (tokens/s) of whole models over one sequence, layer by layer as
// calibration runs it (best of --repeat runs). Options: bench_forward --help.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "bench/bench_args.h"
#include "formats/error.h"
#include "formats/model_file.h"
#include "model/forward.h"

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> models;
  int tokens = 512, repeat = 3;
  kvcc::bench::Args("bench_forward",
                    "CPU forward-pass throughput (tokens/s) of whole models over one sequence, layer by layer as\n"
                    "calibration runs it.")
      .positional(&models, "MODEL ...",
                  "model directories (default, from the repository root: ../shared/models/tinystories-656k and "
                  "gutenberg-27m)")
      .option("--tokens", &tokens, "tokens of the sequence (at most the model's context)", 1)
      .option("--repeat", &repeat, "runs per model (the best is reported)", 1)
      .example("bench_forward ../shared/models/gutenberg-27m --tokens 2048")
      .parse(argc, argv);
  if (models.empty()) {
    const std::string shared = "../shared/models/";  // run from the repository root
    models = {shared + "tinystories-656k", shared + "gutenberg-27m"};
  }
  try {
    for (const std::string& path : models) {
      if (!std::filesystem::exists(path)) {
        std::printf("%s: absent, skipped\n", path.c_str());
        continue;
      }
      const kvcc::ModelFile model = kvcc::ModelFile::open(path);
      const kvcc::ModelConfig& c = model.config();
      const int T = std::min(tokens, c.max_position);
      std::vector<int32_t> ids(T);
      for (int t = 0; t < T; ++t) ids[t] = int32_t((t * 7919 + 13) % c.vocab);
      double best = 1e300, best_load = 0, best_final = 0;
      for (int r = 0; r < repeat; ++r) {
        std::vector<float> x(size_t(T) * c.hidden), logits(size_t(T) * c.vocab);
        double load = 0;
        const auto t0 = std::chrono::steady_clock::now();
        kvcc::embed(model, ids.data(), T, x.data());
        for (int l = 0; l < c.n_layers; ++l) {
          const auto tl = std::chrono::steady_clock::now();
          const kvcc::LayerWeights w = kvcc::load_layer(model, l);
          load += seconds_since(tl);
          kvcc::layer_forward(c, w, l, 0, x.data(), T);
        }
        const auto tf = std::chrono::steady_clock::now();
        kvcc::final_logits(model, x.data(), T, logits.data());
        const double final_s = seconds_since(tf), total = seconds_since(t0);
        if (total < best) best = total, best_load = load, best_final = final_s;
      }
      std::printf(
          "%s: %d tokens, %d layers, hidden %d, head_dim %d: %.3f s, %.0f tokens/s "
          "(weight load+convert %.3f s, LM head %.3f s; best of %d)\n",
          path.c_str(), T, c.n_layers, c.hidden, c.head_dim, best, T / best, best_load, best_final, repeat);
    }
  } catch (const kvcc::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
