// EpiCache's layer sensitivity to block-wise prefill (docs/eviction.md, "Layer budgets"): how
// much a layer's keys change when the context is prefilled in blocks under a bounded cache. Each
// document runs twice, with causal attention and with a block-prefill mask (a query in block b of
// `block` tokens sees the first `sink` tokens, the second half of block b − 1 and block b up to
// itself); per layer the cosine similarity of the two runs' keys is summed over tokens and KV
// heads. A lower similarity means the layer depends more on context a bounded cache drops.
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "formats/model_file.h"
#include "formats/stats.h"

namespace kvcc {

// Runs layer by layer (one layer's weights loaded at a time; both runs' hidden states of every
// document kept), so memory is that of calibration's own pass over the same tokens, twice.
// progress(layer) after each layer. Throws Error when block < 2, sink < 0 or the documents hold
// no tokens.
LayerSensitivity measure_layer_sensitivity(const ModelFile& model, const std::vector<std::vector<int32_t>>& documents,
                                           int block, int sink, const std::function<void(int)>& progress = {});

}  // namespace kvcc
