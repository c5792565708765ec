#include "formats/kv_layout.h"

#include <string>
#include <utility>

#include "formats/error.h"

namespace kvcc {

PageLayout::PageLayout(const KvGeometry& g, std::vector<BlockWidths> widths)
    : heads_(g.n_kv_heads), geo_(g), widths_(std::move(widths)) {
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

std::string PageLayout::kernel_problem() const {
  for (int l = 0; l < geo_.n_layers; ++l)
    for (int h = 1; h < heads_; ++h) {
      const BlockWidths &a = widths(l, 0), &b = widths(l, h);
      if (a.key != b.key || a.value != b.value)
        return "layer " + std::to_string(l) + " holds KV head 0 at " + std::to_string(a.key) + " / " +
               std::to_string(a.value) + " bits and KV head " + std::to_string(h) + " at " + std::to_string(b.key) +
               " / " + std::to_string(b.value) + " (the CUDA kernels take one key and one value width a layer)";
    }
  return "";
}

LayerBlocks PageLayout::layer_blocks(int layer) const {
  KVCC_REQUIRE(layer >= 0 && layer < geo_.n_layers, "kv cache: layer " + std::to_string(layer) + " out of range");
  const std::string problem = kernel_problem();
  KVCC_REQUIRE(problem.empty(), "kv cache: " + problem);
  LayerBlocks b;
  b.page_bytes = page_bytes_;
  b.layer_offset = offset_[size_t(layer) * size_t(heads_)];
  b.widths = widths(layer, 0);
  b.head_bytes = geo_.page_head_bytes(b.widths);
  return b;
}

}  // namespace kvcc
