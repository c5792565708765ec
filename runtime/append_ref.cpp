#include "runtime/append_ref.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "formats/codec_scalar.h"
#include "formats/error.h"
#include "formats/fp16.h"
#include "formats/kv_rotation.h"
#include "formats/page_row_codec.h"

namespace kvcc {

AppendBatch make_append_batch(const std::vector<int>& seqs, const std::vector<int64_t>& old_lengths,
                              const std::vector<int>& counts) {
  KVCC_REQUIRE(seqs.size() == old_lengths.size() && seqs.size() == counts.size(),
               "append: sequences, old lengths and counts differ in size");
  AppendBatch b{seqs, old_lengths, counts, {}};
  int64_t off = 0;
  for (int c : counts) {
    b.row_offsets.push_back(off);
    off += c;
  }
  return b;
}

FixedRotation fixed_rotation(const float* rot, int d) {
  FixedRotation r{d, std::vector<int32_t>(size_t(d) * size_t(d)), std::vector<int>(size_t(d))};
  for (int j = 0; j < d; ++j) {
    float mx = 0.0f;
    for (int i = 0; i < d; ++i) {
      const float a = rot[size_t(i) * size_t(d) + size_t(j)];
      KVCC_REQUIRE(std::isfinite(a), "rotation: column " + std::to_string(j) + " holds NaN or inf");
      mx = std::max(mx, std::fabs(a));
    }
    const int e = rot_exponent(mx);
    r.e[size_t(j)] = e;
    for (int i = 0; i < d; ++i)
      r.q[size_t(i) * size_t(d) + size_t(j)] = rot_fixed(rot[size_t(i) * size_t(d) + size_t(j)], e, kRotRBits);
  }
  return r;
}

void rotate_kv_row(const float* x, const FixedRotation* rot, int d, float* out) {
  if (!rot) {
    for (int j = 0; j < d; ++j) out[j] = round_bf16(x[j]);
    return;
  }
  KVCC_REQUIRE(rot->d == d, "rotate_kv_row: the rotation is for another head_dim");
  float mx = 0.0f;
  bool finite = true;
  for (int i = 0; i < d; ++i) {
    finite = finite && std::isfinite(x[i]);
    mx = std::max(mx, std::fabs(x[i]));
  }
  if (!finite) {
    for (int j = 0; j < d; ++j) out[j] = float_from_bf16(kRotNaN);
    return;
  }
  const int ex = rot_exponent(mx);
  std::vector<int64_t> X(static_cast<size_t>(d));
  for (int i = 0; i < d; ++i) X[size_t(i)] = rot_fixed(x[i], ex, kRotXBits);
  for (int j = 0; j < d; ++j) {
    int64_t t = 0;
    for (int i = 0; i < d; ++i) t += X[size_t(i)] * rot->q[size_t(i) * size_t(d) + size_t(j)];
    out[j] = float_from_bf16(rot_bf16(t, ex + rot->e[size_t(j)] - kRotXBits - kRotRBits));
  }
}

void append_ref(KvCache& cache, int layer, const AppendBatch& batch, const float* k, const float* v, const float* rot_k,
                const float* rot_v, const HeadCodec* codecs) {
  KVCC_REQUIRE(cache.memory() == PoolMemory::Host, "append_ref: needs a host pool");
  const KvGeometry& g = cache.geometry();
  KVCC_REQUIRE(layer >= 0 && layer < g.n_layers, "append: layer " + std::to_string(layer) + " out of range");
  const int d = g.head_dim, H = g.n_kv_heads;
  std::vector<float> krow(static_cast<size_t>(d)), vrow(static_cast<size_t>(d));
  std::vector<float> khist, vhist;  // the rows entering history, [moved tokens][d], page by page
  std::vector<FixedRotation> fk, fv;
  for (int h = 0; h < H; ++h) {
    if (rot_k) fk.push_back(fixed_rotation(rot_k + size_t(h) * size_t(d) * size_t(d), d));
    if (rot_v) fv.push_back(fixed_rotation(rot_v + size_t(h) * size_t(d) * size_t(d), d));
  }
  for (size_t bi = 0; bi < batch.seqs.size(); ++bi) {
    const int seq = batch.seqs[bi];
    const int64_t n0 = batch.old_lengths[bi], n1 = n0 + batch.counts[bi];
    KVCC_REQUIRE(cache.length(seq) >= n1,
                 "append: sequence " + std::to_string(seq) + " was not grown before appending");
    const KvTiers t0 = tiers_of(g, n0), t1 = tiers_of(g, n1);
    const std::vector<int32_t>& pages = cache.page_table(seq);
    const size_t moved = size_t(t1.hist_tokens - t0.hist_tokens);
    khist.resize(moved * size_t(d));
    vhist.resize(moved * size_t(d));
    for (int h = 0; h < H; ++h) {
      uint16_t* win = cache.windows_base() + g.window_block_elem(seq, layer, h);
      auto stage = [&](int64_t post, const float* kr, const float* vr) {
        const size_t at = size_t(post - t0.hist_tokens) * size_t(d);
        std::copy(kr, kr + d, &khist[at]);
        std::copy(vr, vr + d, &vhist[at]);
      };
      // 1. Old ring tokens that the new length pushes into history (read before any ring write).
      for (int64_t post = t0.hist_tokens; post < t1.hist_tokens && post < n0 - t0.sink_count; ++post) {
        const size_t slot = size_t(ring_slot(g, post));
        for (int c = 0; c < d; ++c) {
          krow[size_t(c)] = float_from_bf16(win[g.k_ring_elem() + slot * size_t(d) + size_t(c)]);
          vrow[size_t(c)] = float_from_bf16(win[g.v_ring_elem() + slot * size_t(d) + size_t(c)]);
        }
        stage(post, krow.data(), vrow.data());
      }
      // 2. The new tokens: sink, history or ring by their final tier.
      for (int j = 0; j < batch.counts[bi]; ++j) {
        const size_t r = size_t(batch.row_offsets[bi] + j);
        const float* kx = k + (r * size_t(H) + size_t(h)) * size_t(d);
        const float* vx = v + (r * size_t(H) + size_t(h)) * size_t(d);
        rotate_kv_row(kx, rot_k ? &fk[size_t(h)] : nullptr, d, krow.data());
        rotate_kv_row(vx, rot_v ? &fv[size_t(h)] : nullptr, d, vrow.data());
        const int64_t pos = n0 + j;
        size_t kdst, vdst;
        if (pos < g.sink) {
          kdst = g.k_sink_elem() + size_t(pos) * size_t(d);
          vdst = g.v_sink_elem() + size_t(pos) * size_t(d);
        } else if (pos - g.sink < t1.hist_tokens) {
          stage(pos - g.sink, krow.data(), vrow.data());
          continue;
        } else {
          const size_t slot = size_t(ring_slot(g, pos - g.sink));
          kdst = g.k_ring_elem() + slot * size_t(d);
          vdst = g.v_ring_elem() + slot * size_t(d);
        }
        for (int c = 0; c < d; ++c) {
          win[kdst + size_t(c)] = bf16_from_float(krow[size_t(c)]);
          win[vdst + size_t(c)] = bf16_from_float(vrow[size_t(c)]);
        }
      }
      // 3. Every page that became full, whole (per-channel keys need all of its tokens).
      for (int64_t first = t0.hist_tokens; first < t1.hist_tokens; first += g.page_tokens) {
        uint8_t* blk = cache.page_block(pages[size_t(first / g.page_tokens)], layer, h);
        const BlockWidths w = cache.layout().widths(layer, h);
        const size_t at = size_t(first - t0.hist_tokens) * size_t(d);
        quantize_page_side(g, codecs[h].key, true, w, &khist[at], blk);
        quantize_page_side(g, codecs[h].value, false, w, &vhist[at], blk);
      }
    }
  }
}

}  // namespace kvcc
