/* A small C ABI over kvcc::Runtime (runtime/kvcc_runtime.h) for engines to bind. Every call
 * returns a status; on failure kvcc_last_error() gives a one-line message (per thread).
 * Tensor pointers are device pointers (device pool) or host pointers (host pool); stream is a
 * cudaStream_t or NULL. Shapes as in kvcc_runtime.h. */
#ifndef KVCC_C_H
#define KVCC_C_H
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum kvcc_status { KVCC_OK = 0, KVCC_ERROR = 1, KVCC_CACHE_FULL = 2, KVCC_BAD_ARGUMENT = 3 };
/* The element type of q, k, v and out (runtime/activations.h): float32, or bfloat16 (raw 16-bit
 * words, widened on load and rounded to nearest even on store). */
enum kvcc_activations { KVCC_FLOAT32 = 0, KVCC_BFLOAT16 = 1 };

typedef struct kvcc_runtime kvcc_runtime;

/* memory: 0 = host pool (CPU reference), 1 = device pool (CUDA, a Hopper GPU: sm_90). */
int kvcc_runtime_load(const char* artifact_path, int n_layers, int n_heads, int n_kv_heads, int head_dim,
                      int64_t max_pages, int max_sequences, int memory, kvcc_runtime** out);
/* Tensor parallelism: rank `rank` of `ranks` serves KV heads [rank·n_kv/ranks, (rank+1)·n_kv/ranks)
 * and their query heads; q, k, v and out of every later call hold the slice's heads only
 * (kvcc_runtime.h). ranks must divide n_kv_heads. rank 0 of 1 is kvcc_runtime_load. */
int kvcc_runtime_load_rank(const char* artifact_path, int n_layers, int n_heads, int n_kv_heads, int head_dim,
                           int64_t max_pages, int max_sequences, int memory, int rank, int ranks, kvcc_runtime** out);
/* The same with the declared maxima of kvcc_runtime.h's RuntimeOptions (engine mode, needed to
 * capture a step in a CUDA graph): max_context > 0 declares them; max_batch (0: max_sequences)
 * and max_step_tokens (0: max_batch) bound every later step. activations (kvcc_activations) is the
 * type of every later call's q, k, v and out. All 0 is kvcc_runtime_load_rank. */
int kvcc_runtime_load_limits(const char* artifact_path, int n_layers, int n_heads, int n_kv_heads, int head_dim,
                             int64_t max_pages, int max_sequences, int memory, int rank, int ranks, int max_batch,
                             int64_t max_context, int max_step_tokens, int activations, kvcc_runtime** out);
/* The same, for an engine that keeps the page tables (RuntimeOptions::engine_tables): steps are
 * opened by kvcc_begin_step; the Runtime's own sequences, kvcc_begin_append, kvcc_decode and
 * kvcc_prefill are refused. max_context must be > 0 and max_batch <= 2048. */
int kvcc_runtime_load_engine(const char* artifact_path, int n_layers, int n_heads, int n_kv_heads, int head_dim,
                             int64_t max_pages, int max_sequences, int memory, int rank, int ranks, int max_batch,
                             int64_t max_context, int max_step_tokens, int activations, kvcc_runtime** out);
void kvcc_runtime_free(kvcc_runtime* rt);

int kvcc_add_sequence(kvcc_runtime* rt, int* seq);
int kvcc_fork_sequence(kvcc_runtime* rt, int parent, int* seq, void* stream);
int kvcc_free_sequence(kvcc_runtime* rt, int seq);
int kvcc_sequence_length(kvcc_runtime* rt, int seq, int64_t* length);

int kvcc_begin_append(kvcc_runtime* rt, int n_seqs, const int* seqs, const int* counts);
/* The same, with the stream append and decode will run on (a device pool plans the step there;
 * kvcc_begin_append plans it on the default stream). */
int kvcc_begin_append_stream(kvcc_runtime* rt, int n_seqs, const int* seqs, const int* counts, void* stream);
int kvcc_append(kvcc_runtime* rt, int layer, const void* k, const void* v, void* stream);
int kvcc_decode(kvcc_runtime* rt, int layer, int n_seqs, const int* seqs, const void* q, void* out, void* stream);
/* Prefill / extend of n_seqs sequences in one set of launches (a ragged batch; see kvcc_runtime.h):
 * sequence seqs[i] gets counts[i] new tokens, which attend to its cache and causally to each other;
 * q, out [sum(counts), n_heads, d], k, v [sum(counts), n_kv, d], the sequences' rows one after
 * another in seqs' order (for the open step's sequences in its order: append's k and v). Each
 * sequence at most once. Before kvcc_begin_append, or between it and kvcc_append of this layer.
 * seqs and counts are host arrays. */
int kvcc_prefill(kvcc_runtime* rt, int layer, int n_seqs, const int* seqs, const int* counts, const void* q,
                 const void* k, const void* v, void* out, void* stream);

/* Engine tables (kvcc_runtime_load_engine; runtime/engine_step.h): a step of `batch` sequences
 * given as int32 arrays, device pointers on a device pool: window slots, lengths before the step,
 * new-token counts, and block_table [batch, stride] of history pages (kvcc_history_pages per
 * sequence), and `rows`, the rows of the step's k and v (<= max_step_tokens; 0: max_step_tokens): a
 * step whose counts sum above it plans nothing. Planned on the device on `stream`: capturable with
 * the layers in one CUDA graph. */
int kvcc_begin_step(kvcc_runtime* rt, int batch, const int32_t* slots, const int32_t* lengths, const int32_t* counts,
                    const int32_t* block_table, int stride, int rows, void* stream);
/* Decode of the open step's sequences, in its order (either kind of step). */
int kvcc_decode_step(kvcc_runtime* rt, int layer, const void* q, void* out, void* stream);
/* kvcc_prefill for sequences of the engine's tables: sequence i is window slot slots[i] with
 * lengths[i] tokens before its counts[i] new ones and history pages pages[i] (an int32 array of at
 * least kvcc_history_pages(lengths[i]) ids; a device pointer on a device pool). slots, lengths,
 * pages and counts themselves are host arrays of n_seqs entries. */
int kvcc_prefill_engine(kvcc_runtime* rt, int layer, int n_seqs, const int* slots, const int64_t* lengths,
                        const int32_t* const* pages, const int* counts, const void* q, const void* k, const void* v,
                        void* out, void* stream);
/* Why the last kvcc_begin_step planned nothing, or "" (waits for `stream`); the string stays valid
 * until the next call on rt. */
int kvcc_step_problem(kvcc_runtime* rt, void* stream, const char** message);
int kvcc_bytes_in_use(kvcc_runtime* rt, int64_t* bytes);
/* Token eviction (kvcc_runtime.h Runtime::evict_tokens): keeps the n_kept token positions kept[]
 * (ascending, distinct, each < the sequence's length) of seq and compacts the survivors into whole
 * pages; *released (may be NULL) = pages returned to the pool. Not inside an open step. */
int kvcc_evict_tokens(kvcc_runtime* rt, int seq, int64_t n_kept, const int64_t* kept, void* stream, int64_t* released);
/* Token scores for eviction (Runtime::attention_scores): the W queries q [W, n_heads, d] of seq's
 * last W tokens attend causally to the cache as stored; scores (float32 [n_kv, length]) = each
 * position's softmax weights summed over the queries and each KV head's query heads. Device
 * pointers on a device pool. Between steps only. */
int kvcc_attention_scores(kvcc_runtime* rt, int layer, int seq, int W, const void* q, float* scores, void* stream);
const char* kvcc_last_error(void);

/* The library's version, "major.minor.patch" (the CMake project version). */
const char* kvcc_version(void);
/* Reads and validates the artifact at path (as a Runtime load does, without the engine's shape)
 * and sets *json to a JSON object describing it: format_version, producer, created, command,
 * model_id, n_layers, n_heads, n_kv_heads, head_dim, rope_style, fingerprint {id, weights_sha256,
 * fields}, recipe {method, key_bits, value_bits, group, sink, recent, page_size, value_target,
 * granularity, composition, seed, params}, clip_ratio {key, value: [min, max]}, level_tables
 * {key, value: heads with a 4-level table}, provenance {...}, and cache {served (whether the
 * runtime serves it), refusal (why not, else ""), gpu_refusal (why the CUDA kernels do not, else
 * ""), keys ("per_token" | "per_channel"), key_group_tokens, key_pair_bytes (per-channel keys: 4
 * for fp16 pairs, 2 for key_params=e5m3; else 0), value_group, page_bytes, slot_bytes}:
 * the layout of kvcc::cache_geometry. The string stays valid until this thread's next
 * kvcc_artifact_describe call. */
int kvcc_artifact_describe(const char* artifact_path, const char** json);
/* The fingerprint of the model at model_path (a Hugging Face directory or a llama2.c .bin), as
 * artifacts and the zoo record it: {"id", "weights_sha256", "fields": [[name, value], ...]}. The
 * string stays valid until this thread's next kvcc_model_fingerprint call. */
int kvcc_model_fingerprint(const char* model_path, const char** json);
/* INT2 history pages one sequence of `tokens` tokens holds with these windows (kv_layout.h's
 * tiers: sink tokens first, then whole pages, the last tokens in the recent ring), i.e. what
 * max_pages must cover per sequence. */
int kvcc_history_pages(int sink, int recent, int page_size, int64_t tokens, int64_t* pages);

#ifdef __cplusplus
}
#endif
#endif
