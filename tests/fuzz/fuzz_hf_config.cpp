// libFuzzer target: a Hugging Face config.json (parse_hf_config and what is derived from the
// config: fingerprint, RoPE frequencies, the tensor list ModelFile expects). The input is the
// config, beside the fixed weights of tests/data/models/qwen2-bias.
#include <nlohmann/json.hpp>

#include "formats/hf_config.h"
#include "formats/model_config.h"
#include "formats/model_file.h"
#include "fuzz_common.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  kvcc::fuzz::link_fixture("models/qwen2-bias/model.safetensors", "model.safetensors");
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvcc;
  if (fuzz::write_input_as("config.json", data, size).empty()) return 0;
  fuzz::attempt([&] {
    const ModelConfig config = read_hf_config(fuzz::scratch_dir());
    fingerprint_fields(config);
    make_fingerprint(config, std::string(64, '0'));
    rope_inv_freq(config);
  });
  fuzz::attempt([&] { fuzz::exercise_model(ModelFile::open(fuzz::scratch_dir())); });
  return 0;
}
