#include "cli/demo/sample.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <string>

#include "formats/error.h"

namespace kvcc::demo {

IncrementalDecoder::IncrementalDecoder(const ModelFile& model, int max_tokens)
    : model_(model), max_tokens_(max_tokens) {
  const ModelConfig& c = model.config();
  KVCC_REQUIRE(max_tokens >= 1 && max_tokens <= c.max_position,
               "decoder: tokens must be in 1.." + std::to_string(c.max_position) + " (the model's context)");
  const size_t kvdim = size_t(c.n_kv_heads) * size_t(c.head_dim), qdim = size_t(c.n_heads) * size_t(c.head_dim);
  for (int l = 0; l < c.n_layers; ++l) {
    layers_.push_back(load_layer(model, l));
    keys_.emplace_back(size_t(max_tokens) * kvdim);
    values_.emplace_back(size_t(max_tokens) * kvdim);
  }
  x_.resize(size_t(c.hidden));
  q_.resize(qdim);
  attn_.resize(qdim);
  logits_.resize(size_t(c.vocab));
}

const std::vector<float>& IncrementalDecoder::step(int32_t id) {
  KVCC_REQUIRE(pos_ < max_tokens_, "decoder: past its " + std::to_string(max_tokens_) + " tokens");
  const ModelConfig& c = model_.config();
  const size_t kvdim = size_t(c.n_kv_heads) * size_t(c.head_dim);
  embed(model_, &id, 1, x_.data());
  for (int l = 0; l < c.n_layers; ++l) {
    float* k = keys_[size_t(l)].data();
    float* v = values_[size_t(l)].data();
    attention_qkv(c, layers_[size_t(l)], x_.data(), 1, pos_, q_.data(), nullptr, k + size_t(pos_) * kvdim,
                  v + size_t(pos_) * kvdim);
    prefix_causal_attention(c, pos_, 1, q_.data(), k, v, attn_.data());
    attention_output_and_mlp(c, layers_[size_t(l)], attn_.data(), 1, x_.data());
  }
  final_logits(model_, x_.data(), 1, logits_.data());
  ++pos_;
  return logits_;
}

namespace {

// A uniform double in [0, 1) from the top 53 bits of one mt19937_64 draw.
double uniform01(std::mt19937_64& rng) { return double(rng() >> 11) * 0x1.0p-53; }

// Samples from softmax(logits / temperature) by inverse CDF, in double.
int32_t sample_token(const std::vector<float>& logits, double temperature, std::mt19937_64& rng) {
  const float mx = *std::max_element(logits.begin(), logits.end());
  std::vector<double> p(logits.size());
  double sum = 0;
  for (size_t v = 0; v < logits.size(); ++v) sum += p[v] = std::exp((double(logits[v]) - mx) / temperature);
  const double u = uniform01(rng) * sum;
  double acc = 0;
  for (size_t v = 0; v < p.size(); ++v) {
    acc += p[v];
    if (u < acc) return int32_t(v);
  }
  return int32_t(p.size() - 1);
}

}  // namespace

std::vector<std::vector<int32_t>> sample_documents(const ModelFile& model, int n_docs, const SampleOptions& o) {
  const ModelConfig& c = model.config();
  KVCC_REQUIRE(n_docs >= 0, "sample: negative document count");
  KVCC_REQUIRE(
      o.max_tokens >= 2 && o.max_tokens <= c.max_position,
      "sample: tokens per document must be in 2.." + std::to_string(c.max_position) + " (the model's context)");
  KVCC_REQUIRE(o.temperature > 0, "sample: the temperature must be positive");
  IncrementalDecoder decoder(model, o.max_tokens);
  std::mt19937_64 rng(o.seed);
  std::vector<std::vector<int32_t>> docs;
  while (int(docs.size()) < n_docs) {
    std::vector<int32_t> ids{c.bos_id >= 0 ? c.bos_id : 1};
    decoder.reset();
    while (int(ids.size()) < o.max_tokens) {
      const int32_t next = sample_token(decoder.step(ids.back()), o.temperature, rng);
      if (std::find(o.stop_ids.begin(), o.stop_ids.end(), next) != o.stop_ids.end()) break;
      ids.push_back(next);
    }
    if (ids.size() >= 2) docs.push_back(std::move(ids));
  }
  return docs;
}

}  // namespace kvcc::demo
