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

typedef struct kvcc_runtime kvcc_runtime;

/* memory: 0 = host pool (CPU reference), 1 = device pool (CUDA, a Hopper GPU: sm_90). */
int kvcc_runtime_load(const char* artifact_path, int n_layers, int n_heads, int n_kv_heads, int head_dim,
                      int64_t max_pages, int max_sequences, int memory, kvcc_runtime** out);
/* Tensor parallelism: rank `rank` of `ranks` serves KV heads [rank·n_kv/ranks, (rank+1)·n_kv/ranks)
 * and their query heads; q, k, v and out of every later call hold the slice's heads only
 * (kvcc_runtime.h). ranks must divide n_kv_heads. rank 0 of 1 is kvcc_runtime_load. */
int kvcc_runtime_load_rank(const char* artifact_path, int n_layers, int n_heads, int n_kv_heads, int head_dim,
                           int64_t max_pages, int max_sequences, int memory, int rank, int ranks, kvcc_runtime** out);
void kvcc_runtime_free(kvcc_runtime* rt);

int kvcc_add_sequence(kvcc_runtime* rt, int* seq);
int kvcc_fork_sequence(kvcc_runtime* rt, int parent, int* seq, void* stream);
int kvcc_free_sequence(kvcc_runtime* rt, int seq);
int kvcc_sequence_length(kvcc_runtime* rt, int seq, int64_t* length);

int kvcc_begin_append(kvcc_runtime* rt, int n_seqs, const int* seqs, const int* counts);
int kvcc_append(kvcc_runtime* rt, int layer, const float* k, const float* v, void* stream);
int kvcc_decode(kvcc_runtime* rt, int layer, int n_seqs, const int* seqs, const float* q, float* out, void* stream);
/* T new tokens of one sequence attend to its cache and causally to themselves (see kvcc_runtime.h):
 * q, out [T, n_heads, d], k, v [T, n_kv, d]. Before kvcc_begin_append, or between it and
 * kvcc_append of this layer. */
int kvcc_prefill(kvcc_runtime* rt, int layer, int seq, int T, const float* q, const float* k, const float* v,
                 float* out, void* stream);

int kvcc_bytes_in_use(kvcc_runtime* rt, int64_t* bytes);
const char* kvcc_last_error(void);

#ifdef __cplusplus
}
#endif
#endif
