#include "formats/artifact.h"

#include <Eigen/Dense>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <set>

#include "formats/artifact_safetensors.h"
#include "formats/atomic_file.h"
#include "formats/error.h"
#include "formats/h5.h"
#include "formats/h5_common.h"
#include "formats/method.h"
#include "formats/sha256.h"

namespace kvcc {
namespace {

std::string side_path(int layer, int h, const char* side) {
  return "/layers/" + std::to_string(layer) + "/kv" + std::to_string(h) + "/" + side;
}

template <class T>
std::string bytes_sha256(const std::vector<T>& v) {
  return sha256_hex(v.data(), v.size() * sizeof(T));
}

// Writes a dataset with the sha256 of its (little-endian) bytes as attribute `sha256`.
template <class T>
void write_checked(const h5::Group& g, const std::string& name, const h5::Shape& shape, const std::vector<T>& data) {
  h5::Dataset ds = g.write(name, shape, data);
  ds.set_attr("sha256", bytes_sha256(data));
}

// Reads a dataset of exactly dtype T, checking its checksum; a mismatch is thrown, or collected
// into `problems` when given.
template <class T>
std::vector<T> read_checked(const h5::Group& g, const std::string& name, const h5::Shape* expected,
                            h5::Shape* shape_out, std::vector<std::string>* problems) {
  std::vector<T> data = g.read<T>(name, expected, shape_out);
  const h5::Dataset ds = g.dataset(name);
  const std::string want = ds.attr_string("sha256");
  if (bytes_sha256(data) != want) {
    const std::string msg = g.file_name() + ": checksum mismatch in " + ds.path();
    if (!problems) throw Error(msg);
    problems->push_back(msg);
  }
  return data;
}

void write_side(const h5::Group& g, const SideArtifact& s, int d) {
  g.set_attr("clip_ratio", s.clip_ratio);
  const int64_t rot_dim = s.rotation.empty() ? 0 : d;
  write_checked(g, "rotation", {rot_dim, rot_dim}, s.rotation);
  if (!s.eigenvalues.empty()) write_checked(g, "eigenvalues", {int64_t(s.eigenvalues.size())}, s.eigenvalues);
  if (!s.levels.empty()) write_checked(g, "levels", {int64_t(s.levels.size())}, s.levels);
  if (s.bits != 0) write_checked(g, "bits", {1}, std::vector<double>{s.bits});
  if (s.extras.empty()) return;
  h5::Group extras = g.create_group("extras", /*track_order=*/true);
  for (const NamedArray& a : s.extras) {
    if (a.integer) {
      std::vector<int64_t> ints(a.data.size());
      for (size_t i = 0; i < ints.size(); ++i) ints[i] = int64_t(std::llround(a.data[i]));
      write_checked(extras, a.name, a.shape, ints);
    } else {
      write_checked(extras, a.name, a.shape, a.data);
    }
  }
}

SideArtifact read_side(const h5::Group& g, int d, std::vector<std::string>* problems) {
  SideArtifact s;
  s.clip_ratio = g.attr_double("clip_ratio");
  // Shapes are checked before anything is read (and every read is bounded by the file's size).
  h5::Shape shape = g.dataset("rotation").shape();
  if (shape != h5::Shape{d, d} && shape != h5::Shape{0, 0})
    throw Error(g.file_name() + ": " + g.child_path("rotation") + " has shape " + h5::shape_string(shape) +
                ", expected " + h5::shape_string({d, d}));
  s.rotation = read_checked<double>(g, "rotation", &shape, nullptr, problems);
  const h5::Shape vec{d};
  if (g.has("eigenvalues")) s.eigenvalues = read_checked<double>(g, "eigenvalues", &vec, nullptr, problems);
  if (g.has("levels")) {
    shape = g.dataset("levels").shape();
    if (shape.size() != 1) throw Error(g.file_name() + ": " + g.child_path("levels") + " must be one-dimensional");
    s.levels = read_checked<double>(g, "levels", &shape, nullptr, problems);
  }
  if (g.has("bits")) {  // absent in artifacts without per-side widths
    const h5::Shape one{1};
    s.bits = read_checked<double>(g, "bits", &one, nullptr, problems)[0];
  }
  if (g.has("extras")) {
    h5::Group extras = g.group("extras");
    for (const std::string& name : extras.children()) {
      NamedArray a;
      a.name = name;
      const h5::DType type = extras.dataset(name).dtype();
      if (type == h5::DType::Int64) {
        a.integer = true;
        auto ints = read_checked<int64_t>(extras, name, nullptr, &a.shape, problems);
        a.data.assign(ints.begin(), ints.end());
      } else if (type == h5::DType::Float64) {
        a.data = read_checked<double>(extras, name, nullptr, &a.shape, problems);
      } else {
        throw Error(g.file_name() + ": " + extras.child_path(name) + " has dtype " + h5::dtype_name(type) +
                    ", expected float64 or int64");
      }
      s.extras.push_back(std::move(a));
    }
  }
  return s;
}

void write_recipe(const h5::Group& g, const Recipe& r) {
  g.set_attr("method", r.method);
  g.set_attr("key_bits", r.key_bits);
  g.set_attr("value_bits", r.value_bits);
  g.set_attr("group", r.group);
  g.set_attr("sink", r.sink);
  g.set_attr("recent", r.recent);
  g.set_attr("page_size", r.page_size);
  g.set_attr("value_target", r.value_target);
  g.set_attr("granularity", r.granularity);
  g.set_attr("composition", r.composition);
  g.set_attr("seed", r.seed);
  h5::Group params = g.create_group("params");
  for (const auto& [key, value] : r.params) params.set_attr(key, value);
}

Recipe read_recipe(const h5::Group& g) {
  Recipe r;
  r.method = g.attr_string("method");
  r.key_bits = g.attr_double("key_bits");
  r.value_bits = g.attr_double("value_bits");
  constexpr int kMin = std::numeric_limits<int>::min(), kMax = std::numeric_limits<int>::max();
  r.group = g.attr_int32("group", kMin, kMax);
  r.sink = g.attr_int32("sink", kMin, kMax);
  r.recent = g.attr_int32("recent", kMin, kMax);
  r.page_size = g.attr_int32("page_size", kMin, kMax);
  r.value_target = g.attr_string("value_target");
  r.granularity = g.attr_string("granularity");
  r.composition = g.attr_string("composition");
  r.seed = g.attr_uint("seed");
  h5::Group params = g.group("params");
  for (const std::string& key : params.attr_names()) r.params[key] = params.attr_string(key);
  return r;
}

Artifact read_artifact_impl(const std::string& path, std::vector<std::string>* problems) {
  h5::File file = h5::File::open(path);
  Artifact a;
  a.format_version = h5::check_root_header(file, kArtifactFormat, kArtifactMajor, kArtifactWidthsMajor);
  a.producer = file.attr_string("producer");
  a.created = file.attr_string("created");
  a.command = file.attr_string("command");
  a.model_id = file.attr_string("model_id");
  {
    h5::Group model = file.group("model");
    // Checked, not narrowed: 2^32 + 8 must not read as 8.
    constexpr int kMin = std::numeric_limits<int>::min(), kMax = std::numeric_limits<int>::max();
    a.n_layers = model.attr_int32("n_layers", kMin, kMax);
    a.n_heads = model.attr_int32("n_heads", kMin, kMax);
    a.n_kv_heads = model.attr_int32("n_kv_heads", kMin, kMax);
    a.head_dim = model.attr_int32("head_dim", kMin, kMax);
    try {
      a.rope_style = rope_style_from_name(model.attr_string("rope_style"));
    } catch (const Error& e) {
      model.fail(e.what());
    }
    if (a.n_layers <= 0 || a.n_kv_heads <= 0 || a.head_dim <= 0 || a.n_heads <= 0)
      model.fail("invalid model shape (" + std::to_string(a.n_layers) + " layers, " + std::to_string(a.n_heads) + "/" +
                 std::to_string(a.n_kv_heads) + " heads, head_dim " + std::to_string(a.head_dim) + ")");
    a.fingerprint = h5::read_fingerprint(model);
  }
  {
    h5::Group prov = file.group("provenance");
    a.provenance.data_sha256 = prov.attr_string("data_sha256");
    a.provenance.tokens = prov.attr_uint("tokens");
    a.provenance.sequences = prov.attr_uint("sequences");
    a.provenance.seed = prov.attr_uint("seed");
    a.provenance.stats_sha256 = prov.attr_string("stats_sha256");
    a.provenance.source = prov.attr_string("source");
  }
  a.recipe = read_recipe(file.group("recipe"));
  if (file.has("layer_budgets")) {  // 1.2 / 2.1
    const h5::Shape shape{a.n_layers};
    a.layer_budgets = read_checked<double>(file, "layer_budgets", &shape, nullptr, problems);
  }
  h5::Group layers = file.group("layers");
  // Not reserved from the (untrusted) counts: a missing group ends the loop with an Error.
  for (int l = 0; l < a.n_layers; ++l) {
    h5::Group layer = layers.group(std::to_string(l));
    for (int h = 0; h < a.n_kv_heads; ++h) {
      h5::Group head = layer.group("kv" + std::to_string(h));
      HeadArtifact ha;
      ha.key = read_side(head.group("key"), a.head_dim, problems);
      ha.value = read_side(head.group("value"), a.head_dim, problems);
      a.heads.push_back(std::move(ha));
    }
  }
  check_artifact_version_holds(a, path);
  return a;
}

bool all_finite(const std::vector<double>& v) {
  return std::all_of(v.begin(), v.end(), [](double x) { return std::isfinite(x); });
}

void verify_side(const SideArtifact& s, int d, const std::string& where, double tol, std::vector<std::string>& out) {
  const size_t dd = size_t(d) * size_t(d);
  if (!s.rotation.empty()) {
    if (s.rotation.size() != dd) {
      out.push_back(where + "/rotation: " + std::to_string(s.rotation.size()) + " values, expected " +
                    std::to_string(d) + "x" + std::to_string(d));
    } else if (!all_finite(s.rotation)) {
      out.push_back(where + "/rotation: contains NaN or inf");
    } else {
      const double err = max_orthogonality_error(s.rotation, d);
      if (!(err <= tol))
        out.push_back(where + "/rotation: not orthogonal (max |RtR - I| = " + std::to_string(err) + " > " +
                      std::to_string(tol) + ")");
    }
  }
  if (!s.eigenvalues.empty()) {
    if (s.eigenvalues.size() != size_t(d))
      out.push_back(where + "/eigenvalues: " + std::to_string(s.eigenvalues.size()) + " values, expected " +
                    std::to_string(d));
    else if (!all_finite(s.eigenvalues)) out.push_back(where + "/eigenvalues: contains NaN or inf");
    else if (!std::is_sorted(s.eigenvalues.begin(), s.eigenvalues.end()))
      out.push_back(where + "/eigenvalues: not in ascending order");
  }
  if (!(std::isfinite(s.clip_ratio) && s.clip_ratio > 0 && s.clip_ratio <= 1))
    out.push_back(where + ": clip_ratio " + std::to_string(s.clip_ratio) + " is not in (0, 1]");
  if (!s.levels.empty()) {
    const size_t n = s.levels.size();
    if (n < 2 || n > 256 || (n & (n - 1)) != 0)
      out.push_back(where + "/levels: " + std::to_string(n) + " levels, expected a power of two in [2, 256]");
    if (!all_finite(s.levels)) out.push_back(where + "/levels: contains NaN or inf");
    else if (std::adjacent_find(s.levels.begin(), s.levels.end(), std::greater_equal<double>()) != s.levels.end())
      out.push_back(where + "/levels: not strictly ascending");
  }
  if (s.bits != 0 && !(s.bits >= 1 && s.bits <= 8 && s.bits == std::floor(s.bits)))
    out.push_back(where + ": bits " + std::to_string(s.bits) + " is not a whole number of bits in [1, 8]");
  std::set<std::string> names;
  for (const NamedArray& a : s.extras) {
    const std::string at = where + "/extras/" + a.name;
    if (a.name.empty() || a.name.find('/') != std::string::npos || a.name == "." || a.name == "..")
      out.push_back(where + "/extras: invalid name \"" + a.name + "\"");
    if (!names.insert(a.name).second) out.push_back(at + ": duplicate name");
    if (h5::element_count(a.shape) != int64_t(a.data.size()) ||
        std::any_of(a.shape.begin(), a.shape.end(), [](int64_t x) { return x < 0; }))
      out.push_back(at + ": " + std::to_string(a.data.size()) + " values do not fill shape " +
                    h5::shape_string(a.shape));
    if (!all_finite(a.data)) out.push_back(at + ": contains NaN or inf");
    else if (a.integer && std::any_of(a.data.begin(), a.data.end(), [](double x) {
               return x != std::nearbyint(x) || std::abs(x) > 9.007199254740992e15;
             }))
      out.push_back(at + ": integer array holds a non-integer value");
  }
}

std::string field_value(const ModelFingerprint& fp, const std::string& name) {
  for (const auto& [n, v] : fp.fields)
    if (n == name) return v;
  return "";
}

}  // namespace

namespace {

bool same_bits(double x, double y) { return std::memcmp(&x, &y, sizeof x) == 0; }

std::string vector_difference(const std::vector<double>& x, const std::vector<double>& y) {
  if (x.size() != y.size()) return std::to_string(x.size()) + " vs " + std::to_string(y.size()) + " values";
  for (size_t i = 0; i < x.size(); ++i)
    if (!same_bits(x[i], y[i])) return "element " + std::to_string(i) + " differs";
  return "";
}

std::string side_difference(const SideArtifact& x, const SideArtifact& y, const std::string& at) {
  if (!same_bits(x.clip_ratio, y.clip_ratio)) return at + ": clip_ratio differs";
  if (!same_bits(x.bits, y.bits)) return at + ": bits differ";
  const std::pair<const char*, std::pair<const std::vector<double>*, const std::vector<double>*>> fields[] = {
      {"rotation", {&x.rotation, &y.rotation}},
      {"eigenvalues", {&x.eigenvalues, &y.eigenvalues}},
      {"levels", {&x.levels, &y.levels}}};
  for (const auto& [name, v] : fields)
    if (std::string d = vector_difference(*v.first, *v.second); !d.empty()) return at + "/" + name + ": " + d;
  if (x.extras.size() != y.extras.size())
    return at + "/extras: " + std::to_string(x.extras.size()) + " vs " + std::to_string(y.extras.size()) + " arrays";
  for (size_t i = 0; i < x.extras.size(); ++i) {
    const NamedArray &p = x.extras[i], &q = y.extras[i];
    if (p.name != q.name) return at + "/extras: array " + std::to_string(i) + " is " + p.name + " vs " + q.name;
    const std::string where = at + "/extras/" + p.name;
    if (p.integer != q.integer) return where + ": integer vs float";
    if (p.shape != q.shape) return where + ": shape " + h5::shape_string(p.shape) + " vs " + h5::shape_string(q.shape);
    if (std::string d = vector_difference(p.data, q.data); !d.empty()) return where + ": " + d;
  }
  return "";
}

}  // namespace

namespace {
bool has_side_widths(const Artifact& a) {
  return std::any_of(a.heads.begin(), a.heads.end(),
                     [](const HeadArtifact& h) { return h.key.bits != 0 || h.value.bits != 0; });
}
}  // namespace

std::string artifact_format_version(const Artifact& a) {
  const int budgets = a.layer_budgets.empty() ? 0 : 1;
  return has_side_widths(a) ? std::to_string(kArtifactWidthsMajor) + "." + std::to_string(budgets)
                            : std::to_string(kArtifactMajor) + "." + std::to_string(1 + budgets);
}

void check_artifact_version_holds(const Artifact& a, const std::string& path) {
  if (has_side_widths(a) && h5::parse_version(a.format_version, path).first < kArtifactWidthsMajor)
    throw Error(path + ": sides carry their own code widths (bits), which needs format_version " +
                std::to_string(kArtifactWidthsMajor) + ".0, but the file says " + a.format_version);
}

std::string artifact_difference(const Artifact& a, const Artifact& b) {
  const std::pair<const char*, std::pair<const std::string*, const std::string*>> strings[] = {
      {"producer", {&a.producer, &b.producer}},
      {"created", {&a.created, &b.created}},
      {"command", {&a.command, &b.command}},
      {"model_id", {&a.model_id, &b.model_id}},
      {"fingerprint id", {&a.fingerprint.id, &b.fingerprint.id}},
      {"fingerprint weights_sha256", {&a.fingerprint.weights_sha256, &b.fingerprint.weights_sha256}},
      {"provenance data_sha256", {&a.provenance.data_sha256, &b.provenance.data_sha256}},
      {"provenance stats_sha256", {&a.provenance.stats_sha256, &b.provenance.stats_sha256}},
      {"provenance source", {&a.provenance.source, &b.provenance.source}},
      {"recipe method", {&a.recipe.method, &b.recipe.method}},
      {"recipe value_target", {&a.recipe.value_target, &b.recipe.value_target}},
      {"recipe granularity", {&a.recipe.granularity, &b.recipe.granularity}},
      {"recipe composition", {&a.recipe.composition, &b.recipe.composition}}};
  for (const auto& [name, v] : strings)
    if (*v.first != *v.second) return std::string(name) + ": \"" + *v.first + "\" vs \"" + *v.second + "\"";
  if (a.fingerprint.fields != b.fingerprint.fields) return "fingerprint fields differ";
  const std::pair<const char*, std::pair<int64_t, int64_t>> ints[] = {
      {"n_layers", {a.n_layers, b.n_layers}},
      {"n_heads", {a.n_heads, b.n_heads}},
      {"n_kv_heads", {a.n_kv_heads, b.n_kv_heads}},
      {"head_dim", {a.head_dim, b.head_dim}},
      {"rope_style", {int64_t(a.rope_style), int64_t(b.rope_style)}},
      {"recipe group", {a.recipe.group, b.recipe.group}},
      {"recipe sink", {a.recipe.sink, b.recipe.sink}},
      {"recipe recent", {a.recipe.recent, b.recipe.recent}},
      {"recipe page_size", {a.recipe.page_size, b.recipe.page_size}}};
  for (const auto& [name, v] : ints)
    if (v.first != v.second)
      return std::string(name) + ": " + std::to_string(v.first) + " vs " + std::to_string(v.second);
  const std::pair<const char*, std::pair<uint64_t, uint64_t>> uints[] = {
      {"provenance tokens", {a.provenance.tokens, b.provenance.tokens}},
      {"provenance sequences", {a.provenance.sequences, b.provenance.sequences}},
      {"provenance seed", {a.provenance.seed, b.provenance.seed}},
      {"recipe seed", {a.recipe.seed, b.recipe.seed}}};
  for (const auto& [name, v] : uints)
    if (v.first != v.second)
      return std::string(name) + ": " + std::to_string(v.first) + " vs " + std::to_string(v.second);
  if (!same_bits(a.recipe.key_bits, b.recipe.key_bits)) return "recipe key_bits differs";
  if (!same_bits(a.recipe.value_bits, b.recipe.value_bits)) return "recipe value_bits differs";
  if (a.recipe.params != b.recipe.params) return "recipe params differ";
  if (std::string d = vector_difference(a.layer_budgets, b.layer_budgets); !d.empty()) return "layer_budgets: " + d;
  if (a.heads.size() != b.heads.size())
    return std::to_string(a.heads.size()) + " vs " + std::to_string(b.heads.size()) + " head entries";
  for (size_t i = 0; i < a.heads.size(); ++i) {
    const int l = a.n_kv_heads > 0 ? int(i) / a.n_kv_heads : 0, h = a.n_kv_heads > 0 ? int(i) % a.n_kv_heads : 0;
    for (const char* side : {"key", "value"}) {
      const bool k = side[0] == 'k';
      const std::string d = side_difference(k ? a.heads[i].key : a.heads[i].value,
                                            k ? b.heads[i].key : b.heads[i].value, side_path(l, h, side));
      if (!d.empty()) return d;
    }
  }
  return "";
}

double max_orthogonality_error(const std::vector<double>& rotation, int d) {
  KVCC_REQUIRE(rotation.size() == size_t(d) * size_t(d), "max_orthogonality_error: not a d x d matrix");
  Eigen::Map<const Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>> r(rotation.data(), d, d);
  return (r.transpose() * r - Eigen::MatrixXd::Identity(d, d)).cwiseAbs().maxCoeff();
}

const NamedArray* SideArtifact::extra(const std::string& name) const {
  for (const NamedArray& a : extras)
    if (a.name == name) return &a;
  return nullptr;
}

std::vector<std::string> verify_artifact(const Artifact& a, double tol) {
  std::vector<std::string> out;
  if (a.n_layers <= 0 || a.n_kv_heads <= 0 || a.head_dim <= 0 || a.n_heads <= 0 || a.n_heads % a.n_kv_heads != 0) {
    out.push_back("invalid model shape (" + std::to_string(a.n_layers) + " layers, " + std::to_string(a.n_heads) + "/" +
                  std::to_string(a.n_kv_heads) + " heads, head_dim " + std::to_string(a.head_dim) + ")");
    return out;
  }
  const size_t n = size_t(a.n_layers) * size_t(a.n_kv_heads);
  if (a.heads.size() != n) {
    out.push_back(std::to_string(a.heads.size()) + " head entries, expected " + std::to_string(n) +
                  " (layers x kv heads)");
    return out;
  }
  // The dimensions must be those of the model the fingerprint names.
  const std::pair<const char*, int> dims[] = {
      {"n_layers", a.n_layers}, {"n_heads", a.n_heads}, {"n_kv_heads", a.n_kv_heads}, {"head_dim", a.head_dim}};
  for (const auto& [name, value] : dims) {
    const std::string fp_value = field_value(a.fingerprint, name);
    if (!fp_value.empty() && fp_value != std::to_string(value))
      out.push_back(std::string("model ") + name + " " + std::to_string(value) + " disagrees with the fingerprint (" +
                    fp_value + ")");
  }
  const std::string fp_rope = field_value(a.fingerprint, "rope_style");
  if (!fp_rope.empty() && fp_rope != rope_style_name(a.rope_style))
    out.push_back(std::string("model rope_style ") + rope_style_name(a.rope_style) +
                  " disagrees with the fingerprint (" + fp_rope + ")");
  if (a.fingerprint.id.empty()) out.push_back("model fingerprint is empty");

  const Recipe& r = a.recipe;
  const std::optional<Method> method = find_method(r.method);
  if (r.method.empty()) out.push_back("recipe: method is empty");
  else if (!method) out.push_back("recipe: unknown method '" + r.method + "' (expected " + method_names() + ")");
  else
    for (const std::string& p : method_param_problems(*method, r.params)) out.push_back("recipe: " + p);
  if (!(std::isfinite(r.key_bits) && r.key_bits > 0 && std::isfinite(r.value_bits) && r.value_bits > 0))
    out.push_back("recipe: key_bits/value_bits must be positive");
  // group's meaning is per method (channels for the uniform grid, tokens for KIVI's keys), so
  // only its sign is a format matter.
  if (r.group < 0) out.push_back("recipe: group " + std::to_string(r.group) + " is negative");
  if (r.sink < 0 || r.recent < 0 || r.page_size <= 0)
    out.push_back("recipe: sink/recent must be >= 0 and page_size > 0");
  if (r.granularity != "head" && r.granularity != "layer")
    out.push_back("recipe: granularity \"" + r.granularity + "\" is not head or layer");
  if (!a.layer_budgets.empty()) {
    if (a.layer_budgets.size() != size_t(a.n_layers))
      out.push_back("layer_budgets: " + std::to_string(a.layer_budgets.size()) + " values, expected " +
                    std::to_string(a.n_layers) + " (one per layer)");
    else if (!std::all_of(a.layer_budgets.begin(), a.layer_budgets.end(),
                          [](double x) { return std::isfinite(x) && x > 0; }))
      out.push_back("layer_budgets: every value must be finite and positive");
  }

  for (int l = 0; l < a.n_layers; ++l)
    for (int h = 0; h < a.n_kv_heads; ++h) {
      verify_side(a.head(l, h).key, a.head_dim, side_path(l, h, "key"), tol, out);
      verify_side(a.head(l, h).value, a.head_dim, side_path(l, h, "value"), tol, out);
      if (r.granularity == "layer" && h > 0 &&
          (a.head(l, h).key.rotation != a.head(l, 0).key.rotation ||
           a.head(l, h).value.rotation != a.head(l, 0).value.rotation))
        out.push_back("/layers/" + std::to_string(l) + "/kv" + std::to_string(h) +
                      ": granularity is layer but its rotation differs from kv0's");
    }
  // Per-side widths: only codecs whose grid takes any width (no fitted level table, split or
  // codebook sized by the recipe's bits).
  const bool any_bits = std::any_of(a.heads.begin(), a.heads.end(),
                                    [](const HeadArtifact& h) { return h.key.bits != 0 || h.value.bits != 0; });
  if (any_bits && method && method_traits(*method).codec != CodecFamily::UniformGrid &&
      method_traits(*method).codec != CodecFamily::KiviChannel)
    out.push_back("per-side bit widths are for the uniform-grid and kivi methods, not " + r.method);
  // Method-specific checks (e.g. codebook shapes against the recipe), owned by the method's codec
  // and reached through the method table.
  if (method && method_traits(*method).verify) {
    const std::vector<std::string> problems = method_traits(*method).verify(a);
    out.insert(out.end(), problems.begin(), problems.end());
  }
  return out;
}

void write_artifact(const Artifact& a, const std::string& path) {
  const std::vector<std::string> problems = verify_artifact(a);
  if (!problems.empty())
    throw Error(path + ": refusing to write an invalid artifact: " + problems.front() +
                (problems.size() > 1 ? " (and " + std::to_string(problems.size() - 1) + " more problems)" : ""));
  write_file_atomically(path, [&](const std::string& tmp) {
    h5::File file = h5::File::create(tmp, path);
    const auto [major, minor] = h5::parse_version(artifact_format_version(a), path);
    h5::write_root_header(file, kArtifactFormat, major, minor, a.producer, a.created, a.command);
    file.set_attr("model_id", a.model_id);
    {
      h5::Group model = file.create_group("model");
      model.set_attr("n_layers", a.n_layers);
      model.set_attr("n_heads", a.n_heads);
      model.set_attr("n_kv_heads", a.n_kv_heads);
      model.set_attr("head_dim", a.head_dim);
      model.set_attr("rope_style", rope_style_name(a.rope_style));
      h5::write_fingerprint(model, a.fingerprint);
      h5::Group prov = file.create_group("provenance");
      prov.set_attr("data_sha256", a.provenance.data_sha256);
      prov.set_attr("tokens", a.provenance.tokens);
      prov.set_attr("sequences", a.provenance.sequences);
      prov.set_attr("seed", a.provenance.seed);
      prov.set_attr("stats_sha256", a.provenance.stats_sha256);
      prov.set_attr("source", a.provenance.source);
      write_recipe(file.create_group("recipe"), a.recipe);
      if (!a.layer_budgets.empty()) write_checked(file, "layer_budgets", {a.n_layers}, a.layer_budgets);
      h5::Group layers = file.create_group("layers");
      for (int l = 0; l < a.n_layers; ++l) {
        h5::Group layer = layers.create_group(std::to_string(l));
        for (int h = 0; h < a.n_kv_heads; ++h) {
          h5::Group head = layer.create_group("kv" + std::to_string(h));
          write_side(head.create_group("key"), a.head(l, h).key, a.head_dim);
          write_side(head.create_group("value"), a.head(l, h).value, a.head_dim);
        }
      }
    }
    h5::seal_attributes(file);
    file.close();
  });
}

namespace {
// Either container, told apart by the first bytes; a file that cannot be probed goes to the HDF5
// reader, whose errors name what is wrong (missing file, not HDF5, truncated).
Artifact read_any_container(const std::string& path, std::vector<std::string>* problems) {
  bool safetensors = false;
  try {
    safetensors = artifact_container(path) == ArtifactContainer::Safetensors;
  } catch (const Error&) {}
  return safetensors ? read_artifact_safetensors(path, problems) : read_artifact_impl(path, problems);
}
}  // namespace

Artifact read_artifact(const std::string& path) {
  Artifact a = read_any_container(path, nullptr);
  const std::vector<std::string> problems = verify_artifact(a);
  if (!problems.empty())
    throw Error(path + ": " + problems.front() +
                (problems.size() > 1 ? " (and " + std::to_string(problems.size() - 1) + " more problems)" : ""));
  return a;
}

std::vector<std::string> verify_artifact_file(const std::string& path, double tol) {
  std::vector<std::string> problems;
  Artifact a = read_any_container(path, &problems);
  for (std::string& p : verify_artifact(a, tol)) problems.push_back(path + ": " + p);
  return problems;
}

}  // namespace kvcc
