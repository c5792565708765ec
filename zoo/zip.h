// A small ZIP reader/writer for the archives PyTorch's torch.save produces: stored (uncompressed)
// entries, optional zip64 records, data aligned to 64 bytes through padding extra fields. Anything
// else (deflate, encryption, multi-disk) is refused with an Error naming the entry and the cause.
// Archives are held in memory: the files kvcc reads this way (OSCAR rotations) are megabytes.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace kvcc {

// CRC-32 (IEEE 802.3, the ZIP checksum); pass a previous result as `crc` to continue a stream.
uint32_t crc32(const void* data, size_t size, uint32_t crc = 0);

struct ZipEntry {
  std::string name;
  uint64_t data_offset = 0;  // where the stored bytes start in the archive
  uint64_t size = 0;
  uint32_t crc32 = 0;  // from the central directory
};

class ZipReader {
 public:
  // Reads the whole file; throws Error naming the path when it is missing, truncated or not a
  // supported ZIP archive.
  static ZipReader open(const std::string& path);
  // `label` names the archive in error messages.
  static ZipReader from_bytes(std::string bytes, const std::string& label);

  const std::vector<ZipEntry>& entries() const { return entries_; }
  const ZipEntry* find(std::string_view name) const;  // nullptr when absent
  // The entry's bytes, CRC-checked; throws Error when missing or corrupt.
  std::string read(std::string_view name) const;
  std::string read(const ZipEntry& entry) const;
  const std::string& label() const { return label_; }

 private:
  ZipReader() = default;
  void parse();
  std::string bytes_;
  std::string label_;
  std::vector<ZipEntry> entries_;
};

class ZipWriter {
 public:
  // Each entry's data starts at a multiple of `alignment` (PyTorch uses 64). `force_zip64` writes
  // zip64 extras and end records even when sizes fit in 32 bits (they are used when needed).
  explicit ZipWriter(uint32_t alignment = 64, bool force_zip64 = false);
  void add(const std::string& name, std::string_view data);
  // The finished archive; the writer must not be used afterwards.
  std::string finish();

 private:
  struct Written {
    std::string name;
    uint64_t header_offset;
    uint64_t size;
    uint32_t crc;
  };
  uint32_t alignment_;
  bool force_zip64_;
  std::string out_;
  std::vector<Written> written_;
  bool finished_ = false;
};

}  // namespace kvcc
