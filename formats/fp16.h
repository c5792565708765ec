// IEEE half and bfloat16 as raw 16-bit words with round-to-nearest-even conversions, so host code
// (the CPU references) and CUDA code (__float2half_rn / __float2bfloat16_rn) agree bit for bit.
#pragma once
#include <cstdint>
#include <cstring>

#include "formats/host_device.h"

namespace kvcc {

KVCC_HD uint32_t f32_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}
KVCC_HD float f32_from_bits(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// float -> IEEE binary16, round to nearest even; overflow gives inf, NaN stays NaN.
KVCC_HD uint16_t f16_from_float(float f) {
  uint32_t x = f32_bits(f);
#if defined(__CUDA_ARCH__)
  // The conversion unit rounds the same way (ties to even, subnormals, overflow to inf): one
  // instruction instead of the branches below, which the quantisers ran for every row's scale and
  // zero. Only NaN payloads differ (it returns the canonical NaN): those take the software path.
  if ((x & 0x7fffffffu) <= 0x7f800000u) {
    uint16_t h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
  }
#endif
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t absx = x & 0x7fffffffu;
  if (absx >= 0x7f800000u) return uint16_t(sign | 0x7c00u | (absx > 0x7f800000u ? 0x200u : 0u));
  if (absx >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to >= 65520: inf
  if (absx < 0x38800000u) {                                  // subnormal half or zero
    if (absx < 0x33000000u) return uint16_t(sign);           // < 2^-25: rounds to zero
    uint32_t mant = (absx & 0x7fffffu) | 0x800000u;
    int shift = 126 - int(absx >> 23);  // 14..24
    uint32_t half = mant >> shift;
    uint32_t rem = mant & ((1u << shift) - 1u);
    uint32_t mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1u))) ++half;
    return uint16_t(sign | half);
  }
  uint32_t h = ((absx - 0x38000000u) >> 13);
  uint32_t rem = absx & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return uint16_t(sign | h);
}

KVCC_HD float float_from_f16(uint16_t h) {
#if defined(__CUDA_ARCH__)
  if ((h & 0x7c00u) != 0x7c00u) {  // finite: exact in hardware (inf and NaN as below)
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
  }
#endif
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    if (mant == 0) return f32_from_bits(sign);
    float v = float(mant) * (1.0f / 16777216.0f);  // mant * 2^-24
    return sign ? -v : v;
  }
  if (exp == 31) return f32_from_bits(sign | 0x7f800000u | (mant << 13));
  return f32_from_bits(sign | ((exp + 112u) << 23) | (mant << 13));
}

// float -> bfloat16, round to nearest even; NaN stays NaN.
KVCC_HD uint16_t bf16_from_float(float f) {
  uint32_t x = f32_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return uint16_t((x >> 16) | 0x40u);
  uint32_t lsb = (x >> 16) & 1u;
  return uint16_t((x + 0x7fffu + lsb) >> 16);
}

KVCC_HD float float_from_bf16(uint16_t b) { return f32_from_bits(uint32_t(b) << 16); }

// Rounds through the 16-bit format and back: the value the cache actually holds.
KVCC_HD float round_f16(float f) { return float_from_f16(f16_from_float(f)); }
KVCC_HD float round_bf16(float f) { return float_from_bf16(bf16_from_float(f)); }

}  // namespace kvcc
