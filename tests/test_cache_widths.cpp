// Code widths per (layer, KV head) block (kv_layout.h PageLayout, compile --bits-budget's
// artifacts) in the host pool: codes pack in bit planes at 1-4 bits (checked against a writer of
// the planes by hand), the blocks tile a page in (layer, head) order and reduce to the 2-bit layout, and a pool
// whose blocks have their own widths holds, block for block, the bytes of uniform pools at those
// widths given the same appends (so every width is the one the per-channel tests check against
// the codec); compaction moves rows at their widths. What the runtime refuses is named.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "cache_test_util.h"
#include "formats/artifact.h"
#include "formats/kv_layout.h"
#include "formats/page_row_codec.h"
#include "runtime/append_ref.h"
#include "runtime/attention_ref.h"
#include "runtime/compact_ref.h"
#include "runtime/kv_cache.h"
#include "runtime/kvcc_runtime.h"
#include "runtime/memory.h"

namespace kvcc {
namespace {

using testing::error_of;

// d = 32, one (scale, zero) group of 16 channels a token, pages of 16, sink 8, ring 32.
KvGeometry geometry() {
  KvGeometry g;
  g.n_layers = 2;
  g.n_kv_heads = 2;
  g.head_dim = 32;
  g.group = 16;
  g.page_tokens = 16;
  g.sink = 8;
  g.recent = 32;
  return g;
}

// Every width on both sides: {1, 3}, {2, 4}, {3, 1}, {4, 2}.
std::vector<BlockWidths> all_widths() { return {{1, 3}, {2, 4}, {3, 1}, {4, 2}}; }

// The bit planes of a row (kv_layout.h's pack_codes), written another way: each plane as the
// sequence of its 2-bit or 1-bit fields in the order the layout gives them. A 2-bit plane is
// channels 0, 1, .. d − 1 at consecutive 2-bit fields (LSB first); a 1-bit plane is, per 4-byte
// word k, four bytes j each holding channels 16k + 4j .. + 3 of the first half in bits 0-3 and the
// same channels of the second half in bits 4-7.
std::vector<uint8_t> planes_by_hand(const std::vector<uint8_t>& codes, int bits) {
  const int d = int(codes.size());
  std::vector<uint8_t> row;
  for (int b0 = 0; b0 < bits;) {
    const int pb = bits - b0 >= 2 ? 2 : 1;
    std::vector<uint8_t> plane(size_t(d * pb / 8), 0);
    auto field = [&](int c) { return (codes[size_t(c)] >> b0) & ((1 << pb) - 1); };
    if (pb == 2) {
      for (int c = 0; c < d; ++c) plane[size_t(c / 4)] = uint8_t(plane[size_t(c / 4)] | field(c) << (2 * (c % 4)));
    } else {
      for (int byte = 0; byte < d / 8; ++byte)
        for (int bit = 0; bit < 8; ++bit) {
          const int i = 16 * (byte / 4) + 4 * (byte % 4) + bit % 4, c = i + (bit >= 4 ? d / 2 : 0);
          plane[size_t(byte)] = uint8_t(plane[size_t(byte)] | field(c) << bit);
        }
    }
    row.insert(row.end(), plane.begin(), plane.end());
    b0 += pb;
  }
  return row;
}

TEST(CacheWidths, CodesPackInBitPlanesAtEveryWidth) {
  std::mt19937 rng(5);
  for (int d : {8, 16, 40, 128})
    for (int bits = 1; bits <= 4; ++bits) {
      std::vector<uint8_t> codes(static_cast<size_t>(d)), row(size_t(d * bits / 8), 0xAB);
      for (auto& c : codes) c = uint8_t(rng() % (1u << bits));
      pack_codes(codes.data(), d, row.data(), bits);
      EXPECT_EQ(row, planes_by_hand(codes, bits)) << d << " channels, " << bits << " bits";
      for (int c = 0; c < d; ++c)
        ASSERT_EQ(unpack_code(row.data(), d, c, bits), codes[size_t(c)]) << d << " channels, " << bits << " bits";
    }
  // 2 bits: the layout the CUDA kernels read (channel c at byte c/4, bits 2·(c%4)); the planes of
  // wider codes follow it, the low bits first.
  const std::vector<uint8_t> c4 = {0x1, 0x6, 0xB, 0xC, 0x0, 0xF, 0x5, 0xA};
  std::vector<uint8_t> r4(4);
  pack_codes(c4.data(), 8, r4.data(), 4);
  EXPECT_EQ(r4, (std::vector<uint8_t>{0b00111001, 0b10011100, 0b11100100, 0b10011100}));
}

TEST(CacheWidths, BlocksTileThePageInOrder) {
  const KvGeometry g = geometry();
  const PageLayout two(g, {});
  EXPECT_TRUE(two.two_bit());
  EXPECT_EQ(two.page_bytes(), g.page_bytes());
  for (int l = 0; l < g.n_layers; ++l)
    for (int h = 0; h < g.n_kv_heads; ++h) EXPECT_EQ(two.block_offset(3, l, h), g.page_block_offset(3, l, h));
  const PageLayout w(g, all_widths());
  EXPECT_FALSE(w.two_bit());
  // Block (l, h): 16 tokens × 32 codes at each side's width, then 16 × 2 (scale, zero) pairs a side.
  size_t at = 0;
  for (int i = 0; i < 4; ++i) {
    const BlockWidths b = all_widths()[size_t(i)];
    EXPECT_EQ(w.block_offset(0, i / 2, i % 2), at);
    EXPECT_EQ(w.block_offset(5, i / 2, i % 2), 5 * w.page_bytes() + at);
    EXPECT_EQ(w.widths(i / 2, i % 2).key, b.key);
    EXPECT_EQ(g.page_head_bytes(b), size_t(16 * 32 * (b.key + b.value) / 8 + 2 * 16 * 2 * 4));
    EXPECT_EQ(g.v_params_offset(b) - g.k_params_offset(b), g.k_params_bytes());
    at += g.page_head_bytes(b);
  }
  EXPECT_EQ(w.page_bytes(), at);
  // 20 code bits a token over the four blocks against the 2-bit layout's 16: 4 more a token and channel.
  EXPECT_EQ(w.page_bytes(), g.page_bytes() + size_t(16 * 32 * 4 / 8));
  // The kernels' view of a layer (LayerBlocks): every head of a layer at one width, the blocks
  // where block_offset puts them; the 2-bit layout's the same as KvGeometry's.
  const PageLayout per_layer(g, {{3, 1}, {3, 1}, {2, 4}, {2, 4}});
  EXPECT_EQ(per_layer.kernel_problem(), "");
  for (int l = 0; l < g.n_layers; ++l) {
    const LayerBlocks lb = per_layer.layer_blocks(l), lb2 = two.layer_blocks(l), geo2 = two_bit_layer_blocks(g, l);
    EXPECT_EQ(lb.widths.key, l ? 2 : 3);
    EXPECT_EQ(lb.widths.value, l ? 4 : 1);
    for (int h = 0; h < g.n_kv_heads; ++h) {
      EXPECT_EQ(lb.block_offset(7, h), per_layer.block_offset(7, l, h));
      EXPECT_EQ(lb2.block_offset(7, h), g.page_block_offset(7, l, h));
      EXPECT_EQ(geo2.block_offset(7, h), g.page_block_offset(7, l, h));
    }
  }
  EXPECT_CONTAINS(w.kernel_problem(), "layer 0 holds KV head 0 at 1 / 3 bits and KV head 1 at 2 / 4");
  EXPECT_CONTAINS(error_of([&] { PageLayout(g, {{2, 2}}); }), "1 code widths for 4");
  EXPECT_CONTAINS(error_of([&] { PageLayout(g, {{2, 2}, {2, 5}, {2, 2}, {2, 2}}); }), "KV head 1 codes of 5 bits");
  EXPECT_CONTAINS(error_of([&] { PageLayout(g, {{0, 2}, {2, 2}, {2, 2}, {2, 2}}); }), "codes of 0 bits");
  KvGeometry odd = g;
  odd.head_dim = odd.group = 4;
  EXPECT_CONTAINS(error_of([&] { PageLayout(odd, {{3, 2}, {2, 2}, {2, 2}, {2, 2}}); }), "not whole bytes");
}

// One pool with every width and four uniform pools (1..4 bits), the same appends (crossing the
// sink, flushing single and several pages) and forks: every block of every page of the widths
// pool is, side by side, the uniform pool's block of that side's width; gather_sequence decodes
// accordingly; bytes in use and the memory accounting agree with the layout.
TEST(CacheWidths, EachBlockIsTheUniformPoolOfItsWidth) {
  const KvGeometry g = geometry();
  const int H = g.n_kv_heads, d = g.head_dim;
  KvCache mixed(KvCacheConfig{g, 64, 4, PoolMemory::Host, all_widths()});
  std::vector<std::unique_ptr<KvCache>> uniform;
  for (int b = 1; b <= 4; ++b)
    uniform.push_back(std::make_unique<KvCache>(
        KvCacheConfig{g, 64, 4, PoolMemory::Host, std::vector<BlockWidths>(4, BlockWidths{b, b})}));
  std::mt19937 rng(11);
  std::vector<HeadCodec> codecs(4);
  for (size_t i = 0; i < codecs.size(); ++i) {
    codecs[i].key.clip_ratio = 0.9f + 0.02f * float(i);
    codecs[i].value.clip_ratio = 0.95f;
  }
  std::vector<float> rot_k, rot_v;
  for (int l = 0; l < g.n_layers; ++l) {
    const auto rk = testing::random_rotations(H, d, rng), rv = testing::random_rotations(H, d, rng);
    rot_k.insert(rot_k.end(), rk.begin(), rk.end());
    rot_v.insert(rot_v.end(), rv.begin(), rv.end());
  }
  std::vector<KvCache*> pools{&mixed};
  for (auto& u : uniform) pools.push_back(u.get());
  std::vector<int> seqs;
  for (KvCache* c : pools) seqs.push_back(c->add_sequence());
  ASSERT_EQ(seqs, std::vector<int>(5, seqs[0]));
  const int s = seqs[0];
  std::normal_distribution<float> nd;
  for (int n : {5, 40, 1, 70}) {
    std::vector<float> k(size_t(n) * H * d), v(k.size());
    for (size_t i = 0; i < k.size(); ++i) {
      k[i] = nd(rng) * (i % 7 == 0 ? 5.0f : 1.0f) + 0.2f;
      v[i] = nd(rng);
    }
    for (KvCache* c : pools) {
      const int64_t old = c->length(s);
      c->grow(s, n);
      for (int l = 0; l < g.n_layers; ++l)
        append_ref(*c, l, make_append_batch({s}, {old}, {n}), k.data(), v.data(), rot_k.data() + size_t(l) * H * d * d,
                   rot_v.data() + size_t(l) * H * d * d, codecs.data() + size_t(l) * H);
    }
  }
  const int f = mixed.fork(s);  // shares the pages, copies the window
  ASSERT_EQ(mixed.page_table(f), mixed.page_table(s));
  const auto& pages = mixed.page_table(s);
  ASSERT_GE(pages.size(), 4u);
  for (size_t p = 0; p < pages.size(); ++p)
    for (int l = 0; l < g.n_layers; ++l)
      for (int h = 0; h < H; ++h) {
        const BlockWidths w = mixed.layout().widths(l, h);
        const uint8_t* got = mixed.page_block(pages[p], l, h);
        const KvCache& uk = *uniform[size_t(w.key - 1)];
        const KvCache& uv = *uniform[size_t(w.value - 1)];
        const uint8_t* key = uk.page_block(uk.page_table(s)[p], l, h);
        const uint8_t* val = uv.page_block(uv.page_table(s)[p], l, h);
        const BlockWidths wk{w.key, w.key}, wv{w.value, w.value};
        EXPECT_EQ(0, std::memcmp(got, key, g.codes_bytes(w.key))) << "page " << p << " layer " << l << " head " << h;
        EXPECT_EQ(0, std::memcmp(got + g.k_params_offset(w), key + g.k_params_offset(wk), g.k_params_bytes()));
        EXPECT_EQ(0, std::memcmp(got + g.v_codes_offset(w), val + g.v_codes_offset(wv), g.codes_bytes(w.value)));
        EXPECT_EQ(0, std::memcmp(got + g.v_params_offset(w), val + g.v_params_offset(wv), g.v_params_bytes()));
      }
  // What sequence m of the widths pool decodes to: per (layer, head), the keys of sequence u in
  // the uniform pool of the key width, the values of u in that of the value width.
  auto decodes_as_uniform = [&](int m, int u) {
    for (int l = 0; l < g.n_layers; ++l) {
      std::vector<float> mk, mv;
      gather_sequence(mixed, l, m, codecs.data() + size_t(l) * H, mk, mv);
      for (int h = 0; h < H; ++h) {
        const BlockWidths w = mixed.layout().widths(l, h);
        std::vector<float> kk, kv, vk, vv;
        gather_sequence(*uniform[size_t(w.key - 1)], l, u, codecs.data() + size_t(l) * H, kk, kv);
        gather_sequence(*uniform[size_t(w.value - 1)], l, u, codecs.data() + size_t(l) * H, vk, vv);
        ASSERT_EQ(mk.size(), kk.size());
        for (size_t at = size_t(h) * d; at < mk.size(); at += size_t(H) * d)
          for (int c = 0; c < d; ++c) {
            ASSERT_EQ(mk[at + size_t(c)], kk[at + size_t(c)]) << "layer " << l << " head " << h << " row " << at;
            ASSERT_EQ(mv[at + size_t(c)], vv[at + size_t(c)]) << "layer " << l << " head " << h << " row " << at;
          }
      }
    }
  };
  decodes_as_uniform(s, s);
  EXPECT_EQ(mixed.bytes_in_use(), pages.size() * mixed.layout().page_bytes() + 2 * g.window_slot_bytes());
  EXPECT_EQ(int2_sequence_bytes(g, mixed.length(s), all_widths()),
            int64_t(pages.size() * mixed.layout().page_bytes() + g.window_slot_bytes()));
  EXPECT_GT(int2_sequence_bytes(g, 4096, std::vector<BlockWidths>(4, BlockWidths{4, 4})),
            int2_sequence_bytes(g, 4096, std::vector<BlockWidths>(4, BlockWidths{1, 1})));

  // Compaction moves rows at their own widths: keeping every other token of the fork equals the
  // uniform pools compacted the same way, block by block.
  mixed.free_sequence(s);
  std::vector<int64_t> kept;
  for (int64_t i = 0; i < mixed.length(f); i += 2) kept.push_back(i);
  compact_ref(mixed, f, kept, codecs.data());
  for (auto& u : uniform) compact_ref(*u, s, kept, codecs.data());
  decodes_as_uniform(f, s);
}

TEST(CacheWidths, RefusalsByName) {
  const KvGeometry g = geometry();
  // The CUDA kernels take one key and one value width a layer: a device pool whose layer mixes
  // widths across KV heads is refused before any device work (so this holds without a GPU).
  EXPECT_CONTAINS(error_of([&] {
                    KvCache(KvCacheConfig{g, 4, 1, PoolMemory::Device, all_widths()});
                  }),
                  "layer 0 holds KV head 0 at 1 / 3 bits and KV head 1 at 2 / 4");
  EXPECT_CONTAINS(error_of([&] { PageLayout(g, all_widths()).layer_blocks(1); }),
                  "one key and one value width a layer");
  // A 4-level table codes 2 bits.
  SideCodec table;
  table.use_table = 1;
  const float levels[4] = {-1.5f, -0.5f, 0.5f, 1.5f};
  std::memcpy(table.levels, levels, sizeof levels);
  std::vector<float> row(32, 0.5f);
  uint8_t codes[16];
  uint16_t params[4];
  EXPECT_CONTAINS(error_of([&] { quantize_row(g, table, 3, row.data(), codes, params); }), "codes 2 bits, not 3");
}

// The runtime serves an artifact's own widths on the host pool, names them when a device pool is
// asked for, and refuses widths the pages cannot hold.
TEST(CacheWidths, RuntimeServesTheArtifactsWidths) {
  std::mt19937 rng(2);
  Artifact a;
  a.n_layers = 2;
  a.n_heads = 4;
  a.n_kv_heads = 2;
  a.head_dim = 32;
  a.recipe.method = "hadamard";
  a.recipe.sink = 8;
  a.recipe.recent = 32;
  a.recipe.page_size = 16;
  for (int i = 0; i < 4; ++i) {
    HeadArtifact h;
    h.key.rotation = testing::random_orthogonal(1, 32, rng);
    h.value.rotation = testing::random_orthogonal(1, 32, rng);
    h.key.bits = all_widths()[size_t(i)].key;
    h.value.bits = all_widths()[size_t(i)].value;
    a.heads.push_back(h);
  }
  const EngineShape e{2, 4, 2, 32};
  Runtime rt(a, e, RuntimeOptions{8, 2, PoolMemory::Host, 0.0f});
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(rt.cache().layout().widths(i / 2, i % 2).key, all_widths()[size_t(i)].key);
    EXPECT_EQ(rt.cache().layout().widths(i / 2, i % 2).value, all_widths()[size_t(i)].value);
  }
  EXPECT_EQ(cache_widths(a).size(), 4u);
  // A slice (rank 1 of 2) holds its own heads' widths.
  RuntimeOptions ro{8, 2, PoolMemory::Host, 0.0f};
  ro.kv_begin = 1;
  ro.kv_end = 2;
  Runtime slice(a, e, ro);
  EXPECT_EQ(slice.cache().layout().widths(0, 0).key, 2);
  EXPECT_EQ(slice.cache().layout().widths(1, 0).value, 2);
  EXPECT_CONTAINS(device_scope_problem(cache_geometry(a), 4, cache_widths(a)),
                  "layer 0 holds KV head 0 at 1 / 3 bits and KV head 1 at 2 / 4");
  EXPECT_CONTAINS(error_of([&] {
                    Runtime(a, e, RuntimeOptions{8, 2, PoolMemory::Device, 0.0f});
                  }),
                  "layer 0 holds KV head 0 at 1 / 3 bits");
  a.heads[3].value.bits = 5;
  EXPECT_CONTAINS(error_of([&] { check_artifact_for_engine(a, e); }),
                  "layer 1 KV head 1 values at 5 bits: the runtime's pages hold 1 to 4 bits a code");
  a.heads[3].value.bits = 3;
  a.heads[3].value.levels = {-1.5, -0.5, 0.5, 1.5};
  EXPECT_CONTAINS(error_of([&] { check_artifact_for_engine(a, e); }), "values at 3 bits with a 4-level table");
}

}  // namespace
}  // namespace kvcc
