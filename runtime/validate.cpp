#include "runtime/validate.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <type_traits>

#include "formats/codec_commvq.h"
#include "formats/error.h"
#include "formats/kv_layout.h"
#include "formats/tokenizer.h"
#include "runtime/forward.h"
#include "runtime/kvcc_runtime.h"

#if defined(KVCC_HAVE_CUDA)
#include <cuda_runtime.h>
#endif

namespace kvcc {

namespace {
// The value `name` names among `choices`; Error listing them otherwise.
template <typename E>
E from_name(const std::string& name, std::initializer_list<std::pair<const char*, E>> choices, const char* what) {
  std::string list;
  for (const auto& [n, e] : choices) {
    if (name == n) return e;
    list += (list.empty() ? "" : " | ") + std::string(n);
  }
  throw Error("unknown validation " + std::string(what) + " '" + name + "' (" + list + ")");
}
}  // namespace

ValidateMode validate_mode_from_name(const std::string& name) {
  return from_name<ValidateMode>(name, {{"pseudo-decode", ValidateMode::PseudoDecode}, {"static", ValidateMode::Static}},
                                 "mode");
}

const char* validate_mode_name(ValidateMode mode) {
  return mode == ValidateMode::PseudoDecode ? "pseudo-decode" : "static";
}

ValidatePrecision validate_precision_from_name(const std::string& name) {
  return from_name<ValidatePrecision>(name, {{"float", ValidatePrecision::Float}, {"double", ValidatePrecision::Double}},
                                      "precision");
}

const char* validate_precision_name(ValidatePrecision precision) {
  return precision == ValidatePrecision::Float ? "float" : "double";
}

ValidateCache validate_cache_from_name(const std::string& name) {
  return from_name<ValidateCache>(name, {{"codec", ValidateCache::Codec}, {"runtime", ValidateCache::Runtime}},
                                  "cache path");
}

ValidateDevice validate_device_from_name(const std::string& name) {
  return from_name<ValidateDevice>(
      name, {{"auto", ValidateDevice::Auto}, {"cpu", ValidateDevice::Cpu}, {"gpu", ValidateDevice::Gpu}}, "device");
}

bool cuda_device_present() {
#if defined(KVCC_HAVE_CUDA)
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return false;
  }
  return n > 0;
#else
  return false;
#endif
}

namespace {
// A scheme named `name` with the artifact's windows and page size (either cache path).
CacheScheme artifact_scheme(const Artifact& artifact, const std::string& name) {
  CacheScheme s;
  s.name = name;
  s.sink = artifact.recipe.sink;
  s.recent = artifact.recipe.recent;
  s.page_size = artifact.recipe.page_size;
  s.artifact = &artifact;
  return s;
}
}  // namespace

CacheScheme runtime_scheme_from_artifact(const Artifact& artifact, const std::string& name,
                                         const ModelConfig& config, ValidateDevice device) {
  CacheScheme s = artifact_scheme(artifact, name);
  s.cache = ValidateCache::Runtime;
  const EngineShape engine{config.n_layers, config.n_heads, config.n_kv_heads, config.head_dim};
  std::string scope;  // why the device pool cannot serve it: checked up front, so that `auto` can
                      // pick the host pool instead of failing mid-run
  try {
    // A host runtime with no pages checks everything the real one will: method, bits, group,
    // shapes, and the windows the cache accepts (pages of a multiple of 16 tokens, ring >= page).
    Runtime probe(artifact, engine, RuntimeOptions{0, 1, PoolMemory::Host, 0.0f});
    scope = device_scope_problem(probe.geometry());
  } catch (const Error& e) {
    throw Error("artifact " + name + " cannot be validated through the runtime (--cache runtime): " + e.what() +
                "; use --cache codec");
  }
  switch (device) {
    case ValidateDevice::Cpu:
      s.pool = PoolMemory::Host;
      break;
    case ValidateDevice::Gpu:
#if !defined(KVCC_HAVE_CUDA)
      throw Error("--device gpu: this kvcc was built without CUDA (use --device cpu or auto)");
#endif
      require(cuda_device_present(), "--device gpu: no CUDA device is present (use --device cpu or auto)");
      require(scope.empty(), "artifact " + name + " is outside the GPU kernels' scope: " + scope +
                                 " (use --device cpu or auto: the host pool serves it)");
      s.pool = PoolMemory::Device;
      break;
    case ValidateDevice::Auto:
      s.pool = scope.empty() && cuda_device_present() ? PoolMemory::Device : PoolMemory::Host;
      break;
  }
  return s;
}

CacheScheme scheme_from_artifact(const Artifact& artifact, const std::string& name,
                                 const ModelConfig& config) {
  CacheScheme s = artifact_scheme(artifact, name);
  const Artifact* a = &artifact;
  if (artifact.recipe.method == "commvq") {
    // Codebooks decoded once per (layer, KV head); keys are coded pre-RoPE at their positions.
    struct Books {
      std::vector<CommvqKeyCodebook> keys;
      std::vector<CommvqValueCodebook> values;
      std::vector<double> inv_freq;
    };
    auto books = std::make_shared<Books>();
    books->inv_freq = rope_inv_freq(config);
    for (const HeadArtifact& h : artifact.heads) {
      books->keys.push_back(commvq_key_codebook(h.key, artifact.head_dim, artifact.rope_style));
      books->values.push_back(commvq_value_codebook(h.value, artifact.head_dim, true));
    }
    const int n_kv = artifact.n_kv_heads, d = artifact.head_dim;
    s.codec = [books, n_kv, d](int layer, KvSide side, const float* rows, int n, int64_t first_position,
                               float* out) {
      const size_t kvdim = size_t(n_kv) * d;
      std::vector<float> head_rows(size_t(n) * d), head_out(size_t(n) * d);
      std::vector<int32_t> positions(static_cast<size_t>(n));
      for (int t = 0; t < n; ++t) positions[size_t(t)] = int32_t(first_position + t);
      for (int h = 0; h < n_kv; ++h) {  // CommVQ's codebooks are per KV head
        for (int t = 0; t < n; ++t)
          std::copy_n(rows + size_t(t) * kvdim + size_t(h) * d, d, head_rows.data() + size_t(t) * d);
        const size_t index = size_t(layer) * size_t(n_kv) + size_t(h);
        if (side == KvSide::Value)
          commvq_roundtrip_values(books->values[index], head_rows.data(), size_t(n), head_out.data());
        else
          commvq_roundtrip_keys(books->keys[index], head_rows.data(), positions.data(), size_t(n),
                                books->inv_freq, true, head_out.data());
        for (int t = 0; t < n; ++t)
          std::copy_n(head_out.data() + size_t(t) * d, d, out + size_t(t) * kvdim + size_t(h) * d);
      }
    };
    return s;
  }
  s.codec = [a](int layer, KvSide side, const float* rows, int n, int64_t, float* out) {
    roundtrip_layer_page(*a, layer, side, rows, n, out);
  };
  return s;
}

void check_artifact_matches(const Artifact& artifact, const ModelFile& model,
                            const std::string& artifact_name) {
  const ModelConfig& c = model.config();
  auto shape = [&](const char* what, int have, int want) {
    require(have == want, "artifact " + artifact_name + " was compiled for another model: " + what +
                              " " + std::to_string(have) + " vs the model's " + std::to_string(want));
  };
  shape("n_layers", artifact.n_layers, c.n_layers);
  shape("n_kv_heads", artifact.n_kv_heads, c.n_kv_heads);
  shape("n_heads", artifact.n_heads, c.n_heads);
  shape("head_dim", artifact.head_dim, c.head_dim);
  require(artifact.rope_style == c.rope_style,
          "artifact " + artifact_name + " was compiled for another model: RoPE " +
              rope_style_name(artifact.rope_style) + " vs the model's " + rope_style_name(c.rope_style));
  if (!artifact.fingerprint.id.empty() && !artifact.fingerprint.matches(model.fingerprint()))
    throw Error("artifact " + artifact_name + " was compiled for another model: " +
                artifact.fingerprint.describe_difference(model.fingerprint()));
  require(artifact.heads.size() == size_t(c.n_layers) * size_t(c.n_kv_heads),
          "artifact " + artifact_name + " holds " + std::to_string(artifact.heads.size()) +
              " heads, the model needs " + std::to_string(c.n_layers * c.n_kv_heads));
}

double effective_bits_at_lengths(const Recipe& recipe, int head_dim, const std::vector<int64_t>& lengths) {
  double bits = 0, elements = 0;
  for (int64_t n : lengths) {
    if (n <= 0) continue;
    bits += double(n) * effective_bits(recipe, head_dim, n);
    elements += double(n);
  }
  require(elements > 0, "effective bits need at least one evaluated token");
  return bits / elements;
}

double clustered_standard_error(const std::vector<double>& values, const std::vector<double>& weights) {
  require(values.size() == weights.size(), "clustered_standard_error: values and weights differ in length");
  const size_t D = values.size();
  if (D < 2) return std::numeric_limits<double>::quiet_NaN();
  double w_sum = 0, wx_sum = 0;
  for (size_t i = 0; i < D; ++i) {
    require(weights[i] > 0, "clustered_standard_error: weights must be positive");
    w_sum += weights[i];
    wx_sum += weights[i] * values[i];
  }
  const double mean = wx_sum / w_sum;
  double ss = 0;
  for (size_t i = 0; i < D; ++i) {
    const double r = weights[i] * (values[i] - mean);
    ss += r * r;
  }
  return std::sqrt(double(D) / double(D - 1) * ss) / w_sum;
}

namespace {

// History tokens (post-sink, whole pages) of a sequence of n tokens: the runtime's tiers_of. With
// a ring smaller than a page (which the runtime does not serve) only whole pages are quantised.
int64_t history_tokens(const CacheScheme& s, int64_t n) {
  KvGeometry g;
  g.sink = s.sink;
  g.recent = s.recent;
  g.page_tokens = s.page_size;
  const int64_t post = n - std::min<int64_t>(n, s.sink);
  return std::min(tiers_of(g, n).hist_tokens, post / s.page_size * s.page_size);
}

// One layer's cache of one sequence as attention sees it: [length, kv_dim] keys and values, with
// quantised pages replaced by their dequantised rows.
template <typename S>
struct LayerCache {
  std::vector<S> keys, values;
  int64_t length = 0, quantised = 0;  // quantised: post-sink tokens already in pages
};

// Appends T rows to the cache and quantises the pages the policy now moves into history. Pages
// are quantised from the full-precision rows (the ring holds them unquantised until then); a
// page's rows [P, kv_dim] are contiguous in the cache and go to the codec as one block.
template <typename S>
void append_rows(const ModelConfig& c, const CacheScheme& s, int layer, LayerCache<S>& cache, const S* key,
                 const S* value, int T) {
  const size_t kvdim = size_t(c.n_kv_heads) * c.head_dim;
  cache.keys.insert(cache.keys.end(), key, key + size_t(T) * kvdim);
  cache.values.insert(cache.values.end(), value, value + size_t(T) * kvdim);
  cache.length += T;
  if (!s.codec) return;
  const int64_t target = history_tokens(s, cache.length);
  const int P = s.page_size;
  const size_t page = size_t(P) * kvdim;
  std::vector<float> rows(std::is_same_v<S, float> ? 0 : page), out(page);
  for (; cache.quantised < target; cache.quantised += P) {
    const int64_t first = std::min<int64_t>(cache.length, s.sink) + cache.quantised;
    for (const KvSide side : {KvSide::Key, KvSide::Value}) {
      S* base = (side == KvSide::Key ? cache.keys : cache.values).data() + size_t(first) * kvdim;
      if constexpr (std::is_same_v<S, float>) {
        s.codec(layer, side, base, P, first, out.data());
        std::copy(out.begin(), out.end(), base);
      } else {
        // Double mode (header): the codec sees the page in float; its change is applied in double.
        for (size_t i = 0; i < page; ++i) rows[i] = float(base[i]);
        s.codec(layer, side, rows.data(), P, first, out.data());
        for (size_t i = 0; i < page; ++i) base[i] += double(out[i]) - double(rows[i]);
      }
    }
  }
}

// log-softmax of one logits row in double.
template <typename S>
void log_softmax(const S* logits, int V, std::vector<double>& out) {
  out.resize(size_t(V));
  double m = -std::numeric_limits<double>::infinity();
  for (int v = 0; v < V; ++v) m = std::max(m, double(logits[v]));
  double sum = 0;
  for (int v = 0; v < V; ++v) sum += std::exp(double(logits[v]) - m);
  const double lse = m + std::log(sum);
  for (int v = 0; v < V; ++v) out[size_t(v)] = double(logits[v]) - lse;
}

// Sums over predictions: of all documents (in the order the float results have always been
// summed) and of the current document.
struct Accum {
  double nll = 0, kl = 0, top1 = 0;
  double doc_nll = 0, doc_kl = 0, doc_top1 = 0;
  std::vector<double> err_num, err_den;
};

// One runtime-path scheme: its Runtime (one window slot, pages for the longest document) and, for a
// device pool, the device copies of one block's q / k / v / out. Per document one sequence; per
// block begin_block, then per layer attend_and_append (Runtime::prefill's call order).
class RuntimeRun {
 public:
  RuntimeRun(const CacheScheme& s, const ModelConfig& c, int64_t max_length) : device_(s.pool == PoolMemory::Device) {
    const Artifact& a = *s.artifact;
    require(s.sink == a.recipe.sink && s.recent == a.recipe.recent && s.page_size == a.recipe.page_size,
            "scheme " + s.name + ": the runtime path serves the artifact recipe's windows and page size "
            "(set them in the recipe, not in the scheme)");
    const int64_t pages = max_length / std::max(1, a.recipe.page_size) + 1;
    rt_ = std::make_unique<Runtime>(a, EngineShape{c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim},
                                    RuntimeOptions{pages, 1, s.pool, 0.0f});
    qdim_ = size_t(c.n_heads) * c.head_dim;
    kvdim_ = size_t(c.n_kv_heads) * c.head_dim;
  }
  ~RuntimeRun() {
#if defined(KVCC_HAVE_CUDA)
    release();
#endif
  }
  RuntimeRun(const RuntimeRun&) = delete;
  RuntimeRun& operator=(const RuntimeRun&) = delete;

  void begin_document() { seq_ = rt_->cache().add_sequence(); }
  void end_document() {
    if (seq_ >= 0) rt_->cache().free_sequence(seq_);
    seq_ = -1;
  }
  void begin_block(int T) { rt_->begin_append({seq_}, {T}); }
  // The block's attention (out [T, n_heads·d]) over the cache plus itself, then the step's append
  // of (append_k, append_v): the block's own K/V, or the reference run's in static mode.
  void attend_and_append(int layer, int T, const float* q, const float* k, const float* v, const float* append_k,
                         const float* append_v, float* out) {
    if (!device_) {
      rt_->prefill(layer, seq_, T, q, k, v, out);
      rt_->append(layer, append_k, append_v);
      return;
    }
#if defined(KVCC_HAVE_CUDA)
    reserve(size_t(T));
    const size_t qb = size_t(T) * qdim_ * sizeof(float), kb = size_t(T) * kvdim_ * sizeof(float);
    // Synchronous copies on the legacy default stream, where the runtime queues its kernels: in order.
    copy(q_, q, qb, cudaMemcpyHostToDevice);
    copy(k_, k, kb, cudaMemcpyHostToDevice);
    copy(v_, v, kb, cudaMemcpyHostToDevice);
    rt_->prefill(layer, seq_, T, q_, k_, v_, out_);
    if (append_k != k) copy(k_, append_k, kb, cudaMemcpyHostToDevice);
    if (append_v != v) copy(v_, append_v, kb, cudaMemcpyHostToDevice);
    rt_->append(layer, k_, v_);
    copy(out, out_, qb, cudaMemcpyDeviceToHost);
    const cudaError_t e = cudaGetLastError();
    require(e == cudaSuccess, std::string("validate (runtime, GPU): ") + cudaGetErrorString(e));
#else
    throw Error("validate: a device pool without CUDA");
#endif
  }

 private:
#if defined(KVCC_HAVE_CUDA)
  void reserve(size_t tokens) {
    if (tokens <= cap_) return;
    release();
    auto alloc = [](float*& p, size_t n) {
      require(cudaMalloc(&p, n * sizeof(float)) == cudaSuccess,
              "validate (runtime, GPU): cannot allocate " + std::to_string(n * sizeof(float)) + " bytes");
    };
    alloc(q_, tokens * qdim_);
    alloc(k_, tokens * kvdim_);
    alloc(v_, tokens * kvdim_);
    alloc(out_, tokens * qdim_);
    cap_ = tokens;
  }
  void release() {
    for (float** p : {&q_, &k_, &v_, &out_}) {
      cudaFree(*p);
      *p = nullptr;
    }
    cap_ = 0;
  }
  static void copy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
    const cudaError_t e = cudaMemcpy(dst, src, bytes, kind);
    require(e == cudaSuccess, std::string("validate (runtime, GPU): copy failed: ") + cudaGetErrorString(e));
  }
#endif
  std::unique_ptr<Runtime> rt_;
  bool device_ = false;
  int seq_ = -1;
  size_t qdim_ = 0, kvdim_ = 0, cap_ = 0;
  float *q_ = nullptr, *k_ = nullptr, *v_ = nullptr, *out_ = nullptr;
};

// The lockstep run of validate_schemes in precision S (float or double): fills result's counts,
// per-document lists and acc (index 0 the reference, 1.. the schemes).
template <typename S>
void run_documents(const ModelFile& model, const std::vector<std::vector<int32_t>>& documents,
                   const std::vector<const CacheScheme*>& runs, ValidateMode mode, int block,
                   const std::function<void(const ValidateProgress&)>& progress, ValidateProgress prog,
                   std::chrono::steady_clock::time_point t0, ValidationResult& result, std::vector<Accum>& acc,
                   std::vector<std::vector<DocumentMetrics>>& per_doc, const std::vector<RuntimeRun*>& runtimes) {
  const ModelConfig& c = model.config();
  std::vector<BasicLayerWeights<S>> weights;
  for (int l = 0; l < c.n_layers; ++l) weights.push_back(load_layer<S>(model, l));
  const int hidden = c.hidden, V = c.vocab;
  const size_t qdim = size_t(c.n_heads) * c.head_dim, kvdim = size_t(c.n_kv_heads) * c.head_dim;
  const size_t R = runs.size();
  std::vector<S> x, q, key, value, attn, logits, all_k, all_v;
  std::vector<std::vector<S>> ref_attn(size_t(c.n_layers)), ref_key(size_t(c.n_layers)),
      ref_value(size_t(c.n_layers));
  std::vector<S> ref_logits;
  std::vector<double> lp_ref, lp_q;
  for (const auto& doc : documents) {
    ++prog.documents_done;
    if (doc.size() < 2) continue;
    const int64_t n = int64_t(doc.size());
    result.documents++;
    result.tokens += uint64_t(n);
    result.doc_lengths.push_back(n);
    for (Accum& a : acc) a.doc_nll = a.doc_kl = a.doc_top1 = 0;
    std::vector<std::vector<LayerCache<S>>> caches(R, std::vector<LayerCache<S>>(size_t(c.n_layers)));
    for (RuntimeRun* rt : runtimes)
      if (rt) rt->begin_document();
    for (int64_t b0 = 0; b0 < n; b0 += block) {
      const int T = int(std::min<int64_t>(block, n - b0));
      const int predict = int(std::min<int64_t>(T, n - 1 - b0));  // positions with a next token
      for (size_t r = 0; r < R; ++r) {
        const CacheScheme& s = *runs[r];
        x.resize(size_t(T) * hidden);
        embed(model, doc.data() + b0, T, x.data());
        q.resize(size_t(T) * qdim);
        key.resize(size_t(T) * kvdim);
        value.resize(size_t(T) * kvdim);
        attn.resize(size_t(T) * qdim);
        RuntimeRun* rt = runtimes[r];
        if (rt) rt->begin_block(T);
        for (int l = 0; l < c.n_layers; ++l) {
          LayerCache<S>& cache = caches[r][size_t(l)];
          attention_qkv(c, weights[size_t(l)], x.data(), T, int(b0), q.data(), nullptr, key.data(),
                        value.data());
          const bool from_reference = mode == ValidateMode::Static && r > 0;
          if (rt) {
            // The serving code: prefill over the cache + the block, then the step's append.
            if constexpr (std::is_same_v<S, float>)
              rt->attend_and_append(l, T, q.data(), key.data(), value.data(),
                                    from_reference ? ref_key[size_t(l)].data() : key.data(),
                                    from_reference ? ref_value[size_t(l)].data() : value.data(), attn.data());
            else
              throw Error("validate: the runtime cache path runs in float only");
          } else {
            // The block attends to the cache as stored plus its own rows in full precision.
            all_k = cache.keys;
            all_v = cache.values;
            all_k.insert(all_k.end(), key.begin(), key.end());
            all_v.insert(all_v.end(), value.begin(), value.end());
            prefix_causal_attention(c, cache.length, T, q.data(), all_k.data(), all_v.data(), attn.data());
          }
          if (r == 0) {
            ref_attn[size_t(l)] = attn;
            ref_key[size_t(l)] = key;
            ref_value[size_t(l)] = value;
          } else {
            double num = 0, den = 0;
            for (size_t i = 0; i < attn.size(); ++i) {
              const double diff = double(attn[i]) - double(ref_attn[size_t(l)][i]);
              num += diff * diff;
              den += double(ref_attn[size_t(l)][i]) * double(ref_attn[size_t(l)][i]);
            }
            acc[r].err_num[size_t(l)] += num;
            acc[r].err_den[size_t(l)] += den;
          }
          if (!rt)
            append_rows(c, s, l, cache, from_reference ? ref_key[size_t(l)].data() : key.data(),
                        from_reference ? ref_value[size_t(l)].data() : value.data(), T);
          attention_output_and_mlp(c, weights[size_t(l)], attn.data(), T, x.data());
        }
        logits.resize(size_t(T) * V);
        final_logits(model, x.data(), T, logits.data());
        for (S v : logits)
          require(std::isfinite(v), "non-finite logits in validation (" + s.name + ", position " +
                                        std::to_string(b0) + "+): the model or artifact holds NaNs");
        if (r == 0) ref_logits = logits;
        Accum& a = acc[r];
        for (int t = 0; t < predict; ++t) {
          const int target = doc[size_t(b0 + t + 1)];
          log_softmax(logits.data() + size_t(t) * V, V, lp_q);
          a.nll -= lp_q[size_t(target)];
          a.doc_nll -= lp_q[size_t(target)];
          if (r == 0) continue;
          log_softmax(ref_logits.data() + size_t(t) * V, V, lp_ref);
          double kl = 0;
          for (int v = 0; v < V; ++v) kl += std::exp(lp_ref[size_t(v)]) * (lp_ref[size_t(v)] - lp_q[size_t(v)]);
          a.kl += std::max(kl, 0.0);
          a.doc_kl += std::max(kl, 0.0);
          const auto am_ref = std::max_element(lp_ref.begin(), lp_ref.end()) - lp_ref.begin();
          const auto am_q = std::max_element(lp_q.begin(), lp_q.end()) - lp_q.begin();
          a.top1 += am_ref == am_q ? 1.0 : 0.0;
          a.doc_top1 += am_ref == am_q ? 1.0 : 0.0;
        }
      }
      result.predictions += uint64_t(predict);
      prog.tokens_done += uint64_t(T);
      prog.elapsed_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (progress) progress(prog);
    }
    for (RuntimeRun* rt : runtimes)
      if (rt) rt->end_document();
    const double p = double(n - 1);
    const double ref_nll = acc[0].doc_nll / p;
    result.reference_doc_nll.push_back(ref_nll);
    for (size_t r = 1; r < R; ++r) {
      DocumentMetrics m;
      m.nll = acc[r].doc_nll / p;
      m.kl = acc[r].doc_kl / p;
      m.top1_agreement = acc[r].doc_top1 / p;
      m.ppl_rel_change = std::exp(m.nll - ref_nll) - 1.0;
      per_doc[r - 1].push_back(m);
    }
  }
}

}  // namespace

ValidationResult validate_schemes(const ModelFile& model, const std::vector<std::vector<int32_t>>& documents,
                                  const std::vector<CacheScheme>& schemes, ValidateMode mode, int block,
                                  const std::function<void(const ValidateProgress&)>& progress,
                                  ValidatePrecision precision) {
  const auto t0 = std::chrono::steady_clock::now();
  const ModelConfig& c = model.config();
  require(block > 0, "validation block size must be positive");
  for (const CacheScheme& s : schemes) {
    require(s.page_size > 0 && s.sink >= 0 && s.recent >= 0,
            "scheme " + s.name + ": page size must be positive and windows non-negative");
    if (s.cache != ValidateCache::Runtime) continue;
    require(s.artifact, "scheme " + s.name + ": the runtime cache path needs an artifact");
    require(precision == ValidatePrecision::Float,
            "scheme " + s.name + ": the runtime cache path runs in float only (the kernels take float32 "
            "activations); --precision double is the codec path's exact check");
  }
  ValidationResult result;
  result.model = model.path();
  result.mode = validate_mode_name(mode);
  result.precision = validate_precision_name(precision);
  result.block = block;
  uint64_t tokens_total = 0;
  for (const auto& doc : documents)
    if (doc.size() >= 2) tokens_total += doc.size();
  require(tokens_total > 0, "no document with at least 2 tokens to validate on (empty text?)");

  const size_t S = schemes.size();
  // Index 0 is the full-precision reference, 1..S the schemes.
  std::vector<const CacheScheme*> runs(S + 1);
  CacheScheme reference;
  reference.name = "full precision";
  runs[0] = &reference;
  for (size_t i = 0; i < S; ++i) runs[i + 1] = &schemes[i];
  std::vector<Accum> acc(S + 1);
  for (Accum& a : acc) a.err_num.assign(size_t(c.n_layers), 0), a.err_den.assign(size_t(c.n_layers), 0);
  std::vector<std::vector<DocumentMetrics>> per_doc(S);

  // Runtime-path schemes get their Runtime (index r as in runs; null: codec path or reference).
  int64_t max_length = 0;
  for (const auto& doc : documents) max_length = std::max<int64_t>(max_length, int64_t(doc.size()));
  std::vector<std::unique_ptr<RuntimeRun>> owned;
  std::vector<RuntimeRun*> runtimes(S + 1, nullptr);
  for (size_t i = 0; i < S; ++i)
    if (schemes[i].cache == ValidateCache::Runtime) {
      owned.push_back(std::make_unique<RuntimeRun>(schemes[i], c, max_length));
      runtimes[i + 1] = owned.back().get();
    }

  ValidateProgress prog;
  prog.documents_total = documents.size();
  prog.tokens_total = tokens_total;
  if (precision == ValidatePrecision::Double)
    run_documents<double>(model, documents, runs, mode, block, progress, prog, t0, result, acc, per_doc, runtimes);
  else
    run_documents<float>(model, documents, runs, mode, block, progress, prog, t0, result, acc, per_doc, runtimes);

  const double P = double(result.predictions);
  result.reference_nll = acc[0].nll / P;
  result.reference_perplexity = std::exp(result.reference_nll);
  std::vector<double> weights;  // predictions per document
  for (int64_t len : result.doc_lengths) weights.push_back(double(len - 1));
  for (size_t i = 0; i < S; ++i) {
    const Accum& a = acc[i + 1];
    SchemeMetrics m;
    m.name = schemes[i].name;
    if (schemes[i].cache == ValidateCache::Runtime)
      m.cache = schemes[i].pool == PoolMemory::Device ? "runtime/gpu" : "runtime/cpu";
    m.nll = a.nll / P;
    m.perplexity = std::exp(m.nll);
    m.ppl_rel_change = m.perplexity / result.reference_perplexity - 1.0;
    m.kl = a.kl / P;
    m.top1_agreement = a.top1 / P;
    m.per_document = std::move(per_doc[i]);
    std::vector<double> kl, nll_diff;
    for (size_t d = 0; d < m.per_document.size(); ++d) {
      kl.push_back(m.per_document[d].kl);
      nll_diff.push_back(m.per_document[d].nll - result.reference_doc_nll[d]);
    }
    m.kl_stderr = clustered_standard_error(kl, weights);
    // d(e^Δ − 1)/dΔ = e^Δ at the mean paired difference Δ = nll − reference nll.
    m.ppl_rel_change_stderr = (1.0 + m.ppl_rel_change) * clustered_standard_error(nll_diff, weights);
    for (int l = 0; l < c.n_layers; ++l)
      m.layer_rel_error.push_back(a.err_den[size_t(l)] > 0 ? a.err_num[size_t(l)] / a.err_den[size_t(l)] : 0.0);
    if (const Artifact* art = schemes[i].artifact) {
      m.method = art->recipe.method;
      m.nominal_bits = nominal_bits(art->recipe);
      m.effective_bits = effective_bits_at_lengths(art->recipe, art->head_dim, result.doc_lengths);
    }
    result.schemes.push_back(m);
  }
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return result;
}

std::vector<std::vector<int32_t>> load_validation_documents(const ModelFile& model, const ValidateData& data) {
  const ModelConfig& c = model.config();
  std::vector<std::vector<int32_t>> docs;
  if (!data.ids_path.empty()) {
    docs = read_token_id_file(data.ids_path);
  } else {
    require(!data.data_path.empty(), "validation needs --data TEXT or --ids FILE");
    const std::string text = read_text_file(data.data_path, "validation text");
    const std::unique_ptr<Tokenizer> tok = Tokenizer::for_model(model.path(), c.vocab, data.tokenizer_path);
    docs = encode_documents(*tok, text, data.separator, c.add_bos);
  }
  const int max_len = data.max_seq_len > 0 ? data.max_seq_len
                                           : (c.max_position > 0 ? std::min(c.max_position, 2048) : 2048);
  std::vector<std::vector<int32_t>> out;
  uint64_t total = 0;
  for (auto& d : docs) {
    if (data.max_tokens > 0 && total >= data.max_tokens) break;
    if (int64_t(d.size()) > max_len) d.resize(size_t(max_len));
    if (data.max_tokens > 0 && total + d.size() > data.max_tokens) d.resize(size_t(data.max_tokens - total));
    if (d.size() < 2) continue;
    for (int32_t id : d)
      require(id >= 0 && id < c.vocab, "token id " + std::to_string(id) + " outside the model's vocabulary of " +
                                           std::to_string(c.vocab));
    total += d.size();
    out.push_back(std::move(d));
  }
  require(!out.empty(), "the validation input holds no document of at least 2 tokens (empty text?): " +
                            (data.ids_path.empty() ? data.data_path : data.ids_path));
  return out;
}

std::string format_table(const ValidationResult& r) {
  std::ostringstream o;
  char line[512];
  std::snprintf(line, sizeof line,
                "%s, %s, block %d, %s: %llu documents, %llu tokens; full-precision ppl %.4f\n", r.model.c_str(),
                r.mode.c_str(), r.block, r.precision.c_str(), (unsigned long long)r.documents,
                (unsigned long long)r.tokens, r.reference_perplexity);
  o << line;
  std::snprintf(line, sizeof line, "%-28s %-10s %-11s %7s %7s %10s %9s %7s %10s %9s %7s %10s\n", "scheme",
                "method", "cache", "nominal", "eff.", "ppl", "Δppl %", "±se", "KL", "±se", "top-1", "max layer");
  o << line;
  // A standard error needs 2 documents; "-" otherwise.
  auto se = [](double v, const char* fmt) {
    char b[32];
    if (std::isnan(v)) return std::string("-");
    std::snprintf(b, sizeof b, fmt, v);
    return std::string(b);
  };
  for (const SchemeMetrics& m : r.schemes) {
    const double max_err = m.layer_rel_error.empty()
                               ? 0.0
                               : *std::max_element(m.layer_rel_error.begin(), m.layer_rel_error.end());
    std::snprintf(line, sizeof line, "%-28s %-10s %-11s %7.3f %7.3f %10.4f %+9.3f %7s %10.3e %9s %7.4f %10.3e\n",
                  m.name.c_str(), m.method.c_str(), m.cache.c_str(), m.nominal_bits, m.effective_bits, m.perplexity,
                  100.0 * m.ppl_rel_change, se(100.0 * m.ppl_rel_change_stderr, "%.3f").c_str(), m.kl,
                  se(m.kl_stderr, "%.2e").c_str(), m.top1_agreement, max_err);
    o << line;
  }
  o << "(±se: standard error across documents; Δppl's from per-document paired NLL differences; cache: codec =\n"
       " simulated pages with float32 windows, runtime/cpu|gpu = the serving runtime's host|device pool)\n";
  return o.str();
}

std::string to_json(const ValidationResult& r) {
  // NaN (a standard error of one document) is written as null.
  auto num = [](double v) { return std::isnan(v) ? nlohmann::json(nullptr) : nlohmann::json(v); };
  nlohmann::json j;
  j["model"] = r.model;
  j["mode"] = r.mode;
  j["precision"] = r.precision;
  j["block"] = r.block;
  j["documents"] = r.documents;
  j["tokens"] = r.tokens;
  j["predictions"] = r.predictions;
  j["doc_lengths"] = r.doc_lengths;
  j["reference"] = {{"nll", r.reference_nll},
                    {"perplexity", r.reference_perplexity},
                    {"per_document_nll", r.reference_doc_nll}};
  j["stderr"] = "across documents (clusters): kl_stderr of the token-weighted mean KL; ppl_rel_change_stderr "
                "from the per-document paired NLL differences against the reference (delta method)";
  j["seconds"] = r.seconds;
  j["schemes"] = nlohmann::json::array();
  for (const SchemeMetrics& m : r.schemes) {
    nlohmann::json docs = nlohmann::json::array();
    for (size_t d = 0; d < m.per_document.size(); ++d) {
      const DocumentMetrics& dm = m.per_document[d];
      docs.push_back({{"tokens", d < r.doc_lengths.size() ? r.doc_lengths[d] : 0},
                      {"nll", dm.nll},
                      {"ppl_rel_change", dm.ppl_rel_change},
                      {"kl", dm.kl},
                      {"top1_agreement", dm.top1_agreement}});
    }
    j["schemes"].push_back({{"name", m.name},
                            {"method", m.method},
                            {"cache", m.cache},
                            {"nominal_bits", m.nominal_bits},
                            {"effective_bits", m.effective_bits},
                            {"nll", m.nll},
                            {"perplexity", m.perplexity},
                            {"ppl_rel_change", m.ppl_rel_change},
                            {"ppl_rel_change_stderr", num(m.ppl_rel_change_stderr)},
                            {"kl", m.kl},
                            {"kl_stderr", num(m.kl_stderr)},
                            {"top1_agreement", m.top1_agreement},
                            {"layer_rel_error", m.layer_rel_error},
                            {"per_document", docs}});
  }
  return j.dump(2) + "\n";
}

std::string to_svg(const ValidationResult& r) {
  // KL on a log axis against effective bits; one labelled point per scheme with its error bar.
  const double W = 720, H = 440, L = 80, R = 200, T = 40, B = 60;
  double bmin = 1e9, bmax = -1e9, kmin = 1e9, kmax = -1e9;
  // A bar spans KL ± its standard error on the log axis; a lower end at or below 0 is drawn a
  // decade below the point (so it does not stretch the axis).
  auto bar = [](const SchemeMetrics& m) {
    const double se = std::isnan(m.kl_stderr) ? 0.0 : m.kl_stderr, k = std::log10(std::max(m.kl, 1e-9));
    return std::pair{std::max(std::log10(std::max(m.kl - se, 1e-9)), k - 1), std::log10(std::max(m.kl + se, 1e-9))};
  };
  for (const SchemeMetrics& m : r.schemes) {
    bmin = std::min(bmin, m.effective_bits);
    bmax = std::max(bmax, m.effective_bits);
    const auto [lo, hi] = bar(m);
    kmin = std::min(kmin, lo);
    kmax = std::max(kmax, hi);
  }
  if (r.schemes.empty()) bmin = 0, bmax = 1, kmin = -3, kmax = 0;
  bmin -= 0.1, bmax += 0.1;
  kmin = std::floor(kmin), kmax = std::ceil(kmax);
  if (kmax <= kmin) kmax = kmin + 1;
  auto px = [&](double b) { return L + (b - bmin) / (bmax - bmin) * (W - L - R); };
  auto py = [&](double k) { return T + (kmax - k) / (kmax - kmin) * (H - T - B); };
  std::ostringstream o;
  o << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << H
    << "\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  o << "<text x=\"" << L << "\" y=\"24\" font-size=\"14\">KV-cache quality vs effective bits (" << r.mode
    << ", full-precision ppl " << r.reference_perplexity << ")</text>\n";
  o << "<line x1=\"" << L << "\" y1=\"" << H - B << "\" x2=\"" << W - R << "\" y2=\"" << H - B
    << "\" stroke=\"black\"/>\n<line x1=\"" << L << "\" y1=\"" << T << "\" x2=\"" << L << "\" y2=\"" << H - B
    << "\" stroke=\"black\"/>\n";
  for (double k = kmin; k <= kmax + 1e-9; k += 1)
    o << "<text x=\"" << L - 8 << "\" y=\"" << py(k) + 4 << "\" text-anchor=\"end\">1e" << int(k) << "</text>\n";
  for (int i = 0; i <= 4; ++i) {
    const double b = bmin + (bmax - bmin) * i / 4;
    char label[32];
    std::snprintf(label, sizeof label, "%.2f", b);
    o << "<text x=\"" << px(b) << "\" y=\"" << H - B + 18 << "\" text-anchor=\"middle\">" << label << "</text>\n";
  }
  o << "<text x=\"" << (L + W - R) / 2 << "\" y=\"" << H - 16 << "\" text-anchor=\"middle\">effective bits per element</text>\n";
  o << "<text x=\"18\" y=\"" << (T + H - B) / 2 << "\" transform=\"rotate(-90 18 " << (T + H - B) / 2
    << ")\" text-anchor=\"middle\">mean KL(full ‖ quantised), nats</text>\n";
  o << "<text x=\"" << W - R + 10 << "\" y=\"" << T + 12
    << "\" font-size=\"11\">bars: ±1 s.e. across documents</text>\n";
  for (const SchemeMetrics& m : r.schemes) {
    const double x = px(m.effective_bits), y = py(std::log10(std::max(m.kl, 1e-9)));
    const auto [lo, hi] = bar(m);
    const double y_lo = py(lo), y_hi = py(hi);
    o << "<line x1=\"" << x << "\" y1=\"" << y_lo << "\" x2=\"" << x << "\" y2=\"" << y_hi
      << "\" stroke=\"#1f77b4\"/>\n<line x1=\"" << x - 4 << "\" y1=\"" << y_lo << "\" x2=\"" << x + 4 << "\" y2=\""
      << y_lo << "\" stroke=\"#1f77b4\"/>\n<line x1=\"" << x - 4 << "\" y1=\"" << y_hi << "\" x2=\"" << x + 4
      << "\" y2=\"" << y_hi << "\" stroke=\"#1f77b4\"/>\n";
    o << "<circle cx=\"" << x << "\" cy=\"" << y << "\" r=\"4\" fill=\"#1f77b4\"/>\n<text x=\"" << x + 6
      << "\" y=\"" << y + 4 << "\">" << m.name << "</text>\n";
  }
  o << "</svg>\n";
  return o.str();
}

}  // namespace kvcc
