#include "eval/experiment.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <memory>
#include <type_traits>

#include "eval/runtime_run.h"
#include "formats/error.h"
#include "formats/kv_layout.h"
#include "model/forward.h"
#include "model/tokenizer.h"

namespace kvcc {

const char* validate_mode_name(ValidateMode mode) {
  return mode == ValidateMode::PseudoDecode ? "pseudo-decode" : "static";
}

const char* validate_precision_name(ValidatePrecision precision) {
  return precision == ValidatePrecision::Float ? "float" : "double";
}

namespace {

// Σ_docs len·bits_at(len) / Σ len over the documents with tokens.
template <typename BitsAt>
double length_weighted(const std::vector<int64_t>& lengths, BitsAt bits_at) {
  double bits = 0, elements = 0;
  for (int64_t n : lengths) {
    if (n <= 0) continue;
    bits += double(n) * bits_at(n);
    elements += double(n);
  }
  KVCC_REQUIRE(elements > 0, "bits per element need at least one evaluated token");
  return bits / elements;
}

}  // namespace

double effective_bits_at_lengths(const Recipe& recipe, int head_dim, const std::vector<int64_t>& lengths) {
  return length_weighted(lengths, [&](int64_t n) { return effective_bits(recipe, head_dim, n); });
}
double effective_bits_at_lengths(const Artifact& artifact, const std::vector<int64_t>& lengths) {
  return length_weighted(lengths, [&](int64_t n) { return effective_bits(artifact, n); });
}
double stored_bits_at_lengths(const Artifact& artifact, const std::vector<int64_t>& lengths) {
  return length_weighted(lengths, [&](int64_t n) { return stored_bits(artifact, n); });
}

double clustered_standard_error(const std::vector<double>& values, const std::vector<double>& weights) {
  KVCC_REQUIRE(values.size() == weights.size(), "clustered_standard_error: values and weights differ in length");
  const size_t D = values.size();
  if (D < 2) return std::numeric_limits<double>::quiet_NaN();
  double w_sum = 0, wx_sum = 0;
  for (size_t i = 0; i < D; ++i) {
    KVCC_REQUIRE(weights[i] > 0, "clustered_standard_error: weights must be positive");
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

// History tokens (post-sink, whole pages) of a sequence of n tokens: kv_layout.h's quantised_tokens.
int64_t history_tokens(const CacheScheme& s, int64_t n) {
  KvGeometry g;
  g.sink = s.sink;
  g.recent = s.recent;
  g.page_tokens = s.page_size;
  return quantised_tokens(g, n);
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
  const CodecPath* path = std::get_if<CodecPath>(&s.path);
  if (!path || !path->codec) return;
  const PageCodec& codec = path->codec;
  const int64_t target = history_tokens(s, cache.length);
  const int P = s.page_size;
  const size_t page = size_t(P) * kvdim;
  std::vector<float> rows(std::is_same_v<S, float> ? 0 : page), out(page);
  for (; cache.quantised < target; cache.quantised += P) {
    const int64_t first = std::min<int64_t>(cache.length, s.sink) + cache.quantised;
    for (const KvSide side : {KvSide::Key, KvSide::Value}) {
      S* base = (side == KvSide::Key ? cache.keys : cache.values).data() + size_t(first) * kvdim;
      if constexpr (std::is_same_v<S, float>) {
        codec(layer, side, base, P, first, out.data());
        std::copy(out.begin(), out.end(), base);
      } else {
        // Double mode (header): the codec sees the page in float; its change is applied in double.
        for (size_t i = 0; i < page; ++i) rows[i] = float(base[i]);
        codec(layer, side, rows.data(), P, first, out.data());
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
  double late_nll = 0, late_kl = 0, late_top1 = 0, doc_late_nll = 0, doc_late_kl = 0;
  std::vector<double> err_num, err_den;
};

// One runtime-path scheme: its Runtime (one window slot, pages for the longest document) and, for a
// device pool, the device copies of one block's q / k / v / out. Per document one sequence; per
// block begin_block, then per layer attend_and_append (Runtime::prefill's call order).
// per-document lists and acc (index 0 the reference, 1.. the schemes).
template <typename S>
void run_documents(const ModelFile& model, const std::vector<std::vector<int32_t>>& documents,
                   const std::vector<const CacheScheme*>& runs, ValidateMode mode, int block,
                   const std::function<void(const ValidateProgress&)>& progress, ValidateProgress prog,
                   std::chrono::steady_clock::time_point t0, ValidationResult& result, std::vector<Accum>& acc,
                   std::vector<std::vector<DocumentMetrics>>& per_doc, const std::vector<RuntimeRun*>& runtimes,
                   const LogitsSink& sink, int64_t late_from, std::vector<double>& reference_late_doc_nll) {
  const ModelConfig& c = model.config();
  std::vector<BasicLayerWeights<S>> weights;
  for (int l = 0; l < c.n_layers; ++l) weights.push_back(load_layer<S>(model, l));
  const int hidden = c.hidden, V = c.vocab;
  const size_t qdim = size_t(c.n_heads) * c.head_dim, kvdim = size_t(c.n_kv_heads) * c.head_dim;
  const size_t R = runs.size();
  std::vector<S> x, q, key, value, attn, logits, all_k, all_v;
  std::vector<std::vector<S>> ref_attn(size_t(c.n_layers)), ref_key(size_t(c.n_layers)), ref_value(size_t(c.n_layers));
  std::vector<S> ref_logits;
  std::vector<double> lp_ref, lp_q, row;
  for (const auto& doc : documents) {
    ++prog.documents_done;
    if (doc.size() < 2) continue;
    const int64_t n = int64_t(doc.size());
    result.documents++;
    result.tokens += uint64_t(n);
    result.doc_lengths.push_back(n);
    for (Accum& a : acc) a.doc_nll = a.doc_kl = a.doc_top1 = a.doc_late_nll = a.doc_late_kl = 0;
    // Predictions at positions >= late_from in this document.
    const int64_t doc_late = late_from > 0 ? std::max<int64_t>(0, n - 1 - late_from) : 0;
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
          attention_qkv(c, weights[size_t(l)], x.data(), T, int(b0), q.data(), nullptr, key.data(), value.data());
          const bool from_reference = mode == ValidateMode::Static && r > 0;
          if (rt) {
            // The serving code: prefill over the cache + the block, then the step's append.
            if constexpr (std::is_same_v<S, float>)
              rt->attend_and_append(l, T, q.data(), key.data(), value.data(),
                                    from_reference ? ref_key[size_t(l)].data() : key.data(),
                                    from_reference ? ref_value[size_t(l)].data() : value.data(), attn.data());
            else throw Error("validate: the runtime cache path runs in float only");
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
          if (!std::isfinite(v))
            throw Error("non-finite logits in validation (" + s.name + ", position " + std::to_string(b0) +
                        "+): the model or artifact holds NaNs");
        if (r == 0) ref_logits = logits;
        Accum& a = acc[r];
        for (int t = 0; t < predict; ++t) {
          const int target = doc[size_t(b0 + t + 1)];
          log_softmax(logits.data() + size_t(t) * V, V, lp_q);
          if (sink) {
            row.assign(logits.begin() + std::ptrdiff_t(size_t(t) * V),
                       logits.begin() + std::ptrdiff_t(size_t(t + 1) * V));
            sink(r, result.predictions + uint64_t(t), row.data(), lp_q.data(), V);
          }
          const bool late = late_from > 0 && b0 + t >= late_from;
          a.nll -= lp_q[size_t(target)];
          a.doc_nll -= lp_q[size_t(target)];
          if (late) {
            a.late_nll -= lp_q[size_t(target)];
            a.doc_late_nll -= lp_q[size_t(target)];
          }
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
          if (late) {
            a.late_kl += std::max(kl, 0.0);
            a.doc_late_kl += std::max(kl, 0.0);
            a.late_top1 += am_ref == am_q ? 1.0 : 0.0;
          }
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
    result.late_predictions += uint64_t(doc_late);
    for (size_t r = 1; r < R; ++r) {
      DocumentMetrics m;
      m.nll = acc[r].doc_nll / p;
      m.kl = acc[r].doc_kl / p;
      m.top1_agreement = acc[r].doc_top1 / p;
      m.ppl_rel_change = std::exp(m.nll - ref_nll) - 1.0;
      m.late_predictions = doc_late;
      if (doc_late > 0) {
        m.late_nll = acc[r].doc_late_nll / double(doc_late);
        m.late_kl = acc[r].doc_late_kl / double(doc_late);
      }
      per_doc[r - 1].push_back(m);
    }
    reference_late_doc_nll.push_back(doc_late > 0 ? acc[0].doc_late_nll / double(doc_late) : 0.0);
  }
}

}  // namespace

ValidationResult validate_schemes(const ModelFile& model, const std::vector<std::vector<int32_t>>& documents,
                                  const std::vector<CacheScheme>& schemes, ValidateMode mode, int block,
                                  const std::function<void(const ValidateProgress&)>& progress,
                                  ValidatePrecision precision, const LogitsSink& logits, int64_t late_from) {
  const auto t0 = std::chrono::steady_clock::now();
  const ModelConfig& c = model.config();
  KVCC_REQUIRE(block > 0, "validation block size must be positive");
  KVCC_REQUIRE(late_from >= 0,
               "validation: the late positions' start must not be negative, got " + std::to_string(late_from));
  for (const CacheScheme& s : schemes) {
    KVCC_REQUIRE(s.page_size > 0 && s.sink >= 0 && s.recent >= 0,
                 "scheme " + s.name + ": page size must be positive and windows non-negative");
    if (!s.on_runtime()) continue;
    KVCC_REQUIRE(s.artifact != nullptr, "scheme " + s.name + ": the runtime cache path needs an artifact");
    KVCC_REQUIRE(precision == ValidatePrecision::Float,
                 "scheme " + s.name +
                     ": the runtime cache path runs in float only (the kernels take float32 "
                     "activations); double precision is the codec path's exact check");
  }
  ValidationResult result;
  result.model = model.path();
  result.mode = validate_mode_name(mode);
  result.precision = validate_precision_name(precision);
  result.block = block;
  uint64_t tokens_total = 0;
  for (const auto& doc : documents)
    if (doc.size() >= 2) tokens_total += doc.size();
  KVCC_REQUIRE(tokens_total > 0, "no document with at least 2 tokens to validate on (empty text?)");

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
    if (schemes[i].on_runtime()) {
      owned.push_back(std::make_unique<RuntimeRun>(schemes[i], c, max_length));
      runtimes[i + 1] = owned.back().get();
    }

  ValidateProgress prog;
  prog.documents_total = documents.size();
  prog.tokens_total = tokens_total;
  result.late_from = late_from;
  std::vector<double> reference_late_doc_nll;
  if (precision == ValidatePrecision::Double)
    run_documents<double>(model, documents, runs, mode, block, progress, prog, t0, result, acc, per_doc, runtimes,
                          logits, late_from, reference_late_doc_nll);
  else
    run_documents<float>(model, documents, runs, mode, block, progress, prog, t0, result, acc, per_doc, runtimes,
                         logits, late_from, reference_late_doc_nll);
  const double late_P = double(result.late_predictions);
  if (late_P > 0) result.reference_late_nll = acc[0].late_nll / late_P;

  const double P = double(result.predictions);
  result.reference_nll = acc[0].nll / P;
  result.reference_perplexity = std::exp(result.reference_nll);
  std::vector<double> weights;  // predictions per document
  for (int64_t len : result.doc_lengths) weights.push_back(double(len - 1));
  result.reference_nll_stderr = clustered_standard_error(result.reference_doc_nll, weights);
  for (size_t i = 0; i < S; ++i) {
    const Accum& a = acc[i + 1];
    SchemeMetrics m;
    m.name = schemes[i].name;
    m.cache = schemes[i].path_name();
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
    if (late_P > 0) {
      // The documents with late predictions are the clusters, weighted by those predictions.
      std::vector<double> late_kl, late_diff, late_w;
      for (size_t d = 0; d < m.per_document.size(); ++d) {
        const DocumentMetrics& dm = m.per_document[d];
        if (dm.late_predictions == 0) continue;
        late_kl.push_back(dm.late_kl);
        late_diff.push_back(dm.late_nll - reference_late_doc_nll[d]);
        late_w.push_back(double(dm.late_predictions));
      }
      m.late.predictions = result.late_predictions;
      m.late.kl = a.late_kl / late_P;
      m.late.kl_stderr = clustered_standard_error(late_kl, late_w);
      m.late.top1_agreement = a.late_top1 / late_P;
      m.late.ppl_rel_change = std::exp(a.late_nll / late_P - result.reference_late_nll) - 1.0;
      m.late.ppl_rel_change_stderr = (1.0 + m.late.ppl_rel_change) * clustered_standard_error(late_diff, late_w);
    }
    for (int l = 0; l < c.n_layers; ++l)
      m.layer_rel_error.push_back(a.err_den[size_t(l)] > 0 ? a.err_num[size_t(l)] / a.err_den[size_t(l)] : 0.0);
    if (const Artifact* art = schemes[i].artifact.get()) {
      m.method = art->recipe.method;
      m.nominal_bits = nominal_bits(*art);
      m.effective_bits = effective_bits_at_lengths(*art, result.doc_lengths);
      m.stored_bits = stored_bits_at_lengths(*art, result.doc_lengths);
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
    KVCC_REQUIRE(!data.data_path.empty(), "validation needs a text or a token-id file");
    const std::string text = read_text_file(data.data_path, "validation text");
    const std::unique_ptr<Tokenizer> tok = Tokenizer::for_model(model.path(), c.vocab, data.tokenizer_path);
    docs = encode_documents(*tok, text, data.separator, c.add_bos);
  }
  const int max_len =
      data.max_seq_len > 0 ? data.max_seq_len : (c.max_position > 0 ? std::min(c.max_position, 2048) : 2048);
  std::vector<std::vector<int32_t>> out;
  uint64_t total = 0;
  for (auto& d : docs) {
    if (data.max_tokens > 0 && total >= data.max_tokens) break;
    if (int64_t(d.size()) > max_len) d.resize(size_t(max_len));
    if (data.max_tokens > 0 && total + d.size() > data.max_tokens) d.resize(size_t(data.max_tokens - total));
    if (d.size() < 2) continue;
    for (int32_t id : d)
      KVCC_REQUIRE(id >= 0 && id < c.vocab,
                   "token id " + std::to_string(id) + " outside the model's vocabulary of " + std::to_string(c.vocab));
    total += d.size();
    out.push_back(std::move(d));
  }
  KVCC_REQUIRE(!out.empty(), "the validation input holds no document of at least 2 tokens (empty text?): " +
                                 (data.ids_path.empty() ? data.data_path : data.ids_path));
  return out;
}

}  // namespace kvcc
