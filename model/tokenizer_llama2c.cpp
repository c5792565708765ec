// llama2.c tokenizer.bin, encoded exactly as llama2.c's run.c does: a dummy-prefix space token,
// each UTF-8 character looked up whole (else its bytes as <0xXX> at id byte+3), then greedy merges
// of the adjacent pair whose concatenation is the best-scoring vocabulary entry (leftmost on ties).
#include <cmath>
#include <cstring>
#include <fstream>
#include <string_view>
#include <unordered_map>

#include "formats/error.h"
#include "model/tokenizer_bpe.h"
#include "model/tokenizer_impl.h"

namespace kvcc::detail {
namespace {

constexpr int32_t kLlama2cBos = 1;
constexpr int32_t kLlama2cEos = 2;
constexpr int32_t kByteFallbackOffset = 3;  // <0x00> is id 3 in every llama2.c / sentencepiece vocab
// run.c starts its best-score search at -1e10, so a pair scoring at or below it never merges.
constexpr float kNoMergeScore = -1e10f;

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};

class Llama2cTokenizer final : public Tokenizer {
 public:
  explicit Llama2cTokenizer(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    KVCC_REQUIRE(in.good(), "cannot open tokenizer " + path);
    const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    size_t offset = 0;
    auto read_i32 = [&](const char* field) {
      KVCC_REQUIRE(offset + 4 <= bytes.size(), "tokenizer " + path + " is truncated (in " + field + " of token " +
                                                   std::to_string(pieces_.size()) + ")");
      int32_t v;
      std::memcpy(&v, bytes.data() + offset, 4);
      offset += 4;
      return v;
    };
    const int32_t max_token_length = read_i32("the header");
    // Real vocabularies have pieces of a few dozen bytes; anything else is not a tokenizer.bin.
    KVCC_REQUIRE(max_token_length > 0 && max_token_length <= 4096,
                 "tokenizer " + path + " is corrupt: max_token_length " + std::to_string(max_token_length));
    while (offset < bytes.size()) {
      const int32_t score_bits = read_i32("the score");
      float score;
      std::memcpy(&score, &score_bits, 4);
      const int32_t length = read_i32("the length");
      const std::string where = " of token " + std::to_string(pieces_.size());
      KVCC_REQUIRE(std::isfinite(score), "tokenizer " + path + " is corrupt: non-finite score" + where);
      KVCC_REQUIRE(length >= 0 && length <= max_token_length,
                   "tokenizer " + path + " is corrupt: length " + std::to_string(length) + where +
                       " exceeds max_token_length " + std::to_string(max_token_length));
      KVCC_REQUIRE(offset + length <= bytes.size(), "tokenizer " + path + " is truncated (in the bytes" + where + ")");
      pieces_.emplace_back(bytes.data() + offset, length);
      scores_.push_back(score);
      offset += length;
    }
    KVCC_REQUIRE(pieces_.size() > kByteFallbackOffset + 255,
                 "tokenizer " + path + " has " + std::to_string(pieces_.size()) +
                     " tokens, fewer than the 259 of a llama2.c vocabulary (<unk>, <s>, </s>, 256 bytes)");
    for (int32_t id = 0; id < static_cast<int32_t>(pieces_.size()); ++id)
      piece_ids_.try_emplace(pieces_[id], id);  // the lowest id wins for a duplicated piece
    auto space = piece_ids_.find(std::string_view(" "));
    KVCC_REQUIRE(space != piece_ids_.end(), "tokenizer " + path + " has no \" \" token for the dummy prefix");
    dummy_prefix_id_ = space->second;
  }

  std::vector<int32_t> encode(const std::string& text, bool add_bos) const override {
    std::vector<int32_t> ids;
    if (!text.empty()) ids.push_back(dummy_prefix_id_);
    // Group the bytes of each UTF-8 character (at most 4) as run.c does.
    size_t start = 0;
    for (size_t i = 0; i < text.size(); ++i) {
      const auto byte = static_cast<unsigned char>(text[i]);
      if ((byte & 0xC0) != 0x80) start = i;
      const auto next = i + 1 < text.size() ? static_cast<unsigned char>(text[i + 1]) : 0;
      if ((next & 0xC0) == 0x80 && i + 1 - start < 4) continue;
      const std::string_view character(text.data() + start, i + 1 - start);
      if (auto it = piece_ids_.find(character); it != piece_ids_.end()) {
        ids.push_back(it->second);
      } else {
        for (unsigned char b : character) ids.push_back(kByteFallbackOffset + b);
      }
      start = i + 1;
    }
    // run.c keeps BOS in the array while merging, so its pairs are considered too.
    if (add_bos) ids.insert(ids.begin(), kLlama2cBos);
    std::string joined;
    return bpe_merge(ids, [&](int32_t left, int32_t right) -> std::optional<MergeResult> {
      joined.assign(pieces_[left]);
      joined.append(pieces_[right]);
      auto it = piece_ids_.find(std::string_view(joined));
      if (it == piece_ids_.end() || !(scores_[it->second] > kNoMergeScore)) return std::nullopt;
      return MergeResult{-static_cast<double>(scores_[it->second]), it->second};
    });
  }

  std::string decode(const std::vector<int32_t>& ids) const override {
    std::string text;
    bool first = true;
    for (int32_t id : ids) {
      KVCC_REQUIRE(id >= 0 && id < vocab_size(),
                   "token id " + std::to_string(id) + " is outside the vocabulary of " + std::to_string(vocab_size()));
      if (id == kLlama2cBos || id == kLlama2cEos) continue;
      std::string_view piece = pieces_[id];
      if (first && !piece.empty() && piece[0] == ' ') piece.remove_prefix(1);  // the dummy prefix
      first = false;
      unsigned byte;
      if (piece.size() == 6 && piece.starts_with("<0x") && piece.ends_with(">") &&
          std::sscanf(std::string(piece).c_str(), "<0x%02X>", &byte) == 1) {
        text.push_back(static_cast<char>(byte));
      } else {
        text.append(piece);
      }
    }
    return text;
  }

  int vocab_size() const override { return static_cast<int>(pieces_.size()); }
  int bos_id() const override { return kLlama2cBos; }
  int eos_id() const override { return kLlama2cEos; }
  std::string kind() const override { return "llama2.c tokenizer.bin"; }

 private:
  std::vector<std::string> pieces_;
  std::vector<float> scores_;
  std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>> piece_ids_;
  int32_t dummy_prefix_id_ = -1;
};

}  // namespace

std::unique_ptr<Tokenizer> load_llama2c_tokenizer(const std::string& path) {
  return std::make_unique<Llama2cTokenizer>(path);
}

}  // namespace kvcc::detail
