// Shared fixture of the compile tests: small synthetic statistics, and BLAS pinned to one thread
// (compile_artifact runs LAPACK single-threaded, bit-reproducible; references must match it).
#pragma once
#include "one_blas_thread.h"

#include "compile/synthetic_stats.h"
#include "formats/stats.h"

namespace kvcc::test {

// 2 layers, 2 query heads per KV head, 15 documents of 48 tokens.
inline Stats make_small_stats(int n_kv_heads, int head_dim) {
  SyntheticSpec spec;
  spec.n_layers = 2;
  spec.n_kv_heads = n_kv_heads;
  spec.group = 2;
  spec.head_dim = head_dim;
  spec.docs = 15;
  spec.doc_len = 48;
  return make_synthetic_stats(spec);
}

inline const Stats& small_stats() {
  static const Stats stats = make_small_stats(2, 64);
  return stats;
}

}  // namespace kvcc::test
