// Per-channel key pages (kv_layout.h key_group_tokens, KIVI's keys) in the host pool: the bytes
// append_ref writes equal a token-by-token simulation whose pages are coded by formats/kv_codec.h
// (the codec validation and compile use), decode_ref and prefill_ref equal a naive float64
// attention over the simulation's decoded contents, and the layout's sizes are the hand-worked
// ones. Both value sides: KIVI's own (per-token groups, no clip) and the mixed recipe's (a
// rotated per-token grid with a clip ratio); 2-bit codes, or each (layer, KV head) block at its
// own key and value widths (1-4 bits, compile --bits-budget's artifacts).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <vector>

#include "cache_test_util.h"
#include "formats/codec_scalar.h"
#include "formats/fp16.h"
#include "formats/kv_codec.h"
#include "formats/kv_layout.h"
#include "runtime/append_ref.h"
#include "runtime/attention_ref.h"
#include "runtime/compact_ref.h"
#include "runtime/kv_cache.h"

namespace kvcc {
namespace {

using testing::random_rotations;

// d = 32, pages of 16 tokens, sink 8, ring 32; keys per channel over T tokens (pairs of
// `key_pair_bytes`: 4 fp16, 2 e5m3); values per token over groups of `value_group` channels.
KvGeometry geometry(int T, int value_group, int key_pair_bytes = 4) {
  KvGeometry g;
  g.n_layers = 2;
  g.n_kv_heads = 2;
  g.head_dim = 32;
  g.group = value_group;
  g.page_tokens = 16;
  g.sink = 8;
  g.recent = 32;
  g.key_group_tokens = T;
  g.key_pair_bytes = key_pair_bytes;
  return g;
}

// The kivi recipe whose codec (kv_codec.h roundtrip_rotated) the pages must equal: keys per channel
// over groups of T tokens of the page; values either KIVI's (per token, groups of T channels capped
// at d, no clip) or, mixed, the hadamard grid's (per token over d, the stored clip ratio).
Recipe kivi_recipe(const KvGeometry& g, bool mixed) {
  Recipe r;
  r.method = "kivi";
  r.group = g.key_group_tokens;
  r.page_size = g.page_tokens;
  r.sink = g.sink;
  r.recent = g.recent;
  if (mixed) r.params["values"] = "hadamard";
  if (g.e5m3_key_pairs()) r.params["key_params"] = "e5m3";
  return r;
}

struct SimHead {
  std::vector<std::vector<float>> k, v;          // rotated, BF16-rounded, per position
  std::vector<std::vector<float>> k_hat, v_hat;  // decoded as stored, per position
  std::vector<int> ring;                         // positions in the ring, oldest first
  std::vector<std::vector<int>> pages;           // positions of each history page
};

// x·R as the cache stores it (append_ref.h: rotate_kv_row, the CUDA kernels' arithmetic;
// test_cache.cpp's RotateKvRow* tests check it against exact sums).
std::vector<float> rotate_bf16(const float* x, const float* rot, int d) {
  std::vector<float> out(static_cast<size_t>(d));
  const FixedRotation r = fixed_rotation(rot, d);
  rotate_kv_row(x, &r, d, out.data());
  return out;
}

// A 2-byte key pair worked out by search rather than by codec_scalar.h's bit arithmetic: the scale
// the e5m3 nearest (hi − lo)/(2^b − 1) (testing::nearest_e5m3), 1 when that is 0; the zero
// rint(−lo/scale·4) clamped to a signed byte; codes on that grid (DESIGN.md's rule).
struct PairBytes {
  unsigned scale_byte, zero_byte;
  float scale, zero;
};
PairBytes e5m3_pair(const std::vector<float>& x, int bits, std::vector<uint8_t>& codes) {
  const float lo = *std::min_element(x.begin(), x.end()), hi = *std::max_element(x.begin(), x.end());
  const unsigned best = testing::nearest_e5m3(double((hi - lo) / float((1 << bits) - 1)));
  PairBytes p;
  p.scale_byte = best == 0 || best == 0xF8u ? 0x78u : best;  // 0x78 << 7 = fp16 1.0
  p.scale = float_from_f16(uint16_t(p.scale_byte << 7));
  const double q = std::clamp(std::nearbyint(double(-lo / p.scale * 4.0f)), -128.0, 127.0);
  p.zero_byte = unsigned(uint8_t(int8_t(q)));
  p.zero = float(q) / 4.0f;
  const float top = float((1 << bits) - 1);
  codes.resize(x.size());
  for (size_t i = 0; i < x.size(); ++i)
    codes[i] = uint8_t(std::clamp(std::floor(x[i] / p.scale + p.zero + 0.5f), 0.0f, top));
  return p;
}

// Every width on both sides over the four (layer, KV head) blocks: {1, 3}, {2, 4}, {3, 1}, {4, 2}.
std::vector<BlockWidths> mixed_widths(const KvGeometry& g) {
  std::vector<BlockWidths> w;
  for (int i = 0; i < g.n_layers * g.n_kv_heads; ++i) w.push_back(BlockWidths{1 + i % 4, 1 + (i + 2) % 4});
  return w;
}

struct World {
  KvGeometry g;
  Recipe recipe;
  std::vector<BlockWidths> widths;  // [layers][H]
  KvCache cache;
  std::vector<float> rot_k, rot_v;                   // [layers][H][d][d]
  std::vector<HeadCodec> codecs;                     // [layers][H]
  std::vector<SideArtifact> key_sides, value_sides;  // with each block's bits, as compile stores them
  std::map<int, std::vector<SimHead>> sim;
  std::mt19937 rng{99};

  World(const KvGeometry& geo, bool mixed, std::vector<BlockWidths> w = {})
      : g(geo),
        recipe(kivi_recipe(geo, mixed)),
        widths(w.empty() ? std::vector<BlockWidths>(size_t(geo.n_layers * geo.n_kv_heads)) : w),
        cache(KvCacheConfig{geo, 128, 6, PoolMemory::Host, w}) {
    for (int l = 0; l < g.n_layers; ++l) {
      auto rk = random_rotations(g.n_kv_heads, g.head_dim, rng);
      auto rv = random_rotations(g.n_kv_heads, g.head_dim, rng);
      rot_k.insert(rot_k.end(), rk.begin(), rk.end());
      rot_v.insert(rot_v.end(), rv.begin(), rv.end());
      for (int h = 0; h < g.n_kv_heads; ++h) {
        HeadCodec c;  // keys: never clipped; values: the mixed recipe's clip, else none
        c.value.clip_ratio = mixed ? 0.85f + 0.05f * float(h) : 1.0f;
        codecs.push_back(c);
        SideArtifact ks, vs;  // kivi keys: no clip whatever is stored
        ks.bits = widths[size_t(l * g.n_kv_heads + h)].key;
        vs.bits = widths[size_t(l * g.n_kv_heads + h)].value;
        vs.clip_ratio = double(c.value.clip_ratio);
        key_sides.push_back(ks);
        value_sides.push_back(vs);
      }
    }
  }
  const float* rk(int l) const { return rot_k.data() + size_t(l) * g.n_kv_heads * g.head_dim * g.head_dim; }
  const float* rv(int l) const { return rot_v.data() + size_t(l) * g.n_kv_heads * g.head_dim * g.head_dim; }
  const HeadCodec* codec(int l) const { return codecs.data() + size_t(l) * g.n_kv_heads; }

  int add() {
    const int s = cache.add_sequence();
    sim[s] = std::vector<SimHead>(size_t(g.n_layers * g.n_kv_heads));
    return s;
  }
  int fork(int parent) {
    const int s = cache.fork(parent);
    sim[s] = sim[parent];
    return s;
  }

  // One token into the simulation: the ring's oldest P tokens become a page coded by kv_codec.h.
  void sim_append(int l, int h, SimHead& s, std::vector<float> kr, std::vector<float> vr) {
    const int pos = int(s.k.size()), d = g.head_dim, P = g.page_tokens;
    s.k.push_back(kr);
    s.v.push_back(vr);
    s.k_hat.push_back(kr);
    s.v_hat.push_back(vr);
    if (pos < g.sink) return;
    if (int(s.ring.size()) == g.recent) {
      std::vector<float> ky(size_t(P) * d), vy(ky.size()), kq(ky.size()), vq(ky.size());
      for (int i = 0; i < P; ++i) {
        std::copy_n(s.k[size_t(s.ring[size_t(i)])].data(), d, &ky[size_t(i) * d]);
        std::copy_n(s.v[size_t(s.ring[size_t(i)])].data(), d, &vy[size_t(i) * d]);
      }
      roundtrip_rotated(recipe, key_sides[size_t(l * g.n_kv_heads + h)], KvSide::Key, d, ky.data(), P, kq.data());
      roundtrip_rotated(recipe, value_sides[size_t(l * g.n_kv_heads + h)], KvSide::Value, d, vy.data(), P, vq.data());
      for (int i = 0; i < P; ++i) {
        const int p = s.ring[size_t(i)];
        s.k_hat[size_t(p)].assign(&kq[size_t(i) * d], &kq[size_t(i) * d] + d);
        s.v_hat[size_t(p)].assign(&vq[size_t(i) * d], &vq[size_t(i) * d] + d);
      }
      s.pages.emplace_back(s.ring.begin(), s.ring.begin() + P);
      s.ring.erase(s.ring.begin(), s.ring.begin() + P);
    }
    s.ring.push_back(pos);
  }

  void append(const std::vector<int>& seqs, const std::vector<int>& counts) {
    std::vector<int64_t> old, add;
    int rows = 0;
    for (size_t i = 0; i < seqs.size(); ++i) {
      old.push_back(cache.length(seqs[i]));
      add.push_back(counts[i]);
      rows += counts[i];
    }
    cache.grow_batch(seqs, add);
    const AppendBatch batch = make_append_batch(seqs, old, counts);
    const int H = g.n_kv_heads, d = g.head_dim;
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (int l = 0; l < g.n_layers; ++l) {
      std::vector<float> k(size_t(rows) * H * d), v(k.size());
      for (size_t i = 0; i < k.size(); ++i) {
        k[i] = nd(rng) * (i % 5 == 0 ? 6.0f : 1.0f);  // outlier channels: what per-channel scales absorb
        v[i] = nd(rng);
      }
      append_ref(cache, l, batch, k.data(), v.data(), rk(l), rv(l), codec(l));
      for (size_t i = 0; i < seqs.size(); ++i)
        for (int j = 0; j < counts[i]; ++j)
          for (int h = 0; h < H; ++h) {
            const size_t row = size_t(batch.row_offsets[i] + j);
            sim_append(l, h, sim[seqs[i]][size_t(l * H + h)],
                       rotate_bf16(k.data() + (row * H + h) * d, rk(l) + size_t(h) * d * d, d),
                       rotate_bf16(v.data() + (row * H + h) * d, rv(l) + size_t(h) * d * d, d));
          }
    }
  }

  // Every page byte against the simulation: key codes and (scale, zero) per channel and token group
  // from codec_scalar.h's quantize_uniform over the channel's T rows (no clip; 2-byte pairs:
  // e5m3_pair's search), and the values they decode to equal to kv_codec.h's roundtrip bit for bit; value rows as
  // quantize_uniform with the clip threshold per token; window rows as BF16.
  void check_storage(int seq) {
    const int H = g.n_kv_heads, d = g.head_dim, P = g.page_tokens, T = g.key_group_tokens;
    const int64_t n = cache.length(seq);
    const KvTiers t = tiers_of(g, n);
    for (int l = 0; l < g.n_layers; ++l)
      for (int h = 0; h < H; ++h) {
        const SimHead& s = sim[seq][size_t(l * H + h)];
        const BlockWidths w = widths[size_t(l * H + h)];
        ASSERT_EQ(int64_t(s.pages.size()) * P, t.hist_tokens);
        for (size_t pg = 0; pg < s.pages.size(); ++pg) {
          const uint8_t* blk = cache.page_block(cache.page_table(seq)[pg], l, h);
          const uint16_t* kp = reinterpret_cast<const uint16_t*>(blk + g.k_params_offset(w));
          for (int t0 = 0; t0 < P; t0 += T)
            for (int c = 0; c < d; ++c) {
              std::vector<float> x(static_cast<size_t>(T));
              std::vector<uint8_t> codes(static_cast<size_t>(T));
              for (int i = 0; i < T; ++i) x[size_t(i)] = s.k[size_t(s.pages[pg][size_t(t0 + i)])][size_t(c)];
              float scale, zero;
              if (g.e5m3_key_pairs()) {
                const PairBytes p = e5m3_pair(x, w.key, codes);
                const size_t at = size_t(t0 / T) * d + size_t(c);
                ASSERT_EQ(kp[at] & 0xffu, p.scale_byte) << "page " << pg << " channel " << c;
                ASSERT_EQ(kp[at] >> 8, p.zero_byte) << "page " << pg << " channel " << c;
                scale = p.scale;
                zero = p.zero;
              } else {
                const GroupParams p = quantize_uniform(x.data(), T, INFINITY, w.key, codes.data());
                const size_t at = (size_t(t0 / T) * d + size_t(c)) * 2;
                ASSERT_EQ(kp[at], p.scale) << "page " << pg << " channel " << c;
                ASSERT_EQ(kp[at + 1], p.zero);
                scale = float_from_f16(p.scale);
                zero = float_from_f16(p.zero);
              }
              for (int i = 0; i < T; ++i) {
                const int pos = s.pages[pg][size_t(t0 + i)];
                const uint8_t* crow = blk + g.k_codes_offset() + size_t(t0 + i) * size_t(d * w.key / 8);
                ASSERT_EQ(unpack_code(crow, d, c, w.key), codes[size_t(i)]) << "pos " << pos << " ch " << c;
                const float decoded = (float(codes[size_t(i)]) - zero) * scale;
                ASSERT_EQ(decoded, s.k_hat[size_t(pos)][size_t(c)]) << "pos " << pos << " ch " << c;
              }
            }
          const HeadCodec& hc = codec(l)[h];
          const uint16_t* vp = reinterpret_cast<const uint16_t*>(blk + g.v_params_offset(w));
          for (int r = 0; r < P; ++r) {
            const int pos = s.pages[pg][size_t(r)];
            const uint8_t* crow = blk + g.v_codes_offset(w) + size_t(r) * size_t(d * w.value / 8);
            for (int grp = 0; grp < d / g.group; ++grp) {
              const float* x = s.v[size_t(pos)].data() + grp * g.group;
              std::vector<uint8_t> codes(static_cast<size_t>(g.group));
              const GroupParams p =
                  quantize_uniform(x, g.group, clip_threshold(x, g.group, hc.value.clip_ratio), w.value, codes.data());
              ASSERT_EQ(vp[(size_t(r) * (d / g.group) + size_t(grp)) * 2], p.scale) << "pos " << pos;
              ASSERT_EQ(vp[(size_t(r) * (d / g.group) + size_t(grp)) * 2 + 1], p.zero);
              for (int i = 0; i < g.group; ++i) {
                ASSERT_EQ(unpack_code(crow, d, grp * g.group + i, w.value), codes[size_t(i)]);
                ASSERT_EQ(uniform_dequant(codes[size_t(i)], float_from_f16(p.scale), float_from_f16(p.zero)),
                          s.v_hat[size_t(pos)][size_t(grp * g.group + i)]);
              }
            }
          }
        }
        const uint16_t* win = cache.windows_base() + g.window_block_elem(seq, l, h);
        for (int64_t pos = 0; pos < n; ++pos) {
          const int64_t post = pos - t.sink_count;
          if (pos >= t.sink_count && post < t.hist_tokens) continue;
          const size_t ko =
              pos < g.sink ? g.k_sink_elem() + size_t(pos) * d : g.k_ring_elem() + size_t(post % g.recent) * d;
          const size_t vo =
              pos < g.sink ? g.v_sink_elem() + size_t(pos) * d : g.v_ring_elem() + size_t(post % g.recent) * d;
          for (int c = 0; c < d; ++c) {
            ASSERT_EQ(win[ko + size_t(c)], bf16_from_float(s.k[size_t(pos)][size_t(c)]));
            ASSERT_EQ(win[vo + size_t(c)], bf16_from_float(s.v[size_t(pos)][size_t(c)]));
          }
        }
      }
  }
};

std::vector<double> rotate_query(const float* q, const float* rot, int d) {
  std::vector<double> out(static_cast<size_t>(d), 0.0);
  for (int j = 0; j < d; ++j)
    for (int i = 0; i < d; ++i) out[size_t(j)] += double(q[i]) * rot[size_t(i * d + j)];
  return out;
}

// Naive float64 softmax attention over n rows of a simulated head, output rotated back by R_vᵀ.
std::vector<double> naive_attention(const std::vector<double>& q_rot, const std::vector<std::vector<float>>& keys,
                                    const std::vector<std::vector<float>>& values, size_t n, const float* rot_v, int d,
                                    double scale) {
  std::vector<double> out(static_cast<size_t>(d), 0.0), s(n), o(static_cast<size_t>(d), 0.0);
  if (n == 0) return out;
  double mx = -1e300, l = 0;
  for (size_t j = 0; j < n; ++j) {
    s[j] = 0;
    for (int c = 0; c < d; ++c) s[j] += q_rot[size_t(c)] * keys[j][size_t(c)];
    mx = std::max(mx, s[j] *= scale);
  }
  for (size_t j = 0; j < n; ++j) {
    const double p = std::exp(s[j] - mx);
    l += p;
    for (int c = 0; c < d; ++c) o[size_t(c)] += p * values[j][size_t(c)];
  }
  for (int i = 0; i < d; ++i)
    for (int j = 0; j < d; ++j) out[size_t(j)] += o[size_t(i)] / l * rot_v[size_t(j * d + i)];
  return out;
}

double rel_err(const float* got, const std::vector<double>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

// The reference kernels accumulate in double over float inputs, the naive attention in double over
// the same decoded floats: they differ by the float rounding of the output rotation alone
// (~1e-7 relative); 1e-5 is the bound the per-token cache's tests hold (tests/test_cache.cpp).
constexpr double kAttentionTol = 1e-5;

void check_decode(World& w, const std::vector<int>& seqs, int n_heads) {
  const KvGeometry& g = w.g;
  const int d = g.head_dim, H = g.n_kv_heads, r = n_heads / H;
  std::normal_distribution<float> nd;
  std::vector<float> q(seqs.size() * size_t(n_heads * d)), out(q.size());
  for (auto& x : q) x = 2.0f * nd(w.rng);
  const double scale = 1.0 / std::sqrt(double(d));
  for (int l = 0; l < g.n_layers; ++l) {
    decode_ref(w.cache, l, seqs, q.data(), n_heads, w.rk(l), w.rv(l), w.codec(l), float(scale), out.data());
    for (size_t b = 0; b < seqs.size(); ++b)
      for (int qh = 0; qh < n_heads; ++qh) {
        const int h = qh / r;
        const SimHead& s = w.sim[seqs[b]][size_t(l * H + h)];
        const size_t off = (b * n_heads + qh) * d;
        const auto want = naive_attention(rotate_query(q.data() + off, w.rk(l) + size_t(h) * d * d, d), s.k_hat,
                                          s.v_hat, s.k.size(), w.rv(l) + size_t(h) * d * d, d, scale);
        if (s.k.empty()) {
          for (int c = 0; c < d; ++c) EXPECT_EQ(out[off + size_t(c)], 0.0f);
        } else {
          EXPECT_LT(rel_err(out.data() + off, want), kAttentionTol) << "seq " << seqs[b] << " len " << s.k.size();
        }
      }
  }
}

void check_prefill(World& w, int seq) {
  const KvGeometry& g = w.g;
  const int T = 29, n_heads = 4, d = g.head_dim, H = g.n_kv_heads, r = n_heads / H, l = 1;
  std::normal_distribution<float> nd;
  std::vector<float> q(size_t(T * n_heads * d)), k(size_t(T * H * d)), v(k.size()), out(q.size());
  for (auto* a : {&q, &k, &v})
    for (auto& x : *a) x = nd(w.rng);
  const double scale = 1.0 / std::sqrt(double(d));
  prefill_ref(w.cache, l, seq, T, q.data(), k.data(), v.data(), n_heads, w.rk(l), w.rv(l), w.codec(l), float(scale),
              out.data());
  for (int h = 0; h < H; ++h) {
    const SimHead& s = w.sim[seq][size_t(l * H + h)];
    auto keys = s.k_hat, values = s.v_hat;
    for (int j = 0; j < T; ++j) {
      keys.push_back(rotate_bf16(k.data() + size_t(j * H + h) * d, w.rk(l) + size_t(h) * d * d, d));
      values.push_back(rotate_bf16(v.data() + size_t(j * H + h) * d, w.rv(l) + size_t(h) * d * d, d));
    }
    for (int j = 0; j < T; ++j)
      for (int qh = h * r; qh < (h + 1) * r; ++qh) {
        const size_t off = size_t(j * n_heads + qh) * d;
        const auto want = naive_attention(rotate_query(q.data() + off, w.rk(l) + size_t(h) * d * d, d), keys, values,
                                          s.k.size() + size_t(j) + 1, w.rv(l) + size_t(h) * d * d, d, scale);
        EXPECT_LT(rel_err(out.data() + off, want), kAttentionTol) << "token " << j << " head " << qh;
      }
  }
}

struct Case {
  int key_group_tokens, value_group;
  bool mixed;
  bool widths = false;  // the blocks at mixed_widths, else 2 bits
  int key_pair_bytes = 4;
};
class PerChannelKeys : public ::testing::TestWithParam<Case> {};

// Chunks that cross the sink, fill the ring exactly, flush one page and several at once, in a
// batch, then a fork that diverges; then decode over every kind of length and prefill.
TEST_P(PerChannelKeys, AppendEqualsCodecAndAttentionEqualsFloat64) {
  const Case c = GetParam();
  const KvGeometry g = geometry(c.key_group_tokens, c.value_group, c.key_pair_bytes);
  World w(g, c.mixed, c.widths ? mixed_widths(g) : std::vector<BlockWidths>{});
  const int e = w.add(), a = w.add(), b = w.add(), s = w.add();
  w.append({a, b, s}, {5, 40, 20});
  w.append({a, b}, {35, 1});
  w.append({a}, {1});
  w.append({a, b}, {100, 3});
  const int f = w.fork(a);
  w.append({f, a}, {17, 64});
  ASSERT_GT(tiers_of(w.g, w.cache.length(a)).hist_tokens, 4 * w.g.page_tokens);
  for (int q : {a, b, f, s}) w.check_storage(q);
  check_decode(w, {e, s, b, a, f}, 4);
  check_prefill(w, a);
  check_prefill(w, s);
}

INSTANTIATE_TEST_SUITE_P(Layouts, PerChannelKeys,
                         // kivi's value groups are its group capped at d (cache_geometry), the mixed
                         // recipe's one group of d.
                         ::testing::Values(Case{16, 32, true},        // mixed: one key group a page
                                           Case{8, 32, true},         // mixed: two key groups a page
                                           Case{8, 8, false},         // kivi: two key groups, values in 4 groups
                                           Case{16, 16, false},       // kivi: one key group, values in 2 groups
                                           Case{16, 32, true, true},  // the bits-budget recipe's layout
                                           Case{8, 8, false, true},
                                           // 2-byte key pairs (key_params=e5m3, the kernels' pages)
                                           Case{16, 32, true, false, 2}, Case{8, 32, true, false, 2},
                                           Case{8, 8, false, false, 2}, Case{16, 32, true, true, 2}),
                         [](const auto& info) {
                           return "T" + std::to_string(info.param.key_group_tokens) + "_G" +
                                  std::to_string(info.param.value_group) + (info.param.mixed ? "_mixed" : "_kivi") +
                                  (info.param.widths ? "_widths" : "") +
                                  (info.param.key_pair_bytes == 2 ? "_e5m3" : "");
                         });

// Hand-worked sizes: at d = 128, P = T = 128 a (page, layer, head) block holds 2 × 128 × 32 code
// bytes, 128 key (scale, zero) pairs and 128 value pairs: 9216 bytes, 2.25 bits per element on each
// side, as kv_codec's history_bits says for the mixed recipe.
TEST(PerChannelKeysLayout, SizesAndOffsets) {
  KvGeometry g;
  g.n_layers = 1;
  g.n_kv_heads = 1;
  g.head_dim = g.group = 128;
  g.page_tokens = g.recent = 128;
  g.key_group_tokens = 128;
  EXPECT_EQ(g.k_params_bytes(), size_t(128 * 4));
  EXPECT_EQ(g.v_params_bytes(), size_t(128 * 4));
  EXPECT_EQ(g.page_head_bytes(), size_t(2 * 128 * 32 + 2 * 512));
  EXPECT_EQ(g.v_params_offset(), size_t(2 * 128 * 32 + 512));
  Recipe r;
  r.method = "kivi";
  r.group = r.page_size = 128;
  r.params["values"] = "hadamard";
  EXPECT_DOUBLE_EQ(8.0 * double(g.page_head_bytes()) / (2.0 * 128 * 128),
                   0.5 * (history_bits(r, KvSide::Key, 128) + history_bits(r, KvSide::Value, 128)));
  // Two key groups a page: twice the key pairs.
  g.key_group_tokens = 64;
  EXPECT_EQ(g.k_params_bytes(), size_t(2 * 128 * 4));
  EXPECT_EQ(g.page_head_bytes(), size_t(2 * 128 * 32 + 3 * 512));
  // 2-byte pairs (key_params=e5m3): 256 key parameter bytes, 2.125 bits per key element.
  g.key_group_tokens = 128;
  g.key_pair_bytes = 2;
  EXPECT_EQ(g.k_params_bytes(), size_t(128 * 2));
  EXPECT_EQ(g.page_head_bytes(), size_t(2 * 128 * 32 + 256 + 512));
  r.params["key_params"] = "e5m3";
  EXPECT_DOUBLE_EQ(history_bits(r, KvSide::Key, 128), 2.125);
  EXPECT_DOUBLE_EQ(8.0 * double(g.page_head_bytes()) / (2.0 * 128 * 128),
                   0.5 * (history_bits(r, KvSide::Key, 128) + history_bits(r, KvSide::Value, 128)));
  g.key_pair_bytes = 4;
  // Per-token keys are unchanged.
  g.key_group_tokens = 0;
  EXPECT_EQ(g.page_head_bytes(), size_t(2 * 128 * 32 + 2 * 512));
}

TEST(PerChannelKeysLayout, RefusalsByName) {
  KvGeometry g = geometry(12, 32);  // 12 does not divide the 16-token page
  EXPECT_CONTAINS(testing::error_of([&] {
                    KvCache(KvCacheConfig{g, 4, 1, PoolMemory::Host});
                  }),
                  "must divide the page of 16 tokens");
  // Eviction would move rows between pages whose key scales span their tokens.
  World w(geometry(16, 32), true);
  const int a = w.add();
  w.append({a}, {90});
  EXPECT_CONTAINS(testing::error_of([&] { compact_ref(w.cache, a, {0, 1, 2}, w.codecs.data()); }), "per-channel");
  EXPECT_EQ(w.cache.length(a), 90);
  w.check_storage(a);
}

}  // namespace
}  // namespace kvcc
