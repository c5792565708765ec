// Shared by the forward and model-file tests: running a whole model and reading the reference
// logits that tests/reference/make_forward_refs.py saved from transformers.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <type_traits>
#include <vector>

#include "formats/model_file.h"
#include "model/forward.h"

namespace kvcc::testing {

inline std::string data_models_dir() { return std::string(KVCC_SOURCE_DIR) + "/tests/data/models"; }
inline std::string shared_models_dir() { return std::string(KVCC_SHARED_DIR) + "/models"; }

inline nlohmann::json read_json_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot open " + path);
  return nlohmann::json::parse(in);
}

// Full forward of one sequence: logits [T, vocab], in float32 or (S = double) in double.
template <typename S = float>
std::vector<S> model_logits(const ModelFile& model, const std::vector<int32_t>& ids) {
  const ModelConfig& c = model.config();
  const int T = int(ids.size());
  std::vector<S> x(size_t(T) * c.hidden);
  embed(model, ids.data(), T, x.data());
  for (int l = 0; l < c.n_layers; ++l) {
    if constexpr (std::is_same_v<S, float>) layer_forward(c, load_layer(model, l), l, 0, x.data(), T);
    else layer_forward(c, load_layer<double>(model, l), l, 0, x.data(), T);
  }
  std::vector<S> logits(size_t(T) * c.vocab);
  final_logits(model, x.data(), T, logits.data());
  return logits;
}

// A whole model's prefill of ids in which the query at position i of layer l attends to exactly
// the positions visible(l, i) (ascending, each <= i), the attention a float64 softmax over those
// rows: the reference for prefills that hide part of the past (block-wise prefill, eviction,
// layer sensitivity). keys / values: every layer's [T, n_kv·d] from the model's float32
// projections.
inline void masked_prefill(const ModelFile& model, const std::vector<int32_t>& ids,
                           const std::function<std::vector<int32_t>(int layer, int i)>& visible,
                           std::vector<std::vector<float>>& keys, std::vector<std::vector<float>>& values) {
  const ModelConfig& c = model.config();
  const int T = int(ids.size()), d = c.head_dim;
  const size_t qdim = size_t(c.n_heads) * d, kvdim = size_t(c.n_kv_heads) * d;
  std::vector<float> x(size_t(T) * c.hidden), q(size_t(T) * qdim), k(size_t(T) * kvdim), v(size_t(T) * kvdim),
      attn(size_t(T) * qdim);
  embed(model, ids.data(), T, x.data());
  keys.clear();
  values.clear();
  for (int l = 0; l < c.n_layers; ++l) {
    const LayerWeights w = load_layer<float>(model, l);
    attention_qkv(c, w, x.data(), T, 0, q.data(), nullptr, k.data(), v.data());
    keys.push_back(k);
    values.push_back(v);
    for (int i = 0; i < T; ++i) {
      const std::vector<int32_t> seen = visible(l, i);
      for (int h = 0; h < c.n_heads; ++h) {
        const size_t g = size_t(h / c.group());
        std::vector<double> p(seen.size());
        double mx = -INFINITY, z = 0;
        for (size_t j = 0; j < seen.size(); ++j) {
          double s = 0;
          for (int a = 0; a < d; ++a)
            s += double(q[size_t(i) * qdim + size_t(h) * d + a]) * k[size_t(seen[j]) * kvdim + g * d + a];
          mx = std::max(mx, p[j] = s / std::sqrt(double(d)));
        }
        for (double& s : p) z += (s = std::exp(s - mx));
        for (int a = 0; a < d; ++a) {
          double o = 0;
          for (size_t j = 0; j < seen.size(); ++j) o += p[j] / z * v[size_t(seen[j]) * kvdim + g * d + a];
          attn[size_t(i) * qdim + size_t(h) * d + a] = float(o);
        }
      }
    }
    attention_output_and_mlp(c, w, attn.data(), T, x.data());
  }
}

struct RefComparison {
  double max_abs_diff = 0;
  double max_abs_ref = 0;
  double relative() const { return max_abs_diff / max_abs_ref; }
};

// max |ours − ref| / max |ref| over the reference positions (our forward in float32 or double).
template <typename S = float>
RefComparison compare_to_reference(const ModelFile& model, const nlohmann::json& ref) {
  const std::vector<int32_t> ids = ref["ids"].get<std::vector<int32_t>>();
  const std::vector<S> logits = model_logits<S>(model, ids);
  const int vocab = model.config().vocab;
  RefComparison cmp;
  const auto positions = ref["positions"].get<std::vector<int>>();
  for (size_t k = 0; k < positions.size(); ++k) {
    const auto row = ref["logits"][k].get<std::vector<double>>();
    if (int(row.size()) != vocab) throw std::runtime_error("reference vocab mismatch");
    for (int v = 0; v < vocab; ++v) {
      cmp.max_abs_diff =
          std::max(cmp.max_abs_diff, std::abs(double(logits[size_t(positions[k]) * vocab + v]) - row[v]));
      cmp.max_abs_ref = std::max(cmp.max_abs_ref, std::abs(row[v]));
    }
  }
  return cmp;
}

}  // namespace kvcc::testing
