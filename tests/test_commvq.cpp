// CommVQ: the codec's RoPE commutativity, score-without-decoding, EM training invariants, encode/
// decode round trips, determinism and the artifact glue. References are computed another way:
// naive double-precision RoPE and dot products, runtime's apply_rope, brute-force decoding.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "compile/commvq.h"
#include "formats/artifact.h"
#include "formats/codec_commvq.h"
#include "formats/error.h"
#include "formats/fp16.h"
#include "runtime/commvq_score.h"
#include "model/forward.h"

namespace kvcc {
namespace {

ModelConfig rope_config(int d, RopeStyle style, bool llama3 = false) {
  ModelConfig c;
  c.architecture = "llama";
  c.head_dim = d;
  c.n_heads = 1;
  c.n_kv_heads = 1;
  c.rope_theta = llama3 ? 500000.0 : 10000.0;
  c.rope_style = style;
  if (llama3) {
    c.rope_scaling.type = "llama3";
    c.rope_scaling.factor = 8.0;
    c.rope_scaling.low_freq_factor = 1.0;
    c.rope_scaling.high_freq_factor = 4.0;
    c.rope_scaling.original_max_position = 8192;
  }
  return c;
}

CommvqKeyCodebook random_key_codebook(int d, int stages, int half_bits, RopeStyle style, uint64_t seed) {
  CommvqKeyCodebook cb;
  cb.d = d;
  cb.stages = stages;
  cb.half_bits = half_bits;
  cb.rope_style = style;
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> g(0.0f, 0.2f);
  cb.params.resize(size_t(stages) * cb.n_params() * d);
  for (float& x : cb.params) x = g(rng);
  return cb;
}

CommvqEncoded random_codes(size_t n, int stages, int n_codes, uint64_t seed) {
  CommvqEncoded e;
  e.n = n;
  e.stages = stages;
  std::mt19937_64 rng(seed);
  e.codes.resize(n * stages);
  for (auto& c : e.codes) c = uint16_t(rng() % uint64_t(n_codes));
  std::uniform_real_distribution<float> u(0.5f, 8.0f);
  for (size_t i = 0; i < n; ++i) e.norms.push_back(f16_from_float(u(rng)));
  return e;
}

// Keys with a skewed spectrum and a RoPE-pair structure, like real pre-RoPE keys.
std::vector<float> synthetic_rows(size_t n, int d, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> mean(d);
  for (int c = 0; c < d; ++c) mean[c] = (c % 5 == 0) ? 2.0f : 0.0f;
  std::vector<float> x(n * d);
  for (size_t i = 0; i < n; ++i)
    for (int c = 0; c < d; ++c) x[i * d + c] = mean[c] + g(rng) * std::pow(0.8f, float(c % 16)) * 3.0f;
  return x;
}

// Naive RoPE in double from the definition: pair (re, im) rotated by pos·ω_j.
std::vector<double> naive_rope(const std::vector<float>& x, int d, RopeStyle style, const std::vector<double>& inv_freq,
                               int pos) {
  std::vector<double> y(x.begin(), x.end());
  for (int j = 0; j < d / 2; ++j) {
    const int c0 = commvq_pair_channel(style, d, j, 0), c1 = commvq_pair_channel(style, d, j, 1);
    const double angle = double(float(pos) * float(inv_freq[j]));
    y[c0] = std::cos(angle) * x[c0] - std::sin(angle) * x[c1];
    y[c1] = std::sin(angle) * x[c0] + std::cos(angle) * x[c1];
  }
  return y;
}

class CommvqStyle : public ::testing::TestWithParam<RopeStyle> {};

TEST_P(CommvqStyle, RopeOfDecodedKeyEqualsDecodingWithRotatedCodewords) {
  const RopeStyle style = GetParam();
  const int d = 32, stages = 3, half_bits = 3;
  const ModelConfig cfg = rope_config(d, style);
  const auto inv_freq = rope_inv_freq(cfg);
  const CommvqKeyCodebook cb = random_key_codebook(d, stages, half_bits, style, 11);
  const CommvqEncoded enc = random_codes(1, stages, cb.n_codes(), 12);
  for (int pos : {0, 1, 7, 1000, 4095}) {
    std::vector<float> k(d);
    commvq_decode_keys(cb, enc, k.data());
    apply_rope(cfg, k.data(), 1, 1, pos);  // RoPE after decoding (the model's own RoPE)

    // Decode with every parameter t_{r,k,j} multiplied by e^{i·pos·ω_j}.
    CommvqKeyCodebook rotated = cb;
    for (size_t rk = 0; rk < size_t(stages) * cb.n_params(); ++rk)
      for (int j = 0; j < d / 2; ++j) {
        const double angle = double(float(pos) * float(inv_freq[j]));
        float* t = rotated.params.data() + rk * d + 2 * j;
        const double re = t[0], im = t[1];
        t[0] = float(std::cos(angle) * re - std::sin(angle) * im);
        t[1] = float(std::sin(angle) * re + std::cos(angle) * im);
      }
    std::vector<float> k_rot(d);
    commvq_decode_keys(rotated, enc, k_rot.data());
    double scale = 0;
    for (float v : k) scale = std::max(scale, double(std::fabs(v)));
    for (int c = 0; c < d; ++c) EXPECT_NEAR(k[c], k_rot[c], 2e-6 * scale) << "pos " << pos << " channel " << c;
  }
}

TEST_P(CommvqStyle, TableScoresEqualDotWithRopedDecodedKey) {
  const RopeStyle style = GetParam();
  const int d = 64, stages = 5, half_bits = 4;
  for (bool llama3 : {false, true}) {
    const ModelConfig cfg = rope_config(d, style, llama3);
    const auto inv_freq = rope_inv_freq(cfg);
    const CommvqKeyCodebook cb = random_key_codebook(d, stages, half_bits, style, 21);
    const size_t n = 200;
    const CommvqEncoded enc = random_codes(n, stages, cb.n_codes(), 22);
    std::vector<int32_t> pos(n);
    std::mt19937 rng(5);
    for (auto& p : pos) p = int32_t(rng() % 100000);
    std::vector<float> q(d);
    std::normal_distribution<float> g(0.0f, 1.0f);
    for (float& x : q) x = g(rng);

    std::vector<float> scores(n);
    commvq_scores(commvq_query_table(cb, q.data()), inv_freq, enc, pos.data(), scores.data());

    std::vector<float> keys(n * d);
    commvq_decode_keys(cb, enc, keys.data());
    for (size_t i = 0; i < n; ++i) {
      std::vector<float> k(keys.begin() + i * d, keys.begin() + (i + 1) * d);
      const auto kr = naive_rope(k, d, style, inv_freq, pos[i]);
      double ref = 0, qn = 0, kn = 0;
      for (int c = 0; c < d; ++c) {
        ref += double(q[c]) * kr[c];
        qn += double(q[c]) * q[c];
        kn += kr[c] * kr[c];
      }
      // 1e-5 relative to the score, or to ‖q‖‖k‖ where the score itself cancels to near zero.
      const double tol = 1e-5 * std::max(std::fabs(ref), 0.01 * std::sqrt(qn * kn));
      EXPECT_NEAR(scores[i], ref, tol) << "token " << i << " llama3 " << llama3;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(BothConventions, CommvqStyle,
                         ::testing::Values(RopeStyle::RotateHalf, RopeStyle::Interleaved));

TEST(Commvq, ValueSumsEqualWeightedDecodedValues) {
  const int d = 16;
  CommvqValueCodebook cb;
  cb.d = d;
  cb.stages = 3;
  cb.code_bits = 4;
  std::mt19937_64 rng(3);
  std::normal_distribution<float> g(0.0f, 1.0f);
  cb.codewords.resize(size_t(cb.stages) * cb.n_codes() * d);
  for (float& x : cb.codewords) x = g(rng);
  // An orthogonal rotation: a product of Givens rotations.
  std::vector<double> R(size_t(d) * d, 0.0);
  for (int i = 0; i < d; ++i) R[size_t(i) * d + i] = 1.0;
  for (int s = 0; s < 40; ++s) {
    const int a = int(rng() % d), b = int((a + 1 + rng() % (d - 1)) % d);
    const double th = double(g(rng));
    for (int r = 0; r < d; ++r) {
      const double x = R[size_t(r) * d + a], y = R[size_t(r) * d + b];
      R[size_t(r) * d + a] = std::cos(th) * x - std::sin(th) * y;
      R[size_t(r) * d + b] = std::sin(th) * x + std::cos(th) * y;
    }
  }
  cb.rotation = R;
  const size_t n = 300;
  const CommvqEncoded enc = random_codes(n, cb.stages, cb.n_codes(), 4);
  std::vector<float> p(n);
  double total = 0;
  for (float& x : p) total += (x = std::uniform_real_distribution<float>(0, 1)(rng));
  for (float& x : p) x = float(x / total);
  std::vector<float> out(d);
  commvq_weighted_values(cb, enc, p.data(), out.data());
  std::vector<float> v(n * d);
  commvq_decode_values(cb, enc, v.data());
  for (int c = 0; c < d; ++c) {
    double ref = 0;
    for (size_t i = 0; i < n; ++i) ref += double(p[i]) * v[i * d + c];
    EXPECT_NEAR(out[c], ref, 1e-5 * (1 + std::fabs(ref)));
  }
}

TEST(Commvq, KeyRoundTripRecoversCodewordsAndNorms) {
  const int d = 16;
  for (RopeStyle style : {RopeStyle::RotateHalf, RopeStyle::Interleaved}) {
    const CommvqKeyCodebook base = random_key_codebook(d, 1, 3, style, 31);
    for (int code = 0; code < base.n_codes(); ++code) {
      // Scale the codebook so this centre has unit norm: a key 3·centre then normalises to the
      // centre exactly, must encode to its own code and decode to 3·centre.
      std::vector<float> c(d, 0.0f);
      commvq_key_add_centre(base, 0, uint16_t(code), 1.0f, c.data());
      double cn = 0;
      for (float v : c) cn += double(v) * v;
      CommvqKeyCodebook cb = base;
      for (float& t : cb.params) t = float(t / std::sqrt(cn));
      std::vector<float> z(d, 0.0f), x(d);
      commvq_key_add_centre(cb, 0, uint16_t(code), 3.0f, z.data());
      commvq_from_pairs(style, d, z.data(), x.data());
      const CommvqEncoded enc = commvq_encode_keys(cb, x.data(), 1);
      EXPECT_EQ(enc.codes[0], code);
      EXPECT_FLOAT_EQ(float_from_f16(enc.norms[0]), 3.0f);
      std::vector<float> back(d);
      commvq_decode_keys(cb, enc, back.data());
      for (int ch = 0; ch < d; ++ch) EXPECT_NEAR(back[ch], x[ch], 1e-5f);
    }
  }
}

TEST(Commvq, RejectsNonFiniteRows) {
  const CommvqKeyCodebook cb = random_key_codebook(8, 1, 2, RopeStyle::RotateHalf, 1);
  std::vector<float> x(8, 1.0f);
  x[3] = std::nanf("");
  EXPECT_THROW(commvq_encode_keys(cb, x.data(), 1), Error);
  x[3] = 1e6f;  // norm overflows fp16
  EXPECT_THROW(commvq_encode_keys(cb, x.data(), 1), Error);
}

TEST(Commvq, BudgetPresetsMatchThePaper) {
  // research/commvq.md §1.4: d = 128, 64 params/pair, R = 11 (1.03 bits) and 21 (1.97 bits).
  const CommvqBudget b1 = commvq_budget(1, 128), b2 = commvq_budget(2, 128);
  EXPECT_EQ(b1.key_stages, 11);
  EXPECT_EQ(b1.key_half_bits, 6);
  EXPECT_EQ(b2.key_stages, 21);
  EXPECT_NEAR(commvq_nominal_bits(b1.key_stages, 2 * b1.key_half_bits, 128), 1.03, 0.005);
  EXPECT_NEAR(commvq_nominal_bits(b2.key_stages, 2 * b2.key_half_bits, 128), 1.97, 0.005);
  EXPECT_DOUBLE_EQ(commvq_effective_bits(11, 12, 128), (132.0 + 16.0) / 128.0);
  EXPECT_EQ(b1.value_stages * b1.value_code_bits, 128);
  EXPECT_EQ(b2.value_stages * b2.value_code_bits, 256);
  const CommvqBudget small = commvq_budget(1, 8);  // stories260k: 8 bits per token
  EXPECT_EQ(small.key_stages * 2 * small.key_half_bits, 8);
  EXPECT_THROW(commvq_budget(3, 128), Error);
}

CommvqTrainOptions small_options(uint64_t seed) {
  CommvqTrainOptions o;
  o.budget.key_stages = 4;
  o.budget.key_half_bits = 3;
  o.budget.value_stages = 3;
  o.budget.value_code_bits = 5;
  o.iterations = 12;
  o.value_iterations = 10;
  o.seed = seed;
  o.threads = 2;
  return o;
}

TEST(CommvqTrain, StagesNeverIncreaseErrorAndEncodingReproducesIt) {
  const int d = 16;
  const size_t n = 3000;
  const auto x = synthetic_rows(n, d, 77);
  for (RopeStyle style : {RopeStyle::RotateHalf, RopeStyle::Interleaved}) {
    std::vector<CommvqStageReport> rep;
    const auto cb = train_commvq_keys(x.data(), n, d, style, small_options(5), &rep);
    ASSERT_EQ(rep.size(), 4u);
    for (size_t r = 0; r < rep.size(); ++r) {
      EXPECT_LE(rep[r].error_after, rep[r].error_before * (1 + 1e-6)) << "stage " << r;
      if (r > 0) {
        EXPECT_NEAR(rep[r].error_before, rep[r - 1].error_after, 1e-9);
      }
      // The kept iterate is the best one seen, and greedy encoding with it gives its error.
      double best = rep[r].error_before;
      for (double e : rep[r].iteration_error) best = std::min(best, e);
      EXPECT_NEAR(rep[r].error_after, best, 1e-4 * rep[r].error_before) << "stage " << r;
    }
    EXPECT_LT(rep.back().error_after, 0.5 * rep.front().error_before);
    // Independent check: encode + decode the rows and measure the normalised error directly.
    const CommvqEncoded enc = commvq_encode_keys(cb, x.data(), n);
    std::vector<float> back(n * d);
    commvq_decode_keys(cb, enc, back.data());
    double err = 0;
    for (size_t i = 0; i < n; ++i) {
      const double nrm = float_from_f16(enc.norms[i]);
      for (int c = 0; c < d; ++c) {
        const double e = (double(x[i * d + c]) - back[i * d + c]) / nrm;
        err += e * e;
      }
    }
    EXPECT_NEAR(err / n, rep.back().error_after, 1e-4 * rep.front().error_before);
  }
}

TEST(CommvqTrain, HardEmIsMonotoneSoTheMStepIsTheConstrainedMinimiser) {
  // At a vanishing temperature EM is k-means under the commutativity constraint: with an exact
  // E-step (nearest centre) and an exact M-step (the weighted least-squares optimum over t) the
  // hard error can never go up. A wrong M-step breaks this quickly.
  const int d = 16;
  const size_t n = 2000;
  const auto x = synthetic_rows(n, d, 8);
  CommvqTrainOptions o = small_options(9);
  o.budget.key_stages = 2;
  o.temp_start = o.temp_end = 1e-7;
  o.iterations = 15;
  o.patience = 100;
  std::vector<CommvqStageReport> rep;
  train_commvq_keys(x.data(), n, d, RopeStyle::RotateHalf, o, &rep);
  for (const auto& s : rep) {
    ASSERT_GE(s.iteration_error.size(), 3u);
    for (size_t i = 1; i < s.iteration_error.size(); ++i)
      EXPECT_LE(s.iteration_error[i], s.iteration_error[i - 1] * (1 + 1e-5)) << "iteration " << i;
    EXPECT_LT(s.iteration_error.back(), s.iteration_error.front());
  }
}

TEST(CommvqTrain, SoftAnnealingBeatsItsInitialisation) {
  const int d = 16;
  const size_t n = 3000;
  const auto x = synthetic_rows(n, d, 10);
  CommvqTrainOptions o = small_options(3);
  o.budget.key_stages = 1;
  o.patience = 100;
  std::vector<CommvqStageReport> rep;
  train_commvq_keys(x.data(), n, d, RopeStyle::RotateHalf, o, &rep);
  EXPECT_LT(rep[0].error_after, 0.9 * rep[0].iteration_error.front());
}

TEST(CommvqTrain, DeterministicForASeedAndThreadCount) {
  const int d = 16;
  const size_t n = 1500;
  const auto x = synthetic_rows(n, d, 12);
  CommvqTrainOptions a = small_options(42), b = small_options(42), c = small_options(43);
  a.threads = 1;
  b.threads = 2;
  const auto ka = train_commvq_keys(x.data(), n, d, RopeStyle::RotateHalf, a);
  const auto kb = train_commvq_keys(x.data(), n, d, RopeStyle::RotateHalf, b);
  const auto kc = train_commvq_keys(x.data(), n, d, RopeStyle::RotateHalf, c);
  EXPECT_EQ(ka.params, kb.params);
  EXPECT_NE(ka.params, kc.params);
  const auto va = train_commvq_values(x.data(), n, d, {}, a);
  const auto vb = train_commvq_values(x.data(), n, d, {}, b);
  EXPECT_EQ(va.codewords, vb.codewords);
}

TEST(CommvqTrain, ValueStagesNeverIncreaseErrorAndRoundTrip) {
  const int d = 16;
  const size_t n = 2500;
  const auto x = synthetic_rows(n, d, 13);
  // A permutation with sign flips is an orthogonal rotation whose effect is easy to reason about.
  std::vector<double> R(size_t(d) * d, 0.0);
  for (int i = 0; i < d; ++i) R[size_t(i) * d + (i * 5 + 3) % d] = (i % 3 == 0) ? -1.0 : 1.0;
  std::vector<CommvqStageReport> rep;
  const auto cb = train_commvq_values(x.data(), n, d, R, small_options(6), &rep);
  for (size_t r = 0; r < rep.size(); ++r) {
    EXPECT_LE(rep[r].error_after, rep[r].error_before * (1 + 1e-6));
    if (r > 0) {
      EXPECT_NEAR(rep[r].error_before, rep[r - 1].error_after, 1e-9);
    }
  }
  EXPECT_LT(rep.back().error_after, 0.5 * rep.front().error_before);
  const CommvqEncoded enc = commvq_encode_values(cb, x.data(), n);
  std::vector<float> back(n * d);
  commvq_decode_values(cb, enc, back.data());
  double err = 0;
  for (size_t i = 0; i < n; ++i) {
    const double nrm = float_from_f16(enc.norms[i]);
    for (int c = 0; c < d; ++c) {
      const double e = (double(x[i * d + c]) - back[i * d + c]) / nrm;
      err += e * e;
    }
  }
  EXPECT_NEAR(err / n, rep.back().error_after, 1e-4 * rep.front().error_before);
}

TEST(CommvqArtifact, StoreLoadAndVerify) {
  const int d = 16;
  Artifact art;
  art.n_layers = 1;
  art.n_kv_heads = 2;
  art.n_heads = 4;
  art.head_dim = d;
  art.rope_style = RopeStyle::Interleaved;
  art.recipe.method = "commvq";
  art.recipe.params = {{"key_stages", "2"}, {"key_code_bits", "6"}, {"value_stages", "3"}, {"value_code_bits", "4"}};
  art.heads.resize(2);
  CommvqCodec codec;
  codec.key = random_key_codebook(d, 2, 3, RopeStyle::Interleaved, 5);
  codec.value.d = d;
  codec.value.stages = 3;
  codec.value.code_bits = 4;
  codec.value.codewords.assign(size_t(3) * 16 * d, 0.25f);
  for (auto& h : art.heads) commvq_store(codec, h.key, h.value);
  EXPECT_TRUE(verify_commvq(art).empty());
  const CommvqCodec back = commvq_load(art, 0, 1);
  EXPECT_EQ(back.key.params, codec.key.params);
  EXPECT_EQ(back.key.half_bits, 3);
  EXPECT_EQ(back.key.rope_style, RopeStyle::Interleaved);
  EXPECT_EQ(back.value.codewords, codec.value.codewords);
  EXPECT_TRUE(back.value.rotation.empty());  // identity is stored, loaded as "no rotation"
  EXPECT_NE(describe_commvq(art).find("2 stages x 6-bit"), std::string::npos);

  art.recipe.params["key_stages"] = "3";
  EXPECT_EQ(verify_commvq(art).size(), 2u);  // both heads disagree with the recipe
  art.recipe.params["key_stages"] = "2";
  art.heads[1].value.extras.clear();
  const auto problems = verify_commvq(art);
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_NE(problems[0].find("layer 0 kv head 1"), std::string::npos);
  EXPECT_THROW(commvq_load(art, 0, 1), Error);
  art.heads[0].key.extras[0].data[7] = std::nan("");
  EXPECT_FALSE(verify_commvq(art).empty());
}

TEST(CommvqArtifact, HdfRoundTripAndVerifyHook) {
  const int d = 16;
  ModelConfig cfg = rope_config(d, RopeStyle::RotateHalf);
  cfg.n_layers = 1;
  cfg.n_heads = 2;
  cfg.n_kv_heads = 1;
  Artifact art;
  art.producer = "kvcc test";
  art.created = "2026-01-01T00:00:00Z";
  art.fingerprint = make_fingerprint(cfg, std::string(64, 'a'));
  art.n_layers = 1;
  art.n_heads = 2;
  art.n_kv_heads = 1;
  art.head_dim = d;
  art.recipe.method = "commvq";
  art.recipe.key_bits = art.recipe.value_bits = 1;
  art.recipe.params = {{"key_stages", "2"}, {"key_code_bits", "6"}, {"value_stages", "3"}, {"value_code_bits", "4"}};
  art.heads.resize(1);
  CommvqCodec codec;
  codec.key = random_key_codebook(d, 2, 3, RopeStyle::RotateHalf, 9);
  codec.value.d = d;
  codec.value.stages = 3;
  codec.value.code_bits = 4;
  codec.value.codewords.resize(size_t(3) * 16 * d);
  for (size_t i = 0; i < codec.value.codewords.size(); ++i) codec.value.codewords[i] = float(std::sin(double(i)));
  commvq_store(codec, art.heads[0].key, art.heads[0].value);
  const std::string path = ::testing::TempDir() + "commvq_roundtrip.kvcc.h5";
  write_artifact(art, path);
  const Artifact back = read_artifact(path);
  EXPECT_TRUE(verify_artifact(back).empty());
  const CommvqCodec loaded = commvq_load(back, 0, 0);
  EXPECT_EQ(loaded.key.params, codec.key.params);
  EXPECT_EQ(loaded.value.codewords, codec.value.codewords);
  // verify_artifact runs the commvq checks: a recipe that disagrees with the codebooks is refused.
  art.recipe.params["value_code_bits"] = "5";
  EXPECT_FALSE(verify_artifact(art).empty());
  EXPECT_THROW(write_artifact(art, path), Error);
  std::remove(path.c_str());
}

}  // namespace
}  // namespace kvcc
