// The statistics accumulator against a naive double-precision computation: random q/k/v for a few
// short sequences, the causal softmax computed here in double, per-vector outer products summed
// directly, and the reservoir chosen by sorting every token's priority.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <set>
#include <tuple>

#include "calibrate/accumulators.h"
#include "formats/error.h"
#include "model/forward.h"

namespace kvcc {
namespace {

ModelConfig small_config() {
  ModelConfig c;
  c.architecture = "llama";
  c.n_layers = 2;
  c.hidden = 32;
  c.n_heads = 6;
  c.n_kv_heads = 2;  // r = 3
  c.head_dim = 8;
  c.intermediate = 64;
  c.vocab = 100;
  c.max_position = 64;
  return c;
}

// One sequence's taps for one layer, with everything the naive reference needs in double.
struct Sequence {
  uint32_t doc = 0;
  int T = 0;
  std::vector<float> q, key_pre, key, value;  // as the forward pass would hand them over
  // Per query head: probs [T, T] and outputs [T, d] in double (the reference) and float (fed).
  std::vector<std::vector<double>> probs, out;
  std::vector<std::vector<float>> probs_f, out_f;
};

Sequence make_sequence(const ModelConfig& c, uint32_t doc, int T, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int d = c.head_dim, nq = c.n_heads, nkv = c.n_kv_heads, r = c.group();
  Sequence s;
  s.doc = doc;
  s.T = T;
  s.q.resize(size_t(T) * nq * d);
  s.key_pre.resize(size_t(T) * nkv * d);
  s.key.resize(size_t(T) * nkv * d);
  s.value.resize(size_t(T) * nkv * d);
  // Channel-dependent scales and offsets make the matrices far from diagonal and ranges distinct.
  for (size_t i = 0; i < s.q.size(); ++i) s.q[i] = normal(rng) * (1.0f + float(i % d) * 0.3f);
  for (size_t i = 0; i < s.key.size(); ++i) {
    s.key_pre[i] = normal(rng);
    s.key[i] = normal(rng) * 2.0f + float(i % d) * 0.1f;
    s.value[i] = normal(rng) - 0.5f + float(i % 3);
  }
  const double scale = 1.0 / std::sqrt(double(d));
  for (int hq = 0; hq < nq; ++hq) {
    const int h = hq / r;
    std::vector<double> p(size_t(T) * T, 0.0), o(size_t(T) * d, 0.0);
    for (int i = 0; i < T; ++i) {
      std::vector<double> logit(size_t(i) + 1);
      double mx = -INFINITY;
      for (int j = 0; j <= i; ++j) {
        double dot = 0;
        for (int k = 0; k < d; ++k)
          dot += double(s.q[(size_t(i) * nq + hq) * d + k]) * double(s.key[(size_t(j) * nkv + h) * d + k]);
        logit[size_t(j)] = dot * scale;
        mx = std::max(mx, logit[size_t(j)]);
      }
      double z = 0;
      for (int j = 0; j <= i; ++j) z += std::exp(logit[size_t(j)] - mx);
      for (int j = 0; j <= i; ++j) p[size_t(i) * T + j] = std::exp(logit[size_t(j)] - mx) / z;
      for (int j = 0; j <= i; ++j)
        for (int k = 0; k < d; ++k)
          o[size_t(i) * d + k] += p[size_t(i) * T + j] * double(s.value[(size_t(j) * nkv + h) * d + k]);
    }
    s.probs_f.emplace_back(p.begin(), p.end());
    s.out_f.emplace_back(o.begin(), o.end());
    s.probs.push_back(std::move(p));
    s.out.push_back(std::move(o));
  }
  return s;
}

SequenceTaps taps_of(const Sequence& s, int layer) {
  SequenceTaps t;
  t.layer = layer;
  t.doc = s.doc;
  t.T = s.T;
  t.q = s.q.data();
  t.key_pre = s.key_pre.data();
  t.key = s.key.data();
  t.value = s.value.data();
  return t;
}

void feed(StatsAccumulator& acc, const Sequence& s, int layer) {
  const SequenceTaps t = taps_of(s, layer);
  acc.on_qkv(t);
  for (int hq = 0; hq < acc.config().n_heads; ++hq)
    acc.on_probs(t, hq, s.probs_f[size_t(hq)].data(), s.out_f[size_t(hq)].data());
}

void add_outer(std::vector<double>& m, const double* x, int d, double w = 1.0) {
  for (int a = 0; a < d; ++a)
    for (int b = 0; b < d; ++b) m[size_t(a) * d + b] += w * x[a] * x[b];
}

// Every entry within `rel` of the reference, relative to the reference matrix's largest entry.
void expect_matrix_near(const std::vector<double>& got, const std::vector<double>& want, double rel,
                        const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double scale = 0;
  for (double v : want) scale = std::max(scale, std::abs(v));
  ASSERT_GT(scale, 0.0) << what << " reference is all zero";
  for (size_t i = 0; i < want.size(); ++i) ASSERT_NEAR(got[i], want[i], rel * scale) << what << " entry " << i;
}

struct Fixture {
  ModelConfig config = small_config();
  std::vector<std::vector<Sequence>> per_layer;  // [layer][sequence]
};

Fixture make_fixture(uint64_t seed, const std::vector<std::pair<uint32_t, int>>& docs) {
  Fixture f;
  std::mt19937_64 rng(seed);
  for (int l = 0; l < f.config.n_layers; ++l) {
    std::vector<Sequence> seqs;
    for (auto [doc, T] : docs) seqs.push_back(make_sequence(f.config, doc, T, rng));
    f.per_layer.push_back(std::move(seqs));
  }
  return f;
}

Stats accumulate(const Fixture& f, int capacity, uint64_t seed, bool reverse_order = false) {
  StatsAccumulator acc(f.config, capacity, seed);
  for (int l = 0; l < f.config.n_layers; ++l) {
    auto seqs = f.per_layer[size_t(l)];
    if (reverse_order) std::reverse(seqs.begin(), seqs.end());
    for (const auto& s : seqs) feed(acc, s, l);
  }
  Stats stats = make_empty_stats(f.config, ModelFingerprint{}, capacity);
  acc.export_into(stats);
  return stats;
}

const std::vector<std::pair<uint32_t, int>> kDocs = {{0, 5}, {1, 11}, {4, 17}, {7, 3}};

TEST(CalibrateStats, SumsMatchNaiveDoubleComputation) {
  const Fixture f = make_fixture(42, kDocs);
  const Stats stats = accumulate(f, 16, 7);
  const ModelConfig& c = f.config;
  const int d = c.head_dim, nq = c.n_heads, nkv = c.n_kv_heads, r = c.group();
  uint64_t tokens = 0;
  for (auto [doc, T] : kDocs) tokens += uint64_t(T);

  for (int l = 0; l < c.n_layers; ++l) {
    for (int h = 0; h < nkv; ++h) {
      std::vector<double> qm(size_t(d) * d, 0), om(qm), p2(qm), km(qm), vm(qm);
      std::vector<double> kmin(size_t(d), INFINITY), kmax(size_t(d), -INFINITY), vmin(kmin), vmax(kmax);
      double p2_weight = 0;
      for (const Sequence& s : f.per_layer[size_t(l)]) {
        std::vector<double> x(static_cast<size_t>(d));
        for (int t = 0; t < s.T; ++t) {
          for (int hq = h * r; hq < h * r + r; ++hq) {
            for (int k = 0; k < d; ++k) x[size_t(k)] = s.q[(size_t(t) * nq + hq) * d + k];
            add_outer(qm, x.data(), d);
            add_outer(om, s.out[size_t(hq)].data() + size_t(t) * d, d);
          }
          for (int k = 0; k < d; ++k) {
            const double kv = s.key[(size_t(t) * nkv + h) * d + k];
            const double vv = s.value[(size_t(t) * nkv + h) * d + k];
            kmin[size_t(k)] = std::min(kmin[size_t(k)], kv);
            kmax[size_t(k)] = std::max(kmax[size_t(k)], kv);
            vmin[size_t(k)] = std::min(vmin[size_t(k)], vv);
            vmax[size_t(k)] = std::max(vmax[size_t(k)], vv);
            x[size_t(k)] = kv;
          }
          add_outer(km, x.data(), d);
          for (int k = 0; k < d; ++k) x[size_t(k)] = s.value[(size_t(t) * nkv + h) * d + k];
          add_outer(vm, x.data(), d);
        }
        // p2: w_j = Σ over the group's heads Σ_i p_ij² (the diagonal of SᵀS).
        for (int j = 0; j < s.T; ++j) {
          double w = 0;
          for (int hq = h * r; hq < h * r + r; ++hq)
            for (int i = 0; i < s.T; ++i)
              w += s.probs[size_t(hq)][size_t(i) * s.T + j] * s.probs[size_t(hq)][size_t(i) * s.T + j];
          for (int k = 0; k < d; ++k) x[size_t(k)] = s.value[(size_t(j) * nkv + h) * d + k];
          add_outer(p2, x.data(), d, w);
          p2_weight += w;
        }
      }
      const HeadStats& hs = stats.head(l, h);
      const std::string where = " layer " + std::to_string(l) + " head " + std::to_string(h);
      expect_matrix_near(hs.query_m2, qm, 1e-6, "query_m2" + where);
      expect_matrix_near(hs.output_m2, om, 1e-6, "output_m2" + where);
      expect_matrix_near(hs.p2_m2, p2, 1e-6, "p2_m2" + where);
      expect_matrix_near(hs.key_m2, km, 1e-6, "key_m2" + where);
      expect_matrix_near(hs.value_m2, vm, 1e-6, "value_m2" + where);
      EXPECT_NEAR(hs.p2_weight, p2_weight, 1e-6 * p2_weight) << where;
      EXPECT_EQ(hs.query_count, tokens * uint64_t(r)) << where;
      EXPECT_EQ(hs.output_count, tokens * uint64_t(r)) << where;
      EXPECT_EQ(hs.kv_count, tokens) << where;
      for (int k = 0; k < d; ++k) {
        // Ranges are exact: min/max of the same float values.
        EXPECT_EQ(hs.key_min[size_t(k)], kmin[size_t(k)]) << where;
        EXPECT_EQ(hs.key_max[size_t(k)], kmax[size_t(k)]) << where;
        EXPECT_EQ(hs.value_min[size_t(k)], vmin[size_t(k)]) << where;
        EXPECT_EQ(hs.value_max[size_t(k)], vmax[size_t(k)]) << where;
      }
      // Stored matrices are full and symmetric.
      for (int a = 0; a < d; ++a)
        for (int b = 0; b < d; ++b) ASSERT_EQ(hs.query_m2[size_t(a) * d + b], hs.query_m2[size_t(b) * d + a]);
    }
  }
}

TEST(CalibrateStats, ReservoirKeepsSmallestPrioritiesOfAllTokens) {
  const Fixture f = make_fixture(3, kDocs);
  const int capacity = 9;
  const uint64_t seed = 1234;
  const Stats stats = accumulate(f, capacity, seed);
  const ModelConfig& c = f.config;
  const int d = c.head_dim, nq = c.n_heads, nkv = c.n_kv_heads, r = c.group();

  // Expected: sort every (doc, position) by priority, keep the first `capacity`.
  std::vector<std::tuple<uint64_t, uint32_t, int>> all;
  for (auto [doc, T] : kDocs)
    for (int t = 0; t < T; ++t) all.emplace_back(reservoir_priority(seed, doc, t), doc, t);
  std::sort(all.begin(), all.end());
  all.resize(size_t(capacity));
  std::set<std::pair<uint32_t, int>> expected;
  for (auto& [p, doc, t] : all) expected.insert({doc, t});
  ASSERT_EQ(expected.size(), size_t(capacity));

  for (int l = 0; l < c.n_layers; ++l) {
    for (int h = 0; h < nkv; ++h) {
      const Reservoir& res = stats.reservoir(l, h);
      ASSERT_EQ(res.size(), size_t(capacity));
      EXPECT_EQ(res.group, r);
      EXPECT_EQ(res.d, d);
      std::set<std::pair<uint32_t, int>> got;
      for (size_t i = 0; i < res.size(); ++i) {
        const uint32_t doc = res.doc[i];
        const int t = res.position[i];
        got.insert({doc, t});
        EXPECT_EQ(res.priority[i], reservoir_priority(seed, doc, t));
        EXPECT_EQ(res.heldout[i], doc % 5 == 4 ? 1 : 0);
        const Sequence* s = nullptr;
        for (const auto& cand : f.per_layer[size_t(l)])
          if (cand.doc == doc) s = &cand;
        ASSERT_NE(s, nullptr);
        for (int k = 0; k < d; ++k) {
          EXPECT_EQ(res.key[i * d + size_t(k)], s->key[(size_t(t) * nkv + h) * d + k]);
          EXPECT_EQ(res.key_pre[i * d + size_t(k)], s->key_pre[(size_t(t) * nkv + h) * d + k]);
          EXPECT_EQ(res.value[i * d + size_t(k)], s->value[(size_t(t) * nkv + h) * d + k]);
          for (int g = 0; g < r; ++g)
            EXPECT_EQ(res.q[(i * r + size_t(g)) * d + size_t(k)], s->q[(size_t(t) * nq + h * r + g) * d + k]);
        }
      }
      EXPECT_EQ(got, expected) << "layer " << l << " head " << h;
    }
  }
}

TEST(CalibrateStats, ResultDoesNotDependOnSequenceOrder) {
  const Fixture f = make_fixture(5, kDocs);
  const Stats a = accumulate(f, 6, 99);
  const Stats b = accumulate(f, 6, 99, /*reverse_order=*/true);
  for (size_t i = 0; i < a.heads.size(); ++i) {
    expect_matrix_near(b.heads[i].query_m2, a.heads[i].query_m2, 1e-13, "query_m2");
    expect_matrix_near(b.heads[i].p2_m2, a.heads[i].p2_m2, 1e-13, "p2_m2");
    std::set<uint64_t> pa(a.reservoirs[i].priority.begin(), a.reservoirs[i].priority.end());
    std::set<uint64_t> pb(b.reservoirs[i].priority.begin(), b.reservoirs[i].priority.end());
    EXPECT_EQ(pa, pb);
  }
}

TEST(CalibrateStats, ReservoirLargerThanDataKeepsEverything) {
  const Fixture f = make_fixture(8, kDocs);
  const Stats stats = accumulate(f, 1000, 1);
  size_t tokens = 0, heldout = 0;
  for (auto [doc, T] : kDocs) {
    tokens += size_t(T);
    if (doc % 5 == 4) heldout += size_t(T);
  }
  for (const Reservoir& res : stats.reservoirs) {
    EXPECT_EQ(res.size(), tokens);
    EXPECT_EQ(size_t(std::count(res.heldout.begin(), res.heldout.end(), uint8_t(1))), heldout);
  }
}

// The GPU path's sampler: tokens chosen up front (preselect) and their rows offered packed, one
// sequence at a time, must give the reservoirs that merging every candidate gives, bit for bit.
TEST(CalibrateStats, PreselectedSamplerEqualsMergingEveryCandidate) {
  const Fixture f = make_fixture(6, kDocs);
  const ModelConfig& c = f.config;
  const int qdim = c.n_heads * c.head_dim, kvdim = c.n_kv_heads * c.head_dim;
  for (int capacity : {1, 7, 20, 1000}) {
    ReservoirSampler merging(c, capacity, 77), preselected(c, capacity, 77);
    preselected.preselect(kDocs);
    for (int l = 0; l < c.n_layers; ++l)
      for (const Sequence& s : f.per_layer[size_t(l)]) {
        merging.offer(l, s.doc, merging.candidates(l, s.doc, s.T), false, s.q.data(), s.key_pre.data(), s.key.data(),
                      s.value.data());
        const std::vector<int> kept = preselected.candidates(l, s.doc, s.T);
        std::vector<float> q, kp, k, v;  // the kept rows packed, as the GPU gathers them
        for (int t : kept) {
          q.insert(q.end(), s.q.begin() + ptrdiff_t(t) * qdim, s.q.begin() + ptrdiff_t(t + 1) * qdim);
          kp.insert(kp.end(), s.key_pre.begin() + ptrdiff_t(t) * kvdim, s.key_pre.begin() + ptrdiff_t(t + 1) * kvdim);
          k.insert(k.end(), s.key.begin() + ptrdiff_t(t) * kvdim, s.key.begin() + ptrdiff_t(t + 1) * kvdim);
          v.insert(v.end(), s.value.begin() + ptrdiff_t(t) * kvdim, s.value.begin() + ptrdiff_t(t + 1) * kvdim);
        }
        preselected.offer(l, s.doc, kept, true, q.data(), kp.data(), k.data(), v.data());
      }
    Stats a, b;
    std::move(merging).move_into(a);
    std::move(preselected).move_into(b);
    ASSERT_EQ(a.reservoirs.size(), b.reservoirs.size());
    for (size_t i = 0; i < a.reservoirs.size(); ++i) {
      const Reservoir &x = a.reservoirs[i], &y = b.reservoirs[i];
      EXPECT_EQ(x.size(), size_t(std::min(capacity, 36))) << capacity;
      EXPECT_EQ(x.priority, y.priority) << capacity;
      EXPECT_EQ(x.position, y.position);
      EXPECT_EQ(x.doc, y.doc);
      EXPECT_EQ(x.heldout, y.heldout);
      EXPECT_EQ(x.q, y.q);
      EXPECT_EQ(x.key_pre, y.key_pre);
      EXPECT_EQ(x.key, y.key);
      EXPECT_EQ(x.value, y.value);
    }
  }
}

TEST(CalibrateStats, PriorityIsAHashOfSeedDocPosition) {
  // Distinct tokens and seeds give distinct priorities (a collision here would mean a weak mix).
  std::set<uint64_t> seen;
  for (uint32_t doc = 0; doc < 50; ++doc)
    for (int t = 0; t < 50; ++t) seen.insert(reservoir_priority(17, doc, t));
  EXPECT_EQ(seen.size(), 2500u);
  EXPECT_NE(reservoir_priority(1, 0, 0), reservoir_priority(2, 0, 0));
  EXPECT_EQ(reservoir_priority(1, 3, 4), reservoir_priority(1, 3, 4));
}

TEST(CalibrateStats, ProbsWithoutQkvIsRefused) {
  const Fixture f = make_fixture(9, {{0, 4}});
  StatsAccumulator acc(f.config, 4, 1);
  const Sequence& s = f.per_layer[0][0];
  const SequenceTaps t = taps_of(s, 0);
  EXPECT_THROW(acc.on_probs(t, 0, s.probs_f[0].data(), s.out_f[0].data()), Error);
}

// The runtime's causal attention drives the observer with its own (float) softmax: the sums
// must agree with the naive double computation from the same q/k/v within float rounding.
TEST(CalibrateStats, RuntimeAttentionDrivesTheObserver) {
  const Fixture f = make_fixture(11, {{0, 6}, {2, 13}});
  const ModelConfig& c = f.config;
  StatsAccumulator via_runtime(c, 0, 1), via_naive(c, 0, 1);
  for (int l = 0; l < c.n_layers; ++l) {
    for (const Sequence& s : f.per_layer[size_t(l)]) {
      const SequenceTaps t = taps_of(s, l);
      std::vector<float> out(size_t(s.T) * c.n_heads * c.head_dim);
      causal_attention(c, s.T, s.q.data(), s.key.data(), s.value.data(), out.data(), &via_runtime, &t);
      // The attention output itself equals the naive o of every head.
      for (int hq = 0; hq < c.n_heads; ++hq)
        for (int i = 0; i < s.T; ++i)
          for (int k = 0; k < c.head_dim; ++k)
            ASSERT_NEAR(out[(size_t(i) * c.n_heads + hq) * c.head_dim + k],
                        s.out[size_t(hq)][size_t(i) * c.head_dim + k], 1e-5);
      feed(via_naive, s, l);
    }
  }
  Stats a = make_empty_stats(c, ModelFingerprint{}, 0), b = a;
  via_runtime.export_into(a);
  via_naive.export_into(b);
  for (size_t i = 0; i < a.heads.size(); ++i) {
    expect_matrix_near(a.heads[i].output_m2, b.heads[i].output_m2, 1e-5, "output_m2");
    expect_matrix_near(a.heads[i].p2_m2, b.heads[i].p2_m2, 1e-5, "p2_m2");
    expect_matrix_near(a.heads[i].query_m2, b.heads[i].query_m2, 1e-12, "query_m2");
    EXPECT_NEAR(a.heads[i].p2_weight, b.heads[i].p2_weight, 1e-5 * b.heads[i].p2_weight);
    EXPECT_EQ(a.heads[i].output_count, b.heads[i].output_count);
  }
}

}  // namespace
}  // namespace kvcc
