// The scalar KV codecs, shared by the compiler (fitting, reports), the CPU reference of the cache
// and the CUDA kernels, so that every path produces the same codes bit for bit.
//
// A "group" is G consecutive channels of one token (G = head_dim by default).
//
// Uniform grid (oscar, hadamard, identity, random; DESIGN.md "Quantizers and bits"):
//   thr   = the k-th smallest |x| of the group, k = floor(ratio·G) clamped to [1, G]
//   x_c   = clamp(x, -thr, thr);  lo, hi = min, max of x_c
//   scale = fp16((hi - lo) / (2^b - 1));  zero = fp16(-lo / scale)      (both stored as fp16)
//   code  = clamp(floor(x_c / scale + zero + 1/2), 0, 2^b - 1)
//   x̂     = (code - zero) · scale
// The code is computed from the fp16-rounded scale and zero, which are what dequantisation sees.
// A constant group (hi == lo) stores scale 1 and zero -lo, so it decodes exactly to lo.
//
// Per-channel keys (kivi; kv_layout.h's per-channel key pages): the uniform grid over a channel's
// values in a group of tokens, no clip, its pair in two bytes instead of four:
//   scale = e5m3((hi - lo) / (2^b - 1)), an unsigned float of 5 exponent and 3 mantissa bits (the
//           fp16 word's bits 7-14: fp16 = byte << 7), rounded to nearest even
//   zero  = q / 4, q = clamp(rint(-lo / scale · 4), -128, 127): a signed byte of quarter steps
// and codes against that rounded pair as above. A scale of 0 or beyond fp16 stores 1 (a constant
// channel then decodes to lo within a quarter step). The zero spans ±32 steps: a channel whose
// values all lie further than 32 of its own steps from 0 saturates. Measured on real keys: zeros
// within ±15 steps, +0.1–0.2% key error against the fp16 pair (scripts/key_param_formats.py).
//
// Level table (oscar-lm, turboquant): per (layer, KV head) a sorted table of 2^b levels in units
// of the group's RMS. scale = fp16(sqrt(mean x²)); code = index of the nearest level to x/scale
// (ties to the lower level); x̂ = level[code] · scale. The zero is unused (stored as 0).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "formats/fp16.h"
#include "formats/host_device.h"

namespace kvcc {

struct GroupParams {
  uint16_t scale;  // fp16 bits
  uint16_t zero;   // fp16 bits
};

// k = floor(ratio·G), clamped to [1, G]: the rank (1-based) of the clip threshold among |x|.
KVCC_HD int clip_rank(double ratio, int G) {
  int k = int(std::floor(ratio * double(G)));
  return k < 1 ? 1 : (k > G ? G : k);
}

KVCC_HD GroupParams uniform_params(float lo, float hi, int bits) {
  const float levels = float((1 << bits) - 1);
  uint16_t sh = f16_from_float((hi - lo) / levels);
  float s = float_from_f16(sh);
  if (!(s > 0.0f) || std::isinf(s)) {  // constant group (or a range fp16 cannot hold)
    sh = f16_from_float(1.0f);
    s = 1.0f;
  }
  return GroupParams{sh, f16_from_float(-lo / s)};
}

KVCC_HD uint8_t uniform_code(float x, float scale, float zero, int bits) {
  const float maxc = float((1 << bits) - 1);
  float c = std::floor(x / scale + zero + 0.5f);
  c = c < 0.0f ? 0.0f : (c > maxc ? maxc : c);
  return uint8_t(c);
}

KVCC_HD float uniform_dequant(uint8_t code, float scale, float zero) { return (float(code) - zero) * scale; }

// Quantises one group of G values with a given clip threshold (thr > 0; pass +inf for no clip).
KVCC_HD GroupParams quantize_uniform(const float* x, int G, float thr, int bits, uint8_t* codes) {
  float lo = INFINITY, hi = -INFINITY;
  for (int i = 0; i < G; ++i) {
    float c = x[i] < -thr ? -thr : (x[i] > thr ? thr : x[i]);
    lo = c < lo ? c : lo;
    hi = c > hi ? c : hi;
  }
  GroupParams p = uniform_params(lo, hi, bits);
  const float s = float_from_f16(p.scale), z = float_from_f16(p.zero);
  for (int i = 0; i < G; ++i) {
    float c = x[i] < -thr ? -thr : (x[i] > thr ? thr : x[i]);
    codes[i] = uniform_code(c, s, z, bits);
  }
  return p;
}

// x > 0 as e5m3 (fp16's bits 7-14), rounded to nearest even: 0 for x <= 2^-18 (or NaN, or
// negative), 0xF8 (fp16 infinity) from 63488 up.
KVCC_HD uint8_t e5m3_from_float(float x) {
  if (!(x > 0.0f)) return 0;
  const uint32_t u = f32_bits(x);
  if (u >= 0x47800000u) return 0xF8u;  // >= 2^16 (and inf)
  uint32_t q, rem, mid;
  if (u < 0x38800000u) {  // below 2^-14: subnormal, units of 2^-17
    const int shift = 133 - int(u >> 23);
    if (shift > 24) return 0;  // below 2^-18
    const uint32_t mant = (u & 0x7fffffu) | 0x800000u;
    q = mant >> shift;
    rem = mant & ((1u << shift) - 1u);
    mid = 1u << (shift - 1);
  } else {
    q = (u - 0x38000000u) >> 20;
    rem = u & 0xfffffu;
    mid = 0x80000u;
  }
  if (rem > mid || (rem == mid && (q & 1u))) ++q;
  return uint8_t(q < 0xF8u ? q : 0xF8u);
}
KVCC_HD float float_from_e5m3(uint8_t b) { return float_from_f16(uint16_t(uint16_t(b) << 7)); }

struct ChanParams {
  uint8_t scale;  // e5m3
  int8_t zero;    // quarter steps
  KVCC_HD float scale_value() const { return float_from_e5m3(scale); }
  KVCC_HD float zero_value() const { return float(zero) * 0.25f; }
  // As stored: the scale in the low byte, the zero in the high one.
  KVCC_HD uint16_t word() const { return uint16_t(scale | (uint16_t(uint8_t(zero)) << 8)); }
};
KVCC_HD ChanParams chan_params_of_word(uint16_t w) { return ChanParams{uint8_t(w & 0xffu), int8_t(uint8_t(w >> 8))}; }
// The scales of bytes 0 and 2 of a word (two stored pairs, or any two scale bytes placed there) as
// the fp16 bits of a half2: how the CUDA kernels read them (finite, so one conversion is exact).
KVCC_HD uint32_t e5m3x2_as_f16x2(uint32_t w) { return (w & 0x00ff00ffu) << 7; }

KVCC_HD ChanParams chan_params(float lo, float hi, int bits) {
  ChanParams p;
  p.scale = e5m3_from_float((hi - lo) / float((1 << bits) - 1));
  float s = float_from_e5m3(p.scale);
  if (!(s > 0.0f) || std::isinf(s)) {
    p.scale = e5m3_from_float(1.0f);
    s = 1.0f;
  }
  const float q = std::rint(-lo / s * 4.0f);
  p.zero = int8_t(q > -128.0f ? (q < 127.0f ? q : 127.0f) : -128.0f);  // (a NaN: -128)
  return p;
}

// One channel's n values (stride apart) coded per channel: the pair, codes[i] for value i.
KVCC_HD ChanParams quantize_chan(const float* x, int n, int stride, int bits, uint8_t* codes) {
  float lo = INFINITY, hi = -INFINITY;
  for (int i = 0; i < n; ++i) {
    const float v = x[size_t(i) * size_t(stride)];
    lo = v < lo ? v : lo;
    hi = v > hi ? v : hi;
  }
  const ChanParams p = chan_params(lo, hi, bits);
  const float s = p.scale_value(), z = p.zero_value();
  for (int i = 0; i < n; ++i) codes[i] = uniform_code(x[size_t(i) * size_t(stride)], s, z, bits);
  return p;
}

// Level-table codec. levels: 2^bits ascending values in RMS units.
KVCC_HD uint8_t table_code(float xn, const float* levels, int n_levels) {
  int c = 0;
  for (int i = 0; i + 1 < n_levels; ++i) c += xn > 0.5f * (levels[i] + levels[i + 1]) ? 1 : 0;
  return uint8_t(c);
}

KVCC_HD GroupParams quantize_table(const float* x, int G, const float* levels, int bits, uint8_t* codes) {
  float ss = 0.0f;
  for (int i = 0; i < G; ++i) ss += x[i] * x[i];
  uint16_t sh = f16_from_float(std::sqrt(ss / float(G)));
  float s = float_from_f16(sh);
  if (!(s > 0.0f) || std::isinf(s)) {
    sh = f16_from_float(1.0f);
    s = 1.0f;
  }
  for (int i = 0; i < G; ++i) codes[i] = table_code(x[i] / s, levels, 1 << bits);
  return GroupParams{sh, 0};
}

#if !defined(__CUDACC__)
// Host: the clip threshold of one group, the clip_rank-th smallest |x| (any exact selection gives
// the same value, so device code may select differently).
inline float clip_threshold(const float* x, int G, double ratio) {
  float a[1024];
  float* abs_x = G <= 1024 ? a : new float[size_t(G)];
  for (int i = 0; i < G; ++i) abs_x[i] = std::fabs(x[i]);
  const int k = clip_rank(ratio, G);
  std::nth_element(abs_x, abs_x + (k - 1), abs_x + G);
  const float thr = abs_x[k - 1];
  if (abs_x != a) delete[] abs_x;
  return thr;
}
#endif

KVCC_HD float table_dequant(uint8_t code, float scale, const float* levels) { return levels[code] * scale; }

}  // namespace kvcc
