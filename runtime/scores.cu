// Attention-based token scores on a device pool: runtime/kv_kernels.h (attention_scores_int2).
// Semantics: runtime/attention_ref.cpp's attention_scores_ref.
//
// No [W, n] weight matrix is stored. The R = W·r query rows of a KV head (query i, group head a:
// row i·r + a) are rotated once; the cache is then read twice in tiles of 64 positions, decoded to
// float in shared memory as decode and prefill read it (BF16 sink and ring, INT2 pages through
// codec_scalar.h): the first pass writes each tile's (max, Σ exp) of every row's logits, a merge
// makes each row's log-sum-exp, and the second pass recomputes the tile's logits and sums
// exp(s − lse) over the rows into the tile's 64 scores. Float32 throughout (the reference is
// float64): a weight's relative error is a few float32 roundings of a logit of a few units.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <string>

#include "formats/codec_scalar.h"
#include "formats/error.h"
#include "formats/fp16.h"
#include "runtime/cuda_util.cuh"
#include "runtime/kv_kernels.h"

namespace kvcc {
namespace {

constexpr int kD = kGpuHeadDim;
constexpr int kTile = 64;           // positions per CTA
constexpr int kChunk = 16;          // query rows staged at a time
constexpr int kThreads = 128;       // key t = tid % 64 for rows (tid / 64)·8 .. +7 of a chunk
constexpr int kKeyStride = kD + 4;  // padded rows: a quarter-warp's float4 loads hit distinct banks

struct ScoreArgs {
  KvGeometry g;
  const uint8_t* pages;
  const uint16_t* windows;
  const int32_t* page_table;
  const HeadCodec* codecs;  // device [n_kv] of the layer
  int layer, slot, W, r, R, tiles;
  int64_t n;
  const float* q_rot;  // [n_kv][R][d], sm_scale folded in
  float2* part;        // [n_kv][R][tiles]: (max, Σ exp) of a row's logits in a tile
  float* lse;          // [n_kv][R]
  float* scores;       // [n_kv][n]
};

template <class T>
__global__ void rotate_rows(const T* q, const float* rot_k, int n_heads, int r, float sm_scale, float* q_rot, int R) {
  __shared__ float x[kD];
  const int row = blockIdx.x, h = blockIdx.y, j = threadIdx.x;
  const int i = row / r, qh = h * r + row % r;
  x[j] = load_activation(q + (size_t(i) * n_heads + qh) * kD + j);
  __syncthreads();
  float acc = 0.0f;
  if (rot_k) {
    const float* rk = rot_k + size_t(h) * kD * kD;
    for (int c = 0; c < kD; ++c) acc = fmaf(x[c], rk[size_t(c) * kD + j], acc);
  } else {
    acc = x[j];
  }
  q_rot[(size_t(h) * R + row) * kD + j] = acc * sm_scale;
}

// A tile's 64 keys as the cache holds them, into K (float). Row sources first (one thread per
// row: a BF16 window row, or an INT2 code row with its (scale, zero)), then every row as 16
// segments of 8 channels (a uint4 of BF16, or 2 bytes of codes), a thread's 8 segments loaded
// before any is decoded so that their global loads are in flight together (group = head_dim:
// one pair per row, the kernels' scope).
constexpr int kSegs = kD / 8;
constexpr int kSegsPerThread = kTile * kSegs / kThreads;
__device__ void load_tile_keys(const ScoreArgs& a, int h, int64_t p0, float* K, const void** src, float2* sz) {
  const KvGeometry& g = a.g;
  const int tid = threadIdx.x;
  if (tid < kTile) {
    const int64_t p = p0 + tid;
    const KvTiers t = tiers_of(g, a.n);
    const uint16_t* win = a.windows + g.window_block_elem(a.slot, a.layer, h);
    const void* ptr = nullptr;
    float2 pz = make_float2(0.0f, 0.0f);
    if (p >= a.n) {
      ptr = nullptr;
    } else if (p < t.sink_count) {
      ptr = win + g.k_sink_elem() + size_t(p) * kD;
    } else if (p - t.sink_count >= t.hist_tokens) {
      ptr = win + g.k_ring_elem() + size_t(ring_slot(g, p - t.sink_count)) * kD;
    } else {
      const int64_t post = p - t.sink_count;
      const uint8_t* blk = a.pages + g.page_block_offset(a.page_table[post / g.page_tokens], a.layer, h);
      const int row = int(post % g.page_tokens);
      const uint16_t* ps = reinterpret_cast<const uint16_t*>(blk + g.k_params_offset()) + size_t(row) * 2;
      pz = make_float2(float_from_f16(ps[0]), float_from_f16(ps[1]));
      // Marked by the low bit (code rows are 32-byte aligned, BF16 rows 256-byte aligned).
      ptr = reinterpret_cast<const uint8_t*>(blk + g.k_codes_offset() + size_t(row) * g.code_row_bytes()) + 1;
    }
    src[tid] = ptr;
    sz[tid] = pz;
  }
  __syncthreads();
  const SideCodec sc = a.codecs[h].key;
  uint4 raw[kSegsPerThread];
#pragma unroll
  for (int k = 0; k < kSegsPerThread; ++k) {
    const int item = tid + k * kThreads, row = item / kSegs, seg = item % kSegs;
    const uintptr_t ptr = reinterpret_cast<uintptr_t>(src[row]);
    raw[k] = make_uint4(0, 0, 0, 0);
    if (ptr & 1u) raw[k].x = reinterpret_cast<const uint16_t*>(ptr - 1)[seg];
    else if (ptr) raw[k] = reinterpret_cast<const uint4*>(ptr)[seg];
  }
#pragma unroll
  for (int k = 0; k < kSegsPerThread; ++k) {
    const int item = tid + k * kThreads, row = item / kSegs, seg = item % kSegs;
    const uintptr_t ptr = reinterpret_cast<uintptr_t>(src[row]);
    float x[8];
    if (ptr & 1u) {
      const float2 pz = sz[row];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const uint8_t code = uint8_t((raw[k].x >> (2 * j)) & 3u);  // unpack_code's order
        x[j] = sc.use_table ? table_dequant(code, pz.x, sc.levels) : uniform_dequant(code, pz.x, pz.y);
      }
    } else {
      const uint32_t w[4] = {raw[k].x, raw[k].y, raw[k].z, raw[k].w};
#pragma unroll
      for (int j = 0; j < 8; ++j) x[j] = float_from_bf16(uint16_t(w[j / 2] >> (16 * (j % 2))));
    }
    float4* dst = reinterpret_cast<float4*>(K + row * kKeyStride + seg * 8);
    dst[0] = make_float4(x[0], x[1], x[2], x[3]);
    dst[1] = make_float4(x[4], x[5], x[6], x[7]);
  }
}

// kPass 0: each row's (max, Σ exp) over the tile; 1: the tile's scores from the rows' lse.
template <int kPass>
__global__ void __launch_bounds__(kThreads) score_tiles(ScoreArgs a) {
  __shared__ __align__(16) float K[kTile * kKeyStride];
  __shared__ __align__(16) float Q[kChunk * kD];
  __shared__ float S[kChunk * kTile];
  __shared__ const void* src[kTile];
  __shared__ float2 sz[kTile];
  const int tile = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
  const int64_t p0 = int64_t(tile) * kTile;
  load_tile_keys(a, h, p0, K, src, sz);
  const int t = tid % kTile, half = tid / kTile;
  const int64_t p = p0 + t;
  float colsum = 0.0f;
  for (int r0 = 0; r0 < a.R; r0 += kChunk) {
    __syncthreads();  // K written; Q and S free
    for (int e = tid; e < kChunk * kD; e += kThreads) {
      const int row = r0 + e / kD;
      Q[e] = row < a.R ? a.q_rot[(size_t(h) * a.R + row) * kD + e % kD] : 0.0f;
    }
    __syncthreads();
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    const float4* k4 = reinterpret_cast<const float4*>(K + t * kKeyStride);
#pragma unroll 4
    for (int c4 = 0; c4 < kD / 4; ++c4) {
      const float4 k = k4[c4];
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const float4 q = reinterpret_cast<const float4*>(Q + (half * 8 + u) * kD)[c4];
        acc[u] = fmaf(q.x, k.x, fmaf(q.y, k.y, fmaf(q.z, k.z, fmaf(q.w, k.w, acc[u]))));
      }
    }
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const int row = r0 + half * 8 + u;
      // Query i sits at position n − W + i and sees positions up to it.
      const bool valid = row < a.R && p < a.n && p <= a.n - a.W + row / a.r;
      if (kPass == 0) {
        S[(half * 8 + u) * kTile + t] = valid ? acc[u] : -INFINITY;
      } else if (valid) {
        colsum += expf(acc[u] - a.lse[size_t(h) * a.R + row]);
      }
    }
    if (kPass == 0) {
      __syncthreads();
      // 8 lanes per row, 8 logits each, then across the 8 lanes (aligned groups of a warp).
      const int row = tid / 8, l8 = tid % 8;
      float m = -INFINITY;
      for (int j = 0; j < 8; ++j) m = fmaxf(m, S[row * kTile + l8 * 8 + j]);
      for (int o = 4; o >= 1; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
      float l = 0.0f;
      if (m > -INFINITY)
        for (int j = 0; j < 8; ++j) l += expf(S[row * kTile + l8 * 8 + j] - m);
      for (int o = 4; o >= 1; o >>= 1) l += __shfl_xor_sync(0xffffffffu, l, o);
      if (l8 == 0 && r0 + row < a.R) a.part[(size_t(h) * a.R + r0 + row) * a.tiles + tile] = make_float2(m, l);
    }
  }
  if (kPass == 1) {
    __syncthreads();
    if (half == 1) S[t] = colsum;
    __syncthreads();
    if (half == 0 && p < a.n) a.scores[size_t(h) * a.n + p] = colsum + S[t];
  }
}

// One warp per (row, head): the tiles' (max, Σ exp) merged into the row's log-sum-exp.
__global__ void merge_rows(ScoreArgs a) {
  const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, h = blockIdx.y, lane = threadIdx.x % 32;
  if (row >= a.R) return;
  const float2* pr = a.part + (size_t(h) * a.R + row) * a.tiles;
  float m = -INFINITY, l = 0.0f;
  for (int i = lane; i < a.tiles; i += 32) {
    const float2 x = pr[i];
    const float mm = fmaxf(m, x.x);
    if (mm > -INFINITY) l = l * expf(m - mm) + x.y * expf(x.x - mm);
    m = mm;
  }
  for (int o = 16; o >= 1; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, o), l2 = __shfl_xor_sync(0xffffffffu, l, o);
    const float mm = fmaxf(m, m2);
    l = mm > -INFINITY ? l * expf(m - mm) + l2 * expf(m2 - mm) : 0.0f;
    m = mm;
  }
  if (lane == 0) a.lse[size_t(h) * a.R + row] = m + logf(l);
}

struct Layout {
  size_t q_rot = 0, part = 0, lse = 0, total = 0;
};
Layout layout_of(const KvGeometry& g, int64_t n, int W, int n_heads) {
  const size_t R = size_t(W) * size_t(n_heads / g.n_kv_heads), H = size_t(g.n_kv_heads);
  const size_t tiles = size_t((n + kTile - 1) / kTile);
  Layout L;
  size_t at = 0;
  auto take = [&at](size_t bytes) {
    const size_t o = at;
    at += (bytes + 255) / 256 * 256;
    return o;
  };
  L.q_rot = take(H * R * kD * 4);
  L.part = take(H * R * tiles * 8);
  L.lse = take(H * R * 4);
  L.total = at;
  return L;
}

}  // namespace

size_t attention_scores_workspace_bytes(const KvGeometry& g, int64_t length, int W, int n_heads) {
  return layout_of(g, length, W, n_heads).total;
}

void attention_scores_int2(const KvGeometry& g, const uint8_t* pages, const uint16_t* windows, int layer, int seq_slot,
                           int64_t length, const int32_t* page_table, int W, const HeadCodec* codecs, int n_heads,
                           float sm_scale, const void* q, const float* rot_k, float* scores, void* workspace,
                           size_t workspace_bytes, cudaStream_t stream, Activations act) {
  require_gpu_served(g, n_heads, kGpuPrefill, true, "attention scores");
  KVCC_REQUIRE(!g.per_channel_keys(),
               "attention scores (CUDA): per-channel key pages are not supported (the scoring kernel reads per-token "
               "key scales); score them from a host pool");
  KVCC_REQUIRE(W >= 1 && W <= length, "attention scores: the observation window (" + std::to_string(W) +
                                          ") must be in [1, the sequence's length " + std::to_string(length) + "]");
  KVCC_REQUIRE(length <= int64_t(INT32_MAX) * kTile, "attention scores: sequence too long");
  const Layout L = layout_of(g, length, W, n_heads);
  KVCC_REQUIRE(
      workspace && workspace_bytes >= L.total,
      "attention scores: workspace of " + std::to_string(workspace_bytes) + " bytes, needs " + std::to_string(L.total));
  uint8_t* ws = static_cast<uint8_t*>(workspace);
  ScoreArgs a;
  a.g = g;
  a.pages = pages;
  a.windows = windows;
  a.page_table = page_table;
  a.codecs = codecs;
  a.layer = layer;
  a.slot = seq_slot;
  a.W = W;
  a.r = n_heads / g.n_kv_heads;
  a.R = W * a.r;
  a.n = length;
  a.tiles = int((length + kTile - 1) / kTile);
  a.q_rot = reinterpret_cast<float*>(ws + L.q_rot);
  a.part = reinterpret_cast<float2*>(ws + L.part);
  a.lse = reinterpret_cast<float*>(ws + L.lse);
  a.scores = scores;
  const dim3 rows(unsigned(a.R), unsigned(g.n_kv_heads));
  if (act == Activations::BFloat16)
    rotate_rows<<<rows, kD, 0, stream>>>(static_cast<const __nv_bfloat16*>(q), rot_k, n_heads, a.r, sm_scale,
                                         const_cast<float*>(a.q_rot), a.R);
  else
    rotate_rows<<<rows, kD, 0, stream>>>(static_cast<const float*>(q), rot_k, n_heads, a.r, sm_scale,
                                         const_cast<float*>(a.q_rot), a.R);
  const dim3 tiles(unsigned(a.tiles), unsigned(g.n_kv_heads));
  score_tiles<0><<<tiles, kThreads, 0, stream>>>(a);
  merge_rows<<<dim3(unsigned((a.R + 3) / 4), unsigned(g.n_kv_heads)), 128, 0, stream>>>(a);
  score_tiles<1><<<tiles, kThreads, 0, stream>>>(a);
  check_cuda(cudaGetLastError(), "attention scores: launch");
}

}  // namespace kvcc
