#include "zoo/zoo.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <algorithm>
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
  for (int64_t ctx : {4096, 32768, 131072}) eff[std::to_string(ctx)] = effective_bits(a.recipe, a.head_dim, ctx);
  return {{"nominal", nominal_bits(a.recipe)},
          {"history_key", history_bits(a.recipe, KvSide::Key, a.head_dim)},
          {"history_value", history_bits(a.recipe, KvSide::Value, a.head_dim)},
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
  return {{"id", e.id},
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
  } catch (const json::parse_error& ex) {
    throw Error(path.string() + " is not valid JSON (" + std::string(ex.what()) + ")");
  }
  KVCC_REQUIRE(j.is_object() && j.value("format", "") == kIndexFormat,
               path.string() + " is not a kvcc zoo index (format is not \"" + kIndexFormat + "\")");
  const int version = j.value("format_version", 0);
  KVCC_REQUIRE(version == kIndexVersion, path.string() + ": zoo index format_version " + std::to_string(version) +
                                             " is not supported (this kvcc reads " + std::to_string(kIndexVersion) +
                                             ")");
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
        sha256_hex(art_sha + "\n" + e.published + "\n" + e.notes + "\n" + e.validation.dump()).substr(0, 12);
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
  stage("index_written");

  // 5. Old files no entry refers to any more.
  std::set<std::string> referenced;
  for (const auto& k : kept)
    for (const auto& f : k.files) referenced.insert(f.path);
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
    for (const auto& f : e.files) {
      listed.insert(fs::path(f.path).lexically_normal().generic_string());
      const fs::path p = fs::path(zoo_dir) / f.path;
      ++report.files_checked;
      if (!fs::is_regular_file(p)) {
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
