// The hook through which calibration watches the forward pass without runtime depending on it.
// The forward pass (model/forward.h) calls an observer, when given one, for every sequence and
// layer; calibrate/ implements it to accumulate statistics.
#pragma once
#include <cstdint>

namespace kvcc {

struct SequenceTaps {
  int layer = 0;
  uint32_t doc = 0;                // document index in the calibration text (stable across ranks)
  int T = 0;                       // tokens in this sequence; positions are 0..T-1
  const float* q = nullptr;        // [T, n_heads * d] post-RoPE queries (after q_norm, with bias)
  const float* key_pre = nullptr;  // [T, n_kv_heads * d] keys before RoPE (after k_norm, with bias)
  const float* key = nullptr;      // [T, n_kv_heads * d] post-RoPE keys
  const float* value = nullptr;    // [T, n_kv_heads * d]
};

class AttentionObserver {
 public:
  virtual ~AttentionObserver() = default;
  // Once per (sequence, layer), before attention.
  virtual void on_qkv(const SequenceTaps& taps) = 0;
  // Once per query head of that sequence and layer, after its causal softmax:
  // probs [T, T] row-major (row i holds p_i0..p_ii, zeros above the diagonal) and the head's
  // output o = probs · V [T, d].
  virtual void on_probs(const SequenceTaps& taps, int q_head, const float* probs, const float* output) = 0;
};

}  // namespace kvcc
