// The calibration's layer loop on a CUDA GPU (`kvcc calibrate-model --device gpu`): the hidden
// states of every calibration token stay on the device, each layer's float32 weights are uploaded
// in turn (so a model larger than the GPU still calibrates), the layer runs on cuBLAS SGEMMs in
// float32 as the CPU forward does (model/forward.h, same operations and RoPE tables), and the
// statistics of formats/stats.h accumulate on the device in float64 (Gram DGEMMs over the float32 rows
// widened to double). Reservoir rows are gathered on the device and offered to the host sampler,
// so the kept tokens are the CPU path's. Only this file's interface is seen without nvcc.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "calibrate/accumulators.h"
#include "formats/model_config.h"
#include "formats/stats.h"

namespace kvcc {

// True when this build has the GPU path (CUDA found at configure time).
bool gpu_calibration_built();

// One calibration sequence: its document index and where its T tokens start in the hidden states.
struct GpuSequence {
  uint32_t doc = 0;
  int T = 0;
  size_t offset = 0;  // in tokens
};

// One layer's float32 weights in the layout of model/forward.h's LayerWeights (nn.Linear [out, in]
// row-major), as host pointers; null for tensors the architecture lacks (biases, q/k norms). (A
// view, so that this header stays free of forward.h, which nvcc's C++17 cannot read.)
struct LayerTensors {
  const float *attn_norm = nullptr, *wq = nullptr, *wk = nullptr, *wv = nullptr, *wo = nullptr;
  const float *bq = nullptr, *bk = nullptr, *bv = nullptr, *q_norm = nullptr, *k_norm = nullptr;
  const float *mlp_norm = nullptr, *w_gate = nullptr, *w_up = nullptr, *w_down = nullptr;
};

class GpuLayerRunner {
 public:
  // Selects CUDA device `device`, uploads the hidden states x [tokens, hidden] and allocates the
  // float64 sums of every (layer, KV head) and scratch for sequences of up to `longest` tokens.
  // Throws Error when no such device exists or memory runs out (naming the sizes).
  GpuLayerRunner(const ModelConfig& config, const std::vector<float>& x, int longest, int device);
  ~GpuLayerRunner();
  GpuLayerRunner(const GpuLayerRunner&) = delete;
  GpuLayerRunner& operator=(const GpuLayerRunner&) = delete;

  // Runs `layer` over every sequence (attention only when `last`: its MLP output is never read),
  // accumulating the layer's sums and offering each sequence's reservoir candidates to `sampler`.
  // `progress` is called after each sequence with the tokens done in this layer.
  void run_layer(int layer, const LayerTensors& weights, const std::vector<GpuSequence>& sequences, bool last,
                 ReservoirSampler& sampler, const std::function<void(uint64_t)>& progress);

  // The sums of every (layer, KV head), matrices mirrored to full symmetric form.
  std::vector<HeadStats> head_stats() const;
  // Device time spent in statistics (sums, ranges, reservoir gathers and their download).
  double stats_seconds() const;
  std::string device_name() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvcc
