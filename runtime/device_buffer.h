// DeviceBuffer<T>: n elements of device memory owned by one object (cudaMalloc'd, freed with it;
// move-only), with host copies in and out. The one device array type of the runtime, the GPU
// tests and the benchmarks. CUDA errors throw kvcc::Error naming the call.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "runtime/cuda_util.cuh"

namespace kvcc {

template <class T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  // n uninitialised elements.
  explicit DeviceBuffer(size_t n) { allocate(n); }
  // A copy of a host array.
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { upload(host); }
  ~DeviceBuffer() { cudaFree(p_); }
  DeviceBuffer(DeviceBuffer&& o) noexcept : p_(std::exchange(o.p_, nullptr)), n_(std::exchange(o.n_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      cudaFree(p_);
      p_ = std::exchange(o.p_, nullptr);
      n_ = std::exchange(o.n_, 0);
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  T* data() const { return p_; }
  size_t size() const { return n_; }
  size_t bytes() const { return n_ * sizeof(T); }
  bool empty() const { return n_ == 0; }

  // At least n elements: reallocates (contents lost, after the device finishes with the old
  // memory: cudaFree synchronises) only when the buffer is smaller.
  void reserve(size_t n) {
    if (n <= n_) return;
    cudaFree(std::exchange(p_, nullptr));
    n_ = 0;
    allocate(n);
  }
  // host[0 .. n) into elements 0 .. n: cudaMemcpy, or cudaMemcpyAsync in `stream` order (from
  // pageable host memory, staged before the call returns). n <= size().
  void upload(const T* host, size_t n, cudaStream_t stream = nullptr) {
    KVCC_REQUIRE(n <= n_, "device buffer: upload of " + std::to_string(n) + " elements into " + std::to_string(n_));
    if (n == 0) return;
    check_cuda(stream ? cudaMemcpyAsync(p_, host, n * sizeof(T), cudaMemcpyHostToDevice, stream)
                      : cudaMemcpy(p_, host, n * sizeof(T), cudaMemcpyHostToDevice),
               "device buffer: upload");
  }
  void upload(const std::vector<T>& host, cudaStream_t stream = nullptr) { upload(host.data(), host.size(), stream); }
  // Elements 0 .. n into host[0 .. n), synchronously.
  void download(T* host, size_t n) const {
    KVCC_REQUIRE(n <= n_, "device buffer: download of " + std::to_string(n) + " elements from " + std::to_string(n_));
    if (n > 0) check_cuda(cudaMemcpy(host, p_, n * sizeof(T), cudaMemcpyDeviceToHost), "device buffer: download");
  }
  std::vector<T> download() const {
    std::vector<T> host(n_);
    download(host.data(), n_);
    return host;
  }

 private:
  void allocate(size_t n) {
    void* p = nullptr;
    const cudaError_t e = cudaMalloc(&p, std::max<size_t>(1, n) * sizeof(T));  // never null, even for n = 0
    KVCC_REQUIRE(e == cudaSuccess, "device buffer: cannot allocate " + std::to_string(n * sizeof(T)) +
                                       " bytes: " + cudaGetErrorString(e));
    p_ = static_cast<T*>(p);
    n_ = n;
  }

  T* p_ = nullptr;
  size_t n_ = 0;
};

}  // namespace kvcc
