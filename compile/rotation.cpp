#include "compile/rotation.h"

#include <lapacke.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "formats/error.h"

namespace kvcc {

namespace {

uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

void require_finite(const Matrix& a, const std::string& what) {
  for (double x : a) KVCC_REQUIRE(std::isfinite(x), what + " contains NaN or inf");
}

}  // namespace

uint64_t GaussianStream::next_u64() { return splitmix64(state_); }

double GaussianStream::next() {
  if (has_spare_) {
    has_spare_ = false;
    return spare_;
  }
  // Two uniforms in (0, 1] from the top 53 bits.
  const double u1 = (double(next_u64() >> 11) + 1.0) * 0x1.0p-53;
  const double u2 = double(next_u64() >> 11) * 0x1.0p-53;
  const double radius = std::sqrt(-2.0 * std::log(u1));
  const double angle = 2.0 * M_PI * u2;
  spare_ = radius * std::sin(angle);
  has_spare_ = true;
  return radius * std::cos(angle);
}

uint64_t derive_seed(uint64_t seed, int layer, int head, int side) {
  uint64_t state =
      seed ^ (uint64_t(uint32_t(layer)) << 32) ^ (uint64_t(uint32_t(head)) << 2) ^ uint64_t(uint32_t(side));
  splitmix64(state);
  return splitmix64(state);
}

bool is_power_of_two(int d) { return d > 0 && (d & (d - 1)) == 0; }

int bit_reverse(int i, int d) {
  int bits = 0;
  while ((1 << bits) < d) ++bits;
  int r = 0;
  for (int b = 0; b < bits; ++b)
    if (i & (1 << b)) r |= 1 << (bits - 1 - b);
  return r;
}

Matrix identity_matrix(int d) {
  Matrix m(size_t(d) * d, 0.0);
  for (int i = 0; i < d; ++i) m[size_t(i) * d + i] = 1.0;
  return m;
}

Matrix hadamard_matrix(int d) {
  KVCC_REQUIRE(is_power_of_two(d), "a Hadamard rotation needs a power-of-two head_dim, got " + std::to_string(d) +
                                       " (use --method identity or random for this model)");
  // Sylvester: H[i][j] = (-1)^popcount(i & j) / sqrt(d).
  const double s = 1.0 / std::sqrt(double(d));
  Matrix h(size_t(d) * d);
  for (int i = 0; i < d; ++i)
    for (int j = 0; j < d; ++j) h[size_t(i) * d + j] = (__builtin_popcount(unsigned(i & j)) & 1) ? -s : s;
  return h;
}

Matrix random_orthogonal(int d, uint64_t seed) {
  GaussianStream gauss(seed);
  Matrix a(static_cast<size_t>(d) * d);
  for (double& x : a) x = gauss.next();
  std::vector<double> tau(static_cast<size_t>(d));
  lapack_int info = LAPACKE_dgeqrf(LAPACK_ROW_MAJOR, d, d, a.data(), d, tau.data());
  KVCC_REQUIRE(info == 0, "LAPACKE_dgeqrf failed (info " + std::to_string(info) + ")");
  std::vector<double> r_diag(static_cast<size_t>(d));
  for (int j = 0; j < d; ++j) r_diag[size_t(j)] = a[size_t(j) * d + j];
  info = LAPACKE_dorgqr(LAPACK_ROW_MAJOR, d, d, d, a.data(), d, tau.data());
  KVCC_REQUIRE(info == 0, "LAPACKE_dorgqr failed (info " + std::to_string(info) + ")");
  // Q·diag(sign(diag R)) makes the factorisation unique, hence Haar-distributed.
  for (int j = 0; j < d; ++j)
    if (r_diag[size_t(j)] < 0)
      for (int i = 0; i < d; ++i) a[size_t(i) * d + j] = -a[size_t(i) * d + j];
  return a;
}

SymmetricEigen symmetric_eigen(const Matrix& a, int d) {
  KVCC_REQUIRE(a.size() == size_t(d) * d,
               "eigendecomposition: matrix is not " + std::to_string(d) + "x" + std::to_string(d));
  require_finite(a, "importance target");
  Matrix work(size_t(d) * d);
  for (int i = 0; i < d; ++i)
    for (int j = 0; j < d; ++j) work[size_t(i) * d + j] = 0.5 * (a[size_t(i) * d + j] + a[size_t(j) * d + i]);
  SymmetricEigen eig;
  eig.values.resize(static_cast<size_t>(d));
  const lapack_int info = LAPACKE_dsyevd(LAPACK_ROW_MAJOR, 'V', 'U', d, work.data(), d, eig.values.data());
  KVCC_REQUIRE(info == 0, "LAPACKE_dsyevd failed (info " + std::to_string(info) + ")");
  for (int j = 0; j < d; ++j) {
    int arg = 0;
    for (int i = 1; i < d; ++i)
      if (std::fabs(work[size_t(i) * d + j]) > std::fabs(work[size_t(arg) * d + j])) arg = i;
    if (work[size_t(arg) * d + j] < 0)
      for (int i = 0; i < d; ++i) work[size_t(i) * d + j] = -work[size_t(i) * d + j];
  }
  eig.vectors = std::move(work);
  return eig;
}

std::vector<int> bit_reversal_permutation(const std::vector<double>& eigenvalues) {
  const int d = int(eigenvalues.size());
  KVCC_REQUIRE(is_power_of_two(d), "bit-reversal permutation needs a power-of-two head_dim, got " + std::to_string(d));
  std::vector<int> order(static_cast<size_t>(d));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return eigenvalues[size_t(a)] > eigenvalues[size_t(b)]; });
  std::vector<int> perm(static_cast<size_t>(d));
  for (int i = 0; i < d; ++i) perm[size_t(bit_reverse(i, d))] = order[size_t(i)];
  return perm;
}

Matrix matmul(const Matrix& a, const Matrix& b, int d) {
  Matrix c(size_t(d) * d, 0.0);
  for (int i = 0; i < d; ++i)
    for (int k = 0; k < d; ++k) {
      const double aik = a[size_t(i) * d + k];
      if (aik == 0.0) continue;
      const double* brow = &b[size_t(k) * d];
      double* crow = &c[size_t(i) * d];
      for (int j = 0; j < d; ++j) crow[j] += aik * brow[j];
    }
  return c;
}

Matrix transpose(const Matrix& a, int d) {
  Matrix t(size_t(d) * d);
  for (int i = 0; i < d; ++i)
    for (int j = 0; j < d; ++j) t[size_t(j) * d + i] = a[size_t(i) * d + j];
  return t;
}

double orthogonality_error(const Matrix& r, int d) {
  double worst = 0.0;
  for (int i = 0; i < d; ++i)
    for (int j = 0; j < d; ++j) {
      double dot = 0.0;
      for (int k = 0; k < d; ++k) dot += r[size_t(k) * d + i] * r[size_t(k) * d + j];
      worst = std::max(worst, std::fabs(dot - (i == j ? 1.0 : 0.0)));
    }
  return worst;
}

Matrix compose_oscar(const SymmetricEigen& eig, const std::string& composition) {
  const int d = int(eig.values.size());
  if (composition == "U") return eig.vectors;
  KVCC_REQUIRE(composition == "UH" || composition == "UHP",
               "unknown rotation composition '" + composition + "' (expected UHP, UH or U)");
  Matrix uh = matmul(eig.vectors, hadamard_matrix(d), d);
  if (composition == "UH") return uh;
  // P = I[:, perm]: column j of U·H·P is column perm[j] of U·H.
  const std::vector<int> perm = bit_reversal_permutation(eig.values);
  Matrix r(size_t(d) * d);
  for (int i = 0; i < d; ++i)
    for (int j = 0; j < d; ++j) r[size_t(i) * d + j] = uh[size_t(i) * d + size_t(perm[size_t(j)])];
  return r;
}

Matrix key_target(const HeadStats& head, int d) {
  KVCC_REQUIRE(head.query_m2.size() == size_t(d) * d, "stats: query second moment has the wrong shape");
  KVCC_REQUIRE(head.query_count > 0, "stats: no queries were observed for a KV head (empty calibration?)");
  Matrix m(head.query_m2);
  for (double& x : m) x /= double(head.query_count);
  return m;
}

Matrix value_target(const HeadStats& head, const Reservoir& reservoir, const std::string& target, int d) {
  if (target == "output") {
    KVCC_REQUIRE(head.output_m2.size() == size_t(d) * d && head.output_count > 0,
                 "stats: no attention outputs were observed for value target 'output'");
    Matrix m(head.output_m2);
    for (double& x : m) x /= double(head.output_count);
    return m;
  }
  if (target == "p2") {
    KVCC_REQUIRE(head.p2_m2.size() == size_t(d) * d && head.p2_weight > 0,
                 "stats: no attention probabilities were observed for value target 'p2'");
    Matrix m(head.p2_m2);
    for (double& x : m) x /= head.p2_weight;
    return m;
  }
  KVCC_REQUIRE(target == "logit2", "unknown value target '" + target + "' (expected output, p2 or logit2)");
  const Matrix mq = key_target(head, d);
  std::vector<size_t> rows;
  for (size_t i = 0; i < reservoir.size(); ++i)
    if (!reservoir.heldout[i]) rows.push_back(i);
  KVCC_REQUIRE(!rows.empty(),
               "stats: value target 'logit2' needs reservoir rows, and the reservoir "
               "has no fitting rows");
  std::vector<double> weight(rows.size());
  double weight_sum = 0.0;
  for (size_t n = 0; n < rows.size(); ++n) {
    const float* k = &reservoir.key[rows[n] * size_t(d)];
    double w = 0.0;
    for (int a = 0; a < d; ++a) {
      double s = 0.0;
      for (int b = 0; b < d; ++b) s += mq[size_t(a) * d + b] * double(k[b]);
      w += double(k[a]) * s;
    }
    weight[n] = w;
    weight_sum += w;
  }
  weight_sum = std::max(weight_sum, 1e-12);
  // w normalised to mean 1, then A = (1/n) Σ w v vᵀ = Σ w v vᵀ / Σ w.
  Matrix a(size_t(d) * d, 0.0);
  for (size_t n = 0; n < rows.size(); ++n) {
    const float* v = &reservoir.value[rows[n] * size_t(d)];
    const double w = weight[n] / weight_sum;
    for (int i = 0; i < d; ++i) {
      const double wi = w * double(v[i]);
      for (int j = 0; j < d; ++j) a[size_t(i) * d + j] += wi * double(v[j]);
    }
  }
  return a;
}

}  // namespace kvcc
