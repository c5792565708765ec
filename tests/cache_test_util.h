// Helpers shared by the cache tests (gpu_test_cache.cu, gpu_test_prefill.cu,
// test_cache_runtime.cpp): random orthogonal rotations, their transposes, the relative error of an
// output row, and the kernels' default geometry (d = 128, one group per row, 64-token pages, sink
// 64, ring 256).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <random>
#include <string>
#include <vector>

#include "formats/artifact.h"
#include "formats/kv_layout.h"
#include "formats/model_config.h"
#include "formats_test_util.h"

namespace kvcc::testing {

// heads orthogonal [d, d] matrices (formats_test_util.h's, one after another), row-major, float64.
inline std::vector<double> random_orthogonal(int heads, int d, std::mt19937& rng) {
  std::vector<double> out;
  for (int h = 0; h < heads; ++h) {
    const std::vector<double> m = random_orthogonal(d, rng);
    out.insert(out.end(), m.begin(), m.end());
  }
  return out;
}

// The same as float [heads, d, d], as the kernels take rotations.
inline std::vector<float> random_rotations(int heads, int d, std::mt19937& rng) {
  const std::vector<double> r = random_orthogonal(heads, d, rng);
  return std::vector<float>(r.begin(), r.end());
}

// Per head, Rᵀ (the kernels take R_vᵀ for the output rotation).
inline std::vector<float> transpose_heads(const std::vector<float>& r, int heads, int d) {
  std::vector<float> t(r.size());
  for (int h = 0; h < heads; ++h)
    for (int i = 0; i < d; ++i)
      for (int j = 0; j < d; ++j) t[(size_t(h) * d + j) * d + i] = r[(size_t(h) * d + i) * d + j];
  return t;
}

// ‖got − want‖ / ‖want‖ over n values.
inline double rel(const float* got, const float* want, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    num += double(got[i] - want[i]) * double(got[i] - want[i]);
    den += double(want[i]) * double(want[i]);
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

inline KvGeometry test_geometry(int layers, int heads) {
  KvGeometry g;
  g.n_layers = layers;
  g.n_kv_heads = heads;
  g.head_dim = 128;
  g.group = 128;
  g.page_tokens = 64;
  g.sink = 64;
  g.recent = 256;
  return g;
}

// A small oscar artifact for Runtime tests: `layers` x `kv` heads of random rotations (seed 42),
// clip ratios 0.9 + 0.02·i (keys) and 0.95 (values), sink 8, recent 32, pages of 16.
inline Artifact small_runtime_artifact(int layers, int heads, int kv, int d) {
  std::mt19937 rng(42);
  Artifact a;
  a.producer = "test";
  a.model_id = "tiny";
  a.n_layers = layers;
  a.n_heads = heads;
  a.n_kv_heads = kv;
  a.head_dim = d;
  ModelConfig cfg;
  cfg.architecture = "llama";
  cfg.n_layers = layers;
  cfg.n_heads = heads;
  cfg.n_kv_heads = kv;
  cfg.head_dim = d;
  cfg.hidden = heads * d;
  a.fingerprint = make_fingerprint(cfg, std::string(64, '0'));
  a.recipe.method = "oscar";
  a.recipe.sink = 8;
  a.recipe.recent = 32;
  a.recipe.page_size = 16;
  for (int i = 0; i < layers * kv; ++i) {
    HeadArtifact h;
    h.key.rotation = random_orthogonal(1, d, rng);
    h.value.rotation = random_orthogonal(1, d, rng);
    h.key.clip_ratio = 0.9 + 0.02 * i;
    h.value.clip_ratio = 0.95;
    a.heads.push_back(h);
  }
  return a;
}

}  // namespace kvcc::testing
