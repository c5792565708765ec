// What kvcc needs to know about a model's architecture, whatever file it came from, and the
// fingerprint that ties artifacts and stats files to one model.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace kvcc {

// Which channels RoPE rotates together: HF "rotate_half" pairs (i, i + d/2); llama2.c pairs (2i, 2i+1).
enum class RopeStyle { RotateHalf, Interleaved };

const char* rope_style_name(RopeStyle s);            // "rotate_half" | "interleaved"
RopeStyle rope_style_from_name(const std::string&);  // throws Error on an unknown name

struct RopeScaling {
  std::string type = "default";  // "default" | "llama3"
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int original_max_position = 8192;
};

struct ModelConfig {
  std::string architecture;  // "llama" | "mistral" | "qwen2" | "qwen3" | "llama2c"
  int n_layers = 0;
  int hidden = 0;
  int n_heads = 0;     // query heads
  int n_kv_heads = 0;  // key/value heads; n_heads % n_kv_heads == 0
  int head_dim = 0;
  int intermediate = 0;
  int vocab = 0;
  int max_position = 0;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  RopeStyle rope_style = RopeStyle::RotateHalf;
  double rms_eps = 1e-5;
  bool tied_embeddings = false;
  bool qkv_bias = false;  // Qwen2
  bool qk_norm = false;   // Qwen3 per-head RMSNorm on q and k before RoPE
  int bos_id = -1;        // -1: none
  int eos_id = -1;
  bool add_bos = true;  // whether the tokenizer/config asks for BOS at the start of a sequence

  int group() const { return n_heads / n_kv_heads; }  // query heads per KV head
};

// A model's identity: architecture fields (canonical order, as strings) plus a sha256 over its
// weight files' tensor headers (names, dtypes, shapes; sorted by name), so a renamed copy of the
// same model matches and a different model does not. `id` is sha256(fields ‖ weights_sha256):
// the value compared.
struct ModelFingerprint {
  std::vector<std::pair<std::string, std::string>> fields;
  std::string weights_sha256;  // hex
  std::string id;              // hex

  bool matches(const ModelFingerprint& o) const { return id == o.id; }
  // Human-readable list of what differs ("n_layers: 8 vs 36; weights: differ"), empty if equal.
  std::string describe_difference(const ModelFingerprint& o) const;
};

// Architecture fields of a config in canonical order (the fingerprint's `fields`).
std::vector<std::pair<std::string, std::string>> fingerprint_fields(const ModelConfig&);
// sha256 over "name=value\n" for each field in order, then "weights_sha256=HEX\n" (readers
// recompute it to detect an edited fingerprint).
std::string fingerprint_id(const std::vector<std::pair<std::string, std::string>>& fields,
                           const std::string& weights_sha256);
// RoPE inverse frequencies [head_dim/2] of a config, including llama3 rope scaling (a property of
// the architecture, shared by the forward pass, CommVQ and its report).
std::vector<double> rope_inv_freq(const ModelConfig&);

// Builds a fingerprint from a config and the sha256 of its tensor headers.
ModelFingerprint make_fingerprint(const ModelConfig&, const std::string& weights_sha256);

}  // namespace kvcc
