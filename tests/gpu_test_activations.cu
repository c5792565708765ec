// BFloat16 activations on the device pool: a Runtime loaded with RuntimeOptions::activations =
// BFloat16 and fed bfloat16 q, k, v gives, for prefill and decode, exactly the bfloat16 rounding of
// what a float32 device Runtime gives on the same values widened (runtime/activations.h's
// contract: the kernels widen on load and round on store, nothing else changes), every output
// element written (NaN sentinels), and the two pools byte for byte equal. The bfloat16 decode steps
// run as one CUDA graph captured at the first step and replayed, over steps that cross the sink's
// end, history flushes and the ring's wrap; with uniform-grid codecs and with level tables (the
// decode kernel's fp16-query path).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <random>
#include <vector>

#include "formats/artifact.h"
#include "formats/fp16.h"
#include "formats/kv_layout.h"
#include "runtime/device_buffer.h"
#include "runtime/kvcc_runtime.h"
#include "cache_test_util.h"
#include "gpu_test_util.h"

namespace kvcc {
namespace {

using testing::device_pool_bytes;
using testing::gpu_runtime_artifact;
using testing::random_rows;

constexpr int kD = kGpuHeadDim;
constexpr int kLayers = 2, kHeads = 16, kKv = 4;

// One tensor of activations in both types: float32 (bfloat16 values widened) and bfloat16.
struct Pair {
  DeviceBuffer<float> f32;
  DeviceBuffer<uint16_t> bf16;
  explicit Pair(size_t n) : f32(n), bf16(n) {}
  void set(const std::vector<float>& x) {
    std::vector<uint16_t> b(x.size());
    std::vector<float> w(x.size());
    for (size_t i = 0; i < x.size(); ++i) {
      b[i] = bf16_from_float(x[i]);
      w[i] = float_from_bf16(b[i]);
    }
    f32.upload(w);
    bf16.upload(b);
  }
};

// Elements of the bfloat16 output not written (NaN) and not equal to the float32 output rounded.
void expect_rounded(const Pair& out, size_t n, const char* what, size_t step, int layer) {
  std::vector<float> want(n);
  std::vector<uint16_t> got(n);
  ASSERT_EQ(cudaMemcpy(want.data(), out.f32.data(), n * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(got.data(), out.bf16.data(), n * 2, cudaMemcpyDeviceToHost), cudaSuccess);
  size_t nan = 0, differ = 0;
  for (size_t i = 0; i < n; ++i) {
    nan += (got[i] & 0x7fffu) > 0x7f80u;
    differ += got[i] != bf16_from_float(want[i]);
  }
  ASSERT_EQ(nan, 0u) << what << ", step " << step << " layer " << layer << ": output elements not written";
  ASSERT_EQ(differ, 0u) << what << ", step " << step << " layer " << layer
                        << ": bfloat16 output is not the float32 output rounded";
}

void check_bf16_equals_rounded_f32(bool tables, unsigned seed) {
  std::mt19937 rng(seed);
  const Artifact art = gpu_runtime_artifact(rng, tables);
  RuntimeOptions o;
  o.max_pages = 64;
  o.max_sequences = 3;
  o.memory = PoolMemory::Device;
  o.max_batch = 3;
  o.max_context = 512;
  o.max_step_tokens = 256;
  const EngineShape e{kLayers, kHeads, kKv, kD};
  Runtime f32(art, e, o);
  o.activations = Activations::BFloat16;
  Runtime bf16(art, e, o);
  for (Runtime* rt : {&f32, &bf16}) CUDA_OK(cudaMemset(rt->cache().pages_base(), 0, rt->cache().pool_bytes()));
  for (int i = 0; i < 3; ++i) ASSERT_EQ(f32.cache().add_sequence(), bf16.cache().add_sequence());
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const size_t kv_row = size_t(kKv) * kD, q_row = size_t(kHeads) * kD;
  std::vector<Pair> k, v, q, out;
  for (int l = 0; l < kLayers; ++l) {
    k.emplace_back(size_t(o.max_step_tokens) * kv_row);
    v.emplace_back(size_t(o.max_step_tokens) * kv_row);
    q.emplace_back(size_t(o.max_step_tokens) * q_row);
    out.emplace_back(size_t(o.max_step_tokens) * q_row);
  }
  auto set_inputs = [&](int rows, int q_rows) {
    CUDA_OK(cudaStreamSynchronize(s));
    for (int l = 0; l < kLayers; ++l) {
      k[size_t(l)].set(random_rows(size_t(rows) * kv_row, rng, true));
      v[size_t(l)].set(random_rows(size_t(rows) * kv_row, rng, false));
      q[size_t(l)].set(random_rows(size_t(q_rows) * q_row, rng, false));
    }
    CUDA_OK(cudaDeviceSynchronize());
  };
  auto sentinels = [&](size_t n) {
    for (int l = 0; l < kLayers; ++l) {
      CUDA_OK(cudaMemsetAsync(out[size_t(l)].f32.data(), 0xff, n * 4, s));
      CUDA_OK(cudaMemsetAsync(out[size_t(l)].bf16.data(), 0xff, n * 2, s));
    }
  };
  // History through prefill, one sequence at a time: sequence 0 two tokens short of the sink's end,
  // 1 three short of its first flush, 2 eight short of the ring's wrap (post-sink 120 of 128).
  const std::vector<int> fill = {14, 78, 136};
  for (int seq = 0; seq < 3; ++seq) {
    const int T = fill[size_t(seq)];
    set_inputs(T, T);
    sentinels(size_t(T) * q_row);
    for (Runtime* rt : {&f32, &bf16}) {
      const bool b = rt == &bf16;
      rt->begin_append({seq}, {T}, s);
      for (int l = 0; l < kLayers; ++l) {
        const Pair &kl = k[size_t(l)], &vl = v[size_t(l)], &ql = q[size_t(l)], &ol = out[size_t(l)];
        if (b) rt->prefill(l, seq, T, ql.bf16.data(), kl.bf16.data(), vl.bf16.data(), ol.bf16.data(), s);
        else rt->prefill(l, seq, T, ql.f32.data(), kl.f32.data(), vl.f32.data(), ol.f32.data(), s);
        if (b) rt->append(l, kl.bf16.data(), vl.bf16.data(), s);
        else rt->append(l, kl.f32.data(), vl.f32.data(), s);
      }
    }
    CUDA_OK(cudaStreamSynchronize(s));
    for (int l = 0; l < kLayers; ++l) expect_rounded(out[size_t(l)], size_t(T) * q_row, "prefill", size_t(seq), l);
  }
  ASSERT_TRUE(device_pool_bytes(f32.cache()) == device_pool_bytes(bf16.cache()))
      << "the pools differ after the prefills";
  std::vector<KvTiers> before;
  for (int seq = 0; seq < 3; ++seq) before.push_back(tiers_of(f32.geometry(), f32.cache().length(seq)));

  struct Step {
    std::vector<int> seqs, counts;
  };
  const std::vector<Step> steps = {{{0, 1, 2}, {1, 1, 1}}, {{0, 1, 2}, {2, 1, 3}}, {{2, 0, 1}, {1, 1, 1}},
                                   {{0, 1, 2}, {1, 1, 1}}, {{1, 2, 0}, {1, 1, 1}}, {{0, 1, 2}, {70, 1, 1}},
                                   {{0, 1, 2}, {1, 1, 1}}};
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  const size_t n_out = 3 * q_row;
  for (size_t si = 0; si < steps.size(); ++si) {
    const Step& st = steps[si];
    int rows = 0;
    for (int x : st.counts) rows += x;
    set_inputs(rows, 3);
    sentinels(n_out);
    f32.begin_append(st.seqs, st.counts, s);
    for (int l = 0; l < kLayers; ++l) {
      f32.append(l, k[size_t(l)].f32.data(), v[size_t(l)].f32.data(), s);
      f32.decode(l, st.seqs, q[size_t(l)].f32.data(), out[size_t(l)].f32.data(), s);
    }
    bf16.begin_append(st.seqs, st.counts, s);
    if (!exec) {
      CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
      for (int l = 0; l < kLayers; ++l) {
        bf16.append(l, k[size_t(l)].bf16.data(), v[size_t(l)].bf16.data(), s);
        bf16.decode(l, st.seqs, q[size_t(l)].bf16.data(), out[size_t(l)].bf16.data(), s);
      }
      CUDA_OK(cudaStreamEndCapture(s, &graph));
      CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    }
    CUDA_OK(cudaGraphLaunch(exec, s));
    CUDA_OK(cudaStreamSynchronize(s));
    for (int l = 0; l < kLayers; ++l) expect_rounded(out[size_t(l)], n_out, "decode", si, l);
  }
  const KvGeometry& g = f32.geometry();
  std::vector<KvTiers> after;
  for (int seq = 0; seq < 3; ++seq) after.push_back(tiers_of(g, f32.cache().length(seq)));
  EXPECT_LT(before[0].sink_count, g.sink);
  EXPECT_EQ(after[0].sink_count, g.sink);
  EXPECT_GT(after[0].hist_tokens, before[0].hist_tokens);
  EXPECT_GT(after[1].hist_tokens, before[1].hist_tokens);
  EXPECT_LT((before[2].hist_tokens + before[2].ring_count) / g.recent,
            (after[2].hist_tokens + after[2].ring_count) / g.recent)
      << "the ring of sequence 2 wraps during the steps";
  EXPECT_TRUE(device_pool_bytes(f32.cache()) == device_pool_bytes(bf16.cache())) << "the pools differ after the steps";
  CUDA_OK(cudaGraphExecDestroy(exec));
  CUDA_OK(cudaGraphDestroy(graph));
  CUDA_OK(cudaStreamDestroy(s));
  std::printf("bfloat16 activations%s: 3 prefills and %zu graph-replayed steps equal to float32 rounded\n",
              tables ? " (level tables)" : "", steps.size());
}

TEST(GpuActivations, BFloat16EqualsRoundedFloat32) { check_bf16_equals_rounded_f32(false, 41); }
TEST(GpuActivations, BFloat16EqualsRoundedFloat32WithLevelTables) { check_bf16_equals_rounded_f32(true, 43); }

}  // namespace
}  // namespace kvcc
