// CommVQ codebook training (research/commvq.md §3, DESIGN.md "CommVQ"), per (layer, KV head).
//
// Keys: pre-RoPE rows divided by their fp16 norm, residual additive quantisation trained stage by
// stage. Each stage runs EM on the current residuals:
//   E-step  squared distances to all K² centres t_a + i·t_b from one GEMM against [t; i·t]
//           (‖z‖² + gram_ab − 2⟨z,t_a⟩ − 2⟨z,i·t_b⟩), soft assignment softmax(−D/T) with the
//           temperature annealed exponentially from temp_start to temp_end (in units of the
//           current mean hard error, so it follows the residuals' shrinking scale);
//   M-step  the closed-form weighted least squares under the commutativity constraint: per stage
//           one K×K Hermitian system shared by all d/2 pairs,
//             H_kk = Σ_b n_kb + Σ_a n_ak,  H_kl = i·(n_kl − n_lk),
//             rhs_kj = Σ_b S_kb,j − i·Σ_a S_ak,j
//           (n the soft counts, S the soft-weighted sums; the sums only need the two marginals of
//           the assignment, so they are two GEMMs [K, n]·[n, d]).
//   The iterate with the lowest hard (greedy) error is kept, starting from the all-zero codebook,
//   so a stage never increases the training error. Residuals for the next stage come from the
//   codec's greedy assignment, exactly what encoding does.
// Values: optionally rotated rows divided by their fp16 norm, residual VQ, each stage k-means
// (hard EM) from seeded random rows, keeping the best iterate.
//
// Deterministic for a seed (independent of the thread count).
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "formats/artifact.h"
#include "formats/codec_commvq.h"
#include "formats/stats.h"

namespace kvcc {

struct CommvqBudget {
  int key_stages = 0;
  int key_half_bits = 0;  // K = 2^h parameters per pair; key codes have 2h bits
  int value_stages = 0;
  int value_code_bits = 0;
};

// Presets for 1 or 2 bits per element at head_dim d: key codes of 12 bits (K = 64, the paper's
// choice) when the per-token budget bits·d is at least 96 bits, else 8 bits (K = 16), else the
// largest even count that fits; stages = round(bits·d / code bits), at least 1 (d = 128: 11 and
// 21 stages, 1.03 and 1.97 nominal bits). Values: 8-bit codes (256 codewords), stages =
// round(bits·d / 8). Throws Error unless bits is 1 or 2.
CommvqBudget commvq_budget(int bits, int d);

struct CommvqTrainOptions {
  CommvqBudget budget;
  int iterations = 30;        // EM iterations per stage at most
  int patience = 6;           // stop a stage after this many iterations without a better hard error
  double temp_start = 0.03;   // soft-assignment temperature / current mean hard error, first iteration
  double temp_end = 0.0003;   // ... last iteration
  int value_iterations = 20;  // k-means iterations per value stage at most
  uint64_t seed = 0;
  size_t max_rows = 0;                               // train on a seeded subsample of at most this many rows (0: all)
  int threads = 0;                                   // E-step worker threads (0: hardware concurrency)
  std::function<void(const std::string&)> progress;  // one line per stage; may be empty
};

// Mean squared error of the normalised rows (‖x/n − x̂/n‖², i.e. squared relative error).
struct CommvqStageReport {
  double error_before = 0;              // residual energy entering the stage
  std::vector<double> iteration_error;  // hard error of each EM iterate
  int best_iteration = -1;              // -1: the all-zero codebook was kept
  double error_after = 0;               // after greedy encoding with the kept codebook
  double seconds = 0;
};

// key_pre: [n, d] pre-RoPE keys in model layout.
CommvqKeyCodebook train_commvq_keys(const float* key_pre, size_t n, int d, RopeStyle style,
                                    const CommvqTrainOptions& options,
                                    std::vector<CommvqStageReport>* report = nullptr);
// value: [n, d]; rotation: [d, d] (x_rot = x·R) or empty.
CommvqValueCodebook train_commvq_values(const float* value, size_t n, int d, const std::vector<double>& rotation,
                                        const CommvqTrainOptions& options,
                                        std::vector<CommvqStageReport>* report = nullptr);

// ---- `kvcc compile --method commvq` ----
//
// Recipe params (docs/formats.md "commvq"), filled from commvq_budget(key_bits / value_bits,
// head_dim) unless given: key_stages, key_code_bits (even), value_stages, value_code_bits,
// iterations (EM iterations per stage, default 20), max_rows (training rows per head, 0 = all
// fitting rows); written back: key_bits_nominal, key_bits_effective, value_bits_nominal,
// value_bits_effective (codes + the fp16 norm per token; kv_codec's history_bits reads them).
// Throws Error on inconsistent params.
void commvq_fill_recipe(Recipe& recipe, int head_dim);

// Trains one (layer, KV head) on the reservoir's fitting rows (pre-RoPE keys, values; held-out
// rows never) and stores codebooks and identity rotations in `out` (commvq_store). Single-threaded
// (compile_artifact runs layers in parallel); the seed is derived from recipe.seed, layer and head.
void compile_commvq_head(const Reservoir& reservoir, const Recipe& recipe, RopeStyle style, int layer, int h,
                         HeadArtifact& out);

// Reconstructions of a reservoir's held-out (or fitting) rows, selected as compile/fit.h's
// select_rows does (in reservoir order, at most max_rows): post-RoPE keys RoPE_m(decode(encode(k_pre)))
// at each row's position, and values. inv_freq: runtime's rope_inv_freq of the model.
void commvq_reservoir_roundtrip(const Artifact& artifact, int layer, int h, const Reservoir& reservoir, bool heldout,
                                int max_rows, const std::vector<double>& inv_freq, std::vector<float>& key_out,
                                std::vector<float>& value_out);

}  // namespace kvcc
