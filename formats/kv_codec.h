// THE semantics of every KV quantisation method kvcc compiles: quantise and dequantise one page of
// n token rows [n, d] of one (layer, KV head, key|value), given in the model's basis (post-RoPE
// keys, values), returning the dequantised rows in the model's basis. A pure codec: no fitting;
// the parameters come from an Artifact (compile fits them). The compiler's report, validation and
// the CPU reference of the cache use it; CUDA kernels must reproduce it (codes exactly, floats to
// rounding). docs/formats.md "Methods" repeats these semantics.
//
// Every method works in the rotated basis y = x·R (R = the side's rotation, float64 accumulation,
// rounded to float), quantises y, and returns ŷ·Rᵀ (float64 accumulation). Within the rotated row:
//
//   oscar, hadamard, identity, random (uniform grid, codec_scalar.h):
//       per row, per group of G = recipe.group (0: d) consecutive channels: thr = clip_threshold
//       (the ⌊clip_ratio·G⌋-th smallest |y|), quantize_uniform at B bits, fp16 scale and zero.
//       G > d (also oscar-lm): a group spans G/d KV heads of one token (roundtrip_layer_page).
//   oscar-lm (level table): per row and group, quantize_table with side.levels (2^B levels in RMS
//       units; fp16 RMS scale).
//   turboquant: Lloyd–Max level table on the randomly rotated row, like oscar-lm, but the groups
//       come from the outlier split: extras "split" = [n_hi] puts rotated coordinates [0, n_hi)
//       in a group coded with extras "outlier_levels" (B_hi bits) and [n_hi, d) in a group coded
//       with side.levels (B_lo bits); without a split one group of d. (The RMS scale of a group is
//       its norm/√G: the paper's stored norm.) Variant "prod" (recipe.params["variant"]): side.levels
//       are (B−1)-bit, and the residual ρ = y − ŷ_mse gets 1-bit QJL: s = sign(S·ρ) (sign(0) = +1),
//       γ = fp16(‖ρ‖), ŷ = ŷ_mse + √(π/2)/d · γ · Sᵀs, with S = extras "qjl_matrix" [d, d]
//       i.i.d. N(0,1) (applied in the rotated basis; S·Πᵀ is again i.i.d. Gaussian).
//   kivi (identity rotation, no clipping): keys per channel over groups of G_t = recipe.group
//       (0: the page) consecutive tokens of the page; values per token over groups of
//       G = recipe.group channels (0 or G >= d: the whole row); quantize_uniform with thr = +inf.
//       Param key_params=e5m3: each key pair in 2 bytes, not fp16's 4 (codec_scalar.h ChanParams:
//       an e5m3 scale and the zero in quarter steps, codes against them), as the CUDA kernels serve.
//       Mixed recipe (params "values" = hadamard | oscar): the keys as above; the value side is
//       coded as that grid method's value side (side_recipe): the side's rotation (H, or oscar's
//       value rotation), the stored clip ratio, per-token groups of head_dim.
//   kvarn (Hadamard rotation): the page is one tile, oriented [d, n] for keys (rows = channels)
//       and [n, d] for values (rows = tokens). Sinkhorn-style balancing on log standard
//       deviations (unbiased; clamped to [1e-3, 1e3]): repeat `iterations` (params, default 8)
//       times: column log-scales L_c += log std(columns), clipped to [−0.3, 10]; then row
//       log-scales L_r likewise; the iterate (including the unscaled start) with the smallest
//       max/min std ratio of columns plus that of rows is kept. Scales s = fp16(exp(L)); the
//       balanced tile C = T / s_r / s_c is quantised per row (quantize_uniform, no clip), and
//       T̂ = Ĉ · s_r · s_c.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "formats/artifact.h"

namespace kvcc {

enum class KvSide { Key = 0, Value = 1 };
const char* kv_side_name(KvSide side);

// The recipe whose codec codes `side` of `recipe`: the recipe itself, except that a mixed kivi
// recipe (params "values" = hadamard | oscar) codes its values as that grid method with group 0
// (= head_dim), the same value bits, value target and composition. Throws on another "values".
Recipe side_recipe(const Recipe& recipe, KvSide side);

// A kivi recipe's key pairs in 2 bytes (params "key_params" = e5m3; absent or fp16: fp16 pairs).
bool e5m3_key_pairs(const Recipe& recipe);

// Integer bits of a side's codes (key_bits / value_bits; for a turboquant split, the floor).
int side_code_bits(const Recipe& recipe, KvSide side);
// The same for one (layer, KV head) side: its own width (SideArtifact::bits, compile
// --bits-budget) when it has one, else the recipe's.
int side_code_bits(const Recipe& recipe, const SideArtifact& side, KvSide which);
double side_nominal_bits(const Recipe& recipe, KvSide side);

// x·R and x·Rᵀ for n rows of width d (R row-major [d, d]).
void rotate_rows(const std::vector<double>& rotation, int d, const float* rows, int n, float* out);
void unrotate_rows(const std::vector<double>& rotation, int d, const float* rows, int n, float* out);

// Quantise + dequantise n rows that are already in the rotated basis (no rotation applied).
// The compiler's fitting calls this to avoid rotating once per candidate.
void roundtrip_rotated(const Recipe& recipe, const SideArtifact& side, KvSide which, int d, const float* rotated, int n,
                       float* out);

// The full codec: rotate, quantise, dequantise, rotate back. rows and out are [n, d].
void roundtrip_page(const Recipe& recipe, const SideArtifact& side, KvSide which, int d, const float* rows, int n,
                    float* out);
std::vector<float> roundtrip_page(const Artifact& artifact, int layer, int kv_head, KvSide which, const float* rows,
                                  int n);

// All KV heads of one layer at once: rows and out are [n, n_kv * d] (token-major; KV head h holds
// channels [h*d, (h+1)*d)). Equal to roundtrip_page per head when the recipe's group is <= d.
// When recipe.group > d (a multiple of d dividing n_kv*d: small head_dim) one quantiser group spans
// group/d consecutive KV heads of the same token: each head is rotated by its own rotation, the
// rotated rows are quantised together per group, then each head is rotated back. The heads of a
// group must hold the same clip ratio / level table (compile stores the joint fit in each).
void roundtrip_layer_page(const Artifact& artifact, int layer, KvSide which, const float* rows, int n, float* out);

// KV heads per quantiser group: 1 when recipe.group <= d (and for kivi, whose group counts key
// tokens); group/d when it spans heads. Throws a clear error for a group that cannot span (a
// method whose traits say so, formats/method.h spans_heads, or not a multiple of d dividing n_kv*d).
int group_span(const Recipe& recipe, int d, int n_kv);

// turboquant's artifact checks (the method table's verify entry): per side, the stored outlier
// split agrees with the recipe's budget, outlier channels and levels fit it, the level tables have
// the sizes the bits give, and variant prod carries a [d, d] qjl_matrix.
std::vector<std::string> verify_turboquant(const Artifact& artifact);

// KVarN's balancing of one tile [rows, cols] (row-major): returns the fp16-rounded column and row
// scales of the most balanced iterate (semantics above).
struct BalanceScales {
  std::vector<float> col, row;
};
BalanceScales kvarn_balance(const float* tile, int rows, int cols, int iterations);
// max/min of the (unbiased) standard deviations of the columns plus that of the rows.
double std_imbalance(const float* tile, int rows, int cols);

// Bits per element averaged over K and V. nominal: the code bits alone (a turboquant split counts
// its fractional budget). effective: codes plus every fp16 scale, zero and norm, plus the BF16
// sink and recent tokens (recipe.sink + recipe.recent, 16 bits each) at context_len tokens: the
// published accounting (a sliding window of exactly sink + recent tokens; OSCAR's numbers).
// stored: the same for what the paged cache holds, whole pages (kv_layout.h quantised_tokens: the
// ring holds recent − page + 1 .. recent tokens, ~(page − 1)/2 fewer than the published count on
// average), the number to match when recipes differ in page size.
// Scales KVarN can fold (RTN scale into the balancing scale) are counted folded, as its fork stores them.
double nominal_bits(const Recipe& recipe);
double history_bits(const Recipe& recipe, KvSide which, int head_dim);  // quantised tier only
double effective_bits(const Recipe& recipe, int head_dim, int64_t context_len);
double stored_bits(const Recipe& recipe, int head_dim, int64_t context_len);
// An artifact's own accounting: with per-side widths (SideArtifact::bits) each (layer, KV head)
// side counts at its width, and these are means over them (every side holds the same number of
// elements); without, they equal the recipe's.
double nominal_bits(const Artifact& artifact);
double history_bits(const Artifact& artifact, KvSide which);
double effective_bits(const Artifact& artifact, int64_t context_len);
double stored_bits(const Artifact& artifact, int64_t context_len);
// Whether any side has a width of its own.
bool has_side_bits(const Artifact& artifact);

}  // namespace kvcc
