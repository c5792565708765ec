// A whole decode step through the public Runtime API, as an engine calls it: begin_append (one
// new token per sequence), then per layer append(layer) + decode(layer) on one stream, host work
// included (wall time from the first call to the stream's end, over many steps). Only the public
// API is used, so the same file times an older tree's Runtime (scripts/gpu_run.sh BEFORE_TREE).
// With --modes: `plain` (no maxima declared), `fixed` (maxima declared: workspace and tables sized
// at load, fixed grids) and `graph` (maxima declared, every layer's append + decode captured once
// in a CUDA graph, then begin_append + one graph launch per step) and `graph-bf16` (the same with
// RuntimeOptions::activations = BFloat16: q, k, v and out in bfloat16, as engines hold them).
// Modes other than plain need a Runtime with RuntimeOptions::max_context.
//
// usage: bench_step [--configs Hq:Hkv:batch:ctx,...] [--layers L] [--steps N]
//                   [--modes plain,fixed,graph,graph-bf16]
#include <cuda_runtime.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "formats/artifact.h"
#include "formats/fp16.h"
#include "runtime/kv_cache.h"
#include "runtime/kvcc_runtime.h"

using namespace kvcc;

namespace {

void ck(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

// A random orthogonal d x d matrix (Gram-Schmidt of Gaussian rows), row-major.
std::vector<double> random_orthogonal(int d, std::mt19937& rng) {
  std::normal_distribution<double> n01;
  std::vector<double> m(size_t(d) * d);
  for (double& x : m) x = n01(rng);
  for (int i = 0; i < d; ++i) {
    double* r = m.data() + size_t(i) * d;
    for (int j = 0; j < i; ++j) {
      const double* q = m.data() + size_t(j) * d;
      double dot = 0;
      for (int c = 0; c < d; ++c) dot += r[c] * q[c];
      for (int c = 0; c < d; ++c) r[c] -= dot * q[c];
    }
    double norm = 0;
    for (int c = 0; c < d; ++c) norm += r[c] * r[c];
    norm = std::sqrt(norm);
    for (int c = 0; c < d; ++c) r[c] /= norm;
  }
  return m;
}

// n standard normal activations on the device, float32 or (bf16) bfloat16.
void* device_random(size_t n, std::mt19937& rng, bool bf16) {
  std::normal_distribution<float> n01;
  std::vector<float> h(n);
  for (float& x : h) x = n01(rng);
  std::vector<uint16_t> b(bf16 ? n : 0);
  for (size_t i = 0; i < b.size(); ++i) b[i] = bf16_from_float(h[i]);
  void* d = nullptr;
  const size_t bytes = n * (bf16 ? 2 : 4);
  ck(cudaMalloc(&d, bytes), "cudaMalloc");
  ck(cudaMemcpy(d, bf16 ? static_cast<const void*>(b.data()) : h.data(), bytes, cudaMemcpyHostToDevice), "cudaMemcpy");
  return d;
}

// begin_append on the benchmark's stream where the Runtime takes one (older Runtimes did no device
// work there and take none).
template <class R>
auto begin_step(R& rt, const std::vector<int>& seqs, const std::vector<int>& counts, cudaStream_t s, int)
    -> decltype(rt.begin_append(seqs, counts, static_cast<void*>(s)), void()) {
  rt.begin_append(seqs, counts, static_cast<void*>(s));
}
template <class R>
void begin_step(R& rt, const std::vector<int>& seqs, const std::vector<int>& counts, cudaStream_t, long) {
  rt.begin_append(seqs, counts);
}

enum class Mode { Plain, Fixed, Graph, GraphBf16 };

// New tokens per fill step: the declared max_step_tokens too (so the decode steps' append grids
// are sized for a step of 8192 tokens, as an engine's that also prefills through this Runtime).
constexpr int kChunk = 8192;

// The maxima, where this tree's RuntimeOptions has them; false where it does not (an older tree:
// plain mode only).
template <class O>
auto declare(O& o, int batch, int64_t context, int) -> decltype(o.max_context, bool()) {
  o.max_batch = batch;
  o.max_context = context;
  o.max_step_tokens = kChunk;
  return true;
}
template <class O>
bool declare(O&, int, int64_t, long) {
  return false;
}

void run(int hq, int hkv, int batch, int ctx, int layers, int steps, Mode mode) {
  const int d = 128;
  std::mt19937 rng(7);
  Artifact art;
  art.n_layers = layers;
  art.n_heads = hq;
  art.n_kv_heads = hkv;
  art.head_dim = d;
  art.recipe.method = "oscar";
  for (int i = 0; i < layers * hkv; ++i) {
    HeadArtifact h;
    h.key.rotation = random_orthogonal(d, rng);
    h.value.rotation = random_orthogonal(d, rng);
    h.key.clip_ratio = h.value.clip_ratio = 0.95;
    art.heads.push_back(h);
  }
  const EngineShape e{layers, hq, hkv, d};
  RuntimeOptions o;
  o.max_pages = int64_t(batch) * ((ctx + steps + 64) / 64 + 1);
  o.max_sequences = batch;
  o.memory = PoolMemory::Device;
  // Room for the warm-up, the timed steps and (graph) the captured one.
  if (mode != Mode::Plain && !declare(o, batch, int64_t(ctx) + steps + 8, 0)) {
    std::printf("step %d/%d b=%-3d ctx=%-7d: this Runtime has no declared maxima\n", hq, hkv, batch, ctx);
    return;
  }
  const bool bf16 = mode == Mode::GraphBf16;
  if (bf16) o.activations = Activations::BFloat16;
  Runtime rt(art, e, o);
  cudaStream_t s;
  ck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
  std::vector<int> seqs;
  for (int b = 0; b < batch; ++b) seqs.push_back(rt.cache().add_sequence());
  // Fill every sequence to ctx tokens, in chunks (random K/V rows).
  const int chunk = kChunk;
  void* kv = device_random(size_t(chunk) * hkv * d, rng, bf16);
  for (int b = 0; b < batch; ++b)
    for (int done = 0; done < ctx; done += chunk) {
      const int n = std::min(chunk, ctx - done);
      begin_step(rt, {seqs[size_t(b)]}, {n}, s, 0);
      for (int l = 0; l < layers; ++l) rt.append(l, kv, kv, s);
    }
  ck(cudaStreamSynchronize(s), "fill");
  void* k1 = device_random(size_t(batch) * hkv * d, rng, bf16);
  void* v1 = device_random(size_t(batch) * hkv * d, rng, bf16);
  void* q = device_random(size_t(batch) * hq * d, rng, bf16);
  void* out = nullptr;
  ck(cudaMalloc(&out, size_t(batch) * hq * d * sizeof(float)), "cudaMalloc");
  const std::vector<int> ones(size_t(batch), 1);
  auto step = [&] {
    begin_step(rt, seqs, ones, s, 0);
    for (int l = 0; l < layers; ++l) {
      rt.append(l, k1, v1, s);
      rt.decode(l, seqs, q, out, s);
    }
  };
  // Graph mode: the first step's layers captured once; each step is then begin_append (host plan,
  // one upload) and a launch of the graph.
  cudaGraphExec_t exec = nullptr;
  auto graph_step = [&] {
    begin_step(rt, seqs, ones, s, 0);
    if (!exec) {
      cudaGraph_t g;
      ck(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), "capture");
      for (int l = 0; l < layers; ++l) {
        rt.append(l, k1, v1, s);
        rt.decode(l, seqs, q, out, s);
      }
      ck(cudaStreamEndCapture(s, &g), "capture end");
      ck(cudaGraphInstantiate(&exec, g, 0), "graph instantiate");
      ck(cudaGraphDestroy(g), "graph destroy");
    }
    ck(cudaGraphLaunch(exec, s), "graph launch");
  };
  auto one = [&] { mode == Mode::Graph || mode == Mode::GraphBf16 ? graph_step() : step(); };
  for (int i = 0; i < 3; ++i) one();  // warm-up
  ck(cudaStreamSynchronize(s), "warm-up");
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < steps; ++i) one();
  ck(cudaStreamSynchronize(s), "steps");
  const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
  const char* name = mode == Mode::Plain   ? ""
                     : mode == Mode::Fixed ? " [fixed]"
                     : mode == Mode::Graph ? " [graph]"
                                           : " [graph-bf16]";
  std::printf("step %d/%d b=%-3d ctx=%-7d %d layers: %.1f us per layer (append + decode, host work included)%s\n", hq,
              hkv, batch, ctx, layers, us / steps / layers, name);
  if (exec) cudaGraphExecDestroy(exec);
  for (void* p : {kv, k1, v1, q, out}) cudaFree(p);
  cudaStreamDestroy(s);
}

}  // namespace

int main(int argc, char** argv) {
  std::string configs = "32:8:1:32768,32:8:8:131072,32:8:64:32768";
  int layers = 4, steps = 50;
  std::string modes = "plain";
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--configs")) configs = argv[i + 1];
    if (!std::strcmp(argv[i], "--modes")) modes = argv[i + 1];
    if (!std::strcmp(argv[i], "--layers")) layers = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--steps")) steps = std::atoi(argv[i + 1]);
  }
  std::stringstream ss(configs);
  std::string item;
  while (std::getline(ss, item, ',')) {
    int hq, hkv, batch, ctx;
    if (std::sscanf(item.c_str(), "%d:%d:%d:%d", &hq, &hkv, &batch, &ctx) != 4) {
      std::fprintf(stderr, "bad config %s\n", item.c_str());
      return 1;
    }
    try {
      std::stringstream ms(modes);
      std::string m;
      while (std::getline(ms, m, ',')) {
        if (m != "plain" && m != "fixed" && m != "graph" && m != "graph-bf16") {
          std::fprintf(stderr, "bad mode %s (plain, fixed, graph or graph-bf16)\n", m.c_str());
          return 1;
        }
        run(hq, hkv, batch, ctx, layers, steps,
            m == "plain"   ? Mode::Plain
            : m == "fixed" ? Mode::Fixed
            : m == "graph" ? Mode::Graph
                           : Mode::GraphBf16);
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s: %s\n", item.c_str(), e.what());
      return 1;
    }
  }
  return 0;
}
