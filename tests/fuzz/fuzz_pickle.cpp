// libFuzzer target: the pickle reader alone (a .pt file's data.pkl), so that mutations reach the
// opcode interpreter without first having to keep a zip archive valid. Storages come from a
// loader that returns 4 KiB for any key, as torch_load's would for a well-formed archive.
#include <string>
#include <string_view>

#include "fuzz_common.h"
#include "zoo/pickle.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvcc;
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  const StorageLoader load = [](const std::string& key) { return std::string(4096, char(key.size())); };
  fuzz::attempt([&] { unpickle(bytes, load, "fuzz.pkl").repr(); });
  return 0;
}
