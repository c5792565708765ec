// The zoo: publish (empty and non-empty zoo, duplicates, conflicts, --replace, corrupted
// artifacts, interrupted publishes), verify (missing, corrupt, extra files) and find (a matching
// and a non-matching real model). Expected hashes are recomputed independently of the zoo code.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "formats/artifact.h"
#include "formats/atomic_file.h"
#include "formats/error.h"
#include "formats/model_file.h"
#include "formats/sha256.h"
#include "zoo/zoo.h"

namespace fs = std::filesystem;
using namespace kvcc;

namespace {

const std::string kShared = KVCC_SHARED_DIR;
const std::string kTinyStories = kShared + "/models/tinystories-656k";
const std::string kStories260k = kShared + "/models/stories260k/stories260K.bin";

std::string read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void write_bytes(const fs::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
}

ModelConfig tiny_config() {
  ModelConfig c;
  c.architecture = "llama";
  c.n_layers = 2;
  c.hidden = 32;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.head_dim = 8;
  c.intermediate = 64;
  c.vocab = 100;
  return c;
}

// A small sound artifact: cyclic-shift key rotations (orthogonal), identity value rotations,
// ascending eigenvalues starting at `eig0` (a distinctive value that tests can find in the file).
Artifact small_artifact(const std::string& model_id, const ModelConfig& c, const ModelFingerprint& fp,
                        const std::string& method, double eig0) {
  Artifact a;
  a.producer = "test_zoo";
  a.created = "2026-01-01T00:00:00Z";
  a.command = "test";
  a.model_id = model_id;
  a.fingerprint = fp;
  a.n_layers = c.n_layers;
  a.n_heads = c.n_heads;
  a.n_kv_heads = c.n_kv_heads;
  a.head_dim = c.head_dim;
  a.rope_style = c.rope_style;
  a.recipe.method = method;
  a.recipe.value_target = method == "oscar" ? "output" : "";
  a.recipe.composition = method == "oscar" ? "UHP" : "";
  a.provenance.source = "calibrated";
  a.provenance.tokens = 1234;
  a.provenance.sequences = 5;
  const int d = c.head_dim;
  a.heads.resize(size_t(c.n_layers * c.n_kv_heads));
  for (int l = 0; l < c.n_layers; ++l)
    for (int h = 0; h < c.n_kv_heads; ++h) {
      HeadArtifact& ha = a.head(l, h);
      ha.key.rotation.assign(size_t(d * d), 0.0);
      ha.value.rotation.assign(size_t(d * d), 0.0);
      for (int i = 0; i < d; ++i) {
        ha.key.rotation[size_t(i * d + (i + l + h + 1) % d)] = 1.0;
        ha.value.rotation[size_t(i * d + i)] = 1.0;
        ha.key.eigenvalues.push_back(eig0 + i + 100 * (l * c.n_kv_heads + h));
      }
      ha.key.clip_ratio = 0.95;
      ha.value.clip_ratio = 0.9;
    }
  return a;
}

struct ZooFixture : ::testing::Test {
  fs::path dir;
  fs::path zoo;
  ModelConfig cfg = tiny_config();
  ModelFingerprint fp = make_fingerprint(cfg, sha256_hex("weights of tiny"));

  void SetUp() override {
    dir = fs::temp_directory_path() /
          ("kvcc_test_zoo_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()) + "_" +
           std::to_string(::getpid()));
    fs::remove_all(dir);
    fs::create_directories(dir);
    zoo = dir / "zoo";
  }
  void TearDown() override { fs::remove_all(dir); }

  std::string write(const Artifact& a, const std::string& name) {
    const std::string p = (dir / name).string();
    write_artifact(a, p);
    return p;
  }
};

}  // namespace

TEST_F(ZooFixture, PublishIntoEmptyThenNonEmptyZoo) {
  const std::string a1 = write(small_artifact("tiny", cfg, fp, "oscar", 11.0), "a1.kvcc.h5");
  const std::string a2 = write(small_artifact("tiny", cfg, fp, "hadamard", 22.0), "a2.kvcc.h5");
  ASSERT_FALSE(fs::exists(zoo));
  const zoo::PublishResult r1 = zoo::publish(a1, zoo.string(), {});
  EXPECT_EQ(r1.entry.id, "tiny/oscar-int2-g8-output");
  zoo::Index index = zoo::read_index(zoo.string());
  ASSERT_EQ(index.entries.size(), 1u);
  // The published file is byte-identical to the source, and the index says so.
  const zoo::ZooFile* f = index.entries[0].file("artifact");
  ASSERT_NE(f, nullptr);
  EXPECT_EQ(read_bytes(zoo / f->path), read_bytes(a1));
  EXPECT_EQ(f->sha256, sha256_file_hex(a1));
  EXPECT_EQ(f->size, fs::file_size(a1));
  EXPECT_EQ(index.entries[0].fingerprint.id, fp.id);
  EXPECT_TRUE(fs::exists(zoo / index.entries[0].file("card")->path));
  const nlohmann::json first = zoo::entry_to_json(index.entries[0]);

  zoo::PublishOptions o;
  o.notes = "second recipe";
  o.validation = {{"perplexity", 12.5}, {"kl", 0.01}};
  zoo::publish(a2, zoo.string(), o);
  index = zoo::read_index(zoo.string());
  ASSERT_EQ(index.entries.size(), 2u);
  // The existing entry is untouched.
  EXPECT_EQ(zoo::entry_to_json(*index.find("tiny/oscar-int2-g8-output")), first);
  const zoo::ZooEntry& second = *index.find("tiny/hadamard-int2-g8");
  EXPECT_EQ(second.validation["perplexity"].get<double>(), 12.5);
  const std::string card = read_bytes(zoo / second.file("card")->path);
  EXPECT_NE(card.find("second recipe"), std::string::npos);
  EXPECT_NE(card.find("perplexity"), std::string::npos);
  EXPECT_NE(card.find(fp.id), std::string::npos);
  const zoo::VerifyReport v = zoo::verify_zoo(zoo.string());
  EXPECT_TRUE(v.ok());
  EXPECT_EQ(v.files_checked, 4u);
}

// Plain kivi and its mixed recipe (rotated values) at the same group are different caches: their
// tags differ, so both publish side by side, and the zoo checks them like any other entry.
TEST_F(ZooFixture, KiviAndItsMixedRecipeAreTwoEntries) {
  Artifact plain = small_artifact("tiny", cfg, fp, "kivi", 11.0);
  plain.recipe.group = 16;
  Artifact mixed = plain;
  mixed.recipe.params["values"] = "hadamard";
  EXPECT_EQ(zoo::recipe_tag(plain), "kivi-int2-g16");
  EXPECT_EQ(zoo::recipe_tag(mixed), "kivi-int2-g16-vhadamard");
  Artifact e5m3 = mixed;  // 2-byte key pairs: tagged; fp16, the default, is not
  e5m3.recipe.params["key_params"] = "e5m3";
  EXPECT_EQ(zoo::recipe_tag(e5m3), "kivi-int2-g16-vhadamard-ke5m3");
  e5m3.recipe.params["key_params"] = "fp16";
  EXPECT_EQ(zoo::recipe_tag(e5m3), "kivi-int2-g16-vhadamard");
  const zoo::PublishResult a = zoo::publish(write(plain, "plain.kvcc.h5"), zoo.string(), {});
  const zoo::PublishResult b = zoo::publish(write(mixed, "mixed.kvcc.h5"), zoo.string(), {});
  EXPECT_NE(a.entry.id, b.entry.id);
  EXPECT_EQ(zoo::read_index(zoo.string()).entries.size(), 2u);
  EXPECT_TRUE(zoo::verify_zoo(zoo.string()).ok());
}

TEST_F(ZooFixture, DuplicateAndConflictRefusedUnlessReplace) {
  const std::string a1 = write(small_artifact("tiny", cfg, fp, "oscar", 11.0), "a1.kvcc.h5");
  zoo::publish(a1, zoo.string(), {});
  const std::string index_before = read_bytes(zoo / "index.json");
  // The same artifact again.
  try {
    zoo::publish(a1, zoo.string(), {});
    FAIL() << "duplicate accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("already exists"), std::string::npos) << e.what();
  }
  // Another artifact with the same id (same model and recipe).
  const std::string a1b = write(small_artifact("tiny", cfg, fp, "oscar", 33.0), "a1b.kvcc.h5");
  EXPECT_THROW(zoo::publish(a1b, zoo.string(), {}), Error);
  // The same model id naming another model.
  ModelConfig other = cfg;
  other.n_layers = 3;
  const ModelFingerprint other_fp = make_fingerprint(other, sha256_hex("other weights"));
  const std::string a3 = write(small_artifact("tiny", other, other_fp, "hadamard", 44.0), "a3.kvcc.h5");
  try {
    zoo::publish(a3, zoo.string(), {});
    FAIL() << "conflict accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("n_layers: 2 vs 3"), std::string::npos) << e.what();
  }
  EXPECT_EQ(read_bytes(zoo / "index.json"), index_before);
  EXPECT_TRUE(zoo::verify_zoo(zoo.string()).ok());

  // --replace: the new artifact takes the entry; the old files go.
  const std::string old_path = zoo::read_index(zoo.string()).entries[0].file("artifact")->path;
  zoo::PublishOptions o;
  o.replace = true;
  const zoo::PublishResult r = zoo::publish(a1b, zoo.string(), o);
  EXPECT_EQ(r.replaced, std::vector<std::string>{"tiny/oscar-int2-g8-output"});
  const zoo::Index index = zoo::read_index(zoo.string());
  ASSERT_EQ(index.entries.size(), 1u);
  EXPECT_EQ(index.entries[0].file("artifact")->sha256, sha256_file_hex(a1b));
  EXPECT_FALSE(fs::exists(zoo / old_path));
  EXPECT_TRUE(zoo::verify_zoo(zoo.string()).ok());
}

TEST_F(ZooFixture, CorruptedArtifactRefused) {
  const std::string good = write(small_artifact("tiny", cfg, fp, "oscar", 12345.678), "good.kvcc.h5");
  zoo::publish(write(small_artifact("tiny", cfg, fp, "hadamard", 1.0), "h.kvcc.h5"), zoo.string(), {});
  const std::string index_before = read_bytes(zoo / "index.json");
  // Change one stored eigenvalue (found by its bytes) without touching the dataset's checksum.
  std::string bytes = read_bytes(good);
  const double target = 12345.678;
  const std::string pattern(reinterpret_cast<const char*>(&target), sizeof target);
  const size_t at = bytes.find(pattern);
  ASSERT_NE(at, std::string::npos) << "eigenvalue bytes not found in the artifact";
  bytes[at] ^= 0x01;
  const fs::path bad = dir / "bad.kvcc.h5";
  write_bytes(bad, bytes);
  EXPECT_THROW(zoo::publish(bad.string(), zoo.string(), {}), Error);
  // Truncated.
  write_bytes(bad, read_bytes(good).substr(0, fs::file_size(good) / 2));
  EXPECT_THROW(zoo::publish(bad.string(), zoo.string(), {}), Error);
  // Unsound content with valid checksums: a rotation that is not orthogonal.
  Artifact skew = small_artifact("tiny", cfg, fp, "oscar", 5.0);
  skew.head(1, 1).key.rotation[0] = 0.5;
  EXPECT_THROW(write(skew, "skew.kvcc.h5"), Error);  // the writer already refuses it
  EXPECT_EQ(read_bytes(zoo / "index.json"), index_before);
  EXPECT_TRUE(zoo::verify_zoo(zoo.string()).ok());  // nothing was left behind
}

TEST_F(ZooFixture, InterruptedPublishLeavesTheOldZooValid) {
  const std::string a1 = write(small_artifact("tiny", cfg, fp, "oscar", 11.0), "a1.kvcc.h5");
  const std::string a2 = write(small_artifact("tiny", cfg, fp, "hadamard", 22.0), "a2.kvcc.h5");
  const std::string a1b = write(small_artifact("tiny", cfg, fp, "oscar", 33.0), "a1b.kvcc.h5");
  zoo::publish(a1, zoo.string(), {});
  const std::string index_before = read_bytes(zoo / "index.json");

  // An error inside the publish (the index rename never happens): everything is rolled back.
  for (const char* stage : {"files_written", "index_temp_written"}) {
    zoo::PublishOptions o;
    o.on_stage = [&](const std::string& s) {
      if (s == stage) throw Error(std::string("simulated failure at ") + stage);
    };
    EXPECT_THROW(zoo::publish(a2, zoo.string(), o), Error);
    EXPECT_EQ(read_bytes(zoo / "index.json"), index_before) << stage;
    const zoo::VerifyReport v = zoo::verify_zoo(zoo.string());
    EXPECT_TRUE(v.ok()) << stage << ": " << (v.extra.empty() ? "" : v.extra[0]);
  }

  // A crash (the process dies at that point, nothing is cleaned up), also while replacing.
  for (const char* stage : {"files_written", "index_temp_written"}) {
    for (bool replace : {false, true}) {
      const pid_t pid = ::fork();
      ASSERT_GE(pid, 0);
      if (pid == 0) {
        zoo::PublishOptions o;
        o.replace = replace;
        o.on_stage = [&](const std::string& s) {
          if (s == stage) ::_exit(3);
        };
        try {
          zoo::publish(replace ? a1b : a2, zoo.string(), o);
        } catch (...) {}
        ::_exit(0);
      }
      int status = 0;
      ::waitpid(pid, &status, 0);
      ASSERT_TRUE(WIFEXITED(status));
      EXPECT_EQ(WEXITSTATUS(status), 3) << "the hook was not reached at " << stage;
      // The old index is intact and valid, its entry verifies; the crash's files are only "extra".
      EXPECT_EQ(read_bytes(zoo / "index.json"), index_before);
      const zoo::Index index = zoo::read_index(zoo.string());
      ASSERT_EQ(index.entries.size(), 1u);
      const zoo::VerifyReport v = zoo::verify_zoo(zoo.string());
      EXPECT_TRUE(v.missing.empty());
      EXPECT_TRUE(v.corrupt.empty());
      EXPECT_FALSE(v.extra.empty());
      for (const auto& x : v.extra) fs::remove(zoo / x.substr(0, x.find(' ')));
      EXPECT_TRUE(zoo::verify_zoo(zoo.string()).ok());
    }
  }
  // After the crashes, a publish goes through.
  zoo::publish(a2, zoo.string(), {});
  EXPECT_EQ(zoo::read_index(zoo.string()).entries.size(), 2u);
  EXPECT_TRUE(zoo::verify_zoo(zoo.string()).ok());
}

TEST_F(ZooFixture, VerifyFindsCorruptMissingAndExtraFiles) {
  zoo::publish(write(small_artifact("tiny", cfg, fp, "oscar", 11.0), "a1.kvcc.h5"), zoo.string(), {});
  zoo::publish(write(small_artifact("tiny", cfg, fp, "hadamard", 22.0), "a2.kvcc.h5"), zoo.string(), {});
  const zoo::Index index = zoo::read_index(zoo.string());
  const fs::path art = zoo / index.entries[0].file("artifact")->path;
  const fs::path card = zoo / index.entries[1].file("card")->path;
  std::string bytes = read_bytes(art);
  bytes[bytes.size() / 2] ^= 0x40;  // same size, different content
  write_bytes(art, bytes);
  fs::remove(card);
  write_bytes(zoo / "tiny" / "stray.txt", "x");
  write_bytes(zoo / ".gitattributes", "*.h5 binary\n");  // hidden files are the host's business
  const zoo::VerifyReport v = zoo::verify_zoo(zoo.string());
  EXPECT_FALSE(v.ok());
  ASSERT_EQ(v.corrupt.size(), 1u);
  EXPECT_EQ(v.corrupt[0].find(index.entries[0].file("artifact")->path), 0u);
  ASSERT_EQ(v.missing.size(), 1u);
  EXPECT_EQ(v.missing[0].find(index.entries[1].file("card")->path), 0u);
  ASSERT_EQ(v.extra.size(), 1u);
  EXPECT_EQ(v.extra[0], "tiny/stray.txt");
  // The command line reports the same and fails.
  const std::string cmd =
      std::string(KVCC_BINARY) + " zoo verify --zoo " + zoo.string() + " > " + (dir / "out.txt").string();
  EXPECT_NE(std::system(cmd.c_str()), 0);
  const std::string out = read_bytes(dir / "out.txt");
  EXPECT_NE(out.find("corrupt: "), std::string::npos) << out;
  EXPECT_NE(out.find("missing: "), std::string::npos) << out;
  EXPECT_NE(out.find("extra:   tiny/stray.txt"), std::string::npos) << out;
}

TEST_F(ZooFixture, IndexSchemaErrors) {
  EXPECT_THROW(zoo::read_index(zoo.string()), Error);  // no zoo there
  fs::create_directories(zoo);
  write_bytes(zoo / "index.json", "{not json");
  EXPECT_THROW(zoo::read_index(zoo.string()), Error);
  write_bytes(zoo / "index.json", R"({"format": "kvcc-zoo", "format_version": 99, "entries": []})");
  EXPECT_THROW(zoo::read_index(zoo.string()), Error);
  // Mistyped fields and a number no double holds are kvcc::Error, not a JSON library exception
  // (found by fuzz_zoo_index).
  write_bytes(zoo / "index.json", R"({"format": 1, "format_version": 1, "entries": []})");
  EXPECT_THROW(zoo::read_index(zoo.string()), Error);
  write_bytes(zoo / "index.json", R"({"format": "kvcc-zoo", "format_version": "1", "entries": []})");
  EXPECT_THROW(zoo::read_index(zoo.string()), Error);
  write_bytes(zoo / "index.json", R"({"format": "kvcc-zoo", "format_version": 1e999, "entries": []})");
  EXPECT_THROW(zoo::read_index(zoo.string()), Error);
  // A file path that leaves the zoo.
  zoo::publish(write(small_artifact("tiny", cfg, fp, "oscar", 11.0), "a1.kvcc.h5"), (dir / "z2").string(), {});
  std::string idx = read_bytes(dir / "z2" / "index.json");
  const size_t at = idx.find("\"tiny/oscar");
  idx.replace(at, 1, "\"../");
  write_bytes(zoo / "index.json", idx);
  EXPECT_THROW(zoo::read_index(zoo.string()), Error);
}

TEST_F(ZooFixture, FindMatchingAndNonMatchingModel) {
  if (!fs::exists(kTinyStories) || !fs::exists(kStories260k))
    GTEST_SKIP() << "models not found under " << kShared << "/models (../shared absent)";
  const ModelFile tiny = ModelFile::open(kTinyStories);
  const std::string art =
      write(small_artifact("tinystories-656k", tiny.config(), tiny.fingerprint(), "oscar", 7.0), "ts.kvcc.h5");
  zoo::publish(art, zoo.string(), {});
  const zoo::Index index = zoo::read_index(zoo.string());

  const zoo::FindResult hit = zoo::find_for_fingerprint(index, ModelFile::open(kTinyStories).fingerprint());
  ASSERT_EQ(hit.matches.size(), 1u);
  EXPECT_EQ(hit.matches[0]->model_id, "tinystories-656k");

  const ModelFile other = ModelFile::open(kStories260k);
  const zoo::FindResult miss = zoo::find_for_fingerprint(index, other.fingerprint());
  EXPECT_TRUE(miss.matches.empty());
  ASSERT_NE(miss.closest, nullptr);
  EXPECT_NE(miss.closest_difference.find("n_layers: 2 vs 5"), std::string::npos) << miss.closest_difference;

  // Through the command line: a listing for the match, a one-line error naming the closest entry.
  const std::string out = (dir / "find.txt").string();
  EXPECT_EQ(std::system((std::string(KVCC_BINARY) + " zoo find --model " + kTinyStories + " --zoo " + zoo.string() +
                         " > " + out)
                            .c_str()),
            0);
  EXPECT_NE(read_bytes(out).find("tinystories-656k/oscar"), std::string::npos);
  EXPECT_NE(std::system((std::string(KVCC_BINARY) + " zoo find --model " + kStories260k + " --zoo " + zoo.string() +
                         " 2> " + out)
                            .c_str()),
            0);
  const std::string err = read_bytes(out);
  EXPECT_NE(err.find("no entry"), std::string::npos) << err;
  EXPECT_NE(err.find("closest: tinystories-656k/oscar"), std::string::npos) << err;
}

TEST_F(ZooFixture, CommandLinePublishListShow) {
  const std::string a1 = write(small_artifact("tiny", cfg, fp, "oscar", 11.0), "a1.kvcc.h5");
  const std::string kvcc = KVCC_BINARY;
  const std::string out = (dir / "out.txt").string();
  ASSERT_EQ(
      std::system(
          (kvcc + " zoo publish " + a1 + " --zoo " + zoo.string() + " --card-notes 'first notes' > " + out).c_str()),
      0);
  const std::string err = (dir / "err.txt").string();
  EXPECT_NE(std::system((kvcc + " zoo publish " + a1 + " --zoo " + zoo.string() + " 2> " + err).c_str()), 0);
  EXPECT_NE(read_bytes(err).find("--replace"), std::string::npos) << read_bytes(err);
  EXPECT_EQ(std::system((kvcc + " zoo publish " + a1 + " --zoo " + zoo.string() +
                         " --replace --card-notes 'cli notes' > " + out)
                            .c_str()),
            0);
  ASSERT_EQ(std::system((kvcc + " zoo list --zoo " + zoo.string() + " > " + out).c_str()), 0);
  EXPECT_NE(read_bytes(out).find("tiny/oscar-int2-g8-output"), std::string::npos);
  ASSERT_EQ(std::system((kvcc + " zoo show tiny --zoo " + zoo.string() + " --card > " + out).c_str()), 0);
  EXPECT_NE(read_bytes(out).find("cli notes"), std::string::npos);
  ASSERT_EQ(std::system((kvcc + " zoo verify --zoo " + zoo.string() + " > " + out).c_str()), 0);
}

// Publishers running at once into one zoo take turns on the index (a lock held from reading it
// to replacing it): every one of them exits 0 and every entry is in the index afterwards.
TEST_F(ZooFixture, ConcurrentPublishersLoseNoEntry) {
  constexpr int kPublishers = 6, kRounds = 8;
  std::vector<std::string> artifacts;
  for (int i = 0; i < kPublishers; ++i)
    artifacts.push_back(write(small_artifact("m" + std::to_string(i), cfg, fp, "oscar", 3.0 + i),
                              "p" + std::to_string(i) + ".kvcc.h5"));
  for (int round = 0; round < kRounds; ++round) {
    const fs::path z = dir / ("zoo" + std::to_string(round));
    std::string cmd = "cd " + dir.string() + " && fails=0; pids=''; ";
    for (const auto& a : artifacts)
      cmd +=
          std::string(KVCC_BINARY) + " zoo publish " + a + " --zoo " + z.string() + " >/dev/null & pids=\"$pids $!\"; ";
    cmd += "for p in $pids; do wait $p || fails=$((fails+1)); done; exit $fails";
    ASSERT_EQ(std::system(cmd.c_str()), 0) << "round " << round;
    const zoo::Index index = zoo::read_index(z.string());
    EXPECT_EQ(index.entries.size(), size_t(kPublishers)) << "round " << round;
    const zoo::VerifyReport report = zoo::verify_zoo(z.string());
    EXPECT_TRUE(report.ok()) << "round " << round;
  }
}
