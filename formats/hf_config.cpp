#include "formats/hf_config.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "formats/error.h"
#include "formats/json_int.h"

namespace kvcc {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

std::optional<json> read_json_if_present(const fs::path& path) {
  if (!fs::exists(path)) return std::nullopt;
  std::ifstream in(path);
  KVCC_REQUIRE(bool(in), path.string() + ": cannot open");
  std::stringstream buffer;
  buffer << in.rdbuf();
  try {
    return json::parse(buffer.str());
  } catch (const json::exception& e) {
    throw Error(path.string() + ": not valid JSON (" + e.what() + ")");
  }
}

bool present(const json& j, const char* key) { return j.contains(key) && !j[key].is_null(); }

int required_int(const json& j, const char* key, const std::string& where) {
  KVCC_REQUIRE(present(j, key), where + ": missing field '" + key + "'");
  return json_int32(j[key], where + ": field '" + key + "'", 1);
}

int optional_int(const json& j, const char* key, int fallback, const std::string& where) {
  if (!present(j, key)) return fallback;
  return json_int32(j[key], where + ": field '" + key + "'");
}

double optional_number(const json& j, const char* key, double fallback, const std::string& where) {
  if (!present(j, key)) return fallback;
  KVCC_REQUIRE(j[key].is_number(), where + ": field '" + key + "' must be a number");
  const double v = j[key].get<double>();
  KVCC_REQUIRE(std::isfinite(v), where + ": field '" + key + "' must be finite, got " + j[key].dump());
  return v;
}

bool optional_bool(const json& j, const char* key, bool fallback, const std::string& where) {
  if (!present(j, key)) return fallback;
  KVCC_REQUIRE(j[key].is_boolean(), where + ": field '" + key + "' must be true or false");
  return j[key].get<bool>();
}

// A token id field that may be an integer or a list of integers (Llama 3.1's eos): the first.
std::optional<int> token_id(const json& j, const char* key, const std::string& where) {
  if (!present(j, key)) return std::nullopt;
  const json& v = j[key];
  if (v.is_number_integer()) return json_int32(v, where + ": field '" + key + "'");
  if (v.is_array() && !v.empty() && v[0].is_number_integer()) return json_int32(v[0], where + ": field '" + key + "'");
  return std::nullopt;
}

struct Arch {
  const char* hf_class;
  const char* model_type;
  const char* name;
};
constexpr Arch kArchitectures[] = {
    {"LlamaForCausalLM", "llama", "llama"},
    {"MistralForCausalLM", "mistral", "mistral"},
    {"Qwen2ForCausalLM", "qwen2", "qwen2"},
    {"Qwen3ForCausalLM", "qwen3", "qwen3"},
};

std::string architecture_of(const json& config, const std::string& where) {
  std::string declared;
  if (present(config, "architectures") && config["architectures"].is_array() && !config["architectures"].empty() &&
      config["architectures"][0].is_string()) {
    declared = config["architectures"][0].get<std::string>();
    for (const auto& a : kArchitectures)
      if (declared == a.hf_class) return a.name;
  } else if (present(config, "model_type") && config["model_type"].is_string()) {
    declared = config["model_type"].get<std::string>();
    for (const auto& a : kArchitectures)
      if (declared == a.model_type) return a.name;
  } else {
    throw Error(where + ": missing field 'architectures' (and 'model_type')");
  }
  throw Error(where + ": unknown architecture '" + declared +
              "' (supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, "
              "Qwen3ForCausalLM)");
}

// transformers 5 keeps rope_theta and the scaling fields together in `rope_parameters`;
// transformers 4 has a top-level `rope_theta` and an optional `rope_scaling` object.
void parse_rope(const json& config, const std::string& where, ModelConfig& cfg) {
  const json* scaling = nullptr;
  if (present(config, "rope_parameters")) {
    const json& params = config["rope_parameters"];
    KVCC_REQUIRE(params.is_object(), where + ": rope_parameters must be an object");
    cfg.rope_theta =
        optional_number(params, "rope_theta", optional_number(config, "rope_theta", 10000.0, where), where);
    scaling = &params;
  } else {
    cfg.rope_theta = optional_number(config, "rope_theta", 10000.0, where);
    if (present(config, "rope_scaling")) {
      KVCC_REQUIRE(config["rope_scaling"].is_object(), where + ": rope_scaling must be an object or null");
      scaling = &config["rope_scaling"];
    }
  }
  KVCC_REQUIRE(cfg.rope_theta > 0,
               where + ": field 'rope_theta' must be positive, got " + std::to_string(cfg.rope_theta));
  if (!scaling) return;
  std::string type = "default";
  for (const char* key : {"rope_type", "type"})
    if (present(*scaling, key) && (*scaling)[key].is_string()) {
      type = (*scaling)[key].get<std::string>();
      break;
    }
  if (type == "default") return;
  KVCC_REQUIRE(type == "llama3", where + ": unsupported rope scaling type '" + type + "' (supported: default, llama3)");
  RopeScaling& s = cfg.rope_scaling;
  s.type = "llama3";
  const char* fields[] = {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"};
  for (const char* key : fields)
    KVCC_REQUIRE(present(*scaling, key), where + ": llama3 rope scaling lacks '" + key + "'");
  s.factor = optional_number(*scaling, "factor", 1.0, where);
  s.low_freq_factor = optional_number(*scaling, "low_freq_factor", 1.0, where);
  s.high_freq_factor = optional_number(*scaling, "high_freq_factor", 4.0, where);
  s.original_max_position = optional_int(*scaling, "original_max_position_embeddings", 8192, where);
  KVCC_REQUIRE(
      s.factor > 0 && s.low_freq_factor > 0 && s.high_freq_factor > s.low_freq_factor && s.original_max_position > 0,
      where + ": llama3 rope scaling fields out of range");
}

// Whether the tokenizer prepends BOS: tokenizer_config's add_bos_token when given, otherwise
// whether tokenizer.json's post-processor template starts with a special token.
std::optional<bool> tokenizer_json_adds_bos(const json& tokenizer) {
  if (!present(tokenizer, "post_processor")) return false;
  std::vector<const json*> processors{&tokenizer["post_processor"]};
  if (present(tokenizer["post_processor"], "processors"))
    for (const auto& p : tokenizer["post_processor"]["processors"]) processors.push_back(&p);
  for (const json* p : processors) {
    if (!p->is_object() || !present(*p, "type")) continue;
    if ((*p)["type"] == "TemplateProcessing" && present(*p, "single") && (*p)["single"].is_array() &&
        !(*p)["single"].empty())
      return (*p)["single"][0].contains("SpecialToken");
  }
  return false;
}

std::optional<int> added_token_id(const json& tokenizer, const std::string& content, const std::string& where) {
  if (!present(tokenizer, "added_tokens") || !tokenizer["added_tokens"].is_array()) return std::nullopt;
  for (const auto& t : tokenizer["added_tokens"])
    if (t.contains("content") && t["content"] == content && t.contains("id") && t["id"].is_number_integer())
      return json_int32(t["id"], where + ": the id of added token \"" + content + "\"", 0);
  return std::nullopt;
}

std::optional<std::string> token_text(const json& tokenizer_config, const char* key) {
  if (!present(tokenizer_config, key)) return std::nullopt;
  const json& v = tokenizer_config[key];
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string()) return v["content"].get<std::string>();
  return std::nullopt;
}

}  // namespace

ModelConfig parse_hf_config(const json& config, const std::string& where) {
  KVCC_REQUIRE(config.is_object(), where + ": not a JSON object");
  ModelConfig cfg;
  cfg.architecture = architecture_of(config, where);
  cfg.hidden = required_int(config, "hidden_size", where);
  cfg.n_layers = required_int(config, "num_hidden_layers", where);
  cfg.n_heads = required_int(config, "num_attention_heads", where);
  cfg.intermediate = required_int(config, "intermediate_size", where);
  cfg.vocab = required_int(config, "vocab_size", where);
  cfg.n_kv_heads = optional_int(config, "num_key_value_heads", cfg.n_heads, where);
  KVCC_REQUIRE(cfg.n_kv_heads > 0 && cfg.n_heads % cfg.n_kv_heads == 0,
               where + ": num_attention_heads " + std::to_string(cfg.n_heads) +
                   " is not a multiple of num_key_value_heads " + std::to_string(cfg.n_kv_heads));
  KVCC_REQUIRE(cfg.hidden % cfg.n_heads == 0 || present(config, "head_dim"),
               where + ": hidden_size is not a multiple of num_attention_heads and head_dim is absent");
  cfg.head_dim = optional_int(config, "head_dim", cfg.hidden / cfg.n_heads, where);
  KVCC_REQUIRE(cfg.head_dim > 0 && cfg.head_dim % 2 == 0, where + ": head_dim must be positive and even");
  cfg.max_position = optional_int(config, "max_position_embeddings", 2048, where);
  cfg.rms_eps = optional_number(config, "rms_norm_eps", 1e-6, where);
  KVCC_REQUIRE(cfg.rms_eps >= 0,
               where + ": field 'rms_norm_eps' must not be negative, got " + std::to_string(cfg.rms_eps));
  cfg.tied_embeddings = optional_bool(config, "tie_word_embeddings", false, where);
  cfg.rope_style = RopeStyle::RotateHalf;
  parse_rope(config, where, cfg);

  const std::string act = present(config, "hidden_act") && config["hidden_act"].is_string()
                              ? config["hidden_act"].get<std::string>()
                              : "silu";
  KVCC_REQUIRE(act == "silu", where + ": unsupported hidden_act '" + act + "' (only silu)");
  KVCC_REQUIRE(!optional_bool(config, "mlp_bias", false, where), where + ": mlp_bias is not supported");
  if (cfg.architecture == "qwen2") {
    cfg.qkv_bias = true;  // Qwen2 always has q/k/v biases and no o_proj bias
  } else {
    KVCC_REQUIRE(!optional_bool(config, "attention_bias", false, where),
                 where + ": attention_bias (with an o_proj bias) is not supported for " + cfg.architecture);
  }
  cfg.qk_norm = cfg.architecture == "qwen3";
  if (cfg.architecture == "qwen2" || cfg.architecture == "qwen3")
    KVCC_REQUIRE(!optional_bool(config, "use_sliding_window", false, where),
                 where +
                     ": use_sliding_window is not supported by the C++ forward, which attends over the whole "
                     "context (python -m kvcc.calibrate runs sliding-window models)");
  // Mistral's window applies whenever it is set (v0.1: 4096 of 32768); a window covering the whole
  // context changes nothing.
  if (cfg.architecture == "mistral" && present(config, "sliding_window") && !config["sliding_window"].is_null()) {
    const int window = optional_int(config, "sliding_window", 0, where);
    KVCC_REQUIRE(window >= cfg.max_position,
                 where + ": sliding_window " + std::to_string(window) + " (below max_position_embeddings " +
                     std::to_string(cfg.max_position) +
                     ") is not supported by the C++ forward, which attends over the whole context (python -m "
                     "kvcc.calibrate runs sliding-window models)");
  }
  cfg.bos_id = token_id(config, "bos_token_id", where).value_or(-1);
  cfg.eos_id = token_id(config, "eos_token_id", where).value_or(-1);
  return cfg;
}

ModelConfig read_hf_config(const std::string& dir) {
  const fs::path root(dir);
  const fs::path config_path = root / "config.json";
  auto config = read_json_if_present(config_path);
  KVCC_REQUIRE(config.has_value(), dir + ": no config.json (not a Hugging Face model directory)");
  ModelConfig cfg = parse_hf_config(*config, config_path.string());

  const auto generation = read_json_if_present(root / "generation_config.json");
  const auto tokenizer_config = read_json_if_present(root / "tokenizer_config.json");
  const auto tokenizer = read_json_if_present(root / "tokenizer.json");
  if (generation) {
    const std::string gen_where = (root / "generation_config.json").string();
    if (cfg.bos_id < 0) cfg.bos_id = token_id(*generation, "bos_token_id", gen_where).value_or(-1);
    if (cfg.eos_id < 0) cfg.eos_id = token_id(*generation, "eos_token_id", gen_where).value_or(-1);
  }
  if (tokenizer_config && tokenizer) {
    if (auto text = token_text(*tokenizer_config, "bos_token"); text && cfg.bos_id < 0)
      cfg.bos_id = added_token_id(*tokenizer, *text, (root / "tokenizer.json").string()).value_or(-1);
    if (auto text = token_text(*tokenizer_config, "eos_token"); text && cfg.eos_id < 0)
      cfg.eos_id = added_token_id(*tokenizer, *text, (root / "tokenizer.json").string()).value_or(-1);
  }

  // Qwen tokenizers add no BOS although config.json names one; Llama ones do.
  bool add_bos = cfg.architecture != "qwen2" && cfg.architecture != "qwen3";
  if (tokenizer_config && present(*tokenizer_config, "add_bos_token") &&
      (*tokenizer_config)["add_bos_token"].is_boolean())
    add_bos = (*tokenizer_config)["add_bos_token"].get<bool>();
  else if (tokenizer) add_bos = tokenizer_json_adds_bos(*tokenizer).value_or(add_bos);
  cfg.add_bos = add_bos && cfg.bos_id >= 0;
  return cfg;
}

}  // namespace kvcc
