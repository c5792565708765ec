// SHA-256 (FIPS 180-4) of bytes, strings and files, streaming, with lowercase hex output. Used for
// model fingerprints, provenance (data and stats file hashes) and per-dataset artifact checksums.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace kvcc {

class Sha256 {
 public:
  Sha256();
  Sha256& update(const void* data, size_t size);
  Sha256& update(std::string_view s) { return update(s.data(), s.size()); }
  // Finishes the hash; the object must not be updated afterwards.
  std::array<uint8_t, 32> digest();
  std::string hex_digest();

 private:
  void compress(const uint8_t block[64]);
  std::array<uint32_t, 8> state_;
  uint8_t buffer_[64];
  size_t buffered_ = 0;
  uint64_t total_bytes_ = 0;
  bool finished_ = false;
};

std::string sha256_hex(const void* data, size_t size);
std::string sha256_hex(std::string_view s);
// Streams the file; throws Error naming the path when it cannot be read.
std::string sha256_file_hex(const std::string& path);
std::string to_hex(const uint8_t* bytes, size_t size);

}  // namespace kvcc
