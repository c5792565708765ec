// The C++ API an inference engine links (runtime + formats only): an artifact's rotations and
// quantizer parameters, the paged INT2 cache, and the append / decode / prefill kernels.
//
// One Runtime serves one model. With PoolMemory::Device (needs CUDA and a Hopper GPU, sm_90; other
// GPUs are refused by name when the Runtime is made) all tensor arguments are device pointers and
// work is queued on the given stream; with PoolMemory::Host the same calls run the CPU reference
// on host pointers (the stream is ignored). Per step:
//   begin_append(seqs, counts)  -- grows the sequences (allocates pages, all or nothing)
//   append(layer, k, v, stream) -- for every layer: rotate, write windows, quantise into pages
//   decode(layer, seqs, q, out, stream)
// or, when the engine keeps the page tables (RuntimeOptions::engine_tables, vLLM / FlashInfer
// style block tables), begin_step(EngineStep) instead of begin_append and decode_step(layer, q, out).
// k, v: [sum(counts), n_kv, d] post-RoPE, unrotated, sequences in order;
// q, out: [n_seqs, n_heads, d] (q post-RoPE, unrotated; out in the model's basis).
// These activations are float32, or bfloat16 with RuntimeOptions::activations (runtime/activations.h:
// widened on load, outputs rounded to nearest even, so a bfloat16 call equals the float32 one on
// the widened inputs with its output rounded).
// Prefill / extend of one sequence by T tokens: prefill(layer, seq, T, q, k, v, out, stream) with
// q, out [T, n_heads, d] and k, v [T, n_kv, d] (the sequence's rows of what append gets), or of
// several at once: prefill(layer, seqs, counts, ...) (a ragged batch, one set of launches). It
// reads the cache as it was before these tokens, so call it before begin_append, or after
// begin_append (T = the sequence's count) and before append(layer). On a device pool a sequence
// of the step begin_append planned is read through the step's device page tables (no copy);
// another sequence's page table is uploaded by the call.
//
// Tensor parallelism: RuntimeOptions::kv_begin / kv_end (e.g. from kv_head_slice(rank, ranks))
// make the Runtime serve one slice of the model's KV heads [kv_begin, kv_end): it holds only
// those heads' codecs, rotations and cache pages, and every tensor above is the slice's part:
// n_kv = kv_end - kv_begin KV heads and n_heads = the slice's query heads, (n_heads / n_kv_heads
// of the model) per KV head, i.e. model query heads [kv_begin·r, kv_end·r) for r = n_heads /
// n_kv_heads. Each head is computed by the same code as in a whole-model Runtime, so the ranks'
// outputs concatenated along the heads are the whole model's bit for bit.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "formats/artifact.h"
#include "formats/kv_layout.h"
#include "runtime/activations.h"
#include "runtime/engine_step.h"
#include "runtime/kv_cache.h"
#include "runtime/plan.h"

namespace kvcc {

struct PrefillSequence;  // runtime/kv_kernels.h

// What the engine says the model is; an artifact that disagrees is refused.
struct EngineShape {
  int n_layers = 0, n_heads = 0, n_kv_heads = 0, head_dim = 0;
};

struct RuntimeOptions {
  int64_t max_pages = 0;  // INT2 history pages in the pool (each holds the slice's KV heads only)
  int max_sequences = 0;
  PoolMemory memory = PoolMemory::Device;
  float sm_scale = 0.0f;  // 0: 1/sqrt(head_dim)
  // The model's KV heads this Runtime serves, [kv_begin, kv_end); kv_end = 0: all of them
  // (kv_begin must then be 0). A proper slice needs n_heads a multiple of n_kv_heads.
  int kv_begin = 0, kv_end = 0;
  // Declared maxima (engine mode; max_context > 0 declares them): the largest step the engine
  // will open, sequences in it (0: max_sequences), tokens of a sequence after it, and new tokens
  // of all its sequences together (0: max_batch, one per sequence). A device Runtime then sizes
  // its step tables and workspace once, at load, never reallocates them, plans decode's split-K
  // grid for max_context (every step launches the same grids, so a decode step captured in a CUDA
  // graph replays for later steps), and begin_append refuses a step beyond them (Error, the cache
  // unchanged; the host pool refuses the same steps). Undeclared (0), the device workspace is
  // sized in begin_append for each step (between steps, never inside one) and decode's split
  // plan follows the step's longest sequence; nothing may then be captured.
  int max_batch = 0;
  int64_t max_context = 0;
  int max_step_tokens = 0;
  // The element type of q, k, v and out in every call (engines run in bfloat16).
  Activations activations = Activations::Float32;
  // The engine keeps the page tables (runtime/engine_step.h): it allocates window slots
  // [0, max_sequences) and pool pages [0, max_pages) itself and opens each step with
  // begin_step(EngineStep); the Runtime's allocator (cache()'s add_sequence, grow, ...),
  // begin_append and evict_tokens are then refused. Needs the maxima declared (max_context > 0)
  // and max_batch <= kEngineMaxBatch.
  bool engine_tables = false;
};

// Rank `rank` of `ranks` tensor-parallel ranks: contiguous equal slices of the KV heads,
// [rank·n/ranks, (rank+1)·n/ranks). Throws Error when ranks does not divide n_kv_heads or rank
// is not in [0, ranks).
struct KvHeadRange {
  int begin = 0, end = 0;
};
KvHeadRange kv_head_slice(int n_kv_heads, int rank, int ranks);

class Runtime {
 public:
  Runtime(const Artifact& artifact, const EngineShape& engine, const RuntimeOptions& options);
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;
  static std::unique_ptr<Runtime> load(const std::string& artifact_path, const EngineShape& engine,
                                       const RuntimeOptions& options);

  KvCache& cache() { return *cache_; }
  // The cache's geometry: n_kv_heads is the slice's KV heads (all of the model's by default).
  const KvGeometry& geometry() const { return cache_->geometry(); }
  // The slice served: model KV heads [kv_begin, kv_end), and the query heads q and out hold
  // (model query heads [kv_begin·r, kv_end·r), r = n_heads / n_kv_heads).
  int kv_begin() const { return kv_begin_; }
  int kv_end() const { return kv_begin_ + geometry().n_kv_heads; }
  int n_heads() const { return n_heads_; }
  // Per layer, the slice's KV heads in order: [n_kv] codecs.
  const HeadCodec* codecs(int layer) const { return codecs_.data() + size_t(layer) * geometry().n_kv_heads; }
  // Host copies: [n_kv, d, d] per layer (the slice's heads), x_rot = x·R (null when the artifact
  // has no rotation).
  const float* rot_k(int layer) const;
  const float* rot_v(int layer) const;

  // Opens a step: the sequences grow by counts. On a device pool the step is planned here, once
  // for all layers (append moves, window writes and the decode batch of `seqs`, uploaded in one
  // copy on `stream`; workspace sized), so append(layer) and decode(layer, seqs) only launch
  // kernels. decode of other sequences than the step's plans its batch per call. Pass the stream
  // append and decode run on (one stream per Runtime); calls on another stream are ordered after
  // the upload, and the next step's upload after them, by events.
  //
  // CUDA graphs (device pool, maxima declared): everything a step changes (lengths, page moves,
  // page tables, the counts the append grids stride over) is written by begin_append's upload
  // into device tables at fixed addresses, and append(layer) / decode(layer) launch fixed grids
  // over them. So an engine calls begin_append(seqs, counts, stream) outside the capture, captures
  // append(l) + decode(l, seqs) for every layer on `stream` once, and for each later step calls
  // begin_append (same number of sequences; any ids, lengths and counts within the maxima) and
  // replays the graph on the same stream. The graph reads the k, v, q and out addresses it was
  // captured with. prefill and decode of other sequences than the step's never touch the step's
  // tables or workspace (prefill of the step's sequences reads their page tables there).
  void begin_append(const std::vector<int>& seqs, const std::vector<int>& counts, void* stream = nullptr);
  // Opens a step from the engine's tables (RuntimeOptions::engine_tables; EngineStep's arrays are
  // device pointers on a device pool, host pointers on a host pool). The engine has allocated
  // every page the new lengths need (history_pages). On a device pool the step is planned on the
  // device by one kernel on `stream` (plan_engine_step), reading the tables when it runs: so
  // begin_step and every layer's append + decode can be captured in one CUDA graph and replayed
  // for later steps, with new lengths, counts, slots and block-table entries written by the engine
  // into the same arrays (same addresses, same batch). A sequence outside the limits makes that
  // step plan nothing, its decode write zeros, and step_problem() name it; a host pool throws
  // Error instead (changing nothing).
  void begin_step(const EngineStep& step, void* stream = nullptr);
  // Why the last begin_step planned nothing ("" when it did): reads the step's header back,
  // waiting for `stream` (not for use inside a capture). Host pool: always "" (it throws).
  std::string step_problem(void* stream = nullptr);
  // History pages a sequence of `length` tokens holds (an engine allocates this many per sequence).
  int64_t history_pages(int64_t length) const { return kvcc::history_pages(geometry(), length); }
  // The declared maxima (all 0 when undeclared; max_batch and max_step_tokens resolved).
  int max_batch() const { return limits_.max_batch; }
  int64_t max_context() const { return limits_.max_context; }
  int max_step_tokens() const { return limits_.max_step_tokens; }
  // The tensors are RuntimeOptions::activations (float32 by default).
  Activations activations() const { return options_.activations; }
  // The open step's new tokens of one layer (k, v [rows, n_kv, d]); once every layer has appended
  // the step is over and append is refused until the next begin_append / begin_step.
  void append(int layer, const void* k, const void* v, void* stream = nullptr);
  void decode(int layer, const std::vector<int>& seqs, const void* q, void* out, void* stream = nullptr);
  // Decode of the open step's sequences, in the step's order (begin_append's or begin_step's).
  void decode_step(int layer, const void* q, void* out, void* stream = nullptr);
  void prefill(int layer, int seq, int T, const void* q, const void* k, const void* v, void* out,
               void* stream = nullptr);
  // Several sequences at once (a ragged batch: one set of launches for all of them, e.g. a
  // chunked-prefill step's): seqs[i] extended by counts[i] tokens; q, out [Σcounts, n_heads, d],
  // k, v [Σcounts, n_kv, d], the sequences' rows one after another in seqs' order (for the open
  // step's sequences in its order, exactly append's k and v). Each sequence at most once.
  void prefill(int layer, const std::vector<int>& seqs, const std::vector<int>& counts, const void* q, const void* k,
               const void* v, void* out, void* stream = nullptr);
  // The same for a sequence of the engine's tables (engine_tables; pages: a device pointer on a
  // device pool): the T new tokens after seq.length attend to what the cache holds of its first
  // seq.length tokens and to themselves. Call it before the layer's append of a step that appends
  // them, as above.
  void prefill(int layer, const EngineSequence& seq, int T, const void* q, const void* k, const void* v, void* out,
               void* stream = nullptr);
  void prefill(int layer, const std::vector<EngineSequence>& seqs, const std::vector<int>& counts, const void* q,
               const void* k, const void* v, void* out, void* stream = nullptr);

  // Token eviction: keeps only the tokens at positions `kept` (strictly increasing, < length) of
  // `seq`, in every layer and KV head, and compacts them into whole pages so that freed pages
  // return to the pool (CompactionPlan in kv_cache.h has the rules; the sequence then has
  // kept.size() tokens, later appends continue after them with their own RoPE positions). Pages
  // shared with a fork are never written. All or nothing: a bad list (Error) or too few free pages
  // (CacheFull, only when pages are shared) changes nothing. Not inside an open step (between
  // begin_append and the last layer's append). Returns the pages released. A device pool queues the
  // moves on `stream` (runtime/compact.h) and needs no synchronisation before the next call on it;
  // it compacts 2-bit pages only (kWidthsEvictionRefusal).
  int64_t evict_tokens(int seq, const std::vector<int64_t>& kept, void* stream = nullptr);

  // Token scores for eviction (SnapKV's, without the attention matrix): the W queries of the
  // sequence's last W tokens (q [W, n_heads, d] post-RoPE, unrotated, the activations type; those
  // tokens already appended) attend causally to what the cache holds of layer `layer`, and
  // scores (float32 [n_kv, length], a device pointer on a device pool) receives, per KV head and
  // position, the softmax weights summed over the W queries and the head's query heads (each
  // head's scores sum to W·n_heads/n_kv). Read from the INT2 pages and BF16 windows as decode
  // reads them, so a caller ranks tokens by what the cache would give them; max-pool and keep
  // the top ones, then evict_tokens. The Runtime's own sequences, between steps (not inside one).
  // A device pool scores 2-bit pages only (kWidthsEvictionRefusal).
  void attention_scores(int layer, int seq, int W, const void* q, float* scores, void* stream = nullptr);

 private:
  struct DeviceState;
  EngineShape engine_;
  RuntimeOptions options_;
  int kv_begin_ = 0;  // first model KV head of the slice
  int n_heads_ = 0;   // query heads of the slice
  std::unique_ptr<KvCache> cache_;
  std::vector<LayerBlocks> blocks_;   // a device pool's layers as its kernels address them
  std::vector<HeadCodec> codecs_;     // [layers * n_kv]
  std::vector<float> rot_k_, rot_v_;  // [layers * n_kv * d * d], empty: identity
  StepLimits limits_;                 // all 0: undeclared
  std::vector<int> pending_seqs_, pending_counts_;
  std::vector<int64_t> pending_old_;
  std::vector<char> appended_;     // [layers]: append(layer) done in the current step
  bool step_from_engine_ = false;  // the open step came from begin_step
  // The length prefill reads: before the open step's tokens (checked), else the current one.
  int64_t prefill_length(int layer, int seq, int T) const;
  void plan_step(void* stream);
  void prefill_slots(int layer, const std::vector<int>& seqs, const std::vector<int>& counts, const void* q,
                     const void* k, const void* v, void* out, void* stream);
  void require_distinct(const std::vector<int>& seqs) const;
  void prefill_device(int layer, const std::vector<PrefillSequence>& seqs, const void* q, const void* k, const void* v,
                      void* out, void* stream);  // device pool only (kv_kernels.h)
  void decode_sequences(int layer, const std::vector<int>& seqs, const void* q, void* out, void* stream);
  // Host pool with bfloat16 activations: the widened inputs and the float outputs of the reference.
  std::vector<float> host_x_[3], host_out_;
  const float* host_input(int i, const void* p, size_t n);
  std::unique_ptr<DeviceState> dev_;
};

// The cache geometry an artifact's recipe gives (all of its KV heads): windows, page size and the
// (scale, zero) layout. kivi: per-channel key pages over groups of min(group, page) tokens
// (kv_layout.h key_group_tokens), values per token over min(group, head_dim) channels, or head_dim
// for the mixed recipe (params "values"); every other served method: per-token groups of `group`
// channels (0: head_dim) on both sides.
KvGeometry cache_geometry(const Artifact& artifact);
// The code widths of the artifact's (layer, KV head) blocks, [n_layers · n_kv_heads] (kv_layout.h
// PageLayout): each side's own bits (compile --bits-budget) or the recipe's.
std::vector<BlockWidths> cache_widths(const Artifact& artifact);

// Checks an artifact against the engine's shape and the runtime's scope; throws Error naming
// the first mismatch.
void check_artifact_for_engine(const Artifact& artifact, const EngineShape& engine);

// Why the device pool's kernels cannot serve this cache geometry, or "" when they can (one table
// for the Runtime and every launcher: runtime/served.h's gpu_unsupported_reason). Without
// n_heads, the append and prefill kernels' rules on the cache alone: head_dim 128, one (scale,
// zero) group per row, 64-token pages and <= 64 KV heads. With the model's query heads, all a
// device Runtime needs, decode included: also a whole number of query heads per KV head, at most
// 8, sink and recent windows in multiples of 16 tokens, and one key and one value code width a
// layer in `widths` (cache_widths: PageLayout::kernel_problem). A Runtime with a device pool refuses a model outside
// the latter when it is made (never at its first decode or prefill); `kvcc validate --device auto` falls back to the
// host pool.
std::string device_scope_problem(const KvGeometry& g);
std::string device_scope_problem(const KvGeometry& g, int n_heads, const std::vector<BlockWidths>& widths);

}  // namespace kvcc
