// Attention-based token scores on a device pool (runtime/scores.cu) against the CPU reference
// (attention_scores_ref through a host Runtime holding the device pool's bytes): sequences whose lengths end in
// the sink, just past a flush, mid-history and across many 64-token tiles, observation windows of
// 1 to 96 queries, uniform-grid and level-table codecs, float32 and bfloat16 queries; every score
// written (NaN sentinels), a second run bit for bit the first.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "formats/artifact.h"
#include "formats/fp16.h"
#include "runtime/device_buffer.h"
#include "runtime/kvcc_runtime.h"
#include "cache_test_util.h"
#include "gpu_test_util.h"

namespace kvcc {
namespace {

using testing::gpu_runtime_artifact;
using testing::random_rows;

constexpr int kD = kGpuHeadDim;
constexpr int kLayers = 2, kHeads = 16, kKv = 4, kR = kHeads / kKv;

void check_scores(bool tables, Activations act, unsigned seed) {
  std::mt19937 rng(seed);
  const Artifact art = gpu_runtime_artifact(rng, tables);
  RuntimeOptions o;
  o.max_pages = 128;
  o.max_sequences = 4;
  o.activations = act;
  const EngineShape e{kLayers, kHeads, kKv, kD};
  o.memory = PoolMemory::Host;
  Runtime host(art, e, o);
  o.memory = PoolMemory::Device;
  Runtime dev(art, e, o);
  const bool bf = act == Activations::BFloat16;
  // Activations as the runtime takes them: bfloat16 bits, or floats.
  auto as_act = [&](const std::vector<float>& x) {
    std::vector<uint16_t> b(x.size());
    for (size_t i = 0; i < x.size(); ++i) b[i] = bf16_from_float(x[i]);
    return b;
  };
  // Sink 16, ring 64, pages of 64: 9 tokens stay in the sink; 16 + 64 + 64 + 1 has just flushed
  // one page; 1500 and 3001 hold many pages and tiles (3001: a partial last tile).
  const std::vector<int64_t> lengths = {9, 16 + 64 + 64 + 1, 1500, 3001};
  const size_t kv_row = size_t(kKv) * kD, q_row = size_t(kHeads) * kD;
  for (size_t i = 0; i < lengths.size(); ++i) {
    ASSERT_EQ(host.cache().add_sequence(), dev.cache().add_sequence());
    const int seq = int(i);
    for (int64_t at = 0; at < lengths[i]; at += 700) {
      const int cnt = int(std::min<int64_t>(700, lengths[i] - at));
      host.begin_append({seq}, {cnt});
      dev.begin_append({seq}, {cnt});
      for (int l = 0; l < kLayers; ++l) {
        const auto k = random_rows(size_t(cnt) * kv_row, rng, true), v = random_rows(k.size(), rng, false);
        if (bf) {
          const auto kb = as_act(k), vb = as_act(v);
          host.append(l, kb.data(), vb.data());
          DeviceBuffer<uint16_t> dk(kb), dv(vb);
          dev.append(l, dk.data(), dv.data());
        } else {
          host.append(l, k.data(), v.data());
          DeviceBuffer<float> dk(k), dv(v);
          dev.append(l, dk.data(), dv.data());
        }
        CUDA_OK(cudaDeviceSynchronize());
      }
    }
  }
  // The device rotates K/V with its own float32 arithmetic, so a stored BF16 element may round to
  // the other neighbour than the host's: the reference reads the device's own bytes (same page
  // ids: the bookkeeping is shared), so the comparison below is of the scores' arithmetic alone.
  for (size_t i = 0; i < lengths.size(); ++i)
    ASSERT_EQ(host.cache().page_table(int(i)), dev.cache().page_table(int(i)));
  CUDA_OK(cudaMemcpy(host.cache().pages_base(), dev.cache().pages_base(), dev.cache().pool_bytes(),
                     cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < lengths.size(); ++i) {
    const int64_t n = lengths[i];
    for (const int W : {1, 7, 32, 96}) {
      if (W > n) continue;
      const int l = (W + int(i)) % kLayers;
      SCOPED_TRACE("length " + std::to_string(n) + " W " + std::to_string(W) + " layer " + std::to_string(l));
      // Queries 3x a unit normal: logits of several units, so the weights are far from uniform.
      auto q = random_rows(size_t(W) * q_row, rng, false);
      for (float& x : q) x *= 3.0f;
      std::vector<float> want(size_t(kKv) * size_t(n)), got(want.size()), again(want.size());
      DeviceBuffer<float> scores(want.size());
      auto run = [&](std::vector<float>& out) {
        CUDA_OK(cudaMemset(scores.data(), 0xff, scores.bytes()));  // NaN sentinels
        if (bf) {
          const auto qb = as_act(q);
          DeviceBuffer<uint16_t> dq(qb);
          dev.attention_scores(l, int(i), W, dq.data(), scores.data());
        } else {
          DeviceBuffer<float> dq(q);
          dev.attention_scores(l, int(i), W, dq.data(), scores.data());
        }
        CUDA_OK(cudaDeviceSynchronize());
        CUDA_OK(cudaMemcpy(out.data(), scores.data(), scores.bytes(), cudaMemcpyDeviceToHost));
      };
      run(got);
      run(again);
      if (bf) {
        const auto qb = as_act(q);
        host.attention_scores(l, int(i), W, qb.data(), want.data());
      } else {
        host.attention_scores(l, int(i), W, q.data(), want.data());
      }
      size_t nan = 0, bad = 0;
      double worst = 0, sum = 0;
      for (size_t j = 0; j < want.size(); ++j) {
        if (std::isnan(got[j])) {
          ++nan;
          continue;
        }
        // Float32 logits (128-term dots of |s| up to ~30, the scale folded into q) against the
        // reference's float64: a few 1e-6 relative in each weight, summed over W·r weights.
        const double err = std::fabs(double(got[j]) - want[j]), tol = 1e-4 * want[j] + 1e-6 * W * kR;
        bad += err > tol;
        worst = std::max(worst, err / (want[j] + 1e-6 * W * kR));
        if (j < size_t(n)) sum += got[j];
      }
      EXPECT_EQ(nan, 0u) << "scores not written";
      EXPECT_EQ(bad, 0u) << "worst relative error " << worst;
      EXPECT_NEAR(sum, double(W) * kR, 1e-4 * W * kR) << "head 0's scores do not sum to W·r";
      EXPECT_EQ(got, again) << "a second run differs";
    }
  }
}

TEST(GpuScores, MatchTheReferenceUniformGrid) { check_scores(false, Activations::Float32, 71); }
TEST(GpuScores, MatchTheReferenceLevelTables) { check_scores(true, Activations::Float32, 72); }
TEST(GpuScores, MatchTheReferenceBFloat16Queries) { check_scores(true, Activations::BFloat16, 73); }

}  // namespace
}  // namespace kvcc
