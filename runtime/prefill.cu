// Prefill / extend attention over the paged mixed-precision cache (semantics: prefill_ref in
// runtime/attention_ref.cpp; docs/runtime.md "Prefill / extend"), for a ragged batch of sequences
// (their new tokens one after another in q, k, v and out). Four kernels, up to five launches for
// up to kLaunchSeqs sequences (a short extend: three); the batch's sequences and their offsets are
// kernel parameters (PrefillArgs), so a launch needs no copy to the device:
//
//  1. stage_inputs, one launch of three roles: q·R_k per head into head-major fp16 staging
//     ([n_kv][rows][d]; a query row is a (new token, query head of the group) pair), on the tensor
//     cores (rotate_tiles: split bf16 terms; a long launch's queries: a rotate launch before);
//     k·R_k and v·R_v as the append computes them (rotate_kv.cuh: exact fixed-point sums on the
//     tensor cores, rounded to BF16), so the staged new keys and values are exactly what the ring
//     will hold; the BF16 sink and ring (oldest first) in front of them (stage_windows), widened to
//     fp16 (exact within fp16's normal range; beyond ±65504 they saturate, below 2⁻¹⁴ they round).
//  2. prefill_kernel: flash-attention style on the warpgroup MMAs (wgmma, sm_90a), warp-specialised.
//     One CTA = (sequence, key-range split, tile of 64·(MMA warpgroups) query rows, KV head: the
//     fastest); every query head of the group shares the CTA's K/V tiles. Three builds (Build): 4
//     or 8 MMA warps, and the 4-warp one at two CTAs an SM. A producer warpgroup
//     loads key tiles of 64 tokens (INT2 pages by bulk copy, expanded; then the staged fp16 rows,
//     with the causal mask) into shared-memory stages in the 128-byte-swizzled layout the MMAs
//     read; each MMA warpgroup owns 64 rows and consumes the stages (mbarriers between the two
//     roles); S = Q·Kᵀ and O += P·V run in fp16 with fp32 accumulation, Q from registers, P from
//     shared memory (fp16 carries 3 more mantissa bits than bf16: with a bf16 query the logits'
//     rounding alone gave 1-4% output error on the tests' peaked softmax), with an online softmax
//     in registers. INT2 pages are expanded to their code values (exact: 0..3, or the level table
//     rounded to fp16) and the per-token scale and zero are folded in once per token (DESIGN.md):
//     q·k̂ = s·(q·x − z·Σq), Σ p·v̂ = Σ (p·s)·x − Σ (p·s)·z. fp16 rows use s = 1, z = 0, so one
//     code path serves every tier. Per-channel key pages (KIVI's keys) are expanded to the values
//     they decode to (a per-page table per channel pair) and then take s = 1, z = 0 too.
//  3. finish: log-sum-exp merge of the splits (runtime/merge.cuh, as decode's), normalisation (a
//     sequence of one split is normalised by prefill_kernel); then rotate takes the rows out
//     through R_vᵀ, but for sequences of few rows (T·r <= 256: short extends), which finish takes
//     out itself (fp32 FMAs; one launch fewer). Every launch is a programmatic dependent one
//     (launch_dependent): each kernel starts while its predecessor runs (a rotation splits its R
//     into shared memory meanwhile).
// The host-side plan and workspace layout are runtime/plan.cpp's.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include "formats/codec_scalar.h"
#include "formats/error.h"
#include "formats/kv_layout.h"
#include "runtime/activations.h"
#include "runtime/cuda_util.cuh"
#include "runtime/kv_kernels.h"
#include "runtime/merge.cuh"
#include "runtime/plan.h"
#include "runtime/ptx.cuh"
#include "runtime/rotate_kv.cuh"
#include "runtime/served.h"

namespace kvcc {
namespace {

constexpr int kD = kGpuHeadDim;                   // head_dim
constexpr int kBN = kPrefillKeyTile;              // key tokens per tile (= page_tokens)
constexpr int kPageBytes = kGpuPageBytes;         // a (page, layer, head) 2-bit block, either key kind
constexpr int kRawBlocks = 6;                     // such blocks in flight to the producer (Smem::raw)
constexpr int kCodeWords = kGpuCodeRowBytes / 4;  // 32-bit words of a code row, 16 codes each
constexpr int kLaunchSeqs = 64;                   // sequences per launch (their descriptors are kernel parameters)
constexpr int kShortRows = 256;                   // a short extend's query rows (T·r) a KV head, at most
constexpr float kLog2e = 1.4426950408889634f;

// Two at once in one instruction (satfinite: beyond ±65504 the largest finite, NaN stays NaN); the
// softmax packs 32 probabilities a tile with it.
__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  uint32_t u;
  asm("cvt.rn.satfinite.f16x2.f32 %0, %1, %2;" : "=r"(u) : "f"(hi), "f"(lo));
  return u;
}
__device__ __forceinline__ float2 unpack_half2(uint32_t u) {
  return __half22float2(*reinterpret_cast<const __half2*>(&u));
}
__device__ __forceinline__ uint32_t bf16x2_to_half2(uint32_t u) {
  const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u));
  return pack_half2(f.x, f.y);
}

// ---------------------------------------------------------------------------------------------
// Rotations: q·R_k into the staging and O·R_vᵀ out, on the tensor cores. R, and fp32
// inputs, are split into three bf16 terms (t₀ the bf16 rounding of x, t₁ of x − t₀, t₂ of what is
// left: x to fp32's 24 bits), and Σ_{i+j≤2} x_i·R_j is accumulated in fp32 by bf16 MMAs. Every
// product is exact and the dropped products are below 2⁻²⁴·|x|·|R|; the accumulation truncates
// (within 2⁻¹⁶·Σ|x_c·R_c| in the tests, a few fp32 steps of the result), at the tensor cores'
// rate: one fp32 FMA per element and column (the rotations' first form) ran at ~8 TFLOP/s and took
// half of a 4K prefill's time. A bf16 input is one term (3 MMAs per tile step instead of 6). No R
// (no rotation artifacts) is the identity, on the same path.
constexpr int kRotWarps = 8;       // the output rotation's warps (rotate); rows a tile: 16 a warp
constexpr int kRotPitch = kD + 8;  // bf16 per shared row: ldmatrix rows hit distinct banks
constexpr int kRotParts = 4;       // column slices of a tile when tiles are few

// x ≈ t[0] + t[1] + t[2], each term the bf16 rounding of what the earlier ones leave (exact differences).
__device__ __forceinline__ void split_bf16(float x, __nv_bfloat16 (&t)[3]) {
  t[0] = __float2bfloat16_rn(x);
  const float rest = x - __bfloat162float(t[0]);
  t[1] = __float2bfloat16_rn(rest);
  t[2] = __float2bfloat16_rn(rest - __bfloat162float(t[1]));
}

// A CTA's shared memory for tiles of kRows rows and its kCols output columns (from col0).
template <int kTerms, int kRows, int kCols>
struct RotSmem {
  __nv_bfloat16 r[3][kD][kCols + 8];          // R's terms, r[j][c][n − col0] (B operands by ldmatrix.trans)
  __nv_bfloat16 x[kTerms][kRows][kRotPitch];  // the tile's rows, as kTerms terms (A operands)
  int64_t src_row[kRows], dst_row[kRows];
};
template <typename In>
constexpr int rot_terms() {
  return std::is_same<In, float>::value ? 3 : 1;
}

// Where a rotation's rows are, other than in the activations' layout: row p (of the launch's
// range) of KV head h is row offset[e] + h·head_stride[e] + p, e the last segment with first[e] <= p;
// -1 (not rotated here) where head_stride[e] is kSkipRows.
constexpr int64_t kSkipRows = -1;
struct RowMap {
  int n = 0;
  int64_t first[kLaunchSeqs];
  int64_t offset[kLaunchSeqs];
  int64_t head_stride[kLaunchSeqs];
  __device__ int64_t row(int64_t p, int h) const {
    int lo = 0, hi = n - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (first[mid] <= p) lo = mid;
      else hi = mid - 1;
    }
    return head_stride[lo] == kSkipRows ? -1 : offset[lo] + h * head_stride[lo] + p;
  }
};

// y = x·R[h] for KV head h and rows [row0, row0 + rows), in tiles of 16·kWarps rows, by CTA cta of
// ctas (a multiple of kParts) for this head: tile cta / kParts, then every (ctas / kParts)-th (R is
// split into shared memory once per CTA). kIn: x in the activations' layout (row p = token p / r,
// query head h·r + p % r), y the fp16 staging at map's rows (the queries). Else x fp32 at map's
// rows and y in the activations' layout. fp16 saturates beyond ±65504 (NaN stays NaN). Rows the
// map skips are neither read nor written. kParts > 1 (few rows: a short extend's one tile a head):
// the columns are split over kParts CTAs, CTA cta % kParts taking columns [kD/kParts·part,
// +kD/kParts): each splits and multiplies that slice of R only, so the tile's latency (R's fill
// first) is a kParts-th. smem: RotSmem<rot_terms<In>(), 16·kWarps, kD / kParts>.
template <bool kIn, typename In, typename Out, int kWarps, int kParts>
__device__ __forceinline__ void rotate_tiles(const In* x, const float* rot, int64_t row0, int64_t rows, int n_kv, int r,
                                             Out* y, const RowMap& map, int h, int cta, int ctas, uint8_t* smem) {
  constexpr int kTerms = rot_terms<In>(), kCols = kD / kParts, kRows = 16 * kWarps, kThreads = 32 * kWarps;
  auto& s = *reinterpret_cast<RotSmem<kTerms, kRows, kCols>*>(smem);
  int64_t* src_row = s.src_row;
  int64_t* dst_row = s.dst_row;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int col0 = kCols * (cta % kParts);
  // R's terms (the CTA's columns), kCols/8 column pairs a thread: their loads issued together (a
  // short extend's few CTAs wait for this fill first), coalesced, conflict-free stores.
  const float* R = rot ? rot + size_t(h) * kD * kD : nullptr;
  constexpr int kPairs = kD * kCols / 2 / kThreads;
  float2 pair[kPairs];
#pragma unroll
  for (int u = 0; u < kPairs; ++u) {
    const int e = tid + u * kThreads, c = e / (kCols / 2), n = col0 + 2 * (e % (kCols / 2));
    pair[u] = R ? __ldg(reinterpret_cast<const float2*>(R + size_t(c) * kD + n))
                : make_float2(float(c == n), float(c == n + 1));
  }
#pragma unroll
  for (int u = 0; u < kPairs; ++u) {
    const int e = tid + u * kThreads, c = e / (kCols / 2), n = 2 * (e % (kCols / 2));
    __nv_bfloat16 lo[3], hi[3];
    split_bf16(pair[u].x, lo);
    split_bf16(pair[u].y, hi);
#pragma unroll
    for (int j = 0; j < 3; ++j) *reinterpret_cast<__nv_bfloat162*>(&s.r[j][c][n]) = __halves2bfloat162(lo[j], hi[j]);
  }
  pdl_wait();  // x comes from the preceding kernel
  const int64_t tiles = (rows + kRows - 1) / kRows;
  for (int64_t tile = cta / kParts; tile < tiles; tile += ctas / kParts) {
    const int64_t p0 = row0 + tile * kRows;
    const int n = int(min(int64_t(kRows), row0 + rows - p0));
    if (tid < n) {
      const int64_t p = p0 + tid;
      const int64_t act = ((p / r) * n_kv + h) * r + p % r;
      const int64_t mapped = map.row(p, h);
      src_row[tid] = mapped < 0 ? -1 : kIn ? act : mapped;
      dst_row[tid] = mapped < 0 ? -1 : kIn ? mapped : act;
    }
    __syncthreads();  // (also: R's terms are in place)
    // The tile's rows into shared memory as bf16 terms, 16-byte loads issued together (one
    // round trip a tile, not one per load); rows past n are zero.
    if constexpr (kTerms == 1) {
      constexpr int kLoads = kRows * (kD / 8) / kThreads;
      uint4 u[kLoads];
#pragma unroll
      for (int c = 0; c < kLoads; ++c) {
        const int e = tid + c * kThreads, i = e / (kD / 8), col = 8 * (e % (kD / 8));
        u[c] = i < n && src_row[i] >= 0 ? __ldg(reinterpret_cast<const uint4*>(x + src_row[i] * kD + col))
                                        : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int c = 0; c < kLoads; ++c) {
        const int e = tid + c * kThreads, i = e / (kD / 8), col = 8 * (e % (kD / 8));
        *reinterpret_cast<uint4*>(&s.x[0][i][col]) = u[c];
      }
    } else {
      constexpr int kLoads = kRows * (kD / 4) / kThreads;
      float4 f[kLoads];
#pragma unroll
      for (int c = 0; c < kLoads; ++c) {
        const int e = tid + c * kThreads, i = e / (kD / 4), col = 4 * (e % (kD / 4));
        f[c] = i < n && src_row[i] >= 0 ? __ldg(reinterpret_cast<const float4*>(x + src_row[i] * kD + col))
                                        : make_float4(0, 0, 0, 0);
      }
#pragma unroll
      for (int c = 0; c < kLoads; ++c) {
        const int e = tid + c * kThreads, i = e / (kD / 4), col = 4 * (e % (kD / 4));
        __nv_bfloat16 t[4][3];
        split_bf16(f[c].x, t[0]);
        split_bf16(f[c].y, t[1]);
        split_bf16(f[c].z, t[2]);
        split_bf16(f[c].w, t[3]);
#pragma unroll
        for (int j = 0; j < 3; ++j) {
          __nv_bfloat162* d = reinterpret_cast<__nv_bfloat162*>(&s.x[j][i][col]);
          d[0] = __halves2bfloat162(t[0][j], t[1][j]);
          d[1] = __halves2bfloat162(t[2][j], t[3][j]);
        }
      }
    }
    __syncthreads();
    // Warp w: rows 16w .. 16w + 15, the CTA's columns; m16n8k16 MMAs, 2 column tiles per B load.
    float acc[kCols / 8][4];
#pragma unroll
    for (int t = 0; t < kCols / 8; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.0f;
#pragma unroll 1
    for (int k0 = 0; k0 < kD; k0 += 16) {
      uint32_t a[kTerms][4];
#pragma unroll
      for (int i = 0; i < kTerms; ++i)
        ldmatrix_x4(a[i], smem_addr(&s.x[i][16 * warp + lane % 16][k0 + 8 * (lane / 16)]));
#pragma unroll
      for (int n0 = 0; n0 < kCols; n0 += 16)
#pragma unroll
        for (int j = 0; j < 3; ++j) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, smem_addr(&s.r[j][k0 + lane % 8 + 8 * ((lane / 8) % 2)][n0 + 8 * (lane / 16)]));
#pragma unroll
          for (int i = 0; i + j <= 2 && i < kTerms; ++i) {
            mma_bf16(acc[n0 / 8], a[i][0], a[i][1], a[i][2], a[i][3], b[0], b[1]);
            mma_bf16(acc[n0 / 8 + 1], a[i][0], a[i][1], a[i][2], a[i][3], b[2], b[3]);
          }
        }
    }
    // Lane (g, t) holds rows g and g + 8 of its warp's 16, columns 8·tile + 2t and + 1.
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int i = 16 * warp + g + 8 * half;
      if (i >= n || dst_row[i] < 0) continue;
      Out* dst = y + dst_row[i] * kD + col0 + 2 * t;
#pragma unroll
      for (int nt = 0; nt < kCols / 8; ++nt) {
        const float v0 = acc[nt][2 * half], v1 = acc[nt][2 * half + 1];
        if constexpr (kIn) {
          *reinterpret_cast<uint32_t*>(dst + 8 * nt) = pack_half2(v0, v1);
        } else if constexpr (std::is_same<Out, float>::value) {
          *reinterpret_cast<float2*>(dst + 8 * nt) = make_float2(v0, v1);
        } else {
          *reinterpret_cast<__nv_bfloat162*>(dst + 8 * nt) = __floats2bfloat162_rn(v0, v1);
        }
      }
    }
    __syncthreads();  // the next tile's rows and terms overwrite this one's
  }
}

// rotate_tiles of KV head blockIdx.y, 8 warps a CTA: the output, and the queries of a long launch
// (stage_inputs rotates a short one's).
template <bool kIn, typename In, typename Out, int kParts>
__global__ void __launch_bounds__(32 * kRotWarps, 1)
    rotate(const In* x, const float* rot, int64_t row0, int64_t rows, int n_kv, int r, Out* y,
           const __grid_constant__ RowMap map) {
  extern __shared__ __align__(128) uint8_t rot_smem[];
  pdl_launch_dependents();  // the next rotation may split its R meanwhile
  rotate_tiles<kIn, In, Out, kRotWarps, kParts>(x, rot, row0, rows, n_kv, r, y, map, blockIdx.y, blockIdx.x, gridDim.x,
                                                rot_smem);
}

// A key/value tile's rows p0 .. p0 + n - 1 of KV head h (n returned, at most tile_rows): thread i < n
// records row i's input row ((token, KV head) of [T, n_kv, d]) and its staging row; the caller
// syncs before reading them.
__device__ __forceinline__ int kv_tile_rows(int64_t row0, int64_t rows, int64_t p0, int tile_rows, int n_kv, int h,
                                            const RowMap& map, int64_t* src_row, int64_t* dst_row) {
  const int n = int(min(int64_t(tile_rows), row0 + rows - p0)), i = threadIdx.x;
  if (i < n) {
    src_row[i] = (p0 + i) * n_kv + h;
    dst_row[i] = map.row(p0 + i, h);
  }
  return n;
}

// One sequence of a launch: where its rows are in the staging, the partials and the output, and
// which CTAs of the attention and finish grids are its.
struct SeqArgs {
  const int32_t* page_table;   // its history pages
  int64_t hist_tokens;         // tokens in INT2 history (the ring's position)
  int64_t token0, kv0, part0;  // first token of q/k/v/out, staged key row, partial row (PrefillSeqPlan)
  int seq_slot, sink_count, T, rows, row_tiles, n_pages, win_rows, splits, units_per_split;
  int cta0, fin0;  // its first CTA (x) of prefill_kernel's and finish's grids
};

// A layer's page blocks (LayerBlocks) as the producer reads them: block (page, head) at
// pages + page·page_stride + head·bytes, its parts' offsets, its code widths, and the raw buffers
// (Smem::raw) that so long a block gets: as many whole blocks as the 2-bit blocks' room holds.
struct PrefillBlocks {
  uint32_t page_stride, bytes, v_codes, k_params, v_params;
  int key_bits, value_bits, n_raw;
};
struct PrefillArgs {
  const uint8_t* pages;  // the layer's first block (LayerBlocks::block_offset(0, 0))
  PrefillBlocks blk;
  KvGeometry geo;
  int layer, r, n_kv;
  int64_t q_rows, kv_rows;  // staged query rows (the batch's tokens · r) and key/value rows per KV head
  __half* q;                // [n_kv][q_rows][d] rotated
  __half* k;                // [n_kv][kv_rows][d] rotated, BF16 values (window rows, then new keys)
  __half* v;
  float* part_o;   // [part rows][d]: sequence i's [splits][n_kv][rows] from part0
  float* part_ml;  // [part rows][2] (running max in log2 units, sum)
  float sm_scale_log2;
  // Per (KV head, side): the value x_c each 2-bit code stands for (c, or the level table) and
  // whether the stored zero applies (uniform grid) or not (level table: x̂ = s·level[c]).
  float code_value[kPrefillMaxKvHeads][2][4];
  int use_zero[kPrefillMaxKvHeads][2];
  int fin_rows;  // rows per finish CTA (up to kFinRows)
  int n_seqs;
  SeqArgs seq[kLaunchSeqs];
};

// The key and value sides of a rotate_kv launch (blockIdx.z: 0 keys, 1 values): both in one
// launch, so that a short extend pays one kernel boundary for them, not two.
template <typename In>
struct KvSides {
  const In* x[2];
  const RotFragments* rot[2];
  __half* y[2];
};

constexpr int kKvRows = 64, kKvThreads = 128;  // rotate_kv's rows a tile, threads a CTA

// Rows i0 .. i0 + kKvRows - 1 of sequence sq's BF16 windows of one layer, KV head h and side (sink
// rows, then the ring oldest first), widened to fp16 into the sequence's first win_rows rows of the
// key/value staging, ahead of its new tokens (exact within fp16's range; beyond ±65504 they
// saturate): 16 threads a row, 16-byte chunks, the CTA's loads issued together. CTAs of the
// staging launch (stage_inputs), not a kernel of their own: one kernel boundary fewer.
__device__ __forceinline__ void stage_windows(const PrefillArgs& a, const __nv_bfloat16* windows, const SeqArgs& sq,
                                              int i0, int h, int side) {
  constexpr int kPerPass = kKvThreads / 16, kPasses = kKvRows / kPerPass;
  const KvGeometry& geo = a.geo;
  const __nv_bfloat16* win = windows + geo.window_block_elem(sq.seq_slot, a.layer, h);
  const int chunk = threadIdx.x % 16;
  pdl_wait();  // (the windows come from earlier kernels, complete once the preceding one is)
  uint4 u[kPasses];
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    const int i = i0 + kPerPass * p + int(threadIdx.x) / 16;
    if (i >= sq.win_rows) continue;
    const __nv_bfloat16* src = i < sq.sink_count
                                   ? win + (side ? geo.v_sink_elem() : geo.k_sink_elem()) + size_t(i) * kD
                                   : win + (side ? geo.v_ring_elem() : geo.k_ring_elem()) +
                                         size_t(ring_slot(geo, sq.hist_tokens + (i - sq.sink_count))) * kD;
    u[p] = reinterpret_cast<const uint4*>(src)[chunk];
  }
  __half* dst = (side ? a.v : a.k) + (size_t(h) * a.kv_rows + sq.kv0) * kD;
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    const int i = i0 + kPerPass * p + int(threadIdx.x) / 16;
    if (i >= sq.win_rows) continue;
    const uint4 w =
        make_uint4(bf16x2_to_half2(u[p].x), bf16x2_to_half2(u[p].y), bf16x2_to_half2(u[p].z), bf16x2_to_half2(u[p].w));
    reinterpret_cast<uint4*>(dst + size_t(i) * kD)[chunk] = w;
  }
}

// New keys and values: x·R[h] as the append computes it (rotate_kv.cuh: kv_rotation.h's exact
// fixed-point sums on int8 MMAs, rounded to bf16), so the staged rows are exactly what the ring
// will hold (a key one bf16 step off moves a peaked softmax: the tensor cores' truncating fp32
// sums landed on another bf16 value in a few elements per thousand). A CTA of 4 warps, warp w
// output columns 32w .. + 31 (R's fixed-point fragments in registers, loaded before the wait on
// the preceding kernel), takes tiles of up to kKvRows rows of KV head h and side (0 keys, 1
// values), tile cta, then every ctas-th: warps put the rows in fixed point, then rotate them in
// 16-row MMA tiles into map's rows of the fp16 staging (fp16 of the bf16 value). Without R:
// fp16(bf16(x)).
struct KvSmem {
  RotRows<kKvRows> xr;
  int64_t src_row[kKvRows], dst_row[kKvRows];
};
template <typename In>
__device__ __forceinline__ void rotate_kv(const KvSides<In>& sides, int64_t row0, int64_t rows, int n_kv,
                                          const RowMap& map, int h, int side, int cta, int ctas, KvSmem& s) {
  const In* x = side ? sides.x[1] : sides.x[0];  // (selects: an indexed parameter array would go through local memory)
  const RotFragments* rot = side ? sides.rot[1] : sides.rot[0];
  __half* y = side ? sides.y[1] : sides.y[0];
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32;
  RotCols rc;
  if (rot) load_rot_frags(rot + h, w, rc);
  pdl_wait();  // x comes from the preceding kernel
  const int64_t tiles = (rows + kKvRows - 1) / kKvRows;
  for (int64_t tile = cta; tile < tiles; tile += ctas) {
    __syncthreads();  // the previous tile's rows are consumed
    const int n = kv_tile_rows(row0, rows, row0 + tile * kKvRows, kKvRows, n_kv, h, map, s.src_row, s.dst_row);
    __syncthreads();
    const int mtiles = (n + 15) / 16;
    for (int r = w; r < (rot ? 16 * mtiles : n); r += kKvThreads / 32) {
      float xv[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      if (r < n)
#pragma unroll
        for (int u = 0; u < 4; ++u) xv[u] = load_activation(x + s.src_row[r] * kD + 4 * lane + u);
      if (rot) {
        put_rot_row(xv, s.xr, r);
      } else {
        const float2 f01 = __bfloat1622float2(__floats2bfloat162_rn(xv[0], xv[1]));
        const float2 f23 = __bfloat1622float2(__floats2bfloat162_rn(xv[2], xv[3]));
        *reinterpret_cast<uint2*>(y + s.dst_row[r] * kD + 4 * lane) =
            make_uint2(pack_half2(f01.x, f01.y), pack_half2(f23.x, f23.y));
      }
    }
    if (!rot) continue;
    __syncthreads();
    for (int m = 0; m < mtiles; ++m)
      rotate_rows(s.xr, m, n, rc, w, [&](int row, int col, uint32_t yb) {
        *reinterpret_cast<uint32_t*>(y + s.dst_row[row] * kD + col) =
            pack_half2(float_from_bf16(uint16_t(yb & 0xffffu)), float_from_bf16(uint16_t(yb >> 16)));
      });
  }
}

// Everything the attention reads besides the pages, staged in one launch (a short extend's only
// kernel boundary before the attention; as three launches a call over 4K took 5% longer): per
// (KV head h = blockIdx.y, z = blockIdx.z), CTAs x < q_ctas rotate the queries (rotate_tiles, 4
// warps, tiles of 64 rows in kRotParts column slices: CTA 2x + z of 2·q_ctas; none when a launch
// of its own rotated them), the next kv_ctas the new keys (z = 0) or values (z = 1) (rotate_kv), the
// rest the windows of side z, win_ctas CTAs a sequence (stage_windows). The roles share the
// dynamic shared memory.
template <typename In>
__global__ void __launch_bounds__(kKvThreads, 2)
    stage_inputs(const In* q, const float* rot_q, const __grid_constant__ RowMap q_map, int q_ctas,
                 const KvSides<In> sides, int64_t row0, int64_t rows, const __grid_constant__ RowMap kv_map,
                 int kv_ctas, const __grid_constant__ PrefillArgs a, const __nv_bfloat16* windows, int win_ctas) {
  extern __shared__ __align__(128) uint8_t stage_smem[];
  pdl_launch_dependents();
  const int x = blockIdx.x, h = blockIdx.y, z = blockIdx.z;
  if (x < q_ctas) {
    rotate_tiles<true, In, __half, kKvThreads / 32, kRotParts>(q, rot_q, 0, a.q_rows, a.n_kv, a.r, a.q, q_map, h,
                                                               2 * x + z, 2 * q_ctas, stage_smem);
  } else if (x < q_ctas + kv_ctas) {
    rotate_kv(sides, row0, rows, a.n_kv, kv_map, h, z, x - q_ctas, kv_ctas, *reinterpret_cast<KvSmem*>(stage_smem));
  } else {
    const int w = x - q_ctas - kv_ctas;
    stage_windows(a, windows, a.seq[w / win_ctas], (w % win_ctas) * kKvRows, h, z);
  }
}

// The launch's sequence of CTA x: the last one whose first CTA (cta0 or fin0) is <= x.
template <class First>
__device__ __forceinline__ const SeqArgs& seq_of(const PrefillArgs& a, int x, First first) {
  int lo = 0, hi = a.n_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (first(a.seq[mid]) <= x) lo = mid;
    else hi = mid - 1;
  }
  return a.seq[lo];
}

// O = (Σ_s O_s·2^(m_s − M)) / (Σ_s l_s·2^(m_s − M)) over a row's splits, written in fp32 over its
// split-0 partial; a sequence of one split was normalised by prefill_kernel. a.fin_rows
// (<= kFinRows) rows per CTA, one after another: kFinRows for long extends, fewer when the rows are
// few, so that the grid fills the GPU (a short extend's 8 rows a CTA took 12 us at 16 tokens over
// 32K, each row's merge a chain of dependent loads). kSlices slices of kD threads merge disjoint
// sets of splits (merge_run: one round of loads for up to kSlices·kChunk splits), so few dependent
// loads are in series when there are many splits.
// A sequence of few rows (kShortRows a KV head at most: a short extend) is also taken out through
// R_vᵀ here, into out (the activations' layout), and the output rotation skips it: fp32 FMAs, R_vᵀ
// read from L2 by every CTA (64 KB: less than a rotation launch's latency at few rows), each slice
// of threads a quarter of the input channels, the slices summed in a fixed order. The choice is
// the sequence's alone, so its output does not depend on the batch it comes in. kTakeOut: the launch
// has such a sequence (without, the build holds no rotation: 32 registers, not 62, and the merge of
// long extends keeps its occupancy).
constexpr int kFinRows = 8, kSlices = 4, kFinThreads = kSlices * kD;
static_assert(kSlices == 4, "merge_slices combines 4 runs");
__host__ __device__ constexpr bool out_in_finish(int rows) { return rows <= kShortRows; }
template <int kChunk, bool kTakeOut, typename Out>
__global__ void __launch_bounds__(kFinThreads)
    finish(const __grid_constant__ PrefillArgs a, const float* rot_v_t, Out* out) {
  __shared__ float run_m[kFinRows][kSlices], run_l[kFinRows][kSlices];
  __shared__ float part[kSlices][kFinRows][kD];
  __shared__ float merged[kFinRows][kD];
  pdl_wait();  // the partials come from prefill_kernel
  pdl_launch_dependents();
  const SeqArgs& sq = seq_of(a, blockIdx.x, [](const SeqArgs& e) { return e.fin0; });
  const bool take_out = kTakeOut && out_in_finish(sq.rows);
  if (!take_out && sq.splits == 1) return;  // prefill_kernel normalised its rows
  const int rows = sq.rows, splits = sq.splits, n_kv = a.n_kv;
  const int h = blockIdx.y, p0 = (blockIdx.x - sq.fin0) * a.fin_rows, tid = threadIdx.x;
  const int j = tid % kD, slice = tid / kD;
  const int n = min(a.fin_rows, rows - p0);
  // Split s of row i: partial row part0 + (s·n_kv + h)·rows + p0 + i.
  const size_t row0 = size_t(sq.part0) + size_t(h) * rows + p0, split_stride = size_t(n_kv) * rows;
  if (splits > 1) {
    for (int i = 0; i < n; ++i) {
      float m = -INFINITY, l = 0.0f, acc = 0.0f;
      const size_t row = row0 + i;
      merge_run<kChunk, kD>(
          a.part_o, a.part_ml, [row, split_stride](int s) { return size_t(s) * split_stride + row; }, j, splits, slice,
          kSlices, m, l, acc);
      part[slice][i][j] = acc;
      if (j == 0) {
        run_m[i][slice] = m;
        run_l[i][slice] = l;
      }
    }
    __syncthreads();  // every read of the rows' partials is done: split 0's rows take the result
    for (int i = slice; i < n; i += kSlices) {  // every row sees its own token: its sum > 0
      const float o = merge_slices(run_m[i], run_l[i], &part[0][i][j], kFinRows * kD);
      a.part_o[(row0 + i) * kD + j] = o;
      if (take_out) merged[i][j] = o;
    }
  } else {  // (one split: only a sequence taken out here gets this far)
    for (int i = slice; i < n; i += kSlices) merged[i][j] = a.part_o[(row0 + i) * kD + j];
  }
  if (take_out) {
    __syncthreads();  // the merged rows are in place; part is free
    // Output column j, input channels c0 .. c0 + kD/kSlices - 1 of each row (rows past n: not stored).
    constexpr int kPart = kD / kSlices;
    const int c0 = slice * kPart;
    const float* R = rot_v_t ? rot_v_t + size_t(h) * kD * kD : nullptr;
    float acc[kFinRows];
#pragma unroll
    for (int i = 0; i < kFinRows; ++i) acc[i] = 0.0f;
    if (R) {
#pragma unroll 4
      for (int c = c0; c < c0 + kPart; ++c) {
        const float rv = __ldg(R + size_t(c) * kD + j);
#pragma unroll
        for (int i = 0; i < kFinRows; ++i) acc[i] = fmaf(merged[i][c], rv, acc[i]);
      }
#pragma unroll
      for (int i = 0; i < kFinRows; ++i) part[slice][i][j] = acc[i];
      __syncthreads();
    }
    for (int i = slice; i < n; i += kSlices) {
      const float y = R ? (part[0][i][j] + part[1][i][j]) + (part[2][i][j] + part[3][i][j]) : merged[i][j];
      // Row p0 + i of the sequence: new token token0 + (p0 + i) / r, query head h·r + (p0 + i) % r.
      const int64_t p = sq.token0 * a.r + p0 + i;
      const size_t act = size_t(((p / a.r) * n_kv + h) * a.r + p % a.r);
      if constexpr (std::is_same<Out, float>::value) out[act * kD + j] = y;
      else out[act * kD + j] = __float2bfloat16_rn(y);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Attention.

// A stage's code values from a block of other widths than 2 / 2 (uniform grids: level tables are
// 2-bit codes), for the producer thread's word `xword` of rows xrow + 16·q (q < 4), keys then
// values, as the 2-bit expansion lays them out (k_lo / k_hi, v_lo / v_hi: its two 16-byte chunks in
// row xrow of the stage's K and V tiles). Per 2-bit-plane nibble n (channels 2n, 2n + 1 of the
// word's 16): the first plane's pair from its table (lut; the per-channel keys' chan_l, stride 17),
// plus 4·(c0', c1') of the second plane by one fp16 FMA (exact for the code values, integers up to
// 15; for per-channel keys times 4·s of the pair's channels, rounded as the table is). A 1-bit
// plane's word holds this word's channels in bits 0-3 of each byte once shifted right by
// 4·(xword / 4) (kv_layout.h); nibble n's two bits at 8·(n / 2) + 2·(n % 2), taken as the nibble
// b0 | b1 << 2 of the 2-bit tables. Out of line: the 2-bit expansion keeps the producer's registers.
__device__ __forceinline__ void expand_widths(const uint8_t* raw, const PrefillBlocks& pb, bool chan, int xrow,
                                              int xword, const uint32_t (*lut)[16], const uint32_t* chan_l,
                                              __half* k_lo, __half* k_hi, __half* v_lo, __half* v_hi) {
  const int one_word = 4 * (xword & 3), one_shift = 4 * (xword >> 2);
  const auto bits_nibble = [](uint32_t b2) { return (b2 & 1u) | ((b2 & 2u) << 1); };
#pragma unroll 1
  for (int j = 0; j < 8; ++j) {
    const int side = j >> 2, bits = side ? pb.value_bits : pb.key_bits;
    const uint8_t* row = raw + (side ? pb.v_codes : 0u) + (xrow + 16 * (j & 3)) * (kD * bits / 8);
    const bool ck = chan && side == 0;
    const uint32_t w = bits >= 2 ? *reinterpret_cast<const uint32_t*>(row + 4 * xword)
                                 : *reinterpret_cast<const uint32_t*>(row + one_word) >> one_shift;
    const uint32_t x = bits == 4   ? *reinterpret_cast<const uint32_t*>(row + kD / 4 + 4 * xword)
                       : bits == 3 ? *reinterpret_cast<const uint32_t*>(row + kD / 4 + one_word) >> one_shift
                                   : 0u;
    uint32_t out[8];
#pragma unroll
    for (int n = 0; n < 8; ++n) {
      const int bit2 = 8 * (n >> 1) + 2 * (n & 1);
      const uint32_t nib = bits >= 2 ? (w >> (4 * n)) & 15u : bits_nibble((w >> bit2) & 3u);
      uint32_t v = ck ? chan_l[17 * n + nib] : lut[side][nib];
      if (bits >= 3) {
        const uint32_t hi = bits == 4 ? (x >> (4 * n)) & 15u : bits_nibble((x >> bit2) & 3u);
        __half2 m = __float2half2_rn(4.0f);
        if (ck) {  // 4·(s, s') of channels 2p, 2p + 1 (p = 8·xword + n): e5m3 bytes 0, 2 as fp16
          const uint32_t pz = *reinterpret_cast<const uint32_t*>(raw + pb.k_params + 4 * (8 * xword + n));
          const uint32_t sp = e5m3x2_as_f16x2(pz);
          m = __hmul2(m, *reinterpret_cast<const __half2*>(&sp));
        }
        const uint32_t c = lut[side][hi];  // (c0', c1'): the uniform grid's code pair
        const __half2 r = __hfma2(*reinterpret_cast<const __half2*>(&c), m, *reinterpret_cast<const __half2*>(&v));
        v = *reinterpret_cast<const uint32_t*>(&r);
      }
      out[n] = v;
    }
    __half* lo = (side ? v_lo : k_lo) + (j & 3) * 16 * 64;  // 16 rows further
    __half* hi = (side ? v_hi : k_hi) + (j & 3) * 16 * 64;
    *reinterpret_cast<uint4*>(lo) = make_uint4(out[0], out[1], out[2], out[3]);
    *reinterpret_cast<uint4*>(hi) = make_uint4(out[4], out[5], out[6], out[7]);
  }
}

// Key tiles in shared memory. A 64-token tile of keys or values is two blocks of 64 rows × 64
// channels (channels 0-63, then 64-127), each row 128 bytes with its 16-byte chunks swizzled
// (chunk c of row r at c ^ (r % 8)): the 128-byte-swizzled layout the warpgroup MMAs read through
// a descriptor, K-major for S = Q·Kᵀ and MN-major (transposed) for O += P·V. The swizzle also
// spreads the 16-byte stores of a warp over the banks.
constexpr int kTileHalfs = kBN * kD;       // one tile of K or V: 16 KB
constexpr int kBlockBytes = kBN * 64 * 2;  // one 64-channel block: 8 KB
constexpr int kProducer = 128;             // threads of the producer warpgroup (warps 0-3)
// Half index of (row, 16-byte chunk c of the 16 in a row) in a tile.
__device__ __forceinline__ int tile_at(int row, int c) { return (c >> 3) * (kBN * 64) + sw128_offset(row, c & 7) / 2; }
// kStages K/V tiles (the producer fills up to kStages - 1 ahead of the MMAs), kRaw INT2 page
// blocks (copies issued up to kRaw - 1 units ahead), a P' buffer per MMA warpgroup.
template <int kStages, int kRaw, int kWgs>
struct Smem {
  __half k[kStages][kTileHalfs];  // first: the dynamic allocation is aligned to 1024 bytes below
  __half v[kStages][kTileHalfs];
  __half p[kWgs][64 * kBN];       // per MMA warpgroup, P' = fp16(p·s_v) of its 64 rows (A of P·V, 128-byte swizzled)
  float4 tok[kStages][kBN];       // INT2 tiles: (s_k·sm_scale_log2, z_k, s_v, z_v) per token, x̂ = s·(x − z)
  uint8_t raw[kRaw][kPageBytes];  // INT2 page blocks as stored, before expansion (bulk copies; PrefillBlocks::n_raw
                                  // of PrefillBlocks::bytes each where the codes are wider)
  uint64_t full[kStages];         // stage filled: every producer thread arrives
  uint64_t empty[kStages];        // stage read: every MMA warp arrives
  uint64_t raw_full[kRaw];        // page block landed
  uint32_t chan_lut[kD / 2][17];  // per-channel key pages: per channel pair, its 16 nibbles' two values (+1: banks)
};
// The kernel's builds: kWarps MMA warps (one or two warpgroups of 64 query rows) and kPerSm CTAs
// an SM. Two CTAs an SM (the 4-warp build, for few query rows over long histories, where one
// CTA's chain of expansion, S, softmax and P·V per key tile leaves the SM idle most of the time)
// take half the K/V stages, so that two fit the SM's shared memory, and split the registers
// 56 / 200 between the roles (128 a thread at launch).
template <int kWarps, int kPerSm>
struct Build {
  static_assert(kPerSm == 1 || (kPerSm == 2 && kWarps == 4), "two CTAs an SM: the 4-warp build");
  static constexpr int stages = kPerSm == 2 ? 2 : 4, raw = kRawBlocks;
  using Shared = Smem<stages, raw, kWarps / 4>;
  static constexpr size_t smem_bytes = sizeof(Shared) + 1024;  // + the alignment of the swizzle atoms
};
static_assert(2 * (Build<4, 2>::smem_bytes + 1024) <= 228 * 1024, "two CTAs of the 2-stage build fit an SM");
static_assert(kTileHalfs * 2 % 1024 == 0, "tiles keep the 1024-byte alignment of the swizzle atoms");
static_assert(kPageBytes % 16 == 0, "bulk copies move multiples of 16 bytes");

// Units (key tiles) of a CTA: INT2 pages 0 .. n_pages-1, then 64-row tiles of the fp16 staging
// (windows, then new tokens) up to the CTA's last query token. Warp-specialised (FlashAttention
// 3's structure): a producer warpgroup fills the stages and kWarps MMA warps (one or two
// warpgroups of 64 query rows each) consume them.
//  - Producer: thread 0 bulk-copies each INT2 page block into a raw buffer (kRaw - 1 units ahead,
//    the page id read one unit before its copy); the 128 threads expand a landed block into the
//    stage's code values and per-token (scale, zero), or cp.async a staged fp16 tile into it
//    (zeros past the end), and arrive on the stage's `full` barrier.
//  - MMA warpgroups: iteration u waits for unit u's stage, issues S = Q·Kᵀ of unit u and then
//    O += P'·V of unit u-1, runs the softmax of unit u while the P·V still runs, waits for it,
//    releases unit u-1's stage (`empty`), rescales O (where a row's maximum rose) and writes unit
//    u's P' for the next iteration's P·V (FlashAttention 3's overlap within a warpgroup).
// Loads, expansion and MMAs thus overlap across units instead of sharing one chain per tile
// (the single-role kernel spent ~3 us a tile with the tensor cores 11-18% busy). kOne: the launch
// has one sequence, whose fields are then constant-bank operands rather than registers.
template <int kWarps, bool kOne, int kPerSm>
__global__ void __launch_bounds__(32 * kWarps + kProducer, kPerSm)
    prefill_kernel(const __grid_constant__ PrefillArgs a) {
  constexpr int kBM = 16 * kWarps;
  using B = Build<kWarps, kPerSm>;
  constexpr int kStages = B::stages, kRaw = B::raw;
  extern __shared__ uint8_t smem_raw[];
  auto& sm = *reinterpret_cast<typename B::Shared*>(smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023));
  __shared__ uint32_t lut[2][16];  // two codes (4 bits) -> their two fp16 x values

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int cw = warp - kProducer / 32;  // MMA warp (negative: a producer warp)
  // The KV head varies fastest over the grid, so a sequence's last (shortest) split of every head
  // is what the GPU runs last.
  const int h = int(blockIdx.x % unsigned(a.n_kv)), cta = int(blockIdx.x / unsigned(a.n_kv));
  const SeqArgs& sq = kOne ? a.seq[0] : seq_of(a, cta, [](const SeqArgs& e) { return e.cta0; });
  const int rows = sq.rows, r = a.r, n_pages = sq.n_pages, win_rows = sq.win_rows, kv_rows = win_rows + sq.T;
  const int local = cta - sq.cta0;
  const int tile = sq.row_tiles - 1 - local % sq.row_tiles;  // the tiles with the most new tokens start first
  const int split = local / sq.row_tiles;
  const int row0 = tile * kBM;
  const int last_token = (min(row0 + kBM, rows) - 1) / r;
  const int n_units = n_pages + (win_rows + last_token) / kBN + 1;
  const int u0 = split * sq.units_per_split, u1 = min(n_units, u0 + sq.units_per_split);

  pdl_wait();  // the staging comes from the preceding kernels, the pages from earlier ones
  pdl_launch_dependents();
  // An empty split of a short query tile: nothing seen. (A path of its own: an O zeroed on a path
  // into the loop's final wait made ptxas serialise every MMA, C7515.)
  if (u0 >= u1) {
    if (cw < 0) return;
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int p = row0 + 16 * cw + g + 8 * rr;
      if (p >= rows) continue;
      const size_t row = size_t(sq.part0) + (size_t(split) * a.n_kv + h) * rows + p;
#pragma unroll
      for (int n = 0; n < kD / 8; ++n)
        *reinterpret_cast<float2*>(a.part_o + row * kD + 8 * n + 2 * t) = make_float2(0.0f, 0.0f);
      if (t == 0) *reinterpret_cast<float2*>(a.part_ml + row * 2) = make_float2(-INFINITY, 0.0f);
    }
    return;
  }
  if (tid < 32) {
    const int side = tid >> 4, i = tid & 15;
    lut[side][i] = pack_half2(a.code_value[h][side][i & 3], a.code_value[h][side][i >> 2]);
  }
  if (warp == 0) {
    mbar_init(sm.full, kStages, lane, kProducer);
    mbar_init(sm.empty, kStages, lane, 32 * kWarps);  // every MMA thread arrives (below)
    mbar_init(sm.raw_full, kRaw, lane, 1);
  }
  __syncthreads();  // the barriers and the lookup table
  const uint32_t full_s = smem_addr(sm.full), empty_s = smem_addr(sm.empty);

  if (cw < 0) {
    // ---- Producer warpgroup (registers: 48 per thread here, 224 in the MMA warpgroups, in the
    // 8-warp build; 56 and 200 in the two-CTA one).
    if constexpr (kWarps == 8) setmaxnreg_dec<48>();
    if constexpr (kPerSm == 2) setmaxnreg_dec<56>();
    const int32_t* page_table = sq.page_table;
    const __half* kst = a.k + (size_t(h) * a.kv_rows + sq.kv0) * kD;  // this sequence's staged rows
    const __half* vst = a.v + (size_t(h) * a.kv_rows + sq.kv0) * kD;
    const uint32_t raw_s = smem_addr(sm.raw[0]), raw_bar = smem_addr(sm.raw_full);
    const auto page_of = [&](int u) { return u < u1 && u < n_pages ? page_table[u] : 0; };
    // Per-channel key pages: their keys expanded to the values they decode to (below).
    const bool chan = a.geo.per_channel_keys();
    const PrefillBlocks& pb = a.blk;
    const int n_raw = pb.n_raw;                        // (kRaw for 2-bit blocks)
    const auto copy_page = [&](int u, int32_t page) {  // unit u's block into raw buffer (u - u0) % n_raw
      if (u >= u1 || u >= n_pages) return;
      const int b = (u - u0) % n_raw;
      bulk_copy(raw_s + uint32_t(b) * pb.bytes,
                a.pages + (size_t(h) * pb.bytes + size_t(uint32_t(page)) * pb.page_stride), pb.bytes, raw_bar + 8 * b);
    };
    // Thread tid expands word xword of rows xrow + 16·q (q < 4) of both sides. Eight threads (a
    // quarter warp, which a 16-byte store serves at once) take two adjacent rows x four words, so
    // their 16-byte chunks land in 8 distinct swizzle positions (same row, four words: two-way bank
    // conflicts); a warp's words are rows 4w..4w+3 whole, one 128-byte load.
    static_assert(2 * kBN * kCodeWords == 8 * kProducer && kBN == 64, "eight code words a producer thread");
    const int xrow = ((tid >> 4) << 1) | ((tid >> 2) & 1), xword = (((tid >> 3) & 1) << 2) | (tid & 3);
    const int code_off = xrow * kGpuCodeRowBytes + 4 * xword;  // its first word in a raw block
    const int tile_lo = tile_at(xrow, 2 * xword), tile_hi = tile_at(xrow, 2 * xword + 1);
    int32_t next_page = 0;  // thread 0: the page id of unit u + n_raw - 1
    if (tid == 0) {
      for (int w = u0; w < u0 + n_raw - 1; ++w) copy_page(w, page_of(w));
      next_page = page_of(u0 + n_raw - 1);
    }
    for (int u = u0; u < u1; ++u) {
      const int i = u - u0, st = i % kStages;
      named_barrier_sync(3, kProducer);  // every producer thread is done with unit u-1's raw block
      if (tid == 0) {
        copy_page(u + n_raw - 1, next_page);
        next_page = page_of(u + n_raw);
      }
      if (i >= kStages) mbar_wait(empty_s + 8 * st, uint32_t(i / kStages - 1) & 1u);  // unit u - kStages read
      if (u < n_pages) {
        mbar_wait(raw_bar + 8 * (i % n_raw), uint32_t(i / n_raw) & 1u);
        const uint8_t* raw = sm.raw[0] + (i % n_raw) * pb.bytes;
        if (chan) {
          // Per-channel keys decode to x̂ = (x − z_c)·s_c (uniform_dequant): per channel pair of the
          // page, a table of the 16 code nibbles' two values (fp32, rounded once to fp16), which the
          // expansion below reads in place of the plain code-value table (as many lookups; a second
          // pass applying s and z cost +50% at T = 2048 over 32K, the producer being the limit).
          // The previous unit's readers passed the barrier above; this one publishes the table.
          {
            const int p = tid >> 1, n0 = (tid & 1) * 8;  // channel pair p, nibbles n0 .. n0 + 7
            // Their 2-byte pairs (codec_scalar.h ChanParams): e5m3 scales in bytes 0, 2 (fp16 = byte << 7,
            // finite: one conversion), zeros q/4 in bytes 1, 3.
            const uint32_t pz = *reinterpret_cast<const uint32_t*>(raw + pb.k_params + 4 * p);
            const uint32_t s2 = e5m3x2_as_f16x2(pz);
            const float2 s = __half22float2(*reinterpret_cast<const __half2*>(&s2));
            const float2 a = make_float2(s.x, float(int8_t(pz >> 8)) * 0.25f);  // (s, z) of channels 2p, 2p + 1
            const float2 b = make_float2(s.y, float(int8_t(pz >> 24)) * 0.25f);
#pragma unroll
            for (int i = 0; i < 8; ++i)
              sm.chan_lut[p][n0 + i] =
                  pack_half2((float((n0 + i) & 3) - a.y) * a.x, (float((n0 + i) >> 2) - b.y) * b.x);
          }
          named_barrier_sync(3, kProducer);
        }
        if (pb.key_bits == 2 && pb.value_bits == 2) {
          // One swizzle phase (row % 8) for a thread's eight words, so their addresses are fixed
          // offsets of one base; the eight loads are issued before the first lookup needs one.
          uint32_t w[8];
#pragma unroll
          for (int j = 0; j < 8; ++j)
            w[j] = *reinterpret_cast<const uint32_t*>(raw + (j >> 2) * kGpuVCodesOffset +
                                                      (j & 3) * 16 * kGpuCodeRowBytes + code_off);
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            const bool ck = chan && j < 4;
            const uint32_t* l = ck ? &sm.chan_lut[8 * xword][0] : lut[j >> 2];
            const int ls = ck ? 17 : 0;
            const uint4 lo = make_uint4(l[w[j] & 15], l[ls + ((w[j] >> 4) & 15)], l[2 * ls + ((w[j] >> 8) & 15)],
                                        l[3 * ls + ((w[j] >> 12) & 15)]);
            const uint4 hi = make_uint4(l[4 * ls + ((w[j] >> 16) & 15)], l[5 * ls + ((w[j] >> 20) & 15)],
                                        l[6 * ls + ((w[j] >> 24) & 15)], l[7 * ls + (w[j] >> 28)]);
            __half* dst = (j >> 2 ? sm.v[st] : sm.k[st]) + (j & 3) * 16 * 64;  // 16 rows further
            *reinterpret_cast<uint4*>(dst + tile_lo) = lo;
            *reinterpret_cast<uint4*>(dst + tile_hi) = hi;
          }
        } else {
          expand_widths(raw, pb, chan, xrow, xword, lut, &sm.chan_lut[8 * xword][0], sm.k[st] + tile_lo,
                        sm.k[st] + tile_hi, sm.v[st] + tile_lo, sm.v[st] + tile_hi);
        }
        if (tid < kBN) {
          const float2 kp = chan ? make_float2(1.0f, 0.0f)
                                 : __half22float2(*reinterpret_cast<const __half2*>(raw + pb.k_params + 4 * tid));
          const float2 vp = __half22float2(*reinterpret_cast<const __half2*>(raw + pb.v_params + 4 * tid));
          sm.tok[st][tid] = make_float4(kp.x * a.sm_scale_log2, !chan && a.use_zero[h][0] ? kp.y : 0.0f, vp.x,
                                        a.use_zero[h][1] ? vp.y : 0.0f);
        }
        fence_proxy_async();  // the stage's stores, before the tensor cores read it
        mbar_arrive(full_s + 8 * st);
      } else {
        const int key0 = (u - n_pages) * kBN;
        for (int e = tid; e < 2 * kBN * (kD / 8); e += kProducer) {
          const int side = e / (kBN * (kD / 8)), row = (e / (kD / 8)) % kBN, chunk = e % (kD / 8);
          const bool ok = key0 + row < kv_rows;
          const __half* src = (side ? vst : kst) + size_t(ok ? key0 + row : 0) * kD + 8 * chunk;
          cp_async16((side ? sm.v[st] : sm.k[st]) + tile_at(row, chunk), src, ok ? 16 : 0);
        }
        cp_async_mbar_arrive(full_s + 8 * st);  // once this thread's copies have landed
      }
    }
    cp_async_wait_all();
    return;
  }

  // ---- MMA warpgroups.
  if constexpr (kWarps == 8) setmaxnreg_inc<224>();
  if constexpr (kPerSm == 2) setmaxnreg_inc<200>();
  // The warp's 16 query rows (16 of its warpgroup's 64): Q fragments (A operand), Σq of the fp16
  // values, token index.
  uint32_t qa[kD / 16][4];
  float qsum[2];
  int qtok[2];
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int p = row0 + 16 * cw + g + 8 * rr;
    const bool ok = p < rows;
    qtok[rr] = (ok ? p : rows - 1) / r;
    const uint32_t* qrow =
        reinterpret_cast<const uint32_t*>(a.q + (size_t(h) * a.q_rows + size_t(sq.token0) * r + (ok ? p : 0)) * kD);
    float s = 0.0f;
#pragma unroll
    for (int ks = 0; ks < kD / 16; ++ks) {
      const uint32_t lo = ok ? qrow[8 * ks + t] : 0u, hi = ok ? qrow[8 * ks + 4 + t] : 0u;
      qa[ks][rr] = lo;      // a0 / a1: columns 2t, 2t+1 of rows g / g+8
      qa[ks][2 + rr] = hi;  // a2 / a3: columns 2t+8, 2t+9
      const float2 f0 = unpack_half2(lo), f1 = unpack_half2(hi);
      s += (f0.x + f0.y) + (f1.x + f1.y);
    }
    s += __shfl_xor_sync(0xffffffffu, s, 1);
    s += __shfl_xor_sync(0xffffffffu, s, 2);
    qsum[rr] = s;
  }

  float o[2 * kD / 4];  // O: 16 rows × 128 channels per warp (wgmma_m64n128k16's accumulator)
#pragma unroll
  for (int i = 0; i < 2 * kD / 4; ++i) o[i] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f}, spz[2] = {0.0f, 0.0f};
  const int wg = cw >> 2;  // MMA warpgroup
  const uint32_t k_base = smem_addr(sm.k[0]), v_base = smem_addr(sm.v[0]), p_base = smem_addr(sm.p[wg]);
  int u = u0;
  // O += P'·X_v of unit w on the tensor cores, P' from shared memory (K-major A: 16 tokens a step,
  // 32 bytes within its 128-byte rows), X_v from unit w's stage (MN-major B: 16 tokens a step,
  // 8-token groups 1024 bytes apart, the two 64-channel blocks 8 KB apart). (P' from registers
  // would save the shared-memory round trip, but ptxas 13.0 may reuse a register an MMA in flight
  // still reads.)
  const auto issue_pv = [&](int w) {
    wgmma_fence();  // (ptxas still adds one where the first iteration commits an empty group: C7519)
    const uint32_t v_tile = v_base + uint32_t((w - u0) % kStages) * (kTileHalfs * 2);
#pragma unroll
    for (int kk = 0; kk < kBN / 16; ++kk)
      wgmma_m64n128k16_ss<1, 1>(o, wgmma_desc_sw128(p_base + kk * 32, 16, 1024),
                                wgmma_desc_sw128(v_tile + kk * 16 * 128, kBlockBytes, 1024));
  };
  do {
    const int i = u - u0, st = i % kStages;
    mbar_wait(full_s + 8 * st, uint32_t(i / kStages) & 1u);
    if (u >= n_pages) fence_proxy_async();  // the producer's cp.async stores, before the tensor cores read them
    // S = Q·Kᵀ of unit u, then O += P'·V of unit u-1, on the tensor cores one after the other
    // (K-major B: 16 channels a step, 32 bytes within the 128-byte rows of one 64-channel block):
    // the softmax of unit u runs while the P·V does.
    const uint32_t k_tile = k_base + uint32_t(st) * (kTileHalfs * 2);
    const auto k_desc = [k_tile](int ks) {
      return wgmma_desc_sw128(k_tile + (ks >> 2) * kBlockBytes + (ks & 3) * 32, 16, 1024);
    };
    float sc[2 * kBN / 4];  // S: 16 rows × 64 tokens per warp
    wgmma_fence();
    wgmma_m64n64k16_rs<0, 0>(sc, qa[0][0], qa[0][1], qa[0][2], qa[0][3], k_desc(0));
#pragma unroll
    for (int ks = 1; ks < kD / 16; ++ks)
      wgmma_m64n64k16_rs<0, 1>(sc, qa[ks][0], qa[ks][1], qa[ks][2], qa[ks][3], k_desc(ks));
    wgmma_commit();
    if (u > u0) issue_pv(u - 1);
    wgmma_commit();   // (empty in the first iteration: the wait below counts groups)
    wgmma_wait<1>();  // S of unit u (the P·V after it may still run)
    wgmma_hold(sc);
    // Logits (log2 units), row maxima, and P' = fp16(p·s_v) (rows g and g+8 of the warp, tokens
    // 8·nt + 2t and + 1) with Σ P'·z_v, in two builds: an INT2 page tile, with its per-token fold
    // and no mask, and a staged fp16 tile with the causal mask (window rows have key0 + tok < 0;
    // rows past the new tokens exceed every query's token). Almost every tile is a page: its build
    // does none of the mask's work.
    float alpha[2];
    uint32_t pn[kBN / 8][2];
    const auto softmax = [&](auto page_tile) {
      constexpr bool page = decltype(page_tile)::value;
      const int key0 = (u - n_pages) * kBN - win_rows;  // new-token index of the tile's row 0
      float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int nt = 0; nt < kBN / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int tok = 8 * nt + 2 * t + e;
          const float2 tp =
              page ? *reinterpret_cast<const float2*>(&sm.tok[st][tok]) : make_float2(a.sm_scale_log2, 0.0f);
#pragma unroll
          for (int rr = 0; rr < 2; ++rr) {
            float& x = sc[4 * nt + 2 * rr + e];
            if (page) x = (x - tp.y * qsum[rr]) * tp.x;
            else x = key0 + tok <= qtok[rr] ? x * tp.x : -INFINITY;
            mx[rr] = fmaxf(mx[rr], x);
          }
        }
      float msub[2];
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        mx[rr] = fmaxf(mx[rr], __shfl_xor_sync(0xffffffffu, mx[rr], 1));
        mx[rr] = fmaxf(mx[rr], __shfl_xor_sync(0xffffffffu, mx[rr], 2));
        const float mn = fmaxf(m[rr], mx[rr]);
        alpha[rr] = mn == m[rr] ? 1.0f : fast_exp2(m[rr] - mn);  // (exactly 1 where the maximum stays)
        msub[rr] = mn == -INFINITY ? 0.0f : mn;                  // nothing seen yet: exp2(-inf - 0) = 0
        m[rr] = mn;
        l[rr] *= alpha[rr];
        spz[rr] *= alpha[rr];
      }
#pragma unroll
      for (int nt = 0; nt < kBN / 8; ++nt) {
        const float2 tp0 =
            page ? *reinterpret_cast<const float2*>(&sm.tok[st][8 * nt + 2 * t].z) : make_float2(1.0f, 0.0f);
        const float2 tp1 =
            page ? *reinterpret_cast<const float2*>(&sm.tok[st][8 * nt + 2 * t + 1].z) : make_float2(1.0f, 0.0f);
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          const float p0 = fast_exp2(sc[4 * nt + 2 * rr] - msub[rr]),
                      p1 = fast_exp2(sc[4 * nt + 2 * rr + 1] - msub[rr]);
          l[rr] += p0 + p1;
          pn[nt][rr] = pack_half2(p0 * tp0.x, p1 * tp1.x);
          if (page) {  // (staged tiles have no zero point)
            const float2 pr = unpack_half2(pn[nt][rr]);
            spz[rr] = fmaf(pr.x, tp0.y, fmaf(pr.y, tp1.y, spz[rr]));
          }
        }
      }
    };
    if (u < n_pages) softmax(std::true_type{});
    else softmax(std::false_type{});
    wgmma_wait<0>();  // the P·V of unit u-1: O holds units < u, scaled to the old maxima; P' is free
    wgmma_hold(o);
    // Unit u-1's stage is read: every thread arrives for its own reads (of the per-token scales in
    // the softmax, and its share of the P·V just waited for). One arrive a warp after the
    // warpgroup's barrier orders them as well, but compute-sanitizer's racecheck does not follow
    // that chain and reported the producer's next writes of the scales as hazards in the 2-stage
    // builds; with an arrive a thread it reports none, and the times did not change (H100).
    if (u > u0) mbar_arrive(empty_s + 8 * ((i - 1) % kStages));
    // O to the new maxima, skipped where no row of the warp's has a new one (most tiles, once the
    // first few have been seen).
    if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) {
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
#pragma unroll
        for (int n = 0; n < kD / 8; ++n) {
          o[4 * n + 2 * rr] *= alpha[rr];
          o[4 * n + 2 * rr + 1] *= alpha[rr];
        }
      }
    }
    // P' into the warpgroup's buffer (row r's 16-byte chunk c at c ^ (r % 8), r % 8 = g), visible
    // to the tensor cores once the warpgroup's four warps have written theirs.
#pragma unroll
    for (int nt = 0; nt < kBN / 8; ++nt)
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        const int row = 16 * (cw & 3) + g + 8 * rr;
        *reinterpret_cast<uint32_t*>(reinterpret_cast<uint8_t*>(sm.p[wg]) + sw128_offset(row, nt) + 4 * t) = pn[nt][rr];
      }
    fence_proxy_async();
    named_barrier_sync(1 + wg, 128);
  } while (++u < u1);
  issue_pv(u1 - 1);
  wgmma_commit();
  wgmma_wait<0>();
  wgmma_hold(o);

  // Partial results: unnormalised O − Σ P'·z_v, running max, sum; a sequence of one split (nothing
  // to merge) takes the normalised O in their place (finish skips it).
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    l[rr] += __shfl_xor_sync(0xffffffffu, l[rr], 1);
    l[rr] += __shfl_xor_sync(0xffffffffu, l[rr], 2);
    spz[rr] += __shfl_xor_sync(0xffffffffu, spz[rr], 1);
    spz[rr] += __shfl_xor_sync(0xffffffffu, spz[rr], 2);
    const int p = row0 + 16 * cw + g + 8 * rr;
    if (p >= rows) continue;
    const size_t row = size_t(sq.part0) + (size_t(split) * a.n_kv + h) * rows + p;
    float* dst = a.part_o + row * kD;
    const float scale = sq.splits == 1 ? 1.0f / l[rr] : 1.0f;  // > 0: every row sees its own token
#pragma unroll
    for (int n = 0; n < kD / 8; ++n)
      *reinterpret_cast<float2*>(dst + 8 * n + 2 * t) =
          make_float2((o[4 * n + 2 * rr] - spz[rr]) * scale, (o[4 * n + 2 * rr + 1] - spz[rr]) * scale);
    if (t == 0) *reinterpret_cast<float2*>(a.part_ml + row * 2) = make_float2(m[rr], l[rr]);
  }
}

// The kernel of a build (kOne: a launch of one sequence).
template <int kWarps, int kPerSm>
auto prefill_kernel_of(bool one) {
  return one ? prefill_kernel<kWarps, true, kPerSm> : prefill_kernel<kWarps, false, kPerSm>;
}

// The shared-memory attribute of every build, set once per process.
void prepare_prefill_kernels() {
  static std::once_flag once;
  std::call_once(once, [] {
    const auto set = [](auto kernel, size_t bytes) {
      check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)),
                 "prefill (CUDA): shared memory attribute");
    };
    for (bool one : {false, true}) {
      set(prefill_kernel_of<4, 1>(one), Build<4, 1>::smem_bytes);
      set(prefill_kernel_of<4, 2>(one), Build<4, 2>::smem_bytes);
      set(prefill_kernel_of<8, 1>(one), Build<8, 1>::smem_bytes);
    }
  });
}

// What the plan needs of this GPU: the CTAs of each build resident at once (occupancy), asked once.
const PrefillGpu& prefill_gpu() {
  static const PrefillGpu gpu = [] {
    prepare_prefill_kernels();
    auto resident = [](auto kernel, int threads, size_t bytes) {
      int per_sm = 0;
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, bytes);
      return std::max(1, per_sm) * multiprocessors();
    };
    PrefillGpu p;
    p.resident4 = resident(prefill_kernel_of<4, 1>(false), 32 * 4 + kProducer, Build<4, 1>::smem_bytes);
    p.resident4_pair = resident(prefill_kernel_of<4, 2>(false), 32 * 4 + kProducer, Build<4, 2>::smem_bytes);
    p.resident8 = resident(prefill_kernel_of<8, 1>(false), 32 * 8 + kProducer, Build<8, 1>::smem_bytes);
    return p;
  }();
  return gpu;
}

// (Explicit splits need nothing of the device.)
PrefillPlan plan_of(const KvGeometry& g, const std::vector<PrefillSequence>& seqs, const PrefillShape& shape) {
  std::vector<int64_t> lengths(seqs.size());
  std::vector<int> counts(seqs.size());
  for (size_t i = 0; i < seqs.size(); ++i) {
    lengths[i] = seqs[i].length;
    counts[i] = seqs[i].T;
  }
  return plan_prefill(shape.splits > 0 ? PrefillGpu{} : prefill_gpu(), g, lengths, counts, shape.n_heads, shape.splits,
                      shape.warps, shape.ctas_per_sm);
}

// Every launch of a prefill is a programmatic dependent launch: the grid may start while its
// predecessor runs (a rotation splits its R meanwhile, the attention sets up its barriers), and
// each kernel waits (griddepcontrol.wait) before it touches what earlier kernels wrote. A short
// extend is three kernels of a few microseconds each; launched plainly, each also paid the one
// before it draining.
template <typename... Params, typename... Args>
void launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                      const char* what, Args... args) {
  cudaLaunchAttribute pdl;
  pdl.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  pdl.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t c{};
  c.gridDim = grid;
  c.blockDim = block;
  c.dynamicSmemBytes = smem;
  c.stream = stream;
  c.attrs = &pdl;
  c.numAttrs = 1;
  check_cuda(cudaLaunchKernelEx(&c, kernel, args...), what);
}

// Rows [row0, row0 + rows) of every KV head through R (rotate): at most one CTA an SM per head
// (each splits R into its shared memory once), each taking every gridDim.x-th tile.
template <bool kIn, typename In, typename Out>
void rotate_rows(const In* x, const float* rot, int64_t row0, int64_t rows, int n_kv, int r, Out* y, const RowMap& map,
                 cudaStream_t stream) {
  if (rows == 0) return;
  constexpr int kTile = 16 * kRotWarps, kTerms = rot_terms<In>();
  constexpr size_t kSmem[2] = {sizeof(RotSmem<kTerms, kTile, kD>), sizeof(RotSmem<kTerms, kTile, kD / kRotParts>)};
  static const cudaError_t attribute[2] = {
      cudaFuncSetAttribute(rotate<kIn, In, Out, 1>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmem[0])),
      cudaFuncSetAttribute(rotate<kIn, In, Out, kRotParts>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           int(kSmem[1]))};
  for (const cudaError_t e : attribute) check_cuda(e, "prefill (CUDA): the rotation's shared memory attribute");
  const int64_t tiles = (rows + kTile - 1) / kTile;
  // Fewer tiles than a quarter of the SMs: each tile's columns split over kRotParts CTAs.
  const bool split = tiles * n_kv * kRotParts <= multiprocessors();
  const dim3 grid(
      split ? unsigned(tiles * kRotParts) : unsigned(std::min<int64_t>(tiles, std::max(1, multiprocessors() / n_kv))),
      unsigned(n_kv));
  launch_dependent(split ? rotate<kIn, In, Out, kRotParts> : rotate<kIn, In, Out, 1>, grid, dim3(32 * kRotWarps),
                   kSmem[split], stream, "prefill (CUDA): rotation launch", x, rot, row0, rows, n_kv, r, y, map);
}

// stage_inputs' launch: per (KV head, side), 2·q_ctas query CTAs (with_q: a's queries, kRotParts a
// 64-row tile, up to a wave of tiles), a CTA per 64 rows of the new keys or values (up to a wave,
// two CTAs an SM), then win_ctas a sequence of a (max_win rows at most).
template <typename In>
void stage_inputs_launch(const In* q, const float* rot_q, const RowMap& q_map, bool with_q, const KvSides<In>& sides,
                         int64_t row0, int64_t rows, const RowMap& kv_map, const PrefillArgs& a,
                         const __nv_bfloat16* windows, int max_win, cudaStream_t stream) {
  constexpr size_t kSmem = std::max(sizeof(KvSmem), sizeof(RotSmem<rot_terms<In>(), kKvRows, kD / kRotParts>));
  static const cudaError_t attribute =
      cudaFuncSetAttribute(stage_inputs<In>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmem));
  check_cuda(attribute, "prefill (CUDA): the staging's shared memory attribute");
  const int64_t wave = std::max(1, multiprocessors() / a.n_kv);
  const int q_ctas = with_q ? int(std::min<int64_t>((a.q_rows + kKvRows - 1) / kKvRows, wave)) * kRotParts / 2 : 0;
  const int kv_ctas = int(std::min<int64_t>((rows + kKvRows - 1) / kKvRows, wave));
  const int win_ctas = (max_win + kKvRows - 1) / kKvRows;
  launch_dependent(stage_inputs<In>, dim3(unsigned(q_ctas + kv_ctas + win_ctas * a.n_seqs), unsigned(a.n_kv), 2),
                   dim3(kKvThreads), kSmem, stream, "prefill (CUDA): input staging launch", q, rot_q, q_map, q_ctas,
                   sides, row0, rows, kv_map, kv_ctas, a, windows, std::max(win_ctas, 1));
}

void check_scope(const KvGeometry& g, int layer, const std::vector<PrefillSequence>& seqs, const PrefillShape& shape) {
  require_gpu_served(g, shape.n_heads, kGpuPrefill, true, "prefill (CUDA)");
  KVCC_REQUIRE(layer >= 0 && layer < g.n_layers, "prefill (CUDA): layer out of range");
  int64_t tokens = 0;
  for (const PrefillSequence& s : seqs) {
    KVCC_REQUIRE(s.T >= 0 && s.length >= 0 && s.length + s.T < (int64_t(1) << 31),
                 "prefill (CUDA): length or token count out of range");
    tokens += s.T;
  }
  KVCC_REQUIRE(tokens * shape.n_heads < (int64_t(1) << 31), "prefill (CUDA): the batch's token count out of range");
}

template <typename In, typename Out>
void launch_prefill(const KvGeometry& g, const uint16_t* windows, const std::vector<PrefillSequence>& seqs,
                    const PrefillPlan& plan, PrefillArgs& a, const In* q, const In* k, const In* v, const float* rot_k,
                    const float* rot_v_t, const RotFragments* fixed_k, const RotFragments* fixed_v, Out* out,
                    cudaStream_t stream) {
  const int n_kv = g.n_kv_heads;
  RowMap staged_q;  // [n_kv][q_rows][d]
  staged_q.n = 1;
  staged_q.first[0] = staged_q.offset[0] = 0;
  staged_q.head_stride[0] = a.q_rows;
  // A short launch's queries (every sequence's) go with the first inputs' staging; a long one's
  // take a launch of their own (the 4-warp quarter-column tiles would load each row four times).
  const bool q_with_inputs = a.q_rows <= kShortRows;
  if (!q_with_inputs) rotate_rows<true>(q, rot_k, 0, a.q_rows, n_kv, a.r, a.q, staged_q, stream);
  std::vector<int> live;  // sequences with new tokens
  for (size_t i = 0; i < seqs.size(); ++i)
    if (seqs[i].T > 0) live.push_back(int(i));
  prepare_prefill_kernels();
  for (size_t c0 = 0; c0 < live.size(); c0 += kLaunchSeqs) {
    const size_t c1 = std::min(live.size(), c0 + kLaunchSeqs);
    // The new keys and values of these sequences (consecutive tokens), each sequence's shifted
    // past its window rows in the staging; their outputs' merged, unrotated rows (split 0's partials).
    RowMap staged_kv, merged;
    staged_kv.n = merged.n = int(c1 - c0);
    int64_t short_rows = 0;  // rows a KV head that finish takes out itself
    for (size_t e = c0; e < c1; ++e) {
      const PrefillSeqPlan& sp = plan.seqs[size_t(live[e])];
      staged_kv.first[e - c0] = sp.token0;
      staged_kv.offset[e - c0] = sp.kv0 + sp.win_rows - sp.token0;
      staged_kv.head_stride[e - c0] = a.kv_rows;
      merged.first[e - c0] = sp.token0 * a.r;
      merged.offset[e - c0] = sp.part0 - sp.token0 * a.r;
      merged.head_stride[e - c0] = out_in_finish(sp.rows) ? kSkipRows : sp.rows;  // (finish takes those out)
      if (out_in_finish(sp.rows)) short_rows += sp.rows;
    }
    const PrefillSeqPlan& first = plan.seqs[size_t(live[c0])];
    const PrefillSeqPlan& last = plan.seqs[size_t(live[c1 - 1])];
    const int64_t tok0 = first.token0, toks = last.token0 + last.T - tok0;
    // The launch's sequences, those with the longest splits first (they start first).
    std::vector<int> order(live.begin() + long(c0), live.begin() + long(c1));
    std::stable_sort(order.begin(), order.end(), [&plan](int x, int y) {
      return plan.seqs[size_t(x)].units_per_split > plan.seqs[size_t(y)].units_per_split;
    });
    a.n_seqs = int(order.size());
    // finish's rows per CTA: kFinRows, or fewer where that leaves the GPU short of two CTAs an SM.
    int64_t merged_rows = 0;
    for (int i : order) {
      const PrefillSeqPlan& sp = plan.seqs[size_t(i)];
      if (sp.splits > 1 || out_in_finish(sp.rows)) merged_rows += int64_t(sp.rows) * n_kv;
    }
    a.fin_rows =
        int(std::clamp<int64_t>((merged_rows + 2 * multiprocessors() - 1) / (2 * multiprocessors()), 1, kFinRows));
    int ctas = 0, fin_ctas = 0, max_win = 0, max_splits = 0;
    for (size_t e = 0; e < order.size(); ++e) {
      const PrefillSequence& s = seqs[size_t(order[e])];
      const PrefillSeqPlan& sp = plan.seqs[size_t(order[e])];
      KVCC_REQUIRE(s.page_table || sp.n_pages == 0, "prefill (CUDA): a null page table for a sequence with history");
      const KvTiers t = tiers_of(g, s.length);
      SeqArgs& d = a.seq[e];
      d.page_table = s.page_table;
      d.hist_tokens = t.hist_tokens;
      d.token0 = sp.token0;
      d.kv0 = sp.kv0;
      d.part0 = sp.part0;
      d.seq_slot = s.seq_slot;
      d.sink_count = t.sink_count;
      d.T = sp.T;
      d.rows = sp.rows;
      d.row_tiles = sp.row_tiles;
      d.n_pages = sp.n_pages;
      d.win_rows = sp.win_rows;
      d.splits = sp.splits;
      d.units_per_split = sp.units_per_split;
      d.cta0 = ctas;
      d.fin0 = fin_ctas;
      ctas += sp.row_tiles * sp.splits;
      fin_ctas += (sp.rows + a.fin_rows - 1) / a.fin_rows;
      max_win = std::max(max_win, sp.win_rows);
      max_splits = std::max(max_splits, sp.splits);
    }
    stage_inputs_launch(q, rot_k, staged_q, q_with_inputs && c0 == 0,
                        KvSides<In>{{k, v}, {fixed_k, fixed_v}, {a.k, a.v}}, tok0, toks, staged_kv, a,
                        reinterpret_cast<const __nv_bfloat16*>(windows), max_win, stream);
    KVCC_REQUIRE(int64_t(ctas) * n_kv < (int64_t(1) << 31), "prefill (CUDA): too many query tiles in one launch");
    const dim3 grid(unsigned(ctas * n_kv)), threads(32 * plan.warps + kProducer);
    const bool one = a.n_seqs == 1;
    const char* what = "prefill (CUDA): attention launch";
    if (plan.warps == 8)
      launch_dependent(prefill_kernel_of<8, 1>(one), grid, threads, Build<8, 1>::smem_bytes, stream, what, a);
    else if (plan.ctas_per_sm == 2)
      launch_dependent(prefill_kernel_of<4, 2>(one), grid, threads, Build<4, 2>::smem_bytes, stream, what, a);
    else launch_dependent(prefill_kernel_of<4, 1>(one), grid, threads, Build<4, 1>::smem_bytes, stream, what, a);
    const int chunk = merge_slice_chunk(max_splits);
    const auto fin = short_rows > 0 ? (chunk == 1   ? finish<1, true, Out>
                                       : chunk == 4 ? finish<4, true, Out>
                                                    : finish<12, true, Out>)
                                    : (chunk == 1   ? finish<1, false, Out>
                                       : chunk == 4 ? finish<4, false, Out>
                                                    : finish<12, false, Out>);
    if (max_splits > 1 || short_rows > 0)
      launch_dependent(fin, dim3(fin_ctas, n_kv), dim3(kFinThreads), 0, stream, "prefill (CUDA): merge launch", a,
                       rot_v_t, out);
    if (short_rows < toks * a.r)  // (finish took every row out)
      rotate_rows<false>(static_cast<const float*>(a.part_o), rot_v_t, tok0 * a.r, toks * a.r, n_kv, a.r, out, merged,
                         stream);
  }
}

}  // namespace

size_t prefill_workspace_bytes(const KvGeometry& g, const std::vector<PrefillSequence>& seqs,
                               const PrefillShape& shape) {
  check_scope(g, 0, seqs, shape);
  return prefill_workspace(g, plan_of(g, seqs, shape), shape.n_heads).bytes;
}

void prefill_int2(const KvGeometry& g, const uint8_t* pages, const uint16_t* windows, int layer,
                  const std::vector<PrefillSequence>& seqs, const HeadCodec* codecs, const PrefillShape& shape,
                  const void* q, const void* k, const void* v, const float* rot_k, const float* rot_v_t,
                  const RotFragments* fixed_k, const RotFragments* fixed_v, void* out, void* workspace,
                  size_t workspace_bytes, cudaStream_t stream, Activations act, const LayerBlocks* blocks) {
  require_hopper();
  check_scope(g, layer, seqs, shape);
  KVCC_REQUIRE(bool(rot_k) == bool(rot_v_t) && bool(rot_k) == bool(fixed_k) && bool(rot_k) == bool(fixed_v),
               "prefill (CUDA): give all four rotations or none");
  const PrefillPlan plan = plan_of(g, seqs, shape);
  if (plan.tokens == 0) return;
  const PrefillWorkspace lay = prefill_workspace(g, plan, shape.n_heads);
  KVCC_REQUIRE(workspace && workspace_bytes >= lay.bytes, "prefill (CUDA): workspace too small");
  uint8_t* ws = static_cast<uint8_t*>(workspace);
  static thread_local PrefillArgs a;  // ~9 KB of kernel parameters
  a = PrefillArgs{};
  const LayerBlocks lb = blocks ? *blocks : two_bit_layer_blocks(g, layer);
  bool key_table = false, value_table = false;
  for (int h = 0; h < g.n_kv_heads; ++h) {
    key_table = key_table || codecs[h].key.use_table;
    value_table = value_table || codecs[h].value.use_table;
  }
  check_layer_blocks(g, lb, key_table, value_table, "prefill (CUDA)");
  KVCC_REQUIRE(lb.page_bytes <= UINT32_MAX, "prefill (CUDA): pages of more than 4 GiB");
  a.pages = pages + lb.layer_offset;
  a.blk.page_stride = uint32_t(lb.page_bytes);
  a.blk.bytes = uint32_t(lb.head_bytes);
  a.blk.v_codes = uint32_t(g.v_codes_offset(lb.widths));
  a.blk.k_params = uint32_t(g.k_params_offset(lb.widths));
  a.blk.v_params = uint32_t(g.v_params_offset(lb.widths));
  a.blk.key_bits = lb.widths.key;
  a.blk.value_bits = lb.widths.value;
  // Wider blocks: as many as the 2-bit blocks' room holds (a 4 / 4 block: one, copied while none is expanded).
  a.blk.n_raw = int(std::min<size_t>(kRawBlocks, size_t(kRawBlocks) * kPageBytes / lb.head_bytes));
  a.geo = g;
  a.layer = layer;
  a.r = shape.n_heads / g.n_kv_heads;
  a.n_kv = g.n_kv_heads;
  a.q_rows = plan.tokens * a.r;
  a.kv_rows = plan.kv_rows;
  a.q = reinterpret_cast<__half*>(ws + lay.q);
  a.k = reinterpret_cast<__half*>(ws + lay.k);
  a.v = reinterpret_cast<__half*>(ws + lay.v);
  a.part_o = reinterpret_cast<float*>(ws + lay.part_o);
  a.part_ml = reinterpret_cast<float*>(ws + lay.part_ml);
  a.sm_scale_log2 = shape.sm_scale * kLog2e;
  for (int h = 0; h < g.n_kv_heads; ++h)
    for (int side = 0; side < 2; ++side) {
      const SideCodec& c = side ? codecs[h].value : codecs[h].key;
      for (int i = 0; i < 4; ++i) a.code_value[h][side][i] = c.use_table ? c.levels[i] : float(i);
      a.use_zero[h][side] = c.use_table ? 0 : 1;
    }
  if (act == Activations::BFloat16)
    launch_prefill(g, windows, seqs, plan, a, static_cast<const __nv_bfloat16*>(q),
                   static_cast<const __nv_bfloat16*>(k), static_cast<const __nv_bfloat16*>(v), rot_k, rot_v_t, fixed_k,
                   fixed_v, static_cast<__nv_bfloat16*>(out), stream);
  else
    launch_prefill(g, windows, seqs, plan, a, static_cast<const float*>(q), static_cast<const float*>(k),
                   static_cast<const float*>(v), rot_k, rot_v_t, fixed_k, fixed_v, static_cast<float*>(out), stream);
  check_cuda(cudaGetLastError(), "prefill (CUDA) launch");
}

}  // namespace kvcc
