// Artifacts as safetensors (formats/artifact_safetensors.h): HDF5 -> safetensors -> HDF5 gives
// back every attribute and every dataset bit for bit (compared by walking both HDF5 files, not
// through the artifact reader), for every published zoo artifact and a fresh artifact of every
// method; a Runtime loaded from either file decodes bit-identically; the file is readable as
// plain safetensors; and corrupt, truncated, foreign or inconsistent files are refused with an
// Error (mutants are read in a forked child under a time and memory limit).
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <random>

#include "compile/compile.h"
#include "compile/synthetic_stats.h"
#include "compile_test_util.h"
#include "formats/artifact.h"
#include "formats/artifact_safetensors.h"
#include "formats/error.h"
#include "formats/h5.h"
#include "formats/method.h"
#include "formats/safetensors.h"
#include "formats/safetensors_writer.h"
#include "formats/sha256.h"
#include "formats_test_util.h"
#include "runtime/kvcc_runtime.h"

namespace kvcc {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using testing::error_of;
using testing::read_bytes;
using testing::ScratchDir;
using testing::write_bytes;

// An attribute as text, tagged with the first typed getter that accepts it, so that two files
// compare equal only when every attribute has the same type class and value.
std::string attr_repr(const h5::Object& o, const std::string& name) {
  try {
    return "s:" + o.attr_string(name);
  } catch (const Error&) {}
  try {
    return "i:" + std::to_string(o.attr_int(name));
  } catch (const Error&) {}
  try {
    return "u:" + std::to_string(o.attr_uint(name));
  } catch (const Error&) {}
  const double v = o.attr_double(name);
  return "d:" + std::string(reinterpret_cast<const char*>(&v), sizeof v);
}

// Every group, dataset and attribute of `g` as path -> content (dataset bytes with dtype and shape).
void walk(const h5::Group& g, std::map<std::string, std::string>& out) {
  for (const std::string& a : g.attr_names()) out[g.path() + "@" + a] = attr_repr(g, a);
  for (const std::string& name : g.children()) {
    try {
      walk(g.group(name), out);
      continue;
    } catch (const Error&) {}
    const h5::Dataset ds = g.dataset(name);
    for (const std::string& a : ds.attr_names()) out[ds.path() + "@" + a] = attr_repr(ds, a);
    std::string content = std::string(h5::dtype_name(ds.dtype())) + h5::shape_string(ds.shape()) + ":";
    if (ds.dtype() == h5::DType::Int64) {
      const auto v = g.read<int64_t>(name);
      content.append(reinterpret_cast<const char*>(v.data()), v.size() * 8);
    } else {
      const auto v = g.read<double>(name);
      content.append(reinterpret_cast<const char*>(v.data()), v.size() * 8);
    }
    out[ds.path()] = content;
  }
}

std::map<std::string, std::string> hdf5_contents(const std::string& path) {
  std::map<std::string, std::string> out;
  walk(h5::File::open(path), out);
  return out;
}

// The first key whose content differs between two walks, or "".
std::string first_difference(const std::map<std::string, std::string>& a, const std::map<std::string, std::string>& b) {
  for (const auto& [k, v] : a) {
    const auto it = b.find(k);
    if (it == b.end()) return k + " (missing in the second)";
    if (it->second != v) return k;
  }
  for (const auto& [k, v] : b)
    if (!a.count(k)) return k + " (missing in the first)";
  return "";
}

// HDF5 -> safetensors -> HDF5, checked at each step.
void check_round_trip(const std::string& h5_path, const ScratchDir& dir, const std::string& tag) {
  const std::string st = dir.file(tag + ".safetensors"), back = dir.file(tag + ".back.kvcc.h5");
  const Artifact original = read_artifact(h5_path);
  write_artifact_safetensors(original, st);
  EXPECT_EQ(artifact_container(st), ArtifactContainer::Safetensors);
  const Artifact from_st = read_artifact(st);
  EXPECT_EQ(artifact_difference(original, from_st), "") << tag;
  EXPECT_TRUE(verify_artifact_file(st).empty()) << tag;
  write_artifact(from_st, back);
  auto before = hdf5_contents(h5_path), after = hdf5_contents(back);
  EXPECT_GT(before.size(), 20u);
  // The writer writes its own format version for the content (1.1: attribute checksums, which
  // attr_names hides).
  EXPECT_EQ(after["/@format_version"], "s:" + artifact_format_version(original));
  before.erase("/@format_version");
  after.erase("/@format_version");
  EXPECT_EQ(first_difference(before, after), "") << tag;

  // Each tensor's listed sha256 is the one the HDF5 dataset carries (the same bytes).
  const auto tensors = read_safetensors(st);
  const h5::File file = h5::File::open(h5_path);
  size_t compared = 0;
  for (const auto& [name, view] : tensors) {
    if (name.rfind("layers.", 0) != 0) continue;
    std::string p = "/" + name;
    std::replace(p.begin(), p.end(), '.', '/');
    const size_t extras = p.find("/extras/");  // extra names may contain '.'
    if (extras != std::string::npos) p = p.substr(0, extras + 8) + name.substr(name.find(".extras.") + 8);
    const std::string dir_part = p.substr(0, p.rfind('/')), leaf = p.substr(p.rfind('/') + 1);
    h5::Group g = file;
    size_t start = 1;
    while (start < dir_part.size()) {
      const size_t slash = std::min(dir_part.find('/', start), dir_part.size());
      g = g.group(dir_part.substr(start, slash - start));
      start = slash + 1;
    }
    EXPECT_EQ(sha256_hex(view.data, view.nbytes), g.dataset(leaf).attr_string("sha256")) << name;
    ++compared;
  }
  EXPECT_GT(compared, 0u);
}

TEST(ArtifactSafetensors, PublishedArtifactsRoundTripBitForBit) {
  ScratchDir dir;
  const std::vector<std::string> paths = testing::published_artifacts();
  ASSERT_GE(paths.size(), 6u);
  for (const std::string& p : paths)
    check_round_trip(p, dir,
                     fs::path(p).parent_path().filename().string() + "-" +
                         fs::path(p).parent_path().parent_path().filename().string());
}

TEST(ArtifactSafetensors, FreshArtifactOfEveryMethodRoundTrips) {
  ScratchDir dir;
  const Stats stats = test::make_small_stats(2, 16);
  for (Method m : all_methods()) {
    CompileOptions o;
    o.method = method_name(m);
    o.max_fit_rows = 64;
    if (m == Method::Kivi) o.group = 16;  // its token groups must fit the 48-token documents
    Artifact art;
    try {
      art = compile_artifact(stats, o);
    } catch (const Error& e) {
      ADD_FAILURE() << o.method << ": " << e.what();
      continue;
    }
    const std::string h5_path = dir.file(o.method + ".kvcc.h5");
    write_artifact(art, h5_path);
    check_round_trip(h5_path, dir, o.method);
  }
}

// Arrays a compiled artifact may not have: extras of both dtypes with dots in their names, an
// empty rotation, level tables; a -0.0 and denormal survive bit for bit.
TEST(ArtifactSafetensors, UnusualContentRoundTrips) {
  ScratchDir dir;
  const ModelConfig c = testing::small_config();
  Artifact a = testing::random_artifact(c, testing::small_fingerprint(c), 3);
  a.head(0, 0).key.extras.push_back({"z.first", {2, 3}, {1, 2, 3, 4, 5, -0.0}, false});
  a.head(0, 0).key.extras.push_back({"a.second", {4}, {-7, 0, 9007199254740991.0, 3}, true});
  a.head(1, 1).value.levels = {-1.5, -0.5, 4.9e-324, 0.5};
  a.head(2, 0).value.rotation.clear();
  a.head(2, 0).value.eigenvalues.clear();
  a.recipe.params["note"] = "x=1, \"quoted\"";
  a.provenance.seed = 18446744073709551615ull;
  ASSERT_TRUE(verify_artifact(a).empty()) << verify_artifact(a)[0];
  const std::string h5_path = dir.file("u.kvcc.h5");
  write_artifact(a, h5_path);
  check_round_trip(h5_path, dir, "unusual");
  const Artifact back = read_artifact(dir.file("unusual.safetensors"));
  ASSERT_EQ(back.head(0, 0).key.extras.size(), 2u);
  EXPECT_EQ(back.head(0, 0).key.extras[0].name, "z.first");  // listed order, not name order
  EXPECT_TRUE(std::signbit(back.head(0, 0).key.extras[0].data[5]));
  EXPECT_TRUE(back.head(2, 0).value.rotation.empty());
}

// Engines read it as a plain safetensors file: F64 tensors under documented names, the JSON
// document in __metadata__ (checked here with the generic reader and nlohmann, not kvcc's).
TEST(ArtifactSafetensors, LayoutIsPlainSafetensors) {
  ScratchDir dir;
  const ModelConfig c = testing::small_config();
  const Artifact a = testing::random_artifact(c, testing::small_fingerprint(c), 4);
  const std::string st = dir.file("a.safetensors");
  write_artifact_safetensors(a, st);
  const auto tensors = read_safetensors(st);
  const TensorView& rot = tensors.at("layers.2.kv1.value.rotation");
  EXPECT_EQ(rot.dtype, TensorDType::F64);
  EXPECT_EQ(rot.shape, (std::vector<int64_t>{8, 8}));
  std::vector<double> r(64);
  std::memcpy(r.data(), rot.data, 64 * 8);
  EXPECT_EQ(r, a.head(2, 1).value.rotation);
  const TensorView& clip = tensors.at("clip_ratio.value");
  EXPECT_EQ(clip.shape, (std::vector<int64_t>{3, 2}));
  double c21 = 0;
  std::memcpy(&c21, clip.data + 8 * (2 * 2 + 1), 8);
  EXPECT_EQ(c21, a.head(2, 1).value.clip_ratio);

  const std::string bytes = read_bytes(st);
  uint64_t len = 0;
  std::memcpy(&len, bytes.data(), 8);
  EXPECT_EQ((8 + len) % 8, 0u);  // data aligned for engines that map it
  const json header = json::parse(bytes.substr(8, len));
  const json doc = json::parse(header["__metadata__"][kArtifactMetadataKey].get<std::string>());
  EXPECT_EQ(doc["format"], "kvcc-artifact");
  EXPECT_EQ(doc["format_version"], artifact_format_version(a));
  EXPECT_EQ(doc["recipe"]["method"], a.recipe.method);
  EXPECT_EQ(doc["model"]["head_dim"], 8);
  EXPECT_EQ(doc["tensors"].size(), tensors.size());
  EXPECT_EQ(detect_kvcc_format(st), kArtifactFormat);
}

// Rewrites a safetensors file's header (and the JSON document inside it) through `edit`,
// keeping the data section; the document re-signed (its sha256 updated) unless `sign` is false.
void rewrite(const std::string& src, const std::string& dst, const std::function<void(json& header, json& doc)>& edit,
             const std::string& append = "", bool sign = true) {
  const std::string bytes = read_bytes(src);
  uint64_t len = 0;
  std::memcpy(&len, bytes.data(), 8);
  json header = json::parse(bytes.substr(8, len));
  json doc = json::parse(header["__metadata__"][kArtifactMetadataKey].get<std::string>());
  edit(header, doc);
  if (!doc.is_null()) {
    header["__metadata__"][kArtifactMetadataKey] = doc.dump();
    if (sign && header["__metadata__"].contains(kArtifactChecksumKey))
      header["__metadata__"][kArtifactChecksumKey] = sha256_hex(doc.dump());
  }
  const std::string text = header.dump();
  const uint64_t n = text.size();
  write_bytes(dst, std::string(reinterpret_cast<const char*>(&n), 8) + text + bytes.substr(8 + len) + append);
}

struct BadFiles : ::testing::Test {
  ScratchDir dir;
  ModelConfig c = testing::small_config();
  Artifact a = testing::random_artifact(c, testing::small_fingerprint(c), 5);
  std::string good = dir.file("good.safetensors"), bad = dir.file("bad.safetensors");
  void SetUp() override { write_artifact_safetensors(a, good); }
  std::string read_error(const std::function<void(json&, json&)>& edit, const std::string& append = "") {
    rewrite(good, bad, edit, append);
    return error_of([&] { read_artifact(bad); });
  }
};

TEST_F(BadFiles, ForeignAndInconsistentFilesAreRefusedByName) {
  // A sanity check of the editor: an unchanged rewrite reads.
  EXPECT_EQ(read_error([](json&, json&) {}), "(no error)");
  // Plain safetensors without kvcc metadata (what a model's weights look like).
  write_safetensors_f32(bad, {{"model.embed_tokens.weight", {2, 2}, {1, 2, 3, 4}}});
  EXPECT_CONTAINS(error_of([&] { read_artifact(bad); }), "a safetensors file but not a kvcc artifact");
  EXPECT_CONTAINS(error_of([&] { detect_kvcc_format(bad); }), "not a kvcc artifact");
  const std::string weights = std::string(KVCC_SHARED_DIR) + "/models/tinystories-656k/model.safetensors";
  if (fs::exists(weights)) {
    EXPECT_CONTAINS(error_of([&] { read_artifact(weights); }), "not a kvcc artifact");
  }
  EXPECT_CONTAINS(read_error([](json&, json& d) { d["format"] = "kvcc-stats"; }), "expected kvcc-artifact");
  EXPECT_CONTAINS(read_error([](json&, json& d) { d["format_version"] = "3.0"; }),
                  "format_version 3.0 is not supported");
  EXPECT_EQ(read_error([](json&, json& d) { d["format_version"] = "1.7"; }), "(no error)");  // newer minor
  // A tensor this reader does not know: an error in a 1.0 file, skipped in a newer minor's.
  auto rename = [](const char* version) {
    return [version](json& h, json& d) {
      d["format_version"] = version;
      h["layers.0.kv0.key.future"] = h["layers.0.kv0.key.levels"];
      h.erase("layers.0.kv0.key.levels");
      for (json& t : d["tensors"])
        if (t["name"] == "layers.0.kv0.key.levels") t["name"] = "layers.0.kv0.key.future";
    };
  };
  EXPECT_CONTAINS(read_error(rename("1.0")), "'layers.0.kv0.key.future' is not a kvcc artifact tensor name");
  EXPECT_EQ(read_error(rename("1.3")), "(no error)");
  EXPECT_TRUE(read_artifact(bad).head(0, 0).key.levels.empty());
  // Shapes that disagree with the model shape the document states.
  EXPECT_CONTAINS(read_error([](json&, json& d) { d["model"]["head_dim"] = 4; }), "has shape [8, 8], expected [4, 4]");
  EXPECT_CONTAINS(read_error([](json&, json& d) { d["model"]["n_layers"] = 2; }),
                  "'clip_ratio.key' has shape [3, 2], expected [2, 2]");
  EXPECT_CONTAINS(read_error([](json&, json& d) { d["model"]["n_kv_heads"] = 0; }), "n_kv_heads");
  EXPECT_CONTAINS(read_error([](json&, json& d) { d["model"]["n_layers"] = 4294967298LL; }), "n_layers");
  EXPECT_CONTAINS(read_error([](json& h, json&) { h["layers.0.kv0.key.rotation"]["dtype"] = "I64"; }),
                  "has dtype I64, expected F64");
  // The tensor list and the file must agree.
  const size_t n = read_safetensors(good).size();
  EXPECT_CONTAINS(read_error([](json&, json& d) { d["tensors"].erase(d["tensors"].size() - 1); }),
                  "lists " + std::to_string(n - 1) + " tensors, the file holds " + std::to_string(n));
  EXPECT_CONTAINS(read_error([](json&, json& d) { d["tensors"][3]["name"] = "layers.0.kv0.key.nonsense"; }),
                  "is listed but not in the file");
  EXPECT_CONTAINS(read_error([](json&, json& d) { d["tensors"][3]["sha256"] = std::string(64, '0'); }),
                  "checksum mismatch in tensor");
  EXPECT_CONTAINS(read_error([](json&, json& d) { d.erase("recipe"); }), "lacks \"recipe\"");
  EXPECT_CONTAINS(read_error([](json&, json& d) { d["recipe"]["sink"] = "64"; }), "recipe.sink");
  EXPECT_CONTAINS(read_error([](json&, json& d) { d["model"]["fingerprint"]["fields"][1][1] = "9"; }),
                  "fingerprint id does not match");
  EXPECT_CONTAINS(read_error([](json& h, json& d) {
                    d = json();
                    h["__metadata__"][kArtifactMetadataKey] = "{nope";
                  }),
                  "is not valid JSON");
  // Bytes the header does not account for.
  EXPECT_CONTAINS(read_error([](json&, json&) {}, "trailing"), "data bytes after the last tensor");
}

// Format 1.1: the document's sha256 sits beside it in __metadata__, so an edit of the recipe, the
// model, the provenance or a tensor's listed sha256 that is not re-signed is refused; a 1.0
// document (no checksum) still reads, a 1.1 one without it does not.
TEST_F(BadFiles, UnsignedEditsOfTheDocumentAreRefused) {
  const std::string mismatch = "__metadata__." + std::string(kArtifactMetadataKey) + " edited or corrupt (" +
                               kArtifactChecksumKey + " does not match)";
  for (const auto& edit : std::vector<std::function<void(json&, json&)>>{
           [](json&, json& d) { d["recipe"]["method"] = "hadamard"; }, [](json&, json& d) { d["recipe"]["sink"] = 16; },
           [](json&, json& d) { d["provenance"]["tokens"] = 7; },
           [](json&, json& d) { d["tensors"][3]["sha256"] = std::string(64, '0'); }}) {
    rewrite(good, bad, edit, "", /*sign=*/false);
    EXPECT_CONTAINS(error_of([&] { read_artifact(bad); }), mismatch);
    EXPECT_CONTAINS(error_of([&] { verify_artifact_file(bad); }), mismatch);
  }
  EXPECT_CONTAINS(read_error([](json& h, json&) { h["__metadata__"].erase(kArtifactChecksumKey); }),
                  std::string(kArtifactChecksumKey) + " missing");
  EXPECT_EQ(read_error([](json& h, json& d) {
              h["__metadata__"].erase(kArtifactChecksumKey);
              d["format_version"] = "1.0";
            }),
            "(no error)");
}

TEST_F(BadFiles, HugeClaimsAreRefusedBeforeAllocation) {
  // A header length far beyond the file.
  std::string bytes = read_bytes(good);
  const uint64_t huge = uint64_t(1) << 62;
  std::memcpy(bytes.data(), &huge, 8);
  write_bytes(bad, bytes);
  EXPECT_CONTAINS(error_of([&] { read_artifact(bad); }), "exceeds the file size");
  // A tensor claiming a terabyte of data.
  EXPECT_CONTAINS(read_error([](json& h, json&) {
                    h["layers.0.kv0.key.rotation"]["shape"] = {1 << 20, 1 << 20};
                  }),
                  "data_offsets span");
  // Counts in the document that would make a huge head table: bounded by the clip ratio tensor.
  EXPECT_CONTAINS(read_error([](json&, json& d) {
                    d["model"]["n_layers"] = 2000000000;
                    d["model"]["n_kv_heads"] = 2000000000;
                  }),
                  "expected [2000000000, 2000000000]");
  // Overlapping tensors (two names on the same bytes).
  EXPECT_CONTAINS(read_error([](json& h, json&) {
                    h["layers.0.kv0.key.rotation"]["data_offsets"] = h["layers.0.kv0.value.rotation"]["data_offsets"];
                  }),
                  "overlapping tensors or a hole");
}

TEST_F(BadFiles, DataCorruptionIsCaughtByChecksums) {
  std::string bytes = read_bytes(good);
  bytes[bytes.size() - 3] ^= 0x10;
  write_bytes(bad, bytes);
  EXPECT_CONTAINS(error_of([&] { read_artifact(bad); }), "checksum mismatch in tensor");
  const auto problems = verify_artifact_file(bad);
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_CONTAINS(problems[0], "checksum mismatch in tensor layers.2.kv1.value.");
}

// "" when reading `path` in a child ends with a result or a kvcc::Error; otherwise what happened.
std::string read_in_child(const std::string& path) {
  const pid_t pid = ::fork();
  if (pid < 0) return "fork failed";
  if (pid == 0) {
    rlimit rl{};
    ::getrlimit(RLIMIT_AS, &rl);
    ::alarm(20);
    int code = 0;
    try {
      for (auto f :
           {+[](const std::string& p) { read_artifact(p); }, +[](const std::string& p) { verify_artifact_file(p); },
            +[](const std::string& p) { detect_kvcc_format(p); }}) {
        try {
          f(path);
        } catch (const Error&) {}
      }
    } catch (const std::bad_alloc&) {
      code = 3;
    } catch (...) {
      code = 4;
    }
    ::_exit(code);
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return "";
  if (WIFEXITED(status)) return "exit " + std::to_string(WEXITSTATUS(status));
  return "signal " + std::to_string(WTERMSIG(status));
}

// Deterministic mutants: every truncation length, single-byte changes across the header and the
// length field, and byte flips in the data. None may crash, hang or throw anything but Error; a
// changed data byte or a truncation must be refused.
TEST_F(BadFiles, MutantsNeverCrashAndDataMutantsAreRefused) {
  const std::string bytes = read_bytes(good);
  uint64_t len = 0;
  std::memcpy(&len, bytes.data(), 8);
  const size_t data_start = 8 + len;
  std::mt19937_64 rng(7);
  size_t mutants = 0;
  for (size_t cut = 0; cut < bytes.size(); cut += 1 + cut / 16) {
    write_bytes(bad, bytes.substr(0, cut));
    EXPECT_NE(error_of([&] { read_artifact(bad); }), "(no error)") << "truncated to " << cut;
    ++mutants;
  }
  for (int i = 0; i < 400; ++i) {
    std::string m = bytes;
    const size_t at = i < 16 ? size_t(i) : 8 + rng() % len;
    m[at] = char(i < 16 ? m[at] ^ (1 << (i % 8)) : rng() % 256);
    write_bytes(bad, m);
    EXPECT_EQ(read_in_child(bad), "") << "header byte " << at;
    ++mutants;
  }
  for (int i = 0; i < 64; ++i) {
    std::string m = bytes;
    const size_t at = data_start + rng() % (bytes.size() - data_start);
    m[at] ^= char(1 << (rng() % 8));
    write_bytes(bad, m);
    EXPECT_NE(error_of([&] { read_artifact(bad); }), "(no error)") << "data byte " << at;
    ++mutants;
  }
  EXPECT_GT(mutants, 500u);
}

TEST(ArtifactSafetensors, ContainerDetection) {
  ScratchDir dir;
  const ModelConfig c = testing::small_config();
  const Artifact a = testing::random_artifact(c, testing::small_fingerprint(c), 6);
  write_artifact(a, dir.file("a.kvcc.h5"));
  write_artifact_safetensors(a, dir.file("a.safetensors"));
  EXPECT_EQ(artifact_container(dir.file("a.kvcc.h5")), ArtifactContainer::Hdf5);
  EXPECT_EQ(artifact_container(dir.file("a.safetensors")), ArtifactContainer::Safetensors);
  write_bytes(dir.file("junk"), std::string(5000, '\x7f'));
  EXPECT_EQ(artifact_container(dir.file("junk")), ArtifactContainer::Unknown);
  EXPECT_EQ(error_of([&] { read_artifact(dir.file("junk")); }), dir.file("junk") + ": not an HDF5 file (or truncated)");
  EXPECT_CONTAINS(error_of([&] { artifact_container(dir.file("absent")); }), "no such file");
  EXPECT_EQ(detect_kvcc_format(dir.file("a.kvcc.h5")), kArtifactFormat);
  // The writer refuses an invalid artifact and leaves nothing behind.
  Artifact skew = a;
  skew.head(0, 0).key.rotation[0] = 0.5;
  EXPECT_CONTAINS(error_of([&] { write_artifact_safetensors(skew, dir.file("skew.safetensors")); }),
                  "refusing to write an invalid artifact");
  EXPECT_FALSE(testing::file_exists(dir.file("skew.safetensors")));
  EXPECT_TRUE(dir.temporaries().empty());
}

// The runtime (host pool) loaded from the safetensors file decodes bit-identically to the one
// loaded from the HDF5 file, for every published artifact of a method the runtime serves.
TEST(ArtifactSafetensors, RuntimeFromEitherFileDecodesIdentically) {
  ScratchDir dir;
  size_t served = 0;
  for (const std::string& path : testing::published_artifacts()) {
    const Artifact art = read_artifact(path);
    if (!served_by_runtime(art.recipe.method)) continue;
    const std::string st = dir.file("rt.safetensors");
    write_artifact_safetensors(art, st);
    const EngineShape shape{art.n_layers, art.n_heads, art.n_kv_heads, art.head_dim};
    RuntimeOptions o;
    o.max_pages = 64;
    o.max_sequences = 2;
    o.memory = PoolMemory::Host;
    std::unique_ptr<Runtime> rts[2] = {Runtime::load(path, shape, o), Runtime::load(st, shape, o)};
    // Enough tokens to fill the sink and recent windows and spill into INT2 pages.
    const int T = art.recipe.sink + art.recipe.recent + 2 * art.recipe.page_size + 3;
    const size_t kv = size_t(T) * art.n_kv_heads * art.head_dim, qn = size_t(art.n_heads) * art.head_dim;
    std::mt19937 rng(11);
    std::normal_distribution<float> normal;
    std::vector<float> k(kv), v(kv), q(qn);
    std::vector<float> out[2] = {std::vector<float>(qn), std::vector<float>(qn)};
    int seqs[2];
    for (int r = 0; r < 2; ++r) {
      seqs[r] = rts[r]->cache().add_sequence();
      rts[r]->begin_append({seqs[r]}, {T});
    }
    for (int l = 0; l < art.n_layers; ++l) {
      for (auto& x : k) x = normal(rng);
      for (auto& x : v) x = normal(rng);
      for (auto& x : q) x = normal(rng);
      for (int r = 0; r < 2; ++r) {
        rts[r]->append(l, k.data(), v.data());
        rts[r]->decode(l, {seqs[r]}, q.data(), out[r].data());
      }
      ASSERT_EQ(std::memcmp(out[0].data(), out[1].data(), qn * sizeof(float)), 0) << path << " layer " << l;
      EXPECT_TRUE(std::all_of(out[0].begin(), out[0].end(), [](float x) { return std::isfinite(x); }));
    }
    ++served;
  }
  EXPECT_GE(served, 4u);
}

}  // namespace
}  // namespace kvcc
