// Tokenizer discovery (which file belongs to a model), document splitting and pre-tokenized input.
#include "model/tokenizer.h"

#include <algorithm>
#include <charconv>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "formats/atomic_file.h"
#include "formats/error.h"
#include "model/tokenizer_impl.h"

namespace kvcc {
namespace fs = std::filesystem;

namespace detail {

void require_valid_utf8(const std::string& text, const std::string& what) {
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  for (size_t i = 0; i < n;) {
    const unsigned char lead = s[i];
    size_t len;
    uint32_t min_codepoint, codepoint;
    if (lead < 0x80) {
      ++i;
      continue;
    } else if ((lead & 0xE0) == 0xC0) {
      len = 2, min_codepoint = 0x80, codepoint = lead & 0x1F;
    } else if ((lead & 0xF0) == 0xE0) {
      len = 3, min_codepoint = 0x800, codepoint = lead & 0x0F;
    } else if ((lead & 0xF8) == 0xF0) {
      len = 4, min_codepoint = 0x10000, codepoint = lead & 0x07;
    } else {
      throw Error(what + " is not valid UTF-8 (byte offset " + std::to_string(i) + ")");
    }
    bool valid = i + len <= n;
    for (size_t k = 1; valid && k < len; ++k) {
      valid = (s[i + k] & 0xC0) == 0x80;
      codepoint = (codepoint << 6) | (s[i + k] & 0x3F);
    }
    // Overlong forms, UTF-16 surrogates and code points past U+10FFFF are invalid too.
    valid =
        valid && codepoint >= min_codepoint && codepoint <= 0x10FFFF && !(codepoint >= 0xD800 && codepoint <= 0xDFFF);
    if (!valid) throw Error(what + " is not valid UTF-8 (byte offset " + std::to_string(i) + ")");
    i += len;
  }
}

}  // namespace detail

std::unique_ptr<Tokenizer> Tokenizer::from_file(const std::string& path) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    const fs::path json_path = fs::path(path) / "tokenizer.json";
    KVCC_REQUIRE(fs::exists(json_path, ec), "no tokenizer.json in directory " + path);
    return detail::load_hf_tokenizer(json_path.string());
  }
  std::ifstream in(path, std::ios::binary);
  KVCC_REQUIRE(in.good(), "cannot open tokenizer " + path + " (no such file or not readable)");
  const std::string extension = fs::path(path).extension().string();
  if (extension == ".json") return detail::load_hf_tokenizer(path);
  if (extension == ".bin") return detail::load_llama2c_tokenizer(path);
  // Otherwise by content: tokenizer.json is a JSON object; tokenizer.bin starts with a binary int32.
  char first = 0;
  while (in.get(first) && (first == ' ' || first == '\n' || first == '\r' || first == '\t')) {}
  KVCC_REQUIRE(in.gcount() > 0, "tokenizer " + path + " is empty");
  if (first == '{') return detail::load_hf_tokenizer(path);
  return detail::load_llama2c_tokenizer(path);
}

namespace {

// The tokenizer file beside a llama2.c checkpoint: tokenizer.bin, else tok<vocab>.bin, else the
// only tok*.bin.
fs::path find_llama2c_tokenizer(const fs::path& model_path, int vocab_size) {
  const fs::path dir = model_path.has_parent_path() ? model_path.parent_path() : fs::path(".");
  std::error_code ec;
  if (fs::exists(dir / "tokenizer.bin", ec)) return dir / "tokenizer.bin";
  if (fs::exists(dir / ("tok" + std::to_string(vocab_size) + ".bin"), ec))
    return dir / ("tok" + std::to_string(vocab_size) + ".bin");
  std::vector<fs::path> candidates;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.starts_with("tok") && name.ends_with(".bin")) candidates.push_back(entry.path());
  }
  KVCC_REQUIRE(!candidates.empty(),
               "no tokenizer.bin or tok*.bin beside " + model_path.string() + " (pass the tokenizer explicitly)");
  std::sort(candidates.begin(), candidates.end());
  std::string names;
  for (const auto& c : candidates) names += (names.empty() ? "" : ", ") + c.filename().string();
  KVCC_REQUIRE(candidates.size() == 1,
               "several tokenizers beside " + model_path.string() + " (" + names + "); pass one explicitly");
  return candidates.front();
}

}  // namespace

std::unique_ptr<Tokenizer> Tokenizer::for_model(const std::string& model_path, int vocab_size,
                                                const std::string& explicit_path) {
  std::unique_ptr<Tokenizer> tokenizer;
  std::error_code ec;
  if (!explicit_path.empty()) {
    tokenizer = from_file(explicit_path);
  } else if (fs::is_directory(model_path, ec)) {
    const fs::path json_path = fs::path(model_path) / "tokenizer.json";
    KVCC_REQUIRE(fs::exists(json_path, ec), "no tokenizer.json in model directory " + model_path);
    tokenizer = from_file(json_path.string());
  } else {
    KVCC_REQUIRE(fs::exists(model_path, ec), "model path " + model_path + " does not exist");
    tokenizer = from_file(find_llama2c_tokenizer(model_path, vocab_size).string());
  }
  // Models may pad their embedding table past the tokenizer's last id (Qwen: 151936 rows for
  // 151665 tokens) for alignment; a gap of more than 1% means a different tokenizer.
  const int tokens = tokenizer->vocab_size();
  const bool padded = tokens < vocab_size && static_cast<int64_t>(vocab_size - tokens) * 100 < vocab_size;
  KVCC_REQUIRE(vocab_size <= 0 || tokens == vocab_size || padded, "tokenizer has " + std::to_string(tokens) +
                                                                      " tokens but the model's vocabulary is " +
                                                                      std::to_string(vocab_size));
  return tokenizer;
}

std::vector<std::string> split_documents(const std::string& text, const std::string& separator) {
  // Separators usually sit on their own line, so the whitespace around them belongs to the
  // separator, not the document: each document is trimmed.
  constexpr const char* kWhitespace = " \t\n\r\f\v";
  std::vector<std::string> documents;
  auto add = [&](size_t begin, size_t end) {
    const size_t first = text.find_first_not_of(kWhitespace, begin);
    if (first == std::string::npos || first >= end) return;
    const size_t last = text.find_last_not_of(kWhitespace, end - 1);
    documents.push_back(text.substr(first, last + 1 - first));
  };
  if (separator.empty()) {
    add(0, text.size());
    return documents;
  }
  size_t begin = 0;
  for (size_t hit; (hit = text.find(separator, begin)) != std::string::npos; begin = hit + separator.size())
    add(begin, hit);
  add(begin, text.size());
  return documents;
}

std::string read_text_file(const std::string& path, const std::string& what) {
  KVCC_REQUIRE(std::filesystem::is_regular_file(path), what + " '" + path + "' does not exist or is not a file");
  std::ifstream in(path, std::ios::binary);
  KVCC_REQUIRE(bool(in), "cannot open " + what + " '" + path + "'");
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

std::vector<std::vector<int32_t>> encode_documents(const Tokenizer& tokenizer, const std::string& text,
                                                   const std::string& separator, bool add_bos) {
  std::vector<std::vector<int32_t>> out;
  for (const std::string& doc : split_documents(text, separator)) out.push_back(tokenizer.encode(doc, add_bos));
  return out;
}

void write_token_id_file(const std::string& path, const std::vector<std::vector<int32_t>>& documents) {
  std::string text;
  for (const auto& doc : documents) {
    for (size_t i = 0; i < doc.size(); ++i) {
      if (i) text += ' ';
      text += std::to_string(doc[i]);
    }
    text += '\n';
  }
  write_bytes_atomically(path, text);
}

std::vector<std::vector<int32_t>> read_token_id_file(const std::string& path) {
  std::ifstream in(path);
  KVCC_REQUIRE(in.good(), "cannot open token id file " + path);
  std::vector<std::vector<int32_t>> documents;
  std::string line;
  for (size_t line_number = 1; std::getline(in, line); ++line_number) {
    std::vector<int32_t> ids;
    const char* p = line.data();
    const char* end = p + line.size();
    while (true) {
      while (p < end && (*p == ' ' || *p == '\t' || *p == '\r')) ++p;
      if (p == end) break;
      int32_t id = -1;
      const auto [next, error] = std::from_chars(p, end, id);
      const bool separated = next == end || *next == ' ' || *next == '\t' || *next == '\r';
      if (error != std::errc() || id < 0 || !separated) {
        const char* word_end = std::find_if(p, end, [](char c) { return c == ' ' || c == '\t'; });
        throw Error("token id file " + path + " line " + std::to_string(line_number) + ": \"" +
                    std::string(p, word_end) + "\" is not a token id");
      }
      ids.push_back(id);
      p = next;
    }
    if (!ids.empty()) documents.push_back(std::move(ids));
  }
  KVCC_REQUIRE(!documents.empty(), "token id file " + path + " holds no token ids");
  return documents;
}

}  // namespace kvcc
