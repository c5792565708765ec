#include "eval/eviction.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <map>
#include <numeric>
#include <sstream>

#include <Eigen/Core>

#include "eval/experiment.h"
#include "formats/error.h"
#include "formats/kv_layout.h"
#include "model/forward.h"
#include "model/observer.h"

namespace kvcc {
namespace {
// The message of a failed check, built only then (KVCC_REQUIRE).
template <class... A>
std::string cat(const A&... a) {
  std::ostringstream s;
  (s << ... << a);
  return s.str();
}
}  // namespace

const char* eviction_score_name(EvictionScore score) {
  switch (score) {
    case EvictionScore::Window:
      return "window";
    case EvictionScore::H2O:
      return "h2o";
    case EvictionScore::SnapKV:
      return "snapkv";
    case EvictionScore::Emitted:
      return "emitted";
    case EvictionScore::QueryMoment:
      return "qmoment";
    case EvictionScore::QueryGaussian:
      return "qgauss";
    case EvictionScore::KeyNorm:
      return "keynorm";
    case EvictionScore::EpiCache:
      return "epicache";
    case EvictionScore::ValueAware:
      return "vatp";
  }
  return "?";
}

std::vector<EvictionScore> all_eviction_scores() {
  return {EvictionScore::Window,  EvictionScore::H2O,         EvictionScore::SnapKV,
          EvictionScore::Emitted, EvictionScore::QueryMoment, EvictionScore::QueryGaussian,
          EvictionScore::KeyNorm, EvictionScore::EpiCache,    EvictionScore::ValueAware};
}

const char* eviction_merge_name(EvictionMerge merge) {
  switch (merge) {
    case EvictionMerge::None:
      return "none";
    case EvictionMerge::Value:
      return "value";
    case EvictionMerge::KeyValue:
      return "kv";
    case EvictionMerge::Average:
      return "average";
  }
  return "?";
}

std::vector<EvictionMerge> all_eviction_merges() {
  return {EvictionMerge::None, EvictionMerge::Value, EvictionMerge::KeyValue, EvictionMerge::Average};
}

std::vector<float> merge_evicted(EvictionMerge merge, double threshold, float* keys, float* values, int64_t n,
                                 size_t stride, int d, const std::vector<int32_t>& kept,
                                 const std::vector<double>& mass, int64_t* merged) {
  KVCC_REQUIRE(n >= 0 && d >= 1 && stride >= size_t(d), "merge_evicted: bad shape");
  KVCC_REQUIRE(int64_t(mass.size()) == n, cat("merge_evicted: ", mass.size(), " masses for ", n, " tokens"));
  const size_t K = kept.size();
  std::vector<char> is_kept(size_t(n), 0);
  for (size_t i = 0; i < K; ++i) {
    KVCC_REQUIRE(kept[i] >= 0 && kept[i] < n && (i == 0 || kept[i] > kept[i - 1]),
                 "merge_evicted: kept positions must ascend within [0, n)");
    is_kept[size_t(kept[i])] = 1;
  }
  for (int64_t j = 0; j < n; ++j)
    KVCC_REQUIRE(std::isfinite(mass[size_t(j)]) && mass[size_t(j)] >= 0 && (!is_kept[size_t(j)] || mass[size_t(j)] > 0),
                 cat("merge_evicted: token ", j, " has mass ", mass[size_t(j)], " (kept tokens need > 0)"));
  std::vector<float> log_mass(K, 0.0f);
  if (merged) *merged = 0;
  std::vector<int32_t> evicted;
  for (int64_t j = 0; j < n; ++j)
    if (!is_kept[size_t(j)]) evicted.push_back(int32_t(j));
  if (merge == EvictionMerge::None || K == 0 || evicted.empty()) return log_mass;

  // Unit keys (float64 norms), then every evicted key's cosine with every kept one: one GEMM.
  auto unit_rows = [&](const std::vector<int32_t>& rows) {
    std::vector<float> u(rows.size() * size_t(d));
    for (size_t i = 0; i < rows.size(); ++i) {
      const float* k = keys + size_t(rows[i]) * stride;
      double s = 0;
      for (int a = 0; a < d; ++a) s += double(k[a]) * k[a];
      const double inv = s > 0 ? 1.0 / std::sqrt(s) : 0.0;
      for (int a = 0; a < d; ++a) u[i * d + a] = float(k[a] * inv);
    }
    return u;
  };
  const std::vector<float> ue = unit_rows(evicted), uk = unit_rows(kept);
  const size_t E = evicted.size();
  std::vector<float> cosine(E * K);
  using Rows = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  Eigen::Map<Rows>(cosine.data(), Eigen::Index(E), Eigen::Index(K)).noalias() =
      Eigen::Map<const Rows>(ue.data(), Eigen::Index(E), d) *
      Eigen::Map<const Rows>(uk.data(), Eigen::Index(K), d).transpose();

  // Clusters: the kept row's sums in float64, from its own mass-weighted row.
  std::vector<double> msum(K), ksum(K * size_t(d)), vsum(K * size_t(d));
  for (size_t i = 0; i < K; ++i) {
    const double a = mass[size_t(kept[i])];
    msum[i] = a;
    for (int c = 0; c < d; ++c) {
      ksum[i * d + c] = a * keys[size_t(kept[i]) * stride + c];
      vsum[i * d + c] = a * values[size_t(kept[i]) * stride + c];
    }
  }
  std::vector<char> touched(K, 0);
  int64_t count = 0;
  for (size_t e = 0; e < E; ++e) {
    const float* row = cosine.data() + e * K;
    size_t best = 0;
    for (size_t i = 1; i < K; ++i)
      if (row[i] > row[best]) best = i;
    if (!(double(row[best]) >= threshold)) continue;
    const double a = mass[size_t(evicted[e])];
    const float* k = keys + size_t(evicted[e]) * stride;
    const float* v = values + size_t(evicted[e]) * stride;
    msum[best] += a;
    for (int c = 0; c < d; ++c) {
      ksum[best * d + c] += a * k[c];
      vsum[best * d + c] += a * v[c];
    }
    touched[best] = 1;
    ++count;
  }
  if (merged) *merged = count;
  for (size_t i = 0; i < K; ++i) {
    if (!touched[i]) continue;
    float* k = keys + size_t(kept[i]) * stride;
    float* v = values + size_t(kept[i]) * stride;
    for (int c = 0; c < d; ++c) {
      v[c] = float(vsum[i * d + c] / msum[i]);
      if (merge != EvictionMerge::Value) k[c] = float(ksum[i * d + c] / msum[i]);
    }
    if (merge != EvictionMerge::Average) log_mass[i] = float(std::log(msum[i] / mass[size_t(kept[i])]));
  }
  return log_mass;
}

std::vector<int64_t> allocate_layer_budgets(const std::vector<double>& weights, int64_t total, int64_t lo, int64_t hi) {
  const int64_t L = int64_t(weights.size());
  KVCC_REQUIRE(L > 0, "layer budgets: no layers");
  KVCC_REQUIRE(lo >= 0 && lo <= hi, cat("layer budgets: need 0 <= lo <= hi, got ", lo, ", ", hi));
  for (double w : weights)
    KVCC_REQUIRE(std::isfinite(w) && w > 0, cat("layer budgets: weights must be finite and positive, got ", w));
  total = std::clamp(total, L * lo, L * hi);
  // share_l = clamp(λ·w_l, lo, hi) with λ such that the shares sum to total: the sum grows with λ,
  // so bisection finds it (the layers at a bound are then fixed there, the rest proportional).
  auto shares = [&](double lambda) {
    std::vector<double> x(static_cast<size_t>(L));
    for (int64_t l = 0; l < L; ++l) x[size_t(l)] = std::clamp(lambda * weights[size_t(l)], double(lo), double(hi));
    return x;
  };
  auto sum_of = [](const std::vector<double>& x) { return std::accumulate(x.begin(), x.end(), 0.0); };
  double a = 0, b = 1;
  while (sum_of(shares(b)) < double(total)) b *= 2;
  for (int i = 0; i < 200; ++i) {
    const double m = 0.5 * (a + b);
    (sum_of(shares(m)) < double(total) ? a : b) = m;
  }
  const std::vector<double> share = shares(b);
  // Largest remainder: floors, then one more token to the largest fractions until the total.
  std::vector<int64_t> out(static_cast<size_t>(L));
  int64_t sum = 0;
  for (int64_t l = 0; l < L; ++l) sum += out[size_t(l)] = std::clamp(int64_t(std::floor(share[size_t(l)])), lo, hi);
  std::vector<int64_t> order(static_cast<size_t>(L));
  for (int64_t l = 0; l < L; ++l) order[size_t(l)] = l;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return share[size_t(a)] - std::floor(share[size_t(a)]) > share[size_t(b)] - std::floor(share[size_t(b)]);
  });
  for (size_t i = 0; sum < total; i = (i + 1) % size_t(L))
    if (out[size_t(order[i])] < hi) {
      ++out[size_t(order[i])];
      ++sum;
    }
  return out;
}

std::vector<int32_t> select_kept(const std::vector<double>& scores, int64_t n, int64_t budget, int sink, int recent) {
  KVCC_REQUIRE(n >= 0 && budget >= 0 && sink >= 0 && recent >= 0, "select_kept: negative size");
  KVCC_REQUIRE(scores.empty() || int64_t(scores.size()) == n,
               cat("select_kept: ", scores.size(), " scores for ", n, " tokens"));
  std::vector<int32_t> kept;
  if (budget >= n) {
    kept.resize(size_t(n));
    std::iota(kept.begin(), kept.end(), 0);
    return kept;
  }
  const int64_t s = std::min<int64_t>({sink, budget, n});
  // Below sink + recent (or without scores) the budget after the sink goes to the newest tokens.
  const int64_t r = scores.empty() ? budget - s : std::min<int64_t>(recent, budget - s);
  std::vector<char> take(size_t(n), 0);
  for (int64_t j = 0; j < s; ++j) take[size_t(j)] = 1;
  for (int64_t j = n - r; j < n; ++j) take[size_t(j)] = 1;
  int64_t left = budget - s - r;
  if (left > 0 && !scores.empty()) {
    std::vector<int32_t> order;
    for (int64_t j = s; j < n - r; ++j) order.push_back(int32_t(j));
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
      return scores[size_t(a)] != scores[size_t(b)] ? scores[size_t(a)] > scores[size_t(b)] : a > b;
    });
    for (size_t i = 0; i < order.size() && left > 0; ++i, --left) take[size_t(order[i])] = 1;
  }
  for (int64_t j = 0; j < n; ++j)
    if (take[size_t(j)]) kept.push_back(int32_t(j));
  return kept;
}

std::vector<double> value_aware_scores(const std::vector<double>& attention, const float* values, int64_t n,
                                       size_t stride, int d) {
  KVCC_REQUIRE(int64_t(attention.size()) == n, "value_aware_scores: one attention weight per value");
  std::vector<double> out(static_cast<size_t>(n));
  for (int64_t j = 0; j < n; ++j) {
    double l1 = 0;
    for (int a = 0; a < d; ++a) l1 += std::fabs(double(values[size_t(j) * stride + a]));
    out[size_t(j)] = attention[size_t(j)] * l1;
  }
  return out;
}

std::vector<double> query_moment_scores(const std::vector<double>& m, const float* keys, int64_t n, size_t stride,
                                        int d) {
  KVCC_REQUIRE(m.size() == size_t(d) * d, "query_moment_scores: the moment is not [d, d]");
  std::vector<double> out(static_cast<size_t>(n));
  for (int64_t j = 0; j < n; ++j) {
    const float* k = keys + size_t(j) * stride;
    double s = 0;
    for (int a = 0; a < d; ++a) {
      double t = 0;
      for (int b = 0; b < d; ++b) t += m[size_t(a) * d + b] * double(k[b]);
      s += double(k[a]) * t;
    }
    out[size_t(j)] = s;
  }
  return out;
}

std::vector<double> query_gaussian_scores(const std::vector<double>& mean, const std::vector<double>& cov,
                                          const float* keys, int64_t n, size_t stride, int d) {
  KVCC_REQUIRE(mean.size() == size_t(d) && cov.size() == size_t(d) * d, "query_gaussian_scores: shapes");
  std::vector<double> out = query_moment_scores(cov, keys, n, stride, d);
  const double s = 1.0 / std::sqrt(double(d));
  for (int64_t j = 0; j < n; ++j) {
    double mk = 0;
    for (int a = 0; a < d; ++a) mk += mean[size_t(a)] * double(keys[size_t(j) * stride + a]);
    out[size_t(j)] = mk * s + 0.5 * out[size_t(j)] * s * s;
  }
  return out;
}

Clusters cosine_kmeans(const std::vector<double>& rows, int n, int dim, int k) {
  KVCC_REQUIRE(n >= 1 && dim >= 1 && k >= 1 && rows.size() == size_t(n) * dim, "cosine_kmeans: shapes");
  k = std::min(k, n);
  std::vector<double> unit(rows);
  for (int i = 0; i < n; ++i) {
    double s = 0;
    for (int a = 0; a < dim; ++a) s += unit[size_t(i) * dim + a] * unit[size_t(i) * dim + a];
    const double inv = s > 0 ? 1.0 / std::sqrt(s) : 0.0;
    for (int a = 0; a < dim; ++a) unit[size_t(i) * dim + a] *= inv;
  }
  auto dot = [&](const double* a, const double* b) {
    double s = 0;
    for (int i = 0; i < dim; ++i) s += a[i] * b[i];
    return s;
  };
  Clusters out;
  out.k = k;
  out.centroids.assign(size_t(k) * dim, 0.0);
  // Farthest point: each next centre is the row least similar to every centre so far.
  std::vector<int> centre = {0};
  while (int(centre.size()) < k) {
    int best = 0;
    double best_sim = 2;
    for (int i = 0; i < n; ++i) {
      double sim = -2;
      for (int c : centre) sim = std::max(sim, dot(&unit[size_t(i) * dim], &unit[size_t(c) * dim]));
      if (sim < best_sim) best_sim = sim, best = i;
    }
    centre.push_back(best);
  }
  for (int c = 0; c < k; ++c) std::copy_n(&unit[size_t(centre[size_t(c)]) * dim], dim, &out.centroids[size_t(c) * dim]);
  out.assignment.assign(size_t(n), -1);
  for (int it = 0; it < 100; ++it) {
    bool moved = false;
    for (int i = 0; i < n; ++i) {
      int best = 0;
      double best_sim = -3;
      for (int c = 0; c < k; ++c) {
        const double sim = dot(&unit[size_t(i) * dim], &out.centroids[size_t(c) * dim]);
        if (sim > best_sim) best_sim = sim, best = c;
      }
      moved |= out.assignment[size_t(i)] != best;
      out.assignment[size_t(i)] = best;
    }
    if (!moved) break;
    std::fill(out.centroids.begin(), out.centroids.end(), 0.0);
    for (int i = 0; i < n; ++i)
      for (int a = 0; a < dim; ++a)
        out.centroids[size_t(out.assignment[size_t(i)]) * dim + a] += unit[size_t(i) * dim + a];
    for (int c = 0; c < k; ++c) {
      double s = 0;
      for (int a = 0; a < dim; ++a) s += out.centroids[size_t(c) * dim + a] * out.centroids[size_t(c) * dim + a];
      // An empty cluster keeps its previous centre's direction (the farthest point's row).
      if (s == 0) std::copy_n(&unit[size_t(centre[size_t(c)]) * dim], dim, &out.centroids[size_t(c) * dim]);
      else
        for (int a = 0; a < dim; ++a) out.centroids[size_t(c) * dim + a] /= std::sqrt(s);
    }
  }
  return out;
}

std::vector<double> observation_scores(const ModelConfig& c, const float* q, int W, const float* keys, int64_t n,
                                       int g) {
  KVCC_REQUIRE(W >= 1 && W <= n, cat("observation scores: ", W, " queries over ", n, " tokens"));
  const int d = c.head_dim, r = c.group();
  const size_t qdim = size_t(c.n_heads) * d, kvdim = size_t(c.n_kv_heads) * d;
  const double scale = 1.0 / std::sqrt(double(d));
  std::vector<double> out(static_cast<size_t>(n), 0.0), w(static_cast<size_t>(n));
  for (int i = 0; i < W; ++i)
    for (int h = g * r; h < (g + 1) * r; ++h) {
      const float* qi = q + size_t(i) * qdim + size_t(h) * d;
      const int64_t last = n - W + i;
      double mx = -1e300, sum = 0;
      for (int64_t j = 0; j <= last; ++j) {
        const float* kj = keys + size_t(j) * kvdim + size_t(g) * d;
        double dot = 0;
        for (int a = 0; a < d; ++a) dot += double(qi[a]) * kj[a];
        mx = std::max(mx, w[size_t(j)] = dot * scale);
      }
      for (int64_t j = 0; j <= last; ++j) sum += (w[size_t(j)] = std::exp(w[size_t(j)] - mx));
      for (int64_t j = 0; j <= last; ++j) out[size_t(j)] += w[size_t(j)] / sum;
    }
  return out;
}

std::vector<double> max_pool(const std::vector<double>& x, int width) {
  KVCC_REQUIRE(width >= 1 && width % 2 == 1, cat("max_pool: the width must be odd and positive, got ", width));
  const int64_t n = int64_t(x.size()), h = width / 2;
  std::vector<double> out(x.size());
  for (int64_t j = 0; j < n; ++j) {
    double m = x[size_t(j)];
    for (int64_t i = std::max<int64_t>(0, j - h); i <= std::min<int64_t>(n - 1, j + h); ++i)
      m = std::max(m, x[size_t(i)]);
    out[size_t(j)] = m;
  }
  return out;
}

void attention_over_kept(const ModelConfig& c, int64_t n0, int T, const float* q, const float* hist_k,
                         const float* hist_v, const std::vector<std::vector<int32_t>>& kept, const float* cont_k,
                         const float* cont_v, float* out, const std::vector<std::vector<float>>* log_mass) {
  const int d = c.head_dim, r = c.group(), qdim = c.n_heads * d, kvdim = c.n_kv_heads * d;
  KVCC_REQUIRE(int(kept.size()) == c.n_kv_heads,
               cat("attention_over_kept: ", kept.size(), " kept sets for ", c.n_kv_heads, " KV heads"));
  KVCC_REQUIRE(
      !log_mass || log_mass->size() == kept.size(),
      cat("attention_over_kept: ", log_mass ? log_mass->size() : 0, " log-mass sets for ", kept.size(), " KV heads"));
  // One KV head at a time through the model's own attention: a group of r query heads over
  // [kept history rows; continuation rows], the history as a prefix. A head whose rows carry a
  // log mass b attends with one channel more: q' = [q·√((d+1)/d), 1], k' = [k, b·√(d+1)], v' =
  // [v, 0] under the model's scale 1/√(d+1), so q'·k'/√(d+1) = q·k/√d + b.
  std::vector<float> qg, kg, vg, og;
  for (int g = 0; g < c.n_kv_heads; ++g) {
    const std::vector<int32_t>& rows = kept[size_t(g)];
    const std::vector<float>* bias = log_mass ? &(*log_mass)[size_t(g)] : nullptr;
    KVCC_REQUIRE(!bias || bias->size() == rows.size(),
                 cat("attention_over_kept: ", bias ? bias->size() : 0, " log masses for ", rows.size(), " kept rows"));
    const bool biased = bias && std::any_of(bias->begin(), bias->end(), [](float b) { return b != 0; });
    const int e = biased ? d + 1 : d;  // channels per row
    ModelConfig one = c;
    one.n_heads = r;
    one.n_kv_heads = 1;
    one.head_dim = e;
    const size_t N = rows.size() + size_t(T);
    qg.assign(size_t(T) * r * e, 0.0f);
    og.resize(size_t(T) * r * e);
    kg.assign(N * e, 0.0f);
    vg.assign(N * e, 0.0f);
    const float kscale = biased ? float(std::sqrt(double(d + 1))) : 1.0f;
    const double qscale = biased ? std::sqrt(double(d + 1) / double(d)) : 1.0;
    for (size_t i = 0; i < rows.size(); ++i) {
      KVCC_REQUIRE(rows[i] >= 0 && rows[i] < n0,
                   cat("attention_over_kept: kept position ", rows[i], " outside [0, ", n0, ")"));
      std::copy_n(hist_k + size_t(rows[i]) * kvdim + size_t(g) * d, d, kg.data() + i * e);
      std::copy_n(hist_v + size_t(rows[i]) * kvdim + size_t(g) * d, d, vg.data() + i * e);
      if (biased) kg[i * e + d] = (*bias)[i] * kscale;
    }
    for (int t = 0; t < T; ++t) {
      std::copy_n(cont_k + size_t(t) * kvdim + size_t(g) * d, d, kg.data() + (rows.size() + t) * e);
      std::copy_n(cont_v + size_t(t) * kvdim + size_t(g) * d, d, vg.data() + (rows.size() + t) * e);
      for (int h = 0; h < r; ++h) {
        const float* src = q + size_t(t) * qdim + (size_t(g) * r + h) * d;
        float* dst = qg.data() + (size_t(t) * r + h) * e;
        if (biased) {
          for (int a = 0; a < d; ++a) dst[a] = float(src[a] * qscale);
          dst[d] = 1.0f;
        } else {
          std::copy_n(src, d, dst);
        }
      }
    }
    prefix_causal_attention(one, int64_t(rows.size()), T, qg.data(), kg.data(), vg.data(), og.data());
    for (int t = 0; t < T; ++t)
      for (int h = 0; h < r; ++h)
        std::copy_n(og.data() + (size_t(t) * r + h) * e, d, out + size_t(t) * qdim + (size_t(g) * r + h) * d);
  }
}

namespace {
// Merge masses: the score queries' attention per row, floored at 1e-12 of the head's largest so
// that every kept row has some (merge_evicted needs a_j > 0).
std::vector<double> floored_masses(std::vector<double> mass) {
  const double top = mass.empty() ? 0.0 : *std::max_element(mass.begin(), mass.end());
  for (double& a : mass) a = std::max(a, 1e-12 * top + 1e-300);
  return mass;
}

// Adds to acc (one entry per candidate row: the kept rows, then the block's T rows) the softmax
// weights that block queries t in [t0, T) of KV head g's query heads put on the candidates they
// see: every kept row (logit + its log mass) and the block's rows up to their own (float64).
void add_block_weights(const ModelConfig& c, const float* q, int T, int t0, const float* rows,
                       const std::vector<int32_t>& kept, const std::vector<float>& bias, const float* block_k, int g,
                       std::vector<double>& acc) {
  const int d = c.head_dim, r = c.group();
  const size_t qdim = size_t(c.n_heads) * d, kvdim = size_t(c.n_kv_heads) * d, n = kept.size();
  const double scale = 1.0 / std::sqrt(double(d));
  std::vector<double> w(n + size_t(T));
  for (int t = t0; t < T; ++t)
    for (int h = 0; h < r; ++h) {
      const float* qi = q + size_t(t) * qdim + (size_t(g) * r + h) * d;
      double mx = -1e300, sum = 0;
      const size_t seen = n + size_t(t) + 1;
      for (size_t j = 0; j < seen; ++j) {
        const float* kj =
            j < n ? rows + size_t(kept[j]) * kvdim + size_t(g) * d : block_k + (j - n) * kvdim + size_t(g) * d;
        double dot = 0;
        for (int a = 0; a < d; ++a) dot += double(qi[a]) * kj[a];
        w[j] = dot * scale + (j < n ? double(bias[j]) : 0.0);
        mx = std::max(mx, w[j]);
      }
      for (size_t j = 0; j < seen; ++j) sum += (w[j] = std::exp(w[j] - mx));
      for (size_t j = 0; j < seen; ++j) acc[j] += w[j] / sum;
    }
}
}  // namespace

BlockPrefill block_prefill(const ModelFile& model, const std::vector<LayerWeights>& weights, const int32_t* ids, int H,
                           EvictionScore score, const std::vector<int64_t>& budgets, EvictionMerge merge,
                           const int32_t* patched, const EvictionOptions& o, const QueryStatistics* qs) {
  const ModelConfig& c = model.config();
  const int d = c.head_dim, L = c.n_layers, G = c.n_kv_heads, B = o.prefill_block, P = o.block;
  const size_t qdim = size_t(c.n_heads) * d, kvdim = size_t(G) * d;
  KVCC_REQUIRE(B >= 1, cat("block_prefill: the block must be positive, got ", B));
  KVCC_REQUIRE(
      H >= 1 && int(weights.size()) == L && int(budgets.size()) == L,
      cat("block_prefill: ", weights.size(), " layers of weights and ", budgets.size(), " budgets for ", L, " layers"));
  KVCC_REQUIRE(score != EvictionScore::Emitted,
               "block_prefill: the emitted score is measured on the whole prefill only");
  KVCC_REQUIRE(score != EvictionScore::EpiCache || (patched && P >= 1),
               "block_prefill: epicache needs its medoid block");
  const bool moments = score == EvictionScore::QueryMoment || score == EvictionScore::QueryGaussian;
  KVCC_REQUIRE(!moments || (qs && qs->moment.size() == size_t(L) * G && qs->mean.size() == size_t(L) * G &&
                            qs->cov.size() == size_t(L) * G),
               "block_prefill: qmoment and qgauss need the query statistics of every layer and KV head");
  for (int64_t b : budgets) KVCC_REQUIRE(b >= 1, cat("block_prefill: budgets must be positive, got ", b));

  BlockPrefill out;
  out.keys.assign(size_t(L), std::vector<float>(size_t(H) * kvdim, 0.0f));
  out.values = out.keys;
  out.kept.assign(size_t(L), std::vector<std::vector<int32_t>>(size_t(G)));
  out.log_mass.assign(size_t(L), std::vector<std::vector<float>>(size_t(G)));
  // Per layer and KV head: accumulated attention per position (h2o), and this block's weights per
  // candidate from the observation queries and from the patched prompt.
  using PerHead = std::vector<std::vector<std::vector<double>>>;
  const PerHead empty(static_cast<size_t>(L), std::vector<std::vector<double>>(static_cast<size_t>(G)));
  PerHead h2o, snap = empty, patch = empty;
  if (score == EvictionScore::H2O)
    h2o.assign(size_t(L), std::vector<std::vector<double>>(size_t(G), std::vector<double>(size_t(H), 0.0)));
  // The block's last `observation` queries rank (snapkv, vatp) or weigh the merges of the scores
  // that have no queries of their own.
  const bool observed = score == EvictionScore::SnapKV || score == EvictionScore::ValueAware ||
                        (merge != EvictionMerge::None && score != EvictionScore::EpiCache);
  std::vector<float> x, q, k, v, attn, kc, vc;
  for (int s = 0; s < H; s += B) {
    const int T = std::min(B, H - s);
    x.resize(size_t(T) * c.hidden);
    q.resize(size_t(T) * qdim);
    k.resize(size_t(T) * kvdim);
    v.resize(size_t(T) * kvdim);
    attn.resize(size_t(T) * qdim);
    embed(model, ids + s, T, x.data());
    for (int l = 0; l < L; ++l) {
      attention_qkv(c, weights[size_t(l)], x.data(), T, s, q.data(), nullptr, k.data(), v.data());
      std::copy(k.begin(), k.end(), out.keys[size_t(l)].begin() + ptrdiff_t(size_t(s) * kvdim));
      std::copy(v.begin(), v.end(), out.values[size_t(l)].begin() + ptrdiff_t(size_t(s) * kvdim));
      for (int g = 0; g < G; ++g) {
        const auto& kept = out.kept[size_t(l)][size_t(g)];
        const auto& bias = out.log_mass[size_t(l)][size_t(g)];
        if (observed) {
          auto& w = snap[size_t(l)][size_t(g)];
          w.assign(kept.size() + size_t(T), 0.0);
          add_block_weights(c, q.data(), T, std::max(0, T - o.observation), out.keys[size_t(l)].data(), kept, bias,
                            k.data(), g, w);
        }
        if (score == EvictionScore::H2O) {
          std::vector<double> all(kept.size() + size_t(T), 0.0);
          add_block_weights(c, q.data(), T, 0, out.keys[size_t(l)].data(), kept, bias, k.data(), g, all);
          for (size_t j = 0; j < all.size(); ++j)
            h2o[size_t(l)][size_t(g)][size_t(j < kept.size() ? kept[j] : s + int(j - kept.size()))] += all[j];
        }
      }
      attention_over_kept(c, s, T, q.data(), out.keys[size_t(l)].data(), out.values[size_t(l)].data(),
                          out.kept[size_t(l)], k.data(), v.data(), attn.data(), &out.log_mass[size_t(l)]);
      attention_output_and_mlp(c, weights[size_t(l)], attn.data(), T, x.data());
    }
    // The candidates: the kept rows, then the block's (zero log mass).
    for (int l = 0; l < L; ++l)
      for (int g = 0; g < G; ++g) {
        for (int t = 0; t < T; ++t) out.kept[size_t(l)][size_t(g)].push_back(s + t);
        out.log_mass[size_t(l)][size_t(g)].resize(out.kept[size_t(l)][size_t(g)].size(), 0.0f);
      }
    // Every KV head of a layer holds as many rows (select_kept keeps exactly the budget); the
    // patched prompt runs, and adds its rows, only when some layer is over its budget.
    int64_t held = 0;
    bool over = false;
    for (int l = 0; l < L; ++l) {
      held += int64_t(out.kept[size_t(l)][0].size());
      over = over || int64_t(out.kept[size_t(l)][0].size()) > budgets[size_t(l)];
    }
    out.peak_rows = std::max(out.peak_rows, held + (over && score == EvictionScore::EpiCache ? int64_t(L) * P : 0));
    if (!over) continue;
    if (score == EvictionScore::EpiCache) {
      // The patched prompt after the block: its queries' attention on every candidate.
      std::vector<float> px(size_t(P) * c.hidden), pq(size_t(P) * qdim), pk(size_t(P) * kvdim), pv(size_t(P) * kvdim),
          pa(size_t(P) * qdim);
      embed(model, patched, P, px.data());
      for (int l = 0; l < L; ++l) {
        attention_qkv(c, weights[size_t(l)], px.data(), P, s + T, pq.data(), nullptr, pk.data(), pv.data());
        for (int g = 0; g < G; ++g) {
          const auto& kept = out.kept[size_t(l)][size_t(g)];
          std::vector<double> w(kept.size() + size_t(P), 0.0);
          add_block_weights(c, pq.data(), P, 0, out.keys[size_t(l)].data(), kept, out.log_mass[size_t(l)][size_t(g)],
                            pk.data(), g, w);
          w.resize(kept.size());
          patch[size_t(l)][size_t(g)] = std::move(w);
        }
        attention_over_kept(c, s + T, P, pq.data(), out.keys[size_t(l)].data(), out.values[size_t(l)].data(),
                            out.kept[size_t(l)], pk.data(), pv.data(), pa.data(), &out.log_mass[size_t(l)]);
        attention_output_and_mlp(c, weights[size_t(l)], pa.data(), P, px.data());
      }
    }
    // Evict to the budget.
    for (int l = 0; l < L; ++l)
      for (int g = 0; g < G; ++g) {
        std::vector<int32_t>& cand = out.kept[size_t(l)][size_t(g)];
        std::vector<float>& bias = out.log_mass[size_t(l)][size_t(g)];
        const int64_t n = int64_t(cand.size());
        if (n <= budgets[size_t(l)]) continue;
        kc.resize(size_t(n) * d);
        vc.resize(size_t(n) * d);
        for (int64_t i = 0; i < n; ++i) {
          std::copy_n(out.keys[size_t(l)].data() + size_t(cand[size_t(i)]) * kvdim + size_t(g) * d, d,
                      kc.data() + size_t(i) * d);
          std::copy_n(out.values[size_t(l)].data() + size_t(cand[size_t(i)]) * kvdim + size_t(g) * d, d,
                      vc.data() + size_t(i) * d);
        }
        const std::vector<double>& obs_w = snap[size_t(l)][size_t(g)];
        const size_t hg = size_t(l) * G + g;
        std::vector<double> sc;
        switch (score) {
          case EvictionScore::Window:
            break;
          case EvictionScore::H2O:
            for (int32_t p : cand) sc.push_back(h2o[size_t(l)][size_t(g)][size_t(p)]);
            break;
          case EvictionScore::SnapKV:
            sc = max_pool(obs_w, o.pool);
            break;
          case EvictionScore::ValueAware:
            sc = max_pool(value_aware_scores(obs_w, vc.data(), n, size_t(d), d), o.pool);
            break;
          case EvictionScore::QueryMoment:
            sc = query_moment_scores(qs->moment[hg], kc.data(), n, size_t(d), d);
            break;
          case EvictionScore::QueryGaussian:
            sc = query_gaussian_scores(qs->mean[hg], qs->cov[hg], kc.data(), n, size_t(d), d);
            break;
          case EvictionScore::KeyNorm:
            for (int64_t i = 0; i < n; ++i) {
              double e = 0;
              for (int a = 0; a < d; ++a) e += double(kc[size_t(i) * d + a]) * kc[size_t(i) * d + a];
              sc.push_back(e);
            }
            break;
          case EvictionScore::EpiCache:
            sc = max_pool(patch[size_t(l)][size_t(g)], o.pool);
            break;
          case EvictionScore::Emitted:
            break;
        }
        const std::vector<int32_t> sel = select_kept(sc, n, budgets[size_t(l)], o.sink, o.recent);
        out.evicted += n - int64_t(sel.size());
        std::vector<float> gained(sel.size(), 0.0f);
        if (merge != EvictionMerge::None) {
          const std::vector<double> mass =
              floored_masses(score == EvictionScore::EpiCache ? patch[size_t(l)][size_t(g)] : obs_w);
          int64_t m = 0;
          gained = merge_evicted(merge, o.merge_threshold, kc.data(), vc.data(), n, size_t(d), d, sel, mass, &m);
          out.merged += m;
          for (int32_t i : sel) {
            std::copy_n(kc.data() + size_t(i) * d, d,
                        out.keys[size_t(l)].data() + size_t(cand[size_t(i)]) * kvdim + size_t(g) * d);
            std::copy_n(vc.data() + size_t(i) * d, d,
                        out.values[size_t(l)].data() + size_t(cand[size_t(i)]) * kvdim + size_t(g) * d);
          }
        }
        std::vector<int32_t> kept;
        std::vector<float> kept_bias;
        for (size_t i = 0; i < sel.size(); ++i) {
          kept.push_back(cand[size_t(sel[i])]);
          kept_bias.push_back(bias[size_t(sel[i])] + gained[i]);
        }
        cand = std::move(kept);
        bias = std::move(kept_bias);
      }
  }
  return out;
}

std::vector<std::vector<int32_t>> build_conversations(const std::vector<std::vector<int32_t>>& documents,
                                                      const EvictionOptions& o, int bos_id) {
  KVCC_REQUIRE(o.passages >= 1 && o.history >= o.passages && o.continuation >= 1,
               cat("eviction: need history >= passages", " >= 1 and a continuation, got history ", o.history, ", ",
                   o.passages, " passages, continuation ", o.continuation));
  const size_t D = documents.size(), stride = D / size_t(o.passages);
  const int per = o.history / o.passages;
  std::vector<std::vector<int32_t>> out;
  for (size_t i = 0; i < stride && int(out.size()) < o.conversations; ++i) {
    std::vector<int32_t> conv;
    bool ok = true;
    for (int k = 0; k < o.passages && ok; ++k) {
      std::vector<int32_t> doc = documents[i + size_t(k) * stride];
      if (k > 0 && !doc.empty() && doc[0] == bos_id) doc.erase(doc.begin());
      // The last passage fills the history up to H exactly.
      const int take = k + 1 == o.passages ? o.history - int(conv.size()) : per;
      const size_t need = size_t(take) + (k == 0 ? size_t(o.continuation) + 1 : 0);
      if (doc.size() < need) ok = false;
      else conv.insert(conv.end(), doc.begin(), doc.begin() + take);
    }
    if (!ok) continue;
    const std::vector<int32_t>& first = documents[i];
    const int per0 = o.passages == 1 ? o.history : per;
    conv.insert(conv.end(), first.begin() + per0, first.begin() + per0 + o.continuation + 1);
    out.push_back(std::move(conv));
  }
  KVCC_REQUIRE(!out.empty(),
               cat("eviction: no conversation can be built: every one needs ", o.passages, " documents of at least ",
                   per, " tokens (", o.history / o.passages + o.continuation + 1, " for the first) among ", D,
                   " documents (", o.passages, " groups of ", stride, ")"));
  return out;
}

namespace {

// Per layer, the history's post-RoPE K/V and, per KV head, the attention-based scores.
struct HistoryObserver : AttentionObserver {
  const ModelConfig& c;
  int observation;
  std::vector<std::vector<float>> keys, values;             // [layer] [H, kvdim]
  std::vector<std::vector<float>> last_q;                   // [layer] [observation, qdim]
  std::vector<std::vector<std::vector<double>>> h2o, snap;  // [layer][kv head] [H]
  HistoryObserver(const ModelConfig& config, int obs) : c(config), observation(obs) {
    keys.resize(size_t(c.n_layers));
    values.resize(size_t(c.n_layers));
    last_q.resize(size_t(c.n_layers));
    h2o.assign(size_t(c.n_layers), std::vector<std::vector<double>>(size_t(c.n_kv_heads)));
    snap = h2o;
  }
  void on_qkv(const SequenceTaps& t) override {
    const size_t n = size_t(t.T) * c.n_kv_heads * c.head_dim;
    keys[size_t(t.layer)].assign(t.key, t.key + n);
    values[size_t(t.layer)].assign(t.value, t.value + n);
    const size_t qdim = size_t(c.n_heads) * c.head_dim;
    last_q[size_t(t.layer)].assign(t.q + size_t(t.T - observation) * qdim, t.q + size_t(t.T) * qdim);
  }
  void on_probs(const SequenceTaps& t, int q_head, const float* probs, const float*) override {
    const int g = q_head / c.group(), T = t.T;
    std::vector<double>& a = h2o[size_t(t.layer)][size_t(g)];
    std::vector<double>& s = snap[size_t(t.layer)][size_t(g)];
    a.resize(size_t(T), 0.0);
    s.resize(size_t(T), 0.0);
    for (int i = 0; i < T; ++i) {
      const float* row = probs + size_t(i) * T;
      for (int j = 0; j <= i; ++j) a[size_t(j)] += row[j];
      if (i >= T - observation)
        for (int j = 0; j <= i; ++j) s[size_t(j)] += row[j];
    }
  }
};

// The history as the artifact's cache holds it: whole pages past the sink and before the ring
// through the codec (eval/experiment.cpp's append_rows, all at once).
void quantise_history(const CacheScheme& s, const ModelConfig& c, int layer, std::vector<float>& keys,
                      std::vector<float>& values, int64_t n) {
  const CodecPath* path = std::get_if<CodecPath>(&s.path);
  KVCC_REQUIRE(path && path->codec, "eviction: the INT2 scheme needs a codec");
  KvGeometry g;
  g.sink = s.sink;
  g.recent = s.recent;
  g.page_tokens = s.page_size;
  const int64_t post = n - std::min<int64_t>(n, s.sink);
  const int64_t hist = std::min(tiers_of(g, n).hist_tokens, post / s.page_size * s.page_size);
  const size_t kvdim = size_t(c.n_kv_heads) * c.head_dim, page = size_t(s.page_size) * kvdim;
  std::vector<float> out(page);
  for (int64_t p = 0; p < hist; p += s.page_size) {
    const int64_t first = s.sink + p;
    for (const KvSide side : {KvSide::Key, KvSide::Value}) {
      float* base = (side == KvSide::Key ? keys : values).data() + size_t(first) * kvdim;
      path->codec(layer, side, base, s.page_size, first, out.data());
      std::copy(out.begin(), out.end(), base);
    }
  }
}

struct Sums {
  std::vector<double> kl, dnll, top1, merged;  // per conversation
};

}  // namespace

EvictionResult run_eviction(const ModelFile& model, const std::vector<std::vector<int32_t>>& conversations,
                            const Stats* stats, const CacheScheme* int2, const EvictionOptions& o,
                            const std::function<void(int, int)>& progress) {
  const auto t0 = std::chrono::steady_clock::now();
  const ModelConfig& c = model.config();
  const int H = o.history, C = o.continuation, d = c.head_dim, V = c.vocab;
  KVCC_REQUIRE(H >= 1 && C >= 1, "eviction: history and continuation must be positive");
  KVCC_REQUIRE(int64_t(H) + C <= c.max_position || c.max_position <= 0,
               cat("eviction: history + continuation (", H + C, ") exceed the model's context of ", c.max_position));
  KVCC_REQUIRE(o.observation >= 1 && o.observation <= H,
               cat("eviction: the observation window must be in [1, ", H, "], got ", o.observation));
  KVCC_REQUIRE(o.episodes >= 1 && o.block >= 1 && o.block <= H && o.route >= 1 && o.route <= C,
               cat("eviction: epicache needs episodes >= 1, a block in [1, history] and route tokens in [1, "
                   "continuation], got ",
                   o.episodes, ", ", o.block, ", ", o.route));
  for (double r : o.ratios) KVCC_REQUIRE(std::isfinite(r) && r >= 1, cat("eviction: ratios must be >= 1, got ", r));
  KVCC_REQUIRE(o.layer_budgets.empty() || o.layer_budgets.size() == size_t(c.n_layers),
               cat("eviction: ", o.layer_budgets.size(), " layer budgets for a model of ", c.n_layers, " layers"));
  KVCC_REQUIRE(!o.merges.empty(), "eviction: no merge mode (none drops the evicted tokens)");
  KVCC_REQUIRE(std::isfinite(o.merge_threshold), "eviction: the merge threshold must be finite");
  if (stats) {
    KVCC_REQUIRE(
        stats->config.n_layers == c.n_layers && stats->config.n_kv_heads == c.n_kv_heads && stats->config.head_dim == d,
        cat("eviction: the stats are for another model shape (", stats->config.n_layers, " layers, ",
            stats->config.n_kv_heads, " KV heads, head_dim ", stats->config.head_dim, ")"));
  }
  KVCC_REQUIRE(o.prefill_block >= 0, cat("eviction: the prefill block must be >= 0, got ", o.prefill_block));
  const bool blockwise = o.prefill_block > 0;
  std::vector<EvictionScore> scores;
  for (EvictionScore s : o.scores)
    if (((s != EvictionScore::QueryMoment && s != EvictionScore::QueryGaussian) || stats) &&
        !(blockwise && s == EvictionScore::Emitted))
      scores.push_back(s);

  std::vector<LayerWeights> weights;
  for (int l = 0; l < c.n_layers; ++l) weights.push_back(load_layer<float>(model, l));
  const size_t qdim = size_t(c.n_heads) * d, kvdim = size_t(c.n_kv_heads) * d;

  // The query second moments, normalised: E[q qᵀ] per (layer, KV head).
  // and the Gaussian query model: the mean of the reservoir's queries and the covariance.
  QueryStatistics qstats;
  if (stats)
    for (size_t i = 0; i < stats->heads.size(); ++i) {
      const HeadStats& h = stats->heads[i];
      KVCC_REQUIRE(h.query_count > 0, "eviction: the stats hold no queries");
      std::vector<double> m = h.query_m2;
      for (double& v : m) v /= double(h.query_count);
      const Reservoir& res = stats->reservoirs[i];
      const size_t rows = res.size() * size_t(res.group);
      KVCC_REQUIRE(rows > 0 && res.q.size() == rows * size_t(d), "eviction: qgauss needs the stats' reservoir queries");
      std::vector<double> mu(size_t(d), 0.0);
      for (size_t r = 0; r < rows; ++r)
        for (int a = 0; a < d; ++a) mu[size_t(a)] += double(res.q[r * size_t(d) + a]) / double(rows);
      std::vector<double> sigma = m;
      for (int a = 0; a < d; ++a)
        for (int b = 0; b < d; ++b) sigma[size_t(a) * d + b] -= mu[size_t(a)] * mu[size_t(b)];
      qstats.moment.push_back(std::move(m));
      qstats.mean.push_back(std::move(mu));
      qstats.cov.push_back(std::move(sigma));
    }

  struct Variant {
    std::string score;  // eviction_score_name(kind), or "full" (nothing evicted)
    double ratio;
    bool int2;
    EvictionMerge merge = EvictionMerge::None;
    EvictionScore kind = EvictionScore::Window;
  };
  std::vector<Variant> variants;
  for (bool q : {false, true}) {
    if (q && !int2) continue;
    if (q) variants.push_back({"full", 1, true});
    for (EvictionScore s : scores)
      for (double r : o.ratios)
        for (EvictionMerge m : o.merges) variants.push_back({eviction_score_name(s), r, q, m, s});
  }
  std::vector<Sums> sums(variants.size());
  std::vector<int64_t> peak(variants.size(), int64_t(c.n_layers) * H);
  std::vector<double> ref_nll;
  int routed_first = 0;

  std::vector<float> x, q, k, v, attn, logits;
  std::vector<double> lp_ref, lp;
  int done = 0;
  for (const std::vector<int32_t>& conv : conversations) {
    KVCC_REQUIRE(int64_t(conv.size()) == int64_t(H) + C + 1,
                 cat("eviction: a conversation has ", conv.size(), " tokens, expected ", H + C + 1));
    // History prefill in full precision, watched.
    HistoryObserver obs(c, o.observation);
    x.resize(size_t(H) * c.hidden);
    embed(model, conv.data(), H, x.data());
    for (int l = 0; l < c.n_layers; ++l) layer_forward(c, weights[size_t(l)], l, 0, x.data(), H, &obs);

    // EpiCache: the routed episode's patched-prompt scores, [layer][KV head] [H].
    std::vector<std::vector<std::vector<double>>> epi;
    int medoid = -1;
    if (std::find(scores.begin(), scores.end(), EvictionScore::EpiCache) != scores.end()) {
      const int B = o.block, blocks = H / B;
      // A segment's embedding: the mean of its tokens' input embeddings (EpiCache's "llm"
      // embedder), less the mean over the history's blocks. On gutenberg-27m this routes 7 of 16
      // continuations to the passage they continue against 3 for the mean final hidden state of
      // the segment run alone (whose first tokens, a sink, dominate it), and lowers the KL at 4x
      // by 18% (measured).
      auto embed_tokens = [&](const int32_t* ids, int T) {
        std::vector<float> h(size_t(T) * c.hidden);
        embed(model, ids, T, h.data());
        std::vector<double> e(size_t(c.hidden), 0.0);
        for (int t = 0; t < T; ++t)
          for (int a = 0; a < c.hidden; ++a) e[size_t(a)] += double(h[size_t(t) * c.hidden + a]) / double(T);
        return e;
      };
      std::vector<double> rows, mean_row(size_t(c.hidden), 0.0);
      for (int b = 0; b < blocks; ++b) {
        const std::vector<double> e = embed_tokens(conv.data() + size_t(b) * B, B);
        rows.insert(rows.end(), e.begin(), e.end());
        for (int a = 0; a < c.hidden; ++a) mean_row[size_t(a)] += e[size_t(a)] / double(blocks);
      }
      for (int b = 0; b < blocks; ++b)
        for (int a = 0; a < c.hidden; ++a) rows[size_t(b) * c.hidden + a] -= mean_row[size_t(a)];
      const Clusters cl = cosine_kmeans(rows, blocks, c.hidden, o.episodes);
      auto cosine = [&](const double* a, const double* b) {
        double ab = 0, aa = 0, bb = 0;
        for (int i = 0; i < c.hidden; ++i) ab += a[i] * b[i], aa += a[i] * a[i], bb += b[i] * b[i];
        return aa > 0 && bb > 0 ? ab / std::sqrt(aa * bb) : -1.0;
      };
      std::vector<double> query = embed_tokens(conv.data() + H, o.route);
      for (int a = 0; a < c.hidden; ++a) query[size_t(a)] -= mean_row[size_t(a)];
      int routed = 0;
      for (int e = 1; e < cl.k; ++e)
        if (cosine(query.data(), &cl.centroids[size_t(e) * c.hidden]) >
            cosine(query.data(), &cl.centroids[size_t(routed) * c.hidden]))
          routed = e;
      for (int b = 0; b < blocks; ++b)
        if (cl.assignment[size_t(b)] == routed &&
            (medoid < 0 || cosine(&rows[size_t(b) * c.hidden], &cl.centroids[size_t(routed) * c.hidden]) >
                               cosine(&rows[size_t(medoid) * c.hidden], &cl.centroids[size_t(routed) * c.hidden])))
          medoid = b;
      routed_first += int64_t(medoid) * B < H / o.passages;
    }
    if (medoid >= 0 && !blockwise) {
      const int B = o.block;
      // The medoid block appended after the history: its queries' attention on every history key.
      epi.assign(size_t(c.n_layers),
                 std::vector<std::vector<double>>(size_t(c.n_kv_heads), std::vector<double>(size_t(H), 0.0)));
      std::vector<float> px(size_t(B) * c.hidden), pq(size_t(B) * qdim), pk(size_t(B) * kvdim), pv(size_t(B) * kvdim),
          pa(size_t(B) * qdim);
      std::vector<std::vector<int32_t>> everything(size_t(c.n_kv_heads), std::vector<int32_t>(size_t(H)));
      for (auto& e : everything) std::iota(e.begin(), e.end(), 0);
      embed(model, conv.data() + size_t(medoid) * B, B, px.data());
      for (int l = 0; l < c.n_layers; ++l) {
        attention_qkv(c, weights[size_t(l)], px.data(), B, H, pq.data(), nullptr, pk.data(), pv.data());
        const std::vector<float> no_mass(size_t(H), 0.0f);
        for (int g = 0; g < c.n_kv_heads; ++g) {
          std::vector<double> w(size_t(H + B), 0.0);
          add_block_weights(c, pq.data(), B, 0, obs.keys[size_t(l)].data(), everything[size_t(g)], no_mass, pk.data(),
                            g, w);
          w.resize(size_t(H));
          epi[size_t(l)][size_t(g)] = std::move(w);
        }
        attention_over_kept(c, H, B, pq.data(), obs.keys[size_t(l)].data(), obs.values[size_t(l)].data(), everything,
                            pk.data(), pv.data(), pa.data());
        attention_output_and_mlp(c, weights[size_t(l)], pa.data(), B, px.data());
      }
    }

    // Kept sets of one score and budget, per layer and KV head.
    std::vector<std::vector<float>> qkeys, qvalues;  // the history through the INT2 codec
    if (int2) {
      qkeys = obs.keys;
      qvalues = obs.values;
      for (int l = 0; l < c.n_layers; ++l) quantise_history(*int2, c, l, qkeys[size_t(l)], qvalues[size_t(l)], H);
    }
    // quantised: the cache holds the history through the INT2 codec (what "emitted" reads).
    auto budgets_of = [&](double ratio) {
      const int64_t budget = int64_t(std::ceil(double(H) / ratio));
      return o.layer_budgets.empty() ? std::vector<int64_t>(size_t(c.n_layers), budget)
                                     : allocate_layer_budgets(o.layer_budgets, budget * c.n_layers,
                                                              std::min<int64_t>(H, int64_t(o.sink) + o.recent), H);
    };
    auto kept_sets = [&](const std::string& score, double ratio, bool quantised) {
      const std::vector<int64_t> budgets = budgets_of(ratio);
      std::vector<std::vector<std::vector<int32_t>>> kept(size_t(c.n_layers));
      for (int l = 0; l < c.n_layers; ++l)
        for (int g = 0; g < c.n_kv_heads; ++g) {
          std::vector<double> sc;
          const float* keys = obs.keys[size_t(l)].data() + size_t(g) * d;
          if (score == "h2o") sc = obs.h2o[size_t(l)][size_t(g)];
          else if (score == "snapkv") sc = max_pool(obs.snap[size_t(l)][size_t(g)], o.pool);
          else if (score == "vatp")  // the values as the cache holds them (through the codec on int2 rows)
            sc = max_pool(
                value_aware_scores(obs.snap[size_t(l)][size_t(g)],
                                   (quantised ? qvalues : obs.values)[size_t(l)].data() + size_t(g) * d, H, kvdim, d),
                o.pool);
          else if (score == "emitted")
            sc = max_pool(observation_scores(c, obs.last_q[size_t(l)].data(), o.observation,
                                             (quantised ? qkeys : obs.keys)[size_t(l)].data(), H, g),
                          o.pool);
          else if (score == "qmoment")
            sc = query_moment_scores(qstats.moment[size_t(l) * c.n_kv_heads + g], keys, H, kvdim, d);
          else if (score == "qgauss") {
            const size_t i = size_t(l) * c.n_kv_heads + g;
            sc = query_gaussian_scores(qstats.mean[i], qstats.cov[i], keys, H, kvdim, d);
          } else if (score == "epicache") {
            sc = max_pool(epi[size_t(l)][size_t(g)], o.pool);
          } else if (score == "keynorm") {
            sc.resize(size_t(H));
            for (int j = 0; j < H; ++j) {
              double s = 0;
              for (int a = 0; a < d; ++a) s += double(keys[size_t(j) * kvdim + a]) * keys[size_t(j) * kvdim + a];
              sc[size_t(j)] = s;
            }
          } else {
            KVCC_REQUIRE(score == "window" || score == "full", "eviction: unknown score '" + score + "'");
          }
          kept[size_t(l)].push_back(select_kept(sc, H, budgets[size_t(l)], o.sink, o.recent));
        }
      return kept;
    };
    // The continuation over a kept history: log-probabilities of its C predictions.
    // hk / hv: per layer, the history's rows as the cache holds them; log_mass: per layer and KV
    // head, merge_evicted's term for each kept row (null: none).
    using Rows = std::vector<std::vector<float>>;
    auto continuation = [&](const std::vector<std::vector<std::vector<int32_t>>>& kept, const Rows& hist_k,
                            const Rows& hist_v, const std::vector<Rows>* log_mass, std::vector<double>& out) {
      x.resize(size_t(C) * c.hidden);
      embed(model, conv.data() + H, C, x.data());
      q.resize(size_t(C) * qdim);
      k.resize(size_t(C) * kvdim);
      v.resize(size_t(C) * kvdim);
      attn.resize(size_t(C) * qdim);
      for (int l = 0; l < c.n_layers; ++l) {
        attention_qkv(c, weights[size_t(l)], x.data(), C, H, q.data(), nullptr, k.data(), v.data());
        attention_over_kept(c, H, C, q.data(), hist_k[size_t(l)].data(), hist_v[size_t(l)].data(), kept[size_t(l)],
                            k.data(), v.data(), attn.data(), log_mass ? &(*log_mass)[size_t(l)] : nullptr);
        attention_output_and_mlp(c, weights[size_t(l)], attn.data(), C, x.data());
      }
      logits.resize(size_t(C) * V);
      final_logits(model, x.data(), C, logits.data());
      out.assign(size_t(C) * V, 0.0);
      for (int t = 0; t < C; ++t) {
        const float* row = logits.data() + size_t(t) * V;
        double m = row[0];
        for (int u = 1; u < V; ++u) m = std::max(m, double(row[u]));
        double s = 0;
        for (int u = 0; u < V; ++u) s += std::exp(double(row[u]) - m);
        const double lse = m + std::log(s);
        for (int u = 0; u < V; ++u) out[size_t(t) * V + u] = double(row[u]) - lse;
      }
    };
    // The evicted tokens merged into the kept ones (full precision), then, on int2 rows, the
    // merged history through the codec: the cache stores the merged rows.
    Rows mk, mv;
    std::vector<Rows> log_mass;
    auto merge_into_kept = [&](const std::vector<std::vector<std::vector<int32_t>>>& kept, const std::string& score,
                               EvictionMerge merge, bool quantised) {
      mk = obs.keys;
      mv = obs.values;
      log_mass.assign(size_t(c.n_layers), Rows(size_t(c.n_kv_heads)));
      int64_t merged = 0, evicted = 0;
      for (int l = 0; l < c.n_layers; ++l)
        for (int g = 0; g < c.n_kv_heads; ++g) {
          // The attention mass of the score's queries (epicache: the episode's medoid block).
          const std::vector<double> mass =
              floored_masses(score == "epicache" ? epi[size_t(l)][size_t(g)] : obs.snap[size_t(l)][size_t(g)]);
          const std::vector<int32_t>& kg = kept[size_t(l)][size_t(g)];
          int64_t m = 0;
          log_mass[size_t(l)][size_t(g)] =
              merge_evicted(merge, o.merge_threshold, mk[size_t(l)].data() + size_t(g) * d,
                            mv[size_t(l)].data() + size_t(g) * d, H, kvdim, d, kg, mass, &m);
          merged += m;
          evicted += H - int64_t(kg.size());
        }
      if (quantised)
        for (int l = 0; l < c.n_layers; ++l) quantise_history(*int2, c, l, mk[size_t(l)], mv[size_t(l)], H);
      return evicted > 0 ? double(merged) / double(evicted) : 0.0;
    };
    const auto all = kept_sets("full", 1.0, false);
    continuation(all, obs.keys, obs.values, nullptr, lp_ref);
    double nll = 0;
    for (int t = 0; t < C; ++t) nll -= lp_ref[size_t(t) * V + conv[size_t(H + t + 1)]];
    ref_nll.push_back(nll / C);
    // Block-wise prefills by (score, ratio, merge): the int2 rows quantise the same rows.
    std::map<std::string, BlockPrefill> prefilled;
    for (size_t vi = 0; vi < variants.size(); ++vi) {
      const Variant& var = variants[vi];
      double merged = 0;
      if (blockwise && var.score != "full") {
        const std::string key = cat(var.score, ' ', var.ratio, ' ', eviction_merge_name(var.merge));
        auto it = prefilled.find(key);
        if (it == prefilled.end())
          it =
              prefilled
                  .emplace(key, block_prefill(model, weights, conv.data(), H, var.kind, budgets_of(var.ratio),
                                              var.merge, medoid >= 0 ? conv.data() + size_t(medoid) * o.block : nullptr,
                                              o, stats ? &qstats : nullptr))
                  .first;
        const BlockPrefill& bp = it->second;
        peak[vi] = bp.peak_rows;
        merged = bp.evicted > 0 ? double(bp.merged) / double(bp.evicted) : 0.0;
        if (var.int2) {
          mk = bp.keys;
          mv = bp.values;
          for (int l = 0; l < c.n_layers; ++l) quantise_history(*int2, c, l, mk[size_t(l)], mv[size_t(l)], H);
          continuation(bp.kept, mk, mv, &bp.log_mass, lp);
        } else {
          continuation(bp.kept, bp.keys, bp.values, &bp.log_mass, lp);
        }
      } else {
        if (var.score == "epicache") peak[vi] = int64_t(c.n_layers) * (H + o.block);  // the medoid block too
        const auto kept = var.score == "full" ? all : kept_sets(var.score, var.ratio, var.int2);
        if (var.merge == EvictionMerge::None) {
          continuation(kept, var.int2 ? qkeys : obs.keys, var.int2 ? qvalues : obs.values, nullptr, lp);
        } else {
          merged = merge_into_kept(kept, var.score, var.merge, var.int2);
          continuation(kept, mk, mv, &log_mass, lp);
        }
      }
      double kl = 0, dn = 0, top1 = 0;
      for (int t = 0; t < C; ++t) {
        const double* a = lp_ref.data() + size_t(t) * V;
        const double* b = lp.data() + size_t(t) * V;
        int am = 0, bm = 0;
        for (int u = 0; u < V; ++u) {
          kl += std::exp(a[u]) * (a[u] - b[u]);
          if (a[u] > a[am]) am = u;
          if (b[u] > b[bm]) bm = u;
        }
        top1 += am == bm;
        const int32_t target = conv[size_t(H + t + 1)];
        dn += a[target] - b[target];
      }
      sums[vi].kl.push_back(kl / C);
      sums[vi].dnll.push_back(dn / C);
      sums[vi].top1.push_back(top1 / C);
      sums[vi].merged.push_back(merged);
    }
    if (progress) progress(++done, int(conversations.size()));
  }

  EvictionResult res;
  res.history = H;
  res.layers = c.n_layers;
  res.continuation = C;
  res.passages = o.passages;
  res.conversations = int(conversations.size());
  res.sink = o.sink;
  res.recent = o.recent;
  res.layer_budgets = o.layer_budgets;
  res.merge_threshold = o.merge_threshold;
  res.prefill_block = o.prefill_block;
  const std::vector<double> w(conversations.size(), 1.0);
  auto mean = [](const std::vector<double>& x) { return std::accumulate(x.begin(), x.end(), 0.0) / double(x.size()); };
  res.reference_nll = mean(ref_nll);
  if (std::find(scores.begin(), scores.end(), EvictionScore::EpiCache) != scores.end())
    res.epicache_routed_first = routed_first;
  for (size_t vi = 0; vi < variants.size(); ++vi) {
    EvictionRow row;
    row.score = variants[vi].score;
    row.ratio = variants[vi].ratio;
    row.int2 = variants[vi].int2;
    row.merge = eviction_merge_name(variants[vi].merge);
    row.merged = mean(sums[vi].merged);
    row.kl = mean(sums[vi].kl);
    row.kl_stderr = clustered_standard_error(sums[vi].kl, w);
    row.delta_nll = mean(sums[vi].dnll);
    row.delta_nll_stderr = clustered_standard_error(sums[vi].dnll, w);
    row.top1 = mean(sums[vi].top1);
    row.peak_rows = peak[vi];
    res.rows.push_back(row);
  }
  res.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return res;
}

}  // namespace kvcc
