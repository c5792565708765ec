// The attention-level report (`kvcc report`): every method compiled in memory from one stats file
// and evaluated on the reservoir's held-out rows (documents never used for fitting), per layer and
// KV head. Held-out rows are cut into pages of the recipe's page size (KIVI and KVarN quantise a
// page at a time) and coded with formats/kv_codec.h's layer codec (all KV heads of a layer at
// once, on the same held-out tokens, so groups spanning KV heads are evaluated as coded).
// Attention here is a proxy: each held-out query attends over all held-out keys of its (layer,
// KV head) (softmax(q kᵀ/√d)), since the reservoir holds rows from many documents; sink/recent
// windows are not applied (the report measures the quantised tier itself).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "compile/compile.h"
#include "compile/fit.h"
#include "formats/artifact.h"
#include "formats/stats.h"

namespace kvcc {

struct HeadMetrics {
  int layer = 0, head = 0, rows = 0;
  double logit_rel = 0;   // ‖Q(K − K̂)ᵀ‖_F / ‖QKᵀ‖_F over held-out queries and keys
  double output_rel = 0;  // ‖P V − P̂ V̂‖_F / ‖P V‖_F, P = softmax(QKᵀ/√d), P̂ from K̂
  double key_rel = 0;     // ‖K − K̂‖_F / ‖K‖_F
  double value_rel = 0;   // ‖V − V̂‖_F / ‖V‖_F
};

struct MethodReport {
  std::string label;  // method name (plus any non-default option)
  Recipe recipe;
  double nominal_bits = 0, effective_bits_32k = 0, effective_bits_2k = 0;
  std::vector<HeadMetrics> heads;  // layer-major
  double compile_seconds = 0;
  HeadMetrics mean() const;                 // mean over all heads
  HeadMetrics layer_mean(int layer) const;  // mean over a layer's heads
};

struct AttentionReport {
  std::string model;  // a label for the stats (file name)
  int n_layers = 0, n_kv_heads = 0, head_dim = 0;
  std::vector<MethodReport> methods;
};

// Metrics of every KV head of one layer of an artifact on the given rows (model basis; one FitRows
// per KV head, aligned: the same tokens, select_aligned_rows), coded page by page with the layer
// codec roundtrip_layer_page, so quantiser groups spanning KV heads are evaluated as coded.
std::vector<HeadMetrics> evaluate_layer(const Artifact& artifact, int layer, const std::vector<FitRows>& rows);

// Metrics from given reconstructions kq, vq of one head's rows (evaluate_layer's second half;
// commvq, whose keys need their positions, reconstructs them itself).
HeadMetrics head_metrics(int d, int layer, int head, const std::vector<float>& query, int nq,
                         const std::vector<float>& key, const std::vector<float>& value, const std::vector<float>& kq,
                         const std::vector<float>& vq, int n);

// Compiles each option set and evaluates it on up to max_rows held-out tokens per head.
// Throws Error when the stats have no held-out reservoir rows.
AttentionReport attention_report(const Stats& stats, const std::vector<CompileOptions>& methods, int max_rows = 512,
                                 bool show_progress = false);

std::string report_table(const AttentionReport& report);  // markdown
std::string report_json(const AttentionReport& report);
std::string report_svg(const AttentionReport& report);  // per-layer logit and output error bars

}  // namespace kvcc
