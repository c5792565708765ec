#include "formats/codec_commvq.h"

#include <Eigen/Dense>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

#include "formats/error.h"
#include "formats/fp16.h"

namespace kvcc {

namespace {

using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using ConstRowMap = Eigen::Map<const RowMat>;

// Rows per block of the distance products: bounds the [block, K²]-sized work arrays.
constexpr size_t kAssignBlock = 512;

bool is_pow2(int64_t x) { return x > 0 && (x & (x - 1)) == 0; }
int log2_exact(int64_t x) {
  int b = 0;
  while ((int64_t(1) << b) < x) ++b;
  return b;
}

}  // namespace

void commvq_to_pairs(RopeStyle style, int d, const float* x, float* z) {
  for (int j = 0; j < d / 2; ++j) {
    z[2 * j] = x[commvq_pair_channel(style, d, j, 0)];
    z[2 * j + 1] = x[commvq_pair_channel(style, d, j, 1)];
  }
}

void commvq_from_pairs(RopeStyle style, int d, const float* z, float* x) {
  for (int j = 0; j < d / 2; ++j) {
    x[commvq_pair_channel(style, d, j, 0)] = z[2 * j];
    x[commvq_pair_channel(style, d, j, 1)] = z[2 * j + 1];
  }
}

void CommvqKeyCodebook::check() const {
  KVCC_REQUIRE(d > 0 && d % 2 == 0,
               "commvq key codebook: head_dim " + std::to_string(d) + " is not a positive even number");
  KVCC_REQUIRE(stages > 0, "commvq key codebook: no stages");
  KVCC_REQUIRE(half_bits >= 1 && half_bits <= 8, "commvq key codebook: " + std::to_string(half_bits) +
                                                     " bits per parameter index is outside 1..8 (codes are 16-bit)");
  KVCC_REQUIRE(params.size() == size_t(stages) * size_t(n_params()) * size_t(d),
               "commvq key codebook: " + std::to_string(params.size()) + " parameters, expected stages*K*d = " +
                   std::to_string(size_t(stages) * size_t(n_params()) * size_t(d)));
}

void CommvqValueCodebook::check() const {
  KVCC_REQUIRE(d > 0, "commvq value codebook: head_dim must be positive");
  KVCC_REQUIRE(stages > 0, "commvq value codebook: no stages");
  KVCC_REQUIRE(code_bits >= 1 && code_bits <= 16,
               "commvq value codebook: code bits " + std::to_string(code_bits) + " outside 1..16");
  KVCC_REQUIRE(codewords.size() == size_t(stages) * size_t(n_codes()) * size_t(d),
               "commvq value codebook: " + std::to_string(codewords.size()) + " codeword values, expected " +
                   std::to_string(size_t(stages) * size_t(n_codes()) * size_t(d)));
  KVCC_REQUIRE(rotation.empty() || rotation.size() == size_t(d) * size_t(d),
               "commvq value codebook: rotation is not [d, d]");
}

void commvq_key_stage_tables(const float* t, int K, int d, float* it, float* gram) {
  const int pairs = d / 2;
  for (int k = 0; k < K; ++k)
    for (int j = 0; j < pairs; ++j) {
      const float re = t[size_t(k) * d + 2 * j], im = t[size_t(k) * d + 2 * j + 1];
      it[size_t(k) * d + 2 * j] = -im;  // i·(re + i·im) = −im + i·re
      it[size_t(k) * d + 2 * j + 1] = re;
    }
  std::vector<double> sq(static_cast<size_t>(K), 0.0);
  for (int k = 0; k < K; ++k)
    for (int c = 0; c < d; ++c) sq[k] += double(t[size_t(k) * d + c]) * t[size_t(k) * d + c];
  for (int a = 0; a < K; ++a)
    for (int b = 0; b < K; ++b) {
      double cross = 0.0;  // ⟨t_a, i·t_b⟩
      for (int c = 0; c < d; ++c) cross += double(t[size_t(a) * d + c]) * it[size_t(b) * d + c];
      gram[size_t(a) * K + b] = float(sq[a] + sq[b] + 2.0 * cross);
    }
}

void commvq_key_assign(const CommvqKeyCodebook& cb, int r, const float* z, size_t n, uint16_t* code, float* dist2) {
  const int K = cb.n_params(), d = cb.d;
  std::vector<float> it(size_t(K) * d), gram(size_t(K) * K);
  commvq_key_stage_tables(cb.stage(r), K, d, it.data(), gram.data());
  ConstRowMap T(cb.stage(r), K, d), IT(it.data(), K, d);
  RowMat P, Q;
  for (size_t i0 = 0; i0 < n; i0 += kAssignBlock) {
    const size_t m = std::min(kAssignBlock, n - i0);
    ConstRowMap Z(z + i0 * size_t(d), Eigen::Index(m), d);
    P.noalias() = Z * T.transpose();   // ⟨z, t_a⟩
    Q.noalias() = Z * IT.transpose();  // ⟨z, i·t_b⟩
    for (size_t i = 0; i < m; ++i) {
      const float* p = P.data() + i * size_t(K);
      const float* q = Q.data() + i * size_t(K);
      float best = std::numeric_limits<float>::infinity();
      int best_code = 0;
      for (int a = 0; a < K; ++a) {
        const float* g = gram.data() + size_t(a) * K;
        for (int b = 0; b < K; ++b) {
          const float dist = g[b] - 2.0f * (p[a] + q[b]);
          if (dist < best) {
            best = dist;
            best_code = a * K + b;
          }
        }
      }
      code[i0 + i] = uint16_t(best_code);
      if (dist2) {
        const float* zi = z + (i0 + i) * size_t(d);
        float zz = 0.0f;
        for (int c = 0; c < d; ++c) zz += zi[c] * zi[c];
        dist2[i0 + i] = std::max(0.0f, zz + best);
      }
    }
  }
}

void commvq_key_add_centre(const CommvqKeyCodebook& cb, int r, uint16_t code, float sign, float* z) {
  const int K = cb.n_params(), d = cb.d;
  const float* ta = cb.stage(r) + size_t(code / K) * d;
  const float* tb = cb.stage(r) + size_t(code % K) * d;
  for (int j = 0; j < d / 2; ++j) {
    z[2 * j] += sign * (ta[2 * j] - tb[2 * j + 1]);      // re(t_a) − im(t_b)
    z[2 * j + 1] += sign * (ta[2 * j + 1] + tb[2 * j]);  // im(t_a) + re(t_b)
  }
}

void commvq_value_assign(const CommvqValueCodebook& cb, int r, const float* x, size_t n, uint16_t* code, float* dist2) {
  const int C = cb.n_codes(), d = cb.d;
  ConstRowMap W(cb.stage(r), C, d);
  Eigen::VectorXf norms2 = W.rowwise().squaredNorm();
  RowMat P;
  for (size_t i0 = 0; i0 < n; i0 += kAssignBlock) {
    const size_t m = std::min(kAssignBlock, n - i0);
    ConstRowMap X(x + i0 * size_t(d), Eigen::Index(m), d);
    P.noalias() = X * W.transpose();
    for (size_t i = 0; i < m; ++i) {
      const float* p = P.data() + i * size_t(C);
      float best = std::numeric_limits<float>::infinity();
      int best_code = 0;
      for (int c = 0; c < C; ++c) {
        const float dist = norms2[c] - 2.0f * p[c];
        if (dist < best) {
          best = dist;
          best_code = c;
        }
      }
      code[i0 + i] = uint16_t(best_code);
      if (dist2) {
        const float* xi = x + (i0 + i) * size_t(d);
        float xx = 0.0f;
        for (int c = 0; c < d; ++c) xx += xi[c] * xi[c];
        dist2[i0 + i] = std::max(0.0f, xx + best);
      }
    }
  }
}

uint16_t commvq_row_norm(const float* x, int d, const char* what) {
  double ss = 0.0;
  for (int c = 0; c < d; ++c) ss += double(x[c]) * x[c];
  KVCC_REQUIRE(std::isfinite(ss), std::string("commvq: a ") + what + " row is not finite (NaN or inf)");
  const uint16_t h = f16_from_float(float(std::sqrt(ss)));
  KVCC_REQUIRE(std::isfinite(float_from_f16(h)),
               std::string("commvq: a ") + what + " row's norm " + std::to_string(std::sqrt(ss)) + " overflows fp16");
  return h;
}

CommvqEncoded commvq_encode_keys(const CommvqKeyCodebook& cb, const float* x, size_t n) {
  cb.check();
  const int d = cb.d;
  CommvqEncoded enc;
  enc.n = n;
  enc.stages = cb.stages;
  enc.codes.resize(n * size_t(cb.stages));
  enc.norms.resize(n);
  std::vector<float> z(n * size_t(d));
  for (size_t i = 0; i < n; ++i) {
    enc.norms[i] = commvq_row_norm(x + i * d, d, "key");
    const float nrm = float_from_f16(enc.norms[i]);
    commvq_to_pairs(cb.rope_style, d, x + i * d, z.data() + i * d);
    const float inv = nrm > 0.0f ? 1.0f / nrm : 0.0f;
    for (int c = 0; c < d; ++c) z[i * d + c] *= inv;
  }
  std::vector<uint16_t> stage_codes(n);
  for (int r = 0; r < cb.stages; ++r) {
    commvq_key_assign(cb, r, z.data(), n, stage_codes.data());
    for (size_t i = 0; i < n; ++i) {
      enc.codes[i * cb.stages + r] = stage_codes[i];
      commvq_key_add_centre(cb, r, stage_codes[i], -1.0f, z.data() + i * d);
    }
  }
  return enc;
}

void commvq_decode_keys(const CommvqKeyCodebook& cb, const CommvqEncoded& enc, float* x) {
  cb.check();
  KVCC_REQUIRE(enc.stages == cb.stages, "commvq: encoded keys have " + std::to_string(enc.stages) +
                                            " stages, the codebook " + std::to_string(cb.stages));
  const int d = cb.d;
  std::vector<float> z(static_cast<size_t>(d));
  for (size_t i = 0; i < enc.n; ++i) {
    std::fill(z.begin(), z.end(), 0.0f);
    for (int r = 0; r < cb.stages; ++r) commvq_key_add_centre(cb, r, enc.codes[i * cb.stages + r], 1.0f, z.data());
    const float nrm = float_from_f16(enc.norms[i]);
    for (float& v : z) v *= nrm;
    commvq_from_pairs(cb.rope_style, d, z.data(), x + i * d);
  }
}

CommvqEncoded commvq_encode_values(const CommvqValueCodebook& cb, const float* x, size_t n) {
  cb.check();
  const int d = cb.d;
  CommvqEncoded enc;
  enc.n = n;
  enc.stages = cb.stages;
  enc.codes.resize(n * size_t(cb.stages));
  enc.norms.resize(n);
  std::vector<float> y(n * size_t(d));
  for (size_t i = 0; i < n; ++i) {
    enc.norms[i] = commvq_row_norm(x + i * d, d, "value");
    float* yi = y.data() + i * d;
    if (cb.rotation.empty()) {
      std::copy(x + i * d, x + (i + 1) * d, yi);
    } else {
      for (int k = 0; k < d; ++k) {
        double s = 0.0;
        for (int c = 0; c < d; ++c) s += double(x[i * d + c]) * cb.rotation[size_t(c) * d + k];
        yi[k] = float(s);
      }
    }
    const float nrm = float_from_f16(enc.norms[i]);
    const float inv = nrm > 0.0f ? 1.0f / nrm : 0.0f;
    for (int c = 0; c < d; ++c) yi[c] *= inv;
  }
  std::vector<uint16_t> stage_codes(n);
  for (int r = 0; r < cb.stages; ++r) {
    commvq_value_assign(cb, r, y.data(), n, stage_codes.data());
    for (size_t i = 0; i < n; ++i) {
      enc.codes[i * cb.stages + r] = stage_codes[i];
      const float* w = cb.stage(r) + size_t(stage_codes[i]) * d;
      for (int c = 0; c < d; ++c) y[i * d + c] -= w[c];
    }
  }
  return enc;
}

void commvq_decode_values(const CommvqValueCodebook& cb, const CommvqEncoded& enc, float* x) {
  cb.check();
  KVCC_REQUIRE(enc.stages == cb.stages, "commvq: encoded values have " + std::to_string(enc.stages) +
                                            " stages, the codebook " + std::to_string(cb.stages));
  const int d = cb.d;
  std::vector<float> y(static_cast<size_t>(d));
  for (size_t i = 0; i < enc.n; ++i) {
    std::fill(y.begin(), y.end(), 0.0f);
    for (int r = 0; r < cb.stages; ++r) {
      const float* w = cb.stage(r) + size_t(enc.codes[i * cb.stages + r]) * d;
      for (int c = 0; c < d; ++c) y[c] += w[c];
    }
    const float nrm = float_from_f16(enc.norms[i]);
    float* xi = x + i * d;
    if (cb.rotation.empty()) {
      for (int c = 0; c < d; ++c) xi[c] = nrm * y[c];
    } else {
      for (int c = 0; c < d; ++c) {  // x = y·Rᵀ
        double s = 0.0;
        for (int k = 0; k < d; ++k) s += double(y[k]) * cb.rotation[size_t(c) * d + k];
        xi[c] = nrm * float(s);
      }
    }
  }
}

namespace {

// Rotates each row [d] of x in place by ±position·ω_j per RoPE pair (sign −1 undoes RoPE).
void rotate_pairs(RopeStyle style, int d, float* x, const int32_t* positions, size_t n,
                  const std::vector<double>& inv_freq, double sign) {
  KVCC_REQUIRE(int(inv_freq.size()) == d / 2,
               "commvq: " + std::to_string(inv_freq.size()) + " RoPE frequencies for head_dim " + std::to_string(d));
  for (size_t i = 0; i < n; ++i) {
    float* row = x + i * size_t(d);
    for (int j = 0; j < d / 2; ++j) {
      const double angle = sign * double(float(positions[i]) * float(inv_freq[size_t(j)]));
      const double c = std::cos(angle), s = std::sin(angle);
      float& re = row[commvq_pair_channel(style, d, j, 0)];
      float& im = row[commvq_pair_channel(style, d, j, 1)];
      const double a = re, b = im;
      re = float(c * a - s * b);
      im = float(s * a + c * b);
    }
  }
}

}  // namespace

void commvq_roundtrip_keys(const CommvqKeyCodebook& cb, const float* rows, const int32_t* positions, size_t n,
                           const std::vector<double>& inv_freq, bool rows_post_rope, float* out) {
  const int d = cb.d;
  std::vector<float> pre(rows, rows + n * size_t(d));
  if (rows_post_rope) rotate_pairs(cb.rope_style, d, pre.data(), positions, n, inv_freq, -1.0);
  const CommvqEncoded enc = commvq_encode_keys(cb, pre.data(), n);
  commvq_decode_keys(cb, enc, out);
  rotate_pairs(cb.rope_style, d, out, positions, n, inv_freq, 1.0);
}

void commvq_roundtrip_values(const CommvqValueCodebook& cb, const float* rows, size_t n, float* out) {
  commvq_decode_values(cb, commvq_encode_values(cb, rows, n), out);
}

// ---- artifact glue ----

namespace {

constexpr const char* kCodebooks = "commvq_codebooks";

// The extra named `name` of a side, or null (SideArtifact::extra's lookup, kept local so the codec
// does not depend on the artifact reader's object file).
const NamedArray* find_extra(const SideArtifact& side, const std::string& name) {
  for (const NamedArray& a : side.extras)
    if (a.name == name) return &a;
  return nullptr;
}

std::vector<double> identity_matrix(int d) {
  std::vector<double> m(size_t(d) * d, 0.0);
  for (int i = 0; i < d; ++i) m[size_t(i) * d + i] = 1.0;
  return m;
}

bool is_identity(const std::vector<double>& m, int d) {
  if (m.size() != size_t(d) * d) return false;
  for (int i = 0; i < d; ++i)
    for (int j = 0; j < d; ++j)
      if (m[size_t(i) * d + j] != (i == j ? 1.0 : 0.0)) return false;
  return true;
}

std::string head_name(int layer, int h) { return "layer " + std::to_string(layer) + " kv head " + std::to_string(h); }

// Problems of one head's codebooks against head_dim d; empty when sound.
std::vector<std::string> check_head(const HeadArtifact& head, int d, const std::string& where) {
  std::vector<std::string> problems;
  const NamedArray* k = find_extra(head.key, kCodebooks);
  const NamedArray* v = find_extra(head.value, kCodebooks);
  if (!k) problems.push_back(where + ": key side has no " + kCodebooks);
  if (!v) problems.push_back(where + ": value side has no " + kCodebooks);
  auto product = [](const std::vector<int64_t>& s) {
    int64_t p = 1;
    for (int64_t x : s) p *= x;
    return p;
  };
  auto finite = [](const std::vector<double>& a) {
    return std::all_of(a.begin(), a.end(), [](double x) { return std::isfinite(x); });
  };
  if (k) {
    if (k->shape.size() != 4 || k->shape[2] * 2 != d || k->shape[3] != 2 || k->shape[0] < 1 || !is_pow2(k->shape[1]) ||
        k->shape[1] > 256)
      problems.push_back(where + ": key " + kCodebooks + " is not [stages, K (power of two <= 256), " +
                         std::to_string(d / 2) + ", 2]");
    else if (int64_t(k->data.size()) != product(k->shape))
      problems.push_back(where + ": key " + kCodebooks + " holds " + std::to_string(k->data.size()) +
                         " values, its shape says " + std::to_string(product(k->shape)));
    else if (!finite(k->data)) problems.push_back(where + ": key " + kCodebooks + " has non-finite values");
  }
  if (v) {
    if (v->shape.size() != 3 || v->shape[2] != d || v->shape[0] < 1 || !is_pow2(v->shape[1]) || v->shape[1] > 65536)
      problems.push_back(where + ": value " + kCodebooks + " is not [stages, 2^bits, " + std::to_string(d) + "]");
    else if (int64_t(v->data.size()) != product(v->shape))
      problems.push_back(where + ": value " + kCodebooks + " holds " + std::to_string(v->data.size()) +
                         " values, its shape says " + std::to_string(product(v->shape)));
    else if (!finite(v->data)) problems.push_back(where + ": value " + kCodebooks + " has non-finite values");
  }
  return problems;
}

// Recipe parameter as an int, or -1 when absent.
int recipe_int(const Recipe& recipe, const std::string& name) {
  auto it = recipe.params.find(name);
  if (it == recipe.params.end()) return -1;
  try {
    return std::stoi(it->second);
  } catch (const std::exception&) {
    throw Error("commvq: recipe parameter " + name + " = '" + it->second + "' is not an integer");
  }
}

}  // namespace

void commvq_store(const CommvqCodec& codec, SideArtifact& key, SideArtifact& value) {
  codec.key.check();
  codec.value.check();
  const int d = codec.key.d;
  key.rotation = identity_matrix(d);  // keys are quantised pre-RoPE in the model's own basis
  key.eigenvalues.clear();
  NamedArray kc{kCodebooks,
                {codec.key.stages, codec.key.n_params(), d / 2, 2},
                std::vector<double>(codec.key.params.begin(), codec.key.params.end()),
                false};
  NamedArray vc{kCodebooks,
                {codec.value.stages, codec.value.n_codes(), d},
                std::vector<double>(codec.value.codewords.begin(), codec.value.codewords.end()),
                false};
  auto put = [](SideArtifact& side, NamedArray a) {
    auto it =
        std::find_if(side.extras.begin(), side.extras.end(), [&](const NamedArray& e) { return e.name == a.name; });
    if (it != side.extras.end()) *it = std::move(a);
    else side.extras.push_back(std::move(a));
  };
  put(key, std::move(kc));
  put(value, std::move(vc));
  value.rotation = codec.value.rotation.empty() ? identity_matrix(d) : codec.value.rotation;
}

CommvqKeyCodebook commvq_key_codebook(const SideArtifact& key, int d, RopeStyle style) {
  const NamedArray* k = find_extra(key, kCodebooks);
  KVCC_REQUIRE(k != nullptr, std::string("commvq: the key side has no ") + kCodebooks);
  KVCC_REQUIRE(k->shape.size() == 4 && k->shape[2] * 2 == d && k->shape[3] == 2 && k->shape[0] >= 1 &&
                   is_pow2(k->shape[1]) && k->shape[1] <= 256 &&
                   k->data.size() == size_t(k->shape[0] * k->shape[1] * k->shape[2] * 2),
               std::string("commvq: key ") + kCodebooks + " is not [stages, K, " + std::to_string(d / 2) + ", 2]");
  CommvqKeyCodebook cb;
  cb.d = d;
  cb.stages = int(k->shape[0]);
  cb.half_bits = log2_exact(k->shape[1]);
  cb.rope_style = style;
  cb.params.assign(k->data.begin(), k->data.end());
  cb.check();
  return cb;
}

CommvqValueCodebook commvq_value_codebook(const SideArtifact& value, int d, bool with_rotation) {
  const NamedArray* v = find_extra(value, kCodebooks);
  KVCC_REQUIRE(v != nullptr, std::string("commvq: the value side has no ") + kCodebooks);
  KVCC_REQUIRE(v->shape.size() == 3 && v->shape[2] == d && v->shape[0] >= 1 && is_pow2(v->shape[1]) &&
                   v->shape[1] <= 65536 && v->data.size() == size_t(v->shape[0] * v->shape[1] * d),
               std::string("commvq: value ") + kCodebooks + " is not [stages, 2^bits, " + std::to_string(d) + "]");
  CommvqValueCodebook cb;
  cb.d = d;
  cb.stages = int(v->shape[0]);
  cb.code_bits = log2_exact(v->shape[1]);
  cb.codewords.assign(v->data.begin(), v->data.end());
  if (with_rotation && !value.rotation.empty() && !is_identity(value.rotation, d)) {
    KVCC_REQUIRE(value.rotation.size() == size_t(d) * d, "commvq: value rotation is not [d, d]");
    cb.rotation = value.rotation;
  }
  cb.check();
  return cb;
}

CommvqCodec commvq_load(const Artifact& artifact, int layer, int kv_head) {
  KVCC_REQUIRE(layer >= 0 && layer < artifact.n_layers && kv_head >= 0 && kv_head < artifact.n_kv_heads,
               "commvq: " + head_name(layer, kv_head) + " is outside the artifact");
  const int d = artifact.head_dim;
  const HeadArtifact& head = artifact.head(layer, kv_head);
  auto problems = check_head(head, d, head_name(layer, kv_head));
  KVCC_REQUIRE(problems.empty(), problems.empty() ? "" : "commvq: " + problems.front());
  CommvqCodec codec;
  codec.key = commvq_key_codebook(head.key, d, artifact.rope_style);
  codec.value = commvq_value_codebook(head.value, d, true);
  return codec;
}

std::vector<std::string> verify_commvq(const Artifact& artifact) {
  std::vector<std::string> problems;
  const int d = artifact.head_dim;
  if (d <= 0 || d % 2 != 0) {
    problems.push_back("commvq: head_dim " + std::to_string(d) + " is not a positive even number");
    return problems;
  }
  int key_stages = -1, key_bits = -1, value_stages = -1, value_bits = -1;
  try {
    key_stages = recipe_int(artifact.recipe, "key_stages");
    key_bits = recipe_int(artifact.recipe, "key_code_bits");
    value_stages = recipe_int(artifact.recipe, "value_stages");
    value_bits = recipe_int(artifact.recipe, "value_code_bits");
  } catch (const Error& e) {
    problems.push_back(e.what());
  }
  for (int l = 0; l < artifact.n_layers; ++l)
    for (int h = 0; h < artifact.n_kv_heads; ++h) {
      if (size_t(l * artifact.n_kv_heads + h) >= artifact.heads.size()) {
        problems.push_back("commvq: artifact has fewer heads than n_layers * n_kv_heads");
        return problems;
      }
      const HeadArtifact& head = artifact.head(l, h);
      auto hp = check_head(head, d, "commvq: " + head_name(l, h));
      if (!hp.empty()) {
        problems.insert(problems.end(), hp.begin(), hp.end());
        continue;
      }
      const NamedArray& k = *find_extra(head.key, kCodebooks);
      const NamedArray& v = *find_extra(head.value, kCodebooks);
      const std::string where = "commvq: " + head_name(l, h);
      if (key_stages >= 0 && k.shape[0] != key_stages)
        problems.push_back(where + ": key codebook has " + std::to_string(k.shape[0]) +
                           " stages, recipe key_stages = " + std::to_string(key_stages));
      if (key_bits >= 0 && 2 * log2_exact(k.shape[1]) != key_bits)
        problems.push_back(where + ": key codebook K = " + std::to_string(k.shape[1]) +
                           " disagrees with recipe key_code_bits = " + std::to_string(key_bits));
      if (value_stages >= 0 && v.shape[0] != value_stages)
        problems.push_back(where + ": value codebook has " + std::to_string(v.shape[0]) +
                           " stages, recipe value_stages = " + std::to_string(value_stages));
      if (value_bits >= 0 && log2_exact(v.shape[1]) != value_bits)
        problems.push_back(where + ": value codebook has " + std::to_string(v.shape[1]) +
                           " codewords, recipe value_code_bits = " + std::to_string(value_bits));
    }
  return problems;
}

std::string describe_commvq(const Artifact& artifact) {
  if (artifact.heads.empty()) return "";
  const int d = artifact.head_dim;
  const HeadArtifact& head = artifact.heads.front();
  const NamedArray* k = find_extra(head.key, kCodebooks);
  const NamedArray* v = find_extra(head.value, kCodebooks);
  if (!k || !v || k->shape.size() != 4 || v->shape.size() != 3) return "commvq: codebooks missing or misshapen";
  const int ks = int(k->shape[0]), kb = 2 * log2_exact(k->shape[1]);
  const int vs = int(v->shape[0]), vb = log2_exact(v->shape[1]);
  char line[320];
  std::snprintf(line, sizeof line,
                "commvq: key %d stages x %d-bit codes (K=%lld params/pair, %s pairs), %.3f nominal / %.3f "
                "effective bits; value %d stages x %d-bit codes, %.3f nominal / %.3f effective bits",
                ks, kb, static_cast<long long>(k->shape[1]), rope_style_name(artifact.rope_style),
                commvq_nominal_bits(ks, kb, d), commvq_effective_bits(ks, kb, d), vs, vb,
                commvq_nominal_bits(vs, vb, d), commvq_effective_bits(vs, vb, d));
  return line;
}

}  // namespace kvcc
