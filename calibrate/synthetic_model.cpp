#include "calibrate/synthetic_model.h"

#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "formats/atomic_file.h"
#include "formats/error.h"
#include "formats/safetensors_writer.h"

namespace kvcc {
namespace {

// Normal deviates from raw mt19937_64 output (Box-Muller), so the model's bytes do not depend on
// the standard library's distribution implementations.
class Gaussian {
 public:
  explicit Gaussian(uint64_t seed) : rng_(seed) {}
  double uniform() { return (double(rng_() >> 11) + 0.5) * (1.0 / 9007199254740992.0); }
  double next() {
    const double u1 = uniform(), u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
  std::mt19937_64& rng() { return rng_; }

 private:
  std::mt19937_64 rng_;
};

F32Tensor random_matrix(Gaussian& g, const std::string& name, int rows, int cols, double stddev) {
  F32Tensor t{name, {rows, cols}, std::vector<float>(size_t(rows) * cols)};
  for (float& v : t.data) v = float(g.next() * stddev);
  return t;
}

F32Tensor ones(const std::string& name, int n) { return F32Tensor{name, {n}, std::vector<float>(size_t(n), 1.f)}; }

}  // namespace

void write_synthetic_model(const std::string& dir, const SyntheticModelSpec& s) {
  KVCC_REQUIRE(s.head_dim % 2 == 0 && s.head_dim >= 8, "synthetic model: head_dim must be even and >= 8");
  KVCC_REQUIRE(s.hidden >= 8 && s.n_heads % s.n_kv_heads == 0, "synthetic model: bad head counts");
  std::filesystem::create_directories(dir);
  Gaussian g(s.seed);
  const int d = s.head_dim, half = d / 2, H = s.hidden;
  // Hidden dim 0 marks the first token (BOS, the attention sink); dim 1 is a constant every token
  // carries (what real models' massive activations provide); the rest is random.
  constexpr int kSinkDim = 0, kConstDim = 1;
  std::vector<F32Tensor> tensors;
  F32Tensor embed = random_matrix(g, "model.embed_tokens.weight", s.vocab, H, 1.0);
  for (int t = 0; t < s.vocab; ++t) {
    embed.data[size_t(t) * H + kSinkDim] = t == 0 ? 30.f : 0.f;
    embed.data[size_t(t) * H + kConstDim] = 4.f;
  }
  tensors.push_back(std::move(embed));
  // Rotate-half RoPE pairs channel i with i + d/2; pair index half-1 has the lowest frequency.
  const int sink_pair = half - 1;
  const int outlier_pairs[2] = {half - 2, half - 3};
  for (int l = 0; l < s.n_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    tensors.push_back(ones(p + "input_layernorm.weight", H));
    F32Tensor wq = random_matrix(g, p + "self_attn.q_proj.weight", s.n_heads * d, H, 1.0 / std::sqrt(H));
    F32Tensor wk = random_matrix(g, p + "self_attn.k_proj.weight", s.n_kv_heads * d, H, 1.0 / std::sqrt(H));
    F32Tensor wv = random_matrix(g, p + "self_attn.v_proj.weight", s.n_kv_heads * d, H, 1.0 / std::sqrt(H));
    for (int h = 0; h < s.n_heads; ++h)
      for (int c = 0; c < d; ++c) {
        const int pair = c % half;
        // Anisotropic queries: energy grows with the pair index (outlier pairs included).
        const double scale = 0.4 + 2.0 * double(pair) / half;
        float* row = wq.data.data() + size_t(h * d + c) * H;
        for (int j = 0; j < H; ++j) row[j] = float(row[j] * scale);
        row[kSinkDim] = 0.f;
        row[kConstDim] = pair == sink_pair ? 0.8f : 0.f;  // every query looks for the sink key
      }
    for (int h = 0; h < s.n_kv_heads; ++h)
      for (int c = 0; c < d; ++c) {
        const int pair = c % half;
        float* row = wk.data.data() + size_t(h * d + c) * H;
        const bool outlier = pair == outlier_pairs[0] || pair == outlier_pairs[1];
        // Outlier channels vary with the token too (x4), so clipping them away loses signal.
        if (outlier)
          for (int j = 0; j < H; ++j) row[j] *= 4.f;
        row[kSinkDim] = pair == sink_pair ? 0.8f : 0.f;  // BOS's key points where queries look
        // A few key channels with a large near-constant magnitude (low-frequency pairs).
        row[kConstDim] = outlier ? 2.5f : 0.f;
        float* vrow = wv.data.data() + size_t(h * d + c) * H;
        const double vscale = 0.5 + 1.5 * double((c * 7) % d) / d;  // anisotropic values
        for (int j = 0; j < H; ++j) vrow[j] = float(vrow[j] * vscale);
      }
    tensors.push_back(std::move(wq));
    tensors.push_back(std::move(wk));
    tensors.push_back(std::move(wv));
    tensors.push_back(
        random_matrix(g, p + "self_attn.o_proj.weight", H, s.n_heads * d, 0.5 / std::sqrt(s.n_heads * d)));
    tensors.push_back(ones(p + "post_attention_layernorm.weight", H));
    tensors.push_back(random_matrix(g, p + "mlp.gate_proj.weight", s.intermediate, H, 1.0 / std::sqrt(H)));
    tensors.push_back(random_matrix(g, p + "mlp.up_proj.weight", s.intermediate, H, 1.0 / std::sqrt(H)));
    tensors.push_back(random_matrix(g, p + "mlp.down_proj.weight", H, s.intermediate, 0.5 / std::sqrt(s.intermediate)));
  }
  tensors.push_back(ones("model.norm.weight", H));
  // Logits of standard deviation ~1.5: distributions peaked enough for a perturbed cache to show.
  tensors.push_back(random_matrix(g, "lm_head.weight", s.vocab, H, 1.5 / std::sqrt(H)));
  write_safetensors_f32((std::filesystem::path(dir) / "model.safetensors").string(), tensors);

  nlohmann::ordered_json config = {
      {"architectures", {"LlamaForCausalLM"}},
      {"model_type", "llama"},
      {"_kvcc_note",
       "SYNTHETIC model generated by kvcc (random weights with real-model KV structure); not a language model"},
      {"hidden_size", H},
      {"intermediate_size", s.intermediate},
      {"num_hidden_layers", s.n_layers},
      {"num_attention_heads", s.n_heads},
      {"num_key_value_heads", s.n_kv_heads},
      {"head_dim", d},
      {"vocab_size", s.vocab},
      {"max_position_embeddings", s.max_position},
      {"rope_theta", 10000.0},
      {"rms_norm_eps", 1e-5},
      {"hidden_act", "silu"},
      {"tie_word_embeddings", false},
      {"attention_bias", false},
      {"bos_token_id", 0},
      {"eos_token_id", 1},
      {"torch_dtype", "float32"}};
  write_bytes_atomically((std::filesystem::path(dir) / "config.json").string(), config.dump(2) + "\n");
}

std::vector<std::vector<int32_t>> synthetic_documents(const SyntheticModelSpec& s, int n_docs, int length,
                                                      uint64_t seed) {
  KVCC_REQUIRE(n_docs > 0 && length >= 2, "synthetic documents: need at least one document of 2 tokens");
  // Successor sets are fixed by the model's seed (the "language"); `seed` picks the walks.
  constexpr int kSuccessors = 6;
  Gaussian table_rng(s.seed ^ 0x5eed5eedULL);
  std::vector<int32_t> successors(size_t(s.vocab) * kSuccessors);
  for (auto& t : successors) t = int32_t(2 + table_rng.rng()() % uint64_t(s.vocab - 2));
  Gaussian walk(seed);
  std::vector<std::vector<int32_t>> docs(static_cast<size_t>(n_docs));
  for (auto& doc : docs) {
    doc.push_back(0);  // BOS
    int32_t cur = int32_t(2 + walk.rng()() % uint64_t(s.vocab - 2));
    while (int(doc.size()) < length) {
      doc.push_back(cur);
      const uint64_t r = walk.rng()() % 16;  // mostly a successor, sometimes a jump
      cur = r < 14 ? successors[size_t(cur) * kSuccessors + r % kSuccessors]
                   : int32_t(2 + walk.rng()() % uint64_t(s.vocab - 2));
    }
  }
  return docs;
}

void write_token_ids(const std::string& path, const std::vector<std::vector<int32_t>>& docs) {
  std::ostringstream out;
  for (const auto& doc : docs) {
    for (size_t i = 0; i < doc.size(); ++i) out << (i ? " " : "") << doc[i];
    out << "\n";
  }
  write_bytes_atomically(path, out.str());
}

}  // namespace kvcc
