#include "calibrate/layer_sensitivity.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "formats/error.h"
#include "model/forward.h"

namespace kvcc {
namespace {

// The masked run's attention for one document: block b's queries over [sink rows; the second
// half of block b − 1; block b causally], one KV head at a time through the model's own prefix
// attention (the kept rows are its prefix).
void block_prefill_attention(const ModelConfig& c, int T, int block, int sink, const float* q, const float* k,
                             const float* v, float* out) {
  const int d = c.head_dim, r = c.group();
  const size_t qdim = size_t(c.n_heads) * d, kvdim = size_t(c.n_kv_heads) * d;
  ModelConfig one = c;
  one.n_heads = r;
  one.n_kv_heads = 1;
  std::vector<float> qg, kg, vg, og;
  for (int s0 = 0; s0 < T; s0 += block) {
    const int Tb = std::min(block, T - s0);
    std::vector<int> rows;
    for (int j = 0; j < std::min(sink, s0); ++j) rows.push_back(j);
    for (int j = std::max(sink, s0 - block / 2); j < s0; ++j) rows.push_back(j);
    for (int j = s0; j < s0 + Tb; ++j) rows.push_back(j);
    const size_t n = rows.size();
    qg.resize(size_t(Tb) * r * d);
    og.resize(qg.size());
    kg.resize(n * d);
    vg.resize(n * d);
    for (int g = 0; g < c.n_kv_heads; ++g) {
      for (size_t i = 0; i < n; ++i) {
        std::copy_n(k + size_t(rows[i]) * kvdim + size_t(g) * d, d, kg.data() + i * d);
        std::copy_n(v + size_t(rows[i]) * kvdim + size_t(g) * d, d, vg.data() + i * d);
      }
      for (int t = 0; t < Tb; ++t)
        std::copy_n(q + size_t(s0 + t) * qdim + size_t(g) * r * d, size_t(r) * d, qg.data() + size_t(t) * r * d);
      prefix_causal_attention(one, int64_t(n) - Tb, Tb, qg.data(), kg.data(), vg.data(), og.data());
      for (int t = 0; t < Tb; ++t)
        std::copy_n(og.data() + size_t(t) * r * d, size_t(r) * d, out + size_t(s0 + t) * qdim + size_t(g) * r * d);
    }
  }
}

}  // namespace

LayerSensitivity measure_layer_sensitivity(const ModelFile& model, const std::vector<std::vector<int32_t>>& documents,
                                           int block, int sink, const std::function<void(int)>& progress) {
  const ModelConfig& c = model.config();
  KVCC_REQUIRE(block >= 2 && sink >= 0, "layer sensitivity: the block must be >= 2 tokens and the sink >= 0 (got " +
                                            std::to_string(block) + ", " + std::to_string(sink) + ")");
  const int d = c.head_dim, H = c.n_kv_heads;
  const size_t qdim = size_t(c.n_heads) * d, kvdim = size_t(H) * d;
  LayerSensitivity out;
  out.block = block;
  out.sink = sink;
  out.key_similarity_sum.assign(size_t(c.n_layers), 0.0);
  // Both runs' hidden states, every document's rows one after another.
  std::vector<size_t> start;
  size_t total = 0;
  for (const auto& doc : documents) {
    start.push_back(total);
    total += doc.size();
  }
  KVCC_REQUIRE(total > 0, "layer sensitivity: the documents hold no tokens");
  std::vector<float> xf(total * size_t(c.hidden)), xm;
  for (size_t i = 0; i < documents.size(); ++i)
    if (!documents[i].empty())
      embed(model, documents[i].data(), int(documents[i].size()), xf.data() + start[i] * size_t(c.hidden));
  xm = xf;
  std::vector<float> q, k, km, v, attn;
  for (int l = 0; l < c.n_layers; ++l) {
    const LayerWeights w = load_layer<float>(model, l);
    for (size_t i = 0; i < documents.size(); ++i) {
      const int T = int(documents[i].size());
      if (T == 0) continue;
      float* f = xf.data() + start[i] * size_t(c.hidden);
      float* m = xm.data() + start[i] * size_t(c.hidden);
      q.resize(size_t(T) * qdim);
      attn.resize(q.size());
      k.resize(size_t(T) * kvdim);
      km.resize(k.size());
      v.resize(k.size());
      attention_qkv(c, w, m, T, 0, q.data(), nullptr, km.data(), v.data());
      block_prefill_attention(c, T, block, sink, q.data(), km.data(), v.data(), attn.data());
      attention_output_and_mlp(c, w, attn.data(), T, m);
      attention_qkv(c, w, f, T, 0, q.data(), nullptr, k.data(), v.data());
      causal_attention(c, T, q.data(), k.data(), v.data(), attn.data());
      attention_output_and_mlp(c, w, attn.data(), T, f);
      double sum = 0;
      for (size_t row = 0; row < size_t(T) * H; ++row) {
        const float* a = k.data() + row * d;
        const float* b = km.data() + row * d;
        double ab = 0, aa = 0, bb = 0;
        for (int j = 0; j < d; ++j) {
          ab += double(a[j]) * b[j];
          aa += double(a[j]) * a[j];
          bb += double(b[j]) * b[j];
        }
        sum += aa > 0 && bb > 0 ? ab / std::sqrt(aa * bb) : 1.0;  // two zero keys agree
      }
      out.key_similarity_sum[size_t(l)] += sum;
    }
    if (progress) progress(l);
  }
  out.pairs = uint64_t(total) * uint64_t(H);
  return out;
}

}  // namespace kvcc
