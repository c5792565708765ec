#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <string>
#include <vector>

#include "calibrate/gpu_layers.h"
#include "formats/error.h"

namespace kvcc {

bool gpu_calibration_built() { return true; }

namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw Error(std::string("calibrate on the GPU: ") + what + ": " + cudaGetErrorString(e));
}
void check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS)
    throw Error(std::string("calibrate on the GPU: ") + what + ": cuBLAS " + cublasGetStatusString(s));
}
#define KVCC_CAL_CUDA(call) check((call), #call)

// A device array that only grows (one layer's tensors and one sequence's scratch are reused).
template <typename T>
struct DeviceArray {
  T* p = nullptr;
  size_t n = 0;
  DeviceArray() = default;
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  ~DeviceArray() { cudaFree(p); }
  void reserve(size_t count, const char* what) {
    if (count <= n) return;
    cudaFree(p);
    p = nullptr;
    n = 0;
    const cudaError_t e = cudaMalloc(&p, std::max<size_t>(count, 1) * sizeof(T));
    if (e != cudaSuccess)
      throw Error(std::string("calibrate on the GPU: cannot allocate ") + what + " (" +
                  std::to_string(count * sizeof(T) >> 20) + " MiB): " + cudaGetErrorString(e));
    n = count;
  }
};

constexpr int kThreads = 256;

// Block-wide sum of one double per thread (blockDim.x == kThreads).
__device__ double block_sum(double v, double* shared) {
  shared[threadIdx.x] = v;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s >>= 1) {
    if (int(threadIdx.x) < s) shared[threadIdx.x] += shared[threadIdx.x + s];
    __syncthreads();
  }
  const double total = shared[0];
  __syncthreads();
  return total;
}

// HF LlamaRMSNorm as model/forward.cpp's rms_norm: the mean of squares in double, then
// y = w · (x · inv) in float. One block per row; in place is allowed (y == x).
__global__ void rms_norm_kernel(const float* x, int n, int in_stride, const float* w, double eps, float* y,
                                int out_stride) {
  __shared__ double shared[kThreads];
  const float* xr = x + size_t(blockIdx.x) * in_stride;
  float* yr = y + size_t(blockIdx.x) * out_stride;
  double sum_sq = 0;
  for (int i = threadIdx.x; i < n; i += kThreads) sum_sq += double(xr[i]) * xr[i];
  sum_sq = block_sum(sum_sq, shared);
  const float inv = float(1.0 / sqrt(sum_sq / n + eps));
  for (int i = threadIdx.x; i < n; i += kThreads) yr[i] = w[i] * (xr[i] * inv);
}

__global__ void add_bias_kernel(float* y, size_t total, int n, const float* b) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < total; i += size_t(gridDim.x) * blockDim.x)
    y[i] += b[i % n];
}

// RoPE in place on x [T, n_heads·d] with the host's cos/sin tables [T, d/2] (forward.cpp's values).
__global__ void rope_kernel(float* x, int T, int n_heads, int d, const float* cos_t, const float* sin_t,
                            bool rotate_half) {
  const int half = d / 2;
  const size_t total = size_t(T) * n_heads * half;
  for (size_t k = blockIdx.x * size_t(blockDim.x) + threadIdx.x; k < total; k += size_t(gridDim.x) * blockDim.x) {
    const int i = int(k % half);
    const size_t th = k / half;  // t * n_heads + h
    const int t = int(th / n_heads);
    float* v = x + th * d;
    float& a = rotate_half ? v[i] : v[2 * i];
    float& b = rotate_half ? v[i + half] : v[2 * i + 1];
    const float c = cos_t[size_t(t) * half + i], s = sin_t[size_t(t) * half + i];
    const float x0 = a, x1 = b;
    a = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));  // as the CPU rounds: no fused multiply-add
    b = __fadd_rn(__fmul_rn(x1, c), __fmul_rn(x0, s));
  }
}

__global__ void silu_mul_kernel(float* gate, const float* up, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const float g = gate[i];
    gate[i] = g / (1.0f + expf(-g)) * up[i];
  }
}

// Causal softmax of scores [rows = heads·T, T] in place, as forward.cpp's attend: row i keeps
// j <= i (exp(s - max) in float, summed in double, scaled by float(1 / sum)), zeros above.
__global__ void causal_softmax_kernel(float* s, int T) {
  __shared__ double shared[kThreads];
  __shared__ float shared_max[kThreads];
  const int i = int(blockIdx.x % unsigned(T));
  float* row = s + size_t(blockIdx.x) * T;
  float m = -INFINITY;
  for (int j = threadIdx.x; j <= i; j += kThreads) m = fmaxf(m, row[j]);
  shared_max[threadIdx.x] = m;
  __syncthreads();
  for (int k = kThreads / 2; k > 0; k >>= 1) {
    if (int(threadIdx.x) < k) shared_max[threadIdx.x] = fmaxf(shared_max[threadIdx.x], shared_max[threadIdx.x + k]);
    __syncthreads();
  }
  m = shared_max[0];
  double sum = 0;
  for (int j = threadIdx.x; j <= i; j += kThreads) {
    const float e = expf(row[j] - m);
    row[j] = e;
    sum += e;
  }
  sum = block_sum(sum, shared);
  const float inv = float(1.0 / sum);
  for (int j = threadIdx.x; j < T; j += kThreads) row[j] = j <= i ? row[j] * inv : 0.0f;
}

// w_j = Σ_heads Σ_{i >= j} p_ij² over one KV group's `heads` probability matrices [heads, T, T]:
// block (x, y) sums rows [y·kP2Rows, (y+1)·kP2Rows) of its columns into partial[y, j] (enough
// blocks to fill the GPU; a thread per column alone would leave it idle), then p2_sum_kernel adds
// the partials of each column in order.
constexpr int kP2Rows = 64;
__global__ void p2_partial_kernel(const float* p, int T, int heads, double* partial) {
  const int j = int(blockIdx.x * blockDim.x + threadIdx.x);
  if (j >= T) return;
  const int i0 = max(j, int(blockIdx.y) * kP2Rows), i1 = min(T, int(blockIdx.y + 1) * kP2Rows);
  double acc = 0;
  for (int h = 0; h < heads; ++h) {
    const float* ph = p + size_t(h) * T * T;
    for (int i = i0; i < i1; ++i) {
      const double v = ph[size_t(i) * T + j];
      acc += v * v;
    }
  }
  partial[size_t(blockIdx.y) * T + j] = acc;
}

__global__ void p2_sum_kernel(const double* partial, int T, int chunks, double* w) {
  const int j = int(blockIdx.x * blockDim.x + threadIdx.x);
  if (j >= T) return;
  double acc = 0;
  for (int k = 0; k < chunks; ++k) acc += partial[size_t(k) * T + j];
  w[j] = acc;
}

// Rows of width d widened to double, packed [n, d]: row i is src + (i / per_token)·token_stride +
// (i % per_token)·d (a KV group's query heads are per_token consecutive rows of one token), scaled
// by sqrt(w[i / per_token]) when w is given (the p2 target's Σ_j w_j v_j v_jᵀ).
__global__ void rows_to_double_kernel(const float* src, int n, int per_token, int64_t token_stride, int d,
                                      const double* w, double* dst) {
  const size_t total = size_t(n) * d;
  for (size_t k = blockIdx.x * size_t(blockDim.x) + threadIdx.x; k < total; k += size_t(gridDim.x) * blockDim.x) {
    const int i = int(k / d), c = int(k % d);
    const int t = i / per_token;
    const float* row = src + t * token_stride + int64_t(i % per_token) * d;
    const double s = w ? sqrt(w[t]) : 1.0;
    dst[k] = s * double(row[c]);
  }
}

__device__ void atomic_min_max(double* lo, double* hi, double v) {
  // Ranges are exact whatever the order, so atomics keep them deterministic.
  auto* lo_bits = reinterpret_cast<unsigned long long*>(lo);
  auto* hi_bits = reinterpret_cast<unsigned long long*>(hi);
  unsigned long long old = *lo_bits;
  while (v < __longlong_as_double(old)) {
    const unsigned long long seen = atomicCAS(lo_bits, old, __double_as_longlong(v));
    if (seen == old) break;
    old = seen;
  }
  old = *hi_bits;
  while (v > __longlong_as_double(old)) {
    const unsigned long long seen = atomicCAS(hi_bits, old, __double_as_longlong(v));
    if (seen == old) break;
    old = seen;
  }
}

// Per-channel ranges of rows [T, n_kv·d]: block (x, y) takes columns of x and rows of chunk y and
// folds them into range[(h·4 + which)·d + c] (which: 0/1 for the first of the pair, lo/hi).
constexpr int kRangeRows = 64;
__global__ void ranges_kernel(const float* rows, int T, int n_kv, int d, double* ranges, int which) {
  const int col = int(blockIdx.x * blockDim.x + threadIdx.x);
  if (col >= n_kv * d) return;
  const int t0 = int(blockIdx.y) * kRangeRows, t1 = min(T, t0 + kRangeRows);
  if (t0 >= t1) return;
  float lo = rows[size_t(t0) * n_kv * d + col], hi = lo;
  for (int t = t0 + 1; t < t1; ++t) {
    const float v = rows[size_t(t) * n_kv * d + col];
    lo = fminf(lo, v);
    hi = fmaxf(hi, v);
  }
  const int h = col / d, c = col % d;
  double* base = ranges + size_t(h) * 4 * d;
  atomic_min_max(base + size_t(which) * d + c, base + size_t(which + 1) * d + c, lo);
  atomic_min_max(base + size_t(which) * d + c, base + size_t(which + 1) * d + c, hi);
}

__global__ void add_sum_kernel(const double* w, int n, double* total) {
  __shared__ double shared[kThreads];
  double s = 0;
  for (int i = threadIdx.x; i < n; i += kThreads) s += w[i];
  s = block_sum(s, shared);
  if (threadIdx.x == 0) *total += s;
}

// dst [n, width] = rows positions[i] of src [·, width] (stride `stride`).
__global__ void gather_rows_kernel(const float* src, int64_t stride, int width, const int* positions, int n,
                                   float* dst) {
  const size_t total = size_t(n) * width;
  for (size_t k = blockIdx.x * size_t(blockDim.x) + threadIdx.x; k < total; k += size_t(gridDim.x) * blockDim.x) {
    const int i = int(k / width), c = int(k % width);
    dst[k] = src[int64_t(positions[i]) * stride + c];
  }
}

// c[e] += Σ_k partial[k, e] (chunks in order: deterministic).
constexpr int kGramRows = 256;
__global__ void add_partials_kernel(const double* partial, int chunks, int dd, double* c) {
  for (int e = int(blockIdx.x * blockDim.x + threadIdx.x); e < dd; e += int(gridDim.x * blockDim.x)) {
    double acc = 0;
    for (int k = 0; k < chunks; ++k) acc += partial[size_t(k) * dd + e];
    c[e] += acc;
  }
}

int grid_for(size_t n) { return int(std::min<size_t>((n + kThreads - 1) / kThreads, 65535 * 8)); }

}  // namespace

struct GpuLayerRunner::Impl {
  ModelConfig c;
  int d = 0, r = 0, qdim = 0, kvdim = 0, longest = 0;
  int device = 0;
  cudaStream_t stream = nullptr;
  cublasHandle_t blas = nullptr;
  DeviceArray<float> x;  // hidden states [tokens, hidden]
  // One layer's weights.
  DeviceArray<float> attn_norm, wq, wk, wv, wo, bq, bk, bv, q_norm, k_norm, mlp_norm, w_gate, w_up, w_down;
  // One sequence's activations.
  DeviceArray<float> xn, q, key, value, attn, gate, up, scores, cos_t, sin_t;
  DeviceArray<double> rows64, gram_partial, w, p2_partial;
  // Reservoir candidates: positions and the packed rows gathered (q, key_pre, key, value).
  DeviceArray<int> positions;
  DeviceArray<float> gathered;
  float* host_gathered = nullptr;  // pinned
  size_t host_gathered_n = 0;
  // Sums per (layer, KV head): five d×d matrices (full; the export mirrors one triangle so the
  // result is exactly symmetric), four ranges [d] and p2_weight.
  DeviceArray<double> m2, ranges, p2_weight;
  std::vector<uint64_t> query_count, output_count, kv_count;
  // Statistics timing: one event pair per statistics section of a sequence.
  std::vector<cudaEvent_t> events;
  int events_used = 0;
  double stats_ms = 0;
  const double one = 1.0, zero64 = 0.0;
  bool has_bias = false;

  enum Matrix { kQuery = 0, kOutput, kP2, kKey, kValue, kMatrices };
  double* matrix(int layer, int h, Matrix m) {
    return m2.p + ((size_t(layer) * c.n_kv_heads + h) * kMatrices + m) * size_t(d) * d;
  }
  double* range(int layer, int h, int which) {  // 0 key_min, 1 key_max, 2 value_min, 3 value_max
    return ranges.p + ((size_t(layer) * c.n_kv_heads + h) * 4 + which) * size_t(d);
  }

  void upload(DeviceArray<float>& dst, const float* src, size_t n, const char* what) {
    if (!src) return;
    dst.reserve(n, what);
    KVCC_CAL_CUDA(cudaMemcpyAsync(dst.p, src, n * sizeof(float), cudaMemcpyHostToDevice, stream));
  }

  // y [T, out] = x [T, in] · Wᵀ + beta·y (row-major; nn.Linear's W [out, in]).
  void linear(const float* xin, int T, int in, const float* wt, int out, float* y, float beta) {
    const float alpha = 1.0f;
    KVCC_CAL_CUDA(cublasSgemm(blas, CUBLAS_OP_T, CUBLAS_OP_N, out, T, in, &alpha, wt, in, xin, in, &beta, y, out));
  }
  void rms_norm(const float* xin, int rows, int n, int in_stride, const float* wt, float* y, int out_stride) {
    rms_norm_kernel<<<rows, kThreads, 0, stream>>>(xin, n, in_stride, wt, c.rms_eps, y, out_stride);
    KVCC_CAL_CUDA(cudaGetLastError());
  }
  // C += Aᵀ A for n rows widened into rows64 [n, d], as a split-K batch: one d×d product per
  // kGramRows rows, then the chunks added in order (one DSYRK spreads only d×d outputs over the
  // GPU). Full matrices; the export mirrors one triangle.
  void gram(double* cm, int n) {
    const int chunks = (n + kGramRows - 1) / kGramRows, padded = chunks * kGramRows;
    if (padded > n)
      KVCC_CAL_CUDA(cudaMemsetAsync(rows64.p + size_t(n) * d, 0, size_t(padded - n) * d * sizeof(double), stream));
    KVCC_CAL_CUDA(cublasDgemmStridedBatched(blas, CUBLAS_OP_N, CUBLAS_OP_T, d, d, kGramRows, &one, rows64.p, d,
                                            int64_t(kGramRows) * d, rows64.p, d, int64_t(kGramRows) * d, &zero64,
                                            gram_partial.p, d, int64_t(d) * d, chunks));
    add_partials_kernel<<<grid_for(size_t(d) * d), kThreads, 0, stream>>>(gram_partial.p, chunks, d * d, cm);
    KVCC_CAL_CUDA(cudaGetLastError());
  }
  void to_double(const float* src, int n, int per_token, int64_t token_stride, const double* scale) {
    rows_to_double_kernel<<<grid_for(size_t(n) * d), kThreads, 0, stream>>>(src, n, per_token, token_stride, d, scale,
                                                                            rows64.p);
    KVCC_CAL_CUDA(cudaGetLastError());
  }
  void stats_begin() {
    if (events_used + 2 > int(events.size())) {
      for (int k = 0; k < 2; ++k) {
        cudaEvent_t e;
        KVCC_CAL_CUDA(cudaEventCreate(&e));
        events.push_back(e);
      }
    }
    KVCC_CAL_CUDA(cudaEventRecord(events[size_t(events_used)], stream));
  }
  void stats_end() {
    KVCC_CAL_CUDA(cudaEventRecord(events[size_t(events_used) + 1], stream));
    events_used += 2;
  }
  void collect_stats_time() {  // after the stream has been synchronized
    for (int k = 0; k < events_used; k += 2) {
      float ms = 0;
      KVCC_CAL_CUDA(cudaEventElapsedTime(&ms, events[size_t(k)], events[size_t(k) + 1]));
      stats_ms += ms;
    }
    events_used = 0;
  }

  void sequence(int layer, const GpuSequence& s, bool last, ReservoirSampler& sampler);
};

GpuLayerRunner::GpuLayerRunner(const ModelConfig& config, const std::vector<float>& x, int longest, int device)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.c = config;
  m.d = config.head_dim;
  m.r = config.group();
  m.qdim = config.n_heads * m.d;
  m.kvdim = config.n_kv_heads * m.d;
  m.longest = longest;
  m.device = device;
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0)
    throw Error("--device gpu:" + std::to_string(device) +
                ": no CUDA device is available (calibrate on the CPU: --device cpu)");
  if (device < 0 || device >= count)
    throw Error("--device gpu:" + std::to_string(device) + ": this machine has " + std::to_string(count) +
                " CUDA device(s)");
  KVCC_CAL_CUDA(cudaSetDevice(device));
  KVCC_CAL_CUDA(cudaStreamCreateWithFlags(&m.stream, cudaStreamNonBlocking));
  KVCC_CAL_CUDA(cublasCreate(&m.blas));
  KVCC_CAL_CUDA(cublasSetStream(m.blas, m.stream));
  // Float32 products stay float32 (no TF32): the statistics must match the CPU path's rounding.
  KVCC_CAL_CUDA(cublasSetMathMode(m.blas, CUBLAS_DEFAULT_MATH));

  m.x.reserve(x.size(), "the calibration set's hidden states");
  KVCC_CAL_CUDA(cudaMemcpy(m.x.p, x.data(), x.size() * sizeof(float), cudaMemcpyHostToDevice));
  const size_t L = size_t(std::max(longest, 1));
  m.xn.reserve(L * config.hidden, "activations");
  m.q.reserve(L * m.qdim, "queries");
  m.attn.reserve(L * m.qdim, "attention outputs");
  m.key.reserve(L * m.kvdim, "keys");
  m.value.reserve(L * m.kvdim, "values");
  m.gate.reserve(L * config.intermediate, "the MLP's activations");
  m.up.reserve(L * config.intermediate, "the MLP's activations");
  m.scores.reserve(size_t(m.r) * L * L, "attention probabilities of one KV group");
  const size_t gram_chunks = (L * m.r + kGramRows - 1) / kGramRows;
  m.rows64.reserve(gram_chunks * kGramRows * m.d, "float64 rows");
  m.gram_partial.reserve(gram_chunks * m.d * m.d, "float64 partial sums");
  m.w.reserve(L, "value-target weights");
  m.p2_partial.reserve(((L + kP2Rows - 1) / kP2Rows) * L, "value-target weights");

  // RoPE tables for positions 0..longest-1, computed as forward.cpp's apply_rope does.
  const int half = m.d / 2;
  const std::vector<double> inv_freq_d = rope_inv_freq(config);
  std::vector<float> cos_h(L * half), sin_h(L * half);
  for (size_t t = 0; t < L; ++t)
    for (int i = 0; i < half; ++i) {
      const float angle = float(t) * float(inv_freq_d[size_t(i)]);
      cos_h[t * half + i] = float(std::cos(double(angle)));
      sin_h[t * half + i] = float(std::sin(double(angle)));
    }
  m.upload(m.cos_t, cos_h.data(), cos_h.size(), "RoPE tables");
  m.upload(m.sin_t, sin_h.data(), sin_h.size(), "RoPE tables");

  const size_t heads = size_t(config.n_layers) * config.n_kv_heads;
  m.m2.reserve(heads * Impl::kMatrices * m.d * m.d, "the statistics' sums");
  KVCC_CAL_CUDA(cudaMemsetAsync(m.m2.p, 0, m.m2.n * sizeof(double), m.stream));
  m.ranges.reserve(heads * 4 * m.d, "the statistics' ranges");
  m.p2_weight.reserve(heads, "the statistics' sums");
  KVCC_CAL_CUDA(cudaMemsetAsync(m.p2_weight.p, 0, heads * sizeof(double), m.stream));
  HeadStats empty;
  empty.resize(m.d);  // ±inf ranges, as the CPU accumulator starts
  std::vector<double> r0(heads * 4 * m.d);
  for (size_t h = 0; h < heads; ++h)
    for (int k = 0; k < 4; ++k) {
      const std::vector<double>& src = k == 0   ? empty.key_min
                                       : k == 1 ? empty.key_max
                                       : k == 2 ? empty.value_min
                                                : empty.value_max;
      std::copy(src.begin(), src.end(), r0.begin() + ptrdiff_t((h * 4 + k) * m.d));
    }
  KVCC_CAL_CUDA(cudaMemcpy(m.ranges.p, r0.data(), r0.size() * sizeof(double), cudaMemcpyHostToDevice));
  m.query_count.assign(heads, 0);
  m.output_count.assign(heads, 0);
  m.kv_count.assign(heads, 0);
}

GpuLayerRunner::~GpuLayerRunner() {
  if (!impl_) return;
  for (cudaEvent_t e : impl_->events) cudaEventDestroy(e);
  if (impl_->host_gathered) cudaFreeHost(impl_->host_gathered);
  if (impl_->blas) cublasDestroy(impl_->blas);
  if (impl_->stream) cudaStreamDestroy(impl_->stream);
}

void GpuLayerRunner::run_layer(int layer, const LayerTensors& w, const std::vector<GpuSequence>& sequences, bool last,
                               ReservoirSampler& sampler, const std::function<void(uint64_t)>& progress) {
  Impl& m = *impl_;
  KVCC_CAL_CUDA(cudaSetDevice(m.device));
  const ModelConfig& c = m.c;
  const size_t hidden = size_t(c.hidden), inter = size_t(c.intermediate);
  const bool complete = w.attn_norm && w.wq && w.wk && w.wv && (!c.qkv_bias || (w.bq && w.bk && w.bv)) &&
                        (!c.qk_norm || (w.q_norm && w.k_norm)) &&
                        (last || (w.wo && w.mlp_norm && w.w_gate && w.w_up && w.w_down));
  if (!complete) throw Error("calibrate on the GPU: layer " + std::to_string(layer) + " lacks a weight tensor");
  m.has_bias = c.qkv_bias;
  m.upload(m.attn_norm, w.attn_norm, hidden, "layer weights");
  m.upload(m.wq, w.wq, size_t(m.qdim) * hidden, "layer weights");
  m.upload(m.wk, w.wk, size_t(m.kvdim) * hidden, "layer weights");
  m.upload(m.wv, w.wv, size_t(m.kvdim) * hidden, "layer weights");
  m.upload(m.bq, w.bq, size_t(m.qdim), "layer weights");
  m.upload(m.bk, w.bk, size_t(m.kvdim), "layer weights");
  m.upload(m.bv, w.bv, size_t(m.kvdim), "layer weights");
  m.upload(m.q_norm, w.q_norm, size_t(m.d), "layer weights");
  m.upload(m.k_norm, w.k_norm, size_t(m.d), "layer weights");
  if (!last) {
    m.upload(m.wo, w.wo, hidden * m.qdim, "layer weights");
    m.upload(m.mlp_norm, w.mlp_norm, hidden, "layer weights");
    m.upload(m.w_gate, w.w_gate, inter * hidden, "layer weights");
    m.upload(m.w_up, w.w_up, inter * hidden, "layer weights");
    m.upload(m.w_down, w.w_down, hidden * inter, "layer weights");
  }
  uint64_t done = 0;
  for (const GpuSequence& s : sequences) {
    if (s.T <= 0) continue;
    if (s.T > m.longest) throw Error("calibrate on the GPU: a sequence is longer than the runner was sized for");
    m.sequence(layer, s, last, sampler);
    done += uint64_t(s.T);
    if (progress) progress(done);
  }
  KVCC_CAL_CUDA(cudaStreamSynchronize(m.stream));
}

void GpuLayerRunner::Impl::sequence(int layer, const GpuSequence& s, bool last, ReservoirSampler& sampler) {
  const int T = s.T, hidden = c.hidden, inter = c.intermediate, nkv = c.n_kv_heads;
  float* xs = x.p + s.offset * size_t(hidden);

  // The reservoir's candidates are known before the layer runs (priorities are a hash).
  const std::vector<int> cand = sampler.candidates(layer, s.doc, T);
  const int nc = int(cand.size());
  const size_t row_floats = size_t(qdim) + 3 * size_t(kvdim);
  if (nc > 0) {
    positions.reserve(size_t(nc), "reservoir positions");
    gathered.reserve(size_t(nc) * row_floats, "reservoir rows");
    if (host_gathered_n < size_t(nc) * row_floats) {
      if (host_gathered) cudaFreeHost(host_gathered);
      host_gathered = nullptr;
      host_gathered_n = 0;
      KVCC_CAL_CUDA(cudaMallocHost(&host_gathered, size_t(nc) * row_floats * sizeof(float)));
      host_gathered_n = size_t(nc) * row_floats;
    }
    KVCC_CAL_CUDA(cudaMemcpyAsync(positions.p, cand.data(), size_t(nc) * sizeof(int), cudaMemcpyHostToDevice, stream));
  }
  float* g_q = gathered.p;
  float* g_kpre = g_q + size_t(nc) * qdim;
  float* g_key = g_kpre + size_t(nc) * kvdim;
  float* g_value = g_key + size_t(nc) * kvdim;
  auto gather = [&](const float* src, int width, float* dst) {
    gather_rows_kernel<<<grid_for(size_t(nc) * width), kThreads, 0, stream>>>(src, width, width, positions.p, nc, dst);
    KVCC_CAL_CUDA(cudaGetLastError());
  };

  // attention_qkv: input norm, projections (+bias), q/k norm, RoPE.
  rms_norm(xs, T, hidden, hidden, attn_norm.p, xn.p, hidden);
  linear(xn.p, T, hidden, wq.p, qdim, q.p, 0.0f);
  linear(xn.p, T, hidden, wk.p, kvdim, key.p, 0.0f);
  linear(xn.p, T, hidden, wv.p, kvdim, value.p, 0.0f);
  if (has_bias) {
    add_bias_kernel<<<grid_for(size_t(T) * qdim), kThreads, 0, stream>>>(q.p, size_t(T) * qdim, qdim, bq.p);
    add_bias_kernel<<<grid_for(size_t(T) * kvdim), kThreads, 0, stream>>>(key.p, size_t(T) * kvdim, kvdim, bk.p);
    add_bias_kernel<<<grid_for(size_t(T) * kvdim), kThreads, 0, stream>>>(value.p, size_t(T) * kvdim, kvdim, bv.p);
    KVCC_CAL_CUDA(cudaGetLastError());
  }
  if (c.qk_norm) {
    rms_norm(q.p, T * c.n_heads, d, d, q_norm.p, q.p, d);
    rms_norm(key.p, T * nkv, d, d, k_norm.p, key.p, d);
  }
  if (nc > 0) {
    stats_begin();
    gather(key.p, kvdim, g_kpre);  // pre-RoPE keys of the candidates
    stats_end();
  }
  const bool rotate_half = c.rope_style == RopeStyle::RotateHalf;
  rope_kernel<<<grid_for(size_t(T) * c.n_heads * (d / 2)), kThreads, 0, stream>>>(q.p, T, c.n_heads, d, cos_t.p,
                                                                                  sin_t.p, rotate_half);
  rope_kernel<<<grid_for(size_t(T) * nkv * (d / 2)), kThreads, 0, stream>>>(key.p, T, nkv, d, cos_t.p, sin_t.p,
                                                                            rotate_half);
  KVCC_CAL_CUDA(cudaGetLastError());

  // Statistics of q, k, v (StatsAccumulator::on_qkv) and the reservoir rows.
  stats_begin();
  for (int h = 0; h < nkv; ++h) {
    const size_t index = size_t(layer) * nkv + h;
    to_double(q.p + size_t(h) * r * d, T * r, r, qdim, nullptr);
    gram(matrix(layer, h, kQuery), T * r);
    to_double(key.p + size_t(h) * d, T, 1, kvdim, nullptr);
    gram(matrix(layer, h, kKey), T);
    to_double(value.p + size_t(h) * d, T, 1, kvdim, nullptr);
    gram(matrix(layer, h, kValue), T);
    query_count[index] += uint64_t(T) * uint64_t(r);
    kv_count[index] += uint64_t(T);
  }
  const dim3 range_grid((kvdim + kThreads - 1) / kThreads, (T + kRangeRows - 1) / kRangeRows);
  ranges_kernel<<<range_grid, kThreads, 0, stream>>>(key.p, T, nkv, d, range(layer, 0, 0), 0);
  ranges_kernel<<<range_grid, kThreads, 0, stream>>>(value.p, T, nkv, d, range(layer, 0, 0), 2);
  KVCC_CAL_CUDA(cudaGetLastError());
  if (nc > 0) {
    gather(q.p, qdim, g_q);
    gather(key.p, kvdim, g_key);
    gather(value.p, kvdim, g_value);
    KVCC_CAL_CUDA(cudaMemcpyAsync(host_gathered, gathered.p, size_t(nc) * row_floats * sizeof(float),
                                  cudaMemcpyDeviceToHost, stream));
  }
  stats_end();

  // Causal attention per KV group: scores = scale · Q Kᵀ, softmax, o = P V (forward.cpp's attend).
  const float scale = float(1.0 / std::sqrt(double(d)));
  const float zero = 0.0f, unit = 1.0f;
  for (int g = 0; g < nkv; ++g) {
    KVCC_CAL_CUDA(cublasSgemmStridedBatched(blas, CUBLAS_OP_T, CUBLAS_OP_N, T, T, d, &scale, key.p + size_t(g) * d,
                                            kvdim, 0, q.p + size_t(g) * r * d, qdim, d, &zero, scores.p, T,
                                            int64_t(T) * T, r));
    causal_softmax_kernel<<<unsigned(r) * unsigned(T), kThreads, 0, stream>>>(scores.p, T);
    KVCC_CAL_CUDA(cudaGetLastError());
    KVCC_CAL_CUDA(cublasSgemmStridedBatched(blas, CUBLAS_OP_N, CUBLAS_OP_N, d, T, T, &unit, value.p + size_t(g) * d,
                                            kvdim, 0, scores.p, T, int64_t(T) * T, &zero, attn.p + size_t(g) * r * d,
                                            qdim, d, r));
    // Value targets (StatsAccumulator::on_probs): Σ o oᵀ per query head, Σ_j w_j v_j v_jᵀ.
    stats_begin();
    const int chunks = (T + kP2Rows - 1) / kP2Rows, col_blocks = (T + kThreads - 1) / kThreads;
    p2_partial_kernel<<<dim3(col_blocks, chunks), kThreads, 0, stream>>>(scores.p, T, r, p2_partial.p);
    p2_sum_kernel<<<col_blocks, kThreads, 0, stream>>>(p2_partial.p, T, chunks, w.p);
    KVCC_CAL_CUDA(cudaGetLastError());
    to_double(value.p + size_t(g) * d, T, 1, kvdim, w.p);
    gram(matrix(layer, g, kP2), T);
    add_sum_kernel<<<1, kThreads, 0, stream>>>(w.p, T, p2_weight.p + size_t(layer) * nkv + g);
    to_double(attn.p + size_t(g) * r * d, T * r, r, qdim, nullptr);
    gram(matrix(layer, g, kOutput), T * r);
    KVCC_CAL_CUDA(cudaGetLastError());
    output_count[size_t(layer) * nkv + g] += uint64_t(T) * uint64_t(r);
    stats_end();
  }

  if (!last) {  // attention_output_and_mlp
    linear(attn.p, T, qdim, wo.p, hidden, xs, 1.0f);
    rms_norm(xs, T, hidden, hidden, mlp_norm.p, xn.p, hidden);
    linear(xn.p, T, hidden, w_gate.p, inter, gate.p, 0.0f);
    linear(xn.p, T, hidden, w_up.p, inter, up.p, 0.0f);
    silu_mul_kernel<<<grid_for(size_t(T) * inter), kThreads, 0, stream>>>(gate.p, up.p, size_t(T) * inter);
    KVCC_CAL_CUDA(cudaGetLastError());
    linear(gate.p, T, inter, w_down.p, hidden, xs, 1.0f);
  }

  KVCC_CAL_CUDA(cudaStreamSynchronize(stream));
  collect_stats_time();
  if (nc > 0) {
    const float* h_q = host_gathered;
    const float* h_kpre = h_q + size_t(nc) * qdim;
    const float* h_key = h_kpre + size_t(nc) * kvdim;
    const float* h_value = h_key + size_t(nc) * kvdim;
    const auto t0 = std::chrono::steady_clock::now();
    sampler.offer(layer, s.doc, cand, true, h_q, h_kpre, h_key, h_value);
    stats_ms += 1e3 * std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
}

std::vector<HeadStats> GpuLayerRunner::head_stats() const {
  const Impl& m = *impl_;
  KVCC_CAL_CUDA(cudaSetDevice(m.device));
  KVCC_CAL_CUDA(cudaStreamSynchronize(m.stream));
  const size_t heads = size_t(m.c.n_layers) * m.c.n_kv_heads, dd = size_t(m.d) * m.d;
  std::vector<double> m2(m.m2.n), ranges(heads * 4 * m.d), p2w(heads);
  KVCC_CAL_CUDA(cudaMemcpy(m2.data(), m.m2.p, m2.size() * sizeof(double), cudaMemcpyDeviceToHost));
  KVCC_CAL_CUDA(cudaMemcpy(ranges.data(), m.ranges.p, ranges.size() * sizeof(double), cudaMemcpyDeviceToHost));
  KVCC_CAL_CUDA(cudaMemcpy(p2w.data(), m.p2_weight.p, heads * sizeof(double), cudaMemcpyDeviceToHost));
  std::vector<HeadStats> out(heads);
  for (size_t h = 0; h < heads; ++h) {
    HeadStats& hs = out[h];
    hs.resize(m.d);
    // The row-major lower triangle (i >= j), mirrored.
    auto take = [&](std::vector<double>& dst, int which) {
      const double* src = m2.data() + (h * Impl::kMatrices + size_t(which)) * dd;
      for (int i = 0; i < m.d; ++i)
        for (int j = 0; j <= i; ++j) dst[size_t(i) * m.d + j] = dst[size_t(j) * m.d + i] = src[size_t(i) * m.d + j];
    };
    take(hs.query_m2, Impl::kQuery);
    take(hs.output_m2, Impl::kOutput);
    take(hs.p2_m2, Impl::kP2);
    take(hs.key_m2, Impl::kKey);
    take(hs.value_m2, Impl::kValue);
    auto range_of = [&](std::vector<double>& dst, int which) {
      const double* src = ranges.data() + (h * 4 + size_t(which)) * m.d;
      std::copy(src, src + m.d, dst.begin());
    };
    range_of(hs.key_min, 0);
    range_of(hs.key_max, 1);
    range_of(hs.value_min, 2);
    range_of(hs.value_max, 3);
    hs.p2_weight = p2w[h];
    hs.query_count = m.query_count[h];
    hs.output_count = m.output_count[h];
    hs.kv_count = m.kv_count[h];
  }
  return out;
}

double GpuLayerRunner::stats_seconds() const { return impl_->stats_ms * 1e-3; }

std::string GpuLayerRunner::device_name() const {
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, impl_->device) != cudaSuccess)
    return "CUDA device " + std::to_string(impl_->device);
  return prop.name;
}

}  // namespace kvcc
