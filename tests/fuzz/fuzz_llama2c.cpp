// libFuzzer target: a llama2.c checkpoint (.bin): its header, the tensors it implies and
// ModelFile's checks on them (every command given a .bin model).
#include "formats/llama2c.h"
#include "formats/model_config.h"
#include "formats/model_file.h"
#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvcc;
  const std::string path = fuzz::write_input_as("model.bin", data, size);
  if (path.empty()) return 0;
  fuzz::attempt([&] {
    ModelConfig config;
    read_llama2c(path, config);
    rope_inv_freq(config);
  });
  fuzz::attempt([&] { fuzz::exercise_model(ModelFile::open(path)); });
  return 0;
}
