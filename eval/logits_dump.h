// `kvcc validate --dump-logits FILE`: the next-token logits (or the top k log-probabilities) of
// every scored position of every run, as one safetensors file, for comparison with other
// implementations (transformers, another engine, a reference KIVI). docs/validation.md
// "The model alone, and the logits dump" is the format's specification; in short:
//
//   tokens            I32 [Σ len]     the evaluated documents' ids, concatenated
//   document_offsets  I64 [D + 1]     document d is tokens[offsets[d] : offsets[d+1]]
//   document, position, target  I32 [N]  row r scores the prediction made at `position` of
//                                   `document` (inputs tokens 0..position) of token `target`;
//                                   N = Σ (len − 1), rows in document then position order
//   RUN/logits        F32 [N, vocab]  the model's logits (full dump), or
//   RUN/top_ids       I32 [N, k]      the k most likely ids, descending (ties: lower id first), and
//   RUN/top_logprobs  F32 [N, k]      their log-softmax (computed in double, stored as float)
//   __metadata__: format "kvcc-logits", version "1", kind "logits" | "top_k", k, vocab, runs (a
//                 JSON list of the RUN names: "reference" first, then the schemes), model, mode,
//                 block, precision.
//
// The file is written as the validation runs (one row at a time at its place in the file), so its
// memory is one row, whatever the text's length.
#pragma once
#include <cstdint>
#include <fstream>
#include <map>
#include <string>
#include <vector>

namespace kvcc {

struct LogitsDumpSpec {
  std::vector<std::string> runs;  // tensor name prefixes: "reference", then the schemes' names
  int vocab = 0;
  int top_k = 0;                                // 0: full logits
  std::map<std::string, std::string> metadata;  // added to the header's __metadata__
};

class LogitsDump {
 public:
  // Writes the header and the token tables to `path` (a temporary file: the caller renames it
  // into place). documents: the evaluated documents (every one of >= 2 tokens, as validate_schemes
  // scores them). Throws Error on duplicate or empty run names, k outside [1, vocab], no rows.
  LogitsDump(const std::string& path, const LogitsDumpSpec& spec, const std::vector<std::vector<int32_t>>& documents);
  // Row `row` of run `run`: the float logits and their log-softmax (both [vocab], double).
  void write_row(size_t run, uint64_t row, const double* logits, const double* logprobs);
  // Throws Error unless every row of every run was written once; then flushes and closes.
  void finish();
  uint64_t rows() const { return rows_; }

 private:
  std::ofstream out_;
  std::string path_;
  int vocab_ = 0, k_ = 0;
  uint64_t rows_ = 0, data_start_ = 0;
  std::vector<uint64_t> run_offset_;  // byte offset of each run's first tensor in the data region
  std::vector<uint64_t> written_;     // rows written per run
  std::vector<float> buf_;
  std::vector<int32_t> ids_;
};

}  // namespace kvcc
