// CUDA kernels of the paged INT2 KV cache (device pointers, explicit streams). Each has a CPU
// reference with the same semantics (runtime/append_ref.h, runtime/attention_ref.h). Compiled only
// with KVCC_HAVE_CUDA. The GPU decode kernel supports head_dim 128, one (scale, zero) group per
// row (group = head_dim), up to 8 query heads per KV head, and the uniform grid; the CPU
// reference covers the rest, and the launchers throw Error outside that range.
#pragma once
#if defined(KVCC_HAVE_CUDA)
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "formats/kv_layout.h"

namespace kvcc {

// A decode batch as device arrays. Sequence b's history pages are
// page_table[page_offset[b] .. page_offset[b] + pages(len[b]) - 1].
struct DeviceBatch {
  int batch = 0;
  const int32_t* seq_slot = nullptr;     // [batch] window slot (the cache's sequence id)
  const int32_t* seq_len = nullptr;      // [batch] tokens
  const int32_t* page_offset = nullptr;  // [batch]
  const int32_t* page_table = nullptr;   // flat
  int max_pages = 0;                     // max history pages in the batch (sizes the split-K grid)
};

struct DecodeShape {
  int n_heads = 0;    // query heads; n_heads / n_kv_heads <= 8
  float sm_scale = 0; // softmax scale, usually 1/sqrt(d)
  int target_ctas = 0;  // 0: the kernel's own plan (about one or two waves)
  int stages = 7;       // benchmarking only: bit 0 rotate q, bit 1 attention, bit 2 merge
};

// Bytes of workspace decode_int2 (page_tokens_bf16 = 0) or decode_bf16_paged (its page size;
// only g.n_kv_heads is used then) needs for this batch shape and DecodeShape::target_ctas.
size_t decode_workspace_bytes(const KvGeometry& g, int batch, int n_heads, int max_pages,
                              int page_tokens_bf16 = 0, int target_ctas = 0);

// INT2 decode attention over the mixed cache (sink + INT2 history + ring) of one layer.
// q: [batch, n_heads, d] fp32 post-RoPE, unrotated. rot_k: [n_kv, d, d]; rot_v_t: [n_kv, d, d]
// holding R_vᵀ (so the output rotation reads rows coalesced). out: [batch, n_heads, d] fp32.
// codecs: host array [n_kv] (checked: level tables are not supported by this kernel).
void decode_int2(const KvGeometry& g, const uint8_t* pages, const uint16_t* windows, int layer,
                 const DeviceBatch& batch, const HeadCodec* codecs, const DecodeShape& shape,
                 const float* q, const float* rot_k, const float* rot_v_t, float* out,
                 void* workspace, size_t workspace_bytes, cudaStream_t stream);

// The in-house BF16 baseline: the same kernel structure over a plain paged BF16 cache, pages of
// page_tokens tokens, page block (page, head) = K [page_tokens][d] then V [page_tokens][d] bf16,
// keys and values in the rotated basis (rot_k / rot_v_t may be null: no rotation).
void decode_bf16_paged(int n_kv_heads, int head_dim, int page_tokens, const uint16_t* bf16_pages,
                       const DeviceBatch& batch, const DecodeShape& shape, const float* q,
                       const float* rot_k, const float* rot_v_t, float* out, void* workspace,
                       size_t workspace_bytes, cudaStream_t stream);

// Append (one layer, a batch of sequences): rotate (x·R), round to BF16, quantise the tokens that
// move into history, write sink and ring. The cache must have grown already (KvCache::grow).
// k, v: device [rows, n_kv, d] fp32 unrotated (rows of sequence i start at row_offsets[i]);
// rot_k, rot_v: device [n_kv, d, d], or null when k and v are already rotated.
// codecs: host [n_kv]. The host plans the moves from the lengths and page tables it is given.
struct AppendPlanHost {
  std::vector<int> seq_slots;
  std::vector<int64_t> old_lengths;
  std::vector<int> counts;
  std::vector<int64_t> row_offsets;
  std::vector<std::vector<int32_t>> page_tables;  // each sequence's full page table after growing
};
size_t append_workspace_bytes(const KvGeometry& g, int64_t rows, int64_t max_moves);
void append_kv(const KvGeometry& g, uint8_t* pages, uint16_t* windows, int layer,
               const AppendPlanHost& plan, const HeadCodec* codecs, const float* k, const float* v,
               const float* rot_k, const float* rot_v, void* workspace, size_t workspace_bytes,
               cudaStream_t stream);

}  // namespace kvcc
#endif
