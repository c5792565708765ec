#include "runtime/kvcc_runtime.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "formats/error.h"
#include "formats/kv_codec.h"
#include "formats/method.h"
#include "runtime/append_ref.h"
#include "runtime/compact_ref.h"
#include "runtime/attention_ref.h"
#include "runtime/served.h"

#if defined(KVCC_HAVE_CUDA)
#include <cuda_runtime.h>

#include "runtime/cuda_util.cuh"
#include "runtime/device_buffer.h"
#include "runtime/compact.h"
#include "runtime/kv_kernels.h"
#endif

namespace kvcc {

namespace {
std::string mismatch(const char* what, int artifact, int engine) {
  return std::string("artifact does not match the model: ") + what + " " + std::to_string(artifact) +
         " in the artifact, " + std::to_string(engine) + " in the engine";
}
}  // namespace

KvGeometry cache_geometry(const Artifact& a) {
  KvGeometry g;
  g.n_layers = a.n_layers;
  g.n_kv_heads = a.n_kv_heads;
  g.head_dim = a.head_dim;
  g.page_tokens = a.recipe.page_size;
  g.sink = a.recipe.sink;
  g.recent = a.recipe.recent;
  g.group = a.recipe.group > 0 ? a.recipe.group : a.head_dim;
  if (method_traits(method_of(a.recipe)).codec != CodecFamily::KiviChannel) return g;
  // KIVI (formats/kv_codec.h): group = key tokens per channel group, never longer than the page;
  // values per token over min(group, head_dim) channels, or head_dim for the mixed recipe.
  const int G = a.recipe.group, d = a.head_dim;
  g.key_group_tokens = G > 0 ? std::min(G, a.recipe.page_size) : a.recipe.page_size;
  g.group = a.recipe.params.count("values") || G <= 0 || G >= d ? d : G;
  g.key_pair_bytes = e5m3_key_pairs(a.recipe) ? 2 : 4;
  return g;
}

std::vector<BlockWidths> cache_widths(const Artifact& a) {
  std::vector<BlockWidths> w;
  for (const HeadArtifact& h : a.heads)
    w.push_back(
        BlockWidths{side_code_bits(a.recipe, h.key, KvSide::Key), side_code_bits(a.recipe, h.value, KvSide::Value)});
  return w;
}

void check_artifact_for_engine(const Artifact& a, const EngineShape& e) {
  KVCC_REQUIRE(a.n_layers == e.n_layers, mismatch("layer count", a.n_layers, e.n_layers));
  KVCC_REQUIRE(a.n_heads == e.n_heads, mismatch("query heads", a.n_heads, e.n_heads));
  KVCC_REQUIRE(a.n_kv_heads == e.n_kv_heads, mismatch("KV heads", a.n_kv_heads, e.n_kv_heads));
  KVCC_REQUIRE(a.head_dim == e.head_dim, mismatch("head_dim", a.head_dim, e.head_dim));
  KVCC_REQUIRE(a.heads.size() == size_t(a.n_layers) * size_t(a.n_kv_heads),
               "artifact: expected " + std::to_string(a.n_layers * a.n_kv_heads) + " (layer, KV head) entries, found " +
                   std::to_string(a.heads.size()));
  KVCC_REQUIRE(served_by_runtime(a.recipe.method),
               "artifact: method '" + a.recipe.method + "' is not served by the INT2 paged runtime (it serves " +
                   method_names([](const MethodTraits& t) { return t.served_by_runtime; }, ", ", ", ") + ")");
  // Code widths: the pages hold 1 to 4 bits a code (kv_layout.h), a level table 2.
  for (size_t i = 0; i < a.heads.size(); ++i)
    for (const KvSide which : {KvSide::Key, KvSide::Value}) {
      const SideArtifact& s = which == KvSide::Key ? a.heads[i].key : a.heads[i].value;
      const int bits = side_code_bits(a.recipe, s, which);
      const std::string where = "artifact: layer " + std::to_string(i / size_t(a.n_kv_heads)) + " KV head " +
                                std::to_string(i % size_t(a.n_kv_heads)) +
                                (which == KvSide::Key ? " keys" : " values") + " at " + std::to_string(bits) + " bits";
      KVCC_REQUIRE(bits >= 1 && bits <= 4,
                   where + ": the runtime's pages hold 1 to 4 bits a code (validate it with --cache codec)");
      KVCC_REQUIRE(s.levels.empty() || bits == 2, where + " with a 4-level table: a table codes 2 bits");
    }
  const bool kivi = method_traits(method_of(a.recipe)).codec == CodecFamily::KiviChannel;
  if (kivi) {
    // Per-channel key pages hold whole key groups (kv_layout.h key_group_tokens).
    const KvGeometry g = cache_geometry(a);
    KVCC_REQUIRE(a.recipe.page_size % g.key_group_tokens == 0,
                 "artifact: kivi key groups of " + std::to_string(a.recipe.group) +
                     " tokens do not divide the page of " + std::to_string(a.recipe.page_size) +
                     " tokens; the paged runtime stores whole key groups per page (use --group dividing --page-size)");
    KVCC_REQUIRE(a.head_dim % g.group == 0, "artifact: kivi value groups of " + std::to_string(g.group) +
                                                " channels do not divide head_dim " + std::to_string(a.head_dim));
  }
  // The paged cache stores (scale, zero) per KV-head row; a group spanning heads has no slot there
  // (kivi's group counts key tokens).
  KVCC_REQUIRE(kivi || a.recipe.group <= a.head_dim,
               "artifact: group " + std::to_string(a.recipe.group) + " spans several KV heads (head_dim " +
                   std::to_string(a.head_dim) +
                   "); the paged runtime stores quantiser parameters per KV head, "
                   "so it serves --group <= head_dim only (spanning groups are evaluated by kvcc report / validate)");
  const size_t dd = size_t(a.head_dim) * size_t(a.head_dim);
  for (const HeadArtifact& h : a.heads)
    for (const SideArtifact* s : {&h.key, &h.value}) {
      KVCC_REQUIRE(s->rotation.empty() || s->rotation.size() == dd, "artifact: a rotation is not head_dim x head_dim");
      KVCC_REQUIRE(s->levels.empty() || s->levels.size() == 4, "artifact: a level table does not have 4 levels");
    }
}

#if defined(KVCC_HAVE_CUDA)
struct Runtime::DeviceState {
  DeviceBuffer<float> rot_k;    // [layers, n_kv, d, d]; empty: no rotation
  DeviceBuffer<float> rot_v_t;  // R_vᵀ
  // [layers, n_kv]: R_k and R_v as the append and prefill store keys and values (rot_fragments)
  DeviceBuffer<RotFragments> fixed_k, fixed_v;
  DeviceBuffer<HeadCodec> codecs;  // [layers, n_kv], uploaded once
  DeviceBuffer<int32_t> batch;     // prefill's page table, and a decode batch outside a step
  DeviceBuffer<uint8_t> step;      // the step's plan: append moves | window writes | decode batch
  DeviceBuffer<uint8_t> ws;        // the step's decode workspace (stream order)
  DeviceBuffer<uint8_t> other_ws;  // prefill, decode outside the step, compaction: never the step's buffers
  // Maxima declared: `step` and `ws` are sized at load for `cap` and never reallocated (a captured
  // graph holds their addresses), and decode's split plan is the one for cap.hist_pages.
  bool fixed = false;
  StepCapacity cap;
  std::vector<uint8_t> packed;  // host image of the step's tables (reused: no allocation per step)
  // The step planned by begin_append (valid until the next one): its sequences, the append plan
  // and the decode batch of those sequences, all in `step`.
  std::vector<int> step_seqs;
  std::vector<int32_t> step_page_offsets;  // [step_seqs]: each one's page table in decode.page_table
  uint64_t step_version = 0;               // the cache's version the plan was made at
  DeviceAppendPlan append;
  DeviceBatch decode;
  // One stream per Runtime is the contract; a call on another stream than the step's waits for
  // the step's upload (`uploaded`), and the next upload waits for that call (`used`).
  cudaStream_t step_stream = nullptr;
  cudaEvent_t uploaded = nullptr, used = nullptr;
  bool used_elsewhere = false;
  DeviceState() = default;
  ~DeviceState() {
    if (uploaded) cudaEventDestroy(uploaded);
    if (used) cudaEventDestroy(used);
  }
  // The events, made at the first step (a host pool's Runtime never touches the device).
  void make_events() {
    if (uploaded) return;
    check_cuda(cudaEventCreateWithFlags(&uploaded, cudaEventDisableTiming), "runtime: event");
    check_cuda(cudaEventCreateWithFlags(&used, cudaEventDisableTiming), "runtime: event");
  }
  DeviceState(const DeviceState&) = delete;
  DeviceState& operator=(const DeviceState&) = delete;
  // Before a launch of the step's plan on `s`: wait for the upload when s is another stream.
  void before_use(cudaStream_t s) {
    if (s != step_stream) check_cuda(cudaStreamWaitEvent(s, uploaded, 0), "runtime: stream wait");
  }
  // After it: let the next step's upload wait for this stream.
  void after_use(cudaStream_t s) {
    if (s == step_stream) return;
    check_cuda(cudaEventRecord(used, s), "runtime: event record");
    used_elsewhere = true;
  }
  // r from element off on (a layer's rotations), or null when the artifact has none.
  template <typename T>
  static const T* at(const DeviceBuffer<T>& r, size_t off) {
    return r.empty() ? nullptr : r.data() + off;
  }
  void upload_fixed(const AppendMoves& m, const std::vector<int32_t>& ints, int n_seqs, cudaStream_t stream);
  // Copies host ints (batch arrays, page tables) into `batch`, in stream order; returns it.
  int32_t* upload_batch(const std::vector<int32_t>& host, cudaStream_t s) {
    if (host.empty()) return batch.data();
    if (host.size() > batch.size()) batch.reserve(host.size() * 2);
    batch.upload(host.data(), host.size(), s);
    return batch.data();
  }
};

namespace {
// A decode batch's int arrays for `seqs` at their current lengths: seq_slot | seq_len |
// page_offset | page tables (offsets relative to the tables' start); max_pages is set.
std::vector<int32_t> decode_batch_ints(const KvCache& cache, const std::vector<int>& seqs, int& max_pages) {
  const size_t n = seqs.size();
  std::vector<int32_t> host(3 * n);
  max_pages = 0;
  for (size_t i = 0; i < n; ++i) {
    const auto& pt = cache.page_table(seqs[i]);
    host[i] = seqs[i];
    host[n + i] = int32_t(cache.length(seqs[i]));
    host[2 * n + i] = int32_t(host.size() - 3 * n);
    host.insert(host.end(), pt.begin(), pt.end());
    max_pages = std::max(max_pages, int(pt.size()));
  }
  return host;
}

DeviceBatch device_batch(const int32_t* ints, int n, int max_pages) {
  DeviceBatch db;
  db.batch = n;
  db.seq_slot = ints;
  db.seq_len = ints + n;
  db.page_offset = ints + 2 * n;
  db.page_table = ints + 3 * n;
  db.max_pages = max_pages;
  return db;
}
}  // namespace
#else
struct Runtime::DeviceState {};
#endif

std::string device_scope_problem(const KvGeometry& g) {
  return gpu_unsupported_reason(g, kAnyQueryHeads, kGpuAppend | kGpuPrefill);
}
std::string device_scope_problem(const KvGeometry& g, int n_heads, const std::vector<BlockWidths>& widths) {
  const std::string mixed = PageLayout(g, widths).kernel_problem();
  return mixed.empty() ? gpu_unsupported_reason(g, n_heads, kGpuAllOps) : mixed;
}

KvHeadRange kv_head_slice(int n_kv_heads, int rank, int ranks) {
  KVCC_REQUIRE(n_kv_heads > 0, "tensor parallel: KV heads must be positive, got " + std::to_string(n_kv_heads));
  KVCC_REQUIRE(ranks > 0, "tensor parallel: rank count must be positive, got " + std::to_string(ranks));
  KVCC_REQUIRE(n_kv_heads % ranks == 0, "tensor parallel: " + std::to_string(ranks) + " ranks do not divide " +
                                            std::to_string(n_kv_heads) + " KV heads into equal slices");
  KVCC_REQUIRE(rank >= 0 && rank < ranks,
               "tensor parallel: rank " + std::to_string(rank) + " out of range [0, " + std::to_string(ranks) + ")");
  const int per = n_kv_heads / ranks;
  return KvHeadRange{rank * per, (rank + 1) * per};
}

Runtime::Runtime(const Artifact& a, const EngineShape& e, const RuntimeOptions& o) : engine_(e), options_(o) {
  check_artifact_for_engine(a, e);
  const bool whole = o.kv_begin == 0 && (o.kv_end == 0 || o.kv_end == e.n_kv_heads);
  const int kv_end = o.kv_end == 0 ? e.n_kv_heads : o.kv_end;
  KVCC_REQUIRE(o.kv_end != 0 || o.kv_begin == 0,
               "runtime: kv_begin " + std::to_string(o.kv_begin) + " without kv_end (kv_end = 0 means all KV heads)");
  KVCC_REQUIRE(o.kv_begin >= 0 && o.kv_begin < kv_end && kv_end <= e.n_kv_heads,
               "runtime: KV-head slice [" + std::to_string(o.kv_begin) + ", " + std::to_string(kv_end) +
                   ") is not a non-empty range inside the model's " + std::to_string(e.n_kv_heads) + " KV heads");
  KVCC_REQUIRE(whole || e.n_heads % e.n_kv_heads == 0,
               "runtime: a KV-head slice needs query heads (" + std::to_string(e.n_heads) +
                   ") to be a multiple of KV heads (" + std::to_string(e.n_kv_heads) + ")");
  KVCC_REQUIRE(o.max_batch >= 0 && o.max_context >= 0 && o.max_step_tokens >= 0,
               "runtime: max_batch, max_context and max_step_tokens must not be negative");
  KVCC_REQUIRE(o.max_context > 0 || (o.max_batch == 0 && o.max_step_tokens == 0),
               "runtime: max_batch or max_step_tokens given without max_context (max_context > 0 declares the "
               "maxima)");
  KVCC_REQUIRE(o.max_batch <= o.max_sequences, "runtime: max_batch " + std::to_string(o.max_batch) +
                                                   " above max_sequences " + std::to_string(o.max_sequences));
  KVCC_REQUIRE(!o.engine_tables || o.max_context > 0,
               "runtime: engine_tables needs the maxima declared (max_context > 0): the step tables are sized from "
               "them");
  KVCC_REQUIRE(o.activations == Activations::Float32 || o.activations == Activations::BFloat16,
               "runtime: activations must be float32 (0) or bfloat16 (1), got " + std::to_string(int(o.activations)));
  kv_begin_ = o.kv_begin;
  n_heads_ = whole ? e.n_heads : e.n_heads / e.n_kv_heads * (kv_end - o.kv_begin);
  KvGeometry g = cache_geometry(a);
  g.n_kv_heads = kv_end - o.kv_begin;
  std::vector<BlockWidths> widths;  // the slice's (layer, KV head) blocks
  {
    const std::vector<BlockWidths> all = cache_widths(a);
    for (size_t i = 0; i < all.size(); ++i)
      if (int(i % size_t(a.n_kv_heads)) >= o.kv_begin && int(i % size_t(a.n_kv_heads)) < kv_end)
        widths.push_back(all[i]);
  }
  if (o.memory == PoolMemory::Device) {
    // Everything the device pool's append, decode and prefill will check, checked now.
    bool table = false;  // some head of the slice has a level table
    for (size_t i = 0; i < a.heads.size(); ++i) {
      const HeadArtifact& h = a.heads[i];
      const int kv = int(i % size_t(a.n_kv_heads));
      if (kv >= o.kv_begin && kv < kv_end) table = table || !h.key.levels.empty() || !h.value.levels.empty();
    }
    std::string scope = PageLayout(g, widths).kernel_problem();
    if (scope.empty()) scope = gpu_unsupported_reason(g, n_heads_, kGpuAllOps, table);
    KVCC_REQUIRE(scope.empty(), "runtime: the device pool's kernels cannot serve " + scope + "; use a host pool");
    KVCC_REQUIRE(o.sm_scale >= 0.0f,
                 "runtime: the device pool's kernels need a positive sm_scale (0: 1/sqrt(head_dim))");
#if defined(KVCC_HAVE_CUDA)
    require_hopper();
#endif
  }
  cache_ = std::make_unique<KvCache>(KvCacheConfig{g, o.max_pages, o.max_sequences, o.memory, widths, o.engine_tables});
  if (o.memory == PoolMemory::Device)
    for (int l = 0; l < g.n_layers; ++l) blocks_.push_back(cache_->layout().layer_blocks(l));
  StepCapacity cap;
  if (o.max_context > 0) {
    limits_.max_batch = o.max_batch > 0 ? o.max_batch : o.max_sequences;
    limits_.max_context = o.max_context;
    limits_.max_step_tokens = o.max_step_tokens > 0 ? o.max_step_tokens : limits_.max_batch;
    cap = step_capacity(g, limits_);  // checks the limits
    KVCC_REQUIRE(!o.engine_tables || limits_.max_batch <= kEngineMaxBatch,
                 "runtime: engine_tables serves steps of at most " + std::to_string(kEngineMaxBatch) +
                     " sequences; max_batch is " + std::to_string(limits_.max_batch));
  }
  if (options_.sm_scale == 0.0f) options_.sm_scale = 1.0f / std::sqrt(float(a.head_dim));
  const size_t dd = size_t(a.head_dim) * size_t(a.head_dim);
  // Over the whole model, so that a slice rotates (or not) exactly as the whole-model Runtime does.
  const bool kivi = g.per_channel_keys();
  const bool unclipped[2] = {kivi, kivi && !a.recipe.params.count("values")};
  bool any_rotation = false;
  for (const HeadArtifact& h : a.heads)
    any_rotation = any_rotation || !h.key.rotation.empty() || !h.value.rotation.empty();
  for (size_t i = 0; i < a.heads.size(); ++i) {
    const int kv = int(i % size_t(a.n_kv_heads));
    if (kv < kv_begin_ || kv >= kv_end) continue;  // another rank's head
    const HeadArtifact& h = a.heads[i];
    HeadCodec c;
    for (int side = 0; side < 2; ++side) {
      const SideArtifact& s = side ? h.value : h.key;
      SideCodec& sc = side ? c.value : c.key;
      // KIVI's keys, and its plain values, are never clipped (formats/kv_codec.h); the mixed
      // recipe's values take their stored clip ratio.
      sc.clip_ratio = unclipped[side] ? 1.0f : float(s.clip_ratio);
      sc.use_table = s.levels.empty() ? 0 : 1;
      for (size_t i = 0; i < s.levels.size(); ++i) sc.levels[i] = float(s.levels[i]);
      if (any_rotation) {
        std::vector<float>& dst = side ? rot_v_ : rot_k_;
        for (size_t i = 0; i < dd; ++i)
          dst.push_back(s.rotation.empty() ? (i / size_t(a.head_dim) == i % size_t(a.head_dim) ? 1.0f : 0.0f)
                                           : float(s.rotation[i]));
      }
    }
    codecs_.push_back(c);
  }
  dev_ = std::make_unique<DeviceState>();
#if defined(KVCC_HAVE_CUDA)
  if (o.memory == PoolMemory::Device && any_rotation) {
    std::vector<float> rvt(rot_v_.size());
    const size_t d = size_t(a.head_dim);
    for (size_t m = 0; m < rot_v_.size() / dd; ++m)
      for (size_t i = 0; i < d; ++i)
        for (size_t j = 0; j < d; ++j) rvt[m * dd + j * d + i] = rot_v_[m * dd + i * d + j];
    dev_->rot_k = DeviceBuffer<float>(rot_k_);
    dev_->rot_v_t = DeviceBuffer<float>(rvt);
    const DeviceBuffer<float> rot_v(rot_v_);
    dev_->fixed_k = DeviceBuffer<RotFragments>(rot_k_.size() / dd);
    dev_->fixed_v = DeviceBuffer<RotFragments>(rot_v_.size() / dd);
    rot_fragments(dev_->rot_k.data(), int64_t(dev_->fixed_k.size()), dev_->fixed_k.data(), nullptr);
    rot_fragments(rot_v.data(), int64_t(dev_->fixed_v.size()), dev_->fixed_v.data(), nullptr);
    check_cuda(cudaDeviceSynchronize(), "runtime: the rotations' fixed-point fragments");  // (before rot_v is freed)
  }
  if (o.memory == PoolMemory::Device) dev_->codecs = DeviceBuffer<HeadCodec>(codecs_);
  if (o.memory == PoolMemory::Device && limits_.max_context > 0) {
    // Everything a step within the maxima needs, now: the tables, and a workspace for the largest
    // decode of any batch size up to max_batch (the split plan, hence the workspace, depends on
    // the batch).
    DeviceState& d = *dev_;
    d.fixed = true;
    d.cap = cap;
    d.step = DeviceBuffer<uint8_t>(cap.bytes);
    d.packed.assign(cap.bytes, 0);
    size_t ws = 0;
    for (int b = 1; b <= limits_.max_batch; ++b)
      ws = std::max(ws, decode_workspace_bytes(g, b, n_heads_, int(cap.hist_pages)));
    d.ws = DeviceBuffer<uint8_t>(ws);
  }
#else
  (void)cap;
#endif
}

Runtime::~Runtime() = default;

std::unique_ptr<Runtime> Runtime::load(const std::string& path, const EngineShape& e, const RuntimeOptions& o) {
  return std::make_unique<Runtime>(read_artifact(path), e, o);
}

const float* Runtime::rot_k(int layer) const {
  return rot_k_.empty()
             ? nullptr
             : rot_k_.data() + size_t(layer) * geometry().n_kv_heads * geometry().head_dim * geometry().head_dim;
}
const float* Runtime::rot_v(int layer) const {
  return rot_v_.empty()
             ? nullptr
             : rot_v_.data() + size_t(layer) * geometry().n_kv_heads * geometry().head_dim * geometry().head_dim;
}

void Runtime::begin_append(const std::vector<int>& seqs, const std::vector<int>& counts, void* stream) {
  KVCC_REQUIRE(!options_.engine_tables,
               "runtime: begin_append uses the Runtime's own page tables; with engine_tables open steps by begin_step");
  KVCC_REQUIRE(seqs.size() == counts.size(), "runtime: one count per sequence");
  std::vector<int64_t> old, add;
  int64_t tokens = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    KVCC_REQUIRE(counts[i] >= 0, "runtime: negative token count for sequence " + std::to_string(seqs[i]));
    old.push_back(cache_->length(seqs[i]));
    add.push_back(counts[i]);
    tokens += counts[i];
  }
  if (limits_.max_context > 0) {
    // Before the cache grows: a refused step changes nothing.
    KVCC_REQUIRE(int64_t(seqs.size()) <= limits_.max_batch, "runtime: a step of " + std::to_string(seqs.size()) +
                                                                " sequences, above the declared max_batch " +
                                                                std::to_string(limits_.max_batch));
    KVCC_REQUIRE(tokens <= limits_.max_step_tokens, "runtime: a step of " + std::to_string(tokens) +
                                                        " new tokens, above the declared max_step_tokens " +
                                                        std::to_string(limits_.max_step_tokens));
    for (size_t i = 0; i < seqs.size(); ++i)
      KVCC_REQUIRE(old[i] + counts[i] <= limits_.max_context, "runtime: sequence " + std::to_string(seqs[i]) +
                                                                  " would hold " + std::to_string(old[i] + counts[i]) +
                                                                  " tokens, above the declared max_context " +
                                                                  std::to_string(limits_.max_context));
  }
  cache_->grow_batch(seqs, add);
  pending_seqs_ = seqs;
  pending_counts_ = counts;
  pending_old_ = old;
  appended_.assign(size_t(geometry().n_layers), 0);
  step_from_engine_ = false;
#if defined(KVCC_HAVE_CUDA)
  if (cache_->memory() == PoolMemory::Device) plan_step(stream);
#endif
}

void Runtime::begin_step(const EngineStep& s, void* stream) {
  KVCC_REQUIRE(options_.engine_tables,
               "runtime: begin_step needs RuntimeOptions::engine_tables (the engine's page "
               "tables); this Runtime keeps its own: use begin_append");
  KVCC_REQUIRE(s.batch >= 0 && s.batch <= limits_.max_batch,
               "runtime: a step of " + std::to_string(s.batch) +
                   " sequences, outside [0, max_batch = " + std::to_string(limits_.max_batch) + "]");
  KVCC_REQUIRE(s.stride >= history_pages(limits_.max_context),
               "runtime: block table rows of " + std::to_string(s.stride) + " pages, fewer than the " +
                   std::to_string(history_pages(limits_.max_context)) + " a sequence of max_context tokens holds");
  KVCC_REQUIRE(s.rows >= 0 && s.rows <= limits_.max_step_tokens,
               "runtime: a step of " + std::to_string(s.rows) +
                   " k / v rows, outside [0, max_step_tokens = " + std::to_string(limits_.max_step_tokens) + "]");
  // The step's new tokens are bounded by the rows the caller's tensors hold.
  const int64_t step_rows = s.rows > 0 ? s.rows : limits_.max_step_tokens;
  KVCC_REQUIRE(s.batch == 0 || (s.slots && s.lengths && s.counts && s.block_table),
               "runtime: begin_step with a null table (slots, lengths, counts and block_table are all needed)");
  const KvGeometry& g = geometry();
  if (cache_->memory() == PoolMemory::Host) {
    // The device planner's rules, as errors, before anything changes.
    int64_t tokens = 0;
    std::vector<char> seen(size_t(options_.max_sequences), 0);
    for (int i = 0; i < s.batch; ++i) {
      const int32_t p =
          engine_seq_problem(g, limits_.max_context, options_.max_sequences, options_.max_pages, s.slots[i],
                             s.lengths[i], s.counts[i], s.block_table + int64_t(i) * s.stride);
      KVCC_REQUIRE(p == kStepOk, "runtime: " + engine_step_message(p, i));
      KVCC_REQUIRE(!seen[size_t(s.slots[i])], "runtime: engine step: window slot " + std::to_string(s.slots[i]) +
                                                  " given to two sequences of the step");
      seen[size_t(s.slots[i])] = 1;
      tokens += s.counts[i];
    }
    KVCC_REQUIRE(tokens <= step_rows, "runtime: " + engine_step_message(kStepTooManyTokens, s.batch));
    pending_seqs_.assign(s.slots, s.slots + s.batch);
    pending_counts_.assign(s.counts, s.counts + s.batch);
    pending_old_.assign(s.lengths, s.lengths + s.batch);
    for (int i = 0; i < s.batch; ++i) {
      const int64_t n1 = int64_t(s.lengths[i]) + s.counts[i];
      cache_->mirror_sequence(s.slots[i], n1, s.block_table + int64_t(i) * s.stride, history_pages(n1));
    }
  } else {
#if defined(KVCC_HAVE_CUDA)
    const cudaStream_t st = static_cast<cudaStream_t>(stream);
    DeviceState& d = *dev_;
    d.make_events();
    if (d.used_elsewhere) check_cuda(cudaStreamWaitEvent(st, d.used, 0), "runtime: stream wait");
    d.used_elsewhere = false;
    plan_engine_step(g, s, d.cap, limits_, options_.max_sequences, options_.max_pages, d.step.data(), st);
    // Inside a capture the step lives in the graph: calls on other streams are not ordered by it.
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    check_cuda(cudaStreamIsCapturing(st, &capturing), "runtime: capture status");
    if (capturing == cudaStreamCaptureStatusNone) check_cuda(cudaEventRecord(d.uploaded, st), "runtime: event record");
    d.step_stream = st;
    d.step_seqs.clear();
    d.step_version = cache_->version();
    uint8_t* base = d.step.data();
    d.append.moves = nullptr;
    d.append.writes = nullptr;
    d.append.n_moves = int(d.cap.moves);
    d.append.n_writes = int(d.cap.writes);
    d.append.counts = reinterpret_cast<const int32_t*>(base + d.cap.counts_at);
    d.decode = device_batch(reinterpret_cast<const int32_t*>(base + d.cap.ints_at), s.batch, int(d.cap.hist_pages));
    d.decode.page_table = s.block_table;
    pending_seqs_.assign(size_t(s.batch), -1);  // the slots live on the device
    pending_counts_.clear();
    pending_old_.clear();
#else
    (void)stream;
    throw Error("runtime: built without CUDA");
#endif
  }
  appended_.assign(size_t(g.n_layers), 0);
  step_from_engine_ = true;
}

std::string Runtime::step_problem(void* stream) {
  if (!step_from_engine_ || cache_->memory() == PoolMemory::Host) return "";
#if defined(KVCC_HAVE_CUDA)
  int32_t h[2] = {0, -1};
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  check_cuda(cudaMemcpyAsync(h, dev_->step.data() + dev_->cap.counts_at + 4 * sizeof(int32_t), sizeof(h),
                             cudaMemcpyDeviceToHost, st),
             "runtime: step header");
  check_cuda(cudaStreamSynchronize(st), "runtime: step header");
  return engine_step_message(h[0], h[1]);
#else
  (void)stream;
  return "";
#endif
}

#if defined(KVCC_HAVE_CUDA)
// Maxima declared: the step's tables into `step` (header | decode ints at a fixed place | moves |
// writes, packed: step_packing), the device plans pointing there with capacities for the grids,
// so that every step's append and decode launches are the same. One copy of what the step has.
void Runtime::DeviceState::upload_fixed(const AppendMoves& m, const std::vector<int32_t>& ints, int n_seqs,
                                        cudaStream_t stream) {
  DeviceState& d = *this;
  const StepCapacity& c = d.cap;
  KVCC_REQUIRE(int64_t(m.moves.size()) <= c.moves && int64_t(m.writes.size()) <= c.writes && m.rows <= c.rows &&
                   int64_t(ints.size()) <= c.ints,
               "runtime: a step's tables above their capacities (a bug: begin_append checks the maxima)");
  const StepPacking at = step_packing(c, int64_t(ints.size()), int64_t(m.moves.size()), int64_t(m.writes.size()));
  const int32_t header[kStepHeaderInts] = {int32_t(m.moves.size()),
                                           int32_t(m.writes.size()),
                                           int32_t(at.moves_at - c.counts_at),
                                           int32_t(at.writes_at - c.counts_at),
                                           kStepOk,
                                           -1,
                                           0,
                                           0};
  uint8_t* h = d.packed.data();
  std::memcpy(h + c.counts_at, header, sizeof(header));
  std::memcpy(h + c.ints_at, ints.data(), ints.size() * sizeof(int32_t));
  std::memcpy(h + at.moves_at, m.moves.data(), m.moves.size() * sizeof(AppendMove));
  std::memcpy(h + at.writes_at, m.writes.data(), m.writes.size() * sizeof(AppendWindowWrite));
  // Pageable memory, as the undeclared path: staged before the call returns, so `packed` is free
  // for the next step at once.
  check_cuda(cudaMemcpyAsync(d.step.data(), h, at.bytes, cudaMemcpyHostToDevice, stream), "runtime: step upload");
  uint8_t* base = d.step.data();
  d.append.moves = nullptr;  // at the header's offsets
  d.append.writes = nullptr;
  d.append.n_moves = int(c.moves);
  d.append.n_writes = int(c.writes);
  d.append.counts = reinterpret_cast<const int32_t*>(base + c.counts_at);
  d.append.counts_after_wait = false;
  d.decode = device_batch(reinterpret_cast<const int32_t*>(base + c.ints_at), n_seqs, int(c.hist_pages));
}

// The step's plan, once for all layers: the append moves and window writes (plan_append_moves)
// and the decode batch of the step's sequences at their new lengths, uploaded in one copy; the
// workspace sized for the step's append and decode. Layers then only launch kernels.
void Runtime::plan_step(void* stream_ptr) {
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const KvGeometry& g = geometry();
  const AppendBatch b = make_append_batch(pending_seqs_, pending_old_, pending_counts_);
  AppendPlanHost host_plan{pending_seqs_, pending_old_, pending_counts_, b.row_offsets, {}};
  for (int seq : pending_seqs_) host_plan.page_tables.push_back(cache_->page_table(seq));
  const AppendMoves m = plan_append_moves(g, host_plan);
  int max_pages = 0;
  const std::vector<int32_t> ints = decode_batch_ints(*cache_, pending_seqs_, max_pages);
  DeviceState& d = *dev_;
  d.step_page_offsets.assign(ints.begin() + 2 * pending_seqs_.size(), ints.begin() + 3 * pending_seqs_.size());
  d.make_events();
  if (d.used_elsewhere) check_cuda(cudaStreamWaitEvent(stream, d.used, 0), "runtime: stream wait");
  d.used_elsewhere = false;
  if (d.fixed) {
    d.upload_fixed(m, ints, int(pending_seqs_.size()), stream);
    check_cuda(cudaEventRecord(d.uploaded, stream), "runtime: event record");
    d.step_stream = stream;
    d.step_seqs = pending_seqs_;
    d.step_version = cache_->version();
    return;
  }
  const size_t moves_at = 0, writes_at = align256(m.moves.size() * sizeof(AppendMove)),
               ints_at = writes_at + align256(m.writes.size() * sizeof(AppendWindowWrite)),
               bytes = ints_at + ints.size() * sizeof(int32_t);
  std::vector<uint8_t> packed(bytes);
  std::memcpy(packed.data() + moves_at, m.moves.data(), m.moves.size() * sizeof(AppendMove));
  std::memcpy(packed.data() + writes_at, m.writes.data(), m.writes.size() * sizeof(AppendWindowWrite));
  std::memcpy(packed.data() + ints_at, ints.data(), ints.size() * sizeof(int32_t));
  d.step.reserve(bytes);  // grows only here, between steps
  d.step.upload(packed.data(), bytes, stream);
  check_cuda(cudaEventRecord(d.uploaded, stream), "runtime: event record");
  d.step_stream = stream;
  d.step_seqs = pending_seqs_;
  d.step_version = cache_->version();
  d.append.moves = reinterpret_cast<const AppendMove*>(d.step.data() + moves_at);
  d.append.writes = reinterpret_cast<const AppendWindowWrite*>(d.step.data() + writes_at);
  d.append.n_moves = int(m.moves.size());
  d.append.n_writes = int(m.writes.size());
  d.append.counts = nullptr;
  d.append.counts_after_wait = false;
  d.decode =
      device_batch(reinterpret_cast<const int32_t*>(d.step.data() + ints_at), int(pending_seqs_.size()), max_pages);
  d.ws.reserve(decode_workspace_bytes(g, int(pending_seqs_.size()), n_heads_, max_pages));
}
#endif

const float* Runtime::host_input(int i, const void* p, size_t n) {
  if (options_.activations == Activations::Float32) return static_cast<const float*>(p);
  widen_activations(p, n, options_.activations, host_x_[i]);
  return host_x_[i].data();
}

void Runtime::append(int layer, const void* k, const void* v, void* stream) {
  const KvGeometry& g = geometry();
  KVCC_REQUIRE(layer >= 0 && layer < g.n_layers, "runtime: layer " + std::to_string(layer) + " out of range");
  // Once every layer has appended, the step is over: another append would replay its moves over
  // the windows it already rewrote (a refused begin_append leaves the last step's plan in place).
  KVCC_REQUIRE(std::find(appended_.begin(), appended_.end(), 0) != appended_.end(),
               "runtime: append without an open step (every layer of the last step has appended; open the next "
               "with begin_append or begin_step)");
  appended_[size_t(layer)] = 1;  // prefill must not read this layer's step any more
  if (cache_->memory() == PoolMemory::Host) {
    int64_t rows = 0;
    for (int c : pending_counts_) rows += c;
    const size_t n = size_t(rows) * size_t(g.n_kv_heads) * size_t(g.head_dim);
    append_ref(*cache_, layer, make_append_batch(pending_seqs_, pending_old_, pending_counts_), host_input(0, k, n),
               host_input(1, v, n), rot_k(layer), rot_v(layer), codecs(layer));
    return;
  }
#if defined(KVCC_HAVE_CUDA)
  const size_t heads = size_t(layer) * g.n_kv_heads;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  dev_->before_use(s);
  DeviceAppendPlan plan = dev_->append;
  // The first append after begin_step follows its planning kernel: read the counts after the wait.
  plan.counts_after_wait = step_from_engine_ && std::count(appended_.begin(), appended_.end(), 1) == 1;
  append_kv_planned(g, cache_->pages_base(), cache_->windows_base(), layer, plan,
                    dev_->codecs.data() + size_t(layer) * g.n_kv_heads, k, v, DeviceState::at(dev_->fixed_k, heads),
                    DeviceState::at(dev_->fixed_v, heads), s, options_.activations, &blocks_[size_t(layer)]);
  dev_->after_use(s);
#else
  throw Error("runtime: built without CUDA");
#endif
}

void Runtime::decode_step(int layer, const void* q, void* out, void* stream) {
  KVCC_REQUIRE(!appended_.empty(), "runtime: decode of the step's sequences without an open step");
  if (!step_from_engine_ || cache_->memory() == PoolMemory::Host) {
    const std::vector<int> seqs = pending_seqs_;
    step_from_engine_ ? decode_sequences(layer, seqs, q, out, stream) : decode(layer, seqs, q, out, stream);
    return;
  }
#if defined(KVCC_HAVE_CUDA)
  const KvGeometry& g = geometry();
  KVCC_REQUIRE(layer >= 0 && layer < g.n_layers, "runtime: layer " + std::to_string(layer) + " out of range");
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  dev_->before_use(s);
  const DecodeShape shape{n_heads_, options_.sm_scale, 0};
  const size_t off = size_t(layer) * g.n_kv_heads * g.head_dim * g.head_dim;
  decode_int2(g, cache_->pages_base(), cache_->windows_base(), layer, dev_->decode, codecs(layer), shape, q,
              DeviceState::at(dev_->rot_k, off), DeviceState::at(dev_->rot_v_t, off), out, dev_->ws.data(),
              dev_->ws.bytes(), s, options_.activations, &blocks_[size_t(layer)]);
  dev_->after_use(s);
#else
  (void)q, (void)out, (void)stream;
  throw Error("runtime: built without CUDA");
#endif
}

void Runtime::decode(int layer, const std::vector<int>& seqs, const void* q, void* out, void* stream) {
  KVCC_REQUIRE(!options_.engine_tables,
               "runtime: with engine_tables decode the step's sequences by decode_step(layer, q, out, stream)");
  decode_sequences(layer, seqs, q, out, stream);
}

void Runtime::decode_sequences(int layer, const std::vector<int>& seqs, const void* q, void* out, void* stream) {
  const KvGeometry& g = geometry();
  KVCC_REQUIRE(layer >= 0 && layer < g.n_layers, "runtime: layer " + std::to_string(layer) + " out of range");
  if (cache_->memory() == PoolMemory::Host) {
    const size_t n = seqs.size() * size_t(n_heads_) * size_t(g.head_dim);
    if (options_.activations == Activations::Float32) {
      decode_ref(*cache_, layer, seqs, static_cast<const float*>(q), n_heads_, rot_k(layer), rot_v(layer),
                 codecs(layer), options_.sm_scale, static_cast<float*>(out));
      return;
    }
    host_out_.resize(n);
    decode_ref(*cache_, layer, seqs, host_input(0, q, n), n_heads_, rot_k(layer), rot_v(layer), codecs(layer),
               options_.sm_scale, host_out_.data());
    store_activations(host_out_.data(), n, options_.activations, out);
    return;
  }
#if defined(KVCC_HAVE_CUDA)
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  DeviceBatch db;
  const bool planned = seqs == dev_->step_seqs && cache_->version() == dev_->step_version;
  if (planned) {
    db = dev_->decode;  // planned with the step: no host work, no copy
    dev_->before_use(s);
  } else {
    int max_pages = 0;
    const std::vector<int32_t> host = decode_batch_ints(*cache_, seqs, max_pages);
    db = device_batch(dev_->upload_batch(host, s), int(seqs.size()), max_pages);
    dev_->other_ws.reserve(decode_workspace_bytes(g, db.batch, n_heads_, max_pages));
  }
  const DeviceBuffer<uint8_t>& ws = planned ? dev_->ws : dev_->other_ws;
  DecodeShape shape{n_heads_, options_.sm_scale, 0};
  const size_t off = size_t(layer) * g.n_kv_heads * g.head_dim * g.head_dim;
  decode_int2(g, cache_->pages_base(), cache_->windows_base(), layer, db, codecs(layer), shape, q,
              DeviceState::at(dev_->rot_k, off), DeviceState::at(dev_->rot_v_t, off), out, ws.data(), ws.bytes(), s,
              options_.activations, &blocks_[size_t(layer)]);
  if (planned) dev_->after_use(s);
#else
  throw Error("runtime: built without CUDA");
#endif
}

int64_t Runtime::prefill_length(int layer, int seq, int T) const {
  const bool step_open = std::find(appended_.begin(), appended_.end(), 0) != appended_.end();
  const auto it = std::find(pending_seqs_.begin(), pending_seqs_.end(), seq);
  if (!step_open || it == pending_seqs_.end()) return cache_->length(seq);
  const size_t i = size_t(it - pending_seqs_.begin());
  KVCC_REQUIRE(!appended_[size_t(layer)], "runtime: prefill of layer " + std::to_string(layer) + ", sequence " +
                                              std::to_string(seq) +
                                              " after that layer's append in this step (call prefill first: the new "
                                              "tokens attend to themselves through k and v)");
  KVCC_REQUIRE(T == pending_counts_[i], "runtime: prefill of " + std::to_string(T) + " tokens, but begin_append gave " +
                                            std::to_string(pending_counts_[i]) + " for sequence " +
                                            std::to_string(seq));
  return pending_old_[i];
}

void Runtime::prefill(int layer, const EngineSequence& seq, int T, const void* q, const void* k, const void* v,
                      void* out, void* stream) {
  prefill(layer, std::vector<EngineSequence>{seq}, std::vector<int>{T}, q, k, v, out, stream);
}

void Runtime::prefill(int layer, const std::vector<EngineSequence>& seqs, const std::vector<int>& counts, const void* q,
                      const void* k, const void* v, void* out, void* stream) {
  KVCC_REQUIRE(options_.engine_tables, "runtime: prefill(layer, EngineSequence, ...) needs engine_tables");
  const KvGeometry& g = geometry();
  KVCC_REQUIRE(layer >= 0 && layer < g.n_layers, "runtime: layer " + std::to_string(layer) + " out of range");
  KVCC_REQUIRE(seqs.size() == counts.size(), "runtime: prefill of " + std::to_string(seqs.size()) + " sequences with " +
                                                 std::to_string(counts.size()) + " counts");
  const bool step_open = std::find(appended_.begin(), appended_.end(), 0) != appended_.end();
  std::vector<int> slots(seqs.size());
  for (size_t i = 0; i < seqs.size(); ++i) {
    const EngineSequence& seq = seqs[i];
    const int T = counts[i];
    KVCC_REQUIRE(T >= 0 && seq.length >= 0 && seq.length + T <= limits_.max_context,
                 "runtime: prefill of " + std::to_string(T) + " tokens after " + std::to_string(seq.length) +
                     ": negative, or beyond the declared max_context");
    KVCC_REQUIRE(seq.slot >= 0 && seq.slot < options_.max_sequences,
                 "runtime: window slot " + std::to_string(seq.slot) + " outside [0, max_sequences)");
    KVCC_REQUIRE(seq.pages || history_pages(seq.length) == 0, "runtime: prefill with a null page list");
    slots[i] = seq.slot;
  }
  require_distinct(slots);
  if (cache_->memory() == PoolMemory::Host) {
    for (const EngineSequence& seq : seqs) {
      // Inside a step that appends these tokens, the same order rules as prefill(layer, seq, ...).
      const auto it = std::find(pending_seqs_.begin(), pending_seqs_.end(), seq.slot);
      if (!step_open || it == pending_seqs_.end()) {
        cache_->mirror_sequence(seq.slot, seq.length, seq.pages, history_pages(seq.length));
      } else {
        KVCC_REQUIRE(pending_old_[size_t(it - pending_seqs_.begin())] == seq.length,
                     "runtime: prefill after " + std::to_string(seq.length) + " tokens of window slot " +
                         std::to_string(seq.slot) + ", which the open step holds at another length");
      }
    }
    prefill_slots(layer, slots, counts, q, k, v, out, stream);
    return;
  }
#if defined(KVCC_HAVE_CUDA)
  std::vector<PrefillSequence> batch(seqs.size());
  for (size_t i = 0; i < seqs.size(); ++i) batch[i] = {seqs[i].slot, seqs[i].length, seqs[i].pages, counts[i]};
  prefill_device(layer, batch, q, k, v, out, stream);
#else
  (void)q, (void)k, (void)v, (void)out, (void)stream;
  throw Error("runtime: built without CUDA");
#endif
}

void Runtime::prefill(int layer, int seq, int T, const void* q, const void* k, const void* v, void* out, void* stream) {
  prefill(layer, std::vector<int>{seq}, std::vector<int>{T}, q, k, v, out, stream);
}

void Runtime::prefill(int layer, const std::vector<int>& seqs, const std::vector<int>& counts, const void* q,
                      const void* k, const void* v, void* out, void* stream) {
  KVCC_REQUIRE(!options_.engine_tables,
               "runtime: with engine_tables prefill takes the engine's sequences: prefill(layer, EngineSequence, ...)");
  prefill_slots(layer, seqs, counts, q, k, v, out, stream);
}

void Runtime::require_distinct(const std::vector<int>& seqs) const {
  std::vector<int> sorted(seqs);
  std::sort(sorted.begin(), sorted.end());
  const auto dup = std::adjacent_find(sorted.begin(), sorted.end());
  KVCC_REQUIRE(dup == sorted.end(), "runtime: sequence " + std::to_string(dup == sorted.end() ? 0 : *dup) +
                                        " twice in one prefill (give each sequence's tokens once)");
}

// Prefill of the cache's sequences `seqs` (the Runtime's own, or ones mirrored from the engine's
// tables on a host pool).
void Runtime::prefill_slots(int layer, const std::vector<int>& seqs, const std::vector<int>& counts, const void* q,
                            const void* k, const void* v, void* out, void* stream) {
  const KvGeometry& g = geometry();
  KVCC_REQUIRE(layer >= 0 && layer < g.n_layers, "runtime: layer " + std::to_string(layer) + " out of range");
  KVCC_REQUIRE(seqs.size() == counts.size(), "runtime: prefill of " + std::to_string(seqs.size()) + " sequences with " +
                                                 std::to_string(counts.size()) + " counts");
  require_distinct(seqs);
  std::vector<int64_t> lengths(seqs.size());
  int64_t tokens = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    KVCC_REQUIRE(counts[i] >= 0, "runtime: negative token count");
    lengths[i] = prefill_length(layer, seqs[i], counts[i]);
    tokens += counts[i];
  }
  if (cache_->memory() == PoolMemory::Host) {
    const size_t q_row = size_t(n_heads_) * size_t(g.head_dim), kv_row = size_t(g.n_kv_heads) * size_t(g.head_dim);
    const size_t nq = size_t(tokens) * q_row;
    const bool f32 = options_.activations == Activations::Float32;
    if (!f32) host_out_.resize(nq);
    float* o = f32 ? static_cast<float*>(out) : host_out_.data();
    const float* hq = host_input(0, q, nq);
    const float* hk = host_input(1, k, size_t(tokens) * kv_row);
    const float* hv = host_input(2, v, size_t(tokens) * kv_row);
    size_t t0 = 0;
    for (size_t i = 0; i < seqs.size(); ++i) {
      prefill_ref(*cache_, layer, seqs[i], counts[i], hq + t0 * q_row, hk + t0 * kv_row, hv + t0 * kv_row, n_heads_,
                  rot_k(layer), rot_v(layer), codecs(layer), options_.sm_scale, o + t0 * q_row, lengths[i]);
      t0 += size_t(counts[i]);
    }
    if (!f32) store_activations(o, nq, options_.activations, out);
    return;
  }
#if defined(KVCC_HAVE_CUDA)
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  // A sequence of the step begin_append planned has its page table on the device already (the
  // step's decode batch, whose first pages are those before the step's tokens): no copy. The
  // others' tables are uploaded together.
  DeviceState& d = *dev_;
  std::vector<PrefillSequence> batch(seqs.size());
  std::vector<int32_t> upload;
  std::vector<int64_t> uploaded_at(seqs.size(), -1);
  bool planned_any = false;
  for (size_t i = 0; i < seqs.size(); ++i) {
    batch[i] = {seqs[i], lengths[i], nullptr, counts[i]};
    const auto it = std::find(d.step_seqs.begin(), d.step_seqs.end(), seqs[i]);
    if (it != d.step_seqs.end() && cache_->version() == d.step_version) {
      batch[i].page_table = d.decode.page_table + d.step_page_offsets[size_t(it - d.step_seqs.begin())];
      planned_any = true;
    } else {
      const std::vector<int32_t>& pt = cache_->page_table(seqs[i]);
      uploaded_at[i] = int64_t(upload.size());
      upload.insert(upload.end(), pt.begin(), pt.begin() + kvcc::history_pages(g, lengths[i]));
    }
  }
  const int32_t* tables = d.upload_batch(upload, s);
  for (size_t i = 0; i < seqs.size(); ++i)
    if (uploaded_at[i] >= 0) batch[i].page_table = tables + uploaded_at[i];
  if (planned_any) d.before_use(s);
  prefill_device(layer, batch, q, k, v, out, stream);
  if (planned_any) d.after_use(s);
#else
  (void)q, (void)k, (void)v, (void)out, (void)stream, (void)tokens;
  throw Error("runtime: built without CUDA");
#endif
}

#if defined(KVCC_HAVE_CUDA)
void Runtime::prefill_device(int layer, const std::vector<PrefillSequence>& seqs, const void* q, const void* k,
                             const void* v, void* out, void* stream) {
  const KvGeometry& g = geometry();
  const PrefillShape shape{n_heads_, options_.sm_scale};
  dev_->other_ws.reserve(prefill_workspace_bytes(g, seqs, shape));
  const size_t off = size_t(layer) * g.n_kv_heads * g.head_dim * g.head_dim, heads = size_t(layer) * g.n_kv_heads;
  prefill_int2(g, cache_->pages_base(), cache_->windows_base(), layer, seqs, codecs(layer), shape, q, k, v,
               DeviceState::at(dev_->rot_k, off), DeviceState::at(dev_->rot_v_t, off),
               DeviceState::at(dev_->fixed_k, heads), DeviceState::at(dev_->fixed_v, heads), out, dev_->other_ws.data(),
               dev_->other_ws.bytes(), static_cast<cudaStream_t>(stream), options_.activations,
               &blocks_[size_t(layer)]);
}
#endif

void Runtime::attention_scores(int layer, int seq, int W, const void* q, float* scores, void* stream) {
  const KvGeometry& g = geometry();
  KVCC_REQUIRE(layer >= 0 && layer < g.n_layers, "runtime: layer " + std::to_string(layer) + " out of range");
  KVCC_REQUIRE(!options_.engine_tables,
               "runtime: attention_scores reads the Runtime's own sequences (not engine_tables')");
  const bool step_open = std::find(appended_.begin(), appended_.end(), 0) != appended_.end();
  KVCC_REQUIRE(!step_open, "runtime: attention_scores inside an open step (finish every layer's append first)");
  const int64_t n = cache_->length(seq);
  KVCC_REQUIRE(W >= 1 && W <= n, "runtime: attention_scores over an observation window of " + std::to_string(W) +
                                     " tokens; it must be in [1, the sequence's length " + std::to_string(n) + "]");
  if (cache_->memory() == PoolMemory::Host) {
    const size_t nq = size_t(W) * size_t(n_heads_) * size_t(g.head_dim);
    attention_scores_ref(*cache_, layer, seq, W, host_input(0, q, nq), n_heads_, rot_k(layer), codecs(layer),
                         options_.sm_scale, scores);
    return;
  }
  KVCC_REQUIRE(cache_->layout().two_bit(), kWidthsEvictionRefusal);
#if defined(KVCC_HAVE_CUDA)
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const std::vector<int32_t>& pt = cache_->page_table(seq);
  const int32_t* table = dev_->upload_batch(std::vector<int32_t>(pt.begin(), pt.begin() + history_pages(n)), s);
  dev_->other_ws.reserve(attention_scores_workspace_bytes(g, n, W, n_heads_));
  const size_t off = size_t(layer) * g.n_kv_heads * g.head_dim * g.head_dim;
  attention_scores_int2(g, cache_->pages_base(), cache_->windows_base(), layer, seq, n, table, W,
                        dev_->codecs.data() + size_t(layer) * g.n_kv_heads, n_heads_, options_.sm_scale, q,
                        DeviceState::at(dev_->rot_k, off), scores, dev_->other_ws.data(), dev_->other_ws.bytes(), s,
                        options_.activations);
#else
  (void)q, (void)stream;
  throw Error("runtime: built without CUDA");
#endif
}

int64_t Runtime::evict_tokens(int seq, const std::vector<int64_t>& kept, void* stream) {
  const bool step_open = std::find(appended_.begin(), appended_.end(), 0) != appended_.end();
  KVCC_REQUIRE(!step_open, "runtime: evict_tokens inside an open step (finish every layer's append first)");
  KVCC_REQUIRE(!options_.engine_tables,
               "runtime: evict_tokens compacts the Runtime's own page tables; with "
               "engine_tables the engine's allocator owns them");
  KVCC_REQUIRE(!geometry().per_channel_keys(), kPerChannelEvictionRefusal);
  if (cache_->memory() == PoolMemory::Host) return compact_ref(*cache_, seq, kept, codecs_.data());
  KVCC_REQUIRE(cache_->layout().two_bit(), kWidthsEvictionRefusal);
#if defined(KVCC_HAVE_CUDA)
  return compact_device(*cache_, seq, kept, dev_->codecs.data(), dev_->other_ws, stream);
#else
  (void)stream;
  throw Error("runtime: built without CUDA");
#endif
}

}  // namespace kvcc
