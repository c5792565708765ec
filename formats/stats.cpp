#include "formats/stats.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <unordered_set>

#include "formats/atomic_file.h"
#include "formats/error.h"
#include "formats/h5.h"
#include "formats/h5_common.h"
#include "formats/sha256.h"

namespace kvcc {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// The moment matrices of one head, by dataset name, so every loop over them names them once.
struct MomentRef {
  const char* name;
  std::vector<double> HeadStats::*member;
};
constexpr MomentRef kMoments[] = {{"query_m2", &HeadStats::query_m2},
                                  {"output_m2", &HeadStats::output_m2},
                                  {"p2_m2", &HeadStats::p2_m2},
                                  {"key_m2", &HeadStats::key_m2},
                                  {"value_m2", &HeadStats::value_m2}};
constexpr MomentRef kRanges[] = {{"key_min", &HeadStats::key_min},
                                 {"key_max", &HeadStats::key_max},
                                 {"value_min", &HeadStats::value_min},
                                 {"value_max", &HeadStats::value_max}};

std::string head_path(int layer, int h) { return "/layers/" + std::to_string(layer) + "/kv" + std::to_string(h); }

void check_head_shapes(const HeadStats& hs, int d, const std::string& where) {
  for (const auto& m : kMoments)
    KVCC_REQUIRE((hs.*m.member).size() == size_t(d) * size_t(d),
                 where + "/" + m.name + " has " + std::to_string((hs.*m.member).size()) + " values, expected " +
                     std::to_string(d) + "x" + std::to_string(d));
  for (const auto& m : kRanges)
    KVCC_REQUIRE((hs.*m.member).size() == size_t(d), where + "/" + m.name + " has " +
                                                         std::to_string((hs.*m.member).size()) + " values, expected " +
                                                         std::to_string(d));
}

void check_reservoir_shapes(const Reservoir& r, const std::string& where) {
  const size_t n = r.position.size();
  const size_t d = size_t(r.d), g = size_t(r.group);
  KVCC_REQUIRE(r.q.size() == n * g * d && r.key_pre.size() == n * d && r.key.size() == n * d &&
                   r.value.size() == n * d && r.doc.size() == n && r.priority.size() == n && r.heldout.size() == n,
               where + "/reservoir: arrays disagree on the number of rows (" + std::to_string(n) + " positions)");
  KVCC_REQUIRE(int(n) <= r.capacity,
               where + "/reservoir: " + std::to_string(n) + " rows exceed capacity " + std::to_string(r.capacity));
}

void check_stats_shapes(const Stats& s) {
  const ModelConfig& c = s.config;
  KVCC_REQUIRE(c.n_layers > 0 && c.n_kv_heads > 0 && c.head_dim > 0 && c.n_heads % c.n_kv_heads == 0,
               "stats: invalid model shape (" + std::to_string(c.n_layers) + " layers, " + std::to_string(c.n_heads) +
                   "/" + std::to_string(c.n_kv_heads) + " heads, head_dim " + std::to_string(c.head_dim) + ")");
  const size_t n = size_t(c.n_layers) * size_t(c.n_kv_heads);
  KVCC_REQUIRE(s.heads.size() == n, "stats: " + std::to_string(s.heads.size()) + " head entries, expected " +
                                        std::to_string(n) + " (layers x kv heads)");
  KVCC_REQUIRE(s.reservoirs.size() == n, "stats: " + std::to_string(s.reservoirs.size()) + " reservoirs, expected " +
                                             std::to_string(n) + " (layers x kv heads)");
  KVCC_REQUIRE(!s.sensitivity.measured() || s.sensitivity.key_similarity_sum.size() == size_t(c.n_layers),
               "stats: " + std::to_string(s.sensitivity.key_similarity_sum.size()) + " layer sensitivities, expected " +
                   std::to_string(c.n_layers));
  for (int l = 0; l < c.n_layers; ++l)
    for (int h = 0; h < c.n_kv_heads; ++h) {
      check_head_shapes(s.head(l, h), c.head_dim, head_path(l, h));
      const Reservoir& r = s.reservoir(l, h);
      KVCC_REQUIRE(r.d == c.head_dim && r.group == c.group(),
                   head_path(l, h) + "/reservoir: group " + std::to_string(r.group) + " and d " + std::to_string(r.d) +
                       " do not match the model (" + std::to_string(c.group()) + ", " + std::to_string(c.head_dim) +
                       ")");
      check_reservoir_shapes(r, head_path(l, h));
    }
}

void write_config(const h5::Group& g, const ModelConfig& c) {
  g.set_attr("architecture", c.architecture);
  g.set_attr("n_layers", c.n_layers);
  g.set_attr("hidden", c.hidden);
  g.set_attr("n_heads", c.n_heads);
  g.set_attr("n_kv_heads", c.n_kv_heads);
  g.set_attr("head_dim", c.head_dim);
  g.set_attr("intermediate", c.intermediate);
  g.set_attr("vocab", c.vocab);
  g.set_attr("max_position", c.max_position);
  g.set_attr("rope_theta", c.rope_theta);
  g.set_attr("rope_scaling_type", c.rope_scaling.type);
  g.set_attr("rope_scaling_factor", c.rope_scaling.factor);
  g.set_attr("rope_scaling_low_freq_factor", c.rope_scaling.low_freq_factor);
  g.set_attr("rope_scaling_high_freq_factor", c.rope_scaling.high_freq_factor);
  g.set_attr("rope_scaling_original_max_position", c.rope_scaling.original_max_position);
  g.set_attr("rope_style", rope_style_name(c.rope_style));
  g.set_attr("rms_eps", c.rms_eps);
  g.set_attr("tied_embeddings", c.tied_embeddings);
  g.set_attr("qkv_bias", c.qkv_bias);
  g.set_attr("qk_norm", c.qk_norm);
  g.set_attr("bos_id", c.bos_id);
  g.set_attr("eos_id", c.eos_id);
  g.set_attr("add_bos", c.add_bos);
}

ModelConfig read_config(const h5::Group& g) {
  ModelConfig c;
  // Checked, not narrowed: 2^32 + 8 must not read as 8.
  auto as_int = [&](const char* name) {
    return g.attr_int32(name, std::numeric_limits<int>::min(), std::numeric_limits<int>::max());
  };
  c.architecture = g.attr_string("architecture");
  c.n_layers = as_int("n_layers");
  c.hidden = as_int("hidden");
  c.n_heads = as_int("n_heads");
  c.n_kv_heads = as_int("n_kv_heads");
  c.head_dim = as_int("head_dim");
  c.intermediate = as_int("intermediate");
  c.vocab = as_int("vocab");
  c.max_position = as_int("max_position");
  c.rope_theta = g.attr_double("rope_theta");
  c.rope_scaling.type = g.attr_string("rope_scaling_type");
  c.rope_scaling.factor = g.attr_double("rope_scaling_factor");
  c.rope_scaling.low_freq_factor = g.attr_double("rope_scaling_low_freq_factor");
  c.rope_scaling.high_freq_factor = g.attr_double("rope_scaling_high_freq_factor");
  c.rope_scaling.original_max_position = as_int("rope_scaling_original_max_position");
  try {
    c.rope_style = rope_style_from_name(g.attr_string("rope_style"));
  } catch (const Error& e) {
    g.fail(e.what());
  }
  c.rms_eps = g.attr_double("rms_eps");
  c.tied_embeddings = g.attr_bool("tied_embeddings");
  c.qkv_bias = g.attr_bool("qkv_bias");
  c.qk_norm = g.attr_bool("qk_norm");
  c.bos_id = as_int("bos_id");
  c.eos_id = as_int("eos_id");
  c.add_bos = g.attr_bool("add_bos");
  if (c.n_layers <= 0 || c.n_kv_heads <= 0 || c.n_heads <= 0 || c.head_dim <= 0 || c.n_heads % c.n_kv_heads != 0)
    g.fail("invalid model shape (" + std::to_string(c.n_layers) + " layers, " + std::to_string(c.n_heads) + "/" +
           std::to_string(c.n_kv_heads) + " heads, head_dim " + std::to_string(c.head_dim) + ")");
  return c;
}

void write_head(const h5::Group& g, const HeadStats& hs, int d) {
  const h5::Shape square{d, d}, vec{d};
  for (const auto& m : kMoments) g.write(m.name, square, hs.*m.member);
  for (const auto& m : kRanges) g.write(m.name, vec, hs.*m.member);
  g.set_attr("query_count", hs.query_count);
  g.set_attr("output_count", hs.output_count);
  g.set_attr("kv_count", hs.kv_count);
  g.set_attr("p2_weight", hs.p2_weight);
}

HeadStats read_head(const h5::Group& g, int d) {
  HeadStats hs;
  const h5::Shape square{d, d}, vec{d};
  for (const auto& m : kMoments) hs.*m.member = g.read<double>(m.name, square);
  for (const auto& m : kRanges) hs.*m.member = g.read<double>(m.name, vec);
  hs.query_count = g.attr_uint("query_count");
  hs.output_count = g.attr_uint("output_count");
  hs.kv_count = g.attr_uint("kv_count");
  hs.p2_weight = g.attr_double("p2_weight");
  return hs;
}

void write_reservoir(const h5::Group& g, const Reservoir& r) {
  const int64_t n = int64_t(r.size());
  g.set_attr("capacity", r.capacity);
  g.set_attr("group", r.group);
  g.set_attr("d", r.d);
  g.write("q", {n, r.group, r.d}, r.q);
  g.write("key_pre", {n, r.d}, r.key_pre);
  g.write("key", {n, r.d}, r.key);
  g.write("value", {n, r.d}, r.value);
  g.write("position", {n}, r.position);
  g.write("doc", {n}, r.doc);
  g.write("priority", {n}, r.priority);
  g.write("heldout", {n}, r.heldout);
}

Reservoir read_reservoir(const h5::Group& g, const ModelConfig& c, bool with_rows) {
  Reservoir r;
  constexpr int kMaxInt = std::numeric_limits<int>::max();
  r.capacity = g.attr_int32("capacity", 0, kMaxInt);
  r.group = g.attr_int32("group", 1, kMaxInt);
  r.d = g.attr_int32("d", 1, kMaxInt);
  if (r.group != c.group() || r.d != c.head_dim)
    g.fail("group " + std::to_string(r.group) + " and d " + std::to_string(r.d) + " do not match the model (" +
           std::to_string(c.group()) + ", " + std::to_string(c.head_dim) + ")");
  // The row count is checked against the capacity before anything is read (every read is also
  // bounded by the file's size).
  const h5::Shape shape = g.dataset("position").shape();
  if (shape.size() != 1) g.fail("position must be one-dimensional, has shape " + h5::shape_string(shape));
  const int64_t n = shape[0];
  if (n > r.capacity) g.fail(std::to_string(n) + " rows exceed capacity " + std::to_string(r.capacity));
  r.position = g.read<int32_t>("position", h5::Shape{n});
  if (with_rows) {
    r.q = g.read<float>("q", h5::Shape{n, r.group, r.d});
    r.key_pre = g.read<float>("key_pre", h5::Shape{n, r.d});
    r.key = g.read<float>("key", h5::Shape{n, r.d});
    r.value = g.read<float>("value", h5::Shape{n, r.d});
  }
  r.doc = g.read<uint32_t>("doc", h5::Shape{n});
  r.priority = g.read<uint64_t>("priority", h5::Shape{n});
  r.heldout = g.read<uint8_t>("heldout", h5::Shape{n});
  return r;
}

Stats read_stats_structure(const std::string& path, bool with_rows = true) {
  h5::File file = h5::File::open(path);
  h5::check_root_header(file, kStatsFormat, kStatsMajor);
  Stats s;
  s.producer = file.attr_string("producer");
  s.created = file.attr_string("created");
  s.command = file.attr_string("command");
  h5::Group model = file.group("model");
  s.config = read_config(model);
  s.fingerprint = h5::read_fingerprint(model);
  if (s.fingerprint.fields != fingerprint_fields(s.config))
    model.fail("model config does not match its fingerprint fields (edited or corrupt)");
  h5::Group prov = file.group("provenance");
  s.provenance.data_sha256 = prov.attr_string("data_sha256");
  s.provenance.tokens = prov.attr_uint("tokens");
  s.provenance.sequences = prov.attr_uint("sequences");
  s.provenance.seed = prov.attr_uint("seed");
  s.provenance.max_seq_len = prov.attr_int32("max_seq_len", 0, std::numeric_limits<int>::max());
  s.provenance.tokenizer = prov.attr_string("tokenizer");

  if (file.has("sensitivity")) {
    h5::Group g = file.group("sensitivity");
    LayerSensitivity& ls = s.sensitivity;
    ls.block = g.attr_int32("block", 2, std::numeric_limits<int>::max());
    ls.sink = g.attr_int32("sink", 0, std::numeric_limits<int>::max());
    ls.pairs = g.attr_uint("pairs");
    ls.key_similarity_sum = g.read<double>("key_similarity_sum", h5::Shape{int64_t(s.config.n_layers)});
    if (ls.pairs == 0) g.fail("sensitivity group with no (token, head) pairs");
  }
  const ModelConfig& c = s.config;
  h5::Group layers = file.group("layers");
  // Not reserved from the (untrusted) counts: a missing group ends the loop with an Error.
  for (int l = 0; l < c.n_layers; ++l) {
    h5::Group layer = layers.group(std::to_string(l));
    for (int h = 0; h < c.n_kv_heads; ++h) {
      h5::Group head = layer.group("kv" + std::to_string(h));
      s.heads.push_back(read_head(head, c.head_dim));
      s.reservoirs.push_back(read_reservoir(head.group("reservoir"), c, with_rows));
    }
  }
  return s;
}

bool all_finite(const std::vector<double>& v) {
  return std::all_of(v.begin(), v.end(), [](double x) { return std::isfinite(x); });
}
bool all_finite(const std::vector<float>& v) {
  return std::all_of(v.begin(), v.end(), [](float x) { return std::isfinite(x); });
}

// Problems that make stats unusable for fitting (read_stats refuses them).
void find_value_problems(const Stats& s, std::vector<std::string>& problems) {
  const ModelConfig& c = s.config;
  const LayerSensitivity& ls = s.sensitivity;
  if (ls.measured()) {
    if (ls.key_similarity_sum.size() != size_t(c.n_layers))
      problems.push_back("/sensitivity/key_similarity_sum: " + std::to_string(ls.key_similarity_sum.size()) +
                         " values for " + std::to_string(c.n_layers) + " layers");
    // A sum of cosines over `pairs` pairs lies within ±pairs (up to rounding).
    for (double x : ls.key_similarity_sum)
      if (!std::isfinite(x) || std::abs(x) > double(ls.pairs) * (1 + 1e-9)) {
        problems.push_back("/sensitivity/key_similarity_sum: a value is not finite or exceeds the pair count");
        break;
      }
    if (ls.block < 2 || ls.sink < 0) problems.push_back("/sensitivity: block below 2 or negative sink");
  }
  for (int l = 0; l < c.n_layers; ++l)
    for (int h = 0; h < c.n_kv_heads; ++h) {
      const std::string where = head_path(l, h);
      const HeadStats& hs = s.head(l, h);
      for (const auto& m : kMoments)
        if (!all_finite(hs.*m.member)) problems.push_back(where + "/" + m.name + ": contains NaN or inf");
      if (!std::isfinite(hs.p2_weight)) problems.push_back(where + ": p2_weight is not finite");
      for (const auto& m : kRanges) {
        const auto& v = hs.*m.member;
        const bool bad = std::any_of(v.begin(), v.end(),
                                     [&](double x) { return std::isnan(x) || (hs.kv_count > 0 && !std::isfinite(x)); });
        if (bad) problems.push_back(where + "/" + m.name + ": contains NaN (or inf with rows counted)");
      }
      const Reservoir& r = s.reservoir(l, h);
      if (!all_finite(r.q) || !all_finite(r.key_pre) || !all_finite(r.key) || !all_finite(r.value))
        problems.push_back(where + "/reservoir: rows contain NaN or inf");
    }
}

}  // namespace

std::vector<double> LayerSensitivity::key_similarity() const {
  KVCC_REQUIRE(measured(), "the stats carry no layer sensitivity (calibrate-model --layer-sensitivity)");
  std::vector<double> s = key_similarity_sum;
  for (double& x : s) x /= double(pairs);
  return s;
}

void HeadStats::resize(int d) {
  const size_t dd = size_t(d) * size_t(d);
  for (const auto& m : kMoments) (this->*m.member).assign(dd, 0.0);
  key_min.assign(size_t(d), kInf);
  value_min.assign(size_t(d), kInf);
  key_max.assign(size_t(d), -kInf);
  value_max.assign(size_t(d), -kInf);
  query_count = output_count = kv_count = 0;
  p2_weight = 0.0;
}

Stats make_empty_stats(const ModelConfig& config, const ModelFingerprint& fingerprint, int reservoir_capacity) {
  KVCC_REQUIRE(
      config.n_layers > 0 && config.n_kv_heads > 0 && config.head_dim > 0 && config.n_heads % config.n_kv_heads == 0,
      "make_empty_stats: invalid model shape");
  KVCC_REQUIRE(reservoir_capacity >= 0, "reservoir capacity must be >= 0");
  Stats s;
  s.producer = h5::default_producer();
  s.created = h5::utc_now_iso8601();
  s.config = config;
  s.fingerprint = fingerprint;
  const size_t n = size_t(config.n_layers) * size_t(config.n_kv_heads);
  s.heads.resize(n);
  for (auto& hs : s.heads) hs.resize(config.head_dim);
  s.reservoirs.resize(n);
  for (auto& r : s.reservoirs) {
    r.capacity = reservoir_capacity;
    r.group = config.group();
    r.d = config.head_dim;
  }
  return s;
}

void write_stats(const Stats& s, const std::string& path) {
  check_stats_shapes(s);
  write_file_atomically(path, [&](const std::string& tmp) {
    h5::File file = h5::File::create(tmp, path);
    h5::write_root_header(file, kStatsFormat, kStatsMajor, kStatsMinor, s.producer, s.created, s.command);
    {
      h5::Group model = file.create_group("model");
      write_config(model, s.config);
      h5::write_fingerprint(model, s.fingerprint);
      h5::Group prov = file.create_group("provenance");
      prov.set_attr("data_sha256", s.provenance.data_sha256);
      prov.set_attr("tokens", s.provenance.tokens);
      prov.set_attr("sequences", s.provenance.sequences);
      prov.set_attr("seed", s.provenance.seed);
      prov.set_attr("max_seq_len", s.provenance.max_seq_len);
      prov.set_attr("tokenizer", s.provenance.tokenizer);
      if (s.sensitivity.measured()) {
        h5::Group g = file.create_group("sensitivity");
        g.set_attr("block", s.sensitivity.block);
        g.set_attr("sink", s.sensitivity.sink);
        g.set_attr("pairs", s.sensitivity.pairs);
        g.write("key_similarity_sum", h5::Shape{int64_t(s.sensitivity.key_similarity_sum.size())},
                s.sensitivity.key_similarity_sum);
      }
      h5::Group layers = file.create_group("layers");
      const ModelConfig& c = s.config;
      for (int l = 0; l < c.n_layers; ++l) {
        h5::Group layer = layers.create_group(std::to_string(l));
        for (int h = 0; h < c.n_kv_heads; ++h) {
          h5::Group head = layer.create_group("kv" + std::to_string(h));
          write_head(head, s.head(l, h), c.head_dim);
          write_reservoir(head.create_group("reservoir"), s.reservoir(l, h));
        }
      }
    }
    h5::seal_attributes(file);
    file.close();
  });
}

Stats read_stats(const std::string& path) {
  Stats s = read_stats_structure(path);
  std::vector<std::string> problems;
  find_value_problems(s, problems);
  if (!problems.empty())
    throw Error(path + ": " + problems.front() +
                (problems.size() > 1 ? " (and " + std::to_string(problems.size() - 1) + " more problems)" : ""));
  return s;
}

Stats read_stats_summary(const std::string& path) {
  Stats s = read_stats_structure(path, /*with_rows=*/false);
  std::vector<std::string> problems;
  find_value_problems(s, problems);  // the empty row arrays are trivially finite
  if (!problems.empty())
    throw Error(path + ": " + problems.front() +
                (problems.size() > 1 ? " (and " + std::to_string(problems.size() - 1) + " more problems)" : ""));
  return s;
}

std::vector<std::string> verify_stats(const Stats& s) {
  std::vector<std::string> problems;
  try {
    check_stats_shapes(s);
  } catch (const Error& e) {
    return {e.what()};
  }
  find_value_problems(s, problems);
  const ModelConfig& c = s.config;
  const int d = c.head_dim;
  for (int l = 0; l < c.n_layers; ++l)
    for (int h = 0; h < c.n_kv_heads; ++h) {
      const std::string where = head_path(l, h);
      const HeadStats& hs = s.head(l, h);
      for (const auto& m : kMoments) {
        const auto& a = hs.*m.member;
        double scale = 0, asym = 0, min_diag = 0;
        for (int i = 0; i < d; ++i) {
          min_diag = std::min(min_diag, a[size_t(i * d + i)]);
          for (int j = 0; j < d; ++j) {
            scale = std::max(scale, std::abs(a[size_t(i * d + j)]));
            asym = std::max(asym, std::abs(a[size_t(i * d + j)] - a[size_t(j * d + i)]));
          }
        }
        // Sums of outer products are symmetric with a non-negative diagonal up to rounding.
        if (asym > 1e-9 * scale)
          problems.push_back(where + "/" + m.name + ": not symmetric (max |M - Mt| = " + std::to_string(asym) + ")");
        if (min_diag < 0) problems.push_back(where + "/" + m.name + ": negative diagonal entry");
      }
      if (hs.query_count == 0 && all_finite(hs.query_m2) &&
          std::any_of(hs.query_m2.begin(), hs.query_m2.end(), [](double x) { return x != 0; }))
        problems.push_back(where + ": query_m2 is non-zero but query_count is 0");
      if (hs.kv_count == 0 && std::any_of(hs.key_m2.begin(), hs.key_m2.end(), [](double x) { return x != 0; }))
        problems.push_back(where + ": key_m2 is non-zero but kv_count is 0");
      if (hs.p2_weight < 0) problems.push_back(where + ": p2_weight is negative");
      const Reservoir& r = s.reservoir(l, h);
      std::unordered_set<uint64_t> seen;
      for (size_t i = 0; i < r.size(); ++i)
        if (!seen.insert(r.priority[i]).second) {
          problems.push_back(where + "/reservoir: duplicate priority " + std::to_string(r.priority[i]));
          break;
        }
      for (size_t i = 0; i < r.size(); ++i)
        if (r.heldout[i] != uint8_t(r.doc[i] % 5 == 4)) {
          problems.push_back(where + "/reservoir: heldout flag disagrees with doc % 5 == 4 at row " +
                             std::to_string(i));
          break;
        }
    }
  return problems;
}

std::vector<std::string> verify_stats_file(const std::string& path) {
  Stats s = read_stats_structure(path);
  std::vector<std::string> problems = verify_stats(s);
  for (auto& p : problems) p = path + ": " + p;
  return problems;
}

void reservoir_merge(Reservoir& r, const Reservoir& other) {
  if (r.size() == 0 && r.d == 0) {
    r.d = other.d;
    r.group = other.group;
  }
  KVCC_REQUIRE(r.d == other.d && r.group == other.group, "cannot merge reservoirs of different shapes (group " +
                                                             std::to_string(r.group) + ", d " + std::to_string(r.d) +
                                                             " vs group " + std::to_string(other.group) + ", d " +
                                                             std::to_string(other.d) + ")");
  check_reservoir_shapes(other, "reservoir_merge: other");
  KVCC_REQUIRE(r.position.size() == r.priority.size() && r.doc.size() == r.priority.size() &&
                   r.heldout.size() == r.priority.size() &&
                   r.q.size() == r.priority.size() * size_t(r.group) * size_t(r.d) &&
                   r.key.size() == r.priority.size() * size_t(r.d) && r.key_pre.size() == r.key.size() &&
                   r.value.size() == r.key.size(),
               "reservoir_merge: arrays of the target reservoir disagree on the number of rows");

  // Candidates (source, row), duplicates by priority dropped, sorted by priority; keep `capacity`.
  struct Row {
    uint64_t priority;
    const Reservoir* source;
    size_t index;
  };
  std::vector<Row> rows;
  rows.reserve(r.size() + other.size());
  std::unordered_set<uint64_t> seen;
  for (const Reservoir* src : {static_cast<const Reservoir*>(&r), &other})
    for (size_t i = 0; i < src->size(); ++i)
      if (seen.insert(src->priority[i]).second) rows.push_back({src->priority[i], src, i});
  const size_t keep = std::min(rows.size(), size_t(std::max(r.capacity, 0)));
  std::partial_sort(rows.begin(), rows.begin() + ptrdiff_t(keep), rows.end(),
                    [](const Row& a, const Row& b) { return a.priority < b.priority; });
  rows.resize(keep);

  const size_t d = size_t(r.d), qd = size_t(r.group) * d;
  Reservoir out;
  out.capacity = r.capacity;
  out.group = r.group;
  out.d = r.d;
  out.q.reserve(keep * qd);
  out.key_pre.reserve(keep * d);
  out.key.reserve(keep * d);
  out.value.reserve(keep * d);
  for (const Row& row : rows) {
    const Reservoir& s = *row.source;
    const size_t i = row.index;
    out.q.insert(out.q.end(), s.q.begin() + ptrdiff_t(i * qd), s.q.begin() + ptrdiff_t((i + 1) * qd));
    out.key_pre.insert(out.key_pre.end(), s.key_pre.begin() + ptrdiff_t(i * d),
                       s.key_pre.begin() + ptrdiff_t((i + 1) * d));
    out.key.insert(out.key.end(), s.key.begin() + ptrdiff_t(i * d), s.key.begin() + ptrdiff_t((i + 1) * d));
    out.value.insert(out.value.end(), s.value.begin() + ptrdiff_t(i * d), s.value.begin() + ptrdiff_t((i + 1) * d));
    out.position.push_back(s.position[i]);
    out.doc.push_back(s.doc[i]);
    out.priority.push_back(s.priority[i]);
    out.heldout.push_back(s.heldout[i]);
  }
  r = std::move(out);
}

void merge_stats(Stats& a, const Stats& b) {
  if (!a.fingerprint.matches(b.fingerprint))
    throw Error("cannot merge stats of different models: " + a.fingerprint.describe_difference(b.fingerprint));
  check_stats_shapes(a);
  check_stats_shapes(b);
  // Checked before anything is added, so a refused merge leaves `a` as it was.
  if (a.sensitivity.measured() && b.sensitivity.measured())
    KVCC_REQUIRE(a.sensitivity.block == b.sensitivity.block && a.sensitivity.sink == b.sensitivity.sink &&
                     a.sensitivity.key_similarity_sum.size() == b.sensitivity.key_similarity_sum.size(),
                 "cannot merge layer sensitivities measured with different blocks or sinks (" +
                     std::to_string(a.sensitivity.block) + "/" + std::to_string(a.sensitivity.sink) + " and " +
                     std::to_string(b.sensitivity.block) + "/" + std::to_string(b.sensitivity.sink) + ")");
  for (size_t i = 0; i < a.heads.size(); ++i) {
    HeadStats& x = a.heads[i];
    const HeadStats& y = b.heads[i];
    for (const auto& m : kMoments) {
      auto& dst = x.*m.member;
      const auto& src = y.*m.member;
      for (size_t k = 0; k < dst.size(); ++k) dst[k] += src[k];
    }
    for (size_t k = 0; k < x.key_min.size(); ++k) {
      x.key_min[k] = std::min(x.key_min[k], y.key_min[k]);
      x.key_max[k] = std::max(x.key_max[k], y.key_max[k]);
      x.value_min[k] = std::min(x.value_min[k], y.value_min[k]);
      x.value_max[k] = std::max(x.value_max[k], y.value_max[k]);
    }
    x.query_count += y.query_count;
    x.output_count += y.output_count;
    x.kv_count += y.kv_count;
    x.p2_weight += y.p2_weight;

    Reservoir& ra = a.reservoirs[i];
    ra.capacity = std::min(ra.capacity, b.reservoirs[i].capacity);
    reservoir_merge(ra, b.reservoirs[i]);
  }
  LayerSensitivity& sa = a.sensitivity;
  const LayerSensitivity& sb = b.sensitivity;
  if (sb.measured()) {
    if (!sa.measured()) {
      sa = sb;
    } else {
      for (size_t l = 0; l < sa.key_similarity_sum.size(); ++l) sa.key_similarity_sum[l] += sb.key_similarity_sum[l];
      sa.pairs += sb.pairs;
    }
  }
  StatsProvenance& p = a.provenance;
  const StatsProvenance& q = b.provenance;
  std::string first = p.data_sha256, second = q.data_sha256;
  if (second < first) std::swap(first, second);
  p.data_sha256 = "merged:" + sha256_hex(first + "\n" + second + "\n");
  p.tokens += q.tokens;
  p.sequences += q.sequences;
  p.max_seq_len = std::max(p.max_seq_len, q.max_seq_len);
  if (p.tokenizer != q.tokenizer) p.tokenizer += "," + q.tokenizer;
}

}  // namespace kvcc
