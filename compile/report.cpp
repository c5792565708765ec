#include "compile/report.h"

#include <cblas.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "compile/commvq.h"
#include "compile/fit.h"
#include "formats/error.h"
#include "formats/kv_codec.h"
#include "formats/method.h"

namespace kvcc {

namespace {

double sum_sq(const std::vector<float>& a) {
  double s = 0;
  for (float x : a) s += double(x) * x;
  return s;
}

double rel(double err2, double ref2) { return ref2 > 0 ? std::sqrt(err2 / ref2) : 0.0; }

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

HeadMetrics average(const std::vector<const HeadMetrics*>& hs) {
  HeadMetrics m;
  if (hs.empty()) return m;
  for (const HeadMetrics* h : hs) {
    m.logit_rel += h->logit_rel;
    m.output_rel += h->output_rel;
    m.key_rel += h->key_rel;
    m.value_rel += h->value_rel;
    m.rows += h->rows;
  }
  const double n = double(hs.size());
  m.logit_rel /= n;
  m.output_rel /= n;
  m.key_rel /= n;
  m.value_rel /= n;
  return m;
}

}  // namespace

HeadMetrics MethodReport::mean() const {
  std::vector<const HeadMetrics*> all;
  for (const HeadMetrics& h : heads) all.push_back(&h);
  return average(all);
}

HeadMetrics MethodReport::layer_mean(int layer) const {
  std::vector<const HeadMetrics*> sel;
  for (const HeadMetrics& h : heads)
    if (h.layer == layer) sel.push_back(&h);
  HeadMetrics m = average(sel);
  m.layer = layer;
  return m;
}

std::vector<HeadMetrics> evaluate_layer(const Artifact& art, int layer, const std::vector<FitRows>& rows) {
  const int d = art.head_dim, n_kv = art.n_kv_heads, w = n_kv * d;
  KVCC_REQUIRE(int(rows.size()) == n_kv, "evaluate_layer: expected one row set per KV head");
  const int n = rows[0].n;
  // The layer's rows side by side, [n, n_kv·d], as the layer codec takes them.
  std::vector<float> k(size_t(n) * w), v(size_t(n) * w), kq(k.size()), vq(v.size());
  for (int h = 0; h < n_kv; ++h) {
    KVCC_REQUIRE(rows[size_t(h)].n == n, "evaluate_layer: the KV heads' rows are not aligned");
    for (int t = 0; t < n; ++t) {
      std::copy_n(&rows[size_t(h)].key[size_t(t) * d], d, &k[size_t(t) * w + size_t(h) * d]);
      std::copy_n(&rows[size_t(h)].value[size_t(t) * d], d, &v[size_t(t) * w + size_t(h) * d]);
    }
  }
  const int page = art.recipe.page_size > 0 ? art.recipe.page_size : n;
  for (int t0 = 0; t0 < n; t0 += page) {
    const int len = std::min(page, n - t0);
    const size_t at = size_t(t0) * w;
    roundtrip_layer_page(art, layer, KvSide::Key, &k[at], len, &kq[at]);
    roundtrip_layer_page(art, layer, KvSide::Value, &v[at], len, &vq[at]);
  }
  std::vector<HeadMetrics> out;
  std::vector<float> hk(size_t(n) * d), hv(hk.size());
  for (int h = 0; h < n_kv; ++h) {
    for (int t = 0; t < n; ++t) {
      std::copy_n(&kq[size_t(t) * w + size_t(h) * d], d, &hk[size_t(t) * d]);
      std::copy_n(&vq[size_t(t) * w + size_t(h) * d], d, &hv[size_t(t) * d]);
    }
    const FitRows& r = rows[size_t(h)];
    out.push_back(head_metrics(d, layer, h, r.query, r.nq, r.key, r.value, hk, hv, n));
  }
  return out;
}

HeadMetrics head_metrics(int d, int layer, int head, const std::vector<float>& query, int nq,
                         const std::vector<float>& key, const std::vector<float>& value, const std::vector<float>& kq,
                         const std::vector<float>& vq, int n) {
  HeadMetrics m;
  m.layer = layer;
  m.head = head;
  m.rows = n;
  std::vector<float> kerr(key.size()), verr(value.size());
  for (size_t i = 0; i < key.size(); ++i) kerr[i] = key[i] - kq[i];
  for (size_t i = 0; i < value.size(); ++i) verr[i] = value[i] - vq[i];
  m.key_rel = rel(sum_sq(kerr), sum_sq(key));
  m.value_rel = rel(sum_sq(verr), sum_sq(value));
  const std::vector<float> metric = query_metric(query, nq, d);
  m.logit_rel = rel(weighted_logit_error(kerr, n, metric, d), weighted_logit_error(key, n, metric, d));
  // Outputs with exact and with quantised K/V.
  const std::vector<float> p = attention_probs(query, nq, key, n, d);
  const std::vector<float> pq = attention_probs(query, nq, kq, n, d);
  std::vector<float> o(size_t(nq) * d), oq(size_t(nq) * d);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, nq, d, n, 1.0f, p.data(), n, value.data(), d, 0.0f, o.data(),
              d);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, nq, d, n, 1.0f, pq.data(), n, vq.data(), d, 0.0f, oq.data(),
              d);
  double err2 = 0, ref2 = 0;
  for (size_t i = 0; i < o.size(); ++i) {
    err2 += double(o[i] - oq[i]) * double(o[i] - oq[i]);
    ref2 += double(o[i]) * o[i];
  }
  m.output_rel = rel(err2, ref2);
  return m;
}

AttentionReport attention_report(const Stats& stats, const std::vector<CompileOptions>& methods, int max_rows,
                                 bool show_progress) {
  const ModelConfig& c = stats.config;
  AttentionReport report;
  report.n_layers = c.n_layers;
  report.n_kv_heads = c.n_kv_heads;
  report.head_dim = c.head_dim;
  // Per layer, the same held-out tokens in every KV head, so that a quantiser group spanning heads
  // codes them together (roundtrip_layer_page).
  std::vector<std::vector<FitRows>> heldout;
  for (int l = 0; l < c.n_layers; ++l) {
    std::vector<const Reservoir*> reservoirs;
    for (int h = 0; h < c.n_kv_heads; ++h) reservoirs.push_back(&stats.reservoir(l, h));
    heldout.push_back(select_aligned_rows(reservoirs, true, max_rows));
    KVCC_REQUIRE(heldout.back()[0].n > 1, "stats have no held-out reservoir rows (shared by its KV heads) for layer " +
                                              std::to_string(l) + " (the report evaluates on held-out documents)");
  }
  for (const CompileOptions& opt : methods) {
    const MethodTraits& t = method_traits(method_from_name(opt.method));
    MethodReport mr;
    mr.label = opt.method;
    // Settings that differ from the method's defaults name the row.
    if (opt.granularity == "layer") mr.label += "/layer";
    if (t.accepts(MethodOption::Composition) && !opt.composition.empty() && opt.composition != t.composition)
      mr.label += "/" + opt.composition;
    if (t.accepts(MethodOption::ValueTarget) && !opt.value_target.empty() && opt.value_target != t.value_target)
      mr.label += "/" + opt.value_target;
    if (!opt.fit_clip) mr.label += "/noclip";
    if (opt.group >= 0) mr.label += "/g" + std::to_string(opt.group);
    if (!t.bit_presets.empty()) mr.label = opt.method + "-" + fmt("%g", opt.key_bits);  // commvq-1, commvq-2
    auto it = opt.params.find("variant");
    if (it != opt.params.end() && it->second != "mse") mr.label += "/" + it->second;
    const auto t0 = std::chrono::steady_clock::now();
    const Artifact art = compile_artifact(stats, opt);
    mr.compile_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    mr.recipe = art.recipe;
    mr.nominal_bits = nominal_bits(art);
    mr.effective_bits_32k = effective_bits(art, 32768);
    mr.effective_bits_2k = effective_bits(art, 2048);
    for (int l = 0; l < c.n_layers; ++l) {
      if (t.codec != CodecFamily::CommvqCodebooks) {
        for (HeadMetrics& h : evaluate_layer(art, l, heldout[size_t(l)])) mr.heads.push_back(h);
        continue;
      }
      for (int h = 0; h < c.n_kv_heads; ++h) {
        // Keys are coded pre-RoPE: reconstructed at each held-out row's position. commvq codes
        // whole rows per head, so the head's own held-out selection is used (as select_rows).
        const FitRows rows = select_rows(stats.reservoir(l, h), true, max_rows);
        std::vector<float> kq, vq;
        commvq_reservoir_roundtrip(art, l, h, stats.reservoir(l, h), true, max_rows, rope_inv_freq(c), kq, vq);
        mr.heads.push_back(head_metrics(c.head_dim, l, h, rows.query, rows.nq, rows.key, rows.value, kq, vq, rows.n));
      }
    }
    if (show_progress)
      std::cerr << "report: " << mr.label << " done (compile " << fmt("%.2f", mr.compile_seconds) << " s)\n";
    report.methods.push_back(std::move(mr));
  }
  return report;
}

std::string report_table(const AttentionReport& r) {
  std::ostringstream out;
  out << "Held-out attention-level errors (" << r.model << ": " << r.n_layers << " layers, " << r.n_kv_heads
      << " KV heads, head_dim " << r.head_dim << "); relative Frobenius errors, "
      << "mean over (layer, KV head)\n\n";
  out << "| method | key/value bits | nominal | eff@2K | eff@32K | logit (q-weighted) | attn output | key | value |\n";
  out << "|---|---|---|---|---|---|---|---|---|\n";
  for (const MethodReport& m : r.methods) {
    const HeadMetrics a = m.mean();
    out << "| " << m.label << " | " << fmt("%g", m.recipe.key_bits) << "/" << fmt("%g", m.recipe.value_bits) << " | "
        << fmt("%.3f", m.nominal_bits) << " | " << fmt("%.3f", m.effective_bits_2k) << " | "
        << fmt("%.3f", m.effective_bits_32k) << " | " << fmt("%.4f", a.logit_rel) << " | " << fmt("%.4f", a.output_rel)
        << " | " << fmt("%.4f", a.key_rel) << " | " << fmt("%.4f", a.value_rel) << " |\n";
  }
  out << "\nPer layer, query-weighted logit error (mean over KV heads):\n\n| layer |";
  for (const MethodReport& m : r.methods) out << " " << m.label << " |";
  out << "\n|---|";
  for (size_t i = 0; i < r.methods.size(); ++i) out << "---|";
  out << "\n";
  for (int l = 0; l < r.n_layers; ++l) {
    out << "| " << l << " |";
    for (const MethodReport& m : r.methods) out << " " << fmt("%.4f", m.layer_mean(l).logit_rel) << " |";
    out << "\n";
  }
  return out.str();
}

std::string report_json(const AttentionReport& r) {
  nlohmann::json j;
  j["model"] = r.model;
  j["n_layers"] = r.n_layers;
  j["n_kv_heads"] = r.n_kv_heads;
  j["head_dim"] = r.head_dim;
  j["metrics"] = {{"logit_rel", "||Q(K-Khat)^T||_F / ||QK^T||_F, held-out queries and keys"},
                  {"output_rel", "||PV - Phat Vhat||_F / ||PV||_F, P = softmax(QK^T/sqrt(d)) over held-out keys"},
                  {"key_rel", "||K-Khat||_F / ||K||_F"},
                  {"value_rel", "||V-Vhat||_F / ||V||_F"}};
  for (const MethodReport& m : r.methods) {
    nlohmann::json jm;
    jm["label"] = m.label;
    jm["method"] = m.recipe.method;
    jm["key_bits"] = m.recipe.key_bits;
    jm["value_bits"] = m.recipe.value_bits;
    jm["group"] = m.recipe.group;
    jm["sink"] = m.recipe.sink;
    jm["recent"] = m.recipe.recent;
    jm["nominal_bits"] = m.nominal_bits;
    jm["effective_bits"] = {{"2048", m.effective_bits_2k}, {"32768", m.effective_bits_32k}};
    jm["compile_seconds"] = m.compile_seconds;
    const HeadMetrics a = m.mean();
    jm["mean"] = {
        {"logit_rel", a.logit_rel}, {"output_rel", a.output_rel}, {"key_rel", a.key_rel}, {"value_rel", a.value_rel}};
    for (const HeadMetrics& h : m.heads)
      jm["heads"].push_back({{"layer", h.layer},
                             {"kv_head", h.head},
                             {"rows", h.rows},
                             {"logit_rel", h.logit_rel},
                             {"output_rel", h.output_rel},
                             {"key_rel", h.key_rel},
                             {"value_rel", h.value_rel}});
    j["methods"].push_back(jm);
  }
  return j.dump(2) + "\n";
}

std::string report_svg(const AttentionReport& r) {
  // Two panels (logit error, output error); per layer a group of bars, one per method.
  static const char* colors[] = {"#d62728", "#ff7f0e", "#1f77b4", "#7f7f7f", "#9467bd",
                                 "#2ca02c", "#8c564b", "#e377c2", "#17becf", "#bcbd22"};
  const int n_methods = int(r.methods.size());
  const int layers = r.n_layers;
  const double bar = 10, gap = 14, left = 60, top = 40, panel_h = 220, panel_gap = 70;
  const double group_w = n_methods * bar + gap;
  const double width = left + layers * group_w + 40 + 170;
  const double height = top + 2 * panel_h + panel_gap + 50;
  std::ostringstream s;
  s << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << int(width) << "\" height=\"" << int(height)
    << "\" font-family=\"sans-serif\" font-size=\"11\">\n";
  s << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  s << "<text x=\"" << left << "\" y=\"20\" font-size=\"14\">" << r.model
    << ": held-out relative errors per layer (mean over KV heads)</text>\n";
  for (int panel = 0; panel < 2; ++panel) {
    const double y0 = top + panel * (panel_h + panel_gap);
    double vmax = 1e-12;
    for (const MethodReport& m : r.methods)
      for (int l = 0; l < layers; ++l) {
        const HeadMetrics h = m.layer_mean(l);
        vmax = std::max(vmax, panel == 0 ? h.logit_rel : h.output_rel);
      }
    vmax *= 1.1;
    s << "<text x=\"" << left << "\" y=\"" << y0 - 6 << "\">"
      << (panel == 0 ? "query-weighted logit error" : "attention-output error") << "</text>\n";
    s << "<line x1=\"" << left << "\" y1=\"" << y0 + panel_h << "\" x2=\"" << left + layers * group_w << "\" y2=\""
      << y0 + panel_h << "\" stroke=\"black\"/>\n";
    s << "<line x1=\"" << left << "\" y1=\"" << y0 << "\" x2=\"" << left << "\" y2=\"" << y0 + panel_h
      << "\" stroke=\"black\"/>\n";
    for (int t = 0; t <= 4; ++t) {
      const double v = vmax * t / 4, y = y0 + panel_h - panel_h * t / 4;
      s << "<text x=\"" << left - 5 << "\" y=\"" << y + 4 << "\" text-anchor=\"end\">" << fmt("%.3f", v) << "</text>\n";
      s << "<line x1=\"" << left << "\" y1=\"" << y << "\" x2=\"" << left + layers * group_w << "\" y2=\"" << y
        << "\" stroke=\"#ddd\"/>\n";
    }
    for (int l = 0; l < layers; ++l) {
      const double gx = left + l * group_w + gap / 2;
      for (int mi = 0; mi < n_methods; ++mi) {
        const HeadMetrics h = r.methods[size_t(mi)].layer_mean(l);
        const double v = panel == 0 ? h.logit_rel : h.output_rel;
        const double bh = panel_h * v / vmax;
        s << "<rect x=\"" << gx + mi * bar << "\" y=\"" << y0 + panel_h - bh << "\" width=\"" << bar - 1
          << "\" height=\"" << bh << "\" fill=\"" << colors[mi % 10] << "\"><title>" << r.methods[size_t(mi)].label
          << " layer " << l << ": " << fmt("%.4f", v) << "</title></rect>\n";
      }
      s << "<text x=\"" << gx + n_methods * bar / 2 << "\" y=\"" << y0 + panel_h + 14 << "\" text-anchor=\"middle\">L"
        << l << "</text>\n";
    }
  }
  const double lx = left + layers * group_w + 30;
  for (int mi = 0; mi < n_methods; ++mi) {
    const MethodReport& m = r.methods[size_t(mi)];
    s << "<rect x=\"" << lx << "\" y=\"" << top + mi * 18 << "\" width=\"12\" height=\"12\" fill=\"" << colors[mi % 10]
      << "\"/>\n";
    s << "<text x=\"" << lx + 18 << "\" y=\"" << top + mi * 18 + 10 << "\">" << m.label << " ("
      << fmt("%.2f", m.effective_bits_32k) << " b@32K)</text>\n";
  }
  s << "</svg>\n";
  return s.str();
}

}  // namespace kvcc
