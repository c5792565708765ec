// compile --bits-budget (compile/allocate.h): the widths chosen meet the budget as the
// effective-bits formula computes it (written out here from docs/methods.md), use it as fully as
// the integer widths allow, and are the exact optimum of the measured sensitivities (checked by
// brute force); a layer made very sensitive (sharper attention) gets more key bits; the per-side
// widths survive both containers and drive the codec, hence validate's codec path, exactly as the
// artifacts compiled at those widths, and the runtime's pages hold them. Weighed by the model's
// KL (compile --sensitivity-model): each layer side's errors scale to its measured KL, and that KL
// is validate's for the side quantised alone.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <random>

#include "compile/allocate.h"
#include "compile/compile.h"
#include "eval/bits_sensitivity.h"
#include "compile_test_util.h"
#include "eval/experiment.h"
#include "eval/scheme.h"
#include "formats/artifact.h"
#include "formats/artifact_safetensors.h"
#include "formats/h5.h"
#include "formats/kv_codec.h"
#include "formats_test_util.h"
#include "forward_test_util.h"
#include "runtime/kvcc_runtime.h"

namespace kvcc {
namespace {

using test::small_stats;

CompileOptions budget_options(double budget, int64_t context = 0, const std::string& granularity = "layer") {
  CompileOptions o;
  o.method = "hadamard";
  o.sink = 4;
  o.recent = 32;
  o.page_size = 16;
  o.max_fit_rows = 128;
  o.bits_budget = budget;
  o.budget_context = context;
  o.bits_granularity = granularity;
  o.budget_rows = 128;
  return o;
}

// docs/methods.md "Bits": a uniform-grid side at b bits with one fp16 scale and zero per row of d
// costs b + 32/d per element in the quantised tier; effective bits at L add the BF16 windows.
double formula_bits(const Artifact& a, int64_t L) {
  double tier = 0;
  for (const HeadArtifact& h : a.heads) tier += (h.key.bits + 32.0 / a.head_dim) + (h.value.bits + 32.0 / a.head_dim);
  tier /= double(2 * a.heads.size());
  if (L == 0) return tier;
  const double window = double(std::min<int64_t>(L, a.recipe.sink + a.recipe.recent));
  return (window * 16.0 + (double(L) - window) * tier) / double(L);
}

TEST(BitsBudget, MeetsTheBudgetAsTheFormulaComputesIt) {
  struct Case {
    double budget;
    int64_t context;
    const char* granularity;
  } cases[] = {{1.6, 0, "layer"}, {2.3, 0, "layer"}, {2.9, 0, "head"}, {3.0, 4096, "layer"}, {2.7, 1024, "head"}};
  for (const Case& c : cases) {
    BitsAllocation alloc;
    const Artifact a = compile_with_budget(small_stats(), budget_options(c.budget, c.context, c.granularity), &alloc);
    const double bits = formula_bits(a, c.context);
    EXPECT_NEAR(budget_measure(a, c.context), bits, 1e-12);
    EXPECT_NEAR(alloc.budget_bits, bits, 1e-12);
    EXPECT_LE(bits, c.budget + 1e-12) << c.budget;
    // As fully as the widths allow: one more bit on the smallest unit (a layer's side = its KV
    // heads; or one head's side) would exceed the budget, unless every side is at 4 bits.
    const int unit = alloc.granularity == "head" ? 1 : a.n_kv_heads;
    Artifact wider = a;
    bool all_max = true;
    for (HeadArtifact& h : wider.heads) all_max = all_max && h.key.bits == 4 && h.value.bits == 4;
    for (int h = 0; h < unit; ++h) wider.heads[size_t(h)].key.bits += 1;
    if (!all_max) {
      EXPECT_GT(formula_bits(wider, c.context), c.budget) << c.budget;
    }
    EXPECT_EQ(alloc.granularity, c.granularity);
    EXPECT_DOUBLE_EQ(std::stod(a.recipe.params.at("bits_budget")), c.budget);
    EXPECT_EQ(a.recipe.params.at("bits_granularity"), c.granularity);
    EXPECT_EQ(a.recipe.params.at("budget_context"), std::to_string(c.context));
    std::printf("  budget %.2f at %lld: %.4f bits\n", c.budget, (long long)c.context, bits);
  }
}

// The choice is the exact optimum of the measured table under the budget: every assignment of
// widths to the 4 (layer, side) units, each checked against the budget by the formula.
TEST(BitsBudget, ChoiceIsTheBruteForceOptimum) {
  for (double budget : {1.8, 2.3, 2.6, 3.4}) {
    BitsAllocation alloc;
    const Artifact a = compile_with_budget(small_stats(), budget_options(budget), &alloc);
    const int L = a.n_layers, H = a.n_kv_heads;
    ASSERT_EQ(alloc.widths, (std::vector<int>{1, 2, 3, 4}));
    auto unit_error = [&](int l, int s, int j) {
      double e = 0;
      for (int h = 0; h < H; ++h) e += alloc.sensitivity[(size_t(l) * H + h) * 2 + s].error[size_t(j)];
      return e;
    };
    double best = INFINITY;
    std::vector<int> best_choice;
    for (int code = 0; code < 256; ++code) {
      std::vector<int> choice = {code & 3, (code >> 2) & 3, (code >> 4) & 3, (code >> 6) & 3};  // (l, s) units
      Artifact t = a;
      double e = 0;
      for (int l = 0; l < L; ++l)
        for (int s = 0; s < 2; ++s) {
          const int j = choice[size_t(l * 2 + s)];
          e += unit_error(l, s, j);
          for (int h = 0; h < H; ++h) (s ? t.head(l, h).value : t.head(l, h).key).bits = alloc.widths[size_t(j)];
        }
      if (formula_bits(t, 0) <= budget + 1e-12 && e < best) best = e, best_choice = choice;
    }
    EXPECT_NEAR(alloc.predicted_error, best, 1e-12 * best) << budget;
    for (int l = 0; l < L; ++l)
      for (int s = 0; s < 2; ++s)
        EXPECT_EQ(int((s ? a.head(l, 0).value : a.head(l, 0).key).bits),
                  alloc.widths[size_t(best_choice[size_t(l * 2 + s)])])
            << budget;
  }
  // The solver on a hand-worked table: two items, widths 1/2/3, capacity 4 (weights 1): the best
  // is 1 + 3 bits (0.5 + 0.1) over 2 + 2 (0.3 + 0.4).
  EXPECT_EQ(choose_widths({{0.9, 0.3, 0.2}, {0.5, 0.4, 0.1}}, {1, 1}, {1, 2, 3}, 4), (std::vector<int>{1, 1}));
  EXPECT_EQ(choose_widths({{0.9, 0.3, 0.2}, {0.5, 0.45, 0.44}}, {1, 1}, {1, 2, 3}, 4), (std::vector<int>{2, 0}));
  EXPECT_CONTAINS(testing::error_of([] { choose_widths({{1.0}}, {2}, {1}, 1); }), "below the narrowest");
}

// Attention four times sharper in layer 1 (its queries scaled by 4): a key error moves its logits
// four times as much, so its keys' measured error is far larger and the budget goes there.
TEST(BitsBudget, AVerySensitiveLayerGetsMoreBits) {
  Stats sharp = small_stats();
  for (int h = 0; h < sharp.config.n_kv_heads; ++h) {
    for (float& x : sharp.reservoirs[size_t(1 * sharp.config.n_kv_heads + h)].q) x *= 4.0f;
  }
  BitsAllocation plain, hot;
  const Artifact a = compile_with_budget(small_stats(), budget_options(2.3), &plain);
  const Artifact b = compile_with_budget(sharp, budget_options(2.3), &hot);
  const int H = a.n_kv_heads;
  // The premise: sharper attention doubles layer 1's key error at 2-4 bits (measured ~2.2x; at 1 bit
  // both errors exceed the output itself, saturated) and leaves layer 0's as it was.
  for (size_t j = 0; j < hot.widths.size(); ++j) {
    std::printf("  width %d: layer-1 key error %.4f -> %.4f\n", hot.widths[j],
                plain.sensitivity[size_t(2 * H)].error[j], hot.sensitivity[size_t(2 * H)].error[j]);
    if (hot.widths[j] >= 2) {
      EXPECT_GT(hot.sensitivity[size_t(2 * H)].error[j], 2.0 * plain.sensitivity[size_t(2 * H)].error[j]) << j;
    }
    EXPECT_EQ(hot.sensitivity[0].error[j], plain.sensitivity[0].error[j]);
  }
  EXPECT_GT(b.head(1, 0).key.bits, b.head(0, 0).key.bits);
  EXPECT_GT(b.head(1, 0).key.bits, a.head(1, 0).key.bits);
  std::printf("  key bits per layer: plain %g / %g, sharp layer 1: %g / %g\n", a.head(0, 0).key.bits,
              a.head(1, 0).key.bits, b.head(0, 0).key.bits, b.head(1, 0).key.bits);
}

// weigh_by_kl: at each width up to the recipe's (1 and 2 bits here), each (layer, side)'s errors
// scaled so that their sum over KV heads is that side's KL there, wider widths by the recipe
// width's factor; a KL proportional to the held-out errors changes no width; a KL concentrated on
// one side sends the bits there; a 1-bit KL far above the 2-bit one's extrapolation keeps every
// side off 1 bit.
TEST(BitsBudget, KlWeighsEachLayerSide) {
  const CompileOptions o = budget_options(2.3);
  BitsAllocation plain;
  const Artifact a = compile_with_budget(small_stats(), o, &plain);
  const int L = a.n_layers, H = a.n_kv_heads;  // widths {1,2,3,4}
  auto unit = [&](const BitsAllocation& t, int l, int s, int j) {
    double e = 0;
    for (int h = 0; h < H; ++h) e += t.sensitivity[(size_t(l) * H + h) * 2 + s].error[size_t(j)];
    return e;
  };
  // The KL side_kl answers for an artifact at one width: factor(l, s, width) x the held-out errors.
  auto kl_of = [&](const std::function<double(int, int, int)>& factor) {
    return [&, factor](const Artifact& at) {
      EXPECT_EQ(at.recipe.key_bits, at.recipe.value_bits);  // both sides at one width
      EXPECT_FALSE(has_side_bits(at));
      const int w = int(at.recipe.key_bits);
      std::vector<double> kl;
      for (int l = 0; l < L; ++l)
        for (int s = 0; s < 2; ++s) kl.push_back(factor(l, s, w) * unit(plain, l, s, w - 1));
      return kl;
    };
  };
  // Proportional: 3x the held-out errors everywhere.
  CompileOptions prop = o;
  std::vector<int> asked;
  const auto three = kl_of([](int, int, int) { return 3.0; });
  prop.side_kl = [&](const Artifact& at) {
    asked.push_back(int(at.recipe.key_bits));
    return three(at);
  };
  BitsAllocation scaled;
  const Artifact b = compile_with_budget(small_stats(), prop, &scaled);
  for (size_t i = 0; i < a.heads.size(); ++i) {
    EXPECT_EQ(a.heads[i].key.bits, b.heads[i].key.bits) << i;
    EXPECT_EQ(a.heads[i].value.bits, b.heads[i].value.bits) << i;
  }
  EXPECT_NEAR(scaled.predicted_error, 3.0 * plain.predicted_error, 1e-12 * plain.predicted_error);
  ASSERT_EQ(scaled.kl_scale.size(), size_t(L) * 2 * 4);
  for (double f : scaled.kl_scale) EXPECT_NEAR(f, 3.0, 1e-12);
  EXPECT_EQ(asked, (std::vector<int>{1, 2}));  // measured up to the recipe's width, once each
  EXPECT_EQ(b.recipe.params.at("bits_sensitivity"), "kl");
  EXPECT_EQ(a.recipe.params.at("bits_sensitivity"), "heldout");
  // Concentrated: layer 1's values cost 1000x what any other side does. At 1 and 2 bits the sums
  // are the KLs, at 3 and 4 bits the 2-bit factor applies, and those values get the most bits.
  CompileOptions hot = o;
  auto hot_factor = [](int l, int s, int) { return l == 1 && s == 1 ? 1000.0 : 1.0; };
  hot.side_kl = kl_of(hot_factor);
  BitsAllocation weighed;
  const Artifact c = compile_with_budget(small_stats(), hot, &weighed);
  for (int l = 0; l < L; ++l)
    for (int s = 0; s < 2; ++s)
      for (int j = 0; j < 4; ++j)
        EXPECT_NEAR(unit(weighed, l, s, j), hot_factor(l, s, 0) * unit(plain, l, s, j), 1e-12 * unit(weighed, l, s, j))
            << l << s << j;
  for (int l = 0; l < L; ++l) {
    EXPECT_GE(c.head(1, 0).value.bits, c.head(l, 0).key.bits);
    EXPECT_GE(c.head(1, 0).value.bits, c.head(l, 0).value.bits);
  }
  EXPECT_GT(c.head(1, 0).value.bits, a.head(1, 0).value.bits);
  // 1 bit measured at 100x what the held-out ratio to 2 bits predicts: no side goes to 1 bit at a
  // budget (>= 2.5 bits: widths averaging >= 2) where the held-out errors alone put some there.
  auto has_one = [](const Artifact& x) {
    for (const HeadArtifact& h : x.heads)
      if (h.key.bits == 1 || h.value.bits == 1) return true;
    return false;
  };
  int tried = 0;
  for (double budget : {2.5, 2.6, 2.7, 2.8, 3.0, 3.2}) {
    if (!has_one(compile_with_budget(small_stats(), budget_options(budget, 0, "head")))) continue;
    ++tried;
    CompileOptions steep = budget_options(budget, 0, "head");
    steep.side_kl = kl_of([](int, int, int w) { return w == 1 ? 100.0 : 1.0; });
    EXPECT_FALSE(has_one(compile_with_budget(small_stats(), steep))) << budget;
  }
  EXPECT_GT(tried, 0);  // the premise: some budget where the held-out errors pick 1 bit
  // Refused: one KL per layer and side, finite and >= 0.
  for (std::vector<double> bad :
       {std::vector<double>(size_t(L) * 2 - 1, 1e-3), std::vector<double>{1e-3, -1e-3, 1e-3, 1e-3},
        std::vector<double>{1e-3, NAN, 1e-3, 1e-3}}) {
    CompileOptions w = o;
    w.side_kl = [bad](const Artifact&) { return bad; };
    EXPECT_CONTAINS(testing::error_of([&] { compile_with_budget(small_stats(), w); }), "KL");
  }
  // Not measured at all when the budget cannot be met.
  CompileOptions tight = budget_options(0.5);
  tight.side_kl = [&](const Artifact& at) {
    ADD_FAILURE() << "measured for an infeasible budget";
    return three(at);
  };
  EXPECT_CONTAINS(testing::error_of([&] { compile_with_budget(small_stats(), tight); }), "below the narrowest");
}

// measure_side_kl: each side's KL is validate's KL of a scheme that codes that layer's side alone
// (built here from the layer codec directly) and passes the rest through; zero when the documents
// never fill a page; more bits, less KL.
TEST(BitsBudget, SideKlIsValidatesWithOneSideQuantised) {
  const ModelFile model = ModelFile::open(testing::data_models_dir() + "/llama31-hd64");
  const ModelConfig& c = model.config();
  CompileOptions o = budget_options(0);
  const Artifact a = compile_artifact(small_stats(), o);
  ASSERT_EQ(c.n_layers, a.n_layers);
  std::mt19937 rng(5);
  std::vector<std::vector<int32_t>> docs(2, std::vector<int32_t>(90));
  for (auto& d : docs)
    for (auto& t : d) t = int32_t(rng() % uint32_t(c.vocab));
  const std::vector<double> kl = measure_side_kl(model, docs, a, ValidateMode::Static, 32);
  ASSERT_EQ(kl.size(), size_t(c.n_layers) * 2);
  const size_t row = size_t(c.n_kv_heads) * c.head_dim;
  std::vector<CacheScheme> by_hand;
  for (int l = 0; l < c.n_layers; ++l)
    for (KvSide side : {KvSide::Key, KvSide::Value}) {
      CacheScheme s = scheme_from_artifact(a, "one side", c);
      s.path = CodecPath{[&a, l, side, row](int layer, KvSide sd, const float* r, int m, int64_t, float* out) {
        if (layer == l && sd == side) roundtrip_layer_page(a, layer, sd, r, m, out);
        else std::copy(r, r + size_t(m) * row, out);
      }};
      by_hand.push_back(std::move(s));
    }
  const ValidationResult v = validate_schemes(model, docs, by_hand, ValidateMode::Static, 32);
  for (size_t i = 0; i < kl.size(); ++i) {
    EXPECT_EQ(kl[i], v.schemes[i].kl) << i;
    EXPECT_GT(kl[i], 0.0) << i;
  }
  // 30-token documents never fill a page past the sink (4) and ring (32): nothing is quantised.
  std::vector<std::vector<int32_t>> short_docs(2, std::vector<int32_t>(docs[0].begin(), docs[0].begin() + 30));
  for (double x : measure_side_kl(model, short_docs, a, ValidateMode::Static, 32)) EXPECT_EQ(x, 0.0);
  // 1-bit codes cost more than 4-bit ones, in total over the sides.
  double total[2] = {0, 0};
  for (int i = 0; i < 2; ++i) {
    o.key_bits = o.value_bits = i ? 4 : 1;
    for (double x : measure_side_kl(model, docs, compile_artifact(small_stats(), o), ValidateMode::Static, 32))
      total[i] += x;
  }
  EXPECT_GT(total[0], total[1]);
}

// Per-side widths in both containers; an artifact without them reads 0 (the recipe's bits).
TEST(BitsBudget, WidthsSurviveBothContainersAndAreChecked) {
  const Artifact a = compile_with_budget(small_stats(), budget_options(2.3, 0, "head"));
  ASSERT_TRUE(has_side_bits(a));
  testing::ScratchDir dir;
  write_artifact(a, dir.file("b.kvcc.h5"));
  EXPECT_EQ(artifact_difference(read_artifact(dir.file("b.kvcc.h5")), a), "");
  write_artifact_safetensors(a, dir.file("b.safetensors"));
  EXPECT_EQ(artifact_difference(read_artifact(dir.file("b.safetensors")), a), "");
  Artifact plain = a;
  for (HeadArtifact& h : plain.heads) h.key.bits = h.value.bits = 0;
  EXPECT_CONTAINS(artifact_difference(plain, a), "bits differ");
  write_artifact(plain, dir.file("plain.kvcc.h5"));
  EXPECT_FALSE(has_side_bits(read_artifact(dir.file("plain.kvcc.h5"))));
  // Per-side widths are format 2.0 (a 1.x reader would code those sides at the recipe's bits, and
  // refuses 2.0 by its major); without them 1.1. A 1.x file holding widths is refused.
  EXPECT_EQ(read_artifact(dir.file("b.kvcc.h5")).format_version, "2.0");
  EXPECT_EQ(read_artifact(dir.file("b.safetensors")).format_version, "2.0");
  EXPECT_EQ(read_artifact(dir.file("plain.kvcc.h5")).format_version, "1.1");
  {
    h5::File f = h5::File::open_rw(dir.file("b.kvcc.h5"));
    f.set_attr("format_version", std::string("1.1"));
    h5::seal_attributes(f);
    f.close();
  }
  EXPECT_CONTAINS(testing::error_of([&] { read_artifact(dir.file("b.kvcc.h5")); }),
                  "sides carry their own code widths (bits), which needs format_version 2.0, but the file says 1.1");
  Artifact half = a;
  half.heads[0].key.bits = 2.5;
  EXPECT_CONTAINS(verify_artifact(half).at(0), "not a whole number of bits");
  Artifact tq = a;
  tq.recipe.method = "turboquant";
  bool found = false;
  for (const std::string& p : verify_artifact(tq)) found = found || p.find("per-side bit widths") != std::string::npos;
  EXPECT_TRUE(found);
  CompileOptions o = budget_options(2.3);
  o.method = "turboquant";
  EXPECT_CONTAINS(testing::error_of([&] { compile_artifact(small_stats(), o); }), "not turboquant");
  EXPECT_CONTAINS(testing::error_of([&] { compile_artifact(small_stats(), budget_options(1.2)); }),
                  "below the narrowest allocation");
  EXPECT_CONTAINS(testing::error_of([&] { compile_artifact(small_stats(), budget_options(2.3, 0, "token")); }),
                  "must be auto, layer or head");
}

// The codec codes each side at its own width: a layer's pages through the budget artifact equal
// those through the artifact compiled at that width, bit for bit; so validate's codec path equals
// a scheme that codes each (layer, side) with the artifact of its width.
TEST(BitsBudget, CodecAndValidateUseTheWidths) {
  BitsAllocation alloc;
  const Artifact a = compile_with_budget(small_stats(), budget_options(2.8), &alloc);
  std::vector<Artifact> at;
  for (int b : alloc.widths) {
    CompileOptions o = budget_options(0);
    o.key_bits = o.value_bits = b;
    at.push_back(compile_artifact(small_stats(), o));
  }
  auto width_artifact = [&](int layer, KvSide side) -> const Artifact& {
    const double b = side == KvSide::Key ? a.head(layer, 0).key.bits : a.head(layer, 0).value.bits;
    return at[size_t(b) - 1];
  };
  bool widths_differ = false;
  const int w = a.n_kv_heads * a.head_dim, n = 16;
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  std::vector<float> rows(size_t(n) * w), x(rows.size()), y(rows.size());
  for (float& r : rows) r = nd(rng);
  for (int l = 0; l < a.n_layers; ++l)
    for (KvSide s : {KvSide::Key, KvSide::Value}) {
      widths_differ = widths_differ || (s == KvSide::Key ? a.head(l, 0).key.bits : a.head(l, 0).value.bits) != 2;
      roundtrip_layer_page(a, l, s, rows.data(), n, x.data());
      roundtrip_layer_page(width_artifact(l, s), l, s, rows.data(), n, y.data());
      EXPECT_EQ(x, y) << "layer " << l << " " << kv_side_name(s);
    }
  EXPECT_TRUE(widths_differ);  // the budget moved some side off 2 bits
  const ModelFile model = ModelFile::open(testing::data_models_dir() + "/llama31-hd64");
  const ModelConfig& c = model.config();
  ASSERT_EQ(c.n_layers, a.n_layers);
  ASSERT_EQ(c.n_kv_heads, a.n_kv_heads);
  std::vector<std::vector<int32_t>> docs(2, std::vector<int32_t>(90));
  for (auto& d : docs)
    for (auto& t : d) t = int32_t(rng() % uint32_t(c.vocab));
  CacheScheme by_width = scheme_from_artifact(a, "by width", c);
  by_width.path = CodecPath{[&](int layer, KvSide side, const float* r, int m, int64_t, float* out) {
    roundtrip_layer_page(width_artifact(layer, side), layer, side, r, m, out);
  }};
  const ValidationResult v =
      validate_schemes(model, docs, {scheme_from_artifact(a, "budget", c), by_width}, ValidateMode::PseudoDecode, 32);
  EXPECT_EQ(v.schemes[0].nll, v.schemes[1].nll);
  EXPECT_EQ(v.schemes[0].kl, v.schemes[1].kl);
  EXPECT_GT(v.schemes[0].kl, 0.0);
  // Its accounting is the artifact's own, and the runtime's host pool holds each side at its width.
  EXPECT_NEAR(v.schemes[0].effective_bits, effective_bits_at_lengths(a, v.doc_lengths), 1e-12);
  EXPECT_NEAR(nominal_bits(a), 0.5 * (history_bits(a, KvSide::Key) + history_bits(a, KvSide::Value)) - 0.5, 1e-12);
  Runtime rt(a, EngineShape{a.n_layers, a.n_heads, a.n_kv_heads, a.head_dim},
             RuntimeOptions{4, 1, PoolMemory::Host, 0.0f});
  for (int l = 0; l < a.n_layers; ++l)
    for (int h = 0; h < a.n_kv_heads; ++h) {
      EXPECT_EQ(rt.cache().layout().widths(l, h).key, int(a.head(l, h).key.bits));
      EXPECT_EQ(rt.cache().layout().widths(l, h).value, int(a.head(l, h).value.bits));
    }
}

}  // namespace
}  // namespace kvcc
