#include "eval/runtime_run.h"

#include <algorithm>
#include <string>

#include "formats/error.h"

#if defined(KVCC_HAVE_CUDA)
#include <cuda_runtime.h>
#endif

namespace kvcc {

namespace {
#if defined(KVCC_HAVE_CUDA)
// Synchronous copies on the legacy default stream, where the runtime queues its kernels: in order.
void copy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  const cudaError_t e = cudaMemcpy(dst, src, bytes, kind);
  if (e != cudaSuccess) throw Error(std::string("validation (runtime, GPU): copy failed: ") + cudaGetErrorString(e));
}
#endif
}  // namespace

RuntimeRun::RuntimeRun(const CacheScheme& s, const ModelConfig& c, int64_t max_length) {
  const RuntimePath* path = std::get_if<RuntimePath>(&s.path);
  KVCC_REQUIRE(path && s.artifact, "scheme " + s.name + ": the runtime path needs a runtime scheme with an artifact");
  device_ = path->pool == PoolMemory::Device;
  const Artifact& a = *s.artifact;
  KVCC_REQUIRE(s.sink == a.recipe.sink && s.recent == a.recipe.recent && s.page_size == a.recipe.page_size,
               "scheme " + s.name +
                   ": the runtime path serves the artifact recipe's windows and page size "
                   "(set them in the recipe, not in the scheme)");
  const int64_t pages = max_length / std::max(1, a.recipe.page_size) + 1;
  rt_ = std::make_unique<Runtime>(a, EngineShape{c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim},
                                  RuntimeOptions{pages, 1, path->pool, 0.0f});
  qdim_ = size_t(c.n_heads) * c.head_dim;
  kvdim_ = size_t(c.n_kv_heads) * c.head_dim;
}

RuntimeRun::~RuntimeRun() { release(); }

void RuntimeRun::begin_document() { seq_ = rt_->cache().add_sequence(); }

void RuntimeRun::end_document() {
  if (seq_ >= 0) rt_->cache().free_sequence(seq_);
  seq_ = -1;
}

void RuntimeRun::begin_block(int T) { rt_->begin_append({seq_}, {T}); }

void RuntimeRun::attend_and_append(int layer, int T, const float* q, const float* k, const float* v,
                                   const float* append_k, const float* append_v, float* out) {
  if (!device_) {
    rt_->prefill(layer, seq_, T, q, k, v, out);
    rt_->append(layer, append_k, append_v);
    return;
  }
#if defined(KVCC_HAVE_CUDA)
  reserve(size_t(T));
  const size_t qb = size_t(T) * qdim_ * sizeof(float), kb = size_t(T) * kvdim_ * sizeof(float);
  copy(q_, q, qb, cudaMemcpyHostToDevice);
  copy(k_, k, kb, cudaMemcpyHostToDevice);
  copy(v_, v, kb, cudaMemcpyHostToDevice);
  rt_->prefill(layer, seq_, T, q_, k_, v_, out_);
  if (append_k != k) copy(k_, append_k, kb, cudaMemcpyHostToDevice);
  if (append_v != v) copy(v_, append_v, kb, cudaMemcpyHostToDevice);
  rt_->append(layer, k_, v_);
  copy(out, out_, qb, cudaMemcpyDeviceToHost);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw Error(std::string("validation (runtime, GPU): ") + cudaGetErrorString(e));
#else
  throw Error("validation: a device pool in a build without CUDA");
#endif
}

void RuntimeRun::reserve(size_t tokens) {
#if defined(KVCC_HAVE_CUDA)
  if (tokens <= cap_) return;
  release();
  auto alloc = [](float*& p, size_t n) {
    KVCC_REQUIRE(cudaMalloc(&p, n * sizeof(float)) == cudaSuccess,
                 "validation (runtime, GPU): cannot allocate " + std::to_string(n * sizeof(float)) + " bytes");
  };
  alloc(q_, tokens * qdim_);
  alloc(k_, tokens * kvdim_);
  alloc(v_, tokens * kvdim_);
  alloc(out_, tokens * qdim_);
  cap_ = tokens;
#endif
}

void RuntimeRun::release() {
#if defined(KVCC_HAVE_CUDA)
  for (float** p : {&q_, &k_, &v_, &out_}) {
    cudaFree(*p);
    *p = nullptr;
  }
  cap_ = 0;
#endif
}

}  // namespace kvcc
