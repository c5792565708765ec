#include "compile/layer_budgets.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "formats/error.h"

namespace kvcc {

std::vector<double> layer_attention_spread(const Stats& stats) {
  const ModelConfig& c = stats.config;
  KVCC_REQUIRE(stats.heads.size() == size_t(c.n_layers) * size_t(c.n_kv_heads),
               "layer budgets: the stats hold " + std::to_string(stats.heads.size()) + " heads, the model needs " +
                   std::to_string(size_t(c.n_layers) * size_t(c.n_kv_heads)));
  std::vector<double> spread;
  for (int l = 0; l < c.n_layers; ++l) {
    double queries = 0, p2 = 0;
    for (int h = 0; h < c.n_kv_heads; ++h) {
      const HeadStats& hs = stats.heads[size_t(l) * c.n_kv_heads + h];
      queries += double(hs.query_count);
      p2 += hs.p2_weight;
    }
    KVCC_REQUIRE(p2 > 0 && std::isfinite(p2) && queries > 0,
                 "layer budgets: layer " + std::to_string(l) +
                     " has no attention weights in the stats (p2_weight 0); calibrate with kvcc calibrate-model");
    spread.push_back(queries / p2);
  }
  return spread;
}

std::vector<double> layer_budgets_from_stats(const Stats& stats) {
  std::vector<double> b = layer_attention_spread(stats);
  double mean = 0;
  for (double x : b) mean += x;
  mean /= double(b.size());
  for (double& x : b) x /= mean;
  return b;
}

std::vector<double> sensitivity_layer_budgets(const std::vector<double>& similarity, double alpha, double floor) {
  KVCC_REQUIRE(!similarity.empty(), "layer budgets: no layers");
  KVCC_REQUIRE(alpha > 0 && floor > 0 && floor <= 1, "layer budgets: alpha must be > 0 and the floor in (0, 1] (got " +
                                                         std::to_string(alpha) + ", " + std::to_string(floor) + ")");
  for (double s : similarity) KVCC_REQUIRE(std::isfinite(s), "layer budgets: a layer's similarity is not finite");
  const auto [lo, hi] = std::minmax_element(similarity.begin(), similarity.end());
  std::vector<double> w(similarity.size(), 1.0);
  if (*hi > *lo) {
    double total = 0;
    for (size_t l = 0; l < w.size(); ++l) {
      w[l] = std::pow(1.0 - (similarity[l] - *lo) / (*hi - *lo), alpha);
      total += w[l];
    }
    for (double& x : w) x = std::max(floor, x * double(w.size()) / total);
  }
  return w;
}

std::vector<double> layer_budgets_from_sensitivity(const Stats& stats) {
  KVCC_REQUIRE(stats.sensitivity.measured(),
               "the stats carry no layer sensitivity: calibrate with kvcc calibrate-model --layer-sensitivity");
  return sensitivity_layer_budgets(stats.sensitivity.key_similarity());
}

}  // namespace kvcc
