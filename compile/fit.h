// Quantizer fitting: clip ratios of the uniform INT-b grid, Lloyd–Max level tables (continuous
// densities for TurboQuant, empirical for oscar-lm). The codec itself is formats/kv_codec.h and
// formats/codec_scalar.h; everything here only chooses its parameters.
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "formats/kv_codec.h"
#include "formats/stats.h"

namespace kvcc {

// ---- Lloyd–Max -------------------------------------------------------------------------------

// Lloyd–Max levels (2^bits, ascending) for a continuous density on [lo, hi], solved on a fine
// grid (cumulative integrals, linear interpolation at the cell boundaries) to convergence.
std::vector<double> lloyd_max_density(const std::function<double(double)>& pdf, double lo, double hi, int bits);
// N(0, 1): ±0.7979 (1 bit); ±0.4528, ±1.5104 (2 bits); ... in units of σ.
std::vector<double> lloyd_max_gaussian(int bits);
// The coordinate density of a uniform unit vector in R^d, f(x) ∝ (1 − x²)^((d−3)/2) (TurboQuant
// Lemma 1), levels returned ×√d, i.e. in RMS units (d ≥ 3).
std::vector<double> lloyd_max_sphere(int d, int bits);
// 1-D k-means on samples (sorted internally), initialised from the Gaussian levels scaled to the
// samples' RMS; empty cells keep their previous level.
std::vector<double> lloyd_max_empirical(std::vector<float> samples, int bits, int iterations = 100);
// Mean squared error of coding `samples` with `levels` (nearest level).
double level_mse(const std::vector<float>& samples, const std::vector<double>& levels);

// ---- Clip ratios -----------------------------------------------------------------------------

// The rows one (layer, KV head) is fitted (or evaluated) on, already rotated by the side's
// rotation: keys [n, d], values [n, d], queries [nq, d] (the group's query heads).
struct FitRows {
  int d = 0;
  int n = 0, nq = 0;
  std::vector<float> key, value, query;
};
// Fitting (heldout == 0) or held-out (heldout == 1) rows of a reservoir, at most max_rows tokens
// (the first in reservoir order) with their r queries each.
FitRows select_rows(const Reservoir& reservoir, bool heldout, int max_rows);
// The same tokens from several reservoirs (the KV heads a spanning quantiser group covers): rows
// k of every result are one (document, position), in the first reservoir's order. Reservoir
// priorities depend only on (seed, document, position), so a layer's heads hold the same tokens;
// a token missing from any reservoir (never, for kvcc's own stats) is skipped. With one
// reservoir this is select_rows.
std::vector<FitRows> select_aligned_rows(const std::vector<const Reservoir*>& reservoirs, bool heldout, int max_rows);

// The clip-ratio grid searched (1.0 = no clipping is always a candidate).
const std::vector<double>& clip_ratio_grid();

// Query-weighted logit error Σ_i Σ_j (q_i·(k_j − k̂_j))² given the rows' error E = K − K̂ [n, d]
// and the metric M = Σ q qᵀ [d, d] (all in one basis).
double weighted_logit_error(const std::vector<float>& error, int n, const std::vector<float>& metric, int d);
// Attention-output error Σ_i ‖Σ_j p_ij (v_j − v̂_j)‖² with p [nq, n] row-stochastic.
double output_error(const std::vector<float>& probs, int nq, const std::vector<float>& error, int n, int d);
// Σ_jl G_jl e_j·e_l for a [n, n] Gram matrix G (G = PᵀP gives the output error).
double gram_error(const std::vector<float>& gram, int n, const std::vector<float>& error, int d);
// softmax(q kᵀ / √d) over all n keys, [nq, n].
std::vector<float> attention_probs(const std::vector<float>& query, int nq, const std::vector<float>& key, int n,
                                   int d);
// Σ q qᵀ [d, d] (float).
std::vector<float> query_metric(const std::vector<float>& query, int nq, int d);

// Chooses the clip ratio from clip_ratio_grid() minimising the key (query-weighted logit) or value
// (attention-output) error of `side` on `rows` (rotated by side.rotation). Ties keep the larger
// ratio, so the result is never worse than no clipping on these rows. Returns the chosen ratio;
// best_error / no_clip_error report the errors when given.
double fit_clip_ratio(const Recipe& recipe, const SideArtifact& side, KvSide which, const FitRows& rows,
                      double* best_error = nullptr, double* no_clip_error = nullptr);
// The joint fit of a quantiser group spanning the KV heads `sides` (rows: their aligned rows,
// select_aligned_rows): candidates code the heads' rotated rows side by side (width
// sides.size()·d, as roundtrip_layer_page does) and the error is the sum of the heads' errors,
// each against its own queries. One side is fit_clip_ratio above.
double fit_clip_ratio(const Recipe& recipe, const std::vector<const SideArtifact*>& sides, KvSide which,
                      const std::vector<FitRows>& rows, double* best_error = nullptr, double* no_clip_error = nullptr);

// RMS-normalised rotated coordinates (x / fp16 RMS of its group, as codec_scalar's table codec
// normalises them) of a side's rows [n, d], for oscar-lm's empirical Lloyd–Max.
// d is the row width: head_dim, or span·head_dim for rows of a spanning group's heads side by side.
std::vector<float> normalised_coordinates(const std::vector<float>& rotated, int n, int d, int group);
// The rotated rows of several heads side by side, [n, span·d] (block k = rows[k] · sides[k].rotation:
// float64 as the codec's rotate_rows, or float BLAS, faster, where the clip search is insensitive
// to rounding). rows: aligned (select_aligned_rows).
std::vector<float> rotated_side_by_side(const std::vector<const SideArtifact*>& sides, KvSide which,
                                        const std::vector<FitRows>& rows, bool float64);

}  // namespace kvcc
