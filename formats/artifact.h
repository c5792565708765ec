// Compiled artifacts, format v1 (docs/formats.md has the HDF5 schema): per (layer, KV head) the
// key and value rotations with their eigenvalues and the fitted quantizer parameters, plus the
// recipe, provenance and model fingerprint needed to reproduce and to check them.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "formats/model_config.h"

namespace kvcc {

inline constexpr const char* kArtifactFormat = "kvcc-artifact";
// Writers write 1.1, or 2.0 for an artifact whose sides carry their own code widths
// (SideArtifact::bits): a 1.x reader would ignore those and code the sides at the recipe's bits,
// so such files must be refused by it (a new major). Layer budgets (Artifact::layer_budgets) add a
// minor: 1.2 / 2.1 (an older reader may ignore them: it evicts uniformly). Readers read 1.x and 2.x
// (a newer minor's unknown parts are skipped).
inline constexpr int kArtifactMajor = 1;
inline constexpr int kArtifactMinor = 2;  // the newest 1.x this reader knows
inline constexpr int kArtifactWidthsMajor = 2;
inline constexpr int kArtifactWidthsMinor = 1;  // the newest 2.x this reader knows
struct Artifact;
// "1.1", or "2.0" when some side has its own width; one minor more with layer budgets.
std::string artifact_format_version(const Artifact& a);
// For a reader, after reading a file: throws Error (naming `path`) when its format_version cannot
// hold what it holds (per-side widths in a 1.x file: mislabelled, or written by no kvcc).
void check_artifact_version_holds(const Artifact& a, const std::string& path);

// A method-specific array stored beside the standard ones (e.g. CommVQ codebooks, TurboQuant
// outlier channels). Integer arrays are written as int64 datasets.
struct NamedArray {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<double> data;
  bool integer = false;
};

// One side (key or value) of one (layer, KV head).
struct SideArtifact {
  std::vector<double> rotation;     // [d, d] row-major, applied as x_rot = x · R (orthogonal)
  std::vector<double> eigenvalues;  // [d] ascending, of the target the rotation diagonalises; empty if none
  double clip_ratio = 1.0;          // uniform grid: clip threshold rank ratio (codec_scalar.h)
  std::vector<double> levels;       // level-table codecs: 2^bits ascending levels in RMS units; empty: uniform grid
  std::vector<NamedArray> extras;   // method-specific
  // Code bits of this side when they differ from the recipe's (compile --bits-budget: per-layer or
  // per-head widths); 0: the recipe's key_bits / value_bits. Optional dataset "bits" [1].
  double bits = 0;

  const NamedArray* extra(const std::string& name) const;
};

struct HeadArtifact {
  SideArtifact key;
  SideArtifact value;
};

struct Recipe {
  std::string method;   // a name of formats/method.h's table (method_of converts)
  double key_bits = 2;  // nominal bits per element of the quantised history (2.5 for split budgets)
  double value_bits = 2;
  int group = 0;                     // channels per (scale, zero) group; 0 = head_dim
  int sink = 64;                     // BF16 tokens kept at the start
  int recent = 256;                  // BF16 ring of the last tokens
  int page_size = 64;                // tokens per INT2 page
  std::string value_target;          // output | p2 | logit2 | "" (methods without a value rotation)
  std::string granularity = "head";  // head | layer (one rotation shared by a layer's KV heads)
  std::string composition = "UHP";   // UHP | UH | U (oscar ablations); "" otherwise
  uint64_t seed = 0;
  std::map<std::string, std::string> params;  // method-specific, documented per method in docs/formats.md
};

struct ArtifactProvenance {
  std::string data_sha256;
  uint64_t tokens = 0;
  uint64_t sequences = 0;
  uint64_t seed = 0;
  std::string stats_sha256;  // sha256 of the stats file compiled (empty when imported)
  std::string source;        // "calibrated" | "imported:oscar" | ...
};

struct Artifact {
  std::string format_version = "1.0";  // major.minor as read or written
  std::string producer;
  std::string created;
  std::string command;
  std::string model_id;  // a human name for the model ("gutenberg-27m")
  ModelFingerprint fingerprint;
  int n_layers = 0, n_heads = 0, n_kv_heads = 0, head_dim = 0;
  RopeStyle rope_style = RopeStyle::RotateHalf;
  ArtifactProvenance provenance;
  Recipe recipe;
  std::vector<HeadArtifact> heads;  // [n_layers * n_kv_heads], index layer * n_kv_heads + h
  // Token-eviction budgets per layer relative to a uniform split (mean 1, each > 0), from the
  // calibration's attention spread (compile/layer_budgets.h); empty: none (evict uniformly).
  std::vector<double> layer_budgets;

  HeadArtifact& head(int layer, int h) { return heads[size_t(layer * n_kv_heads + h)]; }
  const HeadArtifact& head(int layer, int h) const { return heads[size_t(layer * n_kv_heads + h)]; }
};

// Writes to a temporary file beside PATH and renames it into place. Each dataset carries a
// sha256 attribute of its bytes, checked on read.
void write_artifact(const Artifact&, const std::string& path);
// Reads and validates shapes, dtypes, checksums and finiteness; refuses an unknown major version.
// PATH may be the HDF5 artifact or its safetensors form (formats/artifact_safetensors.h), told
// apart by the file's first bytes; verify_artifact_file below reads either too.
Artifact read_artifact(const std::string& path);

// "" when the two artifacts are equal in every field, numbers compared bit for bit (so -0.0 and
// 0.0 differ); otherwise the first difference ("/layers/2/kv1/key/rotation: element 17 differs").
// What `kvcc export` checks its output against. format_version is the file's, not the artifact's
// (a writer always writes its own), so it is not compared.
std::string artifact_difference(const Artifact& a, const Artifact& b);

// max |RᵀR − I| of a row-major [d, d] matrix (the orthogonality measure verify reports).
double max_orthogonality_error(const std::vector<double>& rotation, int d);

// One problem per entry; empty when the artifact is sound. Checks shapes, finiteness,
// orthogonality (max |RᵀR − I| <= tol), ascending eigenvalues, level tables sorted, a method of
// formats/method.h's table with valid values of the parameters it takes, and that method's own
// checks (its table entry's verify: commvq codebooks, turboquant's split).
// write_artifact and read_artifact refuse an artifact with any of these problems.
std::vector<std::string> verify_artifact(const Artifact&, double orthogonality_tol = 1e-5);
// Reads PATH (structure, version and dtypes are checked and thrown as by read_artifact), collecting
// checksum mismatches and verify_artifact's problems instead of stopping at the first, so
// `kvcc verify` can list them all. Empty when the file is sound.
std::vector<std::string> verify_artifact_file(const std::string& path, double orthogonality_tol = 1e-5);

}  // namespace kvcc
