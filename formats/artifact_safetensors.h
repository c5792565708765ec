// Artifacts as one safetensors file, for engines that read tensors but not HDF5 (the layout, the
// tensor names and the JSON recipe's schema are in docs/formats.md, "Artifact as safetensors").
// It holds exactly what the HDF5 artifact holds: every rotation, eigenvalue vector, level table
// and method-specific array as a named little-endian tensor (F64, or I64 for integer arrays),
// the per-(layer, KV head) clip ratios as two [n_layers, n_kv_heads] tensors, and everything
// else (format and version, model shape and fingerprint, recipe, provenance, the order and
// sha256 of every tensor) as one JSON document in the header's __metadata__ under the key
// kArtifactMetadataKey. HDF5 -> safetensors -> HDF5 gives back an equal artifact, and a tensor's
// sha256 is the same as that of its HDF5 dataset.
//
// read_artifact and verify_artifact_file (formats/artifact.h) accept either container; they tell
// them apart by the first bytes (artifact_container).
#pragma once
#include <string>
#include <vector>

#include "formats/artifact.h"

namespace kvcc {

// The __metadata__ key whose value is the artifact's JSON document, and (format 1.1 on) the key
// of that text's sha256, which covers everything the document holds: the recipe, the model,
// provenance, and the sha256 of every tensor (clip ratios and rotations included).
inline constexpr const char* kArtifactMetadataKey = "kvcc_artifact";
inline constexpr const char* kArtifactChecksumKey = "kvcc_artifact_sha256";

enum class ArtifactContainer {
  Hdf5,         // starts with the HDF5 signature "\x89HDF\r\n\x1a\n"
  Safetensors,  // an 8-byte little-endian header length, then '{' (the length is checked on reading)
  Unknown,      // neither (a reader then reports the file as not HDF5)
};
// Looks at the file's first bytes only; throws Error when it cannot be opened.
ArtifactContainer artifact_container(const std::string& path);
const char* artifact_container_name(ArtifactContainer);  // "hdf5" | "safetensors" | "unknown"

// Verifies the artifact (as write_artifact does, refusing an invalid one) and writes it
// atomically (temporary file beside PATH, then rename).
void write_artifact_safetensors(const Artifact&, const std::string& path);

// Reads a safetensors artifact: header bounds and tensor extents are checked before any data is
// touched, every tensor must be listed in the JSON document and vice versa, shapes and dtypes
// must agree with the model shape it states. A checksum mismatch is thrown, or appended to
// `problems` when given (what verify_artifact_file does). Does not run verify_artifact.
Artifact read_artifact_safetensors(const std::string& path, std::vector<std::string>* problems = nullptr);

// The kvcc format of a file for commands that take artifacts or stats (verify, inspect):
// kArtifactFormat for a safetensors artifact, else the HDF5 root `format` attribute
// (h5::detect_format). A safetensors file without kvcc metadata is refused with an Error.
std::string detect_kvcc_format(const std::string& path);

}  // namespace kvcc
