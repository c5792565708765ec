// Model readers: Hugging Face configs in both transformers styles, safetensors (single, sharded,
// f32/f16/bf16), llama2.c checkpoints, fingerprints, and the errors a user gets for bad input.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <new>
#include <random>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include "formats/error.h"
#include "formats/hf_config.h"
#include "formats/model_file.h"
#include "forward_test_util.h"

namespace fs = std::filesystem;
using namespace kvcc;
using namespace kvcc::testing;
using nlohmann::json;

namespace {

struct TempDir {
  fs::path path;
  TempDir() {
    path = fs::temp_directory_path() /
           ("kvcc_test_model_" + std::to_string(::getpid()) + "_" + std::to_string(counter()++));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
  static int& counter() {
    static int n = 0;
    return n;
  }
};

std::string read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}
void write_bytes(const fs::path& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), std::streamsize(bytes.size()));
}

// A safetensors file split into its JSON header and data bytes, for editing.
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
    std::string bytes(reinterpret_cast<const char*>(&n), 8);
    write_bytes(p, bytes + h + data);
  }
};

// Copies a tiny test model into a temp dir so a test can break it.
fs::path copy_model(const TempDir& tmp, const std::string& name) {
  const fs::path dst = tmp.path / name;
  fs::copy(data_models_dir() + "/" + name, dst, fs::copy_options::recursive);
  return dst;
}

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "<no kvcc::Error thrown>";
}

}  // namespace

TEST(ModelFile, TinyStories656kConfigTransformers4Style) {
  const std::string dir = shared_models_dir() + "/tinystories-656k";
  if (!fs::exists(dir)) GTEST_SKIP() << dir << " absent (../shared not mounted)";
  const ModelFile m = ModelFile::open(dir);
  const ModelConfig& c = m.config();  // values from ../shared/README.md and its config.json
  EXPECT_EQ(c.architecture, "llama");
  EXPECT_EQ(c.hidden, 128);
  EXPECT_EQ(c.n_layers, 2);
  EXPECT_EQ(c.n_heads, 8);
  EXPECT_EQ(c.n_kv_heads, 4);
  EXPECT_EQ(c.head_dim, 16);
  EXPECT_EQ(c.intermediate, 384);
  EXPECT_EQ(c.vocab, 2048);
  EXPECT_EQ(c.max_position, 512);
  EXPECT_DOUBLE_EQ(c.rope_theta, 10000.0);
  EXPECT_DOUBLE_EQ(c.rms_eps, 1e-6);
  EXPECT_EQ(c.rope_scaling.type, "default");
  EXPECT_EQ(c.rope_style, RopeStyle::RotateHalf);
  EXPECT_TRUE(c.tied_embeddings);
  EXPECT_FALSE(m.has_tensor("lm_head.weight"));
  EXPECT_EQ(c.bos_id, 1);
  EXPECT_EQ(c.eos_id, 2);
  EXPECT_TRUE(c.add_bos);
  EXPECT_EQ(m.tensor_dtype("model.embed_tokens.weight"), "F32");
}

TEST(ModelFile, Gutenberg27mShardedBf16Transformers5Style) {
  const std::string dir = shared_models_dir() + "/gutenberg-27m";
  if (!fs::exists(dir)) GTEST_SKIP() << dir << " absent (../shared not mounted)";
  const ModelFile m = ModelFile::open(dir);
  const ModelConfig& c = m.config();
  EXPECT_EQ(c.hidden, 512);
  EXPECT_EQ(c.n_layers, 8);
  EXPECT_EQ(c.n_heads, 4);
  EXPECT_EQ(c.n_kv_heads, 2);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.intermediate, 1536);
  EXPECT_EQ(c.vocab, 4096);
  EXPECT_DOUBLE_EQ(c.rope_theta, 500000.0);  // from rope_parameters
  EXPECT_DOUBLE_EQ(c.rms_eps, 1e-5);
  EXPECT_TRUE(c.tied_embeddings);
  EXPECT_EQ(c.bos_id, 0);
  EXPECT_EQ(c.eos_id, 1);
  EXPECT_TRUE(c.add_bos);
  EXPECT_EQ(m.tensor_dtype("model.layers.7.mlp.down_proj.weight"), "BF16");
  // 27.3M parameters, per its README.
  int64_t params = 0;
  for (const auto& name : m.tensor_names()) {
    int64_t n = 1;
    for (int64_t s : m.tensor_shape(name)) n *= s;
    params += n;
  }
  EXPECT_NEAR(double(params), 27.3e6, 0.05e6);
}

TEST(ModelFile, Stories260kLlama2cHeader) {
  const std::string bin = shared_models_dir() + "/stories260k/stories260K.bin";
  if (!fs::exists(bin)) GTEST_SKIP() << bin << " absent (../shared not mounted)";
  const ModelFile m = ModelFile::open(bin);
  const ModelConfig& c = m.config();
  EXPECT_EQ(c.architecture, "llama2c");
  EXPECT_EQ(c.hidden, 64);
  EXPECT_EQ(c.n_layers, 5);
  EXPECT_EQ(c.n_heads, 8);
  EXPECT_EQ(c.n_kv_heads, 4);
  EXPECT_EQ(c.head_dim, 8);
  EXPECT_EQ(c.intermediate, 172);
  EXPECT_EQ(c.vocab, 512);
  EXPECT_EQ(c.max_position, 512);
  EXPECT_EQ(c.rope_style, RopeStyle::Interleaved);
  EXPECT_TRUE(c.tied_embeddings);
  EXPECT_EQ(c.bos_id, 1);
  EXPECT_EQ(c.eos_id, 2);
  EXPECT_EQ(m.tensor_shape("model.layers.4.self_attn.k_proj.weight"), (std::vector<int64_t>{32, 64}));
  EXPECT_EQ(m.tensor_shape("model.layers.0.mlp.down_proj.weight"), (std::vector<int64_t>{64, 172}));
  // The final norm sits right before the two RoPE tables (512 x 4 floats each) at the file's end.
  const std::string bytes = read_bytes(bin);
  std::vector<float> tail(64);
  std::memcpy(tail.data(), bytes.data() + bytes.size() - (2 * 512 * 4 + 64) * 4, 64 * 4);
  EXPECT_EQ(m.tensor_f32("model.norm.weight"), tail);
}

TEST(ModelFile, ConfigStylesAndDefaults) {
  // A transformers-4 style llama3 config and its transformers-5 spelling parse the same.
  const json v4 = json::parse(R"({"architectures":["LlamaForCausalLM"],"hidden_size":64,
    "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"intermediate_size":96,
    "vocab_size":100,"rope_theta":500000.0,"torch_dtype":"bfloat16","rope_scaling":{"rope_type":"llama3",
    "factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":8192},
    "eos_token_id":[7,8]})");
  const json v5 = json::parse(R"({"architectures":["LlamaForCausalLM"],"hidden_size":64,
    "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"intermediate_size":96,
    "vocab_size":100,"dtype":"bfloat16","rope_parameters":{"rope_type":"llama3","rope_theta":500000.0,
    "factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":8192},
    "eos_token_id":7})");
  const ModelConfig a = parse_hf_config(v4, "v4"), b = parse_hf_config(v5, "v5");
  EXPECT_EQ(fingerprint_fields(a), fingerprint_fields(b));
  EXPECT_EQ(a.rope_scaling.type, "llama3");
  EXPECT_DOUBLE_EQ(a.rope_theta, 500000.0);
  EXPECT_EQ(a.head_dim, 16);  // hidden / heads when head_dim is absent
  EXPECT_EQ(a.eos_id, 7);     // the first of a list
  json qwen2 = v5;
  qwen2["architectures"] = {"Qwen2ForCausalLM"};
  EXPECT_TRUE(parse_hf_config(qwen2, "q2").qkv_bias);
  json qwen3 = v5;
  qwen3["architectures"] = {"Qwen3ForCausalLM"};
  qwen3["head_dim"] = 128;
  EXPECT_TRUE(parse_hf_config(qwen3, "q3").qk_norm);
  EXPECT_EQ(parse_hf_config(qwen3, "q3").head_dim, 128);
  json mistral = v4;
  mistral.erase("architectures");
  mistral["model_type"] = "mistral";
  EXPECT_EQ(parse_hf_config(mistral, "m").architecture, "mistral");

  json yarn = v5;
  yarn["rope_parameters"]["rope_type"] = "yarn";
  EXPECT_NE(error_of([&] { parse_hf_config(yarn, "y"); }).find("'yarn'"), std::string::npos);
  json gelu = v5;
  gelu["hidden_act"] = "gelu";
  EXPECT_NE(error_of([&] { parse_hf_config(gelu, "g"); }).find("hidden_act"), std::string::npos);
}

TEST(ModelFile, QwenTokenizerlessDirectoryAddsNoBos) {
  const ModelFile m = ModelFile::open(data_models_dir() + "/qwen3-hd64");
  EXPECT_EQ(m.config().architecture, "qwen3");
  EXPECT_FALSE(m.config().add_bos);
  EXPECT_TRUE(m.config().qk_norm);
  EXPECT_TRUE(m.config().tied_embeddings);
}

TEST(ModelFile, FingerprintFollowsTensorHeadersNotPaths) {
  TempDir tmp;
  const fs::path copy = copy_model(tmp, "qwen2-bias");
  const ModelFile original = ModelFile::open(data_models_dir() + "/qwen2-bias");
  const ModelFile copied = ModelFile::open(copy.string());
  EXPECT_TRUE(original.fingerprint().matches(copied.fingerprint()));
  EXPECT_EQ(original.fingerprint().weights_sha256.size(), 64u);
  const ModelFile other = ModelFile::open(data_models_dir() + "/qwen3-hd64");
  EXPECT_FALSE(original.fingerprint().matches(other.fingerprint()));

  // The same weights stored as bf16 are a different file layout, hence a different fingerprint.
  Safetensors st = Safetensors::read(copy / "model.safetensors");
  json header = st.header;
  std::string data;
  for (auto& [name, entry] : header.items()) {
    if (name == "__metadata__") continue;
    const auto off = entry["data_offsets"].get<std::vector<uint64_t>>();
    const size_t n = (off[1] - off[0]) / 4;
    const size_t begin = data.size();
    for (size_t i = 0; i < n; ++i) {
      uint32_t bits;
      std::memcpy(&bits, st.data.data() + off[0] + 4 * i, 4);
      const uint16_t bf = uint16_t(bits >> 16);  // truncation: any bf16 value will do here
      data.append(reinterpret_cast<const char*>(&bf), 2);
    }
    entry["dtype"] = "BF16";
    entry["data_offsets"] = {begin, data.size()};
  }
  st.header = header;
  st.data = data;
  st.write(copy / "model.safetensors");
  const ModelFile bf16 = ModelFile::open(copy.string());
  EXPECT_FALSE(bf16.fingerprint().matches(original.fingerprint()));
  EXPECT_NE(bf16.fingerprint().describe_difference(original.fingerprint()), "");
}

// F16 and BF16 payloads decode to the values their bit patterns denote (patterns written by hand).
TEST(ModelFile, HalfPrecisionTensorsConvertExactly) {
  TempDir tmp;
  const fs::path dir = copy_model(tmp, "qwen2-bias");
  Safetensors st = Safetensors::read(dir / "model.safetensors");
  const std::vector<float> expected = {1.5f, -2.25f, 0.0078125f, 0.0f, 65504.0f, -0.5f};
  const uint16_t f16_bits[] = {0x3E00, 0xC080, 0x2000, 0x0000, 0x7BFF, 0xB800};
  const uint16_t bf16_bits[] = {0x3FC0, 0xC010, 0x3C00, 0x0000, 0x477F, 0xBF00};
  const size_t begin = st.data.size();
  st.data.append(reinterpret_cast<const char*>(f16_bits), sizeof f16_bits);
  st.data.append(reinterpret_cast<const char*>(bf16_bits), sizeof bf16_bits);
  st.header["extra.f16"] = {{"dtype", "F16"}, {"shape", {2, 3}}, {"data_offsets", {begin, begin + 12}}};
  st.header["extra.bf16"] = {{"dtype", "BF16"}, {"shape", {6}}, {"data_offsets", {begin + 12, begin + 24}}};
  st.write(dir / "model.safetensors");
  const ModelFile m = ModelFile::open(dir.string());
  EXPECT_EQ(m.tensor_f32("extra.f16"), expected);
  std::vector<float> expected_bf16 = expected;
  expected_bf16[4] = 65280.0f;  // 0x477F: bf16 has 8 mantissa bits, so no 65504
  EXPECT_EQ(m.tensor_f32("extra.bf16"), expected_bf16);
  std::vector<float> row(3);
  m.tensor_rows_f32("extra.f16", 1, 1, row.data());
  EXPECT_EQ(row, (std::vector<float>{0.0f, 65504.0f, -0.5f}));
}

TEST(ModelFileErrors, MissingPath) {
  const std::string msg = error_of([] { ModelFile::open("/nonexistent/kvcc-model"); });
  EXPECT_NE(msg.find("/nonexistent/kvcc-model"), std::string::npos) << msg;
  EXPECT_NE(msg.find("does not exist"), std::string::npos) << msg;
}

TEST(ModelFileErrors, DirectoryWithoutConfig) {
  TempDir tmp;
  const std::string msg = error_of([&] { ModelFile::open(tmp.path.string()); });
  EXPECT_NE(msg.find("no config.json"), std::string::npos) << msg;
}

TEST(ModelFileErrors, ConfigMissingField) {
  TempDir tmp;
  const fs::path dir = copy_model(tmp, "qwen2-bias");
  json cfg = read_json_file((dir / "config.json").string());
  cfg.erase("hidden_size");
  write_bytes(dir / "config.json", cfg.dump());
  const std::string msg = error_of([&] { ModelFile::open(dir.string()); });
  EXPECT_NE(msg.find("missing field 'hidden_size'"), std::string::npos) << msg;
}

TEST(ModelFileErrors, UnknownArchitecture) {
  TempDir tmp;
  const fs::path dir = copy_model(tmp, "qwen2-bias");
  json cfg = read_json_file((dir / "config.json").string());
  cfg["architectures"] = {"GPTNeoXForCausalLM"};
  write_bytes(dir / "config.json", cfg.dump());
  const std::string msg = error_of([&] { ModelFile::open(dir.string()); });
  EXPECT_NE(msg.find("unknown architecture 'GPTNeoXForCausalLM'"), std::string::npos) << msg;
}

TEST(ModelFileErrors, MissingTensor) {
  TempDir tmp;
  const fs::path dir = copy_model(tmp, "qwen2-bias");
  Safetensors st = Safetensors::read(dir / "model.safetensors");
  st.header.erase("model.layers.1.self_attn.k_proj.bias");
  st.write(dir / "model.safetensors");
  const std::string msg = error_of([&] { ModelFile::open(dir.string()); });
  EXPECT_NE(msg.find("missing tensor model.layers.1.self_attn.k_proj.bias"), std::string::npos) << msg;
}

// A fuzzed config.json claiming 12555558 layers made ModelFile list ~150M expected tensors
// (gigabytes, out of memory under the fuzzer's 2.5 GB) before finding the first one missing.
TEST(ModelFileErrors, LayerCountBeyondTheCheckpointNamesTheFirstMissingTensor) {
  TempDir tmp;
  const fs::path dir = copy_model(tmp, "qwen2-bias");
  json cfg = read_json_file((dir / "config.json").string());
  cfg["num_hidden_layers"] = 12555558;
  write_bytes(dir / "config.json", cfg.dump());
  // In a child whose address space may grow by 1 GiB (listing the tensors needed > 8 GB): the
  // error, or "out of memory".
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::close(fds[0]);
    std::ifstream statm("/proc/self/statm");
    size_t pages = 0;
    statm >> pages;
    const rlim_t limit = rlim_t(pages) * size_t(::sysconf(_SC_PAGESIZE)) + (rlim_t(1) << 30);
    rlimit rl{limit, limit};
    ::setrlimit(RLIMIT_AS, &rl);
    std::string msg;
    try {
      msg = error_of([&] { ModelFile::open(dir.string()); });
    } catch (const std::bad_alloc&) {
      msg = "out of memory";
    }
    if (::write(fds[1], msg.data(), msg.size()) < 0) ::_exit(2);
    ::_exit(0);
  }
  ::close(fds[1]);
  std::string msg;
  char buf[4096];
  for (ssize_t got; (got = ::read(fds[0], buf, sizeof buf)) > 0;) msg.append(buf, size_t(got));
  ::close(fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  EXPECT_NE(msg.find("missing tensor model.layers.2.input_layernorm.weight"), std::string::npos) << msg;
}

TEST(ModelFileErrors, TensorShapeDisagreesWithConfig) {
  TempDir tmp;
  const fs::path dir = copy_model(tmp, "qwen2-bias");
  json cfg = read_json_file((dir / "config.json").string());
  cfg["intermediate_size"] = 65;
  write_bytes(dir / "config.json", cfg.dump());
  const std::string msg = error_of([&] { ModelFile::open(dir.string()); });
  EXPECT_NE(msg.find("mlp.gate_proj.weight has shape [64, 32] but the config implies [65, 32]"), std::string::npos)
      << msg;
}

TEST(ModelFileErrors, HeaderSizeDisagreesWithShape) {
  TempDir tmp;
  const fs::path dir = copy_model(tmp, "qwen2-bias");
  Safetensors st = Safetensors::read(dir / "model.safetensors");
  st.header["model.norm.weight"]["shape"] = {33};  // data_offsets still span 32 floats
  st.write(dir / "model.safetensors");
  const std::string msg = error_of([&] { ModelFile::open(dir.string()); });
  EXPECT_NE(msg.find("'model.norm.weight': data_offsets span 128 bytes but F32 x shape needs 132"), std::string::npos)
      << msg;
}

TEST(ModelFileErrors, HeaderOffsetsBeyondFile) {
  TempDir tmp;
  const fs::path dir = copy_model(tmp, "qwen2-bias");
  Safetensors st = Safetensors::read(dir / "model.safetensors");
  const uint64_t end = st.data.size();
  st.header["model.norm.weight"]["data_offsets"] = {end, end + 128};
  st.write(dir / "model.safetensors");
  const std::string msg = error_of([&] { ModelFile::open(dir.string()); });
  EXPECT_NE(msg.find("lies beyond the end of the file"), std::string::npos) << msg;
}

TEST(ModelFileErrors, HeaderLengthBeyondFile) {
  TempDir tmp;
  const fs::path dir = copy_model(tmp, "qwen2-bias");
  std::string bytes = read_bytes(dir / "model.safetensors");
  const uint64_t huge = uint64_t(bytes.size()) * 2;
  std::memcpy(bytes.data(), &huge, 8);
  write_bytes(dir / "model.safetensors", bytes);
  const std::string msg = error_of([&] { ModelFile::open(dir.string()); });
  EXPECT_NE(msg.find("header length"), std::string::npos) << msg;
}

TEST(ModelFileErrors, TruncatedWeights) {
  TempDir tmp;
  const fs::path dir = copy_model(tmp, "qwen2-bias");
  const std::string bytes = read_bytes(dir / "model.safetensors");
  write_bytes(dir / "model.safetensors", bytes.substr(0, bytes.size() - 1000));
  const std::string msg = error_of([&] { ModelFile::open(dir.string()); });
  EXPECT_NE(msg.find("truncated"), std::string::npos) << msg;
}

TEST(ModelFileErrors, ShardListedInIndexIsMissing) {
  TempDir tmp;
  const fs::path dir = copy_model(tmp, "llama31-hd128");
  fs::remove(dir / "model-00003-of-00006.safetensors");
  const std::string msg = error_of([&] { ModelFile::open(dir.string()); });
  EXPECT_NE(msg.find("model-00003-of-00006.safetensors, which does not exist"), std::string::npos) << msg;
}

TEST(ModelFileErrors, TruncatedLlama2c) {
  const std::string bin = shared_models_dir() + "/stories260k/stories260K.bin";
  if (!fs::exists(bin)) GTEST_SKIP() << bin << " absent (../shared not mounted)";
  TempDir tmp;
  const std::string bytes = read_bytes(bin);
  write_bytes(tmp.path / "cut.bin", bytes.substr(0, bytes.size() / 2));
  std::string msg = error_of([&] { ModelFile::open((tmp.path / "cut.bin").string()); });
  EXPECT_NE(msg.find("truncated llama2.c checkpoint"), std::string::npos) << msg;
  write_bytes(tmp.path / "tiny.bin", bytes.substr(0, 10));
  msg = error_of([&] { ModelFile::open((tmp.path / "tiny.bin").string()); });
  EXPECT_NE(msg.find("truncated"), std::string::npos) << msg;
}

TEST(ModelFileErrors, GarbageIsNotALlama2cCheckpoint) {
  TempDir tmp;
  std::string junk(4096, '\xff');
  write_bytes(tmp.path / "junk.bin", junk);
  const std::string msg = error_of([&] { ModelFile::open((tmp.path / "junk.bin").string()); });
  EXPECT_NE(msg.find("not a llama2.c checkpoint"), std::string::npos) << msg;
}

// A llama2.c checkpoint with a negative vocab_size carries its own classifier after the RoPE
// tables; with the embedding copied there it must give the tied model's logits.
TEST(ModelFile, Llama2cUntiedClassifier) {
  const std::string bin = shared_models_dir() + "/stories260k/stories260K.bin";
  if (!fs::exists(bin)) GTEST_SKIP() << bin << " absent (../shared not mounted)";
  TempDir tmp;
  std::string bytes = read_bytes(bin);
  int32_t vocab;
  std::memcpy(&vocab, bytes.data() + 5 * 4, 4);
  ASSERT_EQ(vocab, 512);
  const std::string embedding = bytes.substr(7 * 4, size_t(512) * 64 * 4);
  const int32_t untied = -vocab;
  std::memcpy(bytes.data() + 5 * 4, &untied, 4);
  write_bytes(tmp.path / "untied.bin", bytes + embedding);
  const ModelFile tied = ModelFile::open(bin);
  const ModelFile copy = ModelFile::open((tmp.path / "untied.bin").string());
  EXPECT_FALSE(copy.config().tied_embeddings);
  EXPECT_EQ(copy.tensor_shape("lm_head.weight"), (std::vector<int64_t>{512, 64}));
  const std::vector<int32_t> ids = {1, 403, 407, 261, 378};
  EXPECT_EQ(model_logits(tied, ids), model_logits(copy, ids));
  // Without the classifier bytes the file is truncated.
  write_bytes(tmp.path / "short.bin", bytes);
  const std::string msg = error_of([&] { ModelFile::open((tmp.path / "short.bin").string()); });
  EXPECT_NE(msg.find("lm_head.weight"), std::string::npos) << msg;
}
