#include "eval/scheme.h"

#include <algorithm>
#include <vector>

#include "formats/codec_commvq.h"
#include "formats/error.h"
#include "formats/method.h"
#include "runtime/kvcc_runtime.h"

#if defined(KVCC_HAVE_CUDA)
#include <cuda_runtime.h>
#endif

namespace kvcc {

std::string CacheScheme::path_name() const {
  if (const RuntimePath* rt = std::get_if<RuntimePath>(&path))
    return rt->pool == PoolMemory::Device ? "runtime/gpu" : "runtime/cpu";
  return "codec";
}

bool cuda_device_present() {
#if defined(KVCC_HAVE_CUDA)
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return false;
  }
  return n > 0;
#else
  return false;
#endif
}

namespace {
// A scheme named `name` with the artifact's windows and page size (either cache path).
CacheScheme artifact_scheme(Artifact artifact, const std::string& name) {
  CacheScheme s;
  s.name = name;
  s.sink = artifact.recipe.sink;
  s.recent = artifact.recipe.recent;
  s.page_size = artifact.recipe.page_size;
  s.artifact = std::make_shared<const Artifact>(std::move(artifact));
  return s;
}
}  // namespace

CacheScheme runtime_scheme_from_artifact(Artifact artifact, const std::string& name, const ModelConfig& config,
                                         ValidateDevice device) {
  CacheScheme s = artifact_scheme(std::move(artifact), name);
  const EngineShape engine{config.n_layers, config.n_heads, config.n_kv_heads, config.head_dim};
  std::string scope;  // why the device pool cannot serve it: checked up front, so that Auto can
                      // pick the host pool instead of failing mid-run
  try {
    // A host runtime with no pages checks everything the real one will: method, bits, group,
    // shapes, and the windows the cache accepts (pages of a multiple of 16 tokens, ring >= page).
    Runtime probe(*s.artifact, engine, RuntimeOptions{0, 1, PoolMemory::Host, 0.0f});
    scope = device_scope_problem(probe.geometry(), config.n_heads, cache_widths(*s.artifact));
  } catch (const Error& e) {
    throw Error("artifact " + name + " cannot be served by the runtime: " + e.what() +
                " (the codec cache path evaluates it)");
  }
  RuntimePath path;
  switch (device) {
    case ValidateDevice::Cpu:
      path.pool = PoolMemory::Host;
      break;
    case ValidateDevice::Gpu:
#if !defined(KVCC_HAVE_CUDA)
      throw Error("device gpu: this kvcc was built without CUDA (device cpu or auto runs on the host)");
#endif
      KVCC_REQUIRE(cuda_device_present(),
                   "device gpu: no CUDA device is present (device cpu or auto runs on the host)");
      KVCC_REQUIRE(scope.empty(), "artifact " + name + " is outside the GPU kernels' scope: " + scope +
                                      " (device cpu or auto serves it from the host pool)");
      path.pool = PoolMemory::Device;
      break;
    case ValidateDevice::Auto:
      path.pool = scope.empty() && cuda_device_present() ? PoolMemory::Device : PoolMemory::Host;
      break;
  }
  s.path = path;
  return s;
}

CacheScheme scheme_from_artifact(Artifact artifact, const std::string& name, const ModelConfig& config) {
  CacheScheme s = artifact_scheme(std::move(artifact), name);
  const std::shared_ptr<const Artifact> a = s.artifact;
  if (method_traits(method_of(a->recipe)).codec == CodecFamily::CommvqCodebooks) {
    // Codebooks decoded once per (layer, KV head); keys are coded pre-RoPE at their positions.
    struct Books {
      std::vector<CommvqKeyCodebook> keys;
      std::vector<CommvqValueCodebook> values;
      std::vector<double> inv_freq;
    };
    auto books = std::make_shared<Books>();
    books->inv_freq = rope_inv_freq(config);
    for (const HeadArtifact& h : a->heads) {
      books->keys.push_back(commvq_key_codebook(h.key, a->head_dim, a->rope_style));
      books->values.push_back(commvq_value_codebook(h.value, a->head_dim, true));
    }
    const int n_kv = a->n_kv_heads, d = a->head_dim;
    s.path = CodecPath{
        [books, n_kv, d](int layer, KvSide side, const float* rows, int n, int64_t first_position, float* out) {
          const size_t kvdim = size_t(n_kv) * d;
          std::vector<float> head_rows(size_t(n) * d), head_out(size_t(n) * d);
          std::vector<int32_t> positions(static_cast<size_t>(n));
          for (int t = 0; t < n; ++t) positions[size_t(t)] = int32_t(first_position + t);
          for (int h = 0; h < n_kv; ++h) {  // CommVQ's codebooks are per KV head
            for (int t = 0; t < n; ++t)
              std::copy_n(rows + size_t(t) * kvdim + size_t(h) * d, d, head_rows.data() + size_t(t) * d);
            const size_t index = size_t(layer) * size_t(n_kv) + size_t(h);
            if (side == KvSide::Value)
              commvq_roundtrip_values(books->values[index], head_rows.data(), size_t(n), head_out.data());
            else
              commvq_roundtrip_keys(books->keys[index], head_rows.data(), positions.data(), size_t(n), books->inv_freq,
                                    true, head_out.data());
            for (int t = 0; t < n; ++t)
              std::copy_n(head_out.data() + size_t(t) * d, d, out + size_t(t) * kvdim + size_t(h) * d);
          }
        }};
    return s;
  }
  s.path = CodecPath{[a](int layer, KvSide side, const float* rows, int n, int64_t, float* out) {
    roundtrip_layer_page(*a, layer, side, rows, n, out);
  }};
  return s;
}

void check_artifact_matches(const Artifact& artifact, const ModelFile& model, const std::string& artifact_name) {
  const ModelConfig& c = model.config();
  auto shape = [&](const char* what, int have, int want) {
    KVCC_REQUIRE(have == want, "artifact " + artifact_name + " was compiled for another model: " + what + " " +
                                   std::to_string(have) + " vs the model's " + std::to_string(want));
  };
  shape("n_layers", artifact.n_layers, c.n_layers);
  shape("n_kv_heads", artifact.n_kv_heads, c.n_kv_heads);
  shape("n_heads", artifact.n_heads, c.n_heads);
  shape("head_dim", artifact.head_dim, c.head_dim);
  KVCC_REQUIRE(artifact.rope_style == c.rope_style,
               "artifact " + artifact_name + " was compiled for another model: RoPE " +
                   rope_style_name(artifact.rope_style) + " vs the model's " + rope_style_name(c.rope_style));
  if (!artifact.fingerprint.id.empty() && !artifact.fingerprint.matches(model.fingerprint()))
    throw Error("artifact " + artifact_name +
                " was compiled for another model: " + artifact.fingerprint.describe_difference(model.fingerprint()));
  KVCC_REQUIRE(artifact.heads.size() == size_t(c.n_layers) * size_t(c.n_kv_heads),
               "artifact " + artifact_name + " holds " + std::to_string(artifact.heads.size()) +
                   " heads, the model needs " + std::to_string(c.n_layers * c.n_kv_heads));
}

}  // namespace kvcc
