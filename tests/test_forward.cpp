// The CPU forward pass against Hugging Face transformers (reference logits saved by
// tests/reference/make_forward_refs.py), plus identities the layer operations must satisfy.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <numbers>
#include <random>

#include "formats/error.h"
#include "model/tokenizer.h"
#include "forward_test_util.h"

namespace fs = std::filesystem;
using namespace kvcc;
using namespace kvcc::testing;

namespace {

constexpr double kRelTol = 1e-4;

void expect_matches_transformers(const std::string& model_path, const std::string& ref_path) {
  const ModelFile model = ModelFile::open(model_path);
  const nlohmann::json ref = read_json_file(ref_path);
  const RefComparison cmp = compare_to_reference(model, ref);
  EXPECT_LT(cmp.relative(), kRelTol) << model_path << ": max |diff| " << cmp.max_abs_diff << " / max |ref| "
                                     << cmp.max_abs_ref;
  EXPECT_GT(cmp.max_abs_ref, 0.5);  // the reference is not degenerate
  std::printf("  %s: max |diff| / max |ref| = %.2e\n", fs::path(model_path).filename().c_str(), cmp.relative());
}

}  // namespace

// Tiny random models saved by transformers: llama3 rope scaling at head_dim 64 (transformers-4
// style config) and 128 (transformers-5 style, sharded), Qwen3 q/k norms at 64 (tied) and 128,
// a plain Llama at head_dim 256 (BF16 weights), Qwen2 q/k/v biases.
class TinyModel : public ::testing::TestWithParam<const char*> {};

TEST_P(TinyModel, LogitsMatchTransformers) {
  const std::string dir = data_models_dir() + "/" + GetParam();
  expect_matches_transformers(dir, dir + "/ref_logits.json");
}

TEST_P(TinyModel, RopeInverseFrequenciesMatchTransformers) {
  const std::string dir = data_models_dir() + "/" + GetParam();
  const ModelFile model = ModelFile::open(dir);
  const auto ref = read_json_file(dir + "/ref_logits.json")["inv_freq"].get<std::vector<double>>();
  const std::vector<double> ours = rope_inv_freq(model.config());
  ASSERT_EQ(ours.size(), ref.size());
  for (size_t i = 0; i < ref.size(); ++i) EXPECT_NEAR(ours[i], ref[i], 1e-6 * ref[i]) << GetParam() << " pair " << i;
}

// The same operations in double (validation's exact-check mode) match transformers as well, and
// differ from float32 by float rounding only (and do differ: the arithmetic is double).
TEST_P(TinyModel, DoubleForwardMatchesTransformersAndFloat) {
  const std::string dir = data_models_dir() + "/" + GetParam();
  const ModelFile model = ModelFile::open(dir);
  const nlohmann::json ref = read_json_file(dir + "/ref_logits.json");
  const RefComparison cmp = compare_to_reference<double>(model, ref);
  EXPECT_LT(cmp.relative(), kRelTol) << GetParam();
  const std::vector<int32_t> ids = ref["ids"].get<std::vector<int32_t>>();
  const std::vector<float> f = model_logits<float>(model, ids);
  const std::vector<double> d = model_logits<double>(model, ids);
  ASSERT_EQ(f.size(), d.size());
  double max_diff = 0, max_abs = 0;
  for (size_t i = 0; i < f.size(); ++i) {
    max_diff = std::max(max_diff, std::abs(double(f[i]) - d[i]));
    max_abs = std::max(max_abs, std::abs(d[i]));
  }
  EXPECT_LT(max_diff, 1e-5 * max_abs) << GetParam();
  EXPECT_GT(max_diff, 0.0) << GetParam();
}

INSTANTIATE_TEST_SUITE_P(Forward, TinyModel,
                         ::testing::Values("llama31-hd64", "llama31-hd128", "llama-hd256", "qwen3-hd64", "qwen3-hd128",
                                           "qwen2-bias"));

TEST(Forward, Llama3ScalingChangesOnlyLowFrequencies) {
  const ModelFile model = ModelFile::open(data_models_dir() + "/llama31-hd64");
  ModelConfig plain = model.config();
  ASSERT_EQ(plain.rope_scaling.type, "llama3");
  const std::vector<double> scaled = rope_inv_freq(plain);
  plain.rope_scaling = RopeScaling{};
  const std::vector<double> base = rope_inv_freq(plain);
  const RopeScaling& s = model.config().rope_scaling;
  int kept = 0, divided = 0, smoothed = 0;
  for (size_t i = 0; i < base.size(); ++i) {
    const double wavelen = 2 * std::numbers::pi / base[i];
    if (wavelen < s.original_max_position / s.high_freq_factor) {
      EXPECT_DOUBLE_EQ(scaled[i], base[i]);
      ++kept;
    } else if (wavelen > s.original_max_position / s.low_freq_factor) {
      EXPECT_NEAR(scaled[i], base[i] / s.factor, 1e-15);
      ++divided;
    } else {
      EXPECT_LT(scaled[i], base[i]);
      EXPECT_GT(scaled[i], base[i] / s.factor);
      ++smoothed;
    }
  }
  EXPECT_GT(kept, 0);  // the reference model exercises all three bands
  EXPECT_GT(divided, 0);
  EXPECT_GT(smoothed, 0);
}

TEST(Forward, TinyStories656kMatchesTransformers) {
  const std::string dir = shared_models_dir() + "/tinystories-656k";
  if (!fs::exists(dir)) GTEST_SKIP() << dir << " absent (../shared not mounted)";
  expect_matches_transformers(dir, data_models_dir() + "/refs/tinystories-656k.json");
}

TEST(Forward, TinyStories656kLongSequenceMatchesTransformers) {
  const std::string dir = shared_models_dir() + "/tinystories-656k";
  if (!fs::exists(dir)) GTEST_SKIP() << dir << " absent (../shared not mounted)";
  expect_matches_transformers(dir, data_models_dir() + "/refs/tinystories-656k-long.json");
}

TEST(Forward, Gutenberg27mMatchesTransformers) {
  const std::string dir = shared_models_dir() + "/gutenberg-27m";
  if (!fs::exists(dir)) GTEST_SKIP() << dir << " absent (../shared not mounted)";
  expect_matches_transformers(dir, data_models_dir() + "/refs/gutenberg-27m.json");
}

// The llama2.c checkpoint (interleaved RoPE) against transformers running the same weights
// converted to an HF Llama with permuted q/k rows.
TEST(Forward, Stories260kMatchesTransformersConversion) {
  const std::string bin = shared_models_dir() + "/stories260k/stories260K.bin";
  if (!fs::exists(bin)) GTEST_SKIP() << bin << " absent (../shared not mounted)";
  expect_matches_transformers(bin, data_models_dir() + "/refs/stories260k.json");
}

namespace {

// Greedy (argmax) continuation, recomputing the whole sequence per step.
std::vector<int32_t> greedy(const ModelFile& model, std::vector<int32_t> ids, int steps) {
  const size_t prompt_len = ids.size();
  const int vocab = model.config().vocab;
  for (int step = 0; step < steps; ++step) {
    const std::vector<float> logits = model_logits(model, ids);
    const float* last = logits.data() + (ids.size() - 1) * vocab;
    ids.push_back(int32_t(std::max_element(last, last + vocab) - last));
  }
  return std::vector<int32_t>(ids.begin() + long(prompt_len), ids.end());
}

}  // namespace

// A trained model's greedy continuation of "Once upon a time, there was a little" is the fluent
// text transformers produces (ids from its tokenizer.json, BOS 1 first).
TEST(Forward, TinyStories656kGreedyGenerationIsFluentAndPinned) {
  const std::string dir = shared_models_dir() + "/tinystories-656k";
  if (!fs::exists(dir)) GTEST_SKIP() << dir << " absent (../shared not mounted)";
  const ModelFile model = ModelFile::open(dir);
  const nlohmann::json ref = read_json_file(data_models_dir() + "/refs/tinystories-656k.json");
  const std::vector<int32_t> prompt = {1, 80, 147, 201, 282, 215, 286, 64, 207, 161};
  ASSERT_EQ(prompt, ref["prompt_ids"].get<std::vector<int32_t>>());
  const std::vector<int32_t> generated = greedy(model, prompt, 40);
  EXPECT_EQ(generated, ref["greedy_ids"].get<std::vector<int32_t>>());
  const auto tokenizer = Tokenizer::from_file(dir + "/tokenizer.json");
  const std::string text = tokenizer->decode(generated);
  EXPECT_EQ(text.rfind(". The large liked to go fast and play with his friends. One day,", 0), 0u) << text;
  EXPECT_NE(text.find("a little girl named Lily"), std::string::npos) << text;
}

// stories260k (llama2.c, interleaved RoPE): greedy ids equal transformers' on the converted
// weights. NOTE: neither implementation gets fluent text from ../shared's stories260K.bin (see
// tests/data/models/README.md), so this pins agreement, not fluency.
TEST(Forward, Stories260kGreedyGenerationIsPinned) {
  const std::string dir = shared_models_dir() + "/stories260k";
  if (!fs::exists(dir)) GTEST_SKIP() << dir << " absent (../shared not mounted)";
  const ModelFile model = ModelFile::open(dir + "/stories260K.bin");
  const nlohmann::json ref = read_json_file(data_models_dir() + "/refs/stories260k.json");
  // "Once upon a time, there was a little" in tok512 (BOS 1 first).
  const std::vector<int32_t> prompt = {1, 403, 407, 261, 378, 432, 383, 286, 261, 376};
  ASSERT_EQ(prompt, ref["prompt_ids"].get<std::vector<int32_t>>());
  const std::vector<int32_t> generated = greedy(model, prompt, 40);
  EXPECT_EQ(generated, ref["greedy_ids"].get<std::vector<int32_t>>());
  const auto tokenizer = Tokenizer::from_file(dir + "/tok512.bin");
  EXPECT_EQ(tokenizer->decode(prompt), "Once upon a time, there was a little");
}

// attention_qkv + causal_attention + attention_output_and_mlp is exactly layer_forward: validation
// substitutes its own attention in the middle.
TEST(Forward, LayerOperationsComposeToLayerForward) {
  const ModelFile model = ModelFile::open(data_models_dir() + "/qwen3-hd64");
  const ModelConfig& c = model.config();
  const int T = 19;
  std::vector<int32_t> ids(T);
  for (int t = 0; t < T; ++t) ids[t] = (t * 37 + 5) % c.vocab;
  std::vector<float> x(size_t(T) * c.hidden);
  embed(model, ids.data(), T, x.data());
  const LayerWeights w = load_layer(model, 1);
  std::vector<float> whole = x;
  layer_forward(c, w, 1, 0, whole.data(), T);

  const size_t qdim = size_t(c.n_heads) * c.head_dim, kvdim = size_t(c.n_kv_heads) * c.head_dim;
  std::vector<float> q(T * qdim), key(T * kvdim), value(T * kvdim), attn(T * qdim);
  attention_qkv(c, w, x.data(), T, 0, q.data(), nullptr, key.data(), value.data());
  causal_attention(c, T, q.data(), key.data(), value.data(), attn.data());
  attention_output_and_mlp(c, w, attn.data(), T, x.data());
  EXPECT_EQ(x, whole);
}

// prefix_causal_attention (validation's blocks over a cache) equals the last rows of causal
// attention over the whole sequence: bit for bit at n0 = 0, to rounding (1e-14 in double) after
// a prefix.
template <typename S>
void check_prefix_attention(double tol) {
  const ModelFile model = ModelFile::open(data_models_dir() + "/llama31-hd64");  // GQA: 4 q / 2 kv heads
  const ModelConfig& c = model.config();
  const int N = 29, n0 = 18, T = N - n0;
  const size_t qdim = size_t(c.n_heads) * c.head_dim, kvdim = size_t(c.n_kv_heads) * c.head_dim;
  std::mt19937 rng(5);
  std::normal_distribution<double> normal;
  std::vector<S> q(N * qdim), k(N * kvdim), v(N * kvdim), full(N * qdim), part(T * qdim), same(N * qdim);
  for (S& x : q) x = S(normal(rng));
  for (S& x : k) x = S(normal(rng));
  for (S& x : v) x = S(normal(rng));
  causal_attention(c, N, q.data(), k.data(), v.data(), full.data());
  prefix_causal_attention(c, 0, N, q.data(), k.data(), v.data(), same.data());
  EXPECT_EQ(same, full);
  prefix_causal_attention(c, n0, T, q.data() + n0 * qdim, k.data(), v.data(), part.data());
  for (size_t i = 0; i < part.size(); ++i) ASSERT_NEAR(part[i], full[n0 * qdim + i], tol) << i;
}

TEST(Forward, PrefixCausalAttentionEqualsRowsOfFullAttention) {
  check_prefix_attention<float>(1e-5);
  check_prefix_attention<double>(1e-14);
}

// Calibration's observer sees float32 activations; a double forward pass refuses one.
TEST(Forward, DoubleForwardRefusesObserver) {
  const ModelFile model = ModelFile::open(data_models_dir() + "/llama31-hd64");
  const ModelConfig& c = model.config();
  const int T = 5;
  const std::vector<int32_t> ids = {1, 7, 9, 2, 30};
  std::vector<double> x(size_t(T) * c.hidden);
  embed(model, ids.data(), T, x.data());
  struct Noop : AttentionObserver {
    void on_qkv(const SequenceTaps&) override {}
    void on_probs(const SequenceTaps&, int, const float*, const float*) override {}
  } noop;
  EXPECT_THROW(layer_forward(c, load_layer<double>(model, 0), 0, 0, x.data(), T, &noop), Error);
}

// Queries and keys at positions pos0.. equal the corresponding rows of a run from position 0.
TEST(Forward, AttentionQkvPositionOffsetMatchesLongerRun) {
  for (const char* name : {"llama31-hd128", "qwen2-bias"}) {
    const ModelFile model = ModelFile::open(data_models_dir() + "/" + name);
    const ModelConfig& c = model.config();
    const int T = 12, pos0 = 7;
    std::vector<int32_t> ids(T);
    for (int t = 0; t < T; ++t) ids[t] = (t * 11 + 3) % c.vocab;
    std::vector<float> x(size_t(T) * c.hidden);
    embed(model, ids.data(), T, x.data());
    const LayerWeights w = load_layer(model, 0);
    const size_t qdim = size_t(c.n_heads) * c.head_dim, kvdim = size_t(c.n_kv_heads) * c.head_dim;
    std::vector<float> q(T * qdim), kp(T * kvdim), k(T * kvdim), v(T * kvdim);
    attention_qkv(c, w, x.data(), T, 0, q.data(), kp.data(), k.data(), v.data());
    const int tail = T - pos0;
    std::vector<float> q2(tail * qdim), kp2(tail * kvdim), k2(tail * kvdim), v2(tail * kvdim);
    attention_qkv(c, w, x.data() + size_t(pos0) * c.hidden, tail, pos0, q2.data(), kp2.data(), k2.data(), v2.data());
    for (size_t i = 0; i < tail * qdim; ++i) ASSERT_NEAR(q2[i], q[pos0 * qdim + i], 1e-5) << name;
    for (size_t i = 0; i < tail * kvdim; ++i) {
      ASSERT_NEAR(k2[i], k[pos0 * kvdim + i], 1e-5) << name;
      // Pre-RoPE keys and values do not depend on position (equal up to GEMM blocking order).
      ASSERT_NEAR(kp2[i], kp[pos0 * kvdim + i], 1e-5) << name;
      ASSERT_NEAR(v2[i], v[pos0 * kvdim + i], 1e-5) << name;
    }
  }
}

// Interleaved RoPE on x equals rotate_half RoPE on x with each head's channels reordered
// (2i -> i, 2i+1 -> i + d/2): the identity make_forward_refs.py relies on for llama2.c.
TEST(Forward, InterleavedRopeIsRotateHalfOnPermutedChannels) {
  ModelConfig c;
  c.head_dim = 16;
  c.rope_theta = 10000;
  const int T = 9, heads = 3, d = c.head_dim;
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  std::vector<float> x(size_t(T) * heads * d), permuted(x.size());
  for (float& v : x) v = normal(rng);
  for (int t = 0; t < T; ++t)
    for (int h = 0; h < heads; ++h)
      for (int i = 0; i < d / 2; ++i) {
        const size_t base = (size_t(t) * heads + h) * d;
        permuted[base + i] = x[base + 2 * i];
        permuted[base + i + d / 2] = x[base + 2 * i + 1];
      }
  c.rope_style = RopeStyle::Interleaved;
  apply_rope(c, x.data(), T, heads, 3);
  c.rope_style = RopeStyle::RotateHalf;
  apply_rope(c, permuted.data(), T, heads, 3);
  for (int t = 0; t < T; ++t)
    for (int h = 0; h < heads; ++h)
      for (int i = 0; i < d / 2; ++i) {
        const size_t base = (size_t(t) * heads + h) * d;
        EXPECT_EQ(permuted[base + i], x[base + 2 * i]);
        EXPECT_EQ(permuted[base + i + d / 2], x[base + 2 * i + 1]);
      }
}

namespace {

// Records what the forward pass hands an observer and checks it against a naive double-precision
// attention.
struct CheckingObserver : AttentionObserver {
  const ModelConfig* config = nullptr;
  int qkv_calls = 0;
  std::vector<int> heads_seen;
  SequenceTaps first_taps;
  double max_prob_err = 0, max_out_err = 0;
  bool upper_zero = true;

  void on_qkv(const SequenceTaps& taps) override {
    ++qkv_calls;
    first_taps = taps;
  }
  void on_probs(const SequenceTaps& taps, int q_head, const float* probs, const float* output) override {
    heads_seen.push_back(q_head);
    const ModelConfig& c = *config;
    const int d = c.head_dim, T = taps.T, kv = q_head / c.group();
    const size_t qdim = size_t(c.n_heads) * d, kvdim = size_t(c.n_kv_heads) * d;
    for (int i = 0; i < T; ++i) {
      std::vector<double> p(i + 1);
      double max_s = -1e300, sum = 0;
      for (int j = 0; j <= i; ++j) {
        double s = 0;
        for (int e = 0; e < d; ++e) s += double(taps.q[i * qdim + q_head * d + e]) * taps.key[j * kvdim + kv * d + e];
        p[j] = s / std::sqrt(double(d));
        max_s = std::max(max_s, p[j]);
      }
      for (double& v : p) sum += (v = std::exp(v - max_s));
      for (int j = 0; j <= i; ++j) max_prob_err = std::max(max_prob_err, std::abs(p[j] / sum - probs[i * T + j]));
      for (int j = i + 1; j < T; ++j) upper_zero = upper_zero && probs[i * T + j] == 0.f;
      for (int e = 0; e < d; ++e) {
        double o = 0;
        for (int j = 0; j <= i; ++j) o += p[j] / sum * taps.value[j * kvdim + kv * d + e];
        max_out_err = std::max(max_out_err, std::abs(o - output[i * d + e]));
      }
    }
  }
};

}  // namespace

TEST(Forward, ObserverSeesNaiveAttention) {
  const ModelFile model = ModelFile::open(data_models_dir() + "/llama31-hd64");
  const ModelConfig& c = model.config();
  const int T = 23;
  std::vector<int32_t> ids(T);
  for (int t = 0; t < T; ++t) ids[t] = (t * 29 + 1) % c.vocab;
  std::vector<float> x(size_t(T) * c.hidden);
  embed(model, ids.data(), T, x.data());
  const LayerWeights w = load_layer(model, 1);
  const std::vector<float> x_in = x;
  CheckingObserver obs;
  obs.config = &c;
  layer_forward(c, w, 1, 42, x.data(), T, &obs);
  EXPECT_EQ(obs.qkv_calls, 1);
  std::vector<int> all_heads(c.n_heads);
  for (int h = 0; h < c.n_heads; ++h) all_heads[h] = h;
  EXPECT_EQ(obs.heads_seen, all_heads);
  EXPECT_EQ(obs.first_taps.layer, 1);
  EXPECT_EQ(obs.first_taps.doc, 42u);
  EXPECT_EQ(obs.first_taps.T, T);
  EXPECT_LT(obs.max_prob_err, 1e-5);
  EXPECT_LT(obs.max_out_err, 1e-4);
  EXPECT_TRUE(obs.upper_zero);

  // The taps are the same q/k/v that attention_qkv produces, with key_pre before RoPE.
  const size_t qdim = size_t(c.n_heads) * c.head_dim, kvdim = size_t(c.n_kv_heads) * c.head_dim;
  std::vector<float> q(T * qdim), kp(T * kvdim), k(T * kvdim), v(T * kvdim);
  attention_qkv(c, w, x_in.data(), T, 0, q.data(), kp.data(), k.data(), v.data());
  std::vector<float> rotated = kp;
  apply_rope(c, rotated.data(), T, c.n_kv_heads, 0);
  EXPECT_EQ(rotated, k);
  // (The tap pointers are dead after layer_forward; their contents were checked inside on_probs.)
}

// Logits at position t do not depend on tokens after t.
TEST(Forward, CausalityOfLogits) {
  const ModelFile model = ModelFile::open(data_models_dir() + "/qwen2-bias");
  const int vocab = model.config().vocab;
  std::vector<int32_t> a = {1, 5, 9, 33, 70, 2, 18, 44}, b = a;
  b[5] = 99, b[6] = 3, b[7] = 120;
  const auto la = model_logits(model, a), lb = model_logits(model, b);
  for (int t = 0; t < 5; ++t)
    for (int v = 0; v < vocab; ++v) ASSERT_NEAR(la[t * vocab + v], lb[t * vocab + v], 1e-5);
  double diff = 0;
  for (int v = 0; v < vocab; ++v) diff += std::abs(la[7 * vocab + v] - lb[7 * vocab + v]);
  EXPECT_GT(diff, 1e-2);
}

TEST(Forward, EmbedRejectsIdsOutsideVocabulary) {
  const ModelFile model = ModelFile::open(data_models_dir() + "/qwen2-bias");
  std::vector<float> x(2 * model.config().hidden);
  const int32_t bad[2] = {3, model.config().vocab};
  EXPECT_THROW(embed(model, bad, 2, x.data()), Error);
  const int32_t negative[1] = {-1};
  EXPECT_THROW(embed(model, negative, 1, x.data()), Error);
}
