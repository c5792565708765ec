// Memory accounting of the paged caches: how many bytes one sequence of a given context takes in
// the INT2 cache (formats/kv_layout.h) and in a BF16 paged cache of the same page size, and how
// many such sequences fit in a memory budget. Pool bytes only (no kernel workspace, no
// activations). `kvcc memory` prints these.
//
// INT2 cache, per sequence of context L (what KvCache allocates for it):
//   window slot      window_slot_bytes(): BF16 K and V sink [S][d] and ring [W][d] per (layer,
//                    KV head), allocated whole for every live sequence, however short
//   history pages    history_pages(g, L) (whole pages of P tokens, kv_layout.h's tiers_of) ×
//                    the page's bytes (K and V codes [P][d·B/8], B the block's code bits, 2 unless
//                    `widths` say otherwise (PageLayout), and (scale, zero) fp16 params [P][d/G]
//                    per (layer, KV head))
// BF16 paged cache, per sequence: ceil(L / P) pages of P tokens × 2 (K, V) × d × 2 bytes per
// (layer, KV head).
// Pages shared by forks are counted once per sequence here (no sharing).
#pragma once
#include <cstdint>
#include <vector>

#include "formats/kv_layout.h"

namespace kvcc {

// Bytes one sequence of `context` tokens holds in the INT2 cache: its window slot plus its
// history pages. context >= 0 (0: an empty live sequence, its slot alone).
// widths: [layers · KV heads] code widths (empty: 2 bits everywhere).
int64_t int2_sequence_bytes(const KvGeometry& g, int64_t context, const std::vector<BlockWidths>& widths = {});
// One page of a BF16 paged cache with g's page size, layers, KV heads and head_dim.
int64_t bf16_page_bytes(const KvGeometry& g);
// Bytes one sequence of `context` tokens holds in that BF16 cache: ceil(context / P) pages.
int64_t bf16_sequence_bytes(const KvGeometry& g, int64_t context);
// floor(budget / bytes_per_sequence); budget >= 0, bytes_per_sequence > 0.
int64_t sequences_in_budget(int64_t budget_bytes, int64_t bytes_per_sequence);

// Both caches at one context and budget.
struct SequenceMemory {
  int64_t context = 0;
  int64_t int2_bytes = 0, bf16_bytes = 0;                                   // per sequence
  double int2_token_layer = 0, bf16_token_layer = 0;                        // per sequence / context / layers
  int64_t int2_sequences = 0, bf16_sequences = 0;                           // in the budget
  double ratio() const { return double(bf16_bytes) / double(int2_bytes); }  // BF16 bytes / INT2 bytes
};
// context > 0, budget >= 0. Throws Error on negative inputs or a geometry the layout cannot hold
// (non-positive sizes, head_dim not a multiple of 4, a group not dividing it, W < P).
SequenceMemory sequence_memory(const KvGeometry& g, int64_t context, int64_t budget_bytes,
                               const std::vector<BlockWidths>& widths = {});

}  // namespace kvcc
