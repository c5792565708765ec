// Host-side planning of the CUDA kernels: decode's split-K plan and merge, prefill's query tiles
// and key-range splits, append's moves, and the layout of every workspace. Plain C++ (no CUDA):
// the launchers (runtime/*.cu) pass what they ask of the device (SMs, resident CTAs from the
// occupancy API), and the CPU tests (tests/test_plan.cpp) pass an H200's.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "formats/kv_layout.h"
#include "runtime/served.h"

namespace kvcc {

// Workspace carving: every buffer starts on a 256-byte boundary (cudaMalloc's alignment).
inline size_t align256(size_t x) { return (x + 255) / 256 * 256; }

// ---------------------------------------------------------------------------------------------
// Decode (runtime/decode.cu).

// The INT2 attention kernel: 4 warps per CTA; pages in each warp's shared-memory ring (ring - 1
// in flight while one is computed). Two builds: a 3-stage ring at 3 CTAs per SM (what shared
// memory fits), and a 2-stage ring at 4 CTAs per SM (registers capped at 128): more warps to hide
// latency, less prefetch per warp.
constexpr int kDecodeWarps = 4;
constexpr int kDecodeRingDeep = 3, kDecodeRingWide = 2;
constexpr int decode_ctas_per_sm(int ring) { return ring == kDecodeRingWide ? 4 : 3; }
// (sequence, KV head) pairs below which decode is latency-bound whatever the context; from there
// on the merge also takes one CTA per pair.
constexpr int kDecodeFewPairs = 48;
// Bytes of the key MMAs' query per (sequence, KV head, query head): [4 t][4] 16-byte B-fragment
// words (DecodeArgs::qk8).
constexpr size_t kDecodeQk8Bytes = 4 * 4 * 16;

// What the decode plan needs of the GPU (decode.cu asks the device).
struct DecodeGpu {
  int sms = 0;            // streaming multiprocessors
  int resident_deep = 0;  // CTAs of the 3-stage INT2 build resident at once on the whole GPU
  int resident_wide = 0;  // the same for the 2-stage build
  int resident(int ring) const { return ring == kDecodeRingWide ? resident_wide : resident_deep; }
};

// History pages ("units") in paged_splits splits of units_per_split each, the BF16 window tiles
// in window_splits splits of win_tiles_per_split each; one CTA per (split, KV head, sequence).
struct DecodePlan {
  int paged_splits, units_per_split, window_splits, win_tiles_per_split, total;
  int ring = kDecodeRingDeep;  // which INT2 kernel build runs it
};

// decode_int2's plan for a batch whose longest history has max_pages pages. target_ctas and ring
// are DecodeShape's overrides (0: the plan's own choice). The choices, measured on the H200
// (docs/runtime.md), are documented at plan.cpp's plan_splits.
DecodePlan plan_decode_int2(const DecodeGpu& gpu, const KvGeometry& g, int batch, int max_pages, int target_ctas,
                            int ring);
// decode_bf16_paged's plan: pages only, two CTAs per SM unless target_ctas says otherwise.
DecodePlan plan_decode_bf16(const DecodeGpu& gpu, int batch, int n_kv, int max_pages, int target_ctas);

// Splits each of 4 slices of threads loads per round of a log-sum-exp merge (merge.cuh's
// merge_run): the smallest of 1, 4, 12 that needs one round (12 beyond 48 splits).
int merge_slice_chunk(int total_splits);
// Which merge kernel combines decode's splits, and how many splits each slice of threads loads per
// round (decode.cu builds merge_splits for chunks 1, 4, 12 and merge_splits_group for 8, 12).
struct MergePlan {
  bool grouped;  // one CTA per (KV head, sequence) instead of per query head
  int chunk;
};
MergePlan plan_decode_merge(int pairs, int total_splits);

// Decode's workspace: byte offsets of the rotated query, the key MMAs' query and its (sum, scale),
// the splits' partial outputs and their (max, sum); total bytes.
struct DecodeWorkspace {
  size_t q_rot, qk8, qk_sc, part_o, part_ml, total;
};
DecodeWorkspace decode_workspace(int batch, int n_heads, int n_kv, const DecodePlan& p);
// Bytes decode_int2 (page_tokens_bf16 = 0) or decode_bf16_paged (its page size; only
// g.n_kv_heads is used then) needs (kv_kernels.h's decode_workspace_bytes, with the device's gpu).
size_t decode_workspace_bytes(const DecodeGpu& gpu, const KvGeometry& g, int batch, int n_heads, int max_pages,
                              int page_tokens_bf16, int target_ctas, int ring);

// ---------------------------------------------------------------------------------------------
// Prefill (runtime/prefill.cu).

constexpr int kPrefillKeyTile = kGpuPageTokens;  // key tokens per tile: one INT2 page
constexpr int kPrefillMaxSplits = 128;           // key-range splits per query tile, at most

// CTAs of the prefill kernel's builds resident at once on the whole GPU: 4 and 8 warps, and the
// 4-warp build at two CTAs an SM (0: not available).
struct PrefillGpu {
  int resident4 = 0, resident8 = 0, resident4_pair = 0;
};

// A batch of sequences prefilled together (FlashInfer's ragged layout: q, k, v and out hold the
// sequences' tokens one after another). Sequence i: T new tokens after lengths[i] cached ones.
struct PrefillSeqPlan {
  int T, rows, row_tiles;  // rows = T·(n_heads / n_kv) query rows per KV head, in tiles of 16·warps
  int splits, units_per_split;
  int n_pages, win_rows;  // INT2 pages; BF16 window rows staged ahead of the new tokens
  int64_t token0;         // its first token in q, k, v and out
  int64_t kv0;            // its first staged key/value row (window rows, then the T new ones)
  int64_t part0;          // its first partial row: [splits][n_kv][rows] rows from here
};
struct PrefillPlan {
  int warps = 0;        // one build per launch
  int ctas_per_sm = 1;  // 2: the 4-warp build at two CTAs an SM
  std::vector<PrefillSeqPlan> seqs;
  int64_t tokens = 0, kv_rows = 0, part_rows = 0;  // totals over the batch
};
// splits, warps and ctas_per_sm are PrefillShape's overrides (0: the plan's). The splits are
// planned for the whole batch: every sequence's key range is cut into splits of about the same
// number of key tiles, so that the batch's CTAs fill the GPU about once and a short extend over a
// long history is not one long CTA behind the others. Throws Error for warps other than 0, 4 and
// 8, ctas_per_sm other than 0, 1 and 2 (2 with 4 warps only), for mismatched lists and for
// negative lengths or counts.
PrefillPlan plan_prefill(const PrefillGpu& gpu, const KvGeometry& g, const std::vector<int64_t>& lengths,
                         const std::vector<int>& counts, int n_heads, int splits, int warps, int ctas_per_sm = 0);

// Prefill's workspace: byte offsets of the rotated fp16 queries ([n_kv][tokens·r][d]), keys and
// values ([n_kv][kv_rows][d]), the splits' partial outputs and (max, sum); total bytes.
struct PrefillWorkspace {
  size_t q, k, v, part_o, part_ml, bytes;
};
PrefillWorkspace prefill_workspace(const KvGeometry& g, const PrefillPlan& p, int n_heads);

// ---------------------------------------------------------------------------------------------
// Append (runtime/append.cu).

// One layer's append for a batch of sequences, as the host gives it: k and v rows of sequence i
// start at row_offsets[i].
struct AppendPlanHost {
  std::vector<int> seq_slots;
  std::vector<int64_t> old_lengths;
  std::vector<int> counts;
  std::vector<int64_t> row_offsets;
  std::vector<std::vector<int32_t>> page_tables;  // each sequence's full page table after growing
};
// A token entering history: from ring slot `src` of window slot `seq_slot` (from_ring 1 or 2) or
// from input row `src` (from_ring 0), into (page, row). from_ring 2: a window write of the same
// step replaces that slot (its `move` names this move), so the two must run in that order.
struct AppendMove {
  int32_t seq_slot, from_ring, src, page, row;
};
// A new token staying in the BF16 windows: input row `src` to sink position or ring slot `dst`;
// `move`: the index of the move that takes the slot's old token into history first, or -1.
struct AppendWindowWrite {
  int32_t seq_slot, to_ring, src, dst, move;
};
struct AppendMoves {
  std::vector<AppendMove> moves;
  std::vector<AppendWindowWrite> writes;
  int64_t rows = 0;  // input rows: the largest row_offsets[i] + counts[i]
};
// The moves and window writes of an append (the same walk as append_ref): the old ring's tokens
// that a flush takes, in order, then each new token where its position puts it; each ring write
// paired with the move that empties its slot, if any. Throws Error when
// the arrays differ in size or a sequence was not grown.
AppendMoves plan_append_moves(const KvGeometry& g, const AppendPlanHost& plan);

// One step's append plan on the device (the same for every layer of the step): the moves and
// window writes of plan_append_moves. Runtime::begin_append uploads it once per step;
// append_kv_planned reads it for each layer.
struct DeviceAppendPlan {
  const AppendMove* moves = nullptr;
  const AppendWindowWrite* writes = nullptr;
  int n_moves = 0, n_writes = 0;
  // Null: the fields above are the step's. Otherwise the step's own live on the device, in a header
  // the step's upload writes: int32 [n_moves, n_writes, byte offset of the moves, byte offset of the
  // window writes] (offsets from the header; moves and writes above are then unused), and n_moves
  // and n_writes above are capacities: they size the grid, so launches captured in a CUDA graph
  // stay valid for every later step within them.
  const int32_t* counts = nullptr;
  // The counts were written by the kernel just before (a step planned on the device): read them
  // after the wait on it, not before.
  bool counts_after_wait = false;
};

// ---------------------------------------------------------------------------------------------
// A step within declared maxima (RuntimeOptions::max_batch, max_context, max_step_tokens): the
// device tables and workspace are sized once, at load, from these bounds.

struct StepLimits {
  int max_batch = 0;        // sequences in a step
  int64_t max_context = 0;  // tokens of a sequence after the step
  int max_step_tokens = 0;  // new tokens of a step, all sequences together
};
// Capacities of one step's tables and the layout of its device table: the header
// (DeviceAppendPlan::counts), the decode batch ints at a fixed place (decode's launches hold their
// address), then the step's moves and window writes packed after the ints it has (their offsets
// in the header; step_packing), so that one copy uploads a step.
struct StepCapacity {
  int64_t moves = 0;                             // AppendMoves::moves of any step within the limits, at most
  int64_t writes = 0;                            // AppendMoves::writes, at most
  int64_t rows = 0;                              // input rows (= max_step_tokens)
  int64_t hist_pages = 0;                        // history pages of a max_context sequence (fixes decode's split plan)
  int64_t ints = 0;                              // decode batch ints: seq_slot | seq_len | page_offset | page tables
  size_t counts_at = 0, ints_at = 0, bytes = 0;  // bytes: for the largest step
};
// Header ints: n_moves, n_writes, moves and writes byte offsets (from the header), and for a
// step an engine's tables planned on the device (engine_step.h) its EngineStepProblem and the
// first sequence that has it (-1: none), which Runtime::step_problem reads back.
constexpr int kStepHeaderInts = 8;
// Where a step's moves and window writes go (byte offsets from the header, 16-byte aligned), and
// the bytes up to their end, for a step of `ints` decode ints, n_moves moves and n_writes writes.
struct StepPacking {
  size_t moves_at, writes_at, bytes;
};
StepPacking step_packing(const StepCapacity& c, int64_t ints, int64_t n_moves, int64_t n_writes);
// Throws Error for non-positive limits. History grows by whole pages, so a sequence given c
// tokens moves at most page_tokens·ceil(c / page_tokens) <= c + page_tokens - 1 tokens into
// history; each new token is at most one window write.
StepCapacity step_capacity(const KvGeometry& g, const StepLimits& limits);
// Engine tables (engine_step.h): the device plans the step into the same table, its decode ints
// 3·batch (seq_slot | seq_len | page_offset; the page table is the engine's block table) and its
// moves and writes at fixed places, those of a step of max_batch sequences at the capacities.
StepPacking engine_step_packing(const StepCapacity& c, int max_batch);
// Sequences an engine step may hold: the device planner keeps three prefix arrays of them in
// shared memory.
constexpr int kEngineMaxBatch = 2048;
// append_kv's workspace (the host plan's copy): byte offsets of the moves, the window writes and
// the codecs; total bytes.
struct AppendWorkspace {
  size_t moves, writes, codecs, bytes;
};
AppendWorkspace append_workspace(const KvGeometry& g, int64_t rows, int64_t max_moves);

}  // namespace kvcc
