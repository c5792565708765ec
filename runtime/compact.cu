// Device compaction: runtime/compact.h. Semantics: runtime/compact_ref.cpp.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "formats/codec_scalar.h"
#include "formats/error.h"
#include "formats/fp16.h"
#include "runtime/compact.h"
#include "runtime/cuda_util.cuh"
#include "runtime/kv_kernels.h"
#include "runtime/plan.h"
#include "runtime/served.h"

namespace kvcc {
namespace {

// Staged sources of one layer, per (move, head, side) s = (m * n_kv + h) * 2 + side: a BF16 row
// (window sources) or a code row and its (scale, zero) pairs (page sources); and the float rows
// [n_quant, n_kv, d] per side that append's quantiser takes for the BF16 -> INT2 moves.
struct Stage {
  uint16_t* bf;
  uint8_t* codes;
  uint16_t* params;
  float* qk;
  float* qv;
};

__device__ uint16_t* window_row(const KvGeometry& g, uint16_t* windows, int seq, int layer, int h, int side,
                                int32_t r) {
  uint16_t* win = windows + g.window_block_elem(seq, layer, h);
  return r < g.sink ? win + (side ? g.v_sink_elem() : g.k_sink_elem()) + size_t(r) * g.head_dim
                    : win + (side ? g.v_ring_elem() : g.k_ring_elem()) + size_t(r - g.sink) * g.head_dim;
}
__device__ uint8_t* code_row(const KvGeometry& g, uint8_t* pages, int32_t page, int layer, int h, int side, int32_t r) {
  return pages + g.page_block_offset(page, layer, h) + (side ? g.v_codes_offset() : g.k_codes_offset()) +
         size_t(r) * g.code_row_bytes();
}
__device__ uint16_t* param_row(const KvGeometry& g, uint8_t* pages, int32_t page, int layer, int h, int side,
                               int32_t r) {
  return reinterpret_cast<uint16_t*>(pages + g.page_block_offset(page, layer, h) +
                                     (side ? g.v_params_offset() : g.k_params_offset())) +
         size_t(r) * 2 * g.groups();
}

// One warp per (move, head, side): read the source row into the stage (and, for a BF16 row that
// enters history, as float into the quantiser's input at row quant[m]).
__global__ void gather_rows(const CompactRowMove* moves, const int32_t* quant, int n_moves, KvGeometry g, int seq,
                            int layer, const uint8_t* pages, const uint16_t* windows, Stage st) {
  const int lane = threadIdx.x & 31, n_kv = g.n_kv_heads, d = g.head_dim;
  const int cb = int(g.code_row_bytes()), G2 = 2 * g.groups();
  const int n_warps = n_moves * n_kv * 2;
  for (int w = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; w < n_warps; w += (gridDim.x * blockDim.x) >> 5) {
    const int side = w % 2, h = (w / 2) % n_kv, m = w / (2 * n_kv);
    const CompactRowMove mv = moves[m];
    if (mv.src_page == kCompactWindow) {
      const uint16_t* src = window_row(g, const_cast<uint16_t*>(windows), seq, layer, h, side, mv.src_row);
      for (int c = lane; c < d; c += 32) st.bf[size_t(w) * d + c] = src[c];
      if (quant[m] >= 0) {
        float* q = (side ? st.qv : st.qk) + (size_t(quant[m]) * n_kv + h) * d;
        for (int c = lane; c < d; c += 32) q[c] = float_from_bf16(src[c]);
      }
    } else {
      uint8_t* pg = const_cast<uint8_t*>(pages);
      const uint8_t* cs = code_row(g, pg, mv.src_page, layer, h, side, mv.src_row);
      const uint16_t* ps = param_row(g, pg, mv.src_page, layer, h, side, mv.src_row);
      for (int c = lane; c < cb; c += 32) st.codes[size_t(w) * cb + c] = cs[c];
      for (int c = lane; c < G2; c += 32) st.params[size_t(w) * G2 + c] = ps[c];
    }
  }
}

// One warp per (move, head, side) of the moves that are not quantised: BF16 -> BF16 copies,
// INT2 -> INT2 copies, INT2 -> BF16 dequantisation (codec_scalar.h's, rounded to BF16).
__global__ void scatter_rows(const CompactRowMove* moves, const int32_t* quant, int n_moves, KvGeometry g, int seq,
                             int layer, uint8_t* pages, uint16_t* windows, const HeadCodec* codecs, Stage st) {
  const int lane = threadIdx.x & 31, n_kv = g.n_kv_heads, d = g.head_dim;
  const int cb = int(g.code_row_bytes()), G2 = 2 * g.groups();
  const int n_warps = n_moves * n_kv * 2;
  for (int w = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; w < n_warps; w += (gridDim.x * blockDim.x) >> 5) {
    const int side = w % 2, h = (w / 2) % n_kv, m = w / (2 * n_kv);
    if (quant[m] >= 0) continue;  // append's quantiser writes it
    const CompactRowMove mv = moves[m];
    if (mv.dst_page == kCompactWindow) {
      uint16_t* dst = window_row(g, windows, seq, layer, h, side, mv.dst_row);
      if (mv.src_page == kCompactWindow) {
        for (int c = lane; c < d; c += 32) dst[c] = st.bf[size_t(w) * d + c];
      } else {
        const SideCodec& sc = side ? codecs[size_t(layer) * n_kv + h].value : codecs[size_t(layer) * n_kv + h].key;
        const uint8_t* cs = st.codes + size_t(w) * cb;
        const uint16_t* ps = st.params + size_t(w) * G2;
        for (int c = lane; c < d; c += 32) {
          const int grp = c / g.group;
          const float s = float_from_f16(ps[2 * grp]);
          const uint8_t code = unpack_code(cs, c);
          const float x = sc.use_table ? table_dequant(code, s, sc.levels)
                                       : uniform_dequant(code, s, float_from_f16(ps[2 * grp + 1]));
          dst[c] = bf16_from_float(x);
        }
      }
    } else {
      uint8_t* cd = code_row(g, pages, mv.dst_page, layer, h, side, mv.dst_row);
      uint16_t* pd = param_row(g, pages, mv.dst_page, layer, h, side, mv.dst_row);
      for (int c = lane; c < cb; c += 32) cd[c] = st.codes[size_t(w) * cb + c];
      for (int c = lane; c < G2; c += 32) pd[c] = st.params[size_t(w) * G2 + c];
    }
  }
}

template <class T>
T* carve(uint8_t*& at, size_t n) {
  T* p = reinterpret_cast<T*>(at);
  at += (n * sizeof(T) + 255) / 256 * 256;
  return p;
}

}  // namespace

void compact_rows_device(KvCache& cache, const CompactionPlan& plan, const HeadCodec* codecs, void* stream) {
  KVCC_REQUIRE(cache.memory() == PoolMemory::Device, "compact (CUDA): needs a device pool");
  const KvGeometry& g = cache.geometry();
  require_gpu_served(g, kAnyQueryHeads, kGpuAppend, false, "compact (CUDA)");
  const int n = int(plan.moves.size());
  if (n == 0) return;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  // Which moves are BF16 -> INT2 (append's quantiser), as rows of its input and its moves.
  std::vector<int32_t> quant(size_t(n), -1);
  std::vector<AppendMove> qmoves;
  for (int m = 0; m < n; ++m) {
    const CompactRowMove& mv = plan.moves[size_t(m)];
    if (mv.src_page == kCompactWindow && mv.dst_page != kCompactWindow) {
      quant[size_t(m)] = int32_t(qmoves.size());
      qmoves.push_back(AppendMove{plan.seq, 0, int32_t(qmoves.size()), mv.dst_page, mv.dst_row});
    }
  }
  const size_t nq = qmoves.size(), n_kv = size_t(g.n_kv_heads), d = size_t(g.head_dim);
  const size_t rows = size_t(n) * n_kv * 2;
  const size_t bytes = 256 * 8 + n * sizeof(CompactRowMove) + n * 4 + nq * sizeof(AppendMove) + rows * d * 2 +
                       rows * g.code_row_bytes() + rows * 2 * size_t(g.groups()) * 2 + 2 * nq * n_kv * d * 4;
  void* base = nullptr;
  check_cuda(cudaMallocAsync(&base, bytes, s), "compact (CUDA): workspace");
  uint8_t* at = static_cast<uint8_t*>(base);
  auto* dmoves = carve<CompactRowMove>(at, size_t(n));
  auto* dquant = carve<int32_t>(at, size_t(n));
  auto* dq = carve<AppendMove>(at, nq);
  Stage st{carve<uint16_t>(at, rows * d), carve<uint8_t>(at, rows * g.code_row_bytes()),
           carve<uint16_t>(at, rows * 2 * size_t(g.groups())), carve<float>(at, nq * n_kv * d),
           carve<float>(at, nq * n_kv * d)};
  check_cuda(cudaMemcpyAsync(dmoves, plan.moves.data(), size_t(n) * sizeof(CompactRowMove), cudaMemcpyHostToDevice, s),
             "compact (CUDA): upload");
  check_cuda(cudaMemcpyAsync(dquant, quant.data(), size_t(n) * 4, cudaMemcpyHostToDevice, s), "compact (CUDA): upload");
  if (nq)
    check_cuda(cudaMemcpyAsync(dq, qmoves.data(), nq * sizeof(AppendMove), cudaMemcpyHostToDevice, s),
               "compact (CUDA): upload");
  // The uploads read pageable host memory: cudaMemcpyAsync stages it before returning.
  const int blocks = int(std::min<size_t>((rows + 3) / 4, size_t(multiprocessors()) * 8));
  for (int l = 0; l < g.n_layers; ++l) {
    gather_rows<<<blocks, 128, 0, s>>>(dmoves, dquant, n, g, plan.seq, l, cache.pages_base(), cache.windows_base(), st);
    scatter_rows<<<blocks, 128, 0, s>>>(dmoves, dquant, n, g, plan.seq, l, cache.pages_base(), cache.windows_base(),
                                        codecs, st);
    if (nq) {
      DeviceAppendPlan ap;
      ap.moves = dq;
      ap.n_moves = int(nq);
      append_kv_planned(g, cache.pages_base(), cache.windows_base(), l, ap, codecs + size_t(l) * n_kv, st.qk, st.qv,
                        nullptr, nullptr, s);
    }
  }
  check_cuda(cudaGetLastError(), "compact (CUDA) launch");
  check_cuda(cudaFreeAsync(base, s), "compact (CUDA): free");
}

int64_t compact_device(KvCache& cache, int seq, const std::vector<int64_t>& kept, const HeadCodec* codecs,
                       void* stream) {
  KVCC_REQUIRE(codecs != nullptr, "compact (CUDA): no codecs");
  const CompactionPlan plan = cache.plan_compaction(seq, kept);
  compact_rows_device(cache, plan, codecs, stream);
  cache.commit_compaction(plan);
  return plan.pages_released;
}

}  // namespace kvcc
