// Host-side helpers the CUDA kernel files share (one definition each, inline). Plain C++ over the
// CUDA runtime API, so host files of the runtime (kvcc_runtime.cpp, kv_cache.cpp) use them too.
#pragma once
#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <string>

#include "formats/error.h"
#include "runtime/served.h"

namespace kvcc {

// CUDA errors become kvcc::Error naming the call, so a launch failure is an exception an engine
// can catch, never an abort.
inline void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw Error(std::string(what) + ": " + cudaGetErrorString(e));
}

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

// Throws Error (served.h's gpu_arch_problem) unless the current device is Hopper (sm_90), the one
// target the kernels are built for. Device pools, the Runtime and every launcher call it; after a
// device passed, a call costs one cudaGetDevice.
inline void require_hopper() {
  static std::atomic<unsigned long long> passed{0};  // bit d: device d is Hopper
  int dev = 0;
  check_cuda(cudaGetDevice(&dev), "CUDA: current device");
  const unsigned long long bit = dev >= 0 && dev < 64 ? 1ull << dev : 0ull;
  if (passed.load(std::memory_order_relaxed) & bit) return;
  int major = 0, minor = 0;
  check_cuda(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev), "CUDA: compute capability");
  check_cuda(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev), "CUDA: compute capability");
  if (!gpu_arch_problem(dev, "", major, minor).empty()) {
    cudaDeviceProp prop{};
    const std::string name = cudaGetDeviceProperties(&prop, dev) == cudaSuccess ? prop.name : "an unnamed GPU";
    throw Error(gpu_arch_problem(dev, name, major, minor));
  }
  passed.fetch_or(bit, std::memory_order_relaxed);
}

}  // namespace kvcc
