#include "zoo/oscar_pt.h"

#include <algorithm>
#include <cmath>
#include <filesystem>

#include "formats/error.h"
#include "zoo/pickle.h"

namespace kvcc {
namespace {

int64_t layer_key(const PyValue& key, const std::string& path) {
  if (key.is(PyValue::Kind::Int)) return key.integer;
  if (key.is(PyValue::Kind::String) && !key.text.empty() &&
      std::all_of(key.text.begin(), key.text.end(), [](char c) { return c >= '0' && c <= '9'; }) &&
      key.text.size() < 10)
    return std::stoll(key.text);
  throw Error(path + ": layer key " + key.repr() + " is not a layer id");
}

const PyValue& field(const PyValue& dict, const char* name, PyValue::Kind kind, const std::string& where) {
  const PyValue* v = dict.get(name);
  KVCC_REQUIRE(v != nullptr, where + ": missing '" + name + "'");
  KVCC_REQUIRE(v->is(kind), where + ": '" + name + "' is a " + kind_name(v->kind) + ", expected " + kind_name(kind));
  return *v;
}

std::string shape_text(const std::vector<int64_t>& s) {
  std::string t = "[";
  for (size_t i = 0; i < s.size(); ++i) t += (i ? ", " : "") + std::to_string(s[i]);
  return t + "]";
}

}  // namespace

OscarRotationSet read_oscar_pt(const std::string& path) {
  const PyValue root = torch_load(path);
  KVCC_REQUIRE(root.is(PyValue::Kind::Dict),
               path + ": not an OSCAR rotation file (top level is a " + kind_name(root.kind) + ", expected a dict)");
  OscarRotationSet set;
  set.format_version = int(field(root, "format_version", PyValue::Kind::Int, path).integer);
  KVCC_REQUIRE(set.format_version == 1 || set.format_version == 2,
               path + ": OSCAR format_version " + std::to_string(set.format_version) + " is not supported (1 or 2)");
  if (const PyValue* o = root.get("objective")) {
    KVCC_REQUIRE(o->is(PyValue::Kind::String), path + ": 'objective' is not a string");
    set.objective = o->text;
  }
  if (const PyValue* g = root.get("source_grouping")) {
    KVCC_REQUIRE(g->is(PyValue::Kind::String), path + ": 'source_grouping' is not a string");
    set.source_grouping = g->text;
  }
  const PyValue& layers = field(root, "layers", PyValue::Kind::Dict, path);
  KVCC_REQUIRE(!layers.entries.empty(), path + ": 'layers' is empty");
  const size_t rot_dims = set.format_version == 1 ? 2 : 3;
  for (const auto& [key, entry] : layers.entries) {
    OscarLayer layer;
    layer.layer_id = layer_key(key, path);
    const std::string where = path + ": layer " + std::to_string(layer.layer_id);
    KVCC_REQUIRE(entry.is(PyValue::Kind::Dict), where + " is not a dict");
    if (const PyValue* id = entry.get("layer_id")) {
      KVCC_REQUIRE(id->is(PyValue::Kind::Int) && id->integer == layer.layer_id,
                   where + ": its layer_id field " + id->repr() + " differs from its key");
    }
    const PyTensor& rot = *field(entry, "rotation", PyValue::Kind::Tensor, where).tensor;
    KVCC_REQUIRE(rot.shape.size() == rot_dims,
                 where + ": rotation has shape " + shape_text(rot.shape) + ", expected " +
                     (rot_dims == 2 ? "[d, d] for format_version 1" : "[n_kv_heads, d, d] for format_version 2"));
    const int64_t d = rot.shape.back();
    const int64_t heads = rot_dims == 3 ? rot.shape[0] : 1;
    KVCC_REQUIRE(d > 0 && heads > 0 && rot.shape[rot_dims - 2] == d,
                 where + ": rotation " + shape_text(rot.shape) + " is not square");
    if (set.layers.empty()) {
      set.head_dim = int(d);
      set.heads = int(heads);
    }
    if (d != set.head_dim || heads != set.heads)
      throw Error(where + ": rotation " + shape_text(rot.shape) + " differs in shape from layer " +
                  std::to_string(set.layers.front().layer_id) + "'s");
    for (float x : rot.data) KVCC_REQUIRE(std::isfinite(x), where + ": rotation holds NaN or inf");
    layer.rotation = rot.data;
    if (const PyValue* ev = entry.get("eigenvalues"); ev != nullptr && !ev->is(PyValue::Kind::None)) {
      KVCC_REQUIRE(ev->is(PyValue::Kind::Tensor), where + ": eigenvalues is not a tensor");
      const std::vector<int64_t> want = rot_dims == 3 ? std::vector<int64_t>{heads, d} : std::vector<int64_t>{d};
      KVCC_REQUIRE(ev->tensor->shape == want, where + ": eigenvalues have shape " + shape_text(ev->tensor->shape) +
                                                  ", expected " + shape_text(want));
      for (float x : ev->tensor->data) KVCC_REQUIRE(std::isfinite(x), where + ": eigenvalues hold NaN or inf");
      layer.eigenvalues = ev->tensor->data;
    }
    set.layers.push_back(std::move(layer));
  }
  std::sort(set.layers.begin(), set.layers.end(),
            [](const OscarLayer& a, const OscarLayer& b) { return a.layer_id < b.layer_id; });
  for (size_t i = 1; i < set.layers.size(); ++i)
    KVCC_REQUIRE(set.layers[i].layer_id != set.layers[i - 1].layer_id,
                 path + ": layer " + std::to_string(set.layers[i].layer_id) + " appears twice");
  return set;
}

void write_oscar_pt(const OscarRotationSet& set, const std::string& path) {
  KVCC_REQUIRE(set.format_version == 1 || set.format_version == 2, "OSCAR format_version must be 1 or 2");
  KVCC_REQUIRE(
      set.format_version == 2 || set.heads == 1,
      "format_version 1 holds one rotation per layer; this set has " + std::to_string(set.heads) + " per layer");
  KVCC_REQUIRE(set.head_dim > 0 && !set.layers.empty(), "OSCAR rotation set is empty");
  const int64_t d = set.head_dim, h = set.heads;
  std::vector<std::pair<PyValue, PyValue>> layers;
  for (const auto& layer : set.layers) {
    KVCC_REQUIRE(layer.rotation.size() == size_t(h * d * d),
                 "layer " + std::to_string(layer.layer_id) + ": rotation size mismatch");
    PyTensor rot;
    rot.shape = set.format_version == 1 ? std::vector<int64_t>{d, d} : std::vector<int64_t>{h, d, d};
    rot.data = layer.rotation;
    std::vector<std::pair<PyValue, PyValue>> entry = {
        {PyValue::from_string("layer_id"), PyValue::from_int(layer.layer_id)},
        {PyValue::from_string("rotation"), PyValue::from_tensor(std::move(rot))}};
    if (!layer.eigenvalues.empty()) {
      KVCC_REQUIRE(layer.eigenvalues.size() == size_t(h * d),
                   "layer " + std::to_string(layer.layer_id) + ": eigenvalues size mismatch");
      PyTensor ev;
      ev.shape = set.format_version == 1 ? std::vector<int64_t>{d} : std::vector<int64_t>{h, d};
      ev.data = layer.eigenvalues;
      entry.emplace_back(PyValue::from_string("eigenvalues"), PyValue::from_tensor(std::move(ev)));
    }
    layers.emplace_back(PyValue::from_int(layer.layer_id), PyValue::dict(std::move(entry)));
  }
  const PyValue root = PyValue::dict({
      {PyValue::from_string("format_version"), PyValue::from_int(set.format_version)},
      {PyValue::from_string("objective"), PyValue::from_string(set.objective)},
      {PyValue::from_string("source_grouping"), PyValue::from_string(set.source_grouping)},
      {PyValue::from_string("layers"), PyValue::dict(std::move(layers))},
  });
  // torch.save names the archive folder after the file's stem.
  const std::string stem = std::filesystem::path(path).stem().string();
  torch_save(root, path, stem.empty() ? "archive" : stem);
}

}  // namespace kvcc
