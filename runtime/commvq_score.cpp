#include "runtime/commvq_score.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "formats/error.h"
#include "formats/fp16.h"

namespace kvcc {

CommvqQueryTable commvq_query_table(const CommvqKeyCodebook& cb, const float* q) {
  cb.check();
  const int d = cb.d, pairs = d / 2, K = cb.n_params();
  std::vector<float> qz(static_cast<size_t>(d));
  commvq_to_pairs(cb.rope_style, d, q, qz.data());
  CommvqQueryTable table;
  table.d = d;
  table.stages = cb.stages;
  table.K = K;
  table.z.resize(cb.params.size());
  for (size_t rk = 0; rk < size_t(cb.stages) * K; ++rk) {
    const float* t = cb.params.data() + rk * d;
    float* z = table.z.data() + rk * d;
    for (int j = 0; j < pairs; ++j) {
      const float qr = qz[2 * j], qi = qz[2 * j + 1], tr = t[2 * j], ti = t[2 * j + 1];
      z[2 * j] = qr * tr + qi * ti;      // Re(conj(q)·t)
      z[2 * j + 1] = qr * ti - qi * tr;  // Im(conj(q)·t)
    }
  }
  return table;
}

void commvq_scores(const CommvqQueryTable& table, const std::vector<double>& inv_freq, const CommvqEncoded& keys,
                   const int32_t* positions, float* scores) {
  const int d = table.d, pairs = d / 2, K = table.K;
  KVCC_REQUIRE(int(inv_freq.size()) == pairs, "commvq: " + std::to_string(inv_freq.size()) + " RoPE frequencies for " +
                                                  std::to_string(pairs) + " pairs");
  KVCC_REQUIRE(keys.stages == table.stages, "commvq: encoded keys have " + std::to_string(keys.stages) +
                                                " stages, the codebook " + std::to_string(table.stages));
  std::vector<float> s(static_cast<size_t>(d));
  for (size_t i = 0; i < keys.n; ++i) {
    std::fill(s.begin(), s.end(), 0.0f);
    const uint16_t* code = keys.codes.data() + i * size_t(keys.stages);
    for (int r = 0; r < table.stages; ++r) {
      const float* za = table.z.data() + (size_t(r) * K + code[r] / K) * d;
      const float* zb = table.z.data() + (size_t(r) * K + code[r] % K) * d;
      for (int j = 0; j < pairs; ++j) {  // Z_a + i·Z_b
        s[2 * j] += za[2 * j] - zb[2 * j + 1];
        s[2 * j + 1] += za[2 * j + 1] + zb[2 * j];
      }
    }
    double acc = 0.0;
    for (int j = 0; j < pairs; ++j) {
      // The angle as apply_rope forms it (a float32 product, like HF and llama2.c), so scores
      // match keys the model rotated itself at long positions too.
      const double angle = double(float(positions[i]) * float(inv_freq[j]));
      acc += std::cos(angle) * s[2 * j] - std::sin(angle) * s[2 * j + 1];  // Re(e^{iθ}·S_j)
    }
    scores[i] = float(acc * double(float_from_f16(keys.norms[i])));
  }
}

void commvq_weighted_values(const CommvqValueCodebook& cb, const CommvqEncoded& values, const float* p, float* out) {
  cb.check();
  KVCC_REQUIRE(values.stages == cb.stages, "commvq: encoded values have " + std::to_string(values.stages) +
                                               " stages, the codebook " + std::to_string(cb.stages));
  const int d = cb.d, C = cb.n_codes();
  std::vector<double> weight(size_t(cb.stages) * C, 0.0);
  for (size_t i = 0; i < values.n; ++i) {
    const double w = double(p[i]) * float_from_f16(values.norms[i]);
    const uint16_t* code = values.codes.data() + i * size_t(values.stages);
    for (int r = 0; r < cb.stages; ++r) weight[size_t(r) * C + code[r]] += w;
  }
  std::vector<double> y(static_cast<size_t>(d), 0.0);
  for (int r = 0; r < cb.stages; ++r)
    for (int c = 0; c < C; ++c) {
      const double w = weight[size_t(r) * C + c];
      if (w == 0.0) continue;
      const float* wc = cb.stage(r) + size_t(c) * d;
      for (int k = 0; k < d; ++k) y[k] += w * wc[k];
    }
  for (int c = 0; c < d; ++c) {
    if (cb.rotation.empty()) {
      out[c] = float(y[c]);
    } else {  // out = y·Rᵀ
      double acc = 0.0;
      for (int k = 0; k < d; ++k) acc += y[k] * cb.rotation[size_t(c) * d + k];
      out[c] = float(acc);
    }
  }
}

void commvq_attend(const CommvqCodec& codec, const std::vector<double>& inv_freq, const float* q,
                   const CommvqEncoded& keys, const int32_t* positions, const CommvqEncoded& values, float scale,
                   float* out) {
  KVCC_REQUIRE(keys.n == values.n, "commvq: " + std::to_string(keys.n) + " encoded keys but " +
                                       std::to_string(values.n) + " encoded values");
  const int d = codec.key.d;
  if (keys.n == 0) {
    std::fill(out, out + d, 0.0f);
    return;
  }
  std::vector<float> p(keys.n);
  commvq_scores(commvq_query_table(codec.key, q), inv_freq, keys, positions, p.data());
  float mx = -INFINITY;
  for (float& x : p) {
    x *= scale;
    mx = std::max(mx, x);
  }
  double total = 0.0;
  for (float& x : p) {
    x = std::exp(x - mx);
    total += x;
  }
  for (float& x : p) x = float(x / total);
  commvq_weighted_values(codec.value, values, p.data(), out);
}

}  // namespace kvcc
