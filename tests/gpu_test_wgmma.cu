// GPU tests of the warpgroup MMA wrappers and shared-memory layouts of runtime/ptx.cuh that the
// prefill kernel (runtime/prefill.cu) is built on, against float64 products on the host, on fresh
// random fp16 operands:
//  - S = Q·Kᵀ as prefill computes it: A (64×128) from registers in mma.m16n8k16's A layout, B
//    (64 keys × 128 channels) K-major in two 64-channel blocks of 128-byte-swizzled rows;
//  - O = P·V: A (64×64) K-major in 128-byte-swizzled rows, B (64 keys × 128 channels) the same
//    tile layout as K read MN-major (transposed), both from shared memory.
// The outputs are poisoned with NaN first (every element written), and the accumulator layout the
// kernels assume (d[4j + 2i + e] = row 16·warp + g + 8i, column 8j + 2t + e) is what is checked.
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "runtime/device_buffer.h"
#include "runtime/ptx.cuh"
#include "gpu_test_util.h"

namespace kvcc {
namespace {

constexpr int kBlock = 64 * 64;  // halfs in one 64-row block of 128-byte rows

// Half index of element (row, col) of a tile of 64-column blocks (8 KB apart) of swizzled rows.
__host__ __device__ int tile_index(int row, int col) {
  return (col / 64) * kBlock + sw128_offset(row, (col % 64) / 8) / 2 + col % 8;
}

// d[64×64] = a[64×128] · b[64×128]ᵀ (row-major inputs), one warpgroup.
__global__ void __launch_bounds__(128) qk_kernel(const __half* a, const __half* b, float* d) {
  __shared__ __align__(1024) __half bs[2 * kBlock];
  const int tid = threadIdx.x, warp = tid / 32, g = (tid % 32) / 4, t = tid % 4;
  for (int i = tid; i < 64 * 128; i += 128) bs[tile_index(i / 128, i % 128)] = b[i];
  fence_proxy_async();
  __syncthreads();
  const uint32_t* arow0 = reinterpret_cast<const uint32_t*>(a + (16 * warp + g) * 128);
  const uint32_t* arow8 = reinterpret_cast<const uint32_t*>(a + (16 * warp + g + 8) * 128);
  uint32_t qa[8][4];
  for (int ks = 0; ks < 8; ++ks) {
    qa[ks][0] = arow0[8 * ks + t];
    qa[ks][1] = arow8[8 * ks + t];
    qa[ks][2] = arow0[8 * ks + 4 + t];
    qa[ks][3] = arow8[8 * ks + 4 + t];
  }
  const uint32_t base = smem_addr(bs);
  const auto desc = [base](int ks) { return wgmma_desc_sw128(base + (ks / 4) * 2 * kBlock + (ks % 4) * 32, 16, 1024); };
  float acc[32];
  wgmma_fence();
  wgmma_m64n64k16_rs<0, 0>(acc, qa[0][0], qa[0][1], qa[0][2], qa[0][3], desc(0));
#pragma unroll
  for (int ks = 1; ks < 8; ++ks) wgmma_m64n64k16_rs<0, 1>(acc, qa[ks][0], qa[ks][1], qa[ks][2], qa[ks][3], desc(ks));
  wgmma_commit();
  wgmma_wait<0>();
  wgmma_hold(acc);
  for (int i = 0; i < 32; ++i) d[(16 * warp + g + 8 * ((i / 2) % 2)) * 64 + 8 * (i / 4) + 2 * t + i % 2] = acc[i];
}

// d[64×128] = p[64×64] · v[64×128] (row-major inputs), one warpgroup; v's descriptor offsets given.
__global__ void __launch_bounds__(128) pv_kernel(const __half* p, const __half* v, float* d, int lbo, int sbo) {
  __shared__ __align__(1024) __half ps[kBlock];
  __shared__ __align__(1024) __half vs[2 * kBlock];
  const int tid = threadIdx.x, warp = tid / 32, g = (tid % 32) / 4, t = tid % 4;
  for (int i = tid; i < 64 * 64; i += 128) ps[tile_index(i / 64, i % 64)] = p[i];
  for (int i = tid; i < 64 * 128; i += 128) vs[tile_index(i / 128, i % 128)] = v[i];
  fence_proxy_async();
  __syncthreads();
  const uint32_t pbase = smem_addr(ps), vbase = smem_addr(vs);
  float acc[64];
  wgmma_fence();
  wgmma_m64n128k16_ss<1, 0>(acc, wgmma_desc_sw128(pbase, 16, 1024), wgmma_desc_sw128(vbase, lbo, sbo));
#pragma unroll
  for (int kk = 1; kk < 4; ++kk)
    wgmma_m64n128k16_ss<1, 1>(acc, wgmma_desc_sw128(pbase + kk * 32, 16, 1024),
                              wgmma_desc_sw128(vbase + kk * 16 * 128, lbo, sbo));
  wgmma_commit();
  wgmma_wait<0>();
  wgmma_hold(acc);
  for (int i = 0; i < 64; ++i) d[(16 * warp + g + 8 * ((i / 2) % 2)) * 128 + 8 * (i / 4) + 2 * t + i % 2] = acc[i];
}

std::vector<__half> random_halves(size_t n, std::mt19937& rng) {
  std::normal_distribution<float> nd;
  std::vector<__half> x(n);
  for (auto& e : x) e = __float2half(nd(rng));
  return x;
}

// Worst |got − want| / Σ|a·b| over the m×n outputs of a (m×k, row-major) · b, b given as
// b_at(kk, col); NaN (an element not written) counts as infinitely wrong. fp16 products are exact
// in fp32, so only the k-term fp32 accumulation differs from the float64 sum: at most k roundings
// of at most 2^-23 relative each (truncating or nearest) of partial sums bounded by Σ|a·b|. A
// wrong layout or descriptor gives errors of order 1.
template <class B>
double worst_error(const std::vector<float>& got, const std::vector<__half>& a, B b_at, int m, int n, int k) {
  double worst = 0;
  for (int r = 0; r < m; ++r)
    for (int c = 0; c < n; ++c) {
      double want = 0, mag = 0;
      for (int kk = 0; kk < k; ++kk) {
        const double x = double(__half2float(a[size_t(r) * k + kk])) * b_at(kk, c);
        want += x;
        mag += std::fabs(x);
      }
      const double g = got[size_t(r) * n + c];
      worst = std::max(worst, std::isfinite(g) ? std::fabs(g - want) / std::max(mag, 1e-30) : INFINITY);
    }
  return worst;
}

// Runs `launch` with `out` poisoned (NaN) first and copies `out` into `got`.
template <class Launch>
void poisoned_run(DeviceBuffer<float>& out, std::vector<float>& got, Launch launch) {
  got.resize(out.size());
  CUDA_OK(cudaMemset(out.data(), 0xff, out.bytes()));
  launch();
  CUDA_OK(cudaDeviceSynchronize());
  CUDA_OK(cudaMemcpy(got.data(), out.data(), out.bytes(), cudaMemcpyDeviceToHost));
}

TEST(GpuWgmma, QueryKeyProductRegistersTimesKMajorTile) {
  std::mt19937 rng(5);
  for (int rep = 0; rep < 3; ++rep) {
    const auto a = random_halves(64 * 128, rng), b = random_halves(64 * 128, rng);
    DeviceBuffer<__half> da(a), db(b);
    DeviceBuffer<float> dd(64 * 64);
    std::vector<float> got;
    ASSERT_NO_FATAL_FAILURE(poisoned_run(dd, got, [&] { qk_kernel<<<1, 128>>>(da.data(), db.data(), dd.data()); }));
    const double e = worst_error(
        got, a, [&b](int kk, int c) { return double(__half2float(b[size_t(c) * 128 + kk])); }, 64, 64, 128);
    std::printf("S = Q·Kᵀ: worst error %.2e of Σ|q·k|\n", e);
    EXPECT_LT(e, 128 * std::ldexp(1.0, -23));
  }
}

TEST(GpuWgmma, ProbabilityValueProductKMajorTimesMnMajorTile) {
  std::mt19937 rng(6);
  for (int rep = 0; rep < 3; ++rep) {
    const auto p = random_halves(64 * 64, rng), v = random_halves(64 * 128, rng);
    DeviceBuffer<__half> dp(p), dv(v);
    DeviceBuffer<float> dd(64 * 128);
    std::vector<float> got;
    const auto v_at = [&v](int kk, int c) { return double(__half2float(v[size_t(kk) * 128 + c])); };
    // lbo = the 64-channel blocks' stride, sbo = the 8-key groups' stride (what prefill passes).
    ASSERT_NO_FATAL_FAILURE(
        poisoned_run(dd, got, [&] { pv_kernel<<<1, 128>>>(dp.data(), dv.data(), dd.data(), 2 * kBlock, 1024); }));
    const double e = worst_error(got, p, v_at, 64, 128, 64);
    std::printf("O = P·V: worst error %.2e of Σ|p·v|\n", e);
    EXPECT_LT(e, 64 * std::ldexp(1.0, -23));
    if (!(e < 64 * std::ldexp(1.0, -23))) {  // which convention the hardware reads, for the record
      ASSERT_NO_FATAL_FAILURE(
          poisoned_run(dd, got, [&] { pv_kernel<<<1, 128>>>(dp.data(), dv.data(), dd.data(), 1024, 2 * kBlock); }));
      std::printf("  with lbo and sbo swapped: worst error %.2e\n", worst_error(got, p, v_at, 64, 128, 64));
    }
  }
}

}  // namespace
}  // namespace kvcc
