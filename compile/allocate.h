// `kvcc compile --bits-budget B`: key and value code widths per layer (or per KV head, where that
// pays) chosen under a budget of bits per element, from the sensitivity measured on the stats.
//
// Sensitivity: for every candidate width w (1–4 bits) the recipe is compiled at w bits on both
// sides (its rotations, fitted clips); then on each (layer, KV head)'s held-out reservoir rows one
// side at a time is coded (page by page, formats/kv_codec.h's layer codec, the other side exact)
// and the squared relative attention-output error ‖PV − P̂V̂‖² / ‖PV‖² is measured, as
// `kvcc report`'s output error (compile/report.h) with one side quantised.
//
// Weighed by the loss (CompileOptions::side_kl, measured on the model once the budget is known
// feasible): at each width up to the recipe's, each (layer, side)'s errors are scaled by one
// factor so that their sum over the layer's KV heads is that side's measured KL at that width;
// wider widths keep the factor of the recipe's. The held-out errors rank every layer's relative
// error alike and come from diffuse attention over many documents' rows; the KL says what each
// layer side costs the model (a first bits budget on the held-out errors alone lost to uniform
// widths at matched bits: docs/results/2026-12-01-served-mixed-recipe.md). Narrower widths are
// measured, not extrapolated: a 1-bit side's errors are large, and the loss grows faster than
// linearly in them (on gutenberg-27m, 1-bit KIVI keys predicted from the 2-bit KL cost 9x the
// uniform recipe's KL: docs/results/2026-12-05-bits-budget-kl.md). Wider widths' errors are smaller,
// where the KL is close to linear in them.
//
// Choice: the sum of those errors over every side (each at its width) is minimised subject to the
// budget, exactly (a multiple-choice knapsack solved by dynamic programming over the total bits).
// The budget is the artifact's own accounting (formats/kv_codec.h): effective_bits(artifact, L)
// at the budget's context L, or with L = 0 the quantised tier alone (the mean of the key and value
// history_bits, the limit of effective bits at long context). Both are affine in the sum of the
// sides' widths, so the budget is a cap on that sum. Units: a layer's side (all its KV heads at one
// width) or, with granularity head, each KV head's side; auto takes per-head widths only when they
// lower the predicted error by at least kHeadGain (otherwise per layer: one width per layer and side
// is what engines' per-layer KV dtypes can serve).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "compile/compile.h"
#include "formats/artifact.h"
#include "formats/kv_codec.h"
#include "formats/stats.h"

namespace kvcc {

inline constexpr double kHeadGain = 0.05;  // auto: per-head widths only for >= 5% less predicted error

// Measured errors of one (layer, KV head, side) at every candidate width (index as widths).
struct SideSensitivity {
  int layer = 0, head = 0;
  KvSide side = KvSide::Key;
  std::vector<double> error;  // squared relative attention-output error with this side at widths[i]
};

struct BitsAllocation {
  std::vector<int> widths;                   // candidates, ascending
  std::vector<SideSensitivity> sensitivity;  // [layer][head][side], side-minor
  std::string granularity;                   // layer | head: what was chosen
  std::vector<int> bits;                     // [layer][head][side], as sensitivity
  double predicted_error = 0;                // Σ sensitivity at the chosen widths
  double layer_error = 0, head_error = 0;    // the optimum at either granularity (head: -1 if not tried)
  double budget_bits = 0;                    // the budget's measure of the chosen widths
  // Weighed by the loss: the factor applied to each (layer, side)'s errors at each width, index
  // (layer·2 + side)·widths + width index (empty: the held-out errors alone).
  std::vector<double> kl_scale;
};

// Scales `table` ([layer][head][side], side-minor, as measure_sensitivity returns it) by the
// measured KLs: kl[j] holds side_kl's answer for widths[j] (2·layers values) for every j <= the
// larger of base[0], base[1] (the recipe's width indices of keys and values). For side s, each
// width j <= base[s] gets the factor kl[j][l·2+s] / Σ_h error[j]; wider ones the factor at base[s].
// Returns the factors (BitsAllocation::kl_scale's layout). Throws Error on a kl of the wrong
// size, a negative or non-finite KL, or a measured width whose errors sum to zero while its KL
// does not.
std::vector<double> weigh_by_kl(std::vector<SideSensitivity>& table, const std::vector<std::vector<double>>& kl,
                                const std::vector<int>& widths, const int base[2], int n_layers, int n_kv);

// The budget's measure of an artifact: effective_bits at `context`, or the quantised tier (mean
// of key and value history bits) when context is 0.
double budget_measure(const Artifact& artifact, int64_t context);

// Minimises Σ_i error[i][choice_i] subject to Σ_i weight[i]·widths[choice_i] <= capacity (exact,
// dynamic programming; ties keep the narrower width). Returns the choice index per item; throws
// Error when even the narrowest widths exceed the capacity.
std::vector<int> choose_widths(const std::vector<std::vector<double>>& error, const std::vector<int>& weight,
                               const std::vector<int>& widths, int64_t capacity);

// The sensitivity table of `options`' recipe on the stats' held-out rows (at most max_rows tokens
// per layer), and the artifacts compiled at each width (index as widths).
std::vector<SideSensitivity> measure_sensitivity(const Stats& stats, const CompileOptions& options,
                                                 const std::vector<int>& widths, int max_rows,
                                                 std::vector<Artifact>& compiled);

// compile_artifact with options.bits_budget > 0: every side of the result holds its chosen width
// (SideArtifact::bits) and the quantiser fitted at that width; the recipe records bits_budget,
// budget_context and bits_granularity in its params. `allocation`, when given, receives the table
// and the choice.
Artifact compile_with_budget(const Stats& stats, const CompileOptions& options, BitsAllocation* allocation = nullptr);

}  // namespace kvcc
