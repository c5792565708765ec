// kvcc tokenize: a text's documents as token ids with the model's own tokenizer, in the file
// format that calibrate-model and validate read with --ids (for machines without the tokenizer's
// dependencies, e.g. PCRE2, or to tokenize once for many runs).
#include <cstdio>
#include <memory>
#include <string>

#include "cli/command.h"
#include "formats/atomic_file.h"
#include "formats/error.h"
#include "formats/model_file.h"
#include "model/tokenizer.h"

namespace kvcc::cli {
namespace {

struct Args {
  std::string model_path, data_path, tokenizer_path, separator = "<|endoftext|>", output;
};

int run_tokenize(const Args& a) {
  require_output_is_not_input(a.output, {a.model_path, a.data_path, a.tokenizer_path});
  const ModelFile model = ModelFile::open(a.model_path);
  const ModelConfig& c = model.config();
  const std::string text = read_text_file(a.data_path, "text");
  const std::unique_ptr<Tokenizer> tok = Tokenizer::for_model(model.path(), c.vocab, a.tokenizer_path);
  const auto docs = encode_documents(*tok, text, a.separator, c.add_bos);
  KVCC_REQUIRE(!docs.empty(), "the text holds no document: " + a.data_path);
  write_token_id_file(a.output, docs);
  size_t tokens = 0;
  for (const auto& d : docs) tokens += d.size();
  std::printf("%zu documents, %zu tokens (%s%s) -> %s\n", docs.size(), tokens, tok->kind().c_str(),
              c.add_bos ? ", BOS added" : "", a.output.c_str());
  return 0;
}

Command reg{"tokenize", 55, "Write a text's documents as token ids (the --ids format of calibrate-model and validate)",
            [](CLI::App& sub) -> std::function<int()> {
              auto a = std::make_shared<Args>();
              sub.footer(
                  "Splits TEXT into documents on --separator, encodes each with MODEL's own tokenizer\n"
                  "(BOS as the model's config says), and writes one line of ids per document: exactly\n"
                  "what `calibrate-model` and `validate` compute from --data, for --ids. Use it where\n"
                  "the tokenizer cannot run (a tokenizer.json with regex pre-tokenizers needs PCRE2) or\n"
                  "to tokenize once for many runs. The file is written atomically; an output that names\n"
                  "an input is refused.\n\n"
                  "Example:\n"
                  "  kvcc tokenize --model DIR --data heldout.txt -o heldout.ids\n"
                  "  kvcc validate --model DIR -a oscar.kvcc.h5 --ids heldout.ids");
              sub.add_option("--model", a->model_path, "HF model directory or llama2.c .bin")->required();
              sub.add_option("--data", a->data_path, "text, documents separated by --separator")->required();
              sub.add_option("--tokenizer", a->tokenizer_path, "explicit tokenizer file (llama2.c)");
              sub.add_option("--separator", a->separator, "document separator")->capture_default_str();
              sub.add_option("-o,--output", a->output, "token id file to write")->required();
              return [a] { return run_tokenize(*a); };
            }};

}  // namespace
}  // namespace kvcc::cli
