// The paged mixed-precision KV cache layout, shared by the host cache bookkeeping, the CPU
// reference kernels and the CUDA kernels (KVCC_HD), so that every path reads and writes the same
// bytes. docs/runtime.md describes it with a picture.
//
// Per layer and sequence the logical token order is
//     [sink: first S tokens, BF16][history: INT2 pages of P tokens][recent ring: last tokens, BF16]
// Keys are stored post-RoPE and rotated (k·R_k) in both tiers, values in the R_v basis (v·R_v).
//
// Tiers are a pure function of the sequence length n (tiers_of): the first min(n, S) tokens are
// the sink; of the rest ("post-sink" tokens, index i = position − S), the ring holds at most W.
// When a token arrives while the ring holds W, the ring's oldest P tokens are first quantised into
// one new INT2 page. So history is always whole pages, and the ring holds the post-sink tokens
// [hist, post), token i in ring slot i mod W.
//
// Memory: one pool = [pages region][window-slot region].
//  - A page id addresses a block for every (layer, KV head) of that page:
//      page block (page, layer, head), page_head_bytes long:
//        K codes  [P][d·B_k/8]  uint8, B_k bits a code, a row in bit planes (pack_codes): at 2
//                 bits channel c at byte c/4, bits 2·(c%4)
//        V codes  [P][d·B_v/8]
//        K params [P][groups]   (scale, zero) fp16 pairs, one per group of G channels of a token;
//                 or, with per-channel keys (key_group_tokens = T > 0, KIVI), [P/T][d]: one pair
//                 per channel per group of T consecutive tokens of the page, fp16 pairs (KIVI as
//                 published) or 2-byte ones (key_pair_bytes = 2: codec_scalar.h ChanParams)
//        V params [P][groups]
//    Per-channel key parameters depend on every token of their group, so they exist only once
//    the page is full: pages are written once, whole, when the ring flushes them (as always).
//    Code widths B_k, B_v (1-4 bits) are 2 unless the artifact gives a (layer, KV head) its own
//    (compile --bits-budget); the blocks of a page then differ in length and PageLayout places
//    them (in (layer, head) order, each after the last). The CUDA kernels take one key and one
//    value width a layer (LayerBlocks).
//  - A window slot (one per live sequence) holds for every (layer, KV head):
//        K sink [S][d] bf16, V sink [S][d], K ring [W][d], V ring [W][d]
//    It is the only mutable per-sequence state, so forking copies it and shares the pages.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "formats/host_device.h"

namespace kvcc {

// Code bits of one (layer, KV head) block: its key and its value codes (1-4 each).
struct BlockWidths {
  int key = 2, value = 2;
};

struct KvGeometry {
  int n_layers = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  int group = 0;         // channels per (scale, zero) of a token row; head_dim divisible by group
  int page_tokens = 64;  // P
  int sink = 64;         // S
  int recent = 256;      // W (>= P)
  // 0: keys per token like values (groups of `group` channels). T > 0 (dividing P): keys per
  // channel over groups of T tokens of the page (KIVI's keys); `group` then applies to values only.
  int key_group_tokens = 0;
  // Per-channel keys: bytes of a channel's (scale, zero) pair: 4, fp16 (KIVI as published), or 2
  // (codec_scalar.h ChanParams; recipe param key_params=e5m3), the pages the CUDA kernels serve.
  int key_pair_bytes = 4;

  KVCC_HD bool per_channel_keys() const { return key_group_tokens > 0; }
  KVCC_HD bool e5m3_key_pairs() const { return per_channel_keys() && key_pair_bytes == 2; }
  KVCC_HD int groups() const { return head_dim / group; }
  // A row of head_dim codes of `bits` bits (whole bytes: PageLayout refuses widths that give none).
  KVCC_HD size_t code_row_bytes(int bits = 2) const { return size_t(head_dim) * size_t(bits) / 8; }
  KVCC_HD size_t codes_bytes(int bits = 2) const { return size_t(page_tokens) * code_row_bytes(bits); }
  // Per-token (scale, zero) pairs of one side: [P][groups].
  KVCC_HD size_t params_bytes() const { return size_t(page_tokens) * size_t(groups()) * 4; }
  // Key token groups of a page (per-channel keys): P / T.
  KVCC_HD int key_token_groups() const { return per_channel_keys() ? page_tokens / key_group_tokens : 0; }
  KVCC_HD size_t k_params_bytes() const {
    return per_channel_keys() ? size_t(key_token_groups()) * size_t(head_dim) * size_t(key_pair_bytes) : params_bytes();
  }
  KVCC_HD size_t v_params_bytes() const { return params_bytes(); }
  // One page block of widths w, and its parts' offsets; the defaults are the 2-bit block.
  KVCC_HD size_t page_head_bytes(BlockWidths w = {}) const {
    return codes_bytes(w.key) + codes_bytes(w.value) + k_params_bytes() + v_params_bytes();
  }
  KVCC_HD size_t k_codes_offset() const { return 0; }
  KVCC_HD size_t v_codes_offset(BlockWidths w = {}) const { return codes_bytes(w.key); }
  KVCC_HD size_t k_params_offset(BlockWidths w = {}) const { return codes_bytes(w.key) + codes_bytes(w.value); }
  KVCC_HD size_t v_params_offset(BlockWidths w = {}) const { return k_params_offset(w) + k_params_bytes(); }
  // A page of 2-bit blocks, and the offset of block (page, layer, head) from the start of the
  // pages region in such a pool (the CUDA kernels' layout; PageLayout's when every width is 2).
  KVCC_HD size_t page_bytes() const { return page_head_bytes() * size_t(n_layers) * size_t(n_kv_heads); }
  KVCC_HD size_t page_block_offset(int64_t page, int layer, int head) const {
    return ((size_t(page) * size_t(n_layers) + size_t(layer)) * size_t(n_kv_heads) + size_t(head)) * page_head_bytes();
  }

  // Window slot: bf16 elements per (layer, head) block and per slot.
  KVCC_HD size_t window_head_elems() const { return 2 * (size_t(sink) + size_t(recent)) * size_t(head_dim); }
  KVCC_HD size_t window_slot_bytes() const { return window_head_elems() * 2 * size_t(n_layers) * size_t(n_kv_heads); }
  // Element offsets (bf16 units) of the four arrays inside one (slot, layer, head) block.
  KVCC_HD size_t k_sink_elem() const { return 0; }
  KVCC_HD size_t v_sink_elem() const { return size_t(sink) * size_t(head_dim); }
  KVCC_HD size_t k_ring_elem() const { return 2 * size_t(sink) * size_t(head_dim); }
  KVCC_HD size_t v_ring_elem() const { return (2 * size_t(sink) + size_t(recent)) * size_t(head_dim); }
  KVCC_HD size_t window_block_elem(int64_t slot, int layer, int head) const {
    return ((size_t(slot) * size_t(n_layers) + size_t(layer)) * size_t(n_kv_heads) + size_t(head)) *
           window_head_elems();
  }
};

// Where the tokens of a sequence of length n live.
struct KvTiers {
  int64_t n = 0;
  int sink_count = 0;       // tokens in the sink (positions 0..sink_count-1)
  int64_t hist_tokens = 0;  // post-sink tokens in INT2 pages (always whole pages)
  int ring_count = 0;       // post-sink tokens hist_tokens..hist_tokens+ring_count-1, in the ring
};

KVCC_HD KvTiers tiers_of(const KvGeometry& g, int64_t n) {
  KvTiers t;
  t.n = n;
  t.sink_count = int(n < g.sink ? n : g.sink);
  const int64_t post = n - t.sink_count;
  if (post <= g.recent) {
    t.hist_tokens = 0;
  } else {
    const int64_t flushes = (post - g.recent + g.page_tokens - 1) / g.page_tokens;
    t.hist_tokens = flushes * g.page_tokens;
  }
  t.ring_count = int(post - t.hist_tokens);
  return t;
}

KVCC_HD int64_t history_pages(const KvGeometry& g, int64_t n) { return tiers_of(g, n).hist_tokens / g.page_tokens; }

// Tokens of a sequence of length n in quantised pages: tiers_of's history, which for a ring at
// least a page long (every geometry the runtime serves) is at most the post-sink tokens; with a
// ring shorter than a page (the codec path of validate only) whole pages of the post-sink tokens.
KVCC_HD int64_t quantised_tokens(const KvGeometry& g, int64_t n) {
  const int64_t post = n - (n < g.sink ? n : g.sink), hist = tiers_of(g, n).hist_tokens;
  const int64_t whole = post / g.page_tokens * g.page_tokens;
  return hist < whole ? hist : whole;
}

// Ring slot of post-sink token i.
KVCC_HD int ring_slot(const KvGeometry& g, int64_t i) { return int(i % g.recent); }

// A row of d codes at 1-4 bits (d a multiple of 8) is bit planes, each laid out so that a kernel
// built for 2-bit rows reads every width with the same channel order (its MMA fragments, its query
// permutation), only adding planes into the codes it has:
//  - a 2-bit plane (d/4 bytes): channel c at byte c/4, bits 2·(c%4);
//  - a 1-bit plane (d/8 bytes): channel c of the row's first half at byte 4·(c/16) + (c%16)/4,
//    bit c%4, and channel c + d/2 at the same byte, bit 4 + c%4 (a 32-bit word of it holds one bit
//    of the same 16 + 16 channels as 2-bit words w and w + d/32 hold two).
// 1 bit: the 1-bit plane. 2 bits: the 2-bit plane. 3 bits: the 2-bit plane of bits 0-1, then the
// 1-bit plane of bit 2. 4 bits: the 2-bit plane of bits 0-1, then that of bits 2-3. (Codes packed
// LSB first would put a 3-bit code across two bytes and give each width its own channel order.)
//
// Channel c's fields in a row of d codes at `bits` bits, planes in order: f(byte, shift, width,
// code_bit) for each, the field's width bits at `shift` of row byte `byte` holding code bits
// code_bit .. code_bit + width − 1.
template <class F>
KVCC_HD void for_each_code_field(int c, int d, int bits, F f) {
  for (int code_bit = 0, off = 0; code_bit < bits;) {
    const int width = bits - code_bit >= 2 ? 2 : 1;
    if (width == 2) {
      f(off + (c >> 2), 2 * (c & 3), width, code_bit);
    } else {
      const int half = c >= d / 2, i = c - half * (d / 2);
      f(off + 4 * (i >> 4) + ((i & 15) >> 2), 4 * half + (i & 3), width, code_bit);
    }
    off += d * width / 8;
    code_bit += width;
  }
}

// The code of channel c in a row of d codes at `bits` bits.
KVCC_HD uint8_t unpack_code(const uint8_t* row, int d, int c, int bits = 2) {
  unsigned code = 0;
  for_each_code_field(c, d, bits, [&](int byte, int shift, int width, int code_bit) {
    code |= ((unsigned(row[byte]) >> shift) & ((1u << width) - 1u)) << code_bit;
  });
  return uint8_t(code);
}

// Packs d codes (each below 2^bits) into the d·bits/8 bytes of a row (unpack_code's layout).
KVCC_HD void pack_codes(const uint8_t* codes, int d, uint8_t* row, int bits = 2) {
  for (int b = 0; b < d * bits / 8; ++b) row[b] = 0;
  for (int c = 0; c < d; ++c)
    for_each_code_field(c, d, bits, [&](int byte, int shift, int width, int code_bit) {
      row[byte] = uint8_t(row[byte] | (((unsigned(codes[c]) >> code_bit) & ((1u << width) - 1u)) << shift));
    });
}

// One layer's blocks as the CUDA kernels address them: every KV head of the layer at the same
// widths, block (page, head) at page·page_bytes + layer_offset + head·head_bytes. The 2-bit layout
// of KvGeometry (page_block_offset) by default; PageLayout::layer_blocks for a pool with widths.
struct LayerBlocks {
  size_t page_bytes = 0, layer_offset = 0, head_bytes = 0;
  BlockWidths widths;
  KVCC_HD size_t block_offset(int64_t page, int head) const {
    return size_t(page) * page_bytes + layer_offset + size_t(head) * head_bytes;
  }
};
KVCC_HD LayerBlocks two_bit_layer_blocks(const KvGeometry& g, int layer) {
  LayerBlocks b;
  b.page_bytes = g.page_bytes();
  b.layer_offset = g.page_block_offset(0, layer, 0);
  b.head_bytes = g.page_head_bytes();
  return b;
}

// Where the blocks of a page are when (layer, KV head) blocks have their own code widths: block
// (layer, head) at page·page_bytes() + offset[layer·H + head], the blocks in (layer, head) order.
// With every width 2 this is KvGeometry::page_block_offset. Host bookkeeping (KvCache owns one).
class PageLayout {
 public:
  PageLayout() = default;
  // widths: [n_layers · n_kv_heads], each side 1..4 bits; empty: 2 bits everywhere. Throws Error
  // on a bad width or a row of codes that is not whole bytes.
  PageLayout(const KvGeometry& g, std::vector<BlockWidths> widths);
  const BlockWidths& widths(int layer, int head) const {
    return widths_[size_t(layer) * size_t(heads_) + size_t(head)];
  }
  size_t page_bytes() const { return page_bytes_; }
  size_t block_offset(int64_t page, int layer, int head) const {
    return size_t(page) * page_bytes_ + offset_[size_t(layer) * size_t(heads_) + size_t(head)];
  }
  // Every block 2 bits a side.
  bool two_bit() const { return two_bit_; }
  // Layer `layer`'s blocks for the CUDA kernels; throws Error when its KV heads differ in widths.
  LayerBlocks layer_blocks(int layer) const;
  // Why the CUDA kernels cannot hold this layout (a layer whose KV heads differ in widths), or "".
  std::string kernel_problem() const;

 private:
  int heads_ = 0;
  KvGeometry geo_;
  std::vector<BlockWidths> widths_;
  std::vector<size_t> offset_;
  size_t page_bytes_ = 0;
  bool two_bit_ = true;
};

// Per (layer, KV head) quantizer of one side (K or V): the uniform grid with a clip ratio, or
// a 4-level table (oscar-lm). Semantics are codec_scalar.h's.
struct SideCodec {
  float clip_ratio = 1.0f;  // uniform grid
  int use_table = 0;        // 1: level table
  float levels[4] = {0, 0, 0, 0};
};
struct HeadCodec {
  SideCodec key, value;
};

}  // namespace kvcc
