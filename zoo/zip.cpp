#include "zoo/zip.h"

#include <array>
#include <fstream>
#include <iterator>
#include <set>

#include "formats/error.h"

namespace kvcc {
namespace {

constexpr uint32_t kLocalSig = 0x04034b50;
constexpr uint32_t kCentralSig = 0x02014b50;
constexpr uint32_t kEndSig = 0x06054b50;
constexpr uint32_t kEnd64Sig = 0x06064b50;
constexpr uint32_t kEnd64LocatorSig = 0x07064b50;
constexpr uint16_t kZip64ExtraId = 0x0001;
constexpr uint16_t kPaddingExtraId = 0x4246;  // "FB", the id PyTorch uses for alignment padding
constexpr uint32_t k32Max = 0xffffffffu;

const std::array<uint32_t, 256>& crc_table() {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xedb88320u ^ (c >> 1) : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  return table;
}

// Little-endian field access with bounds checks that name the archive.
struct Cursor {
  const std::string& bytes;
  const std::string& label;
  void need(uint64_t offset, uint64_t size, const char* what) const {
    KVCC_REQUIRE(offset <= bytes.size() && size <= bytes.size() - offset,
                 label + ": truncated ZIP archive (" + what + " runs past the end of the file)");
  }
  uint64_t get(uint64_t offset, int width) const {
    uint64_t v = 0;
    for (int i = width - 1; i >= 0; --i) v = (v << 8) | uint8_t(bytes[size_t(offset) + size_t(i)]);
    return v;
  }
  uint16_t u16(uint64_t o) const { return uint16_t(get(o, 2)); }
  uint32_t u32(uint64_t o) const { return uint32_t(get(o, 4)); }
  uint64_t u64(uint64_t o) const { return get(o, 8); }
};

void put(std::string& out, uint64_t v, int width) {
  for (int i = 0; i < width; ++i) out.push_back(char((v >> (8 * i)) & 0xff));
}

const char* method_name(uint16_t method) {
  switch (method) {
    case 8:
      return "deflate";
    case 9:
      return "deflate64";
    case 12:
      return "bzip2";
    case 14:
      return "lzma";
    case 93:
      return "zstd";
    default:
      return "unknown";
  }
}

}  // namespace

uint32_t crc32(const void* data, size_t size, uint32_t crc) {
  const auto& table = crc_table();
  const auto* p = static_cast<const uint8_t*>(data);
  uint32_t c = crc ^ 0xffffffffu;
  for (size_t i = 0; i < size; ++i) c = table[(c ^ p[i]) & 0xff] ^ (c >> 8);
  return c ^ 0xffffffffu;
}

ZipReader ZipReader::open(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  KVCC_REQUIRE(bool(in), "cannot open " + path);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  KVCC_REQUIRE(!in.bad(), "cannot read " + path);
  return from_bytes(std::move(bytes), path);
}

ZipReader ZipReader::from_bytes(std::string bytes, const std::string& label) {
  ZipReader r;
  r.bytes_ = std::move(bytes);
  r.label_ = label;
  r.parse();
  return r;
}

void ZipReader::parse() {
  const Cursor c{bytes_, label_};
  const uint64_t n = bytes_.size();
  KVCC_REQUIRE(n >= 22, label_ + ": not a ZIP archive (file too short: " + std::to_string(n) + " bytes)");
  // The end record is the last 22 bytes plus a comment of up to 64 KiB.
  uint64_t end = UINT64_MAX;
  const uint64_t lowest = n >= 22 + 0xffff ? n - 22 - 0xffff : 0;
  for (uint64_t pos = n - 22 + 1; pos-- > lowest;) {
    if (c.u32(pos) == kEndSig && pos + 22 + c.u16(pos + 20) == n) {
      end = pos;
      break;
    }
  }
  KVCC_REQUIRE(end != UINT64_MAX, label_ + ": not a ZIP archive (no end-of-central-directory record; truncated?)");
  KVCC_REQUIRE(c.u16(end + 4) == 0 && c.u16(end + 6) == 0, label_ + ": multi-disk ZIP archives are not supported");
  uint64_t count = c.u16(end + 10);
  uint64_t cd_size = c.u32(end + 12);
  uint64_t cd_offset = c.u32(end + 16);
  if (end >= 20 && c.u32(end - 20) == kEnd64LocatorSig) {
    const uint64_t end64 = c.u64(end - 20 + 8);
    c.need(end64, 56, "zip64 end record");
    KVCC_REQUIRE(c.u32(end64) == kEnd64Sig, label_ + ": corrupt ZIP archive (bad zip64 end record signature)");
    count = c.u64(end64 + 32);
    cd_size = c.u64(end64 + 40);
    cd_offset = c.u64(end64 + 48);
  } else {
    KVCC_REQUIRE(count != 0xffff && cd_offset != k32Max,
                 label_ + ": corrupt ZIP archive (zip64 sizes without a zip64 end record)");
  }
  c.need(cd_offset, cd_size, "central directory");

  std::set<std::string, std::less<>> seen;
  uint64_t pos = cd_offset;
  for (uint64_t i = 0; i < count; ++i) {
    c.need(pos, 46, "central directory entry");
    KVCC_REQUIRE(c.u32(pos) == kCentralSig,
                 label_ + ": corrupt ZIP archive (bad central directory signature at entry " + std::to_string(i) + ")");
    const uint16_t flags = c.u16(pos + 8);
    const uint16_t method = c.u16(pos + 10);
    const uint32_t crc = c.u32(pos + 16);
    uint64_t csize = c.u32(pos + 20);
    uint64_t usize = c.u32(pos + 24);
    const uint16_t name_len = c.u16(pos + 28), extra_len = c.u16(pos + 30), comment_len = c.u16(pos + 32);
    uint64_t local = c.u32(pos + 42);
    c.need(pos + 46, uint64_t(name_len) + extra_len + comment_len, "central directory entry");
    std::string name = bytes_.substr(size_t(pos + 46), name_len);
    // zip64 extra: 8-byte values for exactly those fields stored as 0xffffffff, in this order.
    for (uint64_t e = pos + 46 + name_len; e + 4 <= pos + 46 + name_len + extra_len;) {
      const uint16_t id = c.u16(e), len = c.u16(e + 2);
      KVCC_REQUIRE(e + 4 + len <= pos + 46 + name_len + extra_len,
                   label_ + ": corrupt ZIP archive (extra field of '" + name + "' overruns its entry)");
      if (id == kZip64ExtraId) {
        uint64_t f = e + 4;
        auto take = [&](uint64_t& field) {
          if (field != k32Max) return;
          KVCC_REQUIRE(f + 8 <= e + 4 + len, label_ + ": corrupt ZIP archive (short zip64 extra in '" + name + "')");
          field = c.u64(f);
          f += 8;
        };
        take(usize);
        take(csize);
        take(local);
      }
      e += 4 + uint64_t(len);
    }
    KVCC_REQUIRE(!(flags & 1), label_ + ": entry '" + name + "' is encrypted, which is not supported");
    KVCC_REQUIRE(method == 0, label_ + ": entry '" + name + "' is compressed (method " + std::to_string(method) + ": " +
                                  method_name(method) + "); only stored entries (torch.save archives) are supported");
    KVCC_REQUIRE(csize == usize, label_ + ": corrupt ZIP archive (stored entry '" + name + "' has differing sizes)");
    KVCC_REQUIRE(seen.insert(name).second, label_ + ": corrupt ZIP archive (duplicate entry '" + name + "')");

    // The local header's own name and extra lengths decide where the data starts (PyTorch pads there).
    c.need(local, 30, "local header");
    KVCC_REQUIRE(c.u32(local) == kLocalSig, label_ + ": corrupt ZIP archive (bad local header for '" + name + "')");
    const uint16_t local_name_len = c.u16(local + 26), local_extra_len = c.u16(local + 28);
    c.need(local + 30, local_name_len, "local header");
    KVCC_REQUIRE(bytes_.compare(size_t(local + 30), local_name_len, name) == 0,
                 label_ + ": corrupt ZIP archive (local header name differs from the directory for '" + name + "')");
    const uint64_t data = local + 30 + local_name_len + local_extra_len;
    c.need(data, usize, ("data of '" + name + "'").c_str());
    entries_.push_back({std::move(name), data, usize, crc});
    pos += 46 + uint64_t(name_len) + extra_len + comment_len;
  }
}

const ZipEntry* ZipReader::find(std::string_view name) const {
  for (const auto& e : entries_)
    if (e.name == name) return &e;
  return nullptr;
}

std::string ZipReader::read(std::string_view name) const {
  const ZipEntry* e = find(name);
  KVCC_REQUIRE(e != nullptr, label_ + ": no entry '" + std::string(name) + "' in the archive");
  return read(*e);
}

std::string ZipReader::read(const ZipEntry& e) const {
  std::string data = bytes_.substr(size_t(e.data_offset), size_t(e.size));
  const uint32_t crc = crc32(data.data(), data.size());
  KVCC_REQUIRE(crc == e.crc32, label_ + ": entry '" + e.name + "' is corrupt (CRC-32 mismatch)");
  return data;
}

ZipWriter::ZipWriter(uint32_t alignment, bool force_zip64) : alignment_(alignment), force_zip64_(force_zip64) {
  KVCC_REQUIRE(alignment_ >= 1, "ZIP alignment must be positive");
}

void ZipWriter::add(const std::string& name, std::string_view data) {
  KVCC_REQUIRE(!finished_, "ZipWriter: add() after finish()");
  KVCC_REQUIRE(!name.empty() && name.size() < 0xffff, "ZIP entry name must be 1..65534 bytes");
  for (const auto& w : written_) KVCC_REQUIRE(w.name != name, "ZIP entry '" + name + "' added twice");
  const uint64_t header = out_.size();
  const uint32_t crc = crc32(data.data(), data.size());
  const bool zip64 = force_zip64_ || data.size() >= k32Max || header >= k32Max;
  std::string extra;
  if (zip64) {
    put(extra, kZip64ExtraId, 2);
    put(extra, 16, 2);
    put(extra, data.size(), 8);
    put(extra, data.size(), 8);
  }
  // Pad with an "FB" extra field so the data starts on an alignment boundary.
  const uint64_t unpadded = header + 30 + name.size() + extra.size();
  uint64_t pad = (alignment_ - unpadded % alignment_) % alignment_;
  if (pad != 0 && pad < 4) pad += alignment_;  // the field's own 4-byte header must fit
  if (pad != 0) {
    put(extra, kPaddingExtraId, 2);
    put(extra, pad - 4, 2);
    extra.append(size_t(pad - 4), 'Z');
  }
  put(out_, kLocalSig, 4);
  put(out_, zip64 ? 45 : 20, 2);  // version needed
  put(out_, 0x0800, 2);           // UTF-8 names
  put(out_, 0, 2);                // stored
  put(out_, 0, 4);                // time, date (0: reproducible output)
  put(out_, crc, 4);
  put(out_, zip64 ? k32Max : data.size(), 4);
  put(out_, zip64 ? k32Max : data.size(), 4);
  put(out_, name.size(), 2);
  put(out_, extra.size(), 2);
  out_ += name;
  out_ += extra;
  out_.append(data.data(), data.size());
  written_.push_back({name, header, data.size(), crc});
}

std::string ZipWriter::finish() {
  KVCC_REQUIRE(!finished_, "ZipWriter: finish() called twice");
  finished_ = true;
  const uint64_t cd_offset = out_.size();
  bool any64 = force_zip64_ || written_.size() >= 0xffff;
  for (const auto& w : written_) {
    const bool zip64 = force_zip64_ || w.size >= k32Max || w.header_offset >= k32Max;
    any64 = any64 || zip64;
    std::string extra;
    if (zip64) {
      put(extra, kZip64ExtraId, 2);
      put(extra, 24, 2);
      put(extra, w.size, 8);
      put(extra, w.size, 8);
      put(extra, w.header_offset, 8);
    }
    put(out_, kCentralSig, 4);
    put(out_, zip64 ? 45 : 20, 2);  // version made by
    put(out_, zip64 ? 45 : 20, 2);  // version needed
    put(out_, 0x0800, 2);
    put(out_, 0, 2);
    put(out_, 0, 4);
    put(out_, w.crc, 4);
    put(out_, zip64 ? k32Max : w.size, 4);
    put(out_, zip64 ? k32Max : w.size, 4);
    put(out_, w.name.size(), 2);
    put(out_, extra.size(), 2);
    put(out_, 0, 2);  // comment
    put(out_, 0, 2);  // disk
    put(out_, 0, 2);  // internal attributes
    put(out_, 0, 4);  // external attributes
    put(out_, zip64 ? k32Max : w.header_offset, 4);
    out_ += w.name;
    out_ += extra;
  }
  const uint64_t cd_size = out_.size() - cd_offset;
  any64 = any64 || cd_offset >= k32Max;
  if (any64) {
    const uint64_t end64 = out_.size();
    put(out_, kEnd64Sig, 4);
    put(out_, 44, 8);  // size of the rest of this record
    put(out_, 45, 2);
    put(out_, 45, 2);
    put(out_, 0, 4);
    put(out_, 0, 4);
    put(out_, written_.size(), 8);
    put(out_, written_.size(), 8);
    put(out_, cd_size, 8);
    put(out_, cd_offset, 8);
    put(out_, kEnd64LocatorSig, 4);
    put(out_, 0, 4);
    put(out_, end64, 8);
    put(out_, 1, 4);
  }
  put(out_, kEndSig, 4);
  put(out_, 0, 2);
  put(out_, 0, 2);
  put(out_, any64 ? 0xffff : written_.size(), 2);
  put(out_, any64 ? 0xffff : written_.size(), 2);
  put(out_, any64 ? k32Max : cd_size, 4);
  put(out_, any64 ? k32Max : cd_offset, 4);
  put(out_, 0, 2);
  return std::move(out_);
}

}  // namespace kvcc
