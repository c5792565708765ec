// The mixed recipe (kivi --values hadamard|oscar): KIVI keys with the value side of a rotated
// per-token grid method. Checked against the two recipes it combines: its keys must code exactly as
// plain kivi's, its values exactly as the hadamard / oscar artifact's (same rotation, same fitted
// clip); plus its bit accounting and the refusal of bad options.
#include <cblas.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "compile/compile.h"
#include "compile/rotation.h"
#include "compile/synthetic_stats.h"
#include "compile_test_util.h"
#include "formats/artifact.h"
#include "formats/error.h"
#include "formats/kv_codec.h"

using namespace kvcc;

namespace {

using test::small_stats;

CompileOptions kivi_options(const std::string& values) {
  CompileOptions o;
  o.method = "kivi";
  o.group = 128;  // key token groups, as kivi128
  o.page_size = 128;
  o.max_fit_rows = 128;
  if (!values.empty()) o.params["values"] = values;
  return o;
}

// Rows with a heavy channel and occasional spikes, so clipping and per-channel scales matter.
std::vector<float> page_rows(int n, int d, uint64_t seed) {
  GaussianStream g(seed);
  std::vector<float> x(size_t(n) * d);
  for (int t = 0; t < n; ++t)
    for (int i = 0; i < d; ++i)
      x[size_t(t) * d + i] = float(g.next() * (i == 5 ? 6.0 : 1.0) + (t % 17 == 3 && i == 9 ? 25.0 : 0.0));
  return x;
}

std::string error_of(const CompileOptions& o) {
  try {
    compile_artifact(small_stats(), o);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(MixedRecipe, KeysAreKiviAndValuesAreTheGridMethodsExactly) {
  const Stats& stats = small_stats();
  const int d = 64, n = 128;
  const Artifact kivi = compile_artifact(stats, kivi_options(""));
  EXPECT_EQ(kivi.recipe.params.count("values"), 0u);  // plain kivi stays today's recipe
  for (const std::string values : {"hadamard", "oscar"}) {
    const Artifact mixed = compile_artifact(stats, kivi_options(values));
    CompileOptions grid_options;
    grid_options.method = values;  // default group 0 = head_dim, value target p2, UHP
    grid_options.max_fit_rows = 128;
    const Artifact grid = compile_artifact(stats, grid_options);
    EXPECT_EQ(mixed.recipe.method, "kivi");
    EXPECT_EQ(mixed.recipe.params.at("values"), values);
    EXPECT_EQ(mixed.recipe.value_target, values == "oscar" ? "p2" : "");
    int differs_from_kivi = 0;
    for (int layer = 0; layer < 2; ++layer)
      for (int h = 0; h < 2; ++h) {
        const HeadArtifact& m = mixed.head(layer, h);
        EXPECT_EQ(m.key.rotation, identity_matrix(d)) << values;
        EXPECT_EQ(m.key.clip_ratio, 1.0) << values;
        EXPECT_EQ(m.value.rotation, grid.head(layer, h).value.rotation) << values;
        EXPECT_EQ(m.value.clip_ratio, grid.head(layer, h).value.clip_ratio) << values;
        const std::vector<float> x = page_rows(n, d, uint64_t(100 + 10 * layer + h));
        const std::vector<float> k_mixed = roundtrip_page(mixed, layer, h, KvSide::Key, x.data(), n);
        const std::vector<float> k_kivi = roundtrip_page(kivi, layer, h, KvSide::Key, x.data(), n);
        const std::vector<float> v_mixed = roundtrip_page(mixed, layer, h, KvSide::Value, x.data(), n);
        const std::vector<float> v_grid = roundtrip_page(grid, layer, h, KvSide::Value, x.data(), n);
        const std::vector<float> v_kivi = roundtrip_page(kivi, layer, h, KvSide::Value, x.data(), n);
        for (size_t i = 0; i < x.size(); ++i) {
          ASSERT_EQ(k_mixed[i], k_kivi[i]) << values << " key @" << i;
          ASSERT_EQ(v_mixed[i], v_grid[i]) << values << " value @" << i;
          differs_from_kivi += v_mixed[i] != v_kivi[i];
        }
      }
    EXPECT_GT(differs_from_kivi, 0) << values << ": the value option had no effect";
    // Validation codes a layer's heads together: for kivi that is roundtrip_page per head.
    const int width = 2 * d;
    const std::vector<float> rows = page_rows(n, width, 7);
    std::vector<float> layer_out(rows.size()), head(size_t(n) * d);
    roundtrip_layer_page(mixed, 1, KvSide::Value, rows.data(), n, layer_out.data());
    for (int h = 0; h < 2; ++h) {
      for (int t = 0; t < n; ++t) std::copy_n(&rows[size_t(t) * width + size_t(h) * d], d, &head[size_t(t) * d]);
      const std::vector<float> want = roundtrip_page(grid, 1, h, KvSide::Value, head.data(), n);
      for (int t = 0; t < n; ++t)
        for (int i = 0; i < d; ++i)
          ASSERT_EQ(layer_out[size_t(t) * width + size_t(h) * d + i], want[size_t(t) * d + i]) << values;
    }
  }
}

TEST(MixedRecipe, BitsAreKiviKeysAndGridValues) {
  Recipe r;
  r.method = "kivi";
  r.key_bits = r.value_bits = 2;
  r.group = 128;  // G_t
  r.page_size = 128;
  r.sink = 4;
  r.recent = 128;
  r.params["values"] = "hadamard";
  // d = 128: keys 2 + 32/128 (scale + zero per channel per 128 tokens), values 2 + 32/128 (per token).
  EXPECT_DOUBLE_EQ(history_bits(r, KvSide::Key, 128), 2.25);
  EXPECT_DOUBLE_EQ(history_bits(r, KvSide::Value, 128), 2.25);
  // d = 64: the value group is the head row, 2 + 32/64; keys are unchanged.
  EXPECT_DOUBLE_EQ(history_bits(r, KvSide::Key, 64), 2.25);
  EXPECT_DOUBLE_EQ(history_bits(r, KvSide::Value, 64), 2.5);
  // 2048 tokens, 132 of them BF16: (132·16 + 1916·2.25) / 2048 per side.
  EXPECT_DOUBLE_EQ(effective_bits(r, 128, 2048), (132.0 * 16 + 1916.0 * 2.25) / 2048);
  // Plain kivi with G = 128 >= d codes values per whole row too, so bits agree at d = 128.
  r.params.erase("values");
  EXPECT_DOUBLE_EQ(history_bits(r, KvSide::Value, 128), 2.25);
}

TEST(MixedRecipe, BadOptionsAreRefusedClearly) {
  const std::string bad_value = error_of(kivi_options("random"));
  EXPECT_NE(bad_value.find("kivi values must be hadamard or oscar"), std::string::npos) << bad_value;
  CompileOptions not_kivi;
  not_kivi.method = "hadamard";
  not_kivi.params["values"] = "oscar";
  const std::string wrong_method = error_of(not_kivi);
  EXPECT_NE(wrong_method.find("applies to kivi only"), std::string::npos) << wrong_method;
  CompileOptions bad_target = kivi_options("oscar");
  bad_target.value_target = "nonsense";
  const std::string target = error_of(bad_target);
  EXPECT_NE(target.find("value target must be"), std::string::npos) << target;
  // The codec refuses an artifact carrying an unknown value grid rather than guessing.
  Recipe r;
  r.method = "kivi";
  r.params["values"] = "identity";
  EXPECT_THROW(side_recipe(r, KvSide::Value), Error);
  EXPECT_EQ(side_recipe(r, KvSide::Key).method, "kivi");
}
