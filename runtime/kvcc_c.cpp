#include "runtime/kvcc_c.h"

#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "runtime/kvcc_runtime.h"

struct kvcc_runtime {
  std::unique_ptr<kvcc::Runtime> rt;
};

namespace {
thread_local std::string last_error;

template <class F>
int guarded(F&& f) {
  try {
    f();
    last_error.clear();
    return KVCC_OK;
  } catch (const kvcc::CacheFull& e) {
    last_error = e.what();
    return KVCC_CACHE_FULL;
  } catch (const kvcc::Error& e) {
    last_error = e.what();
    return KVCC_ERROR;
  } catch (const std::exception& e) {
    last_error = std::string("internal error: ") + e.what();
    return KVCC_ERROR;
  }
}
bool bad(const void* p, const char* what) {
  if (p) return false;
  last_error = std::string("null argument: ") + what;
  return true;
}
}  // namespace

extern "C" {

int kvcc_runtime_load(const char* artifact_path, int n_layers, int n_heads, int n_kv_heads, int head_dim,
                      int64_t max_pages, int max_sequences, int memory, kvcc_runtime** out) {
  return kvcc_runtime_load_rank(artifact_path, n_layers, n_heads, n_kv_heads, head_dim, max_pages, max_sequences,
                                memory, 0, 1, out);
}

int kvcc_runtime_load_rank(const char* artifact_path, int n_layers, int n_heads, int n_kv_heads, int head_dim,
                           int64_t max_pages, int max_sequences, int memory, int rank, int ranks, kvcc_runtime** out) {
  if (bad(artifact_path, "artifact_path") || bad(out, "out")) return KVCC_BAD_ARGUMENT;
  return guarded([&] {
    kvcc::RuntimeOptions o;
    o.max_pages = max_pages;
    o.max_sequences = max_sequences;
    o.memory = memory ? kvcc::PoolMemory::Device : kvcc::PoolMemory::Host;
    if (rank != 0 || ranks != 1) {  // one rank: the whole model (its shape is checked by the load)
      const kvcc::KvHeadRange slice = kvcc::kv_head_slice(n_kv_heads, rank, ranks);
      o.kv_begin = slice.begin;
      o.kv_end = slice.end;
    }
    auto h = std::make_unique<kvcc_runtime>();
    h->rt = kvcc::Runtime::load(artifact_path, kvcc::EngineShape{n_layers, n_heads, n_kv_heads, head_dim}, o);
    *out = h.release();
  });
}

void kvcc_runtime_free(kvcc_runtime* rt) { delete rt; }

int kvcc_add_sequence(kvcc_runtime* rt, int* seq) {
  if (bad(rt, "runtime") || bad(seq, "seq")) return KVCC_BAD_ARGUMENT;
  return guarded([&] { *seq = rt->rt->cache().add_sequence(); });
}
int kvcc_fork_sequence(kvcc_runtime* rt, int parent, int* seq, void* stream) {
  if (bad(rt, "runtime") || bad(seq, "seq")) return KVCC_BAD_ARGUMENT;
  return guarded([&] { *seq = rt->rt->cache().fork(parent, stream); });
}
int kvcc_free_sequence(kvcc_runtime* rt, int seq) {
  if (bad(rt, "runtime")) return KVCC_BAD_ARGUMENT;
  return guarded([&] { rt->rt->cache().free_sequence(seq); });
}
int kvcc_sequence_length(kvcc_runtime* rt, int seq, int64_t* length) {
  if (bad(rt, "runtime") || bad(length, "length")) return KVCC_BAD_ARGUMENT;
  return guarded([&] { *length = rt->rt->cache().length(seq); });
}
int kvcc_begin_append(kvcc_runtime* rt, int n_seqs, const int* seqs, const int* counts) {
  if (bad(rt, "runtime") || (n_seqs > 0 && (bad(seqs, "seqs") || bad(counts, "counts")))) return KVCC_BAD_ARGUMENT;
  return guarded(
      [&] { rt->rt->begin_append(std::vector<int>(seqs, seqs + n_seqs), std::vector<int>(counts, counts + n_seqs)); });
}
int kvcc_append(kvcc_runtime* rt, int layer, const float* k, const float* v, void* stream) {
  if (bad(rt, "runtime") || bad(k, "k") || bad(v, "v")) return KVCC_BAD_ARGUMENT;
  return guarded([&] { rt->rt->append(layer, k, v, stream); });
}
int kvcc_decode(kvcc_runtime* rt, int layer, int n_seqs, const int* seqs, const float* q, float* out, void* stream) {
  if (bad(rt, "runtime") || bad(q, "q") || bad(out, "out") || (n_seqs > 0 && bad(seqs, "seqs")))
    return KVCC_BAD_ARGUMENT;
  return guarded([&] { rt->rt->decode(layer, std::vector<int>(seqs, seqs + n_seqs), q, out, stream); });
}
int kvcc_prefill(kvcc_runtime* rt, int layer, int seq, int T, const float* q, const float* k, const float* v,
                 float* out, void* stream) {
  if (bad(rt, "runtime") || (T > 0 && (bad(q, "q") || bad(k, "k") || bad(v, "v") || bad(out, "out"))))
    return KVCC_BAD_ARGUMENT;
  return guarded([&] { rt->rt->prefill(layer, seq, T, q, k, v, out, stream); });
}
int kvcc_bytes_in_use(kvcc_runtime* rt, int64_t* bytes) {
  if (bad(rt, "runtime") || bad(bytes, "bytes")) return KVCC_BAD_ARGUMENT;
  return guarded([&] { *bytes = int64_t(rt->rt->cache().bytes_in_use()); });
}
const char* kvcc_last_error(void) { return last_error.c_str(); }

}  // extern "C"
