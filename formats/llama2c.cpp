#include "formats/llama2c.h"

#include <cstring>

#include "formats/error.h"

namespace kvcc {

std::map<std::string, TensorView> read_llama2c(const std::string& path, ModelConfig& config) {
  auto file = MappedFile::open(path);
  constexpr size_t kHeaderBytes = 7 * sizeof(int32_t);
  KVCC_REQUIRE(file->size() >= kHeaderBytes, path + ": truncated llama2.c checkpoint (" + std::to_string(file->size()) +
                                                 " bytes, shorter than its 28-byte header)");
  int32_t h[7];
  std::memcpy(h, file->data(), sizeof h);
  // Newer llama2.c exports start with the magic "ak42" and a version; only the legacy one is read.
  KVCC_REQUIRE(uint32_t(h[0]) != 0x616b3432u,
               path + ": llama2.c versioned export (magic ak42) is not supported; export with --version 0");
  const int64_t dim = h[0], hidden_dim = h[1], n_layers = h[2], n_heads = h[3], n_kv_heads = h[4], seq_len = h[6];
  const bool shared_classifier = h[5] > 0;
  const int64_t vocab = h[5] > 0 ? h[5] : -int64_t(h[5]);
  KVCC_REQUIRE(
      dim > 0 && hidden_dim > 0 && n_layers > 0 && n_heads > 0 && n_kv_heads > 0 && vocab > 0 && seq_len > 0 &&
          dim <= (1 << 20) && hidden_dim <= (1 << 22) && n_layers <= 4096 && vocab <= (1 << 24) && seq_len <= (1 << 24),
      path + ": not a llama2.c checkpoint (implausible header " + std::to_string(dim) + ", " +
          std::to_string(hidden_dim) + ", " + std::to_string(n_layers) + ", " + std::to_string(n_heads) + ", " +
          std::to_string(n_kv_heads) + ", " + std::to_string(h[5]) + ", " + std::to_string(seq_len) + ")");
  KVCC_REQUIRE(dim % n_heads == 0 && n_heads % n_kv_heads == 0 && (dim / n_heads) % 2 == 0,
               path + ": llama2.c header has inconsistent head counts");
  const int64_t head_dim = dim / n_heads, kv_dim = n_kv_heads * head_dim;

  config = ModelConfig{};
  config.architecture = "llama2c";
  config.n_layers = int(n_layers);
  config.hidden = int(dim);
  config.n_heads = int(n_heads);
  config.n_kv_heads = int(n_kv_heads);
  config.head_dim = int(head_dim);
  config.intermediate = int(hidden_dim);
  config.vocab = int(vocab);
  config.max_position = int(seq_len);
  config.rope_theta = 10000.0;
  config.rope_style = RopeStyle::Interleaved;
  config.rms_eps = 1e-5;  // llama2.c's rmsnorm
  config.tied_embeddings = shared_classifier;
  config.bos_id = 1;
  config.eos_id = 2;
  config.add_bos = true;

  std::map<std::string, TensorView> tensors;
  size_t offset = kHeaderBytes;
  // One entry per stacked llama2.c array, in file order; `per_layer` arrays are split by layer.
  auto take = [&](const std::string& name, std::vector<int64_t> shape, bool per_layer) {
    int64_t numel = 1;
    for (int64_t s : shape) numel *= s;
    const size_t bytes = size_t(numel) * 4;
    const int64_t count = per_layer ? n_layers : 1;
    KVCC_REQUIRE(offset + bytes * size_t(count) <= file->size(),
                 path + ": truncated llama2.c checkpoint (" + std::to_string(file->size()) +
                     " bytes; the header implies at least " + std::to_string(offset + bytes * size_t(count)) +
                     " to hold " + name + ")");
    for (int64_t l = 0; l < count; ++l) {
      TensorView view;
      view.name = per_layer ? "model.layers." + std::to_string(l) + "." + name : name;
      view.dtype = TensorDType::F32;
      view.shape = shape;
      view.data = file->data() + offset;
      view.nbytes = bytes;
      view.file = file;
      offset += bytes;
      if (!name.empty()) tensors.emplace(view.name, std::move(view));
    }
  };
  take("model.embed_tokens.weight", {vocab, dim}, false);
  take("input_layernorm.weight", {dim}, true);
  take("self_attn.q_proj.weight", {dim, dim}, true);
  take("self_attn.k_proj.weight", {kv_dim, dim}, true);
  take("self_attn.v_proj.weight", {kv_dim, dim}, true);
  take("self_attn.o_proj.weight", {dim, dim}, true);
  take("post_attention_layernorm.weight", {dim}, true);
  take("mlp.gate_proj.weight", {hidden_dim, dim}, true);  // w1
  take("mlp.down_proj.weight", {dim, hidden_dim}, true);  // w2
  take("mlp.up_proj.weight", {hidden_dim, dim}, true);    // w3
  take("model.norm.weight", {dim}, false);
  // The precomputed RoPE tables (freq_cis_real, freq_cis_imag) are skipped: the forward pass
  // computes them.
  take("", {seq_len, head_dim / 2}, false);
  take("", {seq_len, head_dim / 2}, false);
  if (!shared_classifier) take("lm_head.weight", {vocab, dim}, false);
  return tensors;
}

}  // namespace kvcc
