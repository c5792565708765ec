// libFuzzer target: a tokenizer file, built twice: fuzz_tokenizer_json (tokenizer.json, the
// Hugging Face format) and fuzz_tokenizer_bin (llama2.c's tokenizer.bin); KVCC_FUZZ_TOKENIZER_NAME
// is the input's file name, which selects the reader. The loaded tokenizer encodes and decodes a
// fixed text (ASCII, multi-byte UTF-8, invalid UTF-8, special-token look-alikes) and decodes
// ids at and past the ends of its vocabulary, as tokenize / calibrate / validate would.
#include <string>
#include <vector>

#include "fuzz_common.h"
#include "model/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvcc;
  const std::string path = fuzz::write_input_as(KVCC_FUZZ_TOKENIZER_NAME, data, size);
  if (path.empty()) return 0;
  static const std::string texts[] = {
      "Once upon a time, there was a little girl named Lily. She liked 3 cats!\n\n  Tabs\tand  spaces ",
      "caf\xc3\xa9 \xe6\x97\xa5\xe6\x9c\xac \xf0\x9f\x98\x80 <|endoftext|><s></s><unk>",
      "bad utf-8: \xff\xfe \xc3 \xe6\x97 end", ""};
  fuzz::attempt([&] {
    const auto tokenizer = Tokenizer::from_file(path);
    const int vocab = tokenizer->vocab_size();
    tokenizer->kind();
    tokenizer->bos_id();
    tokenizer->eos_id();
    for (const std::string& text : texts) {
      for (bool bos : {false, true}) fuzz::attempt([&] { tokenizer->decode(tokenizer->encode(text, bos)); });
    }
    // Every id of a small vocabulary (each alone: a piece may be a partial UTF-8 sequence).
    for (int id = 0; id < vocab && id < 4096; ++id) fuzz::attempt([&] { tokenizer->decode({id}); });
    for (int id : {-1, vocab, vocab + 1}) fuzz::attempt([&] { tokenizer->decode({id}); });
  });
  return 0;
}
