// libFuzzer target: model.safetensors.index.json, the index of a sharded model directory. The
// input is the index, beside the fixed config.json and six shards of tests/data/models/llama31-hd128.
#include "formats/model_file.h"
#include "fuzz_common.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  kvcc::fuzz::link_fixture("models/llama31-hd128/config.json", "config.json");
  for (int i = 1; i <= 6; ++i) {
    const std::string shard = "model-0000" + std::to_string(i) + "-of-00006.safetensors";
    kvcc::fuzz::link_fixture("models/llama31-hd128/" + shard, shard);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvcc;
  if (fuzz::write_input_as("model.safetensors.index.json", data, size).empty()) return 0;
  fuzz::attempt([&] { fuzz::exercise_model(ModelFile::open(fuzz::scratch_dir())); });
  return 0;
}
