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
