#include "eval/logits_dump.h"

#include <algorithm>
#include <numeric>
#include <nlohmann/json.hpp>
#include <set>

#include "formats/error.h"

namespace kvcc {

namespace {

void write_le64(std::ofstream& out, uint64_t n) {
  unsigned char b[8];
  for (int i = 0; i < 8; ++i) b[i] = static_cast<unsigned char>(n >> (8 * i));
  out.write(reinterpret_cast<const char*>(b), 8);
}

template <class T>
void write_array(std::ofstream& out, const std::vector<T>& v) {
  out.write(reinterpret_cast<const char*>(v.data()), std::streamsize(v.size() * sizeof(T)));
}

}  // namespace

LogitsDump::LogitsDump(const std::string& path, const LogitsDumpSpec& spec,
                       const std::vector<std::vector<int32_t>>& documents)
    : path_(path), vocab_(spec.vocab), k_(spec.top_k) {
  KVCC_REQUIRE(vocab_ > 0, "logits dump: vocabulary size must be positive");
  KVCC_REQUIRE(k_ >= 0 && k_ <= vocab_,
               "--dump-top-k " + std::to_string(k_) + " is outside [1, vocab " + std::to_string(vocab_) + "]");
  std::set<std::string> names;
  for (const std::string& r : spec.runs)
    KVCC_REQUIRE(!r.empty() && names.insert(r).second,
                 "logits dump: run name '" + r + "' is empty or used twice (name the artifacts' files apart)");
  // The tables that say what each row is.
  std::vector<int32_t> tokens, doc_of, pos_of, target_of;
  std::vector<int64_t> offsets{0};
  for (const auto& doc : documents) {
    if (doc.size() < 2) continue;  // validate_schemes scores documents of >= 2 tokens only
    const int32_t d = int32_t(offsets.size() - 1);
    for (size_t t = 0; t + 1 < doc.size(); ++t) {
      doc_of.push_back(d);
      pos_of.push_back(int32_t(t));
      target_of.push_back(doc[t + 1]);
    }
    tokens.insert(tokens.end(), doc.begin(), doc.end());
    offsets.push_back(int64_t(tokens.size()));
  }
  rows_ = doc_of.size();
  KVCC_REQUIRE(rows_ > 0, "logits dump: no document of at least 2 tokens");

  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  nlohmann::ordered_json meta = nlohmann::ordered_json::object();
  meta["format"] = "kvcc-logits";
  meta["version"] = "1";
  meta["kind"] = k_ == 0 ? "logits" : "top_k";
  meta["k"] = std::to_string(k_);
  meta["vocab"] = std::to_string(vocab_);
  meta["runs"] = nlohmann::json(spec.runs).dump();
  for (const auto& [key, value] : spec.metadata) meta[key] = value;
  header["__metadata__"] = meta;
  uint64_t offset = 0;
  auto add = [&](const std::string& name, const char* dtype, std::vector<int64_t> shape, uint64_t bytes) {
    header[name] = {{"dtype", dtype}, {"shape", shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  };
  add("tokens", "I32", {int64_t(tokens.size())}, tokens.size() * 4);
  add("document_offsets", "I64", {int64_t(offsets.size())}, offsets.size() * 8);
  add("document", "I32", {int64_t(rows_)}, rows_ * 4);
  add("position", "I32", {int64_t(rows_)}, rows_ * 4);
  add("target", "I32", {int64_t(rows_)}, rows_ * 4);
  for (const std::string& r : spec.runs) {
    run_offset_.push_back(offset);
    if (k_ == 0) {
      add(r + "/logits", "F32", {int64_t(rows_), vocab_}, rows_ * uint64_t(vocab_) * 4);
    } else {
      add(r + "/top_ids", "I32", {int64_t(rows_), k_}, rows_ * uint64_t(k_) * 4);
      add(r + "/top_logprobs", "F32", {int64_t(rows_), k_}, rows_ * uint64_t(k_) * 4);
    }
  }
  written_.assign(spec.runs.size(), 0);
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data region starts 8-byte aligned
  data_start_ = 8 + text.size();
  out_.open(path, std::ios::binary | std::ios::trunc);
  KVCC_REQUIRE(bool(out_), "logits dump: cannot write '" + path + "'");
  write_le64(out_, text.size());
  out_.write(text.data(), std::streamsize(text.size()));
  write_array(out_, tokens);
  write_array(out_, offsets);
  write_array(out_, doc_of);
  write_array(out_, pos_of);
  write_array(out_, target_of);
  KVCC_REQUIRE(bool(out_), "logits dump: write failed: '" + path + "'");
  buf_.resize(size_t(k_ == 0 ? vocab_ : k_));
  ids_.resize(size_t(vocab_));
}

void LogitsDump::write_row(size_t run, uint64_t row, const double* logits, const double* logprobs) {
  KVCC_REQUIRE(run < written_.size(), "logits dump: no run " + std::to_string(run));
  // Rows arrive in order per run; anything else is a bug in the caller.
  KVCC_REQUIRE(row == written_[run] && row < rows_, "logits dump: row " + std::to_string(row) + " of run " +
                                                        std::to_string(run) + " out of order (expected " +
                                                        std::to_string(written_[run]) + ")");
  const uint64_t V = uint64_t(vocab_);
  if (k_ == 0) {
    for (uint64_t v = 0; v < V; ++v) buf_[v] = float(logits[v]);
    out_.seekp(std::streamoff(data_start_ + run_offset_[run] + row * V * 4));
    write_array(out_, buf_);
  } else {
    const uint64_t K = uint64_t(k_);
    std::iota(ids_.begin(), ids_.end(), 0);
    std::partial_sort(ids_.begin(), ids_.begin() + std::ptrdiff_t(K), ids_.end(), [&](int32_t a, int32_t b) {
      return logprobs[a] > logprobs[b] || (logprobs[a] == logprobs[b] && a < b);
    });
    std::vector<int32_t> top(ids_.begin(), ids_.begin() + std::ptrdiff_t(K));
    for (uint64_t i = 0; i < K; ++i) buf_[i] = float(logprobs[top[i]]);
    out_.seekp(std::streamoff(data_start_ + run_offset_[run] + row * K * 4));
    write_array(out_, top);
    out_.seekp(std::streamoff(data_start_ + run_offset_[run] + rows_ * K * 4 + row * K * 4));
    write_array(out_, buf_);
  }
  KVCC_REQUIRE(bool(out_), "logits dump: write failed: '" + path_ + "'");
  ++written_[run];
}

void LogitsDump::finish() {
  for (size_t r = 0; r < written_.size(); ++r)
    KVCC_REQUIRE(written_[r] == rows_, "logits dump: run " + std::to_string(r) + " has " + std::to_string(written_[r]) +
                                           " of " + std::to_string(rows_) + " rows");
  out_.close();
  KVCC_REQUIRE(!out_.fail(), "logits dump: closing '" + path_ + "' failed");
}

}  // namespace kvcc
