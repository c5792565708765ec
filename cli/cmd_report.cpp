// kvcc report: compile every method in memory and compare them on held-out reservoir rows.
#include <filesystem>
#include <iostream>
#include <sstream>
#include <string>

#include "cli/command.h"
#include "compile/report.h"
#include "formats/atomic_file.h"
#include "formats/error.h"
#include "formats/method.h"
#include "formats/stats.h"

namespace kvcc::cli {
namespace {

// Every method of the table, at each of its bit presets where it has them (commvq:1,commvq:2).
std::string all_report_methods() {
  std::string out;
  for (Method m : all_methods()) {
    const MethodTraits& t = method_traits(m);
    if (t.bit_presets.empty()) out += std::string(out.empty() ? "" : ",") + t.name;
    for (double b : t.bit_presets) out += std::string(out.empty() ? "" : ",") + t.name + ":" + std::to_string(int(b));
  }
  return out;
}

struct ReportArgs {
  std::string stats_path, json_path, svg_path, markdown_path;
  std::string methods = all_report_methods();
  double key_bits = 2, value_bits = 2;
  std::string value_target;  // empty: each method's default (compile's)
  std::string granularity = "head";
  int group = -1;
  int rows = 512;
  int fit_rows = 256;
  uint64_t seed = 0;
};

// "oscar,kivi,oscar:UH,oscar:logit2,oscar:layer,turboquant:prod,hadamard:noclip,oscar:g64,commvq:1"
// -> option sets (gN: group N, e.g. a group spanning KV heads; a number: bits per element). The
// shared flags apply to the methods that take them; a modifier a method would ignore is refused
// (formats/method.h check_method_options).
std::vector<CompileOptions> parse_methods(const ReportArgs& a) {
  std::vector<CompileOptions> out;
  std::stringstream list(a.methods);
  std::string item;
  while (std::getline(list, item, ',')) {
    if (item.empty()) continue;
    CompileOptions o;
    std::stringstream parts(item);
    std::getline(parts, o.method, ':');
    const Method method = method_from_name(o.method);
    const MethodTraits& t = method_traits(method);
    o.key_bits = a.key_bits;
    o.value_bits = a.value_bits;
    o.group = a.group;
    if (t.accepts(MethodOption::ValueTarget)) o.value_target = a.value_target;
    if (t.accepts(MethodOption::Granularity)) o.granularity = a.granularity;
    if (t.accepts(MethodOption::Seed)) o.seed = a.seed;
    if (t.accepts(MethodOption::FitRows)) o.max_fit_rows = a.fit_rows;
    unsigned given = 0;
    std::string mod;
    while (std::getline(parts, mod, ':')) {
      if (mod == "UH" || mod == "U" || mod == "UHP") o.composition = mod, given |= MethodOption::Composition;
      else if (mod == "output" || mod == "p2" || mod == "logit2")
        o.value_target = mod, given |= MethodOption::ValueTarget;
      else if (mod == "layer" || mod == "head") o.granularity = mod, given |= MethodOption::Granularity;
      else if (mod == "prod" || mod == "mse") o.params["variant"] = mod;
      else if (mod == "published") o.params["variant"] = mod, o.value_target.clear();  // OSCAR's own target
      else if (mod == "noclip") o.fit_clip = false, given |= MethodOption::NoFitClip;
      else if (!mod.empty() && mod.find_first_not_of("0123456789.") == std::string::npos)
        o.key_bits = o.value_bits = std::stod(mod);
      else if (mod.size() > 1 && mod[0] == 'g' && mod.find_first_not_of("0123456789", 1) == std::string::npos)
        o.group = std::stoi(mod.substr(1));
      else throw Error("--methods: unknown modifier '" + mod + "' in '" + item + "'");
    }
    try {
      check_method_options(method, given, o.params);
    } catch (const Error& e) {
      throw Error("--methods '" + item + "': " + e.what());
    }
    out.push_back(o);
  }
  KVCC_REQUIRE(!out.empty(), "--methods lists no method");
  return out;
}

int run_report(const ReportArgs& a) {
  for (const std::string* out : {&a.markdown_path, &a.json_path, &a.svg_path})
    require_output_is_not_input(*out, {a.stats_path});
  const Stats stats = read_stats(a.stats_path);
  AttentionReport rep = attention_report(stats, parse_methods(a), a.rows, true);
  rep.model = std::filesystem::path(a.stats_path).filename().string();
  const std::string table = report_table(rep);
  std::cout << table;
  if (!a.markdown_path.empty()) write_bytes_atomically(a.markdown_path, table);
  if (!a.json_path.empty()) write_bytes_atomically(a.json_path, report_json(rep));
  if (!a.svg_path.empty()) write_bytes_atomically(a.svg_path, report_svg(rep));
  return 0;
}

Command reg{
    "report", 35, "Compare compile methods on held-out reservoir rows (logit, output, K/V errors)", [](CLI::App& sub) {
      auto a = std::make_shared<ReportArgs>();
      sub.footer(
          "Compiles each method in memory from STATS and evaluates it on the reservoir's\n"
          "held-out rows (documents never used for fitting), per layer and KV head:\n"
          "  logit   ||Q(K-K^)^T|| / ||QK^T||   (real queries weight the key error)\n"
          "  output  ||PV - P^V^|| / ||PV||,  P = softmax(QK^T/sqrt(d)) over held-out keys\n"
          "  key, value: ||X - X^|| / ||X||\n"
          "Method modifiers: oscar:UH, oscar:U, oscar:logit2, oscar:p2, oscar:layer,\n"
          "oscar:published (OSCAR as published: clips 0.96 / 0.92, value target logit2),\n"
          "turboquant:prod, hadamard:noclip, a number of bits (commvq:1 and commvq:2, its\n"
          "presets), gN (group N; above head_dim it spans KV heads, e.g. oscar:g64 on\n"
          "head_dim 16); a modifier the method ignores is refused.\n"
          "Methods: " +
          method_names(nullptr, ", ", ", ") +
          ".\n\n"
          "Example:\n"
          "  kvcc report stats.h5 --json report.json --svg report.svg\n"
          "  kvcc report stats.h5 --methods oscar,oscar:UH,oscar:U,hadamard --key-bits 2\n"
          "  kvcc report stats.h5 --methods oscar,oscar:g64,hadamard,hadamard:g64");
      sub.add_option("STATS", a->stats_path, "calibration statistics (.h5)")->required();
      sub.add_option("--methods", a->methods, "comma-separated methods (with :modifiers)")->capture_default_str();
      sub.add_option("--key-bits", a->key_bits, "bits per key element")->check(positive_real())->capture_default_str();
      sub.add_option("--value-bits", a->value_bits, "bits per value element")
          ->check(positive_real())
          ->capture_default_str();
      sub.add_option("--group", a->group,
                     "channels per scale/zero group for every method (default: each method's; "
                     "per method: the gN modifier)")
          ->transform(whole_number(1, 2147483647));
      sub.add_option("--value-target", a->value_target,
                     std::string("value target of the methods that take one: output | p2 | logit2 "
                                 "(default: ") +
                         method_traits(Method::Oscar).value_target + ")");
      sub.add_option("--granularity", a->granularity, "head | layer (of the methods that take it)")
          ->capture_default_str();
      sub.add_option("--rows", a->rows, "held-out tokens evaluated per KV head")
          ->transform(whole_number(1, 2147483647))
          ->capture_default_str();
      sub.add_option("--fit-rows", a->fit_rows, "fitting tokens per KV head (clip ratios)")
          ->transform(whole_number(1, 2147483647))
          ->capture_default_str();
      sub.add_option("--seed", a->seed, "seed of the methods that draw at random")
          ->transform(whole_number(0, ~0ULL))
          ->capture_default_str();
      sub.add_option("--json", a->json_path, "write the full report (per head) as JSON");
      sub.add_option("--svg", a->svg_path, "write a per-layer bar chart (SVG)");
      sub.add_option("--markdown", a->markdown_path, "write the table (markdown)");
      return [a] { return run_report(*a); };
    }};

}  // namespace
}  // namespace kvcc::cli
