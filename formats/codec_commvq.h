// The CommVQ codec (research/commvq.md, DESIGN.md "CommVQ"): codebooks plus their configuration as
// a value type, with encode/decode of keys and values. Training lives in compile/commvq.h, the
// score-without-decoding CPU reference in runtime/commvq_score.h.
//
// Keys (pre-RoPE, one KV head): x is divided by its L2 norm n = fp16(‖x‖) (stored per token), then
// quantised by residual additive quantisation over R stages. A vector is viewed as d/2 complex
// numbers, one per RoPE pair j in the model's pair convention (z_j = x_re + i·x_im with
// (re, im) = (j, j + d/2) for rotate_half, (2j, 2j+1) for interleaved). Stage r has K = 2^h
// complex parameters t_{r,k,j} per pair; its K² centres are
//     c_{r,(a,b),j} = t_{r,a,j} + i·t_{r,b,j}        code = a·K + b  (2h bits)
// i.e. the sum of the first column of the 2×2 block [[x,−y],[y,x]] of t_a and the second of t_b.
// Every centre is a per-pair complex multiple, so RoPE at position m (z_j ↦ e^{i·m·ω_j}·z_j)
// commutes with decoding: RoPE_m(decode(codes)) = decode with every t rotated by m·ω_j. Decode:
// x̂ = n · Σ_r c_{r,code_r}. Greedy encode: per stage the nearest centre to the residual.
//
// Values (one KV head): optionally rotated (x_rot = x·R, R orthogonal), divided by the fp16 norm,
// residual VQ over R stages of 2^b dense codewords [d] each (in the rotated basis), greedy encode;
// decode x̂ = n · (Σ_r w_{r,code_r}) · Rᵀ.
//
// Stored per token: R codes (key: 2h bits, value: b bits) + one fp16 norm; effective bits per
// element (R·bits + 16) / d. In an artifact (docs/formats.md, method "commvq") the key side's
// extras hold `commvq_codebooks` [R, K, d/2, 2] (the t parameters, pair order) and the value side's
// `commvq_codebooks` [R, 2^b, d].
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "formats/artifact.h"
#include "formats/model_config.h"

namespace kvcc {

// Model channel holding the real (part 0) or imaginary (part 1) component of RoPE pair j.
inline int commvq_pair_channel(RopeStyle style, int d, int j, int part) {
  return style == RopeStyle::RotateHalf ? j + part * (d / 2) : 2 * j + part;
}
// Model layout x [d] -> pair layout z [d] (z[2j] = re, z[2j+1] = im), and back.
void commvq_to_pairs(RopeStyle style, int d, const float* x, float* z);
void commvq_from_pairs(RopeStyle style, int d, const float* z, float* x);

struct CommvqKeyCodebook {
  int d = 0;          // head_dim (even)
  int stages = 0;     // R
  int half_bits = 0;  // h: K = 2^h parameters per pair and stage, codes of 2h bits
  RopeStyle rope_style = RopeStyle::RotateHalf;
  std::vector<float> params;  // [R, K, d/2, 2]: t_{r,k,j} = (re, im), pair layout

  int n_params() const { return 1 << half_bits; }
  int n_codes() const { return 1 << (2 * half_bits); }
  int code_bits() const { return 2 * half_bits; }
  const float* stage(int r) const { return params.data() + size_t(r) * size_t(n_params()) * size_t(d); }
  float* stage(int r) { return params.data() + size_t(r) * size_t(n_params()) * size_t(d); }
  void check() const;  // throws Error when the shape is inconsistent
};

struct CommvqValueCodebook {
  int d = 0;
  int stages = 0;
  int code_bits = 0;             // b: 2^b codewords per stage
  std::vector<float> codewords;  // [R, 2^b, d] in the rotated basis
  std::vector<double> rotation;  // [d, d] row-major, x_rot = x·R; empty = identity

  int n_codes() const { return 1 << code_bits; }
  const float* stage(int r) const { return codewords.data() + size_t(r) * size_t(n_codes()) * size_t(d); }
  float* stage(int r) { return codewords.data() + size_t(r) * size_t(n_codes()) * size_t(d); }
  void check() const;
};

struct CommvqCodec {
  CommvqKeyCodebook key;
  CommvqValueCodebook value;
};

// Bits per element: nominal counts the codes only, effective adds the fp16 norm.
inline double commvq_nominal_bits(int stages, int code_bits, int d) {
  return double(stages) * double(code_bits) / double(d);
}
inline double commvq_effective_bits(int stages, int code_bits, int d) {
  return (double(stages) * double(code_bits) + 16.0) / double(d);
}

// Encoded rows of one KV head: codes [n, stages] and fp16 norms [n].
struct CommvqEncoded {
  size_t n = 0;
  int stages = 0;
  std::vector<uint16_t> codes;
  std::vector<uint16_t> norms;  // fp16 bits
};

// Per-stage tables of the key centres' structure: i·t [K, d] (pair layout) and the Gram term
// gram[a·K + b] = ‖t_a + i·t_b‖². Distances are then ‖z‖² + gram_ab − 2⟨z,t_a⟩ − 2⟨z,i·t_b⟩.
void commvq_key_stage_tables(const float* stage_params, int K, int d, float* i_times_t, float* gram);

// One greedy stage: for residuals z [n, d] (pair layout) the nearest centre of stage r (lowest
// code on ties) and, when dist2 is given, its squared distance. Shared by encoding and training,
// so both choose the same code.
void commvq_key_assign(const CommvqKeyCodebook& cb, int r, const float* z, size_t n, uint16_t* code,
                       float* dist2 = nullptr);
// Adds (sign = +1) or subtracts (sign = -1) the centre of `code` at stage r to z [d] (pair layout).
void commvq_key_add_centre(const CommvqKeyCodebook& cb, int r, uint16_t code, float sign, float* z);
void commvq_value_assign(const CommvqValueCodebook& cb, int r, const float* x, size_t n, uint16_t* code,
                         float* dist2 = nullptr);

// Keys: x [n, d] pre-RoPE in model layout. Throws Error on non-finite input.
CommvqEncoded commvq_encode_keys(const CommvqKeyCodebook& cb, const float* x, size_t n);
void commvq_decode_keys(const CommvqKeyCodebook& cb, const CommvqEncoded& enc, float* x);
// Values: x [n, d] in model basis (the rotation is applied inside).
CommvqEncoded commvq_encode_values(const CommvqValueCodebook& cb, const float* x, size_t n);
void commvq_decode_values(const CommvqValueCodebook& cb, const CommvqEncoded& enc, float* x);

// Quantise + dequantise keys the way a cache holding them at `positions` sees them: rows are
// pre-RoPE (rows_post_rope false) or post-RoPE (true: un-rotated by −m first); the output is the
// post-RoPE reconstruction RoPE_m(decode(encode(k_pre))) [n, d]. inv_freq: [d/2] RoPE inverse
// frequencies (runtime's rope_inv_freq); angles are float32 products m·ω as apply_rope forms them.
void commvq_roundtrip_keys(const CommvqKeyCodebook& cb, const float* rows, const int32_t* positions, size_t n,
                           const std::vector<double>& inv_freq, bool rows_post_rope, float* out);
// Quantise + dequantise values [n, d] (model basis in and out).
void commvq_roundtrip_values(const CommvqValueCodebook& cb, const float* rows, size_t n, float* out);

// fp16 norm of a row, and the divisor used for normalising (0 for a zero row). Throws Error when the
// row is not finite or its norm overflows fp16.
uint16_t commvq_row_norm(const float* x, int d, const char* what);

// Artifact glue. Stores the codebooks as extras (and identity/given rotations) in one head's sides;
// loads them back (checking shapes against the artifact's head_dim and rope style).
void commvq_store(const CommvqCodec& codec, SideArtifact& key, SideArtifact& value);
CommvqCodec commvq_load(const Artifact& artifact, int layer, int kv_head);
// One side's codebook from its extras (Error naming the problem when missing or misshapen). The
// value codebook carries the side's rotation unless it is the identity or with_rotation is false
// (for rows already in the rotated basis).
CommvqKeyCodebook commvq_key_codebook(const SideArtifact& key, int d, RopeStyle style);
CommvqValueCodebook commvq_value_codebook(const SideArtifact& value, int d, bool with_rotation);
// Problems with a commvq artifact (missing or misshapen codebooks, non-finite values, recipe params
// that disagree with the shapes); empty when sound. The method table's verify entry for commvq
// (formats/method.h), so verify_artifact appends these.
std::vector<std::string> verify_commvq(const Artifact& artifact);
// One line per commvq artifact for `inspect` (the table's describe entry): stages, code bits,
// nominal and effective bits per side.
std::string describe_commvq(const Artifact& artifact);

}  // namespace kvcc
