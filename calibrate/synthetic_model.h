// A SYNTHETIC Llama-architecture model that kvcc generates deterministically, so that the whole
// pipeline (calibrate -> compile -> validate) runs with nothing from outside the repository
// (`kvcc demo`). Random weights, but with the structure that makes KV rotation matter in real
// models: a few key channels of large, nearly constant magnitude (low-frequency RoPE pairs), an
// attention sink on the first token, anisotropic queries,
// and peaked next-token distributions. It is not a language model; its numbers say nothing about
// real models and are labelled "synthetic" wherever they appear.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace kvcc {

struct SyntheticModelSpec {
  int vocab = 512;
  int hidden = 256;
  int n_layers = 4;
  int n_heads = 4;
  int n_kv_heads = 2;
  int head_dim = 64;
  int intermediate = 512;
  int max_position = 2048;
  uint64_t seed = 20261129;
};

// Writes DIR/config.json and DIR/model.safetensors (f32) — a Hugging Face Llama directory.
// Creates DIR if needed. The same spec always gives the same bytes.
void write_synthetic_model(const std::string& dir, const SyntheticModelSpec& spec = {});

// Deterministic token documents for the synthetic model: each starts with BOS (id 0), then a
// first-order Markov chain whose per-token successor sets come from `seed`.
std::vector<std::vector<int32_t>> synthetic_documents(const SyntheticModelSpec& spec, int n_docs, int length,
                                                      uint64_t seed);

// Writes documents as a pre-tokenized id file (one document per line), atomically.
void write_token_ids(const std::string& path, const std::vector<std::vector<int32_t>>& docs);

}  // namespace kvcc
