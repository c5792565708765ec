#include "formats/h5.h"

#include <sys/stat.h>

#include <cstring>
#include <sstream>

#include "formats/error.h"

namespace kvcc::h5 {
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
  for (int64_t x : s) n *= x;
  return n;
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

bool Object::has_attr(const std::string& name) const { return H5Aexists(id(), name.c_str()) > 0; }

std::vector<std::string> Object::attr_names() const {
  std::vector<std::string> names;
  hsize_t index = 0;
  if (H5Aiterate2(id(), H5_INDEX_NAME, H5_ITER_INC, &index, collect_attr_name, &names) < 0)
    fail("cannot list attributes");
  return names;
}

namespace {

void write_attr(const Object& obj, const std::string& name, hid_t ftype, hid_t mtype, const void* value) {
  if (obj.has_attr(name) && H5Adelete(obj.id(), name.c_str()) < 0) obj.fail("cannot replace attribute " + name);
  Handle space(H5Screate(H5S_SCALAR), H5Sclose);
  Handle attr(H5Acreate2(obj.id(), name.c_str(), ftype, space.get(), H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
  if (attr.get() < 0 || H5Awrite(attr.get(), mtype, value) < 0) obj.fail("cannot write attribute " + name);
}

Handle open_attr(const Object& obj, const std::string& name) {
  if (!obj.has_attr(name)) obj.fail("missing attribute " + name);
  Handle attr(H5Aopen(obj.id(), name.c_str(), H5P_DEFAULT), H5Aclose);
  if (attr.get() < 0) obj.fail("cannot open attribute " + name);
  Handle space(H5Aget_space(attr.get()), H5Sclose);
  if (H5Sget_simple_extent_npoints(space.get()) != 1) obj.fail("attribute " + name + " is not a single value");
  return attr;
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
  Handle ftype(H5Aget_type(attr.get()), H5Tclose);
  if (H5Tget_class(ftype.get()) != H5T_STRING) fail("attribute " + name + " is not a string");
  if (H5Tis_variable_str(ftype.get()) > 0) {
    Handle mtype(H5Tcopy(H5T_C_S1), H5Tclose);
    H5Tset_size(mtype.get(), H5T_VARIABLE);
    H5Tset_cset(mtype.get(), H5Tget_cset(ftype.get()));
    char* ptr = nullptr;
    if (H5Aread(attr.get(), mtype.get(), &ptr) < 0) fail("cannot read attribute " + name);
    std::string out = ptr ? ptr : "";
    if (ptr) H5free_memory(ptr);
    return out;
  }
  const size_t size = H5Tget_size(ftype.get());
  std::string buf(size, '\0');
  if (H5Aread(attr.get(), ftype.get(), buf.data()) < 0) fail("cannot read attribute " + name);
  buf.resize(std::strlen(buf.c_str()));
  while (!buf.empty() && buf.back() == ' ') buf.pop_back();  // space-padded (Fortran style)
  return buf;
}

int64_t Object::attr_int(const std::string& name) const {
  Handle attr = open_attr(*this, name);
  Handle ftype(H5Aget_type(attr.get()), H5Tclose);
  if (H5Tget_class(ftype.get()) != H5T_INTEGER) fail("attribute " + name + " is not an integer");
  int64_t v = 0;
  if (H5Aread(attr.get(), H5T_NATIVE_INT64, &v) < 0) fail("cannot read attribute " + name);
  return v;
}

uint64_t Object::attr_uint(const std::string& name) const {
  Handle attr = open_attr(*this, name);
  Handle ftype(H5Aget_type(attr.get()), H5Tclose);
  if (H5Tget_class(ftype.get()) != H5T_INTEGER) fail("attribute " + name + " is not an integer");
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
  if (cls != H5T_FLOAT && cls != H5T_INTEGER) fail("attribute " + name + " is not a number");
  double v = 0;
  if (H5Aread(attr.get(), H5T_NATIVE_DOUBLE, &v) < 0) fail("cannot read attribute " + name);
  return v;
}

// ---------------------------------------------------------------- Dataset

Shape Dataset::shape() const {
  Handle space(H5Dget_space(id()), H5Sclose);
  const int rank = H5Sget_simple_extent_ndims(space.get());
  if (rank < 0) fail("cannot read dataset shape");
  std::vector<hsize_t> dims(static_cast<size_t>(rank));
  H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr);
  return Shape(dims.begin(), dims.end());
}

DType Dataset::dtype() const {
  Handle type(H5Dget_type(id()), H5Tclose);
  const H5T_class_t cls = H5Tget_class(type.get());
  const size_t size = H5Tget_size(type.get());
  if (cls == H5T_FLOAT) {
    if (size == 8) return DType::Float64;
    if (size == 4) return DType::Float32;
  } else if (cls == H5T_INTEGER) {
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
  hid_t g = H5Gopen2(id(), name.c_str(), H5P_DEFAULT);
  if (g < 0) throw Error(file_name_ + ": " + path + " is not a group");
  return Group(std::make_shared<Handle>(g, H5Gclose), file_name_, path);
}

Group Group::create_group(const std::string& name, bool track_order) const {
  const std::string path = child_path(name);
  Handle gcpl(H5Pcreate(H5P_GROUP_CREATE), H5Pclose);
  if (track_order) H5Pset_link_creation_order(gcpl.get(), H5P_CRT_ORDER_TRACKED | H5P_CRT_ORDER_INDEXED);
  hid_t g = H5Gcreate2(id(), name.c_str(), H5P_DEFAULT, gcpl.get(), H5P_DEFAULT);
  if (g < 0) throw Error(file_name_ + ": cannot create group " + path);
  return Group(std::make_shared<Handle>(g, H5Gclose), file_name_, path);
}

Dataset Group::dataset(const std::string& name) const {
  const std::string path = child_path(name);
  if (!has(name)) throw Error(file_name_ + ": missing dataset " + path);
  hid_t d = H5Dopen2(id(), name.c_str(), H5P_DEFAULT);
  if (d < 0) throw Error(file_name_ + ": " + path + " is not a dataset");
  return Dataset(std::make_shared<Handle>(d, H5Dclose), file_name_, path);
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
  Dataset ds(std::make_shared<Handle>(d, H5Dclose), file_name_, path);
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
  return shape;
}

void Group::read_raw(const Dataset& ds, DType type, void* out) const {
  if (element_count(ds.shape()) == 0) return;
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
  return File(std::make_shared<Handle>(f, H5Fclose), name, "/");
}

namespace {
hid_t open_checked(const std::string& path, const std::string& name, unsigned flags) {
  silence_hdf5_errors();
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) throw Error(name + ": no such file");
  if (S_ISDIR(st.st_mode)) throw Error(name + ": is a directory, expected an HDF5 file");
  Handle fapl(make_file_access(name), H5Pclose);
#if H5_VERSION_GE(1, 12, 0)
  const htri_t is_hdf5 = H5Fis_accessible(path.c_str(), fapl.get());
#else
  const htri_t is_hdf5 = H5Fis_hdf5(path.c_str());
#endif
  if (is_hdf5 <= 0) throw Error(name + ": not an HDF5 file (or truncated)");
  hid_t f = H5Fopen(path.c_str(), flags, fapl.get());
  if (f < 0) throw Error(name + ": not an HDF5 file (or truncated)");
  return f;
}
}  // namespace

File File::open(const std::string& path, const std::string& display_name) {
  const std::string name = display_name.empty() ? path : display_name;
  return File(std::make_shared<Handle>(open_checked(path, name, H5F_ACC_RDONLY), H5Fclose), name, "/");
}

File File::open_rw(const std::string& path, const std::string& display_name) {
  const std::string name = display_name.empty() ? path : display_name;
  return File(std::make_shared<Handle>(open_checked(path, name, H5F_ACC_RDWR), H5Fclose), name, "/");
}

void File::close() {
  if (id() < 0) return;
  if (H5Fflush(id(), H5F_SCOPE_GLOBAL) < 0) throw Error(file_name_ + ": cannot flush HDF5 file (disk full?)");
  if (!handle_->reset()) throw Error(file_name_ + ": cannot close HDF5 file");
}

}  // namespace kvcc::h5
