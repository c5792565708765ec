// The page-row codec of the paged INT2 cache: one rotated, BF16-rounded row of head_dim values to a
// packed code row (head_dim/4 bytes) and its per-group (scale, zero) fp16 pairs, and back. The
// CPU reference kernels (runtime/append_ref, runtime/attention_ref) use it; the CUDA kernels
// reproduce it from the same primitives (formats/codec_scalar.h) in the layout of kv_layout.h.
#pragma once
#include <cstdint>

#include "formats/kv_layout.h"

namespace kvcc {

// Quantises one rotated row of head_dim values (already BF16-rounded) into a packed code row
// (d/4 bytes) and its per-group (scale, zero) fp16 pairs (2 * groups words).
void quantize_row(const KvGeometry& g, const SideCodec& codec, const float* row, uint8_t* codes, uint16_t* params);
// The values a packed row decodes to.
void dequantize_row(const KvGeometry& g, const SideCodec& codec, const uint8_t* codes, const uint16_t* params,
                    float* row);

}  // namespace kvcc
