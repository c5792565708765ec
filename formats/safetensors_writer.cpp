#include "formats/safetensors_writer.h"

#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "formats/atomic_file.h"
#include "formats/error.h"

namespace kvcc {

void write_safetensors_f32(const std::string& path, const std::vector<F32Tensor>& tensors) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  std::set<std::string> names;
  uint64_t offset = 0;
  for (const F32Tensor& t : tensors) {
    KVCC_REQUIRE(names.insert(t.name).second, "safetensors: duplicate tensor name '" + t.name + "'");
    int64_t count = 1;
    for (int64_t s : t.shape) count *= s;
    KVCC_REQUIRE(count == int64_t(t.data.size()), "safetensors: tensor '" + t.name + "' shape does not match its " +
                                                      std::to_string(t.data.size()) + " elements");
    const uint64_t bytes = uint64_t(count) * sizeof(float);
    header[t.name] = {{"dtype", "F32"}, {"shape", t.shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  write_file_atomically(path, [&](const std::string& tmp) {
    std::ofstream out(tmp, std::ios::binary);
    KVCC_REQUIRE(bool(out), "cannot write '" + tmp + "'");
    const uint64_t n = text.size();
    unsigned char len[8];
    for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(n >> (8 * i));  // little-endian
    out.write(reinterpret_cast<const char*>(len), 8);
    out.write(text.data(), std::streamsize(text.size()));
    for (const F32Tensor& t : tensors)
      out.write(reinterpret_cast<const char*>(t.data.data()), std::streamsize(t.data.size() * sizeof(float)));
    KVCC_REQUIRE(bool(out), "write failed: '" + tmp + "'");
  });
}

}  // namespace kvcc
