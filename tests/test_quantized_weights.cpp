// FP8 checkpoints (quant_method fp8 with block scales; compressed-tensors float-quantized per
// tensor and per channel) read by ModelFile: the dequantized weights against torch's own
// dequantization (tests/reference/make_quantized_models.py stored the sha256 of `w.float() *
// scale` per tensor), calibration of an FP8 model against the same model saved with those weights
// in F32, and the refusals of malformed or unsupported checkpoints.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>

#include "calibrate/driver.h"
#include "calibrate/synthetic_model.h"
#include "formats/error.h"
#include "formats/model_file.h"
#include "formats/quantized_weights.h"
#include "formats/safetensors_writer.h"
#include "formats/sha256.h"
#include "formats/stats.h"
#include "forward_test_util.h"
#include "one_blas_thread.h"

namespace fs = std::filesystem;
using namespace kvcc;
using namespace kvcc::testing;
using nlohmann::json;

namespace {

const char* const kModels[] = {"llama-fp8-block", "qwen3-ct-channel", "llama-ct-tensor"};

struct TempDir {
  fs::path path;
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "kvcc-fp8-XXXXXX").string();
    path = mkdtemp(tmpl.data());
  }
  ~TempDir() { fs::remove_all(path); }
};

std::string read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}
void write_bytes(const fs::path& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), std::streamsize(bytes.size()));
}

// A safetensors file as its JSON header and data bytes, for editing.
struct Safetensors {
  json header;
  std::string data;
  static Safetensors read(const fs::path& p) {
    const std::string bytes = read_bytes(p);
    uint64_t n;
    std::memcpy(&n, bytes.data(), 8);
    return {json::parse(bytes.substr(8, n)), bytes.substr(8 + n)};
  }
  void write(const fs::path& p) const {
    const std::string h = header.dump();
    const uint64_t n = h.size();
    write_bytes(p, std::string(reinterpret_cast<const char*>(&n), 8) + h + data);
  }
  char* bytes_of(const std::string& name) { return data.data() + header[name]["data_offsets"][0].get<size_t>(); }
};

// A copy of a test model that a test may break.
struct ModelCopy {
  TempDir tmp;
  fs::path dir;
  explicit ModelCopy(const std::string& name) : dir(tmp.path / name) {
    fs::copy(data_models_dir() + "/" + name, dir, fs::copy_options::recursive);
  }
  json config() const { return read_json_file((dir / "config.json").string()); }
  void set_config(const json& c) const { write_bytes(dir / "config.json", c.dump(1)); }
  Safetensors weights() const { return Safetensors::read(dir / "model.safetensors"); }
  void set_weights(const Safetensors& s) const { s.write(dir / "model.safetensors"); }
  std::string open_error() const {
    try {
      ModelFile::open(dir.string());
    } catch (const Error& e) {
      return e.what();
    }
    return "<opened>";
  }
};

json digests(const std::string& model) {
  return read_json_file(data_models_dir() + "/" + model + "/dequantized.json")["dequantized_f32_sha256"];
}

// The same model with every tensor as float32 (what tensor_f32 returns) and no quantization_config.
void write_f32_twin(const ModelFile& m, const fs::path& dir) {
  fs::create_directories(dir);
  json config = read_json_file(m.path() + "/config.json");
  config.erase("quantization_config");
  write_bytes(dir / "config.json", config.dump(1));
  std::vector<F32Tensor> tensors;
  for (const std::string& name : m.tensor_names()) {
    if (name.ends_with("_scale") || name.ends_with("_scale_inv")) continue;
    tensors.push_back({name, m.tensor_shape(name), m.tensor_f32(name)});
  }
  write_safetensors_f32((dir / "model.safetensors").string(), tensors);
}

}  // namespace

TEST(QuantizedWeights, E4m3DecodesEveryByte) {
  // Against the format's definition: 1 sign, 4 exponent bits (bias 7), 3 mantissa bits, no
  // infinities, S.1111.111 NaN; 448 the largest and 2^-9 the smallest magnitude.
  for (int b = 0; b < 256; ++b) {
    const int e = (b >> 3) & 15, m = b & 7;
    const double mag = e == 0 ? m / 8.0 * std::pow(2.0, -6) : (1 + m / 8.0) * std::pow(2.0, e - 7);
    const float v = float_from_e4m3(uint8_t(b));
    if (e == 15 && m == 7) {
      EXPECT_TRUE(std::isnan(v)) << b;
      continue;
    }
    EXPECT_EQ(double(v), (b & 0x80) ? -mag : mag) << "byte " << b;
  }
  EXPECT_EQ(float_from_e4m3(0x7e), 448.0f);
  EXPECT_EQ(float_from_e4m3(0x01), std::ldexp(1.0f, -9));
}

TEST(QuantizedWeights, DequantizedWeightsEqualTorchBitForBit) {
  for (const char* name : kModels) {
    SCOPED_TRACE(name);
    const ModelFile m = ModelFile::open(data_models_dir() + "/" + name);
    const json want = digests(name);
    ASSERT_GT(want.size(), 0u);
    for (auto it = want.begin(); it != want.end(); ++it) {
      EXPECT_EQ(m.tensor_dtype(it.key()), "F8_E4M3") << it.key();
      const std::vector<float> w = m.tensor_f32(it.key());
      // Little-endian float32 bytes, as the reference hashed them.
      EXPECT_EQ(sha256_hex(w.data(), w.size() * sizeof(float)), it.value().get<std::string>()) << it.key();
      // Row blocks (the embedding and LM-head path) cut through scale blocks the same way.
      const std::vector<int64_t> shape = m.tensor_shape(it.key());
      const int64_t row0 = shape[0] / 2 + 1, n = shape[0] - row0;
      std::vector<float> rows(size_t(n * shape[1]));
      m.tensor_rows_f32(it.key(), row0, n, rows.data());
      EXPECT_TRUE(std::equal(rows.begin(), rows.end(), w.begin() + row0 * shape[1])) << it.key();
    }
  }
}

TEST(QuantizedWeights, CalibrationEqualsTheF32TwinExactly) {
  // Identical float32 weights through the same forward: the statistics agree bit for bit.
  for (const char* name : kModels) {
    SCOPED_TRACE(name);
    TempDir tmp;
    const std::string quantized = data_models_dir() + "/" + name;
    write_f32_twin(ModelFile::open(quantized), tmp.path / "twin");
    SyntheticModelSpec spec;
    spec.vocab = ModelFile::open(quantized).config().vocab;
    write_token_ids((tmp.path / "ids.txt").string(), synthetic_documents(spec, 6, 40, 3));
    CalibrationOptions o;
    o.ids_path = (tmp.path / "ids.txt").string();
    o.reservoir = 50;
    o.model_path = quantized;
    const Stats a = calibrate_model(o);
    o.model_path = (tmp.path / "twin").string();
    const Stats b = calibrate_model(o);
    EXPECT_NE(a.fingerprint.weights_sha256, b.fingerprint.weights_sha256);  // the dtypes differ
    ASSERT_EQ(a.heads.size(), b.heads.size());
    for (size_t i = 0; i < a.heads.size(); ++i) {
      const HeadStats &x = a.heads[i], &y = b.heads[i];
      EXPECT_EQ(x.query_m2, y.query_m2);
      EXPECT_EQ(x.output_m2, y.output_m2);
      EXPECT_EQ(x.p2_m2, y.p2_m2);
      EXPECT_EQ(x.key_m2, y.key_m2);
      EXPECT_EQ(x.value_m2, y.value_m2);
      EXPECT_EQ(x.key_min, y.key_min);
      EXPECT_EQ(x.value_max, y.value_max);
      EXPECT_EQ(x.p2_weight, y.p2_weight);
      EXPECT_EQ(x.kv_count, y.kv_count);
      EXPECT_EQ(a.reservoirs[i].q, b.reservoirs[i].q);
      EXPECT_EQ(a.reservoirs[i].key_pre, b.reservoirs[i].key_pre);
      EXPECT_EQ(a.reservoirs[i].value, b.reservoirs[i].value);
    }
  }
}

TEST(QuantizedWeights, ConfigsKvccDoesNotDequantizeAreRefusedByName) {
  ModelCopy fp8("llama-fp8-block");
  const json base = fp8.config();
  auto refused = [&](const ModelCopy& m, const json& config, const std::string& expect) {
    m.set_config(config);
    EXPECT_NE(m.open_error().find(expect), std::string::npos) << m.open_error();
  };
  json c = base;
  c["quantization_config"]["quant_method"] = "awq";
  refused(fp8, c, "quant_method 'awq' is not supported");
  c = base;
  c["quantization_config"].erase("quant_method");
  refused(fp8, c, "lacks 'quant_method'");
  c = base;
  c["quantization_config"]["fmt"] = "e5m2";
  refused(fp8, c, "fp8 fmt 'e5m2'");
  c = base;
  c["quantization_config"]["scale_fmt"] = "ue8m0";
  refused(fp8, c, "scale_fmt 'ue8m0'");
  c = base;
  c["quantization_config"]["weight_block_size"] = {128};
  refused(fp8, c, "weight_block_size' must be a pair");
  c = base;
  c["quantization_config"]["weight_block_size"] = {64, 128};  // scales no longer tile the weights
  refused(fp8, c, "fp8 block 64x128 scales of a [160, 136] weight have shape [3, 2]");
  c = base;
  c.erase("quantization_config");
  refused(fp8, c, "is F8_E4M3 but config.json has no quantization_config");

  ModelCopy ct("qwen3-ct-channel");
  const json ct_base = ct.config();
  c = ct_base;
  c["quantization_config"]["format"] = "pack-quantized";
  refused(ct, c, "compressed-tensors format 'pack-quantized' is not supported");
  c = ct_base;
  c["quantization_config"]["quantization_status"] = "frozen";
  refused(ct, c, "quantization_status 'frozen'");
  c = ct_base;
  c["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 4;
  refused(ct, c, "num_bits must be 8");
  c = ct_base;
  c["quantization_config"]["config_groups"]["group_0"]["weights"]["type"] = "int";
  refused(ct, c, "type must be \"float\"");
  c = ct_base;
  c["quantization_config"]["config_groups"]["group_0"]["weights"]["symmetric"] = false;
  refused(ct, c, "asymmetric weights");
  c = ct_base;
  c["quantization_config"]["config_groups"]["group_0"]["weights"]["strategy"] = "group";
  refused(ct, c, "strategy group lacks 'group_size'");
  c = ct_base;
  c["quantization_config"]["config_groups"]["group_0"]["weights"]["strategy"] = "token";
  refused(ct, c, "strategy 'token' is not supported");
  c = ct_base;
  c["quantization_config"]["config_groups"]["group_1"] = c["quantization_config"]["config_groups"]["group_0"];
  c["quantization_config"]["config_groups"]["group_1"]["weights"]["strategy"] = "tensor";
  refused(ct, c, "config groups with different weight schemes (channel, tensor)");
  c = ct_base;
  c["quantization_config"]["config_groups"]["group_0"]["weights"]["strategy"] = "tensor";  // scales are [out, 1]
  refused(ct, c, "has shape [64, 1] but compressed-tensors tensor scales of a [64, 96] weight");
}

TEST(QuantizedWeights, MalformedScalesAndWeightsAreRefusedNamingTheTensor) {
  const std::string w = "model.layers.1.self_attn.k_proj.weight", s = w + "_scale_inv";
  {
    ModelCopy m("llama-fp8-block");
    Safetensors st = m.weights();
    st.header.erase(s);
    m.set_weights(st);
    EXPECT_NE(m.open_error().find("tensor " + w + " is F8_E4M3 but its scale " + s + " is missing"), std::string::npos)
        << m.open_error();
  }
  {  // Same bytes, another shape: [1, 2] -> [2, 1].
    ModelCopy m("llama-fp8-block");
    Safetensors st = m.weights();
    ASSERT_EQ(st.header[s]["shape"], json({1, 2}));
    st.header[s]["shape"] = {2, 1};
    m.set_weights(st);
    EXPECT_NE(m.open_error().find("scale " + s +
                                  " has shape [2, 1] but fp8 block 128x128 scales of a [72, 160] "
                                  "weight have shape [1, 2]"),
              std::string::npos)
        << m.open_error();
  }
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(), -0.5f}) {
    ModelCopy m("llama-fp8-block");
    Safetensors st = m.weights();
    std::memcpy(st.bytes_of(s) + 4, &bad, 4);
    m.set_weights(st);
    EXPECT_NE(m.open_error().find("scale " + s + " holds"), std::string::npos) << m.open_error();
    EXPECT_NE(m.open_error().find("at element 1 (scales must be finite and non-negative)"), std::string::npos);
  }
  {  // A scale of an F32 scale tensor's dtype that is not float.
    ModelCopy m("llama-fp8-block");
    Safetensors st = m.weights();
    st.header[s]["dtype"] = "I32";
    m.set_weights(st);
    EXPECT_NE(m.open_error().find("scale " + s + " has dtype I32"), std::string::npos) << m.open_error();
  }
  {  // A scale without its weight.
    ModelCopy m("llama-fp8-block");
    Safetensors st = m.weights();
    st.header["model.extra.weight_scale_inv"] = st.header[s];
    m.set_weights(st);
    EXPECT_NE(m.open_error().find("is a scale of model.extra.weight, which is absent"), std::string::npos)
        << m.open_error();
  }
  {  // E5M2 is refused, not misread.
    ModelCopy m("llama-fp8-block");
    Safetensors st = m.weights();
    st.header[w]["dtype"] = "F8_E5M2";
    m.set_weights(st);
    EXPECT_NE(m.open_error().find("tensor " + w + " is F8_E5M2"), std::string::npos) << m.open_error();
  }
  {  // An FP8 NaN byte: refused when the tensor is converted, naming it and the element.
    ModelCopy m("llama-fp8-block");
    Safetensors st = m.weights();
    st.bytes_of(w)[7] = char(0x7f);
    m.set_weights(st);
    const ModelFile mf = ModelFile::open(m.dir.string());
    try {
      mf.tensor_f32(w);
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("tensor " + w + " holds an FP8 NaN at element 7"), std::string::npos)
          << e.what();
    }
  }
}
