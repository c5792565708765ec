// Token eviction (eval/eviction.h): the kept sets, the scores against their definitions computed
// another way, the attention over a kept subset against a direct double-precision softmax, merging
// against exact cases (copies of kept keys, a hand-built pair), and the experiment's identities
// (keeping everything loses nothing, merging nothing is dropping).
#include "eval/eviction.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <numeric>
#include <random>

#include <unistd.h>

#include "calibrate/synthetic_model.h"
#include "formats/error.h"
#include "model/forward.h"
#include "forward_test_util.h"

namespace kvcc {
namespace {

std::vector<float> random_rows(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 g(seed);
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = nd(g);
  return v;
}

TEST(Eviction, SelectKeptKeepsSinkRecentAndTheBestScores) {
  // 10 tokens, sink 2, recent 2, budget 6: 0 1 | best two of 2..7 | 8 9.
  const std::vector<double> s = {9, 9, 0.5, 3, 0.1, 3, 7, 0.2, 0, 0};
  EXPECT_EQ(select_kept(s, 10, 6, 2, 2), (std::vector<int32_t>{0, 1, 5, 6, 8, 9}));  // tie 3 vs 3: the later (5)
  EXPECT_EQ(select_kept(s, 10, 10, 2, 2).size(), 10u);
  EXPECT_EQ(select_kept(s, 10, 20, 2, 2).size(), 10u);
  // Below sink + recent: the sink and the newest.
  EXPECT_EQ(select_kept(s, 10, 3, 2, 2), (std::vector<int32_t>{0, 1, 9}));
  // Without scores (window): sink + the newest budget - sink.
  EXPECT_EQ(select_kept({}, 10, 5, 2, 2), (std::vector<int32_t>{0, 1, 7, 8, 9}));
  EXPECT_THROW(select_kept({1, 2}, 3, 2, 0, 0), Error);
}

TEST(Eviction, MaxPoolIsTheWindowMaximum) {
  const std::vector<double> x = {1, 5, 2, 0, 0, 3, 0};
  EXPECT_EQ(max_pool(x, 1), x);
  EXPECT_EQ(max_pool(x, 3), (std::vector<double>{5, 5, 5, 2, 3, 3, 3}));
  EXPECT_THROW(max_pool(x, 2), Error);
}

// kᵀ E[q qᵀ] k is the mean squared logit (q·k)² over the queries the moment was built from.
TEST(Eviction, QueryMomentScoreIsTheMeanSquaredLogit) {
  const int d = 8, nq = 50, nk = 6;
  const std::vector<float> q = random_rows(size_t(nq) * d, 1), k = random_rows(size_t(nk) * d, 2);
  std::vector<double> m(size_t(d) * d, 0.0);
  for (int i = 0; i < nq; ++i)
    for (int a = 0; a < d; ++a)
      for (int b = 0; b < d; ++b) m[size_t(a) * d + b] += double(q[size_t(i) * d + a]) * q[size_t(i) * d + b] / nq;
  const std::vector<double> s = query_moment_scores(m, k.data(), nk, size_t(d), d);
  for (int j = 0; j < nk; ++j) {
    double expect = 0;
    for (int i = 0; i < nq; ++i) {
      double dot = 0;
      for (int a = 0; a < d; ++a) dot += double(q[size_t(i) * d + a]) * k[size_t(j) * d + a];
      expect += dot * dot / nq;
    }
    // Both sums in double of the same float inputs: they differ by double rounding only.
    EXPECT_NEAR(s[size_t(j)], expect, 1e-12 * (1 + expect));
  }
}

// qgauss is log E[exp(q·k/√d)] for q ~ N(μ, Σ): checked against a Monte Carlo mean over draws of
// q (diagonal Σ). For X = q·k/√d ~ N(m, v), exp(X) has relative s.d. √(e^v − 1), so the mean of N
// draws is within 5·√((e^v − 1)/N) of its expectation (relative) but for odds of ~1e-6.
TEST(Eviction, QueryGaussianScoreIsTheLogExpectedAttentionWeight) {
  const int d = 4, N = 200000;
  const std::vector<double> mu = {0.5, -1.0, 0.25, 2.0}, sd = {0.3, 0.6, 0.2, 0.4};
  std::vector<double> cov(size_t(d) * d, 0.0);
  for (int a = 0; a < d; ++a) cov[size_t(a) * d + a] = sd[size_t(a)] * sd[size_t(a)];
  const std::vector<float> k = {1.0f, 0.5f, -2.0f, 0.75f};
  const double score = query_gaussian_scores(mu, cov, k.data(), 1, size_t(d), d)[0];
  std::mt19937_64 g(11);
  std::normal_distribution<double> nd(0.0, 1.0);
  double sum = 0, v = 0;
  for (int a = 0; a < d; ++a) v += sd[size_t(a)] * sd[size_t(a)] * k[size_t(a)] * k[size_t(a)] / d;
  for (int i = 0; i < N; ++i) {
    double x = 0;
    for (int a = 0; a < d; ++a) x += (mu[size_t(a)] + sd[size_t(a)] * nd(g)) * k[size_t(a)];
    sum += std::exp(x / std::sqrt(double(d)));
  }
  const double tol = 5 * std::sqrt((std::exp(v) - 1) / N);
  EXPECT_NEAR(std::exp(score - std::log(sum / N)), 1.0, tol);
  // Without spread it is the mean logit; without a mean, half the squared-logit score over d.
  const std::vector<double> zero(size_t(d) * d, 0.0), zmu(size_t(d), 0.0);
  double mk = 0;
  for (int a = 0; a < d; ++a) mk += mu[size_t(a)] * k[size_t(a)];
  EXPECT_NEAR(query_gaussian_scores(mu, zero, k.data(), 1, size_t(d), d)[0], mk / 2.0, 1e-12);
  EXPECT_NEAR(query_gaussian_scores(zmu, cov, k.data(), 1, size_t(d), d)[0],
              query_moment_scores(cov, k.data(), 1, size_t(d), d)[0] / (2.0 * d), 1e-12);
}

// Three directions with noise: cosine k-means finds them whatever the rows' lengths, and
// again with the rows shuffled (up to the clusters' labels).
// VATP's score: a token's attention times its value's L1 norm, read from the head's channels of
// rows wider than the head (the other heads' channels must not count).
TEST(Eviction, ValueAwareScoreWeighsAttentionByTheValueNorm) {
  const int d = 3;
  const size_t stride = 5;                                     // this head's 3 channels, then 2 of another head's
  const std::vector<float> values = {1,  -2, 0.5f, 100,  100,  //
                                     0,  0,  0,    100,  100,  //
                                     -4, 1,  1,    -100, 100};
  const std::vector<double> attention = {0.5, 0.9, 0.25};
  const std::vector<double> s = value_aware_scores(attention, values.data(), 3, stride, d);
  ASSERT_EQ(s.size(), 3u);
  EXPECT_DOUBLE_EQ(s[0], 0.5 * 3.5);
  EXPECT_DOUBLE_EQ(s[1], 0.0);  // attended to most, but moves the output by nothing
  EXPECT_DOUBLE_EQ(s[2], 0.25 * 6.0);
  EXPECT_THROW(value_aware_scores({0.5}, values.data(), 3, stride, d), Error);
}

TEST(Eviction, CosineKmeansSeparatesDirections) {
  const int dim = 5, per = 7, k = 3;
  std::mt19937 g(5);
  std::normal_distribution<double> nd(0.0, 0.05);
  std::uniform_real_distribution<double> len(0.5, 20.0);
  std::vector<double> rows;
  std::vector<int> truth;
  for (int i = 0; i < per * k; ++i) {
    const int c = i % k;
    const double l = len(g);
    for (int a = 0; a < dim; ++a) rows.push_back(l * ((a == c ? 1.0 : 0.0) + nd(g)));
    truth.push_back(c);
  }
  const Clusters cl = cosine_kmeans(rows, per * k, dim, k);
  ASSERT_EQ(cl.k, k);
  for (int i = 0; i < per * k; ++i)
    for (int j = 0; j < per * k; ++j)
      EXPECT_EQ(cl.assignment[size_t(i)] == cl.assignment[size_t(j)], truth[size_t(i)] == truth[size_t(j)]);
  for (int c = 0; c < k; ++c) {
    double n = 0;
    for (int a = 0; a < dim; ++a) n += cl.centroids[size_t(c) * dim + a] * cl.centroids[size_t(c) * dim + a];
    EXPECT_NEAR(n, 1.0, 1e-12);
  }
  EXPECT_EQ(cosine_kmeans(rows, per * k, dim, 50).k, per * k);  // k capped at n
}

ModelConfig small_config() {
  ModelConfig c;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.head_dim = 16;
  c.hidden = 64;
  return c;
}

// The softmax attention of one query head in double over explicit rows (key, value, logit term).
std::vector<double> direct_attention(const float* qh, int d, const std::vector<const float*>& ks,
                                     const std::vector<const float*>& vs, const std::vector<double>& bias) {
  std::vector<double> w(ks.size()), o(size_t(d), 0.0);
  double mx = -1e300, sum = 0;
  for (size_t j = 0; j < ks.size(); ++j) {
    double dot = 0;
    for (int a = 0; a < d; ++a) dot += double(qh[a]) * ks[j][a];
    w[j] = dot / std::sqrt(double(d)) + bias[j];
    mx = std::max(mx, w[j]);
  }
  for (double& x : w) sum += (x = std::exp(x - mx));
  for (size_t j = 0; j < ks.size(); ++j)
    for (int a = 0; a < d; ++a) o[size_t(a)] += w[j] / sum * vs[j][a];
  return o;
}

// A subset kept per KV head: the attention equals a softmax in double over exactly those rows
// plus the continuation's causal prefix. Float inputs, float GEMMs over ≤ 40 terms of O(1)
// products: the outputs (convex combinations of O(1) values) agree to ~1e-6; 1e-5 is the bound.
TEST(Eviction, AttentionOverKeptMatchesADirectSoftmax) {
  const ModelConfig c = small_config();
  const int d = c.head_dim, n0 = 24, T = 5, qdim = c.n_heads * d, kvdim = c.n_kv_heads * d;
  const auto q = random_rows(size_t(T) * qdim, 3), hk = random_rows(size_t(n0) * kvdim, 4),
             hv = random_rows(size_t(n0) * kvdim, 5), ck = random_rows(size_t(T) * kvdim, 6),
             cv = random_rows(size_t(T) * kvdim, 7);
  const std::vector<std::vector<int32_t>> kept = {{0, 3, 4, 10, 23}, {1, 2, 22}};
  std::vector<float> out(size_t(T) * qdim, NAN);
  attention_over_kept(c, n0, T, q.data(), hk.data(), hv.data(), kept, ck.data(), cv.data(), out.data());
  for (int h = 0; h < c.n_heads; ++h) {
    const int g = h / c.group();
    for (int t = 0; t < T; ++t) {
      std::vector<const float*> ks, vs;
      for (int32_t j : kept[size_t(g)]) {
        ks.push_back(hk.data() + size_t(j) * kvdim + size_t(g) * d);
        vs.push_back(hv.data() + size_t(j) * kvdim + size_t(g) * d);
      }
      for (int j = 0; j <= t; ++j) {
        ks.push_back(ck.data() + size_t(j) * kvdim + size_t(g) * d);
        vs.push_back(cv.data() + size_t(j) * kvdim + size_t(g) * d);
      }
      const auto o =
          direct_attention(q.data() + size_t(t) * qdim + size_t(h) * d, d, ks, vs, std::vector<double>(ks.size(), 0.0));
      for (int a = 0; a < d; ++a)
        EXPECT_NEAR(out[size_t(t) * qdim + size_t(h) * d + a], o[size_t(a)], 1e-5) << "head " << h << " t " << t;
    }
  }
}

// Everything kept: the model's own prefix attention over [history; continuation].
TEST(Eviction, AttentionOverEverythingIsThePrefixAttention) {
  const ModelConfig c = small_config();
  const int d = c.head_dim, n0 = 30, T = 7, qdim = c.n_heads * d, kvdim = c.n_kv_heads * d;
  const auto q = random_rows(size_t(T) * qdim, 8), k = random_rows(size_t(n0 + T) * kvdim, 9),
             v = random_rows(size_t(n0 + T) * kvdim, 10);
  std::vector<std::vector<int32_t>> all(2, std::vector<int32_t>(n0));
  for (auto& a : all)
    for (int j = 0; j < n0; ++j) a[size_t(j)] = j;
  std::vector<float> out(size_t(T) * qdim), ref(size_t(T) * qdim);
  attention_over_kept(c, n0, T, q.data(), k.data(), v.data(), all, k.data() + size_t(n0) * kvdim,
                      v.data() + size_t(n0) * kvdim, out.data());
  prefix_causal_attention(c, n0, T, q.data(), k.data(), v.data(), ref.data());
  for (size_t i = 0; i < out.size(); ++i) EXPECT_NEAR(out[i], ref[i], 1e-5) << i;
}

// A log mass on kept rows: the attention equals a double softmax whose logits carry that term.
// The extra channel (q scaled by √((d+1)/d), the bias by √(d+1)) adds float rounding of relative
// ~1e-7 to logits of O(5): the outputs, convex combinations of O(1) values, agree to ~1e-6.
TEST(Eviction, AttentionOverKeptAddsTheLogMassToTheLogits) {
  const ModelConfig c = small_config();
  const int d = c.head_dim, n0 = 24, T = 5, qdim = c.n_heads * d, kvdim = c.n_kv_heads * d;
  const auto q = random_rows(size_t(T) * qdim, 13), hk = random_rows(size_t(n0) * kvdim, 14),
             hv = random_rows(size_t(n0) * kvdim, 15), ck = random_rows(size_t(T) * kvdim, 16),
             cv = random_rows(size_t(T) * kvdim, 17);
  const std::vector<std::vector<int32_t>> kept = {{0, 3, 4, 10, 23}, {1, 2, 22}};
  const std::vector<std::vector<float>> log_mass = {{0.0f, 1.5f, 0.0f, 2.25f, 0.5f}, {0.0f, 0.0f, 0.0f}};
  std::vector<float> out(size_t(T) * qdim, NAN);
  attention_over_kept(c, n0, T, q.data(), hk.data(), hv.data(), kept, ck.data(), cv.data(), out.data(), &log_mass);
  for (int h = 0; h < c.n_heads; ++h) {
    const int g = h / c.group();
    for (int t = 0; t < T; ++t) {
      std::vector<const float*> ks, vs;
      std::vector<double> bias;
      for (size_t i = 0; i < kept[size_t(g)].size(); ++i) {
        ks.push_back(hk.data() + size_t(kept[size_t(g)][i]) * kvdim + size_t(g) * d);
        vs.push_back(hv.data() + size_t(kept[size_t(g)][i]) * kvdim + size_t(g) * d);
        bias.push_back(log_mass[size_t(g)][i]);
      }
      for (int j = 0; j <= t; ++j) {
        ks.push_back(ck.data() + size_t(j) * kvdim + size_t(g) * d);
        vs.push_back(cv.data() + size_t(j) * kvdim + size_t(g) * d);
        bias.push_back(0);
      }
      const auto o = direct_attention(q.data() + size_t(t) * qdim + size_t(h) * d, d, ks, vs, bias);
      for (int a = 0; a < d; ++a)
        EXPECT_NEAR(out[size_t(t) * qdim + size_t(h) * d + a], o[size_t(a)], 1e-5) << "head " << h << " t " << t;
    }
  }
}

// A history whose evicted tokens repeat kept keys exactly (with values of their own): for every
// query, e^{q·k_i} = e^{q·k_j}, so the merged entry (keys kept, values averaged by mass, logit
// raised by ln(M_j / a_j)) reproduces the attention over the full history; with masses that
// weigh copies alike (as attention does: equal keys get equal mass). kv merging averages equal
// keys into the same key, so it too is exact. Float rounding only: 1e-5 as above.
TEST(Eviction, MergingCopiesOfKeptKeysReproducesTheFullAttention) {
  const ModelConfig c = small_config();
  const int d = c.head_dim, n0 = 24, T = 5, qdim = c.n_heads * d, kvdim = c.n_kv_heads * d;
  const auto q = random_rows(size_t(T) * qdim, 23), ck = random_rows(size_t(T) * kvdim, 26),
             cv = random_rows(size_t(T) * kvdim, 27), hv = random_rows(size_t(n0) * kvdim, 25);
  std::vector<float> hk = random_rows(size_t(n0) * kvdim, 24);
  const std::vector<std::vector<int32_t>> kept = {{0, 3, 4, 10, 23}, {1, 2, 22}};
  // Every evicted token of head g copies the key of a kept token of head g (chosen by position).
  std::mt19937 rng(5);
  std::vector<std::vector<double>> mass(2, std::vector<double>(size_t(n0)));
  std::uniform_real_distribution<double> u(0.1, 2.0);
  for (int g = 0; g < 2; ++g) {
    const auto& kg = kept[size_t(g)];
    for (int32_t j : kg) mass[size_t(g)][size_t(j)] = u(rng);
    for (int i = 0; i < n0; ++i) {
      if (std::find(kg.begin(), kg.end(), i) != kg.end()) continue;
      const int32_t j = kg[size_t(rng() % kg.size())];
      std::copy_n(hk.data() + size_t(j) * kvdim + size_t(g) * d, d, hk.data() + size_t(i) * kvdim + size_t(g) * d);
      mass[size_t(g)][size_t(i)] = mass[size_t(g)][size_t(j)];
    }
  }
  std::vector<float> full(size_t(T) * qdim);
  {
    std::vector<float> all_k(hk), all_v(hv);
    all_k.insert(all_k.end(), ck.begin(), ck.end());
    all_v.insert(all_v.end(), cv.begin(), cv.end());
    prefix_causal_attention(c, n0, T, q.data(), all_k.data(), all_v.data(), full.data());
  }
  for (const EvictionMerge m : {EvictionMerge::Value, EvictionMerge::KeyValue}) {
    std::vector<float> mk(hk), mv(hv);
    std::vector<std::vector<float>> log_mass;
    int64_t merged = 0;
    for (int g = 0; g < 2; ++g) {
      int64_t n = 0;
      log_mass.push_back(merge_evicted(m, 0.99, mk.data() + size_t(g) * d, mv.data() + size_t(g) * d, n0, size_t(kvdim),
                                       d, kept[size_t(g)], mass[size_t(g)], &n));
      merged += n;
    }
    EXPECT_EQ(merged, 2 * n0 - 8) << eviction_merge_name(m);  // every evicted token of both heads
    std::vector<float> out(size_t(T) * qdim, NAN);
    attention_over_kept(c, n0, T, q.data(), mk.data(), mv.data(), kept, ck.data(), cv.data(), out.data(), &log_mass);
    for (size_t i = 0; i < out.size(); ++i) EXPECT_NEAR(out[i], full[i], 1e-5) << eviction_merge_name(m) << " " << i;
  }
  // Without the log mass (D2O's averaging) the merged entry weighs as one token: not the full attention.
  std::vector<float> mk(hk), mv(hv), out(size_t(T) * qdim);
  std::vector<std::vector<float>> zero;
  for (int g = 0; g < 2; ++g) {
    zero.push_back(merge_evicted(EvictionMerge::Average, 0.99, mk.data() + size_t(g) * d, mv.data() + size_t(g) * d, n0,
                                 size_t(kvdim), d, kept[size_t(g)], mass[size_t(g)]));
    for (float b : zero.back()) EXPECT_EQ(b, 0.0f);
  }
  attention_over_kept(c, n0, T, q.data(), mk.data(), mv.data(), kept, ck.data(), cv.data(), out.data(), &zero);
  double gap = 0;
  for (size_t i = 0; i < out.size(); ++i) gap = std::max(gap, double(std::abs(out[i] - full[i])));
  EXPECT_GT(gap, 1e-2);
}

// A hand-built case: one kept key k = (1, 0), one evicted (cos 0.8 with it), masses 1 and 3.
// value: v ← (1·v_k + 3·v_e) / 4, log mass ln 4; kv: the key averaged too; a zero mass on the
// evicted token, or a threshold above its cosine, leaves the kept row as it was (= dropping).
TEST(Eviction, MergeEvictedWeighsByMassAboveTheThreshold) {
  const int d = 2;
  // Rows: 0 kept (1, 0), 1 evicted (0.8, 0.6) [cos 0.8], 2 evicted (0, 1) [cos 0], 3 kept (0, -1).
  const std::vector<float> keys = {1, 0, 0.8f, 0.6f, 0, 1, 0, -1}, values = {2, 4, 6, 8, 100, 100, 1, 1};
  const std::vector<int32_t> kept = {0, 3};
  const std::vector<double> mass = {1, 3, 5, 2};
  {
    std::vector<float> k(keys), v(values);
    int64_t merged = -1;
    const auto lm = merge_evicted(EvictionMerge::Value, 0.5, k.data(), v.data(), 4, d, d, kept, mass, &merged);
    EXPECT_EQ(merged, 1);  // row 2's best cosine is 0 (with row 0; -1 with row 3): below 0.5
    EXPECT_FLOAT_EQ(lm[0], float(std::log(4.0)));
    EXPECT_EQ(lm[1], 0.0f);
    EXPECT_FLOAT_EQ(v[0], (1 * 2 + 3 * 6) / 4.0f);
    EXPECT_FLOAT_EQ(v[1], (1 * 4 + 3 * 8) / 4.0f);
    EXPECT_EQ(k[0], 1.0f);
    EXPECT_EQ(k[1], 0.0f);
    for (int i = 2; i < 8; ++i) EXPECT_EQ(v[size_t(i)], values[size_t(i)]);
  }
  {
    std::vector<float> k(keys), v(values);
    const auto lm = merge_evicted(EvictionMerge::KeyValue, 0.5, k.data(), v.data(), 4, d, d, kept, mass);
    EXPECT_FLOAT_EQ(lm[0], float(std::log(4.0)));
    EXPECT_FLOAT_EQ(k[0], (1 * 1 + 3 * 0.8f) / 4.0f);
    EXPECT_FLOAT_EQ(k[1], (3 * 0.6f) / 4.0f);
    EXPECT_FLOAT_EQ(v[0], 5.0f);
  }
  {  // threshold -1: row 2 merges too, into row 0 (cosines 0 and -1)
    std::vector<float> k(keys), v(values);
    int64_t merged = 0;
    const auto lm = merge_evicted(EvictionMerge::Value, -1, k.data(), v.data(), 4, d, d, kept, mass, &merged);
    EXPECT_EQ(merged, 2);
    EXPECT_FLOAT_EQ(lm[0], float(std::log(9.0)));
    EXPECT_FLOAT_EQ(v[0], (1 * 2 + 3 * 6 + 5 * 100) / 9.0f);
  }
  for (const EvictionMerge m : all_eviction_merges())
    for (const bool zero_mass : {false, true}) {
      std::vector<float> k(keys), v(values);
      std::vector<double> w = mass;
      if (zero_mass) w[1] = w[2] = 0;
      // none, a threshold above every cosine, or zero masses: the kept rows unchanged, no log mass.
      if (m != EvictionMerge::None && !zero_mass) continue;
      const auto lm = merge_evicted(m, zero_mass ? -1.0 : 0.5, k.data(), v.data(), 4, d, d, kept, w);
      EXPECT_EQ(k, keys) << eviction_merge_name(m);
      EXPECT_EQ(v, values) << eviction_merge_name(m);
      EXPECT_EQ(lm, (std::vector<float>{0, 0})) << eviction_merge_name(m);
    }
  {
    std::vector<float> k(keys), v(values);
    EXPECT_EQ(merge_evicted(EvictionMerge::KeyValue, 1.5, k.data(), v.data(), 4, d, d, kept, mass),
              (std::vector<float>{0, 0}));
    EXPECT_EQ(k, keys);
    EXPECT_EQ(v, values);
  }
  std::vector<float> k(keys), v(values);
  std::vector<double> bad = mass;
  bad[0] = 0;  // a kept token without mass
  EXPECT_THROW(merge_evicted(EvictionMerge::Value, 0.5, k.data(), v.data(), 4, d, d, kept, bad), Error);
  EXPECT_THROW(merge_evicted(EvictionMerge::Value, 0.5, k.data(), v.data(), 4, d, d, {3, 0}, mass), Error);
}

TEST(Eviction, ConversationsJoinPassagesOfDistantDocumentsThenContinueTheFirst) {
  std::vector<std::vector<int32_t>> docs;
  for (int i = 0; i < 6; ++i) {
    std::vector<int32_t> doc = {0};
    for (int t = 1; t < 40; ++t) doc.push_back(100 * i + t);
    docs.push_back(doc);
  }
  EvictionOptions o;
  o.history = 12;
  o.passages = 3;
  o.continuation = 5;
  o.conversations = 10;
  const auto conv = build_conversations(docs, o, 0);
  ASSERT_EQ(conv.size(), 2u);  // D/m = 2 groups
  // Passages from documents 0, 2, 4 (4 tokens each, later ones without BOS), then document 0's
  // tokens 4..9 (5 inputs + the last target).
  EXPECT_EQ(conv[0], (std::vector<int32_t>{0, 1, 2, 3, 201, 202, 203, 204, 401, 402, 403, 404, 4, 5, 6, 7, 8, 9}));
  o.history = 200;
  EXPECT_THROW(build_conversations(docs, o, 0), Error);
}

// Layer budgets: proportional to the weights where no bound binds, clamped where one does,
// summing to the total, rounded by largest remainder; bad input refused.
TEST(Eviction, LayerBudgetsShareTheTotalInProportionWithinBounds) {
  EXPECT_EQ(allocate_layer_budgets({1, 2, 3, 2}, 800, 0, 1000), (std::vector<int64_t>{100, 200, 300, 200}));
  EXPECT_EQ(allocate_layer_budgets({1, 1, 1, 1}, 512, 36, 1024), (std::vector<int64_t>(4, 128)));
  // The heavy layer is capped at hi; the light one gets the rest (λ = 50: 1·50 and min(10·50, 150)).
  EXPECT_EQ(allocate_layer_budgets({1, 10}, 200, 36, 150), (std::vector<int64_t>{50, 150}));
  // The light layer is raised to lo; the others share the rest in proportion 1 : 3.
  EXPECT_EQ(allocate_layer_budgets({0.01, 1, 3}, 436, 36, 1000), (std::vector<int64_t>{36, 100, 300}));
  // 10 / 3 each: the remaining token goes to the lowest layer among equal fractions.
  EXPECT_EQ(allocate_layer_budgets({1, 1, 1}, 10, 0, 10), (std::vector<int64_t>{4, 3, 3}));
  // Totals outside [L·lo, L·hi] are clamped to them.
  EXPECT_EQ(allocate_layer_budgets({1, 5}, 1000, 10, 20), (std::vector<int64_t>{20, 20}));
  EXPECT_EQ(allocate_layer_budgets({1, 5}, 3, 10, 20), (std::vector<int64_t>{10, 10}));
  std::mt19937 g(7);
  std::uniform_real_distribution<double> u(0.05, 4.0);
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<double> w(8);
    for (double& x : w) x = u(g);
    const int64_t total = 8 * (40 + trial * 9);
    const std::vector<int64_t> b = allocate_layer_budgets(w, total, 36, 600);
    int64_t sum = 0;
    for (size_t l = 0; l < b.size(); ++l) {
      sum += b[l];
      EXPECT_GE(b[l], 36);
      EXPECT_LE(b[l], 600);
    }
    EXPECT_EQ(sum, total);
    // Between two layers off the bounds the counts follow the weights to within the rounding.
    for (size_t i = 0; i < b.size(); ++i)
      for (size_t j = 0; j < b.size(); ++j)
        if (b[i] > 36 && b[i] < 600 && b[j] > 36 && b[j] < 600) {
          EXPECT_NEAR(double(b[i]) / w[i], double(b[j]) / w[j], 1.0 / w[i] + 1.0 / w[j]);
        }
  }
  EXPECT_THROW(allocate_layer_budgets({}, 10, 0, 10), Error);
  EXPECT_THROW(allocate_layer_budgets({1, 0}, 10, 0, 10), Error);
  EXPECT_THROW(allocate_layer_budgets({1, std::nan("")}, 10, 0, 10), Error);
  EXPECT_THROW(allocate_layer_budgets({1, 1}, 10, 5, 4), Error);
}

class EvictionRun : public ::testing::Test {
 protected:
  void SetUp() override {
    dir = (std::filesystem::temp_directory_path() / ("kvcc_eviction_" + std::to_string(::getpid()))).string();
    spec.vocab = 64;
    spec.hidden = 32;
    spec.n_layers = 2;
    spec.n_heads = 2;
    spec.n_kv_heads = 1;
    spec.head_dim = 16;
    spec.intermediate = 64;
    spec.max_position = 256;
    write_synthetic_model(dir, spec);
  }
  void TearDown() override { std::filesystem::remove_all(dir); }
  // The protocol at test size: 2 conversations of 2 passages, history 48, continuation 16;
  // epicache's blocks of 8 routed by 4 tokens (its options are checked even when it does not run).
  static EvictionOptions small_options() {
    EvictionOptions o;
    o.history = 48;
    o.continuation = 16;
    o.passages = 2;
    o.conversations = 2;
    o.block = 8;
    o.route = 4;
    return o;
  }
  // An "INT2 codec" that stores the rows unchanged (sink 4, ring 8, pages of 8): the int2 rows
  // equal the plain ones wherever the codec is all that differs.
  CacheScheme identity_codec() const {
    CacheScheme s;
    s.sink = 4;
    s.recent = 8;
    s.page_size = 8;
    const size_t d = size_t(spec.head_dim) * size_t(spec.n_kv_heads);
    s.path = CodecPath{[d](int, KvSide, const float* rows, int n, int64_t, float* out) {
      std::copy(rows, rows + size_t(n) * d, out);
    }};
    return s;
  }
  std::string dir;
  SyntheticModelSpec spec;
};

// Ratio 1 keeps every token: every score's row is the reference exactly (KL and ΔNLL 0, top-1 1);
// an identity "codec" makes the int2 rows the same; real eviction loses something.
TEST_F(EvictionRun, KeepingEverythingLosesNothing) {
  const ModelFile model = ModelFile::open(dir);
  EvictionOptions o = small_options();
  o.ratios = {1, 4};
  o.scores = {EvictionScore::Window,  EvictionScore::H2O,      EvictionScore::SnapKV,
              EvictionScore::KeyNorm, EvictionScore::EpiCache, EvictionScore::ValueAware};
  o.episodes = 2;
  const auto conv = build_conversations(synthetic_documents(spec, 4, 80, 3), o, 0);
  const CacheScheme identity = identity_codec();
  const EvictionResult r = run_eviction(model, conv, nullptr, &identity, o);
  ASSERT_EQ(r.rows.size(), 1u + 2 * 6 * 2);  // int2 "full" + (no int2, int2) × scores × ratios
  double lost = 0;
  for (const EvictionRow& row : r.rows) {
    if (row.ratio == 1) {
      EXPECT_EQ(row.kl, 0.0) << row.score;
      EXPECT_EQ(row.delta_nll, 0.0) << row.score;
      EXPECT_EQ(row.top1, 1.0) << row.score;
    } else {
      EXPECT_GE(row.kl, 0.0) << row.score;
      lost += row.kl;
    }
  }
  EXPECT_GT(lost, 0.0);
  EXPECT_GT(r.reference_nll, 0.0);
}

// The emitted score (the runtime's attention_scores over the cache as stored) without INT2 reads
// the history the model attended to, so it keeps what SnapKV keeps: the same rows. Through an
// identity codec too. Its softmax is recomputed from the stored queries and keys (float64) rather
// than taken from the model's probabilities, so this checks the observation window's queries,
// positions and causality.
TEST_F(EvictionRun, EmittedScoresOverAFullPrecisionCacheAreSnapKVs) {
  const ModelFile model = ModelFile::open(dir);
  EvictionOptions o = small_options();
  o.ratios = {2, 4};
  o.sink = 2;  // budgets of 24 and 12 tokens leave room for the scores to choose
  o.recent = 4;
  o.observation = 8;
  o.pool = 3;
  o.scores = {EvictionScore::SnapKV, EvictionScore::Emitted, EvictionScore::KeyNorm};
  const auto conv = build_conversations(synthetic_documents(spec, 4, 80, 3), o, 0);
  const CacheScheme identity = identity_codec();
  const EvictionResult r = run_eviction(model, conv, nullptr, &identity, o);
  auto row = [&](const std::string& score, double ratio, bool int2) {
    for (const EvictionRow& x : r.rows)
      if (x.score == score && x.ratio == ratio && x.int2 == int2) return x;
    ADD_FAILURE() << "no row " << score;
    return EvictionRow{};
  };
  for (const bool int2 : {false, true})
    for (const double ratio : o.ratios) {
      const EvictionRow snap = row("snapkv", ratio, int2), emitted = row("emitted", ratio, int2);
      EXPECT_GT(snap.kl, 0.0);
      EXPECT_EQ(emitted.kl, snap.kl) << ratio << (int2 ? " int2" : "");
      EXPECT_EQ(emitted.delta_nll, snap.delta_nll);
      // Another score keeps other tokens (the comparison above can tell rows apart).
      EXPECT_NE(row("keynorm", ratio, int2).kl, snap.kl);
    }
}

// Equal layer budgets are the uniform split (the same kept sets, so the same rows bit for bit);
// unequal ones move tokens between the layers and change what the continuation sees.
TEST_F(EvictionRun, EqualLayerBudgetsAreTheUniformSplit) {
  const ModelFile model = ModelFile::open(dir);
  EvictionOptions o = small_options();
  o.ratios = {4};  // 12 tokens per layer; layers at least sink + recent = 6
  o.sink = 2;
  o.recent = 4;
  o.scores = {EvictionScore::H2O, EvictionScore::SnapKV};
  const auto conv = build_conversations(synthetic_documents(spec, 4, 80, 3), o, 0);
  const EvictionResult uniform = run_eviction(model, conv, nullptr, nullptr, o);
  o.layer_budgets = {2.5, 2.5};
  const EvictionResult equal = run_eviction(model, conv, nullptr, nullptr, o);
  o.layer_budgets = {1, 3};
  const EvictionResult skewed = run_eviction(model, conv, nullptr, nullptr, o);
  ASSERT_EQ(uniform.rows.size(), 2u);
  ASSERT_EQ(equal.rows.size(), 2u);
  ASSERT_EQ(skewed.rows.size(), 2u);
  bool changed = false;
  for (size_t i = 0; i < uniform.rows.size(); ++i) {
    EXPECT_EQ(equal.rows[i].kl, uniform.rows[i].kl) << uniform.rows[i].score;
    EXPECT_EQ(equal.rows[i].delta_nll, uniform.rows[i].delta_nll) << uniform.rows[i].score;
    changed = changed || skewed.rows[i].kl != uniform.rows[i].kl;
  }
  EXPECT_TRUE(changed);
  EXPECT_EQ(skewed.layer_budgets, (std::vector<double>{1, 3}));
  o.layer_budgets = {1, 1, 1};
  EXPECT_THROW(run_eviction(model, conv, nullptr, nullptr, o), Error);
}

// Merging with a threshold no cosine reaches is dropping: every merge mode's rows equal none's bit
// for bit (with and without the identity codec). With a threshold every cosine passes, every
// evicted token is merged and the rows move.
TEST_F(EvictionRun, MergingNothingIsDropping) {
  const ModelFile model = ModelFile::open(dir);
  EvictionOptions o = small_options();
  o.ratios = {1, 4};
  o.sink = 2;
  o.recent = 4;
  o.observation = 8;
  o.pool = 3;
  o.scores = {EvictionScore::SnapKV, EvictionScore::EpiCache};
  o.episodes = 2;
  o.merges = all_eviction_merges();
  const auto conv = build_conversations(synthetic_documents(spec, 4, 80, 3), o, 0);
  const CacheScheme identity = identity_codec();
  auto find = [](const EvictionResult& r, const EvictionRow& like, const std::string& merge) {
    for (const EvictionRow& x : r.rows)
      if (x.score == like.score && x.ratio == like.ratio && x.int2 == like.int2 && x.merge == merge) return x;
    ADD_FAILURE() << "no row " << like.score << " " << merge;
    return EvictionRow{};
  };
  o.merge_threshold = 1.5;
  const EvictionResult never = run_eviction(model, conv, nullptr, &identity, o);
  ASSERT_EQ(never.rows.size(), 1u + 2 * 2 * 2 * 4);  // int2 "full" + (int2) × scores × ratios × merges
  o.merge_threshold = -1.5;
  const EvictionResult always = run_eviction(model, conv, nullptr, &identity, o);
  int moved = 0;
  for (const EvictionRow& row : never.rows) {
    if (row.merge == "none") continue;
    const EvictionRow none = find(never, row, "none");
    EXPECT_EQ(row.kl, none.kl) << row.score << " " << row.merge;
    EXPECT_EQ(row.delta_nll, none.delta_nll) << row.score << " " << row.merge;
    EXPECT_EQ(row.merged, 0.0);
    const EvictionRow all = find(always, row, row.merge);
    if (row.ratio == 1) {
      EXPECT_EQ(all.kl, 0.0);  // nothing evicted, nothing merged
    } else {
      EXPECT_EQ(all.merged, 1.0) << row.score << " " << row.merge;
      moved += all.kl != none.kl;
    }
  }
  EXPECT_EQ(moved, 2 * 2 * 3);  // (int2) × scores × merging modes at ratio 4
}

// Passages drawn from disjoint parts of the vocabulary, the continuation from the first one's:
// the episodes are the passages, and every continuation is routed to the episode of the passage it
// continues (its medoid block lies in the first passage).
TEST_F(EvictionRun, EpiCacheRoutesAContinuationToItsPassage) {
  const ModelFile model = ModelFile::open(dir);
  EvictionOptions o = small_options();
  o.passages = 3;
  o.ratios = {2};
  o.conversations = 4;
  o.scores = {EvictionScore::EpiCache};
  o.episodes = 3;
  o.route = 8;
  std::mt19937 rng(11);
  std::vector<std::vector<int32_t>> convs;
  for (int i = 0; i < 4; ++i) {
    std::vector<int32_t> conv;
    auto draw = [&](int part, int n) {  // tokens of part p: [1 + 4p, 5 + 4p)
      for (int t = 0; t < n; ++t) conv.push_back(int32_t(1 + 4 * part + int(rng() % 4)));
    };
    const int first = i % 3;
    for (int p = 0; p < 3; ++p) draw((first + p) % 3, 16);
    draw(first, 16 + 1);
    convs.push_back(conv);
  }
  const EvictionResult r = run_eviction(model, convs, nullptr, nullptr, o);
  EXPECT_EQ(r.epicache_routed_first, 4);
}

// Block-wise prefill (block_prefill). A model of two KV heads, so that kept sets differ per head.
class BlockPrefillRun : public ::testing::Test {
 protected:
  void SetUp() override {
    dir = (std::filesystem::temp_directory_path() / ("kvcc_block_prefill_" + std::to_string(::getpid()))).string();
    spec.vocab = 64;
    spec.hidden = 32;
    spec.n_layers = 3;  // layer 2's keys show what layers 0 and 1 attended to
    spec.n_heads = 4;
    spec.n_kv_heads = 2;
    spec.head_dim = 8;
    spec.intermediate = 64;
    spec.max_position = 256;
    write_synthetic_model(dir, spec);
  }
  void TearDown() override { std::filesystem::remove_all(dir); }
  // Float32 against float64 attention through two layers: relative ~1e-6 per operation, a few
  // products deep; 1e-4 of the rows' largest magnitude leaves a margin an error in which rows a
  // query sees (O(1) changes) cannot hide in.
  static void expect_rows_near(const std::vector<float>& got, const std::vector<float>& want, const char* what) {
    ASSERT_EQ(got.size(), want.size());
    float top = 0;
    for (float w : want) top = std::max(top, std::abs(w));
    for (size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], want[i], 1e-4f * top) << what << " element " << i;
  }
  std::string dir;
  SyntheticModelSpec spec;
};

// Budgets of at least the history evict nothing: the rows are the causal prefill's, every
// position kept, no log mass, and the cache held the whole history.
TEST_F(BlockPrefillRun, NothingEvictedIsTheCausalPrefill) {
  const ModelFile model = ModelFile::open(dir);
  const int H = 40;
  const std::vector<int32_t> ids = synthetic_documents(spec, 1, H, 5)[0];
  std::vector<LayerWeights> w;
  for (int l = 0; l < spec.n_layers; ++l) w.push_back(load_layer<float>(model, l));
  EvictionOptions o;
  o.prefill_block = 7;  // a last block of 5
  const BlockPrefill bp =
      block_prefill(model, w, ids.data(), H, EvictionScore::SnapKV, {H, H + 3, H}, EvictionMerge::Value, nullptr, o);
  std::vector<std::vector<float>> keys, values;
  testing::masked_prefill(
      model, ids,
      [](int, int i) {
        std::vector<int32_t> all(size_t(i) + 1);
        std::iota(all.begin(), all.end(), 0);
        return all;
      },
      keys, values);
  for (int l = 0; l < spec.n_layers; ++l) {
    expect_rows_near(bp.keys[size_t(l)], keys[size_t(l)], "keys");
    expect_rows_near(bp.values[size_t(l)], values[size_t(l)], "values");
    for (int g = 0; g < spec.n_kv_heads; ++g) {
      EXPECT_EQ(bp.kept[size_t(l)][size_t(g)].size(), size_t(H));
      EXPECT_EQ(bp.log_mass[size_t(l)][size_t(g)], std::vector<float>(size_t(H), 0.0f));
    }
  }
  EXPECT_EQ(bp.peak_rows, spec.n_layers * H);
  EXPECT_EQ(bp.evicted, 0);
}

// The window policy keeps, after each block, the sink and the newest budget − sink tokens: a
// query at position i in the block starting at s sees exactly those of [0, s) and the block up to
// itself (StreamingLLM prefilled in blocks). The layers' budgets differ, so their kept sets do.
TEST_F(BlockPrefillRun, WindowSeesTheSinkAndTheNewestTokens) {
  const ModelFile model = ModelFile::open(dir);
  const int H = 45, B = 8, sink = 3;  // blocks at 0, 8, ..., 40 (the last of 5)
  const std::vector<int64_t> budgets = {12, 20, 16};
  const std::vector<int32_t> ids = synthetic_documents(spec, 1, H, 6)[0];
  std::vector<LayerWeights> w;
  for (int l = 0; l < spec.n_layers; ++l) w.push_back(load_layer<float>(model, l));
  EvictionOptions o;
  o.prefill_block = B;
  o.sink = sink;
  o.recent = 2;
  const BlockPrefill bp =
      block_prefill(model, w, ids.data(), H, EvictionScore::Window, budgets, EvictionMerge::None, nullptr, o);
  // Layer l's cache once the tokens before s are in.
  auto kept_before = [&](int l, int s) {
    const int64_t M = budgets[size_t(l)];
    std::vector<int32_t> kept;
    for (int j = 0; j < s; ++j)
      if (s <= M || j < sink || j >= s - (M - sink)) kept.push_back(j);
    return kept;
  };
  std::vector<std::vector<float>> keys, values;
  testing::masked_prefill(
      model, ids,
      [&](int l, int i) {
        const int s = i / B * B;
        std::vector<int32_t> v = kept_before(l, s);
        for (int j = s; j <= i; ++j) v.push_back(j);
        return v;
      },
      keys, values);
  for (int l = 0; l < spec.n_layers; ++l) {
    expect_rows_near(bp.keys[size_t(l)], keys[size_t(l)], "keys");
    expect_rows_near(bp.values[size_t(l)], values[size_t(l)], "values");
    for (int g = 0; g < spec.n_kv_heads; ++g) EXPECT_EQ(bp.kept[size_t(l)][size_t(g)], kept_before(l, H)) << l;
  }
  EXPECT_EQ(bp.peak_rows, 12 + 20 + 16 + spec.n_layers * B);  // the budgets and a whole block
  // Without the window rule (every budget H) layer 2's keys differ: the test can tell.
  std::vector<std::vector<float>> causal, unused;
  testing::masked_prefill(
      model, ids,
      [](int, int i) {
        std::vector<int32_t> all(size_t(i) + 1);
        std::iota(all.begin(), all.end(), 0);
        return all;
      },
      causal, unused);
  float moved = 0;
  for (size_t i = 0; i < causal[2].size(); ++i) moved = std::max(moved, std::abs(causal[2][i] - keys[2][i]));
  EXPECT_GT(moved, 1e-2f);
}

// One block is the whole prefill: block-wise prefill keeps what the full prefill's eviction keeps
// and merges as it merges, so every row of run_eviction is the same up to the float rounding of
// computing the rows another way (the attention through attention_over_kept rather than
// causal_attention; the scores in float64 from the queries rather than the model's
// probabilities). Other kept sets would move the KL by orders more.
TEST_F(EvictionRun, OneBlockIsTheWholePrefill) {
  const ModelFile model = ModelFile::open(dir);
  EvictionOptions o = small_options();
  o.ratios = {4};
  o.sink = 2;
  o.recent = 4;
  o.observation = 8;
  o.pool = 3;
  o.scores = {EvictionScore::Window,     EvictionScore::H2O,     EvictionScore::SnapKV,
              EvictionScore::ValueAware, EvictionScore::KeyNorm, EvictionScore::EpiCache};
  o.episodes = 2;
  o.merges = {EvictionMerge::None, EvictionMerge::Value};
  const auto conv = build_conversations(synthetic_documents(spec, 4, 80, 3), o, 0);
  const CacheScheme identity = identity_codec();
  const EvictionResult whole = run_eviction(model, conv, nullptr, &identity, o);
  o.prefill_block = 48;
  const EvictionResult one = run_eviction(model, conv, nullptr, &identity, o);
  o.prefill_block = 16;
  const EvictionResult three = run_eviction(model, conv, nullptr, &identity, o);
  ASSERT_EQ(whole.rows.size(), 1u + 2 * 6 * 2);
  ASSERT_EQ(one.rows.size(), whole.rows.size());
  int moved = 0;
  for (size_t i = 0; i < whole.rows.size(); ++i) {
    const EvictionRow &a = whole.rows[i], &b = one.rows[i];
    EXPECT_NEAR(b.kl, a.kl, 1e-4 * a.kl) << a.score << " " << a.merge << (a.int2 ? " int2" : "");
    EXPECT_NEAR(b.delta_nll, a.delta_nll, 1e-4 * std::abs(a.delta_nll) + 1e-9) << a.score;
    EXPECT_EQ(b.merged, a.merged) << a.score << " " << a.merge;
    EXPECT_EQ(b.peak_rows, a.peak_rows) << a.score;
    // Blocks of 16 evict as they go: each layer holds at most 12 + 16 rows (+ the patched block).
    const EvictionRow& c3 = three.rows[i];
    if (a.score == "full") continue;
    EXPECT_EQ(c3.peak_rows, spec.n_layers * (a.score == "epicache" ? 12 + 16 + 8 : 12 + 16)) << a.score;
    if (a.merge == "value") {
      EXPECT_EQ(c3.merged, 1.0) << a.score;
    }
    moved += c3.kl != a.kl;
  }
  EXPECT_EQ(moved, 2 * 6 * 2);
  EXPECT_EQ(three.prefill_block, 16);
}

// Merging with a threshold no cosine reaches is dropping, block by block too: bit for bit.
TEST_F(EvictionRun, BlockWiseMergingNothingIsDropping) {
  const ModelFile model = ModelFile::open(dir);
  EvictionOptions o = small_options();
  o.ratios = {4};
  o.sink = 2;
  o.recent = 4;
  o.scores = {EvictionScore::SnapKV, EvictionScore::H2O, EvictionScore::EpiCache};
  o.episodes = 2;
  o.prefill_block = 12;
  o.merges = all_eviction_merges();
  o.merge_threshold = 1.5;
  const auto conv = build_conversations(synthetic_documents(spec, 4, 80, 3), o, 0);
  const EvictionResult r = run_eviction(model, conv, nullptr, nullptr, o);
  ASSERT_EQ(r.rows.size(), 3u * 4);
  for (size_t i = 0; i < r.rows.size(); i += 4)
    for (size_t m = 1; m < 4; ++m) {
      EXPECT_EQ(r.rows[i + m].kl, r.rows[i].kl) << r.rows[i].score << " " << r.rows[i + m].merge;
      EXPECT_EQ(r.rows[i + m].merged, 0.0);
    }
}

}  // namespace
}  // namespace kvcc
