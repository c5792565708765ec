// kvcc export: an artifact from one container to the other (HDF5 <-> safetensors), checked by
// reading the written file back. docs/formats.md describes the safetensors layout.
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>

#include "cli/command.h"
#include "formats/artifact.h"
#include "formats/artifact_safetensors.h"
#include "formats/atomic_file.h"
#include "formats/error.h"

namespace kvcc::cli {
namespace {

struct ExportOptions {
  std::string input, format, output;
};

int run_export(const ExportOptions& o) {
  require_output_is_not_input(o.output, {o.input});
  const ArtifactContainer from = artifact_container(o.input);
  const Artifact art = read_artifact(o.input);  // either container, fully verified
  if (o.format == "safetensors") write_artifact_safetensors(art, o.output);
  else write_artifact(art, o.output);
  // The written file must read back as the same artifact (its format_version is the writer's:
  // artifact_difference does not compare it).
  const std::string difference = artifact_difference(art, read_artifact(o.output));
  if (!difference.empty()) {
    std::error_code ec;
    std::filesystem::remove(o.output, ec);
    throw Error(o.output + " does not read back as the artifact written (" + difference + "); removed it");
  }
  size_t arrays = 0;
  for (const HeadArtifact& h : art.heads)
    for (const SideArtifact* s : {&h.key, &h.value})
      arrays += (s->rotation.empty() ? 0 : 1) + (s->eigenvalues.empty() ? 0 : 1) + (s->levels.empty() ? 0 : 1) +
                s->extras.size();
  std::printf(
      "wrote %s (%s, %llu bytes) from %s (%s): %s, %d layers x %d KV heads, head_dim %d, %zu arrays + clip "
      "ratios; reads back equal\n",
      o.output.c_str(), o.format.c_str(), static_cast<unsigned long long>(std::filesystem::file_size(o.output)),
      o.input.c_str(), artifact_container_name(from), art.recipe.method.c_str(), art.n_layers, art.n_kv_heads,
      art.head_dim, arrays);
  return 0;
}

Command reg{"export", 65, "Convert an artifact between HDF5 and safetensors (for engines without HDF5)",
            [](CLI::App& app) -> std::function<int()> {
              auto o = std::make_shared<ExportOptions>();
              app.add_option("ARTIFACT", o->input, "An artifact: *.kvcc.h5 or its safetensors form")->required();
              app.add_option("--format", o->format, "Container to write: safetensors or hdf5")
                  ->required()
                  ->check(CLI::IsMember({"safetensors", "hdf5"}));
              app.add_option("-o,--output", o->output,
                             "File to write (replaced atomically if it exists; must not be ARTIFACT)")
                  ->required();
              app.footer(
                  "Reads ARTIFACT (either container, verified as every reader does) and writes the same\n"
                  "artifact in the other one: safetensors holds every rotation, eigenvalue vector, level\n"
                  "table, codebook and other method array as a named F64/I64 tensor, the clip ratios as\n"
                  "clip_ratio.key/.value [n_layers, n_kv_heads], and the recipe, model fingerprint,\n"
                  "provenance and per-tensor sha256 as JSON in __metadata__.kvcc_artifact (docs/formats.md).\n"
                  "The output is read back and compared with the input, bit for bit; every kvcc command\n"
                  "that takes an artifact reads either form.\n\n"
                  "Examples:\n"
                  "  kvcc export gutenberg-27m.oscar.kvcc.h5 --format safetensors -o gutenberg-27m.oscar.safetensors\n"
                  "  kvcc export gutenberg-27m.oscar.safetensors --format hdf5 -o back.kvcc.h5");
              return [o]() { return run_export(*o); };
            }};

}  // namespace
}  // namespace kvcc::cli
