// `kvcc compile` as a library call: statistics in, a v1 artifact out. What a method is (codec,
// rotation, fit, defaults, accepted options) is its row of formats/method.h's table; a new method
// adds that row, its codec in formats/kv_codec.cpp and, where the table's rules do not cover it,
// its branch in compile_layer() (compile.cpp).
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "formats/artifact.h"
#include "formats/method.h"
#include "formats/stats.h"

namespace kvcc {

struct CompileOptions {
  std::string method = method_name(Method::Oscar);  // a name of the method table (make_recipe converts)
  double key_bits = 2, value_bits = 2;
  // -1 = the method's default (formats/method.h: group 0 = head_dim except kivi's 32 key tokens;
  // windows 64/256 except kivi 0/128, turboquant 0/0, kvarn 128/128 with 128-token pages).
  int group = -1, sink = -1, recent = -1, page_size = -1;
  // Attention-aware rotations (oscar, oscar-lm, kivi --values oscar): output | p2 | logit2 and
  // UHP | UH | U; empty = the method's default (the table's: p2, UHP).
  std::string value_target;
  std::string granularity = "head";  // head | layer
  std::string composition;
  uint64_t seed = 0;
  // Method parameters, the ones the method's table row lists (others are refused; defaults filled
  // in): turboquant variant=mse|prod, codebook=sphere|gaussian; kvarn iterations; kivi
  // values=hadamard|oscar (the mixed recipe: KIVI keys, values on that method's rotated per-token
  // grid with a fitted clip; oscar's value rotation uses value_target/composition); commvq stages,
  // code bits, iterations, max_rows.
  std::map<std::string, std::string> params;
  bool fit_clip = true;    // uniform-grid methods: fit clip ratios (false: 1.0 = no clipping)
  int max_fit_rows = 256;  // reservoir fitting tokens used per (layer, quantiser group of KV heads)
  int threads = 0;         // 0: all cores
  // --bits-budget (compile/allocate.h): > 0 chooses key and value widths (1-4 bits) per layer or
  // per KV head under this many bits per element, as effective bits at budget_context tokens (0:
  // the quantised tier alone), measured on up to budget_rows held-out tokens per layer;
  // bits_granularity layer | head | auto (per head only where it pays).
  double bits_budget = 0;
  int64_t budget_context = 0;
  std::string bits_granularity = "auto";
  int budget_rows = 256;
  // --bits-budget weighed by the model's loss (compile --sensitivity-model): given an artifact with
  // both sides at one width, per (layer, side), index layer·2 + side (0 keys, 1 values), the KL of
  // the next-token distribution with that side of that layer alone quantised
  // (eval/bits_sensitivity.h). Called for each candidate width up to the recipe's, once the budget
  // is known feasible (compile/allocate.h). Unset: the held-out errors alone.
  std::function<std::vector<double>(const Artifact& at_one_width)> side_kl;
  // Also store per-layer token-eviction budgets (Artifact::layer_budgets, compile/layer_budgets.h;
  // format 1.2 / 2.1): "sensitivity" (the stats' layer sensitivity, EpiCache's allocation) or
  // "spread" (the stats' attention spread); empty: none.
  std::string layer_budgets;
  std::function<void(int done, int total)> progress;  // per finished layer
};

// oscar --param variant=published fixes the value target (logit2) and the clip ratios (0.96 / 0.92):
// throws Error for a --value-target or --no-fit-clip that would change them. Needs no stats, so
// the CLI calls it before reading them; make_recipe calls it too.
void check_published_options(const CompileOptions& options);

// The recipe an options set resolves to (the method's defaults from its table row filled in,
// parameters checked against it; a group above head_dim must span whole KV heads:
// formats/kv_codec.h group_span).
Recipe make_recipe(const CompileOptions& options, int head_dim, int n_kv_heads);

// Compiles every (layer, KV head). Throws Error on bad options or stats that cannot support them
// (no reservoir rows for fitting, a non-power-of-two head_dim for H-based methods, NaNs).
// The caller sets command, model_id and provenance.stats_sha256.
Artifact compile_artifact(const Stats& stats, const CompileOptions& options);

}  // namespace kvcc
