#include "runtime/plan.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "formats/error.h"
#include "runtime/engine_step.h"

namespace kvcc {

namespace {

constexpr int kWarps = kDecodeWarps;

// Split-K plan for `splits_per_pair` history splits per (sequence, KV head) pair; window tiles
// grouped so that a window CTA reads about as many bytes as a history split (unit_bytes per page).
DecodePlan plan_for(int splits_per_pair, int max_units, int window_tiles, double unit_bytes) {
  DecodePlan p{};
  const int units = std::max(1, max_units);
  p.units_per_split = std::max(1, (units + splits_per_pair - 1) / splits_per_pair);
  p.paged_splits = (units + p.units_per_split - 1) / p.units_per_split;
  if (window_tiles > 0) {
    const double tile_bytes = double(kGpuWindowTile) * 2 * kGpuBf16RowBytes;  // K and V rows
    int tps = int(std::ceil(p.units_per_split * unit_bytes / tile_bytes / kWarps)) * kWarps;
    p.win_tiles_per_split = std::min(std::max(tps, kWarps), (window_tiles + kWarps - 1) / kWarps * kWarps);
    p.window_splits = (window_tiles + p.win_tiles_per_split - 1) / p.win_tiles_per_split;
  }
  p.total = p.paged_splits + p.window_splits;
  return p;
}

// Split-K plan: ceil(target / pairs) history splits per (sequence, KV head) pair. An explicit
// target_ctas (tests, tuning) is used as is, with the ring `ring` (0: the deep one). By default,
// measured on the H200 (docs/runtime.md, tuning log), with many pairs: 4 waves of resident CTAs
// of the wide-ring kernel if that leaves splits of >= 24 pages, else 2 waves if >= 48 pages (more
// waves balance the tail; too short splits pay each CTA's fixed cost too often). Otherwise (few
// pairs or short contexts) fewer, longer CTAs (the deep-ring build unless the splits are short,
// below): 2 per SM, at least min_units pages per split so that no warp of a CTA idles. (Batch 8
// at 64K / 128K and batch 32 at 32K: 126 / 230 / 250 us with 2 waves, 119 / 222 / 243 with 4;
// batch 8 at 16K: 44 us with 2 per SM, 47 with 2 waves, 50 with 4.)
struct Waves {
  int waves, min_pages;
};
constexpr Waves kWavePlans[] = {{4, 24}, {2, 48}};
DecodePlan plan_splits(const DecodeGpu& gpu, int batch, int n_kv, int max_units, int target_ctas, int window_tiles,
                       int min_units = 1, double unit_bytes = kGpuPageBytes, int ring = 0) {
  const int pairs = std::max(1, batch * n_kv);
  const int units = std::max(1, max_units);
  if (target_ctas > 0) {
    DecodePlan p = plan_for((target_ctas + pairs - 1) / pairs, units, window_tiles, unit_bytes);
    p.ring = ring > 0 ? ring : kDecodeRingDeep;
    return p;
  }
  if (pairs >= kDecodeFewPairs) {
    const int waves_ring = ring > 0 ? ring : kDecodeRingWide;
    for (const Waves& w : kWavePlans) {
      const int target = gpu.resident(waves_ring) * w.waves;
      DecodePlan p = plan_for((target + pairs - 1) / pairs, units, window_tiles, unit_bytes);
      p.ring = waves_ring;
      if (p.units_per_split >= w.min_pages) return p;
    }
  }
  const int want = (2 * gpu.sms + pairs - 1) / pairs;
  const int most = (units + std::max(1, min_units) - 1) / std::max(1, min_units);
  DecodePlan p = plan_for(std::max(1, std::min(want, most)), units, window_tiles, unit_bytes);
  // Short splits (<= 4 pages per warp) gain more from the wide build's lighter warps than from a
  // deeper prefetch: batch 1 at 32K (16-page splits) 18.7 vs 19.5 us; at 128K (62-page splits)
  // 46.2 vs 45.0, batch 8 at 16K / 32K (52 / 103 pages) 52.1 / 89.6 vs 43.7 / 71.4. (Splits of
  // 17–61 pages were not measured.)
  p.ring = ring > 0 ? ring : p.units_per_split <= 4 * kWarps ? kDecodeRingWide : kDecodeRingDeep;
  return p;
}

// The BF16 baseline's default: two CTAs per multiprocessor (its best measured on the H200).
int bf16_target(const DecodeGpu& gpu, int target_ctas) { return target_ctas > 0 ? target_ctas : 2 * gpu.sms; }

}  // namespace

DecodePlan plan_decode_int2(const DecodeGpu& gpu, const KvGeometry& g, int batch, int max_pages, int target_ctas,
                            int ring) {
  return plan_splits(gpu, batch, g.n_kv_heads, max_pages, target_ctas, (g.sink + g.recent) / kGpuWindowTile, kWarps,
                     kGpuPageBytes, ring);  // (per-channel blocks: the same size)
}

DecodePlan plan_decode_bf16(const DecodeGpu& gpu, int batch, int n_kv, int max_pages, int target_ctas) {
  const DecodePlan p = plan_splits(gpu, batch, n_kv, max_pages, bf16_target(gpu, target_ctas), 0);
  return DecodePlan{p.total, p.units_per_split, 0, 0, p.total};
}

// kChunk is the smallest that needs one round of loads (a chunk's loads and exponentials issue
// whether or not its splits exist: 12 where 1 would do cost 4–6 us at batch 32–64, 4K, measured).
int merge_slice_chunk(int total_splits) { return total_splits <= 4 ? 1 : total_splits <= 16 ? 4 : 12; }

MergePlan plan_decode_merge(int pairs, int total_splits) {
  if (pairs >= kDecodeFewPairs) return MergePlan{true, total_splits <= 8 ? 8 : 12};
  return MergePlan{false, merge_slice_chunk(total_splits)};
}

DecodeWorkspace decode_workspace(int batch, int n_heads, int n_kv, const DecodePlan& p) {
  constexpr size_t kHeads = kGpuMaxGroupHeads, kD = kGpuHeadDim;
  DecodeWorkspace w;
  w.q_rot = 0;
  w.qk8 = align256(size_t(batch) * n_heads * kD * sizeof(float));
  w.qk_sc = w.qk8 + align256(size_t(batch) * n_kv * kHeads * kDecodeQk8Bytes);
  w.part_o = w.qk_sc + align256(size_t(batch) * n_kv * kHeads * 2 * sizeof(float));
  w.part_ml = w.part_o + align256(size_t(batch) * n_kv * p.total * kHeads * kD * sizeof(float));
  w.total = w.part_ml + size_t(batch) * n_kv * p.total * kHeads * 2 * sizeof(float);
  return w;
}

size_t decode_workspace_bytes(const DecodeGpu& gpu, const KvGeometry& g, int batch, int n_heads, int max_pages,
                              int page_tokens_bf16, int target_ctas, int ring) {
  const DecodePlan p = page_tokens_bf16 > 0 ? plan_decode_bf16(gpu, batch, g.n_kv_heads, max_pages, target_ctas)
                                            : plan_decode_int2(gpu, g, batch, max_pages, target_ctas, ring);
  return decode_workspace(batch, n_heads, g.n_kv_heads, p).total;
}

// Key-range splits only when the query tiles alone leave the GPU idle (short extends over long
// contexts, batches of few tokens): each CTA gets about (the batch's key tiles) / (CTAs resident)
// key tiles, and at least 4.
PrefillPlan plan_prefill(const PrefillGpu& gpu, const KvGeometry& g, const std::vector<int64_t>& lengths,
                         const std::vector<int>& counts, int n_heads, int splits, int warps, int ctas_per_sm) {
  KVCC_REQUIRE(lengths.size() == counts.size(), "prefill (CUDA): lengths and counts differ in size");
  KVCC_REQUIRE(warps == 0 || warps == 4 || warps == 8, "prefill (CUDA): warps must be 4 or 8");
  KVCC_REQUIRE(ctas_per_sm >= 0 && ctas_per_sm <= 2, "prefill (CUDA): CTAs per SM must be 1 or 2");
  KVCC_REQUIRE(ctas_per_sm < 2 || warps != 8, "prefill (CUDA): two CTAs an SM is a 4-warp build");
  const int r = n_heads / g.n_kv_heads;
  PrefillPlan p;
  p.seqs.resize(counts.size());
  // 8 warps (two warpgroups, 128 rows) use each key tile for twice the rows: 1.3-1.6x faster on
  // the H100 from T·r = 256 rows up; 4 warps won at 64 rows, where one 8-warp tile would be half
  // empty (docs/results/2026-12-05-h100-wgmma-prefill.md). A batch takes 8 when most of its rows
  // are in such sequences.
  int64_t rows_all = 0, rows_big = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    KVCC_REQUIRE(counts[i] >= 0 && lengths[i] >= 0, "prefill (CUDA): negative length or token count");
    const int64_t rows = int64_t(counts[i]) * r;
    rows_all += rows;
    rows_big += rows >= 128 ? rows : 0;
  }
  p.warps = ctas_per_sm == 2 ? 4 : warps > 0 ? warps : (rows_all > 0 && 2 * rows_big >= rows_all ? 8 : 4);
  // The 4-warp build at two CTAs an SM where the GPU holds two: at few query rows one CTA's chain
  // per key tile leaves the SM idle (T = 16 over 32K 7-12% faster, 128K 15-18%, H100); the 8-warp
  // build wins from 128 rows, where two 4-warp CTAs were 10-20% slower (T = 64, 256 over 32K).
  p.ctas_per_sm = ctas_per_sm > 0 ? ctas_per_sm : (p.warps == 4 && gpu.resident4_pair > 0 ? 2 : 1);
  std::vector<int> units(counts.size());
  int64_t work = 0;  // key tiles over the batch's query-tile CTAs
  for (size_t i = 0; i < counts.size(); ++i) {
    PrefillSeqPlan& s = p.seqs[i];
    s.T = counts[i];
    s.rows = s.T * r;
    s.row_tiles = (s.rows + 16 * p.warps - 1) / (16 * p.warps);
    const KvTiers t = tiers_of(g, lengths[i]);
    s.n_pages = int(t.hist_tokens / kPrefillKeyTile);
    s.win_rows = t.sink_count + t.ring_count;
    units[i] = s.T > 0 ? s.n_pages + (s.win_rows + s.T + kPrefillKeyTile - 1) / kPrefillKeyTile : 0;
    work += int64_t(s.row_tiles) * g.n_kv_heads * units[i];
  }
  const int64_t resident = std::max(1, p.warps == 8         ? gpu.resident8
                                       : p.ctas_per_sm == 2 ? gpu.resident4_pair
                                                            : gpu.resident4);
  // Sequence i's splits when each CTA takes about per_cta key tiles.
  const auto splits_of = [&](size_t i, int64_t per_cta) {
    const int u = std::max(1, units[i]);
    int n = splits > 0 ? splits : int(std::min<int64_t>((u + per_cta - 1) / per_cta, std::max(1, u / 4)));
    n = std::max(1, std::min(n, kPrefillMaxSplits));
    const int per_split = (u + n - 1) / n;
    return (u + per_split - 1) / per_split;  // no empty split
  };
  const auto ctas_of = [&](int64_t per_cta) {
    int64_t n = 0;
    for (size_t i = 0; i < counts.size(); ++i) n += int64_t(p.seqs[i].row_tiles) * g.n_kv_heads * splits_of(i, per_cta);
    return n;
  };
  int64_t per_cta = std::max<int64_t>(4, (work + resident - 1) / resident);
  // The rounding up of each sequence's splits can leave a few CTAs for a second wave, as long as
  // the first (16 splits x 8 heads and 4 more on 132 SMs: the extend took 1.37x as long). Longer
  // splits that fit one wave are cheaper while they are less than 1.5x as long: the smallest such.
  if (splits <= 0 && ctas_of(per_cta) > resident) {
    int64_t lo = per_cta + 1, hi = per_cta + per_cta / 2;
    if (hi >= lo && ctas_of(hi) <= resident) {
      while (lo < hi) {
        const int64_t mid = (lo + hi) / 2;
        if (ctas_of(mid) <= resident) hi = mid;
        else lo = mid + 1;
      }
      per_cta = hi;
    }
  }
  for (size_t i = 0; i < counts.size(); ++i) {
    PrefillSeqPlan& s = p.seqs[i];
    const int u = std::max(1, units[i]);
    const int n = splits_of(i, per_cta);
    s.units_per_split = (u + n - 1) / n;
    s.splits = (u + s.units_per_split - 1) / s.units_per_split;
    s.token0 = p.tokens;
    s.kv0 = p.kv_rows;
    s.part0 = p.part_rows;
    p.tokens += s.T;
    p.kv_rows += s.win_rows + s.T;
    p.part_rows += int64_t(s.splits) * g.n_kv_heads * s.rows;
  }
  return p;
}

PrefillWorkspace prefill_workspace(const KvGeometry& g, const PrefillPlan& p, int n_heads) {
  constexpr size_t kD = kGpuHeadDim;
  const size_t rows_all = size_t(p.tokens) * n_heads;
  const size_t kv = size_t(p.kv_rows) * g.n_kv_heads * kD;
  PrefillWorkspace w{};
  size_t off = 0;
  auto take = [&](size_t bytes) {
    const size_t at = off;
    off += align256(bytes);
    return at;
  };
  w.q = take(rows_all * kD * 2);
  w.k = take(kv * 2);
  w.v = take(kv * 2);
  w.part_o = take(size_t(p.part_rows) * kD * 4);
  w.part_ml = take(size_t(p.part_rows) * 2 * 4);
  w.bytes = off;
  return w;
}

AppendMoves plan_append_moves(const KvGeometry& g, const AppendPlanHost& plan) {
  const size_t nseq = plan.seq_slots.size();
  KVCC_REQUIRE(plan.old_lengths.size() == nseq && plan.counts.size() == nseq && plan.row_offsets.size() == nseq &&
                   plan.page_tables.size() == nseq,
               "append (CUDA): plan arrays differ in size");
  AppendMoves m;
  for (size_t i = 0; i < nseq; ++i) {
    const int64_t n0 = plan.old_lengths[i], n1 = n0 + plan.counts[i];
    m.rows = std::max(m.rows, plan.row_offsets[i] + plan.counts[i]);
    const KvTiers t0 = tiers_of(g, n0), t1 = tiers_of(g, n1);
    KVCC_REQUIRE(int64_t(plan.page_tables[i].size()) >= t1.hist_tokens / g.page_tokens,
                 "append (CUDA): sequence was not grown before appending");
    const int slot = plan.seq_slots[i];
    auto page_of = [&](int64_t post) { return plan.page_tables[i][size_t(post / g.page_tokens)]; };
    const int64_t post0 = n0 - t0.sink_count;
    // The old ring's tokens that enter history: posts [t0.hist_tokens, ring_end), at moves first_ring...
    const int64_t ring_end = std::min(t1.hist_tokens, post0);
    const size_t first_ring = m.moves.size();
    for (int64_t post = t0.hist_tokens; post < ring_end; ++post)
      m.moves.push_back(AppendMove{slot, 1, ring_slot(g, post), page_of(post), int32_t(post % g.page_tokens)});
    // ... of which the one in ring slot s, if any (the ring holds fewer than `recent` of them).
    auto ring_move_of = [&](int32_t s) -> int32_t {
      const int64_t a = t0.hist_tokens;
      const int64_t post = a + ((s - a % g.recent) % g.recent + g.recent) % g.recent;
      if (post >= ring_end) return -1;
      m.moves[first_ring + size_t(post - a)].from_ring = 2;
      return int32_t(first_ring + size_t(post - a));
    };
    for (int j = 0; j < plan.counts[i]; ++j) {
      const int64_t pos = n0 + j;
      const int32_t src = int32_t(plan.row_offsets[i] + j);
      if (pos < g.sink) {
        m.writes.push_back(AppendWindowWrite{slot, 0, src, int32_t(pos), -1});
      } else if (pos - g.sink < t1.hist_tokens) {
        const int64_t post = pos - g.sink;
        m.moves.push_back(AppendMove{slot, 0, src, page_of(post), int32_t(post % g.page_tokens)});
      } else {
        const int32_t dst = ring_slot(g, pos - g.sink);
        m.writes.push_back(AppendWindowWrite{slot, 1, src, dst, ring_move_of(dst)});
      }
    }
  }
  return m;
}

AppendWorkspace append_workspace(const KvGeometry& g, int64_t rows, int64_t max_moves) {
  AppendWorkspace w;
  w.moves = 0;
  w.writes = w.moves + align256(size_t(max_moves) * sizeof(AppendMove));
  w.codecs = w.writes + align256(size_t(rows) * sizeof(AppendWindowWrite));
  w.bytes = w.codecs + align256(size_t(g.n_kv_heads) * sizeof(HeadCodec));
  return w;
}

StepCapacity step_capacity(const KvGeometry& g, const StepLimits& l) {
  KVCC_REQUIRE(l.max_batch > 0 && l.max_context > 0 && l.max_step_tokens > 0,
               "step limits: max_batch, max_context and max_step_tokens must be positive (got " +
                   std::to_string(l.max_batch) + ", " + std::to_string(l.max_context) + ", " +
                   std::to_string(l.max_step_tokens) + ")");
  KVCC_REQUIRE(l.max_context <= INT32_MAX && l.max_step_tokens <= int64_t(l.max_batch) * l.max_context,
               "step limits: max_context above 2^31 - 1 tokens, or max_step_tokens above max_batch x max_context");
  StepCapacity c;
  c.moves = int64_t(l.max_step_tokens) + int64_t(l.max_batch) * (g.page_tokens - 1);
  c.writes = l.max_step_tokens;
  c.rows = l.max_step_tokens;
  c.hist_pages = history_pages(g, l.max_context);
  c.ints = 3 * int64_t(l.max_batch) + int64_t(l.max_batch) * c.hist_pages;
  c.counts_at = 0;
  c.ints_at = align256(kStepHeaderInts * sizeof(int32_t));
  c.bytes = step_packing(c, c.ints, c.moves, c.writes).bytes;
  return c;
}

StepPacking engine_step_packing(const StepCapacity& c, int max_batch) {
  return step_packing(c, 3 * int64_t(max_batch), c.moves, c.writes);
}

std::string engine_step_message(int32_t problem, int seq) {
  const std::string who = "engine step: sequence " + std::to_string(seq) + " of the step ";
  switch (problem) {
    case kStepOk:
      return "";
    case kStepBadSlot:
      return who + "has a window slot outside [0, max_sequences)";
    case kStepBadLength:
      return who + "has a negative length or count, or would hold more than the declared max_context tokens";
    case kStepBadPage:
      return who + "names a page outside the pool [0, max_pages) among those the step writes";
    case kStepTooManyTokens:
      return "engine step: more new tokens than the step's k / v rows (EngineStep::rows, at most max_step_tokens)";
    default:
      return "engine step: unknown problem " + std::to_string(problem);
  }
}

StepPacking step_packing(const StepCapacity& c, int64_t ints, int64_t n_moves, int64_t n_writes) {
  const auto align16 = [](size_t x) { return (x + 15) / 16 * 16; };
  StepPacking p;
  p.moves_at = align16(c.ints_at + size_t(ints) * sizeof(int32_t));
  p.writes_at = align16(p.moves_at + size_t(n_moves) * sizeof(AppendMove));
  p.bytes = p.writes_at + size_t(n_writes) * sizeof(AppendWindowWrite);
  return p;
}

}  // namespace kvcc
