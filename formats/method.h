// The compile methods as a type. One traits table (formats/method.cpp) says what each method is:
// its name, codec family, rotation rule, what compile fits, whether the paged INT2 runtime serves
// it, its default windows and parameters, the options it accepts and its artifact checks. Compile,
// the codec, verify_artifact, the CLI, eval and the zoo consult it instead of comparing names, so a
// new method is one row here plus its codec and compile branch.
//
// Artifacts keep the name (Recipe::method, docs/formats.md); convert at the boundary with
// method_from_name / method_of.
#pragma once
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace kvcc {

struct Artifact;
struct Recipe;

enum class Method { Oscar, OscarLm, Hadamard, Identity, Random, TurboQuant, Kivi, Kvarn, Commvq };

// OSCAR as published (`-m oscar --param variant=published`): the serving clip ratios of its
// reference runtime (SGLANG_OSCAR_K/V_CLIP_RATIO), fixed rather than fitted, and the value target
// its released code fits (the score-weighted value moment kvcc calls logit2). docs/methods.md.
inline constexpr double kOscarPublishedKeyClip = 0.96;
inline constexpr double kOscarPublishedValueClip = 0.92;
inline constexpr const char* kOscarPublishedValueTarget = "logit2";
// Whether a recipe is oscar's published variant.
bool oscar_published(const Recipe& recipe);

// How a side's rotated rows are quantised (formats/kv_codec.h has the exact semantics).
enum class CodecFamily {
  UniformGrid,      // per-token channel groups, fp16 scale + zero, stored clip ratio (codec_scalar.h)
  LevelTable,       // per-token groups, fp16 RMS scale, 2^b levels (oscar-lm; turboquant's split)
  KiviChannel,      // keys per channel over token groups, values per token; group = key tokens
  KvarnTile,        // a page is one Sinkhorn-balanced tile, rows coded uniformly
  CommvqCodebooks,  // residual VQ codebooks; keys coded pre-RoPE (formats/codec_commvq.h)
};

// Where a side's rotation comes from (compile/rotation.h).
enum class RotationRule {
  AttentionAware,  // U·H·P of the query moment (keys) and the value target
  Hadamard,        // H
  Identity,        // I
  Random,          // seeded Haar rotation per (layer, KV head, side)
  OutlierBlocks,   // turboquant: Haar blocks on the outlier split
  Codebooks,       // commvq: stored with the codebooks
};

// What compile fits per quantiser group on the reservoir's fitting rows.
enum class Fit { None, ClipRatio, LevelTable };

// `kvcc compile` options whose meaning depends on the method (bits of MethodTraits::options).
// Windows, bits, --group (checked by its own rules) and --threads apply to every method.
enum class MethodOption : unsigned {
  ValueTarget = 1u << 0,  // --value-target
  Composition = 1u << 1,  // --composition
  Granularity = 1u << 2,  // --granularity (one rotation per layer)
  Seed = 1u << 3,         // --seed
  NoFitClip = 1u << 4,    // --no-fit-clip
  FitRows = 1u << 5,      // --fit-rows
};
inline constexpr MethodOption kMethodOptions[] = {MethodOption::ValueTarget, MethodOption::Composition,
                                                  MethodOption::Granularity, MethodOption::Seed,
                                                  MethodOption::NoFitClip,   MethodOption::FitRows};
constexpr unsigned operator|(MethodOption a, MethodOption b) { return unsigned(a) | unsigned(b); }
constexpr unsigned operator|(unsigned a, MethodOption b) { return a | unsigned(b); }
constexpr unsigned& operator|=(unsigned& a, MethodOption b) { return a |= unsigned(b); }
const char* option_flag(MethodOption option);  // "--value-target", ...

// A recipe parameter (Recipe::params) a method takes.
struct MethodParam {
  const char* key;
  const char* flag;                  // the compile flag that sets it, or nullptr: --param KEY=VALUE
  const char* default_value;         // filled in by compile; nullptr: none (absent, or derived)
  std::vector<const char*> choices;  // allowed values; empty: an integer in [min_value, max_value]
  int min_value = 0;
  // An upper bound keeps a recipe's cost sane: compile and verify refuse, say, a kvarn
  // iterations=2000000000 that would make every page take hours to code.
  int max_value = std::numeric_limits<int>::max();
};

struct MethodTraits {
  Method method;
  const char* name;
  const char* summary;  // one line, for --help
  CodecFamily codec;
  RotationRule rotation;
  Fit fit;
  bool served_by_runtime;           // the paged INT2 runtime (per-token grids, the 2-bit level table, and
                                    // kivi's per-channel key pages on the host pool: runtime/served.h)
  bool spans_heads;                 // a group above head_dim may span KV heads (kv_codec.h group_span)
  bool whole_rows;                  // codes whole head rows, tiles or vectors: --group must be head_dim
  bool fractional_bits;             // 2.5 / 3.5-bit budgets (turboquant's outlier split)
  std::vector<double> bit_presets;  // the only bit budgets it takes (commvq 1, 2); empty: 1-8
  // Defaults of CompileOptions' -1 fields: group (0 = head_dim), BF16 sink and recent windows,
  // tokens per page.
  int group, sink, recent, page_size;
  // Defaults of the attention-aware rotation ("" where the method has none).
  const char* value_target;
  const char* composition;
  unsigned options;  // MethodOption bits it accepts
  std::vector<MethodParam> params;
  // Method-specific artifact checks, appended by verify_artifact (nullptr: none).
  std::vector<std::string> (*verify)(const Artifact&);
  // One line for `kvcc inspect` (nullptr: none).
  std::string (*describe)(const Artifact&);

  bool accepts(MethodOption option) const { return (options & unsigned(option)) != 0; }
  const MethodParam* param(std::string_view key) const;
};

const std::vector<Method>& all_methods();  // in table order (the enum's)
const MethodTraits& method_traits(Method m);
const char* method_name(Method m);
// Throws Error "unknown method 'x' (expected oscar, oscar-lm, ... or commvq)".
Method method_from_name(std::string_view name);
std::optional<Method> find_method(std::string_view name);
Method method_of(const Recipe& recipe);  // method_from_name(recipe.method)

// Names of the methods `keep` selects (all when null), in table order, joined by `sep` with
// `last` before the final one: "a, b or c"; " | " lists for --help.
std::string method_names(bool (*keep)(const MethodTraits&) = nullptr, std::string_view sep = ", ",
                         std::string_view last = " or ");
// Whether the paged INT2 runtime serves a recipe's method (false for an unknown name).
bool served_by_runtime(std::string_view method);

// The one rule for options a method would ignore: throws Error for an option in `given`
// (MethodOption bits) or a key of `params` that `m` does not take, and for a parameter value
// outside its choices. A kivi recipe with `values` = a grid method also accepts that method's
// options, which shape its value side.
void check_method_options(Method m, unsigned given, const std::map<std::string, std::string>& params);
// Problems with the values of the parameters `m` takes (other keys are left alone: imported
// artifacts carry provenance parameters); verify_artifact reports them.
std::vector<std::string> method_param_problems(Method m, const std::map<std::string, std::string>& params);

}  // namespace kvcc
