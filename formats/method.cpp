#include "formats/method.h"

#include <algorithm>
#include <cstring>

#include "formats/artifact.h"
#include "formats/codec_commvq.h"
#include "formats/error.h"
#include "formats/kv_codec.h"

namespace kvcc {
namespace {

using enum MethodOption;

constexpr unsigned kGridOptions = NoFitClip | FitRows;  // a fitted clip ratio on the fitting rows

constexpr unsigned kOscarRotation = ValueTarget | Composition | Granularity;

// The published variant holds exactly OSCAR's clip ratios and value target.
std::vector<std::string> verify_oscar(const Artifact& a) {
  std::vector<std::string> out;
  if (!oscar_published(a.recipe)) return out;
  if (a.recipe.value_target != kOscarPublishedValueTarget)
    out.push_back("oscar variant=published: value target '" + a.recipe.value_target + "', expected " +
                  kOscarPublishedValueTarget);
  for (size_t i = 0; i < a.heads.size(); ++i)
    if (a.heads[i].key.clip_ratio != kOscarPublishedKeyClip ||
        a.heads[i].value.clip_ratio != kOscarPublishedValueClip) {
      out.push_back("oscar variant=published: layer " + std::to_string(i / size_t(a.n_kv_heads)) + " kv head " +
                    std::to_string(i % size_t(a.n_kv_heads)) + " clip ratios " +
                    std::to_string(a.heads[i].key.clip_ratio) + " / " + std::to_string(a.heads[i].value.clip_ratio) +
                    ", expected OSCAR's 0.96 / 0.92");
      break;
    }
  return out;
}

// The table, in enum order. Defaults and semantics: docs/methods.md; each entry's codec is
// formats/kv_codec.cpp (commvq: codec_commvq.cpp), its fitting compile/compile.cpp.
const std::vector<MethodTraits>& table() {
  static const std::vector<MethodTraits> t = {
      {.method = Method::Oscar,
       .name = "oscar",
       .summary = "R = U·H·P of the query moment (keys) and value target; INT-b grid, fitted clip",
       .codec = CodecFamily::UniformGrid,
       .rotation = RotationRule::AttentionAware,
       .fit = Fit::ClipRatio,
       .served_by_runtime = true,
       .spans_heads = true,
       .whole_rows = false,
       .fractional_bits = false,
       .bit_presets = {},
       .group = 0,
       .sink = 64,
       .recent = 256,
       .page_size = 64,
       // p2: on gutenberg-27m ~3 % lower KL than output on average, never significantly worse
       // (docs/validation.md "Value target").
       .value_target = "p2",
       .composition = "UHP",
       .options = kOscarRotation | kGridOptions,
       // published: OSCAR's fixed clip ratios and value target (kOscarPublished*); absent: fitted.
       .params = {{"variant", nullptr, nullptr, {"fitted", "published"}}},
       .verify = verify_oscar,
       .describe = nullptr},
      {.method = Method::OscarLm,
       .name = "oscar-lm",
       .summary = "oscar's rotation + a Lloyd-Max level table fitted per KV head (fp16 RMS scale)",
       .codec = CodecFamily::LevelTable,
       .rotation = RotationRule::AttentionAware,
       .fit = Fit::LevelTable,
       .served_by_runtime = true,
       .spans_heads = true,
       .whole_rows = false,
       .fractional_bits = false,
       .bit_presets = {},
       .group = 0,
       .sink = 64,
       .recent = 256,
       .page_size = 64,
       .value_target = "p2",
       .composition = "UHP",
       .options = kOscarRotation | FitRows,
       .params = {},
       .verify = nullptr,
       .describe = nullptr},
      {.method = Method::Hadamard,
       .name = "hadamard",
       .summary = "H (QuaRot) + per-token INT-b grid with fitted clip ratios",
       .codec = CodecFamily::UniformGrid,
       .rotation = RotationRule::Hadamard,
       .fit = Fit::ClipRatio,
       .served_by_runtime = true,
       .spans_heads = true,
       .whole_rows = false,
       .fractional_bits = false,
       .bit_presets = {},
       .group = 0,
       .sink = 64,
       .recent = 256,
       .page_size = 64,
       .value_target = "",
       .composition = "",
       .options = kGridOptions,
       .params = {},
       .verify = nullptr,
       .describe = nullptr},
      {.method = Method::Identity,
       .name = "identity",
       .summary = "no rotation + per-token INT-b grid with fitted clip ratios",
       .codec = CodecFamily::UniformGrid,
       .rotation = RotationRule::Identity,
       .fit = Fit::ClipRatio,
       .served_by_runtime = true,
       .spans_heads = true,
       .whole_rows = false,
       .fractional_bits = false,
       .bit_presets = {},
       .group = 0,
       .sink = 64,
       .recent = 256,
       .page_size = 64,
       .value_target = "",
       .composition = "",
       .options = kGridOptions,
       .params = {},
       .verify = nullptr,
       .describe = nullptr},
      {.method = Method::Random,
       .name = "random",
       .summary = "seeded Haar rotation + per-token INT-b grid with fitted clip ratios",
       .codec = CodecFamily::UniformGrid,
       .rotation = RotationRule::Random,
       .fit = Fit::ClipRatio,
       .served_by_runtime = true,
       .spans_heads = true,
       .whole_rows = false,
       .fractional_bits = false,
       .bit_presets = {},
       .group = 0,
       .sink = 64,
       .recent = 256,
       .page_size = 64,
       .value_target = "",
       .composition = "",
       .options = Granularity | Seed | kGridOptions,
       .params = {},
       .verify = nullptr,
       .describe = nullptr},
      // No windows: the paper quantises every token.
      {.method = Method::TurboQuant,
       .name = "turboquant",
       .summary = "random rotation + sphere Lloyd-Max levels; 2.5/3.5 bits split outliers; prod: QJL",
       .codec = CodecFamily::LevelTable,
       .rotation = RotationRule::OutlierBlocks,
       .fit = Fit::None,
       .served_by_runtime = false,
       .spans_heads = false,
       .whole_rows = true,
       .fractional_bits = true,
       .bit_presets = {},
       .group = 0,
       .sink = 0,
       .recent = 0,
       .page_size = 64,
       .value_target = "",
       .composition = "",
       .options = unsigned(Seed),
       .params = {{"variant", nullptr, "mse", {"mse", "prod"}},
                  {"codebook", nullptr, "sphere", {"sphere", "gaussian"}}},
       .verify = verify_turboquant,
       .describe = nullptr},
      // group = 32 tokens per key group (and channels per value group); recent = its residual window.
      {.method = Method::Kivi,
       .name = "kivi",
       .summary = "keys per channel over token groups, values per token; --values hadamard|oscar: mixed",
       .codec = CodecFamily::KiviChannel,
       .rotation = RotationRule::Identity,
       .fit = Fit::None,
       .served_by_runtime = true,
       .spans_heads = false,
       .whole_rows = false,
       .fractional_bits = false,
       .bit_presets = {},
       .group = 32,
       .sink = 0,
       .recent = 128,
       .page_size = 64,
       .value_target = "",
       .composition = "",
       .options = 0,
       .params = {{"values", "--values", nullptr, {"hadamard", "oscar"}},
                  {"key_params", nullptr, "fp16", {"fp16", "e5m3"}}},
       .verify = nullptr,
       .describe = nullptr},
      // A page is its tile: 128 tokens, with 128-token windows.
      {.method = Method::Kvarn,
       .name = "kvarn",
       .summary = "Hadamard + Sinkhorn log-std balancing of page tiles (128 tokens) + row RTN",
       .codec = CodecFamily::KvarnTile,
       .rotation = RotationRule::Hadamard,
       .fit = Fit::None,
       .served_by_runtime = false,
       .spans_heads = false,
       .whole_rows = true,
       .fractional_bits = false,
       .bit_presets = {},
       .group = 0,
       .sink = 128,
       .recent = 128,
       .page_size = 128,
       .value_target = "",
       .composition = "",
       .options = 0,
       .params = {{"iterations", nullptr, "8", {}, 1, 1000}},
       .verify = nullptr,
       .describe = nullptr},
      // Stages and code bits default to the --bits preset (compile/commvq.h commvq_fill_recipe).
      {.method = Method::Commvq,
       .name = "commvq",
       .summary = "RoPE-commutative key codebooks (coded pre-RoPE) + residual VQ values; --bits 1|2",
       .codec = CodecFamily::CommvqCodebooks,
       .rotation = RotationRule::Codebooks,
       .fit = Fit::None,
       .served_by_runtime = false,
       .spans_heads = false,
       .whole_rows = true,
       .fractional_bits = false,
       .bit_presets = {1, 2},
       .group = 0,
       .sink = 64,
       .recent = 256,
       .page_size = 64,
       .value_target = "",
       .composition = "",
       .options = unsigned(Seed),
       .params = {{"key_stages", nullptr, nullptr, {}, 1, 64},
                  {"key_code_bits", nullptr, nullptr, {}, 2, 16},
                  {"value_stages", nullptr, nullptr, {}, 1, 64},
                  {"value_code_bits", nullptr, nullptr, {}, 1, 16},
                  {"iterations", nullptr, "20", {}, 1, 1000},
                  {"max_rows", nullptr, "0", {}, 0}},
       .verify = verify_commvq,
       .describe = describe_commvq},
  };
  return t;
}

std::string join(const std::vector<std::string>& items, std::string_view sep, std::string_view last) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) {
    if (i > 0) out += i + 1 == items.size() ? last : sep;
    out += items[i];
  }
  return out;
}

std::string param_flag(const MethodParam& p) { return p.flag ? std::string(p.flag) : "--param " + std::string(p.key); }

// Whether `value` is an integer (all of it) >= min.
bool integer_in_range(const std::string& value, int min, int max) {
  try {
    size_t used = 0;
    const long long v = std::stoll(value, &used);
    return used == value.size() && v >= min && v <= max;
  } catch (const std::exception&) {
    return false;
  }
}

// The methods that accept `option`, then the mixed recipes through which one does ("kivi --values
// oscar"), for messages.
std::vector<std::string> methods_accepting(MethodOption option) {
  std::vector<std::string> names;
  for (const MethodTraits& t : table())
    if (t.accepts(option)) names.push_back(t.name);
  for (const MethodTraits& t : table())
    for (const MethodParam& p : t.params)
      for (const char* choice : p.choices)
        if (const auto m = find_method(choice); m && method_traits(*m).accepts(option))
          names.push_back(std::string(t.name) + " " + p.flag + " " + choice);
  return names;
}

}  // namespace

const char* option_flag(MethodOption option) {
  switch (option) {
    case ValueTarget:
      return "--value-target";
    case Composition:
      return "--composition";
    case Granularity:
      return "--granularity";
    case Seed:
      return "--seed";
    case NoFitClip:
      return "--no-fit-clip";
    case FitRows:
      return "--fit-rows";
  }
  return "?";
}

const MethodParam* MethodTraits::param(std::string_view key) const {
  for (const MethodParam& p : params)
    if (key == p.key) return &p;
  return nullptr;
}

const std::vector<Method>& all_methods() {
  static const std::vector<Method> methods = [] {
    std::vector<Method> out;
    for (const MethodTraits& t : table()) out.push_back(t.method);
    return out;
  }();
  return methods;
}

const MethodTraits& method_traits(Method m) {
  const MethodTraits& t = table().at(size_t(m));
  KVCC_REQUIRE(t.method == m, "method table is out of enum order");
  return t;
}

const char* method_name(Method m) { return method_traits(m).name; }

std::optional<Method> find_method(std::string_view name) {
  for (const MethodTraits& t : table())
    if (name == t.name) return t.method;
  return std::nullopt;
}

Method method_from_name(std::string_view name) {
  const std::optional<Method> m = find_method(name);
  KVCC_REQUIRE(m.has_value(), "unknown method '" + std::string(name) + "' (expected " + method_names() + ")");
  return *m;
}

Method method_of(const Recipe& recipe) { return method_from_name(recipe.method); }

std::string method_names(bool (*keep)(const MethodTraits&), std::string_view sep, std::string_view last) {
  std::vector<std::string> names;
  for (const MethodTraits& t : table())
    if (!keep || keep(t)) names.push_back(t.name);
  return join(names, sep, last);
}

bool oscar_published(const Recipe& recipe) {
  const auto it = recipe.params.find("variant");
  return recipe.method == method_name(Method::Oscar) && it != recipe.params.end() && it->second == "published";
}

bool served_by_runtime(std::string_view method) {
  const std::optional<Method> m = find_method(method);
  return m && method_traits(*m).served_by_runtime;
}

std::vector<std::string> method_param_problems(Method m, const std::map<std::string, std::string>& params) {
  const MethodTraits& t = method_traits(m);
  std::vector<std::string> out;
  for (const MethodParam& p : t.params) {
    const auto it = params.find(p.key);
    if (it == params.end()) continue;
    const std::string& v = it->second;
    if (!p.choices.empty()) {
      if (std::none_of(p.choices.begin(), p.choices.end(), [&](const char* c) { return v == c; }))
        out.push_back(std::string(t.name) + " " + p.key + " must be " +
                      join(std::vector<std::string>(p.choices.begin(), p.choices.end()), ", ", " or ") + ", got '" + v +
                      "'");
    } else if (!integer_in_range(v, p.min_value, p.max_value)) {
      out.push_back(std::string(t.name) + " " + p.key + " must be an integer >= " + std::to_string(p.min_value) +
                    (p.max_value < std::numeric_limits<int>::max() ? " and <= " + std::to_string(p.max_value) : "") +
                    ", got '" + v + "'");
    }
  }
  return out;
}

void check_method_options(Method m, unsigned given, const std::map<std::string, std::string>& params) {
  const MethodTraits& t = method_traits(m);
  for (const auto& [key, value] : params) {
    if (t.param(key)) continue;
    std::vector<std::string> takers;
    std::string flag = "--param " + key;
    for (const MethodTraits& other : table())
      if (const MethodParam* p = other.param(key)) {
        takers.push_back(other.name);
        flag = param_flag(*p);
      }
    if (takers.empty()) {
      std::vector<std::string> keys;
      for (const MethodParam& p : t.params) keys.push_back(p.key);
      throw Error("unknown parameter '" + key + "' for " + t.name + " (it takes " +
                  (keys.empty() ? std::string("none") : join(keys, ", ", " and ")) + ")");
    }
    throw Error(flag + " applies to " + join(takers, ", ", " and ") + " only, not " + t.name);
  }
  const std::vector<std::string> problems = method_param_problems(m, params);
  KVCC_REQUIRE(problems.empty(), problems.empty() ? "" : problems.front());
  // A parameter naming another method (kivi --values) codes a side as that method.
  unsigned accepted = t.options;
  for (const MethodParam& p : t.params)
    if (const auto it = params.find(p.key); it != params.end())
      if (const auto side = find_method(it->second)) accepted |= method_traits(*side).options;
  for (MethodOption o : kMethodOptions)
    if ((given & unsigned(o)) && !(accepted & unsigned(o)))
      throw Error(std::string(option_flag(o)) + " applies to " + join(methods_accepting(o), ", ", " and ") +
                  " only, not " + t.name);
}

}  // namespace kvcc
