// The PTX the kernels use, wrapped once: warp-level and warpgroup MMAs, movmatrix, ex2, cp.async,
// bulk (TMA) copies with their mbarriers, and programmatic dependent launch. Device code only,
// built for sm_90a (the warpgroup MMAs need it).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace kvcc {

// ---- Tensor cores (mma.sync, fp32 or int32 accumulators in place)

// D = A·B + D, A 16×16 fp16 (row), B 16×8 fp16 (col).
__device__ __forceinline__ void mma_f16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                        uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma_f16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  mma_f16(c, a[0], a[1], a[2], a[3], b0, b1);
}
// The same with bf16 operands.
__device__ __forceinline__ void mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                         uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// Four 8×8 b16 matrices from shared memory, lane l giving the address of row l % 8 of matrix l / 8;
// register m holds matrix m, lane l its row l / 4, columns 2(l % 4) and + 1 (an mma.sync A or B
// fragment). _trans: transposed (row 2(l % 4) and + 1, column l / 4: B from a k-major tile). volatile:
// the tile under the address changes between calls.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
// Integer MMA: int8 A (row) × int8 B (col), exact int32 accumulation. A = key codes, B = query.
__device__ __forceinline__ void mma_s8(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                       uint32_t b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// The same with each operand's bytes signed (s8) or unsigned (u8): the rotation's fixed-point
// bytes (rotate_kv.cuh), a high s8 byte and low u8 ones.
template <bool kASigned, bool kBSigned>
__device__ __forceinline__ void mma_i8(int (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (kASigned && kBSigned)
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else if constexpr (kASigned)
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.u8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else if constexpr (kBSigned)
    asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else
    asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.u8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// The 8×8 16-bit block held by a warp (a register each), transposed.
__device__ __forceinline__ uint32_t transpose8x8(uint32_t a) {
  uint32_t d;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(d) : "r"(a));
  return d;
}

// ---- Warpgroup MMAs (wgmma, sm_90a): issued by the 4 warps of a warpgroup together, asynchronous
// until wgmma_wait. A comes from registers: each warp's 16 rows in mma.m16n8k16's A layout. The
// accumulator of an m64nN MMA holds, per warp, 16 rows in mma.m16n8k16's C layout for each 8
// columns: d[4j + 2i + e] = (row g + 8i, column 8j + 2t + e), g = lane / 4, t = lane % 4.

// The descriptor of a 128-byte-swizzled shared-memory operand (the PTX ISA's matrix descriptor:
// address, leading and stride byte offsets in 16-byte units, swizzle mode 1 = 128 bytes). The
// swizzle atom (8 rows of 128 bytes, 16-byte chunk c of row r at chunk c ^ (r % 8)) must start on
// a 1024-byte boundary. K-major B: sbo = the stride of 8-row groups, lbo unused (16). MN-major B:
// lbo = the stride of 64-element column blocks, sbo = the stride of 8-row (k) groups.
// Byte offset of 16-byte chunk c (0..7) of row r in such 128-byte rows.
__host__ __device__ constexpr int sw128_offset(int r, int c) { return r * 128 + (((c ^ r) & 7) << 4); }
__device__ __forceinline__ uint64_t wgmma_desc_sw128(uint32_t smem_address, uint32_t lbo, uint32_t sbo) {
  return uint64_t((smem_address >> 4) & 0x3FFF) | (uint64_t((lbo >> 4) & 0x3FFF) << 16) |
         (uint64_t((sbo >> 4) & 0x3FFF) << 32) | (uint64_t(1) << 62);
}
// Orders this warpgroup's earlier register writes before the MMAs that read them.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
// Waits until at most N committed groups of this warpgroup are pending.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// After a wait: keeps the compiler from moving reads or writes of the accumulators r above it
// (no code; it orders the compiler's view only, ptxas sees nothing).
template <int N>
__device__ __forceinline__ void wgmma_hold(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
// Barrier `id` (1..15; 0 is __syncthreads') among `threads` threads of the CTA, e.g. one warpgroup.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
// Shared memory written by ordinary stores (or cp.async) and read next by the tensor cores.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// D[64×N] (+)= A[64×16] · B[16×N] in fp16 with fp32 accumulation. kAccumulate = 0 overwrites D
// and takes no input from its registers (they need no initial value); kTransB = 0: B is K-major
// in shared memory, 1: MN-major. A register operand (a0..a3, and D) is read after the MMA is
// issued, until its wait, and ptxas 13.0 was seen handing such a register to other code before
// the wait: give register A only values that stay live across the wait (the prefill's Q).
#define KVCC_D8(c, i) c(d[i]), c(d[i + 1]), c(d[i + 2]), c(d[i + 3]), c(d[i + 4]), c(d[i + 5]), c(d[i + 6]), c(d[i + 7])
#define KVCC_D32(c) KVCC_D8(c, 0), KVCC_D8(c, 8), KVCC_D8(c, 16), KVCC_D8(c, 24)
#define KVCC_D64(c) KVCC_D32(c), KVCC_D8(c, 32), KVCC_D8(c, 40), KVCC_D8(c, 48), KVCC_D8(c, 56)
template <int kTransB, int kAccumulate>
__device__ __forceinline__ void wgmma_m64n64k16_rs(float (&d)[32], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                                   uint64_t desc_b) {
#define KVCC_M64N64_RS                                                                                          \
  "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, " \
  "%13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "            \
  "{%32, %33, %34, %35}, %36, %37, 1, 1, %38;"
  if constexpr (kAccumulate) {
    asm volatile(KVCC_M64N64_RS
                 : KVCC_D32("+f")
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc_b), "n"(kAccumulate), "n"(kTransB));
  } else {
    asm volatile(KVCC_M64N64_RS
                 : KVCC_D32("=f")
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc_b), "n"(kAccumulate), "n"(kTransB));
  }
#undef KVCC_M64N64_RS
}
// D[64×128] (+)= A[64×16] · B[16×128], A from shared memory too (K-major, through its descriptor).
template <int kTransB, int kAccumulate>
__device__ __forceinline__ void wgmma_m64n128k16_ss(float (&d)[64], uint64_t desc_a, uint64_t desc_b) {
#define KVCC_M64N128_SS                                                                                       \
  "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "   \
  "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, " \
  "%33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, " \
  "%54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, %66, 1, 1, 0, %67;"
  if constexpr (kAccumulate) {
    asm volatile(KVCC_M64N128_SS : KVCC_D64("+f") : "l"(desc_a), "l"(desc_b), "n"(kAccumulate), "n"(kTransB));
  } else {
    asm volatile(KVCC_M64N128_SS : KVCC_D64("=f") : "l"(desc_a), "l"(desc_b), "n"(kAccumulate), "n"(kTransB));
  }
#undef KVCC_M64N128_SS
}
#undef KVCC_D8
#undef KVCC_D32
#undef KVCC_D64

// 2^x (MUFU.EX2; 2^-inf = 0). Relative error ~2^-22, far below the fp16/bf16 operands'.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// ---- cp.async (16 bytes per lane)

// 16 bytes global -> shared; src_bytes = 0 writes zeros (rows outside the valid range, so that
// 0·garbage never reaches the PV product).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes) {
  const uint32_t dst = uint32_t(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(gmem), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// ---- Bulk copies (the TMA unit) and mbarriers

// The shared-space address of a generic pointer to shared memory.
__device__ __forceinline__ uint32_t smem_addr(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }
// One bulk copy of `bytes` into shared memory at dst, completing on the mbarrier at b (both
// shared-space addresses): one instruction of one lane per page instead of 9 cp.async per lane
// (decode: measured 0.5–1% faster at >= 32K context, 0.4–1.5% slower at 4K, same run).
__device__ __forceinline__ void bulk_copy(uint32_t dst, const void* gmem, uint32_t bytes, uint32_t b) {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the stage's earlier reads come first
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "l"(gmem), "r"(bytes), "r"(b)
               : "memory");
}
// Barriers bar[0 .. n) for `count` arrivals each (1: the copy's issuer), made by lane 0 for its warp.
__device__ __forceinline__ void mbar_init(uint64_t* bar, int n, int lane, int count = 1) {
  if (lane == 0)
    for (int i = 0; i < n; ++i)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(uint32_t(__cvta_generic_to_shared(bar + i))),
                   "r"(count)
                   : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");  // visible to the copy unit
  __syncwarp();
}
// Waits for the phase of parity `parity` of the mbarrier at shared-space address b.
__device__ __forceinline__ void mbar_wait(uint32_t b, uint32_t parity) {
  uint32_t done = 0;
  while (!done)
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done)
                 : "r"(b), "r"(parity)
                 : "memory");
}

// This thread's arrival on the mbarrier at b (release: its earlier writes are seen by the waiters).
__device__ __forceinline__ void mbar_arrive(uint32_t b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(b) : "memory");
}
// This thread's arrival on the mbarrier at b once its cp.async copies issued so far have landed
// (counts as one of the expected arrivals).
__device__ __forceinline__ void cp_async_mbar_arrive(uint32_t b) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(b) : "memory");
}

// ---- Registers per thread of a warpgroup (sm_90a; all its warps execute it): a producer
// warpgroup gives registers back, the MMA warpgroups take them.
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
}

// ---- Programmatic dependent launch

// Lets the next kernel of the stream (launched with programmatic stream serialization) start.
__device__ __forceinline__ void pdl_launch_dependents() { asm volatile("griddepcontrol.launch_dependents;"); }
// Waits until the preceding kernel of the stream has completed and its writes are visible.
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

}  // namespace kvcc
