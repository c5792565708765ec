// CPU reference of CommVQ attention over encoded keys and values (formats/codec_commvq.h), without
// decoding keys: for a post-RoPE query q and a key encoded at position m,
//   q·RoPE_m(k̂) = n · Σ_j Re( e^{i·m·ω_j} · Σ_r (Z_{r,a_r,j} + i·Z_{r,b_r,j}) ),
//   Z_{r,k,j} = conj(q_j)·t_{r,k,j}   (the per-query table, independent of the context length),
// with q_j, t in the model's RoPE pair convention and ω_j from rope_inv_freq (llama3 scaling
// included). Values: Σ_t p_t·v̂_t = (Σ_{r,c} w_{r,c}·W_{r,c})·Rᵀ with per-code weights
// w_{r,c} = Σ_{t: code_{t,r} = c} p_t·n_t, so each codeword is read once per query.
#pragma once
#include <cstdint>
#include <vector>

#include "formats/codec_commvq.h"

namespace kvcc {

struct CommvqQueryTable {
  int d = 0, stages = 0, K = 0;
  std::vector<float> z;  // [stages, K, d/2, 2]: conj(q_j)·t_{r,k,j} as (re, im)
};

// q: [d] post-RoPE query in model layout.
CommvqQueryTable commvq_query_table(const CommvqKeyCodebook& cb, const float* q);

// scores[i] = q·RoPE_{positions[i]}(decode(keys row i)), without the 1/√d scale.
// inv_freq: [d/2] RoPE inverse frequencies (rope_inv_freq of the model).
void commvq_scores(const CommvqQueryTable& table, const std::vector<double>& inv_freq, const CommvqEncoded& keys,
                   const int32_t* positions, float* scores);

// out [d] (model basis) = Σ_t p[t]·v̂_t over the encoded values.
void commvq_weighted_values(const CommvqValueCodebook& cb, const CommvqEncoded& values, const float* p, float* out);

// One query's attention over an encoded sequence: softmax(scale·scores) then the weighted values.
// out: [d]. Throws Error when keys and values disagree in length.
void commvq_attend(const CommvqCodec& codec, const std::vector<double>& inv_freq, const float* q,
                   const CommvqEncoded& keys, const int32_t* positions, const CommvqEncoded& values, float scale,
                   float* out);

}  // namespace kvcc
