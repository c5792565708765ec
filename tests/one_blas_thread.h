// OpenBLAS's float results depend on its thread count in the low-order bits. Tests that compare
// results bit for bit (with a child process, or with another decomposition of the same work)
// include this: the whole test process computes with one thread, whatever OPENBLAS_NUM_THREADS
// says, and child processes are started with OPENBLAS_NUM_THREADS=1 (kOneBlasThreadEnv).
#pragma once
#include <cblas.h>

namespace kvcc::test {

inline const int one_blas_thread = [] {
  openblas_set_num_threads(1);
  return 1;
}();

inline constexpr const char* kOneBlasThreadEnv = "OPENBLAS_NUM_THREADS=1 ";

}  // namespace kvcc::test
