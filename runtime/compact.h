// Token eviction with page compaction on a device pool (CUDA; built with KVCC_HAVE_CUDA only):
// the same plan and the same bytes as runtime/compact_ref.h's CPU reference. Rows are gathered
// into a staging buffer first (any destination may be another move's source), then copied or
// dequantised into place; BF16 rows entering history are quantised by the append kernel itself
// (append_kv_planned on the staged rows, identity rotation), so they get append's exact bytes.
#pragma once
#include <cstdint>
#include <vector>

#include "formats/kv_layout.h"
#include "runtime/kv_cache.h"

namespace kvcc {

// Moves a plan's rows in a device pool, on `stream` (a cudaStream_t); returns after queuing
// (its staging is freed in stream order). codecs: device [n_layers * n_kv_heads]. Scope: the
// append kernel's (head_dim 128, one (scale, zero) group per row).
void compact_rows_device(KvCache& cache, const CompactionPlan& plan, const HeadCodec* codecs, void* stream);

// plan_compaction + compact_rows_device + commit_compaction, all or nothing (a refused plan
// queues nothing). Returns the pages released.
int64_t compact_device(KvCache& cache, int seq, const std::vector<int64_t>& kept, const HeadCodec* codecs,
                       void* stream);

}  // namespace kvcc
