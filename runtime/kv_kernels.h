// CUDA kernels of the paged INT2 KV cache (device pointers, explicit streams). Each has a CPU
// reference with the same semantics (runtime/append_ref.h, runtime/attention_ref.h). Compiled only
// with KVCC_HAVE_CUDA. Which shapes they serve is runtime/served.h's gpu_unsupported_reason
// (head_dim 128, one (scale, zero) group per row, 64-token pages, ...); the CPU reference covers
// the rest, and the launchers throw Error outside that scope, or on a GPU that is not Hopper
// (sm_90). Their host-side planning and workspace layouts are runtime/plan.h.
#pragma once
#if defined(KVCC_HAVE_CUDA)
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "formats/kv_layout.h"
#include "runtime/activations.h"
#include "runtime/engine_step.h"
#include "runtime/plan.h"
#include "runtime/served.h"

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
  int n_heads = 0;      // query heads; n_heads / n_kv_heads <= 8
  float sm_scale = 0;   // softmax scale, usually 1/sqrt(d)
  int target_ctas = 0;  // 0: the kernel's own plan (about one or two waves)
  int stages = 7;       // benchmarking only: bit 0 rotate q, bit 1 attention, bit 2 merge
  int ring = 0;         // tests only: 0 the plan's choice, 2 or 3 that INT2 page-ring depth
};

// Bytes of workspace decode_int2 (page_tokens_bf16 = 0) or decode_bf16_paged (its page size;
// only g.n_kv_heads is used then) needs for this batch shape, DecodeShape::target_ctas and ::ring.
size_t decode_workspace_bytes(const KvGeometry& g, int batch, int n_heads, int max_pages, int page_tokens_bf16 = 0,
                              int target_ctas = 0, int ring = 0);

// q, k, v and out below are activations of type `act` (runtime/activations.h: float32 or
// bfloat16, widened where loaded, rounded where stored); everything else is as typed.

// INT2 decode attention over the mixed cache (sink + INT2 history + ring) of one layer.
// q: [batch, n_heads, d] post-RoPE, unrotated. rot_k: [n_kv, d, d]; rot_v_t: [n_kv, d, d]
// holding R_vᵀ (so the output rotation reads rows coalesced). out: [batch, n_heads, d].
// codecs: host array [n_kv]; any level table selects the (slower) table kernel for the launch.
// blocks: where the layer's page blocks are and their code widths (PageLayout::layer_blocks: 1-4
// bits a side, every KV head of the layer alike; level tables at 2 bits); null: the 2-bit pool.
void decode_int2(const KvGeometry& g, const uint8_t* pages, const uint16_t* windows, int layer,
                 const DeviceBatch& batch, const HeadCodec* codecs, const DecodeShape& shape, const void* q,
                 const float* rot_k, const float* rot_v_t, void* out, void* workspace, size_t workspace_bytes,
                 cudaStream_t stream, Activations act = Activations::Float32, const LayerBlocks* blocks = nullptr);

// The in-house BF16 baseline: the same kernel structure over a plain paged BF16 cache, pages of
// page_tokens tokens, page block (page, head) = K [page_tokens][d] then V [page_tokens][d] bf16,
// keys and values in the rotated basis (rot_k / rot_v_t may be null: no rotation); q, out float32.
void decode_bf16_paged(int n_kv_heads, int head_dim, int page_tokens, const uint16_t* bf16_pages,
                       const DeviceBatch& batch, const DecodeShape& shape, const float* q, const float* rot_k,
                       const float* rot_v_t, float* out, void* workspace, size_t workspace_bytes, cudaStream_t stream);

// R_k or R_v of one KV head as the append and prefill multiply keys and values by it: the stored
// rotation's fixed point (formats/kv_rotation.h) laid out as the int8 MMA operands the kernels
// hold in registers (runtime/rotate_kv.cuh). A layer's rotations do not change while it serves, so
// they are built once (rot_fragments) and a kernel loads 36 KB a head, where converting R itself
// cost each launch more than a decode step's whole append did before.
constexpr int kRotFragmentWords = 9216;
struct RotFragments {
  uint32_t words[kRotFragmentWords];
};
// rot: device [n, d, d] fp32, n heads (of one layer or several, as the artifact stores them; finite);
// out: device [n].
void rot_fragments(const float* rot, int64_t n, RotFragments* out, cudaStream_t stream);

// Append (one layer, a batch of sequences): rotate (x·R), round to BF16, quantise the tokens that
// move into history, write sink and ring. The cache must have grown already (KvCache::grow).
// k, v: device [rows, n_kv, d] unrotated (rows of sequence i start at row_offsets[i]);
// rot_k, rot_v: device [n_kv] (rot_fragments of R_k and R_v), or null when k and v are already
// rotated. codecs: host [n_kv]. The host plans the moves from the lengths and page tables it is given
// (AppendPlanHost, plan_append_moves: runtime/plan.h). blocks: as decode_int2's (null: the 2-bit pool).
size_t append_workspace_bytes(const KvGeometry& g, int64_t rows, int64_t max_moves);
void append_kv(const KvGeometry& g, uint8_t* pages, uint16_t* windows, int layer, const AppendPlanHost& plan,
               const HeadCodec* codecs, const void* k, const void* v, const RotFragments* rot_k,
               const RotFragments* rot_v, void* workspace, size_t workspace_bytes, cudaStream_t stream,
               Activations act = Activations::Float32, const LayerBlocks* blocks = nullptr);
// One layer's append from a plan already on the device (DeviceAppendPlan, made once per step):
// rotate, quantise the moves, write the windows, in one launch; no host work, no copies, no
// workspace. codecs: device [n_kv] of this layer. With plan.counts
// (the step's counts on the device) the launches are the same for every step within the
// capacities, so they can be captured in a CUDA graph and replayed.
void append_kv_planned(const KvGeometry& g, uint8_t* pages, uint16_t* windows, int layer, const DeviceAppendPlan& plan,
                       const HeadCodec* codecs, const void* k, const void* v, const RotFragments* rot_k,
                       const RotFragments* rot_v, cudaStream_t stream, Activations act = Activations::Float32,
                       const LayerBlocks* blocks = nullptr);

// Plans a step from an engine's own tables on the device (EngineStep, runtime/engine_step.h: every
// array a device pointer): the moves and window writes plan_append_moves would make from the same
// lengths and page tables, in its order, and the decode batch ints of the step's sequences
// (seq_slot | seq_len | page_offset = i·stride; their page table is the engine's block table),
// into `step`, a step table of capacity c (StepCapacity, laid out by engine_step_packing). One
// kernel of one block, no host work: it can be captured in a CUDA graph with the step's layers.
// A sequence outside the limits plans nothing and is named in the header (kStepHeaderInts).
// Throws Error only for what the host sees: the batch size, the block table's stride, null tables.
void plan_engine_step(const KvGeometry& g, const EngineStep& s, const StepCapacity& c, const StepLimits& limits,
                      int max_sequences, int64_t max_pages, uint8_t* step, cudaStream_t stream);

// Prefill / extend attention (one layer, a ragged batch of sequences; runtime/prefill.cu;
// reference: prefill_ref per sequence). Sequence i's T new tokens at positions
// length..length+T-1 attend causally to its cache as stored (BF16 sink, INT2 history, BF16 ring)
// and to themselves, rotated and BF16-rounded as the ring will hold them. Does not modify the
// cache (append the tokens afterwards). Scope: head_dim 128, group = head_dim, 64-token pages,
// any sink / recent sizes, any query-head group, uniform grid and level-table codecs, up to
// kPrefillMaxKvHeads KV heads (served.h).
// q: device [ΣT, n_heads, d], k, v: device [ΣT, n_kv, d], post-RoPE, unrotated, the sequences'
// tokens one after another in the list's order (FlashInfer's ragged layout; out likewise).
// rot_k, rot_v_t: device [n_kv, d, d] (R_k for the queries, R_vᵀ for the outputs); fixed_k,
// fixed_v: device [n_kv] (rot_fragments of R_k and R_v, for the new keys and values); all four
// null: identity.
// codecs: host [n_kv]. The workspace is sized by prefill_workspace_bytes for the same lengths and
// counts (page tables are not read there). Up to 64 sequences per launch set; no host-to-device
// copy (their descriptors are kernel parameters). blocks: as decode_int2's (null: the 2-bit pool).
struct PrefillShape {
  int n_heads = 0;      // query heads, a multiple of the KV heads
  float sm_scale = 0;   // softmax scale, usually 1/sqrt(d)
  int splits = 0;       // key-range splits per query tile (0: the kernel's plan; tests, tuning)
  int warps = 0;        // query rows per CTA / 16: 4 or 8 (0: the kernel's choice; tuning)
  int ctas_per_sm = 0;  // 2: the 4-warp build at two CTAs an SM, half the K/V stages (0, 1: one; tuning)
};
struct PrefillSequence {
  int seq_slot = 0;                     // its window slot in the cache
  int64_t length = 0;                   // tokens cached before the new ones
  const int32_t* page_table = nullptr;  // device: its first history_pages(length) page ids
  int T = 0;                            // new tokens (0: skipped)
};
size_t prefill_workspace_bytes(const KvGeometry& g, const std::vector<PrefillSequence>& seqs,
                               const PrefillShape& shape);
void prefill_int2(const KvGeometry& g, const uint8_t* pages, const uint16_t* windows, int layer,
                  const std::vector<PrefillSequence>& seqs, const HeadCodec* codecs, const PrefillShape& shape,
                  const void* q, const void* k, const void* v, const float* rot_k, const float* rot_v_t,
                  const RotFragments* fixed_k, const RotFragments* fixed_v, void* out, void* workspace,
                  size_t workspace_bytes, cudaStream_t stream, Activations act = Activations::Float32,
                  const LayerBlocks* blocks = nullptr);

// Attention-based token scores of one sequence (runtime/scores.cu; reference:
// attention_scores_ref): the W queries of its last W tokens (positions length−W..length−1, already
// appended) attend causally to the cache as stored; scores: device float32 [n_kv, length], the
// softmax weights on each position summed over the W queries and each KV head's query heads
// (SnapKV's observation-window score, read from the INT2 pages themselves). No [W, length] matrix
// is stored: two passes over the cache in 64-token tiles, the first writing per-tile (max, Σ exp)
// of each query's logits, the second summing the weights. q: device [W, n_heads, d] post-RoPE,
// unrotated (act); rot_k: device [n_kv, d, d] or null; page_table: device, the sequence's history
// pages; codecs: DEVICE [n_kv] of this layer. Scope: prefill's (served.h, kGpuPrefill).
size_t attention_scores_workspace_bytes(const KvGeometry& g, int64_t length, int W, int n_heads);
void attention_scores_int2(const KvGeometry& g, const uint8_t* pages, const uint16_t* windows, int layer, int seq_slot,
                           int64_t length, const int32_t* page_table, int W, const HeadCodec* codecs, int n_heads,
                           float sm_scale, const void* q, const float* rot_k, float* scores, void* workspace,
                           size_t workspace_bytes, cudaStream_t stream, Activations act = Activations::Float32);

}  // namespace kvcc
#endif
