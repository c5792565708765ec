#include "compile/compile.h"
#include "compile/allocate.h"
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
#include "compile/layer_budgets.h"
#include "compile/rotation.h"
#include "formats/error.h"
#include "formats/h5_common.h"
#include "formats/kv_codec.h"
#include "formats/method.h"

namespace kvcc {

namespace {

const MethodTraits& traits(const Recipe& r) { return method_traits(method_of(r)); }
bool attention_aware(const Recipe& r) { return traits(r).rotation == RotationRule::AttentionAware; }
// Whether a side coded by recipe `r` (a side_recipe) gets a fitted quantiser: clip ratios (uniform
// grid) or a level table (oscar-lm).
bool fits_quantiser(const Recipe& r, const CompileOptions& options) {
  if (oscar_published(r)) return false;  // OSCAR's fixed clip ratios
  const Fit fit = traits(r).fit;
  return (fit == Fit::ClipRatio && options.fit_clip) || fit == Fit::LevelTable;
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
void compile_turboquant_side(const Recipe& recipe, const HeadStats& hs, KvSide which, int layer, int h, int d,
                             LevelCache& cache, SideArtifact& side) {
  const double bits = which == KvSide::Key ? recipe.key_bits : recipe.value_bits;
  const bool prod = param_or(recipe, "variant", "mse") == "prod";
  const std::string codebook = param_or(recipe, "codebook", "sphere");
  const int b_lo = int(std::floor(bits)) - (prod ? 1 : 0);
  const int n_hi = int(std::lround((bits - std::floor(bits)) * d));
  KVCC_REQUIRE(n_hi < d, "turboquant: the outlier split leaves no regular channels");
  const int s = int(which);
  const std::vector<double>& m2 = which == KvSide::Key ? hs.key_m2 : hs.value_m2;
  std::vector<int> order(static_cast<size_t>(d));
  std::iota(order.begin(), order.end(), 0);
  if (m2.size() == size_t(d) * d)
    std::stable_sort(order.begin(), order.end(),
                     [&](int a, int b) { return m2[size_t(a) * d + a] > m2[size_t(b) * d + b]; });
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
  switch (traits(recipe).rotation) {
    case RotationRule::AttentionAware: {
      const SymmetricEigen eig = symmetric_eigen(*target, d);
      side.rotation = compose_oscar(eig, recipe.composition);
      side.eigenvalues = eig.values;
      return;
    }
    case RotationRule::Hadamard:
      side.rotation = hadamard_matrix(d);
      return;
    case RotationRule::Identity:
      side.rotation = identity_matrix(d);
      return;
    case RotationRule::Random: {
      const int head_for_seed = recipe.granularity == "layer" ? 0 : h;
      side.rotation = random_orthogonal(d, derive_seed(recipe.seed, layer, head_for_seed, int(which)));
      return;
    }
    case RotationRule::OutlierBlocks:  // compile_turboquant_side
    case RotationRule::Codebooks:      // compile_commvq_head
      break;
  }
  throw Error("no rotation rule for method '" + recipe.method + "'");
}

// Fits the quantiser shared by KV heads [h0, h0 + span) of a layer jointly on their aligned
// reservoir rows (the same tokens in every head) and stores it in each head.
void fit_quantiser(const Stats& stats, const Recipe& recipe, const CompileOptions& options, int layer, int h0, int span,
                   Artifact& art) {
  const int d = stats.config.head_dim;
  const bool lm = traits(recipe).fit == Fit::LevelTable;
  std::vector<const Reservoir*> reservoirs;
  for (int k = 0; k < span; ++k) reservoirs.push_back(&stats.reservoir(layer, h0 + k));
  const std::vector<FitRows> rows =
      select_aligned_rows(reservoirs, false, lm ? 4 * options.max_fit_rows : options.max_fit_rows);
  const std::string where = "layer " + std::to_string(layer) +
                            (span == 1 ? " KV head " + std::to_string(h0)
                                       : " KV heads " + std::to_string(h0) + ".." + std::to_string(h0 + span - 1));
  // A spanning group fits on the tokens every head of the group holds.
  const std::string none = span == 1 ? " has none" : " share none";
  KVCC_REQUIRE(rows[0].n > 0, lm ? recipe.method + " needs reservoir fitting rows; " + where + none
                                 : "stats have no reservoir fitting rows for " + where +
                                       (span == 1 ? "" : " in common") +
                                       " (calibrate with a reservoir, or compile with --no-fit-clip)");
  for (KvSide which : {KvSide::Key, KvSide::Value}) {
    const Recipe sr = side_recipe(recipe, which);  // a mixed kivi recipe fits its value grid only
    if (!fits_quantiser(sr, options)) continue;
    std::vector<SideArtifact*> sides;
    for (int k = 0; k < span; ++k) {
      HeadArtifact& ha = art.head(layer, h0 + k);
      sides.push_back(which == KvSide::Key ? &ha.key : &ha.value);
    }
    const std::vector<const SideArtifact*> csides(sides.begin(), sides.end());
    if (lm) {
      const std::vector<float> y = rotated_side_by_side(csides, which, rows, true);
      const int group = recipe.group > 0 ? recipe.group : d;
      const std::vector<double> levels =
          lloyd_max_empirical(normalised_coordinates(y, rows[0].n, span * d, group), side_code_bits(recipe, which));
      for (SideArtifact* s : sides) s->levels = levels;
    } else {
      const double ratio = fit_clip_ratio(sr, csides, which, rows);
      for (SideArtifact* s : sides) s->clip_ratio = ratio;
    }
  }
}

void compile_layer(const Stats& stats, const Recipe& recipe, const CompileOptions& options, int layer,
                   LevelCache& cache, Artifact& art) {
  const int d = stats.config.head_dim, n_kv = stats.config.n_kv_heads;
  const Method m = method_of(recipe);
  const Recipe value_recipe = side_recipe(recipe, KvSide::Value);  // differs for mixed kivi
  // Importance targets (oscar; a mixed kivi recipe's oscar values): per head, or summed over the
  // layer's heads.
  const bool key_aware = attention_aware(recipe), value_aware = attention_aware(value_recipe);
  std::vector<Matrix> key_targets(static_cast<size_t>(n_kv)), value_targets(static_cast<size_t>(n_kv));
  for (int h = 0; h < n_kv; ++h) {
    if (key_aware) key_targets[size_t(h)] = key_target(stats.head(layer, h), d);
    if (value_aware)
      value_targets[size_t(h)] = value_target(stats.head(layer, h), stats.reservoir(layer, h), recipe.value_target, d);
  }
  if (recipe.granularity == "layer") {
    for (int h = 1; h < n_kv; ++h) {
      for (size_t i = 0; i < key_targets[0].size(); ++i) key_targets[0][i] += key_targets[size_t(h)][i];
      for (size_t i = 0; i < value_targets[0].size(); ++i) value_targets[0][i] += value_targets[size_t(h)][i];
    }
  }
  for (int h = 0; h < n_kv; ++h) {
    HeadArtifact& ha = art.head(layer, h);
    if (m == Method::Commvq) {  // codebooks trained by EM on the reservoir (compile/commvq.h)
      compile_commvq_head(stats.reservoir(layer, h), recipe, stats.config.rope_style, layer, h, ha);
      continue;
    }
    const HeadStats& hs = stats.head(layer, h);
    const size_t t = recipe.granularity == "layer" ? 0 : size_t(h);
    for (KvSide which : {KvSide::Key, KvSide::Value}) {
      SideArtifact& side = which == KvSide::Key ? ha.key : ha.value;
      if (m == Method::TurboQuant) {
        compile_turboquant_side(recipe, hs, which, layer, h, d, cache, side);
        continue;
      }
      const Recipe sr = which == KvSide::Key ? recipe : value_recipe;
      const Matrix* target =
          attention_aware(sr) ? (which == KvSide::Key ? &key_targets[t] : &value_targets[t]) : nullptr;
      if (recipe.granularity == "layer" && h > 0) {  // one rotation per layer: head 0's
        const SideArtifact& first = which == KvSide::Key ? art.head(layer, 0).key : art.head(layer, 0).value;
        side.rotation = first.rotation;
        side.eigenvalues = first.eigenvalues;
      } else {
        rotation_for(sr, target, layer, h, which, d, side);
      }
    }
  }
  if (oscar_published(recipe))
    for (int h = 0; h < n_kv; ++h) {
      art.head(layer, h).key.clip_ratio = kOscarPublishedKeyClip;
      art.head(layer, h).value.clip_ratio = kOscarPublishedValueClip;
    }
  // Clip ratios (uniform grid) and level tables (oscar-lm): one fit per quantiser group of heads,
  // i.e. per KV head unless recipe.group spans several.
  if (fits_quantiser(recipe, options) || fits_quantiser(value_recipe, options)) {
    const int span = group_span(recipe, d, n_kv);
    for (int h0 = 0; h0 < n_kv; h0 += span) fit_quantiser(stats, recipe, options, layer, h0, span, art);
  }
}

}  // namespace

void check_published_options(const CompileOptions& o) {
  const auto it = o.params.find("variant");
  if (o.method != method_name(Method::Oscar) || it == o.params.end() || it->second != "published") return;
  // As published: its value target and fixed clip ratios; options that would change them are refused.
  KVCC_REQUIRE(o.value_target.empty() || o.value_target == kOscarPublishedValueTarget,
               std::string("oscar variant=published fits OSCAR's own value target ") + kOscarPublishedValueTarget +
                   " (its code's score-weighted value moment), not '" + o.value_target + "'");
  KVCC_REQUIRE(o.fit_clip,
               "oscar variant=published uses OSCAR's fixed clip ratios 0.96 / 0.92; --no-fit-clip does not apply");
}

Recipe make_recipe(const CompileOptions& o, int head_dim, int n_kv_heads) {
  const Method method = method_from_name(o.method);  // lists the table's names when unknown
  const MethodTraits& t = method_traits(method);
  check_method_options(method, 0, o.params);  // parameters it does not take, values out of range
  Recipe r;
  r.method = t.name;
  r.key_bits = o.key_bits;
  r.value_bits = o.value_bits;
  r.seed = o.seed;
  r.params = o.params;
  for (const MethodParam& p : t.params)
    if (p.default_value) r.params.emplace(p.key, p.default_value);
  r.group = o.group >= 0 ? o.group : t.group;
  r.sink = o.sink >= 0 ? o.sink : t.sink;
  r.recent = o.recent >= 0 ? o.recent : t.recent;
  r.page_size = o.page_size > 0 ? o.page_size : t.page_size;
  KVCC_REQUIRE(o.granularity == "head" || o.granularity == "layer",
               "granularity must be head or layer, got '" + o.granularity + "'");
  r.granularity = o.granularity;
  // The attention-aware rotation's settings: oscar's, or a mixed kivi recipe's oscar values.
  const MethodTraits* aware = nullptr;
  for (KvSide s : {KvSide::Key, KvSide::Value})
    if (const MethodTraits& st = traits(side_recipe(r, s)); st.rotation == RotationRule::AttentionAware) aware = &st;
  check_published_options(o);
  if (oscar_published(r)) r.value_target = kOscarPublishedValueTarget;
  if (aware) {
    r.value_target = !r.value_target.empty()  ? r.value_target
                     : o.value_target.empty() ? aware->value_target
                                              : o.value_target;
    r.composition = o.composition.empty() ? aware->composition : o.composition;
    KVCC_REQUIRE(r.value_target == "output" || r.value_target == "p2" || r.value_target == "logit2",
                 "value target must be output, p2 or logit2, got '" + r.value_target + "'");
    KVCC_REQUIRE(r.composition == "UHP" || r.composition == "UH" || r.composition == "U",
                 "composition must be UHP, UH or U, got '" + r.composition + "'");
  } else {
    r.value_target = "";
    r.composition = "";
  }
  if (!t.bit_presets.empty())
    for (KvSide s : {KvSide::Key, KvSide::Value}) {
      const double b = side_nominal_bits(r, s);
      std::vector<std::string> presets;
      for (double p : t.bit_presets) presets.push_back(std::to_string(int(p)));
      KVCC_REQUIRE(std::find(t.bit_presets.begin(), t.bit_presets.end(), b) != t.bit_presets.end(),
                   std::string(t.name) + ": " + kv_side_name(s) + " bits must be " + presets.front() +
                       (presets.size() > 1 ? " or " + presets.back() : "") + " (the presets), got " +
                       std::to_string(b));
    }
  if (t.whole_rows)
    KVCC_REQUIRE(r.group == 0 || r.group == head_dim,
                 std::string(t.name) + " quantises whole rows; --group does not apply");
  if (method == Method::Commvq) commvq_fill_recipe(r, head_dim);  // stages and code bits from the presets
  KVCC_REQUIRE(r.sink >= 0 && r.recent >= 0 && r.page_size > 0, "sink, recent and page size must be >= 0");
  KVCC_REQUIRE(r.group >= 0, "group must be >= 0");
  for (KvSide s : {KvSide::Key, KvSide::Value}) side_code_bits(r, s);  // range and fractional budgets
  if (r.group > head_dim) group_span(r, head_dim, n_kv_heads);  // a group spanning KV heads: checks the method and G
  else if (r.group > 0)
    KVCC_REQUIRE(head_dim % r.group == 0, "--group " + std::to_string(r.group) + " must divide head_dim " +
                                              std::to_string(head_dim) +
                                              " (or, for a group spanning KV heads, be a multiple of it)");
  return r;
}

namespace {
// CompileOptions::layer_budgets, from the stats.
std::vector<double> eviction_budgets(const Stats& stats, const CompileOptions& options) {
  if (options.layer_budgets.empty()) return {};
  if (options.layer_budgets == "sensitivity") return layer_budgets_from_sensitivity(stats);
  if (options.layer_budgets == "spread") return layer_budgets_from_stats(stats);
  throw Error("--layer-budgets must be sensitivity or spread, got '" + options.layer_budgets + "'");
}
}  // namespace

Artifact compile_artifact(const Stats& stats, const CompileOptions& options) {
  std::vector<double> budgets = eviction_budgets(stats, options);  // refused before the long work
  if (options.bits_budget > 0) {                                   // compiles each width
    Artifact art = compile_with_budget(stats, options);
    art.layer_budgets = std::move(budgets);
    return art;
  }
  const ModelConfig& c = stats.config;
  KVCC_REQUIRE(c.n_layers > 0 && c.n_kv_heads > 0 && c.head_dim > 0, "stats describe an empty model");
  const size_t n_heads = size_t(c.n_layers) * size_t(c.n_kv_heads);
  KVCC_REQUIRE(
      stats.heads.size() == n_heads && stats.reservoirs.size() == n_heads,
      "stats hold " + std::to_string(stats.heads.size()) + " heads, the model needs " + std::to_string(n_heads));
  Artifact art;
  art.producer = std::string("kvcc ") + KVCC_VERSION;
  art.created = h5::utc_now_iso8601();
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
  art.layer_budgets = std::move(budgets);
  return art;
}

}  // namespace kvcc
