#include "formats/quantized_weights.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <nlohmann/json.hpp>
#include <tuple>

#include "formats/error.h"
#include "formats/json_int.h"

namespace kvcc {

using nlohmann::json;

namespace {

bool present(const json& j, const char* key) { return j.is_object() && j.contains(key) && !j[key].is_null(); }

std::string string_field(const json& j, const char* key, const std::string& where) {
  KVCC_REQUIRE(j[key].is_string(), where + ": field '" + key + "' must be a string");
  return j[key].get<std::string>();
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// A [rows, cols] pair of positive block sizes.
std::pair<int, int> block_pair(const json& v, const std::string& what) {
  KVCC_REQUIRE(v.is_array() && v.size() == 2, what + " must be a pair of positive integers, got " + v.dump());
  return {json_int32(v[0], what + "[0]", 1), json_int32(v[1], what + "[1]", 1)};
}

WeightQuantization parse_fp8(const json& q, const std::string& where) {
  WeightQuantization w;
  w.method = "fp8";
  w.scale_suffix = "_scale_inv";
  // transformers' FineGrainedFP8Config: fmt e4m3, float scales, FP8 experts.
  if (present(q, "fmt")) {
    const std::string fmt = string_field(q, "fmt", where);
    KVCC_REQUIRE(fmt == "e4m3", where + ": fp8 fmt '" + fmt + "' is not supported (kvcc reads e4m3)");
  }
  if (present(q, "scale_fmt")) {
    const std::string fmt = string_field(q, "scale_fmt", where);
    KVCC_REQUIRE(fmt == "float", where + ": fp8 scale_fmt '" + fmt + "' is not supported (kvcc reads float scales)");
  }
  if (present(q, "expert_dtype")) {
    const std::string e = string_field(q, "expert_dtype", where);
    KVCC_REQUIRE(e == "fp8", where + ": fp8 expert_dtype '" + e + "' is not supported (kvcc reads fp8)");
  }
  if (present(q, "activation_scheme")) {
    const std::string a = string_field(q, "activation_scheme", where);
    KVCC_REQUIRE(a == "dynamic" || a == "static",
                 where + ": fp8 activation_scheme '" + a + "' is not dynamic or static");
  }
  if (!q.contains("weight_block_size")) {  // transformers' default
    w.strategy = "block";
    w.block_rows = w.block_cols = 128;
  } else if (q["weight_block_size"].is_null()) {
    w.strategy = "tensor";
  } else {
    w.strategy = "block";
    std::tie(w.block_rows, w.block_cols) = block_pair(q["weight_block_size"], where + ": field 'weight_block_size'");
  }
  return w;
}

WeightQuantization parse_compressed_tensors(const json& q, const std::string& where) {
  WeightQuantization w;
  w.method = "compressed-tensors";
  w.scale_suffix = "_scale";
  if (present(q, "quantization_status")) {
    const std::string s = string_field(q, "quantization_status", where);
    KVCC_REQUIRE(s == "compressed", where + ": compressed-tensors quantization_status '" + s +
                                        "' is not supported (kvcc reads compressed checkpoints)");
  }
  const std::string top_format = present(q, "format") ? string_field(q, "format", where) : "";
  KVCC_REQUIRE(present(q, "config_groups") && q["config_groups"].is_object() && !q["config_groups"].empty(),
               where + ": compressed-tensors quantization_config lacks 'config_groups'");
  for (auto it = q["config_groups"].begin(); it != q["config_groups"].end(); ++it) {
    const std::string gw = where + ": config group '" + it.key() + "'";
    const json& group = it.value();
    KVCC_REQUIRE(group.is_object(), gw + " is not an object");
    const std::string format = present(group, "format") ? string_field(group, "format", gw) : top_format;
    KVCC_REQUIRE(!format.empty(), gw + " has no 'format' (nor has the quantization_config)");
    KVCC_REQUIRE(format == "float-quantized",
                 gw + ": compressed-tensors format '" + format + "' is not supported (kvcc reads float-quantized)");
    if (!present(group, "weights")) continue;  // activations only: the weights stay in float
    const json& s = group["weights"];
    const std::string ww = gw + " weights";
    KVCC_REQUIRE(s.is_object(), ww + " is not an object");
    KVCC_REQUIRE(present(s, "type") && s["type"] == "float",
                 ww + ": type must be \"float\", got " + (present(s, "type") ? s["type"].dump() : "none"));
    KVCC_REQUIRE(
        present(s, "num_bits") && s["num_bits"] == 8,
        ww + ": num_bits must be 8 (FP8 E4M3), got " + (present(s, "num_bits") ? s["num_bits"].dump() : "none"));
    KVCC_REQUIRE(!present(s, "symmetric") || s["symmetric"] == true,
                 ww + ": asymmetric weights (a zero point) are not supported");
    KVCC_REQUIRE(!present(s, "dynamic") || s["dynamic"] == false, ww + ": dynamic weight scales are not supported");
    KVCC_REQUIRE(present(s, "strategy"), ww + " lack 'strategy'");
    WeightQuantization g = w;
    g.strategy = string_field(s, "strategy", ww);
    if (g.strategy == "tensor") {
    } else if (g.strategy == "channel") {
      g.block_rows = 1;
    } else if (g.strategy == "group") {
      KVCC_REQUIRE(present(s, "group_size"), ww + ": strategy group lacks 'group_size'");
      g.block_rows = 1;
      g.block_cols = json_int32(s["group_size"], ww + ": field 'group_size'", 1);
    } else if (g.strategy == "block") {
      KVCC_REQUIRE(present(s, "block_structure"), ww + ": strategy block lacks 'block_structure'");
      std::tie(g.block_rows, g.block_cols) = block_pair(s["block_structure"], ww + ": field 'block_structure'");
    } else {
      throw Error(ww + ": strategy '" + g.strategy + "' is not supported (tensor, channel, group, block)");
    }
    // Which module a group targets is not resolved: one weight scheme for the whole checkpoint.
    KVCC_REQUIRE(w.strategy.empty() ||
                     (w.strategy == g.strategy && w.block_rows == g.block_rows && w.block_cols == g.block_cols),
                 where + ": config groups with different weight schemes (" + w.strategy + ", " + g.strategy +
                     ") are not supported");
    w = g;
  }
  return w;
}

}  // namespace

WeightQuantization parse_weight_quantization(const json& config, const std::string& where) {
  if (!present(config, "quantization_config")) return {};
  const json& q = config["quantization_config"];
  const std::string qw = where + ": quantization_config";
  KVCC_REQUIRE(q.is_object(), qw + " must be an object");
  KVCC_REQUIRE(present(q, "quant_method"), qw + " lacks 'quant_method'");
  const std::string method = string_field(q, "quant_method", qw);
  if (method == "fp8") return parse_fp8(q, qw);
  if (method == "compressed-tensors") return parse_compressed_tensors(q, qw);
  throw Error(qw + ": quant_method '" + method +
              "' is not supported (kvcc dequantizes fp8 and compressed-tensors float-quantized checkpoints)");
}

float float_from_e4m3(uint8_t byte) {
  const int exp = (byte >> 3) & 0xf, mant = byte & 0x7;
  float v;
  if (exp == 0xf && mant == 0x7) v = std::nanf("");
  else if (exp == 0) v = std::ldexp(float(mant), -9);  // subnormal: mant/8 · 2^-6
  else v = std::ldexp(float(8 + mant), exp - 10);      // (1 + mant/8) · 2^(exp-7)
  return (byte & 0x80) ? -v : v;
}

std::map<std::string, WeightScale> pair_weight_scales(const WeightQuantization& q,
                                                      const std::map<std::string, TensorView>& tensors,
                                                      const std::string& where) {
  std::map<std::string, WeightScale> out;
  for (const auto& [name, view] : tensors) {
    const std::string tw = where + ": tensor " + name;
    KVCC_REQUIRE(view.dtype != TensorDType::F8E5M2, tw + " is F8_E5M2, which kvcc does not read (FP8 checkpoints "
                                                         "store weights in F8_E4M3)");
    if (q.method.empty() || view.dtype == TensorDType::F8E4M3) continue;
    // A weight's scale is WEIGHT + suffix (activation scales such as X.input_scale are not); its
    // weight must be a quantized tensor.
    if (!name.ends_with("weight" + q.scale_suffix)) continue;
    const std::string weight = name.substr(0, name.size() - q.scale_suffix.size());
    auto it = tensors.find(weight);
    KVCC_REQUIRE(
        it != tensors.end() && it->second.dtype == TensorDType::F8E4M3,
        tw + " is a scale of " + weight + ", which " +
            (it == tensors.end() ? std::string("is absent")
                                 : std::string("is ") + tensor_dtype_name(it->second.dtype) + ", not F8_E4M3"));
  }
  for (const auto& [name, view] : tensors) {
    if (view.dtype != TensorDType::F8E4M3) continue;
    const std::string tw = where + ": tensor " + name;
    KVCC_REQUIRE(!q.method.empty(), tw + " is F8_E4M3 but config.json has no quantization_config saying how it is "
                                         "scaled");
    KVCC_REQUIRE(!q.strategy.empty(), tw + " is F8_E4M3 but the quantization_config quantizes no weights");
    KVCC_REQUIRE(view.shape.size() == 2,
                 tw + " is F8_E4M3 of shape " + shape_text(view.shape) + "; only matrices are dequantized");
    const std::string scale_name = name + q.scale_suffix;
    auto s = tensors.find(scale_name);
    KVCC_REQUIRE(s != tensors.end(), tw + " is F8_E4M3 but its scale " + scale_name + " is missing");
    const TensorView& sv = s->second;
    const std::string sw = where + ": scale " + scale_name;
    KVCC_REQUIRE(sv.dtype == TensorDType::F32 || sv.dtype == TensorDType::BF16 || sv.dtype == TensorDType::F16 ||
                     sv.dtype == TensorDType::F64,
                 sw + " has dtype " + tensor_dtype_name(sv.dtype) + " (expected F32, BF16, F16 or F64)");
    const int64_t rows = view.shape[0], cols = view.shape[1];
    WeightScale ws;
    ws.block_rows = q.block_rows > 0 ? q.block_rows : std::max<int64_t>(rows, 1);
    ws.block_cols = q.block_cols > 0 ? q.block_cols : std::max<int64_t>(cols, 1);
    const int64_t grid_rows = (rows + ws.block_rows - 1) / ws.block_rows;
    ws.grid_cols = (cols + ws.block_cols - 1) / ws.block_cols;
    bool shape_ok;
    std::string expected;
    if (q.strategy == "tensor") {  // a scalar, saved as [] or [1]
      shape_ok = sv.shape.empty() || sv.shape == std::vector<int64_t>{1};
      expected = "[] or [1]";
    } else {
      const std::vector<int64_t> want = {grid_rows, ws.grid_cols};
      shape_ok = sv.shape == want;
      expected = shape_text(want);
    }
    const std::string scheme = q.method + " " + q.strategy +
                               (q.strategy == "block" || q.strategy == "group"
                                    ? " " + std::to_string(q.block_rows) + "x" + std::to_string(q.block_cols)
                                    : "");
    KVCC_REQUIRE(shape_ok, sw + " has shape " + shape_text(sv.shape) + " but " + scheme + " scales of a " +
                               shape_text(view.shape) + " weight have shape " + expected);
    ws.values.resize(size_t(sv.numel()));
    tensor_to_f32(sv, 0, ws.values.size(), ws.values.data());
    for (size_t i = 0; i < ws.values.size(); ++i)
      KVCC_REQUIRE(std::isfinite(ws.values[i]) && ws.values[i] >= 0, sw + " holds " + std::to_string(ws.values[i]) +
                                                                         " at element " + std::to_string(i) +
                                                                         " (scales must be finite and non-negative)");
    out.emplace(name, std::move(ws));
  }
  return out;
}

void dequantize_to_f32(const TensorView& weight, const WeightScale& scale, size_t first, size_t count, float* out) {
  KVCC_REQUIRE(weight.dtype == TensorDType::F8E4M3 && weight.shape.size() == 2,
               "tensor " + weight.name + " is not an F8_E4M3 matrix");
  KVCC_REQUIRE(first + count <= size_t(weight.numel()), "tensor " + weight.name + ": elements [" +
                                                            std::to_string(first) + ", " +
                                                            std::to_string(first + count) + ") out of range");
  static const auto table = [] {
    std::array<float, 256> t{};
    for (int b = 0; b < 256; ++b) t[size_t(b)] = float_from_e4m3(uint8_t(b));
    return t;
  }();
  const size_t cols = size_t(weight.shape[1]), end = first + count;
  for (size_t e = first; e < end;) {  // row by row, one scale block of the row at a time
    const size_t i = e / cols, j0 = e % cols, j1 = std::min(cols, j0 + (end - e));
    const float* scales = scale.values.data() + size_t(int64_t(i) / scale.block_rows * scale.grid_cols);
    for (size_t j = j0; j < j1;) {
      const size_t block = size_t(int64_t(j) / scale.block_cols);
      const size_t n = std::min(j1, (block + 1) * size_t(scale.block_cols)) - j;
      const float s = scales[block];
      const uint8_t* bytes = weight.data + e;
      float* dst = out + (e - first);
      bool nan = false;
      for (size_t k = 0; k < n; ++k) {
        nan |= (bytes[k] & 0x7f) == 0x7f;
        dst[k] = table[bytes[k]] * s;
      }
      if (nan) [[unlikely]]
        for (size_t k = 0; k < n; ++k)
          KVCC_REQUIRE((bytes[k] & 0x7f) != 0x7f,
                       "tensor " + weight.name + " holds an FP8 NaN at element " + std::to_string(e + k));
      j += n;
      e += n;
    }
  }
}

}  // namespace kvcc
