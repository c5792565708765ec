// kvcc compile: calibration statistics -> a versioned artifact (rotations + quantizer parameters).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cli/command.h"
#include "cli/progress.h"
#include "compile/compile.h"
#include "eval/bits_sensitivity.h"
#include "eval/experiment.h"
#include "eval/scheme.h"
#include "formats/artifact.h"
#include "formats/atomic_file.h"
#include "formats/error.h"
#include "formats/h5_common.h"
#include "formats/kv_codec.h"
#include "formats/method.h"
#include "formats/sha256.h"
#include "formats/stats.h"

namespace kvcc::cli {
namespace {

// Reads "key=value" pairs into a map (--param variant=prod).
void parse_params(const std::vector<std::string>& items, std::map<std::string, std::string>& out) {
  for (const std::string& item : items) {
    const size_t eq = item.find('=');
    KVCC_REQUIRE(eq != std::string::npos && eq > 0, "--param '" + item + "' is not KEY=VALUE");
    out[item.substr(0, eq)] = item.substr(eq + 1);
  }
}

// "64; kivi, turboquant 0; kvarn 128": a default of the method table, the most common value first.
std::string defaults_text(int MethodTraits::*field) {
  std::map<int, std::vector<std::string>> by_value;
  for (Method m : all_methods()) by_value[method_traits(m).*field].push_back(method_name(m));
  int common = by_value.begin()->first;
  for (const auto& [value, names] : by_value)
    if (names.size() > by_value[common].size()) common = value;
  std::string out = std::to_string(common);
  for (const auto& [value, names] : by_value) {
    if (value == common) continue;
    out += ";";
    for (size_t i = 0; i < names.size(); ++i) out += (i ? ", " : " ") + names[i];
    out += " " + std::to_string(value);
  }
  return out;
}

// "turboquant variant=mse|prod, codebook=sphere|gaussian; kvarn iterations=8; ...": the --param
// keys of the table (a parameter with its own flag, kivi --values, is listed there).
std::string params_text() {
  std::string out;
  for (Method m : all_methods()) {
    std::string keys;
    for (const MethodParam& p : method_traits(m).params) {
      if (p.flag) continue;
      keys += std::string(keys.empty() ? " " : ", ") + p.key;
      if (!p.choices.empty()) {
        keys += "=";
        for (size_t i = 0; i < p.choices.size(); ++i) keys += std::string(i ? "|" : "") + p.choices[i];
      } else if (p.default_value) {
        keys += std::string("=") + p.default_value;
      }
    }
    if (!keys.empty()) out += std::string(out.empty() ? "" : "; ") + method_name(m) + keys;
  }
  return out;
}

// The Methods section of --help: one line per row of the table.
std::string methods_text() {
  std::string out = "Methods:\n";
  for (Method m : all_methods()) {
    char line[256];
    std::snprintf(line, sizeof line, "  %-11s %s\n", method_name(m), method_traits(m).summary);
    out += line;
  }
  return out;
}

template <class Pred>
std::string names_where(Pred keep) {
  return method_names(keep, ", ", ", ");
}

// "commvq: 1 or 2": the methods that take only preset bit budgets.
std::string presets_text() {
  std::string out;
  for (Method m : all_methods()) {
    const std::vector<double>& p = method_traits(m).bit_presets;
    if (p.empty()) continue;
    out += std::string(out.empty() ? "" : "; ") + method_name(m) + ":";
    for (size_t i = 0; i < p.size(); ++i)
      out += (i == 0 ? " " : i + 1 == p.size() ? " or " : ", ") + std::to_string(int(p[i]));
  }
  return out;
}

// The help of a parameter with its own flag (kivi --values): "kivi only: hadamard | oscar".
std::string flag_param_text(const char* flag) {
  for (Method m : all_methods())
    for (const MethodParam& p : method_traits(m).params)
      if (p.flag && std::string(p.flag) == flag) {
        std::string out = std::string(method_name(m)) + " only:";
        for (size_t i = 0; i < p.choices.size(); ++i) out += std::string(i ? " |" : "") + " " + p.choices[i];
        return out;
      }
  return "";
}

struct Args {
  std::string stats_path, out_path, model_id;
  std::vector<std::string> params;
  std::string values;  // kivi --values
  CompileOptions options;
  bool no_fit_clip = false;
  // --bits-budget weighed by the model's KL (eval/bits_sensitivity.h): the model and its text.
  std::string sensitivity_model;
  ValidateData sensitivity_data;
};

void add_compile_options(CLI::App& sub, Args& a) {
  CompileOptions& o = a.options;
  // Unset is the method's default (-1 in CompileOptions); a given value must be in range.
  constexpr unsigned long long kIntMax = 2147483647;
  const auto accepting = [](MethodOption option) {
    std::string names;
    for (Method m : all_methods())
      if (method_traits(m).accepts(option)) names += std::string(names.empty() ? "" : ", ") + method_name(m);
    return names;
  };
  const MethodTraits& oscar = method_traits(Method::Oscar);
  sub.add_option("--method,-m", o.method, method_names(nullptr, " | ", " | "))->capture_default_str();
  sub.add_option("--key-bits", o.key_bits,
                 "bits per key element (1-8; 2.5/3.5 for " +
                     names_where([](const MethodTraits& t) { return t.fractional_bits; }) + ")")
      ->capture_default_str();
  sub.add_option("--value-bits", o.value_bits, "bits per value element")->capture_default_str();
  sub.add_option_function<double>(
      "--bits", [&o](double bits) { o.key_bits = o.value_bits = bits; },
      "bits per key and value element (" + presets_text() + ", its presets)");
  sub.add_option("--group", o.group,
                 "channels per (scale, zero) group, 0 = head_dim (default " + defaults_text(&MethodTraits::group) +
                     "); above head_dim a multiple of it dividing n_kv_heads*head_dim: one "
                     "group spans that many KV heads of a token (" +
                     names_where([](const MethodTraits& t) { return t.spans_heads; }) +
                     "); kivi: also tokens per key group")
      ->transform(whole_number(0, kIntMax));
  sub.add_option("--sink", o.sink, "BF16 tokens kept at the start (default " + defaults_text(&MethodTraits::sink) + ")")
      ->transform(whole_number(0, kIntMax));
  sub.add_option("--recent", o.recent,
                 "BF16 ring of the last tokens (default " + defaults_text(&MethodTraits::recent) +
                     "); kivi's is its residual window")
      ->transform(whole_number(0, kIntMax));
  sub.add_option("--page-size", o.page_size,
                 "tokens per quantised page (default " + defaults_text(&MethodTraits::page_size) +
                     "); kvarn's page is its tile")
      ->transform(whole_number(1, kIntMax));
  sub.add_option("--value-target", o.value_target,
                 "value importance of " + accepting(MethodOption::ValueTarget) +
                     ": output (Σ o oᵀ) | p2 (Σ_j Σ_i p_ij² v vᵀ) | logit2 (OSCAR code: weights kᵀMk "
                     "from reservoir fitting rows); default " +
                     oscar.value_target);
  sub.add_option("--granularity", o.granularity,
                 "head (per KV head) | layer (shared, OSCAR v1): " + accepting(MethodOption::Granularity))
      ->capture_default_str();
  sub.add_option("--composition", o.composition,
                 "rotation of " + accepting(MethodOption::Composition) + ": UHP | UH | U (ablations); default " +
                     oscar.composition);
  sub.add_option("--seed", o.seed, "seed of the random draws of " + accepting(MethodOption::Seed))
      ->capture_default_str()
      ->transform(whole_number(0, ~0ULL));
  sub.add_option("--param", a.params, "method parameter KEY=VALUE: " + params_text());
  sub.add_option("--values", a.values,
                 flag_param_text("--values") +
                     " = the mixed recipe: KIVI keys, values rotated by H or "
                     "oscar's value rotation on a per-token grid of head_dim with a fitted clip "
                     "(recipe param values; default: KIVI's plain per-token values)");
  sub.add_flag("--no-fit-clip", a.no_fit_clip,
               "do not fit clip ratios (use 1.0 = no clipping): " + accepting(MethodOption::NoFitClip));
  sub.add_option("--fit-rows", o.max_fit_rows,
                 "reservoir fitting tokens per KV head (per group of heads when --group spans heads) "
                 "for clip ratios and level tables: " +
                     accepting(MethodOption::FitRows))
      ->capture_default_str()
      ->transform(whole_number(1, kIntMax));
  sub.add_option("--threads", o.threads, "worker threads (default: all cores)")->transform(whole_number(0, 4096));
  sub.add_option("--bits-budget", o.bits_budget,
                 "choose key and value widths (1-4 bits) per layer under this many bits per element, "
                 "from the attention error each width gives on the held-out rows (uniform-grid methods and kivi)")
      ->check(positive_real());
  sub.add_option("--budget-context", o.budget_context,
                 "with --bits-budget: the budget is effective bits at this context (BF16 windows counted); "
                 "0: the quantised tier alone (the long-context limit)")
      ->capture_default_str()
      ->transform(whole_number(0, kIntMax));
  sub.add_option("--layer-budgets", o.layer_budgets,
                 "also store per-layer token-eviction budgets, read by kvcc eviction --layer-budgets artifact "
                 "(artifact format 1.2 / 2.1): sensitivity (EpiCache's: layers whose keys change most under "
                 "block-wise prefill keep more tokens; needs stats from calibrate-model --layer-sensitivity) or "
                 "spread (layers whose queries spread their attention over more keys keep more)")
      ->check(CLI::IsMember({"sensitivity", "spread"}));
  sub.add_option("--bits-granularity", o.bits_granularity,
                 "with --bits-budget: layer | head | auto (per KV head only when it lowers the predicted error "
                 "by 5%)")
      ->capture_default_str();
  a.sensitivity_data.max_tokens = 8192;
  sub.add_option("--sensitivity-model", a.sensitivity_model,
                 "with --bits-budget: weigh each layer's key and value errors by what they cost this model: the "
                 "KL of its next-token distribution with that side of that layer alone quantised, at each width "
                 "up to the recipe's (static mode, on --sensitivity-data or --sensitivity-ids)");
  sub.add_option("--sensitivity-data", a.sensitivity_data.data_path,
                 "with --sensitivity-model: text, documents separated by <|endoftext|>");
  sub.add_option("--sensitivity-ids", a.sensitivity_data.ids_path,
                 "with --sensitivity-model: pre-tokenized documents (one line of ids each)");
  sub.add_option("--sensitivity-tokens", a.sensitivity_data.max_tokens,
                 "with --sensitivity-model: tokens measured (documents truncated to min(max_position, 2048))")
      ->capture_default_str()
      ->transform(whole_number(1, kIntMax));
}

// --sensitivity-model: the KL each layer side costs the model, for --bits-budget to weigh its
// held-out errors by. The model and text are read now (a wrong path fails before any work); a
// measurement runs each time compile hands over an artifact at one width.
std::function<std::vector<double>(const Artifact&)> kl_weights(const Args& a) {
  auto model = std::make_shared<const ModelFile>(ModelFile::open(a.sensitivity_model));
  auto docs =
      std::make_shared<const std::vector<std::vector<int32_t>>>(load_validation_documents(*model, a.sensitivity_data));
  const std::string what = "compiled from " + a.stats_path + " (for --sensitivity-model)";
  return [model, docs, what](const Artifact& art) {
    check_artifact_matches(art, *model, what);
    const auto progress = validate_progress("sensitivity (" + std::to_string(2 * art.n_layers) + " layer sides)");
    const std::vector<double> kl = measure_side_kl(*model, *docs, art, ValidateMode::Static, 128, progress);
    std::printf("KL per layer with its keys / values alone quantised at %g bits:", art.recipe.key_bits);
    for (int l = 0; l < art.n_layers; ++l) std::printf(" %d:%.2e/%.2e", l, kl[size_t(l) * 2], kl[size_t(l) * 2 + 1]);
    std::printf("\n");
    return kl;
  };
}

int run_compile(Args& a) {
  a.options.fit_clip = !a.no_fit_clip;
  check_published_options(a.options);  // before the stats are read
  const bool tty = stderr_is_tty();
  std::cerr << "reading " << a.stats_path << "\n";
  const Stats stats = read_stats(a.stats_path);
  const auto t0 = std::chrono::steady_clock::now();
  if (!a.sensitivity_model.empty()) a.options.side_kl = kl_weights(a);
  a.options.progress = [&](int done, int total) {
    if (tty) std::fprintf(stderr, "\rcompiling %s: layer %d/%d", a.options.method.c_str(), done, total);
    else std::fprintf(stderr, "compiling %s: layer %d/%d\n", a.options.method.c_str(), done, total);
    if (tty && done == total) std::fprintf(stderr, "\n");
  };
  Artifact art = compile_artifact(stats, a.options);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  art.command = h5::process_command_line();
  art.model_id = a.model_id;
  art.provenance.stats_sha256 = sha256_file_hex(a.stats_path);
  write_artifact(art, a.out_path);

  const Recipe& r = art.recipe;
  std::printf("wrote %s: %s, %d layers x %d KV heads, head_dim %d (%.2f s)\n", a.out_path.c_str(), r.method.c_str(),
              art.n_layers, art.n_kv_heads, art.head_dim, seconds);
  std::printf("recipe: key %g bits, value %g bits, group %d, sink %d, recent %d, page %d\n", r.key_bits, r.value_bits,
              r.group > 0 ? r.group : art.head_dim, r.sink, r.recent, r.page_size);
  std::printf(
      "bits/element: nominal %.3f; quantised tier K %.3f V %.3f; effective (with BF16 "
      "sink+recent) %.3f at 2048 tokens, %.3f at 32768, %.3f at 131072; stored (whole pages) %.3f, %.3f, %.3f\n",
      nominal_bits(art), history_bits(art, KvSide::Key), history_bits(art, KvSide::Value), effective_bits(art, 2048),
      effective_bits(art, 32768), effective_bits(art, 131072), stored_bits(art, 2048), stored_bits(art, 32768),
      stored_bits(art, 131072));
  if (has_side_bits(art)) {  // --bits-budget: the widths chosen, per layer
    std::printf(
        "widths (%s, %s, budget %s bits%s): K/V bits per layer", r.params.at("bits_granularity").c_str(),
        r.params.at("bits_sensitivity") == "kl" ? "held-out errors weighed by the model's KL" : "held-out errors",
        r.params.at("bits_budget").c_str(),
        a.options.budget_context > 0 ? (" at " + std::to_string(a.options.budget_context) + " tokens").c_str()
                                     : " in the quantised tier");
    for (int l = 0; l < art.n_layers; ++l) {
      std::string k, v;
      for (int h = 0; h < art.n_kv_heads; ++h) {
        k += (h ? "," : "") + std::to_string(int(art.head(l, h).key.bits));
        v += (h ? "," : "") + std::to_string(int(art.head(l, h).value.bits));
      }
      std::printf(" %d:%s/%s", l, k.c_str(), v.c_str());
    }
    std::printf("\n");
    // The budget is the published accounting (the bits papers state and validate's `eff.` column); the
    // cache stores whole pages, a few hundredths below it.
    if (a.options.budget_context > 0)
      std::printf("budget context %lld tokens: effective %.3f bits, stored (whole pages) %.3f\n",
                  static_cast<long long>(a.options.budget_context), effective_bits(art, a.options.budget_context),
                  stored_bits(art, a.options.budget_context));
  }
  // Either side on a clipped grid (a mixed kivi recipe: keys unclipped, values fitted).
  if (method_traits(method_of(side_recipe(r, KvSide::Key))).fit == Fit::ClipRatio ||
      method_traits(method_of(side_recipe(r, KvSide::Value))).fit == Fit::ClipRatio) {
    double kmin = 1, kmax = 0, vmin = 1, vmax = 0;
    for (const HeadArtifact& h : art.heads) {
      kmin = std::min(kmin, h.key.clip_ratio);
      kmax = std::max(kmax, h.key.clip_ratio);
      vmin = std::min(vmin, h.value.clip_ratio);
      vmax = std::max(vmax, h.value.clip_ratio);
    }
    std::printf("%s clip ratios: keys %.3f..%.3f, values %.3f..%.3f\n",
                oscar_published(r) ? "fixed (OSCAR as published)" : "fitted", kmin, kmax, vmin, vmax);
  }
  return 0;
}

Command reg{"compile", 30, "Compile stats into an artifact: rotations and INT-b quantizers per (layer, KV head)",
            [](CLI::App& sub) {
              auto a = std::make_shared<Args>();
              sub.footer(
                  "Reads STATS (from `kvcc calibrate-model` / `merge-stats`) and writes ART, a v1\n"
                  "artifact with the rotation, eigenvalues and quantizer parameters of every\n"
                  "(layer, KV head), plus the recipe, seed and the stats file's sha256.\n"
                  "Clip ratios are fitted on the query-weighted logit error (keys) and the\n"
                  "attention-output error (values). An option the method ignores is refused, and so is a\n"
                  "number out of range (--page-size 0, --sink -1) or an ART that names STATS.\n\n" +
                  methods_text() +
                  "\nExample:\n"
                  "  kvcc compile stats.h5 --method oscar --key-bits 2 --value-bits 2 -o model.kvcc.h5\n"
                  "  kvcc compile stats.h5 -m turboquant --key-bits 2.5 --value-bits 2.5 -o tq.kvcc.h5\n"
                  "  # widths per layer (1-4 bits) chosen under 2.3 bits per element at 16K tokens\n"
                  "  kvcc compile stats.h5 -m oscar --bits-budget 2.3 --budget-context 16384 -o b23.kvcc.h5\n"
                  "  # the same, each layer's errors weighed by the KL they cost the model on 8192 tokens\n"
                  "  kvcc compile stats.h5 -m oscar --bits-budget 2.3 --budget-context 16384 \\\n"
                  "      --sensitivity-model DIR --sensitivity-data calib.txt -o b23kl.kvcc.h5\n"
                  "  # OSCAR as published: its fixed clips 0.96 / 0.92 and value target logit2\n"
                  "  kvcc compile stats.h5 -m oscar --param variant=published -o oscar-published.kvcc.h5\n"
                  "  kvcc compile stats.h5 --method commvq --bits 1 -o commvq1.kvcc.h5");
              sub.add_option("STATS", a->stats_path, "calibration statistics (.h5)")->required();
              sub.add_option("-o,--output", a->out_path, "artifact to write (.kvcc.h5)")->required();
              sub.add_option("--model-id", a->model_id, "a human name for the model, stored in the artifact");
              add_compile_options(sub, *a);
              return [a, &sub] {
                // An option the method ignores would hide a typo'd recipe: refused by the table's
                // rule, before the stats are read.
                require_output_is_not_input(a->out_path, {a->stats_path});
                parse_params(a->params, a->options.params);
                if (!a->values.empty()) a->options.params["values"] = a->values;
                unsigned given = 0;
                for (MethodOption o : kMethodOptions)
                  if (sub.count(option_flag(o)) > 0) given |= o;
                check_method_options(method_from_name(a->options.method), given, a->options.params);
                const bool measured = !a->sensitivity_model.empty();
                KVCC_REQUIRE(!measured || a->options.bits_budget > 0,
                             "--sensitivity-model weighs --bits-budget's "
                             "choice: give --bits-budget too");
                KVCC_REQUIRE(measured || (sub.count("--sensitivity-data") + sub.count("--sensitivity-ids") +
                                          sub.count("--sensitivity-tokens")) == 0,
                             "--sensitivity-data, --sensitivity-ids and --sensitivity-tokens need --sensitivity-model");
                KVCC_REQUIRE(!measured || a->sensitivity_data.data_path.empty() != a->sensitivity_data.ids_path.empty(),
                             "--sensitivity-model needs one of --sensitivity-data TEXT or --sensitivity-ids FILE");
                if (measured)
                  require_output_is_not_input(
                      a->out_path, {a->sensitivity_model, a->sensitivity_data.data_path, a->sensitivity_data.ids_path});
                return run_compile(*a);
              };
            }};

}  // namespace
}  // namespace kvcc::cli
