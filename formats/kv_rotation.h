// How the cache rotates a key or value row before it stores it: y = x·R in exact integer
// arithmetic, rounded once to BF16.
//
// Each column j of R (d × d) is held as integers Rq_ij = RN(R_ij · 2^(14 − e_j)), e_j the exponent
// with max_i |R_ij| in [2^(e_j − 1), 2^e_j); each row x as X_i = RN(x_i · 2^(22 − e_x)), e_x the
// same for max_i |x_i|. Then y_j = bf16_RN(Σ_i X_i·Rq_ij · 2^(e_x + e_j − 36)), the sum exact in
// int64. An exact sum has no order, so the CPU reference, the CUDA cores and the tensor cores
// (int8 MMAs on the bytes of X and Rq: |X| <= 2^22 is an s8 byte and two u8 ones, |Rq| <= 2^14
// an s8 and a u8) all store the same bytes; an fp32 sum would need one FMA order everywhere.
// The fixed points lose less than a BF16 rounding: X keeps 23 bits of the row's largest element
// (a bf16 input within 2^14 of it exactly), Rq 15 bits of the column's largest entry.
// A row with a NaN or an infinity rotates to NaN in every channel; a zero row or column to zeros.
#pragma once
#include <cmath>
#include <cstdint>

#include "formats/fp16.h"
#include "formats/host_device.h"

namespace kvcc {

constexpr int kRotXBits = 22;  // |X| <= 2^22
constexpr int kRotRBits = 14;  // |Rq| <= 2^14
constexpr uint16_t kRotNaN = 0x7fc0;

// e with a in [2^(e-1), 2^e) (a >= 0 finite); 0 for a = 0.
KVCC_HD int rot_exponent(float a) {
  const uint32_t u = f32_bits(a);
  if (u >= 0x00800000u) return int(u >> 23) - 126;  // normal: the exponent field
  int e = 0;
  (void)frexpf(a, &e);
  return e;
}

// RN(v · 2^(bits − e)), ties to even: the scaling is exact in float32 (a power of two; a result
// below float32's normal range is far below 1/2 and rounds to 0 either way).
// On the device: the scale as a float32 power of two where one exists (the product is then
// ldexpf's), and the rounding by adding 1.5·2^23, which leaves RN(y) in the low bits of the sum for
// |y| <= 2^22 (two adds on the fast pipes instead of a conversion).
KVCC_HD int32_t rot_fixed(float v, int e, int bits) {
#if defined(__CUDA_ARCH__)
  const int k = bits - e;
  const float y = k >= -126 && k <= 127 ? v * __int_as_float((127 + k) << 23) : ldexpf(v, k);
  return int32_t(__float_as_uint(y + 12582912.0f) - 0x4B400000u);
#else
  return int32_t(std::nearbyint(std::ldexp(v, bits - e)));
#endif
}

// The bf16 bits nearest to t·2^shift (ties to even; |t| < 2^62), by integer arithmetic alone, so
// host and device agree by construction: the leading bit of |t| fixes the result's exponent, the
// bits below its last kept bit (8 significant bits, fewer below bf16's normal range) round it.
KVCC_HD uint16_t rot_bf16(int64_t t, int shift) {
  if (t == 0) return 0;
  const uint16_t sign = t < 0 ? 0x8000u : 0u;
  const uint64_t a = t < 0 ? uint64_t(-t) : uint64_t(t);
#if defined(__CUDA_ARCH__)
  const int n = 63 - __clzll(static_cast<long long>(a));
#else
  const int n = 63 - __builtin_clzll(a);
#endif
  const int E = n + shift;  // the value is in [2^E, 2^(E + 1))
  if (E > 127) return uint16_t(sign | 0x7f80u);
  const int last = (E < -126 ? -126 : E) - 7;  // exponent of the result's last kept bit
  const int cut = last - shift;                // bits of a below it
  uint64_t m;
  if (cut <= 0) {
    m = a << -cut;
  } else if (cut > 63) {
    m = 0;  // below half of the smallest subnormal
  } else {
    m = a >> cut;
    const uint64_t rem = a & ((uint64_t(1) << cut) - 1), half = uint64_t(1) << (cut - 1);
    if (rem > half || (rem == half && (m & 1))) ++m;
  }
  // m·2^last: normal (m in [2^7, 2^8]) or subnormal (E < -126: m < 2^7, the field's exponent 0); a
  // carry to 2^8 or to 2^7 moves into the exponent field by the addition itself.
  const uint32_t field = E < -126 ? 0u : uint32_t(last + 7 + 127 - 1) << 7;
  const uint32_t bits = field + uint32_t(m);
  return uint16_t(sign | (bits >= 0x7f80u ? 0x7f80u : bits));
}

}  // namespace kvcc
