// Token eviction with page compaction on a device pool (runtime/compact.cu) against the CPU
// reference (runtime/compact_ref.cpp): the same appends into a host and a device pool, the same
// evictions (every kind of row move: copies, BF16 rows quantised into pages, INT2 rows
// dequantised into the windows), then the pools byte for byte. The bookkeeping is shared, so the
// page tables are the same; the bytes must be too (append's quantiser writes the rows entering
// history on both paths, and dequantisation is codec_scalar.h's on both).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "formats/kv_layout.h"
#include "runtime/append_ref.h"
#include "runtime/compact.h"
#include "runtime/compact_ref.h"
#include "runtime/device_buffer.h"
#include "runtime/kv_cache.h"
#include "runtime/kv_kernels.h"
#include "runtime/plan.h"
#include "cache_test_util.h"
#include "gpu_test_util.h"

namespace kvcc {
namespace {

using testing::PoolPair;
using testing::random_rows;
using testing::test_geometry;

struct Twin : PoolPair {
  DeviceBuffer<uint8_t> ws;
  DeviceBuffer<HeadCodec> dcodecs;
  Twin(const KvGeometry& geo, int64_t pages, int seqs) : PoolPair(geo, pages, seqs, 4242) {
    // Half the heads' values on the level table (the dequantisation's other branch).
    for (size_t i = 0; i < codecs.size(); i += 2) {
      codecs[i].value.use_table = 1;
      const float lv[4] = {-1.5104f, -0.4528f, 0.4528f, 1.5104f};
      std::copy(lv, lv + 4, codecs[i].value.levels);
    }
    dcodecs = DeviceBuffer<HeadCodec>(codecs);
  }
  void append(int seq, int count) {
    const std::vector<int64_t> old = grow({seq}, {count});
    const AppendBatch batch = make_append_batch({seq}, old, {count});
    AppendPlanHost plan{{seq}, old, {count}, batch.row_offsets, {dev.page_table(seq)}};
    ws.reserve(append_workspace_bytes(g, count, count + g.recent));
    for (int l = 0; l < g.n_layers; ++l) {
      const auto k = random_rows(size_t(count) * g.n_kv_heads * g.head_dim, rng, true);
      const auto v = random_rows(k.size(), rng, false);
      const HeadCodec* cod = codecs.data() + size_t(l) * g.n_kv_heads;
      append_ref(host, l, batch, k.data(), v.data(), nullptr, nullptr, cod);
      DeviceBuffer<float> dk(k), dv(v);
      append_kv(g, dev.pages_base(), dev.windows_base(), l, plan, cod, dk.data(), dv.data(), nullptr, nullptr,
                ws.data(), ws.bytes(), nullptr);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    }
  }
  // Page bytes of every live sequence's pages and its window rows in use.
  void expect_same(const std::vector<int>& seqs) {
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<uint8_t> d(dev.pool_bytes());
    ASSERT_EQ(cudaMemcpy(d.data(), dev.pages_base(), d.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    const uint8_t* h = host.pages_base();
    for (int s : seqs) {
      ASSERT_EQ(host.length(s), dev.length(s));
      ASSERT_EQ(host.page_table(s), dev.page_table(s));
      for (int32_t p : host.page_table(s)) {
        const size_t off = g.page_block_offset(p, 0, 0);
        ASSERT_EQ(std::memcmp(d.data() + off, h + off, g.page_bytes()), 0) << "sequence " << s << " page " << p;
      }
      const KvTiers t = tiers_of(g, host.length(s));
      const size_t win = size_t(g.page_bytes()) * size_t(host.config().max_pages), dd = size_t(g.head_dim);
      for (int l = 0; l < g.n_layers; ++l)
        for (int hh = 0; hh < g.n_kv_heads; ++hh) {
          const size_t blk = win + g.window_block_elem(s, l, hh) * 2;
          std::vector<size_t> rows;
          for (int r = 0; r < t.sink_count; ++r) {
            rows.push_back(g.k_sink_elem() + r * dd);
            rows.push_back(g.v_sink_elem() + r * dd);
          }
          for (int64_t i = t.hist_tokens; i < t.hist_tokens + t.ring_count; ++i) {
            rows.push_back(g.k_ring_elem() + size_t(ring_slot(g, i)) * dd);
            rows.push_back(g.v_ring_elem() + size_t(ring_slot(g, i)) * dd);
          }
          for (size_t r : rows)
            ASSERT_EQ(std::memcmp(d.data() + blk + r * 2, h + blk + r * 2, dd * 2), 0)
                << "sequence " << s << " layer " << l << " head " << hh << " window elem " << r;
        }
    }
  }
};

std::vector<int64_t> random_keep(int64_t n, int64_t m, std::mt19937& rng) {
  std::vector<int64_t> all(static_cast<size_t>(n));
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(size_t(m));
  std::sort(all.begin(), all.end());
  return all;
}

TEST(GpuCompaction, DevicePoolEqualsHostReferenceBytes) {
  const KvGeometry g = test_geometry(2, 2);  // d 128, P 64, S 64, W 256
  Twin w(g, 64, 4);
  const int a = w.add();
  w.append(a, 64 + 256 + 64 * 10 + 17);
  w.append(a, 100);
  const int b = w.fork(a);  // shares a's pages: a's compaction must take fresh ones
  w.expect_same({a, b});
  std::mt19937 rng(19);
  const int64_t n = w.host.length(a);
  const std::vector<int64_t> half = random_keep(n, n / 2, rng);
  const int64_t rh = compact_ref(w.host, a, half, w.codecs.data());
  const int64_t rd = compact_device(w.dev, a, half, w.dcodecs.data(), w.ws, nullptr);
  EXPECT_EQ(rh, rd);
  w.expect_same({a, b});
  w.append(a, 300);  // rows that left history go back in
  w.expect_same({a, b});
  // 90% of b's tokens, b alone holding most of its pages now.
  const std::vector<int64_t> tenth = random_keep(n, n / 10, rng);
  EXPECT_EQ(compact_ref(w.host, b, tenth, w.codecs.data()),
            compact_device(w.dev, b, tenth, w.dcodecs.data(), w.ws, nullptr));
  w.expect_same({a, b});
  EXPECT_EQ(w.host.pages_in_use(), w.dev.pages_in_use());
}

// Staging one layer at a time (the chunked path a long sequence takes) and all layers at once
// move the same bytes, over five layers and every kind of move: 50 sink rows, 20 history rows and
// the whole ring kept, so 14 history rows are dequantised into the sink and 58 ring rows are
// quantised into the one new history page.
TEST(GpuCompaction, LayerChunksEqualHostReferenceBytes) {
  const KvGeometry g = test_geometry(5, 2);
  for (const size_t stage : {size_t(1), kCompactStageBytes}) {
    Twin w(g, 64, 2);
    const int a = w.add();
    w.append(a, 64 + 7 * 64 + 256);
    std::mt19937 rng(23);
    std::vector<int64_t> kept(50);
    std::iota(kept.begin(), kept.end(), 0);
    for (int64_t t : random_keep(7 * 64, 20, rng)) kept.push_back(64 + t);
    for (int64_t t = 64 + 7 * 64; t < w.host.length(a); ++t) kept.push_back(t);
    int kinds[2][2] = {};  // [from a page][to a page]
    for (const CompactRowMove& m : w.dev.plan_compaction(a, kept).moves)
      ++kinds[m.src_page != kCompactWindow][m.dst_page != kCompactWindow];
    ASSERT_TRUE(kinds[0][0] > 0 && kinds[0][1] > 0 && kinds[1][0] > 0 && kinds[1][1] > 0)
        << kinds[0][0] << " " << kinds[0][1] << " " << kinds[1][0] << " " << kinds[1][1];
    EXPECT_EQ(compact_ref(w.host, a, kept, w.codecs.data()),
              compact_device(w.dev, a, kept, w.dcodecs.data(), w.ws, nullptr, stage))
        << "stage bytes " << stage;
    w.expect_same({a});
    w.append(a, 70);
    w.expect_same({a});
  }
}

}  // namespace
}  // namespace kvcc
