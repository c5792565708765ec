// Helpers shared by the GPU tests (gpu_test_cache.cu, gpu_test_prefill.cu): device copies of
// host arrays (DeviceBuffer), random K/V rows, and a host + device cache pair driven by the same
// operations.
#pragma once
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <random>
#include <vector>

#include "formats/kv_layout.h"
#include "runtime/device_buffer.h"
#include "runtime/kv_cache.h"
#include "runtime/served.h"

namespace kvcc::testing {

#define CUDA_OK(x) ASSERT_EQ((x), cudaSuccess) << #x

// n values of head_dim-wide rows: keys with 4 outlier channels (×6) and an offset (+0.3), as real
// keys have, or plain standard normal values.
inline std::vector<float> random_rows(size_t n, std::mt19937& rng, bool outliers) {
  std::normal_distribution<float> nd;
  std::vector<float> x(n);
  for (size_t i = 0; i < n; ++i) x[i] = outliers ? nd(rng) * ((i % kGpuHeadDim) < 4 ? 6.0f : 1.0f) + 0.3f : nd(rng);
  return x;
}

// A host pool (the CPU references' cache) and a device pool holding the same sequences, with
// per-(layer, KV head) codecs whose clip ratios are drawn from rng (seeded by the caller).
struct PoolPair {
  KvGeometry g;
  KvCache host, dev;
  std::vector<HeadCodec> codecs;  // [layers * H]
  std::mt19937 rng;

  PoolPair(const KvGeometry& geo, int64_t pages, int seqs, unsigned seed)
      : g(geo),
        host(KvCacheConfig{geo, pages, seqs, PoolMemory::Host}),
        dev(KvCacheConfig{geo, pages, seqs, PoolMemory::Device}),
        rng(seed) {
    std::uniform_real_distribution<float> ur(0.85f, 1.0f);
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
