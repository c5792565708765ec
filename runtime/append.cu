// Append kernels: rotate + round to BF16 (staging), quantise the tokens that enter history
// (from the old ring or straight from staging) into their pages, then write sink and ring.
// Semantics: runtime/append_ref.cpp. The host plans which token goes where from the lengths
// (plan_append_moves, runtime/plan.cpp).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "formats/codec_scalar.h"
#include "formats/error.h"
#include "formats/fp16.h"
#include "formats/kv_layout.h"
#include "runtime/activations.h"
#include "runtime/cuda_util.cuh"
#include "runtime/kv_kernels.h"
#include "runtime/plan.h"
#include "runtime/served.h"

namespace kvcc {
namespace {

constexpr int kD = kGpuHeadDim;
using Move = AppendMove;
using WindowWrite = AppendWindowWrite;

// staging[side][row, head, :] = bf16(x[row, head, :] · R[head])  (x = k for side 0, v for side 1).
// stride: staging rows per side; counts (device, may be null; DeviceAppendPlan::counts): counts[2]
// rows to rotate, else stride. Blocks stride over 16-row tiles, so a grid sized by a capacity serves any count below.
template <typename In>
__global__ void rotate_rows(const In* k, const In* v, const float* rot_k, const float* rot_v, int stride,
                            const int32_t* counts, int n_kv, __nv_bfloat16* staging) {
  __shared__ float xs[16][kD];
  const int side = blockIdx.z, h = blockIdx.y, j = threadIdx.x;
  const int rows = counts ? counts[2] : stride;
  const In* x = side ? v : k;
  const float* R = side ? rot_v : rot_k;
  __nv_bfloat16* out = staging + size_t(side) * stride * n_kv * kD;
  for (int r0 = blockIdx.x * 16; r0 < rows; r0 += gridDim.x * 16) {
    const int nr = min(16, rows - r0);
    __syncthreads();  // the previous tile's xs is read
    for (int t = 0; t < nr; ++t) xs[t][j] = load_activation(x + (size_t(r0 + t) * n_kv + h) * kD + j);
    __syncthreads();
    float acc[16];
#pragma unroll
    for (int t = 0; t < 16; ++t) acc[t] = 0.0f;
    if (R) {
      const float* Rh = R + size_t(h) * kD * kD;
      // Unrolled: a few rows are bound by the latency of R's loads, so issue several at once
      // (each acc[t] still sums over i in order: the same bits).
#pragma unroll 16
      for (int i = 0; i < kD; ++i) {
        const float rij = Rh[size_t(i) * kD + j];
#pragma unroll
        for (int t = 0; t < 16; ++t) acc[t] = fmaf(xs[t][i], rij, acc[t]);
      }
    } else {
#pragma unroll
      for (int t = 0; t < 16; ++t) acc[t] = t < nr ? xs[t][j] : 0.0f;
    }
    for (int t = 0; t < nr; ++t) out[(size_t(r0 + t) * n_kv + h) * kD + j] = __float2bfloat16_rn(acc[t]);
  }
}

// One warp per (move, head, side): clip + quantise + pack one row (codec_scalar.h semantics); lane
// l holds channels 4l .. 4l + 3, i.e. code byte l.
static_assert(kD == 4 * 32 && kGpuCodeRowBytes == 32, "one warp per row: 4 channels, one code byte per lane");
// counts (device, may be null; DeviceAppendPlan::counts): counts[0] moves at byte counts[3] of
// the header, else n_moves at `moves`; warps stride over the work.
__global__ void quantize_moves(const Move* moves, int n_moves, const int32_t* counts, KvGeometry geo, int layer,
                               const __nv_bfloat16* staging, int rows, __nv_bfloat16* windows, uint8_t* pages,
                               const HeadCodec* codecs) {
  if (counts) moves = reinterpret_cast<const Move*>(reinterpret_cast<const uint8_t*>(counts) + counts[3]);
  const int lane = threadIdx.x & 31;
  const int n_kv = geo.n_kv_heads;
  const int n_warps = (counts ? counts[0] : n_moves) * n_kv * 2;
  for (int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; warp < n_warps; warp += (gridDim.x * blockDim.x) >> 5) {
    const int side = warp % 2, h = (warp / 2) % n_kv, mi = warp / (2 * n_kv);
    const Move mv = moves[mi];
    const __nv_bfloat16* src;
    if (mv.from_ring) {
      const __nv_bfloat16* win = windows + geo.window_block_elem(mv.seq_slot, layer, h);
      src = win + (side ? geo.v_ring_elem() : geo.k_ring_elem()) + size_t(mv.src) * kD;
    } else {
      src = staging + size_t(side) * rows * n_kv * kD + (size_t(mv.src) * n_kv + h) * kD;
    }
    float x[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) x[e] = __bfloat162float(src[4 * lane + e]);
    const SideCodec& codec = side ? codecs[h].value : codecs[h].key;
    GroupParams prm;
    uint8_t codes[4];
    if (codec.use_table) {
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
      prm = GroupParams{sh, 0};
#pragma unroll
      for (int e = 0; e < 4; ++e) codes[e] = table_code(x[e] / s, codec.levels, 4);
    } else {
      // Clip threshold: the k-th smallest |x| (any exact selection gives codec_scalar's value).
      const int k = clip_rank(double(codec.clip_ratio), kD);
      float a[4];
      int lt[4] = {0, 0, 0, 0}, le[4] = {0, 0, 0, 0};
#pragma unroll
      for (int e = 0; e < 4; ++e) a[e] = fabsf(x[e]);
      for (int srcl = 0; srcl < 32; ++srcl)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float vv = __shfl_sync(0xffffffffu, a[e], srcl);
#pragma unroll
          for (int m = 0; m < 4; ++m) {
            lt[m] += vv < a[m];
            le[m] += vv <= a[m];
          }
        }
      float thr = INFINITY;
#pragma unroll
      for (int m = 0; m < 4; ++m)
        if (lt[m] < k && k <= le[m]) thr = fminf(thr, a[m]);
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) thr = fminf(thr, __shfl_xor_sync(0xffffffffu, thr, off));
      float lo = INFINITY, hi = -INFINITY, c[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        c[e] = x[e] < -thr ? -thr : (x[e] > thr ? thr : x[e]);
        lo = fminf(lo, c[e]);
        hi = fmaxf(hi, c[e]);
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) {
        lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, off));
        hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, off));
      }
      prm = uniform_params(lo, hi, 2);
      const float s = float_from_f16(prm.scale), z = float_from_f16(prm.zero);
#pragma unroll
      for (int e = 0; e < 4; ++e) codes[e] = uniform_code(c[e], s, z, 2);
    }
    uint8_t* blk = pages + geo.page_block_offset(mv.page, layer, h);
    uint8_t* row = blk + (side ? geo.v_codes_offset() : geo.k_codes_offset()) + size_t(mv.row) * geo.code_row_bytes();
    row[lane] = uint8_t(codes[0] | (codes[1] << 2) | (codes[2] << 4) | (codes[3] << 6));
    if (lane == 0) {
      uint16_t* params = reinterpret_cast<uint16_t*>(blk + (side ? geo.v_params_offset() : geo.k_params_offset()));
      params[2 * mv.row] = prm.scale;
      params[2 * mv.row + 1] = prm.zero;
    }
  }
}

// One warp per (write, head, side): copy a staging row into the sink or ring.
// counts (device, may be null): counts[1] writes at byte counts[4] of the header, else n_writes.
__global__ void write_windows(const WindowWrite* writes, int n_writes, const int32_t* counts, KvGeometry geo, int layer,
                              const __nv_bfloat16* staging, int rows, __nv_bfloat16* windows) {
  if (counts) writes = reinterpret_cast<const WindowWrite*>(reinterpret_cast<const uint8_t*>(counts) + counts[4]);
  const int lane = threadIdx.x & 31;
  const int n_kv = geo.n_kv_heads;
  const int n_warps = (counts ? counts[1] : n_writes) * n_kv * 2;
  for (int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; warp < n_warps; warp += (gridDim.x * blockDim.x) >> 5) {
    const int side = warp % 2, h = (warp / 2) % n_kv, wi = warp / (2 * n_kv);
    const WindowWrite w = writes[wi];
    const __nv_bfloat16* src = staging + size_t(side) * rows * n_kv * kD + (size_t(w.src) * n_kv + h) * kD;
    __nv_bfloat16* win = windows + geo.window_block_elem(w.seq_slot, layer, h);
    const size_t dst =
        w.to_ring ? (side ? geo.v_ring_elem() : geo.k_ring_elem()) : (side ? geo.v_sink_elem() : geo.k_sink_elem());
    const uint2 val = reinterpret_cast<const uint2*>(src)[lane];
    reinterpret_cast<uint2*>(win + dst + size_t(w.dst) * kD)[lane] = val;
  }
}

// Blocks of a launch sized by a capacity (device counts): enough to fill the GPU, the rest of the
// work taken by striding; exact when the counts are the host's.
unsigned blocks_for(int64_t need, bool capacity, int64_t cap_blocks) {
  return unsigned(capacity ? std::min(need, cap_blocks) : need);
}

}  // namespace

size_t append_workspace_bytes(const KvGeometry& g, int64_t rows, int64_t max_moves) {
  return append_workspace(g, rows, max_moves).bytes;
}

void append_kv_planned(const KvGeometry& g, uint8_t* pages, uint16_t* windows, int layer, const DeviceAppendPlan& plan,
                       const HeadCodec* codecs, const void* k, const void* v, const float* rot_k, const float* rot_v,
                       void* staging, size_t staging_bytes, cudaStream_t stream, Activations act) {
  if (plan.rows == 0) return;
  KVCC_REQUIRE(staging_bytes >= append_staging_bytes(g, plan.rows), "append (CUDA): staging too small");
  auto* stage = static_cast<__nv_bfloat16*>(staging);
  auto* win = reinterpret_cast<__nv_bfloat16*>(windows);
  const bool cap = plan.counts != nullptr;
  // With device counts the grids are the capacities' (every step launches the same), capped (the
  // blocks beyond a step's work only read its counts and exit): 8 row tiles per (head, side), 4
  // blocks of 4 warps per SM for the moves and writes.
  const int64_t move_blocks = int64_t(multiprocessors()) * 4;
  const dim3 rot_grid(blocks_for((plan.rows + 15) / 16, cap, 8), g.n_kv_heads, 2);
  if (act == Activations::BFloat16)
    rotate_rows<<<rot_grid, kD, 0, stream>>>(static_cast<const __nv_bfloat16*>(k), static_cast<const __nv_bfloat16*>(v),
                                             rot_k, rot_v, int(plan.rows), plan.counts, g.n_kv_heads, stage);
  else
    rotate_rows<<<rot_grid, kD, 0, stream>>>(static_cast<const float*>(k), static_cast<const float*>(v), rot_k, rot_v,
                                             int(plan.rows), plan.counts, g.n_kv_heads, stage);
  const int64_t move_warps = int64_t(plan.n_moves) * g.n_kv_heads * 2;
  if (move_warps > 0)
    quantize_moves<<<blocks_for((move_warps + 3) / 4, cap, move_blocks), 128, 0, stream>>>(
        plan.moves, plan.n_moves, plan.counts, g, layer, stage, int(plan.rows), win, pages, codecs);
  const int64_t write_warps = int64_t(plan.n_writes) * g.n_kv_heads * 2;
  if (write_warps > 0)
    write_windows<<<blocks_for((write_warps + 3) / 4, cap, move_blocks), 128, 0, stream>>>(
        plan.writes, plan.n_writes, plan.counts, g, layer, stage, int(plan.rows), win);
  check_cuda(cudaGetLastError(), "append (CUDA) launch");
}

void append_kv(const KvGeometry& g, uint8_t* pages, uint16_t* windows, int layer, const AppendPlanHost& plan,
               const HeadCodec* codecs, const void* k, const void* v, const float* rot_k, const float* rot_v,
               void* workspace, size_t workspace_bytes, cudaStream_t stream, Activations act) {
  require_hopper();
  require_gpu_served(g, kAnyQueryHeads, kGpuAppend, false, "append (CUDA)");
  KVCC_REQUIRE(layer >= 0 && layer < g.n_layers, "append (CUDA): layer out of range");
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
  d.rows = m.rows;
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
  append_kv_planned(g, pages, windows, layer, d, d_codecs, k, v, rot_k, rot_v, ws + lay.staging,
                    lay.moves - lay.staging, stream, act);
}

}  // namespace kvcc
