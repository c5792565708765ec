#include "runtime/served.h"

#include "formats/error.h"

namespace kvcc {

KvGeometry gpu_geometry(int n_layers, int n_kv_heads) {
  KvGeometry g;
  g.n_layers = n_layers;
  g.n_kv_heads = n_kv_heads;
  g.head_dim = g.group = kGpuHeadDim;
  g.page_tokens = kGpuPageTokens;
  return g;
}

namespace {
std::string str(int x) { return std::to_string(x); }

// Query heads over KV heads: a whole group per KV head, and (decode) at most the MMA's 8 columns.
std::string query_heads_problem(int n_heads, int n_kv, bool decode) {
  if (n_heads == kAnyQueryHeads) return "";
  if (n_heads <= 0 || n_kv <= 0 || n_heads % n_kv != 0)
    return str(n_heads) + " query heads over " + str(n_kv) + " KV heads (the kernels need a multiple)";
  if (decode && n_heads / n_kv > kGpuMaxGroupHeads)
    return str(n_heads / n_kv) + " query heads per KV head (decode takes <= " + str(kGpuMaxGroupHeads) + ")";
  return "";
}
}  // namespace

std::string gpu_unsupported_reason(const KvGeometry& g, int n_heads, unsigned ops, bool level_table) {
  const bool prefill = ops & kGpuPrefill, decode = ops & kGpuDecode;
  if (g.per_channel_keys() && (g.key_group_tokens != kGpuPageTokens || g.page_tokens != kGpuPageTokens))
    return "per-channel key pages in groups of " + str(g.key_group_tokens) +
           " tokens (the kernels take one group per " + str(kGpuPageTokens) + "-token page; the host pool serves any)";
  if (g.per_channel_keys() && !g.e5m3_key_pairs())
    return "per-channel key pages with fp16 (scale, zero) pairs (the kernels take 2-byte pairs: compile with "
           "--param key_params=e5m3; the host pool serves either)";
  if (g.head_dim != kGpuHeadDim) return "head_dim " + str(g.head_dim) + " (the kernels need " + str(kGpuHeadDim) + ")";
  if (g.group != g.head_dim) return "group " + str(g.group) + " (the kernels need group = head_dim)";
  if (!prefill && !decode) return "";  // append serves any pages, windows and heads
  if (g.page_tokens != kGpuPageTokens)
    return "page size " + str(g.page_tokens) + " (the kernels need " + str(kGpuPageTokens) + ")";
  if (g.n_kv_heads <= 0) return str(g.n_kv_heads) + " KV heads";
  if (prefill && g.n_kv_heads > kPrefillMaxKvHeads)
    return str(g.n_kv_heads) + " KV heads (the kernels take <= " + str(kPrefillMaxKvHeads) + ")";
  if (decode && level_table && g.n_kv_heads > kDecodeMaxTableHeads)
    return str(g.n_kv_heads) + " KV heads with level tables (decode takes <= " + str(kDecodeMaxTableHeads) + ")";
  if (std::string q = query_heads_problem(n_heads, g.n_kv_heads, decode); !q.empty()) return q;
  if (decode && (g.sink % kGpuWindowTile != 0 || g.recent % kGpuWindowTile != 0))
    return "sink " + str(g.sink) + " / recent " + str(g.recent) + " tokens (decode needs multiples of " +
           str(kGpuWindowTile) + ")";
  return "";
}

std::string gpu_bf16_unsupported_reason(int n_kv_heads, int head_dim, int n_heads, int page_tokens) {
  if (head_dim != kGpuHeadDim) return "head_dim " + str(head_dim) + " (the kernels need " + str(kGpuHeadDim) + ")";
  if (std::string q = query_heads_problem(n_heads, n_kv_heads, true); !q.empty()) return q;
  if (page_tokens <= 0 || page_tokens % kGpuWindowTile != 0)
    return "BF16 pages of " + str(page_tokens) + " tokens (need multiples of " + str(kGpuWindowTile) + ")";
  return "";
}

void require_gpu_served(const KvGeometry& g, int n_heads, unsigned ops, bool level_table, const char* who) {
  const std::string why = gpu_unsupported_reason(g, n_heads, ops, level_table);
  KVCC_REQUIRE(why.empty(), std::string(who) + ": " + why + " is not supported");
}

void check_layer_blocks(const KvGeometry& g, const LayerBlocks& b, bool key_table, bool value_table, const char* who) {
  const BlockWidths w = b.widths;
  const std::string widths = str(w.key) + " / " + str(w.value) + " bits";
  KVCC_REQUIRE(w.key >= 1 && w.key <= 4 && w.value >= 1 && w.value <= 4,
               std::string(who) + ": codes of " + widths + " (the pages hold 1 to 4)");
  KVCC_REQUIRE((!key_table || w.key == 2) && (!value_table || w.value == 2),
               std::string(who) + ": level tables with codes of " + widths + " (a table holds 4 levels: 2 bits)");
  KVCC_REQUIRE(
      b.head_bytes == g.page_head_bytes(w) && b.layer_offset + size_t(g.n_kv_heads) * b.head_bytes <= b.page_bytes,
      std::string(who) + ": the layer's blocks do not fit its widths and pages (LayerBlocks)");
}

std::string gpu_arch_problem(int device, const std::string& name, int major, int minor) {
  if (major == 9 && minor == 0) return "";
  return "kvcc's CUDA kernels need a Hopper GPU (sm_90); device " + str(device) + " is " + name + " (sm_" + str(major) +
         str(minor) + "); use the CPU pool";
}

}  // namespace kvcc
