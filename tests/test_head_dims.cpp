// head_dim 64 and 256 through calibration and compile, on tiny models saved by transformers
// (tests/data/models: llama31-hd64 and qwen3-hd64, llama-hd256; test_forward.cpp checks their
// logits against transformers'): every statistic of calibrate_model against a direct float64
// computation from the forward pass's own q/k/v, and compile's rotations against the
// eigen-decomposition of those statistics. validate and the host pool at these head_dims:
// test_validate.cpp, test_cache.cpp, test_cache_runtime.cpp.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <random>

#include "calibrate/driver.h"
#include "calibrate/synthetic_model.h"
#include "compile/compile.h"
#include "compile/rotation.h"
#include "formats/model_file.h"
#include "forward_test_util.h"
#include "model/forward.h"
#include "one_blas_thread.h"

namespace fs = std::filesystem;
using namespace kvcc;

namespace {

const char* const kModels[] = {"llama31-hd64", "qwen3-hd64", "llama-hd256"};
constexpr int kDocs = 5, kDocLen = 60;

std::vector<std::vector<int32_t>> documents(int vocab) {
  std::mt19937 rng(5);
  std::uniform_int_distribution<int> id(0, vocab - 1);
  std::vector<std::vector<int32_t>> docs(kDocs, std::vector<int32_t>(kDocLen));
  for (auto& d : docs)
    for (auto& t : d) t = id(rng);
  return docs;
}

// The statistics of one model over documents(), calibrated once (a reservoir of 64 rows).
const Stats& calibrated(const std::string& name) {
  static std::map<std::string, Stats> cache;
  auto it = cache.find(name);
  if (it != cache.end()) return it->second;
  std::string tmpl = (fs::temp_directory_path() / "kvcc-hd-XXXXXX").string();
  const fs::path dir = mkdtemp(tmpl.data());
  const ModelFile model = ModelFile::open(kvcc::testing::data_models_dir() + "/" + name);
  write_token_ids((dir / "ids.txt").string(), documents(model.config().vocab));
  CalibrationOptions o;
  o.model_path = model.path();
  o.ids_path = (dir / "ids.txt").string();
  o.reservoir = 64;
  Stats s = calibrate_model(o);
  fs::remove_all(dir);
  return cache.emplace(name, std::move(s)).first->second;
}

// The sums calibrate_model accumulates for one (layer, KV head), in float64 from float32 rows.
struct Direct {
  std::vector<double> query_m2, key_m2, value_m2, output_m2, p2_m2;
  double p2_weight = 0;
  double max_logit = 0;  // largest |q·k|/√d seen (sets the softmax's float32 sensitivity)
  explicit Direct(int d)
      : query_m2(size_t(d) * d), key_m2(query_m2), value_m2(query_m2), output_m2(query_m2), p2_m2(query_m2) {}
};

void add_outer(std::vector<double>& m, const float* x, double w, int d) {
  for (int a = 0; a < d; ++a)
    for (int b = 0; b < d; ++b) m[size_t(a) * d + b] += w * double(x[a]) * double(x[b]);
}
void add_outer(std::vector<double>& m, const std::vector<double>& x, int d) {
  for (int a = 0; a < d; ++a)
    for (int b = 0; b < d; ++b) m[size_t(a) * d + b] += x[size_t(a)] * x[size_t(b)];
}

// Runs the model layer by layer over the documents (the driver's layer functions, so each layer
// sees the same float32 inputs) and accumulates every (layer, KV head)'s sums, attention in float64.
std::vector<Direct> direct_statistics(const ModelFile& model) {
  const ModelConfig& c = model.config();
  const int d = c.head_dim, r = c.group(), H = c.n_kv_heads;
  std::vector<Direct> out(size_t(c.n_layers) * H, Direct(d));
  std::vector<LayerWeights> weights;
  for (int l = 0; l < c.n_layers; ++l) weights.push_back(load_layer(model, l));
  const double scale = 1.0 / std::sqrt(double(d));
  for (const auto& ids : documents(c.vocab)) {
    const int T = int(ids.size());
    std::vector<float> x(size_t(T) * c.hidden), q(size_t(T) * c.n_heads * d), k(size_t(T) * H * d), v(k.size());
    embed(model, ids.data(), T, x.data());
    for (int l = 0; l < c.n_layers; ++l) {
      attention_qkv(c, weights[size_t(l)], x.data(), T, 0, q.data(), nullptr, k.data(), v.data());
      for (int h = 0; h < H; ++h) {
        Direct& s = out[size_t(l) * H + h];
        std::vector<double> w(size_t(T), 0.0);
        for (int t = 0; t < T; ++t) {
          add_outer(s.key_m2, k.data() + (size_t(t) * H + h) * d, 1.0, d);
          add_outer(s.value_m2, v.data() + (size_t(t) * H + h) * d, 1.0, d);
        }
        for (int hq = h * r; hq < (h + 1) * r; ++hq)
          for (int i = 0; i < T; ++i) {
            const float* qi = q.data() + (size_t(i) * c.n_heads + hq) * d;
            add_outer(s.query_m2, qi, 1.0, d);
            std::vector<double> logit(size_t(i) + 1), o(size_t(d), 0.0);
            double mx = -1e300, sum = 0;
            for (int j = 0; j <= i; ++j) {
              const float* kj = k.data() + (size_t(j) * H + h) * d;
              double dot = 0;
              for (int e = 0; e < d; ++e) dot += double(qi[e]) * double(kj[e]);
              logit[size_t(j)] = dot * scale;
              s.max_logit = std::max(s.max_logit, std::abs(logit[size_t(j)]));
              mx = std::max(mx, logit[size_t(j)]);
            }
            for (double& p : logit) sum += (p = std::exp(p - mx));
            for (int j = 0; j <= i; ++j) {
              const double p = logit[size_t(j)] / sum;
              w[size_t(j)] += p * p;
              const float* vj = v.data() + (size_t(j) * H + h) * d;
              for (int e = 0; e < d; ++e) o[size_t(e)] += p * double(vj[e]);
            }
            add_outer(s.output_m2, o, d);
          }
        for (int j = 0; j < T; ++j) {
          add_outer(s.p2_m2, v.data() + (size_t(j) * H + h) * d, w[size_t(j)], d);
          s.p2_weight += w[size_t(j)];
        }
      }
      if (l + 1 < c.n_layers) layer_forward(c, weights[size_t(l)], l, 0, x.data(), T);
    }
  }
  return out;
}

double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}
double max_abs(const std::vector<double>& a) {
  double m = 0;
  for (double x : a) m = std::max(m, std::abs(x));
  return m;
}

class HeadDims : public ::testing::TestWithParam<const char*> {};

TEST_P(HeadDims, CalibrationEqualsDirectFloat64Computation) {
  const ModelFile model = ModelFile::open(kvcc::testing::data_models_dir() + "/" + GetParam());
  const ModelConfig& c = model.config();
  const int d = c.head_dim;
  const Stats& stats = calibrated(GetParam());
  ASSERT_EQ(stats.config.head_dim, d);
  const std::vector<Direct> want = direct_statistics(model);
  for (int l = 0; l < c.n_layers; ++l)
    for (int h = 0; h < c.n_kv_heads; ++h) {
      SCOPED_TRACE("layer " + std::to_string(l) + " kv" + std::to_string(h));
      const HeadStats& got = stats.head(l, h);
      const Direct& w = want[size_t(l) * c.n_kv_heads + h];
      // q, k and v are the same float32 rows on both sides: the moments differ only by float64
      // summation order.
      for (auto [g, e] :
           {std::pair{&got.query_m2, &w.query_m2}, {&got.key_m2, &w.key_m2}, {&got.value_m2, &w.value_m2}})
        EXPECT_LE(max_abs_diff(*g, *e), 1e-12 * max_abs(*e));
      // The driver's softmax is float32: a logit s = q·k/√d carries ~√d·2⁻²⁴ relative rounding, so
      // a probability moves by ~|s|·√d·2⁻²⁴ relative; the value targets are sums of such terms
      // (factor 4 for p² and for sums of two rows).
      const double tol = 4.0 * (1.0 + w.max_logit) * std::sqrt(double(d)) * std::ldexp(1.0, -24);
      EXPECT_LE(max_abs_diff(got.output_m2, w.output_m2), tol * max_abs(w.output_m2));
      EXPECT_LE(max_abs_diff(got.p2_m2, w.p2_m2), tol * max_abs(w.p2_m2));
      EXPECT_NEAR(got.p2_weight, w.p2_weight, tol * w.p2_weight);
      EXPECT_EQ(got.kv_count, uint64_t(kDocs * kDocLen));
      EXPECT_EQ(got.query_count, uint64_t(kDocs * kDocLen * c.group()));
      const Reservoir& res = stats.reservoir(l, h);
      EXPECT_EQ(res.size(), 64u);
      EXPECT_EQ(res.q.size(), 64u * c.group() * d);
      EXPECT_EQ(res.key.size(), 64u * d);
    }
}

// oscar with composition U stores the eigenvectors of its targets: RᵀMR is diagonal with the
// artifact's eigenvalues (to float64 eigen-solver rounding); every method compiles at this head_dim
// with orthogonal rotations, and the Hadamard rotation is ±1/√d.
TEST_P(HeadDims, CompiledRotationsDiagonaliseTheStatistics) {
  const Stats& stats = calibrated(GetParam());
  const int d = stats.config.head_dim;
  CompileOptions o;
  o.composition = "U";
  const Artifact art = compile_artifact(stats, o);
  ASSERT_EQ(art.head_dim, d);
  for (int l = 0; l < stats.config.n_layers; ++l)
    for (int h = 0; h < stats.config.n_kv_heads; ++h) {
      const HeadStats& hs = stats.head(l, h);
      const HeadArtifact& ha = art.head(l, h);
      for (auto [target, side] : {std::pair{key_target(hs, d), &ha.key},
                                  std::pair{value_target(hs, stats.reservoir(l, h), "p2", d), &ha.value}}) {
        const Matrix diag = matmul(transpose(side->rotation, d), matmul(target, side->rotation, d), d);
        const double top = *std::max_element(side->eigenvalues.begin(), side->eigenvalues.end());
        for (int i = 0; i < d; ++i)
          for (int j = 0; j < d; ++j)
            ASSERT_NEAR(diag[size_t(i) * d + j], i == j ? side->eigenvalues[size_t(i)] : 0.0, 1e-10 * top)
                << "layer " << l << " kv" << h << " (" << i << ", " << j << ")";
      }
    }
  for (const char* method : {"oscar", "oscar-lm", "hadamard", "identity", "random", "turboquant", "kivi", "kvarn"}) {
    CompileOptions m;
    m.method = method;
    const Artifact a = compile_artifact(stats, m);
    for (const HeadArtifact& ha : a.heads)
      for (const SideArtifact* side : {&ha.key, &ha.value}) {
        if (!side->rotation.empty()) {
          EXPECT_LT(orthogonality_error(side->rotation, d), 1e-10) << method;
        }
      }
    if (std::string(method) == "hadamard") {
      for (double x : a.heads[0].key.rotation) EXPECT_NEAR(std::abs(x), 1.0 / std::sqrt(double(d)), 1e-15);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Models, HeadDims, ::testing::ValuesIn(kModels));

}  // namespace
