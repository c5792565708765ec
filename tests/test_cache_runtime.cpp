// The runtime API (C++ and C ABI) on a host pool: an artifact written to disk is loaded, checked
// against the engine's shape (each mismatch refused by name), and its rotations and clip ratios
// drive append/decode exactly as the reference kernels given the same parameters directly.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "formats/artifact.h"
#include "formats/error.h"
#include "formats/model_config.h"
#include "runtime/append_ref.h"
#include "runtime/attention_ref.h"
#include "runtime/kv_cache.h"
#include "runtime/kvcc_c.h"
#include "runtime/kvcc_runtime.h"
#include "cache_test_util.h"

namespace kvcc {
namespace {

constexpr int kLayers = 2, kHeads = 4, kKv = 2, kD = 32;

Artifact make_artifact(int d = kD) { return testing::small_runtime_artifact(kLayers, kHeads, kKv, d); }

std::string artifact_path() {
  static const std::string path = [] {
    const std::string p = ::testing::TempDir() + "kvcc_runtime_test.kvcc.h5";
    write_artifact(make_artifact(), p);
    return p;
  }();
  return path;
}

RuntimeOptions host_options() {
  RuntimeOptions o;
  o.max_pages = 32;
  o.max_sequences = 4;
  o.memory = PoolMemory::Host;
  return o;
}

// The test artifact loaded as a Runtime and, beside it, a plain host cache driven by the
// reference kernels with the artifact's parameters converted here (rotations [layers * n_kv, d, d],
// codecs [layers * n_kv]); sequences a and b added to both.
class RuntimeAndReference : public ::testing::Test {
 protected:
  std::unique_ptr<Runtime> rt = Runtime::load(artifact_path(), EngineShape{kLayers, kHeads, kKv, kD}, host_options());
  KvCache ref{KvCacheConfig{rt->geometry(), 32, 4, PoolMemory::Host}};
  std::vector<float> rk, rv;
  std::vector<HeadCodec> codecs;
  int a = -1, b = -1;
  RuntimeAndReference() {
    const Artifact art = make_artifact();
    rk.assign(size_t(kLayers) * kKv * kD * kD, 0.0f);
    rv.assign(rk.size(), 0.0f);
    codecs.assign(size_t(kLayers) * kKv, HeadCodec{});
    for (size_t i = 0; i < art.heads.size(); ++i) {
      for (size_t e = 0; e < size_t(kD) * kD; ++e) {
        rk[i * kD * kD + e] = float(art.heads[i].key.rotation[e]);
        rv[i * kD * kD + e] = float(art.heads[i].value.rotation[e]);
      }
      codecs[i].key.clip_ratio = float(art.heads[i].key.clip_ratio);
      codecs[i].value.clip_ratio = float(art.heads[i].value.clip_ratio);
    }
    a = rt->cache().add_sequence();
    b = rt->cache().add_sequence();
    ref.add_sequence();
    ref.add_sequence();
  }
};

TEST(CacheRuntime, RefusesMismatchedShapesByName) {
  const std::string path = artifact_path();
  struct Case {
    EngineShape shape;
    const char* field;
  } cases[] = {{{3, kHeads, kKv, kD}, "layer count"},
               {{kLayers, 8, kKv, kD}, "query heads"},
               {{kLayers, kHeads, 4, kD}, "KV heads"},
               {{kLayers, kHeads, kKv, 64}, "head_dim"}};
  for (const Case& c : cases) {
    try {
      Runtime::load(path, c.shape, host_options());
      ADD_FAILURE() << "accepted a mismatched " << c.field;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(c.field), std::string::npos) << e.what();
    }
  }
  Artifact kvarn = make_artifact();
  kvarn.recipe.method = "kvarn";
  EXPECT_THROW(Runtime(kvarn, EngineShape{kLayers, kHeads, kKv, kD}, host_options()), Error);
}

// The device pool's scope is checked when the Runtime is made (before any device memory), and
// every rule names its field; the in-scope geometry passes.
TEST(CacheRuntime, DeviceScopeNamesWhatIsOutside) {
  KvGeometry g;
  g.n_layers = 2;
  g.n_kv_heads = 8;
  g.head_dim = g.group = 128;
  g.page_tokens = 64;
  g.sink = 4;  // any windows: decode checks its multiples of 16 itself
  g.recent = 96;
  EXPECT_EQ(device_scope_problem(g), "");
  struct Case {
    void (*edit)(KvGeometry&);
    const char* what;
  } cases[] = {{[](KvGeometry& x) { x.head_dim = x.group = 64; }, "head_dim 64"},
               {[](KvGeometry& x) { x.group = 32; }, "group 32"},
               {[](KvGeometry& x) { x.page_tokens = 32; }, "page size 32"},
               {[](KvGeometry& x) { x.n_kv_heads = 72; }, "72 KV heads"}};
  for (const Case& c : cases) {
    KvGeometry x = g;
    c.edit(x);
    EXPECT_NE(device_scope_problem(x).find(c.what), std::string::npos) << device_scope_problem(x);
  }
  RuntimeOptions device = host_options();
  device.memory = PoolMemory::Device;
  try {
    Runtime(make_artifact(), EngineShape{kLayers, kHeads, kKv, kD}, device);
    ADD_FAILURE() << "a device pool accepted head_dim " << kD;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("head_dim 32"), std::string::npos) << e.what();
  }
}

TEST_F(RuntimeAndReference, UsesTheArtifactsRotationsAndClipRatios) {
  EXPECT_EQ(rt->geometry().sink, 8);
  EXPECT_EQ(rt->geometry().recent, 32);
  EXPECT_EQ(rt->geometry().page_tokens, 16);
  EXPECT_EQ(rt->geometry().group, kD);
  // The same appends into the reference cache.
  std::mt19937 rng(7);
  std::normal_distribution<float> nd;
  for (const auto& counts : std::vector<std::vector<int>>{{20, 70}, {45, 1}, {1, 1}}) {
    std::vector<int64_t> old = {ref.length(a), ref.length(b)};
    rt->begin_append({a, b}, counts);
    ref.grow_batch({a, b}, {counts[0], counts[1]});
    const AppendBatch batch = make_append_batch({a, b}, old, counts);
    for (int l = 0; l < kLayers; ++l) {
      std::vector<float> k(size_t(counts[0] + counts[1]) * kKv * kD), v(k.size());
      for (auto& x : k) x = nd(rng);
      for (auto& x : v) x = nd(rng);
      rt->append(l, k.data(), v.data());
      const size_t off = size_t(l) * kKv * kD * kD;
      append_ref(ref, l, batch, k.data(), v.data(), rk.data() + off, rv.data() + off, codecs.data() + size_t(l) * kKv);
    }
  }
  ASSERT_EQ(std::memcmp(rt->cache().pages_base(), ref.pages_base(), ref.pool_bytes()), 0);
  std::vector<float> q(size_t(2) * kHeads * kD), got(q.size()), want(q.size());
  for (auto& x : q) x = nd(rng);
  for (int l = 0; l < kLayers; ++l) {
    rt->decode(l, {a, b}, q.data(), got.data());
    const size_t off = size_t(l) * kKv * kD * kD;
    decode_ref(ref, l, {a, b}, q.data(), kHeads, rk.data() + off, rv.data() + off, codecs.data() + size_t(l) * kKv,
               1.0f / std::sqrt(float(kD)), want.data());
    for (size_t i = 0; i < q.size(); ++i) EXPECT_EQ(got[i], want[i]) << "layer " << l << " element " << i;
  }
}

// A host pool serves any head_dim its layout holds: 8 (llama2.c's stories260K: `kvcc demo`'s
// model; the layout needs a multiple of 4), 64 and 256 (models outside the GPU kernels' 128): the
// Runtime's pages are byte for byte the reference kernels' and its decode and prefill are theirs
// (tests/test_cache.cpp checks those against float64 at these head_dims). A device pool refuses
// them by name before any device memory.
void check_host_pool_serves(int d) {
  SCOPED_TRACE("head_dim " + std::to_string(d));
  const Artifact art = make_artifact(d);
  Runtime rt(art, EngineShape{kLayers, kHeads, kKv, d}, host_options());
  ASSERT_EQ(rt.geometry().head_dim, d);
  ASSERT_EQ(rt.geometry().code_row_bytes(), size_t(d / 4));
  KvCache ref{KvCacheConfig{rt.geometry(), 32, 4, PoolMemory::Host}};
  std::vector<float> rk(size_t(kLayers) * kKv * d * d), rv(rk.size());
  std::vector<HeadCodec> codecs(size_t(kLayers) * kKv);
  for (size_t i = 0; i < art.heads.size(); ++i) {
    for (size_t e = 0; e < size_t(d) * d; ++e) {
      rk[i * d * d + e] = float(art.heads[i].key.rotation[e]);
      rv[i * d * d + e] = float(art.heads[i].value.rotation[e]);
    }
    codecs[i].key.clip_ratio = float(art.heads[i].key.clip_ratio);
    codecs[i].value.clip_ratio = float(art.heads[i].value.clip_ratio);
  }
  const int a = rt.cache().add_sequence(), b = rt.cache().add_sequence();
  ref.add_sequence();
  ref.add_sequence();
  std::mt19937 rng(8);
  std::normal_distribution<float> nd;
  const float scale = 1.0f / std::sqrt(float(d));
  for (const auto& counts : std::vector<std::vector<int>>{{30, 90}, {57, 1}, {1, 40}}) {
    // Prefill of the step's tokens over the cache before them, then their append.
    const int rows = counts[0] + counts[1];
    std::vector<float> q(size_t(rows) * kHeads * d), got(q.size()), want(q.size());
    for (auto& x : q) x = nd(rng);
    std::vector<std::vector<float>> ks, vs;
    for (int l = 0; l < kLayers; ++l) {
      ks.emplace_back(size_t(rows) * kKv * d);
      vs.emplace_back(ks.back().size());
      for (auto& x : ks.back()) x = 2.0f * nd(rng);
      for (auto& x : vs.back()) x = nd(rng);
    }
    const std::vector<int64_t> old = {ref.length(a), ref.length(b)};
    for (int l = 0; l < kLayers; ++l) {
      const size_t off = size_t(l) * kKv * d * d;
      size_t qo = 0, ko = 0;
      for (int i = 0; i < 2; ++i) {
        rt.prefill(l, i ? b : a, counts[size_t(i)], q.data() + qo, ks[size_t(l)].data() + ko, vs[size_t(l)].data() + ko,
                   got.data() + qo);
        prefill_ref(ref, l, i ? b : a, counts[size_t(i)], q.data() + qo, ks[size_t(l)].data() + ko,
                    vs[size_t(l)].data() + ko, kHeads, rk.data() + off, rv.data() + off,
                    codecs.data() + size_t(l) * kKv, scale, want.data() + qo);
        qo += size_t(counts[size_t(i)]) * kHeads * d;
        ko += size_t(counts[size_t(i)]) * kKv * d;
      }
      for (size_t i = 0; i < q.size(); ++i) ASSERT_EQ(got[i], want[i]) << "prefill layer " << l << " element " << i;
    }
    rt.begin_append({a, b}, counts);
    ref.grow_batch({a, b}, {counts[0], counts[1]});
    const AppendBatch batch = make_append_batch({a, b}, old, counts);
    for (int l = 0; l < kLayers; ++l) {
      rt.append(l, ks[size_t(l)].data(), vs[size_t(l)].data());
      const size_t off = size_t(l) * kKv * d * d;
      append_ref(ref, l, batch, ks[size_t(l)].data(), vs[size_t(l)].data(), rk.data() + off, rv.data() + off,
                 codecs.data() + size_t(l) * kKv);
    }
  }
  ASSERT_GT(history_pages(rt.geometry(), rt.cache().length(b)), 2);
  ASSERT_EQ(std::memcmp(rt.cache().pages_base(), ref.pages_base(), ref.pool_bytes()), 0);
  std::vector<float> q(size_t(2) * kHeads * d), got(q.size()), want(q.size());
  for (auto& x : q) x = nd(rng);
  for (int l = 0; l < kLayers; ++l) {
    rt.decode(l, {a, b}, q.data(), got.data());
    const size_t off = size_t(l) * kKv * d * d;
    decode_ref(ref, l, {a, b}, q.data(), kHeads, rk.data() + off, rv.data() + off, codecs.data() + size_t(l) * kKv,
               scale, want.data());
    for (size_t i = 0; i < q.size(); ++i) EXPECT_EQ(got[i], want[i]) << "layer " << l << " element " << i;
  }
  RuntimeOptions device = host_options();
  device.memory = PoolMemory::Device;
  try {
    Runtime(art, EngineShape{kLayers, kHeads, kKv, d}, device);
    ADD_FAILURE() << "a device pool accepted head_dim " << d;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("head_dim " + std::to_string(d)), std::string::npos) << e.what();
  }
}

TEST(CacheRuntime, HostPoolServesHeadDim8) { check_host_pool_serves(8); }
TEST(CacheRuntime, HostPoolServesHeadDims64And256) {
  check_host_pool_serves(64);
  check_host_pool_serves(256);
}

// The cache's own head_dim rule, by pool: a host pool takes any multiple of 4 (4 codes a byte), a
// device pool a multiple of 16 (checked before any device memory, so also without CUDA).
TEST(CacheRuntime, HeadDimRuleByPool) {
  KvGeometry g;
  g.n_layers = 1;
  g.n_kv_heads = 2;
  g.page_tokens = 16;
  g.sink = 4;
  g.recent = 32;
  auto problem = [&](int d, PoolMemory memory) -> std::string {
    KvGeometry x = g;
    x.head_dim = x.group = d;
    try {
      KvCache cache(KvCacheConfig{x, 2, 1, memory});
      return "";
    } catch (const Error& e) {
      return e.what();
    }
  };
  for (int d : {4, 8, 12, 16, 32}) EXPECT_EQ(problem(d, PoolMemory::Host), "") << d;
  for (int d : {2, 6, 10})
    EXPECT_NE(problem(d, PoolMemory::Host).find("multiple of 4 for a host pool"), std::string::npos);
  for (int d : {4, 8, 24})
    EXPECT_NE(problem(d, PoolMemory::Device).find("multiple of 16 for a device pool"), std::string::npos);
}

// Prefill on a host pool is prefill_ref over the cache as it was before the step's tokens, whether
// called before begin_append or inside the step (before that layer's append); misuse is refused.
TEST_F(RuntimeAndReference, PrefillReadsTheCacheBeforeTheStep) {
  std::mt19937 rng(11);
  std::normal_distribution<float> nd;
  const float scale = 1.0f / std::sqrt(float(kD));
  // Steps: from empty; history appears (sink 8 + ring 32 + pages of 16); one token each.
  const std::vector<std::vector<int>> steps = {{20, 70}, {45, 1}, {1, 30}};
  for (size_t step = 0; step < steps.size(); ++step) {
    const std::vector<int>& counts = steps[step];
    const bool inside = step != 1;  // step 1 calls prefill before begin_append
    const std::vector<int64_t> old = {ref.length(a), ref.length(b)};
    if (inside) rt->begin_append({a, b}, counts);
    std::vector<std::vector<float>> ks(kLayers), vs(kLayers);
    for (int l = 0; l < kLayers; ++l) {
      const int rows = counts[0] + counts[1];
      ks[l].resize(size_t(rows) * kKv * kD);
      vs[l].resize(ks[l].size());
      for (auto& x : ks[l]) x = nd(rng);
      for (auto& x : vs[l]) x = nd(rng);
      std::vector<float> q(size_t(rows) * kHeads * kD);
      for (auto& x : q) x = nd(rng);
      std::vector<float> got(q.size(), NAN), want(q.size(), NAN);
      const size_t off = size_t(l) * kKv * kD * kD;
      size_t qo = 0, ko = 0;
      for (int i = 0; i < 2; ++i) {
        const int seq = i ? b : a, T = counts[size_t(i)];
        rt->prefill(l, seq, T, q.data() + qo, ks[l].data() + ko, vs[l].data() + ko, got.data() + qo);
        prefill_ref(ref, l, seq, T, q.data() + qo, ks[l].data() + ko, vs[l].data() + ko, kHeads, rk.data() + off,
                    rv.data() + off, codecs.data() + size_t(l) * kKv, scale, want.data() + qo);
        qo += size_t(T) * kHeads * kD;
        ko += size_t(T) * kKv * kD;
      }
      for (size_t i = 0; i < q.size(); ++i) ASSERT_EQ(got[i], want[i]) << "step " << step << " layer " << l << " " << i;
      if (inside) {
        rt->append(l, ks[l].data(), vs[l].data());
        // This layer's step is in the cache now: prefill of it would attend to the tokens twice
        // (after the last layer the step is complete and prefill starts the next one).
        if (l + 1 < kLayers) {
          EXPECT_THROW(rt->prefill(l, a, counts[0], q.data(), ks[l].data(), vs[l].data(), got.data()), Error);
        }
      }
    }
    if (!inside) {
      rt->begin_append({a, b}, counts);
      EXPECT_THROW(rt->prefill(0, a, counts[0] + 1, nullptr, nullptr, nullptr, nullptr),
                   Error);  // not the step's count
      for (int l = 0; l < kLayers; ++l) rt->append(l, ks[l].data(), vs[l].data());
    }
    ref.grow_batch({a, b}, {counts[0], counts[1]});
    const AppendBatch batch = make_append_batch({a, b}, old, counts);
    for (int l = 0; l < kLayers; ++l)
      append_ref(ref, l, batch, ks[l].data(), vs[l].data(), rk.data() + size_t(l) * kKv * kD * kD,
                 rv.data() + size_t(l) * kKv * kD * kD, codecs.data() + size_t(l) * kKv);
    ASSERT_EQ(std::memcmp(rt->cache().pages_base(), ref.pages_base(), ref.pool_bytes()), 0) << "step " << step;
  }
  std::vector<float> q(size_t(kHeads) * kD, 0.1f), k(size_t(kKv) * kD, 0.2f), out(q.size());
  EXPECT_THROW(rt->prefill(kLayers, a, 1, q.data(), k.data(), k.data(), out.data()), Error);
  // Every layer has appended: the step is over, and so it stays after a refused begin_append
  // (nothing changes in the pool either way).
  const std::vector<uint8_t> pool(rt->cache().pages_base(), rt->cache().pages_base() + ref.pool_bytes());
  std::vector<float> kk(size_t(kKv) * kD * 64, 0.3f);
  EXPECT_THROW(rt->append(0, kk.data(), kk.data()), Error);
  EXPECT_THROW(rt->begin_append({a, b}, {1, -1}), Error);
  EXPECT_THROW(rt->append(0, kk.data(), kk.data()), Error);
  EXPECT_EQ(std::memcmp(rt->cache().pages_base(), pool.data(), pool.size()), 0);
  // The C ABI over the same call.
  kvcc_runtime* c = nullptr;
  ASSERT_EQ(kvcc_runtime_load(artifact_path().c_str(), kLayers, kHeads, kKv, kD, 4, 2, 0, &c), KVCC_OK);
  int s = -1;
  ASSERT_EQ(kvcc_add_sequence(c, &s), KVCC_OK);
  out.assign(out.size(), NAN);
  const int one = 1;
  ASSERT_EQ(kvcc_prefill(c, 0, 1, &s, &one, q.data(), k.data(), k.data(), out.data(), nullptr), KVCC_OK)
      << kvcc_last_error();
  // One token over an empty cache attends to itself alone: the output is its value.
  for (int hh = 0; hh < kHeads; ++hh)
    for (int ch = 0; ch < kD; ++ch) EXPECT_NEAR(out[size_t(hh) * kD + ch], 0.2f, 3e-3f);
  EXPECT_EQ(kvcc_prefill(c, 0, 1, &s, &one, nullptr, k.data(), k.data(), out.data(), nullptr), KVCC_BAD_ARGUMENT);
  EXPECT_EQ(kvcc_prefill(c, 0, 1, &s, nullptr, q.data(), k.data(), k.data(), out.data(), nullptr), KVCC_BAD_ARGUMENT);
  EXPECT_EQ(kvcc_prefill(c, 0, -1, &s, &one, q.data(), k.data(), k.data(), out.data(), nullptr), KVCC_BAD_ARGUMENT);
  EXPECT_NE(std::string(kvcc_last_error()).find("negative"), std::string::npos) << kvcc_last_error();
  EXPECT_EQ(kvcc_prefill(c, 9, 1, &s, &one, q.data(), k.data(), k.data(), out.data(), nullptr), KVCC_ERROR);
  EXPECT_NE(std::string(kvcc_last_error()).find("layer"), std::string::npos) << kvcc_last_error();
  const int twice[2] = {s, s}, ones[2] = {1, 1};
  EXPECT_EQ(kvcc_prefill(c, 0, 2, twice, ones, q.data(), k.data(), k.data(), out.data(), nullptr), KVCC_ERROR);
  kvcc_runtime_free(c);
}

TEST(CacheRuntime, CAbiStatusCodesAndErrors) {
  kvcc_runtime* rt = nullptr;
  EXPECT_EQ(kvcc_runtime_load(artifact_path().c_str(), kLayers, kHeads, 4, kD, 4, 2, 0, &rt), KVCC_ERROR);
  EXPECT_NE(std::string(kvcc_last_error()).find("KV heads"), std::string::npos) << kvcc_last_error();
  EXPECT_EQ(kvcc_runtime_load("/nonexistent/x.kvcc.h5", kLayers, kHeads, kKv, kD, 4, 2, 0, &rt), KVCC_ERROR);
  EXPECT_NE(std::string(kvcc_last_error()).find("/nonexistent/x.kvcc.h5"), std::string::npos) << kvcc_last_error();
  // 4 pages, 2 sequences.
  ASSERT_EQ(kvcc_runtime_load(artifact_path().c_str(), kLayers, kHeads, kKv, kD, 4, 2, 0, &rt), KVCC_OK)
      << kvcc_last_error();
  int s = -1, t = -1, u = -1;
  ASSERT_EQ(kvcc_add_sequence(rt, &s), KVCC_OK);
  const int count = 8 + 32 + 16;  // sink + ring + one page: one page of history
  ASSERT_EQ(kvcc_begin_append(rt, 1, &s, &count), KVCC_OK);
  std::vector<float> k(size_t(count) * kKv * kD, 0.5f), v(k.size(), -0.25f);
  for (size_t i = 0; i < k.size(); ++i) k[i] += 0.001f * float(i % 97);
  for (int l = 0; l < kLayers; ++l) ASSERT_EQ(kvcc_append(rt, l, k.data(), v.data(), nullptr), KVCC_OK);
  int64_t len = 0, bytes = 0;
  ASSERT_EQ(kvcc_sequence_length(rt, s, &len), KVCC_OK);
  EXPECT_EQ(len, count);
  ASSERT_EQ(kvcc_fork_sequence(rt, s, &t, nullptr), KVCC_OK);
  EXPECT_EQ(kvcc_add_sequence(rt, &u), KVCC_CACHE_FULL);  // both slots taken
  const int big = 4 * 16 + 1;
  EXPECT_EQ(kvcc_begin_append(rt, 1, &t, &big), KVCC_CACHE_FULL);  // needs 5 pages, 3 free
  ASSERT_EQ(kvcc_bytes_in_use(rt, &bytes), KVCC_OK);
  KvGeometry g;
  g.n_layers = kLayers;
  g.n_kv_heads = kKv;
  g.head_dim = kD;
  g.group = kD;
  g.page_tokens = 16;
  g.sink = 8;
  g.recent = 32;
  EXPECT_EQ(size_t(bytes), g.page_bytes() + 2 * g.window_slot_bytes());
  std::vector<float> q(size_t(kHeads) * kD, 0.3f), out(q.size(), NAN);
  ASSERT_EQ(kvcc_decode(rt, 1, 1, &t, q.data(), out.data(), nullptr), KVCC_OK);
  for (float x : out) EXPECT_TRUE(std::isfinite(x));
  EXPECT_EQ(kvcc_decode(rt, 5, 1, &t, q.data(), out.data(), nullptr), KVCC_ERROR);
  EXPECT_EQ(kvcc_decode(rt, 0, 1, &t, nullptr, out.data(), nullptr), KVCC_BAD_ARGUMENT);
  EXPECT_EQ(kvcc_free_sequence(rt, s), KVCC_OK);
  EXPECT_EQ(kvcc_free_sequence(rt, s), KVCC_ERROR);
  kvcc_runtime_free(rt);
}

// A kivi artifact (per-channel key pages) written to disk and loaded: the Runtime's geometry and
// codecs are kivi's semantics (keys per channel over min(group, page) tokens and never clipped;
// mixed values with their stored clip ratio, plain kivi values per token over min(group, d)
// channels, unclipped), and its append, prefill and decode are the reference kernels' given those
// parameters directly, bit for bit. The device pool, token eviction and a group that does not tile
// the page are refused by name; the C ABI describes the layout.
TEST(CacheRuntime, KiviArtifactsOnTheHostPool) {
  for (const bool mixed : {true, false}) {
    Artifact art = make_artifact();
    art.recipe.method = "kivi";
    art.recipe.group = 8;  // two key groups per 16-token page; plain values in groups of 8 channels
    if (mixed) art.recipe.params["values"] = "hadamard";
    if (mixed) art.recipe.params["key_params"] = "e5m3";       // 2-byte key pairs; plain kivi: fp16
    for (HeadArtifact& h : art.heads) h.key.rotation.clear();  // kivi keys: no rotation
    const std::string path = ::testing::TempDir() + "kvcc_runtime_kivi.kvcc.h5";
    write_artifact(art, path);
    auto rt = Runtime::load(path, EngineShape{kLayers, kHeads, kKv, kD}, host_options());
    KvGeometry g = rt->geometry();
    EXPECT_EQ(g.key_group_tokens, 8);
    EXPECT_EQ(g.group, mixed ? kD : 8);
    EXPECT_EQ(g.key_pair_bytes, mixed ? 2 : 4);
    EXPECT_EQ(g.k_params_bytes(), size_t(2 * kD * (mixed ? 2 : 4)));
    std::vector<float> rk(size_t(kLayers) * kKv * kD * kD, 0.0f), rv(rk.size());
    std::vector<HeadCodec> codecs(size_t(kLayers) * kKv);
    for (size_t i = 0; i < art.heads.size(); ++i) {
      for (int c = 0; c < kD; ++c) rk[i * kD * kD + size_t(c) * kD + size_t(c)] = 1.0f;
      for (size_t e = 0; e < size_t(kD) * kD; ++e) rv[i * kD * kD + e] = float(art.heads[i].value.rotation[e]);
      codecs[i].key.clip_ratio = 1.0f;  // the artifact's 0.9 + 0.02·i is not kivi's
      codecs[i].value.clip_ratio = mixed ? float(art.heads[i].value.clip_ratio) : 1.0f;
      EXPECT_EQ(rt->codecs(int(i) / kKv)[i % kKv].key.clip_ratio, codecs[i].key.clip_ratio);
      EXPECT_EQ(rt->codecs(int(i) / kKv)[i % kKv].value.clip_ratio, codecs[i].value.clip_ratio);
    }
    KvCache ref{KvCacheConfig{g, 32, 4, PoolMemory::Host}};
    const int a = rt->cache().add_sequence(), b = rt->cache().add_sequence();
    ref.add_sequence();
    ref.add_sequence();
    std::mt19937 rng(5);
    std::normal_distribution<float> nd;
    const float scale = 1.0f / std::sqrt(float(kD));
    for (const auto& counts : std::vector<std::vector<int>>{{20, 70}, {45, 1}, {1, 30}}) {
      const int rows = counts[0] + counts[1];
      const std::vector<int64_t> old = {ref.length(a), ref.length(b)};
      rt->begin_append({a, b}, counts);
      ref.grow_batch({a, b}, {counts[0], counts[1]});
      const AppendBatch batch = make_append_batch({a, b}, old, counts);
      for (int l = 0; l < kLayers; ++l) {
        const size_t qn = size_t(counts[0]) * kHeads * kD;
        std::vector<float> k(size_t(rows) * kKv * kD), v(k.size()), q(qn);
        for (auto* x : {&k, &v, &q})
          for (auto& e : *x) e = nd(rng);
        const size_t off = size_t(l) * kKv * kD * kD;
        std::vector<float> got(q.size()), want(q.size());
        rt->prefill(l, a, counts[0], q.data(), k.data(), v.data(), got.data());
        prefill_ref(ref, l, a, counts[0], q.data(), k.data(), v.data(), kHeads, rk.data() + off, rv.data() + off,
                    codecs.data() + size_t(l) * kKv, scale, want.data(), old[0]);
        for (size_t i = 0; i < q.size(); ++i) ASSERT_EQ(got[i], want[i]) << "prefill layer " << l << " " << i;
        rt->append(l, k.data(), v.data());
        append_ref(ref, l, batch, k.data(), v.data(), rk.data() + off, rv.data() + off,
                   codecs.data() + size_t(l) * kKv);
      }
    }
    ASSERT_GT(history_pages(g, rt->cache().length(b)), 2);
    ASSERT_EQ(std::memcmp(rt->cache().pages_base(), ref.pages_base(), ref.pool_bytes()), 0);
    std::vector<float> q(size_t(2) * kHeads * kD), got(q.size()), want(q.size());
    for (auto& x : q) x = nd(rng);
    for (int l = 0; l < kLayers; ++l) {
      rt->decode(l, {a, b}, q.data(), got.data());
      const size_t off = size_t(l) * kKv * kD * kD;
      decode_ref(ref, l, {a, b}, q.data(), kHeads, rk.data() + off, rv.data() + off, codecs.data() + size_t(l) * kKv,
                 scale, want.data());
      for (size_t i = 0; i < q.size(); ++i) EXPECT_EQ(got[i], want[i]) << "layer " << l << " element " << i;
    }
    EXPECT_CONTAINS(testing::error_of([&] { rt->evict_tokens(a, {0, 1}); }), "per-channel key pages");
    RuntimeOptions device = host_options();
    device.memory = PoolMemory::Device;
    EXPECT_CONTAINS(testing::error_of([&] {
                      Runtime(art, EngineShape{kLayers, kHeads, kKv, kD}, device);
                    }),
                    "per-channel key pages");
    const char* json = nullptr;
    ASSERT_EQ(kvcc_artifact_describe(path.c_str(), &json), KVCC_OK);
    const std::string described = json;
    EXPECT_CONTAINS(described, "\"keys\":\"per_channel\"");
    EXPECT_CONTAINS(described, "\"served\":true");
    EXPECT_CONTAINS(described, "\"key_group_tokens\":8");
    EXPECT_CONTAINS(described, mixed ? "\"key_pair_bytes\":2" : "\"key_pair_bytes\":4");
    Artifact untiled = art;
    untiled.recipe.group = 12;
    EXPECT_CONTAINS(testing::error_of([&] {
                      Runtime(untiled, EngineShape{kLayers, kHeads, kKv, kD}, host_options());
                    }),
                    "do not divide the page of 16 tokens");
  }
}

}  // namespace
}  // namespace kvcc
