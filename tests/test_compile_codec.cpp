// The per-method KV codec (formats/kv_codec.h) against naive references, Lloyd–Max against the
// published centroids, KVarN's balancing, clip-ratio fitting, and the bit accounting.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "compile/fit.h"
#include "compile/rotation.h"
#include "formats/codec_scalar.h"
#include "formats/error.h"
#include "formats/fp16.h"
#include "formats/kv_codec.h"

using namespace kvcc;

namespace {

std::vector<float> gaussian_rows(int n, int d, uint64_t seed, double outlier = 0.0) {
  GaussianStream g(seed);
  std::vector<float> x(size_t(n) * d);
  for (int t = 0; t < n; ++t)
    for (int i = 0; i < d; ++i)
      x[size_t(t) * d + i] = float(g.next() * (i == 3 ? 1.0 + outlier : 1.0) + (i == 3 ? outlier : 0.0));
  return x;
}

// The DESIGN.md INT-b quantizer written out directly (sort for the threshold, fp16 scale/zero).
void naive_uniform(const float* x, int g, double ratio, int bits, float* out) {
  std::vector<float> a(x, x + g);
  for (float& v : a) v = std::fabs(v);
  std::sort(a.begin(), a.end());
  int k = int(std::floor(ratio * g));
  k = std::clamp(k, 1, g);
  const float thr = a[size_t(k - 1)];
  std::vector<float> c(x, x + g);
  for (float& v : c) v = std::clamp(v, -thr, thr);
  const float lo = *std::min_element(c.begin(), c.end()), hi = *std::max_element(c.begin(), c.end());
  float scale = round_f16((hi - lo) / float((1 << bits) - 1));
  if (!(scale > 0)) scale = 1.0f;
  const float zero = round_f16(-lo / scale);
  for (int i = 0; i < g; ++i) {
    float code = std::floor(c[size_t(i)] / scale + zero + 0.5f);
    code = std::clamp(code, 0.0f, float((1 << bits) - 1));
    out[i] = (code - zero) * scale;
  }
}

Recipe recipe_for(const std::string& method, double bits, int group = 0) {
  Recipe r;
  r.method = method;
  r.key_bits = r.value_bits = bits;
  r.group = group;
  return r;
}

}  // namespace

TEST(KvCodec, UniformGridMatchesNaiveReference) {
  const int d = 64, n = 20;
  const std::vector<float> x = gaussian_rows(n, d, 1, 4.0);
  for (int bits : {2, 3, 4})
    for (int group : {16, 64})
      for (double ratio : {1.0, 0.9}) {
        Recipe r = recipe_for("identity", bits, group);
        SideArtifact side;
        side.rotation = identity_matrix(d);
        side.clip_ratio = ratio;
        std::vector<float> got(x.size()), want(x.size());
        roundtrip_page(r, side, KvSide::Key, d, x.data(), n, got.data());
        for (int t = 0; t < n; ++t)
          for (int g0 = 0; g0 < d; g0 += group) naive_uniform(&x[size_t(t) * d + g0], group, ratio, bits, &want[size_t(t) * d + g0]);
        for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(got[i], want[i]) << bits << " " << group << " " << ratio << " @" << i;
      }
}

TEST(KvCodec, RotationIsAppliedAndUndone) {
  const int d = 32, n = 8;
  const std::vector<float> x = gaussian_rows(n, d, 2, 3.0);
  Recipe r = recipe_for("hadamard", 2);
  SideArtifact side;
  side.rotation = hadamard_matrix(d);
  side.clip_ratio = 0.95;
  std::vector<float> got(x.size());
  roundtrip_page(r, side, KvSide::Value, d, x.data(), n, got.data());
  // Reference: rotate by hand, naive quantise, rotate back.
  for (int t = 0; t < n; ++t) {
    std::vector<float> y(static_cast<size_t>(d)), yq(static_cast<size_t>(d));
    for (int j = 0; j < d; ++j) {
      double s = 0;
      for (int k = 0; k < d; ++k) s += double(x[size_t(t) * d + k]) * side.rotation[size_t(k) * d + j];
      y[size_t(j)] = float(s);
    }
    naive_uniform(y.data(), d, 0.95, 2, yq.data());
    for (int i = 0; i < d; ++i) {
      double s = 0;
      for (int j = 0; j < d; ++j) s += double(yq[size_t(j)]) * side.rotation[size_t(i) * d + j];
      EXPECT_NEAR(got[size_t(t) * d + i], s, 1e-5);
    }
  }
}

TEST(KvCodec, LevelTableUsesNearestLevelTimesRms) {
  const int d = 16, n = 6;
  const std::vector<float> x = gaussian_rows(n, d, 3);
  Recipe r = recipe_for("oscar-lm", 2);
  SideArtifact side;
  side.rotation = identity_matrix(d);
  side.levels = {-1.6, -0.5, 0.4, 1.5};
  std::vector<float> got(x.size());
  roundtrip_page(r, side, KvSide::Key, d, x.data(), n, got.data());
  for (int t = 0; t < n; ++t) {
    double ss = 0;
    for (int i = 0; i < d; ++i) ss += double(x[size_t(t) * d + i]) * x[size_t(t) * d + i];
    const float s = round_f16(float(std::sqrt(ss / d)));
    for (int i = 0; i < d; ++i) {
      const float xn = x[size_t(t) * d + i] / s;
      double best = side.levels[0];
      for (double l : side.levels)
        if (std::fabs(xn - l) < std::fabs(xn - best)) best = l;
      EXPECT_FLOAT_EQ(got[size_t(t) * d + i], float(best) * s);
    }
  }
  side.levels = {0.0, 1.0};  // wrong size for 2 bits
  EXPECT_THROW(roundtrip_page(r, side, KvSide::Key, d, x.data(), n, got.data()), Error);
}

TEST(KvCodec, KiviKeysArePerChannelOverTokenGroups) {
  const int d = 8, n = 40, gt = 16;
  const std::vector<float> x = gaussian_rows(n, d, 4, 5.0);
  Recipe r = recipe_for("kivi", 2, gt);
  SideArtifact side;
  side.rotation = identity_matrix(d);
  std::vector<float> got(x.size());
  roundtrip_page(r, side, KvSide::Key, d, x.data(), n, got.data());
  for (int t0 = 0; t0 < n; t0 += gt) {
    const int len = std::min(gt, n - t0);  // the last group is shorter
    for (int c = 0; c < d; ++c) {
      std::vector<float> col(static_cast<size_t>(len)), want(static_cast<size_t>(len));
      for (int t = 0; t < len; ++t) col[size_t(t)] = x[size_t(t0 + t) * d + c];
      naive_uniform(col.data(), len, 1.0, 2, want.data());
      for (int t = 0; t < len; ++t) EXPECT_EQ(got[size_t(t0 + t) * d + c], want[size_t(t)]);
    }
  }
}

TEST(KvCodec, KvarnBalancingReducesStdImbalance) {
  const int rows = 128, cols = 64;
  GaussianStream g(5);
  std::vector<float> tile(size_t(rows) * cols);
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c)
      tile[size_t(r) * cols + c] = float(g.next() * (1.0 + 20.0 * (c % 9 == 0)) * (0.2 + r % 5));
  const BalanceScales s = kvarn_balance(tile.data(), rows, cols, 8);
  std::vector<float> balanced(tile.size());
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) balanced[size_t(r) * cols + c] = tile[size_t(r) * cols + c] / s.row[size_t(r)] / s.col[size_t(c)];
  const double before = std_imbalance(tile.data(), rows, cols), after = std_imbalance(balanced.data(), rows, cols);
  EXPECT_LT(after, 0.25 * before) << before << " -> " << after;
  for (float v : s.row) EXPECT_GE(v, round_f16(std::exp(-0.3f)) - 1e-3f);  // log-scale floor
  // The codec built on it beats plain per-row RTN of the same tile.
  Recipe r = recipe_for("kvarn", 2);
  r.page_size = rows;
  SideArtifact side;
  side.rotation = identity_matrix(cols);
  std::vector<float> got(tile.size()), plain(tile.size());
  roundtrip_page(r, side, KvSide::Value, cols, tile.data(), rows, got.data());
  for (int t = 0; t < rows; ++t) naive_uniform(&tile[size_t(t) * cols], cols, 1.0, 2, &plain[size_t(t) * cols]);
  double e_kvarn = 0, e_plain = 0;
  for (size_t i = 0; i < tile.size(); ++i) {
    e_kvarn += (got[i] - tile[i]) * (got[i] - tile[i]);
    e_plain += (plain[i] - tile[i]) * (plain[i] - tile[i]);
  }
  EXPECT_LT(e_kvarn, e_plain);
}

TEST(LloydMax, GaussianReproducesPublishedCentroids) {
  // research/baselines.md §1.3 (and TurboQuant's ±0.453, ±1.51; lmdeploy's 3-bit constants).
  const std::vector<double> b1 = lloyd_max_gaussian(1), b2 = lloyd_max_gaussian(2), b3 = lloyd_max_gaussian(3);
  EXPECT_NEAR(b1[1], 0.797885, 2e-5);
  EXPECT_NEAR(b2[2], 0.452780, 2e-5);
  EXPECT_NEAR(b2[3], 1.510418, 2e-5);
  EXPECT_NEAR(b2[0], -1.510418, 2e-5);
  EXPECT_NEAR(b3[4], 0.245094, 2e-5);
  EXPECT_NEAR(b3[5], 0.756005, 2e-5);
  EXPECT_NEAR(b3[6], 1.343909, 2e-5);
  EXPECT_NEAR(b3[7], 2.151946, 2e-5);
  const std::vector<double> b4 = lloyd_max_gaussian(4);
  EXPECT_NEAR(b4[15], 2.732590, 5e-5);
}

TEST(LloydMax, SphereDensityAtD128MatchesTable) {
  // Exact Beta density, d = 128, in RMS units (×√d): 0.452453, 1.505193 (research/baselines.md).
  const std::vector<double> b2 = lloyd_max_sphere(128, 2);
  EXPECT_NEAR(b2[2], 0.452453, 5e-5);
  EXPECT_NEAR(b2[3], 1.505193, 5e-5);
  const std::vector<double> b1 = lloyd_max_sphere(128, 1);
  EXPECT_NEAR(b1[1], 0.799444, 5e-5);
}

TEST(LloydMax, EmpiricalOnGaussianSamplesApproachesContinuous) {
  GaussianStream g(6);
  std::vector<float> s(200000);
  for (float& v : s) v = float(g.next() * 2.0);
  const std::vector<double> levels = lloyd_max_empirical(s, 2);
  EXPECT_NEAR(levels[3], 2.0 * 1.510418, 0.03);
  EXPECT_NEAR(levels[2], 2.0 * 0.452780, 0.02);
  // Its MSE: σ² · 0.117482 (the published Gaussian 2-bit distortion).
  EXPECT_NEAR(level_mse(s, levels), 4.0 * 0.117482, 0.01);
}

TEST(TurboQuant, MseOnUnitVectorsMatchesPaper) {
  // D_mse ≈ 0.116 (2 bits) and ≈ 0.034 (3 bits) for unit vectors, d = 128, exact density table.
  const int d = 128, n = 400;
  std::vector<float> x = gaussian_rows(n, d, 7);
  for (int t = 0; t < n; ++t) {
    double ss = 0;
    for (int i = 0; i < d; ++i) ss += double(x[size_t(t) * d + i]) * x[size_t(t) * d + i];
    for (int i = 0; i < d; ++i) x[size_t(t) * d + i] = float(x[size_t(t) * d + i] / std::sqrt(ss));
  }
  for (auto [bits, expected] : {std::pair{2, 0.116000}, std::pair{3, 0.033966}}) {
    Recipe r = recipe_for("turboquant", bits);
    SideArtifact side;
    side.rotation = random_orthogonal(d, 99);
    side.levels = lloyd_max_sphere(d, bits);
    std::vector<float> got(x.size());
    roundtrip_page(r, side, KvSide::Key, d, x.data(), n, got.data());
    double se = 0;
    for (size_t i = 0; i < x.size(); ++i) se += double(got[i] - x[i]) * (got[i] - x[i]);
    EXPECT_NEAR(se / n, expected, 0.1 * expected) << bits;
  }
}

TEST(TurboQuant, ProdIsUnbiasedForInnerProducts) {
  const int d = 64, n = 3000;
  std::vector<float> x = gaussian_rows(n, d, 8);
  Recipe r = recipe_for("turboquant", 2);
  r.params["variant"] = "prod";
  SideArtifact side;
  side.rotation = random_orthogonal(d, 10);
  side.levels = lloyd_max_sphere(d, 1);
  NamedArray s;
  s.name = "qjl_matrix";
  s.shape = {d, d};
  GaussianStream g(11);
  for (int i = 0; i < d * d; ++i) s.data.push_back(g.next());
  side.extras.push_back(s);
  std::vector<float> got(x.size());
  roundtrip_page(r, side, KvSide::Key, d, x.data(), n, got.data());
  // mse-only reconstruction of the same rows: biased by ≈ 2/π at 1 bit.
  Recipe r_mse = recipe_for("turboquant", 1);
  std::vector<float> mse(x.size());
  roundtrip_page(r_mse, side, KvSide::Key, d, x.data(), n, mse.data());
  // E<x, x̂> = ‖x‖² for prod (unbiased); ≈ 2/π·‖x‖² for 1-bit mse (the bias QJL removes).
  double self = 0, self_prod = 0, self_mse = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    self += double(x[i]) * x[i];
    self_prod += double(got[i]) * x[i];
    self_mse += double(mse[i]) * x[i];
  }
  EXPECT_NEAR(self_prod / self, 1.0, 0.03);
  EXPECT_NEAR(self_mse / self, 2.0 / M_PI, 0.03);
}

TEST(ClipFit, NeverWorseThanNoClippingAndClipsHeavyTails) {
  const int d = 64, n = 200, r = 2;
  FitRows rows;
  rows.d = d;
  rows.n = n;
  rows.nq = n * r;
  GaussianStream g(12);
  for (int t = 0; t < n; ++t)
    for (int i = 0; i < d; ++i) {
      // Student-t-like heavy tails: rare huge coordinates make min-max grids coarse.
      const double u = g.next(), w = std::fabs(g.next()) + 0.05;
      rows.key.push_back(float(u / w));
      rows.value.push_back(float(g.next() / (std::fabs(g.next()) + 0.05)));
    }
  for (int i = 0; i < rows.nq * d; ++i) rows.query.push_back(float(g.next()));
  Recipe rec = recipe_for("identity", 2);
  SideArtifact side;
  side.rotation = identity_matrix(d);
  for (KvSide which : {KvSide::Key, KvSide::Value}) {
    double best = 0, none = 0;
    const double ratio = fit_clip_ratio(rec, side, which, rows, &best, &none);
    EXPECT_LE(best, none);
    EXPECT_LT(ratio, 1.0);  // heavy tails: clipping must pay off
    // Recompute the chosen ratio's error independently.
    SideArtifact chosen = side;
    chosen.clip_ratio = ratio;
    const std::vector<float>& x = which == KvSide::Key ? rows.key : rows.value;
    std::vector<float> xq(x.size()), err(x.size());
    roundtrip_page(rec, chosen, which, d, x.data(), n, xq.data());
    double direct = 0;
    for (size_t i = 0; i < x.size(); ++i) err[i] = x[i] - xq[i];
    if (which == KvSide::Key) {
      for (int q = 0; q < rows.nq; ++q)
        for (int t = 0; t < n; ++t) {
          double s = 0;
          for (int i = 0; i < d; ++i) s += double(rows.query[size_t(q) * d + i]) * err[size_t(t) * d + i];
          direct += s * s;
        }
    } else {
      const std::vector<float> p = attention_probs(rows.query, rows.nq, rows.key, n, d);
      for (int q = 0; q < rows.nq; ++q)
        for (int i = 0; i < d; ++i) {
          double s = 0;
          for (int t = 0; t < n; ++t) s += double(p[size_t(q) * n + t]) * err[size_t(t) * d + i];
          direct += s * s;
        }
    }
    EXPECT_NEAR(best, direct, 1e-3 * direct);
  }
}

TEST(Bits, EffectiveBitsMatchPublishedAccounting) {
  Recipe r = recipe_for("oscar", 2);
  r.sink = 64;
  r.recent = 256;
  EXPECT_DOUBLE_EQ(history_bits(r, KvSide::Key, 128), 2.25);
  // OSCAR: 2.284 at 128K, 2.384 at 32K (research/oscar.md §4).
  EXPECT_NEAR(effective_bits(r, 128, 131072), 2.2836, 1e-4);
  EXPECT_NEAR(effective_bits(r, 128, 32768), 2.3843, 1e-4);
  EXPECT_DOUBLE_EQ(effective_bits(r, 128, 100), 16.0);  // all in the BF16 windows
  EXPECT_DOUBLE_EQ(nominal_bits(r), 2.0);
  Recipe kivi = recipe_for("kivi", 2, 32);
  EXPECT_DOUBLE_EQ(history_bits(kivi, KvSide::Key, 128), 3.0);  // KIVI-2, G = 32
  Recipe kvarn = recipe_for("kvarn", 2);
  kvarn.page_size = 128;
  EXPECT_DOUBLE_EQ(history_bits(kvarn, KvSide::Key, 128), 2.375);  // the fork's fp16 scales
  EXPECT_DOUBLE_EQ(history_bits(kvarn, KvSide::Value, 128), 2.375);
  Recipe tq = recipe_for("turboquant", 2.5);
  EXPECT_DOUBLE_EQ(history_bits(tq, KvSide::Key, 128), 2.75);  // two fp16 norms
  Recipe lm = recipe_for("oscar-lm", 2);
  EXPECT_DOUBLE_EQ(history_bits(lm, KvSide::Key, 128), 2.125);
}
