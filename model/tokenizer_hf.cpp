// Hugging Face tokenizer.json with a BPE model, following the `tokenizers` library's pipeline:
// added tokens are split off first (non-normalized ones on the raw text, normalized ones after the
// normalizer ran), then the normalizer, the pre-tokenizer, the BPE model per piece, and the
// TemplateProcessing post-processor's prefix (BOS) when asked. Decode runs the decoder chain.
// Supported: normalizers Sequence/Prepend/Replace/NFC/NFKC/NFD/NFKD (Unicode forms through ICU;
// a build without ICU accepts them for ASCII text only); pre-tokenizers Sequence/Split/Metaspace/
// ByteLevel; decoders Sequence/Replace/ByteFallback/Fuse/Strip/ByteLevel/Metaspace; others are
// refused by name when the file is loaded.
#define PCRE2_CODE_UNIT_WIDTH 8
#if defined(KVCC_HAVE_PCRE2)
#include <pcre2.h>
#endif

#include <algorithm>
#include <array>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string_view>
#include <unordered_map>
#include <variant>

#ifdef KVCC_HAVE_ICU
#include <unicode/unorm2.h>
#include <unicode/ustring.h>
#endif

#include "formats/error.h"
#include "formats/json_int.h"
#include "model/tokenizer_bpe.h"
#include "model/tokenizer_impl.h"

namespace kvcc::detail {
namespace {

using json = nlohmann::json;

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
using TokenMap = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

void replace_all(std::string& s, std::string_view from, std::string_view to) {
  if (from.empty()) return;
  std::string out;
  size_t pos = 0;
  for (size_t hit; (hit = s.find(from, pos)) != std::string::npos; pos = hit + from.size()) {
    out.append(s, pos, hit - pos);
    out.append(to);
  }
  if (pos == 0) return;
  out.append(s, pos, std::string::npos);
  s = std::move(out);
}

// GPT-2's byte <-> printable character table used by ByteLevel: printable Latin-1 bytes map to
// themselves, the other 68 bytes to U+0100 onwards in byte order.
struct ByteLevelTable {
  std::array<std::string, 256> byte_to_utf8;
  std::unordered_map<uint32_t, uint8_t> codepoint_to_byte;
  ByteLevelTable() {
    uint32_t next_extra = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
      const uint32_t cp = printable ? static_cast<uint32_t>(b) : next_extra++;
      append_utf8(byte_to_utf8[b], cp);
      codepoint_to_byte[cp] = static_cast<uint8_t>(b);
    }
  }
};
const ByteLevelTable& byte_level_table() {
  static const ByteLevelTable table;
  return table;
}

// Decodes the UTF-8 character at s[i] (valid UTF-8 assumed), advancing i.
uint32_t next_codepoint(std::string_view s, size_t& i) {
  const auto lead = static_cast<unsigned char>(s[i]);
  const int len = utf8_char_length(lead);
  uint32_t cp = len == 1 ? lead : len == 2 ? (lead & 0x1F) : len == 3 ? (lead & 0x0F) : (lead & 0x07);
  for (int k = 1; k < len && i + k < s.size(); ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  i += len;
  return cp;
}

// Unicode White_Space (what the library's lstrip/rstrip strip, Rust's char::is_whitespace).
bool is_unicode_space(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

// Byte length of the whitespace character starting at s[i], or 0.
size_t space_at(std::string_view s, size_t i) {
  size_t end = i;
  return is_unicode_space(next_codepoint(s, end)) ? end - i : 0;
}

// Byte length of the whitespace character ending just before s[i], or 0.
size_t space_before(std::string_view s, size_t i) {
  size_t start = i - 1;
  while (start > 0 && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
  return space_at(s, start) == i - start ? i - start : 0;
}

#if defined(KVCC_HAVE_PCRE2)
// A compiled PCRE2 pattern with Unicode classes (UTF + UCP), JIT-compiled when available.
class Regex {
 public:
  Regex(const std::string& pattern, bool literal, const std::string& where) {
    int error_code;
    PCRE2_SIZE error_offset;
    const uint32_t options = PCRE2_UTF | (literal ? PCRE2_LITERAL : PCRE2_UCP);  // UCP is invalid with LITERAL
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), options, &error_code,
                          &error_offset, nullptr);
    if (!code_) {
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(error_code, message, sizeof message);
      throw Error(where + ": cannot compile regex at offset " + std::to_string(error_offset) + ": " +
                  reinterpret_cast<const char*>(message));
    }
    pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE);  // falls back to the interpreter if JIT is unavailable
  }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;
  ~Regex() { pcre2_code_free(code_); }

  // Calls on_match(start, end) for each non-empty, non-overlapping match, left to right.
  template <class OnMatch>
  void for_each_match(std::string_view subject, const OnMatch& on_match) const {
    pcre2_match_data* data = pcre2_match_data_create_from_pattern(code_, nullptr);
    size_t start = 0;
    while (start < subject.size()) {
      // The subject was validated once up front; checking it on every call would be quadratic.
      const int rc = pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(subject.data()), subject.size(), start,
                                 PCRE2_NO_UTF_CHECK, data, nullptr);
      if (rc == PCRE2_ERROR_NOMATCH) break;
      if (rc < 0) {
        pcre2_match_data_free(data);
        throw Error("tokenizer regex failed to match (PCRE2 error " + std::to_string(rc) + ")");
      }
      const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(data);
      const size_t match_start = ovector[0], match_end = ovector[1];
      if (match_end == match_start) {
        start = match_start + utf8_char_length(static_cast<unsigned char>(subject[match_start]));
        continue;
      }
      on_match(match_start, match_end);
      start = match_end;
    }
    pcre2_match_data_free(data);
  }

 private:
  pcre2_code* code_ = nullptr;
};
#else
// Without PCRE2 (a runtime-only build) regex pre-tokenizers are refused by name.
class Regex {
 public:
  Regex(const std::string&, bool, const std::string& where) {
    throw Error(where + ": this kvcc was built without PCRE2 (libpcre2-dev), which regex pre-tokenizers need");
  }
  template <class OnMatch>
  void for_each_match(std::string_view, const OnMatch&) const {}
};
#endif

// A piece of text on its way through normalizer and pre-tokenizer. `at_text_start` marks the piece
// that begins the original text (Metaspace's prepend_scheme "first" uses it).
struct Piece {
  std::string text;
  bool at_text_start;
};

enum class SplitBehavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };

SplitBehavior split_behavior_from_name(const std::string& name) {
  if (name == "Removed") return SplitBehavior::Removed;
  if (name == "Isolated") return SplitBehavior::Isolated;
  if (name == "MergedWithPrevious") return SplitBehavior::MergedWithPrevious;
  if (name == "MergedWithNext") return SplitBehavior::MergedWithNext;
  if (name == "Contiguous") return SplitBehavior::Contiguous;
  throw Error("unsupported split behavior \"" + name + "\"");
}

// Splits `piece` on the matches of `regex` as the tokenizers library's NormalizedString::split does.
void split_piece(const Piece& piece, const Regex& regex, SplitBehavior behavior, bool invert, std::vector<Piece>& out) {
  struct Span {
    size_t start, end;
    bool is_match;
  };
  std::vector<Span> spans;
  size_t previous_end = 0;
  regex.for_each_match(piece.text, [&](size_t start, size_t end) {
    if (start != previous_end) spans.push_back({previous_end, start, invert});
    spans.push_back({start, end, !invert});
    previous_end = end;
  });
  if (previous_end != piece.text.size()) spans.push_back({previous_end, piece.text.size(), invert});

  std::vector<Span> kept;
  bool previous_match = false;
  switch (behavior) {
    case SplitBehavior::Isolated:
      kept = spans;
      break;
    case SplitBehavior::Removed:
      for (const Span& s : spans)
        if (!s.is_match) kept.push_back(s);
      break;
    case SplitBehavior::MergedWithPrevious:
      for (const Span& s : spans) {
        if (s.is_match && !previous_match && !kept.empty()) kept.back().end = s.end;
        else kept.push_back(s);
        previous_match = s.is_match;
      }
      break;
    case SplitBehavior::MergedWithNext:  // built right to left, as the library does
      for (auto it = spans.rbegin(); it != spans.rend(); ++it) {
        if (it->is_match && !previous_match && !kept.empty()) kept.back().start = it->start;
        else kept.push_back(*it);
        previous_match = it->is_match;
      }
      std::reverse(kept.begin(), kept.end());
      break;
    case SplitBehavior::Contiguous:
      for (const Span& s : spans) {
        if (s.is_match == previous_match && !kept.empty()) kept.back().end = s.end;
        else kept.push_back(s);
        previous_match = s.is_match;
      }
      break;
  }
  for (const Span& s : kept)
    if (s.end > s.start)
      out.push_back({piece.text.substr(s.start, s.end - s.start), piece.at_text_start && s.start == 0});
}

std::string json_string(const json& j, const char* key, const std::string& where) {
  KVCC_REQUIRE(j.contains(key) && j[key].is_string(), where + ": missing string field \"" + key + "\"");
  return j[key].get<std::string>();
}

// ---- normalizer ----------------------------------------------------------------------------

struct NormalizerStep {
  enum Kind { Prepend, ReplaceLiteral, ReplaceRegex, NFC, NFKC, NFD, NFKD } kind;
  std::string text;     // Prepend: what is prepended; Replace: the literal pattern
  std::string content;  // Replace: the replacement
  std::shared_ptr<Regex> regex;
};

void parse_normalizer(const json& j, std::vector<NormalizerStep>& steps) {
  if (j.is_null()) return;
  const std::string type = json_string(j, "type", "tokenizer.json normalizer");
  if (type == "Sequence") {
    for (const json& sub : j.at("normalizers")) parse_normalizer(sub, steps);
  } else if (type == "Prepend") {
    steps.push_back({NormalizerStep::Prepend, json_string(j, "prepend", "Prepend normalizer"), "", nullptr});
  } else if (type == "Replace") {
    const json& pattern = j.at("pattern");
    const std::string content = json_string(j, "content", "Replace normalizer");
    if (pattern.contains("String")) {
      steps.push_back({NormalizerStep::ReplaceLiteral, pattern["String"].get<std::string>(), content, nullptr});
    } else {
      auto regex = std::make_shared<Regex>(pattern.at("Regex").get<std::string>(), false, "Replace normalizer");
      steps.push_back({NormalizerStep::ReplaceRegex, "", content, regex});
    }
  } else if (type == "NFC" || type == "NFKC" || type == "NFD" || type == "NFKD") {
    const auto kind = type == "NFC"    ? NormalizerStep::NFC
                      : type == "NFKC" ? NormalizerStep::NFKC
                      : type == "NFD"  ? NormalizerStep::NFD
                                       : NormalizerStep::NFKD;
    steps.push_back({kind, "", "", nullptr});
  } else {
    throw Error("tokenizer.json uses the normalizer \"" + type + "\", which kvcc does not support");
  }
}

// Unicode normalization form `kind` of valid UTF-8 text.
std::string unicode_normalize(const std::string& text, NormalizerStep::Kind kind) {
  // Every normalization form leaves ASCII unchanged.
  if (std::all_of(text.begin(), text.end(), [](char c) { return static_cast<unsigned char>(c) < 0x80; })) return text;
#ifdef KVCC_HAVE_ICU
  UErrorCode status = U_ZERO_ERROR;
  const UNormalizer2* normalizer = kind == NormalizerStep::NFC    ? unorm2_getNFCInstance(&status)
                                   : kind == NormalizerStep::NFKC ? unorm2_getNFKCInstance(&status)
                                   : kind == NormalizerStep::NFD  ? unorm2_getNFDInstance(&status)
                                                                  : unorm2_getNFKDInstance(&status);
  // UTF-8 -> UTF-16 -> normalized UTF-16 -> UTF-8; decomposition grows text at most 18-fold per
  // character, but real text far less, so the buffers grow on demand.
  int32_t utf16_length = 0;
  std::vector<UChar> utf16(text.size() + 1);
  u_strFromUTF8(utf16.data(), static_cast<int32_t>(utf16.size()), &utf16_length, text.data(),
                static_cast<int32_t>(text.size()), &status);
  std::vector<UChar> normalized(utf16_length * 2 + 16);
  int32_t normalized_length = unorm2_normalize(normalizer, utf16.data(), utf16_length, normalized.data(),
                                               static_cast<int32_t>(normalized.size()), &status);
  if (status == U_BUFFER_OVERFLOW_ERROR) {
    status = U_ZERO_ERROR;
    normalized.resize(normalized_length + 1);
    normalized_length = unorm2_normalize(normalizer, utf16.data(), utf16_length, normalized.data(),
                                         static_cast<int32_t>(normalized.size()), &status);
  }
  std::string out(static_cast<size_t>(normalized_length) * 3 + 1, '\0');
  int32_t out_length = 0;
  if (U_SUCCESS(status))
    u_strToUTF8(out.data(), static_cast<int32_t>(out.size()), &out_length, normalized.data(), normalized_length,
                &status);
  KVCC_REQUIRE(U_SUCCESS(status), std::string("Unicode normalization failed: ") + u_errorName(status));
  out.resize(out_length);
  return out;
#else
  (void)kind;
  throw Error("this tokenizer's Unicode normalizer needs kvcc built with ICU (libicu-dev) for non-ASCII text");
#endif
}

void normalize(const std::vector<NormalizerStep>& steps, std::string& text) {
  for (const NormalizerStep& step : steps) {
    switch (step.kind) {
      case NormalizerStep::Prepend:
        if (!text.empty()) text.insert(0, step.text);
        break;
      case NormalizerStep::ReplaceLiteral:
        replace_all(text, step.text, step.content);
        break;
      case NormalizerStep::ReplaceRegex: {
        std::string out;
        size_t previous_end = 0;
        step.regex->for_each_match(text, [&](size_t start, size_t end) {
          out.append(text, previous_end, start - previous_end);
          out.append(step.content);
          previous_end = end;
        });
        out.append(text, previous_end, std::string::npos);
        text = std::move(out);
        break;
      }
      case NormalizerStep::NFC:
      case NormalizerStep::NFKC:
      case NormalizerStep::NFD:
      case NormalizerStep::NFKD:
        text = unicode_normalize(text, step.kind);
        break;
    }
  }
}

// ---- pre-tokenizer -------------------------------------------------------------------------

// GPT-2's pre-split, used by ByteLevel when use_regex is true.
constexpr const char* kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

struct PreTokenizerStep {
  enum Kind { Split, Metaspace } kind = Split;
  std::shared_ptr<Regex> regex;  // Split; Metaspace when it splits (on the replacement)
  SplitBehavior behavior = SplitBehavior::Isolated;
  bool invert = false;
  std::string replacement;                                 // Metaspace
  enum Prepend { Always, First, Never } prepend = Always;  // Metaspace
};

struct PreTokenizer {
  std::vector<PreTokenizerStep> steps;
  bool byte_level = false;  // map bytes to GPT-2's printable characters after all steps
  bool byte_level_prefix_space = false;
  std::shared_ptr<Regex> byte_level_regex;  // null unless ByteLevel's use_regex
  bool metaspace = false;
};

void parse_pre_tokenizer(const json& j, PreTokenizer& pre) {
  if (j.is_null()) return;
  const std::string type = json_string(j, "type", "tokenizer.json pre_tokenizer");
  // The byte mapping changes every character, so later splits would see different text; the
  // tokenizers that use ByteLevel put it last.
  KVCC_REQUIRE(!pre.byte_level, "tokenizer.json has a pre-tokenizer after ByteLevel, which kvcc does not support");
  if (type == "Sequence") {
    for (const json& sub : j.at("pretokenizers")) parse_pre_tokenizer(sub, pre);
  } else if (type == "Split") {
    const json& pattern = j.at("pattern");
    PreTokenizerStep step;
    step.kind = PreTokenizerStep::Split;
    if (pattern.contains("String"))
      step.regex = std::make_shared<Regex>(pattern["String"].get<std::string>(), true, "Split pre-tokenizer");
    else step.regex = std::make_shared<Regex>(pattern.at("Regex").get<std::string>(), false, "Split pre-tokenizer");
    step.behavior = split_behavior_from_name(json_string(j, "behavior", "Split pre-tokenizer"));
    step.invert = j.value("invert", false);
    pre.steps.push_back(std::move(step));
  } else if (type == "Metaspace") {
    PreTokenizerStep step;
    step.kind = PreTokenizerStep::Metaspace;
    step.replacement = json_string(j, "replacement", "Metaspace pre-tokenizer");
    if (j.contains("prepend_scheme")) {
      const std::string scheme = j["prepend_scheme"].get<std::string>();
      step.prepend = scheme == "always"  ? PreTokenizerStep::Always
                     : scheme == "first" ? PreTokenizerStep::First
                     : scheme == "never" ? PreTokenizerStep::Never
                                         : throw Error("Metaspace prepend_scheme \"" + scheme + "\" is unknown");
    } else {
      step.prepend = j.value("add_prefix_space", true) ? PreTokenizerStep::Always : PreTokenizerStep::Never;
    }
    if (j.value("split", true)) {
      step.regex = std::make_shared<Regex>(step.replacement, true, "Metaspace pre-tokenizer");
      step.behavior = SplitBehavior::MergedWithNext;
    }
    pre.steps.push_back(std::move(step));
    pre.metaspace = true;
  } else if (type == "ByteLevel") {
    pre.byte_level = true;
    pre.byte_level_prefix_space = j.value("add_prefix_space", false);
    if (j.value("use_regex", true)) pre.byte_level_regex = std::make_shared<Regex>(kGpt2Pattern, false, "ByteLevel");
  } else {
    throw Error("tokenizer.json uses the pre-tokenizer \"" + type + "\", which kvcc does not support");
  }
}

void pre_tokenize(const PreTokenizer& pre, Piece segment, std::vector<Piece>& out) {
  std::vector<Piece> pieces{std::move(segment)}, next;
  for (const PreTokenizerStep& step : pre.steps) {
    next.clear();
    for (Piece& piece : pieces) {
      if (step.kind == PreTokenizerStep::Metaspace) {
        replace_all(piece.text, " ", step.replacement);
        const bool prepend = step.prepend == PreTokenizerStep::Always ||
                             (step.prepend == PreTokenizerStep::First && piece.at_text_start);
        if (prepend && !piece.text.starts_with(step.replacement)) piece.text.insert(0, step.replacement);
        if (!step.regex) {
          next.push_back(std::move(piece));
          continue;
        }
      }
      split_piece(piece, *step.regex, step.behavior, step.invert, next);
    }
    std::swap(pieces, next);
  }
  if (!pre.byte_level) {
    for (Piece& piece : pieces) out.push_back(std::move(piece));
    return;
  }
  next.clear();
  for (Piece& piece : pieces) {
    if (pre.byte_level_prefix_space && !piece.text.starts_with(' ')) piece.text = ' ' + piece.text;
    if (pre.byte_level_regex) split_piece(piece, *pre.byte_level_regex, SplitBehavior::Isolated, false, next);
    else next.push_back(std::move(piece));
  }
  const auto& table = byte_level_table();
  for (Piece& piece : next) {
    std::string mapped;
    mapped.reserve(piece.text.size() * 2);
    for (unsigned char b : piece.text) mapped += table.byte_to_utf8[b];
    out.push_back({std::move(mapped), piece.at_text_start});
  }
}

// ---- decoder -------------------------------------------------------------------------------

struct DecoderStep {
  enum Kind { Replace, ByteFallback, Fuse, Strip, ByteLevel, Metaspace } kind;
  std::string pattern, content;  // Replace; Strip's content; Metaspace's replacement
  int strip_start = 0, strip_stop = 0;
  bool metaspace_strip_first = true;

  explicit DecoderStep(Kind k, std::string p = "", std::string c = "")
      : kind(k), pattern(std::move(p)), content(std::move(c)) {}
};

void parse_decoder(const json& j, std::vector<DecoderStep>& steps) {
  if (j.is_null()) return;
  const std::string type = json_string(j, "type", "tokenizer.json decoder");
  if (type == "Sequence") {
    for (const json& sub : j.at("decoders")) parse_decoder(sub, steps);
  } else if (type == "Replace") {
    const json& pattern = j.at("pattern");
    KVCC_REQUIRE(pattern.contains("String"), "tokenizer.json: a Replace decoder with a regex is not supported");
    steps.push_back(
        DecoderStep{DecoderStep::Replace, pattern["String"].get<std::string>(), json_string(j, "content", "Replace")});
  } else if (type == "ByteFallback") {
    steps.push_back(DecoderStep{DecoderStep::ByteFallback});
  } else if (type == "Fuse") {
    steps.push_back(DecoderStep{DecoderStep::Fuse});
  } else if (type == "Strip") {
    DecoderStep step{DecoderStep::Strip, "", json_string(j, "content", "Strip decoder")};
    step.strip_start = j.value("start", 0);
    step.strip_stop = j.value("stop", 0);
    steps.push_back(step);
  } else if (type == "ByteLevel") {
    steps.push_back(DecoderStep{DecoderStep::ByteLevel});
  } else if (type == "Metaspace") {
    DecoderStep step{DecoderStep::Metaspace, "", json_string(j, "replacement", "Metaspace decoder")};
    if (j.contains("prepend_scheme")) step.metaspace_strip_first = j["prepend_scheme"].get<std::string>() != "never";
    else step.metaspace_strip_first = j.value("add_prefix_space", true);
    steps.push_back(step);
  } else {
    throw Error("tokenizer.json uses the decoder \"" + type + "\", which kvcc does not support");
  }
}

// "<0xAB>" -> 0xAB, or -1.
int byte_fallback_value(std::string_view token) {
  if (token.size() != 6 || !token.starts_with("<0x") || token[5] != '>') return -1;
  int value = 0;
  for (char c : token.substr(3, 2)) {
    const int digit = c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
    if (digit < 0) return -1;
    value = value * 16 + digit;
  }
  return value;
}

void run_decoder(const std::vector<DecoderStep>& steps, std::vector<std::string>& tokens) {
  for (const DecoderStep& step : steps) {
    switch (step.kind) {
      case DecoderStep::Replace:
        for (std::string& t : tokens) replace_all(t, step.pattern, step.content);
        break;
      case DecoderStep::ByteFallback: {
        // Runs of <0xXX> tokens become their bytes. (The library replaces a run that is not valid
        // UTF-8 by U+FFFD per byte; kvcc keeps the raw bytes so partial decodes concatenate.)
        std::vector<std::string> out;
        std::string bytes;
        bool in_run = false;
        for (std::string& t : tokens) {
          const int value = byte_fallback_value(t);
          if (value >= 0) {
            bytes.push_back(static_cast<char>(value));
            in_run = true;
            continue;
          }
          if (in_run) out.push_back(std::move(bytes)), bytes.clear(), in_run = false;
          out.push_back(std::move(t));
        }
        if (in_run) out.push_back(std::move(bytes));
        tokens = std::move(out);
        break;
      }
      case DecoderStep::Fuse: {
        std::string all;
        for (const std::string& t : tokens) all += t;
        tokens.assign(1, std::move(all));
        break;
      }
      case DecoderStep::Strip:
        for (std::string& t : tokens) {
          int start = 0;
          while (start < step.strip_start &&
                 t.compare(start * step.content.size(), step.content.size(), step.content) == 0)
            ++start;
          t.erase(0, start * step.content.size());
          for (int stop = 0; stop < step.strip_stop && t.ends_with(step.content); ++stop)
            t.erase(t.size() - step.content.size());
        }
        break;
      case DecoderStep::ByteLevel: {
        const auto& table = byte_level_table();
        for (std::string& t : tokens) {
          std::string bytes;
          bool all_mapped = true;
          for (size_t i = 0; i < t.size() && all_mapped;) {
            auto it = table.codepoint_to_byte.find(next_codepoint(t, i));
            if (it == table.codepoint_to_byte.end()) all_mapped = false;
            else bytes.push_back(static_cast<char>(it->second));
          }
          if (all_mapped) t = std::move(bytes);  // a token outside the table (an added token) stays as is
        }
        break;
      }
      case DecoderStep::Metaspace:
        for (size_t i = 0; i < tokens.size(); ++i) {
          replace_all(tokens[i], step.content, " ");
          if (i == 0 && step.metaspace_strip_first && tokens[i].starts_with(' ')) tokens[i].erase(0, 1);
        }
        break;
    }
  }
}

// ---- added tokens --------------------------------------------------------------------------

struct AddedToken {
  int32_t id;
  std::string content;
  bool special, normalized, lstrip, rstrip;
};

// Finds added tokens in text, leftmost-longest, as the library's Aho-Corasick matcher does.
class AddedTokenMatcher {
 public:
  void add(std::string pattern, const AddedToken* token) {
    if (pattern.empty()) return;
    by_first_byte_[static_cast<unsigned char>(pattern[0])].push_back({std::move(pattern), token});
  }
  void finish() {
    for (auto& list : by_first_byte_)
      std::stable_sort(list.begin(), list.end(),
                       [](const Entry& a, const Entry& b) { return a.pattern.size() > b.pattern.size(); });
  }

  // Appends to `out` the text between matches as pieces and the matched tokens' ids.
  struct Segment {
    Piece piece;
    int32_t token_id;  // -1: piece holds text
  };
  void split(Piece text, std::vector<Segment>& out) const {
    const std::string& s = text.text;
    size_t piece_start = 0;
    for (size_t i = 0; i < s.size(); ++i) {
      const auto& candidates = by_first_byte_[static_cast<unsigned char>(s[i])];
      const Entry* hit = nullptr;
      for (const Entry& e : candidates)
        if (s.compare(i, e.pattern.size(), e.pattern) == 0) {
          hit = &e;
          break;
        }
      if (!hit) continue;
      size_t match_start = i, match_end = i + hit->pattern.size();
      if (hit->token->lstrip)
        for (size_t n; match_start > piece_start && (n = space_before(s, match_start)) > 0;) match_start -= n;
      if (hit->token->rstrip)
        for (size_t n; match_end < s.size() && (n = space_at(s, match_end)) > 0;) match_end += n;
      if (match_start > piece_start)
        out.push_back({{s.substr(piece_start, match_start - piece_start), text.at_text_start && piece_start == 0}, -1});
      out.push_back({{"", false}, hit->token->id});
      piece_start = match_end;
      i = match_end - 1;
    }
    if (piece_start < s.size()) out.push_back({{s.substr(piece_start), text.at_text_start && piece_start == 0}, -1});
  }

 private:
  struct Entry {
    std::string pattern;
    const AddedToken* token;
  };
  std::array<std::vector<Entry>, 256> by_first_byte_;
};

// ---- the tokenizer -------------------------------------------------------------------------

class HfBpeTokenizer final : public Tokenizer {
 public:
  explicit HfBpeTokenizer(const std::string& path) {
    std::ifstream in(path);
    KVCC_REQUIRE(in.good(), "cannot open tokenizer " + path);
    json root;
    try {
      root = json::parse(in);
    } catch (const json::exception& e) {
      throw Error("tokenizer " + path + " is not valid JSON: " + e.what());
    }
    try {
      load(root);
    } catch (const json::exception& e) {
      throw Error("tokenizer " + path + " is malformed: " + e.what());
    } catch (const Error& e) {
      throw Error("tokenizer " + path + ": " + e.what());
    }
    load_eos(std::filesystem::path(path).parent_path() / "tokenizer_config.json");
  }

  std::vector<int32_t> encode(const std::string& text, bool add_bos) const override {
    require_valid_utf8(text, "text to tokenize");
    std::vector<int32_t> ids;
    if (add_bos) ids = bos_prefix_;
    std::vector<AddedTokenMatcher::Segment> raw_segments, segments;
    raw_matcher_.split({text, true}, raw_segments);
    for (auto& raw : raw_segments) {
      if (raw.token_id >= 0) {
        segments.push_back(std::move(raw));
        continue;
      }
      normalize(normalizer_, raw.piece.text);
      normalized_matcher_.split(std::move(raw.piece), segments);
    }
    std::vector<Piece> pieces;
    for (auto& segment : segments) {
      if (segment.token_id >= 0) {
        ids.push_back(segment.token_id);
        continue;
      }
      pieces.clear();
      pre_tokenize(pre_tokenizer_, std::move(segment.piece), pieces);
      for (const Piece& piece : pieces) encode_word(piece.text, ids);
    }
    return ids;
  }

  std::string decode(const std::vector<int32_t>& ids) const override {
    std::vector<std::string> tokens;
    tokens.reserve(ids.size());
    for (int32_t id : ids) {
      KVCC_REQUIRE(id >= 0 && id < vocab_size(),
                   "token id " + std::to_string(id) + " is outside the vocabulary of " + std::to_string(vocab_size()));
      if (is_special_[id]) continue;  // as the library's decode(skip_special_tokens=True)
      tokens.push_back(id_to_token_[id]);
    }
    run_decoder(decoder_, tokens);
    std::string text;
    for (const std::string& t : tokens) text += t;
    return text;
  }

  int vocab_size() const override { return static_cast<int>(id_to_token_.size()); }
  int bos_id() const override { return bos_prefix_.empty() ? -1 : bos_prefix_.front(); }
  int eos_id() const override { return eos_id_; }
  std::string kind() const override {
    if (pre_tokenizer_.byte_level) return "tokenizer.json (byte-level BPE)";
    if (pre_tokenizer_.metaspace || metaspace_normalizer_) return "tokenizer.json (metaspace BPE)";
    return "tokenizer.json (BPE)";
  }

 private:
  void load(const json& root) {
    const json& model = root.at("model");
    const std::string type = model.value("type", "BPE");
    KVCC_REQUIRE(type == "BPE", "the model type is \"" + type + "\"; kvcc supports BPE tokenizers only");
    for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
      KVCC_REQUIRE(!model.contains(key) || model[key].is_null() || model[key] == "",
                   std::string("BPE ") + key + " is not supported");

    for (const auto& [token, id] : model.at("vocab").items()) {
      const int32_t value = json_int32(id, "model.vocab: the id of \"" + token + "\"", 0);
      vocab_.emplace(token, value);
      set_token(value, token);
    }
    KVCC_REQUIRE(!vocab_.empty(), "the BPE vocabulary is empty");
    const json& merges = model.at("merges");
    for (size_t rank = 0; rank < merges.size(); ++rank) {
      std::string left, right;
      if (merges[rank].is_array()) {
        left = merges[rank].at(0).get<std::string>();
        right = merges[rank].at(1).get<std::string>();
      } else {
        const std::string merge = merges[rank].get<std::string>();
        const size_t space = merge.find(' ');
        KVCC_REQUIRE(space != std::string::npos && merge.find(' ', space + 1) == std::string::npos,
                     "merge " + std::to_string(rank) + " \"" + merge + "\" is not two tokens separated by a space");
        left = merge.substr(0, space);
        right = merge.substr(space + 1);
      }
      const int32_t left_id = vocab_id(left, rank), right_id = vocab_id(right, rank);
      const int32_t merged_id = vocab_id(left + right, rank);
      merges_.insert_or_assign(pair_key(left_id, right_id), MergeResult{static_cast<double>(rank), merged_id});
    }
    byte_fallback_ = model.value("byte_fallback", false);
    fuse_unk_ = model.value("fuse_unk", false);
    ignore_merges_ = model.value("ignore_merges", false);
    if (model.contains("unk_token") && model["unk_token"].is_string()) {
      auto it = vocab_.find(model["unk_token"].get<std::string>());
      KVCC_REQUIRE(it != vocab_.end(), "the unk_token is not in the vocabulary");
      unk_id_ = it->second;
    }
    for (int b = 0; b < 256; ++b) {
      char name[8];
      std::snprintf(name, sizeof name, "<0x%02X>", b);
      auto it = vocab_.find(std::string_view(name));
      byte_ids_[b] = it == vocab_.end() ? -1 : it->second;
    }

    parse_normalizer(root.value("normalizer", json()), normalizer_);
    for (const NormalizerStep& step : normalizer_)
      if (step.content == "\u2581" || step.text == "\u2581") metaspace_normalizer_ = true;
    parse_pre_tokenizer(root.value("pre_tokenizer", json()), pre_tokenizer_);
    parse_decoder(root.value("decoder", json()), decoder_);

    if (root.contains("added_tokens")) {
      for (const json& t : root["added_tokens"]) {
        KVCC_REQUIRE(!t.value("single_word", false),
                     "added token \"" + t.value("content", "") + "\" is single_word, which kvcc does not support");
        added_.push_back({json_int32(t.at("id"), "added_tokens: the id of \"" + t.value("content", "") + "\"", 0),
                          t.at("content").get<std::string>(), t.value("special", false), t.value("normalized", true),
                          t.value("lstrip", false), t.value("rstrip", false)});
      }
    }
    is_special_.assign(id_to_token_.size(), false);
    for (const AddedToken& t : added_) {
      KVCC_REQUIRE(t.id >= 0, "added token \"" + t.content + "\" has a negative id");
      set_token(t.id, t.content);
      is_special_.resize(id_to_token_.size(), false);
      if (t.special) is_special_[t.id] = true;
    }
    // Normalized added tokens are matched after the normalizer ran, as their normalized form.
    for (const AddedToken& t : added_) {
      if (t.normalized) {
        std::string pattern = t.content;
        normalize(normalizer_, pattern);
        normalized_matcher_.add(std::move(pattern), &t);
      } else {
        raw_matcher_.add(t.content, &t);
      }
    }
    raw_matcher_.finish();
    normalized_matcher_.finish();
    for (size_t id = 0; id < id_to_token_.size(); ++id)
      KVCC_REQUIRE(has_token_[id], "token id " + std::to_string(id) + " has no token (the ids have a gap)");

    parse_post_processor(root.value("post_processor", json()));
  }

  void parse_post_processor(const json& j) {
    if (j.is_null()) return;
    const std::string type = json_string(j, "type", "tokenizer.json post_processor");
    if (type == "Sequence") {
      for (const json& sub : j.at("processors")) parse_post_processor(sub);
    } else if (type == "TemplateProcessing") {
      // The special tokens before $A form the BOS prefix; any after it (EOS) are not added, as
      // kvcc never appends EOS to a document.
      for (const json& item : j.at("single")) {
        if (item.contains("Sequence")) break;
        const std::string name = item.at("SpecialToken").at("id").get<std::string>();
        KVCC_REQUIRE(j.at("special_tokens").contains(name),
                     "the template's special token \"" + name + "\" is not defined");
        for (const json& id : j["special_tokens"][name].at("ids")) {
          const int32_t value = json_int32(id, "post_processor: an id of special token \"" + name + "\"");
          KVCC_REQUIRE(value >= 0 && value < vocab_size(), "the template's special token \"" + name + "\" has id " +
                                                               std::to_string(value) + ", outside the vocabulary");
          bos_prefix_.push_back(value);
        }
      }
    } else if (type != "ByteLevel") {  // ByteLevel only adjusts offsets
      throw Error("the post-processor \"" + type + "\" is not supported");
    }
  }

  void load_eos(const std::filesystem::path& config_path) {
    std::ifstream in(config_path);
    if (!in.good()) return;  // tokenizer.json alone does not name EOS
    const json config = json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (!config.is_object() || !config.contains("eos_token")) return;
    const json& eos = config["eos_token"];
    const std::string name = eos.is_string()                              ? eos.get<std::string>()
                             : eos.is_object() && eos.contains("content") ? eos["content"].get<std::string>()
                                                                          : std::string();
    for (const AddedToken& t : added_)
      if (t.content == name) eos_id_ = t.id;
    if (eos_id_ < 0)
      if (auto it = vocab_.find(name); it != vocab_.end()) eos_id_ = it->second;
  }

  void set_token(int32_t id, const std::string& token) {
    if (static_cast<size_t>(id) >= id_to_token_.size()) {
      id_to_token_.resize(id + 1);
      has_token_.resize(id + 1, false);
    }
    id_to_token_[id] = token;
    has_token_[id] = true;
  }

  int32_t vocab_id(const std::string& token, size_t rank) const {
    auto it = vocab_.find(token);
    KVCC_REQUIRE(it != vocab_.end(),
                 "merge " + std::to_string(rank) + " uses \"" + token + "\", which is not in the vocabulary");
    return it->second;
  }

  static uint64_t pair_key(int32_t left, int32_t right) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
  }

  // BPE of one pre-tokenized word, appended to ids. Short words are cached: natural text repeats
  // them, and the cache makes a 2 MB text a matter of a second.
  void encode_word(const std::string& word, std::vector<int32_t>& ids) const {
    constexpr size_t kMaxCachedWordBytes = 64;
    constexpr size_t kMaxCacheEntries = 1 << 20;
    const bool cacheable = word.size() <= kMaxCachedWordBytes;
    if (cacheable) {
      std::lock_guard lock(cache_mutex_);
      if (auto it = cache_.find(word); it != cache_.end()) {
        ids.insert(ids.end(), it->second.begin(), it->second.end());
        return;
      }
    }
    std::vector<int32_t> word_ids = bpe_word(word);
    ids.insert(ids.end(), word_ids.begin(), word_ids.end());
    if (cacheable) {
      std::lock_guard lock(cache_mutex_);
      if (cache_.size() >= kMaxCacheEntries) cache_.clear();
      cache_.emplace(word, std::move(word_ids));
    }
  }

  std::vector<int32_t> bpe_word(const std::string& word) const {
    if (ignore_merges_)
      if (auto it = vocab_.find(word); it != vocab_.end()) return {it->second};
    // One symbol per character; unknown characters become their <0xXX> bytes or <unk> exactly as
    // the library orders them (a pending <unk> is flushed only by the next known character).
    std::vector<int32_t> symbols;
    bool unk_pending = false;
    for (size_t i = 0; i < word.size();) {
      const size_t len = std::min<size_t>(utf8_char_length(static_cast<unsigned char>(word[i])), word.size() - i);
      const std::string_view character(word.data() + i, len);
      i += len;
      if (auto it = vocab_.find(character); it != vocab_.end()) {
        if (unk_pending) symbols.push_back(unk_id_), unk_pending = false;
        symbols.push_back(it->second);
        continue;
      }
      if (byte_fallback_) {
        bool all_bytes = true;
        for (unsigned char b : character) all_bytes = all_bytes && byte_ids_[b] >= 0;
        if (all_bytes) {
          for (unsigned char b : character) symbols.push_back(byte_ids_[b]);
          continue;
        }
      }
      if (unk_id_ < 0) continue;  // the library drops a character it cannot represent
      if (unk_pending && !fuse_unk_) symbols.push_back(unk_id_);
      unk_pending = true;
    }
    if (unk_pending) symbols.push_back(unk_id_);
    return bpe_merge(symbols, [this](int32_t left, int32_t right) -> std::optional<MergeResult> {
      auto it = merges_.find(pair_key(left, right));
      if (it == merges_.end()) return std::nullopt;
      return it->second;
    });
  }

  TokenMap vocab_;
  std::vector<std::string> id_to_token_;
  std::vector<bool> has_token_;
  std::vector<bool> is_special_;
  std::unordered_map<uint64_t, MergeResult> merges_;
  std::array<int32_t, 256> byte_ids_{};
  bool byte_fallback_ = false, fuse_unk_ = false, ignore_merges_ = false;
  int32_t unk_id_ = -1;
  std::vector<NormalizerStep> normalizer_;
  bool metaspace_normalizer_ = false;
  PreTokenizer pre_tokenizer_;
  std::vector<DecoderStep> decoder_;
  std::vector<AddedToken> added_;  // stable: the matchers point into it
  AddedTokenMatcher raw_matcher_, normalized_matcher_;
  std::vector<int32_t> bos_prefix_;
  int32_t eos_id_ = -1;

  mutable std::mutex cache_mutex_;
  mutable std::unordered_map<std::string, std::vector<int32_t>, StringHash, std::equal_to<>> cache_;
};

}  // namespace

std::unique_ptr<Tokenizer> load_hf_tokenizer(const std::string& path) { return std::make_unique<HfBpeTokenizer>(path); }

}  // namespace kvcc::detail
