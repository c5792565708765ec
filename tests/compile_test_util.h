// Shared fixture of the compile tests: small synthetic statistics, and BLAS pinned to one thread
// (compile_artifact runs LAPACK single-threaded, bit-reproducible; references must match it).
#pragma once
#include <cblas.h>

#include "compile/synthetic_stats.h"
#include "formats/stats.h"

namespace kvcc::test {

inline const Stats& small_stats() {
  static const Stats stats = [] {
    SyntheticSpec spec;
    spec.n_layers = 2;
    spec.n_kv_heads = 2;
    spec.group = 2;
    spec.head_dim = 64;
    spec.docs = 15;
    spec.doc_len = 48;
    return make_synthetic_stats(spec);
  }();
  return stats;
}

inline const int single_threaded_blas = [] {
  openblas_set_num_threads(1);
  return 1;
}();

}  // namespace kvcc::test
