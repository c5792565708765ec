// libFuzzer target: a torch .pt file (kvcc zoo import-oscar): the zip reader (every entry read),
// torch_load (zip + pickle + storages) and the OSCAR rotation reader on top of them.
#include "fuzz_common.h"
#include "zoo/oscar_pt.h"
#include "zoo/pickle.h"
#include "zoo/zip.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvcc;
  const std::string path = fuzz::write_input_as("rotations.pt", data, size);
  if (path.empty()) return 0;
  fuzz::attempt([&] {
    const ZipReader zip = ZipReader::open(path);
    for (const ZipEntry& entry : zip.entries()) fuzz::attempt([&] { zip.read(entry); });
  });
  fuzz::attempt([&] { torch_load(path).repr(); });
  fuzz::attempt([&] { read_oscar_pt(path); });
  return 0;
}
