// Key and value rows rotated on the tensor cores in the cache's exact fixed point
// (formats/kv_rotation.h): int8 MMAs on the bytes of X (a row, hi s8 + mid u8 + lo u8) and Rq (a
// column of R, hi s8 + lo u8), six byte pairs summed by weight (2^24, 2^16, 2^8, 2^0) in int32
// (each below 2^23), joined in int64 and rounded once to BF16: the integers the CPU reference sums
// (append_ref.cpp), so both store the same bytes. Used by the append (append.cu) and by prefill's
// new keys and values (prefill.cu). Device code only; head_dim 128.
#pragma once
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "formats/fp16.h"
#include "formats/kv_rotation.h"
#include "runtime/kv_kernels.h"
#include "runtime/ptx.cuh"

namespace kvcc {

constexpr int kRotD = 128;
// A plane's row padded by 16 bytes: the 32 lanes' fragment loads (rows g, words t) hit 32 banks.
constexpr int kRotRowBytes = kRotD + 16;
constexpr int kRotBadRow = INT_MIN;  // a row exponent: the row holds NaN or inf (rotates to NaN)

// rot_bf16 on the conversion unit: t (|t| < 2^53) is exact in double, and so is t·2^shift
// (|shift| < 1000 keeps it in double's normal range); its one rounding to bf16 (cvt.rn: ties to
// even, subnormals, overflow to inf) is rot_bf16's. No branch (the rotations'
// |t| < 2^45 and |shift| < 400: rot_acc_bf16).
__device__ __forceinline__ uint16_t rot_bf16_fast(int64_t t, int shift) {
  const double y = __ll2double_rn(t) * __longlong_as_double(static_cast<long long>(1023 + shift) << 52);
  uint16_t h;
  asm("cvt.rn.bf16.f64 %0, %1;" : "=h"(h) : "d"(y));
  return h;
}

// Up to kRows rows in fixed point: the byte planes of X = hi·2^16 + mid·2^8 + lo (hi s8, the others
// u8) and each row's exponent e_x.
template <int kRows>
struct RotRows {
  static_assert(kRows % 16 == 0, "whole MMA row tiles");
  uint8_t plane[3][kRows][kRotRowBytes];
  int ex[kRows];
};

// A warp's block cb of 32 output columns of R in fixed point. Lane (g = lane / 4, t = lane % 4)
// holds the B fragments of Rq's bytes hi (s8) and lo (u8), Rq = hi·2^8 + lo, for column
// 32·cb + 8n + g of n-tile n and k-step s (input channels 32s + 4t .. + 3 in b0, 32s + 16 + 4t ..
// in b1), and the exponents of the two columns its accumulators hold in each n-tile (8n + 2t, + 1).
struct RotCols {
  uint32_t hi[4][4][2], lo[4][4][2];
  int e[4][2];
};

// A lane's RotCols as words: hi (32), lo (32), the exponents (8).
constexpr int kRotLaneWords = 72;
static_assert(sizeof(RotCols) == kRotLaneWords * 4, "RotCols is its words");
static_assert(kRotFragmentWords == kRotD / 32 * kRotLaneWords * 32, "RotFragments: 4 warps' fragments");

// R: one head's [kRotD][kRotD] fp32 (x_rot = x·R; finite: the artifact's check). Every lane calls.
// (Once per layer, by rot_fragments; the kernels read the result with load_rot_frags.)
__device__ __forceinline__ void rot_cols_from_fp32(const float* R, int cb, RotCols& rc) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int n = 0; n < 4; ++n) {
    const int col = 32 * cb + 8 * n + g;
    float v[4][2][4];
    float mx = 0.0f;
#pragma unroll
    for (int s = 0; s < 4; ++s)
#pragma unroll
      for (int b = 0; b < 2; ++b)
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          v[s][b][u] = __ldg(R + size_t(32 * s + 16 * b + 4 * t + u) * kRotD + col);
          mx = fmaxf(mx, fabsf(v[s][b][u]));
        }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));  // the column's other 96 entries
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const int e = rot_exponent(mx);
#pragma unroll
    for (int s = 0; s < 4; ++s)
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        uint32_t hi = 0, lo = 0;
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const int32_t q = rot_fixed(v[s][b][u], e, kRotRBits);
          hi |= uint32_t((q >> 8) & 0xff) << (8 * u);
          lo |= uint32_t(q & 0xff) << (8 * u);
        }
        rc.hi[n][s][b] = hi;
        rc.lo[n][s][b] = lo;
      }
    rc.e[n][0] = __shfl_sync(0xffffffffu, e, 8 * t);  // lane 4·g' holds column g' = 2t
    rc.e[n][1] = __shfl_sync(0xffffffffu, e, 8 * t + 4);
  }
}

// RotFragments layout: column block cb's words as [cb][18 uint4][lane] (word q of a lane in uint4
// q / 4), so that each of a warp's 18 loads reads 512 contiguous bytes.
// Word q of a lane's RotCols (q a constant after unrolling: the fragments stay in registers).
__device__ __forceinline__ uint32_t& rot_word(RotCols& rc, int q) {
  return q < 32   ? rc.hi[q / 8][(q / 2) % 4][q % 2]
         : q < 64 ? rc.lo[(q - 32) / 8][((q - 32) / 2) % 4][q % 2]
                  : reinterpret_cast<uint32_t&>(rc.e[(q - 64) / 2][q % 2]);
}
__device__ __forceinline__ void store_rot_frags(RotCols& rc, int cb, RotFragments* F) {
  uint4* dst = reinterpret_cast<uint4*>(F->words) + cb * (kRotLaneWords / 4) * 32 + (threadIdx.x & 31);
#pragma unroll
  for (int q = 0; q < kRotLaneWords / 4; ++q)
    dst[32 * q] =
        make_uint4(rot_word(rc, 4 * q), rot_word(rc, 4 * q + 1), rot_word(rc, 4 * q + 2), rot_word(rc, 4 * q + 3));
}
__device__ __forceinline__ void load_rot_frags(const RotFragments* F, int cb, RotCols& rc) {
  const uint4* src = reinterpret_cast<const uint4*>(F->words) + cb * (kRotLaneWords / 4) * 32 + (threadIdx.x & 31);
#pragma unroll
  for (int q = 0; q < kRotLaneWords / 4; ++q) {
    const uint4 u = __ldg(src + 32 * q);
    rot_word(rc, 4 * q) = u.x, rot_word(rc, 4 * q + 1) = u.y, rot_word(rc, 4 * q + 2) = u.z,
                     rot_word(rc, 4 * q + 3) = u.w;
  }
}

// Row r of rr from its 128 values, 4 a lane (channels 4·lane ..): the exponent and the bytes. A
// warp calls (zeros for a padding row).
template <int kRows>
__device__ __forceinline__ void put_rot_row(const float (&v)[4], RotRows<kRows>& rr, int r) {
  const int lane = threadIdx.x & 31;
  bool finite = true;
  float mx = 0.0f;
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    finite = finite && isfinite(v[u]);
    mx = fmaxf(mx, fabsf(v[u]));
  }
  finite = __all_sync(0xffffffffu, finite);
  // (non-negative floats order as their bit patterns)
  mx = __uint_as_float(__reduce_max_sync(0xffffffffu, __float_as_uint(mx)));
  const int e = rot_exponent(finite ? mx : 0.0f);
  uint32_t p[3] = {0, 0, 0};
  if (finite)
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int32_t X = rot_fixed(v[u], e, kRotXBits);
      p[0] |= uint32_t((X >> 16) & 0xff) << (8 * u);
      p[1] |= uint32_t((X >> 8) & 0xff) << (8 * u);
      p[2] |= uint32_t(X & 0xff) << (8 * u);
    }
#pragma unroll
  for (int pl = 0; pl < 3; ++pl) *reinterpret_cast<uint32_t*>(&rr.plane[pl][r][4 * lane]) = p[pl];
  if (lane == 0) rr.ex[r] = finite ? e : kRotBadRow;
}

// Row r of rr as zeros: what put_rot_row stores for a zero row, without its reductions (the padding
// rows of a long append tile's last 16-row MMA tile, whose outputs are not kept). A warp calls.
template <int kRows>
__device__ __forceinline__ void put_zero_row(RotRows<kRows>& rr, int r) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int pl = 0; pl < 3; ++pl) *reinterpret_cast<uint32_t*>(&rr.plane[pl][r][4 * lane]) = 0u;
  if (lane == 0) rr.ex[r] = 0;  // rot_exponent(0)
}

// The A fragments of k-step s of the 16-row tile whose lane rows are r0 = 16m + g and r0 + 8, for
// each byte plane (channels 32s + 4t .. and 32s + 16 + 4t ..).
template <int kRows>
__device__ __forceinline__ void load_row_frags(const RotRows<kRows>& rr, int r0, int s, uint32_t (&a)[3][4]) {
  const int t = threadIdx.x & 3;
#pragma unroll
  for (int pl = 0; pl < 3; ++pl) {
    a[pl][0] = *reinterpret_cast<const uint32_t*>(&rr.plane[pl][r0][32 * s + 4 * t]);
    a[pl][1] = *reinterpret_cast<const uint32_t*>(&rr.plane[pl][r0 + 8][32 * s + 4 * t]);
    a[pl][2] = *reinterpret_cast<const uint32_t*>(&rr.plane[pl][r0][32 * s + 16 + 4 * t]);
    a[pl][3] = *reinterpret_cast<const uint32_t*>(&rr.plane[pl][r0 + 8][32 * s + 16 + 4 * t]);
  }
}

// The six byte-plane products of one k-step into a 16 x 8 output tile: acc[c] weighs 2^(24 − 8c)
// (the rows' hi / mid / lo planes a[0..2] times R's hi bytes h0, h1 and lo bytes l0, l1).
__device__ __forceinline__ void rot_mma_kstep(int (&acc)[4][4], const uint32_t (&a)[3][4], uint32_t h0, uint32_t h1,
                                              uint32_t l0, uint32_t l1) {
  mma_i8<true, true>(acc[0], a[0], h0, h1);    // hi·hi: 2^24
  mma_i8<true, false>(acc[1], a[0], l0, l1);   // hi·lo: 2^16
  mma_i8<false, true>(acc[1], a[1], h0, h1);   // mid·hi: 2^16
  mma_i8<false, false>(acc[2], a[1], l0, l1);  // mid·lo: 2^8
  mma_i8<false, true>(acc[2], a[2], h0, h1);   // lo·hi: 2^8
  mma_i8<false, false>(acc[3], a[2], l0, l1);  // lo·lo: 2^0
}
// Fragment element i of a tile's accumulators as bf16: the exact sum rounded once, for a row of
// exponent ex (kRotBadRow: NaN) and a column of exponent e.
__device__ __forceinline__ uint16_t rot_acc_bf16(const int (&acc)[4][4], int i, int ex, int e) {
  // (each partial below 2^31: hi < 2^28, lo < 2^30 + 2^23; the sum below 2^45. ex and e lie in
  // [-148, 128]: float exponents)
  const int32_t hi = acc[0][i] * 256 + acc[1][i], lo = acc[2][i] * 256 + acc[3][i];
  const int64_t sum = (int64_t(hi) << 16) + int64_t(lo);
  return ex == kRotBadRow ? kRotNaN : rot_bf16_fast(sum, ex + e - kRotXBits - kRotRBits);
}

// Rows [16m, 16m + 16) of rr times the warp's column block cb (rc): out(row, col, y) for each
// pair of adjacent output columns (col, col + 1) of the rows below n, y their two bf16 values
// (col's in the low half).
template <int kRows, typename Out>
__device__ __forceinline__ void rotate_rows(const RotRows<kRows>& rr, int m, int n, const RotCols& rc, int cb,
                                            Out&& out) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  int acc[4][4][4];  // [n-tile][weight 2^24, 2^16, 2^8, 2^0][fragment element]
#pragma unroll
  for (int n = 0; n < 4; ++n)
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[n][c][0] = acc[n][c][1] = acc[n][c][2] = acc[n][c][3] = 0;
  const int r0 = 16 * m + g;
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    uint32_t a[3][4];
    load_row_frags(rr, r0, s, a);
#pragma unroll
    for (int n = 0; n < 4; ++n)
      rot_mma_kstep(acc[n], a, rc.hi[n][s][0], rc.hi[n][s][1], rc.lo[n][s][0], rc.lo[n][s][1]);
  }
  const int ex[2] = {rr.ex[r0], rr.ex[r0 + 8]};
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    if (r0 + 8 * half >= n) continue;  // (a decode step's tile holds a few rows of the 16)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      uint32_t y = 0;
#pragma unroll
      for (int c = 0; c < 2; ++c) y |= uint32_t(rot_acc_bf16(acc[nt], 2 * half + c, ex[half], rc.e[nt][c])) << (16 * c);
      out(r0 + 8 * half, 32 * cb + 8 * nt + 2 * t, y);
    }
  }
}

}  // namespace kvcc
