// Text <-> token ids with the model's own tokenizer: Hugging Face tokenizer.json BPE (byte-level
// as in Llama-3/Qwen, metaspace as in SentencePiece-converted Llamas) and llama2.c tokenizer.bin.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace kvcc {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  // The tokenizer that belongs to a model path: DIR/tokenizer.json for a HF directory; for a
  // llama2.c .bin, tokenizer.bin or tok*.bin beside it (or `explicit_path` when given).
  // Throws Error when none is found or it does not match the model's vocabulary size.
  static std::unique_ptr<Tokenizer> for_model(const std::string& model_path, int vocab_size,
                                              const std::string& explicit_path = "");
  static std::unique_ptr<Tokenizer> from_file(const std::string& path);

  // Encodes one document. add_bos follows the tokenizer's own post-processor / the model config
  // (the caller passes ModelConfig::add_bos); no EOS is added.
  virtual std::vector<int32_t> encode(const std::string& text, bool add_bos) const = 0;
  virtual std::string decode(const std::vector<int32_t>& ids) const = 0;
  virtual int vocab_size() const = 0;
  virtual int bos_id() const = 0;  // -1 when none
  virtual int eos_id() const = 0;
  virtual std::string kind() const = 0;  // "tokenizer.json (byte-level BPE)", ...
};

// Splits a calibration text into documents on `separator` (default "<|endoftext|>"), dropping
// empty ones (whitespace only).
std::vector<std::string> split_documents(const std::string& text, const std::string& separator = "<|endoftext|>");

// A whole text file; Error naming it as `what` ("calibration text", ...) when it is missing or
// cannot be read.
std::string read_text_file(const std::string& path, const std::string& what);

// The documents of a text (split_documents), each encoded (add_bos as Tokenizer::encode says):
// what calibrate-model and validate read from --data.
std::vector<std::vector<int32_t>> encode_documents(const Tokenizer& tokenizer, const std::string& text,
                                                   const std::string& separator, bool add_bos);

// Reads a pre-tokenized file: whitespace-separated decimal ids, one document per line.
std::vector<std::vector<int32_t>> read_token_id_file(const std::string& path);
// Writes one: the format read_token_id_file reads (atomically: formats/atomic_file.h).
void write_token_id_file(const std::string& path, const std::vector<std::vector<int32_t>>& documents);

}  // namespace kvcc
