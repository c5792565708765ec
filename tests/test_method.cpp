// The method table (formats/method.h): names round-trip and unknown ones are refused with the
// table's list, the traits compile and the runtime rely on, the one rule for options a method
// ignores, and verify_artifact's method checks reached through the table (an unknown method, a
// misshapen commvq codebook, a turboquant split that disagrees with the budget).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <set>

#include "compile/compile.h"
#include "compile_test_util.h"
#include "formats/artifact.h"
#include "formats/codec_commvq.h"
#include "formats/error.h"
#include "formats/kv_codec.h"
#include "formats/method.h"
#include "formats_test_util.h"

namespace kvcc {
namespace {

using testing::error_of;

const char* const kNames[] = {"oscar",      "oscar-lm", "hadamard", "identity", "random",
                              "turboquant", "kivi",     "kvarn",    "commvq"};

bool has(const std::string& text, const std::string& needle) { return text.find(needle) != std::string::npos; }

std::string options_error(Method m, unsigned given, const std::map<std::string, std::string>& params) {
  try {
    check_method_options(m, given, params);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(MethodTable, NamesRoundTripInEnumOrder) {
  ASSERT_EQ(all_methods().size(), std::size(kNames));
  std::set<std::string> seen;
  for (size_t i = 0; i < all_methods().size(); ++i) {
    const Method m = all_methods()[i];
    EXPECT_EQ(size_t(m), i);
    EXPECT_EQ(method_traits(m).method, m);
    EXPECT_STREQ(method_name(m), kNames[i]);
    EXPECT_EQ(method_from_name(method_name(m)), m);
    EXPECT_EQ(find_method(method_name(m)), m);
    EXPECT_TRUE(seen.insert(method_name(m)).second) << method_name(m);
    EXPECT_GT(std::strlen(method_traits(m).summary), 10u) << method_name(m);
  }
  Recipe r;
  r.method = "kvarn";
  EXPECT_EQ(method_of(r), Method::Kvarn);
}

TEST(MethodTable, UnknownNamesAreRefusedWithTheList) {
  for (const char* bad : {"bogus", "", "OSCAR", "oscar ", "oscar_lm"}) {
    EXPECT_FALSE(find_method(bad).has_value()) << bad;
    const std::string e = error_of([&] { method_from_name(bad); });
    EXPECT_TRUE(has(e, "unknown method '" + std::string(bad) + "'")) << e;
    EXPECT_TRUE(has(e, "(expected oscar, oscar-lm, hadamard, identity, random, turboquant, kivi, kvarn or commvq)"))
        << e;
  }
  EXPECT_EQ(method_names(nullptr, " | ", " | "),
            "oscar | oscar-lm | hadamard | identity | random | turboquant | kivi | kvarn | commvq");
  // compile refuses it with the same list.
  CompileOptions o;
  o.method = "bogus";
  EXPECT_TRUE(has(error_of([&] { make_recipe(o, 64, 2); }), "kivi, kvarn or commvq)"));
}

TEST(MethodTable, TraitsTheRuntimeAndCompileUse) {
  // The paged INT2 runtime serves the per-token grids, the level table of oscar-lm and kivi's
  // per-channel key pages (the host pool: runtime/served.h).
  EXPECT_EQ(method_names([](const MethodTraits& t) { return t.served_by_runtime; }),
            "oscar, oscar-lm, hadamard, identity, random or kivi");
  EXPECT_TRUE(served_by_runtime("oscar-lm"));
  EXPECT_TRUE(served_by_runtime("kivi"));
  EXPECT_FALSE(served_by_runtime("kvarn"));
  EXPECT_FALSE(served_by_runtime("bogus"));
  EXPECT_EQ(method_names([](const MethodTraits& t) { return t.spans_heads; }),
            "oscar, oscar-lm, hadamard, identity or random");
  EXPECT_EQ(method_names([](const MethodTraits& t) { return t.whole_rows; }), "turboquant, kvarn or commvq");
  EXPECT_EQ(method_traits(Method::Commvq).verify, &verify_commvq);
  EXPECT_EQ(method_traits(Method::Commvq).describe, &describe_commvq);
  EXPECT_EQ(method_traits(Method::TurboQuant).verify, &verify_turboquant);
  EXPECT_NE(method_traits(Method::Oscar).verify, nullptr);  // the published variant's clips
  EXPECT_EQ(method_traits(Method::Hadamard).verify, nullptr);
  EXPECT_STREQ(method_traits(Method::Oscar).value_target, "p2");
  EXPECT_STREQ(method_traits(Method::Hadamard).value_target, "");
}

// Every default of the table reaches the recipe compile makes.
TEST(MethodTable, DefaultsReachTheRecipe) {
  for (Method m : all_methods()) {
    const MethodTraits& t = method_traits(m);
    CompileOptions o;
    o.method = t.name;
    const Recipe r = make_recipe(o, 64, 2);
    EXPECT_EQ(r.method, t.name);
    EXPECT_EQ(r.group, t.group) << t.name;
    EXPECT_EQ(r.sink, t.sink) << t.name;
    EXPECT_EQ(r.recent, t.recent) << t.name;
    EXPECT_EQ(r.page_size, t.page_size) << t.name;
    EXPECT_EQ(r.value_target, t.value_target) << t.name;
    EXPECT_EQ(r.composition, t.composition) << t.name;
    for (const MethodParam& p : t.params) {
      if (!p.default_value) continue;
      EXPECT_EQ(r.params.at(p.key), p.default_value) << t.name << " " << p.key;
    }
  }
  // Explicit settings win; a mixed kivi recipe takes oscar's value-rotation defaults.
  CompileOptions o;
  o.method = "kivi";
  o.sink = 4;
  o.params["values"] = "oscar";
  const Recipe r = make_recipe(o, 64, 2);
  EXPECT_EQ(r.sink, 4);
  EXPECT_EQ(r.group, 32);
  EXPECT_EQ(r.value_target, "p2");
  EXPECT_EQ(r.composition, "UHP");
}

TEST(MethodTable, OptionsAMethodIgnoresAreRefusedByOneRule) {
  using enum MethodOption;
  EXPECT_EQ(options_error(Method::Kivi, 0, {{"values", "hadamard"}}), "(no error)");
  EXPECT_EQ(options_error(Method::Kivi, NoFitClip | FitRows, {{"values", "hadamard"}}), "(no error)");
  EXPECT_EQ(options_error(Method::Kivi, ValueTarget | Composition, {{"values", "oscar"}}), "(no error)");
  EXPECT_EQ(options_error(Method::Oscar, ValueTarget | Composition | Granularity | NoFitClip | FitRows, {}),
            "(no error)");
  EXPECT_EQ(options_error(Method::TurboQuant, unsigned(Seed), {{"variant", "prod"}, {"codebook", "gaussian"}}),
            "(no error)");
  EXPECT_EQ(options_error(Method::Kivi, unsigned(ValueTarget), {{"values", "hadamard"}}),
            "--value-target applies to oscar, oscar-lm and kivi --values oscar only, not kivi");
  EXPECT_EQ(options_error(Method::Kivi, unsigned(NoFitClip), {}),
            "--no-fit-clip applies to oscar, hadamard, identity, random, kivi --values hadamard and kivi "
            "--values oscar only, not kivi");
  EXPECT_EQ(options_error(Method::Oscar, unsigned(Seed), {}),
            "--seed applies to random, turboquant and commvq only, not oscar");
  EXPECT_EQ(options_error(Method::OscarLm, unsigned(NoFitClip), {}).rfind("--no-fit-clip applies to", 0), 0u);
  EXPECT_EQ(options_error(Method::Hadamard, 0, {{"values", "oscar"}}), "--values applies to kivi only, not hadamard");
  EXPECT_EQ(options_error(Method::Oscar, 0, {{"variant", "prod"}}),
            "oscar variant must be fitted or published, got 'prod'");
  EXPECT_EQ(options_error(Method::Hadamard, 0, {{"variant", "published"}}),
            "--param variant applies to oscar and turboquant only, not hadamard");
  EXPECT_EQ(options_error(Method::Hadamard, 0, {{"iterations", "3"}}),
            "--param iterations applies to kvarn and commvq only, not hadamard");
  EXPECT_EQ(options_error(Method::Hadamard, 0, {{"bogus", "1"}}),
            "unknown parameter 'bogus' for hadamard (it takes none)");
  EXPECT_EQ(options_error(Method::Oscar, 0, {{"bogus", "1"}}),
            "unknown parameter 'bogus' for oscar (it takes variant)");
  EXPECT_EQ(options_error(Method::Kvarn, 0, {{"bogus", "1"}}),
            "unknown parameter 'bogus' for kvarn (it takes iterations)");
  EXPECT_EQ(options_error(Method::TurboQuant, 0, {{"variant", "fast"}}),
            "turboquant variant must be mse or prod, got 'fast'");
  EXPECT_EQ(options_error(Method::Kivi, 0, {{"values", "random"}}),
            "kivi values must be hadamard or oscar, got 'random'");
  EXPECT_EQ(options_error(Method::Kvarn, 0, {{"iterations", "0"}}),
            "kvarn iterations must be an integer >= 1 and <= 1000, got '0'");
  EXPECT_EQ(options_error(Method::Kvarn, 0, {{"iterations", "8x"}}),
            "kvarn iterations must be an integer >= 1 and <= 1000, got '8x'");
  // compile applies the same rule to its parameters.
  CompileOptions o;
  o.method = "hadamard";
  o.params["variant"] = "prod";
  EXPECT_EQ(error_of([&] { make_recipe(o, 64, 2); }),
            "--param variant applies to oscar and turboquant only, not hadamard");
}

// A sound commvq artifact of one layer and one KV head (d = 16), codebooks from commvq_store.
Artifact commvq_artifact() {
  const ModelConfig cfg = testing::small_config(1, 2, 1, 16);
  Artifact a;
  a.fingerprint = testing::small_fingerprint(cfg);
  a.n_layers = 1;
  a.n_heads = 2;
  a.n_kv_heads = 1;
  a.head_dim = 16;
  a.rope_style = cfg.rope_style;
  a.recipe.method = "commvq";
  a.recipe.key_bits = a.recipe.value_bits = 1;
  a.recipe.params = {{"key_stages", "2"}, {"key_code_bits", "6"}, {"value_stages", "3"}, {"value_code_bits", "4"}};
  CommvqCodec codec;
  codec.key.d = codec.value.d = 16;
  codec.key.stages = 2;
  codec.key.half_bits = 3;
  codec.key.rope_style = cfg.rope_style;
  codec.key.params.assign(size_t(2) * 8 * 16, 0.125f);
  codec.value.stages = 3;
  codec.value.code_bits = 4;
  codec.value.codewords.assign(size_t(3) * 16 * 16, 0.25f);
  a.heads.resize(1);
  commvq_store(codec, a.heads[0].key, a.heads[0].value);
  return a;
}

// An iteration count that would make compile or validate run for hours is refused by the table's
// bounds, by compile's check and by the artifact reader's verify alike.
TEST(MethodParams, IterationCountsHaveAnUpperBound) {
  EXPECT_EQ(options_error(Method::Kvarn, 0, {{"iterations", "1000"}}), "(no error)");
  EXPECT_EQ(options_error(Method::Kvarn, 0, {{"iterations", "1001"}}),
            "kvarn iterations must be an integer >= 1 and <= 1000, got '1001'");
  EXPECT_EQ(options_error(Method::Kvarn, 0, {{"iterations", "2000000000"}}),
            "kvarn iterations must be an integer >= 1 and <= 1000, got '2000000000'");
  EXPECT_EQ(options_error(Method::Commvq, 0, {{"iterations", "2000000000"}}),
            "commvq iterations must be an integer >= 1 and <= 1000, got '2000000000'");
  CompileOptions o;
  o.method = "kvarn";
  o.params["iterations"] = "2000000000";
  EXPECT_EQ(error_of([&] { make_recipe(o, 64, 2); }),
            "kvarn iterations must be an integer >= 1 and <= 1000, got '2000000000'");

  const ModelConfig cfg = testing::small_config();
  Artifact a = testing::random_artifact(cfg, testing::small_fingerprint(cfg), 3, "kvarn");
  a.recipe.params = {{"iterations", "2000000000"}};
  const std::vector<std::string> problems = verify_artifact(a);
  EXPECT_NE(std::find(problems.begin(), problems.end(),
                      "recipe: kvarn iterations must be an integer >= 1 and <= 1000, got '2000000000'"),
            problems.end())
      << (problems.empty() ? "" : problems[0]);
  testing::ScratchDir dir;
  EXPECT_TRUE(has(error_of([&] { write_artifact(a, dir.file("slow.kvcc.h5")); }), "iterations must be an integer"));
}

TEST(MethodVerify, UnknownMethodIsAProblem) {
  const ModelConfig cfg = testing::small_config();
  Artifact a = testing::random_artifact(cfg, testing::small_fingerprint(cfg), 3, "bogus");
  const std::vector<std::string> problems = verify_artifact(a);
  ASSERT_EQ(problems.size(), 1u) << problems[0];
  EXPECT_EQ(problems[0],
            "recipe: unknown method 'bogus' (expected oscar, oscar-lm, hadamard, identity, random, turboquant, "
            "kivi, kvarn or commvq)");
  testing::ScratchDir dir;
  EXPECT_TRUE(has(error_of([&] { write_artifact(a, dir.file("bogus.kvcc.h5")); }), "unknown method 'bogus'"));
  a.recipe.method = "oscar";
  EXPECT_TRUE(verify_artifact(a).empty());
}

TEST(MethodVerify, CommvqCodebookShapesGoThroughTheTable) {
  Artifact a = commvq_artifact();
  ASSERT_TRUE(verify_artifact(a).empty()) << verify_artifact(a)[0];
  // A value codebook of 8 codewords where the recipe says 4-bit codes.
  NamedArray& v = a.heads[0].value.extras[0];
  ASSERT_EQ(v.name, "commvq_codebooks");
  v.shape[1] = 8;
  v.data.resize(size_t(3) * 8 * 16);
  std::vector<std::string> problems = verify_artifact(a);
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_EQ(problems[0], "commvq: layer 0 kv head 0: value codebook has 8 codewords, recipe value_code_bits = 4");
  testing::ScratchDir dir;
  EXPECT_TRUE(has(error_of([&] { write_artifact(a, dir.file("c.kvcc.h5")); }), "value codebook has 8 codewords"));
  // The same artifact named as another method is not checked as commvq.
  a.recipe.method = "identity";
  a.recipe.params.clear();
  EXPECT_TRUE(verify_artifact(a).empty());
}

TEST(MethodVerify, TurboquantSplitAndParametersGoThroughTheTable) {
  CompileOptions o;
  o.method = "turboquant";
  o.key_bits = o.value_bits = 2.5;
  Artifact a = compile_artifact(test::small_stats(), o);  // d = 64: 32 outlier channels at 3 bits
  ASSERT_TRUE(verify_artifact(a).empty()) << verify_artifact(a)[0];
  a.recipe.params["variant"] = "fast";
  EXPECT_EQ(verify_artifact(a), std::vector<std::string>{"recipe: turboquant variant must be mse or prod, got 'fast'"});
  a.recipe.params["variant"] = "mse";
  SideArtifact& key = a.head(1, 0).key;
  key.extras.erase(std::remove_if(key.extras.begin(), key.extras.end(),
                                  [](const NamedArray& x) { return x.name == "outlier_levels"; }),
                   key.extras.end());
  EXPECT_EQ(verify_artifact(a),
            std::vector<std::string>{"turboquant: layer 1 kv head 0 key: outlier_levels must hold 8 levels"});
  a.recipe.key_bits = 2;  // the stored split no longer matches the budget
  std::vector<std::string> problems = verify_artifact(a);
  ASSERT_FALSE(problems.empty());
  EXPECT_EQ(problems[0],
            "turboquant: layer 0 kv head 0 key: split 32 disagrees with the recipe's 2.000000 bits "
            "(0 outlier channels)");
}

}  // namespace
}  // namespace kvcc
