#include "formats/kv_layout.h"

#include <string>
#include <utility>

#include "formats/error.h"

namespace kvcc {

PageLayout::PageLayout(const KvGeometry& g, std::vector<BlockWidths> widths)
    : heads_(g.n_kv_heads), widths_(std::move(widths)) {
  const size_t blocks = size_t(g.n_layers) * size_t(g.n_kv_heads);
  if (widths_.empty()) widths_.assign(blocks, BlockWidths{});
  KVCC_REQUIRE(widths_.size() == blocks, "kv cache: " + std::to_string(widths_.size()) + " code widths for " +
                                             std::to_string(blocks) + " (layer, KV head) blocks");
  offset_.resize(blocks);
  for (size_t i = 0; i < blocks; ++i) {
    const BlockWidths& w = widths_[i];
    for (int bits : {w.key, w.value}) {
      KVCC_REQUIRE(bits >= 1 && bits <= 4, "kv cache: layer " + std::to_string(i / size_t(heads_)) + " KV head " +
                                               std::to_string(i % size_t(heads_)) + " codes of " +
                                               std::to_string(bits) + " bits (the pages hold 1 to 4)");
      KVCC_REQUIRE(g.head_dim * bits % 8 == 0, "kv cache: a row of " + std::to_string(g.head_dim) + " codes of " +
                                                   std::to_string(bits) + " bits is not whole bytes");
    }
    two_bit_ = two_bit_ && w.key == 2 && w.value == 2;
    offset_[i] = page_bytes_;
    page_bytes_ += g.page_head_bytes(w);
  }
}

}  // namespace kvcc
