// Helpers shared by the GPU tests (gpu_test_cache.cu, gpu_test_prefill.cu): device copies of
// host arrays (DeviceBuffer), random K/V rows, and a host + device cache pair driven by the same
// operations.
#pragma once
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <random>
#include <vector>

#include "formats/artifact.h"
#include "formats/kv_layout.h"
#include "runtime/device_buffer.h"
#include "runtime/kv_cache.h"
#include "runtime/kv_kernels.h"
#include "runtime/served.h"
#include "cache_test_util.h"

namespace kvcc::testing {

#define CUDA_OK(x) ASSERT_EQ((x), cudaSuccess) << #x

// Host rotations [n, d, d] (d = kGpuHeadDim) as the append and prefill take them (rot_fragments,
// built on the device); null or n = 0: none (an empty buffer, whose data() is null).
inline DeviceBuffer<RotFragments> device_fragments(const float* rot, size_t n) {
  if (!rot || n == 0) return {};
  const DeviceBuffer<float> d(std::vector<float>(rot, rot + n * kGpuHeadDim * kGpuHeadDim));
  DeviceBuffer<RotFragments> f(n);
  rot_fragments(d.data(), int64_t(n), f.data(), nullptr);
  check_cuda(cudaDeviceSynchronize(), "rot_fragments");
  return f;
}

// n values of head_dim-wide rows: keys with 4 outlier channels (×6) and an offset (+0.3), as real
// keys have, or plain standard normal values.
inline std::vector<float> random_rows(size_t n, std::mt19937& rng, bool outliers) {
  std::normal_distribution<float> nd;
  std::vector<float> x(n);
  for (size_t i = 0; i < n; ++i) x[i] = outliers ? nd(rng) * ((i % kGpuHeadDim) < 4 ? 6.0f : 1.0f) + 0.3f : nd(rng);
  return x;
}

// The Runtime tests' artifact (gpu_test_graph.cu, gpu_test_activations.cu): oscar, 2 layers, 16
// query / 4 KV heads, random rotations, short windows (sink 16, ring 64) so a few steps cross the
// sink's end, ring wraps and flushes; with level_tables, every other head has 4-level tables.
// kivi: the mixed recipe instead (KIVI keys in per-channel pages of one group, unrotated; values
// rotated per token).
inline Artifact gpu_runtime_artifact(std::mt19937& rng, bool level_tables, bool kivi = false) {
  Artifact art;
  art.n_layers = 2;
  art.n_heads = 16;
  art.n_kv_heads = 4;
  art.head_dim = kGpuHeadDim;
  art.recipe.method = "oscar";
  art.recipe.sink = 16;
  art.recipe.recent = 64;
  art.recipe.page_size = kGpuPageTokens;
  if (kivi) {
    art.recipe.method = "kivi";
    art.recipe.group = kGpuPageTokens;
    art.recipe.params["values"] = "hadamard";
    art.recipe.params["key_params"] = "e5m3";  // the 2-byte pairs the kernels take
  }
  for (int i = 0; i < art.n_layers * art.n_kv_heads; ++i) {
    HeadArtifact h;
    if (!kivi) h.key.rotation = random_orthogonal(1, kGpuHeadDim, rng);
    h.value.rotation = random_orthogonal(1, kGpuHeadDim, rng);
    h.key.clip_ratio = 0.9;
    h.value.clip_ratio = 0.95;
    if (level_tables && i % 2 == 0) {
      h.key.levels = {-1.5, -0.4, 0.45, 1.6};
      h.value.levels = {-1.4, -0.5, 0.5, 1.4};
    }
    art.heads.push_back(h);
  }
  return art;
}

// Every byte of a device pool (pages and windows), on the host.
inline std::vector<uint8_t> device_pool_bytes(const KvCache& c) {
  std::vector<uint8_t> h(c.pool_bytes());
  EXPECT_EQ(cudaMemcpy(h.data(), c.pages_base(), h.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  return h;
}

// A host pool (the CPU references' cache) and a device pool holding the same sequences, with
// per-(layer, KV head) codecs whose clip ratios are drawn from rng (seeded by the caller).
struct PoolPair {
  KvGeometry g;
  KvCache host, dev;
  std::vector<HeadCodec> codecs;  // [layers * H]
  std::mt19937 rng;

  // widths: KvCacheConfig::widths of both pools (empty: 2 bits everywhere).
  PoolPair(const KvGeometry& geo, int64_t pages, int seqs, unsigned seed, const std::vector<BlockWidths>& widths = {})
      : g(geo),
        host(KvCacheConfig{geo, pages, seqs, PoolMemory::Host, widths}),
        dev(KvCacheConfig{geo, pages, seqs, PoolMemory::Device, widths}),
        rng(seed) {
    // Ranks 6 .. 128 of 128: the device's clip selection is checked at every depth, not just the top.
    std::uniform_real_distribution<float> ur(0.05f, 1.0f);
    for (int i = 0; i < g.n_layers * g.n_kv_heads; ++i) {
      HeadCodec c;
      c.key.clip_ratio = ur(rng);
      c.value.clip_ratio = ur(rng);
      codecs.push_back(c);
    }
  }
  int add() {
    const int a = host.add_sequence(), b = dev.add_sequence();
    EXPECT_EQ(a, b);
    return a;
  }
  int fork(int p) {
    const int a = host.fork(p), b = dev.fork(p);
    EXPECT_EQ(a, b);
    return a;
  }
  // Grows both pools for an append of counts[i] rows to seqs[i]; returns the old lengths.
  std::vector<int64_t> grow(const std::vector<int>& seqs, const std::vector<int>& counts) {
    std::vector<int64_t> old, add;
    for (size_t i = 0; i < seqs.size(); ++i) {
      old.push_back(host.length(seqs[i]));
      add.push_back(counts[i]);
    }
    host.grow_batch(seqs, add);
    dev.grow_batch(seqs, add);
    return old;
  }
};

}  // namespace kvcc::testing
