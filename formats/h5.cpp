#include "formats/h5.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <set>
#include <sstream>

#include "formats/error.h"
#include "formats/sha256.h"

namespace kvcc::h5 {

// One global heap collection: its bytes, and where each object's data lies in them.
struct HeapCollection {
  std::string bytes;
  std::map<uint32_t, std::pair<size_t, size_t>> objects;  // index -> (offset in bytes, size)
};
struct FileInfo {
  uint64_t size = std::numeric_limits<uint64_t>::max();  // a file being written: unbounded
  bool untrusted = false;                                // opened read-only: strings come from `heaps`
  std::map<uint64_t, HeapCollection> heaps;              // by file address
  // The file's bytes (mapped read-only while it is open) and the object headers whose attribute
  // messages were checked (check_attribute_messages).
  const unsigned char* bytes = nullptr;
  mutable std::set<uint64_t> checked_headers;
  // Attribute checksums required (File::require_sealed_attributes), and the objects (by path)
  // whose checksum matched or is being checked.
  mutable bool sealed = false;
  mutable std::set<std::string> sealed_ok;
  // The superblock's K values for old-style groups (version 0 and 1 superblocks; 0: not stored,
  // node sizes are then bounded by the file alone): a B-tree node holds at most 2K children.
  unsigned group_leaf_k = 0, group_internal_k = 0;
  FileInfo() = default;
  FileInfo(const FileInfo&) = delete;
  FileInfo& operator=(const FileInfo&) = delete;
  ~FileInfo() {
    if (bytes) ::munmap(const_cast<unsigned char*>(bytes), size_t(size));
  }
};

uint64_t Object::file_size() const { return info_->size; }

namespace {

hid_t file_type(DType t) {
  switch (t) {
    case DType::Float64:
      return H5T_IEEE_F64LE;
    case DType::Float32:
      return H5T_IEEE_F32LE;
    case DType::Int32:
      return H5T_STD_I32LE;
    case DType::Int64:
      return H5T_STD_I64LE;
    case DType::UInt8:
      return H5T_STD_U8LE;
    case DType::UInt16:
      return H5T_STD_U16LE;
    case DType::UInt32:
      return H5T_STD_U32LE;
    case DType::UInt64:
      return H5T_STD_U64LE;
  }
  return H5I_INVALID_HID;
}

hid_t memory_type(DType t) {
  switch (t) {
    case DType::Float64:
      return H5T_NATIVE_DOUBLE;
    case DType::Float32:
      return H5T_NATIVE_FLOAT;
    case DType::Int32:
      return H5T_NATIVE_INT32;
    case DType::Int64:
      return H5T_NATIVE_INT64;
    case DType::UInt8:
      return H5T_NATIVE_UINT8;
    case DType::UInt16:
      return H5T_NATIVE_UINT16;
    case DType::UInt32:
      return H5T_NATIVE_UINT32;
    case DType::UInt64:
      return H5T_NATIVE_UINT64;
  }
  return H5I_INVALID_HID;
}

// HDF5 1.10.7+ and 1.12.1+ can skip file locking, which fails on some network filesystems;
// kvcc never has a reader and a writer on one file (writers rename a finished temporary).
hid_t make_file_access(const std::string& name) {
  hid_t fapl = H5Pcreate(H5P_FILE_ACCESS);
  if (fapl < 0) throw Error(name + ": HDF5 cannot create a file access property list");
#if (H5_VERS_MAJOR == 1 && H5_VERS_MINOR == 10 && H5_VERS_RELEASE >= 7) || H5_VERSION_GE(1, 12, 1)
  H5Pset_file_locking(fapl, false, true);
#endif
  return fapl;
}

std::string join_path(const std::string& parent, const std::string& name) {
  return parent == "/" ? "/" + name : parent + "/" + name;
}

herr_t collect_name(hid_t, const char* name, const H5L_info_t*, void* out) {
  static_cast<std::vector<std::string>*>(out)->emplace_back(name);
  return 0;
}
herr_t collect_attr_name(hid_t, const char* name, const H5A_info_t*, void* out) {
  static_cast<std::vector<std::string>*>(out)->emplace_back(name);
  return 0;
}

// The standard types a file may use for kvcc's numbers (either byte order; HDF5 converts).
// Anything else (a float with odd exponent fields, a 3-byte integer) is refused before a
// conversion could see it.
struct StandardType {
  hid_t le, be;
};
bool is_one_of(hid_t type, std::initializer_list<StandardType> types) {
  for (const StandardType& t : types)
    if (H5Tequal(type, t.le) > 0 || H5Tequal(type, t.be) > 0) return true;
  return false;
}
bool is_standard_integer(hid_t type) {
  return is_one_of(type, {{H5T_STD_I8LE, H5T_STD_I8BE},
                          {H5T_STD_I16LE, H5T_STD_I16BE},
                          {H5T_STD_I32LE, H5T_STD_I32BE},
                          {H5T_STD_I64LE, H5T_STD_I64BE},
                          {H5T_STD_U8LE, H5T_STD_U8BE},
                          {H5T_STD_U16LE, H5T_STD_U16BE},
                          {H5T_STD_U32LE, H5T_STD_U32BE},
                          {H5T_STD_U64LE, H5T_STD_U64BE}});
}
// A little-endian unsigned number of n bytes.
uint64_t le_bytes(const unsigned char* p, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

bool is_standard_float(hid_t type) {
  return is_one_of(type, {{H5T_IEEE_F32LE, H5T_IEEE_F32BE}, {H5T_IEEE_F64LE, H5T_IEEE_F64BE}});
}

}  // namespace

Handle& Handle::operator=(Handle&& o) noexcept {
  if (this != &o) {
    reset();
    id_ = o.id_;
    closer_ = o.closer_;
    o.id_ = H5I_INVALID_HID;
  }
  return *this;
}

bool Handle::reset() {
  bool ok = true;
  if (id_ >= 0 && closer_) ok = closer_(id_) >= 0;
  id_ = H5I_INVALID_HID;
  return ok;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::Float64:
      return "float64";
    case DType::Float32:
      return "float32";
    case DType::Int32:
      return "int32";
    case DType::Int64:
      return "int64";
    case DType::UInt8:
      return "uint8";
    case DType::UInt16:
      return "uint16";
    case DType::UInt32:
      return "uint32";
    case DType::UInt64:
      return "uint64";
  }
  return "?";
}

std::string shape_string(const Shape& s) {
  std::ostringstream o;
  o << '[';
  for (size_t i = 0; i < s.size(); ++i) o << (i ? ", " : "") << s[i];
  o << ']';
  return o.str();
}

int64_t element_count(const Shape& s) {
  int64_t n = 1;
  for (int64_t x : s) {
    if (x < 0) return -1;
    if (x != 0 && n > std::numeric_limits<int64_t>::max() / x) return -1;
    n *= x;
  }
  return n;
}

size_t dtype_size(DType t) {
  switch (t) {
    case DType::Float64:
    case DType::Int64:
    case DType::UInt64:
      return 8;
    case DType::Float32:
    case DType::Int32:
    case DType::UInt32:
      return 4;
    case DType::UInt16:
      return 2;
    case DType::UInt8:
      return 1;
  }
  return 8;
}

void silence_hdf5_errors() { H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr); }

std::pair<int, int> parse_version(const std::string& version, const std::string& what) {
  int major = 0, minor = 0;
  char tail = 0;
  if (std::sscanf(version.c_str(), "%d.%d%c", &major, &minor, &tail) != 2 || major < 0 || minor < 0)
    throw Error(what + ": malformed format_version \"" + version + "\" (expected MAJOR.MINOR)");
  return {major, minor};
}

// ---------------------------------------------------------------- Object

void Object::fail(const std::string& message) const { throw Error(file_name_ + ": " + path_ + ": " + message); }

std::string Object::child_path(const std::string& name) const { return join_path(path_, name); }

// A datatype message (an attribute's type, or a dataset's message 3) must be one kvcc reads:
// fixed-point or IEEE float numbers, and for attributes also fixed-length strings and
// variable-length strings of bytes. libhdf5 decodes any class when it loads the message: an
// enumeration's member names are copied with strdup, as many as the type claims (a flipped class
// byte made it read past the header: heap overflow, found by CI's fuzzing); compound, array and
// reference types carry nested types and counts of their own. Returns "" or what is wrong.
std::string check_datatype(const unsigned char* t, uint64_t length, bool attribute) {
  if (length < 8) return "datatype message too short";
  const unsigned type_class = t[0] & 0x0f, version = t[0] >> 4;
  const uint64_t size = le_bytes(t + 4, 4);
  if (version < 1 || version > 3) return "datatype version " + std::to_string(version);
  switch (type_class) {
    case 0:  // fixed-point: bit offset, precision
      if (size != 1 && size != 2 && size != 4 && size != 8) return "integer type of " + std::to_string(size) + " bytes";
      return length < 12 ? "datatype message too short" : "";
    case 1:  // floating-point: bit offset, precision, exponent and mantissa fields, bias
      if (size != 4 && size != 8) return "float type of " + std::to_string(size) + " bytes";
      return length < 20 ? "datatype message too short" : "";
    case 3:  // fixed-length string
      if (attribute && size >= 1) return "";
      break;
    case 9:  // variable-length: sequence or string, then the base type (a datatype message itself)
      if (attribute && (t[1] & 0x0f) == 1 && size == 16 && length >= 20 && (t[8] & 0x0f) == 0)
        return check_datatype(t + 8, length - 8, false);
      break;
    default:
      break;
  }
  return "unsupported datatype (class " + std::to_string(type_class) + ", " + std::to_string(size) + " bytes)";
}

// libhdf5 1.10 decodes every attribute message of an object header on the first attribute
// access (H5Aexists, H5Aopen, H5Aiterate2) and copies `points x element size` bytes of value out
// of the message without checking that the message holds them: a corrupt dataspace or type made
// H5O_attr_decode read past the header (heap overflow, SEGV; found by scripts/fuzz.sh). So for a
// file opened read-only each object header is parsed here first (version 1 and 2 headers with
// their continuation chunks) and every attribute message's name, type, dataspace and value must
// fit in it. Returns "" or what is wrong.
std::string check_attribute_message(const unsigned char* m, size_t size) {
  if (size < 8) return "attribute message too short";
  const unsigned version = m[0];
  if (version < 1 || version > 3) return "attribute message version " + std::to_string(version);
  const uint64_t name = le_bytes(m + 2, 2), dt = le_bytes(m + 4, 2), ds = le_bytes(m + 6, 2);
  auto pad = [&](uint64_t n) { return version == 1 ? (n + 7) & ~uint64_t(7) : n; };
  const uint64_t dt_at = (version == 3 ? 9 : 8) + pad(name), ds_at = dt_at + pad(dt), data_at = ds_at + pad(ds);
  if (data_at > size || dt < 8 || ds < 4) return "attribute message fields overrun it";
  // libhdf5 copies the name with strdup: it must end inside its field.
  if (name == 0 || !std::memchr(m + (version == 3 ? 9 : 8), 0, size_t(name))) return "attribute name is not terminated";
  // A shared type or dataspace lives in another object header, which libhdf5 decodes unchecked.
  if (version >= 2 && (m[1] & 3)) return "shared attribute types and dataspaces are not supported";
  const unsigned char* t = m + dt_at;
  if (std::string problem = check_datatype(t, dt, true); !problem.empty()) return "attribute: " + problem;
  const uint64_t element = le_bytes(t + 4, 4);  // libhdf5 copies points x this many bytes
  const unsigned char* d = m + ds_at;
  const unsigned ds_version = d[0], rank = d[1];
  if (ds_version < 1 || ds_version > 2 || rank > 32) return "attribute dataspace is invalid";
  const uint64_t dims_at = ds_version == 1 ? 8 : 4;
  if (dims_at + 8 * uint64_t(rank) > ds) return "attribute dataspace overruns it";
  uint64_t points = ds_version == 2 && d[3] == 2 ? 0 : 1;  // version 2 type 2: the null dataspace
  for (unsigned i = 0; i < rank && points; ++i) {
    const uint64_t dim = le_bytes(d + dims_at + 8 * i, 8);
    if (dim != 0 && points > (uint64_t(1) << 40) / dim) return "attribute dataspace is too large";
    points *= dim;
  }
  if (element != 0 && points > (size - data_at) / element) return "attribute value overruns its message";
  return "";
}

// Old-style groups: a symbol table message names a version 1 B-tree whose leaves (symbol table
// nodes) hold the links, each name an offset into the group's local heap. libhdf5 1.10 loads the
// heap and the nodes at the message's addresses unchecked: an undefined heap address made its
// metadata accumulator copy from NULL, and a heap claiming a 12.9 GB data segment was allocated
// before being read (both found by scripts/fuzz.sh). So the heap (its data segment and free list),
// every B-tree node and every symbol table node must lie in the file, hold no more entries than
// the superblock's K allows, and every name offset (keys and links) must end inside the heap's
// data. Returns "" or what is wrong.
std::string check_symbol_table(const unsigned char* f, uint64_t size, uint64_t btree, uint64_t heap,
                               const FileInfo& info) {
  constexpr uint64_t kUndef = ~uint64_t(0);
  // The local heap: "HEAP", version 0, 3 reserved bytes, data size, free list head, data address.
  if (heap > size || size - heap < 32 || std::memcmp(f + heap, "HEAP", 4) != 0 || f[heap + 4] != 0)
    return "symbol table: no local heap at " + std::to_string(heap);
  const uint64_t dsize = le_bytes(f + heap + 8, 8), free_head = le_bytes(f + heap + 16, 8),
                 daddr = le_bytes(f + heap + 24, 8);
  if (dsize == 0 || dsize > size || daddr > size - dsize)
    return "symbol table: local heap data (" + std::to_string(dsize) + " bytes) outside the file";
  const unsigned char* data = f + daddr;
  // The free list: blocks of (next offset, size), each inside the data, none visited twice.
  std::set<uint64_t> free_blocks;
  for (uint64_t b = free_head; b != 1 && b != kUndef;) {  // 1: H5HL_FREE_NULL, the end of the list
    if (b > dsize || dsize - b < 16 || !free_blocks.insert(b).second)
      return "symbol table: corrupt local heap free list";
    const uint64_t next = le_bytes(data + b, 8), length = le_bytes(data + b + 8, 8);
    if (length < 16 || length > dsize - b) return "symbol table: corrupt local heap free list";
    b = next;
  }
  auto name_ok = [&](uint64_t offset) {
    return offset < dsize && std::memchr(data + offset, 0, size_t(dsize - offset));
  };
  const uint64_t leaf_k = info.group_leaf_k, internal_k = info.group_internal_k;
  // The B-tree, depth first; every node once.
  std::vector<std::pair<uint64_t, int>> todo{{btree, -1}};  // (address, level expected; -1 the root's)
  std::set<uint64_t> seen;
  while (!todo.empty()) {
    const auto [at, level_wanted] = todo.back();
    todo.pop_back();
    if (!seen.insert(at).second) return "symbol table: a B-tree node is reached twice";
    if (at > size || size - at < 24 || std::memcmp(f + at, "TREE", 4) != 0 || f[at + 4] != 0)
      return "symbol table: no group B-tree node at " + std::to_string(at);
    const unsigned level = f[at + 5];
    const uint64_t entries = le_bytes(f + at + 6, 2);
    if (level > 32 || (level_wanted >= 0 && int(level) != level_wanted))
      return "symbol table: B-tree node at " + std::to_string(at) + " has level " + std::to_string(level);
    for (uint64_t sibling : {le_bytes(f + at + 8, 8), le_bytes(f + at + 16, 8)})
      if (sibling != kUndef && sibling >= size) return "symbol table: B-tree sibling outside the file";
    // libhdf5 reads the node whole, sized for 2K children (and 2K + 1 keys).
    const uint64_t k = internal_k ? internal_k : entries;
    if ((internal_k && entries > 2 * k) || 24 + (4 * k + 1) * 8 > size - at)
      return "symbol table: B-tree node at " + std::to_string(at) + " overruns the file or its K";
    for (uint64_t e = 0; e <= entries; ++e)
      if (!name_ok(le_bytes(f + at + 24 + 16 * e, 8))) return "symbol table: a B-tree key is not in the local heap";
    for (uint64_t e = 0; e < entries; ++e) {
      const uint64_t child = le_bytes(f + at + 32 + 16 * e, 8);
      if (level > 0) {
        todo.push_back({child, int(level) - 1});
        continue;
      }
      // A symbol table node: "SNOD", version 1, reserved, count, then 40-byte entries; libhdf5 reads
      // it whole, sized for 2 x leaf K entries.
      if (child > size || size - child < 8 || std::memcmp(f + child, "SNOD", 4) != 0 || f[child + 4] != 1)
        return "symbol table: no symbol table node at " + std::to_string(child);
      const uint64_t symbols = le_bytes(f + child + 6, 2), capacity = leaf_k ? 2 * leaf_k : symbols;
      if (symbols > capacity || 8 + 40 * capacity > size - child)
        return "symbol table: symbol table node at " + std::to_string(child) + " overruns the file or its K";
      if (!seen.insert(child).second) return "symbol table: a symbol table node is reached twice";
      for (uint64_t i = 0; i < symbols; ++i) {
        const unsigned char* entry = f + child + 8 + 40 * i;
        if (!name_ok(le_bytes(entry, 8))) return "symbol table: a link name is not in the local heap";
        const uint64_t cache = le_bytes(entry + 16, 4);
        if (cache > 2) return "symbol table: a link has cache type " + std::to_string(cache);
        if (cache == 2) {  // a soft link (refused by name when followed): its value is a heap offset
          if (!name_ok(le_bytes(entry + 24, 4))) return "symbol table: a soft link's value is not in the local heap";
          continue;
        }
        if (le_bytes(entry + 8, 8) >= size) return "symbol table: a link's object header is outside the file";
        if (cache == 1)  // a cached symbol table: its addresses too
          for (int j = 0; j < 2; ++j)
            if (le_bytes(entry + 24 + 8 * j, 8) >= size) return "symbol table: a cached address is outside the file";
      }
    }
  }
  return "";
}

constexpr const char* kChunkedRefusal =
    "chunked storage is not supported (kvcc writes compact and contiguous datasets)";

// Walks the messages of the object header at `addr` (following continuation messages, each chunk
// once), checking attribute messages (type 12), symbol tables (type 17), the storage layout
// (type 8) and link / attribute info (types 2 and 21: no dense storage).
std::string check_object_header(const unsigned char* f, uint64_t file_size, uint64_t addr, const FileInfo& info) {
  struct Chunk {
    uint64_t at, length;
    bool first;
  };
  std::vector<Chunk> todo;
  std::set<uint64_t> seen;
  if (addr >= file_size || file_size - addr < 16) return "object header outside the file";
  const bool v2 = std::memcmp(f + addr, "OHDR", 4) == 0;
  unsigned v2_flags = 0;
  if (v2) {
    if (f[addr + 4] != 2) return "object header version";
    v2_flags = f[addr + 5];
    uint64_t at = addr + 6 + ((v2_flags & 0x20) ? 16 : 0) + ((v2_flags & 0x10) ? 4 : 0);
    const int width = 1 << (v2_flags & 3);
    if (at + uint64_t(width) > file_size) return "object header outside the file";
    const uint64_t length = le_bytes(f + at, width);
    todo.push_back({at + uint64_t(width), length, true});
  } else {
    if (f[addr] != 1) return "object header version";
    todo.push_back({addr + 16, le_bytes(f + addr + 8, 4), true});
  }
  const uint64_t header = v2 ? ((v2_flags & 0x04) ? 6 : 4) : 8;
  while (!todo.empty()) {
    Chunk c = todo.back();
    todo.pop_back();
    if (!seen.insert(c.at).second) continue;
    if (seen.size() > 4096) return "too many object header chunks";
    if (c.at > file_size || c.length > file_size - c.at) return "object header chunk outside the file";
    uint64_t p = c.at, end = c.at + c.length;
    if (v2 && !c.first) {  // "OCHK" ... checksum
      if (c.length < 8 || std::memcmp(f + p, "OCHK", 4) != 0) return "bad object header continuation";
      p += 4;
      end -= 4;
    }
    while (end - p >= header) {
      const unsigned type = v2 ? f[p] : unsigned(le_bytes(f + p, 2));
      const uint64_t size = le_bytes(f + p + (v2 ? 1 : 2), 2);
      const uint64_t data = p + header;
      if (size > end - data) return "object header message overruns its chunk";
      // A message flagged shared (bit 1) holds a reference to another header's message instead.
      if ((type == 0x0c || type == 0x03) && (f[p + (v2 ? 3 : 4)] & 0x02))
        return "shared datatype or attribute messages are not supported";
      if (type == 0x0c)
        if (std::string problem = check_attribute_message(f + data, size_t(size)); !problem.empty()) return problem;
      if (type == 0x03)
        if (std::string problem = check_datatype(f + data, size, false); !problem.empty()) return "dataset: " + problem;
      if (type == 0x11) {  // symbol table: B-tree and local heap addresses
        if (size < 16) return "symbol table message too short";
        if (std::string problem =
                check_symbol_table(f, file_size, le_bytes(f + data, 8), le_bytes(f + data + 8, 8), info);
            !problem.empty())
          return problem;
      }
      if (type == 0x08) {  // data layout: compact (0) or contiguous (1) only
        if (size < 3) return "data layout message too short";
        const unsigned version = f[data];
        if (version < 1 || version > 4) return "data layout version " + std::to_string(version);
        const unsigned cls = version >= 3 ? f[data + 1] : f[data + 2];
        if (cls == 2) return kChunkedRefusal;
        if (cls > 1) return "dataset storage class " + std::to_string(cls) + " is not supported";
      }
      // Link info (0x02) and attribute info (0x15): a defined fractal heap address means dense
      // storage (links or attributes in a fractal heap indexed by v2 B-trees).
      if (type == 0x02 || type == 0x15) {
        if (size < 2) return "link or attribute info message too short";
        const uint64_t heap = data + 2 + ((f[data + 1] & 1) ? (type == 0x02 ? 8 : 2) : 0);
        if (heap + 8 > data + size) return "link or attribute info message too short";
        if (le_bytes(f + heap, 8) != ~uint64_t(0))
          return type == 0x02 ? "dense link storage (a fractal heap) is not supported"
                              : "dense attribute storage (a fractal heap) is not supported";
      }
      if (type == 0x10) {  // continuation: offset and length
        if (size < 16) return "object header continuation too short";
        todo.push_back({le_bytes(f + data, 8), le_bytes(f + data + 8, 8), false});
      }
      p = data + size;
    }
  }
  return "";
}

// Checks the object header at `addr` (once per file opened read-only); "" or what is wrong.
std::string check_header_once(const FileInfo& info, uint64_t addr) {
  if (info.checked_headers.count(addr)) return "";
  std::string problem = check_object_header(info.bytes, info.size, addr, info);
  if (problem.empty()) info.checked_headers.insert(addr);
  return problem;
}

// Before libhdf5 opens the object link `name` of `g` leads to (of a file opened read-only): the
// link must be a hard link (a soft or external link could lead anywhere, another file included)
// and its target's header must pass check_object_header, whose chunk sizes are bounded by the
// file's size (a corrupt header size made H5O_protect allocate 12 GB; found by scripts/fuzz.sh).
void check_link_target(const Object& g, const std::string& name) {
  const FileInfo& info = g.file_info();
  if (!info.untrusted || !info.bytes) return;
#if !H5_VERSION_GE(1, 12, 0)
  H5L_info_t link{};
  if (H5Lget_info(g.id(), name.c_str(), &link, H5P_DEFAULT) < 0) g.fail("cannot read link " + name);
  if (link.type != H5L_TYPE_HARD) g.fail(name + " is not a hard link (soft and external links are not supported)");
  if (std::string problem = check_header_once(info, link.u.address); !problem.empty())
    g.fail(name + ": corrupt object header (" + problem + ")");
#endif
}

// Checks the attribute messages of obj's object header once per file opened read-only.
void check_attributes_decodable(const Object& obj) {
  const FileInfo& info = obj.file_info();
  if (!info.untrusted || !info.bytes) return;
#if !H5_VERSION_GE(1, 12, 0)
  H5O_info_t oinfo{};
  if (H5Oget_info2(obj.id(), &oinfo, H5O_INFO_BASIC) < 0) obj.fail("cannot read the object header");
  if (std::string problem = check_header_once(info, oinfo.addr); !problem.empty())
    obj.fail("corrupt object header (" + problem + ")");
#endif
}

namespace {
// Every attribute name, the checksum's included.
std::vector<std::string> attr_names_raw(const Object& obj) {
  // A name no attribute has makes H5Aexists decode every attribute message, so a corrupt one is
  // refused here before H5Aiterate2 could crash on it (see has_attr).
  check_attributes_decodable(obj);
  if (H5Aexists(obj.id(), "\x01kvcc-probe") < 0) obj.fail("cannot read attributes (corrupt object header)");
  std::vector<std::string> names;
  hsize_t index = 0;
  if (H5Aiterate2(obj.id(), H5_INDEX_NAME, H5_ITER_INC, &index, collect_attr_name, &names) < 0)
    obj.fail("cannot list attributes");
  return names;
}

// In a sealed file, an object's attributes are read only after its checksum matched. The object
// counts as checked while its checksum is computed, so the reads that computes pass through.
void check_seal(const Object& obj) {
  const FileInfo& info = obj.file_info();
  if (!info.sealed || !info.sealed_ok.insert(obj.path()).second) return;
  try {
    const std::vector<std::string> names = attr_names_raw(obj);
    if (names.empty()) return;
    if (std::find(names.begin(), names.end(), kAttributesChecksum) == names.end())
      obj.fail("attributes carry no checksum (" + std::string(kAttributesChecksum) + " missing)");
    if (obj.attr_string(kAttributesChecksum) != obj.attributes_digest())
      obj.fail("attributes edited or corrupt (" + std::string(kAttributesChecksum) + " does not match)");
  } catch (...) {
    info.sealed_ok.erase(obj.path());
    throw;
  }
}
}  // namespace

// H5Aexists, not H5Aiterate2: on an attribute message that fails to decode, libhdf5 1.10's
// iteration frees a half-built table of attributes and crashes (H5A__attr_release_table ->
// H5A__close, found by tests/test_formats_mutations.cpp), while H5Aexists reports an error.
bool Object::has_attr(const std::string& name) const {
  check_attributes_decodable(*this);
  check_seal(*this);
  const htri_t exists = H5Aexists(id(), name.c_str());
  if (exists < 0) fail("cannot read attributes (corrupt object header)");
  return exists > 0;
}

std::vector<std::string> Object::attr_names() const {
  check_seal(*this);
  std::vector<std::string> names = attr_names_raw(*this);
  names.erase(std::remove(names.begin(), names.end(), kAttributesChecksum), names.end());
  return names;
}

namespace {

void write_attr(const Object& obj, const std::string& name, hid_t ftype, hid_t mtype, const void* value) {
  if (obj.has_attr(name) && H5Adelete(obj.id(), name.c_str()) < 0) obj.fail("cannot replace attribute " + name);
  Handle space(H5Screate(H5S_SCALAR), H5Sclose);
  Handle attr(H5Acreate2(obj.id(), name.c_str(), ftype, space.get(), H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
  if (attr.get() < 0 || H5Awrite(attr.get(), mtype, value) < 0) obj.fail("cannot write attribute " + name);
}

// Opens attribute `name`, checking that it holds exactly one value (a scalar or a one-element
// array) of a type no larger than kMaxStringBytes, before any read.
Handle open_attr(const Object& obj, const std::string& name) {
  if (!obj.has_attr(name)) obj.fail("missing attribute " + name);
  Handle attr(H5Aopen(obj.id(), name.c_str(), H5P_DEFAULT), H5Aclose);
  if (attr.get() < 0) obj.fail("cannot open attribute " + name);
  Handle space(H5Aget_space(attr.get()), H5Sclose);
  if (space.get() < 0) obj.fail("cannot read the dataspace of attribute " + name);
  const H5S_class_t space_class = H5Sget_simple_extent_type(space.get());
  if ((space_class != H5S_SCALAR && space_class != H5S_SIMPLE) || H5Sget_simple_extent_npoints(space.get()) != 1)
    obj.fail("attribute " + name + " is not a single value");
  Handle type(H5Aget_type(attr.get()), H5Tclose);
  if (type.get() < 0) obj.fail("cannot read the type of attribute " + name);
  const size_t size = H5Tget_size(type.get());
  if (size == 0 || size > kMaxStringBytes) obj.fail("attribute " + name + " has an invalid size");
  return attr;
}

// The raw reference a variable-length string attribute stores (sequence length, heap collection
// address, object index: 4 + 8 + 4 bytes), passed through unconverted: registered as the
// conversion from a variable-length string to a 16-byte fixed string, a type pair nothing else
// converts between. libhdf5 1.10's own conversion (H5T__conv_vlen -> H5HG_read) trusts the length
// and the index (a corrupt one read out of bounds, a SEGV found by the mutation test).
constexpr size_t kVlenRefBytes = 16;
herr_t pass_vlen_reference(hid_t src, hid_t dst, H5T_cdata_t* cdata, size_t, size_t, size_t, void*, void*, hid_t) {
  if (cdata->command == H5T_CONV_INIT) {
    if (H5Tis_variable_str(src) <= 0 || H5Tget_class(dst) != H5T_STRING || H5Tis_variable_str(dst) != 0 ||
        H5Tget_size(dst) != kVlenRefBytes || H5Tget_size(src) != kVlenRefBytes)
      return -1;
    cdata->need_bkg = H5T_BKG_NO;
    return 0;
  }
  return 0;  // H5T_CONV_CONV: source and destination are the same 16 bytes; H5T_CONV_FREE: nothing
}

void register_vlen_passthrough() {
  static const bool registered = [] {
    Handle src(H5Tcopy(H5T_C_S1), H5Tclose);
    H5Tset_size(src.get(), H5T_VARIABLE);
    Handle dst(H5Tcopy(H5T_C_S1), H5Tclose);
    H5Tset_size(dst.get(), kVlenRefBytes);
    return H5Tregister(H5T_PERS_SOFT, "kvcc_vlen_reference", src.get(), dst.get(), pass_vlen_reference) >= 0;
  }();
  if (!registered) throw Error("HDF5: cannot register kvcc's string reader");
}

// A variable-length string of a file opened read-only, from the global heap collections parsed
// and checked when it was opened: the reference must name an object of one of them, at most as
// long as that object.
std::string read_vlen_string_raw(const Object& obj, const std::string& name, hid_t attr) {
  register_vlen_passthrough();
  Handle mtype(H5Tcopy(H5T_C_S1), H5Tclose);
  if (H5Tset_size(mtype.get(), kVlenRefBytes) < 0 || H5Tset_strpad(mtype.get(), H5T_STR_NULLPAD) < 0)
    obj.fail("cannot read attribute " + name);
  unsigned char ref[kVlenRefBytes] = {};
  if (H5Aread(attr, mtype.get(), ref) < 0) obj.fail("cannot read attribute " + name + " (corrupt string)");
  const uint64_t length = le_bytes(ref, 4), address = le_bytes(ref + 4, 8), index = le_bytes(ref + 12, 4);
  if (length == 0) return "";
  const auto& heaps = obj.file_info().heaps;
  const auto heap = heaps.find(address);
  if (heap == heaps.end()) obj.fail("attribute " + name + " refers to no string storage (corrupt file)");
  const auto object = heap->second.objects.find(uint32_t(index));
  if (index > 0xffff || object == heap->second.objects.end())
    obj.fail("attribute " + name + " refers to a missing string (corrupt file)");
  const auto [offset, size] = object->second;
  if (length > size || length > kMaxStringBytes)
    obj.fail("attribute " + name + " has an invalid length (corrupt file)");
  return heap->second.bytes.substr(offset, size_t(length));
}

// A string attribute's bytes: fixed-length strings are read into a buffer of the (checked) type
// size; variable-length ones from the checked heap copies (read_vlen_string_raw) for a file opened
// read-only, through libhdf5 for one kvcc is writing (File::create, open_rw).
std::string read_string_attr(const Object& obj, const std::string& name, hid_t attr) {
  Handle ftype(H5Aget_type(attr), H5Tclose);
  if (H5Tget_class(ftype.get()) != H5T_STRING) obj.fail("attribute " + name + " is not a string");
  const H5T_cset_t cset = H5Tget_cset(ftype.get());
  if (cset != H5T_CSET_ASCII && cset != H5T_CSET_UTF8) obj.fail("attribute " + name + " has an unknown character set");
  const htri_t variable = H5Tis_variable_str(ftype.get());
  if (variable < 0) obj.fail("attribute " + name + " has an invalid string type");
  if (variable > 0 && obj.file_info().untrusted) return read_vlen_string_raw(obj, name, attr);
  if (variable > 0) {
    Handle mtype(H5Tcopy(H5T_C_S1), H5Tclose);
    if (H5Tset_size(mtype.get(), H5T_VARIABLE) < 0 || H5Tset_cset(mtype.get(), cset) < 0)
      obj.fail("cannot read attribute " + name);
    char* ptr = nullptr;
    if (H5Aread(attr, mtype.get(), &ptr) < 0) obj.fail("cannot read attribute " + name + " (corrupt string)");
    const size_t length = ptr ? ::strnlen(ptr, kMaxStringBytes + 1) : 0;
    std::string out(ptr ? ptr : "", length);
    if (ptr) H5free_memory(ptr);
    if (length > kMaxStringBytes || length > obj.file_size()) obj.fail("attribute " + name + " is too long");
    return out;
  }
  const size_t size = H5Tget_size(ftype.get());  // checked by open_attr
  if (size > obj.file_size()) obj.fail("attribute " + name + " is longer than the file");
  // Read as a fixed-length string of exactly that size, whatever padding the file declares.
  Handle mtype(H5Tcopy(H5T_C_S1), H5Tclose);
  if (H5Tset_size(mtype.get(), size) < 0 || H5Tset_strpad(mtype.get(), H5T_STR_NULLPAD) < 0 ||
      H5Tset_cset(mtype.get(), cset) < 0)
    obj.fail("cannot read attribute " + name);
  std::string buf(size + 1, '\0');
  if (H5Aread(attr, mtype.get(), buf.data()) < 0) obj.fail("cannot read attribute " + name);
  buf.resize(::strnlen(buf.data(), size));
  while (!buf.empty() && buf.back() == ' ') buf.pop_back();  // space-padded (Fortran style)
  return buf;
}

}  // namespace

void Object::set_attr(const std::string& name, const std::string& value) const {
  Handle type(H5Tcopy(H5T_C_S1), H5Tclose);
  H5Tset_size(type.get(), H5T_VARIABLE);
  H5Tset_cset(type.get(), H5T_CSET_UTF8);
  const char* ptr = value.c_str();
  write_attr(*this, name, type.get(), type.get(), &ptr);
}
void Object::set_attr(const std::string& name, int64_t value) const {
  write_attr(*this, name, H5T_STD_I64LE, H5T_NATIVE_INT64, &value);
}
void Object::set_attr(const std::string& name, uint64_t value) const {
  write_attr(*this, name, H5T_STD_U64LE, H5T_NATIVE_UINT64, &value);
}
void Object::set_attr(const std::string& name, double value) const {
  write_attr(*this, name, H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, &value);
}

std::string Object::attr_string(const std::string& name) const {
  Handle attr = open_attr(*this, name);
  return read_string_attr(*this, name, attr.get());
}

int64_t Object::attr_int(const std::string& name) const {
  Handle attr = open_attr(*this, name);
  Handle ftype(H5Aget_type(attr.get()), H5Tclose);
  if (H5Tget_class(ftype.get()) != H5T_INTEGER || !is_standard_integer(ftype.get()))
    fail("attribute " + name + " is not an integer");
  int64_t v = 0;
  if (H5Aread(attr.get(), H5T_NATIVE_INT64, &v) < 0) fail("cannot read attribute " + name);
  return v;
}

int Object::attr_int32(const std::string& name, int lo, int hi) const {
  const int64_t v = attr_int(name);
  if (v < lo || v > hi)
    fail("attribute " + name + " = " + std::to_string(v) + " is out of range [" + std::to_string(lo) + ", " +
         std::to_string(hi) + "]");
  return int(v);
}

uint64_t Object::attr_uint(const std::string& name) const {
  Handle attr = open_attr(*this, name);
  Handle ftype(H5Aget_type(attr.get()), H5Tclose);
  if (H5Tget_class(ftype.get()) != H5T_INTEGER || !is_standard_integer(ftype.get()))
    fail("attribute " + name + " is not an integer");
  if (H5Tget_sign(ftype.get()) == H5T_SGN_2) {
    int64_t v = 0;
    if (H5Aread(attr.get(), H5T_NATIVE_INT64, &v) < 0) fail("cannot read attribute " + name);
    if (v < 0) fail("attribute " + name + " is negative (" + std::to_string(v) + ")");
    return uint64_t(v);
  }
  uint64_t v = 0;
  if (H5Aread(attr.get(), H5T_NATIVE_UINT64, &v) < 0) fail("cannot read attribute " + name);
  return v;
}

double Object::attr_double(const std::string& name) const {
  Handle attr = open_attr(*this, name);
  Handle ftype(H5Aget_type(attr.get()), H5Tclose);
  const H5T_class_t cls = H5Tget_class(ftype.get());
  if (!(cls == H5T_FLOAT && is_standard_float(ftype.get())) &&
      !(cls == H5T_INTEGER && is_standard_integer(ftype.get())))
    fail("attribute " + name + " is not a number");
  double v = 0;
  if (H5Aread(attr.get(), H5T_NATIVE_DOUBLE, &v) < 0) fail("cannot read attribute " + name);
  return v;
}

std::string Object::attributes_digest() const {
  std::vector<std::string> names = attr_names_raw(*this);
  std::sort(names.begin(), names.end());  // byte order, whatever order the file keeps
  std::string text;
  for (const std::string& name : names) {
    if (name == kAttributesChecksum) continue;
    // Each attribute as `len:name` then `len:` and its kind and value: s + the string, i / u + the
    // integer in decimal, f + the float's 64 bits in 16 lowercase hex digits.
    Handle attr = open_attr(*this, name);
    Handle ftype(H5Aget_type(attr.get()), H5Tclose);
    std::string value;
    switch (H5Tget_class(ftype.get())) {
      case H5T_STRING:
        value = "s" + read_string_attr(*this, name, attr.get());
        break;
      case H5T_INTEGER:
        value = H5Tget_sign(ftype.get()) == H5T_SGN_2 ? "i" + std::to_string(attr_int(name))
                                                      : "u" + std::to_string(attr_uint(name));
        break;
      case H5T_FLOAT: {
        const double v = attr_double(name);
        uint64_t bits = 0;
        std::memcpy(&bits, &v, sizeof bits);
        char hex[17];
        std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(bits));
        value = std::string("f") + hex;
        break;
      }
      default:
        fail("attribute " + name + " has a type kvcc does not store");
    }
    text += std::to_string(name.size()) + ":" + name + std::to_string(value.size()) + ":" + value;
  }
  return sha256_hex(text.data(), text.size());
}

// ---------------------------------------------------------------- Dataset

Shape Dataset::shape() const {
  Handle space(H5Dget_space(id()), H5Sclose);
  if (space.get() < 0) fail("cannot read dataset shape");
  const H5S_class_t space_class = H5Sget_simple_extent_type(space.get());
  if (space_class != H5S_SCALAR && space_class != H5S_SIMPLE) fail("dataset has no simple shape");
  const int rank = H5Sget_simple_extent_ndims(space.get());
  if (rank < 0 || rank > H5S_MAX_RANK) fail("cannot read dataset shape");
  std::vector<hsize_t> dims(static_cast<size_t>(rank));
  if (H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr) < 0) fail("cannot read dataset shape");
  Shape shape;
  for (hsize_t x : dims) {
    if (x > hsize_t(std::numeric_limits<int64_t>::max())) fail("dataset has an invalid shape");
    shape.push_back(int64_t(x));
  }
  if (element_count(shape) < 0) fail("dataset shape " + shape_string(shape) + " overflows");
  return shape;
}

DType Dataset::dtype() const {
  Handle type(H5Dget_type(id()), H5Tclose);
  if (type.get() < 0) fail("cannot read the element type");
  const H5T_class_t cls = H5Tget_class(type.get());
  const size_t size = H5Tget_size(type.get());
  const bool standard = cls == H5T_FLOAT ? is_standard_float(type.get()) : is_standard_integer(type.get());
  if (cls == H5T_FLOAT && standard) {
    if (size == 8) return DType::Float64;
    if (size == 4) return DType::Float32;
  } else if (cls == H5T_INTEGER && standard) {
    const bool is_signed = H5Tget_sign(type.get()) == H5T_SGN_2;
    if (is_signed && size == 4) return DType::Int32;
    if (is_signed && size == 8) return DType::Int64;
    if (!is_signed && size == 1) return DType::UInt8;
    if (!is_signed && size == 2) return DType::UInt16;
    if (!is_signed && size == 4) return DType::UInt32;
    if (!is_signed && size == 8) return DType::UInt64;
  }
  fail("unsupported element type (class " + std::to_string(int(cls)) + ", " + std::to_string(size) + " bytes)");
}

void Dataset::check_readable(const Shape& shape, DType type) const {
  const int64_t count = element_count(shape);
  if (count < 0) fail("invalid shape " + shape_string(shape));
  const uint64_t elem = dtype_size(type);
  if (uint64_t(count) > std::numeric_limits<uint64_t>::max() / elem)
    fail("shape " + shape_string(shape) + " overflows");
  const uint64_t bytes = uint64_t(count) * elem;
  if (bytes == 0) return;
  Handle dcpl(H5Dget_create_plist(id()), H5Pclose);
  if (dcpl.get() < 0) fail("cannot read the dataset's storage properties");
  const H5D_layout_t layout = H5Pget_layout(dcpl.get());
  if (layout != H5D_COMPACT && layout != H5D_CONTIGUOUS)
    fail(layout == H5D_CHUNKED ? std::string(kChunkedRefusal)
                               : "unsupported storage layout (" + std::to_string(int(layout)) + ")");
  const int external = H5Pget_external_count(dcpl.get());
  if (external != 0) fail("external storage is not supported");
  // libhdf5 1.10 copies a compact dataset's whole extent out of the bytes its layout message
  // holds without comparing the two sizes (a short or empty buffer read past it or from null).
  if (layout == H5D_COMPACT && H5Dget_storage_size(id()) < bytes)
    fail("compact storage holds " + std::to_string(H5Dget_storage_size(id())) + " bytes, its shape " +
         shape_string(shape) + " needs " + std::to_string(bytes) + " (corrupt file)");
  const uint64_t file = file_size();
  if (bytes > file)
    fail("shape " + shape_string(shape) + " needs " + std::to_string(bytes) + " bytes, more than a file of " +
         std::to_string(file) + " bytes holds (corrupt file)");
}

int64_t Dataset::file_offset() const {
  const haddr_t offset = H5Dget_offset(id());
  return offset == HADDR_UNDEF ? -1 : int64_t(offset);
}

// ---------------------------------------------------------------- Group

bool Group::has(const std::string& name) const { return H5Lexists(id(), name.c_str(), H5P_DEFAULT) > 0; }

std::vector<std::string> Group::children() const {
  std::vector<std::string> names;
  unsigned order_flags = 0;
  Handle gcpl(H5Gget_create_plist(id()), H5Pclose);
  if (gcpl.get() >= 0) H5Pget_link_creation_order(gcpl.get(), &order_flags);
  const H5_index_t index_type = (order_flags & H5P_CRT_ORDER_INDEXED) ? H5_INDEX_CRT_ORDER : H5_INDEX_NAME;
  hsize_t index = 0;
  if (H5Literate(id(), index_type, H5_ITER_INC, &index, collect_name, &names) < 0) fail("cannot list members");
  return names;
}

Group Group::group(const std::string& name) const {
  const std::string path = child_path(name);
  if (!has(name)) throw Error(file_name_ + ": missing group " + path);
  check_link_target(*this, name);
  hid_t g = H5Gopen2(id(), name.c_str(), H5P_DEFAULT);
  if (g < 0) throw Error(file_name_ + ": " + path + " is not a group");
  return Group(std::make_shared<Handle>(g, H5Gclose), file_name_, path, info_);
}

Group Group::create_group(const std::string& name, bool track_order) const {
  const std::string path = child_path(name);
  Handle gcpl(H5Pcreate(H5P_GROUP_CREATE), H5Pclose);
  if (track_order) H5Pset_link_creation_order(gcpl.get(), H5P_CRT_ORDER_TRACKED | H5P_CRT_ORDER_INDEXED);
  hid_t g = H5Gcreate2(id(), name.c_str(), H5P_DEFAULT, gcpl.get(), H5P_DEFAULT);
  if (g < 0) throw Error(file_name_ + ": cannot create group " + path);
  return Group(std::make_shared<Handle>(g, H5Gclose), file_name_, path, info_);
}

Dataset Group::dataset(const std::string& name) const {
  const std::string path = child_path(name);
  if (!has(name)) throw Error(file_name_ + ": missing dataset " + path);
  check_link_target(*this, name);
  hid_t d = H5Dopen2(id(), name.c_str(), H5P_DEFAULT);
  if (d < 0) throw Error(file_name_ + ": " + path + " is not a dataset");
  return Dataset(std::make_shared<Handle>(d, H5Dclose), file_name_, path, info_);
}

Dataset Group::write_raw(const std::string& name, const Shape& shape, DType type, const void* data,
                         size_t count) const {
  const std::string path = child_path(name);
  if (int64_t(count) != element_count(shape))
    throw Error(file_name_ + ": " + path + ": " + std::to_string(count) + " values do not fill shape " +
                shape_string(shape));
  std::vector<hsize_t> dims(shape.begin(), shape.end());
  Handle space(shape.empty() ? H5Screate(H5S_SCALAR) : H5Screate_simple(int(dims.size()), dims.data(), nullptr),
               H5Sclose);
  if (space.get() < 0) throw Error(file_name_ + ": " + path + ": invalid shape " + shape_string(shape));
  hid_t d = H5Dcreate2(id(), name.c_str(), file_type(type), space.get(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
  if (d < 0) throw Error(file_name_ + ": cannot create dataset " + path);
  Dataset ds(std::make_shared<Handle>(d, H5Dclose), file_name_, path, info_);
  if (count > 0 && H5Dwrite(d, memory_type(type), H5S_ALL, H5S_ALL, H5P_DEFAULT, data) < 0)
    throw Error(file_name_ + ": cannot write dataset " + path + " (disk full?)");
  return ds;
}

Shape Group::checked_shape(const Dataset& ds, DType type, const Shape* expected) const {
  const DType stored = ds.dtype();
  if (stored != type)
    throw Error(file_name_ + ": " + ds.path() + " has dtype " + dtype_name(stored) + ", expected " + dtype_name(type));
  Shape shape = ds.shape();
  if (expected && shape != *expected)
    throw Error(file_name_ + ": " + ds.path() + " has shape " + shape_string(shape) + ", expected " +
                shape_string(*expected));
  ds.check_readable(shape, type);
  return shape;
}

void Group::read_raw(const Dataset& ds, DType type, void* out) const {
  const Shape shape = ds.shape();
  if (element_count(shape) == 0) return;
  ds.check_readable(shape, type);
  if (H5Dread(ds.id(), memory_type(type), H5S_ALL, H5S_ALL, H5P_DEFAULT, out) < 0)
    throw Error(file_name_ + ": cannot read dataset " + ds.path() + " (corrupt or truncated file)");
}

// ---------------------------------------------------------------- File

File File::create(const std::string& path, const std::string& display_name) {
  silence_hdf5_errors();
  const std::string name = display_name.empty() ? path : display_name;
  Handle fapl(make_file_access(name), H5Pclose);
  hid_t f = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl.get());
  if (f < 0) throw Error(name + ": cannot create HDF5 file");
  return File(std::make_shared<Handle>(f, H5Fclose), name, "/", std::make_shared<FileInfo>());
}

namespace {

// libhdf5 1.10 trusts the object sizes inside a global heap collection (where variable-length
// strings live): a corrupt size made H5HG_read copy past the collection (heap overflow,
// overlapping memcpy) and a zero-sized free-space object made the collection's parser loop
// forever. So before HDF5 opens a file, every global heap collection in it (signature "GCOL",
// version 1, three zero bytes) is parsed here and must be consistent: inside the file, at least
// the 4 KiB minimum, and its objects (16-byte header, 8-byte aligned data) tiling it, ending with
// the free-space object (index 0) or with less than one header of slack. The collections are kept
// (FileInfo::heaps): strings are read from them, not by libhdf5 (read_string_attr).
// Returns "" or what is wrong.
std::string parse_global_heaps(const unsigned char* data, size_t size, FileInfo& info) {
  static const unsigned char kSig[] = {'G', 'C', 'O', 'L', 1, 0, 0, 0};
  constexpr size_t kHeader = 16, kObjHeader = 16, kMinCollection = 4096;
  for (const unsigned char* p = data; size >= sizeof kSig && p <= data + size - sizeof kSig;) {
    p = static_cast<const unsigned char*>(::memmem(p, size_t(data + size - p), kSig, sizeof kSig));
    if (!p) break;
    const size_t at = size_t(p - data);
    ++p;
    const std::string where = "global heap at " + std::to_string(at);
    if (size - at < kHeader) return where + " is truncated";
    const uint64_t length = le_bytes(data + at + 8, 8);
    if (length < kMinCollection || length > size - at) return where + " has an invalid size " + std::to_string(length);
    HeapCollection heap;
    heap.bytes.assign(reinterpret_cast<const char*>(data + at), size_t(length));
    const size_t end = size_t(length);
    size_t q = kHeader;
    while (q < end) {
      if (end - q < kObjHeader) break;  // slack too small for an object: free space
      const unsigned char* h = data + at + q;
      const uint32_t index = uint32_t(le_bytes(h, 2));
      const uint64_t object = le_bytes(h + 8, 8);
      if (index == 0) {  // free space, the rest of the collection (its size includes its header)
        if (object != end - q) return where + " has an invalid free-space size";
        break;
      }
      const uint64_t need = kObjHeader + ((object + 7) & ~uint64_t(7));
      if (object > end - q || need > end - q) return where + ": object " + std::to_string(index) + " overruns it";
      if (!heap.objects.emplace(index, std::make_pair(q + kObjHeader, size_t(object))).second)
        return where + ": object " + std::to_string(index) + " appears twice";
      q += size_t(need);
    }
    info.heaps.emplace(uint64_t(at), std::move(heap));
  }
  return "";
}

// Maps the file read-only and parses its global heaps; "" when sound (or empty).
std::string read_file_info(const std::string& path, FileInfo& info) {
  if (info.size == 0) return "";
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return "cannot open";
  void* map = ::mmap(nullptr, size_t(info.size), PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (map == MAP_FAILED) return "cannot map";
  info.bytes = static_cast<const unsigned char*>(map);  // unmapped by ~FileInfo
  if (std::string problem = parse_global_heaps(info.bytes, size_t(info.size), info); !problem.empty()) return problem;
  // The root group's object header, which H5Fopen loads (a corrupt size made it allocate 4 GB):
  // its address from the superblock, which must be at offset 0 with base address 0 (what kvcc and
  // h5py write; every address checked here is then a file offset).
  const unsigned char* f = info.bytes;
  if (info.size < 96 || std::memcmp(f, "\x89HDF\r\n\x1a\n", 8) != 0)
    return "no superblock at offset 0 (user blocks are not supported)";
  const unsigned version = f[8];
  uint64_t base = 0, root = 0;
  // The end-of-file address the writer recorded: a shorter file was cut (a copy or download that
  // stopped), the commonest corruption, named as such.
  const uint64_t eof = le_bytes(f + (version <= 1 ? (version == 0 ? 40 : 44) : 28), 8);
  if (version <= 3 && eof != ~uint64_t(0) && eof > info.size)
    return "truncated HDF5 file (" + std::to_string(info.size) + " of its " + std::to_string(eof) + " bytes)";
  if (version <= 1) {
    const size_t at = version == 0 ? 24 : 28;
    info.group_leaf_k = unsigned(le_bytes(f + 16, 2));
    info.group_internal_k = unsigned(le_bytes(f + 18, 2));
    if (info.group_leaf_k == 0 || info.group_internal_k == 0) return "superblock: group K of 0";
    base = le_bytes(f + at, 8);
    // base, free space, EOF, driver info; then the root's symbol table entry: name offset, object
    // header, cache type, reserved, scratch pad (the root group's B-tree and heap when cached).
    const size_t entry = at + 32;
    root = le_bytes(f + entry + 8, 8);
    if (base == 0 && le_bytes(f + entry + 16, 4) == 1)
      if (std::string problem =
              check_symbol_table(f, info.size, le_bytes(f + entry + 24, 8), le_bytes(f + entry + 32, 8), info);
          !problem.empty())
        return "root group: " + problem;
  } else if (version <= 3) {
    base = le_bytes(f + 12, 8);
    root = le_bytes(f + 36, 8);
  } else {
    return "superblock version " + std::to_string(version);
  }
  if (base != 0) return "base address " + std::to_string(base) + " (expected 0)";
  if (std::string problem = check_header_once(info, root); !problem.empty())
    return "root group: corrupt object header (" + problem + ")";
  return "";
}

hid_t open_checked(const std::string& path, const std::string& name, unsigned flags, FileInfo& info) {
  silence_hdf5_errors();
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) throw Error(name + ": no such file");
  if (S_ISDIR(st.st_mode)) throw Error(name + ": is a directory, expected an HDF5 file");
  if (!S_ISREG(st.st_mode)) throw Error(name + ": not a regular file");
  info.size = uint64_t(st.st_size);
  Handle fapl(make_file_access(name), H5Pclose);
#if H5_VERSION_GE(1, 12, 0)
  const htri_t is_hdf5 = H5Fis_accessible(path.c_str(), fapl.get());
#else
  const htri_t is_hdf5 = H5Fis_hdf5(path.c_str());
#endif
  if (is_hdf5 <= 0) throw Error(name + ": not an HDF5 file (or truncated)");
  if (const std::string problem = read_file_info(path, info); !problem.empty())
    throw Error(name + (problem.rfind("truncated", 0) == 0 ? ": " + problem : ": corrupt HDF5 file (" + problem + ")"));
  hid_t f = H5Fopen(path.c_str(), flags, fapl.get());
  if (f < 0) throw Error(name + ": not an HDF5 file (or truncated)");
  // Variable-length string references are parsed here assuming HDF5's default 8-byte addresses
  // and lengths (what every writer kvcc knows uses).
  Handle fcpl(H5Fget_create_plist(f), H5Pclose);
  size_t sizeof_addr = 0, sizeof_size = 0;
  if (fcpl.get() < 0 || H5Pget_sizes(fcpl.get(), &sizeof_addr, &sizeof_size) < 0 || sizeof_addr != 8 ||
      sizeof_size != 8) {
    H5Fclose(f);
    throw Error(name + ": unsupported HDF5 file (addresses and lengths must be 8 bytes)");
  }
  return f;
}
}  // namespace

File File::open(const std::string& path, const std::string& display_name) {
  const std::string name = display_name.empty() ? path : display_name;
  auto info = std::make_shared<FileInfo>();
  info->untrusted = true;
  hid_t f = open_checked(path, name, H5F_ACC_RDONLY, *info);
  return File(std::make_shared<Handle>(f, H5Fclose), name, "/", std::move(info));
}

File File::open_rw(const std::string& path, const std::string& display_name) {
  const std::string name = display_name.empty() ? path : display_name;
  FileInfo checked;
  hid_t f = open_checked(path, name, H5F_ACC_RDWR, checked);
  // Written to after opening: its size no longer bounds what it holds, and strings written now
  // live in heaps parsed before; it is read as kvcc's own output (tests that edit files).
  return File(std::make_shared<Handle>(f, H5Fclose), name, "/", std::make_shared<FileInfo>());
}

void File::require_sealed_attributes() const {
  info_->sealed = true;
  check_seal(*this);
}

void seal_attributes(const Group& g) {
  for (const std::string& name : g.children()) {
#if H5_VERSION_GE(1, 12, 0)
    H5O_info2_t oinfo{};
    const herr_t got = H5Oget_info_by_name3(g.id(), name.c_str(), &oinfo, H5O_INFO_BASIC, H5P_DEFAULT);
#else
    H5O_info_t oinfo{};
    const herr_t got = H5Oget_info_by_name2(g.id(), name.c_str(), &oinfo, H5O_INFO_BASIC, H5P_DEFAULT);
#endif
    if (got < 0) g.fail("cannot read the object " + name);
    if (oinfo.type == H5O_TYPE_GROUP) {
      seal_attributes(g.group(name));
    } else {
      const Dataset ds = g.dataset(name);
      if (!ds.attr_names().empty()) ds.set_attr(kAttributesChecksum, ds.attributes_digest());
    }
  }
  if (!g.attr_names().empty()) g.set_attr(kAttributesChecksum, g.attributes_digest());
}

void File::close() {
  if (id() < 0) return;
  if (H5Fflush(id(), H5F_SCOPE_GLOBAL) < 0) throw Error(file_name_ + ": cannot flush HDF5 file (disk full?)");
  if (!handle_->reset()) throw Error(file_name_ + ": cannot close HDF5 file");
}

}  // namespace kvcc::h5
