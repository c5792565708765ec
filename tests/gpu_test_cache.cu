// GPU tests: every CUDA kernel of the cache against its CPU reference on fresh random inputs.
// Append: the device pool must equal the host pool byte for byte (same operations on both; both
// rotate as append_ref.h's rotate_kv_row). Decode: within bf16 tolerance of the
// float64 reference, every output written (NaN sentinels), identical bits on a repeated run.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "formats/error.h"
#include "formats/fp16.h"
#include "formats/kv_layout.h"
#include "runtime/append_ref.h"
#include "runtime/attention_ref.h"
#include "runtime/kv_cache.h"
#include "runtime/rotate_kv.cuh"
#include "runtime/cuda_util.cuh"
#include "runtime/kv_kernels.h"
#include "runtime/served.h"
#include "cache_test_util.h"
#include "gpu_test_util.h"

namespace kvcc {
namespace {

using testing::PoolPair;
using testing::random_rotations;
using testing::random_rows;
using testing::rel;
using testing::test_geometry;
using testing::transpose_heads;

// The same cache operations on a host pool (CPU reference) and a device pool (CUDA kernels).
struct Twin : PoolPair {
  DeviceBuffer<uint8_t> ws;  // append's workspace, grown as needed

  std::vector<float> rk, rv;  // [layers, H, d, d] when the appends rotate (with_rotations)
  float key_scale = 1.0f;     // the appended keys' scale (small: pages of small key scales)

  Twin(const KvGeometry& geo, int64_t pages, int seqs, const std::vector<BlockWidths>& widths = {})
      : PoolPair(geo, pages, seqs, 777, widths) {}
  void with_rotations() {
    rk = random_rotations(g.n_layers * g.n_kv_heads, g.head_dim, rng);
    rv = random_rotations(g.n_layers * g.n_kv_heads, g.head_dim, rng);
  }
  // Appends random rows to every layer (rotated by rk / rv, or taken as rotated already).
  void append(const std::vector<int>& seqs, const std::vector<int>& counts) {
    const std::vector<int64_t> old = grow(seqs, counts);
    AppendBatch batch = make_append_batch(seqs, old, counts);
    AppendPlanHost plan{seqs, old, counts, batch.row_offsets, {}};
    for (int s : seqs) plan.page_tables.push_back(dev.page_table(s));
    int64_t rows = 0;
    for (int c : counts) rows += c;
    const size_t need = append_workspace_bytes(g, rows, rows + int64_t(seqs.size()) * g.recent);
    ws.reserve(need);
    for (int l = 0; l < g.n_layers; ++l) {
      auto k = random_rows(size_t(rows) * g.n_kv_heads * g.head_dim, rng, true);
      for (float& x : k) x *= key_scale;
      const auto v = random_rows(k.size(), rng, false);
      const HeadCodec* cod = codecs.data() + size_t(l) * g.n_kv_heads;
      const size_t dd = size_t(g.n_kv_heads) * g.head_dim * g.head_dim;
      const float* lrk = rk.empty() ? nullptr : rk.data() + size_t(l) * dd;
      const float* lrv = rv.empty() ? nullptr : rv.data() + size_t(l) * dd;
      append_ref(host, l, batch, k.data(), v.data(), lrk, lrv, cod);
      DeviceBuffer<float> dk(k), dv(v);
      const DeviceBuffer<RotFragments> fk = testing::device_fragments(lrk, g.n_kv_heads),
                                       fv = testing::device_fragments(lrv, g.n_kv_heads);
      // The layer's blocks as the pool places them (for a 2-bit pool, the default's).
      const LayerBlocks blocks = dev.layout().layer_blocks(l);
      append_kv(g, dev.pages_base(), dev.windows_base(), l, plan, cod, dk.data(), dv.data(), fk.data(), fv.data(),
                ws.data(), ws.bytes(), nullptr, Activations::Float32, &blocks);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    }
  }
  // Head i (of codecs) codes its values on a level table.
  void value_table(size_t i) {
    codecs[i].value.use_table = 1;
    const float lv[4] = {-1.5104f, -0.4528f, 0.4528f, 1.5104f};
    std::copy(lv, lv + 4, codecs[i].value.levels);
  }
  // Appends that cross every tier boundary (inside the sink, sink exact, history already; crosses
  // the sink, ring exactly full + 1, one step; a fork diverges, a long prefill; decode steps and
  // their flushes), then the pools compared byte for byte.
  void standard_appends() {
    const int a = add(), b = add(), c = add();
    append({a, b, c}, {1, 63, 400});
    append({a, b, c}, {100, 257, 1});
    const int f = fork(c);
    append({f, c, a}, {64, 3, 700});
    for (int step = 0; step < 70; ++step) append({a, b, f}, {1, 1, 1});
    expect_pools_equal();
  }
  void expect_pools_equal() {
    std::vector<uint8_t> d(dev.pool_bytes());
    ASSERT_EQ(cudaMemcpy(d.data(), dev.pages_base(), d.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    const uint8_t* h = host.pages_base();
    size_t diffs = 0, first = 0;
    for (size_t i = 0; i < d.size(); ++i)
      if (d[i] != h[i] && diffs++ == 0) first = i;
    EXPECT_EQ(diffs, 0u) << "first differing byte " << first << " of " << d.size();
  }
};

void pool_bytes_check(bool rotations) {
  Twin w(test_geometry(2, 2), 64, 6);
  if (rotations) w.with_rotations();
  // Half the heads on the level table (append supports it on the GPU).
  for (size_t i = 0; i < w.codecs.size(); i += 2) w.value_table(i);
  w.standard_appends();
}
TEST(GpuAppend, DevicePoolEqualsHostReferenceBytes) { pool_bytes_check(false); }
TEST(GpuAppend, DevicePoolEqualsHostReferenceBytesWithRotations) { pool_bytes_check(true); }

// Per-channel key pages (KIVI's keys, one group per page): quantize_key_pages writes the bytes
// page_row_codec.cpp's quantize_page_side writes, for pages filled from new rows (a long prefill),
// from the old ring (decode steps) and from both, with the value side beside them unchanged.
void per_channel_bytes_check(bool rotations) {
  KvGeometry g = test_geometry(2, 2);
  g.key_group_tokens = g.page_tokens, g.key_pair_bytes = 2;
  Twin w(g, 64, 6);
  if (rotations) w.with_rotations();
  for (size_t i = 0; i < w.codecs.size(); i += 2) w.value_table(i);  // level-table values beside per-channel keys
  w.standard_appends();
}
TEST(GpuAppend, PerChannelKeyPagesEqualHostReferenceBytes) { per_channel_bytes_check(false); }
TEST(GpuAppend, PerChannelKeyPagesEqualHostReferenceBytesWithRotations) { per_channel_bytes_check(true); }

// The code-width tests' cache: 16 layers, 2 KV heads, per-token or per-channel (chan) keys; and its
// widths, every key and value width pair of 1-4 bits once (layer l: 1 + l / 4 and 1 + l % 4, both
// KV heads alike).
KvGeometry widths_geometry(bool chan) {
  KvGeometry g = test_geometry(16, 2);
  if (chan) g.key_group_tokens = g.page_tokens, g.key_pair_bytes = 2;
  return g;
}
std::vector<BlockWidths> every_width_pair(const KvGeometry& g) {
  std::vector<BlockWidths> widths;
  for (int l = 0; l < g.n_layers; ++l)
    for (int h = 0; h < g.n_kv_heads; ++h) widths.push_back({1 + l / 4, 1 + l % 4});
  return widths;
}

// Code widths (compile --bits-budget's pages): every_width_pair's 16 layers, per-token or
// per-channel keys, the standard appends: the device pool equals the host's byte for byte (quantize_row's and
// quantize_key_pages' bit planes, the blocks where PageLayout puts them). Level-table values on
// head 0 of the layers whose values are 2 bits.
void widths_bytes_check(bool chan, bool rotations) {
  const KvGeometry g = widths_geometry(chan);
  const std::vector<BlockWidths> widths = every_width_pair(g);
  Twin w(g, 64, 6, widths);
  if (rotations) w.with_rotations();
  for (int l = 0; l < g.n_layers; ++l)
    if (widths[size_t(l) * 2].value == 2) w.value_table(size_t(l) * 2);
  w.standard_appends();
}
TEST(GpuAppend, CodeWidthsEqualHostReferenceBytes) { widths_bytes_check(false, false); }
TEST(GpuAppend, CodeWidthsEqualHostReferenceBytesWithRotations) { widths_bytes_check(false, true); }
TEST(GpuAppend, CodeWidthsPerChannelKeysEqualHostReferenceBytesWithRotations) { widths_bytes_check(true, true); }

TEST(GpuAppend, RotationMatchesReference) {
  // 9000 rows: more tiles than the append launches blocks for, so each block takes several (its
  // columns of R loaded once) and the ring's rows come from the later tiles.
  constexpr int kRows = 9000;
  KvGeometry g = test_geometry(1, 2);
  const int64_t pages = (kRows - g.sink) / g.page_tokens + 1;
  KvCache host(KvCacheConfig{g, pages, 1, PoolMemory::Host}), dev(KvCacheConfig{g, pages, 1, PoolMemory::Device});
  std::mt19937 rng(5);
  auto rk = random_rotations(2, 128, rng), rv = random_rotations(2, 128, rng);
  std::vector<HeadCodec> codecs(2);
  const int s = host.add_sequence();
  dev.add_sequence();
  host.grow(s, kRows);
  dev.grow(s, kRows);
  std::normal_distribution<float> nd;
  std::vector<float> k(size_t(kRows) * 2 * 128), v(k.size());
  for (auto& x : k) x = nd(rng);
  for (auto& x : v) x = nd(rng);
  append_ref(host, 0, make_append_batch({s}, {0}, {kRows}), k.data(), v.data(), rk.data(), rv.data(), codecs.data());
  const auto& pt = dev.page_table(s);
  AppendPlanHost plan{{s}, {0}, {kRows}, {0}, {std::vector<int32_t>(pt.begin(), pt.end())}};
  const size_t wsb = append_workspace_bytes(g, kRows, kRows);
  DeviceBuffer<uint8_t> ws(wsb);
  DeviceBuffer<float> dk(k), dv(v);
  const DeviceBuffer<RotFragments> fk = testing::device_fragments(rk.data(), 2),
                                   fv = testing::device_fragments(rv.data(), 2);
  append_kv(g, dev.pages_base(), dev.windows_base(), 0, plan, codecs.data(), dk.data(), dv.data(), fk.data(), fv.data(),
            ws.data(), wsb, nullptr);
  // Both rotate as rotate_kv_row: the pools (windows and pages) hold the same bytes.
  std::vector<uint8_t> d(dev.pool_bytes());
  CUDA_OK(cudaMemcpy(d.data(), dev.pages_base(), d.size(), cudaMemcpyDeviceToHost));
  size_t diffs = 0;
  for (size_t i = 0; i < d.size(); ++i) diffs += d[i] != host.pages_base()[i];
  EXPECT_EQ(diffs, 0u) << "of " << d.size() << " bytes";
}

// A batch's per-sequence arrays on the host (DeviceBatch's fields).
struct BatchColumns {
  std::vector<int32_t> slot, len, off, table;
  int max_pages = 0;
};
// The batch of `seqs` of a cache: their slots, lengths and page tables.
BatchColumns columns_of(const KvCache& cache, const std::vector<int>& seqs) {
  BatchColumns c;
  for (int s : seqs) {
    c.slot.push_back(s);
    c.len.push_back(int32_t(cache.length(s)));
    c.off.push_back(int32_t(c.table.size()));
    const auto& pt = cache.page_table(s);
    c.table.insert(c.table.end(), pt.begin(), pt.end());
    c.max_pages = std::max(c.max_pages, int(pt.size()));
  }
  return c;
}
// A DeviceBatch over device copies of the columns.
struct DevBatch {
  DeviceBuffer<int32_t> slot, len, off, table;
  DeviceBatch b;
  explicit DevBatch(const BatchColumns& c) : slot(c.slot), len(c.len), off(c.off), table(c.table) {
    b.batch = int(c.slot.size());
    b.seq_slot = slot.data();
    b.seq_len = len.data();
    b.page_offset = off.data();
    b.page_table = table.data();
    b.max_pages = c.max_pages;
  }
};

// ring: the INT2 kernel build (DecodeShape::ring; 0 = the plan's choice). table: level tables on
// both sides of half the heads (asymmetric, so the table is not an affine map of the code).
// repeat: the batch lists the 7 sequences that many times (each entry with its own query): 2
// gives 56 (sequence, KV head) pairs, which the per-group merge takes (merge_splits_group).
// chan: per-channel key pages (one group per page) with uniform values. key_scale: keys that
// scale, and queries by its inverse (the same logits; the pages' key scales that small).
void run_decode_check(int n_heads, int target_ctas, int ring = 0, bool table = false, int repeat = 1, bool chan = false,
                      float key_scale = 1.0f) {
  KvGeometry geo = test_geometry(2, 4);
  if (chan) geo.key_group_tokens = geo.page_tokens, geo.key_pair_bytes = 2;
  Twin w(geo, 256, 10);
  w.key_scale = key_scale;
  if (table)
    for (size_t i = 0; i < w.codecs.size(); i += 2) {
      const float lk[4] = {-1.62f, -0.41f, 0.37f, 1.71f}, lv[4] = {-1.48f, -0.52f, 0.44f, 1.55f};
      w.codecs[i].key.use_table = w.codecs[i].value.use_table = 1;
      std::copy(lk, lk + 4, w.codecs[i].key.levels);
      std::copy(lv, lv + 4, w.codecs[i].value.levels);
    }
  const int e = w.add(), s1 = w.add(), s2 = w.add(), s3 = w.add(), s4 = w.add(), s5 = w.add();
  // Lengths: empty, inside the sink, ring exactly full (no history), one page, long, a fork.
  w.append({s1, s2, s3, s4, s5}, {30, 320, 321, 1000, 4000});
  const int f = w.fork(s5);
  w.append({f, s5}, {17, 5});
  std::vector<int> seqs;
  for (int i = 0; i < repeat; ++i) seqs.insert(seqs.end(), {s4, e, s1, s2, s3, s5, f});
  const KvGeometry& g = w.g;
  std::mt19937 rng(99 + n_heads);
  auto rk = random_rotations(g.n_kv_heads, 128, rng), rv = random_rotations(g.n_kv_heads, 128, rng);
  auto rvt = transpose_heads(rv, g.n_kv_heads, 128);
  std::normal_distribution<float> nd;
  std::vector<float> q(seqs.size() * n_heads * 128);
  for (auto& x : q) x = 3.0f * nd(rng) / key_scale;
  const float scale = 1.0f / std::sqrt(128.0f);
  const int layer = 1;
  const HeadCodec* cod = w.codecs.data() + size_t(layer) * g.n_kv_heads;
  std::vector<float> want(q.size());
  decode_ref(w.host, layer, seqs, q.data(), n_heads, rk.data(), rv.data(), cod, scale, want.data());

  DevBatch db(columns_of(w.dev, seqs));
  DecodeShape shape{n_heads, scale, target_ctas};
  shape.ring = ring;
  const size_t wsb = decode_workspace_bytes(g, int(seqs.size()), n_heads, db.b.max_pages, 0, target_ctas, ring);
  DeviceBuffer<uint8_t> ws(wsb);
  DeviceBuffer<float> dq(q), drk(rk), drvt(rvt), dout(q.size());
  std::vector<float> got(q.size()), again(q.size());
  for (int rep = 0; rep < 2; ++rep) {
    CUDA_OK(cudaMemset(dout.data(), 0xff, q.size() * 4));  // NaN sentinels
    CUDA_OK(cudaMemset(ws.data(), 0xff, wsb));
    decode_int2(g, w.dev.pages_base(), w.dev.windows_base(), layer, db.b, cod, shape, dq.data(), drk.data(),
                drvt.data(), dout.data(), ws.data(), wsb, nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaMemcpy(rep ? again.data() : got.data(), dout.data(), q.size() * 4, cudaMemcpyDeviceToHost));
  }
  for (size_t i = 0; i < got.size(); ++i) ASSERT_TRUE(std::isfinite(got[i])) << "output " << i << " not written";
  EXPECT_EQ(std::memcmp(got.data(), again.data(), got.size() * 4), 0) << "repeated runs differ";
  double worst = 0;
  for (size_t b = 0; b < seqs.size(); ++b)
    for (int h = 0; h < n_heads; ++h) {
      const size_t off = (b * n_heads + h) * 128;
      if (w.host.length(seqs[b]) == 0) {
        for (int c = 0; c < 128; ++c) EXPECT_EQ(got[off + c], 0.0f);
        continue;
      }
      const double e = rel(got.data() + off, want.data() + off, 128);
      worst = std::max(worst, e);
      EXPECT_LT(e, 1e-2) << "seq " << seqs[b] << " len " << w.host.length(seqs[b]) << " head " << h;
    }
  std::printf("decode int2%s: %d heads, worst per-head relative error %.2e\n", chan ? " (per-channel keys)" : "",
              n_heads, worst);
}

TEST(GpuDecode, Int2MatchesReferenceGqa4) { run_decode_check(16, 0); }
TEST(GpuDecode, Int2MatchesReferenceGqa8ManySplits) { run_decode_check(32, 4000); }
TEST(GpuDecode, Int2MatchesReferenceGqa5OneSplit) { run_decode_check(20, 1); }
TEST(GpuDecode, Int2MatchesReferenceWideRing) { run_decode_check(20, 64, 2); }
TEST(GpuDecode, Int2LevelTableMatchesReference) { run_decode_check(16, 0, 0, true); }
TEST(GpuDecode, Int2LevelTableMatchesReferenceWideRing) { run_decode_check(20, 64, 2, true); }
// The default plan of these few short splits is the 2-stage ring; the 3-stage one, forced:
TEST(GpuDecode, Int2MatchesReferenceDeepRing) { run_decode_check(16, 0, 3); }
TEST(GpuDecode, Int2LevelTableMatchesReferenceDeepRing) { run_decode_check(16, 0, 3, true); }
// (1000 CTAs: 19 splits per pair, more than one round of the merge's loads.)
TEST(GpuDecode, Int2MatchesReferenceManyPairs) { run_decode_check(16, 1000, 0, false, 2); }
TEST(GpuDecode, Int2LevelTableMatchesReferenceManyPairs) { run_decode_check(20, 0, 0, true, 2); }
// Per-channel key pages: the query scaled per page by the keys' channel scales (fp16 MMAs).
TEST(GpuDecode, Int2PerChannelKeysMatchReferenceGqa4) { run_decode_check(16, 0, 0, false, 1, true); }
TEST(GpuDecode, Int2PerChannelKeysMatchReferenceGqa8ManySplits) { run_decode_check(32, 4000, 0, false, 1, true); }
// Keys 2^10 smaller (channel scales near 2^-10), queries 2^10 larger: the query fragments times the
// page's scales must keep fp16's precision (a fragment scaled by a fixed power of two instead of
// the page's largest scale falls into the subnormals here).
TEST(GpuDecode, Int2PerChannelKeysSmallScalesMatchReference) {
  run_decode_check(16, 0, 0, false, 1, true, 1.0f / 1024.0f);
}
TEST(GpuDecode, Int2PerChannelKeysMatchReferenceGqa5OneSplit) { run_decode_check(20, 1, 0, false, 1, true); }
TEST(GpuDecode, Int2PerChannelKeysMatchReferenceManyPairs) { run_decode_check(16, 1000, 0, false, 2, true); }
TEST(GpuDecode, Int2PerChannelKeysMatchReferenceWideRing) { run_decode_check(20, 64, 2, false, 1, true); }
TEST(GpuDecode, Int2PerChannelKeysMatchReferenceDeepRing) { run_decode_check(16, 0, 3, false, 1, true); }

// Code widths (compile --bits-budget's pages): a host pool at every_width_pair's widths, written by
// the CPU reference's append and copied to the device; each layer decoded by its width build (the
// page stride that of the whole mixed page, not the 2-bit layout's) against decode_ref on the
// host pool, outputs all written, repeated runs identical. ring: as run_decode_check's.
void run_widths_decode_check(bool chan, int ring) {
  const KvGeometry g = widths_geometry(chan);
  const std::vector<BlockWidths> widths = every_width_pair(g);
  KvCache host(KvCacheConfig{g, 160, 6, PoolMemory::Host, widths});
  std::mt19937 rng(4242 + 10 * chan + ring);
  std::uniform_real_distribution<float> ur(0.3f, 1.0f);
  std::vector<HeadCodec> codecs(size_t(g.n_layers) * g.n_kv_heads);
  for (auto& c : codecs) {
    c.key.clip_ratio = ur(rng);
    c.value.clip_ratio = ur(rng);
  }
  const int e = host.add_sequence(), s1 = host.add_sequence(), s2 = host.add_sequence(), s3 = host.add_sequence(),
            s4 = host.add_sequence();
  auto append = [&](const std::vector<int>& seqs, const std::vector<int>& counts) {
    std::vector<int64_t> old, add;
    for (size_t i = 0; i < seqs.size(); ++i) {
      old.push_back(host.length(seqs[i]));
      add.push_back(counts[i]);
    }
    host.grow_batch(seqs, add);
    const AppendBatch batch = make_append_batch(seqs, old, counts);
    int64_t rows = 0;
    for (int c : counts) rows += c;
    for (int l = 0; l < g.n_layers; ++l) {
      const auto k = random_rows(size_t(rows) * g.n_kv_heads * g.head_dim, rng, true);
      const auto v = random_rows(k.size(), rng, false);
      append_ref(host, l, batch, k.data(), v.data(), nullptr, nullptr, codecs.data() + size_t(l) * g.n_kv_heads);
    }
  };
  // Lengths: empty, inside the sink, one page of history, long, and a fork of the long one.
  append({s1, s2, s3, s4}, {30, 321, 1000, 2600});
  const int f = host.fork(s4);
  append({f, s4}, {17, 5});
  const std::vector<int> seqs = {s3, e, s1, s2, s4, f};
  DeviceBuffer<uint8_t> pool(host.pool_bytes());
  CUDA_OK(cudaMemcpy(pool.data(), host.pages_base(), host.pool_bytes(), cudaMemcpyHostToDevice));
  const uint8_t* pages = pool.data();
  const uint16_t* windows = reinterpret_cast<const uint16_t*>(
      pool.data() + (reinterpret_cast<const uint8_t*>(host.windows_base()) - host.pages_base()));
  const int n_heads = 8;
  const float scale = 1.0f / std::sqrt(128.0f);
  auto rk = random_rotations(g.n_kv_heads, 128, rng), rv = random_rotations(g.n_kv_heads, 128, rng);
  auto rvt = transpose_heads(rv, g.n_kv_heads, 128);
  DevBatch db(columns_of(host, seqs));
  DecodeShape shape{n_heads, scale, 0};
  shape.ring = ring;
  const size_t wsb = decode_workspace_bytes(g, int(seqs.size()), n_heads, db.b.max_pages, 0, 0, ring);
  DeviceBuffer<uint8_t> ws(wsb);
  DeviceBuffer<float> drk(rk), drvt(rvt);
  std::normal_distribution<float> nd;
  for (int layer = 0; layer < g.n_layers; ++layer) {
    const BlockWidths w = host.layout().widths(layer, 0);
    const LayerBlocks blocks = host.layout().layer_blocks(layer);
    std::vector<float> q(seqs.size() * n_heads * 128);
    for (auto& x : q) x = 3.0f * nd(rng);
    const HeadCodec* cod = codecs.data() + size_t(layer) * g.n_kv_heads;
    std::vector<float> want(q.size());
    decode_ref(host, layer, seqs, q.data(), n_heads, rk.data(), rv.data(), cod, scale, want.data());
    DeviceBuffer<float> dq(q), dout(q.size());
    std::vector<float> got(q.size()), again(q.size());
    for (int rep = 0; rep < 2; ++rep) {
      CUDA_OK(cudaMemset(dout.data(), 0xff, q.size() * 4));  // NaN sentinels
      CUDA_OK(cudaMemset(ws.data(), 0xff, wsb));
      decode_int2(g, pages, windows, layer, db.b, cod, shape, dq.data(), drk.data(), drvt.data(), dout.data(),
                  ws.data(), wsb, nullptr, Activations::Float32, &blocks);
      CUDA_OK(cudaDeviceSynchronize());
      CUDA_OK(cudaMemcpy(rep ? again.data() : got.data(), dout.data(), q.size() * 4, cudaMemcpyDeviceToHost));
    }
    for (size_t i = 0; i < got.size(); ++i)
      ASSERT_TRUE(std::isfinite(got[i])) << "widths " << w.key << "/" << w.value << ": output " << i << " not written";
    EXPECT_EQ(std::memcmp(got.data(), again.data(), got.size() * 4), 0) << "repeated runs differ";
    double worst = 0;
    for (size_t b = 0; b < seqs.size(); ++b)
      for (int h = 0; h < n_heads; ++h) {
        const size_t off = (b * n_heads + h) * 128;
        if (host.length(seqs[b]) == 0) {
          for (int c = 0; c < 128; ++c) EXPECT_EQ(got[off + c], 0.0f);
          continue;
        }
        const double err = rel(got.data() + off, want.data() + off, 128);
        worst = std::max(worst, err);
        EXPECT_LT(err, 1e-2) << "widths " << w.key << "/" << w.value << " seq " << seqs[b] << " head " << h;
      }
    std::printf("decode int2%s, widths %d/%d: worst per-head relative error %.2e\n", chan ? " (per-channel keys)" : "",
                w.key, w.value, worst);
  }
}

TEST(GpuDecode, CodeWidthsMatchReference) { run_widths_decode_check(false, 0); }
TEST(GpuDecode, CodeWidthsMatchReferenceWideRing) { run_widths_decode_check(false, 2); }
TEST(GpuDecode, CodeWidthsMatchReferenceDeepRing) { run_widths_decode_check(false, 3); }
TEST(GpuDecode, CodeWidthsPerChannelKeysMatchReferenceWideRing) { run_widths_decode_check(true, 2); }
TEST(GpuDecode, CodeWidthsPerChannelKeysMatchReferenceDeepRing) { run_widths_decode_check(true, 3); }

TEST(GpuDecode, Bf16PagedMatchesFloat64) {
  const int H = 2, n_heads = 10, P = 64, d = 128;
  const std::vector<int> lens = {1, 64, 65, 1000, 3001};
  std::mt19937 rng(31);
  std::normal_distribution<float> nd;
  BatchColumns cols;
  std::vector<int32_t>& table = cols.table;
  const std::vector<int32_t>& off = cols.off;
  int npages = 0;
  for (int L : lens) {
    cols.off.push_back(int32_t(table.size()));
    cols.len.push_back(L);
    cols.slot.push_back(0);
    const int p = (L + P - 1) / P;
    cols.max_pages = std::max(cols.max_pages, p);
    for (int i = 0; i < p; ++i) table.push_back(npages + p - 1 - i);  // pages out of order
    npages += p;
  }
  std::vector<uint16_t> pages(size_t(npages) * H * 2 * P * d);
  for (auto& x : pages) x = bf16_from_float(nd(rng));
  std::vector<float> q(lens.size() * n_heads * d), want(q.size());
  for (auto& x : q) x = 2.0f * nd(rng);
  const double scale = 1.0 / std::sqrt(128.0);
  for (size_t b = 0; b < lens.size(); ++b)
    for (int qh = 0; qh < n_heads; ++qh) {
      const int h = qh / (n_heads / H);
      const float* qq = q.data() + (b * n_heads + qh) * d;
      std::vector<double> s(static_cast<size_t>(lens[b]));
      double mx = -1e300;
      for (int t = 0; t < lens[b]; ++t) {
        const uint16_t* kr = pages.data() + ((size_t(table[size_t(off[b] + t / P)]) * H + h) * 2 * P + t % P) * d;
        double acc = 0;
        for (int c = 0; c < d; ++c) acc += double(qq[c]) * float_from_bf16(kr[c]);
        s[size_t(t)] = acc * scale;
        mx = std::max(mx, s[size_t(t)]);
      }
      std::vector<double> o(d, 0.0);
      double l = 0;
      for (int t = 0; t < lens[b]; ++t) {
        const double p = std::exp(s[size_t(t)] - mx);
        l += p;
        const uint16_t* vr = pages.data() + ((size_t(table[size_t(off[b] + t / P)]) * H + h) * 2 * P + P + t % P) * d;
        for (int c = 0; c < d; ++c) o[size_t(c)] += p * float_from_bf16(vr[c]);
      }
      for (int c = 0; c < d; ++c) want[(b * n_heads + qh) * d + c] = float(o[size_t(c)] / l);
    }
  const DevBatch db(cols);
  KvGeometry g = test_geometry(1, H);
  const size_t wsb = decode_workspace_bytes(g, db.b.batch, n_heads, cols.max_pages, P);
  DeviceBuffer<uint8_t> ws(wsb);
  DeviceBuffer<uint16_t> dpages(pages);
  DeviceBuffer<float> dq(q), dout(q.size());
  CUDA_OK(cudaMemset(dout.data(), 0xff, q.size() * 4));
  decode_bf16_paged(H, d, P, dpages.data(), db.b, DecodeShape{n_heads, float(scale), 0}, dq.data(), nullptr, nullptr,
                    dout.data(), ws.data(), wsb, nullptr);
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<float> got(q.size());
  CUDA_OK(cudaMemcpy(got.data(), dout.data(), q.size() * 4, cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < got.size(); ++i) ASSERT_TRUE(std::isfinite(got[i])) << i;
  for (size_t b = 0; b < lens.size(); ++b)
    for (int qh = 0; qh < n_heads; ++qh) {
      const size_t o = (b * n_heads + qh) * d;
      EXPECT_LT(rel(got.data() + o, want.data() + o, d), 1e-2) << "len " << lens[b] << " head " << qh;
    }
}

// The fp16 conversions on the device (formats/fp16.h: the conversion unit for finite values and
// inf, the software path for NaN) give the host's bits: every half to float, and to half the
// floats around every half's rounding boundaries (the midpoint to the next half and its float
// neighbours: ties to even, subnormals, the overflow edge), NaNs with payloads and a random spread.
__global__ void fp16_conversions(const float* f, uint16_t* h, int n, uint32_t* back) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) h[i] = f16_from_float(f[i]);
  if (i < 65536) back[i] = f32_bits(float_from_f16(uint16_t(i)));
}
TEST(GpuFormats, Fp16ConversionsMatchHostBits) {
  std::vector<float> f;
  for (uint32_t h = 0; h < 0x7c00u; ++h) {
    const uint32_t sign = (h & 1u) << 31;  // (both signs over the halves)
    const float a = float_from_f16(uint16_t(h)), b = float_from_f16(uint16_t(h + 1));
    const uint32_t mid = f32_bits(0.5f * (a + b)) | sign;  // exact: a and b are within float's range
    for (uint32_t m : {mid - 1, mid, mid + 1}) f.push_back(f32_from_bits(m));
    f.push_back(f32_from_bits(f32_bits(a) | sign));
  }
  for (uint32_t x : {0x7f800000u, 0xff800000u, 0x7fc00000u, 0x7f800001u, 0xffc12345u, 0x7fbfffffu, 0x477fefffu,
                     0x477ff000u, 0x33000000u, 0x33000001u, 0x32ffffffu})
    f.push_back(f32_from_bits(x));
  std::mt19937 rng(7);
  for (int i = 0; i < 200000; ++i) f.push_back(f32_from_bits(uint32_t(rng())));
  const int n = int(f.size());
  DeviceBuffer<float> df(f);
  DeviceBuffer<uint16_t> dh(f.size());
  DeviceBuffer<uint32_t> dback(65536);
  CUDA_OK(cudaMemset(dh.data(), 0xff, f.size() * 2));
  fp16_conversions<<<(std::max(n, 65536) + 255) / 256, 256>>>(df.data(), dh.data(), n, dback.data());
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<uint16_t> h(f.size());
  std::vector<uint32_t> back(65536);
  CUDA_OK(cudaMemcpy(h.data(), dh.data(), h.size() * 2, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(back.data(), dback.data(), back.size() * 4, cudaMemcpyDeviceToHost));
  int wrong = 0;
  for (int i = 0; i < n; ++i)
    if (h[i] != f16_from_float(f[i]) && ++wrong <= 5)
      ADD_FAILURE() << "f16_from_float(0x" << std::hex << f32_bits(f[i]) << "): device 0x" << h[i] << ", host 0x"
                    << f16_from_float(f[i]);
  for (uint32_t i = 0; i < 65536; ++i)
    if (back[i] != f32_bits(float_from_f16(uint16_t(i))) && ++wrong <= 10)
      ADD_FAILURE() << "float_from_f16(0x" << std::hex << i << "): device 0x" << back[i] << ", host 0x"
                    << f32_bits(float_from_f16(uint16_t(i)));
  EXPECT_EQ(wrong, 0);
}

// The rotations' rounding on the device (rotate_kv.cuh's rot_bf16_fast: a double and one cvt.rn)
// gives the host's rot_bf16 bits (integer rounding) for the sums and shifts the rotations make
// (|t| < 2^45, shifts of two float exponents less 36): around every bf16 rounding boundary at
// results from below the subnormals to past the largest bf16 (ties both ways, one off each side,
// long runs of ones that carry into the exponent), zero, and a random spread.
__global__ void rot_bf16_conversions(const int64_t* t, const int* shift, uint16_t* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = rot_bf16_fast(t[i], shift[i]);
}
TEST(GpuFormats, RotationRoundingMatchesHostBits) {
  std::vector<int64_t> t;
  std::vector<int> sh;
  auto add = [&](int64_t v, int s) {
    for (int64_t x : {v, -v}) {
      t.push_back(x);
      sh.push_back(s);
    }
  };
  for (int lead = 0; lead <= 44; lead += 4)  // t's leading bit
    for (int e = -140; e <= 130; ++e) {      // the result's exponent (bf16 subnormals below -126)
      const int s = e - lead;
      if (s < -332 || s > 220) continue;
      const int64_t top = int64_t(1) << lead;
      add(top, s);
      add(2 * top - 1, s);  // all ones: rounds up into the next exponent
      // Rounding boundaries `cut` bits below the top of a value with some bits below its top.
      const int64_t body = top | (int64_t(0x5a5a5a5a5a5a) & (top - 1));
      for (int cut = 1; cut <= lead; ++cut) {
        const int64_t half = int64_t(1) << (cut - 1), kept = body >> cut << cut;
        for (int64_t d : {half - 1, half, half + 1}) add(kept + d, s);
        add((kept ^ (int64_t(1) << cut)) + half, s);  // the tie with the other last kept bit
      }
    }
  add(0, -300);
  add(0, 100);
  std::mt19937_64 rng(11);
  for (int i = 0; i < 200000; ++i) add(int64_t(rng() >> (19 + rng() % 45)), int(rng() % 553) - 332);
  const int n = int(t.size());
  DeviceBuffer<int64_t> dt(t);
  DeviceBuffer<int> ds(sh);
  DeviceBuffer<uint16_t> dout(t.size());
  CUDA_OK(cudaMemset(dout.data(), 0xff, t.size() * 2));
  rot_bf16_conversions<<<(n + 255) / 256, 256>>>(dt.data(), ds.data(), dout.data(), n);
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<uint16_t> out(t.size());
  CUDA_OK(cudaMemcpy(out.data(), dout.data(), out.size() * 2, cudaMemcpyDeviceToHost));
  int wrong = 0;
  for (int i = 0; i < n; ++i)
    if (out[i] != rot_bf16(t[i], sh[i]) && ++wrong <= 8)
      ADD_FAILURE() << "rot_bf16(" << t[i] << ", " << sh[i] << "): device 0x" << std::hex << out[i] << ", host 0x"
                    << rot_bf16(t[i], sh[i]);
  EXPECT_EQ(wrong, 0) << "of " << n;
}

// The launchers ask the same table as the Runtime (runtime/served.h) and name what they refuse;
// this GPU is the one they are built for.
TEST(GpuServed, LaunchersRefuseWhatTheTableRefuses) {
  ASSERT_NO_THROW(require_hopper());
  auto message = [](auto&& call) -> std::string {
    try {
      call();
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  KvGeometry g = test_geometry(1, 2);
  g.sink = 4;
  ASSERT_FALSE(gpu_unsupported_reason(g, 8, kGpuDecode).empty());
  std::vector<HeadCodec> codecs(2);
  const std::string decode = message([&] {
    decode_int2(g, nullptr, nullptr, 0, DeviceBatch{}, codecs.data(), DecodeShape{8, 0.1f}, nullptr, nullptr, nullptr,
                nullptr, nullptr, 0, nullptr);
  });
  EXPECT_NE(decode.find("sink 4"), std::string::npos) << decode;
  EXPECT_EQ(gpu_unsupported_reason(g, 8, kGpuPrefill), "");  // prefill serves any windows
  g = test_geometry(1, 2);
  const std::string heads = message([&] {
    decode_int2(g, nullptr, nullptr, 0, DeviceBatch{}, codecs.data(), DecodeShape{18, 0.1f}, nullptr, nullptr, nullptr,
                nullptr, nullptr, 0, nullptr);
  });
  EXPECT_NE(heads.find("9 query heads per KV head"), std::string::npos) << heads;
  // Per-channel key pages: decode takes them with uniform values only.
  g.key_group_tokens = g.page_tokens, g.key_pair_bytes = 2;
  codecs[1].value.use_table = 1;
  const std::string chan_table = message([&] {
    decode_int2(g, nullptr, nullptr, 0, DeviceBatch{}, codecs.data(), DecodeShape{8, 0.1f}, nullptr, nullptr, nullptr,
                nullptr, nullptr, 0, nullptr);
  });
  EXPECT_NE(chan_table.find("level-table values"), std::string::npos) << chan_table;
  codecs[1].value.use_table = 0;
  g.key_group_tokens = 32;
  EXPECT_NE(gpu_unsupported_reason(g, 8, kGpuAppend).find("groups of 32 tokens"), std::string::npos);
  g.key_group_tokens = 0;
  g.group = 32;
  const std::string append = message([&] {
    append_kv(g, nullptr, nullptr, 0, AppendPlanHost{}, codecs.data(), nullptr, nullptr, nullptr, nullptr, nullptr, 0,
              nullptr);
  });
  EXPECT_NE(append.find("group 32"), std::string::npos) << append;
  g = test_geometry(1, 72);
  const std::string prefill = message([&] {
    prefill_workspace_bytes(g, {{0, 0, nullptr, 4}}, PrefillShape{72, 0.1f});
  });
  EXPECT_NE(prefill.find("72 KV heads"), std::string::npos) << prefill;
}

}  // namespace
}  // namespace kvcc
