// Hugging Face config.json -> ModelConfig, in both transformers-4 style (`rope_theta`,
// `rope_scaling`, `torch_dtype`) and transformers-5 style (`rope_parameters`, `dtype`).
#pragma once
#include <string>

#include <nlohmann/json_fwd.hpp>

#include "formats/model_config.h"

namespace kvcc {

// Parses the architecture fields of a config.json object. `where` names the file in errors.
// Refuses unknown architectures and features the forward pass does not implement (o_proj/MLP
// biases, non-SiLU activations, rope types other than default/llama3, Qwen sliding windows).
ModelConfig parse_hf_config(const nlohmann::json& config, const std::string& where);

// Reads DIR/config.json and fills bos_id / eos_id / add_bos from config.json,
// generation_config.json, tokenizer_config.json and tokenizer.json's post-processor.
ModelConfig read_hf_config(const std::string& dir);

}  // namespace kvcc
