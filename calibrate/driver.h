// The layer-streaming calibration driver: tokenizes the calibration text into documents, embeds
// every token, then runs the model one layer at a time over all sequences (load a layer's weights,
// run every sequence through it with the statistics observer, drop the weights). Memory is one
// layer's weights plus the hidden states of all calibration tokens, whatever the model's size.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "formats/model_config.h"
#include "formats/stats.h"

namespace kvcc {

// What the driver reports while it works (the CLI draws a bar or prints lines from it).
struct CalibrationProgress {
  std::string stage;  // "tokenize", "embed", "layer", "sensitivity" (layer = the layer just done)
  int layer = 0;      // current layer (stage "layer")
  int n_layers = 0;
  uint64_t tokens_done = 0;   // tokens of this layer (or stage) done so far on this process
  uint64_t tokens_total = 0;  // tokens this process runs through each layer
  double elapsed_s = 0.0;     // since the driver started
};

struct CalibrationOptions {
  std::string model_path;      // HF directory or llama2.c .bin
  std::string data_path;       // calibration text, documents separated by `separator`
  std::string ids_path;        // or: a pre-tokenized file (one document of ids per line)
  std::string tokenizer_path;  // explicit tokenizer (llama2.c models); empty: found beside the model
  std::string separator = "<|endoftext|>";
  uint64_t max_tokens = 0;  // stop after this many tokens in total (0: the whole input)
  int max_seq_len = 0;      // truncate documents to this (0: min(model max_position, 2048))
  int reservoir = 2048;     // reservoir rows per (layer, KV head)
  uint64_t seed = 0;
  // Process only documents with index % shard_count == shard_index (global indices are kept, so
  // the shards merged with merge_stats equal the single run).
  int shard_index = 0;
  int shard_count = 1;
  // EpiCache's layer sensitivity (calibrate/layer_sensitivity.h; Stats::sensitivity), measured
  // when sensitivity_block > 0 on the first documents of the set, at least sensitivity_tokens
  // tokens (by the shard that holds document 0, so shards and ranks merge to one measurement).
  int sensitivity_block = 0;
  int sensitivity_sink = 4;
  uint64_t sensitivity_tokens = 16384;
  // "cpu" (OpenBLAS), "gpu" or "gpu:N" (calibrate/gpu_layers.h: the layers on CUDA device N, 0 by
  // default; under mpirun "gpu" gives each rank the device of its local rank).
  std::string device = "cpu";
  std::string command;                                       // recorded in the stats file
  std::function<void(const CalibrationProgress&)> progress;  // optional
};

// The calibration set after tokenization, truncation and the token budget (before sharding).
struct CalibrationSet {
  std::vector<std::vector<int32_t>> sequences;
  std::vector<uint32_t> doc_index;  // document index in the input, per sequence (stable)
  uint64_t tokens = 0;
  int max_seq_len = 0;
  std::string tokenizer_kind;  // Tokenizer::kind(), or "ids"
  std::string data_sha256;     // of the input file
};

// Reads and tokenizes the input as the options say; throws Error on a missing or empty input,
// a tokenizer that does not match the model, or ids outside the vocabulary.
CalibrationSet prepare_calibration_set(const CalibrationOptions&, const ModelConfig&);

struct CalibrationSummary {
  uint64_t tokens = 0;  // over all processes
  uint64_t sequences = 0;
  double seconds = 0.0;              // wall time of the whole run
  double forward_seconds = 0.0;      // model layers (this process), statistics excluded
  double stats_seconds = 0.0;        // inside the statistics observer, or GPU time of the statistics
  double forward_cpu_seconds = 0.0;  // the same two as process CPU time (all threads), which a
  double stats_cpu_seconds = 0.0;    // busy shared machine disturbs less than wall time
  long peak_rss_kib = 0;             // getrusage maximum resident set of this process
  uint64_t hidden_state_bytes = 0;   // the calibration set's hidden states (this process)
  uint64_t layer_weight_bytes = 0;   // the largest single layer's float32 weights
  int ranks = 1;                     // MPI processes (1 without mpirun)
  std::string device;                // "cpu", or the GPU's name
  bool wrote_output = false;         // false on MPI ranks other than 0
};

// One process: runs the calibration on this process's shard and returns its statistics.
Stats calibrate_model(const CalibrationOptions&, CalibrationSummary* summary = nullptr);

// The command's work: under `mpirun` (OMPI_COMM_WORLD_SIZE set, built with MPI) documents are
// split across ranks by index % size and the statistics are reduced to rank 0; rank 0 (or the only
// process) writes `output_path` atomically. Throws Error before any heavy work when the output's
// directory does not exist.
CalibrationSummary run_calibration(const CalibrationOptions&, const std::string& output_path);

}  // namespace kvcc
