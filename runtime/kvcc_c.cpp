#include "runtime/kvcc_c.h"

#include <algorithm>
#include <exception>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "formats/artifact.h"
#include "formats/artifact_json.h"
#include "formats/error.h"
#include "formats/kv_layout.h"
#include "formats/model_file.h"
#include "runtime/kvcc_runtime.h"

struct kvcc_runtime {
  std::unique_ptr<kvcc::Runtime> rt;
  std::string problem;  // kvcc_step_problem's last message
};

namespace {
thread_local std::string last_error;
thread_local std::string described;      // kvcc_artifact_describe's result
thread_local std::string fingerprinted;  // kvcc_model_fingerprint's result

nlohmann::json fingerprint_json(const kvcc::ModelFingerprint& f) {
  nlohmann::json fields = nlohmann::json::array();
  for (const auto& [name, value] : f.fields) fields.push_back({name, value});
  return {{"id", f.id}, {"weights_sha256", f.weights_sha256}, {"fields", fields}};
}

// [min, max] of one side's clip ratio over all heads, and the heads that use a level table.
nlohmann::json side_summary(const kvcc::Artifact& a, bool key) {
  double lo = std::numeric_limits<double>::infinity(), hi = -lo;
  int tables = 0;
  for (const kvcc::HeadArtifact& h : a.heads) {
    const kvcc::SideArtifact& s = key ? h.key : h.value;
    lo = std::min(lo, s.clip_ratio);
    hi = std::max(hi, s.clip_ratio);
    tables += s.levels.empty() ? 0 : 1;
  }
  if (a.heads.empty()) return {{"clip_ratio", nullptr}, {"level_tables", 0}};
  return {{"clip_ratio", {lo, hi}}, {"level_tables", tables}};
}

// How the runtime would hold the artifact: its cache layout, whether it serves it (and why not),
// and whether the GPU kernels do.
nlohmann::json cache_json(const kvcc::Artifact& a) {
  std::string refusal;
  try {
    kvcc::check_artifact_for_engine(a, kvcc::EngineShape{a.n_layers, a.n_heads, a.n_kv_heads, a.head_dim});
  } catch (const kvcc::Error& e) {
    refusal = e.what();
  }
  const kvcc::KvGeometry g = kvcc::cache_geometry(a);
  const std::vector<kvcc::BlockWidths> widths =
      refusal.empty() ? kvcc::cache_widths(a) : std::vector<kvcc::BlockWidths>{};
  return {{"served", refusal.empty()},
          {"refusal", refusal},
          {"gpu_refusal", refusal.empty() ? kvcc::device_scope_problem(g, a.n_heads, widths) : refusal},
          {"keys", g.per_channel_keys() ? "per_channel" : "per_token"},
          {"key_group_tokens", g.key_group_tokens},
          {"key_pair_bytes", g.per_channel_keys() ? g.key_pair_bytes : 0},
          {"value_group", g.group},
          {"page_bytes", refusal.empty() ? kvcc::PageLayout(g, widths).page_bytes() : g.page_bytes()},
          {"slot_bytes", g.window_slot_bytes()}};
}

std::string describe(const kvcc::Artifact& a) {
  const kvcc::Recipe& r = a.recipe;
  const nlohmann::json k = side_summary(a, true), v = side_summary(a, false);
  const nlohmann::json j = {
      {"format_version", a.format_version},
      {"producer", a.producer},
      {"created", a.created},
      {"command", a.command},
      {"model_id", a.model_id},
      {"n_layers", a.n_layers},
      {"n_heads", a.n_heads},
      {"n_kv_heads", a.n_kv_heads},
      {"head_dim", a.head_dim},
      {"rope_style", kvcc::rope_style_name(a.rope_style)},
      {"fingerprint", fingerprint_json(a.fingerprint)},
      {"recipe", kvcc::recipe_json<nlohmann::json>(r)},
      {"clip_ratio", {{"key", k["clip_ratio"]}, {"value", v["clip_ratio"]}}},
      {"level_tables", {{"key", k["level_tables"]}, {"value", v["level_tables"]}}},
      {"cache", cache_json(a)},
      {"provenance",
       {{"source", a.provenance.source},
        {"tokens", a.provenance.tokens},
        {"sequences", a.provenance.sequences},
        {"seed", a.provenance.seed},
        {"data_sha256", a.provenance.data_sha256},
        {"stats_sha256", a.provenance.stats_sha256}}},
  };
  // Replacement of invalid UTF-8 (free text fields) rather than a throw: a description never fails
  // on a byte the artifact was allowed to hold.
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

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
bool negative(int n, const char* what) {
  if (n >= 0) return false;
  last_error = std::string(what) + " " + std::to_string(n) + " is negative";
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
  return kvcc_runtime_load_limits(artifact_path, n_layers, n_heads, n_kv_heads, head_dim, max_pages, max_sequences,
                                  memory, rank, ranks, 0, 0, 0, KVCC_FLOAT32, out);
}

namespace {
int load_runtime(const char* artifact_path, int n_layers, int n_heads, int n_kv_heads, int head_dim, int64_t max_pages,
                 int max_sequences, int memory, int rank, int ranks, int max_batch, int64_t max_context,
                 int max_step_tokens, int activations, bool engine_tables, kvcc_runtime** out) {
  if (bad(artifact_path, "artifact_path") || bad(out, "out")) return KVCC_BAD_ARGUMENT;
  if (activations != KVCC_FLOAT32 && activations != KVCC_BFLOAT16) {
    last_error = "activations must be KVCC_FLOAT32 (0) or KVCC_BFLOAT16 (1), got " + std::to_string(activations);
    return KVCC_BAD_ARGUMENT;
  }
  return guarded([&] {
    kvcc::RuntimeOptions o;
    o.max_pages = max_pages;
    o.max_sequences = max_sequences;
    o.memory = memory ? kvcc::PoolMemory::Device : kvcc::PoolMemory::Host;
    o.max_batch = max_batch;
    o.max_context = max_context;
    o.max_step_tokens = max_step_tokens;
    o.activations = activations == KVCC_BFLOAT16 ? kvcc::Activations::BFloat16 : kvcc::Activations::Float32;
    o.engine_tables = engine_tables;
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
}  // namespace

int kvcc_runtime_load_limits(const char* artifact_path, int n_layers, int n_heads, int n_kv_heads, int head_dim,
                             int64_t max_pages, int max_sequences, int memory, int rank, int ranks, int max_batch,
                             int64_t max_context, int max_step_tokens, int activations, kvcc_runtime** out) {
  return load_runtime(artifact_path, n_layers, n_heads, n_kv_heads, head_dim, max_pages, max_sequences, memory, rank,
                      ranks, max_batch, max_context, max_step_tokens, activations, false, out);
}

int kvcc_runtime_load_engine(const char* artifact_path, int n_layers, int n_heads, int n_kv_heads, int head_dim,
                             int64_t max_pages, int max_sequences, int memory, int rank, int ranks, int max_batch,
                             int64_t max_context, int max_step_tokens, int activations, kvcc_runtime** out) {
  return load_runtime(artifact_path, n_layers, n_heads, n_kv_heads, head_dim, max_pages, max_sequences, memory, rank,
                      ranks, max_batch, max_context, max_step_tokens, activations, true, out);
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
int kvcc_begin_append_stream(kvcc_runtime* rt, int n_seqs, const int* seqs, const int* counts, void* stream) {
  if (bad(rt, "runtime") || (n_seqs > 0 && (bad(seqs, "seqs") || bad(counts, "counts")))) return KVCC_BAD_ARGUMENT;
  return guarded([&] {
    rt->rt->begin_append(std::vector<int>(seqs, seqs + n_seqs), std::vector<int>(counts, counts + n_seqs), stream);
  });
}
int kvcc_append(kvcc_runtime* rt, int layer, const void* k, const void* v, void* stream) {
  if (bad(rt, "runtime") || bad(k, "k") || bad(v, "v")) return KVCC_BAD_ARGUMENT;
  return guarded([&] { rt->rt->append(layer, k, v, stream); });
}
int kvcc_decode(kvcc_runtime* rt, int layer, int n_seqs, const int* seqs, const void* q, void* out, void* stream) {
  if (bad(rt, "runtime") || bad(q, "q") || bad(out, "out") || (n_seqs > 0 && bad(seqs, "seqs")))
    return KVCC_BAD_ARGUMENT;
  return guarded([&] { rt->rt->decode(layer, std::vector<int>(seqs, seqs + n_seqs), q, out, stream); });
}
int kvcc_prefill(kvcc_runtime* rt, int layer, int n_seqs, const int* seqs, const int* counts, const void* q,
                 const void* k, const void* v, void* out, void* stream) {
  if (bad(rt, "runtime") || (n_seqs > 0 && (bad(seqs, "seqs") || bad(counts, "counts"))) ||
      (n_seqs > 0 && (bad(q, "q") || bad(k, "k") || bad(v, "v") || bad(out, "out"))))
    return KVCC_BAD_ARGUMENT;
  if (negative(n_seqs, "kvcc_prefill: n_seqs")) return KVCC_BAD_ARGUMENT;
  return guarded([&] {
    rt->rt->prefill(layer, std::vector<int>(seqs, seqs + n_seqs), std::vector<int>(counts, counts + n_seqs), q, k, v,
                    out, stream);
  });
}
int kvcc_begin_step(kvcc_runtime* rt, int batch, const int32_t* slots, const int32_t* lengths, const int32_t* counts,
                    const int32_t* block_table, int stride, int rows, void* stream) {
  if (bad(rt, "runtime")) return KVCC_BAD_ARGUMENT;
  return guarded([&] {
    rt->rt->begin_step(kvcc::EngineStep{batch, slots, lengths, counts, block_table, stride, rows}, stream);
  });
}
int kvcc_decode_step(kvcc_runtime* rt, int layer, const void* q, void* out, void* stream) {
  if (bad(rt, "runtime") || bad(q, "q") || bad(out, "out")) return KVCC_BAD_ARGUMENT;
  return guarded([&] { rt->rt->decode_step(layer, q, out, stream); });
}
int kvcc_prefill_engine(kvcc_runtime* rt, int layer, int n_seqs, const int* slots, const int64_t* lengths,
                        const int32_t* const* pages, const int* counts, const void* q, const void* k, const void* v,
                        void* out, void* stream) {
  if (bad(rt, "runtime") ||
      (n_seqs > 0 && (bad(slots, "slots") || bad(lengths, "lengths") || bad(pages, "pages") || bad(counts, "counts") ||
                      bad(q, "q") || bad(k, "k") || bad(v, "v") || bad(out, "out"))))
    return KVCC_BAD_ARGUMENT;
  if (negative(n_seqs, "kvcc_prefill_engine: n_seqs")) return KVCC_BAD_ARGUMENT;
  return guarded([&] {
    std::vector<kvcc::EngineSequence> seqs(static_cast<size_t>(n_seqs));
    for (int i = 0; i < n_seqs; ++i) seqs[size_t(i)] = {slots[i], lengths[i], pages[i]};
    rt->rt->prefill(layer, seqs, std::vector<int>(counts, counts + n_seqs), q, k, v, out, stream);
  });
}
int kvcc_step_problem(kvcc_runtime* rt, void* stream, const char** message) {
  if (bad(rt, "runtime") || bad(message, "message")) return KVCC_BAD_ARGUMENT;
  return guarded([&] {
    rt->problem = rt->rt->step_problem(stream);
    *message = rt->problem.c_str();
  });
}
int kvcc_bytes_in_use(kvcc_runtime* rt, int64_t* bytes) {
  if (bad(rt, "runtime") || bad(bytes, "bytes")) return KVCC_BAD_ARGUMENT;
  return guarded([&] { *bytes = int64_t(rt->rt->cache().bytes_in_use()); });
}
int kvcc_attention_scores(kvcc_runtime* rt, int layer, int seq, int W, const void* q, float* scores, void* stream) {
  if (bad(rt, "runtime") || bad(q, "q") || bad(scores, "scores")) return KVCC_BAD_ARGUMENT;
  return guarded([&] { rt->rt->attention_scores(layer, seq, W, q, scores, stream); });
}
int kvcc_evict_tokens(kvcc_runtime* rt, int seq, int64_t n_kept, const int64_t* kept, void* stream, int64_t* released) {
  if (bad(rt, "runtime") || (n_kept > 0 && bad(kept, "kept"))) return KVCC_BAD_ARGUMENT;
  if (n_kept < 0) {
    last_error = "negative count of kept tokens: " + std::to_string(n_kept);
    return KVCC_BAD_ARGUMENT;
  }
  return guarded([&] {
    const int64_t n = rt->rt->evict_tokens(seq, std::vector<int64_t>(kept, kept + n_kept), stream);
    if (released) *released = n;
  });
}
const char* kvcc_last_error(void) { return last_error.c_str(); }

const char* kvcc_version(void) { return KVCC_VERSION; }

int kvcc_artifact_describe(const char* artifact_path, const char** json) {
  if (bad(artifact_path, "artifact_path") || bad(json, "json")) return KVCC_BAD_ARGUMENT;
  return guarded([&] {
    described = describe(kvcc::read_artifact(artifact_path));
    *json = described.c_str();
  });
}

int kvcc_model_fingerprint(const char* model_path, const char** json) {
  if (bad(model_path, "model_path") || bad(json, "json")) return KVCC_BAD_ARGUMENT;
  return guarded([&] {
    fingerprinted = fingerprint_json(kvcc::ModelFile::open(model_path).fingerprint())
                        .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    *json = fingerprinted.c_str();
  });
}

int kvcc_history_pages(int sink, int recent, int page_size, int64_t tokens, int64_t* pages) {
  if (bad(pages, "pages")) return KVCC_BAD_ARGUMENT;
  return guarded([&] {
    KVCC_REQUIRE(page_size > 0 && sink >= 0 && recent >= page_size && tokens >= 0,
                 "kvcc_history_pages: need page_size > 0, sink >= 0, recent >= page_size and tokens >= 0 (got sink " +
                     std::to_string(sink) + ", recent " + std::to_string(recent) + ", page_size " +
                     std::to_string(page_size) + ", tokens " + std::to_string(tokens) + ")");
    kvcc::KvGeometry g;
    g.sink = sink;
    g.recent = recent;
    g.page_tokens = page_size;
    *pages = kvcc::history_pages(g, tokens);
  });
}

}  // extern "C"
