#include "compile/fit.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <unordered_map>

#include "formats/codec_scalar.h"
#include "formats/error.h"

namespace kvcc {

// ---- Lloyd–Max -------------------------------------------------------------------------------

std::vector<double> lloyd_max_density(const std::function<double(double)>& pdf, double lo, double hi, int bits) {
  KVCC_REQUIRE(bits >= 1 && bits <= 8, "Lloyd–Max needs 1..8 bits");
  const int n_levels = 1 << bits;
  const int grid = 200000;
  const double h = (hi - lo) / grid;
  // Cumulative ∫f and ∫x f on the grid (trapezoid), so a cell's mass and centroid come from two
  // interpolated differences.
  std::vector<double> mass(size_t(grid) + 1, 0.0), moment(size_t(grid) + 1, 0.0);
  double f_prev = pdf(lo);
  for (int i = 1; i <= grid; ++i) {
    const double x0 = lo + (i - 1) * h, x1 = lo + i * h;
    const double f1 = pdf(x1);
    mass[size_t(i)] = mass[size_t(i) - 1] + 0.5 * h * (f_prev + f1);
    moment[size_t(i)] = moment[size_t(i) - 1] + 0.5 * h * (x0 * f_prev + x1 * f1);
    f_prev = f1;
  }
  auto cumulative = [&](const std::vector<double>& c, double x) {
    if (x <= lo) return c.front();
    if (x >= hi) return c.back();
    const double u = (x - lo) / h;
    const size_t i = std::min(size_t(u), size_t(grid) - 1);
    const double frac = u - double(i);
    return c[i] + frac * (c[i + 1] - c[i]);
  };
  // Start from equal-mass quantiles' midpoints.
  std::vector<double> levels(static_cast<size_t>(n_levels));
  {
    size_t j = 0;
    for (int k = 0; k < n_levels; ++k) {
      const double target = (k + 0.5) / n_levels * mass.back();
      while (j < size_t(grid) && mass[j] < target) ++j;
      levels[size_t(k)] = lo + double(j) * h;
    }
  }
  for (int iter = 0; iter < 20000; ++iter) {
    double change = 0.0;
    std::vector<double> next(levels.size());
    for (int k = 0; k < n_levels; ++k) {
      const double a = k == 0 ? lo : 0.5 * (levels[size_t(k) - 1] + levels[size_t(k)]);
      const double b = k == n_levels - 1 ? hi : 0.5 * (levels[size_t(k)] + levels[size_t(k) + 1]);
      const double m = cumulative(mass, b) - cumulative(mass, a);
      next[size_t(k)] = m > 0 ? (cumulative(moment, b) - cumulative(moment, a)) / m : levels[size_t(k)];
      change = std::max(change, std::fabs(next[size_t(k)] - levels[size_t(k)]));
    }
    levels = next;
    if (change < 1e-13) break;
  }
  return levels;
}

std::vector<double> lloyd_max_gaussian(int bits) {
  return lloyd_max_density([](double x) { return std::exp(-0.5 * x * x); }, -10.0, 10.0, bits);
}

std::vector<double> lloyd_max_sphere(int d, int bits) {
  KVCC_REQUIRE(d >= 3, "the sphere-coordinate density needs d >= 3, got " + std::to_string(d));
  const double power = 0.5 * (d - 3);
  std::vector<double> levels =
      lloyd_max_density([power](double x) { return std::pow(std::max(0.0, 1.0 - x * x), power); }, -1.0, 1.0, bits);
  for (double& l : levels) l *= std::sqrt(double(d));
  return levels;
}

double level_mse(const std::vector<float>& samples, const std::vector<double>& levels) {
  double se = 0.0;
  for (float s : samples) {
    double best = std::numeric_limits<double>::infinity();
    for (double l : levels) best = std::min(best, (s - l) * (s - l));
    se += best;
  }
  return samples.empty() ? 0.0 : se / double(samples.size());
}

std::vector<double> lloyd_max_empirical(std::vector<float> samples, int bits, int iterations) {
  KVCC_REQUIRE(!samples.empty(), "Lloyd–Max: no samples to fit");
  std::sort(samples.begin(), samples.end());
  const size_t n = samples.size();
  std::vector<double> prefix(n + 1, 0.0);
  double sq = 0.0;
  for (size_t i = 0; i < n; ++i) {
    prefix[i + 1] = prefix[i] + samples[i];
    sq += double(samples[i]) * samples[i];
  }
  const double rms = std::sqrt(sq / double(n));
  std::vector<double> levels = lloyd_max_gaussian(bits);
  for (double& l : levels) l *= rms > 0 ? rms : 1.0;
  const int n_levels = 1 << bits;
  for (int iter = 0; iter < iterations; ++iter) {
    double change = 0.0;
    size_t start = 0;
    for (int k = 0; k < n_levels; ++k) {
      size_t end = n;
      if (k + 1 < n_levels) {
        // Codec ties go to the lower level (table_code uses x > midpoint), so the cell is (a, b].
        const float b = float(0.5 * (levels[size_t(k)] + levels[size_t(k) + 1]));
        end = size_t(std::upper_bound(samples.begin(), samples.end(), b) - samples.begin());
      }
      if (end > start) {
        const double c = (prefix[end] - prefix[start]) / double(end - start);
        change = std::max(change, std::fabs(c - levels[size_t(k)]));
        levels[size_t(k)] = c;
      }
      start = std::max(start, end);
    }
    std::sort(levels.begin(), levels.end());
    if (change < 1e-9 * (rms > 0 ? rms : 1.0)) break;
  }
  return levels;
}

// ---- Rows and error metrics -------------------------------------------------------------------

FitRows select_rows(const Reservoir& res, bool heldout, int max_rows) {
  return select_aligned_rows({&res}, heldout, max_rows)[0];
}

std::vector<FitRows> select_aligned_rows(const std::vector<const Reservoir*>& reservoirs, bool heldout, int max_rows) {
  KVCC_REQUIRE(!reservoirs.empty(), "select_aligned_rows: no reservoirs");
  auto token = [](const Reservoir& r, size_t i) { return (uint64_t(r.doc[i]) << 32) | uint32_t(r.position[i]); };
  // Row index of every token, per reservoir after the first.
  std::vector<std::unordered_map<uint64_t, size_t>> index(reservoirs.size());
  for (size_t k = 1; k < reservoirs.size(); ++k)
    for (size_t i = 0; i < reservoirs[k]->size(); ++i) index[k].emplace(token(*reservoirs[k], i), i);
  std::vector<FitRows> rows(reservoirs.size());
  for (size_t k = 0; k < reservoirs.size(); ++k) rows[k].d = reservoirs[k]->d;
  const Reservoir& first = *reservoirs[0];
  std::vector<size_t> at(reservoirs.size());
  for (size_t i = 0; i < first.size() && rows[0].n < max_rows; ++i) {
    if (bool(first.heldout[i]) != heldout) continue;
    at[0] = i;
    bool everywhere = true;
    for (size_t k = 1; k < reservoirs.size() && everywhere; ++k) {
      auto it = index[k].find(token(first, i));
      everywhere = it != index[k].end();
      if (everywhere) at[k] = it->second;
    }
    if (!everywhere) continue;
    for (size_t k = 0; k < reservoirs.size(); ++k) {
      const Reservoir& res = *reservoirs[k];
      const long d = res.d, r = res.group, j = long(at[k]);
      FitRows& out = rows[k];
      out.key.insert(out.key.end(), res.key.begin() + j * d, res.key.begin() + (j + 1) * d);
      out.value.insert(out.value.end(), res.value.begin() + j * d, res.value.begin() + (j + 1) * d);
      out.query.insert(out.query.end(), res.q.begin() + j * r * d, res.q.begin() + (j + 1) * r * d);
      ++out.n;
      out.nq += int(r);
    }
  }
  return rows;
}

const std::vector<double>& clip_ratio_grid() {
  static const std::vector<double> grid = {1.0,  0.995, 0.99, 0.98, 0.97, 0.96, 0.95, 0.94,
                                           0.93, 0.92,  0.90, 0.88, 0.85, 0.80, 0.75};
  return grid;
}

std::vector<float> query_metric(const std::vector<float>& query, int nq, int d) {
  std::vector<float> m(size_t(d) * d, 0.0f);
  if (nq == 0) return m;
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, d, d, nq, 1.0f, query.data(), d, query.data(), d, 0.0f, m.data(),
              d);
  return m;
}

double weighted_logit_error(const std::vector<float>& error, int n, const std::vector<float>& metric, int d) {
  if (n == 0) return 0.0;
  std::vector<float> f(size_t(n) * d);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, d, d, 1.0f, error.data(), d, metric.data(), d, 0.0f,
              f.data(), d);
  double total = 0.0;
  for (size_t i = 0; i < f.size(); ++i) total += double(f[i]) * error[i];
  return total;
}

std::vector<float> attention_probs(const std::vector<float>& query, int nq, const std::vector<float>& key, int n,
                                   int d) {
  std::vector<float> p(size_t(nq) * n);
  if (nq == 0 || n == 0) return p;
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nq, n, d, float(1.0 / std::sqrt(double(d))), query.data(), d,
              key.data(), d, 0.0f, p.data(), n);
  for (int i = 0; i < nq; ++i) {
    float* row = &p[size_t(i) * n];
    const float mx = *std::max_element(row, row + n);
    double sum = 0.0;
    for (int j = 0; j < n; ++j) sum += (row[j] = std::exp(row[j] - mx));
    const float inv = float(1.0 / sum);
    for (int j = 0; j < n; ++j) row[j] *= inv;
  }
  return p;
}

double gram_error(const std::vector<float>& gram, int n, const std::vector<float>& error, int d) {
  if (n == 0) return 0.0;
  std::vector<float> ge(size_t(n) * d);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, d, n, 1.0f, gram.data(), n, error.data(), d, 0.0f,
              ge.data(), d);
  double total = 0.0;
  for (size_t i = 0; i < ge.size(); ++i) total += double(ge[i]) * error[i];
  return total;
}

double output_error(const std::vector<float>& probs, int nq, const std::vector<float>& error, int n, int d) {
  if (nq == 0 || n == 0) return 0.0;
  std::vector<float> pe(size_t(nq) * d);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, nq, d, n, 1.0f, probs.data(), n, error.data(), d, 0.0f,
              pe.data(), d);
  double total = 0.0;
  for (float x : pe) total += double(x) * x;
  return total;
}

double fit_clip_ratio(const Recipe& recipe, const SideArtifact& side, KvSide which, const FitRows& rows,
                      double* best_error, double* no_clip_error) {
  return fit_clip_ratio(recipe, std::vector<const SideArtifact*>{&side}, which, std::vector<FitRows>{rows}, best_error,
                        no_clip_error);
}

std::vector<float> rotated_side_by_side(const std::vector<const SideArtifact*>& sides, KvSide which,
                                        const std::vector<FitRows>& rows, bool float64) {
  KVCC_REQUIRE(!sides.empty() && sides.size() == rows.size(), "rotated_side_by_side: one row set per side");
  const int d = rows[0].d, n = rows[0].n, span = int(sides.size()), w = span * d;
  std::vector<float> out(size_t(n) * w), block(size_t(n) * d);
  for (int k = 0; k < span; ++k) {
    KVCC_REQUIRE(rows[size_t(k)].n == n && rows[size_t(k)].d == d, "rotated_side_by_side: rows are not aligned");
    const std::vector<float>& x = which == KvSide::Key ? rows[size_t(k)].key : rows[size_t(k)].value;
    if (float64) {
      rotate_rows(sides[size_t(k)]->rotation, d, x.data(), n, block.data());
    } else {
      const std::vector<float> rot(sides[size_t(k)]->rotation.begin(), sides[size_t(k)]->rotation.end());
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, d, d, 1.0f, x.data(), d, rot.data(), d, 0.0f,
                  block.data(), d);
    }
    for (int t = 0; t < n; ++t) std::copy_n(&block[size_t(t) * d], d, &out[size_t(t) * w + size_t(k) * d]);
  }
  return out;
}

double fit_clip_ratio(const Recipe& recipe, const std::vector<const SideArtifact*>& sides, KvSide which,
                      const std::vector<FitRows>& rows, double* best_error, double* no_clip_error) {
  KVCC_REQUIRE(!sides.empty() && sides.size() == rows.size(), "clip-ratio fitting: one row set per side");
  const int d = rows[0].d, n = rows[0].n, span = int(sides.size()), w = span * d;
  KVCC_REQUIRE(n > 0, "clip-ratio fitting: the reservoir has no fitting rows (heldout == 0)");
  // Errors are basis-independent, so both metrics are evaluated in each head's rotated basis.
  const std::vector<float> y = rotated_side_by_side(sides, which, rows, false);
  // Per head: the key metric Rᵀ (Σ q qᵀ) R [d, d], or the value Gram matrix PᵀP [n, n]
  // (Σ_i ‖Σ_j p_ij e_j‖² = Σ_jl (PᵀP)_jl e_j·e_l: one matrix serves every candidate).
  std::vector<std::vector<float>> metrics(static_cast<size_t>(span));
  for (int k = 0; k < span; ++k) {
    const FitRows& r = rows[size_t(k)];
    std::vector<float>& metric = metrics[size_t(k)];
    if (which == KvSide::Key) {
      const std::vector<float> rot(sides[size_t(k)]->rotation.begin(), sides[size_t(k)]->rotation.end());
      const std::vector<float> m = query_metric(r.query, r.nq, d);
      std::vector<float> mr(size_t(d) * d);
      metric.resize(size_t(d) * d);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, d, d, d, 1.0f, m.data(), d, rot.data(), d, 0.0f, mr.data(),
                  d);
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, d, d, d, 1.0f, rot.data(), d, mr.data(), d, 0.0f,
                  metric.data(), d);
    } else {
      // Attention weights only need q·k, which any common rotation preserves: use the raw rows.
      const std::vector<float> probs = attention_probs(r.query, r.nq, r.key, n, d);
      metric.resize(size_t(n) * n);
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, n, n, r.nq, 1.0f, probs.data(), n, probs.data(), n, 0.0f,
                  metric.data(), n);
    }
  }
  const int group = recipe.group > 0 ? recipe.group : d;
  SideArtifact candidate = *sides[0];
  std::vector<float> yq(y.size()), err(size_t(n) * d);
  double best = std::numeric_limits<double>::infinity(), best_ratio = 1.0, none = 0.0;
  int last_rank = -1;
  for (double ratio : clip_ratio_grid()) {
    const int rank = clip_rank(ratio, group);
    if (rank == last_rank) continue;  // same threshold as the previous candidate
    last_rank = rank;
    candidate.clip_ratio = ratio;
    roundtrip_rotated(recipe, candidate, which, w, y.data(), n, yq.data());
    double e = 0.0;
    for (int k = 0; k < span; ++k) {
      for (int t = 0; t < n; ++t)
        for (int i = 0; i < d; ++i) {
          const size_t at = size_t(t) * w + size_t(k) * d + size_t(i);
          err[size_t(t) * d + size_t(i)] = y[at] - yq[at];
        }
      e += which == KvSide::Key ? weighted_logit_error(err, n, metrics[size_t(k)], d)
                                : gram_error(metrics[size_t(k)], n, err, d);
    }
    if (ratio == 1.0) none = e;
    if (e < best) {
      best = e;
      best_ratio = ratio;
    }
  }
  if (best_error) *best_error = best;
  if (no_clip_error) *no_clip_error = none;
  return best_ratio;
}

std::vector<float> normalised_coordinates(const std::vector<float>& rotated, int n, int d, int group) {
  std::vector<float> out;
  out.reserve(rotated.size());
  for (int t = 0; t < n; ++t)
    for (int g0 = 0; g0 < d; g0 += group) {
      const float* x = &rotated[size_t(t) * d + g0];
      float ss = 0.0f;
      for (int i = 0; i < group; ++i) ss += x[i] * x[i];
      float s = round_f16(std::sqrt(ss / float(group)));
      if (!(s > 0.0f) || std::isinf(s)) s = 1.0f;  // as quantize_table
      for (int i = 0; i < group; ++i) out.push_back(x[i] / s);
    }
  return out;
}

}  // namespace kvcc
