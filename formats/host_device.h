// KVCC_HD marks a function that host and CUDA code both compile (the shared codec and layout).
#pragma once
#if defined(__CUDACC__)
#define KVCC_HD __host__ __device__ __forceinline__
#else
#define KVCC_HD inline
#endif
