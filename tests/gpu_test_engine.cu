// Steps from an engine's own tables on the device (RuntimeOptions::engine_tables):
// 1. plan_engine_step's tables (header, moves, window writes, decode ints) are plan_append_moves'
//    on the same lengths and block tables, entry for entry, for random ragged steps up to
//    kEngineMaxBatch sequences and planning blocks of every size; a step with a bad sequence plans nothing and names
//    it.
// 2. A whole step, begin_step included, captured once in a CUDA graph and replayed for later
//    steps (new lengths, counts, slots, block-table entries written into the same arrays) gives
//    bit for bit the outputs of a Runtime keeping its own tables, uncaptured, and the same pool
//    bytes where each assigns them; against the CPU reference (a host-pool Runtime fed the same
//    tables) within the decode tests' tolerance; every output element written (NaN sentinels).
//    Prefill through the engine's tables equals prefill through the Runtime's own, bit for bit.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "formats/artifact.h"
#include "formats/error.h"
#include "formats/kv_layout.h"
#include "runtime/device_buffer.h"
#include "runtime/engine_step.h"
#include "runtime/kv_kernels.h"
#include "runtime/kvcc_runtime.h"
#include "runtime/plan.h"
#include "cache_test_util.h"
#include "gpu_test_util.h"

namespace kvcc {
namespace {

using testing::gpu_runtime_artifact;
using testing::random_rows;
using testing::rel;

constexpr int kD = kGpuHeadDim;
constexpr int kLayers = 2, kHeads = 16, kKv = 4;

struct HostStep {
  std::vector<int32_t> slots, lengths, counts, table;
  int stride = 0;
};

void check_device_plan(const KvGeometry& g, const StepLimits& lim, int max_sequences, int64_t max_pages,
                       const HostStep& h, const char* what) {
  const StepCapacity cap = step_capacity(g, lim);
  DeviceBuffer<uint8_t> step(cap.bytes);
  CUDA_OK(cudaMemset(step.data(), 0xee, cap.bytes));
  DeviceBuffer<int32_t> slots(h.slots), lengths(h.lengths), counts(h.counts), table(h.table);
  const int B = int(h.slots.size());
  const EngineStep s{B, slots.data(), lengths.data(), counts.data(), table.data(), h.stride};
  plan_engine_step(g, s, cap, lim, max_sequences, max_pages, step.data(), nullptr);
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<uint8_t> got(cap.bytes);
  CUDA_OK(cudaMemcpy(got.data(), step.data(), cap.bytes, cudaMemcpyDeviceToHost));
  int32_t header[kStepHeaderInts];
  std::memcpy(header, got.data() + cap.counts_at, sizeof(header));
  const int32_t* ints = reinterpret_cast<const int32_t*>(got.data() + cap.ints_at);
  // The host's walk over the same tables.
  AppendPlanHost p;
  int64_t row = 0;
  for (int i = 0; i < B; ++i) {
    p.seq_slots.push_back(h.slots[size_t(i)]);
    p.old_lengths.push_back(h.lengths[size_t(i)]);
    p.counts.push_back(h.counts[size_t(i)]);
    p.row_offsets.push_back(row);
    row += h.counts[size_t(i)];
    const auto* r = h.table.data() + size_t(i) * size_t(h.stride);
    p.page_tables.emplace_back(r, r + h.stride);
  }
  const AppendMoves want = plan_append_moves(g, p);
  ASSERT_EQ(header[4], kStepOk) << what << ": " << engine_step_message(header[4], header[5]);
  ASSERT_EQ(header[5], -1) << what;
  ASSERT_EQ(size_t(header[0]), want.moves.size()) << what;
  ASSERT_EQ(size_t(header[1]), want.writes.size()) << what;
  const auto* mv = reinterpret_cast<const AppendMove*>(got.data() + cap.counts_at + size_t(header[2]));
  const auto* wr = reinterpret_cast<const AppendWindowWrite*>(got.data() + cap.counts_at + size_t(header[3]));
  for (size_t i = 0; i < want.moves.size(); ++i) {
    const AppendMove& a = want.moves[i];
    ASSERT_TRUE(a.seq_slot == mv[i].seq_slot && a.from_ring == mv[i].from_ring && a.src == mv[i].src &&
                a.page == mv[i].page && a.row == mv[i].row)
        << what << ": move " << i;
  }
  for (size_t i = 0; i < want.writes.size(); ++i) {
    const AppendWindowWrite& a = want.writes[i];
    ASSERT_TRUE(a.seq_slot == wr[i].seq_slot && a.to_ring == wr[i].to_ring && a.src == wr[i].src &&
                a.dst == wr[i].dst && a.move == wr[i].move)
        << what << ": write " << i;
  }
  for (int i = 0; i < B; ++i) {
    ASSERT_EQ(ints[i], h.slots[size_t(i)]) << what;
    ASSERT_EQ(ints[B + i], h.lengths[size_t(i)] + h.counts[size_t(i)]) << what;
    ASSERT_EQ(ints[2 * B + i], i * h.stride) << what;
  }
}

TEST(GpuEngine, DevicePlanIsPlanAppendMoves) {
  std::mt19937 rng(17);
  KvGeometry g = testing::test_geometry(1, 2);
  g.sink = 16;
  g.recent = 64;
  const int64_t max_pages = 1 << 20;
  for (int trial = 0; trial < 40; ++trial) {
    // Batches from 1 to kEngineMaxBatch; decode steps, prefills and empty sequences mixed.
    const int B = trial == 0 ? kEngineMaxBatch : trial == 1 ? 1 : 1 + int(rng() % 300);
    // The planning block's size follows max_batch (a warp up to 64 sequences, 1024 threads at
    // kEngineMaxBatch): random maxima cover whole and partial warps.
    const int max_batch = trial == 0 ? kEngineMaxBatch : std::min(kEngineMaxBatch, B + int(rng() % 100));
    const StepLimits lim{max_batch, 3000, max_batch * 700};
    HostStep h;
    h.stride = int(history_pages(g, lim.max_context));
    std::vector<int32_t> slots(kEngineMaxBatch);
    std::iota(slots.begin(), slots.end(), 0);
    std::shuffle(slots.begin(), slots.end(), rng);
    for (int i = 0; i < B; ++i) {
      const int kind = int(rng() % 4);
      const int32_t c = kind == 0 ? 0 : kind == 1 || B > 500 ? 1 : int32_t(rng() % 700);
      const int32_t n0 = int32_t(rng() % (lim.max_context - c + 1));
      h.slots.push_back(slots[size_t(i)]);
      h.lengths.push_back(n0);
      h.counts.push_back(c);
      for (int p = 0; p < h.stride; ++p) h.table.push_back(int32_t(rng() % max_pages));
    }
    check_device_plan(g, lim, kEngineMaxBatch, max_pages, h, trial == 0 ? "largest batch" : "random step");
    if (HasFatalFailure()) return;
  }
  // A bad sequence: nothing planned, zero lengths, the first bad one named.
  const StepLimits lim{8, 1000, 500};
  const StepCapacity cap = step_capacity(g, lim);
  HostStep h;
  h.stride = int(history_pages(g, lim.max_context));
  h.slots = {0, 1, 2};
  h.lengths = {10, 990, 20};
  h.counts = {5, 20, 1};  // sequence 1 would hold 1010 > max_context
  h.table.assign(size_t(3 * h.stride), 0);
  DeviceBuffer<uint8_t> step(cap.bytes);
  DeviceBuffer<int32_t> slots(h.slots), lengths(h.lengths), counts(h.counts), table(h.table);
  plan_engine_step(g, EngineStep{3, slots.data(), lengths.data(), counts.data(), table.data(), h.stride}, cap, lim, 8,
                   64, step.data(), nullptr);
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<uint8_t> got(cap.bytes);
  CUDA_OK(cudaMemcpy(got.data(), step.data(), cap.bytes, cudaMemcpyDeviceToHost));
  int32_t header[kStepHeaderInts];
  std::memcpy(header, got.data() + cap.counts_at, sizeof(header));
  EXPECT_EQ(header[0], 0);
  EXPECT_EQ(header[1], 0);
  EXPECT_EQ(header[4], kStepBadLength);
  EXPECT_EQ(header[5], 1);
  const int32_t* ints = reinterpret_cast<const int32_t*>(got.data() + cap.ints_at);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(ints[3 + i], 0) << "decode length of sequence " << i;
  // Valid sequences with more new tokens than the step's rows: nothing planned, the step named;
  // exactly as many rows plans them.
  const std::vector<int32_t> fits = {5, 7, 1};
  counts.upload(fits);
  for (const int rows : {12, 13}) {
    plan_engine_step(g, EngineStep{3, slots.data(), lengths.data(), counts.data(), table.data(), h.stride, rows}, cap,
                     lim, 8, 64, step.data(), nullptr);
    CUDA_OK(cudaMemcpy(header, step.data() + cap.counts_at, sizeof(header), cudaMemcpyDeviceToHost));
    EXPECT_EQ(header[4], rows == 12 ? kStepTooManyTokens : kStepOk) << rows << " rows";
    EXPECT_EQ(header[5], rows == 12 ? 3 : -1) << rows << " rows";
    EXPECT_EQ(header[1], rows == 13 ? 13 : 0) << rows << " rows: window writes";
  }
  // The host sees the stride, the batch and the rows.
  EXPECT_THROW(
      plan_engine_step(g, EngineStep{3, slots.data(), lengths.data(), counts.data(), table.data(), h.stride, 501}, cap,
                       lim, 8, 64, step.data(), nullptr),
      Error);
  EXPECT_THROW(plan_engine_step(g, EngineStep{3, slots.data(), lengths.data(), counts.data(), table.data(), 1}, cap,
                                lim, 8, 64, step.data(), nullptr),
               Error);
  EXPECT_THROW(plan_engine_step(g, EngineStep{9, slots.data(), lengths.data(), counts.data(), table.data(), h.stride},
                                cap, lim, 8, 64, step.data(), nullptr),
               Error);
}

using testing::EngineTables;

void captured_engine_step(bool kivi) {
  std::mt19937 rng(23);
  const Artifact art = gpu_runtime_artifact(rng, false, kivi);
  RuntimeOptions o;
  o.max_pages = 64;
  o.max_sequences = 4;
  o.memory = PoolMemory::Device;
  o.max_batch = 3;
  o.max_context = 512;
  o.max_step_tokens = 256;
  const EngineShape e{kLayers, kHeads, kKv, kD};
  Runtime own(art, e, o);
  RuntimeOptions oe = o;
  oe.engine_tables = true;
  Runtime eng(art, e, oe);
  RuntimeOptions oh = oe;
  oh.memory = PoolMemory::Host;
  Runtime ref(art, e, oh);
  for (Runtime* rt : {&own, &eng}) CUDA_OK(cudaMemset(rt->cache().pages_base(), 0, rt->cache().pool_bytes()));
  const KvGeometry& g = own.geometry();
  std::vector<int> seqs;
  for (int i = 0; i < 3; ++i) seqs.push_back(own.cache().add_sequence());
  const int stride = int(eng.history_pages(o.max_context));
  EngineTables engine(o.max_pages, stride, {3, 0, 2}, rng);
  cudaStream_t so, se;
  CUDA_OK(cudaStreamCreateWithFlags(&so, cudaStreamNonBlocking));
  CUDA_OK(cudaStreamCreateWithFlags(&se, cudaStreamNonBlocking));
  const size_t kv_row = size_t(kKv) * kD, q_row = size_t(kHeads) * kD;
  // The engine's step arrays and activations at fixed addresses (the graph reads those).
  DeviceBuffer<int32_t> d_slots(size_t(o.max_batch)), d_lengths(size_t(o.max_batch)), d_counts(size_t(o.max_batch)),
      d_table(size_t(o.max_batch) * size_t(stride));
  std::vector<DeviceBuffer<float>> k, v, q, out_o, out_e, pre_o, pre_e;
  for (int l = 0; l < kLayers; ++l) {
    k.emplace_back(size_t(o.max_step_tokens) * kv_row);
    v.emplace_back(size_t(o.max_step_tokens) * kv_row);
    q.emplace_back(size_t(o.max_step_tokens) * q_row);
    out_o.emplace_back(size_t(o.max_batch) * q_row);
    out_e.emplace_back(size_t(o.max_batch) * q_row);
    pre_o.emplace_back(size_t(o.max_step_tokens) * q_row);
    pre_e.emplace_back(size_t(o.max_step_tokens) * q_row);
  }
  std::vector<std::vector<float>> hk(kLayers), hv(kLayers), hq(kLayers);
  auto set_inputs = [&](int rows, int q_rows) {
    CUDA_OK(cudaDeviceSynchronize());
    for (int l = 0; l < kLayers; ++l) {
      hk[size_t(l)] = random_rows(size_t(rows) * kv_row, rng, true);
      hv[size_t(l)] = random_rows(size_t(rows) * kv_row, rng, false);
      hq[size_t(l)] = random_rows(size_t(q_rows) * q_row, rng, false);
      k[size_t(l)].upload(hk[size_t(l)]);
      v[size_t(l)].upload(hv[size_t(l)]);
      q[size_t(l)].upload(hq[size_t(l)]);
    }
    CUDA_OK(cudaDeviceSynchronize());
  };
  auto upload_step = [&](const EngineTables::Step& h) {
    CUDA_OK(cudaMemcpy(d_slots.data(), h.slots.data(), h.slots.size() * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_lengths.data(), h.lengths.data(), h.lengths.size() * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_counts.data(), h.counts.data(), h.counts.size() * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_table.data(), h.block_table.data(), h.block_table.size() * 4, cudaMemcpyHostToDevice));
  };
  auto view = [&](int batch) {
    return EngineStep{batch, d_slots.data(), d_lengths.data(), d_counts.data(), d_table.data(), stride};
  };
  // Prefill steps, one sequence each (prefill attends to the sequence's history and itself), then
  // its append; prefill outputs of the two device Runtimes compared bit for bit.
  const std::vector<std::pair<int, int>> fills = {{0, 14}, {1, 78}, {2, 100}, {2, 105}, {0, 40}};
  for (const auto& [i, c] : fills) {
    set_inputs(c, c);
    const EngineTables::Step h = engine.step(g, {i}, {c});
    upload_step(h);
    const EngineSequence es{h.slots[0], h.lengths[0], d_table.data()};
    const EngineSequence es_host{h.slots[0], h.lengths[0], h.block_table.data()};
    own.begin_append({seqs[size_t(i)]}, {c}, so);
    eng.begin_step(view(1), se);
    ref.begin_step(h.view(stride));
    for (int l = 0; l < kLayers; ++l) {
      own.prefill(l, seqs[size_t(i)], c, q[size_t(l)].data(), k[size_t(l)].data(), v[size_t(l)].data(),
                  pre_o[size_t(l)].data(), so);
      eng.prefill(l, es, c, q[size_t(l)].data(), k[size_t(l)].data(), v[size_t(l)].data(), pre_e[size_t(l)].data(), se);
      std::vector<float> pre_ref(size_t(c) * q_row);
      ref.prefill(l, es_host, c, hq[size_t(l)].data(), hk[size_t(l)].data(), hv[size_t(l)].data(), pre_ref.data());
      own.append(l, k[size_t(l)].data(), v[size_t(l)].data(), so);
      eng.append(l, k[size_t(l)].data(), v[size_t(l)].data(), se);
      ref.append(l, hk[size_t(l)].data(), hv[size_t(l)].data());
      CUDA_OK(cudaStreamSynchronize(so));
      CUDA_OK(cudaStreamSynchronize(se));
      const std::vector<float> a = pre_o[size_t(l)].download(), b = pre_e[size_t(l)].download();
      ASSERT_EQ(0, std::memcmp(a.data(), b.data(), size_t(c) * q_row * 4)) << "prefill of sequence " << i;
      for (int t = 0; t < c; ++t)
        for (int hh = 0; hh < kHeads; ++hh) {
          const size_t off = (size_t(t) * kHeads + size_t(hh)) * kD;
          ASSERT_LT(rel(b.data() + off, pre_ref.data() + off, kD), 1e-2) << "prefill row " << t << " head " << hh;
        }
    }
    EXPECT_EQ(eng.step_problem(se), "");
    engine.commit({i}, {c});
  }
  // Decode steps: the engine's whole step captured once (begin_step's plan included), replayed.
  struct Step {
    std::vector<int> which, counts;
  };
  const std::vector<Step> steps = {{{0, 1, 2}, {1, 1, 1}}, {{0, 1, 2}, {2, 1, 3}},  {{2, 0, 1}, {1, 1, 1}},
                                   {{1, 2, 0}, {1, 1, 1}}, {{0, 1, 2}, {70, 1, 1}}, {{0, 1, 2}, {1, 1, 1}},
                                   {{0, 1, 2}, {1, 1, 1}}, {{0, 2, 1}, {1, 65, 1}}, {{0, 1, 2}, {1, 1, 1}}};
  cudaGraphExec_t exec = nullptr;
  cudaGraph_t graph = nullptr;
  const size_t n_out = size_t(o.max_batch) * q_row;
  double worst = 0;
  for (size_t si = 0; si < steps.size(); ++si) {
    const Step& st = steps[si];
    int rows = 0;
    std::vector<int> own_seqs;
    for (size_t j = 0; j < st.which.size(); ++j) {
      rows += st.counts[j];
      own_seqs.push_back(seqs[size_t(st.which[j])]);
    }
    set_inputs(rows, int(st.which.size()));
    const EngineTables::Step h = engine.step(g, st.which, st.counts);
    upload_step(h);
    own.begin_append(own_seqs, st.counts, so);
    for (int l = 0; l < kLayers; ++l) {
      own.append(l, k[size_t(l)].data(), v[size_t(l)].data(), so);
      own.decode(l, own_seqs, q[size_t(l)].data(), out_o[size_t(l)].data(), so);
    }
    for (int l = 0; l < kLayers; ++l) CUDA_OK(cudaMemsetAsync(out_e[size_t(l)].data(), 0xff, n_out * 4, se));
    if (!exec) {
      CUDA_OK(cudaStreamBeginCapture(se, cudaStreamCaptureModeGlobal));
      eng.begin_step(view(int(st.which.size())), se);
      for (int l = 0; l < kLayers; ++l) {
        eng.append(l, k[size_t(l)].data(), v[size_t(l)].data(), se);
        eng.decode_step(l, q[size_t(l)].data(), out_e[size_t(l)].data(), se);
      }
      CUDA_OK(cudaStreamEndCapture(se, &graph));
      CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    }
    CUDA_OK(cudaGraphLaunch(exec, se));
    ref.begin_step(h.view(stride));
    std::vector<std::vector<float>> want(kLayers, std::vector<float>(st.which.size() * q_row));
    for (int l = 0; l < kLayers; ++l) {
      ref.append(l, hk[size_t(l)].data(), hv[size_t(l)].data());
      ref.decode_step(l, hq[size_t(l)].data(), want[size_t(l)].data());
    }
    CUDA_OK(cudaStreamSynchronize(so));
    CUDA_OK(cudaStreamSynchronize(se));
    EXPECT_EQ(eng.step_problem(se), "") << "step " << si;
    for (int l = 0; l < kLayers; ++l) {
      const std::vector<float> a = out_o[size_t(l)].download(), b = out_e[size_t(l)].download();
      size_t nan = 0, differ = 0;
      for (size_t x = 0; x < st.which.size() * q_row; ++x) {
        nan += std::isnan(b[x]);
        differ += std::memcmp(&a[x], &b[x], 4) != 0;
      }
      ASSERT_EQ(nan, 0u) << "step " << si << " layer " << l << ": output elements not written";
      ASSERT_EQ(differ, 0u) << "step " << si << " layer " << l << ": differs from the Runtime's own tables";
      for (size_t r = 0; r < st.which.size() * kHeads; ++r) {
        const double err = rel(b.data() + r * kD, want[size_t(l)].data() + r * kD, kD);
        worst = std::max(worst, err);
        ASSERT_LT(err, 1e-2) << "step " << si << " layer " << l << " row " << r << " against the CPU reference";
      }
    }
    engine.commit(st.which, st.counts);
  }
  // The same bytes where each assigns them.
  const std::vector<uint8_t> po = testing::device_pool_bytes(own.cache()), pe = testing::device_pool_bytes(eng.cache());
  const size_t windows_at = size_t(o.max_pages) * g.page_bytes();
  for (int i = 0; i < 3; ++i) {
    const std::vector<int32_t>& op = own.cache().page_table(seqs[size_t(i)]);
    ASSERT_EQ(op.size(), size_t(history_pages(g, engine.lengths[size_t(i)])));
    for (size_t p = 0; p < op.size(); ++p)
      ASSERT_EQ(0, std::memcmp(po.data() + size_t(op[p]) * g.page_bytes(),
                               pe.data() + size_t(engine.pages[size_t(i)][p]) * g.page_bytes(), g.page_bytes()))
          << "sequence " << i << " page " << p;
    ASSERT_EQ(0, std::memcmp(po.data() + windows_at + size_t(seqs[size_t(i)]) * g.window_slot_bytes(),
                             pe.data() + windows_at + size_t(engine.slots[size_t(i)]) * g.window_slot_bytes(),
                             g.window_slot_bytes()))
        << "sequence " << i << " window slot";
  }
  // A bad step replayed: nothing written, zeros out, the sequence named.
  EngineTables::Step bad = engine.step(g, {0, 1, 2}, {1, 1, 1});
  bad.lengths[1] = int32_t(o.max_context);
  upload_step(bad);
  CUDA_OK(cudaGraphLaunch(exec, se));
  CUDA_OK(cudaStreamSynchronize(se));
  EXPECT_NE(eng.step_problem(se).find("sequence 1 of the step"), std::string::npos) << eng.step_problem(se);
  for (float x : out_e[0].download()) ASSERT_EQ(x, 0.0f);
  EXPECT_TRUE(testing::device_pool_bytes(eng.cache()) == pe) << "a refused step wrote the pool";
  CUDA_OK(cudaGraphExecDestroy(exec));
  CUDA_OK(cudaGraphDestroy(graph));
  CUDA_OK(cudaStreamDestroy(so));
  CUDA_OK(cudaStreamDestroy(se));
  std::printf(
      "engine tables: %zu captured steps equal to the Runtime's own tables bit for bit; worst relative error "
      "against the CPU reference %.2e\n",
      steps.size(), worst);
}

TEST(GpuEngine, CapturedEngineStepMatchesOwnTablesAndTheReference) { captured_engine_step(false); }
// Per-channel key pages: the key-page kernel in the captured step, its grid sized by the capacities.
TEST(GpuEngine, CapturedEngineStepPerChannelKeys) { captured_engine_step(true); }

}  // namespace
}  // namespace kvcc
