// Attention-based token scores (Runtime::attention_scores, attention_scores_ref) on a host pool:
// for one observation query they are the weights decode itself applies (decode's output is the
// weighted sum of the values the cache holds, rotated back), for several they are each query's
// causal softmax over the keys the cache holds, summed; each head's scores sum to W·r.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <vector>

#include "formats/artifact.h"
#include "formats/error.h"
#include "formats/fp16.h"
#include "runtime/attention_ref.h"
#include "runtime/kvcc_runtime.h"
#include "cache_test_util.h"

namespace kvcc {
namespace {

constexpr int kLayers = 2, kHeads = 6, kKv = 2, kD = 32, kR = kHeads / kKv;

std::unique_ptr<Runtime> host_runtime(const Artifact& art, Activations act = Activations::Float32) {
  RuntimeOptions o;
  o.max_pages = 64;
  o.max_sequences = 2;
  o.memory = PoolMemory::Host;
  o.activations = act;
  return std::make_unique<Runtime>(art, EngineShape{kLayers, kHeads, kKv, kD}, o);
}

std::vector<float> normal(size_t n, std::mt19937& rng, float scale) {
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<float> x(n);
  for (float& v : x) v = nd(rng);
  return x;
}

// n tokens appended in chunks of 37: sink (8), INT2 pages (16 tokens), ring (32) all in use.
void fill(Runtime& rt, int seq, int64_t n, std::mt19937& rng) {
  for (int64_t at = 0; at < n; at += 37) {
    const int cnt = int(std::min<int64_t>(37, n - at));
    rt.begin_append({seq}, {cnt});
    for (int l = 0; l < kLayers; ++l) {
      // Keys large enough that the weights are far from uniform (logits of several units).
      const auto k = normal(size_t(cnt) * kKv * kD, rng, 2.0f), v = normal(k.size(), rng, 1.0f);
      rt.append(l, k.data(), v.data());
    }
  }
}

TEST(AttentionScores, OneQueryGivesTheWeightsDecodeApplies) {
  const Artifact art = testing::small_runtime_artifact(kLayers, kHeads, kKv, kD);
  auto rt = host_runtime(art);
  std::mt19937 rng(5);
  const int s = rt->cache().add_sequence();
  const int64_t n = 8 + 16 * 5 + 29;
  fill(*rt, s, n, rng);
  ASSERT_GT(tiers_of(rt->geometry(), n).hist_tokens, 0);
  for (int l = 0; l < kLayers; ++l) {
    // One query per KV head, the same for its r query heads: each head's weights are scores / r.
    std::vector<float> q(size_t(kHeads) * kD);
    const auto base = normal(size_t(kKv) * kD, rng, 1.0f);
    for (int qh = 0; qh < kHeads; ++qh) std::copy_n(base.begin() + (qh / kR) * kD, kD, q.begin() + qh * kD);
    std::vector<float> scores(size_t(kKv) * size_t(n)), out(q.size());
    rt->attention_scores(l, s, 1, q.data(), scores.data());
    rt->decode(l, {s}, q.data(), out.data());
    std::vector<float> keys, values;
    gather_sequence(rt->cache(), l, s, rt->codecs(l), keys, values);
    for (int h = 0; h < kKv; ++h) {
      // o = (Σ_j p_j v_j) R_vᵀ over the values as stored (rotated basis).
      std::vector<double> mix(kD, 0.0);
      double total = 0, pmax = 0;
      for (int64_t j = 0; j < n; ++j) {
        const double p = double(scores[size_t(h) * n + j]) / kR;
        total += p;
        pmax = std::max(pmax, p);
        for (int c = 0; c < kD; ++c) mix[size_t(c)] += p * values[(size_t(j) * kKv + h) * kD + c];
      }
      EXPECT_NEAR(total, 1.0, 1e-6);
      EXPECT_GT(pmax, 5.0 / double(n)) << "weights too flat for the check to mean anything";
      const float* rv = rt->rot_v(l) + size_t(h) * kD * kD;
      for (int qh = h * kR; qh < (h + 1) * kR; ++qh)
        for (int j = 0; j < kD; ++j) {
          double o = 0;
          for (int i = 0; i < kD; ++i) o += mix[size_t(i)] * rv[size_t(j) * kD + i];
          // decode_ref accumulates in float64 and rounds its output to float; the scores are float.
          EXPECT_NEAR(out[size_t(qh) * kD + j], o, 1e-5) << "layer " << l << " head " << qh << " channel " << j;
        }
    }
  }
}

TEST(AttentionScores, ManyQueriesAreCausalSoftmaxesSummed) {
  const Artifact art = testing::small_runtime_artifact(kLayers, kHeads, kKv, kD);
  auto rt = host_runtime(art);
  std::mt19937 rng(6);
  const int s = rt->cache().add_sequence();
  const int64_t n = 8 + 16 * 4 + 40;
  fill(*rt, s, n, rng);
  for (const int W : {1, 5, 32, int(n)}) {
    SCOPED_TRACE("W " + std::to_string(W));
    const int l = W % 2;
    const auto q = normal(size_t(W) * kHeads * kD, rng, 1.0f);
    std::vector<float> scores(size_t(kKv) * size_t(n), -1.0f);
    rt->attention_scores(l, s, W, q.data(), scores.data());
    std::vector<float> keys, values;
    gather_sequence(rt->cache(), l, s, rt->codecs(l), keys, values);
    const float* rk = rt->rot_k(l);
    const double scale = 1.0 / std::sqrt(double(kD));
    std::vector<double> want(size_t(kKv) * size_t(n), 0.0), logit(static_cast<size_t>(n));
    for (int i = 0; i < W; ++i)
      for (int qh = 0; qh < kHeads; ++qh) {
        const int h = qh / kR;
        const float* qi = q.data() + (size_t(i) * kHeads + qh) * kD;
        std::vector<double> qr(kD, 0.0);  // q·R_k
        for (int c = 0; c < kD; ++c)
          for (int a = 0; a < kD; ++a) qr[size_t(c)] += double(qi[a]) * rk[(size_t(h) * kD + a) * kD + c];
        const int64_t last = n - W + i;
        double mx = -1e300, sum = 0;
        for (int64_t j = 0; j <= last; ++j) {
          double dot = 0;
          for (int c = 0; c < kD; ++c) dot += qr[size_t(c)] * keys[(size_t(j) * kKv + h) * kD + c];
          mx = std::max(mx, logit[size_t(j)] = dot * scale);
        }
        for (int64_t j = 0; j <= last; ++j) sum += std::exp(logit[size_t(j)] - mx);
        for (int64_t j = 0; j <= last; ++j) want[size_t(h) * n + j] += std::exp(logit[size_t(j)] - mx) / sum;
      }
    for (int h = 0; h < kKv; ++h) {
      double total = 0;
      for (int64_t j = 0; j < n; ++j) {
        const double got = scores[size_t(h) * n + j];
        total += got;
        // float32 rounding of a sum of at most W·r weights, each <= 1.
        EXPECT_NEAR(got, want[size_t(h) * n + j], 1e-6 * (1 + want[size_t(h) * n + j])) << "head " << h << " pos " << j;
      }
      EXPECT_NEAR(total, double(W) * kR, 1e-5 * W * kR);
    }
  }
}

TEST(AttentionScores, BFloat16QueriesEqualTheirWidenedFloats) {
  const Artifact art = testing::small_runtime_artifact(kLayers, kHeads, kKv, kD);
  auto f32 = host_runtime(art), b16 = host_runtime(art, Activations::BFloat16);
  std::mt19937 rng_a(7), rng_b(7);
  const int s = f32->cache().add_sequence();
  ASSERT_EQ(b16->cache().add_sequence(), s);
  const int64_t n = 70;
  // Same keys and values (the bfloat16 Runtime gets them rounded, so give both the rounded ones).
  for (int64_t at = 0; at < n; at += 35) {
    f32->begin_append({s}, {35});
    b16->begin_append({s}, {35});
    for (int l = 0; l < kLayers; ++l) {
      const auto k = normal(35 * kKv * kD, rng_a, 2.0f), v = normal(k.size(), rng_a, 1.0f);
      std::vector<float> kw(k.size()), vw(v.size());
      std::vector<uint16_t> kb(k.size()), vb(v.size());
      for (size_t i = 0; i < k.size(); ++i) {
        kb[i] = bf16_from_float(k[i]);
        vb[i] = bf16_from_float(v[i]);
        kw[i] = float_from_bf16(kb[i]);
        vw[i] = float_from_bf16(vb[i]);
      }
      f32->append(l, kw.data(), vw.data());
      b16->append(l, kb.data(), vb.data());
    }
  }
  const int W = 9;
  const auto q = normal(size_t(W) * kHeads * kD, rng_b, 1.0f);
  std::vector<uint16_t> qb(q.size());
  std::vector<float> qw(q.size());
  for (size_t i = 0; i < q.size(); ++i) qw[i] = float_from_bf16(qb[i] = bf16_from_float(q[i]));
  std::vector<float> a(size_t(kKv) * n), b(a.size());
  f32->attention_scores(1, s, W, qw.data(), a.data());
  b16->attention_scores(1, s, W, qb.data(), b.data());
  EXPECT_EQ(a, b);
}

TEST(AttentionScores, RefusesBadCalls) {
  const Artifact art = testing::small_runtime_artifact(kLayers, kHeads, kKv, kD);
  auto rt = host_runtime(art);
  std::mt19937 rng(8);
  const int s = rt->cache().add_sequence();
  fill(*rt, s, 20, rng);
  std::vector<float> q(size_t(21) * kHeads * kD, 0.1f), scores(size_t(kKv) * 21);
  EXPECT_THROW(rt->attention_scores(0, s, 0, q.data(), scores.data()), Error);
  EXPECT_THROW(rt->attention_scores(0, s, 21, q.data(), scores.data()), Error);
  EXPECT_THROW(rt->attention_scores(kLayers, s, 1, q.data(), scores.data()), Error);
  EXPECT_THROW(rt->attention_scores(0, s + 1, 1, q.data(), scores.data()), Error);
  rt->begin_append({s}, {1});
  EXPECT_THROW(rt->attention_scores(0, s, 1, q.data(), scores.data()), Error);
  for (int l = 0; l < kLayers; ++l) rt->append(l, q.data(), q.data());
  EXPECT_NO_THROW(rt->attention_scores(0, s, 21, q.data(), scores.data()));
}

}  // namespace
}  // namespace kvcc
