#include "zoo/zoo.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <sstream>

#include "formats/atomic_file.h"
#include "formats/error.h"
#include "formats/kv_codec.h"
#include "formats/method.h"
#include "formats/sha256.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace kvcc::zoo {
namespace {

std::string utc_now() {
  const std::time_t t = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

// Folder and tag names must be portable path components.
bool safe_component(const std::string& s) {
  if (s.empty() || s.size() > 100 || s[0] == '.' || s[0] == '-') return false;
  return std::all_of(s.begin(), s.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' ||
           c == '-';
  });
}

std::string number_text(double v) {
  std::ostringstream s;
  s << v;
  return s.str();
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  KVCC_REQUIRE(bool(in), "cannot read " + path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

json fingerprint_to_json(const ModelFingerprint& fp) {
  json fields = json::array();
  for (const auto& [k, v] : fp.fields) fields.push_back({k, v});
  return {{"id", fp.id}, {"weights_sha256", fp.weights_sha256}, {"fields", fields}};
}

ModelFingerprint fingerprint_from_json(const json& j) {
  ModelFingerprint fp;
  fp.id = j.at("id").get<std::string>();
  fp.weights_sha256 = j.at("weights_sha256").get<std::string>();
  for (const auto& f : j.at("fields")) fp.fields.emplace_back(f.at(0).get<std::string>(), f.at(1).get<std::string>());
  return fp;
}

bool is_shapes_only(const ModelFingerprint& fp) {
  for (const auto& [k, v] : fp.fields)
    if (k == "fingerprint_source" && v == "shapes") return true;
  return false;
}

json recipe_summary(const Artifact& a) {
  const Recipe& r = a.recipe;
  json j = {{"method", r.method},
            {"key_bits", r.key_bits},
            {"value_bits", r.value_bits},
            {"group", r.group == 0 ? a.head_dim : r.group},
            {"sink", r.sink},
            {"recent", r.recent},
            {"page_size", r.page_size},
            {"value_target", r.value_target},
            {"granularity", r.granularity},
            {"composition", r.composition},
            {"seed", r.seed}};
  json params = json::object();
  for (const auto& [k, v] : r.params) params[k] = v;
  j["params"] = params;
  // Clip ratios are fitted per (layer, head); the summary keeps their range.
  double kmin = INFINITY, kmax = -INFINITY, vmin = INFINITY, vmax = -INFINITY;
  for (const auto& h : a.heads) {
    kmin = std::min(kmin, h.key.clip_ratio);
    kmax = std::max(kmax, h.key.clip_ratio);
    vmin = std::min(vmin, h.value.clip_ratio);
    vmax = std::max(vmax, h.value.clip_ratio);
  }
  if (!a.heads.empty()) j["clip_ratio"] = {{"key", {kmin, kmax}}, {"value", {vmin, vmax}}};
  return j;
}

json bits_summary(const Artifact& a) {
  json eff = json::object();
  for (int64_t ctx : {4096, 32768, 131072}) eff[std::to_string(ctx)] = effective_bits(a, ctx);
  return {{"nominal", nominal_bits(a)},
          {"history_key", history_bits(a, KvSide::Key)},
          {"history_value", history_bits(a, KvSide::Value)},
          {"effective", eff}};
}

std::string format_bits(double b) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3f", b);
  return buf;
}

void write_text_file(const std::string& path, const std::string& text) { write_bytes_atomically(path, text); }

// Copies src to dst through a temporary name and checks the copy's hash.
void copy_verified(const std::string& src, const std::string& dst, const std::string& sha256) {
  write_file_atomically(dst, [&](const std::string& tmp) {
    fs::copy_file(src, tmp, fs::copy_options::overwrite_existing);
    KVCC_REQUIRE(sha256_file_hex(tmp) == sha256,
                 "copy of " + src + " into the zoo differs from the original (disk error?)");
  });
}

std::string join(const std::vector<std::string>& items, const std::string& sep) {
  std::string out;
  for (const auto& s : items) out += (out.empty() ? "" : sep) + s;
  return out;
}

size_t difference_count(const std::string& description) {
  if (description.empty()) return 0;
  return size_t(std::count(description.begin(), description.end(), ';')) + 1;
}

}  // namespace

const ZooFile* ZooEntry::file(const std::string& role) const {
  for (const auto& f : files)
    if (f.role == role) return &f;
  return nullptr;
}

const ZooEntry* Index::find(const std::string& id) const {
  for (const auto& e : entries)
    if (e.id == id) return &e;
  return nullptr;
}

json entry_to_json(const ZooEntry& e) {
  json files = json::array();
  for (const auto& f : e.files)
    files.push_back({{"role", f.role}, {"path", f.path}, {"sha256", f.sha256}, {"size", f.size}});
  json j = {{"id", e.id},
            {"model_id", e.model_id},
            {"recipe_tag", e.recipe_tag},
            {"fingerprint", fingerprint_to_json(e.fingerprint)},
            {"fingerprint_source", e.fingerprint_source},
            {"artifact_format_version", e.artifact_format_version},
            {"published", e.published},
            {"notes", e.notes},
            {"recipe", e.recipe},
            {"shape", e.shape},
            {"provenance", e.provenance},
            {"bits", e.bits},
            {"validation", e.validation},
            {"files", files}};
  // Only when set, so indexes of entries without them stay as they were.
  if (!e.base_model.empty()) j["base_model"] = e.base_model;
  if (!e.license.empty()) j["license"] = e.license;
  return j;
}

ZooEntry entry_from_json(const json& j) {
  ZooEntry e;
  try {
    e.id = j.at("id").get<std::string>();
    e.model_id = j.at("model_id").get<std::string>();
    e.recipe_tag = j.at("recipe_tag").get<std::string>();
    e.fingerprint = fingerprint_from_json(j.at("fingerprint"));
    e.fingerprint_source = j.value("fingerprint_source", "model");
    e.artifact_format_version = j.at("artifact_format_version").get<std::string>();
    e.published = j.value("published", "");
    e.notes = j.value("notes", "");
    e.base_model = j.value("base_model", "");
    e.license = j.value("license", "");
    e.recipe = j.value("recipe", json::object());
    e.shape = j.value("shape", json::object());
    e.provenance = j.value("provenance", json::object());
    e.bits = j.value("bits", json::object());
    e.validation = j.contains("validation") ? j.at("validation") : json();
    for (const auto& f : j.at("files")) {
      ZooFile zf{f.at("role").get<std::string>(), f.at("path").get<std::string>(), f.at("sha256").get<std::string>(),
                 f.at("size").get<uint64_t>()};
      e.files.push_back(std::move(zf));
    }
  } catch (const json::exception& ex) {
    throw Error(std::string("zoo index entry ") + (e.id.empty() ? "" : "'" + e.id + "' ") +
                "is malformed: " + ex.what());
  }
  KVCC_REQUIRE(e.id == e.model_id + "/" + e.recipe_tag,
               "zoo index entry '" + e.id + "': id is not model_id/recipe_tag");
  KVCC_REQUIRE(e.file("artifact") != nullptr, "zoo index entry '" + e.id + "' lists no artifact file");
  for (const auto& f : e.files) {
    // Paths stay inside the zoo: no absolute paths, no "..".
    const fs::path p(f.path);
    bool inside = !f.path.empty() && p.is_relative();
    for (const auto& part : p) inside = inside && part != ".." && part != ".";
    KVCC_REQUIRE(inside, "zoo index entry '" + e.id + "': file path '" + f.path + "' leaves the zoo directory");
  }
  return e;
}

Index read_index(const std::string& zoo_dir, bool allow_missing) {
  const fs::path path = fs::path(zoo_dir) / kIndexName;
  Index index;
  if (!fs::exists(path)) {
    KVCC_REQUIRE(allow_missing, "no zoo at " + zoo_dir + " (" + path.string() + " does not exist)");
    return index;
  }
  json j;
  try {
    j = json::parse(read_text(path.string()));
  } catch (const json::exception& ex) {  // parse_error, and out_of_range for a number too large
    throw Error(path.string() + " is not valid JSON (" + std::string(ex.what()) + ")");
  }
  // Types checked before reading: json::value throws type_error on a mistyped field.
  KVCC_REQUIRE(j.is_object() && j.contains("format") && j["format"].is_string() && j["format"] == kIndexFormat,
               path.string() + " is not a kvcc zoo index (format is not \"" + kIndexFormat + "\")");
  const json version = j.value("format_version", json(0));
  KVCC_REQUIRE(version.is_number_integer() && version == kIndexVersion,
               path.string() + ": zoo index format_version " + version.dump() + " is not supported (this kvcc reads " +
                   std::to_string(kIndexVersion) + ")");
  KVCC_REQUIRE(j.contains("entries") && j["entries"].is_array(), path.string() + ": 'entries' is missing");
  std::set<std::string> ids;
  for (const auto& ej : j["entries"]) {
    ZooEntry e = entry_from_json(ej);
    KVCC_REQUIRE(ids.insert(e.id).second, path.string() + ": entry '" + e.id + "' appears twice");
    index.entries.push_back(std::move(e));
  }
  return index;
}

std::string recipe_tag(const Artifact& a) {
  const Recipe& r = a.recipe;
  std::string bits = r.key_bits == r.value_bits && r.key_bits == std::floor(r.key_bits)
                         ? "int" + number_text(r.key_bits)
                         : "k" + number_text(r.key_bits) + "v" + number_text(r.value_bits);
  std::string tag = r.method + "-" + bits + "-g" + std::to_string(r.group == 0 ? a.head_dim : r.group);
  if (!r.value_target.empty()) tag += "-" + r.value_target;
  if (r.granularity == "layer") tag += "-perlayer";
  const MethodTraits& t = method_traits(method_of(r));
  if (t.rotation == RotationRule::AttentionAware && !r.composition.empty() && r.composition != t.composition)
    tag += "-" + r.composition;
  if (auto it = r.params.find("variant"); it != r.params.end() && !it->second.empty()) tag += "-" + it->second;
  // kivi's mixed recipe (rotated values) is another cache than plain kivi at the same group.
  if (auto it = r.params.find("values"); it != r.params.end() && !it->second.empty()) tag += "-v" + it->second;
  // kivi's key pairs in 2 bytes are other pages than fp16's (the default, untagged).
  if (auto it = r.params.find("key_params"); it != r.params.end() && it->second == "e5m3") tag += "-k" + it->second;
  // --bits-budget: widths per layer or head under a budget, not one width.
  if (auto it = r.params.find("bits_budget"); it != r.params.end()) tag += "-b" + it->second;
  for (char& c : tag)
    if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '-')) c = '_';
  return tag;
}

std::string render_card(const ZooEntry& e, const Artifact& a) {
  std::ostringstream s;
  const Recipe& r = a.recipe;
  s << "# " << e.model_id << " · " << e.recipe_tag << "\n\n";
  s << "kvcc zoo entry `" << e.id << "`, published " << e.published << ".\n\n";
  s << "## Model\n\n";
  s << "- model id: " << e.model_id << "\n";
  s << "- fingerprint: `" << e.fingerprint.id << "`"
    << (e.fingerprint_source == "shapes"
            ? " (built from the imported rotations' shapes only: it matches no real model; re-import with --model)"
            : " (architecture fields + sha256 of the weight files' tensor headers)")
    << "\n";
  s << "- shape: " << a.n_layers << " layers, " << a.n_heads << " query / " << a.n_kv_heads << " KV heads, head_dim "
    << a.head_dim << ", RoPE " << rope_style_name(a.rope_style) << "\n";
  std::vector<std::string> fields;
  for (const auto& [k, v] : e.fingerprint.fields) fields.push_back(k + "=" + v);
  s << "- fingerprint fields: " << join(fields, ", ") << "\n\n";
  s << "## Recipe\n\n";
  s << "- method: " << r.method << "; key bits " << number_text(r.key_bits) << ", value bits "
    << number_text(r.value_bits) << ", group " << (r.group == 0 ? a.head_dim : r.group) << "\n";
  if (!r.value_target.empty()) s << "- value target: " << r.value_target << "\n";
  s << "- rotation granularity: " << r.granularity << (r.composition.empty() ? "" : ", composition " + r.composition)
    << "\n";
  s << "- BF16 sink " << r.sink << " tokens, recent window " << r.recent << " tokens, pages of " << r.page_size
    << " tokens\n";
  if (e.recipe.contains("clip_ratio"))
    s << "- clip ratios (min..max over layers and heads): key " << e.recipe["clip_ratio"]["key"][0].get<double>()
      << ".." << e.recipe["clip_ratio"]["key"][1].get<double>() << ", value "
      << e.recipe["clip_ratio"]["value"][0].get<double>() << ".." << e.recipe["clip_ratio"]["value"][1].get<double>()
      << "\n";
  for (const auto& [k, v] : r.params) s << "- " << k << ": " << v << "\n";
  s << "\n## Bits per element\n\n";
  s << "- nominal: " << format_bits(e.bits["nominal"].get<double>()) << "\n";
  s << "- quantised history (codes + fp16 scales, zeros, norms): key "
    << format_bits(e.bits["history_key"].get<double>()) << ", value "
    << format_bits(e.bits["history_value"].get<double>()) << "\n";
  s << "- effective (incl. BF16 sink + recent):";
  for (const char* ctx : {"4096", "32768", "131072"})
    if (e.bits["effective"].contains(ctx))
      s << " " << ctx << " tokens: " << format_bits(e.bits["effective"][ctx].get<double>()) << ";";
  s << "\n\n## Calibration\n\n";
  const auto& p = a.provenance;
  s << "- source: " << (p.source.empty() ? "unknown" : p.source) << "\n";
  if (p.tokens) s << "- " << p.tokens << " tokens in " << p.sequences << " sequences, seed " << p.seed << "\n";
  if (!p.data_sha256.empty()) s << "- data sha256: `" << p.data_sha256 << "`\n";
  if (!p.stats_sha256.empty()) s << "- stats sha256: `" << p.stats_sha256 << "`\n";
  if (!a.command.empty()) s << "- command: `" << a.command << "`\n";
  s << "- producer: " << a.producer << ", created " << a.created << "\n\n";
  s << "## Validation\n\n";
  if (e.validation.is_null()) {
    s << "Not validated yet (publish with --validation REPORT.json to attach `kvcc validate` results).\n";
  } else {
    s << "```json\n" << e.validation.dump(2) << "\n```\n";
  }
  s << "\n## Artifact\n\n";
  const ZooFile* art = e.file("artifact");
  s << "- file: `" << fs::path(art->path).filename().string() << "` (" << art->size << " bytes), sha256 `"
    << art->sha256 << "`, artifact format " << e.artifact_format_version << "\n";
  s << "- check: `kvcc zoo verify --zoo ZOO` (hashes) and `kvcc verify FILE` (shapes, orthogonality)\n";
  if (!e.notes.empty()) s << "\n## Notes\n\n" << e.notes << "\n";
  return s.str();
}

namespace {

// A JSON number as text, or "" when absent or not a number.
std::string json_number(const json& j, const char* key, const char* fmt = "%.4g") {
  if (!j.is_object() || !j.contains(key) || !j[key].is_number()) return "";
  char buf[48];
  std::snprintf(buf, sizeof buf, fmt, j[key].get<double>());
  return buf;
}

std::string json_text(const json& j, const char* key) {
  if (!j.is_object() || !j.contains(key)) return "";
  const json& v = j[key];
  if (v.is_string()) return v.get<std::string>();
  if (v.is_number()) return v.dump();
  return "";
}

// A YAML scalar in double quotes (JSON string escaping is valid YAML).
std::string yaml_string(const std::string& s) { return json(s).dump(); }

// The measured-quality section from an attached `kvcc validate` report: its schemes of this
// entry's method. Nothing is computed or filled in here; absent numbers are left out.
std::string quality_section(const ZooEntry& e) {
  std::ostringstream s;
  const json& v = e.validation;
  const std::string method = json_text(e.recipe, "method");
  if (v.is_null()) {
    s << "No measured quality: this entry was published without a validation report. Measure it with\n"
         "`kvcc validate --model MODEL --artifact FILE --data HELDOUT.txt --json val.json` and re-publish\n"
         "with `--validation val.json`.\n";
    return s.str();
  }
  std::vector<const json*> schemes;
  if (v.is_object() && v.contains("schemes") && v["schemes"].is_array())
    for (const json& sc : v["schemes"])
      if (sc.is_object() && json_text(sc, "method") == method) schemes.push_back(&sc);
  if (schemes.empty()) {
    s << "A validation report is attached (in the entry's card file), but it holds no result for method `" << method
      << "`, so no quality is stated here.\n";
    return s.str();
  }
  s << "From the attached `kvcc validate` report (" << (json_text(v, "mode").empty() ? "?" : json_text(v, "mode"))
    << ", " << (json_text(v, "tokens").empty() ? "?" : json_text(v, "tokens")) << " tokens in "
    << (json_text(v, "documents").empty() ? "?" : json_text(v, "documents"))
    << " documents; ± is one standard error across documents). The run's windows may differ from the artifact's\n"
       "defaults above; its effective bits are those of the run.\n\n";
  const std::string ref_ppl = v.contains("reference") ? json_number(v["reference"], "perplexity", "%.4f") : "";
  s << "| scheme | cache | perplexity (BF16 reference " << (ref_ppl.empty() ? "?" : ref_ppl)
    << ") | Δppl (relative) | KL (nats/token) | top-1 agreement | effective bits |\n";
  s << "|---|---|---|---|---|---|---|\n";
  for (const json* sc : schemes) {
    auto pm = [&](const char* key, const char* err, const char* fmt) {
      const std::string x = json_number(*sc, key, fmt), dx = json_number(*sc, err, fmt);
      return x.empty() ? std::string("–") : x + (dx.empty() ? "" : " ± " + dx);
    };
    auto one = [&](const char* key, const char* fmt) {
      const std::string x = json_number(*sc, key, fmt);
      return x.empty() ? std::string("–") : x;
    };
    s << "| " << json_text(*sc, "name") << " | " << json_text(*sc, "cache") << " | " << one("perplexity", "%.4f")
      << " | " << pm("ppl_rel_change", "ppl_rel_change_stderr", "%.5f") << " | " << pm("kl", "kl_stderr", "%.5f")
      << " | " << one("top1_agreement", "%.4f") << " | " << one("effective_bits", "%.3f") << " |\n";
  }
  return s.str();
}

}  // namespace

std::string model_card_path(const ZooEntry& e) { return e.model_id + "/" + e.recipe_tag + "/" + kModelCardName; }

std::string render_model_card(const ZooEntry& e) {
  const json& r = e.recipe;
  const std::string method = json_text(r, "method");
  auto num = [&](const char* key) {
    return r.contains(key) && r[key].is_number() ? number_text(r[key].get<double>()) : std::string();
  };
  const std::string kb = num("key_bits"), vb = num("value_bits");
  std::ostringstream s;
  s << "---\n";
  s << "base_model: " << yaml_string(e.base_model.empty() ? e.model_id : e.base_model) << "\n";
  s << "library_name: kvcc\n";
  if (!e.license.empty()) s << "license: " << yaml_string(e.license) << "\n";
  s << "tags:\n- kvcc\n- kv-cache\n- kv-cache-quantization\n- " << yaml_string(method) << "\n";
  if (kb == vb && !kb.empty()) s << "- " << yaml_string("int" + kb) << "\n";
  s << "---\n\n";
  s << "# " << e.model_id << " · " << e.recipe_tag << "\n\n";
  s << "A kvcc KV-cache artifact for `" << e.model_id
    << "`: per layer and KV head the key and value rotations and fitted quantizer parameters that hold the model's "
       "KV cache at about "
    << (kb.empty() ? "?" : kb) << " bits per element. It matches the model with fingerprint `"
    << e.fingerprint.id.substr(0, 12) << "`"
    << (e.fingerprint_source == "shapes" ? " (built from shapes only: it matches no real model)" : "")
    << " (`kvcc zoo find --model DIR` checks a model against it).\n\n";
  const json& sh = e.shape;
  const json& b = e.bits;
  auto bits = [&](const json& j, const char* key) {
    const std::string x = json_number(j, key, "%.3f");
    return x.empty() ? std::string("?") : x;
  };
  s << "| | |\n|---|---|\n";
  s << "| method | " << method;
  std::vector<std::string> details;
  if (!json_text(r, "value_target").empty()) details.push_back("value target " + json_text(r, "value_target"));
  if (!json_text(r, "composition").empty()) details.push_back("composition " + json_text(r, "composition"));
  if (!json_text(r, "granularity").empty()) details.push_back("rotations per " + json_text(r, "granularity"));
  if (r.contains("params") && r["params"].is_object())
    for (const auto& [k, v] : r["params"].items())
      if (v.is_string()) details.push_back(k + " " + v.get<std::string>());
  if (!details.empty()) s << " (" << join(details, ", ") << ")";
  s << " |\n";
  s << "| key / value bits | " << (kb.empty() ? "?" : kb) << " / " << (vb.empty() ? "?" : vb) << " (nominal "
    << bits(b, "nominal") << ") |\n";
  s << "| quantised history, bits per element | key " << bits(b, "history_key") << ", value "
    << bits(b, "history_value") << " (codes + fp16 scales, zeros, norms) |\n";
  std::vector<std::string> eff;
  if (b.contains("effective") && b["effective"].is_object())
    for (const char* ctx : {"4096", "32768", "131072"})
      if (b["effective"].contains(ctx)) eff.push_back(std::string(ctx) + " tokens: " + bits(b["effective"], ctx));
  s << "| effective bits (with the BF16 windows) | " << (eff.empty() ? "?" : join(eff, "; ")) << " |\n";
  s << "| windows | BF16 sink " << json_text(r, "sink") << " tokens, BF16 recent " << json_text(r, "recent")
    << " tokens |\n";
  s << "| page size | " << json_text(r, "page_size") << " tokens |\n";
  s << "| group | " << json_text(r, "group") << " |\n";
  s << "| model shape | " << json_text(sh, "n_layers") << " layers, " << json_text(sh, "n_heads") << " query / "
    << json_text(sh, "n_kv_heads") << " KV heads, head_dim " << json_text(sh, "head_dim") << ", RoPE "
    << json_text(sh, "rope_style") << " |\n";
  const json& p = e.provenance;
  s << "| calibration | " << (json_text(p, "source").empty() ? "unknown" : json_text(p, "source"));
  if (json_number(p, "tokens", "%.0f") != "" && json_number(p, "tokens", "%.0f") != "0")
    s << ", " << json_text(p, "tokens") << " tokens in " << json_text(p, "sequences") << " sequences";
  s << " |\n";
  s << "| artifact format | kvcc-artifact " << e.artifact_format_version << " |\n\n";
  s << "## Measured quality\n\n" << quality_section(e) << "\n";
  s << "## Files\n\n";
  for (const ZooFile& f : e.files)
    s << "- `" << fs::path(f.path).filename().string() << "` (" << f.role << ", " << f.size << " bytes, sha256 `"
      << f.sha256 << "`)\n";
  s << "\nThe artifact is HDF5; `kvcc export ARTIFACT --format safetensors -o model.kvcc.safetensors` writes the same "
       "tensors and recipe as safetensors for engines without HDF5 (either form loads in kvcc). The card file holds "
       "the full record (fingerprint fields, provenance, notes); `kvcc zoo verify` checks every file.\n";
  return s.str();
}

// An exclusive flock on <zoo>/.kvcc-zoo.lock (a hidden file, so `zoo verify` does not list it),
// held from reading the index to replacing it: concurrent publishers into one zoo take turns, so
// none of them writes an index that misses another's entry.
namespace {
class ZooLock {
 public:
  explicit ZooLock(const std::string& zoo_dir) {
    const std::string path = (fs::path(zoo_dir) / ".kvcc-zoo.lock").string();
    fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0666);
    if (fd_ < 0) {
      const int err = errno;
      throw Error(path + ": cannot open the zoo's lock file (" + std::strerror(err) + ")");
    }
    while (::flock(fd_, LOCK_EX) != 0) {
      const int err = errno;
      if (err == EINTR) continue;
      ::close(fd_);
      throw Error(path + ": cannot lock the zoo (" + std::strerror(err) + ")");
    }
  }
  ~ZooLock() {
    ::flock(fd_, LOCK_UN);
    ::close(fd_);
  }
  ZooLock(const ZooLock&) = delete;
  ZooLock& operator=(const ZooLock&) = delete;

 private:
  int fd_ = -1;
};
}  // namespace

PublishResult publish(const std::string& artifact_path, const std::string& zoo_dir, const PublishOptions& options) {
  auto stage = [&](const std::string& name) {
    if (options.on_stage) options.on_stage(name);
  };
  // 1. The artifact must be sound before the zoo is touched.
  KVCC_REQUIRE(fs::is_regular_file(artifact_path), "artifact " + artifact_path + " does not exist");
  const std::vector<std::string> problems = verify_artifact_file(artifact_path);
  if (!problems.empty()) {
    std::vector<std::string> first(problems.begin(),
                                   problems.begin() + std::ptrdiff_t(std::min<size_t>(3, problems.size())));
    throw Error("refusing to publish " + artifact_path + ": it fails verification (" + join(first, "; ") +
                (problems.size() > 3 ? "; +" + std::to_string(problems.size() - 3) + " more" : "") + ")");
  }
  const Artifact art = read_artifact(artifact_path);
  const std::string art_sha = sha256_file_hex(artifact_path);
  const uint64_t art_size = fs::file_size(artifact_path);
  KVCC_REQUIRE(safe_component(art.model_id), "artifact model id '" + art.model_id +
                                                 "' cannot name a zoo folder (use letters, digits, '.', '_', '-')");

  // Hub metadata goes into YAML front matter: hub-style ids only ("owner/name", SPDX licence ids).
  auto hub_id = [](const std::string& v, bool slash) {
    return std::all_of(v.begin(), v.end(),
                       [&](char c) {
                         return std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-' ||
                                c == '+' || (slash && c == '/');
                       }) &&
           v.size() <= 200 && std::count(v.begin(), v.end(), '/') <= 1 && v.front() != '/' && v.back() != '/';
  };
  KVCC_REQUIRE(options.base_model.empty() || hub_id(options.base_model, true),
               "base model '" + options.base_model + "' is not a hub repository id (owner/name)");
  KVCC_REQUIRE(options.license.empty() || hub_id(options.license, false),
               "licence '" + options.license + "' is not an SPDX-style id (e.g. mit, apache-2.0)");

  fs::create_directories(zoo_dir);
  // Held until the index is replaced and the files it no longer lists are removed.
  const ZooLock lock(zoo_dir);
  Index index = read_index(zoo_dir, /*allow_missing=*/true);

  ZooEntry e;
  e.model_id = art.model_id;
  e.recipe_tag = recipe_tag(art);
  e.id = e.model_id + "/" + e.recipe_tag;
  e.fingerprint = art.fingerprint;
  e.fingerprint_source = is_shapes_only(art.fingerprint) ? "shapes" : "model";
  e.artifact_format_version = art.format_version;
  e.published = utc_now();
  e.notes = options.notes;
  e.base_model = options.base_model;
  e.license = options.license;
  e.recipe = recipe_summary(art);
  e.shape = {{"n_layers", art.n_layers},
             {"n_heads", art.n_heads},
             {"n_kv_heads", art.n_kv_heads},
             {"head_dim", art.head_dim},
             {"rope_style", rope_style_name(art.rope_style)}};
  e.provenance = {{"source", art.provenance.source},
                  {"tokens", art.provenance.tokens},
                  {"sequences", art.provenance.sequences},
                  {"seed", art.provenance.seed},
                  {"data_sha256", art.provenance.data_sha256},
                  {"stats_sha256", art.provenance.stats_sha256},
                  {"producer", art.producer},
                  {"created", art.created},
                  {"command", art.command}};
  e.bits = bits_summary(art);
  e.validation = options.validation;

  // 2. Duplicates and conflicts.
  PublishResult result;
  if (options.replace)
    if (const ZooEntry* same = index.find(e.id); same && same->file("artifact")->sha256 == art_sha &&
                                                 same->notes == e.notes && same->validation == e.validation &&
                                                 same->base_model == e.base_model && same->license == e.license) {
      write_text_file((fs::path(zoo_dir) / model_card_path(*same)).string(), render_model_card(*same));
      result.entry = *same;
      result.unchanged = true;
      return result;
    }
  std::vector<std::string> refusals;
  for (const auto& old : index.entries) {
    const ZooFile* old_art = old.file("artifact");
    if (old.id == e.id) {
      refusals.push_back("entry '" + old.id + "' already exists (published " + old.published +
                         (old_art->sha256 == art_sha ? ", the identical artifact" : ", a different artifact") + ")");
      result.replaced.push_back(old.id);
    } else if (old_art->sha256 == art_sha) {
      refusals.push_back("this artifact is already published as entry '" + old.id + "'");
      result.replaced.push_back(old.id);
    } else if (old.model_id == e.model_id && !old.fingerprint.matches(e.fingerprint)) {
      refusals.push_back("model id '" + e.model_id + "' names a different model in entry '" + old.id + "' (" +
                         old.fingerprint.describe_difference(e.fingerprint) + ")");
      result.replaced.push_back(old.id);
    }
  }
  if (!refusals.empty() && !options.replace)
    throw Error("refusing to publish " + artifact_path + ": " + join(refusals, "; ") + "; pass --replace to replace");

  // 3. Files under revisioned names, so no file the current index refers to is overwritten. If
  // anything fails before the index is replaced, the new files are removed again (a crash leaves
  // them behind unreferenced; `zoo verify` lists them as extra).
  const std::string folder = e.model_id + "/" + e.recipe_tag;
  std::vector<fs::path> new_files;
  std::vector<ZooEntry> kept;
  try {
    fs::create_directories(fs::path(zoo_dir) / folder);
    const std::string rev =
        sha256_hex(art_sha + "\n" + e.published + "\n" + e.notes + "\n" + e.validation.dump() +
                   (e.base_model.empty() && e.license.empty() ? "" : "\n" + e.base_model + "\n" + e.license))
            .substr(0, 12);
    const std::string art_rel = folder + "/artifact." + rev + ".kvcc.h5";
    new_files.push_back(fs::path(zoo_dir) / art_rel);
    copy_verified(artifact_path, new_files.back().string(), art_sha);
    e.files.push_back({"artifact", art_rel, art_sha, art_size});
    const std::string card = render_card(e, art);
    const std::string card_rel = folder + "/card." + rev + ".md";
    new_files.push_back(fs::path(zoo_dir) / card_rel);
    write_text_file(new_files.back().string(), card);
    e.files.push_back({"card", card_rel, sha256_hex(card), uint64_t(card.size())});
    stage("files_written");

    // 4. The index, atomically.
    for (auto& old : index.entries)
      if (std::find(result.replaced.begin(), result.replaced.end(), old.id) == result.replaced.end())
        kept.push_back(old);
    kept.push_back(e);
    std::sort(kept.begin(), kept.end(), [](const ZooEntry& x, const ZooEntry& y) { return x.id < y.id; });
    json j = {{"format", kIndexFormat}, {"format_version", kIndexVersion}, {"entries", json::array()}};
    for (const auto& k : kept) j["entries"].push_back(entry_to_json(k));
    const std::string index_path = (fs::path(zoo_dir) / kIndexName).string();
    write_file_atomically(index_path, [&](const std::string& tmp) {
      std::ofstream out(tmp, std::ios::binary);
      out << j.dump(2) << "\n";
      out.close();
      KVCC_REQUIRE(bool(out), "cannot write " + tmp);
      stage("index_temp_written");
    });
  } catch (...) {
    std::error_code ec;
    for (const auto& f : new_files) fs::remove(f, ec);
    throw;
  }
  // The model card, from the index record just written (a crash before this leaves the old or no
  // card, which `zoo verify` reports; re-publishing rewrites it).
  write_text_file((fs::path(zoo_dir) / model_card_path(e)).string(), render_model_card(e));
  stage("index_written");

  // 5. Old files no entry refers to any more (and the cards of folders no entry uses).
  std::set<std::string> referenced;
  for (const auto& k : kept) {
    for (const auto& f : k.files) referenced.insert(f.path);
    referenced.insert(model_card_path(k));
  }
  for (const auto& old : index.entries)
    if (std::find(result.replaced.begin(), result.replaced.end(), old.id) != result.replaced.end() &&
        !referenced.count(model_card_path(old))) {
      std::error_code ec;
      fs::remove(fs::path(zoo_dir) / model_card_path(old), ec);
    }
  for (const auto& old : index.entries) {
    if (std::find(result.replaced.begin(), result.replaced.end(), old.id) == result.replaced.end()) continue;
    for (const auto& f : old.files) {
      if (referenced.count(f.path)) continue;
      std::error_code ec;
      if (fs::remove(fs::path(zoo_dir) / f.path, ec)) result.removed_files.push_back(f.path);
      // Drop folders the removal emptied (recipe, then model), never the zoo itself.
      fs::path dir = (fs::path(zoo_dir) / f.path).parent_path();
      for (int up = 0; up < 2 && fs::exists(dir, ec) && fs::is_empty(dir, ec); ++up) {
        fs::remove(dir, ec);
        dir = dir.parent_path();
      }
    }
  }
  result.entry = std::move(e);
  return result;
}

VerifyReport verify_zoo(const std::string& zoo_dir) {
  const Index index = read_index(zoo_dir);
  VerifyReport report;
  report.entries = index.entries.size();
  std::set<std::string> listed;
  for (const auto& e : index.entries) {
    // The model card: present and the one this index record renders.
    const std::string card = model_card_path(e);
    listed.insert(fs::path(card).lexically_normal().generic_string());
    // error_code forms: a name the file system refuses (too long) is reported missing, not thrown.
    std::error_code ec;
    if (!fs::is_regular_file(fs::path(zoo_dir) / card, ec)) {
      report.missing.push_back(card + " (" + e.id + "): model card");
    } else if (read_text((fs::path(zoo_dir) / card).string()) != render_model_card(e)) {
      report.corrupt.push_back(card + " (" + e.id +
                               "): stale model card (not what the index renders; re-publish the entry with "
                               "--replace to rewrite it)");
    }
    for (const auto& f : e.files) {
      listed.insert(fs::path(f.path).lexically_normal().generic_string());
      const fs::path p = fs::path(zoo_dir) / f.path;
      ++report.files_checked;
      if (!fs::is_regular_file(p, ec)) {
        report.missing.push_back(f.path + " (" + e.id + ")");
        continue;
      }
      const uint64_t size = fs::file_size(p);
      const std::string sha = sha256_file_hex(p.string());
      if (size != f.size || sha != f.sha256)
        report.corrupt.push_back(f.path + " (" + e.id + "): " +
                                 (size != f.size
                                      ? "size " + std::to_string(size) + " vs " + std::to_string(f.size) + " listed"
                                      : std::string("sha256 differs from the index")));
    }
  }
  // Anything else in the zoo (hidden files such as .git or .gitattributes excepted) is extra:
  // leftovers of an interrupted publish, or files added by hand.
  const fs::path root(zoo_dir);
  for (auto it = fs::recursive_directory_iterator(root); it != fs::recursive_directory_iterator(); ++it) {
    const std::string name = it->path().filename().string();
    if (!name.empty() && name[0] == '.') {
      if (it->is_directory()) it.disable_recursion_pending();
      continue;
    }
    if (it->is_directory()) continue;
    const std::string rel = fs::relative(it->path(), root).lexically_normal().generic_string();
    if (rel == kIndexName || listed.count(rel)) continue;
    report.extra.push_back(
        rel + (rel.find(kTempMarker) != std::string::npos ? " (temporary file of an interrupted write)" : ""));
  }
  std::sort(report.extra.begin(), report.extra.end());
  return report;
}

const ZooEntry& resolve_entry(const Index& index, const std::string& query) {
  if (const ZooEntry* e = index.find(query)) return *e;
  std::vector<const ZooEntry*> hits;
  for (const auto& e : index.entries)
    if (e.id.rfind(query, 0) == 0 || e.model_id == query) hits.push_back(&e);
  KVCC_REQUIRE(!hits.empty(), "no zoo entry '" + query + "' (run `kvcc zoo list` to see the ids)");
  if (hits.size() > 1) {
    std::vector<std::string> ids;
    for (const auto* h : hits) ids.push_back(h->id);
    throw Error("'" + query + "' matches several zoo entries: " + join(ids, ", "));
  }
  return *hits.front();
}

FindResult find_for_fingerprint(const Index& index, const ModelFingerprint& fingerprint) {
  FindResult r;
  size_t best = SIZE_MAX;
  for (const auto& e : index.entries) {
    if (e.fingerprint.matches(fingerprint)) {
      r.matches.push_back(&e);
      continue;
    }
    const std::string diff = e.fingerprint.describe_difference(fingerprint);
    const size_t n = difference_count(diff);
    if (n < best) {
      best = n;
      r.closest = &e;
      r.closest_difference = diff;
    }
  }
  if (!r.matches.empty()) {
    r.closest = nullptr;
    r.closest_difference.clear();
  }
  return r;
}

}  // namespace kvcc::zoo
