// Model fingerprints: the id is sha256 of the documented canonical text (written out by hand
// here), a change in any architecture field or in the weights changes it, tokenizer-only fields do
// not, and describe_difference names what differs.
#include <gtest/gtest.h>

#include <functional>

#include "formats/error.h"
#include "formats/model_config.h"
#include "formats/sha256.h"
#include "formats_test_util.h"

namespace kvcc {
namespace {

TEST(ModelConfig, RopeStyleNames) {
  EXPECT_STREQ(rope_style_name(RopeStyle::RotateHalf), "rotate_half");
  EXPECT_STREQ(rope_style_name(RopeStyle::Interleaved), "interleaved");
  EXPECT_EQ(rope_style_from_name("interleaved"), RopeStyle::Interleaved);
  EXPECT_EQ(rope_style_from_name("rotate_half"), RopeStyle::RotateHalf);
  try {
    rope_style_from_name("neox");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("unknown RoPE style \"neox\""), std::string::npos);
  }
}

TEST(ModelConfig, FingerprintIdIsShaOfCanonicalText) {
  ModelConfig c = testing::small_config(3, 4, 2, 8);
  const std::string canonical =
      "architecture=llama\nn_layers=3\nhidden=32\nn_heads=4\nn_kv_heads=2\nhead_dim=8\nintermediate=128\n"
      "vocab=256\nrope_theta=500000\nrope_scaling.type=llama3\nrope_scaling.factor=8\n"
      "rope_scaling.low_freq_factor=1\nrope_scaling.high_freq_factor=4\n"
      "rope_scaling.original_max_position=8192\nrope_style=rotate_half\nrms_eps=1e-05\n"
      "tied_embeddings=true\nqkv_bias=false\nqk_norm=false\nweights_sha256=beef\n";
  ModelFingerprint fp = make_fingerprint(c, "beef");
  EXPECT_EQ(fp.id, sha256_hex(canonical));
  EXPECT_EQ(fp.weights_sha256, "beef");
  EXPECT_EQ(fp.fields, fingerprint_fields(c));
  EXPECT_EQ(fp.fields.front(), (std::pair<std::string, std::string>{"architecture", "llama"}));
  EXPECT_EQ(fingerprint_id(fp.fields, fp.weights_sha256), fp.id);
}

TEST(ModelConfig, FingerprintSeparatesModels) {
  const ModelConfig base = testing::small_config();
  const ModelFingerprint fp = make_fingerprint(base, "w1");
  EXPECT_TRUE(fp.matches(make_fingerprint(base, "w1")));
  EXPECT_EQ(fp.describe_difference(make_fingerprint(base, "w1")), "");

  // Tokenizer-side fields and the serving limit do not change the identity.
  ModelConfig tok = base;
  tok.bos_id = 5;
  tok.eos_id = 6;
  tok.add_bos = false;
  tok.max_position = 100000;
  EXPECT_TRUE(fp.matches(make_fingerprint(tok, "w1")));

  ModelConfig deeper = base;
  deeper.n_layers = 36;
  EXPECT_FALSE(fp.matches(make_fingerprint(deeper, "w1")));
  EXPECT_EQ(fp.describe_difference(make_fingerprint(deeper, "w1")), "n_layers: 3 vs 36");

  EXPECT_EQ(fp.describe_difference(make_fingerprint(base, "w2")), "weights: differ");

  ModelConfig several = base;
  several.rope_style = RopeStyle::Interleaved;
  several.qk_norm = true;
  several.rope_theta = 10000.0;
  EXPECT_EQ(fp.describe_difference(make_fingerprint(several, "w2")),
            "rope_theta: 500000 vs 10000; rope_style: rotate_half vs interleaved; qk_norm: false vs true; "
            "weights: differ");

  // Every architecture field participates.
  const std::vector<std::function<void(ModelConfig&)>> edits = {
      [](ModelConfig& m) { m.architecture = "qwen3"; },
      [](ModelConfig& m) { m.hidden += 1; },
      [](ModelConfig& m) { m.n_heads = 8; },
      [](ModelConfig& m) { m.n_kv_heads = 4; },
      [](ModelConfig& m) { m.head_dim = 16; },
      [](ModelConfig& m) { m.intermediate += 1; },
      [](ModelConfig& m) { m.vocab += 1; },
      [](ModelConfig& m) { m.rope_scaling.type = "default"; },
      [](ModelConfig& m) { m.rope_scaling.factor = 2; },
      [](ModelConfig& m) { m.rope_scaling.low_freq_factor = 2; },
      [](ModelConfig& m) { m.rope_scaling.high_freq_factor = 2; },
      [](ModelConfig& m) { m.rope_scaling.original_max_position = 4096; },
      [](ModelConfig& m) { m.rms_eps = 1e-6; },
      [](ModelConfig& m) { m.tied_embeddings = false; },
      [](ModelConfig& m) { m.qkv_bias = true; }};
  for (size_t i = 0; i < edits.size(); ++i) {
    ModelConfig m = base;
    edits[i](m);
    ModelFingerprint other = make_fingerprint(m, "w1");
    EXPECT_FALSE(fp.matches(other)) << "edit " << i;
    EXPECT_FALSE(fp.describe_difference(other).empty()) << "edit " << i;
  }
}

}  // namespace
}  // namespace kvcc
