// The model's layer operations on the CPU (OpenBLAS for every matrix product): what calibration
// streams layer by layer and what validation runs block by block over a quantised cache.
// Activations are row-major, one row per token: float32, or double for validation's exact check.
#pragma once
#include <cstdint>
#include <type_traits>
#include <vector>

#include "formats/model_config.h"
#include "formats/model_file.h"
#include "model/observer.h"

namespace kvcc {

// One decoder layer's weights (empty vectors for tensors the architecture lacks). Scalar is
// float32 for every computation except validation's exact-check mode, which widens the float
// weights to double (exactly) and runs the same operations in double.
template <typename Scalar>
struct BasicLayerWeights {
  std::vector<Scalar> attn_norm;             // [hidden]
  std::vector<Scalar> wq, wk, wv, wo;        // [n_heads*d, hidden], [n_kv*d, hidden] x2, [hidden, n_heads*d]
  std::vector<Scalar> bq, bk, bv;            // Qwen2 biases
  std::vector<Scalar> q_norm, k_norm;        // Qwen3 per-head RMSNorm weights [d]
  std::vector<Scalar> mlp_norm;              // [hidden]
  std::vector<Scalar> w_gate, w_up, w_down;  // [inter, hidden] x2, [hidden, inter]
};
using LayerWeights = BasicLayerWeights<float>;
// One layer's weights as float, or widened to double (exactly: every float is a double).
template <typename Scalar = float>
BasicLayerWeights<Scalar> load_layer(const ModelFile&, int layer);

// The functions below are defined for Scalar = float and double. Both run the same operations
// (cblas_sgemm / cblas_dgemm, softmax and norms in the same order); double differs only in the
// precision of every product and sum, which makes results independent of GEMM blocking to ~1e-15.

// Applies RoPE in place to x [T, n_heads * d] at positions pos0..pos0+T-1 in the model's pair
// convention (rotate_half or interleaved). The angle is the float32 product position · inv_freq
// (as HF forms it) in both precisions; cos/sin are rounded to Scalar.
template <typename Scalar>
void apply_rope(const ModelConfig&, Scalar* x, int T, int n_heads, int pos0);

// Embedding lookup: ids [T] -> x [T, hidden]. Throws Error on an id outside the vocabulary.
template <typename Scalar>
void embed(const ModelFile&, const int32_t* ids, int T, Scalar* x);

// Input RMSNorm, q/k/v projections (+bias), q/k norm, RoPE. x [T, hidden] is not modified.
// Outputs: q [T, n_heads*d] post-RoPE; key_pre [T, n_kv*d] pre-RoPE (may be null); key and
// value [T, n_kv*d].
template <typename Scalar>
void attention_qkv(const ModelConfig&, const BasicLayerWeights<Scalar>&, const Scalar* x, int T, int pos0, Scalar* q,
                   std::type_identity_t<Scalar>* key_pre, Scalar* key, Scalar* value);

// Causal attention (GQA) of T queries at positions n0..n0+T-1 over keys/values [n0 + T, n_kv*d]
// (positions 0..n0+T-1): query i sees keys 0..n0+i. out [T, n_heads*d]. Validation's blocks
// attend to their cache this way; with n0 = 0 it is causal_attention.
template <typename Scalar>
void prefix_causal_attention(const ModelConfig&, int64_t n0, int T, const Scalar* q, const Scalar* key,
                             const Scalar* value, Scalar* out);

// Full-precision causal attention of one sequence (GQA), out [T, n_heads*d]. When `observer` is
// given (float only: calibration's statistics are float) it is called with `taps` (whose
// q/key/value/key_pre the caller filled) as observer.h says.
template <typename Scalar>
void causal_attention(const ModelConfig&, int T, const Scalar* q, const Scalar* key, const Scalar* value, Scalar* out,
                      AttentionObserver* observer = nullptr, const SequenceTaps* taps = nullptr);

// o_proj + residual, then post-attention RMSNorm, SwiGLU MLP + residual, in place on x [T, hidden].
template <typename Scalar>
void attention_output_and_mlp(const ModelConfig&, const BasicLayerWeights<Scalar>&, const Scalar* attn, int T,
                              Scalar* x);

// One whole decoder layer on one sequence (positions 0..T-1), in place on x.
template <typename Scalar>
void layer_forward(const ModelConfig&, const BasicLayerWeights<Scalar>&, int layer, uint32_t doc, Scalar* x, int T,
                   AttentionObserver* observer = nullptr);

// Final RMSNorm and LM head (tied or not): x [T, hidden] -> logits [T, vocab].
template <typename Scalar>
void final_logits(const ModelFile&, const Scalar* x, int T, Scalar* logits);

}  // namespace kvcc
