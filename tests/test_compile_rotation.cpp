// Rotations: orthogonality, the eigenbasis, the OSCAR lemma and the bit-reversal placement.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "compile/rotation.h"
#include "compile/synthetic_stats.h"
#include "formats/error.h"

using namespace kvcc;

namespace {

// Rᵀ A R, naive.
Matrix conjugate(const Matrix& a, const Matrix& r, int d) { return matmul(transpose(r, d), matmul(a, r, d), d); }

Matrix random_spd(int d, uint64_t seed) {
  GaussianStream g(seed);
  Matrix x(size_t(d) * d);
  for (double& v : x) v = g.next();
  Matrix a = matmul(transpose(x, d), x, d);
  // A skewed spectrum, like real query moments.
  for (int i = 0; i < d; ++i) a[size_t(i) * d + i] += 50.0 * std::exp(-i / 3.0);
  return a;
}

}  // namespace

TEST(Rotation, EveryMethodIsOrthogonal) {
  for (int d : {8, 16, 64, 128}) {
    EXPECT_LT(orthogonality_error(hadamard_matrix(d), d), 1e-10) << d;
    EXPECT_LT(orthogonality_error(identity_matrix(d), d), 1e-15) << d;
    EXPECT_LT(orthogonality_error(random_orthogonal(d, 42), d), 1e-10) << d;
    const SymmetricEigen eig = symmetric_eigen(random_spd(d, 3), d);
    for (const char* comp : {"U", "UH", "UHP"})
      EXPECT_LT(orthogonality_error(compose_oscar(eig, comp), d), 1e-10) << d << " " << comp;
  }
  EXPECT_LT(orthogonality_error(random_orthogonal(96, 5), 96), 1e-10);  // any size
}

TEST(Rotation, HadamardEntriesAndSylvesterRecursion) {
  const int d = 16;
  const Matrix h = hadamard_matrix(d), h8 = hadamard_matrix(8);
  // H_16 = [[H_8, H_8], [H_8, -H_8]] / sqrt(2).
  for (int i = 0; i < 8; ++i)
    for (int j = 0; j < 8; ++j) {
      const double e = h8[size_t(i) * 8 + j] / std::sqrt(2.0);
      EXPECT_DOUBLE_EQ(h[size_t(i) * d + j], e);
      EXPECT_DOUBLE_EQ(h[size_t(i) * d + j + 8], e);
      EXPECT_DOUBLE_EQ(h[size_t(i + 8) * d + j], e);
      EXPECT_DOUBLE_EQ(h[size_t(i + 8) * d + j + 8], -e);
    }
  EXPECT_THROW(hadamard_matrix(96), Error);
  EXPECT_THROW(compose_oscar(symmetric_eigen(identity_matrix(12), 12), "UH"), Error);
}

TEST(Rotation, RandomIsDeterministicPerSeed) {
  EXPECT_EQ(random_orthogonal(32, 9), random_orthogonal(32, 9));
  EXPECT_NE(random_orthogonal(32, 9), random_orthogonal(32, 10));
}

TEST(Rotation, EigenvectorsDiagonaliseTheTarget) {
  const int d = 64;
  const Matrix a = random_spd(d, 11);
  const SymmetricEigen eig = symmetric_eigen(a, d);
  EXPECT_TRUE(std::is_sorted(eig.values.begin(), eig.values.end()));
  const Matrix diag = conjugate(a, eig.vectors, d);
  double scale = eig.values.back();
  for (int i = 0; i < d; ++i)
    for (int j = 0; j < d; ++j)
      EXPECT_NEAR(diag[size_t(i) * d + j], i == j ? eig.values[size_t(i)] : 0.0, 1e-10 * scale);
}

TEST(Rotation, HadamardMakesImportanceDiagonalUniform) {
  // OSCAR lemma: diag(Hᵀ Λ H) = tr(Λ)/d, so diag(Rᵀ A R) = tr(A)/d for R = U·H and U·H·P.
  const int d = 128;
  const Matrix a = random_spd(d, 12);
  const SymmetricEigen eig = symmetric_eigen(a, d);
  double trace = 0.0;
  for (int i = 0; i < d; ++i) trace += a[size_t(i) * d + i];
  for (const char* comp : {"UH", "UHP"}) {
    const Matrix rot = conjugate(a, compose_oscar(eig, comp), d);
    for (int i = 0; i < d; ++i) EXPECT_NEAR(rot[size_t(i) * d + i], trace / d, 1e-9 * trace) << comp;
  }
  // Without H the diagonal is the (very non-uniform) spectrum.
  const Matrix u_only = conjugate(a, compose_oscar(eig, "U"), d);
  EXPECT_NEAR(u_only[size_t(d - 1) * d + d - 1], eig.values.back(), 1e-9 * trace);
  EXPECT_GT(u_only[size_t(d - 1) * d + d - 1], 2.0 * trace / d);
}

TEST(Rotation, BitReversalSpreadsTopDirectionsAcrossGroups) {
  const int d = 128;
  EXPECT_EQ(bit_reverse(1, d), 64);
  EXPECT_EQ(bit_reverse(2, d), 32);
  EXPECT_EQ(bit_reverse(3, d), 96);
  std::vector<double> lambda(static_cast<size_t>(d));
  for (int i = 0; i < d; ++i) lambda[size_t(i)] = double(i);  // ascending: rank r is index d-1-r
  const std::vector<int> perm = bit_reversal_permutation(lambda);
  // Rank 1 at position 0, rank 2 at 64, rank 3 at 32, rank 4 at 96 (the OSCAR site's example).
  EXPECT_EQ(perm[0], d - 1);
  EXPECT_EQ(perm[64], d - 2);
  EXPECT_EQ(perm[32], d - 3);
  EXPECT_EQ(perm[96], d - 4);
  // For every group size G = d/2^m, the top 2^m directions land in 2^m distinct groups.
  for (int groups = 2; groups <= d; groups *= 2) {
    const int g = d / groups;
    std::vector<int> seen(size_t(groups), 0);
    for (int pos = 0; pos < d; ++pos)
      if (perm[size_t(pos)] >= d - groups) ++seen[size_t(pos / g)];
    for (int count : seen) EXPECT_EQ(count, 1) << "G=" << g;
  }
  // compose_oscar applies exactly P = I[:, perm]: column j of U·H·P = column perm[j] of U·H.
  const Matrix a = random_spd(16, 4);
  const SymmetricEigen eig = symmetric_eigen(a, 16);
  const Matrix uh = compose_oscar(eig, "UH"), uhp = compose_oscar(eig, "UHP");
  const std::vector<int> p16 = bit_reversal_permutation(eig.values);
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 16; ++j) EXPECT_EQ(uhp[size_t(i) * 16 + j], uh[size_t(i) * 16 + p16[size_t(j)]]);
}

TEST(Rotation, TargetsNormaliseTheStatsSums) {
  SyntheticSpec spec;
  spec.n_layers = 1;
  spec.n_kv_heads = 1;
  spec.head_dim = 16;
  spec.docs = 10;
  spec.doc_len = 16;
  const Stats stats = make_synthetic_stats(spec);
  const HeadStats& hs = stats.head(0, 0);
  const Reservoir& res = stats.reservoir(0, 0);
  const int d = 16;
  // Keys: Σ q qᵀ / count, recomputed from the reservoir (it holds every token here).
  const Matrix m = key_target(hs, d);
  Matrix direct(size_t(d) * d, 0.0);
  const size_t nq = res.q.size() / size_t(d);
  for (size_t row = 0; row < nq; ++row)
    for (int i = 0; i < d; ++i)
      for (int j = 0; j < d; ++j)
        direct[size_t(i) * d + j] += double(res.q[row * d + i]) * res.q[row * d + j] / double(nq);
  for (size_t i = 0; i < m.size(); ++i) EXPECT_NEAR(m[i], direct[i], 1e-5 * (1 + std::fabs(direct[i])));
  // logit2: weights k M kᵀ normalised to mean 1 over the fitting rows.
  const Matrix a = value_target(hs, res, "logit2", d);
  Matrix expect(size_t(d) * d, 0.0);
  std::vector<double> w;
  std::vector<size_t> rows;
  double wsum = 0.0;
  for (size_t t = 0; t < res.size(); ++t) {
    if (res.heldout[t]) continue;
    double s = 0.0;
    for (int i = 0; i < d; ++i)
      for (int j = 0; j < d; ++j) s += res.key[t * d + i] * m[size_t(i) * d + j] * res.key[t * d + j];
    w.push_back(s);
    rows.push_back(t);
    wsum += s;
  }
  for (size_t n = 0; n < rows.size(); ++n) {
    const double wn = w[n] * double(rows.size()) / wsum;  // mean 1
    for (int i = 0; i < d; ++i)
      for (int j = 0; j < d; ++j)
        expect[size_t(i) * d + j] += wn * res.value[rows[n] * d + i] * res.value[rows[n] * d + j] / double(rows.size());
  }
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], expect[i], 1e-9 * (1 + std::fabs(expect[i])));
  EXPECT_THROW(value_target(hs, res, "bogus", d), Error);
}
