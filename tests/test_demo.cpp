// `kvcc demo` run as a user would (the built kvcc binary) on the model the repository ships
// (cli/demo/stories260k), its outputs checked against the same quantities computed another way:
// the reference perplexity by a plain whole-sequence forward pass over the held-out ids it wrote,
// each scheme's effective bits from docs/methods.md's accounting written out here, the cache path
// each method ran on; and the runtime's CPU path against the codec path on this head_dim-8 model.
// Also the demo's sampler (one position at a time) against the whole-sequence forward pass.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "eval/experiment.h"
#include "eval/scheme.h"
#include "formats/artifact.h"
#include "formats/model_file.h"
#include "model/tokenizer.h"
#include "formats_test_util.h"
#include "forward_test_util.h"
// The sampler is part of the kvcc executable (cli/demo/), not of a library: compiled in here.
#include "cli/demo/sample.cpp"

namespace fs = std::filesystem;

namespace kvcc {
namespace {

const std::string kModel = std::string(KVCC_SOURCE_DIR) + "/cli/demo/stories260k/stories260K.bin";

struct RunResult {
  int exit_code = -1;
  std::string out, err;
  double seconds = 0;
};

RunResult run_kvcc(const std::string& dir, const std::string& args) {
  const std::string out = dir + ".stdout", err = dir + ".stderr";
  const std::string cmd = std::string(KVCC_BINARY) + " " + args + " >" + out + " 2>" + err;
  const auto t0 = std::chrono::steady_clock::now();
  const int status = std::system(cmd.c_str());
  RunResult r;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = testing::read_bytes(out);
  r.err = testing::read_bytes(err);
  std::remove(out.c_str());
  std::remove(err.c_str());
  return r;
}

// A fresh directory under the system's temp dir, removed with everything in it.
struct TempDir {
  std::string path;
  TempDir() {
    char tmpl[] = "/tmp/kvcc_demo_test_XXXXXX";
    const char* made = ::mkdtemp(tmpl);
    if (!made) std::abort();
    path = made;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string file(const std::string& name) const { return path + "/" + name; }
};

class DemoCli : public ::testing::Test {
 protected:
  void SetUp() override {
    if (::access(KVCC_BINARY, X_OK) != 0) GTEST_SKIP() << "kvcc binary not built at " << KVCC_BINARY;
  }
};

// Mean next-token NLL (nats) of one document under a plain float32 forward pass of the whole
// sequence, and its prediction count.
std::pair<double, int64_t> forward_nll(const ModelFile& model, const std::vector<int32_t>& ids) {
  const std::vector<float> logits = testing::model_logits(model, ids);
  const int vocab = model.config().vocab;
  double sum = 0;
  for (size_t t = 0; t + 1 < ids.size(); ++t) {
    const float* row = logits.data() + t * size_t(vocab);
    const double mx = *std::max_element(row, row + vocab);
    double z = 0;
    for (int v = 0; v < vocab; ++v) z += std::exp(double(row[v]) - mx);
    sum += mx + std::log(z) - double(row[ids[t + 1]]);
  }
  return {sum / double(ids.size() - 1), int64_t(ids.size() - 1)};
}

// docs/methods.md "Bits": bits per element of the quantised tier, keys and values, of the demo's
// recipes at head_dim d (uniform grid b + 32/G with G = d; oscar-lm b + 16/G; kivi keys
// b + 32/min(G_t, P), values b + 32/min(G, d)).
std::pair<double, double> tier_bits(const std::string& method, int d, int page, int group) {
  if (method == "oscar-lm") return {2 + 16.0 / d, 2 + 16.0 / d};
  if (method == "kivi") return {2 + 32.0 / std::min(group, page), 2 + 32.0 / std::min(group, d)};
  return {2 + 32.0 / d, 2 + 32.0 / d};
}

// The default run: files, the sampled documents, the table, and the JSON's numbers.
TEST_F(DemoCli, DefaultRunOnTheShippedModel) {
  ASSERT_TRUE(fs::exists(kModel)) << kModel;
  TempDir dir;
  const RunResult r = run_kvcc(dir.path, "demo --out " + dir.path);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  std::printf("  kvcc demo: %.1f s wall\n%s", r.seconds, r.out.c_str());
  for (const char* needle : {"[stories260k] sampled 48 calibration stories", "the first held-out story",
                             "[stories260k] calibrate:", "[stories260k] compile: 5 methods",
                             "[stories260k] validate:", "runtime/cpu", "full-precision ppl"})
    EXPECT_NE(r.out.find(needle), std::string::npos) << needle;
  const std::vector<std::string> methods = {"identity", "hadamard", "oscar", "oscar-lm", "kivi"};
  for (const char* f : {"stories260k-calib.ids", "stories260k-heldout.ids", "stories260k.stats.h5",
                        "stories260k-validation.json", "stories260k-validation.svg"})
    EXPECT_TRUE(fs::exists(dir.file(f))) << f;
  for (const std::string& m : methods) EXPECT_TRUE(fs::exists(dir.file("stories260k-" + m + ".kvcc.h5"))) << m;

  // The sampled documents: stories from BOS until the model's next BOS/EOS, within 256 tokens.
  const ModelFile model = ModelFile::open(kModel);
  const ModelConfig& c = model.config();
  ASSERT_EQ(c.head_dim, 8);
  const auto calib = read_token_id_file(dir.file("stories260k-calib.ids"));
  const auto heldout = read_token_id_file(dir.file("stories260k-heldout.ids"));
  EXPECT_EQ(calib.size(), 48u);
  ASSERT_EQ(heldout.size(), 16u);
  EXPECT_NE(calib[0], heldout[0]);
  for (const auto* docs : {&calib, &heldout})
    for (const auto& d : *docs) {
      ASSERT_GE(d.size(), 2u);
      EXPECT_LE(d.size(), 256u);
      EXPECT_EQ(d[0], 1);
      for (size_t i = 1; i < d.size(); ++i) {
        EXPECT_TRUE(d[i] != 1 && d[i] != 2 && d[i] >= 0 && d[i] < c.vocab) << d[i];
      }
    }

  const nlohmann::json j = nlohmann::json::parse(testing::read_bytes(dir.file("stories260k-validation.json")));
  // The reference run equals a plain forward pass over the held-out ids (float32: the validation's
  // blocks of 16 accumulate in another order than one whole-sequence pass).
  double nll_sum = 0;
  int64_t predictions = 0;
  std::vector<int64_t> lengths;
  for (size_t i = 0; i < heldout.size(); ++i) {
    const auto [nll, n] = forward_nll(model, heldout[i]);
    EXPECT_NEAR(j["reference"]["per_document_nll"][i].get<double>(), nll, 1e-4) << "document " << i;
    nll_sum += nll * double(n);
    predictions += n;
    lengths.push_back(int64_t(heldout[i].size()));
  }
  EXPECT_EQ(j["doc_lengths"].get<std::vector<int64_t>>(), lengths);
  EXPECT_EQ(j["predictions"].get<int64_t>(), predictions);
  const double ppl = std::exp(nll_sum / double(predictions));
  EXPECT_NEAR(j["reference"]["perplexity"].get<double>(), ppl, 1e-4 * ppl);
  EXPECT_EQ(j["block"].get<int>(), 16);
  EXPECT_EQ(j["mode"].get<std::string>(), "pseudo-decode");

  // Every method, on the path the demo promises, with the bits its recipe accounts for.
  ASSERT_EQ(j["schemes"].size(), methods.size());
  for (size_t s = 0; s < methods.size(); ++s) {
    const nlohmann::json& m = j["schemes"][s];
    const std::string& method = methods[s];
    EXPECT_EQ(m["method"].get<std::string>(), method);
    EXPECT_EQ(m["cache"].get<std::string>(), "runtime/cpu") << method;  // kivi too: per-channel key pages
    const Artifact art = read_artifact(dir.file("stories260k-" + method + ".kvcc.h5"));
    EXPECT_EQ(art.recipe.sink, 4);
    EXPECT_EQ(art.recipe.recent, 32);
    EXPECT_EQ(art.recipe.page_size, 16);
    const auto [kb, vb] = tier_bits(method, c.head_dim, 16, art.recipe.group);
    double bits = 0;  // token-weighted over the documents, (window·16 + rest·tier) / L per side
    int64_t tokens = 0;
    for (int64_t L : lengths) {
      const double w = double(std::min<int64_t>(L, 36)), q = double(L) - w;
      bits += double(L) * 0.5 * ((w * 16 + q * kb) + (w * 16 + q * vb)) / double(L);
      tokens += L;
    }
    EXPECT_NEAR(m["effective_bits"].get<double>(), bits / double(tokens), 1e-9) << method;
    EXPECT_EQ(m["nominal_bits"].get<double>(), 2.0) << method;
    // A 2-bit history loses something, and no scheme is better than the model itself on average.
    EXPECT_GT(m["kl"].get<double>(), 0.0) << method;
    EXPECT_GT(m["top1_agreement"].get<double>(), 0.0) << method;
    EXPECT_LT(m["top1_agreement"].get<double>(), 1.0) << method;
    double doc_kl = 0;
    for (size_t i = 0; i < heldout.size(); ++i) {
      const double kl = m["per_document"][i]["kl"].get<double>();
      EXPECT_GE(kl, 0.0) << method << " document " << i;
      doc_kl += kl * double(lengths[i] - 1);
    }
    EXPECT_NEAR(m["kl"].get<double>(), doc_kl / double(predictions), 1e-9 * doc_kl) << method;
    EXPECT_NEAR(std::log(m["perplexity"].get<double>()), m["nll"].get<double>(), 1e-9) << method;
  }

  // The runtime's CPU path at head_dim 8 against the codec path, same artifacts and documents:
  // they quantise the same pages with the same quantiser and differ only in BF16 windows, pages
  // quantised from BF16-rounded rows and fp16 parameters (tests/test_validate.cpp's
  // TwoBitKlCloseToCodecPath at head_dim 64), so their KLs agree closely; a mis-packed code row or
  // a wrong parameter slot at head_dim 8 would not.
  const std::vector<std::vector<int32_t>> docs(heldout.begin(), heldout.begin() + 6);
  for (const std::string method : {"identity", "oscar"}) {
    const Artifact art = read_artifact(dir.file("stories260k-" + method + ".kvcc.h5"));
    const ValidationResult v = validate_schemes(
        model, docs,
        {scheme_from_artifact(art, "codec", c), runtime_scheme_from_artifact(art, "runtime", c, ValidateDevice::Cpu)},
        ValidateMode::PseudoDecode, 16);
    const SchemeMetrics &codec = v.schemes[0], &rt = v.schemes[1];
    EXPECT_EQ(rt.cache, "runtime/cpu");
    EXPECT_GT(codec.kl, 1e-3);
    EXPECT_NEAR(rt.kl, codec.kl, 0.1 * codec.kl) << method;
    EXPECT_NEAR(rt.top1_agreement, codec.top1_agreement, 0.05) << method;
    std::printf("  %s at head_dim 8: KL codec %.4e, runtime/cpu %.4e (%+.1f%%)\n", method.c_str(), codec.kl, rt.kl,
                100.0 * (rt.kl / codec.kl - 1.0));
  }
}

// A missing model is one clear error line naming the path and the way out; nothing is run.
TEST_F(DemoCli, MissingModelIsAClearError) {
  TempDir dir;
  const RunResult r = run_kvcc(dir.path, "demo --model " + dir.file("nothing.bin") + " --out " + dir.file("out"));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  for (const char* needle : {"kvcc: error: demo model not found at", "nothing.bin", "--model", "--synthetic"})
    EXPECT_NE(r.err.find(needle), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(dir.file("out")));
}

// The synthetic model's pipeline stays reachable (small, for speed; blocks of 32 so that later
// blocks attend to quantised pages): codec path, its own files.
TEST_F(DemoCli, SyntheticStillRuns) {
  TempDir dir;
  const RunResult r = run_kvcc(
      dir.path,
      "demo --synthetic --calib-docs 2 --eval-docs 2 --doc-length 128 --block 32 --methods identity kivi --out " +
          dir.path);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("SYNTHETIC"), std::string::npos) << r.out;
  const nlohmann::json j = nlohmann::json::parse(testing::read_bytes(dir.file("synthetic-validation.json")));
  EXPECT_EQ(j["documents"].get<int>(), 2);
  EXPECT_EQ(j["tokens"].get<int>(), 256);
  ASSERT_EQ(j["schemes"].size(), 2u);
  for (const auto& m : j["schemes"]) {
    EXPECT_EQ(m["cache"].get<std::string>(), "codec");
    EXPECT_GT(m["kl"].get<double>(), 0.0);
  }
}

// The sampler's one-position-at-a-time logits are the rows of the whole-sequence forward pass, on
// the shipped model (llama2.c: interleaved RoPE, 8 q / 4 kv heads) and on a rotate_half model.
TEST(DemoSampler, IncrementalLogitsEqualWholeSequenceForward) {
  for (const std::string& path : {kModel, testing::data_models_dir() + "/llama31-hd64"}) {
    const ModelFile model = ModelFile::open(path);
    const int vocab = model.config().vocab;
    std::vector<int32_t> ids;  // on stories260k: "Once upon a time, there was a little", then any ids
    for (int32_t id : {1, 403, 407, 261, 378, 432, 383, 286, 261, 376}) ids.push_back(id % vocab);
    for (int t = 0; ids.size() < 70; ++t) ids.push_back(int32_t((t * 97 + 13) % vocab));
    const std::vector<float> whole = testing::model_logits(model, ids);
    demo::IncrementalDecoder decoder(model, int(ids.size()));
    double max_diff = 0, max_ref = 0;
    for (size_t t = 0; t < ids.size(); ++t) {
      const std::vector<float>& row = decoder.step(ids[t]);
      for (int v = 0; v < vocab; ++v) {
        max_diff = std::max(max_diff, std::abs(double(row[size_t(v)]) - whole[t * size_t(vocab) + size_t(v)]));
        max_ref = std::max(max_ref, std::abs(double(whole[t * size_t(vocab) + size_t(v)])));
      }
    }
    EXPECT_GT(max_ref, 0.5) << path;
    EXPECT_LT(max_diff / max_ref, 1e-5) << path << ": max |diff| " << max_diff << " / max |logit| " << max_ref;
    EXPECT_THROW(decoder.step(1), Error);  // past its tokens
  }
}

// The same seed gives the same documents; another seed other documents; every one starts with BOS
// and never contains a stop id.
TEST(DemoSampler, SeededAndStopsAtStopIds) {
  const ModelFile model = ModelFile::open(kModel);
  demo::SampleOptions o;
  o.max_tokens = 64;
  o.stop_ids = {1, 2};
  o.seed = 5;
  const auto a = demo::sample_documents(model, 4, o), b = demo::sample_documents(model, 4, o);
  o.seed = 6;
  const auto other = demo::sample_documents(model, 4, o);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, other);
  for (const auto& d : a) {
    ASSERT_GE(d.size(), 2u);
    EXPECT_LE(d.size(), 64u);
    EXPECT_EQ(d[0], 1);
    EXPECT_EQ(std::count(d.begin() + 1, d.end(), 1) + std::count(d.begin() + 1, d.end(), 2), 0);
  }
}

}  // namespace
}  // namespace kvcc
