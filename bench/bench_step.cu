// A whole decode step through the public Runtime API, as an engine calls it: begin_append (one
// new token per sequence), then per layer append(layer) + decode(layer) on one stream, host work
// included (wall time from the first call to the stream's end, over many steps). Only the public
// API is used, so the same file times an older tree's Runtime (scripts/gpu_run.sh BEFORE_TREE).
// With --modes: `plain` (no maxima declared), `fixed` (maxima declared: workspace and tables sized
// at load, fixed grids) and `graph` (maxima declared, every layer's append + decode captured once
// in a CUDA graph, then begin_append + one graph launch per step) and `graph-bf16` (the same with
// RuntimeOptions::activations = BFloat16: q, k, v and out in bfloat16, as engines hold them).
// `engine-graph-bf16` (RuntimeOptions::engine_tables: the engine's block table and lengths on the
// device; the whole step, begin_step's planning kernel included, captured once and replayed; per
// step the engine copies the new lengths from pinned host memory, then launches the graph).
// Modes other than plain need a Runtime with RuntimeOptions::max_context. Options: bench_step --help.
#include <cuda_runtime.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "bench/bench_args.h"
#include "formats/artifact.h"
#include "formats/fp16.h"
#include "runtime/kv_cache.h"
#include "runtime/kvcc_runtime.h"
#if __has_include("runtime/engine_step.h")
#define KVCC_BENCH_ENGINE 1  // this tree's Runtime takes an engine's tables
#endif

using namespace kvcc;

namespace {

void ck(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "bench_step: CUDA (%s): %s\n", what, cudaGetErrorString(e));
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

enum class Mode { Plain, Fixed, Graph, GraphBf16, EngineGraphBf16 };

// New tokens per fill step: the declared max_step_tokens too (so the decode steps' append grids
// are sized for a step of that many tokens, as an engine's that also prefills through this
// Runtime); --step-tokens.
int kChunk = 8192;
// --append-only: the steps run every layer's append and no decode (what a step's append costs).
bool g_append_only = false;
// --prefill-tokens P (plain and fixed modes): chunked-prefill steps instead of decode steps, every
// sequence P new tokens, per layer one prefill(layer, seqs, counts) of the whole batch (a ragged
// batch), or with --prefill-batched 0 prefill(layer, seq, P) for each sequence; then append(layer).
int g_prefill_tokens = 0;
bool g_prefill_batched = true;

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

const char* what() {
  static char buf[128];
  if (g_prefill_tokens > 0)
    std::snprintf(buf, sizeof buf, "prefill (%s) + append of %d tokens a sequence, step tokens %d",
                  g_prefill_batched ? "ragged batch" : "per sequence", g_prefill_tokens, kChunk);
  else
    std::snprintf(buf, sizeof buf, g_append_only ? "append only, step tokens %d" : "append + decode, step tokens %d",
                  kChunk);
  return buf;
}

#if defined(KVCC_BENCH_ENGINE)
// The engine-tables step: sequence b holds pages [b·stride, (b+1)·stride) of the pool (the
// engine's allocator), filled in chunks through begin_step, then timed decode steps.
void run_engine(const Artifact& art, const EngineShape& e, const RuntimeOptions& o, int batch, int ctx, int layers,
                int steps, cudaStream_t s, std::mt19937& rng) {
  Runtime rt(art, e, o);
  const int d = e.head_dim, hq = e.n_heads, hkv = e.n_kv_heads;
  const int stride = int(rt.history_pages(o.max_context));
  if (int64_t(batch) * stride > o.max_pages) {
    std::printf("engine step: pool of %lld pages below %d x %d\n", (long long)o.max_pages, batch, stride);
    return;
  }
  std::vector<int32_t> table(size_t(batch) * stride);
  for (size_t i = 0; i < table.size(); ++i) table[i] = int32_t(i);
  int32_t *d_slots, *d_lengths, *d_counts, *d_table, *h_lengths;
  ck(cudaMalloc(&d_slots, batch * 4), "cudaMalloc");
  ck(cudaMalloc(&d_lengths, batch * 4), "cudaMalloc");
  ck(cudaMalloc(&d_counts, batch * 4), "cudaMalloc");
  ck(cudaMalloc(&d_table, table.size() * 4), "cudaMalloc");
  ck(cudaMallocHost(&h_lengths, batch * 4), "cudaMallocHost");
  ck(cudaMemcpy(d_table, table.data(), table.size() * 4, cudaMemcpyHostToDevice), "cudaMemcpy");
  std::vector<int32_t> lengths(size_t(batch), 0);
  void* kv = device_random(size_t(kChunk) * hkv * d, rng, true);
  // Fill: one sequence per step, in chunks (its block table row and slot at index 0).
  for (int b = 0; b < batch; ++b)
    for (int done = 0; done < ctx; done += kChunk) {
      const int32_t n = std::min(kChunk, ctx - done), slot = b, len = done;
      ck(cudaMemcpy(d_slots, &slot, 4, cudaMemcpyHostToDevice), "cudaMemcpy");
      ck(cudaMemcpy(d_lengths, &len, 4, cudaMemcpyHostToDevice), "cudaMemcpy");
      ck(cudaMemcpy(d_counts, &n, 4, cudaMemcpyHostToDevice), "cudaMemcpy");
      rt.begin_step(EngineStep{1, d_slots, d_lengths, d_counts, d_table + size_t(b) * stride, stride}, s);
      for (int l = 0; l < layers; ++l) rt.append(l, kv, kv, s);
      ck(cudaStreamSynchronize(s), "fill");
    }
  std::vector<int32_t> slots(static_cast<size_t>(batch)), ones(static_cast<size_t>(batch), 1);
  for (int b = 0; b < batch; ++b) slots[size_t(b)] = b;
  ck(cudaMemcpy(d_slots, slots.data(), batch * 4, cudaMemcpyHostToDevice), "cudaMemcpy");
  ck(cudaMemcpy(d_counts, ones.data(), batch * 4, cudaMemcpyHostToDevice), "cudaMemcpy");
  for (int b = 0; b < batch; ++b) h_lengths[b] = ctx;
  void* k1 = device_random(size_t(batch) * hkv * d, rng, true);
  void* v1 = device_random(size_t(batch) * hkv * d, rng, true);
  void* q = device_random(size_t(batch) * hq * d, rng, true);
  void* out = nullptr;
  ck(cudaMalloc(&out, size_t(batch) * hq * d * 2), "cudaMalloc");
  const EngineStep step{batch, d_slots, d_lengths, d_counts, d_table, stride};
  cudaGraphExec_t exec = nullptr;
  {
    cudaGraph_t g;
    ck(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), "capture");
    rt.begin_step(step, s);
    for (int l = 0; l < layers; ++l) {
      rt.append(l, k1, v1, s);
      if (!g_append_only) rt.decode_step(l, q, out, s);
    }
    ck(cudaStreamEndCapture(s, &g), "capture end");
    ck(cudaGraphInstantiate(&exec, g, 0), "graph instantiate");
    ck(cudaGraphDestroy(g), "graph destroy");
  }
  // A step: the engine's lengths (pinned host) to the device, the graph; then lengths += 1.
  auto one = [&] {
    ck(cudaMemcpyAsync(d_lengths, h_lengths, batch * 4, cudaMemcpyHostToDevice, s), "lengths");
    ck(cudaGraphLaunch(exec, s), "graph launch");
    ck(cudaStreamSynchronize(s), "step");  // the host reads h_lengths' old values no more
    for (int b = 0; b < batch; ++b) ++h_lengths[b];
  };
  // The host waits for each step above only to reuse h_lengths; an engine double-buffers it, so
  // the timed loop does too (two pinned images), and only the last step is waited for.
  int32_t* h2 = nullptr;
  ck(cudaMallocHost(&h2, batch * 4), "cudaMallocHost");
  for (int i = 0; i < 3; ++i) one();  // warm-up
  const std::string problem = rt.step_problem(s);
  if (!problem.empty()) {
    std::printf("engine step: %s\n", problem.c_str());
    std::exit(1);
  }
  int32_t* img[2] = {h_lengths, h2};
  const int32_t base = h_lengths[0];  // ctx + the warm-up steps
  cudaEvent_t done[2];
  for (cudaEvent_t& ev : done) {
    ck(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "event");
    ck(cudaEventRecord(ev, s), "event");
  }
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < steps; ++i) {
    int32_t* h = img[i & 1];
    ck(cudaEventSynchronize(done[i & 1]), "event");  // the step two back has copied this image
    for (int b = 0; b < batch; ++b) h[b] = base + i;
    ck(cudaMemcpyAsync(d_lengths, h, batch * 4, cudaMemcpyHostToDevice, s), "lengths");
    ck(cudaGraphLaunch(exec, s), "graph launch");
    ck(cudaEventRecord(done[i & 1], s), "event");
  }
  ck(cudaStreamSynchronize(s), "steps");
  const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
  const std::string after = rt.step_problem(s);
  std::printf(
      "step %d/%d b=%-3d ctx=%-7d %d layers: %.1f us per layer (%s, host work included) "
      "[engine-graph-bf16]%s\n",
      hq, hkv, batch, ctx, layers, us / steps / layers, what(), after.empty() ? "" : (" " + after).c_str());
  for (cudaEvent_t ev : done) cudaEventDestroy(ev);
  cudaGraphExecDestroy(exec);
  for (void* p : {kv, k1, v1, q, out}) cudaFree(p);
  for (int32_t* p : {d_slots, d_lengths, d_counts, d_table}) cudaFree(p);
  cudaFreeHost(h_lengths);
  cudaFreeHost(h2);
}
#endif

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
  const int per = g_prefill_tokens > 0 ? g_prefill_tokens : 1;  // new tokens per sequence and step
  if (g_prefill_tokens > 0 && (mode == Mode::Graph || mode == Mode::GraphBf16 || mode == Mode::EngineGraphBf16)) {
    std::printf("step %d/%d b=%-3d ctx=%-7d: --prefill-tokens runs in plain and fixed modes only\n", hq, hkv, batch,
                ctx);
    return;
  }
  const int64_t grown = int64_t(steps + 8) * per;  // warm-up, timed steps, the captured one
  o.max_pages = int64_t(batch) * ((ctx + grown + 64) / 64 + 1);
  o.max_sequences = batch;
  o.memory = PoolMemory::Device;
  // Room for the warm-up, the timed steps and (graph) the captured one.
  if (mode != Mode::Plain && !declare(o, batch, int64_t(ctx) + grown, 0)) {
    std::printf("step %d/%d b=%-3d ctx=%-7d: this Runtime has no declared maxima\n", hq, hkv, batch, ctx);
    return;
  }
  const bool bf16 = mode == Mode::GraphBf16 || mode == Mode::EngineGraphBf16;
  if (bf16) o.activations = Activations::BFloat16;
  cudaStream_t s;
  ck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
  if (mode == Mode::EngineGraphBf16) {
#if defined(KVCC_BENCH_ENGINE)
    o.engine_tables = true;
    run_engine(art, e, o, batch, ctx, layers, steps, s, rng);
#else
    std::printf("step %d/%d b=%-3d ctx=%-7d: this Runtime takes no engine tables\n", hq, hkv, batch, ctx);
#endif
    cudaStreamDestroy(s);
    return;
  }
  Runtime rt(art, e, o);
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
  void* k1 = device_random(size_t(batch) * per * hkv * d, rng, bf16);
  void* v1 = device_random(size_t(batch) * per * hkv * d, rng, bf16);
  void* q = device_random(size_t(batch) * per * hq * d, rng, bf16);
  void* out = nullptr;
  ck(cudaMalloc(&out, size_t(batch) * per * hq * d * sizeof(float)), "cudaMalloc");
  const std::vector<int> ones(size_t(batch), per);
  const size_t el = bf16 ? 2 : 4;
  auto at = [&](void* base, size_t elems) { return static_cast<void*>(static_cast<char*>(base) + elems * el); };
  auto step = [&] {
    begin_step(rt, seqs, ones, s, 0);
    for (int l = 0; l < layers && g_prefill_tokens > 0; ++l) {
      if (g_prefill_batched) rt.prefill(l, seqs, ones, q, k1, v1, out, s);
      for (int b = 0; b < batch && !g_prefill_batched; ++b) {
        const size_t qo = size_t(b) * per * hq * d, kvo = size_t(b) * per * hkv * d;
        rt.prefill(l, seqs[size_t(b)], per, at(q, qo), at(k1, kvo), at(v1, kvo), at(out, qo), s);
      }
      rt.append(l, k1, v1, s);
    }
    for (int l = 0; l < layers && g_prefill_tokens == 0; ++l) {
      rt.append(l, k1, v1, s);
      if (!g_append_only) rt.decode(l, seqs, q, out, s);
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
        if (!g_append_only) rt.decode(l, seqs, q, out, s);
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
  std::printf("step %d/%d b=%-3d ctx=%-7d %d layers: %.1f us per layer (%s, host work included)%s\n", hq, hkv, batch,
              ctx, layers, us / steps / layers, what(), name);
  if (exec) cudaGraphExecDestroy(exec);
  for (void* p : {kv, k1, v1, q, out}) cudaFree(p);
  cudaStreamDestroy(s);
}

}  // namespace

int main(int argc, char** argv) {
  std::string configs = "32:8:1:32768,32:8:8:131072,32:8:64:32768";
  int layers = 4, steps = 50;
  std::string modes = "plain";
  bench::Args("bench_step",
              "A whole decode (or chunked-prefill) step through the public Runtime API, as an engine calls it:\n"
              "begin_append, then per layer append + decode, host work included, on a Hopper GPU.")
      .option("--configs", &configs, "shapes: query heads:KV heads:batch:context, comma-separated")
      .option("--modes", &modes,
              "plain, fixed, graph, graph-bf16 and/or engine-graph-bf16 (the header says what each is)")
      .option("--layers", &layers, "layers a step runs", 1)
      .option("--steps", &steps, "steps timed", 1)
      .option("--step-tokens", &kChunk, "declared max_step_tokens (and the fill's chunk)", 1)
      .option("--append-only", &g_append_only, "steps run every layer's append and no decode")
      .option("--prefill-tokens", &g_prefill_tokens, "chunked-prefill steps of this many tokens a sequence (0: decode)",
              0)
      .option("--prefill-batched", &g_prefill_batched, "one ragged prefill a layer (1) or one a sequence (0)")
      .example("bench_step --configs 32:8:1:32768,32:8:8:131072 --modes plain,graph-bf16 --steps 200")
      .parse(argc, argv);
  std::vector<std::string> mode_names;
  std::vector<std::vector<int>> shapes;
  std::string err = bench::parse_choices("--modes", modes,
                                         {"plain", "fixed", "graph", "graph-bf16", "engine-graph-bf16"}, mode_names);
  if (err.empty()) err = bench::parse_shapes(configs, "Hq:Hkv:batch:ctx", 1, 1, shapes);
  if (!err.empty()) {
    std::fprintf(stderr, "bench_step: %s\n", err.c_str());
    return 2;
  }
  std::vector<Mode> mode_list;
  for (const std::string& m : mode_names)
    mode_list.push_back(m == "plain"        ? Mode::Plain
                        : m == "fixed"      ? Mode::Fixed
                        : m == "graph"      ? Mode::Graph
                        : m == "graph-bf16" ? Mode::GraphBf16
                                            : Mode::EngineGraphBf16);
  for (const std::vector<int>& f : shapes) {
    try {
      for (Mode m : mode_list) run(f[0], f[1], f[2], f[3], layers, steps, m);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "bench_step %d:%d:%d:%d: %s\n", f[0], f[1], f[2], f[3], e.what());
      return 1;
    }
  }
  return 0;
}
