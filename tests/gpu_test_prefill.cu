// GPU tests of the prefill / extend attention kernel (runtime/prefill.cu) against its CPU
// reference prefill_ref (float64) on fresh random caches: empty history, inside the sink, ring
// partly filled, ring exactly full, one page, many pages, a diverged fork; T = 1 up to several
// query and key tiles, and T = 4100; 4, 5 and 8 query heads per KV head; the uniform grid and the
// level table; forced key-range splits. Every output element is written (NaN sentinels), and repeated runs are
// bit-identical. The device pool is the host pool's bytes (append is tested in gpu_test_cache).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "formats/artifact.h"
#include "formats/error.h"
#include "formats/fp16.h"
#include "formats/kv_layout.h"
#include "runtime/append_ref.h"
#include "runtime/attention_ref.h"
#include "runtime/kv_cache.h"
#include "runtime/kv_kernels.h"
#include "runtime/kvcc_runtime.h"
#include "runtime/plan.h"
#include "runtime/served.h"
#include "cache_test_util.h"
#include "gpu_test_util.h"

namespace kvcc {
namespace {

using testing::PoolPair;
using testing::random_orthogonal;
using testing::random_rotations;
using testing::random_rows;
using testing::rel;
using testing::test_geometry;
using testing::transpose_heads;

constexpr int kD = kGpuHeadDim;

// A host cache filled by the reference append, and a device pool holding the same bytes.
struct Caches : PoolPair {
  Caches(const KvGeometry& geo, int64_t pages, int seqs, bool level_tables, const std::vector<BlockWidths>& widths = {})
      : PoolPair(geo, pages, seqs, 4242, widths) {
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

// A layer's rotations on the device as prefill_int2 takes them, or none (every pointer null).
struct DeviceRotations {
  DeviceBuffer<float> rk_, rvt_;        // R_k (queries), R_vᵀ (outputs)
  DeviceBuffer<RotFragments> fk_, fv_;  // R_k, R_v for the new keys and values
  bool on;
  DeviceRotations(const std::vector<float>& k, const std::vector<float>& v, int n_kv)
      : rk_(k),
        rvt_(v.empty() ? v : transpose_heads(v, n_kv, kD)),
        fk_(testing::device_fragments(k.empty() ? nullptr : k.data(), size_t(n_kv))),
        fv_(testing::device_fragments(v.empty() ? nullptr : v.data(), size_t(n_kv))),
        on(!k.empty()) {}
  const float* k() const { return on ? rk_.data() : nullptr; }
  const float* vt() const { return on ? rvt_.data() : nullptr; }
  const RotFragments* fixed_k() const { return on ? fk_.data() : nullptr; }
  const RotFragments* fixed_v() const { return on ? fv_.data() : nullptr; }
};

// One GPU prefill of `cases` as one ragged batch (their inputs one after another): NaN sentinels
// in the output and the workspace, run twice; every element written, the runs bit-identical.
std::vector<float> run_batch(Caches& c, const std::vector<Case>& cases,
                             const std::vector<const std::vector<float>*>& in, const PrefillShape& shape, int layer,
                             const DeviceRotations& rot) {
  const KvGeometry& g = c.g;
  std::vector<float> q, k, v;
  for (size_t i = 0; i < cases.size(); ++i) {
    q.insert(q.end(), in[3 * i]->begin(), in[3 * i]->end());
    k.insert(k.end(), in[3 * i + 1]->begin(), in[3 * i + 1]->end());
    v.insert(v.end(), in[3 * i + 2]->begin(), in[3 * i + 2]->end());
  }
  std::vector<DeviceBuffer<int32_t>> tables;
  std::vector<PrefillSequence> seqs;
  for (const Case& cs : cases) {
    const int64_t len = c.host.length(cs.seq);
    const auto& pt = c.dev.page_table(cs.seq);
    tables.emplace_back(std::vector<int32_t>(pt.begin(), pt.begin() + history_pages(g, len)));
    seqs.push_back({cs.seq, len, tables.back().data(), cs.T});
  }
  DeviceBuffer<float> dq(q), dk(k), dv(v), dout(q.size());
  const size_t wsb = prefill_workspace_bytes(g, seqs, shape);
  DeviceBuffer<uint8_t> ws(wsb);
  const HeadCodec* cod = c.codecs.data() + size_t(layer) * g.n_kv_heads;
  const LayerBlocks blocks = c.dev.layout().layer_blocks(layer);  // (a 2-bit pool's: the default's)
  std::vector<float> got(q.size()), again(q.size());
  for (int rep = 0; rep < 2; ++rep) {
    EXPECT_EQ(cudaMemset(dout.data(), 0xff, q.size() * 4), cudaSuccess);  // NaN sentinels
    EXPECT_EQ(cudaMemset(ws.data(), 0xff, wsb), cudaSuccess);
    prefill_int2(g, c.dev.pages_base(), c.dev.windows_base(), layer, seqs, cod, shape, dq.data(), dk.data(), dv.data(),
                 rot.k(), rot.vt(), rot.fixed_k(), rot.fixed_v(), dout.data(), ws.data(), wsb, nullptr,
                 Activations::Float32, &blocks);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(rep ? again.data() : got.data(), dout.data(), q.size() * 4, cudaMemcpyDeviceToHost),
              cudaSuccess);
  }
  size_t unwritten = 0;
  for (float x : got) unwritten += !std::isfinite(x);
  EXPECT_EQ(unwritten, 0u) << cases.size() << " sequences: outputs not written";
  EXPECT_EQ(std::memcmp(got.data(), again.data(), got.size() * 4), 0) << "repeated runs differ";
  return got;
}

// Prefill of every case on the GPU against prefill_ref, each case alone and then all of them
// (repeated `ragged_copies` times, with fresh inputs, so a batch can span several launches) as one
// ragged batch; returns the worst per-head error. With `bitwise` (splits and warps given, and every
// case's splits giving the same merge as the batch's) the batch equals the single launches bit for
// bit: each sequence's CTAs do the same work wherever they sit in the grid.
double check_prefill(Caches& c, const std::vector<Case>& cases, int n_heads, int layer, int splits, int warps,
                     bool rotate, int ragged_copies = 1, bool bitwise = false, int ctas_per_sm = 0) {
  const KvGeometry& g = c.g;
  std::mt19937 rng(17 + n_heads + splits);
  std::vector<float> rk, rv;
  if (rotate) {
    rk = random_rotations(g.n_kv_heads, kD, rng);
    rv = random_rotations(g.n_kv_heads, kD, rng);
  }
  const DeviceRotations rot(rk, rv, g.n_kv_heads);
  const float scale = 1.0f / std::sqrt(float(kD));
  const HeadCodec* cod = c.codecs.data() + size_t(layer) * g.n_kv_heads;
  const PrefillShape shape{n_heads, scale, splits, warps, ctas_per_sm};
  std::vector<Case> all;
  for (int copy = 0; copy < ragged_copies; ++copy) all.insert(all.end(), cases.begin(), cases.end());
  // Inputs and the reference of every entry of `all` (the first cases.size() are the single runs').
  std::vector<std::vector<float>> in, want;
  for (const Case& cs : all) {
    const int T = cs.T;
    auto q = random_rows(size_t(T) * n_heads * kD, rng, false);
    for (auto& x : q) x *= 3.0f;
    auto k = random_rows(size_t(T) * g.n_kv_heads * kD, rng, true);
    auto v = random_rows(k.size(), rng, false);
    want.emplace_back(q.size());
    in.push_back(std::move(q));
    in.push_back(std::move(k));
    in.push_back(std::move(v));
  }
  // The references on every core (they took most of a run: 64 s of the 78-sequence test on one).
  std::atomic<size_t> next{0};
  std::vector<std::thread> pool(std::max(1u, std::min(16u, std::thread::hardware_concurrency())));
  for (std::thread& th : pool)
    th = std::thread([&] {
      for (size_t i; (i = next++) < all.size();)
        prefill_ref(c.host, layer, all[i].seq, all[i].T, in[3 * i].data(), in[3 * i + 1].data(), in[3 * i + 2].data(),
                    n_heads, rotate ? rk.data() : nullptr, rotate ? rv.data() : nullptr, cod, scale, want[i].data());
    });
  for (std::thread& th : pool) th.join();
  auto inputs = [&in](size_t first, size_t n) {
    std::vector<const std::vector<float>*> p;
    for (size_t i = 3 * first; i < 3 * (first + n); ++i) p.push_back(&in[i]);
    return p;
  };
  // Worst per-head error of entries [first, first + n) of `all` in `got` (their outputs in order).
  auto compare = [&](const std::vector<float>& got, size_t first, size_t n, const char* how) {
    double worst = 0;
    size_t off = 0;
    for (size_t i = first; i < first + n; ++i) {
      const Case& cs = all[i];
      for (int row = 0; row < cs.T * n_heads; ++row) {
        const double e = rel(got.data() + off + size_t(row) * kD, want[i].data() + size_t(row) * kD, kD);
        worst = std::max(worst, e);
        EXPECT_LT(e, 1e-2) << how << ": len " << c.host.length(cs.seq) << " T " << cs.T << " row " << row;
      }
      off += want[i].size();
    }
    return worst;
  };
  double worst = 0;
  std::vector<float> singles;
  for (size_t i = 0; i < cases.size(); ++i) {
    const std::vector<float> got = run_batch(c, {cases[i]}, inputs(i, 1), shape, layer, rot);
    const double e = compare(got, i, 1, "alone");
    std::printf("  len %5lld T %4d: worst per-head relative error %.2e\n", (long long)c.host.length(cases[i].seq),
                cases[i].T, e);
    worst = std::max(worst, e);
    singles.insert(singles.end(), got.begin(), got.end());
  }
  const std::vector<float> batch = run_batch(c, all, inputs(0, all.size()), shape, layer, rot);
  const double e = compare(batch, 0, all.size(), "ragged batch");
  std::printf("  ragged batch of %zu sequences: worst per-head relative error %.2e\n", all.size(), e);
  if (bitwise)
    EXPECT_EQ(std::memcmp(batch.data(), singles.data(), singles.size() * 4), 0)
        << "the batch's first sequences differ from the same sequences alone";
  return std::max(worst, e);
}

// Sequences of every tier shape; returns (seq, T) cases covering T = 1 to several tiles.
std::vector<Case> standard_cases(Caches& c) {
  const int e = c.add(), s1 = c.add(), s2 = c.add(), s3 = c.add(), s4 = c.add(), s5 = c.add();
  // inside the sink; sink + part of the ring; ring exactly full (no history); one page; many pages
  c.append({s1, s2, s3, s4, s5}, {30, 100, 320, 400, 3000});
  const int f = c.fork(s5);
  c.append({f, s5}, {17, 5});  // the fork diverges from its parent
  c.sync_device();
  return {{e, 1},  {e, 150},  {s1, 1}, {s1, 40}, {s2, 77}, {s3, 1}, {s3, 64},
          {s4, 3}, {s4, 130}, {f, 1},  {f, 200}, {s5, 65}, {e, 64}};
}

TEST(GpuPrefill, MatchesReferenceGqa4) {
  Caches c(test_geometry(2, 4), 256, 10, false);
  const auto cases = standard_cases(c);
  // 6 copies: 78 sequences, two launches.
  const double worst = check_prefill(c, cases, 16, 1, 0, 0, true, 6);
  std::printf("prefill, 4 heads per KV head, default plan: worst %.2e\n", worst);
}

// One-token extends of every tier shape, 78 at 2 query heads a KV head: 156 query rows, so the
// first launch's input staging rotates every sequence's queries while the keys, values and windows
// of the last 14 go in a second launch; bit for bit against each sequence alone (2 splits each).
TEST(GpuPrefill, ManyOneTokenExtendsInTwoLaunches) {
  Caches c(test_geometry(1, 2), 256, 10, false);
  std::vector<Case> cases;
  for (const Case& cs : standard_cases(c)) cases.push_back({cs.seq, 1});
  const double worst = check_prefill(c, cases, 4, 0, 2, 4, true, 6, true);
  std::printf("prefill, 78 one-token extends, 2 heads per KV head: worst %.2e\n", worst);
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
  const double worst = check_prefill(c, cases, 20, 0, 1, 4, false, 6, true);
  std::printf("prefill, 5 heads per KV head, level tables, 1 split, identity rotation: worst %.2e\n", worst);
}

// The 4-warp build at two CTAs an SM (half the K/V stages, the registers split between the roles)
// against the reference, and bit for bit against the one-CTA build: the same MMAs and sums in the
// same order, whatever the stages.
TEST(GpuPrefill, TwoCtasAnSmMatchReferenceAndOneCtaBitForBit) {
  Caches c(test_geometry(2, 4), 256, 10, false);
  const auto cases = standard_cases(c);
  const double worst = check_prefill(c, cases, 16, 1, 3, 4, true, 6, true, 2);
  std::printf("prefill, two CTAs an SM, 3 splits: worst %.2e\n", worst);
  std::mt19937 rng(29);
  const KvGeometry& g = c.g;
  const std::vector<float> rk = random_rotations(g.n_kv_heads, kD, rng), rv = random_rotations(g.n_kv_heads, kD, rng);
  const DeviceRotations rot(rk, rv, g.n_kv_heads);
  std::vector<std::vector<float>> in;
  for (const Case& cs : cases) {
    in.push_back(random_rows(size_t(cs.T) * 16 * kD, rng, false));
    in.push_back(random_rows(size_t(cs.T) * g.n_kv_heads * kD, rng, true));
    in.push_back(random_rows(size_t(cs.T) * g.n_kv_heads * kD, rng, false));
  }
  std::vector<const std::vector<float>*> ptrs;
  for (const auto& x : in) ptrs.push_back(&x);
  for (int splits : {1, 3, 40}) {
    const float scale = 1.0f / std::sqrt(float(kD));
    const PrefillShape one{16, scale, splits, 4, 1}, two{16, scale, splits, 4, 2};
    const std::vector<float> a = run_batch(c, cases, ptrs, one, 1, rot);
    const std::vector<float> b = run_batch(c, cases, ptrs, two, 1, rot);
    ASSERT_EQ(a.size(), b.size());
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * 4), 0) << splits << " splits: the two builds differ";
  }
}

// Per-channel key pages (one group per page): the producer expands the keys to the values they
// decode to; the default plan (a ragged batch over two launches) and 8 warps with 3 splits.
TEST(GpuPrefill, PerChannelKeyPagesMatchReference) {
  KvGeometry g = test_geometry(2, 4);
  g.key_group_tokens = g.page_tokens, g.key_pair_bytes = 2;
  Caches c(g, 256, 10, false);
  const auto cases = standard_cases(c);
  const double worst =
      std::max(check_prefill(c, cases, 16, 1, 0, 0, true, 6), check_prefill(c, cases, 32, 0, 3, 8, true));
  std::printf("prefill, per-channel key pages: worst %.2e\n", worst);
}

// Code widths (compile --bits-budget's pages), one width pair a layer: layer 0 keys 1 bit (the
// 1-bit plane alone) and values 3 (2-bit plane + 1-bit plane), layer 1 the reverse, layer 2 keys
// 4 bits (two 2-bit planes) and values 2, layer 3 the reverse; per-token and per-channel keys.
// Pages written by the reference append, copied to the device; a 4 / 4 block has one raw buffer.
void widths_prefill_check(bool chan) {
  KvGeometry g = test_geometry(4, 4);
  if (chan) g.key_group_tokens = g.page_tokens, g.key_pair_bytes = 2;
  const BlockWidths per_layer[4] = {{1, 3}, {3, 1}, {4, 2}, {2, 4}};
  std::vector<BlockWidths> widths;
  for (int l = 0; l < g.n_layers; ++l)
    for (int h = 0; h < g.n_kv_heads; ++h) widths.push_back(per_layer[l]);
  Caches c(g, 256, 10, false, widths);
  const auto cases = standard_cases(c);
  double worst = 0;
  for (int l = 0; l < g.n_layers; ++l) {
    const double e = check_prefill(c, cases, 16, l, 0, 0, true, l == 0 ? 6 : 1);
    std::printf("prefill%s, widths %d/%d: worst %.2e\n", chan ? " (per-channel keys)" : "", per_layer[l].key,
                per_layer[l].value, e);
    worst = std::max(worst, e);
  }
  // A 4 / 4 layer: one raw buffer, each page copied while none is expanded.
  std::vector<BlockWidths> wide(size_t(g.n_layers) * g.n_kv_heads, BlockWidths{4, 4});
  Caches c4(g, 256, 10, false, wide);
  const auto cases4 = standard_cases(c4);
  worst = std::max(worst, check_prefill(c4, cases4, 32, 1, 3, 8, true));
  std::printf("prefill%s, code widths: worst %.2e\n", chan ? " (per-channel keys)" : "", worst);
}
TEST(GpuPrefill, CodeWidthsMatchReference) { widths_prefill_check(false); }
TEST(GpuPrefill, CodeWidthsPerChannelKeysMatchReference) { widths_prefill_check(true); }

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

TEST(GpuPrefill, LongExtendMatchesReference) {
  // T = 4100 new tokens (64 query tiles of 8 warps, the last one partial) over 1000 cached ones,
  // the default plan (its own splits and warps).
  Caches c(test_geometry(1, 1), 128, 2, false);
  const int a = c.add();
  c.append({a}, {1000});
  c.sync_device();
  const double worst = check_prefill(c, {{a, 4100}}, 4, 0, 0, 0, true);
  std::printf("prefill, T = 4100 over 1000 tokens: worst %.2e\n", worst);
}

// A stored value against the exact (double) one: `bits` mantissa bits (fp16 10, bf16 7, fp32 23).
struct Tally {
  size_t n = 0, nearest = 0;
  double worst = 0;  // the largest error over its bound
  void add(double got, double exact, double magnitude, int bits, int min_exp) {
    // Half a step of the format at the exact value, plus fp32's accumulation: 48 accumulating MMAs
    // of split terms (8 k-steps, 6 products), each within 2^-22 of its operands' magnitudes.
    const double half_step = std::ldexp(0.5, std::max(std::ilogb(exact), min_exp) - bits);
    worst = std::max(worst, std::fabs(got - exact) / (half_step + std::ldexp(magnitude, -16)));
    ++n;
  }
};

// The rotations, read where the call leaves them. The staged new keys and values (rotate_kv) are
// exactly what the append puts in the ring: append_ref.h's rotate_kv_row (formats/kv_rotation.h's
// exact fixed-point sums, rounded to bf16). The staged queries (fp16) and the output (the merged rows left in
// split 0's partials, times R_vᵀ) come from the tensor cores' split-term rotation (rotate): each
// within its Tally bound of the exact value, and at least 98% of the queries the exact value's
// nearest (the truncating sums cross a rounding boundary rarely); a bf16-accurate rotation (R as
// one bf16 term) misses by ~2^-12·Σ|x_c·R_c|, 16x the bound's accumulation term. fp32
// activations (split into three terms) and bf16 ones; 4 query heads per KV head; 300 tokens
// (rotate_kv: four whole 64-row tiles and a partial one) and 40 (one partial tile).
void rotations_accuracy(int kT) {
  const KvGeometry g = test_geometry(1, 2);
  constexpr int kHeads = 8;
  const int n_kv = g.n_kv_heads, r = kHeads / n_kv;
  std::mt19937 rng(5);
  const auto rk = random_rotations(n_kv, kD, rng), rv = random_rotations(n_kv, kD, rng);
  const auto rvt = transpose_heads(rv, n_kv, kD);
  const DeviceRotations rot(rk, rv, n_kv);
  Caches c(g, 16, 2, false);
  const int s = c.add();
  c.sync_device();
  const std::vector<PrefillSequence> seqs{{s, 0, nullptr, kT}};
  const PrefillShape shape{kHeads, 1.0f / std::sqrt(float(kD)), 1, 8};
  const PrefillPlan plan = plan_prefill(PrefillGpu{}, g, {0}, {kT}, kHeads, 1, 8);
  const PrefillWorkspace lay = prefill_workspace(g, plan, kHeads);
  const PrefillSeqPlan& sp = plan.seqs[0];
  const size_t wsb = prefill_workspace_bytes(g, seqs, shape);
  ASSERT_EQ(wsb, lay.bytes);
  DeviceBuffer<uint8_t> ws(wsb);
  for (const Activations act : {Activations::Float32, Activations::BFloat16}) {
    const bool bf16 = act == Activations::BFloat16;
    // Inputs as the kernels see them: bf16 activations are bf16 values.
    auto values = [&](size_t n) {
      std::vector<float> x = random_rows(n, rng, false);
      if (bf16)
        for (float& e : x) e = float_from_bf16(bf16_from_float(e));
      return x;
    };
    const auto q = values(size_t(kT) * kHeads * kD), k = values(size_t(kT) * n_kv * kD), v = values(k.size());
    auto device = [&](const std::vector<float>& x) {
      std::vector<uint16_t> b(x.size());
      for (size_t i = 0; i < x.size(); ++i) b[i] = bf16_from_float(x[i]);
      return bf16 ? DeviceBuffer<uint8_t>(std::vector<uint8_t>(reinterpret_cast<const uint8_t*>(b.data()),
                                                               reinterpret_cast<const uint8_t*>(b.data() + b.size())))
                  : DeviceBuffer<uint8_t>(std::vector<uint8_t>(reinterpret_cast<const uint8_t*>(x.data()),
                                                               reinterpret_cast<const uint8_t*>(x.data() + x.size())));
    };
    const auto dq = device(q), dk = device(k), dv = device(v);
    DeviceBuffer<uint8_t> dout(q.size() * (bf16 ? 2 : 4));
    CUDA_OK(cudaMemset(ws.data(), 0xff, wsb));
    prefill_int2(g, c.dev.pages_base(), c.dev.windows_base(), 0, seqs, c.codecs.data(), shape, dq.data(), dk.data(),
                 dv.data(), rot.k(), rot.vt(), rot.fixed_k(), rot.fixed_v(), dout.data(), ws.data(), wsb, nullptr, act);
    CUDA_OK(cudaDeviceSynchronize());
    const std::vector<uint8_t> w = ws.download(), o = dout.download();
    auto f16_at = [&w](size_t off, size_t i) {
      uint16_t u;
      std::memcpy(&u, w.data() + off + 2 * i, 2);
      return double(float_from_f16(u));
    };
    auto f32_at = [](const std::vector<uint8_t>& b, size_t off, size_t i) {
      float f;
      std::memcpy(&f, b.data() + off + 4 * i, 4);
      return double(f);
    };
    // Σ_c x_c·R[c][n] and Σ_c |x_c·R[c][n]| of one row.
    auto rotate = [](const float* x, const float* R, int n, double& magnitude) {
      double y = 0;
      magnitude = 0;
      for (int ci = 0; ci < kD; ++ci) {
        y += double(x[ci]) * R[size_t(ci) * kD + n];
        magnitude += std::fabs(double(x[ci]) * R[size_t(ci) * kD + n]);
      }
      return y;
    };
    Tally staged, out;
    size_t kv_differ = 0, kv_n = 0;
    std::vector<FixedRotation> fixed_k, fixed_v;
    for (int h = 0; h < n_kv; ++h) {
      fixed_k.push_back(fixed_rotation(&rk[size_t(h) * kD * kD], kD));
      fixed_v.push_back(fixed_rotation(&rv[size_t(h) * kD * kD], kD));
    }
    for (int h = 0; h < n_kv; ++h)
      for (int t = 0; t < kT; ++t)
        for (int n = 0; n < kD; ++n) {
          double m;
          for (int a = 0; a < r; ++a) {  // q: fp16
            const size_t p = size_t(t) * r + a;
            const double y = rotate(&q[(size_t(t) * kHeads + h * r + a) * kD], &rk[size_t(h) * kD * kD], n, m);
            const double got = f16_at(lay.q, (h * size_t(plan.tokens) * r + p) * kD + n);
            staged.add(got, y, m, 10, -14);
            staged.nearest += got == double(float_from_f16(f16_from_float(float(y))));
          }
          const size_t row = size_t(h) * plan.kv_rows + sp.kv0 + sp.win_rows + t;
          // k, v: the append's rotation (rotate_kv_row: exact fixed-point sums, rounded to bf16,
          // the ring's value), then fp16 as the staging holds every row, a ring row read back
          // included (bf16 -> fp16 loses bits only below fp16's normal range, 2^-14)
          for (int side = 0; side < 2; ++side) {
            const float* x = &(side ? v : k)[(size_t(t) * n_kv + h) * kD];
            std::vector<float> stored(kD);
            rotate_kv_row(x, &(side ? fixed_v : fixed_k)[size_t(h)], kD, stored.data());
            const float ring = stored[size_t(n)];
            const float want = float_from_f16(f16_from_float(ring));
            const float got = float(f16_at(side ? lay.v : lay.k, row * kD + n));
            if (got != want && kv_differ < 4)
              std::printf("  staged %s row %zu channel %d: %.9g, the append's row %.9g (fp16 of it %.9g)\n",
                          side ? "v" : "k", row, n, got, ring, want);
            kv_differ += got != want;
            ++kv_n;
          }
        }
    for (int h = 0; h < n_kv; ++h)
      for (int p = 0; p < sp.rows; ++p) {  // the output: the merged row through R_vᵀ
        std::vector<float> merged(kD);
        for (int ci = 0; ci < kD; ++ci)
          merged[size_t(ci)] = float(f32_at(w, lay.part_o, (size_t(sp.part0) + size_t(h) * sp.rows + p) * kD + ci));
        const int t = p / r, a = p % r;
        for (int n = 0; n < kD; ++n) {
          double m;
          const double y = rotate(merged.data(), &rvt[size_t(h) * kD * kD], n, m);
          const size_t i = (size_t(t) * kHeads + h * r + a) * kD + n;
          uint16_t u;
          std::memcpy(&u, o.data() + 2 * i, 2);
          out.add(bf16 ? double(float_from_bf16(u)) : f32_at(o, 0, i), y, m, bf16 ? 7 : 23, -126);
        }
      }
    std::printf(
        "%s: staged q worst %.3f of the bound, %.4f%% nearest; staged k, v: %zu of %zu differ from the "
        "append's sums; output worst %.3f of the bound\n",
        bf16 ? "bf16" : "fp32", staged.worst, 100.0 * staged.nearest / staged.n, kv_differ, kv_n, out.worst);
    EXPECT_EQ(kv_differ, 0u) << "staged new keys or values differ from what the ring will hold";
    EXPECT_LE(staged.worst, 1.0);
    EXPECT_GE(double(staged.nearest), 0.98 * staged.n);
    EXPECT_LE(out.worst, 1.0);
    EXPECT_EQ(out.n, size_t(kT) * kHeads * kD);
  }
}
TEST(GpuPrefill, RotationsHaveFp32Accuracy) { rotations_accuracy(300); }
TEST(GpuPrefill, RotationsOfFewRowsHaveFp32Accuracy) { rotations_accuracy(40); }

TEST(GpuPrefill, RefusesOutOfScope) {
  KvGeometry g = test_geometry(1, 2);
  g.head_dim = 64;
  g.group = 64;
  const std::vector<PrefillSequence> one{{0, 0, nullptr, 4}};
  EXPECT_THROW(prefill_workspace_bytes(g, one, PrefillShape{4, 0.1f}), Error);
  g = test_geometry(1, 2);
  g.group = 32;
  EXPECT_THROW(prefill_workspace_bytes(g, one, PrefillShape{4, 0.1f}), Error);
  g = test_geometry(1, 2);
  EXPECT_THROW(prefill_workspace_bytes(g, one, PrefillShape{3, 0.1f}), Error);  // 3 heads over 2 KV heads
  EXPECT_THROW(prefill_workspace_bytes(g, one, PrefillShape{4, 0.1f, 0, 6}), Error);
  EXPECT_THROW(prefill_workspace_bytes(g, {{0, 0, nullptr, 4}, {1, 10, nullptr, -1}}, PrefillShape{4, 0.1f}), Error);
}

// The Runtime's device pool against its host pool, prefill called inside steps (after
// begin_append, before append) as an engine does; append runs on each pool's own kernels.
// A device Runtime's prefill (alone and batched) and append against a host Runtime's, layer by
// layer over three steps; `widths`: the two layers' code widths (the artifact's bits).
void runtime_device_matches_host(const std::vector<BlockWidths>& widths) {
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
    h.key.bits = widths[size_t(i / kKv)].key;
    h.value.bits = widths[size_t(i / kKv)].value;
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
      DeviceBuffer<float> dq(q), dk(k), dv(v), dout(q.size());
      std::vector<float> want(q.size()), got(q.size());
      size_t qoff = 0, kvoff = 0;
      for (int i = 0; i < 2; ++i) {
        const int seq = i ? b : a, T = counts[size_t(i)];
        host.prefill(l, seq, T, q.data() + qoff, k.data() + kvoff, v.data() + kvoff, want.data() + qoff);
        dev.prefill(l, seq, T, dq.data() + qoff, dk.data() + kvoff, dv.data() + kvoff, dout.data() + qoff);
        qoff += size_t(T) * kHeads * kD;
        kvoff += size_t(T) * kKv * kD;
      }
      CUDA_OK(cudaMemcpy(got.data(), dout.data(), q.size() * 4, cudaMemcpyDeviceToHost));
      // Both sequences in one call (the ragged batch) on fresh NaN sentinels.
      std::vector<float> got_batch(q.size());
      CUDA_OK(cudaMemset(dout.data(), 0xff, q.size() * 4));
      dev.prefill(l, {a, b}, counts, dq.data(), dk.data(), dv.data(), dout.data());
      CUDA_OK(cudaMemcpy(got_batch.data(), dout.data(), q.size() * 4, cudaMemcpyDeviceToHost));
      for (size_t row = 0; row < size_t(rows) * kHeads; ++row)
        for (const std::vector<float>* g : {&got, &got_batch}) {
          const double e = rel(g->data() + row * kD, want.data() + row * kD, kD);
          worst = std::max(worst, e);
          ASSERT_LT(e, 1e-2) << "layer " << l << " row " << row << (g == &got ? " alone" : " batched");
        }
      host.append(l, k.data(), v.data());
      dev.append(l, dk.data(), dv.data());
      CUDA_OK(cudaDeviceSynchronize());
    }
  }
  // After the step's append of a layer, prefill of that layer for the step is refused.
  dev.begin_append({a}, {4});
  DeviceBuffer<float> dq(size_t(4) * kHeads * kD), dk(size_t(4) * kKv * kD), dout(size_t(4) * kHeads * kD);
  EXPECT_THROW(dev.prefill(0, a, 5, dq.data(), dk.data(), dk.data(), dout.data()), Error);  // not the step's count
  EXPECT_THROW(dev.prefill(0, {a, a}, {4, 4}, dq.data(), dk.data(), dk.data(), dout.data()), Error);  // twice
  EXPECT_THROW(dev.prefill(0, {a, b}, {4}, dq.data(), dk.data(), dk.data(), dout.data()), Error);     // counts
  dev.append(0, dk.data(), dk.data());
  EXPECT_THROW(dev.prefill(0, a, 4, dq.data(), dk.data(), dk.data(), dout.data()), Error);
  CUDA_OK(cudaDeviceSynchronize());
  std::printf("runtime device vs host prefill, widths %d/%d and %d/%d: worst per-head relative error %.2e\n",
              widths[0].key, widths[0].value, widths[1].key, widths[1].value, worst);
}
TEST(GpuPrefill, RuntimeDeviceMatchesHost) { runtime_device_matches_host({{2, 2}, {2, 2}}); }
// compile --bits-budget's artifacts: each layer at its own widths (1 / 3 and 4 / 2 bits).
TEST(GpuPrefill, RuntimeDeviceMatchesHostAtCodeWidths) { runtime_device_matches_host({{1, 3}, {4, 2}}); }

// Every edge of the served-shape table (runtime/served.h) runs on a device Runtime: 8, 1 and 5
// query heads per KV head, windows in 16-token multiples that are not page multiples, no sink.
// Its prefill, append and decode match a host Runtime's; a device Runtime that was made never
// refuses the shape at its first call. The last shape is the mixed recipe's (KIVI keys in
// per-channel pages, rotated per-token values).
TEST(GpuRuntime, ServedShapesRunEveryKernel) {
  struct Shape {
    int n_heads, n_kv, sink, recent;
    bool kivi = false;
  } shapes[] = {{64, 8, 16, 96}, {4, 4, 0, 64}, {20, 4, 48, 80}, {32, 8, 16, 96, true}};
  std::mt19937 rng(21);
  for (const Shape& sh : shapes) {
    Artifact art;
    art.n_layers = 1;
    art.n_heads = sh.n_heads;
    art.n_kv_heads = sh.n_kv;
    art.head_dim = kD;
    art.recipe.method = "oscar";
    art.recipe.sink = sh.sink;
    art.recipe.recent = sh.recent;
    if (sh.kivi) {
      art.recipe.method = "kivi";
      art.recipe.group = kGpuPageTokens;
      art.recipe.params["values"] = "hadamard";
      art.recipe.params["key_params"] = "e5m3";
    }
    for (int i = 0; i < sh.n_kv; ++i) {
      HeadArtifact h;
      if (!sh.kivi) h.key.rotation = random_orthogonal(1, kD, rng);
      h.value.rotation = random_orthogonal(1, kD, rng);
      h.key.clip_ratio = h.value.clip_ratio = 0.95;
      art.heads.push_back(h);
    }
    const EngineShape e{1, sh.n_heads, sh.n_kv, kD};
    RuntimeOptions o;
    o.max_pages = 64;
    o.max_sequences = 1;
    o.memory = PoolMemory::Host;
    Runtime host(art, e, o);
    ASSERT_EQ(device_scope_problem(host.geometry(), sh.n_heads, {}), "");
    ASSERT_EQ(host.geometry().per_channel_keys(), sh.kivi);
    o.memory = PoolMemory::Device;
    Runtime dev(art, e, o);
    const int seq = host.cache().add_sequence();
    ASSERT_EQ(dev.cache().add_sequence(), seq);
    double worst = 0;
    for (int T : {300, 1, 70, 1}) {
      host.begin_append({seq}, {T});
      dev.begin_append({seq}, {T});
      const auto k = random_rows(size_t(T) * sh.n_kv * kD, rng, true);
      const auto v = random_rows(k.size(), rng, false);
      const auto q = random_rows(size_t(T) * sh.n_heads * kD, rng, false);
      DeviceBuffer<float> dq(q), dk(k), dv(v), dout(q.size());
      std::vector<float> want(q.size());
      host.prefill(0, seq, T, q.data(), k.data(), v.data(), want.data());
      dev.prefill(0, seq, T, dq.data(), dk.data(), dv.data(), dout.data());
      host.append(0, k.data(), v.data());
      dev.append(0, dk.data(), dv.data());
      std::vector<float> got = dout.download();
      // Decode of the step's last token's queries over the cache as appended.
      const std::vector<float> qd(q.end() - ptrdiff_t(sh.n_heads) * kD, q.end());
      std::vector<float> want_d(qd.size());
      DeviceBuffer<float> dqd(qd), doutd(qd.size());
      host.decode(0, {seq}, qd.data(), want_d.data());
      dev.decode(0, {seq}, dqd.data(), doutd.data());
      const std::vector<float> got_d = doutd.download();
      got.insert(got.end(), got_d.begin(), got_d.end());
      want.insert(want.end(), want_d.begin(), want_d.end());
      for (size_t row = 0; row < got.size() / kD; ++row) {
        const double err = rel(got.data() + row * kD, want.data() + row * kD, kD);
        worst = std::max(worst, err);
        ASSERT_LT(err, 1e-2) << sh.n_heads << "/" << sh.n_kv << " S " << sh.sink << " W " << sh.recent << " T " << T
                             << " row " << row;
      }
    }
    std::printf("served shape %d/%d, sink %d, ring %d%s: worst per-head relative error %.2e\n", sh.n_heads, sh.n_kv,
                sh.sink, sh.recent, sh.kivi ? ", per-channel keys" : "", worst);
  }
}

// Tensor parallelism on the device pool: ranks of 2 and 4 KV-head slices, each a device Runtime,
// against the whole model's device Runtime on the same steps (the oracle: the same kernels on the
// same heads, so only a different split-K order can differ, well below 1e-5); every rank's prefill
// and decode rows are the whole model's rows of its query heads. The whole device Runtime's pool
// equals the whole host Runtime's byte for byte after every step (both rotate as rotate_kv_row),
// and every rank's rows are within the device-vs-host tolerance of the host Runtime's.
TEST(GpuRuntime, KvHeadSlicesMatchTheWholeDeviceRuntime) {
  const int n_heads = 32, n_kv = 8, group = n_heads / n_kv;
  std::mt19937 rng(33);
  Artifact art;
  art.n_layers = 1;
  art.n_heads = n_heads;
  art.n_kv_heads = n_kv;
  art.head_dim = kD;
  art.recipe.method = "oscar";
  art.recipe.sink = 16;
  art.recipe.recent = 96;
  for (int i = 0; i < n_kv; ++i) {
    HeadArtifact h;
    h.key.rotation = random_orthogonal(1, kD, rng);
    h.value.rotation = random_orthogonal(1, kD, rng);
    h.key.clip_ratio = h.value.clip_ratio = 0.95;
    art.heads.push_back(h);
  }
  const EngineShape e{1, n_heads, n_kv, kD};
  RuntimeOptions o;
  o.max_pages = 64;
  o.max_sequences = 1;
  o.memory = PoolMemory::Host;
  for (int ranks : {2, 4}) {
    Runtime whole(art, e, o);
    RuntimeOptions od = o;
    od.memory = PoolMemory::Device;
    Runtime whole_dev(art, e, od);  // separates the slicing from the device's own rounding
    std::vector<std::unique_ptr<Runtime>> dev;
    for (int r = 0; r < ranks; ++r) {
      RuntimeOptions ro = o;
      ro.memory = PoolMemory::Device;
      const KvHeadRange s = kv_head_slice(n_kv, r, ranks);
      ro.kv_begin = s.begin;
      ro.kv_end = s.end;
      dev.push_back(std::make_unique<Runtime>(art, e, ro));
    }
    const int seq = whole.cache().add_sequence();
    ASSERT_EQ(whole_dev.cache().add_sequence(), seq);
    for (auto& d : dev) ASSERT_EQ(d->cache().add_sequence(), seq);
    // Rows [tokens, heads, kD] -> the heads [h0, h1) of every token.
    auto slice = [](const std::vector<float>& x, int heads, int h0, int h1) {
      const size_t tokens = x.size() / (size_t(heads) * kD);
      std::vector<float> out;
      for (size_t t = 0; t < tokens; ++t)
        out.insert(out.end(), x.begin() + ptrdiff_t((t * heads + h0) * kD),
                   x.begin() + ptrdiff_t((t * heads + h1) * kD));
      return out;
    };
    double worst = 0, worst_dev = 0;
    for (int T : {300, 1, 70, 1}) {
      const auto k = random_rows(size_t(T) * n_kv * kD, rng, true);
      const auto v = random_rows(k.size(), rng, false);
      const auto q = random_rows(size_t(T) * n_heads * kD, rng, false);
      const std::vector<float> qd(q.end() - ptrdiff_t(n_heads) * kD, q.end());
      std::vector<float> want(q.size()), want_d(qd.size());
      whole.begin_append({seq}, {T});
      whole.prefill(0, seq, T, q.data(), k.data(), v.data(), want.data());
      whole.append(0, k.data(), v.data());
      whole.decode(0, {seq}, qd.data(), want_d.data());
      std::vector<float> dev_all, dev_all_d;
      {
        DeviceBuffer<float> dq(q), dk(k), dv(v), dout(q.size()), dqd(qd), doutd(qd.size());
        whole_dev.begin_append({seq}, {T});
        whole_dev.prefill(0, seq, T, dq.data(), dk.data(), dv.data(), dout.data());
        whole_dev.append(0, dk.data(), dv.data());
        whole_dev.decode(0, {seq}, dqd.data(), doutd.data());
        dev_all = dout.download();
        dev_all_d = doutd.download();
      }
      {
        const std::vector<uint8_t> hb(whole.cache().pages_base(),
                                      whole.cache().pages_base() + whole.cache().pool_bytes());
        const std::vector<uint8_t> db = testing::device_pool_bytes(whole_dev.cache());
        ASSERT_EQ(hb.size(), db.size());
        size_t diffs = 0;
        for (size_t i = 0; i < hb.size(); ++i) diffs += hb[i] != db[i];
        EXPECT_EQ(diffs, 0u) << ranks << " ranks, T " << T << ": device and host pools differ";
      }
      for (int r = 0; r < ranks; ++r) {
        Runtime& d = *dev[size_t(r)];
        const int kb = d.kv_begin(), ke = d.kv_end();
        DeviceBuffer<float> dq(slice(q, n_heads, kb * group, ke * group)), dk(slice(k, n_kv, kb, ke)),
            dv(slice(v, n_kv, kb, ke)), dout(size_t(T) * (ke - kb) * group * kD);
        DeviceBuffer<float> dqd(slice(qd, n_heads, kb * group, ke * group)), doutd(size_t(ke - kb) * group * kD);
        d.begin_append({seq}, {T});
        d.prefill(0, seq, T, dq.data(), dk.data(), dv.data(), dout.data());
        d.append(0, dk.data(), dv.data());
        d.decode(0, {seq}, dqd.data(), doutd.data());
        std::vector<float> got = dout.download(), expect = slice(want, n_heads, kb * group, ke * group);
        const std::vector<float> got_d = doutd.download(), expect_d = slice(want_d, n_heads, kb * group, ke * group);
        std::vector<float> same = slice(dev_all, n_heads, kb * group, ke * group);
        const std::vector<float> same_d = slice(dev_all_d, n_heads, kb * group, ke * group);
        got.insert(got.end(), got_d.begin(), got_d.end());
        expect.insert(expect.end(), expect_d.begin(), expect_d.end());
        same.insert(same.end(), same_d.begin(), same_d.end());
        ASSERT_EQ(got.size(), expect.size());
        for (size_t row = 0; row < got.size() / kD; ++row) {
          const double err = rel(got.data() + row * kD, expect.data() + row * kD, kD);
          const double err_dev = rel(got.data() + row * kD, same.data() + row * kD, kD);
          const double dev_host = rel(same.data() + row * kD, expect.data() + row * kD, kD);
          worst = std::max(worst, err);
          worst_dev = std::max(worst_dev, err_dev);
          EXPECT_LT(err_dev, 1e-5) << ranks << " ranks, rank " << r << ", T " << T << ", row " << row
                                   << "; vs the whole host runtime: " << err << " (device vs host " << dev_host << ")";
          EXPECT_LT(err, 1e-2) << ranks << " ranks, rank " << r << ", T " << T << ", row " << row;
        }
      }
    }
    std::printf(
        "%d device ranks: worst per-head relative error %.2e vs the whole host runtime, %.2e vs the whole device "
        "runtime\n",
        ranks, worst, worst_dev);
  }
}

}  // namespace
}  // namespace kvcc
