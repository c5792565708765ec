#include "formats/artifact_safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <tuple>

#include "formats/atomic_file.h"
#include "formats/artifact_json.h"
#include "formats/error.h"
#include "formats/h5.h"
#include "formats/h5_common.h"
#include "formats/json_int.h"
#include "formats/safetensors.h"
#include "formats/sha256.h"

namespace kvcc {
namespace {

using json = nlohmann::json;
using ojson = nlohmann::ordered_json;

// Tensor bytes are written and read as the host's; the format is little-endian.
static_assert(std::endian::native == std::endian::little, "safetensors artifacts assume a little-endian host");

constexpr const char* kSides[] = {"key", "value"};

std::string tensor_prefix(int layer, int h, const char* side) {
  return "layers." + std::to_string(layer) + ".kv" + std::to_string(h) + "." + side + ".";
}

// One tensor to write: its safetensors dtype, shape and little-endian bytes.
struct OutTensor {
  std::string name;
  const char* dtype;
  std::vector<int64_t> shape;
  std::string bytes;
};

OutTensor f64_tensor(std::string name, std::vector<int64_t> shape, const std::vector<double>& v) {
  return {std::move(name), "F64", std::move(shape),
          std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(double))};
}

ojson fingerprint_json(const ModelFingerprint& fp) {
  ojson fields = ojson::array();
  for (const auto& [name, value] : fp.fields) fields.push_back({name, value});
  return ojson{{"id", fp.id}, {"weights_sha256", fp.weights_sha256}, {"fields", fields}};
}

// The header JSON of a safetensors file, after read_safetensors has checked its structure.
json parse_header(const MappedFile& file) {
  const std::string& path = file.path();
  KVCC_REQUIRE(file.size() >= 8, path + ": truncated safetensors file (shorter than the 8-byte header length)");
  uint64_t len = 0;
  std::memcpy(&len, file.data(), 8);
  KVCC_REQUIRE(len <= file.size() - 8, path + ": safetensors header length " + std::to_string(len) +
                                           " exceeds the file size " + std::to_string(file.size()));
  try {
    return json::parse(file.data() + 8, file.data() + 8 + len);
  } catch (const json::exception& e) {
    throw Error(path + ": safetensors header is not valid JSON (" + e.what() + ")");
  }
}

// The artifact's JSON document from a parsed header; a clear Error when the file is some other
// safetensors file (a model's weights, say).
json artifact_document(const json& header, const std::string& path, bool* has_checksum = nullptr) {
  const auto meta = header.find("__metadata__");
  if (meta == header.end() || !meta->is_object() || !meta->contains(kArtifactMetadataKey))
    throw Error(path + ": a safetensors file but not a kvcc artifact (its __metadata__ has no \"" +
                kArtifactMetadataKey + "\" entry; model weights?)");
  const json& text = meta->at(kArtifactMetadataKey);
  KVCC_REQUIRE(text.is_string(), path + ": __metadata__." + kArtifactMetadataKey + " is not a string");
  json doc;
  try {
    doc = json::parse(text.get<std::string>());
  } catch (const json::exception& e) {
    throw Error(path + ": __metadata__." + kArtifactMetadataKey + " is not valid JSON (" + e.what() + ")");
  }
  KVCC_REQUIRE(doc.is_object(), path + ": __metadata__." + kArtifactMetadataKey + " is not a JSON object");
  const auto sum = meta->find(kArtifactChecksumKey);
  if (has_checksum) *has_checksum = sum != meta->end();
  if (sum != meta->end())
    KVCC_REQUIRE(sum->is_string() && sum->get<std::string>() == sha256_hex(text.get<std::string>()),
                 path + ": __metadata__." + kArtifactMetadataKey + " edited or corrupt (" + kArtifactChecksumKey +
                     " does not match)");
  return doc;
}

// Typed, checked access to the JSON document; errors name the file and the key path.
class Doc {
 public:
  Doc(const json& j, std::string path, std::string at) : j_(j), path_(std::move(path)), at_(std::move(at)) {}
  Doc child(const std::string& key) const {
    const json& v = get(key);
    if (!v.is_object()) fail(key, "is not an object");
    return Doc(v, path_, where(key));
  }
  const json& get(const std::string& key) const {
    const auto it = j_.find(key);
    if (it == j_.end()) throw Error(path_ + ": the artifact's JSON document lacks \"" + where(key) + "\"");
    return *it;
  }
  std::string str(const std::string& key) const {
    const json& v = get(key);
    if (!v.is_string()) fail(key, "is not a string");
    return v.get<std::string>();
  }
  int int32(const std::string& key, int64_t lo = std::numeric_limits<int32_t>::min()) const {
    return json_int32(get(key), path_ + ": \"" + where(key) + "\"", lo);
  }
  uint64_t uint(const std::string& key) const {
    const json& v = get(key);
    if (!v.is_number_unsigned() && !(v.is_number_integer() && v.get<int64_t>() >= 0))
      fail(key, "is not a non-negative integer");
    return v.get<uint64_t>();
  }
  double real(const std::string& key) const {
    const json& v = get(key);
    if (!v.is_number()) fail(key, "is not a number");
    return v.get<double>();
  }
  [[noreturn]] void fail(const std::string& key, const std::string& what) const {
    throw Error(path_ + ": \"" + where(key) + "\" in the artifact's JSON document " + what);
  }

 private:
  std::string where(const std::string& key) const { return at_.empty() ? key : at_ + "." + key; }
  const json& j_;
  std::string path_, at_;
};

// Reads a decimal index without sign or leading zeros (so each slot has one name) at s[pos...].
bool parse_index(const std::string& s, size_t& pos, int& out) {
  const size_t start = pos;
  int64_t v = 0;
  while (pos < s.size() && s[pos] >= '0' && s[pos] <= '9') {
    v = v * 10 + (s[pos] - '0');
    if (v > std::numeric_limits<int32_t>::max()) return false;
    ++pos;
  }
  if (pos == start || (s[start] == '0' && pos - start > 1)) return false;
  out = int(v);
  return true;
}

bool consume(const std::string& s, size_t& pos, const char* lit) {
  const size_t n = std::strlen(lit);
  if (s.compare(pos, n, lit) != 0) return false;
  pos += n;
  return true;
}

// "layers.L.kvH.SIDE.FIELD[.EXTRA]" split into its parts; false when the name has another form.
struct SlotName {
  int layer = 0, head = 0;
  bool value = false;
  std::string field, extra;
};
bool parse_slot_name(const std::string& name, SlotName& out) {
  size_t pos = 0;
  if (!consume(name, pos, "layers.") || !parse_index(name, pos, out.layer) || !consume(name, pos, ".kv") ||
      !parse_index(name, pos, out.head) || !consume(name, pos, "."))
    return false;
  if (consume(name, pos, "key.")) out.value = false;
  else if (consume(name, pos, "value.")) out.value = true;
  else return false;
  const std::string rest = name.substr(pos);
  if (rest == "rotation" || rest == "eigenvalues" || rest == "levels") {
    out.field = rest;
    return true;
  }
  if (rest.rfind("extras.", 0) == 0 && rest.size() > 7) {
    out.field = "extras";
    out.extra = rest.substr(7);
    return true;
  }
  return false;
}

std::string shape_text(const std::vector<int64_t>& s) { return h5::shape_string(s); }

std::vector<double> f64_values(const TensorView& t) {
  std::vector<double> v(size_t(t.numel()));
  if (!v.empty()) std::memcpy(v.data(), t.data, t.nbytes);
  return v;
}

}  // namespace

const char* artifact_container_name(ArtifactContainer c) {
  switch (c) {
    case ArtifactContainer::Hdf5:
      return "hdf5";
    case ArtifactContainer::Safetensors:
      return "safetensors";
    default:
      return "unknown";
  }
}

ArtifactContainer artifact_container(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  // The HDF5 readers' wording for a missing file, so every command says it the same way.
  KVCC_REQUIRE(fd >= 0 || errno != ENOENT, path + ": no such file");
  KVCC_REQUIRE(fd >= 0, path + ": cannot open (" + std::strerror(errno) + ")");
  struct stat st {};
  unsigned char head[9] = {};
  ssize_t got = 0;
  const bool regular = ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode);
  if (regular) {
    while (got < ssize_t(sizeof head)) {
      const ssize_t n = ::read(fd, head + got, sizeof head - size_t(got));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      got += n;
    }
  }
  ::close(fd);
  KVCC_REQUIRE(regular, path + ": not a regular file");
  static const unsigned char kHdf5[8] = {0x89, 'H', 'D', 'F', '\r', '\n', 0x1a, '\n'};
  if (got >= 8 && std::memcmp(head, kHdf5, 8) == 0) return ArtifactContainer::Hdf5;
  // The header length is not checked here: a wrong one is the safetensors reader's to report.
  if (got == 9 && head[8] == '{') return ArtifactContainer::Safetensors;
  return ArtifactContainer::Unknown;
}

void write_artifact_safetensors(const Artifact& a, const std::string& path) {
  const std::vector<std::string> problems = verify_artifact(a);
  if (!problems.empty())
    throw Error(path + ": refusing to write an invalid artifact: " + problems.front() +
                (problems.size() > 1 ? " (and " + std::to_string(problems.size() - 1) + " more problems)" : ""));

  // Tensors in a fixed order: clip ratios, then per layer, KV head and side its arrays.
  std::vector<OutTensor> tensors;
  for (const char* side : kSides) {
    std::vector<double> clip;
    for (const HeadArtifact& h : a.heads) clip.push_back(side[0] == 'k' ? h.key.clip_ratio : h.value.clip_ratio);
    tensors.push_back(f64_tensor(std::string("clip_ratio.") + side, {a.n_layers, a.n_kv_heads}, clip));
  }
  // Per-side widths (compile --bits-budget), only when some side has one: 0 = the recipe's bits.
  if (std::any_of(a.heads.begin(), a.heads.end(), [](const HeadArtifact& h) { return h.key.bits || h.value.bits; }))
    for (const char* side : kSides) {
      std::vector<double> bits;
      for (const HeadArtifact& h : a.heads) bits.push_back(side[0] == 'k' ? h.key.bits : h.value.bits);
      tensors.push_back(f64_tensor(std::string("bits.") + side, {a.n_layers, a.n_kv_heads}, bits));
    }
  if (!a.layer_budgets.empty()) tensors.push_back(f64_tensor("layer_budgets", {a.n_layers}, a.layer_budgets));
  const int64_t d = a.head_dim;
  for (int l = 0; l < a.n_layers; ++l)
    for (int h = 0; h < a.n_kv_heads; ++h)
      for (const char* side : kSides) {
        const SideArtifact& s = side[0] == 'k' ? a.head(l, h).key : a.head(l, h).value;
        const std::string p = tensor_prefix(l, h, side);
        if (!s.rotation.empty()) tensors.push_back(f64_tensor(p + "rotation", {d, d}, s.rotation));
        if (!s.eigenvalues.empty()) tensors.push_back(f64_tensor(p + "eigenvalues", {d}, s.eigenvalues));
        if (!s.levels.empty()) tensors.push_back(f64_tensor(p + "levels", {int64_t(s.levels.size())}, s.levels));
        for (const NamedArray& x : s.extras) {
          if (!x.integer) {
            tensors.push_back(f64_tensor(p + "extras." + x.name, x.shape, x.data));
            continue;
          }
          std::vector<int64_t> ints(x.data.size());
          for (size_t i = 0; i < ints.size(); ++i) ints[i] = int64_t(std::llround(x.data[i]));
          tensors.push_back({p + "extras." + x.name, "I64", x.shape,
                             std::string(reinterpret_cast<const char*>(ints.data()), ints.size() * 8)});
        }
      }

  ojson doc;
  doc["format"] = kArtifactFormat;
  doc["format_version"] = artifact_format_version(a);
  doc["producer"] = a.producer.empty() ? h5::default_producer() : a.producer;
  doc["created"] = a.created.empty() ? h5::utc_now_iso8601() : a.created;
  doc["command"] = a.command;
  doc["model_id"] = a.model_id;
  doc["model"] = ojson{{"n_layers", a.n_layers},
                       {"n_heads", a.n_heads},
                       {"n_kv_heads", a.n_kv_heads},
                       {"head_dim", a.head_dim},
                       {"rope_style", rope_style_name(a.rope_style)},
                       {"fingerprint", fingerprint_json(a.fingerprint)}};
  doc["provenance"] = ojson{{"data_sha256", a.provenance.data_sha256},   {"tokens", a.provenance.tokens},
                            {"sequences", a.provenance.sequences},       {"seed", a.provenance.seed},
                            {"stats_sha256", a.provenance.stats_sha256}, {"source", a.provenance.source}};
  const Recipe& r = a.recipe;
  doc["recipe"] = recipe_json<ojson>(r);
  ojson listed = ojson::array();
  for (const OutTensor& t : tensors)
    listed.push_back(ojson{{"name", t.name}, {"sha256", sha256_hex(t.bytes.data(), t.bytes.size())}});
  doc["tensors"] = listed;

  ojson header = ojson::object();
  std::string text;
  try {
    const std::string doc_text = doc.dump();
    header["__metadata__"] = ojson{{kArtifactMetadataKey, doc_text}, {kArtifactChecksumKey, sha256_hex(doc_text)}};
    uint64_t offset = 0;
    for (const OutTensor& t : tensors) {
      header[t.name] =
          ojson{{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + t.bytes.size()}}};
      offset += t.bytes.size();
    }
    text = header.dump();
  } catch (const ojson::exception& e) {
    // JSON holds UTF-8 only; a string attribute that is not (a command line, say) cannot go there.
    throw Error(path + ": cannot write the artifact as safetensors: " + e.what());
  }
  text.append((8 - text.size() % 8) % 8, ' ');  // data starts 8-byte aligned (the format allows space padding)
  write_file_atomically(path, [&](const std::string& tmp) {
    std::ofstream out(tmp, std::ios::binary);
    KVCC_REQUIRE(bool(out), "cannot write '" + tmp + "'");
    const uint64_t n = text.size();
    out.write(reinterpret_cast<const char*>(&n), 8);
    out.write(text.data(), std::streamsize(text.size()));
    for (const OutTensor& t : tensors) out.write(t.bytes.data(), std::streamsize(t.bytes.size()));
    out.close();
    KVCC_REQUIRE(bool(out), "write failed: '" + tmp + "'");
  });
}

Artifact read_artifact_safetensors(const std::string& path, std::vector<std::string>* problems) {
  // The container first: every tensor's extent is checked against the file here.
  const std::map<std::string, TensorView> tensors = read_safetensors(path);
  const std::shared_ptr<const MappedFile> file =
      tensors.empty() ? MappedFile::open(path) : tensors.begin()->second.file;
  const json header = parse_header(*file);
  bool has_checksum = false;
  const json doc_json = artifact_document(header, path, &has_checksum);
  const Doc doc(doc_json, path, "");

  Artifact a;
  const std::string format = doc.str("format");
  KVCC_REQUIRE(format == kArtifactFormat, path + ": is a " + format + " document, expected " + kArtifactFormat);
  a.format_version = doc.str("format_version");
  const auto [major, minor] = h5::parse_version(a.format_version, path);
  // A newer minor is read: tensors it adds (listed and checksummed, names this reader does not
  // know) are skipped; for this minor or an older one an unknown name is an error.
  const bool newer_minor = major == kArtifactMajor ? minor > kArtifactMinor : minor > kArtifactWidthsMinor;
  KVCC_REQUIRE(major >= kArtifactMajor && major <= kArtifactWidthsMajor,
               path + ": " + kArtifactFormat + " format_version " + a.format_version +
                   " is not supported (this kvcc reads " + std::to_string(kArtifactMajor) + ".x and " +
                   std::to_string(kArtifactWidthsMajor) + ".x)");
  KVCC_REQUIRE(
      has_checksum || !h5::has_attribute_checksums(major, minor),
      path + ": __metadata__." + kArtifactMetadataKey + " carries no checksum (" + kArtifactChecksumKey + " missing)");
  a.producer = doc.str("producer");
  a.created = doc.str("created");
  a.command = doc.str("command");
  a.model_id = doc.str("model_id");
  {
    const Doc model = doc.child("model");
    a.n_layers = model.int32("n_layers", 1);
    a.n_heads = model.int32("n_heads", 1);
    a.n_kv_heads = model.int32("n_kv_heads", 1);
    a.head_dim = model.int32("head_dim", 1);
    try {
      a.rope_style = rope_style_from_name(model.str("rope_style"));
    } catch (const Error& e) {
      throw Error(path + ": model: " + e.what());
    }
    const Doc fp = model.child("fingerprint");
    a.fingerprint.id = fp.str("id");
    a.fingerprint.weights_sha256 = fp.str("weights_sha256");
    const json& fields = fp.get("fields");
    if (!fields.is_array()) fp.fail("fields", "is not an array");
    for (const json& f : fields) {
      if (!f.is_array() || f.size() != 2 || !f[0].is_string() || !f[1].is_string())
        fp.fail("fields", "holds an entry that is not a [name, value] pair of strings");
      a.fingerprint.fields.emplace_back(f[0].get<std::string>(), f[1].get<std::string>());
    }
    KVCC_REQUIRE(fingerprint_id(a.fingerprint.fields, a.fingerprint.weights_sha256) == a.fingerprint.id,
                 path + ": model.fingerprint: fingerprint id does not match its fields (edited or corrupt)");
  }
  {
    const Doc p = doc.child("provenance");
    a.provenance.data_sha256 = p.str("data_sha256");
    a.provenance.tokens = p.uint("tokens");
    a.provenance.sequences = p.uint("sequences");
    a.provenance.seed = p.uint("seed");
    a.provenance.stats_sha256 = p.str("stats_sha256");
    a.provenance.source = p.str("source");
  }
  {
    const Doc r = doc.child("recipe");
    Recipe& out = a.recipe;
    out.method = r.str("method");
    out.key_bits = r.real("key_bits");
    out.value_bits = r.real("value_bits");
    out.group = r.int32("group");
    out.sink = r.int32("sink");
    out.recent = r.int32("recent");
    out.page_size = r.int32("page_size");
    out.value_target = r.str("value_target");
    out.granularity = r.str("granularity");
    out.composition = r.str("composition");
    out.seed = r.uint("seed");
    const Doc params = r.child("params");
    for (const auto& [key, value] : r.get("params").items()) out.params[key] = params.str(key);
  }

  // The tensor list: order (extras keep theirs) and checksums; it must name every tensor once.
  const json& listed = doc.get("tensors");
  if (!listed.is_array()) doc.fail("tensors", "is not an array");
  KVCC_REQUIRE(listed.size() == tensors.size(), path + ": the JSON document lists " + std::to_string(listed.size()) +
                                                    " tensors, the file holds " + std::to_string(tensors.size()));
  std::vector<std::pair<const TensorView*, std::string>> order;  // view, listed sha256
  std::set<std::string> seen;
  for (const json& t : listed) {
    if (!t.is_object() || !t.contains("name") || !t["name"].is_string() || !t.contains("sha256") ||
        !t["sha256"].is_string())
      doc.fail("tensors", "holds an entry without a string name and sha256");
    const std::string name = t["name"].get<std::string>();
    const auto it = tensors.find(name);
    KVCC_REQUIRE(it != tensors.end(), path + ": tensor '" + name + "' is listed but not in the file");
    KVCC_REQUIRE(seen.insert(name).second, path + ": tensor '" + name + "' is listed twice");
    order.emplace_back(&it->second, t["sha256"].get<std::string>());
  }
  // The data section is exactly the tensors' bytes, with neither holes nor overlaps (as the
  // safetensors format requires): nothing hides in a kvcc artifact beside what it lists.
  {
    std::vector<std::tuple<uint64_t, uint64_t, std::string>> spans;
    for (auto it = header.begin(); it != header.end(); ++it) {
      if (it.key() == "__metadata__") continue;
      const json& off = it.value()["data_offsets"];  // validated by read_safetensors
      spans.emplace_back(off[0].get<uint64_t>(), off[1].get<uint64_t>(), it.key());
    }
    std::sort(spans.begin(), spans.end());
    uint64_t len = 0;
    std::memcpy(&len, file->data(), 8);
    uint64_t at = 0;
    for (const auto& [begin, end, name] : spans) {
      KVCC_REQUIRE(begin == at, path + ": tensor '" + name + "' starts at data byte " + std::to_string(begin) +
                                    ", expected " + std::to_string(at) + " (overlapping tensors or a hole)");
      at = end;
    }
    KVCC_REQUIRE(at == file->size() - 8 - len, path + ": " + std::to_string(file->size() - 8 - len - at) +
                                                   " data bytes after the last tensor (corrupt or appended to)");
  }

  auto checksum = [&](const TensorView& t, const std::string& want) {
    if (sha256_hex(t.data, t.nbytes) == want) return;
    const std::string msg = path + ": checksum mismatch in tensor " + t.name;
    if (!problems) throw Error(msg);
    problems->push_back(msg);
  };
  auto expect = [&](const TensorView& t, TensorDType dtype, const std::vector<int64_t>& shape, const std::string& why) {
    KVCC_REQUIRE(t.dtype == dtype, path + ": tensor '" + t.name + "' has dtype " + tensor_dtype_name(t.dtype) +
                                       ", expected " + tensor_dtype_name(dtype));
    KVCC_REQUIRE(t.shape == shape, path + ": tensor '" + t.name + "' has shape " + shape_text(t.shape) + ", expected " +
                                       shape_text(shape) + " (" + why + ")");
  };

  // Clip ratios first: their shape [n_layers, n_kv_heads] is bounded by the file's size, which
  // bounds the head table allocated from the (untrusted) counts.
  const std::vector<int64_t> grid{a.n_layers, a.n_kv_heads};
  std::vector<double> clip[2];
  for (int s = 0; s < 2; ++s) {
    const std::string name = std::string("clip_ratio.") + kSides[s];
    const auto it = tensors.find(name);
    KVCC_REQUIRE(it != tensors.end(), path + ": missing tensor '" + name + "'");
    expect(it->second, TensorDType::F64, grid, "n_layers x n_kv_heads of the model");
    clip[s] = f64_values(it->second);
  }
  a.heads.resize(size_t(a.n_layers) * size_t(a.n_kv_heads));
  for (size_t i = 0; i < a.heads.size(); ++i) {
    a.heads[i].key.clip_ratio = clip[0][i];
    a.heads[i].value.clip_ratio = clip[1][i];
  }
  for (int s = 0; s < 2; ++s) {  // per-side widths, when written
    const auto it = tensors.find(std::string("bits.") + kSides[s]);
    if (it == tensors.end()) continue;
    expect(it->second, TensorDType::F64, grid, "n_layers x n_kv_heads of the model");
    const std::vector<double> bits = f64_values(it->second);
    for (size_t i = 0; i < a.heads.size(); ++i) (s ? a.heads[i].value : a.heads[i].key).bits = bits[i];
  }

  const int64_t d = a.head_dim;
  for (const auto& [view, sha] : order) {
    const TensorView& t = *view;
    checksum(t, sha);
    if (t.name == "clip_ratio.key" || t.name == "clip_ratio.value" || t.name == "bits.key" || t.name == "bits.value")
      continue;
    if (t.name == "layer_budgets") {
      expect(t, TensorDType::F64, {a.n_layers}, "n_layers of the model");
      a.layer_budgets = f64_values(t);
      continue;
    }
    SlotName slot;
    if (!parse_slot_name(t.name, slot)) {
      if (newer_minor) continue;
      throw Error(path + ": tensor '" + t.name + "' is not a kvcc artifact tensor name");
    }
    KVCC_REQUIRE(slot.layer < a.n_layers && slot.head < a.n_kv_heads,
                 path + ": tensor '" + t.name + "' lies outside the model's " + std::to_string(a.n_layers) +
                     " layers x " + std::to_string(a.n_kv_heads) + " KV heads");
    SideArtifact& side = slot.value ? a.head(slot.layer, slot.head).value : a.head(slot.layer, slot.head).key;
    if (slot.field == "rotation") {
      expect(t, TensorDType::F64, {d, d}, "head_dim x head_dim");
      side.rotation = f64_values(t);
    } else if (slot.field == "eigenvalues") {
      expect(t, TensorDType::F64, {d}, "head_dim");
      side.eigenvalues = f64_values(t);
    } else if (slot.field == "levels") {
      KVCC_REQUIRE(t.shape.size() == 1, path + ": tensor '" + t.name + "' must be one-dimensional");
      expect(t, TensorDType::F64, t.shape, "");
      side.levels = f64_values(t);
    } else {
      NamedArray x;
      x.name = slot.extra;
      x.shape = t.shape;
      if (t.dtype == TensorDType::I64) {
        x.integer = true;
        std::vector<int64_t> ints(size_t(t.numel()));
        if (!ints.empty()) std::memcpy(ints.data(), t.data, t.nbytes);
        x.data.assign(ints.begin(), ints.end());
      } else {
        KVCC_REQUIRE(t.dtype == TensorDType::F64, path + ": tensor '" + t.name + "' has dtype " +
                                                      tensor_dtype_name(t.dtype) + ", expected F64 or I64");
        x.data = f64_values(t);
      }
      side.extras.push_back(std::move(x));
    }
  }
  check_artifact_version_holds(a, path);
  return a;
}

std::string detect_kvcc_format(const std::string& path) {
  if (artifact_container(path) != ArtifactContainer::Safetensors) return h5::detect_format(path);
  const std::shared_ptr<const MappedFile> file = MappedFile::open(path);
  const json header = parse_header(*file);
  KVCC_REQUIRE(header.is_object(), path + ": safetensors header is not a JSON object");
  const json doc = artifact_document(header, path);
  const auto it = doc.find("format");
  KVCC_REQUIRE(it != doc.end() && it->is_string(),
               path + ": __metadata__." + kArtifactMetadataKey + " has no string \"format\"");
  return it->get<std::string>();
}

}  // namespace kvcc
