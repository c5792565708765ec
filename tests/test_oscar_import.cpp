// Importing OSCAR's published Qwen3-4B-Thinking-2507 rotations (../shared/zoo-reference) into a
// kvcc artifact and exporting them again. Expected values come from PyTorch
// (tests/reference/make_oscar_refs.py: sha256 of every layer's float32 tensor bytes), i.e. from an
// implementation independent of kvcc's zip/pickle reader.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "formats/artifact.h"
#include "formats/error.h"
#include "formats/model_config.h"
#include "zoo/oscar_pt.h"
#include "formats/sha256.h"
#include "zoo/oscar_interop.h"

namespace fs = std::filesystem;
using namespace kvcc;

namespace {

const std::string kRefDir = std::string(KVCC_SHARED_DIR) + "/zoo-reference/oscar/qwen3-4b-thinking-2507";
const std::string kKeyFile = kRefDir + "/k_rotation_qqt_r_h_pbr.pt";
const std::string kValueFile = kRefDir + "/v_rotation_sst_r_h_pbr.pt";

#define REQUIRE_REFERENCE()                             \
  if (!fs::exists(kKeyFile) || !fs::exists(kValueFile)) \
  GTEST_SKIP() << "OSCAR reference rotations not found under " << kRefDir << " (../shared absent)"

nlohmann::json refs() {
  std::ifstream in(std::string(KVCC_SOURCE_DIR) + "/tests/data/oscar/qwen3-4b-thinking-2507.json");
  return nlohmann::json::parse(std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>()));
}

std::string float_sha(const std::vector<float>& v) { return sha256_hex(v.data(), v.size() * sizeof(float)); }
std::string double_as_float_sha(const std::vector<double>& v) {
  const std::vector<float> f(v.begin(), v.end());
  return float_sha(f);
}

double naive_orthogonality_error(const std::vector<double>& r, int d) {
  double worst = 0;
  for (int i = 0; i < d; ++i)
    for (int j = 0; j < d; ++j) {
      double s = 0;
      for (int k = 0; k < d; ++k) s += r[size_t(k * d + i)] * r[size_t(k * d + j)];
      worst = std::max(worst, std::abs(s - (i == j ? 1.0 : 0.0)));
    }
  return worst;
}

fs::path temp_dir(const std::string& name) {
  fs::path p = fs::temp_directory_path() / ("kvcc_test_oscar_import_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

struct Imported {
  OscarRotationSet key, value;
  Artifact artifact;
};

const Imported& imported() {
  static const Imported im = [] {
    Imported x;
    x.key = read_oscar_pt(kKeyFile);
    x.value = read_oscar_pt(kValueFile);
    zoo::OscarImportOptions o;
    o.model_id = "qwen3-4b-thinking-2507";
    x.artifact = zoo::import_oscar(x.key, x.value, o);
    return x;
  }();
  return im;
}

}  // namespace

TEST(OscarImport, ReaderMatchesTorch) {
  REQUIRE_REFERENCE();
  const auto r = refs();
  const auto& im = imported();
  for (const auto* set : {&im.key, &im.value}) {
    const auto& fr = r["files"][set == &im.key ? "k_rotation_qqt_r_h_pbr.pt" : "v_rotation_sst_r_h_pbr.pt"];
    EXPECT_EQ(set->format_version, fr["format_version"].get<int>());
    EXPECT_EQ(set->objective, fr["objective"].get<std::string>());
    EXPECT_EQ(set->source_grouping, fr["source_grouping"].get<std::string>());
    ASSERT_EQ(set->layers.size(), 36u);
    EXPECT_EQ(set->head_dim, 128);
    for (const auto& l : set->layers) {
      const auto& lr = fr["layers"][std::to_string(l.layer_id)];
      EXPECT_EQ(float_sha(l.rotation), lr["rotation_sha256"].get<std::string>()) << "layer " << l.layer_id;
      EXPECT_EQ(float_sha(l.eigenvalues), lr["eigenvalues_sha256"].get<std::string>()) << "layer " << l.layer_id;
    }
  }
}

TEST(OscarImport, ArtifactIsVerifiedAndBitExact) {
  REQUIRE_REFERENCE();
  const auto r = refs();
  const auto& im = imported();
  const fs::path dir = temp_dir("art");
  const std::string path = (dir / "q.kvcc.h5").string();
  write_artifact(im.artifact, path);
  const Artifact a = read_artifact(path);
  EXPECT_TRUE(verify_artifact(a).empty());
  EXPECT_TRUE(verify_artifact_file(path).empty());
  EXPECT_EQ(a.n_layers, 36);
  EXPECT_EQ(a.head_dim, 128);
  EXPECT_EQ(a.recipe.method, "oscar");
  EXPECT_EQ(a.recipe.granularity, "layer");
  EXPECT_EQ(a.recipe.composition, "UHP");
  EXPECT_EQ(a.recipe.value_target, "logit2");
  EXPECT_EQ(a.provenance.source, "imported:oscar");
  // A shapes-only fingerprint, marked as such, whose id is the documented hash of its fields.
  EXPECT_EQ(a.fingerprint.id, fingerprint_id(a.fingerprint.fields, a.fingerprint.weights_sha256));
  EXPECT_NE(std::find(a.fingerprint.fields.begin(), a.fingerprint.fields.end(),
                      std::make_pair(std::string("fingerprint_source"), std::string("shapes"))),
            a.fingerprint.fields.end());
  const auto& kr = r["files"]["k_rotation_qqt_r_h_pbr.pt"]["layers"];
  const auto& vr = r["files"]["v_rotation_sst_r_h_pbr.pt"]["layers"];
  for (int l = 0; l < a.n_layers; ++l) {
    const HeadArtifact& h = a.head(l, 0);
    const std::string id = std::to_string(l);
    // float32 -> float64 is exact: the stored doubles are floats, equal to the source bit for bit,
    // both against kvcc's own reader and against PyTorch's bytes.
    for (size_t i = 0; i < h.key.rotation.size(); ++i) {
      ASSERT_EQ(double(float(h.key.rotation[i])), h.key.rotation[i]);
      ASSERT_EQ(float(h.key.rotation[i]), im.key.layers[size_t(l)].rotation[i]);
      ASSERT_EQ(float(h.value.rotation[i]), im.value.layers[size_t(l)].rotation[i]);
    }
    EXPECT_EQ(double_as_float_sha(h.key.rotation), kr[id]["rotation_sha256"].get<std::string>());
    EXPECT_EQ(double_as_float_sha(h.value.rotation), vr[id]["rotation_sha256"].get<std::string>());
    EXPECT_EQ(double_as_float_sha(h.key.eigenvalues), kr[id]["eigenvalues_sha256"].get<std::string>());
    EXPECT_EQ(double_as_float_sha(h.value.eigenvalues), vr[id]["eigenvalues_sha256"].get<std::string>());
    EXPECT_LT(naive_orthogonality_error(h.key.rotation, 128), 1e-6) << "layer " << l;
    EXPECT_LT(naive_orthogonality_error(h.value.rotation, 128), 1e-6) << "layer " << l;
    EXPECT_TRUE(std::is_sorted(h.key.eigenvalues.begin(), h.key.eigenvalues.end()));
    EXPECT_TRUE(std::is_sorted(h.value.eigenvalues.begin(), h.value.eigenvalues.end()));
    EXPECT_DOUBLE_EQ(h.key.eigenvalues.front(), kr[id]["eigenvalue_min"].get<double>());
    EXPECT_DOUBLE_EQ(h.value.eigenvalues.back(), vr[id]["eigenvalue_max"].get<double>());
  }
  fs::remove_all(dir);
}

TEST(OscarImport, ExportThenReimportIsIdentical) {
  REQUIRE_REFERENCE();
  const auto& im = imported();
  const zoo::OscarExport ex = zoo::export_oscar(im.artifact);
  EXPECT_EQ(ex.key_file_name, "k_rotation_qqt_r_h_pbr.pt");
  EXPECT_EQ(ex.value_file_name, "v_rotation_sst_r_h_pbr.pt");
  EXPECT_EQ(ex.key.format_version, 1);
  const fs::path dir = temp_dir("export");
  write_oscar_pt(ex.key, (dir / ex.key_file_name).string());
  write_oscar_pt(ex.value, (dir / ex.value_file_name).string());
  const OscarRotationSet k2 = read_oscar_pt((dir / ex.key_file_name).string());
  const OscarRotationSet v2 = read_oscar_pt((dir / ex.value_file_name).string());
  EXPECT_EQ(k2.objective, im.key.objective);
  EXPECT_EQ(v2.source_grouping, "layer");
  for (size_t l = 0; l < 36; ++l) {
    EXPECT_EQ(k2.layers[l].rotation, im.key.layers[l].rotation);
    EXPECT_EQ(k2.layers[l].eigenvalues, im.key.layers[l].eigenvalues);
    EXPECT_EQ(v2.layers[l].rotation, im.value.layers[l].rotation);
    EXPECT_EQ(v2.layers[l].eigenvalues, im.value.layers[l].eigenvalues);
  }
  zoo::OscarImportOptions o;
  o.model_id = "again";
  const Artifact again = zoo::import_oscar(k2, v2, o);
  for (int l = 0; l < 36; ++l) {
    EXPECT_EQ(again.head(l, 0).key.rotation, im.artifact.head(l, 0).key.rotation);
    EXPECT_EQ(again.head(l, 0).value.eigenvalues, im.artifact.head(l, 0).value.eigenvalues);
  }
  fs::remove_all(dir);
}

TEST(OscarImport, PerHeadExportNeedsVersion2) {
  REQUIRE_REFERENCE();
  const auto& im = imported();
  zoo::OscarImportOptions o;
  o.model_id = "two-heads";
  o.n_kv_heads = 2;
  o.n_heads = 4;
  Artifact a = zoo::import_oscar(im.key, im.value, o);
  ASSERT_EQ(a.heads.size(), 72u);
  // Make head 1 of layer 3 differ: swap two columns (still orthogonal).
  auto& r = a.head(3, 1).key.rotation;
  for (int i = 0; i < 128; ++i) std::swap(r[size_t(i * 128)], r[size_t(i * 128 + 1)]);
  try {
    zoo::export_oscar(a, 1);
    FAIL() << "differing heads exported as per-layer";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("layer 3"), std::string::npos) << e.what();
  }
  const zoo::OscarExport ex = zoo::export_oscar(a);  // picks version 2
  EXPECT_EQ(ex.key.format_version, 2);
  EXPECT_EQ(ex.key.heads, 2);
  const fs::path dir = temp_dir("v2");
  const std::string kp = (dir / "k.pt").string(), vp = (dir / "v.pt").string();
  write_oscar_pt(ex.key, kp);
  write_oscar_pt(ex.value, vp);
  const OscarRotationSet k2 = read_oscar_pt(kp);
  EXPECT_EQ(k2.format_version, 2);
  EXPECT_EQ(k2.source_grouping, "kv_head");
  const Artifact back = zoo::import_oscar(k2, read_oscar_pt(vp), o);
  EXPECT_EQ(back.recipe.granularity, "head");
  for (int l = 0; l < 36; ++l)
    for (int h = 0; h < 2; ++h) EXPECT_EQ(back.head(l, h).key.rotation, a.head(l, h).key.rotation);
  fs::remove_all(dir);
}

TEST(OscarImport, MismatchedModelRefused) {
  REQUIRE_REFERENCE();
  const auto& im = imported();
  ModelConfig c;
  c.architecture = "llama";
  c.n_layers = 2;
  c.n_heads = 8;
  c.n_kv_heads = 4;
  c.head_dim = 16;
  const ModelFingerprint fp = make_fingerprint(c, "00");
  zoo::OscarImportOptions o;
  o.model_id = "tiny";
  o.config = &c;
  o.fingerprint = &fp;
  try {
    zoo::import_oscar(im.key, im.value, o);
    FAIL() << "rotations of a 36-layer model imported for a 2-layer one";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("36 layers"), std::string::npos) << e.what();
  }
}

TEST(OscarImport, CommandLine) {
  REQUIRE_REFERENCE();
  const fs::path dir = temp_dir("cli");
  const std::string art = (dir / "q.kvcc.h5").string();
  const std::string cmd = std::string(KVCC_BINARY) + " zoo import-oscar " + kKeyFile + " " + kValueFile +
                          " --model-id qwen3-4b-thinking-2507 -o " + art + " > /dev/null";
  ASSERT_EQ(std::system(cmd.c_str()), 0);
  const Artifact a = read_artifact(art);
  EXPECT_EQ(a.head(17, 0).key.rotation, imported().artifact.head(17, 0).key.rotation);
  EXPECT_EQ(a.recipe.params.at("oscar_key_file_sha256"), sha256_file_hex(kKeyFile));
  const std::string out = (dir / "rot").string();
  ASSERT_EQ(
      std::system((std::string(KVCC_BINARY) + " zoo export-oscar " + art + " -o " + out + " > /dev/null").c_str()), 0);
  const OscarRotationSet k = read_oscar_pt(out + "/k_rotation_qqt_r_h_pbr.pt");
  EXPECT_EQ(k.layers[35].rotation, imported().key.layers[35].rotation);
  // A missing file is a one-line error and a non-zero exit.
  EXPECT_NE(std::system((std::string(KVCC_BINARY) + " zoo import-oscar /nonexistent.pt " + kValueFile +
                         " --model-id x -o " + art + " 2> /dev/null")
                            .c_str()),
            0);
  fs::remove_all(dir);
}
