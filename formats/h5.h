// A small RAII layer over the HDF5 C API (1.10 and 1.14) for kvcc's artifact and stats files.
// HDF5's own error printing is silenced; every failure becomes a kvcc::Error that names the file
// and the object ("stats.h5: missing dataset /layers/3/kv1/query_m2"). Files are written with
// little-endian standard types; strings are variable-length UTF-8 (what h5py writes too).
//
// Files opened with File::open are untrusted input (libhdf5 1.10 itself trusts sizes in the file,
// and crashed, hung or allocated gigabytes on corrupt ones). Before libhdf5 opens the file its
// global heap collections are parsed and checked, and variable-length strings are read from those
// copies; before an object is opened its link must be a hard link and its object header (chunk
// sizes, attribute messages) must be consistent with the file; before anything is read its HDF5
// type must be one of the standard types below (or a plain string), an attribute must hold one
// value, and a dataset's size is checked against the file's size before a buffer is allocated (a
// dataset cannot hold more raw bytes than its file). Structures kvcc never writes are refused
// before libhdf5 parses them: chunked storage (its chunk index), dense link and attribute storage
// (fractal heaps, v2 B-trees). A corrupt file is refused with an Error naming what is wrong.
#pragma once
#include <hdf5.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace kvcc::h5 {

// Owns one HDF5 identifier and closes it with the matching H5*close.
class Handle {
 public:
  using Closer = herr_t (*)(hid_t);
  Handle() = default;
  Handle(hid_t id, Closer closer) : id_(id), closer_(closer) {}
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  Handle(Handle&& o) noexcept : id_(o.id_), closer_(o.closer_) { o.id_ = H5I_INVALID_HID; }
  Handle& operator=(Handle&& o) noexcept;
  ~Handle() { reset(); }
  hid_t get() const { return id_; }
  // Closes now; returns false when HDF5 reports a failure (e.g. a failed flush on file close).
  bool reset();

 private:
  hid_t id_ = H5I_INVALID_HID;
  Closer closer_ = nullptr;
};

// The element types kvcc stores; `dtype_name` gives the numpy-style name used in messages.
enum class DType { Float64, Float32, Int32, Int64, UInt8, UInt16, UInt32, UInt64 };
const char* dtype_name(DType);
template <class T>
constexpr DType dtype_of();
template <>
constexpr DType dtype_of<double>() {
  return DType::Float64;
}
template <>
constexpr DType dtype_of<float>() {
  return DType::Float32;
}
template <>
constexpr DType dtype_of<int32_t>() {
  return DType::Int32;
}
template <>
constexpr DType dtype_of<int64_t>() {
  return DType::Int64;
}
template <>
constexpr DType dtype_of<uint8_t>() {
  return DType::UInt8;
}
template <>
constexpr DType dtype_of<uint16_t>() {
  return DType::UInt16;
}
template <>
constexpr DType dtype_of<uint32_t>() {
  return DType::UInt32;
}
template <>
constexpr DType dtype_of<uint64_t>() {
  return DType::UInt64;
}

using Shape = std::vector<int64_t>;
std::string shape_string(const Shape&);  // "[128, 128]"
// The product of the dimensions; -1 when one is negative or the product overflows int64.
int64_t element_count(const Shape&);
size_t dtype_size(DType);

// The longest string attribute kvcc reads (a command line, a fingerprint field list).
inline constexpr size_t kMaxStringBytes = size_t(1) << 20;

// What File::open learnt from the file's bytes: its size, and its global heap collections
// (where variable-length strings live), parsed and checked (h5.cpp).
struct FileInfo;

// The attribute holding the sha256 of an object's other attributes (Object::attributes_digest).
inline constexpr const char* kAttributesChecksum = "attributes_sha256";

// A group, a dataset or a file's root: something attributes hang on.
class Object {
 public:
  const std::string& file_name() const { return file_name_; }
  const std::string& path() const { return path_; }  // "/layers/3/kv1"
  hid_t id() const { return handle_->get(); }
  // Bytes of the file when it was opened for reading (what bounds every read); UINT64_MAX for a
  // file being written.
  uint64_t file_size() const;
  const FileInfo& file_info() const { return *info_; }

  bool has_attr(const std::string& name) const;
  std::vector<std::string> attr_names() const;
  void set_attr(const std::string& name, const std::string& value) const;
  void set_attr(const std::string& name, const char* value) const { set_attr(name, std::string(value)); }
  void set_attr(const std::string& name, int64_t value) const;
  void set_attr(const std::string& name, int value) const { set_attr(name, int64_t(value)); }
  void set_attr(const std::string& name, uint64_t value) const;
  void set_attr(const std::string& name, double value) const;
  void set_attr(const std::string& name, bool value) const { set_attr(name, int64_t(value ? 1 : 0)); }
  // Throw Error "FILE: missing attribute NAME of PATH" / "... is not a string" etc.
  std::string attr_string(const std::string& name) const;
  int64_t attr_int(const std::string& name) const;
  // attr_int checked to lie in [lo, hi] ("attribute NAME = V is out of range [lo, hi]"), so no
  // caller narrows a corrupt 64-bit value into a plausible int.
  int attr_int32(const std::string& name, int lo, int hi) const;
  uint64_t attr_uint(const std::string& name) const;
  double attr_double(const std::string& name) const;  // accepts integer attributes too
  bool attr_bool(const std::string& name) const { return attr_int(name) != 0; }

  // Attribute checksums (formats from version 1.1; docs/formats.md): each object's attributes are
  // covered by its attribute kAttributesChecksum, the sha256 of attributes_digest_text. In a file
  // whose seal was required (File::require_sealed_attributes), every attribute read checks its
  // object's checksum first (once per object): an edited, added, removed or corrupt attribute is
  // an Error naming the object.
  std::string attributes_digest() const;

  // "FILE: PATH: message" as an Error, for callers validating contents.
  [[noreturn]] void fail(const std::string& message) const;
  std::string child_path(const std::string& name) const;

 protected:
  Object(std::shared_ptr<Handle> handle, std::string file_name, std::string path, std::shared_ptr<const FileInfo> info)
      : handle_(std::move(handle)), file_name_(std::move(file_name)), path_(std::move(path)), info_(std::move(info)) {}
  std::shared_ptr<Handle> handle_;
  std::string file_name_;
  std::string path_;
  std::shared_ptr<const FileInfo> info_;
};

class Dataset : public Object {
 public:
  Shape shape() const;  // throws Error for a dataspace that is not simple or scalar
  DType dtype() const;  // throws Error for a type kvcc does not store
  // Throws Error unless `shape` elements of `type` can be read: compact or contiguous storage in
  // the file itself (no chunked, external or virtual storage), no more bytes than the file holds.
  void check_readable(const Shape& shape, DType type) const;
  // Byte offset of contiguous data in the file (tests corrupt bytes through it); -1 if none.
  int64_t file_offset() const;

 private:
  friend class Group;
  using Object::Object;
};

class Group : public Object {
 public:
  bool has(const std::string& name) const;  // a direct child (group or dataset)
  // Names, in creation order when the group tracks it (create_group(..., true)), else name order.
  std::vector<std::string> children() const;
  Group group(const std::string& name) const;  // throws "missing group"
  Group create_group(const std::string& name, bool track_order = false) const;
  Dataset dataset(const std::string& name) const;  // throws "missing dataset"

  template <class T>
  Dataset write(const std::string& name, const Shape& shape, const std::vector<T>& data) const {
    return write_raw(name, shape, dtype_of<T>(), data.data(), data.size());
  }
  // Reads a dataset that must have exactly dtype T (no silent conversions) and, when
  // `expected_shape` is given, exactly that shape.
  template <class T>
  std::vector<T> read(const std::string& name, const Shape* expected_shape = nullptr,
                      Shape* shape_out = nullptr) const {
    Dataset ds = dataset(name);
    Shape shape = checked_shape(ds, dtype_of<T>(), expected_shape);  // bounded by the file's size
    std::vector<T> out(size_t(element_count(shape)));
    read_raw(ds, dtype_of<T>(), out.data());
    if (shape_out) *shape_out = shape;
    return out;
  }
  template <class T>
  std::vector<T> read(const std::string& name, const Shape& expected_shape) const {
    return read<T>(name, &expected_shape);
  }

  Dataset write_raw(const std::string& name, const Shape& shape, DType type, const void* data, size_t count) const;
  void read_raw(const Dataset& ds, DType type, void* out) const;

 protected:
  friend class File;
  using Object::Object;
  // The dataset's shape after checking its dtype is `type`, its shape `expected` (when given) and
  // that it fits the file (Dataset::check_readable).
  Shape checked_shape(const Dataset& ds, DType type, const Shape* expected) const;
};

class File : public Group {
 public:
  // Creates (truncating) `path`. `display_name` names the file in errors (the final name when
  // `path` is a temporary); defaults to `path`.
  static File create(const std::string& path, const std::string& display_name = "");
  // Opens read-only. A missing file, a non-HDF5 file or a truncated one gives a one-line Error.
  static File open(const std::string& path, const std::string& display_name = "");
  static File open_rw(const std::string& path, const std::string& display_name = "");
  // Flushes and closes, turning a failed flush into an Error (destructors cannot report it).
  void close();
  // From now on every object's attributes must carry a matching checksum (kAttributesChecksum);
  // the root's are checked at once. Readers call it for files of a format version that has them.
  void require_sealed_attributes() const;

 private:
  using Group::Group;
};

// Writes kAttributesChecksum on every object under `g` (g included) that has attributes, for a
// file being written (or edited by a test): the last step of a writer before File::close.
void seal_attributes(const Group& g);

// Silences HDF5's automatic error stack printing (idempotent; File::open/create call it).
void silence_hdf5_errors();

// "1.0" -> {1, 0}; throws Error naming `what` when malformed.
std::pair<int, int> parse_version(const std::string& version, const std::string& what);

}  // namespace kvcc::h5
