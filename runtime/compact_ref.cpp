#include "runtime/compact_ref.h"

#include <cstring>
#include <string>

#include "formats/error.h"
#include "formats/fp16.h"
#include "formats/page_row_codec.h"

namespace kvcc {

void compact_rows_ref(KvCache& cache, const CompactionPlan& plan, const HeadCodec* codecs) {
  KVCC_REQUIRE(cache.memory() == PoolMemory::Host, "compact_ref: needs a host pool");
  const KvGeometry& g = cache.geometry();
  KVCC_REQUIRE(!g.per_channel_keys(), kPerChannelEvictionRefusal);
  const int d = g.head_dim, L = g.n_layers, H = g.n_kv_heads;
  const size_t n = plan.moves.size(), G2 = 2 * size_t(g.groups()), cb = g.code_row_bytes(4);
  // Staged sources of one (layer, head), both sides: BF16 rows or INT2 rows (codes + params; a
  // code row at its own width, in a slot of the widest's bytes).
  std::vector<uint16_t> bf(n * 2 * size_t(d));
  std::vector<uint8_t> codes(n * 2 * cb);
  std::vector<uint16_t> params(n * 2 * G2);
  std::vector<float> row(static_cast<size_t>(d));
  for (int l = 0; l < L; ++l) {
    for (int h = 0; h < H; ++h) {
      uint16_t* win = cache.windows_base() + g.window_block_elem(plan.seq, l, h);
      const BlockWidths w = cache.layout().widths(l, h);
      const int bits[2] = {w.key, w.value};
      const size_t row_bytes[2] = {g.code_row_bytes(w.key), g.code_row_bytes(w.value)};
      auto win_row = [&](int32_t r, int side) {
        const size_t base = r < g.sink
                                ? (side == 0 ? g.k_sink_elem() : g.v_sink_elem()) + size_t(r) * size_t(d)
                                : (side == 0 ? g.k_ring_elem() : g.v_ring_elem()) + size_t(r - g.sink) * size_t(d);
        return win + base;
      };
      auto page_codes = [&](int32_t page, int32_t r, int side) {
        return cache.page_block(page, l, h) + (side == 0 ? g.k_codes_offset() : g.v_codes_offset(w)) +
               size_t(r) * row_bytes[side];
      };
      auto page_params = [&](int32_t page, int32_t r, int side) {
        return reinterpret_cast<uint16_t*>(cache.page_block(page, l, h) +
                                           (side == 0 ? g.k_params_offset(w) : g.v_params_offset(w))) +
               size_t(r) * G2;
      };
      // 1. Read every source (a destination may be another move's source).
      for (size_t m = 0; m < n; ++m) {
        const CompactRowMove& mv = plan.moves[m];
        for (int side = 0; side < 2; ++side) {
          const size_t at = m * 2 + size_t(side);
          if (mv.src_page == kCompactWindow) {
            std::memcpy(&bf[at * size_t(d)], win_row(mv.src_row, side), size_t(d) * 2);
          } else {
            std::memcpy(&codes[at * cb], page_codes(mv.src_page, mv.src_row, side), row_bytes[side]);
            std::memcpy(&params[at * G2], page_params(mv.src_page, mv.src_row, side), G2 * 2);
          }
        }
      }
      // 2. Write every destination, converting between tiers.
      const HeadCodec& hc = codecs[size_t(l) * size_t(H) + size_t(h)];
      for (size_t m = 0; m < n; ++m) {
        const CompactRowMove& mv = plan.moves[m];
        for (int side = 0; side < 2; ++side) {
          const size_t at = m * 2 + size_t(side);
          const SideCodec& sc = side == 0 ? hc.key : hc.value;
          const bool from_window = mv.src_page == kCompactWindow;
          if (mv.dst_page == kCompactWindow) {
            uint16_t* dst = win_row(mv.dst_row, side);
            if (from_window) {
              std::memcpy(dst, &bf[at * size_t(d)], size_t(d) * 2);
            } else {
              dequantize_row(g, sc, bits[side], &codes[at * cb], &params[at * G2], row.data());
              for (int c = 0; c < d; ++c) dst[c] = bf16_from_float(row[size_t(c)]);
            }
          } else if (from_window) {
            // As append's flush: the BF16 row, as float, through the page-row codec.
            for (int c = 0; c < d; ++c) row[size_t(c)] = float_from_bf16(bf[at * size_t(d) + size_t(c)]);
            quantize_row(g, sc, bits[side], row.data(), page_codes(mv.dst_page, mv.dst_row, side),
                         page_params(mv.dst_page, mv.dst_row, side));
          } else {
            std::memcpy(page_codes(mv.dst_page, mv.dst_row, side), &codes[at * cb], row_bytes[side]);
            std::memcpy(page_params(mv.dst_page, mv.dst_row, side), &params[at * G2], G2 * 2);
          }
        }
      }
    }
  }
}

int64_t compact_ref(KvCache& cache, int seq, const std::vector<int64_t>& kept, const HeadCodec* codecs) {
  KVCC_REQUIRE(cache.memory() == PoolMemory::Host, "compact_ref: needs a host pool");
  KVCC_REQUIRE(codecs != nullptr, "compact_ref: no codecs");
  KVCC_REQUIRE(!cache.geometry().per_channel_keys(), kPerChannelEvictionRefusal);
  const CompactionPlan plan = cache.plan_compaction(seq, kept);  // throws before any write
  compact_rows_ref(cache, plan, codecs);
  cache.commit_compaction(plan);
  return plan.pages_released;
}

}  // namespace kvcc
