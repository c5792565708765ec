// Token eviction's page compaction (Runtime::evict_tokens on a device pool) against one decode
// step at the same length, both through the public Runtime API with host work included: a
// sequence filled to ctx tokens, then (a) the mean of `steps` decode steps (begin_append of one
// token, per layer append + decode), and (b) evict_tokens keeping a random `keep` fraction of the
// positions, wall time to the stream's end, on a fork of the sequence (every page shared, so all
// kept rows go to fresh pages) and on a sequence of its own filled afresh per repetition (the
// same rows move each time), and (c) the tokens' attention scores over an observation window of
// 32 queries (Runtime::attention_scores) for every layer. The issue's goal: (b) on its own
// sequence < (a). Options: bench_compact --help.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "bench/bench_args.h"
#include "formats/artifact.h"
#include "runtime/kv_cache.h"
#include "runtime/kvcc_runtime.h"

using namespace kvcc;

namespace {

void ck(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "bench_compact: CUDA (%s): %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

float* device_random(size_t n, std::mt19937& rng) {
  std::normal_distribution<float> n01;
  std::vector<float> h(n);
  for (float& x : h) x = n01(rng);
  float* d = nullptr;
  ck(cudaMalloc(&d, n * sizeof(float)), "cudaMalloc");
  ck(cudaMemcpy(d, h.data(), n * sizeof(float), cudaMemcpyHostToDevice), "cudaMemcpy");
  return d;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int run(int ctx, int layers, int hq, int hkv, double keep, int reps) {
  const int steps = 20;
  const int d = 128;
  std::mt19937 rng(11);
  // Identity rotations (compaction moves stored rows and never rotates; the step pays its
  // rotations either way).
  Artifact art;
  art.n_layers = layers;
  art.n_heads = hq;
  art.n_kv_heads = hkv;
  art.head_dim = d;
  art.recipe.method = "oscar";
  std::vector<double> eye(size_t(d) * d, 0.0);
  for (int i = 0; i < d; ++i) eye[size_t(i) * d + i] = 1.0;
  for (int i = 0; i < layers * hkv; ++i) {
    HeadArtifact h;
    h.key.rotation = h.value.rotation = eye;
    h.key.clip_ratio = h.value.clip_ratio = 0.95;
    art.heads.push_back(h);
  }
  RuntimeOptions o;
  const int64_t pages_per_seq = (ctx + steps + 64) / 64 + 2;
  o.max_pages = pages_per_seq * (reps + 2);
  o.max_sequences = reps + 2;
  o.memory = PoolMemory::Device;
  Runtime rt(art, EngineShape{layers, hq, hkv, d}, o);
  cudaStream_t s;
  ck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
  const int seq = rt.cache().add_sequence();
  const int chunk = 8192;
  float* kv = device_random(size_t(chunk) * hkv * d, rng);
  for (int done = 0; done < ctx; done += chunk) {
    const int n = std::min(chunk, ctx - done);
    rt.begin_append({seq}, {n}, s);
    for (int l = 0; l < layers; ++l) rt.append(l, kv, kv, s);
  }
  ck(cudaStreamSynchronize(s), "fill");

  // (b) first, on forks of the filled sequence (a decode step would change its length).
  std::vector<int64_t> kept;
  for (int64_t t = 0; t < ctx; ++t)
    if (std::uniform_real_distribution<double>(0, 1)(rng) < keep) kept.push_back(t);
  const int64_t pages_before = rt.cache().pages_in_use();
  double compact_s = 0;
  int64_t released = 0;
  for (int r = 0; r < reps; ++r) {
    // A fork shares every page, so its compaction writes fresh pages (the shared-page path, as
    // for an engine's forked prefix) and leaves the parent intact for the next repetition.
    const int f = rt.cache().fork(seq, s);
    ck(cudaStreamSynchronize(s), "fork");
    const auto t0 = std::chrono::steady_clock::now();
    released = rt.evict_tokens(f, kept, s);
    ck(cudaStreamSynchronize(s), "evict");
    compact_s += seconds_since(t0);
    rt.cache().free_sequence(f);
  }
  // The host's share: planning alone (plan_compaction changes nothing).
  const auto tp = std::chrono::steady_clock::now();
  for (int r = 0; r < reps; ++r) (void)rt.cache().plan_compaction(seq, kept);
  const double plan_s = seconds_since(tp) / reps;
  // (b') without sharing: a sequence of its own, filled afresh for each repetition; the host's
  // time to return from evict_tokens and the stream's time (events) beside the wall time.
  auto fill = [&](int sq) {
    for (int done = 0; done < ctx; done += chunk) {
      const int n = std::min(chunk, ctx - done);
      rt.begin_append({sq}, {n}, s);
      for (int l = 0; l < layers; ++l) rt.append(l, kv, kv, s);
    }
    ck(cudaStreamSynchronize(s), "fill");
  };
  cudaEvent_t e0, e1;
  ck(cudaEventCreate(&e0), "event");
  ck(cudaEventCreate(&e1), "event");
  double own_s = 0, own_host_s = 0, own_gpu_s = 0;
  int64_t released_own = 0;
  for (int r = 0; r < reps; ++r) {
    const int sq = rt.cache().add_sequence();
    fill(sq);
    const auto t1 = std::chrono::steady_clock::now();
    ck(cudaEventRecord(e0, s), "event");
    released_own = rt.evict_tokens(sq, kept, s);
    own_host_s += seconds_since(t1);
    ck(cudaEventRecord(e1, s), "event");
    ck(cudaStreamSynchronize(s), "evict own");
    own_s += seconds_since(t1);
    float ms = 0;
    ck(cudaEventElapsedTime(&ms, e0, e1), "event");
    own_gpu_s += ms * 1e-3;
    rt.cache().free_sequence(sq);
  }
  own_s /= reps;
  own_host_s /= reps;
  own_gpu_s /= reps;

  // (a) decode steps on a fresh sequence of the same length.
  const int seq2 = rt.cache().add_sequence();
  fill(seq2);
  float* q = device_random(size_t(hq) * d, rng);
  float* k1 = device_random(size_t(hkv) * d, rng);
  float* out = nullptr;
  ck(cudaMalloc(&out, size_t(hq) * d * sizeof(float)), "cudaMalloc");
  auto step = [&] {
    rt.begin_append({seq2}, {1}, s);
    for (int l = 0; l < layers; ++l) {
      rt.append(l, k1, k1, s);
      rt.decode(l, {seq2}, q, out, s);
    }
  };
  for (int i = 0; i < 3; ++i) step();
  ck(cudaStreamSynchronize(s), "warm-up");
  const auto t2 = std::chrono::steady_clock::now();
  for (int i = 0; i < steps; ++i) step();
  ck(cudaStreamSynchronize(s), "steps");
  const double step_s = seconds_since(t2) / steps;

  // (c) SnapKV's token scores read from the cache (attention_scores over an observation window of
  // W = 32 queries), every layer of the same sequence: what ranking the tokens costs before (b).
  const int W = 32;
  const int64_t n_scored = rt.cache().length(seq2);
  float* qw = device_random(size_t(W) * hq * d, rng);
  float* scores = nullptr;
  ck(cudaMalloc(&scores, size_t(hkv) * size_t(n_scored) * sizeof(float)), "cudaMalloc");
  auto score_all = [&] {
    for (int l = 0; l < layers; ++l) rt.attention_scores(l, seq2, W, qw, scores, s);
  };
  score_all();
  ck(cudaStreamSynchronize(s), "warm-up scores");
  const auto t3 = std::chrono::steady_clock::now();
  for (int r = 0; r < reps; ++r) score_all();
  ck(cudaStreamSynchronize(s), "scores");
  const double scores_s = seconds_since(t3) / reps;

  std::printf(
      "compact %d/%d heads, %d layers, ctx %d, keep %.2f (%zu tokens): evict_tokens %.1f us on a fork "
      "(shared pages; returned %lld), %.1f us on a sequence of its own (host returns after %.1f us, stream "
      "%.1f us; %lld pages released of %lld in use); host planning %.1f us; one decode step at ctx %d: %.1f us; "
      "ratio own/step %.2f\n",
      hq, hkv, layers, ctx, keep, kept.size(), compact_s / reps * 1e6, static_cast<long long>(released), own_s * 1e6,
      own_host_s * 1e6, own_gpu_s * 1e6, static_cast<long long>(released_own), static_cast<long long>(pages_before),
      plan_s * 1e6, ctx, step_s * 1e6, own_s / step_s);
  std::printf(
      "scores %d/%d heads, %d layers, ctx %lld, W %d: attention_scores %.1f us for all layers (%.1f us a layer); "
      "ratio to one decode step %.2f\n",
      hq, hkv, layers, static_cast<long long>(n_scored), W, scores_s * 1e6, scores_s * 1e6 / layers, scores_s / step_s);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  for (float* p : {kv, q, k1, out, qw, scores}) cudaFree(p);
  cudaStreamDestroy(s);
  return 0;
}

int main(int argc, char** argv) {
  int ctx = 32768, layers = 32, hq = 32, hkv = 8, reps = 5;
  double keep = 0.1;
  bench::Args("bench_compact",
              "Token eviction's page compaction (Runtime::evict_tokens) against a decode step at the same length,\n"
              "and the tokens' attention scores, through the public Runtime API on a Hopper GPU.")
      .option("--ctx", &ctx, "tokens the sequence is filled to", 1)
      .option("--layers", &layers, "layers", 1)
      .option("--hq", &hq, "query heads (a multiple of --hkv)", 1)
      .option("--hkv", &hkv, "KV heads", 1)
      .option("--keep", &keep, "fraction of the positions kept", 0.0, 1.0)
      .option("--reps", &reps, "compactions timed", 1)
      .example("bench_compact --ctx 32768 --keep 0.1")
      .parse(argc, argv);
  if (hq % hkv != 0) {
    std::fprintf(stderr, "bench_compact: --hq (%d) must be a multiple of --hkv (%d)\n", hq, hkv);
    return 2;
  }
  try {
    return run(ctx, layers, hq, hkv, keep, reps);
  } catch (const std::exception& e) {  // the runtime's errors (kvcc::Error), e.g. no Hopper GPU
    std::fprintf(stderr, "bench_compact: %s\n", e.what());
    return 1;
  }
}
