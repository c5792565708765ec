// `calibrate-model --device gpu` (calibrate/gpu_layers.h) against the CPU path on the same tokens:
// every count, reservoir position, document, priority and held-out flag equal; every float sum,
// range and reservoir row within the float32 rounding of the forward pass (below). Models: the
// synthetic Llama and the test models of tests/data/models (GQA, head_dim 64/72/256, Qwen2 biases,
// Qwen3 q/k norms, FP8 and compressed-tensors weights); the real models of ../shared when
// KVCC_CALIBRATE_REAL names them ("MODEL_DIR:IDS_FILE;..." with ids from `kvcc tokenize`).
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "calibrate/driver.h"
#include "calibrate/synthetic_model.h"
#include "formats/error.h"
#include "formats/model_file.h"
#include "formats/stats.h"

namespace kvcc {
namespace {

namespace fs = std::filesystem;

struct TempDir {
  fs::path path;
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "kvcc-gpucal-XXXXXX").string();
    path = mkdtemp(&tmpl[0]);
  }
  ~TempDir() { fs::remove_all(path); }
  std::string operator/(const std::string& name) const { return (path / name).string(); }
};

// Largest |gpu - cpu| / max|cpu| expected of a float array. Both paths run the same float32
// operations with the same RoPE tables; only summation orders differ (cuBLAS vs OpenBLAS GEMMs,
// the norms' double sums). A dot product of length K then differs by ~sqrt(K)·2^-24 (random-walk
// growth), each layer's residual stream adds its own, so rows after n layers differ by
// ~n·sqrt(K)·2^-24 with K the longest reduction; second moments are products of two such rows
// (factor 2). float64 accumulation adds only N·2^-53.
double float_tolerance(const ModelConfig& c) {
  const double k = double(std::max(c.hidden, c.intermediate));
  return 2.0 * c.n_layers * std::sqrt(k) * std::ldexp(1.0, -24);
}

template <typename T>
double max_abs(const std::vector<T>& v) {
  double m = 0;
  for (T x : v) m = std::max(m, std::abs(double(x)));
  return m;
}

// max |a - b| / max |b| (0 when b is all zero and a equals it).
template <typename T>
double scaled_diff(const std::vector<T>& a, const std::vector<T>& b) {
  EXPECT_EQ(a.size(), b.size());
  double m = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    EXPECT_TRUE(std::isfinite(double(a[i]))) << "element " << i;
    m = std::max(m, std::abs(double(a[i]) - double(b[i])));
  }
  const double scale = max_abs(b);
  return scale > 0 ? m / scale : m;
}

// Asserts the agreement described above; returns the largest scaled difference seen.
double expect_same_stats(const Stats& gpu, const Stats& cpu, double tol, const std::string& what) {
  double worst = 0;
  auto check = [&](double diff, const std::string& name) {
    EXPECT_LE(diff, tol) << what << ": " << name;
    worst = std::max(worst, diff);
  };
  EXPECT_EQ(gpu.heads.size(), cpu.heads.size()) << what;
  for (size_t i = 0; i < std::min(gpu.heads.size(), cpu.heads.size()); ++i) {
    const HeadStats &a = gpu.heads[i], &b = cpu.heads[i];
    const std::string h = " head " + std::to_string(i);
    EXPECT_EQ(a.query_count, b.query_count) << what << h;
    EXPECT_EQ(a.output_count, b.output_count) << what << h;
    EXPECT_EQ(a.kv_count, b.kv_count) << what << h;
    check(scaled_diff(a.query_m2, b.query_m2), "query_m2" + h);
    check(scaled_diff(a.output_m2, b.output_m2), "output_m2" + h);
    check(scaled_diff(a.p2_m2, b.p2_m2), "p2_m2" + h);
    check(scaled_diff(a.key_m2, b.key_m2), "key_m2" + h);
    check(scaled_diff(a.value_m2, b.value_m2), "value_m2" + h);
    check(std::abs(a.p2_weight - b.p2_weight) / b.p2_weight, "p2_weight" + h);
    check(scaled_diff(a.key_min, b.key_min), "key_min" + h);
    check(scaled_diff(a.key_max, b.key_max), "key_max" + h);
    check(scaled_diff(a.value_min, b.value_min), "value_min" + h);
    check(scaled_diff(a.value_max, b.value_max), "value_max" + h);
    // Symmetric, as the CPU path's mirrored matrices are.
    const int d = int(std::lround(std::sqrt(double(a.query_m2.size()))));
    int asymmetric = 0;
    for (int r = 0; r < d; ++r)
      for (int c = 0; c < r; ++c) asymmetric += a.output_m2[size_t(r) * d + c] != a.output_m2[size_t(c) * d + r];
    EXPECT_EQ(asymmetric, 0) << what << h;
  }
  EXPECT_EQ(gpu.reservoirs.size(), cpu.reservoirs.size()) << what;
  for (size_t i = 0; i < std::min(gpu.reservoirs.size(), cpu.reservoirs.size()); ++i) {
    const Reservoir &a = gpu.reservoirs[i], &b = cpu.reservoirs[i];
    const std::string h = " reservoir " + std::to_string(i);
    EXPECT_EQ(a.position, b.position) << what << h;
    EXPECT_EQ(a.doc, b.doc) << what << h;
    EXPECT_EQ(a.priority, b.priority) << what << h;
    EXPECT_EQ(a.heldout, b.heldout) << what << h;
    check(scaled_diff(a.q, b.q), "q" + h);
    check(scaled_diff(a.key_pre, b.key_pre), "key_pre" + h);
    check(scaled_diff(a.key, b.key), "key" + h);
    check(scaled_diff(a.value, b.value), "value" + h);
  }
  EXPECT_EQ(gpu.provenance.tokens, cpu.provenance.tokens) << what;
  return worst;
}

std::pair<Stats, Stats> both_paths(CalibrationOptions o) {
  o.device = "cpu";
  Stats cpu = calibrate_model(o);
  o.device = "gpu";
  CalibrationSummary s;
  Stats gpu = calibrate_model(o, &s);
  EXPECT_NE(s.device, "cpu");
  EXPECT_GE(s.stats_seconds, 0.0);
  EXPECT_LE(s.stats_seconds, s.seconds);
  return {std::move(gpu), std::move(cpu)};
}

// Random documents of 1..max_len tokens (one of length 1, one of max_len) for a model's vocabulary.
void write_random_ids(const std::string& path, int vocab, int n_docs, int max_len, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::vector<int32_t>> docs;
  for (int i = 0; i < n_docs; ++i) {
    const int len = i == 0 ? 1 : i == 1 ? max_len : 1 + int(rng() % uint32_t(max_len));
    std::vector<int32_t> ids(static_cast<size_t>(len));
    for (auto& t : ids) t = int32_t(rng() % uint32_t(vocab));
    docs.push_back(ids);
  }
  write_token_ids(path, docs);
}

TEST(GpuCalibrate, MatchesTheCpuPathOnTheSyntheticModel) {
  TempDir tmp;
  SyntheticModelSpec spec;
  spec.n_layers = 3;
  write_synthetic_model(tmp / "model", spec);
  // Sequences longer than the kernels' row chunks (64) and the reservoir, several short ones.
  std::vector<std::vector<int32_t>> docs = synthetic_documents(spec, 14, 700, 5);
  for (size_t i = 0; i < docs.size(); ++i) docs[i].resize(std::min<size_t>(docs[i].size(), 1 + i * i * 5));
  write_token_ids(tmp / "ids.txt", docs);
  CalibrationOptions o;
  o.model_path = tmp / "model";
  o.ids_path = tmp / "ids.txt";
  o.max_seq_len = 700;
  o.reservoir = 300;
  o.seed = 3;
  auto [gpu, cpu] = both_paths(o);
  const ModelConfig& c = ModelFile::open(o.model_path).config();
  const double worst = expect_same_stats(gpu, cpu, float_tolerance(c), "synthetic");
  std::printf("synthetic: tolerance %.2e, largest scaled difference %.2e\n", float_tolerance(c), worst);
}

TEST(GpuCalibrate, MatchesTheCpuPathOnEveryTestArchitecture) {
  const std::string dir = std::string(KVCC_SOURCE_DIR) + "/tests/data/models/";
  for (const char* name :
       {"llama31-hd64", "llama-hd256", "qwen3-hd64", "qwen2-bias", "llama-fp8-block", "qwen3-ct-channel"}) {
    SCOPED_TRACE(name);
    TempDir tmp;
    const ModelFile model = ModelFile::open(dir + name);
    const ModelConfig& c = model.config();
    const int max_len = std::min(c.max_position > 0 ? c.max_position : 256, 256);
    write_random_ids(tmp / "ids.txt", c.vocab, 9, max_len, 11);
    CalibrationOptions o;
    o.model_path = dir + name;
    o.ids_path = tmp / "ids.txt";
    o.max_seq_len = max_len;
    o.reservoir = 64;
    auto [gpu, cpu] = both_paths(o);
    const double worst = expect_same_stats(gpu, cpu, float_tolerance(c), name);
    std::printf("%s: tolerance %.2e, largest scaled difference %.2e\n", name, float_tolerance(c), worst);
  }
}

TEST(GpuCalibrate, MatchesTheCpuPathOnTheRealModels) {
  const char* list = std::getenv("KVCC_CALIBRATE_REAL");
  if (!list || !*list) GTEST_SKIP() << "set KVCC_CALIBRATE_REAL=MODEL_DIR:IDS_FILE;... to compare on real models";
  std::stringstream in(list);
  std::string item;
  while (std::getline(in, item, ';')) {
    const size_t colon = item.rfind(':');
    ASSERT_NE(colon, std::string::npos) << item;
    SCOPED_TRACE(item);
    CalibrationOptions o;
    o.model_path = item.substr(0, colon);
    o.ids_path = item.substr(colon + 1);
    o.max_tokens = 16384;
    o.max_seq_len = 512;
    o.reservoir = 512;
    o.seed = 7;
    auto [gpu, cpu] = both_paths(o);
    const ModelConfig& c = ModelFile::open(o.model_path).config();
    const double worst = expect_same_stats(gpu, cpu, float_tolerance(c), o.model_path);
    std::printf("%s: %llu tokens, tolerance %.2e, largest scaled difference %.2e\n", o.model_path.c_str(),
                (unsigned long long)gpu.provenance.tokens, float_tolerance(c), worst);
  }
}

TEST(GpuCalibrate, RefusesADeviceTheMachineLacks) {
  TempDir tmp;
  SyntheticModelSpec spec;
  spec.n_layers = 1;
  write_synthetic_model(tmp / "model", spec);
  write_token_ids(tmp / "ids.txt", synthetic_documents(spec, 2, 20, 5));
  CalibrationOptions o;
  o.model_path = tmp / "model";
  o.ids_path = tmp / "ids.txt";
  o.device = "gpu:4096";
  try {
    calibrate_model(o);
    FAIL() << "a missing device was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("gpu:4096"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace kvcc
