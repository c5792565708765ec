// Token eviction with page compaction (KvCache::plan_compaction, runtime/compact_ref,
// Runtime::evict_tokens) on a host pool. The reference for a compacted sequence is a fresh one
// built by the append path from the kept tokens alone: its pages must be byte for byte the
// compacted ones (every kept row enters history from the same BF16 row, by the same codec), its
// windows too once the rows that left history are given as what they decode to, and so its
// decode and prefill outputs are bit for bit the same. Pages returned are counted exactly, and
// pages shared with a fork are never written.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "formats/artifact.h"
#include "formats/error.h"
#include "formats/fp16.h"
#include "formats/kv_layout.h"
#include "formats/model_config.h"
#include "runtime/append_ref.h"
#include "runtime/attention_ref.h"
#include "runtime/compact_ref.h"
#include "runtime/kv_cache.h"
#include "runtime/kvcc_runtime.h"
#include "cache_test_util.h"

namespace kvcc {
namespace {

KvGeometry small_geometry() {
  KvGeometry g;
  g.n_layers = 2;
  g.n_kv_heads = 2;
  g.head_dim = 16;
  g.group = 8;  // two (scale, zero) groups per row
  g.page_tokens = 16;
  g.sink = 8;
  g.recent = 32;
  return g;
}

std::vector<HeadCodec> make_codecs(const KvGeometry& g) {
  std::vector<HeadCodec> c(size_t(g.n_layers) * size_t(g.n_kv_heads));
  for (size_t i = 0; i < c.size(); ++i) {
    c[i].key.clip_ratio = 0.9f + 0.02f * float(i);
    c[i].value.clip_ratio = 0.95f;
    if (i % 2 == 1) {  // the level table too
      c[i].value.use_table = 1;
      const float lv[4] = {-1.5104f, -0.4528f, 0.4528f, 1.5104f};
      std::copy(lv, lv + 4, c[i].value.levels);
    }
  }
  return c;
}

// Unrotated K/V rows of a sequence, per layer [n, H, d]; rotations are the identity (null), so
// what a row decodes to can be appended again as itself.
struct Tokens {
  std::vector<std::vector<float>> k, v;
};

Tokens random_tokens(const KvGeometry& g, int64_t n, std::mt19937& rng) {
  std::normal_distribution<float> nd;
  Tokens t;
  const size_t per = size_t(n) * size_t(g.n_kv_heads) * size_t(g.head_dim);
  for (int l = 0; l < g.n_layers; ++l) {
    t.k.emplace_back(per);
    t.v.emplace_back(per);
    for (auto& x : t.k.back()) x = nd(rng);
    for (auto& x : t.v.back()) x = 3.0f * nd(rng) + 0.5f;
  }
  return t;
}

// Appends rows [from, from + count) of `t` to seq, every layer, identity rotations.
void append_rows(KvCache& c, int seq, const Tokens& t, int64_t from, int count, const std::vector<HeadCodec>& codecs) {
  const KvGeometry& g = c.geometry();
  const int64_t old = c.length(seq);
  c.grow(seq, count);
  const AppendBatch b = make_append_batch({seq}, {old}, {count});
  const size_t row = size_t(g.n_kv_heads) * size_t(g.head_dim);
  for (int l = 0; l < g.n_layers; ++l)
    append_ref(c, l, b, t.k[size_t(l)].data() + size_t(from) * row, t.v[size_t(l)].data() + size_t(from) * row, nullptr,
               nullptr, codecs.data() + size_t(l) * size_t(g.n_kv_heads));
}

void append_all(KvCache& c, int seq, const Tokens& t, const std::vector<HeadCodec>& codecs, int chunk) {
  const int64_t n = int64_t(t.k[0].size()) / (c.geometry().n_kv_heads * c.geometry().head_dim);
  for (int64_t at = 0; at < n; at += chunk) append_rows(c, seq, t, at, int(std::min<int64_t>(chunk, n - at)), codecs);
}

bool in_history(const KvGeometry& g, int64_t n, int64_t pos) {
  const KvTiers t = tiers_of(g, n);
  return pos >= t.sink_count && pos - t.sink_count < t.hist_tokens;
}

// What a fresh sequence must be given to hold the compacted rows: the original row where the
// kept token lands in history (it is quantised from the same BF16 row either way), what the
// original cache holds (decoded) where it lands in a window.
Tokens fresh_inputs(const KvCache& c, int seq, const Tokens& orig, const std::vector<int64_t>& kept,
                    const std::vector<HeadCodec>& codecs) {
  const KvGeometry& g = c.geometry();
  const size_t row = size_t(g.n_kv_heads) * size_t(g.head_dim);
  const int64_t m = int64_t(kept.size());
  Tokens out;
  for (int l = 0; l < g.n_layers; ++l) {
    std::vector<float> gk, gv;
    gather_sequence(c, l, seq, codecs.data() + size_t(l) * size_t(g.n_kv_heads), gk, gv);
    out.k.emplace_back(size_t(m) * row);
    out.v.emplace_back(size_t(m) * row);
    for (int64_t j = 0; j < m; ++j) {
      const bool hist = in_history(g, m, j);
      const float* sk = (hist ? orig.k[size_t(l)].data() : gk.data()) + size_t(kept[size_t(j)]) * row;
      const float* sv = (hist ? orig.v[size_t(l)].data() : gv.data()) + size_t(kept[size_t(j)]) * row;
      std::copy(sk, sk + row, out.k[size_t(l)].begin() + ptrdiff_t(size_t(j) * row));
      std::copy(sv, sv + row, out.v[size_t(l)].begin() + ptrdiff_t(size_t(j) * row));
    }
  }
  return out;
}

// Sequence sa of a and sb of b hold the same bytes: every history page (by table index, all
// layers and heads) and every window row in use.
void expect_same_storage(const KvCache& a, int sa, const KvCache& b, int sb) {
  const KvGeometry& g = a.geometry();
  ASSERT_EQ(a.length(sa), b.length(sb));
  const int64_t n = a.length(sa);
  const std::vector<int32_t>&pa = a.page_table(sa), &pb = b.page_table(sb);
  ASSERT_EQ(pa.size(), pb.size());
  ASSERT_EQ(int64_t(pa.size()), history_pages(g, n));
  for (size_t k = 0; k < pa.size(); ++k)
    ASSERT_EQ(std::memcmp(a.pages_base() + g.page_block_offset(pa[k], 0, 0),
                          b.pages_base() + g.page_block_offset(pb[k], 0, 0), g.page_bytes()),
              0)
        << "page " << k;
  const KvTiers t = tiers_of(g, n);
  const size_t d = size_t(g.head_dim);
  for (int l = 0; l < g.n_layers; ++l)
    for (int h = 0; h < g.n_kv_heads; ++h) {
      const uint16_t* wa = a.windows_base() + g.window_block_elem(sa, l, h);
      const uint16_t* wb = b.windows_base() + g.window_block_elem(sb, l, h);
      std::vector<size_t> rows;  // element offsets of the K rows in use (V follows the same rule)
      for (int r = 0; r < t.sink_count; ++r) {
        rows.push_back(g.k_sink_elem() + size_t(r) * d);
        rows.push_back(g.v_sink_elem() + size_t(r) * d);
      }
      for (int64_t i = t.hist_tokens; i < t.hist_tokens + t.ring_count; ++i) {
        rows.push_back(g.k_ring_elem() + size_t(ring_slot(g, i)) * d);
        rows.push_back(g.v_ring_elem() + size_t(ring_slot(g, i)) * d);
      }
      for (size_t off : rows)
        ASSERT_EQ(std::memcmp(wa + off, wb + off, d * 2), 0)
            << "layer " << l << " head " << h << " window elem " << off;
    }
}

// Decode (one query) and prefill (3 new tokens) of the two sequences agree bit for bit.
void expect_same_attention(const KvCache& a, int sa, const KvCache& b, int sb, const std::vector<HeadCodec>& codecs,
                           std::mt19937& rng) {
  const KvGeometry& g = a.geometry();
  const int n_heads = 2 * g.n_kv_heads, d = g.head_dim, T = 3;
  std::normal_distribution<float> nd;
  std::vector<float> q(size_t(T) * n_heads * d), k(size_t(T) * g.n_kv_heads * d), v(k.size());
  for (auto* x : {&q, &k, &v})
    for (auto& e : *x) e = nd(rng);
  const float scale = 1.0f / std::sqrt(float(d));
  for (int l = 0; l < g.n_layers; ++l) {
    const HeadCodec* c = codecs.data() + size_t(l) * size_t(g.n_kv_heads);
    std::vector<float> oa(size_t(n_heads) * d), ob(oa.size());
    decode_ref(a, l, {sa}, q.data(), n_heads, nullptr, nullptr, c, scale, oa.data());
    decode_ref(b, l, {sb}, q.data(), n_heads, nullptr, nullptr, c, scale, ob.data());
    ASSERT_EQ(std::memcmp(oa.data(), ob.data(), oa.size() * 4), 0) << "decode, layer " << l;
    std::vector<float> pa(q.size()), pb(q.size());
    prefill_ref(a, l, sa, T, q.data(), k.data(), v.data(), n_heads, nullptr, nullptr, c, scale, pa.data());
    prefill_ref(b, l, sb, T, q.data(), k.data(), v.data(), n_heads, nullptr, nullptr, c, scale, pb.data());
    ASSERT_EQ(std::memcmp(pa.data(), pb.data(), pa.size() * 4), 0) << "prefill, layer " << l;
  }
}

std::vector<int64_t> random_keep(int64_t n, int64_t m, std::mt19937& rng) {
  std::vector<int64_t> all(static_cast<size_t>(n));
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(size_t(m));
  std::sort(all.begin(), all.end());
  return all;
}

std::vector<int64_t> range(int64_t from, int64_t to) {
  std::vector<int64_t> r;
  for (int64_t i = from; i < to; ++i) r.push_back(i);
  return r;
}

// Every kind of kept set: each must equal the fresh sequence of its kept tokens, before and after
// more tokens are appended to both (rows that left history re-enter it from their BF16 values).
TEST(Compaction, EqualsAFreshSequenceOfTheKeptTokens) {
  const KvGeometry g = small_geometry();
  const auto codecs = make_codecs(g);
  std::mt19937 rng(19);
  const int64_t n = 8 + 32 + 16 * 12 + 5;  // 237: sink, 12 pages and a part, ring
  const Tokens orig = random_tokens(g, n, rng);
  std::vector<std::pair<std::string, std::vector<int64_t>>> cases = {
      {"all", range(0, n)},
      {"none", {}},
      {"prefix", range(0, 150)},
      {"one in the sink",
       [&] {
         auto r = range(0, n);
         r.erase(r.begin() + 3);
         return r;
       }()},
      {"one page",
       [&] {  // drops history page 4 whole: the later pages shift by one page and stay
         auto r = range(0, 8 + 64);
         auto s = range(8 + 80, n);
         r.insert(r.end(), s.begin(), s.end());
         return r;
       }()},
      {"ring only", range(0, n - 10)},
      {"fewer than the sink", {0, 5, 100, 236}},
      {"half at random", random_keep(n, n / 2, rng)},
      {"a tenth at random", random_keep(n, n / 10, rng)}};
  for (const auto& [name, kept] : cases) {
    SCOPED_TRACE(name);
    KvCache c(KvCacheConfig{g, 64, 2, PoolMemory::Host});
    const int s = c.add_sequence();
    append_all(c, s, orig, codecs, 37);
    const Tokens fresh_in = fresh_inputs(c, s, orig, kept, codecs);
    // Whole old pages that land on a new page boundary are kept as they are (counted by hand:
    // n has 13 pages; "prefix" keeps old pages 0-6, "one page" all but page 4, "ring only" 0-11).
    const std::map<std::string, int> whole_pages = {{"all", 13}, {"prefix", 7}, {"one page", 12}, {"ring only", 12}};
    if (whole_pages.count(name)) {
      const CompactionPlan plan = c.plan_compaction(s, kept);
      EXPECT_EQ(std::count(plan.reused.begin(), plan.reused.end(), 1), whole_pages.at(name));
      EXPECT_TRUE(plan.fresh_pages.empty());
      if (name == "all") {
        EXPECT_TRUE(plan.moves.empty());
      }
    }
    const int64_t pages_before = c.pages_in_use(), free_before = c.pages_free();
    const int64_t released = compact_ref(c, s, kept, codecs.data());
    const int64_t m = int64_t(kept.size());
    EXPECT_EQ(c.length(s), m);
    EXPECT_EQ(released, history_pages(g, n) - history_pages(g, m));
    EXPECT_EQ(c.pages_in_use(), pages_before - released);
    EXPECT_EQ(c.pages_free(), free_before + released);

    KvCache f(KvCacheConfig{g, 64, 2, PoolMemory::Host});
    const int fs = f.add_sequence();
    if (m > 0) append_all(f, fs, fresh_in, codecs, int(m));
    expect_same_storage(c, s, f, fs);
    expect_same_attention(c, s, f, fs, codecs, rng);
    // 60 more tokens: the ring flushes, rows that came out of history go back in.
    const Tokens more = random_tokens(g, 60, rng);
    append_all(c, s, more, codecs, 25);
    append_all(f, fs, more, codecs, 25);
    expect_same_storage(c, s, f, fs);
    expect_same_attention(c, s, f, fs, codecs, rng);
  }
}

// The goal, measured: 90% of the tokens of a 100-page sequence evicted at random
// positions (fixed seed) and the pages that held them counted back in the pool.
TEST(Compaction, NinetyPercentEvictedReturnsTheirPages) {
  const KvGeometry g = small_geometry();
  const auto codecs = make_codecs(g);
  std::mt19937 rng(1919);
  const int64_t n = 8 + 32 + 16 * 100;
  const Tokens orig = random_tokens(g, n, rng);
  KvCache c(KvCacheConfig{g, 128, 2, PoolMemory::Host});
  const int s = c.add_sequence();
  append_all(c, s, orig, codecs, 400);
  ASSERT_EQ(c.pages_in_use(), 100);
  const std::vector<int64_t> kept = random_keep(n, n / 10, rng);
  // Pages that held an evicted token.
  std::set<int32_t> touched;
  std::vector<char> keep(size_t(n), 0);
  for (int64_t p : kept) keep[size_t(p)] = 1;
  for (int64_t pos = 0; pos < n; ++pos)
    if (!keep[size_t(pos)] && in_history(g, n, pos))
      touched.insert(c.page_table(s)[size_t((pos - g.sink) / g.page_tokens)]);
  const int64_t free_before = c.pages_free();
  const int64_t released = compact_ref(c, s, kept, codecs.data());
  const double share = double(released) / double(touched.size());
  std::printf("evicted %lld of %lld tokens: %lld of the %zu pages that held them back in the pool (%.1f%%)\n",
              static_cast<long long>(n - int64_t(kept.size())), static_cast<long long>(n),
              static_cast<long long>(released), touched.size(), 100.0 * share);
  EXPECT_EQ(released, 100 - history_pages(g, int64_t(kept.size())));
  EXPECT_EQ(c.pages_free() - free_before, released);
  EXPECT_GE(share, 0.85);
}

// A fork shares the pages: compacting one side leaves the other's bytes and outputs as they
// were, writes no shared page (fresh pages instead), and refuses (changing nothing) when the
// fresh pages it would need are not free.
TEST(Compaction, ForksKeepTheirPagesAndOutOfPagesChangesNothing) {
  const KvGeometry g = small_geometry();
  const auto codecs = make_codecs(g);
  std::mt19937 rng(7);
  const int64_t n = 8 + 32 + 16 * 10 + 3;
  const Tokens orig = random_tokens(g, n, rng);
  const std::vector<int64_t> kept = random_keep(n, n / 2, rng);
  const int64_t new_pages = history_pages(g, int64_t(kept.size()));
  ASSERT_GT(new_pages, 0);
  {
    // The shared pages + new_pages - 1 free: one fresh page short.
    KvCache c(KvCacheConfig{g, history_pages(g, n) + new_pages - 1, 3, PoolMemory::Host});
    const int a = c.add_sequence();
    append_all(c, a, orig, codecs, 50);
    c.fork(a);
    const std::vector<uint8_t> before(c.pages_base(), c.pages_base() + c.pool_bytes());
    const uint64_t version = c.version();
    const std::vector<int32_t> table = c.page_table(a);
    EXPECT_THROW(compact_ref(c, a, kept, codecs.data()), CacheFull);
    EXPECT_EQ(c.version(), version);
    EXPECT_EQ(c.length(a), n);
    EXPECT_EQ(c.page_table(a), table);
    EXPECT_EQ(c.pages_free(), new_pages - 1);
    EXPECT_EQ(std::memcmp(before.data(), c.pages_base(), c.pool_bytes()), 0);
  }
  KvCache c(KvCacheConfig{g, 64, 3, PoolMemory::Host});
  const int a = c.add_sequence();
  append_all(c, a, orig, codecs, 50);
  const int b = c.fork(a);
  const std::vector<int32_t> shared = c.page_table(b);
  std::vector<uint8_t> shared_bytes;
  for (int32_t p : shared) {
    const uint8_t* at = c.pages_base() + g.page_block_offset(p, 0, 0);
    shared_bytes.insert(shared_bytes.end(), at, at + g.page_bytes());
  }
  KvCache twin(KvCacheConfig{g, 64, 1, PoolMemory::Host});  // b's contents, untouched
  const int t = twin.add_sequence();
  append_all(twin, t, orig, codecs, 50);
  const Tokens fresh_in = fresh_inputs(c, a, orig, kept, codecs);
  const int64_t in_use = c.pages_in_use();
  EXPECT_EQ(compact_ref(c, a, kept, codecs.data()), 0);  // every old page is still b's
  for (size_t i = 0; i < shared.size(); ++i)
    EXPECT_EQ(std::memcmp(c.pages_base() + g.page_block_offset(shared[i], 0, 0),
                          shared_bytes.data() + i * g.page_bytes(), g.page_bytes()),
              0)
        << "shared page " << shared[i] << " was written";
  for (int32_t p : c.page_table(a)) {
    const bool was_shared = std::find(shared.begin(), shared.end(), p) != shared.end();
    EXPECT_EQ(c.page_refcount(p), was_shared ? 2 : 1);
  }
  for (int32_t p : shared) {
    if (std::find(c.page_table(a).begin(), c.page_table(a).end(), p) == c.page_table(a).end()) {
      EXPECT_EQ(c.page_refcount(p), 1);
    }
  }
  EXPECT_EQ(c.pages_in_use(), in_use + new_pages);  // all a's pages fresh (no whole page kept in place)
  expect_same_storage(c, b, twin, t);
  expect_same_attention(c, b, twin, t, codecs, rng);
  KvCache f(KvCacheConfig{g, 64, 1, PoolMemory::Host});
  const int fs = f.add_sequence();
  append_all(f, fs, fresh_in, codecs, 1000);
  expect_same_storage(c, a, f, fs);
  expect_same_attention(c, a, f, fs, codecs, rng);
  // Freeing b returns exactly the old pages a no longer uses.
  c.free_sequence(b);
  EXPECT_EQ(c.pages_in_use(), new_pages);
}

// Bad kept lists are refused by name and change nothing.
TEST(Compaction, RefusesBadListsAndChangesNothing) {
  const KvGeometry g = small_geometry();
  const auto codecs = make_codecs(g);
  std::mt19937 rng(3);
  const int64_t n = 100;
  const Tokens orig = random_tokens(g, n, rng);
  KvCache c(KvCacheConfig{g, 16, 2, PoolMemory::Host});
  const int s = c.add_sequence();
  append_all(c, s, orig, codecs, 100);
  const std::vector<uint8_t> before(c.pages_base(), c.pages_base() + c.pool_bytes());
  const uint64_t version = c.version();
  struct Case {
    std::vector<int64_t> kept;
    const char* says;
  } cases[] = {
      {{0, 5, 5}, "strictly increasing"}, {{4, 2}, "strictly increasing"}, {{-1, 3}, "outside"}, {{0, 100}, "outside"}};
  for (const Case& bad : cases) {
    try {
      compact_ref(c, s, bad.kept, codecs.data());
      ADD_FAILURE() << "accepted a bad list";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(bad.says), std::string::npos) << e.what();
    }
  }
  EXPECT_THROW(compact_ref(c, 1, {0}, codecs.data()), Error);  // no such sequence
  EXPECT_EQ(c.version(), version);
  EXPECT_EQ(c.length(s), n);
  EXPECT_EQ(std::memcmp(before.data(), c.pages_base(), c.pool_bytes()), 0);
  // A plan is refused once the cache has changed.
  const CompactionPlan plan = c.plan_compaction(s, {1, 2, 3});
  c.add_sequence();
  EXPECT_THROW(c.commit_compaction(plan), Error);
  EXPECT_EQ(c.length(s), n);
}

// Through the Runtime, with the artifact's rotations: the pages of a compacted sequence are those
// of a fresh Runtime given the kept tokens' rows, its window rows are what the original cache
// held for those tokens (rounded to BF16), and with no row leaving history (a few ring tokens
// evicted) decode is bit for bit the fresh Runtime's.
constexpr int kLayers = 2, kHeads = 4, kKv = 2, kD = 32;

Artifact make_artifact() { return testing::small_runtime_artifact(kLayers, kHeads, kKv, kD); }

std::unique_ptr<Runtime> host_runtime(const Artifact& art) {
  RuntimeOptions o;
  o.max_pages = 64;
  o.max_sequences = 2;
  o.memory = PoolMemory::Host;
  return std::make_unique<Runtime>(art, EngineShape{kLayers, kHeads, kKv, kD}, o);
}

// Appends rows `idx` of t (all of them when empty) to seq in chunks.
void runtime_append(Runtime& rt, int seq, const Tokens& t, const std::vector<int64_t>& idx, int chunk) {
  const size_t row = size_t(kKv) * kD;
  for (size_t at = 0; at < idx.size(); at += size_t(chunk)) {
    const size_t cnt = std::min(idx.size() - at, size_t(chunk));
    rt.begin_append({seq}, {int(cnt)});
    for (int l = 0; l < kLayers; ++l) {
      std::vector<float> k(cnt * row), v(cnt * row);
      for (size_t i = 0; i < cnt; ++i) {
        std::copy_n(t.k[size_t(l)].begin() + ptrdiff_t(size_t(idx[at + i]) * row), row, k.begin() + ptrdiff_t(i * row));
        std::copy_n(t.v[size_t(l)].begin() + ptrdiff_t(size_t(idx[at + i]) * row), row, v.begin() + ptrdiff_t(i * row));
      }
      rt.append(l, k.data(), v.data());
    }
  }
}

TEST(Compaction, RuntimeEvictsWithRotations) {
  const Artifact art = make_artifact();
  auto rt = host_runtime(art);
  const KvGeometry& g = rt->geometry();
  std::mt19937 rng(11);
  const int64_t n = 8 + 32 + 16 * 6 - 1;  // one more token fills the ring (32 tokens)
  const Tokens orig = random_tokens(g, n, rng);
  for (const bool few_ring_tokens : {true, false}) {
    SCOPED_TRACE(few_ring_tokens ? "a few ring tokens" : "half at random");
    const int s = rt->cache().add_sequence();
    runtime_append(*rt, s, orig, range(0, n), 50);
    std::vector<int64_t> kept = range(0, n);
    if (few_ring_tokens) {
      for (int64_t pos : {n - 1, n - 7, n - 20}) kept.erase(std::find(kept.begin(), kept.end(), pos));
    } else {
      kept = random_keep(n, n / 2, rng);
    }
    const int64_t m = int64_t(kept.size());
    std::vector<std::vector<float>> before_k(kLayers), before_v(kLayers);
    for (int l = 0; l < kLayers; ++l)
      gather_sequence(rt->cache(), l, s, rt->codecs(l), before_k[size_t(l)], before_v[size_t(l)]);
    // Inside an open step eviction is refused.
    rt->begin_append({s}, {1});
    EXPECT_THROW(rt->evict_tokens(s, kept), Error);
    for (int l = 0; l < kLayers; ++l) {
      std::vector<float> one(size_t(kKv) * kD, 0.5f);
      rt->append(l, one.data(), one.data());
    }
    ASSERT_EQ(rt->cache().length(s), n + 1);
    kept.push_back(n);  // the token just appended stays too
    before_k.clear();
    before_v.clear();
    before_k.resize(kLayers);
    before_v.resize(kLayers);
    for (int l = 0; l < kLayers; ++l)
      gather_sequence(rt->cache(), l, s, rt->codecs(l), before_k[size_t(l)], before_v[size_t(l)]);
    Tokens ext = orig;  // the original rows and the appended one
    for (int l = 0; l < kLayers; ++l) {
      ext.k[size_t(l)].insert(ext.k[size_t(l)].end(), size_t(kKv) * kD, 0.5f);
      ext.v[size_t(l)].insert(ext.v[size_t(l)].end(), size_t(kKv) * kD, 0.5f);
    }
    const int64_t released = rt->evict_tokens(s, kept);
    EXPECT_EQ(released, history_pages(g, n + 1) - history_pages(g, m + 1));
    auto fresh = host_runtime(art);
    const int fs = fresh->cache().add_sequence();
    runtime_append(*fresh, fs, ext, kept, 40);
    // Pages: byte for byte the fresh ones.
    const KvCache &c = rt->cache(), &f = fresh->cache();
    ASSERT_EQ(c.page_table(s).size(), f.page_table(fs).size());
    for (size_t k = 0; k < c.page_table(s).size(); ++k)
      ASSERT_EQ(std::memcmp(c.pages_base() + g.page_block_offset(c.page_table(s)[k], 0, 0),
                            f.pages_base() + g.page_block_offset(f.page_table(fs)[k], 0, 0), g.page_bytes()),
                0)
          << "page " << k;
    // Windows: what the original held, to BF16.
    const KvTiers t = tiers_of(g, m + 1);
    for (int l = 0; l < kLayers; ++l)
      for (int h = 0; h < kKv; ++h) {
        const uint16_t* w = c.windows_base() + g.window_block_elem(s, l, h);
        for (int64_t j = 0; j <= m; ++j) {
          if (in_history(g, m + 1, j)) continue;
          const bool sink = j < t.sink_count;
          const size_t row = sink ? size_t(j) : size_t(ring_slot(g, j - t.sink_count));
          const size_t ko = (sink ? g.k_sink_elem() : g.k_ring_elem()) + row * kD;
          const size_t vo = (sink ? g.v_sink_elem() : g.v_ring_elem()) + row * kD;
          const size_t src = (size_t(kept[size_t(j)]) * kKv + size_t(h)) * kD;
          for (int e = 0; e < kD; ++e) {
            ASSERT_EQ(w[ko + size_t(e)], bf16_from_float(before_k[size_t(l)][src + size_t(e)])) << "token " << j;
            ASSERT_EQ(w[vo + size_t(e)], bf16_from_float(before_v[size_t(l)][src + size_t(e)])) << "token " << j;
          }
        }
      }
    if (few_ring_tokens) {
      EXPECT_EQ(released, 0);
      std::normal_distribution<float> nd;
      std::vector<float> q(size_t(kHeads) * kD), oa(q.size()), ob(q.size());
      for (auto& x : q) x = nd(rng);
      for (int l = 0; l < kLayers; ++l) {
        rt->decode(l, {s}, q.data(), oa.data());
        fresh->decode(l, {fs}, q.data(), ob.data());
        ASSERT_EQ(std::memcmp(oa.data(), ob.data(), oa.size() * 4), 0) << "layer " << l;
      }
    }
    rt->cache().free_sequence(s);
  }
  EXPECT_EQ(rt->cache().pages_in_use(), 0);
}

}  // namespace
}  // namespace kvcc
