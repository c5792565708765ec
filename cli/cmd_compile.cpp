// kvcc compile: calibration statistics -> a versioned artifact (rotations + quantizer parameters).
#include <chrono>
#include <cstdio>
#include <iostream>
#include <string>

#include "cli/command.h"
#include "compile/compile.h"
#include "formats/artifact.h"
#include "formats/error.h"
#include "formats/h5_common.h"
#include "formats/kv_codec.h"
#include "formats/sha256.h"
#include "formats/stats.h"

namespace kvcc::cli {
namespace {

// Reads "key=value" pairs into a map (--param variant=prod).
void parse_params(const std::vector<std::string>& items, std::map<std::string, std::string>& out) {
  for (const std::string& item : items) {
    const size_t eq = item.find('=');
    require(eq != std::string::npos && eq > 0, "--param '" + item + "' is not KEY=VALUE");
    out[item.substr(0, eq)] = item.substr(eq + 1);
  }
}

struct Args {
  std::string stats_path, out_path, model_id;
  std::vector<std::string> params;
  std::string values;  // kivi --values
  CompileOptions options;
  bool no_fit_clip = false;
};

void add_compile_options(CLI::App& sub, Args& a) {
  CompileOptions& o = a.options;
  sub.add_option("--method,-m", o.method,
                 "oscar | oscar-lm | hadamard | identity | random | turboquant | kivi | kvarn | commvq")
      ->capture_default_str();
  sub.add_option("--key-bits", o.key_bits, "bits per key element (1-8; 2.5/3.5 for turboquant)")
      ->capture_default_str();
  sub.add_option("--value-bits", o.value_bits, "bits per value element")->capture_default_str();
  sub.add_option_function<double>(
      "--bits", [&o](double bits) { o.key_bits = o.value_bits = bits; },
      "bits per key and value element (commvq: 1 or 2, its presets)");
  sub.add_option("--group", o.group,
                 "channels per (scale, zero) group (default: head_dim; kivi 32); above head_dim a "
                 "multiple of it dividing n_kv_heads*head_dim: one group spans that many KV heads of "
                 "a token (oscar, oscar-lm, hadamard, identity, random); kivi: also tokens per key group");
  sub.add_option("--sink", o.sink, "BF16 tokens kept at the start (default 64; kivi/turboquant 0; kvarn 128)");
  sub.add_option("--recent", o.recent,
                 "BF16 ring of the last tokens (default 256; kivi 128 = its residual window; "
                 "turboquant 0; kvarn 128)");
  sub.add_option("--page-size", o.page_size, "tokens per quantised page (default 64; kvarn 128 = its tile)");
  sub.add_option("--value-target", o.value_target,
                 "oscar value importance: output (Σ o oᵀ) | p2 (Σ_j Σ_i p_ij² v vᵀ) | logit2 "
                 "(OSCAR code: weights kᵀMk from reservoir fitting rows)")
      ->capture_default_str();
  sub.add_option("--granularity", o.granularity, "head (per KV head) | layer (shared, OSCAR v1)")
      ->capture_default_str();
  sub.add_option("--composition", o.composition, "oscar rotation: UHP | UH | U (ablations)")
      ->capture_default_str();
  sub.add_option("--seed", o.seed, "seed of random rotations (random, turboquant)")->capture_default_str();
  sub.add_option("--param", a.params,
                 "method parameter KEY=VALUE: turboquant variant=mse|prod, codebook=sphere|gaussian; "
                 "kvarn iterations=8");
  sub.add_option("--values", a.values,
                 "kivi only: hadamard | oscar = the mixed recipe: KIVI keys, values rotated by H or "
                 "oscar's value rotation on a per-token grid of head_dim with a fitted clip "
                 "(recipe param values; default: KIVI's plain per-token values)");
  sub.add_flag("--no-fit-clip", a.no_fit_clip, "do not fit clip ratios (use 1.0 = no clipping)");
  sub.add_option("--fit-rows", o.max_fit_rows,
                 "reservoir fitting tokens per KV head (per group of heads when --group spans heads) "
                 "for clip ratios")
      ->capture_default_str();
  sub.add_option("--threads", o.threads, "worker threads (default: all cores)");
}

int run_compile(Args& a) {
  parse_params(a.params, a.options.params);
  if (!a.values.empty()) a.options.params["values"] = a.values;  // checked by make_recipe
  a.options.fit_clip = !a.no_fit_clip;
  const bool tty = stderr_is_tty();
  std::cerr << "reading " << a.stats_path << "\n";
  const Stats stats = read_stats(a.stats_path);
  const auto t0 = std::chrono::steady_clock::now();
  a.options.progress = [&](int done, int total) {
    if (tty)
      std::fprintf(stderr, "\rcompiling %s: layer %d/%d", a.options.method.c_str(), done, total);
    else
      std::fprintf(stderr, "compiling %s: layer %d/%d\n", a.options.method.c_str(), done, total);
    if (tty && done == total) std::fprintf(stderr, "\n");
  };
  Artifact art = compile_artifact(stats, a.options);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  art.command = h5::process_command_line();
  art.model_id = a.model_id;
  art.provenance.stats_sha256 = sha256_file_hex(a.stats_path);
  write_artifact(art, a.out_path);

  const Recipe& r = art.recipe;
  std::printf("wrote %s: %s, %d layers x %d KV heads, head_dim %d (%.2f s)\n", a.out_path.c_str(),
              r.method.c_str(), art.n_layers, art.n_kv_heads, art.head_dim, seconds);
  std::printf("recipe: key %g bits, value %g bits, group %d, sink %d, recent %d, page %d\n", r.key_bits,
              r.value_bits, r.group > 0 ? r.group : art.head_dim, r.sink, r.recent, r.page_size);
  std::printf("bits/element: nominal %.3f; quantised tier K %.3f V %.3f; effective (with BF16 "
              "sink+recent) %.3f at 2048 tokens, %.3f at 32768, %.3f at 131072\n",
              nominal_bits(r), history_bits(r, KvSide::Key, art.head_dim),
              history_bits(r, KvSide::Value, art.head_dim), effective_bits(r, art.head_dim, 2048),
              effective_bits(r, art.head_dim, 32768), effective_bits(r, art.head_dim, 131072));
  if (is_uniform_method(r.method) || r.params.count("values")) {  // mixed kivi: keys unclipped, values fitted
    double kmin = 1, kmax = 0, vmin = 1, vmax = 0;
    for (const HeadArtifact& h : art.heads) {
      kmin = std::min(kmin, h.key.clip_ratio);
      kmax = std::max(kmax, h.key.clip_ratio);
      vmin = std::min(vmin, h.value.clip_ratio);
      vmax = std::max(vmax, h.value.clip_ratio);
    }
    std::printf("fitted clip ratios: keys %.3f..%.3f, values %.3f..%.3f\n", kmin, kmax, vmin, vmax);
  }
  return 0;
}

Command reg{"compile", 30,
            "Compile stats into an artifact: rotations and INT-b quantizers per (layer, KV head)",
            [](CLI::App& sub) {
              auto a = std::make_shared<Args>();
              sub.footer(
                  "Reads STATS (from `kvcc calibrate-model` / `merge-stats`) and writes ART, a v1\n"
                  "artifact with the rotation, eigenvalues and quantizer parameters of every\n"
                  "(layer, KV head), plus the recipe, seed and the stats file's sha256.\n\n"
                  "Methods:\n"
                  "  oscar       R = U·H·P from the query second moment (keys) and the value target;\n"
                  "              per-token INT-b grid with fitted clip ratios (query-weighted logit\n"
                  "              error for keys, attention-output error for values)\n"
                  "  oscar-lm    oscar's rotation + a Lloyd-Max level table fitted per KV head\n"
                  "  hadamard    H (QuaRot);  identity: no rotation;  random: seeded Haar rotation\n"
                  "  turboquant  random rotation + Lloyd-Max levels of the sphere density; 2.5/3.5\n"
                  "              bits split channels (outliers at b+1); --param variant=prod adds QJL\n"
                  "  kivi        per-channel keys over token groups, per-token values, residual window;\n"
                  "              --values hadamard|oscar: values on that method's rotated clipped grid\n"
                  "  kvarn       Hadamard + Sinkhorn log-std balancing of 128-token tiles + row RTN\n\n"
                  "Example:\n"
                  "  kvcc compile stats.h5 --method oscar --key-bits 2 --value-bits 2 -o model.kvcc.h5\n"
                  "  kvcc compile stats.h5 -m turboquant --key-bits 2.5 --value-bits 2.5 -o tq.kvcc.h5\n"
                  "  kvcc compile stats.h5 --method commvq --bits 1 -o commvq1.kvcc.h5");
              sub.add_option("STATS", a->stats_path, "calibration statistics (.h5)")->required();
              sub.add_option("-o,--output", a->out_path, "artifact to write (.kvcc.h5)")->required();
              sub.add_option("--model-id", a->model_id, "a human name for the model, stored in the artifact");
              add_compile_options(sub, *a);
              return [a, &sub] {
                // These shape only oscar's rotation; accepting them elsewhere would hide a typo'd recipe.
                const std::string& m = a->options.method;
                const bool oscar_values = m == "kivi" && a->values == "oscar";
                for (const char* flag : {"--value-target", "--composition"})
                  require(sub.count(flag) == 0 || m == "oscar" || m == "oscar-lm" || oscar_values,
                          std::string(flag) + " applies to oscar and oscar-lm only, not " + m +
                              " (and to kivi --values oscar: its value rotation)");
                return run_compile(*a);
              };
            }};

}  // namespace
}  // namespace kvcc::cli
