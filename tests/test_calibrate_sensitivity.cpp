// EpiCache's layer sensitivity (calibrate/layer_sensitivity.h) on a synthetic model, against
// identities: a block as long as the documents hides nothing, layer 0's keys come from the
// embeddings alone, and the masked run equals its definition recomputed with explicit masks;
// and the measurement's life in a stats file (written, read, merged, verified).
#include "calibrate/layer_sensitivity.h"

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>

#include <unistd.h>

#include "calibrate/synthetic_model.h"
#include "formats/error.h"
#include "formats/stats.h"
#include "model/forward.h"
#include "forward_test_util.h"

namespace kvcc {
namespace {

class Sensitivity : public ::testing::Test {
 protected:
  void SetUp() override {
    dir = (std::filesystem::temp_directory_path() / ("kvcc_sensitivity_" + std::to_string(::getpid()))).string();
    spec.vocab = 64;
    spec.hidden = 32;
    spec.n_layers = 3;
    spec.n_heads = 2;
    spec.n_kv_heads = 1;
    spec.head_dim = 16;
    spec.intermediate = 64;
    spec.max_position = 256;
    write_synthetic_model(dir, spec);
  }
  void TearDown() override { std::filesystem::remove_all(dir); }
  std::string dir;
  SyntheticModelSpec spec;
};

// Every layer's keys of the block-prefill run for one document, computed directly: a query sees
// the keys j <= i with j < sink or j >= the start of its block − block/2.
std::vector<std::vector<double>> masked_keys_direct(const ModelFile& model, const std::vector<int32_t>& doc, int block,
                                                    int sink) {
  std::vector<std::vector<float>> keys, values;
  testing::masked_prefill(
      model, doc,
      [&](int, int i) {
        const int start = (i / block) * block;
        std::vector<int32_t> seen;
        for (int j = 0; j <= i; ++j)
          if (j < sink || j >= start - block / 2) seen.push_back(j);
        return seen;
      },
      keys, values);
  std::vector<std::vector<double>> out;
  for (const auto& k : keys) out.emplace_back(k.begin(), k.end());
  return out;
}

TEST_F(Sensitivity, WholeDocumentBlocksHideNothingAndLayerZeroNeverMoves) {
  const ModelFile model = ModelFile::open(dir);
  const auto docs = synthetic_documents(spec, 3, 60, 5);
  const LayerSensitivity whole = measure_layer_sensitivity(model, docs, 64, 2);
  EXPECT_EQ(whole.pairs, 3u * 60u);
  EXPECT_EQ(whole.block, 64);
  EXPECT_EQ(whole.sink, 2);
  ASSERT_EQ(whole.key_similarity_sum.size(), 3u);
  for (double s : whole.key_similarity()) EXPECT_NEAR(s, 1.0, 1e-6);
  int calls = 0;
  const LayerSensitivity blocks = measure_layer_sensitivity(model, docs, 8, 2, [&](int) { ++calls; });
  EXPECT_EQ(calls, 3);
  const std::vector<double> s = blocks.key_similarity();
  EXPECT_NEAR(s[0], 1.0, 1e-12);  // layer 0's keys: embeddings only
  EXPECT_LT(s[1], 1.0 - 1e-4);    // layer 0's attention saw less
  EXPECT_LT(s[2], 1.0 - 1e-4);
  EXPECT_THROW(measure_layer_sensitivity(model, docs, 1, 2), Error);
  EXPECT_THROW(measure_layer_sensitivity(model, docs, 8, -1), Error);
  EXPECT_THROW(measure_layer_sensitivity(model, {{}}, 8, 2), Error);
}

// The similarity sum equals the cosines of the causal keys against the directly masked ones.
TEST_F(Sensitivity, MaskedRunMatchesItsDefinition) {
  const ModelFile model = ModelFile::open(dir);
  const auto docs = synthetic_documents(spec, 1, 45, 9);
  const int block = 10, sink = 3;
  const LayerSensitivity got = measure_layer_sensitivity(model, docs, block, sink);
  const auto masked = masked_keys_direct(model, docs[0], block, sink);
  const auto causal = masked_keys_direct(model, docs[0], 1 << 20, 0);  // one block: causal attention
  const int d = spec.head_dim;
  for (int l = 0; l < spec.n_layers; ++l) {
    double sum = 0;
    for (size_t t = 0; t < docs[0].size(); ++t) {
      double ab = 0, aa = 0, bb = 0;
      for (int a = 0; a < d; ++a) {
        const double x = causal[size_t(l)][t * d + a], y = masked[size_t(l)][t * d + a];
        ab += x * y;
        aa += x * x;
        bb += y * y;
      }
      sum += ab / std::sqrt(aa * bb);
    }
    // Float attention against double: keys agree to ~1e-6 relative, cosines to far better than
    // the differences the mask makes (1e-4 and up in layers 1, 2).
    EXPECT_NEAR(got.key_similarity_sum[size_t(l)], sum, 1e-5 * 45) << "layer " << l;
  }
}

TEST_F(Sensitivity, StatsCarryMergeAndVerifyIt) {
  const ModelFile model = ModelFile::open(dir);
  Stats a = make_empty_stats(model.config(), model.fingerprint(), 0);
  Stats plain = a;
  a.sensitivity = measure_layer_sensitivity(model, synthetic_documents(spec, 2, 30, 1), 8, 2);
  const std::string path = dir + "/s.stats.h5";
  write_stats(a, path);
  const Stats back = read_stats(path);
  EXPECT_EQ(back.sensitivity.block, 8);
  EXPECT_EQ(back.sensitivity.sink, 2);
  EXPECT_EQ(back.sensitivity.pairs, a.sensitivity.pairs);
  EXPECT_EQ(back.sensitivity.key_similarity_sum, a.sensitivity.key_similarity_sum);
  write_stats(plain, path);
  EXPECT_FALSE(read_stats(path).sensitivity.measured());
  // Merging: sums and pairs add; one side's alone is kept; different blocks are refused and leave
  // the target unchanged.
  Stats m = a;
  merge_stats(m, a);
  EXPECT_EQ(m.sensitivity.pairs, 2 * a.sensitivity.pairs);
  EXPECT_EQ(m.sensitivity.key_similarity(), a.sensitivity.key_similarity());
  Stats p = plain;
  merge_stats(p, a);
  EXPECT_EQ(p.sensitivity.key_similarity_sum, a.sensitivity.key_similarity_sum);
  Stats other = a;
  other.sensitivity.block = 16;
  Stats before = a;
  EXPECT_THROW(merge_stats(before, other), Error);
  EXPECT_EQ(before.sensitivity.pairs, a.sensitivity.pairs);
  EXPECT_EQ(before.provenance.tokens, a.provenance.tokens);
  // A cosine sum beyond the pair count is refused on write and read.
  Stats bad = a;
  bad.sensitivity.key_similarity_sum[1] = double(a.sensitivity.pairs) * 1.5;
  EXPECT_FALSE(verify_stats(bad).empty());
  bad.sensitivity.key_similarity_sum.pop_back();
  EXPECT_THROW(write_stats(bad, path), Error);
}

}  // namespace
}  // namespace kvcc
