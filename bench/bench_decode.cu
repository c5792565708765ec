// Decode-attention benchmark of the INT2 paged cache against the in-house BF16 paged kernel,
// with the device-to-device copy ceiling and append throughput measured in the same run.
// PyTorch SDPA is timed by bench/bench_sdpa.py over the same shapes; scripts/gpu_report.py joins
// the two. Methodology (device README METHOD.md): CUDA events after warm-up, median of many
// replays, a CUDA graph per replay holding R decodes over R distinct cache replicas (so small
// shapes do not run out of L2), random non-zero data. Options: bench_decode --help.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
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

__device__ __forceinline__ uint32_t hash32(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return uint32_t(x);
}
__device__ __forceinline__ uint16_t rand_bf16(uint64_t i, uint32_t seed) {
  // uniform in (-2, 2), never zero
  const float u = (float(hash32(i * 2654435761ULL + seed) >> 8) + 0.5f) / 16777216.0f;
  const float f = 4.0f * u - 2.0f;
  uint32_t b;
  memcpy(&b, &f, 4);
  return uint16_t(b >> 16);
}

// Random INT2 pages: random code bytes, realistic (scale, zero) fp16 pairs.
__global__ void fill_int2_pages(uint32_t* words, size_t n_words, KvGeometry g, BlockWidths w, uint32_t seed) {
  const size_t block_words = g.page_head_bytes(w) / 4, params_from = g.k_params_offset(w) / 4;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n_words; i += size_t(gridDim.x) * blockDim.x) {
    const uint32_t r = hash32(i * 0x9E3779B97F4A7C15ULL + seed);
    if (i % block_words < params_from) {
      words[i] = r;
    } else {
      const float scale = 0.02f + 0.08f * float(r & 0xffff) / 65535.0f;
      const float zero = 3.0f * float(r >> 16) / 65535.0f;
      words[i] = uint32_t(__half_as_ushort(__float2half_rn(scale))) |
                 (uint32_t(__half_as_ushort(__float2half_rn(zero))) << 16);
    }
  }
}
__global__ void fill_bf16(uint16_t* x, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    x[i] = rand_bf16(i, seed);
}

constexpr int kD = kGpuHeadDim;
// The BF16 baseline's own paged cache (not kv_layout.h's): pages of 64 tokens.
constexpr int kBf16PageTokens = 64;

std::vector<float> random_orthogonal(int heads, int d, std::mt19937& rng, bool transpose) {
  std::normal_distribution<double> nd;
  std::vector<float> out(size_t(heads) * d * d);
  std::vector<double> m(size_t(d) * d);
  for (int h = 0; h < heads; ++h) {
    for (auto& x : m) x = nd(rng);
    for (int j = 0; j < d; ++j) {
      for (int k = 0; k < j; ++k) {
        double dot = 0;
        for (int i = 0; i < d; ++i) dot += m[size_t(i) * d + j] * m[size_t(i) * d + k];
        for (int i = 0; i < d; ++i) m[size_t(i) * d + j] -= dot * m[size_t(i) * d + k];
      }
      double nrm = 0;
      for (int i = 0; i < d; ++i) nrm += m[size_t(i) * d + j] * m[size_t(i) * d + j];
      for (int i = 0; i < d; ++i) m[size_t(i) * d + j] /= std::sqrt(nrm);
    }
    for (int i = 0; i < d; ++i)
      for (int j = 0; j < d; ++j)
        out[(size_t(h) * d + i) * d + j] = float(transpose ? m[size_t(j) * d + i] : m[size_t(i) * d + j]);
  }
  return out;
}

// Median time (µs) of one graph replay, over `reps` replays after 3 warm-ups.
double time_graph(cudaGraphExec_t exec, cudaStream_t s, int reps) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) CK(cudaGraphLaunch(exec, s));
  CK(cudaStreamSynchronize(s));
  std::vector<float> ms;
  for (int i = 0; i < reps; ++i) {
    CK(cudaEventRecord(a, s));
    CK(cudaGraphLaunch(exec, s));
    CK(cudaEventRecord(b, s));
    CK(cudaEventSynchronize(b));
    float t;
    CK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return 1000.0 * ms[ms.size() / 2];
}

__global__ void copy_words(const uint4* __restrict__ src, uint4* __restrict__ dst, size_t n) {
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    const uint4 a = src[i], b = src[i + stride], c = src[i + 2 * stride], d = src[i + 3 * stride];
    dst[i] = a;
    dst[i + stride] = b;
    dst[i + 2 * stride] = c;
    dst[i + 3 * stride] = d;
  }
  for (; i < n; i += stride) dst[i] = src[i];
}

// The copy ceiling: the faster of cudaMemcpy and a 16-byte-per-thread copy kernel over 2 GiB,
// counting bytes read plus bytes written.
double copy_ceiling_gbps(cudaStream_t s) {
  const size_t bytes = size_t(2) << 30;
  DeviceBuffer<uint4> src(bytes / 16), dst(bytes / 16);
  fill_bf16<<<1024, 256, 0, s>>>(reinterpret_cast<uint16_t*>(src.data()), bytes / 2, 7);
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  double best_us = 1e30;
  for (int variant = 0; variant < 2; ++variant) {
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    if (variant == 0) CK(cudaMemcpyAsync(dst.data(), src.data(), bytes, cudaMemcpyDeviceToDevice, s));
    else copy_words<<<sms * 8, 512, 0, s>>>(src.data(), dst.data(), bytes / 16);
    CK(cudaStreamEndCapture(s, &graph));
    CK(cudaGraphInstantiate(&exec, graph, 0));
    best_us = std::min(best_us, time_graph(exec, s, 20));
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
  return 2.0 * double(bytes) / (best_us * 1e-6) / 1e9;  // read + write
}

struct Config {
  int hq, hkv, batch, ctx;
};

// One layer of the kernels' geometry (served.h: kv_layout.h's default windows and pages); chan:
// per-channel key pages (one group per page, KIVI's keys).
KvGeometry geometry(int hkv, bool chan = false) {
  KvGeometry g = gpu_geometry(1, hkv);
  if (chan) g.key_group_tokens = g.page_tokens, g.key_pair_bytes = 2;
  return g;
}

void bench_config(const Config& c, cudaStream_t s, int reps, std::FILE* out, bool chan, BlockWidths widths) {
  const KvGeometry g = geometry(c.hkv, chan);
  const std::vector<BlockWidths> layer_widths(size_t(c.hkv), widths);
  // KVCC_TABLE=1 times the level-table kernel (oscar-lm codecs) on the same random pages.
  const char* table_env = std::getenv("KVCC_TABLE");
  const bool level_table = table_env && std::atoi(table_env);
  // Shapes the kernels do not serve are skipped with the table's reason (one line, no timing).
  std::string why = gpu_unsupported_reason(g, c.hq, kGpuDecode, level_table);
  if (why.empty()) why = gpu_bf16_unsupported_reason(c.hkv, kD, c.hq, kBf16PageTokens);
  if (!why.empty()) {
    std::printf("decode %2d/%d b=%-3d ctx=%-6d %s skipped: %s\n", c.hq, c.hkv, c.batch, c.ctx,
                chan ? "per-channel" : "per-token", why.c_str());
    return;
  }
  const int64_t pages_per_seq = history_pages(g, c.ctx);
  const KvTiers tiers = tiers_of(g, c.ctx);
  // Bytes read: INT2 page blocks and BF16 window rows (K and V) per (sequence, KV head).
  const double int2_bytes = double(c.batch) * c.hkv *
                            (double(pages_per_seq) * double(g.page_head_bytes(widths)) +
                             double(tiers.sink_count + tiers.ring_count) * 2 * kGpuBf16RowBytes);
  const double bf16_bytes = double(c.batch) * c.hkv * double(c.ctx) * 2 * kGpuBf16RowBytes;
  const int R = int(std::clamp(std::ceil(512e6 / int2_bytes), 1.0, 16.0));

  // INT2 cache, R replicas of the batch, through the allocator.
  KvCache cache(KvCacheConfig{g, pages_per_seq * R * c.batch, R * c.batch, PoolMemory::Device, layer_widths});
  const LayerBlocks blocks = cache.layout().layer_blocks(0);
  std::vector<std::vector<int>> seqs(static_cast<size_t>(R));
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < c.batch; ++b) {
      const int id = cache.add_sequence();
      cache.grow(id, c.ctx);
      seqs[size_t(r)].push_back(id);
    }
  const double mem_per_token_layer = double(cache.bytes_in_use()) / (double(R) * c.batch * c.ctx * g.n_layers);
  fill_int2_pages<<<2048, 256, 0, s>>>(reinterpret_cast<uint32_t*>(cache.pages_base()),
                                       size_t(cache.pages_in_use()) * cache.layout().page_bytes() / 4, g, widths, 11);
  fill_bf16<<<2048, 256, 0, s>>>(cache.windows_base(), size_t(R) * c.batch * g.window_slot_bytes() / 2, 13);
  CK(cudaGetLastError());

  std::mt19937 rng(c.hq * 131 + c.ctx + c.batch);
  std::vector<float> q(size_t(c.batch) * c.hq * kD);
  std::normal_distribution<float> nd;
  for (auto& x : q) x = nd(rng);
  const DeviceBuffer<float> dq(q), d_rk(random_orthogonal(c.hkv, kD, rng, false)),
      d_rvt(random_orthogonal(c.hkv, kD, rng, true));
  const float* rk = d_rk.data();
  const float* rvt = d_rvt.data();
  // KVCC_NO_ROT=1: no rotations (what the query and output rotations cost; A/B runs only).
  if (const char* e = std::getenv("KVCC_NO_ROT"); e && std::atoi(e)) rk = rvt = nullptr;
  DeviceBuffer<float> dout(q.size());
  std::vector<HeadCodec> codecs(size_t(c.hkv));
  if (level_table)
    for (auto& hc : codecs) {
      const float lv[4] = {-1.5f, -0.45f, 0.45f, 1.5f};
      hc.key.use_table = hc.value.use_table = 1;
      std::copy(lv, lv + 4, hc.key.levels);
      std::copy(lv, lv + 4, hc.value.levels);
    }
  // KVCC_TARGET_CTAS overrides the split-K plan's CTA target (for tuning runs).
  const char* target_env = std::getenv("KVCC_TARGET_CTAS");
  const char* stages_env = std::getenv("KVCC_STAGES");  // benchmarking: which decode kernels run
  DecodeShape shape{c.hq, 1.0f / std::sqrt(float(kD)), target_env ? std::atoi(target_env) : 0,
                    stages_env ? std::atoi(stages_env) : 7};
  // KVCC_RING forces the INT2 page-ring depth (2 or 3) instead of the plan's choice (A/B runs).
  if (const char* ring_env = std::getenv("KVCC_RING")) shape.ring = std::atoi(ring_env);

  std::vector<DeviceBatch> batches;
  std::vector<DeviceBuffer<int32_t>> bufs;
  auto upload = [&](const std::vector<int32_t>& v) {
    bufs.emplace_back(v);
    return bufs.back().data();
  };
  for (int r = 0; r < R; ++r) {
    std::vector<int32_t> slot, len, off, table;
    for (int id : seqs[size_t(r)]) {
      slot.push_back(id);
      len.push_back(c.ctx);
      off.push_back(int32_t(table.size()));
      const auto& pt = cache.page_table(id);
      table.insert(table.end(), pt.begin(), pt.end());
    }
    DeviceBatch db;
    db.batch = c.batch;
    db.seq_slot = upload(slot);
    db.seq_len = upload(len);
    db.page_offset = upload(off);
    db.page_table = upload(table);
    db.max_pages = int(pages_per_seq);
    batches.push_back(db);
  }
  const size_t ws_int2 = decode_workspace_bytes(g, c.batch, c.hq, int(pages_per_seq), 0, shape.target_ctas, shape.ring);
  const int bf16_pages_per_seq = (c.ctx + kBf16PageTokens - 1) / kBf16PageTokens;
  const size_t ws_bf16 =
      decode_workspace_bytes(g, c.batch, c.hq, bf16_pages_per_seq, kBf16PageTokens, shape.target_ctas);
  DeviceBuffer<uint8_t> ws(std::max(ws_int2, ws_bf16));

  // INT2 graph.
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CK(cudaStreamSynchronize(s));
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  for (int r = 0; r < R; ++r)
    decode_int2(g, cache.pages_base(), cache.windows_base(), 0, batches[size_t(r)], codecs.data(), shape, dq.data(), rk,
                rvt, dout.data(), ws.data(), ws_int2, s, Activations::Float32, &blocks);
  CK(cudaStreamEndCapture(s, &graph));
  CK(cudaGraphInstantiate(&exec, graph, 0));
  const double int2_us = time_graph(exec, s, reps) / R;
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  // Every output written and finite (the inputs are random, never zero).
  std::vector<float> host_out(q.size());
  dout.download(host_out.data(), host_out.size());
  bool finite = true;
  for (float x : host_out) finite = finite && std::isfinite(x);

  // BF16 in-house baseline over a plain paged BF16 cache of the same shape.
  const int Rb = int(std::clamp(std::ceil(512e6 / bf16_bytes), 1.0, 16.0));
  const size_t bf16_pages = size_t(Rb) * c.batch * bf16_pages_per_seq;
  const size_t page_elems = size_t(c.hkv) * 2 * kBf16PageTokens * kD;
  DeviceBuffer<uint16_t> bpool;
  try {
    bpool = DeviceBuffer<uint16_t>(bf16_pages * page_elems);
  } catch (const Error&) {
    cudaGetLastError();  // too large for the GPU: no baseline for this shape
  }
  double bf16_us = -1;
  if (!bpool.empty()) {
    fill_bf16<<<2048, 256, 0, s>>>(bpool.data(), bf16_pages * page_elems, 17);
    std::vector<DeviceBatch> bb;
    for (int r = 0; r < Rb; ++r) {
      std::vector<int32_t> slot(size_t(c.batch), 0), len(size_t(c.batch), c.ctx), off, table;
      for (int b = 0; b < c.batch; ++b) {
        off.push_back(int32_t(table.size()));
        for (int p = 0; p < bf16_pages_per_seq; ++p)
          table.push_back(int32_t((size_t(r) * c.batch + b) * bf16_pages_per_seq + p));
      }
      DeviceBatch db;
      db.batch = c.batch;
      db.seq_slot = upload(slot);
      db.seq_len = upload(len);
      db.page_offset = upload(off);
      db.page_table = upload(table);
      db.max_pages = bf16_pages_per_seq;
      bb.push_back(db);
    }
    CK(cudaStreamSynchronize(s));
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    for (int r = 0; r < Rb; ++r)
      decode_bf16_paged(c.hkv, kD, kBf16PageTokens, bpool.data(), bb[size_t(r)], shape, dq.data(), rk, rvt, dout.data(),
                        ws.data(), ws_bf16, s);
    CK(cudaStreamEndCapture(s, &graph));
    CK(cudaGraphInstantiate(&exec, graph, 0));
    bf16_us = time_graph(exec, s, reps) / Rb;
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
  std::fprintf(out,
               "{\"kind\":\"decode\",\"keys\":\"%s\",\"key_bits\":%d,\"value_bits\":%d,\"q_heads\":%d,\"kv_heads\":%d,"
               "\"batch\":%d,\"context\":%d,"
               "\"int2_us\":%.3f,\"bf16_inhouse_us\":%.3f,\"int2_bytes\":%.0f,\"bf16_bytes\":%.0f,"
               "\"int2_gbps\":%.1f,\"bf16_inhouse_gbps\":%.1f,\"int2_bytes_per_token_layer\":%.2f,"
               "\"bf16_bytes_per_token_layer\":%d,\"replicas\":%d,\"outputs_finite\":%s}\n",
               chan ? "per_channel" : "per_token", widths.key, widths.value, c.hq, c.hkv, c.batch, c.ctx, int2_us,
               bf16_us, int2_bytes, bf16_bytes, int2_bytes / int2_us / 1e3,
               bf16_us > 0 ? bf16_bytes / bf16_us / 1e3 : 0.0, mem_per_token_layer, 2 * c.hkv * kGpuBf16RowBytes, R,
               finite ? "true" : "false");
  std::fflush(out);
  std::printf(
      "decode %2d/%d b=%-3d ctx=%-6d %-11s %d/%d bits int2 %8.1f us (%6.0f GB/s)  bf16 in-house %8.1f us (%6.0f GB/s)  "
      "%s\n",
      c.hq, c.hkv, c.batch, c.ctx, chan ? "per-channel" : "per-token", widths.key, widths.value, int2_us,
      int2_bytes / int2_us / 1e3, bf16_us, bf16_us > 0 ? bf16_bytes / bf16_us / 1e3 : 0.0,
      finite ? "" : "NON-FINITE OUTPUT");
}

// Append throughput: a prefill of `tokens` into one sequence, and `steps` decode steps of a
// batch; bandwidth counts fp32 inputs read plus cache bytes written.
void bench_append(cudaStream_t s, std::FILE* out) {
  const KvGeometry g = geometry(8);
  const std::string why = gpu_unsupported_reason(g, kAnyQueryHeads, kGpuAppend);
  if (!why.empty()) {
    std::printf("append skipped: %s\n", why.c_str());
    return;
  }
  std::mt19937 rng(3);
  const DeviceBuffer<float> rk(random_orthogonal(8, kD, rng, false)), rv(random_orthogonal(8, kD, rng, false));
  DeviceBuffer<RotFragments> fk(8), fv(8);  // (built once, as the Runtime does at load)
  rot_fragments(rk.data(), 8, fk.data(), nullptr);
  rot_fragments(rv.data(), 8, fv.data(), nullptr);
  std::vector<HeadCodec> codecs(8);
  for (auto& c : codecs) c.key.clip_ratio = c.value.clip_ratio = 0.95f;
  const int tokens = 32768;
  const size_t in_elems = size_t(tokens) * 8 * kD;
  DeviceBuffer<float> k(in_elems), v(in_elems);
  {
    std::vector<float> h(in_elems);
    std::normal_distribution<float> nd;
    for (auto& x : h) x = nd(rng);
    k.upload(h);
    for (auto& x : h) x = nd(rng);
    v.upload(h);
  }
  KvCache cache(KvCacheConfig{g, history_pages(g, tokens) + 64 * 8, 65, PoolMemory::Device});
  const size_t wsb = append_workspace_bytes(g, tokens, tokens);
  DeviceBuffer<uint8_t> ws(wsb);
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<float> ms;
  for (int rep = 0; rep < 6; ++rep) {
    const int id = cache.add_sequence();
    cache.grow(id, tokens);
    AppendPlanHost plan{{id}, {0}, {tokens}, {0}, {cache.page_table(id)}};
    CK(cudaEventRecord(a, s));
    append_kv(g, cache.pages_base(), cache.windows_base(), 0, plan, codecs.data(), k.data(), v.data(), fk.data(),
              fv.data(), ws.data(), wsb, s);
    CK(cudaEventRecord(b, s));
    CK(cudaEventSynchronize(b));
    float t;
    CK(cudaEventElapsedTime(&t, a, b));
    if (rep > 0) ms.push_back(t);
    cache.free_sequence(id);
  }
  std::sort(ms.begin(), ms.end());
  const double prefill_us = 1000.0 * ms[ms.size() / 2];
  const KvTiers t = tiers_of(g, tokens);
  const double written = double(8) * (double(t.hist_tokens) * double(g.page_head_bytes()) / g.page_tokens +
                                      double(t.sink_count + t.ring_count) * 2 * kGpuBf16RowBytes);
  const double prefill_bytes = double(in_elems) * 4 * 2 + written;
  const double bf16_bytes = double(in_elems) * 2 * 2 + written;
  // The same append planned once, as a step's layers run it (Runtime::begin_append plans a step
  // once for all layers; an engine step is planned on the device): the kernel alone per layer,
  // median of 9 launches over the plan (rewriting the same pages), float32 and bfloat16 inputs.
  double planned_us[2] = {0, 0};
  {
    const int id = cache.add_sequence();
    cache.grow(id, tokens);
    const AppendMoves m = plan_append_moves(g, AppendPlanHost{{id}, {0}, {tokens}, {0}, {cache.page_table(id)}});
    DeviceBuffer<AppendMove> moves(m.moves);
    DeviceBuffer<AppendWindowWrite> writes(m.writes);
    DeviceBuffer<HeadCodec> d_codecs(codecs);
    DeviceAppendPlan d;
    d.moves = moves.data();
    d.writes = writes.data();
    d.n_moves = int(m.moves.size());
    d.n_writes = int(m.writes.size());
    DeviceBuffer<uint16_t> kb(in_elems), vb(in_elems);
    {
      std::vector<uint16_t> h(in_elems);
      std::normal_distribution<float> nd;
      for (auto& x : h) x = bf16_from_float(nd(rng));
      kb.upload(h);
      for (auto& x : h) x = bf16_from_float(nd(rng));
      vb.upload(h);
    }
    for (const Activations act : {Activations::Float32, Activations::BFloat16}) {
      const bool bf = act == Activations::BFloat16;
      const void* kp = bf ? static_cast<const void*>(kb.data()) : k.data();
      const void* vp = bf ? static_cast<const void*>(vb.data()) : v.data();
      std::vector<float> lt;
      for (int rep = 0; rep < 10; ++rep) {
        CK(cudaEventRecord(a, s));
        append_kv_planned(g, cache.pages_base(), cache.windows_base(), 0, d, d_codecs.data(), kp, vp, fk.data(),
                          fv.data(), s, act);
        CK(cudaEventRecord(b, s));
        CK(cudaEventSynchronize(b));
        float t1;
        CK(cudaEventElapsedTime(&t1, a, b));
        if (rep > 0) lt.push_back(t1);
      }
      std::sort(lt.begin(), lt.end());
      planned_us[bf] = 1000.0 * lt[lt.size() / 2];
    }
    cache.free_sequence(id);
  }
  // Decode steps: 64 sequences at 4096 tokens, 64 steps of one token each (every sequence
  // flushes one page in that window). Wall time per step includes the host planning.
  std::vector<int> ids;
  for (int i = 0; i < 64; ++i) {
    ids.push_back(cache.add_sequence());
    cache.grow(ids.back(), 0);
  }
  const int steps = 64;
  CK(cudaEventRecord(a, s));
  for (int st = 0; st < steps; ++st) {
    std::vector<int64_t> old, add(64, 1);
    for (int id : ids) old.push_back(cache.length(id));
    cache.grow_batch(ids, add);
    AppendPlanHost plan{ids, old, std::vector<int>(64, 1), {}, {}};
    for (int i = 0; i < 64; ++i) {
      plan.row_offsets.push_back(i);
      plan.page_tables.push_back(cache.page_table(ids[size_t(i)]));
    }
    append_kv(g, cache.pages_base(), cache.windows_base(), 0, plan, codecs.data(), k.data(), v.data(), fk.data(),
              fv.data(), ws.data(), wsb, s);
  }
  CK(cudaEventRecord(b, s));
  CK(cudaEventSynchronize(b));
  float tsteps;
  CK(cudaEventElapsedTime(&tsteps, a, b));
  const double step_us = 1000.0 * tsteps / steps;
  for (int id : ids) cache.free_sequence(id);
  // The bare kernel of a decode step's append (one token per sequence), planned once per step as
  // Runtime::begin_append does: plan and upload outside the timed region, then the planned kernel
  // for 32 layers between events; the mean per layer over 64 steps (each sequence flushes one
  // ring token into a page in that window). bench_step --append-only times the API's step.
  constexpr int kLayers = 32;
  double bare_us[3] = {0, 0, 0};
  const int bare_batches[3] = {1, 8, 64};
  {
    DeviceBuffer<HeadCodec> d_codecs(codecs);
    for (int bi = 0; bi < 3; ++bi) {
      const int nb = bare_batches[bi];
      std::vector<int> bids;
      for (int i = 0; i < nb; ++i) {
        bids.push_back(cache.add_sequence());
        cache.grow(bids.back(), 1024);  // history pages, and room in the pool for 64 of them
      }
      double total_ms = 0;
      for (int st = 0; st < steps; ++st) {
        std::vector<int64_t> old, add(size_t(nb), 1);
        for (int id : bids) old.push_back(cache.length(id));
        cache.grow_batch(bids, add);
        AppendPlanHost plan{bids, old, std::vector<int>(size_t(nb), 1), {}, {}};
        for (int i = 0; i < nb; ++i) {
          plan.row_offsets.push_back(i);
          plan.page_tables.push_back(cache.page_table(bids[size_t(i)]));
        }
        const AppendMoves m = plan_append_moves(g, plan);
        DeviceBuffer<AppendMove> moves(m.moves);
        DeviceBuffer<AppendWindowWrite> writes(m.writes);
        DeviceAppendPlan d;
        d.moves = moves.data();
        d.writes = writes.data();
        d.n_moves = int(m.moves.size());
        d.n_writes = int(m.writes.size());
        CK(cudaDeviceSynchronize());
        // A warm-up launch, then kLayers back to back as a step's layers run (the same moves each
        // time: idempotent), so the events time the kernels and not one launch's latency.
        append_kv_planned(g, cache.pages_base(), cache.windows_base(), 0, d, d_codecs.data(), k.data(), v.data(),
                          fk.data(), fv.data(), s);
        CK(cudaEventRecord(a, s));
        for (int l = 0; l < kLayers; ++l)
          append_kv_planned(g, cache.pages_base(), cache.windows_base(), 0, d, d_codecs.data(), k.data(), v.data(),
                            fk.data(), fv.data(), s);
        CK(cudaEventRecord(b, s));
        CK(cudaEventSynchronize(b));
        float t1;
        CK(cudaEventElapsedTime(&t1, a, b));
        total_ms += t1 / kLayers;
      }
      bare_us[bi] = 1000.0 * total_ms / steps;
      for (int id : bids) cache.free_sequence(id);
    }
  }
  std::fprintf(out,
               "{\"kind\":\"append\",\"prefill_tokens\":%d,\"kv_heads\":8,\"prefill_us\":%.1f,\"prefill_gbps\":%.1f,"
               "\"planned_f32_us\":%.1f,\"planned_f32_gbps\":%.1f,\"planned_bf16_us\":%.1f,\"planned_bf16_gbps\":%.1f,"
               "\"decode_step_batch\":64,\"decode_step_us\":%.1f,\"planned_step_us_b1\":%.2f,"
               "\"planned_step_us_b8\":%.2f,\"planned_step_us_b64\":%.2f}\n",
               tokens, prefill_us, prefill_bytes / prefill_us / 1e3, planned_us[0], prefill_bytes / planned_us[0] / 1e3,
               planned_us[1], bf16_bytes / planned_us[1] / 1e3, step_us, bare_us[0], bare_us[1], bare_us[2]);
  std::printf(
      "append: prefill %d tokens x 8 kv heads: %.1f us (%.0f GB/s of fp32 input + cache written); "
      "planned once, kernel per layer: fp32 %.1f us (%.0f GB/s), bf16 %.1f us (%.0f GB/s); "
      "decode step (batch 64, 1 token, host plan per call): %.1f us; planned once per step, the kernel alone: "
      "batch 1 %.2f us, batch 8 %.2f us, batch 64 %.2f us\n",
      tokens, prefill_us, prefill_bytes / prefill_us / 1e3, planned_us[0], prefill_bytes / planned_us[0] / 1e3,
      planned_us[1], bf16_bytes / planned_us[1] / 1e3, step_us, bare_us[0], bare_us[1], bare_us[2]);
}

}  // namespace

int main(int argc, char** argv) {
  std::string configs = "32:8:1:32768,32:8:8:131072", out_path = "bench_decode.jsonl";
  int reps = 30;
  std::string keys = "per-token", widths_arg = "2/2";
  bench::Args("bench_decode",
              "Decode attention over the INT2 paged cache against the in-house BF16 paged kernel, the\n"
              "device-to-device copy ceiling, and the append (a 32K prefill and decode steps), on a Hopper GPU.")
      .option("--configs", &configs, "shapes timed: query heads:KV heads:batch:context, comma-separated ('' for none)")
      .option("--out", &out_path, "JSON lines written (one per shape, device, append)")
      .option("--reps", &reps, "graph replays timed per shape (their median is reported)", 1)
      .option("--keys", &keys, "key pages timed: per-token and/or per-channel, each shape in turn")
      .option("--widths", &widths_arg, "code widths timed, key/value bits (1-4), comma-separated")
      .example("bench_decode --configs 32:8:1:32768,32:8:8:131072 --keys per-token,per-channel --out d.jsonl")
      .parse(argc, argv);
  std::vector<BlockWidths> widths;
  for (const std::string& w : bench::split(widths_arg, ',')) {
    std::vector<long> f;
    if (!bench::split_ints(w, '/', 2, f) || f[0] < 1 || f[0] > 4 || f[1] < 1 || f[1] > 4) {
      std::fprintf(stderr, "bench_decode: --widths takes K/V pairs of 1-4 bits, not '%s'\n", w.c_str());
      return 2;
    }
    widths.push_back(BlockWidths{int(f[0]), int(f[1])});
  }
  std::vector<std::string> key_kinds;
  std::vector<std::vector<int>> shapes;
  std::string err = bench::parse_choices("--keys", keys, {"per-token", "per-channel"}, key_kinds);
  if (err.empty()) err = bench::parse_shapes(configs, "Hq:Hkv:batch:ctx", 1, 1, shapes);
  if (!err.empty()) {
    std::fprintf(stderr, "bench_decode: %s\n", err.c_str());
    return 2;
  }
  std::FILE* out = nullptr;
  try {
    require_hopper();  // before the output is created: no empty file from a machine without one
    out = std::fopen(out_path.c_str(), "w");
    KVCC_REQUIRE(out, "cannot write " + out_path);
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    const double ceiling = copy_ceiling_gbps(s);
    std::fprintf(out, "{\"kind\":\"device\",\"name\":\"%s\",\"sms\":%d,\"copy_gbps\":%.1f}\n", prop.name,
                 prop.multiProcessorCount, ceiling);
    std::printf("device %s, %d SMs, copy ceiling %.0f GB/s (read + write)\n", prop.name, prop.multiProcessorCount,
                ceiling);
    for (const std::vector<int>& c : shapes)
      for (const std::string& k : key_kinds)
        for (const BlockWidths& w : widths)
          bench_config(Config{c[0], c[1], c[2], c[3]}, s, reps, out, k == "per-channel", w);
    bench_append(s, out);
  } catch (const Error& e) {
    std::fprintf(stderr, "bench_decode: %s\n", e.what());
    return 1;
  }
  std::fclose(out);
  return 0;
}
