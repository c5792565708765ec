// Steps from an engine's own tables (RuntimeOptions::engine_tables, runtime/engine_step.h).
// 1. The closed-form per-sequence moves and writes the device planner uses (engine_seq_items,
//    engine_move, engine_write, run here on the host) are plan_append_moves' tables, field for
//    field and in its order, for every old length and count around the tier boundaries and for
//    random ragged batches with random page ids.
// 2. A host-pool Runtime fed the engine's tables (its own slot and page assignment, not the
//    Runtime's) serves the same attention as a Runtime keeping its own tables, bit for bit, and
//    holds the same bytes in the pages and window slots the two assign; bad steps are refused
//    before anything changes, and the Runtime's own allocator is off.
// The device planner is compared with plan_append_moves on the GPU (tests/gpu_test_engine.cu).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "formats/artifact.h"
#include "formats/error.h"
#include "formats/kv_layout.h"
#include "runtime/engine_step.h"
#include "runtime/kv_cache.h"
#include "runtime/kvcc_c.h"
#include "runtime/kvcc_runtime.h"
#include "runtime/plan.h"
#include "cache_test_util.h"

namespace kvcc {
namespace {

KvGeometry geometry(int sink, int recent, int page) {
  KvGeometry g;
  g.n_layers = 1;
  g.n_kv_heads = 1;
  g.head_dim = 32;
  g.group = 32;
  g.page_tokens = page;
  g.sink = sink;
  g.recent = recent;
  return g;
}

// The step's tables by the closed forms, sequence by sequence (what plan_engine_step_kernel does
// with a block scan).
AppendMoves closed_form(const KvGeometry& g, const AppendPlanHost& p) {
  AppendMoves m;
  int64_t row = 0;
  for (size_t i = 0; i < p.seq_slots.size(); ++i) {
    const EngineSeqItems it = engine_seq_items(g, p.old_lengths[i], p.counts[i]);
    const int64_t first_move = int64_t(m.moves.size());
    for (int64_t k = 0; k < it.moves(); ++k)
      m.moves.push_back(engine_move(g, it, p.seq_slots[i], p.old_lengths[i], row, p.page_tables[i].data(), k));
    for (int64_t k = 0; k < it.writes(); ++k)
      m.writes.push_back(engine_write(g, it, p.seq_slots[i], p.old_lengths[i], row, first_move, k));
    row += p.counts[i];
  }
  return m;
}

void expect_same(const AppendMoves& want, const AppendMoves& got, const std::string& where) {
  ASSERT_EQ(want.moves.size(), got.moves.size()) << where;
  ASSERT_EQ(want.writes.size(), got.writes.size()) << where;
  for (size_t i = 0; i < want.moves.size(); ++i) {
    const AppendMove &a = want.moves[i], &b = got.moves[i];
    ASSERT_TRUE(a.seq_slot == b.seq_slot && a.from_ring == b.from_ring && a.src == b.src && a.page == b.page &&
                a.row == b.row)
        << where << " move " << i << ": want (" << a.seq_slot << " " << a.from_ring << " " << a.src << " " << a.page
        << " " << a.row << ") got (" << b.seq_slot << " " << b.from_ring << " " << b.src << " " << b.page << " "
        << b.row << ")";
  }
  for (size_t i = 0; i < want.writes.size(); ++i) {
    const AppendWindowWrite &a = want.writes[i], &b = got.writes[i];
    ASSERT_TRUE(a.seq_slot == b.seq_slot && a.to_ring == b.to_ring && a.src == b.src && a.dst == b.dst &&
                a.move == b.move)
        << where << " write " << i << ": want (" << a.seq_slot << " " << a.to_ring << " " << a.src << " " << a.dst
        << " " << a.move << ") got (" << b.seq_slot << " " << b.to_ring << " " << b.src << " " << b.dst << " " << b.move
        << ")";
  }
}

// A plan of sequences at old lengths n0 with counts, slots `slots`, random page ids.
AppendPlanHost plan_of(const KvGeometry& g, const std::vector<int>& slots, const std::vector<int64_t>& n0,
                       const std::vector<int>& counts, std::mt19937& rng) {
  AppendPlanHost p;
  int64_t row = 0;
  for (size_t i = 0; i < n0.size(); ++i) {
    p.seq_slots.push_back(slots[i]);
    p.old_lengths.push_back(n0[i]);
    p.counts.push_back(counts[i]);
    p.row_offsets.push_back(row);
    row += counts[i];
    std::vector<int32_t> table(size_t(history_pages(g, n0[i] + counts[i])));
    for (int32_t& id : table) id = int32_t(rng() % 100000);
    p.page_tables.push_back(table);
  }
  return p;
}

TEST(EngineStepItems, EqualPlanAppendMovesForEveryLengthAndCount) {
  std::mt19937 rng(11);
  for (const KvGeometry& g :
       {geometry(8, 32, 16), geometry(0, 64, 64), geometry(16, 64, 16), geometry(64, 256, 64), geometry(4, 48, 16)}) {
    const int P = g.page_tokens;
    const std::string gs =
        "sink " + std::to_string(g.sink) + " recent " + std::to_string(g.recent) + " page " + std::to_string(P);
    // One sequence: every old length and count across the sink, the first flushes and wraps.
    for (int64_t n0 = 0; n0 <= 2 * (g.sink + g.recent + P); ++n0)
      for (int c = 0; c <= 3 * P + g.recent; c += (c < 2 * P ? 1 : 7)) {
        const AppendPlanHost p = plan_of(g, {3}, {n0}, {c}, rng);
        expect_same(plan_append_moves(g, p), closed_form(g, p),
                    gs + " n0 " + std::to_string(n0) + " c " + std::to_string(c));
        if (HasFatalFailure()) return;
      }
    // Ragged batches: decode steps beside prefills, empty sequences among them.
    for (int trial = 0; trial < 300; ++trial) {
      const int batch = 1 + int(rng() % 9);
      std::vector<int> slots(static_cast<size_t>(batch)), counts;
      std::iota(slots.begin(), slots.end(), 0);
      std::shuffle(slots.begin(), slots.end(), rng);
      std::vector<int64_t> n0;
      for (int b = 0; b < batch; ++b) {
        n0.push_back(int64_t(rng() % (4 * (g.sink + g.recent + P))));
        const int kind = int(rng() % 4);
        counts.push_back(kind == 0 ? 0 : kind == 1 ? 1 : int(rng() % (5 * P)));
      }
      const AppendPlanHost p = plan_of(g, slots, n0, counts, rng);
      expect_same(plan_append_moves(g, p), closed_form(g, p), gs + " trial " + std::to_string(trial));
      if (HasFatalFailure()) return;
    }
  }
}

TEST(EngineStepItems, ProblemsAreNamed) {
  const KvGeometry g = geometry(8, 32, 16);
  std::vector<int32_t> pages(64);
  std::iota(pages.begin(), pages.end(), 0);
  const int64_t ctx = 500, pool = 64;
  EXPECT_EQ(engine_seq_problem(g, ctx, 4, pool, 0, 0, 100, pages.data()), kStepOk);
  EXPECT_EQ(engine_seq_problem(g, ctx, 4, pool, 3, 400, 100, pages.data()), kStepOk);  // exactly max_context
  EXPECT_EQ(engine_seq_problem(g, ctx, 4, pool, 4, 0, 1, pages.data()), kStepBadSlot);
  EXPECT_EQ(engine_seq_problem(g, ctx, 4, pool, -1, 0, 1, pages.data()), kStepBadSlot);
  EXPECT_EQ(engine_seq_problem(g, ctx, 4, pool, 0, -1, 1, pages.data()), kStepBadLength);
  EXPECT_EQ(engine_seq_problem(g, ctx, 4, pool, 0, 10, -1, pages.data()), kStepBadLength);
  EXPECT_EQ(engine_seq_problem(g, ctx, 4, pool, 0, 400, 101, pages.data()), kStepBadLength);
  // A page the step writes (history pages of the new length beyond those of the old) out of the
  // pool is refused; an id the step only reads is not checked.
  const int64_t first_written = history_pages(g, 200);
  ASSERT_LT(first_written, history_pages(g, 300));
  pages[size_t(first_written)] = int32_t(pool);
  EXPECT_EQ(engine_seq_problem(g, ctx, 4, pool, 0, 200, 100, pages.data()), kStepBadPage);
  pages[size_t(first_written)] = -1;
  EXPECT_EQ(engine_seq_problem(g, ctx, 4, pool, 0, 200, 100, pages.data()), kStepBadPage);
  EXPECT_EQ(engine_seq_problem(g, ctx, 4, pool, 0, 300, 1, pages.data()), kStepOk);
  for (int p : {kStepBadSlot, kStepBadLength, kStepBadPage, kStepTooManyTokens})
    EXPECT_FALSE(engine_step_message(p, 2).empty());
  EXPECT_TRUE(engine_step_message(kStepOk, -1).empty());
}

using testing::EngineTables;

std::vector<float> random_rows(size_t n, std::mt19937& rng) {
  std::normal_distribution<float> n01;
  std::vector<float> x(n);
  for (float& v : x) v = n01(rng);
  return x;
}

TEST(RuntimeEngine, EngineTablesServeWhatTheRuntimesOwnTablesServe) {
  const int L = 2, Hq = 4, Hkv = 2, d = 32;
  const Artifact a = testing::small_runtime_artifact(L, Hq, Hkv, d);  // sink 8, recent 32, pages of 16
  const EngineShape e{L, Hq, Hkv, d};
  RuntimeOptions o;
  o.max_pages = 96;
  o.max_sequences = 5;
  o.memory = PoolMemory::Host;
  o.max_batch = 3;
  o.max_context = 400;
  o.max_step_tokens = 200;
  Runtime own(a, e, o);
  RuntimeOptions oe = o;
  oe.engine_tables = true;
  Runtime eng(a, e, oe);
  const KvGeometry& g = own.geometry();
  std::mt19937 rng(3);
  const int n = 3;
  std::vector<int> seqs;
  for (int i = 0; i < n; ++i) seqs.push_back(own.cache().add_sequence());
  const int stride = int(eng.history_pages(o.max_context)) + 2;
  EngineTables tables(o.max_pages, stride, {4, 1, 2}, rng);  // not the Runtime's slots 0, 1, 2
  // Steps: ragged prefills that cross the sink, flush pages and wrap the ring, then decode steps
  // of one token each (with a sequence left out of some), each with prefill + append + decode.
  const std::vector<std::pair<std::vector<int>, std::vector<int>>> steps = {
      {{0, 1, 2}, {5, 40, 120}}, {{1, 0}, {30, 77}},     {{2}, {63}}, {{0, 1, 2}, {1, 1, 1}},
      {{0, 2}, {1, 1}},          {{0, 1, 2}, {1, 1, 1}}, {{1}, {17}}, {{0, 1, 2}, {1, 1, 1}}};
  for (size_t si = 0; si < steps.size(); ++si) {
    const auto& [which, counts] = steps[si];
    std::vector<int> own_seqs;
    int rows = 0;
    for (size_t j = 0; j < which.size(); ++j) {
      own_seqs.push_back(seqs[size_t(which[j])]);
      rows += counts[j];
    }
    const EngineTables::Step st = tables.step(g, which, counts);
    // Prefill outputs of each sequence before the step's append, both ways.
    std::vector<std::vector<float>> q_pre, k_pre, v_pre;
    for (size_t j = 0; j < which.size(); ++j) {
      q_pre.push_back(random_rows(size_t(counts[j]) * Hq * d, rng));
      k_pre.push_back(random_rows(size_t(counts[j]) * Hkv * d, rng));
      v_pre.push_back(random_rows(size_t(counts[j]) * Hkv * d, rng));
    }
    own.begin_append(own_seqs, counts);
    eng.begin_step(st.view(stride));
    EXPECT_EQ(eng.step_problem(), "");
    for (int l = 0; l < L; ++l) {
      std::vector<float> k, v;
      for (size_t j = 0; j < which.size(); ++j) {
        const size_t ij = size_t(which[j]);
        std::vector<float> po(q_pre[j].size()), pe(q_pre[j].size());
        own.prefill(l, own_seqs[j], counts[j], q_pre[j].data(), k_pre[j].data(), v_pre[j].data(), po.data());
        const EngineSequence es{tables.slots[ij], tables.lengths[ij], st.block_table.data() + j * size_t(stride)};
        eng.prefill(l, es, counts[j], q_pre[j].data(), k_pre[j].data(), v_pre[j].data(), pe.data());
        ASSERT_EQ(0, std::memcmp(po.data(), pe.data(), po.size() * sizeof(float))) << "prefill step " << si;
        k.insert(k.end(), k_pre[j].begin(), k_pre[j].end());
        v.insert(v.end(), v_pre[j].begin(), v_pre[j].end());
      }
      ASSERT_EQ(k.size(), size_t(rows) * Hkv * d);
      own.append(l, k.data(), v.data());
      eng.append(l, k.data(), v.data());
      const std::vector<float> q = random_rows(which.size() * Hq * d, rng);
      std::vector<float> out_own(q.size(), 1.0f), out_eng(q.size(), 2.0f), out_step(q.size(), 3.0f);
      own.decode(l, own_seqs, q.data(), out_own.data());
      own.decode_step(l, q.data(), out_step.data());  // the step's sequences, same thing
      eng.decode_step(l, q.data(), out_eng.data());
      ASSERT_EQ(0, std::memcmp(out_own.data(), out_eng.data(), q.size() * sizeof(float))) << "decode step " << si;
      ASSERT_EQ(0, std::memcmp(out_own.data(), out_step.data(), q.size() * sizeof(float)));
    }
    tables.commit(which, counts);
  }
  // The same bytes where each assigns them: every history page and every window slot.
  for (int i = 0; i < n; ++i) {
    const std::vector<int32_t>& op = own.cache().page_table(seqs[size_t(i)]);
    const std::vector<int32_t>& ep = tables.pages[size_t(i)];
    ASSERT_EQ(int64_t(op.size()), history_pages(g, tables.lengths[size_t(i)]));
    for (size_t p = 0; p < op.size(); ++p)
      ASSERT_EQ(0, std::memcmp(own.cache().pages_base() + size_t(op[p]) * g.page_bytes(),
                               eng.cache().pages_base() + size_t(ep[p]) * g.page_bytes(), g.page_bytes()))
          << "sequence " << i << " page " << p;
    ASSERT_EQ(0, std::memcmp(reinterpret_cast<const uint8_t*>(own.cache().windows_base()) +
                                 size_t(seqs[size_t(i)]) * g.window_slot_bytes(),
                             reinterpret_cast<const uint8_t*>(eng.cache().windows_base()) +
                                 size_t(tables.slots[size_t(i)]) * g.window_slot_bytes(),
                             g.window_slot_bytes()))
        << "sequence " << i << " window slot";
  }
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

TEST(RuntimeEngine, BadStepsAndTheOwnAllocatorAreRefused) {
  const Artifact a = testing::small_runtime_artifact(1, 4, 2, 32);
  const EngineShape e{1, 4, 2, 32};
  RuntimeOptions o;
  o.max_pages = 16;
  o.max_sequences = 3;
  o.memory = PoolMemory::Host;
  o.engine_tables = true;
  EXPECT_THROW(Runtime(a, e, o), Error);  // no maxima declared
  o.max_batch = 2;
  o.max_context = 100;
  o.max_step_tokens = 50;
  Runtime rt(a, e, o);
  const KvGeometry& g = rt.geometry();
  const int stride = int(rt.history_pages(100));
  std::vector<int32_t> table(size_t(2 * stride));
  std::iota(table.begin(), table.end(), 0);
  std::vector<int32_t> slots = {0, 2}, lengths = {0, 0}, counts = {30, 20};
  auto view = [&] { return EngineStep{2, slots.data(), lengths.data(), counts.data(), table.data(), stride}; };
  rt.begin_step(view());
  const uint64_t version = rt.cache().version();
  auto refused = [&](const EngineStep& s, const std::string& part) {
    try {
      rt.begin_step(s);
      ADD_FAILURE() << "accepted a step that should fail with: " << part;
    } catch (const Error& err) {
      EXPECT_TRUE(contains(err.what(), part)) << err.what();
    }
    EXPECT_EQ(rt.cache().version(), version) << part;
  };
  lengths = {30, 20};
  counts = {51, 0};
  refused(view(), "max_step_tokens");
  // EngineStep::rows bounds the step's new tokens by the rows of the caller's k and v.
  counts = {20, 10};
  EngineStep padded = view();
  padded.rows = 29;
  refused(padded, "more new tokens than the step's k / v rows");
  padded.rows = 51;
  refused(padded, "51 k / v rows, outside [0, max_step_tokens = 50]");
  padded.rows = -1;
  refused(padded, "-1 k / v rows");
  counts = {-1, 1};
  refused(view(), "sequence 0 of the step has a negative length or count");
  counts = {1, 81};
  refused(view(), "sequence 1 of the step has a negative length or count, or would hold more than");
  counts = {1, 1};
  slots = {0, 3};
  refused(view(), "sequence 1 of the step has a window slot outside");
  slots = {1, 1};
  refused(view(), "window slot 1 given to two sequences");
  slots = {0, 2};
  lengths = {30, 40};
  counts = {1, 40};  // sequence 1 grows to 80 tokens: history pages are written
  ASSERT_GT(history_pages(g, 80), history_pages(g, 40));
  table[size_t(stride) + size_t(history_pages(g, 40))] = int32_t(o.max_pages);
  refused(view(), "sequence 1 of the step names a page outside the pool");
  std::iota(table.begin(), table.end(), 0);
  refused(EngineStep{3, slots.data(), lengths.data(), counts.data(), table.data(), stride}, "max_batch");
  refused(EngineStep{2, slots.data(), lengths.data(), counts.data(), table.data(), stride - 1}, "block table rows");
  refused(EngineStep{2, slots.data(), nullptr, counts.data(), table.data(), stride}, "null table");
  // The Runtime's own tables are off.
  EXPECT_THROW(rt.begin_append({0}, {1}), Error);
  EXPECT_THROW(rt.cache().add_sequence(), Error);
  EXPECT_THROW(rt.evict_tokens(0, {0}), Error);
  std::vector<float> q(4 * 32), out(4 * 32);
  EXPECT_THROW(rt.decode(0, {0}, q.data(), out.data()), Error);
  EXPECT_THROW(rt.prefill(0, 0, 1, q.data(), q.data(), q.data(), out.data()), Error);
  // And the engine calls are refused on a Runtime that keeps its own.
  RuntimeOptions own = o;
  own.engine_tables = false;
  Runtime rt_own(a, e, own);
  EXPECT_THROW(rt_own.begin_step(view()), Error);
  EXPECT_THROW(rt_own.prefill(0, EngineSequence{0, 0, table.data()}, 1, q.data(), q.data(), q.data(), out.data()),
               Error);
}

TEST(RuntimeEngine, TheCAbiServesTheSameSteps) {
  const int L = 1, Hq = 4, Hkv = 2, d = 32;
  const Artifact a = testing::small_runtime_artifact(L, Hq, Hkv, d);
  const std::string path = ::testing::TempDir() + "kvcc_engine_c_test.kvcc.h5";
  write_artifact(a, path);
  RuntimeOptions o;
  o.max_pages = 32;
  o.max_sequences = 3;
  o.memory = PoolMemory::Host;
  o.max_batch = 2;
  o.max_context = 200;
  o.max_step_tokens = 100;
  o.engine_tables = true;
  Runtime cpp(a, EngineShape{L, Hq, Hkv, d}, o);
  kvcc_runtime* c = nullptr;
  ASSERT_EQ(kvcc_runtime_load_engine(path.c_str(), L, Hq, Hkv, d, 32, 3, 0, 0, 1, 2, 200, 100, KVCC_FLOAT32, &c),
            KVCC_OK)
      << kvcc_last_error();
  kvcc_runtime* undeclared = nullptr;
  EXPECT_EQ(kvcc_runtime_load_engine(path.c_str(), L, Hq, Hkv, d, 32, 3, 0, 0, 1, 0, 0, 0, KVCC_FLOAT32, &undeclared),
            KVCC_ERROR);
  EXPECT_NE(std::string(kvcc_last_error()).find("max_context"), std::string::npos) << kvcc_last_error();
  std::mt19937 rng(9);
  const int stride = int(cpp.history_pages(200));
  std::vector<int32_t> table(size_t(2 * stride));
  for (size_t i = 0; i < table.size(); ++i) table[i] = int32_t(31 - i);  // the engine's own order
  std::vector<int32_t> slots = {2, 0}, lengths = {0, 0};
  for (const std::vector<int32_t>& counts : {std::vector<int32_t>{60, 40}, {1, 1}, {40, 1}, {1, 1}}) {
    const int rows = counts[0] + counts[1];
    const std::vector<float> k = random_rows(size_t(rows) * Hkv * d, rng), v = random_rows(size_t(rows) * Hkv * d, rng);
    const std::vector<float> q = random_rows(size_t(rows) * Hq * d, rng), qd = random_rows(2 * Hq * d, rng);
    std::vector<float> pre_c(q.size()), pre_cpp(q.size()), out_c(qd.size()), out_cpp(qd.size());
    const EngineStep st{2, slots.data(), lengths.data(), counts.data(), table.data(), stride, rows};
    cpp.begin_step(st);
    ASSERT_EQ(kvcc_begin_step(c, 2, slots.data(), lengths.data(), counts.data(), table.data(), stride, rows, nullptr),
              KVCC_OK)
        << kvcc_last_error();
    const char* problem = nullptr;
    ASSERT_EQ(kvcc_step_problem(c, nullptr, &problem), KVCC_OK);
    EXPECT_STREQ(problem, "");
    // Both sequences' new rows in one call through the C ABI, each alone through C++: sequence
    // 0's rows are the first counts[0] rows of q, k and v, sequence 1's the next counts[1].
    const size_t q_row = size_t(Hq) * d, kv_row = size_t(Hkv) * d;
    for (int i = 0; i < 2; ++i) {
      const size_t r0 = i ? size_t(counts[0]) : 0;
      cpp.prefill(0, EngineSequence{slots[i], lengths[i], table.data() + size_t(i) * stride}, counts[i],
                  q.data() + r0 * q_row, k.data() + r0 * kv_row, v.data() + r0 * kv_row, pre_cpp.data() + r0 * q_row);
    }
    const int c_slots[2] = {slots[0], slots[1]}, c_counts[2] = {counts[0], counts[1]};
    const int64_t c_lengths[2] = {lengths[0], lengths[1]};
    const int32_t* c_pages[2] = {table.data(), table.data() + stride};
    ASSERT_EQ(kvcc_prefill_engine(c, 0, 2, c_slots, c_lengths, c_pages, c_counts, q.data(), k.data(), v.data(),
                                  pre_c.data(), nullptr),
              KVCC_OK)
        << kvcc_last_error();
    cpp.append(0, k.data(), v.data());
    ASSERT_EQ(kvcc_append(c, 0, k.data(), v.data(), nullptr), KVCC_OK) << kvcc_last_error();
    cpp.decode_step(0, qd.data(), out_cpp.data());
    ASSERT_EQ(kvcc_decode_step(c, 0, qd.data(), out_c.data(), nullptr), KVCC_OK) << kvcc_last_error();
    EXPECT_EQ(0, std::memcmp(pre_c.data(), pre_cpp.data(), pre_c.size() * 4));
    EXPECT_EQ(0, std::memcmp(out_c.data(), out_cpp.data(), out_c.size() * 4));
    for (int i = 0; i < 2; ++i) lengths[size_t(i)] += counts[size_t(i)];
  }
  // A bad step is refused with the problem named; the Runtime's own calls are refused.
  const std::vector<int32_t> too_many = {60, 41};
  EXPECT_EQ(kvcc_begin_step(c, 2, slots.data(), lengths.data(), too_many.data(), table.data(), stride, 0, nullptr),
            KVCC_ERROR);
  EXPECT_NE(std::string(kvcc_last_error()).find("max_step_tokens"), std::string::npos) << kvcc_last_error();
  const std::vector<int32_t> two = {1, 1};
  EXPECT_EQ(kvcc_begin_step(c, 2, slots.data(), lengths.data(), two.data(), table.data(), stride, 1, nullptr),
            KVCC_ERROR);
  EXPECT_NE(std::string(kvcc_last_error()).find("k / v rows"), std::string::npos) << kvcc_last_error();
  int seq = -1;
  EXPECT_NE(kvcc_add_sequence(c, &seq), KVCC_OK);
  kvcc_runtime_free(c);
}

}  // namespace
}  // namespace kvcc
