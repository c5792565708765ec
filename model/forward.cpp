#include "model/forward.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <numbers>
#include <string>

#include "formats/error.h"

namespace kvcc {

namespace {

// C [M, N] = alpha · A [M, K] · op(B) + beta · C, row-major; op(B) = Bᵀ when trans_b (B [N, K]).
void gemm(bool trans_b, int M, int N, int K, float alpha, const float* A, int lda, const float* B, int ldb, float beta,
          float* C, int ldc) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, M, N, K, alpha, A, lda, B, ldb, beta, C,
              ldc);
}
void gemm(bool trans_b, int M, int N, int K, double alpha, const double* A, int lda, const double* B, int ldb,
          double beta, double* C, int ldc) {
  cblas_dgemm(CblasRowMajor, CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, M, N, K, alpha, A, lda, B, ldb, beta, C,
              ldc);
}

// y [T, out] = x [T, in] · Wᵀ (W [out, in], nn.Linear layout) + beta·y.
template <typename S>
void linear(const S* x, int T, int in, const S* w, int out, S* y, S beta = S(0)) {
  gemm(true, T, out, in, S(1), x, in, w, in, beta, y, out);
}

// HF LlamaRMSNorm: x · rsqrt(mean(x²) + eps) · w, in Scalar (the mean is accumulated in double,
// which only removes summation-order noise).
template <typename S>
void rms_norm(const S* x, int rows, int n, int stride, const S* w, double eps, S* y, int out_stride) {
  for (int r = 0; r < rows; ++r) {
    const S* xr = x + size_t(r) * stride;
    S* yr = y + size_t(r) * out_stride;
    double sum_sq = 0;
    for (int i = 0; i < n; ++i) sum_sq += double(xr[i]) * xr[i];
    const S inv = S(1.0 / std::sqrt(sum_sq / n + eps));
    for (int i = 0; i < n; ++i) yr[i] = w[i] * (xr[i] * inv);
  }
}

template <typename S>
void add_bias(S* y, int T, int n, const std::vector<S>& bias) {
  if (bias.empty()) return;
  for (int t = 0; t < T; ++t)
    for (int i = 0; i < n; ++i) y[size_t(t) * n + i] += bias[i];
}

// Refuses a NaN or infinite weight, naming the tensor: it would spread through every later
// activation into statistics that kvcc's own readers then reject.
void require_finite(const ModelFile& model, const std::string& name, const float* v, size_t n, size_t offset = 0) {
  for (size_t i = 0; i < n; ++i)
    if (!std::isfinite(v[i]))
      throw Error(model.path() + ": tensor " + name + " holds a non-finite value (" + std::to_string(v[i]) +
                  " at element " + std::to_string(offset + i) + ")");
}

template <typename S>
std::vector<S> load_checked(const ModelFile& model, const std::string& name, size_t numel) {
  std::vector<float> v = model.tensor_f32(name);
  KVCC_REQUIRE(v.size() == numel, model.path() + ": tensor " + name + " has " + std::to_string(v.size()) +
                                      " elements, expected " + std::to_string(numel));
  require_finite(model, name, v.data(), v.size());
  if constexpr (std::is_same_v<S, float>) return v;
  else return std::vector<S>(v.begin(), v.end());
}

}  // namespace

template <typename S>
BasicLayerWeights<S> load_layer(const ModelFile& model, int layer) {
  const ModelConfig& c = model.config();
  KVCC_REQUIRE(layer >= 0 && layer < c.n_layers,
               "layer " + std::to_string(layer) + " out of range (model has " + std::to_string(c.n_layers) + ")");
  const std::string p = "model.layers." + std::to_string(layer) + ".";
  const size_t hidden = size_t(c.hidden), qdim = size_t(c.n_heads) * c.head_dim,
               kvdim = size_t(c.n_kv_heads) * c.head_dim, inter = size_t(c.intermediate);
  auto load = [&](const std::string& name, size_t numel) { return load_checked<S>(model, p + name, numel); };
  BasicLayerWeights<S> w;
  w.attn_norm = load("input_layernorm.weight", hidden);
  w.wq = load("self_attn.q_proj.weight", qdim * hidden);
  w.wk = load("self_attn.k_proj.weight", kvdim * hidden);
  w.wv = load("self_attn.v_proj.weight", kvdim * hidden);
  w.wo = load("self_attn.o_proj.weight", hidden * qdim);
  if (c.qkv_bias) {
    w.bq = load("self_attn.q_proj.bias", qdim);
    w.bk = load("self_attn.k_proj.bias", kvdim);
    w.bv = load("self_attn.v_proj.bias", kvdim);
  }
  if (c.qk_norm) {
    w.q_norm = load("self_attn.q_norm.weight", size_t(c.head_dim));
    w.k_norm = load("self_attn.k_norm.weight", size_t(c.head_dim));
  }
  w.mlp_norm = load("post_attention_layernorm.weight", hidden);
  w.w_gate = load("mlp.gate_proj.weight", inter * hidden);
  w.w_up = load("mlp.up_proj.weight", inter * hidden);
  w.w_down = load("mlp.down_proj.weight", hidden * inter);
  return w;
}
template BasicLayerWeights<float> load_layer<float>(const ModelFile&, int);
template BasicLayerWeights<double> load_layer<double>(const ModelFile&, int);

template <typename S>
void apply_rope(const ModelConfig& c, S* x, int T, int n_heads, int pos0) {
  const int d = c.head_dim, half = d / 2;
  const std::vector<double> inv_freq_d = rope_inv_freq(c);
  // HF and llama2.c both form the angle as a float32 product position · inv_freq; doing the same
  // keeps long-position angles identical to theirs.
  std::vector<float> inv_freq(inv_freq_d.begin(), inv_freq_d.end());
  std::vector<S> cos_t(half), sin_t(half);
  const size_t row = size_t(n_heads) * d;
  for (int t = 0; t < T; ++t) {
    const float pos = float(pos0 + t);
    for (int i = 0; i < half; ++i) {
      const float angle = pos * inv_freq[i];
      cos_t[i] = S(std::cos(double(angle)));
      sin_t[i] = S(std::sin(double(angle)));
    }
    for (int h = 0; h < n_heads; ++h) {
      S* v = x + t * row + size_t(h) * d;
      for (int i = 0; i < half; ++i) {
        // rotate_half pairs (i, i + d/2); interleaved pairs (2i, 2i + 1).
        S& a = c.rope_style == RopeStyle::RotateHalf ? v[i] : v[2 * i];
        S& b = c.rope_style == RopeStyle::RotateHalf ? v[i + half] : v[2 * i + 1];
        const S x0 = a, x1 = b;
        a = x0 * cos_t[i] - x1 * sin_t[i];
        b = x1 * cos_t[i] + x0 * sin_t[i];
      }
    }
  }
}

template <typename S>
void embed(const ModelFile& model, const int32_t* ids, int T, S* x) {
  const ModelConfig& c = model.config();
  std::vector<float> row(std::is_same_v<S, float> ? 0 : size_t(c.hidden));
  for (int t = 0; t < T; ++t) {
    KVCC_REQUIRE(ids[t] >= 0 && ids[t] < c.vocab, "token id " + std::to_string(ids[t]) + " at position " +
                                                      std::to_string(t) + " is outside the vocabulary (" +
                                                      std::to_string(c.vocab) + ")");
    const size_t offset = size_t(ids[t]) * size_t(c.hidden);
    if constexpr (std::is_same_v<S, float>) {
      model.tensor_rows_f32("model.embed_tokens.weight", ids[t], 1, x + size_t(t) * c.hidden);
      require_finite(model, "model.embed_tokens.weight", x + size_t(t) * c.hidden, size_t(c.hidden), offset);
    } else {
      model.tensor_rows_f32("model.embed_tokens.weight", ids[t], 1, row.data());
      require_finite(model, "model.embed_tokens.weight", row.data(), row.size(), offset);
      std::copy(row.begin(), row.end(), x + size_t(t) * c.hidden);
    }
  }
}

template <typename S>
void attention_qkv(const ModelConfig& c, const BasicLayerWeights<S>& w, const S* x, int T, int pos0, S* q,
                   std::type_identity_t<S>* key_pre, S* key, S* value) {
  if (T <= 0) return;  // BLAS rejects empty leading dimensions
  const int hidden = c.hidden, d = c.head_dim, qdim = c.n_heads * d, kvdim = c.n_kv_heads * d;
  std::vector<S> xn(size_t(T) * hidden);
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

namespace {

// The attention of prefix_causal_attention, reporting each head's probabilities and output to the
// observer (n0 = 0 only: the observer's probs are [T, T]).
template <typename S>
void attend(const ModelConfig& c, int64_t n0, int T, const S* q, const S* key, const S* value, S* out,
            AttentionObserver* observer, const SequenceTaps* taps) {
  if (T <= 0) return;  // BLAS rejects empty leading dimensions
  const int d = c.head_dim, qdim = c.n_heads * d, kvdim = c.n_kv_heads * d, group = c.group();
  const int N = int(n0 + T);
  const S scale = S(1.0 / std::sqrt(double(d)));
  std::vector<S> probs(size_t(T) * N);  // one head at a time: [T, N]
  std::vector<S> head_out(size_t(T) * d);
  for (int h = 0; h < c.n_heads; ++h) {
    const int kv = h / group;
    // scores = scale · Q_h K_kvᵀ (strided views into the [T, heads·d] rows)
    gemm(true, T, N, d, scale, q + size_t(h) * d, qdim, key + size_t(kv) * d, kvdim, S(0), probs.data(), N);
    for (int i = 0; i < T; ++i) {
      S* row = probs.data() + size_t(i) * N;
      const int last = int(n0) + i;
      S max_score = row[0];
      for (int j = 1; j <= last; ++j) max_score = std::max(max_score, row[j]);
      double sum = 0;
      for (int j = 0; j <= last; ++j) {
        row[j] = std::exp(row[j] - max_score);
        sum += row[j];
      }
      const S inv = S(1.0 / sum);
      for (int j = 0; j <= last; ++j) row[j] *= inv;
      std::fill(row + last + 1, row + N, S(0));
    }
    gemm(false, T, d, N, S(1), probs.data(), N, value + size_t(kv) * d, kvdim, S(0), head_out.data(), d);
    for (int t = 0; t < T; ++t)
      std::copy(head_out.data() + size_t(t) * d, head_out.data() + size_t(t + 1) * d,
                out + size_t(t) * qdim + size_t(h) * d);
    if constexpr (std::is_same_v<S, float>)
      if (observer) observer->on_probs(*taps, h, probs.data(), head_out.data());
  }
}

}  // namespace

template <typename S>
void prefix_causal_attention(const ModelConfig& c, int64_t n0, int T, const S* q, const S* key, const S* value,
                             S* out) {
  KVCC_REQUIRE(n0 >= 0, "prefix_causal_attention: negative prefix length");
  attend(c, n0, T, q, key, value, out, nullptr, nullptr);
}

template <typename S>
void causal_attention(const ModelConfig& c, int T, const S* q, const S* key, const S* value, S* out,
                      AttentionObserver* observer, const SequenceTaps* taps) {
  if (T <= 0) return;
  KVCC_REQUIRE(!observer || taps, "causal_attention: an observer needs the caller's SequenceTaps");
  KVCC_REQUIRE((!observer || std::is_same_v<S, float>), "causal_attention: observers see float32 activations only");
  if (observer) observer->on_qkv(*taps);
  attend(c, 0, T, q, key, value, out, observer, taps);
}

template <typename S>
void attention_output_and_mlp(const ModelConfig& c, const BasicLayerWeights<S>& w, const S* attn, int T, S* x) {
  if (T <= 0) return;  // BLAS rejects empty leading dimensions
  const int hidden = c.hidden, qdim = c.n_heads * c.head_dim, inter = c.intermediate;
  linear(attn, T, qdim, w.wo.data(), hidden, x, S(1));  // residual: x += attn · Woᵀ
  std::vector<S> xn(size_t(T) * hidden);
  rms_norm(x, T, hidden, hidden, w.mlp_norm.data(), c.rms_eps, xn.data(), hidden);
  std::vector<S> gate(size_t(T) * inter), up(size_t(T) * inter);
  linear(xn.data(), T, hidden, w.w_gate.data(), inter, gate.data());
  linear(xn.data(), T, hidden, w.w_up.data(), inter, up.data());
  for (size_t i = 0; i < gate.size(); ++i) {
    const S g = gate[i];
    gate[i] = g / (S(1) + std::exp(-g)) * up[i];  // SiLU(gate) · up
  }
  linear(gate.data(), T, inter, w.w_down.data(), hidden, x, S(1));
}

template <typename S>
void layer_forward(const ModelConfig& c, const BasicLayerWeights<S>& w, int layer, uint32_t doc, S* x, int T,
                   AttentionObserver* observer) {
  if (T <= 0) return;  // BLAS rejects empty leading dimensions
  const size_t qdim = size_t(c.n_heads) * c.head_dim, kvdim = size_t(c.n_kv_heads) * c.head_dim;
  std::vector<S> q(T * qdim), key(T * kvdim), value(T * kvdim), attn(T * qdim);
  std::vector<S> key_pre(observer ? T * kvdim : 0);
  attention_qkv(c, w, x, T, 0, q.data(), observer ? key_pre.data() : nullptr, key.data(), value.data());
  SequenceTaps taps;
  if constexpr (std::is_same_v<S, float>) {
    taps.layer = layer;
    taps.doc = doc;
    taps.T = T;
    taps.q = q.data();
    taps.key_pre = observer ? key_pre.data() : nullptr;
    taps.key = key.data();
    taps.value = value.data();
  }
  causal_attention(c, T, q.data(), key.data(), value.data(), attn.data(), observer, &taps);
  attention_output_and_mlp(c, w, attn.data(), T, x);
}

template <typename S>
void final_logits(const ModelFile& model, const S* x, int T, S* logits) {
  if (T <= 0) return;
  const ModelConfig& c = model.config();
  const int hidden = c.hidden, vocab = c.vocab;
  const std::vector<S> norm = load_checked<S>(model, "model.norm.weight", size_t(hidden));
  std::vector<S> xn(size_t(T) * hidden);
  rms_norm(x, T, hidden, hidden, norm.data(), c.rms_eps, xn.data(), hidden);
  const std::string head = c.tied_embeddings ? "model.embed_tokens.weight" : "lm_head.weight";
  // The head is converted a block of vocabulary rows at a time, bounding memory for large vocabs.
  constexpr int kRowsPerBlock = 8192;
  const size_t block_size = size_t(std::min(vocab, kRowsPerBlock)) * hidden;
  std::vector<float> block(block_size);
  std::vector<S> wide(std::is_same_v<S, float> ? 0 : block_size);
  for (int r0 = 0; r0 < vocab; r0 += kRowsPerBlock) {
    const int rows = std::min(kRowsPerBlock, vocab - r0);
    model.tensor_rows_f32(head, r0, rows, block.data());
    require_finite(model, head, block.data(), size_t(rows) * hidden, size_t(r0) * hidden);
    const S* w;
    if constexpr (std::is_same_v<S, float>) {
      w = block.data();
    } else {
      std::copy(block.begin(), block.begin() + size_t(rows) * hidden, wide.begin());
      w = wide.data();
    }
    gemm(true, T, rows, hidden, S(1), xn.data(), hidden, w, hidden, S(0), logits + r0, vocab);
  }
}

// The two precisions (forward.h).
#define KVCC_FORWARD_INSTANTIATE(S)                                                                                    \
  template void apply_rope<S>(const ModelConfig&, S*, int, int, int);                                                  \
  template void embed<S>(const ModelFile&, const int32_t*, int, S*);                                                   \
  template void attention_qkv<S>(const ModelConfig&, const BasicLayerWeights<S>&, const S*, int, int, S*, S*, S*, S*); \
  template void prefix_causal_attention<S>(const ModelConfig&, int64_t, int, const S*, const S*, const S*, S*);        \
  template void causal_attention<S>(const ModelConfig&, int, const S*, const S*, const S*, S*, AttentionObserver*,     \
                                    const SequenceTaps*);                                                              \
  template void attention_output_and_mlp<S>(const ModelConfig&, const BasicLayerWeights<S>&, const S*, int, S*);       \
  template void layer_forward<S>(const ModelConfig&, const BasicLayerWeights<S>&, int, uint32_t, S*, int,              \
                                 AttentionObserver*);                                                                  \
  template void final_logits<S>(const ModelFile&, const S*, int, S*);
KVCC_FORWARD_INSTANTIATE(float)
KVCC_FORWARD_INSTANTIATE(double)
#undef KVCC_FORWARD_INSTANTIATE

}  // namespace kvcc
