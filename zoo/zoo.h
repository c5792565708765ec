// A zoo is a directory of published artifacts that a user can host anywhere (a git repo, a model
// hub, a shared disk):
//
//   <zoo>/index.json                                  the catalogue (schema in docs/zoo.md)
//   <zoo>/<model_id>/<recipe_tag>/artifact.<rev>.kvcc.h5
//   <zoo>/<model_id>/<recipe_tag>/card.<rev>.md       model, fingerprint, recipe, calibration, bits,
//                                                     validation results
//
//   <zoo>/<model_id>/<recipe_tag>/README.md          the model card a model hub shows: YAML front
//                                                     matter + method, bits, windows, measured quality
//
// Entry ids are "<model_id>/<recipe_tag>". File names carry a revision (the first 12 hex digits
// of the sha256 of the entry's content) so that publishing a replacement never overwrites a file
// the current index refers to: files are written first, then the index is replaced atomically
// (temp + rename), then files no entry refers to any more are removed. An interrupted publish
// therefore leaves the old index valid and every existing entry intact (at worst unreferenced
// files, which `zoo verify` reports as extra). README.md has the fixed name hubs look for, so it
// is not in the index: it is rendered from the entry's index record alone (render_model_card),
// written atomically after the index, and `zoo verify` re-renders it to find a missing or stale one.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "formats/artifact.h"
#include "formats/model_config.h"

namespace kvcc::zoo {

inline constexpr const char* kIndexName = "index.json";
inline constexpr const char* kIndexFormat = "kvcc-zoo";
inline constexpr int kIndexVersion = 1;

struct ZooFile {
  std::string role;    // "artifact" | "card"
  std::string path;    // relative to the zoo directory, '/'-separated
  std::string sha256;  // hex
  uint64_t size = 0;
};

struct ZooEntry {
  std::string id;  // "<model_id>/<recipe_tag>"
  std::string model_id;
  std::string recipe_tag;
  ModelFingerprint fingerprint;
  std::string fingerprint_source;  // "model" | "shapes" (built from an imported file's shapes only)
  std::string artifact_format_version;
  std::string published;  // UTC, ISO 8601
  std::string notes;
  // The model card's hub metadata: the base model's hub repository id and the artifact's licence
  // (an SPDX id such as "mit"); empty: not known (the card then names model_id and no licence).
  // In the index only when set.
  std::string base_model, license;
  nlohmann::json recipe;      // method, bits, group, sink, recent, value_target, granularity, ...
  nlohmann::json shape;       // n_layers, n_heads, n_kv_heads, head_dim, rope_style
  nlohmann::json provenance;  // source, tokens, sequences, data/stats sha256, producer, command
  nlohmann::json bits;        // nominal, history, effective at 4K/32K/128K
  nlohmann::json validation;  // null unless validation results were attached
  std::vector<ZooFile> files;

  const ZooFile* file(const std::string& role) const;
};

struct Index {
  std::vector<ZooEntry> entries;  // sorted by id
  const ZooEntry* find(const std::string& id) const;
};

// Reads <zoo>/index.json and checks its schema. When the index is absent: an empty index if
// allow_missing, else an Error saying there is no zoo there.
Index read_index(const std::string& zoo_dir, bool allow_missing = false);
nlohmann::json entry_to_json(const ZooEntry& entry);
ZooEntry entry_from_json(const nlohmann::json& j);  // Error on a schema violation

// The recipe tag of an artifact ("oscar-int2-g128-logit2", "kivi-k2v2-g32", ...).
std::string recipe_tag(const Artifact& artifact);
// The card text (markdown) for an entry.
std::string render_card(const ZooEntry& entry, const Artifact& artifact);

// The model card file of every entry folder.
inline constexpr const char* kModelCardName = "README.md";
// Its text: YAML front matter (base_model, library_name: kvcc, tags) and a body with the method,
// key/value bits, effective bits, windows, page size and the measured quality of the attached
// validation report (or a statement that there is none). A function of the index record only.
std::string render_model_card(const ZooEntry& entry);
// "<model_id>/<recipe_tag>/README.md" (relative to the zoo).
std::string model_card_path(const ZooEntry& entry);

struct PublishOptions {
  std::string notes;          // appended to the card
  std::string base_model;     // hub repository id of the base model ("karpathy/tinyllamas"); "" unknown
  std::string license;        // licence of the artifact (SPDX id); "" unknown
  bool replace = false;       // replace a duplicate or conflicting entry instead of refusing
  nlohmann::json validation;  // attached results (a `kvcc validate` JSON report); null: none
  // Called after each step ("files_written", "index_temp_written", "index_written"); tests throw
  // from it to simulate a publish interrupted at that point.
  std::function<void(const std::string& stage)> on_stage;
};

struct PublishResult {
  ZooEntry entry;
  std::vector<std::string> replaced;       // ids of entries the new one replaced
  std::vector<std::string> removed_files;  // old files no entry refers to any more
  // With `replace`, an entry identical to the request (same id, artifact bytes, notes,
  // validation, base model and licence) is kept as it is (its files, publication time and index record) and only its
  // model card is rewritten: re-publishing regenerates cards without touching artifacts.
  bool unchanged = false;
};

// Verifies the artifact (every problem verify finds is reported) before touching the zoo; refuses
// a duplicate (same id, or the same artifact already published under another id) and a conflict
// (the artifact's model id already names a model with another fingerprint) unless `replace`.
PublishResult publish(const std::string& artifact_path, const std::string& zoo_dir, const PublishOptions& options);

struct VerifyReport {
  size_t entries = 0, files_checked = 0;  // files the index lists (model cards not counted)
  std::vector<std::string> missing;       // "path (entry id)", model cards included
  std::vector<std::string> corrupt;       // "path (entry id): size/sha256 differ" or a stale model card
  std::vector<std::string> extra;         // files in the zoo no entry refers to
  bool ok() const { return missing.empty() && corrupt.empty() && extra.empty(); }
};
// Re-hashes every file the index lists and walks the directory for files it does not list.
VerifyReport verify_zoo(const std::string& zoo_dir);

// Entry lookup for `zoo show`: an exact id, else a unique id prefix or unique model id.
const ZooEntry& resolve_entry(const Index& index, const std::string& query);

struct FindResult {
  std::vector<const ZooEntry*> matches;
  const ZooEntry* closest = nullptr;  // when nothing matches: the entry with the fewest differences
  std::string closest_difference;     // describe_difference of that entry
};
FindResult find_for_fingerprint(const Index& index, const ModelFingerprint& fingerprint);

}  // namespace kvcc::zoo
