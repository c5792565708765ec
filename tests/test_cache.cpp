// CPU tests of the paged INT2 KV cache: allocator bookkeeping, the append reference against a
// token-by-token simulation that quantises with codec_scalar.h, and the decode / prefill
// references against a naive float64 attention over that simulation's contents.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <random>
#include <vector>

#include "formats/codec_scalar.h"
#include "formats/error.h"
#include "formats/fp16.h"
#include "formats/kv_layout.h"
#include "formats/kv_rotation.h"
#include "runtime/append_ref.h"
#include "runtime/attention_ref.h"
#include "runtime/kv_cache.h"
#include "cache_test_util.h"

namespace kvcc {
namespace {

KvGeometry small_geometry(int d = 32, int group = 32) {
  KvGeometry g;
  g.n_layers = 2;
  g.n_kv_heads = 2;
  g.head_dim = d;
  g.group = group;
  g.page_tokens = 16;
  g.sink = 8;
  g.recent = 32;
  return g;
}

using testing::random_rotations;

// What one (layer, head) of one sequence should hold, simulated token by token: every token's
// rotated BF16 row, and for each token whether it was quantised (and its decoded values).
struct SimHead {
  std::vector<std::vector<float>> k, v;          // rotated, BF16-rounded, per position
  std::vector<std::vector<float>> k_hat, v_hat;  // as stored (decoded), per position
  std::vector<std::vector<uint8_t>> k_codes, v_codes;
  std::vector<std::vector<uint16_t>> k_params, v_params;
  std::vector<int> ring;  // positions currently in the ring, oldest first
};

void sim_quantize(const KvGeometry& g, const SideCodec& c, const std::vector<float>& x, std::vector<uint8_t>& codes,
                  std::vector<uint16_t>& params, std::vector<float>& hat) {
  codes.assign(size_t(g.head_dim), 0);
  params.clear();
  hat.assign(size_t(g.head_dim), 0.0f);
  for (int grp = 0; grp < g.head_dim / g.group; ++grp) {
    const float* xs = x.data() + grp * g.group;
    uint8_t* cs = codes.data() + grp * g.group;
    GroupParams p = c.use_table ? quantize_table(xs, g.group, c.levels, 2, cs)
                                : quantize_uniform(xs, g.group, clip_threshold(xs, g.group, c.clip_ratio), 2, cs);
    params.push_back(p.scale);
    params.push_back(p.zero);
    for (int i = 0; i < g.group; ++i)
      hat[size_t(grp * g.group + i)] = c.use_table ? c.levels[cs[i]] * float_from_f16(p.scale)
                                                   : (float(cs[i]) - float_from_f16(p.zero)) * float_from_f16(p.scale);
  }
}

// Appends one token to the simulation: sink while short, else ring; a full ring first moves its
// P oldest tokens into history.
void sim_append(const KvGeometry& g, const HeadCodec& codec, SimHead& s, const std::vector<float>& kr,
                const std::vector<float>& vr) {
  const int pos = int(s.k.size());
  s.k.push_back(kr);
  s.v.push_back(vr);
  s.k_hat.push_back(kr);
  s.v_hat.push_back(vr);
  s.k_codes.emplace_back();
  s.v_codes.emplace_back();
  s.k_params.emplace_back();
  s.v_params.emplace_back();
  if (pos < g.sink) return;
  if (int(s.ring.size()) == g.recent) {
    for (int i = 0; i < g.page_tokens; ++i) {
      const int p = s.ring[size_t(i)];
      sim_quantize(g, codec.key, s.k[size_t(p)], s.k_codes[size_t(p)], s.k_params[size_t(p)], s.k_hat[size_t(p)]);
      sim_quantize(g, codec.value, s.v[size_t(p)], s.v_codes[size_t(p)], s.v_params[size_t(p)], s.v_hat[size_t(p)]);
    }
    s.ring.erase(s.ring.begin(), s.ring.begin() + g.page_tokens);
  }
  s.ring.push_back(pos);
}

// x·R as the cache stores it (append_ref.h: rotate_kv_row, the CUDA kernels' arithmetic;
// test_cache.cpp's RotateKvRow* tests check it against exact sums).
std::vector<float> rotate_bf16(const float* x, const float* rot, int d) {
  std::vector<float> out(static_cast<size_t>(d));
  const FixedRotation r = fixed_rotation(rot, d);
  rotate_kv_row(x, &r, d, out.data());
  return out;
}

struct World {
  KvGeometry g;
  KvCache cache;
  std::vector<float> rot_k, rot_v;          // [layers][H][d][d]
  std::vector<HeadCodec> codecs;            // [layers][H]
  std::map<int, std::vector<SimHead>> sim;  // seq -> [layers * H]
  std::mt19937 rng{1234};

  explicit World(const KvGeometry& geo, int64_t pages = 256, int seqs = 8)
      : g(geo), cache(KvCacheConfig{geo, pages, seqs, PoolMemory::Host}) {
    for (int l = 0; l < g.n_layers; ++l) {
      auto rk = random_rotations(g.n_kv_heads, g.head_dim, rng);
      auto rv = random_rotations(g.n_kv_heads, g.head_dim, rng);
      rot_k.insert(rot_k.end(), rk.begin(), rk.end());
      rot_v.insert(rot_v.end(), rv.begin(), rv.end());
      for (int h = 0; h < g.n_kv_heads; ++h) {
        HeadCodec c;
        c.key.clip_ratio = 0.9f + 0.05f * float(h);
        c.value.clip_ratio = 0.95f;
        codecs.push_back(c);
      }
    }
  }
  const float* rk(int l) const { return rot_k.data() + size_t(l) * g.n_kv_heads * g.head_dim * g.head_dim; }
  const float* rv(int l) const { return rot_v.data() + size_t(l) * g.n_kv_heads * g.head_dim * g.head_dim; }
  const HeadCodec* codec(int l) const { return codecs.data() + size_t(l) * g.n_kv_heads; }

  int add() {
    int s = cache.add_sequence();
    sim[s] = std::vector<SimHead>(size_t(g.n_layers * g.n_kv_heads));
    return s;
  }
  int fork(int parent) {
    int s = cache.fork(parent);
    sim[s] = sim[parent];
    return s;
  }
  // Appends counts[i] random tokens to seqs[i] on every layer, in the cache and the simulation.
  void append(const std::vector<int>& seqs, const std::vector<int>& counts) {
    std::vector<int64_t> old, add;
    for (size_t i = 0; i < seqs.size(); ++i) {
      old.push_back(cache.length(seqs[i]));
      add.push_back(counts[i]);
    }
    cache.grow_batch(seqs, add);
    AppendBatch batch = make_append_batch(seqs, old, counts);
    int rows = 0;
    for (int c : counts) rows += c;
    const int H = g.n_kv_heads, d = g.head_dim;
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (int l = 0; l < g.n_layers; ++l) {
      std::vector<float> k(size_t(rows * H * d)), v(k.size());
      for (size_t i = 0; i < k.size(); ++i) {
        k[i] = nd(rng) * (i % 7 == 0 ? 4.0f : 1.0f);  // a few outlier channels
        v[i] = nd(rng);
      }
      append_ref(cache, l, batch, k.data(), v.data(), rk(l), rv(l), codec(l));
      for (size_t i = 0; i < seqs.size(); ++i)
        for (int j = 0; j < counts[i]; ++j)
          for (int h = 0; h < H; ++h) {
            const size_t row = size_t(batch.row_offsets[i] + j);
            const float* kx = k.data() + (row * H + h) * d;
            const float* vx = v.data() + (row * H + h) * d;
            sim_append(g, codec(l)[h], sim[seqs[i]][size_t(l * H + h)], rotate_bf16(kx, rk(l) + size_t(h) * d * d, d),
                       rotate_bf16(vx, rv(l) + size_t(h) * d * d, d));
          }
    }
  }

  // Checks every stored byte of seq against the simulation.
  void check_storage(int seq) {
    const int H = g.n_kv_heads, d = g.head_dim;
    const int64_t n = cache.length(seq);
    const KvTiers t = tiers_of(g, n);
    for (int l = 0; l < g.n_layers; ++l)
      for (int h = 0; h < H; ++h) {
        const SimHead& s = sim[seq][size_t(l * H + h)];
        ASSERT_EQ(int64_t(s.k.size()), n);
        const uint16_t* win = cache.windows_base() + g.window_block_elem(seq, l, h);
        for (int64_t pos = 0; pos < n; ++pos) {
          const bool quantised = !s.k_codes[size_t(pos)].empty();
          const int64_t post = pos - t.sink_count;
          ASSERT_EQ(quantised, pos >= t.sink_count && post < t.hist_tokens) << "pos " << pos;
          if (quantised) {
            const int32_t page = cache.page_table(seq)[size_t(post / g.page_tokens)];
            const uint8_t* blk = cache.pages_base() + g.page_block_offset(page, l, h);
            const size_t row = size_t(post % g.page_tokens);
            for (int side = 0; side < 2; ++side) {
              const auto& codes = side ? s.v_codes[size_t(pos)] : s.k_codes[size_t(pos)];
              const auto& params = side ? s.v_params[size_t(pos)] : s.k_params[size_t(pos)];
              const uint8_t* crow = blk + (side ? g.v_codes_offset() : g.k_codes_offset()) + row * size_t(d / 4);
              for (int c = 0; c < d; ++c)
                ASSERT_EQ((crow[c / 4] >> (2 * (c % 4))) & 3, codes[size_t(c)]) << "pos " << pos << " ch " << c;
              const uint16_t* prm =
                  reinterpret_cast<const uint16_t*>(blk + (side ? g.v_params_offset() : g.k_params_offset())) +
                  row * 2 * size_t(g.groups());
              for (size_t i = 0; i < params.size(); ++i) ASSERT_EQ(prm[i], params[i]);
            }
          } else {
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
  }
};

// Naive float64 attention of rotated query rows over a simulated head, output rotated back.
std::vector<double> naive_attention(const std::vector<double>& q_rot, const std::vector<std::vector<float>>& keys,
                                    const std::vector<std::vector<float>>& values, size_t n, const float* rot_v, int d,
                                    double scale) {
  std::vector<double> out(static_cast<size_t>(d), 0.0);
  if (n == 0) return out;
  std::vector<double> s(n);
  double mx = -1e300;
  for (size_t j = 0; j < n; ++j) {
    s[j] = 0;
    for (int c = 0; c < d; ++c) s[j] += q_rot[size_t(c)] * keys[j][size_t(c)];
    s[j] *= scale;
    mx = std::max(mx, s[j]);
  }
  double l = 0;
  std::vector<double> o(static_cast<size_t>(d), 0.0);
  for (size_t j = 0; j < n; ++j) {
    const double p = std::exp(s[j] - mx);
    l += p;
    for (int c = 0; c < d; ++c) o[size_t(c)] += p * values[j][size_t(c)];
  }
  for (int i = 0; i < d; ++i)
    for (int j = 0; j < d; ++j) out[size_t(j)] += o[size_t(i)] / l * rot_v[size_t(j * d + i)];
  return out;
}

std::vector<double> rotate_query(const float* q, const float* rot, int d) {
  std::vector<double> out(static_cast<size_t>(d), 0.0);
  for (int j = 0; j < d; ++j)
    for (int i = 0; i < d; ++i) out[size_t(j)] += double(q[i]) * rot[size_t(i * d + j)];
  return out;
}

double rel_err(const std::vector<float>& got, const std::vector<double>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

__extension__ typedef __int128 Int128;  // exact sums for the rotation's oracle (GCC and Clang)

// The nearest bf16 to t·2^s (t an exact integer sum, |t| < 2^60), found another way than
// kv_rotation.h's round to odd: the bf16 values around a long double estimate, their distances
// to t·2^s compared exactly as integers in units of 2^(s − 8) (below any candidate's last bit).
float nearest_bf16_exact(Int128 t, int s) {
  if (t == 0) return 0.0f;
  const uint16_t guess = bf16_from_float(float(std::ldexp(static_cast<long double>(t), s)));
  float best = 0.0f;
  Int128 best_dist = -1;
  for (int step = -2; step <= 2; ++step) {
    const float c = float_from_bf16(uint16_t(int(guess) + step));  // same sign: steps of |value|
    if (!std::isfinite(c) || c == 0.0f || (c < 0) != (t < 0)) continue;
    int e = 0;
    const Int128 m = Int128(std::ldexp(std::frexp(c, &e), 8));  // c = m·2^(e − 8), |m| < 2^8
    if (e - s < 0) continue;  // below 2^s: not a neighbour of an integer multiple of 2^s >= 2^s
    const Int128 diff = (t << 8) - (m << (e - s));
    const Int128 dist = diff < 0 ? -diff : diff;
    if (best_dist < 0 || dist < best_dist || (dist == best_dist && (bf16_from_float(c) & 1) == 0)) {
      best = c;
      best_dist = dist;
    }
  }
  return best;
}

// The stored rotation (formats/kv_rotation.h): column j of R and the row x in fixed point, the sum
// exact, rounded once to BF16. Checked against a second computation of the same definition (the
// fixed points from a loop over exponents, the sum in Int128, the rounding by exact comparison
// of the bf16 neighbours), against the float64 product (within half a BF16 step plus what the
// fixed points drop), exact for permutations of bf16 rows, NaN rows for non-finite inputs.
TEST(CacheAppend, RotateKvRowIsTheExactFixedPointSum) {
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  for (const int d : {32, 128}) {
    std::vector<float> x(static_cast<size_t>(d)), R(static_cast<size_t>(d * d)), out(static_cast<size_t>(d));
    for (int trial = 0; trial < 20; ++trial) {
      for (int i = 0; i < d; ++i) x[size_t(i)] = nd(rng) * (i % 9 == 0 ? 20.0f : 1.0f) * (trial % 2 ? 1e-3f : 1.0f);
      for (auto& v : R) v = nd(rng) / std::sqrt(float(d));
      const FixedRotation f = fixed_rotation(R.data(), d);
      rotate_kv_row(x.data(), &f, d, out.data());
      auto exponent_above = [](double a) {  // e with a < 2^e <= 2a (a > 0)
        int e = -200;
        while (std::ldexp(1.0, e) <= a) ++e;
        return e;
      };
      double xmax = 0;
      for (float v : x) xmax = std::max(xmax, double(std::fabs(v)));
      const int ex = exponent_above(xmax);
      for (int j = 0; j < d; ++j) {
        double cmax = 0;
        for (int i = 0; i < d; ++i) cmax = std::max(cmax, double(std::fabs(R[size_t(i) * d + size_t(j)])));
        const int ej = exponent_above(cmax);
        Int128 t = 0;
        double real = 0, dropped = 0;
        for (int i = 0; i < d; ++i) {
          const double r = R[size_t(i) * d + size_t(j)];
          const int64_t X = std::llrint(std::ldexp(double(x[size_t(i)]), 22 - ex));
          const int64_t Q = std::llrint(std::ldexp(r, 14 - ej));
          ASSERT_LE(std::llabs(X), int64_t(1) << 22);
          ASSERT_LE(std::llabs(Q), int64_t(1) << 14);
          t += Int128(X) * Q;
          real += double(x[size_t(i)]) * r;
          dropped += std::ldexp(std::fabs(r), ex - 23) + std::ldexp(std::fabs(double(x[size_t(i)])), ej - 15);
        }
        ASSERT_EQ(out[size_t(j)], nearest_bf16_exact(t, ex + ej - 36)) << "d " << d << " trial " << trial << " j " << j;
        EXPECT_LE(std::fabs(double(out[size_t(j)]) - real), std::ldexp(std::fabs(real), -8) + dropped * 1.0001) << j;
      }
    }
    // A permutation of bf16 values within 2^14 of the row's largest: exact.
    std::vector<float> P(size_t(d) * size_t(d), 0.0f);
    for (int j = 0; j < d; ++j) P[size_t((j * 37 + 5) % d) * d + size_t(j)] = 1.0f;
    for (int i = 0; i < d; ++i) {
      const float v = nd(rng);
      x[size_t(i)] = round_bf16(std::copysign(std::max(std::fabs(v), 1e-3f), v));
    }
    const FixedRotation fp = fixed_rotation(P.data(), d);
    rotate_kv_row(x.data(), &fp, d, out.data());
    for (int j = 0; j < d; ++j) EXPECT_EQ(out[size_t(j)], x[size_t((j * 37 + 5) % d)]) << j;
    rotate_kv_row(x.data(), nullptr, d, out.data());
    for (int j = 0; j < d; ++j) EXPECT_EQ(out[size_t(j)], round_bf16(x[size_t(j)])) << j;
    // Below the fixed point's last bit (2^(e_x − 22)) an element is dropped: (1 + 2^-8, 2^-25, ..)
    // summed by a column of ones is 1 + 2^-8 exactly, a tie that BF16 rounds to 1 (the float64 sum
    // lies above it: 1 + 2^-7).
    std::vector<float> tiny(size_t(d), std::ldexp(1.0f, -25)), ones(size_t(d) * size_t(d), 0.0f);
    tiny[0] = 1.0f + std::ldexp(1.0f, -8);
    for (int i = 0; i < d; ++i) ones[size_t(i) * d] = 1.0f;
    const FixedRotation fo = fixed_rotation(ones.data(), d);
    rotate_kv_row(tiny.data(), &fo, d, out.data());
    EXPECT_EQ(out[0], 1.0f);
    // Just above that tie by 2^-34, below float32's last bit: the one rounding sees it (1 + 2^-7),
    // where rounding to float32 first would make the tie again. x = (1 + 2^-8, 2^-21, 0, ..) and
    // column 0 of R = (1, 2^-13, 0, ..) are exact in fixed point (X_1 = 1, Rq_10 = 1).
    std::vector<float> near(size_t(d), 0.0f), col(size_t(d) * size_t(d), 0.0f);
    near[0] = 1.0f + std::ldexp(1.0f, -8);
    near[1] = std::ldexp(1.0f, -21);
    col[0] = 1.0f;
    col[size_t(d)] = std::ldexp(1.0f, -13);
    const FixedRotation fc = fixed_rotation(col.data(), d);
    rotate_kv_row(near.data(), &fc, d, out.data());
    EXPECT_EQ(out[0], 1.0f + std::ldexp(1.0f, -7));
    // Non-finite rows rotate to NaN everywhere; a zero row to zeros.
    x[size_t(d / 2)] = std::numeric_limits<float>::infinity();
    rotate_kv_row(x.data(), &fp, d, out.data());
    for (int j = 0; j < d; ++j) EXPECT_TRUE(std::isnan(out[size_t(j)])) << j;
    std::fill(x.begin(), x.end(), 0.0f);
    rotate_kv_row(x.data(), &fp, d, out.data());
    for (int j = 0; j < d; ++j) EXPECT_EQ(out[size_t(j)], 0.0f) << j;
  }
  std::vector<float> bad(32 * 32, 0.0f);
  bad[5] = std::nanf("");
  EXPECT_THROW(fixed_rotation(bad.data(), 32), Error);
}

// rot_bf16 (integer rounding of t·2^s to bf16) against the nearest of the bf16 values around it,
// measured in long double (exact here: |t| < 2^40 and the candidates' bits lie within 64 bits of
// t's), across normal, subnormal, zero and overflowing results.
TEST(CacheAppend, RotBf16IsTheNearestBf16) {
  std::mt19937_64 rng(5);
  for (int trial = 0; trial < 200000; ++trial) {
    const int bits = 1 + int(rng() % 40);
    int64_t t = int64_t(rng() >> (64 - bits)) | (int64_t(1) << (bits - 1));
    if (trial % 7 == 0) t |= 0xff;  // long runs of ones: carries into the exponent
    if (rng() & 1) t = -t;
    const int s = int(rng() % 320) - 200;  // results from below the subnormals to above the largest
    const long double v = std::ldexp(static_cast<long double>(t), s);
    const uint16_t got = rot_bf16(t, s);
    // The candidates: the bf16 below |v| (truncation of its float value toward zero) and the next.
    const long double av = std::fabs(v);
    if (av >= std::ldexp(1.0L, 128)) {
      ASSERT_EQ(got & 0x7fffu, 0x7f80u) << t << " " << s;
      continue;
    }
    float f = static_cast<float>(av);
    if (static_cast<long double>(f) > av) f = std::nextafter(f, 0.0f);
    const uint16_t lo = uint16_t(f32_bits(f) >> 16), hi = uint16_t(lo + 1);
    const long double dlo = av - static_cast<long double>(float_from_bf16(lo));
    // (IEEE rounding to nearest: beyond the largest bf16 by half a step or more gives inf, as if
    // the next value were 2^128)
    const long double dhi =
        (hi == 0x7f80u ? std::ldexp(1.0L, 128) : static_cast<long double>(float_from_bf16(hi))) - av;
    const uint16_t want = (dlo < dhi || (dlo == dhi && (lo & 1) == 0)) ? lo : hi;
    ASSERT_EQ(got, uint16_t(want | (t < 0 ? 0x8000u : 0u))) << "t " << t << " s " << s;
  }
  EXPECT_EQ(rot_bf16(0, -30), 0u);
}

TEST(CacheLayout, TiersMatchTokenByTokenRing) {
  KvGeometry g = small_geometry();
  int sink = 0, ring = 0, hist = 0;
  for (int64_t n = 0; n <= 400; ++n) {
    const KvTiers t = tiers_of(g, n);
    EXPECT_EQ(t.sink_count, sink) << n;
    EXPECT_EQ(t.ring_count, ring) << n;
    EXPECT_EQ(t.hist_tokens, hist) << n;
    EXPECT_EQ(t.sink_count + t.hist_tokens + t.ring_count, n);
    if (sink < g.sink) {
      ++sink;
    } else {
      if (ring == g.recent) {
        ring -= g.page_tokens;
        hist += g.page_tokens;
      }
      ++ring;
    }
  }
}

TEST(CacheLayout, PageAndSlotSizes) {
  KvGeometry g = small_geometry(64, 32);
  // Per (layer, head): K and V codes 16 tokens × 16 bytes, params 16 tokens × 2 groups × 4 bytes.
  EXPECT_EQ(g.page_head_bytes(), size_t(2 * 16 * 16 + 2 * 16 * 2 * 4));
  EXPECT_EQ(g.page_bytes(), g.page_head_bytes() * 4);
  EXPECT_EQ(g.window_slot_bytes(), size_t(2 * (8 + 32) * 64 * 2 * 4));
  uint8_t codes[8] = {0, 1, 2, 3, 3, 2, 1, 0}, row[2];
  pack_codes(codes, 8, row);
  EXPECT_EQ(row[0], 0b11100100);
  EXPECT_EQ(row[1], 0b00011011);
  for (int c = 0; c < 8; ++c) EXPECT_EQ(unpack_code(row, 8, c), codes[c]);
}

TEST(CacheAllocator, AccountingForkFreeAndOutOfMemory) {
  KvGeometry g = small_geometry();
  KvCache cache(KvCacheConfig{g, 6, 3, PoolMemory::Host});
  const size_t page = size_t(2 * 16 * 8 + 2 * 16 * 4) * 4;  // bytes per page, all layers/heads
  const size_t slot = size_t(2 * (8 + 32) * 32 * 2) * 4;    // bytes per window slot
  EXPECT_EQ(cache.bytes_in_use(), 0u);
  const int a = cache.add_sequence();
  EXPECT_EQ(cache.bytes_in_use(), slot);
  // 8 sink + 32 ring + 1 → one flush of a 16-token page.
  EXPECT_EQ(cache.grow(a, 41).size(), 1u);
  EXPECT_EQ(cache.pages_in_use(), 1);
  EXPECT_EQ(cache.grow(a, 16).size(), 1u);  // 57 tokens: 49 post-sink → 2 pages
  EXPECT_EQ(cache.bytes_in_use(), slot + 2 * page);
  const int b = cache.fork(a);
  EXPECT_EQ(cache.length(b), 57);
  EXPECT_EQ(cache.page_table(b), cache.page_table(a));
  EXPECT_EQ(cache.page_refcount(cache.page_table(a)[0]), 2);
  EXPECT_EQ(cache.bytes_in_use(), 2 * slot + 2 * page);  // shared pages counted once
  EXPECT_EQ(cache.grow(b, 16).size(), 1u);
  EXPECT_NE(cache.page_table(b).back(), cache.page_table(a).back());
  EXPECT_EQ(cache.pages_in_use(), 3);
  // Out of pages: needs 4 more (64 tokens), only 3 free. Nothing changes.
  EXPECT_THROW(cache.grow(a, 64), Error);
  EXPECT_EQ(cache.length(a), 57);
  EXPECT_EQ(cache.pages_in_use(), 3);
  EXPECT_EQ(cache.page_table(a).size(), 2u);
  // All or nothing across a batch.
  EXPECT_THROW(cache.grow_batch({a, b}, {32, 32}), Error);
  EXPECT_EQ(cache.length(b), 73);
  // Out of slots.
  cache.add_sequence();
  EXPECT_THROW(cache.add_sequence(), Error);
  EXPECT_THROW(cache.fork(a), Error);
  cache.free_sequence(a);
  EXPECT_EQ(cache.page_refcount(cache.page_table(b)[0]), 1);
  EXPECT_EQ(cache.pages_in_use(), 3);  // b still holds a's two pages and its own
  cache.free_sequence(b);
  EXPECT_EQ(cache.pages_in_use(), 0);
  EXPECT_EQ(cache.bytes_in_use(), slot);
  EXPECT_THROW(cache.length(a), Error);
  EXPECT_THROW(cache.free_sequence(a), Error);
}

// Chunks that cross the sink, fill the ring exactly, and flush one and several pages at once.
void check_packs_codec_codes(const KvGeometry& g) {
  World w(g);
  const int a = w.add(), b = w.add();
  w.append({a, b}, {5, 40});
  w.append({a, b}, {35, 1});
  w.append({a}, {1});
  w.append({a, b}, {100, 3});
  const int c = w.fork(a);
  w.append({c, a}, {17, 64});
  for (int s : {a, b, c}) w.check_storage(s);
}

TEST(CacheAppend, PacksExactlyTheCodecCodes) { check_packs_codec_codes(small_geometry()); }

// A host pool serves any head_dim the layout can hold (code rows of head_dim/4 bytes): head_dim 8
// (llama2.c's stories260K, kvcc demo's model) with one group per row and with two groups of 4,
// and head_dim 12 (rows of 3 bytes).
TEST(CacheAppend, SmallHeadDimsPackExactlyTheCodecCodes) {
  check_packs_codec_codes(small_geometry(8, 8));
  check_packs_codec_codes(small_geometry(8, 4));
  check_packs_codec_codes(small_geometry(12, 4));
}

// head_dim 64 and 256 (models outside the GPU kernels' 128), one group per row.
TEST(CacheAppend, HeadDims64And256PackExactlyTheCodecCodes) {
  check_packs_codec_codes(small_geometry(64, 64));
  check_packs_codec_codes(small_geometry(256, 256));
}

TEST(CacheAppend, GroupsAndLevelTable) {
  World w(small_geometry(64, 16));
  for (auto& c : w.codecs) {
    c.value.use_table = 1;  // Lloyd–Max levels of a unit Gaussian, in RMS units
    const float lv[4] = {-1.5104f, -0.4528f, 0.4528f, 1.5104f};
    std::copy(lv, lv + 4, c.value.levels);
  }
  const int a = w.add();
  w.append({a}, {130});
  w.append({a}, {33});
  w.check_storage(a);
}

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
        auto qr = rotate_query(q.data() + off, w.rk(l) + size_t(h) * d * d, d);
        auto want = naive_attention(qr, s.k_hat, s.v_hat, s.k.size(), w.rv(l) + size_t(h) * d * d, d, scale);
        std::vector<float> got(out.begin() + long(off), out.begin() + long(off + d));
        if (s.k.empty()) {
          for (float x : got) EXPECT_EQ(x, 0.0f);
        } else {
          EXPECT_LT(rel_err(got, want), 1e-5) << "seq " << seqs[b] << " len " << s.k.size() << " head " << qh;
        }
      }
  }
}

// Lengths: empty; inside the sink; ring partly filled (no history); ring exactly full;
// one page of history; many pages; a fork that diverged (small_geometry's windows).
void check_decode_mixed_lengths(const KvGeometry& g) {
  World w(g);
  const int e = w.add(), s1 = w.add(), s2 = w.add(), s3 = w.add(), s4 = w.add(), s5 = w.add();
  w.append({s1, s2, s3, s4, s5}, {5, 20, 40, 41, 300});
  const int f = w.fork(s5);
  w.append({f, s5}, {9, 70});
  ASSERT_EQ(tiers_of(w.g, 40).ring_count, w.g.recent);
  ASSERT_EQ(tiers_of(w.g, 40).hist_tokens, 0);
  ASSERT_GT(tiers_of(w.g, 300).hist_tokens, 0);
  check_decode(w, {e, s1, s2, s3, s4, s5, f}, 8);
}

TEST(CacheDecode, MatchesFloat64OnMixedLengths) { check_decode_mixed_lengths(small_geometry()); }

TEST(CacheDecode, SmallHeadDimsMatchFloat64OnMixedLengths) {
  check_decode_mixed_lengths(small_geometry(8, 8));
  check_decode_mixed_lengths(small_geometry(8, 4));
}

TEST(CacheDecode, HeadDims64And256MatchFloat64OnMixedLengths) {
  check_decode_mixed_lengths(small_geometry(64, 64));
  check_decode_mixed_lengths(small_geometry(256, 256));
}

TEST(CacheDecode, GroupsAndLevelTableAndWideGroups) {
  World w(small_geometry(64, 32));
  for (auto& c : w.codecs) {
    c.key.use_table = 1;
    const float lv[4] = {-1.6f, -0.5f, 0.45f, 1.5f};
    std::copy(lv, lv + 4, c.key.levels);
  }
  const int a = w.add(), b = w.add();
  w.append({a, b}, {200, 77});
  check_decode(w, {b, a}, 6);
}

void check_prefill_causal(const KvGeometry& geometry) {
  World w(geometry);
  const KvGeometry& g = w.g;
  const int a = w.add();
  w.append({a}, {90});
  const int T = 37, n_heads = 4, d = g.head_dim, H = g.n_kv_heads, r = n_heads / H;
  std::normal_distribution<float> nd;
  std::vector<float> q(size_t(T * n_heads * d)), k(size_t(T * H * d)), v(k.size()), out(q.size());
  for (auto& x : q) x = nd(w.rng);
  for (auto& x : k) x = nd(w.rng);
  for (auto& x : v) x = nd(w.rng);
  const double scale = 1.0 / std::sqrt(double(d));
  const int l = 1;
  prefill_ref(w.cache, l, a, T, q.data(), k.data(), v.data(), n_heads, w.rk(l), w.rv(l), w.codec(l), float(scale),
              out.data());
  for (int h = 0; h < H; ++h) {
    const SimHead& s = w.sim[a][size_t(l * H + h)];
    auto keys = s.k_hat, values = s.v_hat;
    for (int j = 0; j < T; ++j) {
      keys.push_back(rotate_bf16(k.data() + size_t(j * H + h) * d, w.rk(l) + size_t(h) * d * d, d));
      values.push_back(rotate_bf16(v.data() + size_t(j * H + h) * d, w.rv(l) + size_t(h) * d * d, d));
    }
    for (int j = 0; j < T; ++j)
      for (int qh = h * r; qh < (h + 1) * r; ++qh) {
        const size_t off = size_t(j * n_heads + qh) * d;
        auto qr = rotate_query(q.data() + off, w.rk(l) + size_t(h) * d * d, d);
        auto want =
            naive_attention(qr, keys, values, s.k.size() + size_t(j) + 1, w.rv(l) + size_t(h) * d * d, d, scale);
        std::vector<float> got(out.begin() + long(off), out.begin() + long(off + d));
        EXPECT_LT(rel_err(got, want), 1e-5) << "token " << j << " head " << qh;
      }
  }
}

TEST(CachePrefill, MatchesFloat64Causal) { check_prefill_causal(small_geometry()); }

TEST(CachePrefill, SmallHeadDimsMatchFloat64Causal) {
  check_prefill_causal(small_geometry(8, 8));
  check_prefill_causal(small_geometry(8, 4));
}

TEST(CachePrefill, HeadDims64And256MatchFloat64Causal) {
  check_prefill_causal(small_geometry(64, 64));
  check_prefill_causal(small_geometry(256, 256));
}

}  // namespace
}  // namespace kvcc
