#include "runtime/forward.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <numbers>
#include <string>

#include "formats/error.h"

namespace kvcc {

namespace {

// y [T, out] = x [T, in] · Wᵀ (W [out, in], nn.Linear layout) + beta·y.
void linear(const float* x, int T, int in, const float* w, int out, float* y, float beta = 0.f) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, out, in, 1.f, x, in, w, in, beta, y, out);
}

// HF LlamaRMSNorm: x · rsqrt(mean(x²) + eps) · w, in float32 (the mean is accumulated in double,
// which only removes summation-order noise).
void rms_norm(const float* x, int rows, int n, int stride, const float* w, double eps, float* y,
              int out_stride) {
  for (int r = 0; r < rows; ++r) {
    const float* xr = x + size_t(r) * stride;
    float* yr = y + size_t(r) * out_stride;
    double sum_sq = 0;
    for (int i = 0; i < n; ++i) sum_sq += double(xr[i]) * xr[i];
    const float inv = float(1.0 / std::sqrt(sum_sq / n + eps));
    for (int i = 0; i < n; ++i) yr[i] = w[i] * (xr[i] * inv);
  }
}

void add_bias(float* y, int T, int n, const std::vector<float>& bias) {
  if (bias.empty()) return;
  for (int t = 0; t < T; ++t)
    for (int i = 0; i < n; ++i) y[size_t(t) * n + i] += bias[i];
}

std::vector<float> load_checked(const ModelFile& model, const std::string& name, size_t numel) {
  std::vector<float> v = model.tensor_f32(name);
  require(v.size() == numel, model.path() + ": tensor " + name + " has " + std::to_string(v.size()) +
                                 " elements, expected " + std::to_string(numel));
  return v;
}

}  // namespace

LayerWeights load_layer(const ModelFile& model, int layer) {
  const ModelConfig& c = model.config();
  require(layer >= 0 && layer < c.n_layers,
          "layer " + std::to_string(layer) + " out of range (model has " + std::to_string(c.n_layers) + ")");
  const std::string p = "model.layers." + std::to_string(layer) + ".";
  const size_t hidden = size_t(c.hidden), qdim = size_t(c.n_heads) * c.head_dim,
               kvdim = size_t(c.n_kv_heads) * c.head_dim, inter = size_t(c.intermediate);
  LayerWeights w;
  w.attn_norm = load_checked(model, p + "input_layernorm.weight", hidden);
  w.wq = load_checked(model, p + "self_attn.q_proj.weight", qdim * hidden);
  w.wk = load_checked(model, p + "self_attn.k_proj.weight", kvdim * hidden);
  w.wv = load_checked(model, p + "self_attn.v_proj.weight", kvdim * hidden);
  w.wo = load_checked(model, p + "self_attn.o_proj.weight", hidden * qdim);
  if (c.qkv_bias) {
    w.bq = load_checked(model, p + "self_attn.q_proj.bias", qdim);
    w.bk = load_checked(model, p + "self_attn.k_proj.bias", kvdim);
    w.bv = load_checked(model, p + "self_attn.v_proj.bias", kvdim);
  }
  if (c.qk_norm) {
    w.q_norm = load_checked(model, p + "self_attn.q_norm.weight", size_t(c.head_dim));
    w.k_norm = load_checked(model, p + "self_attn.k_norm.weight", size_t(c.head_dim));
  }
  w.mlp_norm = load_checked(model, p + "post_attention_layernorm.weight", hidden);
  w.w_gate = load_checked(model, p + "mlp.gate_proj.weight", inter * hidden);
  w.w_up = load_checked(model, p + "mlp.up_proj.weight", inter * hidden);
  w.w_down = load_checked(model, p + "mlp.down_proj.weight", hidden * inter);
  return w;
}

void apply_rope(const ModelConfig& c, float* x, int T, int n_heads, int pos0) {
  const int d = c.head_dim, half = d / 2;
  const std::vector<double> inv_freq_d = rope_inv_freq(c);
  // HF and llama2.c both form the angle as a float32 product position · inv_freq; doing the same
  // keeps long-position angles identical to theirs.
  std::vector<float> inv_freq(inv_freq_d.begin(), inv_freq_d.end());
  std::vector<float> cos_t(half), sin_t(half);
  const size_t row = size_t(n_heads) * d;
  for (int t = 0; t < T; ++t) {
    const float pos = float(pos0 + t);
    for (int i = 0; i < half; ++i) {
      const float angle = pos * inv_freq[i];
      cos_t[i] = float(std::cos(double(angle)));
      sin_t[i] = float(std::sin(double(angle)));
    }
    for (int h = 0; h < n_heads; ++h) {
      float* v = x + t * row + size_t(h) * d;
      for (int i = 0; i < half; ++i) {
        // rotate_half pairs (i, i + d/2); interleaved pairs (2i, 2i + 1).
        float& a = c.rope_style == RopeStyle::RotateHalf ? v[i] : v[2 * i];
        float& b = c.rope_style == RopeStyle::RotateHalf ? v[i + half] : v[2 * i + 1];
        const float x0 = a, x1 = b;
        a = x0 * cos_t[i] - x1 * sin_t[i];
        b = x1 * cos_t[i] + x0 * sin_t[i];
      }
    }
  }
}

void embed(const ModelFile& model, const int32_t* ids, int T, float* x) {
  const ModelConfig& c = model.config();
  for (int t = 0; t < T; ++t) {
    require(ids[t] >= 0 && ids[t] < c.vocab, "token id " + std::to_string(ids[t]) + " at position " +
                                                 std::to_string(t) + " is outside the vocabulary (" +
                                                 std::to_string(c.vocab) + ")");
    model.tensor_rows_f32("model.embed_tokens.weight", ids[t], 1, x + size_t(t) * c.hidden);
  }
}

void attention_qkv(const ModelConfig& c, const LayerWeights& w, const float* x, int T, int pos0,
                   float* q, float* key_pre, float* key, float* value) {
  if (T <= 0) return;  // BLAS rejects empty leading dimensions
  const int hidden = c.hidden, d = c.head_dim, qdim = c.n_heads * d, kvdim = c.n_kv_heads * d;
  std::vector<float> xn(size_t(T) * hidden);
  rms_norm(x, T, hidden, hidden, w.attn_norm.data(), c.rms_eps, xn.data(), hidden);
  linear(xn.data(), T, hidden, w.wq.data(), qdim, q);
  linear(xn.data(), T, hidden, w.wk.data(), kvdim, key);
  linear(xn.data(), T, hidden, w.wv.data(), kvdim, value);
  add_bias(q, T, qdim, w.bq);
  add_bias(key, T, kvdim, w.bk);
  add_bias(value, T, kvdim, w.bv);
  if (c.qk_norm) {  // Qwen3: RMSNorm over each head's d channels, before RoPE
    rms_norm(q, T * c.n_heads, d, d, w.q_norm.data(), c.rms_eps, q, d);
    rms_norm(key, T * c.n_kv_heads, d, d, w.k_norm.data(), c.rms_eps, key, d);
  }
  if (key_pre) std::copy(key, key + size_t(T) * kvdim, key_pre);
  apply_rope(c, q, T, c.n_heads, pos0);
  apply_rope(c, key, T, c.n_kv_heads, pos0);
}

void causal_attention(const ModelConfig& c, int T, const float* q, const float* key,
                      const float* value, float* out, AttentionObserver* observer,
                      const SequenceTaps* taps) {
  if (T <= 0) return;  // BLAS rejects empty leading dimensions
  const int d = c.head_dim, qdim = c.n_heads * d, kvdim = c.n_kv_heads * d, group = c.group();
  require(!observer || taps, "causal_attention: an observer needs the caller's SequenceTaps");
  if (observer) observer->on_qkv(*taps);
  const float scale = float(1.0 / std::sqrt(double(d)));
  std::vector<float> probs(size_t(T) * T);  // one head at a time: [T, T]
  std::vector<float> head_out(size_t(T) * d);
  for (int h = 0; h < c.n_heads; ++h) {
    const int kv = h / group;
    // scores = scale · Q_h K_kvᵀ (strided views into the [T, heads·d] rows)
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, T, d, scale, q + size_t(h) * d, qdim,
                key + size_t(kv) * d, kvdim, 0.f, probs.data(), T);
    for (int i = 0; i < T; ++i) {
      float* row = probs.data() + size_t(i) * T;
      float max_score = row[0];
      for (int j = 1; j <= i; ++j) max_score = std::max(max_score, row[j]);
      double sum = 0;
      for (int j = 0; j <= i; ++j) {
        row[j] = std::exp(row[j] - max_score);
        sum += row[j];
      }
      const float inv = float(1.0 / sum);
      for (int j = 0; j <= i; ++j) row[j] *= inv;
      std::fill(row + i + 1, row + T, 0.f);
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, T, d, T, 1.f, probs.data(), T,
                value + size_t(kv) * d, kvdim, 0.f, head_out.data(), d);
    for (int t = 0; t < T; ++t)
      std::copy(head_out.data() + size_t(t) * d, head_out.data() + size_t(t + 1) * d,
                out + size_t(t) * qdim + size_t(h) * d);
    if (observer) observer->on_probs(*taps, h, probs.data(), head_out.data());
  }
}

void attention_output_and_mlp(const ModelConfig& c, const LayerWeights& w, const float* attn, int T,
                              float* x) {
  if (T <= 0) return;  // BLAS rejects empty leading dimensions
  const int hidden = c.hidden, qdim = c.n_heads * c.head_dim, inter = c.intermediate;
  linear(attn, T, qdim, w.wo.data(), hidden, x, 1.f);  // residual: x += attn · Woᵀ
  std::vector<float> xn(size_t(T) * hidden);
  rms_norm(x, T, hidden, hidden, w.mlp_norm.data(), c.rms_eps, xn.data(), hidden);
  std::vector<float> gate(size_t(T) * inter), up(size_t(T) * inter);
  linear(xn.data(), T, hidden, w.w_gate.data(), inter, gate.data());
  linear(xn.data(), T, hidden, w.w_up.data(), inter, up.data());
  for (size_t i = 0; i < gate.size(); ++i) {
    const float g = gate[i];
    gate[i] = g / (1.f + std::exp(-g)) * up[i];  // SiLU(gate) · up
  }
  linear(gate.data(), T, inter, w.w_down.data(), hidden, x, 1.f);
}

void layer_forward(const ModelConfig& c, const LayerWeights& w, int layer, uint32_t doc, float* x,
                   int T, AttentionObserver* observer) {
  if (T <= 0) return;  // BLAS rejects empty leading dimensions
  const size_t qdim = size_t(c.n_heads) * c.head_dim, kvdim = size_t(c.n_kv_heads) * c.head_dim;
  std::vector<float> q(T * qdim), key(T * kvdim), value(T * kvdim), attn(T * qdim);
  std::vector<float> key_pre(observer ? T * kvdim : 0);
  attention_qkv(c, w, x, T, 0, q.data(), observer ? key_pre.data() : nullptr, key.data(), value.data());
  SequenceTaps taps;
  taps.layer = layer;
  taps.doc = doc;
  taps.T = T;
  taps.q = q.data();
  taps.key_pre = observer ? key_pre.data() : nullptr;
  taps.key = key.data();
  taps.value = value.data();
  causal_attention(c, T, q.data(), key.data(), value.data(), attn.data(), observer, &taps);
  attention_output_and_mlp(c, w, attn.data(), T, x);
}

void final_logits(const ModelFile& model, const float* x, int T, float* logits) {
  if (T <= 0) return;
  const ModelConfig& c = model.config();
  const int hidden = c.hidden, vocab = c.vocab;
  const std::vector<float> norm = load_checked(model, "model.norm.weight", size_t(hidden));
  std::vector<float> xn(size_t(T) * hidden);
  rms_norm(x, T, hidden, hidden, norm.data(), c.rms_eps, xn.data(), hidden);
  const std::string head = c.tied_embeddings ? "model.embed_tokens.weight" : "lm_head.weight";
  // The head is converted a block of vocabulary rows at a time, bounding memory for large vocabs.
  constexpr int kRowsPerBlock = 8192;
  std::vector<float> block(size_t(std::min(vocab, kRowsPerBlock)) * hidden);
  for (int r0 = 0; r0 < vocab; r0 += kRowsPerBlock) {
    const int rows = std::min(kRowsPerBlock, vocab - r0);
    model.tensor_rows_f32(head, r0, rows, block.data());
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, rows, hidden, 1.f, xn.data(), hidden,
                block.data(), hidden, 0.f, logits + r0, vocab);
  }
}

}  // namespace kvcc
