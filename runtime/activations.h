// The element type of the activations the runtime's calls take and return (q, k, v and out):
// float32, or bfloat16 as engines hold them. Kernels widen bfloat16 to float where they load it
// and round their float result to nearest even where they store it, and the CPU reference does the
// same around its float code, so a bfloat16 call equals the float32 call on the widened inputs with
// its outputs rounded, bit for bit (what the tests check).
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "formats/fp16.h"

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#endif

namespace kvcc {

enum class Activations : int { Float32 = 0, BFloat16 = 1 };

inline size_t activation_bytes(Activations a) { return a == Activations::BFloat16 ? 2 : 4; }
inline const char* activations_name(Activations a) { return a == Activations::BFloat16 ? "bfloat16" : "float32"; }

// Host: n activations at p as float (bfloat16 widened exactly), and float results stored as `a`.
inline void widen_activations(const void* p, size_t n, Activations a, std::vector<float>& out) {
  out.resize(n);
  if (a == Activations::Float32) {
    const float* f = static_cast<const float*>(p);
    out.assign(f, f + n);
    return;
  }
  const uint16_t* b = static_cast<const uint16_t*>(p);
  for (size_t i = 0; i < n; ++i) out[i] = float_from_bf16(b[i]);
}
inline void store_activations(const float* x, size_t n, Activations a, void* p) {
  if (a == Activations::Float32) {
    float* f = static_cast<float*>(p);
    for (size_t i = 0; i < n; ++i) f[i] = x[i];
    return;
  }
  uint16_t* b = static_cast<uint16_t*>(p);
  for (size_t i = 0; i < n; ++i) b[i] = bf16_from_float(x[i]);
}

#if defined(__CUDACC__)
// Device: one activation as float, and a float result stored in the activations' type.
__device__ __forceinline__ float load_activation(const float* p) { return *p; }
__device__ __forceinline__ float load_activation(const __nv_bfloat16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ void store_activation(float* p, float x) { *p = x; }
__device__ __forceinline__ void store_activation(__nv_bfloat16* p, float x) { *p = __float2bfloat16_rn(x); }
#endif

}  // namespace kvcc
