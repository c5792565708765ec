// Tokenizers against independent implementations: the Hugging Face `tokenizers` library (for
// tokenizer.json) and a Python re-derivation of llama2.c's encode (for tokenizer.bin), whose ids
// tests/reference/make_tokenizer_refs.py stored in tests/data/tokenizer/.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>
#include <unistd.h>

#include "formats/error.h"
#include "formats/sha256.h"
#include "model/tokenizer.h"

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

const std::string kShared = KVCC_SHARED_DIR;
const std::string kRefs = std::string(KVCC_SOURCE_DIR) + "/tests/data/tokenizer/";
const std::string kTinyStoriesModel = kShared + "/models/tinystories-656k";
const std::string kGutenbergModel = kShared + "/models/gutenberg-27m";
const std::string kStories260kModel = kShared + "/models/stories260k/stories260K.bin";
const std::string kStories260kTokenizer = kShared + "/models/stories260k/tok512.bin";

#define SKIP_WITHOUT_SHARED() \
  if (!fs::exists(kShared + "/models")) GTEST_SKIP() << "no ../shared/models (real models and text) here"

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << path;
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void write_file(const fs::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out << bytes;
}

json read_json(const std::string& path) { return json::parse(read_file(path)); }

std::string ids_sha256(const std::vector<int32_t>& ids) {
  // The reference hashes the ids as little-endian int32 (x86 byte order).
  return kvcc::sha256_hex(ids.data(), ids.size() * sizeof(int32_t));
}

// A fresh directory under the system temp dir, removed at the end of the test.
struct TempDir {
  fs::path path;
  TempDir() {
    const auto* info = testing::UnitTest::GetInstance()->current_test_info();
    path = fs::temp_directory_path() /
           ("kvcc_tok_" + std::string(info->test_suite_name()) + "_" + info->name() + "_" + std::to_string(::getpid()));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
};

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const kvcc::Error& e) {
    return e.what();
  }
  return "(no error)";
}

// Every document of `text_name` against the per-document count and sha256 of the reference.
void expect_matches_reference(const kvcc::Tokenizer& tok, const std::string& ref_name, double* seconds = nullptr) {
  const json ref = read_json(kRefs + ref_name);
  const auto docs = kvcc::split_documents(read_file(kShared + "/" + ref["text"].get<std::string>()));
  ASSERT_EQ(docs.size(), ref["documents"].size()) << "split_documents disagrees with the reference's splitting";
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::vector<int32_t>> all_ids;
  for (const auto& doc : docs) all_ids.push_back(tok.encode(doc, ref["add_bos"].get<bool>()));
  if (seconds) *seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  int mismatches = 0;
  for (size_t d = 0; d < docs.size(); ++d) {
    const json& expected = ref["documents"][d];
    const bool same = static_cast<int64_t>(all_ids[d].size()) == expected["count"].get<int64_t>() &&
                      ids_sha256(all_ids[d]) == expected["sha256"].get<std::string>();
    if (!same && ++mismatches <= 5)
      ADD_FAILURE() << ref_name << " document " << d << ": " << all_ids[d].size() << " ids vs " << expected["count"];
  }
  EXPECT_EQ(mismatches, 0);
  for (size_t d = 0; d < ref["first_ids"].size(); ++d)
    EXPECT_EQ(all_ids[d], ref["first_ids"][d].get<std::vector<int32_t>>()) << ref_name << " document " << d;
}

void expect_cases(const kvcc::Tokenizer& tok, const json& cases, const std::string& name) {
  for (const json& c : cases) {
    const std::string text = c["text"];
    SCOPED_TRACE(name + " text \"" + text + "\"");
    const auto ids = tok.encode(text, false);
    EXPECT_EQ(ids, c["ids"].get<std::vector<int32_t>>());
    EXPECT_EQ(tok.encode(text, true), c["ids_bos"].get<std::vector<int32_t>>());
    // The library's decode of special tokens is not compared (see make_tokenizer_refs.py).
    if (!c["decoded"].is_null()) {
      EXPECT_EQ(tok.decode(ids), c["decoded"].get<std::string>());
    }
  }
}

}  // namespace

TEST(Tokenizer, TinyStories656kMatchesTokenizersLibraryOnEveryDocument) {
  SKIP_WITHOUT_SHARED();
  auto tok = kvcc::Tokenizer::from_file(kTinyStoriesModel + "/tokenizer.json");
  EXPECT_EQ(tok->vocab_size(), 2048);
  EXPECT_EQ(tok->bos_id(), 1);  // <|start_story|>, from the TemplateProcessing post-processor
  EXPECT_EQ(tok->eos_id(), 2);  // <|end_story|>, from tokenizer_config.json
  EXPECT_EQ(tok->kind(), "tokenizer.json (metaspace BPE)");
  expect_matches_reference(*tok, "tinystories-656k.json");
}

TEST(Tokenizer, Gutenberg27mMatchesTokenizersLibraryOnEveryDocumentAndIsFast) {
  SKIP_WITHOUT_SHARED();
  auto tok = kvcc::Tokenizer::from_file(kGutenbergModel + "/tokenizer.json");
  EXPECT_EQ(tok->vocab_size(), 4096);
  EXPECT_EQ(tok->bos_id(), 0);  // <|begin_of_text|>
  EXPECT_EQ(tok->eos_id(), 1);  // <|end_of_text|>
  EXPECT_EQ(tok->kind(), "tokenizer.json (byte-level BPE)");
  double seconds = 0;
  expect_matches_reference(*tok, "gutenberg-27m.json", &seconds);
  std::printf("gutenberg_heldout.txt (2.2 MB) tokenized in %.2f s\n", seconds);
  EXPECT_LT(seconds, 10.0) << "the 2.2 MB held-out text should tokenize in a few seconds";
}

TEST(Tokenizer, Stories260kMatchesPythonRederivationOfLlama2c) {
  SKIP_WITHOUT_SHARED();
  auto tok = kvcc::Tokenizer::from_file(kStories260kTokenizer);
  EXPECT_EQ(tok->vocab_size(), 512);
  EXPECT_EQ(tok->bos_id(), 1);
  EXPECT_EQ(tok->eos_id(), 2);
  EXPECT_EQ(tok->kind(), "llama2.c tokenizer.bin");
  const json ref = read_json(kRefs + "stories260k.json");
  const auto docs = kvcc::split_documents(read_file(kShared + "/" + ref["text"].get<std::string>()));
  ASSERT_GE(docs.size(), ref["first_ids"].size());
  for (size_t d = 0; d < ref["first_ids"].size(); ++d)
    EXPECT_EQ(tok->encode(docs[d], true), ref["first_ids"][d].get<std::vector<int32_t>>()) << "document " << d;
}

TEST(Tokenizer, EdgeCasesMatchReference) {
  SKIP_WITHOUT_SHARED();
  const json cases = read_json(kRefs + "cases.json");
  expect_cases(*kvcc::Tokenizer::from_file(kTinyStoriesModel + "/tokenizer.json"),
               cases["tokenizers"]["tinystories-656k"], "tinystories-656k");
  expect_cases(*kvcc::Tokenizer::from_file(kGutenbergModel + "/tokenizer.json"), cases["tokenizers"]["gutenberg-27m"],
               "gutenberg-27m");
  expect_cases(*kvcc::Tokenizer::from_file(kStories260kTokenizer), cases["tokenizers"]["stories260k"], "stories260k");
}

// tokenizer.json files patched as the reference script patched them, exercising the GPT-2
// ByteLevel regex with add_prefix_space, ignore_merges, lstrip/rstrip added tokens, every Split
// behavior and invert, NFC/NFKC normalizers, and the Metaspace pre-tokenizer and decoder.
TEST(Tokenizer, PatchedVariantsMatchReference) {
  SKIP_WITHOUT_SHARED();
  const json cases = read_json(kRefs + "cases.json");
  TempDir dir;
  for (const auto& [name, variant] : cases["variants"].items()) {
    json doc = read_json(kShared + "/models/" + variant["base"].get<std::string>() + "/tokenizer.json");
    for (const auto& [pointer, value] : variant["patches"].items()) doc[json::json_pointer(pointer)] = value;
    const fs::path path = dir.path / (name + ".json");
    write_file(path, doc.dump());
    auto tok = kvcc::Tokenizer::from_file(path.string());
    if (error_of([&] { tok->encode("\u00e9", false); }).find("needs kvcc built with ICU") != std::string::npos) {
      std::printf("skipping variant %s: kvcc was built without ICU\n", name.c_str());
      continue;
    }
    expect_cases(*tok, variant["cases"], name);
  }
}

TEST(Tokenizer, DecodeInvertsEncodeOnRealText) {
  SKIP_WITHOUT_SHARED();
  const auto stories = kvcc::split_documents(read_file(kShared + "/text/tinystories_valid_100.txt"));
  const auto books = kvcc::split_documents(read_file(kShared + "/text/gutenberg_heldout.txt"));
  auto gutenberg = kvcc::Tokenizer::from_file(kGutenbergModel + "/tokenizer.json");
  for (size_t d = 0; d < books.size(); d += 7)
    EXPECT_EQ(gutenberg->decode(gutenberg->encode(books[d], true)), books[d]);
  // llama2.c falls back to bytes, so any text survives, including the books' “curly quotes”.
  auto llama2c = kvcc::Tokenizer::from_file(kStories260kTokenizer);
  for (const auto& doc : stories) EXPECT_EQ(llama2c->decode(llama2c->encode(doc, true)), doc);
  for (size_t d = 0; d < books.size(); d += 29) EXPECT_EQ(llama2c->decode(llama2c->encode(books[d], true)), books[d]);
  // tinystories-656k has no byte tokens: characters outside its vocabulary become <unk> (id 0),
  // so only stories without them round-trip.
  auto tiny = kvcc::Tokenizer::from_file(kTinyStoriesModel + "/tokenizer.json");
  int round_trips = 0;
  for (const auto& doc : stories) {
    const auto ids = tiny->encode(doc, true);
    if (std::find(ids.begin(), ids.end(), 0) != ids.end()) continue;
    EXPECT_EQ(tiny->decode(ids), doc);
    ++round_trips;
  }
  EXPECT_GT(round_trips, 50);
}

// The word cache is shared by all encode calls; concurrent callers must get the serial result.
TEST(Tokenizer, ConcurrentEncodesAgreeWithSerial) {
  SKIP_WITHOUT_SHARED();
  auto tok = kvcc::Tokenizer::from_file(kGutenbergModel + "/tokenizer.json");
  const auto books = kvcc::split_documents(read_file(kShared + "/text/gutenberg_heldout.txt"));
  std::vector<std::vector<int32_t>> parallel(16);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      for (int d = t; d < 16; d += 4) parallel[d] = tok->encode(books[d], true);
    });
  for (auto& thread : threads) thread.join();
  auto fresh = kvcc::Tokenizer::from_file(kGutenbergModel + "/tokenizer.json");
  for (int d = 0; d < 16; ++d) EXPECT_EQ(parallel[d], fresh->encode(books[d], true)) << "document " << d;
}

TEST(Tokenizer, UnknownCharactersUseByteFallbackOrUnk) {
  SKIP_WITHOUT_SHARED();
  // llama2.c: an emoji is not in tok512, so its 4 UTF-8 bytes become <0xXX> at id byte + 3.
  auto llama2c = kvcc::Tokenizer::from_file(kStories260kTokenizer);
  const std::string emoji = "\xF0\x9F\x99\x82";
  const auto ids = llama2c->encode(emoji, false);
  ASSERT_EQ(ids.size(), 5u);  // the dummy-prefix space, then the four bytes
  for (int k = 0; k < 4; ++k) EXPECT_EQ(ids[1 + k], static_cast<unsigned char>(emoji[k]) + 3);
  EXPECT_EQ(llama2c->decode(ids), emoji);
  // byte-level BPE represents every byte.
  auto gutenberg = kvcc::Tokenizer::from_file(kGutenbergModel + "/tokenizer.json");
  EXPECT_EQ(gutenberg->decode(gutenberg->encode(emoji + " \x01\x7f", false)), emoji + " \x01\x7f");
  // tinystories-656k: no byte tokens, so the unknown character is one fused <unk>.
  auto tiny = kvcc::Tokenizer::from_file(kTinyStoriesModel + "/tokenizer.json");
  const auto tiny_ids = tiny->encode(emoji + emoji, false);
  EXPECT_EQ(std::count(tiny_ids.begin(), tiny_ids.end(), 0), 1);
}

TEST(Tokenizer, EmptyTextGivesNothingOrBos) {
  SKIP_WITHOUT_SHARED();
  for (const std::string& path :
       {kTinyStoriesModel + "/tokenizer.json", kGutenbergModel + "/tokenizer.json", kStories260kTokenizer}) {
    auto tok = kvcc::Tokenizer::from_file(path);
    EXPECT_TRUE(tok->encode("", false).empty()) << path;
    EXPECT_EQ(tok->encode("", true), std::vector<int32_t>{tok->bos_id()}) << path;
    EXPECT_EQ(tok->decode({}), "");
  }
}

// The --ids file format: what write_token_id_file writes, read_token_id_file reads back unchanged;
// encode_documents is split_documents then encode, document by document.
TEST(Tokenizer, TokenIdFilesRoundTripAndEncodeDocumentsSplitsFirst) {
  const std::vector<std::vector<int32_t>> docs = {{1, 2, 3}, {2147483647}, {0, 40, 7, 7, 99999}};
  const std::string path = (fs::temp_directory_path() / ("kvcc_ids_" + std::to_string(::getpid()) + ".txt")).string();
  kvcc::write_token_id_file(path, docs);
  EXPECT_EQ(kvcc::read_token_id_file(path), docs);
  std::ifstream in(path);
  std::string first;
  std::getline(in, first);
  EXPECT_EQ(first, "1 2 3");
  fs::remove(path);
  SKIP_WITHOUT_SHARED();
  auto tok = kvcc::Tokenizer::from_file(kTinyStoriesModel + "/tokenizer.json");
  const std::string text = "Once upon a time.\n<|endoftext|>\n  \n<|endoftext|>Tom ran home. ";
  const auto got = kvcc::encode_documents(*tok, text, "<|endoftext|>", true);
  ASSERT_EQ(got.size(), 2u);  // the whitespace-only document is dropped
  EXPECT_EQ(got[0], tok->encode("Once upon a time.", true));
  EXPECT_EQ(got[1], tok->encode("Tom ran home.", true));
}

TEST(Tokenizer, SpecialTokensAreMatchedBeforeSplittingAndSkippedWhenDecoding) {
  SKIP_WITHOUT_SHARED();
  auto tok = kvcc::Tokenizer::from_file(kGutenbergModel + "/tokenizer.json");
  const auto ids = tok->encode("<|begin_of_text|>Hi<|end_of_text|>", false);
  ASSERT_GE(ids.size(), 3u);
  EXPECT_EQ(ids.front(), 0);
  EXPECT_EQ(ids.back(), 1);
  EXPECT_EQ(tok->decode(ids), "Hi");
  EXPECT_THROW(tok->decode({4096}), kvcc::Error);
  EXPECT_THROW(tok->decode({-1}), kvcc::Error);
  EXPECT_NE(error_of([&] { tok->encode("bad \xC3 byte", false); }).find("not valid UTF-8 (byte offset 4)"),
            std::string::npos);
}

TEST(Tokenizer, ForModelFindsTheTokenizerAndRefusesAVocabularyMismatch) {
  SKIP_WITHOUT_SHARED();
  EXPECT_EQ(kvcc::Tokenizer::for_model(kStories260kModel, 512)->kind(), "llama2.c tokenizer.bin");
  EXPECT_EQ(kvcc::Tokenizer::for_model(kGutenbergModel, 4096)->vocab_size(), 4096);
  EXPECT_EQ(kvcc::Tokenizer::for_model(kGutenbergModel, 512, kStories260kTokenizer)->vocab_size(), 512);
  EXPECT_THROW(kvcc::Tokenizer::for_model(kStories260kModel, 512, kGutenbergModel + "/tokenizer.json"), kvcc::Error);
  EXPECT_EQ(error_of([] { kvcc::Tokenizer::for_model(kStories260kModel, 2048); }),
            "tokenizer has 512 tokens but the model's vocabulary is 2048");
  EXPECT_EQ(error_of([] { kvcc::Tokenizer::for_model(kTinyStoriesModel, 4096); }),
            "tokenizer has 2048 tokens but the model's vocabulary is 4096");
  // An embedding table padded by under 1% past the tokenizer (as Qwen's) is accepted.
  EXPECT_EQ(kvcc::Tokenizer::for_model(kGutenbergModel, 4128)->vocab_size(), 4096);
  EXPECT_THROW(kvcc::Tokenizer::for_model(kGutenbergModel, 4000), kvcc::Error);

  TempDir dir;
  EXPECT_NE(error_of([&] { kvcc::Tokenizer::for_model(dir.path.string(), 512); }).find("no tokenizer.json"),
            std::string::npos);
  EXPECT_NE(
      error_of([&] { kvcc::Tokenizer::for_model((dir.path / "missing.bin").string(), 512); }).find("does not exist"),
      std::string::npos);
  write_file(dir.path / "model.bin", "x");
  EXPECT_NE(
      error_of([&] { kvcc::Tokenizer::for_model((dir.path / "model.bin").string(), 512); }).find("no tokenizer.bin"),
      std::string::npos);
  // tokenizer.bin beside the checkpoint wins over tok*.bin.
  fs::copy_file(kStories260kTokenizer, dir.path / "tok512.bin");
  fs::copy_file(kStories260kTokenizer, dir.path / "tok999.bin");
  EXPECT_NE(
      error_of([&] { kvcc::Tokenizer::for_model((dir.path / "model.bin").string(), 1000); }).find("several tokenizers"),
      std::string::npos);
  EXPECT_EQ(kvcc::Tokenizer::for_model((dir.path / "model.bin").string(), 512)->vocab_size(), 512);
  write_file(dir.path / "tokenizer.bin", read_file(kStories260kTokenizer).substr(0, 9));
  EXPECT_NE(error_of([&] {
              kvcc::Tokenizer::for_model((dir.path / "model.bin").string(), 512);
            }).find("tokenizer.bin is truncated"),
            std::string::npos);
}

TEST(Tokenizer, CorruptTokenizerJsonIsRefusedByName) {
  SKIP_WITHOUT_SHARED();
  TempDir dir;
  const std::string original = read_file(kGutenbergModel + "/tokenizer.json");
  auto load_error = [&](const std::string& content) {
    const fs::path path = dir.path / "tokenizer.json";
    write_file(path, content);
    return error_of([&] { kvcc::Tokenizer::from_file(path.string()); });
  };
  EXPECT_NE(load_error(original.substr(0, original.size() / 2)).find("is not valid JSON"), std::string::npos);
  json doc = json::parse(original);
  json no_model = doc;
  no_model.erase("model");
  EXPECT_NE(load_error(no_model.dump()).find("is malformed"), std::string::npos);
  json bad_merge = doc;
  bad_merge["model"]["merges"][5] = json::array({"Ġ", "no-such-token"});
  EXPECT_NE(load_error(bad_merge.dump()).find("merge 5 uses \"no-such-token\", which is not in the vocabulary"),
            std::string::npos);
  json wordpiece = doc;
  wordpiece["model"]["type"] = "WordPiece";
  EXPECT_NE(load_error(wordpiece.dump()).find("kvcc supports BPE tokenizers only"), std::string::npos);
  json lowercase = doc;
  lowercase["normalizer"] = {{"type", "Lowercase"}};
  EXPECT_NE(load_error(lowercase.dump()).find("the normalizer \"Lowercase\""), std::string::npos);
  json bad_regex = doc;
  bad_regex["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(unclosed";
  EXPECT_NE(load_error(bad_regex.dump()).find("cannot compile regex"), std::string::npos);
  json gap = doc;
  gap["model"]["vocab"].erase("Ġt");
  EXPECT_FALSE(load_error(gap.dump()).empty());
  EXPECT_NE(load_error("").find("is not valid JSON"), std::string::npos);
  // Without a telling extension the content decides; an empty file is neither format.
  write_file(dir.path / "tokenizer", "");
  EXPECT_NE(error_of([&] { kvcc::Tokenizer::from_file((dir.path / "tokenizer").string()); }).find("is empty"),
            std::string::npos);
  write_file(dir.path / "tokenizer", original);
  EXPECT_EQ(kvcc::Tokenizer::from_file((dir.path / "tokenizer").string())->vocab_size(), 4096);
}

TEST(Tokenizer, TruncatedOrCorruptTokenizerBinIsRefused) {
  SKIP_WITHOUT_SHARED();
  TempDir dir;
  const std::string original = read_file(kStories260kTokenizer);
  auto load_error = [&](const std::string& content) {
    const fs::path path = dir.path / "tok.bin";
    write_file(path, content);
    return error_of([&] { kvcc::Tokenizer::from_file(path.string()); });
  };
  // Cut inside the bytes of a token, inside a length field, and after the header only.
  EXPECT_NE(load_error(original.substr(0, original.size() - 1)).find("is truncated"), std::string::npos);
  EXPECT_NE(load_error(original.substr(0, 4 + 8 + 5 + 6)).find("is truncated"), std::string::npos);
  EXPECT_NE(load_error(original.substr(0, 4)).find("fewer than the 259"), std::string::npos);
  std::string bad_length = original;
  const int32_t huge = 1 << 20;
  std::memcpy(bad_length.data() + 4 + 4, &huge, 4);  // the first token's length
  EXPECT_NE(load_error(bad_length).find("is corrupt: length 1048576 of token 0"), std::string::npos);
  std::string bad_header = original;
  const int32_t negative = -3;
  std::memcpy(bad_header.data(), &negative, 4);
  EXPECT_NE(load_error(bad_header).find("max_token_length -3"), std::string::npos);
  EXPECT_NE(
      error_of([&] { kvcc::Tokenizer::from_file((dir.path / "absent.bin").string()); }).find("cannot open tokenizer"),
      std::string::npos);
  write_file(dir.path / "tokenizer", original);  // no extension: recognised by content
  EXPECT_EQ(kvcc::Tokenizer::from_file((dir.path / "tokenizer").string())->kind(), "llama2.c tokenizer.bin");
}

TEST(Tokenizer, SplitDocumentsTrimsAndDropsEmptyDocuments) {
  using V = std::vector<std::string>;
  EXPECT_EQ(kvcc::split_documents("a b\n<|endoftext|>\n c \n<|endoftext|>  \n<|endoftext|><|endoftext|>d"),
            (V{"a b", "c", "d"}));
  EXPECT_EQ(kvcc::split_documents("just one"), V{"just one"});
  EXPECT_TRUE(kvcc::split_documents(" \n\t<|endoftext|>\n").empty());
  EXPECT_TRUE(kvcc::split_documents("").empty());
  EXPECT_EQ(kvcc::split_documents("x##y##", "##"), (V{"x", "y"}));
  EXPECT_EQ(kvcc::split_documents(" whole text ", ""), V{"whole text"});
}

TEST(Tokenizer, ReadTokenIdFile) {
  TempDir dir;
  const fs::path path = dir.path / "ids.txt";
  write_file(path, "1 2 3\n\n  17\t4096 \r\n0\n");
  EXPECT_EQ(kvcc::read_token_id_file(path.string()), (std::vector<std::vector<int32_t>>{{1, 2, 3}, {17, 4096}, {0}}));
  write_file(path, "1 2\n3 x4 5\n");
  EXPECT_NE(error_of([&] { kvcc::read_token_id_file(path.string()); }).find("line 2: \"x4\" is not a token id"),
            std::string::npos);
  write_file(path, "1 -2\n");
  EXPECT_NE(error_of([&] { kvcc::read_token_id_file(path.string()); }).find("\"-2\" is not a token id"),
            std::string::npos);
  write_file(path, "7 99999999999\n");
  EXPECT_NE(error_of([&] { kvcc::read_token_id_file(path.string()); }).find("\"99999999999\""), std::string::npos);
  write_file(path, "12ab\n");
  EXPECT_NE(error_of([&] { kvcc::read_token_id_file(path.string()); }).find("\"12ab\""), std::string::npos);
  write_file(path, "\n \n");
  EXPECT_NE(error_of([&] { kvcc::read_token_id_file(path.string()); }).find("holds no token ids"), std::string::npos);
  EXPECT_NE(error_of([&] { kvcc::read_token_id_file((dir.path / "absent").string()); }).find("cannot open"),
            std::string::npos);
}
