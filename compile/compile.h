// `kvcc compile` as a library call: statistics in, a v1 artifact out. One branch per method in
// compile_artifact() (compile.cpp); a new method (e.g. commvq) adds its branch there and its codec
// in formats/kv_codec.cpp.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "formats/artifact.h"
#include "formats/stats.h"

namespace kvcc {

struct CompileOptions {
  std::string method = "oscar";  // see compile_methods()
  double key_bits = 2, value_bits = 2;
  // -1 = the method's default: group 0 (= head_dim) except kivi 32; sink/recent 64/256 except
  // kivi 0/128 (its residual window), turboquant 0/0 (the paper quantises every token), kvarn
  // 128/128 with 128-token pages (its tile); page 64 otherwise.
  int group = -1, sink = -1, recent = -1, page_size = -1;
  // oscar, oscar-lm: output | p2 | logit2. p2: on gutenberg-27m ~3 % lower KL than output on
  // average, never significantly worse (docs/validation.md "Value target").
  std::string value_target = "p2";
  std::string granularity = "head";     // head | layer
  std::string composition = "UHP";      // oscar, oscar-lm: UHP | UH | U
  uint64_t seed = 0;
  // Method parameters: turboquant variant=mse|prod, codebook=sphere|gaussian; kvarn iterations=8;
  // kivi values=hadamard|oscar (the mixed recipe: KIVI keys, values on that method's rotated
  // per-token grid with a fitted clip; oscar's value rotation uses value_target/composition).
  std::map<std::string, std::string> params;
  bool fit_clip = true;    // uniform-grid methods: fit clip ratios (false: 1.0 = no clipping)
  int max_fit_rows = 256;  // reservoir fitting tokens used per (layer, quantiser group of KV heads)
  int threads = 0;         // 0: all cores
  std::function<void(int done, int total)> progress;  // per finished layer
};

const std::vector<std::string>& compile_methods();

// The recipe an options set resolves to (method defaults filled in, parameters checked; a group
// above head_dim must span whole KV heads: formats/kv_codec.h group_span).
Recipe make_recipe(const CompileOptions& options, int head_dim, int n_kv_heads);

// Compiles every (layer, KV head). Throws Error on bad options or stats that cannot support them
// (no reservoir rows for fitting, a non-power-of-two head_dim for H-based methods, NaNs).
// The caller sets command, model_id and provenance.stats_sha256.
Artifact compile_artifact(const Stats& stats, const CompileOptions& options);

// ISO 8601 UTC "YYYY-MM-DDTHH:MM:SSZ" of now.
std::string utc_timestamp();

}  // namespace kvcc
