// Host-side helpers the CUDA kernel files share (one definition each, inline).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <string>

#include "formats/error.h"

namespace kvcc {

// CUDA errors become kvcc::Error naming the call, so a launch failure is an exception an engine
// can catch, never an abort.
inline void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw Error(std::string(what) + ": " + cudaGetErrorString(e));
}

// Workspace carving: every buffer starts on a 256-byte boundary (cudaMalloc's alignment).
inline size_t align256(size_t x) { return (x + 255) / 256 * 256; }

// Streaming multiprocessors of the current device (split-K plans size their grids by it).
inline int multiprocessors() {
  static const int sms = [] {
    int dev = 0, n = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
    return n > 0 ? n : 132;
  }();
  return sms;
}

}  // namespace kvcc
