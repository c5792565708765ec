// CPU reference of the attention kernels (same semantics as runtime/decode.cu and prefill.cu),
// accumulated in float64: the query rotated by R_k, attention over the cache as stored (BF16
// sink and ring, INT2 history decoded by codec_scalar.h), the output rotated back by R_vᵀ.
#pragma once
#include <cstdint>
#include <vector>

#include "formats/kv_layout.h"
#include "runtime/kv_cache.h"

namespace kvcc {

// The rotated keys and values one layer of a sequence holds, decoded to float, in logical order
// (sink, history, ring): [length, n_kv, d] each. The cache must be a host pool. length: the
// sequence's length (-1: cache.length(seq)); a shorter one reads the cache as it was before a
// grow whose tokens this layer has not been given yet (prefill inside a step).
void gather_sequence(const KvCache& cache, int layer, int seq, const HeadCodec* codecs, std::vector<float>& keys,
                     std::vector<float>& values, int64_t length = -1);

// Decode attention: one query per sequence. q: [batch, n_heads, d] post-RoPE, unrotated;
// out: [batch, n_heads, d]. rot_k, rot_v: [n_kv, d, d] (null: identity). sm_scale: the softmax
// scale (1/sqrt(d) usually). An empty sequence gives a zero output.
void decode_ref(const KvCache& cache, int layer, const std::vector<int>& seqs, const float* q, int n_heads,
                const float* rot_k, const float* rot_v, const HeadCodec* codecs, float sm_scale, float* out);

// Prefill/extend attention for one sequence: T new tokens at positions length..length+T-1 attend
// causally to the cache as stored and to the new tokens themselves (rotated, BF16-rounded, as
// the ring will hold them). q: [T, n_heads, d]; k, v: [T, n_kv, d] unrotated; out [T, n_heads, d].
// Does not modify the cache: append the new tokens afterwards. length: as in gather_sequence.
void prefill_ref(const KvCache& cache, int layer, int seq, int T, const float* q, const float* k, const float* v,
                 int n_heads, const float* rot_k, const float* rot_v, const HeadCodec* codecs, float sm_scale,
                 float* out, int64_t length = -1);

// Attention-based token scores (SnapKV's observation window, over the cache as stored): the W
// queries of the sequence's last W tokens (positions n−W..n−1, already in the cache) attend
// causally to its n tokens; scores[h][j] = Σ over those queries and KV head h's query heads of
// the softmax weight on position j. q: [W, n_heads, d] post-RoPE, unrotated; scores: [n_kv, n]
// (n = cache.length(seq)). Each query's weights sum to 1, so each head's scores sum to W·r.
void attention_scores_ref(const KvCache& cache, int layer, int seq, int W, const float* q, int n_heads,
                          const float* rot_k, const HeadCodec* codecs, float sm_scale, float* scores);

}  // namespace kvcc
