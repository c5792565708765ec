#include "formats/model_config.h"

#include <charconv>
#include <cmath>
#include <map>
#include <numbers>

#include "formats/error.h"
#include "formats/sha256.h"

namespace kvcc {
namespace {

// Shortest text that reads back to the same double, so the fingerprint does not depend on printf
// precision choices: whole numbers below 1e15 in plain digits ("500000"), others in the shortest
// general form ("1e-05", "0.5").
std::string canonical_double(double v) {
  char buf[64];
  const bool whole = std::isfinite(v) && v == std::floor(v) && std::abs(v) < 1e15;
  auto res = whole ? std::to_chars(buf, buf + sizeof buf, v, std::chars_format::fixed)
                   : std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, res.ptr);
}

}  // namespace

const char* rope_style_name(RopeStyle s) {
  switch (s) {
    case RopeStyle::RotateHalf:
      return "rotate_half";
    case RopeStyle::Interleaved:
      return "interleaved";
  }
  return "?";
}

RopeStyle rope_style_from_name(const std::string& name) {
  if (name == "rotate_half") return RopeStyle::RotateHalf;
  if (name == "interleaved") return RopeStyle::Interleaved;
  throw Error("unknown RoPE style \"" + name + "\" (expected rotate_half or interleaved)");
}

// Everything that changes what attention computes from the weights. Tokenizer choices (bos/eos ids,
// add_bos) and max_position (a serving limit, not the RoPE schedule, which rope_scaling fixes) are
// left out, so changing them does not orphan artifacts.
std::vector<std::pair<std::string, std::string>> fingerprint_fields(const ModelConfig& c) {
  return {
      {"architecture", c.architecture},
      {"n_layers", std::to_string(c.n_layers)},
      {"hidden", std::to_string(c.hidden)},
      {"n_heads", std::to_string(c.n_heads)},
      {"n_kv_heads", std::to_string(c.n_kv_heads)},
      {"head_dim", std::to_string(c.head_dim)},
      {"intermediate", std::to_string(c.intermediate)},
      {"vocab", std::to_string(c.vocab)},
      {"rope_theta", canonical_double(c.rope_theta)},
      {"rope_scaling.type", c.rope_scaling.type},
      {"rope_scaling.factor", canonical_double(c.rope_scaling.factor)},
      {"rope_scaling.low_freq_factor", canonical_double(c.rope_scaling.low_freq_factor)},
      {"rope_scaling.high_freq_factor", canonical_double(c.rope_scaling.high_freq_factor)},
      {"rope_scaling.original_max_position", std::to_string(c.rope_scaling.original_max_position)},
      {"rope_style", rope_style_name(c.rope_style)},
      {"rms_eps", canonical_double(c.rms_eps)},
      {"tied_embeddings", c.tied_embeddings ? "true" : "false"},
      {"qkv_bias", c.qkv_bias ? "true" : "false"},
      {"qk_norm", c.qk_norm ? "true" : "false"},
  };
}

// id = sha256 over "name=value\n" for each field in order, then "weights_sha256=HEX\n".
std::string fingerprint_id(const std::vector<std::pair<std::string, std::string>>& fields,
                           const std::string& weights_sha256) {
  Sha256 hash;
  for (const auto& [name, value] : fields) hash.update(name).update("=").update(value).update("\n");
  hash.update("weights_sha256=").update(weights_sha256).update("\n");
  return hash.hex_digest();
}

ModelFingerprint make_fingerprint(const ModelConfig& config, const std::string& weights_sha256) {
  ModelFingerprint fp;
  fp.fields = fingerprint_fields(config);
  fp.weights_sha256 = weights_sha256;
  fp.id = fingerprint_id(fp.fields, weights_sha256);
  return fp;
}

std::string ModelFingerprint::describe_difference(const ModelFingerprint& o) const {
  if (matches(o)) return "";
  std::map<std::string, std::string> theirs(o.fields.begin(), o.fields.end());
  std::string out;
  auto add = [&](const std::string& item) { out += (out.empty() ? "" : "; ") + item; };
  for (const auto& [name, value] : fields) {
    auto it = theirs.find(name);
    if (it == theirs.end()) {
      add(name + ": " + value + " vs (absent)");
    } else {
      if (it->second != value) add(name + ": " + value + " vs " + it->second);
      theirs.erase(it);
    }
  }
  for (const auto& [name, value] : o.fields) {
    if (theirs.count(name)) add(name + ": (absent) vs " + value);
  }
  if (weights_sha256 != o.weights_sha256) add("weights: differ");
  if (out.empty()) add("fingerprint id: " + id.substr(0, 12) + " vs " + o.id.substr(0, 12));
  return out;
}

std::vector<double> rope_inv_freq(const ModelConfig& c) {
  const int half = c.head_dim / 2;
  std::vector<double> inv_freq(half);
  for (int i = 0; i < half; ++i) inv_freq[i] = 1.0 / std::pow(c.rope_theta, double(2 * i) / c.head_dim);
  if (c.rope_scaling.type == "llama3") {
    // transformers' _compute_llama3_parameters: long wavelengths are slowed by `factor`, short
    // ones kept, and the band between interpolated smoothly.
    const RopeScaling& s = c.rope_scaling;
    const double low_freq_wavelen = s.original_max_position / s.low_freq_factor;
    const double high_freq_wavelen = s.original_max_position / s.high_freq_factor;
    for (double& f : inv_freq) {
      const double wavelen = 2 * std::numbers::pi / f;
      if (wavelen > low_freq_wavelen) {
        f /= s.factor;
      } else if (wavelen >= high_freq_wavelen) {
        const double smooth =
            (s.original_max_position / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
        f = (1 - smooth) * f / s.factor + smooth * f;
      }
    }
  } else {
    KVCC_REQUIRE(c.rope_scaling.type == "default", "unsupported rope scaling type " + c.rope_scaling.type);
  }
  return inv_freq;
}

}  // namespace kvcc
