// Decode attention over the paged mixed-precision cache (and the BF16 paged baseline), on
// tensor cores (mma.sync). docs/runtime.md explains the design; in short:
//
//  - One CTA = (split, KV head, sequence), 4 warps. All query heads of the KV group (<= 8) are the
//    n = 8 columns of the MMAs, so each K/V byte is read once per group. Keys are the M rows:
//    Sᵀ[16 tokens × 8 heads] = K[16 × 128] · Qᵀ, then Oᵀ[128 × 8] += Vᵀ[128 × 16 tokens] · Pᵀ.
//    Pᵀ comes from the Sᵀ accumulators by one movmatrix.trans per 8×8 block.
//  - INT2 history. Keys: int8 MMAs (m16n8k32); one AND turns a code word into 4 int8 codes, the
//    query is int8 hi + lo (made once per head by rotate_queries), so q·c is exact integer
//    arithmetic. Values: fp16 MMAs (m16n8k16); one AND turns two codes into fp16 operands κ·c
//    (code bits masked into the mantissa of a subnormal, κ = 2^-24 .. 2^-16).
//    The scale/zero fold (DESIGN.md) is applied once per token:
//      q·k̂ = s·(q·c − z·Σq),  Σ p·v̂ = Σ (p·s)·c − Σ (p·s)·z,  Σ(p·s)·c = acc/κ.
//    Per-channel key pages (kChan): keys on fp16 MMAs too, codes as subnormals, the query scaled
//    per page by the channel scales (chan_query).
//  - BF16 sink and ring (and the baseline's pages) are extra splits of the same launch; one
//    merge kernel combines the splits' (max, sum, output) by log-sum-exp and rotates by R_vᵀ.
// Shared with prefill: the PTX wrappers (runtime/ptx.cuh), the log-sum-exp merge
// (runtime/merge.cuh), the geometry (runtime/served.h); the host-side plan is runtime/plan.cpp's.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "formats/codec_scalar.h"
#include "formats/error.h"
#include "formats/fp16.h"
#include "formats/kv_layout.h"
#include "runtime/activations.h"
#include "runtime/cuda_util.cuh"
#include "runtime/kv_kernels.h"
#include "runtime/merge.cuh"
#include "runtime/plan.h"
#include "runtime/ptx.cuh"
#include "runtime/served.h"

namespace kvcc {
namespace {

// Pages in each warp's shared-memory ring (ring - 1 in flight while one is computed). Two builds of
// the INT2 kernel: a 3-stage ring at 3 CTAs per SM (what shared memory fits), and a 2-stage ring
// at 4 CTAs per SM (registers capped at 128): more warps to hide latency, less prefetch per warp.
// The plan picks the second when there are enough long splits to fill its waves (runtime/plan.cpp);
// DecodeShape::ring forces one (tests, and A/B runs through bench_decode's KVCC_RING).
constexpr int kRingDeep = kDecodeRingDeep, kRingWide = kDecodeRingWide;
constexpr int ctas_per_sm(int ring) { return decode_ctas_per_sm(ring); }
// Lazy online softmax: the running max moves only when a logit exceeds it by more than this many
// log2 units, so p <= 2^slack and most tiles skip the warp reduction and the rescale. Negative:
// move it on every tile. p·s_v is an fp16 operand, so 2^slack·s_v must stay far below 65504.
#ifndef KVCC_DECODE_SLACK
#define KVCC_DECODE_SLACK 4.0f
#endif
constexpr float kSlack = KVCC_DECODE_SLACK;
// A page is walked in 16-token subtiles (the MMA's M).
constexpr int kSubtiles = kGpuPageTokens / 16;
static_assert(kSubtiles == 4, "load_keys, load_values and int2_page hold a page's 4 subtiles in registers");

constexpr int kD = kGpuHeadDim;            // head_dim of the tensor-core kernel
constexpr int kHeads = kGpuMaxGroupHeads;  // MMA n: query heads per KV head, padded
constexpr int kWarps = kDecodeWarps;
// Per-warp output slab of the CTA's final reduction: [kHeads][kSlabRow] floats, rows padded
// against shared-memory bank conflicts (the final sum adds exactly 4 slabs).
static_assert(kWarps == 4, "the slab sum is written for 4 warps");
constexpr int kSlabRow = kD + 4, kSlabFloats = kHeads * kSlabRow;
constexpr size_t kSlabBytes = size_t(kWarps) * kSlabFloats * sizeof(float);
constexpr int kThreads = 32 * kWarps;
static_assert(kGpuWindowTile == 16, "the BF16 windows are walked in bf16_tile's 16-row tiles");
constexpr int kMaxTableHeads = kDecodeMaxTableHeads;  // KV heads the level-table kernel takes
constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ __half2 u32_as_h2(uint32_t x) { return *reinterpret_cast<__half2*>(&x); }
__device__ __forceinline__ uint32_t pack_bf162(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

// Two value codes (bit position 2j of each 16-bit half of w) as two fp16 subnormals κ_j·c, one
// AND each: a code in mantissa bits 2j, 2j + 1 (j <= 4) is masked in place, κ_j = 2^(2j - 24);
// the codes at bits 10–15 (j = 5..7) lie in the exponent and sign, so one shift by 6, shared by
// the three, brings them to bits 4–9, κ_j = 2^(2j - 30). (The tensor cores keep fp16 subnormals,
// and each accumulator row holds one channel, i.e. one κ, so the scaling costs no precision;
// operands 1 + κ·c, used before, needed Σ p·s taken back out and 4 shifts per word.)
template <bool kHi = false>
__device__ __forceinline__ uint32_t code_pair(uint32_t w, int j) {
  constexpr uint32_t kMask = 0x00030003u;
  if (j < 5) return w & (kMask << (2 * j));
  // A plain shift (ALU pipe) in the per-token kernel: as a multiply-high on the FMA pipe, which
  // carries its softmax and fold, batch 8 / 128K took 6% longer (measured). kHi: the multiply-high,
  // for the per-channel kernel of 1-2-bit keys, whose ALU pipe is the busier one (twice the key
  // masks).
  return (kHi ? __umulhi(w, 1u << 26) : w >> 6) & (kMask << (2 * j - 6));
}
// 1/κ_j.
__host__ __device__ constexpr float kappa_inv(int j) { return float(1u << (j < 5 ? 24 - 2 * j : 30 - 2 * j)); }

struct DecodeArgs {
  // INT2 cache
  const uint8_t* pages;  // the layer's first block (LayerBlocks::block_offset(0, 0))
  const __nv_bfloat16* windows;
  KvGeometry geo;
  int layer;
  uint32_t page_stride;  // LayerBlocks::page_bytes; a block is GpuBlock's kBytes of the layer's widths
  BlockWidths widths;    // the layer's code widths (the kernel build's kKB, kVB)
  // BF16 baseline cache
  const __nv_bfloat16* bf16_pages;
  int bf16_page_tokens;
  int n_kv;
  // batch
  const int32_t* seq_slot;
  const int32_t* seq_len;
  const int32_t* page_offset;
  const int32_t* page_table;
  // queries and split plan
  const float* q_rot;  // [batch, n_heads, kD]
  // The query of the INT2 key MMAs (rotate_queries; int8, or fp16 for the level-table kernel):
  // per (sequence, KV head, head of the group, t) the 16 B-fragment words of thread (g = head, t)
  // (KeyQuery::frag); per (sequence, KV head, head) its sum and logit scale (KeyQuery).
  const uint4* qk8;    // [batch, n_kv, 8 heads, 4 t, 4]
  const float* qk_sc;  // [batch, n_kv, 8, 2]
  int n_heads, group_heads;
  float sm_scale_log2;  // sm_scale · log2(e)
  int paged_splits, units_per_split, total_splits, win_tiles_per_split;
  float* part_o;   // [batch, n_kv, total_splits, kHeads, kD]
  float* part_ml;  // [batch, n_kv, total_splits, kHeads, 2]
  // Level-table kernel only: per KV head and side (K, V) the code values L(0..3) as fp16,
  // (L0 | L1 << 16, L2 | L3 << 16); (0, 1, 2, 3) for a head on the uniform grid.
  uint32_t tables[kMaxTableHeads][2][2];
};

struct WarpState {
  float o[8][4];
  float m[2], l[2];
  float spz[4];  // Σ P'·z for head columns 2t, 2t + 1 in [0], [1] (an MMA accumulator; [2], [3] unused)
};

__device__ __forceinline__ void state_init(WarpState& st) {
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) st.o[j][i] = 0.0f;
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    st.m[c] = -INFINITY;
    st.l[c] = st.spz[c] = st.spz[c + 2] = 0.0f;
  }
}

__device__ __forceinline__ float warp_max_over_rows(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 4));
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 8));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 16));
}
__device__ __forceinline__ float warp_sum_over_rows(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 4);
  x += __shfl_xor_sync(0xffffffffu, x, 8);
  return x + __shfl_xor_sync(0xffffffffu, x, 16);
}

// Running max for the thread's two head columns (the tile's maxima mx0, mx1 are this thread's);
// rescales the state when it moves; returns the max to subtract (0 while nothing has been seen,
// so exp2(-inf - 0) = 0). kLazy (INT2 pages): the max moves only when a logit exceeds it by more
// than kSlack, decided by one vote, so most pages skip the reductions and the rescale. The BF16
// tiles keep the exact max (BF16 P has no fp16 range to respect; measured: the vote slowed the
// BF16 baseline kernel at large batch).
template <bool kLazy>
__device__ __forceinline__ void online_rescale(WarpState& st, float mx0, float mx1, float (&msub)[2]) {
  if (kLazy && kSlack >= 0.0f &&
      !__any_sync(0xffffffffu, mx0 > st.m[0] + kSlack || mx1 > st.m[1] + kSlack)) {  // (-inf + slack = -inf)
#pragma unroll
    for (int c = 0; c < 2; ++c) msub[c] = (st.m[c] == -INFINITY) ? 0.0f : st.m[c];
    return;
  }
  const float mx[2] = {warp_max_over_rows(mx0), warp_max_over_rows(mx1)};
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    const float mn = fmaxf(st.m[c], mx[c]);
    const float alpha = (mn == -INFINITY) ? 1.0f : fast_exp2(st.m[c] - mn);
    st.m[c] = mn;
    msub[c] = (mn == -INFINITY) ? 0.0f : mn;
    st.l[c] *= alpha;
    st.spz[c] *= alpha;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      st.o[j][c] *= alpha;
      st.o[j][c + 2] *= alpha;
    }
  }
}

// The bytes one warp reads of an INT2 page (staged in shared memory): per 16-token
// subtile s, the K code words of tokens g and g+8 (8 bytes at 8t) and their (scale, zero) pairs;
// then the V code words of tokens 2t, 2t+1, 2t+8, 2t+9 (4 bytes at 4g) and the (scale, zero)
// pairs of tokens g and g+8. Keys and values are loaded separately, just before their MMAs, so
// that fewer registers are live at once. Codes of other widths than 2 (GpuPlanes): kw / vw hold
// the row's first plane, kx / vx its second. A 1-bit plane's word is read where it holds the same
// channels as the 2-bit word (kv_layout.h: the 16 + 16 channels of 2-bit words w and w + 4), and
// shifted so that its bits 0-3 of each byte are those channels' (bits 4-7 hold the row's second half).
struct KeyRegs {
  uint2 kw[kSubtiles][2], kx[kSubtiles][2];
  uint32_t kp[kSubtiles][2];
};
struct ValueRegs {
  uint32_t vw[kSubtiles][4], vx[kSubtiles][4], vp[kSubtiles][2];
  uint32_t vz[kSubtiles][4];  // the A fragment of the Σ P'·z MMA (int2_page)
};
// The key words of one plane at byte `off` of rows g and g + 8 of subtile s (rows of kRow bytes).
template <bool kOneBit, int kRow>
__device__ __forceinline__ void load_key_plane(const uint8_t* codes, int off, int s, int g, int t, uint2 (&w)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const uint8_t* row = codes + (16 * s + g + 8 * r) * kRow + off;
    if (kOneBit) {
      const uint2 x = *reinterpret_cast<const uint2*>(row + 8 * (t & 1));
      w[r] = make_uint2(x.x >> (4 * (t >> 1)), x.y >> (4 * (t >> 1)));
    } else {
      w[r] = *reinterpret_cast<const uint2*>(row + 8 * t);
    }
  }
}
// kChan: per-channel key pages, whose key parameters are per channel (read by chan_query) and
// whose value parameters follow them.
template <bool kChan, int kKB, int kVB>
__device__ __forceinline__ void load_keys(const uint8_t* blk, KeyRegs& d, int g, int t) {
  using B = GpuBlock<kKB, kVB, kChan>;
  using Pl = GpuPlanes<kKB>;
  const uint32_t* kpar = reinterpret_cast<const uint32_t*>(blk + B::kKParamsOffset);
#pragma unroll
  for (int s = 0; s < kSubtiles; ++s) {
    load_key_plane<Pl::kFirstOneBit, B::kKRowBytes>(blk, 0, s, g, t, d.kw[s]);
    if (Pl::kSecond) load_key_plane<Pl::kSecondOneBit, B::kKRowBytes>(blk, Pl::kSecondOffset, s, g, t, d.kx[s]);
    if (!kChan) {
      d.kp[s][0] = kpar[16 * s + g];
      d.kp[s][1] = kpar[16 * s + g + 8];
    }
  }
}
// The value words of one plane at byte `off` of rows 2t, 2t + 1, 2t + 8, 2t + 9 of subtile s.
template <bool kOneBit, int kRow>
__device__ __forceinline__ void load_value_plane(const uint8_t* codes, int off, int s, int g, int t, uint32_t (&w)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint8_t* row = codes + (16 * s + 2 * t + (i & 1) + 8 * (i >> 1)) * kRow + off;
    w[i] = kOneBit ? *reinterpret_cast<const uint32_t*>(row + 4 * (g & 3)) >> (4 * (g >> 2))
                   : *reinterpret_cast<const uint32_t*>(row + 4 * g);
  }
}
template <bool kChan, int kKB, int kVB>
__device__ __forceinline__ void load_values(const uint8_t* blk, ValueRegs& d, int g, int t) {
  using B = GpuBlock<kKB, kVB, kChan>;
  using Pl = GpuPlanes<kVB>;
  const uint8_t* vc = blk + B::kVCodesOffset;
  const uint32_t* vpar = reinterpret_cast<const uint32_t*>(blk + B::kVParamsOffset);
#pragma unroll
  for (int s = 0; s < kSubtiles; ++s) {
    load_value_plane<Pl::kFirstOneBit, B::kVRowBytes>(vc, 0, s, g, t, d.vw[s]);
    if (Pl::kSecond) load_value_plane<Pl::kSecondOneBit, B::kVRowBytes>(vc, Pl::kSecondOffset, s, g, t, d.vx[s]);
    d.vp[s][0] = vpar[16 * s + g];
    d.vp[s][1] = vpar[16 * s + g + 8];
    const uint2 za = *reinterpret_cast<const uint2*>(vpar + 16 * s + 2 * t);
    const uint2 zb = *reinterpret_cast<const uint2*>(vpar + 16 * s + 2 * t + 8);
    d.vz[s][0] = __byte_perm(za.x, za.y, 0x7632);
    d.vz[s][1] = za.y;
    d.vz[s][2] = __byte_perm(zb.x, zb.y, 0x7632);
    d.vz[s][3] = zb.y;
  }
}

// Bit `from` of each lane (a byte: 0x01010101, or a 16-bit half: 0x00010001) of u moved to bit `to`.
__device__ __forceinline__ uint32_t bit_to(uint32_t u, int from, int to, uint32_t lanes) {
  return (to >= from ? u << (to - from) : u >> (from - to)) & (lanes << to);
}
// Field f (channel 4·byte + f) of the 4 bytes of a key code word pair as int8 codes times σ_f
// (1 for even f, 4 for odd: the query of odd fields is divided by 4, rotate_queries), the A
// operand of the int8 key MMAs: w the first plane's word, w4 = w >> 4, x the second plane's.
template <int kBits>
__device__ __forceinline__ uint32_t key_field_s8(uint32_t w, uint32_t w4, uint32_t x, int f) {
  const int sigma = 2 * (f & 1);  // log2 of σ_f, as a bit position
  if (kBits == 1) return bit_to(w, f, sigma, 0x01010101u);
  const uint32_t m = (f & 1) ? 0x0C0C0C0Cu : 0x03030303u;
  const uint32_t lo = (f < 2 ? w : w4) & m;
  if (kBits == 2) return lo;
  if (kBits == 3) return lo | bit_to(x, f, 2 + sigma, 0x01010101u);  // code bit 2: ×4
  return lo | ((f < 2 ? x << 2 : x >> 2) & (m << 2));                // code bits 2-3: ×4
}
// Where a 1-bit plane holds the bit of channel j of each 16-bit half (code_pair's channel j):
// byte j / 4, bit j % 4.
__host__ __device__ constexpr int one_bit_pos(int j) { return 8 * (j >> 2) + (j & 3); }
// That bit moved to code_pair's place of field j, so that it enters an fp16 MMA as κ_j·bit (the
// keys' planes and a 3-bit value's second plane, which share an accumulator or a B operand scaled
// for κ_j).
__device__ __forceinline__ uint32_t bit_pair(uint32_t x, int j) {
  return bit_to(x, one_bit_pos(j), j < 5 ? 2 * j : 2 * j - 6, 0x00010001u);
}
// The same bit masked where it lies, one AND: alone, bit p of an fp16 is 2^(p - 24) for every
// p <= 11 (a subnormal, or at p = 10, 11 the two smallest normals), so the operand is κ'_j·bit
// with κ'_j = 2^(one_bit_pos(j) - 24). For a 1-bit value plane, whose MMA j has its own
// accumulators (value_kappa_inv undoes κ'_j).
__device__ __forceinline__ uint32_t bit_in_place(uint32_t x, int j) {
  static_assert(one_bit_pos(7) <= 11, "bits above 11 reach the exponent's upper bits");
  return x & (0x00010001u << one_bit_pos(j));
}
// 1/κ of value MMA j's operands at value width kVB (bit_in_place's for 1-bit values).
template <int kVB>
__host__ __device__ constexpr float value_kappa_inv(int j) {
  return kVB == 1 ? float(1u << (24 - one_bit_pos(j))) : kappa_inv(j);
}
// Field j of a plane's word as fp16 subnormals κ_j·c (code_pair, or bit_pair for a 1-bit plane).
template <bool kOneBit>
__device__ __forceinline__ uint32_t plane_pair(uint32_t w, int j) {
  return kOneBit ? bit_pair(w, j) : code_pair(w, j);
}

// The query side of the int8 key MMAs (made by rotate_queries). Channel c of a key code row sits
// in byte c/4 at bits 2·f, f = c % 4; a code word masked with 0x03030303 (f = 0), 0x0C0C0C0C
// (f = 1, codes ×4), and the same after >> 4 (f = 2, 3) gives 4 int8 codes of field f, the A
// fragment; the B fragment is the query's int8 hi or lo part for the same channels.
// The level-table kernel's keys are fp16 MMAs instead: each A register holds the fp16 values
// L(c) of two codes of one token (a byte-permute lookup in the head's table), the B fragment
// the fp16 query q/max|q|.
constexpr int kLoScale = 254;
struct KeyQuery {
  // B fragments. int8: hi[f][chunk] = frag[2f + chunk], lo[f][chunk] = frag[8 + 2f + chunk];
  // level table: MMA m's (b0, b1) = (frag[2m], frag[2m + 1]).
  uint32_t frag[16];
  float sum[2];    // per head column 2t + c: Σ of the query as the MMAs see it (int8: exact integer)
  float scale[2];  // per head column: the logit scale (int8: max|q|/127/254; table: max|q|) · sm_scale · log2e
};

// Two codes as two fp16 code values: x holds them at bits 0-1 and 8-9; the selector picks bytes
// (2c0, 2c0 + 1, 2c1, 2c1 + 1) of the 8-byte table (lo, hi).
__device__ __forceinline__ uint32_t table_pair(uint32_t x, uint32_t lo, uint32_t hi) {
  return __byte_perm(lo, hi, x * 0x22u + 0x1010u);
}

// Per-channel key pages: k̂_c = s_c·(x_c − z_c) with one (s_c, z_c) per channel of the page (2-byte
// pairs, codec_scalar.h ChanParams: s_c an e5m3, fp16's bits 7-14; z_c = q_c/4, q_c a signed byte), so
// q·k̂ = Σ_c (q_c·s_c)·x_c − Σ_c (q_c·s_c)·z_c. The key codes enter fp16 MMAs as subnormals κ_j·x,
// one AND a register as the values' (code_pair): MMA j (0..7) takes code field j of a code word,
// channels 32t + j and 32t + 8 + j of the thread's first word (a0 / a1: tokens g, g + 8), 32t + 16 + j
// and 32t + 24 + j of its second (a2 / a3). Its B fragment holds the query for the same channels
// (rotate_queries' per-channel layout: frag[2j + half]), pre-scaled by f_j = 2^-9 / κ_j so that
// every product is q̂·x·2^-9 whatever j. Per page (chan_query) the fragments are multiplied by the
// page's scales of their channels over 2^E (E: the exponent of the page's largest scale, so that
// fp16 cannot overflow), and Σ_c (q̂_c·s_c)·z_c comes from 8 more MMAs whose A holds z_c·2^7/f_j
// = q_c·2^5/f_j (exact in fp16), for every head column at once (in token rows 0-7 or 8-15):
//   logit / q.scale = Σ q̂·s·(x − z) = 2^E·(2^9·acc − 2^-7·acc_z).
// log2 κ_j (code_pair) and the pre-scale f_j.
__host__ __device__ constexpr int kappa_log2(int j) { return j < 5 ? 2 * j - 24 : 2 * j - 30; }
__host__ __device__ constexpr float chan_prescale(int j) { return float(1u << (-9 - kappa_log2(j))); }
// A signed byte q of a pair as fp16 q·2^5/f_j in one HFMA2: the byte flipped by 0x80 under 0x64 is
// fp16 1152 + q, times m = 2^5/f_j (2^-10 .. 2^-2) plus −1152·m, exact. As half2 bits: m and −1152·m.
__device__ __forceinline__ uint32_t chan_zero_mul(int j) {
  const int e = 5 - (-9 - kappa_log2(j));  // log2(2^5 / f_j), -10 .. -2
  const uint32_t h = uint32_t(15 + e) << 10;
  return h | (h << 16);
}
__device__ __forceinline__ uint32_t chan_zero_add(int j) {
  const int e = 5 - (-9 - kappa_log2(j));
  const uint32_t h = 0x8000u | (uint32_t(25 + e) << 10) | 0x080u;  // −1.125·2^(10 + e) = −1152·2^e
  return h | (h << 16);
}

struct ChanPage {
  uint32_t b[16];  // the query fragments times the page's channel scales over 2^E
  float kscale;    // 2^(9 + E)
  float zbias[2];  // 2^(E - 7)·acc_z for head columns 2t, 2t + 1
};

// qf: this lane's query fragments in shared memory (word k at qf[32·(k / 4)], component k % 4),
// not registers: the 2-stage ring's 128 registers would spill with them. scr: the warp's 128-word
// scratch. The page's (s, z) pairs are decoded once a warp, not once a lane: lane L makes the
// scale and zero words of fragment word k = L % 16 for t = L / 16 and L / 16 + 2 (channels
// 32t + 16·half + j and + 8, k = 2j + half), each lane then reads its t's 16 of each. The page's
// largest scale (E) is a warp maximum of the bytes the lanes loaded (together, every channel).
// kQuad: the zero MMAs read their A quad as stored (below); off for keys of 3-4 bits, whose second
// plane's registers leave no room for the second accumulator (it spilled there).
template <bool kQuad>
__device__ __forceinline__ void chan_query(const uint8_t* kparams, const uint4* qf, uint32_t* scr, ChanPage& cp,
                                           int t) {
  const int lane = threadIdx.x & 31, k = lane & 15, j = k >> 1, half = k & 1;
  const uint32_t* kpar = reinterpret_cast<const uint32_t*>(kparams);
  uint32_t a[2], c[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int c1 = 32 * ((lane >> 4) + 2 * r) + 16 * half + j;  // and c1 + 8: the same pair (j & 1)
    a[r] = kpar[c1 >> 1];
    c[r] = kpar[(c1 + 8) >> 1];
  }
  const uint32_t mx =
      __vmaxu2(__vmaxu2(a[0] & 0x00ff00ffu, c[0] & 0x00ff00ffu), __vmaxu2(a[1] & 0x00ff00ffu, c[1] & 0x00ff00ffu));
  const unsigned smax_byte = __reduce_max_sync(0xffffffffu, max(mx & 0xffffu, mx >> 16));
  // E: smax·2^-E in [0.5, 1) (an e5m3 of exponent field e is below 2^(e - 14)), clamped so that
  // 2^-E is an fp16 (normal or subnormal).
  const int E = min(16, max(-14, int(smax_byte >> 3) - 14));
  const uint32_t inv = uint32_t(__half_as_ushort(__float2half_rn(__uint_as_float(uint32_t(127 - E) << 23))));
  const __half2 inv2 = u32_as_h2(inv | (inv << 16));
  const uint32_t sel = (j & 1) ? 0x0602u : 0x0400u;  // the pair's scale bytes
  // Zero word k at (k & ~3) | (k & 1) << 1 | (k >> 1 & 1): a quad reads (z_j, z_j+1, z_j', z_j+1')
  // (half 0, 0, 1, 1 of MMAs j = 2·q4, j + 1), the A operand of both zero MMAs as it stands.
  const int zpos = kQuad ? (k & ~3) | ((k & 1) << 1) | ((k >> 1) & 1) : k;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const __half2 s2 = __hmul2(u32_as_h2(e5m3x2_as_f16x2(__byte_perm(a[r], c[r], sel))), inv2);
    const uint32_t q2 = (__byte_perm(a[r], c[r], sel + 0x0101u) & 0x00ff00ffu) ^ 0x64806480u;  // 1152 + q
    const __half2 zs = __hfma2(u32_as_h2(q2), u32_as_h2(chan_zero_mul(j)), u32_as_h2(chan_zero_add(j)));
    const int tt = (lane >> 4) + 2 * r;
    scr[16 * tt + k] = *reinterpret_cast<const uint32_t*>(&s2);
    scr[64 + 16 * tt + zpos] = *reinterpret_cast<const uint32_t*>(&zs);
  }
  __syncwarp();
  const uint4* s4 = reinterpret_cast<const uint4*>(scr + 16 * t);
  const uint4* z4 = reinterpret_cast<const uint4*>(scr + 64 + 16 * t);
  // MMA j (even) sums rows 0-7 (a0, a2: z_j) into acc_z, MMA j + 1 rows 8-15 (a1, a3: z_j+1) into
  // acc_z1; each one's other rows pair the other MMA's zeros with its B and are never read.
  float acc_z[4] = {0.0f, 0.0f, 0.0f, 0.0f}, acc_z1[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int q4 = 0; q4 < 4; ++q4) {  // fragment words 4·q4 .. 4·q4 + 3: MMAs j = 2·q4, 2·q4 + 1
    const uint4 sw = s4[q4], zw = z4[q4], fw = qf[32 * q4];
    const uint32_t sv[4] = {sw.x, sw.y, sw.z, sw.w}, zv[4] = {zw.x, zw.y, zw.z, zw.w}, fv[4] = {fw.x, fw.y, fw.z, fw.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const __half2 bq = __hmul2(u32_as_h2(fv[e]), u32_as_h2(sv[e]));
      cp.b[4 * q4 + e] = *reinterpret_cast<const uint32_t*>(&bq);
    }
    if (kQuad) {
      mma_f16(acc_z, zv[0], zv[1], zv[2], zv[3], cp.b[4 * q4], cp.b[4 * q4 + 1]);       // Σ B'·z̃, rows 0-7
      mma_f16(acc_z1, zv[0], zv[1], zv[2], zv[3], cp.b[4 * q4 + 2], cp.b[4 * q4 + 3]);  // rows 8-15
    } else {
#pragma unroll
      for (int m = 0; m < 2; ++m)  // every row: Σ B'·z̃ of its head column
        mma_f16(acc_z, zv[2 * m], zv[2 * m], zv[2 * m + 1], zv[2 * m + 1], cp.b[4 * q4 + 2 * m],
                cp.b[4 * q4 + 2 * m + 1]);
    }
  }
  const float e2 = __uint_as_float(uint32_t(127 + E) << 23);  // 2^E (E >= -14: normal)
  cp.kscale = e2 * 512.0f;
  cp.zbias[0] = (kQuad ? acc_z[0] + acc_z1[2] : acc_z[0]) * e2 * (1.0f / 128.0f);
  cp.zbias[1] = (kQuad ? acc_z[1] + acc_z1[3] : acc_z[1]) * e2 * (1.0f / 128.0f);
}

// One INT2 page block, staged in shared memory at blk. kTable: code values from the
// head's level tables (tk, tv: lo and hi words of DecodeArgs::tables) on fp16 MMAs. kChan:
// per-channel key pages (chan_query), keys on fp16 MMAs too (values uniform: kTable is false).
// kKB, kVB: the code widths (a level table: 2 bits). A second plane of weight 4 adds MMAs: the
// int8 keys take it in the same operand (codes up to 15·σ_f), the per-channel keys in a second
// accumulator, the values with P' × 4 as B (exact: a power of two, far from fp16's range).
template <bool kTable, bool kChan, int kKB, int kVB>
__device__ __forceinline__ void int2_page(const uint8_t* blk, const KeyQuery& q, const uint4* qf, uint32_t* scr,
                                          WarpState& st, int g, int t, const uint32_t (&tk)[2],
                                          const uint32_t (&tv)[2]) {
  static_assert(!(kTable && kChan), "per-channel keys take uniform values");
  static_assert(!kTable || (kKB == 2 && kVB == 2), "level tables are 2-bit codes");
  using KPl = GpuPlanes<kKB>;
  using VPl = GpuPlanes<kVB>;
  // Per-channel keys of 1-2 bits: the zero MMAs read their A quad as stored and the `>> 6` shifts
  // are multiply-highs. With 3-4-bit keys neither: their second plane's registers leave no room
  // (the second zero accumulator spilled; with the multiply-highs the 3/2 build spilled 52 bytes, not
  // 40, and timed 3% slower).
  constexpr bool kLight = kChan && !KPl::kSecond;
  KeyRegs kr;
  load_keys<kChan, kKB, kVB>(blk, kr, g, t);
  ChanPage cp;
  if (kChan) chan_query<kLight>(blk + GpuBlock<kKB, kVB, kChan>::kKParamsOffset, qf, scr, cp, t);
  const auto& kw = kr.kw;
  const auto& kx = kr.kx;
  const auto& kp = kr.kp;
  float sc[kSubtiles][4];
  float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
  for (int s = 0; s < kSubtiles; ++s) {
    if (kChan) {
      // MMA j: code field j of the words (chan_query's layout), one AND a register.
      const uint32_t w[4] = {kw[s][0].x, kw[s][1].x, kw[s][0].y, kw[s][1].y};  // a0 .. a3's words
      const uint32_t x2[4] = {kx[s][0].x, kx[s][1].x, kx[s][0].y, kx[s][1].y};
      uint32_t w6[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) w6[k] = kLight ? __umulhi(w[k], 1u << 26) : w[k] >> 6;  // the FMA pipe, or ALU
      float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f}, acc2[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        if (KPl::kFirstOneBit) {
          mma_f16(acc, bit_pair(w[0], j), bit_pair(w[1], j), bit_pair(w[2], j), bit_pair(w[3], j), cp.b[2 * j],
                  cp.b[2 * j + 1]);
        } else {
          const uint32_t m = j < 5 ? 0x00030003u << (2 * j) : 0x00030003u << (2 * j - 6);
          const uint32_t* src = j < 5 ? w : w6;
          mma_f16(acc, src[0] & m, src[1] & m, src[2] & m, src[3] & m, cp.b[2 * j], cp.b[2 * j + 1]);
        }
        if (KPl::kSecond) {
          constexpr bool kOne2 = KPl::kSecondOneBit;
          mma_f16(acc2, plane_pair<kOne2>(x2[0], j), plane_pair<kOne2>(x2[1], j), plane_pair<kOne2>(x2[2], j),
                  plane_pair<kOne2>(x2[3], j), cp.b[2 * j], cp.b[2 * j + 1]);
        }
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {                              // token g (i < 2) or g + 8, head column 2t + (i & 1)
        if (KPl::kSecond) acc[i] = fmaf(4.0f, acc2[i], acc[i]);  // the second plane's code bits weigh 4
        const float x = fmaf(acc[i], cp.kscale, -cp.zbias[i & 1]);
        sc[s][i] = x;
        if (i & 1) mx1 = fmaxf(mx1, x);
        else mx0 = fmaxf(mx0, x);
      }
      continue;
    }
    if (kTable) {
      // MMA m = 4·word + f takes field f of the thread's code word `word` (bytes 8t + 4·word ..),
      // bytes (0, 1) as a0 / a1 (tokens g, g + 8) and bytes (2, 3) as a2 / a3.
      float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int m = 0; m < 8; ++m) {
        const int f = m & 3;
        const uint32_t wg = (m >> 2) ? kw[s][0].y : kw[s][0].x;
        const uint32_t wg8 = (m >> 2) ? kw[s][1].y : kw[s][1].x;
        mma_f16(acc, table_pair((wg >> (2 * f)) & 0x0303u, tk[0], tk[1]),
                table_pair((wg8 >> (2 * f)) & 0x0303u, tk[0], tk[1]),
                table_pair((wg >> (2 * f + 16)) & 0x0303u, tk[0], tk[1]),
                table_pair((wg8 >> (2 * f + 16)) & 0x0303u, tk[0], tk[1]), q.frag[2 * m], q.frag[2 * m + 1]);
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float2 sz = __half22float2(*reinterpret_cast<const __half2*>(&kp[s][r]));
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int i = 2 * r + c;
          const float x = fmaf(-sz.y, q.sum[c], acc[i]) * sz.x;
          sc[s][i] = x;
          if (c) mx1 = fmaxf(mx1, x);
          else mx0 = fmaxf(mx0, x);
        }
      }
      continue;
    }
    int hi[4] = {0, 0, 0, 0}, lo[4] = {0, 0, 0, 0};
    // A fragment words: token g chunk 0, token g+8 chunk 0, token g chunk 1, token g+8 chunk 1.
    const uint32_t w[4] = {kw[s][0].x, kw[s][1].x, kw[s][0].y, kw[s][1].y};
    const uint32_t x2[4] = {kx[s][0].x, kx[s][1].x, kx[s][0].y, kx[s][1].y};
    uint32_t w4[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) w4[k] = w[k] >> 4;
#pragma unroll
    for (int f = 0; f < 4; ++f) {
      const uint32_t a0 = key_field_s8<kKB>(w[0], w4[0], x2[0], f), a1 = key_field_s8<kKB>(w[1], w4[1], x2[1], f);
      const uint32_t a2 = key_field_s8<kKB>(w[2], w4[2], x2[2], f), a3 = key_field_s8<kKB>(w[3], w4[3], x2[3], f);
      mma_s8(hi, a0, a1, a2, a3, q.frag[2 * f], q.frag[2 * f + 1]);
      mma_s8(lo, a0, a1, a2, a3, q.frag[8 + 2 * f], q.frag[8 + 2 * f + 1]);
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {  // token g (r = 0) or g + 8
      const float2 sz = __half22float2(*reinterpret_cast<const __half2*>(&kp[s][r]));
#pragma unroll
      for (int c = 0; c < 2; ++c) {  // head column 2t + c
        const int i = 2 * r + c;
        const float qc = float(hi[i] * kLoScale + lo[i]);  // exact at 2 bits (|.| < 2^24), else within 2^-24
        // The logit without its per-column scale (q.scale > 0), which enters with the max.
        const float x = fmaf(-sz.y, q.sum[c], qc) * sz.x;
        sc[s][i] = x;
        if (c) mx1 = fmaxf(mx1, x);
        else mx0 = fmaxf(mx0, x);
      }
    }
  }
  float msub[2];
  online_rescale<true>(st, mx0 * q.scale[0], mx1 * q.scale[1], msub);
  ValueRegs vr;
  load_values<kChan, kKB, kVB>(blk, vr, g, t);
  const auto& vw = vr.vw;
  const auto& vx = vr.vx;
  const auto& vp = vr.vp;
  const auto& vz = vr.vz;
#pragma unroll
  for (int s = 0; s < kSubtiles; ++s) {
    float pr[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) pr[i] = fast_exp2(fmaf(sc[s][i], q.scale[i & 1], -msub[i & 1]));
#pragma unroll
    for (int i = 0; i < 4; ++i) st.l[i & 1] += pr[i];
    // P' = p·s_v rounded to fp16 (the MMA operand).
    const float s0 = __low2float(u32_as_h2(vp[s][0])), s1 = __low2float(u32_as_h2(vp[s][1]));  // tokens g, g + 8
    const __half2 h01 = __floats2half2_rn(pr[0] * s0, pr[1] * s0);
    const __half2 h23 = __floats2half2_rn(pr[2] * s1, pr[3] * s1);
    const uint32_t b01 = transpose8x8(*reinterpret_cast<const uint32_t*>(&h01));
    const uint32_t b23 = transpose8x8(*reinterpret_cast<const uint32_t*>(&h23));
    // Σ P'·z by one more MMA from the same operand: rows 0-7 of A hold the zeros of the
    // subtile's tokens (k = 2t, 2t + 1 in a0, 2t + 8, 2t + 9 in a2), so column 2t + c of
    // accumulator rows 0-7 is Σ_k z_k·P'_k (products exact, fp32 sums; was 4 FFMA and 4
    // conversions per subtile). Rows 8-15 take whatever the loads left in a1, a3 (no moves to
    // clear them) and are never read.
    mma_f16(st.spz, vz[s][0], vz[s][1], vz[s][2], vz[s][3], b01, b23);
    if (kTable) {
      // Bytes of tokens (2t, 2t + 1) interleaved: [b0, b0', b1, b1'] and [b2, b2', b3, b3'];
      // MMA j's rows g and g + 8 are channels 16g + j and 16g + 8 + j, as on the uniform path.
      const uint32_t i01 = __byte_perm(vw[s][0], vw[s][1], 0x5140), i01h = __byte_perm(vw[s][0], vw[s][1], 0x7362);
      const uint32_t i23 = __byte_perm(vw[s][2], vw[s][3], 0x5140), i23h = __byte_perm(vw[s][2], vw[s][3], 0x7362);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int sh = 2 * (j & 3) + 16 * (j >> 2);
        mma_f16(st.o[j], table_pair((i01 >> sh) & 0x0303u, tv[0], tv[1]),
                table_pair((i01h >> sh) & 0x0303u, tv[0], tv[1]), table_pair((i23 >> sh) & 0x0303u, tv[0], tv[1]),
                table_pair((i23h >> sh) & 0x0303u, tv[0], tv[1]), b01, b23);
      }
      continue;
    }
    const uint32_t lo_a = __byte_perm(vw[s][0], vw[s][1], 0x5410);
    const uint32_t hi_a = __byte_perm(vw[s][0], vw[s][1], 0x7632);
    const uint32_t lo_b = __byte_perm(vw[s][2], vw[s][3], 0x5410);
    const uint32_t hi_b = __byte_perm(vw[s][2], vw[s][3], 0x7632);
    if (VPl::kFirstOneBit) {  // 1-bit values (no second plane): bits masked in place
#pragma unroll
      for (int j = 0; j < 8; ++j)
        mma_f16(st.o[j], bit_in_place(lo_a, j), bit_in_place(hi_a, j), bit_in_place(lo_b, j), bit_in_place(hi_b, j),
                b01, b23);
      continue;
    }
#pragma unroll
    for (int j = 0; j < 8; ++j)
      mma_f16(st.o[j], code_pair<kLight>(lo_a, j), code_pair<kLight>(hi_a, j), code_pair<kLight>(lo_b, j),
              code_pair<kLight>(hi_b, j), b01, b23);
    if (VPl::kSecond) {
      const __half2 four = __float2half2_rn(4.0f);
      const __half2 q01 = __hmul2(u32_as_h2(b01), four), q23 = __hmul2(u32_as_h2(b23), four);
      const uint32_t b01x4 = *reinterpret_cast<const uint32_t*>(&q01), b23x4 = *reinterpret_cast<const uint32_t*>(&q23);
      const uint32_t xlo_a = __byte_perm(vx[s][0], vx[s][1], 0x5410), xhi_a = __byte_perm(vx[s][0], vx[s][1], 0x7632);
      const uint32_t xlo_b = __byte_perm(vx[s][2], vx[s][3], 0x5410), xhi_b = __byte_perm(vx[s][2], vx[s][3], 0x7632);
      constexpr bool kOne2 = VPl::kSecondOneBit;
#pragma unroll
      for (int j = 0; j < 8; ++j)
        mma_f16(st.o[j], plane_pair<kOne2>(xlo_a, j), plane_pair<kOne2>(xhi_a, j), plane_pair<kOne2>(xlo_b, j),
                plane_pair<kOne2>(xhi_b, j), b01x4, b23x4);
    }
  }
}

// One 16-token BF16 tile (the MMA's M, served.h's kGpuWindowTile): rows 0..15 at kbase/vbase (row
// stride kD), row r valid if bit r of `valid` is set (invalid rows are neither read nor counted).
// kSplitQ: q = q_hi + q_lo in two bf16 MMAs, so the logits carry fp32-like precision (the
// windows of the INT2 cache); the plain BF16 baseline rounds q once, as BF16 attention does.
template <bool kSplitQ>
__device__ __forceinline__ void bf16_tile(const __nv_bfloat16* kbase, const __nv_bfloat16* vbase, uint32_t valid,
                                          const uint32_t (&kq)[8][2], const uint32_t (&kq_lo)[8][2], float cscale,
                                          WarpState& st, int g, int t) {
  uint4 kr[2][4], vr[4][2];
  const uint4 zero4 = make_uint4(0, 0, 0, 0);
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int row = g + 8 * rr;
    const bool ok = (valid >> row) & 1u;
#pragma unroll
    for (int i = 0; i < 4; ++i)
      kr[rr][i] = ok ? __ldg(reinterpret_cast<const uint4*>(kbase + row * kD + (kD / 4) * t + 8 * i)) : zero4;
  }
#pragma unroll
  for (int rr = 0; rr < 4; ++rr) {
    const int row = 2 * t + (rr & 1) + 8 * (rr >> 1);
    const bool ok = (valid >> row) & 1u;
#pragma unroll
    for (int i = 0; i < 2; ++i)
      vr[rr][i] = ok ? __ldg(reinterpret_cast<const uint4*>(vbase + row * kD + 16 * g + 8 * i)) : zero4;
  }
  float sc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int kb = 0; kb < 8; ++kb) {
    const uint4& a = kr[0][kb >> 1];
    const uint4& b = kr[1][kb >> 1];
    if (kb & 1) {
      mma_bf16(sc, a.z, b.z, a.w, b.w, kq[kb][0], kq[kb][1]);
      if (kSplitQ) mma_bf16(sc, a.z, b.z, a.w, b.w, kq_lo[kb][0], kq_lo[kb][1]);
    } else {
      mma_bf16(sc, a.x, b.x, a.y, b.y, kq[kb][0], kq[kb][1]);
      if (kSplitQ) mma_bf16(sc, a.x, b.x, a.y, b.y, kq_lo[kb][0], kq_lo[kb][1]);
    }
  }
  float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int row = g + 8 * (i >> 1);
    const float x = ((valid >> row) & 1u) ? sc[i] * cscale : -INFINITY;
    sc[i] = x;
    if (i & 1) mx1 = fmaxf(mx1, x);
    else mx0 = fmaxf(mx0, x);
  }
  float msub[2];
  online_rescale<false>(st, mx0, mx1, msub);
  float ps[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    ps[i] = fast_exp2(sc[i] - msub[i & 1]);
    st.l[i & 1] += ps[i];
  }
  const uint32_t b01 = transpose8x8(pack_bf162(ps[0], ps[1]));
  const uint32_t b23 = transpose8x8(pack_bf162(ps[2], ps[3]));
#pragma unroll
  for (int mb = 0; mb < 8; ++mb) {
    const int half = mb >> 2, wi = mb & 3;
    auto word = [&](int rr) {
      const uint4& u = vr[rr][half];
      return wi == 0 ? u.x : wi == 1 ? u.y : wi == 2 ? u.z : u.w;
    };
    const uint32_t w0 = word(0), w1 = word(1), w2 = word(2), w3 = word(3);
    mma_bf16(st.o[mb], __byte_perm(w0, w1, 0x5410), __byte_perm(w0, w1, 0x7632), __byte_perm(w2, w3, 0x5410),
             __byte_perm(w2, w3, 0x7632), b01, b23);
  }
}

enum class Mode { Int2, Bf16Paged };

// kTable: INT2 pages decoded through the per-head level tables (DecodeArgs::tables). kChan:
// per-channel key pages (int2_page), larger blocks. kKB, kVB: the layer's code widths.
template <Mode kMode, int kRing, bool kTable = false, bool kChan = false, int kKB = 2, int kVB = 2>
__global__ void __launch_bounds__(kThreads, ctas_per_sm(kRing)) decode_kernel(DecodeArgs a) {
  constexpr int kPageBytes = GpuBlock<kKB, kVB, kChan>::kBytes;
  const int split = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  __shared__ float qs[kHeads][kD];
  __shared__ float w_m[kWarps][kHeads], w_l[kWarps][kHeads];

  pdl_launch_dependents();
  const int len = a.seq_len[b];
  const int r = a.group_heads;
  // Which work this split does.
  const bool int2_split = kMode == Mode::Int2 && split < a.paged_splits;
  const bool paged_split = kMode == Mode::Bf16Paged;
  const bool win_split = kMode == Mode::Int2 && split >= a.paged_splits;
  // INT2 pages reach shared memory by bulk copies, kRing - 1 in flight per warp: page k of this
  // warp is p0 + warp + k·kWarps and lands in ring stage k % kRing.
  int p0 = 0, n_mine = 0;
  const int32_t* pt = a.page_table;
  if (int2_split) {
    const int n_pages = int(tiers_of(a.geo, len).hist_tokens / a.geo.page_tokens);
    p0 = split * a.units_per_split;
    const int p1 = min(n_pages, p0 + a.units_per_split);
    n_mine = p0 + warp < p1 ? (p1 - p0 - warp + kWarps - 1) / kWarps : 0;
    pt += a.page_offset[b];
  }
  extern __shared__ uint4 dyn_smem[];  // INT2: the page ring [kWarps][kRing][kPageBytes]; then the output slabs
  uint8_t* ring = reinterpret_cast<uint8_t*>(dyn_smem) + size_t(warp) * kRing * kPageBytes;
  // The page ids of 32 consecutive k, one per lane, loaded together: no dependent global load
  // stands between a page's turn and its copy. (issue() runs warp-uniformly, k ascending.)
  int ids = 0;
  __shared__ __align__(8) uint64_t bars[kWarps][kRing];  // per warp and ring stage: its page has landed
  if (int2_split) mbar_init(bars[warp], kRing, lane);
  // Shared-space addresses of the warp's ring and barriers, made once (per page, with the page's
  // global address hoisted too: 3% at batch 8 / 128K, measured on the 2-bit pool's layout).
  const uint32_t ring_s = smem_addr(ring), bars_s = smem_addr(bars[warp]);
  auto issue = [&](int k) {
    if ((k & 31) == 0) ids = k + lane < n_mine ? pt[p0 + warp + (k + lane) * kWarps] : 0;
    const int id = __shfl_sync(0xffffffffu, ids, k & 31);
    if (k < n_mine) {
      // Page id's block of this head (LayerBlocks; unhoisted: a hoisted base spilled the
      // 2-bit per-channel build at 128 registers).
      const uint8_t* src = a.pages + (size_t(h) * kPageBytes + size_t(uint32_t(id)) * a.page_stride);
      if (lane == 0) bulk_copy(ring_s + (k % kRing) * kPageBytes, src, kPageBytes, bars_s + 8 * (k % kRing));
    }
  };
  // The cache does not depend on rotate_queries: the first pages' loads overlap it.
  if (int2_split)
#pragma unroll
    for (int k = 0; k < kRing - 1; ++k) issue(k);
  pdl_wait();  // the query comes from rotate_queries
  if (!int2_split) {
    for (int i = threadIdx.x; i < kHeads * kD; i += kThreads) {
      const int hh = i / kD, c = i % kD;
      qs[hh][c] = hh < r ? a.q_rot[(size_t(b) * a.n_heads + size_t(h) * r + hh) * kD + c] : 0.0f;
    }
    __syncthreads();
  }

  WarpState st;
  state_init(st);
  bool int2_path = false;

  if (int2_split) {
    int2_path = true;
    // The query fragments of head g (zero for padding heads) and the columns' sums and scales.
    KeyQuery kq;
    const size_t qb = (size_t(b) * a.n_kv + h) * kHeads;
    const uint4 zero4 = make_uint4(0, 0, 0, 0);
    uint4 w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) w[k] = g < r ? a.qk8[((qb + g) * 4 + t) * 4 + k] : zero4;
    // Per-channel keys: the fragments in the warp's slot after the page ring (chan_query).
    uint4* qf = reinterpret_cast<uint4*>(reinterpret_cast<uint8_t*>(dyn_smem) + size_t(kWarps) * kRing * kPageBytes) +
                warp * 4 * 32 + lane;
    // Per-channel keys: the warp's scratch for the page's decoded (s, z) words, after the fragments.
    uint32_t* scr = reinterpret_cast<uint32_t*>(reinterpret_cast<uint8_t*>(dyn_smem) +
                                                size_t(kWarps) * kRing * kPageBytes + size_t(kWarps) * 4 * 32 * 16) +
                    warp * 128;
    if (kChan) {
#pragma unroll
      for (int k = 0; k < 4; ++k) qf[32 * k] = w[k];
      __syncwarp();
    } else {
#pragma unroll
      for (int k = 0; k < 16; ++k) kq.frag[k] = reinterpret_cast<const uint32_t*>(w)[k];
    }
    uint32_t tk[2] = {0, 0}, tv[2] = {0, 0};
    if (kTable) {
      tk[0] = a.tables[h][0][0];
      tk[1] = a.tables[h][0][1];
      tv[0] = a.tables[h][1][0];
      tv[1] = a.tables[h][1][1];
    }
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const bool real = 2 * t + c < r;
      kq.sum[c] = real ? a.qk_sc[(qb + 2 * t + c) * 2] : 0.0f;
      kq.scale[c] = real ? a.qk_sc[(qb + 2 * t + c) * 2 + 1] : 0.0f;
    }
    for (int k = 0; k < n_mine; ++k) {
      issue(k + kRing - 1);
      mbar_wait(bars_s + 8 * (k % kRing), uint32_t(k / kRing) & 1u);  // the stage's (k / kRing)-th fill
      __syncwarp();
      int2_page<kTable, kChan, kKB, kVB>(ring + (k % kRing) * kPageBytes, kq, qf, scr, st, g, t, tk, tv);
      __syncwarp();  // every lane has read stage k % kRing before it is refilled
    }
  } else if (paged_split || win_split) {
    uint32_t kq[8][2], kq_lo[8][2];
    auto lo_part = [](float x) { return x - __bfloat162float(__float2bfloat16_rn(x)); };
#pragma unroll
    for (int kb = 0; kb < 8; ++kb) {
      const int c = (kD / 4) * t + 4 * kb;
      kq[kb][0] = pack_bf162(qs[g][c], qs[g][c + 1]);
      kq[kb][1] = pack_bf162(qs[g][c + 2], qs[g][c + 3]);
      kq_lo[kb][0] = pack_bf162(lo_part(qs[g][c]), lo_part(qs[g][c + 1]));
      kq_lo[kb][1] = pack_bf162(lo_part(qs[g][c + 2]), lo_part(qs[g][c + 3]));
    }
    const float cscale = a.sm_scale_log2;
    if (paged_split) {
      const int P = a.bf16_page_tokens;
      const int n_pages = (len + P - 1) / P;
      const int p0 = split * a.units_per_split;
      const int p1 = min(n_pages, p0 + a.units_per_split);
      const int32_t* pt = a.page_table + a.page_offset[b];
      const int tiles_per_page = P / 16;
      for (int u = p0 * tiles_per_page + warp; u < p1 * tiles_per_page; u += kWarps) {
        const int p = u / tiles_per_page, tile = u % tiles_per_page;
        const int tok0 = p * P + tile * 16;
        const int nvalid = max(0, min(16, len - tok0));
        const uint32_t valid = nvalid >= 16 ? 0xffffu : ((1u << nvalid) - 1u);
        if (!valid) continue;
        const __nv_bfloat16* blk = a.bf16_pages + (size_t(pt[p]) * a.n_kv + h) * 2 * size_t(P) * kD;
        bf16_tile<false>(blk + size_t(tile) * 16 * kD, blk + size_t(P) * kD + size_t(tile) * 16 * kD, valid, kq, kq_lo,
                         cscale, st, g, t);
      }
    } else {
      const KvGeometry& geo = a.geo;
      const KvTiers tiers = tiers_of(geo, len);
      const int sink_tiles = geo.sink / kGpuWindowTile, ring_tiles = geo.recent / kGpuWindowTile;
      const int first_tile = (split - a.paged_splits) * a.win_tiles_per_split;
      const int last_tile = min(sink_tiles + ring_tiles, first_tile + a.win_tiles_per_split);
      const __nv_bfloat16* win = a.windows + geo.window_block_elem(a.seq_slot[b], a.layer, h);
      const int first = int(tiers.hist_tokens % geo.recent);  // ring slot of the oldest ring token
      for (int tile = first_tile + warp; tile < last_tile; tile += kWarps) {
        if (tile < sink_tiles) {
          const int nvalid = max(0, min(16, tiers.sink_count - tile * 16));
          const uint32_t valid = nvalid >= 16 ? 0xffffu : ((1u << nvalid) - 1u);
          if (valid)
            bf16_tile<true>(win + geo.k_sink_elem() + size_t(tile) * 16 * kD,
                            win + geo.v_sink_elem() + size_t(tile) * 16 * kD, valid, kq, kq_lo, cscale, st, g, t);
        } else {
          const int rt = tile - sink_tiles;
          uint32_t valid = 0;
          for (int rr = 0; rr < 16; ++rr) {
            const int age = (rt * 16 + rr - first + geo.recent) % geo.recent;
            if (age < tiers.ring_count) valid |= 1u << rr;
          }
          if (valid)
            bf16_tile<true>(win + geo.k_ring_elem() + size_t(rt) * 16 * kD,
                            win + geo.v_ring_elem() + size_t(rt) * 16 * kD, valid, kq, kq_lo, cscale, st, g, t);
        }
      }
    }
  }

  // Finish the warp: sums over the token rows, then the INT2 fold; map to (head, channel).
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    st.l[c] = warp_sum_over_rows(st.l[c]);  // (spz: every row holds the whole sum already)
  }
  if (g == 0) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      w_m[warp][2 * t + c] = st.m[c];
      w_l[warp][2 * t + c] = st.l[c];
    }
  }
  __syncthreads();
  float factor[2];
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    float mall = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mall = fmaxf(mall, w_m[w][2 * t + c]);
    factor[c] = st.m[c] == -INFINITY ? 0.0f : exp2f(st.m[c] - mall);
  }
  // Each warp stores its scaled output in its own slab (the page ring's memory, free now), as
  // 16 contiguous channels per head and thread; then the warps' slabs are added in a fixed order,
  // so repeated runs give identical bits.
  float* slabs = reinterpret_cast<float*>(dyn_smem);
  {
    float* slab = slabs + warp * kSlabFloats;
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      float v[16];
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const float o = st.o[j][c + 2 * hf];
          if (int2_path && kTable) v[8 * hf + j] = (o - st.spz[c]) * factor[c];  // Σ(p·s)·L(c) − Σ(p·s)·z
          else if (int2_path)
            v[8 * hf + j] = (o * value_kappa_inv<kVB>(j) - st.spz[c]) * factor[c];  // Σ(p·s)·c − Σ(p·s)·z
          else v[2 * j + hf] = o * factor[c];
        }
      float4* dst = reinterpret_cast<float4*>(slab + (2 * t + c) * kSlabRow + 16 * g);
#pragma unroll
      for (int k = 0; k < 4; ++k) dst[k] = make_float4(v[4 * k], v[4 * k + 1], v[4 * k + 2], v[4 * k + 3]);
    }
  }
  __syncthreads();
  const size_t base = (size_t(b) * a.n_kv + h) * a.total_splits + split;
  for (int i = threadIdx.x; i < r * kD; i += kThreads) {
    const int off = (i / kD) * kSlabRow + i % kD;
    a.part_o[base * kHeads * kD + i] =
        (slabs[off] + slabs[kSlabFloats + off]) + (slabs[2 * kSlabFloats + off] + slabs[3 * kSlabFloats + off]);
  }
  if (threadIdx.x < r) {
    const int hh = threadIdx.x;
    float mall = -INFINITY, lsum = 0.0f;
    for (int w = 0; w < kWarps; ++w) mall = fmaxf(mall, w_m[w][hh]);
    for (int w = 0; w < kWarps; ++w)
      if (w_m[w][hh] != -INFINITY) lsum += w_l[w][hh] * exp2f(w_m[w][hh] - mall);
    a.part_ml[(base * kHeads + hh) * 2] = mall;
    a.part_ml[(base * kHeads + hh) * 2 + 1] = lsum;
  }
}

// Quarter `slice` of column j of the kD × kD matrix R (rows 32·slice ..), zeros without R.
__device__ __forceinline__ void load_quarter(const float* R, int slice, int j, float (&rc)[kD / 4]) {
#pragma unroll
  for (int i = 0; i < kD / 4; ++i) rc[i] = 0.0f;
  if (!R) return;
  const float* col = R + (size_t(slice) * (kD / 4) * kD + j);
#pragma unroll
  for (int i = 0; i < kD / 4; ++i) rc[i] = __ldg(col + i * kD);
}
// The rotation of r rows x[hh] by R, by quarters: part[slice][hh][j] = Σ_i x[hh][32·slice + i]·R[32·slice + i][j],
// with rc this thread's quarter of R's column j (the caller adds the 4 slices).
__device__ __forceinline__ void rotate_quarter(const float (*x)[kD], const float (&rc)[kD / 4], int r, int slice, int j,
                                               float (*part)[kHeads][kD]) {
  for (int hh = 0; hh < r; ++hh) {
    float acc = 0.0f;
#pragma unroll
    for (int i = 0; i < kD / 4; ++i) acc = fmaf(x[hh][slice * (kD / 4) + i], rc[i], acc);
    part[slice][hh][j] = acc;
  }
}

// q_rot[b, qh] = q[b, qh] · R_k[qh / r]. One CTA per (KV head, sequence) rotates the group's r
// query heads, so R_k is read once per group (with a CTA and an R_k read per query head, the two
// rotations cost ~6 us of the 187 us chain at batch 8 / 128K, measured); 4 slices of threads each
// take a quarter of R's rows per output column (32 dependent FMAs in series per head). Then slice
// k finishes heads k, k + 4.
// With qk8 (INT2 decode), also the query of the key MMAs in B-fragment order (DecodeArgs::qk8),
// once per head rather than in every attention CTA:
//  - int8 (uniform grid): T = q_rot·127/max|q_rot| (÷4 for odd code fields f = c % 4, whose
//    codes are masked in place, ×4) = hi + lo/254, rounded, so that
//    q·c = (max|q|/127/254)·(254·acc_hi + acc_lo) with ~15-bit precision (one int8 alone loses
//    ~1% of a logit's precision, more than the 1e-2 test budget allows);
//  - fp16 (level table): q_rot/max|q_rot|;
//  - fp16 per-channel (per-channel key pages): q_rot/max|q_rot| times chan_prescale(j), in the
//    layout chan_query reads.
enum class QueryKind { Int8, Fp16Table, Fp16Chan };
constexpr int kRotThreads = 4 * kD;
template <typename In>
__global__ void __launch_bounds__(kRotThreads)
    rotate_queries(const In* q, const float* rot_k, int n_heads, int r, float sm_scale_log2, float* q_rot, uint4* qk8,
                   float* qk_sc, QueryKind kind) {
  __shared__ float qv[kHeads][kD];
  __shared__ float part[4][kHeads][kD];
  __shared__ float wmax[4][4];
  __shared__ float wsum[4][4];
  const int h = blockIdx.x, b = blockIdx.y, j = threadIdx.x % kD, slice = threadIdx.x / kD;
  // R_k does not depend on the preceding kernel (the append): its loads overlap that kernel's end.
  float rc[kD / 4];
  load_quarter(rot_k ? rot_k + size_t(h) * kD * kD : nullptr, slice, j, rc);
  // decode_kernel reads the cache before its own wait: it may launch only once the append is done.
  pdl_wait();
  pdl_launch_dependents();
  for (int hh = slice; hh < r; hh += 4)
    qv[hh][j] = load_activation(q + (size_t(b) * n_heads + size_t(h) * r + hh) * kD + j);
  __syncthreads();
  if (rot_k) {
    rotate_quarter(qv, rc, r, slice, j, part);
    __syncthreads();
  }
  const int warp = j >> 5, lane = j & 31;
  for (int hh = slice; hh < r; hh += 4) {
    const int qh = h * r + hh;
    const size_t off = (size_t(b) * n_heads + qh) * kD;
    const float x = rot_k ? (part[0][hh][j] + part[1][hh][j]) + (part[2][hh][j] + part[3][hh][j]) : qv[hh][j];
    q_rot[off + j] = x;
    if (!qk8) continue;
    float amax = fabsf(x);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if (lane == 0) wmax[slice][warp] = amax;
    asm volatile("bar.sync %0, %1;" ::"r"(1 + slice), "n"(kD));  // the 4 warps of this slice only
    amax = fmaxf(fmaxf(wmax[slice][0], wmax[slice][1]), fmaxf(wmax[slice][2], wmax[slice][3]));
    const int n_kv = n_heads / r;
    // Channel j is field f = j % 4 of code byte l = j / 4 of a key row; thread t = l / 8 of the
    // MMA warp holds it.
    const int f = j & 3, l = j >> 2, t = l >> 3;
    uint8_t* dst = reinterpret_cast<uint8_t*>(qk8 + (((size_t(b) * n_kv + h) * kHeads + hh) * 4 + t) * 4);
    float sum;  // Σ over channels of the query as the MMAs see it; exact for int8
    float scale;
    if (kind == QueryKind::Fp16Chan) {
      // Channel c = 32t + 16·half + 8·e + jj is element e of word 2·jj + half (chan_query).
      const float inv = amax > 0.0f ? 1.0f / amax : 1.0f;
      const int rr = j & 31, jj = rr & 7, half = rr >> 4, e = (rr >> 3) & 1;
      const __half v = __float2half_rn(x * inv * chan_prescale(jj));
      reinterpret_cast<__half*>(dst)[(2 * jj + half) * 2 + e] = v;
      sum = 0.0f;  // (unused: the zeros enter per page)
      scale = (amax > 0.0f ? amax : 1.0f) * sm_scale_log2;
    } else if (kind == QueryKind::Fp16Table) {
      // Byte l is element l % 2 of word 2·(4·word + f) + half, word = (l / 4) % 2, half = (l / 2) % 2.
      const float inv = amax > 0.0f ? 1.0f / amax : 1.0f;
      const __half v = __float2half_rn(x * inv);
      const int m = 4 * ((l >> 2) & 1) + f, half = (l >> 1) & 1;
      reinterpret_cast<__half*>(dst)[(2 * m + half) * 2 + (l & 1)] = v;
      sum = __half2float(v);
      scale = (amax > 0.0f ? amax : 1.0f) * sm_scale_log2;
    } else {
      // Byte l is byte l % 4 of word (f, chunk = (l / 4) % 2): hi at 2f + chunk, lo at 8 + 2f + chunk.
      const float unit = amax > 0.0f ? amax / 127.0f : 1.0f;
      const int chunk = (l >> 2) & 1, e = l & 3;
      const int wgt = (f & 1) ? 4 : 1;
      const float y = x * (1.0f / unit) * ((f & 1) ? 0.25f : 1.0f);
      const float hi = rintf(y);
      const float lo = fminf(fmaxf(rintf((y - hi) * float(kLoScale)), -127.0f), 127.0f);
      dst[(2 * f + chunk) * 4 + e] = uint8_t(int8_t(hi));
      dst[(8 + 2 * f + chunk) * 4 + e] = uint8_t(int8_t(lo));
      sum = float(wgt * (int(hi) * kLoScale + int(lo)));  // |.| < 2^17: float sums stay exact
      scale = unit / float(kLoScale) * sm_scale_log2;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (lane == 0) wsum[slice][warp] = sum;
    asm volatile("bar.sync %0, %1;" ::"r"(1 + slice), "n"(kD));
    if (j == 0) {
      float* sc = qk_sc + ((size_t(b) * n_kv + h) * kHeads + hh) * 2;
      sc[0] = (wsum[slice][0] + wsum[slice][1]) + (wsum[slice][2] + wsum[slice][3]);  // int8: exact, |.| < 2^23
      sc[1] = scale;
    }
  }
}

// out[b, qh] = (Σ_s O_s·2^(m_s − M)) / (Σ_s l_s·2^(m_s − M)) · R_vᵀ. 4 slices of threads each
// merge a quarter of the splits (their loads in one round for up to 4·kChunk splits) and take a quarter of the
// rotation's inputs per output channel, so few dependent loads are in series.
// kChunk: splits per slice and round of loads; the launch picks the smallest that needs one round
// (a chunk's loads and exponentials are issued whether or not its splits exist: 12 where 1 would
// do cost 4–6 us at batch 32–64, 4K context, measured).
constexpr int kMergeThreads = 4 * kD;
template <int kChunk, typename Out>
__global__ void __launch_bounds__(kMergeThreads)
    merge_splits(const float* part_o, const float* part_ml, int n_kv, int total_splits, int n_heads, int r,
                 const float* rot_v_t, Out* out) {
  __shared__ float part[4][kD];
  __shared__ float ov[kD];
  __shared__ float slice_m[4], slice_l[4];
  const int qh = blockIdx.x, b = blockIdx.y, j = threadIdx.x % kD, slice = threadIdx.x / kD;
  const int h = qh / r, hh = qh % r;
  // This thread's quarter of R_vᵀ's column j does not depend on the attention kernel: load it
  // while that kernel still runs.
  float rv[kD / 4];
  load_quarter(rot_v_t ? rot_v_t + size_t(h) * kD * kD : nullptr, slice, j, rv);
  pdl_wait();               // partials come from decode_kernel
  pdl_launch_dependents();  // the next layer's append may stage its rotation now
  // Slice `slice` merges splits slice, slice + 4, ... (one round of loads for up to 4·kChunk
  // splits); the 4 slices are combined at the end.
  const size_t base = (size_t(b) * n_kv + h) * total_splits;
  float m_run, l_run, acc;
  // Split s of head hh: entry (base + s)·kHeads + hh of the partials (DecodeArgs::part_o, part_ml).
  merge_run<kChunk, kD>(
      part_o, part_ml, [base, hh](int s) { return (base + s) * kHeads + hh; }, j, total_splits, slice, 4, m_run, l_run,
      acc);
  part[slice][j] = acc;
  if (j == 0) {
    slice_m[slice] = m_run;
    slice_l[slice] = l_run;
  }
  __syncthreads();
  if (slice == 0) ov[j] = merge_slices(slice_m, slice_l, &part[0][j], kD);
  __syncthreads();
  float o = slice == 0 ? ov[j] : 0.0f;
  if (rot_v_t) {
    o = 0.0f;
#pragma unroll
    for (int i = 0; i < kD / 4; ++i) o = fmaf(ov[slice * (kD / 4) + i], rv[i], o);
  }
  __syncthreads();
  part[slice][j] = o;
  __syncthreads();
  if (slice == 0)
    store_activation(out + (size_t(b) * n_heads + qh) * kD + j, (part[0][j] + part[1][j]) + (part[2][j] + part[3][j]));
}

// The same merge with one CTA per (KV head, sequence): slice k merges heads k, k + 4 over all
// splits (kChunk per round of loads), and R_vᵀ is read once per group instead of once per head.
// For many pairs (measured on the H200, same run: batch 64 / 32K 374 -> 363 us, batch 32 / 64K
// 350 -> 344, batch 8 equal); with few pairs merge_splits' 4 slices per head finish sooner
// (batch 1 / 32K 17.3 vs 19.2 us).
template <int kChunk, typename Out>
__global__ void __launch_bounds__(kMergeThreads)
    merge_splits_group(const float* part_o, const float* part_ml, int n_kv, int total_splits, int n_heads, int r,
                       const float* rot_v_t, Out* out) {
  __shared__ float ov[kHeads][kD];
  __shared__ float part[4][kHeads][kD];
  const int h = blockIdx.x, b = blockIdx.y, j = threadIdx.x % kD, slice = threadIdx.x / kD;
  float rv[kD / 4];
  load_quarter(rot_v_t ? rot_v_t + size_t(h) * kD * kD : nullptr, slice, j, rv);
  pdl_wait();               // partials come from decode_kernel
  pdl_launch_dependents();  // the next layer's append may stage its rotation now
  const size_t base = (size_t(b) * n_kv + h) * total_splits;
  for (int hh = slice; hh < r; hh += 4) {
    float m_run, l_run, acc;
    merge_run<kChunk, kD>(
        part_o, part_ml, [base, hh](int s) { return (base + s) * kHeads + hh; }, j, total_splits, 0, 1, m_run, l_run,
        acc);
    ov[hh][j] = l_run > 0.0f ? acc / l_run : 0.0f;
  }
  __syncthreads();
  if (rot_v_t) {
    rotate_quarter(ov, rv, r, slice, j, part);
    __syncthreads();
  }
  for (int hh = slice; hh < r; hh += 4)
    store_activation(out + (size_t(b) * n_heads + size_t(h) * r + hh) * kD + j,
                     rot_v_t ? (part[0][hh][j] + part[1][hh][j]) + (part[2][hh][j] + part[3][hh][j]) : ov[hh][j]);
}

// The INT2 kernel builds: per page-ring depth, level tables (2-bit codes), and per-token or
// per-channel keys at every key and value width; each with its dynamic shared memory (the page
// ring; per-channel keys add each warp's query fragments, decode_kernel's qf), allowed once per
// process.
using DecodeKernel = void (*)(DecodeArgs);
struct Int2Build {
  DecodeKernel kernel;
  size_t smem;
};
template <int kRing, bool kTable, bool kChan, int kKB, int kVB>
constexpr Int2Build int2_build() {
  return {decode_kernel<Mode::Int2, kRing, kTable, kChan, kKB, kVB>,
          size_t(kWarps) * (kRing * size_t(GpuBlock<kKB, kVB, kChan>::kBytes) + (kChan ? 4 * 32 * 16 + 128 * 4 : 0))};
}
static_assert(int2_build<kRingWide, false, false, 1, 1>().smem >= kSlabBytes, "the output slabs reuse the page ring");
static_assert(4 * sizeof(uint4) * 4 == kDecodeQk8Bytes, "DecodeArgs::qk8 per head: [4 t][4] uint4");
// [key bits − 1][value bits − 1], flattened.
template <int kRing, bool kChan, int... I>
std::array<Int2Build, 16> width_builds(std::integer_sequence<int, I...>) {
  return {int2_build<kRing, false, kChan, I / 4 + 1, I % 4 + 1>()...};
}
const std::array<Int2Build, 16>& width_builds(int ring, bool chan) {
  using Widths = std::make_integer_sequence<int, 16>;
  static const std::array<Int2Build, 16> sets[2][2] = {
      {width_builds<kRingDeep, false>(Widths{}), width_builds<kRingDeep, true>(Widths{})},
      {width_builds<kRingWide, false>(Widths{}), width_builds<kRingWide, true>(Widths{})}};
  return sets[ring == kRingWide][chan];
}
Int2Build int2_build(int ring, bool table, bool chan, BlockWidths w) {
  if (table)
    return ring == kRingWide ? int2_build<kRingWide, true, false, 2, 2>() : int2_build<kRingDeep, true, false, 2, 2>();
  return width_builds(ring, chan)[size_t(w.key - 1) * 4 + size_t(w.value - 1)];
}
void prepare_int2_kernels() {
  static std::once_flag once;
  std::call_once(once, [] {
    for (int ring : {kRingDeep, kRingWide}) {
      std::vector<Int2Build> builds{int2_build(ring, true, false, {})};
      for (bool chan : {false, true})
        for (const Int2Build& b : width_builds(ring, chan)) builds.push_back(b);
      for (const Int2Build& b : builds)
        check_cuda(cudaFuncSetAttribute(b.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(b.smem)),
                   "decode (CUDA): shared memory attribute");
    }
  });
}

// What the split-K plan needs of this GPU: its SMs and the CTAs of each INT2 build resident at
// once (occupancy), asked once per process. An explicit CTA target needs nothing of the device.
const DecodeGpu& decode_gpu(int target_ctas) {
  static const DecodeGpu none{};
  if (target_ctas > 0) return none;
  static const DecodeGpu gpu = [] {
    prepare_int2_kernels();
    // The 2-bit builds' occupancy plans every width (the workspace the Runtime sizes at load
    // depends on the plan); wider blocks fit fewer CTAs an SM, so their splits take more waves.
    auto resident = [](int ring) {
      const Int2Build b = int2_build(ring, false, false, {});
      int per_sm = 0;
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, b.kernel, kThreads, b.smem);
      return std::max(1, per_sm) * multiprocessors();
    };
    DecodeGpu d;
    d.sms = multiprocessors();
    d.resident_deep = resident(kRingDeep);
    d.resident_wide = resident(kRingWide);
    return d;
  }();
  return gpu;
}

// The merge for the plan, writing Out.
template <typename Out>
void launch_merge(const cudaLaunchConfig_t& c, const MergePlan& m, const DecodeArgs& a, int total, const float* rot_v_t,
                  void* out) {
  const auto merge = m.grouped      ? (m.chunk == 8 ? merge_splits_group<8, Out> : merge_splits_group<12, Out>)
                     : m.chunk == 1 ? merge_splits<1, Out>
                     : m.chunk == 4 ? merge_splits<4, Out>
                                    : merge_splits<12, Out>;
  check_cuda(cudaLaunchKernelEx(&c, merge, static_cast<const float*>(a.part_o), static_cast<const float*>(a.part_ml),
                                a.n_kv, total, a.n_heads, a.group_heads, rot_v_t, static_cast<Out*>(out)),
             "decode (CUDA) merge launch");
}

void launch(Mode mode, bool table, DecodeArgs& a, const DecodePlan& plan, int batch, const void* q, const float* rot_k,
            const float* rot_v_t, void* out, Activations act, void* workspace, size_t workspace_bytes,
            cudaStream_t stream, int stages) {
  const DecodeWorkspace lay = decode_workspace(batch, a.n_heads, a.n_kv, plan);
  KVCC_REQUIRE(workspace_bytes >= lay.total, "decode (CUDA): workspace too small");
  if (batch == 0) return;
  uint8_t* ws = static_cast<uint8_t*>(workspace);
  float* q_rot = reinterpret_cast<float*>(ws + lay.q_rot);
  uint4* qk8 = reinterpret_cast<uint4*>(ws + lay.qk8);
  float* qk_sc = reinterpret_cast<float*>(ws + lay.qk_sc);
  a.q_rot = q_rot;
  a.qk8 = qk8;
  a.qk_sc = qk_sc;
  a.part_o = reinterpret_cast<float*>(ws + lay.part_o);
  a.part_ml = reinterpret_cast<float*>(ws + lay.part_ml);
  a.paged_splits = mode == Mode::Int2 ? plan.paged_splits : plan.total;
  a.units_per_split = plan.units_per_split;
  a.win_tiles_per_split = plan.win_tiles_per_split;
  a.total_splits = plan.total;
  // Programmatic dependent launch: each grid is launched while its predecessor runs and waits
  // (griddepcontrol.wait) for its results, hiding launch latency; each lets its dependents launch
  // after that wait (decode_kernel at once: merge_splits reads nothing of it before its own wait).
  cudaLaunchAttribute pdl;
  pdl.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  pdl.val.programmaticStreamSerializationAllowed = 1;
  auto config = [&](dim3 grid, unsigned block, size_t smem) {
    cudaLaunchConfig_t c{};
    c.gridDim = grid;
    c.blockDim = dim3(block);
    c.dynamicSmemBytes = smem;
    c.stream = stream;
    c.attrs = &pdl;
    c.numAttrs = 1;
    return c;
  };
  if (stages & 1) {
    uint4* qk = mode == Mode::Int2 ? qk8 : nullptr;
    const QueryKind kind = mode == Mode::Int2 && a.geo.per_channel_keys() ? QueryKind::Fp16Chan
                           : table                                        ? QueryKind::Fp16Table
                                                                          : QueryKind::Int8;
    const dim3 grid(a.n_kv, batch);
    const cudaLaunchConfig_t c = config(grid, kRotThreads, 0);
    if (act == Activations::BFloat16)
      check_cuda(cudaLaunchKernelEx(&c, rotate_queries<__nv_bfloat16>, static_cast<const __nv_bfloat16*>(q), rot_k,
                                    a.n_heads, a.group_heads, a.sm_scale_log2, q_rot, qk, qk_sc, kind),
                 "decode (CUDA) launch");
    else
      check_cuda(cudaLaunchKernelEx(&c, rotate_queries<float>, static_cast<const float*>(q), rot_k, a.n_heads,
                                    a.group_heads, a.sm_scale_log2, q_rot, qk, qk_sc, kind),
                 "decode (CUDA) launch");
  }
  const dim3 grid(plan.total, a.n_kv, batch);
  if (stages & 2) {
    if (mode == Mode::Int2) {
      prepare_int2_kernels();
      const Int2Build b = int2_build(plan.ring, table, a.geo.per_channel_keys(), a.widths);
      const cudaLaunchConfig_t c = config(grid, kThreads, b.smem);
      check_cuda(cudaLaunchKernelEx(&c, b.kernel, a), "decode (CUDA) launch");
    } else {
      const cudaLaunchConfig_t c = config(grid, kThreads, kSlabBytes);
      check_cuda(cudaLaunchKernelEx(&c, decode_kernel<Mode::Bf16Paged, kRingDeep>, a), "decode (CUDA) launch");
    }
  }
  if (stages & 4) {
    const MergePlan m = plan_decode_merge(batch * a.n_kv, plan.total);
    const cudaLaunchConfig_t c = config(dim3(m.grouped ? a.n_kv : a.n_heads, batch), kMergeThreads, 0);
    if (act == Activations::BFloat16) launch_merge<__nv_bfloat16>(c, m, a, plan.total, rot_v_t, out);
    else launch_merge<float>(c, m, a, plan.total, rot_v_t, out);
  }
  check_cuda(cudaGetLastError(), "decode (CUDA) launch");
}

}  // namespace

size_t decode_workspace_bytes(const KvGeometry& g, int batch, int n_heads, int max_pages, int page_tokens_bf16,
                              int target_ctas, int ring) {
  return decode_workspace_bytes(decode_gpu(target_ctas), g, batch, n_heads, max_pages, page_tokens_bf16, target_ctas,
                                ring);
}

void decode_int2(const KvGeometry& g, const uint8_t* pages, const uint16_t* windows, int layer,
                 const DeviceBatch& batch, const HeadCodec* codecs, const DecodeShape& shape, const void* q,
                 const float* rot_k, const float* rot_v_t, void* out, void* workspace, size_t workspace_bytes,
                 cudaStream_t stream, Activations act, const LayerBlocks* blocks) {
  require_hopper();
  bool table = false;
  for (int h = 0; h < g.n_kv_heads; ++h) table = table || codecs[h].key.use_table || codecs[h].value.use_table;
  require_gpu_served(g, shape.n_heads, kGpuDecode, table, "decode (CUDA)");
  KVCC_REQUIRE(!(table && g.per_channel_keys()),
               "decode (CUDA): per-channel keys with level-table values are not supported (kivi's values are uniform)");
  KVCC_REQUIRE(shape.sm_scale > 0.0f, "decode (CUDA): sm_scale must be positive");
  KVCC_REQUIRE(layer >= 0 && layer < g.n_layers, "decode (CUDA): layer out of range");
  const LayerBlocks lb = blocks ? *blocks : two_bit_layer_blocks(g, layer);
  check_layer_blocks(g, lb, table, table, "decode (CUDA)");  // (the table build is 2 / 2)
  KVCC_REQUIRE(shape.ring == 0 || shape.ring == kRingDeep || shape.ring == kRingWide,
               "decode (CUDA): DecodeShape::ring must be 0, 2 or 3");
  DecodeArgs a{};
  if (table) {
    // Code values as fp16: the level table, or the uniform grid's 0..3 (its zero is in the pages).
    for (int h = 0; h < g.n_kv_heads; ++h)
      for (int side = 0; side < 2; ++side) {
        const SideCodec& sc = side ? codecs[h].value : codecs[h].key;
        uint16_t v[4];
        for (int c = 0; c < 4; ++c) v[c] = f16_from_float(sc.use_table ? sc.levels[c] : float(c));
        a.tables[h][side][0] = uint32_t(v[0]) | (uint32_t(v[1]) << 16);
        a.tables[h][side][1] = uint32_t(v[2]) | (uint32_t(v[3]) << 16);
      }
  }
  a.pages = pages + lb.layer_offset;
  a.windows = reinterpret_cast<const __nv_bfloat16*>(windows);
  a.geo = g;
  a.layer = layer;
  KVCC_REQUIRE(lb.page_bytes <= UINT32_MAX, "decode (CUDA): pages of more than 4 GiB");
  a.page_stride = uint32_t(lb.page_bytes);
  a.widths = lb.widths;
  a.n_kv = g.n_kv_heads;
  a.seq_slot = batch.seq_slot;
  a.seq_len = batch.seq_len;
  a.page_offset = batch.page_offset;
  a.page_table = batch.page_table;
  a.n_heads = shape.n_heads;
  a.group_heads = shape.n_heads / g.n_kv_heads;
  a.sm_scale_log2 = shape.sm_scale * kLog2e;
  const DecodePlan plan =
      plan_decode_int2(decode_gpu(shape.target_ctas), g, batch.batch, batch.max_pages, shape.target_ctas, shape.ring);
  launch(Mode::Int2, table, a, plan, batch.batch, q, rot_k, rot_v_t, out, act, workspace, workspace_bytes, stream,
         shape.stages);
}

void decode_bf16_paged(int n_kv_heads, int head_dim, int page_tokens, const uint16_t* bf16_pages,
                       const DeviceBatch& batch, const DecodeShape& shape, const float* q, const float* rot_k,
                       const float* rot_v_t, float* out, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  require_hopper();
  const std::string why = gpu_bf16_unsupported_reason(n_kv_heads, head_dim, shape.n_heads, page_tokens);
  KVCC_REQUIRE(why.empty(), "decode (CUDA): " + why + " is not supported");
  KVCC_REQUIRE(shape.sm_scale > 0.0f, "decode (CUDA): sm_scale must be positive");
  DecodeArgs a{};
  a.bf16_pages = reinterpret_cast<const __nv_bfloat16*>(bf16_pages);
  a.bf16_page_tokens = page_tokens;
  a.n_kv = n_kv_heads;
  a.seq_slot = batch.seq_slot;
  a.seq_len = batch.seq_len;
  a.page_offset = batch.page_offset;
  a.page_table = batch.page_table;
  a.n_heads = shape.n_heads;
  a.group_heads = shape.n_heads / n_kv_heads;
  a.sm_scale_log2 = shape.sm_scale * kLog2e;
  const DecodePlan plan =
      plan_decode_bf16(decode_gpu(shape.target_ctas), batch.batch, n_kv_heads, batch.max_pages, shape.target_ctas);
  launch(Mode::Bf16Paged, false, a, plan, batch.batch, q, rot_k, rot_v_t, out, Activations::Float32, workspace,
         workspace_bytes, stream, shape.stages);
}

}  // namespace kvcc
