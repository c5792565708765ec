// libFuzzer target: a token-id file (--ids of calibrate-model and validate: one document per
// line, ids separated by spaces).
#include "fuzz_common.h"
#include "model/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvcc;
  const std::string path = fuzz::write_input_as("tokens.ids", data, size);
  if (path.empty()) return 0;
  fuzz::attempt([&] { read_token_id_file(path); });
  return 0;
}
