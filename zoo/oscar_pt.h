// OSCAR RotationZoo rotation files (FutureMLS-Lab/OSCAR, torch.save dicts; docs/zoo.md):
//
//   {"format_version": 1 | 2,
//    "objective": "qqt_r_h_pbr" | "sst_r_h_pbr" | "hadamard" | ...,
//    "source_grouping": "layer" (v1) | "kv_head" (v2, ours: OSCAR's v2 files are not published),
//    "layers": {<int layer_id>: {"layer_id": int,
//                                "rotation": float32 [d, d] (v1) | [n_kv_heads, d, d] (v2),
//                                "eigenvalues": float32 [d] (v1) | [n_kv_heads, d] (v2), ascending}}}
//
// Rotations apply to row vectors, x_rot = x · R. Layer keys may be ints or digit strings (OSCAR's
// loader accepts both); hybrid models key by global layer id, so ids need not be contiguous.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace kvcc {

struct OscarLayer {
  int64_t layer_id = 0;
  std::vector<float> rotation;     // [heads, d, d] row-major (heads = 1 in a v1 file)
  std::vector<float> eigenvalues;  // [heads, d], or empty when the file has none
};

struct OscarRotationSet {
  int format_version = 1;  // 1: one rotation per layer; 2: one per (layer, KV head)
  std::string objective;
  std::string source_grouping = "layer";
  int head_dim = 0;
  int heads = 1;                   // rotations per layer: 1 for v1, n_kv_heads for v2
  std::vector<OscarLayer> layers;  // sorted by layer_id
};

// Reads and validates (version, shapes, consistent d, finiteness); Error names the path and cause.
OscarRotationSet read_oscar_pt(const std::string& path);
// Writes a torch.save archive (atomically) that torch.load(..., weights_only=True) reads.
void write_oscar_pt(const OscarRotationSet& set, const std::string& path);

}  // namespace kvcc
