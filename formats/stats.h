// Calibration statistics, format v1 (docs/formats.md has the HDF5 schema). Everything additive
// is stored as a float64 sum with its count and normalised only at compile time, so stats files
// merge by summation and calibration can be sharded.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "formats/model_config.h"

namespace kvcc {

inline constexpr const char* kStatsFormat = "kvcc-stats";
inline constexpr int kStatsMajor = 1;
inline constexpr int kStatsMinor = 2;  // 2: the optional layer sensitivity

// Sums over the calibration set for one (layer, KV head). d = head_dim; matrices are row-major
// [d, d]. All keys and queries are post-RoPE.
struct HeadStats {
  std::vector<double> query_m2;   // Σ q qᵀ over every query of the group's r query heads
  uint64_t query_count = 0;       // number of q rows summed (tokens × r)
  std::vector<double> output_m2;  // value target "output": Σ_i o_i o_iᵀ, o_i = Σ_j p_ij v_j, per query head
  uint64_t output_count = 0;      // number of o rows summed (tokens × r)
  std::vector<double> p2_m2;      // value target "p2": Σ_j w_j v_j v_jᵀ, w_j = Σ_heads Σ_i p_ij²
  double p2_weight = 0.0;         // Σ_j w_j
  std::vector<double> key_m2;     // Σ k kᵀ (post-RoPE)
  std::vector<double> value_m2;   // Σ v vᵀ
  uint64_t kv_count = 0;          // number of k (= v) rows summed
  std::vector<double> key_min, key_max, value_min, value_max;  // per channel [d]

  void resize(int d);  // zero sums, ±inf ranges
};

// A bounded uniform sample of token rows for one (layer, KV head), for fitting clip ratios and
// codebooks and for held-out evaluation. Rows are chosen by a deterministic priority (a hash of
// seed, document and position, so every layer and head samples the same tokens; the `capacity`
// smallest are kept), so sampling does
// not depend on how documents were split across processes, and merging two reservoirs is "keep
// the smallest priorities of the union". A row is held out when its document is (doc % 5 == 4),
// so held-out rows never share a document with fitting rows.
struct Reservoir {
  int capacity = 0;
  int group = 0;  // r query heads per KV head
  int d = 0;
  std::vector<float> q;            // [n, r, d] post-RoPE queries of the group's heads at this token
  std::vector<float> key_pre;      // [n, d] pre-RoPE key (after k_norm where the model has one)
  std::vector<float> key;          // [n, d] post-RoPE key
  std::vector<float> value;        // [n, d]
  std::vector<int32_t> position;   // [n] position within its sequence
  std::vector<uint32_t> doc;       // [n] document index in the calibration text
  std::vector<uint64_t> priority;  // [n] sampling priority (smaller is kept)
  std::vector<uint8_t> heldout;    // [n] 1 if held out

  size_t size() const { return position.size(); }
};

// EpiCache's layer sensitivity to block-wise prefill (calibrate/layer_sensitivity.h), when
// measured: per layer the sum, over `pairs` (token, KV head) pairs, of the cosine similarity
// between a key of the causal run and of a run whose queries see only `sink` sink tokens, the
// second half of the previous block of `block` tokens and their own block. Minor version 2.
struct LayerSensitivity {
  int block = 0, sink = 0;
  uint64_t pairs = 0;                      // 0: not measured
  std::vector<double> key_similarity_sum;  // [n_layers]

  bool measured() const { return pairs > 0; }
  std::vector<double> key_similarity() const;  // the sums over pairs
};

struct StatsProvenance {
  std::string data_sha256;  // sha256 of the calibration input file (merged: see merge_stats)
  uint64_t tokens = 0;
  uint64_t sequences = 0;
  uint64_t seed = 0;
  int max_seq_len = 0;
  std::string tokenizer;  // what tokenized the text ("tokenizer.json", "tokenizer.bin", "ids")
};

struct Stats {
  std::string producer;  // "kvcc 0.1.0"
  std::string created;   // ISO 8601 UTC
  std::string command;   // the command line that made it
  ModelConfig config;
  ModelFingerprint fingerprint;
  StatsProvenance provenance;
  std::vector<HeadStats> heads;       // [n_layers * n_kv_heads], index layer * n_kv_heads + h
  std::vector<Reservoir> reservoirs;  // same indexing
  LayerSensitivity sensitivity;       // not measured unless calibrate-model --layer-sensitivity

  HeadStats& head(int layer, int h) { return heads[size_t(layer * config.n_kv_heads + h)]; }
  const HeadStats& head(int layer, int h) const { return heads[size_t(layer * config.n_kv_heads + h)]; }
  Reservoir& reservoir(int layer, int h) { return reservoirs[size_t(layer * config.n_kv_heads + h)]; }
  const Reservoir& reservoir(int layer, int h) const { return reservoirs[size_t(layer * config.n_kv_heads + h)]; }
};

// Empty stats (zero sums, empty reservoirs of the given capacity) for a model.
Stats make_empty_stats(const ModelConfig&, const ModelFingerprint&, int reservoir_capacity);

// Writes to PATH.tmp-XXXX then renames: a crash never leaves a half-written file.
void write_stats(const Stats&, const std::string& path);
// Reads and validates (format, version, shapes, counts, finiteness); throws Error naming the problem.
Stats read_stats(const std::string& path);

// As read_stats but without the reservoirs' row arrays (q, key_pre, key, value stay empty; the
// per-row position, doc, priority and heldout are read), for summaries of large files.
Stats read_stats_summary(const std::string& path);

// Every problem found in loaded stats, one line each: non-finite sums or ranges, asymmetric or
// negative-diagonal second moments, inconsistent reservoirs. Empty when sound.
std::vector<std::string> verify_stats(const Stats&);
// Reads PATH (structure, shapes, version checked and thrown as by read_stats) without rejecting bad
// values, then returns verify_stats's problems, so `kvcc verify` can list them all.
std::vector<std::string> verify_stats_file(const std::string& path);

// a += b. Refuses (Error) when the two describe different models. Sums and counts add, ranges
// widen, reservoirs keep the smallest priorities of the union (capacity: the smaller of the two,
// the largest for which that is still exact), tokens and sequences add, layer sensitivities add
// (refused when both are measured with different blocks or sinks; one side's alone is kept);
// data_sha256 becomes sha256 of the two inputs' hashes in sorted order ("merged:" prefix).
void merge_stats(Stats& a, const Stats& b);

// Adds reservoir rows to r keeping the `capacity` smallest priorities (a row whose priority is
// already present is a duplicate and is skipped). Used by calibration and merge. Afterwards r's
// rows are sorted by ascending priority, so merging is order-independent. An empty r with d == 0
// takes other's group and d; otherwise they must agree (Error).
void reservoir_merge(Reservoir& r, const Reservoir& other);

}  // namespace kvcc
