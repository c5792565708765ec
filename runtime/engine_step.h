// A step given by an engine's own tables (RuntimeOptions::engine_tables): which window slot each
// sequence holds, its length before the step, its new tokens and its history pages as a block
// table [sequences, stride] int32, the way vLLM and FlashInfer keep them. From these alone the
// append's moves and window writes follow, sequence by sequence, in closed form (the functions
// below, KVCC_HD: the device plans a step with them, runtime/append.cu's plan_engine_step, and
// they give exactly plan_append_moves' tables, in its order: tests/test_runtime_engine.cpp).
#pragma once
#include <cstdint>
#include <string>

#include "formats/host_device.h"
#include "formats/kv_layout.h"
#include "runtime/plan.h"

namespace kvcc {

// All arrays int32, sequences in the order of the step's k / v rows (sequence i's rows follow
// those of sequences 0..i-1: FlashInfer's ragged layout). Device pointers on a device pool, host
// pointers on a host pool. block_table[i·stride + p] is the pool page of history page p of
// sequence i (history_pages(g, length) pages are read; the engine allocates them, e.g. by
// pages_for_length in kvcc_runtime.h, before the step).
struct EngineStep {
  int batch = 0;                         // sequences in the step (a host value)
  const int32_t* slots = nullptr;        // [batch] window slot of each, in [0, max_sequences)
  const int32_t* lengths = nullptr;      // [batch] tokens before the step
  const int32_t* counts = nullptr;       // [batch] new tokens
  const int32_t* block_table = nullptr;  // [batch, stride]
  int stride = 0;                        // block table row length, >= history_pages(max_context)
  // Rows of the step's k and v (a host value, <= max_step_tokens; 0: max_step_tokens): a step
  // whose counts sum above it plans nothing (kStepTooManyTokens), so an append never reads past
  // the caller's tensors; rows beyond the counts' sum are padding, never read.
  int rows = 0;
};

// One sequence of an engine's tables, for prefill: its slot, length before the new tokens and its
// history pages (history_pages(g, length) of them are read).
struct EngineSequence {
  int slot = 0;
  int64_t length = 0;
  const int32_t* pages = nullptr;
};

// What is wrong with a sequence of a step, if anything (EngineStepProblem; engine_step_message
// names it). The ids the step writes are checked; the ids it only reads (decode's) are the
// engine's to keep in range, as FlashInfer's are.
enum EngineStepProblem : int32_t {
  kStepOk = 0,
  kStepBadSlot = 1,        // slot outside [0, max_sequences)
  kStepBadLength = 2,      // negative length or count, or more than max_context tokens after the step
  kStepBadPage = 3,        // a page the step writes outside [0, max_pages)
  kStepTooManyTokens = 4,  // the step's new tokens above its rows (EngineStep::rows, max_step_tokens)
};

// The text of a problem of sequence `seq` (seq = batch: the step as a whole), for an Error.
std::string engine_step_message(int32_t problem, int seq);

// Per-sequence counts of an append from n0 tokens by c (tiers_of's walk, as plan_append_moves).
struct EngineSeqItems {
  int64_t ring_moves = 0;        // old ring tokens entering history (first in the moves)
  int64_t new_moves = 0;         // new tokens going straight to history (after them)
  int64_t sink_writes = 0;       // new tokens into the sink (first in the writes)
  int64_t ring_writes = 0;       // new tokens into the ring (after them)
  int64_t hist0 = 0, hist1 = 0;  // history tokens before and after
  int64_t ring_end = 0;          // ring moves are posts [hist0, ring_end)
  int64_t first_ring_write = 0;  // post of the first ring write
  KVCC_HD int64_t moves() const { return ring_moves + new_moves; }
  KVCC_HD int64_t writes() const { return sink_writes + ring_writes; }
};

KVCC_HD int64_t engine_max64(int64_t a, int64_t b) { return a > b ? a : b; }
KVCC_HD int64_t engine_min64(int64_t a, int64_t b) { return a < b ? a : b; }

KVCC_HD EngineSeqItems engine_seq_items(const KvGeometry& g, int64_t n0, int64_t c) {
  EngineSeqItems s;
  const KvTiers t0 = tiers_of(g, n0), t1 = tiers_of(g, n0 + c);
  const int64_t S = g.sink, post0 = n0 - t0.sink_count, n1 = n0 + c;
  s.hist0 = t0.hist_tokens;
  s.hist1 = t1.hist_tokens;
  s.ring_end = engine_min64(t1.hist_tokens, post0);
  s.ring_moves = engine_max64(0, s.ring_end - t0.hist_tokens);
  s.sink_writes = engine_min64(engine_max64(S - n0, 0), c);
  s.new_moves = engine_max64(0, engine_min64(n1, S + t1.hist_tokens) - engine_max64(n0, S));
  s.ring_writes = c - s.sink_writes - s.new_moves;
  s.first_ring_write = engine_max64(engine_max64(n0, S) - S, t1.hist_tokens);
  return s;
}

KVCC_HD int64_t engine_mod(int64_t a, int64_t m) { return ((a % m) + m) % m; }

// Move k (< s.moves()) of a sequence whose moves start at index first_move of the step's, whose
// rows start at row0, whose history pages are pages[].
KVCC_HD AppendMove engine_move(const KvGeometry& g, const EngineSeqItems& s, int slot, int64_t n0, int64_t row0,
                               const int32_t* pages, int64_t k) {
  AppendMove m;
  m.seq_slot = slot;
  int64_t post;
  if (k < s.ring_moves) {
    post = s.hist0 + k;
    m.src = ring_slot(g, post);
    // A ring write of this step lands in its slot: the write runs this move first.
    m.from_ring = engine_mod(post - s.first_ring_write, g.recent) < s.ring_writes ? 2 : 1;
  } else {
    const int64_t pos = engine_max64(n0, g.sink) + (k - s.ring_moves);
    post = pos - g.sink;
    m.src = int32_t(row0 + pos - n0);
    m.from_ring = 0;
  }
  m.page = pages[post / g.page_tokens];
  m.row = int32_t(post % g.page_tokens);
  return m;
}

// Window write k (< s.writes()) of the same sequence; first_move: the index of its first move in
// the step's moves (a ring write names the move that empties its slot).
KVCC_HD AppendWindowWrite engine_write(const KvGeometry& g, const EngineSeqItems& s, int slot, int64_t n0, int64_t row0,
                                       int64_t first_move, int64_t k) {
  AppendWindowWrite w;
  w.seq_slot = slot;
  if (k < s.sink_writes) {
    w.to_ring = 0;
    w.src = int32_t(row0 + k);
    w.dst = int32_t(n0 + k);
    w.move = -1;
    return w;
  }
  const int64_t post = s.first_ring_write + (k - s.sink_writes);
  w.to_ring = 1;
  w.src = int32_t(row0 + post + g.sink - n0);
  w.dst = ring_slot(g, post);
  // The old ring token in that slot: the post p = dst (mod recent) in [hist0, hist0 + recent).
  const int64_t p = s.hist0 + engine_mod(w.dst - s.hist0, g.recent);
  w.move = p < s.ring_end ? int32_t(first_move + (p - s.hist0)) : -1;
  return w;
}

// The first problem of sequence (slot, n0, c, pages), or kStepOk. max_pages: pool pages.
KVCC_HD int32_t engine_seq_problem(const KvGeometry& g, int64_t max_context, int max_sequences, int64_t max_pages,
                                   int32_t slot, int64_t n0, int64_t c, const int32_t* pages) {
  if (slot < 0 || slot >= max_sequences) return kStepBadSlot;
  if (n0 < 0 || c < 0 || n0 + c > max_context) return kStepBadLength;
  const EngineSeqItems s = engine_seq_items(g, n0, c);
  for (int64_t p = s.hist0 / g.page_tokens; p < s.hist1 / g.page_tokens; ++p)
    if (pages[p] < 0 || pages[p] >= max_pages) return kStepBadPage;
  return kStepOk;
}

}  // namespace kvcc
