// Read-only memory-mapped files and the safetensors container (8-byte little-endian header
// length, a JSON header {name: {dtype, shape, data_offsets}}, then the raw tensor bytes).
// Every header entry is checked against the file before any data is touched, so a header that
// lies about sizes or a truncated file is refused when it is opened, not when a tensor is read.
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace kvcc {

// A whole file mapped read-only (MAP_PRIVATE); unmapped on destruction.
class MappedFile {
 public:
  static std::shared_ptr<const MappedFile> open(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  MappedFile() = default;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
  std::string path_;
};

enum class TensorDType { F64, F32, F16, BF16, I64, I32, I16, I8, U8, Bool, F8E4M3, F8E5M2 };

const char* tensor_dtype_name(TensorDType);  // safetensors spelling: "F32", "BF16", ...
size_t tensor_dtype_size(TensorDType);       // bytes per element

// Where one tensor's bytes lie: in a mapped file, at `data` (not necessarily aligned).
struct TensorView {
  std::string name;
  TensorDType dtype = TensorDType::F32;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;
  size_t nbytes = 0;
  std::shared_ptr<const MappedFile> file;  // keeps the mapping alive

  int64_t numel() const;
};

// Converts `count` elements of a float tensor (F64/F32/F16/BF16) starting at element `first` to
// float32; throws Error for other dtypes.
void tensor_to_f32(const TensorView&, size_t first, size_t count, float* out);

// Parses and validates one .safetensors file; throws Error naming the file and the cause.
std::map<std::string, TensorView> read_safetensors(const std::string& path);

}  // namespace kvcc
