#include "compile/compile.h"
#include "compile/commvq.h"

#include <cblas.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <ctime>
#include <mutex>
#include <numeric>
#include <thread>

#include "compile/fit.h"
#include "compile/rotation.h"
#include "formats/error.h"
#include "formats/kv_codec.h"

namespace kvcc {

namespace {

bool attention_aware(const std::string& m) { return m == "oscar" || m == "oscar-lm"; }
// Whether a side coded by method `m` gets a fitted quantiser: clip ratios (uniform grid) or a level
// table (oscar-lm).
bool fits_quantiser(const std::string& m, const CompileOptions& options) {
  return (is_uniform_method(m) && options.fit_clip) || m == "oscar-lm";
}

std::string param_or(const Recipe& r, const std::string& key, const std::string& fallback) {
  auto it = r.params.find(key);
  return it == r.params.end() ? fallback : it->second;
}

// Lloyd–Max tables shared by every head (continuous densities depend only on dim and bits).
struct LevelCache {
  std::mutex mutex;
  std::map<std::pair<int, int>, std::vector<double>> tables;
  std::vector<double> get(const std::string& codebook, int dim, int bits) {
    const int key_dim = codebook == "gaussian" || dim < 3 ? 0 : dim;
    std::lock_guard<std::mutex> lock(mutex);
    auto it = tables.find({key_dim, bits});
    if (it != tables.end()) return it->second;
    std::vector<double> t = key_dim == 0 ? lloyd_max_gaussian(bits) : lloyd_max_sphere(dim, bits);
    tables[{key_dim, bits}] = t;
    return t;
  }
};

NamedArray int_array(const std::string& name, const std::vector<int>& values) {
  NamedArray a;
  a.name = name;
  a.shape = {int64_t(values.size())};
  a.data.assign(values.begin(), values.end());
  a.integer = true;
  return a;
}

// TurboQuant: outlier split by the calibration second moment's diagonal, a random rotation per
// sub-vector placed so that rotated coordinates [0, n_hi) come from the outlier channels, and the
// Lloyd–Max tables of each sub-vector's dimension.
void compile_turboquant_side(const Recipe& recipe, const HeadStats& hs, KvSide which, int layer,
                             int h, int d, LevelCache& cache, SideArtifact& side) {
  const double bits = which == KvSide::Key ? recipe.key_bits : recipe.value_bits;
  const bool prod = param_or(recipe, "variant", "mse") == "prod";
  const std::string codebook = param_or(recipe, "codebook", "sphere");
  const int b_lo = int(std::floor(bits)) - (prod ? 1 : 0);
  const int n_hi = int(std::lround((bits - std::floor(bits)) * d));
  require(n_hi < d, "turboquant: the outlier split leaves no regular channels");
  const int s = int(which);
  const std::vector<double>& m2 = which == KvSide::Key ? hs.key_m2 : hs.value_m2;
  std::vector<int> order(static_cast<size_t>(d));
  std::iota(order.begin(), order.end(), 0);
  if (m2.size() == size_t(d) * d)
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
      return m2[size_t(a) * d + a] > m2[size_t(b) * d + b];
    });
  std::vector<int> hi(order.begin(), order.begin() + n_hi), lo(order.begin() + n_hi, order.end());
  std::sort(hi.begin(), hi.end());
  std::sort(lo.begin(), lo.end());
  side.rotation.assign(size_t(d) * d, 0.0);
  auto place = [&](const std::vector<int>& channels, int offset, uint64_t seed) {
    const int m = int(channels.size());
    if (m == 0) return;
    const Matrix pi = random_orthogonal(m, seed);
    for (int a = 0; a < m; ++a)
      for (int j = 0; j < m; ++j) side.rotation[size_t(channels[size_t(a)]) * d + offset + j] = pi[size_t(a) * m + j];
  };
  place(hi, 0, derive_seed(recipe.seed, layer, h, 10 + s));
  place(lo, n_hi, derive_seed(recipe.seed, layer, h, 20 + s));
  if (b_lo > 0) side.levels = cache.get(codebook, d - n_hi, b_lo);
  if (n_hi > 0) {
    side.extras.push_back(int_array("split", {n_hi}));
    side.extras.push_back(int_array("outlier_channels", hi));
    NamedArray ol;
    ol.name = "outlier_levels";
    ol.data = cache.get(codebook, n_hi, b_lo + 1);
    ol.shape = {int64_t(ol.data.size())};
    side.extras.push_back(ol);
  }
  if (prod) {
    GaussianStream g(derive_seed(recipe.seed, layer, h, 30 + s));
    NamedArray qjl;
    qjl.name = "qjl_matrix";
    qjl.shape = {d, d};
    qjl.data.resize(size_t(d) * d);
    for (double& x : qjl.data) x = g.next();
    side.extras.push_back(qjl);
  }
}

// Rotation of one side for the rotation-only methods and oscar; eigenvalues where there are any.
void rotation_for(const Recipe& recipe, const Matrix* target, int layer, int h, KvSide which, int d,
                  SideArtifact& side) {
  const std::string& m = recipe.method;
  if (attention_aware(m)) {
    const SymmetricEigen eig = symmetric_eigen(*target, d);
    side.rotation = compose_oscar(eig, recipe.composition);
    side.eigenvalues = eig.values;
  } else if (m == "hadamard" || m == "kvarn") {
    side.rotation = hadamard_matrix(d);
  } else if (m == "identity" || m == "kivi") {
    side.rotation = identity_matrix(d);
  } else if (m == "random") {
    const int head_for_seed = recipe.granularity == "layer" ? 0 : h;
    side.rotation = random_orthogonal(d, derive_seed(recipe.seed, layer, head_for_seed, int(which)));
  } else {
    throw Error("no rotation rule for method '" + m + "'");
  }
}

// Fits the quantiser shared by KV heads [h0, h0 + span) of a layer jointly on their aligned
// reservoir rows (the same tokens in every head) and stores it in each head.
void fit_quantiser(const Stats& stats, const Recipe& recipe, const CompileOptions& options, int layer,
                   int h0, int span, Artifact& art) {
  const int d = stats.config.head_dim;
  const bool lm = recipe.method == "oscar-lm";
  std::vector<const Reservoir*> reservoirs;
  for (int k = 0; k < span; ++k) reservoirs.push_back(&stats.reservoir(layer, h0 + k));
  const std::vector<FitRows> rows =
      select_aligned_rows(reservoirs, false, lm ? 4 * options.max_fit_rows : options.max_fit_rows);
  const std::string where = "layer " + std::to_string(layer) +
                            (span == 1 ? " KV head " + std::to_string(h0)
                                       : " KV heads " + std::to_string(h0) + ".." + std::to_string(h0 + span - 1));
  // A spanning group fits on the tokens every head of the group holds.
  const std::string none = span == 1 ? " has none" : " share none";
  require(rows[0].n > 0, lm ? "oscar-lm needs reservoir fitting rows; " + where + none
                            : "stats have no reservoir fitting rows for " + where +
                                  (span == 1 ? "" : " in common") +
                                  " (calibrate with a reservoir, or compile with --no-fit-clip)");
  for (KvSide which : {KvSide::Key, KvSide::Value}) {
    const Recipe sr = side_recipe(recipe, which);  // a mixed kivi recipe fits its value grid only
    if (!fits_quantiser(sr.method, options)) continue;
    std::vector<SideArtifact*> sides;
    for (int k = 0; k < span; ++k) {
      HeadArtifact& ha = art.head(layer, h0 + k);
      sides.push_back(which == KvSide::Key ? &ha.key : &ha.value);
    }
    const std::vector<const SideArtifact*> csides(sides.begin(), sides.end());
    if (lm) {
      const std::vector<float> y = rotated_side_by_side(csides, which, rows, true);
      const int group = recipe.group > 0 ? recipe.group : d;
      const std::vector<double> levels = lloyd_max_empirical(
          normalised_coordinates(y, rows[0].n, span * d, group), side_code_bits(recipe, which));
      for (SideArtifact* s : sides) s->levels = levels;
    } else {
      const double ratio = fit_clip_ratio(sr, csides, which, rows);
      for (SideArtifact* s : sides) s->clip_ratio = ratio;
    }
  }
}

void compile_layer(const Stats& stats, const Recipe& recipe, const CompileOptions& options,
                   int layer, LevelCache& cache, Artifact& art) {
  const int d = stats.config.head_dim, n_kv = stats.config.n_kv_heads;
  const std::string& m = recipe.method;
  const Recipe value_recipe = side_recipe(recipe, KvSide::Value);  // differs for mixed kivi
  // Importance targets (oscar; a mixed kivi recipe's oscar values): per head, or summed over the
  // layer's heads.
  const bool key_aware = attention_aware(m), value_aware = attention_aware(value_recipe.method);
  std::vector<Matrix> key_targets(static_cast<size_t>(n_kv)), value_targets(static_cast<size_t>(n_kv));
  for (int h = 0; h < n_kv; ++h) {
    if (key_aware) key_targets[size_t(h)] = key_target(stats.head(layer, h), d);
    if (value_aware)
      value_targets[size_t(h)] =
          value_target(stats.head(layer, h), stats.reservoir(layer, h), recipe.value_target, d);
  }
  if (recipe.granularity == "layer") {
    for (int h = 1; h < n_kv; ++h) {
      for (size_t i = 0; i < key_targets[0].size(); ++i) key_targets[0][i] += key_targets[size_t(h)][i];
      for (size_t i = 0; i < value_targets[0].size(); ++i) value_targets[0][i] += value_targets[size_t(h)][i];
    }
  }
  for (int h = 0; h < n_kv; ++h) {
    HeadArtifact& ha = art.head(layer, h);
    if (m == "commvq") {  // codebooks trained by EM on the reservoir (compile/commvq.h)
      compile_commvq_head(stats.reservoir(layer, h), recipe, stats.config.rope_style, layer, h, ha);
      continue;
    }
    const HeadStats& hs = stats.head(layer, h);
    const size_t t = recipe.granularity == "layer" ? 0 : size_t(h);
    for (KvSide which : {KvSide::Key, KvSide::Value}) {
      SideArtifact& side = which == KvSide::Key ? ha.key : ha.value;
      if (m == "turboquant") {
        compile_turboquant_side(recipe, hs, which, layer, h, d, cache, side);
        continue;
      }
      const Recipe sr = which == KvSide::Key ? recipe : value_recipe;
      const Matrix* target =
          attention_aware(sr.method) ? (which == KvSide::Key ? &key_targets[t] : &value_targets[t]) : nullptr;
      if (recipe.granularity == "layer" && h > 0) {  // one rotation per layer: head 0's
        const SideArtifact& first = which == KvSide::Key ? art.head(layer, 0).key : art.head(layer, 0).value;
        side.rotation = first.rotation;
        side.eigenvalues = first.eigenvalues;
      } else {
        rotation_for(sr, target, layer, h, which, d, side);
      }
    }
  }
  // Clip ratios (uniform grid) and level tables (oscar-lm): one fit per quantiser group of heads,
  // i.e. per KV head unless recipe.group spans several.
  if (fits_quantiser(m, options) || fits_quantiser(value_recipe.method, options)) {
    const int span = group_span(recipe, d, n_kv);
    for (int h0 = 0; h0 < n_kv; h0 += span) fit_quantiser(stats, recipe, options, layer, h0, span, art);
  }
}

}  // namespace

const std::vector<std::string>& compile_methods() {
  static const std::vector<std::string> methods = {"oscar",  "oscar-lm",   "hadamard", "identity",
                                                   "random", "turboquant", "kivi",     "kvarn",
                                                   "commvq"};
  return methods;
}

std::string utc_timestamp() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

Recipe make_recipe(const CompileOptions& o, int head_dim, int n_kv_heads) {
  const auto& methods = compile_methods();
  require(std::find(methods.begin(), methods.end(), o.method) != methods.end(),
          "unknown method '" + o.method + "' (expected oscar, oscar-lm, hadamard, identity, random, "
          "turboquant, kivi, kvarn or commvq)");
  Recipe r;
  r.method = o.method;
  r.key_bits = o.key_bits;
  r.value_bits = o.value_bits;
  r.seed = o.seed;
  r.params = o.params;
  const bool kivi = o.method == "kivi", tq = o.method == "turboquant", kvarn = o.method == "kvarn";
  r.group = o.group >= 0 ? o.group : (kivi ? 32 : 0);
  r.sink = o.sink >= 0 ? o.sink : (kivi || tq ? 0 : (kvarn ? 128 : 64));
  r.recent = o.recent >= 0 ? o.recent : (kivi ? 128 : (tq ? 0 : (kvarn ? 128 : 256)));
  r.page_size = o.page_size > 0 ? o.page_size : (kvarn ? 128 : 64);
  require(o.granularity == "head" || o.granularity == "layer",
          "granularity must be head or layer, got '" + o.granularity + "'");
  r.granularity = o.granularity;
  // kivi --values hadamard|oscar: the mixed recipe (kv_codec.h side_recipe checks the value).
  require(kivi || r.params.count("values") == 0,
          "--values (a rotated value grid) applies to kivi only, not " + o.method);
  if (attention_aware(o.method) || attention_aware(side_recipe(r, KvSide::Value).method)) {
    require(o.value_target == "output" || o.value_target == "p2" || o.value_target == "logit2",
            "value target must be output, p2 or logit2, got '" + o.value_target + "'");
    require(o.composition == "UHP" || o.composition == "UH" || o.composition == "U",
            "composition must be UHP, UH or U, got '" + o.composition + "'");
    r.value_target = o.value_target;
    r.composition = o.composition;
  } else {
    r.value_target = "";
    r.composition = "";
  }
  if (tq) {
    r.params.emplace("variant", "mse");
    r.params.emplace("codebook", "sphere");
    require(r.params["variant"] == "mse" || r.params["variant"] == "prod",
            "turboquant variant must be mse or prod");
    require(r.params["codebook"] == "sphere" || r.params["codebook"] == "gaussian",
            "turboquant codebook must be sphere or gaussian");
  }
  if (kvarn) r.params.emplace("iterations", "8");
  if (o.method == "commvq") {
    require(r.group == 0 || r.group == head_dim, "commvq codes whole rows; --group does not apply");
    commvq_fill_recipe(r, head_dim);  // stages and code bits from the 1-/2-bit presets
  }
  require(r.sink >= 0 && r.recent >= 0 && r.page_size > 0, "sink, recent and page size must be >= 0");
  require(r.group >= 0, "group must be >= 0");
  for (KvSide s : {KvSide::Key, KvSide::Value}) {
    const int bits = side_code_bits(r, s);  // validates the range and fractional budgets
    if (tq && r.params["variant"] == "prod")
      require(bits >= 1, "turboquant prod needs at least 1 bit");
  }
  if (tq || kvarn)
    require(r.group == 0 || r.group == head_dim, o.method + " quantises whole rows; --group does not apply");
  if (r.group > head_dim)
    group_span(r, head_dim, n_kv_heads);  // a group spanning KV heads: checks the method and G
  else if (r.group > 0)
    require(head_dim % r.group == 0,
            "--group " + std::to_string(r.group) + " must divide head_dim " + std::to_string(head_dim) +
                " (or, for a group spanning KV heads, be a multiple of it)");
  return r;
}

Artifact compile_artifact(const Stats& stats, const CompileOptions& options) {
  const ModelConfig& c = stats.config;
  require(c.n_layers > 0 && c.n_kv_heads > 0 && c.head_dim > 0, "stats describe an empty model");
  const size_t n_heads = size_t(c.n_layers) * size_t(c.n_kv_heads);
  require(stats.heads.size() == n_heads && stats.reservoirs.size() == n_heads,
          "stats hold " + std::to_string(stats.heads.size()) + " heads, the model needs " +
              std::to_string(n_heads));
  Artifact art;
  art.producer = std::string("kvcc ") + KVCC_VERSION;
  art.created = utc_timestamp();
  art.fingerprint = stats.fingerprint;
  art.n_layers = c.n_layers;
  art.n_heads = c.n_heads;
  art.n_kv_heads = c.n_kv_heads;
  art.head_dim = c.head_dim;
  art.rope_style = c.rope_style;
  art.provenance.data_sha256 = stats.provenance.data_sha256;
  art.provenance.tokens = stats.provenance.tokens;
  art.provenance.sequences = stats.provenance.sequences;
  art.provenance.seed = stats.provenance.seed;
  art.provenance.source = "calibrated";
  art.recipe = make_recipe(options, c.head_dim, c.n_kv_heads);
  art.heads.resize(n_heads);

  LevelCache cache;
  std::atomic<int> next_layer{0}, done{0};
  std::mutex progress_mutex;
  std::exception_ptr failure;
  int threads = options.threads > 0 ? options.threads : int(std::max(1u, std::thread::hardware_concurrency()));
  threads = std::min(threads, c.n_layers);
  // Layers run in parallel and BLAS/LAPACK run single-threaded, always: a threaded dsyevd rounds
  // differently, and the artifact must not depend on --threads (the calls are small anyway).
  const int blas_threads = openblas_get_num_threads();
  openblas_set_num_threads(1);
  auto worker = [&] {
    for (int layer = next_layer++; layer < c.n_layers; layer = next_layer++) {
      try {
        compile_layer(stats, art.recipe, options, layer, cache, art);
      } catch (...) {
        std::lock_guard<std::mutex> lock(progress_mutex);
        if (!failure) failure = std::current_exception();
        next_layer = c.n_layers;
        return;
      }
      const int finished = ++done;
      if (options.progress) {
        std::lock_guard<std::mutex> lock(progress_mutex);
        options.progress(finished, c.n_layers);
      }
    }
  };
  std::vector<std::thread> pool;
  for (int i = 1; i < threads; ++i) pool.emplace_back(worker);
  worker();
  for (auto& t : pool) t.join();
  openblas_set_num_threads(blas_threads);
  if (failure) std::rethrow_exception(failure);
  return art;
}

}  // namespace kvcc
