// Validation (eval/): the pseudo-decode path with a full-precision "quantiser"
// reproduces the plain forward pass (exactly in double, at any block size); KL against itself is
// 0; the per-layer codec equals the per-head one at group <= d; standard errors and effective bits
// for hand-worked cases; artifacts for another model and empty inputs are refused. The runtime
// cache path (kvcc::Runtime): equals a BF16-window forward pass when nothing is quantised, is close
// to the codec path at 2 bits, refuses what it cannot serve; device pool vs host pool (GPU only).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>

#include "formats/error.h"
#include "formats/fp16.h"
#include "formats/kv_codec.h"
#include "forward_test_util.h"
#include "eval/experiment.h"
#include "eval/output.h"
#include "eval/scheme.h"
#include "runtime/kvcc_runtime.h"

namespace kvcc {
namespace {

std::string tiny_model_path() { return testing::data_models_dir() + "/llama31-hd64"; }
// The runtime path at both head_dims outside the GPU kernels' 128.
const std::string kRuntimeModels[] = {testing::data_models_dir() + "/llama31-hd64",
                                      testing::data_models_dir() + "/llama-hd256"};

std::vector<std::vector<int32_t>> random_documents(int vocab, const std::vector<int>& lengths) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> id(0, vocab - 1);
  std::vector<std::vector<int32_t>> docs;
  for (int n : lengths) {
    std::vector<int32_t> d(static_cast<size_t>(n));
    for (auto& t : d) t = id(rng);
    docs.push_back(d);
  }
  return docs;
}

// Mean next-token NLL over documents of the logits `logits_of(doc)` gives ([len, vocab] in S),
// log-softmax in double.
template <typename S, typename LogitsOf>
double mean_nll(int V, const std::vector<std::vector<int32_t>>& docs, LogitsOf logits_of) {
  double nll = 0;
  uint64_t count = 0;
  for (const auto& doc : docs) {
    const std::vector<S> logits = logits_of(doc);
    for (size_t t = 0; t + 1 < doc.size(); ++t) {
      const S* row = logits.data() + t * size_t(V);
      double m = row[0];
      for (int v = 1; v < V; ++v) m = std::max(m, double(row[v]));
      double sum = 0;
      for (int v = 0; v < V; ++v) sum += std::exp(double(row[v]) - m);
      nll += m + std::log(sum) - double(row[doc[t + 1]]);
      ++count;
    }
  }
  return nll / double(count);
}

// Mean next-token NLL of the plain forward pass (whole documents at once, in S = float or double).
template <typename S = float>
double plain_forward_nll(const ModelFile& model, const std::vector<std::vector<int32_t>>& docs) {
  return mean_nll<S>(model.config().vocab, docs, [&](const auto& doc) { return testing::model_logits<S>(model, doc); });
}

// A scheme whose codec returns every page unchanged: a full-precision "quantiser" that still goes
// through the page machinery (sink, ring, pages).
CacheScheme copy_scheme(const ModelConfig& c, int sink, int recent, int page) {
  CacheScheme s;
  s.name = "identity-codec";
  s.sink = sink;
  s.recent = recent;
  s.page_size = page;
  const size_t kvdim = size_t(c.n_kv_heads) * c.head_dim;
  s.path = CodecPath{[kvdim](int, KvSide, const float* rows, int n, int64_t, float* out) {
    std::copy(rows, rows + size_t(n) * kvdim, out);
  }};
  return s;
}

// A 2-bit identity-rotation artifact for the model (no clipping).
Artifact identity_artifact(const ModelFile& model, int sink, int recent, int page) {
  const ModelConfig& c = model.config();
  Artifact a;
  a.fingerprint = model.fingerprint();
  a.n_layers = c.n_layers;
  a.n_heads = c.n_heads;
  a.n_kv_heads = c.n_kv_heads;
  a.head_dim = c.head_dim;
  a.rope_style = c.rope_style;
  a.recipe.method = "identity";
  a.recipe.sink = sink;
  a.recipe.recent = recent;
  a.recipe.page_size = page;
  std::vector<double> eye(size_t(c.head_dim) * c.head_dim, 0.0);
  for (int i = 0; i < c.head_dim; ++i) eye[size_t(i) * c.head_dim + i] = 1.0;
  a.heads.resize(size_t(c.n_layers) * c.n_kv_heads);
  for (HeadArtifact& h : a.heads) h.key.rotation = h.value.rotation = eye;
  return a;
}

TEST(Validate, FullPrecisionCodecReproducesPlainForward) {
  const ModelFile model = ModelFile::open(tiny_model_path());
  ASSERT_EQ(model.config().head_dim, 64);
  // Documents span several blocks, pages and a partial last block.
  const auto docs = random_documents(model.config().vocab, {150, 37, 2});
  const double plain = plain_forward_nll(model, docs);
  // One block per document runs the same float operations as the plain forward pass: equal to
  // 1e-9 relative (in practice bit for bit), with pages going through the codec.
  const ValidationResult one_block =
      validate_schemes(model, docs, {copy_scheme(model.config(), 4, 16, 8)}, ValidateMode::PseudoDecode, 256);
  EXPECT_NEAR(one_block.reference_nll, plain, 1e-9 * plain);
  EXPECT_NEAR(one_block.schemes[0].nll, plain, 1e-9 * plain);
  for (ValidateMode mode : {ValidateMode::PseudoDecode, ValidateMode::Static}) {
    const ValidationResult r = validate_schemes(
        model, docs, {copy_scheme(model.config(), 4, 16, 8), copy_scheme(model.config(), 0, 8, 8)}, mode, 32);
    EXPECT_EQ(r.predictions, 149u + 36u + 1u);
    // Blocks of 32 change only the shapes of the float32 GEMMs (OpenBLAS accumulates in a
    // shape-dependent order), so the plain pass agrees to float rounding, not bit for bit.
    EXPECT_NEAR(r.reference_nll, plain, 1e-6 * plain);
    std::printf("  float, blocks of 32, %s: |reference − plain| / plain = %.1e\n", r.mode.c_str(),
                std::abs(r.reference_nll - plain) / plain);
    for (const SchemeMetrics& m : r.schemes) {
      // Against the full-precision run of the same blocks: identical to the last bit.
      EXPECT_EQ(m.nll, r.reference_nll) << m.name;
      EXPECT_EQ(m.kl, 0.0);  // identical logits: every term is exactly p·0
      EXPECT_EQ(m.top1_agreement, 1.0);
      for (double e : m.layer_rel_error) EXPECT_EQ(e, 0.0);
    }
  }
}

// Issue #6's Done-when: in double, the pseudo-decode path with a full-precision quantiser
// reproduces the plain forward pass to 1e-9 relative (in practice ~1e-15) at any block size, with
// sink, ring and pages in place; float at blocks of 32 only reaches ~1e-8 (GEMM blocking).
TEST(Validate, DoublePrecisionReproducesPlainForwardAtAnyBlock) {
  const ModelFile model = ModelFile::open(tiny_model_path());
  const ModelConfig& c = model.config();
  const auto docs = random_documents(c.vocab, {200, 37, 2});
  const double plain = plain_forward_nll<double>(model, docs);
  for (int block : {32, 128}) {
    for (ValidateMode mode : {ValidateMode::PseudoDecode, ValidateMode::Static}) {
      const ValidationResult r =
          validate_schemes(model, docs, {copy_scheme(c, 4, 16, 8), copy_scheme(c, 0, 8, 8), copy_scheme(c, 4, 24, 16)},
                           mode, block, {}, ValidatePrecision::Double);
      EXPECT_EQ(r.precision, "double");
      EXPECT_EQ(r.predictions, 199u + 36u + 1u);
      EXPECT_NEAR(r.reference_nll, plain, 1e-9 * plain) << "block " << block;
      std::printf("  block %d, %s: |reference − plain| / plain = %.1e\n", block, r.mode.c_str(),
                  std::abs(r.reference_nll - plain) / plain);
      for (const SchemeMetrics& m : r.schemes) {
        EXPECT_NEAR(m.nll, plain, 1e-9 * plain) << "block " << block;
        // The codec's change (zero) is applied in double: the pages stay exact, KL exactly 0.
        EXPECT_EQ(m.nll, r.reference_nll);
        EXPECT_EQ(m.kl, 0.0);
        EXPECT_EQ(m.top1_agreement, 1.0);
        for (double e : m.layer_rel_error) EXPECT_EQ(e, 0.0);
      }
    }
  }
}

// The same on a real model (head_dim 128, 8 layers), where float32 at blocks of 32 drifts by ~1e-8.
TEST(Validate, DoublePrecisionReproducesPlainForwardOnGutenberg27m) {
  const std::string dir = testing::shared_models_dir() + "/gutenberg-27m";
  if (!std::filesystem::exists(dir)) GTEST_SKIP() << dir << " absent (../shared not mounted)";
  const ModelFile model = ModelFile::open(dir);
  const ModelConfig& c = model.config();
  const auto docs = random_documents(c.vocab, {300});
  const double plain = plain_forward_nll<double>(model, docs);
  const ValidationResult d = validate_schemes(model, docs, {copy_scheme(c, 4, 32, 32)}, ValidateMode::PseudoDecode, 32,
                                              {}, ValidatePrecision::Double);
  EXPECT_NEAR(d.reference_nll, plain, 1e-9 * plain);
  EXPECT_EQ(d.schemes[0].nll, d.reference_nll);
  EXPECT_EQ(d.schemes[0].kl, 0.0);
  const ValidationResult f = validate_schemes(model, docs, {}, ValidateMode::PseudoDecode, 32);
  const double plain_f = plain_forward_nll<float>(model, docs);
  std::printf(
      "  gutenberg-27m, 300 tokens, blocks of 32: |reference − plain| / plain = %.1e (double), "
      "%.1e (float)\n",
      std::abs(d.reference_nll - plain) / plain, std::abs(f.reference_nll - plain_f) / plain_f);
}

// The per-layer codec (roundtrip_layer_page on all KV heads at once) gives the same numbers as
// the per-head codec (roundtrip_page on each head) for an artifact with groups within a head.
TEST(Validate, PerLayerCodecEqualsPerHeadCodecAtGroupWithinHead) {
  const ModelFile model = ModelFile::open(tiny_model_path());
  const ModelConfig& c = model.config();
  ASSERT_GT(c.n_kv_heads, 1);
  Artifact art = identity_artifact(model, 4, 16, 8);
  art.recipe.method = "random";
  art.recipe.group = 32;  // two groups per 64-channel head
  // A different signed permutation per (layer, head, side), so a mixed-up head shows.
  std::mt19937 rng(11);
  for (HeadArtifact& h : art.heads)
    for (SideArtifact* side : {&h.key, &h.value}) {
      std::vector<int> perm(size_t(c.head_dim));
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.end(), rng);
      side->rotation.assign(size_t(c.head_dim) * c.head_dim, 0.0);
      for (int i = 0; i < c.head_dim; ++i)
        side->rotation[size_t(i) * c.head_dim + perm[size_t(i)]] = (rng() & 1) ? 1.0 : -1.0;
    }
  CacheScheme per_head;
  per_head.name = "per-head";
  per_head.sink = 4;
  per_head.recent = 16;
  per_head.page_size = 8;
  const int d = c.head_dim, n_kv = c.n_kv_heads;
  per_head.path = CodecPath{[&art, d, n_kv](int layer, KvSide side, const float* rows, int n, int64_t, float* out) {
    const size_t kvdim = size_t(n_kv) * d;
    for (int h = 0; h < n_kv; ++h) {
      std::vector<float> head(size_t(n) * d);
      for (int t = 0; t < n; ++t) std::copy_n(rows + t * kvdim + size_t(h) * d, d, head.data() + size_t(t) * d);
      const std::vector<float> q = roundtrip_page(art, layer, h, side, head.data(), n);
      for (int t = 0; t < n; ++t) std::copy_n(q.data() + size_t(t) * d, d, out + t * kvdim + size_t(h) * d);
    }
  }};
  const auto docs = random_documents(c.vocab, {120, 60});
  const ValidationResult r = validate_schemes(model, docs, {scheme_from_artifact(art, "per-layer", c), per_head},
                                              ValidateMode::PseudoDecode, 32);
  const SchemeMetrics &layer = r.schemes[0], &head = r.schemes[1];
  EXPECT_GT(layer.kl, 1e-4);  // the codec does quantise
  EXPECT_EQ(layer.nll, head.nll);
  EXPECT_EQ(layer.kl, head.kl);
  EXPECT_EQ(layer.top1_agreement, head.top1_agreement);
  EXPECT_EQ(layer.layer_rel_error, head.layer_rel_error);
}

// Hand-worked: values {1, 2, 4} with weights {1, 1, 2}: μ = 11/4, Σ wᵢ²(xᵢ − μ)² = 1.75² + 0.75² +
// 2.5² = 9.875, √(3/2 · 9.875) / 4. Equal weights: the sample s.d. / √D (here 1/√3).
TEST(Validate, ClusteredStandardErrorHandWorked) {
  EXPECT_NEAR(clustered_standard_error({1, 2, 4}, {1, 1, 2}), std::sqrt(1.5 * 9.875) / 4.0, 1e-15);
  EXPECT_NEAR(clustered_standard_error({1, 2, 3}, {5, 5, 5}), 1.0 / std::sqrt(3.0), 1e-15);
  EXPECT_TRUE(std::isnan(clustered_standard_error({1}, {1})));
  EXPECT_EQ(clustered_standard_error({2, 2}, {1, 3}), 0.0);
  EXPECT_THROW(clustered_standard_error({1, 2}, {1}), Error);
}

// Per-document metrics recombine to the totals, and the standard errors are those of the
// per-document values (KL) and paired NLL differences (Δppl), in the table, JSON and SVG.
TEST(Validate, PerDocumentMetricsAndErrorBars) {
  const ModelFile model = ModelFile::open(tiny_model_path());
  const ModelConfig& c = model.config();
  const auto docs = random_documents(c.vocab, {90, 64, 130});
  const Artifact art = identity_artifact(model, 4, 16, 8);
  const ValidationResult r =
      validate_schemes(model, docs, {scheme_from_artifact(art, "int2", c)}, ValidateMode::PseudoDecode, 32);
  const SchemeMetrics& m = r.schemes[0];
  ASSERT_EQ(m.per_document.size(), 3u);
  ASSERT_EQ(r.reference_doc_nll.size(), 3u);
  std::vector<double> w, kl, diff;
  double nll = 0, ref = 0, kl_sum = 0;
  for (size_t d = 0; d < 3; ++d) {
    w.push_back(double(r.doc_lengths[d] - 1));
    kl.push_back(m.per_document[d].kl);
    diff.push_back(m.per_document[d].nll - r.reference_doc_nll[d]);
    nll += w[d] * m.per_document[d].nll;
    ref += w[d] * r.reference_doc_nll[d];
    kl_sum += w[d] * m.per_document[d].kl;
    EXPECT_NEAR(m.per_document[d].ppl_rel_change, std::exp(diff[d]) - 1.0, 1e-12);
  }
  const double P = double(r.predictions);
  EXPECT_NEAR(nll / P, m.nll, 1e-12);
  EXPECT_NEAR(ref / P, r.reference_nll, 1e-12);
  EXPECT_NEAR(kl_sum / P, m.kl, 1e-12);
  EXPECT_GT(m.kl_stderr, 0.0);
  EXPECT_DOUBLE_EQ(m.kl_stderr, clustered_standard_error(kl, w));
  EXPECT_DOUBLE_EQ(m.ppl_rel_change_stderr, (1.0 + m.ppl_rel_change) * clustered_standard_error(diff, w));

  const nlohmann::json j = nlohmann::json::parse(to_json(r));
  EXPECT_EQ(j["precision"], "float");
  EXPECT_DOUBLE_EQ(j["schemes"][0]["kl_stderr"].get<double>(), m.kl_stderr);
  EXPECT_DOUBLE_EQ(j["schemes"][0]["ppl_rel_change_stderr"].get<double>(), m.ppl_rel_change_stderr);
  ASSERT_EQ(j["schemes"][0]["per_document"].size(), 3u);
  EXPECT_EQ(j["schemes"][0]["per_document"][2]["tokens"], 130);
  EXPECT_DOUBLE_EQ(j["schemes"][0]["per_document"][1]["kl"].get<double>(), m.per_document[1].kl);
  EXPECT_NE(format_table(r).find("±se"), std::string::npos);
  // The SVG draws the error bars (lines in the points' colour).
  EXPECT_NE(to_svg(r).find("stroke=\"#1f77b4\""), std::string::npos);

  // One document: no standard error (null in the JSON, "-" in the table).
  const ValidationResult one =
      validate_schemes(model, {docs[0]}, {scheme_from_artifact(art, "int2", c)}, ValidateMode::PseudoDecode, 32);
  EXPECT_TRUE(std::isnan(one.schemes[0].kl_stderr));
  EXPECT_TRUE(nlohmann::json::parse(to_json(one))["schemes"][0]["kl_stderr"].is_null());
}

TEST(Validate, TwoBitCacheLosesQualityAndErrorAccumulates) {
  const ModelFile model = ModelFile::open(tiny_model_path());
  const auto docs = random_documents(model.config().vocab, {200});
  const Artifact art = identity_artifact(model, 4, 16, 8);
  const std::vector<CacheScheme> schemes{scheme_from_artifact(art, "int2", model.config())};
  const ValidationResult pd = validate_schemes(model, docs, schemes, ValidateMode::PseudoDecode, 32);
  const ValidationResult st = validate_schemes(model, docs, schemes, ValidateMode::Static, 32);
  const SchemeMetrics& m = pd.schemes[0];
  EXPECT_GT(m.kl, 0.0);
  EXPECT_LE(m.top1_agreement, 1.0);
  EXPECT_GT(m.layer_rel_error[0], 0.0);
  // Layer 0's inputs are the embeddings in both modes, so its cache (and error) is the same; the
  // later layer sees K/V from perturbed hidden states only in pseudo-decode.
  EXPECT_NEAR(m.layer_rel_error[0], st.schemes[0].layer_rel_error[0], 1e-12);
  EXPECT_NE(m.layer_rel_error[1], st.schemes[0].layer_rel_error[1]);
  // A sink + ring covering the whole document means nothing is quantised: exact again.
  const Artifact wide = identity_artifact(model, 4, 256, 8);
  const ValidationResult exact = validate_schemes(model, docs, {scheme_from_artifact(wide, "wide", model.config())},
                                                  ValidateMode::PseudoDecode, 32);
  EXPECT_EQ(exact.schemes[0].kl, 0.0);
  EXPECT_EQ(m.method, "identity");
  EXPECT_DOUBLE_EQ(m.nominal_bits, 2.0);
}

TEST(Validate, EffectiveBitsHandWorked) {
  Recipe r;
  r.method = "identity";
  r.key_bits = r.value_bits = 2;
  r.group = 0;  // one fp16 scale + zero per 64-channel row: 2 + 32/64 = 2.5 bits
  r.sink = 4;
  r.recent = 32;
  // 100 tokens: 36 window tokens at 16 bits + 64 history at 2.5 = 736 bits per channel pair;
  // 36 tokens: all window, 16 bits each = 576. Together (736 + 576) / 136.
  EXPECT_NEAR(effective_bits_at_lengths(r, 64, {100, 36}), 1312.0 / 136.0, 1e-12);
  EXPECT_NEAR(effective_bits_at_lengths(r, 64, {100}), 7.36, 1e-12);
}

// Stored bits count whole pages: sink 4, ring 32, pages of 16. 90 tokens: 86 post-sink, history
// the 4 pages flushed so far (64 tokens: a page leaves the ring when the ring would exceed 32),
// ring 22; BF16 4 + 22 = 26 tokens, so (26·16 + 64·2.5) / 90 = 6.4, against the published
// accounting's 36 BF16 tokens: (36·16 + 54·2.5) / 90 = 7.9. 100 tokens: 96 post-sink, history 64,
// ring 32: both 7.36. A ring shorter than a page (the codec path only) quantises whole pages of the
// post-sink tokens: pages of 64, ring 16, 100 tokens: history 64, BF16 36.
TEST(Validate, StoredBitsCountWholePages) {
  Recipe r;
  r.method = "identity";
  r.key_bits = r.value_bits = 2;
  r.group = 0;  // 2.5 bits a quantised element at head_dim 64
  r.sink = 4;
  r.recent = 32;
  r.page_size = 16;
  EXPECT_NEAR(stored_bits(r, 64, 90), 6.4, 1e-12);
  EXPECT_NEAR(effective_bits(r, 64, 90), 7.9, 1e-12);
  EXPECT_NEAR(stored_bits(r, 64, 100), 7.36, 1e-12);
  EXPECT_NEAR(effective_bits(r, 64, 100), 7.36, 1e-12);
  EXPECT_NEAR(stored_bits(r, 64, 20), 16.0, 1e-12);  // all in the windows
  r.page_size = 64;
  r.recent = 16;
  EXPECT_NEAR(stored_bits(r, 64, 100), (36.0 * 16 + 64.0 * 2.5) / 100.0, 1e-12);
  r.page_size = 0;
  EXPECT_THROW(stored_bits(r, 64, 100), Error);
}

TEST(Validate, RefusesArtifactForAnotherModel) {
  const ModelFile model = ModelFile::open(tiny_model_path());
  Artifact art = identity_artifact(model, 4, 16, 8);
  EXPECT_NO_THROW(check_artifact_matches(art, model, "ok.kvcc.h5"));
  Artifact wrong_dim = art;
  wrong_dim.head_dim = 128;
  try {
    check_artifact_matches(wrong_dim, model, "other.kvcc.h5");
    FAIL() << "a head_dim mismatch was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("head_dim 128"), std::string::npos) << e.what();
  }
  Artifact wrong_weights = art;
  wrong_weights.fingerprint.weights_sha256 = std::string(64, '0');
  wrong_weights.fingerprint.id = "not-this-model";
  EXPECT_THROW(check_artifact_matches(wrong_weights, model, "other.kvcc.h5"), Error);
  Artifact wrong_layers = art;
  wrong_layers.n_layers = 3;
  EXPECT_THROW(check_artifact_matches(wrong_layers, model, "other.kvcc.h5"), Error);
}

TEST(Validate, RefusesEmptyInput) {
  const ModelFile model = ModelFile::open(tiny_model_path());
  EXPECT_THROW(validate_schemes(model, {{5}, {}}, {}, ValidateMode::PseudoDecode, 32), Error);
  const std::string path = (std::filesystem::temp_directory_path() / "kvcc_validate_empty.ids").string();
  { std::ofstream(path) << "\n"; }
  ValidateData data;
  data.ids_path = path;
  EXPECT_THROW(load_validation_documents(model, data), Error);
  std::filesystem::remove(path);
}

// ---- The runtime cache path (--cache runtime): kvcc::Runtime's prefill + append ----

// An artifact with the normalised Sylvester Hadamard rotation on every (layer, head, side): mixes
// every channel, so rounding in the rotated basis differs from rounding in the model's.
Artifact hadamard_artifact(const ModelFile& model, int sink, int recent, int page) {
  Artifact a = identity_artifact(model, sink, recent, page);
  a.recipe.method = "hadamard";
  const int d = a.head_dim;
  std::vector<double> h(size_t(d) * d);
  for (int i = 0; i < d; ++i)
    for (int j = 0; j < d; ++j)
      h[size_t(i) * d + j] = (__builtin_popcount(unsigned(i & j)) & 1 ? -1.0 : 1.0) / std::sqrt(double(d));
  for (HeadArtifact& head : a.heads) head.key.rotation = head.value.rotation = h;
  return a;
}

// Logits of the plain float forward pass with every key and value stored as a BF16 window holds
// it: x' = bf16(x·R)·Rᵀ per KV head (R the artifact's rotation of that layer, head and side),
// written independently of the runtime (its rotation, append and attention code are not used).
std::vector<float> bf16_window_logits(const ModelFile& model, const Artifact& art, const std::vector<int32_t>& ids) {
  const ModelConfig& c = model.config();
  const int T = int(ids.size()), d = c.head_dim, n_kv = c.n_kv_heads;
  const size_t qdim = size_t(c.n_heads) * d, kvdim = size_t(n_kv) * d;
  std::vector<float> x(size_t(T) * c.hidden), q(size_t(T) * qdim), k(size_t(T) * kvdim), v(size_t(T) * kvdim),
      attn(size_t(T) * qdim);
  embed(model, ids.data(), T, x.data());
  for (int l = 0; l < c.n_layers; ++l) {
    const LayerWeights w = load_layer(model, l);
    attention_qkv(c, w, x.data(), T, 0, q.data(), nullptr, k.data(), v.data());
    for (int h = 0; h < n_kv; ++h) {
      const HeadArtifact& head = art.heads[size_t(l) * n_kv + h];
      for (auto [rows, R] : {std::pair{&k, &head.key.rotation}, std::pair{&v, &head.value.rotation}})
        for (int t = 0; t < T; ++t) {
          float* row = rows->data() + size_t(t) * kvdim + size_t(h) * d;
          std::vector<double> rot(size_t(d), 0.0);
          for (int i = 0; i < d; ++i)
            for (int j = 0; j < d; ++j) rot[size_t(j)] += double(row[i]) * (*R)[size_t(i) * d + j];
          for (double& r : rot) r = float_from_bf16(bf16_from_float(float(r)));
          for (int i = 0; i < d; ++i) {
            double back = 0;
            for (int j = 0; j < d; ++j) back += rot[size_t(j)] * (*R)[size_t(i) * d + j];
            row[i] = float(back);
          }
        }
    }
    prefix_causal_attention(c, 0, T, q.data(), k.data(), v.data(), attn.data());
    attention_output_and_mlp(c, w, attn.data(), T, x.data());
  }
  std::vector<float> logits(size_t(T) * c.vocab);
  final_logits(model, x.data(), T, logits.data());
  return logits;
}

// (1) With a sink covering every token nothing is quantised: the runtime path's NLL is the plain
// forward pass's with K/V rounded to BF16 in the rotated basis (bf16_window_logits), at any block
// size (prefill rounds the block's own K/V as the ring will hold them). The two differ only in
// float summation order (prefill_ref accumulates in double, the forward in float GEMMs), which can
// flip the BF16 rounding of a few elements (tolerance below). Pseudo-decode only: in static mode the cache holds the
// reference run's K/V, which this forward pass does not compute (with one block per document there is no cache, and
// static equals it too: checked at block 256).
TEST(ValidateRuntime, WindowsCoveringEveryTokenEqualBf16RoundedForward) {
  for (const std::string& path : kRuntimeModels) {
    SCOPED_TRACE(path);
    const ModelFile model = ModelFile::open(path);
    const ModelConfig& c = model.config();
    const auto docs = random_documents(c.vocab, {150, 37, 2});
    const Artifact art = hadamard_artifact(model, 256, 16, 16);
    const double bf16_ref =
        mean_nll<float>(c.vocab, docs, [&](const auto& doc) { return bf16_window_logits(model, art, doc); });
    const double plain = plain_forward_nll(model, docs);
    // The effect under test is the BF16 rounding of the windows: the runtime must sit four times
    // closer to the BF16-window forward than that rounding moves the NLL (~4e-5 relative), so a
    // runtime that kept float windows fails. Per-block and whole-document GEMMs sum in different
    // orders, and one K/V element whose BF16 rounding flips moves the NLL ~5e-6 relative (seen on
    // one machine): the tolerance leaves room for a couple of such flips.
    const double bf16_effect = std::abs(bf16_ref - plain);
    ASSERT_GT(bf16_effect, 1e-5 * plain) << "BF16 rounding must be visible for this test to mean anything";
    const double tol = 0.25 * bf16_effect;
    for (int block : {1, 32, 256})
      for (ValidateMode mode : {ValidateMode::PseudoDecode, ValidateMode::Static}) {
        if (mode == ValidateMode::Static && block < 256) continue;
        const ValidationResult r = validate_schemes(
            model, docs, {runtime_scheme_from_artifact(art, "rt", c, ValidateDevice::Cpu)}, mode, block);
        EXPECT_EQ(r.schemes[0].cache, "runtime/cpu");
        EXPECT_NEAR(r.schemes[0].nll, bf16_ref, tol) << "block " << block << ", " << r.mode;
        std::printf("  block %d, %s: |runtime − bf16 forward| / nll = %.1e (BF16 rounding itself: %.1e)\n", block,
                    r.mode.c_str(), std::abs(r.schemes[0].nll - bf16_ref) / plain, std::abs(bf16_ref - plain) / plain);
      }
  }
}

// (2) With 2-bit pages the runtime path and the codec path quantise the same pages with the same
// quantiser; they differ only in the windows (BF16 in the runtime, float32 in the codec path), in
// the pages being quantised from BF16-rounded rows, and in fp16 scale/zero. So their KL against
// the full-precision run agree within 10% (measured: 0.3–3.3%), and both are > 0.
TEST(ValidateRuntime, TwoBitKlCloseToCodecPath) {
  for (const std::string& path : kRuntimeModels) {
    SCOPED_TRACE(path);
    const ModelFile model = ModelFile::open(path);
    const ModelConfig& c = model.config();
    const auto docs = random_documents(c.vocab, {200, 120});
    for (const Artifact& art : {identity_artifact(model, 16, 32, 16), hadamard_artifact(model, 16, 32, 16)}) {
      for (ValidateMode mode : {ValidateMode::PseudoDecode, ValidateMode::Static}) {
        const ValidationResult r =
            validate_schemes(model, docs,
                             {scheme_from_artifact(art, "codec", c),
                              runtime_scheme_from_artifact(art, "runtime", c, ValidateDevice::Cpu)},
                             mode, 32);
        const SchemeMetrics &codec = r.schemes[0], &rt = r.schemes[1];
        EXPECT_EQ(codec.cache, "codec");
        EXPECT_EQ(rt.cache, "runtime/cpu");
        EXPECT_GT(codec.kl, 1e-4);
        EXPECT_GT(rt.kl, 1e-4);
        EXPECT_NEAR(rt.kl, codec.kl, 0.1 * codec.kl) << art.recipe.method << ", " << r.mode;
        EXPECT_NEAR(rt.top1_agreement, codec.top1_agreement, 0.05);
        for (int l = 0; l < c.n_layers; ++l) EXPECT_GT(rt.layer_rel_error[size_t(l)], 0.0);
        std::printf("  %s, %s: KL codec %.4e, runtime %.4e (%.1f%%); top-1 %.4f / %.4f\n", art.recipe.method.c_str(),
                    r.mode.c_str(), codec.kl, rt.kl, 100.0 * (rt.kl / codec.kl - 1.0), codec.top1_agreement,
                    rt.top1_agreement);
        const nlohmann::json j = nlohmann::json::parse(to_json(r));
        EXPECT_EQ(j["schemes"][1]["cache"], "runtime/cpu");
        EXPECT_NE(format_table(r).find("runtime/cpu"), std::string::npos);
      }
    }
  }
}

// The mixed recipe (KIVI keys per channel, Hadamard-rotated per-token values with a clip ratio) as
// compile writes it: identity key rotations, H on the values, group = the page.
Artifact mixed_artifact(const ModelFile& model, int sink, int recent, int page) {
  Artifact a = hadamard_artifact(model, sink, recent, page);
  a.recipe.method = "kivi";
  a.recipe.group = page;
  a.recipe.params["values"] = "hadamard";
  for (HeadArtifact& h : a.heads) {
    h.key.rotation = identity_artifact(model, sink, recent, page).heads[0].key.rotation;
    h.value.clip_ratio = 0.95;
  }
  return a;
}

// (2b) The mixed recipe through the host pool's per-channel key pages against the codec path. The
// two quantise the same pages with the same codec (tests/test_cache_per_channel.cpp checks the
// bytes), so they differ by the BF16 rounding the runtime applies to every row it holds (windows
// and the rows pages are quantised from) alone. Its size: the KL of the runtime with windows
// covering every token (nothing quantised), kl_bf16. An extra perturbation δ on top of the
// quantisation error ε moves a KL (≈ ½‖ε‖² in the Fisher metric) by at most 2‖ε‖‖δ‖ + ‖δ‖², i.e.
// |KL_rt − KL_codec| ≤ 2·√(KL_codec · kl_bf16) + kl_bf16; pages quantised from BF16 rows can also
// flip single codes, so the test allows twice that bound.
TEST(ValidateRuntime, MixedRecipeRuntimeEqualsCodecToBf16Rounding) {
  const ModelFile model = ModelFile::open(tiny_model_path());
  const ModelConfig& c = model.config();
  const auto docs = random_documents(c.vocab, {200, 120});
  const Artifact art = mixed_artifact(model, 16, 32, 16);
  for (ValidateMode mode : {ValidateMode::PseudoDecode, ValidateMode::Static}) {
    const ValidationResult r = validate_schemes(
        model, docs,
        {scheme_from_artifact(art, "codec", c), runtime_scheme_from_artifact(art, "runtime", c, ValidateDevice::Cpu),
         runtime_scheme_from_artifact(mixed_artifact(model, 256, 32, 16), "bf16", c, ValidateDevice::Cpu)},
        mode, 32);
    const SchemeMetrics &codec = r.schemes[0], &rt = r.schemes[1], &bf16 = r.schemes[2];
    EXPECT_EQ(rt.cache, "runtime/cpu");
    EXPECT_EQ(rt.method, "kivi");
    EXPECT_GT(codec.kl, 1e-4);
    EXPECT_GT(bf16.kl, 0.0);
    const double bound = 2.0 * (2.0 * std::sqrt(codec.kl * bf16.kl) + bf16.kl);
    EXPECT_LT(std::abs(rt.kl - codec.kl), bound) << r.mode;
    EXPECT_NEAR(rt.top1_agreement, codec.top1_agreement, 0.05);
    std::printf("  mixed, %s: KL codec %.4e, runtime %.4e (%+.2f%%), BF16 alone %.2e, bound %.2e\n", r.mode.c_str(),
                codec.kl, rt.kl, 100.0 * (rt.kl / codec.kl - 1.0), bf16.kl, bound);
  }
}

// (3) What the runtime path cannot run is refused by name, before any work.
TEST(ValidateRuntime, Refusals) {
  const ModelFile model = ModelFile::open(tiny_model_path());
  const ModelConfig& c = model.config();
  auto refused = [&](const Artifact& art, ValidateDevice device, const std::string& expect) {
    try {
      runtime_scheme_from_artifact(art, "bad.kvcc.h5", c, device);
      ADD_FAILURE() << "accepted; expected an error containing '" << expect << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(expect), std::string::npos) << e.what();
    }
  };
  Artifact kvarn = identity_artifact(model, 16, 32, 16);
  kvarn.recipe.method = "kvarn";
  refused(kvarn, ValidateDevice::Cpu, "method 'kvarn'");
  refused(kvarn, ValidateDevice::Cpu, "bad.kvcc.h5");
  // kivi is served by the host pool only, and its key groups must tile the page.
  Artifact kivi = identity_artifact(model, 16, 32, 16);
  kivi.recipe.method = "kivi";
  kivi.recipe.group = 16;
  EXPECT_EQ(runtime_scheme_from_artifact(kivi, "kivi", c, ValidateDevice::Auto).path_name(), "runtime/cpu");
  refused(kivi, ValidateDevice::Gpu, cuda_device_present() ? "per-channel key pages" : "device gpu");
  kivi.recipe.group = 12;
  refused(kivi, ValidateDevice::Cpu, "do not divide the page of 16 tokens");
  Artifact spanning = identity_artifact(model, 16, 32, 16);
  spanning.recipe.group = 128;  // two 64-channel heads per group
  refused(spanning, ValidateDevice::Cpu, "spans several KV heads");
  // Code widths of 1-4 bits are the host pool's; the GPU kernels read 2-bit codes.
  Artifact three_bit = identity_artifact(model, 16, 32, 16);
  three_bit.recipe.key_bits = 3;
  EXPECT_EQ(runtime_scheme_from_artifact(three_bit, "3 bits", c, ValidateDevice::Auto).path_name(), "runtime/cpu");
  refused(three_bit, ValidateDevice::Gpu, cuda_device_present() ? "2-bit codes" : "device gpu");
  three_bit.recipe.key_bits = 5;
  refused(three_bit, ValidateDevice::Cpu, "1 to 4 bits");
  refused(identity_artifact(model, 16, 32, 8), ValidateDevice::Cpu, "multiple of 16");  // the cache's page rule
  refused(identity_artifact(model, 16, 16, 32), ValidateDevice::Cpu, "recent window");
  const Artifact ok = identity_artifact(model, 16, 32, 16);
  // head_dim 64 is outside the GPU kernels' scope; without a device gpu is refused for that first.
  refused(ok, ValidateDevice::Gpu, cuda_device_present() ? "head_dim 64" : "device gpu");
  EXPECT_EQ(runtime_scheme_from_artifact(ok, "ok", c, ValidateDevice::Auto).path_name(), "runtime/cpu");
  // Double precision, and windows that are not the recipe's.
  const auto docs = random_documents(c.vocab, {40});
  const CacheScheme rt = runtime_scheme_from_artifact(ok, "ok", c, ValidateDevice::Cpu);
  try {
    validate_schemes(model, docs, {rt}, ValidateMode::PseudoDecode, 32, {}, ValidatePrecision::Double);
    ADD_FAILURE() << "double precision accepted on the runtime path";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("float only"), std::string::npos) << e.what();
  }
  CacheScheme other_windows = rt;
  other_windows.recent = 64;
  EXPECT_THROW(validate_schemes(model, docs, {other_windows}, ValidateMode::PseudoDecode, 32), Error);
}

// The device pool (CUDA kernels) against the host pool (CPU reference) on a head_dim-128 model in
// the kernels' scope. Skips without a CUDA device. The kernels round q to fp16 and accumulate
// differently (docs/runtime.md: ~5e-3 per-head output error), so KLs agree within 10%, NLLs within
// 1e-3 relative.
TEST(ValidateRuntime, DevicePoolMatchesHostPool) {
  const ModelFile model = ModelFile::open(testing::data_models_dir() + "/llama31-hd128");
  const ModelConfig& c = model.config();
  const auto docs = random_documents(c.vocab, {250, 180});
  const Artifact hadamard = hadamard_artifact(model, 16, 64, 64);
  // The mixed recipe at the kernels' pages: KIVI keys per channel over the 64-token page (no
  // rotation), Hadamard values per token.
  Artifact mixed = hadamard;
  mixed.recipe.method = "kivi";
  mixed.recipe.group = 64;
  mixed.recipe.params["values"] = "hadamard";
  for (HeadArtifact& h : mixed.heads) h.key.rotation.clear();
  // fp16 key pairs (kivi as published) are the host pool's; the kernels take 2-byte pairs.
  EXPECT_NE(device_scope_problem(cache_geometry(mixed), c.n_heads, cache_widths(mixed)).find("key_params=e5m3"),
            std::string::npos);
  mixed.recipe.params["key_params"] = "e5m3";
  // Both are in the kernels' scope (checked without a GPU too).
  for (const Artifact* art : {&hadamard, static_cast<const Artifact*>(&mixed)})
    EXPECT_EQ(device_scope_problem(cache_geometry(*art), c.n_heads, cache_widths(*art)), "") << art->recipe.method;
  EXPECT_TRUE(cache_geometry(mixed).per_channel_keys());
  if (!cuda_device_present()) GTEST_SKIP() << "no CUDA device (or built without CUDA)";
  for (const Artifact* art : {&hadamard, static_cast<const Artifact*>(&mixed)})
    for (ValidateMode mode : {ValidateMode::PseudoDecode, ValidateMode::Static}) {
      const ValidationResult r =
          validate_schemes(model, docs,
                           {runtime_scheme_from_artifact(*art, "host", c, ValidateDevice::Cpu),
                            runtime_scheme_from_artifact(*art, "device", c, ValidateDevice::Gpu)},
                           mode, 64);
      const SchemeMetrics &host = r.schemes[0], &dev = r.schemes[1];
      EXPECT_EQ(host.cache, "runtime/cpu");
      EXPECT_EQ(dev.cache, "runtime/gpu");
      EXPECT_GT(host.kl, 1e-4);
      EXPECT_NEAR(dev.kl, host.kl, 0.1 * host.kl) << art->recipe.method << " " << r.mode;
      EXPECT_NEAR(dev.nll, host.nll, 1e-3 * host.nll) << art->recipe.method << " " << r.mode;
      std::printf("  %s, %s: KL host %.4e, device %.4e; NLL host %.6f, device %.6f; %.2f s\n",
                  art->recipe.method.c_str(), r.mode.c_str(), host.kl, dev.kl, host.nll, dev.nll, r.seconds);
    }
}

}  // namespace
}  // namespace kvcc
