// A whole decode step (every layer: append the new K/V, decode) captured in a CUDA graph on a
// non-default stream and replayed for later steps against the same steps run uncaptured by a
// second Runtime with the same options on identical inputs: outputs equal bit for bit, every
// output element written (NaN sentinels before each replay), and the two pools byte for byte equal
// at the end. The steps cross the sink's end, the ring's wrap and history page flushes, change
// the new-token counts (so the append's rows, moves and window writes) and the order of the
// sequences; only the number of sequences stays that of the captured step.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "formats/artifact.h"
#include "formats/error.h"
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

void captured_decode_step(bool kivi) {
  std::mt19937 rng(31);
  const Artifact art = gpu_runtime_artifact(rng, false, kivi);
  RuntimeOptions o;
  o.max_pages = 64;
  o.max_sequences = 3;
  o.memory = PoolMemory::Device;
  o.max_batch = 3;
  o.max_context = 512;
  o.max_step_tokens = 256;
  const EngineShape e{kLayers, kHeads, kKv, kD};
  Runtime plain(art, e, o), graphed(art, e, o);
  // Zeroed pools, so that untouched bytes compare equal too.
  for (Runtime* rt : {&plain, &graphed}) CUDA_OK(cudaMemset(rt->cache().pages_base(), 0, rt->cache().pool_bytes()));
  std::vector<int> seqs;
  for (int i = 0; i < 3; ++i) {
    seqs.push_back(plain.cache().add_sequence());
    ASSERT_EQ(graphed.cache().add_sequence(), seqs.back());
  }
  cudaStream_t sp, sg;
  CUDA_OK(cudaStreamCreateWithFlags(&sp, cudaStreamNonBlocking));
  CUDA_OK(cudaStreamCreateWithFlags(&sg, cudaStreamNonBlocking));
  const size_t kv_row = size_t(kKv) * kD, q_row = size_t(kHeads) * kD;
  // Per layer: the step's K, V (up to max_step_tokens rows), q and the two outputs, at fixed
  // addresses (a graph replays the addresses it captured; each step writes new values there).
  std::vector<DeviceBuffer<float>> k, v, q, out_p, out_g;
  for (int l = 0; l < kLayers; ++l) {
    k.emplace_back(size_t(o.max_step_tokens) * kv_row);
    v.emplace_back(size_t(o.max_step_tokens) * kv_row);
    q.emplace_back(size_t(o.max_batch) * q_row);
    out_p.emplace_back(size_t(o.max_batch) * q_row);
    out_g.emplace_back(size_t(o.max_batch) * q_row);
  }
  auto set_inputs = [&](int rows, bool with_q) {
    CUDA_OK(cudaDeviceSynchronize());  // the last step has read the inputs
    for (int l = 0; l < kLayers; ++l) {
      k[size_t(l)].upload(random_rows(size_t(rows) * kv_row, rng, true));
      v[size_t(l)].upload(random_rows(size_t(rows) * kv_row, rng, false));
      if (with_q) q[size_t(l)].upload(random_rows(size_t(o.max_batch) * q_row, rng, false));
    }
    CUDA_OK(cudaDeviceSynchronize());  // copies on the legacy stream, the steps on non-blocking ones
  };
  // History before the decode steps: sequence 0 two tokens short of the sink's end, 1 three short
  // of its first flush (post-sink 65 tokens), 2 four short of its third, the ring about to wrap.
  const std::vector<std::pair<std::vector<int>, std::vector<int>>> fill = {{{0, 1, 2}, {14, 78, 100}}, {{2}, {105}}};
  for (const auto& [s, c] : fill) {
    int rows = 0;
    for (int x : c) rows += x;
    set_inputs(rows, false);
    for (Runtime* rt : {&plain, &graphed}) {
      const cudaStream_t st = rt == &plain ? sp : sg;
      rt->begin_append(s, c, st);
      for (int l = 0; l < kLayers; ++l) rt->append(l, k[size_t(l)].data(), v[size_t(l)].data(), st);
    }
  }
  CUDA_OK(cudaStreamSynchronize(sp));
  CUDA_OK(cudaStreamSynchronize(sg));
  std::vector<KvTiers> before;
  for (int s : seqs) before.push_back(tiers_of(plain.geometry(), plain.cache().length(s)));

  struct Step {
    std::vector<int> seqs, counts;
  };
  const std::vector<Step> steps = {{{0, 1, 2}, {1, 1, 1}},  {{0, 1, 2}, {1, 1, 1}}, {{0, 1, 2}, {2, 1, 3}},
                                   {{2, 0, 1}, {1, 1, 1}},  {{0, 1, 2}, {1, 1, 1}}, {{1, 2, 0}, {1, 1, 1}},
                                   {{0, 1, 2}, {1, 1, 1}},  {{0, 1, 2}, {1, 1, 1}}, {{0, 1, 2}, {1, 1, 1}},
                                   {{0, 1, 2}, {70, 1, 1}}, {{0, 1, 2}, {1, 1, 1}}};
  cudaGraphExec_t exec = nullptr;
  cudaGraph_t graph = nullptr;
  const size_t n_out = size_t(o.max_batch) * q_row;
  for (size_t si = 0; si < steps.size(); ++si) {
    const Step& st = steps[si];
    int rows = 0;
    for (int x : st.counts) rows += x;
    set_inputs(rows, true);
    // The uncaptured Runtime.
    plain.begin_append(st.seqs, st.counts, sp);
    for (int l = 0; l < kLayers; ++l) {
      plain.append(l, k[size_t(l)].data(), v[size_t(l)].data(), sp);
      plain.decode(l, st.seqs, q[size_t(l)].data(), out_p[size_t(l)].data(), sp);
    }
    // The graph: NaN sentinels, the step's plan uploaded outside the capture, then the replay.
    for (int l = 0; l < kLayers; ++l) CUDA_OK(cudaMemsetAsync(out_g[size_t(l)].data(), 0xff, n_out * 4, sg));
    graphed.begin_append(st.seqs, st.counts, sg);
    if (!exec) {
      CUDA_OK(cudaStreamBeginCapture(sg, cudaStreamCaptureModeGlobal));
      for (int l = 0; l < kLayers; ++l) {
        graphed.append(l, k[size_t(l)].data(), v[size_t(l)].data(), sg);
        graphed.decode(l, st.seqs, q[size_t(l)].data(), out_g[size_t(l)].data(), sg);
      }
      CUDA_OK(cudaStreamEndCapture(sg, &graph));
      CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    }
    CUDA_OK(cudaGraphLaunch(exec, sg));
    CUDA_OK(cudaStreamSynchronize(sp));
    CUDA_OK(cudaStreamSynchronize(sg));
    for (int l = 0; l < kLayers; ++l) {
      const std::vector<float> want = out_p[size_t(l)].download(), got = out_g[size_t(l)].download();
      size_t nan = 0, differ = 0;
      for (size_t i = 0; i < n_out; ++i) {
        nan += std::isnan(got[i]) || std::isnan(want[i]);
        differ += std::memcmp(&got[i], &want[i], 4) != 0;
      }
      ASSERT_EQ(nan, 0u) << "step " << si << " layer " << l << ": output elements not written";
      ASSERT_EQ(differ, 0u) << "step " << si << " layer " << l << ": replay differs from the uncaptured step";
    }
  }
  // The steps crossed what they were meant to: the sink's end, history flushes, the ring's wrap.
  const KvGeometry& g = plain.geometry();
  std::vector<KvTiers> after;
  for (int s : seqs) after.push_back(tiers_of(g, plain.cache().length(s)));
  EXPECT_LT(before[0].sink_count, g.sink);
  EXPECT_EQ(after[0].sink_count, g.sink);
  EXPECT_GT(after[0].hist_tokens, before[0].hist_tokens);  // the 70-token step flushes sequence 0
  EXPECT_GT(after[1].hist_tokens, before[1].hist_tokens);
  EXPECT_GT(after[2].hist_tokens, before[2].hist_tokens);
  // Post-sink token i sits in ring slot i % recent: the slot index wraps between the two.
  EXPECT_LT((before[2].hist_tokens + before[2].ring_count) / g.recent,
            (after[2].hist_tokens + after[2].ring_count) / g.recent)
      << "the ring of sequence 2 wraps during the steps";
  for (int s : seqs) EXPECT_EQ(plain.cache().length(s), graphed.cache().length(s));
  EXPECT_TRUE(device_pool_bytes(plain.cache()) == device_pool_bytes(graphed.cache())) << "the pools differ";
  // A step beyond the maxima is refused, the cache unchanged.
  const int64_t len0 = graphed.cache().length(0);
  EXPECT_THROW(graphed.begin_append({0, 1, 2}, {200, 50, 7}, sg), Error);  // 257 tokens
  EXPECT_EQ(graphed.cache().length(0), len0);
  CUDA_OK(cudaGraphExecDestroy(exec));
  CUDA_OK(cudaGraphDestroy(graph));
  CUDA_OK(cudaStreamDestroy(sp));
  CUDA_OK(cudaStreamDestroy(sg));
  std::printf("graph replay: %zu steps of %d layers equal to the uncaptured runtime bit for bit\n", steps.size(),
              kLayers);
}

TEST(GpuGraph, CapturedDecodeStepReplaysBitForBit) { captured_decode_step(false); }
TEST(GpuGraph, CapturedDecodeStepPerChannelKeysReplaysBitForBit) { captured_decode_step(true); }

}  // namespace
}  // namespace kvcc
