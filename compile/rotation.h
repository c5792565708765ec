// Rotations the compiler fits per (layer, KV head) or per layer (DESIGN.md "Rotations").
// Every matrix is row-major [d, d] float64 and applied to row vectors as x_rot = x · R.
//
//   oscar     R = U·H·P: U the eigenvectors (ascending eigenvalues, columns) of the importance
//             target, H the normalised Sylvester Hadamard, P the bit-reversal permutation
//             (perm[bitrev(i)] = argsort_desc(λ)[i], P = I[:, perm]). Compositions U·H and U for
//             ablations.
//   hadamard  R = H (QuaRot / KVarN front end).
//   identity  R = I (KIVI; "no rotation").
//   random    R = Q of the QR of a seeded Gaussian matrix, column signs fixed so diag(R_qr) > 0
//             (a Haar rotation, TurboQuant), deterministic for a seed on every platform.
//
// H-based methods need a power-of-two head_dim; any other size gets an Error naming the size
// (there is no fallback: a padded Hadamard would not be a d×d rotation).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "formats/stats.h"

namespace kvcc {

using Matrix = std::vector<double>;  // row-major [d, d]

struct SymmetricEigen {
  std::vector<double> values;  // [d] ascending
  Matrix vectors;              // [d, d]; column j is the eigenvector of values[j]
};

// LAPACKE dsyevd of a symmetric matrix (the upper triangle is read after symmetrising).
// Each eigenvector's sign is fixed so that its largest-magnitude entry is positive, so the
// composed R does not depend on the LAPACK build's sign choices. Throws Error on NaN/inf input.
SymmetricEigen symmetric_eigen(const Matrix& a, int d);

Matrix identity_matrix(int d);
// Normalised Sylvester Hadamard (entries ±1/√d); Error unless d is a power of two.
Matrix hadamard_matrix(int d);
// Haar-distributed orthogonal matrix from a seeded Gaussian via Householder QR.
Matrix random_orthogonal(int d, uint64_t seed);

bool is_power_of_two(int d);
// Reverses the low log2(d) bits of i (d a power of two).
int bit_reverse(int i, int d);
// perm with perm[bitrev(i)] = argsort_desc(eigenvalues)[i] (ties keep the lower index first).
std::vector<int> bit_reversal_permutation(const std::vector<double>& eigenvalues);

// R = U·H·P, U·H or U from an eigendecomposition; composition is "UHP", "UH" or "U".
Matrix compose_oscar(const SymmetricEigen& eig, const std::string& composition);

Matrix matmul(const Matrix& a, const Matrix& b, int d);  // a·b, both [d, d]
Matrix transpose(const Matrix& a, int d);
double orthogonality_error(const Matrix& r, int d);  // max |RᵀR − I|

// Importance targets, normalised by their counts (stats store sums).
// Keys: the query second moment M_h = Σ q qᵀ / count.
Matrix key_target(const HeadStats& head, int d);
// Values: "output" (Σ o oᵀ / count), "p2" (Σ w v vᵀ / Σ w) from the stats sums, or "logit2":
// (1/n) Σ_j w_j v_j v_jᵀ with w_j = k_jᵀ M_h k_j normalised to mean 1, computed here, at compile
// time, from the reservoir's fitting rows (heldout == 0) because it needs the final M_h; M_h is
// the stats' (all-token) query second moment.
Matrix value_target(const HeadStats& head, const Reservoir& reservoir, const std::string& target, int d);

// A deterministic per-(layer, head, side) seed derived from the recipe seed (splitmix64).
uint64_t derive_seed(uint64_t seed, int layer, int head, int side);

// A standard normal stream from splitmix64 + Box–Muller: the same numbers on every platform.
class GaussianStream {
 public:
  explicit GaussianStream(uint64_t seed) : state_(seed) {}
  double next();
  uint64_t next_u64();

 private:
  uint64_t state_;
  bool has_spare_ = false;
  double spare_ = 0.0;
};

}  // namespace kvcc
