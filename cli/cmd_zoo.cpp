// kvcc zoo: publish, list, show, verify and find artifacts in a zoo directory; import and export
// OSCAR RotationZoo rotation files. docs/zoo.md describes the layout and the index schema.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <memory>
#include <string>

#include "cli/command.h"
#include "formats/artifact.h"
#include "formats/atomic_file.h"
#include "formats/error.h"
#include "formats/model_file.h"
#include "zoo/oscar_pt.h"
#include "formats/sha256.h"
#include "zoo/oscar_interop.h"
#include "zoo/zoo.h"

namespace kvcc::cli {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

std::string short_id(const std::string& hex) { return hex.substr(0, 12); }

std::string bits_text(const json& bits) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.2f", bits.value("nominal", 0.0));
  std::string s = buf;
  if (bits.contains("effective") && bits["effective"].contains("32768")) {
    std::snprintf(buf, sizeof buf, " (%.2f @32K)", bits["effective"]["32768"].get<double>());
    s += buf;
  }
  return s;
}

void print_entry_line(const zoo::ZooEntry& e) {
  const zoo::ZooFile* art = e.file("artifact");
  std::printf("%-44s %-10s %-16s %2dx%dx%-4d %9.2f MB  fp %s%s%s\n", e.id.c_str(), e.recipe.value("method", "").c_str(),
              bits_text(e.bits).c_str(), e.shape.value("n_layers", 0), e.shape.value("n_kv_heads", 0),
              e.shape.value("head_dim", 0), double(art->size) / 1e6, short_id(e.fingerprint.id).c_str(),
              e.fingerprint_source == "shapes" ? " (shapes only)" : "", e.validation.is_null() ? "" : "  validated");
}

std::string read_file_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  KVCC_REQUIRE(bool(in), "cannot read " + path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

static Command reg{
    "zoo", 80, "Publish, list, check and find artifacts in a zoo; import/export OSCAR rotation files",
    [](CLI::App& app) -> std::function<int()> {
      app.require_subcommand(1);
      app.footer(
          "A zoo is a directory (index.json + one folder per model and recipe) that can be hosted anywhere.\n"
          "Examples:\n"
          "  kvcc zoo publish model.kvcc.h5 --zoo zoo/published --card-notes 'calibrated on ...'\n"
          "  kvcc zoo find --model ../shared/models/gutenberg-27m --zoo zoo/published\n"
          "  kvcc zoo import-oscar k_rotation_qqt_r_h_pbr.pt v_rotation_sst_r_h_pbr.pt --model-id qwen3-4b -o "
          "q.kvcc.h5\n"
          "  kvcc zoo export-oscar q.kvcc.h5 -o rotations/");

      struct Options {
        std::string zoo_dir, artifact, notes, validation, base_model, license, entry, model, model_id, key_pt, value_pt,
            out;
        bool replace = false, json_out = false, card = false;
        int format_version = 0, n_heads = 0, n_kv_heads = 0;
        double key_clip = 0.96, value_clip = 0.92;
      };
      auto o = std::make_shared<Options>();

      auto* publish =
          app.add_subcommand("publish", "Verify an artifact and add it (files, then the index, atomically)");
      publish->add_option("artifact", o->artifact, "Artifact to publish (.kvcc.h5)")->required();
      publish->add_option("--zoo", o->zoo_dir, "Zoo directory (created when absent)")->required();
      publish->add_option("--card-notes", o->notes, "Text appended to the entry's card");
      publish->add_option("--base-model", o->base_model,
                          "Hub id of the base model for the model card (e.g. karpathy/tinyllamas)");
      publish->add_option("--license", o->license, "Licence of the artifact for the model card (SPDX id, e.g. mit)");
      publish->add_option("--validation", o->validation, "A `kvcc validate` JSON report to attach");
      publish->add_flag("--replace", o->replace, "Replace a duplicate or conflicting entry instead of refusing");

      auto* list = app.add_subcommand("list", "List a zoo's entries");
      list->add_option("--zoo", o->zoo_dir, "Zoo directory")->required();
      list->add_flag("--json", o->json_out, "Print the index entries as JSON");

      auto* show = app.add_subcommand("show", "Show one entry (id, unique id prefix or model id)");
      show->add_option("entry", o->entry, "Entry id")->required();
      show->add_option("--zoo", o->zoo_dir, "Zoo directory")->required();
      show->add_flag("--card", o->card, "Print the entry's card instead of its index record");

      auto* verify = app.add_subcommand("verify", "Re-hash every file; report missing, corrupt and extra files");
      verify->add_option("--zoo", o->zoo_dir, "Zoo directory")->required();

      auto* find = app.add_subcommand("find", "Entries whose fingerprint matches a model");
      find->add_option("--model", o->model, "Model directory or llama2.c .bin")->required();
      find->add_option("--zoo", o->zoo_dir, "Zoo directory")->required();

      auto* imp = app.add_subcommand("import-oscar", "Convert OSCAR RotationZoo K/V .pt files into a kvcc artifact");
      imp->add_option("key_pt", o->key_pt, "k_rotation_*.pt")->required();
      imp->add_option("value_pt", o->value_pt, "v_rotation_*.pt")->required();
      imp->add_option("--model-id", o->model_id, "Model id recorded in the artifact (e.g. qwen3-4b-thinking-2507)")
          ->required();
      imp->add_option("--model", o->model, "The model the rotations belong to (fingerprint and shape check)");
      imp->add_option("-o,--output", o->out, "Artifact to write")->required();
      imp->add_option("--n-heads", o->n_heads, "Query heads, without --model (default: n_kv_heads)");
      imp->add_option("--n-kv-heads", o->n_kv_heads, "KV heads, without --model (default: rotations per layer)");
      imp->add_option("--key-clip", o->key_clip, "Key clip ratio (OSCAR serving default 0.96)");
      imp->add_option("--value-clip", o->value_clip, "Value clip ratio (OSCAR serving default 0.92)");

      auto* exp = app.add_subcommand("export-oscar", "Write an artifact's rotations as OSCAR K/V .pt files");
      exp->add_option("artifact", o->artifact, "Artifact (.kvcc.h5)")->required();
      exp->add_option("-o,--output", o->out, "Output directory (created when absent; an existing file is refused)")
          ->required();
      exp->add_option("--format-version", o->format_version,
                      "1: per layer (KV heads must share rotations), 2: per KV head; default: 1 when possible")
          ->check(CLI::IsMember({1, 2}));

      return [o, publish, list, show, verify, find, imp, exp]() -> int {
        if (publish->parsed()) {
          zoo::PublishOptions po;
          po.notes = o->notes;
          po.base_model = o->base_model;
          po.license = o->license;
          po.replace = o->replace;
          if (!o->validation.empty()) {
            try {
              po.validation = json::parse(read_file_text(o->validation));
            } catch (const json::parse_error& e) {
              throw Error(o->validation + " is not valid JSON (" + std::string(e.what()) + ")");
            }
          }
          const zoo::PublishResult r = zoo::publish(o->artifact, o->zoo_dir, po);
          for (const auto& id : r.replaced) std::printf("replaced entry %s\n", id.c_str());
          std::printf(r.unchanged ? "unchanged %s (model card rewritten)\n" : "published %s\n", r.entry.id.c_str());
          for (const auto& f : r.entry.files)
            std::printf("  %s  %s  (%llu bytes)\n", f.sha256.c_str(), f.path.c_str(),
                        static_cast<unsigned long long>(f.size));
          return 0;
        }
        if (list->parsed()) {
          const zoo::Index index = zoo::read_index(o->zoo_dir);
          if (o->json_out) {
            json arr = json::array();
            for (const auto& e : index.entries) arr.push_back(zoo::entry_to_json(e));
            std::cout << arr.dump(2) << "\n";
            return 0;
          }
          if (index.entries.empty()) std::printf("zoo %s is empty\n", o->zoo_dir.c_str());
          for (const auto& e : index.entries) print_entry_line(e);
          return 0;
        }
        if (show->parsed()) {
          const zoo::Index index = zoo::read_index(o->zoo_dir);
          const zoo::ZooEntry& e = zoo::resolve_entry(index, o->entry);
          if (o->card) {
            std::cout << read_file_text((fs::path(o->zoo_dir) / e.file("card")->path).string());
          } else {
            std::cout << zoo::entry_to_json(e).dump(2) << "\n";
          }
          return 0;
        }
        if (verify->parsed()) {
          const zoo::VerifyReport r = zoo::verify_zoo(o->zoo_dir);
          for (const auto& m : r.missing) std::printf("missing: %s\n", m.c_str());
          for (const auto& c : r.corrupt) std::printf("corrupt: %s\n", c.c_str());
          for (const auto& x : r.extra) std::printf("extra:   %s\n", x.c_str());
          std::printf("%s: %zu entries, %zu files checked, %zu missing, %zu corrupt, %zu extra\n",
                      r.ok() ? "OK" : "FAILED", r.entries, r.files_checked, r.missing.size(), r.corrupt.size(),
                      r.extra.size());
          return r.ok() ? 0 : 1;
        }
        if (find->parsed()) {
          const ModelFile model = ModelFile::open(o->model);
          const zoo::Index index = zoo::read_index(o->zoo_dir);
          const zoo::FindResult r = zoo::find_for_fingerprint(index, model.fingerprint());
          if (r.matches.empty()) {
            std::string msg = "no entry in " + o->zoo_dir + " matches model " + o->model + " (fingerprint " +
                              short_id(model.fingerprint().id) + ")";
            if (r.closest != nullptr)
              msg += "; closest: " + r.closest->id + " (entry vs model: " + r.closest_difference + ")";
            else msg += "; the zoo is empty";
            throw Error(msg);
          }
          for (const auto* e : r.matches) print_entry_line(*e);
          return 0;
        }
        if (imp->parsed()) {
          require_output_is_not_input(o->out, {o->key_pt, o->value_pt, o->model});
          const OscarRotationSet key = read_oscar_pt(o->key_pt);
          const OscarRotationSet value = read_oscar_pt(o->value_pt);
          zoo::OscarImportOptions io;
          io.model_id = o->model_id;
          io.n_heads = o->n_heads;
          io.n_kv_heads = o->n_kv_heads;
          io.key_clip_ratio = o->key_clip;
          io.value_clip_ratio = o->value_clip;
          io.key_file_sha256 = sha256_file_hex(o->key_pt);
          io.value_file_sha256 = sha256_file_hex(o->value_pt);
          io.command = "kvcc zoo import-oscar " + o->key_pt + " " + o->value_pt + " --model-id " + o->model_id +
                       (o->model.empty() ? "" : " --model " + o->model) +
                       (o->n_heads ? " --n-heads " + std::to_string(o->n_heads) : "") +
                       (o->n_kv_heads ? " --n-kv-heads " + std::to_string(o->n_kv_heads) : "") + " --key-clip " +
                       std::to_string(o->key_clip) + " --value-clip " + std::to_string(o->value_clip) + " -o " + o->out;
          std::unique_ptr<ModelFile> model;
          if (!o->model.empty()) {
            model = std::make_unique<ModelFile>(ModelFile::open(o->model));
            io.config = &model->config();
            io.fingerprint = &model->fingerprint();
          }
          const Artifact art = zoo::import_oscar(key, value, io);
          const std::vector<std::string> problems = verify_artifact(art);
          if (!problems.empty()) throw Error("the imported rotations fail verification: " + problems.front());
          write_artifact(art, o->out);
          std::printf("wrote %s: %d layers, %d KV heads, %dx%d rotations (%s), fingerprint %s%s\n", o->out.c_str(),
                      art.n_layers, art.n_kv_heads, art.head_dim, art.head_dim, art.recipe.granularity.c_str(),
                      short_id(art.fingerprint.id).c_str(),
                      model ? "" : " (from shapes only; pass --model to tie it to a model)");
          return 0;
        }
        if (exp->parsed()) {
          // -o names a directory: an existing file there is refused (not replaced by a directory).
          std::error_code ec;
          KVCC_REQUIRE(!fs::exists(o->out, ec) || fs::is_directory(o->out, ec),
                       "--output " + o->out + " is an existing file; export-oscar writes two .pt files into a " +
                           "directory: give a directory (created when absent)");
          const Artifact art = read_artifact(o->artifact);
          const zoo::OscarExport ex = zoo::export_oscar(art, o->format_version);
          const std::string kpath = (fs::path(o->out) / ex.key_file_name).string();
          const std::string vpath = (fs::path(o->out) / ex.value_file_name).string();
          require_output_is_not_input(kpath, {o->artifact});
          require_output_is_not_input(vpath, {o->artifact});
          fs::create_directories(o->out, ec);
          KVCC_REQUIRE(!ec, "cannot create the output directory " + o->out + " (" + ec.message() + ")");
          write_oscar_pt(ex.key, kpath);
          write_oscar_pt(ex.value, vpath);
          std::printf("wrote %s and %s (format_version %d, %zu layers)\n", kpath.c_str(), vpath.c_str(),
                      ex.key.format_version, ex.key.layers.size());
          return 0;
        }
        return 1;
      };
    }};

}  // namespace
}  // namespace kvcc::cli
