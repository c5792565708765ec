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
  int e = 0;
  (void)frexpf(a, &e);
  return e;
}

// RN(v · 2^(bits − e)) (exact scaling in float64, ties to even).
KVCC_HD int32_t rot_fixed(float v, int e, int bits) { return int32_t(rint(ldexp(double(v), bits - e))); }

// bf16_RN(t · 2^shift), t an exact sum (|t| < 2^53): t·2^shift is exact in float64; rounded toward
// zero to float32 with a sticky last bit (round to odd), then to nearest bf16, which is the nearest
// bf16 of the exact value (float32 keeps 16 more bits than bf16, over the same exponent range).
KVCC_HD uint16_t rot_bf16(int64_t t, int shift) {
  const double d = ldexp(double(t), shift);
  float f = float(d);
  if (fabs(double(f)) > fabs(d)) f = nextafterf(f, 0.0f);
  uint32_t b = f32_bits(f);
  if (double(f) != d) b |= 1u;
  return bf16_from_float(f32_from_bits(b));
}

}  // namespace kvcc
