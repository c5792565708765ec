// Helpers shared by the tests/test_formats_*.cpp files: a scratch directory that is removed
// afterwards, random but fully populated stats and artifacts, and raw file surgery.
#pragma once
#include <dirent.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "formats/artifact.h"
#include "formats/atomic_file.h"
#include "formats/error.h"
#include "formats/fp16.h"
#include "formats/stats.h"

namespace kvcc::testing {

// The e5m3 byte nearest x by search over every finite byte (fp16 word byte << 7), ties to the even
// byte; 0xF8 (fp16 infinity) where x is nearer 2^16 than 61440 (as fp16 rounds to infinity). The
// reference for codec_scalar.h's e5m3_from_float, which works on the bits.
inline unsigned nearest_e5m3(double x) {
  const auto value = [](unsigned b) { return b == 0xF8u ? 65536.0 : double(float_from_f16(uint16_t(b << 7))); };
  unsigned best = 0;
  for (unsigned b = 1; b <= 0xF8u; ++b) {
    const double e = std::fabs(value(b) - x), eb = std::fabs(value(best) - x);
    if (e < eb || (e == eb && (b & 1u) == 0)) best = b;
  }
  return best;
}

// The message of the kvcc::Error that f throws, or "(no error)".
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}
#define EXPECT_CONTAINS(haystack, needle) \
  EXPECT_NE(std::string(haystack).find(needle), std::string::npos) << "message: " << (haystack)

class ScratchDir {
 public:
  ScratchDir() {
    char tmpl[] = "/tmp/kvcc_formats_test_XXXXXX";
    const char* made = ::mkdtemp(tmpl);
    if (!made) std::abort();
    path_ = made;
  }
  ~ScratchDir() {
    for (const auto& name : entries()) std::remove((path_ + "/" + name).c_str());
    ::rmdir(path_.c_str());
  }
  std::string file(const std::string& name) const { return path_ + "/" + name; }
  std::vector<std::string> entries() const {
    std::vector<std::string> out;
    if (DIR* dir = ::opendir(path_.c_str())) {
      while (dirent* e = ::readdir(dir)) {
        std::string name = e->d_name;
        if (name != "." && name != "..") out.push_back(name);
      }
      ::closedir(dir);
    }
    return out;
  }
  // Names of leftover temporaries from atomic writes.
  std::vector<std::string> temporaries() const {
    std::vector<std::string> out;
    for (const auto& name : entries())
      if (name.find(kTempMarker) != std::string::npos) out.push_back(name);
    return out;
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

inline std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}
inline void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), std::streamsize(bytes.size()));
}
inline bool file_exists(const std::string& path) { return ::access(path.c_str(), F_OK) == 0; }

inline ModelConfig small_config(int n_layers = 3, int n_heads = 4, int n_kv_heads = 2, int head_dim = 8) {
  ModelConfig c;
  c.architecture = "llama";
  c.n_layers = n_layers;
  c.hidden = n_heads * head_dim;
  c.n_heads = n_heads;
  c.n_kv_heads = n_kv_heads;
  c.head_dim = head_dim;
  c.intermediate = 4 * c.hidden;
  c.vocab = 256;
  c.max_position = 512;
  c.rope_theta = 500000.0;
  c.rope_scaling.type = "llama3";
  c.rope_scaling.factor = 8.0;
  c.rms_eps = 1e-5;
  c.tied_embeddings = true;
  c.bos_id = 1;
  c.eos_id = 2;
  return c;
}

inline ModelFingerprint small_fingerprint(const ModelConfig& c, const std::string& weights = "ab12") {
  return make_fingerprint(c, weights);
}

// One token's rows for one (layer, KV head), generated independently of any kvcc code.
struct TokenRows {
  std::vector<float> q, key_pre, key, value;  // q: [r, d]
  int32_t position;
  uint32_t doc;
  uint64_t priority;
};

inline std::vector<TokenRows> random_rows(int n, int r, int d, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<TokenRows> rows(static_cast<size_t>(n));
  for (auto& t : rows) {
    for (int i = 0; i < r * d; ++i) t.q.push_back(normal(rng));
    for (int i = 0; i < d; ++i) {
      t.key_pre.push_back(normal(rng));
      t.key.push_back(normal(rng) * 3.0f + float(i));
      t.value.push_back(normal(rng) - 1.0f);
    }
    t.position = int32_t(rng() % 1000);
    t.doc = uint32_t(rng() % 50);
    t.priority = rng();
  }
  return rows;
}

// Stats whose sums are those of `rows_per_head` random tokens per head (sums in double, naive
// outer products) and whose reservoirs hold the `capacity` smallest priorities among them.
struct RandomStats {
  Stats stats;
  std::vector<std::vector<TokenRows>> rows;  // per head index
};

inline void add_outer(std::vector<double>& m, const float* x, int d, double w = 1.0) {
  for (int i = 0; i < d; ++i)
    for (int j = 0; j < d; ++j) m[size_t(i * d + j)] += w * double(x[i]) * double(x[j]);
}

inline RandomStats random_stats(const ModelConfig& c, const ModelFingerprint& fp, int capacity, int rows_per_head,
                                uint64_t seed) {
  std::mt19937_64 rng(seed);
  RandomStats out;
  out.stats = make_empty_stats(c, fp, capacity);
  Stats& s = out.stats;
  s.command = "kvcc test";
  s.provenance.data_sha256 = "data" + std::to_string(seed);
  s.provenance.tokens = uint64_t(rows_per_head);
  s.provenance.sequences = 3;
  s.provenance.seed = 7;
  s.provenance.max_seq_len = 128;
  s.provenance.tokenizer = "tokenizer.json";
  const int d = c.head_dim, r = c.group();
  for (size_t hi = 0; hi < s.heads.size(); ++hi) {
    auto rows = random_rows(rows_per_head, r, d, rng);
    HeadStats& hs = s.heads[hi];
    std::uniform_real_distribution<double> weight(0.1, 2.0);
    for (const auto& t : rows) {
      for (int g = 0; g < r; ++g) add_outer(hs.query_m2, t.q.data() + g * d, d);
      add_outer(hs.key_m2, t.key.data(), d);
      add_outer(hs.value_m2, t.value.data(), d);
      const double w = weight(rng);
      add_outer(hs.p2_m2, t.value.data(), d, w);
      hs.p2_weight += w;
      add_outer(hs.output_m2, t.value.data(), d, 0.5);
      for (int i = 0; i < d; ++i) {
        hs.key_min[size_t(i)] = std::min(hs.key_min[size_t(i)], double(t.key[size_t(i)]));
        hs.key_max[size_t(i)] = std::max(hs.key_max[size_t(i)], double(t.key[size_t(i)]));
        hs.value_min[size_t(i)] = std::min(hs.value_min[size_t(i)], double(t.value[size_t(i)]));
        hs.value_max[size_t(i)] = std::max(hs.value_max[size_t(i)], double(t.value[size_t(i)]));
      }
    }
    hs.query_count = uint64_t(rows_per_head) * uint64_t(r);
    hs.output_count = hs.query_count;
    hs.kv_count = uint64_t(rows_per_head);

    // Reservoir: the `capacity` smallest priorities, found by a full sort.
    std::vector<const TokenRows*> sorted;
    for (const auto& t : rows) sorted.push_back(&t);
    std::sort(sorted.begin(), sorted.end(), [](auto* a, auto* b) { return a->priority < b->priority; });
    Reservoir& res = s.reservoirs[hi];
    for (size_t i = 0; i < sorted.size() && int(i) < capacity; ++i) {
      const TokenRows& t = *sorted[i];
      res.q.insert(res.q.end(), t.q.begin(), t.q.end());
      res.key_pre.insert(res.key_pre.end(), t.key_pre.begin(), t.key_pre.end());
      res.key.insert(res.key.end(), t.key.begin(), t.key.end());
      res.value.insert(res.value.end(), t.value.begin(), t.value.end());
      res.position.push_back(t.position);
      res.doc.push_back(t.doc);
      res.priority.push_back(t.priority);
      res.heldout.push_back(uint8_t(t.doc % 5 == 4));
    }
    out.rows.push_back(std::move(rows));
  }
  return out;
}

// A random orthogonal matrix (Gram-Schmidt on Gaussian columns), row-major [d, d].
template <typename Rng>
std::vector<double> random_orthogonal(int d, Rng& rng) {
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<double> m(size_t(d * d));
  for (auto& x : m) x = normal(rng);
  for (int j = 0; j < d; ++j) {
    for (int k = 0; k < j; ++k) {
      double dot = 0;
      for (int i = 0; i < d; ++i) dot += m[size_t(i * d + j)] * m[size_t(i * d + k)];
      for (int i = 0; i < d; ++i) m[size_t(i * d + j)] -= dot * m[size_t(i * d + k)];
    }
    double norm = 0;
    for (int i = 0; i < d; ++i) norm += m[size_t(i * d + j)] * m[size_t(i * d + j)];
    norm = std::sqrt(norm);
    for (int i = 0; i < d; ++i) m[size_t(i * d + j)] /= norm;
  }
  return m;
}

inline Artifact random_artifact(const ModelConfig& c, const ModelFingerprint& fp, uint64_t seed,
                                const std::string& method = "oscar") {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> uni(0.0, 1.0);
  Artifact a;
  a.command = "kvcc compile test";
  a.model_id = "small-test";
  a.fingerprint = fp;
  a.n_layers = c.n_layers;
  a.n_heads = c.n_heads;
  a.n_kv_heads = c.n_kv_heads;
  a.head_dim = c.head_dim;
  a.rope_style = c.rope_style;
  a.provenance = {"datahash", 12345, 17, 3, "statshash", "calibrated"};
  a.recipe.method = method;
  a.recipe.value_target = "output";
  a.recipe.seed = seed;
  a.recipe.params = {{"clip_grid", "0.8:1.0:0.01"}, {"note", "random test artifact"}};
  const int d = c.head_dim;
  for (int i = 0; i < c.n_layers * c.n_kv_heads; ++i) {
    HeadArtifact h;
    for (SideArtifact* side : {&h.key, &h.value}) {
      side->rotation = random_orthogonal(d, rng);
      for (int k = 0; k < d; ++k) side->eigenvalues.push_back(uni(rng) * 10);
      std::sort(side->eigenvalues.begin(), side->eigenvalues.end());
      side->clip_ratio = 0.5 + 0.5 * uni(rng);
    }
    h.key.levels = {-1.5 - uni(rng), -0.4, 0.45, 1.6 + uni(rng)};
    NamedArray codebook{"codebook", {2, 3}, {}, false};
    for (int k = 0; k < 6; ++k) codebook.data.push_back(uni(rng) - 0.5);
    NamedArray channels{"outlier_channels", {3}, {0, 5, double(d - 1)}, true};
    h.value.extras = {codebook, channels};
    a.heads.push_back(std::move(h));
  }
  return a;
}

#ifdef KVCC_SOURCE_DIR
// The project zoo's published HDF5 artifacts (format 1.0), sorted.
inline std::vector<std::string> published_artifacts() {
  std::vector<std::string> out;
  for (const auto& e :
       std::filesystem::recursive_directory_iterator(std::filesystem::path(KVCC_SOURCE_DIR) / "zoo" / "published")) {
    const std::string name = e.path().filename().string();
    if (e.is_regular_file() && name.rfind("artifact.", 0) == 0 && name.size() > 9 &&
        name.compare(name.size() - 8, 8, ".kvcc.h5") == 0)
      out.push_back(e.path().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}
#endif

}  // namespace kvcc::testing
