// The page-row codec of the paged INT2 cache: one rotated, BF16-rounded row of head_dim values to a
// packed code row (head_dim·bits/8 bytes) and its per-group (scale, zero) fp16 pairs, and back;
// and a whole page side in a page block's layout (kv_layout.h), which per-channel keys need (their
// parameters span the page's tokens). Widths of 1-4 bits; a level table (4 levels) is 2 bits. The CPU reference kernels
// (runtime/append_ref, runtime/attention_ref) use it; the CUDA kernels reproduce the per-token form from the same
// primitives (formats/codec_scalar.h) in the layout of kv_layout.h.
#pragma once
#include <cstdint>

#include "formats/kv_layout.h"

namespace kvcc {

// Quantises one rotated row of head_dim values (already BF16-rounded) into a packed code row
// (d·bits/8 bytes) and its per-group (scale, zero) fp16 pairs (2 * groups words).
void quantize_row(const KvGeometry& g, const SideCodec& codec, int bits, const float* row, uint8_t* codes,
                  uint16_t* params);
// The values a packed row decodes to.
void dequantize_row(const KvGeometry& g, const SideCodec& codec, int bits, const uint8_t* codes, const uint16_t* params,
                    float* row);

// One side of a full page: rows [P][d] (rotated, BF16-rounded) into the page block `block` (the
// start of a (page, layer, head) block of widths w). Values, and keys when g.key_group_tokens ==
// 0, row by row (quantize_row). Per-channel keys: for every channel c and group of T =
// key_group_tokens tokens, the uniform grid over those T values with no clip (KIVI's keys,
// formats/kv_codec.h), its (scale, zero) pair at K params [group][c]: fp16, or with
// g.key_pair_bytes = 2 codec_scalar.h's ChanParams.
void quantize_page_side(const KvGeometry& g, const SideCodec& codec, bool key, BlockWidths w, const float* rows,
                        uint8_t* block);
// What row `row` of a page block's side decodes to ([d] values).
void dequantize_page_row(const KvGeometry& g, const SideCodec& codec, bool key, BlockWidths w, const uint8_t* block,
                         int row, float* out);

}  // namespace kvcc
