#include "zoo/oscar_interop.h"

#include <chrono>
#include <cstring>
#include <ctime>
#include <initializer_list>

#include "formats/error.h"
#include "formats/method.h"

namespace kvcc::zoo {
namespace {

// OSCAR objectives are "<target>_<composition>", e.g. "qqt_r_h_pbr", "sst_r_h_pbr"; "hadamard" is
// the data-free baseline.
struct Objective {
  std::string target;       // "qqt", "sst", "hadamard", ...
  std::string composition;  // kvcc's name: "UHP", "UH", "U"; "" when unknown
};

Objective parse_objective(const std::string& objective) {
  static const std::pair<const char*, const char*> comps[] = {{"_r_h_pbr", "UHP"}, {"_r_h", "UH"}, {"_r", "U"}};
  for (const auto& [suffix, name] : comps) {
    const size_t n = std::strlen(suffix);
    if (objective.size() > n && objective.compare(objective.size() - n, n, suffix) == 0)
      return {objective.substr(0, objective.size() - n), name};
  }
  return {objective, ""};
}

std::string oscar_composition(const std::string& kvcc_composition) {
  if (kvcc_composition == "UHP") return "r_h_pbr";
  if (kvcc_composition == "UH") return "r_h";
  if (kvcc_composition == "U") return "r";
  return kvcc_composition;
}

std::string utc_now() {
  const std::time_t t = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

void check_layers(const OscarRotationSet& set, const char* which) {
  for (size_t i = 0; i < set.layers.size(); ++i)
    KVCC_REQUIRE(set.layers[i].layer_id == int64_t(i),
                 std::string(which) + " rotations have layer ids that are not 0.." +
                     std::to_string(set.layers.size() - 1) + " (layer " + std::to_string(set.layers[i].layer_id) +
                     "); sparse ids (hybrid models) are not supported by kvcc artifacts");
}

void fill_side(SideArtifact& side, const OscarRotationSet& set, int layer, int kv_head, double clip_ratio) {
  const size_t d = size_t(set.head_dim);
  const int src_head = set.heads == 1 ? 0 : kv_head;
  const OscarLayer& l = set.layers[size_t(layer)];
  side.rotation.assign(l.rotation.begin() + std::ptrdiff_t(size_t(src_head) * d * d),
                       l.rotation.begin() + std::ptrdiff_t(size_t(src_head + 1) * d * d));
  if (!l.eigenvalues.empty())
    side.eigenvalues.assign(l.eigenvalues.begin() + std::ptrdiff_t(size_t(src_head) * d),
                            l.eigenvalues.begin() + std::ptrdiff_t(size_t(src_head + 1) * d));
  side.clip_ratio = clip_ratio;
}

}  // namespace

Artifact import_oscar(const OscarRotationSet& key, const OscarRotationSet& value, const OscarImportOptions& o) {
  KVCC_REQUIRE(!o.model_id.empty(), "import-oscar needs a model id");
  KVCC_REQUIRE((o.config == nullptr) == (o.fingerprint == nullptr), "import_oscar: config and fingerprint go together");
  check_layers(key, "key");
  check_layers(value, "value");
  KVCC_REQUIRE(key.layers.size() == value.layers.size(), "key rotations have " + std::to_string(key.layers.size()) +
                                                             " layers but value rotations " +
                                                             std::to_string(value.layers.size()));
  KVCC_REQUIRE(key.head_dim == value.head_dim,
               "key rotations are " + std::to_string(key.head_dim) + "x" + std::to_string(key.head_dim) +
                   " but value rotations " + std::to_string(value.head_dim) + "x" + std::to_string(value.head_dim));
  const int per_head = std::max(key.heads, value.heads);
  KVCC_REQUIRE((key.heads == 1 || key.heads == per_head) && (value.heads == 1 || value.heads == per_head),
               "key and value files hold different numbers of per-head rotations (" + std::to_string(key.heads) +
                   " vs " + std::to_string(value.heads) + ")");

  Artifact a;
  a.producer = std::string("kvcc ") + KVCC_VERSION;
  a.created = utc_now();
  a.command = o.command;
  a.model_id = o.model_id;
  a.n_layers = int(key.layers.size());
  a.head_dim = key.head_dim;
  if (o.config != nullptr) {
    const ModelConfig& c = *o.config;
    KVCC_REQUIRE(c.n_layers == a.n_layers, "the OSCAR files have " + std::to_string(a.n_layers) +
                                               " layers but the model has " + std::to_string(c.n_layers) +
                                               " (rotations of another model?)");
    KVCC_REQUIRE(c.head_dim == a.head_dim, "the OSCAR rotations are " + std::to_string(a.head_dim) +
                                               "-dimensional but the model's head_dim is " +
                                               std::to_string(c.head_dim));
    KVCC_REQUIRE(per_head == 1 || per_head == c.n_kv_heads, "the OSCAR files hold " + std::to_string(per_head) +
                                                                " rotations per layer but the model has " +
                                                                std::to_string(c.n_kv_heads) + " KV heads");
    a.n_heads = c.n_heads;
    a.n_kv_heads = c.n_kv_heads;
    a.rope_style = c.rope_style;
    a.fingerprint = *o.fingerprint;
  } else {
    a.n_kv_heads = o.n_kv_heads > 0 ? o.n_kv_heads : per_head;
    a.n_heads = o.n_heads > 0 ? o.n_heads : a.n_kv_heads;
    KVCC_REQUIRE(per_head == 1 || per_head == a.n_kv_heads, "the OSCAR files hold " + std::to_string(per_head) +
                                                                " rotations per layer but --n-kv-heads is " +
                                                                std::to_string(a.n_kv_heads));
    KVCC_REQUIRE(a.n_heads % a.n_kv_heads == 0, "--n-heads must be a multiple of --n-kv-heads");
    a.rope_style = RopeStyle::RotateHalf;  // OSCAR serves Hugging Face models
    // A fingerprint of shapes only, marked so: it can never match a real model's fingerprint.
    a.fingerprint.fields = {{"architecture", "unknown"},
                            {"n_layers", std::to_string(a.n_layers)},
                            {"n_heads", std::to_string(a.n_heads)},
                            {"n_kv_heads", std::to_string(a.n_kv_heads)},
                            {"head_dim", std::to_string(a.head_dim)},
                            {"rope_style", rope_style_name(a.rope_style)},
                            {"fingerprint_source", "shapes"}};
    a.fingerprint.weights_sha256 = "";
    a.fingerprint.id = fingerprint_id(a.fingerprint.fields, a.fingerprint.weights_sha256);
  }

  const Objective kobj = parse_objective(key.objective), vobj = parse_objective(value.objective);
  Recipe& r = a.recipe;
  // OSCAR's data-free objective "hadamard" is kvcc's hadamard; every other one is an oscar rotation.
  const Method method = kobj.target == "hadamard" && vobj.target == "hadamard" ? Method::Hadamard : Method::Oscar;
  const bool aware = method_traits(method).rotation == RotationRule::AttentionAware;
  r.method = method_name(method);
  r.key_bits = r.value_bits = 2;
  r.group = 0;
  r.granularity = per_head == 1 ? "layer" : "head";
  r.composition = aware ? kobj.composition : "";
  // OSCAR's "sst" value target is the logit²-weighted value moment (DESIGN.md "logit2").
  r.value_target = !aware ? "" : vobj.target == "sst" ? "logit2" : vobj.target;
  r.params["oscar_key_objective"] = key.objective;
  r.params["oscar_value_objective"] = value.objective;
  r.params["oscar_format_version"] = std::to_string(std::max(key.format_version, value.format_version));
  r.params["clip_source"] = "OSCAR serving defaults unless overridden (key " + std::to_string(o.key_clip_ratio) +
                            ", value " + std::to_string(o.value_clip_ratio) + ")";
  if (!o.key_file_sha256.empty()) r.params["oscar_key_file_sha256"] = o.key_file_sha256;
  if (!o.value_file_sha256.empty()) r.params["oscar_value_file_sha256"] = o.value_file_sha256;
  a.provenance.source = "imported:oscar";

  a.heads.resize(size_t(a.n_layers) * size_t(a.n_kv_heads));
  for (int l = 0; l < a.n_layers; ++l)
    for (int h = 0; h < a.n_kv_heads; ++h) {
      fill_side(a.head(l, h).key, key, l, h, o.key_clip_ratio);
      fill_side(a.head(l, h).value, value, l, h, o.value_clip_ratio);
    }
  return a;
}

OscarExport export_oscar(const Artifact& a, int format_version) {
  KVCC_REQUIRE(format_version >= 0 && format_version <= 2, "OSCAR format_version must be 1 or 2");
  KVCC_REQUIRE(a.n_layers > 0 && a.n_kv_heads > 0 && a.head_dim > 0 &&
                   a.heads.size() == size_t(a.n_layers) * size_t(a.n_kv_heads),
               "artifact has no rotations to export");
  const size_t d = size_t(a.head_dim);
  auto to_f32 = [](const std::vector<double>& v) { return std::vector<float>(v.begin(), v.end()); };

  // Whether every layer's heads share one rotation (after rounding to float32, as OSCAR stores it).
  int shared_at_layer = -1, differing_head = -1;
  for (int l = 0; l < a.n_layers && differing_head < 0; ++l)
    for (int h = 1; h < a.n_kv_heads; ++h) {
      const HeadArtifact &first = a.head(l, 0), &other = a.head(l, h);
      if (to_f32(first.key.rotation) != to_f32(other.key.rotation) ||
          to_f32(first.value.rotation) != to_f32(other.value.rotation)) {
        shared_at_layer = l;
        differing_head = h;
        break;
      }
    }
  const bool shared = differing_head < 0;
  if (format_version == 0) format_version = shared ? 1 : 2;
  KVCC_REQUIRE(format_version == 2 || shared,
               "the artifact's KV heads have different rotations (layer " + std::to_string(shared_at_layer) +
                   ", heads 0 and " + std::to_string(differing_head) +
                   "); OSCAR format_version 1 holds one per layer: use --format-version 2");

  OscarExport out;
  const Recipe& r = a.recipe;
  std::string kobj, vobj;
  if (auto it = r.params.find("oscar_key_objective"); it != r.params.end()) kobj = it->second;
  if (auto it = r.params.find("oscar_value_objective"); it != r.params.end()) vobj = it->second;
  if (kobj.empty() || vobj.empty()) {
    if (const auto m = find_method(r.method); m && method_traits(*m).rotation == RotationRule::AttentionAware) {
      const std::string comp = oscar_composition(r.composition.empty() ? "UHP" : r.composition);
      kobj = "qqt_" + comp;
      vobj = (r.value_target == "logit2" || r.value_target.empty() ? std::string("sst") : r.value_target) + "_" + comp;
    } else {
      kobj = vobj = r.method;  // "hadamard", "random", "identity", ...
    }
  }
  const int heads = format_version == 1 ? 1 : a.n_kv_heads;
  for (int side = 0; side < 2; ++side) {
    OscarRotationSet& set = side == 0 ? out.key : out.value;
    set.format_version = format_version;
    set.objective = side == 0 ? kobj : vobj;
    set.source_grouping = format_version == 1 ? "layer" : "kv_head";
    set.head_dim = a.head_dim;
    set.heads = heads;
    for (int l = 0; l < a.n_layers; ++l) {
      OscarLayer layer;
      layer.layer_id = l;
      bool have_eigen = true;
      for (int h = 0; h < heads; ++h) {
        const SideArtifact& s = side == 0 ? a.head(l, h).key : a.head(l, h).value;
        KVCC_REQUIRE(s.rotation.size() == d * d, "layer " + std::to_string(l) + " head " + std::to_string(h) +
                                                     " has no " + (side == 0 ? "key" : "value") + " rotation");
        layer.rotation.insert(layer.rotation.end(), s.rotation.begin(), s.rotation.end());
        have_eigen = have_eigen && s.eigenvalues.size() == d;
        if (have_eigen) layer.eigenvalues.insert(layer.eigenvalues.end(), s.eigenvalues.begin(), s.eigenvalues.end());
      }
      if (!have_eigen) layer.eigenvalues.clear();  // OSCAR's loader needs only the rotation
      set.layers.push_back(std::move(layer));
    }
  }
  for (const std::string* obj : {&kobj, &vobj})
    for (char c : *obj)
      KVCC_REQUIRE((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-' ||
                       c == '.',
                   "objective '" + *obj + "' cannot name an OSCAR rotation file");
  out.key_file_name = "k_rotation_" + kobj + ".pt";
  out.value_file_name = "v_rotation_" + vobj + ".pt";
  return out;
}

}  // namespace kvcc::zoo
