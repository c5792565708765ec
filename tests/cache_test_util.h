// Helpers shared by the cache tests (gpu_test_cache.cu, gpu_test_prefill.cu,
// test_cache_runtime.cpp, the engine-table tests): random orthogonal rotations, their transposes,
// the relative error of an output row, the kernels' default geometry (d = 128, one group per row,
// 64-token pages, sink 64, ring 256), and an engine's page tables.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "formats/artifact.h"
#include "formats/kv_layout.h"
#include "formats/model_config.h"
#include "runtime/engine_step.h"
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

// The engine's side of engine-table steps (test_runtime_engine.cpp, gpu_test_engine.cu): its own
// window slot per sequence and its own page allocator (ids handed out in a shuffled order, so they
// differ from the Runtime's), the block table [batch, stride].
struct EngineTables {
  int stride = 0;
  std::vector<int32_t> free_pages;
  std::vector<int32_t> slots, lengths;
  std::vector<std::vector<int32_t>> pages;  // per sequence
  EngineTables(int64_t pool, int stride_, std::vector<int32_t> slots_, std::mt19937& rng)
      : stride(stride_), slots(std::move(slots_)), lengths(slots.size(), 0), pages(slots.size()) {
    for (int32_t p = 0; p < int32_t(pool); ++p) free_pages.push_back(p);
    std::shuffle(free_pages.begin(), free_pages.end(), rng);
  }
  // Grows sequence i's pages for `count` new tokens; the step's tables for sequences `which`.
  struct Step {
    std::vector<int32_t> slots, lengths, counts, block_table;
    EngineStep view(int stride) const {
      return EngineStep{int(slots.size()), slots.data(), lengths.data(), counts.data(), block_table.data(), stride};
    }
  };
  Step step(const KvGeometry& g, const std::vector<int>& which, const std::vector<int>& counts) {
    Step s;
    for (size_t j = 0; j < which.size(); ++j) {
      const size_t i = size_t(which[j]);
      while (int64_t(pages[i].size()) < history_pages(g, lengths[i] + counts[j])) {
        pages[i].push_back(free_pages.back());
        free_pages.pop_back();
      }
      s.slots.push_back(slots[i]);
      s.lengths.push_back(lengths[i]);
      s.counts.push_back(counts[j]);
      std::vector<int32_t> row(size_t(stride), -7);  // entries past the sequence's pages: never read
      std::copy(pages[i].begin(), pages[i].end(), row.begin());
      s.block_table.insert(s.block_table.end(), row.begin(), row.end());
    }
    return s;
  }
  void commit(const std::vector<int>& which, const std::vector<int>& counts) {
    for (size_t j = 0; j < which.size(); ++j) lengths[size_t(which[j])] += counts[j];
  }
};

}  // namespace kvcc::testing
