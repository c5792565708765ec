// OSCAR as published (`-m oscar --param variant=published`): every head holds exactly OSCAR's
// serving clip ratios 0.96 (keys) / 0.92 (values) and the artifact its value target logit2; its
// rotations are those of the fitted oscar with the same value target (only the clips differ); an
// artifact that claims the variant with other clips is refused by verify and write; options that
// would change what "published" means are refused by name.
#include <gtest/gtest.h>

#include <string>

#include "compile/compile.h"
#include "compile_test_util.h"
#include "formats/artifact.h"
#include "formats/error.h"
#include "formats/kv_codec.h"
#include "formats/method.h"
#include "formats_test_util.h"

namespace kvcc {
namespace {

using test::small_stats;

CompileOptions published_options() {
  CompileOptions o;
  o.method = "oscar";
  o.params["variant"] = "published";
  o.max_fit_rows = 128;
  return o;
}

TEST(OscarPublished, HoldsExactlyOscarsClipsAndValueTarget) {
  const Artifact art = compile_artifact(small_stats(), published_options());
  EXPECT_EQ(art.recipe.value_target, "logit2");
  EXPECT_EQ(art.recipe.params.at("variant"), "published");
  ASSERT_EQ(art.heads.size(), size_t(art.n_layers * art.n_kv_heads));
  for (const HeadArtifact& h : art.heads) {
    EXPECT_EQ(h.key.clip_ratio, 0.96);
    EXPECT_EQ(h.value.clip_ratio, 0.92);
  }
  EXPECT_TRUE(verify_artifact(art).empty());
  // The same rotations as the fitted oscar with OSCAR's value target: only the clips differ, and
  // those were fitted to other values there (so the variant changes something).
  CompileOptions fitted = published_options();
  fitted.params.clear();
  fitted.value_target = "logit2";
  const Artifact fit = compile_artifact(small_stats(), fitted);
  bool clips_differ = false;
  for (size_t i = 0; i < art.heads.size(); ++i) {
    EXPECT_EQ(art.heads[i].key.rotation, fit.heads[i].key.rotation);
    EXPECT_EQ(art.heads[i].value.rotation, fit.heads[i].value.rotation);
    clips_differ = clips_differ || fit.heads[i].key.clip_ratio != 0.96 || fit.heads[i].value.clip_ratio != 0.92;
  }
  EXPECT_TRUE(clips_differ);
  // Bits are the grid's: the variant changes no accounting.
  EXPECT_EQ(history_bits(art.recipe, KvSide::Key, art.head_dim), history_bits(fit.recipe, KvSide::Key, art.head_dim));
  // Written and read back, it is the same artifact; the zoo import's defaults are the same ratios.
  testing::ScratchDir dir;
  write_artifact(art, dir.file("published.kvcc.h5"));
  EXPECT_EQ(artifact_difference(read_artifact(dir.file("published.kvcc.h5")), art), "");
}

TEST(OscarPublished, OtherClipsUnderTheVariantAreRefused) {
  Artifact art = compile_artifact(small_stats(), published_options());
  art.heads[3].value.clip_ratio = 0.95;
  const std::vector<std::string> problems = verify_artifact(art);
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_CONTAINS(problems[0], "layer 1 kv head 1 clip ratios");
  EXPECT_CONTAINS(problems[0], "expected OSCAR's 0.96 / 0.92");
  testing::ScratchDir dir;
  EXPECT_CONTAINS(testing::error_of([&] { write_artifact(art, dir.file("bad.kvcc.h5")); }), "0.96 / 0.92");
  art = compile_artifact(small_stats(), published_options());
  art.recipe.value_target = "p2";
  EXPECT_CONTAINS(verify_artifact(art).at(0), "value target 'p2', expected logit2");
}

TEST(OscarPublished, OptionsThatWouldChangeItAreRefused) {
  CompileOptions o = published_options();
  o.value_target = "p2";
  EXPECT_CONTAINS(testing::error_of([&] { compile_artifact(small_stats(), o); }), "value target logit2");
  o = published_options();
  o.fit_clip = false;
  EXPECT_CONTAINS(testing::error_of([&] { compile_artifact(small_stats(), o); }), "--no-fit-clip");
  o = published_options();
  o.params["variant"] = "paper";
  EXPECT_CONTAINS(testing::error_of([&] { compile_artifact(small_stats(), o); }), "fitted or published");
  o = published_options();
  o.method = "hadamard";
  EXPECT_CONTAINS(testing::error_of([&] { compile_artifact(small_stats(), o); }), "not hadamard");
  // Naming the default explicitly is the fitted oscar.
  o = published_options();
  o.params["variant"] = "fitted";
  const Artifact fitted = compile_artifact(small_stats(), o);
  EXPECT_FALSE(oscar_published(fitted.recipe));
  EXPECT_EQ(fitted.recipe.value_target, "p2");
}

}  // namespace
}  // namespace kvcc
