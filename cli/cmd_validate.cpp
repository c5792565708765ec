// kvcc validate: a model run over text with each artifact's quantised KV cache, against the same
// run with a full-precision cache (eval/experiment.h).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cli/command.h"
#include "cli/progress.h"
#include "formats/artifact.h"
#include "formats/atomic_file.h"
#include "formats/error.h"
#include "formats/method.h"
#include "formats/model_file.h"
#include "eval/experiment.h"
#include "eval/logits_dump.h"
#include "eval/output.h"
#include "eval/scheme.h"

namespace kvcc::cli {
namespace {

enum class CachePath { Codec, Runtime };

struct Args {
  std::string model_path, json_path, svg_path, dump_path;
  int dump_top_k = 0;  // 0: full logits
  ValidateMode mode = ValidateMode::PseudoDecode;
  ValidatePrecision precision = ValidatePrecision::Float;
  CachePath cache = CachePath::Codec;
  ValidateDevice device = ValidateDevice::Auto;
  std::vector<std::string> artifact_paths;
  ValidateData data;
  int block = 128;
  int64_t late_from = 0;                       // > 0: positions from here on also reported on their own
  std::optional<int> sink, recent, page_size;  // unset: the artifact's recipe
};

int run_validate(Args& a) {
  KVCC_REQUIRE(a.cache == CachePath::Runtime || a.device == ValidateDevice::Auto,
               "--device applies to --cache runtime (the codec path runs on the CPU)");
  KVCC_REQUIRE(a.cache == CachePath::Codec || a.precision == ValidatePrecision::Float,
               "--cache runtime runs in float only (the kernels take float32 activations); --precision double is "
               "the codec path's exact check");
  KVCC_REQUIRE(!a.data.data_path.empty() || !a.data.ids_path.empty(), "validate needs --data TEXT or --ids FILE");
  KVCC_REQUIRE(a.dump_top_k == 0 || !a.dump_path.empty(), "--dump-top-k needs --dump-logits FILE");
  std::vector<std::string> inputs = a.artifact_paths;
  inputs.insert(inputs.end(), {a.model_path, a.data.data_path, a.data.ids_path, a.data.tokenizer_path});
  for (const std::string* out : {&a.json_path, &a.svg_path, &a.dump_path}) require_output_is_not_input(*out, inputs);
  const ModelFile model = ModelFile::open(a.model_path);
  std::vector<CacheScheme> schemes;
  for (const std::string& path : a.artifact_paths) {
    Artifact artifact = read_artifact(path);
    check_artifact_matches(artifact, model, path);
    // Windows and pages are a serving choice: evaluate the same fitted artifact under others.
    Recipe& r = artifact.recipe;
    if (a.sink) r.sink = *a.sink;
    if (a.recent) r.recent = *a.recent;
    if (a.page_size) r.page_size = *a.page_size;
    std::string name = std::filesystem::path(path).filename().string();
    for (const char* ext : {".kvcc.h5", ".h5"})
      if (name.size() > std::string(ext).size() && name.ends_with(ext)) {
        name.resize(name.size() - std::string(ext).size());
        break;
      }
    schemes.push_back(a.cache == CachePath::Runtime
                          ? runtime_scheme_from_artifact(std::move(artifact), name, model.config(), a.device)
                          : scheme_from_artifact(std::move(artifact), name, model.config()));
  }
  const auto docs = load_validation_documents(model, a.data);
  const auto progress = validate_progress("validating");
  ValidationResult result;
  if (a.dump_path.empty()) {
    result = validate_schemes(model, docs, schemes, a.mode, a.block, progress, a.precision, {}, a.late_from);
  } else {
    // Written as the run goes, into a temporary file renamed into place only when complete.
    LogitsDumpSpec spec;
    spec.runs.push_back("reference");
    for (const CacheScheme& s : schemes) spec.runs.push_back(s.name);
    spec.vocab = model.config().vocab;
    spec.top_k = a.dump_top_k;
    spec.metadata = {{"model", a.model_path},
                     {"mode", validate_mode_name(a.mode)},
                     {"block", std::to_string(a.block)},
                     {"precision", validate_precision_name(a.precision)}};
    write_file_atomically(a.dump_path, [&](const std::string& tmp) {
      LogitsDump dump(tmp, spec, docs);
      result = validate_schemes(
          model, docs, schemes, a.mode, a.block, progress, a.precision,
          [&](size_t run, uint64_t row, const double* logits, const double* logprobs, int) {
            dump.write_row(run, row, logits, logprobs);
          },
          a.late_from);
      dump.finish();
    });
  }
  std::cout << format_table(result);
  std::printf("(%.1f s; per-layer relative attention-output errors in the JSON)\n", result.seconds);
  if (!a.json_path.empty()) write_bytes_atomically(a.json_path, to_json(result));
  if (!a.svg_path.empty()) write_bytes_atomically(a.svg_path, to_svg(result));
  return 0;
}

Command reg{
    "validate", 50, "Measure quality: run the model with each artifact's quantised KV cache vs full precision",
    [](CLI::App& sub) {
      auto a = std::make_shared<Args>();
      sub.footer(
          "Runs MODEL over the text with each artifact's quantised KV cache and, in the same\n"
          "pass, with a full-precision cache; reports perplexity and its change, mean\n"
          "KL(full || quantised) of next-token distributions, top-1 agreement, per-layer\n"
          "relative attention-output error, nominal, effective (the published accounting:\n"
          "every token past the windows quantised) and stored bits (whole pages, as the\n"
          "cache holds them: compare these across page sizes). Each artifact's\n"
          "cache policy: first --sink tokens and a ring of --recent tokens kept exact; older\n"
          "tokens quantised a page (--page-size) at a time by the artifact's method.\n\n"
          "Modes: pseudo-decode (default): blocks of --block tokens attend to the quantised\n"
          "cache of earlier blocks, then their K/V are appended, so error accumulates as in\n"
          "decoding; static: the cache is filled from the full-precision run's K/V.\n\n"
          "Precision: float (default) computes like the model's float32 forward pass;\n"
          "double is the slow exact-check mode (~1.5x the time, 1.7x the memory): the\n"
          "full-precision run then equals the plain forward pass to ~1e-15 whatever --block\n"
          "is (float: ~1e-8). Codecs still quantise float rows (their change is applied to\n"
          "the double rows).\n\n"
          "Cache path: codec (default) simulates the cache (pages quantised by the artifact's\n"
          "codec, float32 windows). runtime runs the quantised attention through the serving\n"
          "runtime (kvcc::Runtime prefill + append: BF16 windows of rotated K/V, INT2 pages),\n"
          "on --device auto (the GPU when present and the shape is in the kernels' scope, else\n"
          "the CPU reference kernels), cpu, or gpu. runtime serves 2-bit artifacts (group <=\n"
          "head_dim, float precision) of " +
          method_names([](const MethodTraits& t) { return t.served_by_runtime; }, ", ", " and ") +
          "; others\n"
          "are refused by name. The table's 'cache' column says which path ran.\n\n"
          "Error bars: '±se' is the standard error across documents (each document one\n"
          "sample; Δppl's from per-document paired NLL differences vs the full-precision\n"
          "run). A difference between methods within about 2 se is not established by this\n"
          "text: add documents. --json holds per-document metrics (for paired comparisons\n"
          "between methods); --svg plots KL vs effective bits with +-1 se bars.\n\n"
          "Without --artifact it measures the model alone: the full-precision NLL and\n"
          "perplexity of the text, with the standard error across documents.\n\n"
          "--dump-logits FILE writes the logits of every scored position of every run (the\n"
          "full-precision reference and each artifact) as safetensors: tensors reference/logits,\n"
          "NAME/logits [positions, vocab] f32, with tokens, document_offsets and per row its\n"
          "document, position and target (docs/validation.md has the format); --dump-top-k K\n"
          "writes instead NAME/top_ids and NAME/top_logprobs [positions, K]. For comparing\n"
          "with other implementations, e.g. transformers: with --block at least the longest\n"
          "document the reference rows are the plain forward pass bit for bit.\n\n"
          "Progress goes to stderr: redrawn on a terminal, else a line per 5% of the tokens.\n\n"
          "Examples:\n"
          "  kvcc validate --model ../shared/models/gutenberg-27m --artifact oscar.kvcc.h5 \\\n"
          "      --artifact kivi.kvcc.h5 --data heldout.txt --tokens 16384 --json v.json --svg v.svg\n"
          "  # the same artifacts at other windows (the fitted parameters do not depend on them)\n"
          "  kvcc validate --model DIR -a oscar.kvcc.h5 --data heldout.txt --sink 4 --recent 32 --page-size 32\n"
          "  # slow exact-check mode: activations in double, numbers free of float32 GEMM noise\n"
          "  kvcc validate --model DIR -a oscar.kvcc.h5 --data heldout.txt --tokens 4096 --precision double\n"
          "  # through the serving runtime (GPU kernels when a device is present)\n"
          "  kvcc validate --model DIR -a oscar.kvcc.h5 --data heldout.txt --cache runtime\n"
          "  # the model alone, with its logits for another implementation to compare\n"
          "  kvcc validate --model DIR --data heldout.txt --tokens 4096 --block 2048 --dump-logits ref.safetensors");
      sub.add_option("--model", a->model_path, "HF model directory or llama2.c .bin")->required();
      sub.add_option("--artifact,-a", a->artifact_paths, "artifact(s) to evaluate (repeatable; none: the model alone)");
      sub.add_option("--data", a->data.data_path, "text, documents separated by --separator");
      sub.add_option("--ids", a->data.ids_path, "pre-tokenized documents (one line of ids each)");
      sub.add_option("--tokenizer", a->data.tokenizer_path, "explicit tokenizer file (llama2.c)");
      sub.add_option("--separator", a->data.separator, "document separator")->capture_default_str();
      sub.add_option("--tokens", a->data.max_tokens, "stop after this many tokens (0: all)")
          ->transform(whole_number(0, ~0ULL))
          ->capture_default_str();
      sub.add_option("--max-seq-len", a->data.max_seq_len, "truncate documents (0: min(max_position, 2048))")
          ->transform(whole_number(0, 2147483647))
          ->capture_default_str();
      sub.add_option("--block", a->block, "tokens per pseudo-decode block")
          ->transform(whole_number(1, 2147483647))
          ->capture_default_str();
      sub.add_option("--late-from", a->late_from,
                     "also report the predictions at positions >= N on their own (long-range use of the cache, "
                     "e.g. 8192 on 16K documents; 0: not)")
          ->transform(whole_number(0, 1ULL << 40));
      // Names become the library's enums here: the library never sees a flag's spelling.
      sub.add_option("--mode", a->mode, "pseudo-decode (default) | static")
          ->transform(CLI::CheckedTransformer(std::map<std::string, ValidateMode>{
              {"pseudo-decode", ValidateMode::PseudoDecode}, {"static", ValidateMode::Static}}));
      sub.add_option("--precision", a->precision,
                     "float (default) | double (slow exact-check mode: activations in double)")
          ->transform(CLI::CheckedTransformer(std::map<std::string, ValidatePrecision>{
              {"float", ValidatePrecision::Float}, {"double", ValidatePrecision::Double}}));
      sub.add_option("--cache", a->cache, "codec (default) | runtime (the serving runtime's prefill + append)")
          ->transform(CLI::CheckedTransformer(
              std::map<std::string, CachePath>{{"codec", CachePath::Codec}, {"runtime", CachePath::Runtime}}));
      sub.add_option("--device", a->device, "auto (default) | cpu | gpu (for --cache runtime)")
          ->transform(CLI::CheckedTransformer(std::map<std::string, ValidateDevice>{
              {"auto", ValidateDevice::Auto}, {"cpu", ValidateDevice::Cpu}, {"gpu", ValidateDevice::Gpu}}));
      sub.add_option("--sink", a->sink, "override every artifact's BF16 sink tokens")
          ->transform(whole_number(0, 2147483647));
      sub.add_option("--recent", a->recent, "override every artifact's recent-ring tokens")
          ->transform(whole_number(0, 2147483647));
      sub.add_option("--page-size", a->page_size, "override every artifact's page size")
          ->transform(whole_number(1, 2147483647));
      sub.add_option("--json", a->json_path, "write the metrics as JSON");
      sub.add_option("--svg", a->svg_path, "write a plot of KL vs effective bits");
      sub.add_option("--dump-logits", a->dump_path, "write every scored position's logits (safetensors)");
      sub.add_option("--dump-top-k", a->dump_top_k, "with --dump-logits: only the K most likely ids and log-probs")
          ->transform(whole_number(1, 2147483647));
      return [a] { return run_validate(*a); };
    }};

}  // namespace
}  // namespace kvcc::cli
