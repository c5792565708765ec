#include "formats/kv_codec.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "formats/codec_commvq.h"
#include "formats/codec_scalar.h"
#include "formats/error.h"
#include "formats/kv_layout.h"
#include "formats/method.h"

namespace kvcc {

namespace {

const NamedArray* find_extra(const SideArtifact& side, const std::string& name) {
  for (const NamedArray& a : side.extras)
    if (a.name == name) return &a;
  return nullptr;
}

std::string param(const Recipe& recipe, const std::string& key, const std::string& fallback) {
  auto it = recipe.params.find(key);
  return it == recipe.params.end() ? fallback : it->second;
}

// `d` is the width of the rows being coded: head_dim, or span·head_dim for a group that spans
// several KV heads (roundtrip_layer_page concatenates the heads' rotated rows).
int channel_group(const Recipe& recipe, int d) {
  const int g = recipe.group > 0 ? recipe.group : d;
  KVCC_REQUIRE(g <= d && d % g == 0, "recipe group " + std::to_string(g) + " must divide the coded row width " +
                                         std::to_string(d) + " (head_dim, or the heads a spanning group covers)");
  return g;
}

// KIVI's value groups: G channels, capped at head_dim (G = 32 on a head_dim-16 model is one group
// per token).
int kivi_value_group(const Recipe& recipe, int d) {
  if (recipe.group <= 0 || recipe.group >= d) return d;
  return channel_group(recipe, d);
}

std::vector<float> to_float(const std::vector<double>& v) { return std::vector<float>(v.begin(), v.end()); }

// Level-table codec on one group (codec_scalar.h), writing the dequantised values.
void table_roundtrip(const float* y, int g, const std::vector<float>& levels, int bits, float* out) {
  uint8_t codes[1024];
  std::vector<uint8_t> big;
  uint8_t* c = codes;
  if (g > 1024) {
    big.resize(static_cast<size_t>(g));
    c = big.data();
  }
  const GroupParams p = quantize_table(y, g, levels.data(), bits, c);
  const float s = float_from_f16(p.scale);
  for (int i = 0; i < g; ++i) out[i] = table_dequant(c[i], s, levels.data());
}

// Uniform codec on `g` values gathered with a stride (KIVI's per-channel keys use stride d).
void uniform_roundtrip_strided(const float* x, int g, int stride, double clip_ratio, int bits, float* out) {
  float buf[1024];
  std::vector<float> big;
  float* v = buf;
  if (g > 1024) {
    big.resize(static_cast<size_t>(g));
    v = big.data();
  }
  for (int i = 0; i < g; ++i) v[i] = x[size_t(i) * stride];
  const float thr = clip_ratio >= 1.0 ? std::numeric_limits<float>::infinity() : clip_threshold(v, g, clip_ratio);
  uint8_t codes[1024];
  std::vector<uint8_t> bigc;
  uint8_t* c = codes;
  if (g > 1024) {
    bigc.resize(static_cast<size_t>(g));
    c = bigc.data();
  }
  const GroupParams p = quantize_uniform(v, g, thr, bits, c);
  const float s = float_from_f16(p.scale), z = float_from_f16(p.zero);
  for (int i = 0; i < g; ++i) out[size_t(i) * stride] = uniform_dequant(c[i], s, z);
}

// KIVI's per-channel keys with key_params=e5m3: one channel's g values (stride apart), the pair in
// two bytes (codec_scalar.h ChanParams), as the runtime's per-channel key pages hold them.
void chan_roundtrip_strided(const float* x, int g, int stride, int bits, float* out) {
  std::vector<uint8_t> c(static_cast<size_t>(g));
  const ChanParams p = quantize_chan(x, g, stride, bits, c.data());
  const float s = p.scale_value(), z = p.zero_value();
  for (int i = 0; i < g; ++i) out[size_t(i) * stride] = uniform_dequant(c[size_t(i)], s, z);
}

std::vector<float> checked_levels(const std::vector<double>& levels, int bits, const char* what) {
  KVCC_REQUIRE(int(levels.size()) == (1 << bits), std::string("artifact: ") + what + " has " +
                                                      std::to_string(levels.size()) + " levels, expected " +
                                                      std::to_string(1 << bits));
  return to_float(levels);
}

void turboquant_roundtrip(const Recipe& recipe, const SideArtifact& side, KvSide which, int d, const float* y, int n,
                          float* out) {
  const bool prod = param(recipe, "variant", "mse") == "prod";
  const double nominal = side_nominal_bits(recipe, which);
  const NamedArray* split = find_extra(side, "split");
  const int n_hi = split && !split->data.empty() ? int(split->data[0]) : 0;
  KVCC_REQUIRE(n_hi >= 0 && n_hi < d, "artifact: turboquant split out of range");
  const int b_lo = int(std::floor(nominal)) - (prod ? 1 : 0);
  KVCC_REQUIRE(b_lo >= 1 || (prod && b_lo >= 0), "turboquant needs at least 1 bit per coordinate");
  std::vector<float> lo_levels, hi_levels;
  if (b_lo > 0) lo_levels = checked_levels(side.levels, b_lo, "turboquant levels");
  if (n_hi > 0) {
    const NamedArray* hi = find_extra(side, "outlier_levels");
    KVCC_REQUIRE(hi != nullptr, "artifact: turboquant split without outlier_levels");
    hi_levels = checked_levels(hi->data, b_lo + 1, "turboquant outlier_levels");
  }
  std::vector<float> s_mat;
  if (prod) {
    const NamedArray* s = find_extra(side, "qjl_matrix");
    KVCC_REQUIRE(s != nullptr && s->data.size() == size_t(d) * d,
                 "artifact: turboquant prod needs a [d, d] qjl_matrix");
    s_mat = to_float(s->data);
  }
  const double qjl_scale = std::sqrt(M_PI / 2.0) / double(d);
  std::vector<float> resid(static_cast<size_t>(d));
  std::vector<int8_t> signs(static_cast<size_t>(d));
  for (int t = 0; t < n; ++t) {
    const float* yr = y + size_t(t) * d;
    float* o = out + size_t(t) * d;
    if (n_hi > 0) table_roundtrip(yr, n_hi, hi_levels, b_lo + 1, o);
    if (b_lo > 0) table_roundtrip(yr + n_hi, d - n_hi, lo_levels, b_lo, o + n_hi);
    else std::fill(o + n_hi, o + d, 0.0f);
    if (!prod) continue;
    double norm2 = 0.0;
    for (int i = 0; i < d; ++i) {
      resid[size_t(i)] = yr[i] - o[i];
      norm2 += double(resid[size_t(i)]) * resid[size_t(i)];
    }
    const double gamma = double(round_f16(float(std::sqrt(norm2))));
    for (int a = 0; a < d; ++a) {
      double proj = 0.0;
      for (int i = 0; i < d; ++i) proj += double(s_mat[size_t(a) * d + i]) * resid[size_t(i)];
      signs[size_t(a)] = proj >= 0.0 ? 1 : -1;
    }
    for (int i = 0; i < d; ++i) {
      double back = 0.0;
      for (int a = 0; a < d; ++a) back += double(s_mat[size_t(a) * d + i]) * signs[size_t(a)];
      o[i] = float(double(o[i]) + qjl_scale * gamma * back);
    }
  }
}

void kvarn_roundtrip(const Recipe& recipe, KvSide which, int d, const float* y, int n, float* out) {
  const int bits = side_code_bits(recipe, which);
  const int iterations = std::stoi(param(recipe, "iterations", "8"));
  // Keys: tile [d, n] (rows = channels); values: [n, d] (rows = tokens).
  const int rows = which == KvSide::Key ? d : n, cols = which == KvSide::Key ? n : d;
  std::vector<float> tile(size_t(rows) * cols);
  for (int t = 0; t < n; ++t)
    for (int c = 0; c < d; ++c) {
      const float v = y[size_t(t) * d + c];
      if (which == KvSide::Key) tile[size_t(c) * cols + t] = v;
      else tile[size_t(t) * cols + c] = v;
    }
  const BalanceScales s = kvarn_balance(tile.data(), rows, cols, iterations);
  std::vector<float> balanced(static_cast<size_t>(cols)), deq(static_cast<size_t>(cols));
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < cols; ++c)
      balanced[size_t(c)] = tile[size_t(r) * cols + c] / s.row[size_t(r)] / s.col[size_t(c)];
    uniform_roundtrip_strided(balanced.data(), cols, 1, 1.0, bits, deq.data());
    for (int c = 0; c < cols; ++c) tile[size_t(r) * cols + c] = deq[size_t(c)] * s.row[size_t(r)] * s.col[size_t(c)];
  }
  for (int t = 0; t < n; ++t)
    for (int c = 0; c < d; ++c)
      out[size_t(t) * d + c] = which == KvSide::Key ? tile[size_t(c) * cols + t] : tile[size_t(t) * cols + c];
}

// Unbiased standard deviations of the rows (axis 1) or columns of C = T / s_r / s_c.
void scaled_stds(const float* t, int rows, int cols, const std::vector<double>& lr, const std::vector<double>& lc,
                 bool of_columns, std::vector<double>& out) {
  const int n_out = of_columns ? cols : rows, n_in = of_columns ? rows : cols;
  out.assign(size_t(n_out), 1.0);
  if (n_in < 2) return;
  std::vector<double> sum(size_t(n_out), 0.0), sum2(size_t(n_out), 0.0);
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) {
      const double v = double(t[size_t(r) * cols + c]) * std::exp(-lr[size_t(r)] - lc[size_t(c)]);
      const size_t k = size_t(of_columns ? c : r);
      sum[k] += v;
      sum2[k] += v * v;
    }
  for (int k = 0; k < n_out; ++k) {
    const double mean = sum[size_t(k)] / n_in;
    const double var = std::max(0.0, (sum2[size_t(k)] - n_in * mean * mean) / (n_in - 1));
    out[size_t(k)] = std::clamp(std::sqrt(var), 1e-3, 1e3);
  }
}

double ratio(const std::vector<double>& s) {
  const auto [mn, mx] = std::minmax_element(s.begin(), s.end());
  return *mx / std::max(*mn, 1e-8);
}

}  // namespace

const char* kv_side_name(KvSide side) { return side == KvSide::Key ? "key" : "value"; }

bool e5m3_key_pairs(const Recipe& recipe) { return param(recipe, "key_params", "fp16") == "e5m3"; }

Recipe side_recipe(const Recipe& recipe, KvSide side) {
  const auto it = recipe.params.find("values");
  if (side != KvSide::Value || it == recipe.params.end() || method_of(recipe) != Method::Kivi) return recipe;
  // The table's choices: a rotated per-token grid.
  const std::vector<std::string> problems = method_param_problems(Method::Kivi, {{"values", it->second}});
  KVCC_REQUIRE(problems.empty(), problems.empty() ? "" : problems.front());
  Recipe r = recipe;
  r.method = it->second;
  r.group = 0;  // kivi's group counts key tokens; the value grid is per token over head_dim
  r.params.clear();
  return r;
}

double side_nominal_bits(const Recipe& recipe, KvSide side) {
  return side == KvSide::Key ? recipe.key_bits : recipe.value_bits;
}

int side_code_bits(const Recipe& recipe, KvSide side) {
  const double b = side_nominal_bits(recipe, side);
  const int bits = int(std::floor(b));
  KVCC_REQUIRE(bits >= 1 && bits <= 8, "bits per element must be between 1 and 8, got " + std::to_string(b));
  KVCC_REQUIRE(double(bits) == b || method_traits(method_of(recipe)).fractional_bits,
               "fractional bits (" + std::to_string(b) + ") need --method " +
                   method_names([](const MethodTraits& t) { return t.fractional_bits; }) + " (outlier split)");
  return bits;
}

int side_code_bits(const Recipe& recipe, const SideArtifact& side, KvSide which) {
  if (side.bits == 0) return side_code_bits(recipe, which);
  KVCC_REQUIRE(side.bits >= 1 && side.bits <= 8 && side.bits == std::floor(side.bits),
               "artifact: a side's bits must be a whole number in [1, 8], got " + std::to_string(side.bits));
  return int(side.bits);
}

void rotate_rows(const std::vector<double>& rotation, int d, const float* rows, int n, float* out) {
  KVCC_REQUIRE(rotation.size() == size_t(d) * d, "artifact: rotation is not [head_dim, head_dim]");
  std::vector<double> acc(static_cast<size_t>(d));
  for (int t = 0; t < n; ++t) {
    std::fill(acc.begin(), acc.end(), 0.0);
    const float* x = rows + size_t(t) * d;
    for (int k = 0; k < d; ++k) {
      const double xk = x[k];
      const double* rrow = &rotation[size_t(k) * d];
      for (int j = 0; j < d; ++j) acc[size_t(j)] += xk * rrow[j];
    }
    for (int j = 0; j < d; ++j) out[size_t(t) * d + j] = float(acc[size_t(j)]);
  }
}

void unrotate_rows(const std::vector<double>& rotation, int d, const float* rows, int n, float* out) {
  KVCC_REQUIRE(rotation.size() == size_t(d) * d, "artifact: rotation is not [head_dim, head_dim]");
  for (int t = 0; t < n; ++t) {
    const float* y = rows + size_t(t) * d;
    for (int i = 0; i < d; ++i) {
      const double* rrow = &rotation[size_t(i) * d];
      double acc = 0.0;
      for (int j = 0; j < d; ++j) acc += double(y[j]) * rrow[j];
      out[size_t(t) * d + i] = float(acc);
    }
  }
}

void roundtrip_rotated(const Recipe& recipe, const SideArtifact& side, KvSide which, int d, const float* y, int n,
                       float* out) {
  const Method m = method_of(recipe);
  switch (method_traits(m).codec) {
    case CodecFamily::UniformGrid: {
      const int bits = side_code_bits(recipe, side, which), g = channel_group(recipe, d);
      for (int t = 0; t < n; ++t)
        for (int g0 = 0; g0 < d; g0 += g)
          uniform_roundtrip_strided(y + size_t(t) * d + g0, g, 1, side.clip_ratio, bits, out + size_t(t) * d + g0);
      return;
    }
    case CodecFamily::LevelTable: {
      if (m == Method::TurboQuant) return turboquant_roundtrip(recipe, side, which, d, y, n, out);
      const int bits = side_code_bits(recipe, which), g = channel_group(recipe, d);
      const std::vector<float> levels = checked_levels(side.levels, bits, (recipe.method + " levels").c_str());
      for (int t = 0; t < n; ++t)
        for (int g0 = 0; g0 < d; g0 += g)
          table_roundtrip(y + size_t(t) * d + g0, g, levels, bits, out + size_t(t) * d + g0);
      return;
    }
    case CodecFamily::KiviChannel: {
      const int bits = side_code_bits(recipe, side, which);
      if (which == KvSide::Key) {
        const int gt = recipe.group > 0 ? recipe.group : n;
        const bool e5m3 = e5m3_key_pairs(recipe);
        for (int t0 = 0; t0 < n; t0 += gt) {
          const int len = std::min(gt, n - t0);
          for (int c = 0; c < d; ++c)
            if (e5m3) chan_roundtrip_strided(y + size_t(t0) * d + c, len, d, bits, out + size_t(t0) * d + c);
            else uniform_roundtrip_strided(y + size_t(t0) * d + c, len, d, 1.0, bits, out + size_t(t0) * d + c);
        }
      } else if (recipe.params.count("values")) {  // mixed recipe: the grid method's value codec
        roundtrip_rotated(side_recipe(recipe, which), side, which, d, y, n, out);
      } else {
        const int g = kivi_value_group(recipe, d);
        for (int t = 0; t < n; ++t)
          for (int g0 = 0; g0 < d; g0 += g)
            uniform_roundtrip_strided(y + size_t(t) * d + g0, g, 1, 1.0, bits, out + size_t(t) * d + g0);
      }
      return;
    }
    case CodecFamily::KvarnTile:
      return kvarn_roundtrip(recipe, which, d, y, n, out);
    case CodecFamily::CommvqCodebooks:
      // Values: residual VQ of the rows (already in the side's rotated basis). Keys are coded
      // pre-RoPE and need each row's position: commvq_roundtrip_keys in formats/codec_commvq.h.
      KVCC_REQUIRE(which == KvSide::Value,
                   "commvq keys are coded pre-RoPE and need their positions; use "
                   "commvq_roundtrip_keys (formats/codec_commvq.h)");
      return commvq_roundtrip_values(commvq_value_codebook(side, d, false), y, size_t(n), out);
  }
}

void roundtrip_page(const Recipe& recipe, const SideArtifact& side, KvSide which, int d, const float* rows, int n,
                    float* out) {
  if (n <= 0) return;
  std::vector<float> y(size_t(n) * d), yq(size_t(n) * d);
  rotate_rows(side.rotation, d, rows, n, y.data());
  roundtrip_rotated(recipe, side, which, d, y.data(), n, yq.data());
  unrotate_rows(side.rotation, d, yq.data(), n, out);
}

std::vector<float> roundtrip_page(const Artifact& artifact, int layer, int kv_head, KvSide which, const float* rows,
                                  int n) {
  KVCC_REQUIRE(layer >= 0 && layer < artifact.n_layers && kv_head >= 0 && kv_head < artifact.n_kv_heads,
               "artifact has no (layer " + std::to_string(layer) + ", KV head " + std::to_string(kv_head) + ")");
  const HeadArtifact& h = artifact.head(layer, kv_head);
  std::vector<float> out(size_t(n) * artifact.head_dim);
  roundtrip_page(artifact.recipe, which == KvSide::Key ? h.key : h.value, which, artifact.head_dim, rows, n,
                 out.data());
  return out;
}

int group_span(const Recipe& recipe, int d, int n_kv) {
  if (recipe.group <= d) return 1;
  const MethodTraits& t = method_traits(method_of(recipe));
  if (t.codec == CodecFamily::KiviChannel) return 1;  // kivi: group = key tokens
  const int g = recipe.group;
  KVCC_REQUIRE(t.spans_heads, "--group " + std::to_string(g) + " exceeds head_dim " + std::to_string(d) + ": method " +
                                  recipe.method + " cannot span KV heads (only " +
                                  method_names([](const MethodTraits& m) { return m.spans_heads; }, ", ", " and ") +
                                  " quantise per-token channel groups that can)");
  KVCC_REQUIRE(g % d == 0 && (n_kv * d) % g == 0,
               "--group " + std::to_string(g) + " exceeds head_dim " + std::to_string(d) +
                   ", so it must be a multiple of head_dim dividing n_kv_heads*head_dim = " + std::to_string(n_kv * d) +
                   " (a group spans whole KV heads of one token)");
  return g / d;
}

void roundtrip_layer_page(const Artifact& artifact, int layer, KvSide which, const float* rows, int n, float* out) {
  KVCC_REQUIRE(layer >= 0 && layer < artifact.n_layers, "artifact has no layer " + std::to_string(layer));
  if (n <= 0) return;
  const Recipe& recipe = artifact.recipe;
  const int d = artifact.head_dim, n_kv = artifact.n_kv_heads, width = n_kv * d;
  const int span = group_span(recipe, d, n_kv);
  const int w = span * d;  // coded row width: the heads of one spanning group, side by side
  std::vector<float> x(size_t(n) * d), y(size_t(n) * w), yq(size_t(n) * w), head(size_t(n) * d);
  for (int h0 = 0; h0 < n_kv; h0 += span) {
    auto side_of = [&](int h) -> const SideArtifact& {
      const HeadArtifact& ha = artifact.head(layer, h);
      return which == KvSide::Key ? ha.key : ha.value;
    };
    const SideArtifact& first = side_of(h0);
    for (int k = 0; k < span; ++k) {
      const SideArtifact& s = side_of(h0 + k);
      // One group has one clip ratio / level table: compile stores the joint fit in every head.
      KVCC_REQUIRE(s.clip_ratio == first.clip_ratio && s.levels == first.levels && s.bits == first.bits,
                   "artifact: layer " + std::to_string(layer) + " KV heads " + std::to_string(h0) + " and " +
                       std::to_string(h0 + k) + " share a quantiser group but differ in clip ratio, levels or bits");
      for (int t = 0; t < n; ++t) std::copy_n(rows + size_t(t) * width + size_t(h0 + k) * d, d, &x[size_t(t) * d]);
      rotate_rows(s.rotation, d, x.data(), n, head.data());
      for (int t = 0; t < n; ++t) std::copy_n(&head[size_t(t) * d], d, &y[size_t(t) * w + size_t(k) * d]);
    }
    roundtrip_rotated(recipe, first, which, w, y.data(), n, yq.data());
    for (int k = 0; k < span; ++k) {
      for (int t = 0; t < n; ++t) std::copy_n(&yq[size_t(t) * w + size_t(k) * d], d, &head[size_t(t) * d]);
      unrotate_rows(side_of(h0 + k).rotation, d, head.data(), n, x.data());
      for (int t = 0; t < n; ++t) std::copy_n(&x[size_t(t) * d], d, out + size_t(t) * width + size_t(h0 + k) * d);
    }
  }
}

double std_imbalance(const float* tile, int rows, int cols) {
  std::vector<double> lr(size_t(rows), 0.0), lc(size_t(cols), 0.0), sc, sr;
  scaled_stds(tile, rows, cols, lr, lc, true, sc);
  scaled_stds(tile, rows, cols, lr, lc, false, sr);
  return ratio(sc) + ratio(sr);
}

BalanceScales kvarn_balance(const float* tile, int rows, int cols, int iterations) {
  std::vector<double> lr(size_t(rows), 0.0), lc(size_t(cols), 0.0), sc, sr;
  std::vector<double> best_lr = lr, best_lc = lc;
  double best = std_imbalance(tile, rows, cols);
  for (int it = 0; it < iterations; ++it) {
    scaled_stds(tile, rows, cols, lr, lc, true, sc);
    for (int c = 0; c < cols; ++c) lc[size_t(c)] = std::clamp(lc[size_t(c)] + std::log(sc[size_t(c)]), -0.3, 10.0);
    scaled_stds(tile, rows, cols, lr, lc, false, sr);
    for (int r = 0; r < rows; ++r) lr[size_t(r)] = std::clamp(lr[size_t(r)] + std::log(sr[size_t(r)]), -0.3, 10.0);
    scaled_stds(tile, rows, cols, lr, lc, true, sc);
    scaled_stds(tile, rows, cols, lr, lc, false, sr);
    const double imbalance = ratio(sc) + ratio(sr);
    if (imbalance < best) {
      best = imbalance;
      best_lr = lr;
      best_lc = lc;
    }
  }
  BalanceScales s;
  s.col.resize(static_cast<size_t>(cols));
  s.row.resize(static_cast<size_t>(rows));
  for (int c = 0; c < cols; ++c) s.col[size_t(c)] = round_f16(float(std::exp(best_lc[size_t(c)])));
  for (int r = 0; r < rows; ++r) s.row[size_t(r)] = round_f16(float(std::exp(best_lr[size_t(r)])));
  return s;
}

double nominal_bits(const Recipe& recipe) { return 0.5 * (recipe.key_bits + recipe.value_bits); }

double history_bits(const Recipe& recipe, KvSide which, int d) {
  const double b = side_nominal_bits(recipe, which);
  const Method m = method_of(recipe);
  const double G = recipe.group > 0 ? recipe.group : d;
  switch (method_traits(m).codec) {
    case CodecFamily::UniformGrid:
      return b + 32.0 / G;  // fp16 scale + zero per group
    case CodecFamily::LevelTable: {
      if (m != Method::TurboQuant) return b + 16.0 / G;  // fp16 RMS scale per group
      const bool split = b != std::floor(b);
      double meta = 16.0 * (split ? 2 : 1);                         // one fp16 norm per sub-vector
      if (param(recipe, "variant", "mse") == "prod") meta += 16.0;  // fp16 residual norm γ
      return b + meta / d;
    }
    case CodecFamily::KiviChannel: {
      if (which == KvSide::Value && recipe.params.count("values"))
        return history_bits(side_recipe(recipe, which), which, d);  // grid: b + 32/d
      // Keys: one scale/zero per channel per G_t tokens (fp16, or 2 bytes with key_params=e5m3), a
      // group never longer than the page (the codec caps it there); values: per token per G channels.
      const double gk = recipe.group > 0 ? std::min(recipe.group, recipe.page_size) : recipe.page_size;
      if (which == KvSide::Key) return b + (e5m3_key_pairs(recipe) ? 16.0 : 32.0) / gk;
      return b + 32.0 / double(kivi_value_group(recipe, d));
    }
    case CodecFamily::KvarnTile: {
      const double p = recipe.page_size;
      // Per tile: RTN scale (folded into the row balance scale) + zero per row, one balance scale
      // per column: keys 2d + P, values 2P + d fp16 values per d·P elements.
      const double n16 = which == KvSide::Key ? 2.0 * d + p : 2.0 * p + d;
      return b + 16.0 * n16 / (double(d) * p);
    }
    case CodecFamily::CommvqCodebooks: {
      auto it = recipe.params.find(which == KvSide::Key ? "key_bits_effective" : "value_bits_effective");
      if (it != recipe.params.end()) return std::stod(it->second);
      return b;
    }
  }
  throw Error("no bit accounting for method '" + recipe.method + "'");
}

std::vector<std::string> verify_turboquant(const Artifact& a) {
  std::vector<std::string> out;
  const int d = a.head_dim;
  const bool prod = param(a.recipe, "variant", "mse") == "prod";
  for (KvSide which : {KvSide::Key, KvSide::Value}) {
    const double b = side_nominal_bits(a.recipe, which);
    if (!(b >= 1 && b <= 8)) {
      out.push_back("turboquant: " + std::string(kv_side_name(which)) + " bits " + std::to_string(b) + " outside 1..8");
      continue;
    }
    // What compile stores for this budget: n_hi outlier channels at b_lo + 1 bits, the rest at b_lo.
    const int b_lo = int(std::floor(b)) - (prod ? 1 : 0);
    const int want_hi = int(std::lround((b - std::floor(b)) * d));
    for (int l = 0; l < a.n_layers; ++l)
      for (int h = 0; h < a.n_kv_heads; ++h) {
        const HeadArtifact& ha = a.head(l, h);
        const SideArtifact& s = which == KvSide::Key ? ha.key : ha.value;
        const std::string where =
            "turboquant: layer " + std::to_string(l) + " kv head " + std::to_string(h) + " " + kv_side_name(which);
        const NamedArray* split = s.extra("split");
        int n_hi = 0;
        if (split && (!split->integer || split->data.size() != 1)) {
          out.push_back(where + ": split is not one integer");
          continue;
        }
        if (split) n_hi = int(split->data[0]);
        if (n_hi != want_hi) {
          out.push_back(where + ": split " + std::to_string(n_hi) + " disagrees with the recipe's " +
                        std::to_string(b) + " bits (" + std::to_string(want_hi) + " outlier channels)");
          continue;
        }
        if (n_hi > 0) {
          const NamedArray* ch = s.extra("outlier_channels");
          std::vector<double> sorted = ch ? ch->data : std::vector<double>{};
          std::sort(sorted.begin(), sorted.end());
          if (!ch || !ch->integer || ch->data.size() != size_t(n_hi) ||
              std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end() || sorted.front() < 0 ||
              sorted.back() >= d)
            out.push_back(where + ": outlier_channels must be " + std::to_string(n_hi) +
                          " distinct channel indices in [0, " + std::to_string(d) + ")");
          const NamedArray* hi = s.extra("outlier_levels");
          if (!hi || hi->data.size() != size_t(1) << (b_lo + 1))
            out.push_back(where + ": outlier_levels must hold " + std::to_string(1 << (b_lo + 1)) + " levels");
        }
        if (b_lo > 0 && s.levels.size() != size_t(1) << b_lo)
          out.push_back(where + ": " + std::to_string(s.levels.size()) + " levels, expected " +
                        std::to_string(1 << b_lo));
        const NamedArray* qjl = s.extra("qjl_matrix");
        if (prod && (!qjl || qjl->data.size() != size_t(d) * d))
          out.push_back(where + ": variant prod needs a [d, d] qjl_matrix");
      }
  }
  return out;
}

namespace {
// The recipe a side is accounted with: its own width in place of the recipe's.
Recipe at_side_bits(const Recipe& recipe, const SideArtifact& side, KvSide which) {
  Recipe r = recipe;
  if (side.bits != 0) (which == KvSide::Key ? r.key_bits : r.value_bits) = side.bits;
  return r;
}
}  // namespace

bool has_side_bits(const Artifact& a) {
  return std::any_of(a.heads.begin(), a.heads.end(),
                     [](const HeadArtifact& h) { return h.key.bits != 0 || h.value.bits != 0; });
}

double history_bits(const Artifact& a, KvSide which) {
  if (!has_side_bits(a) || a.heads.empty()) return history_bits(a.recipe, which, a.head_dim);
  double sum = 0;
  for (const HeadArtifact& h : a.heads) {
    const SideArtifact& s = which == KvSide::Key ? h.key : h.value;
    sum += history_bits(at_side_bits(a.recipe, s, which), which, a.head_dim);
  }
  return sum / double(a.heads.size());
}

double nominal_bits(const Artifact& a) {
  if (!has_side_bits(a) || a.heads.empty()) return nominal_bits(a.recipe);
  double sum = 0;
  for (const HeadArtifact& h : a.heads)
    sum += side_nominal_bits(at_side_bits(a.recipe, h.key, KvSide::Key), KvSide::Key) +
           side_nominal_bits(at_side_bits(a.recipe, h.value, KvSide::Value), KvSide::Value);
  return sum / double(2 * a.heads.size());
}

namespace {

// Tokens of a context_len-token sequence in quantised pages: every token past the windows (the
// published accounting), or the whole pages the cache holds (kv_layout.h's quantised_tokens).
int64_t quantised_count(const Recipe& r, int64_t context_len, bool whole_pages) {
  KVCC_REQUIRE(context_len > 0, "bits per element need a positive context length");
  if (!whole_pages) return context_len - std::min<int64_t>(context_len, int64_t(r.sink) + r.recent);
  KVCC_REQUIRE(r.page_size > 0, "stored bits need the recipe's page size");
  KvGeometry g;
  g.sink = r.sink;
  g.recent = r.recent;
  g.page_tokens = r.page_size;
  return quantised_tokens(g, context_len);
}

// Mean over K and V of (the BF16 tokens · 16 + the quantised ones · their tier's bits) / n.
double bits_per_element(int64_t n, int64_t quantised, double key_tier, double value_tier) {
  const double q = double(quantised), window = double(n) - q;
  return 0.5 * ((window * 16.0 + q * key_tier) / double(n) + (window * 16.0 + q * value_tier) / double(n));
}

double artifact_bits(const Artifact& a, int64_t n, bool whole_pages) {
  return bits_per_element(n, quantised_count(a.recipe, n, whole_pages), history_bits(a, KvSide::Key),
                          history_bits(a, KvSide::Value));
}

double recipe_bits(const Recipe& r, int head_dim, int64_t n, bool whole_pages) {
  return bits_per_element(n, quantised_count(r, n, whole_pages), history_bits(r, KvSide::Key, head_dim),
                          history_bits(r, KvSide::Value, head_dim));
}

}  // namespace

double effective_bits(const Artifact& a, int64_t context_len) { return artifact_bits(a, context_len, false); }
double effective_bits(const Recipe& r, int head_dim, int64_t context_len) {
  return recipe_bits(r, head_dim, context_len, false);
}
double stored_bits(const Artifact& a, int64_t context_len) { return artifact_bits(a, context_len, true); }
double stored_bits(const Recipe& r, int head_dim, int64_t context_len) {
  return recipe_bits(r, head_dim, context_len, true);
}

}  // namespace kvcc
