// Artifact format v1: exact round trip (rotations bit-exact, including float32 sources), per-dataset
// checksums catching a flipped byte, NaN and non-orthogonal rotations, wrong versions, missing
// datasets, and verify_artifact's list of problems.
#include <gtest/gtest.h>
#include <hdf5.h>

#include <cmath>
#include <cstring>
#include <functional>

#include "formats/artifact.h"
#include "formats/error.h"
#include "formats/h5.h"
#include "formats/sha256.h"
#include "formats_test_util.h"

namespace kvcc {
namespace {

using testing::error_of;

void expect_equal_sides(const SideArtifact& a, const SideArtifact& b) {
  EXPECT_EQ(a.rotation, b.rotation);
  EXPECT_EQ(a.eigenvalues, b.eigenvalues);
  EXPECT_EQ(a.clip_ratio, b.clip_ratio);
  EXPECT_EQ(a.levels, b.levels);
  ASSERT_EQ(a.extras.size(), b.extras.size());
  for (size_t i = 0; i < a.extras.size(); ++i) {
    EXPECT_EQ(a.extras[i].name, b.extras[i].name);
    EXPECT_EQ(a.extras[i].shape, b.extras[i].shape);
    EXPECT_EQ(a.extras[i].data, b.extras[i].data);
    EXPECT_EQ(a.extras[i].integer, b.extras[i].integer);
  }
}

void expect_equal_artifacts(const Artifact& a, const Artifact& b) {
  EXPECT_EQ(b.format_version, artifact_format_version(a));  // what the writer writes for this content
  EXPECT_EQ(a.layer_budgets, b.layer_budgets);
  EXPECT_EQ(a.command, b.command);
  EXPECT_EQ(a.model_id, b.model_id);
  EXPECT_EQ(a.fingerprint.id, b.fingerprint.id);
  EXPECT_EQ(a.fingerprint.fields, b.fingerprint.fields);
  EXPECT_EQ(a.n_layers, b.n_layers);
  EXPECT_EQ(a.n_heads, b.n_heads);
  EXPECT_EQ(a.n_kv_heads, b.n_kv_heads);
  EXPECT_EQ(a.head_dim, b.head_dim);
  EXPECT_EQ(a.rope_style, b.rope_style);
  EXPECT_EQ(a.provenance.data_sha256, b.provenance.data_sha256);
  EXPECT_EQ(a.provenance.tokens, b.provenance.tokens);
  EXPECT_EQ(a.provenance.sequences, b.provenance.sequences);
  EXPECT_EQ(a.provenance.seed, b.provenance.seed);
  EXPECT_EQ(a.provenance.stats_sha256, b.provenance.stats_sha256);
  EXPECT_EQ(a.provenance.source, b.provenance.source);
  EXPECT_EQ(a.recipe.method, b.recipe.method);
  EXPECT_EQ(a.recipe.key_bits, b.recipe.key_bits);
  EXPECT_EQ(a.recipe.value_bits, b.recipe.value_bits);
  EXPECT_EQ(a.recipe.group, b.recipe.group);
  EXPECT_EQ(a.recipe.sink, b.recipe.sink);
  EXPECT_EQ(a.recipe.recent, b.recipe.recent);
  EXPECT_EQ(a.recipe.page_size, b.recipe.page_size);
  EXPECT_EQ(a.recipe.value_target, b.recipe.value_target);
  EXPECT_EQ(a.recipe.granularity, b.recipe.granularity);
  EXPECT_EQ(a.recipe.composition, b.recipe.composition);
  EXPECT_EQ(a.recipe.seed, b.recipe.seed);
  EXPECT_EQ(a.recipe.params, b.recipe.params);
  ASSERT_EQ(a.heads.size(), b.heads.size());
  for (size_t i = 0; i < a.heads.size(); ++i) {
    expect_equal_sides(a.heads[i].key, b.heads[i].key);
    expect_equal_sides(a.heads[i].value, b.heads[i].value);
  }
}

struct Fixture {
  ModelConfig config = testing::small_config(3, 4, 2, 8);
  ModelFingerprint fp = testing::small_fingerprint(config);
};

TEST(ArtifactFormat, RoundTripIsExact) {
  testing::ScratchDir dir;
  Fixture f;
  Artifact a = testing::random_artifact(f.config, f.fp, 3);
  a.recipe.key_bits = 2.5;
  a.recipe.group = 4;
  a.head(2, 1).value.rotation.clear();  // a side without a rotation
  a.head(2, 1).value.eigenvalues.clear();
  // A float32 rotation (e.g. imported from OSCAR) must come back bit for bit.
  std::mt19937_64 rng(1);
  std::vector<double> r = testing::random_orthogonal(8, rng);
  for (double& x : r) x = double(float(x));
  a.head(0, 0).key.rotation = r;
  const std::string path = dir.file("model.kvcc.h5");
  write_artifact(a, path);
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"model.kvcc.h5"});
  Artifact back = read_artifact(path);
  expect_equal_artifacts(a, back);
  EXPECT_EQ(back.producer, std::string("kvcc ") + KVCC_VERSION);  // filled in by the writer
  EXPECT_EQ(back.created.size(), 20u);
  EXPECT_TRUE(verify_artifact_file(path).empty());
  ASSERT_NE(back.head(1, 0).value.extra("outlier_channels"), nullptr);
  EXPECT_EQ(back.head(1, 0).value.extra("outlier_channels")->data, (std::vector<double>{0, 5, 7}));
  EXPECT_EQ(back.head(1, 0).value.extra("nope"), nullptr);

  // The stored checksum is sha256 of the dataset's little-endian float64 bytes.
  h5::File file = h5::File::open(path);
  h5::Dataset ds = file.group("layers").group("1").group("kv0").group("key").dataset("rotation");
  const auto& rot = a.head(1, 0).key.rotation;
  EXPECT_EQ(ds.attr_string("sha256"), sha256_hex(rot.data(), rot.size() * sizeof(double)));
}

TEST(ArtifactFormat, CorruptedByteIsAChecksumMismatch) {
  testing::ScratchDir dir;
  Fixture f;
  const std::string path = dir.file("a.h5");
  write_artifact(testing::random_artifact(f.config, f.fp, 4), path);
  int64_t offset;
  {
    h5::File file = h5::File::open(path);
    offset = file.group("layers").group("2").group("kv0").group("key").dataset("rotation").file_offset();
  }
  ASSERT_GT(offset, 0);
  std::string bytes = testing::read_bytes(path);
  bytes[size_t(offset + 8)] ^= 0x01;  // the lowest mantissa bit: still finite and orthogonal
  testing::write_bytes(path, bytes);
  EXPECT_EQ(error_of([&] { read_artifact(path); }), path + ": checksum mismatch in /layers/2/kv0/key/rotation");
  auto problems = verify_artifact_file(path);
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_EQ(problems[0], path + ": checksum mismatch in /layers/2/kv0/key/rotation");
}

// Writes a good artifact, then lets `damage` edit it in place.
template <class F>
std::string damaged(const testing::ScratchDir& dir, F&& damage) {
  Fixture f;
  const std::string path = dir.file("damaged.h5");
  write_artifact(testing::random_artifact(f.config, f.fp, 5), path);
  {
    h5::File file = h5::File::open_rw(path);
    damage(file);
    h5::seal_attributes(file);
    file.close();
  }
  return path;
}

// Overwrites a rotation's values and re-signs it, so only the content check can object.
void replace_rotation(h5::File& file, const char* side, std::vector<double> values) {
  h5::Dataset ds = file.group("layers").group("1").group("kv1").group(side).dataset("rotation");
  H5Dwrite(ds.id(), H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, values.data());
  ds.set_attr("sha256", sha256_hex(values.data(), values.size() * sizeof(double)));
}

TEST(ArtifactFormat, BadInputGivesClearErrors) {
  testing::ScratchDir dir;
  std::string path;

  path = damaged(dir, [](h5::File& file) {
    std::vector<double> r(64, 0.0);
    for (int i = 0; i < 8; ++i) r[size_t(i * 9)] = 1.0;
    r[10] = std::nan("");
    replace_rotation(file, "value", r);
  });
  EXPECT_EQ(error_of([&] { read_artifact(path); }), path + ": /layers/1/kv1/value/rotation: contains NaN or inf");

  path = damaged(dir, [](h5::File& file) {
    std::vector<double> r(64, 0.0);
    for (int i = 0; i < 8; ++i) r[size_t(i * 9)] = 1.0;
    r[1] = 0.01;  // RtR - I has 0.01 off the diagonal
    replace_rotation(file, "key", r);
  });
  EXPECT_CONTAINS(error_of([&] { read_artifact(path); }),
                  "/layers/1/kv1/key/rotation: not orthogonal (max |RtR - I| = 0.010000");

  path = damaged(dir, [](h5::File& file) { H5Ldelete(file.id(), "/layers/2/kv1/value/rotation", H5P_DEFAULT); });
  EXPECT_EQ(error_of([&] { read_artifact(path); }), path + ": missing dataset /layers/2/kv1/value/rotation");

  path = damaged(dir, [](h5::File& file) { H5Ldelete(file.id(), "/layers/2", H5P_DEFAULT); });
  EXPECT_EQ(error_of([&] { read_artifact(path); }), path + ": missing group /layers/2");

  path = damaged(dir, [](h5::File& file) { file.set_attr("format_version", std::string("3.1")); });
  EXPECT_EQ(error_of([&] { read_artifact(path); }),
            path + ": kvcc-artifact format_version 3.1 is not supported (this kvcc reads 1.x and 2.x)");

  path = damaged(dir, [](h5::File& file) {
    file.set_attr("format_version", std::string("1.4"));
    file.group("layers").group("0").group("kv0").group("key").write("future", {1}, std::vector<double>{1});
    file.group("recipe").set_attr("future_knob", 3.0);
  });
  EXPECT_NO_THROW(read_artifact(path));

  path = damaged(dir, [](h5::File& file) { file.group("model").group("fingerprint").set_attr("n_layers", "9"); });
  EXPECT_CONTAINS(error_of([&] { read_artifact(path); }), "fingerprint id does not match its fields");

  path = damaged(dir, [](h5::File& file) {
    h5::Group g = file.group("layers").group("0").group("kv1").group("key");
    H5Ldelete(g.id(), "eigenvalues", H5P_DEFAULT);
    std::vector<float> ev(8, 1.0f);
    g.write("eigenvalues", {8}, ev).set_attr("sha256", sha256_hex(ev.data(), ev.size() * 4));
  });
  EXPECT_EQ(error_of([&] { read_artifact(path); }),
            path + ": /layers/0/kv1/key/eigenvalues has dtype float32, expected float64");

  testing::write_bytes(dir.file("junk.h5"), std::string(5000, '\x7f'));
  EXPECT_EQ(error_of([&] { read_artifact(dir.file("junk.h5")); }),
            dir.file("junk.h5") + ": not an HDF5 file (or truncated)");
  const std::string good = dir.file("good.h5");
  Fixture f;
  write_artifact(testing::random_artifact(f.config, f.fp, 6), good);
  const std::string bytes = testing::read_bytes(good);
  testing::write_bytes(dir.file("cut.h5"), bytes.substr(0, bytes.size() - 100));
  EXPECT_CONTAINS(error_of([&] { read_artifact(dir.file("cut.h5")); }),
                  dir.file("cut.h5") + ": truncated HDF5 file (" + std::to_string(bytes.size() - 100) + " of its ");
}

// Format 1.1: attributes (clip ratios, the recipe and its parameters, provenance, the model) carry
// checksums, so an edit that is not re-signed is refused by every reader, naming the object; a
// 1.0 file, which has none, is still read.
TEST(ArtifactFormat, EditedAttributesAreRefused) {
  testing::ScratchDir dir;
  Fixture f;
  const std::string good = dir.file("good.h5");
  write_artifact(testing::random_artifact(f.config, f.fp, 6), good);
  ASSERT_EQ(read_artifact(good).format_version, "1.1");
  struct Edit {
    std::string object;
    std::function<void(h5::File&)> apply;
  };
  const std::vector<Edit> edits = {
      {"/layers/1/kv0/key",
       [](h5::File& file) { file.group("layers").group("1").group("kv0").group("key").set_attr("clip_ratio", 0.5); }},
      {"/recipe", [](h5::File& file) { file.group("recipe").set_attr("method", std::string("hadamard")); }},
      {"/recipe", [](h5::File& file) { H5Adelete(file.group("recipe").id(), "sink"); }},
      {"/recipe/params",
       [](h5::File& file) { file.group("recipe").group("params").set_attr("extra", std::string("1")); }},
      {"/provenance", [](h5::File& file) { file.group("provenance").set_attr("tokens", uint64_t(7)); }},
      {"/", [](h5::File& file) { file.set_attr("command", std::string("kvcc compile elsewhere")); }},
  };
  for (const Edit& e : edits) {
    const std::string path = dir.file("edited.h5");
    testing::write_bytes(path, testing::read_bytes(good));
    {
      h5::File file = h5::File::open_rw(path);
      e.apply(file);
      file.close();  // not re-signed
    }
    const std::string expected =
        path + ": " + e.object + ": attributes edited or corrupt (attributes_sha256 does not match)";
    EXPECT_EQ(error_of([&] { read_artifact(path); }), expected);
    EXPECT_EQ(error_of([&] { verify_artifact_file(path); }), expected);
  }
  // A 1.1 file whose checksums were stripped.
  const std::string path = dir.file("stripped.h5");
  testing::write_bytes(path, testing::read_bytes(good));
  {
    h5::File file = h5::File::open_rw(path);
    H5Adelete(file.group("provenance").id(), h5::kAttributesChecksum);
    file.close();
  }
  EXPECT_EQ(error_of([&] { read_artifact(path); }),
            path + ": /provenance: attributes carry no checksum (attributes_sha256 missing)");
  // Re-signed edits reach the content checks (BadInputGivesClearErrors), and a 1.0 file reads.
  for (const std::string& published : testing::published_artifacts()) {
    const Artifact a = read_artifact(published);
    EXPECT_EQ(a.format_version, "1.0") << published;
    EXPECT_EQ(a.recipe.params.count(h5::kAttributesChecksum), 0u);
  }
}

TEST(ArtifactFormat, VerifyListsEveryProblemAndWriterRefuses) {
  testing::ScratchDir dir;
  Fixture f;
  Artifact a = testing::random_artifact(f.config, f.fp, 7);
  a.head(0, 1).key.eigenvalues[3] = 1e9;        // no longer ascending
  a.head(1, 0).key.levels = {-1, 0.5, 0.2, 1};  // unsorted levels
  a.head(2, 1).value.clip_ratio = 1.5;          // outside (0, 1]
  a.head(2, 0).value.extras[1].data[1] = 2.5;   // integer array with a fraction
  a.recipe.page_size = 0;                       // pages must hold tokens
  const auto problems = verify_artifact(a);
  ASSERT_EQ(problems.size(), 5u);
  EXPECT_EQ(problems[0], "recipe: sink/recent must be >= 0 and page_size > 0");
  EXPECT_EQ(problems[1], "/layers/0/kv1/key/eigenvalues: not in ascending order");
  EXPECT_EQ(problems[2], "/layers/1/kv0/key/levels: not strictly ascending");
  EXPECT_EQ(problems[3], "/layers/2/kv0/value/extras/outlier_channels: integer array holds a non-integer value");
  EXPECT_EQ(problems[4], "/layers/2/kv1/value: clip_ratio 1.500000 is not in (0, 1]");

  EXPECT_EQ(error_of([&] { write_artifact(a, dir.file("bad.h5")); }),
            dir.file("bad.h5") +
                ": refusing to write an invalid artifact: recipe: sink/recent must be >= 0 and page_size > 0"
                " (and 4 more problems)");
  EXPECT_TRUE(dir.entries().empty());

  // Shared per-layer rotations must really be shared; dimensions must match the fingerprint.
  Artifact b = testing::random_artifact(f.config, f.fp, 8);
  b.recipe.granularity = "layer";
  for (int l = 0; l < b.n_layers; ++l) b.head(l, 1) = b.head(l, 0);
  EXPECT_TRUE(verify_artifact(b).empty());
  std::mt19937_64 rng(2);
  b.head(2, 1).key.rotation = testing::random_orthogonal(8, rng);
  b.head_dim = 8;
  b.n_heads = 8;
  const auto p2 = verify_artifact(b);
  ASSERT_EQ(p2.size(), 2u);
  EXPECT_EQ(p2[0], "model n_heads 8 disagrees with the fingerprint (4)");
  EXPECT_EQ(p2[1], "/layers/2/kv1: granularity is layer but its rotation differs from kv0's");
}

}  // namespace
}  // namespace kvcc
