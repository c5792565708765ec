// Quantiser groups that span several KV heads (recipe.group > head_dim, small head_dim): compile's
// validation of --group, the joint fit shared by a group's heads, aligned reservoir rows, the
// report's layer codec, and the runtime's refusal (it stores parameters per KV head).
#include <gtest/gtest.h>

#include <filesystem>

#include "compile/compile.h"
#include "compile/fit.h"
#include "compile/report.h"
#include "compile/synthetic_stats.h"
#include "formats/artifact.h"
#include "formats/error.h"
#include "formats/kv_codec.h"
#include "runtime/kvcc_runtime.h"
#include "compile_test_util.h"
#include "formats_test_util.h"

using namespace kvcc;
using kvcc::testing::error_of;

namespace {

// A tiny-model shape: 4 KV heads of head_dim 16 (as tinystories-656k).
const Stats& small_head_stats() {
  static const Stats stats = test::make_small_stats(4, 16);
  return stats;
}

CompileOptions options_for(const std::string& method, int group) {
  CompileOptions o;
  o.method = method;
  o.group = group;
  o.max_fit_rows = 128;
  return o;
}

}  // namespace

TEST(SpanningGroups, CompileRefusesGroupsThatCannotSpanWithAClearMessage) {
  const Stats& s = small_head_stats();
  auto err = [&](const std::string& m, int g) { return error_of([&] { compile_artifact(s, options_for(m, g)); }); };
  EXPECT_CONTAINS(err("oscar", 24), "multiple of head_dim dividing n_kv_heads*head_dim = 64");
  EXPECT_CONTAINS(err("oscar", 48), "multiple of head_dim dividing n_kv_heads*head_dim = 64");
  EXPECT_CONTAINS(err("oscar", 128), "multiple of head_dim dividing n_kv_heads*head_dim = 64");
  EXPECT_CONTAINS(err("identity", 12), "must divide head_dim 16");
  EXPECT_CONTAINS(err("turboquant", 32), "turboquant quantises whole rows; --group does not apply");
  EXPECT_CONTAINS(err("kvarn", 64), "kvarn quantises whole rows");
  EXPECT_CONTAINS(err("commvq", 32), "commvq quantises whole rows");
  for (int g : {32, 64}) EXPECT_EQ(err("hadamard", g), "(no error)") << g;
  EXPECT_EQ(err("kivi", 64), "(no error)");  // kivi: 64 tokens per key group, values per head
}

TEST(SpanningGroups, HeadsOfAGroupShareTheirJointlyFittedQuantiser) {
  const Stats& s = small_head_stats();
  const Artifact art = compile_artifact(s, options_for("oscar", 32));
  for (int l = 0; l < art.n_layers; ++l) {
    // Heads {0, 1} and {2, 3} form groups: equal clip ratios within, the joint fit's value.
    for (int h0 : {0, 2}) {
      const HeadArtifact &a = art.head(l, h0), &b = art.head(l, h0 + 1);
      EXPECT_EQ(a.key.clip_ratio, b.key.clip_ratio);
      EXPECT_EQ(a.value.clip_ratio, b.value.clip_ratio);
      const std::vector<FitRows> rows = select_aligned_rows({&s.reservoir(l, h0), &s.reservoir(l, h0 + 1)}, false, 128);
      EXPECT_EQ(a.key.clip_ratio, fit_clip_ratio(art.recipe, {&a.key, &b.key}, KvSide::Key, rows));
      EXPECT_EQ(a.value.clip_ratio, fit_clip_ratio(art.recipe, {&a.value, &b.value}, KvSide::Value, rows));
    }
    // Each head keeps its own rotation.
    EXPECT_NE(art.head(l, 0).key.rotation, art.head(l, 1).key.rotation);
  }
  // oscar-lm: one level table per group of 64 = the whole layer.
  const Artifact lm = compile_artifact(s, options_for("oscar-lm", 64));
  for (int h = 1; h < 4; ++h) EXPECT_EQ(lm.head(1, h).value.levels, lm.head(1, 0).value.levels);
  EXPECT_NE(lm.head(0, 0).value.levels, lm.head(1, 0).value.levels);
  // The artifact file keeps the recipe group and the shared parameters.
  kvcc::testing::ScratchDir dir;
  const std::string path = dir.file("g64.h5");
  write_artifact(lm, path);
  const Artifact back = read_artifact(path);
  EXPECT_EQ(back.recipe.group, 64);
  EXPECT_EQ(back.head(1, 3).value.levels, lm.head(1, 3).value.levels);
}

TEST(SpanningGroups, AlignedRowsMatchTokensAcrossReservoirs) {
  auto reservoir = [](std::vector<std::pair<uint32_t, int32_t>> tokens, float tag) {
    Reservoir r;
    r.d = 2;
    r.group = 1;
    for (auto [doc, pos] : tokens) {
      r.doc.push_back(doc);
      r.position.push_back(pos);
      r.heldout.push_back(0);
      r.priority.push_back(0);
      for (float v : {tag, float(doc * 100 + pos)}) {
        r.key.push_back(v);
        r.value.push_back(-v);
        r.q.push_back(v);
      }
    }
    return r;
  };
  // The second reservoir lacks token (0, 2) and holds the others in another order.
  const Reservoir a = reservoir({{0, 1}, {0, 2}, {3, 5}, {4, 0}}, 1.0f);
  const Reservoir b = reservoir({{4, 0}, {3, 5}, {0, 1}}, 2.0f);
  const std::vector<FitRows> rows = select_aligned_rows({&a, &b}, false, 10);
  ASSERT_EQ(rows.size(), 2u);
  ASSERT_EQ(rows[0].n, 3);
  ASSERT_EQ(rows[1].n, 3);
  const std::vector<float> want_a = {1, 1, 1, 305, 1, 400}, want_b = {2, 1, 2, 305, 2, 400};
  EXPECT_EQ(rows[0].key, want_a);
  EXPECT_EQ(rows[1].key, want_b);
  EXPECT_EQ(rows[1].nq, 3);
  // max_rows counts aligned tokens; a single reservoir is select_rows.
  EXPECT_EQ(select_aligned_rows({&a, &b}, false, 2)[1].n, 2);
  EXPECT_EQ(select_aligned_rows({&a}, false, 10)[0].key, select_rows(a, false, 10).key);
}

TEST(SpanningGroups, ReportEvaluatesSpanningGroupsWithTheLayerCodec) {
  const Stats& s = small_head_stats();
  const AttentionReport rep = attention_report(s, {options_for("hadamard", 16), options_for("hadamard", 64)}, 128);
  ASSERT_EQ(rep.methods.size(), 2u);
  EXPECT_EQ(rep.methods[1].label, "hadamard/g64");
  EXPECT_DOUBLE_EQ(history_bits(rep.methods[0].recipe, KvSide::Key, 16), 4.0);
  EXPECT_DOUBLE_EQ(history_bits(rep.methods[1].recipe, KvSide::Key, 16), 2.5);
  EXPECT_LT(rep.methods[1].effective_bits_32k, rep.methods[0].effective_bits_32k);
  // One (scale, zero) for four heads costs accuracy: larger errors than one per head.
  const HeadMetrics per_head = rep.methods[0].mean(), spanning = rep.methods[1].mean();
  EXPECT_GT(spanning.logit_rel, per_head.logit_rel);
  EXPECT_GT(spanning.value_rel, per_head.value_rel);
  EXPECT_LT(spanning.logit_rel, 1.0);
  ASSERT_EQ(rep.methods[1].heads.size(), 8u);

  // The report's numbers are the layer codec's: recompute layer 1, head 2's key error by hand.
  const Artifact art = compile_artifact(s, options_for("hadamard", 64));
  std::vector<const Reservoir*> res;
  for (int h = 0; h < 4; ++h) res.push_back(&s.reservoir(1, h));
  const std::vector<FitRows> rows = select_aligned_rows(res, true, 128);
  const int n = rows[0].n, d = 16, w = 64, page = art.recipe.page_size;
  std::vector<float> k(size_t(n) * w), kq(k.size());
  for (int h = 0; h < 4; ++h)
    for (int t = 0; t < n; ++t) std::copy_n(&rows[size_t(h)].key[size_t(t) * d], d, &k[size_t(t) * w + size_t(h) * d]);
  for (int t0 = 0; t0 < n; t0 += page)
    roundtrip_layer_page(art, 1, KvSide::Key, &k[size_t(t0) * w], std::min(page, n - t0), &kq[size_t(t0) * w]);
  double err = 0, ref = 0;
  for (int t = 0; t < n; ++t)
    for (int i = 0; i < d; ++i) {
      const size_t at = size_t(t) * w + 2 * d + size_t(i);
      err += double(k[at] - kq[at]) * (k[at] - kq[at]);
      ref += double(k[at]) * k[at];
    }
  const HeadMetrics& h12 = rep.methods[1].heads[4 + 2];
  ASSERT_EQ(h12.layer, 1);
  ASSERT_EQ(h12.head, 2);
  EXPECT_NEAR(h12.key_rel, std::sqrt(err / ref), 1e-9);
}

TEST(SpanningGroups, PagedRuntimeRefusesThem) {
  const Artifact art = compile_artifact(small_head_stats(), options_for("oscar", 64));
  const EngineShape shape{art.n_layers, art.n_heads, art.n_kv_heads, art.head_dim};
  EXPECT_CONTAINS(error_of([&] { check_artifact_for_engine(art, shape); }),
                  "the paged runtime stores quantiser parameters per KV head");
  const Artifact per_head = compile_artifact(small_head_stats(), options_for("oscar", 16));
  EXPECT_EQ(error_of([&] { check_artifact_for_engine(per_head, shape); }), "(no error)");
}
