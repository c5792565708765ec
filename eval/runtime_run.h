// One runtime-path scheme's serving runtime during an experiment: a kvcc::Runtime (one window
// slot, pages for the longest document) and, for a device pool, the device copies of one block's
// q / k / v / out. Per document one sequence; per block begin_block once, then per layer
// attend_and_append: prefill (the block over the cache plus itself, causally; its own K/V rotated
// and BF16-rounded as the ring holds them) and the step's append, Runtime::prefill's call order.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>

#include "eval/scheme.h"
#include "runtime/kvcc_runtime.h"

namespace kvcc {

class RuntimeRun {
 public:
  // s must be on the runtime path with an artifact; max_length sizes the page pool.
  RuntimeRun(const CacheScheme& s, const ModelConfig& c, int64_t max_length);
  ~RuntimeRun();
  RuntimeRun(const RuntimeRun&) = delete;
  RuntimeRun& operator=(const RuntimeRun&) = delete;

  void begin_document();
  void end_document();
  void begin_block(int T);
  // The block's attention (out [T, n_heads·d], host float32) over the cache plus itself, then the
  // step's append of (append_k, append_v): the block's own K/V, or the reference run's in static
  // mode. All arrays are host memory.
  void attend_and_append(int layer, int T, const float* q, const float* k, const float* v, const float* append_k,
                         const float* append_v, float* out);

 private:
  void reserve(size_t tokens);
  void release();

  std::unique_ptr<Runtime> rt_;
  bool device_ = false;
  int seq_ = -1;
  size_t qdim_ = 0, kvdim_ = 0, cap_ = 0;
  float *q_ = nullptr, *k_ = nullptr, *v_ = nullptr, *out_ = nullptr;  // device, cap_ tokens
};

}  // namespace kvcc
