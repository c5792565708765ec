#include "compile/allocate.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>

#include "compile/fit.h"
#include "formats/error.h"
#include "formats/kv_codec.h"
#include "formats/method.h"

namespace kvcc {

namespace {

// Attention outputs P·V [nq, d] of one head's rows.
std::vector<float> outputs(const std::vector<float>& probs, int nq, const std::vector<float>& value, int n, int d) {
  std::vector<float> o(size_t(nq) * d);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, nq, d, n, 1.0f, probs.data(), n, value.data(), d, 0.0f,
              o.data(), d);
  return o;
}

double rel2(const std::vector<float>& got, const std::vector<float>& ref) {
  double e = 0, r = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    e += double(got[i] - ref[i]) * double(got[i] - ref[i]);
    r += double(ref[i]) * ref[i];
  }
  return r > 0 ? e / r : 0.0;
}

std::string number(double x) {
  std::ostringstream o;
  o << x;
  return o.str();
}

// Copies of `a` with every side at width w (the measure of the extreme allocations).
Artifact at_width(Artifact a, int w) {
  for (HeadArtifact& h : a.heads) h.key.bits = h.value.bits = w;
  return a;
}

}  // namespace

double budget_measure(const Artifact& a, int64_t context) {
  if (context > 0) return effective_bits(a, context);
  return 0.5 * (history_bits(a, KvSide::Key) + history_bits(a, KvSide::Value));
}

std::vector<int> choose_widths(const std::vector<std::vector<double>>& error, const std::vector<int>& weight,
                               const std::vector<int>& widths, int64_t capacity) {
  const size_t n = error.size(), m = widths.size();
  KVCC_REQUIRE(weight.size() == n && m > 0, "choose_widths: one weight per item and at least one width");
  int64_t least = 0;
  for (size_t i = 0; i < n; ++i) least += int64_t(weight[i]) * widths[0];
  KVCC_REQUIRE(least <= capacity,
               "bits budget: below the narrowest allocation (" + std::to_string(widths[0]) + " bits on every side)");
  const double inf = std::numeric_limits<double>::infinity();
  const size_t K = size_t(capacity);
  // best[k]: least error of the items so far with exactly k bits; pick[i][k]: item i's width.
  std::vector<double> best(K + 1, inf), next(K + 1);
  best[0] = 0;
  std::vector<std::vector<int8_t>> pick(n, std::vector<int8_t>(K + 1, -1));
  for (size_t i = 0; i < n; ++i) {
    KVCC_REQUIRE(error[i].size() == m, "choose_widths: one error per width");
    std::fill(next.begin(), next.end(), inf);
    for (size_t k = 0; k <= K; ++k) {
      if (best[k] == inf) continue;
      for (size_t j = 0; j < m; ++j) {
        const size_t c = k + size_t(weight[i]) * size_t(widths[j]);
        if (c > K) break;  // widths ascend
        const double e = best[k] + error[i][j];
        if (e < next[c]) {  // strict: ties keep the earlier (narrower) choice
          next[c] = e;
          pick[i][c] = int8_t(j);
        }
      }
    }
    best.swap(next);
  }
  size_t at = 0;
  for (size_t k = 0; k <= K; ++k)
    if (best[k] < best[at]) at = k;
  std::vector<int> choice(n);
  for (size_t i = n; i-- > 0;) {
    const int j = pick[i][at];
    choice[i] = j;
    at -= size_t(weight[i]) * size_t(widths[size_t(j)]);
  }
  return choice;
}

std::vector<SideSensitivity> measure_sensitivity(const Stats& stats, const CompileOptions& options,
                                                 const std::vector<int>& widths, int max_rows,
                                                 std::vector<Artifact>& compiled) {
  const ModelConfig& c = stats.config;
  const int d = c.head_dim, n_kv = c.n_kv_heads, w = n_kv * d;
  compiled.clear();
  for (int b : widths) {
    CompileOptions o = options;
    o.bits_budget = 0;
    o.key_bits = o.value_bits = b;
    o.progress = nullptr;
    compiled.push_back(compile_artifact(stats, o));
  }
  std::vector<SideSensitivity> out;
  for (int l = 0; l < c.n_layers; ++l) {
    std::vector<const Reservoir*> reservoirs;
    for (int h = 0; h < n_kv; ++h) reservoirs.push_back(&stats.reservoir(l, h));
    const std::vector<FitRows> rows = select_aligned_rows(reservoirs, true, max_rows);
    const int n = rows[0].n;
    KVCC_REQUIRE(n > 0, "bits budget: the stats have no held-out reservoir rows for layer " + std::to_string(l) +
                            " (the sensitivity is measured on them)");
    // The layer's rows side by side, [n, n_kv·d], as the layer codec takes them.
    std::vector<float> k(size_t(n) * w), v(k.size());
    for (int h = 0; h < n_kv; ++h)
      for (int t = 0; t < n; ++t) {
        std::copy_n(&rows[size_t(h)].key[size_t(t) * d], d, &k[size_t(t) * w + size_t(h) * d]);
        std::copy_n(&rows[size_t(h)].value[size_t(t) * d], d, &v[size_t(t) * w + size_t(h) * d]);
      }
    std::vector<std::vector<float>> probs(static_cast<size_t>(n_kv)), ref(static_cast<size_t>(n_kv));
    for (int h = 0; h < n_kv; ++h) {
      const FitRows& r = rows[size_t(h)];
      probs[size_t(h)] = attention_probs(r.query, r.nq, r.key, n, d);
      ref[size_t(h)] = outputs(probs[size_t(h)], r.nq, r.value, n, d);
    }
    std::vector<SideSensitivity> layer(size_t(n_kv) * 2);
    for (int h = 0; h < n_kv; ++h)
      for (int s = 0; s < 2; ++s) layer[size_t(h) * 2 + size_t(s)] = {l, h, KvSide(s), {}};
    std::vector<float> kq(k.size()), vq(v.size()), hk(size_t(n) * d), hv(hk.size());
    for (const Artifact& art : compiled) {
      const int page = art.recipe.page_size > 0 ? art.recipe.page_size : n;
      for (int t0 = 0; t0 < n; t0 += page) {
        const int len = std::min(page, n - t0);
        roundtrip_layer_page(art, l, KvSide::Key, &k[size_t(t0) * w], len, &kq[size_t(t0) * w]);
        roundtrip_layer_page(art, l, KvSide::Value, &v[size_t(t0) * w], len, &vq[size_t(t0) * w]);
      }
      for (int h = 0; h < n_kv; ++h) {
        for (int t = 0; t < n; ++t) {
          std::copy_n(&kq[size_t(t) * w + size_t(h) * d], d, &hk[size_t(t) * d]);
          std::copy_n(&vq[size_t(t) * w + size_t(h) * d], d, &hv[size_t(t) * d]);
        }
        const FitRows& r = rows[size_t(h)];
        // Keys quantised, values exact; then values quantised, keys exact.
        const std::vector<float> pk = attention_probs(r.query, r.nq, hk, n, d);
        layer[size_t(h) * 2].error.push_back(rel2(outputs(pk, r.nq, r.value, n, d), ref[size_t(h)]));
        layer[size_t(h) * 2 + 1].error.push_back(rel2(outputs(probs[size_t(h)], r.nq, hv, n, d), ref[size_t(h)]));
      }
    }
    out.insert(out.end(), layer.begin(), layer.end());
  }
  return out;
}

std::vector<double> weigh_by_kl(std::vector<SideSensitivity>& table, const std::vector<std::vector<double>>& kl,
                                const std::vector<int>& widths, const int base[2], int n_layers, int n_kv) {
  const size_t m = widths.size();
  KVCC_REQUIRE(table.size() == size_t(n_layers) * n_kv * 2, "bits budget: the sensitivity table has the wrong size");
  for (int s = 0; s < 2; ++s)
    KVCC_REQUIRE(base[s] >= 0 && size_t(base[s]) < m && size_t(base[s]) < kl.size(),
                 "bits budget: no measured KL at the recipe's width");
  std::vector<double> scale(size_t(n_layers) * 2 * m, 0.0);
  for (int l = 0; l < n_layers; ++l)
    for (int s = 0; s < 2; ++s) {
      const std::string side = "layer " + std::to_string(l) + (s ? " values" : " keys");
      double* f = &scale[(size_t(l) * 2 + size_t(s)) * m];
      for (int j = 0; j <= base[s]; ++j) {
        KVCC_REQUIRE(kl[size_t(j)].size() == size_t(n_layers) * 2,
                     "bits budget: " + std::to_string(kl[size_t(j)].size()) + " measured KLs for " +
                         std::to_string(n_layers) + " layers (one per layer and side)");
        const double k = kl[size_t(j)][size_t(l) * 2 + size_t(s)];
        KVCC_REQUIRE(std::isfinite(k) && k >= 0, "bits budget: the measured KL of " + side + " at " +
                                                     std::to_string(widths[size_t(j)]) + " bits is " + number(k) +
                                                     " (must be finite and >= 0)");
        double sum = 0;
        for (int h = 0; h < n_kv; ++h) sum += table[(size_t(l) * n_kv + size_t(h)) * 2 + size_t(s)].error[size_t(j)];
        KVCC_REQUIRE(sum > 0 || k == 0, "bits budget: " + side + " show no held-out error at " +
                                            std::to_string(widths[size_t(j)]) + " bits but a KL of " + number(k) +
                                            ": the two cannot be matched");
        f[j] = sum > 0 ? k / sum : 0.0;
      }
      for (size_t j = size_t(base[s]) + 1; j < m; ++j) f[j] = f[base[s]];
      for (int h = 0; h < n_kv; ++h) {
        std::vector<double>& e = table[(size_t(l) * n_kv + size_t(h)) * 2 + size_t(s)].error;
        for (size_t j = 0; j < m; ++j) e[j] *= f[j];
      }
    }
  return scale;
}

Artifact compile_with_budget(const Stats& stats, const CompileOptions& options, BitsAllocation* result) {
  const ModelConfig& c = stats.config;
  const Recipe recipe = make_recipe(options, c.head_dim, c.n_kv_heads);
  const MethodTraits& t = method_traits(method_of(recipe));
  KVCC_REQUIRE(
      t.codec == CodecFamily::UniformGrid || t.codec == CodecFamily::KiviChannel,
      "--bits-budget chooses widths of the uniform grid (" +
          method_names([](const MethodTraits& m) { return m.codec == CodecFamily::UniformGrid; }, ", ", " and ") +
          ") and of kivi, not " + recipe.method + " (its codes are sized by its own tables)");
  KVCC_REQUIRE(
      options.bits_granularity == "auto" || options.bits_granularity == "layer" || options.bits_granularity == "head",
      "--bits-granularity must be auto, layer or head, got '" + options.bits_granularity + "'");
  KVCC_REQUIRE(options.budget_context >= 0, "--budget-context must be >= 0");
  BitsAllocation a;
  a.widths = {1, 2, 3, 4};
  std::vector<Artifact> compiled;
  a.sensitivity = measure_sensitivity(stats, options, a.widths, options.budget_rows, compiled);

  // The measure is affine in the sum S of the sides' widths: m(S) = m0 + slope·(S − S0).
  const int n_sides = int(a.sensitivity.size());
  const double m0 = budget_measure(at_width(compiled[0], a.widths[0]), options.budget_context);
  const double m1 = budget_measure(at_width(compiled[0], a.widths[1]), options.budget_context);
  const double slope = (m1 - m0) / double(n_sides * (a.widths[1] - a.widths[0]));
  KVCC_REQUIRE(options.bits_budget >= m0 - 1e-12, "--bits-budget " + number(options.bits_budget) +
                                                      " is below the narrowest allocation: " + number(m0) +
                                                      " bits with 1-bit codes everywhere");
  // The largest S within the budget (a hair of slack for the affine fit's rounding).
  const int64_t capacity = std::min<int64_t>(
      int64_t(n_sides) * a.widths.back(),
      int64_t(std::floor((options.bits_budget - m0) / slope + 1e-9)) + int64_t(n_sides) * a.widths[0]);

  if (options.side_kl) {  // weighed by the model's KL, measured once the budget is known feasible
    int base[2];
    for (int s = 0; s < 2; ++s) {
      const double b = s ? recipe.value_bits : recipe.key_bits;
      const auto it = std::find(a.widths.begin(), a.widths.end(), int(b));
      KVCC_REQUIRE(double(int(b)) == b && it != a.widths.end(),
                   "bits budget: the KL is measured at the recipe's widths, which must be whole numbers in 1-4");
      base[s] = int(it - a.widths.begin());
    }
    // compiled[j]: both sides at widths[j], the quantisers fitted there.
    std::vector<std::vector<double>> kl;
    for (int j = 0; j <= std::max(base[0], base[1]); ++j) kl.push_back(options.side_kl(compiled[size_t(j)]));
    a.kl_scale = weigh_by_kl(a.sensitivity, kl, a.widths, base, c.n_layers, c.n_kv_heads);
  }

  const int n_kv = c.n_kv_heads;
  // Per layer: items (layer, side) of weight n_kv; per head: (layer, head, side) of weight 1.
  auto solve = [&](bool per_head, std::vector<int>& bits) {
    std::vector<std::vector<double>> error;
    std::vector<int> weight;
    for (int l = 0; l < c.n_layers; ++l)
      for (int s = 0; s < 2; ++s) {
        if (per_head) {
          for (int h = 0; h < n_kv; ++h) {
            error.push_back(a.sensitivity[(size_t(l) * n_kv + size_t(h)) * 2 + size_t(s)].error);
            weight.push_back(1);
          }
        } else {
          std::vector<double> sum(a.widths.size(), 0.0);
          for (int h = 0; h < n_kv; ++h)
            for (size_t j = 0; j < sum.size(); ++j)
              sum[j] += a.sensitivity[(size_t(l) * n_kv + size_t(h)) * 2 + size_t(s)].error[j];
          error.push_back(sum);
          weight.push_back(n_kv);
        }
      }
    const std::vector<int> choice = choose_widths(error, weight, a.widths, capacity);
    bits.assign(size_t(n_sides), 0);
    double total = 0;
    size_t item = 0;
    for (int l = 0; l < c.n_layers; ++l)
      for (int s = 0; s < 2; ++s)
        for (int h = 0; h < (per_head ? n_kv : 1); ++h, ++item) {
          total += error[item][size_t(choice[item])];
          for (int hh = per_head ? h : 0; hh < (per_head ? h + 1 : n_kv); ++hh)
            bits[(size_t(l) * n_kv + size_t(hh)) * 2 + size_t(s)] = a.widths[size_t(choice[item])];
        }
    return total;
  };
  std::vector<int> layer_bits, head_bits;
  a.layer_error = solve(false, layer_bits);
  // A quantiser group spanning KV heads has one width: per-head widths need groups within a head.
  const bool heads_ok = group_span(recipe, c.head_dim, n_kv) == 1 && n_kv > 1;
  a.head_error = -1;
  if (heads_ok && options.bits_granularity != "layer") a.head_error = solve(true, head_bits);
  KVCC_REQUIRE(heads_ok || options.bits_granularity != "head",
               "--bits-granularity head needs quantiser groups within a KV head (and more than one KV head)");
  const bool per_head =
      options.bits_granularity == "head" ||
      (options.bits_granularity == "auto" && a.head_error >= 0 && a.head_error <= (1.0 - kHeadGain) * a.layer_error);
  a.granularity = per_head ? "head" : "layer";
  a.bits = per_head ? head_bits : layer_bits;
  a.predicted_error = per_head ? a.head_error : a.layer_error;

  // Each side from the artifact compiled at its width (rotation and the quantiser fitted there).
  Artifact art = compiled[0];
  for (size_t i = 0; i < art.heads.size(); ++i)
    for (int s = 0; s < 2; ++s) {
      const int b = a.bits[i * 2 + size_t(s)];
      const size_t j = size_t(std::find(a.widths.begin(), a.widths.end(), b) - a.widths.begin());
      SideArtifact& side = s ? art.heads[i].value : art.heads[i].key;
      side = s ? compiled[j].heads[i].value : compiled[j].heads[i].key;
      side.bits = b;
    }
  art.recipe = recipe;
  art.recipe.params["bits_budget"] = number(options.bits_budget);
  art.recipe.params["budget_context"] = std::to_string(options.budget_context);
  art.recipe.params["bits_granularity"] = a.granularity;
  // What the widths were chosen from: held-out attention errors, or those weighed by measured KL.
  art.recipe.params["bits_sensitivity"] = options.side_kl ? "kl" : "heldout";
  a.budget_bits = budget_measure(art, options.budget_context);
  KVCC_REQUIRE(a.budget_bits <= options.bits_budget + 1e-9 || capacity == int64_t(n_sides) * a.widths.back(),
               "bits budget: the allocation's " + number(a.budget_bits) + " bits exceed the budget (a bug)");
  if (result) *result = a;
  return art;
}

}  // namespace kvcc
