// What one evaluated KV cache is: its windows, page size and how its pages are made, either by a
// page codec that simulates the cache (the codec path) or by the serving runtime itself (the
// runtime path). eval/experiment.h runs schemes against the full-precision model.
//
// Cache policy (the CUDA runtime's, formats/kv_layout.h tiers_of): per layer and KV head the first
// S tokens stay full precision (sink), the last post-sink tokens stay full precision in a ring of
// W, and when a token arrives while the ring holds W its oldest P tokens are quantised as one page
// by the artifact's method (formats/kv_codec.h roundtrip_layer_page, all KV heads of the layer at
// once); a page never changes afterwards. On the codec path the windows hold float32 (or double);
// on the runtime path they hold BF16 in the rotated basis and pages are the INT2 bytes the kernels
// read (eval/runtime_run.h).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <variant>

#include "formats/artifact.h"
#include "formats/kv_codec.h"
#include "formats/model_file.h"
#include "runtime/kv_cache.h"

namespace kvcc {

// Quantise + dequantise one page of n tokens of all KV heads of (layer, side): rows and out are
// [n, n_kv * d] (token-major; KV head h holds channels [h*d, (h+1)*d)), at positions
// first_position.. (CommVQ codes keys pre-RoPE, so it needs them). Per layer because a quantiser
// group may span several KV heads (small head_dim).
using PageCodec =
    std::function<void(int layer, KvSide side, const float* rows, int n, int64_t first_position, float* out)>;

// The codec path: pages simulated by `codec` (null: pages kept in full precision, the reference).
struct CodecPath {
  PageCodec codec;
};
// The runtime path: a kvcc::Runtime on the host pool (the CPU reference kernels) or the device
// pool (the CUDA kernels). Its windows must be the artifact recipe's.
struct RuntimePath {
  PoolMemory pool = PoolMemory::Host;
};

struct CacheScheme {
  std::string name;  // shown in tables ("oscar", a file name, ...)
  int sink = 64, recent = 256, page_size = 64;
  std::shared_ptr<const Artifact> artifact;  // bit accounting (and the runtime path); null for hand-made schemes
  std::variant<CodecPath, RuntimePath> path;

  bool on_runtime() const { return std::holds_alternative<RuntimePath>(path); }
  // "codec", "runtime/cpu" or "runtime/gpu": the path and pool that run it.
  std::string path_name() const;
};

// Which pool a runtime-path scheme uses. Auto: the device one when the build has CUDA, a device
// is present and the shape is in the GPU kernels' scope, else the host one; Gpu: the device one or
// an Error saying why not.
enum class ValidateDevice { Auto, Cpu, Gpu };
bool cuda_device_present();  // built with CUDA and cudaGetDeviceCount > 0

// The codec-path scheme an artifact's recipe describes (codec = kv_codec roundtrip_layer_page;
// CommVQ: commvq_roundtrip_keys/values per KV head with the model's RoPE).
CacheScheme scheme_from_artifact(Artifact artifact, const std::string& name, const ModelConfig& config);

// The runtime-path scheme of an artifact: its recipe's windows, the pool `device` picks. Throws
// Error naming the artifact and the reason when the runtime cannot serve it (method, bits,
// spanning group, windows the cache refuses) or when the GPU is asked for and cannot be had.
CacheScheme runtime_scheme_from_artifact(Artifact artifact, const std::string& name, const ModelConfig& config,
                                         ValidateDevice device);

// Throws Error naming what differs when the artifact was compiled for another model (fingerprint,
// layer/head counts, head_dim or RoPE convention).
void check_artifact_matches(const Artifact& artifact, const ModelFile& model, const std::string& artifact_name);

}  // namespace kvcc
