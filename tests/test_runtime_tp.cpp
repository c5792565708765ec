// Tensor parallelism on a host pool (the CPU reference): N ranks, each a Runtime built for its
// contiguous slice of the KV heads (kv_head_slice), driven by the slices of the same q, k and v as
// one whole-model Runtime, give outputs whose concatenation along the heads is the whole model's
// bit for bit (prefill and decode over random appends, a fork and several steps), pages whose
// blocks are the whole model's for the same heads, and 1/N of its pool bytes.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "formats/artifact.h"
#include "formats/error.h"
#include "formats/model_config.h"
#include "runtime/kv_cache.h"
#include "runtime/kvcc_c.h"
#include "runtime/kvcc_runtime.h"
#include "cache_test_util.h"

namespace kvcc {
namespace {

constexpr int kLayers = 2, kHeads = 8, kKv = 4, kD = 32, kGroup = kHeads / kKv;

// A random artifact: rotations per head, clip ratios, and level tables on half the key sides.
Artifact make_artifact() {
  ModelConfig cfg;
  cfg.architecture = "llama";
  cfg.n_layers = kLayers;
  cfg.n_heads = kHeads;
  cfg.n_kv_heads = kKv;
  cfg.head_dim = kD;
  cfg.hidden = kHeads * kD;
  Artifact a = testing::random_artifact(cfg, make_fingerprint(cfg, std::string(64, '0')), 7);
  a.recipe.sink = 8;
  a.recipe.recent = 32;
  a.recipe.page_size = 16;
  for (size_t i = 0; i < a.heads.size(); ++i) {
    if (i % 2) a.heads[i].key.levels.clear();
    a.heads[i].value.extras.clear();
  }
  return a;
}

RuntimeOptions options(int kv_begin = 0, int kv_end = 0) {
  RuntimeOptions o;
  o.max_pages = 64;
  o.max_sequences = 4;
  o.memory = PoolMemory::Host;
  o.kv_begin = kv_begin;
  o.kv_end = kv_end;
  return o;
}

const EngineShape kShape{kLayers, kHeads, kKv, kD};

// Heads [begin, end) of rows x [rows, heads, d].
std::vector<float> heads_of(const std::vector<float>& x, int heads, int begin, int end) {
  const size_t rows = x.size() / (size_t(heads) * kD);
  std::vector<float> out;
  for (size_t r = 0; r < rows; ++r)
    out.insert(out.end(), x.begin() + long((r * heads + size_t(begin)) * kD),
               x.begin() + long((r * heads + size_t(end)) * kD));
  return out;
}

std::vector<float> random_rows(size_t n, float scale, std::mt19937& rng) {
  std::normal_distribution<float> nd;
  std::vector<float> x(n);
  for (auto& e : x) e = scale * nd(rng);
  return x;
}

TEST(RuntimeTp, KvHeadSliceIsContiguousAndEqual) {
  EXPECT_EQ(kv_head_slice(8, 0, 1).begin, 0);
  EXPECT_EQ(kv_head_slice(8, 0, 1).end, 8);
  EXPECT_EQ(kv_head_slice(8, 2, 4).begin, 4);
  EXPECT_EQ(kv_head_slice(8, 2, 4).end, 6);
  EXPECT_EQ(kv_head_slice(8, 7, 8).begin, 7);
  EXPECT_EQ(kv_head_slice(8, 7, 8).end, 8);
  auto message = [](int n, int r, int N) {
    try {
      kv_head_slice(n, r, N);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message(8, 0, 3).find("3 ranks do not divide 8 KV heads"), std::string::npos) << message(8, 0, 3);
  EXPECT_NE(message(8, 4, 4).find("rank 4 out of range"), std::string::npos) << message(8, 4, 4);
  EXPECT_NE(message(8, -1, 4).find("rank -1 out of range"), std::string::npos) << message(8, -1, 4);
  EXPECT_NE(message(8, 0, 0).find("rank count must be positive"), std::string::npos) << message(8, 0, 0);
  EXPECT_NE(message(8, 0, 16).find("do not divide"), std::string::npos) << message(8, 0, 16);
}

TEST(RuntimeTp, RefusesBadSlices) {
  const Artifact a = make_artifact();
  auto message = [&](RuntimeOptions o, EngineShape e = kShape) {
    try {
      Runtime rt(a, e, o);
    } catch (const Error& err) {
      return std::string(err.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message(options(2, 0)).find("kv_begin 2 without kv_end"), std::string::npos);
  EXPECT_NE(message(options(0, 5)).find("slice [0, 5)"), std::string::npos) << message(options(0, 5));
  EXPECT_NE(message(options(3, 3)).find("slice [3, 3)"), std::string::npos);
  EXPECT_NE(message(options(-1, 2)).find("slice [-1, 2)"), std::string::npos);
  // The whole range given explicitly is the default.
  Runtime whole(a, kShape, options(0, kKv));
  EXPECT_EQ(whole.geometry().n_kv_heads, kKv);
  EXPECT_EQ(whole.n_heads(), kHeads);
  EXPECT_EQ(whole.kv_begin(), 0);
  EXPECT_EQ(whole.kv_end(), kKv);
  Runtime part(a, kShape, options(1, 3));
  EXPECT_EQ(part.geometry().n_kv_heads, 2);
  EXPECT_EQ(part.n_heads(), 2 * kGroup);
  EXPECT_EQ(part.kv_begin(), 1);
  EXPECT_EQ(part.kv_end(), 3);
}

// The rank's page blocks and window blocks are the whole model's for the same heads.
void expect_same_bytes(Runtime& whole, Runtime& rank, int ranks, int r) {
  const KvGeometry& gw = whole.geometry();
  const KvGeometry& gr = rank.geometry();
  const int b = rank.kv_begin();
  KvCache& wc = whole.cache();
  KvCache& rc = rank.cache();
  ASSERT_EQ(rc.pages_in_use(), wc.pages_in_use());
  for (int seq = 0; seq < wc.config().max_sequences; ++seq) {
    if (!wc.live(seq)) continue;
    ASSERT_TRUE(rc.live(seq));
    ASSERT_EQ(rc.page_table(seq), wc.page_table(seq));
    for (int l = 0; l < gw.n_layers; ++l)
      for (int h = 0; h < gr.n_kv_heads; ++h) {
        for (int32_t p : wc.page_table(seq))
          ASSERT_EQ(std::memcmp(rc.pages_base() + gr.page_block_offset(p, l, h),
                                wc.pages_base() + gw.page_block_offset(p, l, b + h), gw.page_head_bytes()),
                    0)
              << "rank " << r << "/" << ranks << " page " << p << " layer " << l << " head " << h;
        ASSERT_EQ(std::memcmp(rc.windows_base() + gr.window_block_elem(seq, l, h),
                              wc.windows_base() + gw.window_block_elem(seq, l, b + h), gw.window_head_elems() * 2),
                  0)
            << "rank " << r << "/" << ranks << " window of sequence " << seq << " layer " << l << " head " << h;
      }
  }
}

class RuntimeTpRanks : public ::testing::TestWithParam<int> {};

TEST_P(RuntimeTpRanks, RanksTogetherEqualTheWholeModel) {
  const int N = GetParam();
  const Artifact art = make_artifact();
  Runtime whole(art, kShape, options());
  std::vector<std::unique_ptr<Runtime>> ranks;
  for (int r = 0; r < N; ++r) {
    const KvHeadRange s = kv_head_slice(kKv, r, N);
    ranks.push_back(std::make_unique<Runtime>(art, kShape, options(s.begin, s.end)));
    ASSERT_EQ(ranks.back()->n_heads(), kHeads / N);
  }
  // Memory per rank: 1/N of the whole model's pages, window slots and pool.
  for (const auto& rt : ranks) {
    EXPECT_EQ(rt->geometry().page_bytes() * size_t(N), whole.geometry().page_bytes());
    EXPECT_EQ(rt->geometry().window_slot_bytes() * size_t(N), whole.geometry().window_slot_bytes());
    EXPECT_EQ(rt->cache().pool_bytes() * size_t(N), whole.cache().pool_bytes());
  }
  auto each = [&](auto&& f) {
    f(whole);
    for (auto& rt : ranks) f(*rt);
  };
  std::vector<int> seqs;
  for (int i = 0; i < 3; ++i) {
    int id = -1;
    each([&](Runtime& rt) {
      const int s = rt.cache().add_sequence();
      if (id < 0) id = s;
      ASSERT_EQ(s, id);
    });
    seqs.push_back(id);
  }
  const int r_heads = kHeads / N;
  std::mt19937 rng(100 + N);
  std::uniform_int_distribution<int> count(1, 40);
  // Runs `call(rt, q, k, v, out)` on the whole Runtime with the full tensors and on each rank with
  // its heads, and checks that the ranks' outputs concatenated along the heads are the whole's.
  auto compare = [&](const char* what, int step, int layer, const std::vector<float>& q, const std::vector<float>& k,
                     const std::vector<float>& v, auto&& call) {
    std::vector<float> want(q.size(), -1.0f);
    call(whole, q, k, v, want);
    std::vector<std::vector<float>> got(static_cast<size_t>(N));
    for (int r = 0; r < N; ++r) {
      const KvHeadRange s = kv_head_slice(kKv, r, N);
      const std::vector<float> qr = heads_of(q, kHeads, s.begin * kGroup, s.end * kGroup);
      got[size_t(r)].assign(qr.size(), -2.0f);
      call(*ranks[size_t(r)], qr, heads_of(k, kKv, s.begin, s.end), heads_of(v, kKv, s.begin, s.end), got[size_t(r)]);
    }
    const size_t rows = q.size() / (size_t(kHeads) * kD);
    for (size_t row = 0; row < rows; ++row)
      for (int r = 0; r < N; ++r)
        ASSERT_EQ(std::memcmp(got[size_t(r)].data() + row * r_heads * kD,
                              want.data() + (row * kHeads + size_t(r) * r_heads) * kD, size_t(r_heads) * kD * 4),
                  0)
            << what << " step " << step << " layer " << layer << " row " << row << " rank " << r << "/" << N;
  };
  for (int step = 0; step < 9; ++step) {
    if (step == 4) {  // a fork that then diverges
      int id = -1;
      each([&](Runtime& rt) {
        const int s = rt.cache().fork(seqs[1]);
        if (id < 0) id = s;
        ASSERT_EQ(s, id);
      });
      seqs.push_back(id);
    }
    std::vector<int> counts;
    int rows = 0;
    for (size_t i = 0; i < seqs.size(); ++i) {
      counts.push_back(step % 3 == 2 ? 1 : count(rng));  // every third step a decode-like step
      rows += counts.back();
    }
    std::vector<std::vector<float>> ks, vs;
    for (int l = 0; l < kLayers; ++l) {
      ks.push_back(random_rows(size_t(rows) * kKv * kD, 2.0f, rng));
      vs.push_back(random_rows(size_t(rows) * kKv * kD, 1.0f, rng));
    }
    const std::vector<float> q = random_rows(size_t(rows) * kHeads * kD, 1.0f, rng);
    // Prefill of sequence 0 before begin_append; the others inside the step, before each append.
    for (int l = 0; l < kLayers; ++l) {
      const int T = counts[0];
      const std::vector<float> q0(q.begin(), q.begin() + long(T) * kHeads * kD);
      const std::vector<float> k0(ks[size_t(l)].begin(), ks[size_t(l)].begin() + long(T) * kKv * kD);
      const std::vector<float> v0(vs[size_t(l)].begin(), vs[size_t(l)].begin() + long(T) * kKv * kD);
      compare("prefill before the step", step, l, q0, k0, v0,
              [&](Runtime& rt, const std::vector<float>& qq, const std::vector<float>& kk, const std::vector<float>& vv,
                  std::vector<float>& out) { rt.prefill(l, seqs[0], T, qq.data(), kk.data(), vv.data(), out.data()); });
    }
    each([&](Runtime& rt) { rt.begin_append(seqs, counts); });
    for (int l = 0; l < kLayers; ++l) {
      int row = 0;
      for (size_t i = 0; i < seqs.size(); ++i) {
        const int T = counts[i];
        if (i > 0) {
          const std::vector<float> qi(q.begin() + long(row) * kHeads * kD, q.begin() + long(row + T) * kHeads * kD);
          const std::vector<float> ki(ks[size_t(l)].begin() + long(row) * kKv * kD,
                                      ks[size_t(l)].begin() + long(row + T) * kKv * kD);
          const std::vector<float> vi(vs[size_t(l)].begin() + long(row) * kKv * kD,
                                      vs[size_t(l)].begin() + long(row + T) * kKv * kD);
          compare(
              "prefill inside the step", step, l, qi, ki, vi,
              [&](Runtime& rt, const std::vector<float>& qq, const std::vector<float>& kk, const std::vector<float>& vv,
                  std::vector<float>& out) { rt.prefill(l, seqs[i], T, qq.data(), kk.data(), vv.data(), out.data()); });
        }
        row += T;
      }
      whole.append(l, ks[size_t(l)].data(), vs[size_t(l)].data());
      for (int r = 0; r < N; ++r) {
        const KvHeadRange s = kv_head_slice(kKv, r, N);
        const std::vector<float> kr = heads_of(ks[size_t(l)], kKv, s.begin, s.end);
        const std::vector<float> vr = heads_of(vs[size_t(l)], kKv, s.begin, s.end);
        ranks[size_t(r)]->append(l, kr.data(), vr.data());
      }
    }
    // Decode of every sequence after the step.
    const std::vector<float> qd = random_rows(seqs.size() * kHeads * kD, 1.0f, rng);
    for (int l = 0; l < kLayers; ++l)
      compare("decode", step, l, qd, {}, {},
              [&](Runtime& rt, const std::vector<float>& qq, const std::vector<float>&, const std::vector<float>&,
                  std::vector<float>& out) { rt.decode(l, seqs, qq.data(), out.data()); });
  }
  // The run reached INT2 history (several pages) in every sequence.
  for (int s : seqs) EXPECT_GE(history_pages(whole.geometry(), whole.cache().length(s)), 3) << "sequence " << s;
  for (int r = 0; r < N; ++r) {
    expect_same_bytes(whole, *ranks[size_t(r)], N, r);
    EXPECT_EQ(ranks[size_t(r)]->cache().bytes_in_use() * size_t(N), whole.cache().bytes_in_use());
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, RuntimeTpRanks, ::testing::Values(1, 2, 4));

TEST(RuntimeTp, CAbiLoadsARank) {
  const std::string path = ::testing::TempDir() + "kvcc_runtime_tp_test.kvcc.h5";
  write_artifact(make_artifact(), path);
  kvcc_runtime* rt = nullptr;
  ASSERT_EQ(kvcc_runtime_load_rank(path.c_str(), kLayers, kHeads, kKv, kD, 8, 2, 0, 1, 2, &rt), KVCC_OK)
      << kvcc_last_error();
  int seq = -1;
  ASSERT_EQ(kvcc_add_sequence(rt, &seq), KVCC_OK);
  const int count = 3;
  ASSERT_EQ(kvcc_begin_append(rt, 1, &seq, &count), KVCC_OK);
  std::mt19937 rng(3);
  const std::vector<float> k = random_rows(size_t(count) * (kKv / 2) * kD, 1.0f, rng), v = k;
  for (int l = 0; l < kLayers; ++l) ASSERT_EQ(kvcc_append(rt, l, k.data(), v.data(), nullptr), KVCC_OK);
  const std::vector<float> q = random_rows(size_t(kHeads / 2) * kD, 1.0f, rng);
  std::vector<float> out(q.size());
  ASSERT_EQ(kvcc_decode(rt, 0, 1, &seq, q.data(), out.data(), nullptr), KVCC_OK) << kvcc_last_error();
  kvcc_runtime_free(rt);
  EXPECT_EQ(kvcc_runtime_load_rank(path.c_str(), kLayers, kHeads, kKv, kD, 8, 2, 0, 0, 3, &rt), KVCC_ERROR);
  EXPECT_NE(std::string(kvcc_last_error()).find("3 ranks do not divide 4 KV heads"), std::string::npos)
      << kvcc_last_error();
  EXPECT_EQ(kvcc_runtime_load_rank(path.c_str(), kLayers, kHeads, kKv, kD, 8, 2, 0, 2, 2, &rt), KVCC_ERROR);
  EXPECT_NE(std::string(kvcc_last_error()).find("rank 2 out of range"), std::string::npos) << kvcc_last_error();
}

}  // namespace
}  // namespace kvcc
