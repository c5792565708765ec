// Bad inputs, run as a user would (the built kvcc binary, on a small generated model): nothing
// overwrites its own input, changes a number silently, writes a file kvcc then rejects, or answers
// with an unclear message.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "calibrate/synthetic_model.h"
#include "formats/artifact.h"
#include "formats/atomic_file.h"
#include "formats/error.h"
#include "formats/hf_config.h"
#include "formats/stats.h"
#include "formats_test_util.h"
#include "model/tokenizer.h"

namespace kvcc {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

struct RunResult {
  int exit_code;
  std::string out, err;
};

class BadInputs : public ::testing::Test {
 protected:
  void SetUp() override {
    if (::access(KVCC_BINARY, X_OK) != 0) GTEST_SKIP() << "kvcc binary not built at " << KVCC_BINARY;
    char tmpl[] = "/tmp/kvcc_bad_inputs_XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir = tmpl;
  }
  void TearDown() override {
    std::error_code ec;
    if (!dir.empty()) fs::remove_all(dir, ec);
  }

  std::string file(const std::string& name) const { return dir + "/" + name; }

  RunResult run(const std::string& args) const {
    const std::string out = file("stdout.txt"), err = file("stderr.txt");
    const std::string cmd =
        "OPENBLAS_NUM_THREADS=1 " + std::string(KVCC_BINARY) + " " + args + " >" + out + " 2>" + err;
    const int status = std::system(cmd.c_str());
    RunResult r{WIFEXITED(status) ? WEXITSTATUS(status) : -1, testing::read_bytes(out), testing::read_bytes(err)};
    std::remove(out.c_str());
    std::remove(err.c_str());
    return r;
  }

  // A small synthetic Llama directory and a token id file of its documents.
  SyntheticModelSpec spec() const {
    SyntheticModelSpec s;
    s.vocab = 64;
    s.hidden = 32;
    s.n_layers = 2;
    s.n_heads = 2;
    s.n_kv_heads = 1;
    s.head_dim = 16;
    s.intermediate = 64;
    s.max_position = 256;
    return s;
  }
  std::string make_model(const std::string& name = "model") const {
    const std::string m = file(name);
    write_synthetic_model(m, spec());
    return m;
  }
  std::string make_ids(int docs = 4, int length = 64) const {
    const std::string p = file("docs.ids");
    write_token_ids(p, synthetic_documents(spec(), docs, length, 7));
    return p;
  }
  std::string calibrate(const std::string& model, const std::string& ids, const std::string& out) const {
    const RunResult r = run("calibrate-model --model " + model + " --ids " + ids + " --reservoir 64 -o " + out);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return out;
  }

  std::string dir;
};

void expect_error(const RunResult& r, const std::vector<std::string>& needles) {
  EXPECT_NE(r.exit_code, 0);
  for (const std::string& n : needles) EXPECT_NE(r.err.find(n), std::string::npos) << "no '" << n << "' in: " << r.err;
}

// 1. An output naming an input is refused before any work, naming both, and the input is intact.
TEST_F(BadInputs, OutputThatNamesAnInputIsRefused) {
  const std::string model = make_model();
  const std::string ids = make_ids();
  const std::string stats = calibrate(model, ids, file("s.h5"));
  const std::string stats_bytes = testing::read_bytes(stats);
  const std::string ids_bytes = testing::read_bytes(ids);

  expect_error(run("compile " + stats + " -m identity -o " + stats), {"the output " + stats, "is the input " + stats});
  // The same file by another spelling.
  expect_error(run("compile " + stats + " -m identity -o " + dir + "/./s.h5"), {"is the input " + stats});
  fs::create_hard_link(stats, file("s-link.h5"));
  expect_error(run("compile " + stats + " -m identity -o " + file("s-link.h5")), {"is the input " + stats});
  fs::remove(file("s-link.h5"));
  expect_error(run("merge-stats " + stats + " " + stats + " -o " + stats), {"is the input " + stats});
  expect_error(run("calibrate-model --model " + model + " --ids " + ids + " -o " + ids), {"is the input " + ids});
  const std::string text = file("text.txt");
  testing::write_bytes(text, "a story<|endoftext|>another story");
  expect_error(run("tokenize --model " + model + " --data " + text + " -o " + text), {"is the input " + text});
  EXPECT_EQ(testing::read_bytes(text), "a story<|endoftext|>another story");
  testing::write_bytes(file("k.pt"), "not a pt");
  testing::write_bytes(file("v.pt"), "not a pt");
  expect_error(run("zoo import-oscar " + file("k.pt") + " " + file("v.pt") + " --model-id m -o " + file("v.pt")),
               {"the output " + file("v.pt"), "is the input " + file("v.pt")});
  EXPECT_EQ(testing::read_bytes(file("v.pt")), "not a pt");
  expect_error(run("report " + stats + " --json " + stats), {"is the input " + stats});
  expect_error(run("validate --model " + model + " -a " + stats + " --ids " + ids + " --json " + ids),
               {"is the input " + ids});
  EXPECT_EQ(testing::read_bytes(stats), stats_bytes);
  EXPECT_EQ(testing::read_bytes(ids), ids_bytes);

  // The helper: paths that do not exist yet compare by their canonical form.
  EXPECT_THROW(require_output_is_not_input(dir + "/x/../new.h5", {dir + "/new.h5"}), Error);
  EXPECT_NO_THROW(require_output_is_not_input(dir + "/new.h5", {dir + "/other.h5", ""}));
}

// 2. Numbers out of range are refused by name, not wrapped or replaced by defaults.
TEST_F(BadInputs, CliNumbersOutOfRangeAreRefusedByName) {
  const std::string model = make_model();
  const std::string ids = make_ids();
  const std::string stats = calibrate(model, ids, file("s.h5"));
  const std::string base = "compile " + stats + " -m identity -o " + file("a.kvcc.h5") + " ";
  expect_error(run(base + "--page-size 0"), {"--page-size", "got '0'"});
  expect_error(run(base + "--sink -1"), {"--sink", "got '-1'"});
  expect_error(run(base + "--recent -3"), {"--recent", "got '-3'"});
  expect_error(run(base + "--group -16"), {"--group", "got '-16'"});
  expect_error(run("compile " + stats + " -m random --seed -1 -o " + file("a.kvcc.h5")), {"--seed", "got '-1'"});
  // A real option: NaN and infinity are refused too (every comparison with NaN is false).
  for (const char* b : {"nan", "inf", "-1", "0", "2.3x"})
    expect_error(run(base + "--bits-budget " + b),
                 {"--bits-budget", "must be a finite number > 0", "got '" + std::string(b) + "'"});
  EXPECT_FALSE(testing::file_exists(file("a.kvcc.h5")));
  const RunResult ok = run(base + "--sink 0 --recent 0 --page-size 8");
  ASSERT_EQ(ok.exit_code, 0) << ok.err;
  EXPECT_NE(ok.out.find("sink 0, recent 0, page 8"), std::string::npos) << ok.out;

  const std::string cal = "calibrate-model --model " + model + " --ids " + ids + " -o " + file("c.h5") + " ";
  expect_error(run(cal + "--tokens -5"), {"--tokens", "got '-5'"});
  expect_error(run(cal + "--tokens 0"), {"--tokens", "got '0'"});
  expect_error(run(cal + "--max-seq-len -1"), {"--max-seq-len"});
  expect_error(run(cal + "--reservoir 0"), {"--reservoir"});
  EXPECT_FALSE(testing::file_exists(file("c.h5")));
  const std::string val = "validate --model " + model + " --ids " + ids + " -a " + file("none.kvcc.h5") + " ";
  expect_error(run(val + "--sink -3"), {"--sink", "got '-3'"});
  expect_error(run(val + "--recent -1"), {"--recent", "got '-1'"});
  expect_error(run(val + "--page-size 0"), {"--page-size", "got '0'"});
  expect_error(run(val + "--block 0"), {"--block", "got '0'"});
  expect_error(run(val + "--dump-top-k -2"), {"--dump-top-k", "got '-2'"});
  const std::string evict = "eviction --model " + model + " --ids " + ids + " ";
  expect_error(run(evict + "--ratios 2,nan"), {"--ratios", "must be a finite number in [1, 1e+06], got 'nan'"});
  expect_error(run(evict + "--ratios 0.5"), {"--ratios", "got '0.5'"});
  expect_error(run(evict + "--merge-threshold inf"), {"--merge-threshold", "got 'inf'"});
  // A leading zero is decimal, not octal.
  const RunResult ten = run(cal + "--tokens 010 --reservoir 16");
  ASSERT_EQ(ten.exit_code, 0) << ten.err;
  EXPECT_EQ(read_stats(file("c.h5")).provenance.tokens, 10u);
}

json read_json_file(const std::string& path) { return json::parse(testing::read_bytes(path)); }
void write_json_file(const std::string& path, const json& j) { testing::write_bytes(path, j.dump(2)); }

// 2. 64-bit integers in config.json and tokenizer.json are checked before narrowing to 32 bits.
TEST_F(BadInputs, JsonIntegersOutOfRangeAreRefusedWithKeyAndFile) {
  const std::string model = make_model();
  const std::string config = model + "/config.json";
  json j = read_json_file(config);
  const json good = j;
  j["num_hidden_layers"] = int64_t(4294967298);  // 2 after a silent 64->32-bit narrowing
  write_json_file(config, j);
  std::string err = testing::error_of([&] { read_hf_config(model); });
  EXPECT_NE(err.find("num_hidden_layers"), std::string::npos) << err;
  EXPECT_NE(err.find(config), std::string::npos) << err;
  EXPECT_NE(err.find("4294967298"), std::string::npos) << err;
  j = good;
  j["bos_token_id"] = uint64_t(18446744073709551615ull);
  write_json_file(config, j);
  err = testing::error_of([&] { read_hf_config(model); });
  EXPECT_NE(err.find("bos_token_id"), std::string::npos) << err;
  write_json_file(config, good);
  EXPECT_EQ(read_hf_config(model).n_layers, 2);

  const std::string tok = file("tokenizer.json");
  const json t = {
      {"model", {{"type", "BPE"}, {"vocab", {{"a", 0}, {"b", int64_t(4294967297)}}}, {"merges", json::array()}}}};
  write_json_file(tok, t);
  err = testing::error_of([&] { Tokenizer::from_file(tok); });
  EXPECT_NE(err.find(tok), std::string::npos) << err;
  EXPECT_NE(err.find("\"b\""), std::string::npos) << err;
  EXPECT_NE(err.find("4294967297"), std::string::npos) << err;
  json t2 = {{"model", {{"type", "BPE"}, {"vocab", {{"a", 0}, {"b", 1}}}, {"merges", json::array()}}},
             {"added_tokens", {{{"id", int64_t(4294967296)}, {"content", "<s>"}}}}};
  write_json_file(tok, t2);
  err = testing::error_of([&] { Tokenizer::from_file(tok); });
  EXPECT_NE(err.find("added_tokens"), std::string::npos) << err;
  EXPECT_NE(err.find("4294967296"), std::string::npos) << err;
}

// Overwrites the first float32 of `tensor` in DIR/model.safetensors with `value`.
void corrupt_first_value(const std::string& model_dir, const std::string& tensor, float value) {
  const std::string path = model_dir + "/model.safetensors";
  std::string bytes = testing::read_bytes(path);
  uint64_t header_size = 0;
  std::memcpy(&header_size, bytes.data(), 8);
  const json header = json::parse(bytes.substr(8, header_size));
  ASSERT_TRUE(header.contains(tensor));
  ASSERT_EQ(header[tensor]["dtype"], "F32");
  const size_t offset = 8 + header_size + header[tensor]["data_offsets"][0].get<size_t>();
  std::memcpy(bytes.data() + offset, &value, sizeof value);
  testing::write_bytes(path, bytes);
}

// 3. calibrate-model refuses weights and config values that would give stats kvcc then rejects.
TEST_F(BadInputs, CalibrationRefusesNonFiniteWeightsAndBadNormEps) {
  const std::string ids = make_ids();
  const std::string nan_model = make_model("nan");
  corrupt_first_value(nan_model, "model.layers.1.self_attn.k_proj.weight", std::numeric_limits<float>::quiet_NaN());
  RunResult r = run("calibrate-model --model " + nan_model + " --ids " + ids + " -o " + file("nan.h5"));
  expect_error(r, {"model.layers.1.self_attn.k_proj.weight", "non-finite"});
  EXPECT_FALSE(testing::file_exists(file("nan.h5")));

  const std::string inf_model = make_model("inf");
  corrupt_first_value(inf_model, "model.embed_tokens.weight", std::numeric_limits<float>::infinity());
  // Every document starts with BOS (id 0), whose embedding row holds the infinity.
  r = run("calibrate-model --model " + inf_model + " --ids " + ids + " -o " + file("inf.h5"));
  expect_error(r, {"model.embed_tokens.weight", "non-finite"});
  EXPECT_FALSE(testing::file_exists(file("inf.h5")));

  const std::string eps_model = make_model("eps");
  json j = read_json_file(eps_model + "/config.json");
  j["rms_norm_eps"] = -1e-5;
  write_json_file(eps_model + "/config.json", j);
  r = run("calibrate-model --model " + eps_model + " --ids " + ids + " -o " + file("eps.h5"));
  expect_error(r, {"rms_norm_eps", eps_model + "/config.json"});
  EXPECT_FALSE(testing::file_exists(file("eps.h5")));

  j["rms_norm_eps"] = 1e-5;
  j["rope_theta"] = -10000.0;
  write_json_file(eps_model + "/config.json", j);
  r = run("calibrate-model --model " + eps_model + " --ids " + ids + " -o " + file("eps.h5"));
  expect_error(r, {"rope_theta"});
  EXPECT_FALSE(testing::file_exists(file("eps.h5")));
}

// The C++ forward attends over the whole context, so a sliding window that would cut it is refused
// by name (a Mistral v0.1 config: 4096 of 32768; Qwen's use_sliding_window), while a window covering
// the whole context, or none, is accepted.
TEST_F(BadInputs, SlidingWindowsTheForwardWouldIgnoreAreRefused) {
  const std::string model = make_model();
  const std::string config = model + "/config.json";
  json j = read_json_file(config);
  const json good = j;
  j["architectures"] = {"MistralForCausalLM"};
  j["model_type"] = "mistral";
  j["max_position_embeddings"] = 32768;
  j["sliding_window"] = 4096;
  write_json_file(config, j);
  std::string err = testing::error_of([&] { read_hf_config(model); });
  EXPECT_NE(err.find("sliding_window 4096 (below max_position_embeddings 32768) is not supported"), std::string::npos)
      << err;
  EXPECT_NE(err.find(config), std::string::npos) << err;
  for (const json& window : {json(32768), json(nullptr)}) {
    j["sliding_window"] = window;
    write_json_file(config, j);
    EXPECT_EQ(read_hf_config(model).architecture, "mistral") << window.dump();
  }
  j = good;
  j["architectures"] = {"Qwen2ForCausalLM"};
  j["model_type"] = "qwen2";
  j["use_sliding_window"] = true;
  j["sliding_window"] = 4096;
  write_json_file(config, j);
  err = testing::error_of([&] { read_hf_config(model); });
  EXPECT_NE(err.find("use_sliding_window is not supported"), std::string::npos) << err;
  write_json_file(config, good);
}

// The output head is checked too: only validate's logits read it, after calibration succeeded.
TEST_F(BadInputs, ValidateRefusesANonFiniteOutputHead) {
  const std::string ids = make_ids();
  const std::string model = make_model();
  const std::string stats = calibrate(model, ids, file("s.h5"));
  const RunResult c = run("compile " + stats + " -m identity -o " + file("a.kvcc.h5"));
  ASSERT_EQ(c.exit_code, 0) << c.err;
  corrupt_first_value(model, "lm_head.weight", std::numeric_limits<float>::quiet_NaN());
  const RunResult r = run("validate --model " + model + " --artifact " + file("a.kvcc.h5") + " --ids " + ids +
                          " --json " + file("v.json"));
  expect_error(r, {"lm_head.weight", "non-finite"});
  EXPECT_FALSE(testing::file_exists(file("v.json")));
}

// Options of demo, report and verify: negative, zero, NaN and infinite values are refused by name
// before any work (demo would otherwise read -1 as "the default").
TEST_F(BadInputs, DemoReportAndVerifyOptionsAreRangeChecked) {
  const std::string demo = "demo --out " + file("demo") + " ";
  expect_error(run(demo + "--calib-docs -3"), {"--calib-docs", "got '-3'"});
  expect_error(run(demo + "--eval-docs 0"), {"--eval-docs", "got '0'"});
  expect_error(run(demo + "--doc-length -5"), {"--doc-length", "got '-5'"});
  expect_error(run(demo + "--sink -1"), {"--sink", "got '-1'"});
  expect_error(run(demo + "--recent -2"), {"--recent", "got '-2'"});
  expect_error(run(demo + "--page-size 0"), {"--page-size", "got '0'"});
  expect_error(run(demo + "--block 0"), {"--block", "got '0'"});
  expect_error(run(demo + "--temperature nan"), {"--temperature", "got 'nan'"});
  expect_error(run(demo + "--temperature -1"), {"--temperature", "got '-1'"});
  EXPECT_FALSE(fs::exists(file("demo")));

  const std::string stats = calibrate(make_model(), make_ids(), file("s.h5"));
  expect_error(run("report " + stats + " --key-bits nan"), {"--key-bits", "got 'nan'"});
  expect_error(run("report " + stats + " --value-bits inf"), {"--value-bits", "got 'inf'"});
  expect_error(run("report " + stats + " --group -16"), {"--group", "got '-16'"});
  expect_error(run("report " + stats + " --rows 0"), {"--rows", "got '0'"});
  expect_error(run("report " + stats + " --fit-rows -1"), {"--fit-rows", "got '-1'"});
  expect_error(run("verify " + stats + " --tol -1"), {"--tol", "got '-1'"});
  expect_error(run("verify " + stats + " --tol nan"), {"--tol", "got 'nan'"});
  const RunResult ok = run("verify " + stats + " --tol 1e-4");
  EXPECT_EQ(ok.exit_code, 0) << ok.err;
}

// 4. compile refuses a kvarn iteration count that would make validate run for hours.
TEST_F(BadInputs, CompileRefusesHugeIterationCounts) {
  const std::string stats = calibrate(make_model(), make_ids(), file("s.h5"));
  const RunResult r = run("compile " + stats + " -m kvarn --param iterations=2000000000 -o " + file("k.kvcc.h5"));
  expect_error(r, {"kvarn iterations must be an integer >= 1 and <= 1000, got '2000000000'"});
  EXPECT_FALSE(testing::file_exists(file("k.kvcc.h5")));
}

// 6. Bare `kvcc` is a usage error with the help on stderr.
TEST_F(BadInputs, BareKvccPrintsHelpAndExits2) {
  const RunResult r = run("");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(r.out.empty()) << r.out;
  EXPECT_NE(r.err.find("a subcommand is required"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("calibrate-model"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("merge-stats"), std::string::npos) << r.err;
}

// 6. export-oscar -o naming an existing file is a clear refusal that leaves the file alone.
TEST_F(BadInputs, ExportOscarRefusesAnExistingFileAsOutput) {
  const ModelConfig c = testing::small_config(2, 4, 2, 8);
  Artifact a = testing::random_artifact(c, testing::small_fingerprint(c), 5, "oscar");
  a.recipe.params.clear();
  write_artifact(a, file("a.kvcc.h5"));
  testing::write_bytes(file("existing"), "keep me");
  const RunResult r = run("zoo export-oscar " + file("a.kvcc.h5") + " -o " + file("existing"));
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_EQ(r.err.rfind("kvcc: error: ", 0), 0u) << r.err;
  EXPECT_NE(r.err.find(file("existing") + " is an existing file"), std::string::npos) << r.err;
  EXPECT_EQ(testing::read_bytes(file("existing")), "keep me");
}

// 6. merge-stats names the two files in the order of the values it prints for them.
TEST_F(BadInputs, MergeStatsNamesFilesInTheOrderOfTheirValues) {
  const ModelConfig small = testing::small_config(2, 4, 2, 8);
  const ModelConfig wide = testing::small_config(2, 4, 2, 16);
  write_stats(testing::random_stats(small, testing::small_fingerprint(small), 6, 5, 1).stats, file("small.h5"));
  write_stats(testing::random_stats(wide, testing::small_fingerprint(wide), 6, 5, 2).stats, file("wide.h5"));
  const RunResult r = run("merge-stats " + file("small.h5") + " " + file("wide.h5") + " -o " + file("m.h5"));
  expect_error(r, {file("small.h5") + " vs " + file("wide.h5") +
                   ": cannot merge stats of different models: "
                   "hidden: 32 vs 64; head_dim: 8 vs 16"});
}

// 6. validate prints at most about one progress line per 5% of the tokens when stderr is a file.
TEST_F(BadInputs, ValidateProgressIsBoundedWithoutATerminal) {
  const std::string model = make_model();
  const std::string ids = make_ids(6, 96);
  const std::string stats = calibrate(model, ids, file("s.h5"));
  const RunResult c = run("compile " + stats + " -m identity -o " + file("i.kvcc.h5"));
  ASSERT_EQ(c.exit_code, 0) << c.err;
  const RunResult r = run("validate --model " + model + " -a " + file("i.kvcc.h5") + " --ids " + ids +
                          " --block 2 --sink 4 --recent 4 "
                          "--page-size 8");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  size_t lines = 0, pos = 0;
  while ((pos = r.err.find("validating:", pos)) != std::string::npos) ++lines, ++pos;
  EXPECT_GE(lines, 1u) << r.err;
  EXPECT_LE(lines, 21u) << r.err;  // 6 documents of 48 blocks each: 288 lines before
  EXPECT_NE(r.err.find("document 6/6"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace kvcc
