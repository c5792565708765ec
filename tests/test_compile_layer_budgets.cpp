// Per-layer eviction budgets (compile/layer_budgets.h): the attention spread against the causal
// softmax recomputed from the synthetic stats' own rows, EpiCache's sensitivity allocation against
// its definition, and the budgets carried by the artifact in both containers (format 1.2; 1.1
// without them) and checked by verify.
#include "compile/layer_budgets.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>

#include "compile/compile.h"
#include "compile/synthetic_stats.h"
#include "formats/artifact.h"
#include "formats/artifact_safetensors.h"
#include "formats/error.h"
#include "formats_test_util.h"

namespace kvcc {
namespace {

SyntheticSpec small_spec() {
  SyntheticSpec spec;
  spec.n_layers = 3;
  spec.n_kv_heads = 2;
  spec.group = 2;
  spec.head_dim = 16;
  spec.docs = 6;
  spec.doc_len = 24;
  spec.query_decay = 2.0;
  return spec;
}

// Σ over queries of Σ_j p_ij², from the reservoir's rows (every token kept): causal softmax of
// q·k/√d within each document, in double.
TEST(LayerBudgets, SpreadIsTheHarmonicMeanOfTheEffectiveKeyCount) {
  const SyntheticSpec spec = small_spec();
  const Stats stats = make_synthetic_stats(spec);
  const int d = spec.head_dim, r = spec.group;
  const std::vector<double> spread = layer_attention_spread(stats);
  ASSERT_EQ(spread.size(), 3u);
  for (int l = 0; l < spec.n_layers; ++l) {
    double queries = 0, p2 = 0;
    for (int h = 0; h < spec.n_kv_heads; ++h) {
      const Reservoir& res = stats.reservoir(l, h);
      ASSERT_EQ(res.size(), size_t(spec.docs * spec.doc_len));
      std::map<std::pair<uint32_t, int32_t>, size_t> row;  // (doc, position) -> reservoir row
      for (size_t i = 0; i < res.size(); ++i) row[{res.doc[i], res.position[i]}] = i;
      for (int doc = 0; doc < spec.docs; ++doc)
        for (int i = 0; i < spec.doc_len; ++i)
          for (int g = 0; g < r; ++g) {
            const float* q = res.q.data() + (row.at({uint32_t(doc), i}) * r + g) * d;
            std::vector<double> logit(size_t(i) + 1);
            for (int j = 0; j <= i; ++j) {
              const float* k = res.key.data() + row.at({uint32_t(doc), j}) * d;
              double s = 0;
              for (int c = 0; c < d; ++c) s += double(q[c]) * k[c];
              logit[size_t(j)] = s / std::sqrt(double(d));
            }
            const double mx = *std::max_element(logit.begin(), logit.end());
            double z = 0, zz = 0;
            for (double x : logit) z += std::exp(x - mx);
            for (double x : logit) zz += std::exp(2 * (x - mx));
            p2 += zz / (z * z);
            queries += 1;
          }
    }
    // The reservoir holds the rows rounded to float: logits move by ~1e-6 relative.
    EXPECT_NEAR(spread[size_t(l)], queries / p2, 1e-4 * spread[size_t(l)]) << "layer " << l;
    EXPECT_GT(spread[size_t(l)], 1.0);
    EXPECT_LT(spread[size_t(l)], double(spec.doc_len));
  }
  const std::vector<double> b = layer_budgets_from_stats(stats);
  EXPECT_NEAR(std::accumulate(b.begin(), b.end(), 0.0) / 3.0, 1.0, 1e-12);
  for (int l = 0; l < 3; ++l) EXPECT_NEAR(b[size_t(l)] / b[0], spread[size_t(l)] / spread[0], 1e-12);

  Stats none = stats;
  none.head(1, 0).p2_weight = 0;
  none.head(1, 1).p2_weight = 0;
  EXPECT_THROW(layer_attention_spread(none), Error);
}

// EpiCache's allocation, computed here from its definition: s = [1, 0.5, 0, 0.75] min-max
// normalised is itself, weights (1 − s)^1.1 scaled to mean 1, then floored at 0.25.
TEST(LayerBudgets, SensitivityFollowsEpiCachesAllocation) {
  const std::vector<double> s = {1.0, 0.5, 0.0, 0.75};
  std::vector<double> w;
  double total = 0;
  for (double x : s) {
    w.push_back(std::pow(1.0 - x, 1.1));
    total += w.back();
  }
  const std::vector<double> b = sensitivity_layer_budgets({0.9, 0.85, 0.8, 0.875});  // the same, shifted and scaled
  ASSERT_EQ(b.size(), 4u);
  for (size_t l = 0; l < 4; ++l) EXPECT_NEAR(b[l], std::max(0.25, w[l] * 4 / total), 1e-12) << l;
  EXPECT_EQ(b[0], 0.25);  // the least sensitive layer keeps the floor
  EXPECT_EQ(sensitivity_layer_budgets({0.7, 0.7}), (std::vector<double>{1, 1}));
  EXPECT_THROW(sensitivity_layer_budgets({}), Error);
  EXPECT_THROW(sensitivity_layer_budgets({0.5, NAN}), Error);
  EXPECT_THROW(sensitivity_layer_budgets({0.5, 0.6}, 0.0), Error);
  EXPECT_THROW(sensitivity_layer_budgets({0.5, 0.6}, 1.1, 1.5), Error);
  // From stats: the sums over their pairs.
  Stats st = make_synthetic_stats(small_spec());
  EXPECT_THROW(layer_budgets_from_sensitivity(st), Error);
  st.sensitivity = LayerSensitivity{64, 2, 10, {9.0, 8.5, 8.0}};
  EXPECT_EQ(layer_budgets_from_sensitivity(st), sensitivity_layer_budgets({0.9, 0.85, 0.8}));
}

TEST(LayerBudgets, CompileStoresThemAndBothContainersCarryThem) {
  testing::ScratchDir dir;
  const Stats stats = make_synthetic_stats(small_spec());
  CompileOptions o;
  o.method = "oscar";
  o.max_fit_rows = 64;
  const Artifact plain = compile_artifact(stats, o);
  EXPECT_TRUE(plain.layer_budgets.empty());
  o.layer_budgets = "spread";
  const Artifact a = compile_artifact(stats, o);
  EXPECT_EQ(a.layer_budgets, layer_budgets_from_stats(stats));
  // Sensitivity needs stats that measured it (refused before the long work).
  o.layer_budgets = "sensitivity";
  EXPECT_THROW(compile_artifact(stats, o), Error);
  Stats measured = stats;
  measured.sensitivity = LayerSensitivity{256, 4, 100, {99.0, 98.0, 99.5}};
  EXPECT_EQ(compile_artifact(measured, o).layer_budgets, sensitivity_layer_budgets({0.99, 0.98, 0.995}));
  o.layer_budgets = "bogus";
  EXPECT_THROW(compile_artifact(stats, o), Error);
  o.layer_budgets = "spread";
  EXPECT_EQ(artifact_format_version(plain), "1.1");
  EXPECT_EQ(artifact_format_version(a), "1.2");

  write_artifact(a, dir.file("a.kvcc.h5"));
  write_artifact_safetensors(a, dir.file("a.safetensors"));
  write_artifact(plain, dir.file("plain.kvcc.h5"));
  for (const char* name : {"a.kvcc.h5", "a.safetensors"}) {
    const Artifact back = read_artifact(dir.file(name));
    EXPECT_EQ(back.format_version, "1.2") << name;
    EXPECT_EQ(back.layer_budgets, a.layer_budgets) << name;
    EXPECT_EQ(artifact_difference(a, back), "") << name;
  }
  EXPECT_TRUE(read_artifact(dir.file("plain.kvcc.h5")).layer_budgets.empty());
  EXPECT_NE(artifact_difference(a, plain), "");

  // With per-side widths the minor is 2.1.
  Artifact wide = a;
  wide.heads[0].key.bits = 3;
  EXPECT_EQ(artifact_format_version(wide), "2.1");

  Artifact bad = a;
  bad.layer_budgets.pop_back();
  EXPECT_CONTAINS(verify_artifact(bad).front(), "layer_budgets: 2 values, expected 3");
  bad = a;
  bad.layer_budgets[1] = -1;
  EXPECT_CONTAINS(verify_artifact(bad).front(), "finite and positive");
  EXPECT_THROW(write_artifact(bad, dir.file("bad.kvcc.h5")), Error);
}

}  // namespace
}  // namespace kvcc
