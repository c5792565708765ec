// Append kernel: rotate + round to BF16, quantise the tokens that enter history (new, or from the
// old ring) into their pages, write sink and ring; one launch per layer.
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

// The k-th smallest (1 <= k <= 128) of a warp's 128 values, 4 per lane: a bitonic sort of element
// e = 4·lane + r (in-lane exchanges for strides 1 and 2, shuffles above), then element k - 1
// broadcast. 15 rounds of 4 shuffles; counting ranks (each value against all 128) took 128
// shuffles and 1024 compares, most of a long append's time.
__device__ float warp_kth_smallest(float a[4], int k) {
  const int lane = threadIdx.x & 31;
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

// One warp: clip + quantise + pack one row (codec_scalar.h semantics); lane
// l holds channels 4l .. 4l + 3, i.e. code byte l.
static_assert(kD == 4 * 32 && kGpuCodeRowBytes == 32, "one warp per row: 4 channels, one code byte per lane");
// src: the row (global or shared memory); (page, row): where it goes.
__device__ void quantize_row(const __nv_bfloat16* src, int page, int row_in_page, int side, int h,
                             const KvGeometry& geo, int layer, uint8_t* pages, const HeadCodec* codecs) {
  const int lane = threadIdx.x & 31;
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
    float a[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) a[e] = fabsf(x[e]);
    const float thr = warp_kth_smallest(a, clip_rank(double(codec.clip_ratio), kD));
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
  uint8_t* blk = pages + geo.page_block_offset(page, layer, h);
  uint8_t* row =
      blk + (side ? geo.v_codes_offset() : geo.k_codes_offset()) + size_t(row_in_page) * geo.code_row_bytes();
  row[lane] = uint8_t(codes[0] | (codes[1] << 2) | (codes[2] << 4) | (codes[3] << 6));
  if (lane == 0) {
    uint16_t* params = reinterpret_cast<uint16_t*>(blk + (side ? geo.v_params_offset() : geo.k_params_offset()));
    params[2 * row_in_page] = prm.scale;
    params[2 * row_in_page + 1] = prm.zero;
  }
}

// The ring row of window slot seq_slot that holds ring slot `slot`.
__device__ const __nv_bfloat16* ring_row(const KvGeometry& geo, const __nv_bfloat16* windows, int seq_slot, int layer,
                                         int h, int side, int slot) {
  return windows + geo.window_block_elem(seq_slot, layer, h) + (side ? geo.v_ring_elem() : geo.k_ring_elem()) +
         size_t(slot) * kD;
}

// One layer's append in one launch. A block owns one (KV head, side) and strides over tiles of
// kAppTile items (the moves, then the window writes). Thread j keeps column j of R in registers,
// loaded once before the wait on the preceding kernel (R does not depend on it), and computes
// column j of the rotated row of every item in a tile that takes a new row (x = k for side 0, v
// for side 1): bf16(x[row, head, :] · R[head]), each sum over i in order. Then warp w stores items
// w, w + 4, ..: a move quantises its row (new, or from the old ring) into its page row; a window
// write first moves the ring slot it replaces, if a move is paired with it (plan_append_moves:
// the move has from_ring == 2, the write its index), then writes the row into sink or ring.
// (Rotating into a staging buffer in one launch and storing in a second cost a kernel boundary:
// the decode step per layer at batch 1 / 32K took 23.6 us against 20.2, measured.)
// counts (device, may be null; DeviceAppendPlan::counts): counts[0] moves at byte counts[2] and
// counts[1] writes at byte counts[3] of the header, else n_moves and n_writes.
constexpr int kAppTile = 4, kAppThreads = kD, kAppChunk = 4;
template <typename In>
__global__ void __launch_bounds__(kAppThreads, 3)
    append_rows(const In* k, const In* v, const float* rot_k, const float* rot_v, const Move* moves, int n_moves,
                const WindowWrite* writes, int n_writes, const int32_t* counts, KvGeometry geo, int layer,
                __nv_bfloat16* windows, uint8_t* pages, const HeadCodec* codecs) {
  __shared__ __align__(16) float xs[kAppTile][kD];
  __shared__ __align__(16) __nv_bfloat16 ys[kAppTile][kD];
  __shared__ int tile_row[kAppTile];   // rotated row r: its input row
  __shared__ int item_slot[kAppTile];  // item u of the tile: its rotated row, or -1
  __shared__ int n_rot;
  const int side = blockIdx.z, h = blockIdx.y, j = threadIdx.x, lane = j & 31, w = j >> 5;
  // The step's tables come from its upload, done before any kernel after it: read before the wait.
  if (counts) {
    n_moves = counts[0];
    n_writes = counts[1];
    moves = reinterpret_cast<const Move*>(reinterpret_cast<const uint8_t*>(counts) + counts[2]);
    writes = reinterpret_cast<const WindowWrite*>(reinterpret_cast<const uint8_t*>(counts) + counts[3]);
  }
  const int n_items = n_moves + n_writes;
  if (int(blockIdx.x) * kAppTile >= n_items) return;
  const int n_kv = geo.n_kv_heads;
  const In* x = side ? v : k;
  const float* R = side ? rot_v : rot_k;
  float rc[kD];
  if (R) {
    const float* col = R + size_t(h) * kD * kD + j;
#pragma unroll
    for (int i = 0; i < kD; ++i) rc[i] = col[size_t(i) * kD];
  }
  pdl_wait();  // k and v may come from the preceding kernel
  pdl_launch_dependents();
  // The input row of item u, or -1 (a move from the old ring).
  auto new_row = [&](int item) {
    if (item < n_moves) {
      const Move& mv = moves[item];
      return mv.from_ring ? -1 : mv.src;
    }
    return writes[item - n_moves].src;
  };
  for (int i0 = blockIdx.x * kAppTile; i0 < n_items; i0 += gridDim.x * kAppTile) {
    const int nt = min(kAppTile, n_items - i0);
    __syncthreads();  // the previous tile's shared rows are consumed
    if (w == 0) {
      const int row = lane < nt ? new_row(i0 + lane) : -1;
      const unsigned takes = __ballot_sync(0xffffffffu, row >= 0);
      const int r = __popc(takes & ((1u << lane) - 1));
      if (lane < kAppTile) item_slot[lane] = row >= 0 ? r : -1;
      if (row >= 0) tile_row[r] = row;
      if (lane == 0) n_rot = __popc(takes);
    }
    __syncthreads();
    const int nr = n_rot;
    for (int r = 0; r < nr; ++r) xs[r][j] = load_activation(x + (size_t(tile_row[r]) * n_kv + h) * kD + j);
    __syncthreads();
    for (int r0 = 0; r0 < nr; r0 += kAppChunk) {
      float acc[kAppChunk] = {0.0f, 0.0f, 0.0f, 0.0f};
      if (R) {
#pragma unroll
        for (int i = 0; i < kD; i += 4)
#pragma unroll
          for (int c = 0; c < kAppChunk; ++c) {
            const float4 xv = *reinterpret_cast<const float4*>(&xs[r0 + c][i]);  // one address per block
            acc[c] = fmaf(xv.w, rc[i + 3], fmaf(xv.z, rc[i + 2], fmaf(xv.y, rc[i + 1], fmaf(xv.x, rc[i], acc[c]))));
          }
      } else {
#pragma unroll
        for (int c = 0; c < kAppChunk; ++c) acc[c] = xs[r0 + c][j];
      }
#pragma unroll
      for (int c = 0; c < kAppChunk; ++c)
        if (r0 + c < nr) ys[r0 + c][j] = __float2bfloat16_rn(acc[c]);
    }
    __syncthreads();
    for (int u = w; u < nt; u += kAppThreads / 32) {
      const int item = i0 + u;
      if (item < n_moves) {
        const Move mv = moves[item];
        if (mv.from_ring == 0) quantize_row(ys[item_slot[u]], mv.page, mv.row, side, h, geo, layer, pages, codecs);
        else if (mv.from_ring == 1)
          quantize_row(ring_row(geo, windows, mv.seq_slot, layer, h, side, mv.src), mv.page, mv.row, side, h, geo,
                       layer, pages, codecs);
        continue;  // from_ring 2: its window write moves it
      }
      const WindowWrite wr = writes[item - n_moves];
      if (wr.move >= 0) {
        const Move mv = moves[wr.move];
        quantize_row(ring_row(geo, windows, mv.seq_slot, layer, h, side, mv.src), mv.page, mv.row, side, h, geo, layer,
                     pages, codecs);
        __syncwarp();  // every lane has read the slot's old row
      }
      __nv_bfloat16* win = windows + geo.window_block_elem(wr.seq_slot, layer, h);
      const size_t dst =
          wr.to_ring ? (side ? geo.v_ring_elem() : geo.k_ring_elem()) : (side ? geo.v_sink_elem() : geo.k_sink_elem());
      reinterpret_cast<uint2*>(win + dst + size_t(wr.dst) * kD)[lane] =
          reinterpret_cast<const uint2*>(ys[item_slot[u]])[lane];
    }
  }
}

// Blocks of append_rows that one SM holds (its registers bound it: R's column is 128 of them).
int resident_blocks(Activations act) {
  static const int n[2] = {
      [] {
        int b = 0;
        check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, append_rows<float>, kAppThreads, 0),
                   "append (CUDA): occupancy");
        return std::max(b, 1);
      }(),
      [] {
        int b = 0;
        check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, append_rows<__nv_bfloat16>, kAppThreads, 0),
                   "append (CUDA): occupancy");
        return std::max(b, 1);
      }()};
  return n[act == Activations::BFloat16];
}

}  // namespace

size_t append_workspace_bytes(const KvGeometry& g, int64_t rows, int64_t max_moves) {
  return append_workspace(g, rows, max_moves).bytes;
}

void append_kv_planned(const KvGeometry& g, uint8_t* pages, uint16_t* windows, int layer, const DeviceAppendPlan& plan,
                       const HeadCodec* codecs, const void* k, const void* v, const float* rot_k, const float* rot_v,
                       cudaStream_t stream, Activations act) {
  const int64_t items = int64_t(plan.n_moves) + plan.n_writes;
  if (items == 0) return;
  // Blocks per (KV head, side): each loads R's 64 KB once for all the tiles it takes, so about one
  // wave of them, and with host counts at least one per 32 tiles. With device counts the grid is
  // the capacities' (every step launches the same): the blocks beyond a step's tiles only read its
  // counts and exit. Tiles of 4 items spread a decode step's few rows over more blocks: at batch
  // 64 the kernel took 7.9 us per layer against 15.7 with tiles of 16, and a 32K-token append
  // 2150 us against 1933 (measured).
  const int64_t tiles = (items + kAppTile - 1) / kAppTile;
  const int64_t wave =
      std::max<int64_t>(1, int64_t(multiprocessors()) * resident_blocks(act) / (int64_t(g.n_kv_heads) * 2));
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
  if (act == Activations::BFloat16)
    check_cuda(cudaLaunchKernelEx(&c, append_rows<__nv_bfloat16>, static_cast<const __nv_bfloat16*>(k),
                                  static_cast<const __nv_bfloat16*>(v), rot_k, rot_v, plan.moves, plan.n_moves,
                                  plan.writes, plan.n_writes, counts, g, layer, win, pages, codecs),
               "append (CUDA) launch");
  else
    check_cuda(cudaLaunchKernelEx(&c, append_rows<float>, static_cast<const float*>(k), static_cast<const float*>(v),
                                  rot_k, rot_v, plan.moves, plan.n_moves, plan.writes, plan.n_writes, counts, g, layer,
                                  win, pages, codecs),
               "append (CUDA) launch");
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
  append_kv_planned(g, pages, windows, layer, d, d_codecs, k, v, rot_k, rot_v, stream, act);
}

}  // namespace kvcc
