// The tokenizer implementations behind Tokenizer::from_file (private to formats/).
#pragma once
#include <memory>
#include <string>

#include "model/tokenizer.h"

namespace kvcc::detail {

// Hugging Face tokenizer.json with a BPE model.
std::unique_ptr<Tokenizer> load_hf_tokenizer(const std::string& path);
// llama2.c tokenizer.bin: int32 max_token_length, then per token float32 score, int32 length, bytes.
std::unique_ptr<Tokenizer> load_llama2c_tokenizer(const std::string& path);

// Throws Error naming the byte offset of the first invalid UTF-8 sequence in `text`.
void require_valid_utf8(const std::string& text, const std::string& what);

}  // namespace kvcc::detail
