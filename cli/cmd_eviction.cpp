#include <algorithm>
#include <cstdio>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/command.h"
#include "eval/eviction.h"
#include "eval/experiment.h"
#include "eval/scheme.h"
#include "formats/artifact.h"
#include "formats/atomic_file.h"
#include "formats/error.h"
#include "formats/model_file.h"
#include "formats/stats.h"

namespace kvcc::cli {
namespace {

struct Args {
  std::string model_path, stats_path, artifact_path, json_path;
  ValidateData data;
  EvictionOptions options;
  std::vector<std::string> scores, merges;
  std::string layer_budgets = "uniform";
};

std::string table(const EvictionResult& r) {
  std::string out;
  char line[256];
  std::snprintf(line, sizeof line,
                "%d conversations: %d passages, history %d, continuation %d (reference NLL %.4f); kept always: "
                "sink %d, recent %d\n",
                r.conversations, r.passages, r.history, r.continuation, r.reference_nll, r.sink, r.recent);
  out += line;
  if (r.prefill_block > 0) {
    std::snprintf(line, sizeof line, "block-wise prefill: blocks of %d tokens, evicting to the budget after each\n",
                  r.prefill_block);
    out += line;
  }
  // peak: the most rows the cache held at once, as a fraction of the whole history's.
  out += "score     ratio  int2  merge   merged  KL (nats)            dNLL                 top-1   peak\n";
  for (const EvictionRow& row : r.rows) {
    std::snprintf(line, sizeof line, "%-9s %5.1fx %-5s %-7s %5.3f   %.4e ±%.1e   %+.4e ±%.1e   %.4f  %.3f\n",
                  row.score.c_str(), row.ratio, row.int2 ? "yes" : "no", row.merge.c_str(), row.merged, row.kl,
                  row.kl_stderr, row.delta_nll, row.delta_nll_stderr, row.top1,
                  double(row.peak_rows) / (double(r.layers) * r.history));
    out += line;
  }
  return out;
}

std::string to_json(const EvictionResult& r) {
  nlohmann::json j;
  j["model"] = r.model;
  j["stats"] = r.stats;
  j["artifact"] = r.artifact;
  j["history"] = r.history;
  j["layers"] = r.layers;
  j["continuation"] = r.continuation;
  j["passages"] = r.passages;
  j["conversations"] = r.conversations;
  j["sink"] = r.sink;
  j["recent"] = r.recent;
  j["reference_nll"] = r.reference_nll;
  j["layer_budgets"] = r.layer_budgets;  // empty: uniform
  j["merge_threshold"] = r.merge_threshold;
  j["prefill_block"] = r.prefill_block;  // 0: the whole history at once
  if (r.epicache_routed_first >= 0) j["epicache_routed_to_first_passage"] = r.epicache_routed_first;
  j["seconds"] = r.seconds;
  for (const EvictionRow& row : r.rows)
    j["rows"].push_back({{"score", row.score},
                         {"ratio", row.ratio},
                         {"int2", row.int2},
                         {"merge", row.merge},
                         {"merged_fraction", row.merged},
                         {"kl", row.kl},
                         {"kl_stderr", row.kl_stderr},
                         {"delta_nll", row.delta_nll},
                         {"delta_nll_stderr", row.delta_nll_stderr},
                         {"top1_agreement", row.top1},
                         {"peak_rows", row.peak_rows}});
  return j.dump(2) + "\n";
}

std::vector<std::string> merge_names() {
  std::vector<std::string> names;
  for (EvictionMerge m : all_eviction_merges()) names.push_back(eviction_merge_name(m));
  return names;
}

std::vector<std::string> score_names() {
  std::vector<std::string> names;
  for (EvictionScore s : all_eviction_scores()) names.push_back(eviction_score_name(s));
  return names;
}

int run_eviction_command(Args& a) {
  KVCC_REQUIRE(!a.data.data_path.empty() || !a.data.ids_path.empty(), "eviction needs --data TEXT or --ids FILE");
  require_output_is_not_input(a.json_path, {a.model_path, a.stats_path, a.artifact_path, a.data.data_path,
                                            a.data.ids_path, a.data.tokenizer_path});
  if (!a.scores.empty()) {
    a.options.scores.clear();
    for (const std::string& name : a.scores)
      for (EvictionScore s : all_eviction_scores())
        if (name == eviction_score_name(s)) a.options.scores.push_back(s);
  }
  if (!a.merges.empty()) {
    a.options.merges.clear();
    for (const std::string& name : a.merges)
      for (EvictionMerge m : all_eviction_merges())
        if (name == eviction_merge_name(m)) a.options.merges.push_back(m);
  }
  if (a.options.prefill_block > 0) {
    KVCC_REQUIRE(a.scores.empty() || std::find(a.options.scores.begin(), a.options.scores.end(),
                                               EvictionScore::Emitted) == a.options.scores.end(),
                 "--scores emitted is measured on the whole prefill only; leave it out with --prefill-block");
    KVCC_REQUIRE(a.options.prefill_block <= a.options.history,
                 "--prefill-block " + std::to_string(a.options.prefill_block) + " is longer than the history (" +
                     std::to_string(a.options.history) + " tokens)");
  }
  const ModelFile model = ModelFile::open(a.model_path);
  std::optional<Stats> stats;
  if (!a.stats_path.empty()) {
    stats = read_stats(a.stats_path);
    KVCC_REQUIRE(stats->fingerprint.id == model.fingerprint().id,
                 a.stats_path + " was calibrated on another model (fingerprint " + stats->fingerprint.id + ", " +
                     a.model_path + " is " + model.fingerprint().id + ")");
  } else {
    for (EvictionScore s : a.options.scores)
      KVCC_REQUIRE((s != EvictionScore::QueryMoment && s != EvictionScore::QueryGaussian) || a.scores.empty(),
                   "the qmoment and qgauss scores need --stats (the calibrated query statistics)");
  }
  KVCC_REQUIRE(a.layer_budgets == "uniform" || !a.artifact_path.empty(),
               "--layer-budgets artifact needs --artifact (the budgets are stored in it)");
  std::optional<CacheScheme> int2;
  if (!a.artifact_path.empty()) {
    Artifact artifact = read_artifact(a.artifact_path);
    check_artifact_matches(artifact, model, a.artifact_path);
    if (a.layer_budgets == "artifact") {
      KVCC_REQUIRE(
          !artifact.layer_budgets.empty(),
          a.artifact_path + " carries no layer budgets (compile it with kvcc compile --layer-budgets sensitivity)");
      a.options.layer_budgets = artifact.layer_budgets;
    }
    int2 = scheme_from_artifact(std::move(artifact), a.artifact_path, model.config());
  }
  // Documents long enough for a passage (the first one also carries the continuation).
  ValidateData data = a.data;
  data.max_seq_len = a.options.history + a.options.continuation + 1;
  const auto docs = load_validation_documents(model, data);
  const auto conversations = build_conversations(docs, a.options, model.config().bos_id);
  EvictionResult r =
      run_eviction(model, conversations, stats ? &*stats : nullptr, int2 ? &*int2 : nullptr, a.options,
                   [](int done, int total) { std::fprintf(stderr, "eviction: conversation %d/%d\n", done, total); });
  r.model = a.model_path;
  r.stats = a.stats_path;
  r.artifact = a.artifact_path;
  if (!r.layer_budgets.empty()) {
    std::printf("layer budgets (relative to uniform):");
    for (double b : r.layer_budgets) std::printf(" %.3f", b);
    std::printf("\n");
  }
  std::cout << table(r);
  if (r.epicache_routed_first >= 0)
    std::printf("epicache: %d of %d continuations routed to an episode whose medoid is in the first passage\n",
                r.epicache_routed_first, r.conversations);
  std::printf("(%.1f s)\n", r.seconds);
  if (!a.json_path.empty()) write_bytes_atomically(a.json_path, to_json(r));
  return 0;
}

Command reg{"eviction", 55, "Measure token eviction: which history tokens to keep, by which score, and what it costs",
            [](CLI::App& sub) {
              auto a = std::make_shared<Args>();
              sub.footer(
                  "Builds conversations from the text: --passages passages from documents far apart\n"
                  "(different books in the held-out sets), --history tokens in all, then the next\n"
                  "--continuation tokens of the FIRST passage's document. The history is prefilled in\n"
                  "full precision; each policy keeps ceil(history / ratio) tokens per layer and KV head\n"
                  "(always the first --sink and the last --recent) and the continuation runs over them;\n"
                  "reported against the full history: KL(full || evicted), dNLL and top-1 agreement,\n"
                  "with standard errors across conversations.\n\n"
                  "Scores: window (StreamingLLM: sink + newest), h2o (accumulated attention), snapkv\n"
                  "(attention of the last --observation history queries, max-pooled over --pool),\n"
                  "emitted (snapkv's score over the history as the cache holds it, as the runtime's\n"
                  "attention_scores emits it: on int2 rows, over the quantised keys),\n"
                  "qmoment (k^T E[q q^T] k from --stats: no attention matrix), qgauss (log E[exp(q.k/sqrt d)]\n"
                  "for a Gaussian query fitted to --stats), keynorm (|k|^2), epicache (EpiCache: the\n"
                  "history's --block-token blocks clustered into --episodes episodes; per episode a\n"
                  "cache scored by its medoid block appended after the history; the continuation\n"
                  "routed by its first --route tokens), vatp (snapkv's attention times |v|_1, the\n"
                  "value-aware score of VATP).\n"
                  "With --merge the evicted tokens are merged into the kept ones instead of dropped\n"
                  "(each into the kept token of most similar key, cosine >= --merge-threshold, weighted\n"
                  "by the attention mass of the score's queries): value (values averaged, keys kept,\n"
                  "the entry's logit raised by the log of the merged mass), kv (keys too), average\n"
                  "(keys and values averaged, no log mass: D2O's form); every score and ratio runs\n"
                  "once per mode listed (none: dropped). On int2 rows the codec stores the merged rows.\n"
                  "With --prefill-block B the history is prefilled in blocks of B tokens that attend to\n"
                  "the cache as it stands, evicting to the budget after each block (snapkv/vatp: the\n"
                  "block's last --observation queries; epicache: the medoid block appended after it;\n"
                  "h2o: every query so far): memory bounded by budget + B rows (the 'peak' column).\n"
                  "With --artifact each policy also runs on the history quantised as the artifact's\n"
                  "cache holds it (rows marked int2; 'full' int2 is quantisation alone).\n"
                  "With --layer-budgets artifact the layers share the same total unevenly, by the\n"
                  "budgets the artifact stores (kvcc compile --layer-budgets sensitivity: layers\n"
                  "whose keys drift most under block-wise prefill keep more tokens).\n\n"
                  "Example:\n"
                  "  kvcc eviction --model ../shared/models/gutenberg-27m --data heldout.txt \\\n"
                  "      --stats gut.stats.h5 --artifact gut.oscar.kvcc.h5 --json eviction.json");
              sub.add_option("--model", a->model_path, "HF model directory or llama2.c .bin")->required();
              sub.add_option("--data", a->data.data_path, "text, documents separated by --separator");
              sub.add_option("--ids", a->data.ids_path, "pre-tokenized documents (one line of ids each)");
              sub.add_option("--tokenizer", a->data.tokenizer_path, "explicit tokenizer file (llama2.c)");
              sub.add_option("--separator", a->data.separator, "document separator")->capture_default_str();
              sub.add_option("--stats", a->stats_path, "calibration statistics of the model (for qmoment)");
              sub.add_option("--artifact", a->artifact_path, "also run every policy on the INT2-quantised history");
              sub.add_option("--history", a->options.history, "history tokens")
                  ->transform(whole_number(1, 2147483647))
                  ->capture_default_str();
              sub.add_option("--continuation", a->options.continuation, "continuation tokens scored")
                  ->transform(whole_number(1, 2147483647))
                  ->capture_default_str();
              sub.add_option("--passages", a->options.passages, "passages the history is made of")
                  ->transform(whole_number(1, 64))
                  ->capture_default_str();
              sub.add_option("--ratios", a->options.ratios, "token compression ratios (>= 1)")
                  ->delimiter(',')
                  ->check(real_in(1.0, 1e6))
                  ->capture_default_str();
              sub.add_option("--scores", a->scores, "scores to run (default: all; qmoment and qgauss need --stats)")
                  ->delimiter(',')
                  ->check(CLI::IsMember(score_names()));
              sub.add_option("--sink", a->options.sink, "first tokens always kept")
                  ->transform(whole_number(0, 2147483647))
                  ->capture_default_str();
              sub.add_option("--recent", a->options.recent, "newest tokens always kept")
                  ->transform(whole_number(0, 2147483647))
                  ->capture_default_str();
              sub.add_option("--observation", a->options.observation, "snapkv's observation window")
                  ->transform(whole_number(1, 2147483647))
                  ->capture_default_str();
              sub.add_option("--pool", a->options.pool, "snapkv's max-pool width (odd)")
                  ->transform(whole_number(1, 1023))
                  ->capture_default_str();
              sub.add_option("--conversations", a->options.conversations, "conversations at most")
                  ->transform(whole_number(1, 2147483647))
                  ->capture_default_str();
              sub.add_option("--episodes", a->options.episodes, "epicache: episodes")
                  ->transform(whole_number(1, 1024))
                  ->capture_default_str();
              sub.add_option("--block", a->options.block, "epicache: tokens per history block")
                  ->transform(whole_number(1, 2147483647))
                  ->capture_default_str();
              sub.add_option("--route", a->options.route, "epicache: continuation tokens that route it")
                  ->transform(whole_number(1, 2147483647))
                  ->capture_default_str();
              sub.add_option("--layer-budgets", a->layer_budgets,
                             "uniform (every layer keeps ceil(history / ratio)) or artifact (the artifact's "
                             "per-layer budgets share that total)")
                  ->check(CLI::IsMember({"uniform", "artifact"}))
                  ->capture_default_str();
              sub.add_option("--merge", a->merges,
                             "evicted tokens: none (dropped), value, kv or average (merged); a list runs each")
                  ->delimiter(',')
                  ->check(CLI::IsMember(merge_names()));
              sub.add_option("--merge-threshold", a->options.merge_threshold,
                             "merge an evicted token only if its key's cosine with the nearest kept key is at least "
                             "this (-1: every evicted token merges; > 1: none does)")
                  ->check(real_in(-2.0, 2.0))
                  ->capture_default_str();
              sub.add_option("--prefill-block", a->options.prefill_block,
                             "0: prefill the whole history, then evict; B: prefill it in blocks of B tokens, each "
                             "attending to the cache as it stands, evicting to the budget after each block "
                             "(bounded memory, EpiCache); every score but emitted")
                  ->transform(whole_number(0, 2147483647))
                  ->capture_default_str();
              sub.add_option("--json", a->json_path, "write the rows as JSON");
              return [a] { return run_eviction_command(*a); };
            }};

}  // namespace
}  // namespace kvcc::cli
