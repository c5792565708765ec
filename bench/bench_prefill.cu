// Prefill / extend benchmark of the INT2 paged cache (runtime/prefill.cu): T new tokens over a
// context of ctx cached tokens, one layer, the whole call (rotations, attention, merge). CUDA
// events around each call after warm-up (≥ 0.2 s), median of the repetitions ("ms": the host's
// planning and launches included, "host_ms" of it on the host; "graph_ms": the call captured in a
// CUDA graph and replayed, as bench_sdpa.py times PyTorch); random codes with
// sane scales and random BF16 windows. "TFLOP/s" counts the attention's QKᵀ and PV products (the
// history plus the causal half of the new block), as flash-attention benchmarks do. Activations
// (q, k, v in, the output out) in bfloat16, as engines call it, or float32; build 0 is the plan's
// choice (what a Runtime runs), --warps 4 or 8 force the warps (the plan picks CTAs per SM), 4x1
// and 4x2 the 4-warp build at one or two CTAs an SM. bench_sdpa.py --prefill-configs times PyTorch's BF16
// attention on the same shapes.
//
// --keys per-channel times per-channel key pages (KIVI's keys, one group per page) instead.
// Options: bench_prefill --help.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "bench/bench_args.h"
#include "formats/error.h"
#include "formats/fp16.h"
#include "formats/kv_layout.h"
#include "runtime/cuda_util.cuh"
#include "runtime/device_buffer.h"
#include "runtime/kv_cache.h"
#include "runtime/kv_kernels.h"
#include "runtime/served.h"

using namespace kvcc;

namespace {

#define CK(x) check_cuda((x), #x)  // a failed CUDA call ends the benchmark with its name

constexpr int kD = kGpuHeadDim;

// A build to time: warps and CTAs per SM (0: the plan's), as --warps spells it ("4x2").
struct BuildSpec {
  int warps = 0, per_sm = 0;
  std::string name;
};
void run_config(int n_heads, int n_kv, int ctx, int T, const std::vector<BuildSpec>& builds, bool bf16, int reps,
                bool chan) {
  KvGeometry g = gpu_geometry(1, n_kv);
  if (chan) g.key_group_tokens = g.page_tokens, g.key_pair_bytes = 2;
  // Shapes the kernels do not serve are skipped with the table's reason.
  if (const std::string why = gpu_unsupported_reason(g, n_heads, kGpuPrefill); !why.empty()) {
    std::fprintf(stderr, "prefill %d:%d:%d:%d skipped: %s\n", n_heads, n_kv, ctx, T, why.c_str());
    return;
  }
  const int64_t pages = history_pages(g, ctx);
  KvCache cache(KvCacheConfig{g, std::max<int64_t>(1, pages), 1, PoolMemory::Device});
  const int seq = cache.add_sequence();
  cache.grow(seq, ctx);
  std::mt19937 rng(3);
  std::vector<uint8_t> pool(cache.pool_bytes());
  for (auto& x : pool) x = uint8_t(rng());
  for (int64_t p = 0; p < pages; ++p)  // (scale, zero) = (~0.05..0.06, 1.5) in fp16, K and V
    for (int h = 0; h < n_kv; ++h) {
      uint16_t* prm = reinterpret_cast<uint16_t*>(pool.data() + g.page_block_offset(p, 0, h) + g.k_params_offset());
      for (size_t i = 0; i < (g.k_params_bytes() + g.v_params_bytes()) / 4; ++i) {
        prm[2 * i] = uint16_t(0x2A66 + (rng() & 0xFF));
        prm[2 * i + 1] = 0x3E00;
      }
    }
  const size_t win_off = size_t(reinterpret_cast<const uint8_t*>(cache.windows_base()) - cache.pages_base());
  uint16_t* win = reinterpret_cast<uint16_t*>(pool.data() + win_off);
  for (size_t i = 0; i < g.window_slot_bytes() / 2; ++i) win[i] = uint16_t(0x3F80 ^ (rng() & 0x807F));  // ±[1, 2)
  CK(cudaMemcpy(cache.pages_base(), pool.data(), pool.size(), cudaMemcpyHostToDevice));
  const auto& pt = cache.page_table(seq);
  const DeviceBuffer<int32_t> table(std::vector<int32_t>(pt.begin(), pt.begin() + pages));
  std::normal_distribution<float> nd;
  std::vector<float> q(size_t(T) * n_heads * kD), kv(size_t(T) * n_kv * kD), rot(size_t(n_kv) * kD * kD);
  for (auto& x : q) x = nd(rng);
  for (auto& x : kv) x = nd(rng);
  for (auto& x : rot) x = nd(rng) / std::sqrt(float(kD));  // timing only: any dense matrix
  const DeviceBuffer<float> drot(rot);
  DeviceBuffer<RotFragments> dfix{size_t(n_kv)};
  rot_fragments(drot.data(), n_kv, dfix.data(), nullptr);
  // bfloat16 inputs are the float32 ones rounded (to nearest even); a buffer of either type.
  auto device_input = [bf16](const std::vector<float>& x) {
    std::vector<uint16_t> h(bf16 ? x.size() : 0);
    for (size_t i = 0; i < h.size(); ++i) h[i] = bf16_from_float(x[i]);
    DeviceBuffer<uint8_t> d(x.size() * (bf16 ? 2 : 4));
    CK(cudaMemcpy(d.data(), bf16 ? static_cast<const void*>(h.data()) : x.data(), d.size(), cudaMemcpyHostToDevice));
    return d;
  };
  const DeviceBuffer<uint8_t> dq = device_input(q), dkv = device_input(kv);
  DeviceBuffer<uint8_t> dout(q.size() * (bf16 ? 2 : 4));
  const Activations act = bf16 ? Activations::BFloat16 : Activations::Float32;
  const std::vector<HeadCodec> codecs(static_cast<size_t>(n_kv));
  const double keys = double(ctx) * T + 0.5 * double(T) * T;
  const double flops = 4.0 * n_heads * kD * keys;
  for (const BuildSpec& build : builds) {
    PrefillShape shape{n_heads, 1.0f / std::sqrt(float(kD)), 0, build.warps, build.per_sm};
    const std::vector<PrefillSequence> one{{seq, ctx, table.data(), T}};
    const size_t wsb = prefill_workspace_bytes(g, one, shape);
    DeviceBuffer<uint8_t> ws(wsb);
    cudaStream_t stream;
    CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    auto call = [&] {
      prefill_int2(g, cache.pages_base(), cache.windows_base(), 0, one, codecs.data(), shape, dq.data(), dkv.data(),
                   dkv.data(), drot.data(), drot.data(), dfix.data(), dfix.data(), dout.data(), ws.data(), wsb, stream,
                   act);
    };
    // Warm-up: 3 calls and at least 0.2 s of them, so that the clocks have left idle (with 3 calls
    // alone, the first build timed for a shape ran 0.2-2.5% slower than the same launch after it).
    const auto w0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 3 || std::chrono::steady_clock::now() - w0 < std::chrono::milliseconds(200); ++i) {
      call();
      CK(cudaStreamSynchronize(stream));
    }
    std::vector<float> times, graph_times, host;
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    auto timed = [&](std::vector<float>& out, auto&& fn) {
      CK(cudaEventRecord(a, stream));
      fn();
      CK(cudaEventRecord(b, stream));
      CK(cudaEventSynchronize(b));
      float ms = 0;
      CK(cudaEventElapsedTime(&ms, a, b));
      out.push_back(ms);
    };
    for (int i = 0; i < reps; ++i)
      timed(times, [&] {
        const auto h0 = std::chrono::steady_clock::now();
        call();
        host.push_back(std::chrono::duration<float, std::milli>(std::chrono::steady_clock::now() - h0).count());
      });
    // The call captured once in a CUDA graph and replayed (as engines run a step, and as
    // bench_sdpa.py times PyTorch): the device's time without the host's planning and launches.
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    call();
    CK(cudaStreamEndCapture(stream, &graph));
    CK(cudaGraphInstantiate(&exec, graph, 0));
    for (int i = 0; i < 3; ++i) CK(cudaGraphLaunch(exec, stream));
    for (int i = 0; i < reps; ++i) timed(graph_times, [&] { CK(cudaGraphLaunch(exec, stream)); });
    CK(cudaGraphExecDestroy(exec));
    CK(cudaGraphDestroy(graph));
    auto median = [](std::vector<float>& v) {
      std::sort(v.begin(), v.end());
      return double(v[v.size() / 2]);
    };
    const double ms = median(times), graph_ms = median(graph_times), host_ms = median(host);
    std::printf(
        "{\"bench\": \"prefill\", \"q_heads\": %d, \"kv_heads\": %d, \"ctx\": %d, \"T\": %d, \"warps\": \"%s\", "
        "\"activations\": \"%s\", \"keys\": \"%s\", \"ms\": %.4f, \"tokens_per_s\": %.0f, \"tflops\": %.1f, "
        "\"graph_ms\": %.4f, \"host_ms\": %.4f}\n",
        n_heads, n_kv, ctx, T, build.name.c_str(), bf16 ? "bf16" : "f32", chan ? "per_channel" : "per_token", ms,
        T / (ms * 1e-3), flops / (ms * 1e-3) / 1e12, graph_ms, host_ms);
    CK(cudaEventDestroy(a));
    CK(cudaEventDestroy(b));
    CK(cudaStreamDestroy(stream));
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::string configs = "32:8:32768:2048,32:8:32768:256,32:8:32768:16,32:8:4096:2048,32:8:131072:2048";
  std::string builds = "0,4,8";
  std::string activations = "bf16,f32";
  int reps = 20;
  std::string keys = "per-token";
  bench::Args("bench_prefill",
              "Prefill / extend over the INT2 paged cache: T new tokens over ctx cached ones, one layer, the whole\n"
              "call (direct, its host part, and replayed from a CUDA graph), on a Hopper GPU.")
      .option("--configs", &configs, "shapes: query heads:KV heads:context:new tokens, comma-separated")
      .option("--warps", &builds, "builds timed: 0 (the plan's), 4, 8, 4x1 or 4x2 (4 warps at 1 or 2 CTAs an SM)")
      .option("--activations", &activations, "activations timed: bf16 and/or f32")
      .option("--reps", &reps, "calls timed per shape and build (their median is reported)", 1)
      .option("--keys", &keys, "key pages: per-token and/or per-channel")
      .example("bench_prefill --configs 32:8:32768:16,32:8:32768:2048 --warps 0 --activations bf16")
      .parse(argc, argv);
  std::vector<std::vector<int>> shapes;
  std::vector<std::string> build_names, kinds, key_kinds;
  std::string err = bench::parse_shapes(configs, "Hq:Hkv:ctx:T", 0, 1, shapes);
  if (err.empty()) err = bench::parse_choices("--warps", builds, {"0", "4", "8", "4x1", "4x2"}, build_names);
  if (err.empty()) err = bench::parse_choices("--activations", activations, {"bf16", "f32"}, kinds);
  if (err.empty()) err = bench::parse_choices("--keys", keys, {"per-token", "per-channel"}, key_kinds);
  if (!err.empty()) {
    std::fprintf(stderr, "bench_prefill: %s\n", err.c_str());
    return 2;
  }
  std::vector<BuildSpec> build_specs;
  for (const std::string& b : build_names)  // warps, and CTAs an SM after the 'x'
    build_specs.push_back(BuildSpec{b[0] - '0', b.size() == 3 ? b[2] - '0' : 0, b});
  try {
    require_hopper();
    for (const std::vector<int>& c : shapes)
      for (const std::string& kind : kinds)
        for (const std::string& k : key_kinds)
          run_config(c[0], c[1], c[2], c[3], build_specs, kind == "bf16", reps, k == "per-channel");
  } catch (const Error& e) {
    std::fprintf(stderr, "bench_prefill: %s\n", e.what());
    return 1;
  }
  return 0;
}
