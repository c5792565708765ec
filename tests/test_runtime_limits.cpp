// Declared step maxima (RuntimeOptions::max_batch, max_context, max_step_tokens): the capacities
// the device tables are sized by at load (runtime/plan.h's step_capacity) hold every step within
// the maxima, checked by brute force against plan_append_moves, the same walk the append kernels
// run (and the move bound is reached: it is not loose); and a Runtime refuses a step beyond them
// with an Error naming the limit, before the cache changes. Host pools: the checks are the
// Runtime's own, the same for either pool (the device side is tests/gpu_test_graph.cu).
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "formats/artifact.h"
#include "formats/error.h"
#include "formats/kv_layout.h"
#include "formats/model_config.h"
#include "runtime/kv_cache.h"
#include "runtime/kvcc_runtime.h"
#include "runtime/plan.h"
#include "cache_test_util.h"

namespace kvcc {
namespace {

KvGeometry geometry(int sink, int recent, int page) {
  KvGeometry g;
  g.n_layers = 1;
  g.n_kv_heads = 2;
  g.head_dim = 32;
  g.group = 32;
  g.page_tokens = page;
  g.sink = sink;
  g.recent = recent;
  return g;
}

// plan_append_moves for sequences of lengths n0 given counts (page ids: any, one per history page).
AppendMoves moves_of(const KvGeometry& g, const std::vector<int64_t>& n0, const std::vector<int>& counts) {
  AppendPlanHost p;
  int64_t row = 0;
  for (size_t i = 0; i < n0.size(); ++i) {
    p.seq_slots.push_back(int(i));
    p.old_lengths.push_back(n0[i]);
    p.counts.push_back(counts[i]);
    p.row_offsets.push_back(row);
    row += counts[i];
    std::vector<int32_t> table(size_t(history_pages(g, n0[i] + counts[i])));
    for (size_t j = 0; j < table.size(); ++j) table[j] = int32_t(j);
    p.page_tables.push_back(table);
  }
  return plan_append_moves(g, p);
}

TEST(StepCapacity, BoundsEveryStepWithinTheLimits) {
  for (const KvGeometry& g : {geometry(16, 64, 64), geometry(8, 32, 16), geometry(0, 64, 64), geometry(64, 256, 64)}) {
    const int P = g.page_tokens;
    // One sequence, every old length and count up to three pages: moves <= c + P - 1, writes <= c.
    int64_t most_for_one = 0;
    for (int c = 1; c <= 3 * P; ++c)
      for (int64_t n0 = 0; n0 <= 2 * (g.sink + g.recent + P); ++n0) {
        const AppendMoves m = moves_of(g, {n0}, {c});
        const StepCapacity cap = step_capacity(g, StepLimits{1, n0 + c, c});
        ASSERT_LE(int64_t(m.moves.size()), cap.moves) << "n0 " << n0 << " c " << c;
        ASSERT_LE(int64_t(m.writes.size()), cap.writes) << "n0 " << n0 << " c " << c;
        ASSERT_LE(m.rows, cap.rows);
        if (c == 1) most_for_one = std::max(most_for_one, int64_t(m.moves.size()));
      }
    // One token can flush a whole page from the ring: the bound for c = 1 is met.
    EXPECT_EQ(most_for_one, step_capacity(g, StepLimits{1, 1 << 20, 1}).moves);
    // Random batches.
    std::mt19937 rng(5);
    for (int trial = 0; trial < 2000; ++trial) {
      const int batch = 1 + int(rng() % 6), tokens = batch + int(rng() % (2 * P));
      std::vector<int> counts(size_t(batch), 1);
      for (int t = batch; t < tokens; ++t) ++counts[rng() % counts.size()];
      std::vector<int64_t> n0;
      int64_t longest = 0;
      for (int b = 0; b < batch; ++b) {
        n0.push_back(int64_t(rng() % 600));
        longest = std::max(longest, n0.back() + counts[size_t(b)]);
      }
      const AppendMoves m = moves_of(g, n0, counts);
      const StepCapacity cap = step_capacity(g, StepLimits{batch, longest, tokens});
      ASSERT_LE(int64_t(m.moves.size()), cap.moves) << "trial " << trial;
      ASSERT_LE(int64_t(m.writes.size()), cap.writes) << "trial " << trial;
      ASSERT_LE(m.rows, cap.rows) << "trial " << trial;
      // The decode batch's ints: seq_slot, seq_len, page_offset and each page table.
      int64_t ints = 3 * batch;
      for (int b = 0; b < batch; ++b) ints += history_pages(g, n0[size_t(b)] + counts[size_t(b)]);
      ASSERT_LE(ints, cap.ints) << "trial " << trial;
    }
  }
}

TEST(StepCapacity, LayoutAndBadLimits) {
  const KvGeometry g = geometry(16, 64, 64);
  const StepCapacity c = step_capacity(g, StepLimits{8, 131072, 8});
  EXPECT_EQ(c.hist_pages, history_pages(g, 131072));
  EXPECT_EQ(c.moves, 8 + 8 * 63);
  EXPECT_EQ(c.writes, 8);
  EXPECT_EQ(c.ints, 3 * 8 + 8 * c.hist_pages);
  // Header, then the decode ints at a fixed 256-byte boundary, then a step's moves and writes
  // packed after its own ints on 16-byte boundaries; no step within the limits runs past `bytes`.
  EXPECT_EQ(c.counts_at, 0u);
  EXPECT_EQ(c.ints_at % 256, 0u);
  EXPECT_GE(c.ints_at, kStepHeaderInts * sizeof(int32_t));
  std::mt19937 rng(3);
  for (int trial = 0; trial < 1000; ++trial) {
    const int64_t ints = int64_t(rng() % uint32_t(c.ints + 1)), moves = int64_t(rng() % uint32_t(c.moves + 1)),
                  writes = int64_t(rng() % uint32_t(c.writes + 1));
    const StepPacking p = step_packing(c, ints, moves, writes);
    ASSERT_EQ(p.moves_at % 16, 0u);
    ASSERT_EQ(p.writes_at % 16, 0u);
    ASSERT_GE(p.moves_at, c.ints_at + size_t(ints) * sizeof(int32_t));
    ASSERT_GE(p.writes_at, p.moves_at + size_t(moves) * sizeof(AppendMove));
    ASSERT_EQ(p.bytes, p.writes_at + size_t(writes) * sizeof(AppendWindowWrite));
    ASSERT_LE(p.bytes, c.bytes);
  }
  EXPECT_EQ(step_packing(c, c.ints, c.moves, c.writes).bytes, c.bytes);
  EXPECT_THROW(step_capacity(g, StepLimits{0, 100, 1}), Error);
  EXPECT_THROW(step_capacity(g, StepLimits{1, 0, 1}), Error);
  EXPECT_THROW(step_capacity(g, StepLimits{1, 100, -1}), Error);
  EXPECT_THROW(step_capacity(g, StepLimits{2, 100, 201}), Error);             // more than 2 x 100 tokens
  EXPECT_THROW(step_capacity(g, StepLimits{1, int64_t(1) << 32, 1}), Error);  // beyond int32 lengths
}

Artifact small_artifact() {
  ModelConfig cfg;
  cfg.architecture = "llama";
  cfg.n_layers = 1;
  cfg.n_heads = 4;
  cfg.n_kv_heads = 2;
  cfg.head_dim = 32;
  cfg.hidden = 128;
  Artifact a = testing::random_artifact(cfg, make_fingerprint(cfg, std::string(64, '0')), 3);
  a.recipe.sink = 8;
  a.recipe.recent = 32;
  a.recipe.page_size = 16;
  for (HeadArtifact& h : a.heads) h.value.extras.clear();
  return a;
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

TEST(RuntimeLimits, StepsBeyondTheMaximaAreRefusedBeforeTheCacheChanges) {
  const Artifact a = small_artifact();
  const EngineShape e{1, 4, 2, 32};
  RuntimeOptions o;
  o.max_pages = 64;
  o.max_sequences = 3;
  o.memory = PoolMemory::Host;
  o.max_batch = 2;
  o.max_context = 100;
  o.max_step_tokens = 40;
  Runtime rt(a, e, o);
  EXPECT_EQ(rt.max_batch(), 2);
  EXPECT_EQ(rt.max_context(), 100);
  EXPECT_EQ(rt.max_step_tokens(), 40);
  const int s0 = rt.cache().add_sequence(), s1 = rt.cache().add_sequence(), s2 = rt.cache().add_sequence();
  rt.begin_append({s0, s1}, {30, 10});  // within: 40 tokens, 2 sequences
  rt.begin_append({s0}, {40});
  rt.begin_append({s0}, {30});  // exactly max_context
  EXPECT_EQ(rt.cache().length(s0), 100);
  const uint64_t version = rt.cache().version();
  const int64_t pages = rt.cache().pages_in_use();
  auto refused = [&](const std::vector<int>& seqs, const std::vector<int>& counts, const std::string& limit) {
    try {
      rt.begin_append(seqs, counts);
      ADD_FAILURE() << "a step beyond " << limit << " was accepted";
    } catch (const Error& err) {
      EXPECT_TRUE(contains(err.what(), limit)) << err.what();
    }
    EXPECT_EQ(rt.cache().version(), version) << limit;
    EXPECT_EQ(rt.cache().pages_in_use(), pages) << limit;
  };
  refused({s0, s1, s2}, {1, 1, 1}, "max_batch 2");
  refused({s1, s2}, {30, 11}, "max_step_tokens 40");
  refused({s1, s0}, {1, 1}, "max_context 100");  // s0 would hold 101
  refused({s1}, {-1}, "negative token count");
  EXPECT_EQ(rt.cache().length(s0), 100);
  EXPECT_EQ(rt.cache().length(s1), 10);
}

TEST(RuntimeLimits, DefaultsAndBadOptions) {
  const Artifact a = small_artifact();
  const EngineShape e{1, 4, 2, 32};
  RuntimeOptions o;
  o.max_pages = 64;
  o.max_sequences = 3;
  o.memory = PoolMemory::Host;
  {
    Runtime rt(a, e, o);  // undeclared: no maxima, no refusals beyond the pool's
    EXPECT_EQ(rt.max_batch(), 0);
    EXPECT_EQ(rt.max_context(), 0);
    const int s = rt.cache().add_sequence();
    rt.begin_append({s}, {500});
    EXPECT_EQ(rt.cache().length(s), 500);
  }
  o.max_context = 64;
  {
    Runtime rt(a, e, o);  // max_batch: the pool's sequences; max_step_tokens: one per sequence
    EXPECT_EQ(rt.max_batch(), 3);
    EXPECT_EQ(rt.max_step_tokens(), 3);
  }
  auto bad = [&](RuntimeOptions x, const std::string& part) {
    try {
      Runtime rt(a, e, x);
      ADD_FAILURE() << "accepted: " << part;
    } catch (const Error& err) {
      EXPECT_TRUE(contains(err.what(), part)) << err.what();
    }
  };
  RuntimeOptions x = o;
  x.max_context = -1;
  bad(x, "must not be negative");
  x = o;
  x.max_batch = -2;
  bad(x, "must not be negative");
  x = o;
  x.max_context = 0;
  x.max_batch = 2;
  bad(x, "without max_context");
  x = o;
  x.max_batch = 4;
  bad(x, "above max_sequences 3");
  x = o;
  x.max_step_tokens = 3 * 64 + 1;
  bad(x, "max_step_tokens");
}

}  // namespace
}  // namespace kvcc
