// Per-layer token-eviction budgets from calibration statistics (EpiCache's layer-wise budgets;
// docs/eviction.md), by one of two measures: the layer sensitivity the stats may carry (EpiCache's
// own: layers whose keys drift most under block-wise prefill keep more tokens), or the attention
// spread (layers whose queries spread their attention over more keys keep more).
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

// EpiCache's allocation from per-layer key similarities under block-wise prefill
// (calibrate/layer_sensitivity.h): min-max normalised similarity s, weight (1 − s)^alpha, scaled
// to mean 1, then raised to at least `floor` (EpiCache: alpha 1.1, floor 0.25). All similarities
// equal: every weight 1. Throws Error for no layers, a non-finite similarity or bad parameters.
std::vector<double> sensitivity_layer_budgets(const std::vector<double>& similarity, double alpha = 1.1,
                                              double floor = 0.25);
// sensitivity_layer_budgets of the stats' measured layer sensitivity; Error when not measured.
std::vector<double> layer_budgets_from_sensitivity(const Stats& stats);

}  // namespace kvcc
