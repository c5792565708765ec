// SHA-256 against the FIPS 180-2 / NIST CSRC example vectors, plus streaming in odd chunk sizes and
// the file variant, which must agree with the one-shot hash.
#include <gtest/gtest.h>

#include <string>

#include "formats/error.h"
#include "formats/sha256.h"
#include "formats_test_util.h"

namespace kvcc {
namespace {

TEST(Sha256, NistVectors) {
  EXPECT_EQ(sha256_hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  // An empty vector's data() may be null: no bytes are read (UBSan flagged memcpy from null here).
  EXPECT_EQ(sha256_hex(nullptr, 0), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(sha256_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(sha256_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(sha256_hex(std::string(1000000, 'a')), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
  // The 896-bit message (two blocks after padding) exercises the length field spilling over.
  EXPECT_EQ(sha256_hex("abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmnoijklmnopjklmnopqklmnopqrlmnopq"
                       "rsmnopqrstnopqrstu"),
            "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1");
}

TEST(Sha256, StreamingMatchesOneShot) {
  std::string message;
  for (int i = 0; i < 5000; ++i) message.push_back(char((i * 131 + 7) & 0xff));
  const std::string expected = sha256_hex(message);
  for (size_t chunk : {1u, 3u, 55u, 56u, 63u, 64u, 65u, 1000u}) {
    Sha256 h;
    for (size_t at = 0; at < message.size(); at += chunk)
      h.update(message.data() + at, std::min(chunk, message.size() - at));
    EXPECT_EQ(h.hex_digest(), expected) << "chunk " << chunk;
  }
}

TEST(Sha256, FileMatchesBytesAndMissingFileErrors) {
  testing::ScratchDir dir;
  const std::string content(3 << 20, 'a');  // spans several 1 MiB read chunks
  testing::write_bytes(dir.file("f.bin"), content);
  EXPECT_EQ(sha256_file_hex(dir.file("f.bin")), sha256_hex(content));
  try {
    sha256_file_hex(dir.file("missing.bin"));
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("missing.bin: cannot open"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace kvcc
