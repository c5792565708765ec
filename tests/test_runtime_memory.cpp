// Memory accounting (runtime/memory.h) against values worked out by hand from kv_layout.h's
// formulas, against the cache's own bytes_in_use, and its edge cases; `kvcc memory`'s table and
// errors.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <memory>
#include <string>
#include <sys/wait.h>

#include "formats/artifact.h"
#include "formats/error.h"
#include "formats_test_util.h"
#include "runtime/kv_cache.h"
#include "runtime/memory.h"

namespace kvcc {
namespace {

// Llama-3.1-8B's cache shape with the default recipe: 32 layers, 8 KV heads, d = 128, G = d,
// P = 64, S = 64, W = 256.
KvGeometry llama8b() {
  KvGeometry g;
  g.n_layers = 32;
  g.n_kv_heads = 8;
  g.head_dim = 128;
  g.group = 128;
  return g;
}

constexpr int64_t kGiB = int64_t(1) << 30;

TEST(RuntimeMemory, Llama8bByHand) {
  const KvGeometry g = llama8b();
  // A (page, layer, head) block: K and V codes 64 × 32 bytes, K and V params 64 × 4 bytes = 4608;
  // a page holds it for 32 × 8 (layer, head) pairs.
  const int64_t page = 4608 * 256;
  // A window slot: K and V, sink 64 + ring 256 rows of 128 bf16, per (layer, head) = 163840 bytes.
  const int64_t slot = 2 * (64 + 256) * 128 * 2 * 256;
  // A BF16 page: 64 tokens × (K, V) × 128 × 2 bytes per (layer, head).
  const int64_t bf16_page = 64 * 2 * 128 * 2 * 256;
  EXPECT_EQ(bf16_page_bytes(g), bf16_page);

  // 128K: 131008 post-sink tokens, ceil((131008 − 256) / 64) = 2043 pages.
  const SequenceMemory m128 = sequence_memory(g, 131072, 80 * kGiB);
  EXPECT_EQ(m128.int2_bytes, slot + 2043 * page);
  EXPECT_EQ(m128.int2_bytes, int64_t(2451963904));
  EXPECT_EQ(m128.bf16_bytes, 2048 * bf16_page);
  EXPECT_EQ(m128.bf16_bytes, 16 * kGiB);
  // docs/runtime.md: 585 bytes per token and layer at 128K against 4096 for BF16.
  EXPECT_NEAR(m128.int2_token_layer, 584.6, 0.05);
  EXPECT_EQ(std::lround(m128.int2_token_layer), 585);
  EXPECT_EQ(m128.bf16_token_layer, 4096.0);
  EXPECT_EQ(m128.int2_sequences, 35);  // 85899345920 / 2451963904 = 35.03
  EXPECT_EQ(m128.bf16_sequences, 5);
  EXPECT_NEAR(m128.ratio(), 7.006, 0.001);

  // 32K: 32704 post-sink tokens, ceil((32704 − 256) / 64) = 507 pages.
  const SequenceMemory m32 = sequence_memory(g, 32768, 80 * kGiB);
  EXPECT_EQ(m32.int2_bytes, slot + 507 * page);
  EXPECT_EQ(m32.bf16_bytes, 4 * kGiB);
  EXPECT_NEAR(m32.int2_token_layer, 610.4, 0.05);
  EXPECT_EQ(m32.int2_sequences, 134);  // 85899345920 / 640024576 = 134.2
  EXPECT_EQ(m32.bf16_sequences, 20);
}

TEST(RuntimeMemory, RoundingAndShortContexts) {
  const KvGeometry g = llama8b();
  const int64_t page = 4608 * 256, slot = int64_t(g.window_slot_bytes()), bf16_page = bf16_page_bytes(g);
  // Below sink + ring (320) the slot alone; one more token flushes a whole page.
  EXPECT_EQ(int2_sequence_bytes(g, 0), slot);
  EXPECT_EQ(int2_sequence_bytes(g, 1), slot);
  EXPECT_EQ(int2_sequence_bytes(g, 100), slot);
  EXPECT_EQ(int2_sequence_bytes(g, 320), slot);
  EXPECT_EQ(int2_sequence_bytes(g, 321), slot + page);
  EXPECT_EQ(int2_sequence_bytes(g, 384), slot + page);
  EXPECT_EQ(int2_sequence_bytes(g, 385), slot + 2 * page);
  // BF16: whole pages of 64 tokens.
  EXPECT_EQ(bf16_sequence_bytes(g, 0), 0);
  EXPECT_EQ(bf16_sequence_bytes(g, 1), bf16_page);
  EXPECT_EQ(bf16_sequence_bytes(g, 64), bf16_page);
  EXPECT_EQ(bf16_sequence_bytes(g, 65), 2 * bf16_page);
  // A short context costs more in the INT2 cache (its whole BF16 windows) than in BF16 pages.
  const SequenceMemory m = sequence_memory(g, 100, 80 * kGiB);
  EXPECT_EQ(m.int2_bytes, slot);
  EXPECT_EQ(m.bf16_bytes, 2 * bf16_page);
  EXPECT_LT(m.ratio(), 1.0);
  EXPECT_EQ(m.int2_sequences, 80 * kGiB / slot);
  // Zero budget: nothing fits.
  const SequenceMemory z = sequence_memory(g, 131072, 0);
  EXPECT_EQ(z.int2_sequences, 0);
  EXPECT_EQ(z.bf16_sequences, 0);
  EXPECT_EQ(sequences_in_budget(10, 3), 3);
  EXPECT_EQ(sequences_in_budget(2, 3), 0);
}

TEST(RuntimeMemory, GroupsAndOtherWindows) {
  KvGeometry g = llama8b();
  g.group = 32;  // 4 (scale, zero) pairs a row: params 64 × 16 bytes per side
  g.sink = 16;
  g.recent = 128;
  g.page_tokens = 32;
  g.n_layers = 2;
  g.n_kv_heads = 1;
  const int64_t page = (2 * 32 * 32 + 2 * 32 * 16) * 2;
  const int64_t slot = 2 * (16 + 128) * 128 * 2 * 2;
  // 1000 tokens: 984 post-sink, ceil((984 − 128) / 32) = 27 pages.
  EXPECT_EQ(int2_sequence_bytes(g, 1000), slot + 27 * page);
  EXPECT_EQ(bf16_sequence_bytes(g, 1000), 32 * (32 * 2 * 128 * 2 * 2));  // ceil(1000 / 32) = 32 pages
}

// Per-channel keys (one key group a 64-token page): 128 key pairs a block instead of 64, of 4 bytes
// (fp16) or 2 (key_params=e5m3, as large as the per-token block).
TEST(RuntimeMemory, PerChannelKeyPairs) {
  KvGeometry g = llama8b();
  g.n_layers = 1;
  g.n_kv_heads = 1;
  g.key_group_tokens = 64;
  const int64_t slot = 2 * (64 + 256) * 128 * 2;
  // 1000 tokens: 936 post-sink, ceil((936 − 256) / 64) = 11 pages.
  EXPECT_EQ(int2_sequence_bytes(g, 1000), slot + 11 * (2 * 64 * 32 + 128 * 4 + 64 * 4));
  g.key_pair_bytes = 2;
  EXPECT_EQ(int2_sequence_bytes(g, 1000), slot + 11 * (2 * 64 * 32 + 128 * 2 + 64 * 4));
  g.key_group_tokens = 0;
  EXPECT_EQ(int2_sequence_bytes(g, 1000), slot + 11 * 4608);
  g.key_group_tokens = 64;
  g.key_pair_bytes = 3;
  EXPECT_THROW(int2_sequence_bytes(g, 1000), Error);
}

// The formulas are what the cache itself counts for one sequence.
TEST(RuntimeMemory, MatchesTheCachesBytesInUse) {
  KvGeometry g;
  g.n_layers = 3;
  g.n_kv_heads = 2;
  g.head_dim = 16;
  g.group = 8;
  g.page_tokens = 16;
  g.sink = 8;
  g.recent = 32;
  KvCache cache(KvCacheConfig{g, 64, 1, PoolMemory::Host});
  const int seq = cache.add_sequence();
  int64_t n = 0;
  for (int64_t add : {0, 1, 7, 30, 1, 15, 1, 16, 200, 17, 300}) {
    cache.grow(seq, add);
    n += add;
    EXPECT_EQ(int64_t(cache.bytes_in_use()), int2_sequence_bytes(g, n)) << "length " << n;
  }
}

TEST(RuntimeMemory, RefusesNegativeAndBadInputs) {
  const KvGeometry g = llama8b();
  auto message = [](auto&& f) {
    try {
      f();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message([&] { int2_sequence_bytes(g, -1); }).find("negative context -1"), std::string::npos);
  EXPECT_NE(message([&] { bf16_sequence_bytes(g, -5); }).find("negative context -5"), std::string::npos);
  EXPECT_NE(message([&] { sequence_memory(g, 0, 1); }).find("context must be positive"), std::string::npos);
  EXPECT_NE(message([&] { sequence_memory(g, 1024, -1); }).find("negative budget -1"), std::string::npos);
  EXPECT_NE(message([&] { sequences_in_budget(1, 0); }).find("bytes per sequence must be positive"), std::string::npos);
  KvGeometry bad = g;
  bad.n_layers = 0;
  EXPECT_NE(message([&] { int2_sequence_bytes(bad, 1); }).find("layers must be positive"), std::string::npos);
  bad = g;
  bad.n_kv_heads = -2;
  EXPECT_NE(message([&] { bf16_page_bytes(bad); }).find("KV heads must be positive"), std::string::npos);
  bad = g;
  bad.head_dim = 130;
  EXPECT_NE(message([&] { int2_sequence_bytes(bad, 1); }).find("multiple of 4"), std::string::npos);
  bad = g;
  bad.recent = 32;
  EXPECT_NE(message([&] { int2_sequence_bytes(bad, 1); }).find("at least one page"), std::string::npos);
  bad = g;
  bad.sink = -1;
  EXPECT_NE(message([&] { int2_sequence_bytes(bad, 1); }).find("negative sink"), std::string::npos);
  EXPECT_NE(message([&] { int2_sequence_bytes(g, std::numeric_limits<int64_t>::max() / 2); }).find("overflows"),
            std::string::npos);
}

#if defined(KVCC_BINARY)
// `kvcc memory`: runs the binary, returns its exit code and stdout + stderr.
std::pair<int, std::string> kvcc(const std::string& args) {
  const std::string cmd = std::string(KVCC_BINARY) + " memory " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  std::array<char, 4096> buf{};
  while (p && std::fgets(buf.data(), int(buf.size()), p)) out += buf.data();
  const int status = p ? pclose(p) : -1;
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

TEST(RuntimeMemoryCli, PrintsTheTable) {
  const auto [rc, out] = kvcc(
      "--layers 32 --kv-heads 8 --head-dim 128 --sink 64 --recent 256 --page-size 64 "
      "--context 32768,128K --budget 80GiB");
  ASSERT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("85899345920 bytes"), std::string::npos) << out;
  // 32K: 610.4 vs 4096 bytes per token and layer, 134 vs 20 sequences; 128K: 584.6, 35 vs 5.
  EXPECT_NE(out.find("610.4"), std::string::npos) << out;
  EXPECT_NE(out.find("584.6"), std::string::npos) << out;
  EXPECT_NE(out.find("4096.0"), std::string::npos) << out;
  EXPECT_NE(out.find("134"), std::string::npos) << out;
  EXPECT_NE(out.find("131072"), std::string::npos) << out;
  // Per rank of 2 (tensor parallel): half the bytes, so twice the sequences in the same budget.
  const auto [rc2, out2] = kvcc("--layers 32 --kv-heads 8 --head-dim 128 --context 32768 --budget 80GiB --ranks 2");
  ASSERT_EQ(rc2, 0) << out2;
  EXPECT_NE(out2.find(" 268 "), std::string::npos) << out2;
  EXPECT_NE(out2.find(" 40 "), std::string::npos) << out2;
}

TEST(RuntimeMemoryCli, ClearErrors) {
  const std::string shape = "--layers 32 --kv-heads 8 --head-dim 128 ";
  const std::pair<std::string, std::string> cases[] = {
      {shape + "--context 32768 --budget -5GiB", "budget"},
      {shape + "--context 32768 --budget 0", "budget must be positive"},
      {shape + "--context 32768 --budget 80XB", "unknown unit"},
      {shape + "--context 32768 --budget lots", "not a size"},
      {shape + "--context -1 --budget 1GiB", "context"},
      {shape + "--context 0 --budget 1GiB", "context must be positive"},
      {shape + "--context 12,abc --budget 1GiB", "not a token count"},
      {"--layers 0 --kv-heads 8 --head-dim 128 --context 1024 --budget 1GiB", "layers must be positive"},
      {"--layers 32 --kv-heads 8 --head-dim 128 --page-size 64 --recent 32 --context 1024 --budget 1GiB",
       "at least one page"},
      {"--layers 32 --kv-heads 8 --context 1024 --budget 1GiB", "--head-dim"},
      {shape + "--context 1024 --budget 1GiB --ranks 3", "3 ranks do not divide 8 KV heads"},
      {"--artifact x.h5 --layers 2 --context 1024 --budget 1GiB", "excludes"},
  };
  for (const auto& [args, want] : cases) {
    const auto [rc, out] = kvcc(args);
    EXPECT_NE(rc, 0) << args;
    EXPECT_NE(out.find(want), std::string::npos) << args << "\n" << out;
  }
  const auto [rc, out] = kvcc("--help");
  EXPECT_EQ(rc, 0);
  EXPECT_NE(out.find("Example"), std::string::npos) << out;
}

// An artifact whose (layer, KV head) sides have their own code widths (compile --bits-budget):
// the table's INT2 bytes are those of its pages (PageLayout), by hand: per rank of 2 the rank
// whose heads take more.
TEST(RuntimeMemoryCli, ArtifactWidths) {
  testing::ScratchDir dir;
  const ModelConfig c = testing::small_config(2, 4, 2, 128);
  Artifact a = testing::random_artifact(c, testing::small_fingerprint(c), 7);
  a.recipe.sink = 64;
  a.recipe.recent = 256;
  a.recipe.page_size = 64;
  const BlockWidths w[4] = {{4, 3}, {2, 1}, {2, 2}, {1, 1}};  // (layer, head): 16 code bits a token in all
  for (int i = 0; i < 4; ++i) {
    HeadArtifact& h = a.heads[size_t(i)];
    h.key.levels.clear();
    h.value.extras.clear();
    h.key.bits = w[i].key;
    h.value.bits = w[i].value;
  }
  write_artifact(a, dir.file("w.kvcc.h5"));
  const auto [rc, out] = kvcc("--artifact " + dir.file("w.kvcc.h5") + " --context 1024 --budget 1GiB");
  ASSERT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("code bits per (layer, KV head): keys 1-4, values 1-3"), std::string::npos) << out;
  // 1024 tokens: sink 64, 704 in 11 pages, ring 256. A page: 64 tokens × 128 channels × 16 code
  // bits / 8 + 4 blocks × 2 sides × 64 × 4 parameter bytes; the slot 2 × 320 × 128 × 2 × 4 bytes.
  const int64_t page = 64 * 128 * 16 / 8 + 4 * 2 * 64 * 4, slot = 2 * 320 * 128 * 2 * 4;
  EXPECT_NE(out.find(" " + std::to_string(slot + 11 * page) + " "), std::string::npos) << out;
  // Rank 0 holds heads {4/3, 2/2} (11 bits), rank 1 {2/1, 1/1} (5 bits): the table is rank 0's.
  const auto [rc2, out2] = kvcc("--artifact " + dir.file("w.kvcc.h5") + " --context 1024 --budget 1GiB --ranks 2");
  ASSERT_EQ(rc2, 0) << out2;
  const int64_t page0 = 64 * 128 * 11 / 8 + 2 * 2 * 64 * 4;
  EXPECT_NE(out2.find(" " + std::to_string(slot / 2 + 11 * page0) + " "), std::string::npos) << out2;
}
#endif

}  // namespace
}  // namespace kvcc
