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
#include "runtime/ptx.cuh"
#include "runtime/served.h"

namespace kvcc {
namespace {

constexpr int kD = kGpuHeadDim;
using Move = AppendMove;
using WindowWrite = AppendWindowWrite;

// staging[side][row, head, :] = bf16(x[row, head, :] · R[head])  (x = k for side 0, v for side 1).
// stride: staging rows per side; counts (device, may be null; DeviceAppendPlan::counts): counts[2]
// rows to rotate, else stride. A block owns kRotCols columns of one (head, side): it stages that
// slice of R in shared memory once (one round of wide loads: a decode step's few rows were bound by
// the latency of R's column loads, 16 us per layer at batch 1, measured), then strides over
// 16-row tiles, so a grid sized by a capacity serves any count below. Warp w computes rows
// w, w + 4, w + 8, w + 12 of a tile, lane l column l of the slice; each output sums over i in order.
constexpr int kRotCols = 32, kRotThreads = 128, kRotTile = 16;
constexpr int kRotLoads = kD * kRotCols / 4 / kRotThreads;  // float4 loads of R per thread
template <typename In>
__global__ void __launch_bounds__(kRotThreads)
    rotate_rows(const In* k, const In* v, const float* rot_k, const float* rot_v, int stride, const int32_t* counts,
                int n_kv, __nv_bfloat16* staging) {
  __shared__ __align__(16) float xs[kRotTile][kD];
  __shared__ __align__(16) float rs[kD][kRotCols];
  const int side = blockIdx.z & 1, c0 = (blockIdx.z >> 1) * kRotCols, h = blockIdx.y;
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const int rows = counts ? counts[2] : stride;  // the step's upload: done before any kernel after it
  if (int(blockIdx.x) * kRotTile >= rows) return;
  const In* x = side ? v : k;
  const float* R = side ? rot_v : rot_k;
  __nv_bfloat16* out = staging + size_t(side) * stride * n_kv * kD;
  // R does not depend on the preceding kernel: its loads overlap that kernel's end.
  float4 t[kRotLoads];
  if (R) {
    const float4* Rh = reinterpret_cast<const float4*>(R + size_t(h) * kD * kD + c0);
#pragma unroll
    for (int e = 0; e < kRotLoads; ++e) {
      const int f = threadIdx.x + e * kRotThreads;  // float4 f of the slice: row f / 8, columns 4 (f % 8) ..
      t[e] = Rh[size_t(f / (kRotCols / 4)) * (kD / 4) + f % (kRotCols / 4)];
    }
  }
  pdl_wait();  // k and v may come from the preceding kernel; staging is free once it is done
  pdl_launch_dependents();
  static_assert(kRotThreads == kD, "thread j loads channel j of a tile's rows");
  for (int r0 = blockIdx.x * kRotTile; r0 < rows; r0 += gridDim.x * kRotTile) {
    const int nr = min(kRotTile, rows - r0);
    // The tile's loads are issued before R's are awaited (the slice is stored on the first tile).
    float xr[kRotTile];
#pragma unroll
    for (int u = 0; u < kRotTile; ++u)
      xr[u] = u < nr ? load_activation(x + (size_t(r0 + u) * n_kv + h) * kD + threadIdx.x) : 0.0f;
    __syncthreads();  // the previous tile's xs is read
    if (R && r0 == int(blockIdx.x) * kRotTile)
#pragma unroll
      for (int e = 0; e < kRotLoads; ++e) reinterpret_cast<float4*>(&rs[0][0])[threadIdx.x + e * kRotThreads] = t[e];
#pragma unroll
    for (int u = 0; u < kRotTile; ++u) xs[u][threadIdx.x] = xr[u];
    __syncthreads();
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (R) {
#pragma unroll 4
      for (int i = 0; i < kD; i += 4) {
        const float r0i = rs[i][lane], r1i = rs[i + 1][lane], r2i = rs[i + 2][lane], r3i = rs[i + 3][lane];
#pragma unroll
        for (int t = 0; t < 4; ++t) {
          const float4 xv = *reinterpret_cast<const float4*>(&xs[w + 4 * t][i]);  // one address per warp
          acc[t] = fmaf(xv.w, r3i, fmaf(xv.z, r2i, fmaf(xv.y, r1i, fmaf(xv.x, r0i, acc[t]))));
        }
      }
    } else {
#pragma unroll
      for (int t = 0; t < 4; ++t) acc[t] = w + 4 * t < nr ? xs[w + 4 * t][c0 + lane] : 0.0f;
    }
#pragma unroll
    for (int t = 0; t < 4; ++t)
      if (w + 4 * t < nr) out[(size_t(r0 + w + 4 * t) * n_kv + h) * kD + c0 + lane] = __float2bfloat16_rn(acc[t]);
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
  pdl_wait();  // staging comes from rotate_rows
  pdl_launch_dependents();
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
  pdl_wait();  // the moves read ring rows these writes may replace
  pdl_launch_dependents();
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
  // blocks beyond a step's work only read its counts and exit): 4 blocks of 4 warps per SM for the
  // moves and writes. The rotation's blocks each stage their slice of R once for all the tiles they
  // take: about 8 blocks per SM with device counts (one wave; most exit at a decode step), and at
  // least one block per 8 tiles otherwise (a 32K-token append with one wave: 3.9 vs 3.4 ms, measured).
  const int64_t move_blocks = int64_t(multiprocessors()) * 4;
  const int64_t rot_slices = int64_t(g.n_kv_heads) * 2 * (kD / kRotCols);
  const int64_t rot_tiles = (plan.rows + kRotTile - 1) / kRotTile;
  const int64_t rot_wave = std::max<int64_t>(1, multiprocessors() * 8 / rot_slices);
  const dim3 rot_grid(unsigned(std::min(rot_tiles, cap ? rot_wave : std::max(rot_wave, (rot_tiles + 7) / 8))),
                      g.n_kv_heads, 2 * (kD / kRotCols));
  // Programmatic dependent launch: each kernel is launched while its predecessor runs and waits
  // (griddepcontrol.wait) for its results, hiding launch latency; each lets its own dependents
  // launch only after that wait, so a kernel that starts finds all but its predecessor done.
  cudaLaunchAttribute pdl;
  pdl.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  pdl.val.programmaticStreamSerializationAllowed = 1;
  auto config = [&](dim3 grid, unsigned threads) {
    cudaLaunchConfig_t c{};
    c.gridDim = grid;
    c.blockDim = dim3(threads);
    c.stream = stream;
    c.attrs = &pdl;
    c.numAttrs = 1;
    return c;
  };
  const int rows = int(plan.rows);
  const cudaLaunchConfig_t rc = config(rot_grid, kRotThreads);
  if (act == Activations::BFloat16)
    check_cuda(
        cudaLaunchKernelEx(&rc, rotate_rows<__nv_bfloat16>, static_cast<const __nv_bfloat16*>(k),
                           static_cast<const __nv_bfloat16*>(v), rot_k, rot_v, rows, plan.counts, g.n_kv_heads, stage),
        "append (CUDA) launch");
  else
    check_cuda(cudaLaunchKernelEx(&rc, rotate_rows<float>, static_cast<const float*>(k), static_cast<const float*>(v),
                                  rot_k, rot_v, rows, plan.counts, g.n_kv_heads, stage),
               "append (CUDA) launch");
  const int64_t move_warps = int64_t(plan.n_moves) * g.n_kv_heads * 2;
  if (move_warps > 0) {
    const cudaLaunchConfig_t c = config(dim3(blocks_for((move_warps + 3) / 4, cap, move_blocks)), 128);
    check_cuda(cudaLaunchKernelEx(&c, quantize_moves, static_cast<const Move*>(plan.moves), plan.n_moves,
                                  static_cast<const int32_t*>(plan.counts), g, layer,
                                  static_cast<const __nv_bfloat16*>(stage), rows, win, pages, codecs),
               "append (CUDA) launch");
  }
  const int64_t write_warps = int64_t(plan.n_writes) * g.n_kv_heads * 2;
  if (write_warps > 0) {
    const cudaLaunchConfig_t c = config(dim3(blocks_for((write_warps + 3) / 4, cap, move_blocks)), 128);
    check_cuda(cudaLaunchKernelEx(&c, write_windows, static_cast<const WindowWrite*>(plan.writes), plan.n_writes,
                                  static_cast<const int32_t*>(plan.counts), g, layer,
                                  static_cast<const __nv_bfloat16*>(stage), rows, win),
               "append (CUDA) launch");
  }
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
