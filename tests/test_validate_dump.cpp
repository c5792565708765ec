// `kvcc validate` without artifacts (the model alone) and its logits dump (eval/logits_dump.h):
// the dumped reference logits are the plain forward pass's (bit for bit with one block per
// document, to float rounding at blocks), the top-k form equals the full dump sorted, every run
// is dumped in order with the tables that say what each row is; the CLI writes the file and the
// model's NLL. The comparison with transformers' own logits is python/tests/test_logits_dump.py.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>

#include "eval/experiment.h"
#include "eval/logits_dump.h"
#include "eval/output.h"
#include "eval/scheme.h"
#include "formats/atomic_file.h"
#include "formats/safetensors.h"
#include "formats_test_util.h"
#include "forward_test_util.h"
#include "model/tokenizer.h"

namespace kvcc {
namespace {

using testing::ScratchDir;

std::string tiny_model_path() { return testing::data_models_dir() + "/llama31-hd64"; }

std::vector<std::vector<int32_t>> random_documents(int vocab, const std::vector<int>& lengths) {
  std::mt19937 rng(11);
  std::uniform_int_distribution<int> id(0, vocab - 1);
  std::vector<std::vector<int32_t>> docs;
  for (int n : lengths) {
    std::vector<int32_t> d(static_cast<size_t>(n));
    for (auto& t : d) t = id(rng);
    docs.push_back(d);
  }
  return docs;
}

// validate_schemes with its logits dumped to `path`; returns the result.
ValidationResult run_dumped(const ModelFile& model, const std::vector<std::vector<int32_t>>& docs,
                            const std::vector<CacheScheme>& schemes, int block, int top_k, const std::string& path) {
  LogitsDumpSpec spec;
  spec.runs.push_back("reference");
  for (const CacheScheme& s : schemes) spec.runs.push_back(s.name);
  spec.vocab = model.config().vocab;
  spec.top_k = top_k;
  spec.metadata = {{"block", std::to_string(block)}};
  ValidationResult r;
  write_file_atomically(path, [&](const std::string& tmp) {
    LogitsDump dump(tmp, spec, docs);
    r = validate_schemes(model, docs, schemes, ValidateMode::PseudoDecode, block, {}, ValidatePrecision::Float,
                         [&](size_t run, uint64_t row, const double* logits, const double* lp, int) {
                           dump.write_row(run, row, logits, lp);
                         });
    dump.finish();
  });
  return r;
}

template <class T>
std::vector<T> tensor(const std::map<std::string, TensorView>& file, const std::string& name, TensorDType dtype) {
  const auto it = file.find(name);
  if (it == file.end()) throw std::runtime_error("no tensor " + name);
  EXPECT_EQ(it->second.dtype, dtype) << name;
  std::vector<T> out(size_t(it->second.numel()));
  std::memcpy(out.data(), it->second.data, it->second.nbytes);
  return out;
}

// A 2-bit identity artifact (no rotation, no clip) for the tiny model: a second run to dump.
Artifact identity_artifact(const ModelFile& model) {
  const ModelConfig& c = model.config();
  Artifact a;
  a.fingerprint = model.fingerprint();
  a.n_layers = c.n_layers;
  a.n_heads = c.n_heads;
  a.n_kv_heads = c.n_kv_heads;
  a.head_dim = c.head_dim;
  a.rope_style = c.rope_style;
  a.recipe.method = "identity";
  a.recipe.sink = 4;
  a.recipe.recent = 16;
  a.recipe.page_size = 8;
  std::vector<double> eye(size_t(c.head_dim) * c.head_dim, 0.0);
  for (int i = 0; i < c.head_dim; ++i) eye[size_t(i) * c.head_dim + i] = 1.0;
  a.heads.resize(size_t(c.n_layers) * c.n_kv_heads);
  for (HeadArtifact& h : a.heads) h.key.rotation = h.value.rotation = eye;
  return a;
}

// One block per document: the reference run is the plain forward pass's float operations, so its
// dumped logits are those of testing::model_logits bit for bit; the tables say which document,
// position and target each row is; the model-alone result carries the NLL and its clustered se.
TEST(ValidateDump, ReferenceLogitsArePlainForwardBitForBit) {
  const ModelFile model = ModelFile::open(tiny_model_path());
  const int V = model.config().vocab;
  const auto docs = random_documents(V, {70, 1, 33, 2});  // the 1-token document is not scored
  ScratchDir dir;
  const std::string path = dir.file("ref.safetensors");
  const ValidationResult r = run_dumped(model, docs, {}, 256, 0, path);
  EXPECT_TRUE(r.schemes.empty());
  EXPECT_EQ(r.predictions, 69u + 32u + 1u);
  const auto file = read_safetensors(path);
  const auto logits = tensor<float>(file, "reference/logits", TensorDType::F32);
  const auto doc_of = tensor<int32_t>(file, "document", TensorDType::I32);
  const auto pos_of = tensor<int32_t>(file, "position", TensorDType::I32);
  const auto target = tensor<int32_t>(file, "target", TensorDType::I32);
  const auto tokens = tensor<int32_t>(file, "tokens", TensorDType::I32);
  const auto offsets = tensor<int64_t>(file, "document_offsets", TensorDType::I64);
  ASSERT_EQ(logits.size(), size_t(r.predictions) * V);
  ASSERT_EQ(offsets, (std::vector<int64_t>{0, 70, 103, 105}));
  size_t row = 0;
  std::vector<double> doc_nll, weights;
  for (const auto& doc : docs) {
    if (doc.size() < 2) continue;
    const std::vector<float> plain = testing::model_logits(model, doc);
    double nll = 0;
    for (size_t t = 0; t + 1 < doc.size(); ++t, ++row) {
      EXPECT_EQ(doc_of[row], int32_t(doc_nll.size()));
      EXPECT_EQ(pos_of[row], int32_t(t));
      EXPECT_EQ(target[row], doc[t + 1]);
      EXPECT_EQ(tokens[size_t(offsets[doc_nll.size()]) + t], doc[t]);
      EXPECT_EQ(std::memcmp(&logits[row * V], &plain[t * V], size_t(V) * sizeof(float)), 0) << "row " << row;
      double m = -INFINITY, sum = 0;
      for (int v = 0; v < V; ++v) m = std::max(m, double(plain[t * V + v]));
      for (int v = 0; v < V; ++v) sum += std::exp(double(plain[t * V + v]) - m);
      nll += m + std::log(sum) - double(plain[t * V + doc[t + 1]]);
    }
    doc_nll.push_back(nll / double(doc.size() - 1));
    weights.push_back(double(doc.size() - 1));
  }
  double mean = 0;
  for (size_t d = 0; d < doc_nll.size(); ++d) mean += weights[d] * doc_nll[d] / double(r.predictions);
  EXPECT_NEAR(r.reference_nll, mean, 1e-12 * mean);
  EXPECT_NEAR(r.reference_nll_stderr, clustered_standard_error(doc_nll, weights), 1e-12);
  EXPECT_GT(r.reference_nll_stderr, 0.0);
  EXPECT_NE(format_table(r).find("full precision: NLL"), std::string::npos);
  EXPECT_DOUBLE_EQ(nlohmann::json::parse(to_json(r))["reference"]["nll_stderr"].get<double>(), r.reference_nll_stderr);
}

// At blocks of 16 the reference is the same model with its GEMMs cut into other shapes: equal to
// float rounding of reordered sums. OpenBLAS's blocked accumulation moves a float32 logit by a few
// ulps per GEMM; 1e-5 of the largest logit is ~100 ulps, far below any modelling difference (a
// wrong mask or RoPE position moves logits by O(1)).
TEST(ValidateDump, BlockedReferenceEqualsPlainForwardToFloatRounding) {
  const ModelFile model = ModelFile::open(tiny_model_path());
  const int V = model.config().vocab;
  const auto docs = random_documents(V, {70, 33});
  ScratchDir dir;
  run_dumped(model, docs, {}, 16, 0, dir.file("b16.safetensors"));
  const auto file = read_safetensors(dir.file("b16.safetensors"));
  const auto logits = tensor<float>(file, "reference/logits", TensorDType::F32);
  size_t row = 0;
  double max_diff = 0, max_ref = 0;
  for (const auto& doc : docs) {
    const std::vector<float> plain = testing::model_logits(model, doc);
    for (size_t t = 0; t + 1 < doc.size(); ++t, ++row)
      for (int v = 0; v < V; ++v) {
        max_diff = std::max(max_diff, std::abs(double(logits[row * V + v]) - double(plain[t * V + v])));
        max_ref = std::max(max_ref, std::abs(double(plain[t * V + v])));
      }
  }
  EXPECT_GT(max_ref, 0.5);
  EXPECT_LT(max_diff, 1e-5 * max_ref);
  std::printf("  blocks of 16: max |dump - plain| / max |logit| = %.1e\n", max_diff / max_ref);
}

// Every run is dumped (reference, then the schemes in order), and the top-k form holds exactly the
// k largest log-probabilities of the full dump of the same (deterministic) run, sorted, with their
// ids, the log-softmax computed in double from the float logits.
TEST(ValidateDump, TopKEqualsFullDumpSortedForEveryRun) {
  const ModelFile model = ModelFile::open(tiny_model_path());
  const int V = model.config().vocab, K = 7;
  const auto docs = random_documents(V, {60, 41});
  const std::vector<CacheScheme> schemes{scheme_from_artifact(identity_artifact(model), "int2", model.config())};
  ScratchDir dir;
  const ValidationResult full = run_dumped(model, docs, schemes, 16, 0, dir.file("full.safetensors"));
  const ValidationResult topk = run_dumped(model, docs, schemes, 16, K, dir.file("topk.safetensors"));
  EXPECT_EQ(full.schemes[0].kl, topk.schemes[0].kl);
  EXPECT_GT(full.schemes[0].kl, 0.0);  // the scheme's logits differ from the reference's
  const auto f = read_safetensors(dir.file("full.safetensors"));
  const auto k = read_safetensors(dir.file("topk.safetensors"));
  const size_t N = size_t(full.predictions);
  for (const char* run : {"reference", "int2"}) {
    const auto logits = tensor<float>(f, std::string(run) + "/logits", TensorDType::F32);
    const auto ids = tensor<int32_t>(k, std::string(run) + "/top_ids", TensorDType::I32);
    const auto lps = tensor<float>(k, std::string(run) + "/top_logprobs", TensorDType::F32);
    ASSERT_EQ(ids.size(), N * K);
    for (size_t row = 0; row < N; ++row) {
      const float* x = &logits[row * V];
      double m = -INFINITY, sum = 0;
      for (int v = 0; v < V; ++v) m = std::max(m, double(x[v]));
      for (int v = 0; v < V; ++v) sum += std::exp(double(x[v]) - m);
      std::vector<int> order(static_cast<size_t>(V));
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return x[a] > x[b]; });
      for (int i = 0; i < K; ++i) {
        EXPECT_EQ(ids[row * K + i], order[size_t(i)]) << run << " row " << row;
        EXPECT_EQ(lps[row * K + i], float(double(x[order[size_t(i)]]) - m - std::log(sum))) << run << " row " << row;
      }
    }
  }
  // The two runs differ somewhere (the scheme is quantised).
  EXPECT_NE(tensor<float>(f, "reference/logits", TensorDType::F32), tensor<float>(f, "int2/logits", TensorDType::F32));
}

// validate's late positions (--late-from): their KL, Δppl and top-1 equal the same means computed
// here from the logits the run hands out, over the rows whose position is >= late_from (position p
// of a document predicts token p + 1); a start past every document measures nothing; a negative one
// is refused. Tolerance: the two sums add the same double terms in different orders.
TEST(ValidateDump, LatePositionsEqualTheirLogitsRecomputed) {
  const ModelFile model = ModelFile::open(tiny_model_path());
  const auto docs = random_documents(model.config().vocab, {70, 41, 25});
  const std::vector<CacheScheme> schemes{scheme_from_artifact(identity_artifact(model), "int2", model.config())};
  std::vector<std::vector<double>> lp[2];  // per run: log-probs of every row
  const int64_t late_from = 30;
  const ValidationResult r = validate_schemes(
      model, docs, schemes, ValidateMode::PseudoDecode, 16, {}, ValidatePrecision::Float,
      [&](size_t run, uint64_t row, const double*, const double* logprobs, int vocab) {
        EXPECT_EQ(lp[run].size(), row);
        lp[run].emplace_back(logprobs, logprobs + vocab);
      },
      late_from);
  ASSERT_EQ(lp[0].size(), r.predictions);
  double kl = 0, nll_q = 0, nll_ref = 0, top1 = 0;
  uint64_t n = 0, row = 0;
  for (const auto& d : docs)
    for (int64_t p = 0; p + 1 < int64_t(d.size()); ++p, ++row) {
      if (p < late_from) continue;
      const std::vector<double>&ref = lp[0][row], &q = lp[1][row];
      for (size_t v = 0; v < ref.size(); ++v) kl += std::exp(ref[v]) * (ref[v] - q[v]);
      nll_ref -= ref[size_t(d[size_t(p + 1)])];
      nll_q -= q[size_t(d[size_t(p + 1)])];
      top1 += (std::max_element(ref.begin(), ref.end()) - ref.begin()) ==
              (std::max_element(q.begin(), q.end()) - q.begin());
      ++n;
    }
  ASSERT_EQ(n, 39u + 10u);  // documents of 70 and 41 tokens: 39 and 10 predictions from position 30
  ASSERT_EQ(r.late_predictions, n);
  const LateMetrics& m = r.schemes[0].late;
  EXPECT_EQ(m.predictions, n);
  EXPECT_GT(m.kl, 0.0);
  EXPECT_NEAR(m.kl, kl / double(n), 1e-12 * std::max(1.0, kl / double(n)));
  EXPECT_NEAR(m.ppl_rel_change, std::exp((nll_q - nll_ref) / double(n)) - 1.0, 1e-12);
  EXPECT_DOUBLE_EQ(m.top1_agreement, top1 / double(n));
  EXPECT_FALSE(std::isnan(m.kl_stderr));  // two documents have late positions
  EXPECT_NE(format_table(r).find("positions >= 30 only (49 predictions)"), std::string::npos) << format_table(r);
  EXPECT_NE(to_json(r).find("\"late\""), std::string::npos);

  const ValidationResult none =
      validate_schemes(model, docs, schemes, ValidateMode::PseudoDecode, 16, {}, ValidatePrecision::Float, {}, 500);
  EXPECT_EQ(none.late_predictions, 0u);
  EXPECT_EQ(none.schemes[0].late.predictions, 0u);
  EXPECT_NE(format_table(none).find("no prediction at those positions"), std::string::npos);
  EXPECT_THROW(
      validate_schemes(model, docs, schemes, ValidateMode::PseudoDecode, 16, {}, ValidatePrecision::Float, {}, -1),
      Error);
}

TEST(ValidateDump, RefusesBadSpecs) {
  ScratchDir dir;
  const std::vector<std::vector<int32_t>> docs{{1, 2, 3}};
  LogitsDumpSpec spec{{"reference", "reference"}, 16, 0, {}};
  EXPECT_CONTAINS(testing::error_of([&] { LogitsDump(dir.file("a"), spec, docs); }), "used twice");
  spec.runs = {"reference"};
  spec.top_k = 17;
  EXPECT_CONTAINS(testing::error_of([&] { LogitsDump(dir.file("b"), spec, docs); }), "outside [1, vocab 16]");
  spec.top_k = 0;
  EXPECT_CONTAINS(testing::error_of([&] { LogitsDump(dir.file("c"), spec, {{4}}); }), "no document");
  LogitsDump dump(dir.file("d"), spec, docs);
  std::vector<double> row(16, 0.0);
  EXPECT_CONTAINS(testing::error_of([&] { dump.write_row(0, 1, row.data(), row.data()); }), "out of order");
  dump.write_row(0, 0, row.data(), row.data());
  EXPECT_CONTAINS(testing::error_of([&] { dump.finish(); }), "1 of 2 rows");
}

// The CLI: no --artifact measures the model alone and prints its NLL; --dump-logits writes the
// file (renamed into place, no temporary left); --dump-top-k alone is refused.
TEST(ValidateDump, CliWithoutArtifact) {
  if (std::system(("test -x " + std::string(KVCC_BINARY)).c_str()) != 0) GTEST_SKIP() << "kvcc not built";
  const ModelFile model = ModelFile::open(tiny_model_path());
  ScratchDir dir;
  const auto docs = random_documents(model.config().vocab, {40, 25});
  write_token_id_file(dir.file("docs.ids"), docs);
  const std::string base = "OPENBLAS_NUM_THREADS=1 " + std::string(KVCC_BINARY) + " validate --model " +
                           tiny_model_path() + " --ids " + dir.file("docs.ids") + " --block 64";
  ASSERT_EQ(std::system((base + " --dump-logits " + dir.file("out.safetensors") + " --dump-top-k 3 --json " +
                         dir.file("v.json") + " >" + dir.file("log") + " 2>&1")
                            .c_str()),
            0)
      << testing::read_bytes(dir.file("log"));
  EXPECT_CONTAINS(testing::read_bytes(dir.file("log")), "full precision: NLL");
  EXPECT_TRUE(dir.temporaries().empty());
  const auto file = read_safetensors(dir.file("out.safetensors"));
  EXPECT_EQ(file.at("reference/top_ids").shape, (std::vector<int64_t>{39 + 24, 3}));
  const ValidationResult r = validate_schemes(model, docs, {}, ValidateMode::PseudoDecode, 64);
  const nlohmann::json j = testing::read_json_file(dir.file("v.json"));
  // The CLI ran OpenBLAS on one thread, this process may use more: GEMM partitioning changes float
  // summation order, ~1e-8 relative in the NLL.
  EXPECT_NEAR(j["reference"]["nll"].get<double>(), r.reference_nll, 1e-6 * r.reference_nll);
  EXPECT_NE(std::system((base + " --dump-top-k 3 >" + dir.file("log2") + " 2>&1").c_str()), 0);
  EXPECT_CONTAINS(testing::read_bytes(dir.file("log2")), "--dump-top-k needs --dump-logits");
}

}  // namespace
}  // namespace kvcc
