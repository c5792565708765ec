// kvcc inspect: a readable (or --json) summary of an artifact or a stats file.
#include <Eigen/Dense>
#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "cli/command.h"
#include "formats/artifact.h"
#include "formats/artifact_json.h"
#include "formats/artifact_safetensors.h"
#include "formats/error.h"
#include "formats/h5.h"
#include "formats/h5_common.h"
#include "formats/method.h"
#include "formats/stats.h"

namespace kvcc::cli {
namespace {

using nlohmann::json;

std::string fmt(const char* format, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, format, v);
  return buf;
}

// Range of a per-side quantity over a layer's KV heads.
struct Range {
  double lo = std::numeric_limits<double>::infinity();
  double hi = -std::numeric_limits<double>::infinity();
  void add(double v) {
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  }
  bool empty() const { return lo > hi; }
  json to_json() const { return empty() ? json(nullptr) : json::array({lo, hi}); }
  std::string text(const char* f) const {
    return empty() ? std::string("-") : "[" + fmt(f, lo) + ", " + fmt(f, hi) + "]";
  }
};

struct LayerSummary {
  Range key_eig, value_eig, key_clip, value_clip, key_bits, value_bits;
};

std::vector<LayerSummary> summarize_layers(const Artifact& a) {
  std::vector<LayerSummary> out(size_t(a.n_layers));
  for (int l = 0; l < a.n_layers; ++l)
    for (int h = 0; h < a.n_kv_heads; ++h) {
      const HeadArtifact& ha = a.head(l, h);
      LayerSummary& s = out[size_t(l)];
      if (!ha.key.eigenvalues.empty()) {
        s.key_eig.add(ha.key.eigenvalues.front());
        s.key_eig.add(ha.key.eigenvalues.back());
      }
      if (!ha.value.eigenvalues.empty()) {
        s.value_eig.add(ha.value.eigenvalues.front());
        s.value_eig.add(ha.value.eigenvalues.back());
      }
      s.key_clip.add(ha.key.clip_ratio);
      s.value_clip.add(ha.value.clip_ratio);
      s.key_bits.add(ha.key.bits != 0 ? ha.key.bits : a.recipe.key_bits);
      s.value_bits.add(ha.value.bits != 0 ? ha.value.bits : a.recipe.value_bits);
    }
  return out;
}

json extras_json(const SideArtifact& s) {
  json out = json::array();
  for (const NamedArray& x : s.extras)
    out.push_back({{"name", x.name}, {"shape", x.shape}, {"dtype", x.integer ? "int64" : "float64"}});
  return out;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

int inspect_artifact(const std::string& path, bool as_json) {
  const Artifact a = read_artifact(path);
  const auto layers = summarize_layers(a);
  const Recipe& r = a.recipe;
  const HeadArtifact& first = a.heads.front();
  if (as_json) {
    json j;
    j["file"] = path;
    j["format"] = kArtifactFormat;
    j["format_version"] = a.format_version;
    j["producer"] = a.producer;
    j["created"] = a.created;
    j["command"] = a.command;
    j["model_id"] = a.model_id;
    json fields = json::object();
    for (const auto& [k, v] : a.fingerprint.fields) fields[k] = v;
    j["model"] = {{"n_layers", a.n_layers},
                  {"n_heads", a.n_heads},
                  {"n_kv_heads", a.n_kv_heads},
                  {"head_dim", a.head_dim},
                  {"rope_style", rope_style_name(a.rope_style)},
                  {"fingerprint",
                   {{"id", a.fingerprint.id}, {"weights_sha256", a.fingerprint.weights_sha256}, {"fields", fields}}}};
    j["provenance"] = {{"source", a.provenance.source}, {"data_sha256", a.provenance.data_sha256},
                       {"tokens", a.provenance.tokens}, {"sequences", a.provenance.sequences},
                       {"seed", a.provenance.seed},     {"stats_sha256", a.provenance.stats_sha256}};
    j["recipe"] = recipe_json<json>(r);
    j["extras"] = {{"key", extras_json(first.key)}, {"value", extras_json(first.value)}};
    json lj = json::array();
    for (int l = 0; l < a.n_layers; ++l) {
      const LayerSummary& s = layers[size_t(l)];
      lj.push_back({{"layer", l},
                    {"key",
                     {{"eigenvalue_range", s.key_eig.to_json()},
                      {"clip_ratio_range", s.key_clip.to_json()},
                      {"bits_range", s.key_bits.to_json()}}},
                    {"value",
                     {{"eigenvalue_range", s.value_eig.to_json()},
                      {"clip_ratio_range", s.value_clip.to_json()},
                      {"bits_range", s.value_bits.to_json()}}}});
      if (!a.layer_budgets.empty()) lj.back()["eviction_budget"] = a.layer_budgets[size_t(l)];
    }
    j["layers"] = lj;
    std::cout << j.dump(2) << "\n";
    return 0;
  }
  std::printf("%s: kvcc artifact, format %s, written by %s at %s\n", path.c_str(), a.format_version.c_str(),
              a.producer.c_str(), a.created.c_str());
  std::printf("model       %s: %d layers, %d query / %d KV heads, head_dim %d, RoPE %s\n",
              a.model_id.empty() ? "(unnamed)" : a.model_id.c_str(), a.n_layers, a.n_heads, a.n_kv_heads, a.head_dim,
              rope_style_name(a.rope_style));
  std::printf("fingerprint %s (weights %s)\n", a.fingerprint.id.c_str(),
              a.fingerprint.weights_sha256.empty() ? "not recorded" : a.fingerprint.weights_sha256.c_str());
  std::printf("method      %s: key %g bits, value %g bits, group %d, sink %d, recent %d, page %d\n", r.method.c_str(),
              r.key_bits, r.value_bits, r.group, r.sink, r.recent, r.page_size);
  std::printf("            value target %s, granularity %s, composition %s, seed %" PRIu64 "\n",
              r.value_target.empty() ? "-" : r.value_target.c_str(), r.granularity.c_str(),
              r.composition.empty() ? "-" : r.composition.c_str(), r.seed);
  for (const auto& [k, v] : r.params) std::printf("            %s = %s\n", k.c_str(), v.c_str());
  if (const auto describe = method_traits(method_of(r)).describe)  // e.g. commvq's codebooks
    std::printf("            %s\n", describe(a).c_str());
  std::printf("provenance  %s, %" PRIu64 " tokens in %" PRIu64 " sequences, seed %" PRIu64 "\n",
              a.provenance.source.c_str(), a.provenance.tokens, a.provenance.sequences, a.provenance.seed);
  std::printf("            data sha256 %s\n",
              a.provenance.data_sha256.empty() ? "-" : a.provenance.data_sha256.c_str());
  std::printf("            stats sha256 %s\n",
              a.provenance.stats_sha256.empty() ? "-" : a.provenance.stats_sha256.c_str());
  std::printf("command     %s\n", a.command.empty() ? "-" : a.command.c_str());
  for (const char* side : {"key", "value"}) {
    const SideArtifact& s = std::string(side) == "key" ? first.key : first.value;
    std::printf("%-11s rotation %s, eigenvalues %s, levels %s", side, s.rotation.empty() ? "none" : "[d, d]",
                s.eigenvalues.empty() ? "none" : "[d]",
                s.levels.empty() ? "none (uniform grid)" : std::to_string(s.levels.size()).c_str());
    for (const NamedArray& x : s.extras) std::printf(", %s %s", x.name.c_str(), shape_text(x.shape).c_str());
    std::printf("\n");
  }
  const bool budgets = !a.layer_budgets.empty();  // the last column: eviction budget relative to uniform
  std::printf("\n%5s  %-24s %-24s %-16s %-16s %-8s %-8s%s\n", "layer", "key eigenvalues", "value eigenvalues",
              "key clip", "value clip", "K bits", "V bits", budgets ? " evict budget" : "");
  for (int l = 0; l < a.n_layers; ++l) {
    const LayerSummary& s = layers[size_t(l)];
    std::printf("%5d  %-24s %-24s %-16s %-16s %-8s %-8s", l, s.key_eig.text("%.3g").c_str(),
                s.value_eig.text("%.3g").c_str(), s.key_clip.text("%.3f").c_str(), s.value_clip.text("%.3f").c_str(),
                s.key_bits.text("%g").c_str(), s.value_bits.text("%g").c_str());
    if (budgets) std::printf(" %.3f", a.layer_budgets[size_t(l)]);
    std::printf("\n");
  }
  return 0;
}

// Spectrum of the mean query second moment M/count: its extremes and effective rank
// (participation ratio (Σλ)²/Σλ², d for an isotropic query distribution, 1 for a single direction).
struct Spectrum {
  double min = 0, max = 0, effective_rank = 0;
  bool valid = false;
};

Spectrum query_spectrum(const HeadStats& hs, int d) {
  Spectrum s;
  if (hs.query_count == 0) return s;
  Eigen::Map<const Eigen::MatrixXd> m(hs.query_m2.data(), d, d);
  Eigen::SelfAdjointEigenSolver<Eigen::MatrixXd> solver(m / double(hs.query_count), Eigen::EigenvaluesOnly);
  const Eigen::VectorXd ev = solver.eigenvalues();
  s.min = ev.minCoeff();
  s.max = ev.maxCoeff();
  const double sum = ev.sum(), sum_sq = ev.squaredNorm();
  s.effective_rank = sum_sq > 0 ? sum * sum / sum_sq : 0;
  s.valid = true;
  return s;
}

int inspect_stats(const std::string& path, bool as_json) {
  const Stats s = read_stats_summary(path);  // the reservoir rows can be gigabytes; not needed here
  const ModelConfig& c = s.config;
  if (as_json) {
    json j;
    j["file"] = path;
    j["format"] = kStatsFormat;
    j["format_version"] = h5::File::open(path).attr_string("format_version");
    j["producer"] = s.producer;
    j["created"] = s.created;
    j["command"] = s.command;
    json fields = json::object();
    for (const auto& [k, v] : s.fingerprint.fields) fields[k] = v;
    j["model"] = {{"architecture", c.architecture},
                  {"n_layers", c.n_layers},
                  {"n_heads", c.n_heads},
                  {"n_kv_heads", c.n_kv_heads},
                  {"head_dim", c.head_dim},
                  {"fingerprint",
                   {{"id", s.fingerprint.id}, {"weights_sha256", s.fingerprint.weights_sha256}, {"fields", fields}}}};
    j["provenance"] = {{"data_sha256", s.provenance.data_sha256}, {"tokens", s.provenance.tokens},
                       {"sequences", s.provenance.sequences},     {"seed", s.provenance.seed},
                       {"max_seq_len", s.provenance.max_seq_len}, {"tokenizer", s.provenance.tokenizer}};
    const LayerSensitivity& ls = s.sensitivity;
    j["layer_sensitivity"] =
        ls.measured()
            ? json{{"block", ls.block}, {"sink", ls.sink}, {"pairs", ls.pairs}, {"key_similarity", ls.key_similarity()}}
            : json(nullptr);
    json lj = json::array();
    for (int l = 0; l < c.n_layers; ++l) {
      json heads = json::array();
      for (int h = 0; h < c.n_kv_heads; ++h) {
        const HeadStats& hs = s.head(l, h);
        const Reservoir& r = s.reservoir(l, h);
        const Spectrum sp = query_spectrum(hs, c.head_dim);
        const size_t heldout = size_t(std::count(r.heldout.begin(), r.heldout.end(), uint8_t(1)));
        heads.push_back(
            {{"kv_head", h},
             {"query_count", hs.query_count},
             {"output_count", hs.output_count},
             {"kv_count", hs.kv_count},
             {"p2_weight", hs.p2_weight},
             {"reservoir", {{"rows", r.size()}, {"heldout", heldout}, {"capacity", r.capacity}}},
             {"query_spectrum", sp.valid ? json{{"min", sp.min}, {"max", sp.max}, {"effective_rank", sp.effective_rank}}
                                         : json(nullptr)}});
      }
      lj.push_back({{"layer", l}, {"heads", heads}});
    }
    j["layers"] = lj;
    std::cout << j.dump(2) << "\n";
    return 0;
  }
  std::printf("%s: kvcc calibration statistics, written by %s at %s\n", path.c_str(), s.producer.c_str(),
              s.created.c_str());
  std::printf("model       %s: %d layers, %d query / %d KV heads, head_dim %d, RoPE %s\n", c.architecture.c_str(),
              c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, rope_style_name(c.rope_style));
  std::printf("fingerprint %s (weights %s)\n", s.fingerprint.id.c_str(),
              s.fingerprint.weights_sha256.empty() ? "not recorded" : s.fingerprint.weights_sha256.c_str());
  std::printf("provenance  %" PRIu64 " tokens in %" PRIu64 " sequences (max length %d), tokenizer %s, seed %" PRIu64
              "\n",
              s.provenance.tokens, s.provenance.sequences, s.provenance.max_seq_len, s.provenance.tokenizer.c_str(),
              s.provenance.seed);
  std::printf("            data sha256 %s\n", s.provenance.data_sha256.c_str());
  std::printf("command     %s\n", s.command.empty() ? "-" : s.command.c_str());
  if (s.sensitivity.measured()) {
    std::printf("sensitivity key similarity under block-wise prefill (blocks of %d, sink %d, %" PRIu64
                " token-head pairs), layer 0..:",
                s.sensitivity.block, s.sensitivity.sink, s.sensitivity.pairs);
    for (double x : s.sensitivity.key_similarity()) std::printf(" %.5f", x);
    std::printf("\n");
  }
  std::printf("\n%5s %3s %12s %10s %16s  %-24s %9s\n", "layer", "kv", "queries", "kv rows", "reservoir(held)",
              "query eigenvalues", "eff.rank");
  for (int l = 0; l < c.n_layers; ++l)
    for (int h = 0; h < c.n_kv_heads; ++h) {
      const HeadStats& hs = s.head(l, h);
      const Reservoir& r = s.reservoir(l, h);
      const Spectrum sp = query_spectrum(hs, c.head_dim);
      const long heldout = long(std::count(r.heldout.begin(), r.heldout.end(), uint8_t(1)));
      const std::string res = std::to_string(r.size()) + "(" + std::to_string(heldout) + ")";
      const std::string eig = sp.valid ? "[" + fmt("%.3g", sp.min) + ", " + fmt("%.3g", sp.max) + "]" : "-";
      std::printf("%5d %3d %12" PRIu64 " %10" PRIu64 " %16s  %-24s %9s\n", l, h, hs.query_count, hs.kv_count,
                  res.c_str(), eig.c_str(), sp.valid ? fmt("%.1f", sp.effective_rank).c_str() : "-");
    }
  return 0;
}

Command reg{
    "inspect", 60, "Print a summary of an artifact or a stats file (--json for machines)",
    [](CLI::App& app) -> std::function<int()> {
      auto path = std::make_shared<std::string>();
      auto as_json = std::make_shared<bool>(false);
      app.add_option("FILE", *path, "An artifact (*.kvcc.h5) or a calibration stats file (stats.h5)")->required();
      app.add_flag("--json", *as_json, "Print one JSON object instead of text");
      app.footer(
          "Reads FILE (validating it as every reader does) and prints the model and its fingerprint,\n"
          "the provenance and the command that made it; for an artifact the method and recipe (bits,\n"
          "group, sink, recent, page) and per-layer eigenvalue and clip-ratio ranges (and eviction\n"
          "budgets when compiled with --layer-budgets); for stats the token counts, reservoir sizes\n"
          "and the query spectrum per layer and KV head.\n\n"
          "Examples:\n"
          "  kvcc inspect gutenberg-27m.oscar.kvcc.h5\n"
          "  kvcc inspect stats.h5 --json | jq .provenance");
      return [path, as_json]() {
        const std::string format = detect_kvcc_format(*path);
        if (format == kArtifactFormat) return inspect_artifact(*path, *as_json);
        if (format == kStatsFormat) return inspect_stats(*path, *as_json);
        throw Error(*path + ": unknown format \"" + format + "\" (expected " + kArtifactFormat + " or " + kStatsFormat +
                    ")");
      };
    }};

}  // namespace
}  // namespace kvcc::cli
