// CPU reference of token eviction with page compaction: evicts every token of a sequence but the
// kept ones and packs the survivors into whole pages, so that the pages they no longer fill go
// back to the pool. The bookkeeping is KvCache::plan_compaction / commit_compaction (the rules
// are CompactionPlan's); this moves the rows of every layer and KV head.
#pragma once
#include <cstdint>
#include <vector>

#include "formats/kv_layout.h"
#include "runtime/kv_cache.h"

namespace kvcc {

// Per-channel key pages (KIVI keys) are not compacted: a page's key (scale, zero) pairs span its
// tokens, so a row cannot move to another page without re-quantising both pages.
inline constexpr const char* kPerChannelEvictionRefusal =
    "token eviction: per-channel key pages (kivi keys) cannot be compacted (a page's key scales span its tokens, so "
    "moving a row would re-quantise its page)";
// A device pool's eviction kernels (compaction, attention scores) read 2-bit pages; the host pool
// compacts and scores pages of any widths.
inline constexpr const char* kWidthsEvictionRefusal =
    "token eviction on a device pool: its compaction and scoring kernels read 2-bit pages; pages of other code "
    "widths (compile --bits-budget) are compacted and scored by the host pool";

// Moves a plan's rows in a host pool: all sources are read before any write, BF16 rows entering
// history are quantised by the append path's codec, INT2 rows entering a window are dequantised
// and rounded to BF16. codecs: [n_layers * n_kv_heads] (every layer's, in order).
void compact_rows_ref(KvCache& cache, const CompactionPlan& plan, const HeadCodec* codecs);

// plan_compaction + compact_rows_ref + commit_compaction: all or nothing (a refused plan changes
// nothing). Returns the number of pages released to the pool.
int64_t compact_ref(KvCache& cache, int seq, const std::vector<int64_t>& kept, const HeadCodec* codecs);

}  // namespace kvcc
