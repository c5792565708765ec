#include "formats/model_file.h"

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "formats/error.h"
#include "formats/hf_config.h"
#include "formats/llama2c.h"
#include "formats/quantized_weights.h"
#include "formats/safetensors.h"
#include "formats/sha256.h"

namespace kvcc {

namespace fs = std::filesystem;

struct ModelFile::Impl {
  std::string path;
  ModelConfig config;
  ModelFingerprint fingerprint;
  std::map<std::string, TensorView> tensors;
  std::map<std::string, WeightScale> scales;  // F8_E4M3 tensors (formats/quantized_weights.h)

  const TensorView& find(const std::string& name) const {
    auto it = tensors.find(name);
    KVCC_REQUIRE(it != tensors.end(), path + ": missing tensor " + name);
    return it->second;
  }
  // Elements of a tensor as float32: dequantized when it is a scaled F8_E4M3 weight.
  void convert(const TensorView& view, size_t first, size_t count, float* out) const {
    auto scale = scales.find(view.name);
    if (scale != scales.end()) dequantize_to_f32(view, scale->second, first, count, out);
    else tensor_to_f32(view, first, count, out);
  }
};

namespace {

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

// Calls visit(name, shape) for each tensor the forward pass reads, with the shapes the config
// implies, a layer at a time: a config claiming millions of layers costs nothing until a tensor
// is missing (listing them all first took gigabytes).
template <class Visit>
void visit_expected_tensors(const ModelConfig& c, Visit&& visit) {
  const int64_t hidden = c.hidden, qdim = int64_t(c.n_heads) * c.head_dim, kvdim = int64_t(c.n_kv_heads) * c.head_dim,
                inter = c.intermediate;
  visit("model.embed_tokens.weight", std::vector<int64_t>{c.vocab, hidden});
  visit("model.norm.weight", std::vector<int64_t>{hidden});
  if (!c.tied_embeddings) visit("lm_head.weight", std::vector<int64_t>{c.vocab, hidden});
  for (int l = 0; l < c.n_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    visit(p + "input_layernorm.weight", std::vector<int64_t>{hidden});
    visit(p + "self_attn.q_proj.weight", std::vector<int64_t>{qdim, hidden});
    visit(p + "self_attn.k_proj.weight", std::vector<int64_t>{kvdim, hidden});
    visit(p + "self_attn.v_proj.weight", std::vector<int64_t>{kvdim, hidden});
    visit(p + "self_attn.o_proj.weight", std::vector<int64_t>{hidden, qdim});
    if (c.qkv_bias) {
      visit(p + "self_attn.q_proj.bias", std::vector<int64_t>{qdim});
      visit(p + "self_attn.k_proj.bias", std::vector<int64_t>{kvdim});
      visit(p + "self_attn.v_proj.bias", std::vector<int64_t>{kvdim});
    }
    if (c.qk_norm) {
      visit(p + "self_attn.q_norm.weight", std::vector<int64_t>{c.head_dim});
      visit(p + "self_attn.k_norm.weight", std::vector<int64_t>{c.head_dim});
    }
    visit(p + "post_attention_layernorm.weight", std::vector<int64_t>{hidden});
    visit(p + "mlp.gate_proj.weight", std::vector<int64_t>{inter, hidden});
    visit(p + "mlp.up_proj.weight", std::vector<int64_t>{inter, hidden});
    visit(p + "mlp.down_proj.weight", std::vector<int64_t>{hidden, inter});
  }
}

std::map<std::string, TensorView> read_hf_weights(const fs::path& dir) {
  const fs::path index_path = dir / "model.safetensors.index.json";
  const fs::path single_path = dir / "model.safetensors";
  if (fs::exists(index_path)) {
    std::ifstream in(index_path);
    KVCC_REQUIRE(bool(in), index_path.string() + ": cannot open");
    std::stringstream text;
    text << in.rdbuf();
    nlohmann::json index;
    try {
      index = nlohmann::json::parse(text.str());
    } catch (const nlohmann::json::exception& e) {
      throw Error(index_path.string() + ": not valid JSON (" + e.what() + ")");
    }
    KVCC_REQUIRE(index.contains("weight_map") && index["weight_map"].is_object(),
                 index_path.string() + ": missing field 'weight_map'");
    std::map<std::string, std::map<std::string, TensorView>> shards;
    std::map<std::string, TensorView> tensors;
    for (auto it = index["weight_map"].begin(); it != index["weight_map"].end(); ++it) {
      KVCC_REQUIRE(it.value().is_string(),
                   index_path.string() + ": weight_map entry " + it.key() + " is not a file name");
      const std::string shard = it.value().get<std::string>();
      KVCC_REQUIRE(shard.find('/') == std::string::npos,
                   index_path.string() + ": shard name '" + shard + "' is not a plain file name");
      auto found = shards.find(shard);
      if (found == shards.end()) {
        const fs::path shard_path = dir / shard;
        // The error_code form: a name the file system refuses (too long) is the index's fault.
        std::error_code ec;
        const bool exists = fs::exists(shard_path, ec);
        KVCC_REQUIRE(exists && !ec, index_path.string() + " names shard " + shard + ", which does not exist" +
                                        (ec ? " (" + ec.message() + ")" : ""));
        found = shards.emplace(shard, read_safetensors(shard_path.string())).first;
      }
      auto tensor = found->second.find(it.key());
      KVCC_REQUIRE(tensor != found->second.end(),
                   index_path.string() + " places tensor " + it.key() + " in " + shard + ", which lacks it");
      tensors.emplace(it.key(), tensor->second);
    }
    return tensors;
  }
  KVCC_REQUIRE(fs::exists(single_path), dir.string() + ": no model.safetensors or model.safetensors.index.json");
  return read_safetensors(single_path.string());
}

// config.json's quantization_config (read_hf_config has already checked that the file parses).
WeightQuantization read_weight_quantization(const fs::path& dir) {
  const fs::path path = dir / "config.json";
  std::ifstream in(path);
  KVCC_REQUIRE(bool(in), path.string() + ": cannot open");
  std::stringstream text;
  text << in.rdbuf();
  try {
    return parse_weight_quantization(nlohmann::json::parse(text.str()), path.string());
  } catch (const nlohmann::json::exception& e) {
    throw Error(path.string() + ": not valid JSON (" + e.what() + ")");
  }
}

std::string weights_header_sha256(const std::map<std::string, TensorView>& tensors) {
  Sha256 hash;  // std::map iterates in sorted name order
  for (const auto& [name, view] : tensors) {
    std::string shape;
    for (size_t i = 0; i < view.shape.size(); ++i) {
      if (i) shape += ',';
      shape += std::to_string(view.shape[i]);
    }
    hash.update(name).update("\t").update(tensor_dtype_name(view.dtype)).update("\t").update(shape).update("\n");
  }
  return hash.hex_digest();
}

}  // namespace

ModelFile ModelFile::open(const std::string& path) {
  auto impl = std::make_unique<Impl>();
  impl->path = path;
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);
  KVCC_REQUIRE(!ec && fs::exists(status), "model path " + path + " does not exist");
  if (fs::is_directory(status)) {
    impl->config = read_hf_config(path);
    impl->tensors = read_hf_weights(path);
    impl->scales = pair_weight_scales(read_weight_quantization(path), impl->tensors, path);
  } else {
    KVCC_REQUIRE(fs::path(path).extension() == ".bin",
                 path + ": not a model (expected a Hugging Face directory or a llama2.c .bin)");
    impl->tensors = read_llama2c(path, impl->config);
  }
  // The fingerprint covers the file's own headers, before tied weights are resolved.
  const std::string weights_sha256 = weights_header_sha256(impl->tensors);
  if (impl->config.tied_embeddings) {
    // Tied checkpoints store the shared matrix under either name (tinystories-656k keeps only
    // lm_head.weight); it is exposed as model.embed_tokens.weight and lm_head is absent.
    auto head = impl->tensors.find("lm_head.weight");
    if (head != impl->tensors.end()) {
      if (!impl->tensors.count("model.embed_tokens.weight")) {
        TensorView embedding = head->second;
        embedding.name = "model.embed_tokens.weight";
        impl->tensors.emplace(embedding.name, std::move(embedding));
        auto scale = impl->scales.find("lm_head.weight");
        if (scale != impl->scales.end()) impl->scales.emplace("model.embed_tokens.weight", scale->second);
      }
      impl->tensors.erase("lm_head.weight");
      impl->scales.erase("lm_head.weight");
    }
  }
  visit_expected_tensors(impl->config, [&](const std::string& name, const std::vector<int64_t>& shape) {
    const TensorView& view = impl->find(name);
    KVCC_REQUIRE(view.shape == shape, path + ": tensor " + name + " has shape " + shape_text(view.shape) +
                                          " but the config implies " + shape_text(shape));
    KVCC_REQUIRE(view.dtype == TensorDType::F32 || view.dtype == TensorDType::F16 || view.dtype == TensorDType::BF16 ||
                     view.dtype == TensorDType::F64 || impl->scales.count(name),
                 path + ": tensor " + name + " has non-float dtype " + tensor_dtype_name(view.dtype));
  });
  impl->fingerprint = make_fingerprint(impl->config, weights_sha256);
  return ModelFile(std::move(impl));
}

ModelFile::ModelFile(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ModelFile::ModelFile(ModelFile&&) noexcept = default;
ModelFile& ModelFile::operator=(ModelFile&&) noexcept = default;
ModelFile::~ModelFile() = default;

const ModelConfig& ModelFile::config() const { return impl_->config; }
const ModelFingerprint& ModelFile::fingerprint() const { return impl_->fingerprint; }
const std::string& ModelFile::path() const { return impl_->path; }

bool ModelFile::has_tensor(const std::string& name) const { return impl_->tensors.count(name) > 0; }

std::vector<int64_t> ModelFile::tensor_shape(const std::string& name) const { return impl_->find(name).shape; }

std::string ModelFile::tensor_dtype(const std::string& name) const {
  return tensor_dtype_name(impl_->find(name).dtype);
}

std::vector<std::string> ModelFile::tensor_names() const {
  std::vector<std::string> names;
  for (const auto& entry : impl_->tensors) names.push_back(entry.first);
  return names;
}

std::vector<float> ModelFile::tensor_f32(const std::string& name) const {
  const TensorView& view = impl_->find(name);
  std::vector<float> out(size_t(view.numel()));
  impl_->convert(view, 0, out.size(), out.data());
  return out;
}

void ModelFile::tensor_rows_f32(const std::string& name, int64_t row0, int64_t n_rows, float* out) const {
  const TensorView& view = impl_->find(name);
  KVCC_REQUIRE(view.shape.size() == 2, impl_->path + ": tensor " + name + " is not a matrix");
  KVCC_REQUIRE(row0 >= 0 && n_rows >= 0 && row0 + n_rows <= view.shape[0],
               impl_->path + ": rows [" + std::to_string(row0) + ", " + std::to_string(row0 + n_rows) +
                   ") out of range for tensor " + name + " with " + std::to_string(view.shape[0]) + " rows");
  const size_t cols = size_t(view.shape[1]);
  impl_->convert(view, size_t(row0) * cols, size_t(n_rows) * cols, out);
}

}  // namespace kvcc
