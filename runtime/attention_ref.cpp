#include "runtime/attention_ref.h"

#include <cmath>
#include <limits>
#include <string>

#include "formats/error.h"
#include "formats/fp16.h"
#include "formats/page_row_codec.h"
#include "runtime/append_ref.h"

namespace kvcc {

void gather_sequence(const KvCache& cache, int layer, int seq, const HeadCodec* codecs, std::vector<float>& keys,
                     std::vector<float>& values, int64_t length) {
  KVCC_REQUIRE(cache.memory() == PoolMemory::Host, "attention_ref: needs a host pool");
  const KvGeometry& g = cache.geometry();
  const int d = g.head_dim, H = g.n_kv_heads;
  KVCC_REQUIRE(length <= cache.length(seq), "attention_ref: length beyond the sequence's");
  const int64_t n = length < 0 ? cache.length(seq) : length;
  const KvTiers t = tiers_of(g, n);
  const std::vector<int32_t>& pages = cache.page_table(seq);
  keys.assign(size_t(n) * size_t(H) * size_t(d), 0.0f);
  values.assign(keys.size(), 0.0f);
  for (int h = 0; h < H; ++h) {
    const uint16_t* win = cache.windows_base() + g.window_block_elem(seq, layer, h);
    for (int64_t pos = 0; pos < n; ++pos) {
      float* kd = keys.data() + (size_t(pos) * size_t(H) + size_t(h)) * size_t(d);
      float* vd = values.data() + (size_t(pos) * size_t(H) + size_t(h)) * size_t(d);
      const uint16_t *ks = nullptr, *vs = nullptr;
      if (pos < t.sink_count) {
        ks = win + g.k_sink_elem() + size_t(pos) * size_t(d);
        vs = win + g.v_sink_elem() + size_t(pos) * size_t(d);
      } else if (pos - t.sink_count < t.hist_tokens) {
        const int64_t post = pos - t.sink_count;
        const uint8_t* blk = cache.page_block(pages[size_t(post / g.page_tokens)], layer, h);
        const BlockWidths w = cache.layout().widths(layer, h);
        const int row = int(post % g.page_tokens);
        dequantize_page_row(g, codecs[h].key, true, w, blk, row, kd);
        dequantize_page_row(g, codecs[h].value, false, w, blk, row, vd);
        continue;
      } else {
        const size_t slot = size_t(ring_slot(g, pos - t.sink_count));
        ks = win + g.k_ring_elem() + slot * size_t(d);
        vs = win + g.v_ring_elem() + slot * size_t(d);
      }
      for (int c = 0; c < d; ++c) {
        kd[c] = float_from_bf16(ks[c]);
        vd[c] = float_from_bf16(vs[c]);
      }
    }
  }
}

namespace {

void rotate(const float* x, const float* rot, int d, bool transpose, double* out) {
  for (int j = 0; j < d; ++j) {
    if (!rot) {
      out[j] = x[j];
      continue;
    }
    double acc = 0.0;
    for (int i = 0; i < d; ++i)
      acc += double(x[i]) *
             double(transpose ? rot[size_t(j) * size_t(d) + size_t(i)] : rot[size_t(i) * size_t(d) + size_t(j)]);
    out[j] = acc;
  }
}

// Softmax attention of one rotated query over n rotated keys/values of head h ([n, H, d]
// arrays), then the output rotated back by R_vᵀ.
void attend(const double* q_rot, const float* keys, const float* values, int64_t n, int H, int h, int d,
            const float* rot_v, float sm_scale, float* out) {
  if (n == 0) {
    for (int c = 0; c < d; ++c) out[c] = 0.0f;
    return;
  }
  std::vector<double> s(static_cast<size_t>(n));
  double mx = -std::numeric_limits<double>::infinity();
  for (int64_t j = 0; j < n; ++j) {
    const float* kr = keys + (size_t(j) * size_t(H) + size_t(h)) * size_t(d);
    double acc = 0.0;
    for (int c = 0; c < d; ++c) acc += q_rot[c] * double(kr[c]);
    s[size_t(j)] = acc * double(sm_scale);
    mx = std::max(mx, s[size_t(j)]);
  }
  std::vector<double> o(size_t(d), 0.0);
  double l = 0.0;
  for (int64_t j = 0; j < n; ++j) {
    const double p = std::exp(s[size_t(j)] - mx);
    l += p;
    const float* vr = values + (size_t(j) * size_t(H) + size_t(h)) * size_t(d);
    for (int c = 0; c < d; ++c) o[size_t(c)] += p * double(vr[c]);
  }
  for (int j = 0; j < d; ++j) {
    double acc = 0.0;
    for (int i = 0; i < d; ++i)
      acc += o[size_t(i)] / l * (rot_v ? double(rot_v[size_t(j) * size_t(d) + size_t(i)]) : (i == j ? 1.0 : 0.0));
    out[j] = float(acc);
  }
}

}  // namespace

void decode_ref(const KvCache& cache, int layer, const std::vector<int>& seqs, const float* q, int n_heads,
                const float* rot_k, const float* rot_v, const HeadCodec* codecs, float sm_scale, float* out) {
  const KvGeometry& g = cache.geometry();
  const int d = g.head_dim, H = g.n_kv_heads;
  KVCC_REQUIRE(n_heads % H == 0,
               "decode: query heads " + std::to_string(n_heads) + " not a multiple of KV heads " + std::to_string(H));
  const int r = n_heads / H;
  std::vector<float> keys, values;
  std::vector<double> q_rot(static_cast<size_t>(d));
  for (size_t b = 0; b < seqs.size(); ++b) {
    gather_sequence(cache, layer, seqs[b], codecs, keys, values);
    const int64_t n = cache.length(seqs[b]);
    for (int qh = 0; qh < n_heads; ++qh) {
      const int h = qh / r;
      const size_t off = (b * size_t(n_heads) + size_t(qh)) * size_t(d);
      rotate(q + off, rot_k ? rot_k + size_t(h) * size_t(d) * size_t(d) : nullptr, d, false, q_rot.data());
      attend(q_rot.data(), keys.data(), values.data(), n, H, h, d,
             rot_v ? rot_v + size_t(h) * size_t(d) * size_t(d) : nullptr, sm_scale, out + off);
    }
  }
}

void prefill_ref(const KvCache& cache, int layer, int seq, int T, const float* q, const float* k, const float* v,
                 int n_heads, const float* rot_k, const float* rot_v, const HeadCodec* codecs, float sm_scale,
                 float* out, int64_t length) {
  const KvGeometry& g = cache.geometry();
  const int d = g.head_dim, H = g.n_kv_heads;
  KVCC_REQUIRE(n_heads % H == 0, "prefill: query heads not a multiple of KV heads");
  const int r = n_heads / H;
  std::vector<float> keys, values;
  gather_sequence(cache, layer, seq, codecs, keys, values, length);
  const int64_t n0 = length < 0 ? cache.length(seq) : length;
  keys.resize((size_t(n0) + size_t(T)) * size_t(H) * size_t(d));
  values.resize(keys.size());
  for (int h = 0; h < H; ++h) {  // the new rows as the append will store them
    FixedRotation fk, fv;
    if (rot_k) fk = fixed_rotation(rot_k + size_t(h) * size_t(d) * size_t(d), d);
    if (rot_v) fv = fixed_rotation(rot_v + size_t(h) * size_t(d) * size_t(d), d);
    for (int j = 0; j < T; ++j) {
      const size_t src = (size_t(j) * size_t(H) + size_t(h)) * size_t(d);
      const size_t dst = ((size_t(n0) + size_t(j)) * size_t(H) + size_t(h)) * size_t(d);
      rotate_kv_row(k + src, rot_k ? &fk : nullptr, d, &keys[dst]);
      rotate_kv_row(v + src, rot_v ? &fv : nullptr, d, &values[dst]);
    }
  }
  std::vector<double> q_rot(static_cast<size_t>(d));
  for (int j = 0; j < T; ++j)
    for (int qh = 0; qh < n_heads; ++qh) {
      const int h = qh / r;
      const size_t off = (size_t(j) * size_t(n_heads) + size_t(qh)) * size_t(d);
      rotate(q + off, rot_k ? rot_k + size_t(h) * size_t(d) * size_t(d) : nullptr, d, false, q_rot.data());
      attend(q_rot.data(), keys.data(), values.data(), n0 + j + 1, H, h, d,
             rot_v ? rot_v + size_t(h) * size_t(d) * size_t(d) : nullptr, sm_scale, out + off);
    }
}

void attention_scores_ref(const KvCache& cache, int layer, int seq, int W, const float* q, int n_heads,
                          const float* rot_k, const HeadCodec* codecs, float sm_scale, float* scores) {
  const KvGeometry& g = cache.geometry();
  const int d = g.head_dim, H = g.n_kv_heads;
  KVCC_REQUIRE(n_heads % H == 0, "attention scores: query heads not a multiple of KV heads");
  const int64_t n = cache.length(seq);
  KVCC_REQUIRE(W >= 1 && W <= n, "attention scores: the observation window (" + std::to_string(W) +
                                     ") must be in [1, the sequence's length " + std::to_string(n) + "]");
  const int r = n_heads / H;
  std::vector<float> keys, values;
  gather_sequence(cache, layer, seq, codecs, keys, values);
  std::vector<double> q_rot(static_cast<size_t>(d)), s(static_cast<size_t>(n)), acc(size_t(H) * size_t(n), 0.0);
  for (int i = 0; i < W; ++i) {
    const int64_t last = n - W + i;  // the query's position: it sees 0..last
    for (int qh = 0; qh < n_heads; ++qh) {
      const int h = qh / r;
      rotate(q + (size_t(i) * size_t(n_heads) + size_t(qh)) * size_t(d),
             rot_k ? rot_k + size_t(h) * size_t(d) * size_t(d) : nullptr, d, false, q_rot.data());
      double mx = -std::numeric_limits<double>::infinity(), l = 0.0;
      for (int64_t j = 0; j <= last; ++j) {
        const float* kr = keys.data() + (size_t(j) * size_t(H) + size_t(h)) * size_t(d);
        double dot = 0.0;
        for (int c = 0; c < d; ++c) dot += q_rot[size_t(c)] * double(kr[c]);
        s[size_t(j)] = dot * double(sm_scale);
        mx = std::max(mx, s[size_t(j)]);
      }
      for (int64_t j = 0; j <= last; ++j) l += s[size_t(j)] = std::exp(s[size_t(j)] - mx);
      for (int64_t j = 0; j <= last; ++j) acc[size_t(h) * size_t(n) + size_t(j)] += s[size_t(j)] / l;
    }
  }
  for (size_t i = 0; i < acc.size(); ++i) scores[i] = float(acc[i]);
}

}  // namespace kvcc
