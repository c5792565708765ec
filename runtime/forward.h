// The model's layer operations on the CPU (OpenBLAS for every matrix product): what calibration
// streams layer by layer and what validation runs block by block over a quantised cache.
// Activations are float32, row-major, one row per token.
#pragma once
#include <cstdint>
#include <vector>

#include "formats/model_config.h"
#include "formats/model_file.h"
#include "runtime/observer.h"

namespace kvcc {

// One decoder layer's weights as float32 (empty vectors for tensors the architecture lacks).
struct LayerWeights {
  std::vector<float> attn_norm;                  // [hidden]
  std::vector<float> wq, wk, wv, wo;             // [n_heads*d, hidden], [n_kv*d, hidden] x2, [hidden, n_heads*d]
  std::vector<float> bq, bk, bv;                 // Qwen2 biases
  std::vector<float> q_norm, k_norm;             // Qwen3 per-head RMSNorm weights [d]
  std::vector<float> mlp_norm;                   // [hidden]
  std::vector<float> w_gate, w_up, w_down;       // [inter, hidden] x2, [hidden, inter]
};
LayerWeights load_layer(const ModelFile&, int layer);

// Applies RoPE in place to x [T, n_heads * d] at positions pos0..pos0+T-1 in the model's pair
// convention (rotate_half or interleaved).
void apply_rope(const ModelConfig&, float* x, int T, int n_heads, int pos0);

// Embedding lookup: ids [T] -> x [T, hidden]. Throws Error on an id outside the vocabulary.
void embed(const ModelFile&, const int32_t* ids, int T, float* x);

// Input RMSNorm, q/k/v projections (+bias), q/k norm, RoPE. x [T, hidden] is not modified.
// Outputs: q [T, n_heads*d] post-RoPE; key_pre [T, n_kv*d] pre-RoPE (may be null); key and
// value [T, n_kv*d].
void attention_qkv(const ModelConfig&, const LayerWeights&, const float* x, int T, int pos0,
                   float* q, float* key_pre, float* key, float* value);

// Full-precision causal attention of one sequence (GQA), out [T, n_heads*d]. When `observer` is
// given it is called with `taps` (whose q/key/value/key_pre the caller filled) as observer.h says.
void causal_attention(const ModelConfig&, int T, const float* q, const float* key,
                      const float* value, float* out, AttentionObserver* observer = nullptr,
                      const SequenceTaps* taps = nullptr);

// o_proj + residual, then post-attention RMSNorm, SwiGLU MLP + residual, in place on x [T, hidden].
void attention_output_and_mlp(const ModelConfig&, const LayerWeights&, const float* attn, int T,
                              float* x);

// One whole decoder layer on one sequence (positions 0..T-1), in place on x.
void layer_forward(const ModelConfig&, const LayerWeights&, int layer, uint32_t doc, float* x,
                   int T, AttentionObserver* observer = nullptr);

// Final RMSNorm and LM head (tied or not): x [T, hidden] -> logits [T, vocab].
void final_logits(const ModelFile&, const float* x, int T, float* logits);

}  // namespace kvcc
