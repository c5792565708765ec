#include "eval/output.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>

namespace kvcc {

std::string format_table(const ValidationResult& r) {
  std::ostringstream o;
  char line[512];
  std::snprintf(line, sizeof line, "%s, %s, block %d, %s: %llu documents, %llu tokens; full-precision ppl %.4f\n",
                r.model.c_str(), r.mode.c_str(), r.block, r.precision.c_str(), (unsigned long long)r.documents,
                (unsigned long long)r.tokens, r.reference_perplexity);
  o << line;
  if (r.schemes.empty()) {  // the model alone: its NLL with the error bar
    char se[32] = "-";
    if (!std::isnan(r.reference_nll_stderr)) std::snprintf(se, sizeof se, "%.5f", r.reference_nll_stderr);
    std::snprintf(line, sizeof line, "full precision: NLL %.5f ± %s nats/token, perplexity %.4f (%llu predictions)\n",
                  r.reference_nll, se, r.reference_perplexity, (unsigned long long)r.predictions);
    o << line << "(±: standard error across documents)\n";
    return o.str();
  }
  std::snprintf(line, sizeof line, "%-28s %-10s %-11s %7s %7s %7s %10s %9s %7s %10s %9s %7s %10s\n", "scheme", "method",
                "cache", "nominal", "eff.", "stored", "ppl", "Δppl %", "±se", "KL", "±se", "top-1", "max layer");
  o << line;
  // A standard error needs 2 documents; "-" otherwise.
  auto se = [](double v, const char* fmt) {
    char b[32];
    if (std::isnan(v)) return std::string("-");
    std::snprintf(b, sizeof b, fmt, v);
    return std::string(b);
  };
  for (const SchemeMetrics& m : r.schemes) {
    const double max_err =
        m.layer_rel_error.empty() ? 0.0 : *std::max_element(m.layer_rel_error.begin(), m.layer_rel_error.end());
    std::snprintf(line, sizeof line, "%-28s %-10s %-11s %7.3f %7.3f %7.3f %10.4f %+9.3f %7s %10.3e %9s %7.4f %10.3e\n",
                  m.name.c_str(), m.method.c_str(), m.cache.c_str(), m.nominal_bits, m.effective_bits, m.stored_bits,
                  m.perplexity, 100.0 * m.ppl_rel_change, se(100.0 * m.ppl_rel_change_stderr, "%.3f").c_str(), m.kl,
                  se(m.kl_stderr, "%.2e").c_str(), m.top1_agreement, max_err);
    o << line;
  }
  if (r.late_from > 0) {
    std::snprintf(line, sizeof line, "positions >= %lld only (%llu predictions):\n", (long long)r.late_from,
                  (unsigned long long)r.late_predictions);
    o << line;
    for (const SchemeMetrics& m : r.schemes) {
      if (m.late.predictions == 0) {
        o << "  " << m.name << ": no prediction at those positions\n";
        continue;
      }
      std::snprintf(line, sizeof line, "  %-26s Δppl %+8.3f %% ± %s   KL %10.3e ± %s   top-1 %7.4f\n", m.name.c_str(),
                    100.0 * m.late.ppl_rel_change, se(100.0 * m.late.ppl_rel_change_stderr, "%.3f").c_str(), m.late.kl,
                    se(m.late.kl_stderr, "%.2e").c_str(), m.late.top1_agreement);
      o << line;
    }
  }
  o << "(±se: standard error across documents; Δppl's from per-document paired NLL differences; cache: codec =\n"
       " simulated pages with float32 windows, runtime/cpu|gpu = the serving runtime's host|device pool; eff. =\n"
       " bits with every token past sink + recent quantised, the published accounting; stored = what the pages\n"
       " and windows hold, whole pages only: compare stored bits across page sizes)\n";
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
                    {"nll_stderr", num(r.reference_nll_stderr)},
                    {"perplexity", r.reference_perplexity},
                    {"per_document_nll", r.reference_doc_nll}};
  j["stderr"] =
      "across documents (clusters): kl_stderr of the token-weighted mean KL; ppl_rel_change_stderr "
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
    j["schemes"].push_back(
        {{"name", m.name},
         {"method", m.method},
         {"cache", m.cache},
         {"nominal_bits", m.nominal_bits},
         {"effective_bits", m.effective_bits},
         {"stored_bits", m.stored_bits},
         {"nll", m.nll},
         {"perplexity", m.perplexity},
         {"ppl_rel_change", m.ppl_rel_change},
         {"ppl_rel_change_stderr", num(m.ppl_rel_change_stderr)},
         {"kl", m.kl},
         {"kl_stderr", num(m.kl_stderr)},
         {"top1_agreement", m.top1_agreement},
         {"late", r.late_from > 0 ? nlohmann::json{{"from", r.late_from},
                                                   {"predictions", m.late.predictions},
                                                   {"kl", m.late.kl},
                                                   {"kl_stderr", num(m.late.kl_stderr)},
                                                   {"ppl_rel_change", m.late.ppl_rel_change},
                                                   {"ppl_rel_change_stderr", num(m.late.ppl_rel_change_stderr)},
                                                   {"top1_agreement", m.late.top1_agreement}}
                                  : nlohmann::json(nullptr)},
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
  o << "<text x=\"" << (L + W - R) / 2 << "\" y=\"" << H - 16
    << "\" text-anchor=\"middle\">effective bits per element</text>\n";
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
    o << "<circle cx=\"" << x << "\" cy=\"" << y << "\" r=\"4\" fill=\"#1f77b4\"/>\n<text x=\"" << x + 6 << "\" y=\""
      << y + 4 << "\">" << m.name << "</text>\n";
  }
  o << "</svg>\n";
  return o.str();
}

}  // namespace kvcc
