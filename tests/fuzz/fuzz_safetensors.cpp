// libFuzzer target: safetensors model weights (every command that opens a Hugging Face model
// directory: calibrate-model, tokenize, validate, the forward pass). The input is the directory's
// model.safetensors, beside a fixed config.json (tests/data/models/qwen2-bias), so that a mutant
// of that model's weights gets past the header into ModelFile's shape checks and conversions.
#include <vector>

#include "formats/model_file.h"
#include "formats/safetensors.h"
#include "fuzz_common.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  kvcc::fuzz::link_fixture("models/qwen2-bias/config.json", "config.json");
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvcc;
  const std::string path = fuzz::write_input_as("model.safetensors", data, size);
  if (path.empty()) return 0;
  fuzz::attempt([&] {
    for (const auto& [name, view] : read_safetensors(path)) {
      // The reader checked nbytes against the file, so numel is bounded by the input's size.
      std::vector<float> out(static_cast<size_t>(view.numel()));
      tensor_to_f32(view, 0, out.size(), out.data());
    }
  });
  fuzz::attempt([&] { fuzz::exercise_model(ModelFile::open(fuzz::scratch_dir())); });
  return 0;
}
