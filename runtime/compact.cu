// Device compaction: runtime/compact.h. Semantics: runtime/compact_ref.cpp.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "formats/codec_scalar.h"
#include "formats/error.h"
#include "formats/fp16.h"
#include "runtime/compact.h"
#include "runtime/compact_ref.h"
#include "runtime/cuda_util.cuh"
#include "runtime/kv_kernels.h"
#include "runtime/plan.h"
#include "runtime/served.h"

namespace kvcc {
namespace {

// The plan's moves on the device: each move's slot among the moves of its source kind (page
// rows or window rows) and, for a BF16 row entering history, its row of the quantiser's input.
struct MoveTables {
  const CompactRowMove* moves;
  const int32_t* slot;
  const int32_t* quant;  // -1: not quantised
  int n_moves, n_page, n_window, n_quant;
};

// Staged sources of a chunk of layers [l0, l0 + lc), so that any destination may be another move's
// source: item (layer - l0, slot, head, side) of each kind at ((lr·n_kind + slot)·n_kv + h)·2 + side.
struct Stage {
  uint8_t* codes;    // page sources: code rows, [lc][n_page][n_kv][2][cb]
  uint16_t* params;  // and their (scale, zero) pairs, [lc][n_page][n_kv][2][2 · groups]
  uint16_t* bf;      // window sources: BF16 rows, [lc][n_window][n_kv][2][d]
  float* qk;         // the quantiser's float input per layer, [lc][n_quant][n_kv][d]
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

// A team of kTeam lanes per (move, layer) pair, walking the pair's 2·n_kv (head, side) items: the
// move is read and decoded once, each lane holds a contiguous slice of every row (head_dim 128, the
// scope: a BF16 row is 256 bytes, two uint4 per lane; a code row 32 bytes, one word per lane, i.e.
// 16 codes; a row's (scale, zero) pairs `groups` <= kTeam words), and a lane loads kBatch items'
// words before storing them, so loads are in flight together. One launch covers every layer of a
// chunk. Item j of a pair is head j / 2, side j % 2, staged at (pair's first item) + j.
constexpr int kTeam = 8;
constexpr int kDim = 128;
constexpr int kLaneDims = kDim / kTeam;  // channels per lane
constexpr int kBatch = 8;

__device__ void copy_bf16_slice(const uint16_t* src, uint16_t* dst, int lane) {
  const uint4* s4 = reinterpret_cast<const uint4*>(src) + 2 * lane;
  uint4* d4 = reinterpret_cast<uint4*>(dst) + 2 * lane;
  const uint4 x = s4[0], y = s4[1];
  d4[0] = x;
  d4[1] = y;
}

// Code rows (and their pairs) of a pair's items from wherever `src` says to wherever `dst` says,
// kBatch items at a time.
template <class Src, class Dst>
__device__ void copy_code_items(int n_items, int groups, int lane, Src src, Dst dst) {
  for (int j0 = 0; j0 < n_items; j0 += kBatch) {
    uint32_t c[kBatch], pr[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b)
      if (j0 + b < n_items) {
        const uint8_t* cs;
        const uint16_t* ps;
        src(j0 + b, cs, ps);
        c[b] = reinterpret_cast<const uint32_t*>(cs)[lane];
        if (lane < groups) pr[b] = reinterpret_cast<const uint32_t*>(ps)[lane];
      }
#pragma unroll
    for (int b = 0; b < kBatch; ++b)
      if (j0 + b < n_items) {
        uint8_t* cd;
        uint16_t* pd;
        dst(j0 + b, cd, pd);
        reinterpret_cast<uint32_t*>(cd)[lane] = c[b];
        if (lane < groups) reinterpret_cast<uint32_t*>(pd)[lane] = pr[b];
      }
  }
}

__global__ void gather_rows(MoveTables t, KvGeometry g, int seq, int l0, int lc, const uint8_t* pages,
                            const uint16_t* windows, Stage st) {
  const int n_items = 2 * g.n_kv_heads, cb = int(g.code_row_bytes()), G2 = 2 * g.groups();
  const int lane = int(threadIdx.x % kTeam);
  const unsigned pairs = unsigned(lc) * unsigned(t.n_moves), stride = gridDim.x * blockDim.x / kTeam;
  uint8_t* pg = const_cast<uint8_t*>(pages);
  uint16_t* win = const_cast<uint16_t*>(windows);
  for (unsigned p = (blockIdx.x * blockDim.x + threadIdx.x) / kTeam; p < pairs; p += stride) {
    const int m = int(p % unsigned(t.n_moves)), lr = int(p / unsigned(t.n_moves)), layer = l0 + lr;
    const CompactRowMove mv = t.moves[m];
    const size_t slot = size_t(t.slot[m]);
    if (mv.src_page == kCompactWindow) {
      const size_t at0 = (size_t(lr) * t.n_window + slot) * n_items;
      const int qi = t.quant[m];
      for (int j = 0; j < n_items; ++j) {
        const uint16_t* src = window_row(g, win, seq, layer, j >> 1, j & 1, mv.src_row);
        copy_bf16_slice(src, st.bf + (at0 + j) * kDim, lane);
        if (qi >= 0) {
          float* q = ((j & 1) ? st.qv : st.qk) + ((size_t(lr) * t.n_quant + qi) * g.n_kv_heads + (j >> 1)) * kDim;
#pragma unroll
          for (int c = 0; c < kLaneDims; ++c) q[lane * kLaneDims + c] = float_from_bf16(src[lane * kLaneDims + c]);
        }
      }
    } else {
      const size_t at0 = (size_t(lr) * t.n_page + slot) * n_items;
      copy_code_items(
          n_items, g.groups(), lane,
          [&](int j, const uint8_t*& cs, const uint16_t*& ps) {
            cs = code_row(g, pg, mv.src_page, layer, j >> 1, j & 1, mv.src_row);
            ps = param_row(g, pg, mv.src_page, layer, j >> 1, j & 1, mv.src_row);
          },
          [&](int j, uint8_t*& cd, uint16_t*& pd) {
            cd = st.codes + (at0 + j) * cb;
            pd = st.params + (at0 + j) * G2;
          });
    }
  }
}

// The pairs that are not quantised: BF16 -> BF16 copies, INT2 -> INT2 copies, INT2 -> BF16
// dequantisation (codec_scalar.h's, rounded to BF16).
__global__ void scatter_rows(MoveTables t, KvGeometry g, int seq, int l0, int lc, uint8_t* pages, uint16_t* windows,
                             const HeadCodec* codecs, Stage st) {
  const int n_kv = g.n_kv_heads, n_items = 2 * n_kv, cb = int(g.code_row_bytes()), G2 = 2 * g.groups();
  const int lane = int(threadIdx.x % kTeam);
  const unsigned pairs = unsigned(lc) * unsigned(t.n_moves), stride = gridDim.x * blockDim.x / kTeam;
  for (unsigned p = (blockIdx.x * blockDim.x + threadIdx.x) / kTeam; p < pairs; p += stride) {
    const int m = int(p % unsigned(t.n_moves)), lr = int(p / unsigned(t.n_moves)), layer = l0 + lr;
    if (t.quant[m] >= 0) continue;  // append's quantiser writes it
    const CompactRowMove mv = t.moves[m];
    const size_t slot = size_t(t.slot[m]);
    const size_t at0 = (size_t(lr) * (mv.src_page == kCompactWindow ? t.n_window : t.n_page) + slot) * n_items;
    if (mv.dst_page != kCompactWindow) {  // INT2 -> INT2 (a BF16 source would be quantised)
      copy_code_items(
          n_items, g.groups(), lane,
          [&](int j, const uint8_t*& cs, const uint16_t*& ps) {
            cs = st.codes + (at0 + j) * cb;
            ps = st.params + (at0 + j) * G2;
          },
          [&](int j, uint8_t*& cd, uint16_t*& pd) {
            cd = code_row(g, pages, mv.dst_page, layer, j >> 1, j & 1, mv.dst_row);
            pd = param_row(g, pages, mv.dst_page, layer, j >> 1, j & 1, mv.dst_row);
          });
      continue;
    }
    for (int j = 0; j < n_items; ++j) {
      const int h = j >> 1, side = j & 1;
      uint16_t* dst = window_row(g, windows, seq, layer, h, side, mv.dst_row);
      if (mv.src_page == kCompactWindow) {
        copy_bf16_slice(st.bf + (at0 + j) * kDim, dst, lane);
        continue;
      }
      const HeadCodec& hc = codecs[size_t(layer) * n_kv + h];
      const SideCodec& sc = side ? hc.value : hc.key;
      const uint32_t codes = reinterpret_cast<const uint32_t*>(st.codes + (at0 + j) * cb)[lane];  // 16 codes
      const uint16_t* ps = st.params + (at0 + j) * G2;
      alignas(16) uint16_t out[kLaneDims];
#pragma unroll
      for (int k = 0; k < kLaneDims; ++k) {
        const int grp = (lane * kLaneDims + k) / g.group;
        const float scale = float_from_f16(ps[2 * grp]);
        const uint8_t code = uint8_t((codes >> (2 * k)) & 3u);  // unpack_code's order: channel c at bits 2c
        const float x = sc.use_table ? table_dequant(code, scale, sc.levels)
                                     : uniform_dequant(code, scale, float_from_f16(ps[2 * grp + 1]));
        out[k] = bf16_from_float(x);
      }
      uint4* d4 = reinterpret_cast<uint4*>(dst) + 2 * lane;
      d4[0] = reinterpret_cast<const uint4*>(out)[0];
      d4[1] = reinterpret_cast<const uint4*>(out)[1];
    }
  }
}

// Where a plan's arrays sit in the workspace (each 256-byte aligned): the move tables, uploaded in
// one copy, then the staging of one chunk of layers.
struct Layout {
  int n_moves = 0, n_page = 0, n_window = 0, n_quant = 0, chunk = 1;
  size_t moves = 0, slot = 0, quant = 0, qmoves = 0, tables = 0;
  size_t codes = 0, params = 0, bf = 0, qk = 0, qv = 0, total = 0;
};
Layout layout_of(const KvGeometry& g, const CompactionPlan& plan, size_t stage_bytes) {
  Layout L;
  L.n_moves = int(plan.moves.size());
  for (const CompactRowMove& mv : plan.moves) {
    (mv.src_page == kCompactWindow ? L.n_window : L.n_page)++;
    if (mv.src_page == kCompactWindow && mv.dst_page != kCompactWindow) ++L.n_quant;
  }
  const size_t n_kv = size_t(g.n_kv_heads), d = size_t(g.head_dim), cb = g.code_row_bytes(),
               G2 = 2 * size_t(g.groups()), nq = size_t(L.n_quant);
  const size_t layer_bytes =
      size_t(L.n_page) * n_kv * 2 * (cb + G2 * 2) + size_t(L.n_window) * n_kv * 2 * d * 2 + 2 * nq * n_kv * d * 4;
  L.chunk = int(std::clamp<size_t>(stage_bytes / std::max<size_t>(layer_bytes, 1), 1, size_t(g.n_layers)));
  size_t at = 0;
  auto take = [&at](size_t bytes) {
    const size_t o = at;
    at += (bytes + 255) / 256 * 256;
    return o;
  };
  const size_t n = size_t(L.n_moves), lc = size_t(L.chunk);
  L.moves = take(n * sizeof(CompactRowMove));
  L.slot = take(n * 4);
  L.quant = take(n * 4);
  L.qmoves = take(nq * sizeof(AppendMove));
  L.tables = at;
  L.codes = take(lc * L.n_page * n_kv * 2 * cb);
  L.params = take(lc * L.n_page * n_kv * 2 * G2 * 2);
  L.bf = take(lc * L.n_window * n_kv * 2 * d * 2);
  L.qk = take(lc * nq * n_kv * d * 4);
  L.qv = take(lc * nq * n_kv * d * 4);
  L.total = at;
  return L;
}

}  // namespace

size_t compact_workspace_bytes(const KvGeometry& g, const CompactionPlan& plan, size_t stage_bytes) {
  return layout_of(g, plan, stage_bytes).total;
}

void compact_rows_device(KvCache& cache, const CompactionPlan& plan, const HeadCodec* codecs, void* workspace,
                         size_t workspace_bytes, void* stream, size_t stage_bytes) {
  KVCC_REQUIRE(cache.memory() == PoolMemory::Device, "compact (CUDA): needs a device pool");
  const KvGeometry& g = cache.geometry();
  require_gpu_served(g, kAnyQueryHeads, kGpuAppend, false, "compact (CUDA)");
  KVCC_REQUIRE(!g.per_channel_keys(), kPerChannelEvictionRefusal);
  KVCC_REQUIRE(cache.layout().two_bit(), kWidthsEvictionRefusal);
  KVCC_REQUIRE(g.head_dim == kDim && g.groups() <= kTeam,
               "compact (CUDA): head_dim " + std::to_string(g.head_dim) + " with " + std::to_string(g.groups()) +
                   " groups per row; the kernels take head_dim 128, at most 8 groups");
  if (plan.moves.empty()) return;
  const Layout L = layout_of(g, plan, stage_bytes);
  KVCC_REQUIRE(workspace != nullptr && workspace_bytes >= L.total,
               "compact (CUDA): workspace of " + std::to_string(workspace_bytes) + " bytes, the plan needs " +
                   std::to_string(L.total) + " (compact_workspace_bytes)");
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  // The tables' host image: each move's slot among its source kind's moves, and the BF16 -> INT2
  // ones as rows of append's input.
  std::vector<uint8_t> host(L.tables, 0);
  auto* slot = reinterpret_cast<int32_t*>(host.data() + L.slot);
  auto* quant = reinterpret_cast<int32_t*>(host.data() + L.quant);
  auto* qmoves = reinterpret_cast<AppendMove*>(host.data() + L.qmoves);
  std::memcpy(host.data() + L.moves, plan.moves.data(), plan.moves.size() * sizeof(CompactRowMove));
  int n_page = 0, n_window = 0, nq = 0;
  for (int m = 0; m < L.n_moves; ++m) {
    const CompactRowMove& mv = plan.moves[size_t(m)];
    slot[m] = mv.src_page == kCompactWindow ? n_window++ : n_page++;
    quant[m] = -1;
    if (mv.src_page == kCompactWindow && mv.dst_page != kCompactWindow) {
      quant[m] = nq;
      qmoves[nq] = AppendMove{plan.seq, 0, nq, mv.dst_page, mv.dst_row};
      ++nq;
    }
  }
  uint8_t* w = static_cast<uint8_t*>(workspace);
  // Pageable memory: cudaMemcpyAsync stages it before returning, so `host` may go.
  check_cuda(cudaMemcpyAsync(w, host.data(), L.tables, cudaMemcpyHostToDevice, s), "compact (CUDA): upload");
  const MoveTables t{reinterpret_cast<CompactRowMove*>(w + L.moves),
                     reinterpret_cast<int32_t*>(w + L.slot),
                     reinterpret_cast<int32_t*>(w + L.quant),
                     L.n_moves,
                     L.n_page,
                     L.n_window,
                     L.n_quant};
  const Stage st{w + L.codes, reinterpret_cast<uint16_t*>(w + L.params), reinterpret_cast<uint16_t*>(w + L.bf),
                 reinterpret_cast<float*>(w + L.qk), reinterpret_cast<float*>(w + L.qv)};
  const size_t n_kv = size_t(g.n_kv_heads), d = size_t(g.head_dim);
  for (int l0 = 0; l0 < g.n_layers; l0 += L.chunk) {
    const int layers = std::min(L.chunk, g.n_layers - l0);
    const size_t threads = size_t(layers) * size_t(L.n_moves) * kTeam;
    const int blocks = int(std::min<size_t>((threads + 255) / 256, size_t(multiprocessors()) * 16));
    gather_rows<<<blocks, 256, 0, s>>>(t, g, plan.seq, l0, layers, cache.pages_base(), cache.windows_base(), st);
    scatter_rows<<<blocks, 256, 0, s>>>(t, g, plan.seq, l0, layers, cache.pages_base(), cache.windows_base(), codecs,
                                        st);
    for (int lr = 0; L.n_quant && lr < layers; ++lr) {
      DeviceAppendPlan ap;
      ap.moves = reinterpret_cast<AppendMove*>(w + L.qmoves);
      ap.n_moves = L.n_quant;
      const size_t off = size_t(lr) * size_t(L.n_quant) * n_kv * d;
      append_kv_planned(g, cache.pages_base(), cache.windows_base(), l0 + lr, ap, codecs + size_t(l0 + lr) * n_kv,
                        st.qk + off, st.qv + off, nullptr, nullptr, s);
    }
  }
  check_cuda(cudaGetLastError(), "compact (CUDA) launch");
}

int64_t compact_device(KvCache& cache, int seq, const std::vector<int64_t>& kept, const HeadCodec* codecs,
                       DeviceBuffer<uint8_t>& workspace, void* stream, size_t stage_bytes) {
  KVCC_REQUIRE(codecs != nullptr, "compact (CUDA): no codecs");
  const CompactionPlan plan = cache.plan_compaction(seq, kept);
  workspace.reserve(compact_workspace_bytes(cache.geometry(), plan, stage_bytes));
  compact_rows_device(cache, plan, codecs, workspace.data(), workspace.bytes(), stream, stage_bytes);
  cache.commit_compaction(plan);
  return plan.pages_released;
}

}  // namespace kvcc
