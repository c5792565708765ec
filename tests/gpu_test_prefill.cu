// GPU tests of the prefill / extend attention kernel (runtime/prefill.cu) against its CPU
// reference prefill_ref (float64) on fresh random caches: empty history, inside the sink, ring
// partly filled, ring exactly full, one page, many pages, a diverged fork; T = 1 up to several
// query and key tiles; 4, 5 and 8 query heads per KV head; the uniform grid and the level table;
// forced key-range splits. Every output element is written (NaN sentinels), and repeated runs are
// bit-identical. The device pool is the host pool's bytes (append is tested in gpu_test_cache).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "formats/artifact.h"
#include "formats/error.h"
#include "formats/kv_layout.h"
#include "runtime/append_ref.h"
#include "runtime/attention_ref.h"
#include "runtime/kv_cache.h"
#include "runtime/kv_kernels.h"
#include "runtime/kvcc_runtime.h"
#include "cache_test_util.h"
#include "gpu_test_util.h"

namespace kvcc {
namespace {

using testing::random_orthogonal;
using testing::random_rotations;
using testing::rel;
using testing::test_geometry;
using testing::transpose_heads;
using testing::Dev;
using testing::PoolPair;
using testing::random_rows;

constexpr int kD = 128;

// A host cache filled by the reference append, and a device pool holding the same bytes.
struct Caches : PoolPair {
  Caches(const KvGeometry& geo, int64_t pages, int seqs, bool level_tables) : PoolPair(geo, pages, seqs, 4242) {
    if (!level_tables) return;
    for (size_t i = 0; i < codecs.size(); ++i) {
      HeadCodec& c = codecs[i];
      if (i % 2 == 0) {  // keys of even heads, values of every head
        const float lv[4] = {-1.5104f, -0.4528f, 0.4528f, 1.5104f};
        c.key.use_table = 1;
        std::copy(lv, lv + 4, c.key.levels);
      }
      const float lv[4] = {-1.7f, -0.5f, 0.41f, 1.3f};  // asymmetric: not exact in bf16
      c.value.use_table = 1;
      std::copy(lv, lv + 4, c.value.levels);
    }
  }
  // Appends random rows (rotation null) to every layer of the host pool (the reference append).
  void append(const std::vector<int>& seqs, const std::vector<int>& counts) {
    const std::vector<int64_t> old = grow(seqs, counts);
    int64_t rows = 0;
    for (int c : counts) rows += c;
    const AppendBatch batch = make_append_batch(seqs, old, counts);
    for (int l = 0; l < g.n_layers; ++l) {
      const auto k = random_rows(size_t(rows) * g.n_kv_heads * kD, rng, true);
      const auto v = random_rows(k.size(), rng, false);
      append_ref(host, l, batch, k.data(), v.data(), nullptr, nullptr, codecs.data() + size_t(l) * g.n_kv_heads);
    }
  }
  void sync_device() {
    ASSERT_EQ(host.pool_bytes(), dev.pool_bytes());
    CUDA_OK(cudaMemcpy(dev.pages_base(), host.pages_base(), host.pool_bytes(), cudaMemcpyHostToDevice));
  }
};

struct Case {
  int seq, T;
};

// Prefill of every case on the GPU against prefill_ref; returns the worst per-head error.
double check_prefill(Caches& c, const std::vector<Case>& cases, int n_heads, int layer, int splits, int warps,
                     bool rotate) {
  const KvGeometry& g = c.g;
  std::mt19937 rng(17 + n_heads + splits);
  std::vector<float> rk, rv, rvt;
  if (rotate) {
    rk = random_rotations(g.n_kv_heads, kD, rng);
    rv = random_rotations(g.n_kv_heads, kD, rng);
    rvt = transpose_heads(rv, g.n_kv_heads, kD);
  }
  Dev<float> drk(rk), drv(rv), drvt(rvt);
  const float scale = 1.0f / std::sqrt(float(kD));
  const HeadCodec* cod = c.codecs.data() + size_t(layer) * g.n_kv_heads;
  const PrefillShape shape{n_heads, scale, splits, warps};
  double worst = 0;
  for (const Case& cs : cases) {
    const int T = cs.T;
    const int64_t len = c.host.length(cs.seq);
    auto q = random_rows(size_t(T) * n_heads * kD, rng, false);
    for (auto& x : q) x *= 3.0f;
    const auto k = random_rows(size_t(T) * g.n_kv_heads * kD, rng, true);
    const auto v = random_rows(k.size(), rng, false);
    std::vector<float> want(q.size());
    prefill_ref(c.host, layer, cs.seq, T, q.data(), k.data(), v.data(), n_heads, rotate ? rk.data() : nullptr,
                rotate ? rv.data() : nullptr, cod, scale, want.data());

    const auto& pt = c.dev.page_table(cs.seq);
    Dev<int32_t> table(std::vector<int32_t>(pt.begin(), pt.begin() + history_pages(g, len)));
    Dev<float> dq(q), dk(k), dv(v), dout(q.size());
    const size_t wsb = prefill_workspace_bytes(g, len, T, shape);
    Dev<uint8_t> ws(wsb);
    std::vector<float> got(q.size()), again(q.size());
    for (int rep = 0; rep < 2; ++rep) {
      EXPECT_EQ(cudaMemset(dout.p, 0xff, q.size() * 4), cudaSuccess);  // NaN sentinels
      EXPECT_EQ(cudaMemset(ws.p, 0xff, wsb), cudaSuccess);
      prefill_int2(g, c.dev.pages_base(), c.dev.windows_base(), layer, cs.seq, len, table.p, T, cod, shape, dq.p,
                   dk.p, dv.p, rotate ? drk.p : nullptr, rotate ? drv.p : nullptr, rotate ? drvt.p : nullptr, dout.p,
                   ws.p, wsb, nullptr);
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      EXPECT_EQ(cudaMemcpy(rep ? again.data() : got.data(), dout.p, q.size() * 4, cudaMemcpyDeviceToHost),
                cudaSuccess);
    }
    size_t unwritten = 0;
    for (float x : got) unwritten += !std::isfinite(x);
    EXPECT_EQ(unwritten, 0u) << "len " << len << " T " << T << ": outputs not written";
    EXPECT_EQ(std::memcmp(got.data(), again.data(), got.size() * 4), 0) << "len " << len << " T " << T
                                                                        << ": repeated runs differ";
    double worst_case = 0;
    for (int j = 0; j < T; ++j)
      for (int h = 0; h < n_heads; ++h) {
        const size_t off = (size_t(j) * n_heads + h) * kD;
        const double e = rel(got.data() + off, want.data() + off, kD);
        worst_case = std::max(worst_case, e);
        EXPECT_LT(e, 1e-2) << "len " << len << " T " << T << " token " << j << " head " << h;
      }
    std::printf("  len %5lld T %4d: worst per-head relative error %.2e\n", (long long)len, T, worst_case);
    worst = std::max(worst, worst_case);
  }
  return worst;
}

// Sequences of every tier shape; returns (seq, T) cases covering T = 1 to several tiles.
std::vector<Case> standard_cases(Caches& c) {
  const int e = c.add(), s1 = c.add(), s2 = c.add(), s3 = c.add(), s4 = c.add(), s5 = c.add();
  // inside the sink; sink + part of the ring; ring exactly full (no history); one page; many pages
  c.append({s1, s2, s3, s4, s5}, {30, 100, 320, 400, 3000});
  const int f = c.fork(s5);
  c.append({f, s5}, {17, 5});  // the fork diverges from its parent
  c.sync_device();
  return {{e, 1},  {e, 150}, {s1, 1},  {s1, 40}, {s2, 77}, {s3, 1},   {s3, 64},
          {s4, 3}, {s4, 130}, {f, 1},  {f, 200}, {s5, 65}, {e, 64}};
}

TEST(GpuPrefill, MatchesReferenceGqa4) {
  Caches c(test_geometry(2, 4), 256, 10, false);
  const auto cases = standard_cases(c);
  const double worst = check_prefill(c, cases, 16, 1, 0, 0, true);
  std::printf("prefill, 4 heads per KV head, default plan: worst %.2e\n", worst);
}

TEST(GpuPrefill, MatchesReferenceGqa8EightWarpsSplits) {
  Caches c(test_geometry(1, 2), 256, 10, false);
  const auto cases = standard_cases(c);
  const double worst = check_prefill(c, cases, 16, 0, 3, 8, true);
  std::printf("prefill, 8 heads per KV head, 8 warps, 3 splits: worst %.2e\n", worst);
}

TEST(GpuPrefill, MatchesReferenceGqa5LevelTablesOneSplitNoRotation) {
  Caches c(test_geometry(1, 4), 256, 10, true);
  const auto cases = standard_cases(c);
  const double worst = check_prefill(c, cases, 20, 0, 1, 4, false);
  std::printf("prefill, 5 heads per KV head, level tables, 1 split, identity rotation: worst %.2e\n", worst);
}

TEST(GpuPrefill, ManySplitsAndOddWindows) {
  // Sink and ring not multiples of the 64-token tile; more splits than key tiles.
  KvGeometry g = test_geometry(1, 2);
  g.sink = 16;
  g.recent = 96;
  Caches c(g, 256, 6, false);
  const int a = c.add(), b = c.add();
  c.append({a, b}, {16 + 96, 1000});
  c.sync_device();
  const double worst = check_prefill(c, {{a, 1}, {a, 90}, {b, 33}}, 8, 0, 40, 4, true);
  std::printf("prefill, sink 16 / ring 96, 40 splits: worst %.2e\n", worst);
}

TEST(GpuPrefill, RefusesOutOfScope) {
  KvGeometry g = test_geometry(1, 2);
  g.head_dim = 64;
  g.group = 64;
  EXPECT_THROW(prefill_workspace_bytes(g, 0, 4, PrefillShape{4, 0.1f}), Error);
  g = test_geometry(1, 2);
  g.group = 32;
  EXPECT_THROW(prefill_workspace_bytes(g, 0, 4, PrefillShape{4, 0.1f}), Error);
  g = test_geometry(1, 2);
  EXPECT_THROW(prefill_workspace_bytes(g, 0, 4, PrefillShape{3, 0.1f}), Error);  // 3 heads over 2 KV heads
  EXPECT_THROW(prefill_workspace_bytes(g, 0, 4, PrefillShape{4, 0.1f, 0, 6}), Error);
}

// The Runtime's device pool against its host pool, prefill called inside steps (after
// begin_append, before append) as an engine does; append runs on each pool's own kernels.
TEST(GpuPrefill, RuntimeDeviceMatchesHost) {
  constexpr int kLayers = 2, kHeads = 16, kKv = 4;
  std::mt19937 rng(9);
  Artifact art;
  art.n_layers = kLayers;
  art.n_heads = kHeads;
  art.n_kv_heads = kKv;
  art.head_dim = kD;
  art.recipe.method = "oscar";
  for (int i = 0; i < kLayers * kKv; ++i) {
    HeadArtifact h;
    h.key.rotation = random_orthogonal(1, kD, rng);
    h.value.rotation = random_orthogonal(1, kD, rng);
    h.key.clip_ratio = 0.9;
    h.value.clip_ratio = 0.95;
    art.heads.push_back(h);
  }
  RuntimeOptions o;
  o.max_pages = 64;
  o.max_sequences = 2;
  o.memory = PoolMemory::Host;
  Runtime host(art, EngineShape{kLayers, kHeads, kKv, kD}, o);
  o.memory = PoolMemory::Device;
  Runtime dev(art, EngineShape{kLayers, kHeads, kKv, kD}, o);
  const int a = host.cache().add_sequence(), b = host.cache().add_sequence();
  dev.cache().add_sequence();
  dev.cache().add_sequence();
  double worst = 0;
  for (const std::vector<int>& counts : {std::vector<int>{300, 1}, {150, 700}, {1, 1}}) {
    host.begin_append({a, b}, counts);
    dev.begin_append({a, b}, counts);
    const int rows = counts[0] + counts[1];
    for (int l = 0; l < kLayers; ++l) {
      const auto k = random_rows(size_t(rows) * kKv * kD, rng, true);
      const auto v = random_rows(k.size(), rng, false);
      const auto q = random_rows(size_t(rows) * kHeads * kD, rng, false);
      Dev<float> dq(q), dk(k), dv(v), dout(q.size());
      std::vector<float> want(q.size()), got(q.size());
      size_t qoff = 0, kvoff = 0;
      for (int i = 0; i < 2; ++i) {
        const int seq = i ? b : a, T = counts[size_t(i)];
        host.prefill(l, seq, T, q.data() + qoff, k.data() + kvoff, v.data() + kvoff, want.data() + qoff);
        dev.prefill(l, seq, T, dq.p + qoff, dk.p + kvoff, dv.p + kvoff, dout.p + qoff);
        qoff += size_t(T) * kHeads * kD;
        kvoff += size_t(T) * kKv * kD;
      }
      CUDA_OK(cudaMemcpy(got.data(), dout.p, q.size() * 4, cudaMemcpyDeviceToHost));
      for (size_t row = 0; row < size_t(rows) * kHeads; ++row) {
        const double e = rel(got.data() + row * kD, want.data() + row * kD, kD);
        worst = std::max(worst, e);
        ASSERT_LT(e, 1e-2) << "layer " << l << " row " << row;
      }
      host.append(l, k.data(), v.data());
      dev.append(l, dk.p, dv.p);
      CUDA_OK(cudaDeviceSynchronize());
    }
  }
  // After the step's append of a layer, prefill of that layer for the step is refused.
  dev.begin_append({a}, {4});
  Dev<float> dq(size_t(4) * kHeads * kD), dk(size_t(4) * kKv * kD), dout(size_t(4) * kHeads * kD);
  EXPECT_THROW(dev.prefill(0, a, 5, dq.p, dk.p, dk.p, dout.p), Error);  // not the step's count
  dev.append(0, dk.p, dk.p);
  EXPECT_THROW(dev.prefill(0, a, 4, dq.p, dk.p, dk.p, dout.p), Error);
  CUDA_OK(cudaDeviceSynchronize());
  std::printf("runtime device vs host prefill: worst per-head relative error %.2e\n", worst);
}

}  // namespace
}  // namespace kvcc
