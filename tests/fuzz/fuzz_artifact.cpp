// libFuzzer target: the artifact readers (kvcc verify / inspect / validate, the runtime's load).
#include "formats/artifact.h"
#include "formats/h5_common.h"
#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvcc;
  if (!fuzz::write_input(data, size)) return 0;
  const std::string& path = fuzz::scratch_path();
  fuzz::attempt([&] { h5::detect_format(path); });
  fuzz::attempt([&] { verify_artifact_file(path); });
  fuzz::attempt([&] { read_artifact(path); });
  return 0;
}
