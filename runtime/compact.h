// Token eviction with page compaction on a device pool (CUDA; built with KVCC_HAVE_CUDA only):
// the same plan and the same bytes as runtime/compact_ref.h's CPU reference. Rows are gathered
// into a staging buffer first (any destination may be another move's source), then copied or
// dequantised into place; BF16 rows entering history are quantised by the append kernel itself
// (append_kv_planned on the staged rows, identity rotation), so they get append's exact bytes.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "formats/kv_layout.h"
#include "runtime/device_buffer.h"
#include "runtime/kv_cache.h"

namespace kvcc {

// Rows are staged for several layers at once, at most stage_bytes of them (at least one layer's):
// two launches per chunk of layers, plus append's quantiser per layer for BF16 rows entering history.
inline constexpr size_t kCompactStageBytes = size_t(128) << 20;

// Device workspace compact_rows_device needs for `plan`: its move tables and the staging.
size_t compact_workspace_bytes(const KvGeometry& g, const CompactionPlan& plan,
                               size_t stage_bytes = kCompactStageBytes);

// Moves a plan's rows in a device pool, on `stream` (a cudaStream_t); returns after queuing. The
// workspace (at least compact_workspace_bytes) is the caller's, used in `stream` order, so one
// reused buffer costs no allocation per call. codecs: device [n_layers * n_kv_heads]. Scope: the
// append kernel's (head_dim 128, one (scale, zero) group per row).
void compact_rows_device(KvCache& cache, const CompactionPlan& plan, const HeadCodec* codecs, void* workspace,
                         size_t workspace_bytes, void* stream, size_t stage_bytes = kCompactStageBytes);

// plan_compaction + compact_rows_device + commit_compaction, all or nothing (a refused plan
// queues nothing); the workspace grows when the plan needs more (cudaFree: the device finishes with
// the old one first). Returns the pages released.
int64_t compact_device(KvCache& cache, int seq, const std::vector<int64_t>& kept, const HeadCodec* codecs,
                       DeviceBuffer<uint8_t>& workspace, void* stream, size_t stage_bytes = kCompactStageBytes);

}  // namespace kvcc
