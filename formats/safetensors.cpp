#include "formats/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>

#include "formats/error.h"
#include "formats/fp16.h"

namespace kvcc {

std::shared_ptr<const MappedFile> MappedFile::open(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  KVCC_REQUIRE(fd >= 0, path + ": cannot open (" + std::strerror(errno) + ")");
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw Error(path + ": not a regular file");
  }
  std::shared_ptr<MappedFile> file(new MappedFile());
  file->path_ = path;
  file->size_ = size_t(st.st_size);
  if (file->size_ > 0) {
    void* p = ::mmap(nullptr, file->size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      int err = errno;
      ::close(fd);
      throw Error(path + ": cannot memory-map (" + std::strerror(err) + ")");
    }
    file->data_ = static_cast<const uint8_t*>(p);
  }
  ::close(fd);  // the mapping stays valid without the descriptor
  return file;
}

MappedFile::~MappedFile() {
  if (data_) ::munmap(const_cast<uint8_t*>(data_), size_);
}

namespace {

struct DTypeInfo {
  TensorDType dtype;
  const char* name;
  size_t size;
};
constexpr DTypeInfo kDTypes[] = {
    {TensorDType::F64, "F64", 8},   {TensorDType::F32, "F32", 4},        {TensorDType::F16, "F16", 2},
    {TensorDType::BF16, "BF16", 2}, {TensorDType::I64, "I64", 8},        {TensorDType::I32, "I32", 4},
    {TensorDType::I16, "I16", 2},   {TensorDType::I8, "I8", 1},          {TensorDType::U8, "U8", 1},
    {TensorDType::Bool, "BOOL", 1}, {TensorDType::F8E4M3, "F8_E4M3", 1}, {TensorDType::F8E5M2, "F8_E5M2", 1},
};

const DTypeInfo& dtype_info(TensorDType d) {
  for (const auto& info : kDTypes)
    if (info.dtype == d) return info;
  throw Error("internal: unknown tensor dtype");
}

template <typename T>
T load_unaligned(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

}  // namespace

const char* tensor_dtype_name(TensorDType d) { return dtype_info(d).name; }
size_t tensor_dtype_size(TensorDType d) { return dtype_info(d).size; }

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

void tensor_to_f32(const TensorView& t, size_t first, size_t count, float* out) {
  KVCC_REQUIRE(first + count <= size_t(t.numel()), "tensor " + t.name + ": elements [" + std::to_string(first) + ", " +
                                                       std::to_string(first + count) + ") out of range");
  const size_t elem = tensor_dtype_size(t.dtype);
  const uint8_t* src = t.data + first * elem;
  switch (t.dtype) {
    case TensorDType::F32:
      std::memcpy(out, src, count * 4);  // the data may be unaligned in the file
      return;
    case TensorDType::F64:
      for (size_t i = 0; i < count; ++i) out[i] = float(load_unaligned<double>(src + 8 * i));
      return;
    case TensorDType::F16:
      for (size_t i = 0; i < count; ++i) out[i] = float_from_f16(load_unaligned<uint16_t>(src + 2 * i));
      return;
    case TensorDType::BF16:
      for (size_t i = 0; i < count; ++i) out[i] = float_from_bf16(load_unaligned<uint16_t>(src + 2 * i));
      return;
    default:
      throw Error("tensor " + t.name + " has dtype " + tensor_dtype_name(t.dtype) +
                  ", not a float type (F32/F16/BF16/F64)");
  }
}

std::map<std::string, TensorView> read_safetensors(const std::string& path) {
  auto file = MappedFile::open(path);
  const size_t file_size = file->size();
  KVCC_REQUIRE(file_size >= 8, path + ": truncated safetensors file (" + std::to_string(file_size) +
                                   " bytes, shorter than the 8-byte header length)");
  const uint64_t header_len = load_unaligned<uint64_t>(file->data());  // little-endian hosts only
  KVCC_REQUIRE(header_len <= file_size - 8, path + ": safetensors header length " + std::to_string(header_len) +
                                                " exceeds the file size " + std::to_string(file_size) +
                                                " (truncated or not safetensors)");
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(file->data() + 8, file->data() + 8 + header_len);
  } catch (const nlohmann::json::exception& e) {
    throw Error(path + ": safetensors header is not valid JSON (" + e.what() + ")");
  }
  KVCC_REQUIRE(header.is_object(), path + ": safetensors header is not a JSON object");
  const uint8_t* data_start = file->data() + 8 + header_len;
  const uint64_t data_size = file_size - 8 - header_len;

  std::map<std::string, TensorView> tensors;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") continue;
    const std::string& name = it.key();
    const auto& entry = it.value();
    const std::string where = path + ": tensor '" + name + "'";
    KVCC_REQUIRE(
        entry.is_object() && entry.contains("dtype") && entry.contains("shape") && entry.contains("data_offsets"),
        where + " lacks dtype, shape or data_offsets");
    TensorView view;
    view.name = name;
    view.file = file;
    bool known = false;
    const std::string dtype_name = entry["dtype"].is_string() ? entry["dtype"].get<std::string>() : "?";
    for (const auto& info : kDTypes)
      if (dtype_name == info.name) view.dtype = info.dtype, known = true;
    KVCC_REQUIRE(known, where + " has unknown dtype '" + dtype_name + "'");

    KVCC_REQUIRE(entry["shape"].is_array(), where + ": shape is not an array");
    uint64_t numel = 1;
    for (const auto& dim : entry["shape"]) {
      KVCC_REQUIRE(dim.is_number_integer() && dim.get<int64_t>() >= 0, where + ": bad shape entry");
      const uint64_t d = dim.get<uint64_t>();
      KVCC_REQUIRE(d == 0 || numel <= std::numeric_limits<uint64_t>::max() / 16 / d, where + ": shape overflows");
      numel *= d;
      view.shape.push_back(int64_t(d));
    }
    const auto& offsets = entry["data_offsets"];
    KVCC_REQUIRE(
        offsets.is_array() && offsets.size() == 2 && offsets[0].is_number_unsigned() && offsets[1].is_number_unsigned(),
        where + ": data_offsets is not a pair of unsigned integers");
    const uint64_t begin = offsets[0].get<uint64_t>(), end = offsets[1].get<uint64_t>();
    KVCC_REQUIRE(begin <= end,
                 where + ": data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) + ") are reversed");
    const uint64_t expected = numel * tensor_dtype_size(view.dtype);
    KVCC_REQUIRE(end - begin == expected, where + ": data_offsets span " + std::to_string(end - begin) + " bytes but " +
                                              dtype_name + " x shape needs " + std::to_string(expected));
    KVCC_REQUIRE(end <= data_size, where + ": data [" + std::to_string(begin) + ", " + std::to_string(end) +
                                       ") lies beyond the end of the file's " + std::to_string(data_size) +
                                       " data bytes (truncated or corrupt)");
    view.data = data_start + begin;
    view.nbytes = size_t(expected);
    tensors.emplace(name, std::move(view));
  }
  return tensors;
}

}  // namespace kvcc
