// kvcc verify: re-check an artifact or a stats file and say what, if anything, is wrong.
#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>

#include "cli/command.h"
#include "formats/artifact.h"
#include "formats/artifact_safetensors.h"
#include "formats/error.h"
#include "formats/h5_common.h"
#include "formats/method.h"
#include "formats/stats.h"
#include "runtime/kvcc_runtime.h"

namespace kvcc::cli {
namespace {

int report(const std::string& path, const std::vector<std::string>& problems) {
  for (const std::string& p : problems) std::printf("FAIL %s\n", p.c_str());
  if (problems.empty()) return 0;
  std::fprintf(stderr, "kvcc: error: %s failed verification (%zu problem%s)\n", path.c_str(), problems.size(),
               problems.size() == 1 ? "" : "s");
  return 1;
}

int verify_artifact_cmd(const std::string& path, double tol) {
  const auto problems = verify_artifact_file(path, tol);
  if (!problems.empty()) return report(path, problems);
  const Artifact a = read_artifact(path);
  size_t datasets = a.layer_budgets.empty() ? 0 : 1, rotations = 0;
  double worst = 0;
  for (const HeadArtifact& h : a.heads)
    for (const SideArtifact* s : {&h.key, &h.value}) {
      datasets += 1 + (s->eigenvalues.empty() ? 0 : 1) + (s->levels.empty() ? 0 : 1) + (s->bits != 0 ? 1 : 0) +
                  s->extras.size();
      if (!s->rotation.empty()) {
        ++rotations;
        worst = std::max(worst, max_orthogonality_error(s->rotation, a.head_dim));
      }
    }
  std::printf("OK %s: kvcc-artifact %s, method %s, %d layers x %d KV heads, head_dim %d\n", path.c_str(),
              a.format_version.c_str(), a.recipe.method.c_str(), a.n_layers, a.n_kv_heads, a.head_dim);
  std::printf(
      "   checked: format version, fingerprint id, shapes and dtypes, sha256 of %zu datasets, finiteness,\n"
      "   orthogonality of %zu rotations (max |RtR - I| = %.2e <= %.0e), ascending eigenvalues,\n"
      "   sorted level tables, clip ratios, recipe%s\n",
      datasets, rotations, worst, tol,
      method_traits(method_of(a.recipe)).verify ? (", " + a.recipe.method + "'s own checks").c_str() : "");
  // Whether the serving runtime takes it (the Runtime's own check), and where.
  std::string served;
  try {
    check_artifact_for_engine(a, EngineShape{a.n_layers, a.n_heads, a.n_kv_heads, a.head_dim});
    const std::string gpu = device_scope_problem(cache_geometry(a), a.n_heads, cache_widths(a));
    served = gpu.empty() ? "served (host pool and GPU kernels)"
                         : "served by the host pool (CPU reference); the GPU kernels do not take " + gpu;
  } catch (const Error& e) {
    served = std::string("not served: ") + e.what();
  }
  std::printf("   runtime: %s\n", served.c_str());
  return 0;
}

int verify_stats_cmd(const std::string& path) {
  const auto problems = verify_stats_file(path);
  if (!problems.empty()) return report(path, problems);
  const Stats s = read_stats(path);
  size_t rows = 0;
  for (const Reservoir& r : s.reservoirs) rows += r.size();
  std::printf("OK %s: kvcc-stats, %s, %d layers x %d KV heads, head_dim %d, %llu tokens\n", path.c_str(),
              s.config.architecture.c_str(), s.config.n_layers, s.config.n_kv_heads, s.config.head_dim,
              static_cast<unsigned long long>(s.provenance.tokens));
  std::printf(
      "   checked: format version, fingerprint id against the config, shapes and dtypes, finiteness of\n"
      "   sums, ranges and %zu reservoir rows, symmetric moments with non-negative diagonals,\n"
      "   counts, unique reservoir priorities, held-out flags\n",
      rows);
  return 0;
}

Command reg{
    "verify", 61, "Re-check an artifact or stats file (checksums, shapes, orthogonality, finiteness)",
    [](CLI::App& app) -> std::function<int()> {
      auto path = std::make_shared<std::string>();
      auto tol = std::make_shared<double>(1e-5);
      app.add_option("FILE", *path, "An artifact (*.kvcc.h5) or a calibration stats file (stats.h5)")->required();
      app.add_option("--tol", *tol, "Largest allowed |RtR - I| of a rotation")
          ->check(positive_real())
          ->capture_default_str();
      app.footer(
          "Artifacts: format version, fingerprint, shapes and dtypes, the sha256 of every dataset,\n"
          "NaN/inf, orthogonality of every rotation (max |RtR - I|), ascending eigenvalues, sorted\n"
          "level tables, clip ratios and the recipe. Stats: format version, fingerprint, shapes,\n"
          "finiteness, symmetry of the second moments, counts and reservoirs.\n"
          "Prints OK and the checks done (exit 0), or one FAIL line per problem (exit 1).\n\n"
          "Example:\n"
          "  kvcc verify gutenberg-27m.oscar.kvcc.h5 && kvcc verify stats.h5");
      return [path, tol]() {
        const std::string format = detect_kvcc_format(*path);
        if (format == kArtifactFormat) return verify_artifact_cmd(*path, *tol);
        if (format == kStatsFormat) return verify_stats_cmd(*path);
        throw Error(*path + ": unknown format \"" + format + "\" (expected " + kArtifactFormat + " or " + kStatsFormat +
                    ")");
      };
    }};

}  // namespace
}  // namespace kvcc::cli
