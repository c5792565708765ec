// Append kernel: rotate + round to BF16, quantise the tokens that enter history (new, or from the
// old ring) into their pages, write sink and ring; one launch per layer.
// Semantics: runtime/append_ref.cpp. The host plans which token goes where from the lengths
// (plan_append_moves, runtime/plan.cpp).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <string>
#include <type_traits>

#include "formats/codec_scalar.h"
#include "formats/error.h"
#include "formats/fp16.h"
#include "formats/kv_layout.h"
#include "runtime/activations.h"
#include "runtime/cuda_util.cuh"
#include "runtime/engine_step.h"
#include "runtime/kv_kernels.h"
#include "runtime/plan.h"
#include "runtime/ptx.cuh"
#include "runtime/rotate_kv.cuh"
#include "runtime/served.h"

namespace kvcc {
namespace {

constexpr int kD = kGpuHeadDim;
using Move = AppendMove;
using WindowWrite = AppendWindowWrite;

// The k-th smallest (1 <= k <= 128) of a warp's 128 values, 4 per lane: a bitonic sort of element
// e = 4·lane + r (in-lane exchanges for strides 1 and 2, shuffles above), then element k - 1
// broadcast. 15 rounds of 4 shuffles; counting ranks (each value against all 128) took 128
// shuffles and 1024 compares, most of a long append's time.
// (Not inlined: fitted and published clips take the path below; this one stays out of the hot
// code, which it would double. The values by value: an array would go through local memory.)
__device__ __noinline__ float warp_kth_smallest(float4 v, int k) {
  const int lane = threadIdx.x & 31;
  float a[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int size = 2; size <= 4 * 32; size <<= 1)
#pragma unroll
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      if (stride >= 4) {
        const bool lower = (lane & (stride >> 2)) == 0;
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const bool up = ((4 * lane + r) & size) == 0;
          const float o = __shfl_xor_sync(0xffffffffu, a[r], stride >> 2);
          a[r] = lower == up ? fminf(a[r], o) : fmaxf(a[r], o);
        }
      } else {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          if (r & stride) continue;
          const bool up = ((4 * lane + r) & size) == 0;
          const float lo = fminf(a[r], a[r + stride]), hi = fmaxf(a[r], a[r + stride]);
          a[r] = up ? lo : hi;
          a[r + stride] = up ? hi : lo;
        }
      }
    }
  const int e = k - 1;
  const float mine = (e & 3) == 0 ? a[0] : (e & 3) == 1 ? a[1] : (e & 3) == 2 ? a[2] : a[3];
  return __shfl_sync(0xffffffffu, mine, e >> 2);
}

// The same value when it is among the 16 largest (k >= 113: the clip ratios fitted and published
// are 0.92 or more, k >= 117): each lane sorts its 4 keys (the bit patterns of |x|, which order
// non-negative floats as integers; a NaN takes key 0: never above a number), then m = 129 - k
// rounds of a warp maximum of the lanes' largest (redux.sync), each popping that key off the lowest
// lane holding it: round m's maximum is the m-th largest, copies counted.
constexpr int kTopRounds = 16;
// N rows at once (one k: one head and side), their latency chains interleaved.
template <int N>
__device__ __forceinline__ void warp_kth_smallest_of_top(const float (&a)[N][4], int k, float (&thr)[N]) {
  const unsigned lane_bit = 1u << (threadIdx.x & 31);
  const int m = 4 * 32 + 1 - k;
  unsigned key[N][4];
#pragma unroll
  for (int n = 0; n < N; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) key[n][e] = isnan(a[n][e]) ? 0u : __float_as_uint(a[n][e]);
    auto order = [&](int i, int j) {  // key[n][i] >= key[n][j]
      const unsigned hi = max(key[n][i], key[n][j]), lo = min(key[n][i], key[n][j]);
      key[n][i] = hi;
      key[n][j] = lo;
    };
    order(0, 1), order(2, 3), order(0, 2), order(1, 3), order(1, 2);
  }
  for (int round = 1;; ++round) {
    unsigned w[N];
#pragma unroll
    for (int n = 0; n < N; ++n) w[n] = __reduce_max_sync(0xffffffffu, key[n][0]);
    if (round == m) {
#pragma unroll
      for (int n = 0; n < N; ++n) thr[n] = __uint_as_float(w[n]);
      return;
    }
#pragma unroll
    for (int n = 0; n < N; ++n) {
      const unsigned holders = __ballot_sync(0xffffffffu, key[n][0] == w[n]);
      if ((holders & (0u - holders)) == lane_bit) {  // (selects, not a branch)
        key[n][0] = key[n][1];
        key[n][1] = key[n][2];
        key[n][2] = key[n][3];
        key[n][3] = 0u;
      }
    }
  }
}

// A key that orders floats (not NaN) as signed integers, and back.
__device__ __forceinline__ int float_order(float f) {
  const int b = __float_as_int(f);
  return b >= 0 ? b : b ^ 0x7fffffff;
}
__device__ __forceinline__ float ordered_float(int k) { return __int_as_float(k >= 0 ? k : k ^ 0x7fffffff); }

// Writes one row of codes at `bits` bits (kv_layout.h's bit planes) from a warp whose lane l holds
// the codes of channels 4l .. 4l + 3: in a 2-bit plane they are byte l; in the 1-bit plane lanes l
// and l + 16 share byte l % 16 (low and high nibble). codes4: byte e is channel 4l + e's code (by
// value: an array would go through local memory). Out of line: 2-bit pools never call it.
__device__ __noinline__ void pack_row(uint32_t codes4, int bits, uint8_t* row) {
  const int lane = threadIdx.x & 31;
  const uint8_t codes[4] = {uint8_t(codes4), uint8_t(codes4 >> 8), uint8_t(codes4 >> 16), uint8_t(codes4 >> 24)};
  int off = 0;
  for (int cb = 0; cb + 2 <= bits; cb += 2, off += kD / 4)  // 2-bit planes: code bits cb, cb + 1
    row[off + lane] = uint8_t(((codes[0] >> cb) & 3) | (((codes[1] >> cb) & 3) << 2) | (((codes[2] >> cb) & 3) << 4) |
                              (((codes[3] >> cb) & 3) << 6));
  if (bits & 1) {  // the 1-bit plane: the top code bit
    const int cb = bits - 1;
    unsigned nib = ((codes[0] >> cb) & 1) | (((codes[1] >> cb) & 1) << 1) | (((codes[2] >> cb) & 1) << 2) |
                   (((codes[3] >> cb) & 1) << 3);
    nib <<= 4 * (lane >> 4);
    nib |= __shfl_xor_sync(0xffffffffu, nib, 16);
    if (lane < 16) row[off + lane] = uint8_t(nib);
  }
}

// A row on the 4-level table (oscar-lm; not inlined: out of the uniform grid's hot code; in and
// out by value, as arrays would go through local memory).
struct TableRow {
  GroupParams prm;
  uint8_t codes[4];
};
__device__ __noinline__ TableRow table_codes(float4 v, const SideCodec& codec) {
  const float x[4] = {v.x, v.y, v.z, v.w};
  // The sum of squares in codec_scalar's order (channel 0 upwards), unfused, so the scale is
  // bit-identical to the host's.
  float ss = 0.0f;
  for (int i = 0; i < kD; ++i) {
    const float xi = __shfl_sync(0xffffffffu, x[i & 3], i >> 2);
    ss = __fadd_rn(ss, __fmul_rn(xi, xi));
  }
  uint16_t sh = f16_from_float(sqrtf(ss / float(kD)));
  float s = float_from_f16(sh);
  if (!(s > 0.0f) || isinf(s)) {
    sh = f16_from_float(1.0f);
    s = 1.0f;
  }
  TableRow r{GroupParams{sh, 0}, {}};
#pragma unroll
  for (int e = 0; e < 4; ++e) r.codes[e] = table_code(x[e] / s, codec.levels, 4);
  return r;
}

// What a block's rows of one (KV head, side) share: the codec, its clip rank, the code width and
// where a row's codes and parameters sit in a page block (computed once a block: the 64-bit
// offsets, an integer division and the clip rank's double arithmetic would otherwise be per row).
struct SideDest {
  const SideCodec* codec;
  int use_table;         // the codec's level table (else the uniform grid)
  int k;                 // the clip threshold's rank among |x| (uniform grid)
  int bits;              // code width (a level table: 2, check_layer_blocks)
  int row_bytes;         // one code row
  size_t codes, params;  // offsets in the page block
};
__device__ SideDest side_dest(int side, int h, const KvGeometry& geo, const LayerBlocks& lb, const HeadCodec* codecs) {
  const BlockWidths wd = lb.widths;
  SideDest d;
  d.codec = side ? &codecs[h].value : &codecs[h].key;
  d.use_table = d.codec->use_table;
  d.k = clip_rank(double(d.codec->clip_ratio), kD);
  d.bits = side ? wd.value : wd.key;
  d.row_bytes = int(geo.code_row_bytes(d.bits));
  d.codes = side ? geo.v_codes_offset(wd) : geo.k_codes_offset();
  d.params = side ? geo.v_params_offset(wd) : geo.k_params_offset(wd);
  return d;
}

// One warp: clip + quantise + pack N rows (codec_scalar.h semantics), their latency chains
// interleaved (the warp's shuffles and reductions wait tens of cycles each); lane l holds channels
// 4l .. 4l + 3 of each, i.e. code byte l of a 2-bit plane.
static_assert(kD == 4 * 32 && kGpuCodeRowBytes == 32, "one warp per row: 4 channels, one code byte per lane");
// src[n]: row n (global or shared memory); (page[n], row_in_page[n]): where it goes, in the
// layer's blocks lb.
template <int N>
__device__ void quantize_rows(const __nv_bfloat16* const (&src)[N], const int (&page)[N], const int (&row_in_page)[N],
                              int h, const SideDest& d, const LayerBlocks& lb, uint8_t* pages) {
  const int lane = threadIdx.x & 31;
  float x[N][4];
#pragma unroll
  for (int n = 0; n < N; ++n) {  // (one 8-byte load a lane: rows are whole 256-byte rows)
    const uint2 b = reinterpret_cast<const uint2*>(src[n])[lane];
    const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&b.x));
    const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&b.y));
    x[n][0] = lo.x, x[n][1] = lo.y, x[n][2] = hi.x, x[n][3] = hi.y;
  }
  const int bits = d.bits;
  GroupParams prm[N];
  uint8_t codes[N][4];
  if (d.use_table) {
#pragma unroll
    for (int n = 0; n < N; ++n) {
      const TableRow r = table_codes(make_float4(x[n][0], x[n][1], x[n][2], x[n][3]), *d.codec);
      prm[n] = r.prm;
#pragma unroll
      for (int e = 0; e < 4; ++e) codes[n][e] = r.codes[e];
    }
  } else {
    // Clip threshold: the k-th smallest |x| (any exact selection gives codec_scalar's value).
    float a[N][4], thr[N];
#pragma unroll
    for (int n = 0; n < N; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) a[n][e] = fabsf(x[n][e]);
    if (d.k > 4 * 32 - kTopRounds) {  // (one k per head and side: the branch is the warp's)
      warp_kth_smallest_of_top(a, d.k, thr);
    } else {
#pragma unroll
      for (int n = 0; n < N; ++n) thr[n] = warp_kth_smallest(make_float4(a[n][0], a[n][1], a[n][2], a[n][3]), d.k);
    }
#pragma unroll
    for (int n = 0; n < N; ++n) {
      float lo = INFINITY, hi = -INFINITY, c[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        c[e] = x[n][e] < -thr[n] ? -thr[n] : (x[n][e] > thr[n] ? thr[n] : x[n][e]);
        lo = fminf(lo, c[e]);
        hi = fmaxf(hi, c[e]);
      }
      // The warp's min and max by redux.sync on keys that order floats as signed integers (a
      // NaN lane, which holds ±inf here, is as fminf / fmaxf would leave it).
      lo = ordered_float(__reduce_min_sync(0xffffffffu, float_order(lo)));
      hi = ordered_float(__reduce_max_sync(0xffffffffu, float_order(hi)));
      prm[n] = uniform_params(lo, hi, bits);
      const float s = float_from_f16(prm[n].scale), z = float_from_f16(prm[n].zero);
#pragma unroll
      for (int e = 0; e < 4; ++e) codes[n][e] = uniform_code(c[e], s, z, bits);
    }
  }
#pragma unroll
  for (int n = 0; n < N; ++n) {
    uint8_t* blk = pages + lb.block_offset(page[n], h);
    uint8_t* row = blk + d.codes + size_t(row_in_page[n]) * d.row_bytes;
    if (bits == 2) row[lane] = uint8_t(codes[n][0] | (codes[n][1] << 2) | (codes[n][2] << 4) | (codes[n][3] << 6));
    else pack_row(codes[n][0] | (codes[n][1] << 8) | (codes[n][2] << 16) | (uint32_t(codes[n][3]) << 24), bits, row);
    if (lane == 0) {
      uint16_t* params = reinterpret_cast<uint16_t*>(blk + d.params);
      params[2 * row_in_page[n]] = prm[n].scale;
      params[2 * row_in_page[n] + 1] = prm[n].zero;
    }
  }
}
__device__ __forceinline__ void quantize_row(const __nv_bfloat16* src, int page, int row_in_page, int h,
                                             const SideDest& d, const LayerBlocks& lb, uint8_t* pages) {
  quantize_rows<1>({src}, {page}, {row_in_page}, h, d, lb, pages);
}

// The ring row of window slot seq_slot that holds ring slot `slot`.
__device__ const __nv_bfloat16* ring_row(const KvGeometry& geo, const __nv_bfloat16* windows, int seq_slot, int layer,
                                         int h, int side, int slot) {
  return windows + geo.window_block_elem(seq_slot, layer, h) + (side ? geo.v_ring_elem() : geo.k_ring_elem()) +
         size_t(slot) * kD;
}

// A row's 128 input values, 4 a lane (channels 4·lane ..), as floats.
template <typename In>
__device__ __forceinline__ void load_row4(const In* row, float (&v)[4]) {
  const int lane = threadIdx.x & 31;
  if constexpr (std::is_same<In, float>::value) {
    const float4 f = reinterpret_cast<const float4*>(row)[lane];
    v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
  } else {
    const uint2 b = reinterpret_cast<const uint2*>(row)[lane];
    const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&b.x));
    const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&b.y));
    v[0] = lo.x, v[1] = lo.y, v[2] = hi.x, v[3] = hi.y;
  }
}
__device__ __forceinline__ void store_row4_bf16(const float (&v)[4], __nv_bfloat16* row) {
  const int lane = threadIdx.x & 31;
  const __nv_bfloat162 a = __floats2bfloat162_rn(v[0], v[1]), b = __floats2bfloat162_rn(v[2], v[3]);
  reinterpret_cast<uint2*>(row)[lane] =
      make_uint2(*reinterpret_cast<const uint32_t*>(&a), *reinterpret_cast<const uint32_t*>(&b));
}

// rotate_rows for a long tile's m-tiles, n-tile by n-tile: each n-tile's fragments (16 words and
// 2 exponents a lane) are read from RotFragments (L1) once a tile instead of held in registers for
// the kernel's life (72), so the long kernel fits 5 blocks an SM (90 registers) instead of 3; the
// A fragments are read from shared memory once per (n-tile, m-tile), 4 times rotate_rows' count.
template <int kRows, typename Out>
__device__ __forceinline__ void rotate_rows_by_ntile(const RotRows<kRows>& rr, int mtiles, int n, const RotFragments* F,
                                                     int cb, Out&& out) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const uint4* src = reinterpret_cast<const uint4*>(F->words) + cb * (kRotLaneWords / 4) * 32 + lane;
#pragma unroll 1
  for (int nt = 0; nt < 4; ++nt) {
    // word q of the lane's RotCols: hi[n][s][b] at 8n + 2s + b, lo at 32 + .., e[n][c] at 64 + 2n + c
    const uint4 h0 = __ldg(src + 32 * (2 * nt)), h1 = __ldg(src + 32 * (2 * nt + 1));
    const uint4 l0 = __ldg(src + 32 * (8 + 2 * nt)), l1 = __ldg(src + 32 * (8 + 2 * nt + 1));
    const uint4 ee = __ldg(src + 32 * (16 + nt / 2));
    const uint32_t hi[4][2] = {{h0.x, h0.y}, {h0.z, h0.w}, {h1.x, h1.y}, {h1.z, h1.w}};
    const uint32_t lo[4][2] = {{l0.x, l0.y}, {l0.z, l0.w}, {l1.x, l1.y}, {l1.z, l1.w}};
    const int e[2] = {int(nt % 2 ? ee.z : ee.x), int(nt % 2 ? ee.w : ee.y)};
#pragma unroll 1
    for (int m = 0; m < mtiles; ++m) {
      int acc[4][4];
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[c][0] = acc[c][1] = acc[c][2] = acc[c][3] = 0;
      const int r0 = 16 * m + g;
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        uint32_t a[3][4];
        load_row_frags(rr, r0, s, a);
        rot_mma_kstep(acc, a, hi[s][0], hi[s][1], lo[s][0], lo[s][1]);
      }
      const int ex[2] = {rr.ex[r0], rr.ex[r0 + 8]};
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        if (r0 + 8 * half >= n) continue;
        uint32_t y = 0;
#pragma unroll
        for (int c = 0; c < 2; ++c) y |= uint32_t(rot_acc_bf16(acc, 2 * half + c, ex[half], e[c])) << (16 * c);
        out(r0 + 8 * half, 32 * cb + 8 * nt + 2 * t, y);
      }
    }
  }
}

// The exponents of columns 8n + g of the warp's column block (n = 0..3), from rc.e (which holds
// columns 8n + 2t and 8n + 2t + 1): the column exponents of rotate_rows8_swapped's accumulators.
__device__ __forceinline__ void cols8_exponents(const RotCols& rc, int (&ecol)[4]) {
  const int g = (threadIdx.x & 31) >> 2;
#pragma unroll
  for (int n = 0; n < 4; ++n) {
    const int e0 = __shfl_sync(0xffffffffu, rc.e[n][0], g >> 1), e1 = __shfl_sync(0xffffffffu, rc.e[n][1], g >> 1);
    ecol[n] = (g & 1) ? e1 : e0;
  }
}

// Rows 0 .. nr - 1 (nr <= 8: a decode step's tile) of rr times the warp's column block cb, with the
// MMA's operands swapped: R's bytes as A and the rows' as B, Yᵀ = Rᵀ·Xᵀ. A's m-tile mt is the block's
// columns 16mt + g and 16mt + 8 + g, i.e. rc's n-tiles 2mt and 2mt + 1, whose B fragments are these A
// fragments word for word; B's column g is row g. 2 m-tiles × 4 k-steps × 6 byte pairs = 48 MMAs
// a warp, against 96 for rotate_rows' 16-row tile of which at most 8 rows are kept, and no padding
// rows to zero (rows nr .. 7 are read, never stored: an output column depends on its row alone).
// The integer sums are rotate_rows' (exact), so the bf16 values are the same. ecol:
// cols8_exponents. Writes ys[row][32·cb + col] one bf16 at a time (a lane holds columns g, g + 8).
template <int kTile>
__device__ __forceinline__ void rotate_rows8_swapped(const RotRows<16>& rr, int nr, const RotCols& rc,
                                                     const int (&ecol)[4], int cb, __nv_bfloat16 (&ys)[kTile][kD]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  int acc[2][4][4];  // [m-tile][weight 2^24, 2^16, 2^8, 2^0][fragment element]
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[mt][c][0] = acc[mt][c][1] = acc[mt][c][2] = acc[mt][c][3] = 0;
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    uint32_t b[3][2];  // row g's bytes of channels 32s + 4t .. and 32s + 16 + 4t .., per plane
#pragma unroll
    for (int pl = 0; pl < 3; ++pl) {
      b[pl][0] = *reinterpret_cast<const uint32_t*>(&rr.plane[pl][g][32 * s + 4 * t]);
      b[pl][1] = *reinterpret_cast<const uint32_t*>(&rr.plane[pl][g][32 * s + 16 + 4 * t]);
    }
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      const uint32_t h[4] = {rc.hi[2 * mt][s][0], rc.hi[2 * mt + 1][s][0], rc.hi[2 * mt][s][1],
                             rc.hi[2 * mt + 1][s][1]};
      const uint32_t l[4] = {rc.lo[2 * mt][s][0], rc.lo[2 * mt + 1][s][0], rc.lo[2 * mt][s][1],
                             rc.lo[2 * mt + 1][s][1]};
      mma_i8<true, true>(acc[mt][0], h, b[0][0], b[0][1]);    // R hi · X hi: 2^24
      mma_i8<false, true>(acc[mt][1], l, b[0][0], b[0][1]);   // R lo · X hi: 2^16
      mma_i8<true, false>(acc[mt][1], h, b[1][0], b[1][1]);   // R hi · X mid: 2^16
      mma_i8<false, false>(acc[mt][2], l, b[1][0], b[1][1]);  // R lo · X mid: 2^8
      mma_i8<true, false>(acc[mt][2], h, b[2][0], b[2][1]);   // R hi · X lo: 2^8
      mma_i8<false, false>(acc[mt][3], l, b[2][0], b[2][1]);  // R lo · X lo: 2^0
    }
  }
  // Element i of an m-tile's accumulators: column g (i < 2) or g + 8, row 2t + (i & 1).
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    const int row = 2 * t + c;
    if (row >= nr) continue;
    const int ex = rr.ex[row];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const uint16_t y = rot_acc_bf16(acc[mt], 2 * half + c, ex, ecol[2 * mt + half]);
        ys[row][32 * cb + 16 * mt + 8 * half + g] = __ushort_as_bfloat16(y);
      }
  }
}

// One layer's append in one launch. A block owns one (KV head, side) and strides over tiles of
// kTile items (the moves, then the window writes). Warp w rotates into output columns
// 32w .. 32w + 31 of R in fixed point (rotate_kv.cuh): tiles of 4 keep its fragments in registers,
// loaded before the wait on the preceding kernel (R does not depend on it), and rotate with R as
// the MMA's A operand (rotate_rows8_swapped: half the MMAs of a 16-row tile); tiles of 64 read them
// n-tile by n-tile (rotate_rows_by_ntile), which fits 5 blocks an SM instead of 3. Per tile, the
// items that take a new row (x = k for side 0, v for side 1) have their rows put in fixed point by
// warps, row by row, and rotated on the tensor cores into bf16 rows (kv_rotation.h's exact sums);
// without R the rows are rounded to bf16. Then warp w stores items w, w + 4, ..: a move quantises
// its row (new, or from the old ring) into its page row; a window write first moves the ring slot
// it replaces, if a move is paired with it (plan_append_moves: the move has from_ring == 2, the
// write its index), then writes the row into sink or ring. Tiles of 4 spread a decode step's few
// rows over many blocks; tiles of 64 (long appends) fill the MMAs' 16-row tiles.
// (Rotating into a staging buffer in one launch and storing in a second cost a kernel boundary:
// the decode step per layer at batch 1 / 32K took 23.6 us against 20.2, measured.)
// counts (device, may be null; DeviceAppendPlan::counts): counts[0] moves at byte counts[2] and
// counts[1] writes at byte counts[3] of the header, else n_moves and n_writes. They are read before
// the wait on the preceding kernel (a host upload is complete by then), or after it when that
// kernel wrote them (counts_after_wait: a step planned on the device).
constexpr int kAppThreads = kD;
constexpr int kShortTile = 4, kLongTile = 64;
static_assert(kAppThreads / 32 * 32 == kD, "a warp per 32 output columns");
template <typename In, int kTile>
__global__ void __launch_bounds__(kAppThreads, kTile > 4 ? 5 : 3)
    append_rows(const In* k, const In* v, const RotFragments* rot_k, const RotFragments* rot_v, const Move* moves,
                int n_moves, const WindowWrite* writes, int n_writes, const int32_t* counts, bool counts_after_wait,
                KvGeometry geo, int layer, LayerBlocks lb, __nv_bfloat16* windows, uint8_t* pages,
                const HeadCodec* codecs) {
  constexpr int kRows = (kTile + 15) / 16 * 16;
  __shared__ __align__(16) RotRows<kRows> xr;
  __shared__ __align__(16) __nv_bfloat16 ys[kTile][kD];
  __shared__ int tile_row[kTile];   // rotated row r: its input row
  __shared__ int item_slot[kTile];  // item u of the tile: its rotated row, or -1
  __shared__ int n_rot;
  constexpr int kWarps = kAppThreads / 32;
  const int side = blockIdx.z, h = blockIdx.y, j = threadIdx.x, lane = j & 31, w = j >> 5;
  auto read_counts = [&] {
    n_moves = counts[0];
    n_writes = counts[1];
    moves = reinterpret_cast<const Move*>(reinterpret_cast<const uint8_t*>(counts) + counts[2]);
    writes = reinterpret_cast<const WindowWrite*>(reinterpret_cast<const uint8_t*>(counts) + counts[3]);
  };
  // A host upload of the step's tables is done before any kernel after it: read before the wait.
  if (counts && !counts_after_wait) read_counts();
  if (!counts_after_wait && int(blockIdx.x) * kTile >= n_moves + n_writes) return;
  const int n_kv = geo.n_kv_heads;
  const In* x = side ? v : k;
  const RotFragments* R = side ? rot_v : rot_k;
  RotCols rc;
  int ecol[4];
  if constexpr (kTile <= 8)
    if (R) {
      load_rot_frags(R + h, w, rc);
      cols8_exponents(rc, ecol);
    }
  pdl_wait();  // k and v may come from the preceding kernel (and the tables, counts_after_wait)
  pdl_launch_dependents();
  if (counts_after_wait) {
    read_counts();
    if (int(blockIdx.x) * kTile >= n_moves + n_writes) return;
  }
  const int n_items = n_moves + n_writes;
  // Per-channel key pages are written whole by quantize_key_pages (launched before): the key side's
  // moves are done, its window writes remain.
  const bool skip_moves = side == 0 && geo.per_channel_keys();
  const SideDest dest = side_dest(side, h, geo, lb, codecs);
  // The input row of item u, or -1 (a move from the old ring, or one done already).
  auto new_row = [&](int item) {
    if (item < n_moves) {
      const Move& mv = moves[item];
      return mv.from_ring || skip_moves ? -1 : mv.src;
    }
    return writes[item - n_moves].src;
  };
  for (int i0 = blockIdx.x * kTile; i0 < n_items; i0 += gridDim.x * kTile) {
    const int nt = min(kTile, n_items - i0);
    __syncthreads();  // the previous tile's shared rows are consumed
    if (w == 0) {
      int base = 0;
#pragma unroll
      for (int u0 = 0; u0 < kTile; u0 += 32) {
        const int u = u0 + lane;
        const int row = u < nt ? new_row(i0 + u) : -1;
        const unsigned takes = __ballot_sync(0xffffffffu, row >= 0);
        const int r = base + __popc(takes & ((1u << lane) - 1));
        if (u < kTile) item_slot[u] = row >= 0 ? r : -1;
        if (row >= 0) tile_row[r] = row;
        base += __popc(takes);
      }
      if (lane == 0) n_rot = base;
    }
    __syncthreads();
    const int nr = n_rot, mtiles = (nr + 15) / 16;
    // The tile's new rows: in fixed point (then rotated together), or rounded to bf16.
    // Warp w takes rows w, w + 4, .., two at a time (both loads in flight together); with R, rows
    // from nr up pad the last MMA tile of a long tile and are written as zeros (a short tile's
    // swapped rotation needs no padding).
    const int rows = R && kTile > 8 ? 16 * mtiles : nr;
    for (int r = w; r < rows; r += 2 * kWarps) {
      const int r1 = r + kWarps;
      float xv[2][4];
      if (r < nr) load_row4(x + (size_t(tile_row[r]) * n_kv + h) * kD, xv[0]);
      if (r1 < nr) load_row4(x + (size_t(tile_row[r1]) * n_kv + h) * kD, xv[1]);
      if (R) {
        if (r < nr) put_rot_row(xv[0], xr, r);
        else put_zero_row(xr, r);
        if (r1 < nr) put_rot_row(xv[1], xr, r1);
        else if (r1 < rows) put_zero_row(xr, r1);
      } else {
        store_row4_bf16(xv[0], ys[r]);
        if (r1 < nr) store_row4_bf16(xv[1], ys[r1]);
      }
    }
    if (R) {
      __syncthreads();
      if constexpr (kTile <= 8) {
        rotate_rows8_swapped(xr, nr, rc, ecol, w, ys);
      } else {
        rotate_rows_by_ntile(xr, mtiles, nr, R + h, w,
                             [&](int row, int col, uint32_t y) { *reinterpret_cast<uint32_t*>(&ys[row][col]) = y; });
      }
    }
    __syncthreads();
    // Item u's store: a move quantises its row (new, or from the old ring) into its page row; a
    // window write first moves the ring slot it replaces (if a move is paired with it), then writes
    // the new row into sink or ring.
    auto move_row = [&](const Move& mv, int u) -> const __nv_bfloat16* {  // null: none (from_ring 2)
      return mv.from_ring == 0   ? ys[item_slot[u]]
             : mv.from_ring == 1 ? ring_row(geo, windows, mv.seq_slot, layer, h, side, mv.src)
                                 : nullptr;
    };
    auto store = [&](int u) {
      const int item = i0 + u;
      if (item < n_moves) {
        if (skip_moves) return;
        const Move mv = moves[item];
        if (const __nv_bfloat16* src = move_row(mv, u)) quantize_row(src, mv.page, mv.row, h, dest, lb, pages);
        return;  // from_ring 2: its window write moves it
      }
      const WindowWrite wr = writes[item - n_moves];
      if (wr.move >= 0 && !skip_moves) {
        const Move mv = moves[wr.move];
        quantize_row(ring_row(geo, windows, mv.seq_slot, layer, h, side, mv.src), mv.page, mv.row, h, dest, lb, pages);
        __syncwarp();  // every lane has read the slot's old row
      }
      __nv_bfloat16* win = windows + geo.window_block_elem(wr.seq_slot, layer, h);
      const size_t dst =
          wr.to_ring ? (side ? geo.v_ring_elem() : geo.k_ring_elem()) : (side ? geo.v_sink_elem() : geo.k_sink_elem());
      reinterpret_cast<uint2*>(win + dst + size_t(wr.dst) * kD)[lane] =
          reinterpret_cast<const uint2*>(ys[item_slot[u]])[lane];
    };
    // Warp w stores items w, w + 4, ..: two at a time, and two moves that quantise a row each
    // together (quantize_rows<2>; a long append is nearly all such moves).
    for (int u = w; u < nt; u += 2 * kWarps) {
      const int u1 = u + kWarps;
      if (kTile > kWarps && !skip_moves && i0 + u1 < n_moves && u1 < nt) {  // (tiles of 4: never)
        const Move m0 = moves[i0 + u], m1 = moves[i0 + u1];
        const __nv_bfloat16 *s0 = move_row(m0, u), *s1 = move_row(m1, u1);
        if (s0 && s1) {
          quantize_rows<2>({s0, s1}, {m0.page, m1.page}, {m0.row, m1.row}, h, dest, lb, pages);
          continue;
        }
      }
      store(u);
      if (u1 < nt) store(u1);
    }
  }
}

// Per-channel key pages (KIVI's keys, key_group_tokens = P): a flushed page's keys are quantised
// per channel over its P tokens, so they need the whole page at once. The moves of an append are
// whole pages, P consecutive moves each (rows 0..P-1 in order: plan_append_moves, engine_move), so
// move P·i + r is row r of the append's page i. A block takes pages of one KV head: warps put the
// page's new rows in fixed point and rotate them as append_rows does (rotate_kv.cuh), or copy the
// old ring's rows; then thread j, channel j, codes its P values on the uniform grid without clip
// (codec_scalar.h chan_params, as page_row_codec.cpp's quantize_page_side) and writes its 2-byte
// (scale, zero) pair (served.h: the kernels take key_pair_bytes = 2);
// four lanes pack each byte of a 2-bit plane; a 1-bit plane's bytes (channels j and j + 64) are
// gathered in shared memory. It runs before append_rows, which writes the ring slots these
// pages read, and which then skips the key side's moves.
constexpr int kPageThreads = kD;
template <typename In>
__global__ void __launch_bounds__(kPageThreads, 3)
    quantize_key_pages(const In* k, const RotFragments* rot_k, const Move* moves, int n_moves, const int32_t* counts,
                       bool counts_after_wait, KvGeometry geo, int layer, LayerBlocks lb, const __nv_bfloat16* windows,
                       uint8_t* pages) {
  constexpr int P = kGpuPageTokens;
  static_assert(P % 16 == 0, "whole MMA row tiles");
  __shared__ __align__(16) RotRows<P> xr;
  __shared__ __align__(16) __nv_bfloat16 ys[P][kD];  // the page's rotated keys
  __shared__ bool is_new[P];                         // row r is a new row (not the old ring's)
  __shared__ uint32_t one_bit[P][kD / 32];           // the rows' 1-bit planes (odd widths)
  const int h = blockIdx.y, j = threadIdx.x, w = j >> 5;
  if (counts && !counts_after_wait) {
    n_moves = counts[0];
    moves = reinterpret_cast<const Move*>(reinterpret_cast<const uint8_t*>(counts) + counts[2]);
  }
  if (!counts_after_wait && int(blockIdx.x) * P >= n_moves) {
    pdl_wait();  // (a dependent's wait covers its predecessors only through this grid's completion)
    pdl_launch_dependents();
    return;
  }
  RotCols rc;
  if (rot_k) load_rot_frags(rot_k + h, w, rc);
  pdl_wait();  // k, the ring and (counts_after_wait) the tables come from preceding kernels
  pdl_launch_dependents();
  if (counts_after_wait) {
    n_moves = counts[0];
    moves = reinterpret_cast<const Move*>(reinterpret_cast<const uint8_t*>(counts) + counts[2]);
  }
  const int n_kv = geo.n_kv_heads;
  for (int page = blockIdx.x; page * P < n_moves; page += gridDim.x) {
    const Move* pm = moves + size_t(page) * P;
    __syncthreads();  // the previous page's rows are consumed
    for (int i = j; i < P * (kD / 32); i += kPageThreads) one_bit[i / (kD / 32)][i % (kD / 32)] = 0;
    for (int r = w; r < P; r += kPageThreads / 32) {
      const Move mv = pm[r];
      float xv[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      if (mv.from_ring == 0) load_row4(k + (size_t(mv.src) * n_kv + h) * kD, xv);
      else
        reinterpret_cast<uint2*>(ys[r])[j & 31] =
            reinterpret_cast<const uint2*>(ring_row(geo, windows, mv.seq_slot, layer, h, 0, mv.src))[j & 31];
      if (rot_k) put_rot_row(xv, xr, r);  // (an old ring row's zeros: its outputs are not kept)
      else if (mv.from_ring == 0) store_row4_bf16(xv, ys[r]);
      if ((j & 31) == 0) is_new[r] = mv.from_ring == 0;
    }
    if (rot_k) {
      __syncthreads();
      for (int m = 0; m < P / 16; ++m)
        rotate_rows(xr, m, P, rc, w, [&](int row, int col, uint32_t y) {
          if (is_new[row]) *reinterpret_cast<uint32_t*>(&ys[row][col]) = y;
        });
    }
    __syncthreads();
    float lo = INFINITY, hi = -INFINITY;
    for (int r = 0; r < P; ++r) {
      const float x = __bfloat162float(ys[r][j]);
      lo = x < lo ? x : lo;  // (codec_scalar's comparisons: a NaN leaves the bound)
      hi = x > hi ? x : hi;
    }
    const int bits = lb.widths.key;
    const ChanParams prm = chan_params(lo, hi, bits);
    const float sc = prm.scale_value(), z = prm.zero_value();
    uint8_t* blk = pages + lb.block_offset(pm[0].page, h);
    uint8_t* codes = blk + geo.k_codes_offset();
    const int row_bytes = int(geo.code_row_bytes(bits)), one_off = bits / 2 * (kD / 4);
    // Channel j's place in the 1-bit plane (kv_layout.h): byte 4·(i / 16) + (i % 16) / 4 of the
    // half's channel i, bit i % 4 (+ 4 in the second half).
    const int i1 = j & (kD / 2 - 1), byte1 = 4 * (i1 >> 4) + ((i1 & 15) >> 2);
    const int shift1 = 8 * (byte1 & 3) + (i1 & 3) + 4 * (j >= kD / 2);
    for (int r = 0; r < P; ++r) {
      const unsigned code = uniform_code(__bfloat162float(ys[r][j]), sc, z, bits);
      for (int cb = 0; cb + 2 <= bits; cb += 2) {  // 2-bit planes: code bits cb, cb + 1
        unsigned v = ((code >> cb) & 3u) << (2 * (j & 3));
        v |= __shfl_xor_sync(0xffffffffu, v, 1);
        v |= __shfl_xor_sync(0xffffffffu, v, 2);
        if ((j & 3) == 0) codes[size_t(r) * row_bytes + cb / 2 * (kD / 4) + (j >> 2)] = uint8_t(v);
      }
      if (bits & 1) atomicOr(&one_bit[r][byte1 >> 2], ((code >> (bits - 1)) & 1u) << shift1);
    }
    if (bits & 1) {
      __syncthreads();
      for (int i = j; i < P * (kD / 32); i += kPageThreads)
        *reinterpret_cast<uint32_t*>(codes + size_t(i / (kD / 32)) * row_bytes + one_off + 4 * (i % (kD / 32))) =
            one_bit[i / (kD / 32)][i % (kD / 32)];
    }
    reinterpret_cast<uint16_t*>(blk + geo.k_params_offset(lb.widths))[j] = prm.word();
  }
}

// A step from an engine's tables planned on the device (engine_step.h): one block. Each thread
// checks and counts its sequences (kEnginePlanSeqs of them; the block is as small as max_batch
// allows, a warp for up to 64 sequences: the block's barriers cost a short step most of the
// kernel's time), a block scan gives each sequence its
// first move, write and row, then the threads fill the moves and writes (each finds its sequence
// by a binary search of the prefixes) and the decode batch ints. A step with a problem plans no
// moves or writes and zero lengths (decode then writes zeros), and says which in the header.
constexpr int kEnginePlanThreads = 1024, kEnginePlanSeqs = kEngineMaxBatch / kEnginePlanThreads;
static_assert(kEngineMaxBatch % kEnginePlanThreads == 0, "sequences per planning thread");
// Threads of the planning block for steps of up to max_batch sequences.
int engine_plan_threads(int max_batch) {
  const int t = (max_batch + kEnginePlanSeqs - 1) / kEnginePlanSeqs;
  return std::min(kEnginePlanThreads, std::max(32, (t + 31) / 32 * 32));
}

// Exclusive block scan of one value per thread (any whole number of warps up to 1024); returns the
// block total too.
__device__ int32_t block_exclusive_scan(int32_t x, int32_t* warp_sums, int32_t& total) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  int32_t inc = x;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int32_t y = __shfl_up_sync(0xffffffffu, inc, o);
    if (lane >= o) inc += y;
  }
  if (lane == 31) warp_sums[w] = inc;
  __syncthreads();
  if (w == 0) {
    int32_t s = lane < int(blockDim.x >> 5) ? warp_sums[lane] : 0, sinc = s;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int32_t y = __shfl_up_sync(0xffffffffu, sinc, o);
      if (lane >= o) sinc += y;
    }
    warp_sums[lane] = sinc - s;  // exclusive
    if (lane == 31) warp_sums[32] = sinc;
  }
  __syncthreads();
  total = warp_sums[32];
  const int32_t r = warp_sums[w] + inc - x;
  __syncthreads();  // warp_sums is reused by the next scan
  return r;
}

// The largest i in [0, n] with pref[i] <= x (pref non-decreasing, pref[0] = 0 <= x).
__device__ int find_sequence(const int32_t* pref, int n, int32_t x) {
  int lo = 0, hi = n;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (pref[mid] <= x) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

__global__ void __launch_bounds__(kEnginePlanThreads)
    plan_engine_step_kernel(KvGeometry g, EngineStep s, StepLimits lim, int max_sequences, int64_t max_pages,
                            int32_t* header, int32_t* ints, Move* moves, WindowWrite* writes, int32_t moves_off,
                            int32_t writes_off) {
  __shared__ int32_t mv[kEngineMaxBatch + 1], wr[kEngineMaxBatch + 1], rows[kEngineMaxBatch + 1];
  __shared__ int32_t warp_sums[33];
  __shared__ int32_t first_bad;  // 8·sequence + problem of the first sequence with one
  const int B = s.batch, t = threadIdx.x;
  if (t == 0) first_bad = INT_MAX;
  __syncthreads();
  int32_t m_loc[kEnginePlanSeqs], w_loc[kEnginePlanSeqs], r_loc[kEnginePlanSeqs];
  int32_t m_sum = 0, w_sum = 0, r_sum = 0;
#pragma unroll
  for (int e = 0; e < kEnginePlanSeqs; ++e) {
    const int i = t * kEnginePlanSeqs + e;
    m_loc[e] = w_loc[e] = r_loc[e] = 0;
    if (i >= B) continue;
    const int64_t n0 = s.lengths[i], c = s.counts[i];
    const int32_t p = engine_seq_problem(g, lim.max_context, max_sequences, max_pages, s.slots[i], n0, c,
                                         s.block_table + int64_t(i) * s.stride);
    if (p != kStepOk) {
      atomicMin(&first_bad, 8 * i + p);
      continue;
    }
    const EngineSeqItems it = engine_seq_items(g, n0, c);
    m_loc[e] = int32_t(it.moves());
    w_loc[e] = int32_t(it.writes());
    r_loc[e] = int32_t(c);
    m_sum += m_loc[e];
    w_sum += w_loc[e];
    r_sum += r_loc[e];
  }
  int32_t n_moves, n_writes, n_rows;
  int32_t m_at = block_exclusive_scan(m_sum, warp_sums, n_moves);
  int32_t w_at = block_exclusive_scan(w_sum, warp_sums, n_writes);
  int32_t r_at = block_exclusive_scan(r_sum, warp_sums, n_rows);
#pragma unroll
  for (int e = 0; e < kEnginePlanSeqs; ++e) {
    const int i = t * kEnginePlanSeqs + e;
    if (i > B) break;
    mv[i] = m_at;
    wr[i] = w_at;
    rows[i] = r_at;
    m_at += m_loc[e];
    w_at += w_loc[e];
    r_at += r_loc[e];
  }
  if (t == 0) {  // for kEngineMaxBatch sequences no thread above reaches index B
    mv[B] = n_moves;
    wr[B] = n_writes;
    rows[B] = n_rows;
  }
  __syncthreads();
  // Counts are summed in int32: their capacities (step_capacity) are, and a sequence beyond
  // max_context never reaches the sums.
  const bool bad = first_bad != INT_MAX || n_rows > (s.rows > 0 ? s.rows : lim.max_step_tokens);
  if (t == 0) {
    header[0] = bad ? 0 : n_moves;
    header[1] = bad ? 0 : n_writes;
    header[2] = moves_off;
    header[3] = writes_off;
    header[4] = first_bad != INT_MAX ? first_bad % 8 : bad ? int32_t(kStepTooManyTokens) : int32_t(kStepOk);
    header[5] = first_bad != INT_MAX ? first_bad / 8 : bad ? B : -1;
  }
  for (int i = t; i < B; i += blockDim.x) {
    ints[i] = bad ? 0 : s.slots[i];
    ints[B + i] = bad ? 0 : s.lengths[i] + s.counts[i];
    ints[2 * B + i] = bad ? 0 : i * s.stride;
  }
  if (bad) return;
  for (int x = t; x < n_moves; x += blockDim.x) {
    const int i = find_sequence(mv, B, x);
    const int64_t n0 = s.lengths[i];
    const EngineSeqItems it = engine_seq_items(g, n0, s.counts[i]);
    moves[x] = engine_move(g, it, s.slots[i], n0, rows[i], s.block_table + int64_t(i) * s.stride, x - mv[i]);
  }
  for (int x = t; x < n_writes; x += blockDim.x) {
    const int i = find_sequence(wr, B, x);
    const int64_t n0 = s.lengths[i];
    const EngineSeqItems it = engine_seq_items(g, n0, s.counts[i]);
    writes[x] = engine_write(g, it, s.slots[i], n0, rows[i], mv[i], x - wr[i]);
  }
}

// Blocks of `kernel` that one SM holds at `threads` threads (at least 1).
template <typename Kernel>
int resident(Kernel kernel, int threads) {
  int b = 0;
  check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, kernel, threads, 0), "append (CUDA): occupancy");
  return std::max(b, 1);
}
// Blocks of append_rows that one SM holds (its registers bound it: R's fixed-point fragments and
// their exponents are 72 of them in tiles of 4), asked once per activation type and tile.
template <int kTile>
int resident_blocks(Activations act) {
  static const int n[2] = {resident(append_rows<float, kTile>, kAppThreads),
                           resident(append_rows<__nv_bfloat16, kTile>, kAppThreads)};
  return n[act == Activations::BFloat16];
}
// The same for quantize_key_pages.
int resident_page_blocks(Activations act) {
  static const int n[2] = {resident(quantize_key_pages<float>, kPageThreads),
                           resident(quantize_key_pages<__nv_bfloat16>, kPageThreads)};
  return n[act == Activations::BFloat16];
}

// One warp per (head, column block): R in fixed point once, as the kernels hold it.
__global__ void __launch_bounds__(128) rot_fragments_kernel(const float* rot, RotFragments* out) {
  RotCols rc;
  rot_cols_from_fp32(rot + size_t(blockIdx.x) * kD * kD, threadIdx.x / 32, rc);
  store_rot_frags(rc, threadIdx.x / 32, out + blockIdx.x);
}

}  // namespace

void rot_fragments(const float* rot, int64_t n, RotFragments* out, cudaStream_t stream) {
  KVCC_REQUIRE(n >= 0 && n < (int64_t(1) << 31), "rot_fragments: head count out of range");
  if (n == 0) return;
  require_hopper();
  rot_fragments_kernel<<<unsigned(n), 128, 0, stream>>>(rot, out);
  check_cuda(cudaGetLastError(), "rot_fragments launch");
}

size_t append_workspace_bytes(const KvGeometry& g, int64_t rows, int64_t max_moves) {
  return append_workspace(g, rows, max_moves).bytes;
}

void append_kv_planned(const KvGeometry& g, uint8_t* pages, uint16_t* windows, int layer, const DeviceAppendPlan& plan,
                       const HeadCodec* codecs, const void* k, const void* v, const RotFragments* rot_k,
                       const RotFragments* rot_v, cudaStream_t stream, Activations act, const LayerBlocks* blocks) {
  const int64_t items = int64_t(plan.n_moves) + plan.n_writes;
  if (items == 0) return;
  const LayerBlocks lb = blocks ? *blocks : two_bit_layer_blocks(g, layer);
  check_layer_blocks(g, lb, false, false, "append (CUDA)");
  // Blocks per (KV head, side): each loads R's 36 KB of fragments once for all the tiles it takes, so about one
  // wave of them, and with host counts at least one per 32 tiles. With device counts the grid is
  // the capacities' (every step launches the same): the blocks beyond a step's tiles only read its
  // counts and exit. Tiles of 4 items spread a decode step's few rows over more blocks (at batch 64
  // the kernel took 7.9 us per layer against 15.7 with tiles of 16, measured with fp32 rotations);
  // a long append (host counts, kLongItems items or more) takes tiles of 64, whose rows fill the
  // rotation's 16-row MMA tiles.
  constexpr int64_t kLongItems = 2048;
  const bool long_tiles = !plan.counts && items >= kLongItems;
  const int tile = long_tiles ? kLongTile : kShortTile;
  const int64_t tiles = (items + tile - 1) / tile;
  const int64_t wave =
      std::max<int64_t>(1, int64_t(multiprocessors()) *
                               (long_tiles ? resident_blocks<kLongTile>(act) : resident_blocks<kShortTile>(act)) /
                               (int64_t(g.n_kv_heads) * 2));
  const dim3 grid(unsigned(std::min(tiles, plan.counts ? wave : std::max(wave, (tiles + 31) / 32))), g.n_kv_heads, 2);
  // Programmatic dependent launch: the kernel is launched while its predecessor runs and waits
  // (griddepcontrol.wait) for its results, hiding launch latency; it lets its own dependents
  // launch only after that wait, so a kernel that starts finds all but its predecessor done.
  cudaLaunchAttribute pdl;
  pdl.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  pdl.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t c{};
  c.gridDim = grid;
  c.blockDim = dim3(kAppThreads);
  c.stream = stream;
  c.attrs = &pdl;
  c.numAttrs = 1;
  auto* win = reinterpret_cast<__nv_bfloat16*>(windows);
  const auto* counts = static_cast<const int32_t*>(plan.counts);
  if (g.per_channel_keys()) {
    // The key pages first (they read ring slots that append_rows overwrites). Pages are whole
    // P-move runs (plan_append_moves); with device counts the grid is the capacity's, as below.
    KVCC_REQUIRE(plan.counts || plan.n_moves % g.page_tokens == 0, "append (CUDA): moves are not whole pages");
    const int64_t n_pages = (int64_t(plan.n_moves) + g.page_tokens - 1) / g.page_tokens;
    const int64_t page_wave =
        std::max<int64_t>(1, int64_t(multiprocessors()) * resident_page_blocks(act) / int64_t(g.n_kv_heads));
    if (n_pages > 0) {
      cudaLaunchConfig_t pc = c;
      pc.gridDim = dim3(unsigned(std::min(n_pages, page_wave)), g.n_kv_heads);
      pc.blockDim = dim3(kPageThreads);
      if (act == Activations::BFloat16)
        check_cuda(cudaLaunchKernelEx(&pc, quantize_key_pages<__nv_bfloat16>, static_cast<const __nv_bfloat16*>(k),
                                      rot_k, plan.moves, plan.n_moves, counts, plan.counts_after_wait, g, layer, lb,
                                      static_cast<const __nv_bfloat16*>(win), pages),
                   "append (CUDA) key pages launch");
      else
        check_cuda(cudaLaunchKernelEx(&pc, quantize_key_pages<float>, static_cast<const float*>(k), rot_k, plan.moves,
                                      plan.n_moves, counts, plan.counts_after_wait, g, layer, lb,
                                      static_cast<const __nv_bfloat16*>(win), pages),
                   "append (CUDA) key pages launch");
    }
  }
  auto launch = [&](auto kernel, const auto* kx, const auto* vx) {
    check_cuda(cudaLaunchKernelEx(&c, kernel, kx, vx, rot_k, rot_v, plan.moves, plan.n_moves, plan.writes,
                                  plan.n_writes, counts, plan.counts_after_wait, g, layer, lb, win, pages, codecs),
               "append (CUDA) launch");
  };
  const auto* kb = static_cast<const __nv_bfloat16*>(k);
  const auto* vb = static_cast<const __nv_bfloat16*>(v);
  const auto* kf = static_cast<const float*>(k);
  const auto* vf = static_cast<const float*>(v);
  if (act == Activations::BFloat16) {
    if (long_tiles) launch(append_rows<__nv_bfloat16, kLongTile>, kb, vb);
    else launch(append_rows<__nv_bfloat16, kShortTile>, kb, vb);
  } else {
    if (long_tiles) launch(append_rows<float, kLongTile>, kf, vf);
    else launch(append_rows<float, kShortTile>, kf, vf);
  }
}

void append_kv(const KvGeometry& g, uint8_t* pages, uint16_t* windows, int layer, const AppendPlanHost& plan,
               const HeadCodec* codecs, const void* k, const void* v, const RotFragments* rot_k,
               const RotFragments* rot_v, void* workspace, size_t workspace_bytes, cudaStream_t stream, Activations act,
               const LayerBlocks* blocks) {
  require_hopper();
  require_gpu_served(g, kAnyQueryHeads, kGpuAppend, false, "append (CUDA)");
  KVCC_REQUIRE(layer >= 0 && layer < g.n_layers, "append (CUDA): layer out of range");
  bool key_table = false, value_table = false;
  for (int h = 0; h < g.n_kv_heads; ++h) {
    key_table = key_table || codecs[h].key.use_table;
    value_table = value_table || codecs[h].value.use_table;
  }
  if (blocks) check_layer_blocks(g, *blocks, key_table, value_table, "append (CUDA)");
  // Plan the moves and window writes (the same walk as append_ref).
  const AppendMoves m = plan_append_moves(g, plan);
  if (m.rows == 0) return;
  const AppendWorkspace lay = append_workspace(g, m.rows, int64_t(m.moves.size()));
  KVCC_REQUIRE(workspace_bytes >= lay.bytes, "append (CUDA): workspace too small");
  uint8_t* ws = static_cast<uint8_t*>(workspace);
  DeviceAppendPlan d;
  d.moves = reinterpret_cast<AppendMove*>(ws + lay.moves);
  d.writes = reinterpret_cast<AppendWindowWrite*>(ws + lay.writes);
  d.n_moves = int(m.moves.size());
  d.n_writes = int(m.writes.size());
  auto* d_codecs = reinterpret_cast<HeadCodec*>(ws + lay.codecs);
  // Pageable host memory: the copies complete (staged) before cudaMemcpyAsync returns.
  if (!m.moves.empty())
    check_cuda(cudaMemcpyAsync(ws + lay.moves, m.moves.data(), m.moves.size() * sizeof(AppendMove),
                               cudaMemcpyHostToDevice, stream),
               "append (CUDA): copy plan");
  if (!m.writes.empty())
    check_cuda(cudaMemcpyAsync(ws + lay.writes, m.writes.data(), m.writes.size() * sizeof(AppendWindowWrite),
                               cudaMemcpyHostToDevice, stream),
               "append (CUDA): copy plan");
  check_cuda(
      cudaMemcpyAsync(d_codecs, codecs, size_t(g.n_kv_heads) * sizeof(HeadCodec), cudaMemcpyHostToDevice, stream),
      "append (CUDA): copy codecs");
  append_kv_planned(g, pages, windows, layer, d, d_codecs, k, v, rot_k, rot_v, stream, act, blocks);
}

}  // namespace kvcc

namespace kvcc {

void plan_engine_step(const KvGeometry& g, const EngineStep& s, const StepCapacity& c, const StepLimits& limits,
                      int max_sequences, int64_t max_pages, uint8_t* step, cudaStream_t stream) {
  KVCC_REQUIRE(s.batch >= 0 && s.batch <= limits.max_batch && s.batch <= kEngineMaxBatch,
               "engine step: " + std::to_string(s.batch) +
                   " sequences, outside [0, max_batch = " + std::to_string(limits.max_batch) + "]");
  KVCC_REQUIRE(s.stride >= c.hist_pages, "engine step: block table rows of " + std::to_string(s.stride) +
                                             " pages, fewer than the " + std::to_string(c.hist_pages) +
                                             " a sequence of max_context tokens holds");
  KVCC_REQUIRE(s.rows >= 0 && s.rows <= limits.max_step_tokens,
               "engine step: " + std::to_string(s.rows) +
                   " k / v rows, outside [0, max_step_tokens = " + std::to_string(limits.max_step_tokens) + "]");
  KVCC_REQUIRE(s.batch == 0 || (s.slots && s.lengths && s.counts && s.block_table),
               "engine step: a null table (slots, lengths, counts and block_table are all needed)");
  const StepPacking at = engine_step_packing(c, limits.max_batch);
  auto* header = reinterpret_cast<int32_t*>(step + c.counts_at);
  plan_engine_step_kernel<<<1, engine_plan_threads(limits.max_batch), 0, stream>>>(
      g, s, limits, max_sequences, max_pages, header, reinterpret_cast<int32_t*>(step + c.ints_at),
      reinterpret_cast<AppendMove*>(step + at.moves_at), reinterpret_cast<AppendWindowWrite*>(step + at.writes_at),
      int32_t(at.moves_at - c.counts_at), int32_t(at.writes_at - c.counts_at));
  check_cuda(cudaGetLastError(), "engine step (CUDA): plan launch");
}

}  // namespace kvcc
