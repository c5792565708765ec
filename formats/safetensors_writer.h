// Writes float32 tensors as a safetensors file (8-byte little-endian header length, JSON header
// padded with spaces to 8 bytes, then the raw data), atomically. kvcc writes models only for the
// synthetic demo model; everything else reads them (formats/safetensors.h).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace kvcc {

struct F32Tensor {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> data;  // row-major, product(shape) elements
};

// Throws Error on a shape that does not match the data size or a duplicate name.
void write_safetensors_f32(const std::string& path, const std::vector<F32Tensor>& tensors);

}  // namespace kvcc
