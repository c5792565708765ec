#include "formats/page_row_codec.h"

#include <cmath>
#include <string>
#include <vector>

#include "formats/codec_scalar.h"
#include "formats/error.h"
#include "formats/fp16.h"

namespace kvcc {

namespace {
void check_table_width(const SideCodec& codec, int bits) {
  KVCC_REQUIRE(!codec.use_table || bits == 2, "a 4-level table codes 2 bits, not " + std::to_string(bits));
}
}  // namespace

void quantize_row(const KvGeometry& g, const SideCodec& codec, int bits, const float* row, uint8_t* codes,
                  uint16_t* params) {
  uint8_t unpacked[1024];
  KVCC_REQUIRE(g.head_dim <= 1024, "append: head_dim above 1024");
  check_table_width(codec, bits);
  for (int grp = 0; grp < g.groups(); ++grp) {
    const float* x = row + grp * g.group;
    GroupParams p;
    if (codec.use_table) {
      p = quantize_table(x, g.group, codec.levels, bits, unpacked + grp * g.group);
    } else {
      const float thr = clip_threshold(x, g.group, double(codec.clip_ratio));
      p = quantize_uniform(x, g.group, thr, bits, unpacked + grp * g.group);
    }
    params[2 * grp] = p.scale;
    params[2 * grp + 1] = p.zero;
  }
  pack_codes(unpacked, g.head_dim, codes, bits);
}

void dequantize_row(const KvGeometry& g, const SideCodec& codec, int bits, const uint8_t* codes, const uint16_t* params,
                    float* row) {
  check_table_width(codec, bits);
  for (int c = 0; c < g.head_dim; ++c) {
    const int grp = c / g.group;
    const float s = float_from_f16(params[2 * grp]);
    const uint8_t code = unpack_code(codes, g.head_dim, c, bits);
    row[c] = codec.use_table ? table_dequant(code, s, codec.levels)
                             : uniform_dequant(code, s, float_from_f16(params[2 * grp + 1]));
  }
}

void quantize_page_side(const KvGeometry& g, const SideCodec& codec, bool key, BlockWidths w, const float* rows,
                        uint8_t* block) {
  const int d = g.head_dim, P = g.page_tokens, bits = key ? w.key : w.value;
  uint8_t* codes = block + (key ? g.k_codes_offset() : g.v_codes_offset(w));
  uint16_t* params = reinterpret_cast<uint16_t*>(block + (key ? g.k_params_offset(w) : g.v_params_offset(w)));
  if (!key || !g.per_channel_keys()) {
    for (int r = 0; r < P; ++r)
      quantize_row(g, codec, bits, rows + size_t(r) * size_t(d), codes + size_t(r) * g.code_row_bytes(bits),
                   params + size_t(r) * 2 * size_t(g.groups()));
    return;
  }
  KVCC_REQUIRE(!codec.use_table, "per-channel keys take the uniform grid, not a level table");
  const int T = g.key_group_tokens;
  KVCC_REQUIRE(T > 0 && P % T == 0, "per-channel key groups of " + std::to_string(T) +
                                        " tokens must divide the page of " + std::to_string(P));
  std::vector<float> x(static_cast<size_t>(T));
  std::vector<uint8_t> c(static_cast<size_t>(T)), all(size_t(P) * size_t(d));  // all: [P][d] codes
  for (int t0 = 0, grp = 0; t0 < P; t0 += T, ++grp)
    for (int ch = 0; ch < d; ++ch) {
      const size_t at = size_t(grp) * size_t(d) + size_t(ch);
      if (g.e5m3_key_pairs()) {
        params[at] = quantize_chan(rows + size_t(t0) * size_t(d) + size_t(ch), T, d, bits, c.data()).word();
      } else {
        for (int i = 0; i < T; ++i) x[size_t(i)] = rows[size_t(t0 + i) * size_t(d) + size_t(ch)];
        const GroupParams p = quantize_uniform(x.data(), T, INFINITY, bits, c.data());  // KIVI's keys: no clip
        params[2 * at] = p.scale;
        params[2 * at + 1] = p.zero;
      }
      for (int i = 0; i < T; ++i) all[size_t(t0 + i) * size_t(d) + size_t(ch)] = c[size_t(i)];
    }
  for (int r = 0; r < P; ++r)
    pack_codes(&all[size_t(r) * size_t(d)], d, codes + size_t(r) * g.code_row_bytes(bits), bits);
}

void dequantize_page_row(const KvGeometry& g, const SideCodec& codec, bool key, BlockWidths w, const uint8_t* block,
                         int row, float* out) {
  const int bits = key ? w.key : w.value;
  const uint8_t* codes =
      block + (key ? g.k_codes_offset() : g.v_codes_offset(w)) + size_t(row) * g.code_row_bytes(bits);
  const uint16_t* params =
      reinterpret_cast<const uint16_t*>(block + (key ? g.k_params_offset(w) : g.v_params_offset(w)));
  if (!key || !g.per_channel_keys()) {
    dequantize_row(g, codec, bits, codes, params + size_t(row) * 2 * size_t(g.groups()), out);
    return;
  }
  const int words = g.key_pair_bytes / 2;  // uint16 words a pair
  const uint16_t* grp = params + size_t(row / g.key_group_tokens) * size_t(g.head_dim) * size_t(words);
  for (int c = 0; c < g.head_dim; ++c) {
    const uint8_t code = unpack_code(codes, g.head_dim, c, bits);
    if (g.e5m3_key_pairs()) {
      const ChanParams p = chan_params_of_word(grp[c]);
      out[c] = uniform_dequant(code, p.scale_value(), p.zero_value());
    } else {
      out[c] = uniform_dequant(code, float_from_f16(grp[2 * c]), float_from_f16(grp[2 * c + 1]));
    }
  }
}

}  // namespace kvcc
