// The inspect, verify and merge-stats subcommands, run as a user would (the built kvcc binary):
// exit codes, what they print, and that errors are a single stderr line without HDF5 dumps and
// leave no output behind.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <cmath>

#include <nlohmann/json.hpp>

#include "formats/artifact.h"
#include "formats/h5.h"
#include "formats/kv_codec.h"
#include "formats/method.h"
#include "formats/stats.h"
#include "formats_test_util.h"

namespace kvcc {
namespace {

struct RunResult {
  int exit_code;
  std::string out, err;
};

RunResult run_kvcc(const testing::ScratchDir& dir, const std::string& args) {
  const std::string out = dir.path() + "/../" + "kvcc_cli_stdout_" + std::to_string(::getpid());
  const std::string err = out + ".err";
  const std::string cmd = std::string(KVCC_BINARY) + " " + args + " >" + out + " 2>" + err;
  const int status = std::system(cmd.c_str());
  RunResult r{WIFEXITED(status) ? WEXITSTATUS(status) : -1, testing::read_bytes(out), testing::read_bytes(err)};
  std::remove(out.c_str());
  std::remove(err.c_str());
  return r;
}

size_t line_count(const std::string& s) { return size_t(std::count(s.begin(), s.end(), '\n')); }

void expect_one_line_error(const RunResult& r, const std::string& needle) {
  EXPECT_NE(r.exit_code, 0);
  EXPECT_EQ(line_count(r.err), 1u) << r.err;
  EXPECT_EQ(r.err.rfind("kvcc: error: ", 0), 0u) << r.err;
  EXPECT_NE(r.err.find(needle), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("HDF5-DIAG"), std::string::npos) << r.err;
}

class FormatsCli : public ::testing::Test {
 protected:
  void SetUp() override {
    if (::access(KVCC_BINARY, X_OK) != 0) GTEST_SKIP() << "kvcc binary not built at " << KVCC_BINARY;
  }
  testing::ScratchDir dir;
  ModelConfig config = testing::small_config(2, 4, 2, 8);
  ModelFingerprint fp = testing::small_fingerprint(config);
};

// compile checks its options against the method table before reading the stats: an option the
// method ignores is one line naming it and the methods that take it, and nothing is written.
TEST_F(FormatsCli, CompileRefusesOptionsTheMethodIgnores) {
  write_stats(testing::random_stats(config, fp, 6, 10, 1).stats, dir.file("s.h5"));
  const std::string base = "compile " + dir.file("s.h5") + " -o " + dir.file("a.kvcc.h5") + " ";
  expect_one_line_error(run_kvcc(dir, base + "-m hadamard --seed 3"),
                        "--seed applies to random, turboquant and commvq only, not hadamard");
  expect_one_line_error(run_kvcc(dir, base + "-m hadamard --values oscar"),
                        "--values applies to kivi only, not hadamard");
  expect_one_line_error(run_kvcc(dir, base + "-m kivi --values random"),
                        "kivi values must be hadamard or oscar, got 'random'");
  expect_one_line_error(run_kvcc(dir, base + "-m kivi --values hadamard --composition UH"),
                        "--composition applies to oscar, oscar-lm and kivi --values oscar only, not kivi");
  expect_one_line_error(run_kvcc(dir, base + "-m hadamard --param variant=prod"),
                        "--param variant applies to oscar and turboquant only, not hadamard");
  expect_one_line_error(run_kvcc(dir, base + "-m oscar --param variant=published --value-target p2"),
                        "oscar variant=published fits OSCAR's own value target logit2");
  expect_one_line_error(run_kvcc(dir, base + "-m oscar-lm --no-fit-clip"), "--no-fit-clip applies to oscar, ");
  expect_one_line_error(run_kvcc(dir, base + "-m kvarn --granularity layer"),
                        "--granularity applies to oscar, oscar-lm, random and kivi --values oscar only, not kvarn");
  expect_one_line_error(run_kvcc(dir, base + "-m bogus"),
                        "unknown method 'bogus' (expected oscar, oscar-lm, hadamard, identity, random, turboquant, "
                        "kivi, kvarn or commvq)");
  // The model that weighs --bits-budget comes with the budget and one source of text.
  expect_one_line_error(run_kvcc(dir, base + "-m hadamard --sensitivity-model M --sensitivity-data t.txt"),
                        "--sensitivity-model weighs --bits-budget's choice: give --bits-budget too");
  expect_one_line_error(run_kvcc(dir, base + "-m hadamard --bits-budget 2.3 --sensitivity-data t.txt"),
                        "--sensitivity-data, --sensitivity-ids and --sensitivity-tokens need --sensitivity-model");
  expect_one_line_error(run_kvcc(dir, base + "-m hadamard --bits-budget 2.3 --sensitivity-model M"),
                        "--sensitivity-model needs one of --sensitivity-data TEXT or --sensitivity-ids FILE");
  expect_one_line_error(
      run_kvcc(dir,
               base + "-m hadamard --bits-budget 2.3 --sensitivity-model M --sensitivity-data t --sensitivity-ids i"),
      "--sensitivity-model needs one of --sensitivity-data TEXT or --sensitivity-ids FILE");
  EXPECT_FALSE(testing::file_exists(dir.file("a.kvcc.h5")));
  // --help lists every method of the table with its summary.
  const RunResult help = run_kvcc(dir, "compile --help");
  EXPECT_EQ(help.exit_code, 0);
  for (Method m : all_methods())
    EXPECT_NE(help.out.find("\n  " + std::string(method_name(m)) + " "), std::string::npos) << method_name(m);
}

// eviction's block-wise prefill refuses what it cannot measure before opening anything.
// compile's summary prints the artifact's bits in both accountings, as the library computes them
// for the written file: effective (the published one: every token past sink + recent quantised)
// and stored (whole pages), the stored below the effective by the ring's partial page.
TEST_F(FormatsCli, CompilePrintsEffectiveAndStoredBits) {
  write_stats(testing::random_stats(config, fp, 6, 40, 5).stats, dir.file("s.h5"));
  const std::string path = dir.file("a.kvcc.h5");
  const RunResult r = run_kvcc(dir, "compile " + dir.file("s.h5") +
                                        " -m hadamard --sink 4 --recent 64 --page-size 16 "
                                        "--threads 1 -o " +
                                        path);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const Artifact a = read_artifact(path);
  const size_t eff = r.out.find("effective (with BF16 sink+recent) "), st = r.out.find("stored (whole pages) ");
  ASSERT_NE(eff, std::string::npos) << r.out;
  ASSERT_NE(st, std::string::npos) << r.out;
  double e[3], s[3];
  ASSERT_EQ(std::sscanf(r.out.c_str() + eff, "effective (with BF16 sink+recent) %lf at 2048 tokens, %lf at 32768, %lf",
                        &e[0], &e[1], &e[2]),
            3)
      << r.out;
  ASSERT_EQ(std::sscanf(r.out.c_str() + st, "stored (whole pages) %lf, %lf, %lf", &s[0], &s[1], &s[2]), 3) << r.out;
  const int64_t ctx[3] = {2048, 32768, 131072};
  for (int i = 0; i < 3; ++i) {
    EXPECT_NEAR(e[i], effective_bits(a, ctx[i]), 5e-4) << ctx[i];  // printed to 3 decimals
    EXPECT_NEAR(s[i], stored_bits(a, ctx[i]), 5e-4) << ctx[i];
  }
  EXPECT_LT(stored_bits(a, 2048), effective_bits(a, 2048));
}

TEST_F(FormatsCli, EvictionRefusesWhatBlockWisePrefillCannotRun) {
  const std::string base = "eviction --model " + dir.file("m") + " --data " + dir.file("t.txt") + " ";
  expect_one_line_error(run_kvcc(dir, base + "--prefill-block 64 --scores snapkv,emitted"),
                        "--scores emitted is measured on the whole prefill only");
  expect_one_line_error(run_kvcc(dir, base + "--history 512 --prefill-block 1024"),
                        "--prefill-block 1024 is longer than the history (512 tokens)");
  const RunResult negative = run_kvcc(dir, base + "--prefill-block -1");
  EXPECT_NE(negative.exit_code, 0);
  EXPECT_NE(negative.err.find("--prefill-block"), std::string::npos) << negative.err;
}

TEST_F(FormatsCli, MergeStats) {
  write_stats(testing::random_stats(config, fp, 6, 10, 1).stats, dir.file("a.h5"));
  write_stats(testing::random_stats(config, fp, 6, 15, 2).stats, dir.file("b.h5"));
  write_stats(testing::random_stats(config, fp, 6, 20, 3).stats, dir.file("c.h5"));
  RunResult r = run_kvcc(dir, dir.file("a.h5") + " " + dir.file("b.h5"));  // no subcommand
  EXPECT_NE(r.exit_code, 0);

  r = run_kvcc(dir, "merge-stats " + dir.file("a.h5") + " " + dir.file("b.h5") + " " + dir.file("c.h5") + " -o " +
                        dir.file("merged.h5"));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const Stats merged = read_stats(dir.file("merged.h5"));
  EXPECT_EQ(merged.provenance.tokens, 45u);
  EXPECT_EQ(merged.head(1, 1).kv_count, 45u);
  EXPECT_NE(merged.command.find("merge-stats"), std::string::npos);
  EXPECT_NE(r.out.find("45 tokens"), std::string::npos) << r.out;

  const ModelConfig other = testing::small_config(2, 4, 2, 16);
  write_stats(testing::random_stats(other, testing::small_fingerprint(other), 6, 5, 4).stats, dir.file("x.h5"));
  r = run_kvcc(dir, "merge-stats " + dir.file("a.h5") + " " + dir.file("x.h5") + " -o " + dir.file("bad.h5"));
  expect_one_line_error(r, "different models: hidden: 32 vs 64; head_dim: 8 vs 16");
  EXPECT_FALSE(testing::file_exists(dir.file("bad.h5")));
  EXPECT_TRUE(dir.temporaries().empty());

  r = run_kvcc(dir, "merge-stats " + dir.file("a.h5") + " " + dir.file("missing.h5") + " -o " + dir.file("bad.h5"));
  expect_one_line_error(r, "missing.h5: no such file");
  EXPECT_FALSE(testing::file_exists(dir.file("bad.h5")));
}

TEST_F(FormatsCli, InspectAndVerifyArtifact) {
  const std::string path = dir.file("model.kvcc.h5");
  write_artifact(testing::random_artifact(config, fp, 1), path);
  RunResult r = run_kvcc(dir, "inspect " + path);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find(fp.id), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("method      oscar"), std::string::npos) << r.out;

  r = run_kvcc(dir, "inspect --json " + path);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["model"]["fingerprint"]["id"], fp.id);
  EXPECT_EQ(j["recipe"]["method"], "oscar");
  EXPECT_EQ(j["layers"].size(), 2u);
  // The JSON eigenvalue range of layer 1's keys is the min/max over its KV heads.
  const Artifact a = read_artifact(path);
  const double lo = std::min(a.head(1, 0).key.eigenvalues.front(), a.head(1, 1).key.eigenvalues.front());
  const double hi = std::max(a.head(1, 0).key.eigenvalues.back(), a.head(1, 1).key.eigenvalues.back());
  EXPECT_EQ(j["layers"][1]["key"]["eigenvalue_range"][0].get<double>(), lo);
  EXPECT_EQ(j["layers"][1]["key"]["eigenvalue_range"][1].get<double>(), hi);

  r = run_kvcc(dir, "verify " + path);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out.rfind("OK ", 0), 0u) << r.out;
  EXPECT_NE(r.out.find("sha256 of 28 datasets"), std::string::npos)
      << r.out;  // 4 heads x (key: rot, eig, levels; value: rot, eig, 2 extras)

  // Layer budgets: one dataset more, format 1.2, a column of inspect and a field of its JSON.
  {
    Artifact b = testing::random_artifact(config, fp, 1);
    b.layer_budgets = {0.75, 1.25};
    const std::string with = dir.file("budgets.kvcc.h5");
    write_artifact(b, with);
    RunResult v = run_kvcc(dir, "verify " + with);
    ASSERT_EQ(v.exit_code, 0) << v.err;
    EXPECT_NE(v.out.find("kvcc-artifact 1.2"), std::string::npos) << v.out;
    EXPECT_NE(v.out.find("sha256 of 29 datasets"), std::string::npos) << v.out;
    v = run_kvcc(dir, "inspect " + with);
    ASSERT_EQ(v.exit_code, 0) << v.err;
    EXPECT_NE(v.out.find("evict budget"), std::string::npos) << v.out;
    EXPECT_NE(v.out.find(" 1.250\n"), std::string::npos) << v.out;
    v = run_kvcc(dir, "inspect --json " + with);
    ASSERT_EQ(v.exit_code, 0) << v.err;
    EXPECT_EQ(nlohmann::json::parse(v.out)["layers"][1]["eviction_budget"].get<double>(), 1.25);
  }

  // Flip the lowest byte of one rotation value: verify names the dataset, exit 1.
  int64_t offset;
  {
    h5::File f = h5::File::open(path);
    offset = f.group("layers").group("1").group("kv1").group("value").dataset("rotation").file_offset();
  }
  std::string bytes = testing::read_bytes(path);
  bytes[size_t(offset)] ^= 1;
  testing::write_bytes(path, bytes);
  r = run_kvcc(dir, "verify " + path);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.out.find("FAIL " + path + ": checksum mismatch in /layers/1/kv1/value/rotation"), std::string::npos)
      << r.out;
  expect_one_line_error(r, "failed verification (1 problem)");
  r = run_kvcc(dir, "inspect " + path);
  expect_one_line_error(r, "checksum mismatch in /layers/1/kv1/value/rotation");
}

TEST_F(FormatsCli, InspectAndVerifyStats) {
  const std::string path = dir.file("stats.h5");
  write_stats(testing::random_stats(config, fp, 6, 10, 1).stats, path);
  RunResult r = run_kvcc(dir, "inspect " + path);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find(fp.id), std::string::npos) << r.out;
  r = run_kvcc(dir, "inspect " + path + " --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["provenance"]["tokens"], 10);
  EXPECT_EQ(j["layers"][0]["heads"][1]["kv_count"], 10);
  EXPECT_EQ(j["layers"][0]["heads"][1]["reservoir"]["rows"], 6);
  // Random Gaussian queries: effective rank between 1 and d.
  const double rank = j["layers"][0]["heads"][1]["query_spectrum"]["effective_rank"];
  EXPECT_GT(rank, 1.0);
  EXPECT_LE(rank, 8.0);

  r = run_kvcc(dir, "verify " + path);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out.rfind("OK ", 0), 0u) << r.out;

  // NaN in a sum: verify lists it, inspect refuses it.
  {
    h5::File f = h5::File::open_rw(path);
    h5::Dataset ds = f.group("layers").group("1").group("kv0").dataset("key_m2");
    std::vector<double> v(64, 0.0);
    v[0] = std::nan("");
    H5Dwrite(ds.id(), H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data());
    h5::seal_attributes(f);
    f.close();
  }
  r = run_kvcc(dir, "verify " + path);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.out.find("/layers/1/kv0/key_m2: contains NaN or inf"), std::string::npos) << r.out;
  r = run_kvcc(dir, "inspect " + path);
  expect_one_line_error(r, "/layers/1/kv0/key_m2: contains NaN or inf");
}

TEST_F(FormatsCli, BadFilesGiveOneLineErrors) {
  testing::write_bytes(dir.file("notes.txt"), "not hdf5\n");
  expect_one_line_error(run_kvcc(dir, "inspect " + dir.file("notes.txt")), "not an HDF5 file (or truncated)");
  expect_one_line_error(run_kvcc(dir, "verify " + dir.file("notes.txt")), "not an HDF5 file (or truncated)");
  expect_one_line_error(run_kvcc(dir, "verify " + dir.file("absent.h5")), "absent.h5: no such file");

  write_stats(testing::random_stats(config, fp, 6, 10, 1).stats, dir.file("s.h5"));
  const std::string bytes = testing::read_bytes(dir.file("s.h5"));
  testing::write_bytes(dir.file("cut.h5"), bytes.substr(0, bytes.size() / 2));
  expect_one_line_error(run_kvcc(dir, "inspect " + dir.file("cut.h5")),
                        "truncated HDF5 file (" + std::to_string(bytes.size() / 2) + " of its ");
  {
    h5::File f = h5::File::open_rw(dir.file("s.h5"));
    f.set_attr("format_version", std::string("2.1"));
    h5::seal_attributes(f);
    f.close();
  }
  expect_one_line_error(run_kvcc(dir, "verify " + dir.file("s.h5")), "format_version 2.1 is not supported");
  {
    h5::File f = h5::File::create(dir.file("plain.h5"));
    f.close();
  }
  expect_one_line_error(run_kvcc(dir, "inspect " + dir.file("plain.h5")), "without a root 'format' attribute");

  const RunResult help = run_kvcc(dir, "inspect --help");
  EXPECT_EQ(help.exit_code, 0);
  EXPECT_NE(help.out.find("Example"), std::string::npos);
}

}  // namespace
}  // namespace kvcc

namespace kvcc {
namespace {

// The subcommands on a real model (../shared: skipped when absent).
class FormatsCliRealModel : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!testing::file_exists(model + "/model.safetensors") || !testing::file_exists(text))
      GTEST_SKIP() << "needs ../shared/models/tinystories-656k and ../shared/text (absent)";
    if (::access(KVCC_BINARY, X_OK) != 0) GTEST_SKIP() << "kvcc binary not built at " << KVCC_BINARY;
  }
  const std::string model = std::string(KVCC_SHARED_DIR) + "/models/tinystories-656k";
  const std::string text = std::string(KVCC_SHARED_DIR) + "/text/tinystories_valid_100.txt";
  testing::ScratchDir dir;
};

// `kvcc tokenize` writes what validate reads from --data: the same validation from the ids file
// and from the text gives the same numbers; a missing text is a one-line error and writes nothing.
TEST_F(FormatsCliRealModel, TokenizedIdsValidateLikeTheText) {
  RunResult r = run_kvcc(dir, "tokenize --model " + model + " --data " + text + " -o " + dir.file("t.ids"));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("100 documents"), std::string::npos) << r.out;
  // A 2-bit artifact compiled here from a short calibration (the zoo's may change).
  ASSERT_EQ(
      run_kvcc(dir, "calibrate-model --model " + model + " --data " + text + " --tokens 3000 -o " + dir.file("s.h5"))
          .exit_code,
      0);
  ASSERT_EQ(run_kvcc(dir, "compile " + dir.file("s.h5") + " -m hadamard -o " + dir.file("a.kvcc.h5")).exit_code, 0);
  const std::string common = " --model " + model + " -a " + dir.file("a.kvcc.h5") +
                             " --tokens 1500 --sink 4 --recent 32 --page-size 32 --json ";
  ASSERT_EQ(run_kvcc(dir, "validate" + common + dir.file("text.json") + " --data " + text).exit_code, 0);
  ASSERT_EQ(run_kvcc(dir, "validate" + common + dir.file("ids.json") + " --ids " + dir.file("t.ids")).exit_code, 0);
  const auto a = nlohmann::json::parse(testing::read_bytes(dir.file("text.json")));
  const auto b = nlohmann::json::parse(testing::read_bytes(dir.file("ids.json")));
  EXPECT_EQ(a["tokens"], b["tokens"]);
  EXPECT_EQ(a["doc_lengths"], b["doc_lengths"]);
  EXPECT_GT(a["tokens"].get<int>(), 1000);
  EXPECT_EQ(a["schemes"][0]["nll"], b["schemes"][0]["nll"]);
  EXPECT_EQ(a["schemes"][0]["kl"], b["schemes"][0]["kl"]);
  EXPECT_GT(a["schemes"][0]["kl"].get<double>(), 0.0);
  expect_one_line_error(
      run_kvcc(dir, "tokenize --model " + model + " --data " + dir.file("none.txt") + " -o " + dir.file("n.ids")),
      "none.txt");
  EXPECT_FALSE(testing::file_exists(dir.file("n.ids")));
}

// End to end on a real model: calibrating two document shards and merging them equals one run
// over all documents (sums up to float64 rounding, reservoirs exactly), the contract that lets
// calibration scale out.
TEST_F(FormatsCliRealModel, ShardedCalibrationMergesToFullRun) {
  const std::string common = " --model " + model + " --data " + text + " --tokens 2000 --reservoir 128";
  auto run = [&](const std::string& args) { return run_kvcc(dir, args).exit_code; };
  ASSERT_EQ(run("calibrate-model" + common + " -o " + dir.file("full.h5")), 0);
  ASSERT_EQ(run("calibrate-model" + common + " --shard 0/2 -o " + dir.file("s0.h5")), 0);
  ASSERT_EQ(run("calibrate-model" + common + " --shard 1/2 -o " + dir.file("s1.h5")), 0);
  ASSERT_EQ(run("merge-stats " + dir.file("s0.h5") + " " + dir.file("s1.h5") + " -o " + dir.file("m.h5")), 0);
  const Stats full = read_stats(dir.file("full.h5"));
  const Stats merged = read_stats(dir.file("m.h5"));
  EXPECT_TRUE(full.fingerprint.matches(merged.fingerprint));
  EXPECT_EQ(merged.provenance.tokens, full.provenance.tokens);
  EXPECT_EQ(merged.provenance.sequences, full.provenance.sequences);
  ASSERT_EQ(full.heads.size(), merged.heads.size());
  for (size_t i = 0; i < full.heads.size(); ++i) {
    const HeadStats &x = full.heads[i], &y = merged.heads[i];
    EXPECT_EQ(x.query_count, y.query_count);
    EXPECT_EQ(x.kv_count, y.kv_count);
    for (auto member :
         {&HeadStats::query_m2, &HeadStats::output_m2, &HeadStats::p2_m2, &HeadStats::key_m2, &HeadStats::value_m2}) {
      const auto &a = x.*member, &b = y.*member;
      double scale = 0, diff = 0;
      for (size_t k = 0; k < a.size(); ++k) {
        scale = std::max(scale, std::abs(a[k]));
        diff = std::max(diff, std::abs(a[k] - b[k]));
      }
      EXPECT_LE(diff, 1e-9 * scale) << "head " << i;
    }
    EXPECT_EQ(x.key_min, y.key_min);
    EXPECT_EQ(x.value_max, y.value_max);
    EXPECT_EQ(full.reservoirs[i].priority, merged.reservoirs[i].priority) << "head " << i;
    EXPECT_EQ(full.reservoirs[i].key, merged.reservoirs[i].key) << "head " << i;
    EXPECT_EQ(full.reservoirs[i].q, merged.reservoirs[i].q) << "head " << i;
  }
}

}  // namespace
}  // namespace kvcc
