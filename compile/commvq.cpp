#include "compile/commvq.h"

#include <cblas.h>
// lapack_complex_double = std::complex<double>
#include <complex>
#define lapack_complex_float std::complex<float>
#define lapack_complex_double std::complex<double>
#include <lapacke.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <complex>
#include <cstdio>
#include <limits>
#include <thread>

#include "formats/error.h"
#include "formats/fp16.h"

namespace kvcc {

namespace {

// Rows per GEMM chunk and per E-step work unit. Work units are fixed-size and their partial sums
// are reduced in order, so results do not depend on the thread count.
constexpr size_t kChunkRows = 4096;
constexpr size_t kUnitRows = 256;
// Soft weights below exp(−kCutoff) are dropped (they cannot change a sum at float precision).
constexpr float kCutoff = 25.0f;

uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// `count` row indices drawn without replacement from [0, n) (all of them, then repeats, if n < count),
// by a partial Fisher–Yates shuffle on a splitmix64 stream: the same on every platform.
std::vector<size_t> sample_rows(size_t n, size_t count, uint64_t seed) {
  std::vector<size_t> idx(n);
  for (size_t i = 0; i < n; ++i) idx[i] = i;
  uint64_t state = seed;
  const size_t take = std::min(n, count);
  for (size_t i = 0; i < take; ++i) {
    const size_t j = i + size_t(splitmix64(state) % uint64_t(n - i));
    std::swap(idx[i], idx[j]);
  }
  std::vector<size_t> out(count);
  for (size_t i = 0; i < count; ++i) out[i] = idx[i % take];
  return out;
}

int thread_count(int requested) {
  if (requested > 0) return requested;
  const unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : int(std::min(hw, 16u));
}

// Runs fn(unit) for units 0..count-1 on up to `threads` workers.
template <class Fn>
void parallel_units(size_t count, int threads, Fn fn) {
  const size_t workers = std::min(size_t(threads), count);
  if (workers <= 1) {
    for (size_t u = 0; u < count; ++u) fn(u);
    return;
  }
  std::vector<std::thread> pool;
  for (size_t w = 0; w < workers; ++w)
    pool.emplace_back([&, w] {
      for (size_t u = w; u < count; u += workers) fn(u);
    });
  for (auto& t : pool) t.join();
}

double mean_energy(const std::vector<float>& z, size_t n, int d) {
  double s = 0.0;
  for (size_t i = 0; i < n * size_t(d); ++i) s += double(z[i]) * z[i];
  return n ? s / double(n) : 0.0;
}

// Seeded subsample of the rows (all rows when max_rows is 0 or not smaller than n).
std::vector<size_t> training_rows(size_t n, size_t max_rows, uint64_t seed) {
  if (max_rows == 0 || max_rows >= n) {
    std::vector<size_t> all(n);
    for (size_t i = 0; i < n; ++i) all[i] = i;
    return all;
  }
  auto rows = sample_rows(n, max_rows, seed ^ 0x5eed5a3b1e5ull);
  std::sort(rows.begin(), rows.end());
  return rows;
}

double temperature_factor(const CommvqTrainOptions& o, int it) {
  if (o.iterations <= 1) return o.temp_end;
  const double f = double(it) / double(o.iterations - 1);
  return o.temp_start * std::pow(o.temp_end / o.temp_start, f);
}

void report_stage(const CommvqTrainOptions& o, const char* side, int r, int stages, const CommvqStageReport& s) {
  if (!o.progress) return;
  char line[200];
  std::snprintf(line, sizeof line, "commvq %s stage %d/%d: error %.6f -> %.6f (%zu iterations, best %d, %.2f s)", side,
                r + 1, stages, s.error_before, s.error_after, s.iteration_error.size(), s.best_iteration, s.seconds);
  o.progress(line);
}

// ---- keys ----

// Sums one EM pass needs, accumulated over all rows.
struct KeyPass {
  double hard_error = 0;       // Σ_i min_ab D_i,ab
  std::vector<double> counts;  // n_ab [K²]
  std::vector<double> sums;    // [2K, d]: rows 0..K-1 Σ_i A_ik z_i, rows K..2K-1 Σ_i B_ik z_i
};

// One E-step pass over z [n, d] with centre parameters t [K, d] at temperature T (T <= 0: hard
// error only).
KeyPass key_pass(const float* z, size_t n, int d, int K, const std::vector<float>& t, double T, int threads) {
  const size_t K2 = size_t(K) * K;
  std::vector<float> it(size_t(K) * d), gram(K2);
  commvq_key_stage_tables(t.data(), K, d, it.data(), gram.data());
  std::vector<float> basis(size_t(2 * K) * d);  // [t; i·t]
  std::copy(t.begin(), t.end(), basis.begin());
  std::copy(it.begin(), it.end(), basis.begin() + size_t(K) * d);

  KeyPass pass;
  pass.counts.assign(K2, 0.0);
  pass.sums.assign(size_t(2 * K) * d, 0.0);
  const bool soft = T > 0;
  const float inv_T = soft ? float(1.0 / T) : 0.0f;
  std::vector<float> pq(kChunkRows * size_t(2 * K));
  std::vector<float> marg(kChunkRows * size_t(2 * K));  // [m, 2K]: A (over b) then B (over a)
  std::vector<float> chunk_sums(size_t(2 * K) * d);
  const size_t units_per_chunk = kChunkRows / kUnitRows;
  std::vector<double> unit_counts(soft ? units_per_chunk * K2 : 0);
  std::vector<double> unit_hard(units_per_chunk);
  std::vector<std::vector<float>> scratch(static_cast<size_t>(threads), std::vector<float>(K2));
  std::vector<std::vector<uint32_t>> near_lists(static_cast<size_t>(threads));

  for (size_t c0 = 0; c0 < n; c0 += kChunkRows) {
    const size_t m = std::min(kChunkRows, n - c0);
    const float* zc = z + c0 * size_t(d);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(m), 2 * K, d, 1.0f, zc, d, basis.data(), d, 0.0f,
                pq.data(), 2 * K);
    const size_t units = (m + kUnitRows - 1) / kUnitRows;
    if (soft) std::fill(unit_counts.begin(), unit_counts.end(), 0.0);
    std::fill(marg.begin(), marg.end(), 0.0f);
    // Each worker owns scratch[worker]; units map to workers round-robin inside parallel_units,
    // so the worker index is recovered from the unit.
    const size_t workers = std::max<size_t>(1, std::min(size_t(threads), units));
    parallel_units(units, int(workers), [&](size_t u) {
      float* dist = scratch[u % workers].data();
      std::vector<uint32_t>& near = near_lists[u % workers];
      double hard = 0.0;
      double* counts = soft ? unit_counts.data() + u * K2 : nullptr;
      const size_t r_end = std::min(m, (u + 1) * kUnitRows);
      for (size_t i = u * kUnitRows; i < r_end; ++i) {
        const float* p = pq.data() + i * size_t(2 * K);
        const float* q = p + K;
        const float* zi = zc + i * size_t(d);
        float zz = 0.0f;
        for (int c = 0; c < d; ++c) zz += zi[c] * zi[c];
        // Distances, with the minimum kept in 8 lanes so the loop vectorises.
        float lane_min[8];
        std::fill(lane_min, lane_min + 8, std::numeric_limits<float>::infinity());
        for (int a = 0; a < K; ++a) {
          const float* g = gram.data() + size_t(a) * K;
          float* drow = dist + size_t(a) * K;
          const float pa2 = 2.0f * p[a];
          for (int b = 0; b < K; ++b) drow[b] = g[b] - pa2 - 2.0f * q[b];
          for (int b = 0; b + 8 <= K; b += 8)
            for (int l = 0; l < 8; ++l) lane_min[l] = drow[b + l] < lane_min[l] ? drow[b + l] : lane_min[l];
          for (int b = K - K % 8; b < K; ++b) lane_min[0] = std::min(lane_min[0], drow[b]);
        }
        const float dmin = *std::min_element(lane_min, lane_min + 8);
        hard += std::max(0.0f, zz + dmin);
        if (!soft) continue;
        // Soft weights of the centres within kCutoff temperatures of the nearest (a sparse list:
        // at the annealed temperatures only a few centres per row survive).
        const float limit = dmin + kCutoff * float(T);
        near.clear();
        for (size_t ab = 0; ab < K2; ++ab)
          if (dist[ab] < limit) near.push_back(uint32_t(ab));
        if (near.empty()) near.push_back(uint32_t(std::min_element(dist, dist + K2) - dist));
        float total = 0.0f;
        for (uint32_t ab : near) {
          dist[ab] = std::exp(-(dist[ab] - dmin) * inv_T);
          total += dist[ab];
        }
        const float inv_total = 1.0f / total;
        float* A = marg.data() + i * size_t(2 * K);
        float* B = A + K;
        for (uint32_t ab : near) {
          const float w = dist[ab] * inv_total;
          counts[ab] += w;
          A[ab / K] += w;
          B[ab % K] += w;
        }
      }
      unit_hard[u] = hard;
    });
    for (size_t u = 0; u < units; ++u) pass.hard_error += unit_hard[u];
    if (!soft) continue;
    for (size_t u = 0; u < units; ++u)
      for (size_t ab = 0; ab < K2; ++ab) pass.counts[ab] += unit_counts[u * K2 + ab];
    // [2K, d] = margᵀ [2K, m] · z [m, d]
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, 2 * K, d, int(m), 1.0f, marg.data(), 2 * K, zc, d, 0.0f,
                chunk_sums.data(), d);
    for (size_t x = 0; x < chunk_sums.size(); ++x) pass.sums[x] += chunk_sums[x];
  }
  return pass;
}

// Closed-form M-step: solves the K×K Hermitian system (shared by all pairs) for new parameters.
// A small ridge toward the previous parameters keeps unused ones where they were.
void key_m_step(const KeyPass& pass, int K, int d, std::vector<float>& t) {
  using cd = std::complex<double>;
  const int pairs = d / 2;
  // Row-major K×K Hermitian system and [K, pairs] right-hand sides for LAPACKE_zhesv.
  std::vector<lapack_complex_double> H(size_t(K) * K), rhs(size_t(K) * pairs);
  auto set = [](lapack_complex_double& x, cd v) { x = v; };
  double trace = 0.0;
  std::vector<double> diag(size_t(K), 0.0);
  for (int k = 0; k < K; ++k) {
    for (int b = 0; b < K; ++b) diag[k] += pass.counts[size_t(k) * K + b];
    for (int a = 0; a < K; ++a) diag[k] += pass.counts[size_t(a) * K + k];
    trace += diag[k];
  }
  const double ridge = 1e-9 * trace / K + 1e-12;
  for (int k = 0; k < K; ++k)
    for (int l = 0; l < K; ++l)
      set(H[size_t(k) * K + l],
          l == k ? cd(diag[k] + ridge, 0.0) : cd(0.0, pass.counts[size_t(k) * K + l] - pass.counts[size_t(l) * K + k]));
  for (int k = 0; k < K; ++k)
    for (int j = 0; j < pairs; ++j) {
      const double sa_re = pass.sums[size_t(k) * d + 2 * j], sa_im = pass.sums[size_t(k) * d + 2 * j + 1];
      const double sb_re = pass.sums[size_t(K + k) * d + 2 * j], sb_im = pass.sums[size_t(K + k) * d + 2 * j + 1];
      // Σ_b S_kb − i·Σ_a S_ak, plus the ridge's pull toward the previous t.
      set(rhs[size_t(k) * pairs + j],
          cd(sa_re + sb_im, sa_im - sb_re) + ridge * cd(t[size_t(k) * d + 2 * j], t[size_t(k) * d + 2 * j + 1]));
    }
  std::vector<lapack_int> ipiv(static_cast<size_t>(K));
  const lapack_int info = LAPACKE_zhesv(LAPACK_ROW_MAJOR, 'U', K, pairs, H.data(), K, ipiv.data(), rhs.data(), pairs);
  if (info != 0) return;  // singular: keep the previous iterate; the best-iterate rule still holds
  std::vector<float> next(t.size());
  for (int k = 0; k < K; ++k)
    for (int j = 0; j < pairs; ++j) {
      const lapack_complex_double v = rhs[size_t(k) * pairs + j];
      next[size_t(k) * d + 2 * j] = float(v.real());
      next[size_t(k) * d + 2 * j + 1] = float(v.imag());
    }
  if (std::all_of(next.begin(), next.end(), [](float x) { return std::isfinite(x); })) t.swap(next);
}

// ---- values ----

struct ValuePass {
  double hard_error = 0;
  std::vector<double> sums;        // [C, d]
  std::vector<double> counts;      // [C]
  std::vector<size_t> worst_rows;  // rows by descending error, for re-seeding empty codewords
};

ValuePass value_pass(const float* y, size_t n, int d, int C, const std::vector<float>& w, size_t want_worst) {
  ValuePass pass;
  pass.sums.assign(size_t(C) * d, 0.0);
  pass.counts.assign(size_t(C), 0.0);
  std::vector<float> ww(static_cast<size_t>(C));
  for (int c = 0; c < C; ++c) {
    double s = 0.0;
    for (int k = 0; k < d; ++k) s += double(w[size_t(c) * d + k]) * w[size_t(c) * d + k];
    ww[c] = float(s);
  }
  std::vector<float> prod(kChunkRows * size_t(C));
  std::vector<std::pair<float, size_t>> errors;
  if (want_worst) errors.reserve(n);
  for (size_t c0 = 0; c0 < n; c0 += kChunkRows) {
    const size_t m = std::min(kChunkRows, n - c0);
    const float* yc = y + c0 * size_t(d);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(m), C, d, 1.0f, yc, d, w.data(), d, 0.0f, prod.data(), C);
    for (size_t i = 0; i < m; ++i) {
      const float* p = prod.data() + i * size_t(C);
      float best = std::numeric_limits<float>::infinity();
      int code = 0;
      for (int c = 0; c < C; ++c) {
        const float dist = ww[c] - 2.0f * p[c];
        if (dist < best) {
          best = dist;
          code = c;
        }
      }
      const float* yi = yc + i * size_t(d);
      float yy = 0.0f;
      for (int k = 0; k < d; ++k) yy += yi[k] * yi[k];
      const float err = std::max(0.0f, yy + best);
      pass.hard_error += err;
      pass.counts[code] += 1.0;
      double* s = pass.sums.data() + size_t(code) * d;
      for (int k = 0; k < d; ++k) s[k] += yi[k];
      if (want_worst) errors.emplace_back(err, c0 + i);
    }
  }
  if (want_worst) {
    const size_t take = std::min(want_worst, errors.size());
    std::partial_sort(errors.begin(), errors.begin() + take, errors.end(), [](auto& a, auto& b) {
      return a.first > b.first || (a.first == b.first && a.second < b.second);
    });
    for (size_t i = 0; i < take; ++i) pass.worst_rows.push_back(errors[i].second);
  }
  return pass;
}

}  // namespace

CommvqBudget commvq_budget(int bits, int d) {
  KVCC_REQUIRE(bits == 1 || bits == 2, "commvq: --bits must be 1 or 2, got " + std::to_string(bits));
  KVCC_REQUIRE(d >= 2 && d % 2 == 0, "commvq: head_dim " + std::to_string(d) + " is not a positive even number");
  const int total = bits * d;  // code bits per token and head
  CommvqBudget b;
  const int key_code = total >= 96 ? 12 : (total >= 8 ? 8 : std::max(2, total - total % 2));
  b.key_half_bits = key_code / 2;
  b.key_stages = std::max(1, int(std::lround(double(total) / key_code)));
  b.value_code_bits = std::min(8, total);
  b.value_stages = std::max(1, int(std::lround(double(total) / b.value_code_bits)));
  return b;
}

CommvqKeyCodebook train_commvq_keys(const float* key_pre, size_t n_all, int d, RopeStyle style,
                                    const CommvqTrainOptions& o, std::vector<CommvqStageReport>* report) {
  KVCC_REQUIRE(n_all > 0, "commvq: no key rows to train on");
  CommvqKeyCodebook cb;
  cb.d = d;
  cb.stages = o.budget.key_stages;
  cb.half_bits = o.budget.key_half_bits;
  cb.rope_style = style;
  cb.params.assign(size_t(cb.stages) * cb.n_params() * d, 0.0f);
  cb.check();
  const int K = cb.n_params();
  const int threads = thread_count(o.threads);

  const auto rows = training_rows(n_all, o.max_rows, o.seed);
  const size_t n = rows.size();
  std::vector<float> z(n * size_t(d));
  for (size_t i = 0; i < n; ++i) {
    const float* x = key_pre + rows[i] * size_t(d);
    const float nrm = float_from_f16(commvq_row_norm(x, d, "key"));
    commvq_to_pairs(style, d, x, z.data() + i * d);
    const float inv = nrm > 0.0f ? 1.0f / nrm : 0.0f;
    for (int c = 0; c < d; ++c) z[i * d + c] *= inv;
  }
  if (report) report->assign(size_t(cb.stages), {});
  std::vector<uint16_t> codes(n);

  for (int r = 0; r < cb.stages; ++r) {
    const auto start = std::chrono::steady_clock::now();
    CommvqStageReport s;
    s.error_before = mean_energy(z, n, d);
    // The all-zero codebook is the first candidate: it leaves the residual as it is.
    std::vector<float> best(size_t(K) * d, 0.0f);
    double best_error = s.error_before;
    // Init: centre (k,k) = (1+i)·t_k at K seeded rows, i.e. t_k = z·(1−i)/2.
    std::vector<float> t(size_t(K) * d);
    const auto init = sample_rows(n, size_t(K), o.seed * 0x9e3779b97f4a7c15ull + uint64_t(r) + 1);
    for (int k = 0; k < K; ++k) {
      const float* zi = z.data() + init[k] * d;
      for (int j = 0; j < d / 2; ++j) {
        t[size_t(k) * d + 2 * j] = 0.5f * (zi[2 * j] + zi[2 * j + 1]);
        t[size_t(k) * d + 2 * j + 1] = 0.5f * (zi[2 * j + 1] - zi[2 * j]);
      }
    }
    double scale = s.error_before;  // the temperature's unit: the current mean hard error
    int since_best = 0;
    for (int it = 0; it < o.iterations; ++it) {
      const double T = temperature_factor(o, it) * std::max(scale, 1e-30);
      KeyPass pass = key_pass(z.data(), n, d, K, t, T, threads);
      const double err = pass.hard_error / double(n);
      s.iteration_error.push_back(err);
      scale = err;
      // An iterate must beat the best by a relative margin above float noise to replace it.
      if (err < best_error * (1.0 - 1e-6)) {
        best_error = err;
        best = t;
        s.best_iteration = it;
        since_best = 0;
      } else if (++since_best >= o.patience) {
        break;
      }
      if (it + 1 < o.iterations) key_m_step(pass, K, d, t);
    }
    std::copy(best.begin(), best.end(), cb.stage(r));
    // Residuals exactly as encoding computes them.
    commvq_key_assign(cb, r, z.data(), n, codes.data());
    for (size_t i = 0; i < n; ++i) commvq_key_add_centre(cb, r, codes[i], -1.0f, z.data() + i * d);
    s.error_after = mean_energy(z, n, d);
    s.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    report_stage(o, "key", r, cb.stages, s);
    if (report) (*report)[r] = std::move(s);
  }
  return cb;
}

CommvqValueCodebook train_commvq_values(const float* value, size_t n_all, int d, const std::vector<double>& rotation,
                                        const CommvqTrainOptions& o, std::vector<CommvqStageReport>* report) {
  KVCC_REQUIRE(n_all > 0, "commvq: no value rows to train on");
  CommvqValueCodebook cb;
  cb.d = d;
  cb.stages = o.budget.value_stages;
  cb.code_bits = o.budget.value_code_bits;
  cb.codewords.assign(size_t(cb.stages) * cb.n_codes() * d, 0.0f);
  if (!rotation.empty()) cb.rotation.assign(rotation.begin(), rotation.end());
  cb.check();
  const int C = cb.n_codes();

  const auto rows = training_rows(n_all, o.max_rows, o.seed);
  const size_t n = rows.size();
  std::vector<float> y(n * size_t(d));
  for (size_t i = 0; i < n; ++i) {
    const float* x = value + rows[i] * size_t(d);
    const float nrm = float_from_f16(commvq_row_norm(x, d, "value"));
    const float inv = nrm > 0.0f ? 1.0f / nrm : 0.0f;
    float* yi = y.data() + i * d;
    if (rotation.empty()) {
      for (int c = 0; c < d; ++c) yi[c] = x[c] * inv;
    } else {
      for (int k = 0; k < d; ++k) {
        double acc = 0.0;
        for (int c = 0; c < d; ++c) acc += double(x[c]) * rotation[size_t(c) * d + k];
        yi[k] = float(acc) * inv;
      }
    }
  }
  if (report) report->assign(size_t(cb.stages), {});
  std::vector<uint16_t> codes(n);

  for (int r = 0; r < cb.stages; ++r) {
    const auto start = std::chrono::steady_clock::now();
    CommvqStageReport s;
    s.error_before = mean_energy(y, n, d);
    std::vector<float> best(size_t(C) * d, 0.0f);
    double best_error = s.error_before;
    std::vector<float> w(size_t(C) * d);
    const auto init = sample_rows(n, size_t(C), o.seed * 0xbf58476d1ce4e5b9ull + uint64_t(r) + 7);
    for (int c = 0; c < C; ++c)
      std::copy(y.data() + init[c] * d, y.data() + (init[c] + 1) * d, w.data() + size_t(c) * d);
    int since_best = 0;
    for (int it = 0; it < o.value_iterations; ++it) {
      ValuePass pass = value_pass(y.data(), n, d, C, w, size_t(C));
      const double err = pass.hard_error / double(n);
      s.iteration_error.push_back(err);
      if (err < best_error * (1.0 - 1e-6)) {
        best_error = err;
        best = w;
        s.best_iteration = it;
        since_best = 0;
      } else if (++since_best >= o.patience) {
        break;
      }
      // M-step: centroids; an empty codeword moves to one of the worst-fitted rows.
      size_t next_worst = 0;
      for (int c = 0; c < C; ++c) {
        float* wc = w.data() + size_t(c) * d;
        if (pass.counts[c] > 0) {
          for (int k = 0; k < d; ++k) wc[k] = float(pass.sums[size_t(c) * d + k] / pass.counts[c]);
        } else if (next_worst < pass.worst_rows.size()) {
          const float* yi = y.data() + pass.worst_rows[next_worst++] * d;
          std::copy(yi, yi + d, wc);
        }
      }
    }
    std::copy(best.begin(), best.end(), cb.stage(r));
    commvq_value_assign(cb, r, y.data(), n, codes.data());
    for (size_t i = 0; i < n; ++i) {
      const float* wc = cb.stage(r) + size_t(codes[i]) * d;
      for (int k = 0; k < d; ++k) y[i * d + k] -= wc[k];
    }
    s.error_after = mean_energy(y, n, d);
    s.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    report_stage(o, "value", r, cb.stages, s);
    if (report) (*report)[r] = std::move(s);
  }
  return cb;
}

namespace {

int param_int(const Recipe& recipe, const std::string& name, int fallback) {
  auto it = recipe.params.find(name);
  if (it == recipe.params.end()) return fallback;
  try {
    size_t used = 0;
    const int v = std::stoi(it->second, &used);
    if (used == it->second.size()) return v;
  } catch (const std::exception&) {}
  throw Error("commvq: parameter " + name + "=" + it->second + " is not an integer");
}

std::string fixed(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6f", v);
  return buf;
}

uint64_t head_seed(uint64_t seed, int layer, int h) {
  uint64_t state = seed ^ (uint64_t(layer) << 32) ^ uint64_t(h) ^ 0xc0311f9ull;
  return splitmix64(state);
}

}  // namespace

void commvq_fill_recipe(Recipe& recipe, int d) {
  KVCC_REQUIRE(recipe.key_bits == 1 || recipe.key_bits == 2,
               "commvq: key bits must be 1 or 2 (the presets), got " + fixed(recipe.key_bits));
  KVCC_REQUIRE(recipe.value_bits == 1 || recipe.value_bits == 2,
               "commvq: value bits must be 1 or 2 (the presets), got " + fixed(recipe.value_bits));
  const CommvqBudget kb = commvq_budget(int(recipe.key_bits), d);
  const CommvqBudget vb = commvq_budget(int(recipe.value_bits), d);
  const int key_stages = param_int(recipe, "key_stages", kb.key_stages);
  const int key_code_bits = param_int(recipe, "key_code_bits", 2 * kb.key_half_bits);
  const int value_stages = param_int(recipe, "value_stages", vb.value_stages);
  const int value_code_bits = param_int(recipe, "value_code_bits", vb.value_code_bits);
  const int iterations = param_int(recipe, "iterations", 20);
  const int max_rows = param_int(recipe, "max_rows", 0);
  KVCC_REQUIRE(key_stages >= 1 && value_stages >= 1, "commvq: stages must be >= 1");
  KVCC_REQUIRE(key_code_bits >= 2 && key_code_bits <= 16 && key_code_bits % 2 == 0,
               "commvq: key_code_bits must be even and in 2..16, got " + std::to_string(key_code_bits));
  KVCC_REQUIRE(value_code_bits >= 1 && value_code_bits <= 16,
               "commvq: value_code_bits must be in 1..16, got " + std::to_string(value_code_bits));
  KVCC_REQUIRE(iterations >= 1 && max_rows >= 0, "commvq: iterations must be >= 1 and max_rows >= 0");
  recipe.params["key_stages"] = std::to_string(key_stages);
  recipe.params["key_code_bits"] = std::to_string(key_code_bits);
  recipe.params["value_stages"] = std::to_string(value_stages);
  recipe.params["value_code_bits"] = std::to_string(value_code_bits);
  recipe.params["iterations"] = std::to_string(iterations);
  recipe.params["max_rows"] = std::to_string(max_rows);
  recipe.params["key_bits_nominal"] = fixed(commvq_nominal_bits(key_stages, key_code_bits, d));
  recipe.params["key_bits_effective"] = fixed(commvq_effective_bits(key_stages, key_code_bits, d));
  recipe.params["value_bits_nominal"] = fixed(commvq_nominal_bits(value_stages, value_code_bits, d));
  recipe.params["value_bits_effective"] = fixed(commvq_effective_bits(value_stages, value_code_bits, d));
  recipe.value_target = "";
  recipe.composition = "";
}

void compile_commvq_head(const Reservoir& res, const Recipe& recipe, RopeStyle style, int layer, int h,
                         HeadArtifact& out) {
  const int d = res.d;
  std::vector<float> keys, values;
  for (size_t i = 0; i < res.size(); ++i) {
    if (res.heldout[i]) continue;
    keys.insert(keys.end(), res.key_pre.begin() + long(i * d), res.key_pre.begin() + long((i + 1) * d));
    values.insert(values.end(), res.value.begin() + long(i * d), res.value.begin() + long((i + 1) * d));
  }
  const size_t n = keys.size() / size_t(d);
  KVCC_REQUIRE(n > 0, "commvq needs reservoir fitting rows; layer " + std::to_string(layer) + " KV head " +
                          std::to_string(h) + " has none (calibrate with --reservoir)");
  CommvqTrainOptions o;
  o.budget.key_stages = param_int(recipe, "key_stages", 0);
  o.budget.key_half_bits = param_int(recipe, "key_code_bits", 0) / 2;
  o.budget.value_stages = param_int(recipe, "value_stages", 0);
  o.budget.value_code_bits = param_int(recipe, "value_code_bits", 0);
  o.iterations = param_int(recipe, "iterations", 20);
  o.value_iterations = o.iterations;
  o.patience = 4;
  o.max_rows = size_t(param_int(recipe, "max_rows", 0));
  o.seed = head_seed(recipe.seed, layer, h);
  o.threads = 1;
  CommvqCodec codec;
  codec.key = train_commvq_keys(keys.data(), n, d, style, o);
  // Values are coded in the model basis: dense residual VQ is rotation-equivariant, so a value
  // rotation would not change its error.
  codec.value = train_commvq_values(values.data(), n, d, {}, o);
  commvq_store(codec, out.key, out.value);
}

void commvq_reservoir_roundtrip(const Artifact& art, int layer, int h, const Reservoir& res, bool heldout, int max_rows,
                                const std::vector<double>& inv_freq, std::vector<float>& key_out,
                                std::vector<float>& value_out) {
  const int d = res.d;
  std::vector<float> key_pre, value;
  std::vector<int32_t> positions;
  for (size_t i = 0; i < res.size() && int(positions.size()) < max_rows; ++i) {
    if (bool(res.heldout[i]) != heldout) continue;
    key_pre.insert(key_pre.end(), res.key_pre.begin() + long(i * d), res.key_pre.begin() + long((i + 1) * d));
    value.insert(value.end(), res.value.begin() + long(i * d), res.value.begin() + long((i + 1) * d));
    positions.push_back(res.position[i]);
  }
  const CommvqCodec codec = commvq_load(art, layer, h);
  key_out.resize(key_pre.size());
  value_out.resize(value.size());
  commvq_roundtrip_keys(codec.key, key_pre.data(), positions.data(), positions.size(), inv_freq, false, key_out.data());
  commvq_roundtrip_values(codec.value, value.data(), positions.size(), value_out.data());
}

}  // namespace kvcc
