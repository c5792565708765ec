// kvcc demo: the whole pipeline on a SYNTHETIC model kvcc generates itself (nothing from outside
// the repository): generate model + token documents -> calibrate -> compile several methods at 2
// bits with small windows -> validate (pseudo-decode) -> table, JSON and SVG.
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
#include "compile/compile.h"
#include "formats/artifact.h"
#include "formats/atomic_file.h"
#include "formats/error.h"
#include "formats/model_file.h"
#include "formats/sha256.h"
#include "formats/stats.h"
#include "eval/experiment.h"
#include "eval/output.h"
#include "eval/scheme.h"

namespace kvcc::cli {
namespace {

struct Args {
  std::string out_dir = "kvcc-demo";
  int calib_docs = 8, eval_docs = 4, doc_length = 512;
  std::vector<std::string> methods{"identity", "hadamard", "kivi", "kvarn", "oscar", "oscar-lm"};
};

double since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int run_demo(const Args& a) {
  namespace fs = std::filesystem;
  const auto t0 = std::chrono::steady_clock::now();
  fs::create_directories(a.out_dir);
  const fs::path out(a.out_dir);
  const SyntheticModelSpec spec;
  const std::string model_dir = (out / "synthetic-model").string();
  write_synthetic_model(model_dir, spec);
  // Held-out documents use a different walk seed from the calibration documents.
  const std::string calib_ids = (out / "synthetic-calib.ids").string();
  const std::string eval_ids = (out / "synthetic-heldout.ids").string();
  write_token_ids(calib_ids, synthetic_documents(spec, a.calib_docs, a.doc_length, 1));
  write_token_ids(eval_ids, synthetic_documents(spec, a.eval_docs, a.doc_length, 2));
  std::printf("[synthetic] model %s: %d layers, %d q / %d kv heads, head_dim %d, vocab %d (%.1f s)\n",
              model_dir.c_str(), spec.n_layers, spec.n_heads, spec.n_kv_heads, spec.head_dim, spec.vocab,
              since(t0));

  CalibrationOptions copt;
  copt.model_path = model_dir;
  copt.ids_path = calib_ids;
  copt.max_seq_len = a.doc_length;
  copt.command = "kvcc demo (synthetic)";
  const std::string stats_path = (out / "synthetic.stats.h5").string();
  const CalibrationSummary cs = run_calibration(copt, stats_path);
  std::printf("[synthetic] calibrated on %llu tokens -> %s (%.1f s)\n", (unsigned long long)cs.tokens,
              stats_path.c_str(), since(t0));

  const Stats stats = read_stats(stats_path);
  const std::string stats_sha256 = sha256_file_hex(stats_path);
  std::vector<Artifact> artifacts;
  std::vector<std::string> names;
  for (const std::string& method : a.methods) {
    CompileOptions o;
    o.method = method;
    o.key_bits = o.value_bits = 2;
    // Small windows expose the quantised history; pages must fit in the ring (W >= P).
    o.sink = 4;
    o.recent = 32;
    o.page_size = 32;
    Artifact art = compile_artifact(stats, o);
    art.model_id = "synthetic";
    art.provenance.stats_sha256 = stats_sha256;
    art.command = "kvcc demo (synthetic): compile --method " + method + " --key-bits 2 --value-bits 2 "
                  "--sink 4 --recent 32 --page-size 32";
    const std::string path = (out / ("synthetic-" + method + ".kvcc.h5")).string();
    write_artifact(art, path);
    artifacts.push_back(std::move(art));
    names.push_back("synthetic-" + method);
    std::printf("[synthetic] compiled %s -> %s (%.1f s)\n", method.c_str(), path.c_str(), since(t0));
  }

  const ModelFile model = ModelFile::open(model_dir);
  std::vector<CacheScheme> schemes;
  for (size_t i = 0; i < artifacts.size(); ++i) {
    check_artifact_matches(artifacts[i], model, names[i]);
    schemes.push_back(scheme_from_artifact(std::move(artifacts[i]), names[i], model.config()));
  }
  ValidateData data;
  data.ids_path = eval_ids;
  const auto docs = load_validation_documents(model, data);
  const ValidationResult result =
      validate_schemes(model, docs, schemes, ValidateMode::PseudoDecode, 128, [&](const ValidateProgress& p) {
        std::fprintf(stderr, "[synthetic] validating: %llu/%llu tokens\n", (unsigned long long)p.tokens_done,
                     (unsigned long long)p.tokens_total);
      });
  std::printf("\n== SYNTHETIC model (random weights with real-model KV structure; not a language model) ==\n");
  std::cout << format_table(result);
  write_bytes_atomically((out / "synthetic-validation.json").string(), to_json(result));
  write_bytes_atomically((out / "synthetic-validation.svg").string(), to_svg(result));
  std::printf("[synthetic] wrote %s/synthetic-validation.{json,svg}; total %.1f s\n", a.out_dir.c_str(),
              since(t0));
  std::printf("The same on a real model:\n"
              "  kvcc calibrate-model --model DIR --data TEXT -o stats.h5\n"
              "  kvcc compile stats.h5 --method oscar -o oscar.kvcc.h5\n"
              "  kvcc validate --model DIR --artifact oscar.kvcc.h5 --data HELDOUT\n");
  return 0;
}

Command reg{"demo", 5,
            "Run the whole pipeline on a built-in SYNTHETIC model (calibrate, compile, validate)",
            [](CLI::App& sub) {
              auto a = std::make_shared<Args>();
              sub.footer(
                  "Generates a synthetic Llama-architecture model (random weights built with the KV\n"
                  "structure of real models: outlier key channels, RoPE, an attention sink,\n"
                  "anisotropic queries) and token documents, calibrates, compiles each method at 2\n"
                  "bits with sink 4 / recent 32 / pages of 32, and validates under pseudo-decode.\n"
                  "Everything is labelled synthetic; it needs nothing outside the repository.");
              sub.add_option("--out", a->out_dir, "directory for the model, stats, artifacts and results")
                  ->capture_default_str();
              sub.add_option("--methods", a->methods, "methods to compile")->capture_default_str();
              sub.add_option("--doc-length", a->doc_length, "tokens per document")->capture_default_str();
              sub.add_option("--calib-docs", a->calib_docs, "calibration documents")->capture_default_str();
              sub.add_option("--eval-docs", a->eval_docs, "held-out documents")->capture_default_str();
              return [a] { return run_demo(*a); };
            }};

}  // namespace
}  // namespace kvcc::cli
