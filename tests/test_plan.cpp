// CPU tests of the CUDA kernels' host side: the one table of served shapes and the layout
// constants (runtime/served.h), the split-K, prefill and append planners and the workspace layouts
// (runtime/plan.h), and the log-sum-exp merge both attention kernels run (runtime/merge.cuh, host
// and device code). Plans are checked against what the kernels do with them (every page of every
// sequence in exactly one split, every new token moved or written exactly once) and against the
// choices docs/runtime.md documents, with the numbers worked out by hand for an H200.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "formats/artifact.h"
#include "formats/error.h"
#include "formats/kv_layout.h"
#include "runtime/kvcc_runtime.h"
#include "runtime/merge.cuh"
#include "runtime/plan.h"
#include "runtime/served.h"
#include "formats_test_util.h"

namespace kvcc {
namespace {

// An H200: 132 SMs; decode's builds at their __launch_bounds__ occupancy (3 CTAs per SM with the
// 3-stage ring, 4 with the 2-stage one), prefill's 4-warp kernel 2 per SM, the 8-warp one 1.
constexpr int kSms = 132;
DecodeGpu h200_decode() {
  DecodeGpu g;
  g.sms = kSms;
  g.resident_deep = decode_ctas_per_sm(kDecodeRingDeep) * kSms;
  g.resident_wide = decode_ctas_per_sm(kDecodeRingWide) * kSms;
  return g;
}
// One CTA an SM of each build's shared memory, two of the 4-warp build's two-CTA form.
PrefillGpu h200_prefill() { return PrefillGpu{kSms, kSms, 2 * kSms}; }
int64_t resident_of(const PrefillGpu& gpu, const PrefillPlan& p) {
  return p.warps == 8 ? gpu.resident8 : p.ctas_per_sm == 2 ? gpu.resident4_pair : gpu.resident4;
}

int ceil_div(int64_t a, int64_t b) { return int((a + b - 1) / b); }
bool contains(const std::string& s, const std::string& what) { return s.find(what) != std::string::npos; }

// ---------------------------------------------------------------------------------------------
// Layout constants and the served-shape table.

TEST(ServedLayout, ConstantsAreKvLayoutsBytes) {
  const KvGeometry g = gpu_geometry(3, 5);
  EXPECT_EQ(g.head_dim, kGpuHeadDim);
  EXPECT_EQ(g.group, g.head_dim);
  EXPECT_EQ(g.page_tokens, KvGeometry{}.page_tokens);
  EXPECT_EQ(g.sink, KvGeometry{}.sink);
  EXPECT_EQ(g.recent, KvGeometry{}.recent);
  EXPECT_EQ(size_t(kGpuPageTokens), size_t(g.page_tokens));
  EXPECT_EQ(size_t(kGpuCodeRowBytes), g.code_row_bytes());
  EXPECT_EQ(size_t(kGpuCodesBytes), g.codes_bytes());
  EXPECT_EQ(size_t(kGpuParamsBytes), g.params_bytes());
  EXPECT_EQ(size_t(kGpuVCodesOffset), g.v_codes_offset());
  EXPECT_EQ(size_t(kGpuKParamsOffset), g.k_params_offset());
  EXPECT_EQ(size_t(kGpuVParamsOffset), g.v_params_offset());
  EXPECT_EQ(size_t(kGpuPageBytes), g.page_head_bytes());
  EXPECT_EQ(kGpuPageBytes, 72 * 64);  // docs/runtime.md: 72 bytes per token and head, 64 tokens
  // Per-channel key pages: one 2-byte (scale, zero) pair per channel for the page's keys, so the
  // block is as long as the per-token one.
  KvGeometry chan = g;
  chan.key_group_tokens = chan.page_tokens;
  chan.key_pair_bytes = 2;
  EXPECT_EQ(size_t(kGpuChanKParamsBytes), chan.k_params_bytes());
  EXPECT_EQ(size_t(kGpuChanVParamsOffset), chan.v_params_offset());
  EXPECT_EQ(size_t(kGpuChanPageBytes), chan.page_head_bytes());
  EXPECT_EQ(size_t(kGpuKParamsOffset), chan.k_params_offset());
  EXPECT_EQ(kGpuChanPageBytes, kGpuPageBytes);
  // A window row: the window block holds 2·(S + W) BF16 rows.
  EXPECT_EQ(size_t(kGpuBf16RowBytes), g.window_head_elems() * 2 / (2 * size_t(g.sink + g.recent)));
  EXPECT_EQ(gpu_unsupported_reason(g, 4 * g.n_kv_heads), "");
}

using testing::error_of;

// GpuBlock (the kernels' constexpr block layout at widths K / V) is KvGeometry's at those widths,
// and check_layer_blocks takes exactly the layers the kernels read: widths of 1-4 bits, a level
// table's side at 2, the block the widths give, inside the page.
TEST(ServedLayout, BlocksAtCodeWidths) {
  KvGeometry g = gpu_geometry(2, 3), chan = g;
  chan.key_group_tokens = chan.page_tokens;
  chan.key_pair_bytes = 2;
  auto expect_block = [](const KvGeometry& geo, BlockWidths w, int v_codes, int k_params, int v_params, int bytes) {
    EXPECT_EQ(size_t(v_codes), geo.v_codes_offset(w));
    EXPECT_EQ(size_t(k_params), geo.k_params_offset(w));
    EXPECT_EQ(size_t(v_params), geo.v_params_offset(w));
    EXPECT_EQ(size_t(bytes), geo.page_head_bytes(w));
  };
  using B13 = GpuBlock<1, 3, false>;
  using B42 = GpuBlock<4, 2, true>;
  expect_block(g, {1, 3}, B13::kVCodesOffset, B13::kKParamsOffset, B13::kVParamsOffset, B13::kBytes);
  expect_block(chan, {4, 2}, B42::kVCodesOffset, B42::kKParamsOffset, B42::kVParamsOffset, B42::kBytes);
  EXPECT_EQ(B13::kKRowBytes, 16);
  EXPECT_EQ(B42::kVRowBytes, 32);

  const PageLayout layout(g, {{1, 3}, {1, 3}, {1, 3}, {4, 2}, {4, 2}, {4, 2}});
  const LayerBlocks l1 = layout.layer_blocks(1);
  EXPECT_NO_THROW(check_layer_blocks(g, l1, false, true, "x"));  // a value table at 2 bits
  EXPECT_CONTAINS(error_of([&] { check_layer_blocks(g, l1, true, false, "append (CUDA)"); }),
                  "append (CUDA): level tables with codes of 4 / 2 bits");
  EXPECT_CONTAINS(error_of([&] { check_layer_blocks(g, layout.layer_blocks(0), false, true, "x"); }),
                  "level tables with codes of 1 / 3 bits");
  LayerBlocks bad = l1;
  bad.widths.value = 3;  // the block no longer what the widths give
  EXPECT_CONTAINS(error_of([&] { check_layer_blocks(g, bad, false, false, "x"); }), "do not fit");
  bad = l1;
  bad.page_bytes -= 1;  // the layer's blocks past the page
  EXPECT_CONTAINS(error_of([&] { check_layer_blocks(g, bad, false, false, "x"); }), "do not fit");
  bad = l1;
  bad.widths.key = 5;
  EXPECT_CONTAINS(error_of([&] { check_layer_blocks(g, bad, false, false, "x"); }), "codes of 5 / 2 bits");
  EXPECT_NO_THROW(check_layer_blocks(g, two_bit_layer_blocks(g, 1), true, true, "x"));
}

// Every rule names its field and applies to the kernels that have it; the full question (all
// ops) is refused exactly when one kernel refuses.
TEST(ServedShapes, EachRuleNamesItsFieldAndKernels) {
  const KvGeometry base = gpu_geometry(2, 8);
  for (unsigned ops : {unsigned(kGpuAppend), unsigned(kGpuPrefill), unsigned(kGpuDecode), unsigned(kGpuAllOps)})
    EXPECT_EQ(gpu_unsupported_reason(base, 32, ops), "") << ops;
  struct Case {
    void (*edit)(KvGeometry&);
    int heads;
    bool table;
    const char* what;
    bool append, prefill, decode;
  } cases[] = {
      {[](KvGeometry& g) { g.head_dim = g.group = 64; }, 32, false, "head_dim 64", false, false, false},
      {[](KvGeometry& g) { g.group = 32; }, 32, false, "group 32", false, false, false},
      {[](KvGeometry& g) { g.page_tokens = 32; }, 32, false, "page size 32", true, false, false},
      {[](KvGeometry& g) { g.page_tokens = 128; }, 32, false, "page size 128", true, false, false},
      {[](KvGeometry& g) { g.n_kv_heads = 72; }, 72 * 4, false, "72 KV heads", true, false, true},
      {[](KvGeometry& g) { g.n_kv_heads = 72; }, 72 * 4, true, "72 KV heads", true, false, false},
      {[](KvGeometry& g) { g.n_kv_heads = 64; }, 64 * 8, true, "", true, true, true},
      {[](KvGeometry& g) { g.sink = 4; }, 32, false, "sink 4", true, true, false},
      {[](KvGeometry& g) { g.recent = 72; }, 32, false, "recent 72", true, true, false},
      {[](KvGeometry& g) { g.sink = 0; }, 32, false, "", true, true, true},
      {[](KvGeometry&) {}, 36, false, "36 query heads over 8", true, false, false},
      {[](KvGeometry&) {}, 0, false, "0 query heads", true, false, false},
      {[](KvGeometry&) {}, 72, false, "9 query heads per KV head", true, true, false},
      {[](KvGeometry&) {}, 40, false, "", true, true, true},  // 5 per KV head
      {[](KvGeometry&) {}, 8, false, "", true, true, true},   // 1 per KV head
      // Per-channel key pages: one key group per 64-token page, 2-byte pairs.
      {[](KvGeometry& g) { g.key_group_tokens = 64, g.key_pair_bytes = 2; }, 32, false, "", true, true, true},
      {[](KvGeometry& g) { g.key_group_tokens = 64, g.key_pair_bytes = 2; }, 32, true, "", true, true, true},
      {[](KvGeometry& g) { g.key_group_tokens = 64; }, 32, false, "fp16 (scale, zero) pairs", false, false, false},
      {[](KvGeometry& g) { g.key_group_tokens = 32; }, 32, false, "groups of 32 tokens", false, false, false},
      {[](KvGeometry& g) { g.key_group_tokens = g.page_tokens = 128; }, 32, false, "groups of 128 tokens", false, false,
       false},
  };
  for (const Case& c : cases) {
    KvGeometry g = base;
    c.edit(g);
    const bool served[3] = {c.append, c.prefill, c.decode};
    const unsigned ops[3] = {kGpuAppend, kGpuPrefill, kGpuDecode};
    for (int i = 0; i < 3; ++i) {
      const std::string why = gpu_unsupported_reason(g, c.heads, ops[i], c.table);
      if (served[i]) EXPECT_EQ(why, "") << c.what << " op " << ops[i];
      else EXPECT_TRUE(contains(why, c.what)) << c.what << " op " << ops[i] << ": '" << why << "'";
    }
    const std::string all = gpu_unsupported_reason(g, c.heads, kGpuAllOps, c.table);
    EXPECT_EQ(all.empty(), c.append && c.prefill && c.decode) << c.what << ": '" << all << "'";
    if (!all.empty()) {
      EXPECT_TRUE(contains(all, c.what)) << all;
    }
  }
  // The BF16 baseline decode: its own pages (multiples of 16 tokens), the same query-head rules.
  EXPECT_EQ(gpu_bf16_unsupported_reason(2, 128, 10, 64), "");
  EXPECT_EQ(gpu_bf16_unsupported_reason(2, 128, 10, 16), "");
  EXPECT_TRUE(contains(gpu_bf16_unsupported_reason(2, 128, 10, 40), "BF16 pages of 40"));
  EXPECT_TRUE(contains(gpu_bf16_unsupported_reason(2, 64, 10, 64), "head_dim 64"));
  EXPECT_TRUE(contains(gpu_bf16_unsupported_reason(2, 128, 18, 64), "9 query heads per KV head"));
  EXPECT_TRUE(contains(gpu_bf16_unsupported_reason(2, 128, 9, 64), "9 query heads over 2"));
}

// device_scope_problem (kvcc_runtime.h) is the same table: the cache alone for append and
// prefill, everything a device Runtime runs once the query heads are given.
TEST(ServedShapes, DeviceScopeProblemIsTheTable) {
  KvGeometry g = gpu_geometry(2, 8);
  EXPECT_EQ(device_scope_problem(g), "");
  EXPECT_EQ(device_scope_problem(g, 32, {}), "");
  g.sink = 4;
  EXPECT_EQ(device_scope_problem(g), "");  // append and prefill serve any windows
  EXPECT_TRUE(contains(device_scope_problem(g, 32, {}), "sink 4"));
  g = gpu_geometry(2, 8);
  EXPECT_TRUE(contains(device_scope_problem(g, 72, {}), "9 query heads per KV head"));
  g.page_tokens = 32;
  EXPECT_EQ(device_scope_problem(g), gpu_unsupported_reason(g, kAnyQueryHeads, kGpuAppend | kGpuPrefill));
  EXPECT_TRUE(contains(device_scope_problem(g), "page size 32"));
}

Artifact served_artifact(int n_heads, int n_kv, int sink, int recent) {
  Artifact a;
  a.n_layers = 1;
  a.n_heads = n_heads;
  a.n_kv_heads = n_kv;
  a.head_dim = kGpuHeadDim;
  a.recipe.method = "oscar";
  a.recipe.sink = sink;
  a.recipe.recent = recent;
  a.recipe.page_size = kGpuPageTokens;
  a.heads.resize(size_t(n_kv));  // no rotations: identity
  return a;
}

// A device Runtime asks the table for every kernel when it is made, before it touches a device,
// so a shape decode or prefill would refuse never gets as far as its first call. (Built with or
// without CUDA, with or without a GPU: the scope is checked first.)
TEST(ServedShapes, DeviceRuntimeRefusesAtConstruction) {
  RuntimeOptions o;
  o.max_pages = 4;
  o.max_sequences = 1;
  struct Case {
    int n_heads, n_kv, sink, recent;
    const char* what;
  } refused[] = {
      {32, 8, 4, 256, "sink 4"}, {32, 8, 64, 72, "recent 72"}, {72, 8, 64, 256, "9 query heads per KV head"}};
  for (const Case& c : refused) {
    const Artifact a = served_artifact(c.n_heads, c.n_kv, c.sink, c.recent);
    const EngineShape e{1, c.n_heads, c.n_kv, kGpuHeadDim};
    o.memory = PoolMemory::Host;
    EXPECT_NO_THROW({ Runtime host(a, e, o); }) << c.what;  // the host pool serves it
    o.memory = PoolMemory::Device;
    try {
      Runtime rt(a, e, o);
      ADD_FAILURE() << "a device Runtime accepted " << c.what;
    } catch (const Error& err) {
      EXPECT_TRUE(contains(err.what(), "cannot serve") && contains(err.what(), c.what)) << err.what();
    }
  }
  // A served shape is not refused for its shape (here it may still find no GPU or no CUDA).
  const Artifact a = served_artifact(64, 8, 16, 96);
  o.memory = PoolMemory::Device;
  try {
    Runtime rt(a, EngineShape{1, 64, 8, kGpuHeadDim}, o);
  } catch (const Error& err) {
    EXPECT_FALSE(contains(err.what(), "cannot serve")) << err.what();
  }
}

TEST(ServedShapes, OnlyHopperRunsTheKernels) {
  EXPECT_EQ(gpu_arch_problem(0, "NVIDIA H200", 9, 0), "");
  const std::string a100 = gpu_arch_problem(0, "NVIDIA A100-SXM4-80GB", 8, 0);
  EXPECT_EQ(a100,
            "kvcc's CUDA kernels need a Hopper GPU (sm_90); device 0 is NVIDIA A100-SXM4-80GB (sm_80); use the "
            "CPU pool");
  EXPECT_TRUE(contains(gpu_arch_problem(1, "NVIDIA B200", 10, 0), "device 1 is NVIDIA B200 (sm_100)"));
  EXPECT_TRUE(contains(gpu_arch_problem(0, "NVIDIA L40S", 8, 9), "(sm_89)"));
  EXPECT_FALSE(gpu_arch_problem(0, "sm_90a?", 9, 1).empty());
}

// ---------------------------------------------------------------------------------------------
// Decode's split-K plan.

// What decode_kernel does with a plan, checked for a sequence of n_pages history pages (any
// sequence of the batch: n_pages <= max_pages): split s takes pages [s·ups, min(n, (s+1)·ups)),
// its warps every 4th page; window split w takes window tiles [w·wtps, (w+1)·wtps).
void expect_plan_covers(const DecodePlan& p, const KvGeometry& g, int max_pages, const std::string& where) {
  const int units = std::max(1, max_pages);
  ASSERT_GE(p.units_per_split, 1) << where;
  ASSERT_GE(p.paged_splits, 1) << where;
  // Every page of the longest sequence in exactly one split, no split empty.
  EXPECT_GE(int64_t(p.paged_splits) * p.units_per_split, units) << where;
  EXPECT_LT(int64_t(p.paged_splits - 1) * p.units_per_split, units) << where;
  for (int n : {0, 1, max_pages / 2, max_pages}) {
    std::vector<int> seen(size_t(std::max(n, 0)), 0);
    for (int s = 0; s < p.paged_splits; ++s)
      for (int w = 0; w < kDecodeWarps; ++w)
        for (int k = s * p.units_per_split + w; k < std::min(n, (s + 1) * p.units_per_split); k += kDecodeWarps)
          ++seen[size_t(k)];
    for (int k = 0; k < n; ++k) ASSERT_EQ(seen[size_t(k)], 1) << where << " page " << k << " of " << n;
  }
  const int tiles = (g.sink + g.recent) / kGpuWindowTile;
  if (tiles == 0) {
    EXPECT_EQ(p.window_splits, 0) << where;
  } else {
    EXPECT_EQ(p.win_tiles_per_split % kDecodeWarps, 0) << where;
    EXPECT_GE(p.win_tiles_per_split, kDecodeWarps) << where;
    EXPECT_GE(int64_t(p.window_splits) * p.win_tiles_per_split, tiles) << where;
    EXPECT_LT(int64_t(p.window_splits - 1) * p.win_tiles_per_split, tiles) << where;
  }
  EXPECT_EQ(p.total, p.paged_splits + p.window_splits) << where;
  EXPECT_TRUE(p.ring == kDecodeRingDeep || p.ring == kDecodeRingWide) << where;
}

TEST(DecodePlanning, SplitsCoverEveryPageOnceWithinTheirBudget) {
  const DecodeGpu gpu = h200_decode();
  int cases = 0;
  for (auto [sink, recent] : {std::pair{64, 256}, std::pair{16, 96}, std::pair{0, 64}})
    for (int n_kv : {1, 2, 8})
      for (int batch : {1, 2, 3, 5, 6, 8, 16, 32, 64, 128})
        for (int64_t ctx : {0, 1, 100, 320, 321, 1000, 4096, 16384, 32768, 131072}) {
          KvGeometry g = gpu_geometry(1, n_kv);
          g.sink = sink;
          g.recent = recent;
          const int pages = int(history_pages(g, ctx));
          const int pairs = batch * n_kv, units = std::max(1, pages);
          for (int target : {0, 1, 64, 1000, 4000})
            for (int ring : {0, kDecodeRingWide, kDecodeRingDeep}) {
              const std::string where = "b" + std::to_string(batch) + " kv" + std::to_string(n_kv) + " ctx" +
                                        std::to_string(ctx) + " S" + std::to_string(sink) + " target" +
                                        std::to_string(target) + " ring" + std::to_string(ring);
              const DecodePlan p = plan_decode_int2(gpu, g, batch, pages, target, ring);
              expect_plan_covers(p, g, pages, where);
              ++cases;
              EXPECT_EQ(p.ring, ring ? ring : p.ring) << where;
              if (target > 0) {
                EXPECT_LE(p.paged_splits, std::max(1, ceil_div(target, pairs))) << where;
                EXPECT_EQ(p.ring, ring ? ring : kDecodeRingDeep) << where;
                continue;
              }
              if (pairs >= kDecodeFewPairs && p.units_per_split >= 24 && p.ring == (ring ? ring : kDecodeRingWide)) {
                // The waves plan: at most 4 waves of resident CTAs of its build.
                EXPECT_LE(p.paged_splits, ceil_div(4 * gpu.resident(p.ring), pairs)) << where;
              } else {
                // Otherwise about 2 CTAs per SM, and no more splits than leave kDecodeWarps pages each.
                EXPECT_LE(p.paged_splits, std::max(1, ceil_div(2 * kSms, pairs))) << where;
                EXPECT_LE(p.paged_splits, std::max(1, ceil_div(units, kDecodeWarps))) << where;
                const int short_ring = p.units_per_split <= 4 * kDecodeWarps ? kDecodeRingWide : kDecodeRingDeep;
                EXPECT_EQ(p.ring, ring ? ring : short_ring) << where;
              }
            }
        }
  EXPECT_GT(cases, 4000);
}

// docs/runtime.md's table of choices at 8 KV heads and the default windows (history pages: 59 at
// 4K, 251 at 16K, 507 at 32K, 2043 at 128K), each worked out by hand: 4 waves of the 2-stage
// build (4·528 = 2112 CTAs) if splits keep >= 24 pages; else 2 CTAs per SM (264), >= 4 pages per
// split, the 2-stage build for splits of <= 16 pages.
TEST(DecodePlanning, DocumentedChoicesOnAnH200) {
  const DecodeGpu gpu = h200_decode();
  const KvGeometry g = gpu_geometry(1, 8);
  ASSERT_EQ(history_pages(g, 4096), 59);
  ASSERT_EQ(history_pages(g, 16384), 251);
  ASSERT_EQ(history_pages(g, 32768), 507);
  ASSERT_EQ(history_pages(g, 131072), 2043);
  struct Case {
    int batch, ctx, ring, units_per_split, paged_splits;
  } cases[] = {
      {8, 131072, kDecodeRingWide, 62, 33},  // 64 pairs: ceil(2112 / 64) = 33 splits of 62 pages
      {32, 32768, kDecodeRingWide, 57, 9},   // 256 pairs: 9 splits of 57
      {64, 32768, kDecodeRingWide, 102, 5},  // 512 pairs: 5 splits of 102
      {64, 4096, kDecodeRingDeep, 59, 1},    // 4 waves leave 12 pages: one 59-page split per pair
      {8, 16384, kDecodeRingDeep, 51, 5},    // 4 waves leave 8 pages: ceil(264 / 64) = 5 splits of 51
      {8, 32768, kDecodeRingDeep, 102, 5},   // 16 pages with 4 waves: 5 splits of 102
      {1, 32768, kDecodeRingWide, 16, 32},   // 8 pairs: 33 splits wanted, 16-page splits (2-stage)
      {1, 131072, kDecodeRingDeep, 62, 33},  // 62-page splits keep the 3-stage build
      {1, 4096, kDecodeRingWide, 4, 15},     // at least 4 pages per split: 15 splits
  };
  for (const Case& c : cases) {
    const DecodePlan p = plan_decode_int2(gpu, g, c.batch, int(history_pages(g, c.ctx)), 0, 0);
    EXPECT_EQ(p.ring, c.ring) << "batch " << c.batch << " ctx " << c.ctx;
    EXPECT_EQ(p.units_per_split, c.units_per_split) << "batch " << c.batch << " ctx " << c.ctx;
    EXPECT_EQ(p.paged_splits, c.paged_splits) << "batch " << c.batch << " ctx " << c.ctx;
    // A window split reads about as many bytes as a history split (a multiple of 4 tiles, at most
    // the 20 tiles of 16 tokens at S + W = 320): a 16-token tile is 16 K and V rows of 256 bytes.
    const int64_t split_bytes = int64_t(p.units_per_split) * 72 * 64, tile_bytes = 16 * 2 * 256;
    EXPECT_TRUE(p.win_tiles_per_split == 20 || p.win_tiles_per_split * tile_bytes >= split_bytes);
    EXPECT_TRUE(p.win_tiles_per_split == 4 || (p.win_tiles_per_split - 4) * tile_bytes < split_bytes);
  }
}

// The rung "else 2 waves if that leaves >= 48 pages" of the documented plan never applies: the
// 2-wave target has at most twice fewer splits per pair than the 4-wave one, so whenever 4 waves
// leave < 24 pages per split, 2 waves leave at most 46. Every default plan with many pairs is the
// 4-wave one or the 2-per-SM one.
TEST(DecodePlanning, TwoWaveRungIsNeverTaken) {
  const DecodeGpu gpu = h200_decode();
  for (int n_kv : {1, 4, 8})
    for (int batch = 1; batch <= 256; batch += 7)
      for (int pages = 1; pages <= 4096; pages = pages * 5 / 4 + 1) {
        const KvGeometry g = gpu_geometry(1, n_kv);
        const int pairs = batch * n_kv;
        if (pairs < kDecodeFewPairs) continue;
        const DecodePlan p = plan_decode_int2(gpu, g, batch, pages, 0, 0);
        const int four = ceil_div(pages, ceil_div(4 * gpu.resident_wide, pairs));
        if (four >= 24) EXPECT_EQ(p.units_per_split, four);
        else EXPECT_LE(p.paged_splits, std::max(1, ceil_div(2 * kSms, pairs)));
      }
}

TEST(DecodePlanning, BaselineTakesTwoCtasPerSm) {
  const DecodeGpu gpu = h200_decode();
  for (int batch : {1, 5, 64})
    for (int pages : {1, 16, 47, 1000, 2048}) {
      const DecodePlan p = plan_decode_bf16(gpu, batch, 2, pages, 0);
      EXPECT_EQ(p.window_splits, 0);
      EXPECT_EQ(p.total, p.paged_splits);
      EXPECT_LE(p.paged_splits, ceil_div(2 * kSms, batch * 2));
      EXPECT_GE(int64_t(p.paged_splits) * p.units_per_split, pages);
      EXPECT_LT(int64_t(p.paged_splits - 1) * p.units_per_split, pages);
      EXPECT_LE(plan_decode_bf16(gpu, batch, 2, pages, 40).paged_splits, ceil_div(40, batch * 2));
    }
}

// Per-head merge: the smallest chunk (of 1, 4, 12) whose round of loads covers the 4 slices' splits;
// grouped merge (>= 48 pairs) one slice per head over all splits: 8, else 12.
TEST(DecodePlanning, MergeLoadsEverySplitInOneRoundWhenItCan) {
  for (int total = 1; total <= 200; ++total) {
    const MergePlan m = plan_decode_merge(kDecodeFewPairs - 1, total);
    EXPECT_FALSE(m.grouped);
    EXPECT_EQ(m.chunk, merge_slice_chunk(total));
    int smallest = 12;
    for (int c : {12, 4, 1})
      if (4 * c >= total) smallest = c;
    EXPECT_EQ(m.chunk, smallest) << total;
    const MergePlan gm = plan_decode_merge(kDecodeFewPairs, total);
    EXPECT_TRUE(gm.grouped);
    EXPECT_EQ(gm.chunk, total <= 8 ? 8 : 12);
  }
}

// The workspace holds every buffer the launch carves, each on a 256-byte boundary, in order.
TEST(DecodePlanning, WorkspaceHoldsEveryBuffer) {
  const DecodeGpu gpu = h200_decode();
  for (int n_kv : {1, 8})
    for (int batch : {1, 3, 64})
      for (int pages : {0, 5, 507, 2043})
        for (int target : {0, 4000}) {
          const int n_heads = 4 * n_kv;
          const KvGeometry g = gpu_geometry(1, n_kv);
          const DecodePlan p = plan_decode_int2(gpu, g, batch, pages, target, 0);
          const DecodeWorkspace w = decode_workspace(batch, n_heads, n_kv, p);
          const size_t pairs = size_t(batch) * n_kv, heads = kGpuMaxGroupHeads;
          for (size_t off : {w.q_rot, w.qk8, w.qk_sc, w.part_o, w.part_ml}) EXPECT_EQ(off % 256, 0u);
          EXPECT_GE(w.qk8 - w.q_rot, size_t(batch) * n_heads * kGpuHeadDim * 4);
          EXPECT_GE(w.qk_sc - w.qk8, pairs * heads * kDecodeQk8Bytes);
          EXPECT_GE(w.part_o - w.qk_sc, pairs * heads * 2 * 4);
          EXPECT_GE(w.part_ml - w.part_o, pairs * p.total * heads * kGpuHeadDim * 4);
          EXPECT_GE(w.total - w.part_ml, pairs * p.total * heads * 2 * 4);
          EXPECT_EQ(decode_workspace_bytes(gpu, g, batch, n_heads, pages, 0, target, 0), w.total);
        }
  // The baseline's: its own plan, only n_kv of the geometry used.
  const KvGeometry g = gpu_geometry(1, 2);
  EXPECT_EQ(decode_workspace_bytes(gpu, g, 5, 10, 47, 64, 0, 0),
            decode_workspace(5, 10, 2, plan_decode_bf16(gpu, 5, 2, 47, 0)).total);
}

// ---------------------------------------------------------------------------------------------
// Prefill's plan.

// One sequence's plan against the rules: tiles cover its rows, splits cover its key tiles.
void expect_covers(const PrefillSeqPlan& p, const KvGeometry& g, int64_t length, int T, int r, int warps,
                   const std::string& where) {
  EXPECT_EQ(p.T, T) << where;
  EXPECT_EQ(p.rows, T * r) << where;
  EXPECT_GE(p.row_tiles * 16 * warps, p.rows) << where;
  EXPECT_LT((p.row_tiles - 1) * 16 * warps, p.rows) << where;
  const KvTiers t = tiers_of(g, length);
  EXPECT_EQ(p.n_pages, history_pages(g, length)) << where;
  EXPECT_EQ(p.win_rows, t.sink_count + t.ring_count) << where;
  // Key tiles: the pages, then 64-row tiles of the staged window rows and new tokens.
  const int units = T > 0 ? p.n_pages + ceil_div(p.win_rows + T, kPrefillKeyTile) : 1;
  EXPECT_GE(int64_t(p.splits) * p.units_per_split, units) << where;
  EXPECT_LT(int64_t(p.splits - 1) * p.units_per_split, units) << where;
  EXPECT_LE(p.splits, kPrefillMaxSplits) << where;
}
// The plan's own splits (no override) keep at least 4 key tiles each.
void expect_four_tiles(const PrefillSeqPlan& p, const std::string& where) {
  const int units = p.T > 0 ? p.n_pages + ceil_div(p.win_rows + p.T, kPrefillKeyTile) : 1;
  EXPECT_TRUE(units < 4 || p.units_per_split >= 4) << where;
}

TEST(PrefillPlanning, TilesAndSplitsCoverEveryKey) {
  const PrefillGpu gpu = h200_prefill();
  for (auto [n_heads, n_kv] : {std::pair{16, 4}, std::pair{32, 8}, std::pair{20, 4}, std::pair{8, 2}})
    for (int64_t length : {0, 30, 320, 400, 3000, 32768, 131072})
      for (int T : {1, 3, 16, 64, 130, 256, 2048})
        for (int splits : {0, 1, 3, 40, 500})
          for (int warps : {0, 4, 8}) {
            KvGeometry g = gpu_geometry(1, n_kv);
            const PrefillPlan p = plan_prefill(gpu, g, {length}, {T}, n_heads, splits, warps);
            const std::string where = "len " + std::to_string(length) + " T " + std::to_string(T) + " heads " +
                                      std::to_string(n_heads) + " splits " + std::to_string(splits) + " warps " +
                                      std::to_string(warps);
            const int r = n_heads / n_kv;
            ASSERT_EQ(p.seqs.size(), 1u);
            EXPECT_EQ(p.warps, warps ? warps : (T * r >= 128 ? 8 : 4)) << where;
            EXPECT_EQ(p.ctas_per_sm, p.warps == 4 ? 2 : 1) << where;  // the 4-warp build at two an SM
            const PrefillSeqPlan& s = p.seqs[0];
            expect_covers(s, g, length, T, r, p.warps, where);
            EXPECT_EQ(p.tokens, T);
            EXPECT_EQ(p.kv_rows, s.win_rows + T);
            EXPECT_EQ(p.part_rows, int64_t(s.splits) * n_kv * s.rows);
            if (splits > 0) {
              EXPECT_LE(s.splits, splits) << where;
              continue;
            }
            expect_four_tiles(s, where);
            const int ctas = s.row_tiles * n_kv, resident = int(resident_of(gpu, p));
            EXPECT_TRUE(ctas < resident || s.splits == 1) << where;  // the query tiles fill the GPU
            EXPECT_LE(int64_t(s.splits) * ctas, std::max(int64_t(ctas), int64_t(resident) + ctas)) << where;
          }
  EXPECT_THROW(plan_prefill(gpu, gpu_geometry(1, 2), {0}, {4}, 4, 0, 6), Error);
  EXPECT_THROW(plan_prefill(gpu, gpu_geometry(1, 2), {0}, {4}, 4, 0, 8, 2), Error);  // two an SM: 4 warps only
  EXPECT_THROW(plan_prefill(gpu, gpu_geometry(1, 2), {0}, {4}, 4, 0, 0, 3), Error);
  EXPECT_THROW(plan_prefill(gpu, gpu_geometry(1, 2), {0}, {4}, 4, 0, 0, -1), Error);
  // Overrides: one CTA an SM; two (the 4-warp build even where 8 would be planned); a GPU
  // without the two-CTA form (its residency unknown) plans one.
  EXPECT_EQ(plan_prefill(gpu, gpu_geometry(1, 2), {4096}, {16}, 4, 0, 0, 1).ctas_per_sm, 1);
  const PrefillPlan two = plan_prefill(gpu, gpu_geometry(1, 2), {4096}, {2048}, 4, 0, 0, 2);
  EXPECT_EQ(two.ctas_per_sm, 2);
  EXPECT_EQ(two.warps, 4);
  EXPECT_EQ(plan_prefill(PrefillGpu{kSms, kSms, 0}, gpu_geometry(1, 2), {4096}, {16}, 4, 0, 0).ctas_per_sm, 1);
  EXPECT_THROW(plan_prefill(gpu, gpu_geometry(1, 2), {0, 5}, {4}, 4, 0, 0), Error);
  EXPECT_THROW(plan_prefill(gpu, gpu_geometry(1, 2), {-1}, {4}, 4, 0, 0), Error);
  EXPECT_THROW(plan_prefill(gpu, gpu_geometry(1, 2), {0}, {-4}, 4, 0, 0), Error);
}

// A ragged batch: each sequence planned by the same rules, its rows placed after the earlier
// sequences' (tokens, staged rows, partials), the splits sized for the whole batch: about one
// wave of CTAs, and each CTA about the batch's mean key tiles (so a short extend over a long
// history is split even when other sequences fill the GPU).
TEST(PrefillPlanning, RaggedBatchesPlaceEverySequenceAndBalanceTheSplits) {
  const PrefillGpu gpu = h200_prefill();
  const KvGeometry g = gpu_geometry(1, 8);
  const int n_heads = 32, r = 4;
  const std::vector<std::pair<std::vector<int64_t>, std::vector<int>>> batches = {
      {{4096, 0, 131072, 300, 70000}, {16, 2048, 16, 0, 1}},
      {{32768, 32768, 32768, 32768}, {16, 16, 16, 16}},
      {std::vector<int64_t>(100, 8192), std::vector<int>(100, 64)},
      {{131072, 100}, {4096, 4096}},
  };
  for (const auto& [lengths, counts] : batches) {
    const PrefillPlan p = plan_prefill(gpu, g, lengths, counts, n_heads, 0, 0);
    ASSERT_EQ(p.seqs.size(), counts.size());
    int64_t tokens = 0, kv = 0, part = 0, ctas = 0, work = 0, rows_all = 0, rows_big = 0;
    for (size_t i = 0; i < counts.size(); ++i) {
      const PrefillSeqPlan& s = p.seqs[i];
      const std::string where = "batch of " + std::to_string(counts.size()) + ", sequence " + std::to_string(i);
      expect_covers(s, g, lengths[i], counts[i], r, p.warps, where);
      expect_four_tiles(s, where);
      EXPECT_EQ(s.token0, tokens) << where;
      EXPECT_EQ(s.kv0, kv) << where;
      EXPECT_EQ(s.part0, part) << where;
      tokens += s.T;
      kv += s.win_rows + s.T;
      part += int64_t(s.splits) * g.n_kv_heads * s.rows;
      ctas += int64_t(s.row_tiles) * g.n_kv_heads * s.splits;
      const int units = s.T > 0 ? s.n_pages + ceil_div(s.win_rows + s.T, kPrefillKeyTile) : 0;
      work += int64_t(s.row_tiles) * g.n_kv_heads * units;
      rows_all += s.rows;
      rows_big += s.rows >= 128 ? s.rows : 0;
    }
    EXPECT_EQ(p.tokens, tokens);
    EXPECT_EQ(p.kv_rows, kv);
    EXPECT_EQ(p.part_rows, part);
    EXPECT_EQ(p.warps, 2 * rows_big >= rows_all ? 8 : 4);
    const int64_t resident = resident_of(gpu, p);
    // The longest split is within 4 tiles or one mean share of the batch's key tiles per CTA, or
    // within 1.5 shares when that fits the batch in one wave.
    const int64_t mean = std::max<int64_t>(4, ceil_div(work, resident));
    for (const PrefillSeqPlan& s : p.seqs) {
      if (s.splits == kPrefillMaxSplits) continue;
      EXPECT_LE(s.units_per_split, mean + mean / 2) << "units " << s.units_per_split;
      if (s.units_per_split > mean) {
        EXPECT_LE(ctas, resident) << "units " << s.units_per_split;
      }
    }
    int64_t query_ctas = 0;
    for (const PrefillSeqPlan& s : p.seqs) query_ctas += int64_t(s.row_tiles) * g.n_kv_heads;
    EXPECT_LE(ctas, resident + query_ctas);
  }
}

// A split plan fits one wave where it can: 16 tokens over 32K with 8 KV heads on 132 SMs are 16
// splits a head (128 CTAs), not 17 (136: four CTAs of a second wave, each as long as the first);
// at two CTAs an SM, 33 (264 CTAs).
TEST(PrefillPlanning, SplitsFitOneWave) {
  const PrefillGpu gpu = h200_prefill();
  const KvGeometry g = gpu_geometry(1, 8);
  for (auto [warps, per_sm] : {std::pair{4, 0}, std::pair{4, 2}, std::pair{8, 0}})
    for (int64_t length : {4096, 32768, 131072})
      for (int T : {1, 16, 30}) {
        const PrefillPlan p = plan_prefill(gpu, g, {length}, {T}, 32, 0, warps, per_sm);
        const PrefillSeqPlan& s = p.seqs[0];
        const int64_t resident = resident_of(gpu, p), ctas = int64_t(s.splits) * s.row_tiles * 8;
        const std::string where = "len " + std::to_string(length) + " T " + std::to_string(T) + " warps " +
                                  std::to_string(warps) + "x" + std::to_string(per_sm);
        EXPECT_LE(ctas, resident) << where;
        // and most of it, where the 4-tile minimum does not bind (32K: 512 tiles)
        if (length >= 32768 && s.splits < kPrefillMaxSplits) {
          EXPECT_GE(2 * ctas, resident) << where;
        }
      }
  // 8 sequences at two CTAs an SM: 4 splits each (256 CTAs of 4 warps on 264), not 5 (320).
  const PrefillPlan p = plan_prefill(gpu, g, std::vector<int64_t>(8, 32768), std::vector<int>(8, 16), 32, 0, 0, 2);
  ASSERT_EQ(p.warps, 4);
  for (const PrefillSeqPlan& s : p.seqs) EXPECT_EQ(s.splits, 4);
}

TEST(PrefillPlanning, WorkspaceHoldsEveryBuffer) {
  const PrefillGpu gpu = h200_prefill();
  for (int64_t length : {0, 400, 32768})
    for (int T : {1, 77, 2048}) {
      const KvGeometry g = gpu_geometry(1, 4);
      const int n_heads = 20;
      const std::vector<int64_t> lengths{length, 100, 70000};
      const std::vector<int> counts{T, 3, 16};
      const PrefillPlan p = plan_prefill(gpu, g, lengths, counts, n_heads, 0, 0);
      const PrefillWorkspace w = prefill_workspace(g, p, n_heads);
      for (size_t off : {w.q, w.k, w.v, w.part_o, w.part_ml, w.bytes}) EXPECT_EQ(off % 256, 0u);
      const size_t rows = size_t(T + 3 + 16) * n_heads, kv = size_t(p.kv_rows) * g.n_kv_heads * kGpuHeadDim;
      size_t part = 0;
      for (const PrefillSeqPlan& s : p.seqs) part += size_t(s.splits) * g.n_kv_heads * s.rows;
      EXPECT_EQ(w.q, 0u);
      EXPECT_GE(w.k - w.q, rows * kGpuHeadDim * 2);
      EXPECT_GE(w.v - w.k, kv * 2);
      EXPECT_GE(w.part_o - w.v, kv * 2);
      EXPECT_GE(w.part_ml - w.part_o, part * kGpuHeadDim * 4);
      EXPECT_GE(w.bytes - w.part_ml, part * 2 * 4);
    }
}

// ---------------------------------------------------------------------------------------------
// Append's moves.

// Random batches of appends: every new token is moved into its page row or written to its window
// slot exactly once, the ring tokens a flush takes are moved from their ring slots, and every
// history row the append creates is written exactly once.
TEST(AppendPlanning, EveryTokenLandsOnceWhereItsTierSays) {
  std::mt19937 rng(7);
  int64_t pairs = 0;  // ring writes paired with a move, over all rounds
  for (auto [sink, recent] : {std::pair{64, 256}, std::pair{16, 96}, std::pair{0, 64}})
    for (int round = 0; round < 40; ++round) {
      KvGeometry g = gpu_geometry(1, 2);
      g.sink = sink;
      g.recent = recent;
      AppendPlanHost plan;
      const int nseq = 1 + int(rng() % 5);
      int64_t row = 0;
      int32_t next_page = 0;
      for (int i = 0; i < nseq; ++i) {
        const int64_t old =
            std::vector<int64_t>{0, 1, sink, sink + recent, sink + recent + 1, 1000}[rng() % 6] + int64_t(rng() % 70);
        const int count = std::vector<int>{0, 1, 1, 17, 64, 300}[rng() % 6];
        plan.seq_slots.push_back(10 + i);
        plan.old_lengths.push_back(old);
        plan.counts.push_back(count);
        plan.row_offsets.push_back(row);
        row += count;
        std::vector<int32_t> pt;
        for (int64_t p = 0; p < history_pages(g, old + count); ++p) pt.push_back(next_page++);
        plan.page_tables.push_back(pt);
      }
      const AppendMoves m = plan_append_moves(g, plan);
      EXPECT_EQ(m.rows, row);
      std::map<std::pair<int32_t, int32_t>, int> page_rows;  // (page, row) -> times written
      std::vector<int> staged(size_t(row), 0);               // input row -> times used
      for (const AppendMove& mv : m.moves) {
        ++page_rows[{mv.page, mv.row}];
        if (!mv.from_ring) ++staged[size_t(mv.src)];
      }
      for (const AppendWindowWrite& w : m.writes) ++staged[size_t(w.src)];
      // A ring write is paired with the move of the same sequence's token in that slot, if one
      // moves; every such move (from_ring == 2) with exactly one write, no other.
      std::vector<int> paired(m.moves.size(), 0);
      for (const AppendWindowWrite& w : m.writes) {
        const auto same_slot = std::find_if(m.moves.begin(), m.moves.end(), [&](const AppendMove& mv) {
          return mv.from_ring && mv.seq_slot == w.seq_slot && mv.src == w.dst;
        });
        if (!w.to_ring || same_slot == m.moves.end()) {
          EXPECT_EQ(w.move, -1);
          continue;
        }
        ASSERT_EQ(w.move, int32_t(same_slot - m.moves.begin()));
        ++paired[size_t(w.move)];
        ++pairs;
      }
      for (size_t j = 0; j < m.moves.size(); ++j) EXPECT_EQ(paired[j], m.moves[j].from_ring == 2 ? 1 : 0) << j;
      for (size_t r = 0; r < staged.size(); ++r) EXPECT_EQ(staged[r], 1) << "input row " << r;
      size_t expected_rows = 0;
      for (int i = 0; i < nseq; ++i) {
        const int64_t n0 = plan.old_lengths[size_t(i)], n1 = n0 + plan.counts[size_t(i)];
        const KvTiers t0 = tiers_of(g, n0), t1 = tiers_of(g, n1);
        const int64_t post0 = n0 - t0.sink_count;
        for (int64_t post = t0.hist_tokens; post < t1.hist_tokens; ++post) {
          const int32_t page = plan.page_tables[size_t(i)][size_t(post / g.page_tokens)];
          EXPECT_EQ((page_rows[{page, int32_t(post % g.page_tokens)}]), 1) << "seq " << i << " post " << post;
          ++expected_rows;
          // The token's source: the old ring (its slot) or the new rows (its input row).
          const bool from_ring = post < post0;
          const auto it = std::find_if(m.moves.begin(), m.moves.end(), [&](const AppendMove& mv) {
            return mv.page == page && mv.row == int32_t(post % g.page_tokens);
          });
          ASSERT_NE(it, m.moves.end());
          EXPECT_EQ(it->seq_slot, plan.seq_slots[size_t(i)]);
          EXPECT_EQ(bool(it->from_ring), from_ring);
          EXPECT_EQ(it->src,
                    from_ring ? int32_t(post % g.recent) : int32_t(plan.row_offsets[size_t(i)] + (post + g.sink - n0)));
        }
        for (const AppendWindowWrite& w : m.writes) {
          if (w.seq_slot != plan.seq_slots[size_t(i)]) continue;
          const int64_t pos = n0 + (w.src - plan.row_offsets[size_t(i)]);
          ASSERT_TRUE(pos >= n0 && pos < n1);
          if (w.to_ring) {
            EXPECT_GE(pos - g.sink, t1.hist_tokens);  // stays in the ring
            EXPECT_EQ(w.dst, int32_t((pos - g.sink) % g.recent));
          } else {
            EXPECT_LT(pos, g.sink);
            EXPECT_EQ(w.dst, int32_t(pos));
          }
        }
      }
      EXPECT_EQ(page_rows.size(), expected_rows);
      EXPECT_EQ(m.moves.size(), expected_rows);
      const AppendWorkspace w = append_workspace(g, m.rows, int64_t(m.moves.size()));
      for (size_t off : {w.moves, w.writes, w.codecs, w.bytes}) EXPECT_EQ(off % 256, 0u);
      EXPECT_GE(w.writes - w.moves, m.moves.size() * sizeof(AppendMove));
      EXPECT_GE(w.codecs - w.writes, m.writes.size() * sizeof(AppendWindowWrite));
      EXPECT_GE(w.bytes - w.codecs, size_t(g.n_kv_heads) * sizeof(HeadCodec));
    }
  EXPECT_GT(pairs, 0);  // the rounds include flushes that replace ring slots
}

TEST(AppendPlanning, RefusesInconsistentPlans) {
  const KvGeometry g = gpu_geometry(1, 2);
  AppendPlanHost plan{{0}, {0}, {1000}, {0}, {{}}};  // 1000 tokens need pages: not grown
  EXPECT_THROW(plan_append_moves(g, plan), Error);
  plan.page_tables[0].assign(size_t(history_pages(g, 1000)), 3);
  EXPECT_NO_THROW(plan_append_moves(g, plan));
  plan.counts.push_back(1);  // arrays differ in size
  EXPECT_THROW(plan_append_moves(g, plan), Error);
}

// ---------------------------------------------------------------------------------------------
// The log-sum-exp merge (merge.cuh), run on the host: split partials of one output element
// against a float64 merge of the same partials.

struct Partials {
  std::vector<float> o, ml;  // [splits] outputs, [splits][2] (max, sum)
};
Partials random_partials(int splits, std::mt19937& rng, double empty_share) {
  std::uniform_real_distribution<float> u(-30.0f, 10.0f), pos(0.5f, 20.0f), val(-3.0f, 3.0f), coin(0.0f, 1.0f);
  Partials p;
  for (int s = 0; s < splits; ++s) {
    const bool empty = coin(rng) < empty_share;  // the split saw no key: -inf, 0, 0
    p.ml.push_back(empty ? -INFINITY : u(rng));
    p.ml.push_back(empty ? 0.0f : pos(rng));
    p.o.push_back(empty ? 0.0f : val(rng) * p.ml.back());
  }
  return p;
}
// The merged value, and the size of its terms (Σ w·|o| / Σ w·l: float rounding is relative to it).
std::pair<double, double> merged64(const Partials& p) {
  double mall = -std::numeric_limits<double>::infinity(), num = 0, mag = 0, den = 0;
  for (size_t s = 0; s < p.o.size(); ++s) mall = std::max(mall, double(p.ml[2 * s]));
  if (mall == -std::numeric_limits<double>::infinity()) return {0.0, 0.0};
  for (size_t s = 0; s < p.o.size(); ++s) {
    if (p.ml[2 * s] == -INFINITY) continue;
    const double w = std::exp2(double(p.ml[2 * s]) - mall);
    num += w * p.o[s];
    mag += w * std::fabs(p.o[s]);
    den += w * p.ml[2 * s + 1];
  }
  return {num / den, mag / den};
}
// 4 slices (splits slice, slice + 4, ...) merged by merge_run, combined by merge_slices, as
// decode's merge_splits and prefill's finish do; and one run over all splits (merge_splits_group).
template <int kChunk>
void expect_merges(const Partials& p, const std::string& where) {
  const int n = int(p.o.size());
  auto entry = [](int s) { return size_t(s); };
  float m[4], l[4], acc[4];
  for (int slice = 0; slice < 4; ++slice)
    merge_run<kChunk, 1>(p.o.data(), p.ml.data(), entry, 0, n, slice, 4, m[slice], l[slice], acc[slice]);
  const auto [want, size] = merged64(p);
  const double tol = 1e-6 * (1.0 + size);
  EXPECT_NEAR(merge_slices(m, l, acc, 1), want, tol) << where << " chunk " << kChunk;
  float m1, l1, a1;
  merge_run<kChunk, 1>(p.o.data(), p.ml.data(), entry, 0, n, 0, 1, m1, l1, a1);
  EXPECT_NEAR(l1 > 0.0f ? a1 / l1 : 0.0f, want, tol) << where << " chunk " << kChunk << " (one run)";
}

TEST(Merge, LogSumExpOfSplitsMatchesFloat64) {
  std::mt19937 rng(11);
  for (int splits : {1, 2, 3, 4, 5, 13, 16, 17, 48, 49, 128})
    for (double empty : {0.0, 0.3, 0.9})
      for (int rep = 0; rep < 5; ++rep) {
        const Partials p = random_partials(splits, rng, empty);
        const std::string where = std::to_string(splits) + " splits, empty share " + std::to_string(empty);
        expect_merges<1>(p, where);
        expect_merges<4>(p, where);
        expect_merges<8>(p, where);
        expect_merges<12>(p, where);
      }
  // No split saw a key: zero, not NaN.
  Partials none = random_partials(9, rng, 1.0);
  float m[4], l[4], acc[4];
  for (int slice = 0; slice < 4; ++slice)
    merge_run<4, 1>(
        none.o.data(), none.ml.data(), [](int s) { return size_t(s); }, 0, 9, slice, 4, m[slice], l[slice], acc[slice]);
  EXPECT_EQ(merge_slices(m, l, acc, 1), 0.0f);
}

// The entry function and row length address the kernels' layouts: decode's [pair][split][8][128]
// and prefill's [split][n_kv][rows][128], element j of the row.
TEST(Merge, ReadsThePartialsLayoutItIsGiven) {
  std::mt19937 rng(5);
  const int splits = 7, n_kv = 3, rows = 5, d = 4;
  std::vector<float> o(size_t(splits) * n_kv * rows * d), ml(size_t(splits) * n_kv * rows * 2);
  std::uniform_real_distribution<float> u(-4.0f, 4.0f), pos(0.5f, 3.0f);
  for (auto& x : o) x = u(rng);
  for (size_t i = 0; i < ml.size(); i += 2) {
    ml[i] = u(rng);
    ml[i + 1] = pos(rng);
  }
  for (int h = 0; h < n_kv; ++h)
    for (int row = 0; row < rows; ++row)
      for (int j = 0; j < d; ++j) {
        Partials p;
        for (int s = 0; s < splits; ++s) {
          const size_t e = (size_t(s) * n_kv + h) * rows + row;
          p.o.push_back(o[e * d + j]);
          p.ml.push_back(ml[e * 2]);
          p.ml.push_back(ml[e * 2 + 1]);
        }
        const size_t base = size_t(h) * rows + row, stride = size_t(n_kv) * rows;
        float m, l, acc;
        merge_run<4, d>(
            o.data(), ml.data(), [base, stride](int s) { return size_t(s) * stride + base; }, j, splits, 0, 1, m, l,
            acc);
        EXPECT_NEAR(acc / l, merged64(p).first, 1e-6 * (1.0 + merged64(p).second));
      }
}

}  // namespace
}  // namespace kvcc
