// OSCAR RotationZoo interop: OSCAR's K and V rotation files (zoo/oscar_pt.h) <-> a kvcc
// artifact. Rotations and eigenvalues are float32 in OSCAR files and float64 in artifacts; the
// import is exact (every float32 is a float64), the export rounds to nearest float32 (exact for
// imported artifacts). docs/zoo.md documents the mapping.
#pragma once
#include <string>

#include "formats/artifact.h"
#include "formats/method.h"
#include "formats/model_config.h"
#include "zoo/oscar_pt.h"

namespace kvcc::zoo {

struct OscarImportOptions {
  std::string model_id;
  // The model the rotations belong to (both or neither): its fingerprint goes into the artifact
  // and its shapes are checked against the files. Without it the fingerprint is built from the
  // files' shapes alone and marked with the field fingerprint_source=shapes (it matches no model).
  const ModelConfig* config = nullptr;
  const ModelFingerprint* fingerprint = nullptr;
  // Head counts when no model is given (v1 files do not record them): 0 = the per-layer rotation
  // count (1 for v1, n_kv_heads for v2) for n_kv_heads, and n_kv_heads for n_heads.
  int n_heads = 0, n_kv_heads = 0;
  // OSCAR serves with fixed clip ratios (SGLANG_OSCAR_K/V_CLIP_RATIO = 0.96 / 0.92).
  double key_clip_ratio = kOscarPublishedKeyClip, value_clip_ratio = kOscarPublishedValueClip;
  std::string command;                             // recorded in the artifact
  std::string key_file_sha256, value_file_sha256;  // recorded in recipe.params
};

Artifact import_oscar(const OscarRotationSet& key, const OscarRotationSet& value, const OscarImportOptions& options);

struct OscarExport {
  OscarRotationSet key, value;
  std::string key_file_name, value_file_name;  // "k_rotation_<objective>.pt", "v_rotation_<objective>.pt"
};
// format_version 1 needs one rotation per layer (all KV heads equal; Error otherwise), 2 writes
// one per KV head; 0 picks 1 when every layer's heads share their rotations, else 2.
OscarExport export_oscar(const Artifact& artifact, int format_version = 0);

}  // namespace kvcc::zoo
