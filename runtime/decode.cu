// Decode attention over the paged mixed-precision cache (and the BF16 paged baseline), on
// tensor cores (mma.sync m16n8k16). docs/runtime.md explains the design; in short:
//
//  - One CTA = (split, KV head, sequence), 4 warps. All query heads of the KV group (<= 8) are the
//    n = 8 columns of the MMAs, so each K/V byte is read once per group. Keys are the M rows:
//    Sᵀ[16 tokens × 8 heads] = K[16 × 128] · Qᵀ, then Oᵀ[128 × 8] += Vᵀ[128 × 16 tokens] · Pᵀ.
//    Pᵀ comes from the Sᵀ accumulators by one movmatrix.trans per 8×8 block.
//  - INT2 history: the codes become fp16 operands with one LOP3 per two codes: code bits masked
//    into the fp16 mantissa under the exponent of 1.0 give 1 + κ·c exactly (κ = 1/4 or 1/16 by
//    the bit position). The scale/zero fold (DESIGN.md) is applied once per token:
//      q·k̂ = s·(q·c − z·Σq),  Σ p·v̂ = Σ (p·s)·c − Σ (p·s)·z,
//    with q·c recovered from the MMA as acc − Σ(q/κ), and Σ(p·s)·c as (acc − Σ p·s)/κ.
//  - BF16 sink and ring (and the baseline's pages) are extra splits of the same launch; one
//    merge kernel combines the splits' (max, sum, output) by log-sum-exp and rotates by R_vᵀ.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <string>

#include "formats/error.h"
#include "formats/kv_layout.h"
#include "runtime/kv_kernels.h"

namespace kvcc {
namespace {

// How INT2 pages reach the registers. 2: cp.async into a 3-stage per-warp shared-memory ring
// (two pages in flight, no registers held, 3 CTAs per SM); 1: two pages double-buffered in
// registers (2 CTAs per SM); 0: one page at a time (3 CTAs per SM).
#ifndef KVCC_DECODE_PREFETCH
#define KVCC_DECODE_PREFETCH 2
#endif
// Pages in each warp's cp.async ring (kStages - 1 in flight while one is computed) and the CTAs
// per SM the kernel is compiled for (3 stages fit 3 CTAs in shared memory; 2 stages fit 4, which
// caps registers at 128). Compile-time, so that scripts/gpu_perf.sh can compare variants in one
// run; the defaults are the fastest measured on the H200 (docs/runtime.md, tuning log).
#ifndef KVCC_DECODE_STAGES
#define KVCC_DECODE_STAGES 3
#endif
#ifndef KVCC_DECODE_MIN_BLOCKS
#define KVCC_DECODE_MIN_BLOCKS 3
#endif
constexpr int kStages = KVCC_DECODE_STAGES;
static_assert(kStages >= 2, "the page ring needs at least two stages");
// Waves of resident CTAs the default split-K plan aims at once there are many (sequence, KV head)
// pairs (plan_splits).
#ifndef KVCC_DECODE_WAVES
#define KVCC_DECODE_WAVES 2
#endif
constexpr int kPageBytes = 4608;  // one (page, layer, head) block at P = 64, d = 128, G = d

constexpr int kD = 128;      // head_dim of the tensor-core kernel
constexpr int kHeads = 8;    // MMA n: query heads per KV head, padded
constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr float kLog2e = 1.4426950408889634f;

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw Error(std::string(what) + ": " + cudaGetErrorString(e));
}

__device__ __forceinline__ void mma_f16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                        uint32_t a3, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t transpose8x8(uint32_t a) {
  uint32_t d;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(d) : "r"(a));
  return d;
}
// 2^x (MUFU.EX2; 2^-inf = 0). Relative error ~2^-22, far below the fp16/bf16 operands'.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}
__device__ __forceinline__ uint32_t pack_bf162(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

// (a & b) | c in one LOP3. Written as inline PTX with register operands because LOP3 takes only
// one immediate: with two constant operands the compiler emits an AND and an OR (twice the ALU
// work of the code expansion, the kernel's bottleneck).
__device__ __forceinline__ uint32_t and_or(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// Two codes (bit position 2j of each 16-bit half of w) as two fp16 values 1 + κ_j·c.
// Bits land at mantissa bits 8–9 (κ = 1/4) or 6–7 (κ = 1/16); one shift is shared by two j.
struct CodeMasks {
  uint32_t m8, m6, one;
};
__device__ __forceinline__ uint32_t code_pair(uint32_t w, int j, const CodeMasks& k) {
  switch (j) {
    case 0: return and_or(w << 8, k.m8, k.one);
    case 1: return and_or(w << 4, k.m6, k.one);
    case 2: return and_or(w << 4, k.m8, k.one);
    case 3: return and_or(w, k.m6, k.one);
    case 4: return and_or(w, k.m8, k.one);
    // Right shifts as multiply-high: IMAD.HI runs on the FMA pipe, which has room; SHF would
    // load the ALU pipe further.
    case 5: return and_or(__umulhi(w, 1u << 28), k.m6, k.one);
    case 6: return and_or(__umulhi(w, 1u << 28), k.m8, k.one);
    default: return and_or(__umulhi(w, 1u << 26), k.m8, k.one);
  }
}
// 1/κ_j.
__host__ __device__ constexpr float kappa_inv(int j) { return (j == 1 || j == 3 || j == 5) ? 16.0f : 4.0f; }

struct DecodeArgs {
  // INT2 cache
  const uint8_t* pages;
  const __nv_bfloat16* windows;
  KvGeometry geo;
  int layer;
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
  const float* q_rot;  // [batch, n_heads, 128]
  int n_heads, group_heads;
  float sm_scale_log2;  // sm_scale · log2(e)
  int paged_splits, units_per_split, total_splits, win_tiles_per_split;
  float* part_o;   // [batch, n_kv, total_splits, 8, 128]
  float* part_ml;  // [batch, n_kv, total_splits, 8, 2]
};

struct WarpState {
  float o[8][4];
  float m[2], l[2], sp[2], spz[2];
};

__device__ __forceinline__ void state_init(WarpState& st) {
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) st.o[j][i] = 0.0f;
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    st.m[c] = -INFINITY;
    st.l[c] = st.sp[c] = st.spz[c] = 0.0f;
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

// New running max for the thread's two head columns; rescales the state; returns the max to
// subtract (0 while nothing has been seen, so exp2(-inf - 0) = 0).
__device__ __forceinline__ void online_rescale(WarpState& st, float mx0, float mx1, float (&msub)[2]) {
  const float mx[2] = {warp_max_over_rows(mx0), warp_max_over_rows(mx1)};
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    const float mn = fmaxf(st.m[c], mx[c]);
    const float alpha = (mn == -INFINITY) ? 1.0f : fast_exp2(st.m[c] - mn);
    st.m[c] = mn;
    msub[c] = (mn == -INFINITY) ? 0.0f : mn;
    st.l[c] *= alpha;
    st.sp[c] *= alpha;
    st.spz[c] *= alpha;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      st.o[j][c] *= alpha;
      st.o[j][c + 2] *= alpha;
    }
  }
}

// The bytes one warp reads for a 64-token INT2 page: per 16-token subtile s, the K code words of
// tokens g and g+8 (8 bytes at 8t), the V code words of tokens 2t, 2t+1, 2t+8, 2t+9 (4 bytes at
// 4g), and the (scale, zero) pairs of tokens g and g+8.
struct PageRegs {
  uint2 kw[4][2];
  uint32_t vw[4][4], kp[4][2], vp[4][2];
};

#if KVCC_DECODE_PREFETCH != 2
__device__ __forceinline__ void load_page(const uint8_t* blk, PageRegs& d, int g, int t) {
  const uint8_t* kc = blk;
  const uint8_t* vc = blk + 64 * 32;
  const uint32_t* kpar = reinterpret_cast<const uint32_t*>(blk + 2 * 64 * 32);
  const uint32_t* vpar = kpar + 64;
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    d.kw[s][0] = __ldg(reinterpret_cast<const uint2*>(kc + (16 * s + g) * 32 + 8 * t));
    d.kw[s][1] = __ldg(reinterpret_cast<const uint2*>(kc + (16 * s + g + 8) * 32 + 8 * t));
    d.vw[s][0] = __ldg(reinterpret_cast<const uint32_t*>(vc + (16 * s + 2 * t) * 32 + 4 * g));
    d.vw[s][1] = __ldg(reinterpret_cast<const uint32_t*>(vc + (16 * s + 2 * t + 1) * 32 + 4 * g));
    d.vw[s][2] = __ldg(reinterpret_cast<const uint32_t*>(vc + (16 * s + 2 * t + 8) * 32 + 4 * g));
    d.vw[s][3] = __ldg(reinterpret_cast<const uint32_t*>(vc + (16 * s + 2 * t + 9) * 32 + 4 * g));
    d.kp[s][0] = __ldg(kpar + 16 * s + g);
    d.kp[s][1] = __ldg(kpar + 16 * s + g + 8);
    d.vp[s][0] = __ldg(vpar + 16 * s + g);
    d.vp[s][1] = __ldg(vpar + 16 * s + g + 8);
  }
}

#endif

// The same fragments from a page block staged in shared memory.
__device__ __forceinline__ void load_page_shared(const uint8_t* blk, PageRegs& d, int g, int t) {
  const uint8_t* kc = blk;
  const uint8_t* vc = blk + 64 * 32;
  const uint32_t* kpar = reinterpret_cast<const uint32_t*>(blk + 2 * 64 * 32);
  const uint32_t* vpar = kpar + 64;
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    d.kw[s][0] = *reinterpret_cast<const uint2*>(kc + (16 * s + g) * 32 + 8 * t);
    d.kw[s][1] = *reinterpret_cast<const uint2*>(kc + (16 * s + g + 8) * 32 + 8 * t);
    d.vw[s][0] = *reinterpret_cast<const uint32_t*>(vc + (16 * s + 2 * t) * 32 + 4 * g);
    d.vw[s][1] = *reinterpret_cast<const uint32_t*>(vc + (16 * s + 2 * t + 1) * 32 + 4 * g);
    d.vw[s][2] = *reinterpret_cast<const uint32_t*>(vc + (16 * s + 2 * t + 8) * 32 + 4 * g);
    d.vw[s][3] = *reinterpret_cast<const uint32_t*>(vc + (16 * s + 2 * t + 9) * 32 + 4 * g);
    d.kp[s][0] = kpar[16 * s + g];
    d.kp[s][1] = kpar[16 * s + g + 8];
    d.vp[s][0] = vpar[16 * s + g];
    d.vp[s][1] = vpar[16 * s + g + 8];
  }
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const uint32_t dst = uint32_t(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}

// One 64-token INT2 page already in registers. kq: the K B-fragments (fp16, q/qscale/κ);
// sq1 = Σ(q/qscale/κ), sq0 = Σ(q/qscale) for the thread's two head columns;
// cscale = qscale·sm_scale·log2e.
__device__ __forceinline__ void int2_page(const PageRegs& d, const uint32_t (&kq)[8][2],
                                          const float (&sq1)[2], const float (&sq0)[2],
                                          float cscale, WarpState& st) {
  const CodeMasks km{0x03000300u, 0x00C000C0u, 0x3C003C00u};
  const auto& kw = d.kw;
  const auto& vw = d.vw;
  const auto& kp = d.kp;
  const auto& vp = d.vp;
  float sc[4][4];
#pragma unroll
  for (int s = 0; s < 4; ++s) {
#pragma unroll
    for (int i = 0; i < 4; ++i) sc[s][i] = 0.0f;
#pragma unroll
    for (int kb = 0; kb < 8; ++kb) {
      const int j0 = (2 * kb) & 7, j1 = (2 * kb + 1) & 7;
      const uint32_t wg = (kb >> 2) ? kw[s][0].y : kw[s][0].x;
      const uint32_t wg8 = (kb >> 2) ? kw[s][1].y : kw[s][1].x;
      mma_f16(sc[s], code_pair(wg, j0, km), code_pair(wg8, j0, km), code_pair(wg, j1, km), code_pair(wg8, j1, km),
              kq[kb][0], kq[kb][1]);
    }
  }
  float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
  for (int s = 0; s < 4; ++s)
#pragma unroll
    for (int r = 0; r < 2; ++r) {  // token g (r = 0) or g + 8
      const float2 sz = __half22float2(*reinterpret_cast<const __half2*>(&kp[s][r]));
      const float sc_tok = sz.x * cscale;
#pragma unroll
      for (int c = 0; c < 2; ++c) {  // head column 2t + c
        const int i = 2 * r + c;
        const float x = fmaf(-sz.y, sq0[c], sc[s][i] - sq1[c]) * sc_tok;
        sc[s][i] = x;
        if (c) mx1 = fmaxf(mx1, x); else mx0 = fmaxf(mx0, x);
      }
    }
  float msub[2];
  online_rescale(st, mx0, mx1, msub);
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    float pr[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      pr[i] = fast_exp2(sc[s][i] - msub[i & 1]);
      st.l[i & 1] += pr[i];
    }
    // P' = p·s_v rounded to fp16 (the MMA operand); Σ P' and Σ P'·z from the same rounded values.
    const float2 v0 = __half22float2(*reinterpret_cast<const __half2*>(&vp[s][0]));  // token g
    const float2 v1 = __half22float2(*reinterpret_cast<const __half2*>(&vp[s][1]));  // token g + 8
    const __half2 h01 = __floats2half2_rn(pr[0] * v0.x, pr[1] * v0.x);
    const __half2 h23 = __floats2half2_rn(pr[2] * v1.x, pr[3] * v1.x);
    const float2 f01 = __half22float2(h01), f23 = __half22float2(h23);
    st.sp[0] += f01.x + f23.x;
    st.sp[1] += f01.y + f23.y;
    st.spz[0] = fmaf(f01.x, v0.y, fmaf(f23.x, v1.y, st.spz[0]));
    st.spz[1] = fmaf(f01.y, v0.y, fmaf(f23.y, v1.y, st.spz[1]));
    const uint32_t b01 = transpose8x8(*reinterpret_cast<const uint32_t*>(&h01));
    const uint32_t b23 = transpose8x8(*reinterpret_cast<const uint32_t*>(&h23));
    const uint32_t lo_a = __byte_perm(vw[s][0], vw[s][1], 0x5410);
    const uint32_t hi_a = __byte_perm(vw[s][0], vw[s][1], 0x7632);
    const uint32_t lo_b = __byte_perm(vw[s][2], vw[s][3], 0x5410);
    const uint32_t hi_b = __byte_perm(vw[s][2], vw[s][3], 0x7632);
#pragma unroll
    for (int j = 0; j < 8; ++j)
      mma_f16(st.o[j], code_pair(lo_a, j, km), code_pair(hi_a, j, km), code_pair(lo_b, j, km),
              code_pair(hi_b, j, km), b01, b23);
  }
}

// One 16-token BF16 tile: rows 0..15 at kbase/vbase (row stride 128), row r valid if bit r of
// `valid` is set (invalid rows are neither read nor counted).
// kSplitQ: q = q_hi + q_lo in two bf16 MMAs, so the logits carry fp32-like precision (the
// windows of the INT2 cache); the plain BF16 baseline rounds q once, as BF16 attention does.
template <bool kSplitQ>
__device__ __forceinline__ void bf16_tile(const __nv_bfloat16* kbase, const __nv_bfloat16* vbase,
                                          uint32_t valid, const uint32_t (&kq)[8][2],
                                          const uint32_t (&kq_lo)[8][2], float cscale,
                                          WarpState& st, int g, int t) {
  uint4 kr[2][4], vr[4][2];
  const uint4 zero4 = make_uint4(0, 0, 0, 0);
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int row = g + 8 * rr;
    const bool ok = (valid >> row) & 1u;
#pragma unroll
    for (int i = 0; i < 4; ++i)
      kr[rr][i] = ok ? __ldg(reinterpret_cast<const uint4*>(kbase + row * kD + 32 * t + 8 * i)) : zero4;
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
    if (i & 1) mx1 = fmaxf(mx1, x); else mx0 = fmaxf(mx0, x);
  }
  float msub[2];
  online_rescale(st, mx0, mx1, msub);
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
    mma_bf16(st.o[mb], __byte_perm(w0, w1, 0x5410), __byte_perm(w0, w1, 0x7632),
             __byte_perm(w2, w3, 0x5410), __byte_perm(w2, w3, 0x7632), b01, b23);
  }
}

enum class Mode { Int2, Bf16Paged };

template <Mode kMode>
__global__ void __launch_bounds__(kThreads, KVCC_DECODE_PREFETCH == 1 ? 2 : KVCC_DECODE_MIN_BLOCKS) decode_kernel(DecodeArgs a) {
  const int split = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  __shared__ float qs[kHeads][kD];
  __shared__ float o_sum[kHeads][kD];
  __shared__ float w_m[kWarps][kHeads], w_l[kWarps][kHeads];
  __shared__ float red[kWarps];
  __shared__ float qsum[kHeads][2];

  asm volatile("griddepcontrol.launch_dependents;");
  const int len = a.seq_len[b];
  const int r = a.group_heads;
  asm volatile("griddepcontrol.wait;" ::: "memory");  // q_rot comes from rotate_queries
  for (int i = threadIdx.x; i < kHeads * kD; i += kThreads) {
    const int hh = i / kD, c = i % kD;
    qs[hh][c] = hh < r ? a.q_rot[(size_t(b) * a.n_heads + size_t(h) * r + hh) * kD + c] : 0.0f;
    o_sum[hh][c] = 0.0f;
  }
  __syncthreads();

  WarpState st;
  state_init(st);
  // Which work this split does.
  const bool int2_split = kMode == Mode::Int2 && split < a.paged_splits;
  const bool paged_split = kMode == Mode::Bf16Paged;
  const bool win_split = kMode == Mode::Int2 && split >= a.paged_splits;
  bool int2_path = false;

  if (int2_split) {
    int2_path = true;
    // Normalise q by its largest |value| in the group so that q/κ (up to 16·q) fits fp16.
    float amax = 0.0f;
#pragma unroll
    for (int i = threadIdx.x; i < kHeads * kD; i += kThreads) amax = fmaxf(amax, fabsf((&qs[0][0])[i]));
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    if (lane == 0) red[warp] = amax;
    __syncthreads();
    amax = fmaxf(fmaxf(red[0], red[1]), fmaxf(red[2], red[3]));
    const float qscale = amax > 0.0f ? amax : 1.0f;
    const float qinv = 1.0f / qscale;
    // Σ over channels of exactly the fp16 operands the MMAs see: warp w sums heads 2w, 2w+1.
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int hh = 2 * warp + c;
      float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
      for (int k = 0; k < kD / 32; ++k) {
        const int ch = lane + 32 * k;
        const float qn = qs[hh][ch] * qinv;
        s0 += __half2float(__float2half_rn(qn));
        s1 += __half2float(__float2half_rn(qn * kappa_inv(ch & 7)));
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) {
        s0 += __shfl_xor_sync(0xffffffffu, s0, off);
        s1 += __shfl_xor_sync(0xffffffffu, s1, off);
      }
      if (lane == 0) {
        qsum[hh][0] = s0;
        qsum[hh][1] = s1;
      }
    }
    uint32_t kq[8][2];
#pragma unroll
    for (int kb = 0; kb < 8; ++kb)
#pragma unroll
      for (int slot = 0; slot < 2; ++slot) {
        const int ri = 2 * kb + slot, w = ri >> 3, j = ri & 7;
        const int lo = 32 * t + 16 * w + j;
        const float ki = kappa_inv(j);
        kq[kb][slot] = pack_half2(qs[g][lo] * qinv * ki, qs[g][lo + 8] * qinv * ki);
      }
    __syncthreads();
    const float sq0[2] = {qsum[2 * t][0], qsum[2 * t + 1][0]};
    const float sq1[2] = {qsum[2 * t][1], qsum[2 * t + 1][1]};
    const float cscale = qscale * a.sm_scale_log2;
    const KvTiers tiers = tiers_of(a.geo, len);
    const int n_pages = int(tiers.hist_tokens / a.geo.page_tokens);
    const int p0 = split * a.units_per_split;
    const int p1 = min(n_pages, p0 + a.units_per_split);
    const int32_t* pt = a.page_table + a.page_offset[b];
    auto page_ptr = [&](int p) { return a.pages + a.geo.page_block_offset(pt[p], a.layer, h); };
#if KVCC_DECODE_PREFETCH == 2
    extern __shared__ uint4 page_ring[];  // [kWarps][kStages][kPageBytes]
    uint8_t* ring = reinterpret_cast<uint8_t*>(page_ring) + size_t(warp) * kStages * kPageBytes;
    // Page k of this warp is p0 + warp + k·kWarps; it lands in stage k % kStages.
    const int n_mine = p0 + warp < p1 ? (p1 - p0 - warp + kWarps - 1) / kWarps : 0;
    auto issue = [&](int k) {
      if (k < n_mine) {
        const uint8_t* src = page_ptr(p0 + warp + k * kWarps);
        uint8_t* dst = ring + (k % kStages) * kPageBytes;
#pragma unroll
        for (int i = lane; i < kPageBytes / 16; i += 32) cp_async16(dst + 16 * i, src + 16 * i);
      }
      cp_async_commit();  // an empty group keeps the wait count uniform
    };
#pragma unroll
    for (int k = 0; k < kStages - 1; ++k) issue(k);
    for (int k = 0; k < n_mine; ++k) {
      issue(k + kStages - 1);
      cp_async_wait<kStages - 1>();  // page k's group is done
      __syncwarp();
      PageRegs buf;
      load_page_shared(ring + (k % kStages) * kPageBytes, buf, g, t);
      __syncwarp();  // every lane has read stage k % kStages before it is refilled
      int2_page(buf, kq, sq1, sq0, cscale, st);
    }
#elif KVCC_DECODE_PREFETCH == 1
    // Two pages in registers: the next page's loads are in flight while this one is computed.
    PageRegs buf0, buf1;
    int p = p0 + warp;
    if (p < p1) load_page(page_ptr(p), buf0, g, t);
    for (; p < p1; p += 2 * kWarps) {
      if (p + kWarps < p1) load_page(page_ptr(p + kWarps), buf1, g, t);
      int2_page(buf0, kq, sq1, sq0, cscale, st);
      if (p + kWarps >= p1) break;
      if (p + 2 * kWarps < p1) load_page(page_ptr(p + 2 * kWarps), buf0, g, t);
      int2_page(buf1, kq, sq1, sq0, cscale, st);
    }
#else
    for (int p = p0 + warp; p < p1; p += kWarps) {
      PageRegs buf;
      load_page(page_ptr(p), buf, g, t);
      int2_page(buf, kq, sq1, sq0, cscale, st);
    }
#endif
  } else if (paged_split || win_split) {
    uint32_t kq[8][2], kq_lo[8][2];
    auto lo_part = [](float x) { return x - __bfloat162float(__float2bfloat16_rn(x)); };
#pragma unroll
    for (int kb = 0; kb < 8; ++kb) {
      const int c = 32 * t + 4 * kb;
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
        bf16_tile<false>(blk + size_t(tile) * 16 * kD, blk + size_t(P) * kD + size_t(tile) * 16 * kD,
                         valid, kq, kq_lo, cscale, st, g, t);
      }
    } else {
      const KvGeometry& geo = a.geo;
      const KvTiers tiers = tiers_of(geo, len);
      const int sink_tiles = geo.sink / 16, ring_tiles = geo.recent / 16;
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
    st.l[c] = warp_sum_over_rows(st.l[c]);
    st.sp[c] = warp_sum_over_rows(st.sp[c]);
    st.spz[c] = warp_sum_over_rows(st.spz[c]);
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
  // Warps add in a fixed order, so repeated runs give identical bits.
  for (int w = 0; w < kWarps; ++w) {
    if (w == warp) {
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int c = i & 1, head = 2 * t + c;
          int ch;
          float v = st.o[j][i];
          if (int2_path) {
            ch = 16 * g + 8 * (i >> 1) + j;
            v = (v - st.sp[c]) * kappa_inv(j) - st.spz[c];
          } else {
            ch = 16 * g + 2 * j + (i >> 1);
          }
          o_sum[head][ch] += v * factor[c];
        }
    }
    __syncthreads();
  }
  const size_t base = (size_t(b) * a.n_kv + h) * a.total_splits + split;
  for (int i = threadIdx.x; i < r * kD; i += kThreads) a.part_o[base * kHeads * kD + i] = (&o_sum[0][0])[i];
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

// q_rot[b, qh] = q[b, qh] · R_k[qh / r]  (one CTA per (query head, sequence), one thread per
// column; the loop is unrolled so that many R loads are in flight).
__global__ void rotate_queries(const float* q, const float* rot_k, int n_heads, int r, float* q_rot) {
  asm volatile("griddepcontrol.launch_dependents;");
  __shared__ float qv[kD];
  const int qh = blockIdx.x, b = blockIdx.y, j = threadIdx.x;
  const size_t off = (size_t(b) * n_heads + qh) * kD;
  qv[j] = q[off + j];
  __syncthreads();
  if (!rot_k) {
    q_rot[off + j] = qv[j];
    return;
  }
  const float* R = rot_k + size_t(qh / r) * kD * kD;
  float acc = 0.0f;
#pragma unroll 32
  for (int i = 0; i < kD; ++i) acc = fmaf(qv[i], __ldg(R + size_t(i) * kD + j), acc);
  q_rot[off + j] = acc;
}

__device__ __forceinline__ float block_reduce(float x, bool is_max, float* red) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float y = __shfl_xor_sync(0xffffffffu, x, off);
    x = is_max ? fmaxf(x, y) : x + y;
  }
  __syncthreads();
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = x;
  __syncthreads();
  x = red[0];
  for (int w = 1; w < int(blockDim.x >> 5); ++w) x = is_max ? fmaxf(x, red[w]) : x + red[w];
  return x;
}

// out[b, qh] = (Σ_s O_s·2^(m_s − M)) / (Σ_s l_s·2^(m_s − M)) · R_vᵀ. The split weights are
// computed in parallel; then 4 slices of threads each sum a quarter of the splits and of the
// rotation's inputs per output channel, so few dependent loads are in series.
constexpr int kMergeThreads = 4 * kD;
__global__ void __launch_bounds__(kMergeThreads) merge_splits(const float* part_o, const float* part_ml, int n_kv,
                                                              int total_splits, int n_heads, int r,
                                                              const float* rot_v_t, float* out) {
  asm volatile("griddepcontrol.wait;" ::: "memory");  // partials come from decode_kernel
  extern __shared__ float weights[];  // [total_splits]
  __shared__ float part[4][kD];
  __shared__ float ov[kD];
  __shared__ float red[kMergeThreads / 32];
  const int qh = blockIdx.x, b = blockIdx.y, j = threadIdx.x % kD, slice = threadIdx.x / kD;
  const int h = qh / r, hh = qh % r;
  const size_t base = (size_t(b) * n_kv + h) * total_splits;
  float mall = -INFINITY;
  for (int s = threadIdx.x; s < total_splits; s += kMergeThreads)
    mall = fmaxf(mall, part_ml[((base + s) * kHeads + hh) * 2]);
  mall = block_reduce(mall, true, red);
  float lsum = 0.0f;
  for (int s = threadIdx.x; s < total_splits; s += kMergeThreads) {
    const float m = part_ml[((base + s) * kHeads + hh) * 2];
    const float w = (m == -INFINITY) ? 0.0f : exp2f(m - mall);
    weights[s] = w;
    lsum += w * part_ml[((base + s) * kHeads + hh) * 2 + 1];
  }
  lsum = block_reduce(lsum, false, red);  // (its barriers also publish `weights`)
  float acc = 0.0f;
#pragma unroll 4
  for (int s = slice; s < total_splits; s += 4)
    if (weights[s] != 0.0f) acc = fmaf(weights[s], part_o[((base + s) * kHeads + hh) * kD + j], acc);
  part[slice][j] = acc;
  __syncthreads();
  if (slice == 0) {
    const float sum = (part[0][j] + part[1][j]) + (part[2][j] + part[3][j]);
    ov[j] = lsum > 0.0f ? sum / lsum : 0.0f;
  }
  __syncthreads();
  float o = slice == 0 ? ov[j] : 0.0f;
  if (rot_v_t) {
    const float* R = rot_v_t + size_t(h) * kD * kD;
    o = 0.0f;
#pragma unroll
    for (int i = slice * (kD / 4); i < (slice + 1) * (kD / 4); ++i) o = fmaf(ov[i], __ldg(R + size_t(i) * kD + j), o);
  }
  __syncthreads();
  part[slice][j] = o;
  __syncthreads();
  if (slice == 0) out[(size_t(b) * n_heads + qh) * kD + j] = (part[0][j] + part[1][j]) + (part[2][j] + part[3][j]);
}

int multiprocessors() {
  static int sms = [] {
    int dev = 0, n = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
    return n > 0 ? n : 132;
  }();
  return sms;
}

struct SplitPlan {
  int paged_splits, units_per_split, window_splits, win_tiles_per_split, total;
};

// Dynamic shared memory of the INT2 kernel (the cp.async page ring), allowed once per process.
constexpr size_t int2_smem_bytes() {
  return KVCC_DECODE_PREFETCH == 2 ? size_t(kWarps) * kStages * kPageBytes : 0;
}
void prepare_int2_kernel() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (int2_smem_bytes() > 0)
      check_cuda(cudaFuncSetAttribute(decode_kernel<Mode::Int2>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      int(int2_smem_bytes())),
                 "decode (CUDA): shared memory attribute");
  });
}

// CTAs of the decode kernel resident at once on the whole GPU.
int resident_ctas() {
  static int n = [] {
    int per_sm = 0;
    prepare_int2_kernel();
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, decode_kernel<Mode::Int2>, kThreads, int2_smem_bytes());
    return std::max(1, per_sm) * multiprocessors();
  }();
  return n;
}

// Split-K plan for `splits_per_pair` history splits per (sequence, KV head) pair; window tiles
// grouped so that a window CTA reads about as many bytes as a history split (unit_bytes per page).
SplitPlan plan_for(int splits_per_pair, int max_units, int window_tiles, double unit_bytes) {
  SplitPlan p{};
  const int units = std::max(1, max_units);
  p.units_per_split = std::max(1, (units + splits_per_pair - 1) / splits_per_pair);
  p.paged_splits = (units + p.units_per_split - 1) / p.units_per_split;
  if (window_tiles > 0) {
    const double tile_bytes = 16.0 * 2 * 256;
    int tps = int(std::ceil(p.units_per_split * unit_bytes / tile_bytes / kWarps)) * kWarps;
    p.win_tiles_per_split = std::min(std::max(tps, kWarps), (window_tiles + kWarps - 1) / kWarps * kWarps);
    p.window_splits = (window_tiles + p.win_tiles_per_split - 1) / p.win_tiles_per_split;
  }
  p.total = p.paged_splits + p.window_splits;
  return p;
}

// (sequence, KV head) pairs below which decode is latency-bound whatever the context.
constexpr int kFewPairs = 48;

// Split-K plan: ceil(target / pairs) history splits per (sequence, KV head) pair. An explicit
// target_ctas (tests, tuning) is used as is. By default, measured on the H200 (docs/runtime.md,
// tuning log): two waves of resident CTAs (balances the tail at long contexts and large batches),
// unless there are few pairs or that plan gives splits of fewer than kShortSplit pages; then each
// CTA's fixed cost (start-up, query preparation, the merge's share) dominates, and fewer, longer
// CTAs win: 2 per SM, at least min_units pages per split so that no warp of a CTA idles.
// (Batch 1 at 4K / 32K / 128K: 20.7 / 35.9 / 74.1 -> 18.9 / 33.9 / 66.8 us; batch 8 at 4K / 16K /
// 32K: 55.8 / 80.5 / 113.0 -> 45.5 / 60.5 / 95.1 us. Batch 8 at 128K or batch 32 at 16K, with
// longer splits, are 1-6% slower that way, so they keep two waves.)
constexpr int kShortSplit = 48;
SplitPlan plan_splits(int batch, int n_kv, int max_units, int target_ctas, int window_tiles,
                      int min_units = 1, double unit_bytes = 64.0 * 72.0) {
  const int pairs = std::max(1, batch * n_kv);
  const int units = std::max(1, max_units);
  if (target_ctas > 0) return plan_for((target_ctas + pairs - 1) / pairs, units, window_tiles, unit_bytes);
  const int waves_target = resident_ctas() * KVCC_DECODE_WAVES;
  const SplitPlan waves = plan_for((waves_target + pairs - 1) / pairs, units, window_tiles, unit_bytes);
  if (pairs >= kFewPairs && waves.units_per_split >= kShortSplit) return waves;
  const int want = (2 * multiprocessors() + pairs - 1) / pairs;
  const int most = (units + std::max(1, min_units) - 1) / std::max(1, min_units);
  return plan_for(std::max(1, std::min(want, most)), units, window_tiles, unit_bytes);
}

// The BF16 baseline's default: two CTAs per multiprocessor (its best measured on the H200).
int bf16_target(int target_ctas) { return target_ctas > 0 ? target_ctas : 2 * multiprocessors(); }

size_t workspace_for(int batch, int n_heads, int n_kv, const SplitPlan& p) {
  const size_t qbytes = size_t(batch) * n_heads * kD * sizeof(float);
  const size_t obytes = size_t(batch) * n_kv * p.total * kHeads * kD * sizeof(float);
  const size_t mlbytes = size_t(batch) * n_kv * p.total * kHeads * 2 * sizeof(float);
  return (qbytes + 255) / 256 * 256 + (obytes + 255) / 256 * 256 + mlbytes;
}

void check_shape(int n_kv, int head_dim, const DecodeShape& shape) {
  require(head_dim == kD, "decode (CUDA): head_dim " + std::to_string(head_dim) +
                              " is not supported (the tensor-core kernel needs 128)");
  require(shape.n_heads > 0 && shape.n_heads % n_kv == 0,
          "decode (CUDA): query heads must be a multiple of KV heads");
  require(shape.n_heads / n_kv <= kHeads, "decode (CUDA): more than 8 query heads per KV head");
}

void launch(Mode mode, DecodeArgs& a, const SplitPlan& plan, int batch, const float* q,
            const float* rot_k, const float* rot_v_t, float* out, void* workspace,
            size_t workspace_bytes, cudaStream_t stream, int stages) {
  require(workspace_bytes >= workspace_for(batch, a.n_heads, a.n_kv, plan),
          "decode (CUDA): workspace too small");
  if (batch == 0) return;
  uint8_t* ws = static_cast<uint8_t*>(workspace);
  const size_t qbytes = (size_t(batch) * a.n_heads * kD * sizeof(float) + 255) / 256 * 256;
  const size_t obytes =
      (size_t(batch) * a.n_kv * plan.total * kHeads * kD * sizeof(float) + 255) / 256 * 256;
  float* q_rot = reinterpret_cast<float*>(ws);
  a.q_rot = q_rot;
  a.part_o = reinterpret_cast<float*>(ws + qbytes);
  a.part_ml = reinterpret_cast<float*>(ws + qbytes + obytes);
  a.paged_splits = mode == Mode::Int2 ? plan.paged_splits : plan.total;
  a.units_per_split = plan.units_per_split;
  a.win_tiles_per_split = plan.win_tiles_per_split;
  a.total_splits = plan.total;
  // Programmatic dependent launch: the attention and merge grids are launched while their
  // predecessor runs and wait (griddepcontrol.wait) for its results, hiding launch latency.
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
  if (stages & 1)
    rotate_queries<<<dim3(a.n_heads, batch), kD, 0, stream>>>(q, rot_k, a.n_heads, a.group_heads, q_rot);
  const dim3 grid(plan.total, a.n_kv, batch);
  if (stages & 2) {
    if (mode == Mode::Int2) {
      prepare_int2_kernel();
      const cudaLaunchConfig_t c = config(grid, kThreads, int2_smem_bytes());
      check_cuda(cudaLaunchKernelEx(&c, decode_kernel<Mode::Int2>, a), "decode (CUDA) launch");
    } else {
      const cudaLaunchConfig_t c = config(grid, kThreads, 0);
      check_cuda(cudaLaunchKernelEx(&c, decode_kernel<Mode::Bf16Paged>, a), "decode (CUDA) launch");
    }
  }
  if (stages & 4) {
    const cudaLaunchConfig_t c = config(dim3(a.n_heads, batch), kMergeThreads, plan.total * sizeof(float));
    check_cuda(cudaLaunchKernelEx(&c, merge_splits, static_cast<const float*>(a.part_o),
                                  static_cast<const float*>(a.part_ml), a.n_kv, plan.total, a.n_heads,
                                  a.group_heads, rot_v_t, out),
               "decode (CUDA) merge launch");
  }
  check_cuda(cudaGetLastError(), "decode (CUDA) launch");
}

}  // namespace

size_t decode_workspace_bytes(const KvGeometry& g, int batch, int n_heads, int max_pages,
                              int page_tokens_bf16, int target_ctas) {
  if (page_tokens_bf16 > 0) {
    const SplitPlan p = plan_splits(batch, g.n_kv_heads, max_pages, bf16_target(target_ctas), 0);
    return workspace_for(batch, n_heads, g.n_kv_heads, SplitPlan{p.total, 0, 0, 0, p.total});
  }
  const SplitPlan p =
      plan_splits(batch, g.n_kv_heads, max_pages, target_ctas, (g.sink + g.recent) / 16, kWarps);
  return workspace_for(batch, n_heads, g.n_kv_heads, p);
}

void decode_int2(const KvGeometry& g, const uint8_t* pages, const uint16_t* windows, int layer,
                 const DeviceBatch& batch, const HeadCodec* codecs, const DecodeShape& shape,
                 const float* q, const float* rot_k, const float* rot_v_t, float* out,
                 void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  check_shape(g.n_kv_heads, g.head_dim, shape);
  require(g.group == g.head_dim, "decode (CUDA): needs one (scale, zero) group per row");
  require(g.page_tokens == 64, "decode (CUDA): needs 64-token pages");
  require(g.sink % 16 == 0 && g.recent % 16 == 0,
          "decode (CUDA): sink and recent windows must be multiples of 16 tokens");
  require(layer >= 0 && layer < g.n_layers, "decode (CUDA): layer out of range");
  for (int h = 0; h < g.n_kv_heads; ++h)
    require(!codecs[h].key.use_table && !codecs[h].value.use_table,
            "decode (CUDA): level-table codecs are not supported by the tensor-core kernel");
  DecodeArgs a{};
  a.pages = pages;
  a.windows = reinterpret_cast<const __nv_bfloat16*>(windows);
  a.geo = g;
  a.layer = layer;
  a.n_kv = g.n_kv_heads;
  a.seq_slot = batch.seq_slot;
  a.seq_len = batch.seq_len;
  a.page_offset = batch.page_offset;
  a.page_table = batch.page_table;
  a.n_heads = shape.n_heads;
  a.group_heads = shape.n_heads / g.n_kv_heads;
  a.sm_scale_log2 = shape.sm_scale * kLog2e;
  const SplitPlan plan =
      plan_splits(batch.batch, g.n_kv_heads, batch.max_pages, shape.target_ctas, (g.sink + g.recent) / 16,
                  kWarps);
  launch(Mode::Int2, a, plan, batch.batch, q, rot_k, rot_v_t, out, workspace, workspace_bytes, stream, shape.stages);
}

void decode_bf16_paged(int n_kv_heads, int head_dim, int page_tokens, const uint16_t* bf16_pages,
                       const DeviceBatch& batch, const DecodeShape& shape, const float* q,
                       const float* rot_k, const float* rot_v_t, float* out, void* workspace,
                       size_t workspace_bytes, cudaStream_t stream) {
  check_shape(n_kv_heads, head_dim, shape);
  require(page_tokens > 0 && page_tokens % 16 == 0, "decode (CUDA): BF16 pages must be multiples of 16 tokens");
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
  SplitPlan plan = plan_splits(batch.batch, n_kv_heads, batch.max_pages, bf16_target(shape.target_ctas), 0);
  plan = SplitPlan{plan.total, plan.units_per_split, 0, 0, plan.total};
  launch(Mode::Bf16Paged, a, plan, batch.batch, q, rot_k, rot_v_t, out, workspace, workspace_bytes, stream, shape.stages);
}

}  // namespace kvcc
