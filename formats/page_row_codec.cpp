#include "formats/page_row_codec.h"

#include "formats/codec_scalar.h"
#include "formats/error.h"
#include "formats/fp16.h"

namespace kvcc {

void quantize_row(const KvGeometry& g, const SideCodec& codec, const float* row, uint8_t* codes, uint16_t* params) {
  uint8_t unpacked[1024];
  KVCC_REQUIRE(g.head_dim <= 1024, "append: head_dim above 1024");
  for (int grp = 0; grp < g.groups(); ++grp) {
    const float* x = row + grp * g.group;
    GroupParams p;
    if (codec.use_table) {
      p = quantize_table(x, g.group, codec.levels, 2, unpacked + grp * g.group);
    } else {
      const float thr = clip_threshold(x, g.group, double(codec.clip_ratio));
      p = quantize_uniform(x, g.group, thr, 2, unpacked + grp * g.group);
    }
    params[2 * grp] = p.scale;
    params[2 * grp + 1] = p.zero;
  }
  pack_codes(unpacked, g.head_dim, codes);
}

void dequantize_row(const KvGeometry& g, const SideCodec& codec, const uint8_t* codes, const uint16_t* params,
                    float* row) {
  for (int c = 0; c < g.head_dim; ++c) {
    const int grp = c / g.group;
    const float s = float_from_f16(params[2 * grp]);
    const uint8_t code = unpack_code(codes, c);
    row[c] = codec.use_table ? table_dequant(code, s, codec.levels)
                             : uniform_dequant(code, s, float_from_f16(params[2 * grp + 1]));
  }
}

}  // namespace kvcc
