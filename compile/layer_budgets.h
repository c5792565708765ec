// Per-layer token-eviction budgets from calibration statistics (EpiCache's layer-wise budgets;
// docs/eviction.md). A layer whose queries spread their attention over more keys loses more when
// its history is cut, so it keeps more tokens: its budget is its attention spread over the mean
// spread of all layers.
#pragma once
#include <vector>

#include "formats/stats.h"

namespace kvcc {

// Per layer, the harmonic mean over its queries (every query head, every calibration token) of
// the effective number of keys a query attends to, 1 / Σ_j p_ij²: Σ query_count / Σ p2_weight
// over the layer's KV heads (HeadStats: p2_weight = Σ_i Σ_j p_ij²). Throws Error when a layer has
// no attention recorded (p2_weight 0).
std::vector<double> layer_attention_spread(const Stats& stats);

// layer_attention_spread divided by its mean (mean 1, each > 0): Artifact::layer_budgets.
std::vector<double> layer_budgets_from_stats(const Stats& stats);

}  // namespace kvcc
