// FP8 (E4M3) weights with float scales, read as float32. Two kinds of Hugging Face checkpoint
// store them, both declared by config.json's `quantization_config`:
// - quant_method "fp8" (DeepSeek-V3, Qwen3-*-FP8): WEIGHT in F8_E4M3 [out, in] and
//   WEIGHT_scale_inv [ceil(out/bo), ceil(in/bi)] for weight_block_size [bo, bi] (transformers'
//   default [128, 128] when absent; null: one scale, shape [] or [1]). Despite its name the scale
//   multiplies.
// - quant_method "compressed-tensors", format "float-quantized" (8-bit float weights, symmetric):
//   WEIGHT_scale of shape [] or [1] (strategy tensor), [out, 1] (channel), [out, ceil(in/g)]
//   (group of g) or [ceil(out/bo), ceil(in/bi)] (block [bo, bi]).
// Element (i, j) = float(w[i, j]) · scale[i / bo, j / bi] in float32 (one rounding), so a reader
// equals torch's `w.float() * scale` expanded over the blocks bit for bit. Activation scales
// (input_scale, activation_scale) are not applied: the model is its dequantized weights, what
// transformers runs when it dequantizes. Which tensors are quantized follows their dtype: every
// F8_E4M3 tensor needs its scale, and every scale its F8_E4M3 tensor.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "formats/safetensors.h"

namespace kvcc {

struct WeightQuantization {
  std::string method;        // "" (none) | "fp8" | "compressed-tensors"
  std::string scale_suffix;  // appended to a weight's name: "_scale_inv" (fp8) | "_scale"
  std::string strategy;      // "block" | "tensor" | "channel" | "group"
  // The block one scale covers: rows, columns; 0 = the whole dimension (tensor: 0, 0; channel:
  // 1, 0; group g: 1, g).
  int block_rows = 0;
  int block_cols = 0;
};

// Parses config.json's quantization_config (absent or null: method ""). Refuses, naming the
// field, quantization methods and formats kvcc does not dequantize (GPTQ, AWQ, bitsandbytes,
// int or packed compressed-tensors, FP8 with UE8M0 scales, E5M2, ...).
WeightQuantization parse_weight_quantization(const nlohmann::json& config, const std::string& where);

// One quantized tensor's scale grid: scale[r * grid_cols + c] covers rows [r·block_rows, ...) and
// columns [c·block_cols, ...) of the weight.
struct WeightScale {
  std::vector<float> values;
  int64_t block_rows = 0, block_cols = 0;  // resolved: never 0
  int64_t grid_cols = 0;
};

// Pairs every F8_E4M3 tensor of `tensors` with its scale and checks both (a 2-D weight, a float
// scale of the shape the strategy implies, finite and non-negative scales, no scale without its
// weight, no F8_E5M2); throws Error naming `where` and the tensor. Returns weight name -> scale.
std::map<std::string, WeightScale> pair_weight_scales(const WeightQuantization&,
                                                      const std::map<std::string, TensorView>& tensors,
                                                      const std::string& where);

// Elements [first, first + count) of a quantized 2-D weight as float32; an FP8 NaN is refused
// naming the tensor and the element.
void dequantize_to_f32(const TensorView& weight, const WeightScale& scale, size_t first, size_t count, float* out);

// The float value of an E4M3 (fn: no infinities, NaN = S.1111.111) byte.
float float_from_e4m3(uint8_t byte);

}  // namespace kvcc
