// llama2.c checkpoints (.bin, the legacy export: a header of 7 int32 — dim, hidden_dim,
// n_layers, n_heads, n_kv_heads, vocab_size (negative: untied classifier), seq_len — then float32
// weights in llama2.c's order), exposed under the Hugging Face Llama tensor names.
#pragma once
#include <map>
#include <string>

#include "formats/model_config.h"
#include "formats/safetensors.h"

namespace kvcc {

// Maps the checkpoint and returns its tensors; fills `config` (architecture "llama2c",
// interleaved RoPE, theta 10000, rms eps 1e-5, bos 1, eos 2). The weights keep llama2.c's
// interleaved q/k row order, which is why the forward pass uses interleaved RoPE for them.
std::map<std::string, TensorView> read_llama2c(const std::string& path, ModelConfig& config);

}  // namespace kvcc
