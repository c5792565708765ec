// A model on disk: a Hugging Face directory (config.json + model.safetensors, or a sharded set
// with model.safetensors.index.json; f32/f16/bf16, or FP8 E4M3 with scales as FP8 and
// compressed-tensors checkpoints store them: formats/quantized_weights.h) or a llama2.c checkpoint
// (.bin). Weights are memory-mapped and converted to float32 (dequantized) one tensor at a time, so
// a caller holds at most what it asks for (calibration: one layer).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "formats/model_config.h"

namespace kvcc {

class ModelFile {
 public:
  // Opens a HF directory or a llama2.c .bin; throws Error naming what is missing or wrong
  // (unknown architecture, missing tensor, a header that lies about sizes, truncated data).
  static ModelFile open(const std::string& path);

  const ModelConfig& config() const;
  const ModelFingerprint& fingerprint() const;
  const std::string& path() const;

  // Tensors use Hugging Face Llama names whatever the source format:
  //   model.embed_tokens.weight, model.norm.weight, lm_head.weight (absent when tied),
  //   model.layers.{L}.input_layernorm.weight, .self_attn.{q,k,v,o}_proj.weight,
  //   .self_attn.{q,k,v}_proj.bias (Qwen2), .self_attn.{q,k}_norm.weight (Qwen3),
  //   .post_attention_layernorm.weight, .mlp.{gate,up,down}_proj.weight.
  // Matrices are [out, in] row-major as in PyTorch's nn.Linear.
  bool has_tensor(const std::string& name) const;
  std::vector<int64_t> tensor_shape(const std::string& name) const;
  std::vector<float> tensor_f32(const std::string& name) const;  // throws Error when missing
  // Rows [row0, row0 + n_rows) of a 2-D tensor as float32 into out [n_rows, cols], so embedding
  // lookups and a chunked LM head never convert the whole matrix.
  void tensor_rows_f32(const std::string& name, int64_t row0, int64_t n_rows, float* out) const;
  // Storage dtype as safetensors spells it ("F32", "BF16", "F8_E4M3", ...; "F32" for llama2.c).
  // tensor_f32 and tensor_rows_f32 return an F8_E4M3 weight multiplied by its scales.
  std::string tensor_dtype(const std::string& name) const;
  // Names of all tensors the model file holds, sorted.
  std::vector<std::string> tensor_names() const;

  ModelFile(ModelFile&&) noexcept;
  ModelFile& operator=(ModelFile&&) noexcept;
  ~ModelFile();

 private:
  struct Impl;
  explicit ModelFile(std::unique_ptr<Impl>);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvcc
