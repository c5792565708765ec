// kvcc demo: the whole pipeline on a real tiny language model shipped with the repository
// (cli/demo/stories260k: llama2.c's stories260K, MIT) — sample stories from the model itself ->
// calibrate -> compile several methods at 2 bits with small windows -> validate (pseudo-decode;
// the methods the runtime serves through its CPU path, the rest through the codec path) -> table,
// JSON and SVG. `--synthetic` runs the same on the synthetic model kvcc generates (kept for tests).
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "calibrate/driver.h"
#include "calibrate/synthetic_model.h"
#include "cli/command.h"
#include "cli/demo/sample.h"
#include "compile/compile.h"
#include "eval/experiment.h"
#include "eval/output.h"
#include "eval/scheme.h"
#include "formats/artifact.h"
#include "formats/atomic_file.h"
#include "formats/error.h"
#include "formats/method.h"
#include "formats/model_file.h"
#include "formats/sha256.h"
#include "formats/stats.h"
#include "model/tokenizer.h"

// cli/CMakeLists.txt defines both from the source tree, so the binary finds the model from any
// working directory.
#ifndef KVCC_SOURCE_DIR
#define KVCC_SOURCE_DIR "."
#endif
#ifndef KVCC_DEMO_MODEL
#define KVCC_DEMO_MODEL KVCC_SOURCE_DIR "/cli/demo/stories260k/stories260K.bin"
#endif

namespace kvcc::cli {
namespace {

namespace fs = std::filesystem;

struct Args {
  std::string out_dir = "kvcc-demo";
  std::string model = KVCC_DEMO_MODEL;
  bool synthetic = false;
  // -1 / empty: the defaults of the chosen model (real: run_real, synthetic: run_synthetic).
  int calib_docs = -1, eval_docs = -1, doc_length = -1, sink = -1, recent = -1, page_size = -1, block = -1;
  double temperature = 1.0;
  uint64_t seed = 1;
  std::vector<std::string> methods;
};

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }
int or_default(int v, int d) { return v < 0 ? d : v; }

// What the pipeline after the documents needs.
struct Pipeline {
  std::string label;       // "stories260k", "synthetic": printed and prefixed to every file
  std::string model_path;  // as ModelFile::open takes it
  std::string calib_ids, eval_ids;
  int max_seq_len = 0;
  std::vector<std::string> methods;
  int sink = 4, recent = 32, page_size = 32, block = 128;
  bool serve_on_runtime = true;  // runtime-servable methods through the runtime's CPU path
  std::string out_dir;
};

// calibrate -> compile -> validate -> table, JSON, SVG. t0: the demo's start (times printed
// are since then, each step's own in parentheses).
void run_pipeline(const Pipeline& p, Clock::time_point t0) {
  const fs::path out(p.out_dir);
  const std::string tag = "[" + p.label + "]";
  auto step_line = [&](Clock::time_point s, const std::string& what) {
    std::printf("%s %s (%.2f s; %.1f s total)\n", tag.c_str(), what.c_str(), since(s), since(t0));
    std::fflush(stdout);
  };

  Clock::time_point s = Clock::now();
  CalibrationOptions copt;
  copt.model_path = p.model_path;
  copt.ids_path = p.calib_ids;
  copt.max_seq_len = p.max_seq_len;
  copt.command = "kvcc demo (" + p.label + ")";
  const std::string stats_path = (out / (p.label + ".stats.h5")).string();
  const CalibrationSummary cs = run_calibration(copt, stats_path);
  step_line(s, "calibrate: " + std::to_string(cs.tokens) + " tokens of " + std::to_string(cs.sequences) +
                   " documents -> " + stats_path);

  s = Clock::now();
  const Stats stats = read_stats(stats_path);
  const std::string stats_sha256 = sha256_file_hex(stats_path);
  std::vector<Artifact> artifacts;
  std::vector<std::string> names;
  for (const std::string& method : p.methods) {
    CompileOptions o;
    o.method = method;
    o.key_bits = o.value_bits = 2;
    // Small windows expose the quantised history; pages must fit in the ring (W >= P). KIVI's key
    // groups span the page's tokens (G_t = P); every other method's group is its default (head_dim,
    // capped so for KIVI's value groups).
    o.sink = p.sink;
    o.recent = p.recent;
    o.page_size = p.page_size;
    const bool per_channel_keys = method_traits(method_from_name(method)).codec == CodecFamily::KiviChannel;
    if (per_channel_keys) o.group = p.page_size;  // KIVI's key groups: the page
    Artifact art = compile_artifact(stats, o);
    art.model_id = p.label;
    art.provenance.stats_sha256 = stats_sha256;
    art.command = "kvcc demo (" + p.label + "): compile --method " + method + " --key-bits 2 --value-bits 2 --sink " +
                  std::to_string(p.sink) + " --recent " + std::to_string(p.recent) + " --page-size " +
                  std::to_string(p.page_size) + (per_channel_keys ? " --group " + std::to_string(p.page_size) : "");
    const std::string path = (out / (p.label + "-" + method + ".kvcc.h5")).string();
    write_artifact(art, path);
    artifacts.push_back(std::move(art));
    names.push_back(method);
  }
  step_line(s, "compile: " + std::to_string(p.methods.size()) + " methods at 2 bits (sink " + std::to_string(p.sink) +
                   ", recent " + std::to_string(p.recent) + ", pages of " + std::to_string(p.page_size) + ") -> " +
                   (out / (p.label + "-METHOD.kvcc.h5")).string());

  s = Clock::now();
  const ModelFile model = ModelFile::open(p.model_path);
  std::vector<CacheScheme> schemes;
  for (size_t i = 0; i < artifacts.size(); ++i) {
    check_artifact_matches(artifacts[i], model, names[i]);
    if (p.serve_on_runtime) {
      try {
        schemes.push_back(runtime_scheme_from_artifact(artifacts[i], names[i], model.config(), ValidateDevice::Cpu));
        continue;
      } catch (const Error& e) {  // e.g. kvarn: says so and that the codec path evaluates it
        std::printf("%s %s\n", tag.c_str(), e.what());
      }
    }
    schemes.push_back(scheme_from_artifact(std::move(artifacts[i]), names[i], model.config()));
  }
  ValidateData data;
  data.ids_path = p.eval_ids;
  const auto docs = load_validation_documents(model, data);
  const ValidationResult result = validate_schemes(model, docs, schemes, ValidateMode::PseudoDecode, p.block);
  step_line(s, "validate: " + std::to_string(result.predictions) + " predictions over " +
                   std::to_string(result.documents) + " held-out documents, pseudo-decode in blocks of " +
                   std::to_string(p.block) + " tokens");
  std::printf("\n");
  std::cout << format_table(result);
  const std::string json = (out / (p.label + "-validation.json")).string();
  write_bytes_atomically(json, to_json(result));
  write_bytes_atomically((out / (p.label + "-validation.svg")).string(), to_svg(result));
  std::printf("\n%s wrote %s and .svg; total %.1f s\n", tag.c_str(), json.c_str(), since(t0));
}

// Valid UTF-8 of `text` with each byte that does not start a valid sequence (a tokenizer's lone
// byte token) shown as U+FFFD and control characters as spaces, so that a terminal prints it.
std::string printable_utf8(const std::string& text) {
  std::string out;
  const auto* b = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  for (size_t i = 0; i < n;) {
    const unsigned char c = b[i];
    size_t len = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
    bool ok = len > 0 && i + len <= n;
    for (size_t k = 1; ok && k < len; ++k) ok = (b[i + k] & 0xC0) == 0x80;
    if (!ok) {
      out += "\xEF\xBF\xBD";
      ++i;
    } else {
      if (len == 1 && (c < 0x20 || c == 0x7F)) out += ' ';
      else out.append(text, i, len);
      i += len;
    }
  }
  return out;
}

// The first ~max_chars bytes of a decoded story, cut at a space, indented and wrapped at spaces.
std::string story_excerpt(const std::string& text, size_t max_chars) {
  std::string t = printable_utf8(text);
  if (t.size() > max_chars) {
    size_t cut = t.rfind(' ', max_chars);
    if (cut == std::string::npos)  // no space: cut before a character, not inside one
      for (cut = max_chars; cut > 0 && (static_cast<unsigned char>(t[cut]) & 0xC0) == 0x80;) --cut;
    t = t.substr(0, cut) + " ...";
  }
  std::string wrapped = "    ";
  size_t col = 0;
  for (char ch : t) {
    if (ch == ' ' && col >= 88) {
      wrapped += "\n    ";
      col = 0;
      continue;
    }
    wrapped += ch;
    ++col;
  }
  return wrapped;
}

int run_real(const Args& a) {
  const auto t0 = Clock::now();
  std::error_code ec;
  if (!fs::exists(a.model, ec))
    throw Error("demo model not found at " + a.model +
                " (the repository ships it as cli/demo/stories260k/stories260K.bin with tok512.bin; this kvcc "
                "was built from " KVCC_SOURCE_DIR
                "; pass --model PATH to use another copy or model, or "
                "--synthetic for the generated model)");
  fs::create_directories(a.out_dir);
  const fs::path out(a.out_dir);
  Pipeline p;
  const fs::path mp = fs::absolute(a.model);
  p.label = (fs::is_directory(mp, ec) ? mp.filename() : mp.parent_path().filename()).string();
  p.model_path = a.model;
  p.out_dir = a.out_dir;
  p.sink = or_default(a.sink, 4);
  p.recent = or_default(a.recent, 32);
  p.page_size = or_default(a.page_size, 16);
  p.block = or_default(a.block, 16);
  p.methods =
      a.methods.empty() ? std::vector<std::string>{"identity", "hadamard", "oscar", "oscar-lm", "kivi"} : a.methods;
  const std::string tag = "[" + p.label + "]";

  // 1. The model and its tokenizer.
  Clock::time_point s = Clock::now();
  const ModelFile model = ModelFile::open(a.model);
  const ModelConfig& c = model.config();
  const auto tokenizer = Tokenizer::for_model(a.model, c.vocab);
  p.max_seq_len = std::min(or_default(a.doc_length, 256), c.max_position);
  std::printf(
      "%s model %s: %s, hidden %d, %d layers, %d q / %d kv heads, head_dim %d, vocab %d, %s RoPE "
      "(%.2f s)\n",
      tag.c_str(), a.model.c_str(), c.architecture.c_str(), c.hidden, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim,
      c.vocab, rope_style_name(c.rope_style), since(s));

  // 2. Documents sampled from the model (no text from outside the repository): calibration and
  // held-out stories from different seeds, each from BOS until the model starts the next story.
  s = Clock::now();
  demo::SampleOptions so;
  so.max_tokens = p.max_seq_len;
  so.temperature = a.temperature;
  so.stop_ids = {tokenizer->bos_id(), tokenizer->eos_id()};
  so.seed = a.seed;
  const auto calib = demo::sample_documents(model, or_default(a.calib_docs, 48), so);
  so.seed = a.seed + 1;
  const auto heldout = demo::sample_documents(model, or_default(a.eval_docs, 16), so);
  p.calib_ids = (out / (p.label + "-calib.ids")).string();
  p.eval_ids = (out / (p.label + "-heldout.ids")).string();
  write_token_id_file(p.calib_ids, calib);
  write_token_id_file(p.eval_ids, heldout);
  size_t calib_tokens = 0, eval_tokens = 0;
  for (const auto& d : calib) calib_tokens += d.size();
  for (const auto& d : heldout) eval_tokens += d.size();
  std::printf(
      "%s sampled %zu calibration stories (%zu tokens, seed %llu) and %zu held-out stories (%zu tokens, "
      "seed %llu) at temperature %.2f, at most %d tokens each -> %s, %s (%.2f s; %.1f s total)\n",
      tag.c_str(), calib.size(), calib_tokens, (unsigned long long)a.seed, heldout.size(), eval_tokens,
      (unsigned long long)(a.seed + 1), a.temperature, p.max_seq_len, p.calib_ids.c_str(), p.eval_ids.c_str(), since(s),
      since(t0));
  if (!heldout.empty()) {
    const std::vector<int32_t> body(heldout[0].begin() + 1, heldout[0].end());
    std::printf("%s the first held-out story, as the model wrote it (%s):\n%s\n", tag.c_str(),
                tokenizer->kind().c_str(), story_excerpt(tokenizer->decode(body), 420).c_str());
    if (a.model == KVCC_DEMO_MODEL)
      std::printf(
          "%s (the shipped copy of stories260K does not write fluent English: some of its weights look\n"
          "%s  re-initialised, see cli/demo/stories260k/README.md; --model runs the same on any model)\n",
          tag.c_str(), std::string(tag.size(), ' ').c_str());
  }
  std::fflush(stdout);

  run_pipeline(p, t0);
  std::printf(
      "The same on your model (kvcc SUBCOMMAND --help):\n"
      "  kvcc calibrate-model --model DIR --data TEXT -o stats.h5\n"
      "  kvcc compile stats.h5 --method oscar -o oscar.kvcc.h5\n"
      "  kvcc validate --model DIR --artifact oscar.kvcc.h5 --data HELDOUT --cache runtime\n");
  return 0;
}

int run_synthetic(const Args& a) {
  const auto t0 = Clock::now();
  fs::create_directories(a.out_dir);
  const fs::path out(a.out_dir);
  const SyntheticModelSpec spec;
  Pipeline p;
  p.label = "synthetic";
  p.model_path = (out / "synthetic-model").string();
  p.out_dir = a.out_dir;
  p.max_seq_len = or_default(a.doc_length, 512);
  p.sink = or_default(a.sink, 4);
  p.recent = or_default(a.recent, 32);
  p.page_size = or_default(a.page_size, 32);
  p.block = or_default(a.block, 128);
  p.serve_on_runtime = false;  // the codec path, as the synthetic demo has always run
  p.methods = a.methods.empty() ? std::vector<std::string>{"identity", "hadamard", "kivi", "kvarn", "oscar", "oscar-lm"}
                                : a.methods;
  write_synthetic_model(p.model_path, spec);
  // Held-out documents use a different walk seed from the calibration documents.
  p.calib_ids = (out / "synthetic-calib.ids").string();
  p.eval_ids = (out / "synthetic-heldout.ids").string();
  write_token_ids(p.calib_ids, synthetic_documents(spec, or_default(a.calib_docs, 8), p.max_seq_len, 1));
  write_token_ids(p.eval_ids, synthetic_documents(spec, or_default(a.eval_docs, 4), p.max_seq_len, 2));
  std::printf("[synthetic] model %s: %d layers, %d q / %d kv heads, head_dim %d, vocab %d (%.1f s)\n",
              p.model_path.c_str(), spec.n_layers, spec.n_heads, spec.n_kv_heads, spec.head_dim, spec.vocab, since(t0));
  std::printf("[synthetic] a SYNTHETIC model: random weights with real-model KV structure; not a language model\n");
  run_pipeline(p, t0);
  return 0;
}

Command reg{"demo", 5,
            "Run the whole pipeline on a real tiny model shipped with kvcc (sample, calibrate, compile, validate)",
            [](CLI::App& sub) {
              auto a = std::make_shared<Args>();
              sub.footer(
                  "By default runs on stories260K (llama2.c, trained on TinyStories; MIT; shipped in\n"
                  "cli/demo/stories260k): dim 64, 5 layers, 8 q / 4 kv heads, head_dim 8, vocab 512.\n"
                  "Known problem: this copy does not write fluent English (its README says more).\n"
                  "Files are named after the model's directory (<model>: stories260k).\n"
                  "Steps, each timed:\n"
                  "  1. sample: stories from the model itself with the CPU forward pass (temperature 1,\n"
                  "     from BOS until it starts the next story): --calib-docs for calibration (seed\n"
                  "     --seed) and --eval-docs held out (seed --seed + 1), written as token-id files\n"
                  "     OUT/<model>-{calib,heldout}.ids; the first held-out story is printed.\n"
                  "  2. calibrate on the calibration ids -> OUT/<model>.stats.h5.\n"
                  "  3. compile each of --methods at 2 bits with small windows (sink 4, recent 32,\n"
                  "     pages of 16; KIVI's key groups = the page) -> OUT/<model>-<method>.kvcc.h5.\n"
                  "     At head_dim 8 a per-token group is 8 channels, so its fp16 scale and zero cost\n"
                  "     4 bits per element on top of the 2-bit codes (oscar-lm's scale alone: 2); the\n"
                  "     table's effective bits count them and the BF16 windows.\n"
                  "  4. validate all of them in one run over the held-out ids (pseudo-decode in blocks\n"
                  "     of 16): the methods the INT2 paged runtime serves (identity, hadamard, random,\n"
                  "     oscar, oscar-lm, kivi) through its CPU path (cache column runtime/cpu), the\n"
                  "     others (kvarn, ...) through the codec path (codec); against the full-precision\n"
                  "     model: perplexity, KL, top-1 agreement, effective bits.\n"
                  "     -> the table, OUT/<model>-validation.{json,svg}.\n"
                  "--synthetic runs steps 2-4 on a synthetic model kvcc generates instead (random\n"
                  "weights with real-model KV structure, Markov-chain token documents; not a language\n"
                  "model; codec path, pages of 32, blocks of 128; its defaults: 8 + 4 documents of\n"
                  "512 tokens, methods identity hadamard kivi kvarn oscar oscar-lm).\n"
                  "Example: kvcc demo --out /tmp/demo && ls /tmp/demo");
              sub.add_option("--out", a->out_dir, "directory for the documents, stats, artifacts and results")
                  ->capture_default_str();
              sub.add_option("--model", a->model,
                             "model to run (a llama2.c .bin with its tok*.bin beside it, or a Hugging Face "
                             "directory)")
                  ->capture_default_str();
              sub.add_flag("--synthetic", a->synthetic, "run on the generated synthetic model instead");
              sub.add_option("--methods", a->methods,
                             "methods to compile (default: identity hadamard oscar oscar-lm kivi; synthetic: "
                             "identity hadamard kivi kvarn oscar oscar-lm)");
              sub.add_option("--calib-docs", a->calib_docs, "calibration documents (default 48; synthetic 8)")
                  ->transform(whole_number(1, 2147483647));
              sub.add_option("--eval-docs", a->eval_docs, "held-out documents (default 16; synthetic 4)")
                  ->transform(whole_number(1, 2147483647));
              sub.add_option("--doc-length", a->doc_length,
                             "tokens per document at most (default 256, capped at the model's context; "
                             "synthetic: exactly, 512)")
                  ->transform(whole_number(1, 2147483647));
              sub.add_option("--seed", a->seed, "sampling seed of the calibration stories (held out: seed + 1)")
                  ->transform(whole_number(0, ~0ULL))
                  ->capture_default_str();
              sub.add_option("--temperature", a->temperature, "sampling temperature")
                  ->check(positive_real())
                  ->capture_default_str();
              sub.add_option("--sink", a->sink, "full-precision first tokens (default 4)")
                  ->transform(whole_number(0, 2147483647));
              sub.add_option("--recent", a->recent, "full-precision recent window (default 32)")
                  ->transform(whole_number(0, 2147483647));
              sub.add_option("--page-size", a->page_size, "tokens per INT2 page (default 16; synthetic 32)")
                  ->transform(whole_number(1, 2147483647));
              sub.add_option("--block", a->block, "pseudo-decode block in tokens (default 16; synthetic 128)")
                  ->transform(whole_number(1, 2147483647));
              return [a] { return a->synthetic ? run_synthetic(*a) : run_real(*a); };
            }};

}  // namespace
}  // namespace kvcc::cli
