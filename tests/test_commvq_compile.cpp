// CommVQ through `kvcc compile` / `kvcc report` (compile_artifact, attention_report) and the page
// codec: the artifact verifies, its recipe holds the presets, and the report's held-out key and
// value errors equal errors computed independently from the codec plus a naive RoPE.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "compile/commvq.h"
#include "compile/compile.h"
#include "compile/report.h"
#include "compile/synthetic_stats.h"
#include "formats/codec_commvq.h"
#include "formats/error.h"
#include "formats/kv_codec.h"
#include "model/forward.h"

namespace kvcc {
namespace {

// Synthetic stats whose post-RoPE keys really are RoPE_m(key_pre) (the generator skips RoPE).
Stats rope_consistent_stats() {
  SyntheticSpec spec;
  spec.n_layers = 1;
  spec.n_kv_heads = 1;
  spec.head_dim = 16;
  spec.docs = 20;
  spec.doc_len = 64;
  Stats stats = make_synthetic_stats(spec);
  Reservoir& res = stats.reservoir(0, 0);
  const int d = res.d;
  for (size_t i = 0; i < res.size(); ++i) {
    std::copy(res.key_pre.begin() + long(i * d), res.key_pre.begin() + long((i + 1) * d),
              res.key.begin() + long(i * d));
    apply_rope(stats.config, res.key.data() + i * d, 1, 1, res.position[i]);
  }
  return stats;
}

double rel(const std::vector<double>& err2_ref2) { return std::sqrt(err2_ref2[0] / err2_ref2[1]); }

TEST(CommvqCompile, ArtifactVerifiesAndReportMatchesIndependentErrors) {
  const Stats stats = rope_consistent_stats();
  const int d = stats.config.head_dim;
  CompileOptions o;
  o.method = "commvq";
  o.key_bits = o.value_bits = 1;
  const Artifact art = compile_artifact(stats, o);
  EXPECT_TRUE(verify_artifact(art).empty());
  const CommvqBudget b = commvq_budget(1, d);
  EXPECT_EQ(art.recipe.params.at("key_stages"), std::to_string(b.key_stages));
  EXPECT_EQ(art.recipe.params.at("value_code_bits"), std::to_string(b.value_code_bits));
  EXPECT_NEAR(history_bits(art.recipe, KvSide::Key, d), commvq_effective_bits(b.key_stages, 2 * b.key_half_bits, d),
              1e-6);

  const AttentionReport rep = attention_report(stats, {o}, 512);
  ASSERT_EQ(rep.methods.size(), 1u);
  EXPECT_EQ(rep.methods[0].label, "commvq-1");
  const HeadMetrics& m = rep.methods[0].heads.at(0);

  // Independent: held-out rows in reservoir order, encode/decode with the codec, naive RoPE.
  const Reservoir& res = stats.reservoir(0, 0);
  const CommvqCodec codec = commvq_load(art, 0, 0);
  const auto inv_freq = rope_inv_freq(stats.config);
  std::vector<double> key_e{0, 0}, value_e{0, 0};
  int rows = 0;
  for (size_t i = 0; i < res.size() && rows < 512; ++i) {
    if (!res.heldout[i]) continue;
    ++rows;
    std::vector<float> k(d), v(d);
    commvq_decode_keys(codec.key, commvq_encode_keys(codec.key, res.key_pre.data() + i * d, 1), k.data());
    commvq_decode_values(codec.value, commvq_encode_values(codec.value, res.value.data() + i * d, 1), v.data());
    for (int j = 0; j < d / 2; ++j) {
      const double angle = double(float(res.position[i]) * float(inv_freq[j]));
      const double re = k[j], im = k[j + d / 2];  // rotate_half pairs
      const double rr = std::cos(angle) * re - std::sin(angle) * im, ri = std::sin(angle) * re + std::cos(angle) * im;
      const double er = res.key[i * d + j] - rr, ei = res.key[i * d + j + d / 2] - ri;
      key_e[0] += er * er + ei * ei;
    }
    for (int c = 0; c < d; ++c) {
      key_e[1] += double(res.key[i * d + c]) * res.key[i * d + c];
      const double e = double(res.value[i * d + c]) - v[c];
      value_e[0] += e * e;
      value_e[1] += double(res.value[i * d + c]) * res.value[i * d + c];
    }
  }
  ASSERT_EQ(m.rows, rows);
  EXPECT_NEAR(m.key_rel, rel(key_e), 1e-4 * rel(key_e));
  EXPECT_NEAR(m.value_rel, rel(value_e), 1e-4 * rel(value_e));
  EXPECT_GT(m.key_rel, 0.0);
  EXPECT_LT(m.key_rel, 1.0);

  // The page codec codes commvq values and refuses keys without positions.
  std::vector<float> page(res.value.begin(), res.value.begin() + 8 * d);
  const std::vector<float> out = roundtrip_page(art, 0, 0, KvSide::Value, page.data(), 8);
  std::vector<float> direct(8 * d);
  commvq_decode_values(codec.value, commvq_encode_values(codec.value, page.data(), 8), direct.data());
  for (size_t i = 0; i < out.size(); ++i) EXPECT_NEAR(out[i], direct[i], 1e-5);
  EXPECT_THROW(roundtrip_page(art, 0, 0, KvSide::Key, page.data(), 8), Error);
}

TEST(CommvqCompile, RejectsBudgetsWithoutAPreset) {
  const Stats stats = rope_consistent_stats();
  CompileOptions o;
  o.method = "commvq";
  o.key_bits = o.value_bits = 3;
  EXPECT_THROW(compile_artifact(stats, o), Error);
  o.key_bits = o.value_bits = 2;
  o.params.emplace("key_code_bits", "7");  // must be even: (a, b) index pairs
  EXPECT_THROW(compile_artifact(stats, o), Error);
}

}  // namespace
}  // namespace kvcc
