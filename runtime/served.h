// The shapes the CUDA kernels serve, in one place: their cache geometry as constants derived from
// formats/kv_layout.h, and the one table (gpu_unsupported_reason) that the Runtime, the launchers
// of runtime/kv_kernels.h and the benchmarks all ask. Plain C++ (no CUDA), so the CPU build and its
// tests (tests/test_plan.cpp) see the same answers as the GPU build.
#pragma once
#include <string>

#include "formats/kv_layout.h"

namespace kvcc {

// The geometry the kernels are built for: head_dim 128 (the MMA tiling: 4 codes per byte, one
// warp of 32 lanes × 4 channels per row), one (scale, zero) group per row, and kv_layout.h's
// default page of 64 tokens. KvGeometry's byte functions are not constexpr, so the page block's
// layout is spelled out below from the same formulas; tests/test_plan.cpp checks every constant
// against KvGeometry's own functions.
constexpr int kGpuHeadDim = 128;
constexpr int kGpuPageTokens = KvGeometry{}.page_tokens;                 // P
constexpr int kGpuCodeRowBytes = kGpuHeadDim / 4;                        // code_row_bytes(): 4 codes a byte
constexpr int kGpuParamBytes = 4;                                        // one (scale, zero) fp16 pair a token
constexpr int kGpuCodesBytes = kGpuPageTokens * kGpuCodeRowBytes;        // codes_bytes()
constexpr int kGpuParamsBytes = kGpuPageTokens * kGpuParamBytes;         // params_bytes() at group = head_dim
constexpr int kGpuVCodesOffset = kGpuCodesBytes;                         // v_codes_offset()
constexpr int kGpuKParamsOffset = 2 * kGpuCodesBytes;                    // k_params_offset()
constexpr int kGpuVParamsOffset = 2 * kGpuCodesBytes + kGpuParamsBytes;  // v_params_offset()
constexpr int kGpuPageBytes = 2 * kGpuCodesBytes + 2 * kGpuParamsBytes;  // page_head_bytes(): 4608
constexpr int kGpuBf16RowBytes = 2 * kGpuHeadDim;                        // one sink / ring row
// Per-channel key pages (key_group_tokens = P, key_pair_bytes = 2): one 2-byte (scale, zero) pair
// per channel for the page's keys (codec_scalar.h ChanParams), so the key parameters take head_dim
// 2-byte pairs instead of P 4-byte ones: the block is as long as the per-token one.
constexpr int kGpuChanPairBytes = 2;
constexpr int kGpuChanKParamsBytes = kGpuHeadDim * kGpuChanPairBytes;            // k_params_bytes(): 256
constexpr int kGpuChanVParamsOffset = kGpuKParamsOffset + kGpuChanKParamsBytes;  // v_params_offset()
constexpr int kGpuChanPageBytes = kGpuChanVParamsOffset + kGpuParamsBytes;       // page_head_bytes(): 4608
static_assert(kGpuChanPageBytes == kGpuPageBytes, "2-byte pairs: a per-channel block is a per-token one's size");
// A page block at kKB / kVB bits a key / value code (kv_layout.h: each row its bit planes, the
// 2-bit plane first; 1 bit: the 1-bit plane alone), per-token or per-channel (kChan) key
// parameters. GpuBlock<2, 2, false> is the block above.
template <int kKB, int kVB, bool kChan>
struct GpuBlock {
  static_assert(kKB >= 1 && kKB <= 4 && kVB >= 1 && kVB <= 4, "codes of 1 to 4 bits");
  static constexpr int kKRowBytes = kGpuHeadDim * kKB / 8;
  static constexpr int kVRowBytes = kGpuHeadDim * kVB / 8;
  static constexpr int kVCodesOffset = kGpuPageTokens * kKRowBytes;
  static constexpr int kKParamsOffset = kVCodesOffset + kGpuPageTokens * kVRowBytes;
  static constexpr int kVParamsOffset = kKParamsOffset + (kChan ? kGpuChanKParamsBytes : kGpuParamsBytes);
  static constexpr int kBytes = kVParamsOffset + kGpuParamsBytes;
};
static_assert(GpuBlock<2, 2, false>::kBytes == kGpuPageBytes && GpuBlock<2, 2, true>::kBytes == kGpuChanPageBytes &&
                  GpuBlock<2, 2, true>::kVParamsOffset == kGpuChanVParamsOffset,
              "GpuBlock spells the 2-bit block's layout");
// Where a row's planes are (kv_layout.h for_each_code_field): the first (the 2-bit plane of code
// bits 0-1, or at 1 bit the 1-bit plane) at byte 0, the second (3 bits: the 1-bit plane of bit 2;
// 4 bits: the 2-bit plane of bits 2-3) at head_dim / 4.
template <int kBits>
struct GpuPlanes {
  static constexpr bool kFirstOneBit = kBits == 1;
  static constexpr bool kSecond = kBits >= 3;
  static constexpr bool kSecondOneBit = kBits == 3;
  static constexpr int kSecondOffset = kGpuHeadDim / 4;
};

// Decode walks the BF16 sink and ring in tiles of 16 tokens (the MMA's M), so both windows must
// be multiples of it.
constexpr int kGpuWindowTile = 16;
static_assert(kGpuPageTokens % kGpuWindowTile == 0, "a page is whole MMA tiles");
static_assert(kGpuHeadDim == 4 * 32, "append quantises a row with one warp, 4 channels per lane");

// Scope limits of the kernels beyond the geometry.
constexpr int kGpuMaxGroupHeads = 8;      // decode: query heads per KV head (the MMA's n = 8 columns)
constexpr int kDecodeMaxTableHeads = 64;  // decode with level tables: KV heads (tables are kernel parameters)
constexpr int kPrefillMaxKvHeads = 64;    // prefill: KV heads (per-head codecs are kernel parameters)

// The geometry of kv_layout.h the kernels serve (its default windows), for n_layers and KV heads.
KvGeometry gpu_geometry(int n_layers, int n_kv_heads);

// Which kernels a question is about.
enum GpuOps : unsigned { kGpuAppend = 1u, kGpuPrefill = 2u, kGpuDecode = 4u, kGpuAllOps = 7u };
// n_heads for a question about the cache alone (no query heads checked).
constexpr int kAnyQueryHeads = -1;

// Why the CUDA kernels of `ops` cannot serve this cache geometry with n_heads query heads, or ""
// when they can. level_table: some head uses a 4-level table (decode's table kernel takes <= 64
// KV heads). The rules: append needs head_dim 128 and group = head_dim; prefill also 64-token
// pages, <= 64 KV heads and query heads a multiple of the KV heads; decode the same pages and
// query-head multiple, <= 8 query heads per KV head and sink and recent windows in multiples of
// 16 tokens. A Runtime with a device pool asks this for all three when it is made, so that its
// first decode or prefill never finds the shape unsupported. Per-channel key pages (KIVI keys,
// kv_layout.h key_group_tokens) are served with one key group per 64-token page, in 2-byte pairs
// (key_pair_bytes = 2; fp16 pairs are the host pool's) (their values are
// never level tables: kivi's values are uniform grids; decode_int2 refuses the pairing by name).
std::string gpu_unsupported_reason(const KvGeometry& g, int n_heads, unsigned ops = kGpuAllOps,
                                   bool level_table = true);
// The same for the BF16 baseline decode (decode_bf16_paged): its own pages of page_tokens tokens.
std::string gpu_bf16_unsupported_reason(int n_kv_heads, int head_dim, int n_heads, int page_tokens);
// Throws Error("<who>: <reason>") when gpu_unsupported_reason is not "".
void require_gpu_served(const KvGeometry& g, int n_heads, unsigned ops, bool level_table, const char* who);

// Throws Error("<who>: ...") unless `b` is a layer of g's pages the kernels read: widths of 1-4
// bits (2 on a side with a level table), blocks of g.page_head_bytes(widths) within a page.
void check_layer_blocks(const KvGeometry& g, const LayerBlocks& b, bool key_table, bool value_table, const char* who);

// The kernels are compiled for Hopper (sm_90a: TMA bulk copies, mbarriers, programmatic dependent
// launch, warpgroup MMAs; sm_90a code runs on compute capability 9.0 only). Why device `device`
// (name, compute capability major.minor) cannot run them, or "".
std::string gpu_arch_problem(int device, const std::string& name, int major, int minor);

}  // namespace kvcc
