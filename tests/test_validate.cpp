// Validation (runtime/validate.h): the pseudo-decode path with a full-precision "quantiser"
// reproduces the plain forward pass; KL against itself is 0; effective bits for a hand-worked
// case; artifacts for another model and empty inputs are refused.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>

#include "formats/error.h"
#include "forward_test_util.h"
#include "runtime/validate.h"

namespace kvcc {
namespace {

std::string tiny_model_path() { return testing::data_models_dir() + "/llama31-hd64"; }

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

// Mean next-token NLL of the plain forward pass (whole documents at once), log-softmax in double.
double plain_forward_nll(const ModelFile& model, const std::vector<std::vector<int32_t>>& docs) {
  const int V = model.config().vocab;
  double nll = 0;
  uint64_t count = 0;
  for (const auto& doc : docs) {
    const std::vector<float> logits = testing::model_logits(model, doc);
    for (size_t t = 0; t + 1 < doc.size(); ++t) {
      const float* row = logits.data() + t * size_t(V);
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

CacheScheme copy_scheme(int sink, int recent, int page) {
  CacheScheme s;
  s.name = "identity-codec";
  s.sink = sink;
  s.recent = recent;
  s.page_size = page;
  s.codec = [](int, int, KvSide, const float* rows, int n, int64_t, float* out) {
    std::copy(rows, rows + size_t(n) * 64, out);
  };
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
      validate_schemes(model, docs, {copy_scheme(4, 16, 8)}, ValidateMode::PseudoDecode, 256);
  EXPECT_NEAR(one_block.reference_nll, plain, 1e-9 * plain);
  EXPECT_NEAR(one_block.schemes[0].nll, plain, 1e-9 * plain);
  for (ValidateMode mode : {ValidateMode::PseudoDecode, ValidateMode::Static}) {
    const ValidationResult r =
        validate_schemes(model, docs, {copy_scheme(4, 16, 8), copy_scheme(0, 8, 8)}, mode, 32);
    EXPECT_EQ(r.predictions, 149u + 36u + 1u);
    // Blocks of 32 change only the shapes of the float32 GEMMs (OpenBLAS accumulates in a
    // shape-dependent order), so the plain pass agrees to float rounding, not bit for bit.
    EXPECT_NEAR(r.reference_nll, plain, 1e-6 * plain);
    for (const SchemeMetrics& m : r.schemes) {
      // Against the full-precision run of the same blocks: identical to the last bit.
      EXPECT_EQ(m.nll, r.reference_nll) << m.name;
      EXPECT_EQ(m.kl, 0.0);  // identical logits: every term is exactly p·0
      EXPECT_EQ(m.top1_agreement, 1.0);
      for (double e : m.layer_rel_error) EXPECT_EQ(e, 0.0);
    }
  }
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
  const ValidationResult exact =
      validate_schemes(model, docs, {scheme_from_artifact(wide, "wide", model.config())}, ValidateMode::PseudoDecode, 32);
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
  EXPECT_THROW(validate_mode_from_name("decode"), Error);
}

}  // namespace
}  // namespace kvcc
