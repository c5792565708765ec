#include "runtime/memory.h"

#include <limits>
#include <string>

#include "formats/error.h"

namespace kvcc {

namespace {
// The geometry rules of the layout that the byte formulas rely on (KvCache checks the same and,
// per pool, the head_dim multiple).
void check(const KvGeometry& g) {
  KVCC_REQUIRE(g.n_layers > 0, "memory: layers must be positive, got " + std::to_string(g.n_layers));
  KVCC_REQUIRE(g.n_kv_heads > 0, "memory: KV heads must be positive, got " + std::to_string(g.n_kv_heads));
  KVCC_REQUIRE(g.head_dim > 0 && g.head_dim % 4 == 0,
               "memory: head_dim must be a positive multiple of 4, got " + std::to_string(g.head_dim));
  KVCC_REQUIRE(g.group > 0 && g.head_dim % g.group == 0,
               "memory: group " + std::to_string(g.group) + " does not divide head_dim " + std::to_string(g.head_dim));
  KVCC_REQUIRE(g.page_tokens > 0, "memory: page size must be positive, got " + std::to_string(g.page_tokens));
  KVCC_REQUIRE(g.key_group_tokens >= 0 && (g.key_group_tokens == 0 || g.page_tokens % g.key_group_tokens == 0),
               "memory: per-channel key groups of " + std::to_string(g.key_group_tokens) +
                   " tokens do not divide the page of " + std::to_string(g.page_tokens));
  KVCC_REQUIRE(g.key_pair_bytes == 2 || g.key_pair_bytes == 4,
               "memory: a per-channel key pair takes 2 or 4 bytes, not " + std::to_string(g.key_pair_bytes));
  KVCC_REQUIRE(g.sink >= 0, "memory: negative sink size " + std::to_string(g.sink));
  KVCC_REQUIRE(g.recent >= g.page_tokens, "memory: the recent window (" + std::to_string(g.recent) +
                                              ") must hold at least one page (" + std::to_string(g.page_tokens) + ")");
}

int64_t mul(int64_t a, int64_t b) {
  KVCC_REQUIRE(a == 0 || b <= std::numeric_limits<int64_t>::max() / a, "memory: byte count overflows 64 bits");
  return a * b;
}
int64_t add(int64_t a, int64_t b) {
  KVCC_REQUIRE(b <= std::numeric_limits<int64_t>::max() - a, "memory: byte count overflows 64 bits");
  return a + b;
}
}  // namespace

int64_t int2_sequence_bytes(const KvGeometry& g, int64_t context, const std::vector<BlockWidths>& widths) {
  check(g);
  KVCC_REQUIRE(context >= 0, "memory: negative context " + std::to_string(context));
  const PageLayout layout(g, widths);
  return add(int64_t(g.window_slot_bytes()), mul(history_pages(g, context), int64_t(layout.page_bytes())));
}

int64_t bf16_page_bytes(const KvGeometry& g) {
  check(g);
  return mul(mul(int64_t(g.page_tokens) * 2 * 2, g.head_dim), int64_t(g.n_layers) * g.n_kv_heads);
}

int64_t bf16_sequence_bytes(const KvGeometry& g, int64_t context) {
  KVCC_REQUIRE(context >= 0, "memory: negative context " + std::to_string(context));
  const int64_t pages = context / g.page_tokens + (context % g.page_tokens != 0 ? 1 : 0);
  return mul(pages, bf16_page_bytes(g));
}

int64_t sequences_in_budget(int64_t budget_bytes, int64_t bytes_per_sequence) {
  KVCC_REQUIRE(budget_bytes >= 0, "memory: negative budget " + std::to_string(budget_bytes));
  KVCC_REQUIRE(bytes_per_sequence > 0,
               "memory: bytes per sequence must be positive, got " + std::to_string(bytes_per_sequence));
  return budget_bytes / bytes_per_sequence;
}

SequenceMemory sequence_memory(const KvGeometry& g, int64_t context, int64_t budget_bytes,
                               const std::vector<BlockWidths>& widths) {
  KVCC_REQUIRE(context > 0, "memory: context must be positive, got " + std::to_string(context));
  SequenceMemory m;
  m.context = context;
  m.int2_bytes = int2_sequence_bytes(g, context, widths);
  m.bf16_bytes = bf16_sequence_bytes(g, context);
  const double tokens_layers = double(context) * double(g.n_layers);
  m.int2_token_layer = double(m.int2_bytes) / tokens_layers;
  m.bf16_token_layer = double(m.bf16_bytes) / tokens_layers;
  m.int2_sequences = sequences_in_budget(budget_bytes, m.int2_bytes);
  m.bf16_sequences = sequences_in_budget(budget_bytes, m.bf16_bytes);
  return m;
}

}  // namespace kvcc
