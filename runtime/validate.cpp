#include "runtime/validate.h"

#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>

#include "formats/codec_commvq.h"
#include "formats/error.h"
#include "formats/kv_layout.h"
#include "formats/tokenizer.h"
#include "runtime/forward.h"

namespace kvcc {

ValidateMode validate_mode_from_name(const std::string& name) {
  if (name == "pseudo-decode") return ValidateMode::PseudoDecode;
  if (name == "static") return ValidateMode::Static;
  throw Error("unknown validation mode '" + name + "' (pseudo-decode | static)");
}

const char* validate_mode_name(ValidateMode mode) {
  return mode == ValidateMode::PseudoDecode ? "pseudo-decode" : "static";
}

CacheScheme scheme_from_artifact(const Artifact& artifact, const std::string& name,
                                 const ModelConfig& config) {
  CacheScheme s;
  s.name = name;
  s.sink = artifact.recipe.sink;
  s.recent = artifact.recipe.recent;
  s.page_size = artifact.recipe.page_size;
  s.artifact = &artifact;
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
    const int n_kv = artifact.n_kv_heads;
    s.codec = [books, n_kv](int layer, int kv_head, KvSide side, const float* rows, int n,
                            int64_t first_position, float* out) {
      const size_t index = size_t(layer) * size_t(n_kv) + size_t(kv_head);
      if (side == KvSide::Value) {
        commvq_roundtrip_values(books->values[index], rows, size_t(n), out);
        return;
      }
      std::vector<int32_t> positions(static_cast<size_t>(n));
      for (int t = 0; t < n; ++t) positions[size_t(t)] = int32_t(first_position + t);
      commvq_roundtrip_keys(books->keys[index], rows, positions.data(), size_t(n), books->inv_freq,
                            true, out);
    };
    return s;
  }
  s.codec = [a](int layer, int kv_head, KvSide side, const float* rows, int n, int64_t, float* out) {
    const HeadArtifact& head = a->head(layer, kv_head);
    roundtrip_page(a->recipe, side == KvSide::Key ? head.key : head.value, side, a->head_dim, rows,
                   n, out);
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
struct LayerCache {
  std::vector<float> keys, values;
  int64_t length = 0, quantised = 0;  // quantised: post-sink tokens already in pages
};

// T queries at positions n0..n0+T-1 attending to keys/values [n0+T, kv_dim] causally. The same
// arithmetic as causal_attention (runtime/forward.cpp), so a full-precision cache reproduces the
// plain forward pass bit for bit.
void block_attention(const ModelConfig& c, int64_t n0, int T, const float* q, const float* key,
                     const float* value, float* out) {
  const int d = c.head_dim, qdim = c.n_heads * d, kvdim = c.n_kv_heads * d, group = c.group();
  const int N = int(n0 + T);
  const float scale = float(1.0 / std::sqrt(double(d)));
  std::vector<float> probs(size_t(T) * N), head_out(size_t(T) * d);
  for (int h = 0; h < c.n_heads; ++h) {
    const int kv = h / group;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, N, d, scale, q + size_t(h) * d, qdim,
                key + size_t(kv) * d, kvdim, 0.f, probs.data(), N);
    for (int i = 0; i < T; ++i) {
      float* row = probs.data() + size_t(i) * N;
      const int last = int(n0) + i;
      float max_score = row[0];
      for (int j = 1; j <= last; ++j) max_score = std::max(max_score, row[j]);
      double sum = 0;
      for (int j = 0; j <= last; ++j) {
        row[j] = std::exp(row[j] - max_score);
        sum += row[j];
      }
      const float inv = float(1.0 / sum);
      for (int j = 0; j <= last; ++j) row[j] *= inv;
      std::fill(row + last + 1, row + N, 0.f);
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, T, d, N, 1.f, probs.data(), N,
                value + size_t(kv) * d, kvdim, 0.f, head_out.data(), d);
    for (int t = 0; t < T; ++t)
      std::copy(head_out.data() + size_t(t) * d, head_out.data() + size_t(t + 1) * d,
                out + size_t(t) * qdim + size_t(h) * d);
  }
}

// Appends T rows to the cache and quantises the pages the policy now moves into history. Pages
// are quantised from the full-precision rows (the ring holds them unquantised until then).
void append_rows(const ModelConfig& c, const CacheScheme& s, int layer, LayerCache& cache,
                 const float* key, const float* value, int T) {
  const int d = c.head_dim, kvdim = c.n_kv_heads * d;
  cache.keys.insert(cache.keys.end(), key, key + size_t(T) * kvdim);
  cache.values.insert(cache.values.end(), value, value + size_t(T) * kvdim);
  cache.length += T;
  if (!s.codec) return;
  const int64_t target = history_tokens(s, cache.length);
  const int P = s.page_size;
  std::vector<float> rows(size_t(P) * d), out(size_t(P) * d);
  for (; cache.quantised < target; cache.quantised += P) {
    const int64_t first = std::min<int64_t>(cache.length, s.sink) + cache.quantised;
    for (int side = 0; side < 2; ++side) {
      float* base = (side == 0 ? cache.keys : cache.values).data();
      for (int h = 0; h < c.n_kv_heads; ++h) {
        for (int t = 0; t < P; ++t)
          std::copy_n(base + size_t(first + t) * kvdim + size_t(h) * d, d, rows.data() + size_t(t) * d);
        s.codec(layer, h, side == 0 ? KvSide::Key : KvSide::Value, rows.data(), P, first, out.data());
        for (int t = 0; t < P; ++t)
          std::copy_n(out.data() + size_t(t) * d, d, base + size_t(first + t) * kvdim + size_t(h) * d);
      }
    }
  }
}

// log-softmax of one logits row in double.
void log_softmax(const float* logits, int V, std::vector<double>& out) {
  out.resize(size_t(V));
  double m = -std::numeric_limits<double>::infinity();
  for (int v = 0; v < V; ++v) m = std::max(m, double(logits[v]));
  double sum = 0;
  for (int v = 0; v < V; ++v) sum += std::exp(double(logits[v]) - m);
  const double lse = m + std::log(sum);
  for (int v = 0; v < V; ++v) out[size_t(v)] = double(logits[v]) - lse;
}

struct Accum {
  double nll = 0, kl = 0, top1 = 0;
  std::vector<double> err_num, err_den;
};

}  // namespace

ValidationResult validate_schemes(const ModelFile& model, const std::vector<std::vector<int32_t>>& documents,
                                  const std::vector<CacheScheme>& schemes, ValidateMode mode, int block,
                                  const std::function<void(const ValidateProgress&)>& progress) {
  const auto t0 = std::chrono::steady_clock::now();
  const ModelConfig& c = model.config();
  require(block > 0, "validation block size must be positive");
  for (const CacheScheme& s : schemes)
    require(s.page_size > 0 && s.sink >= 0 && s.recent >= 0,
            "scheme " + s.name + ": page size must be positive and windows non-negative");
  ValidationResult result;
  result.model = model.path();
  result.mode = validate_mode_name(mode);
  result.block = block;
  uint64_t tokens_total = 0;
  for (const auto& doc : documents)
    if (doc.size() >= 2) tokens_total += doc.size();
  require(tokens_total > 0, "no document with at least 2 tokens to validate on (empty text?)");

  std::vector<LayerWeights> weights;
  for (int l = 0; l < c.n_layers; ++l) weights.push_back(load_layer(model, l));

  const int hidden = c.hidden, V = c.vocab;
  const size_t qdim = size_t(c.n_heads) * c.head_dim, kvdim = size_t(c.n_kv_heads) * c.head_dim;
  const size_t S = schemes.size();
  // Index 0 is the full-precision reference, 1..S the schemes.
  std::vector<const CacheScheme*> runs(S + 1);
  CacheScheme reference;
  reference.name = "full precision";
  runs[0] = &reference;
  for (size_t i = 0; i < S; ++i) runs[i + 1] = &schemes[i];
  std::vector<Accum> acc(S + 1);
  for (Accum& a : acc) a.err_num.assign(size_t(c.n_layers), 0), a.err_den.assign(size_t(c.n_layers), 0);

  ValidateProgress prog;
  prog.documents_total = documents.size();
  prog.tokens_total = tokens_total;
  std::vector<float> x, q, key, value, attn, logits;
  std::vector<std::vector<float>> ref_attn(size_t(c.n_layers)), ref_key(size_t(c.n_layers)),
      ref_value(size_t(c.n_layers));
  std::vector<float> ref_logits;
  std::vector<double> lp_ref, lp_q;
  for (const auto& doc : documents) {
    ++prog.documents_done;
    if (doc.size() < 2) continue;
    const int64_t n = int64_t(doc.size());
    result.documents++;
    result.tokens += uint64_t(n);
    result.doc_lengths.push_back(n);
    std::vector<std::vector<LayerCache>> caches(S + 1, std::vector<LayerCache>(size_t(c.n_layers)));
    for (int64_t b0 = 0; b0 < n; b0 += block) {
      const int T = int(std::min<int64_t>(block, n - b0));
      const int predict = int(std::min<int64_t>(T, n - 1 - b0));  // positions with a next token
      for (size_t r = 0; r <= S; ++r) {
        const CacheScheme& s = *runs[r];
        x.resize(size_t(T) * hidden);
        embed(model, doc.data() + b0, T, x.data());
        q.resize(size_t(T) * qdim);
        key.resize(size_t(T) * kvdim);
        value.resize(size_t(T) * kvdim);
        attn.resize(size_t(T) * qdim);
        for (int l = 0; l < c.n_layers; ++l) {
          LayerCache& cache = caches[r][size_t(l)];
          attention_qkv(c, weights[size_t(l)], x.data(), T, int(b0), q.data(), nullptr, key.data(),
                        value.data());
          // The block attends to the cache as stored plus its own rows in full precision.
          std::vector<float> all_k(cache.keys), all_v(cache.values);
          all_k.insert(all_k.end(), key.begin(), key.end());
          all_v.insert(all_v.end(), value.begin(), value.end());
          block_attention(c, cache.length, T, q.data(), all_k.data(), all_v.data(), attn.data());
          if (r == 0) {
            ref_attn[size_t(l)] = attn;
            ref_key[size_t(l)] = key;
            ref_value[size_t(l)] = value;
          } else {
            double num = 0, den = 0;
            for (size_t i = 0; i < attn.size(); ++i) {
              const double diff = double(attn[i]) - ref_attn[size_t(l)][i];
              num += diff * diff;
              den += double(ref_attn[size_t(l)][i]) * ref_attn[size_t(l)][i];
            }
            acc[r].err_num[size_t(l)] += num;
            acc[r].err_den[size_t(l)] += den;
          }
          const bool from_reference = mode == ValidateMode::Static && r > 0;
          append_rows(c, s, l, cache, from_reference ? ref_key[size_t(l)].data() : key.data(),
                      from_reference ? ref_value[size_t(l)].data() : value.data(), T);
          attention_output_and_mlp(c, weights[size_t(l)], attn.data(), T, x.data());
        }
        logits.resize(size_t(T) * V);
        final_logits(model, x.data(), T, logits.data());
        for (float v : logits)
          require(std::isfinite(v), "non-finite logits in validation (" + s.name + ", position " +
                                        std::to_string(b0) + "+): the model or artifact holds NaNs");
        if (r == 0) ref_logits = logits;
        for (int t = 0; t < predict; ++t) {
          const int target = doc[size_t(b0 + t + 1)];
          log_softmax(logits.data() + size_t(t) * V, V, lp_q);
          acc[r].nll -= lp_q[size_t(target)];
          if (r == 0) continue;
          log_softmax(ref_logits.data() + size_t(t) * V, V, lp_ref);
          double kl = 0;
          for (int v = 0; v < V; ++v) kl += std::exp(lp_ref[size_t(v)]) * (lp_ref[size_t(v)] - lp_q[size_t(v)]);
          acc[r].kl += std::max(kl, 0.0);
          const auto am_ref = std::max_element(lp_ref.begin(), lp_ref.end()) - lp_ref.begin();
          const auto am_q = std::max_element(lp_q.begin(), lp_q.end()) - lp_q.begin();
          acc[r].top1 += am_ref == am_q ? 1.0 : 0.0;
        }
      }
      result.predictions += uint64_t(predict);
      prog.tokens_done += uint64_t(T);
      prog.elapsed_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (progress) progress(prog);
    }
  }
  const double P = double(result.predictions);
  result.reference_nll = acc[0].nll / P;
  result.reference_perplexity = std::exp(result.reference_nll);
  for (size_t i = 0; i < S; ++i) {
    const Accum& a = acc[i + 1];
    SchemeMetrics m;
    m.name = schemes[i].name;
    m.nll = a.nll / P;
    m.perplexity = std::exp(m.nll);
    m.ppl_rel_change = m.perplexity / result.reference_perplexity - 1.0;
    m.kl = a.kl / P;
    m.top1_agreement = a.top1 / P;
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
    std::ifstream in(data.data_path, std::ios::binary);
    require(bool(in), "cannot open validation text '" + data.data_path + "'");
    std::stringstream ss;
    ss << in.rdbuf();
    const std::unique_ptr<Tokenizer> tok = Tokenizer::for_model(model.path(), c.vocab, data.tokenizer_path);
    for (const std::string& text : split_documents(ss.str(), data.separator)) {
      if (text.find_first_not_of(" \t\r\n") == std::string::npos) continue;
      docs.push_back(tok->encode(text, c.add_bos));
    }
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
  std::snprintf(line, sizeof line, "%s, %s, block %d: %llu documents, %llu tokens; full-precision ppl %.4f\n",
                r.model.c_str(), r.mode.c_str(), r.block, (unsigned long long)r.documents,
                (unsigned long long)r.tokens, r.reference_perplexity);
  o << line;
  std::snprintf(line, sizeof line, "%-28s %-10s %7s %7s %10s %9s %10s %7s %10s\n", "scheme", "method", "nominal",
                "eff.", "ppl", "Δppl %", "KL", "top-1", "max layer");
  o << line;
  for (const SchemeMetrics& m : r.schemes) {
    const double max_err = m.layer_rel_error.empty()
                               ? 0.0
                               : *std::max_element(m.layer_rel_error.begin(), m.layer_rel_error.end());
    std::snprintf(line, sizeof line, "%-28s %-10s %7.3f %7.3f %10.4f %+9.3f %10.3e %7.4f %10.3e\n",
                  m.name.c_str(), m.method.c_str(), m.nominal_bits, m.effective_bits, m.perplexity,
                  100.0 * m.ppl_rel_change, m.kl, m.top1_agreement, max_err);
    o << line;
  }
  return o.str();
}

std::string to_json(const ValidationResult& r) {
  nlohmann::json j;
  j["model"] = r.model;
  j["mode"] = r.mode;
  j["block"] = r.block;
  j["documents"] = r.documents;
  j["tokens"] = r.tokens;
  j["predictions"] = r.predictions;
  j["reference"] = {{"nll", r.reference_nll}, {"perplexity", r.reference_perplexity}};
  j["seconds"] = r.seconds;
  j["schemes"] = nlohmann::json::array();
  for (const SchemeMetrics& m : r.schemes)
    j["schemes"].push_back({{"name", m.name},
                            {"method", m.method},
                            {"nominal_bits", m.nominal_bits},
                            {"effective_bits", m.effective_bits},
                            {"nll", m.nll},
                            {"perplexity", m.perplexity},
                            {"ppl_rel_change", m.ppl_rel_change},
                            {"kl", m.kl},
                            {"top1_agreement", m.top1_agreement},
                            {"layer_rel_error", m.layer_rel_error}});
  return j.dump(2) + "\n";
}

std::string to_svg(const ValidationResult& r) {
  // KL on a log axis against effective bits; one labelled point per scheme.
  const double W = 720, H = 440, L = 80, R = 200, T = 40, B = 60;
  double bmin = 1e9, bmax = -1e9, kmin = 1e9, kmax = -1e9;
  for (const SchemeMetrics& m : r.schemes) {
    bmin = std::min(bmin, m.effective_bits);
    bmax = std::max(bmax, m.effective_bits);
    const double k = std::log10(std::max(m.kl, 1e-9));
    kmin = std::min(kmin, k);
    kmax = std::max(kmax, k);
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
  for (const SchemeMetrics& m : r.schemes) {
    const double x = px(m.effective_bits), y = py(std::log10(std::max(m.kl, 1e-9)));
    o << "<circle cx=\"" << x << "\" cy=\"" << y << "\" r=\"4\" fill=\"#1f77b4\"/>\n<text x=\"" << x + 6
      << "\" y=\"" << y + 4 << "\">" << m.name << "</text>\n";
  }
  o << "</svg>\n";
  return o.str();
}

}  // namespace kvcc
